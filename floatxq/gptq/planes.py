"""Centered INT4 and its W4A staging: ``code - 8``, the two E2M1 planes, the E4M3 operand.

The W4A paths read a symmetric, contiguous-group 4-bit GPTQ checkpoint as centered integers
``c = code - 8`` in ``-8..7`` (:func:`centered_int4`) and stage them for a tensor core without
rounding: as exact FP8 E4M3 values (:func:`int4_to_e4m3`), or as two exact E2M1 planes
``c = low + 4 * high`` (:func:`split_int4_planes`, :func:`merge_int4_planes`,
:func:`int4_planes_to_e2m1`) for the NVFP4 tensor cores. ``docs/numerics.md`` §10.5 tabulates
the planes.
"""

from typing import NamedTuple

import torch

from floatxq._checks import require_data, require_integer, require_range
from floatxq._typing import Float8e4m3fn, Int16, Integer, Tensor, UInt8, checked_record
from floatxq.formats import E2M1_VALUES, K_GROUP, normalize_gptq_format
from floatxq.gptq.int4 import GPTQPacked, _check_packed, unpack_gptq

__all__ = [
    "E2M1Planes",
    "Int4Planes",
    "centered_int4",
    "int4_planes_to_e2m1",
    "int4_to_e4m3",
    "merge_int4_planes",
    "split_int4_planes",
]


@checked_record
class Int4Planes(NamedTuple):
    """Two planes of a centered INT4 tensor: ``c = low + 4 * high`` exactly."""

    low: Integer[Tensor, "*shape"]
    """``c - 4 * high``, in ``{-2, -1, 0, 1}``; the input's dtype (int16 for unsigned input)."""
    high: Integer[Tensor, "*shape"]
    """``floor((c + 2) / 4)``, in ``{-2, ..., 2}``; the same dtype as ``low``."""


@checked_record
class E2M1Planes(NamedTuple):
    """The two INT4 planes as packed E2M1 codes along K (the NVFP4 weight operand)."""

    low: UInt8[Tensor, "half_k n"]
    """uint8 ``(k/2, n)``: the low plane, two E2M1 codes per byte, even K in the low nibble."""
    high: UInt8[Tensor, "half_k n"]
    """uint8 ``(k/2, n)``: the high plane, packed the same way."""


def centered_int4(packed: GPTQPacked, *, format: str = "gptq") -> Int16[Tensor, "in out"]:
    """Centered INT4 weight codes ``code - 8`` of a symmetric, contiguous-group GPTQ checkpoint.

    The W4A kernels require ``g_idx == arange(in) // 128`` exactly (contiguous groups of 128,
    ``desc_act=False``) and every zero point equal to 8 (symmetric 4-bit). Either format's
    zeros are accepted (v1 words ``0x77777777`` and v2 words ``0x88888888`` both mean 8).

    Args:
      packed: a :class:`GPTQPacked` with ``in % 128 == 0``.
      format: the zero-point convention of ``packed``: ``"gptq"`` or ``"gptq_v2"``.

    Returns:
      int16 ``(in, out)`` values in ``-8..7``.

    Raises:
      ValueError: ``g_idx`` is not ``arange(in) // 128``, the group count is not ``in / 128``, or
        a zero point is not 8 (the message names the first offending group/column).

    Numerics: exact integers.

    Example:
      >>> from floatxq.gptq.int4 import pack_gptq
      >>> p = pack_gptq(torch.full((128, 8), 3), torch.full((1, 8), 8), torch.ones(1, 8),
      ...     torch.zeros(128, dtype=torch.int32), format="gptq")
      >>> centered_int4(p, format="gptq")[0, :3].tolist()
      [-5, -5, -5]
    """
    where = "centered_int4"
    fmt = normalize_gptq_format(format, where=where)
    rows, _, groups = _check_packed(packed, where=where, bits=4)
    g = K_GROUP
    if rows % g:
        raise ValueError(
            f"{where}: in={rows} must be a multiple of {g}: the W4A paths require contiguous "
            f"GPTQ groups of {g} and desc_act=False"
        )
    expected = torch.arange(rows, device=packed.g_idx.device, dtype=torch.int64) // g
    if groups != rows // g or not torch.equal(packed.g_idx.to(torch.int64), expected):
        raise ValueError(
            f"{where}: g_idx must equal arange(in) // {g} with {rows // g} groups (contiguous "
            f"GPTQ groups of {g} and desc_act=False); got {groups} groups and g_idx starting "
            f"{packed.g_idx[:4].tolist()}"
        )
    unpacked = unpack_gptq(packed, bits=4, format=fmt)
    bad = unpacked.zeros != 8
    if bool(bad.any()):
        group, column = (int(i) for i in bad.nonzero()[0])
        raise ValueError(
            f"{where}: every zero point must be 8 (symmetric 4-bit) for the W4A paths; group "
            f"{group}, output column {column} has zero point {int(unpacked.zeros[group, column])}"
        )
    return unpacked.codes.to(torch.int16) - 8


