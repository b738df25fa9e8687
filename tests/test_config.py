"""Example-based tests for floatxq.config: enums, FP8Config validation, payloads, dynamic rules."""

import dataclasses
import json
import warnings

import jaxtyping
import pytest
import torch

from floatxq.config import BACKEND, FORMAT, METHOD, DynamicRule, DynamicRules, FP8Config


@pytest.fixture
def unchecked():
    """Switch the test-time annotation check off, to see the errors users get in production."""
    before = jaxtyping.config.jaxtyping_disable
    jaxtyping.config.update("jaxtyping_disable", True)
    yield
    jaxtyping.config.update("jaxtyping_disable", before)


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
        (BACKEND.GPTQ_TORCH, "gptq_torch"),
        (BACKEND.GPTQ_W4AFP8, "gptq_w4afp8"),
        (BACKEND.GPTQ_W4A_NVFP4, "gptq_w4a_nvfp4"),
        (BACKEND.MLX, "mlx"),
    ],
)
def test_enum_members_are_their_string_values(member, value):
    assert isinstance(member, str)
    assert member == value
    assert str(member) == value
    assert f"{member}" == value
    assert json.dumps(member) == json.dumps(value)
    assert type(member)(value) is member


def test_enum_member_sets_are_exactly_the_spec():
    assert [m.value for m in METHOD] == ["fp8", "gptq"]
    assert [m.value for m in FORMAT] == ["fp8", "gptq", "gptq_v2"]
    assert [m.value for m in BACKEND] == [
        "auto",
        "fp8_torch",
        "gptq_torch",
        "gptq_w4afp8",
        "gptq_w4a_nvfp4",
        "mlx",
    ]


# --------------------------------------------------------------------------------------------
# FP8Config: defaults and normalization
# --------------------------------------------------------------------------------------------


def test_defaults():
    cfg = FP8Config()
    assert cfg.bits == 8
    assert cfg.method is METHOD.FP8
    assert cfg.format == "float8_e4m3fn"
    assert (cfg.group_size, cfg.desc_act, cfg.sym) == (-1, False, True)
    assert cfg.weight_scale_method == "row"
    assert cfg.weight_block_size is None
    assert cfg.weight_scale_semantics == "inverse"
    assert cfg.lm_head is False
    assert cfg.dynamic is None and cfg.meta is None and cfg.smoother is None
    assert cfg.uses_weight_only_lifecycle() is True
    assert cfg == FP8Config()
    assert hash(cfg) == hash(FP8Config())


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


def test_format_of_wrong_kind():
    with pytest.raises(TypeError, match="format"):
        FP8Config(format=8)


def test_bits_must_be_8():
    with pytest.raises(ValueError, match=r"bits.*4.*accepted: 8"):
        FP8Config(bits=4)
    with pytest.raises(TypeError, match="bits"):
        FP8Config(bits="8")
    with pytest.raises(TypeError, match="bits"):
        FP8Config(bits=True)


def test_method():
    assert FP8Config(method="fp8").method is METHOD.FP8
    assert FP8Config(method=" FP8 ").method is METHOD.FP8
    with pytest.raises(ValueError, match=r"method.*'gptq'"):
        FP8Config(method="gptq")
    with pytest.raises(ValueError, match="method"):
        FP8Config(method=METHOD.GPTQ)
    with pytest.raises(TypeError, match="method"):
        FP8Config(method=1)


@pytest.mark.parametrize(
    ("name", "given", "forced"),
    [("group_size", 128, -1), ("desc_act", True, False), ("sym", False, True)],
)
def test_forced_fields_warn_and_are_overridden(name, given, forced):
    with pytest.warns(UserWarning, match=f"{name}={given!r} is ignored"):
        cfg = FP8Config(**{name: given})
    assert getattr(cfg, name) == forced
    assert cfg == FP8Config()


