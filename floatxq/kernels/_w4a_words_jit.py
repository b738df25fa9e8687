"""Triton sources of the decode-words kernels: W4A16 and W4A-FP8 at decode-sized row counts.

Both read the int16 decode words of :mod:`floatxq.gptq.decode_words`: a tile of 128 input rows
is 32 word rows, and nibble ``j`` of the tile is the ``(32, BLOCK_N)`` operand of the input slice
``[128·t + 32·j, +32)``, multiplied by the matching 32 columns of the activations on the tensor
cores (no reshapes). On the GPU each pair of words in a 32-bit register decodes with packed
16-bit instructions (a magic-number OR puts the code in a half's mantissa, a subtract removes
the bias and the zero point exactly); under the interpreter (``ASM`` off) the same values come
from plain FP32 arithmetic. Imported on the first launch, never at ``import floatxq``.
``@no_type_check`` keeps the test run's jaxtyping hook off the functions.
"""

from typing import no_type_check

import triton
import triton.language as tl
from triton import knobs
from triton.language.extra.cuda import gdc_wait

from floatxq.kernels._w4a_jit import split_k_reduce

__all__ = ["INTERPRETED", "w4a16_words_kernel", "w4a_fp8_words_kernel"]

INTERPRETED: bool = bool(knobs.runtime.interpret)
"""Whether the functions below were jitted for the interpreter (``TRITON_INTERPRET=1``)."""

# {shift}: the nibble's bit offset; the mask keeps one nibble of each 16-bit half and the OR
# sets the half's exponent so it reads MAGIC + code (bf16: 128 + code, fp16: 1024 + code).
_BF16_W4A16 = (
    "{{ .reg .b32 t, d, p; shr.b32 t, $1, {shift}; "
    "lop3.b32 t, t, 0x000F000F, 0x43004300, 0xEA; sub.rn.bf16x2 d, t, $2; "
    "mul.rn.bf16x2 p, d, $4; fma.rn.bf16x2 $0, d, $3, p; }}"
)
_FP16_W4A16 = (
    "{{ .reg .b32 t, d, p; shr.b32 t, $1, {shift}; "
    "lop3.b32 t, t, 0x000F000F, 0x64006400, 0xEA; sub.rn.f16x2 d, t, $2; "
    "mul.rn.f16x2 p, d, $4; fma.rn.f16x2 $0, d, $3, p; }}"
)
_FP16_CENTERED = (
    "{{ .reg .b32 t, c; shr.b32 t, $1, {shift}; "
    "lop3.b32 t, t, 0x000F000F, 0x64006400, 0xEA; mov.b32 c, 0x64086408; "
    "sub.rn.f16x2 $0, t, c; }}"
)
BF16_0 = tl.constexpr(_BF16_W4A16.format(shift=0))
BF16_1 = tl.constexpr(_BF16_W4A16.format(shift=4))
BF16_2 = tl.constexpr(_BF16_W4A16.format(shift=8))
BF16_3 = tl.constexpr(_BF16_W4A16.format(shift=12))
FP16_0 = tl.constexpr(_FP16_W4A16.format(shift=0))
FP16_1 = tl.constexpr(_FP16_W4A16.format(shift=4))
FP16_2 = tl.constexpr(_FP16_W4A16.format(shift=8))
FP16_3 = tl.constexpr(_FP16_W4A16.format(shift=12))
CENTERED_0 = tl.constexpr(_FP16_CENTERED.format(shift=0))
CENTERED_1 = tl.constexpr(_FP16_CENTERED.format(shift=4))
CENTERED_2 = tl.constexpr(_FP16_CENTERED.format(shift=8))
CENTERED_3 = tl.constexpr(_FP16_CENTERED.format(shift=12))


@triton.jit
@no_type_check
def _bf16x2(asm: tl.constexpr, words, zz, hh, ll):
    return tl.inline_asm_elementwise(asm, "=r,r,r,r,r", [words, zz, hh, ll], dtype=tl.bfloat16,
                                     is_pure=True, pack=2)  # fmt: skip


@triton.jit
@no_type_check
def _f16x2(asm: tl.constexpr, words, zz, hh, ll):
    return tl.inline_asm_elementwise(asm, "=r,r,r,r,r", [words, zz, hh, ll], dtype=tl.float16,
                                     is_pure=True, pack=2)  # fmt: skip


