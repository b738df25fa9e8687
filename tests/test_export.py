"""Checkpoint layouts: exports that transformers and compressed-tensors load as floatxq decodes.

Each export is written with ``write_checkpoint`` and read back by transformers' own
``AutoModelForCausalLM.from_pretrained``; on CPU transformers decodes FP8 and compressed-tensors
files into dense weights, which are compared element by element with floatxq's decode, and the
loaded model's logits with a dense model holding floatxq's decoded weights.
"""

import json
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

import floatxq as fq
from floatxq.config import FP8Config, GSQConfig
from floatxq.fp8 import dequantize_fp8_weight, fp8_decode
from floatxq.interop.checkpoint import write_checkpoint
from floatxq.interop.export import (
    CHECKPOINT_LAYOUTS,
    DEFAULT_LAYOUT,
    GPTQMODEL_REFUSAL_MARKER,
    export_layout,
    normalize_layout,
)
from floatxq.interop.payload import fp8_config_to_payload
from floatxq.nn.fp8_linear import TorchFP8Linear
from floatxq.nvfp4.quantize import nvfp4_dequantize
from floatxq.testing import assert_bitwise_equal

transformers = pytest.importorskip("transformers")
ct = pytest.importorskip("compressed_tensors")
transformers.logging.set_verbosity_error()

BF16 = torch.bfloat16
IDS = torch.tensor([[1, 5, 9, 33, 64, 100, 7, 127, 0, 42]])


def _fp4_class():
    return pytest.importorskip("floatxq.nn.fp4_linear").TorchFP4Linear


def _llama(*, kv_heads: int = 2, bias: bool = False, seed: int = 0) -> nn.Module:
    """A random bf16 Llama: hidden 128, intermediate 256, 2 layers, vocab 128 (random biases)."""
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=kv_heads,
        vocab_size=128,
        max_position_embeddings=64,
        attention_bias=bias,
        tie_word_embeddings=False,
    )
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=BF16).eval()
    if bias:
        with torch.no_grad():
            for module in model.modules():
                if isinstance(module, nn.Linear) and module.bias is not None:
                    module.bias.normal_(0.0, 0.5)
    return model


def _quantized(config: FP8Config, **kwargs) -> nn.Module:
    return fq.load(_llama(**kwargs), quantize_config=config).quantize(progress=False).model


def _save(model: nn.Module, exported, path: Path) -> Path:
    config = {**model.config.to_dict(), "quantization_config": exported.quantization_config}
    return write_checkpoint(
        path, exported.state, config=config, quantize_config=exported.quantize_config
    )


