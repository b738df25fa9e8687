"""GPTQ integer packing for 2, 4 and 8 bits (``gptq`` v1 / ``gptq_v2``), unpacking, decoding and
converting between the two zero-point conventions.

Layouts (GPT-QModel's checkpoint layout, which every GPTQ kernel reads; ``docs/numerics.md``), with
``per = 32 / bits`` fields per int32 word (16, 8 or 4):
  * ``qweight`` int32 ``(in/per, out)``: input row ``k`` sits in word ``k // per`` at bits
    ``bits * (k % per)`` (the lowest row in the lowest field).
  * ``qzeros`` int32 ``(groups, out/per)``: output column ``n`` sits in word ``n // per`` at bits
    ``bits * (n % per)``. ``gptq_v2`` stores the logical zero point; ``gptq`` (v1, the export
    default) stores ``zero - 1`` in every field as GPT-QModel does: the packed v2 word minus a one
    in every field (``0x55555555``, ``0x11111111``, ``0x01010101``) modulo 2**32.
  * ``scales`` ``(groups, out)`` (float16 when packed here); ``g_idx`` int32 ``(in,)``: the group
    of each input row. Decoding is ``scales[g_idx] * (code - zeros[g_idx])``.

Bits 3, 5 and 6 do not fill an int32 word and are refused. Codes are unsigned ``0..2**bits-1``
with a separate zero point (``2**(bits-1)`` when symmetric). Centering 4-bit codes and staging
them for the W4A paths is :mod:`floatxq.gptq.planes`.
"""

import typing
from typing import NamedTuple

import torch

from floatxq._checks import (
    require_data,
    require_finite,
    require_floating,
    require_integer,
    require_range,
    require_shape,
)
from floatxq._typing import (
    Float,
    Int32,
    Integer,
    Tensor,
    UInt8,
    checked_record,
)
from floatxq.formats import FP16_MAX, normalize_gptq_format

__all__ = [
    "GPTQPacked",
    "GPTQUnpacked",
    "convert_gptq_format",
    "dequantize_gptq",
    "pack_gptq",
    "unpack_gptq",
]

_PACK_BITS: tuple[int, ...] = (2, 4, 8)  # the widths that fill an int32 word exactly
_WORD_BITS = 32
_WORD = 1 << _WORD_BITS


@checked_record
class GPTQPacked(NamedTuple):
    """GPTQ checkpoint tensors (2, 4 or 8 bits), exactly as a ``gptq`` / ``gptq_v2`` file stores
    them.

    Shapes, with ``per = 32 / bits`` fields per word: ``words = in / per`` rows of ``qweight``,
    ``out / per`` columns of ``qzeros``; ``g_idx`` has ``in = per * words`` entries. The record
    does not carry ``bits``: the functions that read it take it as an argument.
    """

    qweight: Int32[Tensor, "words out"]
    """int32 ``(in/per, out)``: ``per`` input rows per word, the lowest row in the lowest field."""
    qzeros: Int32[Tensor, "groups zero_words"]
    """int32 ``(groups, out/per)``: zero points, ``per`` output columns per word (v1 stores
    ``zero - 1`` in every field)."""
    scales: Float[Tensor, "groups out"]
    """``(groups, out)`` direct scales (decode: ``scale * (code - zero)``); float16 when packed
    by :func:`pack_gptq`."""
    g_idx: Int32[Tensor, "rows"]  # noqa: F821
    """int32 ``(in,)``: the group of each input row."""


@checked_record
class GPTQUnpacked(NamedTuple):
    """The logical content of a :class:`GPTQPacked`: codes and zero points as integers."""

    codes: UInt8[Tensor, "rows out"]
    """uint8 ``(in, out)`` codes ``0..2**bits-1``."""
    zeros: UInt8[Tensor, "groups out"]
    """uint8 ``(groups, out)`` logical zero points ``0..2**bits-1`` (v2 meaning, whatever the
    format)."""
    scales: Float[Tensor, "groups out"]
    """``(groups, out)`` direct scales, as stored."""
    g_idx: Int32[Tensor, "rows"]  # noqa: F821
    """int32 ``(in,)`` group of each input row."""


