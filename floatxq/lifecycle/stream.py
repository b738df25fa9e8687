"""The Llama W4A activation stream: decoder layers that hand quantized activations to each other.

Without the stream every W4A linear quantizes its own input, call by call. With it, a Llama
decoder layer whose seven projections are W4A modules (:class:`~floatxq.nn.W4AFP8Linear`,
:class:`~floatxq.nn.W4ANVFP4Linear`) is *selected*: its forward is replaced by one that packs each
GEMM operand once into a :class:`~floatxq.W4AActivation` and passes carriers between layers. The
residual stream stays exact (FP32, the carrier's ``reference``); only what a GEMM reads is rounded.

Per selected layer ``i`` the dataflow is (``lane`` = the (mode, recipe) of the attention or MLP
projections; the MLP lane of a layer listed in ``mlp_fp8_layers`` is FP8)::

    x   = the input carrier (from layer i-1), else pack(h, attention lane, reference=h)  # "input"
    a   = norm operand: x's codes with token scale 1/rms(x)   (fused_norms, NVFP4, no headroom)
          else pack(x · 1/rms(x) · weight in FP32, attention lane)
    q, k, v = q_proj(a), k_proj(a), v_proj(a)            # model dtype
    attention: RoPE, transformers' attention function, the KV cache, all in the model dtype
    o   = pack(attention output, attention lane)                        # "self_attn.o_proj.input"
    r1  = x.exact(FP32) + o_proj(o) -> pack(r1, MLP lane, reference=r1) # "post_attention_residual"
    b   = norm operand of r1 (as a, MLP lane)
    p   = act(gate_proj(b)) · up_proj(b)                 # model dtype
    d   = pack(p, MLP lane)                                             # "mlp.down_proj.input"
    r2  = r1 + down_proj(d) -> pack(r2, attention lane, reference=r2)   # "output"

Each pack takes a global scale (NVFP4): a calibrated producer boundary's
(:class:`NVFP4BoundaryQuantizer`, set by :func:`set_stream_global_scales`); else, with a
``*_headroom`` recipe, the consuming linear's ``activation_global_scale`` (q_proj for the
attention norm operand, gate_proj for the MLP one, o_proj, down_proj); else the dynamic one of the
tensor's own ``max|x|``. Unselected layers and the final norm see ``exact()`` in the model dtype;
``lm_head``, the embeddings and the KV cache stay in the model dtype.

The dataflow is written once (``_llama_layer_flow``) over an *operand codec*: the runtime codec
here packs carriers and calls the W4A modules; :mod:`floatxq.lifecycle.replay`'s codec rounds
the same operands in FP32 for the GPTQ solve, so the two cannot drift apart.

On CUDA the carriers come from the Triton packers with device-side global scales and no host
reads, so a selected layer's forward can be captured in a CUDA graph (capture after calibration:
whether a boundary is calibrated is decided on the host). On the CPU they come from
:func:`floatxq.pack_activation` and the modules take their reference routes.
"""

import dataclasses
import functools
import inspect
import math
import numbers
from collections.abc import Callable, Iterable, Mapping
from typing import Any, NamedTuple

import torch
from torch import nn

from floatxq._typing import Float32, Int32, Tensor
from floatxq.config import _FrozenMapping
from floatxq.formats import (
    W4A_ACTIVATION_MODES,
    NVFP4Recipe,
    W4AActivationMode,
    normalize_nvfp4_recipe,
    nvfp4_uses_headroom,
)
from floatxq.w4a.activation import W4AActivation, _unchecked_activation, pack_activation

__all__ = [
    "LLAMA_STREAM_PROJECTIONS",
    "NVFP4BoundaryQuantizer",
    "StreamBoundary",
    "StreamLane",
    "StreamLayerPlan",
    "W4AStreamPolicy",
    "install_w4a_llama_stream",
    "installed_w4a_stream",
    "llama_stream_boundaries",
    "set_stream_global_scales",
    "stream_boundary_quantizers",
    "stream_lane",
    "stream_layer_plans",
    "stream_producer_keys",
    "uninstall_w4a_llama_stream",
    "validate_producer_scales",
    "w4a_stream_policy",
]

LLAMA_STREAM_PROJECTIONS: tuple[str, ...] = (
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "self_attn.o_proj",
    "mlp.gate_proj",
    "mlp.up_proj",
    "mlp.down_proj",
)
"""The seven projections of a Llama decoder layer, by path inside the layer, in call order."""

_FP8: W4AActivationMode = "w4afp8"
_NVFP4: W4AActivationMode = "w4a_nvfp4"
_DEFAULT_RECIPE: NVFP4Recipe = "least_squares"
_GROUP_WIDTH = 128  # a packed operand's K, and every projection's out_features, in 128s
_STATE = "_floatxq_w4a_stream"  # the installed stream, in the model's __dict__ (no submodule)
_CACHE_NAMES = ("cache", "past_key_values", "past_key_value")
_GRID_DTYPES = (torch.float16, torch.bfloat16, torch.float32)

# (owner, boundary name, key suffix, consumer group) of the five boundaries, in execution order
_BOUNDARY_TABLE = (
    ("layer", "input", "input", "attention"),
    ("self_attn", "output", "self_attn.o_proj.input", "attention"),
    ("layer", "attention_residual", "post_attention_residual", "mlp"),
    ("mlp", "product", "mlp.down_proj.input", "mlp"),
    ("layer", "output", "output", "attention"),
)


# ----------------------------------------------------------------------------------------------
# Boundaries, lanes and the policy
# ----------------------------------------------------------------------------------------------


class StreamBoundary(NamedTuple):
    """One place where a selected layer packs a carrier."""

    layer: int
    owner: str
    """``"layer"``, ``"self_attn"`` or ``"mlp"``: the module that packs it."""
    name: str
    """``"input"``, ``"output"``, ``"attention_residual"`` or ``"product"``."""
    key: str | None
    """The producer key (``model.layers.{i}....``), or None for a layer input handed over by
    the selected layer before it (its carrier is that layer's ``output``)."""
    group: str
    """``"attention"`` or ``"mlp"``: whose lane (mode, recipe) the carrier is packed in."""


class StreamLane(NamedTuple):
    """How one group's GEMM operands are quantized: a mode and, for NVFP4, a recipe."""

    mode: W4AActivationMode
    recipe: NVFP4Recipe | None

    @property
    def nvfp4(self) -> bool:
        """True for an NVFP4 lane."""
        return self.mode == _NVFP4

    @property
    def headroom(self) -> bool:
        """True for an NVFP4 lane with a ``*_headroom`` recipe (scales from the linears)."""
        return self.mode == _NVFP4 and nvfp4_uses_headroom(self.recipe)


def _check_depth(depth: object, *, where: str) -> int:
    if isinstance(depth, bool) or not isinstance(depth, int) or depth < 1:
        raise ValueError(f"{where}: depth must be a positive int (the layer count), got {depth!r}")
    return depth


def _check_selected(selected: object, depth: int, *, where: str) -> tuple[int, ...]:
    """Distinct layer indices in ``[0, depth)``, sorted."""
    if isinstance(selected, (str, bytes)) or not isinstance(selected, Iterable):
        raise TypeError(f"{where}: selected must be an iterable of layer indices, got {selected!r}")
    values = list(selected)
    bad = [v for v in values if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v < depth]
    if bad:
        raise ValueError(
            f"{where}: selected layer indices must be ints in [0, {depth}), got e.g. {bad[:3]!r}"
        )
    if len(set(values)) != len(values):
        raise ValueError(f"{where}: selected layer indices must be distinct, got {values!r}")
    return tuple(sorted(values))


