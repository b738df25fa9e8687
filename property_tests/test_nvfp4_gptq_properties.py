"""Invariants of GPTQ onto the NVFP4 grid (:func:`floatxq.nvfp4_gptq_solve`) over drawn inputs.

Weights are drawn as small integers times a power of two, Hessians as ``xᵀx`` of drawn integer
inputs plus a drawn ridge (exact in FP32, positive semi-definite), so a failure shrinks to a
small matrix.
"""

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import floatxq as fq
from floatxq.testing import assert_bitwise_equal

RECIPES = st.sampled_from(["nvidia", "four_six", "least_squares", "nvidia_headroom"])


@st.composite
def _problem(draw):
    n = draw(st.integers(1, 6))
    k = 16 * draw(st.integers(1, 3))
    exponent = draw(st.integers(-8, 4))
    w = draw(st.lists(st.integers(-64, 64), min_size=n * k, max_size=n * k))
    weight = torch.tensor(w, dtype=torch.float32).reshape(n, k) * 2.0**exponent
    rows = draw(st.integers(1, 2 * k))
    x = draw(st.lists(st.integers(-8, 8), min_size=rows * k, max_size=rows * k))
    x = torch.tensor(x, dtype=torch.float32).reshape(rows, k)
    ridge = draw(st.sampled_from([0.0, 0.5, 4.0]))
    hessian = x.T @ x + ridge * torch.eye(k)
    return weight, hessian


def _decoded(solution) -> torch.Tensor:
    return fq.nvfp4_dequantize(solution.packed, solution.block_scales, solution.global_scale)


@settings(max_examples=max(5, settings().max_examples // 2))
@given(_problem(), RECIPES)
def test_never_worse_than_round_to_nearest_at_the_same_scales(problem, recipe):
    weight, hessian = problem
    g = fq.nvfp4_global_scale(weight.abs().amax(), recipe=recipe)
    s = fq.nvfp4_gptq_solve(weight, hessian, g, recipe=recipe)
    rtn = fq.nvfp4_quantize(weight, g, recipe)
    assert_bitwise_equal(s.block_scales, rtn.block_scales)  # the recipe's scales, unchanged
    # every code is on the grid of its block's scale and the reported loss is its loss
    error = (weight - _decoded(s)).double()
    loss = ((error @ hessian.double()) * error).sum()
    assert torch.isclose(loss.float(), s.loss, rtol=1e-5, atol=1e-30)
    rtn_error = (weight - fq.nvfp4_dequantize(*rtn)).double()
    rtn_loss = ((rtn_error @ hessian.double()) * rtn_error).sum()
    assert torch.isclose(rtn_loss.float(), s.rtn_loss, rtol=1e-5, atol=1e-30)
    assert s.loss <= s.rtn_loss
    if not s.solved:  # round to nearest kept: its bytes
        assert_bitwise_equal(s.packed, rtn.packed)


@settings(max_examples=max(5, settings().max_examples // 2))
@given(_problem(), st.sampled_from([1, 7, 16, 128]))
def test_a_diagonal_hessian_leaves_nothing_to_spread(problem, blocksize):
    # with uncorrelated inputs no error moves to another column: GPTQ is round to nearest
    weight, hessian = problem
    diagonal = torch.diag(torch.diagonal(hessian) + 1.0)
    g = fq.nvfp4_global_scale(weight.abs().amax(), recipe="nvidia")
    s = fq.nvfp4_gptq_solve(weight, diagonal, g, blocksize=blocksize)
    rtn = fq.nvfp4_quantize(weight, g, "nvidia")
    assert torch.equal(_decoded(s), fq.nvfp4_dequantize(*rtn))
    assert s.solved and s.loss == s.rtn_loss
