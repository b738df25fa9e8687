"""W4A checkpoints: an activation policy and its global scales saved with GPT-QModel's GPTQ files,
read back bit for bit, binding the policy's backend and installing the Llama stream.

The models are the embedded tiny Llama (8 layers, widths 256/768, FP32) with every decoder linear
replaced by a round-to-nearest GPTQ module (fast; the solve is not what is tested here), turned
into the policy's W4A modules the way the lifecycle does after a solve.
"""

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

import floatxq
from floatxq.config import BACKEND, ActivationConfig, GPTQConfig
from floatxq.gptq.solve import rtn_quantize
from floatxq.interop.checkpoint import CheckpointError
from floatxq.lifecycle.gptq import gptq_solve_options
from floatxq.lifecycle.model import QuantizedModel
from floatxq.lifecycle.w4a_install import install_activation_stream, install_w4a_modules
from floatxq.nn.gptq_linear import GPTQLinear
from floatxq.nn.w4a_fp8_linear import W4AFP8Linear
from floatxq.nn.w4a_nvfp4_linear import W4ANVFP4Linear

pytest.importorskip("transformers")

BITS = "activation_global_scale_bits"
IDS = torch.tensor([[10, 20, 30, 40, 50, 60, 70, 80, 90, 100, 110, 120, 7]])
NVFP4 = ActivationConfig(mode="w4a_nvfp4", recipe="nvidia")


def _rtn_gptq_llama() -> nn.Module:
    from floatxq.tiny import load_tiny_llama

    model = load_tiny_llama(dtype=torch.float32)
    options = gptq_solve_options(GPTQConfig())
    for name, module in list(model.named_modules()):
        if isinstance(module, nn.Linear) and name != "lm_head":
            solution = rtn_quantize(module.weight.detach().float(), options)
            model.set_submodule(name, GPTQLinear.from_solution(solution, bits=4, group_size=128))
    return model.eval()


def _w4a_model(activation: ActivationConfig, scales=None) -> QuantizedModel:
    """A quantized W4A model as the lifecycle leaves it: W4A modules, stream installed."""
    config = GPTQConfig(activation=activation)
    backend = floatxq.backend_for_activation(activation)
    model = _rtn_gptq_llama()
    install_w4a_modules(model, backend, activation=activation, scales=scales or {})
    install_activation_stream(model, activation)
    return QuantizedModel(model, quantize_config=config, backend=backend, quantized=True)


