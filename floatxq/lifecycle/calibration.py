"""Calibration data for the calibrated lifecycles: samples in, padded and masked batches out.

A calibration set is a sequence of samples. Each sample is a string (tokenized with the model's
tokenizer), a 1-D integer tensor of token ids, a list of ints, or a mapping with ``input_ids`` (and
optionally an ``attention_mask`` whose zeros are leading or trailing padding, removed here). A
2-D integer tensor counts as one sample per row. Samples of at most
:data:`CALIBRATION_MIN_LENGTH` tokens are dropped (a warning says how many); the rest are grouped
``batch_size`` at a time in the given order, right-padded to the longest sample of their batch,
with a keep-mask that is False exactly on the padding, so padding never reaches a Hessian.
"""

import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
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


def _sample_ids(sample: Any, index: int, tokenizer: Tokenizer | None) -> Tensor:
    if isinstance(sample, str):
        return _ids_of_text(sample, tokenizer, index)
    if isinstance(sample, Mapping):
        return _ids_of_mapping(sample, index)
    return _ids_of_tokens(sample, index)


def _flatten(calibration: Any) -> Sequence[Any]:
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


def prepare_calibration(
    calibration: Any,
    *,
    tokenizer: Tokenizer | None = None,
    batch_size: int = 1,
    min_length: int = CALIBRATION_MIN_LENGTH,
    pad_token_id: int = 0,
    vocab_size: int | None = None,
    max_length: int | None = None,
) -> CalibrationSet:
    """Tokenize, filter and batch calibration samples.

    Args:
      calibration: the samples (see the module docstring for the accepted kinds).
      tokenizer: turns string samples into ids (required only when a sample is a string).
      batch_size: samples per batch (≥ 1), in the given order.
      min_length: samples with at most this many tokens are dropped (≥ 0).
      pad_token_id: the id written into padding (never seen by a Hessian: the mask excludes it).
      vocab_size: when given, every id must lie in ``[0, vocab_size)``.
      max_length: when given, a longer sample is refused (floatxq never truncates).

    Returns:
      :class:`CalibrationSet`; warns (``UserWarning``) with the count of dropped samples.

    Raises:
      ValueError: no samples, every sample too short, an id outside the vocabulary, a sample
        longer than ``max_length``, a string sample without a tokenizer, a bad mask.
      TypeError: a sample of an unsupported kind or a non-integer tensor.

    Numerics: exact integer handling; the order of samples is kept.

    Example:
      >>> cal = prepare_calibration([list(range(12)), list(range(3)), list(range(11))],
      ...                           batch_size=2)  # doctest: +SKIP
      >>> cal.samples, cal.dropped, cal.batches[0].attention_mask.sum().item()  # doctest: +SKIP
      (2, 1, 23)
    """
    where = "calibration"
    for name, value, low in (("batch_size", batch_size, 1), ("min_length", min_length, 0)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"{where}: {name} must be an int >= {low}, got {value!r}")
    samples = _flatten(calibration)
    if not samples:
        raise ValueError(f"{where}: no samples were given; pass at least one calibration sample")
    kept: list[Tensor] = []
    dropped = 0
    for index, sample in enumerate(samples):
        ids = _sample_ids(sample, index, tokenizer)
        if ids.numel() <= min_length:
            dropped += 1
            continue
        outside = (ids < 0) if vocab_size is None else (ids < 0) | (ids >= vocab_size)
        if bool(outside.any()):
            bad = ids[outside][:4].tolist()
            accepted = "the model's vocabulary " if vocab_size is not None else ""
            raise ValueError(
                f"{where}: sample {index} has token ids {bad} outside {accepted}"
                f"[0, {vocab_size if vocab_size is not None else 'vocab_size'})"
            )
        if max_length is not None and ids.numel() > max_length:
            raise ValueError(
                f"{where}: sample {index} has {ids.numel()} tokens, more than the model's "
                f"{max_length} positions; split or shorten it (floatxq never truncates)"
            )
        kept.append(ids)
    if not kept:
        raise ValueError(
            f"{where}: all {len(samples)} samples have at most {min_length} tokens "
            f"(calibration_data_min_length), so nothing usable is left; give longer samples"
        )
    if dropped:
        warnings.warn(
            f"{where}: dropped {dropped} of {len(samples)} samples with at most {min_length} "
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


__all__ = [
    "CALIBRATION_MIN_LENGTH",
    "CalibrationBatch",
    "CalibrationSet",
    "Tokenizer",
    "prepare_calibration",
]
