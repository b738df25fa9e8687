"""GSQ's refinement at 8B shapes: ``refine_fp8_codes`` on one Llama-3-8B decoder layer's modules.

Run (one H200): python benchmarks/gsq_solve.py [--format e4m3] [--steps 100] [--out s.json]

For each of the seven projections of a Llama-3-8B decoder layer (q, k, v, o: 4096 inputs; gate,
up: 14336×4096; down: 4096×14336) a random bf16 weight N(0, 0.02²), its round-to-nearest FP8
codes with row scales, and a Hessian ``2·XᵀX/n`` of ``--tokens`` random rows with a spread of
per-input scales (so the Hessian is far from the identity) go through
``floatxq.refine_fp8_codes_auto`` (``--route eager``: ``floatxq.refine_fp8_codes``; default
``GSQConfig`` unless ``--steps``/``--candidates``), timed with CUDA synchronisation, after one
untimed warm-up call on a small problem (which pays the compile). Printed: seconds
per module, the layer's total and ×32 (the 8B model's refinement time), objective before →
after, codes changed, and ``torch.cuda.max_memory_allocated``.

``--profile`` times one step's parts instead, at 4096², 1024×4096 and 4096×14336 with 5
candidates on random FP64 state (mean of 20 calls): the FP64 GEMM ``e·H`` (FP32's beside it),
and the two elementwise halves (``floatxq.gsq._soft_error``, ``_adam_update``) eager and
compiled (``floatxq.kernels.gsq``).
"""

import argparse
import datetime
import json
import pathlib
import sys
import time

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

SHAPES: dict[str, tuple[int, int]] = {
    "q_proj": (4096, 4096),
    "k_proj": (1024, 4096),
    "v_proj": (1024, 4096),
    "o_proj": (4096, 4096),
    "gate_proj": (14336, 4096),
    "up_proj": (14336, 4096),
    "down_proj": (4096, 14336),
}
"""Llama-3-8B's decoder-layer projections, ``(out, in)``."""


