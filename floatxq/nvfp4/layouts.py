"""NVFP4 weights as each producer stores them, converted to and from one canonical record.

Every producer stores the same three things (:mod:`~floatxq.nvfp4.quantize`): E2M1 codes two
per byte, one E4M3 scale per 16 values of K, and one FP32 tensor scale. They differ in nibble
order, in the layout of the block scales and in the direction of the tensor scale:

=================== ============== =================== =========================================
producer            even element   block scales        tensor scale
=================== ============== =================== =========================================
ModelOpt            low nibble     linear ``[N, K/16]`` ``weight_scale_2``: multiplies
compressed-tensors  low nibble     linear ``[N, K/16]`` ``weight_global_scale`` ``[1]``: divides
torchao             low nibble     linear or 128x4     ``per_tensor_scale``: multiplies (or none)
Comfy               high nibble    128x4 swizzled      ``weight_scale_2``: multiplies
=================== ============== =================== =========================================

:class:`NVFP4Weight` is the canonical record (the ModelOpt layout: low nibble first, linear block
scales, a tensor scale that multiplies); ``nvfp4_from_*`` read a producer's tensors into it and
``nvfp4_to_*`` write it back out. Every reader checks dtypes and shapes, rejects block scales that
are NaN or negative and tensor scales that are not finite and positive, naming the tensor. The
only conversion that rounds is compressed-tensors' reciprocal tensor scale.
"""

from typing import NamedTuple

import torch

from floatxq._checks import require_e4m3_scales, require_tensor
from floatxq._typing import Float8e4m3fn, Float32, Shaped, Tensor, UInt8, checked_record
from floatxq.formats import (
    FLOAT32_TINY,
    MODEL_DTYPES,
    NVFP4_BLOCK,
    SWIZZLE_TILE_COLS,
    SWIZZLE_TILE_ROWS,
)
from floatxq.fp8 import fp32_reciprocal
from floatxq.nvfp4.quantize import nvfp4_dequantize
from floatxq.nvfp4.swizzle import unswizzle_scales

__all__ = [
    "NVFP4Weight",
    "nvfp4_dequantize_weight",
    "nvfp4_from_comfy",
    "nvfp4_from_compressed_tensors",
    "nvfp4_from_modelopt",
    "nvfp4_from_torchao",
    "nvfp4_to_compressed_tensors",
    "nvfp4_to_modelopt",
    "swap_nibbles",
]

_E4M3 = torch.float8_e4m3fn
_SCALE_DTYPES = MODEL_DTYPES  # each widens to FP32 exactly
_TILE_ROWS, _TILE_COLS = SWIZZLE_TILE_ROWS, SWIZZLE_TILE_COLS


@checked_record
class NVFP4Weight(NamedTuple):
    """An NVFP4 weight ``[out, in]`` in the canonical (ModelOpt) layout.

    Decode: ``e2m1(code) * float32(block_scale) * global_scale``, exactly
    :func:`floatxq.nvfp4_dequantize`.
    """

    packed: UInt8[Tensor, "out half"]
    """Two E2M1 codes per byte (``half = in / 2``), the even element in the low nibble."""
    block_scales: Float8e4m3fn[Tensor, "out half//8"]
    """One E4M3 scale per 16 elements of a row, row-major (not swizzled): multiply to decode."""
    global_scale: Float32[Tensor, ""]
    """The tensor scale: multiply to decode."""

    @property
    def shape(self) -> tuple[int, int]:
        """The decoded weight's ``(out_features, in_features)``."""
        return (self.packed.shape[0], 2 * self.packed.shape[1])


# ----------------------------------------------------------------------------------------------
# Validation shared by the readers
# ----------------------------------------------------------------------------------------------


