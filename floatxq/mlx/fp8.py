"""FP8 weight encoding with MLX array ops: the same bytes as :func:`floatxq.quantize_fp8_weight`.

The arithmetic is the torch encoder's, step for step, in FP32: ``amax`` per region,
``scale_inv = fp8_max / max(amax, FLT_MIN)`` by true division (capped at FLT_MAX, 1 for an
all-zero region), ``w * scale_inv``, a clamp to ``±fp8_max``. The FP8 byte is then built from
the FP32 bits with integer operations only (sign, exponent, mantissa, FP8 subnormals), rounding
to nearest-even, so no FP8 dtype (which MLX lacks) is needed. Where MLX runs on an Apple GPU,
weights of at least :data:`~floatxq.dispatch.mlx.FP8_ENCODE_MIN_ELEMENTS` elements are
encoded by the Metal kernel ``fp8_encode`` (one fused pass, the same operations per element);
the scales are always computed with array ops. :func:`fp8_encode_route` says which path a
weight takes (the choice is :func:`floatxq.dispatch.mlx_fp8_encode_route`'s).

FP32 subnormal weights are handled as IEEE values: the MLX CPU backend (where this is tested)
computes with them exactly; a backend that flushes subnormals to zero would change such bytes.
"""

from collections.abc import Mapping
from typing import NamedTuple

import mlx.core as mx

from floatxq._typing import Float, Float32, Tensor, UInt8, checked_record
from floatxq.dispatch.mlx import mlx_fp8_encode_route
from floatxq.formats import (
    FLOAT32_MAX,
    FLOAT32_TINY,
    FP8ScaleMethod,
    FP8WeightFormat,
    fp8_dtype,
    fp8_max,
    normalize_fp8_block_size,
    normalize_fp8_scale_method,
    normalize_fp8_weight_format,
)
from floatxq.fp8 import FP8Weight
from floatxq.mlx.kernels import (
    MLX_FLOAT_NAMES,
    fp8_encode_launch,
    metal_available,
    run_metal,
)

__all__ = [
    "MlxFP8Weight",
    "fp8_encode_route",
    "quantize_fp8_weight_mlx",
    "quantize_fp8_weight_torch_via_mlx",
]

_FP8_BITS: Mapping[FP8WeightFormat, tuple[int, int, bool]] = {
    # format: (mantissa bits, exponent bias, has a negative zero); the sign is bit 7 in all four.
    "float8_e4m3fn": (3, 7, True),
    "float8_e5m2": (2, 15, True),
    "float8_e4m3fnuz": (3, 8, False),  # 0x80 is the only NaN, so -0 is stored as +0
    "float8_e5m2fnuz": (2, 16, False),
}


@checked_record
class MlxFP8Weight(NamedTuple):
    """An MLX FP8 weight: byte codes of the weight's shape and FP32 inverse scales (divide)."""

    qweight: UInt8[mx.array, "out in"]
    """FP8 bit patterns as ``mx.uint8``, ``(out, in)`` (the bytes of the torch FP8 codes)."""
    scale_inv: Float32[mx.array, "*scale"]
    """FP32 inverse scales: ``()`` (tensor), ``(out,)`` (row) or ``(out/br, in/bc)`` (block)."""


def _u32(value: int) -> mx.array:
    return mx.array(value, dtype=mx.uint32)


