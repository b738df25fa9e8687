"""Calibration statistics as folds: one ``init / update / finalize`` shape for every statistic.

A statistic is a :class:`Statistic` record of three pure functions (as optax's transformations
are): ``init(...)`` makes an empty state, ``update(state, x)`` returns a new state with a batch of
rows folded in (never mutating the old one), ``finalize(state)`` turns the state into the value
it measures. The lifecycle folds several of them over the same batches in one loop
(:func:`fold_all`), whatever they measure:

- :data:`HESSIAN`: ``H = 2/N Σ xᵀx`` (:func:`floatxq.hessian_init` and its update / finalize);
- :data:`RUNNING_AMAX`: the running ``max|x|`` (:func:`amax_init`, :func:`amax_update`,
  :func:`amax_finalize`);
- :data:`HEADROOM`: NVIDIA's percentile headroom ``amax`` (:func:`floatxq.headroom_init`,
  :func:`floatxq.headroom_update`, :func:`floatxq.headroom_amax`).
"""

from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import torch

from floatxq._checks import require_floating
from floatxq._typing import Float, Float32, Tensor, checked_record
from floatxq.gptq.solve import hessian_finalize, hessian_init, hessian_update
from floatxq.nvfp4.headroom import headroom_amax, headroom_init, headroom_update


class Statistic(NamedTuple):
    """Three pure functions that fold batches of rows into one measured value."""

    init: Callable[..., Any]
    """``init(*args, **kwargs) -> state``: the empty state."""
    update: Callable[[Any, Tensor], Any]
    """``update(state, x) -> state``: a new state with the rows of ``x`` folded in."""
    finalize: Callable[[Any], Any]
    """``finalize(state) -> value``: what the state measures."""


@checked_record
class AmaxState(NamedTuple):
    """The running maximum magnitude of every value folded in so far."""

    amax: Float32[Tensor, ""]
    """FP32 0-d: ``max|x|`` over the values seen (0 before any)."""


def amax_init(*, device: torch.device | str | None = None) -> AmaxState:
    """An empty running ``max|x|`` (0 in FP32 on ``device``).

    Example:
      >>> amax_init().amax.item()
      0.0
    """
    return AmaxState(torch.zeros((), dtype=torch.float32, device=device))


def amax_update(state: AmaxState, x: Float[Tensor, "*rows k"]) -> AmaxState:
    """Fold ``x`` into the running ``max|x|`` (a new state; empty ``x`` leaves it unchanged).

    Raises:
      TypeError: a non-floating ``x``.

    Numerics: exact (a maximum of magnitudes converted to FP32, which is exact for every
    float16 / bfloat16 / float32 value); NaN propagates, so a non-finite input is seen.

    Example:
      >>> amax_update(amax_init(), torch.tensor([[1.0, -3.0]])).amax.item()
      3.0
    """
    require_floating(x, name="x", where="amax_update")
    if x.numel() == 0:
        return state
    amax = x.detach().abs().amax().to(torch.float32)
    return AmaxState(torch.maximum(state.amax.to(amax.device), amax))


def amax_finalize(state: AmaxState) -> Float32[Tensor, ""]:
    """The running ``max|x|`` of ``state`` (FP32 0-d).

    Example:
      >>> amax_finalize(amax_update(amax_init(), torch.tensor([2.0, -0.5]))).item()
      2.0
    """
    return state.amax


HESSIAN = Statistic(hessian_init, hessian_update, hessian_finalize)
"""``init(k, device=...)``; ``finalize`` raises ``ValueError`` on no rows or a non-finite sum."""

RUNNING_AMAX = Statistic(amax_init, amax_update, amax_finalize)
"""``init(device=...)``; ``finalize`` gives the FP32 ``max|x|``."""

HEADROOM = Statistic(headroom_init, headroom_update, headroom_amax)
"""``init(config=None)``; ``finalize`` gives the percentile ``amax`` (``ValueError`` on no data)."""


def fold_all(
    statistics: Mapping[str, Statistic], states: Mapping[str, Any], x: Float[Tensor, "*rows k"]
) -> dict[str, Any]:
    """Fold one batch ``x`` into every statistic's state: ``{name: update(states[name], x)}``.

    Raises:
      ValueError: ``states`` does not name exactly the statistics.

    Example:
      >>> stats = {"amax": RUNNING_AMAX}
      >>> states = fold_all(stats, {"amax": amax_init()}, torch.tensor([[4.0, -5.0]]))
      >>> RUNNING_AMAX.finalize(states["amax"]).item()
      5.0
    """
    if set(states) != set(statistics):
        raise ValueError(
            f"fold_all: states name {sorted(states)}, the statistics {sorted(statistics)}"
        )
    return {name: stat.update(states[name], x) for name, stat in statistics.items()}


__all__ = [
    "HEADROOM",
    "HESSIAN",
    "RUNNING_AMAX",
    "AmaxState",
    "Statistic",
    "amax_finalize",
    "amax_init",
    "amax_update",
    "fold_all",
]
