"""GPTQConfig: validation, defaults, rules, GPT-QModel payloads and the solver's options."""

import dataclasses
import json
import warnings

import pytest

from floatxq.config import FORMAT, METHOD, GPTQConfig
from floatxq.gptq.solve import GPTQSolveOptions
from floatxq.interop.payload import gptq_config_from_payload, gptq_config_to_payload
from floatxq.lifecycle.gptq import gptq_solve_options
from floatxq.testing import assert_fields_match_annotations

DEFAULT_PAYLOAD = {
    "bits": 4,
    "group_size": 128,
    "desc_act": False,
    "sym": True,
    "lm_head": False,
    "method": "gptq",
    "quant_method": "gptq",
    "format": "gptq",
    "checkpoint_format": "gptq",
    "pack_dtype": "int32",
    "meta": {
        "damp_percent": 0.05,
        "damp_auto_increment": 0.01,
        "static_groups": False,
        "act_group_aware": True,
        "mse": 0.0,
    },
}


def test_defaults_are_gptqmodels():
    cfg = GPTQConfig()
    assert (cfg.bits, cfg.group_size, cfg.sym, cfg.desc_act) == (4, 128, True, False)
    assert (cfg.static_groups, cfg.act_group_aware, cfg.mse, cfg.lm_head) == (
        False,
        True,
        0.0,
        False,
    )
    assert (cfg.damp_percent, cfg.damp_auto_increment) == (0.05, 0.01)
    assert cfg.format == FORMAT.GPTQ and GPTQConfig.method is METHOD.GPTQ
    assert cfg.dynamic is None and cfg.meta is None


@pytest.mark.parametrize("name", ["rotation", "method"])
def test_features_without_an_implementation_are_not_fields(name):
    assert name not in {field.name for field in dataclasses.fields(GPTQConfig)}
    with pytest.raises(TypeError, match=name):
        GPTQConfig(**{name: None})


@pytest.mark.parametrize(
    "cfg",
    [
        GPTQConfig(),
        GPTQConfig(damp_percent=1 / 8, damp_auto_increment=0, mse=2, desc_act=None),
        GPTQConfig(format=FORMAT.GPTQ_V2, meta={"q": ["x"]}, dynamic={"a": {"bits": 8}}),
    ],
)
def test_every_field_annotation_is_true(cfg):
    assert_fields_match_annotations(cfg)
    assert type(cfg.format) is str and type(cfg.damp_auto_increment) is float


def test_default_payload_by_hand():
    assert gptq_config_to_payload(GPTQConfig()) == DEFAULT_PAYLOAD


def test_frozen_and_hashable():
    cfg = GPTQConfig(dynamic={r".*mlp": {"bits": 8}}, meta={"note": [1, 2]})
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.bits = 8  # type: ignore[misc]
    assert hash(cfg) == hash(GPTQConfig(dynamic={r".*mlp": {"bits": 8}}, meta={"note": [1, 2]}))


def test_desc_act_turns_group_aware_reordering_off_with_a_warning():
    with pytest.warns(UserWarning, match="desc_act=True turns act_group_aware off"):
        cfg = GPTQConfig(desc_act=True)
    assert cfg.act_group_aware is False
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert GPTQConfig(desc_act=True, act_group_aware=False).act_group_aware is False
        assert GPTQConfig(desc_act=None).desc_act is False
        assert dataclasses.replace(GPTQConfig(desc_act=True, act_group_aware=False), bits=3)


