"""Decode words: the staging is a permutation of nibbles (unstaging returns the codes, and
nibble ``j`` of word ``(32t + r, n)`` is the code of row ``128t + 32j + r``), and a scale split
reproduces the reference decode ``round(float32(scale) · d)`` for every ``d`` a 4-bit code and
zero point make, whenever :func:`split_scales` returns one."""

import torch
from hypothesis import given
from hypothesis import strategies as st

from floatxq.gptq.decode_words import (
    gptq_decode_operands,
    split_scales,
    stage_decode_words,
    unstage_decode_words,
)
from floatxq.gptq.int4 import pack_gptq

SHAPES = st.tuples(st.integers(0, 300), st.integers(0, 9))
HALF = st.sampled_from([torch.float16, torch.bfloat16])
SCALE_DTYPES = st.sampled_from([torch.float16, torch.bfloat16, torch.float32])


@given(SHAPES, st.integers(0, 2**31 - 1))
def test_unstaging_returns_the_codes(shape, seed):
    k, n = shape
    codes = torch.randint(0, 16, (k, n), generator=torch.Generator().manual_seed(seed))
    words = stage_decode_words(codes)
    assert words.dtype == torch.int16 and words.shape == (-(-k // 128) * 32, n)
    assert torch.equal(unstage_decode_words(words, k), codes.to(torch.uint8))


@given(SHAPES, st.integers(0, 2**31 - 1), st.data())
def test_each_nibble_holds_its_row(shape, seed, data):
    k, n = shape
    if k == 0 or n == 0:
        return
    codes = torch.randint(0, 16, (k, n), generator=torch.Generator().manual_seed(seed))
    words = stage_decode_words(codes).to(torch.int32) & 0xFFFF
    row = data.draw(st.integers(0, -(-k // 128) * 128 - 1))
    col = data.draw(st.integers(0, n - 1))
    t, j, r = row // 128, (row % 128) // 32, row % 32
    nibble = (int(words[32 * t + r, col]) >> (4 * j)) & 0xF
    assert nibble == (int(codes[row, col]) if row < k else 0)  # rows past k hold code 0


def _fma_round(d: int, hi: torch.Tensor, lo: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """What the packed decode computes: ``p = round(d · lo)``, then ``round(d · hi + p)`` (the
    sum exact in float32 for these magnitudes)."""
    p = (lo.float() * d).to(dtype).float()
    return (hi.float() * d + p).to(dtype)


@given(st.integers(0, 2**31 - 1), SCALE_DTYPES, HALF, st.integers(-24, 12))
def test_a_split_reproduces_the_reference_decode(seed, scales_dtype, dtype, binade):
    g = torch.Generator().manual_seed(seed)
    scales = ((torch.rand(3, 5, generator=g) + 0.5) * 2.0**binade).to(scales_dtype)
    split = split_scales(scales, dtype)
    if split is None:  # refused: only ever across dtypes
        assert scales_dtype != dtype
        return
    assert torch.equal(split.hi.float() + split.lo.float(), scales.float())
    for d in range(-16, 16):
        reference = (scales.float() * d).to(dtype)
        assert torch.equal(_fma_round(d, split.hi, split.lo, dtype), reference), d


@given(st.integers(0, 2**31 - 1), HALF)
def test_same_dtype_scales_always_split_with_zero_remainder(seed, dtype):
    scales = (torch.rand(4, 4, generator=torch.Generator().manual_seed(seed)) + 0.01).to(dtype)
    split = split_scales(scales, dtype)
    assert split is not None and torch.equal(split.hi, scales)
    assert not bool(split.lo.any())


@given(st.integers(1, 3), st.integers(1, 3), st.integers(0, 2**31 - 1))
def test_operands_reuse_given_words_and_stage_the_same_ones(tiles, blocks, seed):
    """Words staged for one dtype serve the other as they are (``words=``), and equal what
    staging would make; the zero points and scale parts are those of the dtype asked for."""
    g = torch.Generator().manual_seed(seed)
    k, n = 128 * tiles, 8 * blocks  # (the GPTQ words hold 8 codes)
    codes = torch.randint(0, 16, (k, n), generator=g)
    zeros = torch.randint(1, 16, (tiles, n), generator=g)
    scales = torch.rand(tiles, n, generator=g) * 0.02 + 0.001
    packed = pack_gptq(codes, zeros, scales, (torch.arange(k) // 128).to(torch.int32))
    packed = packed._replace(scales=packed.scales.half())
    first, _ = gptq_decode_operands(packed, group_size=128, dtype=torch.float16)
    again, _ = gptq_decode_operands(packed, group_size=128, dtype=torch.bfloat16, words=first.words)
    assert again.words is first.words
    assert torch.equal(first.words, stage_decode_words(codes))
    split = split_scales(packed.scales, torch.bfloat16)
    assert torch.equal(again.hi, split.hi) and torch.equal(again.lo, split.lo)
    assert torch.equal(again.zeros, first.zeros)
