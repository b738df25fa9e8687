"""Example-based tests for floatxq.config (enums, FP8Config, dynamic rules) and FP8 payloads."""

import dataclasses
import json
import typing

import jaxtyping
import pytest
import torch

from floatxq.config import (
    BACKEND,
    FORMAT,
    METHOD,
    DynamicRule,
    DynamicRules,
    FP8Config,
    GPTQConfig,
    NVFP4Config,
)
from floatxq.formats import FP8_DECODE_ONLY_FORMATS, FP8_FORMATS, FP8WeightFormat
from floatxq.interop.payload import (
    fp8_config_from_payload,
    fp8_config_to_payload,
    payload_format,
    payload_method,
)
from floatxq.testing import assert_fields_match_annotations
from floatxq.testing.reference import FP8_PAYLOAD_KEYS

# --------------------------------------------------------------------------------------------
# Enums
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("member", "value"),
    [
        (METHOD.FP8, "fp8"),
        (METHOD.GPTQ, "gptq"),
        (FORMAT.FP8, "fp8"),
        (FORMAT.GPTQ, "gptq"),
        (FORMAT.GPTQ_V2, "gptq_v2"),
        (BACKEND.AUTO, "auto"),
        (BACKEND.FP8_TORCH, "fp8_torch"),
    ],
)
def test_enum_members_are_their_string_values(member, value):
    assert isinstance(member, str)
    assert member == value
    assert str(member) == value
    assert f"{member}" == value
    assert json.dumps(member) == json.dumps(value)
    assert type(member)(value) is member


def test_enum_members_are_only_what_exists():
    assert [m.value for m in METHOD] == ["fp8", "gptq", "nvfp4"]
    assert [m.value for m in FORMAT] == ["fp8", "gptq", "gptq_v2"]
    assert [m.value for m in BACKEND] == [
        "auto", "fp8_torch", "gptq_torch", "gptq_w4afp8", "gptq_w4a_nvfp4", "mlx"
    ]  # fmt: skip
    with pytest.raises(ValueError, match=repr("tensorrt")):
        BACKEND("tensorrt")


def test_configs_name_their_method_without_a_field():
    assert FP8Config.method is METHOD.FP8 and FP8Config().method is METHOD.FP8
    assert GPTQConfig.method is METHOD.GPTQ
    assert NVFP4Config.quant_method is METHOD.NVFP4 and NVFP4Config().method == "rtn"
    assert FP8Config.quant_method is METHOD.FP8 and GPTQConfig.quant_method is METHOD.GPTQ
    assert "method" not in {f.name for f in dataclasses.fields(FP8Config)}
    with pytest.raises(TypeError, match="method"):
        FP8Config(method="fp8")


def test_weight_format_literal_is_the_encodable_fp8_formats():
    assert set(typing.get_args(FP8WeightFormat)) == set(FP8_FORMATS) - FP8_DECODE_ONLY_FORMATS


# --------------------------------------------------------------------------------------------
# FP8Config: defaults, normalization, honest fields
# --------------------------------------------------------------------------------------------


def test_defaults():
    cfg = FP8Config()
    assert cfg.format == "float8_e4m3fn"
    assert cfg.weight_scale_method == "row"
    assert cfg.weight_block_size is None
    assert cfg.lm_head is False
    assert cfg.dynamic is None and cfg.meta is None
    assert [f.name for f in dataclasses.fields(cfg)] == [
        "format",
        "weight_scale_method",
        "weight_block_size",
        "lm_head",
        "dynamic",
        "meta",
        "gsq",
        "gsq_calibration",
    ]
    assert cfg.gsq is None and cfg.gsq_calibration is False
    assert cfg == FP8Config()
    assert hash(cfg) == hash(FP8Config())


@pytest.mark.parametrize(
    "name",
    ["bits", "group_size", "desc_act", "sym", "weight_scale_semantics", "smoother"],
)
def test_fields_without_a_choice_or_an_implementation_are_not_fields(name):
    # bits/group_size/desc_act/sym/weight_scale_semantics have one value (the payload writes
    # it); a smoother has no implementation in floatxq yet
    assert not hasattr(FP8Config(), name)
    with pytest.raises(TypeError, match=name):
        FP8Config(**{name: None})


