"""Properties of FP8 casts, weights and tokens: the contract of ``docs/numerics.md`` as invariants.

Every tensor is built from Hypothesis draws (``floatxq.testing.strategies``), so a failure shrinks
to a small example, and every counterexample found so far is pinned with ``@example``.
"""

import math

import numpy as np
import torch
from hypothesis import example, given
from hypothesis import strategies as st

import floatxq as fq
from floatxq.testing import assert_bitwise_equal, bits_of
from floatxq.testing.reference import ml_encode, ref_quantize_fp8_weight
from floatxq.testing.strategies import (
    FP8_ENCODABLE,
    FP8WeightCase,
    f32_values,
    fp8_layouts,
    fp8_weight_cases,
    matrices,
    power_of_two_exponents,
    spread_matrices,
    token_batches,
)

FORMATS = st.sampled_from(FP8_ENCODABLE)
NON_FINITE = st.sampled_from([math.nan, math.inf, -math.inf])

# Values that stay normal FP32 through any x * 2**e with |e| <= 20 (and through the scales).
SCALABLE = f32_values(min_magnitude=2.0**-60, max_magnitude=2.0**60)

ZERO_ROW_TINY = torch.tensor([[0.0, 0.0, 0.0, 1.1754944e-38]])
DENORMAL_ONLY = torch.tensor([[1e-45, -1e-40, 0.0, 2.0**-149]])
FLT_MAX_ROW = torch.tensor([[3.4028235e38, -3.4028235e38, 1.0]])

_MANTISSA_BITS = {"float8_e4m3fn": 3, "float8_e5m2": 2, "float8_e4m3fnuz": 3, "float8_e5m2fnuz": 2}


def _quantize(case: FP8WeightCase, weight: torch.Tensor | None = None) -> fq.FP8Weight:
    return fq.quantize_fp8_weight(
        case.weight if weight is None else weight,
        format=case.format,
        weight_scale_method=case.method,
        weight_block_size=case.block,
    )


def _tile(case: FP8WeightCase) -> tuple[int, int]:
    """The region of one scale: the whole weight, one row, or one block."""
    rows, cols = case.weight.shape
    return {"tensor": (rows, cols), "row": (1, cols), "block": case.block}[case.method]


