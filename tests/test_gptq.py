"""The Hessian fold, the GPTQ solve, RTN and the solver's options record.

The solve is checked against an independent oracle written here from GPT-QModel's algorithm as
``docs/numerics.md`` describes it: the unblocked float64 solve, one column at a time, with every
later column updated at once (no lazy blocks, no transposed buffers, no graphs), with its own
permutations and group bookkeeping. Equal bytes to this oracle is what "compatible with
GPT-QModel's solver" means here.
"""

import ast
import dataclasses
import inspect
import statistics
import warnings

import pytest
import torch

import floatxq.gptq.solve
from floatxq._typing import CHECKING
from floatxq.config import GPTQConfig
from floatxq.gptq.hessian import HessianState, hessian_finalize, hessian_init, hessian_update
from floatxq.gptq.solve import GPTQSolution, GPTQSolveOptions, gptq_solve, rtn_quantize
from floatxq.lifecycle import gptq_solve_options
from floatxq.testing import assert_bitwise_equal, unchecked

Opts = GPTQSolveOptions


# ------------------------------------------------------------------------------------------------
# The options record
# ------------------------------------------------------------------------------------------------


def test_options_defaults_are_the_checkpoint_config_defaults():
    # GPTQConfig is what users write: its defaults must reach the solver as these defaults
    opts = Opts()
    assert gptq_solve_options(GPTQConfig()) == opts
    assert (opts.bits, opts.group_size, opts.sym, opts.desc_act) == (4, 128, True, False)
    assert (opts.static_groups, opts.act_group_aware) == (False, True)
    assert (opts.damp_percent, opts.damp_auto_increment, opts.mse) == (0.05, 0.01, 0.0)


def test_options_are_frozen_keyword_only_and_hashable():
    opts = Opts(bits=3, group_size=-1, sym=False, mse=2.4)
    with pytest.raises(dataclasses.FrozenInstanceError):
        opts.bits = 4  # type: ignore[misc]
    with pytest.raises(TypeError):
        Opts(4)  # type: ignore[misc]
    assert opts == Opts(bits=3, group_size=-1, sym=False, mse=2.4) and hash(opts) == hash(
        Opts(bits=3, group_size=-1, sym=False, mse=2.4)
    )
    assert dataclasses.replace(opts, bits=8).bits == 8


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"bits": 7}, ValueError, r"bits must be one of \[2, 3, 4, 5, 6, 8\], got 7"),
        ({"bits": 1}, ValueError, r"bits must be one of .*got 1"),
        ({"group_size": 0}, ValueError, r"group_size must be -1 .* or positive, got 0"),
        ({"group_size": -2}, ValueError, r"group_size must be -1 .* or positive, got -2"),
        ({"damp_percent": 0.0}, ValueError, r"0 < damp_percent < 1, got 0.0"),
        ({"damp_percent": 1.0}, ValueError, r"0 < damp_percent < 1, got 1.0"),
        ({"damp_percent": float("nan")}, ValueError, r"0 < damp_percent < 1, got nan"),
        ({"damp_auto_increment": -0.01}, ValueError, r"damp_auto_increment must be .*>= 0"),
        ({"mse": float("inf")}, ValueError, r"mse must be finite and >= 0, got inf"),
        ({"mse": -1.0}, ValueError, r"mse must be finite and >= 0, got -1.0"),
        ({"desc_act": True}, ValueError, r"desc_act=True and act_group_aware=True cannot"),
        ({"bits": 4.0}, TypeError, r"bits must be an int, got float 4.0"),
        ({"bits": True}, TypeError, r"bits must be an int, got bool True"),
        ({"group_size": "128"}, TypeError, r"group_size must be an int, got str '128'"),
        ({"sym": 1}, TypeError, r"sym must be a bool, got int 1"),
        ({"static_groups": None}, TypeError, r"static_groups must be a bool, got NoneType"),
        ({"damp_percent": 1}, TypeError, r"damp_percent must be a float, got int 1"),
        ({"mse": 0}, TypeError, r"mse must be a float, got int 0"),
    ],
)
def test_options_reject_bad_fields_naming_them(production_checks, kwargs, error, message):
    with pytest.raises(error, match=message):
        Opts(**kwargs)


def test_options_reject_wrong_kinds_under_the_annotation_check_too():
    for kwargs in ({"bits": "4"}, {"sym": 1}, {"mse": 0}):
        with pytest.raises(TypeError, match=next(iter(kwargs))):
            Opts(**kwargs)


