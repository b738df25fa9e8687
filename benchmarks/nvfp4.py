# ruff: noqa: B023, B905  (each lambda is timed within its own loop iteration)
"""NVFP4 on an H200: the packer for every recipe, and the emulated W4A-NVFP4 linear.

Usage (GPU): ``python3 benchmarks/nvfp4.py [pack] [linear] [sweep] [--rows 1,16,4096]``
(no section: pack and linear).

Every figure is the median GPU time per call over CUDA-graph replays (``graph_us`` of
``benchmarks/w4a.py``: several copies of each operand, together at least three times the L2
cache, so nothing is served from L2).

- ``pack``: :func:`floatxq.kernels.nvfp4_pack_and_swizzle` on 8192×8192 bf16 for every recipe,
  as effective bandwidth (bytes read + written: 2 per input element, 1/2 per code, 1/16 per
  scale) over the bandwidth of a plain copy of the same tensor, timed in the same run; beside
  it the pure torch reference (:func:`floatxq.nvfp4_pack_swizzled`, eager) and,
  where torchao imports, torchao's ``NVFP4Tensor.to_nvfp4`` (eager).
- ``linear``: for M ∈ {1, 16, 4096} and (N, K) ∈ {(8192, 8192), (28672, 8192), (8192,
  28672)}, bf16 activations: bf16 ``F.linear``; FP8 ``torch._scaled_mm`` rowwise on already
  quantized operands; floatxq's emulated W4A-NVFP4 GEMM alone on packed activations
  (``nvfp4_linear_prepacked``: int32 words up to 64 rows, the staged K-contiguous E4M3 operand
  above) and the whole linear with the packer (``least_squares`` and ``nvidia``).
- ``sweep``: packer rows per program and warps for each recipe; GEMM tiles at M = 4096.
"""

import pathlib
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

from w4a import _gptq, _option, copies_for, eager_us, graph_us

import floatxq as fq
from floatxq.gptq.planes import centered_int4, int4_to_e4m3
from floatxq.kernels import nvfp4 as nvfp4_kernels
from floatxq.nvfp4.operand import nvfp4_pack_swizzled

SHAPES = ((8192, 8192), (28672, 8192), (8192, 28672))
ROWS = (1, 16, 4096)
RECIPES = ("nvidia", "four_six", "least_squares", "least_squares_grid", "exhaustive")
GOALS = {"nvidia": 0.6, "four_six": 0.5, "least_squares": 0.4, "least_squares_grid": 0.25,
         "exhaustive": 0.1}  # fmt: skip


def _torchao_to_nvfp4():
    try:
        from torchao.prototype.mx_formats.nvfp4_tensor import NVFP4Tensor
    except Exception as exc:  # not installed here: reported, not timed
        print(f"torchao unavailable: {type(exc).__name__}: {str(exc)[:80]}")
        return None
    return NVFP4Tensor.to_nvfp4


def pack_bench(tuning=nvfp4_kernels.DEFAULT_NVFP4_TUNING, *, anchors=True) -> None:
    x = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    xs = [x.clone() for _ in range(2)]
    out = torch.empty_like(x)
    copy_us = graph_us([lambda t=t: out.copy_(t) for t in xs])
    copy_bw = 2 * x.numel() * 2 / copy_us / 1e6
    moved = x.numel() * 2 + x.numel() // 2 + x.numel() // 16
    g = fq.nvfp4_global_scale(x.float().abs().amax(), grid_dtype=x.dtype)
    print(f"copy 8192x8192 bf16: {copy_us:.1f} us, {copy_bw:.2f} TB/s")
    print("| recipe | us | effective TB/s | × copy | goal | torch reference us | speedup |")
    print("|---|---|---|---|---|---|---|")
    for recipe in RECIPES:
        t = graph_us([lambda t=t: nvfp4_kernels.nvfp4_pack_and_swizzle(t, g, recipe=recipe,
                                                                       tuning=tuning)
                      for t in xs])  # fmt: skip
        bw = moved / t / 1e6
        ref = float("nan")
        if anchors and recipe != "exhaustive":  # (the eager exhaustive reference takes minutes)
            ref = eager_us(lambda: nvfp4_pack_swizzled(x, g, recipe=recipe), calls=3)
        print(f"| {recipe} | {t:.1f} | {bw:.3f} | {bw / copy_bw:.3f} | {GOALS[recipe]} | "
              f"{ref:.0f} | {ref / t:.0f}× |", flush=True)  # fmt: skip
    to_nvfp4 = _torchao_to_nvfp4() if anchors else None
    if to_nvfp4 is not None:
        try:
            t = eager_us(lambda: to_nvfp4(x, per_tensor_scale=g), calls=10)
        except Exception as exc:  # an API change: reported, not timed
            print(f"torchao to_nvfp4 failed: {type(exc).__name__}: {str(exc)[:100]}")
            return
        bw = moved / t / 1e6
        print(f"| torchao to_nvfp4 (eager) | {t:.1f} | {bw:.3f} | {bw / copy_bw:.3f} | | | |")


