"""The NVFP4 anchor: llm-compressor's QuantizationModifier (NVFP4A16 and W4A4) on the tiny Llama.

Run (in a venv that has llmcompressor; floatxq on the path, no install needed)::

    PYTHONPATH=. nice python benchmarks/llmcompressor_nvfp4_anchor.py --out /tmp/nvfp4_anchor.json

The model is ``floatxq.tiny.TINY_LLAMA_DIR`` in bfloat16 on the CPU. Each scheme is one
``oneshot`` of ``QuantizationModifier(targets="Linear", scheme=S, ignore=["lm_head"])`` with
llm-compressor's preset (compressed-tensors ``PRESET_SCHEMES``):

- ``NVFP4A16``: E2M1 weights, E4M3 scales per block of 16 (max/6), one FP32 global scale per
  module (fused over q/k/v and gate/up, as llm-compressor does for vLLM), bf16 activations.
  Data-free: no calibration set is given (llm-compressor needs none and runs no forward).
- ``NVFP4`` (W4A4): the same weights, and each linear's input quantized to NVFP4 per block of
  16 at a static global scale from the calibration amax (``static_minmax``). Calibration is
  exactly what floatxq's rows use: ``floatxq.tiny.calibration_samples(num_samples=N,
  seq_len=256)``, given to ``oneshot`` as a ``datasets.Dataset`` of ``input_ids`` /
  ``attention_mask`` (byte ids, so no tokenizer), in order, every sample whole.

Timed: the ``oneshot`` call (wall clock and process CPU time; it includes llm-compressor's
tracing and, for W4A4, its sequential calibration pipeline; the E2M1 packing itself happens
later, in ``save_pretrained``, timed as ``save_seconds``). Each quantized model is then saved
(``nvfp4-pack-quantized``) and reloaded by transformers (compressed-tensors decodes the packed
weights and, for W4A4, fake-quantizes the activations at the saved ``input_global_scale``), and
both the in-memory model and the reloaded one are scored with
``floatxq.lifecycle.evaluate.evaluate_lm`` against the unquantized bf16 model on
``floatxq.tiny.token_windows("evaluation", seq_len=256)``: perplexity, mean KL(reference ‖
model) and top-1 agreement. The JSON (``--out``) carries the settings, versions, timings and
reports per scheme; ``benchmarks/nvfp4_quality.py --anchor`` reads it.
"""

import argparse
import datetime
import importlib.metadata
import json
import os
import pathlib
import platform
import shutil
import sys
import tempfile
import time
import traceback
from typing import Any

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from floatxq.lifecycle.evaluate import evaluate_lm, reference_logprobs
from floatxq.tiny import TINY_LLAMA_DIR, calibration_samples, token_windows

SCHEMES: dict[str, bool] = {"NVFP4A16": False, "NVFP4": True}
"""llm-compressor preset scheme → whether it is calibrated (static activation scales)."""


class _NoTokenizer:
    """Stands in for a processor: ``oneshot`` demands one when given a dataset, but a dataset that
    already holds ``input_ids`` is never tokenized, and the truncating collator never reads it."""

    def save_pretrained(self, *args: object, **kwargs: object) -> None:
        return None


