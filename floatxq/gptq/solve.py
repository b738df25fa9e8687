"""The GPTQ solve: the damped inverse Cholesky and the column solve with lazy block updates.

:func:`gptq_solve` quantizes a weight column by column, feeding each column's rounding error
forward to the columns not yet solved through the upper Cholesky factor of ``H⁻¹`` (``H`` from
:mod:`floatxq.gptq.hessian`), and :func:`rtn_quantize` is the round-to-nearest baseline with the
same record. Both take a :class:`GPTQSolveOptions` (the solver's settings, nothing about
checkpoints) and round with the quantizer of :mod:`floatxq.gptq.quantizer`; the results match
GPT-QModel's solver (``docs/numerics.md`` states the contract and where the two differ).

Speed: the solve is one pure-torch function per 128-column block (:func:`_solve_block`) working on
fixed buffers. On CUDA each distinct block pattern is captured once as a CUDA graph and replayed
for the other blocks (the same kernels on the same bytes, without one launch per op), so the
column loop issues no host synchronisation and no Python dispatch per column. The trailing update
``W[:, i2:] -= Err · Hinv[i1:i2, i2:]`` is one in-place GEMM per block. Memory: the Hessian and
its factors (``O(in²)``), the working weight, result and codes (``O(out·in)``), and per-block
buffers (``O(out·128)``).
"""

import contextlib
import dataclasses
import functools
import math
import warnings
from collections import Counter
from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from floatxq._checks import require_finite, require_floating, require_shape
from floatxq._typing import Float, Float64, Int32, Int64, Tensor, UInt8, checked_record
from floatxq.formats import GPTQ_BITS
from floatxq.gptq.quantizer import _fake_quant, _group_params, _quant_spec, _QuantSpec

__all__ = ["GPTQSolution", "GPTQSolveOptions", "gptq_solve", "rtn_quantize"]

GPTQ_BLOCK_SIZE = 128
"""Columns per lazy block update (GPT-QModel's ``blocksize``)."""

_FLOOR_ATTEMPTS = 6
_FLOOR_RELATIVE = 1e-6

GPTQ_MAX_DAMP_RETRIES = 10_000
"""The most ``damp_auto_increment`` retries a damping schedule may take on its way to 1.

GPT-QModel retries ``damp += increment`` while ``damp < 1``, which never ends when the increment
is too small to change ``damp`` (``0.05 + 1e-300 == 0.05``); floatxq refuses such options instead:
an increment must take ``damp_percent`` to 1 within this many retries (``>= 9.5e-5`` from the
default 0.05). GPT-QModel's defaults need 95 (``0.05``, ``0.01``)."""


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class GPTQSolveOptions:
    """The settings :func:`gptq_solve` and :func:`rtn_quantize` use, already normalized.

    A solver record, not a checkpoint config: it knows nothing of serialization, formats or
    per-module rules (``floatxq.lifecycle.gptq_solve_options`` builds one from a resolved
    ``GPTQConfig``). Fields must already have their declared types (``mse=2.0``, not the int
    ``2``): ``__post_init__`` only validates, it never converts.

    Fields: ``bits`` in ``GPTQ_BITS`` (2, 3, 4, 5, 6, 8); ``group_size`` -1 (one group per
    output row) or positive; ``sym`` (zero point fixed at ``2**(bits-1)``); ``desc_act`` (solve
    columns by descending ``diag(H)``); ``static_groups`` (group parameters from the original
    weight); ``act_group_aware`` (reorder inside and across groups, keeping groups contiguous;
    not together with ``desc_act``); ``0 < damp_percent < 1``; ``damp_auto_increment >= 0``
    (0: no retries), and when positive large enough that the damping schedule
    ``damp_percent, +increment, …`` (repeated float64 addition, while below 1) reaches 1 within
    :data:`GPTQ_MAX_DAMP_RETRIES` retries, each raising the damp; ``mse >= 0`` (exponent of the
    shrink search; 0 turns it off).

    Raises:
      TypeError: a field of the wrong type. ValueError: a value outside the ranges above.

    Numerics: names only; no tensor math.

    Example:
      >>> GPTQSolveOptions(bits=3, group_size=-1).bits
      3
    """

    bits: int = 4
    group_size: int = 128
    sym: bool = True
    desc_act: bool = False
    static_groups: bool = False
    act_group_aware: bool = True
    damp_percent: float = 0.05
    damp_auto_increment: float = 0.01
    mse: float = 0.0

    def __post_init__(self) -> None:
        where = "GPTQSolveOptions"
        for name in ("bits", "group_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(
                    f"{where}: {name} must be an int, got {type(value).__name__} {value!r}"
                )
        for name in ("sym", "desc_act", "static_groups", "act_group_aware"):
            value = getattr(self, name)
            if not isinstance(value, bool):
                raise TypeError(
                    f"{where}: {name} must be a bool, got {type(value).__name__} {value!r}"
                )
        for name in ("damp_percent", "damp_auto_increment", "mse"):
            value = getattr(self, name)
            if not isinstance(value, float):
                raise TypeError(
                    f"{where}: {name} must be a float, got {type(value).__name__} {value!r}"
                )
        if self.bits not in GPTQ_BITS:
            raise ValueError(f"{where}: bits must be one of {list(GPTQ_BITS)}, got {self.bits}")
        if self.group_size != -1 and self.group_size < 1:
            raise ValueError(
                f"{where}: group_size must be -1 (one group per row) or positive, got "
                f"{self.group_size}"
            )
        if not 0.0 < self.damp_percent < 1.0:
            raise ValueError(
                f"{where}: damp_percent must satisfy 0 < damp_percent < 1, got "
                f"{self.damp_percent!r}"
            )
        for name in ("damp_auto_increment", "mse"):
            value = getattr(self, name)
            if not 0.0 <= value < math.inf:
                raise ValueError(f"{where}: {name} must be finite and >= 0, got {value!r}")
        _damp_candidates(self.damp_percent, self.damp_auto_increment)  # the schedule must end
        if self.desc_act and self.act_group_aware:
            raise ValueError(
                f"{where}: desc_act=True and act_group_aware=True cannot be combined (group-aware "
                f"reordering keeps groups contiguous, desc_act does not); set one to False"
            )


