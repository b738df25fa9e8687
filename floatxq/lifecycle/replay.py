"""The W4A activation stream replayed in FP32, for the GPTQ solve.

A GPTQ solve should see the inputs its linear will read at runtime. With an activation policy
those are rounded: FP8 per token, or NVFP4 blocks. The replay runs the stream's own dataflow
(:mod:`floatxq.lifecycle.stream`) with a codec whose operands are FP32 tensors already rounded
(quantized, then decoded: QDQ), and whose linears compute ``F.linear(x, W, b)`` in FP32 on the
dense weight (before a module's solve) or the dequantized GPTQ weight (after), rounded once to the
model dtype. So the Hessians fold exactly the operands the W4A GEMMs will multiply, and each layer
hands the next what the runtime stream would.

:func:`round_w4a_activation` and :func:`round_w4a_replay_operand` are the rounding itself;
:class:`ReplayOperand` an operand (rounded lazily: a residual boundary's codes are only read by
the fused-norm shortcut); :class:`ReplayCodec` the codec, with observers for the GPTQ passes;
:func:`replay_llama_layer` one layer; :class:`RoundingMemo` lets a layer's passes share the
roundings of operands whose bits did not change.
"""

from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from floatxq._checks import require_data, require_floating
from floatxq._typing import Float, Float32, Tensor
from floatxq.formats import (
    ACTIVATION_SCALE_BITS,
    NVFP4_DEFAULT_RECIPE,
    W4A_ACTIVATION_MODES,
    NVFP4RecipeName,
    W4AActivationMode,
    normalize_nvfp4_recipe,
)
from floatxq.fp8 import fp8_token_qdq
from floatxq.lifecycle.stream.codec import _check_width
from floatxq.lifecycle.stream.llama import _bind_call, _llama_layer_flow, _returns_tuple
from floatxq.lifecycle.stream.plan import StreamLane, StreamLayerPlan
from floatxq.nvfp4.quantize import nvfp4_block_qdq, nvfp4_dynamic_global_scale
from floatxq.w4a.activation import W4AActivation

__all__ = [
    "ReplayCodec",
    "ReplayOperand",
    "RoundingMemo",
    "replay_llama_layer",
    "round_w4a_activation",
    "round_w4a_replay_operand",
]


def _rounding_arguments(
    x: object, mode: object, recipe: object, global_scale: object, *, where: str
) -> str | None:
    """The canonical recipe (None for FP8) after checking the arguments."""
    require_floating(x, name="x", where=where)
    require_data(x, name="x", where=where)
    if not isinstance(mode, str) or mode not in W4A_ACTIVATION_MODES:
        raise ValueError(f"{where}: mode must be one of {W4A_ACTIVATION_MODES}, got {mode!r}")
    if mode == "w4afp8":
        for name, value in (("recipe", recipe), ("global_scale", global_scale)):
            if value is not None:
                raise ValueError(
                    f"{where}: {name} applies to mode 'w4a_nvfp4' only, got {value!r:.40}"
                )
        return None
    return normalize_nvfp4_recipe(NVFP4_DEFAULT_RECIPE if recipe is None else recipe)


def round_w4a_activation(
    x: Float[Tensor, "*lead k"],
    mode: W4AActivationMode,
    *,
    recipe: NVFP4RecipeName | None = None,
    global_scale: Float[Tensor, "*one"] | float | None = None,
) -> Float[Tensor, "*lead k"]:
    """Quantize-dequantize ``x`` as a W4A activation of ``mode``; ``x``'s shape and dtype back.

    Args:
      x: ``(..., K)`` floating, finite.
      mode: ``"w4afp8"`` (per-row E4M3, :func:`floatxq.fp8_token_qdq`) or ``"w4a_nvfp4"``
        (:func:`floatxq.nvfp4_block_qdq`, ``K % 16 == 0``).
      recipe: NVFP4 only (default ``least_squares``; aliases accepted).
      global_scale: NVFP4 only: one positive finite value, or None for the dynamic scale of
        ``max|x|`` on ``x.dtype``'s grid.

    Returns:
      The rounded tensor in ``x``'s dtype.

    Raises:
      ValueError: an unknown mode or recipe; a recipe or global scale with FP8; non-finite
        ``x``; ``K % 16`` (NVFP4); a global scale that is not positive and finite.
      TypeError: a non-floating ``x``.

    Numerics: as the two QDQ functions: one rounding of the decoded FP32 value to ``x.dtype``.

    Example:
      >>> round_w4a_activation(torch.tensor([[1.0] * 15 + [6.0]]), "w4a_nvfp4",
      ...     global_scale=1.0)[0, -2:].tolist()
      [1.0, 6.0]
    """
    recipe = _rounding_arguments(x, mode, recipe, global_scale, where="round_w4a_activation")
    if recipe is None:
        return fp8_token_qdq(x)
    return nvfp4_block_qdq(x, global_scale, recipe)


