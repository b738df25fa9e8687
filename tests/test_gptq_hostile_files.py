"""Damaged and contradictory GPTQ checkpoints refuse to load, naming the file, tensor or field.

Each case starts from a good producer-written checkpoint (GPT-QModel's ``gptq`` files,
llm-compressor's ``pack-quantized`` files, both in ``tests/fixtures``) and changes one thing.
Every case would otherwise load and compute a different model, or end in a raw error.
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
from floatxq.nn.gptq_linear import GPTQLinear

FIXTURES = Path(__file__).parent / "fixtures"
DESC_ACT = FIXTURES / "gptqmodel_gptq_desc_act"  # 4-bit, group 64, asymmetric, desc_act
DYNAMIC = FIXTURES / "gptqmodel_gptq_dynamic"  # 4-bit g32 sym; down_proj 8-bit g64; o_proj dense
PACKED = FIXTURES / "llmcompressor_w4a16_asym_g64"  # compressed-tensors pack-quantized
DOWN = "model.layers.1.mlp.down_proj"  # in=192, out=128
FILES = ("config.json", "quantize_config.json", "model.safetensors")


def _copy(source: Path, target: Path) -> Path:
    target.mkdir()
    for name in FILES:
        if (source / name).is_file():
            shutil.copyfile(source / name, target / name)
    return target


@pytest.fixture
def gptq(tmp_path) -> Path:
    return _copy(DESC_ACT, tmp_path / "gptq")


@pytest.fixture
def packed(tmp_path) -> Path:
    return _copy(PACKED, tmp_path / "packed")


def _edit_tensors(path: Path, change) -> None:
    file = path / "model.safetensors"
    with safe_open(str(file), "pt") as reader:
        metadata = reader.metadata()
    state = load_file(str(file))
    change(state)
    save_file(state, str(file), metadata=metadata)


def _edit_payloads(path: Path, change, *, files=("config.json", "quantize_config.json")) -> None:
    """Apply ``change`` to config.json's quantization_config and quantize_config.json alike."""
    for name in files:
        if not (path / name).is_file():
            continue
        payload = json.loads((path / name).read_text())
        change(payload["quantization_config"] if name == "config.json" else payload)
        (path / name).write_text(json.dumps(payload))


def _refused(path: Path, match: str) -> None:
    with pytest.raises(CheckpointError, match=match):
        floatxq.load(path)


def test_the_good_checkpoints_load(gptq, packed, tmp_path):
    for path in (gptq, packed, _copy(DYNAMIC, tmp_path / "dynamic")):
        model = floatxq.load(path)
        assert model.quantized_modules
        assert all(
            isinstance(model.model.get_submodule(n), GPTQLinear) for n in model.quantized_modules
        )


# ----------------------------------------------------------------------------------------------
# quant_method gptq: tensors
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("key", ["qweight", "qzeros", "scales", "g_idx"])
def test_a_missing_tensor_is_named(gptq, key):
    _edit_tensors(gptq, lambda s: s.pop(f"{DOWN}.{key}"))
    _refused(gptq, rf"lacks {DOWN}\.{key}")


@pytest.mark.parametrize("extra", ["weight", "weight_scale", "g_idx_perm"])
def test_an_extra_tensor_is_named(gptq, extra):
    _edit_tensors(gptq, lambda s: s.__setitem__(f"{DOWN}.{extra}", torch.zeros(3)))
    _refused(gptq, rf"does not know for this layout: {DOWN}\.{extra}")


@pytest.mark.parametrize(
    "key, stored, match",
    [
        ("qweight", lambda t: t.view(torch.float32), "int32"),
        ("qweight", lambda t: t.to(torch.int64), "int32"),
        ("qzeros", lambda t: t.view(torch.float32), "int32"),
        ("g_idx", lambda t: t.to(torch.float32), "int32"),
        ("scales", lambda t: t.view(torch.int16), "floating"),
    ],
    ids=["qweight-f32", "qweight-i64", "qzeros-f32", "g_idx-f32", "scales-i16"],
)
def test_tensors_of_the_wrong_dtype_are_named(gptq, key, stored, match):
    name = f"{DOWN}.{key}"
    _edit_tensors(gptq, lambda s: s.__setitem__(name, stored(s[name])))
    _refused(gptq, rf"{name}.*has dtype .*{match}")


