"""Properties of FP8Config and GPTQConfig: payload round trips, true fields, validation, rules.

Expected values come from the small tables and the oracle below (and the payload keys of
``floatxq.testing.reference``), written independently of floatxq.config: alias tables,
GPT-QModel's rule order (keys starting with "-" first, then the others, each in the order given)
and ``re.match`` on the key without its ``+:`` / ``-:`` prefix.
Configs are built in the test bodies, not in strategies: the test-time annotation check (beartype)
samples container items with ``random``, which Hypothesis forbids inside strategies.
"""

import dataclasses
import json
import math
import re
from typing import Any

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from floatxq.config import FP8Config, GPTQConfig
from floatxq.formats import GPTQ_BITS
from floatxq.interop.payload import (
    fp8_config_from_payload,
    fp8_config_to_payload,
    gptq_config_from_payload,
    gptq_config_to_payload,
)
from floatxq.testing import assert_fields_match_annotations, production_checks
from floatxq.testing.reference import FP8_PAYLOAD_KEYS
from floatxq.testing.strategies import FP8_ALIASES, FP8_ENCODABLE

# --------------------------------------------------------------------------------------------
# Independent tables
# --------------------------------------------------------------------------------------------

WEIGHT_FORMAT_ALIASES = {
    "": "float8_e4m3fn",
    "fp8": "float8_e4m3fn",
    **{alias: name for alias, name in FP8_ALIASES.items() if name in FP8_ENCODABLE},
}

MODULES = (
    "lm_head",
    "model.embed_tokens",
    *(
        f"model.layers.{i}.{block}.{proj}_proj"
        for i in (0, 1, 10)
        for block, projs in (("self_attn", "qkvo"), ("mlp", ("gate", "up", "down")))
        for proj in projs
    ),
)

PATTERNS = (
    r".*q_proj",
    r".*\.mlp\..*",
    r"model\.layers\.1\.",
    r"model\.layers\.1",
    r"lm_head",
    r".*proj",
    r"proj",
    r"model\.layers\.(0|10)\.self_attn",
    r"model\.layers\.0\.mlp\.down_proj",
    r".*down_proj$",
    r"model",
    r"",
)

GPTQ_FIELDS = (
    "bits",
    "group_size",
    "sym",
    "desc_act",
    "static_groups",
    "act_group_aware",
    "damp_percent",
    "damp_auto_increment",
    "mse",
    "lm_head",
    "format",
    "activation",
    "dynamic",
    "meta",
)
GPTQ_META_SETTINGS = (
    "damp_percent",
    "damp_auto_increment",
    "static_groups",
    "act_group_aware",
    "mse",
)


def first_matching_key(dynamic, module):
    """The oracle's rule choice: ``-`` keys first, then the others; ``re.match`` on the pattern."""
    rules = dict(dynamic or {})
    ordered = [k for k in rules if k.startswith("-")] + [k for k in rules if not k.startswith("-")]
    for key in ordered:
        pattern = key[2:] if key[:2] in ("-:", "+:") else key
        if re.match(pattern, module) is not None:
            return key
    return None


# --------------------------------------------------------------------------------------------
# Strategies (valid by construction)
# --------------------------------------------------------------------------------------------

_PADDING = st.sampled_from(["", " ", "\t", "  ", "\n"])


_CASES = (str.lower, str.upper, str.title, str.swapcase)


@st.composite
def spelled(draw, names):
    """A name in one of four letter cases with surrounding whitespace."""
    name = draw(st.sampled_from(names))
    case = draw(st.sampled_from(_CASES))
    return draw(_PADDING) + case(name) + draw(_PADDING)


format_spellings = spelled(sorted(WEIGHT_FORMAT_ALIASES))
block_sizes = st.tuples(st.integers(1, 1024), st.integers(1, 1024)).flatmap(
    lambda pair: st.sampled_from([pair, list(pair)])
)


