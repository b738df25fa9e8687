"""Properties of GSQ's code refinement (:func:`floatxq.refine_fp8_codes`), its objective
(:func:`floatxq.gsq_objective`) and its grid (:func:`floatxq.fp8_code_grid`).

The oracles here are written independently of ``floatxq.gsq``: codes are decoded with ml_dtypes,
inverse scales expanded region by region, the objective summed in FP64 with ``einsum`` and the
grid built from the 256 decoded bytes. Weights are drawn as values in ``[-4, 4]`` times a power of
two per row with signed zeros mixed in, Hessians as ``xᵀx`` of small integer inputs (exact,
positive semi-definite) whose dead inputs are zero columns, so a failure shrinks to a small case.
"""

import math
from typing import NamedTuple

import ml_dtypes
import numpy as np
import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import floatxq as fq
from floatxq.testing import assert_bitwise_equal, production_checks
from floatxq.testing.reference import ml_decode_codes
from floatxq.testing.strategies import FLOAT_DTYPES, FP8_ENCODABLE

_ML = {name: getattr(ml_dtypes, name) for name in FP8_ENCODABLE}


class Problem(NamedTuple):
    """One call of ``refine_fp8_codes``: a weight, its round-to-nearest baseline, a Hessian."""

    format: str
    method: str
    block: tuple[int, int] | None
    weight: torch.Tensor
    hessian: torch.Tensor | None
    config: dict
    """``GSQConfig`` keywords (the config is built in the test: its checked constructor draws
    from ``random``, which Hypothesis forbids inside strategies)."""
    shift: np.ndarray | None = None
    """Grid steps each baseline code is moved by (clamped to the grid), or None: the baseline
    is round to nearest, which a weight-only refinement can rarely improve on."""

    def baseline(self) -> fq.FP8Weight:
        q = fq.quantize_fp8_weight(
            self.weight,
            format=self.format,
            weight_scale_method=self.method,
            weight_block_size=self.block,
        )
        if self.shift is None:
            return q
        grid = _grid(self.format)
        pos = _positions(_decoded(q.qweight, self.format), self.format)
        moved = np.clip(pos + self.shift, 0, len(grid) - 1)
        moved_bytes = grid[moved].astype(_ML[self.format]).view(np.uint8)
        old = q.qweight.view(torch.uint8).numpy()
        codes = np.where(moved == pos, old, moved_bytes)  # unmoved codes keep their byte
        return q._replace(qweight=torch.from_numpy(codes).view(q.qweight.dtype))


@st.composite
def configs(draw, *, max_steps: int = 6) -> dict:
    start = draw(st.sampled_from([0.5, 1.0, 2.0]))
    return dict(
        candidates=draw(st.integers(2, 7)),
        steps=draw(st.integers(1, max_steps)),
        learning_rate=draw(st.sampled_from([0.1, 0.5, 1.0, 2.0])),
        temperature_start=start,
        temperature_end=start * draw(st.sampled_from([1.0, 0.5, 0.05])),
        seed=draw(st.integers(0, 2**32)),
    )


