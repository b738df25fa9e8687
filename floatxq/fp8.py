"""FP8 weights with inverse scales, FP8 per-token activations, and FP8/E8M0 decoding.

Scale directions, never mixed:
  * ``scale_inv`` (weights): multiply to quantize, divide to decode: ``w ≈ code / scale_inv``.
  * ``scale`` (tokens, E8M0): multiply to decode: ``x ≈ code * scale``.

All scale arithmetic is FP32 IEEE (true division, never a reciprocal-multiply); rounding to FP8 is
round-to-nearest-even after clamping to ±max finite (finite saturation). ``docs/numerics.md``
states the whole contract (scale directions, rounding, saturation, special values).
"""

from collections.abc import Mapping
from typing import Literal, NamedTuple

import torch

from floatxq._checks import (
    fp8_scale_shape,
    require_data,
    require_finite,
    require_floating,
    require_fp8,
    require_positive_finite,
    require_tensor,
    to_float32,
)
from floatxq._typing import Float, Float8e4m3fn, Float32, FP8Dtype, Shaped, Tensor, checked_record
from floatxq.formats import (
    FLOAT32_MAX,
    FLOAT32_SMALLEST_SUBNORMAL,
    FLOAT32_TINY,
    FP8_E4M3_MAX,
    K_GROUP,
    FP8Format,
    FP8ScaleMethod,
    fp8_max,
    normalize_fp8_block_size,
    normalize_fp8_scale_method,
    normalize_fp8_weight_format,
)

__all__ = [
    "FP8_SCALED_RECIPES",
    "FP8Tokens",
    "FP8Weight",
    "decode_e8m0",
    "dequantize_fp8_weight",
    "dequantize_fp8_weight_transposed",
    "direct_to_inverse_scale",
    "fp8_cast",
    "fp8_decode",
    "fp8_scaled_linear",
    "fp8_token_dequantize",
    "fp8_token_qdq",
    "fp8_token_quantize",
    "infer_scale_layout",
    "quantize_fp8_weight",
]


@checked_record
class FP8Weight(NamedTuple):
    """An FP8 weight: codes of the weight's shape and FP32 inverse scales (decode: divide)."""

    qweight: FP8Dtype[Tensor, "out in"]
    """FP8 codes, ``(out, in)``."""
    scale_inv: Float32[Tensor, "*scale"]
    """FP32 inverse scales: ``()`` (tensor), ``(out,)`` (row) or ``(out/br, in/bc)`` (block)."""


@checked_record
class FP8Tokens(NamedTuple):
    """Per-token E4M3 activations: codes and one FP32 direct scale per row (decode: multiply)."""

    codes: Float8e4m3fn[Tensor, "*b k"]
    """``float8_e4m3fn`` codes of the input's shape."""
    scale: Float32[Tensor, "*b 1"]
    """FP32 direct scales, the input's shape with the last axis reduced to 1."""


# ----------------------------------------------------------------------------------------------
# Element casts
# ----------------------------------------------------------------------------------------------


def _saturating_cast(x32: Tensor, dtype: torch.dtype, fmax: float) -> Tensor:
    return torch.clamp(x32, min=-fmax, max=fmax).to(dtype)


def fp8_cast(
    x: Float[Tensor, "*shape"], *, format: str | torch.dtype = "float8_e4m3fn"
) -> FP8Dtype[Tensor, "*shape"]:
    """Round values to an FP8 format: ``clamp(float32(x), ±max)`` then a nearest-even cast.

    Args:
      x: any floating tensor (converted to FP32 first, which is exact for bf16/fp16).
      format: an encodable FP8 name or alias in any case, or its ``torch.dtype`` (E8M0 is
        rejected: ``ValueError``).

    Returns:
      FP8 codes of ``x``'s shape, dtype ``fp8_dtype(format)``.

    Numerics: round-to-nearest-even; finite saturation (±inf → ±max); NaN stays NaN; −0 stays −0
    where the format has it (the ``fnuz`` formats map it to +0).

    Example:
      >>> fp8_cast(torch.tensor([464.0, 1e9])).float().tolist()
      [448.0, 448.0]
    """
    name = normalize_fp8_weight_format(format, where="fp8_cast: format")
    require_floating(x, name="x", where="fp8_cast")
    require_data(x, name="x", where="fp8_cast")
    return _saturating_cast(x.to(torch.float32), getattr(torch, name), fp8_max(name))


