"""Properties of FP8Config: payload round trips, idempotent normalization, rule resolution.

Expected values come from the small tables and the oracle below, written independently of
floatxq.config: an alias table, the seed's rule order (keys starting with "-" first, then the
others, each in insertion order) and ``re.match`` on the key without its ``+:`` / ``-:`` prefix.
"""

import dataclasses
import json
import re
from typing import Any

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from floatxq.config import METHOD, FP8Config
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

ALWAYS_KEYS = {
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
    "weight_scale_semantics",
    "sym",
}

# --------------------------------------------------------------------------------------------
# Strategies (valid by construction)
# --------------------------------------------------------------------------------------------

_PADDING = st.sampled_from(["", " ", "\t", "  ", "\n"])


@st.composite
def spelled(draw, names):
    """A name with random letter case and surrounding whitespace."""
    name = draw(st.sampled_from(names))
    upper = draw(st.lists(st.booleans(), min_size=len(name), max_size=len(name)))
    body = "".join(c.upper() if up else c for c, up in zip(name, upper, strict=True))
    return draw(_PADDING) + body + draw(_PADDING)


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
    | st.text(max_size=4),
    lambda children: (
        st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=3), children, max_size=3)
    ),
    max_leaves=6,
)


@st.composite
def rule_overrides(draw):
    """Raw overrides of one ``+:`` / bare rule, as a user would write them."""
    rule: dict[str, Any] = {}
    if draw(st.booleans()):
        rule[draw(st.sampled_from(["format", "fmt"]))] = draw(format_spellings)
    if draw(st.booleans()):
        rule.update(draw(scale_layouts())[0])
    if draw(st.booleans()):
        rule["bits"] = 8
    if draw(st.booleans()):
        rule["group_size"] = draw(st.sampled_from([-1, None]))
    if draw(st.booleans()):
        rule["weight_scale_semantics"] = draw(spelled(["inverse"]))
    return rule


@st.composite
def dynamic_rules(draw):
    """A ``dynamic`` mapping of 0-5 rules over :data:`PATTERNS`, or None."""
    keys = draw(
        st.lists(
            st.tuples(st.sampled_from(["", "+:", "-:"]), st.sampled_from(PATTERNS)).map("".join),
            max_size=5,
            unique=True,
        )
    )
    if not keys and draw(st.booleans()):
        return None
    return {
        key: draw(st.sampled_from([{}, None])) if key.startswith("-:") else draw(rule_overrides())
        for key in keys
    }


@st.composite
def base_configs(draw):
    """``(kwargs, expected_format, expected_method, expected_block)`` for FP8Config(**kwargs)."""
    fmt = draw(format_spellings)
    layout, scale_method, block = draw(scale_layouts())
    kwargs: dict[str, Any] = {"format": fmt, **layout}
    if draw(st.booleans()):
        kwargs["method"] = draw(st.sampled_from([METHOD.FP8, "fp8", " FP8"]))
    if draw(st.booleans()):
        kwargs["lm_head"] = draw(st.booleans())
    if draw(st.booleans()):
        kwargs["weight_scale_semantics"] = draw(st.sampled_from([None, "inverse", " Inverse"]))
    for name, value in (("group_size", -1), ("desc_act", False), ("sym", True)):
        if draw(st.booleans()):
            kwargs[name] = draw(st.sampled_from([value, None]))
    if draw(st.booleans()):
        kwargs["meta"] = draw(st.dictionaries(st.text(max_size=4), json_values, max_size=3))
    if draw(st.booleans()):
        kwargs["smoother"] = draw(json_values)
    canonical = WEIGHT_FORMAT_ALIASES[fmt.strip().lower()]
    return kwargs, canonical, scale_method, block


# FP8Config is built in the test bodies, not in strategies: the test-time annotation check
# (beartype) samples container items with `random`, which Hypothesis forbids inside strategies.
config_kwargs = st.builds(
    lambda base, dynamic: {**base[0], "dynamic": dynamic}, base_configs(), dynamic_rules()
)


# --------------------------------------------------------------------------------------------
# Oracle
# --------------------------------------------------------------------------------------------


