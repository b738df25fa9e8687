"""GPTQ onto the NVFP4 grid: the column solve with a recipe's E4M3 block scales held fixed.

:func:`nvfp4_gptq_solve` takes a weight, its layer's input Hessian and an FP32 global scale. The
recipe chooses each 16-input block's E4M3 scale from the weight as round to nearest does
(:func:`floatxq.nvfp4_block_scales`); GPTQ then walks the input columns in order, rounds each
to the nearest E2M1 multiple of its block's scale and spreads the rounding error over the
columns not yet quantized through the Cholesky factor of the damped inverse Hessian (the
Hessian-aware rounding of GPTQ, here on a floating-point grid). Both results share the scales,
so their Hessian losses compare directly; the solve keeps the GPTQ codes unless round to nearest
has the lower loss (then it returns round to nearest and says so).

Speed: the columns of each 128-wide block are solved by one pure-torch function on fixed
buffers (:func:`_solve_block`); on CUDA a full block is captured once as a CUDA graph and
replayed for the others (the same kernels on the same bytes, no launch or Python dispatch per
column). The trailing update of the columns after a block is one GEMM. What comes before the
column loop (checks, scales, the factor, the working weight: :func:`_prepare`) and after it
(losses, the comparison with round to nearest, packing: :func:`_finish`) is shared with the
Triton twin of the block loop (:mod:`floatxq.kernels.nvfp4_gptq`), which must give these bytes.
"""

import warnings
from typing import Any, NamedTuple

import torch

from floatxq._checks import require_floating
from floatxq._typing import Float, Float8e4m3fn, Float32, Tensor, UInt8
from floatxq.formats import NVFP4_BLOCK, NVFP4RecipeName, normalize_nvfp4_recipe
from floatxq.nvfp4.e2m1 import _e2m1_value, e2m1_decode, e2m1_encode, pack_e2m1
from floatxq.nvfp4.quantize import NVFP4Blocks, nvfp4_block_scales

__all__ = ["NVFP4GPTQSolution", "nvfp4_gptq_solve"]


class NVFP4GPTQSolution(NamedTuple):
    """The codes and scales of :func:`nvfp4_gptq_solve` and how they compare to round to nearest."""

    packed: UInt8[Tensor, "n half"]
    """Two E2M1 codes per byte, even input in the low nibble (as :func:`floatxq.nvfp4_quantize`)."""
    block_scales: Float8e4m3fn[Tensor, "n blocks"]
    """The recipe's E4M3 scale of each 16-input block (the same for both results)."""
    global_scale: Float32[Tensor, ""]
    loss: Float32[Tensor, ""]
    """``tr(E H Eᵀ)`` of the kept result, ``E = W - decode`` (the undamped Hessian, FP64 sums)."""
    rtn_loss: Float32[Tensor, ""]
    """The same loss for round to nearest at the same scales."""
    solved: bool
    """True when the GPTQ codes were kept (their loss at most ``rtn_loss``)."""


def _checked(weight: Tensor, hessian: Tensor, global_scale: Tensor | float, where: str) -> Tensor:
    require_floating(weight, name="weight", where=where)
    require_floating(hessian, name="hessian", where=where)
    if weight.ndim != 2 or weight.shape[1] % NVFP4_BLOCK:
        raise ValueError(
            f"{where}: weight must be (out, in) with in a multiple of {NVFP4_BLOCK}, got shape "
            f"{tuple(weight.shape)}"
        )
    k = weight.shape[1]
    if tuple(hessian.shape) != (k, k):
        raise ValueError(f"{where}: hessian must be ({k}, {k}), got {tuple(hessian.shape)}")
    if hessian.device != weight.device:
        raise ValueError(f"{where}: hessian is on {hessian.device}, weight on {weight.device}")
    if not (torch.isfinite(weight).all() and torch.isfinite(hessian).all()):
        raise ValueError(f"{where}: weight and hessian must be finite")
    g = torch.as_tensor(global_scale, dtype=torch.float32, device=weight.device).reshape(())
    if not (torch.isfinite(g) and g > 0):
        raise ValueError(f"{where}: global_scale must be positive and finite, got {g.item()}")
    return g


def _upper_inverse_factor(hessian: Tensor, damp_percent: float, where: str) -> Tensor:
    """The upper Cholesky factor of the damped Hessian's inverse (dead inputs: diagonal 1)."""
    h = hessian.to(torch.float64).clone()
    dead = torch.diagonal(h) == 0
    h[dead, dead] = 1.0
    mean = torch.diagonal(h).mean()
    h += torch.eye(h.shape[0], dtype=h.dtype, device=h.device) * (damp_percent * mean)
    factor, info = torch.linalg.cholesky_ex(h)
    if int(info) != 0:
        raise ValueError(
            f"{where}: the damped hessian is not positive definite; raise damp_percent"
        )
    return torch.linalg.cholesky(torch.cholesky_inverse(factor), upper=True)


