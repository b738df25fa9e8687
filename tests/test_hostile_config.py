"""Hostile ``dynamic`` rule keys: what is cheap to decide is refused when the config is built;
a match that backtracks catastrophically is refused when it runs past the timeout.

A rule key is a user regex (``+:regex``, ``-:regex`` or bare) matched as ``re.match`` does
against every module name, and a checkpoint's config file can carry it. Patterns are matched
with the ``regex`` package under a timeout (:data:`RULE_MATCH_TIMEOUT_S`), so no pattern can
hang ``load``; overlong, invalid and ``{``-ambiguous patterns are refused when built, and the
patterns real configs use still match exactly as ``re.match`` does.
"""

import json
import re
import string
import subprocess
import sys

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from floatxq.config import (
    RULE_MATCH_TIMEOUT_S,
    RULE_NAME_MAX_CHARS,
    RULE_PATTERN_MAX_CHARS,
    DynamicRule,
    DynamicRules,
    FP8Config,
    GPTQConfig,
)
from floatxq.interop.payload import fp8_config_from_payload, gptq_config_from_payload

MODULES = (
    "lm_head",
    "model.embed_tokens",
    "model.layers.0.self_attn.q_proj",
    "model.layers.18.mlp.gate_proj",
    "model.layers.19.mlp.down_proj",
    "model.layers.3.mlp.experts.17.up_proj",
    "model.language_model.layers.12.self_attn.o_proj",
)

# Refused when built: (key, what the message must name)
REFUSED = [
    ("a" * (RULE_PATTERN_MAX_CHARS + 1), rf"{RULE_PATTERN_MAX_CHARS + 1} characters"),
    ("(" * 499 + ")" * 499, r"nested too deeply"),
    ("(a", r"not a valid regular expression"),
    ("a**", r"not a valid regular expression"),
    (r"\p{L}+", r"not a valid regular expression"),  # the regex package's syntax, not re's
    ("model{e<=1}", r"not a repeat count"),  # fuzzy matching in regex, literal text in re
]


@pytest.mark.parametrize(("key", "named"), REFUSED, ids=[key[:24] for key, _ in REFUSED])
def test_what_is_cheap_to_decide_is_refused_when_built(key, named, production_checks):
    with pytest.raises(ValueError, match=named) as caught:
        DynamicRule(key=key, overrides={})
    assert str(caught.value).startswith("dynamic: rule key ")


# Accepted when built (the analyser that refused them is gone): on real module names the regex
# engine answers well within the timeout, as re does where re answers within 2 s (re itself can
# take hours: "(.+)+!" over a 48-character name, "(?:|)" * 30 + "!" over any).
BOUNDED = [
    "-:(.+)+!", "(a+)+", "(a*)*", "+:(a|aa)+", "(.*a){20}", "(a?a)+$", r"(?:\d+\.){3}x",
    r"-:(?:(?:a|b)c?)*!", r"(a)\1", r"(a)?(?(1)a|b)", r".*(?=q_proj)", r"(?!lm_head).*",
    r".*(?<=proj)", r"-:.*(?<!proj)$", ".*a" * 4 + "!", "a?" * 30 + "!", "(?:|)" * 30 + "!",
]  # fmt: skip


@pytest.mark.parametrize("key", BOUNDED, ids=[key[:24] for key in BOUNDED])
def test_formerly_refused_constructs_are_built_and_match_like_re(key, production_checks):
    rule = DynamicRule(key=key, overrides={})
    got = [rule.matches(name) for name in MODULES]
    expected = _re_answers(rule.pattern, list(MODULES))
    assert expected is None or got == expected


# (key, a module name it backtracks catastrophically on, in the regex engine too)
SLOW = [("+:(a|aa)+$", "a" * 40 + "!"), ("-:(a|a)+!", "a" * 255)]


@pytest.mark.parametrize(("key", "name"), SLOW)
def test_a_catastrophic_match_is_refused_at_the_timeout(key, name, production_checks):
    rule = DynamicRule(key=key, overrides={})
    # the refusal itself is the bound: the engine stopped at the timeout (no wall-clock check)
    with pytest.raises(ValueError, match=r"catastrophic backtracking") as caught:
        rule.matches(name)
    message = str(caught.value)
    assert message.startswith(f"dynamic: rule key {key!r}: matching module {name[:80]!r}")
    assert f"took over {RULE_MATCH_TIMEOUT_S} s" in message


@pytest.mark.parametrize(("key", "name"), SLOW[:1])
def test_every_config_route_refuses_it_when_matching(key, name, production_checks):
    # the constructors and the config-file readers (what ``load`` and ``eval`` read) build the
    # rule; resolving a module name it backtracks on is refused
    for build in (
        lambda: FP8Config(dynamic={key: {}}),
        lambda: GPTQConfig(dynamic={key: {}}),
        lambda: fp8_config_from_payload({"quant_method": "fp8", "dynamic": {key: {}}}),
        lambda: gptq_config_from_payload({"bits": 4, "dynamic": {key: {}}}),
    ):
        config = build()
        assert config.resolve("model.layers.0.mlp.up_proj") is not None
        with pytest.raises(ValueError, match="catastrophic backtracking"):
            config.resolve(name)
    rules = DynamicRules.from_mapping({key: {}})
    with pytest.raises(ValueError, match="catastrophic backtracking"):
        rules.match(name)


