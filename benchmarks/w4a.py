# ruff: noqa: B023, B905  (each lambda is timed within its own loop iteration)
"""INT4-weight linears on an H200: W4A-FP8 and W4A16 against bf16, FP8 and tinygemm.

Usage (GPU): ``python3 benchmarks/w4a.py [pack] [linear] [sweep] [decode] [--rows 1,8,...]
[--shapes 8192x8192,...] [--batches 1,16] [--layers 32] [--only bf16,w4a16]`` (no section: pack
and linear; ``--rows`` / ``--shapes`` / ``--batches`` limit the linear table's M and (N, K) and
the decode batches; ``--layers`` shortens the decode model for a quick check; ``--only`` keeps
the decode rows whose names start with one of the given prefixes).

Every figure is the median GPU time per call over CUDA-graph replays (``graph_us``). A graph
cycles through several copies of each weight, together at least three times the L2 cache, so
no call finds its weight in L2 (an INT4 8192×8192 weight is 33 MB, L2 is 50 MB): the weights
stream from HBM as they do in a model.

- ``pack``: :func:`floatxq.kernels.fp8_pack` on 8192×8192 bf16 against a plain copy of the same
  tensor (bytes read + written per second).
- ``linear``: for M ∈ {1, 2, 4, 8, 16, 32, 128, 4096} and (N, K) ∈ {(8192, 8192), (28672,
  8192), (8192, 28672)}, bf16 activations: bf16 ``F.linear``; FP8 ``torch._scaled_mm`` rowwise
  on already quantized operands (the raw cuBLAS call, no input quantization); torch's tinygemm
  INT4 kernel (``torch._weight_int4pack_mm``, the layout torchao's INT4 weight-only layer
  uses); GemLite 0.6's A16Wn 4-bit g128 layer (Triton; where importable, M ≤ 128); floatxq's
  W4A-FP8 ``fp8_linear`` (token packing included) and its GEMM alone on packed tokens;
  floatxq's W4A16 kernel; both on the weight form and route the modules take (the decode words
  up to 32 rows).
- ``sweep``: launch shapes of the words-form W4A-FP8 GEMM and the fused W4A16 kernel at M = 1
  and 16, and of the E4M3 GEMM at M = 4096.
- ``decode``: one-token forwards of a random Llama-3-8B-shaped model (32 layers, hidden 4096,
  MLP 14336, GQA 32/8 heads; lm_head kept bf16 in every variant), batch 1 and 16, under CUDA
  graphs: bf16, FP8 (``TorchFP8Linear``, row scales), W4A16 (``GPTQLinear``), W4A-FP8
  (``W4AFP8Linear``, each module quantizing its own input), then the W4A modules under the Llama
  activation stream (``install_w4a_llama_stream``: each producer quantized once, the carrier
  passed to its consumers): W4A-FP8, W4A-NVFP4 (``least_squares``, dynamic global scales; the
  emulation route on Hopper, the route named in the row) and the split (FP8 attention, NVFP4
  MLP); tokens per second. A row whose capture fails is timed eagerly and marked ``(eager)``.
  No KV cache: the step's attention covers one token, so this measures the weight-streaming
  part of a decode step.

``--smoke`` (no GPU needed): builds every decode variant on a two-layer Llama of the tiny model's
widths on the CPU and runs one eager forward each (reference routes), checking that the logits
are finite and naming each row's NVFP4 route; no timing. ``--help`` prints this text.
"""

import copy
import pathlib
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import floatxq as fq
from floatxq.gptq.int4 import pack_gptq
from floatxq.gptq.planes import centered_int4, int4_to_e4m3
from floatxq.kernels import w4a16 as w4a16_kernels
from floatxq.kernels import w4a_fp8 as w4a_fp8_kernels

SHAPES = ((8192, 8192), (28672, 8192), (8192, 28672))
ROWS = (1, 2, 4, 8, 16, 32, 128, 4096)
BATCHES = (1, 16)


