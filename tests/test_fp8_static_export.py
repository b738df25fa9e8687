"""Saving static FP8 (W8A8) modules: compressed-tensors (llm-compressor's ``FP8`` scheme),
transformers' ``activation_scheme: static`` (``hf``) and ModelOpt's ``FP8``; ``gptqmodel``, whose
payload declares no activation scheme, refuses them before anything is written. Each save loads
back bit for bit."""

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

import floatxq
from floatxq.fp8_activation import FP8InputQuant
from floatxq.interop.export import export_layout
from floatxq.nn.fp4_linear import TorchFP4Linear
from floatxq.nn.fp8_linear import TorchFP8Linear
from floatxq.testing import assert_bitwise_equal

CT_STATIC = Path(__file__).parent / "fixtures" / "llmcompressor_fp8_static"
IDS = torch.tensor([[1, 2, 3, 4, 5, 6, 7, 8]])


def _fp8_modules(model: nn.Module) -> dict[str, TorchFP8Linear]:
    return {n: m for n, m in model.named_modules() if isinstance(m, TorchFP8Linear)}


def _logits(model: nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model(IDS).logits


@pytest.fixture(scope="module")
def static_model():
    return floatxq.load(CT_STATIC, dtype=torch.float32)


@pytest.mark.parametrize("layout", ["compressed-tensors", "hf", "modelopt"])
def test_static_fp8_saves_and_reloads_bit_for_bit(static_model, tmp_path, layout):
    path = static_model.save(tmp_path / layout, layout=layout)
    files = load_file(str(path / "model.safetensors"))
    scale_name = "activation_scale" if layout == "hf" else "input_scale"
    shape = (1,) if layout == "compressed-tensors" else ()  # what each producer's readers expect
    reloaded = floatxq.load(path, dtype=torch.float32)
    theirs = _fp8_modules(reloaded.model)
    for name, module in _fp8_modules(static_model.model).items():
        stored = files[f"{name}.{scale_name}"]
        assert stored.dtype == torch.float32 and stored.shape == shape, name
        assert_bitwise_equal(stored.reshape(()), module.input_scale, msg=name)
        back = theirs[name]
        assert back.input_quant == FP8InputQuant("static"), name
        assert_bitwise_equal(back.input_scale, module.input_scale, msg=name)
        assert_bitwise_equal(back.weight, module.weight, msg=name)
        # the multiplying scale written is fl(1/scale_inv): exact back for these (each the
        # FP32 reciprocal of a bf16 scale llm-compressor wrote)
        assert_bitwise_equal(back.weight_scale_inv, module.weight_scale_inv, msg=name)
    assert_bitwise_equal(_logits(reloaded.model), _logits(static_model.model))
    assert floatxq.inspect_checkpoint(path).activations == "fp8 e4m3 static per tensor"


def test_compressed_tensors_declares_the_fp8_scheme(static_model, tmp_path):
    path = static_model.save(tmp_path / "ct", layout="compressed-tensors")
    qconfig = json.loads((path / "config.json").read_text())["quantization_config"]
    (group,) = qconfig["config_groups"].values()
    inputs = group["input_activations"]
    assert (inputs["dynamic"], inputs["strategy"], inputs["num_bits"], inputs["type"]) == (
        False,
        "tensor",
        8,
        "float",
    )


def test_transformers_runs_the_compressed_tensors_export_as_the_producer(static_model, tmp_path):
    """transformers (with compressed-tensors) reads floatxq's save of llm-compressor's fixture
    and computes the producer's own stored logits, bit for bit."""
    from transformers import AutoModelForCausalLM

    bf16 = floatxq.load(CT_STATIC)  # the model dtype the fixture declares (bf16)
    path = bf16.save(tmp_path / "ct", layout="compressed-tensors")
    model = AutoModelForCausalLM.from_pretrained(path)
    stored = load_file(str(CT_STATIC / "llmcompressor_logits.safetensors"))
    with torch.no_grad():
        theirs = model(stored["input_ids"]).logits.float()
    assert_bitwise_equal(theirs, stored["reloaded"])


def test_hf_and_modelopt_metadata(static_model, tmp_path):
    hf = static_model.save(tmp_path / "hf", layout="hf")
    assert (
        json.loads((hf / "config.json").read_text())["quantization_config"]["activation_scheme"]
        == "static"
    )
    modelopt = static_model.save(tmp_path / "mo", layout="modelopt")
    side = json.loads((modelopt / "hf_quant_config.json").read_text())["quantization"]
    assert side["quant_algo"] == "FP8" and "group_size" not in side
    embedded = json.loads((modelopt / "config.json").read_text())["quantization_config"]
    (group,) = embedded["config_groups"].values()
    assert group["input_activations"] == {"dynamic": False, "num_bits": 8, "type": "float"}


def _static(method: str = "tensor", scale: float = 0.01) -> TorchFP8Linear:
    return TorchFP8Linear.from_linear(
        nn.Linear(64, 32), weight_scale_method=method, input_quant="static", input_scale=scale
    )


def test_layouts_that_cannot_hold_static_modules_refuse_before_writing(static_model, tmp_path):
    with pytest.raises(ValueError, match=r"'gptqmodel' cannot hold module .*static FP8 "
                       r"activations.*declares no activation scheme.*'compressed-tensors', 'hf', "
                       r"'modelopt'$"):  # fmt: skip
        static_model.save(tmp_path / "g", layout="gptqmodel")
    assert not (tmp_path / "g").exists()
    row = nn.Sequential(_static("row"))
    with pytest.raises(ValueError, match=r"'modelopt' cannot hold module '0' .*row scales.*"
                       r"hold it: 'compressed-tensors'$"):  # fmt: skip
        export_layout(row, None, "modelopt")
    weight_only = TorchFP8Linear.from_linear(nn.Linear(32, 32), weight_scale_method="tensor")
    mixed = nn.Sequential(_static(), weight_only)
    with pytest.raises(ValueError, match=r"'hf' declares one activation_scheme.*module '1'"):
        export_layout(mixed, None, "hf")
    with_nvfp4 = nn.Sequential(_static(), TorchFP4Linear.from_linear(nn.Linear(32, 32)))
    with pytest.raises(ValueError, match=r"cannot hold module '1' \(quant_algo W4A16_NVFP4\).*"
                       r"FP8 modules \(e.g. '0'\).*MIXED_PRECISION"):  # fmt: skip
        export_layout(with_nvfp4, None, "modelopt")
    export_layout(mixed, None, "compressed-tensors")  # it holds the mix: one group per scheme


def test_a_changed_scale_is_not_written_where_it_would_load_otherwise(tmp_path):
    """The save checks each module loads back as it is, static scale included."""
    model = nn.Sequential(_static(scale=0.0123))
    out = export_layout(model, None, "compressed-tensors")
    assert_bitwise_equal(out.state["0.input_scale"], torch.tensor([0.0123]))
