# ruff: noqa: B023, E501
"""Probe of the fragment-words kernels (issue 31, second part): Gluon ``mma.sync`` kernels whose
weights are the MMA's register operand, decoded in place (``floatxq/kernels/_w4a_frag_jit.py``).

Usage (GPU): ``python3 benchmarks/w4a_frag_probe.py [--rows 1,2,4,8,16,32] [--shapes 8192x8192]``;
``--quick``: the activations loaded a tile early (``PREFETCH_X``) and the rows kernels (9–32
rows, activations as the A operand), checked and timed in one device call (see :func:`quick`);
both measured slower than the library's kernels (RESULTS.md, issue 31 third part).
For each shape and row count: the anchors in the same run (bf16 ``F.linear``, FP8 ``_scaled_mm``,
GemLite's A16Wn where importable, the library's decode-words kernels), then a sweep of the
fragment kernels' launch shapes (``NU`` column tiles of 16, warps, programs per SM), each checked
against the exact decode before it is timed.
"""

import pathlib
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

import floatxq as fq
from floatxq.gptq.decode_words import DecodeOperands, split_scales, stage_decode_words
from floatxq.kernels._w4a_frag_jit import (
    _centered,
    _decode,
    _ld,
    _tile_scales,
    gl,
    gluon,
    mma_v2,
    no_type_check,
)


