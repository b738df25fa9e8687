# ruff: noqa: RUF005  (Triton's code generator builds tuples by concatenation, not unpacking)
"""Triton sources of the NVFP4 activation packer (every recipe) and the emulated W4A-NVFP4 GEMM.

Imported by :mod:`floatxq.kernels.nvfp4` on the first launch, never at ``import floatxq`` (this
module imports Triton); :data:`INTERPRETED` records whether ``triton.jit`` chose the
interpreter. ``@no_type_check`` keeps the test run's jaxtyping hook off the functions.

The packer reproduces :func:`floatxq.nvfp4_block_scales` bit for bit. It is compiled with
``enable_fp_fusion=False`` (no multiply-add contraction: the reference rounds every product and
sum) and ``enable_reflect_ftz=False`` (IEEE division keeps subnormals). Two exact rewrites keep
it cheap:

* E2M1 rounding of ``r = fl(v / e)`` is one magic-number addition: ``(r + M) - M`` with
  ``M = 1.5 · 2**(E + 22)`` rounds ``r`` to the spacing ``2**(E - 1)`` of its binade ``[2**E,
  2**(E+1))`` (``E >= 0``; below 1 the spacing of ``[1, 2)``, 0.5, applies), nearest-even: the
  same thresholds ``> 0.25, >= 0.75, > 1.25, >= 1.75, > 2.5, >= 3.5, > 5`` as the reference's
  comparisons, after clamping to 6.
* ``exhaustive`` evaluates, per block, only the E4M3 codes whose SSE can be below the seeds'
  (a window around the block's amax): a code whose scale maps the amax far above 6 or below 0.5
  has an SSE term of that element alone above the seeds' SSE (the bound and its margins are at
  :func:`scan_window`), so skipping it cannot change the first minimum.
"""

from typing import no_type_check

import triton
import triton.language as tl
from triton import knobs

from floatxq.kernels._fp8_weight_jit import fp8_encode
from floatxq.kernels._w4a_jit import split_k_reduce, tile_of, unpack_fields
from floatxq.kernels._w4a_words_jit import centered_slice

__all__ = ["INTERPRETED", "nvfp4_global_scale_kernel", "nvfp4_pack_kernel", "w4a_nvfp4_kernel"]

INTERPRETED: bool = bool(knobs.runtime.interpret)
"""Whether the functions below were jitted for the interpreter (``TRITON_INTERPRET=1``)."""


@triton.jit
@no_type_check
def tree16(c):
    """Sum of the 16-tuple ``c`` in the fixed order (i, i+8), (i, i+4), (i, i+2), (i, i+1): the
    reference's ``_tree_sum16``."""
    s = ()
    for i in tl.static_range(8):
        s = s + (c[i] + c[i + 8],)
    t = ()
    for i in tl.static_range(4):
        t = t + (s[i] + s[i + 4],)
    return (t[0] + t[2]) + (t[1] + t[3])


@triton.jit
@no_type_check
def choose(take, a, b):
    """``where(take, a[j], b[j])`` for each of the 16 columns."""
    out = ()
    for j in tl.static_range(16):
        out = out + (tl.where(take, a[j], b[j]),)
    return out


@triton.jit
@no_type_check
def e4m3_value(bits):
    """FP32 value of E4M3 codes ``bits`` (int32, 0..126: positive finite)."""
    e = bits >> 3
    m = bits & 7
    normal = (((e + 120) << 23) | (m << 20)).to(tl.float32, bitcast=True)
    return tl.where(e == 0, m.to(tl.float32) * 0.001953125, normal)


@triton.jit
@no_type_check
def e4m3_bits(t):
    """E4M3 code (int32) of FP32 ``t`` in ``[2**-9, 448]``, nearest-even."""
    return fp8_encode(t, 2, 3, 7, False).to(tl.int32) & 0xFF


@triton.jit
@no_type_check
def clamped_scale_bits(t, valid):
    """The reference's ``_clamped_scale``: E4M3 of ``clamp(t, 2**-9, 448)`` where ``valid``,
    else of 1 (code 0x38)."""
    c = tl.where(t < 0.001953125, 0.001953125, tl.where(t > 448.0, 448.0, t))
    return tl.where(valid, e4m3_bits(c), 0x38)