def fp8_decode(
    codes: FP8Dtype[Tensor, "*shape"], *, dtype: torch.dtype = torch.float32
) -> Float[Tensor, "*shape"]:
    """Decode FP8 codes of any FP8 dtype (E8M0 included) to ``dtype``.

    Raises:
      TypeError: ``codes`` that are not an FP8 tensor (``uint8`` bytes must be viewed as their
        FP8 dtype first: integers are not bit patterns), or a meta tensor.

    Numerics: exact into FP32 (every FP8 value is an FP32 value); one nearest-even rounding into a
    narrower ``dtype``. NaN codes decode to NaN; E8M0 follows :func:`decode_e8m0`.

    Example:
      >>> fp8_decode(torch.tensor([0x7E], dtype=torch.uint8).view(torch.float8_e4m3fn)).tolist()
      [448.0]
    """
    require_fp8(codes, name="codes", where="fp8_decode")
    require_data(codes, name="codes", where="fp8_decode")
    if codes.dtype == getattr(torch, "float8_e8m0fnu", None):
        return decode_e8m0(codes).to(dtype)
    return codes.to(torch.float32).to(dtype)


# ----------------------------------------------------------------------------------------------
# Weights
# ----------------------------------------------------------------------------------------------


def _inverse_scale(amax: Tensor, fmax: float) -> Tensor:
    """``fmax / max(amax, FLT_MIN)`` in FP32 (true division) capped at FLT_MAX; 1 if amax is 0."""
    inv = torch.full_like(amax, fmax) / amax.clamp_min(FLOAT32_TINY)
    # GPT-QModel lets this overflow to inf for amax < fmax / FLT_MAX and then writes NaN codes
    # (0 * inf). Capping keeps every inverse scale finite; all other bytes are GPT-QModel's.
    inv = inv.clamp_max(FLOAT32_MAX)
    return torch.where(amax > 0, inv, torch.ones_like(amax))


def _amax(x: Tensor, dim: tuple[int, ...] | None) -> Tensor:
    """``max |x|`` over ``dim`` (all axes when None); an empty reduction gives 0."""
    if dim is None:
        return x.abs().amax() if x.numel() else x.new_zeros(())
    if all(x.shape[d] > 0 for d in dim):
        return x.abs().amax(dim=dim)
    shape = [s for d, s in enumerate(x.shape) if d not in dim]
    return x.new_zeros(shape)


def _weight_arguments(
    weight: object,
    *,
    format: object,
    weight_scale_method: object,
    weight_block_size: object,
    where: str,
) -> tuple[FP8Format, FP8ScaleMethod, tuple[int, int] | None]:
    """Validate a weight-quantization call: ``(format name, scale method, block size)``.

    Shared by the pure function and its kernel twin so both reject bad input the same way; the
    arguments are typed ``object`` because this is where unchecked user input is validated.
    """
    require_floating(weight, name="weight", where=where)
    require_data(weight, name="weight", where=where)
    if weight.ndim != 2:
        raise ValueError(
            f"{where}: weight must be a 2-D (out, in) matrix, got shape {tuple(weight.shape)}"
        )
    name = normalize_fp8_weight_format(format, where=f"{where}: format")
    block = normalize_fp8_block_size(weight_block_size)
    method = normalize_fp8_scale_method(weight_scale_method, weight_block_size=block)
    return name, method, block


