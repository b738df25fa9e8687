"""Decode words reordered for the fragment kernels: each GPU thread's codes in one 32-byte run.

The fragment kernels (:mod:`floatxq.kernels.w4a_frag`) hand the weights' transpose to the
tensor cores as the *A* operand of ``mma.sync.m16n8k16`` straight from registers. In that
instruction lane ``4·g + t`` of a warp holds, for a block of 16 output columns and 16 input rows,
the columns ``g`` and ``g + 8`` at the input-row pairs ``2t, 2t + 1`` and ``2t + 8, 2t + 9``. The
fragment words are the decode words (:mod:`floatxq.gptq.decode_words`) permuted so that every
lane reads exactly its codes for a 32-row slice pair as 16 contiguous int16 words: per tile of
128 input rows (32 word rows) and block ``u`` of :data:`~floatxq.formats.FRAGMENT_COLUMNS`
columns, word ``512·u + 16·(4·g + t) + 8·r + 4·s + 2·h + p`` of the tile is decode word
``(32·tile + 16·s + 8·h + 2·t + p, 16·u + 8·r + g)``: its nibble ``j`` holds input row
``128·tile + 32·j + 16·s + 8·h + 2·t + p`` of that column. Columns past ``out`` (up to the next
multiple of 16) hold code 0.
"""

import torch

from floatxq._typing import Int16, Tensor
from floatxq.formats import DECODE_SLICE_ROWS, FRAGMENT_COLUMNS

__all__ = ["stage_fragment_words", "unstage_fragment_words"]

# one tile's word rows and one column block as the lane order's factors: (s, h, t, p) x (u, r, g)
_ROWS = (2, 2, 4, 2)
_COLUMNS = (2, 8)


def _check(words: object, where: str) -> None:
    if not isinstance(words, torch.Tensor) or words.dtype != torch.int16 or words.ndim != 2:
        raise TypeError(f"{where}: words must be a 2-D int16 tensor")
    if words.shape[0] % DECODE_SLICE_ROWS:
        raise ValueError(
            f"{where}: words must have a multiple of {DECODE_SLICE_ROWS} rows (whole tiles), "
            f"got {words.shape[0]}"
        )


def stage_fragment_words(words: Int16[Tensor, "words out"]) -> Int16[Tensor, "words padded"]:
    """The fragment words of decode words (see the module docstring for the order).

    Args:
      words: int16 decode words ``(tiles · 32, out)`` (:func:`floatxq.gptq.decode_words.
        stage_decode_words`).

    Returns:
      int16 ``(tiles · 32, ceil(out / 16) · 16)``, contiguous; columns past ``out`` hold 0.

    Raises:
      TypeError: ``words`` not a 2-D int16 tensor.
      ValueError: a row count that is not whole tiles (a multiple of 32).

    Numerics: exact (a permutation; zero padding).

    Example:
      >>> from floatxq.gptq.decode_words import stage_decode_words
      >>> codes = torch.zeros(128, 16, dtype=torch.uint8)
      >>> codes[2, 9] = 5  # row 2t + p = 2 (t = 1, p = 0), column 8r + g = 9 (r = 1, g = 1)
      >>> frag = stage_fragment_words(stage_decode_words(codes)).flatten()
      >>> int(frag.nonzero()), int(frag[16 * (4 * 1 + 1) + 8])
      (88, 5)
    """
    _check(words, "stage_fragment_words")
    rows, n = words.shape
    padded = -(-n // FRAGMENT_COLUMNS) * FRAGMENT_COLUMNS
    w = torch.zeros((rows, padded), dtype=torch.int16, device=words.device)
    w[:, :n] = words
    w = w.view(rows // DECODE_SLICE_ROWS, *_ROWS, padded // FRAGMENT_COLUMNS, *_COLUMNS)
    # (tile, s, h, t, p, u, r, g) -> (tile, u, g, t, r, s, h, p)
    return w.permute(0, 5, 7, 3, 6, 1, 2, 4).reshape(rows, padded).contiguous()


def unstage_fragment_words(
    frag: Int16[Tensor, "words padded"], out_features: int
) -> Int16[Tensor, "words out"]:
    """The decode words ``(rows, out_features)`` of fragment words: the inverse of
    :func:`stage_fragment_words`.

    Raises:
      TypeError: ``frag`` not a 2-D int16 tensor.
      ValueError: not whole tiles, or a column count other than ``ceil(out_features / 16) · 16``.

    Numerics: exact.

    Example:
      >>> words = torch.randint(-2**15, 2**15, (64, 20), dtype=torch.int16)
      >>> torch.equal(unstage_fragment_words(stage_fragment_words(words), 20), words)
      True
    """
    where = "unstage_fragment_words"
    _check(frag, where)
    if not isinstance(out_features, int) or isinstance(out_features, bool) or out_features < 0:
        raise ValueError(f"{where}: out_features must be an int >= 0, got {out_features!r}")
    rows, padded = frag.shape
    if padded != -(-out_features // FRAGMENT_COLUMNS) * FRAGMENT_COLUMNS:
        raise ValueError(
            f"{where}: {out_features} columns take {-(-out_features // 16) * 16} fragment "
            f"columns, got {padded}"
        )
    w = frag.view(rows // DECODE_SLICE_ROWS, padded // FRAGMENT_COLUMNS, 8, 4, 2, 2, 2, 2)
    # (tile, u, g, t, r, s, h, p) -> (tile, s, h, t, p, u, r, g)
    w = w.permute(0, 5, 6, 3, 7, 1, 4, 2).reshape(rows, padded)
    return w[:, :out_features].contiguous()
