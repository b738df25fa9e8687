"""The stream's plan: lanes, the five Llama boundaries per layer, the policy, layer plans.

Names and FP32 numbers only: nothing here touches a model.
"""

import dataclasses
import math
import numbers
from collections.abc import Iterable, Mapping
from typing import NamedTuple

import torch

from floatxq.config import _FrozenMapping
from floatxq.formats import (
    NVFP4_DEFAULT_RECIPE,
    W4A_ACTIVATION_MODES,
    NVFP4Recipe,
    W4AActivationMode,
    normalize_nvfp4_recipe,
    nvfp4_uses_headroom,
)

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

# (owner, boundary name, key suffix, consumer group) of the five boundaries, in execution order
_BOUNDARY_TABLE = (
    ("layer", "input", "input", "attention"),
    ("self_attn", "output", "self_attn.o_proj.input", "attention"),
    ("layer", "attention_residual", "post_attention_residual", "mlp"),
    ("mlp", "product", "mlp.down_proj.input", "mlp"),
    ("layer", "output", "output", "attention"),
)


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
        stream_recipe = normalize_nvfp4_recipe(NVFP4_DEFAULT_RECIPE if recipe is None else recipe)
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
