"""Triton sources of the INT4-weight kernels: FP8 token packing, the grouped W4A-FP8 GEMM, the
W4A16 GEMM and the GPTQ decode.

Imported by :mod:`floatxq.kernels.w4a_fp8` and :mod:`floatxq.kernels.w4a16` on the first
launch, never at ``import floatxq`` (this module imports Triton); :data:`INTERPRETED` records
whether ``triton.jit`` chose the interpreter. ``@no_type_check`` keeps the test run's jaxtyping
hook off the functions (Triton must see the plain function).
"""

from typing import no_type_check

import triton
import triton.language as tl
from triton import knobs
from triton.language.extra.cuda import gdc_launch_dependents

from floatxq.kernels._fp8_small_m_jit import sum_partials
from floatxq.kernels._fp8_weight_jit import fp8_encode

__all__ = [
    "INTERPRETED",
    "fp8_pack_kernel",
    "gptq_decode_kernel",
    "w4a16_kernel",
    "w4a_fp8_kernel",
]

INTERPRETED: bool = bool(knobs.runtime.interpret)
"""Whether the functions below were jitted for the interpreter (``TRITON_INTERPRET=1``)."""


@triton.jit
@no_type_check
def fp8_pack_kernel(
    x_ptr,
    q_ptr,
    s_ptr,
    M,
    K,
    stride_xm,
    stride_xk,
    FMAX: tl.constexpr,
    TINY_BITS: tl.constexpr,
    CONVERT: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
    CHUNKS: tl.constexpr,
    LAUNCH_DEPENDENTS: tl.constexpr = False,
):
    """Rows ``[pid·BLOCK_R, +BLOCK_R)`` of :func:`floatxq.fp8_token_quantize`: E4M3 codes (int8
    bits at ``q_ptr``, contiguous ``(M, K)``) and FP32 direct scales at ``s_ptr``.

    ``scale = amax / 448`` (IEEE division; the smallest positive FP32 where it underflows, 1 for
    an all-zero row), ``code = e4m3(clamp(x / scale, ±448))`` with IEEE division and one
    nearest-even saturating conversion. A row is read in ``CHUNKS`` chunks of ``BLOCK_K``: once
    for the amax and once more to quantize (from cache when it is long). ``LAUNCH_DEPENDENTS``
    (GPU only): a GEMM launched dependent on this one may start at once (its first weight
    loads overlap this launch; it reads the tokens only after waiting for it to finish).
    """
    if LAUNCH_DEPENDENTS:
        gdc_launch_dependents()
    pid = tl.program_id(0)
    rows = pid * BLOCK_R + tl.arange(0, BLOCK_R)
    r_ok = rows < M
    cols = tl.arange(0, BLOCK_K)
    base = x_ptr + rows.to(tl.int64)[:, None] * stride_xm
    # amax over the FP32 bit patterns (integer maximum: no flush of subnormals; NaN wins)
    top = tl.zeros([BLOCK_R], dtype=tl.int32)
    if CHUNKS == 1:
        ok = r_ok[:, None] & (cols < K)[None, :]
        xv = tl.load(base + cols.to(tl.int64)[None, :] * stride_xk, mask=ok, other=0.0)
        xv = xv.to(tl.float32)
        top = tl.max(xv.to(tl.int32, bitcast=True) & 0x7FFFFFFF, axis=1)
    else:
        for c in range(CHUNKS):
            kk = c * BLOCK_K + cols
            ok = r_ok[:, None] & (kk < K)[None, :]
            xc = tl.load(base + kk.to(tl.int64)[None, :] * stride_xk, mask=ok, other=0.0)
            bits = xc.to(tl.float32).to(tl.int32, bitcast=True) & 0x7FFFFFFF
            top = tl.maximum(top, tl.max(bits, axis=1))
    amax = top.to(tl.float32, bitcast=True)
    # amax / 448 correctly rounded, subnormal results included: in FP64 (amax / 7 never lies
    # near an FP32 rounding midpoint, so the two roundings give the single one), then to FP32
    scale = (amax.to(tl.float64) / FMAX).to(tl.float32)
    tiny = tl.full([BLOCK_R], TINY_BITS, tl.int32).to(tl.float32, bitcast=True)
    scale = tl.where(scale.to(tl.int32, bitcast=True) > 0, scale, tiny)
    scale = tl.where(top > 0, scale, 1.0)
    # x / scale with both operands times 2**64 for tiny rows: the same exact quotient, with no
    # subnormal operand for a flushing division to lose
    boost = tl.where(top < 0x21800000, 18446744073709551616.0, 1.0)  # amax < 2**-60
    divisor = scale * boost
    tl.store(s_ptr + rows, scale, mask=r_ok)
    q_rows = q_ptr + rows.to(tl.int64)[:, None] * K
    for c in range(CHUNKS):
        kk = c * BLOCK_K + cols
        ok = r_ok[:, None] & (kk < K)[None, :]
        if CHUNKS == 1:
            xc = xv
        else:
            xc = tl.load(base + kk.to(tl.int64)[None, :] * stride_xk, mask=ok, other=0.0)
            xc = xc.to(tl.float32)
        y = tl.math.div_rn(xc * boost[:, None], divisor[:, None])
        y = tl.where(y > FMAX, FMAX, tl.where(y < -FMAX, -FMAX, y))
        tl.store(q_rows + kk[None, :], fp8_encode(y, CONVERT, 3, 7, False), mask=ok)


