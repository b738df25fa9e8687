"""NVIDIA's percentile headroom calibration of an NVFP4 activation's global scale.

Calibration folds activation batches into a fixed-size state (a log2 histogram of the 16-value
block maxima and their running maximum; no activation is kept), then reads a calibrated
activation maximum off it: ``max(rho · P_anchor, P_upper)``. :func:`floatxq.nvfp4_global_scale`
turns that maximum into the global scale (divisor 6 for the ``*_headroom`` recipes). The pure
functions are :func:`headroom_init`, :func:`headroom_update`, :func:`headroom_percentile` and
:func:`headroom_amax` (:data:`floatxq.stats.HEADROOM` folds them beside the other calibration
statistics). The contract is in ``docs/numerics.md``.
"""

import dataclasses
import math
import warnings
from typing import NamedTuple

import torch

from floatxq._checks import require_floating
from floatxq._typing import Bool, Float, Float32, Int64, Tensor, checked_record
from floatxq.formats import FP8_E4M3_MAX
from floatxq.nvfp4.quantize import _blocks_of

__all__ = [
    "HeadroomConfig",
    "HeadroomState",
    "headroom_amax",
    "headroom_init",
    "headroom_percentile",
    "headroom_update",
]

_RHO_LIMIT = FP8_E4M3_MAX / 2.0**-6  # 28672: the E4M3 normal dynamic range


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class HeadroomConfig:
    """Settings of the NVIDIA percentile headroom calibration (validated when built).

    ``anchor_percentile`` and ``upper_percentile`` in ``(0, 100]``, ``rho`` in ``(0, 28672)``
    (the E4M3 normal range), ``num_bins`` log2 bins spanning ``[log2_min, log2_max)``.

    Numerics: names and numbers only.
    """

    anchor_percentile: float | int = 1.0
    upper_percentile: float | int = 99.99
    rho: float | int = 16384.0
    num_bins: int = 512
    log2_min: float | int = -40.0
    log2_max: float | int = 40.0

    def __post_init__(self) -> None:
        for name in ("anchor_percentile", "upper_percentile"):
            p = getattr(self, name)
            if not _is_number(p) or not 0 < p <= 100:
                raise ValueError(f"HeadroomConfig: {name} must be in (0, 100], got {p!r}")
        if not _is_number(self.rho) or not 0 < self.rho < _RHO_LIMIT:
            raise ValueError(
                f"HeadroomConfig: rho must be a number in (0, {_RHO_LIMIT:g}), got {self.rho!r}"
            )
        bins = self.num_bins
        if isinstance(bins, bool) or not isinstance(bins, int) or bins < 1:
            raise ValueError(f"HeadroomConfig: num_bins must be a positive int, got {bins!r}")
        bounds = (self.log2_min, self.log2_max)
        if not all(_is_number(b) and math.isfinite(b) for b in bounds) or bounds[0] >= bounds[1]:
            raise ValueError(
                f"HeadroomConfig: log2_min < log2_max (both finite numbers) is required, got "
                f"log2_min={self.log2_min!r}, log2_max={self.log2_max!r}"
            )


@checked_record
class HeadroomState(NamedTuple):
    """Running statistics of :func:`headroom_update`: fixed size, no activations retained."""

    config: HeadroomConfig
    counts: Int64[Tensor, " bins"]
    """Log2 histogram of the nonzero 16-value block maxima (``config.num_bins`` bins)."""
    running_max: Float32[Tensor, ""]
    """The largest block maximum seen (0 before any data)."""


def headroom_init(config: HeadroomConfig | None = None) -> HeadroomState:
    """An empty headroom state (``config`` defaults to :class:`HeadroomConfig`'s defaults).

    Numerics: zero counts, running max 0.

    Example:
      >>> headroom_init().counts.shape
      torch.Size([512])
    """
    config = config if config is not None else HeadroomConfig()
    return HeadroomState(
        config,
        torch.zeros(config.num_bins, dtype=torch.int64),
        torch.zeros((), dtype=torch.float32),
    )


def _kept_rows(x: Tensor, mask: Tensor | None, *, where: str) -> Tensor:
    """``x`` without the rows a keep-mask drops (``x`` itself when ``mask`` is None).

    The calibration statistics share this convention (:mod:`floatxq.stats`): ``mask`` is a bool
    tensor of ``x``'s leading shape, and a row where it is False reaches no statistic.
    """
    if mask is None:
        return x
    require_floating(x, name="x", where=where)
    if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool:
        kind = f"{mask.dtype} tensor" if isinstance(mask, torch.Tensor) else type(mask).__name__
        raise TypeError(f"{where}: mask must be a bool tensor, got {kind}")
    if x.ndim < 1 or tuple(mask.shape) != tuple(x.shape[:-1]):
        raise ValueError(
            f"{where}: mask must have x's leading shape {tuple(x.shape[:-1])}, got "
            f"{tuple(mask.shape)}"
        )
    return x[mask.to(x.device)]


def _bin_index(log2_value: Tensor, config: HeadroomConfig) -> Tensor:
    span = config.log2_max - config.log2_min
    idx = torch.floor((log2_value - config.log2_min) / span * config.num_bins)
    return idx.clamp(0, config.num_bins - 1).to(torch.int64)


