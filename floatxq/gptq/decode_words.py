"""INT4 codes staged for decode-sized GEMMs: 16-bit words in the order the decode kernels read.

The checkpoint's int32 words hold eight consecutive input rows; a kernel multiplying a few rows
of activations would have to shuffle them into place. The decode words reorder the same nibbles
once, at load: a tile of :data:`~floatxq.formats.DECODE_TILE_ROWS` (128) input rows is 32 int16
rows, and word ``(32·t + r, n)`` holds in nibble ``j`` (bits ``4j..4j+3``) the code of input row
``128·t + 32·j + r``. Nibble ``j`` of a tile's words is then the whole ``(32, n)`` operand of
the input slice ``[128·t + 32·j, +32)``, and a pair of words in one 32-bit register decodes two
weights per instruction. Rows past ``in`` (up to the next tile) hold code 0.

:func:`gptq_decode_operands` adds what a W4A16 decode needs: the zero points unpacked (uint8)
and each scale split into two parts ``hi + lo`` in the activations' dtype, so that
``fma(d, hi, d · lo)`` rounds the exact product ``scale · d`` once (``d = code - zero``) — the
decode of :func:`floatxq.dequantize_gptq`, bit for bit — where such a split exists (checked for
every ``d`` a code and zero can make).
"""

from typing import NamedTuple

import torch

from floatxq._checks import require_data, require_integer, require_range
from floatxq._typing import Float, Int16, Integer, Tensor, UInt8, checked_record
from floatxq.formats import DECODE_SLICE_ROWS, DECODE_TILE_ROWS
from floatxq.gptq.int4 import GPTQPacked, _check_bits, _unpack

__all__ = [
    "DecodeOperands",
    "ScaleSplit",
    "gptq_decode_operands",
    "split_scales",
    "stage_decode_words",
    "unstage_decode_words",
]

_HALF = (torch.float16, torch.bfloat16)
_NIBBLES = DECODE_TILE_ROWS // DECODE_SLICE_ROWS  # 4 codes per int16 word


