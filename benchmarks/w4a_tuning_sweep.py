# ruff: noqa: B023  (each lambda is timed within its own loop iteration)
"""Launch-shape sweep of the INT4 decode kernels on the Llama-3-8B layer shapes (issue 31).

Usage (GPU): ``python3 benchmarks/w4a_tuning_sweep.py [--shapes 1024x4096,...] [--rows 1,16]
[--budget 420] [--all]``.

For each ``N x K`` shape and row count, times (CUDA graphs over weight copies beyond L2, as
``benchmarks/w4a.py``) the library's default launch shape against a grid of others, for:
the W4A16 fragment kernel (``FragTuning``: blocks of 16 columns, programs per SM), the W4A16
decode-words kernel (``W4A16Tuning.words_*``), the W4A-FP8 fragment GEMM and its decode-words
GEMM (``W4AFP8Tuning.dwords_*``). Each result is checked against the default's (FP32 summation
order only may differ) before it is timed. Prints, per kernel, the default's time, the best
launch shape and its time (``--all``: every launch shape's). ``--budget``: seconds after
which the sweep stops (compiles dominate).
"""

import dataclasses
import pathlib
import sys
import time

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

from w4a import _gptq, _option, copies_for, graph_us

import floatxq as fq
from floatxq.gptq.decode_words import gptq_decode_operands, stage_decode_words
from floatxq.gptq.fragment_words import stage_fragment_words
from floatxq.gptq.planes import centered_int4
from floatxq.kernels import w4a16, w4a_fp8, w4a_frag

STARTED = time.perf_counter()


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    scale = b.float().abs().max().clamp_min(1e-6)
    return bool(((a.float() - b.float()).abs().max() / scale) < 2e-2)


def _sweep(label: str, configs: dict[str, object], run) -> None:
    """Time ``run(config)`` (a list of per-copy calls) for each config; the first is the
    default. Prints the default, the best and the ratio."""
    (budget,) = _option("--budget", (420,))
    results, reference = {}, None
    for name, config in configs.items():
        if time.perf_counter() - STARTED > budget:
            print(f"  ({label}: budget spent after {len(results)} configs)")
            break
        try:
            fns = run(config)
            out = fns[0]()
            if reference is None:
                reference = out
            elif not _close(out, reference):
                print(f"  {label} {name}: WRONG result, skipped")
                continue
            results[name] = graph_us(fns)
        except Exception as exc:  # (a launch shape a kernel refuses)
            print(f"  {label} {name}: {type(exc).__name__}: {str(exc)[:80]}")
    if not results:
        return
    default = next(iter(results.values()))
    best = min(results, key=results.get)
    if "--all" in sys.argv:  # every launch shape's time, fastest first
        ranked = sorted(results.items(), key=lambda item: item[1])
        print(f"  {label}: " + "; ".join(f"{name} {t:.1f}" for name, t in ranked))
    print(f"| {label} | {default:.1f} | {best} | {results[best]:.1f} | "
          f"{default / results[best]:.2f}x |", flush=True)  # fmt: skip


def main() -> None:
    shapes = [(14336, 4096), (1024, 4096), (4096, 4096), (4096, 14336)]
    if "--shapes" in sys.argv:
        spec = sys.argv[sys.argv.index("--shapes") + 1].split(",")
        shapes = [tuple(int(v) for v in item.split("x")) for item in spec]
    rows = _option("--rows", (1, 16))
    props = torch.cuda.get_device_properties(0)
    print(f"# {props.name}, torch {torch.__version__}, {time.strftime('%Y-%m-%d %H:%M UTC')}")
    print("| kernel, N x K, M | default us | best launch shape | best us | default / best |")
    print("|---|---|---|---|---|")
    frag_default, w16_default = w4a_frag.DEFAULT_FRAG_TUNING, w4a16.DEFAULT_W4A16_TUNING
    fp8_default = w4a_fp8.DEFAULT_W4A_FP8_TUNING
    for n, k in shapes:
        gptq = [_gptq(n, k, i) for i in range(copies_for(n * k // 2))]
        ops = [gptq_decode_operands(p, group_size=128, dtype=torch.bfloat16)[0] for p in gptq]
        frags = [stage_fragment_words(o.words) for o in ops]
        centered = [stage_decode_words(centered_int4(p) + 8) for p in gptq]
        fp8_frags = [stage_fragment_words(w) for w in centered]
        device = torch.device("cuda")
        for m in rows:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            codes, row_scale = fq.fp8_pack(x)
            frag_cfgs, w16_cfgs = {"default": frag_default}, {"default": frag_default}
            for blocks in (4, 8, 16):
                for target in (2, 4, 8):
                    name = f"blocks={blocks} programs={target}"
                    frag_cfgs[name] = dataclasses.replace(
                        frag_default, blocks=blocks, target_programs=target
                    )
                    w16_cfgs[name] = dataclasses.replace(
                        frag_default, w4a16_blocks=blocks, w4a16_target_programs=target
                    )
            has_lo = gptq[0].scales.dtype != x.dtype  # (FP16 scales, BF16 x: as the modules)
            _sweep(f"W4A16 frag, {n}x{k}, {m}", w16_cfgs, lambda t: [
                lambda f=f, o=o: w4a_frag.w4a16_frag_linear(
                    x, f, o, None, k, n, 128, device, has_lo, t
                ) for f, o in zip(frags, ops, strict=True)
            ])  # fmt: skip
            words_cfgs = {"default": w16_default}
            for block_n in (64, 128, 256):
                for target in (1, 2, 4):
                    tuning = dataclasses.replace(
                        w16_default, words_block_n=block_n, words_target_programs=target
                    )
                    words_cfgs[f"block_n={block_n} programs={target}"] = tuning
            _sweep(f"W4A16 words, {n}x{k}, {m}", words_cfgs, lambda t: [
                lambda p=p, o=o: w4a16.w4a16_linear_kernel(
                    x, p, group_size=128, route="w4a16_words", tuning=t, operands=o
                ) for p, o in zip(gptq, ops, strict=True)
            ])  # fmt: skip
            if m <= fp8_default.dwords_max_rows and m <= 4:
                _sweep(f"W4A-FP8 frag, {n}x{k}, {m}", frag_cfgs, lambda t: [
                    lambda f=f, p=p: w4a_frag.w4a_fp8_frag_gemm(
                        codes, row_scale, f, p.scales, None, torch.bfloat16, t
                    ) for f, p in zip(fp8_frags, gptq, strict=True)
                ])  # fmt: skip
                continue
            dwords_cfgs = {"default": fp8_default}
            for block_n in (64, 128, 256):
                for target in (1, 2, 4, 8):
                    wide = m >= fp8_default.dwords_wide_rows
                    fields = (
                        {"dwords_wide_block_n": block_n, "dwords_wide_target_programs": target}
                        if wide else {"dwords_block_n": block_n, "dwords_target_programs": target}
                    )  # fmt: skip
                    name = f"block_n={block_n} programs={target}"
                    dwords_cfgs[name] = dataclasses.replace(fp8_default, **fields)
            _sweep(f"W4A-FP8 dwords, {n}x{k}, {m}", dwords_cfgs, lambda t: [
                lambda w=w, p=p: w4a_fp8.fp8_linear_prepacked(
                    codes, row_scale, w, p.scales, None, torch.bfloat16, route="triton",
                    tuning=t,
                ) for w, p in zip(centered, gptq, strict=True)
            ])  # fmt: skip
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
