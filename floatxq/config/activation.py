"""W4A activation policies: :class:`ActivationConfig`, its attention and MLP refinements, and
:func:`backend_for_activation`.

Unlike the weight configs, these records carry their own dict form: it *is* the canonical payload
(``quantize_config.json``'s ``"activation"``), so ``to_dict`` / ``from_dict`` live here.
"""

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any, cast

import torch

from floatxq.config.values import BACKEND, _FrozenMapping
from floatxq.formats import (
    NVFP4_DEFAULT_RECIPE,
    W4A_ACTIVATION_MODES,
    NVFP4Recipe,
    W4AActivationMode,
    normalize_nvfp4_recipe,
    nvfp4_uses_headroom,
)

_GLOBAL_SCALE_PREFIX = "model.layers."


def _activation_mode(mode: object, *, where: str) -> W4AActivationMode:
    if not isinstance(mode, str) or mode not in W4A_ACTIVATION_MODES:
        raise ValueError(f"{where}: mode must be one of {W4A_ACTIVATION_MODES}, got {mode!r}")
    return cast(W4AActivationMode, str.__str__(mode))


def _fp8_without_recipe(recipe: object, *, where: str) -> None:
    if recipe is not None:
        raise ValueError(
            f"{where}: FP8 activations do not use an NVFP4 scale recipe, got recipe={recipe!r}"
        )


def _recipe_name_or_none(recipe: object, *, where: str) -> None:
    """An NVFP4 stream's recipe is a name or None (the default); ``False``, ``""`` or ``0`` are
    refused rather than read as "no recipe"."""
    if recipe is not None and (not isinstance(recipe, str) or not recipe):
        raise ValueError(
            f"{where}: recipe must be an NVFP4 recipe name (a non-empty string), or None for the "
            f"default {NVFP4_DEFAULT_RECIPE!r}; got {recipe!r:.80}"
        )


def _unknown_fields(payload: Mapping[str, Any], allowed: tuple[str, ...], *, where: str) -> None:
    extra = sorted(set(payload) - set(allowed))
    if extra:
        raise ValueError(
            f"{where}: unsupported field(s) {extra}; the accepted fields are {list(allowed)}"
        )


