"""Properties of GPTQ INT4 packing, format conversion, centering and the W4A operand staging.

Every tensor is built from Hypothesis draws (``floatxq.testing.strategies``), so a failure shrinks
to a small example; counterexamples are pinned with ``@example``.
"""

import ml_dtypes
import numpy as np
import torch
from hypothesis import example, given
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import floatxq as fq
from floatxq.formats import E2M1_VALUES
from floatxq.testing import assert_bitwise_equal
from floatxq.testing.strategies import (
    GPTQ_FORMAT_NAMES,
    GPTQRecord,
    gptq_packed,
    gptq_records,
    int_arrays,
)

FORMATS = st.sampled_from(GPTQ_FORMAT_NAMES)
INT_DTYPES = st.sampled_from([torch.int8, torch.int16, torch.int32, torch.int64])
SHAPES = hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=6)
NONEMPTY_SHAPES = hnp.array_shapes(min_dims=0, max_dims=3, min_side=1, max_side=6)

ALL_FIFTEEN = GPTQRecord(
    torch.full((8, 8), 15),
    torch.zeros(1, 8, dtype=torch.int64),  # zero point 0: v1 cannot store it, it borrows
    torch.ones(1, 8).half(),
    torch.zeros(8, dtype=torch.int32),
)
V2_ZERO_WORDS = fq.GPTQPacked(
    torch.full((1, 16), -1, dtype=torch.int32),
    torch.tensor([[0, -(2**31)]], dtype=torch.int32),
    torch.ones(1, 16).half(),
    torch.zeros(8, dtype=torch.int32),
)


def _u32(word: int) -> int:
    return word % (1 << 32)


def _i32(word: int) -> int:
    word %= 1 << 32
    return word - (1 << 32) if word >= 1 << 31 else word


# ------------------------------------------------------------------------------------------------
# Packing and formats
# ------------------------------------------------------------------------------------------------