def _regions(case: FP8WeightCase):
    """``(scale index, row slice, column slice)`` of every region, in the scale grid's order."""
    rows, cols = case.weight.shape
    br, bc = _tile(case)
    for i in range(rows // br):
        for j in range(cols // bc):
            index = {"tensor": (), "row": (i,), "block": (i, j)}[case.method]
            yield index, slice(i * br, (i + 1) * br), slice(j * bc, (j + 1) * bc)


def _expanded(scale_inv: torch.Tensor, case: FP8WeightCase) -> torch.Tensor:
    """The inverse scale of every element, region by region (no layout inference involved)."""
    out = torch.empty(case.weight.shape, dtype=torch.float32)
    for index, rs, cs in _regions(case):
        out[rs, cs] = scale_inv[index]
    return out


def _smallest_subnormal(name: str) -> float:
    return fq.fp8_decode(torch.tensor([1], dtype=torch.uint8).view(fq.fp8_dtype(name))).item()


@st.composite
def spread_cases(draw):
    """FP8 weight cases whose rows differ in magnitude by up to 2**±60 (regions must not mix)."""
    method, block = draw(fp8_layouts())
    weight = draw(spread_matrices(block=block or (1, 1), max_blocks=(4, 4)))
    return FP8WeightCase(draw(FORMATS), method, block, weight)


# ------------------------------------------------------------------------------------------------
# Element casts
# ------------------------------------------------------------------------------------------------


@given(st.lists(f32_values(finite=False), min_size=1, max_size=16), FORMATS)
@example([464.0, -464.0, 480.0, 3 * 2.0**-10, -(2.0**-10), -0.0], "float8_e4m3fn")
@example([math.inf, -math.inf, math.nan, 3.4028235e38, -0.0], "float8_e5m2fnuz")
def test_fp8_cast_is_clamp_then_nearest_even(values, name):
    """``fp8_cast`` equals ml_dtypes' nearest-even rounding of the value clamped to ±max."""
    x = torch.tensor(values, dtype=torch.float32)
    got = fq.fp8_cast(x, format=name)
    assert got.dtype == fq.fp8_dtype(name) and got.shape == x.shape
    nan = x.isnan()
    expected = torch.from_numpy(ml_encode(x.numpy(), name))
    assert_bitwise_equal(bits_of(got)[~nan], expected[~nan])
    assert bool(fq.fp8_decode(got)[nan].isnan().all()), "NaN stays NaN"


# ------------------------------------------------------------------------------------------------
# Weights
# ------------------------------------------------------------------------------------------------


@given(fp8_weight_cases(max_blocks=(2, 3), max_shape=(6, 8)))  # the oracle loops in Python
@example(FP8WeightCase("float8_e4m3fn", "row", None, ZERO_ROW_TINY))
@example(FP8WeightCase("float8_e4m3fn", "tensor", None, DENORMAL_ONLY))
@example(FP8WeightCase("float8_e5m2", "block", (1, 4), torch.zeros(1, 4)))
@example(FP8WeightCase("float8_e4m3fnuz", "block", (1, 3), FLT_MAX_ROW))
def test_weight_matches_the_independent_oracle(case):
    """Codes and scales equal a region-by-region numpy/ml_dtypes oracle, bit for bit."""
    q = _quantize(case)
    codes, scale_inv = ref_quantize_fp8_weight(
        case.weight, name=case.format, method=case.method, block=case.block
    )
    assert_bitwise_equal(q.qweight, codes, msg="codes")
    assert_bitwise_equal(q.scale_inv, scale_inv, msg="scale_inv")
    # what the oracle's formula promises: finite positive scales, no NaN code, |code| <= max
    assert bool(torch.isfinite(q.scale_inv).all()) and bool((q.scale_inv > 0).all())
    decoded = fq.fp8_decode(q.qweight)
    assert not bool(decoded.isnan().any())
    assert bool((decoded.abs() <= fq.fp8_max(case.format)).all())
    for index, rs, cs in _regions(case):  # an all-zero region keeps scale_inv 1
        if not bool((case.weight[rs, cs] != 0).any()):
            assert q.scale_inv[index].item() == 1.0


@given(fp8_weight_cases())
@example(FP8WeightCase("float8_e4m3fn", "row", None, DENORMAL_ONLY))
def test_weight_decodes_within_half_a_code_step(case):
    """``|dequantize - w|`` is at most half a step of the FP8 grid, divided by ``scale_inv``."""
    q = _quantize(case)
    back = fq.dequantize_fp8_weight(*q)
    s = _expanded(q.scale_inv, case)
    # the decode is codes / scale_inv of each element's own region: layout inference agrees
    assert_bitwise_equal(back, fq.fp8_decode(q.qweight) / s)
    assert_bitwise_equal(fq.dequantize_fp8_weight_transposed(*q), back.t().contiguous())
    w, sd = case.weight.double(), s.double()
    # FP8 rounding of y = w * s: a relative half-step in the normal range, half the smallest
    # subnormal below it; divided back by s, plus the FP32 roundings of the product and of the
    # quotient and the FP32 subnormal floor of the decoded value.
    half_step = torch.maximum(
        (w * sd).abs() * 2.0 ** -(_MANTISSA_BITS[case.format] + 1),
        torch.full_like(w, _smallest_subnormal(case.format) / 2),
    )
    bound = half_step / sd * (1 + 2.0**-20) + w.abs() * 2.0**-22 + 2.0**-149
    err = (back.double() - w).abs()
    assert bool((err <= bound).all()), float((err - bound).max())


@given(fp8_weight_cases())
@example(FP8WeightCase("float8_e5m2", "tensor", None, DENORMAL_ONLY))
@example(FP8WeightCase("float8_e4m3fn", "row", None, FLT_MAX_ROW))
def test_requantizing_the_decoded_weight_gives_the_same_codes(case):
    """quantize → dequantize → quantize is the identity on codes (the decode lies on the grid)."""
    q = _quantize(case)
    again = _quantize(case, fq.dequantize_fp8_weight(*q))
    assert_bitwise_equal(again.qweight, q.qweight)


@given(fp8_weight_cases(elements=SCALABLE), power_of_two_exponents())
@example(FP8WeightCase("float8_e4m3fnuz", "tensor", None, torch.tensor([[240.0]])), 1)
def test_weight_power_of_two_scaling_passes_through_bitwise(case, e):
    """Scaling ``w`` by ``2**e`` keeps every code and divides every nonzero region's scale."""
    base = _quantize(case)
    scaled = _quantize(case, case.weight * 2.0**e)
    assert_bitwise_equal(scaled.qweight, base.qweight)
    expected = base.scale_inv.clone()
    for index, rs, cs in _regions(case):
        if bool((case.weight[rs, cs] != 0).any()):  # an all-zero region keeps scale_inv 1
            expected[index] = base.scale_inv[index] * 2.0**-e
    assert_bitwise_equal(scaled.scale_inv, expected)


@given(st.one_of(fp8_weight_cases(), spread_cases()))
def test_each_region_quantizes_as_if_alone(case):
    """A row or block gets the codes and scale it gets quantized alone: regions never interact."""
    q = _quantize(case)
    for index, rs, cs in _regions(case):
        alone = fq.quantize_fp8_weight(
            case.weight[rs, cs], format=case.format, weight_scale_method="tensor"
        )
        assert_bitwise_equal(alone.qweight, q.qweight[rs, cs])
        assert_bitwise_equal(alone.scale_inv, q.scale_inv[index])


@given(fp8_weight_cases())
def test_weight_input_not_mutated(case):
    before = case.weight.clone()
    _quantize(case)
    assert_bitwise_equal(case.weight, before)


@given(fp8_weight_cases(), NON_FINITE, st.data())
def test_weight_non_finite_rejected(case, bad, data):
    w = case.weight.clone()
    row = data.draw(st.integers(0, w.shape[0] - 1))
    col = data.draw(st.integers(0, w.shape[1] - 1))
    w[row, col] = bad
    try:
        _quantize(case, w)
    except ValueError as err:
        assert "NaN or infinity" in str(err) and "quantize_fp8_weight" in str(err)
    else:
        raise AssertionError("non-finite weight was accepted")


@given(st.lists(f32_values(), min_size=1, max_size=8))
@example([0.0, 1e-40, 2.0**-149, 3.4028235e38])
def test_direct_scales_invert_by_one_fp32_division(values):
    """``scale_inv = 1 / scale`` (FP32 division); zero maps to ``1 / FLT_MIN``; a scale whose
    inverse would overflow, or a negative one, is refused."""
    s = torch.tensor(values, dtype=torch.float32)
    tiny, fmax = np.float32(np.finfo(np.float32).tiny), np.float32(np.finfo(np.float32).max)
    a = s.numpy()
    if bool((a < 0).any()) or bool(((a > 0) & (a < np.float32(1) / fmax)).any()):
        try:
            fq.direct_to_inverse_scale(s)
        except ValueError as err:
            assert "direct_to_inverse_scale" in str(err)
        else:
            raise AssertionError(f"direct scales {values} were accepted")
        return
    with np.errstate(divide="ignore"):
        expected = np.where(a == 0, np.float32(1) / tiny, np.float32(1) / a).astype(np.float32)
    assert_bitwise_equal(fq.direct_to_inverse_scale(s), torch.from_numpy(expected))


def test_scale_is_one_fp32_division_not_a_reciprocal_multiply():
    """Pins the scale arithmetic to one IEEE FP32 division (no reciprocal-multiply)."""
    amax = np.float32(np.nextafter(np.float32(3.0), np.float32(4.0)))
    w = torch.tensor([[float(amax), 1.0]])
    q = fq.quantize_fp8_weight(w)
    assert q.scale_inv.item() == float(np.float32(448.0) / amax)


# ------------------------------------------------------------------------------------------------
# Tokens
# ------------------------------------------------------------------------------------------------


@given(token_batches())
@example(ZERO_ROW_TINY)
@example(FLT_MAX_ROW)
@example(torch.tensor([[2.0**-149, 0.0], [1e-38, -1e-45]]))
@example(torch.tensor([[13.0, 0.01904296875]]))  # x / scale is an E4M3 tie: division, not 1/s
def test_token_codes_are_the_cast_of_x_over_the_row_scale(x):
    """``scale = amax / 448`` per row (1 for a zero row, 2**-149 where it underflows) and
    ``codes = fp8_cast(x / scale)`` element by element; the QDQ decodes exactly those codes."""
    t = fq.fp8_token_quantize(x)
    x32 = x.float()
    amax = x32.abs().amax(dim=-1, keepdim=True).numpy()
    with np.errstate(under="ignore"):
        ratio = (amax / np.float32(448.0)).astype(np.float32)
    scale = np.where(amax > 0, np.maximum(ratio, np.float32(2.0**-149)), np.float32(1.0))
    assert_bitwise_equal(t.scale, torch.from_numpy(scale.astype(np.float32)))
    assert_bitwise_equal(t.codes, fq.fp8_cast(x32 / t.scale, format="e4m3"))
    y = fq.fp8_token_qdq(x)
    assert_bitwise_equal(y, fq.fp8_token_dequantize(*t, dtype=x.dtype))
    assert bool(torch.isfinite(y).all())
    assert bool((torch.sign(y) * torch.sign(x) >= 0).all()), "a sign flipped"
    assert_bitwise_equal(y[x == 0], x[x == 0])  # zeros stay zeros, with their sign


@given(token_batches(), st.data())
def test_token_rows_are_independent(x, data):
    """Permuting rows, taking one row alone, or adding batch axes changes nothing per row."""
    y = fq.fp8_token_qdq(x)
    perm = torch.tensor(data.draw(st.permutations(range(x.shape[0]))), dtype=torch.int64)
    assert_bitwise_equal(fq.fp8_token_qdq(x[perm]), y[perm])
    i = data.draw(st.integers(0, x.shape[0] - 1))
    assert_bitwise_equal(fq.fp8_token_qdq(x[i : i + 1]), y[i : i + 1])
    rows, k = x.shape
    t = fq.fp8_token_quantize(x.reshape(1, rows, 1, k))
    flat = fq.fp8_token_quantize(x)
    assert_bitwise_equal(t.codes, flat.codes.reshape(1, rows, 1, k))
    assert_bitwise_equal(t.scale, flat.scale.reshape(1, rows, 1, 1))


@given(matrices(max_blocks=(5, 12), elements=SCALABLE), power_of_two_exponents())
def test_token_power_of_two_scaling_passes_through_bitwise(x, e):
    assert_bitwise_equal(fq.fp8_token_qdq(x * 2.0**e), fq.fp8_token_qdq(x) * 2.0**e)


@given(token_batches())
@example(torch.tensor([[3.4028235e38, 7.0, 1.0]]))
def test_token_qdq_is_idempotent_on_codes(x):
    once = fq.fp8_token_qdq(x)
    twice = fq.fp8_token_qdq(once)
    assert_bitwise_equal(fq.fp8_token_quantize(once).codes, fq.fp8_token_quantize(x).codes)
    # the second scale is amax(once)/448 = fl(fl(448*s)/448): equal to s or one FP32 ulp away
    diff = (twice.double() - once.double()).abs()
    assert bool((diff <= once.double().abs() * 2.0**-22 + 2.0**-149).all())


@given(token_batches())
def test_token_error_bound(x):
    y = fq.fp8_token_qdq(x).double()
    xd = x.double()
    scale = fq.fp8_token_quantize(x).scale.double()
    # E4M3: half-ulp 2**-4 relative, or half the smallest subnormal (2**-10) times the scale;
    # plus the output dtype's rounding (FP16/BF16 round the decoded value once more)
    out_eps = {torch.float32: 2.0**-24, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}[x.dtype]
    tiny = {torch.float32: 2.0**-149, torch.bfloat16: 2.0**-133, torch.float16: 2.0**-24}[x.dtype]
    bound = torch.maximum(xd.abs() * 2.0**-4, 2.0**-10 * scale) * (1 + 2.0**-20) + (
        xd.abs() * out_eps * 1.1 + tiny
    )
    assert bool(((y - xd).abs() <= bound).all())


@given(token_batches(), NON_FINITE, st.data())
def test_token_non_finite_rejected(x, bad, data):
    x = x.clone()
    x[data.draw(st.integers(0, x.shape[0] - 1)), data.draw(st.integers(0, x.shape[1] - 1))] = bad
    for fn in (fq.fp8_token_qdq, fq.fp8_token_quantize):
        try:
            fn(x)
        except ValueError as err:
            assert "NaN or infinity" in str(err)
        else:
            raise AssertionError(f"{fn.__name__} accepted non-finite input")


@given(st.lists(st.floats(min_value=0.0, max_value=1e30, allow_subnormal=True), max_size=6))
def test_float64_direct_scales_are_inverted_exactly_or_refused_never_flushed(values):
    """A positive float64 direct scale is never read as 0 (which would map to ``1/FLT_MIN`` and
    decode its region as zeros): if FP32 flushes it, or its inverse overflows, it is refused."""
    s = torch.tensor(values, dtype=torch.float64)
    s32 = s.to(torch.float32)
    lost = bool(((s > 0) & ((s32 == 0) | torch.isinf(1.0 / s32))).any())
    try:
        inverse = fq.direct_to_inverse_scale(s)
    except ValueError as err:
        assert lost, f"refused {values}: {err}"
        return
    assert not lost, f"accepted {values}"
    assert bool(torch.isfinite(inverse).all()) and bool((inverse > 0).all())
    assert_bitwise_equal(inverse[s == 0], torch.full_like(inverse[s == 0], 1 / 2.0**-126))
