"""Sweep ``fp8_small_m``'s launch configurations at decode sizes against cuBLAS in the same run.

Usage (GPU): ``python3 benchmarks/fp8_small_m_sweep.py [--quick | --refine | --crossover]``

For each recipe (tensorwise, rowwise, blockwise; N = K = 8192, bf16 ``x``) and M in {1, 16} it
times every configuration of the kernel (BLOCK_N, BLOCK_K, warps, pipeline stages, split-K; with
``--refine``: the amax pass's load widths and loads in flight, and the FP32 promotion interval,
around the shipped tiles), then prints the best ones next to the raw ``torch._scaled_mm`` of the
same recipe on inputs already in FP8 (the anchor of the forward goal). Kernels are compiled first
in parallel worker processes (Triton's on-disk cache), so the timing loop only loads them.
``--crossover`` instead times the shipped kernel against ``TorchFP8Linear``'s two-launch
``scaled_mm`` route for M from 1 to 32 (where ``SMALL_M`` should sit).

Times: GPU microseconds per call, median of CUDA-graph replays of 20 back-to-back calls ("gr",
no launch gaps: what a decode loop under graphs sees) and, for the leaders, CUDA events with
the L2 flushed before each call ("ev", ``triton.testing.do_bench``). Every leader is also
checked against the accumulation bound the GPU tests use (``HOPPER_FP8_ACCUMULATION``).
"""

import argparse
import dataclasses
import functools
import itertools
import multiprocessing
import pathlib
import sys

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from floatxq.kernels import fp8_small_m
from floatxq.kernels.fp8_small_m import DEFAULT_SMALL_M_TUNING, FP8SmallMTiles

GLOBALS = {
    "AMAX_TILE": "amax_tile",
    "AMAX_ROW_TILE": "amax_row_tile",
    "AMAX_UNROLL": "amax_unroll",
    "COOP_MIN_ROWS": "coop_min_rows",
    "COOP_MAX_PIECE": "coop_max_piece",
}
"""Configuration keys that name ``FP8SmallMTuning`` fields outside the per-recipe tiles."""

N = K = 8192
RECIPES = (("tensorwise", "tensor", None), ("rowwise", "row", None), ("blockwise", "block", 128))


def configs(recipe: str, quick: bool) -> list[dict]:
    """Candidate tiles; ``quick`` keeps the neighbourhood of the shipped ones (64- and 128-wide
    tiles)."""
    block_ks = (128,) if recipe == "blockwise" else (128, 256)
    return [
        dict(BLOCK_N=bn, BLOCK_K=bk, num_warps=warps, num_stages=st, split_k=split)
        for bn, bk, st, warps, split in itertools.product(
            (64, 128) if quick else (32, 64, 128),
            block_ks,
            (3, 4, 5, 6),
            (4, 8),
            (1, 2, 4),
        )
    ]


def _shipped(recipe: str) -> dict:
    """The shipped multi-row tiles of ``recipe`` as a configuration."""
    tiles = DEFAULT_SMALL_M_TUNING.tiles(recipe, 16)
    return dict(
        BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k, num_warps=tiles.num_warps,
        num_stages=tiles.num_stages, split_k=tiles.split_k,
    )  # fmt: skip


def refine_configs(recipe: str) -> list[dict]:
    """The neighbourhood of the shipped tiles: the amax pass's load width and loads in flight
    (``amax_*`` fields), FP32 promotion of the FP8 MMA sums, stages and splits."""
    base = _shipped(recipe)
    amax = (
        ((4096, 8192, 16),)
        if recipe == "blockwise"
        else tuple(itertools.product((4096, 8192), (4096, 8192), (8, 16)))
    )
    out = []
    for (tile, row_tile, unroll), imprecise, stages, split in itertools.product(
        amax, (32, 128, base["BLOCK_K"]), (3, 4), (1, 2, 4)
    ):
        keys = dict(AMAX_TILE=tile, AMAX_ROW_TILE=row_tile, AMAX_UNROLL=unroll)
        out.append(dict(base, **keys, imprecise_k=imprecise, num_stages=stages, split_k=split))
    return list({str(sorted(c.items())): c for c in out}.values())


