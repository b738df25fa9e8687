"""Weight configs: :class:`FP8Config` and :class:`GPTQConfig`, each with its ``dynamic`` rule
normalizer.

Configs are ``@dataclass(frozen=True, slots=True, kw_only=True)`` records with a hand-written
``__init__``: it normalizes the arguments (aliases, lists, rule mappings) and then sets each field
once, so every field holds what its annotation says (``FP8Config.format`` is always an FP8 dtype
name, never a ``torch.dtype`` or ``None``). Configs are hashable, and ``dataclasses.replace``
normalizes its changes the same way. Serialization is not here: GPT-QModel's payload keys, legacy
aliases and forced fields are read and written by :mod:`floatxq.interop.payload`.
"""

import dataclasses
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any, ClassVar, cast

import torch

from floatxq.config.activation import ActivationConfig
from floatxq.config.gsq import GSQConfig
from floatxq.config.rules import DynamicRules, _module_overrides, _rules_or_none
from floatxq.config.values import METHOD, _check_bool, _check_int, _check_real, _frozen_meta
from floatxq.formats import (
    GPTQ_BITS,
    K_GROUP,
    FP8ScaleMethod,
    FP8WeightFormat,
    GPTQFormat,
    normalize_fp8_block_size,
    normalize_fp8_scale_method,
    normalize_fp8_weight_format,
    normalize_gptq_format,
)

# --------------------------------------------------------------------------------------------
# FP8Config
# --------------------------------------------------------------------------------------------

_FP8_RULE_KEYS: tuple[str, ...] = ("format", "weight_scale_method", "weight_block_size")


def _fp8_scale_layout(
    method: Any, block: Any, *, where: str
) -> tuple[FP8ScaleMethod, tuple[int, int] | None]:
    """``(weight_scale_method, weight_block_size)``: the block size normalized, the method
    resolved against it (None means ``block`` with a block size, else ``row``)."""
    try:
        size = normalize_fp8_block_size(block)
        name = normalize_fp8_scale_method(method, weight_block_size=size)
    except ValueError as exc:
        raise ValueError(f"{where}{exc}") from None
    return cast(FP8ScaleMethod, name), size


