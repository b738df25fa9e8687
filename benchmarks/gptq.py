"""Time ``floatxq.gptq_solve`` against a torch-eager textbook GPTQ in the same run.

Usage (GPU): ``python3 benchmarks/gptq.py`` (4096² and 8192², 4-bit, group 128).
CPU smoke run: ``python3 benchmarks/gptq.py --small``.

Both solvers see the same weight and Hessian (FP32; the Hessian folded from correlated random
inputs) and the same settings: 4-bit, symmetric, group 128, blocks of 128, damp 0.05, no
reordering (``desc_act=False, act_group_aware=False``: the textbook has neither). The textbook is
the algorithm as usually written: one Python iteration and about ten eager kernels per column on a
row-major ``W``, group parameters at each group's first column, and one GEMM per block. The
script prints the date, device, torch version, shape, milliseconds of each (median of
``--repeats`` after a warm-up), the speedup, the fraction of equal codes, each solve's peak extra
device memory, and the Hessian-weighted error ``tr((W-Q) H (W-Q)ᵀ)`` of both and of RTN.
"""

import argparse
import datetime
import pathlib
import platform
import statistics
import sys
import time

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from floatxq.gptq.hessian import hessian_finalize, hessian_init, hessian_update
from floatxq.gptq.solve import GPTQSolveOptions, gptq_solve, rtn_quantize

BITS, GROUP, BLOCK, DAMP = 4, 128, 128, 0.05


def textbook_gptq(weight: torch.Tensor, hessian: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The textbook solve (eager, row-major ``W``); returns ``(dequantized, codes)``."""
    maxq = torch.tensor(2**BITS - 1, dtype=torch.float32, device=weight.device)
    w_all = weight.clone().float()
    h = hessian.clone().float()
    columns = w_all.shape[1]
    dead = torch.diag(h) == 0
    h[dead, dead] = 1
    w_all[:, dead] = 0
    h.diagonal().add_(DAMP * torch.mean(torch.diag(h)))
    hinv = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(h)), upper=True)
    q_all = torch.zeros_like(w_all)
    group_scales, group_zeros = [], []
    scale = zero = None
    for i1 in range(0, columns, BLOCK):
        i2 = min(i1 + BLOCK, columns)
        w_block = w_all[:, i1:i2].clone()
        q_block = torch.zeros_like(w_block)
        err_block = torch.zeros_like(w_block)
        h_block = hinv[i1:i2, i1:i2]
        for i in range(i2 - i1):
            if (i1 + i) % GROUP == 0:
                x = w_all[:, i1 + i : i1 + i + GROUP]
                zeros = torch.zeros(x.shape[0], device=x.device)
                xmin = torch.minimum(x.min(1)[0], zeros)
                xmax = torch.maximum(x.max(1)[0], zeros)
                xmax = torch.maximum(xmin.abs(), xmax)
                xmin = torch.where(xmin < 0, -xmax, xmin)
                both = (xmin == 0) & (xmax == 0)
                xmin = torch.where(both, -1.0, xmin)
                xmax = torch.where(both, 1.0, xmax)
                scale = ((xmax - xmin) / maxq).unsqueeze(1)
                zero = torch.full_like(scale, (2**BITS) / 2)
                group_scales.append(scale)
                group_zeros.append(zero)
            w = w_block[:, i]
            d = h_block[i, i]
            c = torch.clamp(torch.round(w.unsqueeze(1) / scale) + zero, 0, maxq)
            q = (scale * (c - zero)).flatten()
            q_block[:, i] = q
            err = (w - q) / d
            w_block[:, i:] -= err.unsqueeze(1).matmul(h_block[i, i:].unsqueeze(0))
            err_block[:, i] = err
        q_all[:, i1:i2] = q_block
        w_all[:, i2:] -= err_block.matmul(hinv[i1:i2, i2:])
    scales = torch.cat(group_scales, 1).repeat_interleave(GROUP, 1)[:, :columns]
    zeros = torch.cat(group_zeros, 1).repeat_interleave(GROUP, 1)[:, :columns]
    codes = torch.clamp(torch.round(q_all / scales) + zeros, 0, 2**BITS - 1).to(torch.uint8)
    return q_all, codes


def make_problem(out: int, k: int, device: torch.device, seed: int) -> tuple[torch.Tensor, ...]:
    """A weight and the Hessian of correlated inputs, drawn on the CPU, multiplied on ``device``."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    mix = (torch.randn(k, k, generator=g) / k**0.5).to(device) + torch.eye(k, device=device)
    state = hessian_init(k, device=device)
    for _ in range(2):  # two calibration batches of k tokens
        state = hessian_update(state, torch.randn(k, k, generator=g).to(device) @ mix)
    weight = (torch.randn(out, k, generator=g) * 0.02).to(device)
    return weight, hessian_finalize(state)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, device: torch.device, repeats: int) -> tuple[float, object, float]:
    """``(median ms, last result, peak extra MiB of the last run)`` after one untimed warm-up."""
    fn()
    times, result, peak = [], None, float("nan")
    for _ in range(repeats):
        result = None  # free the previous result before measuring
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
            base = torch.cuda.memory_allocated(device)
        sync(device)
        start = time.perf_counter()
        result = fn()
        sync(device)
        times.append((time.perf_counter() - start) * 1e3)
        if device.type == "cuda":
            peak = (torch.cuda.max_memory_allocated(device) - base) / 2**20
    return statistics.median(times), result, peak