@st.composite
def problems(draw, *, hessian: bool | None = None) -> Problem:
    """A drawn format, weight dtype, scale layout, weight, Hessian (or None) and config.

    Tensor and row layouts get 0 to 5 rows and 0 to 9 columns; a block layout 0 to 3 blocks of
    rows and 1 to 3 of columns (``quantize_fp8_weight`` gives a zero-column block weight a scale
    grid that its own decoder refuses, so zero columns are drawn with the other layouts).
    """
    dtype = draw(st.sampled_from(FLOAT_DTYPES))
    method = draw(st.sampled_from(["tensor", "row", "block"]))
    if method == "block":
        block = (draw(st.integers(1, 3)), draw(st.integers(1, 4)))
        rows = block[0] * draw(st.integers(1, 3))
        cols = block[1] * draw(st.integers(1, 3))
    else:
        block, rows, cols = None, draw(st.integers(1, 5)), draw(st.integers(1, 9))
    empty = draw(st.sampled_from(["rows", "cols", *["none"] * 8]))  # now and then an empty side
    rows = 0 if empty == "rows" else rows
    cols = 0 if empty == "cols" and method != "block" else cols
    values = st.one_of(st.floats(-4, 4, width=32), st.sampled_from([0.0, -0.0, 1.0, -0.375]))
    every = st.nothing()  # no fill value: each element drawn, so zeros stay occasional
    bulk = draw(hnp.arrays(np.float32, (rows, cols), elements=values, fill=every))
    exponents = draw(hnp.arrays(np.int32, (rows, 1), elements=st.integers(-10, 10)))
    weight = torch.from_numpy(bulk) * torch.exp2(torch.from_numpy(exponents).float())
    with_hessian = draw(st.booleans()) if hessian is None else hessian
    h = None
    if with_hessian:
        n = draw(st.integers(1, 2 * cols + 1))
        x = draw(hnp.arrays(np.int8, (n, cols), elements=st.integers(-3, 3), fill=every))
        x = torch.from_numpy(x).to(torch.float64)
        dead = draw(hnp.arrays(np.bool_, (cols,), elements=st.sampled_from([False] * 3 + [True])))
        x[:, torch.from_numpy(dead)] = 0.0  # inputs that never fire: zero rows and columns
        h = (x.T @ x).to(draw(st.sampled_from([torch.float32, torch.float64])))
    fmt = draw(st.sampled_from(FP8_ENCODABLE))
    shift = None
    if draw(st.booleans()):
        shift = draw(hnp.arrays(np.int64, (rows, cols), elements=st.integers(-2, 2), fill=every))
    return Problem(fmt, method, block, weight.to(dtype), h, draw(configs()), shift)


# A signed zero among the weights: its code is -0 (0x80) in e4m3fn and must stay that byte.
SIGNED_ZERO = Problem(
    "float8_e4m3fn",
    "row",
    None,
    torch.tensor([[-0.0, 1.0, 0.3, -0.7], [0.2, -0.0, -0.0, 0.11]]),
    torch.tensor([[2.0, 1, 0, 0], [1, 2, 0, 0], [0, 0, 0, 0], [0, 0, 0, 1]]),
    {"candidates": 3, "steps": 4, "seed": 1},
)
# The same with codes moved off round to nearest: rows change around the zeros.
SIGNED_ZERO_MOVED = SIGNED_ZERO._replace(
    hessian=torch.eye(4),
    config={"candidates": 3, "steps": 4, "seed": 1, "learning_rate": 0.5},
    shift=np.array([[0, 0, 1, -1], [1, 0, 0, -1]]),
)
ZERO_ROWS = Problem("float8_e5m2", "row", None, torch.zeros(0, 3), torch.eye(3), {"steps": 2})


# ------------------------------------------------------------------------------------------------
# Independent oracles (ml_dtypes decoding, region-by-region scales, einsum in FP64)
# ------------------------------------------------------------------------------------------------


def _grid(fmt: str) -> np.ndarray:
    """The format's finite values ascending, one zero, decoded by ml_dtypes."""
    every = ml_decode_codes(np.arange(256, dtype=np.uint8), fmt).astype(np.float64)
    finite = every[np.isfinite(every)]
    return np.unique(finite) + 0.0  # sorted; -0 == +0 counts once, as +0