def headroom_update(
    state: HeadroomState, x: Float[Tensor, "*b k"], mask: Bool[Tensor, "*b"] | None = None
) -> HeadroomState:
    """Fold a batch of activations into the headroom statistics (a new state; inputs untouched).

    Block maxima of ``|x|`` over 16 consecutive elements (FP32) update the running max, and the
    nonzero ones are counted into ``num_bins`` log2 bins
    ``floor((log2 m − log2_min) / (log2_max − log2_min) · num_bins)`` clamped to the range.
    Counts add and maxima commute, so the order of the batches does not matter. ``mask`` (a bool
    keep-mask of ``x``'s leading shape) drops padding rows before anything is counted.

    Raises:
      ValueError: ``k % 16``, non-finite ``x`` or a mask of another shape (``TypeError``: not
        bool). Empty ``x`` (or every row masked) returns ``state`` unchanged.

    Numerics: exact maxima; FP32 log2 for binning; int64 counts.

    Example:
      >>> s = headroom_update(headroom_init(), torch.full((2, 16), 0.5))
      >>> int(s.counts.sum()), s.running_max.item()
      (2, 0.5)
    """
    where = "headroom_update"
    x = _kept_rows(x, mask, where=where)
    if x.numel() == 0:
        return state
    blocks = _blocks_of(x, where=where)
    block_max = blocks.abs().amax(dim=1)
    config = state.config
    nonzero = block_max[block_max > 0]
    counts = state.counts.to(block_max.device)
    if nonzero.numel():
        counts = counts + torch.bincount(
            _bin_index(torch.log2(nonzero), config), minlength=config.num_bins
        )
    running = torch.maximum(state.running_max.to(block_max.device), block_max.max())
    return HeadroomState(config, counts, running)


def headroom_percentile(
    state: HeadroomState, p: float | int, *, floor: float | int | None = None
) -> float | None:
    """The ``p``-th percentile of the observed nonzero block maxima, as a log2-bin centre.

    Bins below ``floor``'s bin are ignored when ``floor > 0``; ``None`` when no counts remain.
    The index is the first bin whose cumulative count reaches ``p/100 · total``.

    Raises:
      ValueError: ``p`` outside ``(0, 100]``.

    Numerics: bin centres ``2 ** (log2_min + (index + 0.5) / num_bins · span)`` in float64.

    Example:
      >>> s = headroom_update(headroom_init(), torch.full((2, 16), 0.5))
      >>> round(headroom_percentile(s, 50.0), 4)  # the centre of the log2 bin holding 0.5
      0.4946
    """
    if not _is_number(p) or not 0 < p <= 100:
        raise ValueError(f"headroom_percentile: p must be a number in (0, 100], got {p!r}")
    config = state.config
    counts = state.counts.detach().to("cpu", copy=True)
    if floor is not None and floor > 0:
        cut = int(_bin_index(torch.log2(torch.tensor(floor, dtype=torch.float32)), config))
        counts[:cut] = 0
    total = int(counts.sum())
    if total == 0:
        return None
    target = p / 100.0 * total
    cumulative = torch.cumsum(counts, 0).to(torch.float64)
    index = int(torch.searchsorted(cumulative, torch.tensor([target], dtype=torch.float64)))
    index = min(max(index, 0), config.num_bins - 1)
    span = config.log2_max - config.log2_min
    return 2.0 ** (config.log2_min + (index + 0.5) / config.num_bins * span)


def headroom_amax(state: HeadroomState) -> Float32[Tensor, ""]:
    """The calibrated activation maximum: ``max(rho · P_anchor, P_upper)`` of the block maxima.

    ``upper`` is the running max when ``upper_percentile >= 100``, else that percentile (a
    log-bin centre); ``anchor`` is the ``anchor_percentile`` percentile of the blocks no more than
    1e6× below ``upper``. If either is undefined or zero the running max is returned; otherwise
    ``rho · anchor``, or ``upper`` with a warning when that gives no headroom.

    Raises:
      ValueError: no nonzero block has been observed.

    Numerics: percentiles are bin centres computed in float64; the result is rounded to FP32.

    Example:
      >>> s = headroom_update(headroom_init(), torch.full((2, 16), 2.0**-10))
      >>> headroom_amax(s).item() > 8.0
      True
    """
    running = float(state.running_max)
    if int(state.counts.sum()) == 0 or running <= 0:
        raise ValueError(
            "headroom_amax: the headroom calibration observed no nonzero activation blocks"
        )
    config = state.config
    upper = (
        running
        if config.upper_percentile >= 100
        else headroom_percentile(state, config.upper_percentile)
    )
    anchor = headroom_percentile(
        state, config.anchor_percentile, floor=upper / 1e6 if upper else None
    )
    if not upper or not anchor:
        return torch.tensor(running, dtype=torch.float32)
    amax = config.rho * anchor
    if amax <= upper:
        warnings.warn(
            f"NVFP4 headroom: rho * anchor = {amax:.6g} <= upper = {upper:.6g}; the calibration "
            f"gives no requested activation headroom, using the upper percentile",
            UserWarning,
            stacklevel=2,
        )
        amax = upper
    return torch.tensor(amax, dtype=torch.float32)
