"""GPTQ at 8B scale: the lifecycle on a random Llama-3-8B-shaped model, layer by layer on one GPU.

Run (one H200): python benchmarks/gptq_scale.py --out /tmp/gptq-8b.json
NVFP4 (``--method``): ``nvfp4`` (round to nearest, weight-only: no calibration, each weight
quantized on the GPU and put back on the CPU), ``nvfp4-gptq`` (GPTQ onto the NVFP4 grid,
calibrated as INT4 GPTQ is; the lifecycle solves through ``floatxq.dispatch.nvfp4_gptq_solve_auto``,
the Triton block kernel on CUDA), ``nvfp4-w4a4`` (round to nearest plus calibrated input scales);
``--recipe`` picks the NVFP4 recipe (default ``least_squares``, ``NVFP4Config``'s).
FP8 (``--method``): ``fp8`` (round to nearest, row scales, no data) and ``fp8-gsq`` (calibrated
GSQ: ``FP8Config(gsq=GSQConfig(), gsq_calibration=True)``, each module's codes refined against
its layer's Hessian); ``--fp8-format`` picks the format (default ``e4m3``).
CPU smoke run: python benchmarks/gptq_scale.py --device cpu --layers 2 --hidden 256 \
    --intermediate 512 --heads 4 --kv-heads 2 --vocab 1024 --samples 4 --seq-len 64
Build only (time the CPU model build): add ``--build-only``.

The model has Llama-3-8B's shapes (hidden 4096, MLP 14336, 32 heads / 8 KV heads, vocab 128256,
32 layers, untied lm_head; 8.03B parameters) in bfloat16 with random weights: GPTQ's cost does
not depend on what the weights have learned. It is built fast on the CPU: constructed on the meta
device, given uninitialised CPU storage (``to_empty``), then every weight is filled with
N(0, 0.02²) (``normal_`` on bf16 chunks of 16M elements spread over threads, each chunk with its
own seeded ``torch.Generator``: chunk ``c`` of parameter ``p`` always gets seed ``(seed, p, c)``,
so the weights do not depend on the thread count) and every norm weight with 1; the rotary
buffers are rebuilt.
Calibration is ``--samples`` sequences of ``--seq-len`` uniform random token ids.

``floatxq.load(model, quantize_config=GPTQConfig(...), device=...).quantize(samples,
batch_size=...)`` then keeps the model on the CPU and solves one decoder layer at a time on the
device. Reported (printed and in ``--out`` JSON): the wall time of ``quantize`` (total, and per
decoder layer from the time each layer's last module was solved), the module solve time from
``qm.report``, ``torch.cuda.max_memory_allocated`` over the run, and the model's bytes before
and after (and one decoder layer's).
"""

import argparse
import concurrent.futures
import datetime
import json
import os
import pathlib
import sys
import time
from typing import Any

import torch
import transformers

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import floatxq
from floatxq import GPTQConfig

CHUNK = 1 << 24
"""Elements per generated chunk (16M: 32 MiB of bf16 per task)."""


def _fill_chunk(flat: torch.Tensor, start: int, seed: int, std: float) -> None:
    stop = min(start + CHUNK, flat.numel())
    g = torch.Generator(device="cpu").manual_seed(seed)
    flat[start:stop].normal_(0.0, std, generator=g)  # bf16 in place: 1.6x a FP32 draw + cast


def build_model(
    config: transformers.LlamaConfig, *, seed: int = 0, std: float = 0.02, threads: int = 0
) -> transformers.LlamaForCausalLM:
    """A random bf16 ``LlamaForCausalLM`` on the CPU: meta build, ``to_empty``, threaded fill.

    Numerics: weights N(0, std²) by bf16 ``normal_`` (torch's CPU sampler); norm weights exactly 1;
    chunk ``c`` of the ``p``-th parameter uses seed ``seed * 1_000_003 + p * 100_003 + c``.
    """
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config)
    model = model.to(torch.bfloat16).to_empty(device="cpu")
    # to_empty leaves buffers uninitialised too: rebuild the rotary embedding (its inv_freq).
    model.model.rotary_emb = type(model.model.rotary_emb)(config)
    stray = [n for n, _ in model.named_buffers() if not n.startswith("model.rotary_emb.")]
    if stray:  # a buffer this build does not know how to initialise
        raise RuntimeError(f"build_model: uninitialised buffers after to_empty: {stray}")
    jobs: list[tuple[torch.Tensor, int, int]] = []
    with torch.no_grad():
        for p_index, (name, param) in enumerate(model.named_parameters()):
            if name.endswith("norm.weight"):
                param.fill_(1.0)
                continue
            flat = param.detach().view(-1)  # no autograd: worker threads have grad mode on
            for c_index, start in enumerate(range(0, flat.numel(), CHUNK)):
                jobs.append((flat, start, seed * 1_000_003 + p_index * 100_003 + c_index))
        workers = threads or torch.get_num_threads()
        intra = torch.get_num_threads()
        torch.set_num_threads(1)  # one thread per chunk; the pool gives the parallelism
        try:
            with concurrent.futures.ThreadPoolExecutor(max_workers=workers) as pool:
                for f in [pool.submit(_fill_chunk, flat, s, sd, std) for flat, s, sd in jobs]:
                    f.result()
        finally:
            torch.set_num_threads(intra)
    return model.eval()


