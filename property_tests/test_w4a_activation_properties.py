"""Properties of the W4A activation carrier: round trips and the formats' error bounds.

Inputs are built from ``floatxq.testing.strategies`` draws with K a multiple of 128 and the
logical shape 2-D or 3-D, so a failure shrinks to a small tensor. The FP8 carrier must decode to
exactly :func:`floatxq.fp8_token_qdq`; the NVFP4 carrier's decode must lie within E2M1's
rounding bound of its own block scales, and each block's squared error within that of the
``amax → 6`` candidate every recipe tries (recomputed here in float64).
"""

import math

import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

import floatxq as fq
from floatxq.testing import assert_bitwise_equal
from floatxq.testing.strategies import FLOAT_DTYPES, matrices, nvfp4_inputs

E2M1_MAGNITUDES = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=torch.float64)
GLOBAL_SCALES = st.one_of(
    st.none(),  # dynamic
    st.sampled_from([1.0, 2.0**-20, 3.0e-3, 100.0]),
    st.floats(2.0**-26, 2.0**13, width=32),
)


@st.composite
def _logical(draw, x: torch.Tensor) -> torch.Tensor:
    """``x`` ``(rows, k)`` tiled to K of 128 or 256, each copy scaled down by its own drawn
    power of two (so a token mixes magnitudes, and few values are drawn: Hypothesis stays fast),
    then shaped ``(rows, K)``, ``(1, rows, K)`` or ``(rows, 1, K)``."""
    rows, k = x.shape
    big_k = 128 * draw(st.integers(1, 2))
    copies = -(-big_k // k)
    exps = draw(st.lists(st.integers(0, 12), min_size=copies, max_size=copies))
    factors = torch.tensor([2.0**-e for e in exps]).repeat_interleave(k)
    x = (x.float().repeat(1, copies) * factors)[:, :big_k].to(x.dtype)
    return x.reshape(draw(st.sampled_from([(rows, big_k), (1, rows, big_k), (rows, 1, big_k)])))


@st.composite
def fp8_activations(draw) -> torch.Tensor:
    """Any finite values of a drawn dtype (edges mixed in)."""
    dtype = draw(st.sampled_from(FLOAT_DTYPES))
    return draw(_logical(draw(matrices(max_blocks=(4, 32), dtype=dtype))))


@st.composite
def nvfp4_activations(draw) -> torch.Tensor:
    """16-value blocks of very different magnitudes (``nvfp4_inputs``), one element pinned to a
    normal magnitude so the dynamic global scale is a normal FP32."""
    dtype = draw(st.sampled_from(FLOAT_DTYPES))
    if dtype == torch.float16:  # stay inside fp16's range
        x = draw(nvfp4_inputs(max_blocks=4, block_spread=4, max_magnitude=2.0**10))
    else:
        x = draw(nvfp4_inputs(max_blocks=4))
    row, col = draw(st.integers(0, x.shape[0] - 1)), draw(st.integers(0, x.shape[1] - 1))
    x[row, col] = draw(st.floats(1.0, 2.0**10, width=32))
    return draw(_logical(x.to(dtype)))


# ------------------------------------------------------------------------------------------------
# FP8
# ------------------------------------------------------------------------------------------------


@settings(max_examples=max(10, settings.default.max_examples // 2))
@given(fp8_activations())
@example(torch.tensor([[3.4028235e38, -1.0] + [0.0] * 126]))
@example(torch.zeros(2, 1, 128, dtype=torch.bfloat16))
def test_fp8_carrier_round_trip_is_fp8_token_qdq(x):
    a = fq.pack_activation(x, "w4afp8")
    assert_bitwise_equal(a.decode(x.dtype), fq.fp8_token_qdq(x))
    t = fq.fp8_token_quantize(x.reshape(-1, x.shape[-1]))
    assert_bitwise_equal(a.codes, t.codes)


@given(fp8_activations())
def test_fp8_decode_error_within_e4m3_bound(x):
    """Half an E4M3 ulp (``2**-4`` relative) or half the smallest subnormal (``2**-10``) times
    the token's scale, per element; decoded in FP32 so no output rounding is added."""
    a = fq.pack_activation(x, "w4afp8")
    xd = x.double().reshape(a.rows, a.k)
    y = a.decode(torch.float32).double().reshape(a.rows, a.k)
    scale = a.scales.double()[:, None]
    bound = torch.maximum(xd.abs() * 2.0**-4, 2.0**-10 * scale) * (1 + 2.0**-20) + 2.0**-149
    assert bool(((y - xd).abs() <= bound).all())


# ------------------------------------------------------------------------------------------------
# NVFP4
# ------------------------------------------------------------------------------------------------


def _candidate6_sse(x32: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """Per 16-value block, the float64 SSE of the scale mapping its amax onto E2M1's 6: E4M3 of
    ``clamp(amax / (g · 6), 2**-9, 448)`` (1 for a zero block), every element to its nearest
    E2M1 magnitude (saturating at 6)."""
    blocks = x32.reshape(-1, 16)
    amax = blocks.abs().amax(dim=1)
    ratio = (amax / (g * torch.tensor(6.0))).clamp(2.0**-9, 448.0)
    scale = torch.where(amax > 0, ratio, torch.ones_like(ratio))
    e = (scale.to(torch.float8_e4m3fn).float() * g).double()  # FP32 product, as the search
    grid = E2M1_MAGNITUDES * e[:, None, None]  # (blocks, 1, 8)
    err = (grid - blocks.double().abs()[..., None]).abs().amin(dim=-1)
    return (err**2).sum(dim=1)


@settings(max_examples=max(10, settings.default.max_examples // 2))
@given(nvfp4_activations(), GLOBAL_SCALES, st.sampled_from(fq.NVFP4_RECIPES))
@example(torch.tensor([[6.0, -4.0, 0.5] + [0.0] * 125]), None, "exhaustive")
def test_nvfp4_decode_error_within_e2m1_bound(x, global_scale, recipe):
    """Per element ``|y - x| <= max(|x|, e) / 4`` (half an E2M1 step at ``|x| / e`` in ``[0, 6]``)
    plus the saturation ``|x| - 6e`` above it, ``e = block_scale · global_scale``; per block, the
    SSE at most the ``amax → 6`` candidate's (every recipe tries it and keeps the lowest)."""
    a = fq.pack_activation(x, "w4a_nvfp4", global_scale=global_scale, recipe=recipe)
    x32 = x.float().reshape(a.rows, a.k)
    xd = x32.double()
    y = a.decode(torch.float32).double().reshape(a.rows, a.k)
    block = fq.unswizzle_scales_per_group(a.scales, rows=a.rows, cols=a.k // 16)
    e = (block.double() * a.global_scale.double()).repeat_interleave(16, dim=1)
    err = (y - xd).abs()
    bound = (
        torch.maximum(xd.abs(), e) / 4
        + (xd.abs() - 6 * e).clamp_min(0)
        + (xd.abs() + e) * 2.0**-20
        + 2.0**-148
    )
    assert bool((err <= bound).all()), (err - bound).max().item()
    sse = (err**2).reshape(-1, 16).sum(dim=1)
    energy = (xd**2).reshape(-1, 16).sum(dim=1)
    limit = _candidate6_sse(x32, a.global_scale) * (1 + 2.0**-10) + energy * 2.0**-30 + 2.0**-140
    assert bool((sse <= limit).all())


@settings(max_examples=max(10, settings.default.max_examples // 2))
@given(nvfp4_activations(), st.floats(2.0**-20, 2.0**10, width=32), st.data())
def test_nvfp4_with_a_given_global_scale_each_token_is_packed_alone(x, g, data):
    """A given global scale makes each token's codes and block scales its own business; the
    dynamic one is ``max|x| / 1792`` on ``x``'s grid over the whole tensor."""
    a = fq.pack_activation(x, "w4a_nvfp4", global_scale=g)
    flat = x.reshape(a.rows, a.k)
    i = data.draw(st.integers(0, a.rows - 1))
    alone = fq.pack_activation(flat[i : i + 1], "w4a_nvfp4", global_scale=g)
    assert_bitwise_equal(a.codes.view(torch.uint8)[i : i + 1], alone.codes.view(torch.uint8))
    rows_scales = fq.unswizzle_scales_per_group(a.scales, rows=a.rows, cols=a.k // 16)
    alone_scales = fq.unswizzle_scales_per_group(alone.scales, rows=1, cols=a.k // 16)
    assert_bitwise_equal(rows_scales[i : i + 1], alone_scales)
    dynamic = fq.pack_activation(x, "w4a_nvfp4").global_scale
    amax = x.float().abs().max()
    want = (amax / torch.tensor(1792.0)).to(x.dtype).float()
    assert_bitwise_equal(dynamic, torch.where(want > 0, want, amax / torch.tensor(1792.0)))
    assert math.isfinite(dynamic.item())
