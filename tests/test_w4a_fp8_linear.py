"""``W4AFP8Linear``: GPTQ buffers, the staged E4M3 operand, routes, loads and the FP8 carrier.

On CPU the module takes the pure reference (``floatxq.w4a.linear.w4a_fp8_linear``); its outputs are
checked bit for bit against that reference fed the other weight operand (the int32 GPTQ words,
decoded by a different path), and against a float64 oracle of ``F.linear`` on the FP8-quantized
tokens. The Triton route is checked against the same float64 oracle within a bound of its
summation error: on the GPU (``gpu`` marks) and, without CUDA, under ``TRITON_INTERPRET=1`` in a
child process (``test_interpreter_suite``).
"""

import pytest
import torch
import torch.nn.functional as F

import floatxq.kernels.w4a_fp8 as w4a_kernels
from floatxq import BACKEND, GPTQLinear, W4AFP8Linear, dispatch
from floatxq.fp8 import fp8_token_qdq, fp8_token_quantize
from floatxq.gptq.int4 import GPTQPacked, pack_gptq
from floatxq.gptq.solve import GPTQSolveOptions, gptq_solve, rtn_quantize
from floatxq.nn.w4a_fp8_linear import w4a_fp8_ineligibility, w4a_fp8_route
from floatxq.testing import FP32_ACCUMULATION, Accumulation, w4a_fp8_linear_error_bound
from floatxq.testing.interpreter import can_interpret, needs_interpreter, run_interpreted_tests
from floatxq.w4a.linear import w4a_fp8_linear

K, N = 256, 64
CACHE_ABSENT = "staged weight cache is absent; call post_init"


def _gptq(
    seed: int = 0,
    *,
    k: int = K,
    n: int = N,
    bits: int = 4,
    group_size: int = 128,
    sym: bool = True,
    format: str = "gptq",
    bias: bool = False,
) -> GPTQLinear:
    g = torch.Generator().manual_seed(seed)
    weight = torch.randn(n, k, generator=g)
    sol = rtn_quantize(weight, GPTQSolveOptions(bits=bits, group_size=group_size, sym=sym))
    b = torch.randn(n, generator=g).half() if bias else None
    return GPTQLinear.from_solution(sol, bits=bits, group_size=group_size, format=format, bias=b)


def _x(seed: int, *shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 + seed)
    return (torch.randn(*shape, generator=g) * 3).to(dtype)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.element_size() == 1 else t