def weighted_error(weight: torch.Tensor, q: torch.Tensor, hessian: torch.Tensor) -> float:
    d = (weight - q).float()
    return float(((d @ hessian) * d).sum())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small", action="store_true", help="CPU-sized shapes (512, 1024)")
    parser.add_argument("--sizes", type=int, nargs="*", help="square sizes (default by mode)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    device = torch.device(args.device)
    sizes = args.sizes or ([512, 1024] if args.small else [4096, 8192])
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor()
    print(f"date: {datetime.datetime.now().astimezone().isoformat(timespec='seconds')}")
    print(f"device: {device} ({name or 'cpu'}); torch {torch.__version__}")
    print(f"setting: {BITS}-bit sym, group {GROUP}, block {BLOCK}, damp {DAMP}, FP32, no reorder")
    options = GPTQSolveOptions(
        bits=BITS, group_size=GROUP, sym=True, desc_act=False, act_group_aware=False
    )
    header = (
        f"{'shape':>11} | {'textbook ms':>11} | {'floatxq ms':>10} | {'speedup':>7} | "
        f"{'codes equal':>11} | {'eager ms':>8} | {'GAR ms':>7} | {'MiB tb/fx':>11} | "
        f"{'H-err tb / fx / rtn':>26}"
    )
    print(header)
    print("-" * len(header))
    for n in sizes:
        weight, hessian = make_problem(n, n, device, seed=n)
        tb_ms, (tb_q, tb_codes), tb_mib = timed(
            lambda w=weight, h=hessian: textbook_gptq(w, h), device, args.repeats
        )
        fx_ms, fx, fx_mib = timed(
            lambda w=weight, h=hessian: gptq_solve(w, h, options), device, args.repeats
        )
        eager_ms, _, _ = timed(
            lambda w=weight, h=hessian: gptq_solve(w, h, options, cuda_graph=False), device, 1
        )
        gar_ms, _, _ = timed(  # the default options: group-aware reordering on
            lambda w=weight, h=hessian: gptq_solve(w, h, GPTQSolveOptions()), device, 1
        )
        equal = float((fx.codes == tb_codes).double().mean())
        rtn = rtn_quantize(weight, options)
        errors = [
            weighted_error(weight, q, hessian) for q in (tb_q, fx.dequantized, rtn.dequantized)
        ]
        print(
            f"{f'{n}x{n}':>11} | {tb_ms:>11.1f} | {fx_ms:>10.1f} | {tb_ms / fx_ms:>6.2f}x | "
            f"{equal:>11.6f} | {eager_ms:>8.1f} | {gar_ms:>7.1f} | "
            f"{f'{tb_mib:.0f}/{fx_mib:.0f}':>11} | "
            f"{' / '.join(f'{e:.4g}' for e in errors):>26}",
            flush=True,
        )
        del weight, hessian, tb_q, tb_codes, fx, rtn
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