@pytest.mark.parametrize(
    "cfg",
    [
        FP8Config(),
        FP8Config(format=torch.float8_e5m2, weight_block_size=[16, 32], lm_head=True),
        FP8Config(format=None, weight_scale_method=" TENSOR "),
        FP8Config(format=FORMAT.FP8, meta={"k": [1, {"x": None}]}),
        FP8Config(dynamic={"-:a": None, "b": {"weight_block_size": [8, 8], "format": "e5m2"}}),
    ],
)
def test_every_field_annotation_is_true(cfg):
    assert_fields_match_annotations(cfg)
    assert type(cfg.format) is str
    if cfg.dynamic is not None:
        assert isinstance(cfg.dynamic, DynamicRules)


def test_the_field_check_and_the_production_switch_can_fail():
    from floatxq.testing import production_checks as checks_off  # the fixture has this name

    cfg = FP8Config()
    object.__setattr__(cfg, "lm_head", 1)  # what a missing normalization would leave behind
    with pytest.raises(AssertionError, match="field lm_head holds 1"):
        assert_fields_match_annotations(cfg)
    before = jaxtyping.config.jaxtyping_disable
    with pytest.raises(KeyError), checks_off():
        assert jaxtyping.config.jaxtyping_disable
        raise KeyError("the setting is restored on the way out")
    assert jaxtyping.config.jaxtyping_disable == before


@pytest.mark.parametrize(
    ("alias", "canonical"),
    [
        ("e4m3", "float8_e4m3fn"),
        (" E4M3 ", "float8_e4m3fn"),
        ("float8_e4m3", "float8_e4m3fn"),
        ("fp8", "float8_e4m3fn"),
        ("", "float8_e4m3fn"),
        (None, "float8_e4m3fn"),
        (FORMAT.FP8, "float8_e4m3fn"),
        ("E5M2", "float8_e5m2"),
        ("e4m3fnuz", "float8_e4m3fnuz"),
        ("float8_e5m2fnuz", "float8_e5m2fnuz"),
        (torch.float8_e5m2, "float8_e5m2"),
    ],
)
def test_format_aliases(alias, canonical):
    cfg = FP8Config(format=alias)
    assert cfg.format == canonical
    assert type(cfg.format) is str


@pytest.mark.parametrize("alias", ["e8m0", "E8M0FNU", "float8_e8m0", "float8_e8m0fnu"])
def test_e8m0_is_rejected_as_weight_format(alias):
    with pytest.raises(ValueError, match=r"format.*float8_e8m0fnu.*decode-only"):
        FP8Config(format=alias)


def test_unknown_format_and_other_format_members():
    with pytest.raises(ValueError, match=r"format.*'e3m4'"):
        FP8Config(format="e3m4")
    with pytest.raises(ValueError, match=r"format.*FORMAT\.GPTQ"):
        FP8Config(format=FORMAT.GPTQ)


def test_format_of_wrong_kind(production_checks):
    with pytest.raises(TypeError, match="format"):
        FP8Config(format=8)


def test_scale_method_resolution():
    assert FP8Config().weight_scale_method == "row"
    assert FP8Config(weight_scale_method=" Tensor ").weight_scale_method == "tensor"
    block = FP8Config(weight_block_size=[128, 64])
    assert (block.weight_scale_method, block.weight_block_size) == ("block", (128, 64))
    explicit = FP8Config(weight_scale_method="BLOCK", weight_block_size=(128, 64))
    assert explicit == block
    assert hash(explicit) == hash(block)


@pytest.mark.parametrize(
    ("kwargs", "fragment"),
    [
        ({"weight_scale_method": "block"}, "needs weight_block_size"),
        ({"weight_scale_method": "row", "weight_block_size": [128, 128]}, "only valid with"),
        ({"weight_scale_method": "tensor", "weight_block_size": [128, 128]}, "only valid with"),
        ({"weight_scale_method": "channel"}, r"weight_scale_method.*'channel'"),
        ({"weight_block_size": [128]}, "weight_block_size"),
        ({"weight_block_size": [0, 128]}, "weight_block_size"),
        ({"weight_block_size": [128, -1]}, "weight_block_size"),
    ],
)
def test_scale_layout_errors(kwargs, fragment):
    with pytest.raises(ValueError, match=fragment):
        FP8Config(**kwargs)