@checked_record
class GPTQSolution(NamedTuple):
    """A solved (or round-to-nearest) weight, in the weight's ``(out, in)`` orientation.

    Pack it with ``pack_gptq(codes.T, zeros.T, scales.T, g_idx, bits=bits)`` (the checkpoint stores
    input rows first).
    """

    dequantized: Float[Tensor, "out in"]
    """``(out, in)`` quantized weight values, in the weight's dtype: ``scale · (code - zero)``."""
    codes: UInt8[Tensor, "out in"]
    """uint8 ``(out, in)`` codes ``0..2**bits-1``."""
    scales: Float[Tensor, "out groups"]
    """``(out, groups)`` direct scales (FP32; FP64 for a float64 weight); column = group id."""
    zeros: UInt8[Tensor, "out groups"]
    """uint8 ``(out, groups)`` zero points (``2**(bits-1)`` when symmetric)."""
    g_idx: Int32[Tensor, "in"]
    """int32 ``(in,)``: the group (a column of ``scales``/``zeros``) of each input column."""
    loss: Float64[Tensor, ""]
    """float64 0-d: ``Σ (w - q)² / d² / 2`` over all entries (``d`` = diagonal of the inverse's
    Cholesky factor), the Hessian-weighted error GPTQ minimizes (GPT-QModel reports it divided by
    the calibration row count); summed in float64 so large weights cannot overflow it."""
    damp: float
    """The ``damp_percent`` that made the Hessian invertible (0.0 for RTN)."""


# ----------------------------------------------------------------------------------------------
# Damped inverse Cholesky
# ----------------------------------------------------------------------------------------------


