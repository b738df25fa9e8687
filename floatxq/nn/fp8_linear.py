"""``TorchFP8Linear``: FP8 weight codes with FP32 inverse scales, multiplied by the fastest route.

The buffers are the checkpoint format: ``weight`` (FP8 codes ``(out, in)``, a convolution's
weight flattened), ``weight_scale_inv`` (FP32 inverse scales: ``()``, ``(out,)`` or a block
grid), ``bias`` (FP16 ``(out,)`` or ``None``) and static activations' ``input_scale`` (FP32 ``()``).
They move with ``.to()`` as bytes, never cast (the bias is cast to the output dtype per call);
every other state is a per-device cache, dropped whenever the buffers move or are loaded.

A call flattens ``x`` ``(*, in_features)`` to rows, asks :func:`floatxq.dispatch.select_fp8_route`
for the fastest route its facts allow (cached per device, dtype, row bucket and graph capture),
and runs that route's runner (:mod:`floatxq.kernels.fp8_routes`, built once per dtype).
``last_route`` names the route taken (:data:`floatxq.ROUTES`) and ``last_fallback_reason`` why
the fastest candidate was not (``None`` when it was). A route that raises is switched off for
this module and that input dtype (warned once) and the call takes the next route the policy
gives. Declared FP8 activations (``input_quant``: :mod:`floatxq.fp8_activation`) are
applied on every route; ``last_activations`` says how. Convolutions decode the weight and
convolve (``conv_dequant``, :mod:`floatxq.nn.conv`); the LoRA hook ``adapter`` runs last. What
each route computes: ``docs/numerics.md``.
"""

import dataclasses
import functools
import math
import typing
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from floatxq._checks import (
    check_fp8_operands,
    check_size,
    fp8_scale_shape,
    fp8_state_problems,
    fp16_bias,
    stored_fp8_scale,
)
from floatxq._typing import Float, FP8Dtype, Tensor
from floatxq.dispatch import (
    SCALED_MM_ROUTE,
    FP8RouteChoice,
    FP8RouteFacts,
    FP8RouteTuning,
    RoutePreference,
    fp8_scaled_route,
    quantize_fp8_weight_auto,
    select_fp8_route,
)
from floatxq.formats import (
    fp8_dtype,
    normalize_fp8_block_size,
    normalize_fp8_format,
    normalize_fp8_scale_method,
)
from floatxq.fp8 import dequantize_fp8_weight, infer_scale_layout
from floatxq.fp8_activation import (
    WEIGHT_ONLY_ROUTES,
    FP8InputQuant,
    checked_input_quant,
    checked_static_scale,
    describe_x,
    input_qdq,
)
from floatxq.kernels import fp8_routes, triton_unavailable_reason
from floatxq.nn._bytes import ByteBuffers
from floatxq.nn._preference import RoutePreferenceHolder
from floatxq.nn.conv import ConvGeometry, conv_forward, weight_matrix

__all__ = ["TorchFP8Linear"]


@functools.cache
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def _device_capability(device: torch.device) -> tuple[int, int]:
    return _capability(device.index if device.index is not None else torch.cuda.current_device())


class _Runtime:
    """Per-placement caches and route switches; rebuilt whenever the buffers move or are loaded."""

    __slots__ = ("choices", "compiled", "disabled", "prepared", "runners", "warned")

    def __init__(self) -> None:
        self.choices: dict[tuple[torch.device, torch.dtype, int, bool], FP8RouteChoice] = {}
        """The policy's answer by (device, dtype, row bucket, capturing)."""
        self.runners: dict[tuple[str, torch.dtype], tuple[fp8_routes.Runner, tuple]] = {}
        """A route's runner for a dtype, and the buffers it bound (rebuilt when one of them is
        replaced)."""
        self.prepared: dict[Any, Tensor] = {}
        """Weight-side operands (direct scales, the bias in a dtype), computed once."""
        self.disabled: dict[tuple[str, torch.dtype | None], str] = {}
        """Routes switched off, by (route, x dtype; ``None`` for every dtype), with why."""
        self.compiled: Callable[..., Tensor] | None = None
        self.warned: set[tuple[str, torch.dtype | None]] = set()

    def switch_off(self, route: str, dtype: torch.dtype | None, why: str) -> None:
        """Switch ``route`` off for ``dtype`` inputs (the cached choices are dropped)."""
        self.disabled[(route, dtype)] = why
        self.choices.clear()