def _expanded(scale_inv: torch.Tensor, p: Problem) -> np.ndarray:
    """Each element's inverse scale, region by region."""
    rows, cols = p.weight.shape
    s = scale_inv.numpy().astype(np.float32)
    if p.method == "tensor":
        return np.full((rows, cols), s.reshape(()), dtype=np.float32)
    if p.method == "row":
        return np.repeat(s.reshape(rows, 1), cols, axis=1)
    br, bc = p.block
    return np.repeat(np.repeat(s.reshape(rows // br, cols // bc), br, 0), bc, 1)


def _decoded(codes: torch.Tensor, fmt: str) -> np.ndarray:
    return ml_decode_codes(codes.view(torch.uint8).numpy(), fmt)


def _export(values: np.ndarray, scale: np.ndarray, dtype: torch.dtype) -> np.ndarray:
    """``float32(code) / scale_inv`` (one FP32 division), rounded once to ``dtype``, as FP64."""
    quotient = torch.from_numpy(np.asarray(values, np.float32) / scale)
    return quotient.to(dtype).to(torch.float64).numpy()


def _objective(p: Problem, codes: torch.Tensor, scale_inv: torch.Tensor) -> tuple[float, float]:
    """``(Σ e H eᵀ / Σ w H wᵀ, rounding scale)`` in FP64; the scale bounds the summation order's
    effect (the same sums over magnitudes), for tolerances."""
    w = p.weight.to(torch.float64).numpy()
    q = _export(_decoded(codes, p.format), _expanded(scale_inv, p), p.weight.dtype)
    e = w - q
    if p.hessian is None:
        num, den, mag = (e * e).sum(), (w * w).sum(), (e * e).sum()
    else:
        h = p.hessian.to(torch.float64).numpy()
        num = np.einsum("ri,ij,rj->", e, h, e)
        den = np.einsum("ri,ij,rj->", w, h, w)
        mag = np.einsum("ri,ij,rj->", np.abs(e), np.abs(h), np.abs(e))
    den = den if den > 0 else 1.0
    return float(num / den), float(mag / den)


def _positions(values: np.ndarray, fmt: str) -> np.ndarray:
    grid = _grid(fmt)
    pos = np.searchsorted(grid, values.astype(np.float64))
    assert (grid[np.clip(pos, 0, len(grid) - 1)] == values).all(), "a code is off the grid"
    return pos


def _refine(p: Problem, q: fq.FP8Weight, **changes) -> fq.GSQResult:
    config = fq.GSQConfig(**{**p.config, **changes})
    return fq.refine_fp8_codes(p.weight, q.qweight, q.scale_inv, hessian=p.hessian, config=config)


# ------------------------------------------------------------------------------------------------
# refine_fp8_codes
# ------------------------------------------------------------------------------------------------


@given(problems())
@example(SIGNED_ZERO)
@example(SIGNED_ZERO._replace(hessian=None))
@example(SIGNED_ZERO_MOVED)
@example(SIGNED_ZERO_MOVED._replace(hessian=None))
@example(ZERO_ROWS)
def test_codes_stay_on_the_grid_within_their_neighbourhood(p):
    q = p.baseline()
    r, config = _refine(p, q), fq.GSQConfig(**p.config)
    assert r.codes.dtype == q.qweight.dtype and r.codes.shape == q.qweight.shape
    after, before = _decoded(r.codes, p.format), _decoded(q.qweight, p.format)
    assert np.isfinite(after).all()
    k = config.candidates
    # offsets 0, -1, +1, -2, +2, ...: k of them reach k // 2 below and (k - 1) // 2 above
    moved = _positions(after, p.format) - _positions(before, p.format)
    assert (moved >= -(k // 2)).all() and (moved <= (k - 1) // 2).all()
    assert math.ceil((k - 1) / 2) >= np.abs(moved).max(initial=0)
    # a code whose value did not move keeps its byte (signed zero included)
    same_value = after == before
    new, old = r.codes.view(torch.uint8).numpy(), q.qweight.view(torch.uint8).numpy()
    assert (new[same_value] == old[same_value]).all()
    assert int(r.changed) == int((new != old).sum())
    assert r.steps == (config.steps if p.hessian is not None and p.weight.numel() else 0)


@given(problems())
@example(SIGNED_ZERO)
@example(SIGNED_ZERO._replace(hessian=None))
def test_never_worse_than_the_baseline_by_an_independent_oracle(p):
    q = p.baseline()
    r = _refine(p, q)
    before, before_scale = _objective(p, q.qweight, q.scale_inv)
    after, after_scale = _objective(p, r.codes, q.scale_inv)
    slack = 1e-12 * before + 1e-13 * max(before_scale, after_scale)
    assert after <= before + slack
    for reported, oracle, scale in ((r.objective_before, before, before_scale),
                                    (r.objective_after, after, after_scale)):  # fmt: skip
        assert abs(float(reported) - oracle) <= 1e-9 * oracle + 1e-13 * scale
    assert r.objective_after <= r.objective_before


@pytest.mark.parametrize("hessian", [True, False])
def test_a_signed_zero_keeps_its_byte_in_a_row_that_changes(hessian):
    p = SIGNED_ZERO_MOVED if hessian else SIGNED_ZERO_MOVED._replace(hessian=None)
    q = p.baseline()
    r = _refine(p, q)
    old, new = q.qweight.view(torch.uint8), r.codes.view(torch.uint8)
    zeros = old == 0x80
    assert zeros.sum() == 3 and (new[zeros] == 0x80).all()
    assert ((new != old).sum(dim=1) > 0).all()  # both rows moved codes


@settings(max_examples=max(10, settings().max_examples // 2))
@given(problems(hessian=True))
def test_chunking_does_not_change_the_bytes(p):
    q = p.baseline()
    one_row = _refine(p, q, max_candidate_bytes=1)
    whole = _refine(p, q, max_candidate_bytes=1 << 40)
    assert_bitwise_equal(one_row.codes, whole.codes)
    assert_bitwise_equal(one_row.objective_after, whole.objective_after)


@settings(max_examples=max(10, settings().max_examples // 2))
@given(problems(hessian=True))
def test_column_major_inputs_give_the_same_bytes(p):
    q = p.baseline()
    transposed = fq.refine_fp8_codes(
        p.weight.T.contiguous().T,
        q.qweight.view(torch.uint8).T.contiguous().T.view(q.qweight.dtype),
        q.scale_inv,
        hessian=p.hessian.T.contiguous().T,
        config=fq.GSQConfig(**p.config),
    )
    assert_bitwise_equal(transposed.codes.view(torch.uint8), _refine(p, q).codes.view(torch.uint8))


@settings(max_examples=max(10, settings().max_examples // 2))
@given(problems(hessian=True), st.integers(-30, 30))
def test_a_power_of_two_hessian_scale_changes_nothing(p, exponent):
    # numerator, normalizer and gradient all scale exactly, and the objective is their ratio
    q = p.baseline()
    scaled = fq.refine_fp8_codes(
        p.weight,
        q.qweight,
        q.scale_inv,
        hessian=p.hessian * 2.0**exponent,
        config=fq.GSQConfig(**p.config),
    )
    plain = _refine(p, q)
    assert_bitwise_equal(scaled.codes.view(torch.uint8), plain.codes.view(torch.uint8))
    assert_bitwise_equal(scaled.objective_before, plain.objective_before)
    assert_bitwise_equal(scaled.objective_after, plain.objective_after)


@given(problems(hessian=True))
@example(SIGNED_ZERO)
def test_codes_of_dead_inputs_never_move(p):
    # a column whose input never fires has a zero gradient: its logits stay at their start,
    # which favours the baseline
    q = p.baseline()
    r = _refine(p, q)
    dead = (p.hessian == 0).all(dim=0)
    assert_bitwise_equal(r.codes.view(torch.uint8)[:, dead], q.qweight.view(torch.uint8)[:, dead])


@settings(max_examples=max(10, settings().max_examples // 2))
@given(problems())
@example(SIGNED_ZERO)
def test_same_seed_same_bytes_and_a_disabled_config_keeps_the_baseline(p):
    q = p.baseline()
    first, second = _refine(p, q), _refine(p, q)
    assert_bitwise_equal(first.codes, second.codes)
    assert int(first.changed) == int(second.changed)
    off = fq.refine_fp8_codes(
        p.weight, q.qweight, q.scale_inv, hessian=p.hessian, config=fq.GSQConfig(enabled=False)
    )
    assert_bitwise_equal(off.codes.view(torch.uint8), q.qweight.view(torch.uint8))
    assert int(off.changed) == 0 and off.steps == 0
    assert_bitwise_equal(off.objective_after, off.objective_before)
    assert off.codes.data_ptr() != q.qweight.data_ptr() or q.qweight.numel() == 0


@given(problems(hessian=False))
@example(SIGNED_ZERO._replace(hessian=None))
@example(SIGNED_ZERO_MOVED._replace(hessian=None))
def test_weight_only_picks_each_weights_nearest_candidate(p):
    q = p.baseline()
    r = _refine(p, q)
    k = fq.GSQConfig(**p.config).candidates
    scale = _expanded(q.scale_inv, p)
    w = p.weight.to(torch.float64).numpy()
    grid = _grid(p.format)
    base = _decoded(q.qweight, p.format)
    errors = [(w - _export(base, scale, p.weight.dtype)) ** 2]
    pos = _positions(base, p.format)
    for offset in range(1, k):
        step = (offset + 1) // 2 * (-1 if offset % 2 else 1)  # -1, +1, -2, +2, ...
        at = pos + step
        inside = (at >= 0) & (at < len(grid))
        value = _export(grid[np.clip(at, 0, len(grid) - 1)], scale, p.weight.dtype)
        errors.append(np.where(inside, (w - value) ** 2, np.inf))
    best = np.min(np.stack(errors), axis=0) if w.size else np.zeros(w.shape)
    got = (w - _export(_decoded(r.codes, p.format), scale, p.weight.dtype)) ** 2
    kept = r.codes.view(torch.uint8).numpy() == q.qweight.view(torch.uint8).numpy()
    # the best candidate, or the baseline kept when nothing beats it by a relative 1e-12
    assert ((got == best) | (kept & (best >= errors[0] * (1 - 1e-12)))).all()
    assert (got[~kept] < errors[0][~kept]).all()


@settings(max_examples=max(10, settings().max_examples // 2))
@given(problems())
def test_inputs_are_not_mutated(p):
    q = p.baseline()
    weight, codes, scale_inv = p.weight.clone(), q.qweight.clone(), q.scale_inv.clone()
    hessian = None if p.hessian is None else p.hessian.clone()
    _refine(p, q)
    fq.gsq_objective(p.weight, q.qweight, q.scale_inv, hessian=p.hessian)
    assert_bitwise_equal(p.weight, weight)
    assert_bitwise_equal(q.qweight.view(torch.uint8), codes.view(torch.uint8))
    assert_bitwise_equal(q.scale_inv, scale_inv)
    if hessian is not None:
        assert_bitwise_equal(p.hessian, hessian)


# ------------------------------------------------------------------------------------------------
# gsq_objective
# ------------------------------------------------------------------------------------------------


@given(problems(), st.data())
def test_gsq_objective_equals_the_oracle_for_any_finite_codes(p, data):
    q = p.baseline()
    finite = np.flatnonzero(np.isfinite(ml_decode_codes(np.arange(256), p.format)))
    picks = data.draw(
        hnp.arrays(np.int64, tuple(p.weight.shape), elements=st.sampled_from(finite.tolist()))
    )
    codes = torch.from_numpy(picks.astype(np.uint8)).view(q.qweight.dtype)
    got = fq.gsq_objective(p.weight, codes, q.scale_inv, hessian=p.hessian)
    oracle, scale = _objective(p, codes, q.scale_inv)
    assert got.dtype == torch.float64 and got.shape == ()
    assert abs(float(got) - oracle) <= 1e-9 * oracle + 1e-13 * scale


# ------------------------------------------------------------------------------------------------
# fp8_code_grid (its domain is four dtypes: checked exhaustively)
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", FP8_ENCODABLE)
def test_fp8_code_grid_is_every_finite_value_once_ascending(fmt):
    values, codes = fq.fp8_code_grid(getattr(torch, fmt))
    assert values.dtype == torch.float32 and codes.dtype == torch.uint8
    v = values.numpy().astype(np.float64)
    assert np.isfinite(v).all() and (np.diff(v) > 0).all()
    assert_bitwise_equal(values, torch.from_numpy(_grid(fmt).astype(np.float32)))
    assert_bitwise_equal(codes.view(getattr(torch, fmt)).to(torch.float32), values)  # exact
    assert (v == 0).sum() == 1 and int(codes[v == 0][0]) == 0x00
    assert len(set(codes.tolist())) == len(codes)
    # a fresh copy each call: mutating it changes nothing
    values.zero_()
    assert_bitwise_equal(
        fq.fp8_code_grid(getattr(torch, fmt))[0], torch.from_numpy(_grid(fmt)).float()
    )


@pytest.mark.parametrize(
    "dtype", [torch.float32, torch.uint8, torch.int8, torch.bfloat16, torch.float8_e8m0fnu, "e4m3"]
)
def test_fp8_code_grid_refuses_what_has_no_weight_codes(dtype):
    with production_checks(), pytest.raises(TypeError, match="fp8_code_grid"):
        fq.fp8_code_grid(dtype)


# ------------------------------------------------------------------------------------------------
# Bad inputs: the documented errors, naming the argument
# ------------------------------------------------------------------------------------------------


def _good():
    w = torch.tensor([[0.5, -1.0, 2.0], [0.25, 0.0, -3.0]])
    q = fq.quantize_fp8_weight(w, format="e4m3", weight_scale_method="row")
    return w, q.qweight, q.scale_inv, torch.eye(3)


def _nan_codes():
    w, c, s, h = _good()
    bad = c.view(torch.uint8).clone()
    bad[0, 1] = 0x7F  # e4m3fn NaN
    return w, bad.view(c.dtype), s, h


def _with(**changes):
    def build():
        w, c, s, h = _good()
        parts = {"weight": w, "codes": c, "scale_inv": s, "hessian": h}
        for key, fn in changes.items():
            parts[key] = fn(parts[key])
        return parts["weight"], parts["codes"], parts["scale_inv"], parts["hessian"]

    return build


BAD = {
    "uint8 codes": (_with(codes=lambda c: c.view(torch.uint8)), TypeError, "codes must be an FP8"),
    "float codes": (_with(codes=lambda c: c.float()), TypeError, "codes must be an FP8"),
    "integer weight": (_with(weight=lambda w: w.to(torch.int32)), TypeError, "weight"),
    "nan codes": (_nan_codes, ValueError, "codes must be finite"),
    "shape mismatch": (_with(codes=lambda c: c[:, :2]), ValueError, "same shape"),
    "1-d weight": (_with(weight=lambda w: w[0], codes=lambda c: c[0]), ValueError, "must be 2-D"),
    "scale shape": (_with(scale_inv=lambda s: s[:1].repeat(5)), ValueError, "fits no scale"),
    "zero scale": (_with(scale_inv=lambda s: s * 0), ValueError, "positive and finite"),
    "negative scale": (_with(scale_inv=lambda s: -s), ValueError, "positive and finite"),
    "inf scale": (_with(scale_inv=lambda s: s / 0), ValueError, "positive and finite"),
    "nan weight": (_with(weight=lambda w: w * math.nan), ValueError, "weight must be finite"),
    "inf weight": (_with(weight=lambda w: w / 0), ValueError, "weight must be finite"),
    "nan hessian": (_with(hessian=lambda h: h * math.nan), ValueError, "hessian must be finite"),
    "hessian shape": (_with(hessian=lambda h: h[:2, :2]), ValueError, r"hessian must be \(3, 3\)"),
    "integer hessian": (_with(hessian=lambda h: h.to(torch.int64)), TypeError, "hessian"),
}


@pytest.mark.parametrize("case", sorted(BAD))
@pytest.mark.parametrize("fn", [fq.refine_fp8_codes, fq.gsq_objective])
def test_bad_inputs_raise_the_documented_error(case, fn):
    build, error, match = BAD[case]
    w, c, s, h = build()
    with production_checks(), pytest.raises(error, match=match):
        fn(w, c, s, hessian=h)


def test_e8m0_codes_are_refused_by_refine():
    w, c, s, _ = _good()
    e8m0 = torch.full(c.shape, 127, dtype=torch.uint8).view(torch.float8_e8m0fnu)
    with production_checks(), pytest.raises(TypeError, match="float8_e8m0fnu holds scales"):
        fq.refine_fp8_codes(w, e8m0, s)


def test_e8m0_codes_are_refused_by_gsq_objective():
    w, c, s, _ = _good()
    e8m0 = torch.full(c.shape, 127, dtype=torch.uint8).view(torch.float8_e8m0fnu)
    with production_checks(), pytest.raises(TypeError, match="float8_e8m0fnu"):
        fq.gsq_objective(w, e8m0, s)


@pytest.mark.parametrize("config", [{"steps": 3}, "GSQConfig()", 5, fq.FP8Config()])
def test_config_must_be_a_gsq_config(config):
    w, c, s, h = _good()
    with production_checks(), pytest.raises(TypeError, match="config must be a GSQConfig"):
        fq.refine_fp8_codes(w, c, s, hessian=h, config=config)