def _damp_candidates(damp: float, increment: float):
    # Unannotated return on purpose: the test run's beartype samples a random element of an
    # annotated list, which Hypothesis flags when options are built inside a strategy.
    """``damp, damp+inc, damp+2inc, …`` by repeated addition, while below 1.

    Raises ``ValueError`` when the schedule would need more than :data:`GPTQ_MAX_DAMP_RETRIES`
    retries or an addition leaves the damp unchanged (it would never reach 1).
    """
    where = "GPTQSolveOptions"
    candidates = [damp]
    if increment <= 0:
        return candidates
    fewest = (1.0 - damp) / GPTQ_MAX_DAMP_RETRIES
    accepted = (
        f"accepted: 0 (no retries) or an increment that takes damp_percent to 1 within "
        f"{GPTQ_MAX_DAMP_RETRIES} retries (about {fewest:.3g} or more)"
    )
    if (1.0 - damp) / increment > GPTQ_MAX_DAMP_RETRIES + 1:
        raise ValueError(
            f"{where}: damp_auto_increment {increment!r} would need about "
            f"{(1.0 - damp) / increment:.3g} retries to take damp_percent {damp!r} to 1; {accepted}"
        )
    while True:
        nxt = candidates[-1] + increment
        if nxt >= 1.0:
            return candidates
        if nxt <= candidates[-1]:
            raise ValueError(
                f"{where}: damp_auto_increment {increment!r} does not raise the damp "
                f"({candidates[-1]!r} + {increment!r} == {candidates[-1]!r} in float64), so "
                f"the retries would never reach 1; {accepted}"
            )
        if len(candidates) > GPTQ_MAX_DAMP_RETRIES:
            raise ValueError(
                f"{where}: damp_auto_increment {increment!r} needs more than "
                f"{GPTQ_MAX_DAMP_RETRIES} retries to take damp_percent {damp!r} to 1; {accepted}"
            )
        candidates.append(nxt)


def _damped_search(hessian: Tensor, candidates: list[float]) -> tuple[Tensor, float] | None:
    """The upper Cholesky factor of ``(H + c·mean(diag H)·I)⁻¹`` for the first working ``c``.

    The first ``c`` whose Cholesky succeeds is found by bisection (a larger damp keeps a working
    factorization working when ``mean(diag H) > 0``); from there the walk continues until the
    inverse's own factorization succeeds too.
    """
    mean = hessian.diagonal().mean()

    def factor(c: float) -> Tensor | None:
        damped = hessian.clone()
        damped.diagonal().add_(c * mean)
        chol, info = torch.linalg.cholesky_ex(damped)
        return chol if int(info) == 0 else None

    first = factor(candidates[0])
    start = 0
    if first is None:
        if len(candidates) == 1:
            return None
        first = factor(candidates[-1])
        if first is None:
            return None
        lo, start = 0, len(candidates) - 1
        while start - lo > 1:
            mid = (lo + start) // 2
            chol = factor(candidates[mid])
            if chol is None:
                lo = mid
            else:
                start, first = mid, chol
    for j in range(start, len(candidates)):
        chol = first if j == start else factor(candidates[j])
        if chol is None:
            continue
        upper, info = torch.linalg.cholesky_ex(torch.cholesky_inverse(chol), upper=True)
        if int(info) == 0 and bool(torch.isfinite(upper).all()):
            return upper, candidates[j]
    return None


def _inverse_factor(
    hessian: Tensor, damp: float, increment: float, *, columns: Tensor | None = None
) -> tuple[Tensor, float]:
    """Damping with auto-increment retries, then up to six diagonal-floor rescues.

    Each floor ``f = max|diag H| · 1e-6 · 10**(attempt - 1)`` replaces the diagonal by
    ``max(diag + f, f)`` and runs the damping search again. The floors rescue rank-deficient
    Hessians (tiny or slightly negative eigenvalues); a negative diagonal entry, which no
    ``2/N · Σ xᵀx`` has, is refused instead of floored when no damp repairs it. ``columns`` maps
    solve order to natural columns (for the message).
    """
    candidates = _damp_candidates(damp, increment)
    found = _damped_search(hessian, candidates)
    if found is not None:
        return found
    diag = hessian.diagonal().clone()
    negative = diag < 0
    if bool(negative.any()):
        worst = int(torch.argmin(diag))
        column = worst if columns is None else int(columns[worst])
        raise ValueError(
            f"gptq_solve: hessian is not positive semidefinite: {int(negative.sum())} of its "
            f"{diag.shape[0]} diagonal entries are negative (H[{column}, {column}] = "
            f"{float(diag[worst]):.4g}) and no damp_percent in "
            f"{candidates[0]:.4g}..{candidates[-1]:.4g} makes it positive definite; a Hessian "
            f"2/N·Σxᵀx has a non-negative diagonal, so this is not one (check how it was computed)"
        )
    amax = float(diag.abs().max())
    base = amax * _FLOOR_RELATIVE if math.isfinite(amax) and amax > 0 else _FLOOR_RELATIVE
    for attempt in range(1, _FLOOR_ATTEMPTS + 1):
        floor = base * 10.0 ** (attempt - 1)
        floored = hessian.clone()
        floored.diagonal().copy_(torch.clamp(diag + floor, min=floor))
        found = _damped_search(floored, candidates)
        if found is not None:
            return found
    raise ValueError(
        f"gptq_solve: the Hessian could not be made positive definite: damp_percent "
        f"{candidates[0]}..{candidates[-1]} and {_FLOOR_ATTEMPTS} diagonal floors up to "
        f"{base * 10.0 ** (_FLOOR_ATTEMPTS - 1):.3g} all failed; check the calibration inputs"
    )


