"""Every route choice in one place: torch, Triton, cuBLAS or Metal, each with its reason.

A route choice is a pure function of facts (device, dtype, shape, capability, what the torch and
Triton installs provide) returning ``(route, reason)``: ``reason`` is ``None`` exactly when the
fastest candidate was taken, else it names each faster route skipped and why. Kernel
availability (``*_unavailable_reason``) stays in :mod:`floatxq.kernels` as facts; the modules in
:mod:`floatxq.nn` gather facts, ask here, and run the answer. A model's preferences are one
frozen :class:`RoutePreference` record (no per-module route setters).

FP8 linear routes, fastest first (:func:`select_fp8_route`): ``fp8_small_m`` (fused Triton
kernel), ``scaled_mm_tensorwise`` / ``_rowwise`` / ``_blockwise`` (cuBLAS), ``compiled_cpu``
(opt-in), ``dequant_matmul`` (everywhere). Numerics of every route: ``docs/numerics.md``.
"""

import dataclasses
import functools
import importlib.util
import platform
import typing
from collections.abc import Callable, Mapping
from typing import Literal, NamedTuple

import torch
import torch.nn.functional as F

from floatxq._typing import Float, Tensor, checked_record
from floatxq.formats import (
    FP8_DECODE_ONLY_FORMATS,
    FP8_FORMATS,
    FP8_SCALE_METHODS,
    MODEL_DTYPES,
    FP8Format,
    FP8ScaleMethod,
    NVFP4RecipeName,
    W4AActivationMode,
)
from floatxq.fp8 import FP8Weight, quantize_fp8_weight
from floatxq.kernels._triton import (
    capability_shortfall,
    triton_interpret_enabled,
    triton_unavailable_reason,
)
from floatxq.w4a import activation as _activation
from floatxq.w4a.activation import W4AActivation
from floatxq.w4a.linear import w4a_nvfp4_accumulate_group

__all__ = [
    "FP4_DECODE_ROUTES",
    "GPTQ_DECODE_ROUTE",
    "MLX_ENCODER_MIN_ELEMENTS",
    "ROUTES",
    "W4A_FP8_ROUTES",
    "W4A_NVFP4_ROUTES",
    "FP8RouteChoice",
    "FP8RouteFacts",
    "FP8RouteTuning",
    "RoutePreference",
    "fp4_decode_route",
    "fp8_pack_reason",
    "gptq_route",
    "mlx_encoder_reason",
    "nvfp4_accumulator",
    "nvfp4_pack_reason",
    "pack_activation",
    "quantize_fp8_weight_auto",
    "select_fp8_route",
    "stream_pack_reason",
    "torchao_missing",
    "w4a_fp8_carrier_route",
    "w4a_fp8_route",
    "w4a_nvfp4_native_unavailable_reason",
    "w4a_nvfp4_route",
]

# ----------------------------------------------------------------------------------------------
# FP8 linear (TorchFP8Linear)
# ----------------------------------------------------------------------------------------------

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
    scaled = SCALED_MM_ROUTE[facts.scale_method]
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


# ----------------------------------------------------------------------------------------------
# The preference record
# ----------------------------------------------------------------------------------------------

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


# ----------------------------------------------------------------------------------------------
# Weight-only decodes (TorchFP4Linear, GPTQLinear)
# ----------------------------------------------------------------------------------------------

FP4_DECODE_ROUTES = ("dequant_matmul", "triton_decode", "torchao_nvfp4")
"""Routes of ``TorchFP4Linear``: the pure decode, the Triton decode, torchao's NVFP4Tensor."""
GPTQ_DECODE_ROUTE = "dequant_matmul"


@functools.cache
def torchao_missing() -> str | None:
    """Why torchao cannot be used (``None`` when it is installed)."""
    if importlib.util.find_spec("torchao") is None:
        return "torchao is not installed"
    return None


def fp4_decode_route(device: torch.device, dtype: torch.dtype) -> tuple[str, str | None]:
    """``(route, reason)`` of a CUDA call's NVFP4 weight decode: ``"triton_decode"`` where the
    kernel runs for ``dtype`` (``reason`` None), else ``"dequant_matmul"`` and why not.

    Example:
      >>> fp4_decode_route(torch.device("cuda"), torch.float64)[0]
      'dequant_matmul'
    """
    if dtype not in MODEL_DTYPES:
        return "dequant_matmul", f"it writes float16, bfloat16 or float32, not {dtype}"
    reason = triton_unavailable_reason(device)
    return ("triton_decode", None) if reason is None else ("dequant_matmul", reason)