def llama_stream_boundaries(depth: int, selected: Iterable[int]) -> tuple[StreamBoundary, ...]:
    """The five carrier boundaries of each selected layer, in execution order.

    Per selected layer ``i``: ``input`` (key ``model.layers.{i}.input`` only when ``i == 0`` or
    layer ``i - 1`` is not selected; else None, the carrier being layer ``i - 1``'s ``output``),
    ``self_attn``'s ``output`` (``model.layers.{i}.self_attn.o_proj.input``),
    ``attention_residual`` (``model.layers.{i}.post_attention_residual``), ``mlp``'s ``product``
    (``model.layers.{i}.mlp.down_proj.input``) and ``output`` (``model.layers.{i}.output``).
    ``attention_residual`` and ``product`` feed the MLP group, the others the attention group.

    Args:
      depth: the model's decoder layer count (≥ 1).
      selected: the selected layer indices, distinct, in ``[0, depth)`` (any order).

    Returns:
      A tuple of :class:`StreamBoundary`, layers ascending.

    Raises:
      ValueError: a bad depth, an index out of range or repeated.
      TypeError: ``selected`` not an iterable.

    Numerics: names only.

    Example:
      >>> [b.key for b in llama_stream_boundaries(4, [1, 2]) if b.name == "input"]
      ['model.layers.1.input', None]
    """
    where = "llama_stream_boundaries"
    depth = _check_depth(depth, where=where)
    chosen = _check_selected(selected, depth, where=where)
    members = set(chosen)
    out = []
    for i in chosen:
        for owner, name, suffix, group in _BOUNDARY_TABLE:
            key: str | None = f"model.layers.{i}.{suffix}"
            if name == "input" and i > 0 and i - 1 in members:
                key = None
            out.append(StreamBoundary(i, owner, name, key, group))
    return tuple(out)


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class W4AStreamPolicy:
    """An installed stream's policy (build it with :func:`w4a_stream_policy`, which normalizes).

    Fields: ``mode`` and ``recipe`` (the stream; ``recipe`` canonical for NVFP4, None for FP8);
    ``attention_mode`` / ``attention_recipe`` (the q/k/v/o inputs; equal to the stream's unless
    an NVFP4 stream steps attention down to FP8 or uses another recipe); ``mlp_fp8_layers``
    (sorted distinct layer indices whose MLP inputs are FP8, NVFP4 streams only);
    ``fused_norms`` (the norm operands reuse the residual carrier's codes; the norm weights must
    be 1); ``global_scales`` (calibrated FP32 producer scales by key, read-only, or None).

    Raises:
      ValueError: a field that is not in normalized form or breaks a rule of
        :func:`w4a_stream_policy` (FP8 with a recipe, attention or MLP refinements or global
        scales; global scales with a headroom recipe; scales that are not positive finite FP32
        values; layer lists not sorted and distinct).
      TypeError: a field of the wrong kind.

    Numerics: names and FP32 numbers only.

    Example:
      >>> w4a_stream_policy("w4a_nvfp4", attention_mode="w4afp8").attention_recipe is None
      True
    """

    mode: W4AActivationMode
    recipe: NVFP4Recipe | None
    attention_mode: W4AActivationMode
    attention_recipe: NVFP4Recipe | None
    mlp_fp8_layers: tuple[int, ...]
    fused_norms: bool
    global_scales: Mapping[str, float] | None

    def __post_init__(self) -> None:
        where = "W4AStreamPolicy"
        for name in ("mode", "attention_mode"):
            if getattr(self, name) not in W4A_ACTIVATION_MODES:
                raise ValueError(
                    f"{where}: {name} must be one of {W4A_ACTIVATION_MODES}, got "
                    f"{getattr(self, name)!r}"
                )
        for mode_name, recipe_name in (("mode", "recipe"), ("attention_mode", "attention_recipe")):
            mode, recipe = getattr(self, mode_name), getattr(self, recipe_name)
            if mode == _FP8 and recipe is not None:
                raise ValueError(f"{where}: {recipe_name} must be None with {mode_name}='w4afp8'")
            if mode == _NVFP4 and (recipe is None or normalize_nvfp4_recipe(recipe) != recipe):
                raise ValueError(
                    f"{where}: {recipe_name} must be a canonical NVFP4 recipe with "
                    f"{mode_name}='w4a_nvfp4', got {recipe!r}"
                )
        layers = self.mlp_fp8_layers
        if not isinstance(layers, tuple) or list(layers) != sorted(set(layers)):
            raise ValueError(f"{where}: mlp_fp8_layers must be a sorted tuple of distinct ints")
        if not isinstance(self.fused_norms, bool):
            raise TypeError(f"{where}: fused_norms must be a bool, got {self.fused_norms!r}")
        if self.mode == _FP8:
            if self.attention_mode != _FP8 or layers or self.global_scales is not None:
                raise ValueError(
                    f"{where}: an FP8 stream has FP8 attention, no mlp_fp8_layers and no "
                    f"global_scales"
                )
        if self.global_scales is not None:
            _check_scale_values(self.global_scales, where=where)
            if any(lane.headroom for lane in _policy_lanes(self)):
                raise ValueError(
                    f"{where}: global_scales cannot be combined with a headroom recipe"
                )


def _policy_lanes(policy: W4AStreamPolicy) -> tuple[StreamLane, ...]:
    return (
        StreamLane(policy.mode, policy.recipe),
        StreamLane(policy.attention_mode, policy.attention_recipe),
    )


