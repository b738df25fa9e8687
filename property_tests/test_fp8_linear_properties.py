"""Properties of the FP8 GEMM reference ``fp8_scaled_linear``: what every FP8 linear route computes.

The routes (cuBLAS ``scaled_mm``, the Triton small-M kernel) are held to this function by
``floatxq.testing.assert_fp8_linear_close``; these properties pin the function itself without
restating its formula: it is the decoded product, its per-row recipes treat rows independently,
powers of two pass through it exactly, and zero rows give the bias.
"""

import numpy as np
import torch
from hypothesis import example, given
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import floatxq as fq
from floatxq.testing import assert_bitwise_equal
from floatxq.testing.strategies import power_of_two_exponents

RECIPES = {
    "tensorwise": ("tensor", None, ("float8_e4m3fn",)),
    "rowwise": ("row", None, ("float8_e4m3fn", "float8_e5m2")),
    "blockwise": ("block", (128, 128), ("float8_e4m3fn",)),
}


ORDINARY = st.one_of(
    st.just(0.0),
    st.floats(2.0**-12, 4.0, width=32),
    st.floats(-4.0, -(2.0**-12), width=32),
)
"""Zero or a magnitude in ``[2**-12, 4]``: row scaling by ``2**±(spread + 30)`` stays normal."""


def _spread_rows(draw, rows, cols, spread):
    """A ``(rows, cols)`` float32 tensor of :data:`ORDINARY` values, each row scaled by its own
    drawn power of two in ``2**±spread`` (every value a Hypothesis draw, so failures shrink)."""
    bulk = draw(hnp.arrays(np.float32, (rows, cols), elements=ORDINARY))
    exps = draw(hnp.arrays(np.int32, (rows, 1), elements=st.integers(-spread, spread)))
    return torch.from_numpy(bulk) * torch.exp2(torch.from_numpy(exps).float())


@st.composite
def linear_cases(draw, *, recipes=tuple(RECIPES), with_bias=None, spread=8):
    """(recipe, format, x, w, bias): x rows spanning ``2**±spread``, weight rows ``2**±6``;
    small shapes (blockwise: n and k multiples of 128). The weight is quantized by
    :func:`_quantized` in the test body (a strategy must not call type-checked functions:
    beartype samples with ``random``)."""
    recipe = draw(st.sampled_from(recipes))
    _, _, formats = RECIPES[recipe]
    name = draw(st.sampled_from(formats))
    m = draw(st.integers(1, 6))
    if recipe == "blockwise":
        n, k = 128 * draw(st.integers(1, 2)), 128 * draw(st.integers(1, 2))
    else:
        n, k = draw(st.integers(1, 24)), draw(st.integers(1, 96))
    x = _spread_rows(draw, m, k, spread)
    w = _spread_rows(draw, n, k, 6)
    bias_on = draw(st.booleans()) if with_bias is None else with_bias
    bias = None
    if bias_on:
        bias = torch.from_numpy(
            draw(hnp.arrays(np.float32, (n,), elements=st.floats(-32, 32, width=32)))
        )
    return recipe, name, x, w, bias


def _quantized(case):
    """(recipe, x, codes, scale_inv, bias) with the weight quantized in the recipe's layout."""
    recipe, name, x, w, bias = case
    method, block, _ = RECIPES[recipe]
    q = fq.quantize_fp8_weight(w, format=name, weight_scale_method=method, weight_block_size=block)
    return recipe, x, q.qweight, q.scale_inv, bias


