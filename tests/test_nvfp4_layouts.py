"""NVFP4 producer layouts: each reader against hand-built tensors, the writers, the round trips.

The oracles here are written from the formats' definitions, not from floatxq: nibbles are packed
byte by byte in Python, the 128x4 scale swizzle is built from the cuBLAS tile description (and
checked against its offset formula), and decoding is a float64 table lookup rounded once to FP32.
"""

import math

import numpy as np
import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from floatxq.nvfp4.layouts import (
    NVFP4Weight,
    nvfp4_dequantize_weight,
    nvfp4_from_comfy,
    nvfp4_from_compressed_tensors,
    nvfp4_from_modelopt,
    nvfp4_from_torchao,
    nvfp4_to_compressed_tensors,
    nvfp4_to_modelopt,
    swap_nibbles,
)
from floatxq.nvfp4.quantize import nvfp4_dequantize, nvfp4_quantize
from floatxq.nvfp4.swizzle import swizzle_scales
from floatxq.testing import assert_bitwise_equal

E4M3 = torch.float8_e4m3fn
E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
SMALL = settings(max_examples=30, deadline=None, derandomize=True, database=None)


# -- oracles -------------------------------------------------------------------------------------


def codes_of(rows: int, k: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 16, (rows, k), generator=g).tolist()


