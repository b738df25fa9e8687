"""Checkpoint files: safetensors shards, config.json and quantize_config.json, written atomically.

A save writes everything into a hidden temporary directory beside the target and renames it into
place at the end, so a save that fails or is killed leaves no partial model directory (only a
hidden ``.NAME.floatxq-tmp-*`` folder, which the next save to the same target removes). Reading
checks every file it touches and raises :class:`CheckpointError` naming the file, tensor or field.
"""

import json
import os
import shutil
import struct
import uuid
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, NamedTuple

import torch
from safetensors import safe_open
from safetensors.torch import save_file

CONFIG_FILE = "config.json"
QUANTIZE_CONFIG_FILE = "quantize_config.json"
SINGLE_SHARD_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
DEFAULT_MAX_SHARD_BYTES = 4 * 1024**3
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "added_tokens.json",
    "generation_config.json",
)
_TMP_MARK = ".floatxq-tmp-"
_OLD_MARK = ".floatxq-old-"


class CheckpointError(ValueError):
    """A checkpoint file is missing, corrupt, truncated or inconsistent (names the culprit).

    A ``ValueError``, so callers that catch bad input catch it too.

    Numerics: none.
    """


class TensorInfo(NamedTuple):
    """What a safetensors header says about one tensor (no data is read)."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    file: str


# ----------------------------------------------------------------------------------------------
# Writing
# ----------------------------------------------------------------------------------------------


def _unique_tensors(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Drop later names sharing storage with an earlier one (tied weights); CPU, contiguous."""
    seen: set[tuple[int, int, tuple[int, ...]]] = set()
    out: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        key = (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape))
        if tensor.numel() and key in seen:
            continue
        seen.add(key)
        out[name] = tensor.detach().to("cpu").contiguous()
    return out


def _shards(tensors: Mapping[str, torch.Tensor], max_bytes: int) -> list[dict[str, torch.Tensor]]:
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, tensor in tensors.items():
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and size + nbytes > max_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = tensor
        size += nbytes
    return shards


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _write_json(path: Path, payload: Any) -> None:
    with open(path, "w", encoding="utf-8") as fh:
        json.dump(payload, fh, indent=2, sort_keys=True)
        fh.write("\n")
        fh.flush()
        os.fsync(fh.fileno())


def _remove_stale(target: Path) -> None:
    for mark in (_TMP_MARK, _OLD_MARK):
        for stale in target.parent.glob(f".{target.name}{mark}*"):
            shutil.rmtree(stale, ignore_errors=True)


