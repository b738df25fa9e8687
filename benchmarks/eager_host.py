# ruff: noqa: B023  (each lambda is timed within its own loop iteration)
"""Host cost of the quantized modules in eager mode (no CUDA graphs), on an H200.

Usage (GPU): ``python3 benchmarks/eager_host.py [calls] [profile] [model] [modelprofile]
[--layers 8] [--rounds 7]``
(no section: both).

- ``calls``: host microseconds per ``forward`` of each quantized module against ``nn.Linear``
  of the same 512 × 512 shape at 1 row (the GPU work is a few microseconds, so a stream of
  2,000 calls is bound by the host): wall time of the calls, one synchronisation at the end.
- ``profile``: where each module's host time goes (cProfile of 2,000 one-row calls, the
  functions of most own time).
- ``model``: one-token steps of a random Llama-3-8B-shaped model of ``--layers`` decoder layers
  (lm_head bf16), eager and under CUDA graphs, for bf16, ``TorchFP8Linear`` (row), ``GPTQLinear``
  (W4A16) and ``W4AFP8Linear``; milliseconds per step and the eager ratio to bf16, measured
  interleaved over ``--rounds`` rounds (see :func:`model_bench`).
- ``modelprofile``: cProfile of eager steps of a 2-layer model (GPTQ and FP8 variants).
"""

import copy
import pathlib
import sys
import time

import torch
from torch import nn

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from w4a import (
    _converted,
    _option,
    _w4a16,
    _w4a_fp8,
    _w4a_nvfp4,
    eager_us,
    graph_us,
    llama_8b_shaped,
)

import floatxq as fq


def host_us(fn, calls: int = 2000) -> float:
    """Wall microseconds per call of ``fn`` over ``calls`` calls (one sync at the end)."""
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    started = time.perf_counter()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - started) * 1e6 / calls


def _small_modules() -> dict[str, nn.Module]:
    """``nn.Linear`` and each quantized module of the same 512 × 512 weight, on the GPU."""
    torch.manual_seed(0)
    linear = nn.Linear(512, 512, bias=False).cuda().to(torch.bfloat16)
    fp32 = copy.deepcopy(linear).float()  # (nn.Module.float() converts in place)
    return {
        "nn.Linear": linear,
        "TorchFP8Linear (row)": fq.TorchFP8Linear.from_linear(linear),
        "TorchFP8Linear (token activations)": fq.TorchFP8Linear.from_linear(
            linear, input_quant="token"
        ),
        "TorchFP4Linear": fq.TorchFP4Linear.from_linear(fp32).cuda(),
        "GPTQLinear": _w4a16(fp32).cuda().post_init(),
        "W4AFP8Linear": _w4a_fp8(fp32).cuda().post_init(),
        "W4ANVFP4Linear": _w4a_nvfp4(fp32).cuda().post_init(),
    }


def calls_bench() -> None:
    modules = _small_modules()
    x = torch.randn(1, 512, device="cuda", dtype=torch.bfloat16)
    print("| module | host us / call | over nn.Linear | route |")
    print("|---|---|---|---|")
    base = None
    with torch.inference_mode():
        for name, module in modules.items():
            us = host_us(lambda: module(x))
            base = base if base is not None else us
            route = getattr(module, "last_route", "")
            print(f"| {name} | {us:.1f} | {us - base:+.1f} | {route} |", flush=True)


def profile_bench() -> None:
    import cProfile
    import pstats

    wanted = ("TorchFP8Linear (row)", "TorchFP4Linear", "GPTQLinear", "W4AFP8Linear")
    modules = {name: module for name, module in _small_modules().items() if name in wanted}
    x = torch.randn(1, 512, device="cuda", dtype=torch.bfloat16)
    with torch.inference_mode():
        for name, module in modules.items():
            host_us(lambda: module(x), calls=200)
            profile = cProfile.Profile()
            profile.enable()
            host_us(lambda: module(x), calls=2000)
            profile.disable()
            print(f"## {name}: {module.last_route}", flush=True)
            pstats.Stats(profile).sort_stats("tottime").print_stats(14)