def scale_bytes_of(rows: int, cols: int, seed: int) -> torch.Tensor:
    """Positive finite E4M3 bytes (0x01..0x7E) as a float8_e4m3fn ``(rows, cols)`` matrix."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, 127, (rows, cols), generator=g, dtype=torch.uint8).view(E4M3)


def pack_low_first(codes: list[list[int]]) -> torch.Tensor:
    rows = [[row[2 * j] | (row[2 * j + 1] << 4) for j in range(len(row) // 2)] for row in codes]
    return torch.tensor(rows, dtype=torch.uint8)


def pack_high_first(codes: list[list[int]]) -> torch.Tensor:
    rows = [[(row[2 * j] << 4) | row[2 * j + 1] for j in range(len(row) // 2)] for row in codes]
    return torch.tensor(rows, dtype=torch.uint8)


def decode_oracle(codes: list[list[int]], scales: torch.Tensor, g: float) -> torch.Tensor:
    """``value * scale * g`` in float64 (exact: a few bits times a 24-bit g), rounded once."""
    s = scales.to(torch.float64).numpy()
    out = np.empty((len(codes), len(codes[0]) if codes else 0), dtype=np.float64)
    for r, row in enumerate(codes):
        for c, code in enumerate(row):
            value = -E2M1[code & 7] if code & 8 else E2M1[code & 7]
            out[r, c] = value * s[r, c // 16] * g
    return torch.from_numpy(out.astype(np.float32))


def swizzle_oracle(scales: torch.Tensor) -> torch.Tensor:
    """cuBLAS's 128x4 block-scale layout: pad rows to 128 and columns to 4, then each 128x4 tile
    (row tiles outer, column tiles inner) holds its 32 row-groups of 4x4 interleaved."""
    rows, cols = scales.shape
    rp, cp = -(-rows // 128) * 128, -(-cols // 4) * 4
    padded = torch.zeros((rp, cp), dtype=torch.uint8)
    padded[:rows, :cols] = scales.view(torch.uint8)
    tiled = padded.reshape(rp // 128, 4, 32, cp // 4, 4).permute(0, 3, 2, 1, 4)
    return tiled.reshape(-1).view(E4M3)


def test_swizzle_oracle_matches_the_offset_formula_and_floatxq():
    rows, cols = 130, 5  # crosses a row tile and a column tile
    scales = scale_bytes_of(rows, cols, seed=1)
    flat = swizzle_oracle(scales).view(torch.uint8)
    cp = 8
    for r in range(rows):
        for c in range(cols):
            offset = ((r // 128) * (cp // 4) + c // 4) * 512 + (r % 32) * 16
            offset += ((r % 128) // 32) * 4 + c % 4
            assert flat[offset] == scales.view(torch.uint8)[r, c], (r, c)
    assert flat.numel() == 256 * 8
    assert_bitwise_equal(swizzle_scales(scales), swizzle_oracle(scales))


# -- readers -------------------------------------------------------------------------------------


def test_modelopt_reads_hand_packed_bytes_unchanged():
    codes = codes_of(3, 32, seed=2)
    packed, scales = pack_low_first(codes), scale_bytes_of(3, 2, seed=3)
    w = nvfp4_from_modelopt(packed, scales, torch.tensor(0.375))
    assert isinstance(w, NVFP4Weight)
    assert_bitwise_equal(w.packed, packed)
    assert_bitwise_equal(w.block_scales, scales)
    assert_bitwise_equal(w.global_scale, torch.tensor(0.375))
    assert w.shape == (3, 32)
    assert_bitwise_equal(nvfp4_dequantize_weight(w), decode_oracle(codes, scales, 0.375))


def test_modelopt_accepts_fp4x2_codes_uint8_scales_and_a_one_element_scale():
    codes = codes_of(2, 16, seed=4)
    packed, scales = pack_low_first(codes), scale_bytes_of(2, 1, seed=5)
    w = nvfp4_from_modelopt(
        packed.view(torch.float4_e2m1fn_x2),
        scales.view(torch.uint8).reshape(-1),
        torch.tensor([2.0], dtype=torch.bfloat16),
    )
    assert_bitwise_equal(w.packed, packed)
    assert_bitwise_equal(w.block_scales, scales)
    assert_bitwise_equal(w.global_scale, torch.tensor(2.0))


def test_compressed_tensors_divides_by_its_global_scale():
    codes = codes_of(2, 48, seed=6)
    packed, scales = pack_low_first(codes), scale_bytes_of(2, 3, seed=7)
    w = nvfp4_from_compressed_tensors(packed, scales, torch.tensor([4.0]))
    assert_bitwise_equal(w.packed, packed)
    assert_bitwise_equal(w.block_scales, scales)
    assert w.global_scale.item() == 0.25  # a power of two: exact
    assert_bitwise_equal(nvfp4_dequantize_weight(w), decode_oracle(codes, scales, 0.25))

    w3 = nvfp4_from_compressed_tensors(packed, scales, torch.tensor([3.0]))
    assert w3.global_scale.item() == float(np.float32(1.0) / np.float32(3.0))
    exact = decode_oracle(codes, scales, 1.0).double() / 3.0  # the value CT means
    got = nvfp4_dequantize_weight(w3).double()
    assert ((got - exact).abs() <= exact.abs() * 2.0**-23).all()
    assert not torch.equal(got, exact)  # 1/3 rounds: the bound is not vacuous here


@pytest.mark.parametrize("two_d", [False, True], ids=["flat", "viewed-2d"])
def test_torchao_swizzled_scales_are_unswizzled(two_d):
    rows, k = 130, 80  # 130 rows pad to 256, 5 block columns pad to 8
    codes = codes_of(rows, k, seed=8)
    packed, scales = pack_low_first(codes), scale_bytes_of(rows, k // 16, seed=9)
    swizzled = swizzle_oracle(scales)
    if two_d:  # newer torchao views the same bytes as (ceil(M/128)·32, ceil(K/64)·16)
        swizzled = swizzled.reshape(64, 32)
    w = nvfp4_from_torchao(
        packed, swizzled, torch.tensor(0.5), shape=(rows, k), is_swizzled_scales=True
    )
    assert_bitwise_equal(w.block_scales, scales)
    assert_bitwise_equal(w.packed, packed)
    assert_bitwise_equal(nvfp4_dequantize_weight(w), decode_oracle(codes, scales, 0.5))


def test_torchao_linear_scales_and_no_per_tensor_scale():
    codes = codes_of(3, 32, seed=10)
    packed, scales = pack_low_first(codes), scale_bytes_of(3, 2, seed=11)
    for given_scales in (scales, scales.reshape(-1)):
        w = nvfp4_from_torchao(packed, given_scales, None, shape=(3, 32), is_swizzled_scales=False)
        assert_bitwise_equal(w.block_scales, scales)
        assert_bitwise_equal(w.global_scale, torch.tensor(1.0))
        assert_bitwise_equal(nvfp4_dequantize_weight(w), decode_oracle(codes, scales, 1.0))


def test_comfy_high_nibble_first_and_swizzled_scales():
    rows, k = 5, 96
    codes = codes_of(rows, k, seed=12)
    scales = scale_bytes_of(rows, k // 16, seed=13)
    comfy_scales = swizzle_oracle(scales).reshape(128, 8)  # Comfy keeps the padded 2-D shape
    w = nvfp4_from_comfy(pack_high_first(codes), comfy_scales, torch.tensor(3.0), shape=(rows, k))
    assert_bitwise_equal(w.packed, pack_low_first(codes))
    assert_bitwise_equal(w.block_scales, scales)
    assert_bitwise_equal(nvfp4_dequantize_weight(w), decode_oracle(codes, scales, 3.0))


def test_swap_nibbles_on_all_256_bytes():
    every = torch.arange(256, dtype=torch.uint8)
    expected = torch.tensor([((b & 15) << 4) | (b >> 4) for b in range(256)], dtype=torch.uint8)
    assert_bitwise_equal(swap_nibbles(every), expected)
    assert_bitwise_equal(swap_nibbles(swap_nibbles(every)), every)
    assert_bitwise_equal(swap_nibbles(every.view(torch.float4_e2m1fn_x2)), expected)


# -- errors (floatxq's own checks, not the test run's annotation check) --------------------------


def _good():
    return pack_low_first(codes_of(2, 32, seed=14)), scale_bytes_of(2, 2, seed=15)


@pytest.mark.usefixtures("production_checks")
def test_readers_reject_wrong_dtypes():
    packed, scales = _good()
    with pytest.raises(TypeError, match="weight must be uint8 or float4_e2m1fn_x2"):
        nvfp4_from_modelopt(packed.to(torch.int16), scales, torch.tensor(1.0))
    with pytest.raises(TypeError, match="weight_scale must be float8_e4m3fn"):
        nvfp4_from_modelopt(packed, scales.float(), torch.tensor(1.0))
    with pytest.raises(TypeError, match="weight_scale_2 must be a float32"):
        nvfp4_from_modelopt(packed, scales, torch.tensor(1, dtype=torch.int32))
    with pytest.raises(TypeError, match="swap_nibbles: packed"):
        swap_nibbles(torch.zeros(2, dtype=torch.int8))


@pytest.mark.usefixtures("production_checks")
def test_readers_reject_wrong_shapes():
    packed, scales = _good()
    with pytest.raises(ValueError, match=r"weight_scale must have shape \(2, 2\)"):
        nvfp4_from_modelopt(packed, scales[:, :1], torch.tensor(1.0))
    with pytest.raises(ValueError, match="not a multiple of 16"):
        nvfp4_from_modelopt(packed[:, :4], scales[:, :1], torch.tensor(1.0))
    with pytest.raises(ValueError, match="must be 2-D"):
        nvfp4_from_modelopt(packed.reshape(-1), scales, torch.tensor(1.0))
    with pytest.raises(ValueError, match="weight_scale_2 must hold one value"):
        nvfp4_from_modelopt(packed, scales, torch.ones(2))
    with pytest.raises(ValueError, match=r"qdata must have shape \(2, 8\)"):
        nvfp4_from_torchao(packed, scales, None, shape=(2, 16), is_swizzled_scales=False)
    with pytest.raises(ValueError, match="128x4-swizzled scales of a 2x2 grid are 512"):
        nvfp4_from_torchao(packed, scales, None, shape=(2, 32), is_swizzled_scales=True)
    with pytest.raises(ValueError, match="not a multiple of 16"):
        nvfp4_from_comfy(packed, swizzle_oracle(scales), torch.tensor(1.0), shape=(2, 24))


@pytest.mark.usefixtures("production_checks")
@pytest.mark.parametrize("bad", [0.0, -1.0, math.inf, math.nan])
def test_global_scales_must_be_finite_and_positive(bad):
    packed, scales = _good()
    with pytest.raises(ValueError, match="weight_scale_2 must be finite and > 0"):
        nvfp4_from_modelopt(packed, scales, torch.tensor(bad))
    with pytest.raises(ValueError, match="weight_global_scale must be finite and > 0"):
        nvfp4_from_compressed_tensors(packed, scales, torch.tensor([bad]))
    with pytest.raises(ValueError, match="per_tensor_scale must be finite and > 0"):
        nvfp4_from_torchao(
            packed, scales, torch.tensor(bad), shape=(2, 32), is_swizzled_scales=False
        )
    with pytest.raises(ValueError, match="weight_scale_2 must be finite and > 0"):
        nvfp4_from_comfy(packed, swizzle_oracle(scales), torch.tensor(bad), shape=(2, 32))


@pytest.mark.usefixtures("production_checks")
def test_a_reciprocal_outside_fp32_normals_is_refused():
    packed, scales = _good()
    with pytest.raises(ValueError, match="reciprocal of weight_global_scale"):
        nvfp4_from_compressed_tensors(packed, scales, torch.tensor([1e-39]))  # 1/x overflows
    tiny = NVFP4Weight(packed, scales, torch.tensor(1e-39))  # 1e-39 is an FP32 subnormal
    with pytest.raises(ValueError, match="reciprocal of w.global_scale"):
        nvfp4_to_compressed_tensors(tiny)


@pytest.mark.usefixtures("production_checks")
@pytest.mark.parametrize("byte", [0x7F, 0xFF, 0x80, 0xB8], ids=["nan", "-nan", "-0", "-1"])
def test_nan_or_negative_block_scales_are_refused(byte):
    packed, scales = _good()
    bad = scales.view(torch.uint8).clone()
    bad[1, 0] = byte
    with pytest.raises(ValueError, match="weight_scale holds 1 NaN or negative"):
        nvfp4_from_modelopt(packed, bad.view(E4M3), torch.tensor(1.0))
    with pytest.raises(ValueError, match="weight_scale holds 1 NaN or negative"):
        nvfp4_from_comfy(packed, swizzle_oracle(bad.view(E4M3)), torch.tensor(1.0), shape=(2, 32))
    zero = scales.view(torch.uint8).clone()
    zero[1, 0] = 0  # a zero scale is an empty block, not an error
    w = nvfp4_from_modelopt(packed, zero.view(E4M3), torch.tensor(1.0))
    assert (nvfp4_dequantize_weight(w)[1, :16] == 0).all()


@pytest.mark.usefixtures("production_checks")
def test_writers_reject_invalid_records():
    packed, scales = _good()
    with pytest.raises(TypeError, match="w must be an NVFP4Weight"):
        nvfp4_to_modelopt((packed, scales, torch.tensor(1.0)))
    broken = NVFP4Weight(packed, scales, torch.tensor(1.0))._replace(block_scales=scales[:, :1])
    with pytest.raises(ValueError, match="w.block_scales must have shape"):
        nvfp4_to_compressed_tensors(broken)


# -- writers and round trips ---------------------------------------------------------------------


def test_writers_name_and_lay_out_the_tensors():
    packed, scales = _good()
    w = NVFP4Weight(packed, scales, torch.tensor(0.125))
    mo = nvfp4_to_modelopt(w)
    assert set(mo) == {"weight", "weight_scale", "weight_scale_2"}
    assert_bitwise_equal(mo["weight"], packed)
    assert_bitwise_equal(mo["weight_scale"], scales)
    assert_bitwise_equal(mo["weight_scale_2"], torch.tensor(0.125))
    ct = nvfp4_to_compressed_tensors(w)
    assert set(ct) == {"weight_packed", "weight_scale", "weight_global_scale"}
    assert_bitwise_equal(ct["weight_packed"], packed)
    assert_bitwise_equal(ct["weight_scale"], scales)
    assert_bitwise_equal(ct["weight_global_scale"], torch.tensor([8.0]))


def test_a_quantized_weight_survives_both_checkpoint_layouts():
    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(16))
    w = NVFP4Weight(*nvfp4_quantize(x, recipe="nvidia"))
    dense = nvfp4_dequantize_weight(w)
    assert_bitwise_equal(dense, nvfp4_dequantize(*w))
    back = nvfp4_from_modelopt(**nvfp4_to_modelopt(w))
    assert_bitwise_equal(nvfp4_dequantize_weight(back), dense)
    via_ct = nvfp4_from_compressed_tensors(**nvfp4_to_compressed_tensors(w))
    assert_bitwise_equal(via_ct.packed, w.packed)
    assert ((nvfp4_dequantize_weight(via_ct) - dense).abs() <= dense.abs() * 2.0**-22).all()


@st.composite
def modelopt_tensors(draw):
    rows = draw(st.integers(1, 3))
    blocks = draw(st.integers(1, 2))
    packed = draw(
        st.lists(st.integers(0, 255), min_size=rows * blocks * 8, max_size=rows * blocks * 8)
    )
    scales = draw(st.lists(st.integers(0, 126), min_size=rows * blocks, max_size=rows * blocks))
    return (
        torch.tensor(packed, dtype=torch.uint8).reshape(rows, blocks * 8),
        torch.tensor(scales, dtype=torch.uint8).reshape(rows, blocks).view(E4M3),
        torch.tensor(draw(st.floats(2.0**-30, 2.0**30, width=32)), dtype=torch.float32),
    )


EXTREMES = (  # every code -6 (0xFF), scale 448 (0x7E), the smallest global scale drawn
    torch.full((1, 8), 0xFF, dtype=torch.uint8),
    torch.full((1, 1), 0x7E, dtype=torch.uint8).view(E4M3),
    torch.tensor(2.0**-30),
)


@SMALL
@given(modelopt_tensors())
@example(EXTREMES)
def test_modelopt_round_trip_is_byte_exact(tensors):
    weight, weight_scale, weight_scale_2 = tensors
    out = nvfp4_to_modelopt(nvfp4_from_modelopt(weight, weight_scale, weight_scale_2))
    assert_bitwise_equal(out["weight"], weight)
    assert_bitwise_equal(out["weight_scale"], weight_scale)
    assert_bitwise_equal(out["weight_scale_2"], weight_scale_2)


@SMALL
@given(modelopt_tensors(), st.integers(-100, 100))
def test_compressed_tensors_round_trip_is_exact_for_powers_of_two(tensors, exponent):
    weight, weight_scale, _ = tensors
    divisor = torch.tensor([2.0**exponent])
    w = nvfp4_from_compressed_tensors(weight, weight_scale, divisor)
    assert w.global_scale.item() == 2.0**-exponent
    out = nvfp4_to_compressed_tensors(w)
    assert_bitwise_equal(out["weight_packed"], weight)
    assert_bitwise_equal(out["weight_scale"], weight_scale)
    assert_bitwise_equal(out["weight_global_scale"], divisor)


@SMALL
@given(modelopt_tensors(), st.floats(2.0**-100, 2.0**100, width=32))
@example(EXTREMES, 3.0)
@example(EXTREMES, float(np.nextafter(np.float32(2.0), np.float32(0.0))))  # top of a binade
def test_compressed_tensors_round_trip_within_one_ulp(tensors, g):
    weight, weight_scale, _ = tensors
    divisor = torch.tensor([g], dtype=torch.float32)
    w = nvfp4_from_compressed_tensors(weight, weight_scale, divisor)
    exact = 1.0 / float(divisor)  # float64 reciprocal of the FP32 value
    assert abs(w.global_scale.item() - exact) <= exact * 2.0**-24  # one FP32 rounding
    back = nvfp4_to_compressed_tensors(w)["weight_global_scale"]
    ulps = abs(int(back.view(torch.int32)) - int(divisor.view(torch.int32)))
    assert ulps <= 1
    assert abs(back.item() - float(divisor)) <= float(divisor) * 2.0**-23
