"""Per-module ``dynamic`` rules shared by every config, and the bound on their matching time.

:class:`DynamicRules` parses the ``{"+:regex" | "-:regex" | "regex": overrides}`` mapping once,
with a per-config normalizer for the override values, and answers "which rule applies to this
module?". Rule keys may come from a checkpoint's config file, so their matching time is bounded:
patterns are matched with the ``regex`` package (Python ``re``'s syntax and meaning) with a
timeout, and a match that runs past it refuses the rule (see :class:`DynamicRule`).
"""

import dataclasses
import re
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import regex

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

RULE_MATCH_TIMEOUT_S = 0.1
"""The longest one match of a rule pattern against one module name may run (seconds; the
``regex`` package's ``timeout``, checked as it runs): a longer one (catastrophic backtracking)
refuses the rule with a ValueError naming the pattern and the module."""

# A '{' that is neither escaped nor a repeat count ('{2}', '{1,3}', '{,3}', '{2,}'): Python's re
# reads it as literal text, the regex package as fuzzy matching ('{e<=1}') or literal text.
_OTHER_BRACE = regex.compile(r"\\.|(\{)(?!\d*(?:,\d*)?\})", regex.DOTALL)


class RulePattern:
    """A compiled rule pattern whose every match is bounded by :data:`RULE_MATCH_TIMEOUT_S`.

    ``match(name)`` is ``re.match``'s: the ``regex`` match object from the start of ``name``, or
    None; a match that runs past the timeout raises ValueError naming ``where`` and ``name``.
    """

    __slots__ = ("_compiled", "pattern", "where")

    def __init__(self, pattern: str, where: str) -> None:
        self.pattern, self.where = pattern, where
        self._compiled = regex.compile(pattern)

    def match(self, name: str) -> Any:
        try:
            return self._compiled.match(name, timeout=RULE_MATCH_TIMEOUT_S)
        except TimeoutError:
            raise ValueError(
                f"{self.where}: matching module {name[:80]!r} took over {RULE_MATCH_TIMEOUT_S} s "
                f"(catastrophic backtracking); the rule is refused, use one quantifier over a "
                f"character class instead (e.g. '[a-z0-9_.]*')"
            ) from None

    def __repr__(self) -> str:
        return f"RulePattern({self.pattern!r})"


def _check_rule_pattern(key: str, pattern: str) -> RulePattern:
    """Compile a rule pattern, its matching time bounded, or raise ValueError.

    Refused here (cheap to decide): more than :data:`RULE_PATTERN_MAX_CHARS` characters, a
    pattern Python's ``re`` or the ``regex`` package cannot compile, and a ``{`` that is neither
    escaped nor a repeat count (the two read it differently). Catastrophic backtracking is
    bounded when matching (:class:`RulePattern`).
    """
    where = f"dynamic: rule key {key[:80]!r}" + ("..." if len(key) > 80 else "")
    if len(pattern) > RULE_PATTERN_MAX_CHARS:
        raise ValueError(
            f"{where}: the pattern has {len(pattern)} characters; accepted: at most "
            f"{RULE_PATTERN_MAX_CHARS}"
        )
    try:
        re.compile(pattern)  # the meaning GPT-QModel and compressed-tensors give it
        compiled = RulePattern(pattern, where)
    except (re.error, regex.error) as exc:
        raise ValueError(
            f"{where} is not a valid regular expression ({exc}); keys are '+:regex', '-:regex' "
            f"or a bare regex"
        ) from None
    except RecursionError:
        raise ValueError(f"{where}: groups are nested too deeply to parse") from None
    if any(found[1] for found in _OTHER_BRACE.finditer(pattern)):
        raise ValueError(
            f"{where}: a '{{' that is not a repeat count ('{{2}}', '{{1,3}}'); escape it as "
            f"'\\{{' (the regex package that matches rules reads '{{e<=1}}' as fuzzy "
            f"matching)"
        )
    return compiled


def _parse_rule_key(key: Any) -> tuple[str, bool, RulePattern]:
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

    ``pattern`` is the key without its ``+:`` / ``-:`` prefix and is matched as ``re.match`` does:
    anchored at the start of the module name, not at its end (``".*q_proj"`` matches
    ``"model.layers.0.self_attn.q_proj"``, ``"q_proj"`` does not). ``exclude`` is True for ``-:``
    keys; their overrides are always empty. Overrides are stored read-only (lists as tuples).

    Matching time is bounded (keys may come from a downloaded config file): a pattern of more
    than :data:`RULE_PATTERN_MAX_CHARS` characters, one Python's ``re`` cannot compile, or one
    with a ``{`` that is neither escaped nor a repeat count is refused here; each match runs in
    the ``regex`` package with a timeout of :data:`RULE_MATCH_TIMEOUT_S`, and one that runs past
    it (catastrophic backtracking: ``(a|aa)+$`` over a long run of ``a``) raises ValueError
    naming the pattern and the module. Module names longer than :data:`RULE_NAME_MAX_CHARS` are
    refused.

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
    _regex: RulePattern = dataclasses.field(init=False, repr=False, compare=False)

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
          ValueError: ``module_name`` is longer than :data:`RULE_NAME_MAX_CHARS`, or matching it
            ran past :data:`RULE_MATCH_TIMEOUT_S` (names the pattern and the module).
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
          ValueError: a key is not a valid regular expression or is refused (see
            :class:`DynamicRule`), or ``normalize`` rejects a rule.

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