def test_the_solver_knows_nothing_of_checkpoint_configs():
    tree = ast.parse(inspect.getsource(floatxq.gptq.solve))
    imported = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            imported.add(node.module)
        elif isinstance(node, ast.Import):
            imported.update(alias.name for alias in node.names)
    assert "floatxq.config" not in imported and "floatxq.lifecycle" not in imported
    with pytest.raises(TypeError, match=r"options must be a GPTQSolveOptions, got GPTQConfig"):
        unchecked(gptq_solve)(torch.ones(2, 2), torch.eye(2), GPTQConfig())
    with pytest.raises(TypeError, match=r"options must be a GPTQSolveOptions, got dict"):
        unchecked(rtn_quantize)(torch.ones(2, 2), {"bits": 4})


@pytest.mark.skipif(not CHECKING, reason="records are checked only under the import hook")
def test_records_check_their_fields_when_built():
    sol = rtn_quantize(torch.ones(2, 4), Opts(group_size=2))
    with pytest.raises(TypeError):  # codes must be uint8
        GPTQSolution(sol.dequantized, sol.codes.int(), *sol[2:])
    with pytest.raises(TypeError):  # codes (out, in) must match dequantized (out, in)
        GPTQSolution(sol.dequantized, sol.codes[:, :3], *sol[2:])
    with pytest.raises(TypeError):  # zeros (out, groups) must match scales (out, groups)
        GPTQSolution(*sol[:3], sol.zeros[:, :1], *sol[4:])
    with pytest.raises(TypeError):  # g_idx has one entry per input column
        GPTQSolution(*sol[:4], sol.g_idx[:3], *sol[5:])
    with pytest.raises(TypeError):  # the loss is a float64 scalar
        GPTQSolution(*sol[:5], sol.loss.float(), sol.damp)
    with pytest.raises(TypeError):
        HessianState(torch.zeros(2, 3), torch.zeros((), dtype=torch.int64))
    with pytest.raises(TypeError):
        HessianState(torch.zeros(2, 2), torch.zeros((), dtype=torch.int32))
    assert GPTQSolution(*sol) == sol


# ------------------------------------------------------------------------------------------------
# Hessian fold
# ------------------------------------------------------------------------------------------------


def test_hessian_by_hand():
    x = torch.tensor([[1.0, 2.0], [3.0, 4.0], [0.0, 1.0]])
    state = hessian_update(hessian_init(2), x)
    assert isinstance(state, HessianState) and int(state.rows) == 3
    # xᵀx = [[10, 14], [14, 21]]; H = 2/3 · xᵀx
    h = hessian_finalize(state)
    assert h.dtype == torch.float32
    factor = torch.tensor(2.0 / 3.0, dtype=torch.float32)
    expected = torch.tensor([[10.0, 14.0], [14.0, 21.0]]) * factor
    assert_bitwise_equal(h, expected)


def test_hessian_leading_axes_are_rows_and_the_mask_drops_rows():
    x = torch.arange(24, dtype=torch.bfloat16).reshape(2, 3, 4)
    mask = torch.tensor([[True, False, True], [False, True, True]])
    masked = hessian_update(hessian_init(4), x, mask)
    kept = hessian_update(hessian_init(4), x[mask])
    assert int(masked.rows) == 4
    assert_bitwise_equal(masked.xtx, kept.xtx)
    assert_bitwise_equal(hessian_finalize(masked), hessian_finalize(kept))
    inf_in_padding = x.float().clone()
    inf_in_padding[0, 1] = torch.inf  # a masked row never reaches the sum
    assert_bitwise_equal(hessian_update(hessian_init(4), inf_in_padding, mask).xtx, kept.xtx)


def test_hessian_update_is_pure():
    state = hessian_init(3)
    before = state.xtx.clone()
    new = hessian_update(state, torch.ones(5, 3))
    assert_bitwise_equal(state.xtx, before)
    assert int(state.rows) == 0 and int(new.rows) == 5


