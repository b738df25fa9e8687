"""The activation setting of an FP8 linear: how ``x`` is quantized before it meets the weight.

A checkpoint that declares dynamic FP8 activations (llm-compressor's ``FP8_DYNAMIC``: E4M3 per
token; ``FP8_BLOCK`` and transformers' fine-grained FP8: E4M3 per token and 1×128 group) is served
by vLLM with ``x`` quantized per call. :class:`FP8InputQuant` records that declaration on a
:class:`~floatxq.nn.fp8_linear.TorchFP8Linear` (``input_quant``), and :func:`input_qdq` is what the
weight-only routes (``dequant_matmul``, ``compiled_cpu``) apply to ``x`` for it, so every route
multiplies the same quantized activations. ``None`` is weight-only (W8A16).
"""

import dataclasses
from typing import Literal

import torch

from floatxq._typing import Float, Tensor
from floatxq.formats import FP8_E4M3_MAX
from floatxq.fp8 import _saturating_cast, _token_scale

__all__ = ["INPUT_QUANT_STRATEGIES", "FP8InputQuant", "input_qdq", "normalize_input_quant"]

InputQuantStrategy = Literal["token", "group", "tensor"]
INPUT_QUANT_STRATEGIES: tuple[InputQuantStrategy, ...] = ("token", "group", "tensor")
"""How dynamic E4M3 activations are scaled: one scale per token (row), per token and
``group_size`` consecutive columns, or per call (the whole ``x``)."""


@dataclasses.dataclass(frozen=True, slots=True)
class FP8InputQuant:
    """Dynamic FP8 E4M3 activation quantization, as a checkpoint declares it.

    Raises:
      ValueError: an unknown strategy; ``group_size`` missing for (or given without) ``"group"``.
      TypeError: a ``group_size`` that is not an int.

    Numerics: none; a record (:func:`input_qdq` applies it).

    Example:
      >>> FP8InputQuant("group", 128).describe()
      'fp8 e4m3 dynamic per token group of 128'
    """

    strategy: InputQuantStrategy
    group_size: int | None = None

    def __post_init__(self) -> None:
        where = "FP8InputQuant"
        if self.strategy not in INPUT_QUANT_STRATEGIES:
            raise ValueError(
                f"{where}: strategy must be one of {INPUT_QUANT_STRATEGIES}, got {self.strategy!r}"
            )
        size = self.group_size
        if self.strategy != "group":
            if size is not None:
                raise ValueError(f"{where}: group_size is given for 'group' only, got {size!r}")
            return
        if isinstance(size, bool) or not isinstance(size, int):
            raise TypeError(f"{where}: 'group' needs an int group_size, got {size!r}")
        if size <= 0:
            raise ValueError(f"{where}: group_size must be > 0, got {size}")

    def describe(self) -> str:
        """``fp8 e4m3 dynamic per token`` (``... per token group of 128``, ``... per tensor``)."""
        what = {"token": "per token", "tensor": "per tensor"}.get(
            self.strategy, f"per token group of {self.group_size}"
        )
        return f"fp8 e4m3 dynamic {what}"

    def __str__(self) -> str:
        return self.strategy if self.group_size is None else f"group:{self.group_size}"


def normalize_input_quant(value: object) -> FP8InputQuant | None:
    """``None``, an :class:`FP8InputQuant`, ``"token"``, ``"tensor"`` or ``"group:<size>"``.

    Raises:
      ValueError, TypeError: anything else (the accepted spellings named).

    Example:
      >>> normalize_input_quant("group:128")
      FP8InputQuant(strategy='group', group_size=128)
    """
    if value is None or isinstance(value, FP8InputQuant):
        return value
    if isinstance(value, str):
        name, _, size = value.strip().lower().partition(":")
        if name == "group" and size.isdigit():
            return FP8InputQuant("group", int(size))
        if name in ("token", "tensor") and not size:
            return FP8InputQuant(name)  # type: ignore[arg-type]
    raise ValueError(
        f"input_quant must be None (weight-only), 'token', 'tensor', 'group:<size>' or an "
        f"FP8InputQuant, got {value!r}"
    )


def input_qdq(x: Float[Tensor, "*b k"], quant: FP8InputQuant) -> Float[Tensor, "*b k"]:
    """Quantize-dequantize ``x`` through E4M3 as ``quant`` says: the activations a W8A8 serving
    engine multiplies, in ``x``'s dtype (for the weight-only routes' decoded weight).

    ``"token"`` equals :func:`floatxq.fp8_token_qdq` bit for bit; ``"group"`` is it over each
    ``group_size`` columns of a row (``k`` a multiple of it: the module checks), ``"tensor"`` over
    the whole call. No argument checks and no host sync (the module's forward has checked ``x``);
    a NaN or infinite ``x`` gives NaN rows, as a GEMM's quantizer does.

    Numerics: ``scale = amax / 448`` (1 for a zero group, the smallest FP32 where it underflows),
    ``e4m3(clamp(x32 / scale, ±448)) * scale`` exactly in FP32, one rounding to ``x.dtype``.
    """
    if x.numel() == 0:
        return x
    x32 = x.to(torch.float32)
    if quant.strategy == "group":
        size = quant.group_size or x32.shape[-1]  # set for "group" (checked at construction)
        x32 = x32.unflatten(-1, (x32.shape[-1] // size, size))
    elif quant.strategy == "tensor":
        x32 = x32.reshape(1, -1)
    scale = _token_scale(x32)
    codes = _saturating_cast(x32 / scale, torch.float8_e4m3fn, FP8_E4M3_MAX)
    return (codes.to(torch.float32) * scale).reshape(x.shape).to(x.dtype)


def checked_input_quant(
    value: object, *, in_features: int, conv: bool, where: str = "TorchFP8Linear"
) -> FP8InputQuant | None:
    """:func:`normalize_input_quant` for a module of ``in_features`` inputs: ``ValueError`` when a
    group size does not divide them, or for a convolution (its activations are not quantized)."""
    quant = normalize_input_quant(value)
    if quant is not None and quant.group_size and in_features % quant.group_size:
        raise ValueError(
            f"{where}: input_quant {quant} needs in_features ({in_features}) to be a multiple of "
            f"its group size"
        )
    if quant is not None and conv:
        raise ValueError(f"{where}: a convolution's activations are not quantized (conv)")
    return quant


_ROUTE_X = {
    "scaled_mm_tensorwise": "x quantized per tensor to the weight's FP8 format, in the GEMM",
    "scaled_mm_rowwise": "x quantized per row (token) to e4m3, in the GEMM",
    "scaled_mm_blockwise": "x quantized per row and 128 columns to e4m3, in the GEMM",
}
WEIGHT_ONLY_ROUTES = ("dequant_matmul", "compiled_cpu")
"""The FP8 routes that multiply the decoded weight (they apply :func:`input_qdq` themselves)."""


def describe_x(route: str, scaled_route: str, quant: FP8InputQuant | None) -> str:
    """What an FP8 linear's ``route`` did to ``x`` before the weight (``fp8_small_m`` runs
    ``scaled_route``'s recipe; ``"none"`` before any call)."""
    if route == "none":
        return "none"
    if route in _ROUTE_X or route == "fp8_small_m":
        return _ROUTE_X[route if route != "fp8_small_m" else scaled_route]
    if quant is None or route == "conv_dequant":
        return "none: x multiplies the decoded weight (weight-only)"
    return f"{quant.describe()} (quantize-dequantize), then the decoded weight"