def _logits(model: nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model(IDS).logits


def _scales() -> dict[str, float]:
    """Distinct static scales for a few modules (the rest stay 0.0, dynamic)."""
    return {
        "model.layers.0.self_attn.q_proj": 0.0123,
        "model.layers.3.mlp.down_proj": 1.5,
        "model.layers.7.self_attn.o_proj": 2.0**-20,
    }


@pytest.fixture(scope="module")
def saved_nvfp4(tmp_path_factory) -> tuple[Path, QuantizedModel]:
    qm = _w4a_model(NVFP4, _scales())
    path = qm.save(tmp_path_factory.mktemp("w4a") / "nvfp4")
    return path, qm


def test_an_nvfp4_policy_and_its_scales_round_trip(saved_nvfp4):
    path, qm = saved_nvfp4
    stored = json.loads((path / "quantize_config.json").read_text())
    assert stored["activation"] == {"mode": "w4a_nvfp4", "recipe": "nvidia"}
    assert json.loads((path / "config.json").read_text())["quantization_config"] == stored
    tensors = load_file(path / "model.safetensors")
    bits = {k[: -len(BITS) - 1]: v for k, v in tensors.items() if k.endswith(BITS)}
    assert len(bits) == 8 * 7  # every decoder linear (the policy's modules), lm_head not
    for name, value in bits.items():
        assert value.dtype == torch.int32 and value.shape == ()
        want = torch.tensor(_scales().get(name, 0.0), dtype=torch.float32)
        assert value.view(torch.float32).item() == want.item()

    loaded = floatxq.load(path)
    assert loaded.backend == BACKEND.GPTQ_W4A_NVFP4
    assert loaded.quantize_config == qm.quantize_config
    for name, module in qm.model.named_modules():
        if isinstance(module, W4ANVFP4Linear):
            twin = loaded.model.get_submodule(name)
            assert type(twin) is W4ANVFP4Linear
            assert torch.equal(
                twin.activation_global_scale_bits, module.activation_global_scale_bits
            )
            assert twin.activation_recipe == "nvidia"
    from floatxq.lifecycle.stream import installed_w4a_stream

    assert installed_w4a_stream(loaded.model) == installed_w4a_stream(qm.model)
    assert torch.equal(_logits(loaded.model), _logits(qm.model))


def test_an_fp8_policy_writes_no_scales_and_loads_its_backend(tmp_path):
    qm = _w4a_model(ActivationConfig(mode="w4afp8"))
    path = qm.save(tmp_path / "fp8")
    assert not [k for k in load_file(path / "model.safetensors") if k.endswith(BITS)]
    loaded = floatxq.load(path)
    assert loaded.backend == BACKEND.GPTQ_W4AFP8
    kinds = {type(m) for n, m in loaded.model.named_modules() if n.endswith("_proj")}
    assert kinds == {W4AFP8Linear}
    assert torch.equal(_logits(loaded.model), _logits(qm.model))


def test_a_policy_binds_its_backend(saved_nvfp4):
    path, _ = saved_nvfp4
    assert floatxq.load(path, backend="gptq_w4a_nvfp4").backend == BACKEND.GPTQ_W4A_NVFP4
    for other in ("gptq_torch", "gptq_w4afp8"):
        with pytest.raises(ValueError, match=r"runs on backend 'gptq_w4a_nvfp4'; got backend="):
            floatxq.load(path, backend=other)
    with pytest.raises(ValueError, match="is not available in floatxq"):
        floatxq.load(path, backend="tensorrt")


def test_a_model_to_quantize_binds_the_policy_backend():
    model = nn.Sequential(nn.Linear(128, 128))
    config = GPTQConfig(activation="w4afp8")
    assert floatxq.load(model, quantize_config=config).backend == BACKEND.GPTQ_W4AFP8
    assert floatxq.load(model, quantize_config=config, backend="gptq_w4afp8").backend == (
        BACKEND.GPTQ_W4AFP8
    )
    with pytest.raises(ValueError, match="load: backend_for_activation: .* 'gptq_w4afp8'"):
        floatxq.load(model, quantize_config=config, backend="gptq_w4a_nvfp4")


@pytest.mark.parametrize("layout", ["compressed-tensors", "hf"])
def test_layouts_without_a_place_for_the_policy_refuse_it(saved_nvfp4, tmp_path, layout):
    _, qm = saved_nvfp4
    with pytest.raises(ValueError, match=f"layout '{layout}' holds weight-only GPTQ"):
        qm.save(tmp_path / "x", layout=layout)
    assert not (tmp_path / "x").exists()


def test_without_a_policy_a_calibrated_scale_is_refused(tmp_path):
    qm = _w4a_model(NVFP4, _scales())
    qm.quantize_config = GPTQConfig()
    with pytest.raises(ValueError, match="has no NVFP4 activation policy to save it with"):
        qm.save(tmp_path / "x", layout="gptq")


def test_stream_scales_are_module_buffers_that_the_files_leave_to_the_policy(tmp_path):
    from floatxq.lifecycle.stream import set_stream_global_scales, stream_boundary_quantizers

    qm = _w4a_model(NVFP4)
    keys = list(stream_boundary_quantizers(qm.model))
    scales = {key: 0.001 * (i + 1) for i, key in enumerate(keys)}
    set_stream_global_scales(qm.model, scales)  # the stream only: the config has none
    held = {k: v.clone() for k, v in qm.model.state_dict().items() if ".w4a_stream_scales." in k}
    assert len(held) == len(keys) == 5 + 4 * 7  # layer 0's input, then four per layer
    assert sorted(float(v.view(torch.float32)) for v in held.values()) == sorted(
        float(torch.tensor(v, dtype=torch.float32)) for v in scales.values()
    )
    with pytest.raises(ValueError, match=r"activation global_scales give it None"):
        qm.save(tmp_path / "x", layout="gptq")  # refused rather than dropped
    assert not (tmp_path / "x").exists()

    stored = {**NVFP4.to_dict(), "global_scales": scales}
    qm.quantize_config = GPTQConfig(activation=ActivationConfig.from_dict(stored))
    path = qm.save(tmp_path / "y")
    assert not any("w4a_stream_scales" in k for k in load_file(path / "model.safetensors"))
    loaded = floatxq.load(path)
    theirs = loaded.model.state_dict()
    assert all(torch.equal(theirs[k], v) for k, v in held.items())
    assert torch.equal(_logits(loaded.model), _logits(qm.model))

    fresh = _w4a_model(NVFP4)  # dynamic producers until the state dict arrives
    assert not any(q.calibrated for q in stream_boundary_quantizers(fresh.model).values())
    for name, holder in fresh.model.named_modules():  # the W4A modules' caches stay as they are
        if name.endswith(".w4a_stream_scales"):
            holder.load_state_dict({k[len(name) + 1 :]: v for k, v in held.items() if
                                    k.startswith(name + ".")})  # fmt: skip
    assert all(q.calibrated for q in stream_boundary_quantizers(fresh.model).values())
    assert torch.equal(_logits(fresh.model), _logits(qm.model))


def _rewrite(src: Path, dst: Path, *, tensors=None, config=None) -> Path:
    """A copy of checkpoint ``src`` at ``dst`` with its tensors / quantization payload edited."""
    import shutil

    shutil.copytree(src, dst)
    if tensors is not None:
        state = load_file(dst / "model.safetensors")
        tensors(state)
        save_file(state, dst / "model.safetensors", metadata={"format": "pt"})
    if config is not None:
        for name in ("config.json", "quantize_config.json"):
            data = json.loads((dst / name).read_text())
            target = data["quantization_config"] if name == "config.json" else data
            config(target)
            (dst / name).write_text(json.dumps(data))
    return dst


def _key(name: str = "model.layers.3.mlp.down_proj") -> str:
    return f"{name}.{BITS}"


def _drop_policy(q: dict) -> None:
    q.pop("activation")


def _fp8_policy(q: dict) -> None:
    q["activation"] = {"mode": "w4afp8"}


@pytest.mark.parametrize(
    ("edit", "match"),
    [
        (dict(config=_drop_policy), "declares no NVFP4 activation policy"),
        (dict(config=_fp8_policy), "declares no NVFP4 activation policy"),
        (
            dict(tensors=lambda s: s.__setitem__(_key(), s[_key()].view(torch.float32))),
            r"must be one int32 value \(an FP32 bit pattern\), got torch.float32",
        ),
        (
            dict(tensors=lambda s: s.__setitem__(_key(), s[_key()].reshape(1).repeat(2))),
            r"must be one int32 value .* \(2,\)",
        ),
        (
            dict(
                tensors=lambda s: s.__setitem__(
                    _key(), torch.tensor(float("nan")).view(torch.int32)
                )
            ),
            "holds nan; an activation global scale is 0.0",
        ),
        (
            dict(tensors=lambda s: s.__setitem__(_key(), torch.tensor(-1.0).view(torch.int32))),
            "holds -1.0",
        ),
        (
            dict(
                tensors=lambda s: s.__setitem__(_key("lm_head"), torch.tensor(0, dtype=torch.int32))
            ),
            "lm_head.activation_global_scale_bits belongs to no GPTQ module",
        ),
    ],
    ids=["no-policy", "fp8-policy", "float-bits", "two-values", "nan", "negative", "orphan"],
)
def test_damaged_activation_scales_are_refused(saved_nvfp4, tmp_path, edit, match):
    path, _ = saved_nvfp4
    damaged = _rewrite(path, tmp_path / "damaged", **edit)
    with pytest.raises(CheckpointError, match=match):
        floatxq.load(damaged)
