"""The GPTQ anchor: llm-compressor's ``GPTQModifier`` (W4A16, group 128) on the trained tiny Llama.

Run (in a venv that has llmcompressor; floatxq on the path, no install needed)::

    PYTHONPATH=. nice python benchmarks/llmcompressor_gptq_anchor.py --out /tmp/anchor.json

The model is ``floatxq.tiny.TINY_LLAMA_DIR`` in bfloat16 on the CPU. Calibration is exactly what
floatxq's GPTQ rows use: ``floatxq.tiny.calibration_samples(num_samples=N, seq_len=256)``, given
to ``oneshot`` as a ``datasets.Dataset`` of ``input_ids`` / ``attention_mask`` (byte ids, so no
tokenizer), in order (no shuffling), every sample whole (all have ``seq_len`` tokens, so the
truncating collator drops nothing). The recipe is ``GPTQModifier(targets="Linear",
scheme="W4A16", ignore=["lm_head"])`` with llm-compressor's defaults (symmetric INT4, group 128,
``actorder="static"``, ``dampening_frac=0.01``, block 128) unless overridden.

Timed: the ``oneshot`` call (wall clock and process CPU time, which a shared machine disturbs
less; includes llm-compressor's tracing and its sequential pipeline).
The compressed model is then saved (``pack-quantized``) and reloaded by transformers
(compressed-tensors decompresses it to bf16), and both the in-memory oneshot model (fake-quant
forward) and the reloaded one are scored with ``floatxq.lifecycle.evaluate.evaluate_lm`` against
the unquantized bf16 model on ``floatxq.tiny.token_windows("evaluation", seq_len=256)``:
perplexity, mean KL(reference ‖ model) and top-1 agreement. The JSON (``--out``) carries the
settings, versions, timings and reports; ``benchmarks/gptq_quality.py --anchor`` reads it.
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

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from floatxq.lifecycle.evaluate import EvalReport, evaluate_lm, reference_logprobs
from floatxq.tiny import TINY_LLAMA_DIR, calibration_samples, token_windows


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


def _report_dict(report: EvalReport) -> dict:
    return report._asdict()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=128, help="calibration samples")
    parser.add_argument("--seq-len", type=int, default=256, help="tokens per sample and window")
    parser.add_argument("--windows", type=int, default=64, help="evaluation windows")
    parser.add_argument("--batch-size", type=int, default=8, help="oneshot calibration batch")
    parser.add_argument("--eval-batch-size", type=int, default=8)
    parser.add_argument("--group-size", type=int, default=128)
    parser.add_argument(
        "--actorder", default="static", choices=["static", "group", "weight", "none"],
        help="GPTQModifier.actorder (llm-compressor's default: static)",
    )  # fmt: skip
    parser.add_argument("--dampening-frac", type=float, default=0.01)
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    parser.add_argument("--keep", default=None, help="save the compressed model here (kept)")
    parser.add_argument("--out", default=None, help="write the JSON record here")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    import datasets
    import transformers
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import GPTQModifier

    transformers.utils.logging.disable_progress_bar()
    dtype = torch.bfloat16
    load_start = list(os.getloadavg())
    samples = calibration_samples(num_samples=args.samples, seq_len=args.seq_len)
    windows = token_windows("evaluation", seq_len=args.seq_len, max_windows=args.windows)
    print(
        f"# llm-compressor GPTQ anchor  {datetime.date.today()}  "
        f"{platform.processor() or 'cpu'}  threads {torch.get_num_threads()}  "
        f"torch {torch.__version__}  transformers {transformers.__version__}  "
        f"llmcompressor {_version('llmcompressor')}  "
        f"compressed-tensors {_version('compressed-tensors')}"
    )
    print(
        f"model {TINY_LLAMA_DIR.name} bf16; {len(samples)} calibration samples × {args.seq_len}; "
        f"{windows.shape[0]} evaluation windows × {windows.shape[1]}",
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
    modifier = GPTQModifier(
        targets="Linear",
        scheme="W4A16",
        ignore=["lm_head"],
        actorder=None if args.actorder == "none" else args.actorder,
        dampening_frac=args.dampening_frac,
    )
    if args.group_size != 128:  # W4A16's preset is group 128; swap in another group size
        modifier = GPTQModifier(
            config_groups={
                "group_0": {
                    "targets": ["Linear"],
                    "weights": {
                        "num_bits": 4, "type": "int", "symmetric": True, "strategy": "group",
                        "group_size": args.group_size,
                    },
                }
            },
            ignore=["lm_head"],
            actorder=None if args.actorder == "none" else args.actorder,
            dampening_frac=args.dampening_frac,
        )  # fmt: skip
    model = load()
    start, cpu_start = time.perf_counter(), time.process_time()
    model = oneshot(
        model=model,
        processor=_NoTokenizer(),
        dataset=dataset,
        recipe=modifier,
        num_calibration_samples=len(samples),
        max_seq_length=args.seq_len,
        batch_size=args.batch_size,
        shuffle_calibration_samples=False,
    )
    oneshot_s = time.perf_counter() - start
    oneshot_cpu_s = time.process_time() - cpu_start
    print(f"oneshot wall time: {oneshot_s:.2f} s (process CPU {oneshot_cpu_s:.2f} s)", flush=True)
    in_memory = evaluate_lm(model, windows, reference=ref_logprobs, batch_size=args.eval_batch_size)

    root = args.keep or tempfile.mkdtemp(prefix="floatxq-anchor-")
    start = time.perf_counter()
    model.save_pretrained(root, save_compressed=True)
    save_s = time.perf_counter() - start
    del model
    qconfig = json.loads((pathlib.Path(root) / "config.json").read_text())["quantization_config"]
    disk_bytes = sum(f.stat().st_size for f in pathlib.Path(root).glob("*.safetensors"))
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(
        root,
        dtype=dtype,
        local_files_only=True,
        quantization_config=transformers.CompressedTensorsConfig(dequantize=True),
    ).eval()
    linears = [
        n for n, m in reloaded.named_modules() if isinstance(m, torch.nn.Linear) and n != "lm_head"
    ]
    after_reload = evaluate_lm(
        reloaded, windows, reference=ref_logprobs, batch_size=args.eval_batch_size
    )
    if args.keep is None:
        shutil.rmtree(root, ignore_errors=True)

    header = f"{'row':<32} | {'perplexity':>10} | {'KL nats':>9} | {'top-1':>7} | {'wall s':>7}"
    print(header)
    print("-" * len(header))
    print(f"{'bf16 (reference)':<32} | {bf16.perplexity:>10.4f} | {'':>9} | {'':>7} | {'':>7}")
    for name, rep, wall in (
        ("llm-compressor GPTQ (in memory)", in_memory, oneshot_s),
        ("llm-compressor GPTQ (reloaded)", after_reload, oneshot_s),
    ):
        print(
            f"{name:<32} | {rep.perplexity:>10.4f} | {rep.kl_divergence:>9.5f} | "
            f"{rep.top1_agreement:>7.4f} | {wall:>7.2f}"
        )
    print(f"saved format {qconfig.get('format')!r}, {disk_bytes} bytes; save {save_s:.2f} s")

    record = {
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
            "scheme": "W4A16" if args.group_size == 128 else f"W4A16 group {args.group_size}",
            "group_size": args.group_size,
            "actorder": args.actorder,
            "dampening_frac": args.dampening_frac,
            "ignore": ["lm_head"],
            "samples": len(samples),
            "seq_len": args.seq_len,
            "batch_size": args.batch_size,
            "windows": int(windows.shape[0]),
            "eval_batch_size": args.eval_batch_size,
        },
        "quantized_linears": len(linears),
        "oneshot_seconds": oneshot_s,
        "oneshot_cpu_seconds": oneshot_cpu_s,
        "save_seconds": save_s,
        "saved_format": qconfig.get("format"),
        "saved_bytes": disk_bytes,
        "bf16": _report_dict(bf16),
        "in_memory": _report_dict(in_memory),
        "reloaded": _report_dict(after_reload),
    }
    if args.out:
        pathlib.Path(args.out).write_text(json.dumps(record, indent=2) + "\n")
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
