"""FP8 linear routes (:func:`select_fp8_route`) and the FP8 weight encoder choice.

FP8 linear routes, fastest first: ``fp8_small_m`` (fused Triton kernel),
``scaled_mm_tensorwise`` / ``_rowwise`` / ``_blockwise`` (cuBLAS), ``compiled_cpu`` (opt-in),
``dequant_matmul`` (everywhere). The weight encoder (:func:`quantize_fp8_weight_auto`): Triton on
CUDA, MLX's Metal encoder for very large weights on Apple Silicon, else torch. Numerics of every
route: ``docs/numerics.md``.
"""

import dataclasses
import platform
import typing
from collections.abc import Mapping
from typing import Literal, NamedTuple

import torch

from floatxq._typing import Float, Tensor, checked_record
from floatxq.formats import (
    FP8_DECODE_ONLY_FORMATS,
    FP8_FORMATS,
    FP8_SCALE_METHODS,
    FP8Format,
    FP8ScaleMethod,
)
from floatxq.fp8 import FP8Weight, quantize_fp8_weight
from floatxq.fp8_bands import quantize_fp8_weight_banded
from floatxq.kernels._triton import triton_unavailable_reason

__all__ = [
    "MLX_ENCODER_MIN_ELEMENTS",
    "ROUTES",
    "SCALED_MM_ROUTE",
    "FP8RouteChoice",
    "FP8RouteFacts",
    "FP8RouteTuning",
    "fp8_scaled_route",
    "mlx_encoder_reason",
    "quantize_fp8_weight_auto",
    "select_fp8_route",
]


FP8Route = Literal[
    "fp8_small_m",
    "scaled_mm_tensorwise",
    "scaled_mm_rowwise",
    "scaled_mm_blockwise",
    "dequant_matmul",
    "compiled_cpu",
    "conv_dequant",
]
"""A route name: how one ``TorchFP8Linear`` call was computed."""

ROUTES: tuple[FP8Route, ...] = typing.get_args(FP8Route)
"""Every value ``TorchFP8Linear.last_route`` takes (plus ``"none"`` before the first call)."""

SwitchableRoute = Literal[
    "fp8_small_m", "scaled_mm_tensorwise", "scaled_mm_rowwise", "scaled_mm_blockwise",
    "compiled_cpu",
]  # fmt: skip
"""A route a module may switch off after it raised (``dequant_matmul`` never is)."""

ScaledRoute = Literal["scaled_mm_tensorwise", "scaled_mm_rowwise", "scaled_mm_blockwise"]
"""The ``scaled_mm`` route of a weight scale layout."""

