"""GPTQ of a random Llama-3-8B-shaped model shared by N processes (one per GPU) against one.

Run (a host with 8 H200s): python3 benchmarks/distributed_gptq.py --gpus 1,2,4,8 --out r.json
One GPU, correctness only: python3 benchmarks/distributed_gptq.py --gpus 1,2 --same-gpu
CPU smoke run (gloo, a 2-layer model): python3 benchmarks/distributed_gptq.py --cpu --gpus 1,2

For each N of ``--gpus`` in turn the parent starts ``torchrun --nproc-per-node N`` on this
script with ``--worker``. Every worker joins the group (``torchrun_setup``: NCCL, its own GPU),
builds the same random bf16 model on the CPU (``gptq_scale.build_model``: Llama-3-8B's shapes by
default, weights from a fixed seed, the same whatever the thread count), draws the same
calibration (``--samples`` x ``--seq-len`` uniform token ids, fixed seed) and runs
``floatxq.load(model, quantize_config=GPTQConfig(bits=4, group_size=128)).quantize(samples,
batch_size=..., process_group=group)``: the model stays on the CPU, each decoder layer is solved
on the process's GPU (the current CUDA device). Timed: the build, and ``quantize`` from a barrier
to a barrier. The first process writes a JSON record: N, the seconds, every module's Hessian
loss (``qm.report``), a sha256 of every GPTQ module's buffers (packed words, scales, zero
points, ``g_idx``) as each process holds them, and each process's peak GPU memory
(``torch.cuda.max_memory_allocated``, gathered).

The parent then reports, against the smallest N (1 when given): the speedup t_1 / t_N, whether
every module's codes are bit-equal (and equal on every process), and the largest relative
difference of a module loss; all of it goes to ``--out``. It exits 1 when any codes differ.

``--same-gpu``: every process works on ``cuda:0`` and the group is gloo (the worker maps its
``LOCAL_RANK`` to 0 before ``torchrun_setup``), so a one-GPU machine checks the bits; its times
mean nothing. ``--cpu``: no GPU (``CUDA_VISIBLE_DEVICES`` empty), gloo, and by default a small
model of the same form (2 layers, hidden 256, MLP 512, 4/2 heads, vocab 1024; 4 samples of 64
tokens) so the script itself can be tested. Every worker runs with ``--threads`` CPU threads
(default: the host's CPUs over the largest N; 1 with ``--cpu``, since CPU kernels block their
work by thread count and equal bits need equal counts).
"""

import argparse
import datetime
import json
import os
import pathlib
import platform
import subprocess
import sys
import tempfile
from typing import Any

HERE = pathlib.Path(__file__).resolve()
REPO = HERE.parents[1]

SHAPES: dict[str, dict[str, int]] = {
    "gpu": {"layers": 32, "hidden": 4096, "intermediate": 14336, "heads": 32, "kv_heads": 8,
            "vocab": 128256, "samples": 128, "seq_len": 2048},
    "cpu": {"layers": 2, "hidden": 256, "intermediate": 512, "heads": 4, "kv_heads": 2,
            "vocab": 1024, "samples": 4, "seq_len": 64},
}  # fmt: skip
"""The default shapes: Llama-3-8B's on GPUs, a small model of the same form with ``--cpu``."""

SHAPE_KEYS = ("layers", "hidden", "intermediate", "heads", "kv_heads", "vocab")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpus", default="1,2", help="process counts to run, e.g. 1,2,4,8")
    for key in (*SHAPE_KEYS, "samples", "seq_len"):
        parser.add_argument(f"--{key.replace('_', '-')}", type=int, default=None)
    parser.add_argument("--batch-size", type=int, default=1, help="calibration batch")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=0, help="CPU threads per process")
    parser.add_argument("--same-gpu", action="store_true", help="every process on cuda:0, gloo")
    parser.add_argument(
        "--split-rows", action="store_true", help="split every module's rows over the processes"
    )
    parser.add_argument("--cpu", action="store_true", help="no GPU: gloo on the CPU, small model")
    parser.add_argument("--out", default=None, help="write the JSON record here")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--result", default=None, help=argparse.SUPPRESS)
    return parser


