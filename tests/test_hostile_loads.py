"""Damaged checkpoints refuse to load: each case is built from a good GPT-QModel-written one.

Every case used to load and compute wrong (or NaN) logits; each must now end in a
CheckpointError naming the file, tensor or field.
"""

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

import floatxq
from floatxq.lifecycle import CheckpointError, inspect_checkpoint

GOOD = Path(__file__).parent / "fixtures" / "gptqmodel_fp8_row"
UP = "model.layers.1.mlp.up_proj"


@pytest.fixture
def copy(tmp_path) -> Path:
    out = tmp_path / "ckpt"
    shutil.copytree(GOOD, out)
    return out


def _edit_tensors(path: Path, change) -> None:
    file = path / "model.safetensors"
    with safe_open(str(file), "pt") as reader:
        metadata = reader.metadata()
    state = load_file(str(file))
    change(state)
    save_file(state, str(file), metadata=metadata)


def _edit_json(path: Path, name: str, change) -> None:
    payload = json.loads((path / name).read_text())
    change(payload)
    (path / name).write_text(json.dumps(payload))


def test_the_good_checkpoint_loads(copy):
    floatxq.load(copy)


@pytest.mark.parametrize("which", ["one", "all"])
def test_missing_scales_are_refused(copy, which):
    def drop(state):
        for name in [n for n in state if n.endswith(".weight_scale_inv")]:
            if which == "all" or name.startswith(UP):
                del state[name]

    _edit_tensors(copy, drop)
    with pytest.raises(CheckpointError, match=r"weight_scale_inv"):
        floatxq.load(copy)


@pytest.mark.parametrize("bad", [float("nan"), 0.0, -3.0, float("inf")])
def test_bad_inverse_scale_values_are_named(copy, bad):
    name = f"{UP}.weight_scale_inv"
    _edit_tensors(copy, lambda s: s[name].__setitem__(5, bad))
    with pytest.raises(CheckpointError, match=name.replace(".", r"\.")):
        floatxq.load(copy)


@pytest.mark.parametrize(
    "stored",
    [
        lambda t: t.view(torch.int32),  # FP32 bytes relabelled I32
        lambda t: t.to(torch.float8_e4m3fn),  # scales stored as FP8
        lambda t: t.to(torch.bfloat16),  # GPT-QModel's inverse scales are FP32
    ],
    ids=["i32", "fp8", "bf16"],
)
def test_scales_of_the_wrong_dtype_are_refused(copy, stored):
    name = f"{UP}.weight_scale_inv"
    _edit_tensors(copy, lambda s: s.__setitem__(name, stored(s[name])))
    with pytest.raises(CheckpointError, match=name.replace(".", r"\.")):
        floatxq.load(copy)


def test_a_grid_that_tiles_the_weight_another_way_is_refused(copy):
    # up_proj is 192x128 with declared row scales; a (2, 64) grid tiles it as 96x2 blocks
    name = f"{UP}.weight_scale_inv"
    _edit_tensors(copy, lambda s: s.__setitem__(name, s[name].reshape(2, 96)[:, :64].clone()))
    with pytest.raises(CheckpointError, match=r"declares row scales"):
        floatxq.load(copy)


def test_nan_fp8_codes_are_refused(copy):
    name = f"{UP}.weight"

    def poison(state):
        codes = state[name].view(torch.uint8).clone()
        codes[3, 7] = 0x7F  # E4M3 NaN
        state[name] = codes.view(torch.float8_e4m3fn)

    _edit_tensors(copy, poison)
    with pytest.raises(CheckpointError, match=r"NaN/inf FP8 codes"):
        floatxq.load(copy)


def test_quantized_tensors_for_an_excluded_module_are_refused(copy):
    rule = {"-:.*up_proj": {}}
    for name in ("config.json", "quantize_config.json"):
        if name == "config.json":
            _edit_json(copy, name, lambda p: p["quantization_config"].__setitem__("dynamic", rule))
        else:
            _edit_json(copy, name, lambda p: p.__setitem__("dynamic", rule))
    with pytest.raises(CheckpointError, match="excludes the module"):
        floatxq.load(copy)


def test_quantize_config_that_disagrees_with_config_json_is_refused(copy):
    _edit_json(
        copy, "quantize_config.json", lambda p: p.__setitem__("weight_scale_method", "tensor")
    )
    with pytest.raises(CheckpointError, match="describe different FP8 configs"):
        floatxq.load(copy)


def test_a_config_with_more_layers_than_the_tensors_is_refused_before_building(copy):
    _edit_json(copy, "config.json", lambda p: p.__setitem__("num_hidden_layers", 10**6))
    with pytest.raises(CheckpointError, match=r"num_hidden_layers is 1000000 but the tensors"):
        floatxq.load(copy)


def test_tied_embeddings_that_would_discard_a_stored_lm_head_are_refused(copy):
    _edit_json(copy, "config.json", lambda p: p.__setitem__("tie_word_embeddings", True))
    with pytest.raises(CheckpointError, match="tie_word_embeddings"):
        floatxq.load(copy)


def test_load_and_inspect_decide_alike(copy):
    # transformers' multiplying convention in config.json, GPT-QModel's in quantize_config.json
    _edit_json(
        copy,
        "config.json",
        lambda p: p.__setitem__(
            "quantization_config",
            {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic"},
        ),
    )
    for call in (floatxq.load, inspect_checkpoint):
        with pytest.raises(CheckpointError, match="contradict"):
            call(copy)
