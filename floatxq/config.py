"""Frozen configs and ``str`` enums: METHOD, FORMAT, BACKEND, dynamic rules and FP8Config.

Nothing here touches tensor data. Configs are ``@dataclass(frozen=True, slots=True, kw_only=True)``
records, validated and normalized in ``__post_init__``; they are hashable and serialize to the
reference's ``quantize_config.json`` keys with ``to_dict()`` / ``from_dict()`` round-tripping
exactly.

Per-module rules (``dynamic``) are shared by every config: :class:`DynamicRules` parses the
``{"+:regex" | "-:regex" | "regex": overrides}`` mapping once, with a per-config normalizer for the
override values, and answers "which rule applies to this module?".
"""

import dataclasses
import enum
import re
import warnings
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch

from floatxq.formats import (
    FP8_DECODE_ONLY_FORMATS,
    FP8_FORMATS,
    normalize_fp8_block_size,
    normalize_fp8_format,
    normalize_fp8_kwargs,
    normalize_fp8_scale_method,
    normalize_fp8_scale_semantics,
)

# --------------------------------------------------------------------------------------------
# Enums
# --------------------------------------------------------------------------------------------


class _StrEnum(str, enum.Enum):
    """A ``str`` enum whose ``str()`` and f-string form is the bare value."""

    def __str__(self) -> str:
        return str.__str__(self)


class METHOD(_StrEnum):
    """Quantization method. ``METHOD.FP8 == "fp8"``; ``str(METHOD.GPTQ) == "gptq"``."""

    FP8 = "fp8"
    GPTQ = "gptq"


class FORMAT(_StrEnum):
    """Checkpoint format family. ``FORMAT.FP8`` also names the default FP8 dtype (E4M3)."""

    FP8 = "fp8"
    GPTQ = "gptq"
    GPTQ_V2 = "gptq_v2"


class BACKEND(_StrEnum):
    """Inference backend. ``AUTO`` lets the loader pick; the others force one kernel family."""

    AUTO = "auto"
    FP8_TORCH = "fp8_torch"
    GPTQ_TORCH = "gptq_torch"
    GPTQ_W4AFP8 = "gptq_w4afp8"
    GPTQ_W4A_NVFP4 = "gptq_w4a_nvfp4"
    MLX = "mlx"


# --------------------------------------------------------------------------------------------
# Immutable JSON-like values (meta, smoother, rule overrides)
# --------------------------------------------------------------------------------------------


class _FrozenMapping(Mapping[str, Any]):
    """Read-only, hashable ``str``-keyed mapping; compares equal to a dict with the same items."""

    __slots__ = ("_data",)

    def __init__(self, data: Mapping[str, Any]) -> None:
        self._data = dict(data)

    def __getitem__(self, key: object) -> Any:
        return self._data[key]  # type: ignore[index]

    def __iter__(self) -> Iterator[str]:
        return iter(self._data)

    def __len__(self) -> int:
        return len(self._data)

    def __hash__(self) -> int:
        return hash(frozenset(self._data.items()))

    def __repr__(self) -> str:
        return f"FrozenMapping({self._data!r})"


_JSON_KINDS = "None, bool, int, float, str, a mapping with str keys, or a list/tuple of these"


def _freeze(value: Any, *, where: str) -> Any:
    """A hashable copy of a JSON-like value: mappings become read-only, lists become tuples."""
    if value is None or isinstance(value, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)  # str enums become their plain value
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        return float(value)
    if isinstance(value, Mapping):
        items = {}
        for key, item in value.items():
            if not isinstance(key, str):
                raise TypeError(
                    f"{where}: mapping keys must be strings, got {type(key).__name__} {key!r}"
                )
            items[str.__str__(key)] = _freeze(item, where=f"{where}[{key!r}]")
        return _FrozenMapping(items)
    if isinstance(value, (list, tuple)):
        return tuple(_freeze(item, where=f"{where}[{i}]") for i, item in enumerate(value))
    raise TypeError(f"{where}: expected {_JSON_KINDS}; got {type(value).__name__} {value!r}")


def _thaw(value: Any) -> Any:
    """The plain JSON form of a :func:`_freeze` result: dicts and lists."""
    if isinstance(value, Mapping):
        return {key: _thaw(item) for key, item in value.items()}
    if isinstance(value, tuple):
        return [_thaw(item) for item in value]
    return value


# --------------------------------------------------------------------------------------------
# Dynamic per-module rules
# --------------------------------------------------------------------------------------------

DynamicRuleNormalizer = Callable[[str, Mapping[str, Any]], Mapping[str, Any]]
"""``normalize(rule_key, raw_overrides) -> overrides``: validates one ``+:`` rule's overrides."""


