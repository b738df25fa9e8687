"""The FP8 lifecycle: load → quantize → save → load, on real transformers architectures."""

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import floatxq as fq
from floatxq.interop.checkpoint import CheckpointError
from floatxq.nn.fp8_linear import TorchFP8Linear
from floatxq.testing import assert_bitwise_equal

transformers = pytest.importorskip("transformers")


def _small(model_type: str, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    common = dict(vocab_size=128, num_hidden_layers=2, max_position_embeddings=64)
    if model_type == "gpt2":
        config = transformers.GPT2Config(
            n_embd=64, n_head=4, n_layer=2, n_positions=64, vocab_size=128
        )
        return transformers.GPT2LMHeadModel(config).eval()
    attention = dict(
        hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2
    )
    config_cls, model_cls = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
    }[model_type]
    return model_cls(config_cls(**common, **attention, tie_word_embeddings=False)).eval()


def _ids(n: int = 2, length: int = 12) -> torch.Tensor:
    return torch.randint(0, 128, (n, length), generator=torch.Generator().manual_seed(1))


def _weights(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: m.weight.detach().clone() for n, m in model.named_modules() if hasattr(m, "weight")}


@pytest.mark.parametrize("model_type", ["llama", "qwen2", "qwen3", "mistral", "gpt2"])
def test_quantize_every_architecture_bit_exact_and_lm_head_kept(model_type):
    model = _small(model_type)
    before = _weights(model)
    reference = model(input_ids=_ids()).logits
    q = fq.load(model, quantize_config=fq.FP8Config(weight_scale_method="row")).quantize(
        progress=False
    )
    fp8 = {n: m for n, m in q.model.named_modules() if isinstance(m, TorchFP8Linear)}
    assert fp8 and set(fp8) == set(q.quantized_modules)
    head = "lm_head"
    assert head not in fp8 and not isinstance(q.model.get_output_embeddings(), TorchFP8Linear)
    conv1d = transformers.pytorch_utils.Conv1D
    for name, module in fp8.items():
        w = before[name]
        if model_type == "gpt2" and name.endswith(("c_attn", "c_proj", "c_fc")):
            w = w.t()  # Conv1D stores (in, out)
        expected = fq.quantize_fp8_weight(w, weight_scale_method="row")
        assert_bitwise_equal(module.weight, expected.qweight, msg=name)
        assert_bitwise_equal(module.weight_scale_inv, expected.scale_inv, msg=name)
    assert not any(
        isinstance(m, (nn.Linear, conv1d)) and n in fp8 for n, m in q.model.named_modules()
    )
    out = q.model(input_ids=_ids()).logits
    rel = ((out - reference).pow(2).mean() / reference.pow(2).mean()).item()
    assert rel < 1e-2, rel  # FP8 weights move logits a little, not a lot


def test_dynamic_rules_exclusions_and_overrides():
    model = _small("llama")
    config = fq.FP8Config(
        weight_scale_method="row",
        dynamic={
            r"-:.*\.mlp\.down_proj": {},
            r"+:.*self_attn\.(q|k)_proj": {"format": "e5m2", "weight_scale_method": "tensor"},
        },
    )
    q = fq.load(model, quantize_config=config).quantize(progress=False)
    modules = dict(q.model.named_modules())
    assert isinstance(modules["model.layers.0.mlp.down_proj"], nn.Linear)
    q_proj = modules["model.layers.1.self_attn.q_proj"]
    assert q_proj.weight.dtype == torch.float8_e5m2 and q_proj.weight_scale_inv.shape == ()
    v_proj = modules["model.layers.1.self_attn.v_proj"]
    assert v_proj.weight.dtype == torch.float8_e4m3fn and v_proj.weight_scale_inv.shape == (32,)


def test_lm_head_quantized_on_request():
    q = fq.load(_small("llama"), quantize_config=fq.FP8Config(lm_head=True)).quantize(
        progress=False
    )
    assert isinstance(q.model.lm_head, TorchFP8Linear)


def test_block_size_that_does_not_divide_names_the_module_and_changes_nothing():
    model = _small("llama")
    config = fq.FP8Config(weight_block_size=(128, 128))  # hidden 64 is not divisible
    with pytest.raises(ValueError, match=r"model\.layers\.0\.self_attn\.q_proj.*not divisible"):
        fq.load(model, quantize_config=config).quantize(progress=False)
    assert not any(isinstance(m, TorchFP8Linear) for m in model.modules())


