"""The fragment-words kernels (``floatxq.kernels.w4a_frag``): W4A16 and W4A-FP8 for the fewest
rows, the decoded weights as the register operand of ``mma.sync``, against the pure references.

* W4A16 (``route="w4a16_frag"``): the decode is exact — one-hot rows of ``x`` pick single
  weights, bit for bit :func:`floatxq.dequantize_gptq`'s — and every product lies within the
  FP32 accumulation bound of :func:`floatxq.w4a16_linear` (which fails on one wrong code).
  Groups of 32, 64, 128, 256 and one group; both zero-point conventions; ragged ``in`` and
  ``out`` (not multiples of 16: padded fragment columns); 0 to 40 rows (blocks of 32 past 32);
  scales of the activations' dtype (no low parts) and of the other one.
* W4A-FP8 (``route="fragment"``): within the FP32 bound of
  :func:`floatxq.w4a_fp8_linear_prepacked`, which reads the same codes.
* Split-K sums repeat bit for bit; the modules route their fewest rows here.

Gluon has no interpreter: on the CPU only the refusals run.
"""

import pytest
import torch

import floatxq as fq
from floatxq.gptq.decode_words import gptq_decode_operands, stage_decode_words
from floatxq.gptq.fragment_words import stage_fragment_words
from floatxq.gptq.int4 import dequantize_gptq, unpack_gptq
from floatxq.kernels.w4a16 import w4a16_linear_kernel
from floatxq.kernels.w4a_fp8 import fp8_linear_prepacked, fp8_pack
from floatxq.kernels.w4a_frag import (
    FragTuning,
    fragment_unavailable_reason,
    w4a16_frag_linear,
    w4a_fp8_frag_gemm,
)
from floatxq.testing import (
    FP32_ACCUMULATION,
    assert_bitwise_equal,
    assert_within_bound,
    w4a16_linear_error_bound,
    w4a_fp8_linear_error_bound,
)
from tests.test_kernels_w4a_words import _case  # (the same GPTQ cases)

# (k, n, group_size, format, scales dtype): one group per tile, several per tile, groups
# spanning tiles, one group over a ragged k, ragged k and n (n not a multiple of 16)
CASES = [
    (256, 64, 128, "gptq", torch.float16),
    (384, 96, 64, "gptq_v2", torch.bfloat16),
    (256, 40, 32, "gptq", torch.float16),
    (512, 200, 256, "gptq_v2", torch.float16),
    (200, 24, -1, "gptq", torch.bfloat16),
]


def _check_w4a16(seed, case, rows, dtype):
    k, n, group_size, fmt, scales_dtype = case
    packed, size = _case(seed, k, n, group_size, fmt, scales_dtype, "cuda")
    reference = dequantize_gptq(packed, format=fmt, dtype=dtype)
    g = torch.Generator().manual_seed(seed + 1)
    for m in rows:
        x = torch.randn(m, k, generator=g).to(dtype).cuda()
        bias = torch.randn(n, generator=g).to(dtype).cuda() if (seed + m) % 2 else None
        out = w4a16_linear_kernel(x, packed, bias, format=fmt, group_size=size, route="w4a16_frag")
        assert out.dtype == dtype and out.shape == (m, n)
        bound = w4a16_linear_error_bound(x, reference, bias)
        assert_within_bound(out, bound, msg=f"frag {case} m={m} {dtype}")
    # the decode itself, bit for bit: one-hot rows pick single weights (eight at a time)
    rows_of_k = torch.randperm(k, generator=g)[:8]
    picker = torch.zeros(8, k, dtype=dtype, device="cuda")
    picker[torch.arange(8), rows_of_k.cuda()] = 1
    picked = w4a16_linear_kernel(picker, packed, format=fmt, group_size=size, route="w4a16_frag")
    expected = reference.T[rows_of_k.cuda()]  # (the reference is (out, in))
    assert_bitwise_equal(picked, expected, msg=f"decode {case} {dtype}")


