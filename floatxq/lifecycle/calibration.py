"""Calibration data for the calibrated lifecycles: samples in, padded and masked batches out.

A calibration set is a sequence of samples. Each sample is a string (tokenized with the model's
tokenizer), a 1-D integer tensor of token ids, a list of ints, or a mapping with ``input_ids`` (and
optionally an ``attention_mask`` whose zeros are leading or trailing padding, removed here). A
2-D integer tensor counts as one sample per row. Samples of at most
:data:`CALIBRATION_MIN_LENGTH` tokens are dropped (a warning says how many); the rest are grouped
``batch_size`` at a time in the given order, right-padded to the longest sample of their batch,
with a keep-mask that is False exactly on the padding, so padding never reaches a Hessian.
"""

import os
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any, NamedTuple

import torch

from floatxq._typing import Bool, Int64, Tensor

CALIBRATION_MIN_LENGTH = 10
"""Samples with at most this many tokens are dropped (GPT-QModel's
``calibration_data_min_length``)."""

Tokenizer = Callable[[str], Any]
"""Anything that turns a string into token ids: a Hugging Face tokenizer (its ``input_ids``) or a
function returning a 1-D integer tensor or a list of ints."""


class CalibrationBatch(NamedTuple):
    """One padded batch of calibration samples."""

    input_ids: Int64[Tensor, "batch length"]
    """int64 ids, right-padded with the pad id."""
    attention_mask: Bool[Tensor, "batch length"]
    """True on real tokens, False on padding (the keep-mask of every Hessian fold)."""


class CalibrationSet(NamedTuple):
    """The batches a calibrated lifecycle runs, and what was kept of the given samples."""

    batches: tuple[CalibrationBatch, ...]
    samples: int
    """Samples kept."""
    dropped: int
    """Samples dropped for having at most ``min_length`` tokens."""
    tokens: int
    """Real (unpadded) tokens over all kept samples."""


def _ids_of_text(text: str, tokenizer: Tokenizer | None, index: int) -> Tensor:
    if tokenizer is None:
        raise ValueError(
            f"calibration: sample {index} is a string, but this model has no tokenizer; pass "
            f"token-id tensors, load a model directory that holds tokenizer files, or give "
            f"quantize(..., tokenizer=...)"
        )
    encoded = tokenizer(text)
    if isinstance(encoded, Mapping) or hasattr(encoded, "input_ids"):
        encoded = encoded["input_ids"] if isinstance(encoded, Mapping) else encoded.input_ids
    return _ids_of_tokens(encoded, index, what="the tokenizer's output for")


INT64_MAX = 2**63 - 1


def exact_int64(ids: Tensor, *, label: str, where: str) -> Tensor:
    """``ids`` (an integer tensor of any width, unsigned included) as int64 on the CPU, exactly.

    ``uint64`` values of 2**63 and more have no int64 (a plain cast wraps them negative) and
    unsigned tensors wider than a byte support no comparison in torch, so this converts first
    and checks after.

    Raises:
      TypeError: a floating, complex or bool dtype, or a meta tensor. ValueError: a ``uint64``
        value beyond int64 (named with the dtype).

    Numerics: exact integer conversion.
    """
    dtype = ids.dtype
    if dtype.is_floating_point or dtype.is_complex or dtype == torch.bool:
        raise TypeError(f"{where}: {label} must hold integer token ids, got dtype {dtype}")
    if ids.is_meta:
        raise TypeError(f"{where}: {label} is a meta tensor; it holds no token ids")
    wide = ids.detach().to(device="cpu", dtype=torch.int64)
    if dtype == torch.uint64 and wide.numel() and bool((wide < 0).any()):
        position = int(torch.nonzero(wide < 0).flatten()[0]) if wide.ndim == 1 else None
        value = int(wide[wide < 0][0]) + 2**64
        at = f" at position {position}" if position is not None else ""
        raise ValueError(
            f"{where}: {label} holds the {dtype} id {value}{at}, beyond int64; token ids are "
            f"integers in [0, vocab_size)"
        )
    return wide