def _fp32(value: object, *, name: str, where: str) -> float:
    """A positive finite real number that stays positive and finite in FP32, as that value."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{where}: {name} must be a real number, got {type(value).__name__}")
    try:
        v = float(value)
    except OverflowError:
        v = math.inf
    if not (math.isfinite(v) and v > 0):
        raise ValueError(f"{where}: {name} must be positive and finite, got {value!r}")
    fp32 = float(torch.tensor(v, dtype=torch.float32))
    if not (math.isfinite(fp32) and fp32 > 0):
        raise ValueError(
            f"{where}: {name} = {value!r} is {fp32!r} in FP32; it must stay positive and finite"
        )
    return fp32


def _check_scale_values(scales: object, *, where: str) -> dict[str, float]:
    """``scales`` as a plain dict of FP32-rounded values (every key a str, every value a
    positive finite number that stays so in FP32)."""
    if not isinstance(scales, Mapping):
        raise TypeError(f"{where}: global_scales must be a mapping, got {type(scales).__name__}")
    out = {}
    for key, value in scales.items():
        if not isinstance(key, str):
            raise TypeError(f"{where}: global_scales keys must be str, got {key!r}")
        out[key] = _fp32(value, name=f"global_scales[{key!r}]", where=where)
    return out


def _mode(value: object, *, name: str, where: str) -> W4AActivationMode:
    if not isinstance(value, str) or value not in W4A_ACTIVATION_MODES:
        raise ValueError(f"{where}: {name} must be one of {W4A_ACTIVATION_MODES}, got {value!r}")
    return _FP8 if value == _FP8 else _NVFP4


def _policy_of(
    mode: object,
    recipe: object,
    global_scales: object,
    attention_mode: object,
    attention_recipe: object,
    mlp_fp8_layers: object,
    fused_norms: object,
    *,
    where: str,
) -> W4AStreamPolicy:
    mode = _mode(mode, name="mode", where=where)
    if mode == _FP8:
        if recipe is not None:
            raise ValueError(f"{where}: an FP8 stream takes no NVFP4 recipe, got recipe={recipe!r}")
        stream_recipe = None
    else:
        stream_recipe = normalize_nvfp4_recipe(_DEFAULT_RECIPE if recipe is None else recipe)
    attention = mode if attention_mode is None else _mode(attention_mode, name="attention_mode",
                                                          where=where)  # fmt: skip
    if mode == _FP8 and attention != _FP8:
        raise ValueError(
            f"{where}: attention_mode={attention!r} needs an NVFP4 stream (mode='w4a_nvfp4'); an "
            f"FP8 stream's attention is FP8"
        )
    if attention == _FP8:
        if attention_recipe is not None:
            raise ValueError(
                f"{where}: FP8 attention does not use an NVFP4 scale recipe, got "
                f"attention_recipe={attention_recipe!r}"
            )
        attn_recipe = None
    else:
        attn_recipe = normalize_nvfp4_recipe(
            stream_recipe if attention_recipe is None else attention_recipe
        )
    if mlp_fp8_layers is None:
        layers: tuple[int, ...] = ()
    else:
        if isinstance(mlp_fp8_layers, (str, bytes, Mapping)) or not isinstance(
            mlp_fp8_layers, Iterable
        ):
            raise ValueError(
                f"{where}: mlp_fp8_layers must be a list or tuple of layer indices, got "
                f"{mlp_fp8_layers!r}"
            )
        values = list(mlp_fp8_layers)
        bad = [v for v in values if isinstance(v, bool) or not isinstance(v, int) or v < 0]
        if bad:
            raise ValueError(
                f"{where}: mlp_fp8_layers must be non-negative ints (no bools), got e.g. "
                f"{bad[:3]!r}"
            )
        if len(set(values)) != len(values):
            raise ValueError(f"{where}: mlp_fp8_layers must be distinct, got {values!r}")
        if values and mode == _FP8:
            raise ValueError(
                f"{where}: mlp_fp8_layers promotes NVFP4 MLP inputs to FP8; an FP8 stream (mode "
                f"'w4afp8') takes none"
            )
        layers = tuple(sorted(int(v) for v in values))
    if not isinstance(fused_norms, bool):
        raise TypeError(f"{where}: fused_norms must be a bool, got {fused_norms!r}")
    scales = None
    if global_scales is not None:
        if mode == _FP8:
            raise ValueError(
                f"{where}: global_scales are NVFP4 producer scales; an FP8 stream takes none"
            )
        headroom = [
            r for r in (stream_recipe, attn_recipe) if r is not None and nvfp4_uses_headroom(r)
        ]
        if headroom:
            raise ValueError(
                f"{where}: global_scales cannot be combined with the headroom recipe "
                f"{headroom[0]!r} (its scales come from the linears' headroom calibration)"
            )
        scales = _FrozenMapping(_check_scale_values(global_scales, where=where))
    return W4AStreamPolicy(
        mode=mode,
        recipe=stream_recipe,
        attention_mode=attention,
        attention_recipe=attn_recipe,
        mlp_fp8_layers=layers,
        fused_norms=fused_norms,
        global_scales=scales,
    )


def w4a_stream_policy(
    mode: str,
    *,
    recipe: str | None = None,
    global_scales: Mapping[str, float] | None = None,
    attention_mode: str | None = None,
    attention_recipe: str | None = None,
    mlp_fp8_layers: Iterable[int] | None = None,
    fused_norms: bool = False,
) -> W4AStreamPolicy:
    """Normalize and check a stream policy (what :func:`install_w4a_llama_stream` takes).

    Args:
      mode: ``"w4afp8"`` or ``"w4a_nvfp4"``.
      recipe: NVFP4 only: the block-scale recipe (default ``least_squares``; aliases accepted).
      global_scales: NVFP4 only, not with a headroom recipe: calibrated producer scales by key
        (each positive, finite and so in FP32; stored FP32-rounded). The key set is checked
        against a model's producers by :func:`install_w4a_llama_stream`.
      attention_mode: the q/k/v/o inputs' mode (default ``mode``; FP8 inside an NVFP4 stream).
      attention_recipe: NVFP4 attention only (default the stream's recipe).
      mlp_fp8_layers: NVFP4 only: distinct non-negative layer indices whose MLP inputs are FP8.
      fused_norms: the norm operands reuse the residual carrier's codes scaled by ``1/rms``
        (NVFP4 lanes without headroom; the norm weights must be 1).

    Returns:
      A :class:`W4AStreamPolicy`.

    Raises:
      ValueError: an unknown mode or recipe; a recipe, attention override, ``mlp_fp8_layers``
        or ``global_scales`` on an FP8 stream; a recipe on FP8 attention; bad layer lists;
        global scales with a headroom recipe, or not positive finite FP32 values.
      TypeError: ``fused_norms`` not a bool, scales not a mapping of str to numbers.

    Numerics: each global scale rounded once to FP32 (nearest-even).

    Example:
      >>> p = w4a_stream_policy("w4a_nvfp4", recipe="lsq", mlp_fp8_layers=[3, 1])
      >>> p.recipe, p.attention_recipe, p.mlp_fp8_layers
      ('least_squares', 'least_squares', (1, 3))
    """
    return _policy_of(
        mode, recipe, global_scales, attention_mode, attention_recipe, mlp_fp8_layers,
        fused_norms, where="w4a_stream_policy",
    )  # fmt: skip


def stream_lane(policy: W4AStreamPolicy, layer: int, group: str) -> StreamLane:
    """The (mode, recipe) of one layer's ``"attention"`` or ``"mlp"`` operands under ``policy``.

    The attention lane is the policy's attention mode and recipe; the MLP lane is the stream's,
    or FP8 for a layer in ``mlp_fp8_layers``.

    Raises:
      ValueError: ``group`` is neither ``"attention"`` nor ``"mlp"``.

    Numerics: names only.

    Example:
      >>> stream_lane(w4a_stream_policy("w4a_nvfp4", mlp_fp8_layers=[2]), 2, "mlp")
      StreamLane(mode='w4afp8', recipe=None)
    """
    if group == "attention":
        return StreamLane(policy.attention_mode, policy.attention_recipe)
    if group != "mlp":
        raise ValueError(f"stream_lane: group must be 'attention' or 'mlp', got {group!r}")
    if layer in policy.mlp_fp8_layers:
        return StreamLane(_FP8, None)
    return StreamLane(policy.mode, policy.recipe)


def stream_producer_keys(
    policy: W4AStreamPolicy, depth: int, selected: Iterable[int]
) -> tuple[str, ...]:
    """The producer keys that own a calibrated scale: boundaries with a key in an NVFP4 lane.

    Args:
      policy: the stream policy.
      depth, selected: as :func:`llama_stream_boundaries`.

    Returns:
      The keys in execution order (empty for an FP8 stream).

    Raises:
      ValueError, TypeError: as :func:`llama_stream_boundaries`.

    Numerics: names only.

    Example:
      >>> stream_producer_keys(w4a_stream_policy("w4a_nvfp4", attention_mode="w4afp8"), 1, [0])
      ('model.layers.0.post_attention_residual', 'model.layers.0.mlp.down_proj.input')
    """
    return tuple(
        b.key
        for b in llama_stream_boundaries(depth, selected)
        if b.key is not None and stream_lane(policy, b.layer, b.group).nvfp4
    )


def validate_producer_scales(scales: Mapping[str, float], expected: Iterable[str]) -> None:
    """Check that a producer-scale map has exactly the expected keys.

    Raises:
      ValueError: keys missing or extra (both listed, sorted).
      TypeError: ``scales`` is not a mapping.

    Numerics: names only.

    Example:
      >>> validate_producer_scales({"model.layers.0.output": 1.0}, ["model.layers.0.output"])
    """
    if not isinstance(scales, Mapping):
        raise TypeError(
            f"validate_producer_scales: scales must be a mapping, got {type(scales).__name__}"
        )
    wanted = set(expected)
    missing = sorted(wanted - set(scales))
    extra = sorted(set(scales) - wanted)
    if missing or extra:
        raise ValueError(
            f"global_scales must name exactly the stream's NVFP4 producers ({len(wanted)} keys); "
            f"missing {missing}, extra {extra}"
        )


class StreamLayerPlan(NamedTuple):
    """What one selected layer's dataflow packs where (see the module docstring)."""

    index: int
    attention: StreamLane
    mlp: StreamLane
    fused_norms: bool
    input_key: str | None
    """``model.layers.{i}.input``, or None when the selected layer before hands its carrier on."""
    attention_output_key: str
    residual_key: str
    product_key: str
    output_key: str


def stream_layer_plans(
    policy: W4AStreamPolicy, depth: int, selected: Iterable[int]
) -> dict[int, StreamLayerPlan]:
    """The dataflow plan of each selected layer, by index (layers ascending).

    Raises:
      ValueError, TypeError: as :func:`llama_stream_boundaries`.

    Numerics: names only.

    Example:
      >>> plans = stream_layer_plans(w4a_stream_policy("w4afp8"), 2, [0, 1])
      >>> plans[1].input_key, plans[1].output_key
      (None, 'model.layers.1.output')
    """
    keys: dict[int, dict[str, str | None]] = {}
    for b in llama_stream_boundaries(depth, selected):
        keys.setdefault(b.layer, {})[f"{b.owner}.{b.name}"] = b.key
    return {
        i: StreamLayerPlan(
            index=i,
            attention=stream_lane(policy, i, "attention"),
            mlp=stream_lane(policy, i, "mlp"),
            fused_norms=policy.fused_norms,
            input_key=k["layer.input"],
            attention_output_key=k["self_attn.output"],
            residual_key=k["layer.attention_residual"],
            product_key=k["mlp.product"],
            output_key=k["layer.output"],
        )
        for i, k in keys.items()
    }


# ----------------------------------------------------------------------------------------------
# Producer quantizers (plain objects: not modules, not buffers)
# ----------------------------------------------------------------------------------------------


def _one_bits() -> Tensor:
    return torch.tensor(1.0, dtype=torch.float32).view(torch.int32)


class NVFP4BoundaryQuantizer:
    """The global-scale state of one NVFP4 producer boundary of an installed stream.

    A plain object held by the stream (never a submodule or buffer, so ``state_dict``, exports
    and ``named_modules`` do not see it). Uncalibrated, the boundary packs with the dynamic
    global scale of its tensor; calibrated (:meth:`set_scale`), with the stored FP32 scale.

    Args:
      key: the producer key (``model.layers.{i}....``).
      layer: its decoder layer index.
      recipe: the canonical NVFP4 recipe its lane packs with.
      device: where the scale lives (moved to the packed tensor's device on first use there).

    Attributes:
      scale_bits: int32 ``()``: the FP32 scale's bit pattern (1.0 until calibrated).
      calibrated: whether the stored scale is used.
      observer: None, or a callable given each un-quantized boundary tensor before it is packed
        (calibration reads maxima here; raising aborts the forward).

    Numerics: the scale is FP32, stored and used as its bits (no rounding after
    :meth:`set_scale`).

    Example:
      >>> q = NVFP4BoundaryQuantizer("model.layers.0.output", layer=0, recipe="least_squares")
      >>> q.set_scale(0.5); q.calibrated, q.scale
      (True, 0.5)
    """

    def __init__(
        self,
        key: str,
        *,
        layer: int,
        recipe: str,
        device: torch.device | str | None = None,
    ) -> None:
        where = "NVFP4BoundaryQuantizer"
        if not isinstance(key, str) or not key.startswith("model.layers."):
            raise ValueError(f"{where}: key must be a 'model.layers.' producer key, got {key!r}")
        if isinstance(layer, bool) or not isinstance(layer, int) or layer < 0:
            raise ValueError(f"{where}: layer must be a non-negative int, got {layer!r}")
        self.key = key
        self.layer = layer
        self.recipe: NVFP4Recipe = normalize_nvfp4_recipe(recipe)
        bits = _one_bits()
        self.scale_bits: Int32[Tensor, ""] = bits if device is None else bits.to(device)
        self.calibrated = False
        self.observer: Callable[[Tensor], Any] | None = None

    def __repr__(self) -> str:
        state = f"scale={self.scale!r}" if self.calibrated else "dynamic"
        return f"NVFP4BoundaryQuantizer({self.key!r}, {self.recipe}, {state})"

    @property
    def scale(self) -> float:
        """The stored FP32 scale as a Python float (one host read)."""
        return float(self.scale_bits.view(torch.float32))

    def set_scale(self, value: float | int) -> None:
        """Store a calibrated scale and use it from now on.

        Raises:
          TypeError: ``value`` is not a real number (bools refused).
          ValueError: not positive and finite, as a Python float or after rounding to FP32.

        Numerics: one nearest-even rounding to FP32; written in place (a captured CUDA graph
        reads the new value).
        """
        v = _fp32(value, name="value", where=f"NVFP4BoundaryQuantizer({self.key!r}).set_scale")
        bits = torch.tensor(v, dtype=torch.float32).view(torch.int32)
        self.scale_bits.copy_(bits)
        self.calibrated = True

    def reset(self) -> None:
        """Back to the dynamic global scale (stored scale 1.0, not calibrated)."""
        self.scale_bits.copy_(_one_bits())
        self.calibrated = False

    def global_scale(self, device: torch.device) -> Float32[Tensor, ""]:
        """The stored scale as a 0-d FP32 view on ``device`` (moved there once, then kept)."""
        if self.scale_bits.device != device:
            self.scale_bits = self.scale_bits.to(device)
        return self.scale_bits.view(torch.float32)


# ----------------------------------------------------------------------------------------------
# The dataflow, written once over an operand codec
# ----------------------------------------------------------------------------------------------


class _LayerCall(NamedTuple):
    """A decoder layer call's arguments, as the dataflow reads them."""

    attention_mask: Tensor | None
    position_embeddings: tuple[Tensor, Tensor]
    cache: Any
    kwargs: dict[str, Any]
    """Everything else (``position_ids``, ``use_cache``, ...): given to the attention function."""


@functools.cache
def _positional_names(cls: type) -> tuple[str, ...]:
    """The names a decoder layer class's ``forward`` takes positionally, after ``self``."""
    params = list(inspect.signature(cls.forward).parameters.values())[1:]
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return tuple(p.name for p in params if p.kind in kinds)


@functools.cache
def _returns_tuple(cls: type) -> bool:
    """Whether a decoder layer class returns a tuple (older transformers) or the tensor."""
    annotation = inspect.signature(cls.forward).return_annotation
    plain = (inspect.Signature.empty, torch.Tensor, "torch.Tensor", "Tensor")
    return not any(annotation is a or annotation == a for a in plain)


@functools.cache
def _cache_takes_kwargs(cls: type) -> bool:
    """Whether an attention class passes its keyword arguments to ``cache.update(...,
    kwargs=...)`` (transformers 5.2x, the ``cache`` argument) or a ``cache_kwargs`` dict."""
    return "cache" in inspect.signature(cls.forward).parameters


def _bind_call(layer: nn.Module, args: tuple, kwargs: dict[str, Any]) -> tuple[Any, _LayerCall]:
    """``(hidden_states, call)`` of a decoder layer call, whatever was passed positionally."""
    names = _positional_names(type(layer))
    if len(args) > len(names):
        raise TypeError(
            f"{type(layer).__name__}: the stream forward takes at most {len(names)} positional "
            f"arguments, got {len(args)}"
        )
    bound = dict(kwargs)
    for name, value in zip(names, args, strict=False):
        if name in bound:
            raise TypeError(f"{type(layer).__name__}: got multiple values for argument {name!r}")
        bound[name] = value
    if "hidden_states" not in bound:
        raise TypeError(f"{type(layer).__name__}: hidden_states is required")
    hidden = bound.pop("hidden_states")
    cache = None
    for name in _CACHE_NAMES:
        value = bound.pop(name, None)
        cache = value if cache is None else cache
    embeddings = bound.pop("position_embeddings", None)
    if embeddings is None:
        raise ValueError(
            f"{type(layer).__name__}: the W4A stream needs position_embeddings (the rotary "
            f"(cos, sin) that transformers' Llama model passes to each decoder layer)"
        )
    mask = bound.pop("attention_mask", None)
    return hidden, _LayerCall(mask, embeddings, cache, bound)


def _attention_interface(attention: nn.Module) -> Callable[..., Any]:
    from transformers.models.llama import modeling_llama

    impl = getattr(attention.config, "_attn_implementation", None) or "eager"
    eager = modeling_llama.eager_attention_forward
    functions = modeling_llama.ALL_ATTENTION_FUNCTIONS
    if hasattr(functions, "get_interface"):
        return functions.get_interface(impl, eager)
    return eager if impl == "eager" else functions[impl]


def _attention(attention: nn.Module, q: Tensor, k: Tensor, v: Tensor, call: _LayerCall) -> Tensor:
    """Llama attention on projected ``q, k, v`` ``(*rows, width)`` in the model dtype: RoPE, the
    KV cache, transformers' attention function; returns the ``(*rows, heads·dim)`` output."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    lead = q.shape[:-1]
    heads = (*lead, -1, attention.head_dim)
    q = q.view(heads).transpose(1, 2)
    k = k.view(heads).transpose(1, 2)
    v = v.view(heads).transpose(1, 2)
    cos, sin = call.position_embeddings
    q, k = apply_rotary_pos_emb(q, k, cos, sin)
    if call.cache is not None:
        if _cache_takes_kwargs(type(attention)):
            k, v = call.cache.update(k, v, attention.layer_idx, kwargs=call.kwargs)
        else:
            extra = {"sin": sin, "cos": cos, "cache_position": call.kwargs.get("cache_position")}
            k, v = call.cache.update(k, v, attention.layer_idx, extra)
    dropout = 0.0 if not attention.training else attention.attention_dropout
    out, _ = _attention_interface(attention)(
        attention, q, k, v, call.attention_mask, dropout=dropout, scaling=attention.scaling,
        **call.kwargs,
    )  # fmt: skip
    return out.reshape(*lead, -1).contiguous()


def _norm_operand(
    codec: Any,
    norm: nn.Module,
    x: Any,
    xr: Tensor,
    lane: StreamLane,
    fused: bool,
    *,
    site: str,
    headroom: nn.Module,
    model_dtype: torch.dtype,
) -> Any:
    """The RMS-normed GEMM operand of the residual ``x`` (FP32 ``xr``): ``x``'s own codes scaled
    by ``1/rms`` (the fused shortcut), or the packed FP32 ``xr · 1/rms · weight``."""
    inv = torch.rsqrt(xr.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon)
    if fused and lane.nvfp4 and not lane.headroom and codec.fits(x, lane):
        return codec.rescale(x, inv.reshape(-1), site=site, lane=lane)
    normed = xr * inv * norm.weight.to(torch.float32)
    return codec.pack(
        normed, lane, site=site, key=None, headroom=headroom, reference=normed,
        model_dtype=model_dtype,
    )  # fmt: skip


def _llama_layer_flow(
    layer: nn.Module, plan: StreamLayerPlan, codec: Any, hidden: Any, call: _LayerCall
) -> Any:
    """One selected Llama decoder layer over ``codec``'s operands (the module docstring's
    dataflow); returns the ``output`` operand.

    ``codec`` provides: ``is_operand(x)``, ``model_dtype(op)``, ``place(op, like)``,
    ``exact32(op)`` (the FP32 residual), ``fits(op, lane)``, ``pack(value, lane, *, site, key,
    headroom, reference, model_dtype)``, ``rescale(op, inv, *, site, lane)`` and
    ``linear(module, op, *, role)`` (the model dtype out). Sites name what is packed:
    ``input``, ``attention_norm``, ``o_proj``, ``attention_residual``, ``mlp_norm``,
    ``down_proj``, ``output``.
    """
    attn, mlp = layer.self_attn, layer.mlp
    if codec.is_operand(hidden):
        x = codec.place(hidden, layer.input_layernorm.weight)
        model_dtype = codec.model_dtype(x)
    else:
        model_dtype = hidden.dtype
        x = codec.pack(
            hidden, plan.attention, site="input", key=plan.input_key, headroom=None,
            reference=hidden, model_dtype=model_dtype,
        )  # fmt: skip
    xr = codec.exact32(x)
    a = _norm_operand(
        codec, layer.input_layernorm, x, xr, plan.attention, plan.fused_norms,
        site="attention_norm", headroom=attn.q_proj, model_dtype=model_dtype,
    )  # fmt: skip
    q = codec.linear(attn.q_proj, a, role="q_proj")
    k = codec.linear(attn.k_proj, a, role="k_proj")
    v = codec.linear(attn.v_proj, a, role="v_proj")
    del a
    o = codec.pack(
        _attention(attn, q, k, v, call), plan.attention, site="o_proj",
        key=plan.attention_output_key, headroom=attn.o_proj, reference=None,
        model_dtype=model_dtype,
    )  # fmt: skip
    r1 = xr + codec.linear(attn.o_proj, o, role="o_proj").to(torch.float32)
    del o, xr, x
    r1c = codec.pack(
        r1, plan.mlp, site="attention_residual", key=plan.residual_key, headroom=None,
        reference=r1, model_dtype=model_dtype,
    )  # fmt: skip
    b = _norm_operand(
        codec, layer.post_attention_layernorm, r1c, r1, plan.mlp, plan.fused_norms,
        site="mlp_norm", headroom=mlp.gate_proj, model_dtype=model_dtype,
    )  # fmt: skip
    del r1c
    p = mlp.act_fn(codec.linear(mlp.gate_proj, b, role="gate_proj")) * codec.linear(
        mlp.up_proj, b, role="up_proj"
    )
    del b
    d = codec.pack(
        p, plan.mlp, site="down_proj", key=plan.product_key, headroom=mlp.down_proj,
        reference=None, model_dtype=model_dtype,
    )  # fmt: skip
    r2 = r1 + codec.linear(mlp.down_proj, d, role="down_proj").to(torch.float32)
    return codec.pack(
        r2, plan.attention, site="output", key=plan.output_key, headroom=None, reference=r2,
        model_dtype=model_dtype,
    )  # fmt: skip


# ----------------------------------------------------------------------------------------------
# The runtime codec: carriers and W4A modules
# ----------------------------------------------------------------------------------------------


class _Scale(NamedTuple):
    """A pack's global scale: ``fixed`` (FP32 0-d), else a linear's ``bits`` (0.0: dynamic),
    else dynamic."""

    fixed: Tensor | None = None
    bits: Tensor | None = None


def _kernel_reason(device: torch.device, mode: str) -> str | None:
    """Why the Triton packer of ``mode`` cannot run on ``device`` (None: it can)."""
    if device.type != "cuda":
        return f"the tensors are on {device}"
    try:
        if mode == _FP8:
            from floatxq.kernels.w4a_fp8 import w4a_fp8_unavailable_reason as reason
        else:
            from floatxq.kernels.nvfp4 import nvfp4_unavailable_reason as reason
    except ImportError as exc:  # pragma: no cover - the kernels ship with floatxq
        return f"the kernels do not import ({exc})"
    return reason(device)


def _check_width(value: Tensor, *, site: str) -> tuple[tuple[int, ...], int, int]:
    shape = tuple(value.shape)
    if len(shape) < 2 or shape[-1] == 0 or shape[-1] % _GROUP_WIDTH:
        raise ValueError(
            f"W4A stream: the {site} operand must be (..., K) with K a positive multiple of "
            f"{_GROUP_WIDTH}, got shape {shape}"
        )
    return shape, math.prod(shape[:-1]), shape[-1]


def _device_pack(
    value: Tensor,
    lane: StreamLane,
    scale: _Scale,
    model_dtype: torch.dtype,
    reference: Tensor | None,
    *,
    site: str,
) -> W4AActivation:
    """A carrier through the Triton packers with the global scale computed on the device: no
    host read, so a CUDA graph can capture it."""
    shape, rows, k = _check_width(value, site=site)
    x2 = value.reshape(rows, k)
    if lane.mode == _FP8:
        from floatxq.kernels.w4a_fp8 import fp8_pack

        codes, row_scale = fp8_pack(x2)
        return _unchecked_activation(
            codes=codes, scales=row_scale, shape=shape, model_dtype=model_dtype, mode=_FP8,
            reference=reference,
        )  # fmt: skip
    from floatxq.kernels.nvfp4 import nvfp4_pack_and_swizzle
    from floatxq.nvfp4.quantize import _device_global_scale

    if scale.fixed is not None:
        g = scale.fixed.to(torch.float32).reshape(())
    else:
        amax = x2.abs().amax() if rows else torch.zeros((), device=x2.device)
        grid = x2.dtype if x2.dtype in _GRID_DTYPES else None
        g = _device_global_scale(amax, grid_dtype=grid, recipe=lane.recipe)
        if scale.bits is not None:
            g = torch.where(scale.bits == 0, g, scale.bits.view(torch.float32))
    codes, scales = nvfp4_pack_and_swizzle(x2, g, recipe=lane.recipe)
    return _unchecked_activation(
        codes=codes, scales=scales, shape=shape, model_dtype=model_dtype, mode=_NVFP4,
        global_scale=g, recipe=lane.recipe, reference=reference,
    )  # fmt: skip


def _host_pack(
    value: Tensor,
    lane: StreamLane,
    scale: _Scale,
    model_dtype: torch.dtype,
    reference: Tensor | None,
    *,
    site: str,
) -> W4AActivation:
    """A carrier through :func:`floatxq.pack_activation` (checked; the modules' reference
    routes read it)."""
    _check_width(value, site=site)
    if lane.mode == _FP8:
        return pack_activation(value, _FP8, model_dtype=model_dtype, reference=reference)
    g = scale.fixed
    if g is None and scale.bits is not None and int(scale.bits) != 0:
        g = scale.bits.view(torch.float32)
    return pack_activation(
        value, _NVFP4, global_scale=g, model_dtype=model_dtype, recipe=lane.recipe,
        reference=reference,
    )  # fmt: skip


class _RuntimeCodec:
    """Operands are :class:`~floatxq.W4AActivation` carriers; linears are the W4A modules."""

    def __init__(self, quantizers: Mapping[str, NVFP4BoundaryQuantizer]) -> None:
        self.quantizers = quantizers
        self._reasons: dict[tuple[torch.device, str], str | None] = {}

    def _on_device(self, device: torch.device, mode: str) -> bool:
        key = (device, mode)
        if key not in self._reasons:
            self._reasons[key] = _kernel_reason(device, mode)
        return self._reasons[key] is None

    @staticmethod
    def is_operand(x: Any) -> bool:
        return isinstance(x, W4AActivation)

    @staticmethod
    def model_dtype(op: W4AActivation) -> torch.dtype:
        return op.model_dtype

    @staticmethod
    def place(op: W4AActivation, like: Tensor) -> W4AActivation:
        return op if op.codes.device == like.device else op.to(like.device)

    @staticmethod
    def exact32(op: W4AActivation) -> Tensor:
        return op.exact(torch.float32)

    @staticmethod
    def fits(op: W4AActivation, lane: StreamLane) -> bool:
        return op.mode == lane.mode and op.recipe == lane.recipe

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
    ) -> W4AActivation:
        scale = _Scale()
        if lane.nvfp4:
            quantizer = self.quantizers.get(key) if key is not None else None
            if quantizer is not None:
                if quantizer.observer is not None:
                    quantizer.observer(value)
                if quantizer.calibrated:
                    scale = _Scale(fixed=quantizer.global_scale(value.device))
            if scale.fixed is None and lane.headroom and headroom is not None:
                scale = _Scale(bits=headroom.activation_global_scale_bits)
        pack = _device_pack if self._on_device(value.device, lane.mode) else _host_pack
        return pack(value, lane, scale, model_dtype, reference, site=site)

    def rescale(
        self, op: W4AActivation, inv: Tensor, *, site: str, lane: StreamLane
    ) -> W4AActivation:
        if not self._on_device(op.codes.device, _NVFP4):
            return op.rescale_tokens(inv)
        fields = {f.name: getattr(op, f.name) for f in dataclasses.fields(op)}
        fields["token_scale"] = inv if op.token_scale is None else op.token_scale * inv
        if op.reference is not None:
            rows = op.reference.reshape(op.rows, op.k).to(torch.float32) * inv[:, None]
            fields["reference"] = rows.to(op.model_dtype).reshape(op.shape)
        return _unchecked_activation(**fields)

    @staticmethod
    def linear(module: nn.Module, op: W4AActivation, *, role: str) -> Tensor:
        return module(op)


# ----------------------------------------------------------------------------------------------
# Installing the stream
# ----------------------------------------------------------------------------------------------


@dataclasses.dataclass(slots=True)
class _Rebound:
    """One rebinding of a module's forward: where (``attr``) and what to put back."""

    module: nn.Module
    attr: str
    previous: Any  # the instance attribute before, or _ABSENT


