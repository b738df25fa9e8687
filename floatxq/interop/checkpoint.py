"""Checkpoint directories written atomically: safetensors shards, index, config.json and
quantize_config.json, and the file names and error every reader and writer shares.

A save writes everything into a hidden temporary directory beside the target and renames it into
place at the end, so a save that fails or is killed leaves no partial model directory (only a
hidden ``.NAME.floatxq-tmp-*`` folder, which the next save to the same target removes). A save
that replaces a directory keeps the old one, complete, as ``.NAME.floatxq-old-*`` until the new
one is in place; if it is cut short in between, :func:`recover_interrupted_save` (run by the next
save) puts the old one back. Reading the files back is :mod:`floatxq.interop.shards`.
"""

import json
import os
import re
import shutil
import time
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
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
# What follows a mark in a hidden folder's name: ``PID-HEX`` (tmp), ``NANOSECONDS-HEX`` (old) or a
# bare ``HEX`` (old, from earlier floatxq versions). Matched exactly, never as a glob pattern, so a
# target named ``m*`` or ``m[1]`` never reaches another model's folders.
_MARK_SUFFIX = re.compile(r"[0-9a-f]+(?:-[0-9a-f]+)?")


class CheckpointError(ValueError):
    """A checkpoint file is missing, corrupt, truncated or inconsistent (names the culprit).

    A ``ValueError``, so callers that catch bad input catch it too.

    Numerics: none.
    """


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


def _hidden(target: Path, mark: str) -> list[Path]:
    """The hidden ``.NAME<mark>*`` folders of saves to ``target``, sorted by name (oldest first)."""
    prefix = f".{target.name}{mark}"
    try:
        names = os.listdir(target.parent)
    except OSError:  # no parent yet, or not a directory: nothing was left there
        return []
    return sorted(
        target.parent / name
        for name in names
        if name.startswith(prefix) and _MARK_SUFFIX.fullmatch(name[len(prefix) :])
    )


def _tmp_name(target: Path) -> Path:
    return target.parent / f".{target.name}{_TMP_MARK}{os.getpid()}-{uuid.uuid4().hex[:8]}"


def _discard(path: Path) -> None:
    """Remove a folder (or a stray file) if possible; whatever stays is swept by the next save."""
    try:
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)
    except OSError:
        pass


def _retire(old: Path, target: Path) -> None:
    """Delete a superseded ``-old-`` copy of ``target`` (which exists), renaming it first.

    The rename to a ``-tmp-`` name comes first, so a deletion cut short leaves a ``-tmp-`` folder
    (never restored) and every ``-old-`` folder is a complete checkpoint.
    """
    doomed = _tmp_name(target)
    try:
        os.replace(old, doomed)
    except OSError:
        return  # still complete; the next save retries
    _discard(doomed)


def _remove_stale(target: Path) -> None:
    """Sweep what earlier saves to ``target`` left: all ``-tmp-`` folders, and ``-old-`` ones
    only while ``target`` exists (never the only copy of a model; see recover_interrupted_save)."""
    for stale in _hidden(target, _TMP_MARK):
        _discard(stale)
    if os.path.lexists(target):
        for old in _hidden(target, _OLD_MARK):
            _retire(old, target)


def recover_interrupted_save(path: str | os.PathLike[str]) -> bool:
    """Put back a model directory whose replacement by an overwriting save was cut short.

    A save that replaces a directory renames it to a hidden ``.NAME.floatxq-old-*`` folder, renames
    the finished new one into place, and only then deletes the old one. A kill or failure between
    the two renames leaves ``path`` missing and its previous contents, complete, in that folder;
    this renames the folder back (the newest, if there are several). Every save calls it first.

    Args:
      path: the model directory.

    Returns:
      True when a directory was put back; False when ``path`` exists or nothing is there to restore.

    Raises:
      OSError: the rename back failed (the hidden folder stays, so a later call can retry).

    Numerics: none; folders are renamed, no file is read or rewritten.

    Example:
      >>> import tempfile
      >>> recover_interrupted_save(Path(tempfile.gettempdir()) / "no-such-model-dir")
      False
    """
    target = Path(os.path.abspath(os.fspath(path)))
    if os.path.lexists(target):
        return False
    olds = _hidden(target, _OLD_MARK)
    if not olds:
        return False
    os.replace(olds[-1], target)
    _fsync_dir(target.parent)
    return True


