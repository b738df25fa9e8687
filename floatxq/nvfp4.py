"""NVFP4: the E2M1 codec, the FP32 global scale, every block-scale recipe, swizzle and headroom.

An NVFP4 tensor is three things, each named by its direction (all multiply to decode):
  * ``codes``: E2M1 codes, ``sign << 3 | index`` into :data:`~floatxq.formats.E2M1_VALUES`,
    two per byte when packed, the even element (lower K index) in the low nibble;
  * ``block_scales``: one E4M3 scale per 16 consecutive values of the last axis;
  * ``global_scale``: one FP32 scale; ``x ≈ e2m1(code) * float(block_scale) * global_scale``.

The scale search (SPEC §4) runs per 16-value block, vectorized over all blocks (chunked, so memory
stays bounded), in exactly the operation order the contract fixes. Every block sum (the SSE and the
two least-squares dot products) is a fixed pairwise tree, ``(i, i+8)``, then ``(i, i+4)``,
``(i, i+2)``, ``(i, i+1)``: one addition per step, so CPU, CUDA and the Triton twins agree bit for
bit. All division is IEEE FP32 division by a tensor (never ``tensor / python_float``, which CUDA
turns into a multiply by the rounded reciprocal).
"""

import dataclasses
import math
import time
import warnings
from collections.abc import Sequence
from typing import Any, NamedTuple

import torch

from floatxq._typing import Float, Float8e4m3fn, Float32, Shaped, Tensor, UInt8
from floatxq.formats import (
    E2M1_VALUES,
    FP8_E4M3_MAX,
    NVFP4_BLOCK,
    NVFP4_E4M3_SEARCH_RADIUS,
    NVFP4_SCALE_MAX,
    NVFP4_SCALE_MIN,
    normalize_nvfp4_recipe,
    nvfp4_kernel_recipe,
    nvfp4_uses_headroom,
)

__all__ = [
    "DEFAULT_REPORT_RECIPES",
    "HeadroomConfig",
    "HeadroomState",
    "NVFP4ActivationHeadroom",
    "NVFP4Blocks",
    "NVFP4Packed",
    "RecipeRow",
    "RecipesReport",
    "e2m1_decode",
    "e2m1_encode",
    "e2m1_round",
    "headroom_amax",
    "headroom_init",
    "headroom_percentile",
    "headroom_update",
    "nvfp4_block_qdq",
    "nvfp4_block_scales",
    "nvfp4_block_sse",
    "nvfp4_dequantize",
    "nvfp4_global_scale",
    "nvfp4_quantize",
    "pack_e2m1",
    "recipes_report",
    "swizzle_scales",
    "unpack_e2m1",
    "unswizzle_scales",
]

_E4M3 = torch.float8_e4m3fn
_E4M3_CODE_ONE = 0x38  # bit pattern of 1.0, the scale of an all-zero block
_E4M3_FIRST_CODE, _E4M3_LAST_CODE = 1, 126  # 2**-9 ... 448: every positive finite E4M3 value
_E4M3_POSITIVE: tuple[float, ...] = tuple(
    torch.arange(_E4M3_FIRST_CODE, _E4M3_LAST_CODE + 1, dtype=torch.uint8)
    .view(torch.float8_e4m3fn)
    .float()
    .tolist()
)  # every positive finite E4M3 value, ascending
_SEARCH_CHUNK_BLOCKS = 1 << 15  # blocks per vectorized step: ~2 MiB per [chunk, 16] FP32 temporary
_SWIZZLE_ROWS, _SWIZZLE_COLS = 128, 4
_GROUP_BLOCKS = 8  # 128-column activation group = 8 blocks of 16


class NVFP4Blocks(NamedTuple):
    """Unpacked result of the scale search."""

    codes: Tensor
    """UInt8 E2M1 codes ``*b k`` (sign bit 3 set iff the input element is < 0)."""
    block_scales: Tensor
    """``float8_e4m3fn`` ``*b k/16``: multiply to decode."""
    global_scale: Tensor
    """FP32 scalar: multiply to decode."""


class NVFP4Packed(NamedTuple):
    """Packed NVFP4: two codes per byte, even element in the low nibble."""

    packed: Tensor
    """UInt8 ``*b k/2``."""
    block_scales: Tensor
    """``float8_e4m3fn`` ``*b k/16``: multiply to decode."""
    global_scale: Tensor
    """FP32 scalar: multiply to decode."""


# ----------------------------------------------------------------------------------------------
# E2M1 codec
# ----------------------------------------------------------------------------------------------


def _e2m1_table(device: torch.device) -> Tensor:
    return torch.tensor(E2M1_VALUES, dtype=torch.float32, device=device)


def _e2m1_index(magnitude: Tensor) -> Tensor:
    """Index (0..7) of the nearest E2M1 magnitude, ties to the even index; saturates at 6."""
    m = magnitude
    idx = (m > 0.25).to(torch.uint8)
    idx += m >= 0.75
    idx += m > 1.25
    idx += m >= 1.75
    idx += m > 2.5
    idx += m >= 3.5
    idx += m > 5.0
    return idx


def e2m1_round(x: Float[Tensor, "*shape"]) -> Float32[Tensor, "*shape"]:
    """Round to the nearest E2M1 value with the sign of ``x`` (FP32 result).

    The magnitude is clamped to 6 (±inf saturate too); a magnitude crosses up a boundary when
    ``m > 0.25``, ``m >= 0.75``, ``m > 1.25``, ``m >= 1.75``, ``m > 2.5``, ``m >= 3.5``, ``m > 5``.

    Numerics: round-to-nearest, ties to the even code; finite saturation at ±6; the sign is kept
    (tiny negatives and ``-0.0`` give ``-0.0``); NaN gives a signed zero (callers reject it first).

    Example:
      >>> e2m1_round(torch.tensor([0.25, 0.75, -2.5, 5.0, 9.0, -1e-3])).tolist()
      [0.0, 1.0, -2.0, 4.0, 6.0, -0.0]
    """
    x32 = x.to(torch.float32)
    values = _e2m1_table(x32.device)[_e2m1_index(x32.abs()).long()]
    return values.copysign(x32)