@st.composite
def scale_layouts(draw):
    """``(kwargs, expected_method, expected_block)`` for a valid method/block-size pair."""
    kind = draw(st.sampled_from(["tensor", "row", "block", "implicit_block", "implicit_row"]))
    if kind in ("tensor", "row"):
        return {"weight_scale_method": draw(spelled([kind]))}, kind, None
    if kind == "implicit_row":
        return draw(st.sampled_from([{}, {"weight_scale_method": None}])), "row", None
    block = draw(block_sizes)
    kwargs = {"weight_block_size": block}
    if kind == "block":
        kwargs["weight_scale_method"] = draw(spelled(["block"]))
    return kwargs, "block", tuple(block)


json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**40), 2**40)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=3),
    lambda children: (
        st.lists(children, max_size=2) | st.dictionaries(st.text(max_size=2), children, max_size=2)
    ),
    max_leaves=3,
)
# meta keys that are never a config field's name (GPTQConfig refuses those)
meta_mappings = st.dictionaries(st.text("xyz", max_size=3), json_values, max_size=2)


def rule_keys(max_size=4):
    return st.lists(
        st.tuples(st.sampled_from(["", "+:", "-:"]), st.sampled_from(PATTERNS)).map("".join),
        max_size=max_size,
        unique=True,
    )


@st.composite
def fp8_rule_overrides(draw):
    """Raw overrides of one FP8 ``+:`` / bare rule, as a user would write them."""
    rule: dict[str, Any] = {}
    if draw(st.booleans()):
        rule["format"] = draw(format_spellings)
    if draw(st.booleans()):
        rule.update(draw(scale_layouts())[0])
    return rule


@st.composite
def fp8_dynamic_rules(draw):
    """A ``dynamic`` mapping of 0-4 rules over :data:`PATTERNS`, or None."""
    keys = draw(rule_keys())
    if not keys and draw(st.booleans()):
        return None
    return {
        key: draw(st.sampled_from([{}, None]))
        if key.startswith("-:")
        else draw(fp8_rule_overrides())
        for key in keys
    }


@st.composite
def fp8_base_configs(draw):
    """``(kwargs, expected_format, expected_method, expected_block)`` for FP8Config(**kwargs)."""
    fmt = draw(format_spellings)
    layout, scale_method, block = draw(scale_layouts())
    kwargs: dict[str, Any] = {"format": fmt, **layout}
    if draw(st.booleans()):
        kwargs["lm_head"] = draw(st.booleans())
    if draw(st.booleans()):
        kwargs["meta"] = draw(meta_mappings)
    canonical = WEIGHT_FORMAT_ALIASES[fmt.strip().lower()]
    return kwargs, canonical, scale_method, block


fp8_config_kwargs = st.builds(
    lambda base, dynamic: {**base[0], "dynamic": dynamic}, fp8_base_configs(), fp8_dynamic_rules()
)

# GPTQ ----------------------------------------------------------------------------------------

gptq_format_spellings = spelled(["gptq", "gptq_v2"])
damp_percents = st.floats(0.0, 1.0, exclude_min=True, exclude_max=True)
non_negatives = st.floats(0.0, 1e6) | st.integers(0, 5)

GPTQ_VALUES = {
    "bits": st.sampled_from(GPTQ_BITS),
    "group_size": st.just(-1) | st.integers(1, 4096),
    "sym": st.booleans(),
    "static_groups": st.booleans(),
    "damp_percent": damp_percents,
    "damp_auto_increment": non_negatives,
    "mse": non_negatives,
}


@st.composite
def gptq_rule_overrides(draw):
    """Raw overrides of one GPTQ ``+:`` rule: any subset of the solver settings."""
    names = draw(
        st.lists(st.sampled_from([*GPTQ_VALUES, "desc_act", "act_group_aware"]), unique=True)
    )
    rule = {}
    for name in names:
        rule[name] = (
            draw(st.booleans())
            if name in ("desc_act", "act_group_aware")
            else draw(GPTQ_VALUES[name])
        )
    return rule


