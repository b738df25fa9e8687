"""Quantization payloads: the one place that reads and writes GPT-QModel's config keys.

A payload is the JSON object in ``quantize_config.json`` and in ``config.json``'s
``quantization_config``; floatxq and GPT-QModel each read what the other writes. Writing adds the
fields every payload of a method carries (``method`` and ``quant_method``, ``checkpoint_format``
equal to ``format``, ``pack_dtype: "int32"``; for FP8 also ``bits: 8``, ``group_size: -1``,
``desc_act: false``, ``sym: true`` and ``weight_scale_semantics: "inverse"``) and puts GPTQ's
solver settings into ``meta``, where GPT-QModel keeps them; keys whose value is None or ``{}``
are left out. An FP8 config with GSQ adds floatxq's ``gsq`` (every
:class:`~floatxq.config.GSQConfig` field by name) and ``gsq_calibration``. Reading takes what
either library wrote, legacy spellings included (FP8 ``fmt`` and ``weight_only``, GPTQ solver
settings at the top level), checks every carried field, rejects unknown keys (in ``gsq`` too),
and refuses settings whose feature floatxq does not have yet (an FP8 ``smoother`` or
``preprocessors``, a GPTQ ``rotation`` or ``adapter``) with a ValueError saying so, instead of
dropping them.

NVFP4 payloads are floatxq's own (GPT-QModel has none): ``quant_method: "nvfp4"`` and the
:class:`~floatxq.config.NVFP4Config` fields by name, where ``method`` is the rounding (``"rtn"`` or
``"gptq"``), not the checkpoint family.

Round trips are exact: ``config -> payload -> config`` gives an equal config, and
``payload -> config -> payload`` gives the same payload for every payload floatxq writes.
"""

from collections.abc import Callable, Mapping
from typing import Any

import torch

from floatxq.config import (
    METHOD,
    ActivationConfig,
    DynamicRules,
    FP8Config,
    GPTQConfig,
    GSQConfig,
    NVFP4Config,
)
from floatxq.formats import (
    normalize_fp8_format,
    normalize_fp8_scale_semantics,
    normalize_gptq_format,
)

_NOT_YET = "is not available yet in floatxq"

_SHARED_KEYS: frozenset[str] = frozenset(
    {
        "bits",
        "group_size",
        "desc_act",
        "sym",
        "lm_head",
        "method",
        "quant_method",
        "format",
        "checkpoint_format",
        "pack_dtype",
        "dynamic",
        "meta",
    }
)
"""The keys a payload of either method may carry (GPT-QModel's fields common to both)."""
_FP8_KEYS: frozenset[str] = _SHARED_KEYS | {
    "weight_scale_method",
    "weight_block_size",
    "weight_scale_semantics",
    "smoother",
    "preprocessors",
    "gsq",
    "gsq_calibration",
}
_FP8_LEGACY_KEYS: frozenset[str] = frozenset({"fmt", "weight_only", "smooth"})
_FP8_LEGACY_RULE_KEYS: tuple[str, ...] = ("fmt", "bits", "group_size", "weight_scale_semantics")

_GPTQ_META_SETTINGS: tuple[str, ...] = (
    "damp_percent",
    "damp_auto_increment",
    "static_groups",
    "act_group_aware",
    "mse",
)
"""GPTQConfig fields that a payload keeps in ``meta`` (older payloads: at the top level)."""
_GPTQ_KEYS: frozenset[str] = _SHARED_KEYS | {
    "rotation",
    "activation",
    "adapter",
    *_GPTQ_META_SETTINGS,
}


# --------------------------------------------------------------------------------------------
# Shared pieces
# --------------------------------------------------------------------------------------------


def payload_method(payload: Mapping[str, Any]) -> str | None:
    """The method a payload declares (``quant_method``, else ``method``), lower-case, or None.

    Numerics: names only.

    Example:
      >>> payload_method({"quant_method": "FP8"})
      'fp8'
    """
    value = payload.get("quant_method", payload.get("method"))
    return None if value is None else str.lower(str.strip(str(value)))


