"""CUDA gives the same bytes as CPU for every pure function (the device-invariance guarantee of
``docs/numerics.md``)."""

import pytest
import torch

import floatxq as fq
from floatxq.testing import assert_bitwise_equal

pytestmark = pytest.mark.gpu

ENCODABLE = ["float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz"]
LAYOUTS = [("tensor", None), ("row", None), ("block", (128, 128)), ("block", (1, 64))]


def _weight(seed: int, rows: int, cols: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, cols, generator=g) * torch.exp2(
        torch.randint(-40, 40, (rows, 1), generator=g)
    )
    w[0] = 0.0
    w[1] = 0.0
    w[1, 5] = 1e-38  # tiny amax: capped scale
    return w


@pytest.mark.parametrize("name", ENCODABLE)
@pytest.mark.parametrize(("method", "block"), LAYOUTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantize_fp8_weight_cuda_equals_cpu(name, method, block, dtype):
    w = _weight(0, 256, 384).to(dtype)
    kw = dict(format=name, weight_scale_method=method, weight_block_size=block)
    cpu = fq.quantize_fp8_weight(w, **kw)
    gpu = fq.quantize_fp8_weight(w.cuda(), **kw)
    assert gpu.qweight.is_cuda and gpu.scale_inv.is_cuda
    assert_bitwise_equal(gpu.qweight, cpu.qweight, msg="codes")
    assert_bitwise_equal(gpu.scale_inv, cpu.scale_inv, msg="scale_inv")
    back = fq.dequantize_fp8_weight_transposed(gpu.qweight, gpu.scale_inv, dtype=dtype)
    assert_bitwise_equal(back, fq.dequantize_fp8_weight_transposed(*cpu, dtype=dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_fp8_tokens_cuda_equals_cpu(dtype):
    x = _weight(1, 512, 1024).clamp(-6e4, 6e4).to(dtype)
    assert_bitwise_equal(fq.fp8_token_qdq(x.cuda()), fq.fp8_token_qdq(x))
    cpu, gpu = fq.fp8_token_quantize(x), fq.fp8_token_quantize(x.cuda())
    assert_bitwise_equal(gpu.codes, cpu.codes)
    assert_bitwise_equal(gpu.scale, cpu.scale)


@pytest.mark.parametrize("name", ENCODABLE)
def test_fp8_cast_every_bf16_cuda_equals_cpu(name):
    bf16 = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    assert_bitwise_equal(fq.fp8_cast(bf16.cuda(), format=name), fq.fp8_cast(bf16, format=name))


def test_decoders_cuda_equal_cpu():
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    assert_bitwise_equal(fq.decode_e8m0(codes.cuda()), fq.decode_e8m0(codes))
    for name in ENCODABLE:
        view = codes.view(fq.fp8_dtype(name))
        assert_bitwise_equal(fq.fp8_decode(view.cuda()), fq.fp8_decode(view))
    s = torch.tensor([0.5, 0.0, 3.0, 1e-30])
    assert_bitwise_equal(fq.direct_to_inverse_scale(s.cuda()), fq.direct_to_inverse_scale(s))


@pytest.mark.parametrize(
    "recipe", ["nvidia", "four_six", "least_squares", "least_squares_grid", "exhaustive"]
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_nvfp4_cuda_equals_cpu(recipe, dtype):
    x = _weight(2, 96, 512).clamp(-1e15, 1e15).to(dtype)
    for g in (None, 1.0, 3.0e-3):
        cpu, gpu = fq.nvfp4_block_scales(x, g, recipe), fq.nvfp4_block_scales(x.cuda(), g, recipe)
        assert_bitwise_equal(gpu.codes, cpu.codes, msg=f"codes {recipe} {g}")
        assert_bitwise_equal(gpu.block_scales, cpu.block_scales, msg=f"scales {recipe} {g}")
        assert_bitwise_equal(gpu.global_scale, cpu.global_scale)
        assert_bitwise_equal(
            fq.nvfp4_block_qdq(x.cuda(), g, recipe), fq.nvfp4_block_qdq(x, g, recipe)
        )
        sse = fq.nvfp4_block_sse(x.cuda(), gpu.block_scales, gpu.global_scale)
        assert_bitwise_equal(sse, fq.nvfp4_block_sse(x, cpu.block_scales, cpu.global_scale))


def test_nvfp4_swizzle_and_headroom_cuda_equal_cpu():
    scales = torch.rand(300, 24).to(torch.float8_e4m3fn)
    assert_bitwise_equal(
        fq.swizzle_scales_per_group(scales.cuda()), fq.swizzle_scales_per_group(scales)
    )
    x = _weight(3, 64, 256)
    cpu = fq.headroom_update(fq.headroom_init(), x)
    gpu = fq.headroom_update(fq.headroom_init(), x.cuda())
    assert torch.equal(gpu.counts.cpu(), cpu.counts)
    assert fq.headroom_amax(gpu).item() == fq.headroom_amax(cpu).item()