@triton.jit
@no_type_check
def e2m1_round(r):
    """Nearest E2M1 magnitude of ``r >= 0`` (ties to even, saturating at 6; NaN gives 0 as the
    reference's comparisons do)."""
    rc = tl.where(r <= 6.0, r, tl.where(r > 6.0, 6.0, 0.0))
    binade = tl.maximum(rc.to(tl.int32, bitcast=True) & 0x7F800000, 0x3F800000)
    magic = (binade + 0x0B400000).to(tl.float32, bitcast=True)  # 1.5 * 2**(E + 22)
    return (rc + magic) - magic


@triton.jit
@no_type_check
def evaluate(v, scale, g):
    """``(values, sse)`` of block scales ``scale`` on the 16 magnitude columns ``v``: the
    reference's ``_evaluate`` (``e = scale·g``; ``q = e2m1(v / e)``; ``sum((q·e - v)**2)``)."""
    e = scale * g
    q = ()
    sq = ()
    for j in tl.static_range(16):
        qj = e2m1_round(tl.math.div_rn(v[j], e))
        d = qj * e - v[j]
        q = q + (qj,)
        sq = sq + (d * d,)
    return q, tree16(sq)


@triton.jit
@no_type_check
def least_squares_bits(v, q, g):
    """The closed-form least-squares scale of the assignment ``q`` (reference
    ``_least_squares_scale``), as an E4M3 code."""
    qq = ()
    vq = ()
    for j in tl.static_range(16):
        qq = qq + (q[j] * q[j],)
        vq = vq + (v[j] * q[j],)
    den = tree16(qq)
    opt = tl.math.div_rn(tree16(vq), tl.maximum(den, 1.0))
    return clamped_scale_bits(tl.math.div_rn(opt, g), den > 0)


@triton.jit
@no_type_check
def scan_window(amax, best_e, g, windowed):
    """``(first, last)`` E4M3 codes bounding every code whose SSE can be below ``best_e``.

    With ``R = 1.05·sqrt(best_e)``: a scale ``e < 0.98·(amax - R)/6`` saturates the amax to 6
    and leaves it more than ``R`` away; a scale ``e > 2.04·(amax + R)`` maps the amax to 0.5
    (more than ``R`` away) or to 0 (``amax > 1.06·R``: away by the amax itself). Either way that
    element's squared error alone exceeds ``best_e`` after FP32 rounding (the margins cover the
    ~1e-7 relative error of the products, the square root and the division by ``g``), and an
    FP32 sum of non-negative terms is never below any of them. One code more on each side covers
    the nearest-even conversion of the bounds. Where the arithmetic is not safe (``windowed``
    false: extreme global scales, non-finite ``best_e``, an all-zero block) the window is every
    code, 1..126.
    """
    r = tl.sqrt(best_e) * 1.05
    ok = windowed & (best_e < 3.0e38) & (amax > 0.0)
    low_t = (amax - r) * (0.98 / 6.0) / g
    first = tl.where(low_t > 0.001953125, e4m3_bits(tl.minimum(low_t, 448.0)) - 1, 1)
    high_t = (amax + r) * 2.04 / g
    last = tl.where(high_t < 448.0, e4m3_bits(tl.maximum(high_t, 0.001953125)) + 1, 126)
    last = tl.where(amax > r * 1.01, last, 126)
    first = tl.where(ok, tl.maximum(first, 1), 1)
    last = tl.where(ok, tl.minimum(last, 126), 126)
    return first, last


