"""Triton FP8 linear for decode-sized inputs: ``x`` is quantized inside the GEMM, one launch.

Twin of :func:`floatxq.fp8_scaled_linear` (the pure reference) for ``M`` up to a few dozen
rows, where ``quantize x`` + ``torch._scaled_mm`` costs two launches and their host time
(:class:`floatxq.nn.TorchFP8Linear` routes ``M <= 16`` here on CUDA). A program owns
``BLOCK_N`` output columns of every row:

1. ``tensorwise``/``rowwise``: x's amax (per tensor or per row). From ``COOP_MIN_ROWS`` rows
   on, when the grid fits one program per SM, the programs reduce it together: each reads a
   slice of ``x``, folds its maximum into a per-stream word with an atomic and waits at a grid
   barrier (a cooperative launch, so every program is resident). Otherwise (one row, or a grid
   too large) every program reads all of ``x``, many loads in flight at once. ``blockwise``
   takes each 1×128 block's amax where the main loop reads it;
2. the K loop quantizes its ``x`` tile with the weight formula and the same encoder as
   :func:`floatxq.kernels.quantize_fp8_weight_kernel` (so the codes are exactly those of
   :func:`floatxq.quantize_fp8_weight`) and multiplies the codes on the tensor cores with the
   weight tile as the tall operand (``out.T = W · xq.T``): E4M3 × E4M3 as an FP8 MMA whose sums
   are promoted to FP32 every 32 products, E5M2 weights through exact FP16 decodes; products
   are exact;
3. the epilogue multiplies by the direct scales ``sx · sw`` (per 128-wide K block inside the
   loop for ``blockwise``), adds the bias and rounds once to the output dtype.

Optionally (``TILES``) K is split over several programs per output tile, the last to finish
summing the FP32 partials in a fixed order (deterministic; per-stream workspaces). The result
equals the reference up to summation order and the FP32 rounding of the scale products
(bounded per element in the tests: 24 bits for FP32 sums, 22 for Hopper's FP8 MMA).
Triton is imported on the first launch.
"""

import inspect
from typing import Any

import torch

from floatxq._typing import Float, Float32, FP8Dtype, Tensor
from floatxq.formats import FLOAT32_MAX, fp8_max
from floatxq.fp8 import _scaled_linear_arguments
from floatxq.kernels import fp8_weight
from floatxq.kernels._triton import (
    CachedLauncher,
    import_triton,
    launch_device,
    triton_interpret_enabled,
)

__all__ = ["fp8_scaled_linear_kernel"]

tl: Any = None
"""``triton.language``, bound on the first launch (the kernel source below refers to it)."""
_fp8_encode: Any = None
"""The jitted FP8 encoder shared with the weight kernel, bound on the first launch."""


class constexpr:
    """Parameter marker (see :mod:`floatxq.kernels.fp8_weight`): Triton's own once imported."""


