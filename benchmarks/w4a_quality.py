"""W4A quality on the trained tiny Llama: INT4 weights against FP8 and NVFP4 activations.

Run: python benchmarks/w4a_quality.py [--device cpu] [--rows ...] [--out w4a.json]

Model, calibration and evaluation are those of ``benchmarks/gptq_quality.py``: the tiny Llama in
bfloat16, ``calibration_samples(num_samples=128, seq_len=256)``, 64 held-out windows of 256
tokens scored by ``evaluate_lm`` against the bf16 model (perplexity, mean KL(reference ‖ model)
in nats, top-1 agreement). Every row holds 4-bit symmetric weights in groups of 128 (the layout
the W4A GEMMs read; ``act_group_aware`` on, GPTQConfig's default), ``lm_head`` in bf16.

Rows (``--rows``; all by default):

- ``rtn-w4a16``: round-to-nearest weights, bf16 activations (dense QDQ, no calibration).
- ``gptq-w4a16``: GPTQ, bf16 activations (``GPTQLinear``).
- ``w4afp8``: activation-aware GPTQ (``GPTQConfig(activation={"mode": "w4afp8"})``: the solve
  replays per-token FP8 activations), then ``W4AFP8Linear`` modules under the Llama activation
  stream.
- ``nvfp4-<recipe>``: the same with NVFP4 activations (``{"mode": "w4a_nvfp4", "recipe": ...}``)
  for each of the seven block-scale recipes, dynamic activation global scales.
- ``split-least_squares``: FP8 attention, NVFP4 (``least_squares``) MLP
  (``{"mode": "w4a_nvfp4", "attention": {"mode": "w4afp8"}}``).
- ``nvfp4-least_squares-calibrated``: the ``nvfp4-least_squares`` model after
  ``QuantizedModel.calibrate_activations`` on the calibration samples (fixed producer global
  scales); its time is the calibration's alone.
- ``noreplay-*``: controls without activation replay: the ``gptq-w4a16`` weights, solved against
  bf16 activations, converted module by module (``W4AFP8Linear.from_gptq_linear`` /
  ``W4ANVFP4Linear.from_gptq_linear``) and run under the same stream as the row they shadow
  (``w4afp8``, ``nvfp4-least_squares``, ``split-least_squares``); time is the conversion's.

A derived row (calibrated, ``noreplay-*``) reuses its base row's quantized model from the same
run, or quantizes it first when the base row was not asked for. Each W4A row checks that every
decoder Linear became the expected W4A module and that the stream is installed; a row that fails
is reported and the others still run (exit status 1). On CPU the W4A modules take their
reference routes (exact, slow: ``nvfp4-exhaustive`` dominates the run); on CUDA their Triton
routes. The time of a quantized row is its ``quantize`` call (wall clock and process CPU time).
The JSON (``--out``) holds every row, the settings and versions.
"""

import argparse
import copy
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
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

from gptq_quality import decoder_linears, rtn_row, sync

import floatxq
from floatxq import GPTQConfig
from floatxq.config import ActivationConfig
from floatxq.formats import NVFP4_RECIPES
from floatxq.lifecycle.evaluate import EvalReport, evaluate_lm, reference_logprobs
from floatxq.tiny import calibration_samples, load_tiny_llama, token_windows

_FP8 = {"mode": "w4afp8"}
_SPLIT = {"mode": "w4a_nvfp4", "recipe": "least_squares", "attention": {"mode": "w4afp8"}}

ROWS: dict[str, dict[str, Any]] = {
    "rtn-w4a16": {"kind": "rtn"},
    "gptq-w4a16": {"kind": "gptq", "activation": None},
    "w4afp8": {"kind": "gptq", "activation": _FP8},
    **{
        f"nvfp4-{recipe}": {"kind": "gptq", "activation": {"mode": "w4a_nvfp4", "recipe": recipe}}
        for recipe in NVFP4_RECIPES
    },
    "split-least_squares": {"kind": "gptq", "activation": _SPLIT},
    "nvfp4-least_squares-calibrated": {"kind": "calibrated", "base": "nvfp4-least_squares"},
    "noreplay-w4afp8": {"kind": "noreplay", "base": "gptq-w4a16", "activation": _FP8},
    "noreplay-nvfp4-least_squares": {
        "kind": "noreplay",
        "base": "gptq-w4a16",
        "activation": {"mode": "w4a_nvfp4", "recipe": "least_squares"},
    },
    "noreplay-split-least_squares": {
        "kind": "noreplay",
        "base": "gptq-w4a16",
        "activation": _SPLIT,
    },
}
"""Row name → how it is made (GPTQ rows: ``GPTQConfig(bits=4, group_size=128, activation=...)``)."""


def _label(settings: dict[str, Any]) -> str:
    """The activations a row runs with, in a few words."""
    activation = settings.get("activation")
    if settings["kind"] == "calibrated":
        return "nvfp4 lsq, calibrated"
    if activation is None:
        return "bf16"
    if activation["mode"] == "w4afp8":
        return "fp8 per token"
    if activation.get("attention"):
        return f"fp8 attn / nvfp4 {activation['recipe']} mlp"
    return f"nvfp4 {activation['recipe']}"