class _Buffers(NamedTuple):
    """One block's fixed buffers, a row per input column: ``w`` (FP64, error-updated weights),
    ``step`` (FP32 ``block_scale · g``), ``h`` (FP64, the factor's block), ``value`` (FP32,
    the chosen E2M1 value), ``err`` (FP64, the scaled rounding error)."""

    w: Tensor
    step: Tensor
    h: Tensor
    value: Tensor
    err: Tensor


def _solve_block(buf: _Buffers) -> None:
    """Round one block column by column, in place on ``buf`` (plain torch ops, capturable):
    ``v = e2m1(w / step)`` (FP32 division, nearest-even onto E2M1 with the sign kept),
    ``err = (w - v·step) / h[i, i]`` (FP64), then the later columns ``w[j] -= h[i, j] · err``."""
    n = buf.w.shape[0]
    for i in range(n):
        q = buf.w[i].to(torch.float32).div_(buf.step[i])
        buf.value[i].copy_(_e2m1_value(q.abs()).copysign_(q))
        decoded = (buf.value[i] * buf.step[i]).to(torch.float64)
        torch.sub(buf.w[i], decoded, out=buf.err[i])
        buf.err[i].div_(buf.h[i, i])
        if i + 1 < n:
            buf.w[i + 1 :].sub_(buf.h[i, i + 1 :, None] * buf.err[i][None, :])


class _BlockRunner:
    """Runs :func:`_solve_block` on fixed buffers: eagerly, or (CUDA, a block width ``full``
    that occurs more than once) as a CUDA graph: the first such block runs eagerly on a side
    stream (the warm-up capture needs; its result is used), then the capture records the same
    ops for the later blocks. A failed capture warns and goes on eagerly (same results)."""

    def __init__(self, rows: int, device: torch.device, *, full: int) -> None:
        self.rows, self.device = rows, device
        self.graphable = full if device.type == "cuda" else 0
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            self.graphable = 0
        self._buffers: dict[int, _Buffers] = {}
        self._graph: Any = None

    def buffers(self, n: int) -> _Buffers:
        buf = self._buffers.get(n)
        if buf is None:
            f64, f32 = torch.float64, torch.float32
            make = lambda dtype: torch.empty((n, self.rows), dtype=dtype, device=self.device)
            h = torch.empty((n, n), dtype=f64, device=self.device)
            buf = _Buffers(make(f64), make(f32), h, make(f32), make(f64))
            self._buffers[n] = buf
        return buf

    def run(self, n: int) -> None:
        buf = self._buffers[n]
        if n != self.graphable:
            _solve_block(buf)
            return
        if self._graph is not None:
            self._graph.replay()
            return
        current = torch.cuda.current_stream(self.device)
        side = torch.cuda.Stream(self.device)
        side.wait_stream(current)
        with torch.cuda.stream(side):  # this block's result; the capture below only records
            _solve_block(buf)
        current.wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph):
                _solve_block(buf)
        except RuntimeError as exc:  # the warm-up's results stand; only speed is lost
            self.graphable = 0
            warnings.warn(
                f"nvfp4_gptq_solve: CUDA graph capture failed ({exc}); solving the remaining "
                f"blocks eagerly (same results, slower)",
                RuntimeWarning,
                stacklevel=4,
            )
        else:
            self._graph = graph


def _loss(error: Tensor, hessian: Tensor) -> Tensor:
    e = error.to(torch.float64)
    return ((e @ hessian.to(torch.float64)) * e).sum().to(torch.float32)