def payload_format(payload: Mapping[str, Any]) -> str | None:
    """The format a payload declares, as written: ``format``, legacy ``fmt``, or
    ``checkpoint_format``; None when it names none.

    Numerics: names only.

    Example:
      >>> payload_format({"fmt": "e5m2"})
      'e5m2'
    """
    for key in ("format", "fmt", "checkpoint_format"):
        if payload.get(key) is not None:
            return str(payload[key])
    return None


def _thaw(value: Any) -> Any:
    """The plain JSON form of a stored value: read-only mappings become dicts, tuples lists."""
    if isinstance(value, Mapping):
        return {key: _thaw(item) for key, item in value.items()}
    if isinstance(value, tuple):
        return [_thaw(item) for item in value]
    return value


def _rules_payload(rules: DynamicRules | None) -> dict[str, dict[str, Any]] | None:
    """``{key: overrides}`` in the rules' order; overrides whose value is None are left out."""
    if rules is None:
        return None
    return {
        rule.key: {name: _thaw(v) for name, v in rule.overrides.items() if v is not None}
        for rule in rules
    }


def _without_empty(payload: dict[str, Any]) -> dict[str, Any]:
    return {key: value for key, value in payload.items() if value is not None and value != {}}


def _as_dict(payload: Any, *, accepted: frozenset[str], where: str) -> dict[str, Any]:
    """A copy of ``payload``, after checking it is a mapping with only ``accepted`` keys."""
    if not isinstance(payload, Mapping):
        raise TypeError(f"payload: expected a mapping, got {type(payload).__name__} {payload!r}")
    unknown = sorted(repr(key) for key in payload if key not in accepted)
    if unknown:
        raise ValueError(
            f"{where}: unsupported field(s) {', '.join(unknown)}; accepted: "
            f"{', '.join(sorted(accepted))}"
        )
    return dict(payload)


def _pop_method(data: dict[str, Any], method: METHOD) -> None:
    """Remove ``quant_method`` and ``method``; each, when given, must name ``method``."""
    for key in ("quant_method", "method"):
        value = data.pop(key, method.value)
        if not isinstance(value, str) or str.lower(str.strip(value)) != method.value:
            raise ValueError(f"{key}: this reader takes {method.value!r} payloads; got {value!r}")


def _pop_checkpoint_format(
    data: dict[str, Any], canonical: Callable[[Any], Any], *, noun: str
) -> None:
    """Remove ``checkpoint_format``: it must name the same ``noun`` as ``format`` (and stands in
    for ``format`` when that is absent)."""
    if "checkpoint_format" not in data:
        return
    checkpoint_format = data.pop("checkpoint_format")
    if data.get("format") is None:
        data["format"] = checkpoint_format
        return
    try:
        same = canonical(checkpoint_format) == canonical(data["format"])
    except (TypeError, ValueError):
        same = False
    if not same:
        raise ValueError(
            f"checkpoint_format: must name the same {noun} as format={data['format']!r}; "
            f"got {checkpoint_format!r}"
        )


def _pop_pack_dtype(data: dict[str, Any]) -> None:
    """Remove ``pack_dtype``: FP8 and GPTQ payloads both store int32 words."""
    pack_dtype = data.pop("pack_dtype", "int32")
    if pack_dtype not in ("int32", "torch.int32") and pack_dtype is not torch.int32:
        raise ValueError(f"pack_dtype: payloads floatxq reads use 'int32'; got {pack_dtype!r}")


def _pop_forced(data: dict[str, Any], name: str, forced: Any, *, where: str, why: str) -> None:
    """Remove a field every such payload carries with one value; None stands for that value."""
    value = data.pop(name, None)
    if value is not None and (type(value) is not type(forced) or value != forced):
        raise ValueError(f"{where}{name}: {why}; got {value!r}, accepted: {forced!r} or None")


