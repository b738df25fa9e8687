"""GSQ: re-choose FP8 weight codes on the storage grid, inverse scales frozen.

After round to nearest, :func:`refine_fp8_codes` lets every FP8 weight code move to one of its
neighbouring finite codes when that lowers a reconstruction objective:

* **Candidates.** For each weight, ``config.candidates`` codes: the baseline byte itself
  (candidate 0, signed zero kept) and its nearest neighbours on the sorted grid of the format's
  finite values, alternating below and above (``-1, +1, -2, +2, ...``); a neighbour past either
  end of the grid is masked. Each candidate's value is the export arithmetic's, the value the
  module computes with: ``float32(code) / scale_inv`` rounded once to the weight's dtype.
* **Objective.** Per output row ``r``: ``e_r H e_rᵀ / (w_r H w_rᵀ)`` with ``e = W - Q``; ``H``
  is the calibration Hessian. Rows are independent (the scales are frozen), so each row is its
  own problem. Weight-only (no Hessian) the objective is the plain reconstruction error, which
  is separable per weight: every candidate is scored exactly and the best kept, the optimum the
  relaxation below would approach, without running it (``steps`` is then 0).
* **Relaxation** (with a Hessian). Logits ``θ`` over each weight's candidates start at
  ``-½·offset²``. Each step draws Gumbel noise ``g``, takes ``p = softmax((θ + g) / τ)`` at a
  temperature ``τ`` annealed geometrically from ``temperature_start`` to ``temperature_end``,
  the soft weight ``Σ p·value``, the objective's gradient (written out, no autograd), and an
  Adam step on ``θ``.
* **Hard checkpoints.** At ten steps spread over the run (and the last), the argmax of ``θ`` is
  scored exactly; a row takes those codes only when they lower its objective below
  ``(1 - 1e-12)`` times the kept codes' (an improvement no FP64 summation order reverses), so
  the result is never worse than the baseline and chunking or the device cannot flip a choice.

Everything runs in FP64 on the weight's device. The Gumbel noise comes from a private
``torch.Generator`` on the CPU, seeded with ``config.seed``, drawn once per call in a fixed
order: a table of Gumbel values, an offset per (step, row) and one per (column, candidate); a
weight's noise at a step is the table entry at the sum of its offsets. So the same seed gives the
same noise on every device and whatever the chunking, and the rows can be refined in chunks of
at most ``max_candidate_bytes`` of decoded candidates. No host syncs happen inside the step loop.
"""

from collections.abc import Callable
from typing import NamedTuple

import torch

from floatxq._checks import require_data, require_floating, require_fp8
from floatxq._typing import Float, Float64, FP8Dtype, Int64, Tensor, checked_record
from floatxq.config.gsq import GSQConfig
from floatxq.fp8 import _accepted_layouts, _expand_scale_inv, _scale_layout

__all__ = ["GSQResult", "fp8_code_grid", "gsq_objective", "refine_fp8_codes"]

NOISE_TABLE_BITS = 16
"""The Gumbel table holds ``2**16`` values; offsets index it modulo its size."""

CHECKPOINTS = 10
"""Hard checkpoints spread over the steps (the last step is always one)."""

_ADAM_BETAS = (0.9, 0.999)
_ADAM_EPS = 1e-12
_STRICT = 1.0 - 1e-12
"""A checkpoint replaces the kept codes of a row only below ``(1 - 1e-12)`` times its loss: an
improvement no FP64 summation order can reverse, so chunking and devices agree."""


@checked_record
class GSQResult(NamedTuple):
    """What :func:`refine_fp8_codes` returns."""

    codes: FP8Dtype[Tensor, "out in"]
    """The refined codes, the baseline's dtype and shape (scales unchanged)."""
    objective_before: Float64[Tensor, ""]
    """The baseline's objective, ``Σ e_r H e_rᵀ / Σ w_r H w_rᵀ`` (identity ``H`` weight-only)."""
    objective_after: Float64[Tensor, ""]
    """The same for the refined codes; never above ``objective_before``."""
    changed: Int64[Tensor, ""]
    """How many codes differ from the baseline's bytes."""
    steps: int
    """Relaxation steps run (0 when the config is disabled or the weight is empty)."""


