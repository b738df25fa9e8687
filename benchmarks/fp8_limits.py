"""What bounds the tensorwise forward against raw ``torch._scaled_mm`` (N = K = 8192, bf16).

Usage (GPU): ``python3 benchmarks/fp8_limits.py``

A raw ``_scaled_mm`` call starts from FP8 codes of ``x``; a layer starts from bf16 ``x`` and
must first find x's amax over the whole tensor (per-tensor scaling) before any code exists.
This script measures, in one run, the floors that follow (GPU microseconds per call, median of
CUDA-graph replays):

- **16 rows**: stripped-down probes of the fused kernel's product (the shipped swap-AB tile:
  weight tile as the tall MMA operand, 128 x 256 tiles, K split 2, 8 warps, 4 stages), adding
  one cost at a time: the bare product on FP8 ``x`` codes, FP32 promotion every 32 products,
  the split-K reduction through memory, then ``x`` read as bf16 and cast to FP8 in the loop
  (a plain saturating cast with a fixed scale: cheaper than the exact encoder). The last probe
  is the fused kernel without any amax; next to it, the cost of one grid barrier (each program
  reduces a slice, an atomic maximum, a cooperative launch) and the shipped kernel itself.
- **4096 rows**: cuBLAS with and without the bias epilogue on the same codes, the shipped
  two-launch input quantizer, a one-launch quantizer that reads ``x`` a second time right
  after a grid barrier (last rows first, so the second pass can hit L2), and the bandwidth
  floors of one and two passes over ``x`` at the measured copy bandwidth.

The probes are benchmark-only kernels (never called by the library); each one's product is
checked against cuBLAS before it is timed.
"""

import pathlib
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from fp8_small_m_sweep import graph_us

N = K = 8192


@triton.jit
def product_probe(
    xq_ptr, x_ptr, w_ptr, part_ptr, out_ptr, count_ptr, N, K, M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, K_ITERS: tl.constexpr,
    SPLIT: tl.constexpr, PROMOTE: tl.constexpr, REDUCE: tl.constexpr, CAST: tl.constexpr,
):  # fmt: skip
    pid_n, pid_k = tl.program_id(0), tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, M)
    offs_k = tl.arange(0, BLOCK_K)
    n_ok = offs_n < N
    acc = tl.zeros([BLOCK_N, M], tl.float32)
    for ki in range(K_ITERS):
        kk = (pid_k * K_ITERS + ki) * BLOCK_K + offs_k
        k_ok = kk < K
        w = tl.load(
            w_ptr + offs_n.to(tl.int64)[:, None] * K + kk[None, :],
            mask=n_ok[:, None] & k_ok[None, :],
            other=0.0,
        )
        x_offs = offs_m[:, None] * K + kk[None, :]
        if CAST:  # bf16 x, scaled and cast to E4M3 here
            y = tl.load(x_ptr + x_offs, mask=k_ok[None, :], other=0.0).to(tl.float32) * 16.0
            xq = tl.where(y > 448.0, 448.0, tl.where(y < -448.0, -448.0, y)).to(tl.float8e4nv)
        else:
            xq = tl.load(xq_ptr + x_offs, mask=k_ok[None, :], other=0.0)
        if PROMOTE:
            acc = tl.dot(w, tl.trans(xq), acc, max_num_imprecise_acc=32)
        else:
            acc = tl.dot(w, tl.trans(xq), acc)
    p_offs = offs_n.to(tl.int64)[:, None] + offs_m[None, :] * N
    if REDUCE:  # as the shipped kernel: the last split to arrive sums the partials
        tl.store(part_ptr + pid_k * M * N + p_offs, acc)
        tl.debug_barrier()
        if tl.atomic_add(count_ptr + pid_n, 1, sem="acq_rel", scope="gpu") == SPLIT - 1:
            tl.debug_barrier()
            acc = tl.zeros([BLOCK_N, M], tl.float32)
            for j in range(SPLIT):
                acc += tl.load(part_ptr + j * M * N + p_offs, cache_modifier=".cg")
            tl.atomic_xchg(count_ptr + pid_n, 0, sem="relaxed", scope="gpu")
            tl.store(out_ptr + p_offs, acc)
    else:  # partials only (summed outside, not timed)
        tl.store(part_ptr + pid_k * M * N + p_offs, acc)