ACCEPTED = [
    r".*mlp.*",
    r"+:.*q_proj",
    "-:.*down_proj",
    r"model\.layers\.[0-9]+\.self_attn\..*",
    r"+:.*\.18\..*gate.*",
    r".*\.19\..*gate.*",
    r"-:.*\.20\..*gate.*",
    r"-:.*down.*",
    r"+:.*\.(?:1[0-5])\..*",
    r"-:.*\.(?:[2-9]|1\d)\..*",
    r".*layers\.\d+\.mlp\.experts\.\d+\..*",
    r"model\.layers\.(0|10)\.self_attn",
    r".*down_proj$",
    r".*\.(?:gate|up|down)_proj",
    r"+:.*self_attn\.(q|k)_proj",
    r"(?i)MODEL\.LAYERS\.1[0-9]\..*",
    r"(?:model\.)?layers\.\d+\.mlp\..*",
    r"lm_head",
    r"",
    ".*a" * 3 + ".*",  # three counted '.*' and a last one, which is tried once
]


@pytest.mark.parametrize("key", ACCEPTED)
def test_gptqmodel_style_patterns_are_kept_and_match_like_re(key):
    rule = DynamicRule(key=key, overrides={})
    pattern = key[2:] if key[:2] in ("+:", "-:") else key
    assert rule.pattern == pattern
    for name in MODULES:
        assert rule.matches(name) == (re.match(pattern, name) is not None), name


def test_many_quantifiers_are_built_and_match_like_re(production_checks):
    for key in (".*a" * 3 + ".*", ".*a" * 4, ".*a" * 3 + ".*$", "a*b*c*d*!"):
        rule = DynamicRule(key=key, overrides={})
        for name in MODULES:
            assert rule.matches(name) == (re.match(key, name) is not None), (key, name)


def test_module_names_longer_than_the_cap_are_refused_only_when_rules_match_them(
    production_checks,
):
    config = GPTQConfig(dynamic={"-:.*lm_head": {}, r".*mlp.*": {"bits": 8}})
    fits = "model.mlp." + "x" * (RULE_NAME_MAX_CHARS - len("model.mlp."))
    assert config.resolve(fits).bits == 8
    with pytest.raises(ValueError, match=rf"{RULE_NAME_MAX_CHARS + 1} characters"):
        config.resolve(fits + "x")
    # without rules there is nothing to match: any name resolves to the config itself
    assert GPTQConfig().resolve("x" * 10_000) == GPTQConfig()


# ------------------------------------------------------------------------------------------------
# Property: any string is either refused with ValueError or matches exactly like re.match
# ------------------------------------------------------------------------------------------------

REGEX_ALPHABET = "a.b_0" + "()[]{}|*+?^$\\-:=!<>,1" + "dw"
REGEX_TOKENS = (
    *("a", "b", ".", r"\.", "_", "0", "[ab]", "[^.]", r"\d", r"\w", "$", "^"),
    *("(", "(?:", ")", "|", "*", "+", "?", "*?", "{2}", "{1,3}", "{2,}", "(?=", r"\1"),
)
QUANTIFIERS = ("*", "+", "?", "{2}", "{1,3}", "{2,}", "*?", "+?")


def _compose(parts: st.SearchStrategy[str]) -> st.SearchStrategy[str]:
    return st.one_of(
        st.lists(parts, min_size=1, max_size=4).map("".join),
        st.lists(parts, min_size=2, max_size=3).map(lambda alts: "(?:" + "|".join(alts) + ")"),
        st.tuples(parts, st.sampled_from(QUANTIFIERS)).map(lambda t: f"(?:{t[0]}){t[1]}"),
    )


well_formed = st.recursive(
    st.sampled_from(["a", "b", ".", r"\.", "[ab]", r"\d", "_", ".*", "a+"]), _compose, max_leaves=10
)
regex_strings = st.one_of(
    st.text(alphabet=REGEX_ALPHABET, max_size=24),
    st.lists(st.sampled_from(REGEX_TOKENS), max_size=16).map("".join),
    well_formed,
)
names = st.text(alphabet=string.ascii_lowercase[:2] + "._0", max_size=200)


def _re_answers(pattern: str, module_names: list[str]) -> list[bool] | None:
    """Python re's own answers, in a child process (re cannot be stopped): None past 2 s."""
    code = (
        "import json, re, sys, warnings; warnings.simplefilter('ignore'); p, ns = json.load("
        "sys.stdin); print(json.dumps([re.match(p, n) is not None for n in ns]))"
    )
    try:
        done = subprocess.run(
            [sys.executable, "-c", code], input=json.dumps([pattern, module_names]),
            capture_output=True, text=True, timeout=2, check=True,
        )  # fmt: skip
    except subprocess.TimeoutExpired:
        return None
    return json.loads(done.stdout)


@given(regex_strings, st.lists(names, min_size=1, max_size=3))
@example("(.+)+!", ["a" * 40])
@example("(a|aa)+b", ["a" * 40])
@example(".*.*.*!", ["a" * 200])
@example("a*b*a*b*!", ["ab" * 100])
@example("[a-]*", ["a-" * 100])
@settings(max_examples=60, deadline=None, derandomize=True)
@pytest.mark.filterwarnings("ignore::FutureWarning")  # re's "possible nested set" on '[['
def test_any_pattern_is_refused_or_matches_like_re(pattern, module_names):
    """Refused when built, refused at the timeout, or the answer re gives (where re answers)."""
    try:
        rule = DynamicRule(key="+:" + pattern, overrides={})
    except ValueError:
        return
    expected = _re_answers(pattern, module_names)
    for i, name in enumerate(module_names):
        try:
            got = rule.matches(name)
        except ValueError as exc:
            assert "catastrophic backtracking" in str(exc)
            continue
        if expected is not None:
            assert got == expected[i], name