@given(linear_cases())
def test_it_is_the_product_of_the_decoded_operands(case):
    """Against ``dequantize(quantize(x)) @ dequantize(W).T`` (decode by division, float64): the
    direct scales are rounded FP32 reciprocals, so each term may differ by a few FP32 units."""
    recipe, x, codes, scale_inv, bias = _quantized(case)
    method, _, _ = RECIPES[recipe]
    block = (1, 128) if recipe == "blockwise" else None
    x_format = str(codes.dtype).removeprefix("torch.") if recipe == "tensorwise" else "e4m3"
    xq = fq.quantize_fp8_weight(
        x, format=x_format, weight_scale_method=method, weight_block_size=block
    )
    x_dec = fq.dequantize_fp8_weight(*xq).double()
    w_dec = fq.dequantize_fp8_weight(codes, scale_inv).double()
    want = x_dec @ w_dec.T + (0 if bias is None else bias.double())
    magnitude = x_dec.abs() @ w_dec.abs().T + (0 if bias is None else bias.double().abs())
    got = fq.fp8_scaled_linear(x, codes, scale_inv, bias, recipe=recipe).double()
    bound = (x.shape[1] + 8) * 2.0**-22 * magnitude + 2.0**-126
    assert bool(((got - want).abs() <= bound).all())


@given(linear_cases(recipes=("rowwise", "blockwise")), st.data())
def test_per_row_recipes_treat_rows_independently(case, data):
    """Row and 1×128-block scales: permuting (or changing other) rows of ``x`` permutes (or leaves)
    each output row, bit for bit."""
    recipe, x, codes, scale_inv, bias = _quantized(case)
    out = fq.fp8_scaled_linear(x, codes, scale_inv, bias, recipe=recipe)
    perm = torch.tensor(data.draw(st.permutations(range(x.shape[0]))))
    permuted = fq.fp8_scaled_linear(x[perm], codes, scale_inv, bias, recipe=recipe)
    assert_bitwise_equal(permuted, out[perm])
    other = x.clone()
    other[1:] *= 1000.0
    assert_bitwise_equal(fq.fp8_scaled_linear(other, codes, scale_inv, bias, recipe=recipe)[0],
                         out[0])  # fmt: skip


@given(linear_cases(with_bias=False, spread=4), power_of_two_exponents(-30, 30))
def test_powers_of_two_pass_through_exactly(case, e):
    """``x · 2**e`` gives the same codes with scales ``2**e`` apart: the output is ``out · 2**e``
    bit for bit (no bias; magnitudes far from FP32's limits)."""
    recipe, x, codes, scale_inv, _ = _quantized(case)
    out = fq.fp8_scaled_linear(x, codes, scale_inv, recipe=recipe)
    scaled = fq.fp8_scaled_linear(x * 2.0**e, codes, scale_inv, recipe=recipe)
    assert_bitwise_equal(scaled, out * 2.0**e)


@given(linear_cases(with_bias=True), st.integers(0, 5))
@example(
    ("tensorwise", "float8_e4m3fn", torch.zeros(1, 1), torch.ones(1, 1), torch.tensor([-0.0])), 0
)
def test_zero_rows_give_the_bias(case, row):
    """A zero row of ``x`` sums exact zeros: the output is ``+0 + bias`` (a ``-0`` bias comes out
    ``+0``, as IEEE addition gives)."""
    recipe, x, codes, scale_inv, bias = _quantized(case)
    if recipe == "tensorwise":
        x = torch.zeros_like(x)  # tensor scales: only an all-zero x has exactly-zero rows
    else:
        x = x.clone()
        x[row % x.shape[0]] = 0.0
    out = fq.fp8_scaled_linear(x, codes, scale_inv, bias, recipe=recipe)
    zero = (x == 0).all(dim=1)
    assert_bitwise_equal(out[zero], (bias + 0.0).expand(int(zero.sum()), -1).contiguous())


@given(linear_cases(), st.sampled_from([torch.bfloat16, torch.float16]))
def test_output_takes_the_input_dtype_and_one_rounding(case, dtype):
    """Half inputs: the result is the FP32 result rounded once to the input dtype."""
    recipe, x, codes, scale_inv, bias = _quantized(case)
    half = x.clamp(-6e4, 6e4).to(dtype)
    b = None if bias is None else bias.to(dtype)
    got = fq.fp8_scaled_linear(half, codes, scale_inv, b, recipe=recipe)
    wide = fq.fp8_scaled_linear(half.float(), codes, scale_inv, b, recipe=recipe)
    assert got.dtype == dtype
    assert_bitwise_equal(got, wide.to(dtype))
