"""Properties of NVFP4: the E2M1 codec, the block-scale search, swizzle and headroom calibration.

Each property is stated over every recipe on every draw where it is about all recipes. Inputs are
built from Hypothesis draws (``floatxq.testing.strategies``), so a failure shrinks to a small
tensor; ``docs/numerics.md`` states the contract these properties check.
"""

import itertools
import math
import warnings

import ml_dtypes
import numpy as np
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import floatxq as fq
from floatxq.testing import assert_bitwise_equal
from floatxq.testing.reference import ref_e2m1_round
from floatxq.testing.strategies import (
    f32_values,
    matrices,
    nvfp4_grid_points,
    nvfp4_inputs,
    power_of_two_exponents,
    spread_matrices,
)

E4M3 = torch.float8_e4m3fn
RECIPES = ("nvidia", "four_six", "least_squares", "least_squares_grid", "exhaustive")
"""The local algorithms, from the fewest scales tried to all of them."""
GLOBAL_SCALES = st.one_of(
    st.sampled_from([1.0, 2.0**-20, 1e-6, 3.0e-3, 0.0625, 100.0]),
    st.floats(2.0**-26, 2.0**13, width=32),
)
# Checking all five recipes on a draw runs ten or so scale searches: a quarter of the profile's
# examples (12 draws, 60 recipe checks in ci; hundreds of draws in nightly) keeps each such
# property within the ci profile's per-test budget.
ALL_RECIPES = settings(max_examples=max(10, settings.default.max_examples // 4))
ORDERING = settings(max_examples=max(10, settings.default.max_examples // 2))
POSITIVE_E4M3_BITS = torch.arange(1, 127, dtype=torch.uint8)  # 2**-9 ... 448, ascending


def _x(rows: list[list[float]]) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.float32)


ZERO_AND_TINY = _x([[0.0] * 15 + [1.1754944e-38]])
DEN_BELOW_ONE = _x([[0.5, -0.5, 0.5] + [0.0] * 13])  # least squares divides by max(den, 1)
CANDIDATES_TIE = _x([[3.0] * 16])  # amax→4 and amax→6 give the same error
HUGE_NEXT_TO_TINY = _x([[2.0**40] * 16 + [2.0**-40] * 16])
SIGNED_ZEROS = _x([[-0.0, 0.0, -1e-30, 1e-30] + [1.0] * 12])
TIES = _x([[0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0] * 2])


def _sse(x: torch.Tensor, g: float | torch.Tensor, recipe: str) -> torch.Tensor:
    return fq.nvfp4_block_sse(x, fq.nvfp4_block_scales(x, g, recipe).block_scales, g)


# -- the scale search ----------------------------------------------------------------------------


@ORDERING
@given(nvfp4_inputs(), GLOBAL_SCALES)
@example(ZERO_AND_TINY, 1.0)
@example(DEN_BELOW_ONE, 1.0)
@example(CANDIDATES_TIE, 1.0)
@example(HUGE_NEXT_TO_TINY, 1.0)
@example(TIES, 1.0)
def test_recipes_are_ordered_per_block(x, g):
    """Each recipe tries a superset of the previous one's scales, so no block gets worse."""
    sse = [_sse(x, g, recipe) for recipe in RECIPES]
    for coarse, fine, (a, b) in zip(sse[:-1], sse[1:], itertools.pairwise(RECIPES), strict=True):
        assert bool((fine <= coarse).all()), f"{b} worse than {a}"


@ORDERING
@given(nvfp4_inputs(max_rows=2, max_blocks=2), GLOBAL_SCALES)
@example(HUGE_NEXT_TO_TINY, 1.0)
@example(DEN_BELOW_ONE, 2.0**-20)
def test_exhaustive_is_the_minimum_over_every_positive_e4m3_scale(x, g):
    """Brute force: score every block under each of the 126 positive E4M3 scales."""
    shape = (126, x.shape[0], x.shape[-1] // 16)
    every = POSITIVE_E4M3_BITS[:, None, None].expand(shape).contiguous().view(E4M3)
    brute = fq.nvfp4_block_sse(x.expand(126, *x.shape), every, g)  # (126, rows, blocks)
    exhaustive = _sse(x, g, "exhaustive")
    assert bool((exhaustive <= brute).all())
    assert_bitwise_equal(exhaustive, brute.amin(dim=0))  # the candidates are E4M3 scales too


@ALL_RECIPES
@given(nvfp4_inputs(), GLOBAL_SCALES)
@example(SIGNED_ZEROS, 1.0)
@example(TIES, 1.0)
@example(ZERO_AND_TINY, 3.0e-3)
def test_codes_are_the_nearest_e2m1_under_the_chosen_scales(x, g):
    """Whatever scale a recipe picks, the codes are nearest rounding of ``x / (scale · g)``."""
    g32 = torch.tensor(g, dtype=torch.float32)
    for recipe in RECIPES:
        b = fq.nvfp4_block_scales(x, g, recipe)
        s = b.block_scales.float()
        assert bool(((s >= 2.0**-9) & (s <= 448)).all()), recipe
        assert b.global_scale.item() == g32.item()
        assert bool((b.codes <= 15).all())
        assert torch.equal(b.codes >> 3 == 1, x < 0), recipe  # sign bit iff x < 0
        e = (s * g32).repeat_interleave(16, dim=-1)
        expected = fq.e2m1_round(x.abs() / e)
        assert_bitwise_equal(fq.e2m1_decode(b.codes & 7), expected, msg=recipe)


@ALL_RECIPES
@given(nvfp4_inputs(), GLOBAL_SCALES, st.data())
def test_zero_blocks_get_unit_scale_and_zero_codes(x, g, data):
    x = x.clone()
    block = data.draw(st.integers(0, x.shape[-1] // 16 - 1))
    signs = data.draw(hnp.arrays(np.bool_, (x.shape[0], 16)))
    x[:, 16 * block : 16 * block + 16] = torch.where(torch.from_numpy(signs), -0.0, 0.0)
    for recipe in RECIPES:
        b = fq.nvfp4_block_scales(x, g, recipe)
        assert bool((b.block_scales[:, block].float() == 1.0).all()), recipe
        assert bool((b.codes[:, 16 * block : 16 * block + 16] == 0).all()), recipe


@ALL_RECIPES
@given(nvfp4_inputs(), GLOBAL_SCALES)
@example(SIGNED_ZEROS, 1.0)
def test_negating_x_flips_only_the_sign_bits(x, g):
    for recipe in RECIPES:
        a, b = fq.nvfp4_block_scales(x, g, recipe), fq.nvfp4_block_scales(-x, g, recipe)
        assert_bitwise_equal(a.block_scales, b.block_scales)
        assert_bitwise_equal(a.codes & 7, b.codes & 7)
        nonzero = x != 0
        assert bool(((a.codes ^ b.codes)[nonzero] == 8).all())


# Power-of-two rescaling is exact while every value, residual and squared residual of the search
# stays a normal FP32 number: nonzero |x| in [2**-10, 2**10] and |e| <= 28 keep the smallest
# squared residual (~(2**-24 · 2**-38)**2) above FLT_MIN and the largest SSE far below FLT_MAX.
MODERATE = f32_values(min_magnitude=2.0**-10, max_magnitude=2.0**10)


@ALL_RECIPES
@given(
    matrices(block=(1, 16), max_blocks=(3, 3), elements=MODERATE), power_of_two_exponents(-28, 28)
)
@example(TIES, -28)
@example(_x([[2.0**-10] * 15 + [2.0**10]]), 28)
def test_power_of_two_rescaling_of_x_and_global_scale_commutes(x, e):
    amax = x.abs().amax()
    for recipe in RECIPES:
        g = fq.nvfp4_global_scale(amax, recipe=recipe)
        base = fq.nvfp4_block_scales(x, g, recipe)
        scaled = fq.nvfp4_block_scales(x * 2.0**e, g * 2.0**e, recipe)
        assert_bitwise_equal(scaled.codes, base.codes, msg=recipe)
        assert_bitwise_equal(scaled.block_scales, base.block_scales, msg=recipe)
        if amax > 0:  # the dynamic global scale follows amax by the same power of two
            scaled_g = fq.nvfp4_global_scale(amax * 2.0**e, recipe=recipe)
            assert scaled_g.item() == g.item() * 2.0**e


@ALL_RECIPES
@given(nvfp4_grid_points())
def test_nvfp4_grid_points_are_fixed_points_of_every_recipe(point):
    """A tensor already on the grid, each block reaching ±6 · scale, comes back bit for bit."""
    x = fq.nvfp4_dequantize(fq.pack_e2m1(point.codes), point.block_scales, point.global_scale)
    g = point.global_scale
    for recipe in RECIPES:
        assert_bitwise_equal(fq.nvfp4_block_qdq(x, g, recipe), x, msg=recipe)
        assert bool((_sse(x, g, recipe) == 0).all()), recipe
    nvidia = fq.nvfp4_block_scales(x, g, "nvidia")  # a single candidate: the block's own scale
    assert_bitwise_equal(nvidia.block_scales, point.block_scales)
    assert_bitwise_equal(
        nvidia.codes, torch.where(point.codes == 8, 0, point.codes).to(torch.uint8)
    )


@ALL_RECIPES
@given(nvfp4_inputs(), power_of_two_exponents(-20, 20))
@example(CANDIDATES_TIE, 0)
@example(_x([[6 * 1.6 * 2.0**-9] + [0.0] * 15]), 0)  # amax→6 lands on a subnormal scale
def test_quantize_dequantize_quantize_is_idempotent(x, e):
    """Re-quantizing decoded NVFP4 reproduces it: ``nvidia`` and ``four_six`` on blocks whose
    scale is 2**-9 or normal (≥ 2**-6), ``exhaustive`` on every block.

    Between 2**-9 and 2**-6 E4M3 has too few bits: the amax can round to 4 instead of 6, and the
    re-quantized block then picks another scale. The least-squares recipes may move a decoded
    block to another scale too; their guarantee is the ordering above.
    """
    g = 2.0**e
    for recipe in ("nvidia", "four_six", "exhaustive"):
        first = fq.nvfp4_quantize(x, g, recipe)
        y = fq.nvfp4_dequantize(*first)
        again = fq.nvfp4_quantize(y, g, recipe)
        s = first.block_scales.float()
        kept = torch.ones_like(s, dtype=torch.bool)
        if recipe != "exhaustive":
            kept = (s >= 2.0**-6) | (s == 2.0**-9)
        kept = kept.repeat_interleave(16, dim=-1)
        assert torch.equal(fq.nvfp4_dequantize(*again)[kept], y[kept]), recipe
        if recipe == "nvidia":  # one candidate: the same scale and codes (up to -0's sign)
            codes = fq.unpack_e2m1(first.packed)
            again_codes = fq.unpack_e2m1(again.packed)
            assert_bitwise_equal(again_codes[kept], torch.where(codes == 8, 0, codes)[kept])


@given(
    st.floats(min_value=0.0, max_value=1e-30, allow_subnormal=True),
    st.sampled_from([None, torch.float16, torch.bfloat16, torch.float32]),
    st.sampled_from(RECIPES),
)
def test_global_scale_is_positive_and_finite_for_every_tiny_amax(amax, grid, recipe):
    """A positive amax, however small, never gives a global scale of 0 (which every consumer
    refuses): the quotient is held at FP32's smallest subnormal; the dynamic scale agrees."""
    a = torch.tensor(amax, dtype=torch.float32)
    g = fq.nvfp4_global_scale(a, grid_dtype=grid, recipe=recipe)
    assert bool(torch.isfinite(g)) and float(g) > 0
    if float(a) > 0:
        assert float(g) >= 2.0**-149
    x = torch.full((1, 16), float(a), dtype=grid or torch.float32)
    if float(x.abs().amax()) == float(a):
        assert_bitwise_equal(fq.nvfp4_dynamic_global_scale(x, recipe=recipe), g)
    q = fq.nvfp4_quantize(x, recipe=recipe)
    assert bool(torch.isfinite(fq.nvfp4_dequantize(*q, dtype=torch.float32)).all())


@ALL_RECIPES
@given(spread_matrices(block=(1, 16), max_blocks=(3, 3), dtype=torch.bfloat16))
def test_dynamic_global_scale_is_the_calibrated_one_on_the_input_grid(x):
    amax = x.float().abs().amax()
    for recipe in RECIPES:
        g = fq.nvfp4_global_scale(amax, grid_dtype=torch.bfloat16, recipe=recipe)
        dynamic = fq.nvfp4_block_scales(x, None, recipe)
        assert_bitwise_equal(dynamic.global_scale, g)
        calibrated = fq.nvfp4_block_scales(x, g, recipe)
        assert_bitwise_equal(dynamic.block_scales, calibrated.block_scales, msg=recipe)
        assert_bitwise_equal(dynamic.codes, calibrated.codes, msg=recipe)


@ALL_RECIPES
@given(nvfp4_inputs(), GLOBAL_SCALES)
@example(SIGNED_ZEROS, 1.0)
def test_quantize_dequantize_equal_qdq_up_to_the_sign_of_zero(x, g):
    before = x.clone()
    for recipe in RECIPES:
        dq = fq.nvfp4_dequantize(*fq.nvfp4_quantize(x, g, recipe))
        qdq = fq.nvfp4_block_qdq(x, g, recipe)
        assert_bitwise_equal(torch.signbit(qdq), torch.signbit(x))  # qdq keeps every sign
        assert_bitwise_equal(dq, qdq.abs().copysign(dq), msg=recipe)
        differ = torch.signbit(dq) != torch.signbit(qdq)
        assert bool((dq[differ] == 0).all())  # codes keep "x < 0": only zeros may differ
    assert_bitwise_equal(x, before)  # inputs are never mutated


# -- the E2M1 codec -------------------------------------------------------------------------------


@given(hnp.arrays(np.uint8, hnp.array_shapes(min_dims=1, max_dims=3, max_side=6)))
def test_unpack_then_pack_is_the_identity_on_any_bytes(packed):
    packed = torch.from_numpy(packed)
    codes = fq.unpack_e2m1(packed)
    assert codes.shape == (*packed.shape[:-1], 2 * packed.shape[-1])
    assert bool((codes <= 15).all())
    assert_bitwise_equal(fq.pack_e2m1(codes), packed)


@given(
    hnp.array_shapes(min_dims=1, max_dims=3, max_side=6).flatmap(
        lambda shape: hnp.arrays(
            np.uint8, (*shape[:-1], 2 * shape[-1]), elements=st.integers(0, 15)
        )
    )
)
def test_pack_then_unpack_is_the_identity_on_any_codes(codes):
    codes = torch.from_numpy(codes)
    assert_bitwise_equal(fq.unpack_e2m1(fq.pack_e2m1(codes)), codes)
    assert_bitwise_equal(fq.e2m1_encode(fq.e2m1_decode(codes)), codes)


@given(matrices(max_blocks=(3, 8), elements=f32_values(finite=False)))
def test_e2m1_round_is_idempotent_odd_and_nearest(x):
    r = fq.e2m1_round(x)
    assert_bitwise_equal(fq.e2m1_round(r), r)
    finite = ~x.isnan()
    assert_bitwise_equal(fq.e2m1_round(-x)[finite], -r[finite])
    table = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
    m = x.abs().clamp_max(6.0)[finite]
    nearest = (table - m[:, None]).abs().amin(dim=1)
    assert bool(((r.abs()[finite] - m).abs() == nearest).all())  # no E2M1 value is closer


@given(matrices(max_blocks=(2, 8), elements=f32_values(max_magnitude=16.0)))
def test_e2m1_round_is_the_literal_oracle_and_ml_dtypes_cast(x):
    # moved from tests/test_nvfp4.py (a fixed random sample): ties go to the even code
    flat = x.flatten()
    expected = torch.tensor([ref_e2m1_round(float(v))[0] for v in flat], dtype=torch.float32)
    assert_bitwise_equal(fq.e2m1_round(flat), expected)
    in_range = flat.clamp(-6, 6).numpy()  # ml_dtypes' float4 cast is RNE too, inside the range
    ml = in_range.astype(ml_dtypes.float4_e2m1fn).astype(np.float32)
    assert_bitwise_equal(fq.e2m1_round(torch.from_numpy(in_range)), torch.from_numpy(ml))


# -- swizzle --------------------------------------------------------------------------------------


@st.composite
def tagged_scales(draw, *, col_multiple: int = 1, byte: bool = False):
    """A ``(rows, cols)`` matrix whose every entry is distinct and nonzero (its position + 1),
    as int32, or as E4M3 bytes cycling through 1..255: padding is then the only zero."""
    rows = draw(st.integers(0, 260))
    cols = col_multiple * draw(st.integers(0, 16 // col_multiple))
    tags = torch.arange(1, rows * cols + 1, dtype=torch.int32).reshape(rows, cols)
    return ((tags - 1) % 255 + 1).to(torch.uint8).view(E4M3) if byte else tags


def _padding_is_zero_and_values_are_permuted(swizzled, scales):
    flat = swizzled.flatten()
    flat = flat.view(torch.uint8) if flat.dtype == E4M3 else flat
    ours = scales.flatten()
    ours = ours.view(torch.uint8) if ours.dtype == E4M3 else ours
    assert int((flat != 0).sum()) == scales.numel()
    assert torch.equal(flat[flat != 0].sort().values, ours.sort().values)


@given(st.booleans().flatmap(lambda byte: tagged_scales(byte=byte)))
@example(torch.zeros(0, 0, dtype=torch.int32))
def test_swizzle_round_trips_and_pads_with_zero(scales):
    rows, cols = scales.shape
    swizzled = fq.swizzle_scales(scales)
    assert swizzled.shape == (-(-rows // 128) * 128 * (-(-cols // 4) * 4),)
    _padding_is_zero_and_values_are_permuted(swizzled, scales)
    assert_bitwise_equal(fq.unswizzle_scales(swizzled, rows=rows, cols=cols), scales)


@given(st.booleans().flatmap(lambda byte: tagged_scales(col_multiple=8, byte=byte)))
def test_per_group_swizzle_is_the_swizzle_of_each_group(scales):
    rows, cols = scales.shape
    swizzled = fq.swizzle_scales_per_group(scales)
    assert swizzled.shape == (cols // 8, -(-rows // 128) * 128 * 8)
    for j in range(cols // 8):
        assert_bitwise_equal(swizzled[j], fq.swizzle_scales(scales[:, 8 * j : 8 * j + 8]))
    _padding_is_zero_and_values_are_permuted(swizzled, scales)
    assert_bitwise_equal(fq.unswizzle_scales_per_group(swizzled, rows=rows, cols=cols), scales)


def _tile_offsets(rows: int, cols: int, padded_cols: int) -> torch.Tensor:
    """``offset(r, c) = ((r//128)·(Cp/4) + c//4)·512 + (r%32)·16 + ((r%128)//32)·4 + c%4``."""
    r = torch.arange(rows)[:, None]
    c = torch.arange(cols)[None, :]
    return (
        ((r // 128) * (padded_cols // 4) + c // 4) * 512
        + (r % 32) * 16
        + ((r % 128) // 32) * 4
        + c % 4
    )


@given(tagged_scales())
def test_swizzle_places_row_r_column_c_at_the_tile_offset(scales):
    # moved from tests/test_nvfp4.py (20 fixed shapes): the layout itself, slot by slot
    rows, cols = scales.shape
    swizzled = fq.swizzle_scales(scales)
    offsets = _tile_offsets(rows, cols, -(-cols // 4) * 4)
    assert_bitwise_equal(swizzled[offsets.flatten()], scales.flatten())


@given(tagged_scales(col_multiple=8, byte=True))
def test_per_group_swizzle_places_each_group_at_its_tile_offsets(scales):
    # moved from tests/test_nvfp4.py (4 fixed row counts): group j holds columns 8j..8j+7
    rows, cols = scales.shape
    swizzled = fq.swizzle_scales_per_group(scales).view(torch.uint8)
    offsets = _tile_offsets(rows, 8, 8).flatten()
    for j in range(cols // 8):
        group = scales[:, 8 * j : 8 * j + 8].view(torch.uint8).flatten()
        assert_bitwise_equal(swizzled[j][offsets], group)


# -- headroom calibration ------------------------------------------------------------------------

BATCH_VALUES = st.one_of(st.just(0.0), st.floats(2.0**-60, 2.0**60, width=32))


@given(
    st.lists(
        matrices(block=(1, 16), max_blocks=(3, 2), elements=BATCH_VALUES), min_size=1, max_size=4
    ),
    st.data(),
)
def test_headroom_statistics_do_not_depend_on_batch_order_or_split(batches, data):
    def fold(parts):
        state = fq.headroom_init()
        for part in parts:
            state = fq.headroom_update(state, part)
        return state

    in_order = fold(batches)
    shuffled = fold(data.draw(st.permutations(batches)))
    at_once = fold([torch.cat([b.reshape(-1, 16) for b in batches])])
    for other in (shuffled, at_once):
        assert_bitwise_equal(other.counts, in_order.counts)
        assert_bitwise_equal(other.running_max, in_order.running_max)
    blocks = torch.cat([b.reshape(-1, 16) for b in batches]).abs().amax(dim=1)
    assert int(in_order.counts.sum()) == int((blocks > 0).sum())
    assert in_order.running_max.item() == blocks.max().item()


@given(st.lists(st.floats(2.0**-99, 2.0**99, width=32), min_size=16, max_size=64), st.data())
def test_headroom_percentile_monotone_in_p(maxima, data):
    x = torch.tensor(maxima[: len(maxima) // 16 * 16]).reshape(-1, 16)
    state = fq.headroom_update(fq.headroom_init(), x)
    ps = sorted(data.draw(st.lists(st.floats(0.01, 100.0), min_size=2, max_size=6)))
    values = [fq.headroom_percentile(state, p) for p in ps]
    assert all(a <= b for a, b in itertools.pairwise(values))


@given(
    matrices(block=(1, 16), max_blocks=(4, 4), elements=st.floats(2.0**-20, 2.0**20, width=32)),
    st.floats(1.0, 28000.0),
)
def test_headroom_amax_at_least_upper_and_warns_without_headroom(x, rho):
    state = fq.headroom_update(fq.headroom_init(fq.HeadroomConfig(rho=rho)), x)
    upper = fq.headroom_percentile(state, 99.99)
    anchor = fq.headroom_percentile(state, 1.0, floor=upper / 1e6)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        amax = fq.headroom_amax(state).item()
    warned = any("no requested activation headroom" in str(w.message) for w in caught)
    assert warned == (rho * anchor <= upper)
    assert amax == float(np.float32(max(rho * anchor, upper)))
    assert math.isfinite(amax)