def e2m1_encode(values: Float[Tensor, "*shape"]) -> UInt8[Tensor, "*shape"]:
    """Exact codebook map from E2M1 values to 4-bit codes (``sign << 3 | index``).

    ``-0.0`` encodes as code 8, so ``e2m1_encode(e2m1_decode(c)) == c`` for all 16 codes.

    Raises:
      ValueError: a value that is not exactly one of ``±E2M1_VALUES`` (round with
        :func:`e2m1_round` first).

    Numerics: exact, no rounding.

    Example:
      >>> e2m1_encode(torch.tensor([0.0, 1.5, -6.0, -0.0])).tolist()
      [0, 3, 15, 8]
    """
    v = values.to(torch.float32)
    mag = v.abs()
    table = _e2m1_table(v.device)
    idx = torch.searchsorted(table, mag.contiguous()).clamp_max(7)
    if v.numel() and not bool((table[idx] == mag).all()):
        bad = v[table[idx] != mag].flatten()[:4].tolist()
        raise ValueError(
            f"e2m1_encode: values must be exact E2M1 values ±{E2M1_VALUES}; got e.g. {bad}"
        )
    return (idx.to(torch.uint8) | (torch.signbit(v).to(torch.uint8) << 3)).to(torch.uint8)


def _check_codes(codes: Tensor, *, where: str) -> None:
    if codes.dtype != torch.uint8:
        raise TypeError(f"{where}: codes must be uint8 (one E2M1 code each), got {codes.dtype}")
    if codes.numel() and int(codes.max()) > 15:
        raise ValueError(f"{where}: E2M1 codes are 0..15, got a maximum of {int(codes.max())}")


def e2m1_decode(codes: UInt8[Tensor, "*shape"]) -> Float32[Tensor, "*shape"]:
    """Decode 4-bit E2M1 codes: ``0, .5, 1, 1.5, 2, 3, 4, 6`` and the same negated for 8..15.

    Raises:
      ValueError: a code above 15. TypeError: codes that are not uint8.

    Numerics: exact (code 8 is ``-0.0``).

    Example:
      >>> e2m1_decode(torch.tensor([1, 7, 8, 13], dtype=torch.uint8)).tolist()
      [0.5, 6.0, -0.0, -3.0]
    """
    _check_codes(codes, where="e2m1_decode")
    table = _e2m1_table(codes.device)
    signed = torch.cat([table, -table])
    return signed[codes.long()]


def pack_e2m1(codes: UInt8[Tensor, "*b k"]) -> UInt8[Tensor, "*b k//2"]:
    """Pack E2M1 codes two per byte along the last axis: ``byte = code[2j] | code[2j+1] << 4``.

    Raises:
      ValueError: an odd last axis or a code above 15. TypeError: codes that are not uint8.

    Numerics: exact bit packing (the torchao / compressed-tensors nibble order).

    Example:
      >>> pack_e2m1(torch.tensor([[1, 2, 15, 0]], dtype=torch.uint8)).tolist()
      [[33, 15]]
    """
    _check_codes(codes, where="pack_e2m1")
    if codes.ndim == 0 or codes.shape[-1] % 2:
        raise ValueError(
            f"pack_e2m1: the last axis must have even length, got shape {tuple(codes.shape)}"
        )
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack_e2m1(packed: Shaped[Tensor, "*b half"]) -> UInt8[Tensor, "*b k"]:
    """Inverse of :func:`pack_e2m1`; accepts uint8 or ``float4_e2m1fn_x2`` storage.

    Numerics: exact bit unpacking.

    Example:
      >>> unpack_e2m1(torch.tensor([[33, 15]], dtype=torch.uint8)).tolist()
      [[1, 2, 15, 0]]
    """
    if packed.dtype == getattr(torch, "float4_e2m1fn_x2", None):
        packed = packed.view(torch.uint8)
    if packed.dtype != torch.uint8:
        raise TypeError(
            f"unpack_e2m1: packed must be uint8 or float4_e2m1fn_x2, got {packed.dtype}"
        )
    if packed.ndim == 0:
        raise ValueError("unpack_e2m1: packed must have at least one axis")
    low, high = packed & 0xF, packed >> 4
    return torch.stack([low, high], dim=-1).reshape(*packed.shape[:-1], 2 * packed.shape[-1])


# ----------------------------------------------------------------------------------------------
# Global scale
# ----------------------------------------------------------------------------------------------

_GRID_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _divisor(recipe: Any) -> float:
    local = nvfp4_kernel_recipe(recipe)
    return 6.0 if local == "nvidia" or nvfp4_uses_headroom(recipe) else 4.0


