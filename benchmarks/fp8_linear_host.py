"""Host time (CPU microseconds to enqueue one call) of ``TorchFP8Linear`` and of its pieces.

Usage (GPU): ``python3 benchmarks/fp8_linear_host.py [--profile]``.

Decode-sized forwards (M = 1, 16) run for ~20-40 us on an H200, so the time Python takes to issue
them decides their speed when no CUDA graph is used. This script keeps the GPU busy
(``torch.cuda._sleep``) while it times ``calls`` back-to-back enqueues of each piece, so the figure
is pure host time: the module call per route, the input quantization launch, the raw
``scaled_mm`` call, an empty ``nn.Module`` call and ``torch.empty`` as floors. ``--profile``
adds a cProfile of the tensorwise forward at M = 1.
"""

import argparse
import cProfile
import pathlib
import pstats
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from floatxq.kernels import quantize_fp8_input
from floatxq.nn import TorchFP8Linear

N = K = 8192


def host_us(fn, calls: int = 300) -> float:
    """Median over 5 rounds of the host time per call, with the GPU kept busy meanwhile."""
    fn()
    torch.cuda.synchronize()
    rounds = []
    for _ in range(5):
        torch.cuda._sleep(200_000_000)  # ~100 ms of GPU spin: the queue never drains
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        rounds.append((time.perf_counter() - start) / calls * 1e6)
        torch.cuda.synchronize()
    return sorted(rounds)[2]


def _cases(m: int, dense: torch.nn.Linear, layers: dict) -> dict:
    dev, bf16 = "cuda", torch.bfloat16
    one = torch.ones((), device=dev)
    x = torch.randn(m, K, device=dev, dtype=bf16)
    xq = x.to(torch.float8_e4m3fn)
    w_t = layers["tensorwise"].weight.t()
    rows = {}
    for name, layer in layers.items():
        layer(x)
        rows[f"module {name} ({layer.last_route})"] = lambda layer=layer: layer(x)
        if layer.last_route == "fp8_small_m":  # and the scaled_mm route it replaces
            cublas = TorchFP8Linear.from_quantized(
                layer.weight, layer.weight_scale_inv, bias=layer.bias,
                weight_scale_method=layer.weight_scale_method,
                weight_block_size=layer.weight_block_size,
            )  # fmt: skip
            cublas._runtime.disabled[("fp8_small_m", torch.bfloat16)] = "off"
            cublas(x)
            rows[f"module {name} ({cublas.last_route})"] = lambda layer=cublas: layer(x)
    rows["quantize_fp8_input tensor"] = lambda: quantize_fp8_input(
        x, format="float8_e4m3fn", method="tensor", block=None,
        scale_out=torch.empty((), device=dev),
    )  # fmt: skip
    rows["quantize_fp8_input row"] = lambda: quantize_fp8_input(
        x, format="float8_e4m3fn", method="row", block=None,
        scale_out=torch.empty((m, 1), device=dev),
    )  # fmt: skip
    rows["raw _scaled_mm tensorwise +bias"] = lambda: torch._scaled_mm(
        xq, w_t, one, one, bias=dense.bias, out_dtype=bf16
    )
    rows["raw _scaled_mm tensorwise"] = lambda: torch._scaled_mm(xq, w_t, one, one, out_dtype=bf16)
    rows["F.linear bf16"] = lambda: F.linear(x, dense.weight, dense.bias)
    ident = torch.nn.Identity()
    rows["nn.Identity()(x)"] = lambda: ident(x)
    rows["torch.empty(())"] = lambda: torch.empty((), device=dev)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/fp8_linear_host.py needs a CUDA device")
    torch.manual_seed(0)
    dev, bf16 = "cuda", torch.bfloat16
    dense = torch.nn.Linear(K, N, bias=True, device=dev, dtype=bf16)
    layers = {
        "tensorwise": TorchFP8Linear.from_linear(dense, weight_scale_method="tensor"),
        "rowwise": TorchFP8Linear.from_linear(dense, weight_scale_method="row"),
        "blockwise": TorchFP8Linear.from_linear(
            dense, weight_scale_method="block", weight_block_size=(128, 128)
        ),
    }
    print("== host us per call (GPU kept busy), N = K = 8192, bf16")
    for m in (1, 16):
        for name, fn in _cases(m, dense, layers).items():
            print(f"M={m:<3} {name:<48} {host_us(fn):8.1f}")
    if args.profile:
        x = torch.randn(1, K, device=dev, dtype=bf16)
        layer = layers["tensorwise"]
        profiler = cProfile.Profile()
        torch.cuda._sleep(400_000_000)
        profiler.enable()
        for _ in range(300):
            layer(x)
        profiler.disable()
        torch.cuda.synchronize()
        pstats.Stats(profiler).sort_stats("tottime").print_stats(30)


if __name__ == "__main__":
    main()