_ABSENT = object()


@dataclasses.dataclass(slots=True)
class _StreamState:
    """What an installed stream holds (in the model's ``__dict__``, outside the module tree)."""

    policy: W4AStreamPolicy
    depth: int
    selected: tuple[int, ...]
    plans: dict[int, StreamLayerPlan]
    quantizers: dict[str, NVFP4BoundaryQuantizer]
    codec: _RuntimeCodec
    rebound: list[_Rebound]
    hooks: list[Any]


def _state(model: nn.Module) -> _StreamState | None:
    return model.__dict__.get(_STATE)


def _llama_layers(model: nn.Module, *, where: str) -> nn.ModuleList:
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    layers = getattr(getattr(model, "model", None), "layers", None)
    if not isinstance(layers, nn.ModuleList) or len(layers) == 0:
        raise ValueError(
            f"{where}: the model has no model.layers list; the W4A stream runs Llama causal LMs "
            f"(LlamaForCausalLM), got {type(model).__name__}"
        )
    if not isinstance(layers[0], LlamaDecoderLayer):
        raise ValueError(
            f"{where}: model.model.layers[0] is a {type(layers[0]).__name__}; the W4A stream "
            f"runs Llama decoder layers (LlamaDecoderLayer)"
        )
    return layers


def _w4a_classes() -> tuple[type, type]:
    from floatxq.nn.w4a_fp8_linear import W4AFP8Linear
    from floatxq.nn.w4a_nvfp4_linear import W4ANVFP4Linear

    return W4AFP8Linear, W4ANVFP4Linear


