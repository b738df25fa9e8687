"""Loading the peers' NVFP4 W4A4 checkpoints: compressed-tensors' ``NVFP4`` scheme (written here
by compressed-tensors itself) and ModelOpt's NVFP4 export (its documented layout, by
:mod:`floatxq.testing.foreign`), run as ``TorchFP4Linear`` modules with an ``input_scale``.

The references are independent of floatxq's readers: for compressed-tensors, its own FP32
decompression of the weights and its own activation fake-quantization (``forward_quantize``)
hooked into a dense FP32 Llama; for ModelOpt, the writer's dense decode with the activations
quantize-dequantized at the file's ``input_scale``.
"""

import json
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn

import floatxq
from floatxq.interop.checkpoint import CheckpointError
from floatxq.interop.inspect import inspect_checkpoint
from floatxq.nn.fp4_linear import TorchFP4Linear
from floatxq.nvfp4.quantize import nvfp4_block_qdq
from floatxq.testing import assert_bitwise_equal

FIXTURES = Path(__file__).parent / "fixtures"
IDS = torch.tensor([[1, 5, 9, 33, 70, 2, 101, 7, 12, 64]])


def _linears(model: nn.Module) -> dict[str, nn.Module]:
    return {n: m for n, m in model.named_modules() if n.startswith("model.layers.")
            and isinstance(m, (nn.Linear, TorchFP4Linear))}  # fmt: skip


def _dense_llama(path: Path) -> nn.Module:
    from transformers import AutoConfig, AutoModelForCausalLM

    payload = json.loads((path / "config.json").read_text())
    payload.pop("quantization_config", None)
    config = AutoConfig.for_model(payload.pop("model_type"), **payload)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()


# ----------------------------------------------------------------------------------------------
# compressed-tensors' NVFP4 (W4A4), written by compressed-tensors
# ----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def ct_w4a4(tmp_path_factory) -> Path:
    """The tiny Llama quantized by compressed-tensors with its ``NVFP4`` preset: global scales
    from its own ``generate_gparam`` (weights: their amax; inputs: the amax seen on IDS), block
    scales from its ``calculate_qparams``, packed by its ``ModelCompressor``."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (
        QuantizationConfig,
        apply_quantization_config,
        preset_name_to_scheme,
    )
    from compressed_tensors.quantization.utils import calculate_qparams, generate_gparam
    from transformers import AutoModelForCausalLM

    src = FIXTURES / "tiny_random_llama"
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.bfloat16).eval()
    amax: dict[str, float] = {}

    def seen(name):
        def hook(module, args):
            amax[name] = max(amax.get(name, 0.0), args[0].abs().amax().float().item())

        return hook

    hooks = [m.register_forward_pre_hook(seen(n)) for n, m in _linears(model).items()]
    with torch.no_grad():
        model(IDS)
    for hook in hooks:
        hook.remove()
    scheme = preset_name_to_scheme("NVFP4", ["Linear"])
    config = QuantizationConfig(config_groups={"group_0": scheme}, ignore=["lm_head"])
    apply_quantization_config(model, config)
    for name, module in _linears(model).items():
        w = module.weight.detach()
        wg = generate_gparam(w.amin(), w.amax())
        blocks = w.unflatten(-1, (w.shape[-1] // 16, 16))
        scale, _ = calculate_qparams(blocks.amin(-1), blocks.amax(-1), scheme.weights, wg)
        module.weight_global_scale.data.copy_(wg)
        module.weight_scale.data.copy_(scale)
        a = torch.tensor(amax[name])
        module.input_global_scale.data.copy_(generate_gparam(-a, a))
    compressor = ModelCompressor.from_pretrained_model(
        model, quantization_format="nvfp4-pack-quantized"
    )
    compressor.compress_model(model)
    out = tmp_path_factory.mktemp("ct") / "nvfp4"
    out.mkdir()
    state = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    shutil.copyfile(src / "config.json", out / "config.json")
    compressor.update_config(str(out))
    return out


def _ct_reference_logits(path: Path) -> torch.Tensor:
    """compressed-tensors' own numerics in FP32: its weight decompression, its activation
    fake-quantization at each module's ``input_global_scale``."""
    from compressed_tensors.compressors.nvfp4.helpers import unpack_fp4_from_uint8
    from compressed_tensors.quantization import preset_name_to_scheme
    from compressed_tensors.quantization.lifecycle.forward import dequantize, forward_quantize
    from compressed_tensors.quantization.quant_config import QuantizationStatus

    scheme = preset_name_to_scheme("NVFP4", ["Linear"])
    files = load_file(str(path / "model.safetensors"))
    model = _dense_llama(path)
    state = {k: v.float() for k, v in files.items() if k in model.state_dict()}
    for name, module in _linears(model).items():
        packed = files[f"{name}.weight_packed"]
        rows, half = packed.shape
        codes = unpack_fp4_from_uint8(packed, rows, 2 * half, dtype=torch.float32)
        state[f"{name}.weight"] = dequantize(
            x_q=codes,
            scale=files[f"{name}.weight_scale"].float(),
            args=scheme.weights,
            global_scale=files[f"{name}.weight_global_scale"],
            dtype=torch.float32,
        )
        module.input_global_scale = files[f"{name}.input_global_scale"]
        module.quantization_status = QuantizationStatus.FROZEN

        def quantize_input(mod, args):
            return (forward_quantize(mod, args[0], "input", scheme.input_activations),)

        module.register_forward_pre_hook(quantize_input)
    model.load_state_dict(state, strict=True)
    with torch.no_grad():
        return model(IDS).logits


