"""The GPTQ Hessian as a fold: ``H = 2/N · Σ xᵀx`` over calibration rows, in FP32.

:func:`hessian_init` makes an empty :class:`HessianState`, :func:`hessian_update` folds a batch of
layer inputs in (padding rows masked out, bit for bit), :func:`hessian_finalize` reads ``H`` off
it. :data:`floatxq.stats.HESSIAN` is the same three functions as a
:class:`~floatxq.stats.Statistic`, so the lifecycle folds it beside the other statistics.
"""

from typing import Any, NamedTuple

import torch

from floatxq._checks import require_floating
from floatxq._typing import Bool, Float, Float32, Int64, Tensor, checked_record

__all__ = [
    "HessianState",
    "hessian_finalize",
    "hessian_init",
    "hessian_merge",
    "hessian_update",
]


@checked_record
class HessianState(NamedTuple):
    """A running Hessian fold: ``Σ xᵀx`` over the rows seen so far and their count."""

    xtx: Float32[Tensor, "k k"]
    """FP32 ``(k, k)``: the sum of ``xᵀx`` over every folded (unmasked) row."""
    rows: Int64[Tensor, ""]
    """int64 0-d: how many rows were folded in."""


def hessian_init(k: int, *, device: torch.device | str | None = None) -> HessianState:
    """An empty Hessian fold for inputs with ``k`` features.

    Args:
      k: the input width (``in_features`` of the layer), ≥ 1.
      device: where the FP32 ``(k, k)`` accumulator lives.

    Returns:
      ``HessianState(xtx=zeros (k, k) FP32, rows=0)``.

    Numerics: exact zeros.

    Example:
      >>> hessian_init(3).xtx.shape
      torch.Size([3, 3])
    """
    if isinstance(k, bool) or not isinstance(k, int):
        raise TypeError(f"hessian_init: k must be an int, got {type(k).__name__} {k!r}")
    if k < 1:
        raise ValueError(f"hessian_init: k must be >= 1, got {k}")
    xtx = torch.zeros((k, k), dtype=torch.float32, device=device)
    return HessianState(xtx, torch.zeros((), dtype=torch.int64, device=xtx.device))


def hessian_update(
    state: HessianState,
    x: Float[Tensor, "*batch k"],
    mask: Bool[Tensor, "*batch"] | None = None,
) -> HessianState:
    """Fold a batch of layer inputs into a Hessian: ``xtx += xᵀx``, ``rows += N``.

    Args:
      state: the fold so far (from :func:`hessian_init` or a previous update); never mutated.
      x: ``(*batch, k)`` inputs; every leading axis counts as rows (tokens).
      mask: optional ``(*batch)`` bool keep-mask; rows where it is False (padding) are removed
        before the product, so they reach neither the sum nor the count (bit for bit: appending
        masked rows never changes the result).

    Returns:
      A new :class:`HessianState`.

    Raises:
      ValueError: ``x``'s last axis is not the state's ``k``, or the mask's shape is not
        ``x.shape[:-1]``. TypeError: a non-floating ``x``, a non-bool mask, or another device.

    Numerics: FP32 (inputs are converted first, exact for bf16/fp16); the result does not depend
    on how rows are split into batches except through FP32 summation order.

    Example:
      >>> s = hessian_update(hessian_init(2), torch.tensor([[1.0, 2.0], [3.0, 4.0]]))
      >>> s.xtx.tolist(), int(s.rows)
      ([[10.0, 14.0], [14.0, 20.0]], 2)
    """
    where = "hessian_update"
    xtx, rows = _check_state(state, where=where)
    require_floating(x, name="x", where=where)
    k = xtx.shape[0]
    if x.ndim < 1 or x.shape[-1] != k:
        raise ValueError(f"{where}: x must have shape (*batch, {k}), got {tuple(x.shape)}")
    if x.device != xtx.device:
        raise TypeError(f"{where}: x is on {x.device} but the Hessian state on {xtx.device}")
    flat = x.detach().reshape(-1, k).to(torch.float32)
    if mask is None:
        count = torch.full((), flat.shape[0], dtype=torch.int64, device=xtx.device)
    else:
        if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool:
            raise TypeError(f"{where}: mask must be a bool tensor, got {_kind(mask)}")
        if tuple(mask.shape) != tuple(x.shape[:-1]):
            raise ValueError(
                f"{where}: mask must have x's leading shape {tuple(x.shape[:-1])}, got "
                f"{tuple(mask.shape)}"
            )
        # Padding rows are removed, not zeroed: the product then sums exactly the rows an
        # unpadded call sums, in the same order, so padding cannot change a single bit.
        flat = flat[mask.reshape(-1).to(xtx.device)]
        count = torch.full((), flat.shape[0], dtype=torch.int64, device=xtx.device)
    return HessianState(xtx + flat.T @ flat, rows + count)