@triton.jit
@no_type_check
def unpack_fields(words, BITS: tl.constexpr, ROWS: tl.constexpr, COLS: tl.constexpr):
    """``(ROWS, COLS)`` unsigned fields of ``(ROWS * BITS / 32, COLS)`` int32 words: row ``k``
    in word ``k // (32 / BITS)`` at bits ``BITS * (k % (32 / BITS))`` (GPTQ's packing)."""
    PER: tl.constexpr = 32 // BITS
    shifts = tl.arange(0, PER) * BITS
    fields = (words[:, None, :] >> shifts[None, :, None]) & ((1 << BITS) - 1)
    return tl.reshape(fields, (ROWS, COLS))


@triton.jit
@no_type_check
def tile_of(pid, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """``(pid_m, pid_n)`` of program ``pid``: row-major over the output tiles, or (``GROUP_M``
    > 1) in bands of that many M tiles, so a band's weight tiles are reused from L2."""
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    if GROUP_M > 1:
        band = pid // (GROUP_M * tiles_n)
        first_m = band * GROUP_M
        size = tl.minimum(tiles_m - first_m, GROUP_M)
        return first_m + (pid % (GROUP_M * tiles_n)) % size, (pid % (GROUP_M * tiles_n)) // size
    return pid // tiles_n, pid % tiles_n


@triton.jit
@no_type_check
def split_k_reduce(acc, part_ptr, count_ptr, tile, pid_k, offs_m, offs_n, M, N,
                   SPLIT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):  # fmt: skip
    """Store this split's FP32 tile; the last split of the tile to arrive sums all of them in
    split order (the result never depends on arrival order), resets the tile's counter and
    returns ``(sum, True)``; the others return ``(acc, False)``."""
    p_offs = offs_m.to(tl.int64)[:, None] * N + offs_n.to(tl.int64)[None, :]
    p_mask = (offs_m < M)[:, None] & (offs_n < N)[None, :]
    tl.store(part_ptr + pid_k.to(tl.int64) * M * N + p_offs, acc, mask=p_mask)
    tl.debug_barrier()  # every thread's partial is written before the counter moves
    arrived = tl.atomic_add(count_ptr + tile, 1, sem="acq_rel", scope="gpu")
    last = arrived == SPLIT - 1
    if last:
        tl.debug_barrier()
        acc = sum_partials(tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32), part_ptr, p_offs,
                           p_mask, M * N, SPLIT)  # fmt: skip
        tl.atomic_xchg(count_ptr + tile, 0, sem="relaxed", scope="gpu")
    return acc, last