def _normalize_fp8_rule(key: str, overrides: Mapping[str, Any]) -> dict[str, Any]:
    """Validate one FP8 ``+:`` rule: its canonical overrides, ready for ``dataclasses.replace``.

    A rule that names ``weight_scale_method`` or ``weight_block_size`` stores both (the method
    resolved against the rule's own block size), so the pair is replaced together.
    """
    where = f"dynamic[{key!r}]"
    unknown = sorted(name for name in overrides if name not in _FP8_RULE_KEYS)
    if unknown:
        raise ValueError(
            f"{where}: unsupported FP8 override(s) {unknown}; accepted: {list(_FP8_RULE_KEYS)}"
        )
    out: dict[str, Any] = {}
    if "format" in overrides:
        out["format"] = normalize_fp8_weight_format(overrides["format"], where=f"{where}.format")
    if "weight_scale_method" in overrides or "weight_block_size" in overrides:
        method, block = _fp8_scale_layout(
            overrides.get("weight_scale_method"),
            overrides.get("weight_block_size"),
            where=f"{where}: ",
        )
        out["weight_scale_method"] = method
        out["weight_block_size"] = block
    return out


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True, init=False)
class FP8Config:
    """FP8 weight-only quantization settings (inverse scales), with per-module ``dynamic`` rules.

    Arguments are normalized before the fields are set: ``format`` (a name, an alias, ``"fp8"``,
    ``FORMAT.FP8``, None or an FP8 ``torch.dtype``) becomes the torch dtype name, and the
    decode-only ``float8_e8m0fnu`` is rejected; ``weight_block_size`` (a pair) becomes a
    ``(rows, cols)`` tuple; ``weight_scale_method`` is resolved against it (None means
    ``"block"`` with a block size, else ``"row"``); ``dynamic`` becomes :class:`DynamicRules`
    (None when empty) and ``meta`` a read-only mapping (None when empty). ``dynamic`` rules may
    override ``format``, ``weight_scale_method`` and ``weight_block_size``. ``meta`` holds
    descriptive JSON-like entries (who quantized, with what) carried into the saved payload and
    not interpreted. ``gsq`` (a :class:`~floatxq.config.GSQConfig`) refines the codes after
    round to nearest, weight-only, or weighted by the calibration Hessian with
    ``gsq_calibration=True`` (needs ``row`` or ``block`` scales, in every rule too, and data).
    ``lifecycle.payload`` reads and writes GPT-QModel's ``quantize_config.json`` for this config.

    Numerics: names only; the scales are described in ``docs/numerics.md``.

    Example:
      >>> rules = {r".*down_proj": {"format": "e5m2"}}
      >>> cfg = FP8Config(format="e4m3", weight_block_size=[128, 128], dynamic=rules)
      >>> cfg.weight_scale_method, cfg.resolve("model.layers.0.mlp.down_proj").format
      ('block', 'float8_e5m2')
    """

    method: ClassVar[METHOD] = METHOD.FP8
    quant_method: ClassVar[METHOD] = METHOD.FP8
    format: FP8WeightFormat
    weight_scale_method: FP8ScaleMethod
    weight_block_size: tuple[int, int] | None
    lm_head: bool
    dynamic: DynamicRules | None
    meta: Mapping[str, Any] | None
    gsq: GSQConfig | None
    gsq_calibration: bool

    def __init__(
        self,
        *,
        format: str | torch.dtype | None = "float8_e4m3fn",
        weight_scale_method: str | None = None,
        weight_block_size: Sequence[int] | None = None,
        lm_head: bool = False,
        dynamic: Mapping[str, Mapping[str, Any] | None] | DynamicRules | None = None,
        meta: Mapping[str, Any] | None = None,
        gsq: GSQConfig | None = None,
        gsq_calibration: bool = False,
    ) -> None:
        method, block = _fp8_scale_layout(weight_scale_method, weight_block_size, where="")
        calibrated = _check_bool(gsq_calibration, where="gsq_calibration")
        _check_gsq(gsq, calibrated, method)
        set_field = object.__setattr__
        set_field(self, "format", normalize_fp8_weight_format(format, where="format"))
        set_field(self, "weight_scale_method", method)
        set_field(self, "weight_block_size", block)
        set_field(self, "lm_head", _check_bool(lm_head, where="lm_head"))
        rules = DynamicRules.from_mapping(dynamic, normalize=_normalize_fp8_rule)
        set_field(self, "dynamic", _rules_or_none(rules))
        set_field(self, "meta", _frozen_meta(meta))
        for rule in (self.dynamic or ()) if calibrated else ():
            if not rule.exclude and rule.overrides.get("weight_scale_method") == "tensor":
                raise ValueError(
                    f"dynamic[{rule.key!r}]: tensor scales, but gsq_calibration=True needs 'row' "
                    f"or 'block' scales for every module it refines"
                )
        set_field(self, "gsq", gsq)
        set_field(self, "gsq_calibration", calibrated)

    @property
    def needs_calibration(self) -> bool:
        """Whether quantizing needs calibration text: GSQ enabled with ``gsq_calibration``.

        Example:
          >>> FP8Config(gsq=GSQConfig(), gsq_calibration=True).needs_calibration
          True
        """
        return self.gsq is not None and self.gsq.enabled and self.gsq_calibration

    def resolve(self, module_name: str) -> "FP8Config | None":
        """The settings for one module, or None when a ``-:`` rule excludes it.

        The first matching rule (see :class:`DynamicRules`) is applied on top of this config with
        ``dataclasses.replace`` and the result has ``dynamic=None``; with no matching rule the
        result is this config without rules. A rule that names ``weight_scale_method`` or
        ``weight_block_size`` replaces both (``{"weight_block_size": [64, 64]}`` means block
        scaling, ``{"weight_scale_method": "row"}`` drops the base block size); a rule that names
        neither keeps this config's pair.

        Numerics: names only; no tensor math.

        Example:
          >>> FP8Config(dynamic={"-:lm_head": {}}).resolve("lm_head") is None
          True
        """
        overrides = _module_overrides(self.dynamic, module_name)
        if overrides is None:
            return None
        return dataclasses.replace(self, **overrides, dynamic=None)


