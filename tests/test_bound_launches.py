"""Bound launches: after its first CUDA call on an input of a given shape, dtype, strides and
alignment, a quantized module keeps the call's launches bound (its plan, keys and checks done
once) and later calls like it go straight to the driver. These tests hold the bound path to the
same bytes as the full path, check that it is taken, and that what it holds is dropped when a
buffer is replaced, the route preference changes, the module is copied or pickled."""

import copy
import io
from types import SimpleNamespace

import pytest
import torch
from torch import nn

import floatxq as fq
from floatxq.gptq.solve import GPTQSolveOptions, rtn_quantize
from floatxq.kernels import fp8_routes, nvfp4, w4a16, w4a_fp8
from floatxq.kernels._triton import call_key, new_output, on_rows
from floatxq.nn import fp4_linear, gptq_linear


def _gptq(bias: bool = True) -> fq.GPTQLinear:
    g = torch.Generator().manual_seed(3)
    sol = rtn_quantize(
        torch.randn(256, 512, generator=g), GPTQSolveOptions(bits=4, group_size=128, sym=True)
    )
    b = torch.randn(256, generator=g) if bias else None
    return fq.GPTQLinear.from_solution(sol, bits=4, group_size=128, bias=b)


BUILDERS = {
    "GPTQLinear": lambda: _gptq(),
    "W4AFP8Linear": lambda: fq.W4AFP8Linear.from_gptq_linear(_gptq()),
    "W4ANVFP4Linear": lambda: fq.W4ANVFP4Linear.from_gptq_linear(_gptq()),
    "TorchFP4Linear": lambda: fq.TorchFP4Linear.from_linear(nn.Linear(512, 256)),
    "TorchFP8Linear row": lambda: fq.TorchFP8Linear.from_linear(nn.Linear(512, 256)),
    "TorchFP8Linear token": lambda: fq.TorchFP8Linear.from_linear(
        nn.Linear(512, 256), input_quant="token"
    ),
}
# the full-path function each bound call stands for (made to raise to prove it is skipped)
FULL_PATHS = {
    "GPTQLinear": [(gptq_linear, "w4a16_frag_linear"), (w4a16, "_words_linear")],
    "W4AFP8Linear": [(w4a_fp8, "_linear")],
    "W4ANVFP4Linear": [(nvfp4, "nvfp4_pack_and_swizzle"), (nvfp4, "_gemm")],
    "TorchFP4Linear": [(fp4_linear, "nvfp4_dequantize_kernel")],
    "TorchFP8Linear row": [(fp8_routes, "small_m_launch")],
    "TorchFP8Linear token": [(fp8_routes, "small_m_launch")],
}


def test_call_key_and_on_rows_on_cpu():
    x = torch.randn(2, 3, 8)
    assert call_key(x) == (x.shape, x.dtype, x.device, x.stride(), x.data_ptr() % 16 == 0)
    assert call_key(x[:, :, 1:]) != call_key(x[:, :, :7])  # strides or alignment differ
    rows = on_rows(lambda t: t[:, :4] * 2, x, 4)
    assert torch.equal(rows(x), x[..., :4] * 2)
    assert on_rows(None, x, 4) is None
    assert on_rows(lambda t: t, x.transpose(0, 1), 4) is None  # flattens only by a copy
    flat = lambda t: t
    assert on_rows(flat, x[0], 4) is flat  # two axes: as it is


def test_new_output_is_the_result_without_a_launch_only_when_nothing_is_summed():
    """The GEMM kernels' shared prologue: no rows or columns give an empty result, no K the
    bias rounded to the output dtype (else zeros); otherwise the caller launches."""
    cpu, bias = torch.device("cpu"), torch.tensor([1.0 / 3, -2.0, 7.5])
    for m, n in ((0, 3), (2, 0)):
        out, done = new_output(m, n, 128, torch.bfloat16, cpu, bias)
        assert done and out.shape == (m, n) and out.dtype == torch.bfloat16
    out, done = new_output(2, 3, 0, torch.bfloat16, cpu, bias)
    assert done and torch.equal(out, bias.to(torch.bfloat16).expand(2, 3))
    out, done = new_output(2, 3, 0, torch.float16, cpu, None)
    assert done and torch.equal(out, torch.zeros(2, 3, dtype=torch.float16))
    out, done = new_output(2, 3, 128, torch.float32, cpu, bias)
    assert not done and out.shape == (2, 3)