def round_w4a_replay_operand(
    x: Float[Tensor, "*lead k"],
    mode: W4AActivationMode,
    *,
    recipe: NVFP4RecipeName | None = None,
    global_scale: Float[Tensor, "*one"] | float | None = None,
) -> Float32[Tensor, "*lead k"]:
    """The FP32 value a W4A GEMM multiplies for the activation ``x``: its codes decoded in FP32.

    Unlike :func:`round_w4a_activation` the result is not rounded back to ``x.dtype``: the
    W4A GEMMs read the codes times their scales in FP32. The dynamic NVFP4 global scale is
    still taken on ``x.dtype``'s grid, as the runtime packer takes it.

    Args:
      x, mode, recipe, global_scale: as :func:`round_w4a_activation`.

    Returns:
      An FP32 tensor of ``x``'s shape: ``float32(code) · row_scale`` (FP8) or ``(e2m1 ·
      block_scale) · global_scale`` (NVFP4), equal to the FP32 decode of
      :func:`floatxq.pack_activation`'s carrier (signed zeros aside).

    Raises:
      ValueError, TypeError: as :func:`round_w4a_activation`.

    Numerics: FP8 per row ``amax / 448`` (IEEE division), nearest-even saturating E4M3; NVFP4 as
    :func:`floatxq.nvfp4_block_scales` of ``float32(x)``; the decode products in FP32.

    Example:
      >>> x = torch.tensor([[0.3] * 128], dtype=torch.bfloat16)
      >>> round_w4a_replay_operand(x, "w4afp8").dtype
      torch.float32
    """
    recipe = _rounding_arguments(x, mode, recipe, global_scale, where="round_w4a_replay_operand")
    x32 = x.to(torch.float32)
    if recipe is None:
        return fp8_token_qdq(x32)
    g = nvfp4_dynamic_global_scale(x, recipe=recipe) if global_scale is None else global_scale
    return nvfp4_block_qdq(x32, g, recipe)


