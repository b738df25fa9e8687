"""Frozen configs and ``str`` enums: METHOD, FORMAT, BACKEND, dynamic rules, FP8Config, GPTQConfig,
and the W4A activation policy (ActivationConfig).

Nothing here touches tensor data. Configs are ``@dataclass(frozen=True, slots=True, kw_only=True)``
records with a hand-written ``__init__``: it normalizes the arguments (aliases, lists, rule
mappings) and then sets each field once, so every field holds what its annotation says
(``FP8Config.format`` is always an FP8 dtype name, never a ``torch.dtype`` or ``None``). Configs
are hashable, and ``dataclasses.replace`` normalizes its changes the same way.

Serialization is not here: GPT-QModel's payload keys, legacy aliases and forced fields are read and
written by :mod:`floatxq.interop.payload`.

Per-module rules (``dynamic``) are shared by every config: :class:`DynamicRules` parses the
``{"+:regex" | "-:regex" | "regex": overrides}`` mapping once, with a per-config normalizer for the
override values, and answers "which rule applies to this module?". Rule keys may come from a
checkpoint's config file, so their matching time is bounded: a pattern is parsed with Python's own
regex parser and refused when it could backtrack catastrophically (see :class:`DynamicRule`).
"""

import dataclasses
import enum
import re
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, ClassVar, cast

import torch

try:  # Python 3.11+: the parser behind ``re.compile``
    from re import _parser as _regex_parser
except ImportError:  # pragma: no cover - Python 3.10
    import sre_parse as _regex_parser  # type: ignore[no-redef]