def _payload(value: object, *, where: str) -> Mapping[str, Any]:
    if not isinstance(value, Mapping) or not all(isinstance(k, str) for k in value):
        raise ValueError(f"{where}: expected a mapping with str keys, got {value!r:.80}")
    return value


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class ActivationAttentionConfig:
    """The attention projections' activation policy inside an NVFP4 stream (q/k/v/o inputs).

    Args:
      mode: ``"w4afp8"`` (the attention lane steps down to per-token FP8) or ``"w4a_nvfp4"``.
      recipe: NVFP4 only: the block-scale recipe (aliases accepted, stored canonical); required
        for NVFP4 (``ActivationConfig.from_dict`` fills it with the stream's).

    Raises:
      ValueError: an unknown mode or recipe, a recipe with FP8, no recipe with NVFP4.

    Numerics: none; names only.

    Example:
      >>> ActivationAttentionConfig(mode="w4a_nvfp4", recipe="lsq").to_dict()
      {'mode': 'w4a_nvfp4', 'recipe': 'least_squares'}
    """

    mode: W4AActivationMode
    recipe: NVFP4Recipe | None

    def __init__(self, *, mode: str = "w4afp8", recipe: str | None = None) -> None:
        where = "ActivationAttentionConfig"
        set_field = object.__setattr__
        set_field(self, "mode", _activation_mode(mode, where=where))
        if self.mode == "w4afp8":
            _fp8_without_recipe(recipe, where=where)
            set_field(self, "recipe", None)
            return
        if recipe is None:
            raise ValueError(f"{where}: an NVFP4 attention policy needs a recipe")
        set_field(self, "recipe", normalize_nvfp4_recipe(recipe))

    def to_dict(self) -> dict[str, Any]:
        """``{"mode"}`` plus ``"recipe"`` when set (the canonical stored form)."""
        out: dict[str, Any] = {"mode": self.mode}
        if self.recipe is not None:
            out["recipe"] = self.recipe
        return out


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class ActivationMlpConfig:
    """Decoder layers whose MLP activations step down from NVFP4 to per-token FP8.

    Args:
      mode: only ``"w4afp8"`` (promotion goes to FP8).
      layers: a non-empty list or tuple of distinct non-negative int layer indices (stored
        sorted; bools refused).

    Raises:
      ValueError: another mode; ``layers`` empty, not a list/tuple, with duplicates, negative or
        non-int (bool) entries.

    Numerics: none; layer indices only.

    Example:
      >>> ActivationMlpConfig(layers=[3, 0]).to_dict()
      {'mode': 'w4afp8', 'layers': [0, 3]}
    """

    mode: W4AActivationMode
    layers: tuple[int, ...]

    def __init__(self, *, mode: str = "w4afp8", layers: Sequence[int] = ()) -> None:
        where = "ActivationMlpConfig"
        if mode != "w4afp8":
            raise ValueError(f"{where}: mode must be 'w4afp8' (MLP promotion), got {mode!r}")
        if not isinstance(layers, (list, tuple)) or not layers:
            raise ValueError(f"{where}: layers must be a non-empty list or tuple, got {layers!r}")
        bad = [v for v in layers if isinstance(v, bool) or not isinstance(v, int) or v < 0]
        if bad:
            raise ValueError(
                f"{where}: layers must be non-negative ints (no bools), got e.g. {bad[:3]!r}"
            )
        if len(set(layers)) != len(layers):
            raise ValueError(f"{where}: layers must be distinct, got {list(layers)!r}")
        object.__setattr__(self, "mode", "w4afp8")
        object.__setattr__(self, "layers", tuple(sorted(int(v) for v in layers)))
        # (a tuple field: equal configs hash equal)

    def to_dict(self) -> dict[str, Any]:
        """``{"mode", "layers"}`` (the canonical stored form)."""
        return {"mode": self.mode, "layers": list(self.layers)}


def _fp32_global_scales(
    scales: object, recipes: Sequence[str | None], *, where: str
) -> Mapping[str, float]:
    """Calibrated producer scales: a non-empty ``{"model.layers....": positive finite}`` map,
    each value rounded through FP32 (and still positive and finite), read-only."""
    headroom = [r for r in recipes if r is not None and nvfp4_uses_headroom(r)]
    if headroom:
        raise ValueError(
            f"{where}: global_scales cannot be combined with the headroom recipe "
            f"{headroom[0]!r} (its scale is the headroom calibration's)"
        )
    if not isinstance(scales, Mapping) or not scales:
        raise ValueError(f"{where}: global_scales must be a non-empty mapping, got {scales!r:.80}")
    out: dict[str, float] = {}
    for key, value in scales.items():
        if not isinstance(key, str) or not key.startswith(_GLOBAL_SCALE_PREFIX):
            raise ValueError(
                f"{where}: global_scales keys must be strings starting with "
                f"{_GLOBAL_SCALE_PREFIX!r} (producer names), got {key!r}"
            )
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        if not ok or not (value > 0 and value != float("inf")):  # NaN fails the > 0
            raise ValueError(
                f"{where}: global_scales[{key!r}] must be a positive finite number, got {value!r}"
            )
        try:
            fp32 = float(torch.tensor(float(value), dtype=torch.float32).item())
        except OverflowError:  # an int beyond float64's range
            fp32 = float("inf")
        if not (fp32 > 0 and fp32 != float("inf")):
            shown = (
                f"an int of {value.bit_length()} bits" if isinstance(value, int) else repr(value)
            )
            raise ValueError(
                f"{where}: global_scales[{key!r}] = {shown} is {fp32!r} in FP32; it must stay "
                f"positive and finite"
            )
        out[str.__str__(key)] = fp32
    return _FrozenMapping(out)


