"""GSQConfig and FP8Config's GSQ fields: validation, selection, payloads, save and load."""

import dataclasses
import json
import math
from pathlib import Path

import compressed_tensors as ct
import pytest
import torch

import floatxq
from floatxq.config import FP8Config, GSQConfig
from floatxq.interop.checkpoint import CheckpointError
from floatxq.interop.payload import (
    fp8_config_from_payload,
    fp8_config_to_payload,
    fp8_gsq_record,
)
from floatxq.nn.fp8_linear import TorchFP8Linear

FIXTURE = Path(__file__).parent / "fixtures" / "tiny_random_llama"
FIELDS = (
    "enabled", "candidates", "steps", "learning_rate", "temperature_start", "temperature_end",
    "seed", "modules", "max_candidate_bytes", "learn_scales",
)  # fmt: skip


def test_defaults_are_the_documented_ones():
    cfg = GSQConfig()
    # every public field, in order: the payload writes these (a new field must join them)
    assert tuple(f.name for f in dataclasses.fields(cfg) if not f.name.startswith("_")) == FIELDS
    assert (cfg.enabled, cfg.candidates, cfg.steps, cfg.learning_rate) == (True, 5, 100, 0.1)
    assert (cfg.temperature_start, cfg.temperature_end, cfg.seed) == (1.0, 0.05, 0)
    assert (cfg.modules, cfg.max_candidate_bytes, cfg.learn_scales) == (None, 1 << 30, False)
    assert cfg == GSQConfig() and hash(cfg) == hash(GSQConfig())
    assert cfg != GSQConfig(steps=99)


@pytest.mark.parametrize(
    "field, value, kind, match",
    [
        ("enabled", "yes", TypeError, "enabled: expected a bool"),
        ("enabled", 1, TypeError, "enabled: expected a bool"),
        ("candidates", 5.0, TypeError, "candidates: expected an int"),
        ("candidates", True, TypeError, "candidates: expected an int"),
        ("candidates", 1, ValueError, r"candidates: got 1, accepted: 2 <= candidates <= 33"),
        ("candidates", 34, ValueError, r"candidates: got 34"),
        ("steps", 0, ValueError, r"steps: got 0, accepted: 1 <= steps"),
        ("steps", "10", TypeError, "steps: expected an int"),
        ("learning_rate", 0.0, ValueError, "learning_rate: got 0.0, accepted: a finite number > 0"),
        ("learning_rate", -0.1, ValueError, "learning_rate: got -0.1"),
        ("learning_rate", math.nan, ValueError, "learning_rate: expected a finite number"),
        ("learning_rate", math.inf, ValueError, "learning_rate: expected a finite number"),
        ("learning_rate", "0.1", TypeError, "learning_rate: expected a float"),
        ("temperature_start", 0, ValueError, "temperature_start: got 0.0"),
        ("temperature_end", -0.5, ValueError, "temperature_end: got -0.5"),
        ("temperature_end", None, TypeError, "temperature_end: expected a float"),
        ("seed", -1, ValueError, r"seed: got -1, accepted: 0 <= seed"),
        ("seed", 2**63, ValueError, "seed: got 9223372036854775808"),
        ("seed", 1.0, TypeError, "seed: expected an int"),
        ("modules", "q_proj", TypeError, "modules: expected a sequence of regular expressions"),
        ("modules", 3, TypeError, "modules: expected a sequence"),
        ("modules", [r".*q_proj", 7], TypeError, r"modules\[1\]: expected a regular expression"),
        ("modules", [], ValueError, "modules: an empty sequence selects nothing"),
        ("modules", ["(unclosed"], ValueError, r"^modules\[0\] '\(unclosed' is not a valid"),
        ("max_candidate_bytes", 0, ValueError, "max_candidate_bytes: got 0"),
        ("max_candidate_bytes", 1.5, TypeError, "max_candidate_bytes: expected an int"),
        ("learn_scales", True, ValueError, "learn_scales: GSQ keeps the FP8 inverse scales"),
        ("learn_scales", 0, TypeError, "learn_scales: expected a bool"),
    ],
)
def test_each_field_is_checked(production_checks, field, value, kind, match):
    with pytest.raises(kind, match=match):
        GSQConfig(**{field: value})


