"""``QuantizedModel.calibrate_activations``: NVFP4 producer scales from sample text, the report,
saving and reloading them bit for bit, and complete rollback on failure.

The model is the embedded tiny Llama (8 layers, FP32) with round-to-nearest GPTQ weights turned
into W4A-NVFP4 modules and the stream installed, as the lifecycle leaves a W4A model.
"""

import copy
import dataclasses

import pytest
import torch

import floatxq
from floatxq.config import ActivationConfig, GPTQConfig
from floatxq.nvfp4.quantize import nvfp4_global_scale
from floatxq.testing import production_checks

pytest.importorskip("transformers")

from tests.test_w4a_checkpoints import _logits, _w4a_model

LAYERS = 8
SAMPLES = [
    torch.arange(5, 45) % 256,
    torch.tensor([3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7]),
    (torch.arange(0, 90) * 7) % 256,
]
TOKENS = sum(int(s.numel()) for s in SAMPLES)


def _all_keys() -> list[str]:
    keys = ["model.layers.0.input"]
    for i in range(LAYERS):
        keys += [
            f"model.layers.{i}.self_attn.o_proj.input",
            f"model.layers.{i}.post_attention_residual",
            f"model.layers.{i}.mlp.down_proj.input",
            f"model.layers.{i}.output",
        ]
    return keys


def _state(qm) -> dict:
    """Everything calibration may change, copied."""
    from floatxq.lifecycle.stream import installed_w4a_stream, stream_boundary_quantizers

    quantizers = stream_boundary_quantizers(qm.model)
    return {
        "bits": {k: q.scale_bits.clone() for k, q in quantizers.items()},
        "calibrated": {k: q.calibrated for k, q in quantizers.items()},
        "policy": installed_w4a_stream(qm.model),
        "config": qm.quantize_config,
        "hf": copy.deepcopy(getattr(qm.model.config, "quantization_config", None)),
    }


def _same(a: dict, b: dict) -> bool:
    return (
        a["bits"].keys() == b["bits"].keys()
        and all(torch.equal(a["bits"][k], b["bits"][k]) for k in a["bits"])
        and a["calibrated"] == b["calibrated"]
        and a["policy"] == b["policy"]
        and a["config"] == b["config"]
        and a["hf"] == b["hf"]
    )


@pytest.fixture(scope="module")
def calibrated():
    qm = _w4a_model(ActivationConfig(mode="w4a_nvfp4", recipe="least_squares"))
    before = _logits(qm.model)
    seen = []
    report = qm.calibrate_activations(SAMPLES, progress=lambda key, row: seen.append((key, row)))
    return qm, report, seen, before


def test_the_report_names_every_producer_with_its_counts(calibrated):
    qm, report, seen, _ = calibrated
    assert report["algorithm"] == "producer_maximum"
    assert report["recipe"] == "least_squares"
    assert report["upstream_activations"] == "calibrated_encoded_carriers"
    assert report["weight_updates"] == 0
    assert list(report["boundaries"]) == _all_keys() == list(report["global_scales"])
    assert [key for key, _ in seen] == _all_keys()
    for key, row in report["boundaries"].items():
        assert set(row) == {"recipe", "amax", "global_scale", "tokens", "samples"}
        assert row["tokens"] == TOKENS and row["samples"] == len(SAMPLES)
        assert row["recipe"] == "least_squares" and row["amax"] > 0
        want = float(nvfp4_global_scale(row["amax"], recipe="least_squares"))
        assert row["global_scale"] == report["global_scales"][key] == want
    # the first producer is the embedding output: its maximum is known without the stream
    with torch.no_grad():
        embedded = [qm.model.model.embed_tokens(s[None]) for s in SAMPLES]
    amax = max(float(e.abs().max()) for e in embedded)
    assert report["boundaries"]["model.layers.0.input"]["amax"] == amax


def test_the_scales_reach_the_stream_and_the_config(calibrated):
    from floatxq.lifecycle.stream import installed_w4a_stream, stream_boundary_quantizers

    qm, report, _, before = calibrated
    scales = report["global_scales"]
    assert dict(qm.quantize_config.activation.global_scales) == scales
    assert dict(installed_w4a_stream(qm.model).global_scales) == scales
    for key, quantizer in stream_boundary_quantizers(qm.model).items():
        assert quantizer.calibrated
        assert quantizer.scale_bits.view(torch.float32).item() == scales[key]
    assert not torch.equal(_logits(qm.model), before)  # static scales change the codes


def test_calibrated_scales_save_and_reload_bit_for_bit(calibrated, tmp_path):
    from floatxq.lifecycle.stream import stream_boundary_quantizers

    qm, _, _, _ = calibrated
    loaded = floatxq.load(qm.save(tmp_path / "calibrated"))
    assert loaded.quantize_config == qm.quantize_config
    ours, theirs = stream_boundary_quantizers(qm.model), stream_boundary_quantizers(loaded.model)
    assert list(ours) == list(theirs)
    for key in ours:
        assert torch.equal(ours[key].scale_bits, theirs[key].scale_bits), key
        assert theirs[key].calibrated
    assert torch.equal(_logits(loaded.model), _logits(qm.model))


def test_the_split_calibrates_only_its_nvfp4_producers():
    policy = ActivationConfig(mode="w4a_nvfp4", attention={"mode": "w4afp8"})
    qm = _w4a_model(policy)
    report = qm.calibrate_activations(SAMPLES[:1])
    keys = []
    for i in range(LAYERS):
        keys += [
            f"model.layers.{i}.post_attention_residual",
            f"model.layers.{i}.mlp.down_proj.input",
        ]
    assert list(report["boundaries"]) == keys
    assert all(row["tokens"] == SAMPLES[0].numel() for row in report["boundaries"].values())


