"""The NVFP4 weight config: :class:`NVFP4Config` and its ``dynamic`` rule normalizer.

A frozen record like :class:`~floatxq.config.FP8Config`: the hand-written ``__init__`` normalizes
the arguments (recipe aliases, rule mappings) and sets each field once.
"""

import dataclasses
from collections.abc import Mapping
from typing import Any, ClassVar, Literal

from floatxq.config.rules import DynamicRules, _module_overrides, _rules_or_none
from floatxq.config.values import METHOD, _check_bool, _check_real, _frozen_meta
from floatxq.formats import NVFP4_DEFAULT_RECIPE, NVFP4Recipe, normalize_nvfp4_recipe

__all__ = ["NVFP4_ACTIVATIONS", "NVFP4_GLOBAL_SCALES", "NVFP4_METHODS", "NVFP4Config"]

NVFP4GlobalScale = Literal["module", "fused"]
NVFP4_GLOBAL_SCALES: tuple[NVFP4GlobalScale, ...] = ("module", "fused")
"""Where a weight's FP32 global scale comes from: its own amax (``"module"``), or the largest
amax of the sibling projections a serving engine fuses into one GEMM (``"fused"``: q/k/v,
gate/up), so that the fused weight has one global scale."""

NVFP4Method = Literal["rtn", "gptq"]
NVFP4_METHODS: tuple[NVFP4Method, ...] = ("rtn", "gptq")
"""How the E2M1 codes are chosen: round to nearest on the recipe's grid (``"rtn"``, no data
needed), or GPTQ's column solve onto that grid with the recipe's block scales, calibrated layer
by layer (``"gptq"``: Hessian-aware rounding)."""

NVFP4Activations = Literal["nvfp4"]
NVFP4_ACTIVATIONS: tuple[NVFP4Activations, ...] = ("nvfp4",)
"""Activation quantization besides ``None`` (weight-only, NVFP4A16): ``"nvfp4"`` (W4A4) quantizes
each linear's input to NVFP4 per block of 16 at a static global scale calibrated per module
(stored as ``input_scale``; compressed-tensors files hold its reciprocal,
``input_global_scale``)."""

_NVFP4_RULE_KEYS: tuple[str, ...] = ("recipe", "method", "activations")


def _normalize_nvfp4_rule(key: str, overrides: Mapping[str, Any]) -> dict[str, Any]:
    """Validate one NVFP4 ``+:`` rule: its canonical overrides."""
    where = f"dynamic[{key!r}]"
    unknown = sorted(name for name in overrides if name not in _NVFP4_RULE_KEYS)
    if unknown:
        raise ValueError(
            f"{where}: unsupported NVFP4 override(s) {unknown}; accepted: {list(_NVFP4_RULE_KEYS)}"
        )
    out: dict[str, Any] = {}
    if "recipe" in overrides:
        out["recipe"] = _recipe(overrides["recipe"], where=f"{where}.recipe")
    if "method" in overrides:
        out["method"] = _choice(overrides["method"], NVFP4_METHODS, where=f"{where}.method")
    if "activations" in overrides:
        out["activations"] = _activations(overrides["activations"], where=f"{where}.activations")
    return out


def _choice(value: Any, accepted: tuple[str, ...], *, where: str) -> Any:
    if value not in accepted:
        raise ValueError(f"{where}: expected one of {list(accepted)}, got {value!r}")
    return value


def _activations(value: Any, *, where: str) -> NVFP4Activations | None:
    return None if value is None else _choice(value, NVFP4_ACTIVATIONS, where=where)


