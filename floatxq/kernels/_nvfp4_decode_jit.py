"""Triton sources of the NVFP4 decode kernels and the W4A-NVFP4 group accumulation.

Imported by :mod:`floatxq.kernels.nvfp4_decoding` on the first launch, never at ``import
floatxq`` (this module imports Triton); :data:`INTERPRETED` records whether ``triton.jit`` chose
the interpreter. ``@no_type_check`` keeps the test run's jaxtyping hook off the functions
(Triton must see the plain function).

Both formats are decoded from their bits with integer arithmetic (no FP8 or FP4 conversion
instruction), so the values are exact on every GPU and in the interpreter.
"""

from typing import no_type_check

import triton
import triton.language as tl
from triton import knobs

__all__ = ["INTERPRETED", "nvfp4_accumulate_kernel", "nvfp4_decode_kernel"]

INTERPRETED: bool = bool(knobs.runtime.interpret)
"""Whether the functions below were jitted for the interpreter (``TRITON_INTERPRET=1``)."""


@triton.jit
@no_type_check
def e2m1_value(code):
    """The FP32 value of 4-bit E2M1 codes (int32 ``sign << 3 | index``), built from its bits:
    index ``e << 1 | m`` is ``m · 0.5`` for ``e = 0`` and ``(1 + m/2) · 2^(e-1)`` otherwise;
    code 8 is ``-0.0``."""
    index = code & 7
    e = index >> 1
    m = index & 1
    magnitude = tl.where(e == 0, m * (126 << 23), ((126 + e) << 23) | (m << 22))
    sign = (code >> 3) << 31
    return (magnitude | sign).to(tl.float32, bitcast=True)


@triton.jit
@no_type_check
def e4m3_value(byte):
    """The FP32 value of ``float8_e4m3fn`` bytes (int32 ``0..255``): ``(8 + m) · 2^(e-10)`` for
    ``e > 0``, ``m · 2^-9`` for ``e = 0``, NaN for ``e = 15, m = 7``; the sign bit is kept (so
    ``0x80`` is ``-0.0`` and a negative byte a negative value)."""
    e = (byte >> 3) & 15
    m = byte & 7
    normal = ((e + 120) << 23) | (m << 20)
    subnormal = (m.to(tl.float32) * 0.001953125).to(tl.int32, bitcast=True)  # m · 2^-9, exact
    magnitude = tl.where(e == 0, subnormal, normal)
    magnitude = tl.where((e == 15) & (m == 7), 0x7FC00000, magnitude)
    sign = (byte >> 7) << 31
    return (magnitude | sign).to(tl.float32, bitcast=True)


