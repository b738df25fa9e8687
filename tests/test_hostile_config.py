"""Hostile ``dynamic`` rule keys: patterns whose matching time could explode are refused.

A rule key is a user regex (``+:regex``, ``-:regex`` or bare) matched with ``re.match`` against
every module name, and a checkpoint's config file can carry it. ``"-:(.+)+!"`` takes seconds per
module name and four times longer for every two more characters, so ``load`` would hang. These
tests check that every such construct is refused when the config is built (no timing
thresholds: a refusal is an exception, asserted as such), that the refusal says which construct
and why, and that the patterns real configs use still match exactly as ``re.match`` does.
"""

import re
import string

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from floatxq.config import (
    RULE_BACKTRACK_BUDGET,
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

# (key, what the message must name)
HOSTILE = [
    ("-:(.+)+!", r"nested quantifier.*'\+' contains '\+'"),
    ("(a+)+", r"nested quantifier.*'\+' contains '\+'"),
    ("(a*)*", r"nested quantifier.*'\*' contains '\*'"),
    ("+:(a|aa)+", r"nested quantifier.*contains an alternation"),
    ("(.*a){20}", r"nested quantifier.*'\{20\}' contains '\*'"),
    ("(a?a)+$", r"nested quantifier.*contains '\?'"),
    (r"(?:\d+\.){3}x", r"nested quantifier.*'\{3\}' contains '\+'"),
    (r"-:(?:(?:a|b)c?)*!", r"nested quantifier"),
    (r"(a)\1", r"backreference to group 1"),
    (r"(a)?(?(1)a|b)", r"conditional .* group 1"),
    (r".*(?=q_proj)", r"lookahead \(\?=\.\.\.\)"),
    (r"(?!lm_head).*", r"lookahead \(\?!\.\.\.\)"),
    (r".*(?<=proj)", r"lookbehind \(\?<=\.\.\.\)"),
    (r"-:.*(?<!proj)$", r"lookbehind \(\?<!\.\.\.\)"),
    (".*a" * 4 + "!", r"too many quantifiers"),
    ("a?" * 30 + "!", r"too many quantifiers"),
    ("(?:|)" * 30 + "!", r"too many quantifiers"),
    ("a" * (RULE_PATTERN_MAX_CHARS + 1), rf"{RULE_PATTERN_MAX_CHARS + 1} characters"),
    ("(" * 499 + ")" * 499, r"nested too deeply"),
]


@pytest.mark.parametrize(("key", "named"), HOSTILE, ids=[key[:24] for key, _ in HOSTILE])
def test_hostile_patterns_are_refused_naming_the_construct(key, named, production_checks):
    with pytest.raises(ValueError, match=named) as caught:
        DynamicRule(key=key, overrides={})
    message = str(caught.value)
    assert message.startswith("dynamic: rule key ")
    if "characters" not in named:
        assert "catastrophic backtracking" in message or "nested too deeply" in message


@pytest.mark.parametrize("key", [key for key, _ in HOSTILE[:6]])
def test_every_config_route_refuses_them(key, production_checks):
    # the constructors and the config-file readers (what ``load`` and ``eval`` read)
    for build in (
        lambda: FP8Config(dynamic={key: {}}),
        lambda: GPTQConfig(dynamic={key: {}}),
        lambda: DynamicRules.from_mapping({key: {}}),
        lambda: fp8_config_from_payload({"quant_method": "fp8", "dynamic": {key: {}}}),
        lambda: gptq_config_from_payload({"bits": 4, "dynamic": {key: {}}}),
    ):
        with pytest.raises(ValueError, match="catastrophic backtracking"):
            build()


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


def test_a_last_quantifier_is_free_but_one_more_before_it_is_not(production_checks):
    DynamicRule(key=".*a" * 3 + ".*", overrides={})
    with pytest.raises(ValueError, match="too many quantifiers"):
        DynamicRule(key=".*a" * 4, overrides={})  # the last item is 'a': every '.*' can backtrack
    with pytest.raises(ValueError, match="too many quantifiers"):
        DynamicRule(key=".*a" * 3 + ".*$", overrides={})  # '$' after it: it can backtrack too


def test_the_budget_is_three_unbounded_quantifiers():
    assert RULE_BACKTRACK_BUDGET == (RULE_NAME_MAX_CHARS + 1) ** 3
    DynamicRule(key="a*b*c*!", overrides={})
    with pytest.raises(ValueError, match="too many quantifiers"):
        DynamicRule(key="a*b*c*d*!", overrides={})


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


@given(regex_strings, st.lists(names, min_size=1, max_size=3))
@example("(.+)+!", ["a" * 40])
@example("(a|aa)+b", ["a" * 40])
@example(".*.*.*!", ["a" * 200])
@example("a*b*a*b*!", ["ab" * 100])
@example("[a-]*", ["a-" * 100])
@settings(max_examples=60, deadline=None, derandomize=True)
@pytest.mark.filterwarnings("ignore::FutureWarning")  # re's "possible nested set" on '[['
def test_any_pattern_is_refused_or_matches_like_re(pattern, module_names):
    try:
        rule = DynamicRule(key="+:" + pattern, overrides={})
    except ValueError:
        return
    compiled = re.compile(pattern)
    for name in module_names:
        assert rule.matches(name) == (compiled.match(name) is not None)