def _ids_of_tokens(value: Any, index: int, *, what: str = "") -> Tensor:
    label = f"{what} sample {index}".strip()
    if isinstance(value, torch.Tensor):
        if value.ndim == 2 and value.shape[0] == 1:
            value = value[0]
        if value.ndim != 1:
            raise ValueError(
                f"calibration: {label} must be a 1-D sequence of token ids, got shape "
                f"{tuple(value.shape)}"
            )
        return exact_int64(value, label=label, where="calibration")
    if isinstance(value, (list, tuple)):
        if value and isinstance(value[0], (list, tuple)) and len(value) == 1:
            value = value[0]
        for position, v in enumerate(value):
            if not isinstance(v, int) or isinstance(v, bool):
                raise TypeError(
                    f"calibration: {label} must be a list of int token ids; position "
                    f"{position} is {type(v).__name__}"
                )
            if not -INT64_MAX - 1 <= v <= INT64_MAX:  # (str() of a huge int itself raises)
                shown = (
                    f"the id {v}" if v.bit_length() <= 128 else f"an id of {v.bit_length()} bits"
                )
                raise ValueError(
                    f"calibration: {label} has {shown} at position {position}, beyond int64; "
                    f"token ids are integers in [0, vocab_size)"
                )
        return torch.tensor(list(value), dtype=torch.int64)
    raise TypeError(
        f"calibration: {label} must be a string, a 1-D integer tensor, a list of ints or a "
        f"mapping with 'input_ids', got {type(value).__name__}"
    )


def _ids_of_mapping(sample: Mapping[str, Any], index: int) -> Tensor:
    if "input_ids" not in sample:
        raise ValueError(
            f"calibration: sample {index} is a mapping without 'input_ids' (keys: "
            f"{sorted(map(str, sample))[:8]})"
        )
    ids = _ids_of_tokens(sample["input_ids"], index)
    mask = sample.get("attention_mask")
    if mask is None:
        return ids
    keep = _ids_of_tokens(mask, index, what="the attention_mask of")
    if keep.shape != ids.shape or bool(((keep != 0) & (keep != 1)).any()):
        raise ValueError(
            f"calibration: the attention_mask of sample {index} must be 0/1 with the shape of its "
            f"input_ids {tuple(ids.shape)}, got shape {tuple(keep.shape)}"
        )
    real = torch.nonzero(keep).flatten()
    if real.numel() and real.numel() != int(real[-1] - real[0]) + 1:
        raise ValueError(
            f"calibration: the attention_mask of sample {index} has padding between real tokens; "
            f"only leading or trailing padding can be removed"
        )
    return ids[real]


def _sample_ids(
    sample: Any, index: int, tokenizer: Tokenizer | None, text_column: str = "text"
) -> Tensor:
    if isinstance(sample, str):
        return _ids_of_text(sample, tokenizer, index)
    if isinstance(sample, Mapping):
        if "input_ids" not in sample and isinstance(sample.get(text_column), str):
            return _ids_of_text(sample[text_column], tokenizer, index)
        return _ids_of_mapping(sample, index)
    return _ids_of_tokens(sample, index)


def _dataset_rows(dataset: Any, text_column: str) -> Iterator[Any]:
    """The rows of a Hugging Face ``datasets`` Dataset (duck-typed: ``column_names`` and rows
    as mappings): the ``text_column`` strings, else the ``input_ids`` mappings."""
    columns = dataset.column_names
    if isinstance(columns, Mapping):  # a DatasetDict
        raise TypeError(
            f"calibration: got a dataset of splits {sorted(map(str, columns))}; pass one split, "
            f"e.g. dataset[{next(iter(columns), 'train')!r}]"
        )
    columns = list(columns or ())
    if columns and text_column not in columns and "input_ids" not in columns:
        raise ValueError(
            f"calibration: the dataset has no {text_column!r} or 'input_ids' column (columns: "
            f"{columns[:8]}); name its text column with text_column= (--text-column)"
        )
    return _rows(dataset, text_column)


def _rows(dataset: Any, text_column: str) -> Iterator[Any]:
    for row in dataset:
        if isinstance(row, Mapping) and "input_ids" not in row and text_column in row:
            yield row[text_column]
        else:
            yield row