def write_checkpoint(
    path: str | os.PathLike[str],
    state: Mapping[str, torch.Tensor],
    *,
    config: Mapping[str, Any],
    quantize_config: Mapping[str, Any] | None = None,
    extra_files: Mapping[str, str | os.PathLike[str]] | None = None,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    overwrite: bool = False,
) -> Path:
    """Write a model directory atomically: shards, index, config.json, quantize_config.json.

    Args:
      path: the model directory to create.
      state: tensor name → tensor (moved to CPU; tied duplicates are stored once).
      config: the model's ``config.json`` payload (already holding ``quantization_config``).
      quantize_config: the ``quantize_config.json`` payload (omitted when None).
      extra_files: file name → source path copied in (tokenizer files and the like).
      max_shard_bytes: shard size limit; one file ``model.safetensors`` when everything fits.
      overwrite: replace an existing directory (swapped in only after the new one is complete).

    Raises:
      FileExistsError: ``path`` exists and ``overwrite`` is False.

    Numerics: bytes are written as they are (FP8 stays FP8); nothing is converted.
    """
    target = Path(path).absolute()
    if target.exists() and not overwrite:
        raise FileExistsError(
            f"save: {target} already exists; choose a new directory or pass overwrite=True"
        )
    if max_shard_bytes <= 0:
        raise ValueError(f"save: max_shard_bytes must be positive, got {max_shard_bytes}")
    target.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale(target)
    tmp = target.parent / f".{target.name}{_TMP_MARK}{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        tensors = _unique_tensors(state)
        shards = _shards(tensors, max_shard_bytes)
        metadata = {"format": "pt"}
        if len(shards) == 1:
            save_file(shards[0], str(tmp / SINGLE_SHARD_FILE), metadata=metadata)
        else:
            weight_map = {}
            for i, shard in enumerate(shards, start=1):
                name = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
                save_file(shard, str(tmp / name), metadata=metadata)
                weight_map.update(dict.fromkeys(shard, name))
            total = sum(t.numel() * t.element_size() for t in tensors.values())
            _write_json(
                tmp / INDEX_FILE, {"metadata": {"total_size": total}, "weight_map": weight_map}
            )
        _write_json(tmp / CONFIG_FILE, dict(config))
        if quantize_config is not None:
            _write_json(tmp / QUANTIZE_CONFIG_FILE, dict(quantize_config))
        for name, source in (extra_files or {}).items():
            shutil.copyfile(source, tmp / name)
        for file in tmp.iterdir():
            with open(file, "rb") as fh:
                os.fsync(fh.fileno())
        _fsync_dir(tmp)
        if target.exists():
            old = target.parent / f".{target.name}{_OLD_MARK}{uuid.uuid4().hex[:8]}"
            os.replace(target, old)
            os.replace(tmp, target)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, target)
        _fsync_dir(target.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target


# ----------------------------------------------------------------------------------------------
# Reading
# ----------------------------------------------------------------------------------------------


def read_json(path: str | os.PathLike[str], *, what: str) -> dict[str, Any]:
    """Parse a JSON object file, raising :class:`CheckpointError` naming it when it is bad."""
    file = Path(path)
    if not file.is_file():
        raise CheckpointError(f"{what}: {file} is missing")
    try:
        payload = json.loads(file.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{what}: {file} is not valid JSON ({exc})") from None
    if not isinstance(payload, dict):
        raise CheckpointError(
            f"{what}: {file} must hold a JSON object, got {type(payload).__name__}"
        )
    return payload


def shard_files(path: str | os.PathLike[str]) -> list[Path]:
    """The safetensors files of a model directory (via the index when there is one)."""
    root = Path(path)
    if not root.is_dir():
        raise CheckpointError(f"checkpoint: {root} is not a directory")
    index = root / INDEX_FILE
    if index.exists():
        weight_map = read_json(index, what="checkpoint index").get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise CheckpointError(f"checkpoint index: {index} has no 'weight_map'")
        files = sorted({root / str(f) for f in weight_map.values()})
        for file in files:
            if not file.is_file():
                raise CheckpointError(f"checkpoint: shard {file} named by {index.name} is missing")
        return files
    single = root / SINGLE_SHARD_FILE
    if single.is_file():
        return [single]
    found = sorted(root.glob("*.safetensors"))
    if not found:
        raise CheckpointError(f"checkpoint: no *.safetensors files in {root}")
    return found


def _check_header(file: Path) -> None:
    """Reject a truncated safetensors file before handing it to the reader."""
    size = file.stat().st_size
    with open(file, "rb") as fh:
        head = fh.read(8)
        if len(head) < 8:
            raise CheckpointError(f"checkpoint: {file} is truncated (no safetensors header)")
        (header_len,) = struct.unpack("<Q", head)
        if header_len > size - 8:
            raise CheckpointError(f"checkpoint: {file} is truncated (header runs past the end)")
        try:
            header = json.loads(fh.read(header_len))
        except (UnicodeDecodeError, json.JSONDecodeError):
            raise CheckpointError(f"checkpoint: {file} has a corrupt safetensors header") from None
    end = max(
        (int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__"), default=0
    )
    if 8 + header_len + end > size:
        raise CheckpointError(
            f"checkpoint: {file} is truncated ({size} bytes; the header needs "
            f"{8 + header_len + end})"
        )


def tensor_infos(path: str | os.PathLike[str]) -> list[TensorInfo]:
    """Names, dtypes and shapes of every tensor in a checkpoint, read from headers only."""
    infos = []
    for file in shard_files(path):
        _check_header(file)
        try:
            with safe_open(str(file), framework="pt") as reader:
                for name in reader.keys():
                    sl = reader.get_slice(name)
                    infos.append(
                        TensorInfo(name, str(sl.get_dtype()), tuple(sl.get_shape()), file.name)
                    )
        except CheckpointError:
            raise
        except Exception as exc:  # safetensors raises its own error types
            raise CheckpointError(f"checkpoint: cannot read {file} ({exc})") from None
    return infos


def iter_tensors(
    path: str | os.PathLike[str], *, device: str | torch.device = "cpu"
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(name, tensor)`` for every tensor of a checkpoint, one shard at a time."""
    for file in shard_files(path):
        _check_header(file)
        try:
            with safe_open(str(file), framework="pt", device=str(device)) as reader:
                for name in reader.keys():
                    yield name, reader.get_tensor(name)
        except CheckpointError:
            raise
        except Exception as exc:
            raise CheckpointError(f"checkpoint: cannot read {file} ({exc})") from None


def header_metadata(path: str | os.PathLike[str]) -> dict[str, str]:
    """The safetensors ``__metadata__`` string maps of every shard, merged (headers only).

    Raises:
      CheckpointError: a truncated or unreadable shard, or two shards that give one key
        different values (named).
    """
    merged: dict[str, str] = {}
    origin: dict[str, str] = {}
    for file in shard_files(path):
        _check_header(file)
        try:
            with safe_open(str(file), framework="pt") as reader:
                metadata = reader.metadata() or {}
        except Exception as exc:
            raise CheckpointError(f"checkpoint: cannot read {file} ({exc})") from None
        for key, value in metadata.items():
            if key in merged and merged[key] != value and key != "format":
                raise CheckpointError(
                    f"checkpoint: safetensors metadata {key!r} differs between {origin[key]} and "
                    f"{file.name}"
                )
            merged.setdefault(key, value)
            origin.setdefault(key, file.name)
    return merged