def _require_centered(c: object, *, name: str, where: str, low: int, high: int) -> None:
    """An integer tensor whose values lie in ``[low, high]`` (a centered INT4 value or plane)."""
    require_integer(c, name=name, where=where)
    require_data(c, name=name, where=where)
    require_range(c, low, high, name=name, where=where)


def split_int4_planes(c: Integer[Tensor, "*shape"]) -> Int4Planes:
    """Split centered INT4 values into planes ``high = floor((c + 2) / 4)``, ``low = c - 4·high``.

    Both planes are exact E2M1 values (``low`` in ``{-2..1}``, ``high`` in ``{-2..2}``), so the
    NVFP4 tensor cores can multiply an INT4 weight as ``low + 4 * high`` without rounding.

    Args:
      c: integers in ``-8..7`` (any integer dtype).

    Returns:
      ``Int4Planes(low, high)`` of ``c``'s shape, in ``c``'s dtype when it is signed, else int16.

    Raises:
      ValueError: a value outside ``-8..7``. TypeError: a non-integer tensor.

    Numerics: exact integers; ``merge_int4_planes(*split_int4_planes(c)) == c``.

    Example:
      >>> low, high = split_int4_planes(torch.tensor([-8, -6, 7], dtype=torch.int16))
      >>> low.tolist(), high.tolist()
      ([0, -2, -1], [-2, -1, 2])
    """
    where = "split_int4_planes"
    _require_centered(c, name="c", where=where, low=-8, high=7)
    dtype = c.dtype if c.is_signed() else torch.int16
    wide = c.to(torch.int64)
    high = torch.div(wide + 2, 4, rounding_mode="floor")
    return Int4Planes((wide - 4 * high).to(dtype), high.to(dtype))


def merge_int4_planes(
    low: Integer[Tensor, "*shape"], high: Integer[Tensor, "*shape"]
) -> Integer[Tensor, "*shape"]:
    """Recombine two INT4 planes: ``low + 4 * high``.

    Args:
      low: integers in ``-2..1``; high: integers in ``-2..2`` of the same shape and dtype.

    Returns:
      The centered values ``-8..7``, in ``low``'s dtype when it is signed, else int16.

    Raises:
      ValueError: a plane value out of its range, a pair whose sum leaves ``-8..7`` (not a
        :func:`split_int4_planes` output), or mismatched shapes. TypeError: non-integers.

    Numerics: exact integers.

    Example:
      >>> merge_int4_planes(torch.tensor([0, -2, -1]), torch.tensor([-2, -1, 2])).tolist()
      [-8, -6, 7]
    """
    where = "merge_int4_planes"
    _require_centered(low, name="low", where=where, low=-2, high=1)
    _require_centered(high, name="high", where=where, low=-2, high=2)
    if low.shape != high.shape:
        raise ValueError(
            f"{where}: low and high must have the same shape, got {tuple(low.shape)} and "
            f"{tuple(high.shape)}"
        )
    merged = low.to(torch.int64) + 4 * high.to(torch.int64)
    require_range(merged, -8, 7, name="low + 4 * high", where=where)
    return merged.to(low.dtype if low.is_signed() else torch.int16)


_E2M1_EXACT_INTS: dict[int, int] = {
    int(v): i for i, v in enumerate(E2M1_VALUES) if float(v).is_integer() and v > 0
}
"""Integer magnitude → 3-bit E2M1 magnitude index (1→2, 2→4, 3→5, 4→6, 6→7)."""