_X_TENSOR, _X_ROW, _X_BLOCK = 0, 1, 2
_RECIPE_MODE = {"tensorwise": _X_TENSOR, "rowwise": _X_ROW, "blockwise": _X_BLOCK}
_BLOCK_K_GROUP = 128
_BLOCK_M = 16
_BLOCK_M_ONE_ROW = 8
"""Rows per program for a one-row ``x`` (the MMA's narrowest N): half the x tile of a 16-row
program, less shared memory and quantization work per step (H200, N = K = 8192: 0.6-1.1 us
faster at one row, but 1-4 us slower at 2-8 rows for tensorwise and rowwise)."""
_IMPRECISE_K = 32
"""FP8 products the tensor core adds before each FP32 promotion: one Hopper MMA's K (its FP8
sums keep fewer bits than FP32; at 256 they left the tests' 22-bit bound, up to 2% off)."""
TILES: dict[str, dict[str, int]] = {
    "tensorwise": {"BLOCK_N": 128, "BLOCK_K": 256, "num_warps": 8, "num_stages": 4, "split_k": 2},
    "rowwise": {"BLOCK_N": 128, "BLOCK_K": 256, "num_warps": 8, "num_stages": 4, "split_k": 2},
    "blockwise": {"BLOCK_N": 128, "BLOCK_K": 128, "num_warps": 8, "num_stages": 4, "split_k": 4},
}
"""Tiles per recipe for inputs of two rows or more, swept on the H200 at M = 16, N = K = 8192
(``benchmarks/fp8_small_m_sweep.py``; figures in benchmarks/RESULTS.md). Blockwise always
takes BLOCK_K = 128 (one weight scale per K step). ``split_k`` splits K over that many programs
per output tile (rows <= 4, or any rows for blockwise); the last to finish reduces. An optional
``imprecise_k`` sets how many FP8 products the tensor core adds before FP32 promotion (default
32, after every MMA: 128 was no faster, 256 up to 0.7 us faster at M = 1 but outside the
accuracy bound)."""
ONE_ROW_TILES: dict[str, dict[str, int]] = {
    "tensorwise": {"BLOCK_N": 64, "BLOCK_K": 256, "num_warps": 4, "num_stages": 6, "split_k": 1},
    "rowwise": {"BLOCK_N": 64, "BLOCK_K": 256, "num_warps": 4, "num_stages": 6, "split_k": 1},
    "blockwise": {"BLOCK_N": 128, "BLOCK_K": 128, "num_warps": 8, "num_stages": 4, "split_k": 4},
}
"""Tiles for a one-row ``x`` (8-row programs leave room for deeper pipelines), swept at M = 1."""


def _inv_of_amax(amax, FMAX: constexpr, FLT_MAX: constexpr, TINY_BITS: constexpr, ROWS: constexpr):
    """``scale_inv = fmax / max(amax, FLT_MIN)`` (IEEE division), capped at FLT_MAX, 1 for an
    amax of 0; ``amax`` holds the bit patterns of ``|x|`` maxima (``(ROWS,)`` int32)."""
    den = tl.maximum(amax, TINY_BITS).to(tl.float32, bitcast=True)
    inv = tl.math.div_rn(tl.full([ROWS], FMAX, tl.float32), den)
    inv = tl.where(inv > FLT_MAX, FLT_MAX, inv)
    return tl.where(amax > 0, inv, 1.0)