# ----------------------------------------------------------------------------------------------
# The block solve
# ----------------------------------------------------------------------------------------------


@checked_record
class _Buffers(NamedTuple):
    """Fixed per-block buffers, all ``(n, out)`` (one row per weight column) but ``h``."""

    w: Float[Tensor, "n out"]  # working weights (transposed block), updated in place
    h: Float[Tensor, "n n"]  # block of the inverse's upper Cholesky factor
    scale: Float[Tensor, "n out"]  # per column (input for carried/static groups, output for starts)
    zero: Float[Tensor, "n out"]
    code: Float[Tensor, "n out"]  # float codes
    value: Float[Tensor, "n out"]  # dequantized values
    err: Float[Tensor, "n out"]  # (w - q) / d


Lookahead = Callable[[int, int], Tensor]
"""``lookahead(o, e)``: rows ``n..e`` of a group starting at block row ``o``, corrected for the
block's errors so far (only for groups that straddle the block's end)."""


def _solve_block(
    buf: _Buffers,
    inner: tuple[tuple[int, int], ...],
    spec: _QuantSpec,
    lookahead: Lookahead | None,
) -> None:
    """Quantize one block column by column, in place on ``buf`` (plain torch ops, graph-capturable).

    ``inner`` lists the groups that start inside the block as ``(offset, end)`` block-relative
    (``end`` may pass the block's width: the group straddles into the next block). Their
    parameters come from the block's current (error-updated) weights.
    """
    n = buf.w.shape[0]
    starts = dict(inner)
    for i in range(n):
        end = starts.get(i)
        if end is not None:
            stop = min(end, n)
            x = buf.w[i:stop]
            if end > n:
                if lookahead is None:
                    raise RuntimeError("_solve_block: a straddling group needs a lookahead")
                x = torch.cat([x, lookahead(i, end)])
            scale, zero = _group_params(x, spec)
            buf.scale[i:stop].copy_(scale.expand(stop - i, -1))
            buf.zero[i:stop].copy_(zero.expand(stop - i, -1))
        w, s, z = buf.w[i], buf.scale[i], buf.zero[i]
        code, value, err = buf.code[i], buf.value[i], buf.err[i]
        torch.div(w, s, out=code)
        code.round_().add_(z).clamp_(0, spec.maxq)
        torch.sub(code, z, out=value)
        value.mul_(s)
        torch.sub(w, value, out=err)
        err.div_(buf.h[i, i])
        if i + 1 < n:
            buf.w[i + 1 :].addr_(buf.h[i, i + 1 :], err, alpha=-1)


def _straddle(o: int, e: int, *, wt: Tensor, hinv: Tensor, err: Tensor, i1: int, i2: int) -> Tensor:
    """Rows ``i2..i1+e`` of the weights with the block's errors of columns ``i1..i1+o`` applied."""
    return wt[i2 : i1 + e] - hinv[i1 : i1 + o, i2 : i1 + e].T @ err[:o]


