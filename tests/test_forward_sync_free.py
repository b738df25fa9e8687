"""Every quantized module's ``forward`` on CUDA reads nothing back from the device: each call
runs under ``torch.cuda.set_sync_debug_mode("error")``, which raises on any device-to-host
synchronisation. The module is built (and ``post_init``-ed) first, and one call of another row
count warms the kernels; the checked calls include row counts not seen before."""

import pytest
import torch
from torch import nn

import floatxq as fq
from floatxq.gptq.solve import GPTQSolveOptions, rtn_quantize


def _gptq(bits: int = 4) -> fq.GPTQLinear:
    sol = rtn_quantize(torch.randn(256, 512), GPTQSolveOptions(bits=bits, group_size=128, sym=True))
    return fq.GPTQLinear.from_solution(sol, bits=bits, group_size=128, bias=torch.randn(256))


BUILDERS = {
    "TorchFP8Linear row": lambda: fq.TorchFP8Linear.from_linear(nn.Linear(512, 256)),
    "TorchFP8Linear block": lambda: fq.TorchFP8Linear.from_linear(
        nn.Linear(512, 256), weight_scale_method="block", weight_block_size=(128, 128)
    ),
    "TorchFP8Linear token activations": lambda: fq.TorchFP8Linear.from_linear(
        nn.Linear(512, 256), input_quant="token"
    ),
    "TorchFP8Linear static activations": lambda: fq.TorchFP8Linear.from_linear(
        nn.Linear(512, 256), weight_scale_method="tensor", input_quant="static", input_scale=0.01
    ),
    "TorchFP4Linear": lambda: fq.TorchFP4Linear.from_linear(nn.Linear(512, 256)),
    "TorchFP4Linear W4A4": lambda: fq.TorchFP4Linear.from_linear(
        nn.Linear(512, 256), input_scale=0.0017
    ),
    "GPTQLinear": _gptq,
    "GPTQLinear 8-bit": lambda: _gptq(8),
    "W4AFP8Linear": lambda: fq.W4AFP8Linear.from_gptq_linear(_gptq()),
    "W4ANVFP4Linear": lambda: fq.W4ANVFP4Linear.from_gptq_linear(_gptq()),
}


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(BUILDERS))
def test_forward_reads_nothing_back(name):
    layer = BUILDERS[name]().cuda()
    if hasattr(layer, "post_init"):
        layer.post_init()
    layer(torch.randn(3, 512, device="cuda", dtype=torch.bfloat16))  # kernels compiled
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for rows in (1, 16, 33, 300):
            x = torch.randn(rows, 512, device="cuda", dtype=torch.bfloat16)
            out = layer(x)
            assert out.shape == (rows, 256)
    finally:
        torch.cuda.set_sync_debug_mode(previous)
    assert bool(torch.isfinite(out).all())
