"""The activation setting of an FP8 linear: how ``x`` is quantized before it meets the weight.

A checkpoint that declares dynamic FP8 activations (llm-compressor's ``FP8_DYNAMIC``: E4M3 per
token; ``FP8_BLOCK`` and transformers' fine-grained FP8: E4M3 per token and 1×128 group) is served
by vLLM with ``x`` quantized per call. One that declares static FP8 activations (llm-compressor's
``FP8`` scheme, ModelOpt's ``FP8``, transformers' ``activation_scheme: static``: W8A8) stores one
FP32 ``input_scale`` per module, fixed at calibration, and ``x`` is quantized at that scale.
:class:`FP8InputQuant` records the declaration on a
:class:`~floatxq.nn.fp8_linear.TorchFP8Linear` (``input_quant``; a static module also holds the
``input_scale`` buffer), and :func:`input_qdq` is what the weight-only routes (``dequant_matmul``,
``compiled_cpu``) apply to ``x`` for it, so every route multiplies the same quantized activations.
``None`` is weight-only (W8A16).
"""

import dataclasses
from typing import Literal

import torch

from floatxq._checks import positive_scale
from floatxq._typing import Float, Float8e4m3fn, Tensor
from floatxq.formats import FP8_E4M3_MAX
from floatxq.fp8 import _saturating_cast, _token_scale

__all__ = [
    "INPUT_QUANT_STRATEGIES",
    "FP8InputQuant",
    "fp8_static_input_quantize",
    "input_qdq",
    "normalize_input_quant",
    "static_input_qdq",
]

InputQuantStrategy = Literal["token", "group", "tensor", "static"]
INPUT_QUANT_STRATEGIES: tuple[InputQuantStrategy, ...] = ("token", "group", "tensor", "static")
"""How E4M3 activations are scaled: dynamically, one scale per token (row), per token and
``group_size`` consecutive columns, or per call (the whole ``x``); or ``"static"``: one stored
per-tensor ``input_scale`` (the module's buffer), the same for every call."""


@dataclasses.dataclass(frozen=True, slots=True)
class FP8InputQuant:
    """FP8 E4M3 activation quantization, as a checkpoint declares it: dynamic (``"token"``,
    ``"group"``, ``"tensor"``: scales computed per call) or ``"static"`` (per tensor, at the
    module's stored ``input_scale``).

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

    @property
    def dynamic(self) -> bool:
        """Whether the scales are computed per call (False: ``"static"``, a stored scale)."""
        return self.strategy != "static"

    def describe(self) -> str:
        """``fp8 e4m3 dynamic per token`` (``... per token group of 128``, ``... per tensor``,
        ``fp8 e4m3 static per tensor``)."""
        if self.strategy == "static":
            return "fp8 e4m3 static per tensor"
        what = {"token": "per token", "tensor": "per tensor"}.get(
            self.strategy, f"per token group of {self.group_size}"
        )
        return f"fp8 e4m3 dynamic {what}"

    def __str__(self) -> str:
        return self.strategy if self.group_size is None else f"group:{self.group_size}"


def normalize_input_quant(value: object) -> FP8InputQuant | None:
    """``None``, an :class:`FP8InputQuant`, ``"token"``, ``"tensor"``, ``"group:<size>"`` or
    ``"static"``.

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
        if name in ("token", "tensor", "static") and not size:
            return FP8InputQuant(name)  # type: ignore[arg-type]
    raise ValueError(
        f"input_quant must be None (weight-only), 'token', 'tensor', 'group:<size>', 'static' or "
        f"an FP8InputQuant, got {value!r}"
    )