def test_desc_act_and_group_aware_both_set_is_an_error():
    with pytest.raises(ValueError, match="act_group_aware=True requires desc_act=False"):
        GPTQConfig(desc_act=True, act_group_aware=True)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"bits": 7}, ValueError, r"bits: got 7, accepted: \[2, 3, 4, 5, 6, 8\]"),
        ({"bits": 1}, ValueError, "bits: got 1"),
        ({"bits": 16}, ValueError, "bits: got 16"),
        ({"bits": True}, TypeError, "bits: expected an int"),
        ({"bits": "4"}, TypeError, "bits: expected an int"),
        ({"group_size": 0}, ValueError, "group_size: got 0"),
        ({"group_size": -2}, ValueError, "group_size: got -2"),
        ({"group_size": 128.0}, TypeError, "group_size: expected an int"),
        ({"damp_percent": 0}, ValueError, "0 < damp_percent < 1"),
        ({"damp_percent": 1.0}, ValueError, "0 < damp_percent < 1"),
        ({"damp_percent": -0.1}, ValueError, "0 < damp_percent < 1"),
        ({"damp_percent": float("nan")}, ValueError, "damp_percent: expected a finite"),
        ({"damp_auto_increment": -0.01}, ValueError, "damp_auto_increment: got -0.01"),
        ({"mse": -1.0}, ValueError, "mse: got -1.0"),
        ({"mse": float("inf")}, ValueError, "mse: expected a finite"),
        ({"sym": 1}, TypeError, "sym: expected a bool"),
        ({"static_groups": None}, TypeError, "static_groups: expected a bool"),
        ({"lm_head": "no"}, TypeError, "lm_head: expected a bool"),
        ({"format": "fp8"}, ValueError, r"format='fp8' is not a GPTQ packing format"),
        ({"format": FORMAT.FP8}, ValueError, r"format=FORMAT\.FP8 is not"),
        ({"format": 2}, TypeError, "format must be a str"),
        ({"meta": {"damp_percent": 0.1}}, ValueError, r"meta: \['damp_percent'\] are"),
        ({"meta": {"bits": 4}}, ValueError, r"meta: \['bits'\] are GPTQConfig fields"),
        ({"meta": [1]}, TypeError, "meta: expected a mapping"),
    ],
)
def test_validation_names_the_field_and_the_accepted_values(
    kwargs, error, match, production_checks
):
    with pytest.raises(error, match=match):
        GPTQConfig(**kwargs)


def test_normalization():
    cfg = GPTQConfig(
        format=" GPTQ_V2 ",
        damp_percent=0.1,
        damp_auto_increment=0,
        mse=2,
        group_size=-1,
        bits=3,
    )
    assert cfg.format == "gptq_v2" and type(cfg.format) is str
    assert cfg.damp_auto_increment == 0.0 and isinstance(cfg.damp_auto_increment, float)
    assert cfg.mse == 2.0 and isinstance(cfg.mse, float)
    assert GPTQConfig(meta={}).meta is None and GPTQConfig(dynamic={}).dynamic is None


CONFIGS = [
    GPTQConfig(),
    GPTQConfig(bits=8, group_size=-1, sym=False, mse=2.4, static_groups=True),
    GPTQConfig(desc_act=True, act_group_aware=False, format="gptq_v2", lm_head=True),
    GPTQConfig(
        bits=2,
        group_size=32,
        damp_percent=0.01,
        damp_auto_increment=0.0025,
        meta={"quantizer": ["floatxq:0.1.0"], "hessian": {"chunk_size": None}},
        dynamic={"-:.*lm_head": {}, r".*down_proj": {"bits": 8, "desc_act": True}},
    ),
    GPTQConfig(dynamic={r".*up_proj": {"damp_percent": 0.1, "mse": 2.0}, "-:.*gate": None}),
]


@pytest.mark.parametrize("cfg", CONFIGS)
def test_round_trip_config_payload_config(cfg):
    payload = gptq_config_to_payload(cfg)
    assert json.loads(json.dumps(payload)) == payload  # plain JSON
    back = gptq_config_from_payload(payload)
    assert back == cfg and hash(back) == hash(cfg)
    assert gptq_config_to_payload(back) == payload


