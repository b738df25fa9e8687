"""MLX FP8 path: the encoder and the FP8 linears against dense MLX matmuls, on MLX's device.

Run: python benchmarks/mlx_fp8.py [--shapes 4096x4096,4096x14336] [--rows 1,256] [--reps 10]

Needs ``mlx`` (``pip install 'floatxq[mlx]'``). On Linux MLX runs on the CPU and every FP8
linear takes its array-ops route; on an Apple GPU the packed layer takes its Metal kernels
(``route`` column) and large weights are encoded by the Metal encoder.

Per weight shape ``(in, out)`` (a random N(0, 1) weight, E4M3FN, row scales, bfloat16 inputs):

- Encoder: ``quantize_fp8_weight_mlx`` (route from ``fp8_encode_route``) against torch's
  ``quantize_fp8_weight`` on the CPU (the anchor), same bytes checked.
- Linears, for each row count: the anchor is a dense ``x @ W.T`` in bfloat16 with a bfloat16
  weight held in memory (an unquantized layer); then a dense FP32 matmul with a pre-decoded FP32
  weight (the packed layer's arithmetic without its decoding), ``MlxFP8PackedLinear`` (its
  route) and ``MlxFP8Linear`` (native ``mxfp8``). Times are the median over ``--reps`` of a
  call plus ``mx.eval``, after two warm-up calls; ``ratio`` is anchor time / time (above 1:
  faster than the anchor).
"""

import argparse
import platform
import statistics
import time

import mlx.core as mx
import numpy as np
import torch

import floatxq as fq
import floatxq.mlx as fqm
from floatxq.mlx.kernels import metal_available


def _median_ms(fn, reps: int) -> float:
    for _ in range(2):
        mx.eval(fn())
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        mx.eval(fn())
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def _encoder_row(w_np: np.ndarray, reps: int) -> str:
    w_mx = mx.array(w_np)
    w_t = torch.from_numpy(w_np)
    mlx_ms = _median_ms(lambda: fqm.quantize_fp8_weight_mlx(w_mx).qweight, reps)
    times = []
    for _ in range(max(3, reps // 2)):
        start = time.perf_counter()
        ref = fq.quantize_fp8_weight(w_t)
        times.append((time.perf_counter() - start) * 1e3)
    torch_ms = statistics.median(times)
    same = np.array_equal(
        np.array(fqm.quantize_fp8_weight_mlx(w_mx).qweight), ref.qweight.view(torch.uint8).numpy()
    )
    shape = f"{w_np.shape[1]}×{w_np.shape[0]}"
    route = fqm.fp8_encode_route(w_mx)
    return (
        f"| {shape} | encode ({route}) | — | {torch_ms:.2f} | {mlx_ms:.2f} | "
        f"{torch_ms / mlx_ms:.2f} | bytes equal: {same} |"
    )


def _linear_rows(w_np: np.ndarray, rows_list: list[int], reps: int, rng) -> None:
    out, inp = w_np.shape
    q = fqm.quantize_fp8_weight_mlx(mx.array(w_np))
    packed = fqm.MlxFP8PackedLinear(q.qweight, q.scale_inv)
    native = fqm.MlxFP8Linear.from_packed(packed)
    w_bf16 = mx.array(w_np).astype(mx.bfloat16)
    w_f32 = packed.dequantize()
    mx.eval(w_bf16, w_f32, packed.parameters(), native.parameters())
    for rows in rows_list:
        x = mx.array(rng.standard_normal((rows, inp)).astype(np.float32)).astype(mx.bfloat16)
        anchor = _median_ms(lambda x=x: x @ w_bf16.T, reps)
        paths = {
            "dense fp32 (decoded)": (lambda x=x: x.astype(mx.float32) @ w_f32.T, "—"),
            "MlxFP8PackedLinear": (lambda x=x: packed(x), packed.route(rows)),
            "MlxFP8Linear (mxfp8)": (lambda x=x: native(x), "native"),
        }
        print(
            f"| {inp}×{out} | dense bf16 (anchor) | {rows} | {anchor:.2f} | {anchor:.2f} | 1.00 "
            "| — |"
        )
        for name, (fn, route) in paths.items():
            ms = _median_ms(fn, reps)
            print(
                f"| {inp}×{out} | {name} | {rows} | {anchor:.2f} | {ms:.2f} | "
                f"{anchor / ms:.2f} | {route} |",
                flush=True,
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shapes", default="4096x4096,4096x14336", help="in x out, comma list")
    parser.add_argument("--rows", default="1,256", help="rows of x, comma list")
    parser.add_argument("--reps", type=int, default=10)
    args = parser.parse_args()
    print(
        f"# {platform.platform()}, MLX {mx.__version__}, device {mx.default_device()}, "
        f"Metal {metal_available()}"
    )
    print("| in×out | path | rows | anchor ms | ms | ratio | route / check |")
    print("|---|---|---|---|---|---|---|")
    rng = np.random.default_rng(0)
    for spec in args.shapes.split(","):
        inp, out = (int(v) for v in spec.split("x"))
        w_np = rng.standard_normal((out, inp)).astype(np.float32)
        print(_encoder_row(w_np, args.reps), flush=True)
        _linear_rows(w_np, [int(r) for r in args.rows.split(",")], args.reps, rng)


if __name__ == "__main__":
    main()