_SWITCHABLE: tuple[SwitchableRoute, ...] = typing.get_args(SwitchableRoute)
SCALED_MM_ROUTE: Mapping[FP8ScaleMethod, ScaledRoute] = {
    "tensor": "scaled_mm_tensorwise",
    "row": "scaled_mm_rowwise",
    "block": "scaled_mm_blockwise",
}
"""The ``scaled_mm`` route of each weight scale layout (``scaled_mm_`` + the recipe name)."""
_GRAPH_ROWS_FIELD: Mapping[ScaledRoute, str] = {
    "scaled_mm_tensorwise": "graph_rows_tensorwise",
    "scaled_mm_rowwise": "graph_rows_rowwise",
    "scaled_mm_blockwise": "graph_rows_blockwise",
}
_SCALED_MM_FORMATS = ("float8_e4m3fn", "float8_e5m2")
_HALF_DTYPES = (torch.float16, torch.bfloat16)
_SCALED_MM_ALIGN = 16
_TENSORWISE_MIN_CAPABILITY = (8, 9)
_ROWWISE_MIN_CAPABILITY = (9, 0)
_BLOCKWISE_MAJOR = 9
_BLOCKWISE_BLOCK = (128, 128)


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class FP8RouteTuning:
    """Row thresholds of the FP8 route policy: where the fused ``fp8_small_m`` kernel is taken.

    Measured (``benchmarks/fp8_small_m_sweep.py``, ``benchmarks/RESULTS.md``): eagerly,
    decode-sized calls are bound by host time, so one launch beats quantize + cuBLAS up to
    :attr:`small_m_rows`; inside a CUDA graph only GPU time counts, and the fused kernel stays
    faster up to 16 rows for row and block scales but only one row with a tensor scale.

    Raises:
      TypeError, ValueError: a field that is not an int ``>= 0``.

    Numerics: none; thresholds only.

    Example:
      >>> FP8RouteTuning().small_m_limit("scaled_mm_tensorwise", capturing=True)
      1
    """

    small_m_rows: int = 16
    """Calls of at most this many rows (after flattening) take ``fp8_small_m`` when eligible."""
    graph_rows_tensorwise: int = 1
    """Most rows a tensor-scaled layer sends to ``fp8_small_m`` during a CUDA graph capture."""
    graph_rows_rowwise: int = 16
    """Most rows a row-scaled layer sends to ``fp8_small_m`` during a CUDA graph capture."""
    graph_rows_blockwise: int = 16
    """Most rows a block-scaled layer sends to ``fp8_small_m`` during a CUDA graph capture."""

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(
                    f"FP8RouteTuning: {field.name} must be an int, got {type(value).__name__}"
                )
            if value < 0:
                raise ValueError(f"FP8RouteTuning: {field.name} must be >= 0, got {value}")

    def small_m_limit(self, route: ScaledRoute, *, capturing: bool) -> int:
        """Most rows a call of ``route``'s layout sends to ``fp8_small_m`` (eager or captured)."""
        if not capturing:
            return self.small_m_rows
        return min(getattr(self, _GRAPH_ROWS_FIELD[route]), self.small_m_rows)

    def capture_matters(self, rows: int, route: ScaledRoute) -> bool:
        """Whether a CUDA graph capture can change the route of a ``rows``-row call (so a
        caller need not ask torch whether one is under way otherwise)."""
        return rows <= self.small_m_rows and rows > self.small_m_limit(route, capturing=True)


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class FP8RouteFacts:
    """What the FP8 route policy decides on, for one FP8 linear call.

    Raises:
      ValueError: a field outside its accepted values (listed in the message), ``capability``
        missing on CUDA or given elsewhere, ``block_size`` missing for (or given without) the
        block layout, a route switched off twice or one that cannot be switched off.

    Numerics: none; a record of facts.

    Example:
      >>> facts = FP8RouteFacts(
      ...     device_type="cuda", capability=(9, 0), x_dtype=torch.bfloat16, rows=4,
      ...     in_features=512, out_features=256, format="float8_e4m3fn", scale_method="row",
      ...     small_m_unavailable="Triton is not importable",
      ... )
      >>> select_fp8_route(facts)
      FP8RouteChoice(route='scaled_mm_rowwise', reason='fp8_small_m: Triton is not importable')
    """

    device_type: str
    """``x.device.type`` (``"cuda"``, ``"cpu"``, ``"mps"`` ...)."""
    capability: tuple[int, int] | None = None
    """The CUDA device's compute capability ``(major, minor)``; ``None`` off CUDA."""
    x_dtype: torch.dtype
    """``x``'s dtype (the output dtype)."""
    rows: int
    """Rows of ``x`` after flattening (>= 1: an empty ``x`` needs no route)."""
    in_features: int
    out_features: int
    format: FP8Format
    """The weight's canonical FP8 format."""
    scale_method: FP8ScaleMethod
    """The weight's scale layout."""
    block_size: tuple[int, int] | None = None
    """The weight's ``[block_rows, block_cols]`` for ``scale_method="block"``, else ``None``."""
    small_m_unavailable: str | None = None
    """Why the fused Triton kernel cannot run on this CUDA device (``None``: it can)."""
    capturing: bool = False
    """Whether the current CUDA stream is capturing a graph."""
    compile_requested: bool = False
    """Whether the module opted in to ``compiled_cpu`` (``optimize()``)."""
    disabled: tuple[tuple[SwitchableRoute, str], ...] = ()
    """Routes switched off for calls like this one, each with why (e.g. the error it raised)."""
    has_scaled_mm: bool = True
    """Whether this torch has ``torch._scaled_mm`` (tensorwise and rowwise)."""
    has_blockwise_scaled_mm: bool = True
    """Whether this torch has ``F.scaled_mm`` with 1x128 and 128x128 block scaling."""
    input_quant: Literal["token", "group", "tensor", "static"] | None = None
    """The module's declared E4M3 activations (``None``: weight-only): the ``scaled_mm`` route is
    the one quantizing ``x`` that way (:func:`fp8_scaled_route`; ``"static"`` has none yet)."""
    input_group_size: int | None = None
    """Columns per activation scale for ``input_quant="group"``, else ``None``."""

    def __post_init__(self) -> None:
        where = "FP8RouteFacts"
        for name in ("rows", "in_features", "out_features"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"{where}: {name} must be an int, got {type(value).__name__}")
        if self.rows < 1:
            raise ValueError(
                f"{where}: rows must be >= 1 (x has rows to multiply), got {self.rows}"
            )
        if self.in_features < 0 or self.out_features < 0:
            raise ValueError(
                f"{where}: in_features and out_features must be >= 0, got "
                f"({self.in_features}, {self.out_features})"
            )
        if self.format not in FP8_FORMATS:
            raise ValueError(f"{where}: format must be one of {FP8_FORMATS}, got {self.format!r}")
        if self.scale_method not in FP8_SCALE_METHODS:
            raise ValueError(
                f"{where}: scale_method must be one of {FP8_SCALE_METHODS}, got "
                f"{self.scale_method!r}"
            )
        if (self.scale_method == "block") != (self.block_size is not None):
            raise ValueError(
                f"{where}: block_size is given exactly for scale_method='block'; got "
                f"scale_method={self.scale_method!r}, block_size={self.block_size!r}"
            )
        if (self.device_type == "cuda") != (self.capability is not None):
            raise ValueError(
                f"{where}: capability is given exactly for CUDA devices; got "
                f"device_type={self.device_type!r}, capability={self.capability!r}"
            )
        if self.input_quant not in (None, "token", "group", "tensor", "static"):
            raise ValueError(
                f"{where}: input_quant must be None, 'token', 'group', 'tensor' or 'static', got "
                f"{self.input_quant!r}"
            )
        if (self.input_quant == "group") != (self.input_group_size is not None):
            raise ValueError(
                f"{where}: input_group_size is given exactly for input_quant='group'; got "
                f"input_quant={self.input_quant!r}, input_group_size={self.input_group_size!r}"
            )
        routes = [route for route, _ in self.disabled]
        for route in routes:
            if route not in _SWITCHABLE:
                raise ValueError(
                    f"{where}: disabled routes must be among {_SWITCHABLE}, got {route!r}"
                )
        if len(set(routes)) != len(routes):
            raise ValueError(f"{where}: disabled names a route more than once: {routes}")


