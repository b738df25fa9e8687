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


def test_cuda_and_cpu_runs_are_equally_good():
    # Same calibration, same model: FP32 GEMMs sum in another order on the GPU, and GPTQ's error
    # feedback carries any moved code into later columns, so the bytes differ; the quality must
    # not. Each run's logit error against the unquantized model is within 25% of the other's.
    samples = _samples()
    reference = _model(torch.float32)
    cpu = floatxq.load(copy.deepcopy(reference), quantize_config=CONFIG, device="cpu")
    cpu.quantize(samples, progress=False)
    gpu = floatxq.load(copy.deepcopy(reference), quantize_config=CONFIG, device="cuda")
    gpu.quantize(samples, progress=False)
    ids = torch.stack([s[:22] for s in samples])
    with torch.no_grad():
        a = cpu.model(input_ids=ids).logits
        b = gpu.model(input_ids=ids.cuda()).logits.cpu()
        full = reference(input_ids=ids).logits
    err_cpu, err_gpu = (a - full).abs().mean(), (b - full).abs().mean()
    assert err_gpu < 1.25 * err_cpu and err_cpu < 1.25 * err_gpu, (err_cpu, err_gpu)
    assert [m.name for m in cpu.report.modules] == [m.name for m in gpu.report.modules]


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


def test_without_a_device_gptq_works_on_the_gpu_and_leaves_the_model_where_it_was():
    qm = floatxq.load(_model(), quantize_config=CONFIG)
    seen = []
    qm.model.model.layers[1].register_forward_pre_hook(
        lambda _m, args: seen.append(args[0].device.type)
    )
    qm.quantize(_samples(), progress=False)
    assert seen and set(seen) == {"cuda"}
    assert all(t.device.type == "cpu" for t in qm.model.state_dict().values())