def _valid_pair(desc_act, act_group_aware, rule):
    """The rule, with ``act_group_aware`` turned off where it would meet ``desc_act``."""
    merged_desc = rule.get("desc_act", desc_act)
    merged_aware = rule.get("act_group_aware", False if rule.get("desc_act") else act_group_aware)
    if merged_desc and merged_aware:
        return {**rule, "act_group_aware": False}
    return rule


@st.composite
def gptq_config_kwargs(draw):
    """GPTQConfig keyword arguments: a random subset of the fields, each valid."""
    kwargs: dict[str, Any] = {}
    for name, values in GPTQ_VALUES.items():
        if draw(st.booleans()):
            kwargs[name] = draw(values)
    desc_act = draw(st.sampled_from([None, False, True]))
    if desc_act is not None or draw(st.booleans()):
        kwargs["desc_act"] = desc_act
    if desc_act:
        kwargs["act_group_aware"] = False  # leaving it None warns, tested by example
    elif draw(st.booleans()):
        kwargs["act_group_aware"] = draw(st.sampled_from([None, False, True]))
    if draw(st.booleans()):
        kwargs["lm_head"] = draw(st.booleans())
    if draw(st.booleans()):
        kwargs["format"] = draw(gptq_format_spellings)
    if draw(st.booleans()):
        kwargs["meta"] = draw(meta_mappings)
    base_desc = bool(kwargs.get("desc_act"))
    base_aware = kwargs.get("act_group_aware")
    base_aware = (not base_desc) if base_aware is None else base_aware
    keys = draw(rule_keys())
    if keys or draw(st.booleans()):
        kwargs["dynamic"] = {
            key: draw(st.sampled_from([{}, None]))
            if key.startswith("-:")
            else _valid_pair(base_desc, base_aware, draw(gptq_rule_overrides()))
            for key in keys
        }
    return kwargs


# --------------------------------------------------------------------------------------------
# FP8Config properties
# --------------------------------------------------------------------------------------------


def fp8_oracle_resolve(base, dynamic, module):
    """``None`` (excluded) or ``(format, weight_scale_method, weight_block_size)``."""
    key = first_matching_key(dynamic, module)
    if key is None:
        return base
    if key.startswith("-:"):
        return None
    raw = dynamic[key]
    fmt, scale_method, block = base
    if "format" in raw:
        fmt = WEIGHT_FORMAT_ALIASES[raw["format"].strip().lower()]
    if "weight_scale_method" in raw or "weight_block_size" in raw:
        given_block = raw.get("weight_block_size")
        block = None if given_block is None else tuple(given_block)
        given = raw.get("weight_scale_method")
        if given is not None:
            scale_method = given.strip().lower()
        else:
            scale_method = "block" if block is not None else "row"
    return fmt, scale_method, block


modules_drawn = st.lists(st.sampled_from(MODULES), min_size=1, max_size=8, unique=True)


@given(fp8_config_kwargs, st.data())
def test_fp8_payload_round_trips_and_reads_legacy_spellings(kwargs, data):
    """config -> payload -> config and payload -> config -> payload are exact (also through
    JSON); fields hold their annotated types; and the legacy spellings (``fmt`` for ``format``,
    carried fields as None, ``weight_only`` without a smoother, ``bits``/``group_size`` in
    rules) read as the canonical payload does."""
    cfg = FP8Config(**kwargs)
    assert_fields_match_annotations(cfg)
    assert dataclasses.replace(cfg) == cfg
    payload = fp8_config_to_payload(cfg)
    through_json = json.loads(json.dumps(payload))
    again = fp8_config_from_payload(through_json)
    assert again == cfg and hash(again) == hash(cfg)
    assert json.dumps(fp8_config_to_payload(again)) == json.dumps(payload)

    legacy = json.loads(json.dumps(payload))
    if data.draw(st.booleans(), label="fmt"):
        legacy["fmt"] = legacy.pop("format")
    for name in ("bits", "group_size", "desc_act", "sym", "weight_scale_semantics"):
        if data.draw(st.booleans(), label=f"{name}=None"):
            legacy[name] = None
    if data.draw(st.booleans(), label="weight_only"):
        legacy["weight_only"] = data.draw(st.sampled_from([True, False, {}, {"smoother": None}]))
    for rule in (legacy.get("dynamic") or {}).values():
        if "format" in rule and data.draw(st.booleans(), label="rule fmt"):
            rule["fmt"] = rule.pop("format")
        if rule and data.draw(st.booleans(), label="rule bits"):
            rule.update(bits=8, group_size=data.draw(st.sampled_from([-1, None])))
    assert fp8_config_from_payload(legacy) == cfg


