"""Calibration statistics as folds: one ``init / update / finalize`` shape for every statistic.

A statistic is a :class:`Statistic` record of three pure functions (as optax's transformations
are): ``init(...)`` makes an empty state (a NamedTuple), ``update(state, x, mask=None)`` returns a
new state with the rows of ``x`` folded in (never mutating the old one; rows where the bool
keep-mask ``mask`` is False, padding, reach nothing), ``finalize(state)`` turns the state into the
value it measures. The lifecycle folds several of them over the same batches in one loop
(:func:`fold_all`, then :func:`finalize_all`), whatever they measure:

- :data:`HESSIAN`: ``H = 2/N Σ xᵀx`` (:func:`floatxq.hessian_init` and its update / finalize);
- :data:`RUNNING_AMAX`: the running ``max|x|`` (:func:`amax_init`, :func:`amax_update`,
  :func:`amax_finalize`);
- :data:`HEADROOM`: NVIDIA's percentile headroom ``amax`` (:func:`floatxq.headroom_init`,
  :func:`floatxq.headroom_update`, :func:`floatxq.headroom_amax`).

The running amax and the headroom counts do not depend on how rows are split into batches or in
which order they come (maxima commute, integer counts add); the Hessian does only through FP32
summation order.
"""

from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import torch

from floatxq._checks import require_floating
from floatxq._typing import Bool, Float, Float32, Tensor, checked_record
from floatxq.gptq.hessian import hessian_finalize, hessian_init, hessian_merge, hessian_update
from floatxq.nvfp4.headroom import _kept_rows, headroom_amax, headroom_init, headroom_update


class Statistic(NamedTuple):
    """Three pure functions that fold batches of rows into one measured value."""

    init: Callable[..., Any]
    """``init(*args, **kwargs) -> state``: the empty state."""
    update: Callable[..., Any]
    """``update(state, x, mask=None) -> state``: a new state with the kept rows of ``x`` folded
    in (``mask``: a bool keep-mask of ``x``'s leading shape)."""
    finalize: Callable[[Any], Any]
    """``finalize(state) -> value``: what the state measures."""
    merge: Callable[[Any, Any], Any] | None = None
    """``merge(a, b) -> state``: two folds over disjoint rows as one (the calibration split
    across processes); None where the statistic cannot be merged."""


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


def amax_update(
    state: AmaxState, x: Float[Tensor, "*rows k"], mask: Bool[Tensor, "*rows"] | None = None
) -> AmaxState:
    """Fold ``x`` into the running ``max|x|`` (a new state; empty ``x`` leaves it unchanged).

    Args:
      state: the fold so far; never mutated.
      x: floating values; every leading axis counts as rows.
      mask: optional bool keep-mask of ``x``'s leading shape; masked rows are not seen.

    Raises:
      TypeError: a non-floating ``x`` or a non-bool mask. ValueError: a mask of another shape.

    Numerics: exact (a maximum of magnitudes converted to FP32, which is exact for every
    float16 / bfloat16 / float32 value); NaN propagates, so a non-finite input is seen.

    Example:
      >>> amax_update(amax_init(), torch.tensor([[1.0, -3.0]])).amax.item()
      3.0
    """
    where = "amax_update"
    require_floating(x, name="x", where=where)
    x = _kept_rows(x, mask, where=where)
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


def amax_merge(first: AmaxState, second: AmaxState) -> AmaxState:
    """Two running ``max|x|`` over disjoint rows as one (a new state).

    Raises:
      TypeError: either is not an AmaxState.

    Numerics: exact (a maximum; NaN propagates).

    Example:
      >>> amax_merge(AmaxState(torch.tensor(2.0)), AmaxState(torch.tensor(3.0))).amax.item()
      3.0
    """
    for name, state in (("first", first), ("second", second)):
        if not isinstance(state, AmaxState):
            raise TypeError(f"amax_merge: {name} must be an AmaxState, got {type(state).__name__}")
    return AmaxState(torch.maximum(first.amax, second.amax.to(first.amax.device)))


HESSIAN = Statistic(hessian_init, hessian_update, hessian_finalize, hessian_merge)
"""``init(k, device=...)``; ``finalize`` raises ``ValueError`` on no rows or a non-finite sum."""

RUNNING_AMAX = Statistic(amax_init, amax_update, amax_finalize, amax_merge)
"""``init(device=...)``; ``finalize`` gives the FP32 ``max|x|``."""

HEADROOM = Statistic(headroom_init, headroom_update, headroom_amax)
"""``init(config=None)``; ``finalize`` gives the percentile ``amax`` (``ValueError`` on no data)."""


def _check_names(
    statistics: Mapping[str, Statistic], states: Mapping[str, Any], where: str
) -> None:
    if set(states) != set(statistics):
        raise ValueError(
            f"{where}: states name {sorted(states)}, the statistics {sorted(statistics)}"
        )


def fold_all(
    statistics: Mapping[str, Statistic],
    states: Mapping[str, Any],
    x: Float[Tensor, "*rows k"],
    *,
    mask: Bool[Tensor, "*rows"] | None = None,
) -> dict[str, Any]:
    """Fold one batch ``x`` into every statistic's state: ``{name: update(states[name], x, mask)}``.

    Raises:
      ValueError: ``states`` does not name exactly the statistics; any statistic's own error.

    Example:
      >>> stats = {"amax": RUNNING_AMAX}
      >>> states = fold_all(stats, {"amax": amax_init()}, torch.tensor([[4.0, -5.0]]))
      >>> RUNNING_AMAX.finalize(states["amax"]).item()
      5.0
    """
    _check_names(statistics, states, "fold_all")
    if mask is None:
        return {name: stat.update(states[name], x) for name, stat in statistics.items()}
    return {name: stat.update(states[name], x, mask) for name, stat in statistics.items()}


def finalize_all(statistics: Mapping[str, Statistic], states: Mapping[str, Any]) -> dict[str, Any]:
    """Every statistic's value: ``{name: finalize(states[name])}``.

    Raises:
      ValueError: ``states`` does not name exactly the statistics; any statistic's own error.

    Example:
      >>> stats = {"amax": RUNNING_AMAX}
      >>> states = fold_all(stats, {"amax": amax_init()}, torch.tensor([[4.0, -5.0]]))
      >>> finalize_all(stats, states)["amax"].item()
      5.0
    """
    _check_names(statistics, states, "finalize_all")
    return {name: stat.finalize(states[name]) for name, stat in statistics.items()}


__all__ = [
    "HEADROOM",
    "HESSIAN",
    "RUNNING_AMAX",
    "AmaxState",
    "Statistic",
    "amax_finalize",
    "amax_init",
    "amax_merge",
    "amax_update",
    "finalize_all",
    "fold_all",
]
