"""Triton sources of the fused small-M FP8 linear (:mod:`floatxq.kernels.fp8_small_m`).

Imported on the first launch, never at ``import floatxq``: this module imports Triton, and
``triton.jit`` picks the compiler or the interpreter when it decorates (:data:`INTERPRETED`). The
``x`` codes go through :func:`floatxq.kernels._fp8_weight_jit.fp8_encode`, the weight
quantizer's own encoder. ``@no_type_check`` keeps the test run's jaxtyping hook off these
functions (Triton must see the plain function).
"""

from typing import no_type_check

import triton
import triton.language as tl
from triton import knobs

from floatxq.kernels._fp8_weight_jit import fp8_encode

__all__ = ["INTERPRETED", "fp8_small_m_kernel"]

INTERPRETED: bool = bool(knobs.runtime.interpret)
"""Whether the functions below were jitted for the interpreter (``TRITON_INTERPRET=1``)."""


@triton.jit
@no_type_check
def inv_of_amax(amax, FMAX: tl.constexpr, FLT_MAX: tl.constexpr, TINY_BITS: tl.constexpr,
                ROWS: tl.constexpr):  # fmt: skip
    """``scale_inv = fmax / max(amax, FLT_MIN)`` (IEEE division), capped at FLT_MAX, 1 for an
    amax of 0; ``amax`` holds the bit patterns of ``|x|`` maxima (``(ROWS,)`` int32)."""
    den = tl.maximum(amax, TINY_BITS).to(tl.float32, bitcast=True)
    inv = tl.math.div_rn(tl.full([ROWS], FMAX, tl.float32), den)
    inv = tl.where(inv > FLT_MAX, FLT_MAX, inv)
    return tl.where(amax > 0, inv, 1.0)


@triton.jit
@no_type_check
def x_scale_inv(
    x_ptr,
    pid_m,
    M,
    K,
    stride_xm,
    stride_xk,
    MODE: tl.constexpr,
    FMAX: tl.constexpr,
    FLT_MAX: tl.constexpr,
    TINY_BITS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    AMAX_M: tl.constexpr,
    AMAX_K: tl.constexpr,
    AMAX_UNROLL: tl.constexpr,
    M_ITERS: tl.constexpr,
    A_CHUNKS: tl.constexpr,
):
    """``(BLOCK_M,)`` scale_inv of x per tensor (MODE 0) or of this program's rows (MODE 1).

    The amax runs on bit patterns (subnormals exact) in tiles of ``AMAX_M`` rows (1 for a
    one-row x, so no lanes idle on masked rows) by ``AMAX_K`` columns, ``AMAX_UNROLL`` loads in
    flight at once (a rolled loop of loads that feed only a max is not pipelined: one memory
    round trip per tile); chunks of them run in a rolled loop (bounded code and registers).
    """
    amax_m = tl.zeros([AMAX_M], dtype=tl.int32)
    offs_ak = tl.arange(0, AMAX_K)
    for mi in range(M_ITERS):  # MODE 0: every row tile of x; MODE 1: this program's rows
        if MODE == 0:
            rows = mi * AMAX_M + tl.arange(0, AMAX_M)
        else:
            rows = pid_m * BLOCK_M + tl.arange(0, AMAX_M)
        base = x_ptr + rows.to(tl.int64)[:, None] * stride_xm
        for c in range(A_CHUNKS):
            for u in tl.static_range(AMAX_UNROLL):
                kk = (c * AMAX_UNROLL + u) * AMAX_K + offs_ak
                mask = (rows < M)[:, None] & (kk < K)[None, :]
                v = tl.load(base + kk.to(tl.int64)[None, :] * stride_xk, mask=mask, other=0.0)
                bits = v.to(tl.float32).to(tl.int32, bitcast=True) & 0x7FFFFFFF
                amax_m = tl.maximum(amax_m, tl.max(bits, axis=1))
    if MODE == 0 or AMAX_M != BLOCK_M:  # one value for every row (MODE 1: a one-row x)
        amax = tl.zeros([BLOCK_M], dtype=tl.int32) + tl.max(amax_m, axis=0)
    else:
        amax = amax_m
    return inv_of_amax(amax, FMAX, FLT_MAX, TINY_BITS, BLOCK_M)


