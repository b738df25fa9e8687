"""Checkpoint directories written atomically: safetensors shards, index, config.json and
quantize_config.json, and the file names and error every reader and writer shares.

A save writes everything into a hidden temporary directory beside the target and renames it into
place at the end, so a save that fails or is killed leaves no partial model directory (only a
hidden ``.NAME.floatxq-tmp-PID-HEX`` folder, which a later save to the same target removes once
process ``PID`` is gone). A save that replaces a directory keeps the old one, complete, as
``.NAME.floatxq-old-*`` until the new one is in place; if it is cut short in between,
:func:`recover_interrupted_save` (run by the next save) puts the old one back.

Concurrent saves to one target (processes or threads) are serialized by an advisory lock on
``.NAME.floatxq-lock`` beside it (``fcntl.flock``; :func:`lock_file`), held from the existence
check to the final rename, restoring and retiring ``-old-`` folders included: of two saves with
``overwrite=False`` the second fails with ``FileExistsError``; with ``overwrite=True`` each
publishes a complete checkpoint in turn, and the target is always one complete checkpoint. A save
sweeps a ``-tmp-`` folder only under the lock and only when it is provably dead (its process is
not alive on this host, it is this process's own, or its name has no process id), never a live
save's. The kernel drops a killed save's lock; the lock file is removed by the save holding it (a
killed one leaves it, harmlessly: the next save reuses it). Where ``fcntl`` is missing (Windows)
or the filesystem refuses ``flock`` (a ``RuntimeWarning``), saves are not serialized (do not run
concurrent saves to one target there) and sweep only folders of provably dead processes (on
Windows none can be proven dead: a killed save's folder stays until removed by hand).

What a save writes is checked first (:func:`floatxq.interop.export.export_layout`): tensors that
``floatxq.load`` would refuse are refused before this module creates anything. Reading the files
back is :mod:`floatxq.interop.shards`.
"""

import contextlib
import errno
import json
import math
import os
import re
import shutil
import sys
import time
import uuid
import warnings
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

try:
    import fcntl
except ImportError:  # Windows: no flock; saves are not serialized there (module docstring)
    fcntl = None  # type: ignore[assignment]

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
    "vocab.txt",
    "spiece.model",
    "sentencepiece.bpe.model",
    "tokenizer.tiktoken",
    "chat_template.jinja",
)
"""Files that make up a tokenizer: a directory holding one of them has a tokenizer to load."""
TOKENIZER_LOADABLE_FILES = (
    "tokenizer.json",
    "tokenizer.model",
    "vocab.json",
    "vocab.txt",
    "spiece.model",
    "sentencepiece.bpe.model",
    "tokenizer.tiktoken",
)
"""The tokenizer files that hold a vocabulary (``tokenizer_config.json``,
``special_tokens_map.json``, ``added_tokens.json`` or a chat template alone are no tokenizer)."""
SIDE_FILES = (*TOKENIZER_FILES, "generation_config.json")
"""Files a save copies from the source directory: the tokenizer's, and ``generation_config.json``
(generation defaults, no tokenizer)."""
_TMP_MARK = ".floatxq-tmp-"
_OLD_MARK = ".floatxq-old-"
_LOCK_MARK = ".floatxq-lock"
# What follows a mark in a hidden folder's name: ``PID-HEX`` (tmp), ``NANOSECONDS-HEX`` (old) or a
# bare ``HEX`` (old, from earlier floatxq versions). Matched exactly, never as a glob pattern, so a
# target named ``m*`` or ``m[1]`` never reaches another model's folders.
_MARK_SUFFIX = re.compile(r"[0-9a-f]+(?:-[0-9a-f]+)?")


class CheckpointError(ValueError):
    """A checkpoint file is missing, corrupt, truncated or inconsistent (names the culprit).

    A ``ValueError``, so callers that catch bad input catch it too.

    Numerics: none.
    """


def _unique_names(state: Mapping[str, torch.Tensor]) -> list[str]:
    """The names a save stores, in order: later names sharing storage with an earlier one (tied
    weights) are dropped."""
    seen: set[tuple[int, int, tuple[int, ...]]] = set()
    out: list[str] = []
    for name, tensor in state.items():
        key = (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape))
        if tensor.numel() and key in seen:
            continue
        seen.add(key)
        out.append(name)
    return out


