"""Triton source of the NVFP4-grid GPTQ block solve (the column loop of one block).

Imported by :mod:`floatxq.kernels.nvfp4_gptq` on the first launch, never at ``import floatxq``
(this module imports Triton); :data:`INTERPRETED` records whether ``triton.jit`` chose the
interpreter. ``@no_type_check`` keeps the test run's jaxtyping hook off the functions.

The kernel is :func:`floatxq.gptq.nvfp4_grid._solve_block` with the rows split over programs:
within one block, each weight row's columns depend only on that row (the columns of ``h`` are
shared), so a program takes ``BLOCK_R`` rows and runs the block's whole column loop on them,
the ``(BLOCK_R, BW)`` FP64 tile held in registers. Every operation is the reference's, in its
order and precision: FP32 ``fp32(w) / step`` (IEEE division: ``div_rn``, since Triton's FP32
``/`` is the approximate ``div.full.f32``), E2M1 nearest-even with the sign of the quotient,
the FP32 product ``v · step`` widened to FP64, the FP64 difference and the FP64 division by
``h[i, i]`` (Triton's FP64 ``/`` is the IEEE ``div.rn.f64``, as torch's), then
``w[j] - h[i, j] · err`` as a product and a difference rounded apart. It is launched with
``enable_fp_fusion=False`` (no multiply-add contraction: a fused ``w - h·err`` rounds once and
the bytes would differ) and ``enable_reflect_ftz=False`` (FP32 subnormals kept, as torch keeps
them).
"""

from typing import no_type_check

import triton
import triton.language as tl
from triton import knobs

from floatxq.kernels._nvfp4_jit import e2m1_round

__all__ = ["INTERPRETED", "nvfp4_gptq_block_kernel"]

INTERPRETED: bool = bool(knobs.runtime.interpret)
"""Whether the functions below were jitted for the interpreter (``TRITON_INTERPRET=1``)."""


@triton.jit
@no_type_check
def column(tile, here):
    """Column ``here`` (a one-hot row mask of columns) of an FP64 tile, bit for bit: its int64
    bit patterns summed with zeros elsewhere (exact, and ``-0.0`` keeps its sign, which an FP64
    sum with ``+0.0`` fillers would lose)."""
    bits = tl.where(here, tile.to(tl.int64, bitcast=True), 0)
    return tl.sum(bits, axis=1).to(tl.float64, bitcast=True)


@triton.jit
@no_type_check
def signed_e2m1(q):
    """``e2m1(|q|)`` with the sign bit of ``q`` (the reference's ``_e2m1_value(q.abs())
    .copysign_(q)``; a NaN quotient gives a zero of its sign). Bit operations, not a negation:
    Triton negates as ``0 - x``, and ``0 - (+0.0)`` is ``+0.0``, not ``-0.0``."""
    qb = q.to(tl.int32, bitcast=True)
    magnitude = e2m1_round(tl.abs(q)).to(tl.int32, bitcast=True)
    return (magnitude | (qb ^ (qb & 0x7FFFFFFF))).to(tl.float32, bitcast=True)


@triton.jit
@no_type_check
def nvfp4_gptq_block_kernel(
    w_ptr,
    step_ptr,
    h_ptr,
    value_ptr,
    err_ptr,
    rows,
    stride_wr,
    stride_wc,
    stride_sr,
    stride_sc,
    stride_h,
    stride_vr,
    stride_vc,
    stride_er,
    stride_ec,
    WIDTH: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BW: tl.constexpr,
):
    """Solve one block of ``WIDTH <= BW`` columns (``BW`` a power of two) for rows
    ``pid·BLOCK_R ..``; the column count is a compile-time constant (a model has one or two
    block widths), so the loop's bound is too.

    Reads the error-updated weights ``w`` (FP64, ``(rows, WIDTH)``), the steps (FP32, same
    shape) and the factor's block ``h`` (FP64, ``(WIDTH, WIDTH)``, row-major, row stride
    ``stride_h``); writes the E2M1 values (FP32) and the scaled errors (FP64), ``(rows,
    WIDTH)`` each (``stride_*r`` / ``stride_*c``: row and column strides). Per
    column ``i``: ``v = e2m1(fp32(w[:, i]) / step[:, i])`` signed, ``err = (w[:, i] -
    fp64(v·step[:, i])) / h[i, i]``, then ``w[:, j] -= h[i, j]·err`` for ``j > i``. Columns
    past ``WIDTH`` and rows past ``rows`` are masked (never stored).
    """
    pid = tl.program_id(0)
    r = pid * BLOCK_R + tl.arange(0, BLOCK_R)
    c = tl.arange(0, BW)
    r_ok = r < rows
    c_ok = c < WIDTH
    ok = r_ok[:, None] & c_ok[None, :]
    r64 = r.to(tl.int64)
    col = c[None, :]
    w = tl.load(w_ptr + r64[:, None] * stride_wr + col * stride_wc, mask=ok, other=0.0)
    value = tl.zeros([BLOCK_R, BW], dtype=tl.float32)
    err = tl.zeros([BLOCK_R, BW], dtype=tl.float64)
    steps = step_ptr + r64 * stride_sr
    for i in range(WIDTH):
        here = col == i
        wi = column(w, here)
        s = tl.load(steps + i * stride_sc, mask=r_ok, other=1.0)
        v = signed_e2m1(tl.math.div_rn(wi.to(tl.float32), s))
        e = (wi - (v * s).to(tl.float64)) / tl.load(h_ptr + i * stride_h + i)
        h_row = tl.load(h_ptr + i * stride_h + c, mask=c_ok & (c > i), other=0.0)
        w = tl.where(col > i, w - h_row[None, :] * e[:, None], w)
        value = tl.where(here, v[:, None], value)
        err = tl.where(here, e[:, None], err)
    tl.store(value_ptr + r64[:, None] * stride_vr + col * stride_vc, value, mask=ok)
    tl.store(err_ptr + r64[:, None] * stride_er + col * stride_ec, err, mask=ok)