def _selected_layers(layers: nn.ModuleList, *, where: str) -> tuple[int, ...]:
    """Indices of the layers whose seven projections are all W4A modules (a layer with some but
    not all is refused)."""
    kinds = _w4a_classes()
    selected = []
    for i, layer in enumerate(layers):
        modules = {p: layer.get_submodule(p) for p in LLAMA_STREAM_PROJECTIONS}
        w4a = [p for p, m in modules.items() if isinstance(m, kinds)]
        if len(w4a) == len(modules):
            selected.append(i)
        elif w4a:
            others = ", ".join(
                f"{p} ({type(m).__name__})" for p, m in modules.items() if p not in w4a
            )
            raise ValueError(
                f"{where}: layer {i} is partly W4A: {', '.join(w4a)} are W4A modules but "
                f"{others} are not; a layer streams only when all seven projections are "
                f"W4AFP8Linear or W4ANVFP4Linear"
            )
    if not selected:
        raise ValueError(
            f"{where}: no decoder layer has all seven projections as W4A modules "
            f"(W4AFP8Linear / W4ANVFP4Linear); convert the GPTQ modules first"
        )
    return tuple(selected)


def _same_bits(modules: dict[str, nn.Module]) -> bool:
    first = next(iter(modules.values())).activation_global_scale_bits
    return all(
        torch.equal(m.activation_global_scale_bits.to(first.device), first)
        for m in modules.values()
    )