@triton.jit
@no_type_check
def x_amax_together(
    x_ptr,
    sync_ptr,
    pid_m,
    M,
    K,
    stride_xm,
    stride_xk,
    MODE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    COOP_K: tl.constexpr,
    COOP_ITERS: tl.constexpr,
    SLOTS: tl.constexpr,
):
    """``(BLOCK_M,)`` amax bit patterns of x per tensor (MODE 0) or of this program's rows
    (MODE 1), reduced by every program of the grid together: each reads its share of x
    (``COOP_K``-wide pieces of one row, ``COOP_ITERS`` of them), folds it into a global
    maximum with an atomic, and waits at a grid barrier (the launch is cooperative, so every
    program is resident).

    ``sync_ptr`` (int32, per stream) holds a generation, an arrival count and two banks of
    ``SLOTS`` maxima (slot 0 for tensorwise, one per row for rowwise); this launch uses bank
    ``generation % 2``, which is all zeros when it starts. The last program to arrive zeroes
    the other bank for the next launch, resets the count and bumps the generation, which
    releases the others.
    """
    n_prog = tl.num_programs(0) * tl.num_programs(1) * tl.num_programs(2)
    p = (tl.program_id(2) * tl.num_programs(1) + tl.program_id(1)) * tl.num_programs(0) + pid_m
    gen = tl.atomic_add(sync_ptr, 0, sem="relaxed", scope="gpu")
    bank = sync_ptr + 2 + (gen & 1) * SLOTS
    per_row = tl.cdiv(K, COOP_K)
    offs = tl.arange(0, COOP_K)
    for i in range(COOP_ITERS):  # (one piece per program at decode sizes)
        piece = p + i * n_prog
        row = piece // per_row
        kk = (piece % per_row) * COOP_K + offs
        v = tl.load(
            x_ptr + row.to(tl.int64) * stride_xm + kk.to(tl.int64) * stride_xk,
            mask=(kk < K) & (row < M),
            other=0.0,
        )
        bits = tl.max(v.to(tl.float32).to(tl.int32, bitcast=True) & 0x7FFFFFFF, axis=0)
        slot = row if MODE == 1 else 0
        tl.atomic_max(bank + slot, bits, mask=row < M, sem="relaxed", scope="gpu")
    arrived = tl.atomic_add(sync_ptr + 1, 1, sem="acq_rel", scope="gpu")
    if arrived == n_prog - 1:
        other = sync_ptr + 2 + ((gen + 1) & 1) * SLOTS + tl.arange(0, SLOTS)
        tl.store(other, tl.zeros([SLOTS], dtype=tl.int32))  # read by the next launch only
        tl.atomic_xchg(sync_ptr + 1, 0, sem="relaxed", scope="gpu")
        tl.atomic_xchg(sync_ptr, gen + 1, sem="release", scope="gpu")
    else:
        while tl.atomic_add(sync_ptr, 0, sem="acquire", scope="gpu") == gen:
            pass
    if MODE == 0:
        amax = tl.zeros([BLOCK_M], dtype=tl.int32) + tl.atomic_max(
            bank, 0, sem="relaxed", scope="gpu"
        )
    else:
        rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        got = tl.atomic_max(bank + rows, tl.zeros([BLOCK_M], dtype=tl.int32), mask=rows < M,
                            sem="relaxed", scope="gpu")  # fmt: skip
        amax = tl.where(rows < M, got, 0)
    return amax


SPLIT_LOADS = tl.constexpr(8)
"""Partial tiles the last split of a split-K tile loads before adding them. The same bits at
any value; for the short splits of these kernels the compiler already unrolled the loop, so it
measured no faster than 1 (the fragment kernels' own sum gained 1.4–1.6×, RESULTS.md)."""


@triton.jit
@no_type_check
def sum_partials(acc, part_ptr, p_offs, p_mask, MN, SPLIT: tl.constexpr):
    """``acc`` plus the ``SPLIT`` partial tiles stored at ``part_ptr + s · MN + p_offs``, added
    in split order with :data:`SPLIT_LOADS` loads in flight (past the last split, ``-0.0``: the
    identity of addition, so the bits are those of one load at a time)."""
    CH: tl.constexpr = SPLIT_LOADS if SPLIT > SPLIT_LOADS else SPLIT
    for s0 in range(0, SPLIT, CH):
        for j in tl.static_range(CH):
            s = s0 + j
            acc += tl.load(part_ptr + s * MN + p_offs, mask=p_mask & (s < SPLIT), other=-0.0,
                           cache_modifier=".cg")  # fmt: skip
    return acc