def test_qweight_rows_inconsistent_with_bits_are_named(gptq):
    # 8-bit words for the same weight: twice the rows the declared 4 bits give
    name = f"{DOWN}.qweight"
    _edit_tensors(gptq, lambda s: s.__setitem__(name, torch.cat([s[name], s[name]])))
    _refused(gptq, rf"{name} .* shape \(48, 128\) \(its 48 rows are 8-bit\).*bits=4")


@pytest.mark.parametrize(
    "key, shape", [("scales", (4, 128)), ("qzeros", (3, 8)), ("g_idx", (128,))]
)
def test_mis_shaped_tensors_are_named(gptq, key, shape):
    name = f"{DOWN}.{key}"

    def reshape(state):
        t = state[name]
        state[name] = torch.zeros(shape, dtype=t.dtype)

    _edit_tensors(gptq, reshape)
    _refused(
        gptq, rf"{name} in .* has shape {tuple(shape)}".replace("(", r"\(").replace(")", r"\)")
    )


@pytest.mark.parametrize("bad", [3, -1])
def test_a_g_idx_out_of_range_is_named(gptq, bad):
    name = f"{DOWN}.g_idx"
    _edit_tensors(gptq, lambda s: s[name].__setitem__(17, bad))
    _refused(gptq, rf"{name} .* outside \[0, 2\]")


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_scales_are_named(gptq, bad):
    name = f"{DOWN}.scales"
    _edit_tensors(gptq, lambda s: s[name].__setitem__((1, 5), bad))
    _refused(gptq, rf"{name} .* NaN or infinite")


def test_a_non_finite_bias_is_named(gptq):
    name = f"{DOWN}.bias"
    _edit_tensors(gptq, lambda s: s.__setitem__(name, torch.full((128,), float("nan")).half()))
    _refused(gptq, rf"{name} .* NaN or infinity")


# ----------------------------------------------------------------------------------------------
# quant_method gptq: the config against the tensors, and the two config files
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "field, value, match",
    [
        ("bits", 8, r"qweight .* bits=8"),
        ("bits", 2, r"qweight .* bits=2"),
        ("group_size", 32, r"scales .* has shape \(3, 128\); the config's group_size=32"),
        ("group_size", -1, r"scales .* has shape \(3, 128\); the config's group_size=-1"),
        ("desc_act", False, r"g_idx .* reorders the groups, but the config declares desc_act"),
        ("sym", True, r"qzeros .* zero points other than 8, but the config declares sym"),
    ],
)
def test_a_config_that_contradicts_the_tensors_is_refused(gptq, field, value, match):
    _edit_payloads(gptq, lambda p: p.__setitem__(field, value))
    _refused(gptq, match)


def test_quantize_config_json_disagreeing_with_config_json_is_refused(gptq):
    _edit_payloads(gptq, lambda p: p.__setitem__("group_size", 32), files=("quantize_config.json",))
    for call in (floatxq.load, inspect_checkpoint):
        with pytest.raises(
            CheckpointError, match=r"describe different GPTQ .*group_size: 32 vs 64"
        ):
            call(gptq)


def test_quantize_config_json_of_another_method_is_refused(gptq):
    fp8 = json.loads((FIXTURES / "gptqmodel_fp8_row" / "quantize_config.json").read_text())
    (gptq / "quantize_config.json").write_text(json.dumps(fp8))
    _refused(gptq, r"quantize_config\.json declares method 'fp8' .* contradict")


def test_gptq_tensors_of_an_excluded_module_are_refused(gptq):
    _edit_payloads(gptq, lambda p: p.__setitem__("dynamic", {r"-:.*layers\.1\.mlp\.down_proj": {}}))
    _refused(gptq, rf"{DOWN} in .* holds GPTQ tensors, but the quantization config excludes")


