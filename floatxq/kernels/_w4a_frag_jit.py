"""Gluon sources of the fragment-words kernels: W4A16 and W4A-FP8 at decode-sized row counts.

They read the fragment words of :mod:`floatxq.gptq.fragment_words`: per 128-row tile and
16 output columns, each of a warp's 32 lanes loads 16 contiguous int16 words (two 128-bit loads)
that hold exactly the codes it feeds to eight ``mma.sync.m16n8k16`` as the *A* operand, the
weights' transpose (16 output columns × 16 input rows); the few activation rows are the *B*
operand (8, 16 or 32 columns). Decoding never leaves the registers: no shared memory, no layout
shuffles (the conversions to the MMA operand layout are asserted trivial at compile time). Each
32-bit register decodes two weights with packed 16-bit instructions (magic-number OR, exact
subtract of the bias and zero point, the exact scale product rounded once), as the words kernels
do. The next tile's words, scales and activations load while the current tile computes; K splits
over ``program_id(1)`` and the splits are summed in split order by the last one to finish (the
same bits on every run).

Gluon (Triton's layout-explicit dialect) has no interpreter: these run on CUDA GPUs of compute
capability 8.0 or later only; :mod:`floatxq.dispatch` never routes to them elsewhere. Imported on
the first launch, never at ``import floatxq``. ``@no_type_check`` keeps the test run's
jaxtyping hook off the functions.
"""

from typing import no_type_check

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import mma_v2

__all__ = ["w4a16_frag_kernel", "w4a_fp8_frag_kernel"]

# {shift}: the nibble's bit offset; the mask keeps one nibble of each 16-bit half and the OR sets
# the half's exponent so it reads MAGIC + code (bf16: 128 + code, fp16: 1024 + code). $2 holds
# MAGIC + zero (exact), $3 / $4 the scale's two parts (``fma(d, hi, d · lo)``: one rounding).
_LO = (
    "{{ .reg .b32 t, d, p; shr.b32 t, $1, {shift}; "
    "lop3.b32 t, t, 0x000F000F, {magic}, 0xEA; sub.rn.{ty} d, t, $2; "
    "mul.rn.{ty} p, d, $4; fma.rn.{ty} $0, d, $3, p; }}"
)
_NO_LO = (
    "{{ .reg .b32 t, d; shr.b32 t, $1, {shift}; "
    "lop3.b32 t, t, 0x000F000F, {magic}, 0xEA; sub.rn.{ty} d, t, $2; "
    "mul.rn.{ty} $0, d, $3; }}"
)
_CENTERED = (
    "{{ .reg .b32 t, c; shr.b32 t, $1, {shift}; "
    "lop3.b32 t, t, 0x000F000F, 0x64006400, 0xEA; mov.b32 c, 0x64086408; "
    "sub.rn.f16x2 $0, t, c; }}"
)
_BF = {"magic": "0x43004300", "ty": "bf16x2"}
_FP = {"magic": "0x64006400", "ty": "f16x2"}
BF_LO_0 = gl.constexpr(_LO.format(shift=0, **_BF))
BF_LO_1 = gl.constexpr(_LO.format(shift=4, **_BF))
BF_LO_2 = gl.constexpr(_LO.format(shift=8, **_BF))
BF_LO_3 = gl.constexpr(_LO.format(shift=12, **_BF))
BF_0 = gl.constexpr(_NO_LO.format(shift=0, **_BF))
BF_1 = gl.constexpr(_NO_LO.format(shift=4, **_BF))
BF_2 = gl.constexpr(_NO_LO.format(shift=8, **_BF))
BF_3 = gl.constexpr(_NO_LO.format(shift=12, **_BF))
FP_LO_0 = gl.constexpr(_LO.format(shift=0, **_FP))
FP_LO_1 = gl.constexpr(_LO.format(shift=4, **_FP))
FP_LO_2 = gl.constexpr(_LO.format(shift=8, **_FP))
FP_LO_3 = gl.constexpr(_LO.format(shift=12, **_FP))
FP_0 = gl.constexpr(_NO_LO.format(shift=0, **_FP))
FP_1 = gl.constexpr(_NO_LO.format(shift=4, **_FP))
FP_2 = gl.constexpr(_NO_LO.format(shift=8, **_FP))
FP_3 = gl.constexpr(_NO_LO.format(shift=12, **_FP))
CT_0 = gl.constexpr(_CENTERED.format(shift=0))
CT_1 = gl.constexpr(_CENTERED.format(shift=4))
CT_2 = gl.constexpr(_CENTERED.format(shift=8))
CT_3 = gl.constexpr(_CENTERED.format(shift=12))