def nvfp4_gptq_solve(
    weight: Float[Tensor, "n k"],
    hessian: Float[Tensor, "k k"],
    global_scale: Float32[Tensor, ""] | float,
    *,
    recipe: NVFP4RecipeName = "nvidia",
    damp_percent: float = 0.01,
    blocksize: int = 128,
    cuda_graph: bool = True,
) -> NVFP4GPTQSolution:
    """GPTQ of ``weight`` onto the NVFP4 grid of ``recipe``'s block scales under ``global_scale``.

    Args: ``weight`` ``(out, in)``, ``in % 16 == 0``; ``hessian`` ``(in, in)`` positive
    semi-definite (the layer inputs' ``2·XᵀX/n``; an input with diagonal 0 gets weight 0), on the
    weight's device; ``global_scale`` FP32, positive; ``damp_percent`` of the mean diagonal added
    before the factorization; ``blocksize`` columns updated together (speed only); ``cuda_graph``
    replays the column loop of full blocks as a CUDA graph (same bytes; no effect off CUDA).

    Raises:
      ValueError: shapes, non-finite values, a bad global scale or recipe, a damped Hessian that
        is not positive definite, ``damp_percent`` negative or ``blocksize`` below 1.
      TypeError: non-floating tensors.

    Numerics: scales as :func:`floatxq.nvfp4_block_scales` (bit for bit); each column's value
    ``e2m1_round(w / e) · e`` with ``e = float(block_scale) · g`` in FP32, the error propagation
    in FP64. The loss never exceeds round to nearest's at the same scales (the codes with the
    lower loss are returned; ties keep GPTQ's). Round to nearest's bytes are
    :func:`floatxq.nvfp4_quantize`'s.

    Example:
      >>> w = torch.randn(8, 32, generator=torch.Generator().manual_seed(0))
      >>> x = torch.randn(64, 32, generator=torch.Generator().manual_seed(1))
      >>> s = nvfp4_gptq_solve(w, x.T @ x, 0.01)
      >>> bool(s.loss <= s.rtn_loss), s.packed.shape, s.block_scales.shape
      (True, torch.Size([8, 16]), torch.Size([8, 2]))
    """
    prep = _prepare(
        weight, hessian, global_scale, recipe=recipe, damp_percent=damp_percent,
        blocksize=blocksize, where="nvfp4_gptq_solve",
    )  # fmt: skip
    rows, k = prep.w32.shape
    values = torch.empty_like(prep.w32)
    full = blocksize if cuda_graph and k > blocksize else 0
    runner = _BlockRunner(rows, prep.w32.device, full=full)
    for i1 in range(0, k, blocksize):
        i2 = min(i1 + blocksize, k)
        buf = runner.buffers(i2 - i1)
        buf.w.copy_(prep.work[:, i1:i2].T)
        buf.step.copy_(prep.step[:, i1:i2].T)
        buf.h.copy_(prep.upper[i1:i2, i1:i2])
        runner.run(i2 - i1)
        values[:, i1:i2] = buf.value.T
        prep.work[:, i2:] -= buf.err.T.contiguous() @ prep.upper[i1:i2, i2:]
    return _finish(prep, values, hessian)


class _Prepared(NamedTuple):
    """What the column loop reads, built by :func:`_prepare` (shared with the Triton twin)."""

    g: Tensor
    """The FP32 global scale (0-d)."""
    w32: Tensor
    """The weight in FP32, ``(n, k)``."""
    rtn: NVFP4Blocks
    """Round to nearest at the recipe's block scales (its codes are the fallback)."""
    step: Tensor
    """``float(block_scale) · g`` per input, FP32 ``(n, k)``."""
    upper: Tensor
    """The upper Cholesky factor of the damped inverse Hessian, FP64 ``(k, k)``."""
    work: Tensor
    """The error-updated weight, FP64 ``(n, k)`` (dead inputs zeroed); the loop updates it."""


def _prepare(
    weight: Tensor,
    hessian: Tensor,
    global_scale: Tensor | float,
    *,
    recipe: NVFP4RecipeName,
    damp_percent: float,
    blocksize: int,
    where: str,
) -> _Prepared:
    """Checks (errors name ``where``), the recipe's scales, the factor and the working weight."""
    g = _checked(weight, hessian, global_scale, where)
    recipe = normalize_nvfp4_recipe(recipe)
    if not damp_percent >= 0:
        raise ValueError(f"{where}: damp_percent must be >= 0, got {damp_percent}")
    if blocksize < 1:
        raise ValueError(f"{where}: blocksize must be >= 1, got {blocksize}")
    w32 = weight.to(torch.float32)
    rtn = nvfp4_block_scales(w32, g, recipe)
    step = (rtn.block_scales.to(torch.float32) * g).repeat_interleave(NVFP4_BLOCK, dim=1)
    upper = _upper_inverse_factor(hessian, damp_percent, where)
    work = w32.to(torch.float64).clone()
    work[:, torch.diagonal(hessian) == 0] = 0.0
    return _Prepared(g, w32, rtn, step, upper, work)


def _finish(prep: _Prepared, values: Tensor, hessian: Tensor) -> NVFP4GPTQSolution:
    """Both losses, the choice between GPTQ's ``values`` (FP32 E2M1 values) and round to
    nearest, and the packed codes."""
    step, w32 = prep.step, prep.w32
    gptq_loss = _loss(w32 - values * step, hessian)
    rtn_loss = _loss(w32 - e2m1_decode(prep.rtn.codes) * step, hessian)
    solved = bool(gptq_loss <= rtn_loss)
    return NVFP4GPTQSolution(
        packed=pack_e2m1(e2m1_encode(values) if solved else prep.rtn.codes),
        block_scales=prep.rtn.block_scales,
        global_scale=prep.g,
        loss=gptq_loss if solved else rtn_loss,
        rtn_loss=rtn_loss,
        solved=solved,
    )