class ReplayOperand:
    """One operand of the replayed stream: its un-rounded value, how it is rounded, and the
    exact residual it carries (the replay's counterpart of a :class:`~floatxq.W4AActivation`).

    Rounded lazily, once: :meth:`rounded` is the FP32 value a W4A GEMM reads
    (:func:`round_w4a_replay_operand` of ``raw``, times ``token_scale`` per row).

    Args:
      raw: the tensor the runtime would pack (its dtype sets the dynamic scale's grid).
      lane: the :class:`~floatxq.lifecycle.stream.StreamLane` (mode, recipe).
      global_scale: NVFP4: a fixed FP32 scale, or None for the dynamic one.
      reference: the exact value carried for the residual (or None).
      model_dtype: the dtype the layer's linears return.

    Numerics: as :func:`round_w4a_replay_operand`; a token scale multiplies the FP32 rows.

    Example:
      >>> from floatxq.lifecycle.stream import StreamLane
      >>> op = ReplayOperand(torch.full((1, 128), 3.0), StreamLane("w4afp8", None),
      ...     model_dtype=torch.float32)
      >>> op.rounded()[0, :2].tolist(), op.rescaled(torch.tensor([2.0])).rounded()[0, 0].item()
      ([3.0, 3.0], 6.0)
    """

    __slots__ = ("_base", "global_scale", "lane", "model_dtype", "raw", "reference", "token_scale")

    def __init__(
        self,
        raw: Tensor | None,
        lane: StreamLane,
        *,
        global_scale: Tensor | None = None,
        reference: Tensor | None = None,
        model_dtype: torch.dtype,
        token_scale: Tensor | None = None,
        rounded: Tensor | None = None,
    ) -> None:
        if raw is None and rounded is None:
            raise ValueError("ReplayOperand: raw or rounded is required")
        self.raw = raw
        self.lane = lane
        self.global_scale = global_scale
        self.reference = reference
        self.model_dtype = model_dtype
        self.token_scale = token_scale
        self._base = rounded

    @classmethod
    def from_carrier(cls, carrier: W4AActivation) -> "ReplayOperand":
        """The replay operand of a runtime carrier: its FP32 decode, its reference."""
        return cls(
            None,
            StreamLane(carrier.mode, carrier.recipe),
            reference=carrier.reference,
            model_dtype=carrier.model_dtype,
            rounded=carrier.decode(torch.float32),
        )

    @property
    def shape(self) -> tuple[int, ...]:
        """The logical shape ``(..., K)``."""
        return tuple((self.raw if self.raw is not None else self._base).shape)

    def rounded(self) -> Float32[Tensor, "*lead k"]:
        """The FP32 operand the GEMM reads (computed on first use, then kept)."""
        if self._base is None:
            self._base = round_w4a_replay_operand(
                self.raw, self.lane.mode, recipe=self.lane.recipe, global_scale=self.global_scale
            )
        if self.token_scale is None:
            return self._base
        k = self._base.shape[-1]
        scaled = self._base.reshape(-1, k) * self.token_scale[:, None]
        return scaled.reshape(self._base.shape)

    def exact32(self) -> Float32[Tensor, "*lead k"]:
        """The exact value in FP32 (``reference``, else the rounded value)."""
        if self.reference is not None:
            return self.reference.to(torch.float32)
        return self.rounded()

    def exact(self) -> Float[Tensor, "*lead k"]:
        """The exact value in the model dtype (what an unselected layer reads)."""
        return self.exact32().to(self.model_dtype)

    def rescaled(self, inv: Float32[Tensor, " rows"]) -> "ReplayOperand":
        """A new operand whose rows read ``inv`` times larger (the fused-norm shortcut)."""
        base = self.rounded() if self.token_scale is not None else None
        reference = self.reference
        if reference is not None:
            k = reference.shape[-1]
            rows = reference.reshape(-1, k).to(torch.float32) * inv[:, None]
            reference = rows.to(self.model_dtype).reshape(reference.shape)
        if base is not None:  # a second rescale: the first one's product is the new base
            return ReplayOperand(
                None, self.lane, reference=reference, model_dtype=self.model_dtype,
                token_scale=inv, rounded=base,
            )  # fmt: skip
        out = ReplayOperand(
            self.raw, self.lane, global_scale=self.global_scale, reference=reference,
            model_dtype=self.model_dtype, token_scale=inv, rounded=self._base,
        )  # fmt: skip
        return out


def _fixed_scale(value: Any, device: torch.device) -> Tensor:
    return torch.as_tensor(value, dtype=torch.float32, device=device).reshape(())


_SAME_SIZE_INTS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _same_bits(a: Tensor | None, b: Tensor | None) -> bool:
    """Whether ``a`` and ``b`` hold the same bits (signed zeros and NaN payloads count)."""
    if a is None or b is None:
        return a is b
    if a.dtype != b.dtype or a.shape != b.shape or a.device != b.device:
        return False
    ints = _SAME_SIZE_INTS[a.element_size()]
    return torch.equal(a.reshape(-1).view(ints), b.reshape(-1).view(ints))


class RoundingMemo:
    """The NVFP4 operands a layer's replay passes packed, by ``(batch, site)``: a later pass
    that packs the same bits (value, global scale, lane) reads the kept rounding instead of
    searching again, so each site is rounded once per batch per state, with the same bits.

    ``batch`` names the batch being replayed (the caller sets it); FP8 operands are not kept
    (their rounding is cheap). Holds each site's last operand: drop the memo with the layer.

    Example:
      >>> memo = RoundingMemo()
      >>> codec = ReplayCodec(memo=memo)  # one memo shared by the layer's passes
    """

    def __init__(self) -> None:
        self.batch: int = 0
        self._held: dict[tuple[int, str], ReplayOperand] = {}

    def operand(
        self,
        value: Tensor,
        lane: StreamLane,
        *,
        site: str,
        global_scale: Tensor | None,
        reference: Tensor | None,
        model_dtype: torch.dtype,
    ) -> ReplayOperand:
        """The operand of ``value`` at ``site``: rounded already when a pass rounded the same."""
        key = (self.batch, site)
        held = self._held.get(key)
        rounded = None
        if (
            held is not None
            and held._base is not None
            and held.lane == lane
            and _same_bits(held.raw, value)
            and _same_bits(held.global_scale, global_scale)
        ):
            rounded = held._base
        op = ReplayOperand(
            value, lane, global_scale=global_scale, reference=reference,
            model_dtype=model_dtype, rounded=rounded,
        )  # fmt: skip
        if rounded is None:
            self._held[key] = op
        return op