def _version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def run_scheme(
    scheme: str,
    load: Any,
    dataset: Any,
    windows: torch.Tensor,
    ref_logprobs: torch.Tensor,
    args: argparse.Namespace,
) -> dict[str, Any]:
    """One ``oneshot`` of ``scheme``, saved and reloaded; its record."""
    import transformers
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import QuantizationModifier

    calibrated = SCHEMES[scheme]
    modifier = QuantizationModifier(targets="Linear", scheme=scheme, ignore=["lm_head"])
    data = (
        {
            "processor": _NoTokenizer(),
            "dataset": dataset,
            "num_calibration_samples": len(dataset),
            "max_seq_length": args.seq_len,
            "batch_size": args.batch_size,
            "shuffle_calibration_samples": False,
        }
        if calibrated
        else {}
    )
    model = load()
    start, cpu_start = time.perf_counter(), time.process_time()
    model = oneshot(model=model, recipe=modifier, **data)
    oneshot_s = time.perf_counter() - start
    oneshot_cpu_s = time.process_time() - cpu_start
    print(f"{scheme}: oneshot {oneshot_s:.2f} s (process CPU {oneshot_cpu_s:.2f} s)", flush=True)
    model.eval()
    in_memory = evaluate_lm(model, windows, reference=ref_logprobs, batch_size=args.eval_batch_size)

    root = tempfile.mkdtemp(prefix=f"floatxq-nvfp4-anchor-{scheme}-")
    if args.keep:
        root = str(pathlib.Path(args.keep) / scheme)
    start = time.perf_counter()
    model.save_pretrained(root, save_compressed=True)
    save_s = time.perf_counter() - start
    del model
    qconfig = json.loads((pathlib.Path(root) / "config.json").read_text())["quantization_config"]
    disk_bytes = sum(f.stat().st_size for f in pathlib.Path(root).glob("*.safetensors"))
    record: dict[str, Any] = {
        "scheme": scheme,
        "calibrated": calibrated,
        "oneshot_seconds": oneshot_s,
        "oneshot_cpu_seconds": oneshot_cpu_s,
        "save_seconds": save_s,
        "saved_format": qconfig.get("format"),
        "saved_bytes": disk_bytes,
        "input_activations": qconfig["config_groups"]["group_0"].get("input_activations"),
        "in_memory": in_memory._asdict(),
        "reloaded": None,
    }
    try:
        reloaded = transformers.AutoModelForCausalLM.from_pretrained(
            root, dtype=torch.bfloat16, local_files_only=True
        ).eval()
        record["reloaded"] = evaluate_lm(
            reloaded, windows, reference=ref_logprobs, batch_size=args.eval_batch_size
        )._asdict()
    except Exception as exc:  # the in-memory score stands; say why the reload did not
        record["reload_error"] = f"{type(exc).__name__}: {exc}"
        traceback.print_exc()
    if not args.keep:
        shutil.rmtree(root, ignore_errors=True)
    return record


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--schemes", nargs="*", default=list(SCHEMES), choices=list(SCHEMES))
    parser.add_argument("--samples", type=int, default=128, help="calibration samples (W4A4)")
    parser.add_argument("--seq-len", type=int, default=256, help="tokens per sample and window")
    parser.add_argument("--windows", type=int, default=64, help="evaluation windows")
    parser.add_argument("--batch-size", type=int, default=8, help="oneshot calibration batch")
    parser.add_argument("--eval-batch-size", type=int, default=8)
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    parser.add_argument("--keep", default=None, help="save the compressed models under here")
    parser.add_argument("--out", default=None, help="write the JSON record here")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    import datasets
    import transformers

    transformers.utils.logging.disable_progress_bar()
    dtype = torch.bfloat16
    load_start = list(os.getloadavg())
    samples = calibration_samples(num_samples=args.samples, seq_len=args.seq_len)
    windows = token_windows("evaluation", seq_len=args.seq_len, max_windows=args.windows)
    print(
        f"# llm-compressor NVFP4 anchor  {datetime.date.today()}  "
        f"{platform.processor() or 'cpu'}  threads {torch.get_num_threads()}  "
        f"torch {torch.__version__}  transformers {transformers.__version__}  "
        f"llmcompressor {_version('llmcompressor')}  "
        f"compressed-tensors {_version('compressed-tensors')}"
    )
    print(
        f"model {TINY_LLAMA_DIR.name} bf16; {len(samples)} calibration samples × {args.seq_len} "
        f"(W4A4); {windows.shape[0]} evaluation windows × {windows.shape[1]}",
        flush=True,
    )

    def load() -> transformers.PreTrainedModel:
        return transformers.AutoModelForCausalLM.from_pretrained(
            TINY_LLAMA_DIR, dtype=dtype, local_files_only=True
        ).eval()

    reference = load()
    ref_logprobs = reference_logprobs(reference, windows, batch_size=args.eval_batch_size)
    bf16 = evaluate_lm(reference, windows, reference=ref_logprobs, batch_size=args.eval_batch_size)
    del reference
    print(f"bf16 reference: perplexity {bf16.perplexity:.4f}", flush=True)

    rows = [s.tolist() for s in samples]
    dataset = datasets.Dataset.from_dict(
        {"input_ids": rows, "attention_mask": [[1] * len(r) for r in rows]}
    )
    results: dict[str, dict[str, Any]] = {}
    for scheme in args.schemes:
        results[scheme] = run_scheme(scheme, load, dataset, windows, ref_logprobs, args)

    header = f"{'row':<34} | {'perplexity':>10} | {'KL nats':>9} | {'top-1':>7} | {'wall s':>7}"
    print(header)
    print("-" * len(header))
    print(f"{'bf16 (reference)':<34} | {bf16.perplexity:>10.4f} | {'':>9} | {'':>7} | {'':>7}")
    for scheme, record in results.items():
        for where in ("in_memory", "reloaded"):
            rep = record[where]
            if rep is None:
                print(f"{f'{scheme} ({where})':<34} | {record.get('reload_error', '')}")
                continue
            print(
                f"{f'{scheme} ({where})':<34} | {rep['perplexity']:>10.4f} | "
                f"{rep['kl_divergence']:>9.5f} | {rep['top1_agreement']:>7.4f} | "
                f"{record['oneshot_seconds']:>7.2f}"
            )

    record_out = {
        "tool": "llm-compressor",
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "host": {
            "processor": platform.processor() or "cpu",
            "cpu_count": os.cpu_count(),
            "threads": torch.get_num_threads(),
            "loadavg_start": load_start,
            "loadavg_end": list(os.getloadavg()),
        },
        "versions": {
            name: _version(name)
            for name in ("torch", "transformers", "llmcompressor", "compressed-tensors", "datasets")
        },
        "model": str(TINY_LLAMA_DIR),
        "dtype": "bfloat16",
        "settings": {
            "ignore": ["lm_head"],
            "samples": len(samples),
            "seq_len": args.seq_len,
            "batch_size": args.batch_size,
            "windows": int(windows.shape[0]),
            "eval_batch_size": args.eval_batch_size,
        },
        "bf16": bf16._asdict(),
        "schemes": results,
    }
    if args.out:
        pathlib.Path(args.out).write_text(json.dumps(record_out, indent=2) + "\n")
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