@gluon.jit
@no_type_check
def _asm4(asm: gl.constexpr, words, zz, hh, ll, DT: gl.constexpr):
    if DT == gl.bfloat16:
        w = gl.inline_asm_elementwise(asm, "=r,r,r,r,r", [words, zz, hh, ll], dtype=gl.bfloat16,
                                      is_pure=True, pack=2)  # fmt: skip
    else:
        w = gl.inline_asm_elementwise(asm, "=r,r,r,r,r", [words, zz, hh, ll], dtype=gl.float16,
                                      is_pure=True, pack=2)  # fmt: skip
    return w


@gluon.jit
@no_type_check
def _decode(words, zz, hh, ll, J: gl.constexpr, DT: gl.constexpr, HAS_LO: gl.constexpr):
    """Nibble ``J`` of every word, decoded: ``round(hi·d + lo·d)`` with ``d = code - zero``."""
    if DT == gl.bfloat16:
        if HAS_LO:
            if J == 0:
                w = _asm4(BF_LO_0, words, zz, hh, ll, DT)
            elif J == 1:
                w = _asm4(BF_LO_1, words, zz, hh, ll, DT)
            elif J == 2:
                w = _asm4(BF_LO_2, words, zz, hh, ll, DT)
            else:
                w = _asm4(BF_LO_3, words, zz, hh, ll, DT)
        else:
            if J == 0:
                w = _asm4(BF_0, words, zz, hh, ll, DT)
            elif J == 1:
                w = _asm4(BF_1, words, zz, hh, ll, DT)
            elif J == 2:
                w = _asm4(BF_2, words, zz, hh, ll, DT)
            else:
                w = _asm4(BF_3, words, zz, hh, ll, DT)
    else:
        if HAS_LO:
            if J == 0:
                w = _asm4(FP_LO_0, words, zz, hh, ll, DT)
            elif J == 1:
                w = _asm4(FP_LO_1, words, zz, hh, ll, DT)
            elif J == 2:
                w = _asm4(FP_LO_2, words, zz, hh, ll, DT)
            else:
                w = _asm4(FP_LO_3, words, zz, hh, ll, DT)
        else:
            if J == 0:
                w = _asm4(FP_0, words, zz, hh, ll, DT)
            elif J == 1:
                w = _asm4(FP_1, words, zz, hh, ll, DT)
            elif J == 2:
                w = _asm4(FP_2, words, zz, hh, ll, DT)
            else:
                w = _asm4(FP_3, words, zz, hh, ll, DT)
    return w


@gluon.jit
@no_type_check
def _centered(words, J: gl.constexpr):
    """Nibble ``J`` of every word as ``code - 8`` in float16 (exact)."""
    if J == 0:
        asm: gl.constexpr = CT_0
    elif J == 1:
        asm: gl.constexpr = CT_1
    elif J == 2:
        asm: gl.constexpr = CT_2
    else:
        asm: gl.constexpr = CT_3
    return gl.inline_asm_elementwise(asm, "=r,r", [words], dtype=gl.float16, is_pure=True,
                                     pack=2)  # fmt: skip


