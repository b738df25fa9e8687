# ruff: noqa: B023  (each lambda is timed within its own loop iteration)
"""What bounds the decode-sized INT4 GEMMs (N = K = 8192, M = 1 and 16) on an H200.

Usage (GPU): ``python3 benchmarks/w4a_limits.py``

A decode-sized call must stream the packed weight (33.6 MB for 8192 × 8192 at 4 bits, scales
included) from HBM; the goals (3× bf16 ``F.linear``, 1.8× FP8 ``_scaled_mm``) ask for about
11 µs, 1.4× the copy-bandwidth floor. This script measures, in one run (median GPU µs of CUDA
graph replays cycling through five weight copies, so nothing is served from L2):

- the HBM floor: the weight's bytes at the measured device-to-device copy bandwidth;
- probes with the shipped kernels' grid, tiles and pipelining (128 × 4 programs of 64 columns
  and 16 words per step), adding one cost at a time: the loads alone (the words summed as
  integers), then the in-register unpack to ``code - 8`` in FP16 (summed), then the FP16
  tensor-core product with the activation tile;
- the shipped kernels (``fp8_linear_prepacked`` on the words, the fused W4A16 kernel) and
  torch's tinygemm INT4 kernel (a hand-written CUDA GEMV, the peer floor).

For ``fp8_pack`` (8192 × 8192 bf16 in, E4M3 codes and row scales out) the same style of
probes, one row per program: a plain cast of each element to E4M3 (no amax: the copy-like
floor of one read and one narrower write), then the row amax and a multiply by the inverse
scale (one read of the row held in registers; not the exact quotient), then IEEE division
(``div_rn``) as the contract requires; next to them the shipped kernel and a bf16 copy.

The probes are benchmark-only kernels (never called by the library).
"""

import pathlib
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from w4a import _gptq, _tinygemm, graph_us

import floatxq as fq
from floatxq.kernels._w4a_jit import unpack_fields

N = K = 8192


@triton.jit
def probe(a_ptr, w_ptr, out_ptr, N, K, M: tl.constexpr, STAGE: tl.constexpr,
          BLOCK_N: tl.constexpr, GROUP_ITERS: tl.constexpr):  # fmt: skip
    pid_n, pid_k = tl.program_id(0), tl.program_id(1)
    offs_m = tl.arange(0, 16)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, 128)
    m_ok = offs_m < M
    total = tl.zeros([16, BLOCK_N], tl.float32)
    count = tl.zeros([16, BLOCK_N], tl.int32)
    for gi in range(GROUP_ITERS):
        g = pid_k * GROUP_ITERS + gi
        rows = g * 16 + offs_m
        words = tl.load(w_ptr + rows[:, None] * N + offs_n[None, :])
        if STAGE == 0:  # loads only
            count += words
        else:
            c = (unpack_fields(words, 4, 128, BLOCK_N) - 8).to(tl.float16)
            if STAGE == 1:  # + unpack
                total += tl.sum(c.to(tl.float32), axis=0)[None, :]
            else:  # + tensor-core product
                a = tl.load(
                    a_ptr + offs_m[:, None] * K + (g * 128 + offs_k)[None, :],
                    mask=m_ok[:, None],
                    other=0,
                ).to(tl.float8e4nv, bitcast=True)
                total += tl.dot(a.to(tl.float16), c, out_dtype=tl.float32)
    tl.atomic_add(out_ptr + offs_m[:, None] * N + offs_n[None, :],
                  total + count.to(tl.float32), mask=m_ok[:, None])  # fmt: skip


@triton.jit
def pack_probe(x_ptr, q_ptr, s_ptr, K, MODE: tl.constexpr, BLOCK_K: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK_K)
    x = tl.load(x_ptr + row.to(tl.int64) * K + cols).to(tl.float32)
    if MODE == 0:  # a plain cast, no amax
        y = x
    else:
        scale = tl.max(tl.abs(x), axis=0) / 448.0
        tl.store(s_ptr + row, scale)
        if MODE == 1:
            y = x * (1.0 / scale)
        else:
            y = tl.math.div_rn(x, tl.full([BLOCK_K], 1.0, tl.float32) * scale)
    tl.store(q_ptr + row.to(tl.int64) * K + cols, y.to(tl.float8e4nv))


