"""Bounds for the MLX FP8 layers: :func:`assert_mlx_linear_close` (needs ``mlx``)."""

from typing import Any

import mlx.core as mx
import numpy as np
import torch

from floatxq.testing.assertions import assert_within_bound, decoded_linear_error_bound

__all__ = ["assert_mlx_linear_close", "to_torch"]

_TORCH_DTYPES = {mx.float32: torch.float32, mx.float16: torch.float16, mx.bfloat16: torch.bfloat16}


def to_torch(a: mx.array) -> torch.Tensor:
    """An MLX float16/bfloat16/float32 array as a torch tensor of the same dtype and values."""
    values = torch.from_numpy(np.array(a.astype(mx.float32)))  # exact for the three dtypes
    return values.to(_TORCH_DTYPES[a.dtype])


def assert_mlx_linear_close(got: mx.array, x: mx.array, layer: Any, *, msg: str = "") -> None:
    """Assert an MLX FP8 layer's output is ``x @ layer.dequantize().T + bias`` up to FP32 sums.

    ``got`` and ``x`` are ``(..., out)`` and ``(..., in)`` MLX arrays of one dtype; ``layer`` an
    :class:`floatxq.mlx.MlxFP8PackedLinear` (its decoded weight and bias define the exact value).
    The bound is :func:`~floatxq.testing.decoded_linear_error_bound`'s worst case: any FP32
    evaluation order, then one rounding to ``x``'s dtype.

    Raises:
      AssertionError: another dtype or shape, or elements outside the bound (worst ones named).
    """
    prefix = f"{msg}: " if msg else ""
    out = layer.out_features
    if got.dtype != x.dtype or tuple(got.shape) != (*x.shape[:-1], out):
        raise AssertionError(
            f"{prefix}{got.dtype} {tuple(got.shape)} != expected {x.dtype} {(*x.shape[:-1], out)}"
        )
    bias = to_torch(layer.bias) if "bias" in layer else None
    bound = decoded_linear_error_bound(
        to_torch(x).reshape(-1, layer.in_features),
        to_torch(layer.dequantize()),
        bias,
        out_dtype=_TORCH_DTYPES[x.dtype],
    )
    actual = to_torch(got).reshape(-1, out)
    assert_within_bound(actual, bound, which="worst_case", msg=msg)