def hessian(k: int, tokens: int, device: torch.device, seed: int) -> torch.Tensor:
    """``2·XᵀX/n`` of random rows with per-input scales spread over two decades."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    x = torch.randn(tokens, k, generator=g).to(device)
    x *= torch.logspace(-1, 1, k, device=device)[torch.randperm(k, generator=g).to(device)]
    return 2.0 * x.T @ x / tokens


def _ms(fn, repeats: int = 20) -> float:
    """Mean milliseconds of ``fn()`` on CUDA after one warm-up call."""
    fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / repeats * 1e3


def profile(device: torch.device, candidates: int = 5) -> dict:
    """Milliseconds of one step's parts at three shapes: the FP64 GEMM ``e·H`` (and FP32's, for
    comparison), and each elementwise half eager and compiled (random FP64 state)."""
    from floatxq.gsq import NOISE_TABLE_BITS, _adam_update, _soft_error
    from floatxq.kernels.gsq import compiled_steps

    out = {}
    f64 = {"device": device, "dtype": torch.float64}
    for rows, cols in ((4096, 4096), (1024, 4096), (4096, 14336)):
        h = torch.randn(cols, cols, **f64)
        h = h @ h.T / cols
        e = torch.randn(rows, cols, **f64)
        e32, h32 = e.float(), h.float()
        row = {"dgemm": _ms(lambda e=e, h=h: e @ h), "sgemm": _ms(lambda a=e32, b=h32: a @ b)}
        del h32, e32
        theta = torch.randn(rows, cols, candidates, **f64)
        m, v, values = torch.zeros_like(theta), torch.zeros_like(theta), torch.randn_like(theta)
        w, slope = torch.randn(rows, cols, **f64), torch.randn(rows, cols, **f64)
        table = torch.randn(1 << NOISE_TABLE_BITS, **f64)
        size = 1 << NOISE_TABLE_BITS
        ro = torch.randint(0, size, (rows,), device=device, dtype=torch.int32)
        co = torch.randint(0, size, (cols, candidates), device=device, dtype=torch.int32)
        s = torch.tensor(0.7, **f64)
        for name, (soft, adam) in (("eager", (_soft_error, _adam_update)),
                                   ("compiled", compiled_steps(candidates))):  # fmt: skip
            p, err = soft(theta, table, ro, co, values, w, s)
            args = (theta, table, ro, co, values, w, s)
            row[f"soft_{name}"] = _ms(lambda f=soft, a=args: f(*a))
            adam_args = (theta, m, v, p, values, w - err, slope, s, s)
            row[f"adam_{name}"] = _ms(lambda f=adam, a=adam_args: f(*a))
        out[f"{rows}x{cols}"] = row
        print(f"{rows:5d}×{cols:<6d} " + "  ".join(f"{k} {v:.2f} ms" for k, v in row.items()),
              flush=True)  # fmt: skip
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--format", default="e4m3")
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--candidates", type=int, default=None)
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--modules", nargs="+", default=list(SHAPES))
    parser.add_argument(
        "--route", default="auto", choices=["auto", "eager"],
        help="auto: floatxq.refine_fp8_codes_auto (compiled steps on CUDA); eager: the pure one",
    )  # fmt: skip
    parser.add_argument("--out", default=None)
    parser.add_argument(
        "--profile", action="store_true",
        help="time one step's parts (GEMM, each elementwise half eager and compiled) and stop",
    )  # fmt: skip
    args = parser.parse_args()

    from floatxq import GSQConfig, quantize_fp8_weight, refine_fp8_codes, refine_fp8_codes_auto

    refine = refine_fp8_codes_auto if args.route == "auto" else refine_fp8_codes

    device = torch.device(args.device)
    cuda = device.type == "cuda"
    name = torch.cuda.get_device_name(device) if cuda else "cpu"
    print(f"# GSQ solve  {datetime.date.today()}  {name}  torch {torch.__version__}", flush=True)
    if args.profile:
        parts = profile(device)
        if args.out:
            pathlib.Path(args.out).write_text(json.dumps({"profile": parts}, indent=1) + "\n")
        return 0
    extra = {k: v for k, v in (("steps", args.steps), ("candidates", args.candidates)) if v}
    config = GSQConfig(**extra)
    w = torch.randn(64, 256, device=device).to(torch.bfloat16)  # warm-up
    q = quantize_fp8_weight(w, format=args.format)
    refine(w, q.qweight, q.scale_inv, hessian=hessian(256, 512, device, 0), config=config)
    rows = {}
    for i, module in enumerate(args.modules):
        out, k = SHAPES[module]
        g = torch.Generator(device="cpu").manual_seed(10 + i)
        w = (torch.randn(out, k, generator=g) * 0.02).to(torch.bfloat16).to(device)
        h = hessian(k, args.tokens, device, 100 + i)
        q = quantize_fp8_weight(w, format=args.format)
        if cuda:
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
        start = time.perf_counter()
        r = refine(w, q.qweight, q.scale_inv, hessian=h, config=config)
        if cuda:
            torch.cuda.synchronize(device)
        seconds = time.perf_counter() - start
        peak = torch.cuda.max_memory_allocated(device) / 2**30 if cuda else None
        rows[module] = {
            "shape": [out, k], "seconds": seconds, "before": float(r.objective_before),
            "after": float(r.objective_after), "changed": int(r.changed),
            "codes": out * k, "peak_gib": peak,
        }  # fmt: skip
        print(f"{module:10s} {out:6d}×{k:<6d} {seconds:7.2f} s  objective "
              f"{float(r.objective_before):.3e} → {float(r.objective_after):.3e} "
              f"({float(r.objective_after) / float(r.objective_before):.3f}×)  changed "
              f"{int(r.changed) / (out * k):.1%}  peak {peak or 0:.1f} GiB",
              flush=True)  # fmt: skip
        del w, h, q, r
    layer = sum(r["seconds"] for r in rows.values())
    print(f"layer: {layer:.1f} s; ×32 layers: {32 * layer:.0f} s ({32 * layer / 60:.1f} min)")
    if args.out:
        record = {
            "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
            "device": name, "torch": torch.__version__, "format": args.format,
            "config": repr(config), "route": args.route, "tokens": args.tokens, "modules": rows,
            "layer_seconds": layer,
        }  # fmt: skip
        pathlib.Path(args.out).write_text(json.dumps(record, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
