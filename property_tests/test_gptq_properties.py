"""Invariants of the Hessian fold, the GPTQ solve and RTN, over small drawn (shrinkable) inputs.

Weights, calibration inputs, permutations and exponents are all drawn by Hypothesis, so a failure
shrinks to a small matrix. Hessians are built from drawn integer inputs (``xᵀx`` plus a drawn
ridge), which keeps them exact in FP32 and positive definite. The numerics these properties pin
down are described in ``docs/numerics.md``; equality to GPT-QModel's solver is tested against an
independent oracle in ``tests/test_gptq.py``.
"""

import dataclasses
import math

import numpy as np
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from floatxq.gptq.hessian import hessian_finalize, hessian_init, hessian_update
from floatxq.gptq.solve import GPTQSolveOptions, gptq_solve, rtn_quantize
from floatxq.testing import assert_bitwise_equal
from floatxq.testing.strategies import f32_values, matrices

MODES = {
    "plain": dict(act_group_aware=False),
    "desc_act": dict(desc_act=True, act_group_aware=False),
    "static": dict(static_groups=True, act_group_aware=False),
    "desc_act+static": dict(desc_act=True, static_groups=True, act_group_aware=False),
    "group_aware": dict(act_group_aware=True),
    "group_aware+static": dict(act_group_aware=True, static_groups=True),
}
SLOW = settings(max_examples=max(5, settings().max_examples // 2))
"""Half the profile's examples for the properties that run several solves per example."""

BOUNDED = f32_values(max_magnitude=1e30)
"""Finite FP32 values (edges included) small enough that a group's range stays finite."""

NORMAL = st.builds(lambda m, e: m * 2.0**e, st.integers(-255, 255), st.integers(-30, 30))
"""Values whose products with powers of two in ``2**±16`` stay normal FP32 numbers (or zero)."""

NONZERO = st.builds(
    lambda m, e: m * 2.0**e,
    st.integers(1, 255).flatmap(lambda m: st.sampled_from([m, -m])),
    st.integers(-30, 30),
)
"""Like :data:`NORMAL`, never zero: no group row is all zero (such a row keeps a fixed scale)."""


@st.composite
def options(draw, *, sym=None, modes=tuple(MODES), mse=(0.0, 0.0, 2.4), group_sizes=None):
    """:class:`GPTQSolveOptions` over every bit width, group size and reordering mode."""
    return GPTQSolveOptions(
        bits=draw(st.sampled_from([2, 3, 4, 5, 6, 8])),
        group_size=draw(st.sampled_from(group_sizes or [-1, 3, 4, 8, 16, 32])),
        sym=draw(st.booleans()) if sym is None else sym,
        mse=draw(st.sampled_from(mse)),
        **MODES[draw(st.sampled_from(modes))],
    )


def _gram(x: np.ndarray, ridge: np.ndarray) -> torch.Tensor:
    """``xᵀx + diag(ridge)`` in exact integer arithmetic, as FP32."""
    x64 = x.astype(np.int64)
    return torch.from_numpy(x64.T @ x64 + np.diag(ridge.astype(np.int64))).float()


@st.composite
def hessians(draw, k: int, *, distinct_diagonal: bool = False) -> torch.Tensor:
    """A positive definite ``(k, k)`` FP32 Hessian ``xᵀx + diag(ridge)``, ``ridge >= 1``.

    ``distinct_diagonal`` builds the ridge so that every ``diag(H)`` entry differs (the column
    order a reordering picks is then decided by the values alone, never by a tie).
    """
    rows = draw(st.integers(1, k + 2))
    x = draw(hnp.arrays(np.int8, (rows, k), elements=st.integers(-3, 3)))
    norms = (x.astype(np.int64) ** 2).sum(axis=0)
    if distinct_diagonal:
        offsets = draw(st.lists(st.integers(1, 4 * k), min_size=k, max_size=k, unique=True))
        ridge = int(norms.max()) + np.array(offsets) - norms
    else:
        ridge = np.array(draw(st.lists(st.integers(1, 8), min_size=k, max_size=k)))
    return _gram(x, ridge)


@st.composite
def weights_and_hessians(draw, *, elements=BOUNDED, distinct_diagonal=False, max_k=40):
    weight = draw(matrices(max_blocks=(5, max_k), elements=elements))
    return weight, draw(hessians(weight.shape[1], distinct_diagonal=distinct_diagonal))


def _candidates(damp: float, increment: float) -> list[float]:
    """Damping candidates ``damp, damp+inc, …`` by repeated addition, while below 1."""
    out = [damp]
    while increment > 0 and out[-1] + increment < 1.0:
        out.append(out[-1] + increment)
    return out


# ------------------------------------------------------------------------------------------------
# Hessian fold
# ------------------------------------------------------------------------------------------------


@st.composite
def integer_inputs(draw, *, max_rows=12, max_k=6):
    """``(x, cut, mask)``: ``(n, k)`` small integers (every partial sum of ``xᵀx`` is exact in
    FP32), a split point and a keep-mask over the rows."""
    k = draw(st.integers(1, max_k))
    n = draw(st.integers(0, max_rows))
    x = torch.from_numpy(draw(hnp.arrays(np.int8, (n, k), elements=st.integers(-8, 8)))).float()
    mask = torch.tensor(draw(st.lists(st.booleans(), min_size=n, max_size=n)), dtype=torch.bool)
    return x, draw(st.integers(0, n)), mask.reshape(n)


@given(integer_inputs())
@example((torch.ones(1, 1), 0, torch.tensor([False])))
@example((torch.ones(0, 2), 0, torch.zeros(0, dtype=torch.bool)))
@example((torch.tensor([[0.0, -1.0]]), 0, torch.tensor([False])))
def test_fold_splits_and_masks_agree_exactly_on_integer_inputs(case):
    x, cut, mask = case
    n, k = x.shape
    one = hessian_update(hessian_init(k), x)
    two = hessian_update(hessian_update(hessian_init(k), x[:cut]), x[cut:])
    assert_bitwise_equal(two.xtx, one.xtx)
    assert int(two.rows) == int(one.rows) == n
    exact = x.double().T @ x.double()
    assert torch.equal(one.xtx.double(), exact)
    masked = hessian_update(hessian_init(k), x, mask)
    assert_bitwise_equal(masked.xtx, hessian_update(hessian_init(k), x[mask]).xtx)
    assert int(masked.rows) == int(mask.sum())
    if n:
        assert_bitwise_equal(hessian_finalize(two), hessian_finalize(one))
        factor = torch.tensor(2.0 / n, dtype=torch.float32)
        # equal values (a lone product 0·(-1) is -0.0; the fold adds it to +0.0)
        assert torch.equal(hessian_finalize(one), exact.float() * factor)


@given(
    matrices(max_blocks=(16, 6), elements=f32_values(max_magnitude=1e15)),
    st.integers(0, 40),
    st.sampled_from([0.0, 1e30, math.inf, math.nan]),
)
def test_padding_changes_nothing_bit_for_bit(x, pads, fill):
    # A batch padded to a longer sequence: pad rows (any values, even inf/NaN) appended with
    # mask False fold to exactly the same Hessian as the unpadded rows, on any float inputs.
    n, k = x.shape
    padded = torch.cat([x, torch.full((pads, k), fill)])
    mask = torch.cat([torch.ones(n, dtype=torch.bool), torch.zeros(pads, dtype=torch.bool)])
    alone = hessian_update(hessian_init(k), x)
    with_pads = hessian_update(hessian_init(k), padded[None], mask[None])
    assert_bitwise_equal(with_pads.xtx, alone.xtx)
    assert int(with_pads.rows) == n


@given(matrices(max_blocks=(16, 6), elements=f32_values(max_magnitude=1e15)), st.data())
def test_fold_does_not_depend_on_row_order_beyond_fp32_summation(x, data):
    # each entry is a sum of n products; two summation orders differ by at most 2·γ_n·Σ|x_i x_j|
    n, k = x.shape
    order = torch.tensor(data.draw(st.permutations(range(n))), dtype=torch.long)
    cut = data.draw(st.integers(0, n))
    one = hessian_finalize(hessian_update(hessian_init(k), x))
    shuffled = x[order]
    two = hessian_update(hessian_update(hessian_init(k), shuffled[:cut]), shuffled[cut:])
    two = hessian_finalize(two)
    eps = 2.0**-24
    magnitude = x.double().abs().T @ x.double().abs() * (2.0 / n)
    bound = (2 * n + 4) * eps * magnitude + 4 * n * 2.0**-149
    assert bool(((two.double() - one.double()).abs() <= bound).all())


# ------------------------------------------------------------------------------------------------
# The solve
# ------------------------------------------------------------------------------------------------


@given(
    matrices(max_blocks=(6, 40), elements=BOUNDED),
    options(),
    st.sampled_from([1e-3, 1.0, 7.5, 4096.0]),
)
@example(torch.zeros(2, 3), GPTQSolveOptions(), 1.0)
@example(torch.tensor([[-1e-45, 0.0, 1e-45, -0.0]]), GPTQSolveOptions(sym=False, group_size=2), 1.0)
@SLOW
def test_identity_hessian_solve_is_round_to_nearest(weight, opts, c):
    # no cross terms in H: nothing is fed forward, so every column rounds on its own
    k = weight.shape[1]
    sol = gptq_solve(weight, c * torch.eye(k), opts, blocksize=8)
    rtn = rtn_quantize(weight, opts)
    assert_bitwise_equal(sol.codes, rtn.codes)
    assert_bitwise_equal(sol.zeros, rtn.zeros)
    assert_bitwise_equal(sol.g_idx, rtn.g_idx)
    assert_bitwise_equal(sol.scales, rtn.scales)  # equal diag(H): the sorts keep the order
    assert torch.equal(sol.dequantized, rtn.dequantized)  # ±0 may differ after error feedback
    # the loss weighs each squared error by 1/d² = c·(1 + damp), the damped inverse's diagonal
    expected = float(rtn.loss) * c * (1 + sol.damp)
    assert math.isclose(float(sol.loss), expected, rel_tol=1e-5, abs_tol=1e-60)


@given(weights_and_hessians(), options(), st.sampled_from([torch.float32, torch.bfloat16]))
@example((torch.tensor([[1.0, -2.0, 0.5, 0.0]]), torch.eye(4)), GPTQSolveOptions(), torch.float32)
@SLOW
def test_the_solution_is_a_consistent_record(case, opts, dtype):
    weight, hessian = case
    weight = weight.to(dtype)
    out, k = weight.shape
    gs = k if opts.group_size == -1 else opts.group_size
    groups = math.ceil(k / gs)
    natural = torch.arange(k) // gs
    maxq = 2**opts.bits - 1
    for sol in (gptq_solve(weight, hessian, opts), rtn_quantize(weight, opts)):
        assert sol.codes.shape == (out, k) and sol.scales.shape == sol.zeros.shape == (out, groups)
        assert int(sol.codes.max()) <= maxq and int(sol.zeros.max()) <= maxq
        if opts.sym:
            assert bool((sol.zeros == 2 ** (opts.bits - 1)).all())
        assert bool(torch.isfinite(sol.scales).all()) and bool((sol.scales > 0).all())
        assert bool(torch.isfinite(sol.loss)) and float(sol.loss) >= 0
        g = sol.g_idx.long()
        # every value is its code on its group's grid, exactly
        values = (sol.codes.float() - sol.zeros[:, g].float()) * sol.scales[:, g]
        assert_bitwise_equal(sol.dequantized, values.to(dtype))
        reordered = opts.desc_act and not opts.static_groups and sol.damp > 0
        if not reordered:  # groups are runs of natural columns
            assert torch.equal(g, natural)
        else:  # groups are runs of the solve order: larger diag(H), earlier (or equal) group
            assert torch.equal(g.sort().values, natural)
            diag = hessian.diagonal()
            later = diag[:, None] > diag[None, :]
            assert not bool((later & (g[:, None] > g[None, :])).any())


@st.composite
def weights_on_a_grid(draw):
    """``(weight, opts, hessian)``: each group row holds codes 0 and maxq of a power-of-two grid.

    The codes, zero points and scale exponents are drawn; the structure (both grid ends present
    in every group row) is built in, so every group's parameters recover that grid exactly.
    """
    modes = ("plain", "static", "desc_act+static", "group_aware", "group_aware+static")
    opts = draw(options(sym=False, modes=modes, group_sizes=[-1, 2, 3, 4, 8]))
    out, groups = draw(st.integers(1, 4)), draw(st.integers(1, 4))
    grouped = opts.group_size != -1
    if not grouped and draw(st.booleans()):  # one group per row: any column order is fine
        opts = dataclasses.replace(opts, desc_act=True, act_group_aware=False, static_groups=False)
    width = opts.group_size if grouped else draw(st.integers(2, 12))
    k = width * groups if grouped else width
    maxq = 2**opts.bits - 1
    codes = draw(hnp.arrays(np.int64, (out, k), elements=st.integers(0, maxq)))
    for start in range(0, k, width):  # both ends of the grid in every group row
        codes[:, start] = 0
        codes[:, start + 1] = maxq
    if not grouped:
        codes = codes[:, draw(st.permutations(range(k)))]
    zero = draw(hnp.arrays(np.int64, (out, 1), elements=st.integers(0, maxq)))
    exponent = draw(hnp.arrays(np.int64, (out, 1), elements=st.integers(-20, 20)))
    scale = np.exp2(exponent).astype(np.float32)
    return torch.from_numpy((codes - zero).astype(np.float32) * scale), opts, draw(hessians(k))


@given(weights_on_a_grid())
@example(  # 2-bit groups of 3: the last group straddles the first block of 8 columns
    (
        torch.tensor([[0, 3, 1, 0, 3, 2, 0, 3, 0]], dtype=torch.float32).sub(1).mul(0.5),
        GPTQSolveOptions(bits=2, group_size=3, sym=False),
        _gram(np.ones((2, 9), dtype=np.int8), np.ones(9, dtype=np.int64)),
    )
)
@SLOW
def test_a_weight_already_on_the_grid_comes_back_unchanged_with_zero_loss(case):
    weight, opts, hessian = case
    sol = gptq_solve(weight, hessian, opts, blocksize=8)
    assert_bitwise_equal(sol.dequantized, weight)
    assert float(sol.loss) == 0.0
    rtn = rtn_quantize(weight, opts)
    assert_bitwise_equal(rtn.dequantized, weight)
    assert float(rtn.loss) == 0.0


@st.composite
def permuted_problems(draw):
    """``(weight, hessian, opts, perm)`` where reordering makes the solve permutation-equivariant.

    ``desc_act`` without static groups solves in ``diag(H)`` order and numbers groups in that
    order, so any permutation works; every other reordering mode keeps each natural group's
    columns together, so the permutation stays inside groups (and, with static groups, the MSE
    search is off: its error sum runs over the group in natural order).
    """
    modes = ["desc_act", "desc_act+static", "group_aware", "group_aware+static"]
    mode = draw(st.sampled_from(modes))
    static = mode.endswith("static")
    opts = draw(options(modes=(mode,), mse=(0.0,) if static else (0.0, 2.4)))
    weight, hessian = draw(weights_and_hessians(distinct_diagonal=True, max_k=24))
    k = weight.shape[1]
    if mode == "desc_act":
        perm = draw(st.permutations(range(k)))
    else:
        gs = k if opts.group_size == -1 else opts.group_size
        perm = []
        for start in range(0, k, gs):
            perm += draw(st.permutations(range(start, min(k, start + gs))))
    return weight, hessian, opts, torch.tensor(perm, dtype=torch.long)


@given(permuted_problems())
@example(
    (
        torch.tensor([[1.0, -2.0, 3.0, 0.5], [0.25, 0.0, -1.0, 2.0]]),
        _gram(np.array([[1, 2, 0, 1]], dtype=np.int8), np.array([3, 5, 2, 6])),
        GPTQSolveOptions(group_size=2, desc_act=True, act_group_aware=False),
        torch.tensor([3, 1, 0, 2]),
    )
)
@SLOW
def test_reordering_solves_are_equivariant_under_column_permutations(case):
    # permuting W's input columns and H's rows and columns alike permutes the result, bit for bit
    weight, hessian, opts, p = case
    sol = gptq_solve(weight, hessian, opts)
    moved = gptq_solve(weight[:, p], hessian[p][:, p], opts)
    assert_bitwise_equal(moved.codes, sol.codes[:, p])
    assert_bitwise_equal(moved.dequantized, sol.dequantized[:, p])
    assert_bitwise_equal(moved.g_idx, sol.g_idx[p])
    assert_bitwise_equal(moved.scales, sol.scales)
    assert_bitwise_equal(moved.zeros, sol.zeros)
    assert_bitwise_equal(moved.loss, sol.loss)
    assert moved.damp == sol.damp


@given(weights_and_hessians(elements=NORMAL, max_k=24), options(), st.integers(-8, 8))
@SLOW
def test_scaling_the_hessian_by_an_even_power_of_two_changes_only_the_loss(case, opts, e):
    # H·4^e scales the inverse's Cholesky factor by 2^-e exactly and each column's error by 2^e:
    # their products, hence every code and value, are the same; the loss is scaled by 4^e
    weight, hessian = case
    sol = gptq_solve(weight, hessian, opts)
    scaled = gptq_solve(weight, hessian * 4.0**e, opts)
    for field in ("dequantized", "codes", "scales", "zeros", "g_idx"):
        assert_bitwise_equal(getattr(scaled, field), getattr(sol, field), msg=field)
    assert float(scaled.loss) == float(sol.loss) * 4.0**e
    assert scaled.damp == sol.damp


@given(weights_and_hessians(elements=NONZERO, max_k=24), options(mse=(0.0,)), st.integers(-16, 16))
@SLOW
def test_scaling_the_weight_by_a_power_of_two_scales_values_and_scales(case, opts, e):
    # the quantizer's range, scale and error feedback all scale exactly; codes and zeros do not
    # move (the MSE search is off: |error|^2.4 does not scale exactly)
    weight, hessian = case
    sol = gptq_solve(weight, hessian, opts)
    scaled = gptq_solve(weight * 2.0**e, hessian, opts)
    assert_bitwise_equal(scaled.codes, sol.codes)
    assert_bitwise_equal(scaled.zeros, sol.zeros)
    assert_bitwise_equal(scaled.g_idx, sol.g_idx)
    assert_bitwise_equal(scaled.scales, sol.scales * 2.0**e)
    assert_bitwise_equal(scaled.dequantized, sol.dequantized * 2.0**e)
    assert float(scaled.loss) == float(sol.loss) * 4.0**e


@st.composite
def indefinite_hessians(draw):
    """``(weight, gram, opts, j)``: a rank-deficient Gram matrix and the candidate index it needs.

    ``H = gram - s·g·I`` (``g = mean(diag gram)``) is made positive definite by a damp ``c``
    exactly when ``c·(1 - s) > s``. ``s`` is placed so that the threshold lies a quarter, half or
    three quarters of the way between candidates ``j - 1`` and ``j``: no rounding can tip it.
    """
    k = draw(st.integers(3, 12))
    rows = draw(st.integers(1, k - 1))
    x = draw(hnp.arrays(np.int8, (rows, k), elements=st.integers(-3, 3)))
    x[0, 0] = draw(st.sampled_from([-3, -2, -1, 1, 2, 3]))  # a nonzero Gram matrix
    gram = _gram(x, np.zeros(k, dtype=np.int64)).double()
    opts = draw(options(mse=(0.0,)))
    j = draw(st.integers(1, 40))
    fraction = draw(st.sampled_from([0.25, 0.5, 0.75]))
    out = draw(st.integers(1, 4))
    weight = torch.from_numpy(draw(hnp.arrays(np.float32, (out, k), elements=NORMAL, fill=NORMAL)))
    return weight, gram, opts, j, fraction


def _shifted(gram: torch.Tensor, opts: GPTQSolveOptions, j: int, fraction: float) -> torch.Tensor:
    threshold = opts.damp_percent + (j - 1 + fraction) * opts.damp_auto_increment
    shift = threshold / (1 + threshold)  # c·(1 - s) > s  ⇔  c > threshold
    g = gram.diagonal().mean()
    return (gram - shift * g * torch.eye(gram.shape[0], dtype=gram.dtype)).float()


@given(indefinite_hessians(), st.integers(0, 10))
@example(
    (
        torch.ones(1, 3),
        _gram(np.array([[1, 1, 0]], dtype=np.int8), np.zeros(3, dtype=np.int64)).double(),
        GPTQSolveOptions(),
        1,
        0.25,
    ),
    0,
)
@SLOW
def test_damping_takes_the_first_candidate_that_factors_and_grows_with_the_shift(case, more):
    weight, gram, opts, j, fraction = case
    candidates = _candidates(opts.damp_percent, opts.damp_auto_increment)
    sol = gptq_solve(weight, _shifted(gram, opts, j, fraction), opts)
    assert sol.damp == candidates[j]
    assert bool(torch.isfinite(sol.dequantized).all()) and bool(torch.isfinite(sol.loss))
    # a larger shift never needs less damping
    harder = gptq_solve(weight, _shifted(gram, opts, j + more, fraction), opts)
    assert harder.damp == candidates[j + more] >= sol.damp
    # starting from the damp found gives the same bytes without any retry
    again = gptq_solve(
        weight,
        _shifted(gram, opts, j, fraction),
        dataclasses.replace(opts, damp_percent=sol.damp, damp_auto_increment=0.0),
    )
    assert again.damp == sol.damp
    assert_bitwise_equal(again.codes, sol.codes)
    assert_bitwise_equal(again.dequantized, sol.dequantized)
