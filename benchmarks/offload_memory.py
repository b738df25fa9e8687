"""Peak host memory of an offloaded FP8 run against the in-memory one, on a ~2 GB checkpoint.

Run: python benchmarks/offload_memory.py [--dir /tmp/offload-bench] [--out m.json]

A random Llama with TinyLlama-1.1B's shapes (hidden 2048, MLP 5632, 32 heads / 4 KV heads,
22 layers, vocab 32000, untied ``lm_head``; 1.1B parameters, 2.2 GB in bf16) is written with
``save_pretrained`` (shards of 500 MB). Two fresh subprocesses then quantize it to FP8 (row
scales) and save it to the default layout:

* ``offload``: ``floatxq.load(src, quantize_config=FP8Config(), offload="disk",
  device="cpu").quantize(out=dst)``;
* ``memory``: ``floatxq.load(src, quantize_config=FP8Config(), device="cpu").quantize().save(dst)``.

Each reports its peak resident set (``VmHWM`` of ``/proc/self/status``): ``baseline`` after
importing torch, transformers and floatxq, ``peak`` at the end, and the wall time of the work.
The goal checked is the issue's: the offloaded peak at most embeddings + ``lm_head`` + 2 decoder
layers (bf16 bytes) + 0.6 GB for the interpreter and torch. Both outputs must be the same files.
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

import torch
import transformers

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from floatxq.testing.checkpoints import write_random_llama  # noqa: E402

GIB = 2**30

CHILD = textwrap.dedent(
    """
    import json, sys, time
    import torch, transformers
    from transformers.models.llama import modeling_llama  # noqa: F401
    import floatxq as fq

    def status(key):
        for line in open("/proc/self/status"):
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024

    mode, src, dst = sys.argv[1:4]
    baseline = status("VmHWM")
    start = time.perf_counter()
    if mode == "offload":
        model = fq.load(src, quantize_config=fq.FP8Config(), offload="disk", device="cpu")
        model.quantize(out=dst, progress=False)
    else:
        model = fq.load(src, quantize_config=fq.FP8Config(), device="cpu")
        model.quantize(progress=False).save(dst)
    seconds = time.perf_counter() - start
    print(json.dumps({"baseline": baseline, "peak": status("VmHWM"), "seconds": seconds}))
    """
)


def build(path: pathlib.Path) -> dict[str, int]:
    """Write the random checkpoint; return its byte counts (embeddings, lm_head, one layer)."""
    config = transformers.LlamaConfig(
        vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=22,
        num_attention_heads=32, num_key_value_heads=4, tie_word_embeddings=False,
        dtype="bfloat16",
    )  # fmt: skip
    return write_random_llama(path, config, max_shard_size="500MB")


def run(mode: str, src: pathlib.Path, dst: pathlib.Path) -> dict[str, float]:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run(
        [sys.executable, "-c", CHILD, mode, str(src), str(dst)],
        capture_output=True, text=True, env=env, check=True,
    )  # fmt: skip
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", default="/tmp/offload-bench")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    root = pathlib.Path(args.dir)
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    sizes = build(root / "src")
    print(f"# offload memory  {datetime.date.today()}  {os.cpu_count()} CPUs  "
          f"torch {torch.__version__}  python {platform.python_version()}", flush=True)  # fmt: skip
    print(f"checkpoint {sizes['total'] / GIB:.2f} GiB; embeddings {sizes['embeddings'] / 2**20:.0f}"
          f" MiB, lm_head {sizes['lm_head'] / 2**20:.0f} MiB, layer {sizes['layer'] / 2**20:.0f}"
          f" MiB", flush=True)  # fmt: skip
    results = {mode: run(mode, root / "src", root / mode) for mode in ("offload", "memory")}
    goal = sizes["embeddings"] + sizes["lm_head"] + 2 * sizes["layer"] + 0.6e9
    for mode, r in results.items():
        print(f"{mode:8s} peak {r['peak'] / GIB:.3f} GiB (baseline {r['baseline'] / GIB:.3f} GiB)"
              f" in {r['seconds']:.1f} s", flush=True)  # fmt: skip
    same = all(
        filecmp.cmp(root / "offload" / n, root / "memory" / n, shallow=False)
        for n in os.listdir(root / "memory")
    ) and sorted(os.listdir(root / "offload")) == sorted(os.listdir(root / "memory"))
    met = results["offload"]["peak"] <= goal
    print(f"goal: offloaded peak ≤ {goal / GIB:.3f} GiB: {'✓' if met else '✗'}; same files: "
          f"{'✓' if same else '✗'}")  # fmt: skip
    if args.out:
        record = {"date": datetime.date.today().isoformat(), "sizes": sizes, "goal": goal,
                  "results": results, "same_files": same}  # fmt: skip
        pathlib.Path(args.out).write_text(json.dumps(record, indent=1) + "\n")
    shutil.rmtree(root, ignore_errors=True)
    return 0 if met and same else 1


if __name__ == "__main__":
    raise SystemExit(main())
