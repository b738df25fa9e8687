"""Properties of static FP8 activations (``fp8_static_input_quantize`` / ``static_input_qdq``):
what a W8A8 checkpoint's stored ``input_scale`` does to ``x``.

A static scale is the dynamic per-tensor one frozen at calibration: at ``input_scale = amax /
448`` of ``x`` itself the two are the same bits. Any other scale saturates what lies beyond
``448 · input_scale`` to ±448 (never NaN or inf for a finite or infinite ``x``), keeps signs and
zeros, and commutes with powers of two.
"""

import math

import numpy as np
import torch
from hypothesis import example, given
from hypothesis import strategies as st

from floatxq.fp8_activation import (
    FP8InputQuant,
    fp8_static_input_quantize,
    input_qdq,
    static_input_qdq,
)
from floatxq.testing import assert_bitwise_equal
from floatxq.testing.strategies import f32_values, power_of_two_exponents, token_batches

SCALES = st.floats(2.0**-40, 2.0**40, width=32).map(lambda v: torch.tensor(v))
"""Positive normal FP32 activation scales, far from both ends of the range."""

# Values that stay normal FP32 through any x * 2**e with |e| <= 20.
SCALABLE = f32_values(min_magnitude=2.0**-60, max_magnitude=2.0**60)


def _dynamic_tensor_scale(x: torch.Tensor) -> torch.Tensor:
    """``amax / 448`` of the whole ``x`` in FP32 (1 for a zero ``x``, 2**-149 where it
    underflows): the scale dynamic per-tensor quantization computes, as numpy computes it."""
    amax = np.float32(x.float().abs().max().item()) if x.numel() else np.float32(0.0)
    with np.errstate(under="ignore"):
        ratio = np.float32(amax / np.float32(448.0))
    scale = max(ratio, np.float32(2.0**-149)) if amax > 0 else np.float32(1.0)
    return torch.tensor(float(scale), dtype=torch.float32)


@given(token_batches())
@example(torch.tensor([[0.0, -0.0, 0.0]]))
@example(torch.tensor([[2.0**-149, 1e-45, 0.0]]))
@example(torch.tensor([[3.4028235e38, -1.0, 7.0]]))
@example(torch.tensor([[13.0, 0.01904296875]]))  # x / scale is an E4M3 tie
def test_static_at_the_calibrated_amax_equals_dynamic_per_tensor(x):
    """With ``input_scale = amax / 448`` of ``x``, static quantization is dynamic per-tensor
    quantization bit for bit (codes and the decoded activations)."""
    scale = _dynamic_tensor_scale(x)
    assert_bitwise_equal(static_input_qdq(x, scale), input_qdq(x, FP8InputQuant("tensor")))
    assert_bitwise_equal(input_qdq(x, FP8InputQuant("static"), scale), static_input_qdq(x, scale))
    codes = fp8_static_input_quantize(x, scale)
    assert float(codes.float().abs().max()) <= 448.0
    if bool((x != 0).any()) and float(scale) >= 2.0**-126:  # the amax lands on the top code
        assert float(codes.float().abs().max()) == 448.0


@given(token_batches(), SCALES, st.sampled_from([0.0, 1e30, math.inf, -math.inf]))
@example(torch.tensor([[-1e30, 3.0]]), torch.tensor(1.0), math.inf)
@example(torch.tensor([[448.0, 464.0, -480.0]]), torch.tensor(1.0), -0.0)
def test_beyond_the_range_saturates_and_codes_are_finite(x, scale, extra):
    """Whatever lies at or beyond ``448 · input_scale`` becomes ±448 (infinities too); every
    code is finite; signs and zeros are kept."""
    x = torch.cat([x, torch.full((x.shape[0], 1), extra).to(x.dtype)], dim=1)
    codes = fp8_static_input_quantize(x, scale).float()
    assert bool(torch.isfinite(codes).all())
    assert bool((codes.abs() <= 448.0).all())
    ratio = x.double() / scale.double()
    big = ratio.abs() >= 448.0
    assert_bitwise_equal(codes[big], torch.sign(ratio[big]).float() * 448.0)
    assert bool((torch.sign(codes) * torch.sign(x.float()) >= 0).all()), "a sign flipped"
    zeros = x == 0
    assert_bitwise_equal(static_input_qdq(x, scale)[zeros], x[zeros])


@given(token_batches(dtypes=(torch.float32,), elements=SCALABLE), SCALES, power_of_two_exponents())
def test_powers_of_two_pass_through(x, scale, e):
    """Scaling ``x`` and ``input_scale`` by the same power of two scales the result by it and
    leaves the codes unchanged."""
    factor = 2.0**e
    assert_bitwise_equal(
        fp8_static_input_quantize(x * factor, scale * factor), fp8_static_input_quantize(x, scale)
    )
    assert_bitwise_equal(
        static_input_qdq(x * factor, scale * factor), static_input_qdq(x, scale) * factor
    )


@given(token_batches(), SCALES)
def test_qdq_is_idempotent(x, scale):
    """Values already on the grid of ``input_scale`` come back unchanged."""
    once = static_input_qdq(x.float(), scale)
    assert_bitwise_equal(static_input_qdq(once, scale), once)