# ----------------------------------------------------------------------------------------------
# Validation
# ----------------------------------------------------------------------------------------------


def _to_int32_words(words: Tensor) -> Tensor:
    """Unsigned 32-bit words held in int64 → the int32 tensor with the same bits."""
    signed = torch.where(words >= (1 << 31), words - _WORD, words)
    return signed.to(torch.int32)


def _check_bits(bits: object, *, where: str) -> int:
    """``bits`` when GPTQ packing can hold it (2, 4 or 8), else a ``TypeError``/``ValueError``."""
    if isinstance(bits, bool) or not isinstance(bits, int):
        raise TypeError(f"{where}: bits must be an int (2, 4 or 8), got {type(bits).__name__}")
    if bits not in _PACK_BITS:
        raise ValueError(
            f"{where}: bits={bits} cannot be packed; GPTQ packing takes bits 2, 4 or 8 (32/bits "
            f"values fill an int32 word; 3, 5 and 6 do not)"
        )
    return bits


def _per_word(bits: int) -> int:
    """Values per int32 word: 16 (2-bit), 8 (4-bit) or 4 (8-bit)."""
    return _WORD_BITS // bits


def _v1_offset(bits: int) -> int:
    """A one in every field: ``0x55555555`` (2-bit), ``0x11111111`` (4-bit), ``0x01010101``
    (8-bit). A v1 word is the v2 word minus this, modulo 2**32."""
    return sum(1 << shift for shift in range(0, _WORD_BITS, bits))


