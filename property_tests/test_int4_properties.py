"""Properties of GPTQ INT4 packing, centering and staging (SPEC §5)."""

import torch
from hypothesis import example, given
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import floatxq.int4 as fq
from floatxq.formats import E2M1_VALUES
from floatxq.testing import assert_bitwise_equal

FORMATS = st.sampled_from(["gptq", "gptq_v2"])


def _ints(shape, low, high):
    return hnp.arrays("int64", shape, elements=st.integers(low, high)).map(torch.from_numpy)


@st.composite
def gptq_records(draw, *, zeros=None):
    """``(codes (in, out), zeros (groups, out), scales fp16-exact, g_idx (in,))``."""
    rows = 8 * draw(st.integers(1, 6))
    out = 8 * draw(st.integers(1, 4))
    groups = draw(st.integers(1, rows))
    codes = draw(_ints((rows, out), 0, 15))
    zero = draw(_ints((groups, out), 0, 15)) if zeros is None else torch.full((groups, out), zeros)
    scales = draw(
        hnp.arrays(
            "float16",
            (groups, out),
            elements=st.floats(-65504, 65504, width=16, allow_nan=False, allow_infinity=False),
        ).map(torch.from_numpy)
    )
    g_idx = draw(_ints((rows,), 0, groups - 1))
    dtype = draw(st.sampled_from([torch.uint8, torch.int16, torch.int32, torch.int64]))
    return codes.to(dtype), zero.to(dtype), scales, g_idx.to(torch.int32)


@given(gptq_records(), FORMATS)
@example(
    (
        torch.full((8, 8), 15),
        torch.zeros(1, 8, dtype=torch.int64),
        torch.ones(1, 8).half(),
        torch.zeros(8, dtype=torch.int32),
    ),
    "gptq",
)
def test_pack_unpack_round_trip(record, format):
    codes, zeros, scales, g_idx = record
    packed = fq.pack_gptq_int4(codes, zeros, scales, g_idx, format=format)
    assert packed.qweight.shape == (codes.shape[0] // 8, codes.shape[1])
    assert packed.qzeros.shape == (zeros.shape[0], zeros.shape[1] // 8)
    back = fq.unpack_gptq_int4(packed, format=format)
    assert torch.equal(back.codes.to(torch.int64), codes.to(torch.int64))
    assert torch.equal(back.zeros.to(torch.int64), zeros.to(torch.int64))
    assert_bitwise_equal(back.scales, scales)
    assert_bitwise_equal(back.g_idx, g_idx)
    # packing what unpack returns gives the same words again
    again = fq.pack_gptq_int4(*back, format=format)
    for a, b in zip(again, packed, strict=True):
        assert_bitwise_equal(a, b)


@given(gptq_records(), FORMATS, FORMATS)
def test_convert_is_packing_in_the_other_format(record, source, target):
    src = fq.pack_gptq_int4(*record, format=source)
    got = fq.convert_gptq_format(src, source=source, target=target)
    for a, b in zip(got, fq.pack_gptq_int4(*record, format=target), strict=True):
        assert_bitwise_equal(a, b)
    back = fq.convert_gptq_format(got, source=target, target=source)
    assert_bitwise_equal(back.qzeros, src.qzeros)


@given(st.integers(1, 2), st.integers(1, 3), st.data(), FORMATS)
def test_centered_of_a_symmetric_g128_checkpoint_is_code_minus_eight(groups, n, data, format):
    rows, out = 128 * groups, 8 * n
    codes = data.draw(_ints((rows, out), 0, 15))
    packed = fq.pack_gptq_int4(
        codes,
        torch.full((groups, out), 8),
        torch.ones(groups, out),
        torch.arange(rows, dtype=torch.int32) // 128,
        format=format,
    )
    centered = fq.centered_int4(packed, format=format)
    assert torch.equal(centered.to(torch.int64), codes - 8)


CENTERED_DTYPES = st.sampled_from([torch.int8, torch.int16, torch.int32, torch.int64])


@given(hnp.array_shapes(min_dims=0, max_dims=3, max_side=6), st.data(), CENTERED_DTYPES)
def test_planes_recombine_exactly_and_stay_in_range(shape, data, dtype):
    c = data.draw(_ints(shape, -8, 7)).to(dtype)
    low, high = fq.split_int4_planes(c)
    assert low.shape == c.shape and high.dtype == dtype
    assert bool(((low >= -2) & (low <= 1)).all()) and bool(((high >= -2) & (high <= 2)).all())
    assert torch.equal(fq.merge_int4_planes(low, high), c)
    # high is the floor of (c + 2) / 4: Python's // on ints is floor division
    assert high.flatten().tolist() == [(v + 2) // 4 for v in c.flatten().tolist()]


def _decode(byte: int, position: int) -> float:
    nibble = (byte >> (4 * position)) & 0xF
    value = E2M1_VALUES[nibble & 7]
    return -value if nibble & 8 else value


@given(st.integers(1, 4), st.integers(1, 5), st.data())
def test_e2m1_planes_decode_to_the_centered_values(half_k, n, data):
    c = data.draw(_ints((2 * half_k, n), -8, 7)).to(torch.int16)
    staged = fq.int4_planes_to_e2m1(*fq.split_int4_planes(c))
    assert staged.low.shape == (half_k, n) and staged.high.dtype == torch.uint8
    for k in range(2 * half_k):
        for j in range(n):
            lo = _decode(int(staged.low[k // 2, j]), k % 2)
            hi = _decode(int(staged.high[k // 2, j]), k % 2)
            assert lo + 4 * hi == float(c[k, j])
    assert_bitwise_equal(fq.int4_to_e4m3(c).float(), c.float())
