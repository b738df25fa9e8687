# ruff: noqa: B023, B905
"""Probe of the decode-words design (issue 31): the variants that led to
``floatxq.kernels._w4a_words_jit``, and the floor of streaming the same bytes.

Usage (GPU): ``python3 benchmarks/w4a_decode_probe.py [--rows 1,16] [--budget 40]``. For each
row count: the anchors (bf16 ``F.linear``, FP8 ``_scaled_mm``, GemLite's A16Wn when importable),
then a sweep of launch shapes of two probe kernels on int16 words (W4A16 with the split-scale
decode; W4A-FP8), each checked against the exact decode before it is timed, until ``--budget``
seconds; a summary table last. ``stream_kernel`` reads the same int16 words with the same grid
and does nothing else: the bandwidth floor of this structure. The probe kernels decode with the
library's own packed-PTX helpers; only their launch structure is the probe's. The int32
variants of the first probe (eight 16-row slices per word, integer or FP32 magic-number
decodes) are in this file at commit f2e7eb3; RESULTS.md records what each measured.

Layout: a tile of ``4·R`` input rows is ``R`` int16 word rows; word ``r``
holds in nibble ``j`` the code of input row ``tile·rows + R·j + r``, so nibble ``j`` of a word
tile is the ``(R, N)`` operand of one input slice: small products, no reshapes.
"""

import pathlib
import sys
import time

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

from floatxq.kernels._w4a_jit import split_k_reduce
from floatxq.kernels._w4a_words_jit import (
    BF16_0,
    BF16_1,
    BF16_2,
    BF16_3,
    _bf16x2,
    centered_slice,
    packed_slice,
)


