"""Argument validators shared by every pure function: one definition of each check.

Each raises the exception kind floatxq promises for its kind of mistake (``TypeError`` for a wrong
kind of object or dtype, ``ValueError`` for a wrong value or shape) with a message that names the
calling function (``where``), the argument (``name``), what was received and what is accepted.
"""

from typing import Any

import torch
from torch import Tensor


def require_tensor(x: Any, *, name: str, where: str) -> None:
    """``TypeError`` unless ``x`` is a ``torch.Tensor``."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{where}: {name} must be a torch.Tensor, got {type(x).__name__}")


def require_floating(x: Any, *, name: str, where: str) -> None:
    """``TypeError`` unless ``x`` is a floating-point tensor."""
    require_tensor(x, name=name, where=where)
    if not x.is_floating_point():
        raise TypeError(f"{where}: {name} must be a floating-point tensor, got dtype {x.dtype}")


def require_integer(x: Any, *, name: str, where: str) -> None:
    """``TypeError`` unless ``x`` is an integer tensor (bool and complex are not integers)."""
    require_tensor(x, name=name, where=where)
    if x.is_floating_point() or x.is_complex() or x.dtype == torch.bool:
        raise TypeError(
            f"{where}: {name} must be an integer tensor (uint8/int8/int16/int32/int64), "
            f"got dtype {x.dtype}"
        )


def require_finite(x: Tensor, *, name: str, where: str) -> None:
    """``ValueError`` when ``x`` holds NaN or ±inf (one host sync; empty tensors pass)."""
    if x.numel() and not bool(torch.isfinite(x).all()):
        raise ValueError(f"{where}: {name} contains NaN or infinity; finite values are required")


def require_range(x: Tensor, low: int, high: int, *, name: str, where: str) -> None:
    """``ValueError`` when an element of the integer tensor ``x`` lies outside ``[low, high]``."""
    wide = x.to(torch.int64)  # compare in int64: uint8 would wrap a negative bound
    outside = (wide < low) | (wide > high)
    if x.numel() and bool(outside.any()):
        bad = wide[outside]
        raise ValueError(
            f"{where}: {name} must lie in [{low}, {high}]; got values such as {bad[:4].tolist()}"
        )


def require_shape(x: Tensor, shape: tuple[int, ...], *, name: str, where: str) -> None:
    """``ValueError`` unless ``x.shape == shape``."""
    if tuple(x.shape) != shape:
        raise ValueError(f"{where}: {name} must have shape {shape}, got {tuple(x.shape)}")
