"""The INT4-weight kernels against their pure references.

* ``fp8_pack`` equals :func:`floatxq.fp8_token_quantize` bit for bit (rows 0, 1, 7, 129, 1000;
  K 128 to 8192; float16/bfloat16/float32; zero, tiny and huge rows);
* ``fp8_linear`` / ``fp8_linear_prepacked`` (both weight forms) hold the float64 value of the
  grouped sum of the same operands within the statistical bound of their accumulation: FP32
  sums for FP16 tensor cores and the interpreter, Hopper's truncating FP8 sums for the E4M3
  route;
* the W4A16 decode equals :func:`floatxq.dequantize_gptq` bit for bit (2/4/8 bits, v1/v2,
  ``desc_act`` orders, one group), and both W4A16 routes hold ``F.linear`` of the decoded weight
  within the FP32 bound;
* the bounds can fail: an output with one weight code off by one is caught (CPU, below).

GPU tests run the compiled kernels; without CUDA, ``test_interpreter_suite`` reruns the
``interpreted`` tests in a child process under ``TRITON_INTERPRET=1`` on small float16 shapes
(the interpreter converts to bfloat16 by truncation, so bfloat16 is checked on the GPU only).
"""

import pytest
import torch

import floatxq as fq
from floatxq.dispatch import w4a16_route, w4a_fp8_gemm_route, w4a_fp8_operand
from floatxq.gptq.int4 import dequantize_gptq, pack_gptq
from floatxq.gptq.planes import centered_int4, int4_to_e4m3
from floatxq.kernels import w4a16 as w4a16_kernels
from floatxq.kernels.w4a16 import dequantize_gptq_kernel, w4a16_linear_kernel
from floatxq.kernels.w4a_fp8 import (
    DEFAULT_W4A_FP8_TUNING,
    fp8_linear,
    fp8_linear_prepacked,
    fp8_pack,
)
from floatxq.testing import (
    FP32_ACCUMULATION,
    HOPPER_FP8_ACCUMULATION,
    assert_bitwise_equal,
    assert_within_bound,
    production_checks,
    w4a16_linear_error_bound,
    w4a_fp8_linear_error_bound,
)
from floatxq.testing.interpreter import can_interpret, needs_interpreter, run_interpreted_tests
from floatxq.w4a.linear import w4a16_linear, w4a_fp8_linear_prepacked

# ----------------------------------------------------------------------------------------------
# Cases
# ----------------------------------------------------------------------------------------------