def quantize_fp8_weight(
    weight: Float[Tensor, "out in"],
    *,
    format: str | torch.dtype = "float8_e4m3fn",
    weight_scale_method: FP8ScaleMethod | None = "row",
    weight_block_size: tuple[int, int] | list[int] | None = None,
) -> FP8Weight:
    """Quantize a weight matrix to FP8 codes with FP32 inverse scales.

    Per region (the whole tensor, each output row, or each ``[br, bc]`` block; block rows index
    output rows): ``scale_inv = fp8_max / max(amax, FLT_MIN)`` (1 for an all-zero region, capped
    at FLT_MAX so it is always finite) and ``qweight = cast(clamp(w * scale_inv, ±fp8_max))``.

    Args:
      weight: ``(out, in)`` floating weight (any device; converted to FP32, device kept).
      format: FP8 name/alias in any case, or its ``torch.dtype``; ``float8_e8m0fnu`` is
        decode-only (``ValueError``).
      weight_scale_method: ``"tensor"``, ``"row"`` or ``"block"`` (``None``: by block size).
      weight_block_size: ``[block_rows, block_cols]`` for ``"block"``; must divide the shape.

    Returns:
      ``FP8Weight(qweight, scale_inv)``; scale shapes ``()``, ``(out,)``, ``(out/br, in/bc)``.

    Raises:
      ValueError: rank ≠ 2, non-finite weights (or float64 ones beyond FP32's range),
        indivisible shape, E8M0, bad names.
      TypeError: a non-floating weight, or a meta tensor.

    Numerics: FP32 scale math (true division), multiply-to-quantize, clamp then nearest-even
    cast; bit-identical to GPT-QModel's FP8 weights except that tiny-amax regions keep finite
    scales (``docs/numerics.md``).

    Example:
      >>> q = quantize_fp8_weight(torch.tensor([[1.0, -2.0], [0.0, 0.0]]))
      >>> q.scale_inv.tolist(), q.qweight.float().tolist()
      ([224.0, 1.0], [[224.0, -448.0], [0.0, 0.0]])
    """
    where = "quantize_fp8_weight"
    name, method, block = _weight_arguments(
        weight,
        format=format,
        weight_scale_method=weight_scale_method,
        weight_block_size=weight_block_size,
        where=where,
    )
    dtype, fmax = getattr(torch, name), fp8_max(name)
    w = to_float32(weight, name="weight", where=where)
    require_finite(w, name="weight", where=where)

    if method == "tensor":
        scale_inv = _inverse_scale(_amax(w, None), fmax)
        return FP8Weight(_saturating_cast(w * scale_inv, dtype, fmax), scale_inv)
    if method == "row":
        scale_inv = _inverse_scale(_amax(w, (1,)), fmax)
        return FP8Weight(_saturating_cast(w * scale_inv[:, None], dtype, fmax), scale_inv)

    rows, cols = w.shape
    br, bc = block  # type: ignore[misc]  # "block" always carries a block size
    if rows % br or cols % bc:
        raise ValueError(
            f"{where}: weight shape {tuple(w.shape)} is not divisible by weight_block_size "
            f"{[br, bc]} (block rows index output rows); floatxq never pads"
        )
    blocks = w.reshape(rows // br, br, cols // bc, bc)
    scale_inv = _inverse_scale(_amax(blocks, (1, 3)), fmax)
    codes = _saturating_cast(blocks * scale_inv[:, None, :, None], dtype, fmax)
    return FP8Weight(codes.reshape(rows, cols), scale_inv)


def _expand_scale_inv(
    scale_inv: Tensor, shape: torch.Size, layout: tuple[FP8ScaleMethod, tuple[int, int] | None]
) -> Tensor:
    """Broadcast a tensor/row/block inverse scale over an ``(out, in)`` weight.

    A block grid given flattened (1-D, as :func:`infer_scale_layout` accepts it) is read
    row-major, as ``TorchFP8Linear.from_quantized`` reads it.
    """
    method, block = layout
    if method == "tensor":
        return scale_inv.reshape(())
    if method == "row":
        return scale_inv[:, None]
    br, bc = block  # type: ignore[misc]  # "block" always carries a block size
    rows, cols = shape
    grid = scale_inv.reshape(rows // br, cols // bc)
    return grid.repeat_interleave(br, dim=0).repeat_interleave(bc, dim=1)


def _decoded_weight(qweight: object, scale_inv: object, *, where: str) -> Tensor:
    """``float32(code) / scale_inv`` over an ``(out, in)`` weight, in FP32, after the checks
    the encoder's output passes: FP8 codes, a scale layout that fits, finite positive scales."""
    require_fp8(qweight, name="qweight", where=where)
    require_floating(scale_inv, name="scale_inv", where=where)
    require_data(qweight, name="qweight", where=where)
    require_data(scale_inv, name="scale_inv", where=where)
    if qweight.ndim != 2:
        raise ValueError(f"{where}: qweight must be 2-D (out, in), got {tuple(qweight.shape)}")
    layout = _scale_layout(tuple(qweight.shape), tuple(scale_inv.shape))
    if layout is None:
        raise ValueError(
            f"{where}: scale_inv of shape {tuple(scale_inv.shape)} fits no scale layout of "
            f"qweight of shape {tuple(qweight.shape)}; {_accepted_layouts(qweight.shape[0])}"
        )
    if scale_inv.device != qweight.device:
        raise TypeError(
            f"{where}: scale_inv is on {scale_inv.device} but qweight is on {qweight.device}"
        )
    if torch.compiler.is_compiling():  # the value checks need a host sync; the module checked
        s = scale_inv.to(torch.float32)  # its scales when it was built
    else:
        s = to_float32(scale_inv, name="scale_inv", where=where)
        require_positive_finite(s, name="scale_inv (codes are divided by it)", where=where)
    return fp8_decode(qweight) / _expand_scale_inv(s, qweight.shape, layout)


def _dequantize_stored(qweight: Tensor, scale_inv: Tensor, dtype: torch.dtype) -> Tensor:
    """:func:`dequantize_fp8_weight`'s arithmetic without its value checks (no host sync), for
    modules whose buffers were checked when they were built or loaded. Same bits."""
    layout = _scale_layout(tuple(qweight.shape), tuple(scale_inv.shape))
    if layout is None:
        raise ValueError(
            f"dequantize: scale_inv of shape {tuple(scale_inv.shape)} fits no scale layout of "
            f"qweight of shape {tuple(qweight.shape)}"
        )
    s = scale_inv.to(torch.float32)
    return (fp8_decode(qweight) / _expand_scale_inv(s, qweight.shape, layout)).to(dtype)


def dequantize_fp8_weight(
    qweight: FP8Dtype[Tensor, "out in"],
    scale_inv: Float32[Tensor, "*scale"],
    *,
    dtype: torch.dtype = torch.float32,
) -> Float[Tensor, "out in"]:
    """Decode FP8 weight codes: ``float32(code) / scale_inv`` per region, rounded once to ``dtype``.

    Args:
      qweight: ``(out, in)`` FP8 codes.
      scale_inv: FP32 inverse scales shaped ``()``, ``(out,)`` or a block grid ``(out/br, in/bc)``
        (the layout is inferred with :func:`infer_scale_layout`).
      dtype: output dtype.

    Raises:
      TypeError: ``qweight`` not an FP8 tensor (integers are not bit patterns: view ``uint8``
        bytes as the FP8 dtype), non-floating ``scale_inv``, meta tensors, different devices.
      ValueError: a scale shape no layout explains (both shapes named); a ``scale_inv`` entry
        that is zero, negative, NaN or infinite (or a float64 one beyond FP32's range).

    Numerics: FP32 true division, one nearest-even rounding into ``dtype``; NaN codes give NaN.
    Under ``torch.compile`` the scale values are not checked (that needs a host sync).

    Example:
      >>> q = quantize_fp8_weight(torch.tensor([[1.0, -2.0]]))
      >>> dequantize_fp8_weight(*q).tolist()
      [[1.0, -2.0]]
    """
    return _decoded_weight(qweight, scale_inv, where="dequantize_fp8_weight").to(dtype)


def dequantize_fp8_weight_transposed(
    qweight: FP8Dtype[Tensor, "out in"],
    scale_inv: Float32[Tensor, "*scale"],
    *,
    dtype: torch.dtype = torch.float32,
) -> Float[Tensor, "in out"]:
    """:func:`dequantize_fp8_weight` as the contiguous ``(in, out)`` matrix (``x @ W.T`` operand).

    Args:
      qweight: ``(out, in)`` FP8 codes.
      scale_inv: FP32 inverse scales, any layout :func:`infer_scale_layout` explains.
      dtype: output dtype.

    Raises:
      TypeError, ValueError: as :func:`dequantize_fp8_weight`.

    Numerics: bit-identical to ``dequantize_fp8_weight(...).t().contiguous()``.

    Example:
      >>> q = quantize_fp8_weight(torch.tensor([[1.0, -2.0]]))
      >>> dequantize_fp8_weight_transposed(*q).tolist()
      [[1.0], [-2.0]]
    """
    where = "dequantize_fp8_weight_transposed"
    return _decoded_weight(qweight, scale_inv, where=where).to(dtype).t().contiguous()


def _most_square_blocks(rows: int, cols: int, count: int) -> tuple[int, int] | None:
    best: tuple[tuple[int, int, int, int], tuple[int, int]] | None = None
    for row_blocks in range(1, count + 1):
        if count % row_blocks:
            continue
        col_blocks = count // row_blocks
        if rows % row_blocks or cols % col_blocks:
            continue
        br, bc = rows // row_blocks, cols // col_blocks
        key = (abs(br - bc), -min(br, bc), -max(br, bc), br)
        if best is None or key < best[0]:
            best = (key, (br, bc))
    return None if best is None else best[1]


def infer_scale_layout(
    weight_shape: tuple[int, ...] | torch.Size, scale_shape: tuple[int, ...] | torch.Size
) -> tuple[FP8ScaleMethod, tuple[int, int] | None]:
    """Which layout an inverse-scale tensor has for an ``(out, in)`` weight.

    Rules (GPT-QModel's loader's, in order): one element → ``("tensor", None)``; 1-D of length
    ``out`` → ``("row", None)``; 2-D ``(sr, sc)`` dividing the weight → ``("block", (out/sr,
    in/sc))``; another 1-D length ``n`` → the most square block grid with ``n`` blocks that tiles
    the weight.

    Raises:
      ValueError: a weight that is not 2-D, or a scale shape no layout explains.

    Numerics: shapes only.

    Example: ``infer_scale_layout((256, 512), (2, 4)) == ("block", (128, 128))``.
    """
    weight_shape, scale_shape = tuple(weight_shape), tuple(scale_shape)
    if len(weight_shape) != 2:
        raise ValueError(f"infer_scale_layout: weight_shape must be 2-D, got {weight_shape}")
    layout = _scale_layout(weight_shape, scale_shape)
    if layout is None:
        raise ValueError(
            f"infer_scale_layout: scale shape {scale_shape} fits no layout of a {weight_shape} "
            f"weight; {_accepted_layouts(weight_shape[0])}"
        )
    return layout


def _accepted_layouts(rows: int) -> str:
    return (
        f"accepted: () or (1,) for tensor, ({rows},) for row, (out/br, in/bc) for block "
        f"(or that grid flattened)"
    )


def _scale_layout(
    weight_shape: tuple[int, int], scale_shape: tuple[int, ...]
) -> tuple[FP8ScaleMethod, tuple[int, int] | None] | None:
    """:func:`infer_scale_layout`'s rules for a 2-D weight; None when no layout fits."""
    rows, cols = weight_shape
    count = 1
    for s in scale_shape:
        count *= s
    if count == 1 and len(scale_shape) <= 2:
        return ("tensor", None)
    if len(scale_shape) == 1 and scale_shape[0] == rows:
        return ("row", None)
    if len(scale_shape) == 2:
        sr, sc = scale_shape
        if sr > 0 and sc > 0 and rows % sr == 0 and cols % sc == 0:
            return ("block", (rows // sr, cols // sc))
        if rows == 0 and sr == 0 and sc > 0 and cols % sc == 0:
            return ("block", (1, cols // sc))
    if len(scale_shape) == 1 and count > 0:
        block = _most_square_blocks(rows, cols, count)
        if block is not None:
            return ("block", block)
    return None


def fp32_reciprocal(scale: Float[Tensor, "*shape"]) -> Float32[Tensor, "*shape"]:
    """``fl(1 / scale)`` in FP32: one IEEE division (never a reciprocal-multiply), exact for
    powers of two; the turn between inverse and direct scales, both ways.

    No checks: callers validate ``scale`` (0 gives inf, as IEEE division does).

    Example:
      >>> fp32_reciprocal(torch.tensor([4.0, 3.0])).tolist()
      [0.25, 0.3333333432674408]
    """
    s = scale.to(torch.float32)
    return torch.ones_like(s) / s


def direct_to_inverse_scale(scale: Float[Tensor, "*shape"]) -> Float32[Tensor, "*shape"]:
    """Turn direct scales (multiply to decode) into inverse scales (divide to decode).

    ``scale_inv = 1 / scale`` in FP32 (true division); a zero direct scale maps to ``1/FLT_MIN``
    (≈ 8.5e37), as GPT-QModel's loader does, so its all-zero region still decodes to zeros.

    Raises:
      ValueError: a negative or non-finite direct scale (or a float64 one beyond FP32's range,
        or a positive float64 one that rounds to 0 in FP32), or a positive one below
        ``1/FLT_MAX`` (≈ 2.9e-39) whose inverse overflows FP32 (every ``scale_inv`` floatxq
        holds is finite).
      TypeError: a non-floating or meta tensor.

    Numerics: FP32 IEEE division, no rounding beyond it.

    Example:
      >>> direct_to_inverse_scale(torch.tensor([0.5, 0.0])).tolist()
      [2.0, 8.507059173023462e+37]
    """
    where = "direct_to_inverse_scale"
    require_floating(scale, name="scale", where=where)
    require_data(scale, name="scale", where=where)
    s = to_float32(scale, name="scale", where=where)
    require_finite(s, name="scale", where=where)
    if s.numel() and bool((s < 0).any()):
        raise ValueError("direct_to_inverse_scale: scale has negative entries; scales are >= 0")
    if scale.dtype != torch.float32 and s.numel() and bool(((scale > 0) & (s == 0)).any()):
        lost = scale[(scale > 0) & (s == 0)][:4].tolist()
        raise ValueError(
            f"direct_to_inverse_scale: scale has positive {scale.dtype} entries that round to 0 "
            f"in float32 (below ~7e-46), e.g. {lost}; a zero scale would mean an all-zero region"
        )
    inverse = fp32_reciprocal(s)
    if s.numel() and bool(((s > 0) & torch.isinf(inverse)).any()):
        raise ValueError(
            "direct_to_inverse_scale: scale has positive entries below 1/FLT_MAX (~2.9e-39) whose "
            f"inverse overflows float32, e.g. {s[(s > 0) & torch.isinf(inverse)][:4].tolist()}"
        )
    return torch.where(s == 0, torch.full_like(s, 1.0 / FLOAT32_TINY), inverse)


def decode_e8m0(scale_bytes: Shaped[Tensor, "*shape"]) -> Float32[Tensor, "*shape"]:
    """Decode E8M0 scale bytes: ``2 ** (byte - 127)`` in FP32; byte 255 is NaN.

    Args:
      scale_bytes: ``uint8`` storage or ``float8_e8m0fnu`` (viewed as bytes).

    Raises:
      TypeError: any other dtype, a non-tensor or a meta tensor.

    Numerics: exact (byte 0 gives the FP32 subnormal ``2**-127``); no rounding.

    Example:
      >>> decode_e8m0(torch.tensor([127, 128, 0, 255], dtype=torch.uint8)).tolist()[:3]
      [1.0, 2.0, 5.877471754111438e-39]
    """
    require_tensor(scale_bytes, name="scale_bytes", where="decode_e8m0")
    require_data(scale_bytes, name="scale_bytes", where="decode_e8m0")
    e8m0 = getattr(torch, "float8_e8m0fnu", None)
    if scale_bytes.dtype == e8m0:
        scale_bytes = scale_bytes.view(torch.uint8)
    elif scale_bytes.dtype != torch.uint8:
        raise TypeError(
            f"decode_e8m0: scale_bytes must be uint8 or float8_e8m0fnu, got {scale_bytes.dtype}"
        )
    byte = scale_bytes.to(torch.int32)
    # Biased exponent b >= 1 is the FP32 bit pattern b << 23; b == 0 is the subnormal 2**-127.
    bits = torch.where(byte == 0, torch.full_like(byte, 1 << 22), byte << 23)
    value = bits.view(torch.float32)
    return torch.where(byte == 255, torch.full_like(value, float("nan")), value)


# ----------------------------------------------------------------------------------------------
# Tokens (per-row dynamic E4M3)
# ----------------------------------------------------------------------------------------------


def _token_scale(x32: Tensor) -> Tensor:
    amax = x32.abs().amax(dim=-1, keepdim=True)
    # A tensor divisor, not a Python float: CUDA turns `tensor / scalar` into a multiply by the
    # rounded reciprocal, which is one ulp off IEEE division for some amax.
    scale = amax / torch.full_like(amax, FP8_E4M3_MAX)
    # amax / 448 underflows to 0 only for amax below ~448 * 2**-150: use the smallest positive
    # FP32 instead so the row still round-trips without NaN (x / 0).
    scale = torch.where(scale > 0, scale, torch.full_like(scale, FLOAT32_SMALLEST_SUBNORMAL))
    return torch.where(amax > 0, scale, torch.ones_like(scale))


def fp8_token_quantize(x: Float[Tensor, "*b k"]) -> FP8Tokens:
    """Per-row (last axis) dynamic E4M3 quantization with one FP32 direct scale per row.

    ``scale = amax / 448`` (1 for an all-zero row, the smallest positive FP32 where it underflows)
    and ``codes = e4m3(clamp(x / scale, ±448))``.

    Raises:
      ValueError: NaN or infinity in ``x`` (or float64 values beyond FP32's range).
      TypeError: a non-floating or meta ``x``.

    Numerics: FP32 true division (not a reciprocal), clamp then nearest-even E4M3; finite input
    never yields NaN or inf.

    Example:
      >>> t = fp8_token_quantize(torch.tensor([[1.0, -4.0]]))
      >>> t.scale.tolist(), t.codes.float().tolist()
      ([[0.008928571827709675]], [[112.0, -448.0]])
    """
    where = "fp8_token_quantize"
    require_floating(x, name="x", where=where)
    require_data(x, name="x", where=where)
    if x.ndim == 0:
        raise ValueError(f"{where}: x must have at least one axis (the token axis k)")
    x32 = to_float32(x, name="x", where=where)
    require_finite(x32, name="x", where=where)
    if x32.shape[-1] == 0:
        scale = torch.ones((*x32.shape[:-1], 1), dtype=torch.float32, device=x32.device)
        return FP8Tokens(x32.to(torch.float8_e4m3fn), scale)
    scale = _token_scale(x32)
    codes = _saturating_cast(x32 / scale, torch.float8_e4m3fn, FP8_E4M3_MAX)
    return FP8Tokens(codes, scale)


def fp8_token_dequantize(
    codes: FP8Dtype[Tensor, "*b k"],
    scale: Float32[Tensor, "*b 1"],
    *,
    dtype: torch.dtype = torch.float32,
) -> Float[Tensor, "*b k"]:
    """Invert :func:`fp8_token_quantize`: ``float32(codes) * scale`` rounded once to ``dtype``.

    Args:
      codes: ``(*b, k)`` FP8 codes.
      scale: ``(*b, 1)`` direct scales, one per row of ``codes`` (never broadcast along ``k``).
      dtype: output dtype.

    Raises:
      TypeError: ``codes`` not an FP8 tensor, non-floating ``scale``, meta tensors, different
        devices.
      ValueError: 0-d ``codes``; ``scale`` not shaped ``(*b, 1)``; a ``scale`` entry that is
        zero, negative, NaN or infinite (``fp8_token_quantize`` writes none).

    Numerics: exact FP32 product of an E4M3 value and the scale (then one rounding to ``dtype``).

    Example:
      >>> fp8_token_dequantize(*fp8_token_quantize(torch.tensor([[1.0, -4.0]]))).tolist()
      [[1.0, -4.0]]
    """
    where = "fp8_token_dequantize"
    require_fp8(codes, name="codes", where=where)
    require_floating(scale, name="scale", where=where)
    require_data(codes, name="codes", where=where)
    require_data(scale, name="scale", where=where)
    if codes.ndim == 0:
        raise ValueError(f"{where}: codes must have at least one axis (the token axis k)")
    rows = (*codes.shape[:-1], 1)
    if tuple(scale.shape) != rows:
        raise ValueError(
            f"{where}: scale must have shape {rows} (one scale per row of codes of shape "
            f"{tuple(codes.shape)}), got {tuple(scale.shape)}"
        )
    if scale.device != codes.device:
        raise TypeError(f"{where}: scale is on {scale.device} but codes is on {codes.device}")
    s = to_float32(scale, name="scale", where=where)
    require_positive_finite(s, name="scale", where=where)
    return (fp8_decode(codes) * s).to(dtype)


def fp8_token_qdq(x: Float[Tensor, "*b k"]) -> Float[Tensor, "*b k"]:
    """Quantize-dequantize each last-axis row through E4M3 (the W4A-FP8 replay oracle).

    Returns ``x``'s shape and dtype; empty input is returned unchanged.

    Raises:
      ValueError: NaN or infinity in ``x``.

    Numerics: as :func:`fp8_token_quantize`, then ``float32(code) * scale`` rounded once to
    ``x.dtype``; finite input never yields NaN or inf.

    Example:
      >>> fp8_token_qdq(torch.tensor([[1.0, 0.3]])).tolist()
      [[1.0, 0.2857142984867096]]
    """
    require_floating(x, name="x", where="fp8_token_qdq")
    require_data(x, name="x", where="fp8_token_qdq")
    if x.numel() == 0:
        return x
    tokens = fp8_token_quantize(x)
    return fp8_token_dequantize(tokens.codes, tokens.scale, dtype=x.dtype)


# ----------------------------------------------------------------------------------------------
# The scaled FP8 linear (what the scaled_mm routes and the small-M kernel compute)
# ----------------------------------------------------------------------------------------------

FP8ScaledRecipe = Literal["tensorwise", "rowwise", "blockwise"]
"""A recipe name of :func:`fp8_scaled_linear` (one of :data:`FP8_SCALED_RECIPES`)."""

FP8_SCALED_RECIPES: tuple[FP8ScaledRecipe, ...] = ("tensorwise", "rowwise", "blockwise")
"""How ``x`` is quantized against an FP8 weight in :func:`fp8_scaled_linear`, by weight layout:
tensor scales (``x`` per tensor, in the weight's format), row scales (``x`` per row, E4M3) and
``[128, 128]`` blocks (``x`` per 1×128 block, E4M3)."""

_RECIPE_X: Mapping[str, tuple[FP8ScaleMethod, tuple[int, int] | None]] = {
    "tensorwise": ("tensor", None),
    "rowwise": ("row", None),
    "blockwise": ("block", (1, K_GROUP)),
}
_RECIPE_W: Mapping[str, tuple[FP8ScaleMethod, tuple[int, int] | None]] = {
    "tensorwise": ("tensor", None),
    "rowwise": ("row", None),
    "blockwise": ("block", (K_GROUP, K_GROUP)),
}


def fp8_scaled_linear(
    x: Float[Tensor, "m k"],
    weight: FP8Dtype[Tensor, "n k"],
    weight_scale_inv: Float32[Tensor, "*scale"],
    bias: Float[Tensor, "n"] | None = None,  # noqa: F821
    *,
    recipe: FP8ScaledRecipe,
) -> Float[Tensor, "m n"]:
    """``x @ W.T + bias`` as the FP8 GEMM routes compute it: ``x`` quantized, both operands FP8.

    The pure reference of ``TorchFP8Linear``'s ``scaled_mm`` routes and of the Triton small-M
    kernel. ``x`` is quantized with the weight formula (:func:`quantize_fp8_weight`) per tensor
    in the weight's format, per row in E4M3 or per 1×128 block in E4M3, as the recipe says; then
    ``out[m, n] = Σ_k code_x · code_w · sx · sw + bias[n]`` with the direct scales
    ``sx``, ``sw`` = :func:`fp32_reciprocal` of the inverse ones (blockwise: per 128-wide K block).

    Args:
      x: ``(m, k)`` floating activations (finite).
      weight: ``(n, k)`` FP8 codes (``float8_e4m3fn``; ``float8_e5m2`` for ``rowwise``).
      weight_scale_inv: FP32 inverse scales: ``()``, ``(n,)`` or ``(n/128, k/128)``.
      bias: ``(n,)`` or None; added after it is rounded to ``x.dtype`` (as the routes pass it).
      recipe: one of :data:`FP8_SCALED_RECIPES`.

    Returns ``(m, n)`` in ``x.dtype``.

    Raises:
      ValueError: an unknown recipe, mismatched shapes or scale layout, non-finite ``x``, a
        ``weight_scale_inv`` entry that is zero, negative, NaN or infinite.
      TypeError: ``weight`` not an FP8 dtype the recipe takes, ``x`` not floating, meta tensors.

    Numerics: float64 products and sums, rounded to FP32 then once to ``x.dtype``; a GEMM
    accumulating in FP32 differs only by summation order (``docs/numerics.md``).

    Example:
      >>> q = quantize_fp8_weight(torch.eye(2) * 448, weight_scale_method="tensor")  # scale 1
      >>> fp8_scaled_linear(torch.tensor([[448.0, -0.5]]), *q, recipe="tensorwise").tolist()
      [[200704.0, -224.0]]
    """
    where = "fp8_scaled_linear"
    require_floating(x, name="x", where=where)
    _scaled_linear_arguments(
        x, weight, weight_scale_inv, bias, recipe=recipe, scale_name="weight_scale_inv", where=where
    )
    for name, t in (("x", x), ("weight", weight), ("weight_scale_inv", weight_scale_inv)):
        require_data(t, name=name, where=where)
    require_positive_finite(weight_scale_inv, name="weight_scale_inv", where=where)
    xq = _quantize_x(x, weight, recipe)
    sw = fp32_reciprocal(weight_scale_inv)
    out = _scaled_sum(xq.qweight, weight, fp32_reciprocal(xq.scale_inv), sw, recipe)
    if bias is not None:
        out = out + bias.to(x.dtype).double()
    return out.float().to(x.dtype)


def _scaled_linear_arguments(
    x: Tensor,
    weight: Tensor,
    scale: Tensor,
    bias: Tensor | None,
    *,
    recipe: str,
    scale_name: str,
    where: str,
) -> None:
    """The checks :func:`fp8_scaled_linear` and its Triton twin share (recipe, formats, shapes)."""
    if recipe not in _RECIPE_X:
        raise ValueError(f"{where}: recipe must be one of {FP8_SCALED_RECIPES}, got {recipe!r}")
    if x.ndim != 2 or weight.ndim != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(
            f"{where}: x (m, k) and weight (n, k) must share k, got {tuple(x.shape)} and "
            f"{tuple(weight.shape)}"
        )
    name = str(weight.dtype).removeprefix("torch.")
    allowed = ("float8_e4m3fn", "float8_e5m2") if recipe == "rowwise" else ("float8_e4m3fn",)
    if name not in allowed:
        raise TypeError(
            f"{where}: the {recipe} recipe takes {' or '.join(allowed)} codes, got {name}"
        )
    k, n = x.shape[1], weight.shape[0]
    if recipe == "blockwise" and (n % K_GROUP or k % K_GROUP):
        raise ValueError(f"{where}: blockwise needs n and k divisible by {K_GROUP}, got ({n}, {k})")
    expected = fp8_scale_shape(n, k, *_RECIPE_W[recipe], where=where)
    if tuple(scale.shape) != expected or scale.dtype != torch.float32:
        raise ValueError(
            f"{where}: the {recipe} recipe takes float32 {scale_name} of shape {expected}, got "
            f"{scale.dtype} {tuple(scale.shape)}"
        )
    if bias is not None and tuple(bias.shape) != (n,):
        raise ValueError(f"{where}: bias must have shape ({n},), got {tuple(bias.shape)}")


def _quantize_x(x: Tensor, weight: Tensor, recipe: str) -> FP8Weight:
    """``x``'s codes and inverse scales as the recipe quantizes it (the weight formula)."""
    method, block = _RECIPE_X[recipe]
    x_format = str(weight.dtype).removeprefix("torch.") if recipe == "tensorwise" else None
    return quantize_fp8_weight(
        x, format=x_format or "float8_e4m3fn", weight_scale_method=method, weight_block_size=block
    )


def _scaled_sum(
    x_codes: Tensor, w_codes: Tensor, sx: Tensor, sw: Tensor, recipe: str, *, absolute: bool = False
) -> Tensor:
    """``Σ_k code_x · code_w · sx · sw`` in float64 (``absolute``: of the terms' magnitudes).

    ``sx``/``sw`` are the direct scales in the recipe's layouts; blockwise scales each 128-wide
    K block's partial sum by its own pair.
    """
    cx, cw = x_codes.float().double(), w_codes.float().double()
    sx, sw = sx.double(), sw.double()
    if absolute:
        cx, cw, sx, sw = cx.abs(), cw.abs(), sx.abs(), sw.abs()
    if recipe == "blockwise":
        (m, k), n = cx.shape, cw.shape[0]
        kb, g = k // K_GROUP, K_GROUP
        parts = torch.einsum("mbk,nbk->mnb", cx.reshape(m, kb, g), cw.reshape(n, kb, g))
        return (parts * sx[:, None, :] * sw.repeat_interleave(g, dim=0)[None, :, :]).sum(-1)
    if recipe == "rowwise":
        return (cx @ cw.T) * sx[:, None] * sw[None, :]
    return (cx @ cw.T) * (sx * sw)