def _refuse(name: str, value: Any, *, feature: str) -> None:
    """A setting floatxq has no implementation of: anything but None, False or empty is an error."""
    empty = isinstance(value, (str, Mapping, list, tuple)) and len(value) == 0
    if value is None or value is False or empty:
        return
    raise ValueError(
        f"{name}: {feature} {_NOT_YET}; got {name}={value!r}. floatxq reads this payload only "
        f"without it"
    )


# --------------------------------------------------------------------------------------------
# FP8
# --------------------------------------------------------------------------------------------


def fp8_config_to_payload(config: FP8Config) -> dict[str, Any]:
    """GPT-QModel's FP8 payload for ``config``: plain JSON values, None and ``{}`` left out.

    Numerics: names only.

    Example:
      >>> payload = fp8_config_to_payload(FP8Config(weight_block_size=[128, 128]))
      >>> payload["checkpoint_format"], payload["weight_block_size"]
      ('float8_e4m3fn', [128, 128])
    """
    if not isinstance(config, FP8Config):
        raise TypeError(f"config: expected an FP8Config, got {type(config).__name__}")
    block = config.weight_block_size
    payload: dict[str, Any] = {
        "bits": 8,
        "group_size": -1,
        "desc_act": False,
        "lm_head": config.lm_head,
        "method": METHOD.FP8.value,
        "quant_method": METHOD.FP8.value,
        "format": config.format,
        "checkpoint_format": config.format,
        "pack_dtype": "int32",
        "weight_scale_method": config.weight_scale_method,
        "weight_block_size": list(block) if block is not None else None,
        "weight_scale_semantics": "inverse",
        "meta": _thaw(config.meta),
        "dynamic": _rules_payload(config.dynamic),
        "sym": True,
    }
    payload.update(fp8_gsq_record(config) or {})
    return _without_empty(payload)


_GSQ_FIELDS: tuple[str, ...] = (
    "enabled",
    "candidates",
    "steps",
    "learning_rate",
    "temperature_start",
    "temperature_end",
    "seed",
    "modules",
    "max_candidate_bytes",
    "learn_scales",
)
"""The :class:`~floatxq.config.GSQConfig` fields a payload's ``gsq`` object carries, all of them."""


def _gsq_payload(gsq: GSQConfig) -> dict[str, Any]:
    """``gsq``'s fields by name (``modules`` a list, or None for every module)."""
    return {name: _thaw(getattr(gsq, name)) for name in _GSQ_FIELDS}


FLOATXQ_KEY = "floatxq"
"""The object floatxq adds to a compressed-tensors payload, for what that format has no field
for: an FP8 config's GSQ settings (:func:`fp8_gsq_record`). compressed-tensors, transformers and
vLLM ignore keys they do not know."""


def fp8_gsq_record(config: FP8Config) -> dict[str, Any] | None:
    """``{"gsq": {every GSQConfig field}, "gsq_calibration": bool}`` for a config with GSQ, else
    None: the keys an FP8 payload carries, and the ``floatxq`` object of a compressed-tensors one.

    Numerics: names only.

    Example:
      >>> fp8_gsq_record(FP8Config(gsq=GSQConfig(steps=3)))["gsq"]["steps"]
      3
    """
    if not isinstance(config, FP8Config):
        raise TypeError(f"config: expected an FP8Config, got {type(config).__name__}")
    if config.gsq is None:
        return None
    return {"gsq": _gsq_payload(config.gsq), "gsq_calibration": config.gsq_calibration}


def fp8_gsq_from_record(record: Any) -> tuple[GSQConfig | None, bool]:
    """The ``(gsq, gsq_calibration)`` an :func:`fp8_gsq_record` object holds.

    Raises:
      TypeError, ValueError: ``record`` is not an object of those two keys, or a value the
        configs refuse (the key is named: ``gsq.steps``).

    Numerics: names only.
    """
    if not isinstance(record, Mapping):
        raise TypeError(
            f"expected an object with 'gsq' and 'gsq_calibration', got {type(record).__name__} "
            f"{record!r}"
        )
    unknown = sorted(repr(key) for key in record if key not in ("gsq", "gsq_calibration"))
    if unknown:
        raise ValueError(
            f"unsupported field(s) {', '.join(unknown)}; accepted: 'gsq', 'gsq_calibration'"
        )
    calibration = record.get("gsq_calibration", False)
    if not isinstance(calibration, bool):
        raise TypeError(f"gsq_calibration: expected a bool, got {calibration!r}")
    return _gsq_from_payload(record.get("gsq")), calibration