@triton.jit
@no_type_check
def nvfp4_global_scale_kernel(
    x_ptr,
    bits_ptr,
    g_ptr,
    words_ptr,
    M,
    K,
    stride_xm,
    stride_xk,
    DIVISOR: tl.constexpr,
    GRID: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """The FP32 global scale of one NVFP4 activation into ``g_ptr[0]``: the value whose bits
    ``bits_ptr[0]`` (int32) holds, or while they are 0 :func:`floatxq.nvfp4_dynamic_global_scale`
    of ``x`` ``(M, K)``, bit for bit.

    Each program takes the largest ``|x|`` bit pattern of its ``BLOCK_R × BLOCK_K`` tile (no
    flush; NaN above infinity, as ``amax`` propagates it) into ``words_ptr[0]`` with an atomic
    maximum, then counts itself in ``words_ptr[1]``; the last to arrive takes the maximum, sets
    both words back to 0 (the workspace is left as it was found) and divides it by ``448 ·
    DIVISOR`` (IEEE, at least FP32's smallest subnormal, 1 for 0 or NaN), rounding it through
    ``GRID`` (0 FP32, 1 FP16, 2 BF16; a value that rounds to 0 keeps its FP32 value). A stored
    scale skips the loads.
    """
    programs = tl.num_programs(0) * tl.num_programs(1)
    stored = tl.load(bits_ptr)
    if stored == 0:
        rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
        cols = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
        ok = (rows < M)[:, None] & (cols < K)[None, :]
        offs = rows.to(tl.int64)[:, None] * stride_xm + cols.to(tl.int64)[None, :] * stride_xk
        v = tl.abs(tl.load(x_ptr + offs, mask=ok, other=0.0).to(tl.float32))
        tl.atomic_max(words_ptr, tl.max(tl.max(v.to(tl.int32, bitcast=True), axis=1), axis=0))
    if tl.atomic_add(words_ptr + 1, 1) == programs - 1:  # the last program: the scale
        amax = tl.atomic_xchg(words_ptr, 0).to(tl.float32, bitcast=True)
        tl.atomic_xchg(words_ptr + 1, 0)
        tiniest = tl.full([], 1, tl.int32).to(tl.float32, bitcast=True)  # (a literal is FP64)
        quotient = tl.maximum(tl.math.div_rn(amax, 448.0 * DIVISOR), tiniest)
        scale = tl.where(amax > 0.0, quotient, 1.0)
        if GRID == 1:
            rounded = scale.to(tl.float16).to(tl.float32)
            scale = tl.where(rounded > 0.0, rounded, scale)
        elif GRID == 2:  # nearest-even on the bits (the interpreter has no BF16 rounding)
            b = scale.to(tl.int32, bitcast=True)
            b = ((b + 0x7FFF + ((b >> 16) & 1)) >> 16) << 16  # (b >= 0: the scale is positive)
            rounded = b.to(tl.float32, bitcast=True)
            scale = tl.where(rounded > 0.0, rounded, scale)
        tl.store(g_ptr, tl.where(stored == 0, scale, stored.to(tl.float32, bitcast=True)))


@triton.jit
@no_type_check
def nvfp4_pack_kernel(
    x_ptr,
    g_ptr,
    packed_ptr,
    scales_ptr,
    M,
    K,
    padded_rows,
    stride_xm,
    stride_xk,
    LOCAL: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    """Rows ``[pid·BLOCK_R, +BLOCK_R)`` of K group ``program_id(1)`` of
    :func:`floatxq.nvfp4_pack_swizzled`.

    ``LOCAL``: 0 ``nvidia``, 1 ``four_six``, 2 ``least_squares``, 3 ``least_squares_grid``,
    4 ``exhaustive``. Codes go to ``packed_ptr`` (uint8 ``(M, K/2)``, even K in the low
    nibble), E4M3 scales to their ``SWIZZLE_32_4_4`` slots of group ``g`` in ``scales_ptr``
    (``(K/128, padded_rows·8)``); rows ``>= M`` (padding) store scale 0 and no codes. A block
    holding NaN or infinity, or a global scale that is not positive and finite, stores the NaN
    scale 0x7F (nothing decodes to a finite wrong value). Each lane owns whole 16-value blocks
    (their 16 columns held as a tuple), so the search never moves data between threads.
    """
    NB: tl.constexpr = BLOCK_R * 8
    pid_r = tl.program_id(0)
    grp = tl.program_id(1)
    blk = tl.arange(0, NB)
    rows = pid_r * BLOCK_R + blk // 8
    col = blk % 8
    r_ok = rows < M
    slot = ((rows // 128) * 1024 + (col // 4) * 512 + (rows % 32) * 16
            + ((rows % 128) // 32) * 4 + (col % 4))  # fmt: skip
    s_ptrs = scales_ptr + grp.to(tl.int64) * padded_rows * 8 + slot
    if pid_r * BLOCK_R >= M:  # padding rows only: scale 0, no codes, no search
        tl.store(s_ptrs, tl.zeros([NB], dtype=tl.uint8))
        return
    base = x_ptr + rows.to(tl.int64) * stride_xm + (grp * 128 + col * 16).to(tl.int64) * stride_xk
    v = ()
    negative = tl.zeros([NB], dtype=tl.int32)  # bit j: element j < 0 (its code's sign)
    top = tl.zeros([NB], dtype=tl.int32)  # amax over the bit patterns: no flush, NaN on top
    for c in tl.static_range(16):  # column c of every block (from L1 after the first)
        xc = tl.load(base + c * stride_xk, mask=r_ok, other=0.0).to(tl.float32)
        vc = tl.abs(xc)
        v = v + (vc,)
        negative = negative | tl.where(xc < 0.0, 1 << c, 0)
        top = tl.maximum(top, vc.to(tl.int32, bitcast=True))
    g = tl.load(g_ptr).to(tl.float32)
    g_ok = (g > 0.0) & (g <= 3.4028234663852886e38)
    amax = top.to(tl.float32, bitcast=True)
    live = top > 0
    if LOCAL == 0:
        best_b = clamped_scale_bits(tl.math.div_rn(amax, g * 6.0), live)
        best_q, best_e = evaluate(v, e4m3_value(best_b), g)
    else:
        b4 = clamped_scale_bits(tl.math.div_rn(amax, g * 4.0), live)
        q4, e4 = evaluate(v, e4m3_value(b4), g)
        b6 = clamped_scale_bits(tl.math.div_rn(amax, g * 6.0), live)
        q6, e6 = evaluate(v, e4m3_value(b6), g)
        take = e6 < e4  # strict: the first candidate (4) keeps ties
        best_b = tl.where(take, b6, b4)
        best_q = choose(take, q6, q4)
        best_e = tl.where(take, e6, e4)
        if LOCAL == 2 or LOCAL == 3:
            for step in tl.static_range(3):  # the two seeds' assignments, then the best's
                if step == 0:
                    cand_b = least_squares_bits(v, q4, g)
                elif step == 1:
                    cand_b = least_squares_bits(v, q6, g)
                else:
                    cand_b = least_squares_bits(v, best_q, g)
                cq, ce = evaluate(v, e4m3_value(cand_b), g)
                take = ce < best_e
                best_b = tl.where(take, cand_b, best_b)
                best_q = choose(take, cq, best_q)
                best_e = tl.where(take, ce, best_e)
        if LOCAL == 3:  # the 17 codes around the least-squares winner, ascending
            center = best_b
            for off in range(-8, 9):
                cand_b = tl.minimum(tl.maximum(center + off, 1), 126)
                cq, ce = evaluate(v, e4m3_value(cand_b), g)
                take = ce < best_e
                best_b = tl.where(take, cand_b, best_b)
                best_q = choose(take, cq, best_q)
                best_e = tl.where(take, ce, best_e)
        if LOCAL == 4:  # every code that can beat the seeds, ascending
            gb = amax * 0.0 + g  # (per block: scalar booleans do not combine in the interpreter)
            windowed = (gb >= 7.7e-34) & (gb <= 1.2e30)  # 2**-110 .. 2**100
            first, last = scan_window(amax, best_e, g, windowed)
            width = tl.max(last - first, axis=0)
            for w in range(0, 126):  # (a loop bounded by `width` does not interpret)
                if w <= width:
                    cand_b = first + w
                    cq, ce = evaluate(v, e4m3_value(tl.minimum(cand_b, 126)), g)
                    take = (cand_b <= last) & (ce < best_e)
                    best_b = tl.where(take, cand_b, best_b)
                    best_q = choose(take, cq, best_q)
                    best_e = tl.where(take, ce, best_e)
    # codes: E2M1 index from the value's bits, the input's sign; two per byte, even K low
    p_row = packed_ptr + rows.to(tl.int64) * (K // 2) + grp * 64 + col * 8
    for i in tl.static_range(8):
        byte = 0
        for h in tl.static_range(2):
            q = best_q[2 * i + h]
            qb = q.to(tl.int32, bitcast=True)
            index = tl.where(q == 0.0, 0, tl.where(q == 0.5, 1, (qb >> 22) - 252))
            code = index | (((negative >> (2 * i + h)) & 1) << 3)
            byte = byte | (code << (4 * h))
        tl.store(p_row + i, byte.to(tl.uint8), mask=r_ok)
    # scale of (row, block) in this group's SWIZZLE_32_4_4 tile; padding rows hold 0
    bits = tl.where(top < 0x7F800000, best_b, 0x7F)
    bits = tl.where(g_ok, bits, 0x7F)
    tl.store(s_ptrs, tl.where(r_ok, bits, 0).to(tl.uint8))


@triton.jit
@no_type_check
def decoded_activation(c_ptr, sc_ptr, offs_m, m_ok, g, padded_rows, stride_cm,
                       BLOCK_M: tl.constexpr, FIRST: tl.constexpr = 0,
                       WIDTH: tl.constexpr = 128):  # fmt: skip
    """``(BLOCK_M, 128)`` FP16 values ``e2m1(code) · block_scale`` of K group ``g`` (no global
    scale): exact, as each has at most 6 significant bits between 2**-10 and 2688. Each element
    reads its own byte and scale (repeats come from L1), so no tile is reshaped."""
    kk = FIRST + tl.arange(0, WIDTH)  # (a slice of the group: columns FIRST.. of it)
    rows = offs_m.to(tl.int64)[:, None]
    b = tl.load(c_ptr + rows * stride_cm + (g * 64 + kk // 2)[None, :], mask=m_ok[:, None],
                other=0).to(tl.int32)  # fmt: skip
    codes = (b >> ((kk % 2) * 4)[None, :]) & 0xF  # element 2j in the low nibble
    index = codes & 7
    # FP16 bits of 0, 0.5, 1, 1.5, 2, 3, 4, 6: 0.5 is 0x3800; from 1 on, exponent and one bit
    magnitude = tl.where(
        index < 2, index * 0x3800, (((index >> 1) + 14) << 10) | ((index & 1) << 9)
    )
    value = (magnitude | ((codes & 8) << 12)).to(tl.int16).to(tl.float16, bitcast=True)
    blk = kk // 16
    slot = ((offs_m // 128) * 1024 + (offs_m % 32) * 16 + ((offs_m % 128) // 32) * 4)[:, None] + (
        (blk // 4) * 512 + blk % 4)[None, :]  # fmt: skip
    s = tl.load(sc_ptr + g.to(tl.int64) * padded_rows * 8 + slot, mask=m_ok[:, None], other=0)
    return value * s.to(tl.float8e4nv, bitcast=True).to(tl.float16)


@triton.jit
@no_type_check
def w4a_nvfp4_kernel(
    c_ptr,
    sc_ptr,
    g_ptr,
    ts_ptr,
    w_ptr,
    s_ptr,
    b_ptr,
    out_ptr,
    part_ptr,
    count_ptr,
    M,
    N,
    K,
    padded_rows,
    stride_cm,
    stride_wk,
    stride_wn,
    stride_sg,
    stride_sn,
    stride_om,
    WEIGHT: tl.constexpr,
    ACT_FP16: tl.constexpr,
    HAS_TOKEN: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    GROUP_ITERS: tl.constexpr,
    SPLIT: tl.constexpr,
    GROUP_M: tl.constexpr,
    ASM: tl.constexpr,
):
    """``out[m-tile, n-tile]`` of :func:`floatxq.w4a_nvfp4_linear_prepacked`, emulated.

    The activation is the packed NVFP4 operand (``c_ptr`` uint8 ``(M, K/2)``, swizzled E4M3
    scales at ``sc_ptr``), decoded per 128-wide group to exact FP16 values (without the global
    scale), or (``ACT_FP16``) those values already decoded, FP16 ``(M, K)``. The weight
    (``WEIGHT``) is 0: the int32 GPTQ words ``(K/8, N)`` read as ``code - 8``, 1: the staged
    E4M3 operand ``(K, N)``, 2: the same values in FP16, 3: the int16 decode words ``(K/4, N)``
    (:mod:`floatxq.gptq.decode_words`: four MMAs of 32 rows a group, decoded two weights per
    instruction where ``ASM``); all convert exactly to FP16. Each group
    is one FP16 MMA with a fresh FP32 accumulator (every product exact), then ``total = total +
    partial · scales[g, n]`` in ascending groups (``SPLIT`` > 1: per split, summed in split
    order), then ``· global_scale``, ``· token_scale[m]``, ``+ bias``, one rounding. Compiled
    without FMA contraction, so each of those steps rounds as the reference's.
    """
    pid_k = tl.program_id(1)
    tiles_n = tl.cdiv(N, BLOCK_N)
    pid_m, pid_n = tile_of(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, 128)
    m_ok = offs_m < M
    n_ok = offs_n < N
    w_cols = w_ptr + offs_n.to(tl.int64)[None, :] * stride_wn
    total = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for gi in range(GROUP_ITERS):
        g = pid_k * GROUP_ITERS + gi
        if WEIGHT == 3:  # decode words: a group is 32 word rows, four slices of 32 input rows
            words = tl.load(w_cols + (g * 32 + tl.arange(0, 32)).to(tl.int64)[:, None] * N,
                            mask=n_ok[None, :], other=0)  # fmt: skip
            partial = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            for j in tl.static_range(4):
                a = decoded_activation(c_ptr, sc_ptr, offs_m, m_ok, g, padded_rows, stride_cm,
                                       BLOCK_M, 32 * j, 32)  # fmt: skip
                partial = tl.dot(a, centered_slice(words, j, ASM), partial)
        elif ACT_FP16:  # already decoded (exactly) to FP16, (M, K) row-major
            a = tl.load(c_ptr + offs_m.to(tl.int64)[:, None] * stride_cm
                        + (g * 128 + offs_k)[None, :], mask=m_ok[:, None], other=0.0)  # fmt: skip
        else:
            a = decoded_activation(c_ptr, sc_ptr, offs_m, m_ok, g, padded_rows, stride_cm, BLOCK_M)
        if WEIGHT != 3:
            if WEIGHT == 0:  # sixteen words per column, unpacked in registers to code - 8 (exact)
                rows = g * 16 + tl.arange(0, 16)
                words = tl.load(w_cols + rows.to(tl.int64)[:, None] * stride_wk,
                                mask=n_ok[None, :], other=0)  # fmt: skip
                w = (unpack_fields(words, 4, 128, BLOCK_N) - 8).to(tl.float16)
            else:
                w = tl.load(w_cols + (g * 128 + offs_k).to(tl.int64)[:, None] * stride_wk,
                            mask=n_ok[None, :], other=0)  # fmt: skip
                if WEIGHT == 1:  # the staged E4M3 operand
                    w = w.to(tl.float8e4nv, bitcast=True).to(tl.float16)
            partial = tl.dot(a, w, out_dtype=tl.float32)
        s = tl.load(s_ptr + g * stride_sg + offs_n * stride_sn, mask=n_ok, other=0.0)
        total = total + partial * s.to(tl.float32)[None, :]
    last = True
    if SPLIT > 1:
        tile = pid_m * tiles_n + pid_n
        total, last = split_k_reduce(
            total, part_ptr, count_ptr, tile, pid_k, offs_m, offs_n, M, N, SPLIT, BLOCK_M, BLOCK_N
        )
    if last:
        out = total * tl.load(g_ptr).to(tl.float32)
        if HAS_TOKEN:
            out = out * tl.load(ts_ptr + offs_m, mask=m_ok, other=0.0)[:, None]
        if HAS_BIAS:
            out = out + tl.load(b_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        o_ptrs = out_ptr + offs_m.to(tl.int64)[:, None] * stride_om + offs_n[None, :]
        tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])