def nvfp4_global_scale(
    amax: Float[Tensor, ""] | float,
    *,
    grid_dtype: torch.dtype | None = None,
    recipe: str = "least_squares",
) -> Float32[Tensor, ""]:
    """The FP32 global scale that maps ``amax`` onto the top of the E4M3 × E2M1 range.

    ``amax / (448 * d)`` (one FP32 division by 2688 or 1792) for ``amax > 0``, else 1, with
    ``d = 6`` for ``nvidia`` and the headroom recipes and ``d = 4`` otherwise (so the M=4 seed of
    the largest block lands at block scale 448 and value 6 stays as headroom).

    Args:
      amax: the tensor's largest magnitude (finite, ≥ 0).
      grid_dtype: round the result through fp16/bf16/fp32 (the runtime passes the activation
        dtype); a value that rounds to 0 keeps its FP32 value.
      recipe: an NVFP4 recipe name (aliases accepted).

    Raises:
      ValueError: non-finite or negative ``amax``, another ``grid_dtype``, an unknown recipe.

    Numerics: IEEE FP32 division; optional nearest-even rounding through ``grid_dtype`` (fp16
    overflow gives +inf, as the seed's); returns a 0-d FP32 tensor on ``amax``'s device.

    Example:
      >>> nvfp4_global_scale(torch.tensor(1792.0)).item(), nvfp4_global_scale(0.0).item()
      (1.0, 1.0)
    """
    divisor = _divisor(recipe)
    if grid_dtype is not None and grid_dtype not in _GRID_DTYPES:
        raise ValueError(
            f"nvfp4_global_scale: grid_dtype must be torch.float16, torch.bfloat16 or "
            f"torch.float32, got {grid_dtype}"
        )
    v = torch.as_tensor(amax, dtype=torch.float32).reshape(())
    if not bool(torch.isfinite(v)) or bool(v < 0):
        raise ValueError(f"nvfp4_global_scale: amax must be finite and >= 0, got {v.item()!r}")
    scale = torch.where(v > 0, v / torch.full_like(v, FP8_E4M3_MAX * divisor), torch.ones_like(v))
    if grid_dtype is not None:
        rounded = scale.to(grid_dtype).to(torch.float32)
        scale = torch.where(rounded > 0, rounded, scale)
    return scale


# ----------------------------------------------------------------------------------------------
# The scale search
# ----------------------------------------------------------------------------------------------


def _tree_sum16(x: Tensor) -> Tensor:
    """Sum the last axis of 16 in the fixed order (i, i+8), (i, i+4), (i, i+2), (i, i+1)."""
    x = x[..., :8] + x[..., 8:]
    x = x[..., :4] + x[..., 4:]
    x = x[..., :2] + x[..., 2:]
    return x[..., 0] + x[..., 1]


def _to_e4m3_values(t: Tensor) -> Tensor:
    """Nearest-even E4M3 value of an FP32 scale already clamped to [2**-9, 448]."""
    return t.to(_E4M3).to(torch.float32)


def _clamped_scale(t: Tensor, valid: Tensor) -> Tensor:
    """E4M3 of ``clamp(t, 2**-9, 448)`` where ``valid``, else 1."""
    clamped = t.clamp(NVFP4_SCALE_MIN, NVFP4_SCALE_MAX)
    return _to_e4m3_values(torch.where(valid, clamped, torch.ones_like(clamped)))


class _Candidate(NamedTuple):
    scale: Tensor  # [n] FP32 values of E4M3 block scales
    index: Tensor  # [n, 16] uint8 E2M1 magnitude indices (the sign is the input's)
    err: Tensor  # [n] FP32 SSE


def _evaluate(mag: Tensor, scale: Tensor, g: Tensor, table: Tensor) -> _Candidate:
    """SSE of ``scale`` on block magnitudes ``mag`` [n, 16].

    The contract's ``sum((e2m1_round(v / e) * e - v)**2)`` computed on magnitudes: the rounded
    value carries the sign of ``v``, so ``q*e - v == ±(|q|*e - |v|)`` exactly and the SSE is the
    same bits.
    """
    e = scale * g  # FP32 product
    index = _e2m1_index(mag / e[:, None])
    err = _tree_sum16((table[index.long()] * e[:, None] - mag) ** 2)
    return _Candidate(scale, index, err)


def _better(best: _Candidate, cand: _Candidate) -> _Candidate:
    take = cand.err < best.err  # strict: ties keep the incumbent
    return _Candidate(
        torch.where(take, cand.scale, best.scale),
        torch.where(take[:, None], cand.index, best.index),
        torch.where(take, cand.err, best.err),
    )


def _least_squares_scale(mag: Tensor, index: Tensor, g: Tensor, table: Tensor) -> Tensor:
    values = table[index.long()]  # magnitudes: <|v|, |q|> equals <v, q> bit for bit
    den = _tree_sum16(values * values)
    opt = _tree_sum16(mag * values) / den.clamp_min(1.0)
    return _clamped_scale(opt / g, den > 0)


def _codes_from_bits(bits: Tensor) -> Tensor:
    return bits.to(torch.uint8).view(_E4M3).to(torch.float32)


def _search_chunk(blocks: Tensor, g: Tensor, local: str) -> _Candidate:
    """Best block scales for ``blocks`` [n, 16] FP32 under global scale ``g`` (0-d FP32)."""
    mag = blocks.abs()
    table = _e2m1_table(blocks.device)
    amax = mag.amax(dim=1)
    maxima = (6.0,) if local == "nvidia" else (4.0, 6.0)
    seeds = [_evaluate(mag, _clamped_scale(amax / (g * m), amax > 0), g, table) for m in maxima]
    # The contract starts from error +inf; taking the first seed outright differs only when its
    # SSE overflows FP32 (|x| > ~1e19), where "+inf < +inf" would leave the block at zero.
    best = seeds[0]
    for seed in seeds[1:]:
        best = _better(best, seed)
    if local in ("nvidia", "four_six"):
        return best
    if local == "exhaustive":
        for value in _E4M3_POSITIVE:
            best = _better(best, _evaluate(mag, torch.full_like(amax, value), g, table))
        return best
    for seed in seeds:
        scale = _least_squares_scale(mag, seed.index, g, table)
        best = _better(best, _evaluate(mag, scale, g, table))
    scale = _least_squares_scale(mag, best.index, g, table)
    best = _better(best, _evaluate(mag, scale, g, table))
    if local == "least_squares":
        return best
    center = best.scale.to(_E4M3).view(torch.uint8).to(torch.int16)
    radius = NVFP4_E4M3_SEARCH_RADIUS
    for offset in range(-radius, radius + 1):
        bits = (center + offset).clamp(_E4M3_FIRST_CODE, _E4M3_LAST_CODE)
        best = _better(best, _evaluate(mag, _codes_from_bits(bits), g, table))
    return best


