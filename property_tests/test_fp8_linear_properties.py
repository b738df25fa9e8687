"""Properties of the FP8 GEMM reference ``fp8_scaled_linear``: what every FP8 linear route computes.

The routes (cuBLAS ``scaled_mm``, the Triton small-M kernel) are held to this function by
``floatxq.testing.assert_fp8_linear_close``; these properties pin the function itself without
restating its formula: it is the decoded product, its per-row recipes treat rows independently,
powers of two pass through it exactly, and zero rows give the bias.
"""

import torch
from hypothesis import given
from hypothesis import strategies as st

import floatxq as fq
from floatxq.testing import assert_bitwise_equal
from floatxq.testing.strategies import power_of_two_exponents

RECIPES = {
    "tensorwise": ("tensor", None, ("float8_e4m3fn",)),
    "rowwise": ("row", None, ("float8_e4m3fn", "float8_e5m2")),
    "blockwise": ("block", (128, 128), ("float8_e4m3fn",)),
}


@st.composite
def linear_cases(draw, *, recipes=tuple(RECIPES), with_bias=None, spread=8):
    """(recipe, format, x, w, bias): x rows spanning ``2**±spread``; small shapes (blockwise: n
    and k multiples of 128). The weight is quantized by :func:`_quantized` in the test body (a
    strategy must not call type-checked functions: beartype samples with ``random``)."""
    recipe = draw(st.sampled_from(recipes))
    _, _, formats = RECIPES[recipe]
    name = draw(st.sampled_from(formats))
    m = draw(st.integers(1, 6))
    if recipe == "blockwise":
        n, k = 128 * draw(st.integers(1, 2)), 128 * draw(st.integers(1, 3))
    else:
        n, k = draw(st.integers(1, 24)), draw(st.integers(1, 96))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    rows = torch.randint(-spread, spread + 1, (m, 1), generator=g).float()
    x = torch.randn(m, k, generator=g) * torch.exp2(rows)
    w = torch.randn(n, k, generator=g) * torch.exp2(torch.randint(-6, 7, (n, 1), generator=g))
    bias_on = draw(st.booleans()) if with_bias is None else with_bias
    bias = torch.randn(n, generator=g) * 8 if bias_on else None
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


@given(linear_cases(with_bias=True), st.data())
def test_zero_rows_give_the_bias(case, data):
    recipe, x, codes, scale_inv, bias = _quantized(case)
    if recipe == "tensorwise":
        x = torch.zeros_like(x)  # tensor scales: only an all-zero x has exactly-zero rows
    else:
        x = x.clone()
        x[data.draw(st.integers(0, x.shape[0] - 1))] = 0.0
    out = fq.fp8_scaled_linear(x, codes, scale_inv, bias, recipe=recipe)
    zero = (x == 0).all(dim=1)
    assert_bitwise_equal(out[zero], bias.expand(int(zero.sum()), -1).contiguous())


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