def stage_decode_words(codes: Integer[Tensor, "in out"]) -> Int16[Tensor, "words out"]:
    """The decode words of 4-bit ``codes`` (see the module docstring for the order).

    Args:
      codes: integer ``(in, out)`` codes in ``0..15`` (e.g. ``unpack_gptq(...).codes``).

    Returns:
      int16 ``(ceil(in / 128) · 32, out)``, contiguous; rows past ``in`` hold code 0.

    Raises:
      TypeError: ``codes`` not an integer tensor, or a meta tensor.
      ValueError: not 2-D, or a code outside ``0..15``.

    Numerics: exact (a permutation of nibbles).

    Example:
      >>> codes = torch.arange(128).remainder(16).view(128, 1)
      >>> words = stage_decode_words(codes)
      >>> words.shape, hex(int(words[1, 0]) & 0xFFFF)  # rows 1, 33, 65, 97 in nibbles 0..3
      (torch.Size([32, 1]), '0x1111')
    """
    where = "stage_decode_words"
    require_integer(codes, name="codes", where=where)
    require_data(codes, name="codes", where=where)
    if codes.ndim != 2:
        raise ValueError(f"{where}: codes must be 2-D (in, out), got shape {tuple(codes.shape)}")
    require_range(codes, 0, 15, name="codes", where=where)
    k, n = codes.shape
    tiles = -(-k // DECODE_TILE_ROWS)
    padded = torch.zeros((tiles * DECODE_TILE_ROWS, n), dtype=torch.int32, device=codes.device)
    padded[:k] = codes.to(torch.int32)
    nibbles = padded.view(tiles, _NIBBLES, DECODE_SLICE_ROWS, n)
    shifts = (4 * torch.arange(_NIBBLES, device=codes.device, dtype=torch.int32)).view(1, -1, 1, 1)
    words = (nibbles << shifts).sum(dim=1, dtype=torch.int32)  # 0..0xFFFF
    words = torch.where(words >= 1 << 15, words - (1 << 16), words)
    return words.reshape(tiles * DECODE_SLICE_ROWS, n).to(torch.int16).contiguous()


def unstage_decode_words(
    words: Int16[Tensor, "words out"], in_features: int
) -> UInt8[Tensor, "in out"]:
    """The codes ``(in_features, out)`` of decode words: the inverse of
    :func:`stage_decode_words`.

    Raises:
      TypeError: ``words`` not int16.
      ValueError: a row count other than ``ceil(in_features / 128) · 32``.

    Numerics: exact.

    Example:
      >>> codes = torch.randint(0, 16, (200, 3), dtype=torch.uint8)
      >>> torch.equal(unstage_decode_words(stage_decode_words(codes), 200), codes)
      True
    """
    where = "unstage_decode_words"
    if not isinstance(words, torch.Tensor) or words.dtype != torch.int16 or words.ndim != 2:
        raise TypeError(f"{where}: words must be a 2-D int16 tensor")
    if not isinstance(in_features, int) or isinstance(in_features, bool) or in_features < 0:
        raise ValueError(f"{where}: in_features must be an int >= 0, got {in_features!r}")
    tiles = -(-in_features // DECODE_TILE_ROWS)
    if words.shape[0] != tiles * DECODE_SLICE_ROWS:
        raise ValueError(
            f"{where}: {in_features} input rows take {tiles * DECODE_SLICE_ROWS} word rows, got "
            f"{words.shape[0]}"
        )
    n = words.shape[1]
    w = words.to(torch.int32).view(tiles, 1, DECODE_SLICE_ROWS, n)
    shifts = (4 * torch.arange(_NIBBLES, device=words.device, dtype=torch.int32)).view(1, -1, 1, 1)
    codes = (w >> shifts) & 0xF
    return codes.reshape(tiles * DECODE_TILE_ROWS, n)[:in_features].to(torch.uint8)


@checked_record
class ScaleSplit(NamedTuple):
    """Scales split into two parts in a half dtype: ``scale == hi + lo`` exactly, and
    ``d · lo`` exact for every ``d`` in ``-16..15``."""

    hi: Float[Tensor, "groups out"]
    """The scale rounded to the dtype."""
    lo: Float[Tensor, "groups out"]
    """The remainder ``scale - hi`` (exact in the dtype)."""


def split_scales(scales: Float[Tensor, "groups out"], dtype: torch.dtype) -> ScaleSplit | None:
    """``scale = hi + lo`` in ``dtype`` with ``fma(d, hi, d · lo)`` equal to the exact product
    ``scale · d`` rounded once to ``dtype``, for every ``d`` in ``-16..15``; ``None`` where some
    scale has no such split (e.g. float32 scales with more bits than two halves carry).

    Args:
      scales: floating ``(groups, out)`` GPTQ scales (finite).
      dtype: float16 or bfloat16, the activations' dtype.
      words: this weight's decode words already staged (for the other dtype), used as they
        are; None stages them.

    Returns:
      A :class:`ScaleSplit`, or None.

    Raises:
      TypeError: ``dtype`` not float16/bfloat16, or non-floating ``scales``.

    Numerics: exact checks (``lo``'s products and the sum) over every ``d``; the fused
    multiply-add rounds ``d · hi + d · lo = d · scale`` once.

    Example:
      >>> s = torch.tensor([[0.1, 3.0]], dtype=torch.float16)
      >>> split = split_scales(s, torch.bfloat16)
      >>> bool((split.hi.float() + split.lo.float() == s.float()).all())
      True
      >>> split_scales(torch.tensor([[0.1]]), torch.bfloat16) is None  # float32: 24 bits
      True
    """
    where = "split_scales"
    if dtype not in _HALF:
        raise TypeError(f"{where}: dtype must be float16 or bfloat16, got {dtype!r}")
    if not isinstance(scales, torch.Tensor) or not scales.is_floating_point():
        raise TypeError(f"{where}: scales must be a floating tensor")
    s = scales.to(torch.float32)
    if scales.dtype == torch.float64 and not bool((s.double() == scales).all()):
        return None
    hi = s.to(dtype)
    rest = s - hi.float()  # exact in float32
    lo = rest.to(dtype)
    if not bool((lo.float() == rest).all()) or not bool(torch.isfinite(hi).all()):
        return None
    lo32 = lo.float()
    for d in range(-16, 16):
        product = lo32 * d  # exact in float32 (at most 11 + 5 significant bits)
        if not bool((product.to(dtype).float() == product).all()):
            return None
    return ScaleSplit(hi.contiguous(), lo.contiguous())


@checked_record
class DecodeOperands(NamedTuple):
    """What the W4A16 decode kernel reads for one weight and one activation dtype."""

    words: Int16[Tensor, "words out"]
    """The decode words (:func:`stage_decode_words`)."""
    zeros: UInt8[Tensor, "groups out"]
    """uint8 ``(groups, out)`` zero points (the v2 meaning, whatever the format)."""
    hi: Float[Tensor, "groups out"]
    """The scales' first part in the activations' dtype (:func:`split_scales`)."""
    lo: Float[Tensor, "groups out"]
    """The remainder, in the same dtype."""


def gptq_decode_operands(
    packed: GPTQPacked,
    *,
    format: str = "gptq",
    group_size: int,
    dtype: torch.dtype,
    words: Int16[Tensor, "words out"] | None = None,
) -> tuple[DecodeOperands | None, str | None]:
    """``(operands, None)`` for the W4A16 decode kernel, or ``(None, why)`` where it cannot read
    this weight exactly.

    Args:
      packed: 4-bit GPTQ tensors whose ``g_idx`` is ``arange(in) // group_size`` (the caller
        vouches; ``GPTQLinear.contiguous_group_size`` checks it).
      format: the zero-point convention, ``"gptq"`` or ``"gptq_v2"``.
      group_size: the contiguous group size (``in`` for one group).
      dtype: float16 or bfloat16, the activations' dtype.
      words: this weight's decode words already staged (for the other dtype), used as they
        are; None stages them.

    Returns:
      The operands, or the reason: a group size that is neither a multiple of 32 nor the whole
      input, or scales with no exact split in ``dtype`` (:func:`split_scales`).

    Raises:
      TypeError, ValueError: what :func:`floatxq.unpack_gptq` refuses (4-bit).

    Numerics: exact staging; the kernel's decode equals :func:`floatxq.dequantize_gptq`.
    """
    where = "gptq_decode_operands"
    u = _unpack(packed, bits=_check_bits(4, where=where), format=format, where=where)
    k = u.codes.shape[0]
    if group_size < k and group_size % DECODE_SLICE_ROWS:
        return None, (
            f"group_size={group_size} is not a multiple of {DECODE_SLICE_ROWS} (each 32-row "
            f"slice of the decode words must lie in one group)"
        )
    split = split_scales(u.scales, dtype)
    if split is None:
        return None, (f"the {u.scales.dtype} scales do not split exactly into two {dtype} parts")
    words = stage_decode_words(u.codes) if words is None else words
    operands = DecodeOperands(words, u.zeros.contiguous(), split.hi, split.lo)
    return operands, None