def test_edges_of_the_ranges_are_accepted(production_checks):
    cfg = GSQConfig(candidates=33, steps=1, seed=2**63 - 1, temperature_end=1.0)
    assert (cfg.candidates, cfg.steps, cfg.seed) == (33, 1, 2**63 - 1)
    assert GSQConfig(candidates=2, temperature_start=3, temperature_end=3).temperature_end == 3.0
    assert isinstance(GSQConfig(learning_rate=1).learning_rate, float)


def test_the_temperature_anneals_downwards():
    with pytest.raises(ValueError, match="temperature_end: got 0.5 above temperature_start 0.25"):
        GSQConfig(temperature_start=0.25, temperature_end=0.5)
    with pytest.raises(ValueError, match="temperature_end: got 1.5 above"):
        GSQConfig(temperature_end=1.5)  # the default start is 1.0


def test_config_is_frozen_and_keyword_only(production_checks):
    cfg = GSQConfig()
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.steps = 3  # type: ignore[misc]
    with pytest.raises(TypeError):
        GSQConfig(True)  # type: ignore[misc]


def test_selects_matches_names_from_the_start():
    everything = GSQConfig()
    assert everything.selects("model.layers.0.mlp.down_proj") and everything.selects("lm_head")
    mlp = GSQConfig(modules=(r".*mlp\.", r"model\.layers\.1\.self_attn\.q_proj$"))
    assert mlp.modules == (r".*mlp\.", r"model\.layers\.1\.self_attn\.q_proj$")
    assert mlp.selects("model.layers.0.mlp.up_proj")
    assert mlp.selects("model.layers.1.self_attn.q_proj")
    assert not mlp.selects("model.layers.0.self_attn.q_proj")
    assert not GSQConfig(modules=["mlp"]).selects("model.layers.0.mlp.up_proj")  # re.match
    off = GSQConfig(enabled=False)
    assert not off.selects("model.layers.0.mlp.up_proj")
    assert not GSQConfig(enabled=False, modules=[".*"]).selects("x")
    assert GSQConfig(modules=["a", "b"]) == GSQConfig(modules=("a", "b"))


# --- FP8Config's gsq fields ----------------------------------------------------------------


def test_fp8config_checks_gsq_and_its_calibration(production_checks):
    with pytest.raises(TypeError, match="gsq: expected a GSQConfig or None, got dict"):
        FP8Config(gsq={"steps": 3})
    with pytest.raises(TypeError, match="gsq_calibration: expected a bool"):
        FP8Config(gsq=GSQConfig(), gsq_calibration="yes")
    with pytest.raises(ValueError, match="GSQ is off; pass gsq=GSQConfig"):
        FP8Config(gsq_calibration=True)
    with pytest.raises(ValueError, match="GSQ is off"):
        FP8Config(gsq=GSQConfig(enabled=False), gsq_calibration=True)
    with pytest.raises(ValueError, match="needs weight_scale_method 'row' or 'block'.*'tensor'"):
        FP8Config(weight_scale_method="tensor", gsq=GSQConfig(), gsq_calibration=True)
    rule = {r".*down_proj": {"weight_scale_method": "tensor"}}
    with pytest.raises(ValueError, match=r"dynamic\['\.\*down_proj'\]: tensor scales"):
        FP8Config(gsq=GSQConfig(), gsq_calibration=True, dynamic=rule)
    # weight-only GSQ has no such need, and an excluded module is not refined
    assert FP8Config(weight_scale_method="tensor", gsq=GSQConfig()).gsq == GSQConfig()
    assert FP8Config(gsq=GSQConfig(), gsq_calibration=True, dynamic={"-:.*down_proj": {}})


def test_needs_calibration_and_resolve_keep_gsq():
    gsq = GSQConfig(steps=7)
    calibrated = FP8Config(weight_block_size=[32, 32], gsq=gsq, gsq_calibration=True)
    assert calibrated.needs_calibration
    assert not FP8Config(gsq=gsq).needs_calibration and not FP8Config().needs_calibration
    rules = {r".*down_proj": {"format": "e5m2"}}
    resolved = FP8Config(gsq=gsq, gsq_calibration=True, dynamic=rules).resolve("m.down_proj")
    assert resolved.gsq == gsq and resolved.gsq_calibration and resolved.format == "float8_e5m2"


# --- payloads ------------------------------------------------------------------------------