def test_lm_head_must_be_bool(production_checks):
    assert FP8Config(lm_head=True).lm_head is True
    with pytest.raises(TypeError, match="lm_head"):
        FP8Config(lm_head="yes")


def test_meta_is_frozen_json():
    cfg = FP8Config(meta={"quantizer": ["floatxq:0.1"], "n": {"a": 1}})
    with pytest.raises(TypeError):
        cfg.meta["x"] = 1
    assert cfg.meta == {"quantizer": ("floatxq:0.1",), "n": {"a": 1}}
    assert hash(cfg) == hash(FP8Config(meta={"n": {"a": 1}, "quantizer": ("floatxq:0.1",)}))
    assert FP8Config(meta={}) == FP8Config()


def test_meta_errors(production_checks):
    with pytest.raises(TypeError, match="meta"):
        FP8Config(meta=[("a", 1)])
    with pytest.raises(TypeError, match="meta"):
        FP8Config(meta={1: "a"})
    with pytest.raises(TypeError, match=r"meta\['x'\].*object"):
        FP8Config(meta={"x": object()})


def test_production_errors_without_the_annotation_check(production_checks):
    with pytest.raises(TypeError, match=r"meta: expected a mapping.*list"):
        FP8Config(meta=[("a", 1)])
    with pytest.raises(TypeError, match=r"meta: mapping keys must be strings, got int 1"):
        FP8Config(meta={1: "a"})
    with pytest.raises(TypeError, match=r"lm_head: expected a bool, got str 'yes'"):
        FP8Config(lm_head="yes")
    with pytest.raises(TypeError, match=r"dynamic\['\.\*q'\]: expected a mapping.*list"):
        FP8Config(dynamic={".*q": ["format", "e5m2"]})
    with pytest.raises(TypeError, match=r"dynamic: rule keys must be strings.*int 3"):
        FP8Config(dynamic={3: {}})
    with pytest.raises(TypeError, match=r"dynamic\['a'\]: override names must be strings"):
        FP8Config(dynamic={"a": {1: 2}})
    with pytest.raises(TypeError, match=r"dynamic: expected a mapping.*list"):
        FP8Config(dynamic=[("a", {})])
    with pytest.raises(TypeError, match=r"payload: expected a mapping, got list"):
        fp8_config_from_payload([("bits", 8)])
    with pytest.raises(TypeError, match=r"module_name: expected a str, got int 3"):
        FP8Config().resolve(3)


def test_config_is_frozen():
    cfg = FP8Config()
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.format = "float8_e5m2"


def test_replace_normalizes_like_the_constructor():
    cfg = FP8Config(weight_block_size=[32, 32])
    again = dataclasses.replace(
        cfg, format="E5M2", weight_scale_method=None, weight_block_size=None
    )
    assert again == FP8Config(format="float8_e5m2")
    assert dataclasses.replace(cfg) == cfg
    with pytest.raises(ValueError, match="needs weight_block_size"):
        dataclasses.replace(cfg, weight_block_size=None)


# --------------------------------------------------------------------------------------------
# FP8 payloads (floatxq.interop.payload)
# --------------------------------------------------------------------------------------------


def test_payload_of_a_row_config_exact():
    assert fp8_config_to_payload(FP8Config(format="e5m2")) == {
        "bits": 8,
        "group_size": -1,
        "desc_act": False,
        "lm_head": False,
        "method": "fp8",
        "quant_method": "fp8",
        "format": "float8_e5m2",
        "checkpoint_format": "float8_e5m2",
        "pack_dtype": "int32",
        "weight_scale_method": "row",
        "weight_scale_semantics": "inverse",
        "sym": True,
    }


def test_payload_of_a_block_config():
    payload = fp8_config_to_payload(FP8Config(weight_block_size=(128, 64), lm_head=True))
    assert set(payload) == FP8_PAYLOAD_KEYS | {"weight_block_size"}
    assert payload["weight_block_size"] == [128, 64]
    assert type(payload["weight_block_size"]) is list
    assert payload["weight_scale_method"] == "block"
    assert payload["lm_head"] is True


