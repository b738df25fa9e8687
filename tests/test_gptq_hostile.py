"""Hostile GPTQ solver inputs: a damping schedule that never ends, Hessians that are not Hessians.

``damp_auto_increment=1e-300`` used to make the damping schedule grow forever (``0.05 + 1e-300 ==
0.05``) until memory ran out; a negative definite "Hessian" (``-I``) used to be floored into a
positive one and solved without a word. Both are now ``ValueError`` naming the problem, while
Hessians a calibration fold can produce (``2/N · Σ xᵀx``, rank deficient or not) solve as before.
"""

import itertools
import math

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

import floatxq.gptq.solve
from floatxq.config import GPTQConfig
from floatxq.gptq.hessian import hessian_finalize, hessian_init, hessian_update
from floatxq.gptq.solve import GPTQ_MAX_DAMP_RETRIES, GPTQSolveOptions, gptq_solve
from floatxq.lifecycle import gptq_solve_options

Opts = GPTQSolveOptions


# ------------------------------------------------------------------------------------------------
# The damping schedule
# ------------------------------------------------------------------------------------------------


def test_an_increment_too_small_to_move_the_damp_is_refused(production_checks):
    assert 0.05 + 1e-300 == 0.05  # the schedule this increment describes never reaches 1
    with pytest.raises(ValueError, match=r"damp_auto_increment 1e-300 would need about .* retries"):
        Opts(damp_auto_increment=1e-300)
    # the same value read from a config (what ``load``/``quantize`` pass on) stops there too
    config = GPTQConfig(damp_auto_increment=1e-300)
    with pytest.raises(ValueError, match="damp_auto_increment 1e-300"):
        gptq_solve_options(config)


def test_an_increment_that_stalls_below_one_is_refused(production_checks):
    # few enough retries by count, but the float64 addition cannot move a damp this close to 1
    damp = 1.0 - 2.0**-52
    increment = 2.0**-60
    assert damp + increment == damp and (1.0 - damp) / increment < GPTQ_MAX_DAMP_RETRIES
    with pytest.raises(ValueError, match=r"does not raise the damp .* would never reach 1"):
        Opts(damp_percent=damp, damp_auto_increment=increment)


def test_the_retry_cap_is_the_documented_one(production_checks):
    room = 1.0 - 0.05
    Opts(damp_auto_increment=room / (GPTQ_MAX_DAMP_RETRIES - 10))  # just inside
    with pytest.raises(ValueError, match=rf"within {GPTQ_MAX_DAMP_RETRIES} retries"):
        Opts(damp_auto_increment=room / (GPTQ_MAX_DAMP_RETRIES + 100))
    # GPT-QModel's defaults and common choices stay far inside
    for damp, increment in ((0.05, 0.01), (0.01, 0.0025), (0.005, 0.001), (0.1, 0.0)):
        Opts(damp_percent=damp, damp_auto_increment=increment)


@given(
    st.floats(0.0, 1.0, exclude_min=True, exclude_max=True),
    st.floats(0.0, 1.0, allow_subnormal=True) | st.sampled_from([1e-300, 5e-324, 1e-17, 1e-4]),
)
@example(0.05, 1e-300)
@example(1.0 - 2.0**-52, 2.0**-60)
@example(0.5, 2.0**-54)
@settings(max_examples=60, deadline=None, derandomize=True)
def test_every_accepted_schedule_rises_and_ends(damp, increment):
    try:
        Opts(damp_percent=damp, damp_auto_increment=increment)
    except ValueError as exc:
        assert "damp_auto_increment" in str(exc)
        return
    schedule = floatxq.gptq.solve._damp_candidates(damp, increment)
    assert schedule[0] == damp and len(schedule) <= GPTQ_MAX_DAMP_RETRIES + 1
    assert all(a < b < 1.0 for a, b in itertools.pairwise(schedule))
    assert increment == 0 or schedule[-1] + increment >= 1.0


def test_a_fine_schedule_still_finds_the_first_damp_that_works():
    # eigenvalues down to -0.2·m: damping needs c·(0.8·m) > 0.2·m, i.e. c > 0.25
    g = torch.Generator().manual_seed(3)
    x = torch.randn(4, 16, generator=g, dtype=torch.float64)
    gram = x.T @ x / 2
    hessian = gram - 0.2 * gram.diagonal().mean() * torch.eye(16, dtype=torch.float64)
    increment = 1e-4  # 9,500 candidates: bisection, not a walk
    sol = gptq_solve(
        torch.ones(2, 16), hessian.float(), Opts(group_size=-1, damp_auto_increment=increment)
    )
    assert 0.25 < sol.damp < 0.25 + 2 * increment


# ------------------------------------------------------------------------------------------------
# Hessians that are not positive semidefinite
# ------------------------------------------------------------------------------------------------


def test_a_negative_definite_hessian_is_refused(production_checks):
    hessian = -torch.eye(8)
    with pytest.raises(ValueError, match=r"not positive semidefinite: 8 of its 8 diagonal entries"):
        gptq_solve(torch.randn(4, 8), hessian, Opts(group_size=-1))


@pytest.mark.parametrize(
    "options",
    [
        Opts(group_size=-1, act_group_aware=False),
        Opts(group_size=2, desc_act=True, act_group_aware=False),
        Opts(group_size=2),  # group-aware reordering
        Opts(group_size=-1, damp_auto_increment=0.0),
    ],
)
def test_the_message_names_the_negative_entry_in_natural_order(options, production_checks):
    # mean(diag) < 0: damping subtracts, so no damp can help; the solve order is permuted by
    # desc_act / group-aware reordering, the message still names the natural column
    hessian = torch.diag(torch.tensor([1.0, 3.0, -10.0, 2.0]))
    with pytest.raises(
        ValueError, match=r"1 of its 4 diagonal entries are negative \(H\[2, 2\] = -10\)"
    ):
        gptq_solve(torch.randn(3, 4), hessian, options)


def test_a_negative_entry_that_damping_repairs_still_solves():
    # diag (-0.5, 4, 4, 4): mean 2.875, so damp c repairs it once c·2.875 > 0.5 (c > 0.1739),
    # first at 0.05 + 13·0.01 = 0.18; the diagonal floors are never reached
    hessian = torch.diag(torch.tensor([-0.5, 4.0, 4.0, 4.0]))
    sol = gptq_solve(torch.randn(2, 4), hessian, Opts(group_size=-1))
    assert math.isclose(sol.damp, 0.18, rel_tol=1e-9)
    assert bool(torch.isfinite(sol.dequantized).all()) and bool(torch.isfinite(sol.loss))


def test_hessians_from_a_calibration_fold_are_never_refused():
    # rank deficient (2 rows, 6 features) with dead columns: damping or the floors repair it,
    # as before; a fold's diagonal is a sum of squares, never negative
    x = torch.tensor([[1.0, -2.0, 0.0, 3.0, 0.5, 0.0], [2.0, 1.0, 0.0, -1.0, 0.25, 0.0]])
    hessian = hessian_finalize(hessian_update(hessian_init(6), x))
    assert bool((hessian.diagonal() >= 0).all())
    for increment in (0.01, 0.0):
        sol = gptq_solve(
            torch.randn(3, 6), hessian, Opts(group_size=-1, damp_auto_increment=increment)
        )
        assert bool(torch.isfinite(sol.dequantized).all())
