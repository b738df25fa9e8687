"""Time GPTQ onto the NVFP4 grid (CUDA-graph column loop and Triton block kernel) against INT4 GPTQ.

Usage (GPU): ``python3 benchmarks/nvfp4_gptq_solve.py --out /tmp/nvfp4-gptq-solve.json``
(``--sweep`` also times the Triton kernel's tunings; ``--shapes 4096x4096,512x14336`` picks
shapes as ``rows x in``).

For each weight shape of a Llama-3-8B layer, ``(out, in)`` = 4096×4096 (q/o), 4096×14336
(down), 14336×4096 (gate/up), one FP32 weight (N(0, 0.02²)) and one random PSD Hessian
``2/N · XᵀX`` (N = 4096 inputs: a rank-64 part plus noise, per-input scales over four binades)
are drawn on the GPU, and each solve is timed (median of ``--repeats`` after a warm-up, the
device synchronized around each call):

- ``int4``: :func:`floatxq.gptq_solve` at its defaults (4-bit, group 128, act-group-aware
  order), the INT4 solve the NVFP4 goal is measured against (≤ 1.2× its time);
- ``graph``: :func:`floatxq.nvfp4_gptq_solve` (``nvidia`` recipe; each block's column loop a
  replayed CUDA graph of torch kernels);
- ``fast``: :func:`floatxq.kernels.nvfp4_gptq_solve_fast` (the Triton block kernel; what the
  lifecycle runs on CUDA), checked to give ``graph``'s bytes;
- ``shared``: the part both NVFP4 solves share (checks, block scales, the damped inverse's
  factor, losses, packing: ``_prepare`` + ``_finish``), the floor no column loop can go under.

Prints a table and writes every figure, the device and the versions to ``--out`` as JSON.
"""

import argparse
import datetime
import json
import pathlib
import statistics
import sys
import time

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import triton

from floatxq.gptq.nvfp4_grid import _finish, _prepare, nvfp4_gptq_solve
from floatxq.gptq.solve import GPTQSolveOptions, gptq_solve
from floatxq.kernels.nvfp4_gptq import NVFP4GPTQTuning, nvfp4_gptq_solve_fast
from floatxq.nvfp4.quantize import nvfp4_global_scale

SHAPES = ((4096, 4096), (4096, 14336), (14336, 4096))
SWEEP = [(b, w) for b in (2, 4, 8, 16, 32) for w in (1, 2, 4, 8) if b * 128 >= 32 * w]


def problem(rows: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator(device="cuda").manual_seed(seed)
    n = 4096
    x = torch.randn(n, 64, generator=g, device="cuda") @ torch.randn(
        64, k, generator=g, device="cuda"
    )
    x += 0.3 * torch.randn(n, k, generator=g, device="cuda")
    x *= torch.exp2(torch.randint(-2, 2, (1, k), generator=g, device="cuda").float())
    hessian = 2 * x.T @ x / n
    del x
    weight = torch.randn(rows, k, generator=g, device="cuda") * 0.02
    return weight, hessian


def timed(fn, repeats: int) -> tuple[float, object]:
    """``(median ms, last result)`` after one untimed warm-up."""
    result = fn()
    times = []
    for _ in range(repeats):
        result = None
        torch.cuda.synchronize()
        start = time.perf_counter()
        result = fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times), result


def same_bytes(a, b) -> bool:
    return (
        torch.equal(a.packed, b.packed)
        and torch.equal(a.block_scales.view(torch.uint8), b.block_scales.view(torch.uint8))
        and torch.equal(a.loss.view(torch.int32), b.loss.view(torch.int32))
        and torch.equal(a.rtn_loss.view(torch.int32), b.rtn_loss.view(torch.int32))
        and a.solved == b.solved
    )


def measure(rows: int, k: int, seed: int, args: argparse.Namespace) -> dict:
    """Time the three solves (and the sweep) on one shape; print its rows; return its figures."""
    weight, hessian = problem(rows, k, seed)
    gs = nvfp4_global_scale(weight.abs().amax())
    int4_ms, _ = timed(lambda: gptq_solve(weight, hessian, GPTQSolveOptions()), args.repeats)
    graph_ms, graph = timed(lambda: nvfp4_gptq_solve(weight, hessian, gs), args.repeats)
    fast_ms, fast = timed(lambda: nvfp4_gptq_solve_fast(weight, hessian, gs), args.repeats)
    values = torch.empty_like(weight)

    def shared():
        prep = _prepare(
            weight, hessian, gs, recipe="nvidia", damp_percent=0.01, blocksize=128,
            where="benchmark",
        )  # fmt: skip
        return _finish(prep, values.copy_(prep.w32), hessian)

    shared_ms, _ = timed(shared, args.repeats)
    same = same_bytes(fast, graph)
    row = {
        "rows": rows, "in": k, "int4_ms": int4_ms, "graph_ms": graph_ms, "fast_ms": fast_ms,
        "shared_ms": shared_ms, "graph_over_int4": graph_ms / int4_ms,
        "fast_over_int4": fast_ms / int4_ms, "same_bytes": same, "solved": graph.solved,
    }  # fmt: skip
    print(f"{f'{rows}x{k}':>13} {int4_ms:9.1f} {graph_ms:9.1f} {fast_ms:9.1f} "
          f"{shared_ms:9.1f} {graph_ms / int4_ms:10.2f} {fast_ms / int4_ms:9.2f} "
          f"{same!s:>10}")  # fmt: skip
    if args.sweep:
        row["sweep"] = []
        for block_rows, warps in SWEEP:
            tuning = NVFP4GPTQTuning(block_rows=block_rows, warps=warps)
            ms, out = timed(
                lambda t=tuning: nvfp4_gptq_solve_fast(weight, hessian, gs, tuning=t),
                args.repeats,
            )
            ok = same_bytes(out, graph)
            row["sweep"].append({"block_rows": block_rows, "warps": warps, "ms": ms,
                                 "same_bytes": ok})  # fmt: skip
            print(f"{'':>13}   block_rows {block_rows:2d} warps {warps}: {ms:9.1f} ms "
                  f"(same bytes: {ok})")  # fmt: skip
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=pathlib.Path, help="write the figures as JSON here")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--sweep", action="store_true", help="also time the kernel's tunings")
    parser.add_argument("--shapes", help="rows x in, comma-separated (default: the 8B shapes)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA device")
        return 1
    shapes = SHAPES
    if args.shapes:
        shapes = tuple(tuple(int(v) for v in s.split("x")) for s in args.shapes.split(","))
    record = {
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "int4_options": repr(GPTQSolveOptions()),
        "repeats": args.repeats,
        "results": [],
    }
    print(f"{record['date']}  {record['device']}  torch {torch.__version__}  triton "
          f"{triton.__version__}")  # fmt: skip
    head = (f"{'rows x in':>13} {'int4 ms':>9} {'graph ms':>9} {'fast ms':>9} {'shared ms':>9} "
            f"{'graph/int4':>10} {'fast/int4':>9} {'same bytes':>10}")  # fmt: skip
    print(head)
    for index, (rows, k) in enumerate(shapes):
        record["results"].append(measure(rows, k, index, args))
        torch.cuda.empty_cache()
    if args.out:
        args.out.write_text(json.dumps(record, indent=2) + "\n")
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
