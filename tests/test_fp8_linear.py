"""``TorchFP8Linear``: buffers as bytes, construction, forward routes, caches, hooks.

CPU tests cover the stored format, ``from_linear`` for every module kind, the decode route, the
``.to()``/loading policy and disable-on-error. GPU tests check that each ``scaled_mm`` route is
taken where eligible and agrees with the decoded reference within stated tolerances:

* against an emulation of the route (``x`` quantized by the pure function the route mirrors,
  then an FP32 product of the decoded operands): relative Frobenius error < 1e-2, which is
  the output's bf16/fp16 rounding (2**-9 relative) plus FP32 summation order;
* against the decoded weight with ``x`` unquantized (``x @ dequantize_weight().T``): < 0.08
  (E4M3 inputs: each element's relative error is at most 2**-4, about 0.036 RMS).
"""

import dataclasses
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from transformers.pytorch_utils import Conv1D

import floatxq as fq
from floatxq.nn import ROUTES, FP8RouteTuning, TorchFP8Linear
from floatxq.testing import (
    HOPPER_FP8_ACCUMULATION,
    assert_bitwise_equal,
    assert_fp8_linear_close,
    unchecked,
)

SMALL_M = FP8RouteTuning().small_m_rows

LAYOUTS = [("tensor", None), ("row", None), ("block", (16, 32))]
ENCODABLE = ["float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz"]


def _linear(in_features=64, out_features=48, *, bias=True, seed=0, dtype=torch.float32):
    torch.manual_seed(seed)
    layer = nn.Linear(in_features, out_features, bias=bias, dtype=dtype)
    if bias:
        with torch.no_grad():
            layer.bias.uniform_(-3, 3)
    return layer


def _dense_tensors(module: nn.Module) -> list[torch.Tensor]:
    """Every floating, non-FP8 tensor the module keeps between calls (buffers and caches)."""
    kept = [t for t in module.buffers() if not _is_fp8(t)]
    kept += [v for v in module.__dict__.values() if isinstance(v, torch.Tensor)]
    kept += [v for v in module._runtime.prepared.values() if isinstance(v, torch.Tensor)]
    return [t for t in kept if t.is_floating_point() and not _is_fp8(t)]


def _is_fp8(t: torch.Tensor) -> bool:
    return t.dtype in (
        torch.float8_e4m3fn,
        torch.float8_e5m2,
        torch.float8_e4m3fnuz,
        torch.float8_e5m2fnuz,
        torch.float8_e8m0fnu,
    )


# ----------------------------------------------------------------------------------------------
# Buffers and construction
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("method", "block", "scale_shape"),
    [
        ("tensor", None, ()),
        ("row", None, (48,)),
        ("block", (16, 32), (3, 2)),
        (None, (48, 64), (1, 1)),
    ],
)
def test_constructor_allocates_loadable_buffers(method, block, scale_shape):
    layer = TorchFP8Linear(
        64, 48, format="e5m2", weight_scale_method=method, weight_block_size=block
    )
    assert layer.weight.shape == (48, 64) and layer.weight.dtype == torch.float8_e5m2
    assert not bool(layer.weight.float().any())
    assert layer.weight_scale_inv.shape == scale_shape
    assert layer.weight_scale_inv.dtype == torch.float32
    assert bool((layer.weight_scale_inv == 1).all())
    assert layer.bias.dtype == torch.float16 and layer.bias.shape == (48,)
    assert layer.format == "float8_e5m2" and layer.last_route == "none"
    assert layer.weight_block_size == (None if block is None else tuple(block))
    assert list(layer.state_dict()) == ["weight", "weight_scale_inv", "bias"]
    assert TorchFP8Linear(8, 4, bias=False).bias is None


@pytest.mark.parametrize(
    ("args", "kwargs", "error", "match"),
    [
        (
            (64, 48),
            {"weight_scale_method": "block", "weight_block_size": (32, 32)},
            ValueError,
            "not divisible",
        ),
        ((64, 48), {"format": "int8"}, ValueError, "format"),
        ((64, 48), {"weight_scale_method": "column"}, ValueError, "column"),
        ((-1, 48), {}, ValueError, "in_features"),
        ((64, True), {}, TypeError, "out_features"),
        ((64.0, 48), {}, TypeError, "in_features"),
    ],
)
def test_constructor_rejects_bad_arguments(args, kwargs, error, match):
    with pytest.raises(error, match=match):
        unchecked(TorchFP8Linear.__init__)(TorchFP8Linear.__new__(TorchFP8Linear), *args, **kwargs)


@pytest.mark.parametrize("name", ENCODABLE)
@pytest.mark.parametrize(("method", "block"), LAYOUTS)
def test_from_linear_stores_the_pure_functions_bytes(name, method, block):
    dense = _linear(dtype=torch.bfloat16)
    layer = TorchFP8Linear.from_linear(
        dense, format=name, weight_scale_method=method, weight_block_size=block
    )
    want = fq.quantize_fp8_weight(
        dense.weight, format=name, weight_scale_method=method, weight_block_size=block
    )
    assert_bitwise_equal(layer.weight, want.qweight)
    assert_bitwise_equal(layer.weight_scale_inv, want.scale_inv)
    assert_bitwise_equal(layer.bias, dense.bias.detach().half())
    assert (layer.in_features, layer.out_features, layer.format) == (64, 48, name)
    assert layer.weight_scale_method == method
    assert_bitwise_equal(
        layer.dequantize_weight(), fq.dequantize_fp8_weight(want.qweight, want.scale_inv)
    )