def _gsq_from_payload(value: Any) -> GSQConfig | None:
    """The ``gsq`` object of a payload as a :class:`~floatxq.config.GSQConfig` (None stays None).

    Unknown fields are refused here, the values by the config; every message names ``gsq.``."""
    if value is None:
        return None
    if not isinstance(value, Mapping):
        raise TypeError(
            f"gsq: expected an object of GSQConfig fields or null, got {type(value).__name__} "
            f"{value!r}"
        )
    unknown = [f"gsq.{key}" for key in value if key not in _GSQ_FIELDS]
    if unknown:
        raise ValueError(
            f"{', '.join(unknown)}: not a GSQConfig field; accepted: {', '.join(_GSQ_FIELDS)}"
        )
    try:
        return GSQConfig(**value)
    except (TypeError, ValueError) as exc:
        kind = TypeError if isinstance(exc, TypeError) else ValueError
        raise kind(f"gsq.{exc}") from None


def _fp8_carried(data: dict[str, Any], *, where: str) -> None:
    """Remove the fields an FP8 payload (or rule) carries with one value: bits, group_size,
    weight_scale_semantics; and at the top level desc_act and sym."""
    _pop_forced(data, "bits", 8, where=where, why="FP8 weights are 8-bit")
    _pop_forced(data, "group_size", -1, where=where, why="FP8 weights are not grouped")
    semantics = data.pop("weight_scale_semantics", None)
    try:
        normalize_fp8_scale_semantics(semantics)
    except ValueError as exc:
        raise ValueError(f"{where}{exc}") from None


def _fp8_rules(dynamic: Any) -> Any:
    """FP8 rules with their legacy spellings translated (``fmt``) and carried fields checked."""
    if not isinstance(dynamic, Mapping):
        return dynamic  # None, or a wrong kind FP8Config names
    rules: dict[Any, Any] = {}
    for key, value in dynamic.items():
        if not isinstance(value, Mapping) or (isinstance(key, str) and key.startswith("-:")):
            rules[key] = value  # FP8Config checks the kind; -: values are ignored
            continue
        rule = dict(value)
        fmt = rule.pop("fmt", None)
        if rule.get("format") is None and fmt is not None:
            rule["format"] = fmt
        _fp8_carried(rule, where=f"dynamic[{key!r}].")
        rules[key] = rule
    return rules