@given(fp8_base_configs(), fp8_dynamic_rules())
def test_fp8_payload_fields_follow_the_inputs(base, dynamic):
    kwargs, fmt, scale_method, block = base
    payload = fp8_config_to_payload(FP8Config(**kwargs, dynamic=dynamic))
    expected_keys = set(FP8_PAYLOAD_KEYS)
    if block is not None:
        expected_keys.add("weight_block_size")
    if dynamic:
        expected_keys.add("dynamic")
    if kwargs.get("meta"):
        expected_keys.add("meta")
    assert set(payload) == expected_keys
    assert payload["format"] == payload["checkpoint_format"] == fmt
    assert payload["weight_scale_method"] == scale_method
    assert payload.get("weight_block_size") == (None if block is None else list(block))
    assert (payload["bits"], payload["group_size"], payload["desc_act"], payload["sym"]) == (
        8,
        -1,
        False,
        True,
    )
    assert payload["method"] == payload["quant_method"] == "fp8"
    assert payload["lm_head"] is kwargs.get("lm_head", False)
    if dynamic:
        minus_first = [k for k in dynamic if k.startswith("-")]
        minus_first += [k for k in dynamic if not k.startswith("-")]
        assert list(payload["dynamic"]) == minus_first


@given(fp8_base_configs(), fp8_dynamic_rules(), modules_drawn)
@example(
    base=({"weight_block_size": [128, 128]}, "float8_e4m3fn", "block", (128, 128)),
    dynamic={r".*q_proj": {"weight_scale_method": "row"}, r"-:model\.layers\.1\.": None},
    modules=["model.layers.1.self_attn.q_proj", "model.layers.0.self_attn.q_proj", "lm_head"],
)
@example(
    base=({"format": "e5m2"}, "float8_e5m2", "row", None),
    dynamic={r"proj": {"format": "e4m3"}, r".*proj": {"weight_block_size": (16, 32)}},
    modules=["model.layers.0.mlp.up_proj"],
)
def test_fp8_resolution_agrees_with_the_oracle(base, dynamic, modules):
    kwargs, fmt, scale_method, block = base
    cfg = FP8Config(**kwargs, dynamic=dynamic)
    for module in modules:
        expected = fp8_oracle_resolve((fmt, scale_method, block), dynamic, module)
        resolved = cfg.resolve(module)
        if expected is None:
            assert resolved is None, module
            continue
        got = (resolved.format, resolved.weight_scale_method, resolved.weight_block_size)
        assert got == expected, module
        assert resolved.dynamic is None
        assert (resolved.lm_head, resolved.meta) == (cfg.lm_head, cfg.meta)
        assert_fields_match_annotations(resolved)


@given(block_sizes, spelled(["tensor", "row"]))
def test_fp8_block_size_with_a_non_block_method_is_rejected(block, scale_method):
    with pytest.raises(ValueError, match="weight_block_size"):
        FP8Config(weight_scale_method=scale_method, weight_block_size=block)
    with pytest.raises(ValueError, match=r"dynamic\['x'\]"):
        FP8Config(dynamic={"x": {"weight_scale_method": scale_method, "weight_block_size": block}})