def _parse_rule_key(key: Any) -> tuple[str, bool, re.Pattern[str]]:
    """``(pattern, exclude, compiled)`` of a rule key: ``"+:regex"``, ``"-:regex"`` or a regex."""
    if not isinstance(key, str):
        raise TypeError(
            f"dynamic: rule keys must be strings ('+:regex', '-:regex' or a bare regex); got "
            f"{type(key).__name__} {key!r}"
        )
    exclude = key.startswith("-:")
    pattern = key[2:] if exclude or key.startswith("+:") else key
    try:
        compiled = re.compile(pattern)
    except re.error as exc:
        raise ValueError(
            f"dynamic: rule key {key!r} is not a valid regular expression ({exc}); keys are "
            f"'+:regex', '-:regex' or a bare regex"
        ) from None
    return str.__str__(pattern), exclude, compiled


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class DynamicRule:
    """One per-module rule: a key (``"+:regex"``, ``"-:regex"`` or a bare regex) and its overrides.

    ``pattern`` is the key without its ``+:`` / ``-:`` prefix and is matched with ``re.match``:
    anchored at the start of the module name, not at its end (``".*q_proj"`` matches
    ``"model.layers.0.self_attn.q_proj"``, ``"q_proj"`` does not). ``exclude`` is True for ``-:``
    keys; their overrides are always empty. Overrides are stored read-only (lists as tuples).

    Numerics: names only; no tensor math.

    Example:
      >>> DynamicRule(key="-:.*lm_head", overrides={}).matches("lm_head")
      True
    """

    key: str
    overrides: Mapping[str, Any]
    pattern: str = dataclasses.field(init=False)
    exclude: bool = dataclasses.field(init=False)
    _regex: re.Pattern[str] = dataclasses.field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        pattern, exclude, compiled = _parse_rule_key(self.key)
        if not isinstance(self.overrides, Mapping):
            raise TypeError(
                f"dynamic[{self.key!r}]: overrides must be a mapping, got "
                f"{type(self.overrides).__name__} {self.overrides!r}"
            )
        overrides = {} if exclude else self.overrides
        object.__setattr__(self, "key", str.__str__(self.key))
        object.__setattr__(self, "overrides", _freeze(overrides, where=f"dynamic[{self.key!r}]"))
        object.__setattr__(self, "pattern", pattern)
        object.__setattr__(self, "exclude", exclude)
        object.__setattr__(self, "_regex", compiled)

    def matches(self, module_name: str) -> bool:
        """True when the pattern matches at the start of ``module_name`` (``re.match``)."""
        return self._regex.match(module_name) is not None


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class DynamicRules:
    """Ordered per-module rules; the first rule whose pattern matches a module name decides.

    Order (the seed's): keys that start with ``-`` come first, then the others, each group in
    insertion order. So a ``-:`` exclusion beats any ``+:`` rule, and among rules of one kind the
    earlier one wins. A bare key is a ``+:`` rule. Configs build their rules with
    :meth:`from_mapping`, passing a normalizer that validates each ``+:`` rule's overrides.

    Numerics: names only; no tensor math.

    Example:
      >>> rules = DynamicRules.from_mapping({r".*mlp": {"format": "e5m2"}, "-:.*mlp.gate": {}})
      >>> rules.overrides_for("model.layers.0.mlp.gate_proj") is None
      True
    """

    rules: tuple[DynamicRule, ...] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.rules, tuple) or not all(
            isinstance(rule, DynamicRule) for rule in self.rules
        ):
            raise TypeError(
                f"rules: expected a tuple of DynamicRule, got {type(self.rules).__name__} "
                f"{self.rules!r}"
            )
        keys = [rule.key for rule in self.rules]
        duplicates = sorted({key for key in keys if keys.count(key) > 1})
        if duplicates:
            raise ValueError(f"rules: duplicate rule keys {duplicates}")
        first = tuple(rule for rule in self.rules if rule.key.startswith("-"))
        rest = tuple(rule for rule in self.rules if not rule.key.startswith("-"))
        object.__setattr__(self, "rules", first + rest)

    @classmethod
    def from_mapping(
        cls,
        dynamic: "Mapping[str, Mapping[str, Any] | None] | DynamicRules | None",
        *,
        normalize: DynamicRuleNormalizer | None = None,
    ) -> "DynamicRules":
        """Parse ``{"+:regex" | "-:regex" | "regex": overrides}`` into ordered rules.

        Args:
          dynamic: the rule mapping, an existing :class:`DynamicRules` (re-normalized), or None.
          normalize: called as ``normalize(key, overrides)`` for every ``+:`` / bare rule; returns
            the canonical overrides or raises. ``-:`` values are ignored (``{}`` or ``None``).

        Raises:
          TypeError: ``dynamic`` is not a mapping, a key is not a string, or a value is not a
            mapping.
          ValueError: a key is not a valid regular expression, or ``normalize`` rejects a rule.

        Numerics: names only; no tensor math.
        """
        if dynamic is None:
            return cls()
        if isinstance(dynamic, DynamicRules):
            dynamic = dynamic.to_dict()
        if not isinstance(dynamic, Mapping):
            raise TypeError(
                f"dynamic: expected a mapping of rule keys ('+:regex', '-:regex' or a bare regex) "
                f"to override mappings, or None; got {type(dynamic).__name__} {dynamic!r}"
            )
        rules = []
        for key, value in dynamic.items():
            _, exclude, _ = _parse_rule_key(key)
            if exclude and value is None:
                value = {}
            if not isinstance(value, Mapping):
                raise TypeError(
                    f"dynamic[{key!r}]: expected a mapping of per-module overrides, got "
                    f"{type(value).__name__} {value!r}"
                )
            bad = [name for name in value if not isinstance(name, str)]
            if bad:
                raise TypeError(f"dynamic[{key!r}]: override names must be strings, got {bad!r}")
            if exclude:
                overrides: Mapping[str, Any] = {}
            elif normalize is None:
                overrides = value
            else:
                overrides = normalize(key, value)
            rules.append(DynamicRule(key=key, overrides=overrides))
        return cls(rules=tuple(rules))

    def match(self, module_name: str) -> DynamicRule | None:
        """The first rule (in stored order) whose pattern matches ``module_name``, or None."""
        for rule in self.rules:
            if rule.matches(module_name):
                return rule
        return None

    def overrides_for(self, module_name: str) -> Mapping[str, Any] | None:
        """None when a ``-:`` rule decides (module excluded); else the overrides to apply.

        The overrides are those of the first matching ``+:`` rule, or empty when nothing matches.
        """
        rule = self.match(module_name)
        if rule is None:
            return _FrozenMapping({})
        return None if rule.exclude else rule.overrides

    def to_dict(self) -> dict[str, dict[str, Any]]:
        """``{key: overrides}`` in stored order, as plain dicts and lists."""
        return {rule.key: _thaw(rule.overrides) for rule in self.rules}

    def __len__(self) -> int:
        return len(self.rules)

    def __iter__(self) -> Iterator[DynamicRule]:
        return iter(self.rules)


