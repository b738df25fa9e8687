"""Per-module ``dynamic`` rules shared by every config, and the bound on their matching time.

:class:`DynamicRules` parses the ``{"+:regex" | "-:regex" | "regex": overrides}`` mapping once,
with a per-config normalizer for the override values, and answers "which rule applies to this
module?". Rule keys may come from a checkpoint's config file, so their matching time is bounded: a
pattern is parsed with Python's own regex parser and refused when it could backtrack
catastrophically (see :class:`DynamicRule`).
"""

import dataclasses
import re
from collections.abc import Callable, Iterator, Mapping
from typing import Any

try:  # Python 3.11+: the parser behind ``re.compile``
    from re import _parser as _regex_parser
except ImportError:  # pragma: no cover - Python 3.10
    import sre_parse as _regex_parser  # type: ignore[no-redef]

from floatxq.config.values import _freeze, _FrozenMapping

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