@given(spelled(["e8m0", "e8m0fnu", "float8_e8m0", "float8_e8m0fnu"]))
def test_e8m0_is_never_a_weight_format(name):
    with pytest.raises(ValueError, match="decode-only"):
        FP8Config(format=name)
    with pytest.raises(ValueError, match="decode-only"):
        FP8Config(dynamic={".*": {"format": name}})
    with pytest.raises(ValueError, match="decode-only"):
        fp8_config_from_payload({"dynamic": {".*": {"fmt": name}}})


# --------------------------------------------------------------------------------------------
# GPTQConfig properties
# --------------------------------------------------------------------------------------------


@given(gptq_config_kwargs(), st.data())
def test_gptq_payload_round_trips_and_fields_are_true(kwargs, data):
    """config -> payload -> config and payload -> config -> payload are exact (also through
    JSON), with the solver settings in ``meta``; older payloads that keep some of them at the
    top level (or in both places, agreeing) read the same; fields hold their annotated types
    and the given values; rules are stored ``-`` keys first, each group in the given order."""
    cfg = GPTQConfig(**kwargs)
    assert_fields_match_annotations(cfg)
    assert tuple(f.name for f in dataclasses.fields(cfg)) == GPTQ_FIELDS
    assert dataclasses.replace(cfg) == cfg
    assert not (cfg.desc_act and cfg.act_group_aware)
    for name in ("bits", "group_size", "sym", "static_groups", "lm_head"):
        if name in kwargs:
            assert getattr(cfg, name) == kwargs[name]
    for name in ("damp_percent", "damp_auto_increment", "mse"):
        if name in kwargs:
            assert getattr(cfg, name) == float(kwargs[name])
    assert cfg.format == kwargs.get("format", "gptq").strip().lower()
    dynamic = kwargs.get("dynamic") or {}
    minus_first = [k for k in dynamic if k.startswith("-")]
    minus_first += [k for k in dynamic if not k.startswith("-")]
    assert [rule.key for rule in cfg.dynamic or ()] == minus_first

    payload = gptq_config_to_payload(cfg)
    through_json = json.loads(json.dumps(payload))
    assert through_json == payload
    again = gptq_config_from_payload(through_json)
    assert again == cfg and hash(again) == hash(cfg)
    assert gptq_config_to_payload(again) == payload
    assert set(payload["meta"]) >= set(GPTQ_META_SETTINGS)
    assert payload["format"] == payload["checkpoint_format"] == cfg.format
    assert list(payload.get("dynamic", {})) == minus_first

    for name in GPTQ_META_SETTINGS:
        if data.draw(st.booleans(), label=f"{name} at the top level"):
            value = through_json["meta"].pop(name)
            through_json[name] = value
            if data.draw(st.booleans(), label=f"{name} in both places"):
                through_json["meta"][name] = value
    assert gptq_config_from_payload(through_json) == cfg


@given(gptq_config_kwargs(), modules_drawn)
@example(
    kwargs={
        "dynamic": {
            r".*proj": {"desc_act": True},
            r"-:model\.layers\.1\.": None,
            r".*q_proj": {"bits": 8},
        }
    },
    modules=["model.layers.0.self_attn.q_proj", "model.layers.1.mlp.up_proj", "lm_head"],
)
@example(
    kwargs={"desc_act": True, "act_group_aware": False, "dynamic": {"": {"bits": 2}}},
    modules=["lm_head"],
)
def test_gptq_resolution_is_replace_with_the_first_matching_rule(kwargs, modules):
    """First matching rule wins, ``-:`` keys are tried first, the match is anchored at the
    start, and the result is ``replace(config, **overrides)`` of that rule (a rule that turns
    ``desc_act`` on without naming ``act_group_aware`` turns it off, as documented)."""
    cfg = GPTQConfig(**kwargs)
    dynamic = kwargs.get("dynamic")
    plain = dataclasses.replace(cfg, dynamic=None)
    for module in modules:
        key = first_matching_key(dynamic, module)
        resolved = cfg.resolve(module)
        if key is not None and key.startswith("-:"):
            assert resolved is None, module
            continue
        raw = dict(dynamic[key]) if key is not None else {}
        if raw.get("desc_act") and "act_group_aware" not in raw:
            raw["act_group_aware"] = False
        assert resolved == dataclasses.replace(plain, **raw), module
        assert resolved.dynamic is None and resolved.meta == cfg.meta