def fp8_config_from_payload(payload: Mapping[str, Any]) -> FP8Config:
    """Read an FP8 payload written by GPT-QModel or floatxq (legacy spellings included).

    ``method`` and ``quant_method`` must be ``"fp8"``; ``checkpoint_format`` must name the same
    dtype as ``format`` (and stands in for a missing one); legacy ``fmt`` stands in for a missing
    ``format``; ``bits`` 8, ``group_size`` -1, ``desc_act`` false, ``sym`` true,
    ``weight_scale_semantics`` ``"inverse"`` and ``pack_dtype`` ``"int32"`` are checked (None
    stands for each); legacy ``weight_only`` is accepted without a smoother. The rest builds the
    :class:`FP8Config`.

    Raises:
      TypeError: ``payload`` is not a mapping, or a field's value has the wrong kind.
      ValueError: an unknown key, a value that is not accepted (the key is named), or a
        ``smoother`` (legacy ``smooth``) or ``preprocessors``, which floatxq does not have yet.

    Numerics: names only.

    Example:
      >>> fp8_config_from_payload({"fmt": "e5m2", "quant_method": "fp8"}).format
      'float8_e5m2'
    """
    data = _as_dict(payload, accepted=_FP8_KEYS | _FP8_LEGACY_KEYS, where="FP8 payload")
    _pop_method(data, METHOD.FP8)
    _fp8_carried(data, where="")
    _pop_forced(data, "desc_act", False, where="", why="FP8 weights have no column order")
    _pop_forced(data, "sym", True, where="", why="FP8 weights are symmetric")
    _pop_pack_dtype(data)
    weight_only = data.pop("weight_only", None)
    if isinstance(weight_only, Mapping):
        for key in ("smoother", "smooth"):
            _refuse(f"weight_only.{key}", weight_only.get(key), feature="an FP8 smoother")
    elif weight_only is not None and not isinstance(weight_only, bool):
        raise ValueError(f"weight_only: expected a mapping, a bool or None; got {weight_only!r}")
    for key in ("smoother", "smooth"):
        _refuse(key, data.pop(key, None), feature="an FP8 smoother")
    _refuse("preprocessors", data.pop("preprocessors", None), feature="weight preprocessing")
    fmt = data.pop("fmt", None)
    if data.get("format") is None and fmt is not None:
        data["format"] = fmt
    _pop_checkpoint_format(data, normalize_fp8_format, noun="dtype")
    data["dynamic"] = _fp8_rules(data.get("dynamic"))
    data["gsq"] = _gsq_from_payload(data.get("gsq"))
    if data.get("gsq_calibration") is None:
        data.pop("gsq_calibration", None)
    return FP8Config(**data)


# --------------------------------------------------------------------------------------------
# GPTQ
# --------------------------------------------------------------------------------------------


def gptq_config_to_payload(config: GPTQConfig) -> dict[str, Any]:
    """GPT-QModel's GPTQ payload for ``config``; the solver settings go into ``meta``.

    ``meta`` holds the config's own entries and ``damp_percent``, ``damp_auto_increment``,
    ``static_groups``, ``act_group_aware`` and ``mse``.

    Numerics: names only.

    Example:
      >>> payload = gptq_config_to_payload(GPTQConfig())
      >>> payload["checkpoint_format"], payload["meta"]["damp_percent"]
      ('gptq', 0.05)
    """
    if not isinstance(config, GPTQConfig):
        raise TypeError(f"config: expected a GPTQConfig, got {type(config).__name__}")
    meta = _thaw(config.meta) if config.meta is not None else {}
    meta.update({name: getattr(config, name) for name in _GPTQ_META_SETTINGS})
    payload: dict[str, Any] = {
        "bits": config.bits,
        "group_size": config.group_size,
        "desc_act": config.desc_act,
        "sym": config.sym,
        "lm_head": config.lm_head,
        "method": METHOD.GPTQ.value,
        "quant_method": METHOD.GPTQ.value,
        "format": config.format,
        "checkpoint_format": config.format,
        "pack_dtype": "int32",
        "activation": None if config.activation is None else config.activation.to_dict(),
        "dynamic": _rules_payload(config.dynamic),
        "meta": meta,
    }
    return _without_empty(payload)