def test_from_linear_hf_conv1d_is_transposed():
    torch.manual_seed(1)
    conv = Conv1D(48, 64)  # nf = out, nx = in; weight stored (in, out)
    with torch.no_grad():
        conv.bias.uniform_(-1, 1)
    layer = TorchFP8Linear.from_linear(
        conv, weight_scale_method="block", weight_block_size=(16, 32)
    )
    want = fq.quantize_fp8_weight(
        conv.weight.t(), weight_scale_method="block", weight_block_size=(16, 32)
    )
    assert_bitwise_equal(layer.weight, want.qweight)
    assert_bitwise_equal(layer.weight_scale_inv, want.scale_inv)
    x = torch.randn(2, 5, 64)
    got = layer(x)
    deq = fq.dequantize_fp8_weight(want.qweight, want.scale_inv)
    torch.testing.assert_close(got, x @ deq.T + conv.bias.detach().half().float())
    rel = (got - conv(x)).norm() / conv(x).norm()
    assert rel < 0.05  # FP8 weight rounding only


@pytest.mark.parametrize(
    "conv",
    [
        nn.Conv1d(6, 8, 3, stride=2, padding=1, dilation=2),
        nn.Conv2d(4, 8, (3, 2), stride=(2, 1), padding=(1, 0), groups=2),
        nn.Conv2d(4, 6, 3, padding="same", padding_mode="reflect"),
        nn.Conv2d(4, 6, 3, padding=1, padding_mode="circular", bias=False),
        nn.Conv3d(2, 4, 2, stride=1, padding=1),
    ],
    ids=["conv1d", "conv2d-groups", "conv2d-reflect-same", "conv2d-circular", "conv3d"],
)
def test_from_linear_flattens_convolutions_and_keeps_their_geometry(conv):
    torch.manual_seed(2)
    layer = TorchFP8Linear.from_linear(conv, weight_scale_method="row")
    flat = conv.weight.reshape(conv.weight.shape[0], -1)
    want = fq.quantize_fp8_weight(flat)
    assert layer.weight.shape == flat.shape
    assert_bitwise_equal(layer.weight, want.qweight)
    x = torch.randn(2, conv.in_channels, *([7] * (conv.weight.ndim - 2)))
    deq = fq.dequantize_fp8_weight(want.qweight, want.scale_inv).reshape(conv.weight.shape)
    bias = None if conv.bias is None else conv.bias.detach().half().float()
    reference = conv._conv_forward(x, deq, bias)  # the module's own conv with the decoded weight
    got = layer(x)
    assert got.shape == conv(x).shape
    torch.testing.assert_close(got, reference)
    assert layer.last_route == "conv_dequant" and "convolution" in layer.last_fallback_reason
    assert (got - conv(x)).norm() / conv(x).norm() < 0.05


def test_from_linear_rejects_other_modules():
    for module in (nn.ConvTranspose2d(2, 2, 3), nn.Embedding(4, 4), TorchFP8Linear(4, 4)):
        with pytest.raises(TypeError, match="from_linear"):
            TorchFP8Linear.from_linear(module)
    with pytest.raises(ValueError, match="decode-only"):
        TorchFP8Linear.from_linear(_linear(), format="e8m0")
    with pytest.raises(ValueError, match="not divisible"):
        TorchFP8Linear.from_linear(
            _linear(), weight_scale_method="block", weight_block_size=(32, 32)
        )


def test_bias_outside_fp16_range_is_an_error_not_inf():
    dense = _linear()
    with torch.no_grad():
        dense.bias[3] = 70000.0
    with pytest.raises(ValueError, match="float16"):
        TorchFP8Linear.from_linear(dense)
    with torch.no_grad():
        dense.bias[3] = float("inf")
    with pytest.raises(ValueError, match="finite"):
        TorchFP8Linear.from_linear(dense)
    with torch.no_grad():
        dense.bias[3] = -65504.0  # the largest magnitude FP16 holds is fine
    assert TorchFP8Linear.from_linear(dense).bias[3].item() == -65504.0