def _integer_e2m1_codes(v: Tensor, *, where: str, name: str) -> Tensor:
    """E2M1 codes (``sign<<3 | index``) of integers that E2M1 holds exactly; 0 encodes as +0."""
    magnitude = v.to(torch.int64).abs()
    table = torch.full((8,), -1, dtype=torch.int64, device=v.device)
    table[0] = 0
    for value, index in _E2M1_EXACT_INTS.items():
        table[value] = index
    inside = magnitude <= 7
    index = table[magnitude.clamp(max=7)]
    if bool((~inside | (index < 0)).any()):
        raise ValueError(
            f"{where}: {name} must hold integers that E2M1 represents exactly "
            f"(magnitudes 0, 1, 2, 3, 4, 6); got {v[~inside | (index < 0)][:4].tolist()}"
        )
    return (index | torch.where(v < 0, 8, 0)).to(torch.uint8)


def _pack_k(codes: Tensor) -> Tensor:
    """``byte[i, n] = code[2i, n] | code[2i+1, n] << 4``: the even K index in the low nibble."""
    return (codes[0::2] | (codes[1::2] << 4)).contiguous()


def int4_planes_to_e2m1(low: Integer[Tensor, "k n"], high: Integer[Tensor, "k n"]) -> E2M1Planes:
    """Encode two INT4 planes as E2M1 codes and pack each plane along K.

    Each plane value becomes its exact E2M1 code (``|v|`` 0→0, 1→2, 2→4 with bit 3 set for
    ``v < 0``), and two consecutive K rows share one byte: ``byte[i, n] = code[2i, n] |
    code[2i+1, n] << 4`` (the even K element in the low nibble, as NVFP4 packs every operand).

    Args:
      low, high: ``(k, n)`` planes from :func:`split_int4_planes` (``k`` even), ``k`` = input
        rows of the GPTQ weight, ``n`` = output columns.

    Returns:
      ``E2M1Planes(low uint8 (k/2, n), high uint8 (k/2, n))``.

    Raises:
      ValueError: odd ``k``, mismatched shapes, or a value E2M1 cannot hold exactly.

    Numerics: exact (every plane value is an E2M1 value; zero encodes as +0).

    Example:
      >>> planes = split_int4_planes(torch.tensor([[-8], [7]], dtype=torch.int16))
      >>> e = int4_planes_to_e2m1(*planes)
      >>> hex(e.low.item()), hex(e.high.item())
      ('0xa0', '0x4c')
    """
    where = "int4_planes_to_e2m1"
    require_integer(low, name="low", where=where)
    require_integer(high, name="high", where=where)
    require_data(low, name="low", where=where)
    require_data(high, name="high", where=where)
    if low.shape != high.shape or low.ndim != 2:
        raise ValueError(
            f"{where}: low and high must be 2-D (k, n) planes of one shape, got "
            f"{tuple(low.shape)} and {tuple(high.shape)}"
        )
    if low.shape[0] % 2:
        raise ValueError(f"{where}: k={low.shape[0]} must be even (two codes per byte along K)")
    return E2M1Planes(
        _pack_k(_integer_e2m1_codes(low, where=where, name="low")),
        _pack_k(_integer_e2m1_codes(high, where=where, name="high")),
    )


def int4_to_e4m3(c: Integer[Tensor, "*shape"]) -> Float8e4m3fn[Tensor, "*shape"]:
    """Stage centered INT4 values as FP8 E4M3 operands (the W4A-FP8 weight operand).

    Args:
      c: integers in ``-8..7``.

    Returns:
      ``float8_e4m3fn`` values equal to ``c`` (every integer of magnitude ≤ 16 is exact).

    Raises:
      ValueError: a value outside ``-8..7``. TypeError: a non-integer tensor.

    Numerics: exact; no rounding or saturation occurs.

    Example:
      >>> int4_to_e4m3(torch.tensor([-8, 0, 7], dtype=torch.int16)).float().tolist()
      [-8.0, 0.0, 7.0]
    """
    where = "int4_to_e4m3"
    _require_centered(c, name="c", where=where, low=-8, high=7)
    return c.to(torch.float32).to(torch.float8_e4m3fn)