class _BlockRunner:
    """Runs :func:`_solve_block` on fixed buffers: eagerly, or as a replayed CUDA graph.

    A graph is captured for a block pattern (width and inner group starts) that occurs at least
    twice and has no straddling group. The first block of a pattern runs eagerly on a side
    stream (the warm-up that capture needs) and its result is used; capture only records.
    """

    def __init__(
        self,
        rows: int,
        dtype: torch.dtype,
        device: torch.device,
        spec: _QuantSpec,
        graphable: Counter[tuple[int, tuple[tuple[int, int], ...]]],
    ) -> None:
        self.rows, self.dtype, self.device, self.spec = rows, dtype, device, spec
        self.graphable = graphable
        self._buffers: dict[int, _Buffers] = {}
        self._graphs: dict[tuple[int, tuple[tuple[int, int], ...]], Any] = {}

    def buffers(self, n: int) -> _Buffers:
        buf = self._buffers.get(n)
        if buf is None:
            make = lambda shape: torch.empty(shape, dtype=self.dtype, device=self.device)
            buf = _Buffers(
                *(make((n, n)) if f == "h" else make((n, self.rows)) for f in _Buffers._fields)
            )
            self._buffers[n] = buf
        return buf

    def run(self, n: int, inner: tuple[tuple[int, int], ...], lookahead: Lookahead | None) -> None:
        key = (n, inner)
        buf = self.buffers(n)
        if key not in self.graphable:
            _solve_block(buf, inner, self.spec, lookahead)
            return
        graph = self._graphs.get(key)
        if graph is not None:
            graph.replay()
            return
        current = torch.cuda.current_stream(self.device)
        side = torch.cuda.Stream(self.device)
        side.wait_stream(current)
        with torch.cuda.stream(side):
            _solve_block(buf, inner, self.spec, None)
        current.wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph):
                _solve_block(buf, inner, self.spec, None)
        except RuntimeError as exc:  # the warm-up already solved this block; only speed is lost
            del self.graphable[key]
            warnings.warn(
                f"gptq_solve: CUDA graph capture failed ({exc}); solving the remaining blocks "
                f"of width {n} eagerly (same results, slower). Pass cuda_graph=False to skip it.",
                RuntimeWarning,
                stacklevel=4,
            )
            return
        self._graphs[key] = graph


@checked_record
class _Group(NamedTuple):
    start: int  # first column, in solve (permuted) order
    end: int
    slot: int  # the group id (column of scales / zeros)