def _save_target(path: str | os.PathLike[str]) -> Path:
    """The absolute directory a save writes, refusing ones whose replacement would be a disaster."""
    given = os.fspath(path)
    target = Path(os.path.abspath(given))
    resolved = target.resolve()
    places = []
    try:
        places.append((Path.cwd().resolve(), "the current working directory"))
    except OSError:  # the working directory was deleted: nothing to protect there
        pass
    try:
        places.append((Path.home().resolve(), "the home directory"))
    except (RuntimeError, KeyError, OSError):  # no home directory known
        pass
    why = "a filesystem root" if resolved.parent == resolved else None
    for place, name in places:
        if why is None and resolved == place:
            why = name
        elif why is None and resolved in place.parents:
            why = f"a directory holding {name} {place}"
    if why is not None:
        raise ValueError(
            f"save: path {given!r} resolves to {resolved}, {why}; give the model a directory of "
            "its own"
        )
    return target


def _cannot_write(exc: OSError, parent: Path) -> OSError:
    """``exc`` with a message naming the directory a save could not create its folder in."""
    where = next((p for p in (parent, *parent.parents) if os.path.lexists(p)), parent)
    reason = exc.strerror or str(exc)
    err = type(exc)(f"save: cannot write in {where} ({reason}); choose another output directory")
    err.errno = exc.errno
    return err


def _swap(tmp: Path, target: Path, *, replacing: bool) -> None:
    """Rename the finished ``tmp`` to ``target``, so that at every instant ``target`` holds the old
    or the new checkpoint, or is missing while its old one waits, complete, in an ``-old-`` folder.

    When the second rename fails the old one is renamed back; when even that fails it stays for
    :func:`recover_interrupted_save`. The old copy is deleted only once the new one is in place.
    """
    if not replacing:
        os.replace(tmp, target)
        _fsync_dir(target.parent)
        return
    old = target.parent / f".{target.name}{_OLD_MARK}{time.time_ns():020d}-{uuid.uuid4().hex[:8]}"
    os.replace(target, old)
    try:
        os.replace(tmp, target)
    except BaseException as exc:
        try:
            os.replace(old, target)
        except OSError:
            if hasattr(exc, "add_note"):  # Python 3.11+
                exc.add_note(
                    f"save: the previous {target.name} is kept in {old}; the next save to "
                    f"{target} or recover_interrupted_save({str(target)!r}) puts it back"
                )
        raise
    _fsync_dir(target.parent)  # the new directory is durably in place before the old one goes
    _retire(old, target)


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
      overwrite: replace an existing directory (swapped in only after the new one is complete;
        until then the old one stays complete, in place or in a hidden ``-old-`` folder that
        :func:`recover_interrupted_save` puts back).

    Raises:
      FileExistsError: ``path`` exists and ``overwrite`` is False.
      ValueError: ``path`` is the working directory, the home directory, a filesystem root or a
        directory holding one of them; an existing plain file or symbolic link; or
        ``max_shard_bytes`` is not a positive int.
      OSError: the directory cannot be created (the message names the directory; nothing is
        left behind), or writing failed.

    Numerics: bytes are written as they are (FP8 stays FP8); nothing is converted.
    """
    target = _save_target(path)
    if not isinstance(max_shard_bytes, int) or isinstance(max_shard_bytes, bool):
        raise ValueError(f"save: max_shard_bytes must be an int of bytes, got {max_shard_bytes!r}")
    if max_shard_bytes < 1:
        raise ValueError(f"save: max_shard_bytes must be positive, got {max_shard_bytes}")
    recover_interrupted_save(target)
    replacing = os.path.lexists(target)
    if replacing and not overwrite:
        if target.is_symlink() or not target.is_dir():
            kind = "a symbolic link" if target.is_symlink() else "not a directory"
            raise FileExistsError(f"save: {target} already exists and is {kind}; choose another")
        raise FileExistsError(
            f"save: {target} already exists; choose a new directory or pass overwrite=True"
        )
    if replacing and target.is_symlink():
        raise ValueError(
            f"save: {target} is a symbolic link; overwrite=True replaces only a directory (save "
            f"to {target.resolve()} or remove the link)"
        )
    if replacing and not target.is_dir():
        raise ValueError(
            f"save: {target} is not a directory; overwrite=True replaces only a model directory"
        )
    created = [d for d in (target.parent, *target.parent.parents) if not os.path.lexists(d)]
    tmp: Path | None = None
    try:
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise _cannot_write(exc, target.parent) from None
        _remove_stale(target)
        tmp = _tmp_name(target)
        try:
            tmp.mkdir()
        except OSError as exc:
            raise _cannot_write(exc, target.parent) from None
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
        _swap(tmp, target, replacing=replacing)
    except BaseException:
        if tmp is not None:
            _discard(tmp)
        for made in created:  # parents this call created, deepest first; only while empty
            try:
                os.rmdir(made)
            except OSError:
                pass
        raise
    return target
