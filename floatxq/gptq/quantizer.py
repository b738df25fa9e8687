"""GPTQ's elementwise quantizer: a group's ``(scale, zero)``, fake quantization, the MSE search.

Private to :mod:`floatxq.gptq` (:func:`~floatxq.gptq.solve.gptq_solve` and
:func:`~floatxq.gptq.solve.rtn_quantize` share it). Per output row of a group:
``xmin = min(0, min x)``, ``xmax = max(0, max x)``; symmetric widens to ``±max(|xmin|, xmax)``
when ``xmin < 0``; an all-zero row uses ``[-1, 1]``; ``scale = (xmax - xmin) / maxq`` (IEEE
division by a tensor, so CPU and CUDA agree), ``zero = (maxq + 1) / 2`` (symmetric) or
``round(-xmin / scale)``; ``code = clamp(round(x / scale) + zero, 0, maxq)`` and
``value = scale · (code - zero)``, with torch's round-half-to-even.
"""

from typing import NamedTuple

import torch

from floatxq._typing import Float, Tensor, checked_record

_MSE_GRID = 100
_MSE_MAX_SHRINK = 0.8
_MSE_CHUNK = 8  # shrink candidates evaluated at once (fixed so reductions see fixed shapes)


@checked_record
class _QuantSpec(NamedTuple):
    bits: int
    maxq: int
    sym: bool
    norm: float  # the MSE search exponent; 0 = no search
    shrink: Float[Tensor, " candidates"] | None  # fp(1 - i/100), i < 80; built outside graphs


def _quant_spec(
    *, bits: int, sym: bool, mse: float, dtype: torch.dtype, device: torch.device
) -> _QuantSpec:
    """The quantizer of ``bits``-bit codes (``mse > 0``: with the shrink search's candidates)."""
    shrink = None
    if mse > 0:
        count = int(_MSE_MAX_SHRINK * _MSE_GRID)
        shrink = torch.tensor([1 - i / _MSE_GRID for i in range(count)], dtype=dtype, device=device)
    return _QuantSpec(bits, 2**bits - 1, sym, mse, shrink)


def _fake_quant(x: Tensor, scale: Tensor, zero: Tensor, maxq: int) -> tuple[Tensor, Tensor]:
    """``code = clamp(round(x / scale) + zero, 0, maxq)`` and ``value = scale · (code - zero)``."""
    code = torch.clamp(torch.round(x / scale) + zero, 0, maxq)
    return code, scale * (code - zero)


def _group_params(x: Tensor, spec: _QuantSpec) -> tuple[Tensor, Tensor]:
    """Per-column ``(scale, zero)`` of a ``(group, rows)`` slice (rows = output rows of W)."""
    xmin = torch.clamp(x.amin(dim=0), max=0)
    xmax = torch.clamp(x.amax(dim=0), min=0)
    if spec.sym:
        xmax = torch.maximum(xmin.abs(), xmax)
        xmin = torch.where(xmin < 0, -xmax, xmin)
    both_zero = (xmin == 0) & (xmax == 0)
    xmin = torch.where(both_zero, -1.0, xmin)
    xmax = torch.where(both_zero, 1.0, xmax)
    maxq = torch.full_like(xmax, spec.maxq)
    scale = _nonzero_scale((xmax - xmin) / maxq)
    if spec.sym:
        zero = torch.full_like(scale, (spec.maxq + 1) / 2)
    else:
        zero = torch.round(-xmin / scale)
    if spec.shrink is not None:
        scale, zero = _mse_search(x, xmin, xmax, scale, zero, maxq, spec)
    return scale, zero


def _nonzero_scale(scale: Tensor) -> Tensor:
    """A scale that underflowed to 0 (subnormal-only rows) becomes the dtype's tiny value."""
    return torch.where(scale == 0, torch.finfo(scale.dtype).tiny, scale)


def _mse_search(
    x: Tensor,
    xmin: Tensor,
    xmax: Tensor,
    scale: Tensor,
    zero: Tensor,
    maxq: Tensor,
    spec: _QuantSpec,
) -> tuple[Tensor, Tensor]:
    """The shrink search: the first candidate with the least ``Σ |q - x|^norm`` wins.

    Candidates in order: ``p = 1 - i/100`` for ``i = 0..79`` (``p = 1`` is the min/max scale),
    ``scale = (p·xmax - p·xmin) / maxq``; symmetric keeps the zero point, asymmetric uses
    ``round(-p·xmin / scale)``, and 2-bit asymmetric also tries the integer on the other side of
    the unrounded zero point (clamped to ``0..maxq``; floatxq's reading of GPT-QModel's
    "adjacent zero point"). Keeping the first of equal errors equals walking the candidates in
    order and replacing the best only on a strictly smaller error, as GPT-QModel does.
    """
    shrink = spec.shrink if spec.shrink is not None else xmin.new_ones((1,))
    errors, scales, zeros = [], [], []
    for start in range(0, shrink.shape[0], _MSE_CHUNK):
        p = shrink[start : start + _MSE_CHUNK, None]
        xmin1, xmax1 = p * xmin, p * xmax
        scale1 = _nonzero_scale((xmax1 - xmin1) / maxq)
        if spec.sym:
            zero1 = zero.expand_as(scale1)[:, None]
        else:
            exact = -xmin1 / scale1
            rounded = torch.round(exact)
            zero1 = rounded[:, None]
            if spec.bits == 2:
                other = torch.where(rounded > exact, rounded - 1, rounded + 1)
                zero1 = torch.stack([rounded, other.clamp(0, spec.maxq)], dim=1)
        scale1 = scale1[:, None].expand_as(zero1)
        _, value = _fake_quant(x[None, None], scale1[:, :, None], zero1[:, :, None], spec.maxq)
        err = (value - x).abs().pow(spec.norm).sum(dim=2)
        errors.append(err.flatten(0, 1))
        scales.append(scale1.flatten(0, 1))
        zeros.append(zero1.flatten(0, 1))
    best = torch.cat(errors).argmin(dim=0, keepdim=True)
    return (
        torch.cat(scales).gather(0, best)[0],
        torch.cat(zeros).gather(0, best)[0],
    )
