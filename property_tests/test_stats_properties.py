"""Invariants of the calibration statistics as folds (:mod:`floatxq.stats`).

Every statistic (:data:`~floatxq.stats.HESSIAN`, :data:`~floatxq.stats.RUNNING_AMAX`,
:data:`~floatxq.stats.HEADROOM`) is a :class:`~floatxq.stats.Statistic` record, so the same
properties are stated once for all three: folding rows in any split and any batch order gives the
same state (bitwise for the running amax and the headroom counts; for the Hessian when its sums
are exact), an empty batch is the identity, a padding mask equals dropping the rows, and
:func:`~floatxq.stats.fold_all` / :func:`~floatxq.stats.finalize_all` equal folding and
finalizing each statistic alone. Batches are drawn rows with edge values (subnormals, ±0, the
largest finite FP32), so a failure shrinks to a few rows.
"""

import itertools
import math

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from floatxq.gptq.hessian import hessian_merge
from floatxq.stats import (
    HEADROOM,
    HESSIAN,
    RUNNING_AMAX,
    AmaxState,
    Statistic,
    amax_finalize,
    amax_init,
    amax_merge,
    amax_update,
    finalize_all,
    fold_all,
)
from floatxq.testing import assert_bitwise_equal, unchecked
from floatxq.testing.strategies import f32_values

STATISTICS = {"hessian": HESSIAN, "amax": RUNNING_AMAX, "headroom": HEADROOM}


@st.composite
def row_batches(draw, *, elements=None, max_rows=8):
    """``(x, cuts, order)``: ``(n, k)`` FP32 rows (``k`` a multiple of 16, ``n`` possibly 0), the
    points that split them into batches, and the order the batches are folded in."""
    k = draw(st.sampled_from([16, 32]))
    n = draw(st.integers(0, max_rows))
    values = f32_values() if elements is None else elements
    # a drawn fill value plus sparsely drawn elements: cheap to generate, every value shrinkable
    arr = draw(hnp.arrays(np.float32, (n, k), elements=values, fill=values))
    cuts = sorted(draw(st.lists(st.integers(0, n), max_size=3)))
    pieces = len(cuts) + 1
    order = draw(st.permutations(range(pieces)))
    return torch.from_numpy(arr), cuts, order


def _batches(x: torch.Tensor, cuts: list[int], order: list[int]) -> list[torch.Tensor]:
    bounds = [0, *cuts, x.shape[0]]
    chunks = [x[a:b] for a, b in itertools.pairwise(bounds)]
    return [chunks[i] for i in order]


def _init(name: str, k: int):
    if name == "hessian":
        return HESSIAN.init(k)
    return STATISTICS[name].init()


def _fold(stat: Statistic, state, batches):
    for batch in batches:
        state = stat.update(state, batch)
    return state


INTEGER_ROWS = st.integers(-8, 8).map(float)
"""Small integers: every sum of ``xᵀx`` over a few rows is exact in FP32, in any order."""


@given(row_batches())
def test_running_amax_is_max_abs_in_any_split_and_order(case):
    x, cuts, order = case
    state = _fold(RUNNING_AMAX, amax_init(), _batches(x, cuts, order))
    assert isinstance(state, AmaxState)
    expected = float(np.abs(x.numpy().astype(np.float64)).max()) if x.numel() else 0.0
    assert_bitwise_equal(amax_finalize(state), torch.tensor(expected, dtype=torch.float32))
    assert_bitwise_equal(state.amax, _fold(RUNNING_AMAX, amax_init(), [x]).amax)


@given(row_batches())
def test_headroom_counts_do_not_depend_on_split_or_order(case):
    x, cuts, order = case
    whole = HEADROOM.update(HEADROOM.init(), x)
    split = _fold(HEADROOM, HEADROOM.init(), _batches(x, cuts, order))
    assert_bitwise_equal(split.counts, whole.counts)
    assert_bitwise_equal(split.running_max, whole.running_max)
    assert int(whole.counts.sum()) == int((x.reshape(-1, 16).abs().amax(dim=1) > 0).sum())


