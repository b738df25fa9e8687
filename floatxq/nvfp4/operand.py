"""NVFP4 activations as a tensor-core operand: packed codes with per-group swizzled scales.

A ``(rows, K)`` activation (``K`` a multiple of 128) becomes

* ``packed``: ``float4_e2m1fn_x2 (rows, K/2)``, two E2M1 codes per byte, element ``2j`` in the
  low nibble (:func:`floatxq.pack_e2m1`);
* ``scales``: ``float8_e4m3fn (K/128, padded_rows·8)``, the E4M3 block scales of each 128-wide K
  group laid out ``SWIZZLE_32_4_4`` on their own (:func:`floatxq.swizzle_scales_per_group`),
  rows padded to a multiple of 128 with scale 0;

with one FP32 global scale beside them. These are the pure references of the Triton kernels
``nvfp4_pack_and_swizzle`` and ``nvfp4_decode`` (:mod:`floatxq.kernels.nvfp4`), which must equal
them bit for bit. The block-scale search is :func:`floatxq.nvfp4_block_scales`.
"""

import torch

from floatxq._checks import require_data, require_floating, require_tensor
from floatxq._typing import Float, Float8e4m3fn, Shaped, Tensor
from floatxq.formats import (
    K_GROUP,
    MODEL_DTYPES,
    NVFP4_BLOCK,
    NVFP4_DEFAULT_RECIPE,
    SWIZZLE_TILE_ROWS,
    NVFP4RecipeName,
    normalize_nvfp4_recipe,
)
from floatxq.nvfp4.e2m1 import pack_e2m1
from floatxq.nvfp4.quantize import _validated_global_scale, nvfp4_block_scales, nvfp4_dequantize
from floatxq.nvfp4.swizzle import swizzle_scales_per_group, unswizzle_scales_per_group

__all__ = ["nvfp4_decode_swizzled", "nvfp4_pack_swizzled", "padded_rows"]

_TILE_ROWS = SWIZZLE_TILE_ROWS
_FP4X2 = torch.float4_e2m1fn_x2
_E4M3 = torch.float8_e4m3fn


