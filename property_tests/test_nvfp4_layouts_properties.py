"""NVFP4 weights in each producer's layout: every reader and writer is a lossless map to the
canonical record (ModelOpt's layout), the only rounding being compressed-tensors' reciprocal.

Also the tensor-core operand (:func:`floatxq.nvfp4_pack_swizzled`) as the scale search plus two
permutations, and the dynamic global scale as :func:`floatxq.nvfp4_global_scale` of the amax.
"""

import math

import hypothesis.extra.numpy as hnp
import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import floatxq as fq
from floatxq.testing import assert_bitwise_equal
from floatxq.testing.strategies import nvfp4_inputs

E4M3 = torch.float8_e4m3fn


@st.composite
def nvfp4_weights(draw, *, max_rows: int = 6, max_blocks: int = 3) -> fq.NVFP4Weight:
    """A canonical record: any bytes, block scales drawn from every non-negative finite E4M3 byte
    (0..126), and a positive finite FP32 global scale between ``2**-60`` and ``2**60``."""
    rows = draw(st.integers(1, max_rows))
    blocks = draw(st.integers(1, max_blocks))
    packed = draw(hnp.arrays(np.uint8, (rows, 8 * blocks)))
    scales = draw(hnp.arrays(np.uint8, (rows, blocks), elements=st.integers(0, 126)))
    mantissa = draw(st.floats(1.0, 2.0, exclude_max=True, width=32))
    g = torch.tensor(mantissa * 2.0 ** draw(st.integers(-60, 60)), dtype=torch.float32)
    return fq.NVFP4Weight(
        torch.from_numpy(packed), torch.from_numpy(scales).view(E4M3), g.reshape(())
    )


def _same_record(a: fq.NVFP4Weight, b: fq.NVFP4Weight) -> None:
    assert_bitwise_equal(a.packed, b.packed)
    assert_bitwise_equal(a.block_scales.view(torch.uint8), b.block_scales.view(torch.uint8))
    assert_bitwise_equal(a.global_scale, b.global_scale)


@given(st.one_of(hnp.arrays(np.uint8, st.integers(0, 40)), hnp.arrays(np.uint8, (3, 5))))
def test_swap_nibbles_is_an_involution_that_exchanges_the_halves(data):
    packed = torch.from_numpy(data)
    swapped = fq.swap_nibbles(packed)
    assert_bitwise_equal(fq.swap_nibbles(swapped), packed)
    assert_bitwise_equal(swapped & 0xF, packed >> 4)
    assert_bitwise_equal(swapped >> 4, packed & 0xF)
    assert packed.untyped_storage().data_ptr() != swapped.untyped_storage().data_ptr() or (
        packed.numel() == 0
    )


@given(nvfp4_weights())
def test_modelopt_round_trip_is_the_identity(w):
    tensors = fq.nvfp4_to_modelopt(w)
    back = fq.nvfp4_from_modelopt(
        tensors["weight"], tensors["weight_scale"], tensors["weight_scale_2"]
    )
    _same_record(back, w)
    # uint8 bytes for the scales and a [1] tensor scale read the same
    again = fq.nvfp4_from_modelopt(
        w.packed, w.block_scales.view(torch.uint8).flatten(), w.global_scale.reshape(1)
    )
    _same_record(again, w)


@given(nvfp4_weights())
def test_compressed_tensors_round_trip_keeps_bytes_and_the_scale_within_one_ulp(w):
    tensors = fq.nvfp4_to_compressed_tensors(w)
    divisor = tensors["weight_global_scale"]
    assert divisor.shape == (1,) and divisor.dtype == torch.float32
    # compressed-tensors' scale divides: the writer stores the FP32 reciprocal, once rounded
    assert divisor.item() == float(np.float32(1.0) / np.float32(w.global_scale.item()))
    back = fq.nvfp4_from_compressed_tensors(
        tensors["weight_packed"], tensors["weight_scale"], divisor
    )
    assert_bitwise_equal(back.packed, w.packed)
    assert_bitwise_equal(back.block_scales.view(torch.uint8), w.block_scales.view(torch.uint8))
    g, got = w.global_scale.item(), back.global_scale.item()
    assert abs(got - g) <= 2.0**-23 * g
    if math.frexp(g)[0] == 0.5:  # a power of two has an exact reciprocal
        assert got == g


