"""Properties of FP8 weights and tokens: the executable specification of SPEC §2–3."""

import math

import numpy as np
import torch
from hypothesis import example, given
from hypothesis import strategies as st

import floatxq as fq
from floatxq.testing import assert_bitwise_equal
from floatxq.testing.strategies import (
    FP8_ENCODABLE,
    f32_values,
    matrices,
    power_of_two_exponents,
    scaled_gaussian,
)

LAYOUTS = st.sampled_from(
    [("tensor", None), ("row", None), ("block", (1, 4)), ("block", (2, 2)), ("block", (4, 8))]
)
FORMATS = st.sampled_from(FP8_ENCODABLE)


def _block_of(layout):
    return layout[1] or (1, 1)


@st.composite
def weight_cases(draw, *, finite=True, elements=None):
    layout = draw(LAYOUTS)
    w = draw(
        matrices(
            block=_block_of(layout),
            elements=f32_values(finite=finite) if elements is None else elements,
        )
    )
    return draw(FORMATS), layout, w


def _expanded(scale_inv: torch.Tensor, layout, shape) -> torch.Tensor:
    if layout[0] == "tensor":
        return scale_inv.expand(shape)
    if layout[0] == "row":
        return scale_inv[:, None].expand(shape)
    br, bc = layout[1]
    return scale_inv.repeat_interleave(br, 0).repeat_interleave(bc, 1)


