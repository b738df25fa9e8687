"""The preference record: what a caller (a module or a model) asks of the route choices."""

import dataclasses

from floatxq.dispatch.fp8 import _DEFAULT_TUNING, FP8RouteTuning

__all__ = ["W4A_FP8_ROUTES", "W4A_NVFP4_ROUTES", "RoutePreference"]

W4A_FP8_ROUTES: tuple[str, ...] = ("auto", "triton", "reference")
"""Requested routes of ``W4AFP8Linear``: ``"auto"`` takes the kernels where they run."""

W4A_NVFP4_ROUTES: tuple[str, ...] = ("auto", "native", "emulation", "reference")
"""Requested routes of ``W4ANVFP4Linear``: ``"auto"`` takes the fastest that runs."""


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class RoutePreference:
    """What a caller asks of the route choices: one frozen record a module (or model) holds.

    ``W4AFP8Linear.route``, ``W4ANVFP4Linear.route`` and ``TorchFP8Linear.route_tuning`` read
    and replace fields of their module's record.

    Raises:
      ValueError: an unknown ``w4a_fp8`` or ``w4a_nvfp4`` route.
      TypeError: ``fp8_tuning`` that is not an :class:`FP8RouteTuning`.

    Numerics: none; preferences only (every route computes the same product).

    Example:
      >>> dataclasses.replace(RoutePreference(), w4a_nvfp4="reference").w4a_nvfp4
      'reference'
    """

    w4a_fp8: str = "auto"
    """The requested W4A-FP8 route (:data:`W4A_FP8_ROUTES`)."""
    w4a_nvfp4: str = "auto"
    """The requested W4A-NVFP4 route (:data:`W4A_NVFP4_ROUTES`)."""
    fp8_tuning: FP8RouteTuning = _DEFAULT_TUNING
    """The row thresholds of :func:`select_fp8_route`."""

    def __post_init__(self) -> None:
        if self.w4a_fp8 not in W4A_FP8_ROUTES:
            raise ValueError(
                f"W4AFP8Linear: route must be one of {W4A_FP8_ROUTES}, got {self.w4a_fp8!r}"
            )
        if self.w4a_nvfp4 not in W4A_NVFP4_ROUTES:
            raise ValueError(
                f"W4ANVFP4Linear: route must be one of {W4A_NVFP4_ROUTES}, got {self.w4a_nvfp4!r}"
            )
        if not isinstance(self.fp8_tuning, FP8RouteTuning):
            raise TypeError(
                f"TorchFP8Linear.route_tuning must be an FP8RouteTuning, got "
                f"{type(self.fp8_tuning).__name__}"
            )