def stage_frag(words: torch.Tensor) -> torch.Tensor:
    """Decode words ``(32·T, N)`` → fragment words ``(32·T, N16)``: per tile, ``[u, g, t, r, s,
    h, p]`` holds word row ``16s + 8h + 2t + p`` of column ``16u + 8r + g``."""
    rows, n = words.shape
    n16 = -(-n // 16) * 16
    w = torch.zeros((rows, n16), dtype=torch.int16, device=words.device)
    w[:, :n] = words
    t = rows // 32
    w = w.view(t, 2, 2, 4, 2, n16 // 16, 2, 8)  # t, s, h, tq, p, u, r, g
    return w.permute(0, 5, 7, 3, 6, 1, 2, 4).reshape(rows, n16).contiguous()


_WS: dict = {}


def _ws(numel, tiles, device):
    key = (numel, tiles)
    if key not in _WS:
        _WS[key] = (torch.empty(max(numel, 1), dtype=torch.float32, device=device),
                    torch.zeros(max(tiles, 1), dtype=torch.int32, device=device))  # fmt: skip
    return _WS[key]


def _split(tiles, steps, target, sms):
    fits = [d for d in range(1, steps + 1) if steps % d == 0 and tiles * d <= target * sms]
    return max(fits, default=1)


SMS = None


def w4a16_frag(
    x,
    fw,
    zeros,
    hi,
    lo,
    bias,
    n,
    k,
    group,
    *,
    nu=16,
    warps=4,
    target=3,
    has_lo=True,
    stages=1,
    prefetch_x=False,
):
    from floatxq.kernels._w4a_frag_jit import w4a16_frag_kernel

    global SMS
    SMS = SMS or torch.cuda.get_device_properties(x.device).multi_processor_count
    m = x.shape[0]
    mw = 8 if m <= 8 else (16 if m <= 16 else 32)
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    tiles = -(-n // (16 * nu))
    steps = fw.shape[0] // 32
    split = _split(tiles, steps, target, SMS)
    part, counts = _ws(split * m * n, tiles, x.device)
    per_tile = group >= k or group % 128 == 0
    w4a16_frag_kernel[(tiles, split, 1)](
        x, fw, zeros, hi, lo, bias if bias is not None else hi, out, part, counts, m, n, k,
        zeros.shape[0], x.stride(0), out.stride(0), group, per_tile,
        has_lo, bias is not None,
        k % 128 == 0, n % (16 * nu) == 0, nu, mw, steps // split, split, stages, warps,
        prefetch_x, num_warps=warps,
    )  # fmt: skip
    return out


def w4afp8_frag(codes, row_scale, fw, scales, bias, n, k, out_dtype, *, nu=16, warps=4,
                target=3, stages=1, prefetch_x=False):  # fmt: skip
    from floatxq.kernels._w4a_frag_jit import w4a_fp8_frag_kernel

    global SMS
    SMS = SMS or torch.cuda.get_device_properties(codes.device).multi_processor_count
    m = codes.shape[0]
    mw = 8 if m <= 8 else (16 if m <= 16 else 32)
    out = torch.empty((m, n), dtype=out_dtype, device=codes.device)
    tiles = -(-n // (16 * nu))
    steps = fw.shape[0] // 32
    split = _split(tiles, steps, target, SMS)
    part, counts = _ws(split * m * n, tiles, codes.device)
    w4a_fp8_frag_kernel[(tiles, split, 1)](
        codes.view(torch.uint8), row_scale, fw, scales, bias if bias is not None else scales, out,
        part, counts, m, n, k, codes.stride(0), scales.stride(0), scales.stride(1), out.stride(0),
        bias is not None, k % 128 == 0, n % (16 * nu) == 0, nu, mw, steps // split, split, stages,
        warps, prefetch_x, num_warps=warps,
    )  # fmt: skip
    return out


# The rows kernels (activations as the A operand; unmeasured: the next probe times them).


@gluon.jit
@no_type_check
def _operand_b(d, LB: gl.constexpr, NU: gl.constexpr):
    """A ``(NU, 32, 2, 8)`` decoded slice as the MMA's ``(32, 16·NU)`` B operand in the
    columns' *logical* order ``8·(NU·r + u) + g`` (real column ``16u + 8r + g``), so that each
    warp's column tiles are the ones it loaded (a relabelling of registers: asserted free)."""
    d = gl.reshape(d, [NU, 8, 4, 2, 2, 2, 2])
    d = gl.permute(d, [4, 5, 2, 6, 3, 0, 1])
    return gl.convert_layout(gl.reshape(d, [32, 16 * NU]), LB, assert_trivial=True)


@gluon.jit
@no_type_check
def _real_columns(pid_n, NU: gl.constexpr, layout: gl.constexpr):
    """The real output column of each logical column of :func:`_operand_b`."""
    c = gl.arange(0, 16 * NU, layout=layout)
    return pid_n * 16 * NU + ((c // 8) % NU) * 16 + (c // (8 * NU)) * 8 + c % 8


@gluon.jit
@no_type_check
def w4a16_frag_rows_kernel(
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
    BM: gl.constexpr,
    K_ITERS: gl.constexpr,
    SPLIT: gl.constexpr,
    STAGES: gl.constexpr,
    WARPS: gl.constexpr,
):
    """:func:`w4a16_frag_kernel` with the activations as the MMA's A operand (``BM`` = 16 or
    32 rows a program, ``program_id(0)`` over row blocks × column blocks): the shape for 9 to
    32 rows, the same words, numerics and split-K."""
    DT: gl.constexpr = x_ptr.dtype.element_ty
    MAGIC: gl.constexpr = 128.0 if DT == gl.bfloat16 else 1024.0
    BN: gl.constexpr = 16 * NU
    LW: gl.constexpr = gl.BlockedLayout([1, 1, 2, 8], [1, 32, 1, 1], [WARPS, 1, 1, 1],
                                        [3, 2, 1, 0])  # fmt: skip
    L3: gl.constexpr = gl.SliceLayout(3, LW)
    MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[1, WARPS],
                                                  instr_shape=[16, 8])  # fmt: skip
    LA: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=2)
    LB: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=MMA, k_width=2)
    pid = gl.program_id(0)
    pid_k = gl.program_id(1)
    tiles_n = (N + BN - 1) // BN
    pid_m = pid // tiles_n
    pid_n = pid % tiles_n
    o_u = gl.arange(0, NU, layout=gl.SliceLayout(1, gl.SliceLayout(2, L3)))
    o_l = gl.arange(0, 32, layout=gl.SliceLayout(0, gl.SliceLayout(2, L3)))
    o_r = gl.arange(0, 2, layout=gl.SliceLayout(0, gl.SliceLayout(1, L3)))
    o_e = gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(2, LW))))
    lanes = (o_u[:, None, None] * 32 + o_l[None, :, None]) * 2 + o_r[None, None, :]
    offs = lanes[:, :, :, None] * 8 + o_e[None, None, None, :]
    u_ok = gl.broadcast((pid_n * NU + o_u < (N + 15) // 16)[:, None, None, None], offs)[0]
    cols = pid_n * BN + o_u[:, None, None] * 16 + o_r[None, None, :] * 8 + o_l[None, :, None] // 4
    c_ok = cols < N
    a_m = gl.minimum(pid_m * BM + gl.arange(0, BM, layout=gl.SliceLayout(1, LA)), M - 1)
    a_k = gl.arange(0, 32, layout=gl.SliceLayout(0, LA))
    a_ptrs = x_ptr + a_m.to(gl.int64)[:, None] * stride_xm + a_k[None, :]
    tile_words = ((N + 15) // 16) * 512
    t0 = pid_k * K_ITERS
    t_last = t0 + K_ITERS - 1
    w_ptrs = w_ptr + pid_n * NU * 512 + offs
    acc = gl.zeros([BM, BN], gl.float32, layout=MMA)
    words = _ld(w_ptrs + t0.to(gl.int64) * tile_words, u_ok, EVEN_N)
    zero, hi, lo = _tile_scales(z_ptr, hi_ptr, lo_ptr, t0, 0, cols, c_ok, N, GROUP, GROUPS, EVEN_N)
    if STAGES == 2:
        t1 = gl.minimum(t0 + 1, t_last)
        words1 = _ld(w_ptrs + t1.to(gl.int64) * tile_words, u_ok, EVEN_N)
        zero1, hi1, lo1 = _tile_scales(z_ptr, hi_ptr, lo_ptr, t1, 0, cols, c_ok, N, GROUP, GROUPS,
                                       EVEN_N)  # fmt: skip
    for it in range(K_ITERS):
        t = t0 + it
        tn = gl.minimum(t + STAGES, t_last)
        nxt = _ld(w_ptrs + tn.to(gl.int64) * tile_words, u_ok, EVEN_N)
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
            b = _operand_b(_decode(words, zz, hh, ll, j, DT, HAS_LO), LB, NU)
            kk = t * 128 + j * 32
            if EVEN_K:
                a = gl.load(a_ptrs + kk)
            else:
                a = gl.load(a_ptrs + kk, mask=(kk + a_k < K)[None, :], other=0.0)
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
    o_m = pid_m * BM + gl.arange(0, BM, layout=gl.SliceLayout(1, MMA))
    o_n = _real_columns(pid_n, NU, gl.SliceLayout(0, MMA))
    acc, last = _finish_rows(acc, part_ptr, count_ptr, pid, pid_k, o_m, o_n, M, N, SPLIT)
    if last:
        if HAS_BIAS:
            bias = gl.load(b_ptr + o_n, mask=o_n < N, other=0.0).to(DT)
            acc += bias.to(gl.float32)[None, :]
        o_ptrs = out_ptr + o_m.to(gl.int64)[:, None] * stride_om + o_n[None, :]
        gl.store(o_ptrs, acc.to(DT), mask=(o_m < M)[:, None] & (o_n < N)[None, :])


@gluon.jit
@no_type_check
def _finish_rows(acc, part_ptr, count_ptr, tile, pid_k, o_m, o_n, M, N, SPLIT: gl.constexpr):
    """:func:`_finish` for an ``(rows, columns)`` accumulator."""
    last = True
    if SPLIT > 1:
        p_offs = o_m.to(gl.int64)[:, None] * N + o_n[None, :]
        p_mask = (o_m < M)[:, None] & (o_n < N)[None, :]
        gl.store(part_ptr + pid_k.to(gl.int64) * M * N + p_offs, acc, mask=p_mask)
        gl.thread_barrier()
        arrived = gl.atomic_add(count_ptr + tile, 1, sem="acq_rel", scope="gpu")
        last = arrived == SPLIT - 1
        if last:
            gl.thread_barrier()
            acc = gl.zeros_like(acc)
            for s in range(SPLIT):
                acc += gl.load(part_ptr + s * M * N + p_offs, mask=p_mask, other=0.0,
                               cache_modifier=".cg")  # fmt: skip
            gl.atomic_xchg(count_ptr + tile, 0, sem="relaxed", scope="gpu")
    return acc, last


@gluon.jit
@no_type_check
def w4a_fp8_frag_rows_kernel(
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
    BM: gl.constexpr,
    K_ITERS: gl.constexpr,
    SPLIT: gl.constexpr,
    STAGES: gl.constexpr,
    WARPS: gl.constexpr,
):
    """:func:`w4a_fp8_frag_kernel` with the activation codes as the MMA's A operand (``BM``
    rows a program): the shape for 5 to 32 rows, the same words, numerics and split-K."""
    BN: gl.constexpr = 16 * NU
    LW: gl.constexpr = gl.BlockedLayout([1, 1, 2, 8], [1, 32, 1, 1], [WARPS, 1, 1, 1],
                                        [3, 2, 1, 0])  # fmt: skip
    MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[1, WARPS],
                                                  instr_shape=[16, 8])  # fmt: skip
    LA: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=2)
    LB: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=MMA, k_width=2)
    L3: gl.constexpr = gl.SliceLayout(3, LW)
    pid = gl.program_id(0)
    pid_k = gl.program_id(1)
    tiles_n = (N + BN - 1) // BN
    pid_m = pid // tiles_n
    pid_n = pid % tiles_n
    o_u = gl.arange(0, NU, layout=gl.SliceLayout(1, gl.SliceLayout(2, L3)))
    o_l = gl.arange(0, 32, layout=gl.SliceLayout(0, gl.SliceLayout(2, L3)))
    o_r = gl.arange(0, 2, layout=gl.SliceLayout(0, gl.SliceLayout(1, L3)))
    o_e = gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(2, LW))))
    lanes = (o_u[:, None, None] * 32 + o_l[None, :, None]) * 2 + o_r[None, None, :]
    offs = lanes[:, :, :, None] * 8 + o_e[None, None, None, :]
    u_ok = gl.broadcast((pid_n * NU + o_u < (N + 15) // 16)[:, None, None, None], offs)[0]
    a_m = gl.minimum(pid_m * BM + gl.arange(0, BM, layout=gl.SliceLayout(1, LA)), M - 1)
    a_k = gl.arange(0, 32, layout=gl.SliceLayout(0, LA))
    a_ptrs = a_ptr + a_m.to(gl.int64)[:, None] * stride_am + a_k[None, :]
    o_m = pid_m * BM + gl.arange(0, BM, layout=gl.SliceLayout(1, MMA))
    o_n = _real_columns(pid_n, NU, gl.SliceLayout(0, MMA))
    n_ok = o_n < N
    s_ptrs = s_ptr + o_n * stride_sn
    tile_words = ((N + 15) // 16) * 512
    t0 = pid_k * K_ITERS
    t_last = t0 + K_ITERS - 1
    w_ptrs = w_ptr + pid_n * NU * 512 + offs
    total = gl.zeros([BM, BN], gl.float32, layout=MMA)
    words = _ld(w_ptrs + t0.to(gl.int64) * tile_words, u_ok, EVEN_N)
    s = _ld(s_ptrs + t0 * stride_sg, n_ok, EVEN_N)
    if STAGES == 2:
        t1 = gl.minimum(t0 + 1, t_last)
        words1 = _ld(w_ptrs + t1.to(gl.int64) * tile_words, u_ok, EVEN_N)
        s1 = _ld(s_ptrs + t1 * stride_sg, n_ok, EVEN_N)
    for it in range(K_ITERS):
        t = t0 + it
        tn = gl.minimum(t + STAGES, t_last)
        nxt = _ld(w_ptrs + tn.to(gl.int64) * tile_words, u_ok, EVEN_N)
        sn = _ld(s_ptrs + tn * stride_sg, n_ok, EVEN_N)
        partial = gl.zeros([BM, BN], gl.float32, layout=MMA)
        for j in gl.static_range(4):
            b = _operand_b(_centered(words, j), LB, NU)
            kk = t * 128 + j * 32
            if EVEN_K:
                codes = gl.load(a_ptrs + kk)
            else:
                codes = gl.load(a_ptrs + kk, mask=(kk + a_k < K)[None, :], other=0)
            a = codes.to(gl.float8e4nv, bitcast=True).to(gl.float16)
            partial = mma_v2(a, b, partial)
        total += partial * s.to(gl.float32)[None, :]
        if STAGES == 2:
            words = words1
            words1 = nxt
            s = s1
            s1 = sn
        else:
            words = nxt
            s = sn
    total, last = _finish_rows(total, part_ptr, count_ptr, pid, pid_k, o_m, o_n, M, N, SPLIT)
    if last:
        rs = gl.load(rs_ptr + o_m, mask=o_m < M, other=0.0)
        out = total * rs[:, None]
        if HAS_BIAS:
            out += gl.load(b_ptr + o_n, mask=n_ok, other=0.0).to(gl.float32)[None, :]
        o_ptrs = out_ptr + o_m.to(gl.int64)[:, None] * stride_om + o_n[None, :]
        gl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=(o_m < M)[:, None] & n_ok[None, :])


def w4a16_rows(x, fw, zeros, hi, lo, bias, n, k, group, *, nu=8, warps=4, target=3,
               has_lo=True, stages=1, bm=16):  # fmt: skip

    global SMS
    SMS = SMS or torch.cuda.get_device_properties(x.device).multi_processor_count
    m = x.shape[0]
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    tiles = -(-n // (16 * nu)) * -(-m // bm)
    steps = fw.shape[0] // 32
    split = _split(tiles, steps, target, SMS)
    part, counts = _ws(split * m * n, tiles, x.device)
    w4a16_frag_rows_kernel[(tiles, split, 1)](
        x, fw, zeros, hi, lo, bias if bias is not None else hi, out, part, counts, m, n, k,
        zeros.shape[0], x.stride(0), out.stride(0), group, group >= k or group % 128 == 0,
        has_lo, bias is not None, k % 128 == 0, n % (16 * nu) == 0, nu, bm, steps // split, split,
        stages, warps, num_warps=warps,
    )  # fmt: skip
    return out


def w4afp8_rows(codes, row_scale, fw, scales, bias, n, k, out_dtype, *, nu=8, warps=4,
                target=3, stages=1, bm=16):  # fmt: skip

    global SMS
    SMS = SMS or torch.cuda.get_device_properties(codes.device).multi_processor_count
    m = codes.shape[0]
    out = torch.empty((m, n), dtype=out_dtype, device=codes.device)
    tiles = -(-n // (16 * nu)) * -(-m // bm)
    steps = fw.shape[0] // 32
    split = _split(tiles, steps, target, SMS)
    part, counts = _ws(split * m * n, tiles, codes.device)
    w4a_fp8_frag_rows_kernel[(tiles, split, 1)](
        codes.view(torch.uint8), row_scale, fw, scales, bias if bias is not None else scales, out,
        part, counts, m, n, k, codes.stride(0), scales.stride(0), scales.stride(1), out.stride(0),
        bias is not None, k % 128 == 0, n % (16 * nu) == 0, nu, bm, steps // split, split, stages,
        warps, num_warps=warps,
    )  # fmt: skip
    return out


def _opt(name, default):
    return sys.argv[sys.argv.index(name) + 1] if name in sys.argv else default


def check() -> None:
    """Exactness on ragged shapes: W4A16 against F.linear of the exact decode (FP32 bound),
    groups 32/64/128/all, fp16 and bf16, with and without bias; W4A-FP8 against the library's
    own pure reference."""
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(1)
    bad = 0
    for n, k in ((8192, 8192), (200, 320), (24, 4096), (1000, 1100), (16, 128)):
        for group in (32, 64, 128, k):
            if group > k or (group < k and k % group):
                continue
            for sdt, xdt in ((torch.float16, torch.bfloat16), (torch.float16, torch.float16),
                             (torch.bfloat16, torch.bfloat16)):  # fmt: skip
                codes = torch.randint(0, 16, (k, n), device=dev, generator=gen)
                groups = -(-k // group)
                zeros = torch.randint(0, 16, (groups, n), device=dev, generator=gen)
                scales = (torch.rand(groups, n, device=dev, generator=gen) * 0.02 + 1e-3).to(sdt)
                split = split_scales(scales, xdt)
                fw = stage_frag(stage_decode_words(codes))
                zk = zeros.repeat_interleave(group, 0)[:k]
                sk = scales.float().repeat_interleave(group, 0)[:k]
                w = (sk * (codes - zk)).to(xdt).float()
                for m in (1, 3, 8, 13, 16, 32):
                    for with_bias in (False, True):
                        x = torch.randn(m, k, device=dev, generator=gen).to(xdt)
                        bias = (
                            torch.randn(n, device=dev, generator=gen).to(xdt) if with_bias else None
                        )
                        ref = x.float() @ w + (bias.float() if with_bias else 0)
                        st = 1 + (m % 2)
                        got = w4a16_frag(x, fw, zeros.to(torch.uint8), split.hi, split.lo, bias,
                                         n, k, group, nu=8, warps=4, target=3, stages=st,
                                         has_lo=sdt != xdt).float()  # fmt: skip
                        bound = (
                            2 * k * 2**-24 * (x.float().abs() @ w.abs()) + ref.abs() * 2**-7 + 1e-6
                        )
                        ok = bool(((got - ref).abs() <= bound).all())
                        if m > 8:
                            got2 = w4a16_rows(x, fw, zeros.to(torch.uint8), split.hi, split.lo,
                                              bias, n, k, group, stages=st, has_lo=sdt != xdt,
                                              bm=16 if m <= 16 else 32).float()  # fmt: skip
                            ok = ok and bool(((got2 - ref).abs() <= bound).all())
                        if not ok:
                            bad += 1
                            print(
                                f"W4A16 MISMATCH n={n} k={k} g={group} {sdt}/{xdt} m={m} bias={with_bias}: max err {(got - ref).abs().max():.3e}"
                            )
    from floatxq.kernels.w4a_fp8 import fp8_linear_prepacked

    for n, k in ((8192, 8192), (200, 384), (24, 4096), (1000, 1152), (16, 128)):
        for m in (1, 5, 8, 13, 16, 32):
            for with_bias in (False, True):
                cw = stage_decode_words(torch.randint(0, 16, (k, n), device=dev, generator=gen))
                fs = torch.rand(k // 128, n, device=dev, generator=gen).half() + 0.5
                x = torch.randn(m, k, device=dev, generator=gen).to(torch.bfloat16)
                bias = (
                    torch.randn(n, device=dev, generator=gen).to(torch.bfloat16)
                    if with_bias
                    else None
                )
                codes, rs = fq.fp8_pack(x)
                lib = fp8_linear_prepacked(codes, rs, cw, fs, bias, torch.bfloat16).float()
                got = w4afp8_frag(
                    codes,
                    rs,
                    stage_frag(cw),
                    fs,
                    bias,
                    n,
                    k,
                    torch.bfloat16,
                    nu=8,
                    warps=4,
                    target=3,
                    stages=1 + m % 2,
                ).float()
                diff = float((got - lib).abs().max() / lib.abs().max().clamp_min(1e-6))
                got2 = w4afp8_rows(
                    codes,
                    rs,
                    stage_frag(cw),
                    fs,
                    bias,
                    n,
                    k,
                    torch.bfloat16,
                    stages=1 + m % 2,
                    bm=16 if m <= 16 else 32,
                ).float()
                diff = max(diff, float((got2 - lib).abs().max() / lib.abs().max().clamp_min(1e-6)))
                if diff > 2**-7:
                    bad += 1
                    print(f"W4A-FP8 MISMATCH n={n} k={k} m={m} bias={with_bias}: rel {diff:.3e}")
    print(f"check: {bad} mismatches", flush=True)


def bench() -> None:
    from w4a import _gemlite, _gptq, copies_for, graph_us

    from floatxq.gptq.decode_words import gptq_decode_operands
    from floatxq.kernels.w4a16 import DEFAULT_W4A16_TUNING, _words_linear
    from floatxq.kernels.w4a_fp8 import fp8_linear_prepacked

    dev = torch.device("cuda")
    rows = [int(v) for v in _opt("--rows", "1,2,4,8,16,32").split(",")]
    shapes = [tuple(int(v) for v in s.split("x")) for s in _opt("--shapes", "8192x8192").split(",")]
    gen = torch.Generator(device=dev).manual_seed(0)
    for n, k in shapes:
        sets = []
        for i in range(copies_for(n * k // 2)):
            packed = _gptq(n, k, i)
            ops, why = gptq_decode_operands(packed, group_size=128, dtype=torch.bfloat16)
            assert ops is not None, why
            scales = packed.scales.half()
            split = split_scales(scales, torch.bfloat16)
            ops = DecodeOperands(ops.words, ops.zeros, split.hi, split.lo)
            cw = stage_decode_words(torch.randint(0, 16, (k, n), device=dev, generator=gen))
            fs = torch.rand(k // 128, n, device=dev, generator=gen).half() + 0.5
            sets.append(dict(packed=packed, ops=ops, scales=scales, fw=stage_frag(ops.words),
                             cw=cw, cfw=stage_frag(cw), fs=fs, gl=_gemlite(packed)))  # fmt: skip
        wb = [
            torch.randn(n, k, device=dev, dtype=torch.bfloat16)
            for _ in range(copies_for(n * k * 2))
        ]
        w8 = [t.to(torch.float8_e4m3fn) for t in wb[: copies_for(n * k)]]
        s0 = sets[0]
        for m in rows:
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            ref = _words_linear(
                x, s0["ops"], s0["scales"], None, k, n, 128, dev, DEFAULT_W4A16_TUNING
            ).float()
            res = {}
            res["bf16"] = graph_us([lambda t=t: F.linear(x, t) for t in wb])
            x8 = x.to(torch.float8_e4m3fn)
            one = torch.ones((), device=dev)
            res["fp8"] = graph_us(
                [
                    lambda t=t: torch._scaled_mm(x8, t.T, one, one, out_dtype=torch.bfloat16)
                    for t in w8
                ]
            )
            if s0["gl"] is not None:
                res["gemlite"] = graph_us([lambda s=s: s["gl"](x) for s in sets])
            res["lib_words"] = graph_us(
                [
                    lambda s=s: _words_linear(
                        x, s["ops"], s["scales"], None, k, n, 128, dev, DEFAULT_W4A16_TUNING
                    )
                    for s in sets
                ]
            )
            codes, row_scale = fq.fp8_pack(x)
            res["lib_w4afp8"] = graph_us(
                [
                    lambda s=s: fp8_linear_prepacked(
                        codes, row_scale, s["cw"], s["fs"], None, torch.bfloat16
                    )
                    for s in sets
                ]
            )
            line = " ".join(f"{a} {b:.2f}" for a, b in res.items())
            print(f"N={n} K={k} M={m} anchors: {line}", flush=True)
            best16 = best8 = (1e9, None)
            for nu, warps, targets in (
                (4, 4, (4, 8)),
                (8, 4, (3, 6)),
                (8, 8, (4, 8)),
                (16, 8, (2, 4)),
            ):
                for stages in (1, 2):
                    for target in targets:
                        cfg = dict(nu=nu, warps=warps, target=target, stages=stages)
                        try:
                            got = w4a16_frag(
                                x,
                                s0["fw"],
                                s0["ops"].zeros,
                                s0["ops"].hi,
                                s0["ops"].lo,
                                None,
                                n,
                                k,
                                128,
                                **cfg,
                            ).float()
                            err = float((got - ref).abs().max() / ref.abs().max())
                            us = graph_us(
                                [
                                    lambda s=s: w4a16_frag(
                                        x,
                                        s["fw"],
                                        s["ops"].zeros,
                                        s["ops"].hi,
                                        s["ops"].lo,
                                        None,
                                        n,
                                        k,
                                        128,
                                        **cfg,
                                    )
                                    for s in sets
                                ]
                            )
                            best16 = min(best16, (us, f"{cfg} err {err:.1e}"), key=lambda v: v[0])
                            lib8 = fp8_linear_prepacked(
                                codes, row_scale, s0["cw"], s0["fs"], None, torch.bfloat16
                            ).float()
                            got8 = w4afp8_frag(
                                codes,
                                row_scale,
                                s0["cfw"],
                                s0["fs"],
                                None,
                                n,
                                k,
                                torch.bfloat16,
                                **cfg,
                            ).float()
                            err8 = float((got8 - lib8).abs().max() / lib8.abs().max())
                            us8 = graph_us(
                                [
                                    lambda s=s: w4afp8_frag(
                                        codes,
                                        row_scale,
                                        s["cfw"],
                                        s["fs"],
                                        None,
                                        n,
                                        k,
                                        torch.bfloat16,
                                        **cfg,
                                    )
                                    for s in sets
                                ]
                            )
                            best8 = min(
                                best8,
                                (us8, f"{cfg} rel-diff-vs-lib {err8:.1e}"),
                                key=lambda v: v[0],
                            )
                            print(
                                f"  M={m} {cfg}: w4a16 {us:.2f} (err {err:.1e}), w4a-fp8 {us8:.2f} (vs lib {err8:.1e})",
                                flush=True,
                            )
                        except Exception as exc:
                            print(
                                f"  M={m} {cfg}: {type(exc).__name__}: {str(exc)[:300]}", flush=True
                            )
            print(
                f"N={n} K={k} M={m} BEST w4a16 {best16[0]:.2f} {best16[1]} | w4a-fp8 {best8[0]:.2f} {best8[1]} | "
                f"bf16 {res['bf16']:.2f} ({res['bf16'] / best16[0]:.2f}x, fp8-path {res['bf16'] / best8[0]:.2f}x), "
                f"gemlite {res.get('gemlite', float('nan')):.2f}, fp8 {res['fp8']:.2f} ({res['fp8'] / best8[0]:.2f}x)",
                flush=True,
            )


def bench_rows() -> None:
    from w4a import _gptq, copies_for, graph_us

    from floatxq.gptq.decode_words import gptq_decode_operands
    from floatxq.kernels.w4a16 import DEFAULT_W4A16_TUNING, _words_linear
    from floatxq.kernels.w4a_fp8 import fp8_linear_prepacked

    dev = torch.device("cuda")
    n = k = 8192
    gen = torch.Generator(device=dev).manual_seed(0)
    sets = []
    for i in range(copies_for(n * k // 2)):
        packed = _gptq(n, k, i)
        ops, _ = gptq_decode_operands(packed, group_size=128, dtype=torch.bfloat16)
        scales = packed.scales.half()
        split = split_scales(scales, torch.bfloat16)
        ops = DecodeOperands(ops.words, ops.zeros, split.hi, split.lo)
        cw = stage_decode_words(torch.randint(0, 16, (k, n), device=dev, generator=gen))
        fs = torch.rand(k // 128, n, device=dev, generator=gen).half() + 0.5
        sets.append(
            dict(ops=ops, scales=scales, fw=stage_frag(ops.words), cw=cw, cfw=stage_frag(cw), fs=fs)
        )
    for m in (8, 16, 32):
        x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
        codes, rs = fq.fp8_pack(x)
        lib = graph_us(
            [
                lambda s=s: _words_linear(
                    x, s["ops"], s["scales"], None, k, n, 128, dev, DEFAULT_W4A16_TUNING
                )
                for s in sets
            ]
        )
        lib8 = graph_us(
            [
                lambda s=s: fp8_linear_prepacked(codes, rs, s["cw"], s["fs"], None, torch.bfloat16)
                for s in sets
            ]
        )
        print(f"ROWS M={m} lib words {lib:.2f} lib dwords {lib8:.2f}", flush=True)
        for nu, warps in ((8, 4), (16, 8), (16, 4)):
            for bm in (16,) if m <= 16 else (16, 32):
                for stages in (1, 2):
                    for target in (2, 4):
                        cfg = dict(nu=nu, warps=warps, bm=bm, stages=stages, target=target)
                        try:
                            us = graph_us(
                                [
                                    lambda s=s: w4a16_rows(
                                        x,
                                        s["fw"],
                                        s["ops"].zeros,
                                        s["ops"].hi,
                                        s["ops"].lo,
                                        None,
                                        n,
                                        k,
                                        128,
                                        **cfg,
                                    )
                                    for s in sets
                                ]
                            )
                            us8 = float("nan")
                            if not (bm == 32 and nu == 16):
                                us8 = graph_us(
                                    [
                                        lambda s=s: w4afp8_rows(
                                            codes,
                                            rs,
                                            s["cfw"],
                                            s["fs"],
                                            None,
                                            n,
                                            k,
                                            torch.bfloat16,
                                            **cfg,
                                        )
                                        for s in sets
                                    ]
                                )
                            print(f"ROWS M={m} {cfg}: w4a16 {us:.2f} w4a-fp8 {us8:.2f}", flush=True)
                        except Exception as exc:
                            print(
                                f"ROWS M={m} {cfg}: {type(exc).__name__}: {str(exc)[:200]}",
                                flush=True,
                            )
    x = torch.randn(1, k, device=dev, dtype=torch.bfloat16)
    for has_lo in (True, False):
        us = graph_us(
            [
                lambda s=s: w4a16_frag(
                    x,
                    s["fw"],
                    s["ops"].zeros,
                    s["ops"].hi,
                    s["ops"].lo,
                    None,
                    n,
                    k,
                    128,
                    nu=8,
                    warps=4,
                    target=6,
                    stages=2,
                    has_lo=has_lo,
                )
                for s in sets
            ]
        )
        print(f"M=1 swapped has_lo={has_lo}: {us:.2f}", flush=True)


def quick() -> None:
    """One device call's worth (about four minutes): the exactness of the untimed variants (the
    activations prefetched a tile ahead, ``PREFETCH_X``; the rows kernels for 9–32 rows) on a few
    ragged shapes, then their times against the library's routes at 8192 × 8192."""
    from w4a import _gptq, copies_for, graph_us

    from floatxq.gptq.decode_words import gptq_decode_operands
    from floatxq.kernels.w4a16 import DEFAULT_W4A16_TUNING, _words_linear
    from floatxq.kernels.w4a_fp8 import fp8_linear_prepacked
    from floatxq.kernels.w4a_frag import w4a16_frag_linear

    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(2)
    bad = 0
    for n, k, group in ((8192, 8192, 128), (200, 320, 64), (24, 4096, 4096)):
        codes = torch.randint(0, 16, (k, n), device=dev, generator=gen)
        groups = -(-k // group)
        zeros = torch.randint(0, 16, (groups, n), device=dev, generator=gen)
        scales = (torch.rand(groups, n, device=dev, generator=gen) * 0.02 + 1e-3).half()
        split = split_scales(scales, torch.bfloat16)
        words = stage_decode_words(codes)
        fw = stage_frag(words)
        w = (
            (
                scales.float().repeat_interleave(group, 0)[:k]
                * (codes - zeros.repeat_interleave(group, 0)[:k])
            )
            .bfloat16()
            .float()
        )
        fs = (
            torch.rand(groups if group == 128 else k // 128, n, device=dev, generator=gen).half()
            + 0.5
        )
        for m in (1, 8, 16, 32):
            x = torch.randn(m, k, device=dev, generator=gen).bfloat16()
            bias = torch.randn(n, device=dev, generator=gen).bfloat16() if m % 16 else None
            ref = x.float() @ w + (bias.float() if bias is not None else 0)
            bound = 2 * k * 2**-24 * (x.float().abs() @ w.abs()) + ref.abs() * 2**-7 + 1e-6
            if m <= 8:
                got = w4a16_frag(
                    x,
                    fw,
                    zeros.to(torch.uint8),
                    split.hi,
                    split.lo,
                    bias,
                    n,
                    k,
                    group,
                    nu=8,
                    warps=4,
                    target=6,
                    stages=2,
                    prefetch_x=True,
                ).float()
            else:
                got = w4a16_rows(
                    x,
                    fw,
                    zeros.to(torch.uint8),
                    split.hi,
                    split.lo,
                    bias,
                    n,
                    k,
                    group,
                    stages=2,
                    bm=16 if m <= 16 else 32,
                ).float()
            if not bool(((got - ref).abs() <= bound).all()):
                bad += 1
                print(f"W4A16 MISMATCH n={n} k={k} g={group} m={m}")
            if k % 128:
                continue
            codes8, rs = fq.fp8_pack(x)
            lib = fp8_linear_prepacked(codes8, rs, words, fs, bias, torch.bfloat16).float()
            if m <= 8:
                got8 = w4afp8_frag(
                    codes8,
                    rs,
                    fw,
                    fs,
                    bias,
                    n,
                    k,
                    torch.bfloat16,
                    nu=8,
                    warps=4,
                    target=6,
                    stages=2,
                    prefetch_x=True,
                ).float()
            else:
                got8 = w4afp8_rows(
                    codes8,
                    rs,
                    fw,
                    fs,
                    bias,
                    n,
                    k,
                    torch.bfloat16,
                    stages=2,
                    bm=16 if m <= 16 else 32,
                ).float()
            if float((got8 - lib).abs().max() / lib.abs().max().clamp_min(1e-6)) > 2**-7:
                bad += 1
                print(f"W4A-FP8 MISMATCH n={n} k={k} m={m}")
    print(f"quick check: {bad} mismatches", flush=True)
    n = k = 8192
    sets = []
    for i in range(copies_for(n * k // 2)):
        packed = _gptq(n, k, i)
        ops, _ = gptq_decode_operands(packed, group_size=128, dtype=torch.bfloat16)
        scales = packed.scales.half()
        sp = split_scales(scales, torch.bfloat16)
        ops = DecodeOperands(ops.words, ops.zeros, sp.hi, sp.lo)
        fs = torch.rand(k // 128, n, device=dev, generator=gen).half() + 0.5
        sets.append(dict(ops=ops, scales=scales, fw=stage_frag(ops.words), fs=fs))
    for m in (1, 4, 8, 16, 32):
        x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
        codes8, rs = fq.fp8_pack(x)
        res = {
            "bf16": graph_us(
                [
                    lambda w=w: F.linear(x, w)
                    for w in [
                        torch.randn(n, k, device=dev, dtype=torch.bfloat16)
                        for _ in range(copies_for(n * k * 2))
                    ]
                ]
            )
        }
        res["lib words"] = graph_us(
            [
                lambda s=s: _words_linear(
                    x, s["ops"], s["scales"], None, k, n, 128, dev, DEFAULT_W4A16_TUNING
                )
                for s in sets
            ]
        )
        res["lib dwords"] = graph_us(
            [
                lambda s=s: fp8_linear_prepacked(
                    codes8, rs, s["ops"].words, s["fs"], None, torch.bfloat16
                )
                for s in sets
            ]
        )
        if m <= 8:
            res["lib frag"] = graph_us(
                [
                    lambda s=s: w4a16_frag_linear(x, s["fw"], s["ops"], None, k, n, 128, dev, True)
                    for s in sets
                ]
            )
            for px in (False, True):
                cfg = dict(nu=8, warps=4, target=6, stages=2, prefetch_x=px)
                res[f"frag px={px}"] = graph_us(
                    [
                        lambda s=s: w4a16_frag(
                            x,
                            s["fw"],
                            s["ops"].zeros,
                            s["ops"].hi,
                            s["ops"].lo,
                            None,
                            n,
                            k,
                            128,
                            **cfg,
                        )
                        for s in sets
                    ]
                )
                res[f"frag8 px={px}"] = graph_us(
                    [
                        lambda s=s: w4afp8_frag(
                            codes8, rs, s["fw"], s["fs"], None, n, k, torch.bfloat16, **cfg
                        )
                        for s in sets
                    ]
                )
        else:
            for nu, warps in ((8, 4), (16, 8)):
                for bm in (16,) if m <= 16 else (16, 32):
                    cfg = dict(nu=nu, warps=warps, bm=bm, stages=2, target=4)
                    res[f"rows {nu}/{warps}/{bm}"] = graph_us(
                        [
                            lambda s=s: w4a16_rows(
                                x,
                                s["fw"],
                                s["ops"].zeros,
                                s["ops"].hi,
                                s["ops"].lo,
                                None,
                                n,
                                k,
                                128,
                                **cfg,
                            )
                            for s in sets
                        ]
                    )
                    res[f"rows8 {nu}/{warps}/{bm}"] = graph_us(
                        [
                            lambda s=s: w4afp8_rows(
                                codes8, rs, s["fw"], s["fs"], None, n, k, torch.bfloat16, **cfg
                            )
                            for s in sets
                        ]
                    )
        print(f"QUICK M={m}: " + ", ".join(f"{a} {v:.2f}" for a, v in res.items()), flush=True)


if __name__ == "__main__":
    if "--quick" in sys.argv:
        quick()
        sys.exit()
    if "--rows-only" in sys.argv:
        check()
        bench_rows()
        sys.exit()
    if "--check" in sys.argv:
        check()
    bench()