class _Grid(NamedTuple):
    values: Tensor  # (G,) float32, ascending, the finite values (one zero)
    codes: Tensor  # (G,) uint8, each value's byte (zero: 0x00)
    position: Tensor  # (256,) int64: byte -> index in ``values`` (-1 for NaN/inf bytes)


def fp8_code_grid(dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """The sorted finite values of an FP8 storage format and a byte for each.

    Zero appears once (``+0``'s byte, ``0x00``); every other finite value has exactly one byte.
    These are the positions GSQ's candidates move along.

    Returns:
      ``(values, codes)``: FP32 values ascending, and their ``uint8`` bytes.

    Raises:
      TypeError: ``dtype`` is not an FP8 storage format (E8M0 included: it has no weight codes).

    Numerics: every byte decoded exactly into FP32; NaN and infinite bytes and ``-0`` left out.

    Example:
      >>> values, codes = fp8_code_grid(torch.float8_e4m3fn)
      >>> len(values), values[-1].item(), hex(codes[-1].item())
      (253, 448.0, '0x7e')
    """
    grid = _grid(dtype, where="fp8_code_grid")
    return grid.values.clone(), grid.codes.clone()


def _grid(dtype: torch.dtype, *, where: str) -> _Grid:
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point or dtype.itemsize != 1:
        raise TypeError(f"{where}: expected an FP8 dtype, got {dtype!r}")
    if dtype == getattr(torch, "float8_e8m0fnu", None):
        raise TypeError(
            f"{where}: float8_e8m0fnu holds scales only (decode-only); GSQ refines FP8 weight "
            f"codes (float8_e4m3fn, float8_e5m2 and their fnuz variants)"
        )
    every = torch.arange(256, dtype=torch.int16).to(torch.uint8)
    decoded = every.view(dtype).to(torch.float32)
    finite = torch.isfinite(decoded) & ~((decoded == 0) & torch.signbit(decoded))
    values, order = torch.sort(decoded[finite], stable=True)
    codes = every[finite][order]
    position = torch.full((256,), -1, dtype=torch.int64)
    position[codes.to(torch.int64)] = torch.arange(len(codes))
    negative_zero = (decoded == 0) & torch.signbit(decoded)
    position[negative_zero] = int(torch.nonzero(values == 0)[0, 0])
    return _Grid(values, codes, position)


def _offsets(candidates: int) -> list[int]:
    """``[0, -1, 1, -2, 2, ...]`` of length ``candidates``."""
    out = [0]
    step = 1
    while len(out) < candidates:
        out.append(-step)
        if len(out) < candidates:
            out.append(step)
        step += 1
    return out


class _Noise(NamedTuple):
    table: Tensor  # (T,) float64 Gumbel values
    rows: Tensor  # (steps, out) int32 offsets
    cols: Tensor  # (in, K) int32 offsets


def _noise(seed: int, steps: int, rows: int, cols: int, k: int, device: torch.device) -> _Noise:
    """The run's noise, drawn on the CPU in a fixed order (device- and chunk-independent)."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    size = 1 << NOISE_TABLE_BITS
    u = torch.rand(size, generator=gen, dtype=torch.float64).clamp_(min=1e-300, max=1 - 2**-53)
    table = -torch.log(-torch.log(u))
    col = torch.randint(0, size, (cols, k), generator=gen, dtype=torch.int64).to(torch.int32)
    row = torch.randint(0, size, (steps, rows), generator=gen, dtype=torch.int64).to(torch.int32)
    return _Noise(table.to(device), row.to(device), col.to(device))


def _checked_inputs(
    weight: Tensor, codes: Tensor, scale_inv: Tensor, hessian: Tensor | None, where: str
) -> Tensor:
    """The expanded FP32 inverse scales, after every argument check."""
    require_floating(weight, name="weight", where=where)
    require_fp8(codes, name="codes", where=where)
    _grid(codes.dtype, where=where)  # E8M0 holds scales, not weight codes
    require_floating(scale_inv, name="scale_inv", where=where)
    for name, x in (("weight", weight), ("codes", codes), ("scale_inv", scale_inv)):
        require_data(x, name=name, where=where)
    if weight.ndim != 2 or tuple(codes.shape) != tuple(weight.shape):
        raise ValueError(
            f"{where}: weight must be 2-D (out, in) and codes the same shape; got weight "
            f"{tuple(weight.shape)}, codes {tuple(codes.shape)}"
        )
    if codes.device != weight.device or scale_inv.device != weight.device:
        raise ValueError(
            f"{where}: weight, codes and scale_inv must share a device; got {weight.device}, "
            f"{codes.device}, {scale_inv.device}"
        )
    layout = _scale_layout(tuple(codes.shape), tuple(scale_inv.shape))
    if layout is None:
        raise ValueError(
            f"{where}: scale_inv of shape {tuple(scale_inv.shape)} fits no scale layout of "
            f"codes of shape {tuple(codes.shape)}; {_accepted_layouts(codes.shape[0])}"
        )
    s = scale_inv.to(torch.float32)
    if not bool(torch.isfinite(s).all() and (s > 0).all()):
        raise ValueError(
            f"{where}: scale_inv must be positive and finite (codes are divided by it)"
        )
    if not bool(torch.isfinite(weight).all()):
        raise ValueError(f"{where}: weight must be finite")
    if not bool(torch.isfinite(codes.to(torch.float32)).all()):
        raise ValueError(f"{where}: codes must be finite FP8 values (no NaN or inf bytes)")
    if hessian is not None:
        require_floating(hessian, name="hessian", where=where)
        k = weight.shape[1]
        if tuple(hessian.shape) != (k, k):
            raise ValueError(f"{where}: hessian must be ({k}, {k}), got {tuple(hessian.shape)}")
        if hessian.device != weight.device:
            raise ValueError(f"{where}: hessian is on {hessian.device}, weight on {weight.device}")
        if not bool(torch.isfinite(hessian).all()):
            raise ValueError(f"{where}: hessian must be finite")
    return _expand_scale_inv(s, codes.shape, layout).expand(codes.shape)


def _row_losses(error: Tensor, hessian: Tensor | None) -> Tensor:
    """``e_r H e_rᵀ`` per row (identity ``H``: per weight ``e²``), FP64."""
    if hessian is None:
        return error * error
    return ((error @ hessian) * error).sum(dim=1)


def gsq_objective(
    weight: Float[Tensor, "out in"],
    codes: FP8Dtype[Tensor, "out in"],
    scale_inv: Float[Tensor, "*scale"],
    *,
    hessian: Float[Tensor, "in in"] | None = None,
) -> Float64[Tensor, ""]:
    """GSQ's objective of ``codes``: ``Σ_r e_r H e_rᵀ / Σ_r w_r H w_rᵀ`` in FP64.

    ``e = W - Q`` with ``Q`` the export arithmetic's weight (``float32(code) / scale_inv`` rounded
    once to ``weight.dtype``); ``hessian`` None is the identity (the relative squared error).
    A zero denominator counts as 1.

    Raises:
      ValueError, TypeError: as :func:`refine_fp8_codes`.

    Numerics: FP64 sums over the export arithmetic's weight (bit for bit
    :func:`floatxq.dequantize_fp8_weight` in ``weight.dtype``).

    Example:
      >>> from floatxq import quantize_fp8_weight
      >>> w = torch.tensor([[1.0, 0.3]])
      >>> q = quantize_fp8_weight(w, format="e5m2")
      >>> round(gsq_objective(w, q.qweight, q.scale_inv).item(), 6)
      0.000187
    """
    where = "gsq_objective"
    expanded = _checked_inputs(weight, codes, scale_inv, hessian, where)
    h = None if hessian is None else hessian.to(torch.float64)
    w = weight.to(torch.float64)
    q = (codes.to(torch.float32) / expanded).to(weight.dtype).to(torch.float64)
    return _ratio(_row_losses(w - q, h).sum(), _row_losses(w, h).sum())


def _ratio(num: Tensor, den: Tensor) -> Tensor:
    return num / torch.where(den > 0, den, torch.ones_like(den))


class _Chunk(NamedTuple):
    w: Tensor  # (R, C) float64
    values: Tensor  # (R, C, K) float64 candidate weights (export arithmetic)
    valid: Tensor  # (R, C, K) bool
    norm: Tensor  # (R, 1) float64 row normalizers


def _candidates(
    codes: Tensor, expanded: Tensor, grid: _Grid, offsets: Tensor, dtype: torch.dtype
) -> tuple[Tensor, Tensor, Tensor]:
    """Each weight's candidate grid positions, validity and export values."""
    base = grid.position.to(codes.device)[codes.view(torch.uint8).to(torch.int64)]
    pos = base[..., None] + offsets
    valid = (pos >= 0) & (pos < grid.values.numel())
    pos = pos.clamp(0, grid.values.numel() - 1)
    raw = grid.values.to(codes.device)[pos]
    raw[..., 0] = codes.to(torch.float32)  # the baseline's own value (signed zero kept)
    values = (raw / expanded[..., None]).to(dtype).to(torch.float64)
    return pos, valid, values