def padded_rows(rows: int) -> int:
    """``rows`` rounded up to a multiple of 128: the row count of the swizzled scale layout.

    Example:
      >>> padded_rows(0), padded_rows(1), padded_rows(129)
      (0, 128, 256)
    """
    return -(-rows // _TILE_ROWS) * _TILE_ROWS


def _check_x(x: object, *, where: str) -> tuple[int, int]:
    require_floating(x, name="x", where=where)
    require_data(x, name="x", where=where)
    if x.ndim != 2:
        raise ValueError(f"{where}: x must be 2-D (rows, K), got shape {tuple(x.shape)}")
    rows, k = x.shape
    if k == 0 or k % K_GROUP:
        raise ValueError(
            f"{where}: K must be a positive multiple of {K_GROUP} (scales are "
            f"swizzled per 128-wide group), got K={k}"
        )
    return rows, k


def nvfp4_pack_swizzled(
    x: Float[Tensor, "rows k"],
    global_scale: Float[Tensor, "*one"] | float,
    *,
    recipe: NVFP4RecipeName = NVFP4_DEFAULT_RECIPE,
) -> tuple[Shaped[Tensor, "rows k//2"], Float8e4m3fn[Tensor, "k//128 padded"]]:
    """Quantize ``x`` to NVFP4 and lay it out as the tensor-core operand.

    Args:
      x: ``(rows, K)`` floating activations, finite; ``K`` a positive multiple of 128.
      global_scale: one positive finite FP32 value (a number or a one-element tensor).
      recipe: the block-scale recipe (:func:`floatxq.nvfp4_block_scales`; aliases
        accepted).

    Returns:
      ``(packed, scales)``: ``float4_e2m1fn_x2 (rows, K/2)`` and ``float8_e4m3fn (K/128,
      padded_rows(rows)·8)``. No rows gives ``(0, K/2)`` and ``(K/128, 0)``.

    Raises:
      ValueError: ``x`` not 2-D, ``K`` not a positive multiple of 128, NaN or infinity in ``x``,
        a global scale that is not one positive finite value, an unknown recipe.
      TypeError: a non-floating ``x``, a global scale that is not a real number.

    Numerics: exactly :func:`floatxq.nvfp4_block_scales` (codes with the input's sign
    bit, E4M3 scales), codes packed even-low, scales swizzled per 128-wide group with padding 0.

    Example:
      >>> packed, scales = nvfp4_pack_swizzled(torch.full((2, 128), 3.0), 1.0)
      >>> b = scales.view(torch.uint8)[0]  # 3/4 = 0.75 is E4M3 0x34; row 1 starts at slot 16
      >>> packed.shape, scales.shape, b[:5].tolist(), b[16:17].tolist()
      (torch.Size([2, 64]), torch.Size([1, 1024]), [52, 52, 52, 52, 0], [52])
    """
    where = "nvfp4_pack_swizzled"
    rows, k = _check_x(x, where=where)
    recipe = normalize_nvfp4_recipe(recipe)
    g = _validated_global_scale(global_scale, x.device, where=where)
    if rows == 0:
        return (
            torch.empty((0, k // 2), dtype=torch.uint8, device=x.device).view(_FP4X2),
            torch.empty((k // K_GROUP, 0), dtype=_E4M3, device=x.device),
        )
    blocks = nvfp4_block_scales(x, g, recipe)
    return pack_e2m1(blocks.codes).view(_FP4X2), swizzle_scales_per_group(blocks.block_scales)


def _check_decode_operands(
    codes: object, scales: object, width: object, out_dtype: object, *, where: str
) -> int:
    """Kinds, shapes and devices of a decode's operands (no value is read); returns ``rows``."""
    require_tensor(codes, name="codes", where=where)
    require_tensor(scales, name="scales", where=where)
    if codes.dtype not in (torch.uint8, _FP4X2) or codes.ndim != 2:
        raise TypeError(
            f"{where}: codes must be a 2-D uint8 or float4_e2m1fn_x2 (rows, width/2) tensor, "
            f"got {codes.dtype} {tuple(codes.shape)}"
        )
    if scales.dtype != _E4M3:
        raise TypeError(f"{where}: scales must be float8_e4m3fn, got {scales.dtype}")
    if out_dtype not in MODEL_DTYPES:
        raise TypeError(
            f"{where}: out_dtype must be float16, bfloat16 or float32, got {out_dtype!r}"
        )
    if isinstance(width, bool) or not isinstance(width, int) or width <= 0 or width % K_GROUP:
        raise ValueError(f"{where}: width must be a positive multiple of {K_GROUP}, got {width!r}")
    rows = codes.shape[0]
    if codes.shape[1] != width // 2:
        raise ValueError(
            f"{where}: codes must have shape (rows, {width // 2}) for width={width}, got "
            f"{tuple(codes.shape)}"
        )
    expected = (width // K_GROUP, padded_rows(rows) * 8)
    if tuple(scales.shape) != expected:
        raise ValueError(
            f"{where}: scales must have shape {expected} (width/128, padded_rows*8) for "
            f"{rows} rows, got {tuple(scales.shape)}"
        )
    if scales.device != codes.device:
        raise TypeError(f"{where}: scales are on {scales.device}, codes on {codes.device}")
    return rows


def nvfp4_decode_swizzled(
    codes: Shaped[Tensor, "rows half"],
    scales: Float8e4m3fn[Tensor, "groups padded"],
    global_scale: Float[Tensor, "*one"] | float,
    width: int,
    out_dtype: torch.dtype,
) -> Float[Tensor, "rows {width}"]:
    """Decode the operand: ``(e2m1(code) · block_scale) · global_scale`` in ``out_dtype``.

    Args:
      codes: ``(rows, width/2)`` ``float4_e2m1fn_x2`` or ``uint8`` packed codes.
      scales: ``float8_e4m3fn (width/128, padded_rows(rows)·8)`` swizzled block scales.
      global_scale: one positive finite FP32 value.
      width: ``K``, a positive multiple of 128.
      out_dtype: float16, bfloat16 or float32.

    Returns:
      ``(rows, width)`` in ``out_dtype``.

    Raises:
      ValueError: ``width`` not a positive multiple of 128, shapes that do not fit it, a NaN or
        negative block scale, a global scale that is not one positive finite value.
      TypeError: codes that are not uint8 / ``float4_e2m1fn_x2``, scales that are not
        ``float8_e4m3fn``, another ``out_dtype``, tensors on different devices.

    Numerics: as :func:`floatxq.nvfp4_dequantize`: the code-scale product is exact in
    FP32, one rounding for the global scale, one into ``out_dtype`` after clamping to its largest
    finite magnitude. Padding rows of the layout are not read.

    Example:
      >>> packed, scales = nvfp4_pack_swizzled(torch.full((1, 128), 3.0), 1.0)
      >>> nvfp4_decode_swizzled(packed, scales, 1.0, 128, torch.float32)[0, :2].tolist()
      [3.0, 3.0]
    """
    where = "nvfp4_decode_swizzled"
    rows = _check_decode_operands(codes, scales, width, out_dtype, where=where)
    require_data(codes, name="codes", where=where)
    g = _validated_global_scale(global_scale, codes.device, where=where)
    if rows == 0:
        return torch.empty((0, width), dtype=out_dtype, device=codes.device)
    block_scales = unswizzle_scales_per_group(scales, rows=rows, cols=width // NVFP4_BLOCK)
    return nvfp4_dequantize(codes.view(torch.uint8), block_scales, g, dtype=out_dtype)
