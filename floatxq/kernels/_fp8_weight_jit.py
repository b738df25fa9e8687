"""Triton sources of the FP8 weight quantizer and the FP8 encoder every FP8 kernel shares.

Imported by :mod:`floatxq.kernels.fp8_weight` on the first launch, never at ``import floatxq``:
this module imports Triton. ``triton.jit`` picks the compiler or the interpreter when it
decorates (from ``TRITON_INTERPRET``), so the mode of this process's kernels is fixed by the
environment at that first launch (:data:`INTERPRETED`).

The functions carry ``@no_type_check`` so that the test run's jaxtyping import hook leaves them
alone: Triton must see the plain function (its source and this module's globals).
"""

from typing import no_type_check

import triton
import triton.language as tl
from triton import knobs

__all__ = ["INTERPRETED", "fp8_encode", "fp8_quantize_kernel"]

INTERPRETED: bool = bool(knobs.runtime.interpret)
"""Whether the functions below were jitted for the interpreter (``TRITON_INTERPRET=1``)."""


@triton.jit
@no_type_check
def fp8_encode(y, CONVERT: tl.constexpr, MANT: tl.constexpr, BIAS: tl.constexpr,
               FNUZ: tl.constexpr):  # fmt: skip
    """int8 FP8 codes of FP32 ``y`` (clamped to ±fp8_max, NaN kept) with one nearest-even step.

    CONVERT 0/1: the PTX ``cvt.rn.satfinite.{e4m3x2,e5m2x2}.f32`` instruction; 2: an integer
    encoder into (MANT, BIAS, FNUZ). Every FP8 kernel that writes codes calls this one, so their
    codes cannot drift apart.
    """
    if CONVERT == 0:
        code = tl.inline_asm_elementwise(
            "{ .reg .b16 lo, hi;\n"
            "cvt.rn.satfinite.e4m3x2.f32 lo, $2, $1;\n"
            "cvt.rn.satfinite.e4m3x2.f32 hi, $4, $3;\n"
            "mov.b32 $0, {lo, hi}; }",
            "=r,r,r,r,r",
            [y],
            dtype=tl.int8,
            is_pure=True,
            pack=4,
        )
    elif CONVERT == 1:
        code = tl.inline_asm_elementwise(
            "{ .reg .b16 lo, hi;\n"
            "cvt.rn.satfinite.e5m2x2.f32 lo, $2, $1;\n"
            "cvt.rn.satfinite.e5m2x2.f32 hi, $4, $3;\n"
            "mov.b32 $0, {lo, hi}; }",
            "=r,r,r,r,r",
            [y],
            dtype=tl.int8,
            is_pure=True,
            pack=4,
        )
    else:
        # Integer round-to-nearest-even into (MANT, BIAS); |y| <= FMAX, so no overflow.
        bits = y.to(tl.int32, bitcast=True)
        sign = (bits >> 31) & 1
        a = bits & 0x7FFFFFFF
        # normal range: round the FP32 mantissa to MANT bits, then re-bias
        kept = (a + ((1 << (22 - MANT)) - 1) + ((a >> (23 - MANT)) & 1)) >> (23 - MANT)
        normal = kept - ((127 - BIAS) << MANT)
        # subnormal range: the code is round(|y| / 2**(1 - BIAS - MANT))
        mant = (a & 0x7FFFFF) | 0x800000
        shift = tl.minimum(tl.maximum((151 - BIAS - MANT) - (a >> 23), 1), 25)
        sub = (mant + (1 << (shift - 1)) - 1 + ((mant >> shift) & 1)) >> shift
        mag = tl.where(a >= ((128 - BIAS) << 23), normal, sub)
        if FNUZ:
            code32 = tl.where(mag == 0, 0, mag | (sign << 7))
            code32 = tl.where(a > 0x7F800000, 0x80, code32)
        else:
            code32 = tl.where(a > 0x7F800000, 0x7F, mag) | (sign << 7)
        code = code32.to(tl.int8)
    return code