def pack_limits() -> None:
    x = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    xs = [x.clone() for _ in range(2)]
    out = torch.empty_like(x)
    q = torch.empty(8192, 8192, device="cuda", dtype=torch.float8_e4m3fn)
    s = torch.empty(8192, device="cuda")
    copy_us = graph_us([lambda t=t: out.copy_(t) for t in xs])
    cells = []
    for mode in range(3):
        cells.append(
            graph_us(
                [
                    lambda t=t: pack_probe[(8192,)](t, q, s, 8192, mode, 8192, num_warps=8)
                    for t in xs
                ]
            )
        )
    shipped = graph_us([lambda t=t: fq.fp8_pack(t) for t in xs])
    moved = 8192 * 8192 * 3
    print("| fp8_pack probe | us | x copy bandwidth |\n|---|---|---|")
    for label, us in (("bf16 copy (anchor)", copy_us), ("plain cast", cells[0]),
                      ("amax + multiply", cells[1]), ("amax + IEEE division", cells[2]),
                      ("shipped fp8_pack", shipped)):  # fmt: skip
        ratio = (moved if label != "bf16 copy (anchor)" else 8192 * 8192 * 4) / us
        print(f"| {label} | {us:.1f} | {ratio / (8192 * 8192 * 4 / copy_us):.3f} |")


def main() -> None:
    props = torch.cuda.get_device_properties(0)
    print(f"# {props.name}, torch {torch.__version__}")
    gptq = [_gptq(N, K, i) for i in range(5)]
    weight_bytes = gptq[0].qweight.numel() * 4 + gptq[0].scales.numel() * 2
    x = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    xs = [x.clone() for _ in range(2)]
    out = torch.empty_like(x)
    copy_us = graph_us([lambda t=t: out.copy_(t) for t in xs])
    bandwidth = 2 * x.numel() * 2 / copy_us / 1e6
    print(f"copy bandwidth {bandwidth:.2f} TB/s; weight {weight_bytes / 1e6:.1f} MB -> HBM floor "
          f"{weight_bytes / bandwidth / 1e6:.1f} us")  # fmt: skip
    tiny = [_tinygemm(N, K) for _ in range(5)]
    dense = [torch.randn(N, K, device="cuda", dtype=torch.bfloat16) for _ in range(2)]
    print("| M | loads | + unpack | + FP16 MMA | w4a-fp8 words | w4a16 fused | tinygemm | "
          "bf16 |\n|---|---|---|---|---|---|---|---|")  # fmt: skip
    for m in (1, 16):
        xm = torch.randn(m, K, device="cuda", dtype=torch.bfloat16)
        codes, rs = fq.fp8_pack(xm)
        acc = torch.zeros(m, N, device="cuda")
        stages = []
        for stage in range(3):
            stages.append(graph_us([
                lambda p=p: probe[(N // 64, 4)](codes.view(torch.int8), p.qweight, acc, N, K, m,
                                                stage, 64, 16)
                for p in gptq
            ], calls=10))  # fmt: skip
        shipped = graph_us([lambda p=p: fq.fp8_linear_prepacked(
            codes, rs, p.qweight, p.scales, None, torch.bfloat16)
            for p in gptq], calls=10)  # fmt: skip
        w16 = graph_us([lambda p=p: fq.w4a16_linear_kernel(xm, p, group_size=128)
                        for p in gptq], calls=10)  # fmt: skip
        tg = graph_us([lambda t=t: torch._weight_int4pack_mm(xm, t[0], 128, t[1]) for t in tiny],
                      calls=10) if tiny[0] is not None else float("nan")  # fmt: skip
        bf = graph_us([lambda w=w: torch.nn.functional.linear(xm, w) for w in dense], calls=10)
        print(f"| {m} | {stages[0]:.1f} | {stages[1]:.1f} | {stages[2]:.1f} | {shipped:.1f} | "
              f"{w16:.1f} | {tg:.1f} | {bf:.1f} |", flush=True)  # fmt: skip
    pack_limits()


if __name__ == "__main__":
    main()