def _check_layers(
    layers: nn.ModuleList, selected: tuple[int, ...], policy: W4AStreamPolicy, *, where: str
) -> None:
    """Every model-dependent rule: module classes per lane, ``out % 128``, unit norm weights
    for ``fused_norms``, identical headroom scales on modules sharing a carrier."""
    nvfp4_class = _w4a_classes()[1]
    for i in selected:
        layer = layers[i]
        for path in LLAMA_STREAM_PROJECTIONS:
            module = layer.get_submodule(path)
            group = "attention" if path.startswith("self_attn.") else "mlp"
            lane = stream_lane(policy, i, group)
            if lane.nvfp4 and not isinstance(module, nvfp4_class):
                raise ValueError(
                    f"{where}: layer {i} {path} is a {type(module).__name__}, which cannot run "
                    f"NVFP4 carriers; the {group} lane is NVFP4 ({lane.recipe}), use "
                    f"W4ANVFP4Linear"
                )
            if module.out_features % _GROUP_WIDTH:
                raise ValueError(
                    f"{where}: layer {i} {path} has out_features={module.out_features}; every "
                    f"streamed projection needs a multiple of {_GROUP_WIDTH}"
                )
        if policy.fused_norms:
            for name in ("input_layernorm", "post_attention_layernorm"):
                weight = getattr(layer, name).weight
                if not bool((weight == 1).all()):
                    raise ValueError(
                        f"{where}: fused_norms=True needs unit RMSNorm weights (the norm operand "
                        f"reuses the residual's codes), but layer {i} {name}.weight is not all 1"
                    )
        for group, paths in (
            ("attention", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),
            ("mlp", ("mlp.gate_proj", "mlp.up_proj")),
        ):
            if stream_lane(policy, i, group).headroom:
                modules = {p: layer.get_submodule(p) for p in paths}
                if not _same_bits(modules):
                    raise ValueError(
                        f"{where}: layer {i}: {', '.join(paths)} read one shared NVFP4 carrier, "
                        f"so their calibrated activation_global_scale must be identical under a "
                        f"headroom recipe; got "
                        + ", ".join(
                            f"{p}={float(m.activation_global_scale)!r}" for p, m in modules.items()
                        )
                    )