def _encode_fp8(y: mx.array, name: FP8WeightFormat) -> mx.array:
    """FP8 bytes of FP32 values already clamped to ``±fp8_max``: nearest-even, bit by bit."""
    mbits, bias, negative_zero = _FP8_BITS[name]
    bits = mx.view(y, mx.uint32)
    sign = mx.left_shift(mx.right_shift(bits, _u32(31)), _u32(7))
    mag = mx.bitwise_and(bits, _u32(0x7FFFFFFF))
    exp32 = mx.right_shift(mag, _u32(23))

    # Normal FP8 values: drop 23 - mbits mantissa bits with round-half-even (a carry moves into
    # the exponent), then re-bias the exponent from 127 to the format's bias.
    drop = 23 - mbits
    lsb = mx.bitwise_and(mx.right_shift(mag, _u32(drop)), _u32(1))
    rounded = mx.right_shift(mag + _u32((1 << (drop - 1)) - 1) + lsb, _u32(drop))
    normal = rounded - _u32((127 - bias) << mbits)  # wraps for the lanes `where` discards

    # FP8 subnormals: count units of 2**(1 - bias - mbits) in |y| = sig * 2**(e - 150), i.e.
    # sig >> (151 - bias - mbits - e) rounded half-even. Shifts are capped at 25: sig < 2**24,
    # so any larger shift rounds to 0 just as 25 does (FP32 subnormals, e = 0, land there too).
    mant = mx.bitwise_and(mag, _u32(0x7FFFFF))
    is_fp32_normal = exp32 > _u32(0)
    sig = mx.where(is_fp32_normal, mx.bitwise_or(mant, _u32(1 << 23)), mant)
    e_eff = mx.maximum(exp32, _u32(1)).astype(mx.int32)
    shift = mx.clip(151 - bias - mbits - e_eff, 1, 25).astype(mx.uint32)
    half_minus_one = mx.left_shift(_u32(1), shift - _u32(1)) - _u32(1)
    odd = mx.bitwise_and(mx.right_shift(sig, shift), _u32(1))
    subnormal = mx.right_shift(sig + half_minus_one + odd, shift)

    code = mx.where(exp32 >= _u32(128 - bias), normal, subnormal)
    signed = mx.bitwise_or(code, sign)
    if not negative_zero:
        signed = mx.where(code == _u32(0), _u32(0), signed)
    return signed.astype(mx.uint8)


def _inverse_scale(amax: mx.array, fmax: float) -> mx.array:
    """``fmax / max(amax, FLT_MIN)`` in FP32 (true division) capped at FLT_MAX; 1 if amax is 0."""
    f32 = mx.float32
    inv = mx.full(amax.shape, fmax, dtype=f32) / mx.maximum(amax, mx.array(FLOAT32_TINY, f32))
    inv = mx.minimum(inv, mx.array(FLOAT32_MAX, f32))
    return mx.where(amax > mx.array(0.0, f32), inv, mx.array(1.0, f32))


def _quantize(w: mx.array, scale_inv: mx.array, name: FP8WeightFormat) -> mx.array:
    fmax = mx.array(fp8_max(name), dtype=mx.float32)
    return _encode_fp8(mx.clip(w * scale_inv, -fmax, fmax), name)


def fp8_encode_route(weight: Float[mx.array, "out in"]) -> str:
    """Which encoder :func:`quantize_fp8_weight_mlx` uses for ``weight``'s bytes.

    The route of :func:`floatxq.dispatch.mlx_fp8_encode_route` for ``weight``'s size here:
    ``"metal"`` where MLX has its Metal backend and ``weight`` has at least
    ``FP8_ENCODE_MIN_ELEMENTS`` (2**20) elements, else ``"array-ops"``. Both give the same bytes.

    Example:
      >>> fp8_encode_route(mx.zeros((4, 4)))
      'array-ops'
    """
    return mlx_fp8_encode_route(weight.size, metal=metal_available())[0]