def test_from_quantized_infers_or_checks_the_layout():
    w = _linear(64, 48).weight.detach()
    for method, block, scale_shape in [
        ("tensor", None, (1,)),
        ("row", None, (48,)),
        ("block", (16, 32), (3, 2)),
    ]:
        q = fq.quantize_fp8_weight(w, weight_scale_method=method, weight_block_size=block)
        layer = TorchFP8Linear.from_quantized(q.qweight, q.scale_inv.reshape(scale_shape))
        assert layer.weight_scale_method == method
        assert layer.weight_block_size == block
        assert_bitwise_equal(layer.dequantize_weight(), fq.dequantize_fp8_weight(*q))
    q = fq.quantize_fp8_weight(w, weight_scale_method="block", weight_block_size=(16, 32))
    flat = TorchFP8Linear.from_quantized(
        q.qweight, q.scale_inv.flatten(), weight_block_size=(16, 32)
    )
    assert flat.weight_scale_inv.shape == (3, 2)
    half = TorchFP8Linear.from_quantized(q.qweight, q.scale_inv.half())
    assert half.weight_scale_inv.dtype == torch.float32
    with pytest.raises(ValueError, match="does not fit"):
        TorchFP8Linear.from_quantized(q.qweight, q.scale_inv.t(), weight_block_size=(16, 32))
    with pytest.raises(ValueError, match="fits no layout"):
        TorchFP8Linear.from_quantized(q.qweight, torch.ones(5))
    with pytest.raises(ValueError, match="> 0"):
        TorchFP8Linear.from_quantized(q.qweight, torch.zeros(3, 2))
    with pytest.raises(TypeError, match="FP8"):
        unchecked(TorchFP8Linear.from_quantized)(w, q.scale_inv)
    with pytest.raises(ValueError, match="float16"):
        TorchFP8Linear.from_quantized(q.qweight, q.scale_inv, torch.full((48,), 1e5))


def test_empty_like_shapes_a_module_to_load_into():
    conv = nn.Conv2d(4, 8, 3, padding=1)
    empty = TorchFP8Linear.empty_like(conv, weight_scale_method="tensor")
    full = TorchFP8Linear.from_linear(conv, weight_scale_method="tensor")
    empty.load_state_dict(full.state_dict())
    x = torch.randn(1, 4, 5, 5)
    assert_bitwise_equal(empty(x), full(x))


# ----------------------------------------------------------------------------------------------
# Forward on CPU: the decode route
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize(("method", "block"), LAYOUTS)
def test_dequant_route_is_the_decoded_linear_in_x_dtype(dtype, method, block):
    layer = TorchFP8Linear.from_linear(
        _linear(), weight_scale_method=method, weight_block_size=block
    )
    x = torch.randn(2, 3, 64).to(dtype)
    got = layer(x)
    assert got.dtype == dtype and got.shape == (2, 3, 48)
    want = F.linear(x, layer.dequantize_weight(dtype=dtype), layer.bias.to(dtype))
    assert_bitwise_equal(got, want)
    assert layer.last_route == "dequant_matmul"
    assert "cpu" in layer.last_fallback_reason and "optimize()" in layer.last_fallback_reason
    assert layer.last_route in ROUTES


def test_dequant_route_keeps_no_dense_weight_between_calls():
    layer = TorchFP8Linear.from_linear(_linear(256, 128), weight_scale_method="row")
    for dtype in (torch.float32, torch.bfloat16):
        layer(torch.randn(4, 256, dtype=dtype))
        kept = _dense_tensors(layer)
        assert all(t.numel() < 256 * 128 for t in kept), [tuple(t.shape) for t in kept]


def test_e8m0_codes_decode_through_the_module():
    codes = torch.tensor([[127, 128], [126, 130]], dtype=torch.uint8).view(torch.float8_e8m0fnu)
    layer = TorchFP8Linear.from_quantized(codes, torch.tensor([1.0, 4.0]))
    assert layer.format == "float8_e8m0fnu"
    got = layer(torch.tensor([[1.0, 1.0]]))
    torch.testing.assert_close(got, torch.tensor([[3.0, (0.5 + 8.0) / 4.0]]))


def test_empty_inputs_and_empty_weights():
    layer = TorchFP8Linear.from_linear(_linear())
    assert layer(torch.randn(0, 64)).shape == (0, 48)
    assert layer(torch.randn(3, 0, 64)).shape == (3, 0, 48)
    no_inputs = TorchFP8Linear.from_linear(_linear(0, 5))
    out = no_inputs(torch.randn(2, 0))
    assert_bitwise_equal(out, no_inputs.bias.float().expand(2, 5).contiguous())


def test_forward_rejects_bad_inputs():
    layer = TorchFP8Linear.from_linear(_linear())
    forward = unchecked(TorchFP8Linear.forward)
    with pytest.raises(TypeError, match="floating"):
        forward(layer, torch.ones(2, 64, dtype=torch.int64))
    with pytest.raises(ValueError, match=r"\(\*, 64\)"):
        forward(layer, torch.ones(2, 63))
    with pytest.raises(ValueError, match=r"\(\*, 64\)"):
        forward(layer, torch.tensor(1.0))