@pytest.mark.parametrize(
    ("name", "given"), [("group_size", None), ("desc_act", None), ("sym", None)]
)
def test_forced_fields_accept_none_silently(name, given):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cfg = FP8Config(**{name: given})
    assert cfg == FP8Config()


def test_forced_fields_of_wrong_kind():
    with pytest.raises(TypeError, match="group_size"):
        FP8Config(group_size="128")
    with pytest.raises(TypeError, match="sym"):
        FP8Config(sym=1)


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
        ({"weight_scale_semantics": "direct"}, r"weight_scale_semantics.*'direct'"),
    ],
)
def test_scale_layout_errors(kwargs, fragment):
    with pytest.raises(ValueError, match=fragment):
        FP8Config(**kwargs)


def test_scale_semantics_normalized():
    assert FP8Config(weight_scale_semantics=" Inverse ").weight_scale_semantics == "inverse"
    assert FP8Config(weight_scale_semantics=None).weight_scale_semantics == "inverse"


def test_lm_head_must_be_bool():
    assert FP8Config(lm_head=True).lm_head is True
    with pytest.raises(TypeError, match="lm_head"):
        FP8Config(lm_head="yes")


def test_meta_and_smoother_are_frozen_json():
    cfg = FP8Config(meta={"quantizer": ["floatxq:0.1"], "n": {"a": 1}}, smoother={"alpha": 0.5})
    with pytest.raises(TypeError):
        cfg.meta["x"] = 1
    assert cfg.meta == {"quantizer": ("floatxq:0.1",), "n": {"a": 1}}
    assert hash(cfg) == hash(
        FP8Config(meta={"n": {"a": 1}, "quantizer": ("floatxq:0.1",)}, smoother={"alpha": 0.5})
    )
    assert FP8Config(meta={}) == FP8Config()
    assert FP8Config(smoother={}) == FP8Config()
    assert FP8Config(smoother="smoothquant").smoother == "smoothquant"


def test_meta_and_smoother_errors():
    with pytest.raises(TypeError, match="meta"):
        FP8Config(meta=[("a", 1)])
    with pytest.raises(TypeError, match="meta"):
        FP8Config(meta={1: "a"})
    with pytest.raises(TypeError, match=r"meta\['x'\].*object"):
        FP8Config(meta={"x": object()})
    with pytest.raises(TypeError, match="smoother"):
        FP8Config(smoother=object())


def test_production_errors_without_the_annotation_check(unchecked):
    with pytest.raises(TypeError, match=r"meta: expected a mapping.*list"):
        FP8Config(meta=[("a", 1)])
    with pytest.raises(TypeError, match=r"meta: mapping keys must be strings, got int 1"):
        FP8Config(meta={1: "a"})
    with pytest.raises(TypeError, match=r"bits: expected the int 8, got str '8'"):
        FP8Config(bits="8")
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
        FP8Config.from_dict([("bits", 8)])
    with pytest.raises(TypeError, match=r"module_name: expected a str, got int 3"):
        FP8Config().resolve(3)


def test_config_is_frozen():
    cfg = FP8Config()
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.bits = 8


# --------------------------------------------------------------------------------------------
# to_dict / from_dict
# --------------------------------------------------------------------------------------------