def _pack_input(seed, rows, k, dtype, device, *, subnormal=True):
    """Rows over many binades, with a zero row, a row of tiny values (FP32 subnormals for
    float32 unless ``subnormal=False``: the interpreter flushes them) and a row at the dtype's
    largest finite values."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=g) * torch.exp2(torch.randint(-8, 8, (rows, 1), generator=g))
    if rows > 3:
        x[1] = 0.0
        x[2] = x[2] * (2.0**-140 if dtype == torch.float32 and subnormal else 2.0**-20)
        x[3] = torch.finfo(dtype).max * torch.sign(x[3])
    return x.to(dtype).to(device)


def _weight(seed, k, n, device, *, scales_dtype=torch.float16):
    """A symmetric 4-bit GPTQ weight with groups of 128 (codes 0..15, zero 8) in v1 packing,
    scales spread over binades."""
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (k, n), generator=g)
    zeros = torch.full((k // 128, n), 8)
    scales = torch.rand(k // 128, n, generator=g) * 0.02 + 0.001
    g_idx = torch.arange(k, dtype=torch.int32) // 128
    packed = pack_gptq(codes, zeros, scales, g_idx, format="gptq")
    packed = packed._replace(scales=packed.scales.to(scales_dtype))
    return type(packed)(*(t.to(device) for t in packed))


def _operands(packed, form):
    """The weight operand of a form: the int32 words, the staged E4M3 ``(k, n)`` row-major, or
    the same values stored K-contiguous."""
    if form == "words":
        return packed.qweight
    e4m3 = int4_to_e4m3(centered_int4(packed, format="gptq"))
    return e4m3 if form == "e4m3" else e4m3.T.contiguous().T


def _check_linear(seed, m, n, k, dtype, form, device, *, with_bias=True, route=None):
    packed = _weight(seed, k, n, device)
    weight = _operands(packed, form)
    route = route or w4a_fp8_gemm_route(m, weight)[0]
    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(m, k, generator=g) * torch.exp2(torch.randint(-6, 6, (m, 1), generator=g))
    x = x.to(dtype).to(device)
    bias = (torch.randn(n, generator=g) * 4).to(dtype).to(device) if with_bias else None
    out = fp8_linear(x, weight, packed.scales, bias, route=route)
    assert out.dtype == dtype and out.shape == (m, n)
    codes, row_scale = fp8_pack(x)
    again = fp8_linear_prepacked(codes, row_scale, weight, packed.scales, bias, dtype, route=route)
    assert_bitwise_equal(again, out, msg="prepacked")
    interpreted = device == "cpu"
    # FP8 tensor cores (truncating sums inside a group): cuBLAS, and the Triton E4M3 tiles
    tiles = route == "scaled_mm_blockwise" or w4a_fp8_operand(m) == "e4m3"
    fp8_mma = not interpreted and tiles and form != "words"
    accumulation = HOPPER_FP8_ACCUMULATION if fp8_mma else FP32_ACCUMULATION
    tokens = fq.fp8_token_quantize(x)
    bound = w4a_fp8_linear_error_bound(
        tokens.codes, tokens.scale[:, 0], weight, packed.scales, bias, output_dtype=dtype,
        accumulation=accumulation,
    )  # fmt: skip
    assert_within_bound(out, bound, msg=f"{form} {(m, n, k)} {dtype}")


def _w4a16_case(seed, bits, k, n, group_size, fmt, desc_act, device, scales_dtype=torch.float16):
    g = torch.Generator().manual_seed(seed)
    groups = 1 if group_size == -1 else -(-k // group_size)
    codes = torch.randint(0, 2**bits, (k, n), generator=g)
    low = 1 if fmt == "gptq" else 0  # (v1 cannot store a zero point of 0 without a borrow)
    zeros = torch.randint(low, 2**bits, (groups, n), generator=g)
    scales = torch.rand(groups, n, generator=g) * 0.02 + 0.001
    size = k if group_size == -1 else group_size
    g_idx = (torch.arange(k) // size).to(torch.int32)
    if desc_act:
        g_idx = g_idx[torch.randperm(k, generator=g)]
    packed = pack_gptq(codes, zeros, scales, g_idx, bits=bits, format=fmt)
    packed = packed._replace(scales=packed.scales.to(scales_dtype))  # (as a checkpoint holds)
    return type(packed)(*(t.to(device) for t in packed)), (None if desc_act else size)


W4A16_CASES = [
    # (bits, k, n, group_size, format, desc_act, scales dtype): groups of one tile, of several
    # tiles, smaller than a tile (each row's group), desc_act orders, one group; 2/4/8 bits
    (4, 256, 64, 128, "gptq", False, torch.float16),
    (4, 384, 96, 64, "gptq_v2", True, torch.float16),
    (8, 256, 32, 32, "gptq", False, torch.bfloat16),
    (2, 512, 64, -1, "gptq", False, torch.float16),
    (4, 512, 160, 256, "gptq_v2", False, torch.float32),
    (4, 384, 32, 32, "gptq", False, torch.float16),
]


def _check_w4a16(seed, case, m, dtype, route, device):
    bits, k, n, group_size, fmt, desc_act, scales_dtype = case
    packed, group = _w4a16_case(seed, bits, k, n, group_size, fmt, desc_act, device, scales_dtype)
    decoded = dequantize_gptq_kernel(packed, bits=bits, format=fmt, dtype=dtype, group_size=group)
    reference = dequantize_gptq(packed, bits=bits, format=fmt, dtype=dtype)
    assert_bitwise_equal(decoded, reference, msg=f"decode {case} {dtype}")
    gathered = dequantize_gptq_kernel(packed, bits=bits, format=fmt, dtype=dtype)
    assert_bitwise_equal(gathered, reference, msg=f"decode by g_idx {case} {dtype}")
    g = torch.Generator().manual_seed(seed + 2)
    x = torch.randn(m, k, generator=g).to(dtype).to(device)
    bias = torch.randn(n, generator=g).to(dtype).to(device)
    out = w4a16_linear_kernel(x, packed, bias, bits=bits, format=fmt, group_size=group, route=route)
    assert out.dtype == dtype and out.shape == (m, n)
    bound = w4a16_linear_error_bound(x, reference, bias)
    assert_within_bound(out, bound, msg=f"{route} {case} m={m} {dtype}")


# ----------------------------------------------------------------------------------------------
# CPU: the bounds can fail; argument checks
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("accumulation", [FP32_ACCUMULATION, HOPPER_FP8_ACCUMULATION])
@pytest.mark.parametrize("k", [128, 1024, 8192])
def test_w4a_fp8_bound_catches_one_wrong_weight_code(k, accumulation):
    packed = _weight(3, k, 64, "cpu")
    x = (torch.randn(2, k, generator=torch.Generator().manual_seed(4)) * 3).bfloat16()
    tokens = fq.fp8_token_quantize(x)
    codes, row_scale = tokens.codes, tokens.scale[:, 0]
    weight = _operands(packed, "e4m3")
    bound = w4a_fp8_linear_error_bound(
        codes, row_scale, weight, packed.scales, None, output_dtype=torch.float32,
        accumulation=accumulation,
    )  # fmt: skip
    reference = w4a_fp8_linear_prepacked(
        codes, row_scale, weight, packed.scales, output_dtype=torch.float32
    )
    assert_within_bound(reference, bound)  # FP32 sums: within either model
    # one code of column 5 off by one, where row 0's token code is largest
    c = weight.float()
    kk = int(codes[0].float().abs().argmax())
    c[kk, 5] += 1 if c[kk, 5] < 7 else -1
    wrong = w4a_fp8_linear_prepacked(
        codes, row_scale, c.to(torch.float8_e4m3fn), packed.scales, output_dtype=torch.float32
    )
    with pytest.raises(AssertionError, match="outside the statistical bound"):
        assert_within_bound(wrong, bound)


@pytest.mark.parametrize("k", [128, 4096])
def test_w4a16_bound_catches_one_wrong_weight(k):
    packed, _ = _w4a16_case(5, 4, k, 64, 128, "gptq", False, "cpu")
    weight = dequantize_gptq(packed, bits=4, format="gptq", dtype=torch.bfloat16)
    x = torch.randn(3, k, generator=torch.Generator().manual_seed(6)).bfloat16()
    bound = w4a16_linear_error_bound(x, weight, None)
    assert_within_bound(w4a16_linear(x, packed), bound)
    kk = int(x[0].float().abs().argmax())
    scale = float(packed.scales[kk // 128, 9])
    wrong = weight.clone()
    wrong[9, kk] += scale  # one code one step off
    with pytest.raises(AssertionError, match="outside the statistical bound"):
        assert_within_bound(torch.nn.functional.linear(x.float(), wrong.float()), bound)


def test_kernels_refuse_cpu_tensors_and_bad_shapes():
    packed = _weight(0, 256, 32, "cpu")
    x = torch.randn(2, 256)
    if not torch.cuda.is_available():
        with pytest.raises((TypeError, RuntimeError), match="fp8_pack"):
            fp8_pack(x)
        with pytest.raises((TypeError, RuntimeError), match="w4a16_linear_kernel"):
            w4a16_linear_kernel(x.half(), packed)
    with pytest.raises(ValueError, match="multiple of 128"):
        fp8_linear(torch.randn(2, 200), packed.qweight[:25], packed.scales[:1])
    with pytest.raises(ValueError, match="scales must have shape"):
        fp8_linear(x, packed.qweight, packed.scales[:1])
    with pytest.raises(TypeError, match="float8_e4m3fn"):
        fp8_linear(x, packed.qweight.float(), packed.scales)
    with production_checks():  # (the test run's annotation check would answer first)
        with pytest.raises(TypeError, match="x must be a 2-D"):
            fp8_pack(torch.randn(2, 3, 128))
        with pytest.raises(TypeError, match="float16/bfloat16 tensor"):
            w4a16_linear_kernel(x, packed)


def test_operand_choice_and_tuning_checks():
    assert w4a_fp8_operand(DEFAULT_W4A_FP8_TUNING.words_max_rows) == "words"
    assert w4a_fp8_operand(DEFAULT_W4A_FP8_TUNING.words_max_rows + 1) == "e4m3"
    with pytest.raises(ValueError, match="power of two"):
        type(DEFAULT_W4A_FP8_TUNING)(words_block_n=48)
    with pytest.raises(ValueError, match="dwords_small_block_n must be a power of two"):
        type(DEFAULT_W4A_FP8_TUNING)(dwords_small_block_n=96)
    with pytest.raises(ValueError, match=">= 16"):
        w4a16_kernels.W4A16Tuning(block_k=8)


def test_gemm_route_choices_name_their_reasons():
    # the row-count switches live in dispatch; the kernels run the route they are given
    tuning = w4a16_kernels.W4A16Tuning(fused_max_rows=8)
    assert [w4a16_route(m, tuning) for m in (0, 8, 9)] == [
        "w4a16_fused", "w4a16_fused", "w4a16_decode_gemm"
    ]  # fmt: skip
    packed = _weight(5, 256, 64, "cpu")
    words, staged = packed.qweight, _operands(packed, "e4m3_kmajor")
    assert w4a_fp8_gemm_route(127, staged) == (
        "triton",
        "127 rows < 128: the Triton GEMM is faster",
    )
    route, reason = w4a_fp8_gemm_route(130, staged)
    assert route == "triton" and "multiple of 4" in reason
    route, reason = w4a_fp8_gemm_route(256, words)
    assert route == "triton" and "K-contiguous" in reason
    route, reason = w4a_fp8_gemm_route(256, _operands(packed, "e4m3"))
    assert route == "triton" and "K-contiguous" in reason
    route, reason = w4a_fp8_gemm_route(256, staged)
    assert route == "triton" and reason  # on the CPU: the weight's device or the torch named
    lower = w4a_fp8_gemm_route(64, staged, type(DEFAULT_W4A_FP8_TUNING)(cublas_min_rows=64))
    assert lower[0] == "triton" and "rows <" not in lower[1]  # past the threshold: a fact stops it
    x = torch.randn(2, 256, dtype=torch.float16)
    with production_checks():
        with pytest.raises(ValueError, match="route must be None or one of"):
            w4a16_linear_kernel(x, packed, route="fused")
        with pytest.raises(ValueError, match="route must be None or one of"):
            fp8_linear(x, words, packed.scales, route="cublas")


# ----------------------------------------------------------------------------------------------
# The interpreter (CPU, small float16 shapes)
# ----------------------------------------------------------------------------------------------


@pytest.mark.skipif(
    not can_interpret(),
    reason="needs Triton installed and no CUDA device (with CUDA the compiled kernel is tested)",
)
def test_interpreter_suite():
    run_interpreted_tests(__file__, expected=4)


@needs_interpreter
@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
def test_interpreted_fp8_pack():
    for seed, (rows, k) in enumerate([(0, 128), (1, 128), (7, 384), (5, 1000)]):
        for dtype in (torch.float16, torch.float32):
            x = _pack_input(seed, rows, k, dtype, "cpu", subnormal=False)
            codes, scale = fp8_pack(x)
            t = fq.fp8_token_quantize(x)
            assert_bitwise_equal(codes, t.codes, msg=f"{(rows, k)} {dtype}")
            assert_bitwise_equal(scale, t.scale[:, 0], msg=f"{(rows, k)} {dtype}")


@needs_interpreter
def test_interpreted_fp8_linear():
    for seed, (m, n, k) in enumerate([(1, 64, 128), (7, 96, 384), (0, 32, 128), (70, 64, 256)]):
        for form in ("words", "e4m3", "e4m3_kmajor"):
            _check_linear(seed, m, n, k, torch.float16, form, "cpu")


@needs_interpreter
def test_interpreted_w4a16_fused():
    for seed, case in enumerate(W4A16_CASES):
        _check_w4a16(seed, case, 3, torch.float16, "w4a16_fused", "cpu")


@needs_interpreter
def test_interpreted_w4a16_decode_gemm():
    for seed, case in enumerate(W4A16_CASES[:2]):
        _check_w4a16(seed, case, 5, torch.float16, "w4a16_decode_gemm", "cpu")


# ----------------------------------------------------------------------------------------------
# GPU: the compiled kernels
# ----------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_fp8_pack_is_bitwise_fp8_token_quantize(dtype):
    for seed, rows in enumerate((0, 1, 7, 129, 1000)):
        for k in (128, 1000, 4096, 8192):
            x = _pack_input(seed, rows, k, dtype, "cuda")
            codes, scale = fp8_pack(x)
            t = fq.fp8_token_quantize(x)
            assert_bitwise_equal(codes, t.codes, msg=f"{(rows, k)} {dtype}")
            assert_bitwise_equal(scale, t.scale[:, 0], msg=f"{(rows, k)} {dtype}")
    x = _pack_input(9, 16, 512, dtype, "cuda")[:, ::2]  # strided rows and columns
    codes, scale = fp8_pack(x)
    assert_bitwise_equal(codes, fq.fp8_token_quantize(x).codes, msg="strided")


@pytest.mark.gpu
@pytest.mark.parametrize("form", ["words", "e4m3", "e4m3_kmajor"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fp8_linear_within_the_bound(form, dtype):
    shapes = [(0, 96, 128), (1, 96, 128), (7, 160, 384), (16, 256, 4096), (33, 1024, 8192),
              (64, 96, 1024), (65, 256, 1024), (300, 160, 2048), (1, 4096, 8192)]  # fmt: skip
    for seed, (m, n, k) in enumerate(shapes):
        _check_linear(seed, m, n, k, dtype, form, "cuda", with_bias=seed % 2 == 0)


@pytest.mark.gpu
def test_fp8_linear_repeats_bitwise_after_split_k():
    packed = _weight(1, 8192, 1024, "cuda")
    x = torch.randn(4, 8192, device="cuda", dtype=torch.bfloat16)
    first = fp8_linear(x, packed.qweight, packed.scales)
    for _ in range(3):  # the split-K counters were reset; arrival order does not matter
        assert_bitwise_equal(fp8_linear(x, packed.qweight, packed.scales), first)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("route", ["w4a16_fused", "w4a16_decode_gemm"])
def test_w4a16_within_the_bound(route, dtype):
    for seed, case in enumerate(W4A16_CASES):
        for m in (0, 1, 16, 100):
            _check_w4a16(seed, case, m, dtype, route, "cuda")


@pytest.mark.gpu
def test_w4a16_large_shape_and_split_k():
    case = (4, 8192, 1024, 128, "gptq", False, torch.float16)
    for m in (1, 7, 64):
        _check_w4a16(11, case, m, torch.bfloat16, "w4a16_fused", "cuda")


@pytest.mark.gpu
def test_gptq_linear_routes_on_cuda():
    from floatxq.gptq.solve import GPTQSolveOptions, rtn_quantize
    from floatxq.nn import GPTQLinear

    w = torch.randn(256, 512)
    sol = rtn_quantize(w, GPTQSolveOptions(bits=4, group_size=128))
    layer = GPTQLinear.from_solution(sol, bits=4, group_size=128, bias=torch.randn(256)).cuda()
    reference = layer.dequantize_weight(torch.bfloat16)
    for rows, route in ((1, "w4a16_frag"), (32, "w4a16_words"), (33, "w4a16_fused"),
                        (300, "w4a16_decode_gemm")):  # fmt: skip
        x = torch.randn(rows, 512, device="cuda", dtype=torch.bfloat16)
        out = layer(x)
        assert layer.last_route == route and layer.last_reason is None
        assert_within_bound(out, w4a16_linear_error_bound(x, reference, layer.bias))
    x = torch.randn(3, 512, device="cuda")
    layer(x)
    assert layer.last_route == "dequant_matmul" and "float16/bfloat16" in layer.last_reason
    assert layer.contiguous_group_size() == 128


@pytest.mark.gpu
def test_fp8_linear_takes_cublas_for_prefill_rows_within_the_bound():
    for seed, (m, n, k) in enumerate([(128, 256, 1024), (300, 160, 2048), (1000, 1024, 1024)]):
        packed = _weight(seed, k, n, "cuda")
        assert w4a_fp8_gemm_route(m, _operands(packed, "e4m3_kmajor")) == (
            "scaled_mm_blockwise",
            None,
        )
        for with_bias in (False, True):
            _check_linear(seed, m, n, k, torch.bfloat16, "e4m3_kmajor", "cuda",
                          with_bias=with_bias, route="scaled_mm_blockwise")  # fmt: skip
    packed = _weight(7, 256, 64, "cuda")
    staged = _operands(packed, "e4m3_kmajor")
    route, reason = w4a_fp8_gemm_route(130, staged)
    assert route == "triton" and "multiple of 4" in reason
    route, reason = w4a_fp8_gemm_route(256, _operands(packed, "e4m3"))
    assert route == "triton" and "K-contiguous" in reason
    # forced: any multiple of 4 rows runs (below 128 rows only slower); other counts are refused
    _check_linear(8, 16, 256, 1024, torch.bfloat16, "e4m3_kmajor", "cuda",
                  route="scaled_mm_blockwise")  # fmt: skip
    x = torch.randn(18, 256, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="cannot run here: 18 rows"):
        fp8_linear(x, staged, packed.scales, route="scaled_mm_blockwise")
