"""GSQ quality on the trained tiny Llama: FP8 round to nearest against GSQ, per format.

Run: python benchmarks/gsq_quality.py [--formats e5m2 e4m3] [--scales row] [--out q.json]
     [--gsq '{"steps": 100}'] [--eval-windows 64] [--calibration-windows 32]

The model is ``floatxq.tiny.load_tiny_llama(dtype=torch.bfloat16)``; the reference is that bf16
model. Calibration is the demo's: ``floatxq.tiny.calibration_samples(num_samples=32,
seq_len=256)``; evaluation is ``--eval-windows`` windows of 256 tokens of the held-out split,
scored by ``floatxq.lifecycle.evaluate.evaluate_lm`` (mean KL(bf16 ‖ model) in nats per token,
perplexity, top-1 agreement). ``lm_head`` stays bf16.

Rows per format and scale layout, each ``floatxq.load(model, quantize_config=FP8Config(...))
.quantize(...)`` on the CPU:

* ``rtn``: round to nearest (no GSQ);
* ``gsq``: weight-only GSQ (``gsq=GSQConfig(**--gsq)``), no data;
* ``gsq-cal``: calibrated GSQ (``gsq_calibration=True``) on the calibration windows.

The comparison table gives each GSQ row's KL over its ``rtn`` row's, checked against the goals
(:data:`GOALS`: calibrated GSQ ≤ 0.9× for E5M2 row scales, ≤ 0.95× for E4M3 row scales), and
for weight-only GSQ whether any module's weight reconstruction error rose (it must not).
"""

import argparse
import copy
import datetime
import json
import pathlib
import platform
import sys
import time

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

GOALS: dict[tuple[str, str], float] = {("e5m2", "row"): 0.9, ("e4m3", "row"): 0.95}
"""(format, scales) → the largest calibrated-GSQ KL / RTN KL that meets the goal."""

BLOCK = [128, 128]


def fp8_config(fmt: str, scales: str, mode: str, gsq: dict):
    """The row's ``FP8Config``: ``mode`` in ``rtn`` / ``gsq`` / ``gsq-cal``."""
    from floatxq import FP8Config, GSQConfig

    layout = {"weight_block_size": BLOCK} if scales == "block" else {"weight_scale_method": scales}
    if mode == "rtn":
        return FP8Config(format=fmt, **layout)
    return FP8Config(format=fmt, **layout, gsq=GSQConfig(**gsq), gsq_calibration=mode == "gsq-cal")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--formats", nargs="+", default=["e5m2", "e4m3"])
    parser.add_argument("--scales", nargs="+", default=["row"])
    parser.add_argument("--modes", nargs="+", default=["rtn", "gsq", "gsq-cal"])
    parser.add_argument("--gsq", default="{}", help="GSQConfig keyword arguments, as JSON")
    parser.add_argument("--eval-windows", type=int, default=64)
    parser.add_argument("--calibration-windows", type=int, default=32)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    import floatxq
    from floatxq.lifecycle.evaluate import evaluate_lm, reference_logprobs
    from floatxq.tiny import calibration_samples, load_tiny_llama, token_windows

    torch.manual_seed(0)
    gsq = json.loads(args.gsq)
    reference = load_tiny_llama(dtype=torch.bfloat16)
    windows = token_windows("evaluation", seq_len=256, max_windows=args.eval_windows)
    refs = reference_logprobs(reference, windows)
    samples = calibration_samples(num_samples=args.calibration_windows, seq_len=256)
    rows: dict[str, dict] = {}
    for fmt in args.formats:
        for scales in args.scales:
            for mode in args.modes:
                name = f"{fmt}/{scales}/{mode}"
                config = fp8_config(fmt, scales, mode, gsq)
                model = floatxq.load(copy.deepcopy(reference), quantize_config=config)
                start = time.perf_counter()
                model.quantize(samples if mode == "gsq-cal" else None, progress=False)
                seconds = time.perf_counter() - start
                report = evaluate_lm(model.model, windows, reference=refs)
                row = {
                    "format": fmt, "scales": scales, "mode": mode, "seconds": seconds,
                    "kl": report.kl_divergence, "perplexity": report.perplexity,
                    "top1": report.top1_agreement,
                }  # fmt: skip
                if model.report is not None:
                    modules = model.report.modules
                    row["modules"] = len(modules)
                    row["changed"] = sum(m.changed for m in modules)
                    row["codes"] = sum(m.codes for m in modules)
                    row["objective_ratio_mean"] = sum(
                        m.objective_after / max(m.objective_before, 1e-300) for m in modules
                    ) / max(len(modules), 1)
                    row["raised"] = sum(m.objective_after > m.objective_before for m in modules)
                rows[name] = row
                print(f"{name:24s} kl {row['kl']:.6f} ppl {row['perplexity']:.4f} "
                      f"top1 {row['top1']:.4f} {seconds:6.1f} s "
                      f"changed {row.get('changed', '-')}", flush=True)  # fmt: skip
    print("\n| format | scales | row | KL / rtn KL | goal | met |")
    print("| --- | --- | --- | --- | --- | --- |")
    comparisons = {}
    for name, row in rows.items():
        if row["mode"] == "rtn":
            continue
        base = rows.get(f"{row['format']}/{row['scales']}/rtn")
        if base is None:
            continue
        ratio = row["kl"] / base["kl"]
        goal = GOALS.get((row["format"], row["scales"])) if row["mode"] == "gsq-cal" else None
        met = "-" if goal is None else ("✓" if ratio <= goal else "✗")
        comparisons[name] = {"ratio": ratio, "goal": goal}
        print(f"| {row['format']} | {row['scales']} | {row['mode']} | {ratio:.3f} | "
              f"{goal if goal is not None else '-'} | {met} |")  # fmt: skip
    if args.out:
        meta = {
            "date": datetime.date.today().isoformat(), "python": platform.python_version(),
            "torch": torch.__version__, "gsq": gsq, "eval_windows": args.eval_windows,
            "calibration_windows": args.calibration_windows, "threads": torch.get_num_threads(),
        }  # fmt: skip
        pathlib.Path(args.out).write_text(
            json.dumps({"meta": meta, "rows": rows, "comparisons": comparisons}, indent=1)
        )


if __name__ == "__main__":
    main()
