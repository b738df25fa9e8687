"""Every activation policy end to end through the public API, on the embedded tiny Llama (CPU):
activation-aware GPTQ, the W4A modules and stream it leaves, save, load, and the same logits.

The model is the trained tiny Llama cut to its first two decoder layers (FP32) so each policy
quantizes in seconds; calibration is four 64-token samples.
"""

import copy

import pytest
import torch

import floatxq
from floatxq.config import BACKEND, GPTQConfig
from floatxq.lifecycle.evaluate import evaluate_lm
from floatxq.nn.w4a_fp8_linear import W4AFP8Linear
from floatxq.nn.w4a_nvfp4_linear import W4ANVFP4Linear

pytest.importorskip("transformers")

NVFP4_RECIPES = (
    "nvidia",
    "four_six",
    "least_squares",
    "least_squares_grid",
    "exhaustive",
    "nvidia_headroom",
    "least_squares_headroom",
)
POLICIES = {
    "w4afp8": "w4afp8",
    **{f"nvfp4-{r}": {"mode": "w4a_nvfp4", "recipe": r} for r in NVFP4_RECIPES},
    "split": {"mode": "w4a_nvfp4", "attention": {"mode": "w4afp8"}},
    "mlp-promoted": {
        "mode": "w4a_nvfp4",
        "recipe": "nvidia",
        "mlp": {"mode": "w4afp8", "layers": [1]},
    },
    "nvfp4-attention-recipe": {
        "mode": "w4a_nvfp4",
        "recipe": "least_squares",
        "attention": {"mode": "w4a_nvfp4", "recipe": "four_six"},
    },
}


@pytest.fixture(scope="module")
def reference():
    from floatxq.tiny import load_tiny_llama

    model = load_tiny_llama(dtype=torch.float32)
    model.model.layers = model.model.layers[:2]
    model.config.num_hidden_layers = 2
    return model.eval()


@pytest.fixture(scope="module")
def samples():
    from floatxq.tiny import calibration_samples

    return calibration_samples(num_samples=4, seq_len=64)


@pytest.fixture(scope="module")
def windows():
    from floatxq.tiny import token_windows

    return token_windows("evaluation", seq_len=64, max_windows=4)


@pytest.mark.parametrize("name", list(POLICIES))
def test_every_policy_quantizes_saves_reloads_and_runs(name, reference, samples, windows, tmp_path):
    from floatxq.lifecycle.stream import installed_w4a_stream

    config = GPTQConfig(activation=POLICIES[name])
    qm = floatxq.load(copy.deepcopy(reference), quantize_config=config)
    qm.quantize(samples, batch_size=2, progress=False)
    nvfp4 = config.activation.mode == "w4a_nvfp4"
    assert qm.backend == (BACKEND.GPTQ_W4A_NVFP4 if nvfp4 else BACKEND.GPTQ_W4AFP8)
    kind = W4ANVFP4Linear if nvfp4 else W4AFP8Linear
    projections = [m for n, m in qm.model.named_modules() if n.endswith("_proj")]
    assert len(projections) == 14 and all(type(m) is kind for m in projections)
    policy = installed_w4a_stream(qm.model)
    assert policy is not None and policy.mode == config.activation.mode
    scales = qm.report.activation_scales
    assert set(scales) == {n for n, _ in qm.model.named_modules() if n.endswith("_proj")}
    for module, value in scales.items():  # positive on NVFP4 lanes, 0.0 (none) on FP8 ones
        layer = int(module.split(".")[2])
        if ".mlp." in module:
            lane_nvfp4 = nvfp4 and layer not in (
                config.activation.mlp.layers if config.activation.mlp else ()
            )
        else:
            attention = config.activation.attention
            lane_nvfp4 = nvfp4 and (attention is None or attention.mode == "w4a_nvfp4")
        assert (value > 0) == lane_nvfp4, (module, value)

    ids = windows[:2]
    with torch.no_grad():
        logits = qm.model(ids).logits
    assert torch.isfinite(logits).all()
    report = evaluate_lm(qm.model, windows, reference=reference)
    assert report.top1_agreement > 0.5  # a working model, not noise

    loaded = floatxq.load(qm.save(tmp_path / name))
    assert loaded.backend == qm.backend and loaded.quantize_config == config
    assert installed_w4a_stream(loaded.model) == policy
    for n, m in qm.model.named_modules():
        if isinstance(m, W4ANVFP4Linear):
            twin = loaded.model.get_submodule(n)
            assert torch.equal(twin.activation_global_scale_bits, m.activation_global_scale_bits)
            assert twin.activation_recipe == m.activation_recipe
    with torch.no_grad():
        assert torch.equal(loaded.model(ids).logits, logits)


def test_a_model_that_is_not_a_llama_is_refused_before_any_work(samples):
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(
        GPT2Config(n_embd=128, n_layer=1, n_head=2, vocab_size=256, n_positions=128)
    ).eval()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    qm = floatxq.load(model, quantize_config=GPTQConfig(activation="w4afp8"))
    with pytest.raises(ValueError, match="Llama"):
        qm.quantize(samples, progress=False)
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())
    assert not qm.quantized