def gptq_route(device: torch.device, dtype: torch.dtype, rows: int) -> tuple[str, str | None]:
    """``(route, reason)`` of a ``GPTQLinear`` call of ``rows`` rows: ``"w4a16_fused"`` or
    ``"w4a16_decode_gemm"`` (the W4A16 kernels, by row count) where Triton runs on CUDA for
    ``dtype``, else ``"dequant_matmul"`` and why not the kernels.

    Example:
      >>> gptq_route(torch.device("cpu"), torch.float16, 4)
      ('dequant_matmul', 'x is on cpu; the W4A16 kernels run on CUDA')
    """
    from floatxq.kernels.w4a16 import w4a16_route

    if device.type != "cuda":
        return GPTQ_DECODE_ROUTE, f"x is on {device}; the W4A16 kernels run on CUDA"
    if dtype not in _HALF_DTYPES:
        return GPTQ_DECODE_ROUTE, f"x is {dtype}; the W4A16 kernels take float16/bfloat16"
    reason = triton_unavailable_reason(device)
    if reason is not None:
        return GPTQ_DECODE_ROUTE, reason
    return w4a16_route(rows), None


# ----------------------------------------------------------------------------------------------
# W4A GEMMs (W4AFP8Linear, W4ANVFP4Linear)
# ----------------------------------------------------------------------------------------------

_NATIVE_MIN_CAPABILITY = (12, 1)


def _w4a_fp8_unavailable(device: torch.device) -> str | None:
    """The W4A-FP8 kernels' own reason they cannot run on ``device``, or why they do not
    import."""
    try:
        from floatxq.kernels.w4a_fp8 import w4a_fp8_unavailable_reason
    except ImportError as exc:  # pragma: no cover - the kernels ship with floatxq
        return f"floatxq.kernels.w4a_fp8 does not import ({exc})"
    return w4a_fp8_unavailable_reason(device)


def _nvfp4_emulation_unavailable(device: torch.device) -> str | None:
    """The NVFP4 emulation kernels' own reason they cannot run on ``device``, or why they do
    not import."""
    try:
        from floatxq.kernels.nvfp4 import nvfp4_unavailable_reason
    except ImportError as exc:
        return f"floatxq.kernels.nvfp4 does not import ({exc})"
    return nvfp4_unavailable_reason(device)


def w4a_fp8_route(requested: str, device: torch.device) -> tuple[str, str | None]:
    """The W4A-FP8 route a call on ``device`` takes, and why the kernels were not taken.

    Args:
      requested: ``"auto"``, ``"triton"`` or ``"reference"``.
      device: where the call's tensors are.

    Returns:
      ``("triton", None)`` where the kernels run (``"auto"`` or ``"triton"``), else
      ``("reference", why)``.

    Raises:
      ValueError: an unknown ``requested``.
      RuntimeError: ``"triton"`` requested where the kernels cannot run (the reason named).

    Example:
      >>> w4a_fp8_route("reference", torch.device("cpu"))
      ('reference', "route='reference' was requested")
    """
    if requested not in W4A_FP8_ROUTES:
        raise ValueError(f"W4AFP8Linear: route must be one of {W4A_FP8_ROUTES}, got {requested!r}")
    if requested == "reference":
        return "reference", "route='reference' was requested"
    reason = _w4a_fp8_unavailable(device)
    if reason is None:
        return "triton", None
    if requested == "triton":
        raise RuntimeError(f"W4AFP8Linear: route='triton' cannot run on {device}: {reason}")
    return "reference", reason


def w4a_fp8_carrier_route(requested: str, device: torch.device) -> tuple[str, str | None]:
    """The route of an FP8 carrier through ``W4ANVFP4Linear`` (``requested`` its NVFP4 route):
    ``"fp8_triton"`` where the W4A-FP8 kernels run and ``"reference"`` was not requested, else
    ``"fp8_reference"`` and why.

    Example:
      >>> w4a_fp8_carrier_route("reference", torch.device("cpu"))
      ('fp8_reference', "route='reference' was requested")
    """
    if requested == "reference":
        return "fp8_reference", "route='reference' was requested"
    reason = _w4a_fp8_unavailable(device)
    return ("fp8_triton", None) if reason is None else ("fp8_reference", reason)