_ALWAYS = {
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


def test_to_dict_row_config_exact():
    assert FP8Config(format="e5m2").to_dict() == {
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


def test_to_dict_block_config():
    payload = FP8Config(weight_block_size=(128, 64), lm_head=True).to_dict()
    assert set(payload) == _ALWAYS | {"weight_block_size"}
    assert payload["weight_block_size"] == [128, 64]
    assert type(payload["weight_block_size"]) is list
    assert payload["weight_scale_method"] == "block"
    assert payload["lm_head"] is True


def test_to_dict_with_dynamic_meta_smoother():
    cfg = FP8Config(
        dynamic={r".*down_proj": {"fmt": "E5M2", "weight_block_size": (64, 64)}, "-:lm_head": None},
        meta={"damp": [0.1, 0.2]},
        smoother={"alpha": 0.5},
    )
    payload = cfg.to_dict()
    assert set(payload) == _ALWAYS | {"dynamic", "meta", "smoother"}
    assert payload["meta"] == {"damp": [0.1, 0.2]}
    assert payload["smoother"] == {"alpha": 0.5}
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
    ]
    assert json.loads(json.dumps(payload)) == payload


def test_to_dict_values_are_plain_types():
    payload = FP8Config(dynamic={"x": {"format": FORMAT.FP8}}).to_dict()
    assert type(payload["method"]) is str
    assert type(payload["quant_method"]) is str
    assert type(payload["dynamic"]["x"]["format"]) is str


def test_round_trip_examples():
    configs = [
        FP8Config(),
        FP8Config(format="e5m2fnuz", weight_scale_method="tensor", lm_head=True),
        FP8Config(weight_block_size=[32, 16], dynamic={"-:a": {}, "b": {"bits": 8}}),
        FP8Config(meta={"k": [1, 2.5, None, True]}, smoother=["x", 1]),
    ]
    for cfg in configs:
        payload = cfg.to_dict()
        assert FP8Config.from_dict(payload) == cfg
        assert FP8Config.from_dict(json.loads(json.dumps(payload))) == cfg
        assert FP8Config.from_dict(payload).to_dict() == payload


def test_from_dict_legacy_fmt_and_weight_only():
    cfg = FP8Config.from_dict(
        {"fmt": "e5m2", "weight_only": {"smoother": {"alpha": 0.3}}, "weight_block_size": [8, 8]}
    )
    assert cfg.format == "float8_e5m2"
    assert cfg.smoother == {"alpha": 0.3}
    assert (cfg.weight_scale_method, cfg.weight_block_size) == ("block", (8, 8))
    assert FP8Config.from_dict({"fmt": "e5m2", "format": "e4m3"}).format == "float8_e4m3fn"
    assert FP8Config.from_dict({"weight_only": True}) == FP8Config()
    assert FP8Config.from_dict({"smooth": "sq"}).smoother == "sq"


def test_from_dict_checkpoint_format():
    assert FP8Config.from_dict({"checkpoint_format": "e5m2"}).format == "float8_e5m2"
    assert FP8Config.from_dict({"format": "e5m2", "checkpoint_format": "float8_e5m2"}).format == (
        "float8_e5m2"
    )
    with pytest.raises(ValueError, match=r"checkpoint_format.*float8_e4m3fn.*'float8_e5m2'"):
        FP8Config.from_dict({"format": "float8_e4m3fn", "checkpoint_format": "float8_e5m2"})
    with pytest.raises(ValueError, match="checkpoint_format"):
        FP8Config.from_dict({"format": "e4m3", "checkpoint_format": "gptq"})


@pytest.mark.parametrize(
    ("payload", "fragment"),
    [
        ({"quant_method": "gptq"}, r"quant_method.*'gptq'"),
        ({"method": "gptq"}, r"method.*'gptq'"),
        ({"pack_dtype": "int16"}, r"pack_dtype.*'int16'"),
        ({"bits": 4}, r"bits.*4"),
        ({"format": "nvfp4"}, r"format.*'nvfp4'"),
        ({"format": "e8m0"}, "decode-only"),
        ({"smoother": "a", "smooth": "b"}, "smooth"),
    ],
)
def test_from_dict_bad_values(payload, fragment):
    with pytest.raises(ValueError, match=fragment):
        FP8Config.from_dict(payload)


def test_from_dict_rejects_unknown_fields():
    with pytest.raises(ValueError, match=r"unsupported field\(s\) 'bogus', 'damp_percent'"):
        FP8Config.from_dict({"bogus": 1, "damp_percent": 0.01, "bits": 8})


def test_from_dict_needs_a_mapping():
    with pytest.raises(TypeError, match="payload"):
        FP8Config.from_dict([("bits", 8)])


def test_from_dict_does_not_modify_payload():
    payload = {"fmt": "e5m2", "weight_only": {"smooth": "x"}, "dynamic": {"a": {"fmt": "e4m3"}}}
    snapshot = json.dumps(payload)
    FP8Config.from_dict(payload)
    assert json.dumps(payload) == snapshot


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


def test_rules_are_stored_excludes_first():
    cfg = FP8Config(dynamic=_RULES)
    assert list(cfg.to_dict()["dynamic"]) == [
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
    minus = DynamicRule(key=r"-:.*q_proj", overrides={})
    assert (bare.pattern, bare.exclude) == (r".*q_proj", False)
    assert (plus.pattern, plus.exclude) == (r".*q_proj", False)
    assert (minus.pattern, minus.exclude) == (r".*q_proj", True)
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
    assert cfg.to_dict()["dynamic"] == {"-:lm_head": {}, "-:x": {}}


def test_rule_normalization_stored():
    cfg = FP8Config(
        dynamic={
            "a": {"fmt": " E5M2 ", "bits": 8, "group_size": None},
            "b": {"weight_block_size": (32, 32)},
            "c": {"weight_scale_method": "ROW", "weight_scale_semantics": "INVERSE"},
            "d": {"group_size": -1},
        }
    )
    assert cfg.to_dict()["dynamic"] == {
        "a": {"bits": 8, "group_size": None, "format": "float8_e5m2"},
        "b": {"weight_scale_method": "block", "weight_block_size": [32, 32]},
        "c": {"weight_scale_method": "row", "weight_scale_semantics": "inverse"},
        "d": {"group_size": -1},
    }


@pytest.mark.parametrize(
    ("rule", "error", "fragment"),
    [
        ({"bits": 4}, ValueError, r"dynamic\['\.\*q'\]\.bits.*4"),
        ({"group_size": 128}, ValueError, r"dynamic\['\.\*q'\]\.group_size.*128"),
        ({"formt": "e5m2"}, ValueError, r"dynamic\['\.\*q'\].*\['formt'\]"),
        ({"format": "e8m0"}, ValueError, r"dynamic\['\.\*q'\]\.format.*decode-only"),
        ({"format": "int4"}, ValueError, r"dynamic\['\.\*q'\]\.format"),
        ({"weight_scale_method": "block"}, ValueError, r"dynamic\['\.\*q'\].*needs"),
        (
            {"weight_scale_method": "row", "weight_block_size": [8, 8]},
            ValueError,
            r"dynamic\['\.\*q'\].*only valid",
        ),
        ({"weight_scale_semantics": "direct"}, ValueError, r"dynamic\['\.\*q'\].*'direct'"),
        (["format", "e5m2"], TypeError, "dynamic"),
    ],
)
def test_rule_errors_name_the_rule(rule, error, fragment):
    with pytest.raises(error, match=fragment):
        FP8Config(dynamic={".*q": rule})


def test_invalid_regex_names_the_key():
    with pytest.raises(ValueError, match=r"'\+:model\.\(layers' is not a valid regular"):
        FP8Config(dynamic={"+:model.(layers": {}})
    with pytest.raises(ValueError, match=r"'-:\['"):
        FP8Config(dynamic={"-:[": {}})


def test_rule_key_and_dynamic_kind_errors():
    with pytest.raises(TypeError, match="dynamic"):
        DynamicRules.from_mapping({3: {}})
    with pytest.raises(TypeError, match="dynamic"):
        FP8Config(dynamic=[("a", {})])


def test_dynamic_rules_instance_is_accepted_and_renormalized():
    rules = DynamicRules.from_mapping({"a": {"fmt": "e5m2"}})
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


def test_resolve_without_rules_drops_nothing_else():
    cfg = FP8Config(format="e5m2", weight_scale_method="tensor", lm_head=True, smoother="s")
    assert cfg.resolve("anything") == cfg
    with pytest.raises(TypeError, match="module_name"):
        cfg.resolve(3)