def _group_aware_perm(diag: Tensor, group_size: int) -> tuple[Tensor, list[_Group]]:
    """GAR: sort columns inside each group by ``diag`` (descending), then whole groups by their
    largest ``diag`` (descending); both sorts stable. Groups stay contiguous in solve order."""
    k = diag.shape[0]
    count = -(-k // group_size)
    padded = torch.full((count * group_size,), -math.inf, dtype=diag.dtype, device=diag.device)
    padded[:k] = diag
    table = padded.view(count, group_size)
    local = torch.argsort(table, dim=1, descending=True, stable=True)
    order = torch.argsort(table.amax(dim=1), descending=True, stable=True)
    columns = (order[:, None] * group_size + local[order]).flatten()
    perm = columns[columns < k]
    groups, pos = [], 0
    for g in order.tolist():
        size = min(group_size, k - g * group_size)
        groups.append(_Group(pos, pos + size, g))
        pos += size
    return perm, groups


@checked_record
class _Plan(NamedTuple):
    perm: Int64[Tensor, " k"] | None  # solve order → natural column (None: natural order)
    groups: list[_Group] | None  # dynamic groups in solve order (None: static groups)
    static_slot: Int64[Tensor, " k"] | None  # group id of each solve-order column (static)
    g_idx: Int32[Tensor, " k"]  # natural column → group id
    count: int  # number of groups


def _plan(options: GPTQSolveOptions, diag: Tensor, k: int) -> _Plan:
    gs = k if options.group_size == -1 else options.group_size
    count = -(-k // gs)
    device = diag.device
    natural = torch.arange(k, device=device)
    groups: list[_Group] | None = [_Group(g * gs, min(k, (g + 1) * gs), g) for g in range(count)]
    perm = None
    if options.desc_act:
        perm = torch.argsort(diag, descending=True, stable=True)
    elif options.act_group_aware:
        perm, groups = _group_aware_perm(diag, gs)
    g_idx = natural // gs
    static_slot = None
    if options.static_groups:
        groups = None
        static_slot = g_idx if perm is None else perm // gs
    elif options.desc_act:
        g_idx = torch.argsort(perm) // gs  # type: ignore[arg-type]
    return _Plan(perm, groups, static_slot, g_idx.to(torch.int32), count)


@checked_record
class _Block(NamedTuple):
    i1: int
    i2: int
    cover: _Group | None  # the dynamic group holding column i1
    inner: tuple[_Group, ...]  # dynamic groups starting inside (i1, i2)


def _blocks(k: int, blocksize: int, groups: list[_Group] | None) -> list[_Block]:
    blocks, g = [], 0
    for i1 in range(0, k, blocksize):
        i2 = min(i1 + blocksize, k)
        if groups is None:
            blocks.append(_Block(i1, i2, None, ()))
            continue
        while groups[g].end <= i1:
            g += 1
        inner, h = [], g + 1
        while h < len(groups) and groups[h].start < i2:
            inner.append(groups[h])
            h += 1
        blocks.append(_Block(i1, i2, groups[g], tuple(inner)))
    return blocks


def _relative(block: _Block) -> tuple[tuple[int, int], ...]:
    return tuple((grp.start - block.i1, grp.end - block.i1) for grp in block.inner)


def _check_solve_inputs(weight: Any, options: Any, *, where: str) -> None:
    if not isinstance(options, GPTQSolveOptions):
        raise TypeError(
            f"{where}: options must be a GPTQSolveOptions, got {type(options).__name__}; for a "
            f"GPTQConfig pass floatxq.lifecycle.gptq_solve_options(config.resolve(module_name))"
        )
    require_floating(weight, name="weight", where=where)
    if weight.ndim != 2 or weight.shape[0] == 0 or weight.shape[1] == 0:
        raise ValueError(
            f"{where}: weight must be a non-empty 2-D (out, in) matrix, got {tuple(weight.shape)}"
        )
    require_finite(weight, name="weight", where=where)
    limit = torch.finfo(_compute_dtype(weight)).max / 2
    if float(weight.detach().abs().max()) > limit:
        raise ValueError(
            f"{where}: weight magnitudes must be at most {limit:.4g} (half the largest finite "
            f"value) so that a group's range max - min stays finite"
        )


def _compute_dtype(weight: Tensor) -> torch.dtype:
    return torch.float64 if weight.dtype == torch.float64 else torch.float32


def gptq_solve(
    weight: Float[Tensor, "out in"],
    hessian: Float[Tensor, "in in"],
    options: GPTQSolveOptions = GPTQSolveOptions(),
    *,
    blocksize: int = GPTQ_BLOCK_SIZE,
    cuda_graph: bool = True,
) -> GPTQSolution:
    """Quantize a weight with GPTQ: per column, round and push the error onto later columns.

    Columns are reordered by ``diag(H)`` (``desc_act`` / ``act_group_aware``), ``H`` is damped and
    inverted through Cholesky, and columns are solved in blocks, each group's parameters taken at
    its first column from the error-updated weights (every step: ``docs/numerics.md`` §10.3).

    Args:
      weight: ``(out, in)`` floating weight, finite; any device.
      hessian: ``(in, in)`` Hessian on the weight's device (``hessian_finalize``).
      options: the solver settings (:class:`GPTQSolveOptions`).
      blocksize: columns per lazy block (results are independent of it up to rounding).
      cuda_graph: replay repeated block patterns as CUDA graphs (same bytes); no effect on CPU.

    Returns:
      :class:`GPTQSolution` (``g_idx`` as ``docs/numerics.md`` §10.3 step 6 says).

    Raises:
      ValueError: non-finite inputs, weights above half the largest finite value, mismatched
        shapes, ``blocksize < 1``, a Hessian with a negative diagonal no damp repairs, or one no
        damping or floor makes positive definite. TypeError: wrong kinds or devices.

    Numerics: :mod:`floatxq.gptq.quantizer`'s rounding; FP32 linear algebra (FP64 for a float64
    weight): CPU and CUDA agree up to summation order. Inputs are never mutated.

    Example:
      >>> w = torch.tensor([[0.1, -0.7, 0.3, 0.2]])
      >>> sol = gptq_solve(w, torch.eye(4), GPTQSolveOptions(bits=4, group_size=-1))
      >>> sol.codes.tolist(), sol.zeros.tolist(), round(sol.scales.item(), 6)
      ([[9, 0, 11, 10]], [[8]], 0.093333)
    """
    where = "gptq_solve"
    _check_solve_inputs(weight, options, where=where)
    require_floating(hessian, name="hessian", where=where)
    k = weight.shape[1]
    require_shape(hessian, (k, k), name="hessian", where=where)
    if hessian.device != weight.device:
        raise TypeError(f"{where}: hessian is on {hessian.device} but weight on {weight.device}")
    if isinstance(blocksize, bool) or not isinstance(blocksize, int) or blocksize < 1:
        raise ValueError(f"{where}: blocksize must be an int >= 1, got {blocksize!r}")
    require_finite(hessian, name="hessian", where=where)

    with torch.no_grad(), _on_device(weight.device):
        return _solve(weight.detach(), hessian.detach(), options, blocksize, cuda_graph)


def _on_device(device: torch.device) -> Any:
    """Make ``device`` current for CUDA work (graph capture happens on the current device)."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def _solve(
    weight: Tensor, hessian: Tensor, options: GPTQSolveOptions, blocksize: int, cuda_graph: bool
) -> GPTQSolution:
    out, k = weight.shape
    dtype, device = _compute_dtype(weight), weight.device
    spec = _quant_spec(
        bits=options.bits, sym=options.sym, mse=options.mse, dtype=dtype, device=device
    )
    h = hessian.to(dtype=dtype, copy=True)
    diag = h.diagonal()
    dead = diag == 0
    diag.copy_(torch.where(dead, torch.ones_like(diag), diag))
    wt = weight.to(dtype).T.clone(memory_format=torch.contiguous_format)  # (in, out), a copy
    wt.masked_fill_(dead[:, None], 0)

    plan = _plan(options, diag, k)
    scale_t = torch.empty((plan.count, out), dtype=dtype, device=device)
    zero_t = torch.empty((plan.count, out), dtype=dtype, device=device)
    if plan.groups is None:  # static groups: every natural group's parameters, up front
        gs = k if options.group_size == -1 else options.group_size
        for g in range(plan.count):
            scale_t[g], zero_t[g] = _group_params(wt[g * gs : (g + 1) * gs], spec)
    if plan.perm is not None:
        wt = wt[plan.perm]
        h = h[plan.perm][:, plan.perm]
    hinv, damp = _inverse_factor(
        h, options.damp_percent, options.damp_auto_increment, columns=plan.perm
    )
    del h

    blocks = _blocks(k, blocksize, plan.groups)
    patterns = Counter((b.i2 - b.i1, _relative(b)) for b in blocks)
    graphable: Counter[tuple[int, tuple[tuple[int, int], ...]]] = Counter()
    if cuda_graph and device.type == "cuda" and not torch.cuda.is_current_stream_capturing():
        graphable = Counter(
            {key: c for key, c in patterns.items() if c > 1 and all(e <= key[0] for _, e in key[1])}
        )
    runner = _BlockRunner(out, dtype, device, spec, graphable)
    values = torch.empty_like(wt)
    codes = torch.empty((k, out), dtype=torch.uint8, device=device)
    loss = torch.zeros((), dtype=torch.float64, device=device)
    for block in blocks:
        i1, i2 = block.i1, block.i2
        n = i2 - i1
        buf = runner.buffers(n)
        buf.w.copy_(wt[i1:i2])
        buf.h.copy_(hinv[i1:i2, i1:i2])
        if plan.static_slot is not None:
            slots = plan.static_slot[i1:i2]
            torch.index_select(scale_t, 0, slots, out=buf.scale)
            torch.index_select(zero_t, 0, slots, out=buf.zero)
        else:
            cover = block.cover or _Group(i1, i2, 0)  # dynamic plans cover every column
            if cover.start == i1:  # a group starts here: parameters from the updated weights
                scale_t[cover.slot], zero_t[cover.slot] = _group_params(
                    wt[cover.start : cover.end], spec
                )
            stop = min(cover.end, i2) - i1
            buf.scale[:stop].copy_(scale_t[cover.slot].expand(stop, -1))
            buf.zero[:stop].copy_(zero_t[cover.slot].expand(stop, -1))

        lookahead = functools.partial(_straddle, wt=wt, hinv=hinv, err=buf.err, i1=i1, i2=i2)
        runner.run(n, _relative(block), lookahead)
        for grp in block.inner:
            scale_t[grp.slot] = buf.scale[grp.start - i1]
            zero_t[grp.slot] = buf.zero[grp.start - i1]
        values[i1:i2].copy_(buf.value)
        codes[i1:i2].copy_(buf.code)
        loss += buf.err.double().square().sum()
        if i2 < k:
            wt[i2:].addmm_(hinv[i1:i2, i2:].T, buf.err, alpha=-1)
    del wt, hinv, runner

    if plan.perm is not None:
        inverse = torch.argsort(plan.perm)
        values, codes = values[inverse], codes[inverse]
    return GPTQSolution(
        values.T.to(weight.dtype).contiguous(),
        codes.T.contiguous(),
        scale_t.T.contiguous(),
        zero_t.T.to(torch.uint8).contiguous(),
        plan.g_idx,
        loss / 2,
        damp,
    )


def rtn_quantize(
    weight: Float[Tensor, "out in"],
    options: GPTQSolveOptions = GPTQSolveOptions(),
) -> GPTQSolution:
    """Round-to-nearest with GPTQ's quantizer: the baseline :func:`gptq_solve` improves on.

    Each contiguous group of ``group_size`` input columns (the whole row for -1) gets the
    quantizer's parameters from the weight itself (with the MSE search when ``options.mse > 0``);
    ``desc_act``, ``act_group_aware``, ``static_groups`` and the damping settings do not apply.

    Args:
      weight: ``(out, in)`` floating weight, finite; FP32 math (FP64 for float64).
      options: a :class:`GPTQSolveOptions` (``bits``, ``group_size``, ``sym`` and ``mse`` are
        used).

    Returns:
      :class:`GPTQSolution` with ``g_idx = arange(in) // group_size``, ``damp = 0.0`` and
      ``loss = Σ (w - q)² / 2`` (the Hessian-weighted error for ``H = I``).

    Raises:
      ValueError: non-finite, too large (as for :func:`gptq_solve`) or non-2-D weights.
      TypeError: wrong kinds.

    Numerics: the same elementwise quantizer as :func:`gptq_solve` (with an identity Hessian the
    two give the same bytes on one device); without the MSE search the result is bit-identical
    on CPU and CUDA.

    Example:
      >>> sol = rtn_quantize(torch.tensor([[0.1, -0.7, 0.3, 0.2]]), GPTQSolveOptions(group_size=-1))
      >>> sol.codes.tolist(), sol.zeros.tolist()
      ([[9, 0, 11, 10]], [[8]])
    """
    where = "rtn_quantize"
    _check_solve_inputs(weight, options, where=where)
    with torch.no_grad():
        return _round_to_nearest(weight.detach(), options)


def _round_to_nearest(weight: Tensor, options: GPTQSolveOptions) -> GPTQSolution:
    out, k = weight.shape
    dtype, device = _compute_dtype(weight), weight.device
    spec = _quant_spec(
        bits=options.bits, sym=options.sym, mse=options.mse, dtype=dtype, device=device
    )
    gs = k if options.group_size == -1 else options.group_size
    count = -(-k // gs)
    wt = weight.to(dtype).T.clone(memory_format=torch.contiguous_format)
    values, codes = torch.empty_like(wt), torch.empty((k, out), dtype=torch.uint8, device=device)
    scale_t = torch.empty((count, out), dtype=dtype, device=device)
    zero_t = torch.empty((count, out), dtype=dtype, device=device)
    for g in range(count):
        x = wt[g * gs : (g + 1) * gs]
        scale, zero = _group_params(x, spec)
        code, value = _fake_quant(x, scale, zero, spec.maxq)
        scale_t[g], zero_t[g] = scale, zero
        codes[g * gs : (g + 1) * gs], values[g * gs : (g + 1) * gs] = code, value
    loss = (wt.double() - values.double()).square().sum() / 2
    g_idx = (torch.arange(k, device=device) // gs).to(torch.int32)
    return GPTQSolution(
        values.T.to(weight.dtype).contiguous(),
        codes.T.contiguous(),
        scale_t.T.contiguous(),
        zero_t.T.to(torch.uint8).contiguous(),
        g_idx,
        loss,
        0.0,
    )
