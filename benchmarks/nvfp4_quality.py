"""NVFP4 quality on the trained tiny Llama: floatxq's rows through the lifecycle, vs the anchor.

Run: python benchmarks/nvfp4_quality.py [--anchor /tmp/nvfp4_anchor.json] [--out q.json]

Model, calibration and evaluation are those of ``benchmarks/llmcompressor_nvfp4_anchor.py``
(which writes the ``--anchor`` JSON): ``floatxq.tiny.TINY_LLAMA_DIR`` in bfloat16,
``floatxq.tiny.calibration_samples(num_samples=128, seq_len=256)``, and 64 windows of 256 tokens
of the evaluation split, scored by ``floatxq.lifecycle.evaluate.evaluate_lm`` against the bf16
model (perplexity, mean KL(reference ‖ model) in nats, top-1 agreement). ``lm_head`` stays bf16.

Each row is ``floatxq.load(model, quantize_config=NVFP4Config(recipe=R, method=M,
activations=A)).quantize(...)``, the model then running ``TorchFP4Linear`` modules: ``R`` each
block-scale recipe of ``floatxq.formats.NVFP4_RECIPES`` (``exhaustive``, all 126 E4M3 scales per
block, only when named in ``--recipes``: it takes minutes per module group on a CPU), ``M`` in
``rtn`` / ``gptq``, ``A`` None (NVFP4A16) or ``"nvfp4"`` (W4A4, static input scales calibrated on
the samples). RTN NVFP4A16 needs no data and is given none; the other rows get the samples.

The time of a row is its quantize call, wall clock and process CPU time (the load is not timed;
one untimed RTN run goes first, and the rows that need no data are timed by the fastest of
``--repeats`` runs, each from a freshly loaded model).
With ``--anchor``, a second table gives each row's KL over the anchor's for the same activation
kind (llm-compressor ``NVFP4A16`` for weight-only rows, ``NVFP4`` for W4A4), checked against the
goals (:data:`GOALS`: ✓ when the ratio is at most the goal), and the anchor's ``oneshot`` time
over the row's. A third table ranks the RTN NVFP4A16 recipes by KL gained over ``nvidia`` per
second of quantize time (the default-recipe question). The JSON (``--out``) holds every row,
the settings, versions and the comparisons.
"""

import argparse
import datetime
import json
import os
import pathlib
import platform
import sys
import time
import traceback
from typing import Any

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

GOALS: dict[str, float] = {"NVFP4A16": 0.8, "NVFP4": 0.9}
"""Anchor scheme → the largest floatxq KL / anchor KL that meets the goal."""

ACTIVATIONS: dict[str, str | None] = {"A16": None, "W4A4": "nvfp4"}
"""Row suffix → ``NVFP4Config.activations``."""

METHODS: tuple[str, ...] = ("rtn", "gptq")


def anchor_scheme(activations: str | None) -> str:
    """The llm-compressor preset a row is compared with: weight-only → ``NVFP4A16``, W4A4 →
    ``NVFP4``."""
    return "NVFP4A16" if activations is None else "NVFP4"


def row_name(recipe: str, method: str, activations: str | None) -> str:
    """``recipe/method/A16`` or ``recipe/method/W4A4``."""
    return f"{recipe}/{method}/{'A16' if activations is None else 'W4A4'}"


def plan_rows(recipes: list[str], methods: list[str], kinds: list[str]) -> dict[str, dict]:
    """Row name → settings (``recipe``, ``method``, ``activations``), recipes outermost."""
    rows = {}
    for recipe in recipes:
        for kind in kinds:
            for method in methods:
                activations = ACTIVATIONS[kind]
                rows[row_name(recipe, method, activations)] = {
                    "recipe": recipe,
                    "method": method,
                    "activations": activations,
                }
    return rows


def anchor_report(anchor: dict, scheme: str) -> dict | None:
    """The anchor's report for ``scheme``: the reloaded model's, else the in-memory one's."""
    record = anchor.get("schemes", {}).get(scheme)
    if record is None:
        return None
    return record.get("reloaded") or record.get("in_memory")