def test_a_dense_module_the_config_quantizes_stays_dense(tmp_path):
    # GPT-QModel excluded o_proj with a '-:' rule; without the rule the tensors still decide
    path = _copy(DYNAMIC, tmp_path / "m")
    _edit_payloads(path, lambda p: p["dynamic"].pop("-:.*o_proj"))
    model = floatxq.load(path)
    assert type(model.model.get_submodule("model.layers.0.self_attn.o_proj")) is torch.nn.Linear


def test_dynamic_rules_that_contradict_the_tensors_are_refused(tmp_path):
    path = _copy(DYNAMIC, tmp_path / "m")
    _edit_payloads(path, lambda p: p["dynamic"].__setitem__("+:.*down_proj", {"bits": 4}))
    _refused(path, r"down_proj\.qweight .* bits=4")


@pytest.mark.parametrize(
    "change, match",
    [
        (lambda p: p.__setitem__("checkpoint_format", "marlin"), r"checkpoint_format"),
        (lambda p: p.__setitem__("is_marlin_format", True), r"is_marlin_format=True"),
        (lambda p: p.__setitem__("weight_block_size", [64, 64]), r"'weight_block_size'"),
        (lambda p: p.__setitem__("rotation", "hadamard"), r"rotation"),
        (lambda p: p.__setitem__("pack_dtype", "int16"), r"pack_dtype"),
    ],
    ids=["marlin-format", "is-marlin", "unknown-key", "rotation", "pack-dtype"],
)
def test_payloads_floatxq_does_not_read_are_refused(gptq, change, match):
    _edit_payloads(gptq, change)
    for call in (floatxq.load, inspect_checkpoint):
        with pytest.raises(CheckpointError, match=rf"config\.json .*{match}"):
            call(gptq)


def test_transformers_calibration_keys_in_config_json_are_read(gptq):
    # what transformers' / optimum's GPTQConfig writes beside GPT-QModel's payload
    keys = {"true_sequential": True, "use_exllama": False, "model_seqlen": 2048,
            "tokenizer": None, "dataset": "c4", "batch_size": 1, "backend": "auto",
            "cache_block_outputs": True, "damp_percent": 0.05}  # fmt: skip
    _edit_payloads(gptq, lambda p: p.update(keys), files=("config.json",))
    (gptq / "quantize_config.json").unlink()
    assert floatxq.load(gptq).quantize_config.desc_act


# ----------------------------------------------------------------------------------------------
# compressed-tensors pack-quantized
# ----------------------------------------------------------------------------------------------

P_DOWN = "model.layers.0.mlp.down_proj"


def _edit_ct_weights(path: Path, change) -> None:
    def edit(payload):
        change(payload["config_groups"]["group_0"]["weights"])

    _edit_payloads(path, edit, files=("config.json",))


@pytest.mark.parametrize(
    "key, value, match",
    [
        ("weight_shape", torch.tensor([128, 128]), r"weight_shape .* is \[128, 128\]"),
        ("weight_shape", torch.tensor([128.0, 192.0]), r"weight_shape .* dtype torch.float32"),
        ("weight_packed", torch.zeros(128, 18, dtype=torch.int32), r"weight_packed .* \(128, 18\)"),
        ("weight_zero_point", torch.zeros(3, 16, dtype=torch.int32), r"zero_point .* \(3, 16\)"),
        ("weight_scale", torch.ones(128, 5), r"weight_scale .* \(128, 5\); expected"),
        ("weight_g_idx", torch.zeros(192, dtype=torch.int32), r"does not know.*weight_g_idx"),
        ("input_scale", torch.ones(1), r"activation-quantization scales"),
    ],
    ids=[
        "shape",
        "shape-dtype",
        "packed-3bit",
        "zp-shape",
        "scale-groups",
        "g_idx",
        "input-scale",
    ],
)
def test_pack_quantized_tensors_that_do_not_fit_are_named(packed, key, value, match):
    _edit_tensors(packed, lambda s: s.__setitem__(f"{P_DOWN}.{key}", value))
    _refused(packed, match)