def _nearest_chunk(chunk: _Chunk) -> Tensor:
    """Weight-only: the objective is separable per weight, so every candidate is scored exactly
    and the best kept (only when strictly below the baseline's error): the optimum the
    relaxation would approach, without running it."""
    err = (chunk.w[..., None] - chunk.values) ** 2
    err = torch.where(chunk.valid, err, torch.full_like(err, float("inf")))
    best = err.argmin(dim=-1)
    picked = err.gather(-1, best[..., None])[..., 0]
    return torch.where(picked < err[..., 0] * _STRICT, best, torch.zeros_like(best))


MASKED_LOGIT = -1e30
"""The logit of a candidate past the grid's end: its probability is exactly 0 at any
temperature, so its gradient and Adam state stay 0 and it is never the argmax."""


def _soft_error(
    theta: Tensor,
    table: Tensor,
    row_offsets: Tensor,
    col_offsets: Tensor,
    values: Tensor,
    w: Tensor,
    inv_tau: Tensor,
) -> tuple[Tensor, Tensor]:
    """One step's probabilities ``p = softmax((θ + g) / τ)`` (``g``: each weight's Gumbel noise,
    the table entry at its row and column offsets) and the soft weight's error ``W - Σ p·v``."""
    index = (row_offsets[:, None, None] + col_offsets) & ((1 << NOISE_TABLE_BITS) - 1)
    p = torch.softmax((theta + table[index]) * inv_tau, dim=-1)
    return p, w - (p * values).sum(dim=-1)


