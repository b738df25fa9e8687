"""Quantizing an FP8 weight band by band gives ``quantize_fp8_weight``'s bytes, for every band.

``quantize_fp8_weight_banded`` is what the CPU route of ``quantize_fp8_weight_auto`` runs (every
``from_linear`` and the offloaded run go through it), so each property compares it bit for bit
with the whole-weight function, for band sizes from one row to more than the weight has.
"""

import math

import pytest
import torch
from hypothesis import example, given
from hypothesis import strategies as st

import floatxq as fq
from floatxq.formats import FP8_WEIGHT_BAND_ELEMENTS
from floatxq.fp8_bands import quantize_fp8_weight_banded
from floatxq.testing import assert_bitwise_equal
from floatxq.testing.strategies import (
    FP8WeightCase,
    fp8_weight_cases,
    spread_matrices,
)

NON_FINITE = st.sampled_from([math.nan, math.inf, -math.inf])
ROW_SPREAD = torch.tensor([[1e-30, 2e-30], [448.0, -3.4028235e38], [0.0, 0.0], [1e30, -1e-40]])
"""Rows whose magnitudes differ by far more than FP8 covers: a tensor scale must see all."""


def _kwargs(case: FP8WeightCase) -> dict:
    return {
        "format": case.format,
        "weight_scale_method": case.method,
        "weight_block_size": case.block,
    }


def _assert_same(case: FP8WeightCase, rows_per_band: int | None) -> None:
    whole = fq.quantize_fp8_weight(case.weight, **_kwargs(case))
    banded = quantize_fp8_weight_banded(case.weight, rows_per_band=rows_per_band, **_kwargs(case))
    assert banded.qweight.dtype == whole.qweight.dtype
    assert_bitwise_equal(banded.qweight, whole.qweight, msg="codes")
    assert_bitwise_equal(banded.scale_inv, whole.scale_inv, msg="scale_inv")


@st.composite
def spread_cases(draw):
    """Weights whose rows differ in magnitude by up to 2**±60, in any layout."""
    method = draw(st.sampled_from(["tensor", "row", "block"]))
    block = draw(st.tuples(st.integers(1, 3), st.integers(1, 4))) if method == "block" else None
    weight = draw(spread_matrices(block=block or (1, 1), max_blocks=(5, 3)))
    return FP8WeightCase("float8_e4m3fn", method, block, weight)


@given(
    st.one_of(
        fp8_weight_cases(max_shape=(9, 6)),
        fp8_weight_cases(dtype=torch.bfloat16),
        fp8_weight_cases(dtype=torch.float16),
        spread_cases(),
    ),
    st.one_of(st.none(), st.integers(1, 12)),
)
@example(FP8WeightCase("float8_e4m3fn", "tensor", None, ROW_SPREAD), 1)
@example(FP8WeightCase("float8_e5m2", "tensor", None, ROW_SPREAD), 3)
@example(FP8WeightCase("float8_e4m3fn", "row", None, ROW_SPREAD), 2)
@example(FP8WeightCase("float8_e4m3fnuz", "block", (2, 1), ROW_SPREAD), 1)  # rounded up to 2
@example(FP8WeightCase("float8_e4m3fn", "block", (2, 2), ROW_SPREAD), 3)  # rounded up to 4
def test_every_band_size_gives_the_whole_weights_bytes(case, rows_per_band):
    """Codes and inverse scales equal ``quantize_fp8_weight``'s, bit for bit, for any band."""
    _assert_same(case, rows_per_band)


@pytest.mark.parametrize("method, block", [("tensor", None), ("row", None), ("block", (8, 16))])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_default_band_splits_a_large_weight_the_same_way(method, block, dtype):
    """A weight of several default bands (ragged last band, edge values in each) is unchanged."""
    rows = 3 * (FP8_WEIGHT_BAND_ELEMENTS // 512) + 40
    gen = torch.Generator().manual_seed(7)
    weight = torch.randn(rows, 512, generator=gen) * torch.logspace(-20, 20, rows)[:, None]
    weight[::97, 5] = 0.0
    weight[::131, 7] = -0.0
    weight[::89, 3] = torch.finfo(dtype).max
    weight[-1] = 0.0
    case = FP8WeightCase("float8_e4m3fn", method, block, weight.to(dtype))
    _assert_same(case, None)


@pytest.mark.parametrize("shape", [(0, 4), (3, 0), (0, 0)])
@pytest.mark.parametrize("method, block", [("tensor", None), ("row", None), ("block", (1, 2))])
def test_empty_weights_give_the_whole_weights_bytes(shape, method, block):
    _assert_same(FP8WeightCase("float8_e4m3fn", method, block, torch.zeros(shape)), 1)


@given(fp8_weight_cases(max_shape=(9, 6)), NON_FINITE, st.integers(1, 4), st.data())
def test_a_non_finite_value_in_any_band_is_refused(case, bad, rows_per_band, data):
    """NaN or ±inf anywhere raises, as ``quantize_fp8_weight`` raises, whichever band holds it."""
    rows, cols = case.weight.shape
    weight = case.weight.clone()
    weight[data.draw(st.integers(0, rows - 1)), data.draw(st.integers(0, cols - 1))] = bad
    with pytest.raises(ValueError, match="quantize_fp8_weight: weight contains NaN"):
        fq.quantize_fp8_weight(weight, **_kwargs(case))
    with pytest.raises(ValueError, match="quantize_fp8_weight_banded: weight contains NaN"):
        quantize_fp8_weight_banded(weight, rows_per_band=rows_per_band, **_kwargs(case))


@given(fp8_weight_cases().map(lambda c: c._replace(weight=c.weight.double())), st.integers(1, 4))
def test_float64_weights_take_the_whole_weight_path(case, rows_per_band):
    """float64 (whose FP32 overflow check counts over the whole weight) gives the same bytes."""
    _assert_same(case, rows_per_band)


def test_a_block_size_that_does_not_divide_raises_as_the_whole_weight_does():
    weight = torch.ones(3, 4)
    kwargs = {"weight_scale_method": "block", "weight_block_size": (2, 2)}
    with pytest.raises(ValueError, match=r"quantize_fp8_weight: weight shape \(3, 4\)"):
        quantize_fp8_weight_banded(weight, rows_per_band=1, **kwargs)


@pytest.mark.parametrize(
    "rows_per_band, error", [(0, ValueError), (-2, ValueError), (1.5, TypeError), (True, TypeError)]
)
def test_rows_per_band_must_be_a_positive_int(rows_per_band, error):
    with pytest.raises(error, match="rows_per_band"):
        quantize_fp8_weight_banded(torch.ones(2, 2), rows_per_band=rows_per_band)