def _packed_bytes(packed: Tensor, *, name: str, where: str) -> Tensor:
    """``packed`` as a 2-D uint8 tensor (``float4_e2m1fn_x2`` is viewed, never converted)."""
    require_tensor(packed, name=name, where=where)
    if packed.dtype == getattr(torch, "float4_e2m1fn_x2", None):
        packed = packed.view(torch.uint8)
    if packed.dtype != torch.uint8:
        raise TypeError(
            f"{where}: {name} must be uint8 or float4_e2m1fn_x2 (two E2M1 codes per byte), "
            f"got {packed.dtype}"
        )
    if packed.ndim != 2:
        raise ValueError(f"{where}: {name} must be 2-D (out, in/2), got {tuple(packed.shape)}")
    if packed.shape[1] % (NVFP4_BLOCK // 2):
        raise ValueError(
            f"{where}: {name} has {packed.shape[1]} bytes per row, i.e. in_features = "
            f"{2 * packed.shape[1]}, which is not a multiple of {NVFP4_BLOCK}"
        )
    return packed.contiguous()


def _e4m3_bytes(scales: Tensor, *, name: str, where: str) -> Tensor:
    """``scales`` as ``float8_e4m3fn`` (uint8 bytes are viewed, never converted)."""
    require_tensor(scales, name=name, where=where)
    if scales.dtype == torch.uint8:
        scales = scales.view(_E4M3)
    if scales.dtype != _E4M3:
        raise TypeError(
            f"{where}: {name} must be float8_e4m3fn (or its uint8 bytes), got {scales.dtype}"
        )
    return scales


def _linear_block_scales(scales: Tensor, rows: int, cols: int, *, name: str, where: str) -> Tensor:
    """Row-major ``(rows, cols)`` E4M3 scales, given as that matrix or flattened."""
    scales = _e4m3_bytes(scales, name=name, where=where)
    if tuple(scales.shape) not in ((rows, cols), (rows * cols,)):
        raise ValueError(
            f"{where}: {name} must have shape {(rows, cols)} (one scale per 16 values of each "
            f"row; flattened also accepted), got {tuple(scales.shape)}"
        )
    scales = scales.reshape(rows, cols).contiguous()
    require_e4m3_scales(scales, name=name, where=where)
    return scales


def _swizzled_block_scales(
    scales: Tensor, rows: int, cols: int, *, name: str, where: str
) -> Tensor:
    """Unswizzle 128x4-tiled E4M3 scales of a ``(rows, cols)`` matrix, given in any shape."""
    scales = _e4m3_bytes(scales, name=name, where=where)
    padded = -(-rows // _TILE_ROWS) * _TILE_ROWS * (-(-cols // _TILE_COLS) * _TILE_COLS)
    if scales.numel() != padded:
        raise ValueError(
            f"{where}: {name} holds {scales.numel()} scales (shape {tuple(scales.shape)}), but "
            f"the 128x4-swizzled scales of a {rows}x{cols} grid are {padded} (rows padded to "
            f"128, columns to 4)"
        )
    flat = scales.contiguous().reshape(-1)
    linear = unswizzle_scales(flat.view(torch.uint8), rows=rows, cols=cols).contiguous()
    linear = linear.view(_E4M3)
    require_e4m3_scales(linear, name=name, where=where)
    return linear


def _tensor_scale(value: Tensor, device: torch.device, *, name: str, where: str) -> Tensor:
    """A one-element fp32/fp16/bf16 tensor as a 0-d FP32 tensor on ``device`` (exact)."""
    require_tensor(value, name=name, where=where)
    if value.dtype not in _SCALE_DTYPES:
        raise TypeError(
            f"{where}: {name} must be a float32, float16 or bfloat16 tensor, got {value.dtype}"
        )
    if value.numel() != 1:
        raise ValueError(
            f"{where}: {name} must hold one value (shape () or (1,)), got shape "
            f"{tuple(value.shape)}"
        )
    g = value.detach().to(device=device, dtype=torch.float32).reshape(())
    _require_positive_finite(g, name=name, where=where)
    return g


def _require_positive_finite(g: Tensor, *, name: str, where: str) -> None:
    if not bool(torch.isfinite(g)) or not bool(g > 0):
        raise ValueError(f"{where}: {name} must be finite and > 0, got {g.item()!r}")


def _reciprocal(g: Tensor, *, name: str, where: str) -> Tensor:
    """``1 / g`` in FP32 (one IEEE division), refused unless the result is a normal number."""
    r = fp32_reciprocal(g)
    if not bool(torch.isfinite(r)) or not bool(r >= FLOAT32_TINY):
        raise ValueError(
            f"{where}: the reciprocal of {name} = {g.item()!r} is {r.item()!r}, outside FP32's "
            f"normal range; the tensor scale cannot be converted"
        )
    return r


def _logical_shape(shape: tuple[int, int], *, where: str) -> tuple[int, int]:
    if (
        not isinstance(shape, (tuple, list))
        or len(shape) != 2
        or any(isinstance(s, bool) or not isinstance(s, int) or s < 0 for s in shape)
    ):
        raise ValueError(f"{where}: shape must be (out_features, in_features), got {shape!r}")
    out_features, in_features = shape
    if in_features % NVFP4_BLOCK:
        raise ValueError(f"{where}: in_features = {in_features} is not a multiple of {NVFP4_BLOCK}")
    return out_features, in_features


def _packed_of_shape(packed: Tensor, shape: tuple[int, int], *, name: str, where: str) -> Tensor:
    out_features, in_features = _logical_shape(shape, where=where)
    packed = _packed_bytes(packed, name=name, where=where)
    if tuple(packed.shape) != (out_features, in_features // 2):
        raise ValueError(
            f"{where}: {name} must have shape {(out_features, in_features // 2)} for a weight "
            f"of shape {(out_features, in_features)}, got {tuple(packed.shape)}"
        )
    return packed


# ----------------------------------------------------------------------------------------------
# Readers
# ----------------------------------------------------------------------------------------------


def nvfp4_from_modelopt(
    weight: Shaped[Tensor, "out half"],
    weight_scale: Shaped[Tensor, "..."],
    weight_scale_2: Shaped[Tensor, "..."],
) -> NVFP4Weight:
    """Read ModelOpt's NVFP4 tensors (the canonical layout: nothing moves).

    Args:
      weight: uint8 ``[out, in/2]`` (or ``float4_e2m1fn_x2``), even element in the low nibble.
      weight_scale: float8_e4m3fn ``[out, in/16]`` (or uint8 bytes), row-major.
      weight_scale_2: one FP32/FP16/BF16 value that multiplies to decode.

    Raises:
      TypeError: a tensor of another dtype.
      ValueError: shapes that disagree, ``in % 16``, NaN or negative block scales, a
        ``weight_scale_2`` that is not finite and > 0.

    Numerics: exact; the bytes are unchanged (``weight_scale_2`` widened to FP32 exactly).

    Example:
      >>> w = nvfp4_from_modelopt(
      ...     torch.full((1, 8), 0x21, dtype=torch.uint8),
      ...     torch.full((1, 1), 2.0).to(torch.float8_e4m3fn),
      ...     torch.tensor(0.5),
      ... )
      >>> nvfp4_dequantize_weight(w)[0, :2].tolist()
      [0.5, 1.0]
    """
    where = "nvfp4_from_modelopt"
    packed = _packed_bytes(weight, name="weight", where=where)
    rows, half = packed.shape
    scales = _linear_block_scales(weight_scale, rows, half // 8, name="weight_scale", where=where)
    g = _tensor_scale(weight_scale_2, packed.device, name="weight_scale_2", where=where)
    return NVFP4Weight(packed, scales.to(packed.device), g)


def nvfp4_from_compressed_tensors(
    weight_packed: Shaped[Tensor, "out half"],
    weight_scale: Shaped[Tensor, "..."],
    weight_global_scale: Shaped[Tensor, "..."],
) -> NVFP4Weight:
    """Read compressed-tensors' ``nvfp4-pack-quantized`` tensors.

    compressed-tensors decodes ``e2m1 * (float32(weight_scale) / weight_global_scale)``: its
    tensor scale divides. The record's ``global_scale`` is ``1 / weight_global_scale``.

    Args:
      weight_packed: uint8 ``[out, in/2]``, even element in the low nibble.
      weight_scale: float8_e4m3fn ``[out, in/16]`` (or uint8 bytes), row-major.
      weight_global_scale: one FP32/FP16/BF16 value (shape ``[1]``) that divides to decode.

    Raises:
      TypeError, ValueError: as :func:`nvfp4_from_modelopt`; also a ``weight_global_scale``
        whose reciprocal is not a normal FP32 number.

    Numerics: codes and block scales exact; ``global_scale = fl32(1 / weight_global_scale)``, one
    IEEE division: relative error at most ``2**-24`` (half an FP32 ulp), none when
    ``weight_global_scale`` is a power of two. A decoded value is then within ``2**-23``
    relative of the exact ``e2m1 * scale / weight_global_scale`` (outside FP32 underflow).

    Example:
      >>> w = nvfp4_from_compressed_tensors(
      ...     torch.full((1, 8), 0x21, dtype=torch.uint8),
      ...     torch.full((1, 1), 2.0).to(torch.float8_e4m3fn),
      ...     torch.tensor([4.0]),
      ... )
      >>> w.global_scale.item()
      0.25
    """
    where = "nvfp4_from_compressed_tensors"
    packed = _packed_bytes(weight_packed, name="weight_packed", where=where)
    rows, half = packed.shape
    scales = _linear_block_scales(weight_scale, rows, half // 8, name="weight_scale", where=where)
    divisor = _tensor_scale(
        weight_global_scale, packed.device, name="weight_global_scale", where=where
    )
    g = _reciprocal(divisor, name="weight_global_scale", where=where)
    return NVFP4Weight(packed, scales.to(packed.device), g)


def nvfp4_from_torchao(
    qdata: Shaped[Tensor, "out half"],
    scale: Shaped[Tensor, "..."],
    per_tensor_scale: Shaped[Tensor, "..."] | None,
    *,
    shape: tuple[int, int],
    is_swizzled_scales: bool,
) -> NVFP4Weight:
    """Read the tensors of a torchao ``NVFP4Tensor`` (``qdata``, ``_scale_e4m3``,
    ``_per_tensor_scale``) holding a weight of ``shape``.

    torchao packs low nibble first; its scales are ``[out, in/16]`` row-major, or with
    ``is_swizzled_scales`` the 128x4-tiled layout (stored flat, or viewed 2-D by newer releases:
    only the element order matters); ``per_tensor_scale`` multiplies, and ``None`` means 1.

    Args:
      qdata: uint8 (or ``float4_e2m1fn_x2``) ``[out, in/2]``; ``shape``: ``(out, in)``.
      scale: float8_e4m3fn (or uint8) block scales as described above.
      per_tensor_scale: one FP32/FP16/BF16 value, or ``None``.
      is_swizzled_scales: whether ``scale`` is 128x4-swizzled.

    Raises:
      TypeError, ValueError: as :func:`nvfp4_from_modelopt`, and a ``shape`` that ``qdata`` or
        ``scale`` do not fit.

    Numerics: exact (a permutation of the scales). torchao's own ``to_dtype`` rounds
    ``per_tensor_scale * block_scale`` to the original dtype before multiplying; the record
    decodes in FP32 and rounds once, so the two can differ by that rounding.

    Example:
      >>> scales = torch.ones(512).to(torch.float8_e4m3fn)
      >>> w = nvfp4_from_torchao(torch.zeros(2, 8, dtype=torch.uint8), scales, None,
      ...                        shape=(2, 16), is_swizzled_scales=True)  # fmt: skip
      >>> w.block_scales.shape, w.global_scale.item()
      (torch.Size([2, 1]), 1.0)
    """
    where = "nvfp4_from_torchao"
    packed = _packed_of_shape(qdata, shape, name="qdata", where=where)
    rows, cols = packed.shape[0], packed.shape[1] // 8
    read = _swizzled_block_scales if is_swizzled_scales else _linear_block_scales
    scales = read(scale, rows, cols, name="scale", where=where)
    if per_tensor_scale is None:
        g = torch.ones((), dtype=torch.float32, device=packed.device)
    else:
        g = _tensor_scale(per_tensor_scale, packed.device, name="per_tensor_scale", where=where)
    return NVFP4Weight(packed, scales.to(packed.device), g)


def nvfp4_from_comfy(
    weight: Shaped[Tensor, "out half"],
    weight_scale: Shaped[Tensor, "..."],
    weight_scale_2: Shaped[Tensor, "..."],
    *,
    shape: tuple[int, int],
) -> NVFP4Weight:
    """Read a Comfy (``comfy_quant`` ``{"format": "nvfp4"}``) NVFP4 weight of ``shape``.

    Comfy packs the even element in the HIGH nibble (the nibbles are swapped here) and stores
    the block scales 128x4-swizzled (any shape holding that element order, usually the padded
    ``[ceil(out/128)·128, ceil(in/64)·4]``); ``weight_scale_2`` multiplies.

    Args:
      weight: uint8 ``[out, in/2]``, even element in the high nibble.
      weight_scale: float8_e4m3fn (or uint8) swizzled block scales.
      weight_scale_2: one FP32/FP16/BF16 value that multiplies to decode.
      shape: the weight's ``(out_features, in_features)``.

    Raises:
      TypeError, ValueError: as :func:`nvfp4_from_torchao`.

    Numerics: exact (nibble swap and scale permutation).

    Example:
      >>> w = nvfp4_from_comfy(
      ...     torch.full((1, 8), 0x12, dtype=torch.uint8),
      ...     torch.ones(512).to(torch.float8_e4m3fn),
      ...     torch.tensor(1.0),
      ...     shape=(1, 16),
      ... )
      >>> hex(w.packed[0, 0].item()), nvfp4_dequantize_weight(w)[0, :2].tolist()
      ('0x21', [0.5, 1.0])
    """
    where = "nvfp4_from_comfy"
    packed = _packed_of_shape(weight, shape, name="weight", where=where)
    rows, cols = packed.shape[0], packed.shape[1] // 8
    scales = _swizzled_block_scales(weight_scale, rows, cols, name="weight_scale", where=where)
    g = _tensor_scale(weight_scale_2, packed.device, name="weight_scale_2", where=where)
    return NVFP4Weight(swap_nibbles(packed), scales.to(packed.device), g)


def swap_nibbles(packed: Shaped[Tensor, "*shape"]) -> UInt8[Tensor, "*shape"]:
    """Exchange the two 4-bit halves of every byte (low-nibble-first <-> high-nibble-first).

    Raises:
      TypeError: ``packed`` that is not uint8 or ``float4_e2m1fn_x2``.

    Numerics: exact bit permutation; its own inverse. Returns a new uint8 tensor.

    Example:
      >>> swap_nibbles(torch.tensor([0x12, 0xF0], dtype=torch.uint8)).tolist()
      [33, 15]
    """
    where = "swap_nibbles"
    require_tensor(packed, name="packed", where=where)
    if packed.dtype == getattr(torch, "float4_e2m1fn_x2", None):
        packed = packed.view(torch.uint8)
    if packed.dtype != torch.uint8:
        raise TypeError(f"{where}: packed must be uint8 or float4_e2m1fn_x2, got {packed.dtype}")
    return (packed << 4) | (packed >> 4)


# ----------------------------------------------------------------------------------------------
# Writers and decode
# ----------------------------------------------------------------------------------------------


def _checked(w: NVFP4Weight, *, where: str) -> NVFP4Weight:
    """Re-validate a record (records built by ``_replace`` or in production are unchecked)."""
    if not isinstance(w, NVFP4Weight):
        raise TypeError(f"{where}: w must be an NVFP4Weight, got {type(w).__name__}")
    packed = _packed_bytes(w.packed, name="w.packed", where=where)
    rows, half = packed.shape
    scales = _linear_block_scales(
        w.block_scales, rows, half // 8, name="w.block_scales", where=where
    )
    g = _tensor_scale(w.global_scale, packed.device, name="w.global_scale", where=where)
    return NVFP4Weight(packed, scales, g)


def nvfp4_to_modelopt(w: NVFP4Weight) -> dict[str, Tensor]:
    """The record as ModelOpt's tensors: ``weight``, ``weight_scale``, ``weight_scale_2``.

    ``weight_scale_2`` is a 0-d FP32 tensor. Reading them back with :func:`nvfp4_from_modelopt`
    gives the same bytes.

    Raises:
      TypeError, ValueError: a record whose fields have other dtypes or shapes, NaN or negative
        block scales, a global scale that is not finite and > 0.

    Numerics: exact (the tensors themselves, made contiguous).

    Example:
      >>> w = NVFP4Weight(torch.zeros(1, 8, dtype=torch.uint8),
      ...                 torch.ones(1, 1).to(torch.float8_e4m3fn), torch.tensor(2.0))
      >>> sorted(nvfp4_to_modelopt(w))
      ['weight', 'weight_scale', 'weight_scale_2']
    """
    w = _checked(w, where="nvfp4_to_modelopt")
    return {"weight": w.packed, "weight_scale": w.block_scales, "weight_scale_2": w.global_scale}


def nvfp4_to_compressed_tensors(w: NVFP4Weight) -> dict[str, Tensor]:
    """The record as compressed-tensors' tensors: ``weight_packed``, ``weight_scale``,
    ``weight_global_scale`` (FP32 ``[1]``, ``1 / global_scale``: it divides to decode).

    Raises:
      TypeError, ValueError: as :func:`nvfp4_to_modelopt`, and a global scale whose reciprocal
        is not a normal FP32 number.

    Numerics: codes and scales exact; one IEEE FP32 division for ``weight_global_scale``
    (relative error at most ``2**-24``, exact for powers of two). Reading the result back with
    :func:`nvfp4_from_compressed_tensors` returns ``global_scale`` within one FP32 ulp
    (relative ``2**-23``), exactly when it is a power of two.

    Example:
      >>> w = NVFP4Weight(torch.zeros(1, 8, dtype=torch.uint8),
      ...                 torch.ones(1, 1).to(torch.float8_e4m3fn), torch.tensor(0.25))
      >>> nvfp4_to_compressed_tensors(w)["weight_global_scale"].tolist()
      [4.0]
    """
    where = "nvfp4_to_compressed_tensors"
    w = _checked(w, where=where)
    divisor = _reciprocal(w.global_scale, name="w.global_scale", where=where).reshape(1)
    return {
        "weight_packed": w.packed,
        "weight_scale": w.block_scales,
        "weight_global_scale": divisor,
    }


def nvfp4_dequantize_weight(
    w: NVFP4Weight, *, dtype: torch.dtype = torch.float32
) -> Shaped[Tensor, "out in"]:
    """Decode the record: ``(e2m1(code) * float32(block_scale)) * global_scale`` -> ``dtype``.

    Raises:
      TypeError, ValueError: as :func:`floatxq.nvfp4_dequantize`.

    Numerics: exactly :func:`floatxq.nvfp4_dequantize` (the code-scale product is exact
    in FP32, one rounding for the global scale, one into ``dtype``).

    Example:
      >>> w = NVFP4Weight(torch.full((1, 8), 0x75, dtype=torch.uint8),
      ...                 torch.ones(1, 1).to(torch.float8_e4m3fn), torch.tensor(0.5))
      >>> nvfp4_dequantize_weight(w, dtype=torch.bfloat16)[0, :2].tolist()
      [1.5, 3.0]
    """
    return nvfp4_dequantize(w.packed, w.block_scales, w.global_scale, dtype=dtype)