def compare(results: dict[str, dict], anchor: dict) -> dict[str, dict]:
    """Each evaluated row against the anchor scheme of its activation kind.

    Returns row → ``scheme``, ``kl``, ``anchor_kl``, ``kl_ratio`` (row / anchor), ``goal``,
    ``met`` (``kl_ratio <= goal``), ``perplexity_ratio``, ``seconds``, ``anchor_seconds`` and
    ``anchor_over_row_seconds``; rows without an evaluation or an anchor scheme are left out.
    """
    out: dict[str, dict] = {}
    for name, record in results.items():
        if "eval" not in record:
            continue
        scheme = anchor_scheme(record["settings"]["activations"])
        theirs = anchor_report(anchor, scheme)
        if theirs is None:
            continue
        ours = record["eval"]
        ratio = ours["kl_divergence"] / theirs["kl_divergence"]
        a_seconds = anchor["schemes"][scheme]["oneshot_seconds"]
        out[name] = {
            "scheme": scheme,
            "kl": ours["kl_divergence"],
            "anchor_kl": theirs["kl_divergence"],
            "kl_ratio": ratio,
            "goal": GOALS[scheme],
            "met": ratio <= GOALS[scheme],
            "perplexity_ratio": ours["perplexity"] / theirs["perplexity"],
            "seconds": record["seconds"],
            "anchor_seconds": a_seconds,
            "anchor_over_row_seconds": a_seconds / record["seconds"],
        }
    return out


def format_comparison(comparison: dict[str, dict]) -> list[str]:
    """The comparison as text lines: KL, the anchor's, the ratio, the goal mark, times."""
    head = (
        f"{'row':<34} | {'anchor':<8} | {'KL nats':>9} | {'anchor KL':>9} | {'KL ratio':>8} | "
        f"{'goal':>6} | {'wall s':>7} | {'anchor s / s':>12}"
    )
    lines = [head, "-" * len(head)]
    for name, e in comparison.items():
        goal = f"≤{e['goal']:.1f} {'✓' if e['met'] else '✗'}"
        lines.append(
            f"{name:<34} | {e['scheme']:<8} | {e['kl']:>9.5f} | {e['anchor_kl']:>9.5f} | "
            f"{e['kl_ratio']:>8.3f} | {goal:>6} | {e['seconds']:>7.2f} | "
            f"{e['anchor_over_row_seconds']:>11.2f}x"
        )
    return lines


def rtn_a16_tradeoff(results: dict[str, dict], *, baseline: str = "nvidia") -> dict[str, dict]:
    """RTN NVFP4A16 recipes against ``baseline``'s RTN NVFP4A16 row: KL, quantize seconds, the
    fraction of the baseline's KL removed, and that fraction per extra second (None for the
    baseline itself, or when a recipe is not slower).

    Returns recipe → that record, in the order of ``results``; empty without the baseline row.
    """
    base = results.get(row_name(baseline, "rtn", None))
    if base is None or "eval" not in base:
        return {}
    base_kl, base_s = base["eval"]["kl_divergence"], base["seconds"]
    out = {}
    for record in results.values():
        settings = record.get("settings", {})
        if "eval" not in record or settings.get("method") != "rtn" or settings["activations"]:
            continue
        kl, seconds = record["eval"]["kl_divergence"], record["seconds"]
        gain = (base_kl - kl) / base_kl
        extra = seconds - base_s
        out[settings["recipe"]] = {
            "kl": kl,
            "seconds": seconds,
            "kl_gain": gain,
            "gain_per_extra_second": gain / extra if extra > 0 else None,
        }
    return out


def format_tradeoff(tradeoff: dict[str, dict]) -> list[str]:
    """The RTN NVFP4A16 trade-off as text lines."""
    head = f"{'recipe':<24} | {'KL nats':>9} | {'quantize s':>10} | {'KL gain':>8} | {'gain/s':>8}"
    lines = [head, "-" * len(head)]
    for recipe, e in tradeoff.items():
        per = e["gain_per_extra_second"]
        lines.append(
            f"{recipe:<24} | {e['kl']:>9.5f} | {e['seconds']:>10.3f} | {e['kl_gain']:>7.1%} | "
            f"{'' if per is None else f'{per:.3f}':>8}"
        )
    return lines


def run_row(
    settings: dict[str, Any],
    samples: list[torch.Tensor],
    *,
    device: torch.device,
    batch_size: int,
    repeats: int = 1,
) -> tuple[torch.nn.Module, dict[str, Any]]:
    """Quantize the tiny Llama through the lifecycle; the quantized model and the run's record.

    A row that needs no calibration (RTN NVFP4A16: seconds at most) is quantized ``repeats``
    times from a fresh model and timed by its fastest run; the last model is returned.
    """
    count = 1 if _needs_calibration(settings) else max(repeats, 1)
    runs = [
        _quantize_once(settings, samples, device=device, batch_size=batch_size)
        for _ in range(count)
    ]
    model, record = runs[-1]
    record["seconds_all"] = [r["seconds"] for _, r in runs]
    record["seconds"] = min(record["seconds_all"])
    record["cpu_seconds"] = min(r["cpu_seconds"] for _, r in runs)
    return model, record