def test_hessian_errors():
    with pytest.raises(ValueError, match="no rows"):
        hessian_finalize(hessian_init(3))
    with pytest.raises(ValueError, match="no rows"):
        hessian_finalize(hessian_update(hessian_init(2), torch.ones(2, 2), torch.zeros(2).bool()))
    with pytest.raises(ValueError, match="not finite"):
        hessian_finalize(hessian_update(hessian_init(2), torch.tensor([[torch.inf, 1.0]])))
    with pytest.raises(ValueError, match=r"shape \(\*batch, 3\)"):
        unchecked(hessian_update)(hessian_init(3), torch.ones(2, 4))
    with pytest.raises(ValueError, match="mask must have"):
        unchecked(hessian_update)(hessian_init(2), torch.ones(3, 2), torch.ones(2).bool())
    with pytest.raises(TypeError, match="mask must be a bool"):
        unchecked(hessian_update)(hessian_init(2), torch.ones(3, 2), torch.ones(3))
    with pytest.raises(TypeError, match="x must be a floating"):
        unchecked(hessian_update)(hessian_init(2), torch.ones(3, 2).int())
    with pytest.raises(ValueError, match="k must be >= 1"):
        hessian_init(0)


# ------------------------------------------------------------------------------------------------
# An independent oracle
# ------------------------------------------------------------------------------------------------


def _oracle_params(x, bits, sym):
    """The group quantizer's ``(scale, zero)`` on ``x`` (rows, group), float64."""
    maxq = 2**bits - 1
    zeros = torch.zeros(x.shape[0], dtype=x.dtype)
    xmin = torch.minimum(x.min(1).values, zeros)
    xmax = torch.maximum(x.max(1).values, zeros)
    if sym:
        xmax = torch.maximum(xmin.abs(), xmax)
        xmin = torch.where(xmin < 0, -xmax, xmin)
    both = (xmin == 0) & (xmax == 0)
    xmin = torch.where(both, -1.0, xmin)
    xmax = torch.where(both, 1.0, xmax)
    scale = (xmax - xmin) / maxq
    zero = torch.full_like(scale, (maxq + 1) / 2) if sym else torch.round(-xmin / scale)
    return scale, zero