def test_solver_settings_travel_in_meta_next_to_the_users_entries():
    cfg = GPTQConfig(static_groups=True, mse=2.4, meta={"quantizer": "floatxq:0.1.0"})
    payload = gptq_config_to_payload(cfg)
    assert payload["meta"] == {
        "quantizer": "floatxq:0.1.0",
        "damp_percent": 0.05,
        "damp_auto_increment": 0.01,
        "static_groups": True,
        "act_group_aware": True,
        "mse": 2.4,
    }
    assert "damp_percent" not in payload and "static_groups" not in payload
    assert gptq_config_from_payload(payload).meta == {"quantizer": "floatxq:0.1.0"}


def test_reading_a_gptqmodel_payload():
    payload = {
        "bits": 4,
        "group_size": 128,
        "desc_act": False,
        "lm_head": False,
        "quant_method": "gptq",
        "checkpoint_format": "gptq",
        "pack_dtype": "int32",
        "sym": True,
        "meta": {
            "quantizer": ["gptqmodel:7.7.0"],
            "damp_percent": 0.05,
            "damp_auto_increment": 0.01,
            "act_group_aware": True,
            "mse": 0.0,
            "gptaq": None,
            "hessian": {"chunk_size": None, "chunk_bytes": None, "staging_dtype": "float32"},
        },
    }
    cfg = gptq_config_from_payload(payload)
    assert cfg.format == "gptq" and cfg.act_group_aware is True
    assert cfg.meta == {
        "quantizer": ("gptqmodel:7.7.0",),
        "gptaq": None,
        "hessian": {"chunk_size": None, "chunk_bytes": None, "staging_dtype": "float32"},
    }
    assert gptq_config_to_payload(cfg)["meta"]["hessian"]["staging_dtype"] == "float32"


def test_reading_top_level_solver_settings_and_rejecting_conflicts():
    cfg = gptq_config_from_payload({"damp_percent": 0.1, "static_groups": True})
    assert cfg.damp_percent == 0.1 and cfg.static_groups
    assert gptq_config_to_payload(cfg)["meta"]["damp_percent"] == 0.1
    same = gptq_config_from_payload({"damp_percent": 0.1, "meta": {"damp_percent": 0.1}})
    assert same.damp_percent == 0.1
    with pytest.raises(ValueError, match="damp_percent: the payload gives 0.1 at the top level"):
        gptq_config_from_payload({"damp_percent": 0.1, "meta": {"damp_percent": 0.2}})


@pytest.mark.parametrize(
    ("payload", "match"),
    [
        ({"rotation": "hadamard"}, r"rotation: a weight/activation rotation is not available yet"),
        ({"rotation": "random"}, "rotation: .*not available yet"),
        ({"adapter": {"name": "lora", "rank": 128}}, "adapter: a LoRA/EoRA adapter is not avail"),
    ],
)
def test_reading_an_unavailable_feature_says_so(payload, match):
    with pytest.raises(ValueError, match=match):
        gptq_config_from_payload(payload)


def test_reading_empty_unavailable_features_is_fine():
    assert gptq_config_from_payload({"activation": None, "rotation": ""}) == GPTQConfig()
    assert gptq_config_from_payload({"rotation": False, "adapter": {}}) == GPTQConfig()
    assert gptq_config_from_payload({"rotation": None, "format": None}) == GPTQConfig()


@pytest.mark.parametrize(
    ("payload", "error", "match"),
    [
        ({"true_sequential": True}, ValueError, "unsupported field"),
        ({"weight_scale_method": "row"}, ValueError, "unsupported field"),
        ({"quant_method": "fp8"}, ValueError, r"quant_method: this reader takes 'gptq'"),
        ({"method": "awq"}, ValueError, r"method: this reader takes 'gptq'"),
        ({"format": "gptq", "checkpoint_format": "gptq_v2"}, ValueError, "checkpoint_format"),
        ({"pack_dtype": "int16"}, ValueError, "pack_dtype"),
        ({"meta": "x"}, TypeError, "meta: expected a mapping"),
        ({"bits": 3.5}, TypeError, "bits"),
        ({"dynamic": {"a": {"fmt": "e4m3"}}}, ValueError, r"unsupported GPTQ override"),
    ],
)
def test_reading_rejects(payload, error, match, production_checks):
    with pytest.raises(error, match=match):
        gptq_config_from_payload(payload)