def test_ct_nvfp4_w4a4_loads_as_w4a4_fp4_linears(ct_w4a4):
    files = load_file(str(ct_w4a4 / "model.safetensors"))
    loaded = floatxq.load(ct_w4a4, dtype=torch.float32)
    modules = _linears(loaded.model)
    assert len(modules) == 14
    for name, module in modules.items():
        assert isinstance(module, TorchFP4Linear) and module.input_scale is not None, name
        stored = files[f"{name}.input_global_scale"]
        assert stored.dtype == torch.float32 and stored.shape == (1,)
        # floatxq's multiplier is the FP32 reciprocal of compressed-tensors' divisor
        expected = torch.ones((), dtype=torch.float32) / stored.reshape(())
        assert_bitwise_equal(module.input_scale, expected)
    report = inspect_checkpoint(ct_w4a4)
    assert report.layout == "compressed-tensors"
    assert (
        report.activations == "nvfp4 e2m1 block 16, static global scale (W4A4) on 14 NVFP4 modules"
    )


def test_ct_nvfp4_w4a4_logits_match_compressed_tensors_numerics(ct_w4a4):
    loaded = floatxq.load(ct_w4a4, dtype=torch.float32)
    with torch.no_grad():
        ours = loaded.model(IDS).logits
    theirs = _ct_reference_logits(ct_w4a4)
    # the same grid; the two round in a different order (compressed-tensors: max/6 times the
    # divisor, one code times scale/divisor; floatxq: max/(6·g), (code·scale)·g), so only a rare
    # block lands on another E4M3 or E2M1 value
    torch.testing.assert_close(ours, theirs, rtol=0, atol=2e-3)
    # the activations are really quantized: a weight-only run is far away
    for module in _linears(loaded.model).values():
        module.input_scale = None
    with torch.no_grad():
        weight_only = loaded.model(IDS).logits
    assert (weight_only - theirs).abs().max() > 20 * (ours - theirs).abs().max()


def _rewrite_config(path: Path, edit) -> None:
    payload = json.loads((path / "config.json").read_text())
    edit(payload["quantization_config"])
    (path / "config.json").write_text(json.dumps(payload))


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda q: q["config_groups"]["group_0"].__setitem__("input_activations", None),
         "input_global_scale is a static activation scale, but the quantization_config declares no"),  # noqa: E501
        (lambda q: q["config_groups"]["group_0"]["input_activations"].__setitem__("dynamic", True),
         "floatxq runs NVFP4 activations only as compressed-tensors' NVFP4 scheme does"),
        (lambda q: q["config_groups"]["group_0"]["input_activations"].__setitem__("group_size", 32),
         r"declares input activations .*group_size': 32"),
        (lambda q: q["config_groups"]["group_0"].__setitem__("output_activations", {"num_bits": 4}),
         "does not run output quantization"),
    ],
    ids=["scales-without-declaration", "dynamic-global-scale", "group-32", "output"],
)  # fmt: skip
def test_ct_nvfp4_activation_schemes_floatxq_cannot_run_are_refused(
    ct_w4a4, tmp_path, change, message
):
    path = tmp_path / "ct"
    shutil.copytree(ct_w4a4, path)
    _rewrite_config(path, change)
    with pytest.raises(CheckpointError, match=message):
        floatxq.load(path)