@checked_record
class FP8RouteChoice(NamedTuple):
    """The route for a call and, when it is not the fastest candidate, why (``None`` if it is)."""

    route: FP8Route
    reason: str | None


_DEFAULT_TUNING = FP8RouteTuning()


def fp8_scaled_route(
    scale_method: FP8ScaleMethod,
    block_size: tuple[int, int] | None = None,
    input_quant: str | None = None,
    input_group_size: int | None = None,
) -> tuple[ScaledRoute | None, str | None]:
    """The ``scaled_mm`` route (and recipe of ``fp8_small_m``) for a weight layout and the
    module's declared activations, or ``(None, why)`` when no recipe quantizes ``x`` that way.

    Weight-only modules take their layout's route (:data:`SCALED_MM_ROUTE`). Per-token
    activations take ``scaled_mm_rowwise`` (x per row in E4M3; a tensor weight scale broadcast
    to every row), per-token-group ones ``scaled_mm_blockwise`` when the group is the weight's
    block width, per-tensor ones ``scaled_mm_tensorwise`` for a tensor-scaled weight. Static
    per-tensor activations (a stored ``input_scale``) have no route here: the ``scaled_mm`` routes
    compute ``x``'s scale per call, so those modules take ``dequant_matmul`` after
    :func:`floatxq.fp8_activation.static_input_qdq`.

    Numerics: none; a decision.

    Example:
      >>> fp8_scaled_route("tensor", input_quant="token")
      ('scaled_mm_rowwise', None)
    """
    if input_quant is None:
        return SCALED_MM_ROUTE[scale_method], None
    if input_quant == "static":
        return None, (
            "static FP8 activations (a stored input_scale): the scaled_mm routes compute x's "
            "scale per call, so x is quantize-dequantized at input_scale before the decoded weight"
        )
    if input_quant == "token" and scale_method in ("tensor", "row"):
        return "scaled_mm_rowwise", None
    if input_quant == "tensor" and scale_method == "tensor":
        return "scaled_mm_tensorwise", None
    if input_quant == "group" and block_size is not None and input_group_size == block_size[1]:
        return "scaled_mm_blockwise", None
    group = f" of {input_group_size}" if input_group_size is not None else ""
    return None, (
        f"no scaled_mm recipe multiplies {scale_method}-scaled weights by per-{input_quant}"
        f"{group} FP8 activations"
    )