class LoRA(nn.Module):
    """A LoRA adapter as a module: ``out + B(A(x))``."""

    def __init__(self, in_features: int, out_features: int, rank: int = 4) -> None:
        super().__init__()
        self.a = nn.Linear(in_features, rank, bias=False)
        self.b = nn.Linear(rank, out_features, bias=False)

    def forward(self, x_flat: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        return out + self.b(self.a(x_flat.to(self.a.weight.dtype))).to(out.dtype)


def test_adapter_runs_after_bias_on_flattened_inputs():
    layer = TorchFP8Linear.from_linear(_linear())
    seen = {}
    lora_a, lora_b = torch.randn(4, 64), torch.randn(48, 4)

    def adapter(x_flat, out):
        seen["x"], seen["out"] = x_flat.clone(), out.clone()
        return out + x_flat @ lora_a.T @ lora_b.T

    x = torch.randn(2, 3, 64)
    plain = layer(x)
    layer.adapter = adapter
    got = layer(x)
    assert seen["x"].shape == (6, 64) and seen["out"].shape == (6, 48)
    assert_bitwise_equal(seen["out"], plain.reshape(6, 48))  # bias already added
    torch.testing.assert_close(got, plain + (x @ lora_a.T @ lora_b.T))
    lora = LoRA(64, 48)
    layer.adapter = lora  # a module adapter is a submodule: it moves and loads with the layer
    assert "adapter.a.weight" in layer.state_dict()
    torch.testing.assert_close(layer(x), plain + lora.b(lora.a(x)))


@pytest.fixture
def no_type_check_wrappers():
    """torch.compile cannot trace the test run's jaxtyping/beartype wrappers (production code
    carries none), so the compiled-path tests switch the checks off while they run."""
    import jaxtyping

    before = jaxtyping.config.jaxtyping_disable
    jaxtyping.config.update("jaxtyping_disable", True)
    yield
    jaxtyping.config.update("jaxtyping_disable", before)


def test_optimize_compiles_the_cpu_forward(no_type_check_wrappers):
    layer = TorchFP8Linear.from_linear(
        _linear(), weight_scale_method="block", weight_block_size=(16, 32)
    )
    assert layer.optimize(backend="aot_eager") is layer
    x = torch.randn(5, 64)
    got = layer(x)
    assert layer.last_route == "compiled_cpu" and layer.last_fallback_reason is None
    torch.testing.assert_close(got, x @ layer.dequantize_weight().T + layer.bias.float())
    assert all(t.numel() < 64 * 48 for t in _dense_tensors(layer))


@pytest.mark.slow
def test_optimize_with_inductor(no_type_check_wrappers):
    layer = TorchFP8Linear.from_linear(_linear(128, 64)).optimize()
    x = torch.randn(7, 128)
    got = layer(x)
    assert layer.last_route == "compiled_cpu", layer.last_fallback_reason
    torch.testing.assert_close(got, x @ layer.dequantize_weight().T + layer.bias.float())


def _failing_compile(calls):
    def compile(fn, **kwargs):
        def broken(*args):
            calls.append(kwargs)
            raise RuntimeError("no compiler here")

        return broken

    return compile


def test_compiled_path_disables_on_error_and_moves_reset_it(monkeypatch):
    calls = []
    monkeypatch.setattr(torch, "compile", _failing_compile(calls))
    layer = TorchFP8Linear.from_linear(_linear()).optimize()
    x = torch.randn(3, 64)
    reference = F.linear(x, layer.dequantize_weight(), layer.bias.float())
    with pytest.warns(RuntimeWarning, match="no compiler here"):
        got = layer(x)
    assert_bitwise_equal(got, reference)
    assert layer.last_route == "dequant_matmul"
    assert "disabled after an error" in layer.last_fallback_reason
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # disabled: no second attempt, no second warning
        layer(x)
    assert len(calls) == 1 and "no compiler here" in layer.last_fallback_reason
    layer.float()  # buffers "move": caches and switches are dropped, the opt-in stays
    with pytest.warns(RuntimeWarning):
        layer(x)
    assert len(calls) == 2
    layer.load_state_dict(layer.state_dict())  # loading drops them too
    with pytest.warns(RuntimeWarning):
        layer(x)
    assert len(calls) == 3
    layer.optimize()  # and so does a new opt-in
    with pytest.warns(RuntimeWarning):
        layer(x)
    assert len(calls) == 4


# ----------------------------------------------------------------------------------------------
# .to() and state dicts: bytes, never casts
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "move",
    [
        lambda m: m.to(torch.bfloat16),
        lambda m: m.half(),
        lambda m: m.float(),
        lambda m: m.double(),
        lambda m: m.to("cpu", torch.float16),
        lambda m: m.to(dtype=torch.float64),
    ],
    ids=["to-bf16", "half", "float", "double", "to-cpu-fp16", "to-dtype-f64"],
)
def test_dtype_casts_leave_the_stored_format_alone(move):
    layer = TorchFP8Linear.from_linear(
        _linear(), format="e5m2", weight_scale_method="block", weight_block_size=(16, 32)
    )
    layer.adapter = LoRA(64, 48)  # a submodule: unlike the stored buffers, it follows casts
    before = {k: v.clone() for k, v in layer.state_dict().items() if not k.startswith("adapter")}
    layer(torch.randn(2, 64))
    assert layer._runtime.prepared  # a cache to drop
    moved = move(layer)
    assert moved is layer
    for key, tensor in before.items():
        assert_bitwise_equal(getattr(layer, key), tensor, msg=key)
    assert layer.weight.dtype == torch.float8_e5m2
    assert layer.weight_scale_inv.dtype == torch.float32
    assert layer.bias.dtype == torch.float16
    assert layer.adapter.a.weight.dtype == move(nn.Linear(1, 1)).weight.dtype
    assert not layer._runtime.prepared
    assert layer(torch.randn(2, 64)).dtype == torch.float32