def test_calibration_is_ignored_with_a_warning():
    q = fq.load(_small("llama"), quantize_config=fq.FP8Config())
    with pytest.warns(UserWarning, match="ignored"):
        q.quantize(calibration=["some text"], progress=False)


@pytest.mark.parametrize("shard", ["4GB", 20_000])
@pytest.mark.parametrize(
    "layout", [{"weight_scale_method": "row"}, {"weight_block_size": (32, 32)}]
)
def test_save_load_is_bit_exact(tmp_path, shard, layout):
    q = fq.load(_small("llama"), quantize_config=fq.FP8Config(**layout)).quantize(progress=False)
    out = q.save(tmp_path / "fp8", layout="gptqmodel", max_shard_size=shard)
    files = sorted(p.name for p in out.iterdir())
    assert "config.json" in files and "quantize_config.json" in files
    if shard == 20_000:
        assert (
            "model.safetensors.index.json" in files
            and len([f for f in files if f.startswith("model-")]) > 1
        )
    else:
        assert "model.safetensors" in files
    config = json.loads((out / "config.json").read_text())
    qc = json.loads((out / "quantize_config.json").read_text())
    # config.json adds only the activation_scheme that makes transformers and vLLM refuse
    assert config["quantization_config"].pop("activation_scheme").startswith("unsupported")
    assert config["quantization_config"] == qc
    assert qc["method"] == qc["quant_method"] == "fp8" and qc["checkpoint_format"] == qc["format"]
    assert qc["weight_scale_semantics"] == "inverse" and qc["pack_dtype"] == "int32"
    loaded = fq.load(out)
    assert loaded.quantized and loaded.quantized_modules == q.quantized_modules
    a, b = q.model.state_dict(), loaded.model.state_dict()
    assert set(a) == set(b)
    for name in a:
        assert_bitwise_equal(b[name], a[name], msg=name)
    ids = _ids()
    assert_bitwise_equal(loaded.model(input_ids=ids).logits, q.model(input_ids=ids).logits)


def test_save_refuses_to_overwrite_and_replaces_on_request(tmp_path):
    q = fq.load(_small("llama"), quantize_config=fq.FP8Config()).quantize(progress=False)
    out = q.save(tmp_path / "m")
    with pytest.raises(FileExistsError, match="already exists"):
        q.save(out)
    q.save(out, overwrite=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m"]


def test_failed_save_leaves_nothing_behind(tmp_path, monkeypatch):
    import floatxq.interop.checkpoint as ckpt

    q = fq.load(_small("llama"), quantize_config=fq.FP8Config()).quantize(progress=False)
    calls = []
    real = ckpt.save_file

    def failing(tensors, filename, metadata=None):
        calls.append(filename)
        if len(calls) == 2:
            raise OSError("disk full")
        return real(tensors, filename, metadata=metadata)

    monkeypatch.setattr(ckpt, "save_file", failing)
    with pytest.raises(OSError, match="disk full"):
        q.save(tmp_path / "m", max_shard_size=20_000)
    assert list(tmp_path.iterdir()) == []


_KILLED_SAVE = """
import sys, time, torch, transformers
import floatxq as fq, floatxq.interop.checkpoint as ckpt
torch.manual_seed(0)
config = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128,
    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
model = transformers.LlamaForCausalLM(config)
q = fq.load(model, quantize_config=fq.FP8Config()).quantize(progress=False)
real = ckpt.save_file
def slow(tensors, filename, metadata=None):
    real(tensors, filename, metadata=metadata)
    print("shard", flush=True)
    time.sleep(30)
ckpt.save_file = slow
q.save(sys.argv[1], max_shard_size=20_000)
"""


def test_killed_save_leaves_no_model_directory(tmp_path):
    target = tmp_path / "killed"
    proc = subprocess.Popen(
        [sys.executable, "-c", _KILLED_SAVE, str(target)], stdout=subprocess.PIPE, text=True
    )
    try:
        line = proc.stdout.readline()  # the first shard is on disk, the save is mid-way
        assert line.strip() == "shard"
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert not target.exists()
    leftovers = sorted(p.name for p in tmp_path.iterdir())
    # the killed save's temporary folder, and the lock file it held (the kernel released the lock)
    assert leftovers[0] == ".killed.floatxq-lock" and len(leftovers) == 2
    assert leftovers[1].startswith(".killed.floatxq-tmp-")
    # the next save to the same place succeeds and sweeps the stale temporary directory away
    q = fq.load(_small("llama"), quantize_config=fq.FP8Config()).quantize(progress=False)
    q.save(target)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["killed"]
    assert fq.load(target).quantized


def _saved(tmp_path) -> Path:
    q = fq.load(_small("llama"), quantize_config=fq.FP8Config()).quantize(progress=False)
    return q.save(tmp_path / "m", layout="gptqmodel")


def test_missing_and_corrupt_files_name_the_culprit(tmp_path):
    out = _saved(tmp_path)
    shard = out / "model.safetensors"
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match=r"model\.safetensors is truncated"):
        fq.load(out)
    shard.write_bytes(b"\x05\x00")
    with pytest.raises(CheckpointError, match="truncated"):
        fq.load(out)
    shard.unlink()
    with pytest.raises(CheckpointError, match="no \\*\\.safetensors files"):
        fq.load(out)
    (out / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="config.json is not valid JSON"):
        fq.load(out)
    (out / "config.json").unlink()
    with pytest.raises(CheckpointError, match="config.json is missing"):
        fq.load(out)
    with pytest.raises(CheckpointError, match="not a model directory"):
        fq.load(tmp_path / "nowhere")


