"""``TorchFP8Linear`` with static FP8 activations: ``input_quant="static"`` and its ``input_scale``
buffer (the W8A8 of llm-compressor's ``FP8`` scheme, ModelOpt's ``FP8`` and transformers'
``activation_scheme: static``)."""

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from floatxq.fp8 import dequantize_fp8_weight
from floatxq.fp8_activation import FP8InputQuant, static_input_qdq
from floatxq.nn import TorchFP8Linear
from floatxq.testing import assert_bitwise_equal


def _static(method: str = "tensor", scale: float = 0.01, **kw) -> TorchFP8Linear:
    torch.manual_seed(0)
    return TorchFP8Linear.from_linear(
        nn.Linear(64, 32),
        weight_scale_method=method,
        input_quant="static",
        input_scale=torch.tensor(scale),
        **kw,
    )


@pytest.mark.parametrize("method", ["tensor", "row"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_forward_multiplies_the_statically_quantized_input(method, dtype):
    layer = _static(method)
    x = (torch.randn(5, 64) * 3).to(dtype)  # some values beyond 448 * 0.01: saturated
    weight = dequantize_fp8_weight(layer.weight, layer.weight_scale_inv, dtype=dtype)
    expected = F.linear(static_input_qdq(x, layer.input_scale), weight, layer.bias.to(dtype))
    assert_bitwise_equal(layer(x), expected)
    assert layer.input_quant == FP8InputQuant("static")
    assert layer.last_activations == (
        "fp8 e4m3 static per tensor (quantize-dequantize), then the decoded weight"
    )
    assert "static" in layer.last_fallback_reason


def test_the_scale_changes_the_output():
    coarse, fine = _static(scale=0.05), _static(scale=0.001)
    x = torch.randn(3, 64)
    assert not torch.equal(coarse(x), fine(x))
    weight_only = TorchFP8Linear.from_quantized(coarse.weight, coarse.weight_scale_inv, coarse.bias)
    assert not torch.equal(coarse(x), weight_only(x))


def test_state_dict_round_trips_as_bytes():
    layer = _static(scale=0.0123)
    state = layer.state_dict()
    assert list(state) == ["weight", "weight_scale_inv", "bias", "input_scale"]
    assert state["input_scale"].dtype == torch.float32 and state["input_scale"].shape == ()
    fresh = TorchFP8Linear(64, 32, weight_scale_method="tensor", input_quant="static")
    fresh.load_state_dict(state)
    assert_bitwise_equal(fresh.input_scale, layer.input_scale)
    x = torch.randn(4, 64)
    assert_bitwise_equal(fresh(x), layer(x))
    # a one-element (1,) scale, as compressed-tensors stores it, loads as the 0-d buffer
    fresh.load_state_dict({**state, "input_scale": state["input_scale"].reshape(1)})
    assert fresh.input_scale.shape == ()
    moved = layer.half()  # a cast moves the scale as bytes: it stays FP32
    assert moved.input_scale.dtype == torch.float32
    assert_bitwise_equal(moved.input_scale, state["input_scale"])


def test_replacing_the_scale_rebuilds_the_route():
    layer = _static(scale=0.01)
    x = torch.randn(2, 64)
    before = layer(x)
    layer.input_scale = torch.tensor(0.03)  # (not 0.02: powers of two pass through)
    assert not torch.equal(layer(x), before)
    assert_bitwise_equal(layer(x), _static(scale=0.03)(x))


def test_switching_in_and_out_of_static():
    layer = TorchFP8Linear.from_linear(nn.Linear(64, 32))
    with pytest.raises(ValueError, match="use_static_input"):
        layer.input_quant = "static"
    layer.use_static_input(0.5)
    assert layer.input_quant == FP8InputQuant("static") and float(layer.input_scale) == 0.5
    layer.input_quant = "token"
    assert layer.input_scale is None and "input_scale" not in layer.state_dict()


@pytest.mark.parametrize("bad", [0.0, -1.0, float("nan"), float("inf")])
def test_bad_scales_are_refused(bad):
    with pytest.raises(ValueError, match="input_scale must be finite and > 0"):
        _static(scale=bad)
    layer = _static()
    state = {**layer.state_dict(), "input_scale": torch.tensor(bad)}
    with pytest.raises(RuntimeError, match="static input scale must be finite"):
        layer.load_state_dict(state)


def test_the_scale_is_given_exactly_for_static(production_checks):
    linear = nn.Linear(64, 32)
    with pytest.raises(ValueError, match="given exactly for input_quant 'static'"):
        TorchFP8Linear.from_linear(linear, input_quant="static")
    with pytest.raises(ValueError, match="given exactly for input_quant 'static'"):
        TorchFP8Linear.from_linear(linear, input_quant="token", input_scale=0.1)
    with pytest.raises(ValueError, match="one value"):
        TorchFP8Linear.from_linear(linear, input_quant="static", input_scale=torch.ones(2))
    conv = TorchFP8Linear.from_linear(nn.Conv1d(4, 8, 3))
    with pytest.raises(ValueError, match="convolution"):
        conv.use_static_input(0.1)