from floatxq.formats import (
    GPTQ_BITS,
    W4A_ACTIVATION_MODES,
    FP8ScaleMethod,
    FP8WeightFormat,
    GPTQFormat,
    NVFP4Recipe,
    W4AActivationMode,
    normalize_fp8_block_size,
    normalize_fp8_scale_method,
    normalize_fp8_weight_format,
    normalize_gptq_format,
    normalize_nvfp4_recipe,
    nvfp4_uses_headroom,
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
    """Inference backend: ``AUTO`` lets the loader pick, ``FP8_TORCH`` runs ``TorchFP8Linear``,
    ``GPTQ_TORCH`` runs ``GPTQLinear`` (W4A16: INT weights decoded for each call),
    ``GPTQ_W4AFP8`` runs ``W4AFP8Linear`` (symmetric 4-bit g128 GPTQ weights × per-token FP8
    activations; chosen explicitly when loading a GPTQ checkpoint, never by ``AUTO``),
    ``GPTQ_W4A_NVFP4`` runs ``W4ANVFP4Linear`` (the same GPTQ weights × NVFP4 activations; also
    chosen explicitly, never by ``AUTO``), ``MLX`` converts a saved FP8 Llama checkpoint whole to
    an MLX model (``floatxq.mlx``; explicit only).

    Only backends with a runtime in floatxq are members; others join when their runtime lands.
    """

    AUTO = "auto"
    FP8_TORCH = "fp8_torch"
    GPTQ_TORCH = "gptq_torch"
    GPTQ_W4AFP8 = "gptq_w4afp8"
    GPTQ_W4A_NVFP4 = "gptq_w4a_nvfp4"
    MLX = "mlx"


# --------------------------------------------------------------------------------------------
# Immutable JSON-like values (meta, rule overrides)
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


def _frozen_meta(meta: Any) -> Mapping[str, Any] | None:
    """``meta`` stored read-only; None and ``{}`` both become None."""
    if meta is not None and not isinstance(meta, Mapping):
        raise TypeError(
            f"meta: expected a mapping with str keys or None, got {type(meta).__name__} {meta!r}"
        )
    frozen = _freeze(meta, where="meta")
    return frozen if frozen else None


# --------------------------------------------------------------------------------------------
# Scalar validators (one each, shared by both configs)
# --------------------------------------------------------------------------------------------


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


# --------------------------------------------------------------------------------------------
# Dynamic per-module rules
# --------------------------------------------------------------------------------------------

DynamicRuleNormalizer = Callable[[str, Mapping[str, Any]], Mapping[str, Any]]
"""``normalize(rule_key, raw_overrides) -> overrides``: validates one ``+:`` rule's overrides."""


RULE_PATTERN_MAX_CHARS = 1000
"""The longest ``dynamic`` rule pattern accepted (characters, without the ``+:`` / ``-:``)."""

RULE_NAME_MAX_CHARS = 256
"""The longest module name ``dynamic`` rules are matched against (real names are < 150)."""

RULE_BACKTRACK_BUDGET = (RULE_NAME_MAX_CHARS + 1) ** 3
"""The most backtracking paths a rule pattern may have over a name of
:data:`RULE_NAME_MAX_CHARS` characters: three unbounded quantifiers (``.*``) besides a last one."""

_P = _regex_parser
_REPEATS = tuple(
    op
    for op in (_P.MAX_REPEAT, _P.MIN_REPEAT, getattr(_P, "POSSESSIVE_REPEAT", None))
    if op is not None
)
_ATOMIC = getattr(_P, "ATOMIC_GROUP", None)
_BACKTRACKING = "(catastrophic backtracking)"


def _repeat_text(low: int, high: int) -> str:
    """The quantifier as written: ``*``, ``+``, ``?``, ``{m}``, ``{m,}`` or ``{m,n}``."""
    if high == _P.MAXREPEAT:
        return {0: "*", 1: "+"}.get(low, f"{{{low},}}")
    if (low, high) == (0, 1):
        return "?"
    return f"{{{low}}}" if low == high else f"{{{low},{high}}}"


def _first_choice(items: Any) -> str | None:
    """The first construct in a parsed pattern that can match in more than one way, or None."""
    for op, arg in items:
        if op in _REPEATS:
            low, high, body = arg
            if low != high:
                return f"'{_repeat_text(low, high)}'"
            inner = _first_choice(body)
        elif op is _P.BRANCH:
            return "an alternation '|'"
        elif op is _P.SUBPATTERN:
            inner = _first_choice(arg[-1])
        elif op is _ATOMIC:
            inner = _first_choice(arg)
        else:
            inner = None
        if inner is not None:
            return inner
    return None


def _paths(items: Any, *, tail: bool, where: str) -> int:
    """An upper bound on the backtracking paths of a parsed sequence (the product over its items).

    ``tail``: the sequence ends the pattern, so its last item is tried once (``re.match`` succeeds
    as soon as it gets there). Refuses lookarounds, backreferences and nested quantifiers.
    """
    paths = 1
    for i, (op, arg) in enumerate(items):
        paths *= _item_paths(op, arg, tail=tail and i == len(items) - 1, where=where)
    return paths


def _item_paths(op: Any, arg: Any, *, tail: bool, where: str) -> int:
    if op is _P.ASSERT or op is _P.ASSERT_NOT:
        ahead = arg[0] == 1
        shape = ("(?=...)", "(?<=...)") if op is _P.ASSERT else ("(?!...)", "(?<!...)")
        raise ValueError(
            f"{where}: {'lookahead' if ahead else 'lookbehind'} {shape[0 if ahead else 1]} "
            f"refused: a lookaround re-scans the module name wherever it is tried and hides "
            f"repeats from the bound on matching time {_BACKTRACKING}; use a '-:' rule to leave "
            f"modules out"
        )
    if op is _P.GROUPREF or op is _P.GROUPREF_EXISTS:
        group = arg[0] if op is _P.GROUPREF_EXISTS else arg
        construct = "conditional (?(group)...)" if op is _P.GROUPREF_EXISTS else "backreference"
        raise ValueError(
            f"{where}: {construct} to group {group} refused: backreferences make matching time "
            f"unbounded {_BACKTRACKING}; rule keys must be plain regular expressions"
        )
    if op is _P.SUBPATTERN:
        return _paths(arg[-1], tail=tail, where=where)
    if op is _ATOMIC:
        return _paths(arg, tail=tail, where=where)
    if op is _P.BRANCH:
        return sum(_paths(alt, tail=tail, where=where) for alt in arg[1])
    if op in _REPEATS:
        low, high, body = arg
        if high > 1:
            inner = _first_choice(body)
            if inner is not None:
                raise ValueError(
                    f"{where}: nested quantifier refused: a group repeated with "
                    f"'{_repeat_text(low, high)}' contains {inner}; such a pattern can take "
                    f"exponential time to fail on a module name {_BACKTRACKING}; use one "
                    f"quantifier over a character class instead (e.g. '[a-z0-9_.]*')"
                )
        body_paths = _paths(body, tail=tail, where=where)  # 1 when high > 1; refuses lookarounds
        if low == high:
            return body_paths if high == 1 else 1
        if high == 1:
            return 1 + body_paths
        return 1 if tail else 1 + min(high - low, RULE_NAME_MAX_CHARS)
    return 1  # a literal, class, '.', anchor or category: one way to match


def _check_rule_pattern(key: str, pattern: str) -> re.Pattern[str]:
    """Compile a rule pattern whose worst-case matching time is bounded, or raise ValueError."""
    where = f"dynamic: rule key {key[:80]!r}" + ("..." if len(key) > 80 else "")
    if len(pattern) > RULE_PATTERN_MAX_CHARS:
        raise ValueError(
            f"{where}: the pattern has {len(pattern)} characters; accepted: at most "
            f"{RULE_PATTERN_MAX_CHARS}"
        )
    try:
        parsed = _regex_parser.parse(pattern)
        compiled = re.compile(pattern)
        paths = _paths(parsed, tail=True, where=where)
    except re.error as exc:
        raise ValueError(
            f"{where} is not a valid regular expression ({exc}); keys are '+:regex', '-:regex' "
            f"or a bare regex"
        ) from None
    except RecursionError:
        raise ValueError(f"{where}: groups are nested too deeply to parse") from None
    if paths > RULE_BACKTRACK_BUDGET:
        raise ValueError(
            f"{where}: too many quantifiers and alternations: about {float(paths):.3g} ways to "
            f"backtrack over a {RULE_NAME_MAX_CHARS}-character module name, accepted: at most "
            f"{float(RULE_BACKTRACK_BUDGET):.3g} (three '.*' besides a last one); each one "
            f"multiplies the time a failing match can take {_BACKTRACKING}"
        )
    return compiled


def _parse_rule_key(key: Any) -> tuple[str, bool, re.Pattern[str]]:
    """``(pattern, exclude, compiled)`` of a rule key: ``"+:regex"``, ``"-:regex"`` or a regex."""
    if not isinstance(key, str):
        raise TypeError(
            f"dynamic: rule keys must be strings ('+:regex', '-:regex' or a bare regex); got "
            f"{type(key).__name__} {key!r}"
        )
    exclude = key.startswith("-:")
    pattern = key[2:] if exclude or key.startswith("+:") else key
    return str.__str__(pattern), exclude, _check_rule_pattern(key, str.__str__(pattern))


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True, init=False)
class DynamicRule:
    """One per-module rule: a key (``"+:regex"``, ``"-:regex"`` or a bare regex) and its overrides.

    ``pattern`` is the key without its ``+:`` / ``-:`` prefix and is matched with ``re.match``:
    anchored at the start of the module name, not at its end (``".*q_proj"`` matches
    ``"model.layers.0.self_attn.q_proj"``, ``"q_proj"`` does not). ``exclude`` is True for ``-:``
    keys; their overrides are always empty. Overrides are stored read-only (lists as tuples).

    Matching time is bounded (keys may come from a downloaded config file): the pattern is parsed
    with Python's regex parser and refused when it has more than :data:`RULE_PATTERN_MAX_CHARS`
    characters, a nested quantifier (a repeated group holding a quantifier or an alternation:
    ``(a+)+``, ``(a|aa)+``, ``(.*a){20}``), a backreference or conditional, a lookaround, or more
    backtracking paths over a :data:`RULE_NAME_MAX_CHARS`-character name than
    :data:`RULE_BACKTRACK_BUDGET` (each quantifier or alternation multiplies them; one that ends
    the pattern does not). Module names longer than :data:`RULE_NAME_MAX_CHARS` are refused.

    Raises:
      TypeError: ``key`` is not a string or ``overrides`` not a mapping.
      ValueError: ``key`` is not a valid regular expression or is refused as above.

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

    def __init__(self, *, key: str, overrides: Mapping[str, Any]) -> None:
        pattern, exclude, compiled = _parse_rule_key(key)
        if not isinstance(overrides, Mapping):
            raise TypeError(
                f"dynamic[{key!r}]: overrides must be a mapping, got "
                f"{type(overrides).__name__} {overrides!r}"
            )
        frozen = _freeze({} if exclude else overrides, where=f"dynamic[{key!r}]")
        set_field = object.__setattr__
        set_field(self, "key", str.__str__(key))
        set_field(self, "overrides", frozen)
        set_field(self, "pattern", pattern)
        set_field(self, "exclude", exclude)
        set_field(self, "_regex", compiled)

    def matches(self, module_name: str) -> bool:
        """True when the pattern matches at the start of ``module_name`` (``re.match``).

        Raises:
          TypeError: ``module_name`` is not a string.
          ValueError: ``module_name`` is longer than :data:`RULE_NAME_MAX_CHARS` (the bound on
            matching time assumes names no longer).
        """
        if not isinstance(module_name, str):
            raise TypeError(
                f"module_name: expected a str, got {type(module_name).__name__} {module_name!r}"
            )
        if len(module_name) > RULE_NAME_MAX_CHARS:
            raise ValueError(
                f"module_name: {module_name[:60]!r}... has {len(module_name)} characters; dynamic "
                f"rules are matched against names of at most {RULE_NAME_MAX_CHARS}"
            )
        return self._regex.match(module_name) is not None


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True, init=False)
class DynamicRules:
    """Ordered per-module rules; the first rule whose pattern matches a module name decides.

    Order (GPT-QModel's): keys that start with ``-`` come first, then the others, each group in
    the order given. So a ``-:`` exclusion beats any ``+:`` rule, and among rules of one kind the
    earlier one wins. A bare key is a ``+:`` rule. Configs build their rules with
    :meth:`from_mapping`, passing a normalizer that validates each ``+:`` rule's overrides.

    Numerics: names only; no tensor math.

    Example:
      >>> rules = DynamicRules.from_mapping({r".*mlp": {"format": "e5m2"}, "-:.*mlp.gate": {}})
      >>> rules.overrides_for("model.layers.0.mlp.gate_proj") is None
      True
    """

    rules: tuple[DynamicRule, ...]

    def __init__(self, *, rules: tuple[DynamicRule, ...] = ()) -> None:
        if not isinstance(rules, tuple) or not all(isinstance(r, DynamicRule) for r in rules):
            raise TypeError(
                f"rules: expected a tuple of DynamicRule, got {type(rules).__name__} {rules!r}"
            )
        keys = [rule.key for rule in rules]
        duplicates = sorted({key for key in keys if keys.count(key) > 1})
        if duplicates:
            raise ValueError(f"rules: duplicate rule keys {duplicates}")
        first = tuple(rule for rule in rules if rule.key.startswith("-"))
        rest = tuple(rule for rule in rules if not rule.key.startswith("-"))
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
          dynamic: the rule mapping, an existing :class:`DynamicRules` (normalized again), or
            None.
          normalize: called as ``normalize(key, overrides)`` for every ``+:`` / bare rule; returns
            the canonical overrides or raises. ``-:`` values are ignored (``{}`` or ``None``).

        Raises:
          TypeError: ``dynamic`` is not a mapping, a key is not a string, or a value is not a
            mapping.
          ValueError: a key is not a valid regular expression or is refused because its
            matching time could explode (see :class:`DynamicRule`), or ``normalize`` rejects
            a rule.

        Numerics: names only; no tensor math.
        """
        if dynamic is None:
            return cls()
        if isinstance(dynamic, DynamicRules):
            items: Any = [(rule.key, rule.overrides) for rule in dynamic.rules]
        elif isinstance(dynamic, Mapping):
            items = dynamic.items()
        else:
            raise TypeError(
                f"dynamic: expected a mapping of rule keys ('+:regex', '-:regex' or a bare regex) "
                f"to override mappings, or None; got {type(dynamic).__name__} {dynamic!r}"
            )
        rules = []
        for key, value in items:
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

    def __len__(self) -> int:
        return len(self.rules)

    def __iter__(self) -> Iterator[DynamicRule]:
        return iter(self.rules)


def _rules_or_none(rules: DynamicRules) -> DynamicRules | None:
    return rules if len(rules) else None


def _module_overrides(dynamic: DynamicRules | None, module_name: str) -> Mapping[str, Any] | None:
    """A config's overrides for one module (None: excluded); shared by every ``resolve``."""
    if not isinstance(module_name, str):
        raise TypeError(
            f"module_name: expected a str, got {type(module_name).__name__} {module_name!r}"
        )
    return dynamic.overrides_for(module_name) if dynamic is not None else _FrozenMapping({})


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
    not interpreted. ``lifecycle.payload`` reads and writes GPT-QModel's ``quantize_config.json``
    for this config.

    Numerics: names only; the scales are described in ``docs/numerics.md``.

    Example:
      >>> rules = {r".*down_proj": {"format": "e5m2"}}
      >>> cfg = FP8Config(format="e4m3", weight_block_size=[128, 128], dynamic=rules)
      >>> cfg.weight_scale_method, cfg.resolve("model.layers.0.mlp.down_proj").format
      ('block', 'float8_e5m2')
    """

    method: ClassVar[METHOD] = METHOD.FP8
    format: FP8WeightFormat
    weight_scale_method: FP8ScaleMethod
    weight_block_size: tuple[int, int] | None
    lm_head: bool
    dynamic: DynamicRules | None
    meta: Mapping[str, Any] | None

    def __init__(
        self,
        *,
        format: str | torch.dtype | None = "float8_e4m3fn",
        weight_scale_method: str | None = None,
        weight_block_size: Sequence[int] | None = None,
        lm_head: bool = False,
        dynamic: Mapping[str, Mapping[str, Any] | None] | DynamicRules | None = None,
        meta: Mapping[str, Any] | None = None,
    ) -> None:
        method, block = _fp8_scale_layout(weight_scale_method, weight_block_size, where="")
        set_field = object.__setattr__
        set_field(self, "format", normalize_fp8_weight_format(format, where="format"))
        set_field(self, "weight_scale_method", method)
        set_field(self, "weight_block_size", block)
        set_field(self, "lm_head", _check_bool(lm_head, where="lm_head"))
        rules = DynamicRules.from_mapping(dynamic, normalize=_normalize_fp8_rule)
        set_field(self, "dynamic", _rules_or_none(rules))
        set_field(self, "meta", _frozen_meta(meta))

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
    ("group_size", 128),
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
            f"symmetric GPTQ weights in groups of 128 without desc_act or lm_head; this config "
            f"has {', '.join(conflicts)}"
        )
    for rule in rules:
        fixed = sorted(name for name in rule.overrides if name in _W4A_FIXED_RULE_KEYS)
        if fixed:
            raise ValueError(
                f"dynamic[{rule.key!r}]: overrides {fixed}, which an activation policy fixes "
                f"for every module (bits=4, group_size=128, sym=True, desc_act=False); exclude "
                f"the module with a '-:' rule instead"
            )


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True, init=False)
class GPTQConfig:
    """GPTQ (INT weight, Hessian-guided) quantization settings, with per-module ``dynamic`` rules.

    Fields and validation: ``bits`` in ``GPTQ_BITS`` (2, 3, 4, 5, 6, 8); ``group_size`` -1 (one
    group per output row) or positive; ``0 < damp_percent < 1``; ``damp_auto_increment >= 0``;
    ``mse >= 0`` (the exponent of the optional scale search; 0 turns it off); ``format`` the
    packing convention, ``"gptq"`` (v1 zero points) or ``"gptq_v2"``; ``lm_head`` whether the
    output embedding is quantized. ``desc_act=None`` means False. ``act_group_aware`` (group-aware
    reordering) defaults to True, but ``desc_act=True`` turns it off with a warning; setting both
    to True is an error, also where a ``dynamic`` rule combines with this config into both.
    ``dynamic`` rules may override the solver settings (``bits``, ``group_size``, ``sym``,
    ``desc_act``, ``static_groups``, ``act_group_aware``, ``damp_percent``,
    ``damp_auto_increment``, ``mse``). ``meta`` holds descriptive JSON-like entries carried into
    the saved payload, not interpreted, and may not use a field's name. ``lifecycle.payload``
    reads and writes GPT-QModel's ``quantize_config.json``; ``lifecycle.gptq_solve_options``
    turns a resolved config into the solver's options.

    ``activation`` (an :class:`ActivationConfig`, its dict or a mode string, see
    :meth:`ActivationConfig.from_value`) makes the model a W4A one: its GPTQ weights run against
    quantized activations (FP8 per token, or NVFP4), the solve replays that policy, and a saved
    checkpoint binds the matching backend. The W4A GEMMs read one weight layout, so an activation
    policy requires ``bits=4``, ``group_size=128``, ``sym=True``, ``desc_act=False`` and
    ``lm_head=False``, and no ``dynamic`` rule may override ``bits``, ``group_size``, ``sym`` or
    ``desc_act`` (``-:`` exclusions and the other solver settings are allowed).

    Numerics: names only; the solver is described in ``docs/numerics.md``.

    Example:
      >>> cfg = GPTQConfig(bits=4, group_size=128, dynamic={r".*down_proj": {"bits": 8}})
      >>> cfg.act_group_aware, cfg.resolve("model.layers.0.mlp.down_proj").bits
      (True, 8)
    """

    method: ClassVar[METHOD] = METHOD.GPTQ
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
        group_size: int = 128,
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


# --------------------------------------------------------------------------------------------
# Activation policies (W4A): ActivationConfig and its refinements
# --------------------------------------------------------------------------------------------
#
# Unlike the weight configs, these records carry their own dict form: it *is* the canonical
# payload (``quantize_config.json``'s ``"activation"``), so ``to_dict`` / ``from_dict`` live here.

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
        fp32 = float(torch.tensor(float(value), dtype=torch.float32).item())
        if not (fp32 > 0 and fp32 != float("inf")):
            raise ValueError(
                f"{where}: global_scales[{key!r}] = {value!r} is {fp32!r} in FP32; it must stay "
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
        set_field(self, "recipe", normalize_nvfp4_recipe(recipe or "least_squares"))
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