@triton.jit
@no_type_check
def packed_slice(words, zc, hi, lo, J: tl.constexpr, DT: tl.constexpr):
    """Slice ``J`` of a words tile decoded two weights per instruction: ``d = (MAGIC + code) -
    (MAGIC + zero)`` (exact), ``fma(d, hi, d · lo)`` (the exact product rounded once)."""
    zz = tl.broadcast_to(zc[None, :], words.shape)
    hh = tl.broadcast_to(hi[None, :], words.shape)
    ll = tl.broadcast_to(lo[None, :], words.shape)
    if DT == tl.bfloat16:
        if J == 0:
            w = _bf16x2(BF16_0, words, zz, hh, ll)
        elif J == 1:
            w = _bf16x2(BF16_1, words, zz, hh, ll)
        elif J == 2:
            w = _bf16x2(BF16_2, words, zz, hh, ll)
        else:
            w = _bf16x2(BF16_3, words, zz, hh, ll)
    else:
        if J == 0:
            w = _f16x2(FP16_0, words, zz, hh, ll)
        elif J == 1:
            w = _f16x2(FP16_1, words, zz, hh, ll)
        elif J == 2:
            w = _f16x2(FP16_2, words, zz, hh, ll)
        else:
            w = _f16x2(FP16_3, words, zz, hh, ll)
    return w


@triton.jit
@no_type_check
def plain_slice(words, zero, scale, J: tl.constexpr, DT: tl.constexpr):
    """Slice ``J`` decoded in FP32 (the interpreter): ``float32(scale) · (code - zero)``
    rounded once to ``DT``, the values :func:`packed_slice` makes."""
    d = (((words.to(tl.int32) >> (4 * J)) & 15) - zero[None, :]).to(tl.float32)
    return (d * scale[None, :]).to(DT)


@triton.jit
@no_type_check
def centered_slice(words, J: tl.constexpr, ASM: tl.constexpr):
    """Slice ``J`` of a words tile as ``code - 8`` in float16 (exact)."""
    if ASM:
        if J == 0:
            asm: tl.constexpr = CENTERED_0
        elif J == 1:
            asm: tl.constexpr = CENTERED_1
        elif J == 2:
            asm: tl.constexpr = CENTERED_2
        else:
            asm: tl.constexpr = CENTERED_3
        w = tl.inline_asm_elementwise(asm, "=r,r", [words], dtype=tl.float16, is_pure=True,
                                      pack=2)  # fmt: skip
    else:
        w = (((words.to(tl.int32) >> (4 * J)) & 15) - 8).to(tl.float16)
    return w


