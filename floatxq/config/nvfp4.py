"""The NVFP4 weight config: :class:`NVFP4Config` and its ``dynamic`` rule normalizer.

A frozen record like :class:`~floatxq.config.FP8Config`: the hand-written ``__init__`` normalizes
the arguments (recipe aliases, rule mappings) and sets each field once.
"""

import dataclasses
from collections.abc import Mapping
from typing import Any, ClassVar, Literal

from floatxq.config.rules import DynamicRules, _module_overrides, _rules_or_none
from floatxq.config.values import METHOD, _check_bool, _frozen_meta
from floatxq.formats import NVFP4Recipe, normalize_nvfp4_recipe

__all__ = ["NVFP4_GLOBAL_SCALES", "NVFP4Config"]

NVFP4GlobalScale = Literal["module", "fused"]
NVFP4_GLOBAL_SCALES: tuple[NVFP4GlobalScale, ...] = ("module", "fused")
"""Where a weight's FP32 global scale comes from: its own amax (``"module"``), or the largest
amax of the sibling projections a serving engine fuses into one GEMM (``"fused"``: q/k/v,
gate/up), so that the fused weight has one global scale."""

_NVFP4_RULE_KEYS: tuple[str, ...] = ("recipe",)


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
    return out


def _recipe(value: Any, *, where: str) -> NVFP4Recipe:
    try:
        return normalize_nvfp4_recipe(value)
    except ValueError as exc:
        raise ValueError(f"{where}: {exc}") from None


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True, init=False)
class NVFP4Config:
    """NVFP4 weight-only quantization settings (NVFP4A16), with per-module ``dynamic`` rules.

    Each quantized linear stores E2M1 codes, E4M3 scales per block of 16 inputs and one FP32
    global scale, as :class:`~floatxq.nn.TorchFP4Linear` holds them. ``recipe`` is any floatxq
    NVFP4 block-scale recipe (legacy ``lsq*`` aliases accepted); ``global_scale`` is
    ``"module"`` or ``"fused"`` (:data:`NVFP4_GLOBAL_SCALES`); ``dynamic`` rules may override
    ``recipe``; ``lm_head`` quantizes the output embedding too; ``meta`` holds descriptive
    JSON-like entries carried into the saved files and not interpreted.

    Raises:
      ValueError: an unknown recipe or global-scale source, a rule overriding anything else.
      TypeError: ``lm_head`` not a bool, ``meta`` not a mapping.

    Numerics: names only; the recipes are described in ``docs/nvfp4.md``.

    Example:
      >>> cfg = NVFP4Config(recipe="lsq", dynamic={r".*down_proj": {"recipe": "exhaustive"}})
      >>> cfg.recipe, cfg.resolve("model.layers.0.mlp.down_proj").recipe
      ('least_squares', 'exhaustive')
    """

    method: ClassVar[METHOD] = METHOD.NVFP4
    recipe: NVFP4Recipe
    global_scale: NVFP4GlobalScale
    lm_head: bool
    dynamic: DynamicRules | None
    meta: Mapping[str, Any] | None

    def __init__(
        self,
        *,
        recipe: str = "nvidia",
        global_scale: str = "module",
        lm_head: bool = False,
        dynamic: Mapping[str, Mapping[str, Any] | None] | DynamicRules | None = None,
        meta: Mapping[str, Any] | None = None,
    ) -> None:
        if global_scale not in NVFP4_GLOBAL_SCALES:
            raise ValueError(
                f"global_scale: expected one of {list(NVFP4_GLOBAL_SCALES)}, got {global_scale!r}"
            )
        set_field = object.__setattr__
        set_field(self, "recipe", _recipe(recipe, where="recipe"))
        set_field(self, "global_scale", global_scale)
        set_field(self, "lm_head", _check_bool(lm_head, where="lm_head"))
        rules = DynamicRules.from_mapping(dynamic, normalize=_normalize_nvfp4_rule)
        set_field(self, "dynamic", _rules_or_none(rules))
        set_field(self, "meta", _frozen_meta(meta))

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