def test_state_dict_round_trip_and_checks():
    layer = TorchFP8Linear.from_linear(
        _linear(), weight_scale_method="block", weight_block_size=(16, 32)
    )
    state = layer.state_dict()
    fresh = TorchFP8Linear(64, 48, weight_scale_method="block", weight_block_size=(16, 32))
    fresh(torch.randn(1, 64))
    assert fresh._runtime.prepared
    fresh.load_state_dict(state)
    assert not fresh._runtime.prepared
    x = torch.randn(3, 64)
    assert_bitwise_equal(fresh(x), layer(x))
    wrong = TorchFP8Linear(
        64, 48, format="e5m2", weight_scale_method="block", weight_block_size=(16, 32)
    )
    before = wrong.weight.clone()
    with pytest.raises(RuntimeError, match="never cast"):
        wrong.load_state_dict(state)
    assert_bitwise_equal(wrong.weight, before)  # untouched, not cast
    too_big = dict(state, bias=torch.full((48,), 1e6))
    with pytest.raises(RuntimeError, match="float16"):
        TorchFP8Linear(
            64, 48, weight_scale_method="block", weight_block_size=(16, 32)
        ).load_state_dict(too_big)
    bf16_bias = dict(state, bias=state["bias"].to(torch.bfloat16))
    for assign in (False, True):
        target = TorchFP8Linear(64, 48, weight_scale_method="block", weight_block_size=(16, 32))
        target.load_state_dict(bf16_bias, assign=assign)
        assert target.bias.dtype == torch.float16
        assert_bitwise_equal(target.bias, state["bias"].to(torch.bfloat16).half())


# ----------------------------------------------------------------------------------------------
# The CUDA routes' control flow on CPU: the policy told the calls run on an H100 with Triton
# ----------------------------------------------------------------------------------------------


@pytest.fixture
def as_if_on_h100(monkeypatch):
    """The module's route policy sees its CPU calls as an H100's (Triton importable): choosing,
    building runners, switching a failing route off and falling back all run as on the GPU,
    with torch's CPU ``_scaled_mm`` in cuBLAS's place (skipped where this torch has none)."""
    import floatxq.nn.fp8_linear as module

    codes = torch.ones(16, 16).to(torch.float8_e4m3fn)
    try:
        torch._scaled_mm(codes, codes.t(), torch.ones(16, 1), torch.ones(1, 16), None, None,
                         torch.bfloat16)  # fmt: skip
    except Exception as exc:  # no CPU scaled_mm in this torch
        pytest.skip(f"torch._scaled_mm does not run on CPU here: {exc}")
    real = module.select_fp8_route

    def select(facts, *, tuning):
        h100 = dataclasses.replace(
            facts, device_type="cuda", capability=(9, 0), small_m_unavailable=None
        )
        return real(h100, tuning=tuning)

    monkeypatch.setattr(module, "select_fp8_route", select)


def _broken(message):
    def broken(*args, **kwargs):
        raise RuntimeError(message)

    return broken


@pytest.mark.parametrize(("method", "recipe"), [("tensor", "tensorwise"), ("row", "rowwise")])
def test_scaled_mm_routes_run_their_recipe(as_if_on_h100, method, recipe):
    layer = TorchFP8Linear.from_linear(_linear(), weight_scale_method=method)
    x = torch.randn(2 * SMALL_M, 64, dtype=torch.bfloat16)
    got = layer(x)
    assert (layer.last_route, layer.last_fallback_reason) == (f"scaled_mm_{recipe}", None)
    assert_fp8_linear_close(
        got, x, layer.weight, layer.weight_scale_inv, layer.bias.to(x.dtype), recipe=recipe
    )


def test_a_failing_small_m_kernel_falls_back_to_its_scaled_mm_route(as_if_on_h100, monkeypatch):
    import floatxq.kernels.fp8_routes as routes

    monkeypatch.setattr(routes, "small_m_launch", _broken("no such kernel"))
    layer = TorchFP8Linear.from_linear(_linear(), weight_scale_method="row")
    x = torch.randn(4, 64, dtype=torch.bfloat16)
    with pytest.warns(RuntimeWarning, match="fp8_small_m raised .* now uses scaled_mm_rowwise"):
        got = layer(x)
    assert layer.last_route == "scaled_mm_rowwise"
    assert layer.last_fallback_reason == (
        "fp8_small_m: disabled after an error (RuntimeError: no such kernel)"
    )
    assert_fp8_linear_close(
        got, x, layer.weight, layer.weight_scale_inv, layer.bias.to(x.dtype), recipe="rowwise"
    )
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # switched off for bf16: no second attempt, no warning
        layer(x)
    assert layer.last_route == "scaled_mm_rowwise"
    layer(torch.randn(32, 64, dtype=torch.bfloat16))  # prefill never wanted the kernel
    assert (layer.last_route, layer.last_fallback_reason) == ("scaled_mm_rowwise", None)
    with pytest.warns(RuntimeWarning, match="for torch.float16 inputs"):
        layer(x.half())  # fp16 tries the kernel for itself
    layer.float()  # a move drops the switches: the kernel is tried again
    with pytest.warns(RuntimeWarning, match="no such kernel"):
        layer(x)
    monkeypatch.setattr(torch, "_scaled_mm", _broken("cuBLAS says no"))  # bound when built
    fresh = TorchFP8Linear.from_linear(_linear(), weight_scale_method="row")
    with pytest.warns(RuntimeWarning) as caught:  # both fast routes fail in one call
        got = fresh(x)
    assert [str(w.message).split(" raised")[0] for w in caught] == [
        "TorchFP8Linear: fp8_small_m",
        "TorchFP8Linear: scaled_mm_rowwise",
    ]
    assert "now uses dequant_matmul" in str(caught[1].message)
    assert fresh.last_route == "dequant_matmul"
    reason = fresh.last_fallback_reason
    assert reason.startswith("scaled_mm_rowwise (and fp8_small_m, which takes its recipe): ")
    assert "cuBLAS says no" in reason
    assert_bitwise_equal(
        got, F.linear(x, fresh.dequantize_weight(dtype=x.dtype), fresh.bias.to(x.dtype))
    )