def stage16(codes: torch.Tensor, r: int) -> torch.Tensor:
    """``(K, N)`` codes → int16 words ``(Kp / 4, N)``: word ``r`` of tile ``t`` holds in nibble
    ``j`` the code of row ``4R·t + R·j + r``."""
    k, n = codes.shape
    kp = -(-k // (4 * r)) * 4 * r
    padded = torch.zeros((kp, n), dtype=torch.int64, device=codes.device)
    padded[:k] = codes
    tiles = padded.view(kp // (4 * r), 4, r, n)
    shifts = (torch.arange(4, device=codes.device) * 4).view(1, 4, 1, 1)
    words = (tiles << shifts).sum(dim=1)
    words = torch.where(words >= 2**15, words - 2**16, words)
    return words.reshape(kp // 4, n).to(torch.int16).contiguous()


@triton.jit
def w4a16_perm16_kernel(
    x_ptr, w_ptr, z_ptr, s_ptr, lo_ptr, out_ptr, part_ptr, count_ptr, M, N, K, stride_xm,
    R: tl.constexpr, GROUP: tl.constexpr, ACCS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, K_ITERS: tl.constexpr, SPLIT: tl.constexpr,
):  # fmt: skip
    """bf16 only; int16 words, 4 nibbles each; GROUP >= 4R."""
    pid = tl.program_id(0)
    pid_k = tl.program_id(1)
    tiles_n = tl.cdiv(N, BLOCK_N)
    pid_m = pid // tiles_n
    pid_n = pid % tiles_n
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rr = tl.arange(0, R)
    m_ok = offs_m < M
    n_ok = offs_n < N
    x_rows = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc2 = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for it in range(K_ITERS):
        t = pid_k * K_ITERS + it
        words = tl.load(w_ptr + (t * R + rr).to(tl.int64)[:, None] * N + offs_n[None, :],
                        mask=n_ok[None, :], other=0)  # fmt: skip
        g = (t * 4 * R) // GROUP
        zq = tl.load(z_ptr + g * N + offs_n, mask=n_ok, other=0)
        s = tl.load(s_ptr + g * N + offs_n, mask=n_ok, other=0.0)
        lo = tl.load(lo_ptr + g * N + offs_n, mask=n_ok, other=0.0)
        z = (zq.to(tl.float32) + 128.0).to(tl.bfloat16)
        for j in tl.static_range(4):
            w = packed_slice(words, z, s, lo, j, tl.bfloat16)
            kk = t * 4 * R + j * R + rr
            a = tl.load(x_rows + kk[None, :], mask=m_ok[:, None] & (kk < K)[None, :], other=0.0)
            if ACCS == 2 and j % 2 == 1:
                acc2 = tl.dot(a, w, acc2)
            else:
                acc = tl.dot(a, w, acc)
    if ACCS == 2:
        acc += acc2
    last = True
    if SPLIT > 1:
        tile = pid_m * tiles_n + pid_n
        acc, last = split_k_reduce(
            acc, part_ptr, count_ptr, tile, pid_k, offs_m, offs_n, M, N, SPLIT, BLOCK_M, BLOCK_N
        )
    if last:
        o_ptrs = out_ptr + offs_m.to(tl.int64)[:, None] * N + offs_n[None, :]
        tl.store(o_ptrs, acc.to(tl.bfloat16), mask=m_ok[:, None] & n_ok[None, :])


def w4a16_perm16(x, words, zeros, scales, lo, k, group, *, r=16, accs=1, bn=128, warps=4, stages=3,
                 target=4):  # fmt: skip
    m, n = x.shape[0], words.shape[1]
    block_m = 16 if m <= 16 else 32 if m <= 32 else 64
    tiles = -(-m // block_m) * -(-n // bn)
    steps = words.shape[0] // r
    sms = torch.cuda.get_device_properties(x.device).multi_processor_count if x.is_cuda else 4
    split = _split(tiles, steps, target, sms)
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    part, counts = _workspace(max(split * m * n, 1), max(tiles, 1), x.device)
    w4a16_perm16_kernel[(tiles, split, 1)](
        x, words, zeros, scales, lo, out, part, counts, m, n, k, x.stride(0), r, group, accs,
        block_m, bn, steps // split, split, num_warps=warps, num_stages=stages,
    )  # fmt: skip
    return out


@triton.jit
def w4afp8_perm16_kernel(
    a_ptr, rs_ptr, w_ptr, s_ptr, out_ptr, part_ptr, count_ptr, M, N, K,
    R: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, K_ITERS: tl.constexpr,
    SPLIT: tl.constexpr,
):  # fmt: skip
    """Group 128 = 128 / (4R) tiles of int16 words."""
    TILES_PER_GROUP: tl.constexpr = 128 // (4 * R)
    pid = tl.program_id(0)
    pid_k = tl.program_id(1)
    tiles_n = tl.cdiv(N, BLOCK_N)
    pid_m = pid // tiles_n
    pid_n = pid % tiles_n
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rr = tl.arange(0, R)
    m_ok = offs_m < M
    n_ok = offs_n < N
    a_rows = a_ptr + offs_m.to(tl.int64)[:, None] * K
    total = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for it in range(K_ITERS):  # one group per iteration
        g = pid_k * K_ITERS + it
        part = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for tt in tl.static_range(TILES_PER_GROUP):
            t = g * TILES_PER_GROUP + tt
            words = tl.load(w_ptr + (t * R + rr).to(tl.int64)[:, None] * N + offs_n[None, :],
                            mask=n_ok[None, :], other=0)  # fmt: skip
            for j in tl.static_range(4):
                w = centered_slice(words, j, True)
                kk = t * 4 * R + j * R + rr
                a = tl.load(a_rows + kk[None, :], mask=m_ok[:, None], other=0)
                a = a.to(tl.float8e4nv, bitcast=True).to(tl.float16)
                part = tl.dot(a, w, part)
        s = tl.load(s_ptr + g * N + offs_n, mask=n_ok, other=0.0).to(tl.float32)
        total += part * s[None, :]
    last = True
    if SPLIT > 1:
        tile = pid_m * tiles_n + pid_n
        total, last = split_k_reduce(
            total, part_ptr, count_ptr, tile, pid_k, offs_m, offs_n, M, N, SPLIT, BLOCK_M, BLOCK_N
        )
    if last:
        rs = tl.load(rs_ptr + offs_m, mask=m_ok, other=0.0)
        out = total * rs[:, None]
        o_ptrs = out_ptr + offs_m.to(tl.int64)[:, None] * N + offs_n[None, :]
        tl.store(o_ptrs, out.to(tl.bfloat16), mask=m_ok[:, None] & n_ok[None, :])


def w4afp8_perm16(codes, row_scale, words, scales, k, *, r=16, bn=128, warps=4, stages=3,
                  target=4):  # fmt: skip
    m, n = codes.shape[0], words.shape[1]
    block_m = 16 if m <= 16 else 32 if m <= 32 else 64
    tiles = -(-m // block_m) * -(-n // bn)
    steps = k // 128
    sms = torch.cuda.get_device_properties(codes.device).multi_processor_count
    split = _split(tiles, steps, target, sms)
    out = torch.empty((m, n), dtype=torch.bfloat16, device=codes.device)
    part, counts = _workspace(max(split * m * n, 1), max(tiles, 1), codes.device)
    w4afp8_perm16_kernel[(tiles, split, 1)](
        codes.view(torch.int8), row_scale, words, scales, out, part, counts, m, n, k, r,
        block_m, bn, steps // split, split, num_warps=warps, num_stages=stages,
    )  # fmt: skip
    return out


@triton.jit
def stream_kernel(w_ptr, out_ptr, N, ROWS, R: tl.constexpr, BLOCK_N: tl.constexpr,
                  K_ITERS: tl.constexpr):  # fmt: skip
    """Reads ``K_ITERS`` tiles of ``(R, BLOCK_N)`` int16 words per program (the bandwidth
    floor of the same grid): XOR-reduced, one int per column stored."""
    pid = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    rr = tl.arange(0, R)
    acc = tl.zeros([R, BLOCK_N], dtype=tl.int32)
    for it in range(K_ITERS):
        t = pid_k * K_ITERS + it
        words = tl.load(w_ptr + (t * R + rr).to(tl.int64)[:, None] * N + offs_n[None, :])
        acc = acc ^ words.to(tl.int32)
    tl.store(out_ptr + pid_k * N + offs_n, tl.sum(acc, axis=0))


def stream(words, *, r=16, bn=128, warps=4, stages=3, target=4):
    rows, n = words.shape
    steps = rows // r
    tiles = n // bn
    split = _split(
        tiles, steps, target, torch.cuda.get_device_properties(words.device).multi_processor_count
    )
    out = torch.empty((split, n), dtype=torch.int32, device=words.device)
    stream_kernel[(tiles, split, 1)](words, out, n, rows, r, bn, steps // split, num_warps=warps,
                                     num_stages=stages)  # fmt: skip
    return out


_WS = {}


def _workspace(numel, tiles, device):
    key = (numel, tiles)
    if key not in _WS:
        _WS[key] = (torch.empty(numel, dtype=torch.float32, device=device),
                    torch.zeros(tiles, dtype=torch.int32, device=device))  # fmt: skip
    return _WS[key]


def _split(tiles, steps, target, sms):
    split = 1
    for d in range(1, steps + 1):
        if steps % d == 0 and tiles * d <= target * sms:
            split = d
    return split


BUDGET_S = float(sys.argv[sys.argv.index("--budget") + 1]) if "--budget" in sys.argv else 40.0


def _configs():
    out = []
    for r in (32, 16):
        for bn in (128, 256, 64):
            for warps in (4, 8):
                for stages in (3, 4, 2):
                    for target in (4, 8, 2):
                        out.append(("w4a16", dict(r=r, bn=bn, warps=warps, stages=stages,
                                                  target=target)))  # fmt: skip
                        out.append(("w4afp8", dict(r=r, bn=bn, warps=warps, stages=stages,
                                                   target=target)))  # fmt: skip
    out.insert(2, ("w4a16", dict(r=32, accs=2)))
    return out


def main() -> None:
    from w4a import copies_for, graph_us

    import floatxq as fq

    dev = torch.device("cuda")
    props = torch.cuda.get_device_properties(0)
    print(f"# {props.name}, torch {torch.__version__}, triton {triton.__version__}, "
          f"{time.strftime('%Y-%m-%d %H:%M UTC')}", flush=True)  # fmt: skip
    n = k = 8192
    group = 128
    copies = copies_for(n * k // 2)
    gen = torch.Generator(device=dev).manual_seed(0)
    sets = []
    for _ in range(copies):
        codes = torch.randint(0, 16, (k, n), device=dev, generator=gen)
        zeros = torch.randint(0, 16, (k // group, n), device=dev, generator=gen)
        scales = torch.rand(k // group, n, device=dev, generator=gen) * 0.01 + 0.001
        sets.append((codes, zeros, scales.to(torch.float16)))
    staged = {r: [stage16(c, r) for c, _, _ in sets] for r in (16, 32)}
    zeros8 = [z.to(torch.uint8).contiguous() for _, z, _ in sets]
    sc32 = [s.float() for _, _, s in sets]
    hi = [s.to(torch.bfloat16) for _, _, s in sets]
    lo = [(s.float() - h.float()).to(torch.bfloat16) for (_, _, s), h in zip(sets, hi)]
    c0, z0, s0 = sets[0]
    ref_w = s0.float().repeat_interleave(group, 0) * (c0 - z0.repeat_interleave(group, 0))
    ref_w = ref_w.to(torch.bfloat16).float()
    ref_w8 = (c0 - 8).float() * s0.float().repeat_interleave(group, 0)
    rows = (tuple(int(v) for v in sys.argv[sys.argv.index("--rows") + 1].split(","))
            if "--rows" in sys.argv else (1, 16))  # fmt: skip
    dense = [torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02
             for _ in range(copies_for(n * k * 2))]  # fmt: skip
    fp8w = [(torch.randn(n, k, device=dev).to(torch.float8_e4m3fn), torch.rand(1, n, device=dev))
            for _ in range(copies_for(n * k))]  # fmt: skip
    for r in (16, 32):
        for bn in (128, 256):
            us = graph_us([lambda w=w: stream(w, r=r, bn=bn) for w in staged[r]])
            print(f"stream floor r={r} bn={bn}: {us:.2f} us, "
                  f"{staged[r][0].numel() * 2 / us / 1e6:.2f} TB/s", flush=True)  # fmt: skip
    gl = None
    try:
        from gemlite.helper import A16Wn

        gl = [A16Wn(device="cuda:0", dtype=torch.bfloat16).from_weights(
            c.T.contiguous().to(torch.uint8), s.T.contiguous(), z.T.contiguous().to(torch.bfloat16),
            W_nbits=4, group_size=group) for c, z, s in sets]  # fmt: skip
    except Exception as exc:
        print(f"gemlite unavailable: {type(exc).__name__}: {str(exc)[:200]}")
    summary = []
    for m in rows:
        x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
        xq = x.to(torch.float8_e4m3fn)
        sa = torch.rand(m, 1, device=dev)
        codes, row_scale = fq.fp8_pack(x)
        a = {}
        a["bf16"] = graph_us([lambda w=w: F.linear(x, w) for w in dense])
        a["fp8"] = graph_us([lambda w=w, s=s: torch._scaled_mm(xq, w.t(), sa, s,
                             out_dtype=torch.bfloat16) for w, s in fp8w])  # fmt: skip
        if gl is not None:
            try:
                gl[0](x)
                a["gemlite"] = graph_us([lambda g=g: g(x) for g in gl])
            except Exception as exc:
                print(f"gemlite M={m}: {type(exc).__name__}: {str(exc)[:200]}")
        print(f"anchors M={m}: " + ", ".join(f"{key} {v:.3g}" for key, v in a.items()), flush=True)
        ref = x.float() @ ref_w
        xr = codes.view(torch.float8_e4m3fn).float() * row_scale[:, None]
        ref8 = xr @ ref_w8
        best = {}
        started = time.time()
        for kind, cfg in _configs():
            if time.time() - started > BUDGET_S:
                print(f"M={m}: time budget reached", flush=True)
                break
            r = cfg.get("r", 16)
            try:
                if kind == "w4a16":
                    got = w4a16_perm16(x, staged[r][0], zeros8[0], hi[0], lo[0], k, group, **cfg)
                    err = float((got.float() - ref).norm() / ref.norm())
                    us = graph_us(
                        [
                            lambda w=w, z=z, h=h, lw=lw: w4a16_perm16(
                                x, w, z, h, lw, k, group, **cfg
                            )
                            for w, z, h, lw in zip(staged[r], zeros8, hi, lo)
                        ],
                        calls=10,
                        replays=5,
                    )
                else:
                    got = w4afp8_perm16(codes, row_scale, staged[r][0], sc32[0], k, **cfg)
                    err = float((got.float() - ref8).norm() / ref8.norm())
                    us = graph_us(
                        [
                            lambda w=w, s=s: w4afp8_perm16(codes, row_scale, w, s, k, **cfg)
                            for w, s in zip(staged[r], sc32)
                        ],
                        calls=10,
                        replays=5,
                    )
            except Exception as exc:
                print(f"M={m} {kind} {cfg}: {type(exc).__name__}: {str(exc)[-400:]}", flush=True)
                continue
            print(f"M={m} {kind} {cfg}: {us:.2f} us err {err:.2e} "
                  f"({a['bf16'] / us:.2f}x bf16)", flush=True)  # fmt: skip
            if err < 5e-3 and (kind not in best or us < best[kind][0]):
                best[kind] = (us, cfg)
        summary.append((m, a, best))
    print("\n| M | bf16 | fp8 | gemlite | best w4a16 | x bf16 | best w4a-fp8 | x fp8 |")
    for m, a, best in summary:
        b16 = best.get("w4a16", (float("nan"), {}))
        b8 = best.get("w4afp8", (float("nan"), {}))
        print(
            f"| {m} | {a['bf16']:.1f} | {a['fp8']:.1f} | {a.get('gemlite', float('nan')):.1f} | "
            f"{b16[0]:.1f} {b16[1]} | {a['bf16'] / b16[0]:.2f} | {b8[0]:.1f} {b8[1]} | "
            f"{a['fp8'] / b8[0]:.2f} |"
        )


def compare_library() -> None:
    """The probe's W4A-FP8 decode-words kernel against the library's on the same words, scales
    and packed tokens, 8192 × 8192, M in 1..32 (one run)."""
    from w4a import copies_for, graph_us

    import floatxq as fq
    from floatxq.kernels.w4a_fp8 import fp8_linear_prepacked

    dev = torch.device("cuda")
    n = k = 8192
    gen = torch.Generator(device=dev).manual_seed(0)
    words = [stage16(torch.randint(0, 16, (k, n), device=dev, generator=gen), 32)
             for _ in range(copies_for(n * k // 2))]  # fmt: skip
    scales = [torch.rand(k // 128, n, device=dev, generator=gen) + 0.5 for _ in words]
    for m in (1, 2, 4, 8, 16, 32):
        codes, row_scale = fq.fp8_pack(torch.randn(m, k, device=dev, dtype=torch.bfloat16))
        for dtype in (torch.float32, torch.float16):
            cast = [s.to(dtype) for s in scales]
            probe = graph_us([lambda w=w, s=s: w4afp8_perm16(
                codes, row_scale, w, s, k, r=32, bn=128 if m <= 16 else 256,
                stages=2 if m <= 16 else 3, target=4 if m <= 16 else 2)
                for w, s in zip(words, cast)])  # fmt: skip
            lib = graph_us([lambda w=w, s=s: fp8_linear_prepacked(
                codes, row_scale, w, s, None, torch.bfloat16)
                for w, s in zip(words, cast)])  # fmt: skip
            print(f"compare M={m} scales {dtype}: probe {probe:.1f} us, library {lib:.1f} us",
                  flush=True)  # fmt: skip


@triton.jit
def w4a16_swapped_kernel(
    x_ptr, w_ptr, z_ptr, hi_ptr, lo_ptr, out_ptr, part_ptr, count_ptr, M, N, K, stride_xm,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, K_ITERS: tl.constexpr, SPLIT: tl.constexpr,
):  # fmt: skip
    """``out^T = W^T · x^T`` on decode words (group 128, bf16, no split): the weight tile is
    the MMA's A operand (``BLOCK_N`` rows: wgmma-sized), the few activation rows its N side.
    For reading the compiled code (does the decode land in wgmma's register operand?)."""
    pid = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    rr = tl.arange(0, 32)
    m_ok = offs_m < M
    n_ok = offs_n < N
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    for it in range(K_ITERS):
        t = pid_k * K_ITERS + it
        words = tl.load(w_ptr + ((t * 32 + rr).to(tl.int64) * N)[None, :] + offs_n[:, None],
                        mask=n_ok[:, None], other=0)  # fmt: skip
        zero = tl.load(z_ptr + t * N + offs_n, mask=n_ok, other=0).to(tl.float32)
        zz = tl.broadcast_to((zero + 128.0).to(tl.bfloat16)[:, None], words.shape)
        hh = tl.broadcast_to(tl.load(hi_ptr + t * N + offs_n, mask=n_ok, other=0.0)[:, None],
                             words.shape)  # fmt: skip
        ll = tl.broadcast_to(tl.load(lo_ptr + t * N + offs_n, mask=n_ok, other=0.0)[:, None],
                             words.shape)  # fmt: skip
        for j in tl.static_range(4):
            if j == 0:
                wt = _bf16x2(BF16_0, words, zz, hh, ll)
            elif j == 1:
                wt = _bf16x2(BF16_1, words, zz, hh, ll)
            elif j == 2:
                wt = _bf16x2(BF16_2, words, zz, hh, ll)
            else:
                wt = _bf16x2(BF16_3, words, zz, hh, ll)
            kk = t * 128 + j * 32 + rr
            xt = tl.load(x_ptr + offs_m[None, :] * stride_xm + kk[:, None],
                         mask=m_ok[None, :], other=0.0)  # fmt: skip
            acc = tl.dot(wt, xt, acc)
    out = tl.trans(acc)  # (BLOCK_M, BLOCK_N)
    last = True
    if SPLIT > 1:
        out, last = split_k_reduce(
            out, part_ptr, count_ptr, pid, pid_k, offs_m, offs_n, M, N, SPLIT, BLOCK_M, BLOCK_N
        )
    if last:
        o_ptrs = out_ptr + offs_m[:, None] * N + offs_n[None, :]
        tl.store(o_ptrs, out.to(tl.bfloat16), mask=m_ok[:, None] & n_ok[None, :])


def w4a16_swapped(x, words, zeros, hi, lo, *, bn=128, warps=8, stages=3, target=4):
    """The swapped probe kernel on decode words (group 128, bf16 activations)."""
    m, k = x.shape
    n = words.shape[1]
    block_m = 16 if m <= 16 else 32
    tiles = -(-n // bn)
    steps = words.shape[0] // 32
    sms = torch.cuda.get_device_properties(x.device).multi_processor_count
    split = _split(tiles, steps, target, sms)
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    part, counts = _workspace(max(split * m * n, 1), max(tiles, 1), x.device)
    w4a16_swapped_kernel[(tiles, split, 1)](
        x, words, zeros, hi, lo, out, part, counts, m, n, k, x.stride(0), block_m, bn,
        steps // split, split, num_warps=warps, num_stages=stages,
    )  # fmt: skip
    return out


def swapped_bench() -> None:
    """The swapped kernel (wgmma, decoded weights as the register operand) against the
    library's words kernel, 8192 × 8192, bf16 activations, fp16 scales, one run."""
    from w4a import copies_for, graph_us

    from floatxq.gptq.decode_words import DecodeOperands, split_scales, stage_decode_words
    from floatxq.kernels.w4a16 import DEFAULT_W4A16_TUNING, _words_linear

    dev = torch.device("cuda")
    n = k = 8192
    gen = torch.Generator(device=dev).manual_seed(0)
    sets = []
    for _ in range(copies_for(n * k // 2)):
        codes = torch.randint(0, 16, (k, n), device=dev, generator=gen)
        zeros = torch.randint(0, 16, (k // 128, n), device=dev, generator=gen).to(torch.uint8)
        scales = (torch.rand(k // 128, n, device=dev, generator=gen) * 0.01 + 0.001).half()
        split = split_scales(scales, torch.bfloat16)
        ops = DecodeOperands(stage_decode_words(codes), zeros, split.hi, split.lo)
        sets.append((codes, scales, ops))
    c0, s0, o0 = sets[0]
    zeros_k = o0.zeros.repeat_interleave(128, 0).long()
    ref_w = (s0.float().repeat_interleave(128, 0) * (c0 - zeros_k)).to(torch.bfloat16).float()
    for m in (1, 16, 32):
        x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
        ref = x.float() @ ref_w
        lib = graph_us([lambda s=s, o=o: _words_linear(x, o, s, None, k, n, 128, dev,
                        DEFAULT_W4A16_TUNING) for _, s, o in sets])  # fmt: skip
        print(f"M={m} library words kernel: {lib:.2f} us", flush=True)
        shapes = ((128, 8, 3, 4), (128, 4, 3, 4), (64, 4, 3, 4), (128, 8, 4, 2), (256, 8, 3, 2),
                  (128, 8, 2, 8))  # fmt: skip
        for bn, warps, stages, target in shapes:
            try:
                got = w4a16_swapped(x, o0.words, o0.zeros, o0.hi, o0.lo, bn=bn, warps=warps,
                                    stages=stages, target=target)  # fmt: skip
                err = float((got.float() - ref).norm() / ref.norm())
                us = graph_us([lambda o=o: w4a16_swapped(
                    x, o.words, o.zeros, o.hi, o.lo, bn=bn, warps=warps, stages=stages,
                    target=target) for _, _, o in sets])  # fmt: skip
                print(f"M={m} swapped bn={bn} warps={warps} stages={stages} target={target}: "
                      f"{us:.2f} us err {err:.1e}", flush=True)  # fmt: skip
            except Exception as exc:
                print(f"M={m} swapped {bn}/{warps}/{stages}: {type(exc).__name__}: {exc!s:.200}")


if __name__ == "__main__":
    if "--compare-library" in sys.argv:
        compare_library()
    elif "--swapped" in sys.argv:
        swapped_bench()
    else:
        main()