def _recipe(value: Any, *, where: str) -> NVFP4Recipe:
    try:
        return normalize_nvfp4_recipe(value)
    except ValueError as exc:
        raise ValueError(f"{where}: {exc}") from None


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True, init=False)
class NVFP4Config:
    """NVFP4 quantization settings (NVFP4A16 or W4A4), with per-module ``dynamic`` rules.

    Each quantized linear stores E2M1 codes, E4M3 scales per block of 16 inputs and one FP32
    global scale, as :class:`~floatxq.nn.TorchFP4Linear` holds them. ``recipe`` is any floatxq
    NVFP4 block-scale recipe (legacy ``lsq*`` aliases accepted); ``method`` is ``"rtn"`` or
    ``"gptq"`` (:data:`NVFP4_METHODS`; ``damp_percent`` is GPTQ's dampening, a fraction of the
    Hessian's mean diagonal); ``activations`` is None (weight-only) or ``"nvfp4"``
    (:data:`NVFP4_ACTIVATIONS`: W4A4 with a calibrated static global scale per module);
    ``global_scale`` is ``"module"`` or ``"fused"`` (:data:`NVFP4_GLOBAL_SCALES`); ``dynamic``
    rules may override ``recipe``, ``method`` and ``activations``; ``lm_head`` quantizes the
    output embedding too; ``meta`` holds descriptive JSON-like entries carried into the saved
    files and not interpreted. ``gptq`` and W4A4 need calibration text; RTN weight-only needs none.
    The default recipe is ``least_squares``: on the tiny Llama it is the cheapest recipe whose
    round-to-nearest NVFP4A16 model keeps KL against bf16 under 0.8× llm-compressor's (``nvidia``
    is 2.2× faster to quantize but 0.98×; ``benchmarks/RESULTS.md``).

    Raises:
      ValueError: an unknown recipe, method, activation kind or global-scale source, a
        ``damp_percent`` outside ``[0, 1)``, a rule overriding anything else.
      TypeError: ``lm_head`` not a bool, ``damp_percent`` not a number, ``meta`` not a mapping.

    Numerics: names only; the recipes are described in ``docs/nvfp4.md``.

    Example:
      >>> cfg = NVFP4Config(recipe="lsq", dynamic={r".*down_proj": {"recipe": "exhaustive"}})
      >>> cfg.recipe, cfg.resolve("model.layers.0.mlp.down_proj").recipe
      ('least_squares', 'exhaustive')
    """

    quant_method: ClassVar[METHOD] = METHOD.NVFP4
    """The checkpoint family (``"nvfp4"``): ``method`` here names the rounding, not the format."""
    recipe: NVFP4Recipe
    method: NVFP4Method
    activations: NVFP4Activations | None
    damp_percent: float
    global_scale: NVFP4GlobalScale
    lm_head: bool
    dynamic: DynamicRules | None
    meta: Mapping[str, Any] | None

    def __init__(
        self,
        *,
        recipe: str = NVFP4_DEFAULT_RECIPE,
        method: str = "rtn",
        activations: str | None = None,
        damp_percent: float = 0.01,
        global_scale: str = "module",
        lm_head: bool = False,
        dynamic: Mapping[str, Mapping[str, Any] | None] | DynamicRules | None = None,
        meta: Mapping[str, Any] | None = None,
    ) -> None:
        if global_scale not in NVFP4_GLOBAL_SCALES:
            raise ValueError(
                f"global_scale: expected one of {list(NVFP4_GLOBAL_SCALES)}, got {global_scale!r}"
            )
        damp = _check_real(damp_percent, where="damp_percent")
        if not 0.0 <= damp < 1.0:
            raise ValueError(f"damp_percent: got {damp!r}, accepted: 0 <= damp_percent < 1")
        set_field = object.__setattr__
        set_field(self, "recipe", _recipe(recipe, where="recipe"))
        set_field(self, "method", _choice(method, NVFP4_METHODS, where="method"))
        set_field(self, "activations", _activations(activations, where="activations"))
        set_field(self, "damp_percent", damp)
        set_field(self, "global_scale", global_scale)
        set_field(self, "lm_head", _check_bool(lm_head, where="lm_head"))
        rules = DynamicRules.from_mapping(dynamic, normalize=_normalize_nvfp4_rule)
        set_field(self, "dynamic", _rules_or_none(rules))
        set_field(self, "meta", _frozen_meta(meta))

    @property
    def needs_calibration(self) -> bool:
        """Whether any module may need calibration text: ``method="gptq"`` or W4A4, here or in
        a ``+:`` rule.

        Example:
          >>> NVFP4Config().needs_calibration, NVFP4Config(method="gptq").needs_calibration
          (False, True)
        """
        settings = [{"method": self.method, "activations": self.activations}]
        settings += [dict(rule.overrides) for rule in self.dynamic or () if not rule.exclude]
        return any(s.get("method") == "gptq" or s.get("activations") for s in settings)

    def resolve(self, module_name: str) -> "NVFP4Config | None":
        """The settings for one module (the first matching ``+:`` rule applied, ``dynamic``
        dropped), or None when a ``-:`` rule excludes it.

        Numerics: names only.

        Example:
          >>> NVFP4Config(dynamic={"-:.*k_proj": {}}).resolve("layers.0.k_proj") is None
          True
        """
        overrides = _module_overrides(self.dynamic, module_name)
        if overrides is None:
            return None
        return dataclasses.replace(self, **overrides, dynamic=None)