class TorchFP8Linear(ByteBuffers, RoutePreferenceHolder, nn.Module):
    """A linear layer (or a flattened convolution) whose weight is FP8 with FP32 inverse scales.

    The constructor allocates the stored buffers (zeros / ones) for ``load_state_dict`` to fill;
    the module docstring has the buffers, the routes and the ``.to()`` policy.

    Args:
      in_features, out_features: the weight's ``(out, in)`` shape (non-negative ints).
      bias: allocate an FP16 bias buffer.
      format: FP8 name/alias/dtype of the codes (``float8_e8m0fnu`` is accepted for decode-only
        checkpoints; quantizing to it is not).
      weight_scale_method: ``"tensor"``, ``"row"`` or ``"block"`` (``None``: by block size).
      weight_block_size: ``[block_rows, block_cols]`` for ``"block"``; must divide the shape.
      device: where the buffers live.
      input_quant: declared E4M3 activations (``"token"``, ``"tensor"``, ``"group:<size>"``,
        ``"static"``: an ``input_scale`` buffer, 1.0 until loaded) or ``None`` (weight-only).

    Raises:
      ValueError: bad names, negative sizes, a block size (or an ``input_quant`` group) that does
        not divide the shape. TypeError: non-integer sizes.

    Numerics: decode is ``float32(code) / scale_inv`` rounded once to ``x.dtype``; the
    ``scaled_mm`` and ``fp8_small_m`` routes also round ``x`` to FP8 (weight formula) and
    accumulate in FP32; ``docs/numerics.md`` bounds each route against the decoded reference.
    Static activations: ``static_input_qdq(x, input_scale)``, then the decoded weight.

    Example:
      >>> layer = TorchFP8Linear.from_linear(nn.Linear(64, 32))
      >>> layer(torch.randn(4, 64)).shape, layer.last_route
      (torch.Size([4, 32]), 'dequant_matmul')
      >>> print(layer.last_fallback_reason)  # doctest: +NORMALIZE_WHITESPACE
      x is on cpu: fp8_small_m and the scaled_mm routes need CUDA, and compiled_cpu is opt-in
      (call optimize())
    """

    weight: Tensor
    weight_scale_inv: Tensor
    bias: Tensor | None
    input_scale: Tensor | None
    adapter: Callable[[Tensor, Tensor], Tensor] | None
    """LoRA hook: ``out = adapter(x_flat, out)`` after the bias (``None``: no adapter)."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        bias: bool = True,
        format: str | torch.dtype = "float8_e4m3fn",
        weight_scale_method: str | None = "row",
        weight_block_size: Sequence[int] | None = None,
        device: torch.device | str | None = None,
        input_quant: FP8InputQuant | str | None = None,
    ) -> None:
        super().__init__()
        where = "TorchFP8Linear"
        for arg, value in (("in_features", in_features), ("out_features", out_features)):
            check_size(value, name=arg, where=where)
        name = normalize_fp8_format(format)
        block = normalize_fp8_block_size(weight_block_size)
        method = normalize_fp8_scale_method(weight_scale_method, weight_block_size=block)
        scale_shape = fp8_scale_shape(out_features, in_features, method, block, where=where)
        self.in_features = in_features
        self.out_features = out_features
        self.format = name
        self.weight_scale_method = method
        self.weight_block_size = block
        self.conv: ConvGeometry | None = None
        self._input_quant: FP8InputQuant | None = None
        codes = torch.zeros((out_features, in_features), dtype=torch.uint8, device=device)
        self.register_buffer("weight", codes.view(fp8_dtype(name)))
        self.register_buffer(
            "weight_scale_inv", torch.ones(scale_shape, dtype=torch.float32, device=device)
        )
        fp16 = torch.zeros(out_features, dtype=torch.float16, device=device) if bias else None
        self.register_buffer("bias", fp16)
        quant = checked_input_quant(input_quant, in_features=in_features, conv=False)
        static = quant is not None and not quant.dynamic
        one = torch.ones((), dtype=torch.float32, device=device) if static else None
        self.register_buffer("input_scale", one)
        self.input_quant = quant  # type: ignore[assignment]
        self.adapter = None
        self._set_last("none", None)
        self._compile_requested = False
        self._compile_backend = "inductor"
        self.route_preference = RoutePreference()
        self._runtime = _Runtime()

    @classmethod
    def from_linear(
        cls,
        module: nn.Module,
        *,
        format: str | torch.dtype = "float8_e4m3fn",
        weight_scale_method: str | None = "row",
        weight_block_size: Sequence[int] | None = None,
        input_quant: FP8InputQuant | str | None = None,
        input_scale: Float[Tensor, "*one"] | float | None = None,
    ) -> "TorchFP8Linear":
        """Quantize an ``nn.Linear``, a Hugging Face ``Conv1D`` or an ``nn.Conv1d/2d/3d``.

        ``Conv1D`` stores ``(in, out)`` and is transposed; a convolution's weight is flattened to
        ``(out, in/groups·k…)`` and its geometry kept for the forward. The weight is quantized on
        its own device (the Triton kernel on CUDA, else :func:`floatxq.quantize_fp8_weight`: the
        same bytes); the bias becomes FP16.

        Raises:
          TypeError: another module type (transposed convolutions included).
          ValueError: as ``quantize_fp8_weight`` (``input_scale``: as :meth:`from_quantized`),
            or a bias outside FP16's range.

        Numerics: codes and scales bit-identical to ``quantize_fp8_weight(weight_matrix, ...)``.
        """
        matrix, conv = _source_matrix(module, where="from_linear")
        with torch.no_grad():
            q, _, _ = quantize_fp8_weight_auto(
                matrix.detach(),
                format=format,
                weight_scale_method=weight_scale_method,
                weight_block_size=weight_block_size,
            )
        block = normalize_fp8_block_size(weight_block_size)
        method = normalize_fp8_scale_method(weight_scale_method, weight_block_size=block)
        layer = cls.from_quantized(
            q.qweight,
            q.scale_inv,
            getattr(module, "bias", None),
            weight_scale_method=method,
            weight_block_size=block,
            input_quant=input_quant,
            input_scale=input_scale,
        )
        layer.conv = conv
        return layer

    @classmethod
    def empty_like(
        cls,
        module: nn.Module,
        *,
        format: str | torch.dtype = "float8_e4m3fn",
        weight_scale_method: str | None = "row",
        weight_block_size: Sequence[int] | None = None,
        device: torch.device | str | None = None,
        input_quant: FP8InputQuant | str | None = None,
    ) -> "TorchFP8Linear":
        """An unfilled module shaped for ``module`` (convolution geometry included), to load into.

        Numerics: none; buffers are zeros (codes, bias) and ones (scales) until loaded.
        """
        matrix, conv = _source_matrix(module, where="empty_like")
        layer = cls(
            matrix.shape[1],
            matrix.shape[0],
            bias=getattr(module, "bias", None) is not None,
            format=format,
            weight_scale_method=weight_scale_method,
            weight_block_size=weight_block_size,
            device=device if device is not None else matrix.device,
            input_quant=input_quant,
        )
        layer.conv = conv
        return layer

    @classmethod
    def from_quantized(
        cls,
        qweight: FP8Dtype[Tensor, "out in"],
        scale_inv: Float[Tensor, "*scale"],
        bias: Float[Tensor, "out"] | None = None,  # noqa: F821
        *,
        weight_scale_method: str | None = None,
        weight_block_size: Sequence[int] | None = None,
        input_quant: FP8InputQuant | str | None = None,
        input_scale: Float[Tensor, "*one"] | float | None = None,
    ) -> "TorchFP8Linear":
        """Wrap existing FP8 codes and FP32 inverse scales (no copy of the codes when contiguous).

        Args:
          qweight: ``(out, in)`` FP8 codes; the format is its dtype.
          scale_inv: inverse scales (decode: divide), made FP32 on ``qweight``'s device; the
            layout is ``weight_scale_method`` / ``weight_block_size`` when given (the shape must
            fit), else :func:`floatxq.infer_scale_layout`'s.
          bias: ``(out,)`` floating, stored FP16 (finite, within ±65504), or ``None``.
          input_quant: the declared activations, as the constructor takes them.
          input_scale: the static activation scale (decode multiplier), for ``"static"`` only.

        Raises:
          TypeError: non-FP8 codes, non-floating scales or bias.
          ValueError: shapes that fit no layout, scales (``input_scale`` too) not finite and > 0,
            a bias outside FP16's range, ``input_scale`` missing for or given without static.

        Numerics: scales (``input_scale`` too) widened to FP32 exactly; codes untouched.
        """
        where = "TorchFP8Linear.from_quantized"
        check_fp8_operands(qweight, scale_inv, where=where)
        out_features, in_features = qweight.shape
        block = normalize_fp8_block_size(weight_block_size)
        if weight_scale_method is None and block is None:
            method, block = infer_scale_layout(qweight.shape, scale_inv.shape)
        else:
            method = normalize_fp8_scale_method(weight_scale_method, weight_block_size=block)
        scale = stored_fp8_scale(scale_inv, qweight, method, block, where=where)
        device = qweight.device
        stored_bias = None if bias is None else fp16_bias(bias, out_features, device, where=where)
        static = checked_static_scale(input_quant, input_scale, device, where=where)
        layer = cls(
            in_features,
            out_features,
            bias=bias is not None,
            format=qweight.dtype,
            weight_scale_method=method,
            weight_block_size=block,
            device="meta",
            input_quant=input_quant,
        )
        layer.weight = qweight.detach().contiguous()
        layer.weight_scale_inv = scale
        if stored_bias is not None:
            layer.bias = stored_bias
        if static is not None:
            layer.input_scale = static
        return layer

    def use_static_input(self, input_scale: Float[Tensor, "*one"] | float) -> "TorchFP8Linear":
        """Static FP8 activations at ``input_scale`` (e.g. ``amax / 448``; finite, > 0)."""
        checked_input_quant("static", in_features=self.in_features, conv=bool(self.conv))
        where, device = "TorchFP8Linear.use_static_input", self.weight.device
        self.input_scale = checked_static_scale("static", input_scale, device, where=where)
        self.input_quant = "static"  # type: ignore[assignment]
        return self

    def _byte_buffer_names(self) -> tuple[str, ...]:
        return ("weight", "weight_scale_inv", "bias", "input_scale")

    def _applied(self, fn: Callable[[Tensor], Tensor]) -> None:
        self._runtime = _Runtime()

    def __getstate__(self) -> dict[str, Any]:  # (a copy's runners must bind its own tensors)
        return {**super().__getstate__(), "_runtime": _Runtime()}

    def _incoming(
        self, state_dict: dict[str, Any], prefix: str, error_msgs: list[str]
    ) -> tuple[dict[str, Any], list[str]]:
        # checked once here, so the forward routes need no per-call check (or host sync)
        bias, scale = self.bias is not None, self.input_scale is not None
        replaced, problems = fp8_state_problems(
            state_dict, prefix, self.weight.dtype, self.out_features, bias=bias, input_scale=scale
        )
        error_msgs.extend(message for _, message in problems)
        return replaced, [key for key, _ in problems]

    def _loaded(self, prefix: str, missing_keys: list[str]) -> None:
        # load_state_dict(assign=True) puts the incoming tensors in place: restore the format.
        if self.bias is not None and self.bias.dtype != torch.float16:
            self._buffers["bias"] = self.bias.to(torch.float16)
        if self.weight_scale_inv.dtype != torch.float32:
            self._buffers["weight_scale_inv"] = self.weight_scale_inv.to(torch.float32)
        self._runtime = _Runtime()  # (an incoming input_scale was made 0-d FP32 by _incoming)

    def dequantize_weight(self, *, dtype: torch.dtype = torch.float32) -> Float[Tensor, "out in"]:
        """The decoded ``(out, in)`` weight (a convolution's flattened weight), in ``dtype``.

        Numerics: ``float32(code) / scale_inv`` (IEEE), one nearest-even rounding to ``dtype``.
        """
        return dequantize_fp8_weight(self.weight, self.weight_scale_inv, dtype=dtype)

    def optimize(self, *, backend: str = "inductor") -> "TorchFP8Linear":
        """Opt in to the compiled CPU forward (``torch.compile`` with ``backend`` of
        decode-and-multiply) for inputs off CUDA; returns ``self``. It compiles on the first
        such call; a failure warns and falls back to ``dequant_matmul`` until ``optimize()`` is
        called again or the buffers move.

        Numerics: the decode-and-multiply of ``dequant_matmul`` (FP32 summation order may differ).
        """
        runtime = self._runtime
        self._compile_requested = True
        self._compile_backend = backend
        runtime.compiled = None
        runtime.disabled.pop(("compiled_cpu", None), None)
        runtime.warned.discard(("compiled_cpu", None))
        runtime.runners = {k: v for k, v in runtime.runners.items() if k[0] != "compiled_cpu"}
        runtime.choices.clear()
        return self

    def _preference_changed(self) -> None:
        if "_runtime" in self.__dict__:  # choices made under the old preferences
            self._runtime.choices.clear()

    @property
    def route_tuning(self) -> FP8RouteTuning:
        """``route_preference.fp8_tuning``: the row thresholds of the route policy."""
        return self.route_preference.fp8_tuning

    @route_tuning.setter
    def route_tuning(self, tuning: FP8RouteTuning) -> None:
        self.route_preference = dataclasses.replace(self.route_preference, fp8_tuning=tuning)

    @property
    def input_quant(self) -> FP8InputQuant | None:
        """The declared E4M3 activations every route applies to ``x`` (``None``: weight-only):
        an :class:`FP8InputQuant`, ``"token"``, ``"tensor"``, ``"group:<size>"``, ``"static"``
        (:meth:`use_static_input` sets it) or ``None``; a change drops the cached routes."""
        return self._input_quant

    @input_quant.setter
    def input_quant(self, value: FP8InputQuant | str | None) -> None:
        quant = checked_input_quant(value, in_features=self.in_features, conv=bool(self.conv))
        if quant is None or quant.dynamic:
            self._buffers["input_scale"] = None
        elif self._buffers.get("input_scale") is None:
            raise ValueError("TorchFP8Linear: input_quant 'static' needs use_static_input(scale)")
        self._input_quant = quant
        strategy, size = (quant.strategy, quant.group_size) if quant else (None, None)
        block = self.weight_block_size if self.weight_scale_method == "block" else None
        route, _ = fp8_scaled_route(self.weight_scale_method, block, strategy, size)
        self._scaled_route = route or SCALED_MM_ROUTE[self.weight_scale_method]
        self._recipe = self._scaled_route.removeprefix("scaled_mm_")
        if "_runtime" in self.__dict__:
            self._runtime = _Runtime()

    def extra_repr(self) -> str:
        block = (
            f", weight_block_size={list(self.weight_block_size)}" if self.weight_block_size else ""
        )
        conv = f", conv{self.conv.dims}d" if self.conv is not None else ""
        quant = f", input_quant={self._input_quant}" if self._input_quant is not None else ""
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"bias={self.bias is not None}, format={self.format}, "
            f"weight_scale_method={self.weight_scale_method}{block}{conv}{quant}"
        )

    @property
    def last_route(self) -> str:
        """The route the last forward took (one of :data:`ROUTES`; ``"none"`` before any call)."""
        return self._last[0]

    @property
    def last_fallback_reason(self) -> str | None:
        """Why the fastest candidate route was not taken for the last call (``None``: it was).

        Names each faster route skipped and why (Triton missing, no CUDA, a capability, format,
        dtype or shape the route does not take, a switch after an error, the opt-in of
        ``compiled_cpu``); see :func:`floatxq.nn.select_fp8_route`.
        """
        return self._last[1]

    @property
    def last_activations(self) -> str:
        """What the last forward did to ``x`` before it met the weight (``"none"`` before any
        call): :func:`floatxq.fp8_activation.describe_x`."""
        return describe_x(self._last[0], self._scaled_route, self._input_quant)

    def _set_last(self, route: str, reason: str | None) -> None:
        self.__dict__["_last"] = (route, reason)  # past nn.Module.__setattr__ (per-call cost)

    def forward(self, x: Float[Tensor, "..."]) -> Float[Tensor, "..."]:
        """``x @ W.T + bias`` (then the adapter) through the fastest eligible route.

        Numerics: see the class docstring; output dtype is ``x.dtype``.
        """
        if not isinstance(x, torch.Tensor) or not x.is_floating_point():
            got = x.dtype if isinstance(x, torch.Tensor) else type(x).__name__
            raise TypeError(f"TorchFP8Linear: x must be a floating tensor, got {got}")
        device = x.device
        if device != self._buffers["weight"].device:
            raise TypeError(
                f"TorchFP8Linear: x is on {device} but the module's buffers are on "
                f"{self.weight.device}; move one of them with .to()"
            )
        if self.conv is not None:
            return self._conv_forward(x)
        if x.ndim == 0 or x.shape[-1] != self.in_features:
            raise ValueError(
                f"TorchFP8Linear: x must have shape (*, {self.in_features}), got {tuple(x.shape)}"
            )
        x_flat = x.reshape(math.prod(x.shape[:-1]), self.in_features)
        out = self._linear(x_flat)
        if self.adapter is not None:
            out = self.adapter(x_flat, out)
        return out.reshape(*x.shape[:-1], self.out_features)

    def _linear(self, x: Tensor) -> Tensor:
        if x.shape[0] == 0:  # no rows: nothing to multiply (and no kernel launched)
            self._set_last("dequant_matmul", "x has no rows")
            return x.new_empty((0, self.out_features))
        while True:  # ends: each failure switches a route off, and dequant_matmul never is
            route, reason = self._choose(x)
            try:
                out = self._runner(route, x.dtype)(x)
            except Exception as exc:
                if route == "dequant_matmul":
                    raise
                self._switch_off(route, x, exc)
                continue
            self._set_last(route, reason)
            return out

    def _choose(self, x: Tensor) -> FP8RouteChoice:
        """The policy's route for ``x``, cached by what it depends on."""
        rows, tuning = x.shape[0], self.route_preference.fp8_tuning
        capturing = False
        if x.is_cuda and tuning.capture_matters(rows, self._scaled_route):
            capturing = torch.cuda.is_current_stream_capturing()
        key = (x.device, x.dtype, min(rows, tuning.small_m_rows + 1), capturing)
        choices = self._runtime.choices
        choice = choices.get(key)
        if choice is None:
            choice = select_fp8_route(self._facts(x, capturing), tuning=tuning)
            quant = self._input_quant
            if quant is not None and choice.reason and choice.route in WEIGHT_ONLY_ROUTES:
                note = f"x is quantize-dequantized {quant.describe()} before the decoded weight"
                choice = FP8RouteChoice(choice.route, f"{choice.reason}; {note}")
            choices[key] = choice
        return choice

    def _facts(self, x: Tensor, capturing: bool) -> FP8RouteFacts:
        """What the route policy needs to know about a call of ``x``, read from this module,
        this torch, the device and the Triton install."""
        device, dtype = x.device, x.dtype
        cuda = device.type == "cuda"
        disabled = {r: why for (r, d), why in self._runtime.disabled.items() if d in (None, dtype)}
        return FP8RouteFacts(
            device_type=device.type,
            capability=_device_capability(device) if cuda else None,
            x_dtype=dtype,
            rows=x.shape[0],
            in_features=self.in_features,
            out_features=self.out_features,
            format=self.format,
            scale_method=self.weight_scale_method,
            block_size=self.weight_block_size,
            small_m_unavailable=triton_unavailable_reason(device) if cuda else None,
            capturing=capturing,
            compile_requested=self._compile_requested,
            disabled=tuple(disabled.items()),
            has_scaled_mm=fp8_routes.scaled_mm_fn() is not None,
            has_blockwise_scaled_mm=fp8_routes.scaled_mm_blockwise_api() is not None,
            input_quant=self._input_quant.strategy if self._input_quant is not None else None,
            input_group_size=self._input_quant.group_size if self._input_quant else None,
        )

    def _switch_off(self, route: str, x: Tensor, exc: Exception) -> None:
        """Switch a route that raised off for ``x``'s dtype (``compiled_cpu``: for every dtype),
        and warn once naming the route the module now takes."""
        dtype = None if route == "compiled_cpu" else x.dtype
        error = f"{type(exc).__name__}: {exc}".strip()
        runtime = self._runtime
        runtime.switch_off(route, dtype, f"disabled after an error ({error})")
        if route == "compiled_cpu":
            runtime.compiled = None
        key = (route, dtype)
        if key not in runtime.warned:
            runtime.warned.add(key)
            fallback = self._choose(x).route
            warnings.warn(
                f"TorchFP8Linear: {route} raised {error}; this module now uses {fallback} for "
                f"{dtype or 'CPU'} inputs (until its buffers move or are reloaded)",
                RuntimeWarning,
                stacklevel=3,
            )

    def _runner(self, route: str, dtype: torch.dtype) -> fp8_routes.Runner:
        """The route's runner for ``dtype`` inputs, its weight-side operands bound once."""
        buffers = self._buffers
        weight, scale, bias = buffers["weight"], buffers["weight_scale_inv"], buffers.get("bias")
        held = buffers.get("input_scale")
        runtime = self._runtime
        entry = runtime.runners.get((route, dtype))
        if entry is not None:
            bound = entry[1]
            if bound[0] is weight and bound[1] is scale and bound[2] is bias and bound[3] is held:
                return entry[0]
            runtime.prepared.clear()  # a buffer was replaced: the cached operands are stale
        runner = self._build(route, dtype)
        runtime.runners[(route, dtype)] = (runner, (weight, scale, bias, held))
        return runner

    def _build(self, route: str, dtype: torch.dtype) -> fp8_routes.Runner:
        """Build ``route``'s runner from this module's buffers (and cached operands)."""
        weight, bias = self.weight, self._bias_as(dtype)
        if route == "fp8_small_m":
            return fp8_routes.small_m_runner(
                weight, self._row_broadcast(self._direct_weight_scale()), bias, recipe=self._recipe
            )
        if route == "scaled_mm_tensorwise":
            return fp8_routes.tensorwise_runner(
                weight, self._direct_weight_scale(), bias, format=self.format, out_dtype=dtype
            )
        if route == "scaled_mm_rowwise":
            scale = self._prepared(
                "rowwise_b",
                lambda: fp8_routes.rowwise_weight_scale(
                    self._row_broadcast(self._direct_weight_scale())
                ),
            )
            return fp8_routes.rowwise_runner(weight, scale, bias, out_dtype=dtype)
        if route == "scaled_mm_blockwise":
            scale = self._prepared(
                "blockwise_b",
                lambda: fp8_routes.blockwise_weight_scale(self._direct_weight_scale()),
            )
            return fp8_routes.blockwise_runner(weight, scale, bias, out_dtype=dtype)
        if route == "compiled_cpu":
            runtime = self._runtime
            if runtime.compiled is None:
                runtime.compiled = fp8_routes.compile_dequant_linear(backend=self._compile_backend)
            runner = fp8_routes.compiled_cpu_runner(
                weight, self.weight_scale_inv, bias, compiled=runtime.compiled
            )
        else:
            runner = fp8_routes.dequant_runner(weight, self.weight_scale_inv, bias)
        quant, input_scale = self._input_quant, self.input_scale
        if quant is None:
            return runner
        return lambda x: runner(input_qdq(x, quant, input_scale))

    def _row_broadcast(self, direct: Tensor) -> Tensor:
        """A tensor weight scale as one scale per row, where the route is rowwise (per-token
        activations on a tensor-scaled weight); else ``direct`` unchanged."""
        if self._recipe != "rowwise" or self.weight_scale_method != "tensor":
            return direct
        return direct.reshape(1).expand(self.out_features).contiguous()

    def _bias_as(self, dtype: torch.dtype) -> Tensor | None:
        """The stored FP16 bias in ``dtype``, cached per placement."""
        if self.bias is None:
            return None
        bias = self.bias
        return self._prepared(("bias", dtype), lambda: bias.to(dtype))

    def _prepared(self, key: Any, build: Callable[[], Tensor]) -> Tensor:
        cached = self._runtime.prepared.get(key)
        if cached is None:
            cached = self._runtime.prepared[key] = build()
        return cached

    def _direct_weight_scale(self) -> Tensor:
        """``1 / weight_scale_inv`` (IEEE division by a tensor), cached per placement."""
        scale_inv = self.weight_scale_inv
        return self._prepared("direct", lambda: fp8_routes.direct_weight_scale(scale_inv))

    def _conv_forward(self, x: Tensor) -> Tensor:
        geometry = typing.cast(ConvGeometry, self.conv)  # forward() only routes convolutions here
        if self._input_quant is not None:
            raise ValueError("TorchFP8Linear: a convolution's activations are not quantized")
        weight = self.dequantize_weight(dtype=x.dtype)
        out = conv_forward(x, weight, self._bias_as(x.dtype), geometry)
        self._set_last(
            "conv_dequant",
            "convolution: no FP8 convolution kernel, the weight is decoded for this call",
        )
        if self.adapter is not None:
            out = self.adapter(x, out)
        return out


def _source_matrix(module: nn.Module, *, where: str) -> tuple[Tensor, ConvGeometry | None]:
    """:func:`floatxq.nn.conv.weight_matrix` of a module that is not already FP8."""
    if isinstance(module, TorchFP8Linear):
        raise TypeError(f"{where}: the module is already a TorchFP8Linear")
    return weight_matrix(module, where=where)