def test_config_without_quantization_config_is_rejected(tmp_path):
    out = _saved(tmp_path)
    config = json.loads((out / "config.json").read_text())
    del config["quantization_config"]
    (out / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="no 'quantization_config'.*undeclared"):
        fq.load(out)


def test_unknown_method_and_bad_scale_shapes(tmp_path):
    out = _saved(tmp_path)
    config = json.loads((out / "config.json").read_text())
    config["quantization_config"]["method"] = "awq"
    config["quantization_config"]["quant_method"] = "awq"
    (out / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="quant_method 'awq' is not read"):
        fq.load(out)


def test_scale_that_fits_no_layout_names_the_tensor(tmp_path):
    from safetensors.torch import load_file, save_file

    out = _saved(tmp_path)
    state = load_file(out / "model.safetensors")
    state["model.layers.0.mlp.up_proj.weight_scale_inv"] = torch.ones(7)
    save_file(state, out / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"model\.layers\.0\.mlp\.up_proj\.weight_scale_inv"):
        fq.load(out)


def test_backends():
    model = _small("llama")
    assert fq.load(model, quantize_config=fq.FP8Config()).backend == fq.BACKEND.FP8_TORCH
    assert fq.load(model, backend="fp8_torch").backend == fq.BACKEND.FP8_TORCH
    assert fq.load(model, backend=" AUTO ").backend == fq.BACKEND.FP8_TORCH
    gptq = fq.GPTQConfig()
    assert fq.load(model, quantize_config=gptq).backend == fq.BACKEND.GPTQ_TORCH
    assert fq.load(model, quantize_config=gptq, backend="gptq_torch").backend == "gptq_torch"
    with pytest.raises(ValueError, match="backend 'fast' is not available in floatxq"):
        fq.load(model, quantize_config=fq.FP8Config(), backend="fast")
    with pytest.raises(ValueError, match="backend 'mlx' runs a saved checkpoint"):
        fq.load(model, quantize_config=fq.FP8Config(), backend="mlx")
    for name in ("gptq_w4afp8", "gptq_w4a_nvfp4"):
        with pytest.raises(ValueError, match=f"backend '{name}' cannot run FP8 weight-only"):
            fq.load(model, quantize_config=fq.FP8Config(), backend=name)
    with pytest.raises(ValueError, match="backend 'gptq_torch' cannot run FP8 weight-only models"):
        fq.load(model, quantize_config=fq.FP8Config(), backend="gptq_torch")
    with pytest.raises(ValueError, match="backend 'fp8_torch' cannot run GPTQ"):
        fq.load(model, quantize_config=gptq, backend="fp8_torch")