def test_production_type_errors(production_checks):
    with pytest.raises(TypeError, match="payload: expected a mapping, got list"):
        gptq_config_from_payload([("bits", 4)])  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"module_name: expected a str, got int 3"):
        GPTQConfig().resolve(3)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"dynamic\['a'\].sym: expected a bool, got int 1"):
        GPTQConfig(dynamic={"a": {"sym": 1}})
    with pytest.raises(TypeError, match="config: expected a GPTQConfig, got dict"):
        gptq_config_to_payload({"bits": 4})  # type: ignore[arg-type]


def test_checkpoint_format_stands_in_for_a_missing_format():
    assert gptq_config_from_payload({"checkpoint_format": "gptq_v2"}).format == "gptq_v2"


def test_dynamic_rules_are_validated_and_resolved():
    cfg = GPTQConfig(
        dynamic={
            r".*\.mlp\.down_proj": {"bits": 8, "group_size": -1},
            r".*\.self_attn\..*": {"desc_act": True},
            "-:.*lm_head": {},
        }
    )
    down = cfg.resolve("model.layers.3.mlp.down_proj")
    assert (down.bits, down.group_size, down.dynamic) == (8, -1, None)
    attn = cfg.resolve("model.layers.0.self_attn.q_proj")
    assert attn.desc_act and attn.act_group_aware is False  # the rule's desc_act wins
    assert cfg.resolve("lm_head") is None
    plain = cfg.resolve("model.layers.0.mlp.up_proj")
    assert plain == GPTQConfig()
    with pytest.raises(ValueError, match=r"unsupported GPTQ override\(s\) \['fmt'\]"):
        GPTQConfig(dynamic={".*": {"fmt": "e4m3"}})
    with pytest.raises(ValueError, match=r"dynamic\['.\*'\].bits: got 7"):
        GPTQConfig(dynamic={".*": {"bits": 7}})
    with pytest.raises(ValueError, match=r"dynamic\['.\*'\].*cannot be combined"):
        GPTQConfig(dynamic={".*": {"desc_act": True, "act_group_aware": True}})


def test_a_rule_that_would_combine_into_desc_act_with_group_aware_is_refused_early():
    base = {"desc_act": True, "act_group_aware": False}
    with pytest.raises(ValueError, match=r"dynamic\['x'\]: with this config the rule gives"):
        GPTQConfig(**base, dynamic={"x": {"act_group_aware": True}})
    cfg = GPTQConfig(**base, dynamic={"x": {"act_group_aware": True, "desc_act": False}})
    resolved = cfg.resolve("x")
    assert (resolved.desc_act, resolved.act_group_aware) == (False, True)


def test_solver_options_of_a_resolved_config():
    cfg = GPTQConfig(
        bits=3,
        group_size=32,
        sym=False,
        mse=2.0,
        lm_head=True,
        format="gptq_v2",
        dynamic={r".*down_proj": {"desc_act": True, "static_groups": True, "damp_percent": 0.1}},
    )
    plain = gptq_solve_options(cfg.resolve("model.layers.0.mlp.up_proj"))
    assert plain == GPTQSolveOptions(bits=3, group_size=32, sym=False, mse=2.0)
    down = gptq_solve_options(cfg.resolve("model.layers.0.mlp.down_proj"))
    assert down == GPTQSolveOptions(
        bits=3,
        group_size=32,
        sym=False,
        desc_act=True,
        static_groups=True,
        act_group_aware=False,
        damp_percent=0.1,
        mse=2.0,
    )
    with pytest.raises(ValueError, match=r"config: has 1 dynamic rule\(s\).*config\.resolve"):
        gptq_solve_options(cfg)


def test_solver_options_need_a_gptq_config(production_checks):
    with pytest.raises(TypeError, match="config: expected a GPTQConfig, got GPTQSolveOptions"):
        gptq_solve_options(GPTQSolveOptions())  # type: ignore[arg-type]