@gluon.jit
@no_type_check
def _operand(d, LA: gl.constexpr, NU: gl.constexpr):
    """A ``(NU, 32, 2, 8)`` decoded slice as the MMA's ``(16·NU, 32)`` A operand: lane
    ``(g, t)``, half ``r`` and element ``(s, h, p)`` hold row ``16u + 8r + g``, column
    ``16s + 8h + 2t + p`` (a relabelling of registers: asserted free)."""
    d = gl.reshape(d, [NU, 8, 4, 2, 2, 2, 2])
    d = gl.permute(d, [0, 3, 1, 4, 5, 2, 6])
    return gl.convert_layout(gl.reshape(d, [16 * NU, 32]), LA, assert_trivial=True)


@gluon.jit
@no_type_check
def _part(part_ptr, s, MN, p_offs, p_mask, SPLIT: gl.constexpr):
    """Split ``s``'s stored tile (``-0.0``, the identity of addition, past the last split)."""
    return gl.load(part_ptr + s * MN + p_offs, mask=p_mask & (s < SPLIT), other=-0.0,
                   cache_modifier=".cg")  # fmt: skip


@gluon.jit
@no_type_check
def _finish(acc, part_ptr, count_ptr, tile, pid_k, o_n, o_m, M, N, SPLIT: gl.constexpr,
            CHUNK: gl.constexpr):  # fmt: skip
    """Split-K: store this split's FP32 tile; the last split of the tile to arrive sums all of
    them in split order (``CHUNK`` loads in flight), resets the counter and returns
    ``(sum, True)``."""
    last = True
    if SPLIT > 1:
        p_offs = o_m.to(gl.int64)[None, :] * N + o_n[:, None]
        p_mask = (o_m < M)[None, :] & (o_n < N)[:, None]
        gl.store(part_ptr + pid_k.to(gl.int64) * M * N + p_offs, acc, mask=p_mask)
        gl.thread_barrier()  # every thread's partial is written before the counter moves
        arrived = gl.atomic_add(count_ptr + tile, 1, sem="acq_rel", scope="gpu")
        last = arrived == SPLIT - 1
        if last:
            gl.thread_barrier()
            acc = gl.zeros_like(acc)
            MN = M * N
            CH: gl.constexpr = CHUNK if SPLIT > CHUNK else SPLIT
            for s0 in range(0, SPLIT, CH):
                for j in gl.static_range(CH):
                    acc += _part(part_ptr, s0 + j, MN, p_offs, p_mask, SPLIT)
            gl.atomic_xchg(count_ptr + tile, 0, sem="relaxed", scope="gpu")
    return acc, last


@gluon.jit
@no_type_check
def _ld(ptrs, mask, EVEN: gl.constexpr):
    """``ptrs`` loaded, masked (zeros elsewhere) unless ``EVEN`` says every lane is in bounds."""
    if EVEN:
        v = gl.load(ptrs)
    else:
        v = gl.load(ptrs, mask=mask, other=0)
    return v


@gluon.jit
@no_type_check
def _x_tile(ptrs, t, ks, K, EVEN_K: gl.constexpr):
    """The activations' B operands of the four 32-row slices of tile ``t``."""
    kk = t * 128
    if EVEN_K:
        x0 = gl.load(ptrs + kk)
        x1 = gl.load(ptrs + (kk + 32))
        x2 = gl.load(ptrs + (kk + 64))
        x3 = gl.load(ptrs + (kk + 96))
    else:
        x0 = gl.load(ptrs + kk, mask=(kk + ks < K)[:, None], other=0)
        x1 = gl.load(ptrs + (kk + 32), mask=(kk + 32 + ks < K)[:, None], other=0)
        x2 = gl.load(ptrs + (kk + 64), mask=(kk + 64 + ks < K)[:, None], other=0)
        x3 = gl.load(ptrs + (kk + 96), mask=(kk + 96 + ks < K)[:, None], other=0)
    return x0, x1, x2, x3