@triton.jit
def _grid_max(sync_ptr, value, n_prog):
    """Grid-wide maximum of ``value`` (non-negative int32) behind a barrier: the shipped
    kernel's scheme (generation word, arrival count, two banks)."""
    gen = tl.atomic_add(sync_ptr, 0, sem="relaxed", scope="gpu")
    bank = sync_ptr + 2 + (gen & 1)
    tl.atomic_max(bank, value, sem="relaxed", scope="gpu")
    if tl.atomic_add(sync_ptr + 1, 1, sem="acq_rel", scope="gpu") == n_prog - 1:
        tl.store(sync_ptr + 2 + ((gen + 1) & 1), 0)
        tl.atomic_xchg(sync_ptr + 1, 0, sem="relaxed", scope="gpu")
        tl.atomic_xchg(sync_ptr, gen + 1, sem="release", scope="gpu")
    else:
        while tl.atomic_add(sync_ptr, 0, sem="acquire", scope="gpu") == gen:
            pass
    return tl.atomic_max(bank, 0, sem="relaxed", scope="gpu")


@triton.jit
def slice_max(x_ptr, out_ptr, sync_ptr, C, WIDTH: tl.constexpr, BARRIER: tl.constexpr):
    pid = tl.program_id(0)
    offs = tl.arange(0, WIDTH)
    v = tl.load(x_ptr + pid.to(tl.int64) * C + offs, mask=offs < C, other=0.0)
    best = tl.max(v.to(tl.float32).to(tl.int32, bitcast=True) & 0x7FFFFFFF, axis=0)
    if BARRIER:
        best = _grid_max(sync_ptr, best, tl.num_programs(0))
    tl.store(out_ptr + pid, best)