class _Boom(Exception):
    pass


def test_a_failure_midway_restores_everything():
    qm = _w4a_model(ActivationConfig(mode="w4a_nvfp4", recipe="nvidia"))
    qm.calibrate_activations(SAMPLES[1:2])  # start from calibrated scales: restore must keep them
    before, logits = _state(qm), _logits(qm.model)
    count = {"n": 0}

    def progress(key, row):
        count["n"] += 1
        if count["n"] == 11:  # layer 2's scales are set by now, layer 2 half done
            raise _Boom(key)

    with pytest.raises(_Boom):
        qm.calibrate_activations(SAMPLES, progress=progress)
    assert _same(_state(qm), before)
    assert torch.equal(_logits(qm.model), logits)

    layer = qm.model.model.layers[5]
    original = layer.forward

    def broken(*args, **kwargs):
        raise _Boom("layer 5")

    layer.forward = broken
    try:
        with pytest.raises(_Boom, match="layer 5"):
            qm.calibrate_activations(SAMPLES)
    finally:
        layer.forward = original
    assert _same(_state(qm), before)
    assert torch.equal(_logits(qm.model), logits)


def test_an_uncalibrated_model_is_restored_to_dynamic_scales():
    qm = _w4a_model(ActivationConfig(mode="w4a_nvfp4"))
    before = _state(qm)
    assert (
        not any(before["calibrated"].values()) and before["config"].activation.global_scales is None
    )

    def progress(key, row):
        if key.startswith("model.layers.1."):
            raise _Boom(key)

    with pytest.raises(_Boom, match="model.layers.1.self_attn.o_proj.input"):
        qm.calibrate_activations(SAMPLES, progress=progress)
    assert _same(_state(qm), before)
    with pytest.raises(TypeError, match=r"samples\[1\] must hold integer token ids"):
        qm.calibrate_activations([SAMPLES[0], SAMPLES[0].float()])
    assert _same(_state(qm), before)


@pytest.fixture(scope="module")
def nvfp4_model():
    return _w4a_model(ActivationConfig(mode="w4a_nvfp4"))


@pytest.mark.parametrize(
    ("samples", "error", "match"),
    [
        ([], ValueError, "samples is empty"),
        (SAMPLES[0], TypeError, "samples must be a list of 1-D token-id tensors"),
        ([SAMPLES[0][None]], ValueError, r"samples\[0\] must be one unpadded 1-D sequence"),
        ([torch.zeros(0, dtype=torch.long)], ValueError, r"samples\[0\] must be one unpadded"),
        ([[1, 2, 3]], TypeError, r"samples\[0\] must be a torch.Tensor"),
        ([torch.tensor([1, 256])], ValueError, r"outside the vocabulary \[0, 256\)"),
        ([torch.tensor([-1, 2])], ValueError, "outside the vocabulary"),
    ],
)
def test_bad_samples_are_refused(nvfp4_model, samples, error, match):
    before = _state(nvfp4_model)
    with production_checks(), pytest.raises(error, match=match):  # ill-typed on purpose
        nvfp4_model.calibrate_activations(samples)
    assert _same(_state(nvfp4_model), before)


def test_models_that_cannot_be_calibrated_are_refused(nvfp4_model):
    with pytest.raises(RuntimeError, match="the installed stream is 'w4afp8'"):
        _w4a_model(ActivationConfig(mode="w4afp8")).calibrate_activations(SAMPLES)
    for recipe in ("nvidia_headroom", "exhaustive"):
        qm = _w4a_model(ActivationConfig(mode="w4a_nvfp4", recipe=recipe))
        with pytest.raises(ValueError, match=f"recipe '{recipe}' does not take calibrated"):
            qm.calibrate_activations(SAMPLES)
    nvfp4_model.model.train()
    try:
        with pytest.raises(RuntimeError, match="training mode"):
            nvfp4_model.calibrate_activations(SAMPLES)
    finally:
        nvfp4_model.model.eval()
    plain = floatxq.load(copy.deepcopy(nvfp4_model.model), quantize_config=GPTQConfig())
    with pytest.raises(RuntimeError, match="quantize"):
        plain.calibrate_activations(SAMPLES)
    saved = nvfp4_model.quantize_config
    nvfp4_model.quantize_config = dataclasses.replace(
        saved, activation=ActivationConfig(mode="w4a_nvfp4", recipe="nvidia")
    )
    try:
        with pytest.raises(RuntimeError, match="differs from the model's saved activation policy"):
            nvfp4_model.calibrate_activations(SAMPLES)
    finally:
        nvfp4_model.quantize_config = saved


def test_a_model_with_a_calibrated_stream_deep_copies_into_an_independent_one(calibrated):
    from floatxq.lifecycle.stream import installed_w4a_stream, stream_boundary_quantizers

    qm, report, _, _ = calibrated
    twin = copy.deepcopy(qm.model)
    assert installed_w4a_stream(twin) == installed_w4a_stream(qm.model)
    assert torch.equal(_logits(twin), _logits(qm.model))
    key = next(iter(report["global_scales"]))
    stream_boundary_quantizers(twin)[key].set_scale(123.0)  # the copy's own quantizers
    assert stream_boundary_quantizers(qm.model)[key].scale == report["global_scales"][key]
    before = _logits(qm.model)
    with torch.no_grad():  # the copy's streamed layers run the copy's own modules
        twin.model.layers[0].mlp.down_proj.scales.zero_()
    assert not torch.equal(_logits(twin), before)
    assert torch.equal(_logits(qm.model), before)