def oracle_resolve(base, dynamic, module):
    """``None`` (excluded) or ``(format, weight_scale_method, weight_block_size)``."""
    rules = dict(dynamic or {})
    ordered = [k for k in rules if k.startswith("-")] + [k for k in rules if not k.startswith("-")]
    for key in ordered:
        exclude = key.startswith("-:")
        pattern = key[2:] if key[:2] in ("-:", "+:") else key
        if re.match(pattern, module) is None:
            continue
        if exclude:
            return None
        raw = rules[key]
        fmt, scale_method, block = base
        if "format" in raw or "fmt" in raw:
            spelling = raw["format"] if "format" in raw else raw["fmt"]
            fmt = WEIGHT_FORMAT_ALIASES[spelling.strip().lower()]
        if "weight_scale_method" in raw or "weight_block_size" in raw:
            given_block = raw.get("weight_block_size")
            block = None if given_block is None else tuple(given_block)
            given = raw.get("weight_scale_method")
            if given is not None:
                scale_method = given.strip().lower()
            else:
                scale_method = "block" if block is not None else "row"
        return fmt, scale_method, block
    return base


# --------------------------------------------------------------------------------------------
# Properties
# --------------------------------------------------------------------------------------------


@given(config_kwargs)
def test_round_trip_through_dict_and_json(kwargs):
    cfg = FP8Config(**kwargs)
    payload = cfg.to_dict()
    assert FP8Config.from_dict(payload) == cfg
    through_json = json.loads(json.dumps(payload))
    again = FP8Config.from_dict(through_json)
    assert again == cfg
    assert hash(again) == hash(cfg)
    assert again.to_dict() == payload
    assert json.dumps(again.to_dict()) == json.dumps(payload)


@given(config_kwargs)
def test_normalization_is_idempotent(kwargs):
    cfg = FP8Config(**kwargs)
    payload = cfg.to_dict()
    assert FP8Config.from_dict(payload).to_dict() == payload
    assert FP8Config.from_dict(FP8Config.from_dict(payload).to_dict()) == cfg
    assert dataclasses.replace(cfg) == cfg


@given(base_configs(), dynamic_rules())
def test_payload_fields_follow_the_inputs(base, dynamic):
    kwargs, fmt, scale_method, block = base
    payload = FP8Config(**kwargs, dynamic=dynamic).to_dict()
    expected_keys = set(ALWAYS_KEYS)
    if block is not None:
        expected_keys.add("weight_block_size")
    if dynamic:
        expected_keys.add("dynamic")
    if kwargs.get("meta"):
        expected_keys.add("meta")
    if kwargs.get("smoother") not in (None, {}):
        expected_keys.add("smoother")
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


@given(base_configs(), dynamic_rules())
@example(
    base=({"weight_block_size": [128, 128]}, "float8_e4m3fn", "block", (128, 128)),
    dynamic={r".*q_proj": {"weight_scale_method": "row"}, r"-:model\.layers\.1\.": None},
)
@example(
    base=({"format": "e5m2"}, "float8_e5m2", "row", None),
    dynamic={r"proj": {"fmt": "e4m3"}, r".*proj": {"weight_block_size": (16, 32)}},
)
def test_resolution_agrees_with_the_oracle(base, dynamic):
    kwargs, fmt, scale_method, block = base
    cfg = FP8Config(**kwargs, dynamic=dynamic)
    for module in MODULES:
        expected = oracle_resolve((fmt, scale_method, block), dynamic, module)
        resolved = cfg.resolve(module)
        if expected is None:
            assert resolved is None, module
            continue
        got = (resolved.format, resolved.weight_scale_method, resolved.weight_block_size)
        assert got == expected, module
        assert resolved.dynamic is None
        assert (resolved.lm_head, resolved.meta, resolved.smoother) == (
            cfg.lm_head,
            cfg.meta,
            cfg.smoother,
        )


@given(block_sizes, spelled(["tensor", "row"]))
def test_block_size_with_a_non_block_method_is_rejected(block, scale_method):
    with pytest.raises(ValueError, match="weight_block_size"):
        FP8Config(weight_scale_method=scale_method, weight_block_size=block)
    with pytest.raises(ValueError, match=r"dynamic\['x'\]"):
        FP8Config(dynamic={"x": {"weight_scale_method": scale_method, "weight_block_size": block}})


@given(spelled(["e8m0", "e8m0fnu", "float8_e8m0", "float8_e8m0fnu"]))
def test_e8m0_is_never_a_weight_format(name):
    with pytest.raises(ValueError, match="decode-only"):
        FP8Config(format=name)
    with pytest.raises(ValueError, match="decode-only"):
        FP8Config(dynamic={".*": {"fmt": name}})