def _adam_update(
    theta: Tensor,
    m: Tensor,
    v: Tensor,
    p: Tensor,
    values: Tensor,
    q: Tensor,
    slope: Tensor,
    lr: Tensor,
    eps: Tensor,
) -> None:
    """Adam on the logits, in place: the gradient ``p·(v_k - q)·slope`` (``slope``: the
    objective's derivative in the soft weight over ``τ``), bias correction folded into ``lr`` and
    ``eps``."""
    grad = p * ((values - q[..., None]) * slope[..., None])
    b1, b2 = _ADAM_BETAS
    m.lerp_(grad, 1 - b1)
    v.mul_(b2).addcmul_(grad, grad, value=1 - b2)
    theta.sub_(lr * (m / (v.sqrt() + eps)))


class _StepFunctions(NamedTuple):
    """The elementwise halves of a relaxation step (eager here; the CUDA route compiles them)."""

    soft_error: Callable[..., tuple[Tensor, Tensor]]
    adam_update: Callable[..., None]


EAGER_STEPS = _StepFunctions(_soft_error, _adam_update)


def _schedule(config: GSQConfig, device: torch.device) -> Tensor:
    """Per step ``(1/τ, lr_t, eps_t)`` in FP64 on ``device``: the temperature annealed
    geometrically, Adam's bias corrections folded into step size and epsilon."""
    steps = config.steps
    t0, t1 = config.temperature_start, config.temperature_end
    b1, b2 = _ADAM_BETAS
    rows = []
    for step in range(steps):
        tau = t0 * (t1 / t0) ** (step / (steps - 1)) if steps > 1 else t1
        c1, c2 = 1 - b1 ** (step + 1), 1 - b2 ** (step + 1)
        rows.append((1.0 / tau, config.learning_rate * c2**0.5 / c1, _ADAM_EPS * c2**0.5))
    return torch.tensor(rows, dtype=torch.float64, device=device)


