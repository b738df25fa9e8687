"""SWIZZLE_32_4_4: the tensor-core layout of NVFP4 block scales, and its inverse.

A ``(rows, cols)`` matrix of block scales (one per 16 values of K) is zero-padded to rows a
multiple of 128 and columns a multiple of 4, then cut into 128×4 tiles stored one after another
(row tiles outer, column tiles inner); inside a tile the scale of row ``r`` and column ``c`` sits
at ``(r % 32)·16 + ((r % 128) // 32)·4 + c % 4``. Activations are swizzled per 128-column group
(8 block columns) so each group's scales are contiguous. Padding slots hold 0. The scales
themselves come from :mod:`floatxq.nvfp4.quantize`; ``docs/numerics.md`` states the contract.
"""

import torch

from floatxq._typing import Shaped, Tensor
from floatxq.formats import SWIZZLE_TILE_COLS, SWIZZLE_TILE_ROWS

__all__ = [
    "swizzle_scales",
    "swizzle_scales_per_group",
    "unswizzle_scales",
    "unswizzle_scales_per_group",
]

_TILE_ROWS, _TILE_COLS = SWIZZLE_TILE_ROWS, SWIZZLE_TILE_COLS
_GROUP_BLOCKS = 8  # 128-column activation group = 8 blocks of 16


def _ceil_to(n: int, m: int) -> int:
    return -(-n // m) * m


def _swizzle_2d(scales: Tensor) -> Tensor:
    rows, cols = scales.shape
    rp, cp = _ceil_to(rows, _TILE_ROWS), _ceil_to(cols, _TILE_COLS)
    padded = torch.zeros((rp, cp), dtype=scales.dtype, device=scales.device)
    padded[:rows, :cols] = scales
    # offset(r, c) = ((r//128)·(cp/4) + c//4)·512 + (r%32)·16 + ((r%128)//32)·4 + c%4
    tiles = padded.reshape(rp // 128, 4, 32, cp // 4, 4).permute(0, 3, 2, 1, 4)
    return tiles.reshape(-1)


def _unswizzle_2d(flat: Tensor, rows: int, cols: int) -> Tensor:
    rp, cp = _ceil_to(rows, _TILE_ROWS), _ceil_to(cols, _TILE_COLS)
    tiles = flat.reshape(rp // 128, cp // 4, 32, 4, 4).permute(0, 3, 2, 1, 4)
    return tiles.reshape(rp, cp)[:rows, :cols]


def _check_rows_cols(rows: int, cols: int, *, where: str) -> None:
    for name, value in (("rows", rows), ("cols", cols)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"{where}: {name} must be a non-negative int, got {value!r}")


def swizzle_scales(scales: Shaped[Tensor, "rows cols"]) -> Shaped[Tensor, " padded"]:
    """Lay a weight's block scales out as ``SWIZZLE_32_4_4``, zero-padded, flattened.

    Rows are padded to 128 and columns to 4; the ``(rows, cols)`` matrix becomes
    ``offset(r, c) = ((r//128)·(Cp/4) + c//4)·512 + (r%32)·16 + ((r%128)//32)·4 + c%4`` with
    ``Cp`` the padded column count. Any dtype (bytes are moved, never converted).

    Numerics: a permutation of the padded matrix; padding holds 0.

    Example:
      >>> s = swizzle_scales(torch.arange(1.0, 9.0).reshape(2, 4))
      >>> s.shape, s[:4].tolist(), s[16:20].tolist()
      (torch.Size([512]), [1.0, 2.0, 3.0, 4.0], [5.0, 6.0, 7.0, 8.0])
    """
    return _swizzle_2d(scales)


def swizzle_scales_per_group(
    scales: Shaped[Tensor, "rows cols"],
) -> Shaped[Tensor, "cols//8 padded"]:
    """The activation layout: each 128-column group (8 block columns) swizzled on its own.

    Group ``j`` is :func:`swizzle_scales` of ``scales[:, 8j : 8j + 8]``, so the result is
    ``(cols / 8, padded_rows · 8)`` with rows padded to 128.

    Raises:
      ValueError: ``cols % 8`` (the activation's K must be a multiple of 128).

    Numerics: a permutation per group; padding holds 0.

    Example:
      >>> s = swizzle_scales_per_group(torch.arange(8.0).reshape(1, 8))
      >>> s.shape, s[0, :5].tolist()
      (torch.Size([1, 1024]), [0.0, 1.0, 2.0, 3.0, 0.0])
    """
    rows, cols = scales.shape
    if cols % _GROUP_BLOCKS:
        raise ValueError(
            f"swizzle_scales_per_group: scales must have a multiple of {_GROUP_BLOCKS} block "
            f"columns (K % 128 == 0), got cols={cols}"
        )
    if cols == 0:  # split() would hand back the empty matrix as one group
        return scales.new_zeros((0, _ceil_to(rows, _TILE_ROWS) * _GROUP_BLOCKS))
    return torch.stack([_swizzle_2d(g) for g in scales.split(_GROUP_BLOCKS, dim=1)])


def unswizzle_scales(
    swizzled: Shaped[Tensor, " padded"], *, rows: int, cols: int
) -> Shaped[Tensor, "{rows} {cols}"]:
    """Inverse of :func:`swizzle_scales`: the ``(rows, cols)`` matrix without its padding.

    Raises:
      ValueError: a swizzled size other than ``ceil(rows/128)·128 · ceil(cols/4)·4``, or a
        negative ``rows``/``cols``.

    Numerics: a permutation.

    Example:
      >>> s = torch.arange(21.0).reshape(3, 7)
      >>> torch.equal(unswizzle_scales(swizzle_scales(s), rows=3, cols=7), s)
      True
    """
    where = "unswizzle_scales"
    _check_rows_cols(rows, cols, where=where)
    expected = (_ceil_to(rows, _TILE_ROWS) * _ceil_to(cols, _TILE_COLS),)
    if tuple(swizzled.shape) != expected:
        raise ValueError(
            f"{where}: swizzled must have shape {expected} for rows={rows}, cols={cols}, got "
            f"{tuple(swizzled.shape)}"
        )
    return _unswizzle_2d(swizzled, rows, cols)


def unswizzle_scales_per_group(
    swizzled: Shaped[Tensor, "groups padded"], *, rows: int, cols: int
) -> Shaped[Tensor, "{rows} {cols}"]:
    """Inverse of :func:`swizzle_scales_per_group`: the ``(rows, cols)`` matrix, no padding.

    Raises:
      ValueError: ``cols % 8``, or a swizzled shape other than ``(cols/8, ceil(rows/128)·1024)``.

    Numerics: a permutation.

    Example:
      >>> s = torch.arange(48.0).reshape(3, 16)
      >>> torch.equal(
      ...     unswizzle_scales_per_group(swizzle_scales_per_group(s), rows=3, cols=16), s
      ... )
      True
    """
    where = "unswizzle_scales_per_group"
    _check_rows_cols(rows, cols, where=where)
    expected = (cols // _GROUP_BLOCKS, _ceil_to(rows, _TILE_ROWS) * _GROUP_BLOCKS)
    if cols % _GROUP_BLOCKS or tuple(swizzled.shape) != expected:
        raise ValueError(
            f"{where}: swizzled must have shape {expected} for rows={rows}, cols={cols} "
            f"(cols a multiple of {_GROUP_BLOCKS}), got {tuple(swizzled.shape)}"
        )
    parts = [_unswizzle_2d(g, rows, _GROUP_BLOCKS) for g in swizzled]
    if not parts:
        return swizzled.new_zeros((rows, 0))
    return torch.cat(parts, dim=1)