@given(gptq_records(), FORMATS)
@example(ALL_FIFTEEN, "gptq")
def test_pack_then_unpack_is_the_identity(record, format):
    packed = fq.pack_gptq(*record, format=format)
    rows, out = record.codes.shape
    assert packed.qweight.shape == (rows // 8, out) and packed.qweight.dtype == torch.int32
    assert packed.qzeros.shape == (record.zeros.shape[0], out // 8)
    back = fq.unpack_gptq(packed, format=format)
    assert torch.equal(back.codes.to(torch.int64), record.codes.to(torch.int64))
    assert torch.equal(back.zeros.to(torch.int64), record.zeros.to(torch.int64))
    assert_bitwise_equal(back.scales, record.scales)
    assert_bitwise_equal(back.g_idx, record.g_idx)


@given(gptq_packed(), FORMATS)
@example(V2_ZERO_WORDS, "gptq")
def test_unpack_then_pack_is_the_identity_on_any_words(packed, format):
    """Every int32 word is some codes' packing: with the test above, packing is a bijection."""
    again = fq.pack_gptq(*fq.unpack_gptq(packed, format=format), format=format)
    for got, want in zip(again, packed, strict=True):
        assert_bitwise_equal(got, want)


@given(gptq_packed(), st.data())
def test_words_hold_the_codes_lowest_row_in_the_lowest_nibble(packed, data):
    """``code[k, n] = (qweight[k // 8, n] >> 4 * (k % 8)) & 15``, read with Python integers."""
    u = fq.unpack_gptq(packed, format="gptq_v2")
    k = data.draw(st.integers(0, u.codes.shape[0] - 1))
    n = data.draw(st.integers(0, u.codes.shape[1] - 1))
    assert int(u.codes[k, n]) == (_u32(int(packed.qweight[k // 8, n])) >> 4 * (k % 8)) & 15
    g = data.draw(st.integers(0, u.zeros.shape[0] - 1))
    assert int(u.zeros[g, n]) == (_u32(int(packed.qzeros[g, n // 8])) >> 4 * (n % 8)) & 15


@given(gptq_packed(), FORMATS, FORMATS)
@example(V2_ZERO_WORDS, "gptq_v2", "gptq")
def test_format_conversion_is_word_arithmetic_and_exact(packed, source, target):
    """v2 → v1 subtracts 0x11111111 from each zero word modulo 2**32 (v1 → v2 adds it); the
    logical zero points and every other tensor are unchanged, and converting back restores all."""
    got = fq.convert_gptq_format(packed, source=source, target=target)
    delta = {("gptq_v2", "gptq"): -0x11111111, ("gptq", "gptq_v2"): 0x11111111}
    expected = [
        [_i32(int(w) + delta.get((source, target), 0)) for w in row]
        for row in packed.qzeros.tolist()
    ]
    assert got.qzeros.tolist() == expected
    for name in ("qweight", "scales", "g_idx"):
        assert_bitwise_equal(getattr(got, name), getattr(packed, name))
    before = fq.unpack_gptq(packed, format=source)
    after = fq.unpack_gptq(got, format=target)
    assert_bitwise_equal(after.zeros, before.zeros)
    back = fq.convert_gptq_format(got, source=target, target=source)
    for a, b in zip(back, packed, strict=True):
        assert_bitwise_equal(a, b)


@given(gptq_records(), FORMATS, FORMATS)
def test_conversion_equals_packing_in_the_other_format(record, source, target):
    src = fq.pack_gptq(*record, format=source)
    got = fq.convert_gptq_format(src, source=source, target=target)
    for a, b in zip(got, fq.pack_gptq(*record, format=target), strict=True):
        assert_bitwise_equal(a, b)


@given(gptq_records(dtypes=(torch.int64,)), st.data())
def test_pack_rejects_a_code_outside_0_15(record, data):
    codes = record.codes.clone()
    k = data.draw(st.integers(0, codes.shape[0] - 1))
    n = data.draw(st.integers(0, codes.shape[1] - 1))
    codes[k, n] = data.draw(st.one_of(st.integers(-(2**40), -1), st.integers(16, 2**40)))
    try:
        fq.pack_gptq(codes, record.zeros, record.scales, record.g_idx)
    except ValueError as err:
        assert "codes must lie in [0, 15]" in str(err) and str(int(codes[k, n])) in str(err)
    else:
        raise AssertionError(f"code {int(codes[k, n])} was packed")


# ------------------------------------------------------------------------------------------------
# Centering
# ------------------------------------------------------------------------------------------------


@given(st.integers(1, 2), st.integers(1, 3), st.data(), FORMATS)
def test_centered_of_a_symmetric_g128_checkpoint_is_code_minus_eight(groups, n, data, format):
    rows, out = 128 * groups, 8 * n
    codes = data.draw(int_arrays((rows, out), 0, 15))
    packed = fq.pack_gptq(
        codes,
        torch.full((groups, out), 8),
        torch.ones(groups, out),
        torch.arange(rows, dtype=torch.int32) // 128,
        format=format,
    )
    centered = fq.centered_int4(packed, format=format)
    assert centered.dtype == torch.int16
    assert torch.equal(centered.to(torch.int64), codes - 8)
    # an asymmetric zero point anywhere is refused, naming where it is
    g, col = data.draw(st.integers(0, groups - 1)), data.draw(st.integers(0, out - 1))
    zero = data.draw(st.sampled_from([z for z in range(16) if z != 8]))
    zeros = torch.full((groups, out), 8)
    zeros[g, col] = zero
    bad = fq.pack_gptq(codes, zeros, torch.ones(groups, out), packed.g_idx, format=format)
    try:
        fq.centered_int4(bad, format=format)
    except ValueError as err:
        assert f"group {g}, output column {col} has zero point {zero}" in str(err)
    else:
        raise AssertionError("an asymmetric zero point was accepted")


# ------------------------------------------------------------------------------------------------
# Planes and staging
# ------------------------------------------------------------------------------------------------


@given(SHAPES, st.data(), INT_DTYPES)
def test_split_then_merge_is_the_identity_and_planes_stay_in_range(shape, data, dtype):
    c = data.draw(int_arrays(shape, -8, 7, dtype=dtype))
    low, high = fq.split_int4_planes(c)
    assert low.shape == c.shape and low.dtype == dtype and high.dtype == dtype
    assert bool(((low >= -2) & (low <= 1)).all()) and bool(((high >= -2) & (high <= 2)).all())
    assert torch.equal(fq.merge_int4_planes(low, high), c)
    # high is the floor of (c + 2) / 4: Python's // on ints is floor division
    assert high.flatten().tolist() == [(v + 2) // 4 for v in c.flatten().tolist()]


@st.composite
def plane_pairs(draw):
    """``(low, high)`` of one shape with each plane in its own range, any pair of them."""
    shape = draw(SHAPES)
    return draw(int_arrays(shape, -2, 1)), draw(int_arrays(shape, -2, 2))


@given(plane_pairs())
@example((torch.tensor([1]), torch.tensor([2])))
def test_merge_accepts_exactly_the_pairs_split_produces(pair):
    """``merge(low, high)`` is ``low + 4 * high`` when that lies in ``-8..7`` and refused when not
    (``(1, 2)`` gives 9): merge is the inverse of split and accepts nothing else."""
    low, high = pair
    merged = low + 4 * high
    if bool(((merged >= -8) & (merged <= 7)).all()):
        assert torch.equal(fq.merge_int4_planes(low, high), merged)
        assert torch.equal(torch.stack(fq.split_int4_planes(merged)), torch.stack((low, high)))
        return
    try:
        fq.merge_int4_planes(low, high)
    except ValueError as err:
        assert "low + 4 * high" in str(err)
    else:
        raise AssertionError("a pair outside split's image was merged")


def _decode_e2m1(byte: int, position: int) -> float:
    nibble = (byte >> (4 * position)) & 0xF
    value = E2M1_VALUES[nibble & 7]
    return -value if nibble & 8 else value


@given(st.integers(1, 4), st.integers(1, 5), st.data())
def test_e2m1_planes_decode_to_the_centered_values(half_k, n, data):
    c = data.draw(int_arrays((2 * half_k, n), -8, 7, dtype=torch.int16))
    staged = fq.int4_planes_to_e2m1(*fq.split_int4_planes(c))
    assert staged.low.shape == (half_k, n) and staged.high.dtype == torch.uint8
    for k in range(2 * half_k):
        for j in range(n):
            lo = _decode_e2m1(int(staged.low[k // 2, j]), k % 2)
            hi = _decode_e2m1(int(staged.high[k // 2, j]), k % 2)
            assert lo + 4 * hi == float(c[k, j])


@given(SHAPES, st.data(), INT_DTYPES)
def test_int4_to_e4m3_is_exact(shape, data, dtype):
    """Every centered value is staged as the E4M3 code ml_dtypes gives that integer."""
    c = data.draw(int_arrays(shape, -8, 7, dtype=dtype))
    staged = fq.int4_to_e4m3(c)
    expected = c.numpy().astype(np.float32).astype(ml_dtypes.float8_e4m3fn).view(np.uint8)
    assert_bitwise_equal(staged.view(torch.uint8), torch.from_numpy(np.array(expected)))
    assert torch.equal(staged.float(), c.float())


@given(NONEMPTY_SHAPES, st.data(), INT_DTYPES)
def test_staging_rejects_values_outside_minus_8_to_7(shape, data, dtype):
    c = data.draw(int_arrays(shape, -8, 7, dtype=dtype)).clone()
    info = torch.iinfo(dtype)
    bad = data.draw(st.one_of(st.integers(info.min, -9), st.integers(8, info.max)))
    c.view(-1)[data.draw(st.integers(0, c.numel() - 1))] = bad
    for fn in (fq.int4_to_e4m3, fq.split_int4_planes):
        try:
            fn(c)
        except ValueError as err:
            assert "must lie in [-8, 7]" in str(err)
        else:
            raise AssertionError(f"{fn.__name__} accepted {bad}")