def _needs_calibration(settings: dict[str, Any]) -> bool:
    return settings["method"] == "gptq" or settings["activations"] is not None


def _quantize_once(
    settings: dict[str, Any],
    samples: list[torch.Tensor],
    *,
    device: torch.device,
    batch_size: int,
) -> tuple[torch.nn.Module, dict[str, Any]]:
    import floatxq
    from floatxq import NVFP4Config
    from floatxq.nn.fp4_linear import TorchFP4Linear
    from floatxq.tiny import load_tiny_llama

    config = NVFP4Config(**settings)
    model = load_tiny_llama(dtype=torch.bfloat16, device=device)
    qm = floatxq.load(model, quantize_config=config, device=device, dtype=torch.bfloat16)
    data = samples if config.needs_calibration else None
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start, cpu_start = time.perf_counter(), time.process_time()
    qm.quantize(data, batch_size=batch_size, progress=False)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    record: dict[str, Any] = {
        "seconds": time.perf_counter() - start,
        "cpu_seconds": time.process_time() - cpu_start,
        "quantize_seconds": qm.quantize_seconds,
        "calibrated": config.needs_calibration,
    }
    packed = {n: m for n, m in qm.model.named_modules() if isinstance(m, TorchFP4Linear)}
    if not packed or any(not n.startswith("model.layers.") for n in packed):
        raise RuntimeError(
            f"nvfp4_quality: expected decoder TorchFP4Linear only, got {list(packed)}"
        )
    with_input = [n for n, m in packed.items() if getattr(m, "input_scale", None) is not None]
    if len(with_input) != (len(packed) if config.activations else 0):
        raise RuntimeError(
            f"nvfp4_quality: {len(with_input)} of {len(packed)} modules have an input_scale "
            f"for activations={config.activations!r}"
        )
    record["nvfp4_linears"] = len(packed)
    modules = getattr(qm.report, "modules", None) if config.needs_calibration else None
    if modules:
        losses = [m.loss for m in modules if m.loss is not None]
        rtn_losses = [m.rtn_loss for m in modules if m.rtn_loss is not None]
        record["loss_sum"] = sum(losses) if losses else None
        record["rtn_loss_sum"] = sum(rtn_losses) if rtn_losses else None
        scales = [m.input_scale for m in modules if m.input_scale is not None]
        record["input_scale_range"] = [min(scales), max(scales)] if scales else None
    return qm.model, record


