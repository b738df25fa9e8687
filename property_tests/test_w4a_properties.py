"""Properties of the INT4 GEMMs' pure references (``w4a.linear``): what the W4A16 and W4A-FP8
kernels must equal.

* the two W4A-FP8 weight forms (int32 GPTQ words, staged E4M3 ``code - 8``) are the same
  operand: bit-identical outputs;
* W4A-FP8 is the grouped sum of exact products: its output lies within the FP32 bound of the
  float64 value of ``Σ_g scale_g · Σ_k code_x · (code_w - 8)`` times the token scale;
* scaling every group scale by a power of two scales the output by it, bit for bit (each FP32
  step is exact under it), and a group whose scales are zero contributes nothing;
* W4A16 is ``F.linear`` of ``dequantize_gptq`` in ``x``'s dtype, for any packing.
"""

from typing import Any

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import floatxq as fq
from floatxq.testing import assert_bitwise_equal, assert_within_bound, w4a_fp8_linear_error_bound
from floatxq.testing.strategies import gptq_packed, int_arrays


@st.composite
def w4a_fp8_cases(draw: Any) -> tuple[torch.Tensor, Any, torch.Tensor | None]:
    """``(x, (codes, scales), bias)``: a symmetric 4-bit GPTQ weight with groups of 128 (codes
    drawn, scales spread over binades), activations whose rows differ by powers of two (small enough
    that no float16 output overflows)."""
    groups = draw(st.integers(1, 2))
    k, n = 128 * groups, 8 * draw(st.integers(1, 2))
    codes = draw(int_arrays((k, n), 0, 15))
    exps = draw(hnp.arrays(np.int32, (groups, n), elements=st.integers(-12, 2)))
    mant = draw(hnp.arrays(np.float32, (groups, n), elements=st.floats(1, 2, width=32)))
    scales = torch.from_numpy(mant) * torch.exp2(torch.from_numpy(exps).float())
    rows = draw(st.integers(1, 3))
    row_exps = draw(hnp.arrays(np.int32, (rows, 1), elements=st.integers(-10, 3)))
    # values on a 1/16 grid in [-4, 4] (zero included): with the row scales below, no token
    # scale, product or output comes near FP32's subnormals, where power-of-two scaling of the
    # group scales would not be exact
    grid = st.integers(-64, 64).map(lambda v: v / 16)
    bulk = draw(hnp.arrays(np.float32, (rows, k), elements=grid))
    x = torch.from_numpy(bulk) * torch.exp2(torch.from_numpy(row_exps).float())
    dtype = draw(st.sampled_from([torch.float32, torch.bfloat16, torch.float16]))
    bias = None
    if draw(st.booleans()):
        values = draw(hnp.arrays(np.float32, (n,), elements=st.floats(-8, 8, width=32)))
        bias = torch.from_numpy(values).to(dtype)
    return x.to(dtype), (codes, scales), bias


def _packed(weight: Any) -> fq.GPTQPacked:
    """Pack the drawn codes with zero point 8 and groups of 128 (outside the strategy: floatxq's
    calls are type-checked, and the checker draws from ``random``)."""
    codes, scales = weight
    k, groups = codes.shape[0], scales.shape[0]
    g_idx = torch.arange(k, dtype=torch.int32) // 128
    zeros = torch.full((groups, codes.shape[1]), 8)
    return fq.pack_gptq(codes, zeros, scales, g_idx, format="gptq")


def _staged(packed: fq.GPTQPacked) -> torch.Tensor:
    return fq.int4_to_e4m3(fq.centered_int4(packed, format="gptq"))


@settings(max_examples=max(10, settings.default.max_examples // 2))
@given(w4a_fp8_cases())
def test_words_and_staged_e4m3_are_the_same_operand(case):
    x, weight, bias = case
    packed = _packed(weight)
    words = fq.w4a_fp8_linear(x, packed.qweight, packed.scales, bias)
    staged = fq.w4a_fp8_linear(x, _staged(packed), packed.scales, bias)
    assert_bitwise_equal(words, staged)


@settings(max_examples=max(10, settings.default.max_examples // 2))
@given(w4a_fp8_cases())
def test_w4a_fp8_is_the_grouped_sum_of_exact_products(case):
    x, weight, bias = case
    packed = _packed(weight)
    out = fq.w4a_fp8_linear(x, packed.qweight, packed.scales, bias)
    tokens = fq.fp8_token_quantize(x)
    bound = w4a_fp8_linear_error_bound(
        tokens.codes, tokens.scale[:, 0], packed.qweight, packed.scales, bias,
        output_dtype=x.dtype,
    )  # fmt: skip
    assert_within_bound(out, bound)


@settings(max_examples=max(10, settings.default.max_examples // 2))
@given(w4a_fp8_cases(), st.integers(-3, 3))
def test_power_of_two_group_scales_scale_the_output_exactly(case, e):
    x, weight, _ = case
    packed = _packed(weight)
    x = x.float()  # (float32 output: no subnormal or overflow from the drawn ranges)
    tokens = fq.fp8_token_quantize(x)
    codes, row_scale = tokens.codes, tokens.scale[:, 0]
    base = fq.w4a_fp8_linear_prepacked(
        codes, row_scale, packed.qweight, packed.scales, output_dtype=torch.float32
    )
    scaled = fq.w4a_fp8_linear_prepacked(
        codes, row_scale, packed.qweight, packed.scales.float() * 2.0**e,
        output_dtype=torch.float32,
    )  # fmt: skip
    assert_bitwise_equal(scaled, base * 2.0**e)


@settings(max_examples=max(10, settings.default.max_examples // 2))
@given(w4a_fp8_cases())
def test_a_group_with_zero_scales_contributes_nothing(case):
    x, weight, _ = case
    packed = _packed(weight)
    tokens = fq.fp8_token_quantize(x.float())
    codes, row_scale = tokens.codes, tokens.scale[:, 0]
    zeroed = packed.scales.clone()
    zeroed[-1] = 0
    full = fq.w4a_fp8_linear_prepacked(
        codes, row_scale, packed.qweight, zeroed, output_dtype=torch.float32
    )
    groups = zeroed.shape[0]
    if groups == 1:
        assert bool((full == 0).all())
        return
    k = 128 * (groups - 1)
    head = fq.w4a_fp8_linear_prepacked(
        codes[:, :k].contiguous(), row_scale, packed.qweight[: k // 8], packed.scales[:-1],
        output_dtype=torch.float32,
    )  # fmt: skip
    assert torch.equal(full, head)  # (numerically: adding a zero product may turn -0 into +0)


@given(gptq_packed(), st.sampled_from(["gptq", "gptq_v2"]),
       st.sampled_from([torch.float32, torch.bfloat16, torch.float16]), st.data())  # fmt: skip
def test_w4a16_is_f_linear_of_the_decoded_weight(packed, fmt, dtype, data):
    scales = packed.scales.float().clamp(-1e3, 1e3).half()  # (finite products in fp16)
    packed = packed._replace(scales=scales)
    k = packed.qweight.shape[0] * 8
    values = data.draw(hnp.arrays(np.float32, (2, k), elements=st.floats(-4, 4, width=32)))
    x = torch.from_numpy(values).to(dtype)
    weight = fq.dequantize_gptq(packed, bits=4, format=fmt, dtype=dtype)
    assert_bitwise_equal(
        fq.w4a16_linear(x, packed, format=fmt), torch.nn.functional.linear(x, weight)
    )