def test_payload_with_dynamic_and_meta():
    cfg = FP8Config(
        dynamic={
            r".*down_proj": {"format": "E5M2", "weight_block_size": (64, 64)},
            "-:lm_head": None,
            r".*q_proj": {"weight_scale_method": "tensor"},
        },
        meta={"damp": [0.1, 0.2]},
    )
    payload = fp8_config_to_payload(cfg)
    assert set(payload) == FP8_PAYLOAD_KEYS | {"dynamic", "meta"}
    assert payload["meta"] == {"damp": [0.1, 0.2]}
    assert list(payload["dynamic"].items()) == [
        ("-:lm_head", {}),
        (
            ".*down_proj",
            {
                "format": "float8_e5m2",
                "weight_scale_method": "block",
                "weight_block_size": [64, 64],
            },
        ),
        (".*q_proj", {"weight_scale_method": "tensor"}),
    ]
    assert json.loads(json.dumps(payload)) == payload


def test_payload_values_are_plain_types():
    payload = fp8_config_to_payload(FP8Config(dynamic={"x": {"format": FORMAT.FP8}}))
    assert type(payload["method"]) is str
    assert type(payload["quant_method"]) is str
    assert type(payload["dynamic"]["x"]["format"]) is str


def test_round_trip_examples():
    configs = [
        FP8Config(),
        FP8Config(format="e5m2fnuz", weight_scale_method="tensor", lm_head=True),
        FP8Config(weight_block_size=[32, 16], dynamic={"-:a": {}, "b": {"format": "e5m2"}}),
        FP8Config(meta={"k": [1, 2.5, None, True]}, dynamic={"c": {"weight_scale_method": "row"}}),
    ]
    for cfg in configs:
        payload = fp8_config_to_payload(cfg)
        assert fp8_config_from_payload(payload) == cfg
        assert fp8_config_from_payload(json.loads(json.dumps(payload))) == cfg
        assert fp8_config_to_payload(fp8_config_from_payload(payload)) == payload


def test_reading_legacy_fmt_and_weight_only():
    cfg = fp8_config_from_payload({"fmt": "e5m2", "weight_only": {}, "weight_block_size": [8, 8]})
    assert cfg.format == "float8_e5m2"
    assert (cfg.weight_scale_method, cfg.weight_block_size) == ("block", (8, 8))
    assert fp8_config_from_payload({"fmt": "e5m2", "format": "e4m3"}).format == "float8_e4m3fn"
    assert fp8_config_from_payload({"weight_only": True}) == FP8Config()
    rules = fp8_config_from_payload({"dynamic": {"a": {"fmt": " E5M2 ", "bits": 8}}}).dynamic
    assert rules.rules[0].overrides == {"format": "float8_e5m2"}


@pytest.mark.parametrize(
    "payload",
    [
        {"smoother": {"alpha": 0.5}},
        {"smoother": "smoothquant"},
        {"smooth": "sq"},
        {"weight_only": {"smoother": {"alpha": 0.3}}},
        {"weight_only": {"smooth": "x"}},
    ],
)
def test_reading_a_smoother_says_it_is_not_available_yet(payload):
    with pytest.raises(ValueError, match=r"smooth.*FP8 smoother is not available yet in floatxq"):
        fp8_config_from_payload(payload)
    with pytest.raises(ValueError, match=r"preprocessors: weight preprocessing is not available"):
        fp8_config_from_payload({"preprocessors": [{"name": "smoothquant"}]})


def test_reading_empty_unavailable_settings_is_fine():
    assert fp8_config_from_payload({"smoother": None, "smooth": {}}) == FP8Config()
    assert fp8_config_from_payload({"weight_only": {"smoother": None}}) == FP8Config()
    assert fp8_config_from_payload({"preprocessors": [], "smoother": ""}) == FP8Config()


def test_reading_checkpoint_format():
    assert fp8_config_from_payload({"checkpoint_format": "e5m2"}).format == "float8_e5m2"
    both = {"format": "e5m2", "checkpoint_format": "float8_e5m2"}
    assert fp8_config_from_payload(both).format == "float8_e5m2"
    with pytest.raises(ValueError, match=r"checkpoint_format.*float8_e4m3fn.*'float8_e5m2'"):
        fp8_config_from_payload({"format": "float8_e4m3fn", "checkpoint_format": "float8_e5m2"})
    with pytest.raises(ValueError, match="checkpoint_format"):
        fp8_config_from_payload({"format": "e4m3", "checkpoint_format": "gptq"})


