"""The GPTQ lifecycle on CUDA: one layer on the device at a time, native FP8 capture for sources."""

import copy
from pathlib import Path

import pytest
import torch
from torch import nn

import floatxq
from floatxq import GPTQConfig
from floatxq.nn.gptq_linear import GPTQLinear

pytestmark = pytest.mark.gpu

FIXTURE = Path(__file__).parent / "fixtures" / "tiny_random_llama"
CONFIG = GPTQConfig(bits=4, group_size=64)


def _model(dtype=torch.bfloat16) -> nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(FIXTURE, dtype=dtype).eval()


def _samples(count: int = 6) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return [torch.randint(2, 128, (n,), generator=gen) for n in (40, 63, 31, 50, 22, 60)[:count]]


def test_only_one_layer_is_on_the_device_at_a_time():
    model = _model()
    layers = model.model.layers
    seen = []

    def probe(_module, _args):
        seen.append([next(layer.parameters()).device.type for layer in layers])

    handles = [layer.register_forward_pre_hook(probe) for layer in layers]
    qm = floatxq.load(model, quantize_config=CONFIG, device="cuda")
    qm.quantize(_samples(), batch_size=3, progress=False)
    for handle in handles:
        handle.remove()
    assert seen and all(row.count("cuda") == 1 for row in seen)
    assert next(qm.model.parameters()).device.type == "cuda"  # the result goes to `device`
    assert all(
        isinstance(qm.model.get_submodule(n), GPTQLinear)
        and qm.model.get_submodule(n).qweight.device.type == "cuda"
        for n in qm.quantized_modules
    )


def test_cuda_and_cpu_runs_agree():
    # Same calibration, same model: GEMM rounding differs between devices, so a few codes may
    # move; the quantized models' logits must still agree far better than INT4 error itself.
    samples = _samples()
    reference = _model(torch.float32)
    cpu = floatxq.load(copy.deepcopy(reference), quantize_config=CONFIG).quantize(
        samples, progress=False
    )
    gpu = floatxq.load(copy.deepcopy(reference), quantize_config=CONFIG, device="cuda")
    gpu.quantize(samples, progress=False)
    ids = samples[0][None]
    with torch.no_grad():
        a = cpu.model(input_ids=ids).logits
        b = gpu.model(input_ids=ids.cuda()).logits.cpu()
        full = reference(input_ids=ids).logits
    codes_equal = sum(
        torch.equal(cpu.model.get_submodule(n).qweight, gpu.model.get_submodule(n).qweight.cpu())
        for n in cpu.quantized_modules
    )
    assert codes_equal >= len(cpu.quantized_modules) // 2
    assert (a - b).abs().max() < 0.25 * (a - full).abs().max()


def test_fp8_source_capture_runs_the_native_fp8_forward(tmp_path):
    from floatxq.nn.fp8_linear import TorchFP8Linear

    fp8 = floatxq.load(_model(), quantize_config=floatxq.FP8Config(weight_scale_method="row"))
    fp8.quantize(progress=False)
    fp8.save(tmp_path / "fp8")
    source = floatxq.load(tmp_path / "fp8", quantize_config=CONFIG, device="cuda")
    routes = []
    for module in source.model.modules():
        if isinstance(module, TorchFP8Linear):
            module.register_forward_hook(lambda m, _a, _o: routes.append(m.last_route))
    source.quantize(_samples(), batch_size=2, progress=False)
    assert routes and all(r.startswith(("scaled_mm", "fp8_small_m")) for r in routes), set(routes)
    assert len(source.quantized_modules) == 14