def _module_overrides(dynamic: DynamicRules | None, module_name: str) -> Mapping[str, Any] | None:
    """A config's overrides for one module (None: excluded); shared by every ``resolve``."""
    if not isinstance(module_name, str):
        raise TypeError(
            f"module_name: expected a str, got {type(module_name).__name__} {module_name!r}"
        )
    return dynamic.overrides_for(module_name) if dynamic is not None else {}


# --------------------------------------------------------------------------------------------
# FP8Config
# --------------------------------------------------------------------------------------------

_FP8_WEIGHT_FORMATS: tuple[str, ...] = tuple(
    f for f in FP8_FORMATS if f not in FP8_DECODE_ONLY_FORMATS
)
_FP8_RULE_KEYS: tuple[str, ...] = (
    "format",
    "fmt",
    "weight_scale_method",
    "weight_block_size",
    "weight_scale_semantics",
    "bits",
    "group_size",
)
_FP8_PAYLOAD_KEYS: frozenset[str] = frozenset(
    {
        "bits",
        "group_size",
        "desc_act",
        "lm_head",
        "method",
        "quant_method",
        "format",
        "checkpoint_format",
        "pack_dtype",
        "weight_scale_method",
        "weight_block_size",
        "weight_scale_semantics",
        "meta",
        "dynamic",
        "smoother",
        "sym",
    }
)
_FP8_LEGACY_PAYLOAD_KEYS: frozenset[str] = frozenset({"fmt", "weight_only", "smooth"})


def _fp8_weight_format(value: Any, *, where: str) -> str:
    """Canonical FP8 weight dtype name; decode-only formats (E8M0) are rejected."""
    try:
        name = normalize_fp8_format(value)
    except ValueError as exc:
        raise ValueError(f"{where}: {exc}") from None
    except TypeError as exc:
        raise TypeError(f"{where}: {exc}") from None
    if name in FP8_DECODE_ONLY_FORMATS:
        raise ValueError(
            f"{where}: {name} (from {value!r}) is decode-only (MX block scales) and cannot be an "
            f"FP8 weight format; accepted: {', '.join(_FP8_WEIGHT_FORMATS)} or their aliases"
        )
    return name