# ----------------------------------------------------------------------------------------------
# GPU: routes, gates, tolerances
# ----------------------------------------------------------------------------------------------


def _route_layer(method, block, *, name="float8_e4m3fn", n=384, k=512, seed=0):
    dense = _linear(k, n, seed=seed).cuda()
    return dense, TorchFP8Linear.from_linear(
        dense, format=name, weight_scale_method=method, weight_block_size=block
    )


def _emulated(layer, x, *, x_format, x_method, x_block):
    """The route's arithmetic in FP32: x through the pure quantizer, both operands decoded."""
    xq = fq.quantize_fp8_weight(
        x, format=x_format, weight_scale_method=x_method, weight_block_size=x_block
    )
    x_deq = fq.dequantize_fp8_weight(*xq)
    return x_deq @ layer.dequantize_weight().T + layer.bias.float()


def _rel(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm())


ROUTE_CASES = [
    ("tensor", None, "float8_e4m3fn", "scaled_mm_tensorwise", ("float8_e4m3fn", "tensor", None)),
    ("row", None, "float8_e4m3fn", "scaled_mm_rowwise", ("float8_e4m3fn", "row", None)),
    ("row", None, "float8_e5m2", "scaled_mm_rowwise", ("float8_e4m3fn", "row", None)),
    (
        "block",
        (128, 128),
        "float8_e4m3fn",
        "scaled_mm_blockwise",
        ("float8_e4m3fn", "block", (1, 128)),
    ),
]


@pytest.mark.gpu
@pytest.mark.parametrize(("method", "block", "name", "route", "x_quant"), ROUTE_CASES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_scaled_mm_routes_match_the_decoded_reference(method, block, name, route, x_quant, dtype):
    _, layer = _route_layer(method, block, name=name)
    recipe = {"tensor": "tensorwise", "row": "rowwise", "block": "blockwise"}[method]
    for small_m in (True, False):  # rows <= SMALL_M take the fused kernel unless it is off
        if not small_m:
            layer._runtime.switch_off("fp8_small_m", dtype, "off for this test")
        for m in (1, 8, 16, 33, 256, 8, 1):  # repeated sizes reuse the bound route and launch
            x = torch.randn(2, m, 512, device="cuda").to(dtype)
            got = layer(x)
            rows = 2 * m
            expected = "fp8_small_m" if small_m and rows <= SMALL_M else route
            assert layer.last_route == expected, layer.last_fallback_reason
            if small_m or rows > SMALL_M:  # the fastest candidate ran
                assert layer.last_fallback_reason is None
            else:  # the fused kernel would have: the reason says why it did not
                assert "fp8_small_m: off for this test" in layer.last_fallback_reason
            assert got.dtype == dtype and got.shape == (2, m, 384)
            flat = x.reshape(-1, 512)
            assert_fp8_linear_close(
                got.reshape(-1, 384), flat, layer.weight, layer.weight_scale_inv,
                layer.bias.to(dtype), recipe=recipe, msg=expected,
                accumulation=HOPPER_FP8_ACCUMULATION,
            )  # fmt: skip
            x_format, x_method, x_block = x_quant
            emulated = _emulated(
                layer, flat.float(), x_format=x_format, x_method=x_method, x_block=x_block
            )
            assert _rel(got.reshape(-1, 384), emulated) < 1e-2
            decoded = flat.float() @ layer.dequantize_weight().T + layer.bias.float()
            assert _rel(got.reshape(-1, 384), decoded) < 0.08


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("kwargs", "shape", "dtype", "reason"),
    [
        ({"weight_scale_method": "tensor"}, (512, 384), torch.float32, "float16/bfloat16"),
        ({"weight_scale_method": "row"}, (520, 384), torch.bfloat16, "multiples of 16"),
        ({"weight_scale_method": "tensor", "format": "e5m2"}, (512, 384), torch.bfloat16, "e5m2"),
        ({"weight_scale_method": "row", "format": "e4m3fnuz"}, (512, 384), torch.bfloat16, "fnuz"),
        (
            {"weight_scale_method": "block", "weight_block_size": (64, 64)},
            (512, 384),
            torch.bfloat16,
            "[128, 128]",
        ),
        (
            {"weight_scale_method": "block", "weight_block_size": (128, 128), "format": "e5m2"},
            (512, 384),
            torch.bfloat16,
            "float8_e4m3fn only",
        ),
    ],
)
def test_ineligible_inputs_fall_back_with_a_reason(kwargs, shape, dtype, reason):
    k, n = shape
    layer = TorchFP8Linear.from_linear(_linear(k, n).cuda(), **kwargs)
    x = torch.randn(3, k, device="cuda", dtype=dtype)
    got = layer(x)
    assert layer.last_route == "dequant_matmul"
    assert reason in layer.last_fallback_reason
    assert_bitwise_equal(
        got, F.linear(x, layer.dequantize_weight(dtype=dtype), layer.bias.to(dtype))
    )


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("method", "block"), [("tensor", None), ("row", None), ("block", (128, 128))]
)
def test_routes_rebind_when_a_buffer_is_replaced(method, block):
    # A route binds its weight-side operands (direct scales, the cast bias) on first use;
    # assigning a new buffer must not leave the old ones in use.
    bias = _linear(512, 384, seed=0).bias.detach().cuda().half().float()
    cases = ((SMALL_M, "fp8_small_m"), (4 * SMALL_M, f"scaled_mm_{_route_name(method)}"))
    for rows, route in cases:
        _, layer = _route_layer(method, block)
        x = torch.randn(rows, 512, device="cuda", dtype=torch.bfloat16)
        first = layer(x).float()
        layer.weight_scale_inv = layer.weight_scale_inv * 2  # the decoded weight halves, exactly
        layer.bias = torch.zeros_like(layer.bias)
        second = layer(x).float()
        assert layer.last_route == route, layer.last_fallback_reason
        assert _rel(second, (first - bias) / 2) < 1e-2