def _check_gsq(gsq: Any, calibration: bool, method: str) -> None:
    """``gsq`` is None or a :class:`GSQConfig`; ``gsq_calibration`` needs one (enabled) and a
    ``row`` or ``block`` scale layout."""
    if gsq is not None and not isinstance(gsq, GSQConfig):
        raise TypeError(f"gsq: expected a GSQConfig or None, got {type(gsq).__name__} {gsq!r}")
    if not calibration:
        return
    if gsq is None or not gsq.enabled:
        raise ValueError(
            "gsq_calibration=True weights GSQ's objective by the calibration Hessian, but GSQ "
            "is off; pass gsq=GSQConfig() as well"
        )
    if method == "tensor":
        raise ValueError(
            "gsq_calibration=True needs weight_scale_method 'row' or 'block' (calibrated GSQ "
            "refines each output row on its own); got 'tensor'"
        )


# --------------------------------------------------------------------------------------------
# GPTQConfig
# --------------------------------------------------------------------------------------------

_GPTQ_RULE_KEYS: tuple[str, ...] = (
    "bits",
    "group_size",
    "sym",
    "desc_act",
    "static_groups",
    "act_group_aware",
    "damp_percent",
    "damp_auto_increment",
    "mse",
)
"""The settings a GPTQ ``dynamic`` rule may override: those of the solver."""


def _gptq_bits(value: Any, *, where: str) -> int:
    bits = _check_int(value, where=where)
    if bits not in GPTQ_BITS:
        raise ValueError(f"{where}: got {bits!r}, accepted: {list(GPTQ_BITS)}")
    return bits


def _gptq_group_size(value: Any, *, where: str) -> int:
    group_size = _check_int(value, where=where)
    if group_size != -1 and group_size <= 0:
        raise ValueError(
            f"{where}: got {group_size!r}, accepted: -1 (one group per row) or a positive int"
        )
    return group_size


def _gptq_damp(value: Any, *, where: str) -> float:
    damp = _check_real(value, where=where)
    if not 0.0 < damp < 1.0:
        raise ValueError(f"{where}: got {damp!r}, accepted: 0 < damp_percent < 1")
    return damp


def _non_negative(value: Any, *, where: str) -> float:
    number = _check_real(value, where=where)
    if number < 0:
        raise ValueError(f"{where}: got {number!r}, accepted: a finite number >= 0")
    return number


def _normalize_gptq_rule(key: str, overrides: Mapping[str, Any]) -> dict[str, Any]:
    """Validate one GPTQ ``+:`` rule: its canonical overrides, ready for ``dataclasses.replace``.

    A rule that turns ``desc_act`` on without naming ``act_group_aware`` also turns group-aware
    reordering off (the two cannot be combined), so resolving it never builds an invalid config.
    """
    where = f"dynamic[{key!r}]"
    unknown = sorted(name for name in overrides if name not in _GPTQ_RULE_KEYS)
    if unknown:
        raise ValueError(
            f"{where}: unsupported GPTQ override(s) {unknown}; accepted: {list(_GPTQ_RULE_KEYS)}"
        )
    checks: dict[str, Callable[..., Any]] = {
        "bits": _gptq_bits,
        "group_size": _gptq_group_size,
        "sym": _check_bool,
        "desc_act": _check_bool,
        "static_groups": _check_bool,
        "act_group_aware": _check_bool,
        "damp_percent": _gptq_damp,
        "damp_auto_increment": _non_negative,
        "mse": _non_negative,
    }
    out = {name: checks[name](overrides[name], where=f"{where}.{name}") for name in overrides}
    if out.get("desc_act") and "act_group_aware" not in out:
        out["act_group_aware"] = False
    return out