def select_fp8_route(
    facts: FP8RouteFacts, *, tuning: FP8RouteTuning = _DEFAULT_TUNING
) -> FP8RouteChoice:
    """The fastest FP8 route eligible under ``facts``, and why each faster one was skipped.

    "Fastest" is decided per call kind: on CUDA ``fp8_small_m`` where the row count (and graph
    capture) allows it, else the layout's ``scaled_mm`` route; off CUDA ``compiled_cpu`` (opt-in:
    its first call compiles). A switched-off route's own reason is included.

    Args:
      facts: the call's facts.
      tuning: the row thresholds for ``fp8_small_m``.

    Returns:
      ``FP8RouteChoice(route, reason)``, ``reason`` ``None`` exactly for the fastest candidate.

    Numerics: none; a decision (every route computes the product of ``docs/numerics.md``).

    Example:
      >>> facts = FP8RouteFacts(
      ...     device_type="cpu", x_dtype=torch.float32, rows=4, in_features=64,
      ...     out_features=32, format="float8_e4m3fn", scale_method="tensor",
      ... )
      >>> select_fp8_route(facts).route
      'dequant_matmul'
      >>> select_fp8_route(dataclasses.replace(facts, compile_requested=True))
      FP8RouteChoice(route='compiled_cpu', reason=None)
    """
    off = dict(facts.disabled)
    if facts.device_type != "cuda":
        if not facts.compile_requested:
            return FP8RouteChoice(
                "dequant_matmul",
                f"x is on {facts.device_type}: fp8_small_m and the scaled_mm routes need CUDA, "
                f"and compiled_cpu is opt-in (call optimize())",
            )
        why = off.get("compiled_cpu")
        if why is not None:
            return FP8RouteChoice("dequant_matmul", f"compiled_cpu: {why}")
        return FP8RouteChoice("compiled_cpu", None)
    route, no_recipe = fp8_scaled_route(
        facts.scale_method, facts.block_size, facts.input_quant, facts.input_group_size
    )
    if route is None:
        return FP8RouteChoice("dequant_matmul", f"scaled_mm and fp8_small_m: {no_recipe}")
    scaled = route
    small = facts.rows <= tuning.small_m_limit(scaled, capturing=facts.capturing)
    why = _scaled_mm_gate(facts, scaled) or off.get(scaled)
    if why is not None:
        skipped = f"{scaled} (and fp8_small_m, which takes its recipe)" if small else scaled
        return FP8RouteChoice("dequant_matmul", f"{skipped}: {why}")
    if not small:
        return FP8RouteChoice(scaled, None)
    why = facts.small_m_unavailable or off.get("fp8_small_m")
    if why is not None:
        return FP8RouteChoice(scaled, f"fp8_small_m: {why}")
    return FP8RouteChoice("fp8_small_m", None)


def _scaled_mm_gate(facts: FP8RouteFacts, route: ScaledRoute) -> str | None:
    """Why ``route`` cannot multiply this weight and ``x`` here (torch, format, dtype, shape,
    capability), or ``None``."""
    name = facts.format
    if not facts.has_scaled_mm:
        return f"this torch {torch.__version__} has no torch._scaled_mm"
    if name in FP8_DECODE_ONLY_FORMATS:
        return f"{name} is decode-only: no scaled_mm takes it"
    if name not in _SCALED_MM_FORMATS:
        return f"{name} has no scaled_mm on CUDA (the fnuz formats are ROCm's)"
    if facts.x_dtype not in _HALF_DTYPES:
        return f"x is {facts.x_dtype}: the scaled_mm routes take float16/bfloat16 inputs"
    n, k = facts.out_features, facts.in_features
    if n == 0 or k == 0 or n % _SCALED_MM_ALIGN or k % _SCALED_MM_ALIGN:
        return (
            f"weight ({n}, {k}): scaled_mm needs in_features and out_features to be positive "
            f"multiples of {_SCALED_MM_ALIGN}"
        )
    cap = typing.cast(tuple[int, int], facts.capability)  # given on CUDA (checked)
    sm = f"SM {cap[0]}.{cap[1]}"
    if route == "scaled_mm_tensorwise":
        if cap < _TENSORWISE_MIN_CAPABILITY:
            return f"{sm} < 8.9: no FP8 tensor cores for tensorwise scaled_mm"
        if name == "float8_e5m2":
            return (
                "float8_e5m2 weight: the tensorwise route quantizes x to the weight's format, "
                "and scaled_mm cannot multiply two e5m2 operands"
            )
        return None
    if route == "scaled_mm_rowwise":
        if cap < _ROWWISE_MIN_CAPABILITY:
            return f"{sm} < 9.0: rowwise scaled_mm needs Hopper or newer"
        return None
    if facts.block_size != _BLOCKWISE_BLOCK:
        return (
            f"block size {list(facts.block_size or ())}: the blockwise scaled_mm route takes "
            f"[128, 128] blocks only"
        )
    if cap[0] != _BLOCKWISE_MAJOR:
        return f"{sm}: torch's blockwise (1x128 x 128x128) scaled_mm runs on SM 9.x only"
    if name != "float8_e4m3fn":
        return f"{name} weight: blockwise scaled_mm takes float8_e4m3fn only"
    if not facts.has_blockwise_scaled_mm:
        return f"this torch {torch.__version__} has no torch.nn.functional.scaled_mm"
    return None


