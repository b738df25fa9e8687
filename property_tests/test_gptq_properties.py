"""Properties of the Hessian fold, the GPTQ solve and RTN (SPEC §5, reference §8)."""

import statistics

import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from floatxq.config import GPTQConfig
from floatxq.gptq import gptq_solve, hessian_finalize, hessian_init, hessian_update, rtn_quantize
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


class Cfg(dict):
    """GPTQConfig keyword arguments; built inside the test (the annotation check of the config
    draws from ``random``, which Hypothesis forbids inside strategies)."""

    def build(self) -> GPTQConfig:
        return GPTQConfig(**self)


@st.composite
def configs(draw, *, sym=None, modes=tuple(MODES), mse=(0.0, 0.0, 2.4)):
    return Cfg(
        bits=draw(st.sampled_from([2, 3, 4, 5, 6, 8])),
        group_size=draw(st.sampled_from([-1, 3, 4, 8, 16, 32])),
        sym=draw(st.booleans()) if sym is None else sym,
        mse=draw(st.sampled_from(mse)),
        **MODES[draw(st.sampled_from(modes))],
    )


def _gaussian(seed: int, out: int, k: int, dtype=torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    scale = torch.exp2(torch.randint(-8, 8, (out, 1), generator=g).double())
    return (torch.randn(out, k, generator=g, dtype=torch.float64) * scale).to(dtype)


def _wishart(seed: int, k: int, *, rows: int | None = None, dtype=torch.float32) -> torch.Tensor:
    """``2/N · xᵀx`` of correlated random inputs (positive definite when ``rows >= k``)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows or 2 * k + 4, k, generator=g, dtype=torch.float64)
    mix = torch.eye(k, dtype=torch.float64) + torch.randn(k, k, generator=g).double() / k**0.5
    x = x @ mix
    return (2 / x.shape[0] * x.T @ x).to(dtype)


# ------------------------------------------------------------------------------------------------
# Hessian fold
# ------------------------------------------------------------------------------------------------


@given(st.integers(1, 6), st.integers(0, 12), st.integers(0, 12), st.integers(0, 2**31 - 1))
@example(1, 0, 1, 0)
def test_fold_is_associative_exactly_on_integer_inputs(k, n1, n2, seed):
    # small integers make every partial sum exact in FP32, so any split must agree bit for bit
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(-8, 9, (n1 + n2, k), generator=g).float()
    one = hessian_update(hessian_init(k), x)
    two = hessian_update(hessian_update(hessian_init(k), x[:n1]), x[n1:])
    assert_bitwise_equal(two.xtx, one.xtx)
    assert int(two.rows) == int(one.rows) == n1 + n2
    if n1 + n2:
        assert_bitwise_equal(hessian_finalize(two), hessian_finalize(one))
        expected = x.double().T @ x.double() * 2 / (n1 + n2)
        torch.testing.assert_close(hessian_finalize(one).double(), expected, rtol=2e-7, atol=0)


@given(st.integers(1, 8), st.integers(1, 40), st.integers(0, 39), st.integers(0, 2**31 - 1))
def test_fold_of_two_half_batches_equals_one_batch_up_to_summation_order(k, n, cut, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, k, generator=g)
    cut = min(cut, n)
    one = hessian_finalize(hessian_update(hessian_init(k), x))
    two = hessian_finalize(hessian_update(hessian_update(hessian_init(k), x[:cut]), x[cut:]))
    torch.testing.assert_close(two, one, rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------------------------------------------
# The solve
# ------------------------------------------------------------------------------------------------

BOUNDED = f32_values(max_magnitude=1e30)


@given(
    matrices(max_blocks=(6, 40), elements=BOUNDED),
    configs(),
    st.sampled_from([1e-3, 1.0, 7.5, 4096.0]),
)
@example(torch.zeros(2, 3), Cfg(), 1.0)
@example(torch.tensor([[-1e-45, 0.0, 1e-45, -0.0]]), Cfg(sym=False, group_size=2), 1.0)
@SLOW
def test_identity_hessian_solve_is_round_to_nearest(weight, cfg, c):
    cfg = cfg.build()
    # no cross terms in H: nothing is fed forward, so every column rounds on its own
    k = weight.shape[1]
    sol = gptq_solve(weight, c * torch.eye(k), cfg, blocksize=8)
    rtn = rtn_quantize(weight, cfg)
    assert_bitwise_equal(sol.codes, rtn.codes)
    assert_bitwise_equal(sol.zeros, rtn.zeros)
    assert_bitwise_equal(sol.g_idx, rtn.g_idx)
    assert_bitwise_equal(sol.scales, rtn.scales)  # equal diag(H): the sorts keep the order
    assert torch.equal(sol.dequantized, rtn.dequantized)  # ±0 may differ after error feedback


@given(st.integers(1, 6), st.integers(1, 72), configs(sym=False), st.integers(0, 2**31 - 1))
@example(3, 40, Cfg(bits=3, group_size=12, sym=False), 0)  # groups straddle blocks
@SLOW
def test_block_size_does_not_change_the_result_in_float64(out, k, cfg, seed):
    cfg = cfg.build()
    # asymmetric: the symmetric quantizer puts a group's first-column minimum on an exact tie
    # (-7.5 for 4 bits), which ulp-level differences between block sizes may break either way
    weight = _gaussian(seed, out, k, torch.float64)
    hessian = _wishart(seed, k, dtype=torch.float64)
    sols = [gptq_solve(weight, hessian, cfg, blocksize=bs) for bs in (1, 8, 128)]
    for sol in sols[1:]:
        assert torch.equal(sol.codes, sols[0].codes)
        assert torch.equal(sol.zeros, sols[0].zeros)
        torch.testing.assert_close(sol.scales, sols[0].scales, rtol=1e-10, atol=0)
        torch.testing.assert_close(sol.dequantized, sols[0].dequantized, rtol=1e-10, atol=1e-300)
        torch.testing.assert_close(sol.loss, sols[0].loss, rtol=1e-8, atol=1e-300)


@given(
    matrices(max_blocks=(6, 40), elements=BOUNDED),
    configs(),
    st.integers(0, 2**31 - 1),
    st.sampled_from([torch.float32, torch.bfloat16]),
)
@SLOW
def test_every_code_is_on_the_grid_of_its_group(weight, cfg, seed, dtype):
    cfg = cfg.build()
    weight = weight.to(dtype)
    k = weight.shape[1]
    for sol in (gptq_solve(weight, _wishart(seed, k), cfg), rtn_quantize(weight, cfg)):
        maxq = 2**cfg.bits - 1
        assert sol.codes.dtype == torch.uint8 and int(sol.codes.max()) <= maxq
        assert int(sol.zeros.max()) <= maxq
        if cfg.sym:
            assert bool((sol.zeros == 2 ** (cfg.bits - 1)).all())
        assert bool(torch.isfinite(sol.scales).all()) and bool((sol.scales > 0).all())
        assert bool(torch.isfinite(sol.loss)) and float(sol.loss) >= 0
        g = sol.g_idx.long()
        assert int(g.max()) < sol.scales.shape[1]
        values = (sol.codes.float() - sol.zeros[:, g].float()) * sol.scales[:, g]
        assert_bitwise_equal(sol.dequantized, values.to(dtype))


@st.composite
def weights_on_a_grid(draw):
    """``(weight, cfg)``: every group row holds codes 0 and maxq of a per-row power-of-two grid."""
    cfg = draw(configs(sym=False, modes=("plain", "static", "group_aware", "group_aware+static")))
    if cfg["group_size"] == -1 and draw(st.booleans()):
        cfg.update(desc_act=True, act_group_aware=False, static_groups=False)
    out, groups = draw(st.integers(1, 5)), draw(st.integers(1, 4))
    grouped = cfg["group_size"] != -1
    gs = cfg["group_size"] if grouped else draw(st.integers(2, 12))
    k = gs * groups if grouped else gs
    maxq = 2 ** cfg["bits"] - 1
    seed = draw(st.integers(0, 2**31 - 1))
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, maxq + 1, (out, k), generator=g)
    width = gs if grouped else k
    for start in range(0, k, width):  # both ends of the grid in every group row
        codes[:, start] = 0
        codes[:, start + 1 if width > 1 else start] = maxq
    codes = codes if grouped else codes[:, torch.randperm(k, generator=g)]
    zero = torch.randint(0, maxq + 1, (out, 1), generator=g)
    scale = torch.exp2(torch.randint(-20, 20, (out, 1), generator=g).float())
    return (codes - zero).float() * scale, cfg, seed


@given(weights_on_a_grid())
@SLOW
def test_a_weight_already_on_the_grid_comes_back_unchanged_with_zero_loss(case):
    weight, cfg, seed = case
    cfg = cfg.build()
    sol = gptq_solve(weight, _wishart(seed, weight.shape[1]), cfg, blocksize=8)
    assert_bitwise_equal(sol.dequantized, weight)
    assert float(sol.loss) == 0.0
    assert torch.equal(rtn_quantize(weight, cfg).dequantized, weight)


@given(
    st.integers(1, 4),
    st.integers(4, 24),
    st.floats(0.06, 0.4),
    st.integers(0, 2**31 - 1),
    configs(mse=(0.0,)),
)
@SLOW
def test_an_indefinite_hessian_is_damped_until_it_factors(out, k, shift, seed, cfg):
    cfg = cfg.build()
    # a rank-deficient Gram matrix minus shift·mean(diag): the 5% damp cannot fix it, retries can
    rank = max(1, k // 3)
    gram = _wishart(seed, k, rows=rank, dtype=torch.float64)
    hessian = gram - shift * gram.diagonal().mean() * torch.eye(k, dtype=torch.float64)
    weight = _gaussian(seed, out, k)
    sol = gptq_solve(weight, hessian.float(), cfg)
    assert sol.damp > cfg.damp_percent
    # the damped diagonal must exceed the shift: damp · (1 - shift) > shift (up to rounding)
    assert sol.damp * (1 - shift) > shift * 0.99
    assert bool(torch.isfinite(sol.dequantized).all()) and bool(torch.isfinite(sol.loss))
    assert int(sol.codes.max()) <= 2**cfg.bits - 1


def test_gptq_beats_round_to_nearest_on_correlated_inputs():
    # statistical: the Hessian-weighted error tr((W-Q) H (W-Q)ᵀ) with the undamped H, median over
    # seeds of GPTQ's error relative to RTN's, for the default 4-bit g128-style setting
    ratios = []
    for seed in range(7):
        weight = _gaussian(seed, 16, 96)
        hessian = _wishart(seed, 96)
        cfg = GPTQConfig(bits=4, group_size=32)

        def error(q, w=weight, h=hessian):
            d = (w - q).double()
            return float(((d @ h.double()) * d).sum())

        ratios.append(
            error(gptq_solve(weight, hessian, cfg).dequantized)
            / error(rtn_quantize(weight, cfg).dequantized)
        )
    assert statistics.median(ratios) < 0.9, ratios
