"""``layout="modelopt"``: NVFP4 models saved as NVIDIA ModelOpt's files (what TensorRT-LLM, vLLM
and SGLang read as ``quant_method: "modelopt"``), reloaded by ``floatxq.load`` bit for bit.

The tensors are checked against an E2M1 decode written here (low nibble first, both scales
multiply), the metadata against ModelOpt's keys, and, where the ``modelopt`` package is
installed, against ModelOpt's own config conversion and NVFP4 decode.
"""

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from torch import nn

import floatxq as fq
from floatxq.config import FP8Config, GPTQConfig
from floatxq.interop.checkpoint import write_checkpoint
from floatxq.interop.export import export_layout
from floatxq.interop.export_modelopt import modelopt_payloads
from floatxq.lifecycle.layout_check import check_layout
from floatxq.nn.fp4_linear import TorchFP4Linear
from floatxq.nn.fp8_linear import TorchFP8Linear
from floatxq.testing import assert_bitwise_equal

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()

_E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def _llama(*, bias: bool = False, seed: int = 0, dtype: torch.dtype = torch.float32) -> nn.Module:
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(
        vocab_size=128, num_hidden_layers=2, max_position_embeddings=64, hidden_size=64,
        intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
        tie_word_embeddings=False, attention_bias=bias,
    )  # fmt: skip
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype).eval()
    if bias:
        with torch.no_grad():
            for module in model.modules():
                if isinstance(module, nn.Linear) and module.bias is not None:
                    module.bias.normal_(0.0, 0.5)
    return model


def _ids() -> torch.Tensor:
    return torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(1))


def _tensors(path: Path) -> dict[str, torch.Tensor]:
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


def _json(path: Path) -> dict:
    return json.loads(path.read_text())


def _decode(packed: torch.Tensor, scales: torch.Tensor, scale_2: torch.Tensor) -> torch.Tensor:
    """ModelOpt's NVFP4 decode, written from its documented layout: element ``2j`` in the low
    nibble (bit 3 the sign), ``(e2m1 * float(weight_scale)) * weight_scale_2`` in FP32."""
    lut = torch.tensor(_E2M1 + [-v for v in _E2M1], dtype=torch.float32)
    low, high = (packed & 0xF).long(), (packed >> 4).long()
    codes = torch.stack([lut[low], lut[high]], dim=-1).reshape(packed.shape[0], -1)
    blocks = scales.float().repeat_interleave(16, dim=1)
    return (codes * blocks) * scale_2.float()


def _fp4_modules(model: nn.Module) -> dict[str, TorchFP4Linear]:
    return {n: m for n, m in model.named_modules() if isinstance(m, TorchFP4Linear)}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """The tiny Llama quantized to NVFP4 by the lifecycle and saved as ModelOpt's files."""
    dense = _llama(bias=True, dtype=torch.bfloat16)
    model = fq.load(dense, quantize_config=fq.NVFP4Config()).quantize(progress=False)
    path = model.save(tmp_path_factory.mktemp("modelopt") / "m", layout="modelopt")
    return model, path