def _oracle(weight, hessian, cfg):
    """Unblocked GPTQ in float64: ``(values, codes, scales, zeros, g_idx, loss)``."""
    w = weight.double().clone()
    h = hessian.double().clone()
    out, k = w.shape
    gs = k if cfg.group_size == -1 else cfg.group_size
    maxq = 2**cfg.bits - 1
    dead = torch.diag(h) == 0
    h[dead, dead] = 1
    w[:, dead] = 0
    natural = [list(range(s, min(k, s + gs))) for s in range(0, k, gs)]
    static = [_oracle_params(w[:, cols], cfg.bits, cfg.sym) for cols in natural]
    d = torch.diag(h).tolist()
    if cfg.desc_act:
        perm = sorted(range(k), key=lambda i: (-d[i], i))
    elif cfg.act_group_aware:
        order = sorted(range(len(natural)), key=lambda g: (-max(d[i] for i in natural[g]), g))
        perm = [i for g in order for i in sorted(natural[g], key=lambda i: (-d[i], i))]
    else:
        perm = list(range(k))
    p = torch.tensor(perm)
    w, h = w[:, p], h[p][:, p]
    damped = h.clone()
    damped.diagonal().add_(cfg.damp_percent * h.diagonal().mean())
    u = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(damped)), upper=True)
    if cfg.act_group_aware and not cfg.desc_act:
        starts, pos = {}, 0
        for g in order:
            starts[pos] = (pos + len(natural[g]), g)
            pos += len(natural[g])
    else:
        starts = {s: (min(k, s + gs), s // gs) for s in range(0, k, gs)}
    scales = torch.zeros(out, len(natural), dtype=torch.float64)
    zeros = torch.zeros_like(scales)
    values, codes, loss = torch.zeros_like(w), torch.zeros_like(w), 0.0
    for i in range(k):
        if cfg.static_groups:
            g = perm[i] // gs
            s, z = static[g]
            scales[:, g], zeros[:, g] = s, z
        elif i in starts:
            end, g = starts[i]
            s, z = _oracle_params(w[:, i:end], cfg.bits, cfg.sym)
            scales[:, g], zeros[:, g] = s, z
        c = torch.clamp(torch.round(w[:, i] / s) + z, 0, maxq)
        q = s * (c - z)
        err = (w[:, i] - q) / u[i, i]
        loss += float((err**2).sum()) / 2
        w[:, i + 1 :] -= err[:, None] * u[i, i + 1 :][None, :]
        values[:, i], codes[:, i] = q, c
    inverse = torch.argsort(p)
    g_idx = inverse // gs if cfg.desc_act and not cfg.static_groups else torch.arange(k) // gs
    return values[:, inverse], codes[:, inverse], scales, zeros, g_idx, loss


def _problem(seed, out, k, *, rows=None, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows or 3 * k, k, generator=g, dtype=torch.float64)
    x = x @ (torch.eye(k, dtype=torch.float64) + torch.randn(k, k, generator=g).double() / k**0.5)
    hessian = 2 / x.shape[0] * x.T @ x
    weight = torch.randn(out, k, generator=g, dtype=torch.float64)
    return weight.to(dtype), hessian.to(dtype)


MODES = {
    "plain": dict(act_group_aware=False),
    "desc_act": dict(desc_act=True, act_group_aware=False),
    "static": dict(static_groups=True, act_group_aware=False),
    "desc_act+static": dict(desc_act=True, static_groups=True, act_group_aware=False),
    "group_aware": dict(act_group_aware=True),
    "group_aware+static": dict(act_group_aware=True, static_groups=True),
}


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize(
    ("k", "group_size", "blocksize"),
    [(64, 16, 128), (64, 16, 8), (100, 32, 16), (72, 24, 32), (48, -1, 16)],
)
def test_solve_equals_the_unblocked_oracle_asymmetric(mode, k, group_size, blocksize):
    # asymmetric scales put no code on an exact rounding tie, so float64 results agree exactly
    weight, hessian = _problem(k + group_size, 6, k)
    cfg = Opts(bits=3, group_size=group_size, sym=False, **MODES[mode])
    sol = gptq_solve(weight, hessian, cfg, blocksize=blocksize)
    values, codes, scales, zeros, g_idx, loss = _oracle(weight, hessian, cfg)
    assert torch.equal(sol.codes.double(), codes)
    assert torch.equal(sol.zeros.double(), zeros)
    assert torch.equal(sol.g_idx.long(), g_idx)
    torch.testing.assert_close(sol.scales, scales, rtol=1e-12, atol=0)
    torch.testing.assert_close(sol.dequantized, values, rtol=1e-12, atol=1e-12)
    assert sol.loss.item() == pytest.approx(loss, rel=1e-9)
    assert sol.damp == 0.05


@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("mode", ["plain", "static"])
def test_solve_equals_the_unblocked_oracle_symmetric(bits, mode):
    # Symmetric scales map a row's negative extreme to exactly -7.5 (a rounding tie) when it sits
    # in the first column of its group; the first columns are kept small so no such tie occurs.
    weight, hessian = _problem(bits, 8, 96)
    weight[:, ::32] *= 0.01
    cfg = Opts(bits=bits, group_size=32, **MODES[mode])
    sol = gptq_solve(weight, hessian, cfg, blocksize=64)
    values, codes, scales, zeros, _, loss = _oracle(weight, hessian, cfg)
    assert torch.equal(sol.codes.double(), codes)
    assert (sol.zeros == 2 ** (bits - 1)).all() and torch.equal(sol.zeros.double(), zeros)
    torch.testing.assert_close(sol.scales, scales, rtol=1e-12, atol=0)
    torch.testing.assert_close(sol.dequantized, values, rtol=1e-12, atol=1e-12)
    assert sol.loss.item() == pytest.approx(loss, rel=1e-9)


def test_desc_act_g_idx_follows_the_sorted_order():
    k, gs = 32, 8
    weight = torch.randn(4, k, dtype=torch.float64)
    diag = torch.arange(1, k + 1, dtype=torch.float64)  # ascending: desc_act reverses it
    cfg = Opts(group_size=gs, desc_act=True, act_group_aware=False)
    sol = gptq_solve(weight, torch.diag(diag), cfg)
    assert sol.g_idx.dtype == torch.int32
    assert sol.g_idx.tolist() == [(k - 1 - i) // gs for i in range(k)]
    static = gptq_solve(
        weight,
        torch.diag(diag),
        Opts(group_size=gs, desc_act=True, act_group_aware=False, static_groups=True),
    )
    assert static.g_idx.tolist() == [i // gs for i in range(k)]


@pytest.mark.parametrize("mode", list(MODES))
def test_values_are_scale_times_code_minus_zero_of_their_group(mode):
    weight, hessian = _problem(3, 16, 80, dtype=torch.float32)
    for sym in (True, False):
        cfg = Opts(bits=4, group_size=32, sym=sym, **MODES[mode])
        sol = gptq_solve(weight, hessian, cfg, blocksize=32)
        g = sol.g_idx.long()
        scale = sol.scales[:, g]
        zero = sol.zeros[:, g].float()
        expected = (sol.codes.float() - zero) * scale
        assert_bitwise_equal(sol.dequantized, expected)
        assert sol.codes.dtype == torch.uint8 and int(sol.codes.max()) <= 15
        assert sol.scales.shape == (16, 3) and sol.zeros.shape == (16, 3)


def test_dead_columns_are_zero_and_the_solve_stays_finite():
    weight, hessian = _problem(5, 8, 32)
    for j in (0, 7, 31):
        hessian[j, :] = 0
        hessian[:, j] = 0
    sol = gptq_solve(weight, hessian, Opts(group_size=16, sym=False))
    assert torch.isfinite(sol.dequantized).all() and torch.isfinite(sol.loss)
    for j in (0, 7, 31):
        assert (sol.dequantized[:, j] == 0).all()
        assert torch.equal(sol.codes[:, j], sol.zeros[:, j // 16])


def test_damping_retries_upward_until_the_cholesky_succeeds():
    weight, _ = _problem(6, 4, 16)
    g = torch.Generator().manual_seed(6)
    x = torch.randn(4, 16, generator=g, dtype=torch.float64)  # rank 4 < 16
    gram = x.T @ x / 2
    mean = gram.diagonal().mean()
    hessian = gram - 0.2 * mean * torch.eye(16, dtype=torch.float64)  # eigenvalues down to -0.2m
    cfg = Opts(group_size=-1, damp_percent=0.05, damp_auto_increment=0.01)
    sol = gptq_solve(weight, hessian, cfg)
    # needs damp * 0.8m > 0.2m, i.e. damp > 0.25: the first working candidate of 0.05 + j·0.01
    assert 0.25 < sol.damp < 0.27
    assert torch.isfinite(sol.dequantized).all() and torch.isfinite(sol.loss)
    # without retries the diagonal floors (up to +0.1·max diag) rescue it instead
    floored = gptq_solve(weight, hessian, Opts(group_size=-1, damp_auto_increment=0.0))
    assert floored.damp == 0.05 and torch.isfinite(floored.dequantized).all()


def test_a_negative_diagonal_that_no_damp_repairs_is_an_error():
    # GPT-QModel floors the diagonal and "solves" -I as round-to-nearest; floatxq refuses it
    hessian = -torch.eye(8, dtype=torch.float64)  # damping subtracts: mean(diag) < 0
    with pytest.raises(ValueError, match="not positive semidefinite"):
        gptq_solve(torch.randn(4, 8, dtype=torch.float64), hessian, Opts(group_size=-1))


def test_a_hopeless_hessian_is_an_error():
    hessian = torch.tensor([[1.0, 10.0], [10.0, 1.0]])
    with pytest.raises(ValueError, match="could not be made positive definite"):
        gptq_solve(torch.ones(2, 2), hessian, Opts(group_size=-1))


def test_inputs_are_not_mutated_even_for_a_single_row():
    for out in (1, 5):
        weight, hessian = _problem(7, out, 24, dtype=torch.float32)
        hessian[3, :] = 0
        hessian[:, 3] = 0
        before = weight.clone(), hessian.clone()
        gptq_solve(weight, hessian, Opts(group_size=8, desc_act=True, act_group_aware=False))
        rtn_quantize(weight, Opts(group_size=8))
        assert_bitwise_equal(weight, before[0])
        assert_bitwise_equal(hessian, before[1])


def test_bfloat16_weights_are_solved_in_fp32_and_returned_in_bfloat16():
    weight, hessian = _problem(8, 8, 64, dtype=torch.float32)
    weight = weight.bfloat16()
    sol = gptq_solve(weight, hessian, Opts(group_size=32))
    ref = gptq_solve(weight.float(), hessian, Opts(group_size=32))
    assert sol.dequantized.dtype == torch.bfloat16 and sol.scales.dtype == torch.float32
    assert torch.equal(sol.codes, ref.codes)
    assert_bitwise_equal(sol.dequantized, ref.dequantized.bfloat16())


def test_parameters_are_accepted_and_nothing_requires_grad():
    layer = torch.nn.Linear(32, 8)
    sol = gptq_solve(layer.weight, torch.eye(32), Opts(group_size=16))
    assert isinstance(sol, GPTQSolution) and not sol.dequantized.requires_grad
    assert not rtn_quantize(layer.weight, Opts()).dequantized.requires_grad


def test_rtn_by_hand():
    w = torch.tensor([[1.0, -2.0, 0.5, 0.0], [0.0, 0.0, 0.0, 0.0], [0.3, 0.6, 0.9, 1.2]])
    sol = rtn_quantize(w, Opts(bits=4, group_size=-1))
    # row 0: amax 2 → scale fp32(4/15) = 0.26666668 (rounded up), zero 8; 1/s = 3.7499998 → 4;
    # -2/s = -7.4999995 → -7 (the exact -7.5 tie is decided by the scale's rounding); 0.5/s →
    # 1.8749999 → 2. row 1: all zero → scale 2/15. row 2: xmin = 0 stays 0 (symmetric widening
    # only applies to negative minima) → scale 1.2/15 and 0.6/s = 7.5 → 8, 1.2/s = 15: both clamp.
    assert sol.codes.tolist() == [[12, 1, 10, 8], [8, 8, 8, 8], [12, 15, 15, 15]]
    assert sol.zeros.tolist() == [[8], [8], [8]]
    s = torch.tensor([4.0, 2.0, 1.2]) / torch.tensor(15.0)
    assert_bitwise_equal(sol.scales[:, 0], s)
    assert sol.damp == 0.0 and sol.g_idx.tolist() == [0, 0, 0, 0]
    assert sol.loss.item() == pytest.approx(float(((w - sol.dequantized) ** 2).sum()) / 2)
    asym = rtn_quantize(w, Opts(bits=2, group_size=2, sym=False))
    # row 0 group 0: [1, -2] → scale 3/3 = 1, zero round(2) = 2 → codes 3, 0
    assert asym.codes[0].tolist()[:2] == [3, 0] and asym.zeros[0, 0] == 2
    assert asym.scales.shape == (3, 2) and asym.g_idx.tolist() == [0, 0, 1, 1]


def test_rtn_and_solve_reject_bad_arguments():
    cfg = Opts()
    with pytest.raises(ValueError, match="NaN or infinity"):
        rtn_quantize(torch.tensor([[1.0, torch.nan]]), cfg)
    with pytest.raises(ValueError, match="weight contains NaN"):
        gptq_solve(torch.tensor([[1.0, torch.inf]]), torch.eye(2), cfg)
    with pytest.raises(ValueError, match="hessian contains NaN"):
        gptq_solve(torch.ones(2, 2), torch.full((2, 2), torch.nan), cfg)
    with pytest.raises(ValueError, match=r"hessian must have shape \(2, 2\)"):
        unchecked(gptq_solve)(torch.ones(2, 2), torch.eye(3), cfg)
    with pytest.raises(ValueError, match="blocksize must be an int >= 1"):
        gptq_solve(torch.ones(2, 2), torch.eye(2), cfg, blocksize=0)
    with pytest.raises(TypeError, match="options must be a GPTQSolveOptions"):
        unchecked(gptq_solve)(torch.ones(2, 2), torch.eye(2), {"bits": 4})
    with pytest.raises(TypeError, match="hessian must be a floating-point tensor"):
        unchecked(gptq_solve)(torch.ones(2, 2), torch.eye(2).int(), cfg)
    with pytest.raises(TypeError, match="weight must be a torch.Tensor"):
        unchecked(rtn_quantize)([[1.0]], cfg)
    with pytest.raises(ValueError, match="weight magnitudes must be at most"):
        rtn_quantize(torch.tensor([[3e38, 0.0]]), cfg)
    with pytest.raises(TypeError, match="weight must be a floating"):
        unchecked(rtn_quantize)(torch.ones(2, 2).int(), cfg)
    with pytest.raises(ValueError, match="non-empty 2-D"):
        unchecked(rtn_quantize)(torch.ones(2), cfg)


@pytest.mark.parametrize(
    ("out", "k", "kwargs"),
    [
        (3, 40, dict(bits=3, group_size=12)),  # groups straddle blocks of 8
        (1, 1, dict(bits=4, group_size=-1)),
        (5, 72, dict(bits=2, group_size=16, mse=2.4)),
        (4, 33, dict(bits=8, group_size=8, desc_act=True, act_group_aware=False)),
        (2, 50, dict(bits=5, group_size=3, static_groups=True)),
        (
            6,
            64,
            dict(bits=6, group_size=32, desc_act=True, act_group_aware=False, static_groups=True),
        ),
        (3, 45, dict(bits=4, group_size=4, act_group_aware=False)),
    ],
)
def test_block_size_does_not_change_the_result_in_float64(out, k, kwargs):
    # asymmetric: the symmetric quantizer puts a group's first-column minimum on an exact tie
    # (-7.5 for 4 bits), which ulp-level differences between block sizes may break either way
    weight, hessian = _problem(out * k, out, k)
    cfg = Opts(sym=False, **kwargs)
    sols = [gptq_solve(weight, hessian, cfg, blocksize=bs) for bs in (1, 8, 128)]
    for sol in sols[1:]:
        assert torch.equal(sol.codes, sols[0].codes)
        assert torch.equal(sol.zeros, sols[0].zeros)
        assert torch.equal(sol.g_idx, sols[0].g_idx)
        torch.testing.assert_close(sol.scales, sols[0].scales, rtol=1e-10, atol=0)
        torch.testing.assert_close(sol.dequantized, sols[0].dequantized, rtol=1e-10, atol=1e-300)
        torch.testing.assert_close(sol.loss, sols[0].loss, rtol=1e-8, atol=1e-300)


def test_gptq_beats_round_to_nearest_on_correlated_inputs():
    # statistical: the Hessian-weighted error tr((W-Q) H (W-Q)ᵀ) with the undamped H, median over
    # problems of GPTQ's error relative to RTN's, for the default 4-bit setting with groups of 32
    ratios = []
    for seed in range(7):
        weight, hessian = _problem(seed, 16, 96, rows=2 * 96 + 4, dtype=torch.float32)
        cfg = Opts(bits=4, group_size=32)

        def error(q, w=weight, h=hessian):
            d = (w - q).double()
            return float(((d @ h.double()) * d).sum())

        ratios.append(
            error(gptq_solve(weight, hessian, cfg).dequantized)
            / error(rtn_quantize(weight, cfg).dequantized)
        )
    assert statistics.median(ratios) < 0.9, ratios


# ------------------------------------------------------------------------------------------------
# CUDA
# ------------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize(
    "cfg",
    [
        Opts(act_group_aware=False),
        Opts(),
        Opts(group_size=32, sym=False, mse=2.4),
        Opts(group_size=96, desc_act=True, act_group_aware=False),
        Opts(desc_act=True, static_groups=True, act_group_aware=False),
        Opts(bits=3, group_size=-1),
    ],
)
def test_cuda_graph_replay_equals_the_eager_block_solve(cfg):
    weight, hessian = _problem(11, 256, 640, dtype=torch.float32)
    weight, hessian = weight.cuda(), hessian.cuda()
    with warnings.catch_warnings():
        # a capture that falls back to eager fails the test
        warnings.filterwarnings("error", message="gptq_solve: CUDA graph capture failed")
        graph = gptq_solve(weight, hessian, cfg)
    eager = gptq_solve(weight, hessian, cfg, cuda_graph=False)
    for a, b in zip(graph, eager, strict=True):
        if isinstance(a, torch.Tensor):
            assert a.is_cuda
            assert_bitwise_equal(a, b)
    assert graph.damp == eager.damp
    cpu = gptq_solve(weight.cpu(), hessian.cpu(), cfg)
    # CPU and CUDA differ only through FP32 summation order (Cholesky, GEMM): near-ties may flip
    assert float((graph.codes.cpu() == cpu.codes).float().mean()) > 0.99


@pytest.mark.gpu
def test_cuda_rtn_without_search_is_bit_identical_to_cpu():
    weight, _ = _problem(12, 64, 256, dtype=torch.float32)
    for cfg in (Opts(), Opts(bits=3, sym=False, group_size=32)):
        gpu, cpu = rtn_quantize(weight.cuda(), cfg), rtn_quantize(weight, cfg)
        for field in ("dequantized", "codes", "scales", "zeros", "g_idx"):
            assert_bitwise_equal(getattr(gpu, field), getattr(cpu, field), msg=field)
        # the loss is a reduction: equal up to summation order only
        torch.testing.assert_close(gpu.loss.cpu(), cpu.loss, rtol=1e-12, atol=0)