@pytest.mark.parametrize("name", ["GPTQLinear", "W4AFP8Linear"])
def test_plans_dropped_on_new_buffers_copies_and_pickles_cpu(name):
    layer = BUILDERS[name]()
    x = torch.randn(3, 512)
    first = layer(x)
    assert layer._plans  # the row-class plan of the CPU route
    layer.bias = layer.bias * 2  # a new buffer: every plan dropped
    assert layer._plans == {}
    layer(x)
    clone = copy.deepcopy(layer)
    assert clone._plans == {} and layer._plans
    assert torch.equal(clone(x), layer(x))
    buffer = io.BytesIO()
    torch.save(layer, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    assert torch.equal(loaded(x), layer(x)) and not torch.equal(layer(x), first)


def _full(layer, x):
    """The full path's result for ``x``: a copy's first call (copies hold nothing bound)."""
    return copy.deepcopy(layer)(x)


@pytest.mark.parametrize("name", list(BUILDERS))
def test_a_copy_computes_with_its_own_tensors_cpu(name):
    layer = BUILDERS[name]()
    x = torch.randn(2, 512)
    layer(x)
    clone = copy.deepcopy(layer)
    clone.bias.zero_()  # in place: what the copy's runners bind must be its own tensors
    expected = layer(x) - layer.bias.float()  # (the bias: ~0.01, far above the rounding here)
    assert torch.allclose(clone(x), expected, rtol=0, atol=1e-4)


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(BUILDERS))
@pytest.mark.parametrize("shape", [(1, 512), (16, 512), (2, 1, 512), (4, 512)])
def test_bound_call_is_the_full_path(name, shape, monkeypatch):
    layer = BUILDERS[name]().cuda()
    if hasattr(layer, "post_init"):
        layer.post_init()
    gen = torch.Generator(device="cuda").manual_seed(sum(shape))
    x, y = (torch.randn(shape, device="cuda", generator=gen).bfloat16() for _ in range(2))
    route = None
    for _ in range(2):  # the first call binds, the second binds nothing new
        layer(x)
        route = layer.last_route
    if "FP8" not in name:  # (TorchFP8Linear's runner keeps its own)
        assert call_key(x) in layer._plans, route
    expected = _full(layer, y)
    layer(x)  # bound again
    for module, fn in FULL_PATHS[name]:
        monkeypatch.setattr(module, fn, _refuse)
    got = layer(y)
    assert layer.last_route == route
    assert got.shape == expected.shape and torch.equal(got, expected)
    side = torch.cuda.Stream()  # another stream: its own split-K workspace
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        again = layer(y)
    torch.cuda.current_stream().wait_stream(side)
    assert torch.equal(again, expected)


def _refuse(*args, **kwargs):
    raise AssertionError("the full path ran where a bound launch was held")


@pytest.mark.gpu
def test_bound_call_sees_a_new_bias_and_route():
    layer = BUILDERS["W4AFP8Linear"]().cuda().post_init()
    x = torch.randn(1, 512, device="cuda", dtype=torch.bfloat16)
    layer(x)
    assert call_key(x) in layer._plans
    layer.bias = layer.bias + 1
    assert layer._plans == {}
    assert torch.equal(layer(x), _full(layer, x))
    layer(x)
    layer.route = "reference"
    layer(x)
    assert layer.last_route == "reference"


@pytest.mark.gpu
def test_bound_nvfp4_call_sees_a_new_global_scale():
    """The bound W4A-NVFP4 call reads the global-scale bits on the device each call (an
    in-place change shows), and assigning a scale drops what is bound."""
    layer = BUILDERS["W4ANVFP4Linear"]().cuda().post_init()
    x = torch.randn(2, 512, device="cuda", dtype=torch.bfloat16)
    dynamic = layer(x)
    assert torch.equal(layer(x), dynamic) and call_key(x) in layer._plans
    layer.activation_global_scale = 0.02
    assert layer._plans == {}
    stored = layer(x)
    assert torch.equal(layer(x), stored) and not torch.equal(stored, dynamic)
    layer.activation_global_scale_bits.zero_()  # in place: dynamic again, the bound call sees it
    assert torch.equal(layer(x), dynamic)


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(BUILDERS))
def test_bound_calls_in_a_cuda_graph(name):
    layer = BUILDERS[name]().cuda()
    if hasattr(layer, "post_init"):
        layer.post_init()
    x = torch.randn(1, 512, device="cuda", dtype=torch.bfloat16)
    expected = layer(x).clone()
    layer(x)  # bound
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = layer(x)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, expected)


class _Param:
    def __init__(self, constexpr: bool) -> None:
        self.is_constexpr = constexpr


class _FakeJit:
    """A jitted kernel's stand-in: one pointer and one constexpr parameter; counts compiles."""

    __name__ = "fake_kernel"

    def __init__(self) -> None:
        self.params = [_Param(False), _Param(True)]
        self.compiles = 0

    def __getitem__(self, grid):
        def compile_and_launch(*args, **options):
            self.compiles += 1
            return SimpleNamespace(run=None, function=object(), packed_metadata=None)

        return compile_and_launch


def test_a_launch_key_that_misses_a_constexpr_raises_instead_of_reusing_the_kernel():
    """The NVFP4 GEMM's key once missed its weight form: the int16 words reused the int32
    words' kernel and gave wrong sums. A kept launch now checks its constexprs."""
    from floatxq.kernels._triton import CachedLauncher

    jit = _FakeJit()
    launcher = CachedLauncher(jit)
    x = torch.zeros(4)
    launcher("key", (1, 1, 1), (x, 0), {}, 0)
    assert jit.compiles == 1 and len(launcher) == 1
    with pytest.raises(RuntimeError, match=r"fake_kernel.*'key'.*\(0,\).*\(3,\).*every compile"):
        launcher("key", (1, 1, 1), (x, 3), {}, 0)
    with pytest.raises(RuntimeError, match="1 arguments"):
        launcher("key", (1, 1, 1), (x,), {}, 0)
    assert jit.compiles == 1  # nothing ran with the wrong kernel
    launcher("other key", (1, 1, 1), (x, 3), {}, 0)
    assert jit.compiles == 2 and launcher.bind("other key", (1, 1, 1), 0) is not None
