"""W4A activation policies: ActivationConfig, its attention / MLP refinements, the stored dict
form and the backend a policy binds. Expected values are written from the policy rules, not
read back from the implementation."""

import pytest
import torch

from floatxq.config import (
    BACKEND,
    ActivationAttentionConfig,
    ActivationConfig,
    ActivationMlpConfig,
    backend_for_activation,
)
from floatxq.testing import production_checks


def _fp32(value: float) -> float:
    return float(torch.tensor(value, dtype=torch.float32))


# ----------------------------------------------------------------------------------------------
# Building, normalizing, storing
# ----------------------------------------------------------------------------------------------


def test_from_value_accepts_none_an_instance_a_mode_and_a_dict():
    assert ActivationConfig.from_value(None) is None
    cfg = ActivationConfig(mode="w4afp8")
    assert ActivationConfig.from_value(cfg) is cfg
    assert ActivationConfig.from_value("w4afp8").to_dict() == {"mode": "w4afp8"}
    assert ActivationConfig.from_value("w4a_nvfp4").to_dict() == {
        "mode": "w4a_nvfp4", "recipe": "least_squares"
    }  # fmt: skip
    assert ActivationConfig.from_value({"mode": "w4a_nvfp4", "recipe": "lsq_grid"}).recipe == (
        "least_squares_grid"
    )
    with pytest.raises(ValueError, match="expected None, an ActivationConfig, a mode string"):
        ActivationConfig.from_value(3)


def test_the_dict_form_round_trips_and_is_canonical():
    payload = {
        "mode": "w4a_nvfp4",
        "recipe": "lsq",
        "attention": {"mode": "w4a_nvfp4"},
        "mlp": {"mode": "w4afp8", "layers": [5, 1, 3]},
        "global_scales": {"model.layers.0.input_layernorm": 0.1},
    }
    cfg = ActivationConfig.from_dict(payload)
    stored = cfg.to_dict()
    assert stored == {
        "mode": "w4a_nvfp4",
        "recipe": "least_squares",
        "attention": {"mode": "w4a_nvfp4", "recipe": "least_squares"},  # inherited
        "mlp": {"mode": "w4afp8", "layers": [1, 3, 5]},  # sorted
        "global_scales": {"model.layers.0.input_layernorm": _fp32(0.1)},  # through FP32
    }
    again = ActivationConfig.from_dict(stored)
    assert again == cfg and hash(again) == hash(cfg) and again.to_dict() == stored
    assert payload["mlp"]["layers"] == [5, 1, 3]  # the caller's dict is not changed


def test_an_nvfp4_attention_lane_inherits_the_stream_recipe_unless_it_names_one():
    base = {"mode": "w4a_nvfp4", "recipe": "four_six"}
    assert ActivationConfig.from_dict({**base, "attention": {"mode": "w4a_nvfp4"}}).attention == (
        ActivationAttentionConfig(mode="w4a_nvfp4", recipe="four_six")
    )
    own = ActivationConfig.from_dict({**base, "attention": {"mode": "w4a_nvfp4",
                                                             "recipe": "nvidia"}})  # fmt: skip
    assert own.attention.recipe == "nvidia"
    fp8 = ActivationConfig.from_dict({**base, "attention": {"mode": "w4afp8"}})
    assert fp8.attention.to_dict() == {"mode": "w4afp8"}


def test_refinements_as_records_and_their_dict_forms():
    assert ActivationAttentionConfig().to_dict() == {"mode": "w4afp8"}
    assert ActivationMlpConfig(layers=(2,)).layers == (2,)
    cfg = ActivationConfig(
        mode="w4a_nvfp4",
        attention=ActivationAttentionConfig(mode="w4afp8"),
        mlp=ActivationMlpConfig(layers=[0]),
    )
    assert cfg.to_dict() == {"mode": "w4a_nvfp4", "recipe": "least_squares",
                             "attention": {"mode": "w4afp8"},
                             "mlp": {"mode": "w4afp8", "layers": [0]}}  # fmt: skip


# ----------------------------------------------------------------------------------------------
# Refusals
# ----------------------------------------------------------------------------------------------

NVFP4 = {"mode": "w4a_nvfp4"}
KEY = "model.layers.0.mlp.down_proj"