class ReplayCodec:
    """The stream dataflow's codec for the replay: FP32 QDQ operands, FP32 ``F.linear``.

    Global scales, per pack: a ``producer_scales`` entry at its key (calibrated producers);
    else, in a headroom lane, ``site_scales[site]`` (frozen by the GPTQ run), or the consuming
    linear's nonzero ``activation_global_scale`` where it has one (a W4A module); else dynamic.
    This is the runtime's order, so a replay of W4A modules equals their stream.

    Args:
      producer_scales: calibrated FP32 producer scales by key, or None.
      site_scales: frozen headroom scales by site (``attention_norm``, ``o_proj``,
        ``mlp_norm``, ``down_proj``), or None.
      pack_observers: by site, called with the un-rounded operand before it is packed (for a
        fused norm operand: the normed residual ``x · 1/rms``); raising aborts the layer.
      linear_observers: by role (``q_proj`` ... ``down_proj``), called with the FP32 operand
        the linear multiplies; raising aborts the layer.
      memo: a :class:`RoundingMemo` shared by the passes over one layer's batches, or None.

    Numerics: linears compute ``F.linear(x, W, b)`` in FP32 (``W`` the dense weight, or
    ``dequantize_weight(float32)`` of a quantized module), rounded once to the model dtype.

    Example:
      >>> seen = []
      >>> codec = ReplayCodec(linear_observers={"q_proj": seen.append})
      >>> out = replay_llama_layer(layer, hidden, plan=plan, codec=codec,
      ...     position_embeddings=rope)  # doctest: +SKIP
    """

    def __init__(
        self,
        *,
        producer_scales: Mapping[str, float] | None = None,
        site_scales: Mapping[str, float] | None = None,
        pack_observers: Mapping[str, Callable[[Tensor], Any]] | None = None,
        linear_observers: Mapping[str, Callable[[Tensor], Any]] | None = None,
        memo: RoundingMemo | None = None,
    ) -> None:
        self.memo = memo
        self.producer_scales = dict(producer_scales or {})
        self.site_scales = dict(site_scales or {})
        self.pack_observers = dict(pack_observers or {})
        self.linear_observers = dict(linear_observers or {})
        self._weights: dict[int, tuple[nn.Module, Tensor]] = {}

    @staticmethod
    def is_operand(x: Any) -> bool:
        return isinstance(x, ReplayOperand)

    @staticmethod
    def model_dtype(op: ReplayOperand) -> torch.dtype:
        return op.model_dtype

    @staticmethod
    def place(op: ReplayOperand, like: Tensor) -> ReplayOperand:
        return op

    @staticmethod
    def exact32(op: ReplayOperand) -> Tensor:
        return op.exact32()

    @staticmethod
    def fits(op: ReplayOperand, lane: StreamLane) -> bool:
        return op.lane == lane

    def _scale(
        self, lane: StreamLane, site: str, key: str | None, headroom: nn.Module | None, like: Tensor
    ) -> Tensor | None:
        if not lane.nvfp4:
            return None
        if key is not None and key in self.producer_scales:
            return _fixed_scale(self.producer_scales[key], like.device)
        if not lane.headroom:
            return None
        if site in self.site_scales:
            return _fixed_scale(self.site_scales[site], like.device)
        bits = getattr(headroom, ACTIVATION_SCALE_BITS, None)
        if bits is not None and int(bits) != 0:
            return bits.view(torch.float32).to(like.device)
        return None

    def pack(
        self,
        value: Tensor,
        lane: StreamLane,
        *,
        site: str,
        key: str | None,
        headroom: nn.Module | None,
        reference: Tensor | None,
        model_dtype: torch.dtype,
    ) -> ReplayOperand:
        _check_width(value, site=site)
        observer = self.pack_observers.get(site)
        if observer is not None:
            observer(value)
        scale = self._scale(lane, site, key, headroom, value)
        if self.memo is not None and lane.nvfp4:
            return self.memo.operand(
                value, lane, site=site, global_scale=scale, reference=reference,
                model_dtype=model_dtype,
            )  # fmt: skip
        return ReplayOperand(
            value, lane, global_scale=scale, reference=reference, model_dtype=model_dtype
        )

    def rescale(
        self, op: ReplayOperand, inv: Tensor, *, site: str, lane: StreamLane
    ) -> ReplayOperand:
        observer = self.pack_observers.get(site)
        if observer is not None:
            k = op.shape[-1]
            observer((op.exact32().reshape(-1, k) * inv[:, None]).reshape(op.shape))
        return op.rescaled(inv)

    def _weight(self, module: nn.Module) -> Tensor:
        if isinstance(module, nn.Linear):
            return module.weight.to(torch.float32)
        held = self._weights.get(id(module))
        if held is None:
            decode = getattr(module, "dequantize_weight", None)
            if not callable(decode):
                raise TypeError(
                    f"ReplayCodec: cannot replay a {type(module).__name__}: it is neither an "
                    f"nn.Linear nor a module with dequantize_weight(dtype=...)"
                )
            held = (module, decode(dtype=torch.float32))
            self._weights[id(module)] = held
        return held[1]

    def forward(self, module: nn.Module, role: str) -> Callable[[ReplayOperand], Tensor]:
        """The forward a projection takes during a replayed call: :meth:`linear`."""
        return lambda op: self.linear(module, op, role=role)

    def linear(self, module: nn.Module, op: ReplayOperand, *, role: str) -> Tensor:
        x = op.rounded()
        observer = self.linear_observers.get(role)
        if observer is not None:
            observer(x)
        weight = self._weight(module).to(x.device)
        bias = getattr(module, "bias", None)
        bias = None if bias is None else bias.to(device=x.device, dtype=torch.float32)
        return F.linear(x, weight, bias).to(op.model_dtype)


