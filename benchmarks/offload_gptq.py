"""GPTQ of a checkpoint read from disk: offloaded (a layer at a time from the shards) or in memory.

Run (one H200): python benchmarks/offload_gptq.py --dir /tmp/offload-gptq --out /tmp/r.json
CPU smoke run: python benchmarks/offload_gptq.py --device cpu --layers 2 --hidden 256 \
    --intermediate 512 --heads 4 --kv-heads 2 --vocab 1024 --samples 4 --seq-len 64

A random Llama-3-8B-shaped checkpoint (``gptq_scale.build_model``: hidden 4096, MLP 14336,
32 heads / 8 KV heads, vocab 128256, 32 layers, untied ``lm_head``; bf16) is written with
``save_pretrained`` (5 GB shards), then fresh subprocesses quantize it with GPTQ (4 bits, groups
of 128; ``--samples`` x ``--seq-len`` random token ids, batches of ``--batch-size``) and write
the compressed-tensors checkpoint, each mode given by ``--modes``:

* ``offload``: ``floatxq.load(src, quantize_config=cfg, offload="disk").quantize(samples,
  out=dst)``;
* ``memory``: ``floatxq.load(src, quantize_config=cfg).quantize(samples).save(dst)``.

Each child reports the wall time of the whole job (load, quantize, save) and of its parts, the
host's peak resident set (``VmHWM``), ``torch.cuda.max_memory_allocated``, and, offloaded, the
time at which each decoder layer was written (per-layer figures for a larger model's estimate).
The two outputs are compared byte for byte. The goal checked is the issue's: the offloaded job
peaks at 6 GB of host memory at most, and takes at most 10% longer than the in-memory one.
"""

import argparse
import datetime
import filecmp
import json
import os
import pathlib
import platform
import shutil
import subprocess
import sys
import textwrap
import time

import torch
import transformers

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

GB = 10**9

CHILD = textwrap.dedent(
    """
    import json, sys, time
    import torch
    from transformers.models.llama import modeling_llama  # noqa: F401
    import floatxq as fq

    def status(key):
        for line in open("/proc/self/status"):
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024

    mode, src, dst, device = sys.argv[1:5]
    samples, seq_len, vocab, batch = map(int, sys.argv[5:9])
    ids = torch.randint(0, vocab, (samples, seq_len), generator=torch.Generator().manual_seed(0))
    cfg = fq.GPTQConfig(bits=4, group_size=128)
    baseline = status("VmHWM")
    stamps = []
    start = time.perf_counter()
    if mode == "offload":
        model = fq.load(src, quantize_config=cfg, offload="disk", device=device)
        loaded = time.perf_counter()
        model.quantize(
            list(ids.unbind(0)), batch_size=batch, out=dst,
            progress=lambda text: stamps.append((text, time.perf_counter() - start)),
        )
        quantized = saved = time.perf_counter()
    else:
        model = fq.load(src, quantize_config=cfg)
        loaded = time.perf_counter()
        model.quantize(list(ids.unbind(0)), batch_size=batch, progress=False)
        quantized = time.perf_counter()
        model.save(dst)
        saved = time.perf_counter()
    cuda = torch.cuda.max_memory_allocated() if torch.cuda.is_available() else None
    run = model.report.run if mode == "offload" else model.report
    solve = sum(m.seconds for m in run.modules)
    print(json.dumps({
        "seconds": saved - start, "load": loaded - start, "quantize": quantized - loaded,
        "save": saved - quantized, "baseline_rss": baseline, "peak_rss": status("VmHWM"),
        "peak_cuda": cuda, "stamps": stamps, "solve_seconds": solve,
    }))
    """
)


def _same_files(a: pathlib.Path, b: pathlib.Path) -> bool:
    names = sorted(os.listdir(a))
    if names != sorted(os.listdir(b)):
        return False
    return all(filecmp.cmp(a / n, b / n, shallow=False) for n in names)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dir", default="/tmp/offload-gptq")
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--intermediate", type=int, default=14336)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=128256)
    parser.add_argument("--samples", type=int, default=128)
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--modes", default="offload,memory")
    parser.add_argument("--out", default=None, help="write the JSON record here")
    args = parser.parse_args()

    from gptq_scale import build_model

    root = pathlib.Path(args.dir)
    src = root / "src"
    config = transformers.LlamaConfig(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
        num_hidden_layers=args.layers, num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads, tie_word_embeddings=False, dtype="bfloat16",
        max_position_embeddings=max(8192, args.seq_len),
    )  # fmt: skip
    record: dict = {
        "date": datetime.date.today().isoformat(), "host": platform.node(),
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "torch": torch.__version__, "args": vars(args),
    }  # fmt: skip
    if not (src / "config.json").is_file():
        start = time.perf_counter()
        model = build_model(config)
        layer = sum(p.nbytes for p in model.model.layers[0].parameters())
        record["layer_bytes"] = layer
        record["total_bytes"] = sum(p.nbytes for p in model.parameters())
        model.save_pretrained(src, max_shard_size="5GB")
        del model
        record["write_seconds"] = time.perf_counter() - start
        print(f"source written: {record['total_bytes'] / GB:.2f} GB in "
              f"{record['write_seconds']:.1f} s", flush=True)  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    for mode in args.modes.split(","):
        dst = root / mode
        shutil.rmtree(dst, ignore_errors=True)
        done = subprocess.run(
            [sys.executable, "-c", CHILD, mode, str(src), str(dst), args.device,
             str(args.samples), str(args.seq_len), str(args.vocab), str(args.batch_size)],
            capture_output=True, text=True, env=env, check=False,
        )  # fmt: skip
        if done.returncode != 0:
            print(done.stderr[-4000:], file=sys.stderr)
            return 1
        result = json.loads(done.stdout.strip().splitlines()[-1])
        record[mode] = result
        print(f"{mode}: {result['seconds']:.1f} s (load {result['load']:.1f}, quantize "
              f"{result['quantize']:.1f}, save {result['save']:.1f}); peak RSS "
              f"{result['peak_rss'] / GB:.2f} GB; peak CUDA "
              f"{(result['peak_cuda'] or 0) / GB:.2f} GB", flush=True)  # fmt: skip
        if args.out:
            pathlib.Path(args.out).write_text(json.dumps(record, indent=1))
    if "offload" in record and "memory" in record:
        record["same_files"] = _same_files(root / "offload", root / "memory")
        record["time_ratio"] = record["offload"]["seconds"] / record["memory"]["seconds"]
        record["goal_rss"] = record["offload"]["peak_rss"] <= 6 * GB
        record["goal_time"] = record["time_ratio"] <= 1.10
        print(f"same files: {record['same_files']}; offload / memory time "
              f"{record['time_ratio']:.3f}; goals: RSS {record['goal_rss']}, time "
              f"{record['goal_time']}", flush=True)  # fmt: skip
    if args.out:
        pathlib.Path(args.out).write_text(json.dumps(record, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