@pytest.mark.parametrize(
    ("payload", "match"),
    [
        ({}, "'mode' is required"),
        ({"mode": "fp8"}, r"mode must be one of \('w4afp8', 'w4a_nvfp4'\), got 'fp8'"),
        ({"mode": "w4afp8", "recipe": "nvidia"}, "FP8 activations do not use an NVFP4 scale"),
        ({"mode": "w4a_nvfp4", "recipe": "best"}, "Unsupported NVFP4 scale recipe: 'best'"),
        ({"mode": "w4afp8", "attention": {"mode": "w4afp8"}}, "attention refines an NVFP4"),
        ({"mode": "w4afp8", "mlp": {"mode": "w4afp8", "layers": [0]}}, "mlp refines an NVFP4"),
        ({"mode": "w4afp8", "global_scales": {KEY: 1.0}}, "global_scales refines an NVFP4"),
        ({**NVFP4, "version": 2}, r"unsupported field\(s\) \['version'\]"),
        ({**NVFP4, "attention": {"mode": "w4afp8", "x": 1}}, r"attention: unsupported field"),
        ({**NVFP4, "attention": {"recipe": "nvidia"}}, "attention: 'mode' is required"),
        ({**NVFP4, "attention": {"mode": "w4afp8", "recipe": "nvidia"}}, "do not use an NVFP4"),
        ({**NVFP4, "attention": "w4afp8"}, "attention must be an ActivationAttentionConfig or"),
        ({**NVFP4, "attention": {1: "w4afp8"}}, "expected a mapping with str keys"),
        ({**NVFP4, "mlp": {"layers": [0]}}, "'mode' and 'layers' are both required"),
        ({**NVFP4, "mlp": {"mode": "w4a_nvfp4", "layers": [0]}}, "mode must be 'w4afp8'"),
        ({**NVFP4, "mlp": {"mode": "w4afp8", "layers": []}}, "non-empty list or tuple"),
        ({**NVFP4, "mlp": {"mode": "w4afp8", "layers": 3}}, "non-empty list or tuple"),
        ({**NVFP4, "mlp": {"mode": "w4afp8", "layers": [1, 1]}}, "must be distinct"),
        ({**NVFP4, "mlp": {"mode": "w4afp8", "layers": [-1]}}, r"non-negative ints .* \[-1\]"),
        ({**NVFP4, "mlp": {"mode": "w4afp8", "layers": [True]}}, r"no bools.* \[True\]"),
        ({**NVFP4, "mlp": {"mode": "w4afp8", "layers": [1.0]}}, r"non-negative ints"),
        ({**NVFP4, "global_scales": {}}, "global_scales must be a non-empty mapping"),
        ({**NVFP4, "global_scales": {"lm_head": 1.0}}, "keys must be strings starting with"),
        ({**NVFP4, "global_scales": {KEY: True}}, "must be a positive finite number, got True"),
        ({**NVFP4, "global_scales": {KEY: "1"}}, "must be a positive finite number"),
        ({**NVFP4, "global_scales": {KEY: 0.0}}, "must be a positive finite number, got 0.0"),
        ({**NVFP4, "global_scales": {KEY: -2}}, "must be a positive finite number, got -2"),
        ({**NVFP4, "global_scales": {KEY: float("nan")}}, "positive finite number, got nan"),
        ({**NVFP4, "global_scales": {KEY: float("inf")}}, "positive finite number, got inf"),
        ({**NVFP4, "global_scales": {KEY: 1e-60}}, r"1e-60 is 0.0 in FP32; it must stay"),
        ({**NVFP4, "global_scales": {KEY: 1e60}}, r"1e\+60 is inf in FP32; it must stay"),
        ({**NVFP4, "recipe": "nvidia_headroom", "global_scales": {KEY: 1.0}},
         "cannot be combined with the headroom recipe 'nvidia_headroom'"),
        ({**NVFP4, "attention": {"mode": "w4a_nvfp4", "recipe": "lsq_headroom"},
          "global_scales": {KEY: 1.0}}, "headroom recipe 'least_squares_headroom'"),
    ],
)  # fmt: skip
def test_every_invalid_policy_is_a_value_error(payload, match):
    with production_checks(), pytest.raises(ValueError, match=match):
        ActivationConfig.from_dict(payload)


def test_headroom_recipes_are_fine_without_global_scales_and_fp8_attention_has_no_recipe():
    cfg = ActivationConfig.from_dict({"mode": "w4a_nvfp4", "recipe": "lsq_headroom",
                                      "attention": {"mode": "w4afp8"}})  # fmt: skip
    assert cfg.recipe == "least_squares_headroom" and cfg.attention.recipe is None
    # the attention lane is FP8, so only the stream's (non-headroom) recipe matters here
    ok = ActivationConfig.from_dict({**NVFP4, "attention": {"mode": "w4afp8"},
                                     "global_scales": {KEY: 2}})  # fmt: skip
    assert ok.global_scales == {KEY: 2.0}


def test_the_records_are_frozen_and_refuse_other_kinds():
    cfg = ActivationConfig(mode="w4a_nvfp4")
    with pytest.raises(AttributeError):
        cfg.mode = "w4afp8"  # type: ignore[misc]
    with pytest.raises(TypeError):
        cfg.global_scales["x"] = 1.0  # type: ignore[index]
    with production_checks(), pytest.raises(ValueError, match="attention must be an Activation"):
        ActivationConfig(mode="w4a_nvfp4", attention=3)  # type: ignore[arg-type]
    with production_checks(), pytest.raises(ValueError, match="NVFP4 attention policy needs"):
        ActivationAttentionConfig(mode="w4a_nvfp4")


# ----------------------------------------------------------------------------------------------
# The backend a policy binds
# ----------------------------------------------------------------------------------------------


def test_backend_for_activation():
    fp8, nvfp4 = ActivationConfig(mode="w4afp8"), ActivationConfig(mode="w4a_nvfp4")
    assert backend_for_activation(fp8) is BACKEND.GPTQ_W4AFP8
    assert backend_for_activation(nvfp4, " AUTO ") is BACKEND.GPTQ_W4A_NVFP4
    assert backend_for_activation(nvfp4, "gptq_w4a_nvfp4") is BACKEND.GPTQ_W4A_NVFP4
    assert backend_for_activation(None, "gptq_torch") is BACKEND.GPTQ_TORCH
    assert backend_for_activation(None) is None
    with pytest.raises(ValueError, match="activation mode 'w4afp8' runs on backend 'gptq_w4afp8'"):
        backend_for_activation(fp8, "gptq_torch")
    with pytest.raises(ValueError, match="'gptq_w4a_nvfp4'; got backend='gptq_w4afp8'"):
        backend_for_activation(nvfp4, BACKEND.GPTQ_W4AFP8)