def test_files_are_modelopts_tensors_and_metadata(saved):
    model, path = saved
    assert sorted(p.name for p in path.iterdir()) == [
        "config.json",
        "hf_quant_config.json",
        "model.safetensors",
    ]
    tensors = _tensors(path)
    modules = _fp4_modules(model.model)
    assert len(modules) == 14  # 7 linears per layer, lm_head left dense
    for name, module in modules.items():
        n, k = module.out_features, module.in_features
        packed, scales = tensors[f"{name}.weight"], tensors[f"{name}.weight_scale"]
        scale_2 = tensors[f"{name}.weight_scale_2"]
        assert packed.dtype == torch.uint8 and packed.shape == (n, k // 2)
        assert scales.dtype == torch.float8_e4m3fn and scales.shape == (n, k // 16)
        assert scale_2.dtype == torch.float32 and scale_2.shape == ()
        assert f"{name}.input_scale" not in tensors  # weight-only
        assert f"{name}.weight_packed" not in tensors
        if module.bias is None:
            assert f"{name}.bias" not in tensors
        else:  # in the model's dtype, as transformers loads a dense bias
            assert_bitwise_equal(tensors[f"{name}.bias"], module.bias.to(torch.bfloat16))
        # the stored tensors decode (ModelOpt's rule) to the weight the module runs
        expected = module.dequantize_weight(dtype=torch.float32)
        assert torch.equal(_decode(packed, scales, scale_2), expected), name
    assert tensors["lm_head.weight"].dtype == torch.bfloat16
    assert sum(f"{name}.bias" in tensors for name in modules) == 8  # q, k, v, o of 2 layers
    side = _json(path / "hf_quant_config.json")
    assert side["producer"]["name"] == "floatxq"
    assert side["quantization"] == {
        "quant_algo": "W4A16_NVFP4",
        "kv_cache_quant_algo": None,
        "group_size": 16,
        "exclude_modules": ["lm_head"],
    }
    qc = _json(path / "config.json")["quantization_config"]
    assert qc == {
        "config_groups": {
            "group_0": {
                "weights": {"dynamic": False, "num_bits": 4, "type": "float", "group_size": 16},
                "targets": ["Linear"],
            }
        },
        "ignore": ["lm_head"],
        "quant_algo": "W4A16_NVFP4",
        "kv_cache_quant_algo": None,
        "group_size": 16,
        "producer": side["producer"],
        "quant_method": "modelopt",
    }


def test_load_reads_the_files_back_bit_for_bit(saved):
    model, path = saved
    loaded = fq.load(path)
    assert (loaded.layout.layout, loaded.layout.scheme) == ("modelopt", "W4A16_NVFP4")
    ours, theirs = _fp4_modules(model.model), _fp4_modules(loaded.model)
    assert sorted(ours) == sorted(theirs)
    for name, module in ours.items():
        other = theirs[name]
        for leaf in ("weight", "weight_scale", "weight_scale_2"):
            assert_bitwise_equal(getattr(other, leaf), getattr(module, leaf))
        assert (other.bias is None) == (module.bias is None), name
        if module.bias is not None:
            assert_bitwise_equal(other.bias, module.bias)
    with torch.no_grad():
        expected, got = model.model(_ids()).logits, loaded.model(_ids()).logits
    assert_bitwise_equal(got, expected)


def test_the_sidecar_alone_declares_the_layout(saved, tmp_path):
    """TensorRT-LLM reads hf_quant_config.json only: without config.json's quantization_config
    the files still load as ModelOpt NVFP4."""
    model, path = saved
    bare = tmp_path / "bare"
    bare.mkdir()
    for file in path.iterdir():
        (bare / file.name).write_bytes(file.read_bytes())
    config = _json(bare / "config.json")
    del config["quantization_config"]
    (bare / "config.json").write_text(json.dumps(config))
    loaded = fq.load(bare)
    assert loaded.layout.layout == "modelopt"
    assert "hf_quant_config.json" in loaded.layout.evidence
    with torch.no_grad():
        assert_bitwise_equal(loaded.model(_ids()).logits, model.model(_ids()).logits)


def test_a_compressed_tensors_save_of_the_reloaded_model_is_the_same_weights(saved, tmp_path):
    model, path = saved
    again = fq.load(path).save(tmp_path / "ct", layout="ct")
    assert not (again / "hf_quant_config.json").exists()
    with torch.no_grad():
        assert_bitwise_equal(fq.load(again).model(_ids()).logits, model.model(_ids()).logits)


def _w4a4_model(which: str = ".") -> nn.Module:
    """The tiny Llama (bf16) with NVFP4 linears, W4A4 where the name contains ``which``."""
    model = _llama(dtype=torch.bfloat16)
    for name, module in list(model.named_modules()):
        if isinstance(module, nn.Linear) and name != "lm_head":
            parent, _, leaf = name.rpartition(".")
            scale = 10.0 / (6 * 448) if which in name else None
            new = TorchFP4Linear.from_linear(module, input_scale=scale)
            setattr(model.get_submodule(parent), leaf, new)
    return model


def test_w4a4_modules_write_their_input_scale_and_declare_nvfp4():
    model = _w4a4_model()
    exported = export_layout(model, None, "modelopt")
    modules = _fp4_modules(model)
    for name, module in modules.items():
        stored = exported.state[f"{name}.input_scale"]
        assert stored.shape == () and stored.dtype == torch.float32
        assert_bitwise_equal(stored, module.input_scale)  # ModelOpt's input_scale: the same value
        assert float(stored) == pytest.approx(10.0 / 2688, rel=2**-24)
    side = exported.json_files["hf_quant_config.json"]
    assert side["quantization"]["quant_algo"] == "NVFP4"
    group = exported.quantization_config["config_groups"]["group_0"]
    assert group["input_activations"] == group["weights"]  # 4-bit float, blocks of 16


def test_w4a4_save_reloads_bit_for_bit(tmp_path):
    model = _w4a4_model()
    path = fq.load(model).save(tmp_path / "w4a4", layout="modelopt")
    loaded = fq.load(path)
    assert loaded.layout.scheme == "NVFP4"
    theirs = _fp4_modules(loaded.model)
    for name, module in _fp4_modules(model).items():
        assert_bitwise_equal(theirs[name].input_scale, module.input_scale, msg=name)
    with torch.no_grad():
        assert_bitwise_equal(loaded.model(_ids()).logits, model(_ids()).logits)


def test_mixed_weight_only_and_w4a4_are_refused_before_writing(tmp_path):
    """ModelOpt declares the mix as MIXED_PRECISION, which floatxq.load does not run as W4A4:
    the save refuses, naming a weight-only module and the layout that holds the mix."""
    model = fq.load(_w4a4_model("self_attn"))
    with pytest.raises(ValueError, match=r"layout: layout 'modelopt' cannot hold module .*W4A4"):
        model.check_save_layout("modelopt")  # before any work, for a model already quantized
    with pytest.raises(
        ValueError,
        match=r"'modelopt' cannot hold module 'model\.layers\.0\.mlp\.gate_proj' \(NVFP4 "
        r"weights, weight-only\): .*W4A4 modules \(e\.g\. 'model\.layers\.0\.self_attn\.q_proj'\)"
        r".*hold it: 'compressed-tensors'$",
    ):
        model.save(tmp_path / "mixed", layout="modelopt")
    assert not (tmp_path / "mixed").exists()
    model.save(tmp_path / "ct", layout="ct")  # which holds it


def test_files_load_would_refuse_are_not_written(tmp_path, monkeypatch):
    """The save runs load's ModelOpt metadata check: W4A4 declared for a module without an
    input_scale is refused before anything is written."""
    import floatxq.interop.export as export

    monkeypatch.setattr(export, "modelopt_nvfp4_algo", lambda module: "NVFP4")
    model = fq.load(_w4a4_model("self_attn"))
    with pytest.raises(fq.CheckpointError, match=r"mlp\.gate_proj\.input_scale is missing"):
        model.save(tmp_path / "bad", layout="modelopt")
    assert not (tmp_path / "bad").exists()


def test_payloads_are_modelopts_for_mixed_weight_only_and_w4a4():
    side, embedded = modelopt_payloads(
        {"a.q": "NVFP4", "a.k": "W4A16_NVFP4", "b.q": "NVFP4"}, ["lm_head", "a.gate"]
    )
    quantization = side["quantization"]
    assert quantization["quant_algo"] == "MIXED_PRECISION"
    assert quantization["quantized_layers"] == {
        "a.q": {"quant_algo": "NVFP4", "group_size": 16},
        "a.k": {"quant_algo": "W4A16_NVFP4", "group_size": 16},
        "b.q": {"quant_algo": "NVFP4", "group_size": 16},
    }
    assert quantization["exclude_modules"] == ["a.gate", "lm_head"]
    groups = embedded["config_groups"]
    assert [g["targets"] for g in groups.values()] == [["a.q", "b.q"], ["a.k"]]
    assert groups["group_0"]["input_activations"]["num_bits"] == 4  # W4A4
    assert "input_activations" not in groups["group_1"]  # weight-only
    assert embedded["quant_algo"] == "MIXED_PRECISION" and embedded["quant_method"] == "modelopt"
    with pytest.raises(ValueError, match=r"'W4A16_NVFP4', 'FP8'\]; got \['W8A8_SQ'\]"):
        modelopt_payloads({"a": "W8A8_SQ"}, [])
    with pytest.raises(ValueError, match="got none"):
        modelopt_payloads({}, [])


def test_modules_modelopt_cannot_hold_are_refused_naming_them(tmp_path):
    fp8 = nn.Sequential(TorchFP8Linear.from_linear(nn.Linear(64, 32), weight_scale_method="tensor"))
    with pytest.raises(
        ValueError,
        match=r"'modelopt' cannot hold module '0' \(float8_e4m3fn weights with tensor scales\).*"
        r"static W8A8.*input_scale.*hold it: 'compressed-tensors', 'hf', 'gptqmodel'$",
    ):
        export_layout(fp8, None, "modelopt")
    mixed = nn.Sequential(
        TorchFP4Linear.from_linear(nn.Linear(64, 64)),
        TorchFP8Linear.from_linear(nn.Linear(64, 32), weight_scale_method="row"),
    )
    with pytest.raises(ValueError, match=r"module '1' \(float8_e4m3fn weights with row scales"):
        export_layout(mixed, None, "modelopt")
    with pytest.raises(ValueError, match="no TorchFP8Linear or TorchFP4Linear"):
        export_layout(nn.Sequential(nn.Linear(16, 16)), None, "modelopt")
    # other layouts name modelopt among those that hold an NVFP4 module
    fp4 = nn.Sequential(TorchFP4Linear.from_linear(nn.Linear(32, 8)))
    with pytest.raises(ValueError, match=r"hold it: 'compressed-tensors', 'modelopt'$"):
        export_layout(fp4, None, "hf")


def test_check_layout_answers_before_any_work():
    model = _llama()
    assert check_layout(model, fq.NVFP4Config(), "nvidia-modelopt") == "modelopt"
    with pytest.raises(ValueError, match=r"quantize: layout 'modelopt' cannot hold module .*FP8"):
        check_layout(model, FP8Config(weight_scale_method="tensor"), "modelopt", where="quantize")
    with pytest.raises(ValueError, match=r"'modelopt' cannot hold module .*GPTQ 4-bit"):
        check_layout(model, GPTQConfig(bits=4, group_size=32), "modelopt")
    quantizer = fq.load(model, quantize_config=FP8Config(weight_scale_method="tensor"))
    with pytest.raises(ValueError, match="'modelopt' cannot hold"):
        quantizer.quantize(progress=False, layout="modelopt")
    assert not quantizer.quantized  # refused before any module changed
    assert not any(isinstance(m, TorchFP8Linear) for m in quantizer.model.modules())


def test_a_refused_save_leaves_nothing_behind(tmp_path):
    model = fq.load(_llama(), quantize_config=FP8Config()).quantize(progress=False)
    target = tmp_path / "out"
    with pytest.raises(ValueError, match="'modelopt' cannot hold"):
        model.save(target, layout="modelopt")
    assert not target.exists() and list(tmp_path.iterdir()) == []


def test_json_files_refuse_names_the_save_writes_itself(tmp_path):
    for name in ("config.json", "sub/hf_quant_config.json"):
        with pytest.raises(ValueError, match="json_files names"):
            write_checkpoint(tmp_path / "x", {}, config={}, json_files={name: {}})
    assert not (tmp_path / "x").exists()


def test_cli_quantize_nvfp4_with_layout_modelopt(tmp_path):
    from typer.testing import CliRunner

    from floatxq.cli import app

    runner = CliRunner()
    out = tmp_path / "mo"
    args = ["quantize", "tiny", "--out", str(out), "--method", "nvfp4", "--layout", "modelopt"]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    assert "(layout modelopt)" in result.output
    assert _json(out / "hf_quant_config.json")["quantization"]["quant_algo"] == "W4A16_NVFP4"
    result = runner.invoke(app, ["inspect", str(out)])
    assert result.exit_code == 0, result.output
    assert "modelopt" in result.output and "quantized:   56 layers" in result.output
    refused = ["quantize", "tiny", "--out", str(tmp_path / "no"), "--layout", "modelopt"]
    result = runner.invoke(app, refused)  # FP8, the default method: refused before any work
    assert result.exit_code == 2 and "cannot hold module" in result.output, result.output
    assert not (tmp_path / "no").exists()


# --------------------------------------------------------------------------------------------
# Against ModelOpt itself (where the modelopt package is installed)
# --------------------------------------------------------------------------------------------


def test_embedded_config_is_modelopts_own_conversion_of_the_sidecar(saved):
    convert = pytest.importorskip("modelopt.torch.export.convert_hf_config")
    _, path = saved
    side = _json(path / "hf_quant_config.json")
    theirs = convert.convert_hf_quant_config_format(side)
    ours = _json(path / "config.json")["quantization_config"]
    # floatxq adds what vLLM reads from the embedded form: group_size, kv_cache_quant_algo
    extra = {k: ours.pop(k) for k in ("group_size", "kv_cache_quant_algo")}
    assert extra == {"group_size": 16, "kv_cache_quant_algo": None}
    assert ours == theirs


@pytest.mark.parametrize("which", [".", "self_attn"], ids=["w4a4", "mixed"])
def test_w4a4_and_mixed_configs_are_modelopts_own_conversion(which):
    convert = pytest.importorskip("modelopt.torch.export.convert_hf_config")
    model = _w4a4_model(which)
    algos = {n: "NVFP4" if which in n else "W4A16_NVFP4" for n in _fp4_modules(model)}
    sidecar, ours = modelopt_payloads(algos, ["lm_head"])
    if which == ".":  # what the save writes
        exported = export_layout(model, None, "modelopt")
        assert (
            exported.json_files["hf_quant_config.json"]["quantization"] == sidecar["quantization"]
        )
        assert exported.quantization_config == ours
    theirs = convert.convert_hf_quant_config_format(sidecar)
    ours = dict(ours)
    assert ours.pop("kv_cache_quant_algo") is None
    if which == ".":
        assert ours.pop("group_size") == 16
    assert ours["ignore"] == ["lm_head"]
    assert ours == theirs


def test_modelopts_decode_of_the_files_is_floatxqs(saved):
    nvfp4 = pytest.importorskip("modelopt.torch.quantization.qtensor.nvfp4_tensor")
    model, path = saved
    tensors = _tensors(path)
    for name, module in _fp4_modules(model.model).items():
        packed = tensors[f"{name}.weight"]
        shape = (module.out_features, module.in_features)
        qtensor = nvfp4.NVFP4QTensor(torch.Size(shape), torch.float32, packed)
        decoded = qtensor.dequantize(
            dtype=torch.float32,
            scale=tensors[f"{name}.weight_scale"],
            double_scale=tensors[f"{name}.weight_scale_2"],
            block_sizes={-1: 16},
        )
        # ModelOpt multiplies the code by fl(weight_scale * weight_scale_2), floatxq rounds the
        # exact code-scale product once: the two differ by at most 3 * 2**-24 relative
        ours = module.dequantize_weight(dtype=torch.float32)
        assert bool(((decoded - ours).abs() <= 3 * 2.0**-24 * ours.abs()).all()), name