def linear_bench() -> None:
    print("| N | K | M | bf16 us | fp8 scaled_mm us | nvfp4 gemm us | nvfp4 linear (lsq) us | "
          "nvfp4 linear (nvidia) us | gemm / fp8 | linear / fp8 | gemm / bf16 |")  # fmt: skip
    print("|---" * 11 + "|")
    for n, k in SHAPES:
        dense = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
                 for _ in range(copies_for(n * k * 2))]  # fmt: skip
        fp8 = [(torch.randn(n, k, device="cuda").to(torch.float8_e4m3fn),
                torch.rand(1, n, device="cuda")) for _ in range(copies_for(n * k))]  # fmt: skip
        gptq = [_gptq(n, k, i) for i in range(copies_for(n * k // 2))]
        staged = [
            int4_to_e4m3(centered_int4(p)).T.contiguous().T for p in gptq[: copies_for(n * k)]
        ]
        for m in _option("--rows", ROWS):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            xq = x.to(torch.float8_e4m3fn)
            sa = torch.rand(m, 1, device="cuda")
            g = fq.nvfp4_global_scale(x.float().abs().amax(), grid_dtype=x.dtype)
            codes, scales = nvfp4_kernels.nvfp4_pack_and_swizzle(x, g)
            t_bf16 = graph_us([lambda w=w: F.linear(x, w) for w in dense])
            t_fp8 = graph_us([
                lambda w=w, s=s: torch._scaled_mm(xq, w.t(), sa, s, out_dtype=torch.bfloat16)
                for w, s in fp8
            ])  # fmt: skip
            words = fq.dispatch.nvfp4_operand(m) == "words"
            weights = [p.qweight for p in gptq] if words else staged
            t_gemm = graph_us([lambda w=w, p=p: nvfp4_kernels.nvfp4_linear_prepacked(
                codes, scales, g, w, p.scales, output_dtype=torch.bfloat16)
                for w, p in zip(weights, gptq)])  # fmt: skip
            t_lsq = graph_us([lambda w=w, p=p: nvfp4_kernels.nvfp4_linear(
                x, w, p.scales, global_scale=g) for w, p in zip(weights, gptq)])  # fmt: skip
            t_nv = graph_us([lambda w=w, p=p: nvfp4_kernels.nvfp4_linear(
                x, w, p.scales, global_scale=g, recipe="nvidia")
                for w, p in zip(weights, gptq)])  # fmt: skip
            print(
                f"| {n} | {k} | {m} | {t_bf16:.1f} | {t_fp8:.1f} | {t_gemm:.1f} | {t_lsq:.1f} | "
                f"{t_nv:.1f} | {t_fp8 / t_gemm:.2f} | {t_fp8 / t_lsq:.2f} | "
                f"{t_bf16 / t_gemm:.2f} |",
                flush=True,
            )
            if m == 4096:
                flop = 2 * m * n * k
                print(f"|   |   | TFLOP/s | {flop / t_bf16 / 1e6:.0f} | {flop / t_fp8 / 1e6:.0f} "
                      f"| {flop / t_gemm / 1e6:.0f} | {flop / t_lsq / 1e6:.0f} | "
                      f"{flop / t_nv / 1e6:.0f} | | | |")  # fmt: skip
        del dense, fp8, gptq, staged
        torch.cuda.empty_cache()


def sweep() -> None:
    for rows, warps in ((16, 4), (32, 4), (32, 8), (64, 8)):
        tuning = nvfp4_kernels.NVFP4Tuning(pack_rows=rows, pack_rows_search=rows, pack_warps=warps)
        print(f"pack_rows={rows} pack_warps={warps}")
        pack_bench(tuning, anchors=False)
    n = k = 8192
    m = 4096
    gptq = [_gptq(n, k, i) for i in range(copies_for(n * k // 2))]
    staged = [int4_to_e4m3(centered_int4(p)).T.contiguous().T for p in gptq[: copies_for(n * k)]]
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    codes, scales = nvfp4_kernels.nvfp4_pack_and_swizzle(x, 0.01)
    for bm, bn, warps, stages, gm in ((128, 128, 8, 3, 8), (128, 256, 8, 3, 8),
                                      (256, 128, 8, 3, 8), (128, 128, 4, 4, 8)):  # fmt: skip
        tuning = nvfp4_kernels.NVFP4Tuning(e4m3_block_m=bm, e4m3_block_n=bn, e4m3_warps=warps,
                                           e4m3_stages=stages, e4m3_group_m=gm)  # fmt: skip
        try:
            t = graph_us([lambda w=w, p=p: nvfp4_kernels.nvfp4_linear_prepacked(
                codes, scales, 0.01, w, p.scales, output_dtype=torch.bfloat16, tuning=tuning)
                for w, p in zip(staged, gptq)])  # fmt: skip
            print(f"gemm M={m} tile {bm}x{bn} warps {warps} stages {stages} group_m {gm}: "
                  f"{t:.1f} us, {2 * m * n * k / t / 1e6:.0f} TFLOP/s", flush=True)  # fmt: skip
        except Exception as exc:  # a tile that does not fit: reported
            print(f"gemm tile {bm}x{bn} w{warps} s{stages}: {type(exc).__name__} {str(exc)[:80]}")


def main() -> None:
    sections = [a for a in sys.argv[1:] if not a.startswith("--") and not a[0].isdigit()]
    print(torch.cuda.get_device_name(), "torch", torch.__version__)
    if not sections or "pack" in sections:
        pack_bench()
    if not sections or "linear" in sections:
        linear_bench()
    if "sweep" in sections:
        sweep()


if __name__ == "__main__":
    main()