@triton.jit
def quantize_one_launch(
    x_ptr, q_ptr, sync_ptr, R, C: tl.constexpr, TILE_C: tl.constexpr, ITERS: tl.constexpr
):
    pid, n_prog = tl.program_id(0), tl.num_programs(0)
    offs = tl.arange(0, TILE_C)
    wide = tl.zeros([TILE_C], tl.int32)
    for i in range(ITERS):  # rows pid, pid + n_prog, ...
        row = pid + i * n_prog
        for j in tl.static_range(C // TILE_C):
            v = tl.load(x_ptr + row.to(tl.int64) * C + j * TILE_C + offs, mask=row < R)
            wide = tl.maximum(wide, v.to(tl.float32).to(tl.int32, bitcast=True) & 0x7FFFFFFF)
    amax = _grid_max(sync_ptr, tl.max(wide, axis=0), n_prog).to(tl.float32, bitcast=True)
    inv = 448.0 / tl.maximum(amax, 1e-30)
    for i2 in range(ITERS):  # last rows first: the ones most likely still in L2
        row = pid + (ITERS - 1 - i2) * n_prog
        for j in tl.static_range(C // TILE_C):
            at = row.to(tl.int64) * C + (C // TILE_C - 1 - j) * TILE_C + offs
            y = tl.load(x_ptr + at, mask=row < R, eviction_policy="evict_first") * inv
            y = tl.where(y > 448.0, 448.0, tl.where(y < -448.0, -448.0, y))
            tl.store(q_ptr + at, y.to(tl.float8e4nv), mask=row < R, cache_modifier=".cs")


def sixteen_rows(q, bias) -> None:
    from floatxq.kernels import fp8_small_m

    m, (block_n, block_k, split) = 16, (128, 256, 2)
    x = torch.randn(m, K, device="cuda", dtype=torch.bfloat16)
    xq = (x.float() * 16).clamp(-448, 448).to(torch.float8_e4m3fn)
    one = torch.ones((), device="cuda")
    wt = q.qweight.t()
    raw = graph_us(lambda: torch._scaled_mm(xq, wt, one, one, out_dtype=torch.bfloat16))
    raw_bias = graph_us(lambda: torch._scaled_mm(xq, wt, one, one, bias, None, torch.bfloat16))
    expected = torch._scaled_mm(xq, wt, one, one, out_dtype=torch.float32)
    print(f"== 16 rows: raw _scaled_mm (FP8 x, no bias) {raw:.2f} us, with bias {raw_bias:.2f}")
    part = torch.empty(split, m, N, device="cuda")
    out = torch.empty(m, N, device="cuda")
    count = torch.zeros(N // block_n, dtype=torch.int32, device="cuda")
    floor = None
    for label, promote, reduce, cast in (
        ("product on FP8 x codes", 0, 0, 0),
        ("+ FP32 promotion every 32 products", 1, 0, 0),
        ("+ split-K reduction through memory", 1, 1, 0),
        ("+ bf16 x cast to FP8 in the loop (no amax)", 1, 1, 1),
    ):

        def launch(promote=promote, reduce=reduce, cast=cast):
            product_probe[(N // block_n, split)](
                xq, x, q.qweight, part, out, count, N, K, m, block_n, block_k,
                K // block_k // split, split, promote, reduce, cast, num_warps=8, num_stages=4,
            )  # fmt: skip

        launch()
        got = out if reduce else part.sum(0)
        # (a wrong or dropped tile is off by the order of the largest output)
        torch.testing.assert_close(got, expected, rtol=0, atol=1e-2 * expected.abs().max())
        floor = graph_us(launch)
        print(f"   {label:48s} {floor:6.2f} us   raw / this {raw / floor:.3f}")
    programs = (N // block_n) * split
    rows = torch.randn(programs, 2048, device="cuda", dtype=torch.bfloat16)
    maxima = torch.empty(programs, dtype=torch.int32, device="cuda")
    sync = torch.zeros(4, dtype=torch.int32, device="cuda")
    plain = graph_us(lambda: slice_max[(programs,)](rows, maxima, sync, 2048, 2048, False))
    barrier = graph_us(
        lambda: slice_max[(programs,)](
            rows, maxima, sync, 2048, 2048, True, launch_cooperative_grid=True
        )
    )
    assert int(maxima[0]) == int(rows.float().abs().max().view(torch.int32))
    cost = barrier - plain
    print(f"   grid barrier for x's amax ({programs} programs, cooperative)   +{cost:5.2f} us")
    sw = 1 / q.scale_inv
    shipped = graph_us(lambda: fp8_small_m._launch(x, q.qweight, sw, bias, "tensorwise"))
    print(
        f"   floor without amax + barrier = {floor + cost:.2f} us (raw / that "
        f"{raw / (floor + cost):.3f}); shipped fp8_small_m {shipped:.2f} us (raw / shipped "
        f"{raw / shipped:.3f})"
    )


def many_rows(q, bias) -> None:
    from floatxq.kernels import fp8_weight

    m = 4096
    x = torch.randn(m, K, device="cuda", dtype=torch.bfloat16)
    scale = torch.empty((), device="cuda")
    codes = fp8_weight.quantize_fp8_input(
        x, format="float8_e4m3fn", method="tensor", block=None, scale_out=scale
    )
    wt = q.qweight.t()
    sw = 1 / q.scale_inv
    raw = graph_us(lambda: torch._scaled_mm(codes, wt, scale, sw, out_dtype=torch.bfloat16))
    raw_bias = graph_us(lambda: torch._scaled_mm(codes, wt, scale, sw, bias, None, torch.bfloat16))
    two_launch = graph_us(
        lambda: fp8_weight.quantize_fp8_input(
            x, format="float8_e4m3fn", method="tensor", block=None, scale_out=scale
        )
    )
    sync = torch.zeros(4, dtype=torch.int32, device="cuda")
    mine = torch.empty_like(codes)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    programs = 4 * sms
    one_launch = graph_us(
        lambda: quantize_one_launch[(programs,)](
            x,
            mine,
            sync,
            m,
            K,
            2048,
            -(-m // programs),
            num_warps=8,
            launch_cooperative_grid=True,
        )
    )
    mismatch = (mine.view(torch.uint8) != codes.view(torch.uint8)).float().mean().item()
    src = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    copy_gbs = 2 * src.numel() / graph_us(lambda: dst.copy_(src)) / 1e3
    x_bytes, code_bytes = x.numel() * 2, x.numel()
    one_pass = (x_bytes + code_bytes) / copy_gbs / 1e3
    two_pass = (2 * x_bytes + code_bytes) / copy_gbs / 1e3
    print(f"== 4096 rows: raw _scaled_mm {raw:.1f} us, with the bias epilogue {raw_bias:.1f} us")
    print(
        f"   copy bandwidth {copy_gbs:.0f} GB/s; x {x_bytes >> 20} MiB bf16, "
        f"codes {code_bytes >> 20} MiB"
    )
    print(f"   shipped input quantizer (amax launch + quantize launch)  {two_launch:6.1f} us")
    print(
        f"   one launch, second pass after a grid barrier (L2 reuse) {one_launch:6.1f} us "
        f"(codes differing from the exact encoder: {mismatch:.1e})"
    )
    print(f"   floor at copy bandwidth: two passes {two_pass:5.1f} us, one pass {one_pass:5.1f} us")
    for label, quant in (("shipped", two_launch), ("two-pass floor", two_pass)):
        total = raw_bias + quant
        print(
            f"   cuBLAS with bias + {label:15s} {total:6.1f} us: raw / that {raw / total:.3f}, "
            f"raw with bias / that {raw_bias / total:.3f}"
        )


def main() -> None:
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/fp8_limits.py needs a CUDA device")
    import floatxq as fq

    torch.manual_seed(0)
    print(f"== {torch.cuda.get_device_properties(0).name}, N = K = {N}, bf16; graph-replay us")
    q = fq.quantize_fp8_weight(
        torch.randn(N, K, device="cuda", dtype=torch.bfloat16), weight_scale_method="tensor"
    )
    bias = torch.randn(N, device="cuda", dtype=torch.bfloat16)
    sixteen_rows(q, bias)
    many_rows(q, bias)


if __name__ == "__main__":
    main()