@pytest.mark.gpu
def test_a_failing_scaled_mm_disables_the_route_for_that_dtype(monkeypatch):
    _, layer = _route_layer("tensor", None)
    x = torch.randn(4 * SMALL_M, 512, device="cuda", dtype=torch.bfloat16)
    real = torch._scaled_mm

    def broken(*args, **kwargs):
        raise RuntimeError("cuBLAS says no")

    monkeypatch.setattr(torch, "_scaled_mm", broken)
    with pytest.warns(RuntimeWarning, match="cuBLAS says no"):
        got = layer(x)
    assert layer.last_route == "dequant_matmul" and "cuBLAS says no" in layer.last_fallback_reason
    assert_bitwise_equal(
        got, F.linear(x, layer.dequantize_weight(dtype=x.dtype), layer.bias.to(x.dtype))
    )
    monkeypatch.setattr(torch, "_scaled_mm", real)
    layer(x)
    assert layer.last_route == "dequant_matmul"  # still off for bf16 on this module
    layer(x.half())
    assert layer.last_route == "scaled_mm_tensorwise"  # fp16 was never disabled
    layer.cuda()  # a move drops the switch
    layer(x)
    assert layer.last_route == "scaled_mm_tensorwise"


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("method", "block", "rows", "captured"),
    [
        ("tensor", None, 1, "fp8_small_m"),
        ("tensor", None, 4, "scaled_mm_tensorwise"),
        ("row", None, 4, "fp8_small_m"),
        ("block", (128, 128), 4, "fp8_small_m"),
        ("block", (128, 128), 4 * SMALL_M, "scaled_mm_blockwise"),
    ],
)
def test_graph_capture_takes_the_faster_gpu_route(method, block, rows, captured):
    # Eager small-M calls take the one-launch kernel; inside a CUDA graph capture only calls
    # where it is also the faster GPU code keep it (tensorwise: one row), the others cuBLAS.
    _, layer = _route_layer(method, block, seed=3)
    x = torch.randn(rows, 512, device="cuda", dtype=torch.bfloat16)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up as torch's CUDA-graph notes ask (eager, side stream)
        layer(x)
    torch.cuda.current_stream().wait_stream(side)
    assert layer.last_route == ("fp8_small_m" if rows <= SMALL_M else captured)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = layer(x)
    assert layer.last_route == captured, layer.last_fallback_reason
    for seed in range(2):  # replays read x's storage: new values, new result
        x.copy_(torch.randn(rows, 512, generator=torch.Generator().manual_seed(seed)))
        graph.replay()
        torch.cuda.synchronize()
        assert_fp8_linear_close(
            out, x, layer.weight, layer.weight_scale_inv, layer.bias.to(x.dtype),
            recipe=_route_name(method), accumulation=HOPPER_FP8_ACCUMULATION,
        )  # fmt: skip


