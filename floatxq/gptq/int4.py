"""GPTQ integer packing for 2, 4 and 8 bits (``gptq`` v1 / ``gptq_v2``), decoding, centering,
and the W4A operand staging.

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
with a separate zero point (``2**(bits-1)`` when symmetric). The W4A paths center 4-bit codes
(``code - 8`` in ``-8..7``) and stage the centered integers as exact FP8 E4M3 values, or as two
exact E2M1 planes ``c = low + 4 * high`` for NVFP4 tensor cores.
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
    Float8e4m3fn,
    Int16,
    Int32,
    Integer,
    Tensor,
    UInt8,
    checked_record,
)
from floatxq.formats import E2M1_VALUES, GPTQ_W4A_GROUP_SIZE, normalize_gptq_format

__all__ = [
    "E2M1Planes",
    "GPTQPacked",
    "GPTQUnpacked",
    "Int4Planes",
    "centered_int4",
    "convert_gptq_format",
    "dequantize_gptq",
    "int4_planes_to_e2m1",
    "int4_to_e4m3",
    "merge_int4_planes",
    "pack_gptq",
    "pack_gptq_int4",
    "split_int4_planes",
    "unpack_gptq",
    "unpack_gptq_int4",
]

_PACK_BITS: tuple[int, ...] = (2, 4, 8)  # the widths that fill an int32 word exactly
_WORD_BITS = 32
_WORD = 1 << _WORD_BITS
_FP16_MAX = 65504.0


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

    ``per = 32 / bits`` values share an int32 word (16, 8 or 4), the lowest index in the lowest
    field: input rows for ``qweight``, output columns for ``qzeros``.

    Args:
      codes: ``(in, out)`` integers ``0..2**bits-1`` (input rows first, as the checkpoint stores
        them; a solver's ``(out, in)`` codes are passed transposed).
      zeros: ``(groups, out)`` logical zero points ``0..2**bits-1`` (``2**(bits-1)`` when
        symmetric).
      scales: ``(groups, out)`` direct scales, any floating dtype; stored as float16.
      g_idx: ``(in,)`` group of each input row, each in ``[0, groups)``.
      bits: 2, 4 or 8. ``in`` and ``out`` must be multiples of ``32 / bits`` (never padded).
      format: ``"gptq"`` (v1: every zero field stores ``zero - 1``, i.e. the v2 word minus
        ``0x55555555`` / ``0x11111111`` / ``0x01010101`` modulo 2**32) or ``"gptq_v2"``.

    Returns:
      ``GPTQPacked(qweight int32 (in/per, out), qzeros int32 (groups, out/per), scales float16,
      g_idx int32)``, on the inputs' device.

    Raises:
      ValueError: ``bits`` other than 2, 4 or 8; a code/zero outside ``0..2**bits-1``, a g_idx
        outside ``[0, groups)``, shapes that do not agree or are not multiples of ``32/bits``,
        non-finite scales, scales that do not survive float16 (nonzero ones that round to 0, or
        ones that overflow), or an unknown format.
      TypeError: non-integer codes/zeros/g_idx or ``bits``, non-floating scales, meta tensors.

    Numerics: bit-exact integer packing (a set top bit gives a negative int32 word); scales are
    rounded to float16 nearest-even (|s| up to 65519 rounds to at most 65504); a scale the
    rounding flushes to 0 or overflows to ±inf is refused, never stored.

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


def pack_gptq_int4(
    codes: Integer[Tensor, "in out"],
    zeros: Integer[Tensor, "groups out"],
    scales: Float[Tensor, "groups out"],
    g_idx: Integer[Tensor, "in"],
    *,
    format: str = "gptq",
) -> GPTQPacked:
    """Pack unsigned INT4 codes, zero points and scales into GPTQ checkpoint tensors.

    :func:`pack_gptq` with ``bits=4``.

    Args:
      codes: ``(in, out)`` integers ``0..15`` (input rows first, as the checkpoint stores them;
        a solver's ``(out, in)`` codes are passed transposed). ``in`` must be a multiple of 8.
      zeros: ``(groups, out)`` logical zero points ``0..15`` (8 for symmetric 4-bit).
        ``out`` must be a multiple of 8.
      scales: ``(groups, out)`` direct scales, any floating dtype; stored as float16.
      g_idx: ``(in,)`` group of each input row, each in ``[0, groups)``.
      format: ``"gptq"`` (v1: the zero words minus ``0x11111111``) or ``"gptq_v2"``.

    Returns:
      ``GPTQPacked(qweight int32 (in/8, out), qzeros int32 (groups, out/8), scales float16,
      g_idx int32)``, on the inputs' device.

    Raises:
      ValueError: a code/zero outside ``0..15``, a g_idx outside ``[0, groups)``, shapes that
        do not agree or are not multiples of 8, non-finite scales, scales that do not survive
        float16 (nonzero ones that round to 0, or ones that overflow), or an unknown format.
      TypeError: non-integer codes/zeros/g_idx, non-floating scales, or meta tensors.

    Numerics: bit-exact integer packing (the top nibble gives negative int32 words); scales are
    rounded to float16 nearest-even (|s| up to 65519 rounds to at most 65504); a scale the
    rounding flushes to 0 or overflows to ±inf is refused, never stored.

    Example:
      >>> codes = torch.tensor([[15], [0], [0], [0], [0], [0], [0], [1]]).expand(8, 8)
      >>> g_idx = torch.zeros(8, dtype=torch.int32)
      >>> packed = pack_gptq_int4(codes, torch.full((1, 8), 8), torch.ones(1, 8), g_idx)
      >>> hex(packed.qweight[0, 0].item() & 0xFFFFFFFF), hex(packed.qzeros[0, 0].item())
      ('0x1000000f', '0x77777777')
    """
    return _pack(codes, zeros, scales, g_idx, bits=4, format=format, where="pack_gptq_int4")


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
            f"round to 0) to {_FP16_MAX:g} (65520 and more overflow to inf)"
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


def unpack_gptq_int4(packed: GPTQPacked, *, format: str = "gptq") -> GPTQUnpacked:
    """Unpack GPTQ checkpoint tensors into integer codes and logical zero points.

    The exact inverse of :func:`pack_gptq_int4` for the same ``format``: a v1 ``qzeros`` word
    gets ``0x11111111`` added back (modulo 2**32) before its nibbles are read.
    :func:`unpack_gptq` with ``bits=4``.

    Args:
      packed: a :class:`GPTQPacked` (or any 4-tuple of the same tensors).
      format: the convention the zeros were stored in, ``"gptq"`` or ``"gptq_v2"``.

    Returns:
      ``GPTQUnpacked(codes uint8 (in, out), zeros uint8 (groups, out), scales, g_idx int32)``.

    Raises:
      ValueError: inconsistent shapes, a ``g_idx`` outside ``[0, groups)``, non-finite scales
        or an unknown format (what :func:`pack_gptq_int4` refuses to write).
      TypeError: wrong dtypes (non-int32 words or ``g_idx``, non-floating scales), meta tensors.

    Numerics: exact integer unpacking; scales are returned as stored.

    Example:
      >>> packed = GPTQPacked(torch.tensor([[-1]]).expand(1, 8).int(),
      ...     torch.tensor([[0x77777777]], dtype=torch.int32), torch.ones(1, 8).half(),
      ...     torch.zeros(8, dtype=torch.int32))
      >>> u = unpack_gptq_int4(packed, format="gptq")
      >>> u.codes[:, 0].tolist(), u.zeros[0, :2].tolist()
      ([15, 15, 15, 15, 15, 15, 15, 15], [8, 8])
    """
    where = "unpack_gptq_int4"
    u = _unpack(packed, bits=4, format=format, where=where)
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


# ----------------------------------------------------------------------------------------------
# Centering and staging for the W4A paths
# ----------------------------------------------------------------------------------------------


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
      >>> p = pack_gptq_int4(torch.full((128, 8), 3), torch.full((1, 8), 8), torch.ones(1, 8),
      ...     torch.zeros(128, dtype=torch.int32), format="gptq")
      >>> centered_int4(p, format="gptq")[0, :3].tolist()
      [-5, -5, -5]
    """
    where = "centered_int4"
    fmt = normalize_gptq_format(format, where=where)
    rows, _, groups = _check_packed(packed, where=where, bits=4)
    g = GPTQ_W4A_GROUP_SIZE
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
    unpacked = unpack_gptq_int4(packed, format=fmt)
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