def _check_bits(value: Any, *, where: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{where}: expected the int 8, got {type(value).__name__} {value!r}")
    if value != 8:
        raise ValueError(f"{where}: FP8 weights are 8-bit; got {value!r}, accepted: 8")


def _normalize_fp8_rule(key: str, overrides: Mapping[str, Any]) -> dict[str, Any]:
    """Validate one FP8 ``+:`` rule; the result holds only the keys the rule overrides."""
    where = f"dynamic[{key!r}]"
    unknown = sorted(name for name in overrides if name not in _FP8_RULE_KEYS)
    if unknown:
        raise ValueError(
            f"{where}: unsupported FP8 override(s) {unknown}; accepted: {list(_FP8_RULE_KEYS)}"
        )
    out: dict[str, Any] = {}
    if "bits" in overrides:
        _check_bits(overrides["bits"], where=f"{where}.bits")
        out["bits"] = 8
    if "group_size" in overrides:
        group_size = overrides["group_size"]
        if group_size is not None and (isinstance(group_size, bool) or group_size != -1):
            raise ValueError(
                f"{where}.group_size: FP8 weights are not grouped; got {group_size!r}, "
                f"accepted: -1 or None"
            )
        out["group_size"] = None if group_size is None else -1
    if "format" in overrides or "fmt" in overrides:
        raw = overrides["format"] if "format" in overrides else overrides["fmt"]
        out["format"] = _fp8_weight_format(raw, where=f"{where}.format")
    if "weight_scale_method" in overrides or "weight_block_size" in overrides:
        try:
            block = normalize_fp8_block_size(overrides.get("weight_block_size"))
            out["weight_scale_method"] = normalize_fp8_scale_method(
                overrides.get("weight_scale_method"), weight_block_size=block
            )
        except ValueError as exc:
            raise ValueError(f"{where}: {exc}") from None
        if block is not None:
            out["weight_block_size"] = list(block)
    if "weight_scale_semantics" in overrides:
        try:
            out["weight_scale_semantics"] = normalize_fp8_scale_semantics(
                overrides["weight_scale_semantics"]
            )
        except ValueError as exc:
            raise ValueError(f"{where}: {exc}") from None
    return out


def _forced(value: Any, *, name: str, forced: Any, kinds: tuple[type, ...]) -> Any:
    """The seed forces ``group_size``/``desc_act``/``sym``; floatxq also warns when it overrides."""
    if value is None:
        return forced
    ok = isinstance(value, kinds) and not (int in kinds and isinstance(value, bool))
    if not ok:
        accepted = " or ".join(kind.__name__ for kind in kinds)
        raise TypeError(
            f"{name}: expected {accepted} or None, got {type(value).__name__} {value!r}"
        )
    if value != forced:
        warnings.warn(
            f"FP8Config: {name}={value!r} is ignored; FP8 weight quantization always uses "
            f"{name}={forced!r}",
            UserWarning,
            stacklevel=4,
        )
    return forced


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class FP8Config:
    """FP8 weight-only quantization settings (inverse scales), with per-module ``dynamic`` rules.

    Normalization: ``format`` becomes the torch dtype name (aliases, ``"fp8"`` and ``FORMAT.FP8``
    mean ``float8_e4m3fn``; the decode-only ``float8_e8m0fnu`` is rejected); ``weight_block_size``
    a ``(rows, cols)`` tuple; ``weight_scale_method`` is resolved against it (``None`` means
    ``"block"`` with a block size, else ``"row"``); ``method`` becomes ``METHOD.FP8``.
    ``group_size=-1``, ``desc_act=False`` and ``sym=True`` are forced (a different explicit value
    warns). ``dynamic`` rules accept the overrides ``format`` (or legacy ``fmt``),
    ``weight_scale_method``, ``weight_block_size``, ``weight_scale_semantics``, ``bits`` (8) and
    ``group_size`` (-1/None); anything else is rejected. ``meta`` and ``smoother`` must be JSON-like
    and are stored read-only; empty mappings count as None.

    Numerics: names only; no tensor math.

    Example:
      >>> rules = {r".*down_proj": {"fmt": "e5m2"}}
      >>> cfg = FP8Config(format="e4m3", weight_block_size=[128, 128], dynamic=rules)
      >>> cfg.weight_scale_method, cfg.resolve("model.layers.0.mlp.down_proj").format
      ('block', 'float8_e5m2')
    """

    bits: int = 8
    method: METHOD | str = METHOD.FP8
    format: str | torch.dtype | None = "float8_e4m3fn"
    group_size: int | None = -1
    desc_act: bool | None = False
    sym: bool | None = True
    weight_scale_method: str | None = None
    weight_block_size: tuple[int, int] | list[int] | None = None
    weight_scale_semantics: str | None = "inverse"
    lm_head: bool = False
    dynamic: Mapping[str, Mapping[str, Any] | None] | DynamicRules | None = None
    meta: Mapping[str, Any] | None = None
    smoother: Any = None

    def __post_init__(self) -> None:
        _check_bits(self.bits, where="bits")
        if not isinstance(self.method, str):
            raise TypeError(
                f"method: expected 'fp8' or METHOD.FP8, got {type(self.method).__name__} "
                f"{self.method!r}"
            )
        if str.lower(str.strip(self.method)) != METHOD.FP8.value:
            raise ValueError(f"method: FP8Config only supports 'fp8'; got {self.method!r}")
        block = normalize_fp8_block_size(self.weight_block_size)
        scale_method = normalize_fp8_scale_method(self.weight_scale_method, weight_block_size=block)
        if not isinstance(self.lm_head, bool):
            raise TypeError(
                f"lm_head: expected a bool, got {type(self.lm_head).__name__} {self.lm_head!r}"
            )
        if self.meta is not None and not isinstance(self.meta, Mapping):
            raise TypeError(
                f"meta: expected a mapping with str keys or None, got {type(self.meta).__name__} "
                f"{self.meta!r}"
            )
        rules = DynamicRules.from_mapping(self.dynamic, normalize=_normalize_fp8_rule)
        meta = _freeze(self.meta, where="meta")
        smoother = _freeze(self.smoother, where="smoother")
        set_field = object.__setattr__
        set_field(self, "bits", 8)
        set_field(self, "method", METHOD.FP8)
        set_field(self, "format", _fp8_weight_format(self.format, where="format"))
        set_field(
            self, "group_size", _forced(self.group_size, name="group_size", forced=-1, kinds=(int,))
        )
        set_field(
            self, "desc_act", _forced(self.desc_act, name="desc_act", forced=False, kinds=(bool,))
        )
        set_field(self, "sym", _forced(self.sym, name="sym", forced=True, kinds=(bool,)))
        set_field(self, "weight_scale_method", scale_method)
        set_field(self, "weight_block_size", block)
        set_field(
            self,
            "weight_scale_semantics",
            normalize_fp8_scale_semantics(self.weight_scale_semantics),
        )
        set_field(self, "dynamic", rules if len(rules) else None)
        set_field(self, "meta", meta if meta else None)
        set_field(self, "smoother", None if smoother == {} else smoother)

    def uses_weight_only_lifecycle(self) -> bool:
        """True: FP8 weights are quantized without calibration data."""
        return True

    def resolve(self, module_name: str) -> "FP8Config | None":
        """The settings for one module, or None when a ``-:`` rule excludes it.

        The first matching rule (see :class:`DynamicRules`) is applied on top of this config and
        the result has ``dynamic=None``; with no matching rule the result is this config without
        rules. The scale layout is overridden as a pair: a rule that names ``weight_scale_method``
        or ``weight_block_size`` replaces both (its method was resolved against its own block size,
        so ``{"weight_block_size": [64, 64]}`` means block scaling and ``{"weight_scale_method":
        "row"}`` drops the base block size); a rule that names neither keeps this config's pair.

        Numerics: names only; no tensor math.

        Example:
          >>> FP8Config(dynamic={"-:lm_head": {}}).resolve("lm_head") is None
          True
        """
        overrides = _module_overrides(self.dynamic, module_name)
        if overrides is None:
            return None
        scale_method, block = self.weight_scale_method, self.weight_block_size
        if "weight_scale_method" in overrides:
            scale_method = overrides["weight_scale_method"]
            block = overrides.get("weight_block_size")
        return dataclasses.replace(
            self,
            format=overrides.get("format", self.format),
            weight_scale_method=scale_method,
            weight_block_size=block,
            weight_scale_semantics=overrides.get(
                "weight_scale_semantics", self.weight_scale_semantics
            ),
            dynamic=None,
        )

    def to_dict(self) -> dict[str, Any]:
        """The reference's serialized FP8 payload; keys whose value is None or ``{}`` are dropped.

        Numerics: names only; no tensor math.

        Example:
          >>> FP8Config().to_dict()["checkpoint_format"]
          'float8_e4m3fn'
        """
        block = self.weight_block_size
        payload: dict[str, Any] = {
            "bits": 8,
            "group_size": -1,
            "desc_act": False,
            "lm_head": self.lm_head,
            "method": METHOD.FP8.value,
            "quant_method": METHOD.FP8.value,
            "format": self.format,
            "checkpoint_format": self.format,
            "pack_dtype": "int32",
            "weight_scale_method": self.weight_scale_method,
            "weight_block_size": list(block) if block is not None else None,
            "weight_scale_semantics": self.weight_scale_semantics,
            "meta": _thaw(self.meta),
            "dynamic": self.dynamic.to_dict() if self.dynamic is not None else None,
            "smoother": _thaw(self.smoother),
            "sym": True,
        }
        return {key: value for key, value in payload.items() if value is not None and value != {}}

    @classmethod
    def from_dict(cls, payload: Mapping[str, Any]) -> "FP8Config":
        """Build a config from a saved payload (``to_dict`` output or a legacy FP8 payload).

        Legacy ``fmt`` / ``weight_only`` / ``smooth`` are accepted (``normalize_fp8_kwargs``).
        ``method`` and ``quant_method`` must be ``"fp8"``, ``checkpoint_format`` must name the
        same dtype as ``format`` (it stands in for a missing ``format``), ``pack_dtype`` must be
        ``"int32"``; any other key is rejected.

        Raises:
          TypeError: ``payload`` is not a mapping.
          ValueError: an unknown key, or a key whose value is not accepted (the key is named).

        Numerics: names only; no tensor math.

        Example:
          >>> FP8Config.from_dict({"fmt": "e5m2", "quant_method": "fp8"}).format
          'float8_e5m2'
        """
        if not isinstance(payload, Mapping):
            raise TypeError(
                f"payload: expected a mapping, got {type(payload).__name__} {payload!r}"
            )
        accepted = _FP8_PAYLOAD_KEYS | _FP8_LEGACY_PAYLOAD_KEYS
        unknown = sorted(repr(key) for key in payload if key not in accepted)
        if unknown:
            raise ValueError(
                f"FP8Config.from_dict: unsupported field(s) {', '.join(unknown)}; accepted: "
                f"{', '.join(sorted(accepted))}"
            )
        raw = dict(payload)
        if "format" not in raw and "fmt" not in raw and "checkpoint_format" in raw:
            raw["format"] = raw["checkpoint_format"]
        for key in ("quant_method", "method"):
            value = raw.get(key, METHOD.FP8.value)
            if not isinstance(value, str) or str.lower(str.strip(value)) != METHOD.FP8.value:
                raise ValueError(f"{key}: FP8Config only reads 'fp8' payloads; got {value!r}")
        data = normalize_fp8_kwargs(raw)
        data.pop("quant_method", None)
        _pop_checkpoint_format(data, normalize_fp8_format, noun="dtype")
        _pop_pack_dtype(data, family="FP8")
        smooth = data.pop("smooth", None)
        if smooth is not None:
            if data.get("smoother") is None:
                data["smoother"] = smooth
            elif data["smoother"] != smooth:
                raise ValueError(
                    f"smooth: legacy smooth={smooth!r} conflicts with smoother="
                    f"{data['smoother']!r}; give only one"
                )
        return cls(**data)


# --------------------------------------------------------------------------------------------
# GPTQConfig
# --------------------------------------------------------------------------------------------

GPTQ_BITS: tuple[int, ...] = (2, 3, 4, 5, 6, 8)
"""Bit widths the GPTQ solver accepts (the seed's set: 7 is not among them)."""

GPTQ_ROTATIONS: tuple[str, ...] = ("hadamard", "random")
"""Accepted ``rotation`` names (the seed's choices)."""

_GPTQ_FORMATS: tuple[str, ...] = (FORMAT.GPTQ.value, FORMAT.GPTQ_V2.value)
_GPTQ_META_KNOBS: tuple[str, ...] = (
    "damp_percent",
    "damp_auto_increment",
    "static_groups",
    "act_group_aware",
    "mse",
)
"""Solver settings that travel in the payload's ``meta`` (as the seed writes them)."""
_GPTQ_RULE_KEYS: tuple[str, ...] = (
    "bits",
    "group_size",
    "sym",
    "desc_act",
    *_GPTQ_META_KNOBS,
)
_GPTQ_LAYOUT_KEYS: tuple[str, ...] = ("bits", "sym", "group_size", "desc_act")
"""Weight-layout settings that a W4A activation policy fixes (no dynamic override may set them)."""
_GPTQ_PAYLOAD_KEYS: frozenset[str] = frozenset(
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
        "rotation",
        "activation",
        "dynamic",
        "meta",
        *_GPTQ_META_KNOBS,  # accepted at the top level too (older payloads); written into meta
    }
)