# Invalid values per field: (value, error kind). The message must name the field.
_NOT_INT = st.sampled_from([True, False, "4", 4.0, None])
_NOT_BOOL = st.sampled_from([0, 1, "yes", 1.0])
_NOT_REAL = st.sampled_from([True, "0.1", None, [0.1]])
_NOT_FINITE = st.sampled_from([math.nan, math.inf, -math.inf])
INVALID = {
    "bits": st.one_of(
        st.integers(-64, 64).filter(lambda b: b not in GPTQ_BITS).map(lambda v: (v, ValueError)),
        _NOT_INT.map(lambda v: (v, TypeError)),
    ),
    "group_size": st.one_of(
        st.integers(-(2**20), 0).filter(lambda g: g != -1).map(lambda v: (v, ValueError)),
        _NOT_INT.map(lambda v: (v, TypeError)),
    ),
    "damp_percent": st.one_of(
        (st.floats(max_value=0.0) | st.floats(min_value=1.0)).map(lambda v: (v, ValueError)),
        _NOT_REAL.map(lambda v: (v, TypeError)),
    ),
    "damp_auto_increment": st.one_of(
        st.floats(max_value=-1e-300).map(lambda v: (v, ValueError)),
        _NOT_FINITE.map(lambda v: (v, ValueError)),
        _NOT_REAL.map(lambda v: (v, TypeError)),
    ),
    "mse": st.one_of(
        st.integers(max_value=-1).map(lambda v: (v, ValueError)),
        _NOT_FINITE.map(lambda v: (v, ValueError)),
        _NOT_REAL.map(lambda v: (v, TypeError)),
    ),
    **{
        name: _NOT_BOOL.map(lambda v: (v, TypeError))
        for name in ("sym", "static_groups", "lm_head", "desc_act", "act_group_aware")
    },
    "format": st.one_of(
        st.text(max_size=8)
        .filter(lambda t: t.strip().lower() not in ("gptq", "gptq_v2"))
        .map(lambda v: (v, ValueError)),
        st.sampled_from([1, b"gptq", ["gptq"]]).map(lambda v: (v, TypeError)),
    ),
}
_RULE_FIELDS = tuple(name for name in INVALID if name not in ("lm_head", "format"))


def invalid_cases(fields):
    return st.sampled_from(sorted(fields)).flatmap(lambda n: st.tuples(st.just(n), INVALID[n]))


@given(invalid_cases(INVALID))
def test_gptq_every_invalid_field_value_raises_naming_the_field(case):
    """From the constructor and from a payload alike (a payload's None means "absent")."""
    name, (value, error) = case
    with production_checks(), pytest.raises(error, match=name):
        GPTQConfig(**{name: value})
    if value is not None:
        with production_checks(), pytest.raises(error, match=name):
            gptq_config_from_payload({name: value})


@given(invalid_cases(_RULE_FIELDS), st.sampled_from(PATTERNS))
def test_gptq_every_invalid_rule_value_raises_naming_the_rule_and_field(case, pattern):
    name, (value, error) = case
    where = re.escape(f"dynamic[{pattern!r}].{name}")
    with production_checks(), pytest.raises(error, match=where):
        GPTQConfig(dynamic={pattern: {name: value}})
    with production_checks(), pytest.raises(error, match=where):
        gptq_config_from_payload({"dynamic": {pattern: {name: value}}})