def _check_fp8(seed, m, n, k, dtype):
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (k, n), generator=g)
    scales = (torch.rand(k // 128, n, generator=g) * 0.02 + 0.001).to(torch.float16).cuda()
    words = stage_decode_words(codes).cuda()
    frag = stage_fragment_words(words)
    x = (torch.randn(m, k, generator=g) * 4).to(dtype).cuda()
    bias = torch.randn(n, generator=g).to(dtype).cuda() if seed % 2 else None
    tokens, row_scale = fp8_pack(x)
    out = fp8_linear_prepacked(tokens, row_scale, frag, scales, bias, dtype, route="fragment")
    assert out.dtype == dtype and out.shape == (m, n)
    t = fq.fp8_token_quantize(x)
    bound = w4a_fp8_linear_error_bound(
        t.codes, t.scale[:, 0], words, scales, bias, output_dtype=dtype,
        accumulation=FP32_ACCUMULATION,
    )  # fmt: skip
    assert_within_bound(out, bound, msg=f"fp8 fragment words {(m, n, k)} {dtype}")


# ----------------------------------------------------------------------------------------------
# CPU: refusals
# ----------------------------------------------------------------------------------------------


def test_fragment_kernels_say_why_not_on_the_cpu():
    assert "CUDA" in fragment_unavailable_reason(torch.device("cpu"))


def test_tuning_refuses_what_the_kernels_cannot_run():
    with pytest.raises(ValueError, match="stages"):
        FragTuning(stages=3)
    with pytest.raises(ValueError, match="multiple of warps"):
        FragTuning(blocks=4, warps=8)
    with pytest.raises(ValueError, match="w4a16_blocks must be a power of two"):
        FragTuning(w4a16_blocks=12)
    with pytest.raises(ValueError, match="int >= 1"):
        FragTuning(w4a16_max_rows=0)
    with pytest.raises(ValueError, match="reduce_chunk must be 1, 2, 4, 8 or 16"):
        FragTuning(reduce_chunk=3)


# ----------------------------------------------------------------------------------------------
# GPU
# ----------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_w4a16_frag_within_the_bound_and_exact_decode(dtype):
    for seed, case in enumerate(CASES):
        _check_w4a16(seed, case, (0, 1, 3, 8, 40), dtype)
    _check_w4a16(20, (8192, 1024, 128, "gptq", torch.float16), (1, 8), dtype)  # split K


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_w4a_fp8_fragment_within_the_bound(dtype):
    shapes = [(0, 96, 128), (1, 96, 128), (3, 160, 384), (4, 256, 4096), (1, 4096, 8192),
              (40, 64, 256)]  # fmt: skip
    for seed, (m, n, k) in enumerate(shapes):
        _check_fp8(seed, m, n, k, dtype)


@pytest.mark.gpu
def test_fragment_sums_repeat_bitwise_after_split_k():
    packed, size = _case(3, 8192, 2048, 128, "gptq", torch.float16, "cuda")
    x = torch.randn(4, 8192, device="cuda", dtype=torch.bfloat16)
    first = w4a16_linear_kernel(x, packed, group_size=size, route="w4a16_frag")
    frag = stage_fragment_words(stage_decode_words(unpack_gptq(packed).codes))
    tokens, row_scale = fp8_pack(x)
    args = (tokens, row_scale, frag, packed.scales, None, torch.bfloat16)
    first8 = fp8_linear_prepacked(*args, route="fragment")
    for _ in range(3):  # the split-K counters were reset; arrival order does not matter
        assert_bitwise_equal(w4a16_linear_kernel(x, packed, group_size=size, route="w4a16_frag"),
                             first)  # fmt: skip
        assert_bitwise_equal(fp8_linear_prepacked(*args, route="fragment"), first8)


@pytest.mark.gpu
@pytest.mark.parametrize("chunk", [2, 8, 16])
def test_split_k_sum_with_loads_in_flight_is_the_same_sum(chunk):
    # splits of 5, 12 and 3 (K / 128 over one tile of columns): chunks with a ragged tail,
    # against one load at a time
    tuned, one = FragTuning(reduce_chunk=chunk), FragTuning(reduce_chunk=1)
    for seed, (m, n, k) in enumerate([(3, 64, 640), (1, 64, 1536), (8, 200, 384)]):
        packed, size = _case(seed, k, n, 128, "gptq", torch.float16, "cuda")
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        ops = gptq_decode_operands(packed, group_size=size, dtype=x.dtype)[0]
        frag = stage_fragment_words(ops.words)
        call = (x, frag, ops, None, k, n, size, x.device, True)
        assert_bitwise_equal(w4a16_frag_linear(*call, tuned), w4a16_frag_linear(*call, one),
                             msg=f"w4a16 {(m, n, k)} chunk {chunk}")  # fmt: skip
        words = stage_decode_words(unpack_gptq(packed).codes)
        tokens, row_scale = fp8_pack(x)
        args = (tokens, row_scale, stage_fragment_words(words), packed.scales, None, x.dtype)
        assert_bitwise_equal(w4a_fp8_frag_gemm(*args, tuned), w4a_fp8_frag_gemm(*args, one),
                             msg=f"w4a-fp8 {(m, n, k)} chunk {chunk}")  # fmt: skip


@pytest.mark.gpu
def test_modules_take_the_fragment_words_for_the_fewest_rows():
    from floatxq.gptq.solve import GPTQSolveOptions, rtn_quantize

    w = torch.randn(256, 512)
    sol = rtn_quantize(w, GPTQSolveOptions(bits=4, group_size=128, sym=True))
    layer = fq.GPTQLinear.from_solution(sol, bits=4, group_size=128).cuda().post_init()
    w4a = fq.W4AFP8Linear.from_gptq_linear(layer)
    assert w4a._weight_frag is not None
    for dtype in (torch.bfloat16, torch.float16):
        reference = layer.dequantize_weight(dtype)
        for m, route in ((1, "w4a16_frag"), (8, "w4a16_frag"), (9, "w4a16_words")):
            x = torch.randn(m, 512, device="cuda", dtype=dtype)
            out = layer(x)
            assert layer.last_route == route, (m, layer.last_route, layer.last_reason)
            assert_within_bound(out, w4a16_linear_error_bound(x, reference, None))
            t = fq.fp8_token_quantize(x)
            bound = w4a_fp8_linear_error_bound(
                t.codes, t.scale[:, 0], w4a._weight_dwords, w4a.scales, None, output_dtype=dtype,
                accumulation=FP32_ACCUMULATION,
            )  # fmt: skip
            assert_within_bound(w4a(x), bound)
    # one copy of the decode words serves both dtypes; the fragment words are staged once
    cache = layer.__dict__["_decode"]
    assert cache[torch.bfloat16][0].words is cache[torch.float16][0].words
    assert cache["frag"][0] is cache[torch.float16][0].words