def _refine_chunk(
    chunk: _Chunk,
    hessian: Tensor,
    noise: _Noise,
    row0: int,
    config: GSQConfig,
    offsets: Tensor,
    fns: _StepFunctions,
) -> Tensor:
    """The chosen candidate index per weight of one row chunk."""
    w, values, valid, norm = chunk
    rows = w.shape[0]

    def losses(q: Tensor) -> Tensor:
        return _row_losses(w - q, hessian) / norm[:, 0]

    best = torch.zeros(w.shape, dtype=torch.int64, device=w.device)
    best_loss = losses(values[..., 0])
    theta = (-0.5 * offsets.to(torch.float64) ** 2).expand(values.shape)
    theta = torch.where(valid, theta, torch.full_like(theta, MASKED_LOGIT))
    m = torch.zeros_like(theta)
    v = torch.zeros_like(theta)
    schedule = _schedule(config, w.device)
    steps = config.steps
    every = max(1, steps // CHECKPOINTS)
    scale = -2.0 / norm  # (R, 1)
    for step in range(steps):
        inv_tau, lr, eps = schedule[step]
        row_offsets = noise.rows[step, row0 : row0 + rows]
        p, e = fns.soft_error(theta, noise.table, row_offsets, noise.cols, values, w, inv_tau)
        slope = (e @ hessian) * (scale * inv_tau)
        fns.adam_update(theta, m, v, p, values, w - e, slope, lr, eps)
        if (step + 1) % every == 0 or step == steps - 1:
            hard = theta.argmax(dim=-1)
            hard_loss = losses(values.gather(-1, hard[..., None])[..., 0])
            better = hard_loss < best_loss * _STRICT
            best = torch.where(better[:, None], hard, best)
            best_loss = torch.where(better, hard_loss, best_loss)
    return best


def refine_fp8_codes(
    weight: Float[Tensor, "out in"],
    codes: FP8Dtype[Tensor, "out in"],
    scale_inv: Float[Tensor, "*scale"],
    *,
    hessian: Float[Tensor, "in in"] | None = None,
    config: GSQConfig | None = None,
) -> GSQResult:
    """Re-choose FP8 weight codes among their grid neighbours to lower GSQ's objective.

    Args:
      weight: ``(out, in)`` floating weight the codes approximate (its dtype is the export
        arithmetic's: each candidate's value is rounded to it).
      codes: ``(out, in)`` finite FP8 codes, the baseline (e.g. the ``qweight`` of
        :func:`floatxq.quantize_fp8_weight`), on the weight's device.
      scale_inv: their FP32 inverse scales, tensor ``()``, row ``(out,)`` or block grid
        ``(out/br, in/bc)``; frozen.
      hessian: ``(in, in)`` symmetric positive semi-definite calibration Hessian (the layer
        inputs' ``2·XᵀX/n``) weighting the error, or None for the plain reconstruction error.
      config: :class:`~floatxq.config.GSQConfig` (default ``GSQConfig()``); a disabled one
        returns the baseline.

    Returns:
      :class:`GSQResult`: the codes (a new tensor), the objective before and after (after ≤
      before), the number of changed codes and the steps run.

    Raises:
      TypeError: a non-floating ``weight``, ``scale_inv`` or ``hessian``, ``codes`` that are not
        FP8 or are E8M0, meta tensors, a ``config`` that is not a ``GSQConfig``.
      ValueError: shapes that disagree, a scale layout that does not fit, non-finite weights,
        codes, scales or Hessian, non-positive scales, tensors on different devices.

    Numerics: FP64 throughout; candidate values in the export arithmetic (bit for bit what
    :func:`floatxq.dequantize_fp8_weight` gives in ``weight.dtype``); the noise is seeded and
    device-independent, the chunking does not change the result; ties keep the baseline.

    Example:
      >>> from floatxq import quantize_fp8_weight
      >>> g = torch.Generator().manual_seed(0)
      >>> w, x = torch.randn(4, 16, generator=g), torch.randn(64, 16, generator=g)
      >>> q = quantize_fp8_weight(w, format="e5m2")
      >>> r = refine_fp8_codes(w, q.qweight, q.scale_inv, hessian=2 * x.T @ x / 64)
      >>> bool(r.objective_after <= r.objective_before), r.codes.dtype
      (True, torch.float8_e5m2)
    """
    return _refine(weight, codes, scale_inv, hessian, config, EAGER_STEPS, "refine_fp8_codes")


def _refine(
    weight: Tensor,
    codes: Tensor,
    scale_inv: Tensor,
    hessian: Tensor | None,
    config: GSQConfig | None,
    fns: _StepFunctions,
    where: str,
) -> GSQResult:
    """:func:`refine_fp8_codes` with the relaxation's elementwise steps given (the CUDA route
    passes compiled ones: :mod:`floatxq.kernels.gsq`)."""
    if config is None:
        config = GSQConfig()
    if not isinstance(config, GSQConfig):
        raise TypeError(f"{where}: config must be a GSQConfig, got {type(config).__name__}")
    expanded = _checked_inputs(weight, codes, scale_inv, hessian, where)
    grid = _grid(codes.dtype, where=where)
    h = None if hessian is None else hessian.to(torch.float64)
    rows, cols = weight.shape
    device = weight.device
    w64 = weight.to(torch.float64)
    base_values = (codes.to(torch.float32) / expanded).to(weight.dtype).to(torch.float64)
    teacher = _row_losses(w64, h)
    before_terms = _row_losses(w64 - base_values, h)
    total = teacher.sum()
    before = _ratio(before_terms.sum(), total)
    if not config.enabled or weight.numel() == 0:
        zero = torch.zeros((), dtype=torch.int64, device=device)
        return GSQResult(codes.clone(), before, before.clone(), zero, 0)
    k = config.candidates
    offsets = torch.tensor(_offsets(k), dtype=torch.int64, device=device)
    noise = None if h is None else _noise(config.seed, config.steps, rows, cols, k, device)
    per_row = teacher if h is not None else teacher.sum(dim=1)
    norm = torch.where(per_row > 0, per_row, torch.ones_like(per_row))
    chunk_rows = max(1, config.max_candidate_bytes // max(1, cols * k * 8))
    out = codes.view(torch.uint8).clone()
    for r0 in range(0, rows, chunk_rows):
        r1 = min(rows, r0 + chunk_rows)
        pos, valid, values = _candidates(codes[r0:r1], expanded[r0:r1], grid, offsets, weight.dtype)
        chunk = _Chunk(w64[r0:r1], values, valid, norm[r0:r1, None])
        if noise is None:
            choice = _nearest_chunk(chunk)
        else:
            choice = _refine_chunk(chunk, h, noise, r0, config, offsets, fns)
        picked = grid.codes.to(device)[pos.gather(-1, choice[..., None])[..., 0]]
        out[r0:r1] = torch.where(choice == 0, out[r0:r1], picked)
        del pos, valid, values, chunk
    refined = out.view(codes.dtype)
    after_values = (refined.to(torch.float32) / expanded).to(weight.dtype).to(torch.float64)
    after = _ratio(_row_losses(w64 - after_values, h).sum(), total)
    changed = (out != codes.view(torch.uint8)).sum()
    return GSQResult(refined, before, after, changed, 0 if noise is None else config.steps)