@pytest.mark.parametrize(
    ("payload", "fragment"),
    [
        ({"quant_method": "gptq"}, r"quant_method.*'fp8'.*'gptq'"),
        ({"method": "gptq"}, r"method.*'fp8'.*'gptq'"),
        ({"pack_dtype": "int16"}, r"pack_dtype.*'int16'"),
        ({"bits": 4}, r"bits: FP8 weights are 8-bit; got 4"),
        ({"bits": True}, r"bits: .*got True"),
        ({"group_size": 128}, r"group_size: FP8 weights are not grouped; got 128"),
        ({"desc_act": True}, r"desc_act: .*got True"),
        ({"sym": False}, r"sym: FP8 weights are symmetric; got False"),
        ({"weight_scale_semantics": "direct"}, r"weight_scale_semantics.*'direct'"),
        ({"format": "nvfp4"}, r"format.*'nvfp4'"),
        ({"format": "e8m0"}, "decode-only"),
        ({"weight_only": "yes"}, "weight_only"),
        ({"dynamic": {"a": {"bits": 4}}}, r"dynamic\['a'\]\.bits: FP8 weights are 8-bit"),
        ({"dynamic": {"a": {"group_size": 64}}}, r"dynamic\['a'\]\.group_size"),
        ({"dynamic": {"a": {"weight_scale_semantics": "x"}}}, r"dynamic\['a'\]\.weight_scale_sem"),
        ({"dynamic": {"a": {"damp_percent": 0.1}}}, r"dynamic\['a'\]: unsupported FP8 override"),
    ],
)
def test_reading_bad_values(payload, fragment):
    with pytest.raises(ValueError, match=fragment):
        fp8_config_from_payload(payload)


def test_reading_carried_fields_with_their_one_value():
    carried = {"bits": 8, "group_size": -1, "desc_act": False, "sym": True}
    assert fp8_config_from_payload(carried) == FP8Config()
    nones = dict.fromkeys([*carried, "weight_scale_semantics", "group_size"])
    assert fp8_config_from_payload(nones) == FP8Config()
    assert fp8_config_from_payload({"weight_scale_semantics": " Inverse "}) == FP8Config()


def test_reading_rejects_unknown_fields():
    with pytest.raises(ValueError, match=r"unsupported field\(s\) 'bogus', 'damp_percent'"):
        fp8_config_from_payload({"bogus": 1, "damp_percent": 0.01, "bits": 8})


def test_reading_does_not_modify_the_payload():
    payload = {"fmt": "e5m2", "weight_only": {"x": 1}, "dynamic": {"a": {"fmt": "e4m3"}}}
    snapshot = json.dumps(payload)
    fp8_config_from_payload(payload)
    assert json.dumps(payload) == snapshot


def test_payload_method_and_format():
    assert payload_method({"quant_method": " FP8 ", "method": "gptq"}) == "fp8"
    assert payload_method({"method": "gptq"}) == "gptq"
    assert payload_method({}) is None
    assert payload_format({"checkpoint_format": "gptq_v2"}) == "gptq_v2"
    assert payload_format({"fmt": "e5m2", "checkpoint_format": "x"}) == "e5m2"
    assert payload_format({}) is None


# --------------------------------------------------------------------------------------------
# Dynamic rules
# --------------------------------------------------------------------------------------------

_RULES = {
    r".*\.mlp\.down_proj": {"format": "e5m2"},
    r"+:.*self_attn\.q_proj": {"weight_scale_method": "tensor"},
    r"-:model\.layers\.1\.": {},
    r".*proj": {"weight_block_size": [64, 64]},
    r"model\.layers\.0\.mlp\.up": {"format": "e4m3fnuz"},
}
_BASE = FP8Config(format="e4m3", weight_scale_method="block", weight_block_size=[128, 128])