@given(row_batches(elements=INTEGER_ROWS))
def test_hessian_with_exact_sums_does_not_depend_on_split_or_order(case):
    x, cuts, order = case
    k = x.shape[1]
    whole = HESSIAN.update(HESSIAN.init(k), x)
    split = _fold(HESSIAN, HESSIAN.init(k), _batches(x, cuts, order))
    assert_bitwise_equal(split.xtx, whole.xtx)
    assert int(split.rows) == x.shape[0]
    # the oracle in float64, exact for these rows; adding it to the empty fold's zeros gives +0
    assert_bitwise_equal(whole.xtx, torch.zeros(k, k) + (x.double().T @ x.double()).float())


@given(row_batches(), st.sampled_from(sorted(STATISTICS)))
def test_an_empty_batch_is_the_identity(case, name):
    x, _, _ = case
    stat = STATISTICS[name]
    state = stat.update(_init(name, x.shape[1]), x)
    again = stat.update(state, x[:0])
    for a, b in zip(again, state, strict=True):
        if isinstance(a, torch.Tensor):
            assert_bitwise_equal(a, b)
        else:
            assert a == b
    if name == "amax":
        assert amax_finalize(amax_init()).item() == 0.0


@given(row_batches(elements=INTEGER_ROWS), st.data(), st.sampled_from(sorted(STATISTICS)))
def test_a_padding_mask_equals_dropping_its_rows(case, data, name):
    x, _, _ = case
    stat = STATISTICS[name]
    n = x.shape[0]
    mask = torch.tensor(
        data.draw(st.lists(st.booleans(), min_size=n, max_size=n)), dtype=torch.bool
    )
    # padding rows hold any finite value, even the largest: none may reach the statistic
    padded = torch.where(mask[:, None], x, torch.finfo(torch.float32).max)
    masked = stat.update(_init(name, x.shape[1]), padded, mask)
    dropped = stat.update(_init(name, x.shape[1]), x[mask])
    for a, b in zip(masked, dropped, strict=True):
        if isinstance(a, torch.Tensor):
            assert_bitwise_equal(a, b)
        else:
            assert a == b


@given(row_batches(elements=INTEGER_ROWS), st.booleans())
def test_fold_all_and_finalize_all_equal_each_statistic_alone(case, with_mask):
    x, cuts, order = case
    k = x.shape[1]
    mask = torch.ones(x.shape[0], dtype=torch.bool) if with_mask else None
    states = {name: _init(name, k) for name in STATISTICS}
    for batch in _batches(x, cuts, order):
        m = None if mask is None else mask[: batch.shape[0]]
        states = fold_all(STATISTICS, states, batch, mask=m)
    for name, stat in STATISTICS.items():
        alone = _fold(stat, _init(name, k), _batches(x, cuts, order))
        for a, b in zip(states[name], alone, strict=True):
            if isinstance(a, torch.Tensor):
                assert_bitwise_equal(a, b)
    # finalize_all over the statistics that have data to measure (each refuses an empty fold)
    measured = {n: STATISTICS[n] for n in ("hessian", "amax") if x.shape[0]}
    if bool((x != 0).any()):
        measured["headroom"] = HEADROOM
    values = finalize_all(measured, {n: states[n] for n in measured})
    assert set(values) == set(measured)
    for name, stat in measured.items():
        assert_bitwise_equal(values[name], stat.finalize(states[name]))


@given(row_batches(), st.sampled_from([fold_all, finalize_all]))
def test_the_fold_helpers_refuse_states_that_do_not_match_the_statistics(case, helper):
    x, _, _ = case
    states = {"amax": amax_init(), "extra": amax_init()}
    with pytest.raises(ValueError, match=r"states name \['amax', 'extra'\], the statistics"):
        if helper is fold_all:
            fold_all({"amax": RUNNING_AMAX}, states, x)
        else:
            finalize_all({"amax": RUNNING_AMAX}, states)