def _unique_tensors(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Drop later names sharing storage with an earlier one (tied weights); CPU, contiguous."""
    return {name: state[name].detach().to("cpu").contiguous() for name in _unique_names(state)}


def _shards(tensors: Mapping[str, torch.Tensor], max_bytes: int) -> list[dict[str, torch.Tensor]]:
    """The shards, in file order, as ``transformers``' ``save_pretrained`` splits a state dict
    (``huggingface_hub``'s ``split_state_dict_into_shards_factory``: in order, a new shard when
    the next tensor would pass ``max_bytes``, a tensor over it alone in its own shard)."""
    from huggingface_hub import split_state_dict_into_shards_factory

    split = split_state_dict_into_shards_factory(
        dict(tensors),
        # the tensor's own bytes (a view's storage can be larger); ties are already dropped
        get_storage_size=lambda t: t.numel() * t.element_size(),
        get_storage_id=lambda t: None,
        filename_pattern="model{suffix}.safetensors",  # the names _write_files gives
        max_shard_size=max_bytes,
    )
    shards = [{n: tensors[n] for n in names} for names in split.filename_to_tensors.values()]
    return shards or [{}]


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


def _pid_alive(pid: int) -> bool | None:
    """Whether process ``pid`` is alive on this host; None when that cannot be told (Windows,
    where ``os.kill`` would terminate it, or a number that is no process id)."""
    if sys.platform == "win32" or pid <= 0:
        return None
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, another user's
        return True
    except (OverflowError, OSError):
        return None
    return True


def _tmp_is_dead(tmp: Path, target: Path, *, locked: bool) -> bool:
    """Whether no live save can be writing the ``-tmp-`` folder ``tmp`` of ``target``.

    Under the lock, saves that take it (this version's) are not writing: only the holder writes a
    temporary, and it writes this call's. So under the lock a folder of this process, or of a
    name without a process id (earlier floatxq versions), is dead. A process id alive on this host
    keeps its folder even then (a save that did not take the lock: an earlier floatxq version, a
    filesystem without ``flock``), and without the lock only a provably dead process id does.
    """
    owner = tmp.name[len(f".{target.name}{_TMP_MARK}") :].partition("-")
    pid = int(owner[0]) if owner[1] and owner[0].isdigit() else None
    if pid is None:
        return locked
    if pid == os.getpid():
        return locked  # this process's: a failed or retired one under the lock; else a thread's
    alive = _pid_alive(pid)
    return locked if alive is None else not alive


def _remove_stale(target: Path, *, locked: bool) -> None:
    """Sweep what earlier saves to ``target`` left: the ``-tmp-`` folders no live save writes
    (:func:`_tmp_is_dead`), and the ``-old-`` ones while ``target`` exists (never the only copy
    of a model; see recover_interrupted_save)."""
    for stale in _hidden(target, _TMP_MARK):
        if _tmp_is_dead(stale, target, locked=locked):
            _discard(stale)
    if os.path.lexists(target):
        for old in _hidden(target, _OLD_MARK):
            _retire(old, target)


# --------------------------------------------------------------------------------------------
# The target's lock
# --------------------------------------------------------------------------------------------


def lock_file(path: str | os.PathLike[str]) -> Path:
    """The advisory lock file of saves to ``path``: ``.NAME.floatxq-lock`` beside it.

    Numerics: none.

    Example:
      >>> lock_file("/models/llama-fp8").name
      '.llama-fp8.floatxq-lock'
    """
    target = Path(os.path.abspath(os.fspath(path)))
    return target.parent / f".{target.name}{_LOCK_MARK}"


def _same_file(fd: int, lock: Path) -> bool:
    """Whether ``lock`` still names the file ``fd`` has open (the holder unlinks it on release)."""
    try:
        named = os.stat(lock, follow_symlinks=False)
    except FileNotFoundError:
        return False
    held = os.fstat(fd)
    return (named.st_dev, named.st_ino) == (held.st_dev, held.st_ino)


_NO_FLOCK = {errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOTSUP, errno.ENOSYS, errno.EINVAL}
"""``flock`` errors of filesystems that do not lock (some network and FUSE filesystems)."""


def _flock(fd: int, lock: Path, target: Path, timeout: float | None, deadline: float) -> bool:
    """Take the exclusive lock on ``fd`` (waiting until ``deadline`` on ``time.monotonic``'s
    clock, or for ever when ``timeout`` is None): True, or False when the filesystem cannot."""
    assert fcntl is not None
    delay = 0.005
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | (0 if timeout is None else fcntl.LOCK_NB))
            return True
        except BlockingIOError:
            pass
        except OSError as exc:
            if exc.errno not in _NO_FLOCK:
                raise
            warnings.warn(
                f"save: the filesystem of {lock} does not support flock ({exc.strerror}); this "
                f"save to {target} is not serialized with concurrent saves to it",
                RuntimeWarning,
                stacklevel=4,
            )
            return False
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(
                f"save: {target} is being saved by another process (it holds the lock file "
                f"{lock}); gave up waiting after lock_timeout={timeout} s"
            )
        time.sleep(min(delay, left))
        delay = min(2 * delay, 0.1)


def _open_lock(lock: Path, target: Path, *, make_parent: bool) -> int:
    """A descriptor of the lock file, created when missing (never through a symbolic link).

    Opened for writing where possible (NFS locks only files open for writing), else for reading
    (a lock file another user's killed save left). With ``make_parent`` (a save), a parent
    directory that a failing concurrent save removed meanwhile is made again.
    """
    flags = os.O_CREAT | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
    attempts = 3
    while True:
        try:
            return os.open(lock, flags | os.O_RDWR, 0o666)
        except PermissionError:
            return os.open(lock, flags | os.O_RDONLY, 0o666)
        except FileNotFoundError:
            attempts -= 1
            if not make_parent or not attempts:
                raise
            target.parent.mkdir(parents=True, exist_ok=True)


@contextlib.contextmanager
def _locked(target: Path, timeout: float | None = None, *, saving: bool = False) -> Iterator[bool]:
    """Hold the advisory lock of saves to ``target`` (its parent must exist); yields whether the
    lock is held (False without ``fcntl`` or ``flock``).

    The lock file is opened (created when missing) and locked; when the path no longer names the
    locked file (its holder removed it meanwhile), that file is dropped and the path opened again,
    so every holder holds the one file the path names. The holder removes the file while still
    holding it: a waiter then finds its file gone and starts over on a new one.

    Raises:
      OSError: the lock file cannot be created or opened (as ``os.open`` raises it, or, when
        ``saving``, naming the directory a save cannot write in).
      TimeoutError: ``timeout`` seconds passed while another process held the lock.
    """
    if fcntl is None:
        yield False
        return
    lock = lock_file(target)
    deadline = time.monotonic() + (timeout or 0.0)
    while True:
        try:
            fd = _open_lock(lock, target, make_parent=saving)
        except OSError as exc:
            if saving:
                raise _cannot_write(exc, target.parent) from None
            raise
        try:
            held = _flock(fd, lock, target, timeout, deadline)
            if not held or _same_file(fd, lock):
                break
        except BaseException:
            os.close(fd)
            raise
        os.close(fd)
    try:
        yield held
    finally:
        try:  # removed while still locked, so no holder ever holds an unlinked file
            os.unlink(lock)
        except OSError:
            pass
        finally:
            os.close(fd)  # releases the lock


def _recover(target: Path) -> bool:
    """:func:`recover_interrupted_save` for a caller holding the lock."""
    if os.path.lexists(target):
        return False
    olds = _hidden(target, _OLD_MARK)
    if not olds:
        return False
    os.replace(olds[-1], target)
    _fsync_dir(target.parent)
    return True


def recover_interrupted_save(path: str | os.PathLike[str]) -> bool:
    """Put back a model directory whose replacement by an overwriting save was cut short.

    A save that replaces a directory renames it to a hidden ``.NAME.floatxq-old-*`` folder, renames
    the finished new one into place, and only then deletes the old one. A kill or failure between
    the two renames leaves ``path`` missing and its previous contents, complete, in that folder;
    this renames the folder back (the newest, if there are several). Every save calls it first.
    When there is something to put back it takes the saves' lock (:func:`lock_file`) first, so a
    live save between its two renames is waited for, never undone.

    Args:
      path: the model directory.

    Returns:
      True when a directory was put back; False when ``path`` exists or nothing is there to restore.

    Raises:
      OSError: the rename back failed (the hidden folder stays, so a later call can retry), or the
        lock file cannot be created.

    Numerics: none; folders are renamed, no file is read or rewritten.

    Example:
      >>> import tempfile
      >>> recover_interrupted_save(Path(tempfile.gettempdir()) / "no-such-model-dir")
      False
    """
    target = Path(os.path.abspath(os.fspath(path)))
    if os.path.lexists(target) or not _hidden(target, _OLD_MARK):
        return False  # nothing to do: no lock (and no lock file) needed
    with _locked(target):
        return _recover(target)


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


def _check_existing(target: Path, overwrite: bool) -> bool:
    """Whether a save replaces ``target``; refuses what it must not replace."""
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
    return replacing


def _checked_timeout(value: object) -> float | None:
    if value is None:
        return None
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not ok or not math.isfinite(value) or value < 0:  # type: ignore[arg-type]
        raise ValueError(
            f"save: lock_timeout must be None (wait) or a finite number of seconds >= 0, got "
            f"{value!r}"
        )
    return float(value)  # type: ignore[arg-type]


def _write_files(
    tmp: Path,
    state: Mapping[str, torch.Tensor],
    config: Mapping[str, Any],
    quantize_config: Mapping[str, Any] | None,
    extra_files: Mapping[str, str | os.PathLike[str]] | None,
    max_shard_bytes: int,
    json_files: Mapping[str, Any] | None = None,
) -> None:
    """Every file of the checkpoint into ``tmp``, each synced to disk."""
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
        _write_json(tmp / INDEX_FILE, {"metadata": {"total_size": total}, "weight_map": weight_map})
    _write_json(tmp / CONFIG_FILE, dict(config))
    if quantize_config is not None:
        _write_json(tmp / QUANTIZE_CONFIG_FILE, dict(quantize_config))
    for name, source in (extra_files or {}).items():
        shutil.copyfile(source, tmp / name)
    for name, payload in (json_files or {}).items():
        _write_json(tmp / name, dict(payload))
    for file in tmp.iterdir():
        with open(file, "rb") as fh:
            os.fsync(fh.fileno())
    _fsync_dir(tmp)


def write_checkpoint(
    path: str | os.PathLike[str],
    state: Mapping[str, torch.Tensor],
    *,
    config: Mapping[str, Any],
    quantize_config: Mapping[str, Any] | None = None,
    extra_files: Mapping[str, str | os.PathLike[str]] | None = None,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    overwrite: bool = False,
    lock_timeout: float | int | None = None,
    json_files: Mapping[str, Mapping[str, Any]] | None = None,
) -> Path:
    """Write a model directory atomically: shards, index, config.json, quantize_config.json.

    Concurrent saves to one ``path`` are serialized by the advisory lock :func:`lock_file`, held
    from the existence check to the final rename (``docs/checkpoint-safety.md``: what that
    promises, and where ``flock`` is missing).

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
      lock_timeout: seconds to wait for another save to ``path`` (None: as long as it takes).
      json_files: other JSON files written next to ``config.json``, by file name (ModelOpt's
        ``hf_quant_config.json``); written after ``extra_files``, so they replace a copied one.

    Raises:
      FileExistsError: ``path`` exists (or was published by a concurrent save that got the lock
        first) and ``overwrite`` is False.
      ValueError: ``path`` is the working directory, the home directory, a filesystem root or a
        directory holding one of them; an existing plain file or symbolic link; or
        ``max_shard_bytes`` is not a positive int, ``lock_timeout`` not None or seconds >= 0, or
        a ``json_files`` name is a path or one of the files written from ``config``.
      TimeoutError: another save held the lock for ``lock_timeout`` seconds (names the lock file).
      OSError: the directory or lock file cannot be created (the message names the directory;
        nothing is left behind), or writing failed.

    Numerics: bytes are written as they are (FP8 stays FP8); nothing is converted.
    """
    target = _save_target(path)
    if not isinstance(max_shard_bytes, int) or isinstance(max_shard_bytes, bool):
        raise ValueError(f"save: max_shard_bytes must be an int of bytes, got {max_shard_bytes!r}")
    if max_shard_bytes < 1:
        raise ValueError(f"save: max_shard_bytes must be positive, got {max_shard_bytes}")
    timeout = _checked_timeout(lock_timeout)
    for name in json_files or {}:
        if name in (CONFIG_FILE, QUANTIZE_CONFIG_FILE, INDEX_FILE) or Path(name).name != name:
            raise ValueError(
                f"save: json_files names {name!r}; give a plain file name other than "
                f"{CONFIG_FILE}, {QUANTIZE_CONFIG_FILE} and {INDEX_FILE} (written from config)"
            )
    _check_existing(target, overwrite)  # fail fast; checked again under the lock
    created = [d for d in (target.parent, *target.parent.parents) if not os.path.lexists(d)]
    try:
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise _cannot_write(exc, target.parent) from None
        with _locked(target, timeout, saving=True) as locked:
            _recover(target)
            replacing = _check_existing(target, overwrite)
            _remove_stale(target, locked=locked)
            tmp = _tmp_name(target)
            try:
                tmp.mkdir()
            except OSError as exc:
                raise _cannot_write(exc, target.parent) from None
            try:
                _write_files(
                    tmp, state, config, quantize_config, extra_files, max_shard_bytes, json_files
                )
                _swap(tmp, target, replacing=replacing)
            except BaseException:
                _discard(tmp)
                raise
    except BaseException:
        for made in created:  # parents this call created, deepest first; only while empty
            try:
                os.rmdir(made)
            except OSError:
                pass
        raise
    return target
