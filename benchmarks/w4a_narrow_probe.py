# ruff: noqa: B023  (each lambda is timed within its own loop iteration)
"""The narrow-layer probe of the INT4 fragment kernels (issue 31): where time goes at 1–8 rows.

Usage (GPU): ``python3 benchmarks/w4a_narrow_probe.py [--shapes 1024x4096,4096x4096]
[--rows 1,2,4,8,16] [--split-loads 8]``.

For each ``N x K`` shape and row count, in one run (CUDA graphs over weight copies beyond L2,
as ``benchmarks/w4a.py``): bf16 ``F.linear``, torch's tinygemm and GemLite's ``A16Wn`` (the
anchors), then the W4A16 and W4A-FP8 fragment kernels at the default launch shape and with the
split-K reduction's loads in flight (``FragTuning.reduce_chunk``) and fewer or more programs
per SM (a smaller or larger split); past the fragment kernels' rows, the decode-words kernels
(one cell: their reduction is :func:`floatxq.kernels._fp8_small_m_jit.sum_partials`, whose
loads in flight ``--split-loads N`` sets for the run). Every variant's result is checked
against the default's first. µs.
"""

import dataclasses
import pathlib
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

from w4a import _gemlite, _gptq, _option, _tinygemm, copies_for, graph_us

import floatxq as fq
from floatxq.gptq.decode_words import gptq_decode_operands, stage_decode_words
from floatxq.gptq.fragment_words import stage_fragment_words
from floatxq.gptq.planes import centered_int4
from floatxq.kernels import w4a_frag


def _checked(fns, reference):
    out = fns[0]()
    if reference is not None:
        scale = reference.float().abs().max().clamp_min(1e-6)
        if ((out.float() - reference.float()).abs().max() / scale) >= 2e-2:
            return None
    return graph_us(fns)


def main() -> None:
    (loads,) = _option("--split-loads", (0,))
    if loads:  # (before anything compiles: the constant is part of the kernels' cache key)
        import triton.language as tl

        from floatxq.kernels import _fp8_small_m_jit

        _fp8_small_m_jit.SPLIT_LOADS = tl.constexpr(loads)
    shapes = [(1024, 4096), (4096, 4096)]
    if "--shapes" in sys.argv:
        spec = sys.argv[sys.argv.index("--shapes") + 1].split(",")
        shapes = [tuple(int(v) for v in item.split("x")) for item in spec]
    rows = _option("--rows", (1, 2, 4, 8, 16))
    props = torch.cuda.get_device_properties(0)
    print(f"# {props.name}, torch {torch.__version__}, {time.strftime('%Y-%m-%d %H:%M UTC')}, "
          f"split loads {loads or 'default'}")  # fmt: skip
    base = w4a_frag.DEFAULT_FRAG_TUNING
    variants = {"default": {}}
    for chunk in (1, 4, 8, 16):
        variants[f"chunk {chunk}"] = {"reduce_chunk": chunk}
    for target in (2, 4, 6):
        variants[f"programs {target}, chunk 8"] = {
            "reduce_chunk": 8, "target_programs": target, "w4a16_target_programs": target
        }  # fmt: skip
    print("| N x K | M | bf16 | tinygemm | GemLite | kernel | " + " | ".join(variants) + " |")
    print("|---" * (6 + len(variants)) + "|")
    device = torch.device("cuda")
    for n, k in shapes:
        count = copies_for(n * k // 2)
        dense = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
                 for _ in range(copies_for(n * k * 2))]  # fmt: skip
        gptq = [_gptq(n, k, i) for i in range(count)]
        tiny = [_tinygemm(n, k) for _ in range(count)]
        gemlite = [_gemlite(p) for p in gptq]
        ops = [gptq_decode_operands(p, group_size=128, dtype=torch.bfloat16)[0] for p in gptq]
        frags = [stage_fragment_words(o.words) for o in ops]
        centered = [stage_decode_words(centered_int4(p) + 8) for p in gptq]
        fp8_frags = [stage_fragment_words(w) for w in centered]
        for m in rows:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            codes, row_scale = fq.fp8_pack(x)
            has_lo = gptq[0].scales.dtype != x.dtype
            anchors = [graph_us([lambda w=w: F.linear(x, w) for w in dense])]
            anchors.append(float("nan") if tiny[0] is None else graph_us(
                [lambda p=p: torch._weight_int4pack_mm(x, p[0], 128, p[1]) for p in tiny]
            ))  # fmt: skip
            if gemlite[0] is None:
                anchors.append(float("nan"))
            else:
                gemlite[0](x)
                anchors.append(graph_us([lambda g=g: g(x) for g in gemlite]))
            head = f"| {n} x {k} | {m} | " + " | ".join(f"{t:.1f}" for t in anchors)
            kernels = {}
            if m > base.w4a16_max_rows:
                kernels["W4A16 words"] = lambda t: [
                    lambda p=p, o=o: fq.w4a16_linear_kernel(
                        x, p, group_size=128, route="w4a16_words", operands=o
                    ) for p, o in zip(gptq, ops, strict=True)
                ]  # fmt: skip
            else:
                kernels["W4A16 frag"] = lambda t: [
                    lambda f=f, o=o: w4a_frag.w4a16_frag_linear(
                        x, f, o, None, k, n, 128, device, has_lo, t
                    ) for f, o in zip(frags, ops, strict=True)
                ]  # fmt: skip
            if m > base.w4a_fp8_max_rows:
                kernels["W4A-FP8 decode words"] = lambda t: [
                    lambda w=w, p=p: fq.fp8_linear_prepacked(
                        codes, row_scale, w, p.scales, None, torch.bfloat16, route="triton"
                    ) for w, p in zip(centered, gptq, strict=True)
                ]  # fmt: skip
            else:
                kernels["W4A-FP8 frag"] = lambda t: [
                    lambda f=f, p=p: w4a_frag.w4a_fp8_frag_gemm(
                        codes, row_scale, f, p.scales, None, torch.bfloat16, t
                    ) for f, p in zip(fp8_frags, gptq, strict=True)
                ]  # fmt: skip
            for label, make in kernels.items():
                reference, cells = None, []
                for fields in variants.values() if "frag" in label else [{}]:
                    tuning = dataclasses.replace(base, **fields)
                    fns = make(tuning)
                    if reference is None:
                        reference = fns[0]()
                    t = _checked(fns, reference)
                    cells.append("wrong" if t is None else f"{t:.1f}")
                print(f"{head} | {label} | " + " | ".join(cells) + " |", flush=True)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