def _flatten(calibration: Any, text_column: str = "text") -> Iterable[Any]:
    """The samples, lazily for a dataset (rows past ``num_samples`` are never read)."""
    if hasattr(calibration, "column_names") and not isinstance(calibration, (str, bytes)):
        return _dataset_rows(calibration, text_column)
    if isinstance(calibration, torch.Tensor):
        if calibration.ndim == 1:
            return [calibration]
        if calibration.ndim == 2:
            return list(calibration.unbind(0))
        raise ValueError(
            f"calibration: a tensor of token ids must be 1-D (one sample) or 2-D (one sample per "
            f"row), got shape {tuple(calibration.shape)}"
        )
    if isinstance(calibration, (str, bytes, Mapping)) or not isinstance(calibration, Iterable):
        raise TypeError(
            f"calibration: expected a sequence of samples (strings, token-id tensors, lists of "
            f"ints or mappings with 'input_ids'), got {type(calibration).__name__}"
        )
    return list(calibration)


OVERFLOWS: tuple[str, ...] = ("refuse", "truncate", "chunk")
"""What :func:`prepare_calibration` does with samples longer than ``max_length``: refuse them
(the default: nothing is cut without being asked), keep each one's first ``max_length`` tokens,
or concatenate every sample's tokens and cut windows of ``max_length`` (as llm-compressor's
``concatenate_data`` and GPT-QModel's ``calibration_concat_size`` do)."""


def _chunks(pieces: list[Tensor], length: int) -> list[Tensor]:
    """Every piece's tokens in order, cut into windows of ``length`` (the last one shorter)."""
    joined = torch.cat(pieces)
    return list(joined.split(length))


def _check_options(
    batch_size: Any, min_length: Any, max_length: Any, overflow: Any, num_samples: Any
) -> None:
    where = "calibration"
    for name, value, low in (("batch_size", batch_size, 1), ("min_length", min_length, 0)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"{where}: {name} must be an int >= {low}, got {value!r}")
    for name, value in (("max_length", max_length), ("num_samples", num_samples)):
        bad = isinstance(value, bool) or not isinstance(value, int) or value < 1
        if value is not None and bad:
            raise ValueError(f"{where}: {name} must be None or an int >= 1, got {value!r}")
    if overflow not in OVERFLOWS:
        accepted = ", ".join(repr(o) for o in OVERFLOWS)
        raise ValueError(f"{where}: overflow must be one of {accepted}, got {overflow!r}")
    if overflow != "refuse" and max_length is None:
        raise ValueError(
            f"{where}: overflow={overflow!r} cuts samples to max_length, and no max_length was "
            f"given (the model's max_position_embeddings, or a window length)"
        )


def _check_vocab(ids: Tensor, index: int, vocab_size: int | None) -> None:
    outside = (ids < 0) if vocab_size is None else (ids < 0) | (ids >= vocab_size)
    if bool(outside.any()):
        bad = ids[outside][:4].tolist()
        accepted = "the model's vocabulary " if vocab_size is not None else ""
        raise ValueError(
            f"calibration: sample {index} has token ids {bad} outside {accepted}"
            f"[0, {vocab_size if vocab_size is not None else 'vocab_size'})"
        )