def quantize_row(
    settings: dict[str, Any],
    samples: list[torch.Tensor],
    *,
    device: torch.device,
    batch_size: int,
) -> tuple[Any, dict[str, Any]]:
    """GPTQ (activation-aware where the row has a policy) through the lifecycle API; the
    QuantizedModel and the run's record."""
    model = load_tiny_llama(dtype=torch.bfloat16, device=device)
    config = GPTQConfig(bits=4, group_size=128, activation=settings.get("activation"))
    qm = floatxq.load(model, quantize_config=config, device=device, dtype=torch.bfloat16)
    sync(device)
    start, cpu_start = time.perf_counter(), time.process_time()
    qm.quantize(samples, batch_size=batch_size, progress=False)
    sync(device)
    record: dict[str, Any] = {
        "seconds": time.perf_counter() - start,
        "cpu_seconds": time.process_time() - cpu_start,
        "backend": str(getattr(qm.backend, "value", qm.backend)),
    }
    modules = getattr(qm.report, "modules", None)
    if modules:
        record["modules"] = len(modules)
        record["loss_sum"] = sum(float(m.loss) for m in modules)
        record["damp_max"] = max(float(m.damp) for m in modules)
        if "lm_head" in {m.name for m in modules}:
            raise RuntimeError("w4a_quality: lm_head was quantized; every row keeps it in bf16")
    return qm, record


def calibrate_row(qm: Any, samples: list[torch.Tensor], device: torch.device) -> dict[str, Any]:
    """Calibrate ``qm``'s NVFP4 producers in place; the run's record."""
    sync(device)
    start, cpu_start = time.perf_counter(), time.process_time()
    report = qm.calibrate_activations(samples)
    sync(device)
    scales = report.get("global_scales") or {}
    return {
        "seconds": time.perf_counter() - start,
        "cpu_seconds": time.process_time() - cpu_start,
        "calibrated_producers": len(scales),
        "algorithm": report.get("algorithm"),
    }


def convert_without_replay(model: torch.nn.Module, policy: dict[str, Any]) -> dict[str, Any]:
    """Turn ``model``'s GPTQLinear modules (solved against bf16 activations) into the policy's
    W4A modules and install the stream for ``policy``, in place; the run's record."""
    from floatxq.lifecycle.w4a_install import install_activation_stream, install_w4a_modules

    activation = ActivationConfig.from_value(policy)
    start, cpu_start = time.perf_counter(), time.process_time()
    converted = sum(type(m) is floatxq.GPTQLinear for m in model.modules())
    # the lifecycle's own conversion (as after an activation-aware solve), without its scales:
    # these weights were solved against bf16 activations, so their inputs run dynamic
    install_w4a_modules(model, floatxq.backend_for_activation(activation), activation=activation)
    install_activation_stream(model, activation)
    return {
        "seconds": time.perf_counter() - start,
        "cpu_seconds": time.process_time() - cpu_start,
        "converted": converted,
    }