@given(row_batches(), st.integers(0, 7), st.integers(0, 15))
def test_amax_sees_nan_and_never_mutates_its_state(case, row, col):
    x, _, _ = case
    state = amax_update(amax_init(), x)
    before = state.amax.clone()
    bad = torch.cat([x, torch.zeros(row + 1, x.shape[1])])
    bad[-1, col] = math.nan
    after = amax_update(state, bad)
    assert_bitwise_equal(state.amax, before)
    assert math.isnan(amax_finalize(after).item())


@given(row_batches(), st.sampled_from(sorted(STATISTICS)))
def test_a_mask_of_the_wrong_kind_or_shape_is_refused(case, name):
    x, _, _ = case
    stat = STATISTICS[name]
    state = _init(name, x.shape[1])
    with pytest.raises(TypeError, match="mask must be a bool tensor"):
        unchecked(stat.update)(state, x, torch.ones(x.shape[0], dtype=torch.int64))
    with pytest.raises(ValueError, match="mask must have x's leading shape"):
        unchecked(stat.update)(state, x, torch.ones(x.shape[0] + 1, dtype=torch.bool))


MERGEABLE = {"hessian": HESSIAN, "amax": RUNNING_AMAX}


@given(row_batches(elements=INTEGER_ROWS), st.sampled_from(sorted(MERGEABLE)))
def test_merging_folds_of_disjoint_parts_equals_folding_all_of_them(case, name):
    """Exact sums: the parts' folds merged in any order equal the whole fold, bit for bit (the
    calibration split across processes); the empty fold merges as the identity."""
    x, cuts, order = case
    stat = MERGEABLE[name]
    whole = _fold(stat, _init(name, x.shape[1]), [x])
    parts = [_fold(stat, _init(name, x.shape[1]), [b]) for b in _batches(x, cuts, order)]
    merged = parts[0]
    for part in parts[1:]:
        merged = stat.merge(merged, part)
    for got, want in zip(merged, whole, strict=True):
        assert_bitwise_equal(got, want)
    empty = _init(name, x.shape[1])
    for got, want in zip(stat.merge(whole, empty), whole, strict=True):
        assert_bitwise_equal(got, want)


@given(row_batches(max_rows=8), st.integers(1, 7))
def test_merged_hessians_differ_from_one_fold_only_by_fp32_reassociation(case, cut):
    """Any values: a merge changes the sum by at most one FP32 rounding per entry per merge
    against the float64 sum: ``|merged - exact| ≤ (n + 1)·ε·Σ|xᵀx|`` like the whole fold's."""
    x, _, _ = case
    x = x[torch.isfinite(x).all(dim=1)].clamp(-1e15, 1e15)  # finite products, no overflow
    k = x.shape[1]
    cut = min(cut, x.shape[0])
    merged = hessian_merge(HESSIAN.update(HESSIAN.init(k), x[:cut]),
                           HESSIAN.update(HESSIAN.init(k), x[cut:]))  # fmt: skip
    exact = x.double().T @ x.double()
    bound = (x.shape[0] + 2) * 2.0**-24 * (x.double().abs().T @ x.double().abs())
    tiny = (x.shape[0] + 2) * 2.0**-149  # products and sums that underflow FP32
    assert bool(((merged.xtx.double() - exact).abs() <= bound + tiny).all())
    assert int(merged.rows) == x.shape[0]


def test_merges_refuse_mismatched_states():
    with pytest.raises(ValueError, match="k=16 and k=32"):
        hessian_merge(HESSIAN.init(16), HESSIAN.init(32))
    with pytest.raises(TypeError, match="HessianState"):
        unchecked(hessian_merge)(HESSIAN.init(16), amax_init())
    with pytest.raises(TypeError, match="second must be an AmaxState"):
        unchecked(amax_merge)(amax_init(), HESSIAN.init(16))