def _validated_global_scale(global_scale: Any, device: torch.device, *, where: str) -> Tensor:
    g = torch.as_tensor(global_scale, dtype=torch.float32, device=device).reshape(())
    if not bool(torch.isfinite(g)) or not bool(g > 0):
        raise ValueError(f"{where}: global_scale must be positive and finite, got {g.item()!r}")
    return g


def _blocks_of(x: Tensor, *, where: str) -> Tensor:
    if not x.is_floating_point():
        raise TypeError(f"{where}: x must be a floating-point tensor, got dtype {x.dtype}")
    if x.ndim == 0 or x.shape[-1] % NVFP4_BLOCK:
        raise ValueError(
            f"{where}: the last axis (K) must be divisible by {NVFP4_BLOCK}, got shape "
            f"{tuple(x.shape)}"
        )
    x32 = x.to(torch.float32)
    if x32.numel() and not bool(torch.isfinite(x32).all()):
        raise ValueError(f"{where}: x contains NaN or infinity; finite values are required")
    return x32.reshape(-1, NVFP4_BLOCK)


def _resolve_global_scale(x: Tensor, global_scale: Any, recipe: str, *, where: str) -> Tensor:
    if global_scale is None:
        amax = x.abs().amax().to(torch.float32) if x.numel() else torch.zeros((), device=x.device)
        grid = x.dtype if x.dtype in _GRID_DTYPES else None
        return nvfp4_global_scale(amax, grid_dtype=grid, recipe=recipe)
    return _validated_global_scale(global_scale, x.device, where=where)


def _search(blocks: Tensor, g: Tensor, recipe: str) -> _Candidate:
    local = nvfp4_kernel_recipe(recipe)
    if blocks.shape[0] == 0:
        empty = blocks.new_zeros((0,))
        return _Candidate(empty, blocks.new_zeros((0, NVFP4_BLOCK), dtype=torch.uint8), empty)
    parts = [_search_chunk(chunk, g, local) for chunk in blocks.split(_SEARCH_CHUNK_BLOCKS, dim=0)]
    return _Candidate(*(torch.cat(field) for field in zip(*parts, strict=True)))


def _codes_of(blocks: Tensor, index: Tensor) -> Tensor:
    return index | ((blocks < 0).to(torch.uint8) << 3)


def _decoded(blocks: Tensor, best: _Candidate, g: Tensor) -> Tensor:
    """``(e2m1 value * block scale) * g`` with the input's signs (exact value × scale product)."""
    values = _e2m1_table(blocks.device)[best.index.long()].copysign(blocks)
    return (values * best.scale[:, None]) * g