def _encode(weight: mx.array, w: mx.array, scale_inv: mx.array, name: FP8WeightFormat) -> mx.array:
    """FP8 bytes of ``weight`` (``w`` its FP32 copy) under region scales in the canonical shape."""
    if fp8_encode_route(weight) == "metal":
        mbits, bias, negative_zero = _FP8_BITS[name]
        plan = fp8_encode_launch(
            weight,
            scale_inv,
            mbits=mbits,
            bias=bias,
            negative_zero=negative_zero,
            fmax=fp8_max(name),
        )
        return run_metal(plan)
    if scale_inv.ndim == 0:
        return _quantize(w, scale_inv, name)
    if scale_inv.ndim == 1:
        return _quantize(w, scale_inv[:, None], name)
    rows, cols = w.shape
    gr, gc = scale_inv.shape
    blocks = w.reshape(gr, rows // gr, gc, cols // gc)
    return _quantize(blocks, scale_inv[:, None, :, None], name).reshape(rows, cols)


def _check_weight(weight: object, *, where: str) -> mx.array:
    if not isinstance(weight, mx.array):
        raise TypeError(
            f"{where}: weight must be an mlx.core.array, got {type(weight).__name__} (convert a "
            f"torch tensor with floatxq.quantize_fp8_weight instead)"
        )
    dtype = str(weight.dtype).removeprefix("mlx.core.")
    if dtype not in MLX_FLOAT_NAMES:
        raise TypeError(
            f"{where}: weight must be an MLX float16, bfloat16 or float32 array, got dtype "
            f"{weight.dtype}"
        )
    if weight.ndim != 2:
        raise ValueError(
            f"{where}: weight must be a 2-D (out, in) matrix, got shape {tuple(weight.shape)}"
        )
    if weight.size == 0:
        raise ValueError(
            f"{where}: weight of shape {tuple(weight.shape)} is empty; a non-empty matrix is "
            f"required"
        )
    return weight


def quantize_fp8_weight_mlx(
    weight: Float[mx.array, "out in"],
    *,
    format: str = "float8_e4m3fn",
    weight_scale_method: FP8ScaleMethod | None = "row",
    weight_block_size: tuple[int, int] | list[int] | None = None,
) -> MlxFP8Weight:
    """Quantize an MLX weight matrix to FP8 byte codes with FP32 inverse scales.

    Per region (the whole tensor, each output row, or each ``[br, bc]`` block; block rows index
    output rows): ``scale_inv = fp8_max / max(amax, FLT_MIN)`` (1 for an all-zero region, capped
    at FLT_MAX) and ``qweight = bytes(nearest_even(clamp(w * scale_inv, ±fp8_max)))``.

    Args:
      weight: non-empty ``(out, in)`` MLX array of float16, bfloat16 or float32, all finite.
      format: an encodable FP8 name or alias in any case (as :func:`floatxq.quantize_fp8_weight`
        takes it); ``float8_e8m0fnu`` is decode-only (``ValueError``).
      weight_scale_method: ``"tensor"``, ``"row"`` or ``"block"`` (``None``: by block size).
      weight_block_size: ``[block_rows, block_cols]`` for ``"block"``; must divide the shape.

    Returns:
      ``MlxFP8Weight(qweight, scale_inv)``: ``mx.uint8`` bit patterns of the format's codes and
      ``mx.float32`` scales shaped ``()``, ``(out,)`` or ``(out/br, in/bc)``.

    Raises:
      TypeError: a weight that is not an MLX array, or not float16/bfloat16/float32.
      ValueError: rank ≠ 2, an empty weight, NaN or infinity, a block size that does not divide
        the shape, E8M0, bad format/method/block names.

    Numerics: FP32 true division, clamp then nearest-even (fnuz stores -0 as +0); bytes and
    scales bit-identical to ``floatxq.quantize_fp8_weight`` on either :func:`fp8_encode_route`.

    Example:
      >>> q = quantize_fp8_weight_mlx(mx.array([[1.0, -2.0], [0.0, 0.0]]))
      >>> q.scale_inv.tolist(), q.qweight.tolist()
      ([224.0, 1.0], [[118, 254], [0, 0]])
    """
    where = "quantize_fp8_weight_mlx"
    _check_weight(weight, where=where)
    name = normalize_fp8_weight_format(format, where=f"{where}: format")
    block = normalize_fp8_block_size(weight_block_size)
    method = normalize_fp8_scale_method(weight_scale_method, weight_block_size=block)
    w = weight.astype(mx.float32)  # exact for float16 and bfloat16
    if not mx.all(mx.isfinite(w)).item():
        raise ValueError(f"{where}: weight contains NaN or infinity; finite values are required")
    fmax = fp8_max(name)

    if method == "tensor":
        scale_inv = _inverse_scale(mx.max(mx.abs(w)), fmax)
        return MlxFP8Weight(_encode(weight, w, scale_inv, name), scale_inv)
    if method == "row":
        scale_inv = _inverse_scale(mx.max(mx.abs(w), axis=1), fmax)
        return MlxFP8Weight(_encode(weight, w, scale_inv, name), scale_inv)

    rows, cols = w.shape
    br, bc = block  # type: ignore[misc]  # "block" always carries a block size
    if rows % br or cols % bc:
        raise ValueError(
            f"{where}: weight shape {(rows, cols)} is not divisible by weight_block_size "
            f"{[br, bc]} (block rows index output rows); floatxq never pads"
        )
    blocks = w.reshape(rows // br, br, cols // bc, bc)
    scale_inv = _inverse_scale(mx.max(mx.abs(blocks), axis=(1, 3)), fmax)
    return MlxFP8Weight(_encode(weight, w, scale_inv, name), scale_inv)


def quantize_fp8_weight_torch_via_mlx(
    weight: Float[Tensor, "out in"],
    *,
    format: str = "float8_e4m3fn",
    weight_scale_method: FP8ScaleMethod | None = "row",
    weight_block_size: tuple[int, int] | list[int] | None = None,
) -> FP8Weight:
    """:func:`floatxq.quantize_fp8_weight` for a torch weight, encoded by MLX.

    The weight is copied to MLX exactly (through FP32), encoded by
    :func:`quantize_fp8_weight_mlx` and copied back: a :class:`floatxq.FP8Weight` of contiguous
    CPU torch FP8 codes and FP32 inverse scales. ``quantize_fp8_weight_auto`` takes this route
    for very large weights on Apple Silicon, where MLX's Metal encoder beats torch on the CPU.

    Args:
      weight: a non-empty 2-D float16/bfloat16/float32 torch tensor (any device).
      format, weight_scale_method, weight_block_size: as ``quantize_fp8_weight``.

    Returns:
      ``FP8Weight(qweight, scale_inv)`` on the CPU.

    Raises:
      TypeError, ValueError: as :func:`quantize_fp8_weight_mlx`.

    Numerics: bit-identical to ``quantize_fp8_weight`` on the same values.

    Example:
      >>> import torch
      >>> q = quantize_fp8_weight_torch_via_mlx(torch.tensor([[1.0, -2.0]]))
      >>> q.qweight.dtype, q.scale_inv.tolist()
      (torch.float8_e4m3fn, [224.0])
    """
    import numpy as np
    import torch

    floats = {torch.float32: mx.float32, torch.float16: mx.float16, torch.bfloat16: mx.bfloat16}
    if not isinstance(weight, torch.Tensor) or weight.dtype not in floats:
        got = weight.dtype if isinstance(weight, torch.Tensor) else type(weight).__name__
        raise TypeError(
            f"quantize_fp8_weight_torch_via_mlx: weight must be a float16, bfloat16 or float32 "
            f"torch tensor, got {got}"
        )
    name = normalize_fp8_weight_format(format, where="quantize_fp8_weight_torch_via_mlx: format")
    values = weight.detach().cpu().to(torch.float32).contiguous().numpy()
    w = mx.array(values).astype(floats[weight.dtype])  # exact: the values came from it
    q = quantize_fp8_weight_mlx(
        w,
        format=name,
        weight_scale_method=weight_scale_method,
        weight_block_size=weight_block_size,
    )
    codes = torch.from_numpy(np.array(q.qweight, copy=True)).view(fp8_dtype(name))
    scales = torch.from_numpy(np.array(q.scale_inv, copy=True).reshape(q.scale_inv.shape))
    return FP8Weight(codes.contiguous(), scales)