@gluon.jit
@no_type_check
def _pick(x0, x1, x2, x3, J: gl.constexpr):
    if J == 0:
        v = x0
    elif J == 1:
        v = x1
    elif J == 2:
        v = x2
    else:
        v = x3
    return v


@gluon.jit
@no_type_check
def _tile_scales(z_ptr, hi_ptr, lo_ptr, t, J: gl.constexpr, cols, c_ok, N, GROUP: gl.constexpr,
                 GROUPS, EVEN_N: gl.constexpr):  # fmt: skip
    """The zero points and scale parts of slice ``J`` of tile ``t`` (past the last group: the
    last one), in the words' column layout."""
    g = gl.minimum((t * 128 + J * 32) // GROUP, GROUPS - 1)
    zero = _ld(z_ptr + g * N + cols, c_ok, EVEN_N)
    hi = _ld(hi_ptr + g * N + cols, c_ok, EVEN_N)
    lo = _ld(lo_ptr + g * N + cols, c_ok, EVEN_N)
    return zero, hi, lo


@gluon.jit
@no_type_check
def w4a16_frag_kernel(
    x_ptr,
    w_ptr,
    z_ptr,
    hi_ptr,
    lo_ptr,
    b_ptr,
    out_ptr,
    part_ptr,
    count_ptr,
    M,
    N,
    K,
    GROUPS,
    stride_xm,
    stride_om,
    GROUP: gl.constexpr,
    PER_TILE: gl.constexpr,
    HAS_LO: gl.constexpr,
    HAS_BIAS: gl.constexpr,
    EVEN_K: gl.constexpr,
    EVEN_N: gl.constexpr,
    NU: gl.constexpr,
    MW: gl.constexpr,
    K_ITERS: gl.constexpr,
    SPLIT: gl.constexpr,
    CHUNK: gl.constexpr,
    STAGES: gl.constexpr,
    WARPS: gl.constexpr,
    PREFETCH_X: gl.constexpr = False,
):
    """``out[:, n-block]`` of :func:`floatxq.w4a16_linear` from fragment words: per 128-row
    tile, four slices of 32 input rows, each ``acc(16·NU, MW) += W^T · x^T`` on the tensor
    cores (FP32), the zero points and scale parts of a tile loaded with its words when every
    group spans whole tiles (``PER_TILE``), else per slice; the bias (in ``x``'s dtype) added in
    FP32, one rounding. ``HAS_LO``: the scales' low parts are not all zero. ``EVEN_K`` / ``EVEN_N``:
    no bounds to mask. ``STAGES``: tiles loaded ahead (1 or 2). Rows of ``x`` past ``M`` read
    row ``M - 1`` (their columns of the product are never stored). ``PREFETCH_X``: load the
    next tile's activations with its words (a probe variant, measured slower: off)."""
    DT: gl.constexpr = x_ptr.dtype.element_ty
    MAGIC: gl.constexpr = 128.0 if DT == gl.bfloat16 else 1024.0
    BN: gl.constexpr = 16 * NU
    LW: gl.constexpr = gl.BlockedLayout([1, 1, 2, 8], [1, 32, 1, 1], [WARPS, 1, 1, 1],
                                        [3, 2, 1, 0])  # fmt: skip
    L3: gl.constexpr = gl.SliceLayout(3, LW)
    MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[WARPS, 1],
                                                  instr_shape=[16, 8])  # fmt: skip
    LA: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=2)
    LB: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=MMA, k_width=2)
    pid_n = gl.program_id(0)
    pid_k = gl.program_id(1)
    o_u = gl.arange(0, NU, layout=gl.SliceLayout(1, gl.SliceLayout(2, L3)))
    o_l = gl.arange(0, 32, layout=gl.SliceLayout(0, gl.SliceLayout(2, L3)))
    o_r = gl.arange(0, 2, layout=gl.SliceLayout(0, gl.SliceLayout(1, L3)))
    o_e = gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(2, LW))))
    lanes = (o_u[:, None, None] * 32 + o_l[None, :, None]) * 2 + o_r[None, None, :]
    offs = lanes[:, :, :, None] * 8 + o_e[None, None, None, :]
    u_ok = gl.broadcast((pid_n * NU + o_u < (N + 15) // 16)[:, None, None, None], offs)[0]
    cols = pid_n * BN + o_u[:, None, None] * 16 + o_r[None, None, :] * 8 + o_l[None, :, None] // 4
    c_ok = cols < N
    b_k = gl.arange(0, 32, layout=gl.SliceLayout(1, LB))
    b_m = gl.minimum(gl.arange(0, MW, layout=gl.SliceLayout(0, LB)), M - 1)
    b_ptrs = x_ptr + b_m.to(gl.int64)[None, :] * stride_xm + b_k[:, None]
    tile_words = ((N + 15) // 16) * 512
    t0 = pid_k * K_ITERS
    t_last = t0 + K_ITERS - 1
    w_ptrs = w_ptr + pid_n * NU * 512 + offs
    acc = gl.zeros([BN, MW], gl.float32, layout=MMA)
    words = _ld(w_ptrs + t0.to(gl.int64) * tile_words, u_ok, EVEN_N)
    zero, hi, lo = _tile_scales(z_ptr, hi_ptr, lo_ptr, t0, 0, cols, c_ok, N, GROUP, GROUPS, EVEN_N)
    if STAGES == 2:
        t1 = gl.minimum(t0 + 1, t_last)
        words1 = _ld(w_ptrs + t1.to(gl.int64) * tile_words, u_ok, EVEN_N)
        zero1, hi1, lo1 = _tile_scales(z_ptr, hi_ptr, lo_ptr, t1, 0, cols, c_ok, N, GROUP, GROUPS,
                                       EVEN_N)  # fmt: skip
    if PREFETCH_X:
        x0, x1, x2, x3 = _x_tile(b_ptrs, t0, b_k, K, EVEN_K)
    for it in range(K_ITERS):
        t = t0 + it
        tn = gl.minimum(t + STAGES, t_last)  # (past the split: the last tile again, cached)
        nxt = _ld(w_ptrs + tn.to(gl.int64) * tile_words, u_ok, EVEN_N)
        if PREFETCH_X:
            y0, y1, y2, y3 = _x_tile(b_ptrs, gl.minimum(t + 1, t_last), b_k, K, EVEN_K)
        if PER_TILE:
            zn, hn, ln = _tile_scales(z_ptr, hi_ptr, lo_ptr, tn, 0, cols, c_ok, N, GROUP, GROUPS,
                                      EVEN_N)  # fmt: skip
        for j in gl.static_range(4):
            if j == 0 or not PER_TILE:
                if not PER_TILE:
                    zero, hi, lo = _tile_scales(z_ptr, hi_ptr, lo_ptr, t, j, cols, c_ok, N, GROUP,
                                                GROUPS, EVEN_N)  # fmt: skip
                zc = (zero.to(gl.float32) + MAGIC).to(DT)
                zz = gl.broadcast(zc[:, :, :, None], words)[0]
                hh = gl.broadcast(hi[:, :, :, None], words)[0]
                ll = gl.broadcast(lo[:, :, :, None], words)[0]
            a = _operand(_decode(words, zz, hh, ll, j, DT, HAS_LO), LA, NU)
            kk = t * 128 + j * 32
            if PREFETCH_X:
                b = _pick(x0, x1, x2, x3, j)
            elif EVEN_K:
                b = gl.load(b_ptrs + kk)
            else:
                b = gl.load(b_ptrs + kk, mask=(kk + b_k < K)[:, None], other=0.0)
            acc = mma_v2(a, b, acc)
        if STAGES == 2:
            words = words1
            words1 = nxt
            if PER_TILE:
                zero = zero1
                hi = hi1
                lo = lo1
                zero1 = zn
                hi1 = hn
                lo1 = ln
        else:
            words = nxt
            if PER_TILE:
                zero = zn
                hi = hn
                lo = ln
        if PREFETCH_X:
            x0 = y0
            x1 = y1
            x2 = y2
            x3 = y3
    o_n = pid_n * BN + gl.arange(0, BN, layout=gl.SliceLayout(1, MMA))
    o_m = gl.arange(0, MW, layout=gl.SliceLayout(0, MMA))
    acc, last = _finish(acc, part_ptr, count_ptr, pid_n, pid_k, o_n, o_m, M, N, SPLIT, CHUNK)
    if last:
        if HAS_BIAS:  # (the bias in x's dtype, as the reference adds it)
            bias = gl.load(b_ptr + o_n, mask=o_n < N, other=0.0).to(DT)
            acc += bias.to(gl.float32)[:, None]
        o_ptrs = out_ptr + o_m.to(gl.int64)[None, :] * stride_om + o_n[:, None]
        gl.store(o_ptrs, acc.to(DT), mask=(o_m < M)[None, :] & (o_n < N)[:, None])


@gluon.jit
@no_type_check
def _grid_dependency_wait():
    """``griddepcontrol.wait``: block until the grids this launch depends on have finished and
    their writes are visible (a no-op when it was launched without that dependency)."""
    gl.inline_asm_elementwise("griddepcontrol.wait; // $0", "=r", [], dtype=gl.int32,
                              is_pure=False, pack=1)  # fmt: skip


@gluon.jit
@no_type_check
def w4a_fp8_frag_kernel(
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
    HAS_BIAS: gl.constexpr,
    EVEN_K: gl.constexpr,
    EVEN_N: gl.constexpr,
    NU: gl.constexpr,
    MW: gl.constexpr,
    K_ITERS: gl.constexpr,
    SPLIT: gl.constexpr,
    CHUNK: gl.constexpr,
    STAGES: gl.constexpr,
    WARPS: gl.constexpr,
    PREFETCH_X: gl.constexpr = False,
    WAIT: gl.constexpr = False,
):
    """``out[:, n-block]`` of :func:`floatxq.w4a_fp8_linear_prepacked` from fragment words:
    each 128-row group is one tile, four products of ``code - 8`` (float16, exact) and 32 rows
    of E4M3 codes (converted to float16 exactly) into a fresh FP32 accumulator, then ``total +=
    partial · scales[g, n]`` in ascending groups (split over ``program_id(1)``, reduced in split
    order), the token scale, the bias, one rounding. ``PREFETCH_X``: as in
    :func:`w4a16_frag_kernel`. ``WAIT`` (SM 9.0+): launched dependent on the token packing, it
    loads its first weight tiles, then waits for that launch to end before reading tokens."""
    BN: gl.constexpr = 16 * NU
    LW: gl.constexpr = gl.BlockedLayout([1, 1, 2, 8], [1, 32, 1, 1], [WARPS, 1, 1, 1],
                                        [3, 2, 1, 0])  # fmt: skip
    MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[WARPS, 1],
                                                  instr_shape=[16, 8])  # fmt: skip
    LA: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=2)
    LB: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=MMA, k_width=2)
    L3: gl.constexpr = gl.SliceLayout(3, LW)
    pid_n = gl.program_id(0)
    pid_k = gl.program_id(1)
    o_u = gl.arange(0, NU, layout=gl.SliceLayout(1, gl.SliceLayout(2, L3)))
    o_l = gl.arange(0, 32, layout=gl.SliceLayout(0, gl.SliceLayout(2, L3)))
    o_r = gl.arange(0, 2, layout=gl.SliceLayout(0, gl.SliceLayout(1, L3)))
    o_e = gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(2, LW))))
    lanes = (o_u[:, None, None] * 32 + o_l[None, :, None]) * 2 + o_r[None, None, :]
    offs = lanes[:, :, :, None] * 8 + o_e[None, None, None, :]
    u_ok = gl.broadcast((pid_n * NU + o_u < (N + 15) // 16)[:, None, None, None], offs)[0]
    b_k = gl.arange(0, 32, layout=gl.SliceLayout(1, LB))
    b_m = gl.minimum(gl.arange(0, MW, layout=gl.SliceLayout(0, LB)), M - 1)
    b_ptrs = a_ptr + b_m.to(gl.int64)[None, :] * stride_am + b_k[:, None]
    o_n = pid_n * BN + gl.arange(0, BN, layout=gl.SliceLayout(1, MMA))
    o_m = gl.arange(0, MW, layout=gl.SliceLayout(0, MMA))
    n_ok = o_n < N
    s_ptrs = s_ptr + o_n * stride_sn
    tile_words = ((N + 15) // 16) * 512
    t0 = pid_k * K_ITERS
    t_last = t0 + K_ITERS - 1
    w_ptrs = w_ptr + pid_n * NU * 512 + offs
    total = gl.zeros([BN, MW], gl.float32, layout=MMA)
    words = _ld(w_ptrs + t0.to(gl.int64) * tile_words, u_ok, EVEN_N)
    s = _ld(s_ptrs + t0 * stride_sg, n_ok, EVEN_N)
    if STAGES == 2:
        t1 = gl.minimum(t0 + 1, t_last)
        words1 = _ld(w_ptrs + t1.to(gl.int64) * tile_words, u_ok, EVEN_N)
        s1 = _ld(s_ptrs + t1 * stride_sg, n_ok, EVEN_N)
    if WAIT:  # the weights' first tiles above load while the token packing ends
        _grid_dependency_wait()
    if PREFETCH_X:
        x0, x1, x2, x3 = _x_tile(b_ptrs, t0, b_k, K, EVEN_K)
    for it in range(K_ITERS):
        t = t0 + it
        tn = gl.minimum(t + STAGES, t_last)
        nxt = _ld(w_ptrs + tn.to(gl.int64) * tile_words, u_ok, EVEN_N)
        sn = _ld(s_ptrs + tn * stride_sg, n_ok, EVEN_N)
        if PREFETCH_X:
            y0, y1, y2, y3 = _x_tile(b_ptrs, gl.minimum(t + 1, t_last), b_k, K, EVEN_K)
        partial = gl.zeros([BN, MW], gl.float32, layout=MMA)
        for j in gl.static_range(4):
            a = _operand(_centered(words, j), LA, NU)
            kk = t * 128 + j * 32
            if PREFETCH_X:
                codes = _pick(x0, x1, x2, x3, j)
            elif EVEN_K:
                codes = gl.load(b_ptrs + kk)
            else:
                codes = gl.load(b_ptrs + kk, mask=(kk + b_k < K)[:, None], other=0)
            b = codes.to(gl.float8e4nv, bitcast=True).to(gl.float16)
            partial = mma_v2(a, b, partial)
        total += partial * s.to(gl.float32)[:, None]
        if STAGES == 2:
            words = words1
            words1 = nxt
            s = s1
            s1 = sn
        else:
            words = nxt
            s = sn
        if PREFETCH_X:
            x0 = y0
            x1 = y1
            x2 = y2
            x3 = y3
    total, last = _finish(total, part_ptr, count_ptr, pid_n, pid_k, o_n, o_m, M, N, SPLIT, CHUNK)
    if last:
        rs = gl.load(rs_ptr + o_m, mask=o_m < M, other=0.0)
        out = total * rs[None, :]
        if HAS_BIAS:
            out += gl.load(b_ptr + o_n, mask=n_ok, other=0.0).to(gl.float32)[:, None]
        o_ptrs = out_ptr + o_m.to(gl.int64)[None, :] * stride_om + o_n[:, None]
        gl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=(o_m < M)[None, :] & n_ok[:, None])