@pytest.mark.parametrize(
    ("module", "expected"),
    [
        # First matching rule wins: the down_proj rule, not the later ".*proj" one.
        ("model.layers.0.mlp.down_proj", ("float8_e5m2", "block", (128, 128))),
        # A method-only override drops the base block size instead of leaking it.
        ("model.layers.0.self_attn.q_proj", ("float8_e4m3fn", "tensor", None)),
        # The -: rule was written third but is tried first.
        ("model.layers.1.mlp.down_proj", None),
        ("model.layers.1.self_attn.q_proj", None),
        # r"model\.layers\.1\." needs the dot: layer 10 is not excluded.
        ("model.layers.10.self_attn.k_proj", ("float8_e4m3fn", "block", (64, 64))),
        # A block-only override re-resolves the method to block.
        ("model.layers.0.self_attn.o_proj", ("float8_e4m3fn", "block", (64, 64))),
        # ".*proj" is tried before the up_proj rule (insertion order among + rules).
        ("model.layers.0.mlp.up_proj", ("float8_e4m3fn", "block", (64, 64))),
        # No rule matches: the base settings.
        ("lm_head", ("float8_e4m3fn", "block", (128, 128))),
        ("model.embed_tokens", ("float8_e4m3fn", "block", (128, 128))),
    ],
)
def test_resolution_table(module, expected):
    cfg = dataclasses.replace(_BASE, dynamic=_RULES, meta={"m": 1})
    resolved = cfg.resolve(module)
    if expected is None:
        assert resolved is None
        return
    assert (resolved.format, resolved.weight_scale_method, resolved.weight_block_size) == expected
    assert resolved.dynamic is None
    assert resolved.meta == {"m": 1}
    assert resolved.resolve(module) == resolved
    assert_fields_match_annotations(resolved)


def test_rules_are_stored_excludes_first():
    cfg = FP8Config(dynamic=_RULES)
    assert [rule.key for rule in cfg.dynamic] == [
        r"-:model\.layers\.1\.",
        r".*\.mlp\.down_proj",
        r"+:.*self_attn\.q_proj",
        r".*proj",
        r"model\.layers\.0\.mlp\.up",
    ]


def test_match_is_anchored_at_the_start_only():
    rules = DynamicRules.from_mapping({"proj": {}, "+:.*proj": {"x": 1}})
    assert rules.match("model.layers.0.q_proj").key == "+:.*proj"
    assert DynamicRules.from_mapping({"proj": {}}).match("model.layers.0.q_proj") is None
    # re.match, not fullmatch: a prefix match is enough.
    assert DynamicRules.from_mapping({"model": {}}).match("model.layers.0.q_proj").key == "model"


def test_bare_regex_is_a_plus_rule():
    bare = DynamicRule(key=r".*q_proj", overrides={"format": "e5m2"})
    plus = DynamicRule(key=r"+:.*q_proj", overrides={"format": "e5m2"})
    minus = DynamicRule(key=r"-:.*q_proj", overrides={"format": "e5m2"})
    assert (bare.pattern, bare.exclude) == (r".*q_proj", False)
    assert (plus.pattern, plus.exclude) == (r".*q_proj", False)
    assert (minus.pattern, minus.exclude, minus.overrides) == (r".*q_proj", True, {})
    a = FP8Config(dynamic={r".*q_proj": {"format": "e5m2"}}).resolve("x.q_proj")
    b = FP8Config(dynamic={r"+:.*q_proj": {"format": "e5m2"}}).resolve("x.q_proj")
    assert a == b
    assert a.format == "float8_e5m2"


def test_overrides_for():
    rules = DynamicRules.from_mapping({"a": {"k": 1}, "-:b": {}})
    assert rules.overrides_for("abc") == {"k": 1}
    assert rules.overrides_for("bcd") is None
    assert rules.overrides_for("cde") == {}
    assert len(rules) == 2
    assert [rule.key for rule in rules] == ["-:b", "a"]


def test_exclude_rule_values_are_ignored():
    cfg = FP8Config(dynamic={"-:lm_head": {"bits": 4}, "-:x": None})
    assert [(rule.key, rule.overrides) for rule in cfg.dynamic] == [("-:lm_head", {}), ("-:x", {})]
    assert fp8_config_to_payload(cfg)["dynamic"] == {"-:lm_head": {}, "-:x": {}}