@triton.jit
@no_type_check
def nvfp4_decode_kernel(
    codes_ptr,
    scales_ptr,
    gs_ptr,
    gs_value,
    out_ptr,
    R,
    K,
    stride_cr,
    stride_ck,
    stride_s0,
    stride_s1,
    stride_or,
    LIMIT: tl.constexpr,
    SWIZZLED: tl.constexpr,
    GS_TENSOR: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """Rows ``[pid0·BLOCK_R, +BLOCK_R)``, columns ``[pid1·BLOCK_K, +BLOCK_K)`` of a decoded NVFP4
    tensor: ``clamp((e2m1(code) · block_scale) · global_scale, ±LIMIT)`` rounded once to
    ``out_ptr``'s dtype (contiguous rows of ``stride_or``).

    ``codes_ptr``: bytes, element ``2j`` in the low nibble of byte ``j``. ``scales_ptr``: E4M3
    bytes, either row-major ``(R, K/16)`` (``SWIZZLED`` false; strides ``stride_s0``,
    ``stride_s1``) or, per 128-wide group ``g`` at ``g · stride_s0``, the ``SWIZZLE_32_4_4``
    layout: row ``r``, block ``b`` at ``((r//128)·1024 + (b//4)·512 + (r%32)·16 +
    ((r%128)//32)·4 + b%4) · stride_s1``. The global scale is read from ``gs_ptr``
    (``GS_TENSOR``) or is the scalar ``gs_value``. The code-scale product is exact; NaN stays
    NaN through the clamp (no comparison holds for it).
    """
    pid_r = tl.program_id(0)
    pid_k = tl.program_id(1)
    rows = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    ok = (rows < R)[:, None] & (cols < K)[None, :]
    r64 = rows.to(tl.int64)[:, None]
    c64 = cols.to(tl.int64)[None, :]
    byte = tl.load(codes_ptr + r64 * stride_cr + (c64 // 2) * stride_ck, mask=ok, other=0)
    code = (byte.to(tl.int32) >> ((cols % 2) * 4)[None, :]) & 15
    block = c64 // 16
    if SWIZZLED:
        b = block % 8
        inner = (
            (r64 // 128) * 1024 + (b // 4) * 512 + (r64 % 32) * 16 + ((r64 % 128) // 32) * 4 + b % 4
        )
        s_off = (c64 // 128) * stride_s0 + inner * stride_s1
    else:
        s_off = r64 * stride_s0 + block * stride_s1
    scale = e4m3_value(tl.load(scales_ptr + s_off, mask=ok, other=0).to(tl.int32))
    if GS_TENSOR:
        g = tl.load(gs_ptr).to(tl.float32)
    else:
        g = tl.cast(gs_value, tl.float32)
    y = (e2m1_value(code) * scale) * g
    y = tl.where(y > LIMIT, LIMIT, y)
    y = tl.where(y < -LIMIT, -LIMIT, y)
    tl.store(out_ptr + r64 * stride_or + c64, y.to(out_ptr.dtype.element_ty), mask=ok)


@triton.jit
@no_type_check
def nvfp4_accumulate_kernel(
    both_ptr,
    group_scale_ptr,
    acc_ptr,
    gs_ptr,
    gs_value,
    token_scale_ptr,
    bias_ptr,
    out_ptr,
    M,
    N,
    stride_bm,
    stride_bn,
    stride_am,
    stride_an,
    stride_gs,
    stride_ts,
    stride_bias,
    stride_om,
    HAS_ACC: tl.constexpr,
    LAST: tl.constexpr,
    GS_TENSOR: tl.constexpr,
    HAS_TOKEN_SCALE: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """One ``(BLOCK_M, BLOCK_N)`` tile of :func:`floatxq.w4a_nvfp4_accumulate_group`:
    ``t = (acc or +0) + (low + 4·high) · float32(group_scale)``, then when ``LAST``: ``t · g``,
    ``· token_scale[row]``, ``+ float32(bias)``, one rounding to ``out_ptr``'s dtype.

    Launched with ``enable_fp_fusion=False``: each product and sum is rounded on its own (a
    fused multiply-add would round ``x · s + acc`` once and break the equality with the
    reference).
    """
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    r_ok = rows < M
    c_ok = cols < N
    ok = r_ok[:, None] & c_ok[None, :]
    r64 = rows.to(tl.int64)[:, None]
    c64 = cols.to(tl.int64)[None, :]
    low = tl.load(both_ptr + r64 * stride_bm + c64 * stride_bn, mask=ok, other=0.0)
    high = tl.load(both_ptr + r64 * stride_bm + (c64 + N) * stride_bn, mask=ok, other=0.0)
    s = tl.load(group_scale_ptr + cols * stride_gs, mask=c_ok, other=0.0).to(tl.float32)
    part = (low + high * 4.0) * s[None, :]
    if HAS_ACC:
        start = tl.load(acc_ptr + r64 * stride_am + c64 * stride_an, mask=ok, other=0.0)
    else:
        start = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    t = start + part  # (+0 + -0 is +0, as the reference's first group gives)
    if LAST:
        if GS_TENSOR:
            g = tl.load(gs_ptr).to(tl.float32)
        else:
            g = tl.cast(gs_value, tl.float32)
        t = t * g
        if HAS_TOKEN_SCALE:
            ts = tl.load(token_scale_ptr + rows * stride_ts, mask=r_ok, other=1.0)
            t = t * ts[:, None]
        if HAS_BIAS:
            bias = tl.load(bias_ptr + cols * stride_bias, mask=c_ok, other=0.0).to(tl.float32)
            t = t + bias[None, :]
    tl.store(out_ptr + r64 * stride_om + c64, t.to(out_ptr.dtype.element_ty), mask=ok)