def _rebind(module: nn.Module, forward: Callable[..., Any]) -> _Rebound:
    """Replace ``module``'s forward (accelerate's ``_old_forward`` where its hook wraps it)."""
    attr = "_old_forward" if "_old_forward" in module.__dict__ else "forward"
    record = _Rebound(module, attr, module.__dict__.get(attr, _ABSENT))
    module.__dict__[attr] = forward
    return record


def _restore(record: _Rebound) -> None:
    if record.previous is _ABSENT:
        record.module.__dict__.pop(record.attr, None)
    else:
        record.module.__dict__[record.attr] = record.previous


def _stream_forward(state: _StreamState, index: int, layer: nn.Module, *args: Any, **kwargs: Any):
    hidden, call = _bind_call(layer, args, kwargs)
    out = _llama_layer_flow(layer, state.plans[index], state.codec, hidden, call)
    return (out,) if _returns_tuple(type(layer)) else out


def _exact_hidden(_module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
    """Pre-hook of an unselected layer or the final norm: a carrier becomes its exact value in
    the model dtype."""
    if args and isinstance(args[0], W4AActivation):
        return (args[0].exact(), *args[1:]), kwargs
    if isinstance(kwargs.get("hidden_states"), W4AActivation):
        return args, {**kwargs, "hidden_states": kwargs["hidden_states"].exact()}
    return None


def _final_norm_forward(original: Callable[..., Any], hidden: Any, *args: Any, **kwargs: Any):
    """The final norm after a selected last layer: RMSNorm of ``exact()`` in the model dtype."""
    if isinstance(hidden, W4AActivation):
        hidden = hidden.exact()
    return original(hidden, *args, **kwargs)


def _quantizers(
    policy: W4AStreamPolicy, depth: int, selected: tuple[int, ...], layers: nn.ModuleList
) -> dict[str, NVFP4BoundaryQuantizer]:
    out = {}
    for b in llama_stream_boundaries(depth, selected):
        lane = stream_lane(policy, b.layer, b.group)
        if b.key is None or not lane.nvfp4:
            continue
        device = layers[b.layer].input_layernorm.weight.device
        out[b.key] = NVFP4BoundaryQuantizer(b.key, layer=b.layer, recipe=lane.recipe, device=device)
    return out


def install_w4a_llama_stream(
    model: nn.Module,
    mode: str,
    recipe: str | None = None,
    global_scales: Mapping[str, float] | None = None,
    attention_mode: str | None = None,
    attention_recipe: str | None = None,
    mlp_fp8_layers: Iterable[int] | None = None,
    fused_norms: bool = False,
) -> W4AStreamPolicy:
    """Install the W4A activation stream on a Llama causal LM (see the module docstring).

    A decoder layer is selected when its seven projections are all W4A modules; its forward is
    rebound (accelerate's ``_old_forward`` where a hook wraps it) to take and return carriers.
    The final norm is rebound when the last layer is selected; unselected layers (and otherwise
    the final norm) get a pre-hook turning a carrier into its ``exact()`` value. Installing
    again with an equal policy only checks the model again.

    Args:
      model: a ``LlamaForCausalLM`` (``model.model.layers``) holding W4A modules.
      mode, recipe, global_scales, attention_mode, attention_recipe, mlp_fp8_layers,
        fused_norms: as :func:`w4a_stream_policy`; ``mlp_fp8_layers`` must also lie below the
        layer count, and ``global_scales`` must name exactly the NVFP4 producers
        (:func:`stream_producer_keys`).

    Returns:
      The installed :class:`W4AStreamPolicy`.

    Raises:
      ValueError: every :func:`w4a_stream_policy` refusal; not a Llama; no selected layer; a
        layer partly W4A (layer and projections named); a W4AFP8Linear in an NVFP4 lane;
        ``out_features`` not a multiple of 128; ``fused_norms`` with norm weights other than 1;
        q/k/v (gate/up) with different activation global scales under a headroom recipe; a
        ``mlp_fp8_layers`` entry beyond the layers; a global-scale key set that is not the
        producers'; a stream already installed with another policy (uninstall it first).
      TypeError: as :func:`w4a_stream_policy`.

    Numerics: see the module docstring; nothing is computed while installing.

    Example:
      >>> install_w4a_llama_stream(model, "w4a_nvfp4", attention_mode="w4afp8")  # doctest: +SKIP
    """
    where = "install_w4a_llama_stream"
    policy = _policy_of(
        mode, recipe, global_scales, attention_mode, attention_recipe, mlp_fp8_layers,
        fused_norms, where=where,
    )  # fmt: skip
    layers = _llama_layers(model, where=where)
    depth = len(layers)
    beyond = [i for i in policy.mlp_fp8_layers if i >= depth]
    if beyond:
        raise ValueError(
            f"{where}: mlp_fp8_layers {beyond} lie beyond the model's {depth} decoder layers"
        )
    selected = _selected_layers(layers, where=where)
    _check_layers(layers, selected, policy, where=where)
    if policy.global_scales is not None:
        validate_producer_scales(
            policy.global_scales, stream_producer_keys(policy, depth, selected)
        )
    state = _state(model)
    if state is not None:
        if state.policy != policy:
            raise ValueError(
                f"{where}: a stream with another policy is installed ({state.policy}); call "
                f"uninstall_w4a_llama_stream(model) first"
            )
        if state.selected != selected:
            raise ValueError(
                f"{where}: the installed stream streams layers {list(state.selected)}, the model "
                f"now has W4A layers {list(selected)}; call uninstall_w4a_llama_stream(model) "
                f"first"
            )
        return state.policy
    quantizers = _quantizers(policy, depth, selected, layers)
    if policy.global_scales is not None:
        for key, value in policy.global_scales.items():
            quantizers[key].set_scale(value)
    state = _StreamState(
        policy, depth, selected, stream_layer_plans(policy, depth, selected), quantizers,
        _RuntimeCodec(quantizers), [], [],
    )  # fmt: skip
    members = set(selected)
    for i, layer in enumerate(layers):
        if i in members:
            forward = functools.partial(_stream_forward, state, i, layer)
            state.rebound.append(_rebind(layer, forward))
        else:
            state.hooks.append(layer.register_forward_pre_hook(_exact_hidden, with_kwargs=True))
    norm = getattr(model.model, "norm", None)
    if isinstance(norm, nn.Module):
        if depth - 1 in members:
            original = norm.__dict__.get("_old_forward", norm.forward)
            state.rebound.append(_rebind(norm, functools.partial(_final_norm_forward, original)))
        else:
            state.hooks.append(norm.register_forward_pre_hook(_exact_hidden, with_kwargs=True))
    model.__dict__[_STATE] = state
    return policy


def uninstall_w4a_llama_stream(model: nn.Module) -> W4AStreamPolicy | None:
    """Remove an installed stream: forwards and hooks back as they were, quantizers dropped.

    Returns:
      The policy that was installed, or None when no stream was.

    Numerics: none.

    Example:
      >>> uninstall_w4a_llama_stream(torch.nn.Linear(2, 2)) is None
      True
    """
    state = model.__dict__.pop(_STATE, None)
    if state is None:
        return None
    for record in reversed(state.rebound):
        _restore(record)
    for handle in state.hooks:
        handle.remove()
    return state.policy


def installed_w4a_stream(model: nn.Module) -> W4AStreamPolicy | None:
    """The installed stream's policy, or None.

    Numerics: none.

    Example:
      >>> installed_w4a_stream(torch.nn.Linear(2, 2)) is None
      True
    """
    state = _state(model)
    return None if state is None else state.policy


def _installed(model: nn.Module, *, where: str) -> _StreamState:
    state = _state(model)
    if state is None:
        raise ValueError(f"{where}: no W4A stream is installed on this model")
    return state


def stream_boundary_quantizers(model: nn.Module) -> dict[str, NVFP4BoundaryQuantizer]:
    """The installed stream's NVFP4 producer quantizers by key, in execution order.

    The quantizers themselves (not copies): setting ``observer`` or calling ``set_scale`` acts
    on the stream. Prefer :func:`set_stream_global_scales` to set them all at once.

    Raises:
      ValueError: no stream is installed.

    Numerics: none.

    Example:
      >>> quantizers = stream_boundary_quantizers(model)  # doctest: +SKIP
      >>> quantizers["model.layers.0.output"].observer = print  # doctest: +SKIP
    """
    return dict(_installed(model, where="stream_boundary_quantizers").quantizers)


def set_stream_global_scales(model: nn.Module, scales: Mapping[str, float] | None) -> None:
    """Calibrate every NVFP4 producer of the installed stream at once, or return all to dynamic.

    Args:
      model: a model with an installed stream.
      scales: exactly the producer keys (:func:`stream_producer_keys`) with positive finite
        values (FP32-rounded), or None: every quantizer back to dynamic (scale 1.0, not
        calibrated).

    Raises:
      ValueError: no stream installed; a key set other than the producers' (missing and extra
        listed); a value not positive and finite in FP32; a headroom recipe. Nothing changes
        when it raises.
      TypeError: ``scales`` not a mapping of str to real numbers.

    Numerics: each value rounded once to FP32; the policy's ``global_scales`` are updated.

    Example:
      >>> set_stream_global_scales(model, None)  # doctest: +SKIP
    """
    where = "set_stream_global_scales"
    state = _installed(model, where=where)
    if scales is None:
        for quantizer in state.quantizers.values():
            quantizer.reset()
        state.policy = dataclasses.replace(state.policy, global_scales=None)
        return
    policy = _policy_of(
        state.policy.mode, state.policy.recipe, scales, state.policy.attention_mode,
        state.policy.attention_recipe, state.policy.mlp_fp8_layers, state.policy.fused_norms,
        where=where,
    )  # fmt: skip
    validate_producer_scales(policy.global_scales, state.quantizers)
    for key, value in policy.global_scales.items():
        state.quantizers[key].set_scale(value)
    state.policy = policy