def main() -> int:
    from floatxq.formats import NVFP4_RECIPES

    default_recipes = [r for r in NVFP4_RECIPES if r != "exhaustive"]
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--samples", type=int, default=128, help="calibration samples")
    parser.add_argument("--seq-len", type=int, default=256, help="tokens per sample and window")
    parser.add_argument("--windows", type=int, default=64, help="evaluation windows")
    parser.add_argument("--batch-size", type=int, default=8, help="calibration batch")
    parser.add_argument("--eval-batch-size", type=int, default=8)
    parser.add_argument("--recipes", nargs="*", default=default_recipes, choices=NVFP4_RECIPES)
    parser.add_argument("--methods", nargs="*", default=list(METHODS), choices=METHODS)
    parser.add_argument("--kinds", nargs="*", default=list(ACTIVATIONS), choices=list(ACTIVATIONS))
    parser.add_argument("--repeats", type=int, default=3, help="timed runs of uncalibrated rows")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    parser.add_argument("--anchor", default=None, help="JSON from llmcompressor_nvfp4_anchor.py")
    parser.add_argument("--out", default=None, help="write the JSON record here")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    import transformers

    from floatxq.lifecycle.evaluate import evaluate_lm, reference_logprobs
    from floatxq.tiny import calibration_samples, load_tiny_llama, token_windows

    device = torch.device(args.device)
    samples = calibration_samples(num_samples=args.samples, seq_len=args.seq_len)
    windows = token_windows("evaluation", seq_len=args.seq_len, max_windows=args.windows)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(
        f"# NVFP4 quality  {datetime.date.today()}  {name}  threads {torch.get_num_threads()}  "
        f"torch {torch.__version__}  transformers {transformers.__version__}  "
        f"load {' '.join(f'{x:.2f}' for x in os.getloadavg())}"
    )
    print(
        f"tiny Llama bf16; {len(samples)} calibration samples × {args.seq_len}; "
        f"{windows.shape[0]} evaluation windows × {windows.shape[1]}; lm_head bf16",
        flush=True,
    )
    reference = load_tiny_llama(dtype=torch.bfloat16, device=device)
    ref_logprobs = reference_logprobs(reference, windows, batch_size=args.eval_batch_size)
    bf16 = evaluate_lm(reference, windows, reference=ref_logprobs, batch_size=args.eval_batch_size)
    del reference

    # warm-up, untimed: the first quantize of a process pays one-off costs (imports, first calls)
    _quantize_once(plan_rows(["nvidia"], ["rtn"], ["A16"])["nvidia/rtn/A16"], samples,
                   device=device, batch_size=args.batch_size)  # fmt: skip
    rows = plan_rows(args.recipes, args.methods, args.kinds)
    results: dict[str, dict[str, Any]] = {}
    failed: list[str] = []
    header = (
        f"{'row':<34} | {'perplexity':>10} | {'KL nats':>9} | {'top-1':>7} | {'wall s':>7} | "
        f"{'CPU s':>7}"
    )
    print(header)
    print("-" * len(header))
    print(f"{'bf16':<34} | {bf16.perplexity:>10.4f} |")
    for row, settings in rows.items():
        try:
            model, record = run_row(
                settings, samples, device=device, batch_size=args.batch_size, repeats=args.repeats
            )
        except Exception as exc:  # record and go on: one broken row must not hide the others
            failed.append(row)
            results[row] = {"settings": settings, "error": f"{type(exc).__name__}: {exc}"}
            print(f"{row:<34} | FAILED {type(exc).__name__}: {exc}", flush=True)
            traceback.print_exc()
            continue
        report = evaluate_lm(
            model, windows, reference=ref_logprobs, batch_size=args.eval_batch_size
        )
        del model
        record.update(settings=settings, loadavg=list(os.getloadavg()), eval=report._asdict())
        results[row] = record
        print(
            f"{row:<34} | {report.perplexity:>10.4f} | {report.kl_divergence:>9.5f} | "
            f"{report.top1_agreement:>7.4f} | {record['seconds']:>7.2f} | "
            f"{record['cpu_seconds']:>7.2f}",
            flush=True,
        )

    comparison = None
    if args.anchor:
        anchor = json.loads(pathlib.Path(args.anchor).read_text())
        a_set = anchor["settings"]
        mismatch = [
            f"{k}: anchor {a_set.get(k)} vs {v}"
            for k, v in (("samples", len(samples)), ("seq_len", args.seq_len),
                         ("windows", int(windows.shape[0])))
            if a_set.get(k) != v
        ]  # fmt: skip
        if mismatch:
            print(f"WARNING: the anchor was measured differently ({'; '.join(mismatch)})")
        for scheme in GOALS:
            rep = anchor_report(anchor, scheme)
            if rep is not None:
                print(
                    f"anchor {scheme}: llm-compressor {anchor['versions'].get('llmcompressor')}, "
                    f"perplexity {rep['perplexity']:.4f}, KL {rep['kl_divergence']:.5f}, "
                    f"top-1 {rep['top1_agreement']:.4f}, oneshot "
                    f"{anchor['schemes'][scheme]['oneshot_seconds']:.2f} s"
                )
        comparison = compare(results, anchor)
        print()
        print("\n".join(format_comparison(comparison)))
    tradeoff = rtn_a16_tradeoff(results)
    if tradeoff:
        print("\nRTN NVFP4A16: KL removed relative to nvidia, per extra second of quantize time")
        print("\n".join(format_tradeoff(tradeoff)))

    if args.out:
        payload = {
            "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
            "host": {
                "device": name,
                "processor": platform.processor() or "cpu",
                "cpu_count": os.cpu_count(),
                "threads": torch.get_num_threads(),
                "loadavg": list(os.getloadavg()),
            },
            "versions": {"torch": torch.__version__, "transformers": transformers.__version__},
            "settings": {
                "samples": len(samples),
                "seq_len": args.seq_len,
                "windows": int(windows.shape[0]),
                "batch_size": args.batch_size,
                "eval_batch_size": args.eval_batch_size,
                "lm_head": False,
            },
            "bf16": bf16._asdict(),
            "rows": results,
            "anchor": args.anchor,
            "comparison": comparison,
            "rtn_a16_tradeoff": tradeoff,
        }
        pathlib.Path(args.out).write_text(json.dumps(payload, indent=2) + "\n")
        print(f"wrote {args.out}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
