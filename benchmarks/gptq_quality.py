"""GPTQ quality on the trained tiny Llama: floatxq's RTN and GPTQ rows, optionally vs the anchor.

Run: python benchmarks/gptq_quality.py [--device cpu] [--anchor /tmp/anchor.json] [--out q.json]

Model, calibration and evaluation are those of ``benchmarks/llmcompressor_gptq_anchor.py`` (which
writes the ``--anchor`` JSON): ``floatxq.tiny.TINY_LLAMA_DIR`` in bfloat16,
``floatxq.tiny.calibration_samples(num_samples=128, seq_len=256)``, and 64 windows of 256 tokens of
the evaluation split, scored by ``floatxq.lifecycle.evaluate.evaluate_lm`` against the bf16
model (perplexity, mean KL(reference ‖ model) in nats, top-1 agreement). Every row is 4-bit,
symmetric, with ``lm_head`` left in bf16:

- ``rtn-g128``, ``rtn-g32``: ``floatxq.rtn_quantize`` on each decoder Linear, written back as
  dense bf16 weights (quantize-dequantize; no calibration).
- ``gptq-g128`` (the default: ``act_group_aware=True``), ``gptq-g32``, ``gptq-g128-desc``
  (``desc_act=True``), ``gptq-g128-plain`` (no reordering): ``floatxq.load(model,
  quantize_config=GPTQConfig(...)).quantize(samples)``, the model then running ``GPTQLinear``.
- ``gptq-g128-llmc``: the anchor's settings as far as they map (``desc_act`` with
  ``static_groups``, which is llm-compressor's ``actorder="static"``, and ``damp_percent=0.01``).

The time of each row is its quantize call, wall clock and process CPU time (the model load is
not timed). With ``--anchor``, a second table gives floatxq's perplexity and KL over the anchor's
and the anchor's ``oneshot`` time over floatxq's (both measured on whatever shared CPU ran them:
note the load; CPU time is the steadier of the two there, ``--threads 1`` steadier still).
The JSON (``--out``) holds every row, the settings and versions.
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
import transformers

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import floatxq
from floatxq import GPTQConfig, GPTQSolveOptions, rtn_quantize
from floatxq.lifecycle.evaluate import EvalReport, evaluate_lm, reference_logprobs
from floatxq.tiny import calibration_samples, load_tiny_llama, token_windows

ROWS: dict[str, dict[str, Any]] = {
    "rtn-g128": {"kind": "rtn", "group_size": 128},
    "rtn-g32": {"kind": "rtn", "group_size": 32},
    "gptq-g128": {"kind": "gptq", "group_size": 128},  # act_group_aware=True, the default
    "gptq-g32": {"kind": "gptq", "group_size": 32},
    "gptq-g128-desc": {
        "kind": "gptq",
        "group_size": 128,
        "desc_act": True,
        "act_group_aware": False,
    },
    "gptq-g128-plain": {"kind": "gptq", "group_size": 128, "act_group_aware": False},
    "gptq-g128-llmc": {
        "kind": "gptq",
        "group_size": 128,
        "desc_act": True,
        "static_groups": True,
        "act_group_aware": False,
        "damp_percent": 0.01,
    },
}
"""Row name → settings (4-bit, symmetric; GPTQConfig's defaults for anything not named)."""


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def decoder_linears(model: torch.nn.Module) -> list[tuple[str, torch.nn.Linear]]:
    """The Linear modules inside the decoder layers (``lm_head`` and embeddings excluded)."""
    return [
        (name, m)
        for name, m in model.named_modules()
        if isinstance(m, torch.nn.Linear) and ".layers." in f".{name}"
    ]


def rtn_row(model: torch.nn.Module, group_size: int, device: torch.device) -> dict[str, Any]:
    """Round-to-nearest every decoder Linear in place (dense QDQ weights); the run's record."""
    options = GPTQSolveOptions(bits=4, group_size=group_size, sym=True)
    linears = decoder_linears(model)
    sync(device)
    start, cpu_start = time.perf_counter(), time.process_time()
    loss = 0.0
    with torch.no_grad():
        for _, module in linears:
            solution = rtn_quantize(module.weight.detach().float(), options)
            module.weight.copy_(solution.dequantized.to(module.weight.dtype))
            loss += float(solution.loss)
    sync(device)
    return {
        "seconds": time.perf_counter() - start,
        "cpu_seconds": time.process_time() - cpu_start,
        "modules": len(linears),
        "rtn_error_sum": loss,  # Σ (w - q)² / 2 over the modules (GPTQ's loss with H = I)
    }


def gptq_row(
    model: torch.nn.Module,
    settings: dict[str, Any],
    samples: list[torch.Tensor],
    *,
    device: torch.device,
    batch_size: int,
) -> tuple[torch.nn.Module, dict[str, Any]]:
    """Quantize through the lifecycle API; the quantized model and the run's record."""
    config = GPTQConfig(bits=4, **{k: v for k, v in settings.items() if k != "kind"})
    qm = floatxq.load(model, quantize_config=config, device=device, dtype=torch.bfloat16)
    sync(device)
    start, cpu_start = time.perf_counter(), time.process_time()
    qm.quantize(samples, batch_size=batch_size, progress=False)
    sync(device)
    wall = time.perf_counter() - start
    record: dict[str, Any] = {
        "seconds": wall,
        "cpu_seconds": time.process_time() - cpu_start,
        "quantize_seconds": qm.quantize_seconds,
        "config": {
            "group_size": config.group_size,
            "desc_act": config.desc_act,
            "static_groups": config.static_groups,
            "act_group_aware": config.act_group_aware,
            "damp_percent": config.damp_percent,
            "damp_auto_increment": config.damp_auto_increment,
        },
    }
    packed = [n for n, m in qm.model.named_modules() if isinstance(m, floatxq.GPTQLinear)]
    record["gptq_linears"] = len(packed)
    if not packed or any(not n.startswith("model.layers.") for n in packed):
        raise RuntimeError(
            f"gptq_quality: expected GPTQLinear modules in the decoder layers only, got {packed}"
        )
    modules = getattr(qm.report, "modules", None)
    if modules:
        record["modules"] = len(modules)
        record["module_names"] = sorted(m.name for m in modules)
        record["loss_sum"] = sum(float(m.loss) for m in modules)
        record["damp_max"] = max(float(m.damp) for m in modules)
        record["solve_seconds"] = sum(float(m.seconds) for m in modules)
        if "lm_head" in {m.name for m in modules}:
            raise RuntimeError("gptq_quality: lm_head was quantized; every row keeps it in bf16")
    return qm.model, record


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--samples", type=int, default=128, help="calibration samples")
    parser.add_argument("--seq-len", type=int, default=256, help="tokens per sample and window")
    parser.add_argument("--windows", type=int, default=64, help="evaluation windows")
    parser.add_argument("--batch-size", type=int, default=8, help="calibration batch")
    parser.add_argument("--eval-batch-size", type=int, default=8)
    parser.add_argument("--rows", nargs="*", default=list(ROWS), choices=list(ROWS))
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    parser.add_argument("--anchor", default=None, help="JSON from llmcompressor_gptq_anchor.py")
    parser.add_argument("--out", default=None, help="write the JSON record here")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    dtype = torch.bfloat16
    samples = calibration_samples(num_samples=args.samples, seq_len=args.seq_len)
    windows = token_windows("evaluation", seq_len=args.seq_len, max_windows=args.windows)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(
        f"# GPTQ quality  {datetime.date.today()}  {name}  threads {torch.get_num_threads()}  "
        f"torch {torch.__version__}  transformers {transformers.__version__}  "
        f"load {' '.join(f'{x:.2f}' for x in os.getloadavg())}"
    )
    print(
        f"tiny Llama bf16; {len(samples)} calibration samples × {args.seq_len}; "
        f"{windows.shape[0]} evaluation windows × {windows.shape[1]}; 4-bit sym, lm_head bf16",
        flush=True,
    )

    reference = load_tiny_llama(dtype=dtype, device=device)
    ref_logprobs = reference_logprobs(reference, windows, batch_size=args.eval_batch_size)
    bf16 = evaluate_lm(reference, windows, reference=ref_logprobs, batch_size=args.eval_batch_size)
    del reference

    results: dict[str, dict[str, Any]] = {}
    failed: list[str] = []
    header = (
        f"{'row':<16} | {'perplexity':>10} | {'KL nats':>9} | {'top-1':>7} | {'wall s':>7} | "
        f"{'CPU s':>7} | {'GPTQ loss':>10}"
    )
    print(header)
    print("-" * len(header))
    print(
        f"{'bf16':<16} | {bf16.perplexity:>10.4f} | {'':>9} | {'':>7} | {'':>7} | {'':>7} | "
        f"{'':>10}"
    )
    for row in args.rows:
        settings = ROWS[row]
        model = load_tiny_llama(dtype=dtype, device=device)
        try:
            if settings["kind"] == "rtn":
                record = rtn_row(model, settings["group_size"], device)
            else:
                model, record = gptq_row(
                    model, settings, samples, device=device, batch_size=args.batch_size
                )
        except Exception as exc:  # record and go on: one broken row must not hide the others
            failed.append(row)
            results[row] = {"settings": settings, "error": f"{type(exc).__name__}: {exc}"}
            print(f"{row:<16} | FAILED {type(exc).__name__}: {exc}", flush=True)
            traceback.print_exc()
            continue
        report: EvalReport = evaluate_lm(
            model, windows, reference=ref_logprobs, batch_size=args.eval_batch_size
        )
        record["settings"] = settings
        record["loadavg"] = list(os.getloadavg())
        record["eval"] = report._asdict()
        results[row] = record
        loss = record.get("loss_sum")
        print(
            f"{row:<16} | {report.perplexity:>10.4f} | {report.kl_divergence:>9.5f} | "
            f"{report.top1_agreement:>7.4f} | {record['seconds']:>7.2f} | "
            f"{record['cpu_seconds']:>7.2f} | "
            f"{'' if loss is None else f'{loss:.4g}':>10}",
            flush=True,
        )
        del model

    comparison = None
    if args.anchor:
        anchor = json.loads(pathlib.Path(args.anchor).read_text())
        a_eval = anchor["reloaded"]
        a_wall = anchor["oneshot_seconds"]
        a_cpu = anchor.get("oneshot_cpu_seconds")
        a_set = anchor["settings"]
        host_load = anchor["host"].get("loadavg_end", anchor["host"].get("loadavg", [0.0]))[0]
        mismatch = [
            f"{k}: anchor {a_set[k]} vs {v}"
            for k, v in (("samples", len(samples)), ("seq_len", args.seq_len),
                         ("windows", int(windows.shape[0])))
            if a_set.get(k) != v
        ]  # fmt: skip
        if mismatch:
            print(f"WARNING: the anchor was measured differently ({'; '.join(mismatch)})")
        print(
            f"\nanchor: llm-compressor {anchor['versions'].get('llmcompressor')} "
            f"{a_set['scheme']} actorder={a_set['actorder']} damp={a_set['dampening_frac']}: "
            f"perplexity {a_eval['perplexity']:.4f}, KL {a_eval['kl_divergence']:.5f}, "
            f"top-1 {a_eval['top1_agreement']:.4f}, oneshot {a_wall:.2f} s "
            f"(CPU {'n/a' if a_cpu is None else f'{a_cpu:.2f} s'}) "
            f"(host 1-min load at its end {host_load:.2f})"
        )
        head = (
            f"{'row':<16} | {'ppl / anchor':>12} | {'KL / anchor':>11} | "
            f"{'Δppl vs bf16 / anchor Δ':>23} | {'anchor wall / wall':>18} | "
            f"{'anchor CPU / CPU':>16}"
        )
        print(head)
        print("-" * len(head))
        comparison = {}
        a_delta = a_eval["perplexity"] - bf16.perplexity
        for row, record in results.items():
            if "eval" not in record:
                continue
            ev = record["eval"]
            entry = {
                "perplexity_ratio": ev["perplexity"] / a_eval["perplexity"],
                "kl_ratio": ev["kl_divergence"] / a_eval["kl_divergence"],
                "perplexity_delta_ratio": (ev["perplexity"] - bf16.perplexity) / a_delta,
                "anchor_wall_over_wall": a_wall / record["seconds"],
                "anchor_cpu_over_cpu": None if a_cpu is None else a_cpu / record["cpu_seconds"],
            }
            cpu_ratio = entry["anchor_cpu_over_cpu"]
            comparison[row] = entry
            print(
                f"{row:<16} | {entry['perplexity_ratio']:>12.4f} | {entry['kl_ratio']:>11.3f} | "
                f"{entry['perplexity_delta_ratio']:>23.3f} | "
                f"{entry['anchor_wall_over_wall']:>17.2f}x | "
                f"{'n/a' if cpu_ratio is None else f'{cpu_ratio:.2f}x':>16}"
            )

    if args.out:
        record = {
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
                "bits": 4,
                "sym": True,
                "lm_head": False,
            },
            "bf16": bf16._asdict(),
            "rows": results,
            "anchor": args.anchor,
            "comparison": comparison,
        }
        pathlib.Path(args.out).write_text(json.dumps(record, indent=2) + "\n")
        print(f"wrote {args.out}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