@triton.jit
@no_type_check
def w4a16_words_kernel(
    x_ptr,
    w_ptr,
    z_ptr,
    hi_ptr,
    lo_ptr,
    s_ptr,
    b_ptr,
    out_ptr,
    part_ptr,
    count_ptr,
    M,
    N,
    K,
    GROUPS,
    stride_xm,
    stride_xk,
    stride_om,
    GROUP: tl.constexpr,
    PER_TILE: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    ASM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    K_ITERS: tl.constexpr,
    SPLIT: tl.constexpr,
):
    """``out[m-tile, n-tile]`` of :func:`floatxq.w4a16_linear` from decode words: per 128-row
    tile, four products of 32 input rows (zero points and scale parts once per tile when every
    group spans whole tiles, ``PER_TILE``, else per 32-row slice), FP32 accumulation, K split
    over ``program_id(1)`` and reduced in split order, the bias (in ``x``'s dtype) added in
    FP32, one rounding.
    ``s_ptr``: the scales as stored (the interpreter's FP32 decode)."""
    DT: tl.constexpr = x_ptr.dtype.element_ty
    MAGIC: tl.constexpr = 128.0 if DT == tl.bfloat16 else 1024.0
    pid = tl.program_id(0)
    pid_k = tl.program_id(1)
    tiles_n = tl.cdiv(N, BLOCK_N)
    pid_m = pid // tiles_n
    pid_n = pid % tiles_n
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rr = tl.arange(0, 32)
    m_ok = offs_m < M
    n_ok = offs_n < N
    x_rows = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for it in range(K_ITERS):
        t = pid_k * K_ITERS + it
        words = tl.load(w_ptr + (t * 32 + rr).to(tl.int64)[:, None] * N + offs_n[None, :],
                        mask=n_ok[None, :], other=0)  # fmt: skip
        for j in tl.static_range(4):
            k0 = t * 128 + j * 32
            if j == 0 or not PER_TILE:  # this slice's group (past the last row: the last one)
                g = tl.minimum(k0 // GROUP, GROUPS - 1).to(tl.int64)
                zero = tl.load(z_ptr + g * N + offs_n, mask=n_ok, other=0).to(tl.int32)
                if ASM:
                    zc = (zero.to(tl.float32) + MAGIC).to(DT)
                    hi = tl.load(hi_ptr + g * N + offs_n, mask=n_ok, other=0.0)
                    lo = tl.load(lo_ptr + g * N + offs_n, mask=n_ok, other=0.0)
                else:
                    scale = tl.load(s_ptr + g * N + offs_n, mask=n_ok, other=0.0)
                    scale = scale.to(tl.float32)
            if ASM:
                w = packed_slice(words, zc, hi, lo, j, DT)
            else:
                w = plain_slice(words, zero, scale, j, DT)
            kk = k0 + rr
            a = tl.load(x_rows + kk.to(tl.int64)[None, :] * stride_xk,
                        mask=m_ok[:, None] & (kk < K)[None, :], other=0.0)  # fmt: skip
            acc = tl.dot(a, w, acc)
    last = True
    if SPLIT > 1:
        tile = pid_m * tiles_n + pid_n
        acc, last = split_k_reduce(
            acc, part_ptr, count_ptr, tile, pid_k, offs_m, offs_n, M, N, SPLIT, BLOCK_M, BLOCK_N
        )
    if last:
        if HAS_BIAS:  # (the bias in x's dtype, as the reference adds it)
            bias = tl.load(b_ptr + offs_n, mask=n_ok, other=0.0).to(DT)
            acc += bias.to(tl.float32)[None, :]
        o_ptrs = out_ptr + offs_m.to(tl.int64)[:, None] * stride_om + offs_n[None, :]
        tl.store(o_ptrs, acc.to(DT), mask=m_ok[:, None] & n_ok[None, :])


@triton.jit
@no_type_check
def w4a_fp8_words_kernel(
    a_ptr,
    rs_ptr,
    w_ptr,
    s_ptr,
    b_ptr,
    out_ptr,
    part_ptr,
    count_ptr,
    M,
    N,
    K,
    stride_am,
    stride_sg,
    stride_sn,
    stride_om,
    HAS_BIAS: tl.constexpr,
    ASM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    K_ITERS: tl.constexpr,
    SPLIT: tl.constexpr,
    WAIT: tl.constexpr = False,
):
    """``out[m-tile, n-tile]`` of :func:`floatxq.w4a_fp8_linear_prepacked` from decode words:
    each 128-row group is one tile, four products of 32 rows of E4M3 codes (converted to float16
    exactly) and ``code - 8`` (float16, exact) with a fresh FP32 accumulator, then ``total +=
    partial · scales[g, n]`` in ascending groups (split over ``program_id(1)``, reduced in
    split order), the token scale, the bias, one rounding. ``WAIT`` (GPU only): launched
    dependent on the token packing, it reads nothing before that launch has finished."""
    if WAIT:
        gdc_wait()
    pid = tl.program_id(0)
    pid_k = tl.program_id(1)
    tiles_n = tl.cdiv(N, BLOCK_N)
    pid_m = pid // tiles_n
    pid_n = pid % tiles_n
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rr = tl.arange(0, 32)
    m_ok = offs_m < M
    n_ok = offs_n < N
    a_rows = a_ptr + offs_m.to(tl.int64)[:, None] * stride_am
    total = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for it in range(K_ITERS):
        g = pid_k * K_ITERS + it
        words = tl.load(w_ptr + (g * 32 + rr).to(tl.int64)[:, None] * N + offs_n[None, :],
                        mask=n_ok[None, :], other=0)  # fmt: skip
        partial = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for j in tl.static_range(4):
            w = centered_slice(words, j, ASM)
            kk = g * 128 + j * 32 + rr
            a = tl.load(a_rows + kk[None, :], mask=m_ok[:, None], other=0)
            a = a.to(tl.float8e4nv, bitcast=True).to(tl.float16)
            partial = tl.dot(a, w, partial)
        s = tl.load(s_ptr + g * stride_sg + offs_n * stride_sn, mask=n_ok, other=0.0)
        total += partial * s.to(tl.float32)[None, :]
    last = True
    if SPLIT > 1:
        tile = pid_m * tiles_n + pid_n
        total, last = split_k_reduce(
            total, part_ptr, count_ptr, tile, pid_k, offs_m, offs_n, M, N, SPLIT, BLOCK_M, BLOCK_N
        )
    if last:
        rs = tl.load(rs_ptr + offs_m, mask=m_ok, other=0.0)
        out = total * rs[:, None]
        if HAS_BIAS:
            out += tl.load(b_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        o_ptrs = out_ptr + offs_m.to(tl.int64)[:, None] * stride_om + offs_n[None, :]
        tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])