def _swizzled(w: fq.NVFP4Weight) -> torch.Tensor:
    return fq.swizzle_scales(w.block_scales.view(torch.uint8)).view(E4M3)


@given(nvfp4_weights(max_rows=3), st.booleans())
def test_comfy_is_the_record_with_nibbles_swapped_and_scales_swizzled(w, two_d):
    scales = _swizzled(w)
    if two_d:  # Comfy stores the padded grid 2-D; only the element order matters
        scales = scales.reshape(-1, 4)
    got = fq.nvfp4_from_comfy(
        fq.swap_nibbles(w.packed), scales, w.global_scale.to(torch.bfloat16).float(), shape=w.shape
    )
    expected = w._replace(global_scale=w.global_scale.to(torch.bfloat16).float())
    _same_record(got, expected)


@given(nvfp4_weights(max_rows=3), st.booleans(), st.booleans())
def test_torchao_reads_linear_and_swizzled_scales_to_the_same_record(w, swizzled, no_scale):
    scales = _swizzled(w) if swizzled else w.block_scales
    per_tensor = None if no_scale else w.global_scale
    got = fq.nvfp4_from_torchao(
        w.packed, scales, per_tensor, shape=w.shape, is_swizzled_scales=swizzled
    )
    expected = w._replace(global_scale=torch.ones(())) if no_scale else w
    _same_record(got, expected)


@given(nvfp4_weights(), st.sampled_from([torch.float32, torch.bfloat16, torch.float16]))
def test_dequantize_weight_is_nvfp4_dequantize_of_the_fields(w, dtype):
    got = fq.nvfp4_dequantize_weight(w, dtype=dtype)
    assert got.shape == w.shape and got.dtype == dtype
    assert_bitwise_equal(got, fq.nvfp4_dequantize(*w, dtype=dtype))
    # and the decode itself: (e2m1(code) · scale) · g, then one rounding into dtype
    codes = fq.unpack_e2m1(w.packed)
    values = fq.e2m1_decode(codes).reshape(w.shape[0], -1, 16)
    exact = (values * w.block_scales.float()[..., None]).reshape(w.shape) * w.global_scale
    limit = torch.finfo(dtype).max
    assert_bitwise_equal(got, exact.clamp(-limit, limit).to(dtype))


@settings(max_examples=max(10, settings.default.max_examples // 2))
@given(
    nvfp4_inputs(max_rows=2, max_blocks=8, block_spread=10),
    st.sampled_from(["nvidia", "least_squares"]),
)
def test_pack_swizzled_is_the_scale_search_packed_and_swizzled_per_group(x, recipe):
    k = x.shape[1] - x.shape[1] % 128
    if k == 0:
        x = torch.cat([x] * -(-128 // x.shape[1]), dim=1)[:, :128]
        k = 128
    x = x[:, :k].contiguous()
    g = fq.nvfp4_global_scale(x.abs().amax(), recipe=recipe)
    packed, scales = fq.nvfp4_pack_swizzled(x, g, recipe=recipe)
    blocks = fq.nvfp4_block_scales(x, g, recipe)
    assert_bitwise_equal(packed.view(torch.uint8), fq.pack_e2m1(blocks.codes))
    expected = fq.swizzle_scales_per_group(blocks.block_scales.view(torch.uint8))
    assert_bitwise_equal(scales.view(torch.uint8), expected.view(torch.uint8))


@given(
    nvfp4_inputs(max_rows=3, max_blocks=2, block_spread=4, max_magnitude=2.0**10),
    st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
    st.sampled_from(["nvidia", "least_squares", "nvidia_headroom", "exhaustive"]),
)
def test_dynamic_global_scale_is_the_global_scale_of_the_amax_on_the_dtype_grid(x, dtype, recipe):
    x = x.to(dtype)
    got = fq.nvfp4_dynamic_global_scale(x, recipe=recipe)
    expected = fq.nvfp4_global_scale(x.abs().amax().float(), grid_dtype=dtype, recipe=recipe)
    assert got.dtype == torch.float32 and got.shape == ()
    assert_bitwise_equal(got, expected)
    # scaling the input by a power of two scales the FP32 scale by it (before the dtype grid)
    if dtype == torch.float32 and x.abs().amax() > 0:
        assert_bitwise_equal(fq.nvfp4_dynamic_global_scale(x * 4, recipe=recipe), got * 4)