_ACTIVATION_FIELDS = ("mode", "recipe", "attention", "mlp", "global_scales")


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class ActivationConfig:
    """A W4A activation policy: how a GPTQ model's linear inputs are quantized at runtime.

    Args:
      mode: ``"w4afp8"`` (per-token E4M3) or ``"w4a_nvfp4"``.
      recipe: NVFP4 only: the block-scale recipe (default ``least_squares``; aliases accepted,
        stored canonical).
      attention: NVFP4 only: an :class:`ActivationAttentionConfig` (or its dict) for the q/k/v/o
        inputs; an NVFP4 one without a recipe takes the stream's.
      mlp: NVFP4 only: an :class:`ActivationMlpConfig` (or its dict) promoting some layers' MLP
        inputs to FP8.
      global_scales: NVFP4 only, not with a headroom recipe: calibrated FP32 global scales per
        producer (``{"model.layers.<i>....": value}``), each rounded through FP32.

    Raises:
      ValueError: every refusal above (unknown modes and recipes, FP8 with a recipe or a
        refinement, bad layer lists, bad global-scale keys or values, one that is not positive
        and finite after rounding to FP32).

    Numerics: each global scale rounded once to FP32 (nearest-even), stored as that value.

    Example:
      >>> ActivationConfig.from_value("w4a_nvfp4").to_dict()
      {'mode': 'w4a_nvfp4', 'recipe': 'least_squares'}
      >>> ActivationConfig(mode="w4a_nvfp4", attention={"mode": "w4a_nvfp4"}).attention.recipe
      'least_squares'
    """

    mode: W4AActivationMode
    recipe: NVFP4Recipe | None
    attention: ActivationAttentionConfig | None
    mlp: ActivationMlpConfig | None
    global_scales: Mapping[str, float] | None

    def __init__(
        self,
        *,
        mode: str = "w4afp8",
        recipe: str | None = None,
        attention: ActivationAttentionConfig | Mapping[str, Any] | None = None,
        mlp: ActivationMlpConfig | Mapping[str, Any] | None = None,
        global_scales: Mapping[str, Any] | None = None,
    ) -> None:
        where = "ActivationConfig"
        set_field = object.__setattr__
        set_field(self, "mode", _activation_mode(mode, where=where))
        if self.mode == "w4afp8":
            _fp8_without_recipe(recipe, where=where)
            for name, value in (("attention", attention), ("mlp", mlp),
                                ("global_scales", global_scales)):  # fmt: skip
                if value is not None:
                    raise ValueError(
                        f"{where}: {name} refines an NVFP4 stream; mode 'w4afp8' takes none"
                    )
            for name in ("recipe", "attention", "mlp", "global_scales"):
                set_field(self, name, None)
            return
        _recipe_name_or_none(recipe, where=where)
        set_field(self, "recipe", normalize_nvfp4_recipe(recipe or NVFP4_DEFAULT_RECIPE))
        if isinstance(attention, Mapping):
            payload = _payload(attention, where=f"{where}.attention")
            _unknown_fields(payload, ("mode", "recipe"), where=f"{where}.attention")
            if "mode" not in payload:
                raise ValueError(f"{where}.attention: 'mode' is required")
            recipe = payload.get("recipe")
            if payload["mode"] == "w4a_nvfp4" and recipe is None:
                recipe = self.recipe  # an NVFP4 attention lane inherits the stream's recipe
            attention = ActivationAttentionConfig(mode=payload["mode"], recipe=recipe)
        elif attention is not None and not isinstance(attention, ActivationAttentionConfig):
            raise ValueError(
                f"{where}: attention must be an ActivationAttentionConfig or its dict, got "
                f"{type(attention).__name__}"
            )
        set_field(self, "attention", attention)
        if isinstance(mlp, Mapping):
            payload = _payload(mlp, where=f"{where}.mlp")
            _unknown_fields(payload, ("mode", "layers"), where=f"{where}.mlp")
            if set(payload) != {"mode", "layers"}:
                raise ValueError(f"{where}.mlp: 'mode' and 'layers' are both required")
            mlp = ActivationMlpConfig(mode=payload["mode"], layers=payload["layers"])
        elif mlp is not None and not isinstance(mlp, ActivationMlpConfig):
            raise ValueError(
                f"{where}: mlp must be an ActivationMlpConfig or its dict, got {type(mlp).__name__}"
            )
        set_field(self, "mlp", mlp)
        if global_scales is not None:
            recipes = [self.recipe]
            if attention is not None and attention.mode == "w4a_nvfp4":
                recipes.append(attention.recipe)
            global_scales = _fp32_global_scales(global_scales, recipes, where=where)
        set_field(self, "global_scales", global_scales)

    @classmethod
    def from_value(cls, value: object) -> "ActivationConfig | None":
        """None → None; an instance as it is; a mode string (NVFP4 gets ``least_squares``); a
        dict → :meth:`from_dict`. Anything else is a ``ValueError``."""
        if value is None or isinstance(value, cls):
            return value
        if isinstance(value, str):
            return cls(mode=_activation_mode(value, where="ActivationConfig.from_value"))
        if isinstance(value, Mapping):
            return cls.from_dict(value)
        raise ValueError(
            f"ActivationConfig.from_value: expected None, an ActivationConfig, a mode string or "
            f"a dict, got {type(value).__name__}"
        )

    @classmethod
    def from_dict(cls, payload: Mapping[str, Any]) -> "ActivationConfig":
        """The policy of a stored dict: fields ``mode`` (required), ``recipe``, ``attention``,
        ``mlp``, ``global_scales``; any other (GPT-QModel's removed ``version`` included) is a
        ``ValueError``."""
        where = "ActivationConfig.from_dict"
        payload = _payload(payload, where=where)
        _unknown_fields(payload, _ACTIVATION_FIELDS, where=where)
        if "mode" not in payload:
            raise ValueError(f"{where}: 'mode' is required")
        if payload["mode"] == "w4afp8":  # (refused here, before the annotations see a non-str)
            _fp8_without_recipe(payload.get("recipe"), where=where)
        else:
            _recipe_name_or_none(payload.get("recipe"), where=where)
        return cls(**dict(payload))

    def to_dict(self) -> dict[str, Any]:
        """``{"mode"}`` plus each set field (the canonical stored form; ``from_dict`` of it
        gives an equal config)."""
        out: dict[str, Any] = {"mode": self.mode}
        if self.recipe is not None:
            out["recipe"] = self.recipe
        if self.attention is not None:
            out["attention"] = self.attention.to_dict()
        if self.mlp is not None:
            out["mlp"] = self.mlp.to_dict()
        if self.global_scales is not None:
            out["global_scales"] = dict(self.global_scales)
        return out