CONFIGS = [
    FP8Config(),
    FP8Config(gsq=GSQConfig()),
    FP8Config(gsq=GSQConfig(enabled=False)),
    FP8Config(
        format="e5m2", weight_block_size=[32, 32], meta={"by": "test"},
        dynamic={r".*down_proj": {"weight_scale_method": "row"}, "-:.*k_proj": {}},
        gsq=GSQConfig(
            candidates=7, steps=3, learning_rate=0.3, temperature_start=2.5,
            temperature_end=0.1 + 0.2, seed=2**63 - 1, modules=[r".*mlp\.", "lm_head"],
            max_candidate_bytes=12345,
        ),
        gsq_calibration=True,
    ),
]  # fmt: skip


@pytest.mark.parametrize("config", CONFIGS, ids=["plain", "gsq", "disabled", "everything"])
def test_payload_round_trips_exactly(config):
    payload = fp8_config_to_payload(config)
    through_json = json.loads(json.dumps(payload))
    assert through_json == payload
    back = fp8_config_from_payload(through_json)
    assert back == config and back.gsq == config.gsq
    assert fp8_config_to_payload(back) == payload
    if config.gsq is None:
        assert "gsq" not in payload and "gsq_calibration" not in payload
        return
    assert list(payload["gsq"]) == list(FIELDS)
    assert payload["gsq"] == {
        name: list(v) if isinstance(v := getattr(config.gsq, name), tuple) else v for name in FIELDS
    }
    assert payload["gsq_calibration"] is config.gsq_calibration


def test_payload_gsq_values_are_exact():
    payload = fp8_config_to_payload(CONFIGS[-1])
    assert payload["gsq"]["temperature_end"] == 0.1 + 0.2 != 0.3
    assert payload["gsq"]["modules"] == [r".*mlp\.", "lm_head"]
    assert payload["gsq"]["seed"] == 2**63 - 1 and payload["gsq_calibration"] is True


@pytest.mark.parametrize(
    "change, kind, match",
    [
        ({"gsq": {"steps": 3, "bogus": 1}}, ValueError, r"gsq\.bogus: not a GSQConfig field"),
        ({"gsq": {"Steps": 3}}, ValueError, r"gsq\.Steps: not a GSQConfig field"),
        ({"gsq": [3]}, TypeError, "gsq: expected an object of GSQConfig fields"),
        ({"gsq": "on"}, TypeError, "gsq: expected an object"),
        ({"gsq": {"learn_scales": True}}, ValueError, r"gsq\.learn_scales: GSQ keeps"),
        ({"gsq": {"steps": 0}}, ValueError, r"gsq\.steps: got 0"),
        ({"gsq": {"modules": "q"}}, TypeError, r"gsq\.modules: expected a sequence"),
        ({"gsq": None, "gsq_calibration": True}, ValueError, "GSQ is off"),
        ({"gsq_calibration": "true"}, TypeError, "gsq_calibration: expected a bool"),
    ],
)
def test_payload_gsq_errors_name_the_key(production_checks, change, kind, match):
    payload = {**fp8_config_to_payload(FP8Config(gsq=GSQConfig())), **change}
    with pytest.raises(kind, match=match):
        fp8_config_from_payload(payload)


def test_payload_without_some_gsq_fields_takes_the_defaults():
    config = fp8_config_from_payload({"quant_method": "fp8", "gsq": {"steps": 4}})
    assert config.gsq == GSQConfig(steps=4) and not config.gsq_calibration
    assert fp8_config_from_payload({"quant_method": "fp8", "gsq": None}).gsq is None


def test_load_takes_a_payload_with_gsq():
    payload = fp8_config_to_payload(CONFIGS[1])
    assert floatxq.load(FIXTURE, quantize_config=payload).quantize_config == CONFIGS[1]


# --- save and load -------------------------------------------------------------------------


def _codes(model) -> dict[str, torch.Tensor]:
    return {
        name: module.weight.view(torch.uint8).clone()
        for name, module in model.named_modules()
        if isinstance(module, TorchFP8Linear)
    }


@pytest.fixture(scope="module")
def refined():
    config = FP8Config(gsq=GSQConfig(steps=2, seed=5, modules=[r".*mlp\."]))
    model = floatxq.load(FIXTURE, quantize_config=config).quantize(progress=False)
    assert {m.name.split(".")[-1] for m in model.report.modules} == {"gate_proj", "up_proj",
                                                                     "down_proj"}  # fmt: skip
    return config, model