def fp8_static_input_quantize(
    x: Float[Tensor, "*b k"], input_scale: Float[Tensor, ""]
) -> Float8e4m3fn[Tensor, "*b k"]:
    """Static per-tensor E4M3 codes of ``x`` at a stored scale, as compressed-tensors and vLLM
    quantize a W8A8 checkpoint's activations: ``e4m3(clamp(x / input_scale, ±448))``.

    ``input_scale`` is the decode multiplier (``x ≈ code · input_scale``; llm-compressor writes
    ``amax / 448`` of its calibration). No argument checks and no host sync (the module checked
    the scale when it was stored).

    Numerics: ``float32(x) / input_scale`` (IEEE division; vLLM's kernel multiplies by
    ``fl(1 / input_scale)``, which can differ by one rounding), clamp to ±448 (±inf saturates),
    nearest-even E4M3; NaN stays NaN. With ``input_scale = amax / 448`` these are the codes of
    dynamic per-tensor quantization (:func:`input_qdq` with ``"tensor"``).

    Example:
      >>> fp8_static_input_quantize(torch.tensor([1.0, 1e6]), torch.tensor(0.5)).float().tolist()
      [2.0, 448.0]
    """
    scale = input_scale.to(torch.float32)
    return _saturating_cast(x.to(torch.float32) / scale, torch.float8_e4m3fn, FP8_E4M3_MAX)


def static_input_qdq(
    x: Float[Tensor, "*b k"], input_scale: Float[Tensor, ""]
) -> Float[Tensor, "*b k"]:
    """``x`` quantize-dequantized at a static per-tensor scale: the activations a W8A8 serving
    engine multiplies (its output scale ``input_scale · weight_scale`` applied to the codes'
    product is this times the decoded weight), in ``x``'s dtype.

    Numerics: :func:`fp8_static_input_quantize`, then ``float32(code) · input_scale`` (exact in
    FP32: a 4-bit significand times the scale), one nearest-even rounding to ``x.dtype``.

    Example:
      >>> static_input_qdq(torch.tensor([0.3, -900.0]), torch.tensor(1.0)).tolist()
      [0.3125, -448.0]
    """
    if x.numel() == 0:
        return x
    codes = fp8_static_input_quantize(x, input_scale)
    return (codes.to(torch.float32) * input_scale.to(torch.float32)).to(x.dtype)


def input_qdq(
    x: Float[Tensor, "*b k"], quant: FP8InputQuant, input_scale: Float[Tensor, ""] | None = None
) -> Float[Tensor, "*b k"]:
    """Quantize-dequantize ``x`` through E4M3 as ``quant`` says: the activations a W8A8 serving
    engine multiplies, in ``x``'s dtype (for the weight-only routes' decoded weight).

    ``"token"`` equals :func:`floatxq.fp8_token_qdq` bit for bit; ``"group"`` is it over each
    ``group_size`` columns of a row (``k`` a multiple of it: the module checks), ``"tensor"`` over
    the whole call; ``"static"`` is :func:`static_input_qdq` at ``input_scale`` (required for it,
    ignored otherwise). No other argument checks and no host sync (the module's forward has
    checked ``x``); a NaN or infinite ``x`` gives NaN rows, as a GEMM's quantizer does.

    Raises:
      ValueError: ``"static"`` without an ``input_scale``.

    Numerics: ``scale = amax / 448`` (1 for a zero group, the smallest FP32 where it underflows),
    ``e4m3(clamp(x32 / scale, ±448)) * scale`` exactly in FP32, one rounding to ``x.dtype``.
    """
    if quant.strategy == "static":
        if input_scale is None:
            raise ValueError("input_qdq: input_quant 'static' needs the stored input_scale")
        return static_input_qdq(x, input_scale)
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


def checked_static_scale(
    input_quant: object, input_scale: object, device: torch.device, *, where: str
) -> Float[Tensor, ""] | None:
    """``input_scale`` as a module stores it (0-d FP32 on ``device``), given exactly when
    ``input_quant`` is ``"static"`` (``None`` otherwise).

    Raises:
      ValueError: a scale missing for (or given without) ``"static"``; not one finite value > 0.
      TypeError: not a real number or a floating tensor.
    """
    quant = normalize_input_quant(input_quant)
    static = quant is not None and quant.strategy == "static"
    if static != (input_scale is not None):
        raise ValueError(
            f"{where}: input_scale is given exactly for input_quant 'static' (got input_quant="
            f"{quant}, input_scale {'given' if input_scale is not None else 'missing'})"
        )
    if input_scale is None:
        return None
    return positive_scale(input_scale, name="input_scale", where=where, device=device)


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
