"""Properties of the W4A activation policy's stored form (ActivationConfig).

The payloads are drawn as plain dicts (no floatxq calls inside strategies); the expected
canonical form is written here from the policy rules: recipes canonical (legacy ``lsq*``
aliases expanded, ``least_squares`` by default for NVFP4), an NVFP4 attention lane without a
recipe taking the stream's, MLP layers sorted, global scales rounded through FP32.
"""

import json
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from floatxq.config import ActivationConfig
from floatxq.testing import production_checks

CANONICAL = {
    "nvidia": "nvidia", "four_six": "four_six", "least_squares": "least_squares",
    "least_squares_grid": "least_squares_grid", "exhaustive": "exhaustive",
    "nvidia_headroom": "nvidia_headroom", "least_squares_headroom": "least_squares_headroom",
    "lsq": "least_squares", "lsq_grid": "least_squares_grid",
    "lsq_headroom": "least_squares_headroom",
}  # fmt: skip
HEADROOM = {"nvidia_headroom", "least_squares_headroom"}

recipes = st.sampled_from(sorted(CANONICAL))
scales = st.floats(min_value=1e-30, max_value=1e30, allow_nan=False, allow_infinity=False)


@st.composite
def nvfp4_payloads(draw: Any) -> dict[str, Any]:
    payload: dict[str, Any] = {"mode": "w4a_nvfp4"}
    if draw(st.booleans()):
        payload["recipe"] = draw(recipes)
    if draw(st.booleans()):
        attention: dict[str, Any] = {"mode": draw(st.sampled_from(["w4afp8", "w4a_nvfp4"]))}
        if attention["mode"] == "w4a_nvfp4" and draw(st.booleans()):
            attention["recipe"] = draw(recipes)
        payload["attention"] = attention
    if draw(st.booleans()):
        layers = draw(st.lists(st.integers(0, 80), min_size=1, max_size=6, unique=True))
        payload["mlp"] = {"mode": "w4afp8", "layers": layers}
    if draw(st.booleans()):
        keys = draw(st.lists(st.from_regex(r"[a-z0-9_.]{1,12}", fullmatch=True), min_size=1,
                             max_size=4, unique=True))  # fmt: skip
        payload["global_scales"] = {f"model.layers.{k}": draw(scales) for k in keys}
    return payload


def _expected(payload: dict[str, Any]) -> dict[str, Any] | None:
    """The canonical stored form, or None where the rules refuse the payload."""
    stream = CANONICAL[payload.get("recipe", "least_squares")]
    out: dict[str, Any] = {"mode": "w4a_nvfp4", "recipe": stream}
    used = [stream]
    if "attention" in payload:
        attention = dict(payload["attention"])
        if attention["mode"] == "w4a_nvfp4":
            attention["recipe"] = CANONICAL[attention.get("recipe", stream)]
            used.append(attention["recipe"])
        out["attention"] = attention
    if "mlp" in payload:
        out["mlp"] = {"mode": "w4afp8", "layers": sorted(payload["mlp"]["layers"])}
    if "global_scales" in payload:
        if any(r in HEADROOM for r in used):
            return None
        out["global_scales"] = {
            k: float(torch.tensor(v, dtype=torch.float32))
            for k, v in payload["global_scales"].items()
        }
    return out


@given(nvfp4_payloads())
def test_the_stored_form_is_canonical_and_a_fixed_point(payload):
    expected = _expected(payload)
    with production_checks():
        if expected is None:
            try:
                ActivationConfig.from_dict(payload)
            except ValueError as exc:
                assert "headroom recipe" in str(exc)
            else:
                raise AssertionError(f"accepted global scales with a headroom recipe: {payload}")
            return
        cfg = ActivationConfig.from_dict(payload)
        stored = cfg.to_dict()
        assert stored == expected
        again = ActivationConfig.from_dict(stored)
        assert again == cfg and again.to_dict() == stored


@given(st.sampled_from(["w4afp8", "w4a_nvfp4"]))
def test_a_mode_string_is_the_minimal_policy(mode):
    cfg = ActivationConfig.from_value(mode)
    assert cfg.to_dict() == ({"mode": mode} if mode == "w4afp8"
                             else {"mode": mode, "recipe": "least_squares"})  # fmt: skip


# --------------------------------------------------------------------------------------------
# The policy inside a GPTQ config and its payload
# --------------------------------------------------------------------------------------------

W4A_LAYOUT = {"bits": 4, "group_size": 128, "sym": True, "desc_act": False, "lm_head": False}
OTHER_VALUES = {"bits": [2, 3, 8], "group_size": [-1, 32, 64], "sym": [False],
                "desc_act": [True], "lm_head": [True]}  # fmt: skip


@given(nvfp4_payloads() | st.just({"mode": "w4afp8"}), st.sampled_from(["gptq", "gptq_v2"]))
def test_a_gptq_payload_carries_the_policy_in_its_stored_form(payload, fmt):
    """GPTQConfig(activation=...) → GPT-QModel payload → JSON → GPTQConfig is exact, and the
    payload's ``activation`` is the policy's canonical dict."""
    expected = {"mode": "w4afp8"} if payload["mode"] == "w4afp8" else _expected(payload)
    if expected is None:
        return
    from floatxq.config import GPTQConfig
    from floatxq.interop.payload import gptq_config_from_payload, gptq_config_to_payload

    cfg = GPTQConfig(activation=payload, format=fmt)
    stored = json.loads(json.dumps(gptq_config_to_payload(cfg)))
    assert stored["activation"] == expected
    again = gptq_config_from_payload(stored)
    assert again == cfg and again.activation.to_dict() == expected


@given(st.sampled_from(sorted(OTHER_VALUES)), st.data(), st.sampled_from(["w4afp8", "w4a_nvfp4"]))
def test_every_layout_the_w4a_gemms_cannot_read_is_refused(name, data, mode):
    """Each of bits/group_size/sym/desc_act/lm_head off the W4A layout is refused by name, as
    is a ``+:`` rule overriding one of the four per-module layout settings."""
    from floatxq.config import GPTQConfig

    value = data.draw(st.sampled_from(OTHER_VALUES[name]), label=name)
    kwargs = {name: value, "act_group_aware": False} if name == "desc_act" else {name: value}
    with pytest.raises(ValueError, match=f"this config has {name}={value!r}"):
        GPTQConfig(activation=mode, **kwargs)
    if name == "lm_head":
        return
    with pytest.raises(ValueError, match=rf"dynamic\['.\*down_proj'\]: overrides \['{name}'\]"):
        GPTQConfig(activation=mode, dynamic={".*down_proj": {name: value}})
    assert GPTQConfig(activation=mode, **W4A_LAYOUT).activation.mode == mode
