"""TorchFP4Linear W4A4: the activation's NVFP4 quantize-dequantize at a static global scale.

The reference is the pure :func:`floatxq.nvfp4_block_qdq` of ``x`` (``nvidia`` recipe, the
module's ``input_scale``) followed by ``F.linear`` with the pure decode of the weight; values
worked by hand check the reference itself. ``test_interpreter_suite`` reruns the
``interpreted`` tests (the Triton route) under ``TRITON_INTERPRET=1``; the ``gpu`` tests compare
the CUDA routes with the CPU reference byte for byte.
"""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from floatxq import dispatch
from floatxq.dispatch import decode as decode_facts  # the facts fp4_w4a4_route reads
from floatxq.kernels.nvfp4_qdq import nvfp4_activation_qdq
from floatxq.nn.fp4_linear import TorchFP4Linear
from floatxq.nvfp4.layouts import NVFP4Weight
from floatxq.nvfp4.quantize import nvfp4_block_qdq, nvfp4_dequantize, nvfp4_global_scale
from floatxq.testing import assert_bitwise_equal
from floatxq.testing.interpreter import can_interpret, needs_interpreter, run_interpreted_tests

E4M3 = torch.float8_e4m3fn
MODEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def random_weight(out_features: int, in_features: int, seed: int) -> NVFP4Weight:
    g = _gen(seed)
    return NVFP4Weight(
        torch.randint(0, 256, (out_features, in_features // 2), generator=g, dtype=torch.uint8),
        torch.randint(
            1, 127, (out_features, in_features // 16), generator=g, dtype=torch.uint8
        ).view(E4M3),
        torch.tensor(0.0123),
    )


def w4a4_layer(out_features=24, in_features=64, *, seed=0, input_scale=0.0071, bias=True,
               dtype=torch.bfloat16):  # fmt: skip
    b = torch.randn(out_features, generator=_gen(seed + 100)) if bias else None
    w = random_weight(out_features, in_features, seed)
    return TorchFP4Linear.from_nvfp4(w, b, dtype=dtype, input_scale=input_scale)


def reference(layer: TorchFP4Linear, x: torch.Tensor) -> torch.Tensor:
    xq = nvfp4_block_qdq(x, layer.input_scale, "nvidia")
    dense = nvfp4_dequantize(layer.weight, layer.weight_scale, layer.weight_scale_2, dtype=x.dtype)
    return F.linear(xq, dense, None if layer.bias is None else layer.bias.to(x.dtype))


def identity_layer(k: int, input_scale: float) -> TorchFP4Linear:
    """Decoded weight = the identity: code 2 (E2M1 1.0) on the diagonal, block scales 1, g 1."""
    codes = torch.zeros(k, k, dtype=torch.uint8)
    codes.fill_diagonal_(2)
    packed = codes[:, 0::2] | (codes[:, 1::2] << 4)
    scales = torch.ones(k, k // 16).to(E4M3)
    w = NVFP4Weight(packed, scales, torch.tensor(1.0))
    return TorchFP4Linear.from_nvfp4(w, dtype=torch.float32, input_scale=input_scale)


# ----------------------------------------------------------------------------------------------
# Values and the reference (CPU)
# ----------------------------------------------------------------------------------------------


def test_values_worked_by_hand():
    # block [7, 1 x 14, -0.2] at g = 1: scale E4M3(7/6 = 1.1667) = 1.125; 7/1.125 = 6.22 -> 6
    # (6.75); 1/1.125 = 0.889 -> 1 (1.125); 0.2/1.125 = 0.178 -> 0
    layer = identity_layer(16, 1.0)
    x = torch.tensor([[7.0] + [1.0] * 14 + [-0.2]])
    out = layer(x)
    assert out[0, :2].tolist() == [6.75, 1.125] and out[0, 14].item() == 1.125
    assert out[0, 15].item() == 0.0
    # g = 0.5 doubles the grid: scale E4M3(7/3 = 2.333) = 2.25, e = 1.125: the same values
    assert layer.last_route == "w4a4_dequant_matmul" and layer.last_fallback_reason is None
    halved = identity_layer(16, 0.5)
    assert halved(x)[0, :2].tolist() == [6.75, 1.125]
    # a tiny global scale saturates the block scale at 448: 7 / (448 * 2**-10) = 16 -> 6 (2.625)
    tiny = identity_layer(16, 2.0**-10)
    assert tiny(x)[0, 0].item() == 6 * 448 * 2.0**-10


@pytest.mark.parametrize("dtype", MODEL_DTYPES)
@pytest.mark.parametrize("shape", [(3, 64), (2, 5, 64), (1, 64)])
def test_cpu_forward_equals_the_reference(dtype, shape):
    layer = w4a4_layer(seed=len(shape))
    x = (torch.randn(shape, generator=_gen(7)) * 3).to(dtype)
    x[..., 5] = -0.0  # signed zeros survive the activation's qdq
    out = layer(x)
    assert out.dtype == dtype and out.shape == (*shape[:-1], 24)
    assert_bitwise_equal(out, reference(layer, x))
    assert layer.last_route == "w4a4_dequant_matmul"
    # the activation really is quantized: the weight-only output differs
    weight_only = TorchFP4Linear.from_nvfp4(layer.to_nvfp4(), layer.bias, dtype=layer.dtype)
    assert not torch.equal(weight_only(x), out)


def test_from_linear_takes_an_input_scale():
    linear = nn.Linear(32, 8)
    g = nvfp4_global_scale(torch.tensor(5.0))
    layer = TorchFP4Linear.from_linear(linear, input_scale=g)
    assert layer.input_scale.dtype == torch.float32 and layer.input_scale.shape == ()
    assert_bitwise_equal(layer.input_scale, g)
    x = torch.randn(4, 32, generator=_gen(2))
    assert_bitwise_equal(layer(x), reference(layer, x))
    assert TorchFP4Linear.from_linear(linear).input_scale is None
    assert "w4a4=True" in repr(layer) and "w4a4" not in repr(TorchFP4Linear.from_linear(linear))


def test_empty_rows():
    layer = w4a4_layer()
    out = layer(torch.empty(2, 0, 64, dtype=torch.bfloat16))
    assert out.shape == (2, 0, 24) and layer.last_route == "none"


@pytest.mark.usefixtures("production_checks")
def test_non_finite_activations_are_refused_on_cpu():
    layer = w4a4_layer()
    x = torch.randn(2, 64)
    x[1, 3] = float("nan")
    with pytest.raises(ValueError, match="NaN or infinity"):
        layer(x)


# ----------------------------------------------------------------------------------------------
# Buffers, casts, state dicts, refusals
# ----------------------------------------------------------------------------------------------


def test_weight_only_modules_have_no_input_scale():
    layer = TorchFP4Linear(32, 8, bias=True)
    assert layer.input_scale is None and "input_scale" not in layer.state_dict()
    assert sorted(layer.state_dict()) == ["bias", "weight", "weight_scale", "weight_scale_2"]
    w4a4 = TorchFP4Linear(32, 8, input_scale=True)
    assert w4a4.input_scale.dtype == torch.float32 and w4a4.input_scale.item() == 1.0
    assert "input_scale" in w4a4.state_dict()


def test_state_dict_round_trip():
    layer = w4a4_layer(seed=3, input_scale=0.0123)
    state = layer.state_dict()
    assert state["input_scale"].dtype == torch.float32 and state["input_scale"].shape == ()
    fresh = TorchFP4Linear(64, 24, bias=True, input_scale=True)
    fresh.load_state_dict(state)
    assert_bitwise_equal(fresh.input_scale, layer.input_scale)
    x = torch.randn(5, 64, generator=_gen(4)).bfloat16()
    assert_bitwise_equal(fresh(x), layer(x))
    # assign=True puts the incoming tensors in place: a bf16-stored scale comes back as FP32
    assigned = TorchFP4Linear(64, 24, bias=True, input_scale=True)
    assigned.load_state_dict({**state, "input_scale": torch.tensor(0.5, dtype=torch.bfloat16)},
                             assign=True)  # fmt: skip
    assert assigned.input_scale.dtype == torch.float32 and assigned.input_scale.item() == 0.5


def test_a_w4a4_state_dict_does_not_load_into_a_weight_only_module():
    state = w4a4_layer().state_dict()
    with pytest.raises(RuntimeError, match='Unexpected key.*"input_scale"'):
        TorchFP4Linear(64, 24, bias=True).load_state_dict(state)
    with pytest.raises(RuntimeError, match='Missing key.*"input_scale"'):
        TorchFP4Linear(64, 24, bias=True, input_scale=True).load_state_dict(
            TorchFP4Linear(64, 24, bias=True).state_dict()
        )


CASTS = [
    lambda m: m.bfloat16(),
    lambda m: m.half(),
    lambda m: m.to(torch.bfloat16),
    lambda m: m.double(),
]


@pytest.mark.parametrize("cast", CASTS, ids=["bfloat16", "half", "to-bf16", "double"])
def test_casts_keep_the_input_scale_bits(cast):
    layer = w4a4_layer(input_scale=0.0123, dtype=torch.float32)  # not a bf16 or fp16 value
    before = layer.input_scale.clone()
    assert before.to(torch.bfloat16).float().item() != before.item()
    cast(layer)
    assert layer.input_scale.dtype == torch.float32
    assert_bitwise_equal(layer.input_scale, before)


@pytest.mark.usefixtures("production_checks")
@pytest.mark.parametrize("bad", [0.0, -0.5, float("nan"), float("inf"), -0.0])
def test_bad_input_scales_are_refused(bad):
    w = random_weight(8, 32, 0)
    with pytest.raises(ValueError, match=r"TorchFP4Linear.from_nvfp4: input_scale must be finite"):
        TorchFP4Linear.from_nvfp4(w, input_scale=bad)
    with pytest.raises(ValueError, match=r"from_nvfp4: input_scale must be finite"):
        TorchFP4Linear.from_linear(nn.Linear(32, 8), input_scale=torch.tensor(bad))
    layer = TorchFP4Linear(32, 8, input_scale=True)
    state = {**layer.state_dict(), "input_scale": torch.tensor(bad)}
    with pytest.raises(RuntimeError, match=r"input_scale: the activation global scale must be"):
        layer.load_state_dict(state)
    assert layer.input_scale.item() == 1.0  # nothing loaded


@pytest.mark.usefixtures("production_checks")
def test_input_scales_of_another_kind_are_refused():
    w = random_weight(8, 32, 0)
    with pytest.raises(TypeError, match="input_scale must be a real number"):
        TorchFP4Linear.from_nvfp4(w, input_scale="0.5")
    with pytest.raises(ValueError, match=r"input_scale must hold one value"):
        TorchFP4Linear.from_nvfp4(w, input_scale=torch.ones(2))
    layer = TorchFP4Linear(32, 8, input_scale=True)
    with pytest.raises(RuntimeError, match="size mismatch for input_scale"):
        layer.load_state_dict({**layer.state_dict(), "input_scale": torch.ones(2)})


# ----------------------------------------------------------------------------------------------
# The route choice
# ----------------------------------------------------------------------------------------------


def test_route_choice(monkeypatch):
    cuda = torch.device("cuda")
    assert dispatch.fp4_w4a4_route(torch.device("cpu"), torch.float16, 128) == (
        "w4a4_dequant_matmul", None,
    )  # fmt: skip
    monkeypatch.setattr(decode_facts, "nvfp4_unavailable_reason", lambda device: None)
    monkeypatch.setattr(decode_facts, "cuda_capability", lambda device: (9, 0))
    assert dispatch.fp4_w4a4_route(cuda, torch.bfloat16, 256) == ("w4a4_triton", None)
    for blackwell in ((10, 0), (12, 0)):  # tensor cores with NVFP4: the route says it emulates
        monkeypatch.setattr(decode_facts, "cuda_capability", lambda device, c=blackwell: c)
        route, reason = dispatch.fp4_w4a4_route(cuda, torch.bfloat16, 256)
        assert route == "w4a4_triton" and reason.startswith(f"SM {blackwell[0]}.0 has NVFP4")
        assert "no native NVFP4 GEMM route" in reason
    monkeypatch.setattr(decode_facts, "cuda_capability", lambda device: (9, 0))
    route, reason = dispatch.fp4_w4a4_route(cuda, torch.bfloat16, 64)
    assert route == "w4a4_dequant_matmul" and "K=64 is not a multiple of 128" in reason
    route, reason = dispatch.fp4_w4a4_route(cuda, torch.float64, 256)
    assert route == "w4a4_dequant_matmul" and "torch.float64" in reason
    monkeypatch.setattr(decode_facts, "nvfp4_unavailable_reason", lambda device: "no Triton")
    assert dispatch.fp4_w4a4_route(cuda, torch.float16, 256) == (
        "w4a4_dequant_matmul", "no Triton; quantized in torch",
    )  # fmt: skip
    assert set(dispatch.FP4_W4A4_ROUTES) == {"w4a4_dequant_matmul", "w4a4_triton"}


# ----------------------------------------------------------------------------------------------
# The Triton route under the interpreter (CPU, float16/float32)
# ----------------------------------------------------------------------------------------------


@pytest.mark.skipif(
    not can_interpret(),
    reason="needs Triton installed and no CUDA device (with CUDA the compiled kernels are tested)",
)
def test_interpreter_suite():
    run_interpreted_tests(__file__, expected=1)


@needs_interpreter
@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
def test_interpreted_triton_route_equals_the_reference():
    for seed, (shape, dtype) in enumerate([
        ((3, 128), torch.float32), ((1, 256), torch.float16), ((2, 3, 128), torch.float32),
        ((0, 128), torch.float16),
    ]):  # fmt: skip
        x = (torch.randn(shape, generator=_gen(seed)) * 4).to(dtype)
        if x.numel():
            x.view(-1)[::7] = -0.0
            x.view(-1)[1::9] = 1e-4  # rounds to zero: +0.0
        g = torch.tensor(0.0017)
        out = nvfp4_activation_qdq(x, g, triton=True)
        assert_bitwise_equal(out, nvfp4_block_qdq(x, g, "nvidia"), msg=f"{shape} {dtype}")


# ----------------------------------------------------------------------------------------------
# CUDA: both routes byte for byte the CPU reference
# ----------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", MODEL_DTYPES)
def test_cuda_routes_equal_the_cpu_reference(dtype):
    for seed, (rows, k, g) in enumerate([
        (1, 128, 0.0071), (3, 256, 0.0017), (33, 512, 0.02), (0, 128, 0.5), (129, 384, 1e-3),
        (5, 64, 0.0071), (17, 48, 0.3), (2, 1024, 2.0**-12),
    ]):  # fmt: skip
        layer = w4a4_layer(40, k, seed=seed, input_scale=g, dtype=dtype)
        x = (torch.randn(rows, k, generator=_gen(seed)) * (seed + 1)).to(dtype)
        if x.numel():
            x.view(-1)[::11] = -0.0
            x[:, -16:] = 0.0  # an all-zero block
        dense_cpu = layer.dequantize_weight(dtype)
        layer.cuda()
        out = layer(x.cuda())
        want = "w4a4_triton" if k % 128 == 0 else "w4a4_dequant_matmul"
        if rows:
            assert layer.last_route == want, (k, layer.last_route, layer.last_fallback_reason)
            # the activations byte for byte; the GEMM itself may differ between CPU and cuBLAS
            xq = nvfp4_activation_qdq(x.cuda(), layer.input_scale, triton=want == "w4a4_triton")
            assert_bitwise_equal(xq.cpu(), nvfp4_block_qdq(x, g, "nvidia"), msg=f"{rows} {k}")
            dense = layer.dequantize_weight(dtype)
            assert_bitwise_equal(dense.cpu(), dense_cpu)
            assert_bitwise_equal(out, F.linear(xq, dense, layer.bias.to(dtype)), msg=f"{rows} {k}")
        else:
            assert out.shape == (0, 40)


@pytest.mark.gpu
def test_cuda_forward_does_not_use_torchao():
    layer = w4a4_layer(24, 256).cuda()
    x = torch.randn(4, 256, device="cuda", dtype=torch.bfloat16)
    layer(x)
    assert layer.last_route == "w4a4_triton" and layer.last_fallback_reason is None