def w4a_nvfp4_native_unavailable_reason(device: torch.device) -> str | None:
    """Why the native FP4 tensor-core route cannot run on ``device``'s tensors, or ``None``.

    It needs a torch with ``torch.float4_e2m1fn_x2``, ``F.scaled_mm``,
    ``F.ScalingType.BlockWise1x16`` and ``F.SwizzleType.SWIZZLE_32_4_4``, and a CUDA device of
    compute capability 12.1 or newer.

    Example:
      >>> w4a_nvfp4_native_unavailable_reason(torch.device("cpu")) is not None
      True
    """
    scaling = getattr(F, "ScalingType", None)
    swizzle = getattr(F, "SwizzleType", None)
    needs = (
        ("torch.float4_e2m1fn_x2", hasattr(torch, "float4_e2m1fn_x2")),
        ("F.scaled_mm", hasattr(F, "scaled_mm")),
        ("F.ScalingType.BlockWise1x16", hasattr(scaling, "BlockWise1x16")),
        ("F.SwizzleType.SWIZZLE_32_4_4", hasattr(swizzle, "SWIZZLE_32_4_4")),
    )
    missing = [name for name, present in needs if not present]
    if missing:
        return f"torch {torch.__version__} has no {', '.join(missing)}"
    if device.type != "cuda":
        return f"the tensors are on {device}; the FP4 tensor cores need a CUDA device"
    return capability_shortfall(
        device, _NATIVE_MIN_CAPABILITY, need="no FP4 tensor cores for F.scaled_mm's NVFP4 GEMM"
    )


def w4a_nvfp4_route(
    requested: str, device: torch.device, *, planes_staged: bool = True
) -> tuple[str, str | None]:
    """The W4A-NVFP4 route a call on ``device`` takes, and why the native route was not taken.

    Args:
      requested: ``"auto"``, ``"native"``, ``"emulation"`` or ``"reference"``.
      device: where the call's tensors are.
      planes_staged: whether the native weight operand is staged; ``"auto"`` passes over the
        native route without it.

    Returns:
      ``("native", None)`` where the FP4 tensor cores run; else ``("emulation", why)`` where the
      Triton emulation runs; else ``("reference", why)``. A forced route is taken or refused.

    Raises:
      ValueError: an unknown ``requested``.
      RuntimeError: ``"native"`` or ``"emulation"`` requested where it cannot run (the reason
        named), or ``"native"`` without the staged planes (call ``post_init()`` on the device).

    Example:
      >>> w4a_nvfp4_route("reference", torch.device("cpu"))
      ('reference', "route='reference' was requested")
    """
    where = "W4ANVFP4Linear"
    if requested not in W4A_NVFP4_ROUTES:
        raise ValueError(f"{where}: route must be one of {W4A_NVFP4_ROUTES}, got {requested!r}")
    if requested == "reference":
        return "reference", "route='reference' was requested"
    if requested == "emulation":
        why = _nvfp4_emulation_unavailable(device)
        if why is not None:
            raise RuntimeError(f"{where}: route='emulation' cannot run on {device}: {why}")
        return "emulation", "route='emulation' was requested"
    native = w4a_nvfp4_native_unavailable_reason(device)
    if requested == "native":
        if native is not None:
            raise RuntimeError(f"{where}: route='native' cannot run on {device}: {native}")
        if not planes_staged:
            raise RuntimeError(
                f"{where}: the native weight cache is absent; call post_init() (after moving "
                f"the module to {device})"
            )
        return "native", None
    if native is None and not planes_staged:
        native = "the FP4 weight planes are not staged (call post_init() on this device)"
    if native is None:
        return "native", None
    emulation = _nvfp4_emulation_unavailable(device)
    if emulation is None:
        return "emulation", f"native: {native}"
    return "reference", f"native: {native}; emulation: {emulation}"


def nvfp4_accumulator(device: torch.device) -> Callable[..., Tensor]:
    """The W4A-NVFP4 group-accumulation step: the Triton kernel where it runs on ``device``,
    else the pure :func:`floatxq.w4a_nvfp4_accumulate_group` (the same FP32 operations in the
    same order)."""
    try:
        from floatxq.kernels.nvfp4_decoding import nvfp4_accumulate_group
    except ImportError:  # pragma: no cover - the kernels ship with floatxq
        return w4a_nvfp4_accumulate_group
    if triton_unavailable_reason(device) is not None:
        return w4a_nvfp4_accumulate_group
    return nvfp4_accumulate_group