def _zero_regions(w: torch.Tensor, layout) -> torch.Tensor:
    """Grid-shaped mask of the regions whose entries are all zero (independent of the scales)."""
    nonzero = (w != 0).double()
    if layout[0] == "tensor":
        return nonzero.sum() == 0
    if layout[0] == "row":
        return nonzero.sum(dim=1) == 0
    br, bc = layout[1]
    rows, cols = w.shape
    return nonzero.reshape(rows // br, br, cols // bc, bc).sum(dim=(1, 3)) == 0


def _smallest_subnormal(name: str) -> float:
    return fq.fp8_decode(torch.tensor([1], dtype=torch.uint8).view(fq.fp8_dtype(name))).item()


_MANTISSA_BITS = {"float8_e4m3fn": 3, "float8_e5m2": 2, "float8_e4m3fnuz": 3, "float8_e5m2fnuz": 2}

ZERO_ROW_TINY = torch.tensor([[0.0, 0.0, 0.0, 1.1754944e-38]])
DENORMAL_ONLY = torch.tensor([[1e-45, -1e-40, 0.0, 2.0**-149]])


@given(weight_cases())
@example(("float8_e4m3fn", ("row", None), ZERO_ROW_TINY))
@example(("float8_e4m3fn", ("tensor", None), DENORMAL_ONLY))
@example(("float8_e5m2", ("block", (1, 4)), torch.zeros(1, 4)))
def test_weight_scales_shape_finite_positive_and_codes_bounded(case):
    name, layout, w = case
    q = fq.quantize_fp8_weight(
        w, format=name, weight_scale_method=layout[0], weight_block_size=layout[1]
    )
    rows, cols = w.shape
    expected_shape = {
        "tensor": (),
        "row": (rows,),
        "block": (rows // _block_of(layout)[0], cols // _block_of(layout)[1]),
    }[layout[0]]
    assert q.scale_inv.shape == expected_shape and q.scale_inv.dtype == torch.float32
    assert bool(torch.isfinite(q.scale_inv).all()) and bool((q.scale_inv > 0).all())
    codes = fq.fp8_decode(q.qweight)
    assert not bool(codes.isnan().any())
    assert bool((codes.abs() <= fq.fp8_max(name)).all())
    # an all-zero region has scale_inv exactly 1 (and zero codes, checked by the bound below)
    zero = _zero_regions(w, layout)
    assert bool((q.scale_inv[zero] == 1).all())


@given(weight_cases())
@example(("float8_e4m3fn", ("row", None), DENORMAL_ONLY))
def test_weight_reconstruction_bound(case):
    name, layout, w = case
    q = fq.quantize_fp8_weight(
        w, format=name, weight_scale_method=layout[0], weight_block_size=layout[1]
    )
    back = fq.dequantize_fp8_weight(q.qweight, q.scale_inv).double()
    s = _expanded(q.scale_inv, layout, w.shape).double()
    wd = w.double()
    # FP8 rounding of y = w * s: relative half-ulp in the normal range, half the smallest
    # subnormal below it; divided back by s, plus FP32 rounding of the product and quotient
    # and the FP32 subnormal floor of the decoded value.
    half_step = torch.maximum(
        (wd * s).abs() * 2.0 ** -(_MANTISSA_BITS[name] + 1),
        torch.full_like(wd, _smallest_subnormal(name) / 2),
    )
    bound = half_step / s * (1 + 2.0**-20) + wd.abs() * 2.0**-22 + 2.0**-149
    err = (back - wd).abs()
    assert bool((err <= bound).all()), float((err - bound).max())


SAFE = st.one_of(
    st.just(0.0),
    st.just(-0.0),
    st.floats(2.0**-60, 2.0**60, width=32),
    st.floats(-(2.0**60), -(2.0**-60), width=32),
)


@given(weight_cases(elements=SAFE), power_of_two_exponents())
@example(("float8_e4m3fnuz", ("tensor", None), torch.tensor([[240.0]])), 1)
def test_weight_power_of_two_equivariance(case, e):
    name, layout, w = case
    kw = dict(format=name, weight_scale_method=layout[0], weight_block_size=layout[1])
    base = fq.quantize_fp8_weight(w, **kw)
    scaled = fq.quantize_fp8_weight(w * 2.0**e, **kw)
    assert_bitwise_equal(scaled.qweight, base.qweight)
    zero = _zero_regions(w, layout)
    expected = torch.where(zero, base.scale_inv, base.scale_inv * 2.0**-e)  # zero regions keep 1
    assert_bitwise_equal(scaled.scale_inv, expected)


@given(weight_cases())
def test_weight_input_not_mutated(case):
    name, layout, w = case
    before = w.clone()
    fq.quantize_fp8_weight(
        w, format=name, weight_scale_method=layout[0], weight_block_size=layout[1]
    )
    assert_bitwise_equal(w, before)


# ------------------------------------------------------------------------------------------------
# Tokens
# ------------------------------------------------------------------------------------------------

TOKEN_DTYPES = st.sampled_from([torch.float32, torch.bfloat16, torch.float16])


@st.composite
def token_batches(draw, *, elements=None):
    dtype = draw(TOKEN_DTYPES)
    # the largest magnitude that survives the cast to dtype (FLT_MAX overflows bf16)
    limit = {torch.float32: None, torch.bfloat16: 3.38e38, torch.float16: 65504.0}[dtype]
    x = draw(
        matrices(
            max_blocks=(5, 12),
            elements=f32_values(max_magnitude=limit) if elements is None else elements,
        )
    )
    return x.to(dtype)


@given(token_batches())
@example(ZERO_ROW_TINY)
@example(torch.tensor([[3.4028235e38, -3.4028235e38, 1.0]]))
@example(torch.tensor([[2.0**-149, 0.0], [1e-38, -1e-45]]))
def test_token_qdq_finite_in_finite_out(x):
    y = fq.fp8_token_qdq(x)
    assert y.shape == x.shape and y.dtype == x.dtype
    assert bool(torch.isfinite(y).all())
    # zeros stay zeros (with their sign) and signs never flip
    assert bool((torch.sign(y) * torch.sign(x) >= 0).all())
    assert_bitwise_equal(y[x == 0], x[x == 0])


@given(token_batches(), st.data())
def test_token_rows_independent(x, data):
    y = fq.fp8_token_qdq(x)
    perm = torch.randperm(
        x.shape[0], generator=torch.Generator().manual_seed(data.draw(st.integers(0, 99)))
    )
    assert_bitwise_equal(fq.fp8_token_qdq(x[perm]), y[perm])
    i = data.draw(st.integers(0, x.shape[0] - 1))
    assert_bitwise_equal(fq.fp8_token_qdq(x[i : i + 1]), y[i : i + 1])


@given(matrices(max_blocks=(5, 12), elements=SAFE), power_of_two_exponents())
def test_token_power_of_two_equivariance(x, e):
    assert_bitwise_equal(fq.fp8_token_qdq(x * 2.0**e), fq.fp8_token_qdq(x) * 2.0**e)


@given(token_batches())
@example(torch.tensor([[3.4028235e38, 7.0, 1.0]]))
def test_token_qdq_idempotent(x):
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


@given(st.sampled_from([math.nan, math.inf, -math.inf]), st.integers(0, 3), st.integers(0, 7))
def test_token_non_finite_rejected(bad, row, col):
    x = torch.ones(4, 8)
    x[row, col] = bad
    try:
        fq.fp8_token_qdq(x)
    except ValueError as err:
        assert "NaN or infinity" in str(err)
    else:
        raise AssertionError("non-finite input was accepted")


@given(weight_cases(), st.sampled_from([math.nan, math.inf, -math.inf]))
def test_weight_non_finite_rejected(case, bad):
    name, layout, w = case
    w = w.clone()
    w[-1, -1] = bad
    try:
        fq.quantize_fp8_weight(
            w, format=name, weight_scale_method=layout[0], weight_block_size=layout[1]
        )
    except ValueError as err:
        assert "NaN or infinity" in str(err)
    else:
        raise AssertionError("non-finite weight was accepted")


@given(scaled_gaussian(block=(4, 8)))
def test_weight_block_layout_is_independent_per_block(w):
    """Quantizing one block alone gives that block's codes and scale (regions never interact)."""
    q = fq.quantize_fp8_weight(w, weight_scale_method="block", weight_block_size=[4, 8])
    for i in range(w.shape[0] // 4):
        for j in range(w.shape[1] // 8):
            tile = w[4 * i : 4 * i + 4, 8 * j : 8 * j + 8]
            alone = fq.quantize_fp8_weight(tile, weight_scale_method="tensor")
            assert_bitwise_equal(alone.qweight, q.qweight[4 * i : 4 * i + 4, 8 * j : 8 * j + 8])
            assert_bitwise_equal(alone.scale_inv, q.scale_inv[i, j])


def test_numpy_float32_division_is_what_the_scale_uses():
    """Pins the scale arithmetic to one IEEE FP32 division (no reciprocal-multiply)."""
    amax = np.float32(np.nextafter(np.float32(3.0), np.float32(4.0)))
    w = torch.tensor([[float(amax), 1.0]])
    q = fq.quantize_fp8_weight(w)
    assert q.scale_inv.item() == float(np.float32(448.0) / amax)