@triton.jit
@no_type_check
def fp8_quantize_kernel(
    w_ptr,
    q_ptr,
    s_ptr,
    aux_ptr,
    flag_ptr,
    rows,
    rows_valid,
    cols,
    stride_wr,
    stride_wc,
    stride_sr,
    stride_sc,
    region_rows,
    region_cols,
    n_groups,
    n_partials,
    n_iters,
    FMAX: tl.constexpr,
    FLT_MAX: tl.constexpr,
    TINY_BITS: tl.constexpr,
    MODE: tl.constexpr,
    PER_ROW: tl.constexpr,
    DIRECT: tl.constexpr,
    CHECK: tl.constexpr,
    CONVERT: tl.constexpr,
    MANT: tl.constexpr,
    BIAS: tl.constexpr,
    FNUZ: tl.constexpr,
    TILE_R: tl.constexpr,
    TILE_C: tl.constexpr,
    R_ITERS: tl.constexpr,
    C_ITERS: tl.constexpr,
    P_BLOCK: tl.constexpr,
):
    """One program quantizes whole scale regions (see :mod:`floatxq.kernels.fp8_weight`).

    PER_ROW: regions are ``(1, region_cols)``; the program takes TILE_R rows of column group
    ``pid % n_groups``; rows ``>= rows_valid`` read as zeros (padding: codes 0, scale 1).
    Otherwise the program takes region ``(pid // n_groups, pid % n_groups)`` of size
    ``(region_rows, region_cols)``. MODE 0 computes amax per region; MODE 1 (per-row tiles) only
    stores the amax (FP32) of row tiles ``pid + i * n_partials`` (``i < n_iters``) at
    ``aux_ptr[pid]`` (``n_partials`` programs); MODE 2 runs its programs last to first and
    takes the global amax as the max of ``aux_ptr[:n_partials]`` (P_BLOCK > 0) or
    ``aux_ptr[0]`` (P_BLOCK == 0). DIRECT stores ``1 / scale_inv`` instead of ``scale_inv``.
    CHECK: a program whose region holds NaN or ±inf (an amax at or above the bits of +inf)
    stores 1 at ``flag_ptr`` (finiteness checked in the same pass that quantizes). A region
    spans R_ITERS × C_ITERS tiles (loop counts are compile-time constants); a one-tile region is
    loaded once.
    """
    pid = tl.program_id(0)
    if MODE == 2:
        # Last-to-first: the rows the amax pass read last may still sit in L2.
        pid = tl.num_programs(0) - 1 - pid
    pr = pid // n_groups
    pc = pid % n_groups
    if PER_ROW:
        r_start = pr * TILE_R
        r_stop = tl.minimum(r_start + TILE_R, rows)
    else:
        r_start = pr * region_rows
        r_stop = r_start + region_rows
    r_load = tl.minimum(r_stop, rows_valid)
    c_start = pc * region_cols
    c_stop = c_start + region_cols
    offs_r = tl.arange(0, TILE_R)
    offs_c = tl.arange(0, TILE_C)

    if R_ITERS * C_ITERS == 1 and MODE != 1:
        rr = r_start + offs_r
        cc = c_start + offs_c
        m = (rr < r_load)[:, None] & (cc < c_stop)[None, :]
        ptrs = w_ptr + rr.to(tl.int64)[:, None] * stride_wr + cc.to(tl.int64)[None, :] * stride_wc
        x_single = tl.load(ptrs, mask=m, other=0.0).to(tl.float32)

    # Pass 1: amax per region, on bit patterns (exact for subnormals, NaN sorts above inf).
    if MODE == 2:
        if P_BLOCK > 0:
            offs_p = tl.arange(0, P_BLOCK)
            parts = tl.load(aux_ptr + offs_p, mask=offs_p < n_partials, other=0.0)
            amax_bits = tl.max(parts.to(tl.int32, bitcast=True), axis=0)
        else:
            amax_bits = tl.load(aux_ptr).to(tl.int32, bitcast=True)
        acc = tl.zeros([TILE_R], dtype=tl.int32) + amax_bits
    elif MODE == 1:
        # Row tiles pid, pid + n_partials, ... (n_partials programs in all), elementwise max.
        wide = tl.zeros([TILE_R, TILE_C], dtype=tl.int32)
        i = 0
        while i < n_iters:  # (a while loop: the interpreter cannot range() over a runtime int)
            for j in range(C_ITERS):
                rr = (pid + i * n_partials) * TILE_R + offs_r
                cc = j * TILE_C + offs_c
                m = (rr < rows_valid)[:, None] & (cc < cols)[None, :]
                ptrs = w_ptr + rr.to(tl.int64)[:, None] * stride_wr
                ptrs += cc.to(tl.int64)[None, :] * stride_wc
                x = tl.load(ptrs, mask=m, other=0.0).to(tl.float32)
                wide = tl.maximum(wide, x.to(tl.int32, bitcast=True) & 0x7FFFFFFF)
            i += 1
        acc = tl.max(wide, axis=1)
    else:
        if R_ITERS * C_ITERS == 1:
            acc = tl.max(x_single.to(tl.int32, bitcast=True) & 0x7FFFFFFF, axis=1)
        else:
            acc = tl.zeros([TILE_R], dtype=tl.int32)
            for i in range(R_ITERS):
                for j in range(C_ITERS):
                    rr = r_start + i * TILE_R + offs_r
                    cc = c_start + j * TILE_C + offs_c
                    m = (rr < r_load)[:, None] & (cc < c_stop)[None, :]
                    ptrs = (
                        w_ptr
                        + rr.to(tl.int64)[:, None] * stride_wr
                        + cc.to(tl.int64)[None, :] * stride_wc
                    )
                    x = tl.load(ptrs, mask=m, other=0.0).to(tl.float32)
                    bits = x.to(tl.int32, bitcast=True) & 0x7FFFFFFF
                    acc = tl.maximum(acc, tl.max(bits, axis=1))
        if not PER_ROW:
            acc = tl.zeros([TILE_R], dtype=tl.int32) + tl.max(acc, axis=0)

    rows_here = r_start + offs_r
    if MODE == 1:
        tl.store(aux_ptr + pid, tl.max(acc, axis=0).to(tl.float32, bitcast=True))
    else:
        if CHECK:
            # 0x7F800000: the bits of +inf; NaN's are above. Every writer stores the same 1.
            bad = acc >= 0x7F800000
            if MODE == 2:
                bad = bad & ((offs_r + pid) == 0)  # one program reports the global amax
            elif not PER_ROW:
                bad = bad & (offs_r == 0)
            tl.store(flag_ptr + offs_r * 0, tl.full([TILE_R], 1, tl.int32), mask=bad)
        # scale_inv = fmax / max(amax, FLT_MIN), IEEE division, capped at FLT_MAX; 1 for amax 0.
        den = tl.maximum(acc, TINY_BITS).to(tl.float32, bitcast=True)
        inv = tl.math.div_rn(tl.full([TILE_R], FMAX, tl.float32), den)
        inv = tl.where(inv > FLT_MAX, FLT_MAX, inv)
        inv = tl.where(acc > 0, inv, 1.0)
        if DIRECT:
            scale = tl.math.div_rn(tl.full([TILE_R], 1.0, tl.float32), inv)
        else:
            scale = inv
        if MODE == 2:
            tl.store(s_ptr + offs_r * 0, scale, mask=(offs_r + pid) == 0)  # (program 0, lane 0)
        elif PER_ROW:
            s_ptrs = s_ptr + rows_here.to(tl.int64) * stride_sr + pc * stride_sc
            tl.store(s_ptrs, scale, mask=rows_here < r_stop)
        else:
            tl.store(s_ptr + pr * stride_sr + pc * stride_sc + offs_r * 0, scale, mask=offs_r == 0)

        # Pass 2: scale, clamp (NaN kept), convert with one nearest-even rounding.
        for i in range(R_ITERS):
            for j in range(C_ITERS):
                rr = r_start + i * TILE_R + offs_r
                cc = c_start + j * TILE_C + offs_c
                m = (rr < r_stop)[:, None] & (cc < c_stop)[None, :]
                if R_ITERS * C_ITERS == 1:
                    x = x_single
                else:
                    ptrs = (
                        w_ptr
                        + rr.to(tl.int64)[:, None] * stride_wr
                        + cc.to(tl.int64)[None, :] * stride_wc
                    )
                    x = tl.load(ptrs, mask=m & (rr < r_load)[:, None], other=0.0).to(tl.float32)
                y = x * inv[:, None]
                y = tl.where(y > FMAX, FMAX, tl.where(y < -FMAX, -FMAX, y))
                code = fp8_encode(y, CONVERT, MANT, BIAS, FNUZ)
                q_ptrs = q_ptr + rr.to(tl.int64)[:, None] * cols + cc.to(tl.int64)[None, :]
                tl.store(q_ptrs, code, mask=m)