def prepare_calibration(
    calibration: Any,
    *,
    tokenizer: Tokenizer | None = None,
    batch_size: int = 1,
    min_length: int = CALIBRATION_MIN_LENGTH,
    pad_token_id: int = 0,
    vocab_size: int | None = None,
    max_length: int | None = None,
    overflow: str = "refuse",
    num_samples: int | None = None,
    text_column: str = "text",
) -> CalibrationSet:
    """Tokenize, filter, cut and batch calibration samples.

    Args:
      calibration: the samples (see the module docstring for the accepted kinds), or a Hugging
        Face ``datasets`` Dataset (anything with ``column_names`` whose rows are mappings): its
        ``text_column`` strings, else its ``input_ids``.
      tokenizer: turns string samples into ids (required only when a sample is a string).
      batch_size: samples per batch (≥ 1), in the given order.
      min_length: samples with at most this many tokens are dropped (≥ 0).
      pad_token_id: the id written into padding (never seen by a Hessian: the mask excludes it).
      vocab_size: when given, every id must lie in ``[0, vocab_size)``.
      max_length: the longest sample (the model's positions, or a shorter window).
      overflow: what a sample longer than ``max_length`` gets (:data:`OVERFLOWS`): ``"refuse"``
        (the default: an error; nothing is cut unless asked), ``"truncate"`` (its first
        ``max_length`` tokens) or ``"chunk"`` (every sample's tokens concatenated in order and
        cut into windows of ``max_length``; the last window is kept when longer than
        ``min_length``).
      num_samples: keep at most this many samples (windows with ``"chunk"``), the first ones;
        the rest are not tokenized.
      text_column: the mapping key / dataset column that holds a sample's text.

    Returns:
      :class:`CalibrationSet`; warns (``UserWarning``) with the count of dropped samples.

    Raises:
      ValueError: no samples, every sample too short, an id outside the vocabulary, a sample
        longer than ``max_length`` (with ``overflow="refuse"``), a string sample without a
        tokenizer, a bad mask, a dataset without the text column, a bad option.
      TypeError: a sample of an unsupported kind or a non-integer tensor; a dataset of splits.

    Numerics: exact integer handling; the order of samples (and tokens) is kept.

    Example:
      >>> cal = prepare_calibration([list(range(12)), list(range(3)), list(range(11))],
      ...                           batch_size=2)  # doctest: +SKIP
      >>> cal.samples, cal.dropped, cal.batches[0].attention_mask.sum().item()  # doctest: +SKIP
      (2, 1, 23)
      >>> cal = prepare_calibration([list(range(30))] * 3, max_length=32, overflow="chunk")
      >>> [len(b.input_ids[0]) for b in cal.batches]
      [32, 32, 26]
    """
    where = "calibration"
    _check_options(batch_size, min_length, max_length, overflow, num_samples)
    chunk = overflow == "chunk"
    seen = 0
    kept: list[Tensor] = []
    dropped = 0
    pieces: list[Tensor] = []
    gathered = 0
    for index, sample in enumerate(_flatten(calibration, text_column)):
        seen += 1
        ids = _sample_ids(sample, index, tokenizer, text_column)
        if chunk:
            _check_vocab(ids, index, vocab_size)
            pieces.append(ids)
            gathered += ids.numel()
            if num_samples is not None and max_length is not None:
                if gathered >= num_samples * max_length:
                    break
            continue
        if ids.numel() <= min_length:
            dropped += 1
            continue
        _check_vocab(ids, index, vocab_size)
        if max_length is not None and ids.numel() > max_length:
            if overflow == "refuse":
                raise ValueError(
                    f"{where}: sample {index} has {ids.numel()} tokens, more than the model's "
                    f"{max_length} positions; shorten it, or pass overflow='chunk' (concatenate "
                    f"the samples and cut windows of {max_length} tokens) or overflow="
                    f"'truncate' (keep each sample's first {max_length}); floatxq never "
                    f"truncates unasked"
                )
            ids = ids[:max_length]
        kept.append(ids)
        if num_samples is not None and len(kept) >= num_samples:
            break
    if not seen:
        raise ValueError(f"{where}: no samples were given; pass at least one calibration sample")
    if chunk:
        assert max_length is not None  # _check_options
        windows = _chunks(pieces, max_length) if gathered else []
        windows = windows[:num_samples] if num_samples is not None else windows
        kept = [w for w in windows if w.numel() > min_length]  # a short last window only
        if not kept:
            raise ValueError(
                f"{where}: the {seen} samples hold {gathered} tokens in all, at most "
                f"{min_length} (calibration_data_min_length), so no window is usable; give "
                f"more text"
            )
    if not kept:
        raise ValueError(
            f"{where}: all {seen} samples have at most {min_length} tokens "
            f"(calibration_data_min_length), so nothing usable is left; give longer samples"
        )
    if dropped:
        warnings.warn(
            f"{where}: dropped {dropped} of {seen} samples with at most {min_length} "
            f"tokens (calibration_data_min_length); {len(kept)} remain",
            UserWarning,
            stacklevel=3,
        )
    batches = []
    for start in range(0, len(kept), batch_size):
        group = kept[start : start + batch_size]
        length = max(ids.numel() for ids in group)
        input_ids = torch.full((len(group), length), pad_token_id, dtype=torch.int64)
        mask = torch.zeros((len(group), length), dtype=torch.bool)
        for row, ids in enumerate(group):
            input_ids[row, : ids.numel()] = ids
            mask[row, : ids.numel()] = True
        batches.append(CalibrationBatch(input_ids, mask))
    tokens = sum(ids.numel() for ids in kept)
    return CalibrationSet(tuple(batches), len(kept), dropped, tokens)