def backend_for_activation(
    activation: ActivationConfig | None, backend: BACKEND | str | None = None
) -> BACKEND | None:
    """The backend a saved activation policy binds: ``GPTQ_W4AFP8`` or ``GPTQ_W4A_NVFP4``.

    Args:
      activation: the checkpoint's policy, or None (no binding: returns ``backend`` as given,
        normalized, or None).
      backend: what the caller asked for: None or ``auto`` resolve to the policy's backend; the
        policy's own backend is accepted; any other is a ``ValueError``.

    Returns:
      The bound backend (or ``backend`` normalized, or None, without a policy).

    Raises:
      ValueError: an explicit backend other than the policy's; an unknown backend name.

    Numerics: none; names only.

    Example:
      >>> backend_for_activation(ActivationConfig(mode="w4a_nvfp4"), "auto")
      <BACKEND.GPTQ_W4A_NVFP4: 'gptq_w4a_nvfp4'>
    """
    asked = None if backend is None else BACKEND(str(backend).strip().lower())
    if activation is None:
        return asked
    bound = BACKEND.GPTQ_W4AFP8 if activation.mode == "w4afp8" else BACKEND.GPTQ_W4A_NVFP4
    if asked not in (None, BACKEND.AUTO, bound):
        raise ValueError(
            f"backend_for_activation: a checkpoint with activation mode {activation.mode!r} "
            f"runs on backend {bound.value!r}; got backend={asked.value!r}"
        )
    return bound