def replay_llama_layer(
    layer: nn.Module,
    *args: Any,
    plan: StreamLayerPlan,
    codec: ReplayCodec | None = None,
    **kwargs: Any,
) -> Any:
    """Run one Llama decoder layer as the stream runs it, on FP32 QDQ operands.

    Args:
      layer: a ``LlamaDecoderLayer`` whose projections are ``nn.Linear`` or modules with
        ``dequantize_weight`` (GPTQ / W4A modules, native FP8/NVFP4 sources).
      *args, **kwargs: the layer's call as the model makes it (``hidden_states`` first: a
        tensor, a :class:`ReplayOperand`, or a runtime carrier, which is read as its FP32
        decode and reference).
      plan: the layer's :class:`~floatxq.lifecycle.stream.StreamLayerPlan`.
      codec: the :class:`ReplayCodec` (default: no producer scales, no observers).

    Returns:
      The ``output`` :class:`ReplayOperand` (in a 1-tuple where the layer class returns
      tuples).

    Raises:
      ValueError: no ``position_embeddings``; an operand whose K is not a multiple of 128 or
        that holds NaN or infinity; whatever an observer raises.
      TypeError: a projection that cannot be replayed.

    Numerics: see :class:`ReplayCodec`; the residual stays FP32 as in the runtime stream.

    Example:
      >>> plan = stream_layer_plans(w4a_stream_policy("w4afp8"), 1, [0])[0]  # doctest: +SKIP
      >>> out = replay_llama_layer(model.model.layers[0], hidden, plan=plan,
      ...     position_embeddings=(cos, sin))  # doctest: +SKIP
      >>> out.exact32().dtype  # doctest: +SKIP
      torch.float32
    """
    hidden, call = _bind_call(layer, args, kwargs)
    if isinstance(hidden, W4AActivation):
        hidden = ReplayOperand.from_carrier(hidden)
    out = _llama_layer_flow(layer, plan, codec or ReplayCodec(), hidden, call)
    return (out,) if _returns_tuple(type(layer)) else out