def _module_hash(module: Any) -> str:
    """sha256 of a module's buffers: each name, dtype, shape and bytes, in name order."""
    import hashlib

    import torch

    digest = hashlib.sha256()
    for name, buf in sorted(module.named_buffers(), key=lambda item: item[0]):
        data = buf.detach().contiguous().reshape(-1).view(torch.uint8).cpu()
        digest.update(f"{name}:{buf.dtype}:{tuple(buf.shape)};".encode())
        digest.update(data.numpy().tobytes())
    return digest.hexdigest()


def worker(args: argparse.Namespace) -> None:
    """One process of a torchrun: build, calibrate, quantize with the group, report."""
    if args.same_gpu:
        os.environ["LOCAL_RANK"] = "0"  # every process on cuda:0 (torchrun_setup reads it)
    import time

    import torch
    import torch.distributed as dist

    sys.path.insert(0, str(REPO))
    sys.path.insert(0, str(HERE.parent))
    from gptq_scale import build_model, llama_config

    import floatxq
    from floatxq.lifecycle.distributed import torchrun_setup

    group, device = torchrun_setup(backend="gloo" if args.same_gpu else None)
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    cuda = device.type == "cuda"
    config = llama_config(**{key: getattr(args, key) for key in SHAPE_KEYS})
    start = time.perf_counter()
    model = build_model(config, seed=args.seed, threads=args.threads)
    build_s = time.perf_counter() - start
    g = torch.Generator(device="cpu").manual_seed(args.seed + 1)
    ids = torch.randint(0, args.vocab, (args.samples, args.seq_len), generator=g)
    qm = floatxq.load(model, quantize_config=floatxq.GPTQConfig(bits=4, group_size=128))
    if cuda:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    dist.barrier(group)
    start = time.perf_counter()
    qm.quantize(
        list(ids.unbind(0)), batch_size=args.batch_size, progress=False, process_group=group,
        split_rows=args.split_rows and world > 1,
    )  # fmt: skip
    if cuda:
        torch.cuda.synchronize(device)
    dist.barrier(group)
    seconds = time.perf_counter() - start
    hashes = {name: _module_hash(qm.model.get_submodule(name)) for name in qm.quantized_modules}
    mine = {
        "rank": rank,
        "device": str(device),
        "build_seconds": build_s,
        "quantize_seconds": seconds,
        "peak_gpu_bytes": torch.cuda.max_memory_allocated(device) if cuda else None,
        "hashes": hashes,
    }
    everyone: list[Any] = [None] * world
    dist.all_gather_object(everyone, mine, group=group)
    if rank == 0:
        record = {
            "processes": world,
            "device": torch.cuda.get_device_name(device) if cuda else "cpu",
            "backend": dist.get_backend(group),
            "threads": torch.get_num_threads(),
            "build_seconds": build_s,
            "quantize_seconds": seconds,
            "per_process": [{k: v for k, v in p.items() if k != "hashes"} for p in everyone],
            "ranks_agree": all(p["hashes"] == hashes for p in everyone),
            "losses": {m.name: float(m.loss) for m in qm.report.modules},
            "solve_seconds": {m.name: float(m.seconds) for m in qm.report.modules},
            "hashes": hashes,
        }
        pathlib.Path(args.result).write_text(json.dumps(record, indent=1))
        print(
            f"N={world}: built in {build_s:.1f} s, quantized in {seconds:.1f} s, "
            f"{len(hashes)} modules",
            flush=True,
        )
    dist.destroy_process_group()


INPUT_GROUPS = (
    ("q_proj", "k_proj", "v_proj"),
    ("o_proj",),
    ("gate_proj", "up_proj"),
    ("down_proj",),
)
"""A Llama layer's modules that read the same input (solved together, spread over processes)."""


def project(run: dict[str, Any], n: int) -> float:
    """The seconds of an ``n``-process run that a one-process ``run`` predicts if communication
    were free: everything but the module solves divided by ``n``, and each input group's solves
    (their measured seconds) spread as ``owners`` spreads them, the group taking its slowest
    process. An upper bound on the speedup, not a measurement."""
    from floatxq.lifecycle.distributed import owners

    solves: dict[str, float] = run["solve_seconds"]
    groups: dict[tuple[str, int], list[float]] = {}
    for name, seconds in solves.items():
        parent, _, leaf = name.rpartition(".")
        index = next((i for i, g in enumerate(INPUT_GROUPS) if leaf in g), len(INPUT_GROUPS))
        groups.setdefault((parent if index < len(INPUT_GROUPS) else name, index), []).append(
            seconds
        )
    spread = 0.0
    for times in groups.values():
        owner = owners(times, n)
        spread += max(sum(t for t, o in zip(times, owner, strict=True) if o == r) for r in range(n))
    return (run["quantize_seconds"] - sum(solves.values())) / n + spread