@triton.jit
@no_type_check
def w4a_fp8_kernel(
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
    stride_wk,
    stride_wn,
    stride_sg,
    stride_sn,
    stride_om,
    WORDS: tl.constexpr,
    MMA_FP8: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    GROUP_ITERS: tl.constexpr,
    SPLIT: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    """``out[m-tile, n-tile]`` of :func:`floatxq.w4a_fp8_linear_prepacked`.

    ``a_ptr``: E4M3 token codes ``(M, K)`` (unit K stride); ``rs_ptr``: their FP32 direct
    scales. The weight is either the int32 GPTQ words ``(K/8, N)`` read as ``code - 8``
    (``WORDS``) or the staged E4M3 operand ``(K, N)`` (any strides; K-contiguous is the fast
    one for FP8 MMAs). Each 128-wide group is one product with a fresh FP32 accumulator, on FP8
    tensor cores (``MMA_FP8``: E4M3 × E4M3) or on FP16 ones (both operands converted exactly);
    every product of a code and an integer of magnitude ≤ 8 is exact either way. Then
    ``total += partial · scales[g, n]`` in ascending groups, a split's ``GROUP_ITERS`` groups
    (``SPLIT`` > 1: summed across splits by :func:`split_k_reduce`), the token scale once, the
    bias, one rounding. ``GROUP_M`` > 1 orders the programs in bands of that many M tiles so a
    band's weight tiles are reused from L2 (large M).
    """
    pid_k = tl.program_id(1)
    tiles_n = tl.cdiv(N, BLOCK_N)
    pid_m, pid_n = tile_of(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, 128)
    m_ok = offs_m < M
    n_ok = offs_n < N
    a_rows = a_ptr + offs_m.to(tl.int64)[:, None] * stride_am
    w_cols = w_ptr + offs_n.to(tl.int64)[None, :] * stride_wn
    total = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for gi in range(GROUP_ITERS):
        g = pid_k * GROUP_ITERS + gi
        k0 = g * 128
        if WORDS:  # sixteen words per column, unpacked in registers to code - 8 (exact)
            rows = g * 16 + tl.arange(0, 16)
            words = tl.load(w_cols + rows.to(tl.int64)[:, None] * stride_wk,
                            mask=n_ok[None, :], other=0)  # fmt: skip
            w = (unpack_fields(words, 4, 128, BLOCK_N) - 8).to(tl.float16)
            a = tl.load(a_rows + (k0 + offs_k)[None, :], mask=m_ok[:, None], other=0)
            a = a.to(tl.float8e4nv, bitcast=True).to(tl.float16)
            partial = tl.dot(a, w, out_dtype=tl.float32)
        else:
            a = tl.load(a_rows + (k0 + offs_k)[None, :], mask=m_ok[:, None], other=0)
            a = a.to(tl.float8e4nv, bitcast=True)
            w = tl.load(
                w_cols + (k0 + offs_k).to(tl.int64)[:, None] * stride_wk, mask=n_ok[None, :]
            )
            w = w.to(tl.float8e4nv, bitcast=True)
            if not MMA_FP8:
                w = w.to(tl.float16)
                a = a.to(tl.float16)
            partial = tl.dot(a, w, out_dtype=tl.float32)
        s = tl.load(s_ptr + g * stride_sg + offs_n * stride_sn, mask=n_ok, other=0.0)
        s = s.to(tl.float32)
        total += partial * s[None, :]
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


@triton.jit
@no_type_check
def decoded_tile(qw_ptr, qz_ptr, s_ptr, g_ptr, k0, offs_n, n_ok, K, group_size,
                 stride_qw, stride_qwn, stride_qz, stride_qzn, stride_s, stride_sn,
                 BITS: tl.constexpr, V1: tl.constexpr,
                 GATHER: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr,
                 OUT_DTYPE: tl.constexpr):  # fmt: skip
    """The ``(BLOCK_K, BLOCK_N)`` weight tile at input rows ``k0..`` decoded as
    :func:`floatxq.dequantize_gptq` does: ``float32(scale) · (code - zero)`` rounded once
    to ``OUT_DTYPE``. ``GATHER``: each row's group is ``g_idx[k]`` (any order); otherwise every
    row of the tile lies in group ``k0 // group_size``. ``V1`` adds a one to every field of the
    zero-point words (with carries, as the word arithmetic of the v1 convention does)."""
    PER: tl.constexpr = 32 // BITS
    MASK: tl.constexpr = (1 << BITS) - 1
    ONES: tl.constexpr = 0x11111111 if BITS == 4 else (0x55555555 if BITS == 2 else 0x01010101)
    rows = k0 // PER + tl.arange(0, BLOCK_K // PER)
    w_ok = (rows < K // PER)[:, None] & n_ok[None, :]
    w_cols = qw_ptr + (offs_n * stride_qwn)[None, :]
    words = tl.load(w_cols + rows.to(tl.int64)[:, None] * stride_qw, mask=w_ok, other=0)
    codes = unpack_fields(words, BITS, BLOCK_K, BLOCK_N)
    z_col = offs_n // PER
    z_shift = (offs_n % PER) * BITS
    if GATHER:
        kk = k0 + tl.arange(0, BLOCK_K)
        g = tl.load(g_ptr + kk, mask=kk < K, other=0)
        zw = tl.load(qz_ptr + g.to(tl.int64)[:, None] * stride_qz + (z_col * stride_qzn)[None, :],
                     mask=n_ok[None, :], other=0)  # fmt: skip
        if V1:
            zw = zw + ONES
        zero = (zw >> z_shift[None, :]) & MASK
        s = tl.load(s_ptr + g.to(tl.int64)[:, None] * stride_s + (offs_n * stride_sn)[None, :],
                    mask=n_ok[None, :], other=0.0)  # fmt: skip
        diff = (codes - zero).to(tl.float32)
        w = s.to(tl.float32) * diff
    else:
        g = k0 // group_size
        zw = tl.load(qz_ptr + g * stride_qz + z_col * stride_qzn, mask=n_ok, other=0)
        if V1:
            zw = zw + ONES
        zero = (zw >> z_shift) & MASK
        s = tl.load(s_ptr + g * stride_s + offs_n * stride_sn, mask=n_ok, other=0.0)
        diff = (codes - zero[None, :]).to(tl.float32)
        w = s.to(tl.float32)[None, :] * diff
    return w.to(OUT_DTYPE)


@triton.jit
@no_type_check
def w4a16_kernel(
    x_ptr,
    qw_ptr,
    qz_ptr,
    s_ptr,
    g_ptr,
    b_ptr,
    out_ptr,
    part_ptr,
    count_ptr,
    M,
    N,
    K,
    group_size,
    stride_xm,
    stride_xk,
    stride_qw,
    stride_qwn,
    stride_qz,
    stride_qzn,
    stride_s,
    stride_sn,
    stride_om,
    BITS: tl.constexpr,
    V1: tl.constexpr,
    GATHER: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    K_ITERS: tl.constexpr,
    SPLIT: tl.constexpr,
):
    """``out[m-tile, n-tile]`` of :func:`floatxq.w4a16_linear`: each weight tile decoded in
    registers (:func:`decoded_tile`, the exact decode rounded to ``x``'s dtype), multiplied on
    the tensor cores with FP32 accumulation, split over K by ``program_id(1)`` (``K_ITERS``
    steps each, reduced by :func:`split_k_reduce`), the bias (rounded to ``x``'s dtype, as the
    reference adds it) added in FP32, one rounding."""
    pid = tl.program_id(0)
    pid_k = tl.program_id(1)
    tiles_n = tl.cdiv(N, BLOCK_N)
    pid_m = pid // tiles_n
    pid_n = pid % tiles_n
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_ok = offs_m < M
    n_ok = offs_n < N
    x_rows = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for ki in range(K_ITERS):
        k0 = (pid_k * K_ITERS + ki) * BLOCK_K
        kk = k0 + offs_k
        a = tl.load(x_rows + kk.to(tl.int64)[None, :] * stride_xk,
                    mask=m_ok[:, None] & (kk < K)[None, :], other=0.0)  # fmt: skip
        w = decoded_tile(
            qw_ptr, qz_ptr, s_ptr, g_ptr, k0, offs_n, n_ok, K, group_size, stride_qw,
            stride_qwn, stride_qz, stride_qzn, stride_s, stride_sn, BITS, V1, GATHER, BLOCK_K,
            BLOCK_N, x_ptr.dtype.element_ty,
        )  # fmt: skip
        acc = tl.dot(a, w, acc)
    last = True
    if SPLIT > 1:
        tile = pid_m * tiles_n + pid_n
        acc, last = split_k_reduce(
            acc, part_ptr, count_ptr, tile, pid_k, offs_m, offs_n, M, N, SPLIT, BLOCK_M, BLOCK_N
        )
    if last:
        if HAS_BIAS:  # (the bias in x's dtype, as the reference adds it)
            bias = tl.load(b_ptr + offs_n, mask=n_ok, other=0.0).to(out_ptr.dtype.element_ty)
            acc += bias.to(tl.float32)[None, :]
        o_ptrs = out_ptr + offs_m.to(tl.int64)[:, None] * stride_om + offs_n[None, :]
        tl.store(o_ptrs, acc.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


@triton.jit
@no_type_check
def gptq_decode_kernel(
    qw_ptr,
    qz_ptr,
    s_ptr,
    g_ptr,
    w_ptr,
    K,
    N,
    group_size,
    stride_qw,
    stride_qwn,
    stride_qz,
    stride_qzn,
    stride_s,
    stride_sn,
    BITS: tl.constexpr,
    V1: tl.constexpr,
    GATHER: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """The decoded weight ``(K, N)`` (contiguous) in ``w_ptr``'s dtype: the tiles of
    :func:`decoded_tile`, for a library GEMM to multiply (large M)."""
    pid_k = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    k0 = pid_k * BLOCK_K
    w = decoded_tile(
        qw_ptr, qz_ptr, s_ptr, g_ptr, k0, offs_n, n_ok, K, group_size, stride_qw, stride_qwn,
        stride_qz, stride_qzn, stride_s, stride_sn, BITS, V1, GATHER, BLOCK_K, BLOCK_N,
        w_ptr.dtype.element_ty,
    )  # fmt: skip
    kk = k0 + tl.arange(0, BLOCK_K)
    ptrs = w_ptr + kk.to(tl.int64)[:, None] * N + offs_n[None, :]
    tl.store(ptrs, w, mask=(kk < K)[:, None] & n_ok[None, :])