def test_gptqmodel_layout_saves_the_gsq_settings_and_codes(refined, tmp_path):
    config, model = refined
    out = model.save(tmp_path / "gptqmodel", layout="gptqmodel")
    for name in ("quantize_config.json", "config.json"):
        data = json.loads((out / name).read_text())
        payload = data.get("quantization_config", data)
        assert payload["gsq"] == fp8_config_to_payload(config)["gsq"]
        assert payload["gsq_calibration"] is False
    loaded = floatxq.load(out)
    assert loaded.quantize_config == config
    mine, theirs = _codes(model.model), _codes(loaded.model)
    assert mine.keys() == theirs.keys() and len(mine) == 14
    assert all(torch.equal(mine[n], theirs[n]) for n in mine)


def test_the_two_payloads_must_agree_on_gsq(refined, tmp_path):
    _, model = refined
    out = model.save(tmp_path / "gptqmodel", layout="gptqmodel")
    quantize_file = out / "quantize_config.json"
    payload = json.loads(quantize_file.read_text())
    payload["gsq"]["steps"] = 3
    quantize_file.write_text(json.dumps(payload))
    with pytest.raises(CheckpointError, match="quantize_config.json"):
        floatxq.load(out)
    payload["gsq"]["bogus"] = 1
    quantize_file.write_text(json.dumps(payload))
    with pytest.raises(CheckpointError, match=r"gsq\.bogus"):
        floatxq.load(out)


def test_default_layout_records_gsq_for_floatxq(refined, tmp_path):
    config, model = refined
    out = model.save(tmp_path / "ct")  # compressed-tensors
    payload = json.loads((out / "config.json").read_text())["quantization_config"]
    assert payload["quant_method"] == "compressed-tensors"
    assert payload["floatxq"] == fp8_gsq_record(config)
    assert payload["floatxq"]["gsq"]["modules"] == [r".*mlp\."]
    ct.quantization.QuantizationConfig.model_validate(payload)  # the extra key is ignored
    loaded = floatxq.load(out)
    assert loaded.quantize_config == config
    mine, theirs = _codes(model.model), _codes(loaded.model)
    assert mine.keys() == theirs.keys() and all(torch.equal(mine[n], theirs[n]) for n in mine)
    again = loaded.save(tmp_path / "again")
    assert json.loads((again / "config.json").read_text())["quantization_config"] == payload


def test_without_gsq_compressed_tensors_payload_has_no_floatxq_key(tmp_path):
    model = floatxq.load(FIXTURE, quantize_config=FP8Config()).quantize(progress=False)
    out = model.save(tmp_path / "ct")
    assert "floatxq" not in json.loads((out / "config.json").read_text())["quantization_config"]
    assert floatxq.load(out).quantize_config == FP8Config()


def _edit_record(out: Path, change) -> None:
    config_file = out / "config.json"
    data = json.loads(config_file.read_text())
    change(data["quantization_config"])
    config_file.write_text(json.dumps(data))


@pytest.mark.parametrize(
    "change, match",
    [
        (lambda q: q["floatxq"]["gsq"].update(bogus=1), r"floatxq: gsq\.bogus: not a GSQConfig"),
        (lambda q: q["floatxq"]["gsq"].update(steps=0), r"floatxq: gsq\.steps: got 0"),
        (lambda q: q["floatxq"].update(extra=1), r"floatxq: unsupported field\(s\) 'extra'"),
        (lambda q: q.update(floatxq=[1]), r"floatxq: expected an object with 'gsq'"),
        (
            lambda q: q["floatxq"].update(gsq_calibration="no"),
            "floatxq: gsq_calibration: expected a bool",
        ),
        (
            lambda q: q["floatxq"].update(gsq=None, gsq_calibration=True),
            "floatxq: gsq_calibration=True.*GSQ is off",
        ),
    ],
)
def test_a_damaged_record_is_refused_naming_it(refined, tmp_path, change, match):
    _, model = refined
    out = model.save(tmp_path / "ct")
    _edit_record(out, change)
    with pytest.raises(CheckpointError, match=r"config\.json quantization_config\." + match):
        floatxq.load(out)


def test_a_record_the_modules_contradict_is_refused(tmp_path):
    config = FP8Config(weight_scale_method="tensor", gsq=GSQConfig(steps=1))
    out = (
        floatxq.load(FIXTURE, quantize_config=config).quantize(progress=False).save(tmp_path / "t")
    )
    assert floatxq.load(out).quantize_config == config
    _edit_record(out, lambda q: q["floatxq"].update(gsq_calibration=True))
    with pytest.raises(CheckpointError, match="needs weight_scale_method 'row' or 'block'"):
        floatxq.load(out)
