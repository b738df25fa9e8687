"""FP8 weight quantization a band of rows at a time: the bytes of
:func:`floatxq.quantize_fp8_weight`, with FP32 temporaries the size of one band.

``quantize_fp8_weight`` converts the whole weight to FP32 and then holds several whole-weight FP32
temporaries at once (``|w|``, ``w * scale_inv``, the clamp): for a 5632 x 2048 MLP weight each is
46 MB, against the weight's 23 MB of bf16, and on the CPU a layer-by-layer run measured a
transient of 90-140 MB per such module. Every scale region lies inside a band of whole rows
(a row, a block row), so quantizing band by band gives the same scales and codes; a tensor
scale takes its amax over all bands first (a max is exact in any order), then encodes them.
"""

from typing import NamedTuple

import torch

from floatxq._checks import require_finite
from floatxq._typing import Float, Tensor
from floatxq.formats import FP8_WEIGHT_BAND_ELEMENTS, FP8ScaleMethod, fp8_max
from floatxq.fp8 import (
    FP8Weight,
    _amax,
    _inverse_scale,
    _saturating_cast,
    _weight_arguments,
    quantize_fp8_weight,
)

__all__ = ["quantize_fp8_weight_banded"]


class _Band(NamedTuple):
    start: int
    stop: int


def _bands(rows: int, cols: int, block_rows: int, rows_per_band: int | None) -> list[_Band]:
    """Row ranges of at most ``rows_per_band`` rows (default: about
    ``FP8_WEIGHT_BAND_ELEMENTS`` elements), rounded up to whole block rows."""
    step = rows_per_band or max(1, FP8_WEIGHT_BAND_ELEMENTS // max(cols, 1))
    step = -(-step // block_rows) * block_rows
    return [_Band(r, min(r + step, rows)) for r in range(0, rows, step)]


def quantize_fp8_weight_banded(
    weight: Float[Tensor, "out in"],
    *,
    format: str | torch.dtype = "float8_e4m3fn",
    weight_scale_method: FP8ScaleMethod | None = "row",
    weight_block_size: tuple[int, int] | list[int] | None = None,
    rows_per_band: int | None = None,
) -> FP8Weight:
    """:func:`floatxq.quantize_fp8_weight`, computed ``rows_per_band`` rows at a time.

    Args:
      weight, format, weight_scale_method, weight_block_size: as ``quantize_fp8_weight``.
      rows_per_band: rows converted to FP32 at once, rounded up to whole block rows (``None``:
        about ``FP8_WEIGHT_BAND_ELEMENTS`` elements' worth). A float64 weight, or a block size
        that does not divide the shape, goes to ``quantize_fp8_weight`` whole (its errors).

    Raises:
      ValueError, TypeError: as ``quantize_fp8_weight``; ``rows_per_band`` below 1 (``ValueError``)
        or not an int (``TypeError``).

    Numerics: bit for bit ``quantize_fp8_weight``'s codes and inverse scales, for every band size.

    Example:
      >>> w = torch.tensor([[1.0, -2.0], [0.0, 0.0], [4.0, 0.5]])
      >>> q = quantize_fp8_weight_banded(w, weight_scale_method="tensor", rows_per_band=1)
      >>> q.scale_inv.item(), q.qweight.float().tolist()[2]
      (112.0, [448.0, 56.0])
    """
    where = "quantize_fp8_weight_banded"
    if rows_per_band is not None and type(rows_per_band) is not int:
        raise TypeError(f"{where}: rows_per_band must be an int or None, got {rows_per_band!r}")
    if rows_per_band is not None and rows_per_band < 1:
        raise ValueError(f"{where}: rows_per_band must be at least 1, got {rows_per_band}")
    name, method, block = _weight_arguments(
        weight, format=format, weight_scale_method=weight_scale_method,
        weight_block_size=weight_block_size, where=where,
    )  # fmt: skip
    rows, cols = weight.shape
    br, bc = block if method == "block" else (1, 1)  # type: ignore[misc]
    if weight.dtype.itemsize > 4 or rows % br or cols % bc:
        return quantize_fp8_weight(
            weight, format=format, weight_scale_method=weight_scale_method,
            weight_block_size=weight_block_size,
        )  # fmt: skip
    dtype, fmax = getattr(torch, name), fp8_max(name)
    bands = _bands(rows, cols, br, rows_per_band)

    def fp32(band: _Band) -> Tensor:
        w = weight[band.start : band.stop].to(torch.float32)
        require_finite(w, name="weight", where=where)
        return w

    qweight = torch.empty((rows, cols), dtype=dtype, device=weight.device)
    if method == "tensor":
        amax = torch.zeros((), dtype=torch.float32, device=weight.device)
        for band in bands:
            amax = torch.maximum(amax, _amax(fp32(band), None))
        scale_inv = _inverse_scale(amax, fmax)
        for band in bands:
            w = weight[band.start : band.stop].to(torch.float32)
            qweight[band.start : band.stop] = _saturating_cast(w * scale_inv, dtype, fmax)
        return FP8Weight(qweight, scale_inv)
    if method == "row":
        scale_inv = torch.empty((rows,), dtype=torch.float32, device=weight.device)
        for band in bands:
            w = fp32(band)
            inv = _inverse_scale(_amax(w, (1,)), fmax)
            scale_inv[band.start : band.stop] = inv
            qweight[band.start : band.stop] = _saturating_cast(w * inv[:, None], dtype, fmax)
        return FP8Weight(qweight, scale_inv)
    scale_inv = torch.empty((rows // br, cols // bc), dtype=torch.float32, device=weight.device)
    for band in bands:
        blocks = fp32(band).reshape((band.stop - band.start) // br, br, cols // bc, bc)
        inv = _inverse_scale(_amax(blocks, (1, 3)), fmax)
        scale_inv[band.start // br : band.stop // br] = inv
        codes = _saturating_cast(blocks * inv[:, None, :, None], dtype, fmax)
        qweight[band.start : band.stop] = codes.reshape(band.stop - band.start, cols)
    return FP8Weight(qweight, scale_inv)