def _load(path: Path, *, dequantize: bool = False) -> nn.Module:
    kwargs = {}
    if dequantize:
        kwargs["quantization_config"] = transformers.CompressedTensorsConfig(dequantize=True)
    if (
        json.loads((path / "config.json").read_text())["quantization_config"].get("quant_method")
        == "fp8"
    ):  # what transformers does on CPU by itself; with CUDA it would need `kernels`
        kwargs["quantization_config"] = transformers.FineGrainedFP8Config(dequantize=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = transformers.AutoModelForCausalLM.from_pretrained(path, **kwargs).eval()
        with torch.no_grad():
            model(IDS)  # compressed-tensors decompresses on the first forward
    return model


def _decoded(module: nn.Module) -> torch.Tensor:
    """floatxq's own decode of a quantized module, in bf16."""
    if isinstance(module, TorchFP8Linear):
        return dequantize_fp8_weight(module.weight, module.weight_scale_inv, dtype=BF16)
    return nvfp4_dequantize(module.weight, module.weight_scale, module.weight_scale_2, dtype=BF16)


def _quantized_modules(model: nn.Module) -> dict[str, nn.Module]:
    kinds = (TorchFP8Linear, _fp4_class())
    return {n: m for n, m in model.named_modules() if isinstance(m, kinds)}


_DEQUANTIZE_KEEPS_FP32_SCALES = tuple(
    int(part) for part in transformers.__version__.split(".")[:2]
) >= (5, 24)
"""transformers 5.17 (the H200's) rounds weight_scale to bf16 on the dequantize path as well."""


def _ulps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Distance in bf16 ulps between same-signed bf16 tensors (bit patterns are ordered)."""
    return (a.view(torch.int16).int() - b.view(torch.int16).int()).abs()


def _compare_weights(ours: nn.Module, loaded: nn.Module) -> tuple[int, int, int]:
    """(elements that differ, elements, largest difference in ulps) over the quantized linears;
    each loaded bias must equal floatxq's bias in bf16."""
    differ = total = worst = 0
    for name, module in _quantized_modules(ours).items():
        dense = loaded.get_submodule(name)
        assert dense.weight.dtype == BF16, name
        ulps = _ulps(dense.weight.detach(), _decoded(module))
        differ += int((ulps > 0).sum())
        total += ulps.numel()
        worst = max(worst, int(ulps.max()))
        if module.bias is not None:
            assert torch.equal(dense.bias.detach(), module.bias.to(BF16)), name
    assert total > 0
    return differ, total, worst


def _reference(ours: nn.Module) -> nn.Module:
    """A dense bf16 copy of the architecture holding floatxq's decoded weights and its other
    tensors."""
    dense = transformers.AutoModelForCausalLM.from_config(ours.config, dtype=BF16).eval()
    quantized = _quantized_modules(ours)
    source = ours.state_dict()
    state = {}
    for key in dense.state_dict():
        prefix, _, leaf = key.rpartition(".")
        if prefix in quantized:
            module = quantized[prefix]
            state[key] = _decoded(module) if leaf == "weight" else module.bias.to(BF16)
        else:
            state[key] = source[key]
    dense.load_state_dict(state)
    return dense


def _assert_logits_match(ours: nn.Module, loaded: nn.Module, rtol: float) -> None:
    with torch.no_grad():
        expected = _reference(ours)(IDS).logits.float()
        got = loaded(IDS).logits.float()
    error = float((got - expected).abs().max() / expected.abs().max())
    assert error <= rtol, error


# --------------------------------------------------------------------------------------------
# Names
# --------------------------------------------------------------------------------------------


def test_normalize_layout_names_aliases_and_refusals():
    assert CHECKPOINT_LAYOUTS == ("compressed-tensors", "hf", "gptqmodel", "gptq", "modelopt")
    assert DEFAULT_LAYOUT == "compressed-tensors"
    for value, canonical in [
        ("compressed-tensors", "compressed-tensors"),
        (" CT ", "compressed-tensors"),
        ("Compressed_Tensors", "compressed-tensors"),
        ("hf", "hf"),
        ("transformers", "hf"),
        ("DeepSeek", "hf"),
        ("GPTQModel", "gptqmodel"),
        ("NVIDIA-ModelOpt", "modelopt"),
    ]:
        assert normalize_layout(value) == canonical
    with pytest.raises(ValueError, match=r"'gptq-model'.*accepted: 'compressed-tensors'"):
        normalize_layout("gptq-model")
    with pytest.raises(TypeError, match="layout"):
        normalize_layout(None)


# --------------------------------------------------------------------------------------------
# transformers' fine-grained FP8 ("hf")
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "config",
    [FP8Config(weight_scale_method="tensor"), FP8Config(weight_block_size=[32, 64])],
    ids=["tensor", "block"],
)
def test_hf_export_loads_in_transformers_as_floatxq_decodes(config, tmp_path):
    model = _quantized(config, bias=True)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    exported = export_layout(model, config, "hf")
    for key, tensor in model.state_dict().items():  # the model is not changed
        assert_bitwise_equal(tensor, before[key], msg=key)
    block = config.weight_block_size
    assert exported.quantization_config == {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": list(block) if block else None,
        "modules_to_not_convert": ["lm_head"],
    }
    assert exported.quantize_config is None
    scale = exported.state["model.layers.0.mlp.down_proj.weight_scale_inv"]
    assert scale.dtype == torch.float32
    assert scale.shape == (() if block is None else (128 // 32, 256 // 64))
    assert exported.state["model.layers.0.self_attn.q_proj.bias"].dtype == BF16

    loaded = _load(_save(model, exported, tmp_path / "hf"))
    differ, total, worst = _compare_weights(model, loaded)
    assert worst <= 1 and differ <= total // 1000, (differ, total)
    _assert_logits_match(model, loaded, rtol=1e-2)


# --------------------------------------------------------------------------------------------
# compressed-tensors
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dequantize", [True, False], ids=["dequantize", "default"])
@pytest.mark.parametrize(
    "config",
    [
        FP8Config(weight_scale_method="tensor"),
        FP8Config(weight_scale_method="row"),
        FP8Config(weight_block_size=[32, 64]),
        FP8Config(weight_scale_method="row", gsq=GSQConfig(steps=2)),
    ],
    ids=["tensor", "row", "block", "row-gsq"],
)
def test_ct_export_loads_in_transformers_as_floatxq_decodes(config, dequantize, tmp_path):
    model = _quantized(config, bias=config.weight_scale_method == "row")
    exported = export_layout(model, config, "compressed-tensors")
    qc = exported.quantization_config
    assert qc["format"] == "float-quantized" and qc["ignore"] == ["lm_head"]
    assert [g["targets"] for g in qc["config_groups"].values()] == [["Linear"]]
    ct.quantization.QuantizationConfig.model_validate(qc)
    assert ("floatxq" in qc) == (config.gsq is not None)  # GSQ settings: for floatxq.load only

    loaded = _load(_save(model, exported, tmp_path / "ct"), dequantize=dequantize)
    differ, total, worst = _compare_weights(model, loaded)
    assert worst <= 1
    if dequantize and _DEQUANTIZE_KEEPS_FP32_SCALES:
        # decoded in FP32 with the FP32 multiplying scale: floatxq's weights, but for a handful
        assert differ <= total // 1000, (differ, total)
    # else: transformers' default compressed-tensors path (and, before transformers 5.24, its
    # dequantize path too) keeps weight_scale in the model dtype, rounding the FP32 scale once
    # more (2**-9 relative): one bf16 ulp at most, as asserted
    _assert_logits_match(model, loaded, rtol=2e-2)


def test_ct_mixed_fp8_schemes_target_module_names(tmp_path):
    config = FP8Config(
        weight_scale_method="row", dynamic={r".*mlp.*": {"weight_block_size": [32, 64]}}
    )
    model = _quantized(config)
    exported = export_layout(model, config, "ct")
    groups = exported.quantization_config["config_groups"]
    attention = [n for n in _quantized_modules(model) if "self_attn" in n]
    mlp = [n for n in _quantized_modules(model) if ".mlp." in n]
    assert [g["targets"] for g in groups.values()] == [attention, mlp]
    assert [g["weights"]["strategy"] for g in groups.values()] == ["channel", "block"]
    ct.quantization.QuantizationConfig.model_validate(exported.quantization_config)

    loaded = _load(_save(model, exported, tmp_path / "ct"))
    _, _, worst = _compare_weights(model, loaded)
    assert worst <= 1
    _assert_logits_match(model, loaded, rtol=2e-2)
    # floatxq reads each module with its own group's block size (row attention, block MLP)
    ours = fq.load(tmp_path / "ct").model
    for name in attention + mlp:
        module = ours.get_submodule(name)
        expected = "block" if name in mlp else "row"
        assert module.weight_scale_method == expected, (name, module.weight_scale_method)
    _assert_logits_match(model, ours, rtol=2e-2)


def _ct_reference(model: nn.Module, scheme, fmt: str | None, tmp_path: Path):
    """What compressed-tensors itself writes for ``model`` with ``scheme`` on every Linear but
    lm_head: (config.json's quantization_config, compressed state dict)."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import QuantizationConfig, apply_quantization_config

    config = QuantizationConfig(config_groups={"group_0": scheme}, ignore=["lm_head"])
    apply_quantization_config(model, config)
    for module in model.modules():
        for name in ("weight_scale", "weight_global_scale"):
            if hasattr(module, name):
                getattr(module, name).data.fill_(1.0)
    compressor = ModelCompressor.from_pretrained_model(model, quantization_format=fmt)
    compressor.compress_model(model)
    tmp_path.mkdir()
    (tmp_path / "config.json").write_text("{}")
    compressor.update_config(str(tmp_path))
    payload = json.loads((tmp_path / "config.json").read_text())["quantization_config"]
    return payload, model.state_dict()


_UNSET = (None, {}, [])
"""Values of an optional field that says nothing: what a release writes for a key it added."""


def _assert_agrees(ours, reference, read, where: str = "quantization_config") -> None:
    """floatxq's payload ``ours`` against compressed-tensors' own ``reference`` on what the format
    defines, whatever keys a release adds. A key both write must hold the same value (nested
    dicts compared key by key). A key only floatxq writes must be unset (an optional field this
    release does not know). A key only the reference writes must be what compressed-tensors
    itself reads from floatxq's payload (``read``: its parse of ``ours``), or unset: a field a
    newer release adds with its default passes; a defined value floatxq leaves out fails."""
    if not (isinstance(ours, dict) and isinstance(reference, dict)):
        assert ours == reference, (
            f"{where}: floatxq writes {ours!r}, compressed-tensors {reference!r}"
        )
        return
    read = read if isinstance(read, dict) else {}
    for key in sorted(ours.keys() | reference.keys()):
        here = f"{where}.{key}"
        if key in ours and key in reference:
            _assert_agrees(ours[key], reference[key], read.get(key), here)
        elif key in ours:
            assert ours[key] in _UNSET, (
                f"{here}: floatxq writes {ours[key]!r}; the reference has no such key"
            )
        elif key in read:
            assert read[key] == reference[key], (
                f"{here}: compressed-tensors writes {reference[key]!r}, and reads "
                f"{read[key]!r} from floatxq's payload, which leaves it out"
            )
        else:
            assert reference[key] in _UNSET, f"{here}: floatxq leaves out {reference[key]!r}"


def _assert_like_ct(exported, reference, tmp_path) -> None:
    payload, state = reference
    payload = {k: v for k, v in payload.items() if k != "version"}  # the writer's version
    ours = exported.quantization_config
    # compressed-tensors' own schema reads it, and keeps every value floatxq writes
    read = ct.quantization.QuantizationConfig.model_validate(ours).model_dump()
    _assert_agrees(ours, read, read, "quantization_config (as compressed-tensors reads it)")
    _assert_agrees(ours, payload, read)
    assert set(exported.state) == set(state)
    for key, tensor in state.items():
        ours = exported.state[key]
        assert ours.shape == tensor.shape, key
        if key.endswith(".weight_scale") and tensor.dtype == BF16:
            assert ours.dtype == torch.float32, key  # FP8 scales kept in FP32, never rounded
        else:
            assert ours.dtype == tensor.dtype, key


@pytest.mark.parametrize(
    ("preset", "config"),
    [
        ("FP8", FP8Config(weight_scale_method="tensor")),
        ("FP8_DYNAMIC", FP8Config(weight_scale_method="row")),
        ("FP8_BLOCK", FP8Config(weight_block_size=[128, 128])),
    ],
)
def test_ct_fp8_payload_and_tensors_are_what_compressed_tensors_writes(preset, config, tmp_path):
    from compressed_tensors.quantization import QuantizationScheme, preset_name_to_scheme

    # the preset's weight quantization, weight-only (floatxq's files carry no activation scales)
    weights = preset_name_to_scheme(preset, ["Linear"]).weights
    scheme = QuantizationScheme(targets=["Linear"], weights=weights)
    reference = _ct_reference(_llama(kv_heads=4), scheme, "float-quantized", tmp_path / "ct")
    model = _quantized(config, kv_heads=4)
    _assert_like_ct(export_layout(model, config, "ct"), reference, tmp_path)


def test_ct_nvfp4_payload_and_tensors_are_what_compressed_tensors_writes(tmp_path):
    from compressed_tensors.quantization import preset_name_to_scheme

    scheme = preset_name_to_scheme("NVFP4A16", ["Linear"])
    reference = _ct_reference(_llama(), scheme, None, tmp_path / "ct")
    _assert_like_ct(export_layout(_nvfp4_llama(), None, "ct"), reference, tmp_path)


def test_ct_nvfp4_w4a4_payload_and_tensors_are_what_compressed_tensors_writes(tmp_path):
    """llm-compressor's NVFP4 scheme: input_activations declared, input_global_scale = 1/g."""
    from compressed_tensors.quantization import preset_name_to_scheme

    scheme = preset_name_to_scheme("NVFP4", ["Linear"])
    reference = _ct_reference(_llama(), scheme, None, tmp_path / "ct")
    model = _nvfp4_llama(w4a4=".")
    exported = export_layout(model, None, "ct")
    _assert_like_ct(exported, reference, tmp_path)
    group = exported.quantization_config["config_groups"]["group_0"]
    assert group["input_activations"]["dynamic"] == "local"
    for name, module in _quantized_modules(model).items():
        stored = exported.state[f"{name}.input_global_scale"]
        assert stored.dtype == torch.float32 and stored.shape == (1,)
        # one FP32 division, the value compressed-tensors divides by to quantize activations
        expected = torch.tensor([1.0], dtype=torch.float32) / module.input_scale.reshape(1)
        assert_bitwise_equal(stored, expected)
        assert float(stored) == pytest.approx(6 * 448 / 10.0, rel=2**-23)


@pytest.mark.parametrize("amax", [8.0, 10.0])
def test_ct_w4a4_save_reloads_with_its_input_scale(amax, tmp_path):
    """load takes fl(1/input_global_scale): the module's own scale when its reciprocal
    round-trips (amax 8), else the FP32 value half an ulp away (amax 10), never another."""
    model = _nvfp4_llama(w4a4=".")
    g = torch.tensor(amax / (6 * 448), dtype=torch.float32)
    for module in _quantized_modules(model).values():
        module.input_scale = g.clone()
    loaded = fq.load(fq.load(model).save(tmp_path / "w4a4", layout="ct")).model
    back = torch.ones(()) / (torch.ones(()) / g)
    assert torch.equal(back, g) == (amax == 8.0)
    for name, module in _quantized_modules(loaded).items():
        assert_bitwise_equal(module.input_scale, back, msg=name)
        assert_bitwise_equal(module.weight, model.get_submodule(name).weight, msg=name)
    if amax == 8.0:
        with torch.no_grad():
            assert_bitwise_equal(loaded(IDS).logits, model(IDS).logits)


def test_ct_mixed_weight_only_and_w4a4_nvfp4_are_separate_groups(tmp_path):
    model = _nvfp4_llama(w4a4="self_attn")
    exported = export_layout(model, None, "ct")
    qc = exported.quantization_config
    assert qc["format"] == "nvfp4-pack-quantized"
    groups = list(qc["config_groups"].values())
    assert len(groups) == 2
    attention = [n for n in _quantized_modules(model) if "self_attn" in n]
    mlp = [n for n in _quantized_modules(model) if ".mlp." in n]
    assert sorted(groups[0]["targets"]) == sorted(attention)  # module order: attention first
    assert groups[0]["input_activations"]["num_bits"] == 4
    assert sorted(groups[1]["targets"]) == sorted(mlp)
    assert groups[1]["input_activations"] is None
    assert groups[0]["weights"] == groups[1]["weights"]
    read = ct.quantization.QuantizationConfig.model_validate(qc)
    assert read.config_groups["group_1"].input_activations is None
    assert {n for n in exported.state if n.endswith(".input_global_scale")} == {
        f"{n}.input_global_scale" for n in attention
    }
    loaded = fq.load(_save(model, exported, tmp_path / "mixed")).model
    for name, module in _quantized_modules(loaded).items():
        assert (module.input_scale is not None) == (name in attention), name


def test_ct_w4a4_export_runs_in_transformers_with_floatxqs_activation_quantization(tmp_path):
    """transformers (through compressed-tensors, on the CPU) loads the W4A4 files with each
    module's input quantization at the stored input_global_scale: in FP32 its activation
    quantize-dequantize is floatxq's ``nvfp4_block_qdq`` up to the order of the last multiply.
    (In bf16 compressed-tensors divides by the block scale in bf16, and about one element in a
    hundred rounds to the neighbouring E2M1 value, so logits are not compared.)"""
    from compressed_tensors.quantization.lifecycle.forward import forward_quantize

    model = _nvfp4_llama(w4a4=".")
    loaded = _load(_save(model, export_layout(model, None, "ct"), tmp_path / "w4a4"))
    _, _, worst = _compare_weights(model, loaded)
    assert worst <= 1
    generator = torch.Generator().manual_seed(0)
    modules = _quantized_modules(model)
    for name, module in modules.items():
        theirs = loaded.get_submodule(name)
        scheme = theirs.quantization_scheme.input_activations
        assert (scheme.num_bits, scheme.group_size, scheme.dynamic) == (4, 16, "local"), name
        assert_bitwise_equal(
            theirs.input_global_scale.detach(), 1.0 / module.input_scale.reshape(1)
        )
        x = torch.randn(64, module.in_features, generator=generator) * 3  # up to past amax 10
        with torch.no_grad():
            got = forward_quantize(theirs, x.clone(), "input", scheme)
        expected = fq.nvfp4_block_qdq(x, module.input_scale, "nvidia")
        assert torch.equal(got == 0, expected == 0), name
        assert bool(((got - expected).abs() <= 3 * 2.0**-24 * expected.abs()).all()), name
    assert len(modules) == 14


# --------------------------------------------------------------------------------------------
# NVFP4 (compressed-tensors' nvfp4-pack-quantized)
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dequantize", [True, False], ids=["dequantize", "default"])
def test_ct_nvfp4_lifecycle_save_loads_in_transformers_as_floatxq_decodes(dequantize, tmp_path):
    """The files NVFP4Config's quantize() and save() write for the tiny Llama: transformers'
    weights and logits against floatxq's own load of the same files."""
    from floatxq.tiny import TINY_LLAMA_DIR

    quantized = fq.load(TINY_LLAMA_DIR, quantize_config=fq.NVFP4Config()).quantize(progress=False)
    path = quantized.save(tmp_path / "ct")
    ours = fq.load(path).model
    assert len(_quantized_modules(ours)) == 56
    loaded = _load(path, dequantize=dequantize)
    differ, total, worst = _compare_weights(ours, loaded)
    # compressed-tensors divides the block scale by the stored 1/g in FP32, floatxq multiplies it
    # by g: the two FP32 steps can differ by an ulp, and a decoded value that then sits at a
    # bfloat16 half-way point rounds one bfloat16 ulp apart (0.14% of the weights with the
    # default least_squares scales, under 0.1% with nvidia's); never more than one ulp
    assert worst <= 1 and differ <= total // 500, (differ, total)
    _assert_logits_match(ours, loaded, rtol=1e-2)


def _nvfp4_llama(*, fp8_mlp: bool = False, w4a4: str = "") -> nn.Module:
    """The tiny Llama with every linear but lm_head NVFP4 (the MLP's FP8 rows with fp8_mlp);
    the modules whose names contain ``w4a4`` (all with ``"."``) W4A4, with an ``input_scale``
    (the activation global scale of an amax of 10)."""
    fp4 = _fp4_class()
    model = _llama()
    for name, module in list(model.named_modules()):
        if isinstance(module, nn.Linear) and name != "lm_head":
            parent, _, leaf = name.rpartition(".")
            if fp8_mlp and ".mlp." in name:
                new = TorchFP8Linear.from_linear(module, weight_scale_method="row")
            elif w4a4 and w4a4 in name:
                new = fp4.from_linear(module, input_scale=_INPUT_SCALE)
            else:
                new = fp4.from_linear(module)
            setattr(model.get_submodule(parent), leaf, new)
    return model


_INPUT_SCALE = 10.0 / (6 * 448)
"""An activation global scale (decode multiplier) whose FP32 reciprocal is not a power of two."""


@pytest.mark.parametrize("dequantize", [True, False], ids=["dequantize", "default"])
def test_ct_nvfp4_export_loads_in_transformers_as_floatxq_decodes(dequantize, tmp_path):
    model = _nvfp4_llama()
    exported = export_layout(model, None, "ct")
    qc = exported.quantization_config
    assert qc["format"] == "nvfp4-pack-quantized"
    q = model.get_submodule("model.layers.1.self_attn.o_proj")
    prefix = "model.layers.1.self_attn.o_proj."
    assert exported.state[prefix + "weight_packed"] is q.weight
    assert exported.state[prefix + "weight_scale"] is q.weight_scale
    global_scale = exported.state[prefix + "weight_global_scale"]
    assert global_scale.shape == (1,) and global_scale.dtype == torch.float32
    assert float(global_scale) == pytest.approx(1 / float(q.weight_scale_2), rel=2**-24)

    loaded = _load(_save(model, exported, tmp_path / "ct"), dequantize=dequantize)
    differ, total, worst = _compare_weights(model, loaded)
    assert worst <= 1 and differ <= total // 1000, (differ, total)
    _assert_logits_match(model, loaded, rtol=1e-2)


def test_ct_fp8_and_nvfp4_together_are_mixed_precision(tmp_path):
    model = _nvfp4_llama(fp8_mlp=True)
    exported = export_layout(model, None, "ct")
    qc = exported.quantization_config
    assert qc["format"] == "mixed-precision"
    assert [g["format"] for g in qc["config_groups"].values()] == [
        "nvfp4-pack-quantized",
        "float-quantized",
    ]
    ct.quantization.QuantizationConfig.model_validate(qc)
    # transformers' dequantize=True path decodes every dense layer with one config group, so
    # mixed files load through the default (compressed) path only
    loaded = _load(_save(model, exported, tmp_path / "ct"))
    _, _, worst = _compare_weights(model, loaded)
    assert worst <= 1
    _assert_logits_match(model, loaded, rtol=2e-2)


# --------------------------------------------------------------------------------------------
# GPT-QModel's files
# --------------------------------------------------------------------------------------------


def test_gptqmodel_export_is_byte_exact_and_transformers_refuses_it(tmp_path):
    config = FP8Config(weight_block_size=[32, 64])
    model = _quantized(config)
    exported = export_layout(model, config, "gptqmodel")
    state = model.state_dict()
    assert list(exported.state) == list(state)
    for key, tensor in state.items():  # the model's own tensors, as they are
        assert exported.state[key] is tensor or exported.state[key].data_ptr() == tensor.data_ptr()
    assert exported.quantize_config == fp8_config_to_payload(config)
    assert exported.quantization_config == {
        **fp8_config_to_payload(config),
        "activation_scheme": GPTQMODEL_REFUSAL_MARKER,
    }
    path = _save(model, exported, tmp_path / "gptq")
    with pytest.raises(ValueError, match="inverse scale"):
        transformers.AutoModelForCausalLM.from_pretrained(path)


# --------------------------------------------------------------------------------------------
# Scales and refusals
# --------------------------------------------------------------------------------------------


def test_multiplying_scales_decode_within_the_stated_bound_and_exactly_for_powers_of_two():
    torch.manual_seed(3)
    layer = TorchFP8Linear.from_linear(nn.Linear(64, 48), weight_scale_method="row")
    state = export_layout(nn.Sequential(layer), None, "ct").state
    scale = state["0.weight_scale"]
    assert scale.shape == (48, 1) and scale.dtype == torch.float32
    ours = dequantize_fp8_weight(layer.weight, layer.weight_scale_inv)
    theirs = fp8_decode(layer.weight) * scale
    bound = 3 * 2.0**-24 * ours.abs()
    assert bool(((theirs - ours).abs() <= bound).all())

    codes = layer.weight[:12]
    powers = 2.0 ** torch.arange(-6, 6, dtype=torch.float32)
    for layout, key, scale_inv in (
        ("ct", "0.weight_scale", powers),
        ("hf", "0.weight_scale_inv", torch.tensor(0.25)),
    ):
        exact = TorchFP8Linear.from_quantized(codes, scale_inv, None)
        scale = export_layout(nn.Sequential(exact), None, layout).state[key]
        direct = scale.reshape(-1, 1) if scale.numel() > 1 else scale.reshape(())
        assert torch.equal(fp8_decode(codes) * direct, dequantize_fp8_weight(codes, scale_inv))


def test_layouts_refuse_modules_they_cannot_hold_naming_them():
    row = nn.Sequential(TorchFP8Linear.from_linear(nn.Linear(64, 32), weight_scale_method="row"))
    with pytest.raises(
        ValueError,
        match=r"'hf' cannot hold module '0'.*row scales.*"
        r"'compressed-tensors', 'gptqmodel'",
    ):
        export_layout(row, None, "hf")

    e5m2 = nn.Sequential(
        nn.Linear(8, 64), TorchFP8Linear.from_linear(nn.Linear(64, 32), format="e5m2")
    )
    for layout in ("hf", "ct"):
        with pytest.raises(ValueError, match=r"module '1'.*float8_e5m2.*hold it: 'gptqmodel'$"):
            export_layout(e5m2, None, layout)

    conv = nn.Sequential(TorchFP8Linear.from_linear(nn.Conv1d(16, 8, 3)))
    with pytest.raises(ValueError, match=r"module '0'.*convolution.*hold it: 'gptqmodel'$"):
        export_layout(conv, None, "ct")

    blocks = nn.Sequential(
        TorchFP8Linear.from_linear(
            nn.Linear(64, 64), weight_scale_method=None, weight_block_size=[32, 32]
        ),
        TorchFP8Linear.from_linear(
            nn.Linear(64, 64), weight_scale_method=None, weight_block_size=[32, 64]
        ),
    )
    with pytest.raises(
        ValueError, match=r"one weight_block_size.*'0'.*\[32, 32\].*'1'.*\[32, 64\]"
    ):
        export_layout(blocks, None, "hf")
    assert len(export_layout(blocks, None, "ct").quantization_config["config_groups"]) == 2

    fp4 = nn.Sequential(_fp4_class().from_linear(nn.Linear(32, 8)))
    for layout, config in (("hf", None), ("gptqmodel", FP8Config())):
        with pytest.raises(ValueError, match=r"module '0' \(NVFP4.*hold it: 'compressed-tensors'"):
            export_layout(fp4, config, layout)

    with pytest.raises(ValueError, match="no TorchFP8Linear or TorchFP4Linear"):
        export_layout(nn.Sequential(nn.Linear(4, 4)), None, "ct")
    with pytest.raises(TypeError, match="FP8Config"):
        export_layout(row, None, "gptqmodel")
    with pytest.raises(ValueError, match="unknown checkpoint layout"):
        export_layout(row, FP8Config(), "safetensors")
