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
    args = parser.parse_args()

    from floatxq import GSQConfig, quantize_fp8_weight, refine_fp8_codes, refine_fp8_codes_auto

    refine = refine_fp8_codes_auto if args.route == "auto" else refine_fp8_codes

    device = torch.device(args.device)
    cuda = device.type == "cuda"
    name = torch.cuda.get_device_name(device) if cuda else "cpu"
    print(f"# GSQ solve  {datetime.date.today()}  {name}  torch {torch.__version__}", flush=True)
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
