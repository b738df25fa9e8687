"""A checkpoint written while it is being computed, published atomically, resumable.

:func:`write_checkpoint_streamed` is :func:`~floatxq.interop.checkpoint.write_checkpoint` for a
state that never exists whole: the caller's ``fill`` writes the tensors into a
:class:`~floatxq.interop.stream_shards.ShardWriter` as it produces them (a decoder layer at a
time), flushing after each piece. The shards, index and JSON files are the bytes
``write_checkpoint`` would write for the same tensors, and the directory appears at ``path``
only once complete, by the same lock and rename.

Unlike ``write_checkpoint``'s temporary folder, the staging folder
``.NAME.floatxq-partial`` beside ``path`` survives a failure: it holds the flushed tensors and a
record of the run (``offload-run.json``: what the caller says identifies it, e.g. the
quantization settings). A later call with ``resume=True`` and the same record and plan reopens
it and is told which tensors are done; any other call refuses to start over it.
"""

import json
import os
import shutil
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from floatxq.interop.checkpoint import (
    CONFIG_FILE,
    INDEX_FILE,
    QUANTIZE_CONFIG_FILE,
    _cannot_write,
    _check_existing,
    _checked_timeout,
    _fsync_dir,
    _locked,
    _recover,
    _remove_stale,
    _save_target,
    _swap,
    _write_json,
)
from floatxq.interop.stream_shards import ShardPlan, ShardWriter

__all__ = ["PARTIAL_MARK", "RUN_FILE", "partial_dir", "write_checkpoint_streamed"]

PARTIAL_MARK = ".floatxq-partial"
"""The staging folder of a streamed save to ``NAME`` is ``.NAME.floatxq-partial`` beside it."""

RUN_FILE = "offload-run.json"
"""The record of the run a staging folder belongs to (removed when the checkpoint is done)."""


def partial_dir(path: str | os.PathLike[str]) -> Path:
    """The staging folder of a streamed save to ``path`` (which need not exist).

    Numerics: none.
    """
    target = Path(os.path.abspath(os.fspath(path)))
    return target.parent / f".{target.name}{PARTIAL_MARK}"


def _differences(recorded: Mapping[str, Any], current: Mapping[str, Any]) -> list[str]:
    keys = sorted(set(recorded) | set(current))
    return [k for k in keys if recorded.get(k) != current.get(k)]


def _open_staging(staging: Path, plan: ShardPlan, run: Mapping[str, Any], resume: bool) -> Any:
    record = json.loads(json.dumps(dict(run)))  # as it reads back from the file
    if not staging.exists():
        if resume:
            raise ValueError(
                f"quantize: resume=True, but no interrupted run left {staging}; call it "
                f"without resume"
            )
        staging.mkdir()
        _write_json(staging / RUN_FILE, record)
        return ShardWriter(staging, plan)
    if not resume:
        raise ValueError(
            f"quantize: an interrupted run left {staging}; pass resume=True to finish it with "
            f"the same settings, or delete that folder to start over"
        )
    try:
        recorded = json.loads((staging / RUN_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ValueError(
            f"quantize: {staging} has no readable {RUN_FILE} ({exc}); delete the folder to "
            f"start over"
        ) from None
    changed = _differences(recorded, record) if isinstance(recorded, dict) else ["the record"]
    if changed:
        raise ValueError(
            f"quantize: resume=True, but the run differs from the interrupted one in "
            f"{', '.join(changed)}; resuming would mix settings, so start over (delete {staging})"
        )
    return ShardWriter.reopen(staging, plan)


def write_checkpoint_streamed(
    path: str | os.PathLike[str],
    plan: ShardPlan,
    fill: Callable[[ShardWriter], None],
    *,
    config: Mapping[str, Any],
    quantize_config: Mapping[str, Any] | None = None,
    extra_files: Mapping[str, str | os.PathLike[str]] | None = None,
    json_files: Mapping[str, Mapping[str, Any]] | None = None,
    run: Mapping[str, Any],
    resume: bool = False,
    overwrite: bool = False,
    lock_timeout: float | int | None = None,
) -> Path:
    """Write a model directory whose tensors ``fill`` produces, atomically and resumably.

    Args:
      path: the model directory to create.
      plan: the shards (:func:`~floatxq.interop.stream_shards.plan_shards` of every tensor the
        checkpoint holds, in state-dict order).
      fill: writes every tensor not yet in ``writer.done`` and flushes (``writer.flush()``)
        after each piece it wants kept should the run be cut short.
      config, quantize_config, extra_files, json_files: as
        :func:`~floatxq.interop.checkpoint.write_checkpoint`.
      run: JSON-like record identifying the run (settings, calibration): a resumed run must
        give the same.
      resume: finish the staging folder an interrupted run left (:func:`partial_dir`).
      overwrite, lock_timeout: as ``write_checkpoint``.

    Raises:
      FileExistsError: ``path`` exists and ``overwrite`` is False.
      ValueError: a staging folder exists and ``resume`` is False, or ``resume`` is True with
        none, or with another ``run`` record or plan; as ``write_checkpoint``.
      CheckpointError: a damaged staging folder (as ``ShardWriter.reopen``).

    On failure the staging folder stays (flushed tensors kept) and the lock is released.

    Numerics: bytes as written by ``fill``; the files equal ``write_checkpoint``'s.
    """
    target = _save_target(path)
    timeout = _checked_timeout(lock_timeout)
    for name in json_files or {}:  # before any work: the run may take hours
        if name in (CONFIG_FILE, QUANTIZE_CONFIG_FILE, INDEX_FILE) or Path(name).name != name:
            raise ValueError(
                f"save: json_files names {name!r}; give a plain file name other than "
                f"{CONFIG_FILE}, {QUANTIZE_CONFIG_FILE} and {INDEX_FILE}"
            )
    _check_existing(target, overwrite)
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise _cannot_write(exc, target.parent) from None
    staging = partial_dir(target)
    with _locked(target, timeout, saving=True) as locked:
        _recover(target)
        replacing = _check_existing(target, overwrite)
        _remove_stale(target, locked=locked)
        writer = _open_staging(staging, plan, run, resume)
        fill(writer)
        writer.finish()
        (staging / RUN_FILE).unlink()
        _write_json(staging / CONFIG_FILE, dict(config))
        if quantize_config is not None:
            _write_json(staging / QUANTIZE_CONFIG_FILE, dict(quantize_config))
        for name, source in (extra_files or {}).items():
            shutil.copyfile(source, staging / name)
        for name, payload in (json_files or {}).items():
            _write_json(staging / name, dict(payload))
        for file in staging.iterdir():
            with open(file, "rb") as fh:
                os.fsync(fh.fileno())
        _fsync_dir(staging)
        _swap(staging, target, replacing=replacing)
    return target
