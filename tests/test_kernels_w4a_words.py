"""The decode-words kernels (``floatxq.kernels._w4a_words_jit``): W4A16 and W4A-FP8 at
decode-sized row counts, against the pure references.

* W4A16 (``route="w4a16_words"``): the decode is exact — with ``x`` the identity the kernel
  returns :func:`floatxq.dequantize_gptq`'s weight bit for bit — and every product lies within
  the FP32 accumulation bound of :func:`floatxq.w4a16_linear` (which fails on one wrong code:
  ``tests/test_kernels_w4a.py``). Groups of 32, 64, 128, 256 and one group; both zero-point
  conventions; ragged ``in`` (padded tiles) and ``out``; 0 to 65 rows; float16, bfloat16 and
  float32 scales for both activation dtypes (float32 scales with no exact split are refused).
* W4A-FP8 (int16 decode words as the weight): within the FP32 bound of
  :func:`floatxq.w4a_fp8_linear_prepacked`, which reads the same words.
* Split-K sums repeat bit for bit.

``interpreted`` tests run in a child process under ``TRITON_INTERPRET=1`` on float16 (the
interpreter runs the FP32 decode; the packed 16-bit decode runs on the GPU tests).
"""

import pytest
import torch

import floatxq as fq
from floatxq.dispatch import gptq_route, w4a16_route, w4a_fp8_operand
from floatxq.gptq.decode_words import gptq_decode_operands, split_scales, stage_decode_words
from floatxq.gptq.int4 import dequantize_gptq, pack_gptq, unpack_gptq
from floatxq.kernels.w4a16 import w4a16_linear_kernel
from floatxq.kernels.w4a_fp8 import fp8_linear_prepacked, fp8_pack
from floatxq.testing import (
    FP32_ACCUMULATION,
    assert_bitwise_equal,
    assert_within_bound,
    w4a16_linear_error_bound,
    w4a_fp8_linear_error_bound,
)
from floatxq.testing.interpreter import (
    INTERPRETING,
    can_interpret,
    needs_interpreter,
    run_interpreted_tests,
)

# (k, n, group_size, format, scales dtype): tiles of one group, of several groups, groups
# spanning tiles, one group over a ragged k, ragged k and n
CASES = [
    (256, 64, 128, "gptq", torch.float16),
    (384, 96, 64, "gptq_v2", torch.float16),
    (256, 40, 32, "gptq", torch.bfloat16),
    (512, 64, 256, "gptq_v2", torch.float16),
    (200, 48, -1, "gptq", torch.float16),
    (224, 32, 32, "gptq_v2", torch.bfloat16),
]