def _pack_fields(values: Tensor, dim: int, bits: int) -> Tensor:
    """Pack ``0..2**bits-1`` values ``32/bits`` per word along ``dim`` (lowest index in the lowest
    field), as unsigned words held in int64."""
    per = _per_word(bits)
    v = values.to(torch.int64).movedim(dim, -1)
    v = v.reshape(*v.shape[:-1], v.shape[-1] // per, per)
    shifts = torch.arange(0, _WORD_BITS, bits, device=v.device, dtype=torch.int64)
    words = (v << shifts).sum(dim=-1)  # disjoint bits: the sum is an OR, exact in int64
    return words.movedim(-1, dim).contiguous()


def _unpack_fields(words: Tensor, dim: int, bits: int) -> Tensor:
    """Inverse of :func:`_pack_fields`: uint8 values, ``32/bits`` per word along ``dim``."""
    per = _per_word(bits)
    w = words.to(torch.int32).movedim(dim, -1)
    shifts = torch.arange(0, _WORD_BITS, bits, device=w.device, dtype=torch.int32)
    # int32 throughout (half the memory of int64): the mask drops the arithmetic shift's sign bits
    v = (w.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)
    v = v.reshape(*w.shape[:-1], w.shape[-1] * per)
    return v.movedim(-1, dim).to(torch.uint8).contiguous()


def _shift_words(qzeros: Tensor, delta: int) -> Tensor:
    """``qzeros + delta`` modulo 2**32 on the unsigned words, returned as int32 bits."""
    unsigned = (qzeros.to(torch.int64) & (_WORD - 1)) + delta
    return _to_int32_words(unsigned % _WORD)


def _check_packed(packed: object, *, where: str, bits: int = 4) -> tuple[int, int, int]:
    """``(in, out, groups)`` of a valid :class:`GPTQPacked`, or a ``TypeError``/``ValueError``.

    Valid means what :func:`pack_gptq` writes for ``bits``: int32 words, floating finite scales,
    shapes that agree (``out`` a multiple of ``32/bits``) and every ``g_idx`` in ``[0, groups)``.
    """
    if not isinstance(packed, tuple) or len(packed) != 4:
        raise TypeError(
            f"{where}: packed must be a GPTQPacked (qweight, qzeros, scales, g_idx), got "
            f"{type(packed).__name__}"
        )
    qweight, qzeros, scales, g_idx = packed
    for name, t in (("qweight", qweight), ("qzeros", qzeros), ("g_idx", g_idx)):
        require_integer(t, name=f"packed.{name}", where=where)
    require_floating(scales, name="packed.scales", where=where)
    for name, t in (("qweight", qweight), ("qzeros", qzeros), ("scales", scales), ("g_idx", g_idx)):
        require_data(t, name=f"packed.{name}", where=where)
    if qweight.dtype != torch.int32 or qzeros.dtype != torch.int32 or g_idx.dtype != torch.int32:
        raise TypeError(
            f"{where}: packed.qweight, packed.qzeros and packed.g_idx must be int32, got "
            f"{qweight.dtype}, {qzeros.dtype} and {g_idx.dtype}"
        )
    per = _per_word(bits)
    if qweight.ndim != 2 or qzeros.ndim != 2 or scales.ndim != 2 or g_idx.ndim != 1:
        raise ValueError(
            f"{where}: expected qweight (in/{per}, out), qzeros (groups, out/{per}), scales "
            f"(groups, out), g_idx (in,) for bits={bits}; got shapes {tuple(qweight.shape)}, "
            f"{tuple(qzeros.shape)}, {tuple(scales.shape)}, {tuple(g_idx.shape)}"
        )
    rows, out = qweight.shape[0] * per, qweight.shape[1]
    groups = scales.shape[0]
    if out % per:
        raise ValueError(
            f"{where}: out={out} (columns of packed.qweight) must be a multiple of {per} for "
            f"bits={bits} ({per} zero points per packed.qzeros word)"
        )
    require_shape(qzeros, (groups, out // per), name="packed.qzeros", where=where)
    require_shape(scales, (groups, out), name="packed.scales", where=where)
    require_shape(g_idx, (rows,), name="packed.g_idx", where=where)
    # what pack_gptq guarantees of its output
    if rows and not groups:
        raise ValueError(f"{where}: packed.scales and packed.qzeros hold no group for {rows} rows")
    require_range(g_idx, 0, max(groups - 1, 0), name="packed.g_idx", where=where)
    require_finite(scales, name="packed.scales", where=where)
    return rows, out, groups


# ----------------------------------------------------------------------------------------------
# Packing
# ----------------------------------------------------------------------------------------------


def pack_gptq(
    codes: Integer[Tensor, "in out"],
    zeros: Integer[Tensor, "groups out"],
    scales: Float[Tensor, "groups out"],
    g_idx: Integer[Tensor, "in"],
    *,
    bits: int = 4,
    format: str = "gptq",
) -> GPTQPacked:
    """Pack unsigned ``bits``-bit codes, zero points and scales into GPTQ checkpoint tensors.

    Args:
      codes: ``(in, out)`` integers ``0..2**bits-1``, input rows first (a solver's ``(out, in)``
        codes are passed transposed).
      zeros: ``(groups, out)`` logical zero points ``0..2**bits-1``.
      scales: ``(groups, out)`` direct scales, any floating dtype; stored as float16.
      g_idx: ``(in,)`` group of each input row, in ``[0, groups)``.
      bits: 2, 4 or 8; ``in`` and ``out`` must be multiples of ``per = 32 / bits`` (never
        padded; the word layouts: this module's docstring).
      format: ``"gptq"`` (v1: each zero field stores ``zero - 1``) or ``"gptq_v2"``.

    Returns:
      ``GPTQPacked(qweight int32 (in/per, out), qzeros int32 (groups, out/per), scales float16,
      g_idx int32)``, on the inputs' device.

    Raises:
      ValueError: a value out of range, disagreeing shapes, scales float16 cannot hold (or not
        finite), an unknown ``bits`` or format. TypeError: wrong dtypes, meta tensors.

    Numerics: bit-exact integer packing; scales rounded to float16 nearest-even.

    Example:
      >>> codes = torch.zeros(16, 16, dtype=torch.int64)
      >>> codes[0], codes[15] = 3, 1
      >>> g_idx = torch.zeros(16, dtype=torch.int32)
      >>> packed = pack_gptq(codes, torch.full((1, 16), 2), torch.ones(1, 16), g_idx, bits=2)
      >>> hex(packed.qweight[0, 0].item() & 0xFFFFFFFF), hex(packed.qzeros[0, 0].item())
      ('0x40000003', '0x55555555')
    """
    where = "pack_gptq"
    return _pack(
        codes, zeros, scales, g_idx, bits=_check_bits(bits, where=where), format=format, where=where
    )


def _pack(
    codes: Tensor,
    zeros: Tensor,
    scales: Tensor,
    g_idx: Tensor,
    *,
    bits: int,
    format: object,
    where: str,
) -> GPTQPacked:
    """:func:`pack_gptq` for a checked ``bits``, its messages naming ``where``."""
    fmt = normalize_gptq_format(format, where=where)
    require_integer(codes, name="codes", where=where)
    require_integer(zeros, name="zeros", where=where)
    require_integer(g_idx, name="g_idx", where=where)
    require_floating(scales, name="scales", where=where)
    for name, t in (("codes", codes), ("zeros", zeros), ("scales", scales), ("g_idx", g_idx)):
        require_data(t, name=name, where=where)
    if codes.ndim != 2:
        raise ValueError(f"{where}: codes must be 2-D (in, out), got {tuple(codes.shape)}")
    rows, out = codes.shape
    if zeros.ndim != 2 or zeros.shape[1] != out:
        raise ValueError(f"{where}: zeros must be (groups, out={out}), got {tuple(zeros.shape)}")
    groups = zeros.shape[0]
    require_shape(scales, (groups, out), name="scales", where=where)
    require_shape(g_idx, (rows,), name="g_idx", where=where)
    per = _per_word(bits)
    if rows % per or out % per:
        raise ValueError(
            f"{where}: in={rows} and out={out} must both be multiples of {per} ({per} {bits}-bit "
            f"values per int32 word); floatxq never pads"
        )
    top = (1 << bits) - 1
    require_range(codes, 0, top, name="codes", where=where)
    require_range(zeros, 0, top, name="zeros", where=where)
    require_range(g_idx, 0, max(groups - 1, 0), name="g_idx", where=where)
    if rows and not groups:
        raise ValueError(f"{where}: zeros and scales need at least one group for {rows} rows")
    require_finite(scales, name="scales", where=where)
    scales16 = _float16_scales(scales, where=where)

    qweight = _to_int32_words(_pack_fields(codes, 0, bits))
    qzeros = _to_int32_words(_pack_fields(zeros, 1, bits))
    if fmt == "gptq":
        qzeros = _shift_words(qzeros, -_v1_offset(bits))
    return GPTQPacked(
        qweight.contiguous(), qzeros.contiguous(), scales16.contiguous(),
        g_idx.to(torch.int32).contiguous(),
    )  # fmt: skip


def _float16_scales(scales: Tensor, *, where: str) -> Tensor:
    """``scales`` rounded to float16, refused where the store would lose them: a nonzero scale
    that rounds to 0 (every code of its group would decode to 0) or one that overflows to ±inf.
    """
    scales16 = scales.to(torch.float16)
    lost = ((scales16 == 0) & (scales != 0)) | torch.isinf(scales16)
    if scales.numel() and bool(lost.any()):
        raise ValueError(
            f"{where}: {int(lost.sum())} scale(s) do not survive the float16 checkpoint store, "
            f"such as {scales[lost][:4].tolist()}: float16 keeps magnitudes from ~3e-8 (smaller "
            f"round to 0) to {FP16_MAX:g} (65520 and more overflow to inf)"
        )
    return scales16


def unpack_gptq(packed: GPTQPacked, *, bits: int = 4, format: str = "gptq") -> GPTQUnpacked:
    """Unpack GPTQ checkpoint tensors of ``bits``-bit values into integer codes and zero points.

    The exact inverse of :func:`pack_gptq` for the same ``bits`` and ``format``: a v1 ``qzeros``
    word gets a one in every field added back (modulo 2**32) before its fields are read.

    Args:
      packed: a :class:`GPTQPacked` (or any 4-tuple of the same tensors).
      bits: 2, 4 or 8, the width the words were packed with.
      format: the convention the zeros were stored in, ``"gptq"`` or ``"gptq_v2"``.

    Returns:
      ``GPTQUnpacked(codes uint8 (in, out), zeros uint8 (groups, out), scales, g_idx int32)``
      with ``in = 32 / bits * qweight rows``.

    Raises:
      ValueError: ``bits`` other than 2, 4 or 8, inconsistent shapes (``out`` not a multiple of
        ``32/bits`` included), a ``g_idx`` outside ``[0, groups)``, non-finite scales or an
        unknown format (what :func:`pack_gptq` refuses to write).
      TypeError: wrong dtypes (non-int32 words or ``g_idx``, non-floating scales), meta tensors.

    Numerics: exact integer unpacking; scales are returned as stored (a copy).

    Example:
      >>> packed = GPTQPacked(torch.full((1, 4), 0x04030201, dtype=torch.int32),
      ...     torch.tensor([[0x7F7F7F7F]], dtype=torch.int32), torch.ones(1, 4).half(),
      ...     torch.zeros(4, dtype=torch.int32))
      >>> u = unpack_gptq(packed, bits=8, format="gptq")
      >>> u.codes[:, 0].tolist(), u.zeros[0].tolist()
      ([1, 2, 3, 4], [128, 128, 128, 128])
    """
    where = "unpack_gptq"
    u = _unpack(packed, bits=_check_bits(bits, where=where), format=format, where=where)
    return GPTQUnpacked(u.codes, u.zeros, u.scales.clone(), u.g_idx.clone())


def _unpack(packed: object, *, bits: int, format: object, where: str) -> GPTQUnpacked:
    """Validated unpacking; ``scales`` and ``g_idx`` are the stored tensors (not copies)."""
    fmt = normalize_gptq_format(format, where=where)
    _check_packed(packed, where=where, bits=bits)
    qweight, qzeros, scales, g_idx = typing.cast(GPTQPacked, packed)
    words = qzeros if fmt == "gptq_v2" else _shift_words(qzeros, _v1_offset(bits))
    return GPTQUnpacked(
        _unpack_fields(qweight, 0, bits), _unpack_fields(words, 1, bits), scales, g_idx
    )


def dequantize_gptq(
    packed: GPTQPacked,
    *,
    bits: int = 4,
    format: str = "gptq",
    dtype: torch.dtype = torch.float32,
) -> Float[Tensor, "out in"]:
    """Decode GPTQ checkpoint tensors to the ``(out, in)`` weight: ``scale · (code - zero)``.

    Each input row ``k`` reads the scale and zero point of its group ``g_idx[k]``, so a
    ``desc_act`` checkpoint (groups not contiguous in ``k``) decodes the same way.

    Args:
      packed: a :class:`GPTQPacked`, validated as :func:`unpack_gptq` does.
      bits: 2, 4 or 8, the width the words were packed with.
      format: the zero-point convention of ``packed``: ``"gptq"`` or ``"gptq_v2"``.
      dtype: the floating dtype of the result.

    Returns:
      ``(out, in)`` tensor in ``dtype`` (the orientation of ``nn.Linear.weight``), contiguous.

    Raises:
      ValueError, TypeError: as :func:`unpack_gptq`; a ``dtype`` that is not a floating dtype.

    Numerics: ``float32(scale) * float32(code - zero)`` with the integer difference exact, then
    one nearest-even rounding to ``dtype``. The product is exact for float16 and bfloat16 scales
    (at most 11 + 8 significant bits); float32 scales round once in the product, float64 ones
    once more on the way to float32.

    Example:
      >>> packed = GPTQPacked(torch.full((1, 4), 0x04030201, dtype=torch.int32),
      ...     torch.tensor([[0x7F7F7F7F]], dtype=torch.int32), torch.full((1, 4), 0.5).half(),
      ...     torch.zeros(4, dtype=torch.int32))
      >>> dequantize_gptq(packed, bits=8, format="gptq")[0].tolist()
      [-63.5, -63.0, -62.5, -62.0]
    """
    where = "dequantize_gptq"
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(f"{where}: dtype must be a floating torch.dtype, got {dtype!r}")
    bits = _check_bits(bits, where=where)
    fmt = normalize_gptq_format(format, where=where)
    _check_packed(packed, where=where, bits=bits)
    return _dequantize_stored(typing.cast(GPTQPacked, packed), bits, fmt, dtype)


def _dequantize_stored(packed: GPTQPacked, bits: int, fmt: str, dtype: torch.dtype) -> Tensor:
    """:func:`dequantize_gptq` without its checks (no host synchronisation): for buffers a
    module already validated when it was built or loaded."""
    qweight, qzeros, scales, g_idx = packed
    words = qzeros if fmt == "gptq_v2" else _shift_words(qzeros, _v1_offset(bits))
    codes, zeros = _unpack_fields(qweight, 0, bits), _unpack_fields(words, 1, bits)
    group = g_idx.to(torch.int64)
    diff = codes.to(torch.int16) - zeros.to(torch.int16)[group]  # exact: |diff| <= 255
    weight = scales.to(torch.float32)[group] * diff.to(torch.float32)  # (in, out)
    return weight.to(dtype).T.contiguous()


def convert_gptq_format(
    packed: GPTQPacked, *, source: str, target: str, bits: int = 4
) -> GPTQPacked:
    """Convert the zero-point convention of packed GPTQ tensors between ``gptq`` and ``gptq_v2``.

    v2 → v1 subtracts a one in every field (``0x11111111`` for 4 bits, ``0x55555555`` for 2,
    ``0x01010101`` for 8) from every ``qzeros`` word and v1 → v2 adds it, modulo 2**32
    (GPT-QModel's packed-word conversion); the other tensors are copied unchanged.

    Args:
      packed: a :class:`GPTQPacked` stored in ``source``'s convention.
      source, target: ``"gptq"`` or ``"gptq_v2"``.
      bits: 2, 4 or 8, the width the words were packed with.

    Returns:
      A new :class:`GPTQPacked` in ``target``'s convention.

    Raises:
      TypeError, ValueError: as :func:`unpack_gptq`.

    Numerics: exact integer word arithmetic. A v2 zero point of 0 borrows from the next field
    in the v1 form (v1 cannot store it); converting back restores it exactly.

    Example:
      >>> p = GPTQPacked(torch.zeros(1, 8, dtype=torch.int32),
      ...     torch.tensor([[0x77777777]], dtype=torch.int32), torch.ones(1, 8).half(),
      ...     torch.zeros(8, dtype=torch.int32))
      >>> hex(convert_gptq_format(p, source="gptq", target="gptq_v2").qzeros.item() & 0xFFFFFFFF)
      '0x88888888'
    """
    where = "convert_gptq_format"
    bits = _check_bits(bits, where=where)
    src = normalize_gptq_format(source, where=where, name="source")
    dst = normalize_gptq_format(target, where=where, name="target")
    _check_packed(packed, where=where, bits=bits)
    qweight, qzeros, scales, g_idx = packed
    if src == dst:
        qzeros = qzeros.clone()
    else:
        offset = _v1_offset(bits)
        qzeros = _shift_words(qzeros, offset if dst == "gptq_v2" else -offset)
    return GPTQPacked(qweight.clone(), qzeros, scales.clone(), g_idx.clone())
