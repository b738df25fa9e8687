"""E2M1, the 4-bit element format of NVFP4: rounding, the exact code maps and nibble packing.

A code is ``sign << 3 | index``, ``index`` pointing into :data:`~floatxq.formats.E2M1_VALUES`
(``0, 0.5, 1, 1.5, 2, 3, 4, 6``); code 8 is ``-0.0``. Two codes share a byte, the even element
(lower index along the last axis) in the low nibble. The block scales and the scale search that
put real tensors on this grid live in :mod:`floatxq.nvfp4.quantize`; ``docs/numerics.md`` states the
contract.
"""

import torch

from floatxq._checks import require_range, require_tensor
from floatxq._typing import Float, Float32, Shaped, Tensor, UInt8
from floatxq.formats import E2M1_VALUES

__all__ = ["e2m1_decode", "e2m1_encode", "e2m1_round", "pack_e2m1", "unpack_e2m1"]

_CODE_MAX = 15  # sign bit 3 set, magnitude index 7


def _e2m1_table(device: torch.device) -> Tensor:
    """The eight E2M1 magnitudes as an FP32 tensor on ``device`` (index = magnitude code)."""
    return torch.tensor(E2M1_VALUES, dtype=torch.float32, device=device)


_BOUNDARIES = (
    (torch.ge, 0.75),
    (torch.gt, 1.25),
    (torch.ge, 1.75),
    (torch.gt, 2.5),
    (torch.ge, 3.5),
    (torch.gt, 5.0),
)
"""After ``> 0.25``: the comparison that moves a magnitude past each later rounding boundary."""


def _e2m1_index(magnitude: Tensor) -> Tensor:
    """Index (0..7) of the nearest E2M1 magnitude, ties to the even index; saturates at 6."""
    m = magnitude
    # One comparison per boundary between E2M1 magnitudes, strict where the tie goes down to
    # the even index and non-strict where it goes up; each adds 0 or 1 in place (a NaN adds 0).
    idx = torch.gt(m, 0.25).view(torch.uint8)
    hit = torch.empty_like(idx, dtype=torch.bool)
    for compare, boundary in _BOUNDARIES:
        compare(m, boundary, out=hit)
        idx.add_(hit.view(torch.uint8))
    return idx


_ONE_BITS = 0x3F800000  # FP32 1.0
_EXPONENT_MASK = 0x7F800000
_SIX_EXPONENT_BITS = 0x40800000  # FP32 4.0: the exponent field of 6
_SHIFT_22 = 22 << 23  # multiply a power of two by 2**22 in its exponent field


def _e2m1_value(magnitude: Tensor) -> Tensor:
    """The nearest E2M1 magnitude (FP32) of each magnitude: ``table[_e2m1_index(m)]``, bit for bit.

    E2M1 is FP32 rounding (nearest-even) onto steps of 0.5 below 2, 1 in [2, 4), 2 in [4, 6]: after
    clamping to 6, ``(m + c) - c`` with ``c = max(2**floor(log2 m), 1) * 2**22`` (one ulp of ``c``
    is the step) rounds exactly so, in a few passes instead of one comparison per boundary. NaN
    gives 0, as index 0. Equal to :func:`_e2m1_index` on every FP32 value in ``[0, 8]`` (swept).
    """
    return _e2m1_value_(magnitude.clamp_max(6.0))


def _e2m1_value_(m: Tensor) -> Tensor:
    """:func:`_e2m1_value` computed in ``m`` (a contiguous FP32 temporary the caller owns)."""
    m.clamp_max_(6.0)  # a NaN stays NaN
    power = (m.view(torch.int32) & _EXPONENT_MASK).clamp_(_ONE_BITS, _SIX_EXPONENT_BITS)
    c = power.add_(_SHIFT_22).view(torch.float32)
    return m.add_(c).sub_(c).nan_to_num_(0.0)


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
    require_tensor(codes, name="codes", where=where)
    if codes.dtype != torch.uint8:
        raise TypeError(f"{where}: codes must be uint8 (one E2M1 code each), got {codes.dtype}")
    require_range(codes, 0, _CODE_MAX, name="codes (E2M1 codes)", where=where)


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


def unpack_e2m1(packed: Shaped[Tensor, "*b half"]) -> UInt8[Tensor, "*b 2*half"]:
    """Inverse of :func:`pack_e2m1`; accepts uint8 or ``float4_e2m1fn_x2`` storage.

    Raises:
      TypeError: another dtype. ValueError: a 0-d ``packed``.

    Numerics: exact bit unpacking.

    Example:
      >>> unpack_e2m1(torch.tensor([[33, 15]], dtype=torch.uint8)).tolist()
      [[1, 2, 15, 0]]
    """
    require_tensor(packed, name="packed", where="unpack_e2m1")
    if packed.dtype == getattr(torch, "float4_e2m1fn_x2", None):
        packed = packed.view(torch.uint8)
    if packed.dtype != torch.uint8:
        raise TypeError(
            f"unpack_e2m1: packed must be uint8 or float4_e2m1fn_x2, got {packed.dtype}"
        )
    if packed.ndim == 0:
        raise ValueError("unpack_e2m1: packed must have at least one axis, got a 0-d tensor")
    low, high = packed & 0xF, packed >> 4
    return torch.stack([low, high], dim=-1).reshape(*packed.shape[:-1], 2 * packed.shape[-1])