def test_rule_normalization_stored():
    cfg = FP8Config(
        dynamic={
            "a": {"format": " E5M2 "},
            "b": {"weight_block_size": (32, 32)},
            "c": {"weight_scale_method": "ROW"},
        }
    )
    assert {rule.key: dict(rule.overrides) for rule in cfg.dynamic} == {
        "a": {"format": "float8_e5m2"},
        "b": {"weight_scale_method": "block", "weight_block_size": (32, 32)},
        "c": {"weight_scale_method": "row", "weight_block_size": None},
    }


@pytest.mark.parametrize(
    ("rule", "error", "fragment"),
    [
        ({"bits": 8}, ValueError, r"dynamic\['\.\*q'\]: unsupported FP8 override.*\['bits'\]"),
        ({"fmt": "e5m2"}, ValueError, r"dynamic\['\.\*q'\].*\['fmt'\]"),
        ({"formt": "e5m2"}, ValueError, r"dynamic\['\.\*q'\].*\['formt'\]"),
        ({"format": "e8m0"}, ValueError, r"dynamic\['\.\*q'\]\.format.*decode-only"),
        ({"format": "int4"}, ValueError, r"dynamic\['\.\*q'\]\.format"),
        ({"weight_scale_method": "block"}, ValueError, r"dynamic\['\.\*q'\].*needs"),
        (
            {"weight_scale_method": "row", "weight_block_size": [8, 8]},
            ValueError,
            r"dynamic\['\.\*q'\].*only valid",
        ),
        (["format", "e5m2"], TypeError, "dynamic"),
    ],
)
def test_rule_errors_name_the_rule(rule, error, fragment, production_checks):
    with pytest.raises(error, match=fragment):
        FP8Config(dynamic={".*q": rule})


def test_invalid_regex_names_the_key():
    with pytest.raises(ValueError, match=r"'\+:model\.\(layers' is not a valid regular"):
        FP8Config(dynamic={"+:model.(layers": {}})
    with pytest.raises(ValueError, match=r"'-:\['"):
        FP8Config(dynamic={"-:[": {}})


def test_rule_key_and_dynamic_kind_errors(production_checks):
    with pytest.raises(TypeError, match="dynamic"):
        DynamicRules.from_mapping({3: {}})
    with pytest.raises(TypeError, match="dynamic"):
        FP8Config(dynamic=[("a", {})])


def test_dynamic_rules_instance_is_accepted_and_normalized_again():
    rules = DynamicRules.from_mapping({"a": {"format": "e5m2"}})
    assert FP8Config(dynamic=rules) == FP8Config(dynamic={"a": {"format": "float8_e5m2"}})
    with pytest.raises(ValueError, match="unsupported FP8 override"):
        FP8Config(dynamic=DynamicRules.from_mapping({"a": {"damp": 0.1}}))


def test_empty_dynamic_is_none():
    assert FP8Config(dynamic={}).dynamic is None
    assert FP8Config(dynamic=DynamicRules()) == FP8Config()


def test_config_with_dynamic_is_hashable():
    a = FP8Config(dynamic={"a": {"weight_block_size": [8, 8]}, "-:b": {}})
    b = FP8Config(dynamic={"-:b": {}, "a": {"weight_block_size": (8, 8)}})
    assert a == b
    assert hash(a) == hash(b)
    assert len({a, b, FP8Config()}) == 2


def test_duplicate_rule_keys_rejected():
    rule = DynamicRule(key="a", overrides={})
    with pytest.raises(ValueError, match="duplicate"):
        DynamicRules(rules=(rule, rule))


def test_rule_records_do_not_rewrite_their_fields():
    rule = DynamicRule(key="-:x", overrides={"a": [1]})
    assert dataclasses.replace(rule, key="+:x").overrides == {}
    with pytest.raises(ValueError, match="init=False"):
        dataclasses.replace(rule, pattern="y")
    ordered = DynamicRules(rules=(DynamicRule(key="a", overrides={}), rule))
    assert [r.key for r in ordered] == ["-:x", "a"]


def test_resolve_without_rules_drops_nothing_else():
    cfg = FP8Config(format="e5m2", weight_scale_method="tensor", lm_head=True, meta={"s": 1})
    assert cfg.resolve("anything") == cfg
