"""GPTQ packing for 2, 4 and 8 bits: words computed by hand, v1 offsets, round trips, decoding.

The expected words below are written out from the layout (``32/bits`` fields per int32 word, the
lowest row or column in the lowest field; v1 stores ``zero - 1`` in every field), never taken
from the implementation.
"""

import pytest
import torch

import floatxq as fq
from floatxq.testing import assert_bitwise_equal

BITS = (2, 4, 8)
FORMATS = ("gptq", "gptq_v2")


def _u32(word: int) -> int:
    return word % (1 << 32)


def _inputs(bits: int, *, rows: int, out: int, groups: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    top = 1 << bits
    codes = torch.randint(0, top, (rows, out), generator=gen)
    zeros = torch.randint(0, top, (groups, out), generator=gen)
    scales = (torch.rand(groups, out, generator=gen) + 0.01).half()
    g_idx = torch.randint(0, groups, (rows,), generator=gen, dtype=torch.int32)
    return codes, zeros, scales, g_idx


def _one_column(values: list[int], bits: int, zero: int, *, format: str = "gptq_v2"):
    """``values`` down the input rows of every one of ``32/bits`` output columns."""
    per = 32 // bits
    codes = torch.tensor(values).unsqueeze(1).expand(len(values), per)
    g_idx = torch.zeros(len(values), dtype=torch.int32)
    return fq.pack_gptq(
        codes, torch.full((1, per), zero), torch.ones(1, per), g_idx, bits=bits, format=format
    )


# ------------------------------------------------------------------------------------------------
# Words by hand
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("bits", "values", "word"),
    [
        (2, [0, 1, 2, 3] * 4, 0xE4E4E4E4),  # 0b11_10_01_00 in every byte
        (2, [3] + [0] * 14 + [1], 0x40000003),
        (4, [0, 1, 2, 3, 4, 5, 6, 7], 0x76543210),
        (4, [15, 0, 0, 0, 0, 0, 0, 1], 0x1000000F),
        (8, [1, 2, 3, 4], 0x04030201),
        (8, [255, 0, 0, 128], 0x800000FF),
    ],
)
def test_qweight_words_by_hand(bits, values, word):
    packed = _one_column(values, bits, zero=1)
    assert packed.qweight.shape == (1, 32 // bits)
    assert {_u32(w) for w in packed.qweight.flatten().tolist()} == {word}
    unpacked = fq.unpack_gptq(packed, bits=bits, format="gptq_v2")
    assert unpacked.codes[:, 0].tolist() == values


@pytest.mark.parametrize(
    ("bits", "zero", "v2_word", "v1_word"),
    [
        (2, 2, 0xAAAAAAAA, 0x55555555),  # symmetric 2-bit: zero 2, v1 stores 1
        (4, 8, 0x88888888, 0x77777777),  # symmetric 4-bit: zero 8, v1 stores 7
        (8, 128, 0x80808080, 0x7F7F7F7F),  # symmetric 8-bit: zero 128, v1 stores 127
        (2, 1, 0x55555555, 0x00000000),
        (8, 1, 0x01010101, 0x00000000),
    ],
)
def test_symmetric_zero_words_per_bits_and_format(bits, zero, v2_word, v1_word):
    v2 = _one_column([0] * (32 // bits), bits, zero, format="gptq_v2")
    v1 = _one_column([0] * (32 // bits), bits, zero, format="gptq")
    assert v2.qzeros.shape == v1.qzeros.shape == (1, 1)
    assert _u32(v2.qzeros.item()) == v2_word
    assert _u32(v1.qzeros.item()) == v1_word
    for packed, format in ((v1, "gptq"), (v2, "gptq_v2")):
        assert fq.unpack_gptq(packed, bits=bits, format=format).zeros.unique().tolist() == [zero]


@pytest.mark.parametrize(
    ("bits", "zeros", "offset"),
    [
        (2, [0] * 15 + [3], 0x55555555),
        (4, [0, 9, 0, 0, 0, 0, 0, 15], 0x11111111),
        (8, [0, 5, 0, 0], 0x01010101),
    ],
)
def test_v1_zero_of_zero_borrows_and_comes_back(bits, zeros, offset):
    per = 32 // bits
    assert len(zeros) == per
    v2_word = sum(z << (bits * i) for i, z in enumerate(zeros))
    codes = torch.zeros(per, per, dtype=torch.int64)
    packed = fq.pack_gptq(
        codes,
        torch.tensor([zeros]),
        torch.ones(1, per),
        torch.zeros(per, dtype=torch.int32),
        bits=bits,
        format="gptq",
    )
    assert _u32(packed.qzeros.item()) == (v2_word - offset) % (1 << 32)
    assert fq.unpack_gptq(packed, bits=bits, format="gptq").zeros[0].tolist() == zeros


# ------------------------------------------------------------------------------------------------
# Round trips and shapes
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("format", FORMATS)
def test_round_trip_and_shapes(bits, format):
    per = 32 // bits
    rows, out, groups = 2 * per, 3 * per, 5
    codes, zeros, scales, g_idx = _inputs(bits, rows=rows, out=out, groups=groups, seed=bits)
    packed = fq.pack_gptq(codes, zeros, scales, g_idx, bits=bits, format=format)
    assert packed.qweight.shape == (rows * bits // 32, out)
    assert packed.qzeros.shape == (groups, out * bits // 32)
    assert packed.qweight.dtype == packed.qzeros.dtype == packed.g_idx.dtype == torch.int32
    assert packed.scales.dtype == torch.float16
    u = fq.unpack_gptq(packed, bits=bits, format=format)
    assert u.codes.dtype == u.zeros.dtype == torch.uint8
    assert u.codes.tolist() == codes.tolist()
    assert u.zeros.tolist() == zeros.tolist()
    assert_bitwise_equal(u.scales, scales)
    assert u.g_idx.tolist() == g_idx.tolist()


@pytest.mark.parametrize("bits", BITS)
def test_convert_format_per_bits_equals_packing_in_the_other_format(bits):
    codes, zeros, scales, g_idx = _inputs(bits, rows=32, out=32, groups=2, seed=7)
    v1 = fq.pack_gptq(codes, zeros, scales, g_idx, bits=bits, format="gptq")
    v2 = fq.pack_gptq(codes, zeros, scales, g_idx, bits=bits, format="gptq_v2")
    assert_bitwise_equal(
        fq.convert_gptq_format(v1, source="gptq", target="gptq_v2", bits=bits).qzeros, v2.qzeros
    )
    assert_bitwise_equal(
        fq.convert_gptq_format(v2, source="gptq_v2", target="gptq", bits=bits).qzeros, v1.qzeros
    )


def test_empty_rows_pack_and_decode():
    packed = fq.pack_gptq(
        torch.zeros(0, 16, dtype=torch.int64),
        torch.zeros(0, 16, dtype=torch.int64),
        torch.ones(0, 16),
        torch.zeros(0, dtype=torch.int32),
        bits=2,
    )
    assert packed.qweight.shape == (0, 16) and packed.qzeros.shape == (0, 1)
    assert fq.dequantize_gptq(packed, bits=2).shape == (16, 0)


# ------------------------------------------------------------------------------------------------
# Refusals
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("bits", [3, 5, 6, 1, 16, 0])
def test_unpackable_bits_are_refused_naming_the_packable_ones(bits):
    codes, zeros, scales, g_idx = _inputs(2, rows=96, out=96, groups=1)
    with pytest.raises(ValueError, match=rf"bits={bits} cannot be packed.*2, 4 or 8"):
        fq.pack_gptq(codes, zeros, scales, g_idx, bits=bits)
    packed = fq.pack_gptq(codes, zeros, scales, g_idx, bits=2)
    for call in (fq.unpack_gptq, fq.dequantize_gptq):
        with pytest.raises(ValueError, match="2, 4 or 8"):
            call(packed, bits=bits)
    with pytest.raises(ValueError, match="2, 4 or 8"):
        fq.convert_gptq_format(packed, source="gptq", target="gptq_v2", bits=bits)


def test_bits_of_the_wrong_kind_are_refused():
    codes, zeros, scales, g_idx = _inputs(4, rows=8, out=8, groups=1)
    with pytest.raises(TypeError, match="bits"):
        fq.pack_gptq(codes, zeros, scales, g_idx, bits=True)


@pytest.mark.parametrize(("bits", "bad"), [(2, 4), (4, 16), (8, 256), (2, -1)])
def test_codes_and_zeros_beyond_the_width_are_refused(bits, bad):
    top = (1 << bits) - 1
    codes, zeros, scales, g_idx = _inputs(bits, rows=32, out=32, groups=1)
    with pytest.raises(ValueError, match=rf"codes must lie in \[0, {top}\]"):
        fq.pack_gptq(codes.index_fill(0, torch.tensor([3]), bad), zeros, scales, g_idx, bits=bits)
    with pytest.raises(ValueError, match=rf"zeros must lie in \[0, {top}\]"):
        fq.pack_gptq(codes, zeros.index_fill(1, torch.tensor([5]), bad), scales, g_idx, bits=bits)


@pytest.mark.parametrize(("bits", "rows", "out"), [(2, 8, 16), (2, 16, 8), (8, 4, 6), (4, 12, 8)])
def test_sizes_that_do_not_fill_words_are_refused_never_padded(bits, rows, out):
    codes, zeros, scales, g_idx = _inputs(bits, rows=rows, out=out, groups=1)
    with pytest.raises(ValueError, match=f"multiples of {32 // bits}.*never pads"):
        fq.pack_gptq(codes, zeros, scales, g_idx, bits=bits)


def test_unpack_with_other_bits_than_packed_is_refused_by_shape():
    codes, zeros, scales, g_idx = _inputs(2, rows=16, out=16, groups=2)
    packed = fq.pack_gptq(codes, zeros, scales, g_idx, bits=2)  # qzeros (2, 1), g_idx (16,)
    with pytest.raises(ValueError, match="packed"):
        fq.unpack_gptq(packed, bits=4)  # expects g_idx (8,)
    with pytest.raises(ValueError, match="packed"):
        fq.dequantize_gptq(packed, bits=8)


def test_qweight_columns_that_do_not_fill_a_zero_word_are_refused():
    packed = fq.GPTQPacked(
        torch.zeros(1, 6, dtype=torch.int32),
        torch.zeros(1, 1, dtype=torch.int32),
        torch.ones(1, 6).half(),
        torch.zeros(4, dtype=torch.int32),
    )
    with pytest.raises(ValueError, match="out=6.*multiple of 4"):
        fq.unpack_gptq(packed, bits=8)


# ------------------------------------------------------------------------------------------------
# Decoding
# ------------------------------------------------------------------------------------------------


def test_dequantize_by_hand_with_desc_act_groups():
    # 8-bit, in=4, out=4; rows 0 and 2 in group 1, rows 1 and 3 in group 0 (desc_act order)
    codes = torch.tensor([[10, 0, 255, 7]] * 4)  # every row equal, columns differ
    zeros = torch.tensor([[10, 0, 0, 8], [0, 1, 128, 7]])
    scales = torch.tensor([[1.0, 2.0, 0.5, -1.0], [0.25, 3.0, 1.0, 2.0]])
    g_idx = torch.tensor([1, 0, 1, 0], dtype=torch.int32)
    packed = fq.pack_gptq(codes, zeros, scales, g_idx, bits=8, format="gptq")
    w = fq.dequantize_gptq(packed, bits=8, format="gptq")
    assert w.shape == (4, 4) and w.dtype == torch.float32
    # w[o, k] = scales[g_idx[k], o] * (codes[k, o] - zeros[g_idx[k], o])
    assert w.tolist() == [
        [2.5, 0.0, 2.5, 0.0],  # o=0: group 1: 0.25 * 10; group 0: 1 * (10 - 10)
        [-3.0, 0.0, -3.0, 0.0],  # o=1: 3 * (0 - 1); 2 * 0
        [127.0, 127.5, 127.0, 127.5],  # o=2: 1 * (255 - 128); 0.5 * 255
        [0.0, 1.0, 0.0, 1.0],  # o=3: 2 * (7 - 7); -1 * (7 - 8)
    ]


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("format", FORMATS)
def test_dequantize_is_the_exact_product_then_one_rounding(bits, format):
    codes, zeros, scales, g_idx = _inputs(bits, rows=32, out=32, groups=4, seed=3)
    scales = scales * 300  # float16 scales up to ~300: products up to ~76500 · 255
    packed = fq.pack_gptq(codes, zeros, scales, g_idx, bits=bits, format=format)
    g = g_idx.long()
    exact = packed.scales.double()[g] * (codes - zeros[g]).double()  # (in, out), float64
    w32 = fq.dequantize_gptq(packed, bits=bits, format=format)
    assert torch.equal(w32.double(), exact.T)  # exact in float32
    for dtype in (torch.bfloat16, torch.float16, torch.float64):
        w = fq.dequantize_gptq(packed, bits=bits, format=format, dtype=dtype)
        assert w.dtype == dtype and w.is_contiguous()
        assert_bitwise_equal(w, exact.T.float().to(dtype))


def test_dequantize_reads_float32_and_bfloat16_scales_as_stored():
    codes, zeros, _, g_idx = _inputs(4, rows=8, out=8, groups=1)
    for scales in (torch.full((1, 8), 1.0 + 2.0**-20), torch.full((1, 8), 3.0).bfloat16()):
        packed = fq.pack_gptq(codes, zeros, torch.ones(1, 8), g_idx, bits=4)._replace(scales=scales)
        expected = (scales.double()[g_idx.long()] * (codes - zeros[g_idx.long()]).double()).T
        assert torch.equal(fq.dequantize_gptq(packed, bits=4), expected.float())


def test_dequantize_refuses_a_non_floating_dtype_and_does_not_mutate():
    codes, zeros, scales, g_idx = _inputs(4, rows=8, out=8, groups=1)
    packed = fq.pack_gptq(codes, zeros, scales, g_idx, bits=4)
    before = [t.clone() for t in packed]
    with pytest.raises(TypeError, match="dtype must be a floating"):
        fq.dequantize_gptq(packed, bits=4, dtype=torch.int32)
    fq.dequantize_gptq(packed, bits=4, dtype=torch.bfloat16)
    for t, b in zip(packed, before, strict=True):
        assert_bitwise_equal(t, b)


def test_dequantize_refuses_what_pack_refuses():
    codes, zeros, scales, g_idx = _inputs(4, rows=8, out=8, groups=2)
    packed = fq.pack_gptq(codes, zeros, scales, g_idx, bits=4)
    with pytest.raises(ValueError, match=r"g_idx must lie in \[0, 1\]"):
        fq.dequantize_gptq(packed._replace(g_idx=packed.g_idx + 2), bits=4)
    with pytest.raises(ValueError, match="NaN or infinity"):
        fq.dequantize_gptq(packed._replace(scales=packed.scales * torch.inf), bits=4)
    with pytest.raises(ValueError, match="not a GPTQ packing format"):
        fq.dequantize_gptq(packed, bits=4, format="gptq_v3")