def _case(seed, k, n, group_size, fmt, scales_dtype, device):
    g = torch.Generator().manual_seed(seed)
    size = k if group_size == -1 else group_size
    groups = -(-k // size)
    codes = torch.randint(0, 16, (k, n), generator=g)
    zeros = torch.randint(1 if fmt == "gptq" else 0, 16, (groups, n), generator=g)
    scales = torch.rand(groups, n, generator=g) * 0.02 + 0.001
    g_idx = (torch.arange(k) // size).to(torch.int32)
    packed = pack_gptq(codes, zeros, scales, g_idx, format=fmt)
    packed = packed._replace(scales=packed.scales.to(scales_dtype))
    return type(packed)(*(t.to(device) for t in packed)), size


def _check_w4a16(seed, case, m, dtype, device):
    k, n, group_size, fmt, scales_dtype = case
    packed, size = _case(seed, k, n, group_size, fmt, scales_dtype, device)
    reference = dequantize_gptq(packed, format=fmt, dtype=dtype)
    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(m, k, generator=g).to(dtype).to(device)
    bias = torch.randn(n, generator=g).to(dtype).to(device) if seed % 2 else None
    out = w4a16_linear_kernel(x, packed, bias, format=fmt, group_size=size, route="w4a16_words")
    assert out.dtype == dtype and out.shape == (m, n)
    bound = w4a16_linear_error_bound(x, reference, bias)
    assert_within_bound(out, bound, msg=f"words {case} m={m} {dtype}")
    # the decode itself, bit for bit: the identity's rows pick single weights
    eye = torch.eye(k, dtype=dtype, device=device)
    picked = w4a16_linear_kernel(eye, packed, format=fmt, group_size=size, route="w4a16_words")
    assert_bitwise_equal(picked, reference.T.contiguous(), msg=f"decode {case} {dtype}")


def _check_fp8(seed, m, n, k, dtype, device):
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (k, n), generator=g)
    scales = (torch.rand(k // 128, n, generator=g) * 0.02 + 0.001).to(torch.float16).to(device)
    words = stage_decode_words(codes).to(device)
    x = (torch.randn(m, k, generator=g) * 4).to(dtype).to(device)
    bias = torch.randn(n, generator=g).to(dtype).to(device) if seed % 2 else None
    tokens, row_scale = fp8_pack(x)
    out = fp8_linear_prepacked(tokens, row_scale, words, scales, bias, dtype, route="triton")
    assert out.dtype == dtype and out.shape == (m, n)
    t = fq.fp8_token_quantize(x)
    bound = w4a_fp8_linear_error_bound(
        t.codes, t.scale[:, 0], words, scales, bias, output_dtype=dtype,
        accumulation=FP32_ACCUMULATION,
    )  # fmt: skip
    assert_within_bound(out, bound, msg=f"fp8 decode words {(m, n, k)} {dtype}")
    pure = fq.w4a_fp8_linear_prepacked(t.codes, t.scale[:, 0], words, scales, bias,
                                       output_dtype=dtype)  # fmt: skip
    assert_within_bound(pure, bound, msg="the pure reference reads the same words")


# ----------------------------------------------------------------------------------------------
# CPU: choices and refusals
# ----------------------------------------------------------------------------------------------


def test_routes_take_the_decode_words_only_where_held_and_for_few_rows():
    assert w4a16_route(1) == "w4a16_fused"
    assert w4a16_route(32, decode_words=True) == "w4a16_words"
    assert w4a16_route(33, decode_words=True) == "w4a16_fused"
    assert w4a_fp8_operand(32, decode_words=True) == "decode_words"
    assert w4a_fp8_operand(33, decode_words=True) == "words"
    route, why = gptq_route(torch.device("cpu"), torch.bfloat16, 1, decode_words=True)
    assert route == "dequant_matmul" and "CUDA" in why


def _float32_scales(packed):
    """The same weight with scales of full float32 precision (no exact split in a half)."""
    return packed._replace(scales=torch.rand(packed.scales.shape) * 0.02 + 0.001)


def test_decode_operands_say_why_not():
    packed, size = _case(0, 256, 32, 128, "gptq", torch.float32, "cpu")
    packed = _float32_scales(packed)
    ops, why = gptq_decode_operands(packed, format="gptq", group_size=size, dtype=torch.float16)
    assert ops is None and "do not split exactly" in why
    packed, _ = _case(0, 256, 32, 128, "gptq", torch.float16, "cpu")
    ops, why = gptq_decode_operands(packed, format="gptq", group_size=48, dtype=torch.float16)
    assert ops is None and "multiple of 32" in why
    ops, why = gptq_decode_operands(packed, format="gptq", group_size=128, dtype=torch.bfloat16)
    assert why is None and ops.words.dtype == torch.int16 and ops.hi.dtype == torch.bfloat16
    assert torch.equal(ops.zeros, unpack_gptq(packed, format="gptq").zeros)
    # bfloat16 scales split trivially for bfloat16; float16 ones outside its range do not
    big = torch.full((1, 2), 2.0**20, dtype=torch.bfloat16)
    assert split_scales(big, torch.float16) is None
    assert torch.equal(split_scales(big, torch.bfloat16).lo, torch.zeros_like(big))


def test_gptq_linear_says_why_no_decode_words():
    from floatxq.gptq.solve import GPTQSolveOptions, rtn_quantize

    sol = rtn_quantize(torch.randn(32, 128), GPTQSolveOptions(bits=8, group_size=128))
    layer = fq.GPTQLinear.from_solution(sol, bits=8, group_size=128)
    assert layer.decode_operands(torch.float16) == (
        None,
        "bits=8; the decode words hold 4-bit codes",
    )
    sol = rtn_quantize(torch.randn(32, 128), GPTQSolveOptions(bits=4, group_size=32))
    layer = fq.GPTQLinear.from_solution(sol, bits=4, group_size=32)
    ops, why = layer.decode_operands(torch.bfloat16)
    assert why is None and ops.words.shape == (32, 32)


@needs_interpreter
def test_interpreted_words_route_refuses_what_it_cannot_read():
    packed = _float32_scales(_case(0, 256, 32, 128, "gptq", torch.float32, "cpu")[0])
    x = torch.randn(1, 256).half()
    with pytest.raises(ValueError, match="'w4a16_words' cannot run: the torch.float32 scales"):
        w4a16_linear_kernel(x, packed, group_size=128, route="w4a16_words")


# ----------------------------------------------------------------------------------------------
# The interpreter (CPU, float16)
# ----------------------------------------------------------------------------------------------


@pytest.mark.skipif(
    not can_interpret(),
    reason="needs Triton installed and no CUDA device (with CUDA the compiled kernel is tested)",
)
def test_interpreter_suite():
    run_interpreted_tests(__file__, expected=4)


@needs_interpreter
def test_interpreted_w4a16_words():
    for seed, case in enumerate(CASES):
        for m in (0, 1, 3) if seed % 2 else (2, 17):
            _check_w4a16(seed, case, m, torch.float16, "cpu")


if INTERPRETING:  # (the interpreter resolves a kernel's names in its module)
    import triton
    import triton.language as tl

    from floatxq.kernels._fp8_small_m_jit import sum_partials

    @triton.jit
    def _summed(part_ptr, out_ptr, MN, SPLIT: tl.constexpr, BLOCK: tl.constexpr):
        offs = tl.arange(0, BLOCK)
        ok = offs < MN
        acc = sum_partials(tl.zeros([BLOCK], dtype=tl.float32), part_ptr, offs, ok, MN, SPLIT)
        tl.store(out_ptr + offs, acc, mask=ok)


@needs_interpreter
def test_interpreted_split_k_sum_is_in_split_order():
    # the last split's sum (every Triton split-K kernel's): loads in flight, chunks with a
    # ragged tail, the same bits as adding one partial at a time in split order
    g = torch.Generator().manual_seed(0)
    for split in (1, 3, 8, 12, 17):
        parts = torch.randn(split, 50, generator=g) * torch.logspace(-6, 6, 50)
        parts[:, :3] = -0.0  # (signed zeros stay as one-at-a-time addition leaves them)
        out = torch.empty(50)
        _summed[(1,)](parts, out, 50, SPLIT=split, BLOCK=64)
        expected = torch.zeros(50)
        for s in range(split):
            expected = expected + parts[s]
        assert_bitwise_equal(out, expected, msg=f"split {split}")


@needs_interpreter
def test_interpreted_w4a_fp8_decode_words():
    for seed, (m, n, k) in enumerate([(1, 64, 128), (3, 40, 384), (0, 32, 128), (20, 64, 256)]):
        _check_fp8(seed, m, n, k, torch.float16, "cpu")


# ----------------------------------------------------------------------------------------------
# GPU: the compiled kernels (packed 16-bit decode)
# ----------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_w4a16_words_within_the_bound_and_exact_decode(dtype):
    for seed, case in enumerate(CASES):
        for m in (0, 1, 7, 16, 32, 65):
            _check_w4a16(seed, case, m, dtype, "cuda")
    case = (8192, 1024, 128, "gptq", torch.float16)  # split K over many programs
    for m in (1, 16):
        _check_w4a16(20, case, m, dtype, "cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_w4a_fp8_decode_words_within_the_bound(dtype):
    shapes = [(0, 96, 128), (1, 96, 128), (7, 160, 384), (16, 256, 4096), (17, 1024, 8192),
              (32, 4096, 8192), (1, 4096, 8192)]  # fmt: skip
    for seed, (m, n, k) in enumerate(shapes):
        _check_fp8(seed, m, n, k, dtype, "cuda")


@pytest.mark.gpu
def test_decode_words_repeat_bitwise_after_split_k():
    packed, size = _case(3, 8192, 2048, 128, "gptq", torch.float16, "cuda")
    x = torch.randn(4, 8192, device="cuda", dtype=torch.bfloat16)
    first = w4a16_linear_kernel(x, packed, group_size=size, route="w4a16_words")
    words = stage_decode_words(unpack_gptq(packed).codes)
    tokens, row_scale = fp8_pack(x)
    first8 = fp8_linear_prepacked(tokens, row_scale, words, packed.scales, None, torch.bfloat16)
    for _ in range(3):  # the split-K counters were reset; arrival order does not matter
        again = w4a16_linear_kernel(x, packed, group_size=size, route="w4a16_words")
        assert_bitwise_equal(again, first)
        again8 = fp8_linear_prepacked(tokens, row_scale, words, packed.scales, None, torch.bfloat16)
        assert_bitwise_equal(again8, first8)


@pytest.mark.gpu
def test_modules_take_the_decode_words_on_cuda():
    from floatxq.gptq.solve import GPTQSolveOptions, rtn_quantize

    w = torch.randn(256, 512)
    sol = rtn_quantize(w, GPTQSolveOptions(bits=4, group_size=128, sym=True))
    layer = fq.GPTQLinear.from_solution(sol, bits=4, group_size=128).cuda().post_init()
    w4a = fq.W4AFP8Linear.from_gptq_linear(layer)
    for dtype in (torch.bfloat16, torch.float16):
        reference = layer.dequantize_weight(dtype)
        x = torch.randn(16, 512, device="cuda", dtype=dtype)  # (8 or fewer: the fragment words)
        out = layer(x)
        assert layer.last_route == "w4a16_words", layer.last_reason
        assert_within_bound(out, w4a16_linear_error_bound(x, reference, None))
        assert w4a._weight_dwords is not None
        t = fq.fp8_token_quantize(x)
        bound = w4a_fp8_linear_error_bound(
            t.codes, t.scale[:, 0], w4a._weight_dwords, w4a.scales, None, output_dtype=dtype,
            accumulation=FP32_ACCUMULATION,
        )  # fmt: skip
        assert_within_bound(w4a(x), bound)


def test_gptq_linear_keeps_one_route_decision_per_row_class(monkeypatch):
    from floatxq.gptq.solve import GPTQSolveOptions, rtn_quantize
    from floatxq.nn import gptq_linear as module

    sol = rtn_quantize(torch.randn(32, 128), GPTQSolveOptions(bits=4, group_size=128))
    layer = fq.GPTQLinear.from_solution(sol, bits=4, group_size=128)
    x = torch.randn(3, 128, dtype=torch.bfloat16)
    first = layer(x)
    asked = []
    real = module.gptq_route

    def counting(*args, **kwargs):
        asked.append(args)
        return real(*args, **kwargs)

    monkeypatch.setattr(module, "gptq_route", counting)
    assert torch.equal(layer(x), first) and layer(x[:2]) is not None  # 3 kept; 2 decided
    assert len(asked) == 1 and asked[0][2] == 2
    for rebuild in (layer.post_init, lambda: layer.load_state_dict(layer.state_dict()),
                    lambda: layer.to(torch.device("cpu"), torch.float16)):  # fmt: skip
        asked.clear()
        rebuild()
        layer(x)
        assert [a[2] for a in asked] == [3], "decided again after the rebuild"
        layer(x)
        assert len(asked) == 1  # and kept again