def _option(name: str, default: tuple[int, ...]) -> tuple[int, ...]:
    """``--name 1,2,3`` from the command line, else ``default``."""
    if name in sys.argv:
        return tuple(int(v) for v in sys.argv[sys.argv.index(name) + 1].split(","))
    return default


L2_BYTES = 50 * 2**20


def graph_us(fns, calls: int = 30, replays: int = 7) -> float:
    """Median GPU microseconds per call over CUDA-graph replays of ``calls`` calls cycling
    through ``fns`` (one per weight copy)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for fn in fns:
            fn()
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        for i in range(calls):
            fns[i % len(fns)]()
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


def eager_us(fn, calls: int = 20) -> float:
    """Median microseconds per call of ``fn`` run eagerly (events around each call)."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(calls):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return sorted(times)[len(times) // 2]


def copies_for(nbytes: int) -> int:
    return max(1, -(-3 * L2_BYTES // max(nbytes, 1)))


def pack_bench() -> None:
    x = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    xs = [x.clone() for _ in range(2)]
    out = torch.empty_like(x)
    copy_us = graph_us([lambda t=t: out.copy_(t) for t in xs])
    pack_us = graph_us([lambda t=t: fq.fp8_pack(t) for t in xs])
    moved_copy = 2 * x.numel() * 2
    moved_pack = x.numel() * 2 + x.numel() + 8192 * 4
    print(f"copy 8192x8192 bf16: {copy_us:.1f} us, {moved_copy / copy_us / 1e6:.2f} TB/s")
    print(
        f"fp8_pack: {pack_us:.1f} us, {moved_pack / pack_us / 1e6:.2f} TB/s, "
        f"{moved_pack / pack_us / (moved_copy / copy_us):.3f}x copy bandwidth"
    )


def _gptq(n: int, k: int, seed: int):
    g = torch.Generator(device="cuda").manual_seed(seed)
    codes = torch.randint(0, 16, (k, n), device="cuda", generator=g)
    zeros = torch.full((k // 128, n), 8, device="cuda")
    scales = torch.rand(k // 128, n, device="cuda", generator=g) * 0.01 + 0.001
    g_idx = torch.arange(k, dtype=torch.int32, device="cuda") // 128
    return pack_gptq(codes, zeros, scales, g_idx, format="gptq")


def _tinygemm(n: int, k: int):
    """torch's tinygemm INT4 layout for an (n, k) weight, or None where this torch lacks it."""
    try:
        w = torch.randint(0, 16, (n, k), dtype=torch.int32, device="cuda")
        w_uint8 = (w[:, ::2] << 4 | w[:, 1::2]).to(torch.uint8)
        packed = torch._convert_weight_to_int4pack(w_uint8, 8)
        sz = torch.rand(k // 128, n, 2, device="cuda", dtype=torch.bfloat16)
        x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        torch._weight_int4pack_mm(x, packed, 128, sz)
        return packed, sz
    except Exception as exc:  # an API change: reported, not timed
        print(f"  tinygemm unavailable: {type(exc).__name__}: {str(exc)[:100]}")
        return None


def _gemlite(packed):
    """GemLite 0.6's A16Wn layer (4-bit, groups of 128, bf16) of a GPTQ weight, or None where
    GemLite is not installed."""
    try:
        from gemlite.helper import A16Wn
    except ImportError:
        return None
    u = fq.unpack_gptq(packed)
    return A16Wn(device=str(packed.qweight.device), dtype=torch.bfloat16).from_weights(
        u.codes.T.contiguous(), u.scales.T.contiguous().to(torch.bfloat16),
        u.zeros.T.contiguous().to(torch.bfloat16), W_nbits=4, group_size=128,
    )  # fmt: skip


def linear_bench() -> None:
    from floatxq.gptq.decode_words import gptq_decode_operands, stage_decode_words
    from floatxq.gptq.fragment_words import stage_fragment_words
    from floatxq.kernels.w4a_frag import fragment_unavailable_reason, w4a16_frag_linear

    print("| N | K | M | bf16 us | fp8 scaled_mm us | tinygemm us | gemlite us | w4a-fp8 us | "
          "w4a-fp8 gemm us | w4a16 us | w4a-fp8 / fp8 | w4a-fp8 / bf16 | w4a16 / bf16 | "
          "w4a16 / gemlite |")  # fmt: skip
    print("|---" * 15 + "|")
    shapes = SHAPES
    if "--shapes" in sys.argv:  # e.g. --shapes 8192x8192,28672x8192 (N x K)
        spec = sys.argv[sys.argv.index("--shapes") + 1].split(",")
        shapes = tuple(tuple(int(v) for v in item.split("x")) for item in spec)
    for n, k in shapes:
        dense = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
                 for _ in range(copies_for(n * k * 2))]  # fmt: skip
        fp8 = [(torch.randn(n, k, device="cuda").to(torch.float8_e4m3fn),
                torch.rand(1, n, device="cuda")) for _ in range(copies_for(n * k))]  # fmt: skip
        gptq = [_gptq(n, k, i) for i in range(copies_for(n * k // 2))]
        staged = [
            int4_to_e4m3(centered_int4(p)).T.contiguous().T for p in gptq[: copies_for(n * k)]
        ]
        tiny = [_tinygemm(n, k) for _ in range(copies_for(n * k // 2))]
        gl = [_gemlite(p) for p in gptq]
        ops = [gptq_decode_operands(p, group_size=128, dtype=torch.bfloat16)[0] for p in gptq]
        dwords = [stage_decode_words(fq.unpack_gptq(p).codes) for p in gptq]
        frags = [stage_fragment_words(w) for w in dwords]
        frag_runs = fragment_unavailable_reason(torch.device("cuda")) is None
        for m in _option("--rows", ROWS):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            xq = x.to(torch.float8_e4m3fn)
            sa = torch.rand(m, 1, device="cuda")
            codes, row_scale = fq.fp8_pack(x)
            t_bf16 = graph_us([lambda w=w: F.linear(x, w) for w in dense])
            t_fp8 = graph_us([
                lambda w=w, s=s: torch._scaled_mm(xq, w.t(), sa, s, out_dtype=torch.bfloat16)
                for w, s in fp8
            ])  # fmt: skip
            t_tiny = float("nan")
            if tiny[0] is not None:
                t_tiny = graph_us([lambda p=p: torch._weight_int4pack_mm(x, p[0], 128, p[1])
                                   for p in tiny])  # fmt: skip
            t_gl = float("nan")
            if gl[0] is not None and m <= 128:
                gl[0](x)  # (GemLite tunes a row count on its first call)
                t_gl = graph_us([lambda g=g: g(x) for g in gl])
            # the operand and GEMM the modules take for m rows (floatxq.dispatch)
            operand = fq.dispatch.w4a_fp8_operand(m, decode_words=True, fragment=frag_runs)
            weights = {"fragment": frags, "decode_words": dwords,
                       "words": [p.qweight for p in gptq]}.get(operand, staged)  # fmt: skip
            gemm = fq.dispatch.w4a_fp8_gemm_route(m, weights[0])[0]
            gemm = "fragment" if operand == "fragment" else gemm
            t_w4a = graph_us([lambda w=w, p=p: fq.fp8_linear(x, w, p.scales, route=gemm)
                              for w, p in zip(weights, gptq)])  # fmt: skip
            t_gemm = graph_us([lambda w=w, p=p: fq.fp8_linear_prepacked(
                codes, row_scale, w, p.scales, None, torch.bfloat16, route=gemm)
                for w, p in zip(weights, gptq)])  # fmt: skip
            w16 = fq.dispatch.w4a16_route(m, decode_words=True, fragment=frag_runs)
            t_w16 = graph_us([
                lambda p=p, o=o: fq.w4a16_linear_kernel(
                    x, p, group_size=128, route=w16, operands=o
                ) for p, o in zip(gptq, ops)
            ])  # fmt: skip
            if w16 == "w4a16_frag":  # (the modules' call: fragment words staged once)
                t_w16 = graph_us([
                    lambda p=p, o=o, f=f: w4a16_frag_linear(
                        x, f, o, None, k, n, 128, x.device, p.scales.dtype != x.dtype
                    ) for p, o, f in zip(gptq, ops, frags)
                ])  # fmt: skip
            print(
                f"| {n} | {k} | {m} | {t_bf16:.1f} | {t_fp8:.1f} | {t_tiny:.1f} | {t_gl:.1f} | "
                f"{t_w4a:.1f} | {t_gemm:.1f} | {t_w16:.1f} | {t_fp8 / t_w4a:.2f} | "
                f"{t_bf16 / t_w4a:.2f} | {t_bf16 / t_w16:.2f} | {t_gl / t_w16:.2f} |",
                flush=True,
            )
            if m == 4096:
                flop = 2 * m * n * k
                print(
                    f"|   |   | TFLOP/s | {flop / t_bf16 / 1e6:.0f} | {flop / t_fp8 / 1e6:.0f} | "
                    f"{flop / t_tiny / 1e6:.0f} | | {flop / t_w4a / 1e6:.0f} | "
                    f"{flop / t_gemm / 1e6:.0f} | {flop / t_w16 / 1e6:.0f} | | | | |"
                )
        del dense, fp8, gptq, staged, tiny, gl, ops, dwords
        torch.cuda.empty_cache()


def sweep() -> None:
    n = k = 8192
    gptq = [_gptq(n, k, i) for i in range(copies_for(n * k // 2))]
    quick = "quick" in sys.argv
    for m in (1,) if quick else (1, 16):
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        codes, row_scale = fq.fp8_pack(x)
        for bn in (64, 128, 256) if quick else (32, 64, 128, 256):
            for warps in (4,) if quick else (4, 8):
                for stages in (3, 5) if quick else (2, 3, 4, 5):
                    for target in (4, 8) if quick else (2, 4, 8):
                        t8 = w4a_fp8_kernels.W4AFP8Tuning(
                            words_block_n=bn, words_warps=warps, words_stages=stages,
                            target_programs=target,
                        )  # fmt: skip
                        t16 = w4a16_kernels.W4A16Tuning(
                            block_n=bn, warps=warps, stages=stages, target_programs=target
                        )
                        try:
                            a = graph_us([lambda p=p: fq.fp8_linear_prepacked(
                                codes, row_scale, p.qweight, p.scales, None, torch.bfloat16,
                                tuning=t8) for p in gptq], calls=10, replays=3)  # fmt: skip
                            b = graph_us([lambda p=p: fq.w4a16_linear_kernel(
                                x, p, group_size=128, tuning=t16) for p in gptq],
                                calls=10, replays=3)  # fmt: skip
                        except Exception as exc:
                            print(f"M={m} bn={bn} w={warps} s={stages}: {type(exc).__name__}")
                            continue
                        print(f"sweep M={m} bn={bn} warps={warps} stages={stages} "
                              f"target={target}: w4a-fp8 {a:.1f} us, w4a16 {b:.1f} us",
                              flush=True)  # fmt: skip
    m = 4096
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    codes, row_scale = fq.fp8_pack(x)
    staged = [int4_to_e4m3(centered_int4(p)).T.contiguous().T for p in gptq[:2]]
    for bm, bn_, warps, stages, gm in ((128, 128, 8, 3, 8), (128, 256, 8, 3, 8),
                                       (128, 128, 4, 4, 8), (128, 256, 8, 4, 8),
                                       (256, 128, 8, 3, 8), (128, 128, 8, 5, 8)):  # fmt: skip
        t = w4a_fp8_kernels.W4AFP8Tuning(e4m3_block_m=bm, e4m3_block_n=bn_, e4m3_warps=warps,
                                         e4m3_stages=stages, e4m3_group_m=gm)  # fmt: skip
        try:
            us = graph_us([lambda w=w, p=p: fq.fp8_linear_prepacked(
                codes, row_scale, w, p.scales, None, torch.bfloat16, tuning=t)
                for w, p in zip(staged, gptq)], calls=5, replays=3)  # fmt: skip
            print(f"sweep M=4096 e4m3 {bm}x{bn_} warps={warps} stages={stages}: {us:.1f} us, "
                  f"{2 * m * n * k / us / 1e6:.0f} TFLOP/s", flush=True)  # fmt: skip
        except Exception as exc:
            print(f"sweep M=4096 {bm}x{bn_} w={warps} s={stages}: {type(exc).__name__} {exc!s:.80}")


def _swap(model, make) -> None:
    for name, module in list(model.named_modules()):
        for child_name, child in list(module.named_children()):
            if isinstance(child, torch.nn.Linear) and "lm_head" not in f"{name}.{child_name}":
                setattr(module, child_name, make(child))


def _w4a16(linear):
    from floatxq.gptq.solve import GPTQSolveOptions, rtn_quantize

    sol = rtn_quantize(linear.weight.float(), GPTQSolveOptions(bits=4, group_size=128))
    return fq.GPTQLinear.from_solution(sol, bits=4, group_size=128, format="gptq")


def _w4a_fp8(linear):
    return fq.W4AFP8Linear.from_gptq_linear(_w4a16(linear))


def _w4a_nvfp4(linear, recipe: str = "least_squares"):
    layer = fq.W4ANVFP4Linear.from_gptq_linear(_w4a16(linear))
    layer.activation_recipe = recipe
    return layer


def _streamed(base, make, **stream):
    """A copy of ``base`` with every decoder Linear made by ``make`` and the activation stream
    installed with the keyword arguments ``stream``."""
    from floatxq.lifecycle.stream import install_w4a_llama_stream

    model = _converted(base, make)
    install_w4a_llama_stream(model, **stream)
    return model


def _route(model, device: torch.device) -> str:
    """The route the model's W4A-NVFP4 modules take on ``device`` ('' for a model without)."""
    from floatxq.dispatch import w4a_nvfp4_route

    layer = next((m for m in model.modules() if isinstance(m, fq.W4ANVFP4Linear)), None)
    if layer is None:
        return ""
    route, why = w4a_nvfp4_route(layer.route, device)
    return f"nvfp4 route {route}" + (f" ({why})" if why else "")


def decode_variants(base) -> dict:
    """Row name → a builder of that variant of ``base`` (a LlamaForCausalLM)."""
    lsq = {"mode": "w4a_nvfp4", "recipe": "least_squares"}
    return {
        "bf16": lambda: base,
        "fp8 (TorchFP8Linear, row)": lambda: _converted(
            base, lambda lin: fq.TorchFP8Linear.from_linear(lin, weight_scale_method="row")
        ),
        "w4a16 (GPTQLinear)": lambda: _converted(base, _w4a16),
        "w4a-fp8 (W4AFP8Linear)": lambda: _converted(base, _w4a_fp8),
        "w4a-fp8 stream": lambda: _streamed(base, _w4a_fp8, mode="w4afp8"),
        "w4a-nvfp4 lsq stream": lambda: _streamed(base, _w4a_nvfp4, **lsq),
        "split: fp8 attention, nvfp4 lsq mlp (stream)": lambda: _streamed(
            base, _w4a_nvfp4, **lsq, attention_mode="w4afp8"
        ),
    }


def llama_8b_shaped(layers: int):
    """``(config, model)``: a random bf16 Llama-3-8B-shaped model of ``layers`` decoder layers
    on the GPU (seed 0)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        hidden_size=4096, intermediate_size=14336, num_hidden_layers=layers,
        num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
        max_position_embeddings=8192, torch_dtype="bfloat16",
    )  # fmt: skip
    torch.manual_seed(0)
    with torch.device("cuda"):
        return config, LlamaForCausalLM(config).to(torch.bfloat16).eval()


def decode_bench() -> None:
    (layers,) = _option("--layers", (32,))
    print(f"decode: random Llama-3-8B-shaped model, {layers} decoder layers")
    config, base = llama_8b_shaped(layers)
    print("| model | batch | ms / step | tokens/s | vs bf16 |")
    print("|---|---|---|---|---|")
    base_tps = {}
    only = sys.argv[sys.argv.index("--only") + 1].split(",") if "--only" in sys.argv else None
    for name, build in decode_variants(base).items():
        if only is not None and not any(name.startswith(o) for o in only):
            continue
        started = time.time()
        try:
            model = build()
        except Exception as exc:  # a variant that cannot be built: reported, the others run
            print(f"| {name} | | build failed: {type(exc).__name__}: {str(exc)[:120]} | | |")
            continue
        route = _route(model, torch.device("cuda"))
        for batch in _option("--batches", BATCHES):
            ids = torch.randint(0, config.vocab_size, (batch, 1), device="cuda")
            how = "graph"
            with torch.inference_mode():
                try:
                    us = graph_us([lambda: model(input_ids=ids, use_cache=False)], calls=5,
                                  replays=5)  # fmt: skip
                except Exception as exc:  # a capture the model refuses: eager timing instead
                    print(f"  (graph capture failed: {type(exc).__name__}: {str(exc)[:80]})")
                    how = "eager"
                    us = eager_us(lambda: model(input_ids=ids, use_cache=False))
            tps = batch / (us * 1e-6)
            base_tps.setdefault(batch, tps)
            print(f"| {name} | {batch} | {us / 1e3:.2f} ({how}) | {tps:.0f} | "
                  f"{tps / base_tps[batch]:.2f}x |", flush=True)  # fmt: skip
        if model is not base:
            del model
            torch.cuda.empty_cache()
        print(
            f"  ({name}: built and timed in {time.time() - started:.0f} s"
            f"{'; ' + route if route else ''})",
            flush=True,
        )


def decode_smoke() -> None:
    """Every decode variant on a small random Llama on the CPU: one eager forward each."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        hidden_size=256, intermediate_size=768, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=256, max_position_embeddings=64,
    )  # fmt: skip
    torch.manual_seed(0)
    base = LlamaForCausalLM(config).to(torch.bfloat16).eval()
    ids = torch.randint(0, config.vocab_size, (2, 1))
    with torch.inference_mode():
        reference = base(input_ids=ids, use_cache=False).logits.float()
    for name, build in decode_variants(base).items():
        model = build()
        with torch.inference_mode():
            logits = model(input_ids=ids, use_cache=False).logits.float()
        if not bool(torch.isfinite(logits).all()):
            raise RuntimeError(f"decode smoke: {name} gave non-finite logits")
        route = _route(model, torch.device("cpu"))
        print(
            f"{name}: logits {tuple(logits.shape)}, max |Δ| vs bf16 "
            f"{float((logits - reference).abs().max()):.4f}{'; ' + route if route else ''}",
            flush=True,
        )


def _converted(base, make):
    model = copy.deepcopy(base)
    with torch.no_grad():
        _swap(model, make)
    return model


def main() -> None:
    if "--help" in sys.argv or "-h" in sys.argv:
        print(__doc__)
        return
    if "--smoke" in sys.argv:
        decode_smoke()
        return
    wanted = {a for a in sys.argv[1:] if a in ("pack", "linear", "sweep", "decode")}
    wanted = wanted or {"pack", "linear"}
    props = torch.cuda.get_device_properties(0)
    print(f"# {props.name}, torch {torch.__version__}, {time.strftime('%Y-%m-%d %H:%M UTC')}")
    if "pack" in wanted:
        pack_bench()
    if "linear" in wanted:
        linear_bench()
    if "sweep" in wanted:
        sweep()
    if "decode" in wanted:
        decode_bench()


if __name__ == "__main__":
    main()