def test_quantize_config_payloads_name_their_method():
    model = _small("llama")
    loaded = fq.load(model, quantize_config={"method": "gptq", "bits": 8, "group_size": 32})
    assert isinstance(loaded.quantize_config, fq.GPTQConfig)
    assert (loaded.quantize_config.bits, loaded.quantize_config.group_size) == (8, 32)
    with pytest.raises(ValueError, match="method 'awq' is not supported"):
        fq.load(model, quantize_config={"quant_method": "awq"})


def test_a_payload_dict_is_read_as_gptqmodel_writes_it():
    payload = {"fmt": "e5m2", "weight_block_size": [32, 32], "weight_only": True, "bits": 8}
    q = fq.load(_small("llama"), quantize_config=payload)
    assert q.quantize_config == fq.FP8Config(format="e5m2", weight_block_size=(32, 32))
    with pytest.raises(ValueError, match="smoother is not available yet in floatxq"):
        fq.load(_small("llama"), quantize_config={"smoother": {"alpha": 0.5}})


def test_a_checkpoint_that_needs_a_missing_feature_is_refused(tmp_path):
    out = _saved(tmp_path)
    config = json.loads((out / "config.json").read_text())
    config["quantization_config"]["smoother"] = {"name": "smoothquant"}
    (out / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="smoother: an FP8 smoother is not available yet"):
        fq.load(out)


def test_quantize_twice_or_without_config_is_an_error(tmp_path):
    q = fq.load(_small("llama"))
    with pytest.raises(RuntimeError, match="no quantize_config"):
        q.quantize(progress=False)
    with pytest.raises(RuntimeError, match="quantize\\(\\) the model first"):
        q.save(tmp_path / "x")
    q.quantize_config = fq.FP8Config()
    q.quantize(progress=False)
    with pytest.raises(RuntimeError, match="already quantized"):
        q.quantize(progress=False)


def test_plain_directory_loads_and_tokenizer_files_travel(tmp_path):
    model = _small("llama")
    model.save_pretrained(tmp_path / "plain")
    (tmp_path / "plain" / "tokenizer.json").write_text("{}")
    q = fq.load(tmp_path / "plain", quantize_config=fq.FP8Config()).quantize(progress=False)
    out = q.save(tmp_path / "fp8")
    assert (out / "tokenizer.json").read_text() == "{}"
    assert fq.load(out).quantized


@pytest.mark.gpu
@pytest.mark.parametrize("model_type", ["llama", "gpt2"])
def test_cuda_quantize_save_load_matches_cpu_bytes(tmp_path, model_type):
    cpu = fq.load(_small(model_type), quantize_config=fq.FP8Config()).quantize(progress=False)
    gpu = fq.load(_small(model_type), quantize_config=fq.FP8Config(), device="cuda")
    gpu.quantize(progress=False)
    for name in cpu.quantized_modules:
        a = dict(cpu.model.named_modules())[name]
        b = dict(gpu.model.named_modules())[name]
        assert b.weight.is_cuda
        assert_bitwise_equal(b.weight, a.weight, msg=name)
        assert_bitwise_equal(b.weight_scale_inv, a.weight_scale_inv, msg=name)
    out = gpu.save(tmp_path / "gpu", layout="gptqmodel")  # the layout that keeps scale bytes
    loaded = fq.load(out, device="cuda")
    ids = _ids().cuda()
    assert_bitwise_equal(loaded.model(input_ids=ids).logits, gpu.model(input_ids=ids).logits)


def test_a_loaded_checkpoint_saves_again_unchanged(tmp_path):
    from safetensors.torch import load_file

    first = _saved(tmp_path)
    again = fq.load(first).save(tmp_path / "again", layout="gptqmodel")
    a, b = load_file(first / "model.safetensors"), load_file(again / "model.safetensors")
    assert set(a) == set(b)
    for name in a:
        assert_bitwise_equal(b[name], a[name], msg=name)
    assert json.loads((again / "config.json").read_text()) == json.loads(
        (first / "config.json").read_text()
    )
    with pytest.warns(UserWarning, match="already quantized"):
        fq.load(first, quantize_config=fq.FP8Config(format="e5m2"))