def _x_scale_inv(
    x_ptr,
    pid_m,
    M,
    K,
    stride_xm,
    stride_xk,
    MODE: constexpr,
    FMAX: constexpr,
    FLT_MAX: constexpr,
    TINY_BITS: constexpr,
    BLOCK_M: constexpr,
    AMAX_M: constexpr,
    AMAX_K: constexpr,
    AMAX_UNROLL: constexpr,
    M_ITERS: constexpr,
    A_CHUNKS: constexpr,
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
    return _inv_of_amax(amax, FMAX, FLT_MAX, TINY_BITS, BLOCK_M)


def _x_amax_together(
    x_ptr,
    sync_ptr,
    pid_m,
    M,
    K,
    stride_xm,
    stride_xk,
    MODE: constexpr,
    BLOCK_M: constexpr,
    COOP_K: constexpr,
    COOP_ITERS: constexpr,
    SLOTS: constexpr,
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


def _fp8_small_m_kernel(
    x_ptr,
    w_ptr,
    ws_ptr,
    b_ptr,
    out_ptr,
    part_ptr,
    count_ptr,
    sync_ptr,
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
    MODE: constexpr,
    W_E5M2: constexpr,
    HAS_BIAS: constexpr,
    FMAX: constexpr,
    FLT_MAX: constexpr,
    TINY_BITS: constexpr,
    CONVERT: constexpr,
    IMPRECISE_K: constexpr,
    BLOCK_M: constexpr,
    BLOCK_N: constexpr,
    BLOCK_K: constexpr,
    AMAX_M: constexpr,
    AMAX_K: constexpr,
    AMAX_UNROLL: constexpr,
    M_ITERS: constexpr,
    A_CHUNKS: constexpr,
    K_ITERS: constexpr,
    SPLIT: constexpr,
    COOP: constexpr,
    COOP_K: constexpr,
    COOP_ITERS: constexpr,
    SLOTS: constexpr,
):
    """``out[m-tile, n-tile]`` of :func:`floatxq.fp8_scaled_linear` (see the module docstring).

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
        inv = _inv_of_amax(
            _x_amax_together(
                x_ptr, sync_ptr, pid_m, M, K, stride_xm, stride_xk, MODE, BLOCK_M, COOP_K,
                COOP_ITERS, SLOTS,
            ),
            FMAX, FLT_MAX, TINY_BITS, BLOCK_M,
        )  # fmt: skip
    elif MODE != 2:
        inv = _x_scale_inv(
            x_ptr, pid_m, M, K, stride_xm, stride_xk, MODE, FMAX, FLT_MAX, TINY_BITS,
            BLOCK_M, AMAX_M, AMAX_K, AMAX_UNROLL, M_ITERS, A_CHUNKS,
        )  # fmt: skip

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
            inv = _inv_of_amax(
                tl.max(xv.to(tl.int32, bitcast=True) & 0x7FFFFFFF, axis=1),
                FMAX, FLT_MAX, TINY_BITS, BLOCK_M,
            )  # fmt: skip
        y = xv * inv[:, None]
        y = tl.where(y > FMAX, FMAX, tl.where(y < -FMAX, -FMAX, y))
        xq = _fp8_encode(y, CONVERT, 3, 7, False).to(tl.float8e4nv, bitcast=True)
        if W_E5M2:  # E4M3 x E5M2 (rowwise only): both decoded exactly to FP16
            acc = tl.dot(w.to(tl.float16), tl.trans(xq.to(tl.float16)), acc)
        elif MODE != 2:
            acc = tl.dot(w, tl.trans(xq), acc, max_num_imprecise_acc=IMPRECISE_K)
        else:  # blockwise: this step's sums times its x block's and weight block's scales
            part = tl.dot(w, tl.trans(xq), out_dtype=tl.float32, max_num_imprecise_acc=IMPRECISE_K)
            sx_block = tl.math.div_rn(tl.full([BLOCK_M], 1.0, tl.float32), inv)
            sw_block = tl.load(
                ws_ptr + (offs_n // 128).to(tl.int64) * stride_s0 + (k0 // 128) * stride_s1,
                mask=n_ok & (k0 < K),  # a split's last steps may lie past K: no scale there
                other=0.0,
            )
            acc += part * (sw_block[:, None] * sx_block[None, :])

    # 3. Split-K: the last split of this tile to arrive reduces the partials in split order.
    last = True
    if SPLIT > 1:
        tile = pid_m * tl.num_programs(1) + pid_n
        p_offs = offs_n.to(tl.int64)[:, None] + offs_m.to(tl.int64)[None, :] * N
        p_mask = n_ok[:, None] & m_ok[None, :]
        tl.store(part_ptr + pid_k.to(tl.int64) * M * N + p_offs, acc, mask=p_mask)
        tl.debug_barrier()  # every thread's partial is written before the counter moves
        arrived = tl.atomic_add(count_ptr + tile, 1, sem="acq_rel", scope="gpu")
        last = arrived == SPLIT - 1
        if last:
            tl.debug_barrier()
            acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
            for j in range(SPLIT):
                acc += tl.load(
                    part_ptr + j * M * N + p_offs, mask=p_mask, other=0.0, cache_modifier=".cg"
                )
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
    tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=n_ok[:, None] & m_ok[None, :] & last)


_BUILT: dict[bool, CachedLauncher] = {}
_INV_SOURCE, _SCALE_SOURCE, _TOGETHER_SOURCE = _inv_of_amax, _x_scale_inv, _x_amax_together
"""The helpers' plain sources (their module globals become the jitted helpers on a launch)."""


def _launcher(interpret: bool) -> CachedLauncher:
    launcher = _BUILT.get(interpret)
    if launcher is None:
        triton, encode = fp8_weight.bind_triton("fp8_scaled_linear_kernel")
        _, language = import_triton(where="fp8_scaled_linear_kernel")
        global tl, constexpr, _fp8_encode, _inv_of_amax, _x_scale_inv, _x_amax_together
        tl, constexpr, _fp8_encode = language, language.constexpr, encode
        _inv_of_amax, _x_scale_inv, _x_amax_together = (
            triton.jit(inspect.unwrap(fn)) for fn in (_INV_SOURCE, _SCALE_SOURCE, _TOGETHER_SOURCE)
        )
        launcher = CachedLauncher(triton.jit(inspect.unwrap(_fp8_small_m_kernel)))
        _BUILT[interpret] = launcher
    return launcher


def fp8_scaled_linear_kernel(
    x: Float[Tensor, "m k"],
    weight: FP8Dtype[Tensor, "n k"],
    weight_scale: Float32[Tensor, "*scale"],
    bias: Float[Tensor, "n"] | None = None,  # noqa: F821
    *,
    recipe: str,
) -> Float[Tensor, "m n"]:
    """Triton version of :func:`floatxq.fp8_scaled_linear` for small ``m`` (one launch).

    Args:
      x: ``(m, k)`` fp16/bf16/fp32 CUDA activations (any strides); the output takes its dtype.
      weight: ``(n, k)`` FP8 codes (``float8_e4m3fn``; ``float8_e5m2`` for ``rowwise``).
      weight_scale: FP32 DIRECT weight scales ``1 / weight_scale_inv`` (what ``scaled_mm``
        takes): ``()``, ``(n,)`` or ``(n/128, k/128)`` by recipe (any strides).
      bias: ``(n,)`` in ``x.dtype`` or None.
      recipe: ``"tensorwise"``, ``"rowwise"`` or ``"blockwise"``.

    Returns:
      ``(m, n)`` in ``x.dtype``.

    Raises:
      ValueError: an unknown recipe, shapes or scale layouts that do not fit.
      TypeError: devices, dtypes or a weight format the recipe does not take.
      RuntimeError: Triton is not importable.

    Numerics: ``x``'s FP8 codes are bit-identical to the reference's; the output equals
    :func:`floatxq.fp8_scaled_linear` up to FP32 summation order and the FP32 rounding of the
    scale products. No finiteness check (no host sync): NaN in ``x`` gives NaN rows.

    Example:
      >>> w = floatxq.quantize_fp8_weight(torch.randn(256, 512, device="cuda"))  # doctest: +SKIP
      >>> fp8_scaled_linear_kernel(  # doctest: +SKIP
      ...     torch.randn(1, 512, device="cuda"), w.qweight, 1 / w.scale_inv, recipe="rowwise"
      ... ).shape
      torch.Size([1, 256])
    """
    where = "fp8_scaled_linear_kernel"
    for label, t in (("x", x), ("weight", weight), ("weight_scale", weight_scale)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{where}: {label} must be a tensor, got {type(t).__name__}")
    if x.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise TypeError(f"{where}: x must be float16/bfloat16/float32, got {x.dtype}")
    _scaled_linear_arguments(
        x, weight, weight_scale, bias, recipe=recipe, scale_name="weight_scale", where=where
    )
    if bias is not None and bias.dtype != x.dtype:
        raise ValueError(f"{where}: bias must be in {x.dtype} (x's dtype), got {bias.dtype}")
    devices = {t.device for t in (x, weight, weight_scale) + ((bias,) if bias is not None else ())}
    interpret = triton_interpret_enabled()
    if len(devices) != 1 or (x.device.type != "cuda" and not interpret):
        raise TypeError(f"{where}: every tensor must be on one CUDA device, got {devices}")
    return _launch(x, weight, weight_scale, bias, recipe, interpret)


AMAX_TILE = 4096
"""Elements of ``x`` per load of the amax pass over a program's rows (BLOCK_M by
``AMAX_TILE / BLOCK_M``)."""
AMAX_ROW_TILE = 8192
"""Columns per load of the amax pass over a one-row ``x``."""
AMAX_UNROLL = 16
"""Loads of the amax pass in flight at once (one chunk; chunks run one after another)."""
_SPLIT_MAX_M = 4
"""Split K (``TILES[recipe]["split_k"]``) for at most this many rows (any for blockwise): each
split re-reads all of ``x`` for the tensorwise/rowwise amax."""
COOP_MIN_ROWS = 2
"""From this many rows on, tensorwise and rowwise programs reduce x's amax together (a grid
barrier in a cooperative launch, when the grid fits one program per SM) instead of each
reading all of x."""
_COOP_BANK = 64
"""Maxima per bank of the shared amax's words (one per row for rowwise, so rowwise reduces
together for at most this many rows). Fixed, so launches of any recipe and row count can share
the words: each launch starts on a bank of zeros."""
COOP_MAX_PIECE = 4096
"""Widest piece of a row one program reads for the shared amax (more pieces per program past
that)."""
_WORKSPACES: dict[Any, tuple[Tensor, Tensor, Tensor]] = {}
"""Per (device, stream): split-K partials (FP32), per-tile arrival counters and the shared
amax's words (generation, count, two banks of maxima; int32). Kernels on one stream run in
order, so they can share them; counters are zero between launches (the last split of a tile
resets its own; the last program at the amax barrier resets the count and the next bank).
Buffers are only ever replaced by larger ones kept alongside, never freed, so a CUDA graph that
captured one keeps valid memory. (Two CUDA graphs captured on one stream and replayed on two
streams at once would share them: capture them on different streams.)"""
_RETIRED: list[tuple[Tensor, Tensor, Tensor]] = []


def _workspace(
    device: torch.device, index: int, part_numel: int, tiles: int, sync_words: int
) -> tuple[Tensor, Tensor, Tensor]:
    stream = torch._C._cuda_getCurrentRawStream(index) if device.type == "cuda" else 0
    key = (device, stream)
    held = _WORKSPACES.get(key)
    if (
        held is None
        or held[0].numel() < part_numel
        or held[1].numel() < tiles
        or held[2].numel() < sync_words
    ):
        if held is not None:
            _RETIRED.append(held)
        sizes = (part_numel, tiles, sync_words)
        part, count, sync = (
            max(need, held[i].numel() if held else 1) for i, need in enumerate(sizes)
        )
        held = (
            torch.empty(part, dtype=torch.float32, device=device),
            torch.zeros(count, dtype=torch.int32, device=device),
            torch.zeros(sync, dtype=torch.int32, device=device),
        )
        _WORKSPACES[key] = held
    return held


def _plan(
    x: Tensor, weight: Tensor, weight_scale: Tensor, has_bias: bool, recipe: str, interpret: bool
) -> tuple[tuple[int, int, int], int, int, tuple[Any, ...], dict[str, Any]]:
    """``(grid, split, sync words, arguments after the eight tensors, launch options)`` of one
    launch (``sync words`` is 0 unless the programs reduce x's amax together)."""
    (m, k), n = x.shape, weight.shape[0]
    mode = _RECIPE_MODE[recipe]
    tiles = ONE_ROW_TILES[recipe] if m == 1 else TILES[recipe]
    block_n, block_k = tiles["BLOCK_N"], tiles["BLOCK_K"]
    if mode == _X_BLOCK:
        block_k = _BLOCK_K_GROUP
        block_n = min(block_n, 128)
    steps = -(-k // block_k)
    block_m = _BLOCK_M_ONE_ROW if m == 1 else _BLOCK_M
    tiles_n = -(-n // block_n)
    split = max(1, min(tiles.get("split_k", 1), steps))
    split = -(-steps // -(-steps // split))  # no split left without steps (4 steps, 3 -> 2)
    # x's amax: reduced by all programs together behind a grid barrier (a cooperative launch:
    # at most one program per SM, so all are resident) from COOP_MIN_ROWS rows on, where each
    # program reading all of x costs microseconds; otherwise every program reads all of x,
    # so K is split only where that stays cheap (few rows; blockwise needs no amax pass).
    programs = -(-m // block_m) * tiles_n * split
    together = (
        mode != _X_BLOCK
        and m >= COOP_MIN_ROWS
        and not interpret  # (the interpreter runs programs one after another: no barrier)
        and programs <= _sm_count(x.device)
        and (mode == _X_TENSOR or m <= _COOP_BANK)
    )
    if not together and m > _SPLIT_MAX_M and mode != _X_BLOCK:
        split = 1
    grid = (-(-m // block_m), tiles_n, split)
    coop_k = coop_iters = 1
    if together:
        per_row = -(-grid[0] * grid[1] * grid[2] // m)  # pieces per row: about one per program
        coop_k = min(max(16, fp8_weight._next_pow2(-(-k // per_row))), COOP_MAX_PIECE)
        coop_iters = -(-m * -(-k // coop_k) // (grid[0] * grid[1] * grid[2]))
    # the amax pass: one-row tiles for a one-row x, else this program's BLOCK_M rows
    amax_m = 1 if m == 1 else block_m
    width = AMAX_ROW_TILE if m == 1 else AMAX_TILE // amax_m
    amax_k = min(fp8_weight._next_pow2(k), max(16, width))
    amax_tiles = -(-k // amax_k)
    unroll = min(AMAX_UNROLL, amax_tiles)
    tail = (
        m, n, k, x.stride(0), x.stride(1), weight.stride(0), weight.stride(1),
        *(*weight_scale.stride(), 0, 0)[:2], n,
        mode, weight.dtype == torch.float8_e5m2, has_bias, fp8_max("float8_e4m3fn"),
        FLOAT32_MAX, fp8_weight._TINY_BITS,
        fp8_weight._conversion("float8_e4m3fn", x.device, None),
        min(tiles.get("imprecise_k", _IMPRECISE_K), block_k),
        block_m, block_n, block_k, amax_m, amax_k, unroll,
        -(-m // amax_m) if mode == _X_TENSOR else 1, -(-amax_tiles // unroll),
        -(-steps // split), split, together, coop_k, coop_iters, _COOP_BANK,
    )  # fmt: skip
    options: dict[str, Any] = {"num_warps": tiles["num_warps"], "num_stages": tiles["num_stages"]}
    if together:
        options["launch_cooperative_grid"] = True
    return grid, split, 2 + 2 * _COOP_BANK if together else 0, tail, options


def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 0
    index = device.index if device.index is not None else torch.cuda.current_device()
    return fp8_weight._sm_count(index)


_PLANS: dict[Any, tuple[tuple[int, int, int], int, int, tuple[Any, ...], dict[str, Any]]] = {}
"""Launch plans by shapes, strides, dtypes, recipe, tiles and device (computed once each)."""


def _launch(
    x: Tensor,
    weight: Tensor,
    weight_scale: Tensor,
    bias: Tensor | None,
    recipe: str,
    interpret: bool,
) -> Tensor:
    """The launch, arguments already checked (``TorchFP8Linear`` calls this directly)."""
    (m, k), n = x.shape, weight.shape[0]
    device = x.device
    out = torch.empty((m, n), dtype=x.dtype, device=device)
    if m == 0 or n == 0:
        return out
    if k == 0:
        return out.copy_(bias.expand(m, n)) if bias is not None else out.zero_()
    if interpret:
        x = x.float()  # (the interpreter's own widening flushes subnormals)
    key = (
        x.shape, x.stride(), x.dtype, weight.shape, weight.stride(), weight.dtype,
        weight_scale.stride(), None if bias is None else bias.dtype, recipe, device, interpret,
        tuple((ONE_ROW_TILES if m == 1 else TILES)[recipe].items()),
        AMAX_TILE, AMAX_ROW_TILE, AMAX_UNROLL, _BLOCK_M_ONE_ROW, COOP_MIN_ROWS, COOP_MAX_PIECE,
    )  # fmt: skip
    plan = _PLANS.get(key)
    if plan is None:
        plan = _PLANS[key] = _plan(x, weight, weight_scale, bias is not None, recipe, interpret)
    grid, split, sync_words, tail, options = plan
    guard, index = launch_device(device)
    with guard:
        if split > 1 or sync_words:
            part, counts, sync = _workspace(
                device, index, split * m * n if split > 1 else 0, grid[0] * grid[1], sync_words
            )
        else:  # neither split-K nor the shared amax: no workspace (nothing reads these)
            part = counts = sync = out
        args = (
            x, weight, weight_scale, bias if bias is not None else weight_scale, out, part,
            counts, sync, *tail,
        )  # fmt: skip
        aligned = tuple(a.data_ptr() % 16 == 0 for a in args[:8])
        _launcher(interpret)((key, aligned), grid, args, options, index)
    return out