def hessian_merge(first: HessianState, second: HessianState) -> HessianState:
    """Two folds over disjoint rows as one: ``xtx`` and ``rows`` added (a new state).

    Calibration split across processes folds each part, then merges the parts in a fixed order.

    Raises:
      TypeError: either is not a HessianState, or they are on different devices.
      ValueError: their ``k`` differ.

    Numerics: one FP32 addition per entry: equal to folding both parts' rows into one state up
    to the reassociation of FP32 sums (``|Δ| ≤ ε·Σ|xᵀx|`` per entry per merge); ``rows`` exact.

    Example:
      >>> a = hessian_update(hessian_init(2), torch.tensor([[1.0, 2.0]]))
      >>> b = hessian_update(hessian_init(2), torch.tensor([[3.0, 4.0]]))
      >>> merged = hessian_merge(a, b)
      >>> merged.xtx.tolist(), int(merged.rows)
      ([[10.0, 14.0], [14.0, 20.0]], 2)
    """
    where = "hessian_merge"
    xtx, rows = _check_state(first, where=where)
    other, more = _check_state(second, where=where)
    if other.shape != xtx.shape:
        raise ValueError(f"{where}: the states hold k={xtx.shape[0]} and k={other.shape[0]}")
    if other.device != xtx.device:
        raise TypeError(f"{where}: the states are on {xtx.device} and {other.device}")
    return HessianState(xtx + other, rows + more)


def hessian_finalize(state: HessianState) -> Float32[Tensor, "k k"]:
    """The Hessian ``H = (2 / N) · Σ xᵀx`` of a fold, in FP32.

    Raises:
      ValueError: no rows were folded in, or the result is not finite (inputs with inf/NaN).

    Numerics: ``xtx * fp32(2 / N)``: one FP32 rounding of the factor (computed in double) and
    one of the product, the same on every device.

    Example:
      >>> s = hessian_update(hessian_init(2), torch.tensor([[1.0, 2.0], [3.0, 4.0]]))
      >>> hessian_finalize(s).tolist()
      [[10.0, 14.0], [14.0, 20.0]]
    """
    where = "hessian_finalize"
    xtx, rows = _check_state(state, where=where)
    n = int(rows)
    if n <= 0:
        raise ValueError(f"{where}: no rows were folded in (rows={n}); call hessian_update first")
    factor = torch.tensor(2.0 / n, dtype=torch.float32, device=xtx.device)
    hessian = xtx * factor
    if not bool(torch.isfinite(hessian).all()):
        raise ValueError(f"{where}: the Hessian is not finite; the inputs contained inf or NaN")
    return hessian


def _check_state(state: Any, *, where: str) -> tuple[Tensor, Tensor]:
    if not isinstance(state, tuple) or len(state) != 2:
        raise TypeError(f"{where}: state must be a HessianState, got {type(state).__name__}")
    xtx, rows = state
    if (
        not isinstance(xtx, torch.Tensor)
        or xtx.dtype != torch.float32
        or xtx.ndim != 2
        or xtx.shape[0] != xtx.shape[1]
    ):
        raise TypeError(f"{where}: state.xtx must be a square FP32 tensor, got {_kind(xtx)}")
    if not isinstance(rows, torch.Tensor) or rows.ndim != 0:
        raise TypeError(f"{where}: state.rows must be a 0-d tensor, got {_kind(rows)}")
    return xtx, rows


def _kind(x: Any) -> str:
    if isinstance(x, torch.Tensor):
        return f"tensor of dtype {x.dtype} and shape {tuple(x.shape)}"
    return f"{type(x).__name__} {x!r}"