CALIBRATION_FILE_SUFFIXES: tuple[str, ...] = (".txt", ".jsonl", ".json", ".parquet")
"""The local files :func:`load_calibration_file` reads (any other suffix is read as text)."""


def _file_item(item: Any, text_column: str, where: str) -> Any:
    """One record of a ``.jsonl`` / ``.json`` / ``.parquet`` file as a sample."""
    if isinstance(item, Mapping):
        if "input_ids" in item:
            return dict(item)
        if isinstance(item.get(text_column), str):
            return item[text_column]
    if isinstance(item, str) or (isinstance(item, list) and item and isinstance(item[0], int)):
        return item
    raise ValueError(
        f"{where} must be a string, an object with {text_column!r} (a string) or 'input_ids', "
        f"or a list of token ids"
    )


def _json_items(text: str, path: Any, text_column: str) -> list[Any]:
    """A ``.json`` file's records: a JSON array, or JSON lines (what ``Dataset.to_json``
    writes)."""
    from floatxq._checks import bounded_json_loads

    stripped = text.lstrip()
    if stripped.startswith("["):
        items = bounded_json_loads(text, where=f"calibration file {path}")
        return [_file_item(v, text_column, f"{path}: item {i}") for i, v in enumerate(items)]
    out = []
    for number, line in enumerate(text.splitlines(), start=1):
        if line.strip():
            where = f"calibration file {path}: line {number}"
            out.append(_file_item(bounded_json_loads(line, where=where), text_column, where))
    return out


def _parquet_items(path: Any, text_column: str) -> list[Any]:
    try:
        import pyarrow.parquet as pq
    except ImportError as exc:
        raise ImportError(
            f"calibration file {path}: reading .parquet needs pyarrow (pip install "
            f"'floatxq[data]'): {exc}"
        ) from None
    try:
        columns = pq.read_schema(path).names
    except Exception as exc:  # pyarrow raises its own ArrowInvalid for a damaged file
        raise ValueError(f"calibration file {path}: not a readable parquet file ({exc})") from None
    column = text_column if text_column in columns else "input_ids"
    if column not in columns:
        raise ValueError(
            f"calibration file {path}: no {text_column!r} or 'input_ids' column (columns: "
            f"{columns[:8]}); name the text column with text_column= (--text-column)"
        )
    values = pq.read_table(path, columns=[column]).column(column).to_pylist()
    where = f"calibration file {path}: row"
    return [_file_item(v, text_column, f"{where} {i}") for i, v in enumerate(values)]


def load_calibration_file(
    path: str | os.PathLike[str], *, text_column: str = "text", lines: bool = True
) -> list[Any]:
    """Calibration samples from a local file, for :func:`prepare_calibration`.

    * ``.jsonl``: one record per line: a JSON string, an object with ``text_column`` (a string)
      or ``input_ids``, or a list of token ids;
    * ``.json``: a JSON array of such records, or JSON lines (``datasets``' ``to_json``);
    * ``.parquet``: the ``text_column`` column, else ``input_ids`` (needs ``pyarrow``);
    * anything else (``.txt``): UTF-8 text, one sample per non-empty line, or the whole text as
      one sample with ``lines=False`` (for ``overflow="chunk"``: line breaks are kept).

    Raises:
      FileNotFoundError: no such file. ValueError: text that is not UTF-8, JSON that is not,
        a record of another kind, a parquet file without the column. ImportError: ``.parquet``
        without pyarrow.

    Numerics: none (text and ids are returned as read).
    """
    file = Path(path)
    if not file.is_file():
        raise FileNotFoundError(f"calibration file {file}: no such file")
    suffix = file.suffix.lower()
    if suffix == ".parquet":
        return _parquet_items(file, text_column)
    try:
        text = file.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(f"calibration file {file}: not UTF-8 text ({exc})") from None
    if suffix == ".json":
        return _json_items(text, file, text_column)
    if suffix == ".jsonl":
        return _json_items(text if not text.lstrip().startswith("[") else "", file, text_column)
    if not lines:
        return [text] if text.strip() else []
    return [line for line in text.splitlines() if line.strip()]


__all__ = [
    "CALIBRATION_FILE_SUFFIXES",
    "CALIBRATION_MIN_LENGTH",
    "OVERFLOWS",
    "CalibrationBatch",
    "CalibrationSet",
    "Tokenizer",
    "load_calibration_file",
    "prepare_calibration",
]