def _check_bool(value: Any, *, where: str) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{where}: expected a bool, got {type(value).__name__} {value!r}")
    return value


def _check_int(value: Any, *, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{where}: expected an int, got {type(value).__name__} {value!r}")
    return int(value)


def _check_real(value: Any, *, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{where}: expected a float, got {type(value).__name__} {value!r}")
    value = float(value)
    if value != value or value in (float("inf"), float("-inf")):
        raise ValueError(f"{where}: expected a finite number, got {value!r}")
    return value


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


def _gptq_format(value: Any, *, where: str) -> FORMAT:
    if not isinstance(value, str):
        raise TypeError(
            f"{where}: expected 'gptq' or 'gptq_v2' (or FORMAT.GPTQ / FORMAT.GPTQ_V2), got "
            f"{type(value).__name__} {value!r}"
        )
    name = str.lower(str.strip(value))
    if name not in _GPTQ_FORMATS:
        raise ValueError(f"{where}: got {value!r}, accepted: {list(_GPTQ_FORMATS)}")
    return FORMAT(name)


def _gptq_rotation(value: Any, *, where: str) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str):
        raise TypeError(
            f"{where}: expected None or one of {list(GPTQ_ROTATIONS)}, got "
            f"{type(value).__name__} {value!r}"
        )
    name = str.lower(str.strip(value))
    if not name:
        return None
    if name not in GPTQ_ROTATIONS:
        raise ValueError(f"{where}: got {value!r}, accepted: None or {list(GPTQ_ROTATIONS)}")
    return name


def _gptq_activation(value: Any, *, where: str) -> Any:
    """The stored form of an activation policy: None, or a read-only mapping.

    Only the policy's container is checked here; its schema (modes, recipes, attention/MLP
    overrides, global scales) belongs to ``ActivationConfig`` (reference §2.2), which replaces
    this normalizer when it lands. A bare mode string is stored as ``{"mode": value}``.
    """
    if value is None:
        return None
    if isinstance(value, str):
        return _freeze({"mode": str.strip(value)}, where=where)
    if isinstance(value, Mapping):
        return _freeze(value, where=where)
    to_dict = getattr(value, "to_dict", None)
    if callable(to_dict):  # an ActivationConfig-like record
        return _freeze(to_dict(), where=where)
    raise TypeError(
        f"{where}: expected None, a mode string or a policy mapping, got "
        f"{type(value).__name__} {value!r}"
    )


def _normalize_gptq_rule(key: str, overrides: Mapping[str, Any]) -> dict[str, Any]:
    """Validate one GPTQ ``+:`` rule; the result holds only the keys the rule overrides."""
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
    if out.get("desc_act") and out.get("act_group_aware"):
        raise ValueError(
            f"{where}: act_group_aware=True requires desc_act=False; set only one of them"
        )
    return out


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class GPTQConfig:
    """GPTQ (INT weight, Hessian-guided) quantization settings, with per-module ``dynamic`` rules.

    Fields and validation (the seed's): ``bits`` in ``{2, 3, 4, 5, 6, 8}``; ``group_size`` -1
    (one group per output row) or positive; ``0 < damp_percent < 1``; ``damp_auto_increment >=
    0``; ``mse >= 0`` (the exponent of the optional scale search; 0 turns it off); ``format``
    ``"gptq"`` (v1 zero points on disk) or ``"gptq_v2"``, stored as a :class:`FORMAT`;
    ``desc_act=None`` means False. ``act_group_aware`` (group-aware reordering) defaults to True
    but ``desc_act=True`` turns it off with a warning; setting both to True is an error.
    ``rotation`` is None, ``"hadamard"`` or ``"random"``. ``activation`` is None or a W4A policy
    (a mode string or mapping, stored read-only); with a policy the weights must be 4-bit,
    group 128, symmetric, without ``desc_act`` or ``lm_head``, and no ``dynamic`` rule may
    override ``bits``, ``sym``, ``group_size`` or ``desc_act``. ``dynamic`` rules accept
    overrides of ``bits``, ``group_size``, ``sym``, ``desc_act``, ``static_groups``,
    ``act_group_aware``, ``damp_percent``, ``damp_auto_increment`` and ``mse``.

    Serialization: the solver settings ``damp_percent``, ``damp_auto_increment``,
    ``static_groups``, ``act_group_aware`` and ``mse`` are written into the payload's ``meta``
    (where the seed keeps them), next to the user's own ``meta`` entries, which therefore may not
    use those names. ``from_dict`` also reads them at the top level (older payloads).

    Numerics: names only; no tensor math.

    Example:
      >>> cfg = GPTQConfig(bits=4, group_size=128, dynamic={r".*down_proj": {"bits": 8}})
      >>> cfg.act_group_aware, cfg.resolve("model.layers.0.mlp.down_proj").bits
      (True, 8)
    """

    bits: int = 4
    group_size: int = 128
    sym: bool = True
    desc_act: bool | None = False
    static_groups: bool = False
    act_group_aware: bool | None = None
    damp_percent: float | int = 0.05
    damp_auto_increment: float | int = 0.01
    mse: float | int = 0.0
    lm_head: bool = False
    format: FORMAT | str = FORMAT.GPTQ
    method: METHOD | str = METHOD.GPTQ
    activation: Any = None
    dynamic: Mapping[str, Mapping[str, Any] | None] | DynamicRules | None = None
    rotation: str | None = None
    meta: Mapping[str, Any] | None = None

    def __post_init__(self) -> None:
        set_field = object.__setattr__
        if not isinstance(self.method, str):
            raise TypeError(
                f"method: expected 'gptq' or METHOD.GPTQ, got {type(self.method).__name__} "
                f"{self.method!r}"
            )
        if str.lower(str.strip(self.method)) != METHOD.GPTQ.value:
            raise ValueError(f"method: GPTQConfig only supports 'gptq'; got {self.method!r}")
        bits = _gptq_bits(self.bits, where="bits")
        group_size = _gptq_group_size(self.group_size, where="group_size")
        sym = _check_bool(self.sym, where="sym")
        desc_act = False if self.desc_act is None else _check_bool(self.desc_act, where="desc_act")
        static_groups = _check_bool(self.static_groups, where="static_groups")
        if self.act_group_aware is None:
            act_group_aware = not desc_act
            if desc_act:
                warnings.warn(
                    "GPTQConfig: desc_act=True turns act_group_aware off; set "
                    "act_group_aware=False explicitly to silence this warning",
                    UserWarning,
                    stacklevel=3,
                )
        else:
            act_group_aware = _check_bool(self.act_group_aware, where="act_group_aware")
            if act_group_aware and desc_act:
                raise ValueError(
                    "act_group_aware: act_group_aware=True requires desc_act=False; set only one "
                    "of them (group-aware reordering keeps groups contiguous, desc_act does not)"
                )
        lm_head = _check_bool(self.lm_head, where="lm_head")
        if self.meta is not None and not isinstance(self.meta, Mapping):
            raise TypeError(
                f"meta: expected a mapping with str keys or None, got {type(self.meta).__name__} "
                f"{self.meta!r}"
            )
        reserved = sorted(key for key in (self.meta or {}) if key in _GPTQ_META_KNOBS)
        if reserved:
            raise ValueError(
                f"meta: {reserved} are GPTQConfig fields (serialized into meta by to_dict); "
                f"pass them as fields instead"
            )
        meta = _freeze(self.meta, where="meta")
        rules = DynamicRules.from_mapping(self.dynamic, normalize=_normalize_gptq_rule)
        activation = _gptq_activation(self.activation, where="activation")
        set_field(self, "method", METHOD.GPTQ)
        set_field(self, "bits", bits)
        set_field(self, "group_size", group_size)
        set_field(self, "sym", sym)
        set_field(self, "desc_act", desc_act)
        set_field(self, "static_groups", static_groups)
        set_field(self, "act_group_aware", act_group_aware)
        set_field(self, "damp_percent", _gptq_damp(self.damp_percent, where="damp_percent"))
        set_field(
            self,
            "damp_auto_increment",
            _non_negative(self.damp_auto_increment, where="damp_auto_increment"),
        )
        set_field(self, "mse", _non_negative(self.mse, where="mse"))
        set_field(self, "lm_head", lm_head)
        set_field(self, "format", _gptq_format(self.format, where="format"))
        set_field(self, "activation", activation)
        set_field(self, "dynamic", rules if len(rules) else None)
        set_field(self, "rotation", _gptq_rotation(self.rotation, where="rotation"))
        set_field(self, "meta", meta if meta else None)
        if activation is not None:
            self._check_activation_layout()

    def _check_activation_layout(self) -> None:
        problems = []
        if self.bits != 4:
            problems.append(f"bits={self.bits} (needs 4)")
        if self.group_size != 128:
            problems.append(f"group_size={self.group_size} (needs 128)")
        if not self.sym:
            problems.append("sym=False (needs True)")
        if self.desc_act:
            problems.append("desc_act=True (needs False)")
        if self.lm_head:
            problems.append("lm_head=True (needs False)")
        for rule in self.dynamic or ():
            touched = sorted(key for key in rule.overrides if key in _GPTQ_LAYOUT_KEYS)
            if touched and not rule.exclude:
                problems.append(f"dynamic[{rule.key!r}] overrides {touched}")
        if problems:
            raise ValueError(
                "activation: a W4A activation policy needs 4-bit, group 128, symmetric GPTQ "
                "weights without desc_act or lm_head, packed in int32, and no dynamic override "
                f"of bits/sym/group_size/desc_act; got {'; '.join(problems)}"
            )

    def uses_weight_only_lifecycle(self) -> bool:
        """False: GPTQ needs calibration data (Hessians of each layer's inputs)."""
        return False

    def resolve(self, module_name: str) -> "GPTQConfig | None":
        """The settings for one module, or None when a ``-:`` rule excludes it.

        The first matching rule (see :class:`DynamicRules`) is applied on top of this config and
        the result has ``dynamic=None``. A rule that turns ``desc_act`` on without naming
        ``act_group_aware`` turns group-aware reordering off for that module.

        Numerics: names only; no tensor math.

        Example:
          >>> GPTQConfig(dynamic={"-:lm_head": {}}).resolve("lm_head") is None
          True
        """
        found = _module_overrides(self.dynamic, module_name)
        if found is None:
            return None
        overrides = dict(found)
        if overrides.get("desc_act") and "act_group_aware" not in overrides:
            overrides["act_group_aware"] = False
        return dataclasses.replace(self, **overrides, dynamic=None)

    def to_dict(self) -> dict[str, Any]:
        """The reference's serialized GPTQ payload; keys whose value is None or ``{}`` are dropped.

        Numerics: names only; no tensor math.

        Example:
          >>> payload = GPTQConfig().to_dict()
          >>> payload["checkpoint_format"], payload["meta"]["damp_percent"]
          ('gptq', 0.05)
        """
        meta = _thaw(self.meta) if self.meta is not None else {}
        meta.update({name: getattr(self, name) for name in _GPTQ_META_KNOBS})
        payload: dict[str, Any] = {
            "bits": self.bits,
            "group_size": self.group_size,
            "desc_act": self.desc_act,
            "sym": self.sym,
            "lm_head": self.lm_head,
            "method": METHOD.GPTQ.value,
            "quant_method": METHOD.GPTQ.value,
            "format": FORMAT(self.format).value,
            "checkpoint_format": FORMAT(self.format).value,
            "pack_dtype": "int32",
            "rotation": self.rotation,
            "activation": _thaw(self.activation),
            "dynamic": self.dynamic.to_dict() if self.dynamic is not None else None,
            "meta": meta,
        }
        return {key: value for key, value in payload.items() if value is not None and value != {}}

    @classmethod
    def from_dict(cls, payload: Mapping[str, Any]) -> "GPTQConfig":
        """Build a config from a saved payload (``quantize_config.json``, ``quantization_config``).

        ``method`` and ``quant_method`` must be ``"gptq"``; ``checkpoint_format`` must equal
        ``format`` (it stands in for a missing one); ``pack_dtype`` must be ``"int32"``. The
        solver settings are read from ``meta`` or the top level (both at once must agree); the
        rest of ``meta`` is kept as the config's ``meta``. Any other key is rejected.

        Raises:
          TypeError: ``payload`` is not a mapping.
          ValueError: an unknown key, or a key whose value is not accepted (the key is named).

        Numerics: names only; no tensor math.

        Example:
          >>> GPTQConfig.from_dict({"bits": 4, "meta": {"damp_percent": 0.1}}).damp_percent
          0.1
        """
        if not isinstance(payload, Mapping):
            raise TypeError(
                f"payload: expected a mapping, got {type(payload).__name__} {payload!r}"
            )
        unknown = sorted(repr(key) for key in payload if key not in _GPTQ_PAYLOAD_KEYS)
        if unknown:
            raise ValueError(
                f"GPTQConfig.from_dict: unsupported field(s) {', '.join(unknown)}; accepted: "
                f"{', '.join(sorted(_GPTQ_PAYLOAD_KEYS))}"
            )
        data = dict(payload)
        for key in ("quant_method", "method"):
            value = data.pop(key, METHOD.GPTQ.value)
            if not isinstance(value, str) or str.lower(str.strip(value)) != METHOD.GPTQ.value:
                raise ValueError(f"{key}: GPTQConfig only reads 'gptq' payloads; got {value!r}")
        _pop_checkpoint_format(
            data, lambda name: _gptq_format(name, where="checkpoint_format"), noun="format"
        )
        _pop_pack_dtype(data, family="GPTQ")
        meta = data.pop("meta", None)
        if meta is not None:
            if not isinstance(meta, Mapping):
                raise TypeError(
                    f"meta: expected a mapping or None, got {type(meta).__name__} {meta!r}"
                )
            meta = dict(meta)
            for name in _GPTQ_META_KNOBS:
                if name not in meta:
                    continue
                value = meta.pop(name)
                if name in data and data[name] != value:
                    raise ValueError(
                        f"{name}: the payload gives {data[name]!r} at the top level and "
                        f"{value!r} in meta; give one value"
                    )
                data[name] = value
            data["meta"] = meta
        return cls(**data)


def _pop_checkpoint_format(
    data: dict[str, Any], canonical: Callable[[Any], Any], *, noun: str
) -> None:
    """Remove a payload's ``checkpoint_format``: it must name the same ``noun`` as ``format``
    (and stands in for ``format`` when that is absent)."""
    if "checkpoint_format" not in data:
        return
    checkpoint_format = data.pop("checkpoint_format")
    if "format" not in data:
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


def _pop_pack_dtype(data: dict[str, Any], *, family: str) -> None:
    """Remove a payload's ``pack_dtype``: FP8 and GPTQ payloads both store int32 words."""
    pack_dtype = data.pop("pack_dtype", "int32")
    if pack_dtype not in ("int32", "torch.int32") and pack_dtype is not torch.int32:
        raise ValueError(f"pack_dtype: {family} payloads use 'int32'; got {pack_dtype!r}")