# ----------------------------------------------------------------------------------------------
# Packing activations, encoding FP8 weights
# ----------------------------------------------------------------------------------------------


def fp8_pack_reason(x2: Tensor) -> str | None:
    """Why the Triton ``fp8_pack`` is not taken for ``x2``, or None when it is."""
    if x2.dtype not in MODEL_DTYPES:
        return f"x is {x2.dtype}; the kernel reads float16, bfloat16 or float32"
    if x2.device.type != "cuda" and not triton_interpret_enabled():
        return f"x is on {x2.device}; the kernel runs on CUDA tensors (or TRITON_INTERPRET=1)"
    return _w4a_fp8_unavailable(x2.device)


def nvfp4_pack_reason(x2: Tensor) -> str | None:
    """Why the Triton ``nvfp4_pack_and_swizzle`` is not taken for ``x2``, or None when it is."""
    if x2.dtype not in MODEL_DTYPES:
        return f"x is {x2.dtype}; the kernel reads float16, bfloat16 or float32"
    if x2.device.type != "cuda":
        return f"x is on {x2.device}; the packer kernel runs on CUDA tensors"
    return _nvfp4_emulation_unavailable(x2.device)


def stream_pack_reason(device: torch.device, mode: W4AActivationMode) -> str | None:
    """Why an activation stream does not pack on ``device`` through the Triton packers with a
    device-side global scale (None: it does). CUDA only: elsewhere (``TRITON_INTERPRET=1``
    included) the stream packs through the checked :func:`pack_activation`."""
    if device.type != "cuda":
        return f"the tensors are on {device}"
    return (_w4a_fp8_unavailable if mode == "w4afp8" else _nvfp4_emulation_unavailable)(device)


def _pack_fp8(x2: Tensor) -> tuple[Tensor, Tensor]:
    if fp8_pack_reason(x2) is None:
        from floatxq.kernels.w4a_fp8 import fp8_pack

        return fp8_pack(x2)
    return _activation.pack_fp8_tokens(x2)


def _pack_nvfp4(x2: Tensor, x32: Tensor, g: Tensor, recipe: str) -> tuple[Tensor, Tensor]:
    if nvfp4_pack_reason(x2) is None:  # the Triton packer: the same bytes in one launch
        from floatxq.kernels.nvfp4 import nvfp4_pack_and_swizzle

        return nvfp4_pack_and_swizzle(x2, g, recipe=recipe)
    return _activation.pack_nvfp4_blocks(x2, x32, g, recipe)


def pack_activation(
    x: Float[Tensor, "*lead k"],
    mode: W4AActivationMode,
    *,
    global_scale: Float[Tensor, "*one"] | float | None = None,
    model_dtype: torch.dtype | None = None,
    recipe: NVFP4RecipeName | None = None,
    reference: Float[Tensor, "*lead k"] | None = None,
) -> W4AActivation:
    """:func:`floatxq.w4a.activation.pack_activation` through the Triton packers where they run.

    FP8 through ``fp8_pack`` on CUDA (or under ``TRITON_INTERPRET=1``); NVFP4 through
    ``nvfp4_pack_and_swizzle`` on CUDA; else the pure functions. Same arguments, checks and
    bytes as the pure function (the kernels' tests prove the bytes equal).

    Numerics: as :func:`floatxq.w4a.activation.pack_activation`.

    Example:
      >>> a = pack_activation(torch.full((1, 128), 3.0), "w4a_nvfp4", global_scale=1.0)
      >>> a.codes.shape, a.scales.shape, a.recipe
      (torch.Size([1, 64]), torch.Size([1, 1024]), 'least_squares')
    """
    return _activation.pack_activation_with(
        x, mode, global_scale=global_scale, model_dtype=model_dtype, recipe=recipe,
        reference=reference, fp8_packer=_pack_fp8,
        nvfp4_packer=_pack_nvfp4,
    )  # fmt: skip


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
      Silicon with MLX's Metal backend; results on the CPU) or ``"torch"``; ``reason`` says why
      the kernel was not taken (``None`` when it was). All routes give the same bytes.

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
    return quantize_fp8_weight(weight, **kwargs), "torch", reason
