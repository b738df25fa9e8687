"""Properties of the W4A-NVFP4 GEMM's pure reference (``floatxq.w4a.linear``): what its kernels must
equal.

* the two weight forms (int32 GPTQ words, staged E4M3 ``code - 8``) are the same operand:
  bit-identical outputs;
* the output lies within ``w4a_nvfp4_linear_error_bound`` of the float64 value of its terms, and
  that value is the float64 product of the decoded activation and the dequantized GPTQ weight
  (``dequantize_gptq``), times the token scale, plus the bias;
* a group whose scales are zero contributes nothing: the output is bit for bit that of the
  other groups alone.

The drawn data are structured (values on a 1/16 grid, whole blocks a power of two apart, zero
blocks), so the worst-case bound is the one asserted: the statistical bound presumes terms of
random sign (``tests/test_w4a_nvfp4.py`` holds seeded random data to it).
"""

from typing import Any

import numpy as np
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import floatxq as fq
from floatxq.nvfp4.operand import nvfp4_decode_swizzled
from floatxq.testing import assert_bitwise_equal, assert_within_bound, w4a_nvfp4_linear_error_bound
from floatxq.testing.strategies import int_arrays
from floatxq.w4a.activation import pack_activation
from floatxq.w4a.linear import w4a_nvfp4_linear, w4a_nvfp4_linear_prepacked

DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@st.composite
def w4a_nvfp4_cases(draw: Any) -> dict[str, Any]:
    """A symmetric 4-bit GPTQ weight (codes drawn, group scales spread over binades), activation
    rows whose 16-value blocks differ by powers of two (some all zero), an optional bias, token
    scale and global scale (None: the dynamic one), all small enough that nothing overflows."""
    groups = draw(st.integers(1, 2))
    k, n, rows = 128 * groups, 8 * draw(st.integers(1, 2)), draw(st.integers(1, 3))
    codes = draw(int_arrays((k, n), 0, 15))
    exps = draw(hnp.arrays(np.int32, (groups, n), elements=st.integers(-12, 2)))
    mant = draw(hnp.arrays(np.float32, (groups, n), elements=st.floats(1, 2, width=32)))
    scales = torch.from_numpy(mant) * torch.exp2(torch.from_numpy(exps).float())
    grid = st.integers(-64, 64).map(lambda v: v / 16)  # [-4, 4] on a 1/16 grid, zero included
    bulk = torch.from_numpy(draw(hnp.arrays(np.float32, (rows, k), elements=grid)))
    block_exps = draw(hnp.arrays(np.int32, (rows, k // 16), elements=st.integers(-8, 3)))
    spread = torch.exp2(torch.from_numpy(block_exps).float()).repeat_interleave(16, dim=1)
    dtype = draw(st.sampled_from(DTYPES))
    case = {"x": (bulk * spread).to(dtype), "codes": codes, "scales": scales, "dtype": dtype}
    case["bias"] = None
    if draw(st.booleans()):
        values = draw(hnp.arrays(np.float32, (n,), elements=st.floats(-8, 8, width=32)))
        case["bias"] = torch.from_numpy(values).to(dtype)
    case["token_scale"] = None
    if draw(st.booleans()):
        values = draw(hnp.arrays(np.float32, (rows,), elements=st.floats(0.25, 4, width=32)))
        case["token_scale"] = torch.from_numpy(values)
    case["global_scale"] = draw(st.one_of(st.none(), st.floats(2**-12, 1, width=32)))
    case["zeroed_group"] = draw(st.integers(0, groups - 1))
    return case


def _packed(case: dict[str, Any]) -> fq.GPTQPacked:
    """Pack the drawn codes with zero point 8 and groups of 128 (outside the strategy: floatxq's
    calls are type-checked, and the checker draws from ``random``)."""
    codes, scales = case["codes"], case["scales"]
    g_idx = torch.arange(codes.shape[0], dtype=torch.int32) // 128
    zeros = torch.full(scales.shape, 8)
    return fq.pack_gptq(codes, zeros, scales, g_idx, format="gptq")


def _staged(case: dict[str, Any]) -> torch.Tensor:
    return (case["codes"] - 8).to(torch.float32).to(torch.float8_e4m3fn)


def _operand(case: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    a = pack_activation(case["x"], "w4a_nvfp4", global_scale=case["global_scale"])
    return a.codes, a.scales, a.global_scale


def _prepacked(case, operand, weight, group_scales, dtype=None) -> torch.Tensor:
    return w4a_nvfp4_linear_prepacked(
        *operand, weight, group_scales, case["bias"], token_scale=case["token_scale"],
        output_dtype=dtype or case["dtype"],
    )  # fmt: skip


@settings(max_examples=max(10, settings.default.max_examples // 3))
@given(w4a_nvfp4_cases())
def test_words_and_staged_e4m3_are_the_same_operand(case):
    packed = _packed(case)
    x, bias, g = case["x"], case["bias"], case["global_scale"]
    words = w4a_nvfp4_linear(x, packed.qweight, packed.scales, bias, global_scale=g)
    staged = w4a_nvfp4_linear(x, _staged(case), packed.scales, bias, global_scale=g)
    assert_bitwise_equal(words, staged)
    operand = _operand(case)
    assert_bitwise_equal(
        _prepacked(case, operand, packed.qweight, packed.scales),
        _prepacked(case, operand, _staged(case), packed.scales),
    )


@settings(max_examples=max(10, settings.default.max_examples // 3))
@given(w4a_nvfp4_cases())
def test_within_the_bound_of_the_decoded_activation_times_the_dequantized_weight(case):
    packed = _packed(case)
    operand = _operand(case)
    out = _prepacked(case, operand, packed.qweight, packed.scales)
    bound = w4a_nvfp4_linear_error_bound(
        *operand, packed.qweight, packed.scales, case["bias"], token_scale=case["token_scale"],
        output_dtype=case["dtype"],
    )  # fmt: skip
    # the oracle: the activation decoded without its global scale (exact), the global scale,
    # the GPTQ weight as dequantize_gptq decodes it, all in float64
    k = case["x"].shape[1]
    a = nvfp4_decode_swizzled(operand[0], operand[1], 1.0, k, torch.float32).double()
    a = a * operand[2].double()
    w = fq.dequantize_gptq(packed, dtype=torch.float64)  # (n, k)
    oracle, magnitude = a @ w.T, a.abs() @ w.abs().T
    if case["token_scale"] is not None:
        oracle = oracle * case["token_scale"].double()[:, None]
        magnitude = magnitude * case["token_scale"].double()[:, None]
    if case["bias"] is not None:
        oracle = oracle + case["bias"].double()
        magnitude = magnitude + case["bias"].double().abs()
    assert bool(((bound.exact - oracle).abs() <= 1e-12 * magnitude).all())
    assert bool((bound.statistical <= bound.worst_case).all())
    assert_within_bound(out, bound, which="worst_case")
    assert_within_bound(out, bound._replace(exact=oracle), which="worst_case")


ZERO_BIAS_CASE = {
    "x": torch.zeros(1, 128), "codes": torch.full((128, 8), 8), "scales": torch.ones(1, 8),
    "dtype": torch.float32, "bias": torch.full((8,), -0.0), "token_scale": None,
    "global_scale": None, "zeroed_group": 0,
}  # fmt: skip


@settings(max_examples=max(10, settings.default.max_examples // 3))
@given(w4a_nvfp4_cases())
@example(ZERO_BIAS_CASE)
def test_a_group_with_zero_scales_contributes_nothing(case):
    packed = _packed(case)
    codes, scales, g = _operand(case)
    groups, zeroed_group = scales.shape[0], case["zeroed_group"]
    group_scales = packed.scales.clone()
    group_scales[zeroed_group] = 0
    full = _prepacked(case, (codes, scales, g), packed.qweight, group_scales)
    if groups == 1:  # nothing but the bias is left: +0 · scales + bias (so -0 becomes +0)
        expected = torch.zeros(full.shape)
        if case["bias"] is not None:
            expected = expected + case["bias"].float()
        assert_bitwise_equal(full, expected.to(case["dtype"]))
        return
    keep = 1 - zeroed_group
    raw = codes.view(torch.uint8)[:, 64 * keep : 64 * keep + 64].contiguous()
    alone = _prepacked(
        case, (raw, scales[keep : keep + 1].contiguous(), g),
        packed.qweight[16 * keep : 16 * keep + 16].contiguous(), packed.scales[keep : keep + 1],
    )  # fmt: skip
    assert_bitwise_equal(full, alone)
