"""TorchFP4Linear: buffers, the decode forward, dtype casts, state_dict, from_linear quality."""

import importlib.util

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from floatxq.dispatch import decode as dispatch  # the facts its route choice reads
from floatxq.kernels._triton import triton_unavailable_reason
from floatxq.nn import fp4_linear
from floatxq.nn.fp4_linear import TorchFP4Linear
from floatxq.nvfp4.layouts import NVFP4Weight
from floatxq.nvfp4.quantize import nvfp4_dequantize, nvfp4_global_scale, nvfp4_quantize
from floatxq.testing import assert_bitwise_equal

E4M3 = torch.float8_e4m3fn


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def random_layer(out_features=24, in_features=64, *, bias=True, seed=0, dtype=torch.bfloat16):
    """A layer with arbitrary codes, positive finite E4M3 scales and a non-trivial tensor scale."""
    g = _gen(seed)
    w = NVFP4Weight(
        torch.randint(0, 256, (out_features, in_features // 2), generator=g, dtype=torch.uint8),
        torch.randint(
            1, 127, (out_features, in_features // 16), generator=g, dtype=torch.uint8
        ).view(E4M3),
        torch.tensor(0.0123),
    )
    b = torch.randn(out_features, generator=g) if bias else None
    return TorchFP4Linear.from_nvfp4(w, b, dtype=dtype)


def test_constructor_allocates_the_checkpoint_buffers():
    layer = TorchFP4Linear(48, 10, bias=True, dtype=torch.float16)
    shapes = {n: (tuple(b.shape), b.dtype) for n, b in layer.named_buffers()}
    assert shapes == {
        "weight": ((10, 24), torch.uint8),
        "weight_scale": ((10, 3), E4M3),
        "weight_scale_2": ((), torch.float32),
        "bias": ((10,), torch.float16),
    }
    assert (layer.in_features, layer.out_features, layer.dtype) == (48, 10, torch.float16)
    assert list(layer.parameters()) == []
    assert TorchFP4Linear(16, 2).bias is None
    assert "in_features=48, out_features=10, bias=True, dtype=torch.float16" in repr(layer)


@pytest.mark.usefixtures("production_checks")
def test_constructor_rejects_bad_arguments():
    with pytest.raises(ValueError, match="in_features must be a multiple of 16"):
        TorchFP4Linear(40, 8)
    with pytest.raises(ValueError, match="out_features must be >= 0"):
        TorchFP4Linear(16, -1)
    with pytest.raises(TypeError, match="in_features must be an int"):
        TorchFP4Linear(16.0, 8)
    with pytest.raises(ValueError, match="dtype must be"):
        TorchFP4Linear(16, 8, dtype=torch.float64)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_cpu_forward_is_flinear_of_the_decoded_weight(dtype):
    layer = random_layer()
    x = torch.randn(2, 3, 64, generator=_gen(1)).to(dtype)
    dense = nvfp4_dequantize(layer.weight, layer.weight_scale, layer.weight_scale_2, dtype=dtype)
    expected = F.linear(x, dense, layer.bias.to(dtype))
    out = layer(x)
    assert_bitwise_equal(out, expected)
    assert layer.last_route == "dequant_matmul" and layer.last_fallback_reason is None


def test_forward_without_bias_and_module_dtype_does_not_set_the_output_dtype():
    layer = random_layer(bias=False, dtype=torch.bfloat16)
    x = torch.randn(5, 64, generator=_gen(2))
    expected = F.linear(x, nvfp4_dequantize(*layer.to_nvfp4(), dtype=torch.float32))
    assert_bitwise_equal(layer(x), expected)


@pytest.mark.parametrize("shape", [(0, 64), (2, 0, 64)])
def test_empty_batches(shape):
    layer = random_layer()
    out = layer(torch.empty(shape, dtype=torch.bfloat16))
    assert out.shape == (*shape[:-1], 24) and out.dtype == torch.bfloat16


@pytest.mark.usefixtures("production_checks")
def test_forward_rejects_bad_inputs():
    layer = random_layer()
    with pytest.raises(ValueError, match=r"x must have shape \(\*, 64\), got \(2, 48\)"):
        layer(torch.randn(2, 48))
    with pytest.raises(ValueError, match="x must have shape"):
        layer(torch.tensor(1.0))
    with pytest.raises(TypeError, match="x must be a floating tensor"):
        layer(torch.ones(2, 64, dtype=torch.int32))


def test_no_dense_weight_is_kept_after_forward():
    layer = random_layer()
    before = {n: b for n, b in layer.named_buffers()}
    layer(torch.randn(4, 64, generator=_gen(3)).bfloat16())

    def tensors(obj, seen=()):
        if isinstance(obj, torch.Tensor):
            yield obj
        elif isinstance(obj, dict):
            for v in obj.values():
                yield from tensors(v)
        elif isinstance(obj, (list, tuple)):
            for v in obj:
                yield from tensors(v)

    dense = [t for t in tensors(vars(layer)) if t.is_floating_point() and t.numel() >= 24 * 64]
    assert dense == []
    assert {n: b for n, b in layer.named_buffers()} == before  # the same tensor objects


@pytest.mark.parametrize(
    "cast",
    [
        lambda m: m.bfloat16(),
        lambda m: m.half(),
        lambda m: m.float(),
        lambda m: m.double(),
        lambda m: m.to(torch.float16),
        lambda m: m.to("cpu", torch.bfloat16),
    ],
    ids=["bfloat16", "half", "float", "double", "to-fp16", "to-cpu-bf16"],
)
def test_casts_leave_the_byte_buffers_alone(cast):
    layer = random_layer(dtype=torch.float32)
    saved = {n: b.clone() for n, b in layer.named_buffers()}
    cast(layer)
    assert layer.weight.dtype == torch.uint8
    assert layer.weight_scale.dtype == E4M3
    assert layer.weight_scale_2.dtype == torch.float32
    for name in ("weight", "weight_scale", "weight_scale_2"):
        assert_bitwise_equal(getattr(layer, name), saved[name], msg=name)
    assert layer.bias.dtype == layer.dtype  # float64 is no model dtype: .double() keeps fp32
    x = torch.randn(2, 64, generator=_gen(4)).to(layer.dtype)
    assert layer(x).dtype == x.dtype


def test_a_cast_moves_the_model_dtype_and_the_bias():
    layer = random_layer(dtype=torch.float32)
    bias = layer.bias.clone()
    layer.half()
    assert layer.dtype == torch.float16
    assert_bitwise_equal(layer.bias, bias.half())
    assert layer.dequantize_weight().dtype == torch.float16


def test_to_empty_materializes_a_meta_module_for_loading():
    src = random_layer(seed=9)
    with torch.device("meta"):
        dst = TorchFP4Linear(64, 24, bias=True)
    dst.to_empty(device="cpu")
    assert {n: (b.device.type, b.dtype) for n, b in dst.named_buffers()} == {
        n: ("cpu", b.dtype) for n, b in src.named_buffers()
    }
    dst.load_state_dict(src.state_dict())
    for name, tensor in src.named_buffers():
        assert_bitwise_equal(getattr(dst, name), tensor, msg=name)


def test_state_dict_round_trip_gives_identical_bytes():
    src = random_layer(seed=5)
    state = src.state_dict()
    assert set(state) == {"weight", "weight_scale", "weight_scale_2", "bias"}
    dst = TorchFP4Linear(64, 24, bias=True)
    dst.load_state_dict(state)
    for name, tensor in src.named_buffers():
        assert_bitwise_equal(getattr(dst, name), tensor, msg=name)
    assert_bitwise_equal(dst(torch.ones(1, 64).bfloat16()), src(torch.ones(1, 64).bfloat16()))


def test_load_accepts_checkpoint_spellings_and_refuses_converted_codes():
    src = random_layer(seed=6, bias=False)
    state = {
        "weight": src.weight.view(torch.float4_e2m1fn_x2),
        "weight_scale": src.weight_scale.view(torch.uint8),
        "weight_scale_2": src.weight_scale_2.reshape(1),
    }
    dst = TorchFP4Linear(64, 24)
    dst.load_state_dict(state)
    assert_bitwise_equal(dst.weight, src.weight)
    assert_bitwise_equal(dst.weight_scale, src.weight_scale)
    assert_bitwise_equal(dst.weight_scale_2, src.weight_scale_2)
    with pytest.raises(RuntimeError, match="NVFP4 weight is torch.uint8 bytes"):
        dst.load_state_dict({**state, "weight": src.weight.float()})
    with pytest.raises(RuntimeError, match="tensor scale must be finite and > 0"):
        dst.load_state_dict({**state, "weight_scale_2": torch.tensor(0.0)})


def test_from_linear_quantizes_with_floatxq_and_keeps_the_bias():
    torch.manual_seed(0)
    linear = nn.Linear(128, 32).to(torch.bfloat16)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(32, 128, generator=_gen(7)))
    layer = TorchFP4Linear.from_linear(linear)
    w = linear.weight.detach()
    g = nvfp4_global_scale(w.abs().amax().float(), recipe="nvidia")
    q = nvfp4_quantize(w, g, "nvidia")
    assert_bitwise_equal(layer.weight, q.packed)
    assert_bitwise_equal(layer.weight_scale, q.block_scales)
    assert_bitwise_equal(layer.weight_scale_2, g)
    assert_bitwise_equal(layer.bias, linear.bias.detach())
    assert layer.dtype == torch.bfloat16

    dense = w.float()
    err = (layer.dequantize_weight(torch.float32) - dense).pow(2).mean() / dense.pow(2).mean()
    assert err < 2e-2


@pytest.mark.usefixtures("production_checks")
def test_from_linear_rejects_what_it_cannot_quantize():
    with pytest.raises(TypeError, match="must be an nn.Linear"):
        TorchFP4Linear.from_linear(nn.Conv1d(16, 4, 1))
    with pytest.raises(ValueError, match="in_features must be a multiple of 16"):
        TorchFP4Linear.from_linear(nn.Linear(24, 4))
    with pytest.raises(TypeError, match="float16, bfloat16 or float32"):
        TorchFP4Linear.from_linear(nn.Linear(16, 4).double())


def test_to_nvfp4_and_from_nvfp4_round_trip():
    layer = random_layer(seed=8)
    w = layer.to_nvfp4()
    again = TorchFP4Linear.from_nvfp4(w, layer.bias, dtype=torch.bfloat16)
    for name, tensor in layer.named_buffers():
        assert_bitwise_equal(getattr(again, name), tensor, msg=name)
    assert_bitwise_equal(layer.dequantize_weight(), nvfp4_dequantize(*w, dtype=torch.bfloat16))


@pytest.mark.usefixtures("production_checks")
def test_from_nvfp4_validates_the_record_and_bias():
    w = random_layer(bias=False).to_nvfp4()
    with pytest.raises(ValueError, match="weight_scale_2 must be finite and > 0"):
        TorchFP4Linear.from_nvfp4(w._replace(global_scale=torch.tensor(-1.0)))
    with pytest.raises(ValueError, match=r"bias must have shape \(24,\)"):
        TorchFP4Linear.from_nvfp4(w, torch.zeros(3))
    with pytest.raises(ValueError, match="bias contains NaN or infinity once stored"):
        TorchFP4Linear.from_nvfp4(w, torch.full((24,), 1e6), dtype=torch.float16)


@pytest.mark.gpu
def test_cuda_forward_says_why_it_decoded():
    layer = random_layer().cuda()
    x = torch.randn(3, 64, device="cuda", dtype=torch.bfloat16)
    out = layer(x)
    dense = layer.dequantize_weight(torch.bfloat16)
    if importlib.util.find_spec("torchao") is None:
        decoder = (
            "triton_decode" if triton_unavailable_reason(x.device) is None else "dequant_matmul"
        )
        assert layer.last_route == decoder
        assert layer.last_fallback_reason.startswith("torchao is not installed")
        assert_bitwise_equal(out, F.linear(x, dense, layer.bias))
    elif layer.last_route == "torchao_nvfp4":
        assert layer.last_fallback_reason is None
        torch.testing.assert_close(out, F.linear(x, dense, layer.bias), rtol=2e-2, atol=2e-2)
    else:
        assert "NVFP4Tensor raised" in layer.last_fallback_reason


# ----------------------------------------------------------------------------------------------
# The CUDA decode: the Triton kernel where it runs, else the pure function
# ----------------------------------------------------------------------------------------------


def test_cuda_decode_route_takes_the_kernel_where_triton_runs(monkeypatch):
    cuda = torch.device("cuda")
    monkeypatch.setattr(dispatch, "triton_unavailable_reason", lambda device: None)
    for dtype in (torch.float16, torch.bfloat16, torch.float32):
        assert dispatch.fp4_decode_route(cuda, dtype) == ("triton_decode", None)
    route, reason = dispatch.fp4_decode_route(cuda, torch.float64)
    assert route == "dequant_matmul" and "not torch.float64" in reason
    monkeypatch.setattr(dispatch, "triton_unavailable_reason", lambda device: "no Triton here")
    assert dispatch.fp4_decode_route(cuda, torch.bfloat16) == ("dequant_matmul", "no Triton here")


def test_cpu_forward_keeps_the_pure_decode_where_triton_runs(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("the Triton decode was called on CPU")

    monkeypatch.setattr(dispatch, "triton_unavailable_reason", lambda device: None)
    monkeypatch.setattr(fp4_linear, "nvfp4_dequantize_kernel", refuse)
    layer = random_layer(seed=12)
    x = torch.randn(4, 64, generator=_gen(13)).bfloat16()
    expected = F.linear(x, layer.dequantize_weight(torch.bfloat16), layer.bias)
    assert_bitwise_equal(layer(x), expected)
    assert layer.last_route == "dequant_matmul" and layer.last_fallback_reason is None


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("bias", [True, False])
def test_cuda_triton_decode_is_bitwise_the_pure_decode(monkeypatch, dtype, bias):
    monkeypatch.setattr(dispatch, "torchao_missing", lambda: "torchao is not installed")
    for seed, (out_features, in_features, batch) in enumerate(
        [(24, 64, (3,)), (1, 16, (1,)), (300, 4096, (2, 5)), (4096, 1024, (7,))]
    ):
        layer = random_layer(out_features, in_features, bias=bias, seed=seed, dtype=dtype).cuda()
        x = torch.randn(*batch, in_features, generator=_gen(seed)).to(dtype).cuda()
        out = layer(x)
        assert layer.last_route == "triton_decode"
        assert layer.last_fallback_reason.startswith("torchao is not installed; the weight was")
        dense = nvfp4_dequantize(*layer.to_nvfp4(), dtype=dtype)
        expected = F.linear(x, dense, None if layer.bias is None else layer.bias.to(dtype))
        assert_bitwise_equal(out, expected, msg=f"{(out_features, in_features)} {dtype}")


@pytest.mark.gpu
def test_cuda_decode_falls_back_to_torch_and_says_why(monkeypatch):
    monkeypatch.setattr(dispatch, "torchao_missing", lambda: "torchao is not installed")
    layer = random_layer().cuda()
    x64 = torch.randn(3, 64, generator=_gen(14), dtype=torch.float64).cuda()
    out = layer(x64)
    assert layer.last_route == "dequant_matmul"
    assert "torchao is not installed" in layer.last_fallback_reason
    assert "not torch.float64" in layer.last_fallback_reason
    expected = F.linear(x64, layer.dequantize_weight(torch.float64), layer.bias.double())
    assert_bitwise_equal(out, expected)
    monkeypatch.setattr(dispatch, "triton_unavailable_reason", lambda device: "no Triton here")
    x = x64.bfloat16()
    out = layer(x)
    assert layer.last_route == "dequant_matmul"
    assert layer.last_fallback_reason.endswith("the Triton decode cannot run (no Triton here)")
    assert_bitwise_equal(out, F.linear(x, layer.dequantize_weight(torch.bfloat16), layer.bias))
