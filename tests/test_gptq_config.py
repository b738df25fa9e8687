"""GPTQConfig (SPEC §6, reference §2.2 and §8.3): validation, defaults, payload round trips."""

import json
import warnings

import jaxtyping
import pytest

from floatxq.config import FORMAT, METHOD, GPTQConfig


@pytest.fixture
def unchecked():
    """Switch the test-time annotation check off, to see the errors users get in production."""
    before = jaxtyping.config.jaxtyping_disable
    jaxtyping.config.update("jaxtyping_disable", True)
    yield
    jaxtyping.config.update("jaxtyping_disable", before)


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


def test_defaults_are_the_seeds():
    cfg = GPTQConfig()
    assert (cfg.bits, cfg.group_size, cfg.sym, cfg.desc_act) == (4, 128, True, False)
    assert (cfg.static_groups, cfg.act_group_aware, cfg.mse, cfg.lm_head) == (
        False,
        True,
        0.0,
        False,
    )
    assert (cfg.damp_percent, cfg.damp_auto_increment) == (0.05, 0.01)
    assert cfg.format == FORMAT.GPTQ and cfg.method == METHOD.GPTQ
    assert cfg.activation is None and cfg.dynamic is None and cfg.rotation is None
    assert cfg.meta is None and not cfg.uses_weight_only_lifecycle()


def test_default_payload_by_hand():
    assert GPTQConfig().to_dict() == DEFAULT_PAYLOAD


def test_frozen_and_hashable():
    cfg = GPTQConfig(dynamic={r".*mlp": {"bits": 8}}, meta={"note": [1, 2]})
    with pytest.raises((AttributeError, TypeError)):
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
        ({"damp_percent": float("nan")}, ValueError, "finite"),
        ({"damp_auto_increment": -0.01}, ValueError, "damp_auto_increment: got -0.01"),
        ({"mse": -1.0}, ValueError, "mse: got -1.0"),
        ({"mse": float("inf")}, ValueError, "finite"),
        ({"sym": 1}, TypeError, "sym: expected a bool"),
        ({"static_groups": None}, TypeError, "static_groups: expected a bool"),
        ({"lm_head": "no"}, TypeError, "lm_head: expected a bool"),
        ({"format": "fp8"}, ValueError, r"format: got 'fp8', accepted: \['gptq', 'gptq_v2'\]"),
        ({"format": FORMAT.FP8}, ValueError, "format: got"),
        ({"format": 2}, TypeError, "format: expected 'gptq'"),
        ({"method": "fp8"}, ValueError, "only supports 'gptq'"),
        ({"rotation": "spin"}, ValueError, r"rotation: got 'spin'"),
        ({"rotation": 1}, TypeError, "rotation: expected None"),
        ({"meta": {"damp_percent": 0.1}}, ValueError, r"meta: \['damp_percent'\] are"),
        ({"meta": [1]}, TypeError, "meta: expected a mapping"),
        ({"activation": 3}, TypeError, "activation: expected None"),
    ],
)
def test_validation_names_the_field_and_the_accepted_values(kwargs, error, match, unchecked):
    with pytest.raises(error, match=match):
        GPTQConfig(**kwargs)


def test_normalization():
    cfg = GPTQConfig(
        format=" GPTQ_V2 ",
        method=METHOD.GPTQ,
        rotation="Hadamard",
        damp_percent=0.1,
        damp_auto_increment=0,
        mse=2,
        group_size=-1,
        bits=3,
    )
    assert cfg.format is FORMAT.GPTQ_V2 and cfg.rotation == "hadamard"
    assert cfg.damp_auto_increment == 0.0 and isinstance(cfg.damp_auto_increment, float)
    assert cfg.mse == 2.0 and isinstance(cfg.mse, float)
    assert GPTQConfig(rotation="").rotation is None
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
        rotation="random",
        meta={"quantizer": ["floatxq:0.1.0"], "hessian": {"chunk_size": None}},
        dynamic={"-:.*lm_head": {}, r".*down_proj": {"bits": 8, "desc_act": True}},
    ),
    GPTQConfig(activation="w4afp8", rotation="hadamard", dynamic={"-:.*gate": None}),
    GPTQConfig(
        activation={"mode": "w4a_nvfp4", "recipe": "least_squares", "mlp": {"layers": [0, 1]}},
        dynamic={r".*up_proj": {"damp_percent": 0.1, "mse": 2.0}},
    ),
]


@pytest.mark.parametrize("cfg", CONFIGS)
def test_round_trip_config_dict_config(cfg):
    payload = cfg.to_dict()
    assert json.loads(json.dumps(payload)) == payload  # plain JSON
    back = GPTQConfig.from_dict(payload)
    assert back == cfg and hash(back) == hash(cfg)
    assert back.to_dict() == payload