@triton.jit
@no_type_check
def fp8_small_m_kernel(
    x_ptr,
    w_ptr,
    ws_ptr,
    b_ptr,
    out_ptr,
    part_ptr,
    count_ptr,
    sync_ptr,
    xq_ptr,
    xs_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_xk,
    stride_wn,
    stride_wk,
    stride_s0,
    stride_s1,
    stride_om,
    MODE: tl.constexpr,
    W_E5M2: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    FMAX: tl.constexpr,
    FLT_MAX: tl.constexpr,
    TINY_BITS: tl.constexpr,
    CONVERT: tl.constexpr,
    IMPRECISE_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    AMAX_M: tl.constexpr,
    AMAX_K: tl.constexpr,
    AMAX_UNROLL: tl.constexpr,
    M_ITERS: tl.constexpr,
    A_CHUNKS: tl.constexpr,
    K_ITERS: tl.constexpr,
    SPLIT: tl.constexpr,
    COOP: tl.constexpr,
    COOP_K: tl.constexpr,
    COOP_ITERS: tl.constexpr,
    SLOTS: tl.constexpr,
    STORE_X: tl.constexpr,
):
    """``out[m-tile, n-tile]`` of :func:`floatxq.fp8_scaled_linear` (see
    :mod:`floatxq.kernels.fp8_small_m`).

    MODE 0 tensorwise (x per tensor, every program reduces all of x), 1 rowwise (per row),
    2 blockwise (per 1×128 block, BLOCK_K == 128, the weight scale grid is (N/128, K/128)).
    ``ws_ptr`` holds DIRECT weight scales (``1 / weight_scale_inv``). E4M3 weights meet the
    E4M3 ``x`` codes in an FP8 MMA; E5M2 weights and ``x`` are decoded exactly to FP16 first.
    Loop trip counts are compile-time constants (the amax's ``M_ITERS`` row tiles of ``AMAX_M``
    rows and ``A_CHUNKS`` chunks of ``AMAX_UNROLL`` tiles ``AMAX_K`` wide; ``K_ITERS`` steps of
    ``BLOCK_K`` per split): one compiled kernel per layer width, and loops the compiler can
    pipeline.

    SPLIT > 1 splits K over ``program_id(2)`` (K_ITERS steps each): every split stores its FP32
    partial tile at ``part_ptr[split, m, n]``, then bumps the tile's counter; the program that
    arrives last sums the partials in split order (so the result never depends on arrival
    order), runs the epilogue and resets the counter to 0 for the next launch.

    STORE_X also writes what the K loop quantized ``x`` to: its int8 codes at ``xq_ptr[m, k]``
    and its inverse scales at ``xs_ptr`` (``()``, ``[m]`` or ``[m, K / 128]`` by MODE), each
    element once (by the programs of the first N tile, every K split storing its own steps).
    Off, the pointers are ``None`` (Triton makes them compile-time constants) and the kernel is
    the one without the stores.
    """
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_ok = offs_m < M
    n_ok = offs_n < N
    x_rows = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm
    w_rows = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn

    # 1. x's scale (tensorwise/rowwise; blockwise scales are taken per step in the K loop).
    if MODE != 2 and COOP:
        inv = inv_of_amax(
            x_amax_together(
                x_ptr, sync_ptr, pid_m, M, K, stride_xm, stride_xk, MODE, BLOCK_M, COOP_K,
                COOP_ITERS, SLOTS,
            ),
            FMAX, FLT_MAX, TINY_BITS, BLOCK_M,
        )  # fmt: skip
    elif MODE != 2:
        inv = x_scale_inv(
            x_ptr, pid_m, M, K, stride_xm, stride_xk, MODE, FMAX, FLT_MAX, TINY_BITS,
            BLOCK_M, AMAX_M, AMAX_K, AMAX_UNROLL, M_ITERS, A_CHUNKS,
        )  # fmt: skip
    if STORE_X:  # x's inverse scale(s), stored by the programs of the first N tile and split
        lead = (offs_m * 0 + pid_n + pid_k) == 0  # (a vector: see the split-K store mask)
        if MODE == 0:
            tl.store(xs_ptr + offs_m * 0, inv, mask=lead & (offs_m == 0))
        elif MODE == 1:
            tl.store(xs_ptr + offs_m, inv, mask=lead & m_ok)

    # 2. K loop: quantize x's tile to E4M3 codes in registers, then one tensor-core product
    # out.T[n, m] += W[n, k] · xq.T[k, m] ("swap AB": the weight tile is the MMA's tall operand,
    # so 16 rows of x do not waste a 64-row MMA tile), FP32 accumulation promoted every
    # IMPRECISE_K products (Hopper's FP8 MMA adds with fewer bits than FP32 otherwise).
    # Accumulating inside the dot (tensorwise/rowwise) lets Triton pipeline the weight loads.
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    for ki in range(K_ITERS):
        k0 = (pid_k * K_ITERS + ki) * BLOCK_K
        kk = k0 + offs_k
        k_ok = kk < K
        xv = tl.load(
            x_rows + kk.to(tl.int64)[None, :] * stride_xk,
            mask=m_ok[:, None] & k_ok[None, :],
            other=0.0,
        ).to(tl.float32)
        w = tl.load(
            w_rows + kk.to(tl.int64)[None, :] * stride_wk,
            mask=n_ok[:, None] & k_ok[None, :],
            other=0.0,
        )
        if MODE == 2:
            inv = inv_of_amax(
                tl.max(xv.to(tl.int32, bitcast=True) & 0x7FFFFFFF, axis=1),
                FMAX, FLT_MAX, TINY_BITS, BLOCK_M,
            )  # fmt: skip
        y = xv * inv[:, None]
        y = tl.where(y > FMAX, FMAX, tl.where(y < -FMAX, -FMAX, y))
        code = fp8_encode(y, CONVERT, 3, 7, False)
        xq = code.to(tl.float8e4nv, bitcast=True)
        if STORE_X:  # each code once: the first N tile's programs, every split its own steps
            first = m_ok & ((offs_m * 0 + pid_n) == 0)
            tl.store(
                xq_ptr + offs_m.to(tl.int64)[:, None] * K + kk[None, :],
                code,
                mask=first[:, None] & k_ok[None, :],
            )
            if MODE == 2:
                tl.store(
                    xs_ptr + offs_m.to(tl.int64) * (K // 128) + k0 // 128,
                    inv,
                    mask=first & (offs_m * 0 + k0 < K),
                )
        if W_E5M2:  # E4M3 x E5M2 (rowwise only): both decoded exactly to FP16
            acc = tl.dot(w.to(tl.float16), tl.trans(xq.to(tl.float16)), acc)
        elif MODE != 2:
            acc = tl.dot(w, tl.trans(xq), acc, max_num_imprecise_acc=IMPRECISE_K)
        else:  # blockwise: this step's sums times its x block's and weight block's scales
            part = tl.dot(w, tl.trans(xq), out_dtype=tl.float32, max_num_imprecise_acc=IMPRECISE_K)
            sx_block = tl.math.div_rn(tl.full([BLOCK_M], 1.0, tl.float32), inv)
            sw_block = tl.load(
                ws_ptr + (offs_n // 128).to(tl.int64) * stride_s0 + (k0 // 128) * stride_s1,
                mask=n_ok & (offs_n * 0 + k0 < K),  # a split's last steps may lie past K
                other=0.0,
            )
            acc += part * (sw_block[:, None] * sx_block[None, :])

    # 3. Split-K: the last split of this tile to arrive reduces the partials in split order.
    out_ok = n_ok[:, None] & m_ok[None, :]
    if SPLIT > 1:
        tile = pid_m * tl.num_programs(1) + pid_n
        p_offs = offs_n.to(tl.int64)[:, None] + offs_m.to(tl.int64)[None, :] * N
        p_mask = n_ok[:, None] & m_ok[None, :]
        tl.store(part_ptr + pid_k.to(tl.int64) * M * N + p_offs, acc, mask=p_mask)
        tl.debug_barrier()  # every thread's partial is written before the counter moves
        arrived = tl.atomic_add(count_ptr + tile, 1, sem="acq_rel", scope="gpu")
        # (compared as a vector: a scalar flag in a store mask is not a boolean to every
        # Triton interpreter)
        out_ok = out_ok & ((offs_m * 0 + arrived) == SPLIT - 1)[None, :]
        if arrived == SPLIT - 1:
            tl.debug_barrier()
            acc = sum_partials(tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32), part_ptr, p_offs,
                               p_mask, M * N, SPLIT)  # fmt: skip
            tl.atomic_xchg(count_ptr + tile, 0, sem="relaxed", scope="gpu")

    # 4. Epilogue: direct scales, bias (already in the output dtype), one rounding.
    if MODE != 2:
        sx = tl.math.div_rn(tl.full([BLOCK_M], 1.0, tl.float32), inv)
    if MODE == 2:
        out = acc
    elif MODE == 0:
        out = acc * (tl.load(ws_ptr) * sx[None, :])
    else:
        sw = tl.load(ws_ptr + offs_n.to(tl.int64) * stride_s0, mask=n_ok, other=0.0)
        out = acc * (sw[:, None] * sx[None, :])
    if HAS_BIAS:
        out += tl.load(b_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[:, None]
    # out is allocated contiguous by the caller (unit column stride); written transposed back
    o_ptrs = out_ptr + offs_m.to(tl.int64)[None, :] * stride_om + offs_n.to(tl.int64)[:, None]
    tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=out_ok)