def nvfp4_block_scales(
    x: Float[Tensor, "*b k"],
    global_scale: Float[Tensor, ""] | float | None = None,
    recipe: str = "least_squares",
) -> NVFP4Blocks:
    """Search the E4M3 scale of every 16-value block and encode ``x`` as E2M1 codes.

    Per block ``v`` with global scale ``g``, in SPEC §4's order: evaluate the seeds (maxima
    ``(6,)`` for ``nvidia``, ``(4, 6)`` otherwise), then for ``least_squares*`` the closed-form
    least-squares scale of each seed's values and of the best's, then for ``least_squares_grid``
    the 17 E4M3 codes around the best; ``exhaustive`` scans all 126 positive E4M3 scales. A
    candidate replaces the best only when its SSE is strictly lower.

    Args:
      x: ``(*b, k)`` floating input, ``k % 16 == 0``; blocks are 16 consecutive elements of K.
      global_scale: FP32 global scale (finite, > 0); ``None`` derives it dynamically with
        :func:`nvfp4_global_scale` from ``max|x|`` on ``x.dtype``'s grid (as the runtime does).
      recipe: ``nvidia``, ``nvidia_headroom``, ``four_six``, ``least_squares``,
        ``least_squares_headroom``, ``least_squares_grid``, ``exhaustive`` or a legacy alias.

    Returns:
      ``NVFP4Blocks(codes, block_scales, global_scale)``; all-zero blocks get scale 1.

    Raises:
      ValueError: ``k % 16``, non-finite ``x``, a bad global scale or recipe.
      TypeError: a non-floating ``x``.

    Numerics: IEEE FP32 division and products; E2M1 nearest with ties to the even code; scales
    E4M3 nearest-even of a value clamped to ``[2**-9, 448]``; SSE in the fixed pairwise order.

    Example:
      >>> b = nvfp4_block_scales(torch.arange(16.0)[None], 1.0, "nvidia")
      >>> b.block_scales.float().tolist(), b.codes[0, :4].tolist()
      ([[2.5]], [0, 1, 2, 2])
    """
    where = "nvfp4_block_scales"
    recipe = normalize_nvfp4_recipe(recipe)
    blocks = _blocks_of(x, where=where)
    g = _resolve_global_scale(x, global_scale, recipe, where=where)
    best = _search(blocks, g, recipe)
    lead = tuple(x.shape[:-1])
    k = x.shape[-1]
    return NVFP4Blocks(
        codes=_codes_of(blocks, best.index).reshape(*lead, k),
        block_scales=best.scale.to(_E4M3).reshape(*lead, k // NVFP4_BLOCK),
        global_scale=g,
    )


def nvfp4_block_sse(
    x: Float[Tensor, "*b k"],
    block_scales: Float8e4m3fn[Tensor, "*b nblocks"],
    global_scale: Float[Tensor, ""] | float,
) -> Float32[Tensor, "*b nblocks"]:
    """The scale search's objective: each block's SSE under the given E4M3 scales.

    ``sum((e2m1_round(v / e) * e - v)**2)`` with ``e = float(block_scale) * global_scale``,
    summed in the fixed pairwise order, exactly as the recipes compare candidates. Use it to
    compare recipes block by block or to score scales from another quantizer.

    Raises:
      ValueError: as :func:`nvfp4_block_scales`, or ``block_scales`` not shaped ``(*b, k/16)``.

    Numerics: IEEE FP32 throughout (the same bits the search compares).

    Example:
      >>> x = torch.full((1, 16), 3.0)
      >>> nvfp4_block_sse(x, torch.tensor([[0.5]]).to(torch.float8_e4m3fn), 1.0).tolist()
      [[0.0]]
    """
    where = "nvfp4_block_sse"
    blocks = _blocks_of(x, where=where)
    k = x.shape[-1]
    if tuple(block_scales.shape) != (*x.shape[:-1], k // NVFP4_BLOCK):
        raise ValueError(
            f"{where}: block_scales shape {tuple(block_scales.shape)} does not match x of shape "
            f"{tuple(x.shape)} (expected (*b, k/16))"
        )
    g = _validated_global_scale(global_scale, x.device, where=where)
    scale = block_scales.to(torch.float32).reshape(-1)
    err = _evaluate(blocks.abs(), scale, g, _e2m1_table(x.device)).err
    return err.reshape(block_scales.shape)


def nvfp4_quantize(
    x: Float[Tensor, "*b k"],
    global_scale: Float[Tensor, ""] | float | None = None,
    recipe: str = "least_squares",
) -> NVFP4Packed:
    """:func:`nvfp4_block_scales` with the codes packed two per byte (even element low nibble).

    Numerics: as :func:`nvfp4_block_scales`; packing is exact.

    Example:
      >>> q = nvfp4_quantize(torch.full((1, 16), 3.0), 1.0)
      >>> q.packed.shape, q.block_scales.float().item(), q.global_scale.item()
      (torch.Size([1, 8]), 0.75, 1.0)
    """
    blocks = nvfp4_block_scales(x, global_scale, recipe)
    return NVFP4Packed(pack_e2m1(blocks.codes), blocks.block_scales, blocks.global_scale)


def nvfp4_dequantize(
    packed: Shaped[Tensor, "*b half"],
    block_scales: Float8e4m3fn[Tensor, "*b nblocks"],
    global_scale: Float[Tensor, ""] | float,
    *,
    dtype: torch.dtype = torch.float32,
) -> Float[Tensor, "*b k"]:
    """Decode packed NVFP4: ``(e2m1(code) * float(block_scale)) * global_scale`` → ``dtype``.

    Raises:
      ValueError: ``block_scales`` not ``(*b, k/16)`` for the unpacked ``k``, or a bad global scale.

    Numerics: ``e2m1 * block_scale`` is exact in FP32; one FP32 rounding for the global scale,
    then one nearest-even rounding into ``dtype``.

    Example:
      >>> q = nvfp4_quantize(torch.full((1, 16), 3.0), 1.0)
      >>> nvfp4_dequantize(*q)[0, :2].tolist()
      [3.0, 3.0]
    """
    codes = unpack_e2m1(packed)
    k = codes.shape[-1]
    if k % NVFP4_BLOCK or tuple(block_scales.shape) != (*codes.shape[:-1], k // NVFP4_BLOCK):
        raise ValueError(
            f"nvfp4_dequantize: block_scales shape {tuple(block_scales.shape)} does not match "
            f"codes of shape {tuple(codes.shape)} (expected (*b, k/16))"
        )
    if block_scales.dtype != _E4M3:
        raise TypeError(
            f"nvfp4_dequantize: block_scales must be float8_e4m3fn, got {block_scales.dtype}"
        )
    g = _validated_global_scale(global_scale, codes.device, where="nvfp4_dequantize")
    values = e2m1_decode(codes).reshape(*codes.shape[:-1], k // NVFP4_BLOCK, NVFP4_BLOCK)
    local = block_scales.to(torch.float32)[..., None]
    return ((values * local) * g).reshape(codes.shape).to(dtype)


def nvfp4_block_qdq(
    x: Float[Tensor, "*b k"],
    global_scale: Float[Tensor, ""] | float | None = None,
    recipe: str = "least_squares",
) -> Float[Tensor, "*b k"]:
    """Quantize-dequantize through NVFP4 (the replay oracle): ``x``'s shape and dtype back.

    Empty input is returned unchanged; ``global_scale=None`` derives it dynamically.

    Raises:
      ValueError: ``k % 16``, non-finite ``x``, a global scale that is not positive and finite.

    Numerics: as :func:`nvfp4_block_scales`; output ``(value * block_scale) * global_scale`` in
    FP32, rounded once to ``x.dtype``.

    Example:
      >>> nvfp4_block_qdq(torch.tensor([[1.0] * 15 + [6.0]]), 1.0).tolist()[0][-2:]
      [1.0, 6.0]
    """
    if x.numel() == 0:
        return x
    where = "nvfp4_block_qdq"
    recipe = normalize_nvfp4_recipe(recipe)
    blocks = _blocks_of(x, where=where)
    g = _resolve_global_scale(x, global_scale, recipe, where=where)
    return _decoded(blocks, _search(blocks, g, recipe), g).reshape(x.shape).to(x.dtype)


# ----------------------------------------------------------------------------------------------
# SWIZZLE_32_4_4
# ----------------------------------------------------------------------------------------------


def _ceil_to(n: int, m: int) -> int:
    return -(-n // m) * m


def _swizzle_2d(scales: Tensor) -> Tensor:
    rows, cols = scales.shape
    rp, cp = _ceil_to(rows, _SWIZZLE_ROWS), _ceil_to(cols, _SWIZZLE_COLS)
    padded = torch.zeros((rp, cp), dtype=scales.dtype, device=scales.device)
    padded[:rows, :cols] = scales
    # offset(r, c) = ((r//128)·(cp/4) + c//4)·512 + (r%32)·16 + ((r%128)//32)·4 + c%4
    tiles = padded.reshape(rp // 128, 4, 32, cp // 4, 4).permute(0, 3, 2, 1, 4)
    return tiles.reshape(-1)


def _unswizzle_2d(flat: Tensor, rows: int, cols: int) -> Tensor:
    rp, cp = _ceil_to(rows, _SWIZZLE_ROWS), _ceil_to(cols, _SWIZZLE_COLS)
    tiles = flat.reshape(rp // 128, cp // 4, 32, 4, 4).permute(0, 3, 2, 1, 4)
    return tiles.reshape(rp, cp)[:rows, :cols]


def swizzle_scales(
    scales: Shaped[Tensor, "rows cols"], *, per_group: bool = False
) -> Shaped[Tensor, "..."]:
    """Lay block scales out as ``SWIZZLE_32_4_4`` (the tensor-core scale layout), zero-padded.

    ``per_group=False``: the whole ``(rows, cols)`` matrix, rows padded to 128 and columns to 4,
    flattened as ``offset(r, c) = ((r//128)·(Cp/4) + c//4)·512 + (r%32)·16 + ((r%128)//32)·4 +
    c%4``. ``per_group=True``: the activation layout, each 128-column group (8 block columns)
    swizzled on its own, giving ``(cols/8, padded_rows·8)``.

    Raises:
      ValueError: ``per_group`` with ``cols % 8``. Numerics: a permutation; padding holds 0.

    Example:
      >>> s = swizzle_scales(torch.arange(8.0).reshape(1, 8), per_group=True)
      >>> s.shape, s[0, :5].tolist()
      (torch.Size([1, 1024]), [0.0, 1.0, 2.0, 3.0, 0.0])
    """
    if not per_group:
        return _swizzle_2d(scales)
    rows, cols = scales.shape
    if cols % _GROUP_BLOCKS:
        raise ValueError(
            f"swizzle_scales: per_group needs the block columns to be a multiple of "
            f"{_GROUP_BLOCKS} (K % 128 == 0), got {cols}"
        )
    groups = [_swizzle_2d(g) for g in scales.split(_GROUP_BLOCKS, dim=1)]
    if not groups:
        return scales.new_zeros((0, _ceil_to(rows, _SWIZZLE_ROWS) * _GROUP_BLOCKS))
    return torch.stack(groups)


def unswizzle_scales(
    swizzled: Shaped[Tensor, "..."], *, rows: int, cols: int, per_group: bool = False
) -> Shaped[Tensor, "rows cols"]:
    """Inverse of :func:`swizzle_scales`: the ``(rows, cols)`` matrix without its padding.

    Raises:
      ValueError: a swizzled size that does not match ``rows``/``cols``.

    Numerics: a permutation.

    Example:
      >>> s = torch.arange(21.0).reshape(3, 7)
      >>> torch.equal(unswizzle_scales(swizzle_scales(s), rows=3, cols=7), s)
      True
    """
    rp = _ceil_to(rows, _SWIZZLE_ROWS)
    if not per_group:
        expected: tuple[int, ...] = (rp * _ceil_to(cols, _SWIZZLE_COLS),)
        if tuple(swizzled.shape) != expected:
            raise ValueError(
                f"unswizzle_scales: expected shape {expected} for rows={rows}, cols={cols}, got "
                f"{tuple(swizzled.shape)}"
            )
        return _unswizzle_2d(swizzled, rows, cols)
    expected = (cols // _GROUP_BLOCKS, rp * _GROUP_BLOCKS)
    if cols % _GROUP_BLOCKS or tuple(swizzled.shape) != expected:
        raise ValueError(
            f"unswizzle_scales: expected shape {expected} for rows={rows}, cols={cols} "
            f"(per_group), got {tuple(swizzled.shape)}"
        )
    parts = [_unswizzle_2d(g, rows, _GROUP_BLOCKS) for g in swizzled]
    if not parts:
        return swizzled.new_zeros((rows, 0))
    return torch.cat(parts, dim=1)


# ----------------------------------------------------------------------------------------------
# Headroom calibration
# ----------------------------------------------------------------------------------------------

_RHO_LIMIT = FP8_E4M3_MAX / 2.0**-6  # 28672: the E4M3 normal dynamic range


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class HeadroomConfig:
    """Settings of the NVIDIA percentile headroom calibration (validated).

    Numerics: names and numbers only.
    """

    anchor_percentile: float | int = 1.0
    upper_percentile: float | int = 99.99
    rho: float | int = 16384.0
    num_bins: int = 512
    log2_min: float | int = -40.0
    log2_max: float | int = 40.0

    def __post_init__(self) -> None:
        for name in ("anchor_percentile", "upper_percentile"):
            p = getattr(self, name)
            if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0 < p <= 100:
                raise ValueError(f"{name} must be in (0, 100], got {p!r}")
        if isinstance(self.rho, bool) or not isinstance(self.rho, (int, float)):
            raise ValueError(f"rho must be a number in (0, {_RHO_LIMIT:g}), got {self.rho!r}")
        if not 0 < self.rho < _RHO_LIMIT:
            raise ValueError(f"rho must be in (0, {_RHO_LIMIT:g}), got {self.rho!r}")
        if (
            isinstance(self.num_bins, bool)
            or not isinstance(self.num_bins, int)
            or self.num_bins < 1
        ):
            raise ValueError(f"num_bins must be a positive int, got {self.num_bins!r}")
        if not (math.isfinite(self.log2_min) and math.isfinite(self.log2_max)) or not (
            self.log2_min < self.log2_max
        ):
            raise ValueError(
                f"log2_min < log2_max (both finite) is required, got {self.log2_min!r}, "
                f"{self.log2_max!r}"
            )


class HeadroomState(NamedTuple):
    """Running statistics of :func:`headroom_update`: fixed size, no activations retained."""

    config: HeadroomConfig
    counts: Tensor
    """Int64 ``(num_bins,)`` log2 histogram of nonzero 16-value block maxima."""
    running_max: Tensor
    """FP32 scalar: the largest block maximum seen (0 before any data)."""


def headroom_init(config: HeadroomConfig | None = None) -> HeadroomState:
    """An empty headroom state (``config`` defaults to :class:`HeadroomConfig`'s defaults).

    Numerics: zero counts, running max 0.
    """
    config = config if config is not None else HeadroomConfig()
    return HeadroomState(
        config,
        torch.zeros(config.num_bins, dtype=torch.int64),
        torch.zeros((), dtype=torch.float32),
    )


def _bin_index(log2_value: Tensor, config: HeadroomConfig) -> Tensor:
    span = config.log2_max - config.log2_min
    idx = torch.floor((log2_value - config.log2_min) / span * config.num_bins)
    return idx.clamp(0, config.num_bins - 1).to(torch.int64)


def headroom_update(state: HeadroomState, x: Float[Tensor, "*b k"]) -> HeadroomState:
    """Fold a batch of activations into the headroom statistics (a new state; inputs untouched).

    Block maxima of ``|x|`` over 16 consecutive elements (FP32) update the running max, and the
    nonzero ones are counted into ``num_bins`` log2 bins
    ``floor((log2 m − log2_min) / (log2_max − log2_min) · num_bins)`` clamped to the range.

    Raises:
      ValueError: ``k % 16`` or non-finite ``x``. Empty ``x`` returns ``state`` unchanged.

    Numerics: exact maxima; FP32 log2 for binning; int64 counts.
    """
    if x.numel() == 0:
        return state
    blocks = _blocks_of(x, where="headroom_update")
    block_max = blocks.abs().amax(dim=1)
    config = state.config
    nonzero = block_max[block_max > 0]
    counts = state.counts.to(block_max.device)
    if nonzero.numel():
        counts = counts + torch.bincount(
            _bin_index(torch.log2(nonzero), config), minlength=config.num_bins
        )
    running = torch.maximum(state.running_max.to(block_max.device), block_max.max())
    return HeadroomState(config, counts, running)


def headroom_percentile(
    state: HeadroomState, p: float | int, *, floor: float | int | None = None
) -> float | None:
    """The ``p``-th percentile of the observed nonzero block maxima, as a log2-bin centre.

    Bins below ``floor``'s bin are ignored when ``floor > 0``; ``None`` when no counts remain.
    The index is the first bin whose cumulative count reaches ``p/100 · total``.

    Numerics: bin centres ``2 ** (log2_min + (index + 0.5) / num_bins · span)`` in float64.
    """
    if not 0 < p <= 100:
        raise ValueError(f"headroom_percentile: p must be in (0, 100], got {p!r}")
    config = state.config
    counts = state.counts.detach().to("cpu", copy=True)
    if floor is not None and floor > 0:
        cut = int(_bin_index(torch.log2(torch.tensor(floor, dtype=torch.float32)), config))
        counts[:cut] = 0
    total = int(counts.sum())
    if total == 0:
        return None
    target = p / 100.0 * total
    cumulative = torch.cumsum(counts, 0).to(torch.float64)
    index = int(torch.searchsorted(cumulative, torch.tensor([target], dtype=torch.float64)))
    index = min(max(index, 0), config.num_bins - 1)
    span = config.log2_max - config.log2_min
    return 2.0 ** (config.log2_min + (index + 0.5) / config.num_bins * span)


def headroom_amax(state: HeadroomState) -> Float32[Tensor, ""]:
    """The calibrated activation maximum: ``max(rho · P_anchor, P_upper)`` of the block maxima.

    ``upper`` is the running max when ``upper_percentile >= 100``, else that percentile (a
    log-bin centre); ``anchor`` is the ``anchor_percentile`` percentile of the blocks no more than
    1e6× below ``upper``. If either is undefined or zero the running max is returned; otherwise
    ``rho · anchor``, or ``upper`` with a warning when that gives no headroom.

    Raises:
      ValueError: no nonzero block has been observed.

    Numerics: percentiles are bin centres computed in float64; the result is rounded to FP32.
    """
    running = float(state.running_max)
    if int(state.counts.sum()) == 0 or running <= 0:
        raise ValueError(
            "headroom_amax: the headroom calibration observed no nonzero activation blocks"
        )
    config = state.config
    upper = (
        running
        if config.upper_percentile >= 100
        else headroom_percentile(state, config.upper_percentile)
    )
    anchor = headroom_percentile(
        state, config.anchor_percentile, floor=upper / 1e6 if upper else None
    )
    if not upper or not anchor:
        return torch.tensor(running, dtype=torch.float32)
    amax = config.rho * anchor
    if amax <= upper:
        warnings.warn(
            f"NVFP4 headroom: rho * anchor = {amax:.6g} <= upper = {upper:.6g}; the calibration "
            f"gives no requested activation headroom, using the upper percentile",
            UserWarning,
            stacklevel=2,
        )
        amax = upper
    return torch.tensor(amax, dtype=torch.float32)


class NVFP4ActivationHeadroom:
    """NVIDIA's percentile headroom calibration for an NVFP4 activation global scale.

    Holds a :class:`HeadroomState`; :meth:`collect` and :meth:`compute_amax` call the pure
    :func:`headroom_update` and :func:`headroom_amax`. The global scale is then
    ``nvfp4_global_scale(amax, recipe=...)`` (divisor 6 for the headroom recipes).

    Numerics: as the pure functions.

    Example:
      >>> h = NVFP4ActivationHeadroom()
      >>> h.collect(torch.linspace(0.01, 1.0, 1024).reshape(4, 256))
      >>> round(float(h.compute_amax()), 3) > 1.0
      True
    """

    def __init__(
        self,
        anchor_percentile: float | int = 1.0,
        upper_percentile: float | int = 99.99,
        rho: float | int = 16384.0,
        num_bins: int = 512,
        log2_min: float | int = -40.0,
        log2_max: float | int = 40.0,
    ) -> None:
        config = HeadroomConfig(
            anchor_percentile=anchor_percentile,
            upper_percentile=upper_percentile,
            rho=rho,
            num_bins=num_bins,
            log2_min=log2_min,
            log2_max=log2_max,
        )
        self.state = headroom_init(config)

    @property
    def config(self) -> HeadroomConfig:
        """The validated settings."""
        return self.state.config

    def collect(self, x: Float[Tensor, "*b k"]) -> None:
        """Fold a batch of activations into the statistics."""
        self.state = headroom_update(self.state, x)

    def compute_amax(self) -> Float32[Tensor, ""]:
        """The calibrated maximum (see :func:`headroom_amax`)."""
        return headroom_amax(self.state)


# ----------------------------------------------------------------------------------------------
# Recipe report
# ----------------------------------------------------------------------------------------------


class RecipeRow(NamedTuple):
    """One recipe's quality on one tensor (see :func:`recipes_report`)."""

    recipe: str
    global_scale: float
    sse: float
    """Sum over blocks of the search's block SSE (float64 accumulation)."""
    rel_mse: float
    """``mean((qdq(x) - x)**2) / mean(x**2)`` of the decoded output."""
    optimal_share: float
    """Share of blocks whose SSE equals the ``exhaustive`` optimum under the same global scale."""
    seconds: float
    """Wall time of the search (informational)."""


class RecipesReport(NamedTuple):
    """Per-recipe quality of NVFP4 quantization of one tensor."""

    rows: tuple[RecipeRow, ...]
    blocks: int
    shape: tuple[int, ...]


DEFAULT_REPORT_RECIPES: tuple[str, ...] = (
    "nvidia",
    "four_six",
    "least_squares",
    "least_squares_grid",
    "exhaustive",
)


def recipes_report(
    x: Float[Tensor, "*b k"],
    *,
    global_scale: Float[Tensor, ""] | float | None = None,
    recipes: Sequence[str] = DEFAULT_REPORT_RECIPES,
) -> RecipesReport:
    """Measure each NVFP4 recipe against the exact optimum (``exhaustive``) on ``x``.

    With ``global_scale=None`` each recipe gets its own dynamic global scale (divisor 6 for
    ``nvidia``, 4 otherwise, on ``x``'s dtype grid), and its optimal share is measured against the
    exhaustive search under that same scale.

    Numerics: as :func:`nvfp4_block_scales`; sums and MSE accumulated in float64.

    Example:
      >>> r = recipes_report(torch.randn(4, 64, generator=torch.Generator().manual_seed(0)))
      >>> [row.recipe for row in r.rows][:2], r.rows[-1].optimal_share
      (['nvidia', 'four_six'], 1.0)
    """
    names = [normalize_nvfp4_recipe(r) for r in recipes]
    blocks = _blocks_of(x, where="recipes_report")
    x64 = blocks.double()
    power = float(x64.pow(2).mean()) if x64.numel() else 0.0
    optimum: dict[float, Tensor] = {}
    rows = []
    for name in names:
        g = _resolve_global_scale(x, global_scale, name, where="recipes_report")
        start = time.perf_counter()
        best = _search(blocks, g, name)
        seconds = time.perf_counter() - start
        key = float(g)
        if key not in optimum:
            optimum[key] = (
                best.err if name == "exhaustive" else _search(blocks, g, "exhaustive").err
            )
        out = _decoded(blocks, best, g).double()
        mse = float((out - x64).pow(2).mean()) if x64.numel() else 0.0
        share = float((best.err <= optimum[key]).double().mean()) if blocks.shape[0] else 1.0
        rows.append(
            RecipeRow(
                recipe=name,
                global_scale=key,
                sse=float(best.err.double().sum()),
                rel_mse=mse / power if power > 0 else 0.0,
                optimal_share=share,
                seconds=seconds,
            )
        )
    return RecipesReport(tuple(rows), int(blocks.shape[0]), tuple(x.shape))