def coop_configs(recipe: str) -> list[dict]:
    """Tiles whose grid fits one program per SM at N = 8192 (the shared amax's cooperative
    launch), x's amax reduced together from one row on; the shipped tiles without it."""
    out = [dict(_shipped(recipe), COOP_MIN_ROWS=1 << 30)]
    for bn, bk, st, warps, split in itertools.product(
        (64, 128), (128, 256), (3, 4, 5, 6), (4, 8), (1, 2)
    ):
        if (N // bn) * split <= 132:
            out.append(
                dict(BLOCK_N=bn, BLOCK_K=bk, num_warps=warps, num_stages=st, split_k=split,
                     COOP_MIN_ROWS=1)
            )  # fmt: skip
    return out


def _tuning(recipe: str, config: dict, **fields):
    """The default ``FP8SmallMTuning`` with ``recipe``'s tiles (one-row and multi-row) and the
    other fields a configuration names (``GLOBALS``) taken from ``config``."""
    tiles = FP8SmallMTiles(
        block_n=config["BLOCK_N"],
        block_k=config["BLOCK_K"],
        num_warps=config["num_warps"],
        num_stages=config["num_stages"],
        split_k=config.get("split_k", 1),
        imprecise_k=config.get("imprecise_k", 32),
    )
    named = {field: config[key] for key, field in GLOBALS.items() if key in config}
    return dataclasses.replace(
        DEFAULT_SMALL_M_TUNING, **{recipe: tiles, f"{recipe}_one_row": tiles}, **named, **fields
    )


def candidates(recipe: str, mode: str) -> list[dict]:
    if mode == "coop":
        return coop_configs(recipe)
    return refine_configs(recipe) if mode == "refine" else configs(recipe, mode == "quick")


def rows_of(mode: str) -> tuple[int, ...]:
    return (1, 2, 4, 8, 16) if mode == "coop" else (1, 16)


def _operands(recipe: str, method: str, block):
    import floatxq as fq

    torch.manual_seed(0)
    w = torch.randn(N, K, device="cuda", dtype=torch.bfloat16)
    q = fq.quantize_fp8_weight(
        w, weight_scale_method=method, weight_block_size=(block, block) if block else None
    )
    bias = torch.randn(N, device="cuda", dtype=torch.bfloat16)
    xs = {m: torch.randn(m, K, device="cuda", dtype=torch.bfloat16) for m in (1, 2, 4, 8, 16)}
    return q, 1 / q.scale_inv, bias, xs


def _compile(job: tuple[int, int, str, tuple[str, ...]]) -> list[str]:
    """Worker: compile (and launch once) every ``index % workers == worker`` configuration."""
    worker, workers, mode, names = job
    errors = []
    for recipe, method, block in RECIPES:
        if recipe not in names:
            continue
        q, scale, bias, xs = _operands(recipe, method, block)
        for i, tiles in enumerate(candidates(recipe, mode)):
            if i % workers != worker:
                continue
            tuning = _tuning(recipe, tiles)
            for m in rows_of(mode):
                try:
                    fp8_small_m._launch(xs[m], q.qweight, scale, bias, recipe, tuning=tuning)
                except Exception as exc:  # out of shared memory etc.: reported, not a candidate
                    errors.append(f"{recipe} {tiles} M={m}: {type(exc).__name__}")
    torch.cuda.synchronize()
    return errors


def graph_us(fn, calls: int = 20, replays: int = 7) -> float:
    """Median GPU microseconds per call over CUDA-graph replays of ``calls`` calls."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        for _ in range(calls):
            fn()
    graph.replay()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / calls)
    return sorted(times)[len(times) // 2]


def raw_anchor(recipe: str, q, m: int):
    import torch.nn.functional as F

    x = torch.randn(m, K, device="cuda").to(torch.float8_e4m3fn)
    wt = q.qweight.t()
    bf16 = torch.bfloat16
    if recipe == "tensorwise":
        one = torch.ones((), device="cuda")
        return lambda: torch._scaled_mm(x, wt, one, one, out_dtype=bf16)
    if recipe == "rowwise":
        sa, sb = torch.ones(m, 1, device="cuda"), torch.ones(1, N, device="cuda")
        return lambda: torch._scaled_mm(x, wt, sa, sb, out_dtype=bf16)
    recipes = F.ScalingType
    r1 = getattr(recipes, "BlockWise1x128", None) or getattr(recipes, "Blockwise_1x128", None)
    r128 = getattr(recipes, "BlockWise128x128", None) or getattr(recipes, "Blockwise_128x128", None)
    m16 = -(-m // 16) * 16
    x16 = torch.randn(m16, K, device="cuda").to(torch.float8_e4m3fn)
    sa = torch.ones(K // 128, m16, device="cuda").t()
    sb = torch.ones(N // 128, K // 128, device="cuda").t()
    return lambda: F.scaled_mm(x16, wt, sa, r1, sb, r128, output_dtype=bf16)


def crossover(ms: tuple[int, ...] = (1, 2, 4, 8, 16, 32)) -> None:
    """Fused kernel (shipped tiles) against the module's two-launch ``scaled_mm`` route (input
    quantization kernel + cuBLAS) and the raw cuBLAS call, over M: where ``SMALL_M`` and the
    graph-capture policy of ``TorchFP8Linear`` should switch. GPU time (graph replays)."""
    from floatxq.nn import TorchFP8Linear

    print("== crossover: fused fp8_small_m vs the scaled_mm route (gr us, N = K = 8192, bf16)")
    print("recipe      M     fused  16-row  route    raw   route/fused  raw/fused")
    torch.manual_seed(0)
    dense = torch.nn.Linear(K, N, bias=True, device="cuda", dtype=torch.bfloat16)
    for recipe, method, block in RECIPES:
        layer = TorchFP8Linear.from_linear(
            dense, weight_scale_method=method, weight_block_size=(block, block) if block else None
        )
        for dtype in (torch.bfloat16, torch.float16):
            layer._runtime.disabled[("fp8_small_m", dtype)] = "off: the route is timed"
        scale, bias = layer._direct_weight_scale(), layer._bias_as(torch.bfloat16)
        for m in ms:
            x = torch.randn(m, K, device="cuda", dtype=torch.bfloat16)
            launch = functools.partial(fp8_small_m._launch, x, layer.weight, scale, bias, recipe)
            fused = graph_us(launch)
            sixteen_rows = dataclasses.replace(DEFAULT_SMALL_M_TUNING, block_m_one_row=16)
            sixteen = graph_us(functools.partial(launch, tuning=sixteen_rows))  # 16-row programs
            route = graph_us(functools.partial(layer, x))
            q = type("Q", (), {"qweight": layer.weight})
            raw = graph_us(raw_anchor(recipe, q, m))
            print(
                f"{recipe:10s} {m:3d}  {fused:7.1f} {sixteen:6.1f}  {route:6.1f} {raw:6.1f}   "
                f"{route / fused:9.3f}  {raw / fused:9.3f}"
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer configurations")
    parser.add_argument("--refine", action="store_true", help="around the best tiles")
    parser.add_argument("--workers", type=int, default=16)
    parser.add_argument("--top", type=int, default=6)
    parser.add_argument("--recipes", default="tensorwise,rowwise,blockwise")
    parser.add_argument("--crossover", action="store_true", help="only the fused/route crossover")
    parser.add_argument(
        "--coop", action="store_true", help="x's amax reduced by all programs together, M 1-16"
    )
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/fp8_small_m_sweep.py needs a CUDA device")
    if args.crossover:
        crossover()
        return

    from triton.testing import do_bench

    from floatxq.testing import HOPPER_FP8_ACCUMULATION, assert_fp8_linear_close

    context = multiprocessing.get_context("spawn")
    with context.Pool(args.workers) as pool:
        names = tuple(args.recipes.split(","))
        mode = (
            "coop" if args.coop else "refine" if args.refine else "quick" if args.quick else "full"
        )
        jobs = [(w, args.workers, mode, names) for w in range(args.workers)]
        failures = sorted({e for errs in pool.map(_compile, jobs) for e in errs})
    for line in failures:
        print(f"  not a candidate: {line}")

    props = torch.cuda.get_device_properties(0)
    print(f"== fp8_small_m sweep on {props.name}, N = K = {N}, bf16 x; gr = graph replay us")
    shipped = {}
    for recipe, method, block in RECIPES:
        if recipe not in names:
            continue
        q, scale, bias, xs = _operands(recipe, method, block)
        ms = rows_of(mode)
        anchors = {m: graph_us(raw_anchor(recipe, q, m)) for m in ms}
        anchors_ev = {
            m: do_bench(raw_anchor(recipe, q, m), warmup=10, rep=50, return_mode="median") * 1e3
            for m in ms
        }
        rows = {m: [] for m in ms}
        for tiles in candidates(recipe, mode):
            tuning = _tuning(recipe, tiles)
            for m in ms:
                fn = functools.partial(
                    fp8_small_m._launch, xs[m], q.qweight, scale, bias, recipe, tuning=tuning
                )
                try:
                    rows[m].append((graph_us(fn), tiles))
                except Exception as exc:
                    print(f"  failed: {recipe} M={m} {tiles}: {type(exc).__name__}: {exc}"[:300])
                    continue
        for m in ms:
            rows[m].sort(key=lambda r: r[0])
            print(
                f"-- {recipe} M={m}: raw scaled_mm gr {anchors[m]:.1f} us, "
                f"ev {anchors_ev[m]:.1f} us ({len(rows[m])} configurations)"
            )
            for us, tiles in rows[m]:
                if tiles.get("COOP_MIN_ROWS") == 1 << 30:
                    print(f"   (shipped tiles, each program reading all of x: gr {us:6.1f})")
            for us, tiles in rows[m][: args.top]:
                x = xs[m]
                fn = functools.partial(
                    fp8_small_m._launch, x, q.qweight, scale, bias, recipe,
                    tuning=_tuning(recipe, tiles),
                )  # fmt: skip
                ev = do_bench(fn, warmup=10, rep=50, return_mode="median") * 1e3
                try:
                    sums = HOPPER_FP8_ACCUMULATION
                    assert_fp8_linear_close(
                        fn(), x, q.qweight, q.scale_inv, bias, recipe=recipe, accumulation=sums
                    )
                    ok = "in bound"
                except AssertionError as exc:
                    ok = f"OUTSIDE the bound: {str(exc)[:60]}"
                print(
                    f"   gr {us:6.1f} ({anchors[m] / us:.3f}x raw)  ev {ev:6.1f} "
                    f"({anchors_ev[m] / ev:.3f}x raw)  {ok}  {tiles}"
                )
            best = rows[m][0][1] if rows[m] else None
            shipped[(recipe, m)] = best
    print("best per (recipe, M) (M = 1: FP8SmallMTuning.<recipe>_one_row, M = 16: .<recipe>):")
    for key, tiles in shipped.items():
        print(f"  {key}: {tiles}")


if __name__ == "__main__":
    main()