def test_ct_nvfp4_declared_activations_without_their_scales_are_refused(ct_w4a4, tmp_path):
    path = tmp_path / "ct"
    shutil.copytree(ct_w4a4, path)
    files = load_file(str(path / "model.safetensors"))
    name = "model.layers.1.mlp.up_proj.input_global_scale"
    save_file({k: v for k, v in files.items() if k != name}, str(path / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"up_proj.input_global_scale \(the static global"):
        floatxq.load(path)
    kv = tmp_path / "kv"
    shutil.copytree(ct_w4a4, kv)
    files["model.layers.0.self_attn.k_proj.k_scale"] = torch.ones(1)
    save_file(files, str(kv / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"k_proj.k_scale"):
        floatxq.load(kv)


# ----------------------------------------------------------------------------------------------
# ModelOpt NVFP4 (W4A4)
# ----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def dense_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("tiny") / "dense"
    shutil.copytree(FIXTURES / "tiny_random_llama", out)
    return out


def _modelopt_reference_logits(path: Path, dense: dict[str, torch.Tensor]) -> torch.Tensor:
    """The writer's dense decode, each input quantize-dequantized at the file's input_scale."""
    files = load_file(str(path / "model.safetensors"))
    model = _dense_llama(path)
    state = {k: v.float() for k, v in files.items() if k in model.state_dict()}
    for name, module in _linears(model).items():
        state[f"{name}.weight"] = dense[name].float()
        g = files[f"{name}.input_scale"]
        module.register_forward_pre_hook(
            lambda mod, args, g=g: (nvfp4_block_qdq(args[0], g, "nvidia"),)
        )
    model.load_state_dict(state, strict=True)
    with torch.no_grad():
        return model(IDS).logits


@pytest.mark.parametrize("sidecar", [True, False])
def test_modelopt_nvfp4_w4a4_loads_and_runs(dense_dir, tmp_path, sidecar):
    from floatxq.testing.foreign import ACTIVATION_AMAX, write_modelopt_nvfp4

    written = write_modelopt_nvfp4(dense_dir, tmp_path / "m", input_scale=True, sidecar=sidecar)
    loaded = floatxq.load(written.path, dtype=torch.float32)
    modules = _linears(loaded.model)
    assert len(modules) == 14
    expected = torch.tensor(ACTIVATION_AMAX) / torch.tensor(6.0 * 448.0)
    for module in modules.values():
        assert isinstance(module, TorchFP4Linear)
        assert_bitwise_equal(module.input_scale, expected)  # taken as stored: it multiplies
    with torch.no_grad():
        ours = loaded.model(IDS).logits
    assert_bitwise_equal(ours, _modelopt_reference_logits(written.path, written.dense))
    report = inspect_checkpoint(written.path)
    assert report.layout == "modelopt" and "(W4A4) on 14 NVFP4 modules" in report.activations


def test_modelopt_sidecar_only_w4a4_loads(dense_dir, tmp_path):
    from floatxq.testing.foreign import write_modelopt_nvfp4

    written = write_modelopt_nvfp4(dense_dir, tmp_path / "m", input_scale=True)
    _rewrite_config(written.path, lambda q: q.clear())  # an older export: the sidecar alone
    payload = json.loads((written.path / "config.json").read_text())
    payload.pop("quantization_config")
    (written.path / "config.json").write_text(json.dumps(payload))
    loaded = floatxq.load(written.path, dtype=torch.float32)
    assert all(m.input_scale is not None for m in _linears(loaded.model).values())


def _drop(path: Path, suffix: str, only: str | None = None) -> None:
    files = load_file(str(path / "model.safetensors"))
    keep = {k: v for k, v in files.items() if not (k.endswith(suffix) and (only or k) in k)}
    save_file(keep, str(path / "model.safetensors"))


def test_modelopt_w4a4_that_cannot_run_faithfully_is_refused(dense_dir, tmp_path):
    from floatxq.testing.foreign import write_modelopt_nvfp4

    declared = write_modelopt_nvfp4(dense_dir, tmp_path / "declared")  # no input_scale tensors
    with pytest.raises(CheckpointError, match=r"input_scale is missing \(14 of 14"):
        floatxq.load(declared.path)
    one = write_modelopt_nvfp4(dense_dir, tmp_path / "one", input_scale=True)
    _drop(one.path, ".input_scale", only="layers.1.mlp.down_proj")
    with pytest.raises(CheckpointError, match=r"down_proj.input_scale is missing \(1 of 14"):
        floatxq.load(one.path)
    kv = write_modelopt_nvfp4(dense_dir, tmp_path / "kv", input_scale=True)
    for name in ("hf_quant_config.json",):
        payload = json.loads((kv.path / name).read_text())
        payload["quantization"]["kv_cache_quant_algo"] = "FP8"
        (kv.path / name).write_text(json.dumps(payload))
    with pytest.raises(CheckpointError, match="not KV-cache quantization"):
        floatxq.load(kv.path)
    eight = write_modelopt_nvfp4(dense_dir, tmp_path / "eight", input_scale=True)
    _rewrite_config(
        eight.path,
        lambda q: q["config_groups"]["group_0"]["input_activations"].__setitem__("num_bits", 8),
    )
    with pytest.raises(CheckpointError, match="static input_scale \\(num_bits 4"):
        floatxq.load(eight.path)
    weight_only = write_modelopt_nvfp4(dense_dir, tmp_path / "wo", input_scale=True)
    for name in ("config.json", "hf_quant_config.json"):
        file = weight_only.path / name
        payload = json.loads(file.read_text())
        qc = payload.get("quantization_config", payload.get("quantization"))
        for group in (qc.get("config_groups") or {}).values():
            group["input_activations"] = None
        file.write_text(json.dumps(payload))
    with pytest.raises(CheckpointError, match="declares no input activations"):
        floatxq.load(weight_only.path)


def test_weight_only_modelopt_and_ct_nvfp4_still_load_weight_only(dense_dir, tmp_path):
    from floatxq.testing.foreign import write_modelopt_nvfp4

    written = write_modelopt_nvfp4(dense_dir, tmp_path / "wo")
    for name in ("config.json", "hf_quant_config.json"):
        file = written.path / name
        payload = json.loads(file.read_text())
        qc = payload.get("quantization_config", payload.get("quantization"))
        for group in (qc.get("config_groups") or {}).values():
            group["input_activations"] = None
        file.write_text(json.dumps(payload))
    loaded = floatxq.load(written.path)
    assert all(m.input_scale is None for m in _linears(loaded.model).values())
    assert inspect_checkpoint(written.path).activations == "none (weight-only)"
    ct = floatxq.load(FIXTURES / "llmcompressor_nvfp4a16")
    assert all(m.input_scale is None for m in _linears(ct.model).values())
    x = torch.randn(3, 128)
    module = _linears(ct.model)["model.layers.0.self_attn.q_proj"]
    assert_bitwise_equal(module(x.to(module.dtype)), F.linear(x.to(module.dtype),
                         module.dequantize_weight(module.dtype)))  # fmt: skip


# ----------------------------------------------------------------------------------------------
# llm-compressor's calibrated NVFP4 (W4A4) fixture, with the producer's own logits
# ----------------------------------------------------------------------------------------------


def test_llmcompressor_nvfp4_fixture_runs_as_the_producer():
    fixture = FIXTURES / "llmcompressor_nvfp4"
    stored = load_file(str(fixture / "llmcompressor_logits.safetensors"))
    loaded = floatxq.load(fixture, dtype=torch.float32)
    modules = _linears(loaded.model)
    assert len(modules) == 14
    assert all(
        isinstance(m, TorchFP4Linear) and m.input_scale is not None for m in modules.values()
    )
    with torch.no_grad():
        ours = loaded.model(stored["input_ids"]).logits
    # ``in_memory_fp32`` is llm-compressor's fake-quantized forward cast to FP32: the same scales
    # and grid as the files (its FP32 weight fake-quantization lands on the stored codes), so it
    # differs from floatxq's FP32 run only by the rounding order of the activation grid and FP32
    # summation (5.4e-7 measured, on logits of magnitude ~2.4); its bf16 runs are 0.38 away from
    # it, so 2e-6 can only hold for the same numerics
    assert float((ours - stored["in_memory_fp32"]).abs().max()) < 2e-6
    for module in modules.values():  # the activations are really quantized
        module.input_scale = None
    with torch.no_grad():
        weight_only = loaded.model(stored["input_ids"]).logits
    assert float((weight_only - stored["in_memory_fp32"]).abs().max()) > 0.05
    report = inspect_checkpoint(fixture)
    assert report.layout == "compressed-tensors"
    assert (
        report.activations == "nvfp4 e2m1 block 16, static global scale (W4A4) on 14 NVFP4 modules"
    )