MLX_ENCODER_MIN_ELEMENTS = 60 * 2**20
"""CPU weights at least this large are encoded by MLX's Metal encoder on Apple Silicon."""


def _apple_silicon() -> bool:
    return (platform.system(), platform.machine()) == ("Darwin", "arm64")


def mlx_encoder_reason(weight: torch.Tensor) -> str | None:
    """Why the MLX (Metal) encoder does not take ``weight`` (``None``: it does)."""
    if weight.device.type not in ("cpu", "mps") or not _apple_silicon():
        return "not a CPU/MPS weight on Apple Silicon"
    if weight.numel() < MLX_ENCODER_MIN_ELEMENTS:
        return f"fewer than {MLX_ENCODER_MIN_ELEMENTS} elements"
    try:
        from floatxq.mlx import kernels as mlx_kernels
    except ImportError:
        return "MLX is not installed"
    if not mlx_kernels.metal_available():
        return "MLX has no Metal backend"
    return None


def quantize_fp8_weight_auto(
    weight: Float[Tensor, "out in"],
    *,
    format: str | torch.dtype = "float8_e4m3fn",
    weight_scale_method: FP8ScaleMethod | None = "row",
    weight_block_size: tuple[int, int] | list[int] | None = None,
) -> tuple[FP8Weight, str, str | None]:
    """:func:`floatxq.quantize_fp8_weight` through the Triton kernel where it runs, else in torch.

    Args:
      weight, format, weight_scale_method, weight_block_size: as ``quantize_fp8_weight``.

    Returns:
      ``(FP8Weight, route, reason)``: ``route`` is ``"triton"`` (CUDA tensor, Triton imports),
      ``"mlx"`` (a CPU or MPS weight of at least ``MLX_ENCODER_MIN_ELEMENTS`` elements on Apple
      Silicon with MLX's Metal backend; results on the CPU) or ``"torch"``
      (:func:`~floatxq.fp8_bands.quantize_fp8_weight_banded`: a band of rows at a time, so its
      FP32 temporaries stay a few MiB); ``reason`` says why the kernel was not taken (``None``
      when it was). All routes give the same bytes.

    Raises:
      ValueError, TypeError: as :func:`floatxq.quantize_fp8_weight`.

    Numerics: identical bytes on every route (the kernel's tests prove it on fuzzed shapes).

    Example:
      >>> q, route, reason = quantize_fp8_weight_auto(torch.ones(2, 2))
      >>> route, q.scale_inv.tolist()
      ('torch', [448.0, 448.0])
    """
    kwargs = dict(
        format=format,
        weight_scale_method=weight_scale_method,
        weight_block_size=weight_block_size,
    )
    if not isinstance(weight, torch.Tensor):
        return quantize_fp8_weight(weight, **kwargs), "torch", "weight is not a tensor"
    if weight.device.type != "cuda":
        if mlx_encoder_reason(weight) is None:
            from floatxq.mlx.fp8 import quantize_fp8_weight_torch_via_mlx

            return quantize_fp8_weight_torch_via_mlx(weight, **kwargs), "mlx", None
        reason = f"weight is on {weight.device}; the Triton kernel runs on CUDA tensors"
    else:
        reason = triton_unavailable_reason(weight.device)
    if reason is None:
        from floatxq.kernels.fp8_weight import quantize_fp8_weight_kernel

        return quantize_fp8_weight_kernel(weight, **kwargs), "triton", None
    return quantize_fp8_weight_banded(weight, **kwargs), "torch", reason