def gptq_config_from_payload(payload: Mapping[str, Any]) -> GPTQConfig:
    """Read a GPTQ payload written by GPT-QModel or floatxq.

    ``method`` and ``quant_method`` must be ``"gptq"``; ``checkpoint_format`` must equal
    ``format`` (and stands in for a missing one); ``pack_dtype`` must be ``"int32"``. The solver
    settings are read from ``meta`` or the top level (both at once must agree); the rest of
    ``meta`` becomes the config's ``meta``.

    Raises:
      TypeError: ``payload`` is not a mapping, or a field's value has the wrong kind.
      ValueError: an unknown key, a value that is not accepted (the key is named; a W4A
        ``activation`` policy is checked as :class:`~floatxq.config.ActivationConfig` and against
        the weight layout), or a ``rotation`` or an ``adapter``, which floatxq does not have yet.

    Numerics: names only.

    Example:
      >>> gptq_config_from_payload({"bits": 4, "meta": {"damp_percent": 0.1}}).damp_percent
      0.1
    """
    data = _as_dict(payload, accepted=_GPTQ_KEYS, where="GPTQ payload")
    _pop_method(data, METHOD.GPTQ)
    activation = data.pop("activation", None)
    if activation is not None:
        data["activation"] = ActivationConfig.from_value(activation)
    _refuse("rotation", data.pop("rotation", None), feature="a weight/activation rotation")
    _refuse("adapter", data.pop("adapter", None), feature="a LoRA/EoRA adapter")
    _pop_checkpoint_format(data, normalize_gptq_format, noun="packing format")
    if data.get("format") is None:
        data.pop("format", None)  # the default, "gptq"
    _pop_pack_dtype(data)
    meta = data.pop("meta", None)
    if meta is not None:
        if not isinstance(meta, Mapping):
            raise TypeError(f"meta: expected a mapping or None, got {type(meta).__name__} {meta!r}")
        meta = dict(meta)
        for name in _GPTQ_META_SETTINGS:
            if name not in meta:
                continue
            value = meta.pop(name)
            if name in data and data[name] != value:
                raise ValueError(
                    f"{name}: the payload gives {data[name]!r} at the top level and {value!r} in "
                    f"meta; give one value"
                )
            data[name] = value
        data["meta"] = meta
    return GPTQConfig(**data)


_NVFP4_KEYS: frozenset[str] = frozenset(
    {"quant_method", "method", "recipe", "activations", "damp_percent", "global_scale",
     "lm_head", "dynamic", "meta"}
)  # fmt: skip


def nvfp4_config_to_payload(config: NVFP4Config) -> dict[str, Any]:
    """floatxq's NVFP4 payload for ``config``: plain JSON values, None and ``{}`` left out.

    Numerics: names only.

    Example:
      >>> nvfp4_config_to_payload(NVFP4Config(method="gptq"))["quant_method"]
      'nvfp4'
    """
    if not isinstance(config, NVFP4Config):
        raise TypeError(f"config: expected an NVFP4Config, got {type(config).__name__}")
    payload: dict[str, Any] = {
        "quant_method": METHOD.NVFP4.value,
        "method": config.method,
        "recipe": config.recipe,
        "activations": config.activations,
        "damp_percent": config.damp_percent,
        "global_scale": config.global_scale,
        "lm_head": config.lm_head,
        "dynamic": _rules_payload(config.dynamic),
        "meta": _thaw(config.meta),
    }
    return _without_empty(payload)


def nvfp4_config_from_payload(payload: Mapping[str, Any]) -> NVFP4Config:
    """Read an NVFP4 payload written by :func:`nvfp4_config_to_payload`.

    ``quant_method`` must be ``"nvfp4"`` (any case); the other keys are
    :class:`~floatxq.config.NVFP4Config`'s arguments, checked by it.

    Raises:
      TypeError: ``payload`` is not a mapping, or a field's value has the wrong kind.
      ValueError: an unknown key, another ``quant_method``, a value the config refuses.

    Numerics: names only.

    Example:
      >>> nvfp4_config_from_payload({"quant_method": "nvfp4", "recipe": "lsq"}).recipe
      'least_squares'
    """
    data = _as_dict(payload, accepted=_NVFP4_KEYS, where="NVFP4 payload")
    family = data.pop("quant_method", METHOD.NVFP4.value)
    if not isinstance(family, str) or family.lower() != METHOD.NVFP4.value:
        raise ValueError(f"quant_method: expected 'nvfp4' in an NVFP4 payload, got {family!r}")
    return NVFP4Config(**data)


__all__ = [
    "FLOATXQ_KEY",
    "fp8_config_from_payload",
    "fp8_config_to_payload",
    "fp8_gsq_from_record",
    "fp8_gsq_record",
    "gptq_config_from_payload",
    "gptq_config_to_payload",
    "nvfp4_config_from_payload",
    "nvfp4_config_to_payload",
    "payload_format",
    "payload_method",
]