@pytest.mark.gpu
def test_small_m_kernel_falls_back_to_scaled_mm(monkeypatch):
    import floatxq.kernels.fp8_routes as routes
    import floatxq.nn.fp8_linear as module

    _, layer = _route_layer("row", None)
    x = torch.randn(3, 512, device="cuda", dtype=torch.bfloat16)

    def broken(*args):
        raise RuntimeError("no such kernel")

    monkeypatch.setattr(routes, "small_m_launch", broken)
    with pytest.warns(RuntimeWarning, match="now uses scaled_mm_rowwise"):
        got = layer(x)
    assert layer.last_route == "scaled_mm_rowwise"
    assert "fp8_small_m: disabled after an error" in layer.last_fallback_reason
    assert "no such kernel" in layer.last_fallback_reason
    assert_fp8_linear_close(
        got, x, layer.weight, layer.weight_scale_inv, layer.bias.to(x.dtype), recipe="rowwise",
        accumulation=HOPPER_FP8_ACCUMULATION,
    )  # fmt: skip
    with pytest.warns(RuntimeWarning, match="no such kernel"):
        layer(x.half())
    assert layer.last_route == "scaled_mm_rowwise"  # the kernel still fails for fp16 ...
    monkeypatch.undo()
    layer(x)
    assert layer.last_route == "scaled_mm_rowwise"  # ... and stays off for bf16 on this module
    _, fresh = _route_layer("row", None)
    monkeypatch.setattr(module, "triton_unavailable_reason", lambda device: "no Triton here")
    fresh(x)
    assert fresh.last_route == "scaled_mm_rowwise"
    assert fresh.last_fallback_reason == "fp8_small_m: no Triton here"


@pytest.mark.gpu
def test_device_moves_carry_bytes_and_forward_follows():
    layer = TorchFP8Linear.from_linear(_linear(512, 384), weight_scale_method="tensor")
    before = {k: v.clone() for k, v in layer.state_dict().items()}
    layer.to("cuda", torch.bfloat16)
    for key, tensor in before.items():
        assert getattr(layer, key).is_cuda
        assert_bitwise_equal(getattr(layer, key).cpu(), tensor, msg=key)
    x = torch.randn(8, 512, device="cuda", dtype=torch.bfloat16)
    layer(x)
    assert layer.last_route == "fp8_small_m"
    with pytest.raises(TypeError, match="buffers are on"):
        unchecked(TorchFP8Linear.forward)(layer, x.cpu())
    layer.cpu()
    assert layer(x.cpu()).device.type == "cpu"
    assert layer.last_route == "dequant_matmul"


@pytest.mark.gpu
def test_from_linear_on_cuda_uses_the_kernel_bytes():
    dense = _linear(512, 384, dtype=torch.bfloat16)
    for method, block in (("tensor", None), ("row", None), ("block", (128, 128))):
        cpu = TorchFP8Linear.from_linear(dense, weight_scale_method=method, weight_block_size=block)
        gpu = TorchFP8Linear.from_linear(
            dense.cuda(), weight_scale_method=method, weight_block_size=block
        )
        assert gpu.weight.is_cuda
        assert_bitwise_equal(gpu.weight.cpu(), cpu.weight)
        assert_bitwise_equal(gpu.weight_scale_inv.cpu(), cpu.weight_scale_inv)
        dense = dense.cpu()


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("method", "block"), [("tensor", None), ("row", None), ("block", (128, 128))]
)
def test_no_dense_weight_survives_a_call_on_cuda(method, block):
    _, layer = _route_layer(method, block, n=1024, k=1024)
    forced = TorchFP8Linear.from_linear(
        _linear(1024, 1024).cuda(), weight_scale_method=method, weight_block_size=block
    )
    forced._runtime.switch_off(f"scaled_mm_{_route_name(method)}", torch.bfloat16, "test")
    x = torch.randn(64, 1024, device="cuda", dtype=torch.bfloat16)
    for module in (layer, forced):
        module(x)  # warm caches
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        out = module(x)
        del out
        torch.cuda.synchronize()
        assert torch.cuda.memory_allocated() - before < 1024 * 1024  # < half a bf16 weight
    assert forced.last_route == "dequant_matmul"


def _route_name(method):
    return {"tensor": "tensorwise", "row": "rowwise", "block": "blockwise"}[method]


@pytest.mark.gpu
def test_convolutions_run_on_cuda():
    conv = nn.Conv2d(8, 16, 3, padding=1, groups=2).cuda()
    layer = TorchFP8Linear.from_linear(conv, weight_scale_method="tensor")
    x = torch.randn(2, 8, 9, 9, device="cuda", dtype=torch.bfloat16)
    got = layer(x)
    assert layer.last_route == "conv_dequant" and got.dtype == torch.bfloat16
    deq = layer.dequantize_weight(dtype=torch.bfloat16).reshape(conv.weight.shape)
    assert_bitwise_equal(got, F.conv2d(x, deq, layer.bias.bfloat16(), 1, 1, 1, 2))


def test_bad_scales_are_refused_by_load_state_dict():
    # checked once at load, so the forward routes decode without a per-call check or sync
    layer = TorchFP8Linear.from_linear(torch.nn.Linear(32, 16))
    state = layer.state_dict()
    for bad in (0.0, -1.0, float("nan"), float("inf")):
        broken = dict(state)
        broken["weight_scale_inv"] = state["weight_scale_inv"].clone()
        broken["weight_scale_inv"][3] = bad
        with pytest.raises(RuntimeError, match="weight_scale_inv: inverse scales must be finite"):
            TorchFP8Linear(32, 16).load_state_dict(broken)
    TorchFP8Linear(32, 16).load_state_dict(state)