def compare(base: dict[str, Any], run: dict[str, Any]) -> dict[str, Any]:
    """``run`` against ``base``: speedup, codes bit-equal (module by module), loss difference."""
    differ = sorted(n for n in base["hashes"] if run["hashes"].get(n) != base["hashes"][n])
    differ += sorted(set(run["hashes"]) - set(base["hashes"]))
    rel = [
        abs(run["losses"][name] - loss) / max(abs(loss), 1e-30)
        for name, loss in base["losses"].items()
        if name in run["losses"]
    ]
    return {
        "processes": run["processes"],
        "speedup": base["quantize_seconds"] / run["quantize_seconds"],
        "codes_equal": not differ and run["ranks_agree"] and bool(base["hashes"]),
        "ranks_agree": run["ranks_agree"],
        "modules": len(run["hashes"]),
        "modules_differing": differ,
        "losses_compared": len(rel),
        "max_rel_loss_diff": max(rel, default=0.0),
    }


def main() -> int:
    args = _parser().parse_args()
    preset = SHAPES["cpu" if args.cpu else "gpu"]
    for key, value in preset.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.worker:
        worker(args)
        return 0
    counts = sorted({int(n) for n in args.gpus.split(",") if n.strip()})
    if not counts or counts[0] < 1:
        raise SystemExit(f"--gpus {args.gpus!r}: give process counts of at least 1, e.g. 1,2")
    if args.same_gpu and args.cpu:
        raise SystemExit("--same-gpu and --cpu exclude each other")
    threads = args.threads or (1 if args.cpu else max(1, (os.cpu_count() or 1) // counts[-1]))
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    if args.cpu:
        env["CUDA_VISIBLE_DEVICES"] = ""
    passed = [f"--{k.replace('_', '-')}={getattr(args, k)}" for k in (*preset, "batch_size")]
    passed += [f"--seed={args.seed}", f"--threads={threads}"]
    passed += ["--same-gpu"] * args.same_gpu + ["--cpu"] * args.cpu
    passed += ["--split-rows"] * args.split_rows
    runs: dict[int, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for n in counts:
            result = pathlib.Path(tmp) / f"n{n}.json"
            launch = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
            launch += ["--nproc-per-node", str(n), str(HERE), "--worker", f"--result={result}"]
            print(f"# torchrun --nproc-per-node {n} ... ({threads} threads each)", flush=True)
            subprocess.run([*launch, *passed], check=True, env=env)
            runs[n] = json.loads(result.read_text())
    base = runs[counts[0]]
    table = [compare(base, runs[n]) for n in counts]
    print(f"\n{'N':>3} {'quantize s':>10} {'speedup':>8} {'codes equal':>11} {'max rel loss':>12}")
    for n, row in zip(counts, table, strict=True):
        print(
            f"{n:>3} {runs[n]['quantize_seconds']:>10.1f} {row['speedup']:>8.2f} "
            f"{'yes' if row['codes_equal'] else 'NO':>11} {row['max_rel_loss_diff']:>12.3g}"
        )
    projection = {}
    if counts[0] == 1 and "solve_seconds" in base:
        solves = sum(base["solve_seconds"].values())
        print(
            f"\none process: {base['quantize_seconds']:.1f} s, of it module solves {solves:.1f} s"
        )
        for n in (2, 4, 8):
            projection[n] = project(base, n)
            print(
                f"  N={n} if communication were free: {projection[n]:.1f} s "
                f"({base['quantize_seconds'] / projection[n]:.2f}x)"
            )
    record = {
        "projection_seconds": projection,
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "host": platform.node(),
        "cpu_count": os.cpu_count(),
        "args": {k: v for k, v in vars(args).items() if k not in ("worker", "result")},
        "threads": threads,
        "reference_processes": counts[0],
        "comparison": table,
        "runs": {str(n): run for n, run in runs.items()},
    }
    if args.out:
        pathlib.Path(args.out).write_text(json.dumps(record, indent=1))
    return 0 if all(row["codes_equal"] for row in table) else 1


if __name__ == "__main__":
    sys.exit(main())
