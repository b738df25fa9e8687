"""A paper estimate of offloaded GPTQ on one GPU for Llama-3-70B and -405B shapes, scaled from a
measured 8B run (``benchmarks/offload_gptq.py --out r.json``).

Run: python benchmarks/offload_estimate.py r.json [--read-gbps 2.0]

Per decoder layer, the measured offloaded run gives its wall time (the median gap between two
layers written) and the module solves' share of it (``solve_seconds`` / layers). The rest is
the calibration forwards (the layer run once per input group and once for its outputs), the
Hessian folds and the hand-offs, all of which scale with the layer's weights times the tokens.
So a larger model's layer is estimated as:

* forwards and folds: the 8B figure times the ratio of the layers' weight counts (the tokens are
  the same: 128 x 2048);
* solves: the 8B figure times the ratio of ``sum(out * in**2)`` over the layer's linears (the
  GPTQ column updates; the Cholesky's ``in**3 / 3`` per input group is added on both sides);
* reading the layer from disk at ``--read-gbps`` (the page cache served the 8B run, so its reads
  are inside its layer time; a real 140 GB or 810 GB checkpoint comes from the disk).

Memory: host = the run's baseline (interpreter, torch, CUDA context) + embeddings + ``lm_head`` +
one bf16 layer, twice (read, and its copy moving to the GPU); GPU = one bf16 layer + the largest
FP32 Hessian three times (the Hessian, its inverse's Cholesky factor, the solve's work) + the
calibration activations (tokens x hidden in bf16, inputs and outputs) + one batch's MLP
intermediate (batch x length x intermediate in bf16, three of them). Disk: the source, the
output (4-bit codes, a float16 scale and a packed zero per 128 weights, bf16 embeddings and
``lm_head``), and one activation checkpoint (the tokens' hidden states, two while replaced).
What the measured run held beyond these formulas (host: the shard reader's buffers, allocator
caches; GPU: the solve's and the forwards' temporaries) is added to every line unchanged, so
the 8B line is the measured peak.
"""

import argparse
import itertools
import json
import statistics
import sys

SHAPES = {
    "8B": {"layers": 32, "hidden": 4096, "intermediate": 14336, "heads": 32, "kv": 8},
    "70B": {"layers": 80, "hidden": 8192, "intermediate": 28672, "heads": 64, "kv": 8},
    "405B": {"layers": 126, "hidden": 16384, "intermediate": 53248, "heads": 128, "kv": 8},
}
VOCAB = 128256
GB = 1e9


def linears(shape: dict) -> list[tuple[int, int]]:
    """``(out, in)`` of a Llama layer's seven linears."""
    h, i = shape["hidden"], shape["intermediate"]
    kv = h // shape["heads"] * shape["kv"]
    return [(h, h), (kv, h), (kv, h), (h, h), (i, h), (i, h), (h, i)]


def solve_work(shape: dict) -> float:
    groups = {shape["hidden"]: 3, shape["intermediate"]: 1}  # q/k/v, o, gate/up, down inputs
    cholesky = sum(k**3 / 3 * n for k, n in groups.items())
    return sum(o * k * k for o, k in linears(shape)) + cholesky


def layer_weights(shape: dict) -> int:
    return sum(o * k for o, k in linears(shape))


def estimate(record: dict, read_gbps: float) -> list[dict]:
    run = record["offload"]
    stamps = [t for _, t in run["stamps"]]
    gaps = [b - a for a, b in itertools.pairwise(stamps)]
    args = record["args"]
    base = {k: args[a] for k, a in (("layers", "layers"), ("hidden", "hidden"),
            ("intermediate", "intermediate"), ("heads", "heads"), ("kv", "kv_heads"))}  # fmt: skip
    layer_s = statistics.median(gaps)
    solve_s = run["solve_seconds"] / base["layers"]
    forward_s = layer_s - solve_s
    tokens = args["samples"] * args["seq_len"]
    rows = []
    residual = (0.0, 0.0)
    for name, shape in SHAPES.items():
        weights = layer_weights(shape)
        layer_bytes = 2 * weights + 4 * shape["hidden"]  # bf16 weights, two norms
        forward = forward_s * weights / layer_weights(base)
        solve = solve_s * solve_work(shape) / solve_work(base)
        read = 0.0 if name == "8B" else layer_bytes / (read_gbps * GB)
        per_layer = forward + solve + read
        embed = 2 * VOCAB * shape["hidden"]
        host = run["baseline_rss"] + 2 * embed + 2 * layer_bytes
        biggest = max(k for _, k in linears(shape))
        gpu = (
            layer_bytes + 3 * 4 * biggest**2 + 2 * 2 * tokens * shape["hidden"]
            + 3 * 2 * args["batch_size"] * args["seq_len"] * shape["intermediate"]
        )  # fmt: skip
        source = shape["layers"] * layer_bytes + 2 * embed + 2 * shape["hidden"]
        packed = shape["layers"] * weights * (0.5 + (2 + 0.5) / 128) + 2 * embed
        disk = source + packed + 2 * 2 * tokens * shape["hidden"]
        if name == "8B" and base == SHAPES["8B"]:  # calibrate on the measured run
            residual = (run["peak_rss"] - host, (run["peak_cuda"] or 0) - gpu)
        rows.append({
            "model": name, "layer_s": per_layer, "forward_s": forward, "solve_s": solve,
            "read_s": read, "hours": per_layer * shape["layers"] / 3600, "host_gb": host / GB,
            "gpu_gb": gpu / GB, "disk_gb": disk / GB, "source_gb": source / GB,
        })  # fmt: skip
    for row in rows:  # what the measured run held beyond the formulas, held constant
        row["host_gb"] += residual[0] / GB
        row["gpu_gb"] += residual[1] / GB
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("record", help="the JSON of benchmarks/offload_gptq.py --out")
    parser.add_argument("--read-gbps", type=float, default=2.0, help="disk read, GB/s")
    args = parser.parse_args()
    with open(args.record, encoding="utf-8") as fh:
        record = json.load(fh)
    rows = estimate(record, args.read_gbps)
    print(
        "| model | per layer s (forwards + solves + read) | total h | host GB | GPU GB | disk GB |"
    )
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['model']} | {r['layer_s']:.1f} ({r['forward_s']:.1f} + {r['solve_s']:.1f} + "
            f"{r['read_s']:.1f}) | {r['hours']:.2f} | {r['host_gb']:.1f} | {r['gpu_gb']:.1f} | "
            f"{r['disk_gb']:.0f} (source {r['source_gb']:.0f}) |"
        )
    measured = record["offload"]
    print(
        f"measured 8B: {measured['seconds']:.1f} s, peak RSS {measured['peak_rss'] / GB:.2f} GB, "
        f"peak CUDA {(measured['peak_cuda'] or 0) / GB:.2f} GB"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