def _hand_packed(zero_at: tuple[int, int] | None = None) -> GPTQPacked:
    """codes[k, n] = (k + 3n) % 16, zero point 8 (one ``zero_at`` (group, column) set to 9)."""
    k, n = torch.arange(K)[:, None], torch.arange(N)[None, :]
    codes = (k + 3 * n) % 16
    zeros = torch.full((K // 128, N), 8)
    if zero_at is not None:
        zeros[zero_at] = 9
    scales = torch.full((K // 128, N), 0.25)
    g_idx = (torch.arange(K) // 128).to(torch.int32)
    return pack_gptq(codes, zeros, scales, g_idx, format="gptq_v2")


# ----------------------------------------------------------------------------------------------
# Buffers, class attributes, constraints
# ----------------------------------------------------------------------------------------------


def test_buffers_are_gptqs_and_the_cache_is_not_persistent():
    layer = W4AFP8Linear(K, N, bias=True)
    shapes = {name: (t.dtype, tuple(t.shape)) for name, t in layer.state_dict().items()}
    assert shapes == {
        "qweight": (torch.int32, (K // 8, N)),
        "qzeros": (torch.int32, (K // 128, N // 8)),
        "scales": (torch.float16, (K // 128, N)),
        "g_idx": (torch.int32, (K,)),
        "bias": (torch.float16, (N,)),
    }
    assert torch.equal(layer.g_idx, torch.tensor([0] * 128 + [1] * 128, dtype=torch.int32))
    assert layer._weight_e4m3 is None
    with pytest.raises(RuntimeError, match=CACHE_ABSENT):
        layer(torch.zeros(1, K))
    ready = W4AFP8Linear.from_gptq_linear(_gptq(bias=True))
    assert ready._weight_e4m3.dtype == torch.float8_e4m3fn
    assert tuple(ready._weight_e4m3.shape) == (K, N)
    assert "_weight_e4m3" not in ready.state_dict()
    assert sorted(ready.state_dict()) == sorted(shapes)


def test_class_attributes_are_gptqmodels():
    assert (W4AFP8Linear.bits, W4AFP8Linear.group_size) == (4, 128)
    assert (W4AFP8Linear.desc_act, W4AFP8Linear.sym) == (False, True)
    assert W4AFP8Linear.REQUIRES_FORMAT_V2 is True
    assert W4AFP8Linear.backend is BACKEND.GPTQ_W4AFP8 and BACKEND.GPTQ_W4AFP8 == "gptq_w4afp8"
    assert W4AFP8Linear.MIN_COMPUTE_CAPABILITY == (8, 9)


@pytest.mark.parametrize(
    ("args", "kwargs", "match"),
    [
        ((K, N), {"bits": 8}, "bits=8"),
        ((K, N), {"bits": 2}, "bits=2"),
        ((K, N), {"group_size": 64}, "group_size=64"),
        ((K, N), {"group_size": -1}, "group_size=-1"),
        ((K, N), {"desc_act": True}, "desc_act=True"),
        ((K, N), {"sym": False}, "sym=False"),
        ((192, N), {}, "in_features=192"),
        ((K, 48), {}, "out_features=48"),
        ((K, N), {"format": "awq"}, "awq"),
        ((K, N), {"route": "fast"}, "'fast'"),
    ],
)
def test_every_constraint_is_a_value_error_naming_the_value(args, kwargs, match):
    with pytest.raises(ValueError, match=match):
        W4AFP8Linear(*args, **kwargs)


def test_wrong_kinds_are_type_errors():
    with pytest.raises(TypeError, match="bits"):
        W4AFP8Linear(K, N, bits=4.0)
    with pytest.raises(TypeError, match="desc_act"):
        W4AFP8Linear(K, N, desc_act=0)
    with pytest.raises(TypeError, match="in_features"):
        W4AFP8Linear("256", N)
    layer = W4AFP8Linear.from_gptq_linear(_gptq())
    with pytest.raises(ValueError, match="'fast'"):
        layer.route = "fast"
    with pytest.raises(TypeError, match="float64"):
        layer(torch.zeros(1, K, dtype=torch.float64))
    with pytest.raises(TypeError, match="x must be"):
        layer([0.0] * K)
    with pytest.raises(ValueError, match=r"\(\*, 256\)"):
        layer(torch.zeros(2, 128))


# ----------------------------------------------------------------------------------------------
# The staged operand and the conversions
# ----------------------------------------------------------------------------------------------


def test_the_staged_operand_is_code_minus_eight():
    layer = W4AFP8Linear.from_packed(_hand_packed(), format="gptq_v2")
    k, n = torch.arange(K)[:, None], torch.arange(N)[None, :]
    assert torch.equal(layer._weight_e4m3.float(), ((k + 3 * n) % 16 - 8).float())
    # decoded weight: 0.25 * (code - 8), (out, in)
    assert torch.equal(layer.dequantize_weight(), (0.25 * ((k + 3 * n) % 16 - 8)).T.float())


@pytest.mark.parametrize("format", ["gptq", "gptq_v2"])
def test_from_gptq_linear_keeps_the_decoded_weight(format):
    g = torch.Generator().manual_seed(3)
    weight = torch.randn(N, K, generator=g)
    sol = rtn_quantize(weight, GPTQSolveOptions(bits=4, group_size=128, sym=True))
    source = GPTQLinear.from_solution(sol, bits=4, group_size=128, format=format)
    layer = W4AFP8Linear.from_gptq_linear(source)
    assert layer.format == format
    assert layer.qweight.data_ptr() == source.qweight.data_ptr()  # shared, not copied
    # the solution's own decode: scale * (code - zero) per (out, group)
    group = torch.arange(K) // 128
    codes, zeros = sol.codes.to(torch.int16), sol.zeros.to(torch.int16)  # (stored as uint8)
    expected = sol.scales.half().float()[:, group] * (codes - zeros[:, group]).float()
    assert torch.equal(layer.dequantize_weight(torch.float32), expected)
    bf16 = torch.bfloat16
    assert torch.equal(layer.dequantize_weight(bf16), source.dequantize_weight(bf16))
    centered = (codes - 8).T.float()  # symmetric: every zero point is 8
    assert torch.equal(layer._weight_e4m3.float(), centered)


def test_v1_and_v2_zero_words_run_the_same():
    v1, v2 = _gptq(format="gptq"), _gptq(format="gptq_v2")
    assert bool((v1.qzeros == 0x77777777).all())
    assert bool((v2.qzeros == 0x88888888 - 2**32).all())
    a, b = W4AFP8Linear.from_gptq_linear(v1), W4AFP8Linear.from_gptq_linear(v2)
    assert torch.equal(_bytes(a._weight_e4m3), _bytes(b._weight_e4m3))
    x = _x(0, 5, K)
    assert torch.equal(a(x), b(x))


def _desc_act_gptq() -> GPTQLinear:
    g = torch.Generator().manual_seed(7)
    weight = torch.randn(N, K, generator=g)
    x = torch.randn(512, K, generator=g) * torch.rand(K, generator=g)
    options = GPTQSolveOptions(
        bits=4, group_size=128, sym=True, desc_act=True, act_group_aware=False
    )
    sol = gptq_solve(weight, x.T @ x / 512 + 0.01 * torch.eye(K), options)
    return GPTQLinear.from_solution(sol, bits=4, group_size=128)


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda: _gptq(bits=8), "bits=8"),
        (lambda: _gptq(group_size=64), "group_size=64"),
        (lambda: _gptq(k=384, group_size=128, n=48), "out_features=48"),
        (lambda: _gptq(k=192), "in_features=192"),
        (lambda: _gptq(sym=False), r"asymmetric zero points: group \d+, output column \d+"),
        (_desc_act_gptq, "g_idx is not arange"),
    ],
)
def test_from_gptq_linear_refuses_ineligible_modules_naming_why(make, match):
    module = make()
    assert w4a_fp8_ineligibility(module) is not None
    with pytest.raises(ValueError, match=match):
        W4AFP8Linear.from_gptq_linear(module)


def test_an_asymmetric_zero_is_refused_at_post_init_naming_group_and_column():
    with pytest.raises(ValueError, match="group 1, output column 5 has zero point 9"):
        W4AFP8Linear.from_packed(_hand_packed(zero_at=(1, 5)), format="gptq_v2")
    # a load of the same words, then post_init: the same refusal
    layer = W4AFP8Linear(K, N, format="gptq_v2")
    source = GPTQLinear.from_packed(_hand_packed(zero_at=(1, 5)), bits=4, group_size=128,
                                    format="gptq_v2")  # fmt: skip
    layer.load_state_dict(source.state_dict())
    with pytest.raises(ValueError, match="group 1, output column 5"):
        layer.post_init()


def test_a_reordered_g_idx_is_refused_at_post_init():
    p = _hand_packed()
    reordered = GPTQPacked(p.qweight, p.qzeros, p.scales, (1 - p.g_idx).contiguous())
    with pytest.raises(ValueError, match=r"g_idx must equal arange\(in\) // 128"):
        W4AFP8Linear.from_packed(reordered, format="gptq_v2")


# ----------------------------------------------------------------------------------------------
# Forward on CPU: the reference route
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_forward_equals_the_pure_reference_on_the_other_operand_bitwise(dtype):
    layer = W4AFP8Linear.from_gptq_linear(_gptq(1, bias=True))
    x = _x(1, 7, K, dtype=dtype)
    out = layer(x)
    assert out.dtype == dtype and out.shape == (7, N)
    assert layer.last_route == "reference" and "cpu" in layer.last_reason
    words = w4a_fp8_linear(x, layer.qweight, layer.scales, layer.bias)  # int32 words operand
    assert torch.equal(out, words)


def test_forward_is_the_linear_of_the_fp8_tokens():
    layer = W4AFP8Linear.from_gptq_linear(_gptq(2, bias=True))
    x = _x(2, 9, K)
    out = layer(x).double()
    w = layer.dequantize_weight(torch.float64)
    b = layer.bias.double()
    # the FP8-token oracle: only FP32 summation separates the two (terms of at most 1.2e3)
    tokens = fp8_token_qdq(x).double()
    oracle = F.linear(tokens, w, b)
    slack = 1e-5 * (tokens.abs() @ w.abs().T + b.abs())
    assert bool(((out - oracle).abs() <= slack).all())
    # against the unquantized x: each token element moves by at most half an E4M3 step (2**-4
    # relative for normal codes, scale * 2**-10 below them)
    scale = fp8_token_quantize(x).scale.double()
    per_element = 2.0**-4 * x.double().abs() + scale * 2.0**-10
    bound = per_element @ w.abs().T + slack
    exact = F.linear(x.double(), w, b)
    error = (out - exact).abs()
    assert bool((error <= bound).all())
    assert float(error.max()) > 0  # the tokens were quantized


def test_empty_rows_and_three_dimensional_input():
    layer = W4AFP8Linear.from_gptq_linear(_gptq(3, bias=True))
    for shape in ((0, K), (2, 0, K)):
        out = layer(torch.zeros(shape, dtype=torch.bfloat16))
        assert out.shape == (*shape[:-1], N) and out.dtype == torch.bfloat16
    x = _x(3, 2, 3, K)
    out = layer(x)
    assert out.shape == (2, 3, N)
    assert torch.equal(out, layer(x.reshape(6, K)).reshape(2, 3, N))


def test_casts_and_moves_keep_every_byte():
    layer = W4AFP8Linear.from_gptq_linear(_gptq(4, bias=True))
    before = {n: _bytes(t).clone() for n, t in layer.named_buffers()}
    for cast in (lambda m: m.to(torch.bfloat16), lambda m: m.half(), lambda m: m.float(),
                 lambda m: m.to("cpu")):  # fmt: skip
        cast(layer)
        after = dict(layer.named_buffers())
        assert sorted(after) == sorted(before)
        for name, t in after.items():
            assert t.dtype == before[name].dtype or name == "_weight_e4m3", name
            assert torch.equal(_bytes(t), before[name]), name
    assert layer._weight_e4m3.dtype == torch.float8_e4m3fn
    x = _x(4, 3, K, dtype=torch.bfloat16)
    assert torch.equal(layer(x), w4a_fp8_linear(x, layer.qweight, layer.scales, layer.bias))


def test_load_state_dict_empties_the_cache_and_post_init_restores_it():
    source = _gptq(5, bias=True)
    ready = W4AFP8Linear.from_gptq_linear(source)
    x = _x(5, 4, K)
    expected = ready(x)
    layer = W4AFP8Linear(K, N, bias=True)
    layer.load_state_dict(source.state_dict())
    assert layer._weight_e4m3 is None
    with pytest.raises(RuntimeError, match=CACHE_ABSENT):
        layer(x)
    assert layer.post_init() is layer
    assert torch.equal(layer(x), expected)
    ready.load_state_dict(_gptq(6, bias=True).state_dict())  # a loaded module too
    with pytest.raises(RuntimeError, match=CACHE_ABSENT):
        ready(x)
    bad = torch.zeros(3, N, dtype=torch.int32)
    with pytest.raises(ValueError, match="qweight"):  # GPTQLinear's checks, naming the key
        layer.load_state_dict({**source.state_dict(), "qweight": bad})
    assert torch.equal(layer(x), expected)  # a refused load changes nothing, the cache included


def test_pack_replaces_the_weight_and_empties_the_cache():
    layer = W4AFP8Linear.from_gptq_linear(_gptq(7))
    other = _gptq(8, format="gptq_v2")
    layer.pack(other.packed(), format="gptq_v2")
    assert layer._weight_e4m3 is None and layer.format == "gptq_v2"
    with pytest.raises(RuntimeError, match=CACHE_ABSENT):
        layer(_x(7, 2, K))
    layer.post_init()
    x = _x(8, 2, K)
    assert torch.equal(layer(x), W4AFP8Linear.from_gptq_linear(other)(x))
    with pytest.raises(ValueError, match=r"\(32, 256\)"):
        layer.pack(_gptq(9, n=32).packed())


# ----------------------------------------------------------------------------------------------
# The activation carrier and the routes
# ----------------------------------------------------------------------------------------------


def test_an_fp8_carrier_gives_what_the_tensor_gives():
    from floatxq.w4a.activation import pack_activation

    layer = W4AFP8Linear.from_gptq_linear(_gptq(10, bias=True))
    for dtype in (torch.bfloat16, torch.float16):
        x = _x(10, 2, 3, K, dtype=dtype)
        carried = layer(pack_activation(x, "w4afp8"))
        assert carried.dtype == dtype and carried.shape == (2, 3, N)
        assert torch.equal(carried, layer(x))
        assert layer.last_route == "reference"
    empty = layer(pack_activation(torch.zeros(0, K, dtype=torch.bfloat16), "w4afp8"))
    assert empty.shape == (0, N) and empty.dtype == torch.bfloat16


def test_an_nvfp4_carrier_is_refused_naming_its_mode():
    from floatxq.w4a.activation import pack_activation

    layer = W4AFP8Linear.from_gptq_linear(_gptq(11))
    carrier = pack_activation(_x(11, 2, K, dtype=torch.bfloat16), "w4a_nvfp4", global_scale=1.0)
    with pytest.raises(ValueError, match="'w4a_nvfp4'"):
        layer(carrier)
    wide = pack_activation(_x(11, 2, 2 * K, dtype=torch.bfloat16), "w4afp8")
    with pytest.raises(ValueError, match=r"\(\*, 256\)"):
        layer(wide)


def test_routes_and_reasons(monkeypatch):
    layer = W4AFP8Linear.from_gptq_linear(_gptq(12))
    x = _x(12, 2, K)
    assert layer.last_route == "none" and layer.last_reason is None
    layer(x)
    assert layer.last_route == "reference" and "cpu" in layer.last_reason
    layer.route = "reference"
    layer(x)
    assert layer.last_reason == "route='reference' was requested"
    assert w4a_fp8_route("auto", torch.device("cpu"))[0] == "reference"
    if not w4a_kernels.triton_interpret_enabled():
        layer.route = "triton"
        with pytest.raises(RuntimeError, match="route='triton' cannot run on cpu"):
            layer(x)
    # a GPU below the kernels' floor, as the kernels report it
    old_gpu = "CUDA device 0 is SM 8.0 < 8.9: the W4A-FP8 kernels need FP8 tensor cores"
    monkeypatch.setattr(w4a_kernels, "w4a_fp8_unavailable_reason", lambda device: old_gpu)
    with pytest.raises(RuntimeError, match=r"SM 8\.0 < 8\.9"):
        w4a_fp8_route("triton", torch.device("cpu"))
    layer.route = "auto"
    layer(x)  # the decision for "auto" on this device and row count was kept from the first call
    assert layer.last_reason != old_gpu
    layer.post_init()  # rebuilt caches: decided again, from the facts of now
    layer(x)
    assert (layer.last_route, layer.last_reason) == ("reference", old_gpu)
    assert "route=auto" in repr(layer)


# ----------------------------------------------------------------------------------------------
# The Triton route against a float64 oracle (GPU, or the interpreter without CUDA)
# ----------------------------------------------------------------------------------------------


def _oracle_and_bound(
    x: torch.Tensor, layer: W4AFP8Linear, *, chunk_bits: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The exact W4A-FP8 result in float64 and floatxq.testing's statistical bound on a GEMM's
    error for it (the one a single wrong weight code breaks), for FP32 sums or, with
    ``chunk_bits``, tensor cores that truncate inside a group.

    The operands are decoded independently of the staged cache: the token codes and scales
    of ``fp8_token_quantize``, the int32 words read as ``code - 8``, the group scales.
    """
    tokens = fp8_token_quantize(x)
    accumulation = (
        FP32_ACCUMULATION if chunk_bits is None else Accumulation(chunk=128, chunk_bits=chunk_bits)
    )
    bound = w4a_fp8_linear_error_bound(
        tokens.codes, tokens.scale[:, 0], layer.qweight, layer.scales, layer.bias,
        output_dtype=x.dtype, accumulation=accumulation,
    )  # fmt: skip
    return bound.exact, bound.statistical


def _check_triton(device: str, rows: int, dtype: torch.dtype, *, chunk_bits: int | None) -> None:
    layer = W4AFP8Linear.from_gptq_linear(_gptq(20 + rows, bias=True)).to(device)
    x = _x(rows, rows, K, dtype=dtype).to(device)
    out = layer(x)
    assert layer.last_route == "triton" and layer.last_reason is None
    assert out.dtype == dtype and out.shape == (rows, N)
    exact, bound = _oracle_and_bound(x, layer, chunk_bits=chunk_bits)
    error = (out.double() - exact).abs()
    assert bool((error <= bound).all()), float((error / bound).max())
    reference = w4a_fp8_linear(x, layer._weight_e4m3, layer.scales, layer.bias)
    assert bool(((reference.double() - exact).abs() <= bound).all())
    from floatxq.w4a.activation import pack_activation

    if dtype != torch.float32:  # a carrier holds float16/bfloat16 activations
        carried = layer(pack_activation(x, "w4afp8"))
        assert layer.last_route == "triton"
        assert bool(((carried.double() - exact).abs() <= bound).all())


GPU_ROWS = [1, 5, 16, 64, 65, 300]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("rows", GPU_ROWS)
def test_gpu_triton_route_is_the_reference_up_to_summation_order(rows, dtype):
    if w4a_kernels.w4a_fp8_unavailable_reason(torch.device("cuda")) is not None:
        pytest.skip(w4a_kernels.w4a_fp8_unavailable_reason(torch.device("cuda")))
    words = dispatch.w4a_fp8_operand(rows) == "words"
    # words: exact products on FP16 tensor cores, FP32 sums; E4M3 tiles: Hopper's FP8 MMA
    # truncates inside a group (about 13 fraction bits)
    _check_triton("cuda", rows, dtype, chunk_bits=None if words else 13)


@pytest.mark.gpu
def test_gpu_moves_keep_the_staged_bytes_and_route_is_forced():
    layer = W4AFP8Linear.from_gptq_linear(_gptq(30))
    staged = _bytes(layer._weight_e4m3).clone()
    layer.to("cuda").to(torch.bfloat16)
    assert layer._weight_e4m3.is_cuda and torch.equal(_bytes(layer._weight_e4m3).cpu(), staged)
    layer.route = "reference"
    x = _x(30, 3, K, dtype=torch.bfloat16).cuda()
    out = layer(x)
    assert layer.last_route == "reference" and out.is_cuda
    exact, bound = _oracle_and_bound(x, layer)
    assert bool(((out.double() - exact).abs() <= bound).all())


@pytest.mark.skipif(
    not can_interpret(),
    reason="needs Triton installed and no CUDA device (with CUDA the compiled kernel is tested)",
)
def test_interpreter_suite():
    run_interpreted_tests(__file__, expected=1)


@needs_interpreter
def test_interpreted_triton_route_is_the_reference_up_to_summation_order():
    # one row reads the words, 65 rows the staged E4M3 operand (both FP32 sums here)
    for rows in (1, 65):
        assert (dispatch.w4a_fp8_operand(rows) == "words") == (rows == 1)
        _check_triton("cpu", rows, torch.bfloat16, chunk_bits=None)