def llama_config(
    *, layers: int = 32, hidden: int = 4096, intermediate: int = 14336, heads: int = 32,
    kv_heads: int = 8, vocab: int = 128256,
) -> transformers.LlamaConfig:  # fmt: skip
    """Llama-3-8B's configuration (the defaults), or a smaller one of the same form: untied
    ``lm_head``, rope theta 500000, 8192 positions, RMS norm eps 1e-5."""
    return transformers.LlamaConfig(
        hidden_size=hidden, intermediate_size=intermediate, num_attention_heads=heads,
        num_key_value_heads=kv_heads, num_hidden_layers=layers, vocab_size=vocab,
        max_position_embeddings=8192,
        rope_parameters={"rope_type": "default", "rope_theta": 500000.0},
        tie_word_embeddings=False, rms_norm_eps=1e-5,
    )  # fmt: skip


def _stamp(stamps: dict[str, float], module_name: str, start: float) -> None:
    """Record when ``module_name`` was quantized; print a line as each decoder layer ends."""
    stamps[module_name] = now = time.perf_counter()
    if module_name.endswith("down_proj"):
        print(f"  {module_name}: {now - start:.1f} s", flush=True)


def module_bytes(module: torch.nn.Module) -> int:
    """Bytes of a module's parameters and persistent buffers (what a checkpoint holds)."""
    params = sum(p.numel() * p.element_size() for p in module.parameters())
    state_keys = set(module.state_dict().keys())
    buffers = sum(
        b.numel() * b.element_size() for n, b in module.named_buffers() if n in state_keys
    )
    return params + buffers


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--intermediate", type=int, default=14336)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=128256)
    parser.add_argument("--samples", type=int, default=128, help="calibration sequences")
    parser.add_argument("--seq-len", type=int, default=2048, help="tokens per sequence")
    parser.add_argument("--batch-size", type=int, default=8, help="calibration batch")
    parser.add_argument("--group-size", type=int, default=128)
    parser.add_argument(
        "--order", default="act_group_aware", choices=["act_group_aware", "desc_act", "plain"]
    )
    parser.add_argument(
        "--method",
        default="gptq",
        choices=["gptq", "nvfp4", "nvfp4-gptq", "nvfp4-w4a4", "fp8-gsq", "fp8"],
    )
    parser.add_argument("--fp8-format", default="e4m3", help="fp8 / fp8-gsq: the FP8 format")
    parser.add_argument(
        "--recipe", default="least_squares", help="the NVFP4 recipe (NVFP4Config's default)"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=0, help="build threads (0: torch's)")
    parser.add_argument("--build-only", action="store_true", help="time the CPU build, stop")
    parser.add_argument("--out", default=None, help="write the JSON record here")
    args = parser.parse_args()
    device = torch.device(args.device)
    config = llama_config(
        layers=args.layers, hidden=args.hidden, intermediate=args.intermediate, heads=args.heads,
        kv_heads=args.kv_heads, vocab=args.vocab,
    )  # fmt: skip
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(
        f"# GPTQ scale  {datetime.date.today()}  {name}  {os.cpu_count()} CPUs  "
        f"torch {torch.__version__}  transformers {transformers.__version__}",
        flush=True,
    )

    start = time.perf_counter()
    model = build_model(config, seed=args.seed, threads=args.threads)
    build_s = time.perf_counter() - start
    params = sum(p.numel() for p in model.parameters())
    model_bytes = module_bytes(model)
    layer_bytes = module_bytes(model.model.layers[0])
    print(
        f"built {params / 1e9:.3f}B params ({model_bytes / 2**30:.2f} GiB bf16; one decoder layer "
        f"{layer_bytes / 2**20:.1f} MiB) on CPU in {build_s:.2f} s",
        flush=True,
    )
    record: dict[str, Any] = {
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "device": name,
        "cpu_count": os.cpu_count(),
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__},
        "config": {
            "hidden": args.hidden,
            "intermediate": args.intermediate,
            "layers": args.layers,
            "heads": args.heads,
            "kv_heads": args.kv_heads,
            "vocab": args.vocab,
        },
        "params": params,
        "model_bytes": model_bytes,
        "layer_bytes": layer_bytes,
        "build_seconds": build_s,
    }
    if not args.build_only:
        g = torch.Generator(device="cpu").manual_seed(args.seed + 1)
        ids = torch.randint(0, args.vocab, (args.samples, args.seq_len), generator=g)
        samples = list(ids.unbind(0))
        desc = args.order == "desc_act"
        qconfig: Any = GPTQConfig(
            bits=4, group_size=args.group_size, desc_act=desc,
            act_group_aware=args.order == "act_group_aware",
        )  # fmt: skip
        if args.method.startswith("nvfp4"):
            qconfig = floatxq.NVFP4Config(
                recipe=args.recipe,
                method="gptq" if args.method == "nvfp4-gptq" else "rtn",
                activations="nvfp4" if args.method == "nvfp4-w4a4" else None,
            )
            if args.method == "nvfp4":
                samples = None  # weight-only round to nearest reads no data
        if args.method in ("fp8", "fp8-gsq"):
            gsq = args.method == "fp8-gsq"
            qconfig = floatxq.FP8Config(
                format=args.fp8_format, weight_scale_method="row",
                gsq=floatxq.GSQConfig() if gsq else None, gsq_calibration=gsq,
            )  # fmt: skip
            samples = samples if gsq else None
        stamps: dict[str, float] = {}
        # No device for load: the model stays on CPU and GPTQ works on the default device (the
        # first GPU), so the peak below is the working set, not the finished model moved there.
        on = None if device.type == "cuda" and device.index in (None, 0) else device
        qm = floatxq.load(model, quantize_config=qconfig, device=on)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
        start = time.perf_counter()
        qm.quantize(
            samples,
            batch_size=args.batch_size,
            progress=lambda module_name: _stamp(stamps, module_name, start),
        )
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        wall = time.perf_counter() - start
        peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
        # A layer's wall time: from the previous layer's last solve to its own last solve (so it
        # holds the previous layer's output pass and this layer's Hessian folds and solves).
        last_of_layer: dict[int, float] = {}
        for module_name, stamp in stamps.items():
            parts = module_name.split(".")
            if "layers" in parts:
                index = int(parts[parts.index("layers") + 1])
                last_of_layer[index] = max(stamp, last_of_layer.get(index, stamp))
        per_layer, previous = [], start
        for index in sorted(last_of_layer):
            per_layer.append(last_of_layer[index] - previous)
            previous = last_of_layer[index]
        modules = getattr(qm.report, "modules", ()) or ()
        solve_by_layer: dict[int, float] = {}
        for m in modules:
            if m.layer is not None:
                solve_by_layer[m.layer] = solve_by_layer.get(m.layer, 0.0) + float(m.seconds)
        quantized_bytes = module_bytes(qm.model)
        q_layer_bytes = module_bytes(qm.model.model.layers[0])
        record.update(
            {
                "quantize": {
                    "method": args.method,
                    "recipe": args.recipe if args.method.startswith("nvfp4") else None,
                    "fp8_format": args.fp8_format if args.method.startswith("fp8") else None,
                    "group_size": args.group_size,
                    "order": args.order,
                    "samples": args.samples,
                    "seq_len": args.seq_len,
                    "batch_size": args.batch_size,
                },
                "quantize_seconds": wall,
                "quantize_seconds_reported": qm.quantize_seconds,
                "seconds_per_layer": per_layer,
                "solve_seconds_per_layer": [solve_by_layer[i] for i in sorted(solve_by_layer)],
                "solve_seconds": sum(float(m.seconds) for m in modules),
                "modules": len(modules),
                "max_memory_allocated": peak,
                "quantized_model_bytes": quantized_bytes,
                "quantized_layer_bytes": q_layer_bytes,
            }
        )
        median = sorted(per_layer)[len(per_layer) // 2] if per_layer else float("nan")
        print(
            f"{args.method} quantize: {wall:.2f} s for {len(qm.quantized_modules)} modules in "
            f"{args.layers} layers "
            f"({args.samples} × {args.seq_len} tokens, batch {args.batch_size}); per layer "
            f"median {median:.2f} s, first {per_layer[0] if per_layer else float('nan'):.2f} s; "
            f"module solves {record['solve_seconds']:.2f} s"
        )
        if peak is not None:
            print(f"max_memory_allocated: {peak / 2**30:.2f} GiB")
        print(
            f"bytes: model {model_bytes / 2**30:.2f} → {quantized_bytes / 2**30:.2f} GiB; "
            f"decoder layer {layer_bytes / 2**20:.1f} → {q_layer_bytes / 2**20:.1f} MiB"
        )
    if args.out:
        pathlib.Path(args.out).write_text(json.dumps(record, indent=2) + "\n")
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