def test_solver_settings_travel_in_meta_next_to_the_users_entries():
    cfg = GPTQConfig(static_groups=True, mse=2.4, meta={"quantizer": "floatxq:0.1.0"})
    payload = cfg.to_dict()
    assert payload["meta"] == {
        "quantizer": "floatxq:0.1.0",
        "damp_percent": 0.05,
        "damp_auto_increment": 0.01,
        "static_groups": True,
        "act_group_aware": True,
        "mse": 2.4,
    }
    assert "damp_percent" not in payload and "static_groups" not in payload
    assert GPTQConfig.from_dict(payload).meta == {"quantizer": "floatxq:0.1.0"}


def test_from_dict_reads_a_seed_style_payload():
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
    cfg = GPTQConfig.from_dict(payload)
    assert cfg.format == FORMAT.GPTQ and cfg.act_group_aware is True
    assert cfg.meta == {
        "quantizer": ("gptqmodel:7.7.0",),
        "gptaq": None,
        "hessian": {"chunk_size": None, "chunk_bytes": None, "staging_dtype": "float32"},
    }
    assert cfg.to_dict()["meta"]["hessian"]["staging_dtype"] == "float32"


def test_from_dict_accepts_top_level_solver_settings_and_rejects_conflicts():
    cfg = GPTQConfig.from_dict({"damp_percent": 0.1, "static_groups": True})
    assert cfg.damp_percent == 0.1 and cfg.static_groups
    assert cfg.to_dict()["meta"]["damp_percent"] == 0.1
    same = GPTQConfig.from_dict({"damp_percent": 0.1, "meta": {"damp_percent": 0.1}})
    assert same.damp_percent == 0.1
    with pytest.raises(ValueError, match="damp_percent: the payload gives 0.1 at the top level"):
        GPTQConfig.from_dict({"damp_percent": 0.1, "meta": {"damp_percent": 0.2}})


@pytest.mark.parametrize(
    ("payload", "error", "match"),
    [
        ({"true_sequential": True}, ValueError, "unsupported field"),
        ({"weight_scale_method": "row"}, ValueError, "unsupported field"),
        ({"quant_method": "fp8"}, ValueError, "quant_method: GPTQConfig only reads"),
        ({"method": "awq"}, ValueError, "method: GPTQConfig only reads"),
        ({"format": "gptq", "checkpoint_format": "gptq_v2"}, ValueError, "checkpoint_format"),
        ({"pack_dtype": "int16"}, ValueError, "pack_dtype"),
        ({"meta": "x"}, TypeError, "meta: expected a mapping"),
        ({"bits": 3.5}, TypeError, "bits"),
    ],
)
def test_from_dict_rejects(payload, error, match, unchecked):
    with pytest.raises(error, match=match):
        GPTQConfig.from_dict(payload)


def test_production_type_errors(unchecked):
    with pytest.raises(TypeError, match="payload: expected a mapping, got list"):
        GPTQConfig.from_dict([("bits", 4)])  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"module_name: expected a str, got int 3"):
        GPTQConfig().resolve(3)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"dynamic\['a'\].sym: expected a bool, got int 1"):
        GPTQConfig(dynamic={"a": {"sym": 1}})


def test_checkpoint_format_stands_in_for_a_missing_format():
    assert GPTQConfig.from_dict({"checkpoint_format": "gptq_v2"}).format is FORMAT.GPTQ_V2


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
    with pytest.raises(ValueError, match="requires desc_act=False"):
        GPTQConfig(dynamic={".*": {"desc_act": True, "act_group_aware": True}})


@pytest.mark.parametrize(
    ("kwargs", "problem"),
    [
        ({"bits": 8}, "bits=8"),
        ({"group_size": 64}, "group_size=64"),
        ({"sym": False}, "sym=False"),
        ({"desc_act": True, "act_group_aware": False}, "desc_act=True"),
        ({"lm_head": True}, "lm_head=True"),
        ({"dynamic": {r".*down_proj": {"bits": 8}}}, "overrides ['bits']"),
        ({"dynamic": {r".*up_proj": {"desc_act": True}}}, "overrides ['desc_act']"),
    ],
)
def test_an_activation_policy_fixes_the_weight_layout(kwargs, problem):
    with pytest.raises(ValueError, match=f"activation: .*{_escape(problem)}"):
        GPTQConfig(activation={"mode": "w4afp8"}, **kwargs)


def _escape(text: str) -> str:
    return "".join("\\" + ch if ch in "[]()*.+?" else ch for ch in text)


def test_an_activation_policy_allows_exclusions_and_solver_overrides():
    cfg = GPTQConfig(
        activation="w4afp8",
        dynamic={"-:.*down_proj": {}, r".*up_proj": {"damp_percent": 0.1, "static_groups": True}},
    )
    assert cfg.activation == {"mode": "w4afp8"}
    assert cfg.resolve("model.layers.0.mlp.up_proj").static_groups
