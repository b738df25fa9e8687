"""Fragment words: a permutation of the decode words with zero columns up to a multiple of 16
(unstaging returns the words), and each lane's 16 contiguous words are exactly the MMA A-operand
codes the module docstring names: word ``512u + 16(4g + t) + 8r + 4s + 2h + p`` of a tile holds,
in nibble ``j``, input row ``128·tile + 32j + 16s + 8h + 2t + p`` of column ``16u + 8r + g``."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from floatxq.gptq.decode_words import stage_decode_words
from floatxq.gptq.fragment_words import stage_fragment_words, unstage_fragment_words

SHAPES = st.tuples(st.integers(0, 300), st.integers(0, 40))


@given(SHAPES, st.integers(0, 2**31 - 1))
def test_unstaging_returns_the_words(shape, seed):
    k, n = shape
    codes = torch.randint(0, 16, (k, n), generator=torch.Generator().manual_seed(seed))
    words = stage_decode_words(codes)
    frag = stage_fragment_words(words)
    assert frag.dtype == torch.int16 and frag.shape == (words.shape[0], -(-n // 16) * 16)
    assert frag.is_contiguous()
    assert torch.equal(unstage_fragment_words(frag, n), words)
    assert not bool(unstage_fragment_words(frag, frag.shape[1])[:, n:].any())  # zero padding


@given(SHAPES, st.integers(0, 2**31 - 1), st.data())
def test_each_lane_word_holds_its_operand_code(shape, seed, data):
    k, n = shape
    if k == 0 or n == 0:
        return
    codes = torch.randint(0, 16, (k, n), generator=torch.Generator().manual_seed(seed))
    frag = stage_fragment_words(stage_decode_words(codes)).to(torch.int32) & 0xFFFF
    tiles, padded = -(-k // 128), frag.shape[1]
    tile = data.draw(st.integers(0, tiles - 1))
    u = data.draw(st.integers(0, padded // 16 - 1))
    g, t, r, s, h, p, j = (data.draw(st.integers(0, b - 1)) for b in (8, 4, 2, 2, 2, 2, 4))
    flat = frag[32 * tile : 32 * tile + 32].flatten()
    word = int(flat[512 * u + 16 * (4 * g + t) + 8 * r + 4 * s + 2 * h + p])
    row, col = 128 * tile + 32 * j + 16 * s + 8 * h + 2 * t + p, 16 * u + 8 * r + g
    expected = int(codes[row, col]) if row < k and col < n else 0  # padding holds code 0
    assert (word >> (4 * j)) & 0xF == expected


def test_refusals_are_specific():
    with pytest.raises(TypeError, match="[iI]nt16"):  # (our check, or the test run's hook)
        stage_fragment_words(torch.zeros(32, 4, dtype=torch.int32))
    with pytest.raises(ValueError, match="multiple of 32"):
        stage_fragment_words(torch.zeros(31, 4, dtype=torch.int16))
    with pytest.raises(ValueError, match="fragment columns"):
        unstage_fragment_words(torch.zeros(32, 16, dtype=torch.int16), 17)
