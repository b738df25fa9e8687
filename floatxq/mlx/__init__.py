"""The MLX path: FP8 encoding, FP8 linears and whole-model conversion for MLX.

``import floatxq.mlx`` works without MLX installed; the names below import ``mlx.core`` when
first used (an ``ImportError`` naming the ``mlx`` extra where it is missing).

The Metal kernels (Apple GPUs) and their launch plans are in :mod:`floatxq.mlx.kernels`, and
:mod:`floatxq.mlx.metal_emulator` runs the same kernel sources on a CPU through a C++ build.

Public names:
  * :func:`quantize_fp8_weight_mlx`: an MLX weight to FP8 byte codes and FP32 inverse scales.
  * :class:`MlxFP8Weight`: its result record ``(qweight, scale_inv)``.
  * :class:`MlxFP8PackedLinear`: a linear layer over FP8 bytes, decoded per call by a table.
  * :class:`MlxFP8Linear`: E4M3FN weights on MLX's native ``mxfp8`` matmul, when exact.
  * :func:`fp8_decode_table`: the 256 FP32 values of an FP8 format's byte codes.
  * :func:`fp8_encode_route`: which encoder (Metal kernel or array ops) a weight takes.
  * :func:`convert_to_mlx`: a transformers Llama, Mistral, Qwen2 or Qwen3 model with FP8
    linears to the mlx_lm model of its type.
  * :class:`MlxConversion`: its result record ``(model, routes, reasons)``.
"""

import importlib
from typing import Any

__all__ = [
    "MlxConversion",
    "MlxFP8Linear",
    "MlxFP8PackedLinear",
    "MlxFP8Weight",
    "convert_to_mlx",
    "fp8_decode_table",
    "fp8_encode_route",
    "quantize_fp8_weight_mlx",
]

_LAZY = {
    "MlxConversion": "floatxq.mlx.convert",
    "MlxFP8Linear": "floatxq.mlx.linear",
    "MlxFP8PackedLinear": "floatxq.mlx.linear",
    "MlxFP8Weight": "floatxq.mlx.fp8",
    "convert_to_mlx": "floatxq.mlx.convert",
    "fp8_decode_table": "floatxq.mlx.linear",
    "fp8_encode_route": "floatxq.mlx.fp8",
    "quantize_fp8_weight_mlx": "floatxq.mlx.fp8",
}


def __getattr__(name: str) -> Any:
    """Import a public name's module on first access (that module needs ``mlx.core``)."""
    if name not in _LAZY:
        raise AttributeError(f"module 'floatxq.mlx' has no attribute {name!r}")
    try:
        module = importlib.import_module(_LAZY[name])
    except ImportError as exc:
        raise ImportError(
            f"floatxq.mlx.{name} needs MLX (`pip install 'floatxq[mlx]'`, or `mlx[cpu]` on "
            f"Linux): {exc}"
        ) from exc
    return getattr(module, name)


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