def test_pack_quantized_weights_of_the_wrong_dtype_are_read_as_mx_and_refused(packed):
    # a float weight_packed is not the int32 INT layout; nothing reads it as GPTQ words
    name = f"{P_DOWN}.weight_packed"
    _edit_tensors(packed, lambda s: s.__setitem__(name, s[name].view(torch.float32)))
    with pytest.raises(CheckpointError):
        floatxq.load(packed)


def test_non_finite_pack_quantized_scales_are_named(packed):
    name = f"{P_DOWN}.weight_scale"
    _edit_tensors(packed, lambda s: s[name].__setitem__((0, 0), float("inf")))
    _refused(packed, rf"{name} .* NaN or infinite")


@pytest.mark.parametrize(
    "change, match",
    [
        (lambda w: w.__setitem__("symmetric", True), r"asymmetric \(weight_zero_point\)"),
        (lambda w: w.__setitem__("group_size", 32), r"4-bit, 3 group\(s\) of 64.*no pack-quant"),
        (lambda w: w.__setitem__("num_bits", 8), r"4-bit.*which no pack-quantized config group"),
        (lambda w: w.__setitem__("actorder", "group"), r"actorder 'group'"),
        (lambda w: w.__setitem__("type", "float"), r"static int weights"),
        (lambda w: w.__setitem__("dynamic", True), r"static int weights"),
    ],
    ids=["symmetric", "group_size", "num_bits", "actorder", "float", "dynamic"],
)
def test_pack_quantized_config_that_contradicts_the_tensors_is_refused(packed, change, match):
    _edit_ct_weights(packed, change)
    _refused(packed, match)


def test_pack_quantized_with_activation_quantization_is_refused(packed):
    def quantize_inputs(payload):
        group = payload["config_groups"]["group_0"]
        group["input_activations"] = {"num_bits": 8, "type": "int", "dynamic": True}

    _edit_payloads(packed, quantize_inputs, files=("config.json",))
    _refused(packed, r"quantizes activations; floatxq loads weight-only")


# ----------------------------------------------------------------------------------------------
# Generic damage, on a GPTQ checkpoint
# ----------------------------------------------------------------------------------------------


def test_a_truncated_shard_is_refused(gptq):
    file = gptq / "model.safetensors"
    file.write_bytes(file.read_bytes()[:-100])
    _refused(gptq, r"model\.safetensors is truncated")


def test_a_tensor_stored_in_two_shards_is_refused(gptq):
    state = load_file(str(gptq / "model.safetensors"))
    (gptq / "model.safetensors").unlink()
    one, two = "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"
    save_file(state, str(gptq / one), metadata={"format": "pt"})
    name = f"{DOWN}.qzeros"
    save_file({name: torch.zeros_like(state[name])}, str(gptq / two), metadata={"format": "pt"})
    weight_map = dict(dict.fromkeys(state, one), **{name: two})
    (gptq / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    _refused(gptq, rf"{name}' is stored twice")


def test_a_config_with_more_layers_than_the_tensors_is_refused(gptq):
    payload = json.loads((gptq / "config.json").read_text())
    payload["num_hidden_layers"] = 10**6
    (gptq / "config.json").write_text(json.dumps(payload))
    _refused(gptq, r"num_hidden_layers is 1000000 but the tensors hold 2 layers")


def test_gptq_tensors_without_a_declaration_are_refused(gptq):
    payload = json.loads((gptq / "config.json").read_text())
    del payload["quantization_config"]
    (gptq / "config.json").write_text(json.dumps(payload))
    (gptq / "quantize_config.json").unlink()
    for call in (floatxq.load, inspect_checkpoint):
        with pytest.raises(CheckpointError, match=r"no 'quantization_config'.*undeclared"):
            call(gptq)