_W4A_LAYOUT: tuple[tuple[str, Any], ...] = (
    ("bits", 4),
    ("group_size", K_GROUP),
    ("sym", True),
    ("desc_act", False),
    ("lm_head", False),
)
"""The GPTQ settings the W4A GEMMs read (4-bit symmetric groups of 128 in K order, no output
embedding)."""
_W4A_FIXED_RULE_KEYS = ("bits", "group_size", "sym", "desc_act")


def _check_w4a_layout(config: "GPTQConfig", rules: DynamicRules) -> None:
    """Refuse an activation policy on a weight layout the W4A GEMMs cannot read (one message
    listing every conflict), or with ``dynamic`` rules that change that layout per module."""
    conflicts = [
        f"{name}={getattr(config, name)!r} (needs {want!r})"
        for name, want in _W4A_LAYOUT
        if getattr(config, name) != want
    ]
    if conflicts:
        raise ValueError(
            f"activation: a W4A activation policy (mode {config.activation.mode!r}) runs 4-bit "
            f"symmetric GPTQ weights in groups of {K_GROUP} without desc_act or lm_head; this "
            f"config "
            f"has {', '.join(conflicts)}"
        )
    for rule in rules:
        fixed = sorted(name for name in rule.overrides if name in _W4A_FIXED_RULE_KEYS)
        if fixed:
            raise ValueError(
                f"dynamic[{rule.key!r}]: overrides {fixed}, which an activation policy fixes "
                f"for every module (bits=4, group_size={K_GROUP}, sym=True, desc_act=False); "
                f"exclude "
                f"the module with a '-:' rule instead"
            )


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True, init=False)
class GPTQConfig:
    """GPTQ (INT weight, Hessian-guided) quantization settings, with per-module ``dynamic`` rules.

    Fields: ``bits`` in ``GPTQ_BITS``; ``group_size`` -1 (one group per output row) or positive;
    ``0 < damp_percent < 1``; ``damp_auto_increment >= 0``; ``mse >= 0`` (the exponent of the
    optional scale search; 0 turns it off); ``format`` ``"gptq"`` (v1 zero points) or
    ``"gptq_v2"``; ``lm_head`` whether the output embedding is quantized; ``desc_act=None`` means
    False. ``act_group_aware`` defaults to True, but ``desc_act=True`` turns it off with a warning;
    both True is an error, also where a ``dynamic`` rule combines with this config into both.
    ``dynamic`` rules may override the solver settings (all fields but ``lm_head``, ``format``,
    ``activation``, ``meta``); ``meta`` holds descriptive JSON-like entries, never a field's name.

    ``activation`` (see :meth:`ActivationConfig.from_value`) makes the model a W4A one: its GPTQ
    weights run against quantized activations (FP8 per token, or NVFP4), the solve replays that
    policy, and a saved checkpoint binds the matching backend. The W4A GEMMs read one weight
    layout, so a policy requires ``bits=4``, ``group_size=128`` (``K_GROUP``), ``sym=True``,
    ``desc_act=False``, ``lm_head=False``, and no ``dynamic`` rule may override the first four
    (``-:`` exclusions and the other solver settings are allowed).

    Numerics: names only; the solver is described in ``docs/numerics.md``.

    Example:
      >>> cfg = GPTQConfig(bits=4, group_size=128, dynamic={r".*down_proj": {"bits": 8}})
      >>> cfg.act_group_aware, cfg.resolve("model.layers.0.mlp.down_proj").bits
      (True, 8)
    """

    method: ClassVar[METHOD] = METHOD.GPTQ
    quant_method: ClassVar[METHOD] = METHOD.GPTQ
    bits: int
    group_size: int
    sym: bool
    desc_act: bool
    static_groups: bool
    act_group_aware: bool
    damp_percent: float
    damp_auto_increment: float
    mse: float
    lm_head: bool
    format: GPTQFormat
    activation: "ActivationConfig | None"
    dynamic: DynamicRules | None
    meta: Mapping[str, Any] | None

    def __init__(
        self,
        *,
        bits: int = 4,
        group_size: int = K_GROUP,
        sym: bool = True,
        desc_act: bool | None = False,
        static_groups: bool = False,
        act_group_aware: bool | None = None,
        damp_percent: float | int = 0.05,
        damp_auto_increment: float | int = 0.01,
        mse: float | int = 0.0,
        lm_head: bool = False,
        format: str = "gptq",
        activation: "ActivationConfig | Mapping[str, Any] | str | None" = None,
        dynamic: Mapping[str, Mapping[str, Any] | None] | DynamicRules | None = None,
        meta: Mapping[str, Any] | None = None,
    ) -> None:
        descending = False if desc_act is None else _check_bool(desc_act, where="desc_act")
        if act_group_aware is None:
            group_aware = not descending
            if descending:
                warnings.warn(
                    "GPTQConfig: desc_act=True turns act_group_aware off; set "
                    "act_group_aware=False explicitly to silence this warning",
                    UserWarning,
                    stacklevel=2,
                )
        else:
            group_aware = _check_bool(act_group_aware, where="act_group_aware")
            if group_aware and descending:
                raise ValueError(
                    "act_group_aware: act_group_aware=True requires desc_act=False; set only one "
                    "of them (group-aware reordering keeps groups contiguous, desc_act does not)"
                )
        rules = DynamicRules.from_mapping(dynamic, normalize=_normalize_gptq_rule)
        for rule in rules:
            merged_desc = rule.overrides.get("desc_act", descending)
            if merged_desc and rule.overrides.get("act_group_aware", group_aware):
                raise ValueError(
                    f"dynamic[{rule.key!r}]: with this config the rule gives desc_act=True and "
                    f"act_group_aware=True, which cannot be combined; set act_group_aware=False "
                    f"in the rule or turn desc_act off"
                )
        frozen_meta = _frozen_meta(meta)
        fields = [field.name for field in dataclasses.fields(self)]
        reserved = sorted(key for key in frozen_meta or () if key in fields)
        if reserved:
            raise ValueError(
                f"meta: {reserved} are GPTQConfig fields; pass them as fields (meta holds "
                f"descriptive entries only)"
            )
        set_field = object.__setattr__
        set_field(self, "bits", _gptq_bits(bits, where="bits"))
        set_field(self, "group_size", _gptq_group_size(group_size, where="group_size"))
        set_field(self, "sym", _check_bool(sym, where="sym"))
        set_field(self, "desc_act", descending)
        set_field(self, "static_groups", _check_bool(static_groups, where="static_groups"))
        set_field(self, "act_group_aware", group_aware)
        set_field(self, "damp_percent", _gptq_damp(damp_percent, where="damp_percent"))
        set_field(
            self,
            "damp_auto_increment",
            _non_negative(damp_auto_increment, where="damp_auto_increment"),
        )
        set_field(self, "mse", _non_negative(mse, where="mse"))
        set_field(self, "lm_head", _check_bool(lm_head, where="lm_head"))
        set_field(self, "format", normalize_gptq_format(format, where="GPTQConfig"))
        set_field(self, "activation", ActivationConfig.from_value(activation))
        set_field(self, "dynamic", _rules_or_none(rules))
        set_field(self, "meta", frozen_meta)
        if self.activation is not None:
            _check_w4a_layout(self, rules)

    def resolve(self, module_name: str) -> "GPTQConfig | None":
        """The settings for one module, or None when a ``-:`` rule excludes it.

        The first matching rule (see :class:`DynamicRules`) is applied on top of this config with
        ``dataclasses.replace`` and the result has ``dynamic=None``.

        Numerics: names only; no tensor math.

        Example:
          >>> GPTQConfig(dynamic={"-:lm_head": {}}).resolve("lm_head") is None
          True
        """
        overrides = _module_overrides(self.dynamic, module_name)
        if overrides is None:
            return None
        return dataclasses.replace(self, **overrides, dynamic=None)