def model_profile_bench() -> None:
    """cProfile of eager one-token steps of a 2-layer model per variant (where host time goes)."""
    import cProfile
    import pstats

    config, base = llama_8b_shaped(2)
    variants = {
        "GPTQLinear (W4A16)": lambda: _converted(base, lambda lin: _w4a16(lin).post_init()),
        "TorchFP8Linear (row)": lambda: _converted(base, fq.TorchFP8Linear.from_linear),
    }
    for name, build in variants.items():
        model = build()
        for batch in (1, 16):
            ids = torch.randint(0, config.vocab_size, (batch, 1), device="cuda")
            with torch.inference_mode():
                for _ in range(3):
                    model(input_ids=ids, use_cache=False)
                torch.cuda.synchronize()
                profile = cProfile.Profile()
                profile.enable()
                for _ in range(20):
                    model(input_ids=ids, use_cache=False)
                torch.cuda.synchronize()
                profile.disable()
            print(f"## {name}, batch {batch}", flush=True)
            pstats.Stats(profile).sort_stats("tottime").print_stats(12)
        del model


def model_bench() -> None:
    """Eager against graph steps, and the eager A/B against bf16 interleaved: every variant is
    built first, then each round times one eager step of each in turn, so a drift of the host's
    speed (seen between and within runs) moves all of a round's rows together; the ratio is the
    median of the per-round ratios, with its range."""
    (layers,) = _option("--layers", (8,))
    (rounds,) = _option("--rounds", (7,))
    config, base = llama_8b_shaped(layers)
    models = {
        "bf16": base,
        "TorchFP8Linear (row)": _converted(base, fq.TorchFP8Linear.from_linear),
        "GPTQLinear (W4A16)": _converted(base, lambda lin: _w4a16(lin).post_init()),
        "W4AFP8Linear": _converted(base, _w4a_fp8),
    }
    print(f"| model ({layers} layers) | batch | eager ms / step (median of {rounds} rounds) | "
          "graph ms / step | eager / bf16 (median, range) |")  # fmt: skip
    print("|---|---|---|---|---|")
    for batch in (1, 16):
        ids = torch.randint(0, config.vocab_size, (batch, 1), device="cuda")
        steps = {
            name: (lambda m=m: m(input_ids=ids, use_cache=False)) for name, m in models.items()
        }
        eager: dict[str, list[float]] = {name: [] for name in models}
        with torch.inference_mode():
            for _ in range(rounds):
                for name, step in steps.items():
                    eager[name].append(eager_us(step, calls=10))
            graph = {name: graph_us([step], calls=5, replays=5) for name, step in steps.items()}
        for name in models:
            ratios = sorted(e / b for e, b in zip(eager[name], eager["bf16"], strict=True))
            mid = sorted(eager[name])[rounds // 2]
            print(f"| {name} | {batch} | {mid / 1e3:.2f} | {graph[name] / 1e3:.2f} | "
                  f"{ratios[rounds // 2]:.2f}x ({ratios[0]:.2f}-{ratios[-1]:.2f}) |",
                  flush=True)  # fmt: skip


def main() -> None:
    if "--help" in sys.argv or "-h" in sys.argv:
        print(__doc__)
        return
    sections = ("calls", "profile", "model", "modelprofile")
    wanted = {a for a in sys.argv[1:] if a in sections} or {"calls", "model"}
    props = torch.cuda.get_device_properties(0)
    print(f"# {props.name}, torch {torch.__version__}, {time.strftime('%Y-%m-%d %H:%M UTC')}")
    if "calls" in wanted:
        calls_bench()
    if "profile" in wanted:
        profile_bench()
    if "model" in wanted:
        model_bench()
    if "modelprofile" in wanted:
        model_profile_bench()


if __name__ == "__main__":
    main()