def census(model: torch.nn.Module, settings: dict[str, Any]) -> dict[str, Any]:
    """Which module type each decoder Linear became, checked against the row's policy."""
    types: dict[str, int] = {}
    for name, module in model.named_modules():
        if ".layers." in f".{name}" and isinstance(module, (torch.nn.Linear, floatxq.GPTQLinear)):
            types[type(module).__name__] = types.get(type(module).__name__, 0) + 1
    base = ROWS.get(settings.get("base", ""), {})
    activation = settings.get("activation", base.get("activation"))
    if settings["kind"] == "rtn":
        want = "Linear"
    elif activation is None:
        want = "GPTQLinear"
    else:
        want = "W4AFP8Linear" if activation["mode"] == "w4afp8" else "W4ANVFP4Linear"
    if set(types) != {want}:
        raise RuntimeError(f"w4a_quality: expected every decoder Linear to be {want}, got {types}")
    record: dict[str, Any] = {"module_types": types}
    if activation is not None:
        from floatxq.lifecycle.stream import installed_w4a_stream, stream_boundary_quantizers

        policy = installed_w4a_stream(model)
        if policy is None:
            raise RuntimeError("w4a_quality: a W4A row runs without the activation stream")
        record["stream_policy"] = repr(policy)
        record["nvfp4_producers"] = len(stream_boundary_quantizers(model))
    return record


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
    parser.add_argument("--out", default=None, help="write the JSON record here")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    samples = calibration_samples(num_samples=args.samples, seq_len=args.seq_len)
    windows = token_windows("evaluation", seq_len=args.seq_len, max_windows=args.windows)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(
        f"# W4A quality  {datetime.date.today()}  {name}  threads {torch.get_num_threads()}  "
        f"torch {torch.__version__}  transformers {transformers.__version__}  "
        f"load {' '.join(f'{x:.2f}' for x in os.getloadavg())}"
    )
    print(
        f"tiny Llama bf16; {len(samples)} calibration samples × {args.seq_len}; "
        f"{windows.shape[0]} evaluation windows × {windows.shape[1]}; INT4 sym g128, lm_head bf16",
        flush=True,
    )

    reference = load_tiny_llama(dtype=torch.bfloat16, device=device)
    ref_logprobs = reference_logprobs(reference, windows, batch_size=args.eval_batch_size)
    bf16 = evaluate_lm(reference, windows, reference=ref_logprobs, batch_size=args.eval_batch_size)
    del reference

    # the quantized models of this run's base rows, for the rows derived from them: a no-replay
    # control converts a copy of the W4A16 model (no stream installed, so it copies); the
    # calibrated row takes its base's model itself once that row is measured (a model with a
    # stream installed is not copied)
    bases = {ROWS[row]["base"] for row in args.rows if "base" in ROWS[row]}
    kept: dict[str, Any] = {}

    def base_model(row: str, *, take: bool) -> tuple[Any, dict[str, Any] | None]:
        """``row``'s QuantizedModel (taken, or a copy of its model), quantizing it first where
        this run has none."""
        made = None
        if row not in kept:
            kept[row], made = quantize_row(
                ROWS[row], samples, device=device, batch_size=args.batch_size
            )
        if take:
            return kept.pop(row), made
        return copy.deepcopy(kept[row].model), made

    results: dict[str, dict[str, Any]] = {}
    failed: list[str] = []
    header = (
        f"{'row':<31} | {'activations':<34} | {'perplexity':>10} | {'KL nats':>9} | "
        f"{'top-1':>7} | {'wall s':>7} | {'CPU s':>7}"
    )
    print(header)
    print("-" * len(header))
    print(f"{'bf16':<31} | {'bf16':<34} | {bf16.perplexity:>10.4f} | {'':>9} | {'':>7} | | ")
    for row in args.rows:
        settings = ROWS[row]
        try:
            if settings["kind"] == "rtn":
                model = load_tiny_llama(dtype=torch.bfloat16, device=device)
                record = rtn_row(model, 128, device)
                if len(decoder_linears(model)) != record["modules"]:
                    raise RuntimeError("w4a_quality: RTN missed a decoder Linear")
            elif settings["kind"] == "gptq":
                qm, record = quantize_row(
                    settings, samples, device=device, batch_size=args.batch_size
                )
                if row in bases:
                    kept[row] = qm
                model = qm.model
            elif settings["kind"] == "calibrated":
                qm, made = base_model(settings["base"], take=True)
                record = calibrate_row(qm, samples, device)
                if made is not None:
                    record["base_quantize"] = made
                model = qm.model
            else:
                model, made = base_model(settings["base"], take=False)
                record = convert_without_replay(model, settings["activation"])
                if made is not None:
                    record["base_quantize"] = made
            record.update(census(model, settings))
            report: EvalReport = evaluate_lm(
                model, windows, reference=ref_logprobs, batch_size=args.eval_batch_size
            )
        except Exception as exc:  # record and go on: one broken row must not hide the others
            failed.append(row)
            results[row] = {"settings": settings, "error": f"{type(exc).__name__}: {exc}"}
            print(f"{row:<31} | FAILED {type(exc).__name__}: {exc}", flush=True)
            traceback.print_exc()
            continue
        record["settings"] = settings
        record["loadavg"] = list(os.getloadavg())
        record["eval"] = report._asdict()
        results[row] = record
        print(
            f"{row:<31} | {_label(settings):<34} | {report.perplexity:>10.4f} | "
            f"{report.kl_divergence:>9.5f} | {report.top1_agreement:>7.4f} | "
            f"{record['seconds']:>7.2f} | {record['cpu_seconds']:>7.2f}",
            flush=True,
        )
        del model

    gaps = None
    w4a16 = results.get("gptq-w4a16", {}).get("eval")
    if w4a16 is not None:
        # the cost of quantized activations over the same GPTQ weight layout with bf16 ones
        print(f"\n{'row':<31} | {'Δppl vs gptq-w4a16':>18} | {'ΔKL vs gptq-w4a16':>17} | "
              f"{'Δtop-1':>8}")  # fmt: skip
        gaps = {}
        for row, record in results.items():
            ev = record.get("eval")
            if ev is None or row == "gptq-w4a16":
                continue
            gaps[row] = {
                "perplexity": ev["perplexity"] - w4a16["perplexity"],
                "kl_divergence": ev["kl_divergence"] - w4a16["kl_divergence"],
                "top1_agreement": ev["top1_agreement"] - w4a16["top1_agreement"],
            }
            gap = gaps[row]
            print(
                f"{row:<31} | {gap['perplexity']:>+18.4f} | {gap['kl_divergence']:>+17.5f} | "
                f"{gap['top1_agreement']:>+8.4f}"
            )

    if args.out:
        out = {
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
                "group_size": 128,
                "sym": True,
                "lm_head": False,
            },
            "bf16": bf16._asdict(),
            "rows": results,
            "gaps_vs_gptq_w4a16": gaps,
        }
        pathlib.Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
        print(f"wrote {args.out}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
