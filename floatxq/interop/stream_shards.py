"""Safetensors shards written tensor by tensor, byte-identical to :func:`write_checkpoint`'s.

A streamed save never holds the whole model, so it cannot hand ``safetensors.torch.save_file`` a
shard's tensors at once. :func:`plan_shards` computes, from names, dtypes and shapes alone, the
split and file names ``write_checkpoint`` would choose and every byte of each shard's header;
:class:`ShardWriter` creates the files at their full length and then writes each tensor's bytes
at its offset, in any order, one tensor in memory at a time. The finished files equal
``write_checkpoint``'s for the same state dict, byte for byte.

The layout is safetensors' own (``safetensors`` 0.8; checked against ``save_file`` by the tests):
an 8-byte little-endian header length, then compact JSON (``"__metadata__"`` first, then one
``{"dtype","shape","data_offsets"}`` object per tensor, keys in that order, names escaped as
``serde_json`` escapes them, other characters as UTF-8), padded with spaces to a multiple of 8
bytes, then the data: tensors ordered by dtype (widest first: :data:`DATA_ORDER` read backwards)
and, within a dtype, by name, packed with no gaps (empty tensors take no bytes).

Crash safety: the writer keeps :data:`PROGRESS_FILE` beside the shards, replaced atomically at
each :meth:`ShardWriter.flush` after the shards written since the last one are synced to disk,
so :meth:`ShardWriter.reopen` knows which tensors are durably written after a crash.
:meth:`ShardWriter.finish` writes the index and removes the record.
"""

import json
import os
import struct
import sys
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import torch

from floatxq.interop.checkpoint import (
    INDEX_FILE,
    CheckpointError,
    _fsync_dir,
    _shards,
    _unique_names,
    _write_json,
)
from floatxq.interop.shards import read_json

PROGRESS_FILE = "stream-progress.json"
"""The writer's progress record, beside the shards until :meth:`ShardWriter.finish` removes it."""
_PROGRESS_FORMAT = "floatxq-stream-shards"
_PROGRESS_VERSION = 1
_METADATA_JSON = '"__metadata__":{"format":"pt"}'  # write_checkpoint's metadata, one key

DATA_ORDER = (
    "BOOL", "F4", "U8", "I8", "F8_E5M2", "F8_E4M3", "F8_E8M0", "F8_E4M3FNUZ", "F8_E5M2FNUZ",
    "I16", "U16", "F16", "BF16", "I32", "U32", "F32", "C64", "F64", "I64", "U64",
)  # fmt: skip
"""Safetensors' dtype order (its ``Dtype`` enum); a shard's data runs from the last to the first."""
_TORCH_NAMES = {
    "bool": "BOOL", "float4_e2m1fn_x2": "F4", "uint8": "U8", "int8": "I8",
    "float8_e5m2": "F8_E5M2", "float8_e4m3fn": "F8_E4M3", "float8_e8m0fnu": "F8_E8M0",
    "float8_e4m3fnuz": "F8_E4M3FNUZ", "float8_e5m2fnuz": "F8_E5M2FNUZ", "int16": "I16",
    "uint16": "U16", "float16": "F16", "bfloat16": "BF16", "int32": "I32", "uint32": "U32",
    "float32": "F32", "complex64": "C64", "float64": "F64", "int64": "I64", "uint64": "U64",
}  # fmt: skip
SAFETENSORS_DTYPES: dict[torch.dtype, str] = {
    getattr(torch, name): code for name, code in _TORCH_NAMES.items() if hasattr(torch, name)
}
"""Each torch dtype ``save_file`` stores, to its safetensors dtype name (older torch: fewer)."""
_RANK = {code: rank for rank, code in enumerate(DATA_ORDER)}


class TensorSlot(NamedTuple):
    """Where one tensor's bytes lie in its shard file (absolute offsets, ``end`` exclusive)."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int
    end: int


class ShardLayout(NamedTuple):
    """One shard file: its name, its header bytes (length prefix included), its full length and
    its tensors in data order."""

    file: str
    header: bytes
    size: int
    slots: tuple[TensorSlot, ...]


@dataclass(frozen=True, slots=True, kw_only=True)
class ShardPlan:
    """The files ``write_checkpoint`` writes for some tensors, down to each tensor's offset.

    Built by :func:`plan_shards`. ``entries`` are the tensors in state-dict order; ``shards`` the
    files in index order; ``index`` the ``model.safetensors.index.json`` payload (None for one
    file); ``where`` each name's ``(shard number, slot)``.
    """

    entries: tuple[tuple[str, torch.dtype, tuple[int, ...]], ...]
    max_shard_bytes: int
    shards: tuple[ShardLayout, ...]
    index: Mapping[str, Any] | None
    where: Mapping[str, tuple[int, TensorSlot]]


def _checked_entries(
    entries: Iterable[tuple[str, torch.dtype, Iterable[int]]],
) -> tuple[tuple[str, torch.dtype, tuple[int, ...]], ...]:
    out: list[tuple[str, torch.dtype, tuple[int, ...]]] = []
    seen: set[str] = set()
    for i, entry in enumerate(entries):
        if not isinstance(entry, (tuple, list)) or len(entry) != 3:
            raise TypeError(
                f"plan_shards: entries[{i}] must be (name, dtype, shape), got {entry!r}"
            )
        name, dtype, shape = entry
        if not isinstance(name, str):
            raise TypeError(f"plan_shards: entries[{i}] name must be a str, got {name!r}")
        try:
            name.encode("utf-8")
        except UnicodeEncodeError:
            raise ValueError(f"plan_shards: entries[{i}] name {name!r} is not UTF-8") from None
        if name == "__metadata__":
            raise ValueError(
                f"plan_shards: entries[{i}] name '__metadata__' is the safetensors header's "
                "metadata key; rename the tensor"
            )
        if name in seen:
            raise ValueError(f"plan_shards: entries name {name!r} twice")
        seen.add(name)
        if dtype not in SAFETENSORS_DTYPES:
            raise ValueError(
                f"plan_shards: {name!r} has dtype {dtype!r}; safetensors stores "
                f"{sorted(str(d).removeprefix('torch.') for d in SAFETENSORS_DTYPES)}"
            )
        try:
            dims = tuple(shape)
        except TypeError:
            raise TypeError(
                f"plan_shards: {name!r} shape must be a sequence, got {shape!r}"
            ) from None
        if not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in dims):
            raise ValueError(f"plan_shards: {name!r} shape must be ints >= 0, got {shape!r}")
        if SAFETENSORS_DTYPES[dtype] == "F4" and not dims:
            raise ValueError(f"plan_shards: {name!r} is a 0-d float4_e2m1fn_x2 (save_file refuses)")
        out.append((name, dtype, dims))
    return tuple(out)


def _header(slots: list[tuple[str, str, tuple[int, ...], int, int]]) -> bytes:
    """The header bytes ``save_file`` writes for these ``(name, code, shape, start, end)``."""
    parts = [_METADATA_JSON]
    for name, code, shape, start, end in slots:
        dims = ",".join(str(d) for d in shape)
        key = json.dumps(name, ensure_ascii=False)  # escapes exactly what serde_json escapes
        parts.append(f'{key}:{{"dtype":"{code}","shape":[{dims}],"data_offsets":[{start},{end}]}}')
    text = ("{" + ",".join(parts) + "}").encode("utf-8")
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text


def _layout(file: str, shard: list[tuple[str, torch.dtype, tuple[int, ...]]]) -> ShardLayout:
    ordered = sorted(shard, key=lambda e: (-_RANK[SAFETENSORS_DTYPES[e[1]]], e[0]))
    rows: list[tuple[str, str, tuple[int, ...], int, int]] = []
    offset = 0
    for name, dtype, shape in ordered:
        nbytes = _nbytes(dtype, shape)
        code = SAFETENSORS_DTYPES[dtype]
        shown = (*shape[:-1], shape[-1] * 2) if code == "F4" else shape  # F4 counts codes
        rows.append((name, code, shown, offset, offset + nbytes))
        offset += nbytes
    header = _header(rows)
    base = len(header)
    slots = tuple(
        TensorSlot(name, dtype, shape, base + row[3], base + row[4])
        for (name, dtype, shape), row in zip(ordered, rows, strict=True)
    )
    return ShardLayout(file=file, header=header, size=base + offset, slots=slots)


def _nbytes(dtype: torch.dtype, shape: tuple[int, ...]) -> int:
    count = 1
    for d in shape:
        count *= d
    return count * dtype.itemsize


def plan_shards(
    entries: Iterable[tuple[str, torch.dtype, Iterable[int]]], max_shard_bytes: int
) -> ShardPlan:
    """The shard files ``write_checkpoint`` writes for these tensors, and every header byte.

    Args:
      entries: ``(name, dtype, shape)`` of each tensor in state-dict order, tied duplicates
        already dropped (:func:`checkpoint_entries` gives them for a state dict).
      max_shard_bytes: ``write_checkpoint``'s shard size limit (a positive int).

    Returns:
      The :class:`ShardPlan`: the same split and file names as ``write_checkpoint`` (its own
      splitter, run on meta tensors), each shard's header as ``save_file`` writes it with
      metadata ``{"format": "pt"}``, and each tensor's byte range.

    Raises:
      TypeError: an entry is not ``(str, dtype, shape)``.
      ValueError: a name given twice, not UTF-8 or ``"__metadata__"``; a dtype safetensors does
        not store; a negative or non-int dimension; a 0-d ``float4_e2m1fn_x2``;
        ``max_shard_bytes`` not a positive int.

    Numerics: none; no tensor data is touched.

    Example:
      >>> plan = plan_shards([("w", torch.bfloat16, (2, 3))], 1 << 30)
      >>> plan.shards[0].file, plan.shards[0].size  # 8 + 96 header bytes, then 12 data bytes
      ('model.safetensors', 116)
    """
    if not isinstance(max_shard_bytes, int) or isinstance(max_shard_bytes, bool):
        raise ValueError(f"plan_shards: max_shard_bytes must be an int, got {max_shard_bytes!r}")
    if max_shard_bytes < 1:
        raise ValueError(f"plan_shards: max_shard_bytes must be positive, got {max_shard_bytes}")
    checked = _checked_entries(entries)
    meta = {n: torch.empty(s, dtype=d, device="meta") for n, d, s in checked}
    by_name = {e[0]: e for e in checked}
    groups = [[by_name[n] for n in shard] for shard in _shards(meta, max_shard_bytes)]
    if len(groups) == 1:
        names = ["model.safetensors"]
    else:
        names = [
            f"model-{i:05d}-of-{len(groups):05d}.safetensors" for i in range(1, 1 + len(groups))
        ]
    shards = tuple(_layout(file, group) for file, group in zip(names, groups, strict=True))
    index = None
    if len(shards) > 1:
        weight_map = {
            name: file for file, group in zip(names, groups, strict=True) for name, _, _ in group
        }
        total = sum(_nbytes(d, s) for _, d, s in checked)
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    where = {slot.name: (i, slot) for i, shard in enumerate(shards) for slot in shard.slots}
    return ShardPlan(
        entries=checked, max_shard_bytes=max_shard_bytes, shards=shards, index=index, where=where
    )


def checkpoint_entries(
    state: Mapping[str, torch.Tensor],
) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
    """The ``(name, dtype, shape)`` entries ``write_checkpoint`` stores for ``state``, in order,
    tied duplicates dropped as it drops them (nothing is copied).

    Raises:
      ValueError: a tensor is on the meta device (its storage cannot tell ties apart).

    Numerics: none.
    """
    for name, tensor in state.items():
        if tensor.device.type == "meta":
            raise ValueError(
                f"checkpoint_entries: {name!r} is a meta tensor; ties cannot be told from meta "
                "storage, so build the entries by hand"
            )
    return [(n, state[n].dtype, tuple(state[n].shape)) for n in _unique_names(state)]


def _plan_record(plan: ShardPlan) -> dict[str, Any]:
    """What the progress record says of the plan, to refuse a different one on reopen."""
    return {
        "max_shard_bytes": plan.max_shard_bytes,
        "entries": [[n, SAFETENSORS_DTYPES[d], list(s)] for n, d, s in plan.entries],
        "files": [[shard.file, shard.size] for shard in plan.shards],
    }


def _plan_difference(recorded: Mapping[str, Any], plan: ShardPlan) -> str | None:
    """The first way ``plan`` differs from the recorded one, in words; None when it does not."""
    mine = _plan_record(plan)
    if recorded.get("max_shard_bytes") != mine["max_shard_bytes"]:
        return (
            f"max_shard_bytes: recorded {recorded.get('max_shard_bytes')!r}, plan "
            f"{mine['max_shard_bytes']}"
        )
    theirs = recorded.get("entries")
    if not isinstance(theirs, list):
        return "the recorded entries are not a list"
    for i, (old, new) in enumerate(zip(theirs, mine["entries"], strict=False)):
        if old != new:
            return f"entry {i}: recorded {old!r}, plan {new!r} (name, dtype, shape)"
    if len(theirs) != len(mine["entries"]):
        return f"tensor count: recorded {len(theirs)}, plan {len(mine['entries'])}"
    if recorded.get("files") != mine["files"]:
        return f"files: recorded {recorded.get('files')!r}, plan {mine['files']!r}"
    return None


def _tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """The tensor's bytes as ``save_file`` stores them (CPU, contiguous, native little-endian)."""
    flat = tensor.detach().to("cpu").contiguous().reshape(-1)
    return memoryview(flat.view(torch.uint8).numpy())


def _pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    while len(data):
        n = os.pwrite(fd, data, offset)
        data, offset = data[n:], offset + n


def _fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)  # syncs the file's data written through any descriptor
    finally:
        os.close(fd)


class ShardWriter:
    """Writes a :class:`ShardPlan`'s shard files tensor by tensor, in any order.

    ``ShardWriter(directory, plan)`` creates every shard file (header written, full length) and
    the progress record; :meth:`write` puts one tensor's bytes at its offset; :meth:`flush`
    makes the tensors written so far durable and records them; :meth:`finish` checks that every
    tensor was written, syncs the shards, writes the index as ``write_checkpoint`` does and
    removes the record. After a crash, :meth:`reopen` resumes from the last flush.

    Example:
      >>> import tempfile
      >>> plan = plan_shards([("w", torch.float32, (2,))], 1 << 30)
      >>> writer = ShardWriter(tempfile.mkdtemp(), plan)
      >>> writer.write("w", torch.ones(2))
      >>> writer.finish()
      >>> sorted(writer.done), writer.missing
      (['w'], frozenset())
    """

    def __init__(self, directory: str | os.PathLike[str], plan: ShardPlan) -> None:
        """Create the shard files and the progress record in ``directory`` (made if missing).

        Raises:
          TypeError: ``plan`` is not a :class:`ShardPlan`.
          FileExistsError: a shard, the index or the progress record is already there (resume
            with :meth:`reopen`, or remove them).
        """
        self._setup(directory, plan)
        self._directory.mkdir(parents=True, exist_ok=True)
        for name in (*(s.file for s in plan.shards), INDEX_FILE, PROGRESS_FILE):
            if os.path.lexists(self._directory / name):
                raise FileExistsError(
                    f"ShardWriter: {self._directory / name} already exists; resume with "
                    "ShardWriter.reopen or remove it"
                )
        for shard in plan.shards:
            fd = os.open(self._directory / shard.file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            try:
                _pwrite_all(fd, memoryview(shard.header), 0)
                os.ftruncate(fd, shard.size)
                os.fsync(fd)
            finally:
                os.close(fd)
        self._record()

    def _setup(self, directory: str | os.PathLike[str], plan: ShardPlan) -> None:
        if not isinstance(plan, ShardPlan):
            raise TypeError(f"ShardWriter: plan must be a ShardPlan, got {type(plan).__name__}")
        if sys.byteorder != "little":
            raise ValueError("ShardWriter: safetensors data is little-endian; this host is not")
        self._directory = Path(directory)
        self._plan = plan
        self._done: set[str] = set()
        self._pending: set[str] = set()
        self._dirty: set[str] = set()
        self._finished = False

    @classmethod
    def reopen(cls, directory: str | os.PathLike[str], plan: ShardPlan) -> "ShardWriter":
        """Resume an unfinished writer: the tensors flushed before the crash count as done.

        Raises:
          ValueError: ``plan`` differs from the recorded one (names the first difference).
          CheckpointError: the progress record is missing or damaged, or a shard file is missing,
            of the wrong length or with another header.
        """
        self = cls.__new__(cls)
        self._setup(directory, plan)
        record_file = self._directory / PROGRESS_FILE
        if not os.path.lexists(record_file):
            raise CheckpointError(
                f"ShardWriter.reopen: {record_file} is missing: the writer finished, or never "
                "got past creating its files; nothing to resume"
            )
        record = read_json(record_file, what="ShardWriter.reopen")
        if record.get("format") != _PROGRESS_FORMAT or record.get("version") != _PROGRESS_VERSION:
            raise CheckpointError(
                f"ShardWriter.reopen: {record_file} is not a version-{_PROGRESS_VERSION} "
                f"{_PROGRESS_FORMAT} record"
            )
        recorded = record.get("plan")
        if not isinstance(recorded, dict):
            raise CheckpointError(f"ShardWriter.reopen: {record_file} holds no plan")
        differs = _plan_difference(recorded, plan)
        if differs is not None:
            raise ValueError(f"ShardWriter.reopen: plan differs from {record_file}: {differs}")
        done = record.get("done")
        count = len(plan.entries)
        if (
            not isinstance(done, list)
            or not all(type(i) is int and 0 <= i < count for i in done)
            or len(set(done)) != len(done)
        ):
            raise CheckpointError(
                f"ShardWriter.reopen: {record_file} 'done' must list distinct entry numbers "
                f"below {count}"
            )
        for shard in plan.shards:
            path = self._directory / shard.file
            try:
                with open(path, "rb") as fh:
                    size = os.fstat(fh.fileno()).st_size
                    header = fh.read(len(shard.header))
            except OSError as exc:
                raise CheckpointError(f"ShardWriter.reopen: cannot read {path} ({exc})") from None
            same = header == shard.header
            if size != shard.size or not same:
                raise CheckpointError(
                    f"ShardWriter.reopen: {path} is not the planned shard ({size} bytes, "
                    f"planned {shard.size}; header {'equal' if same else 'differs'})"
                )
        self._done = {plan.entries[i][0] for i in done}
        return self

    @property
    def directory(self) -> Path:
        """The folder the shards are written in."""
        return self._directory

    @property
    def done(self) -> frozenset[str]:
        """Tensors written and flushed (durable: a crash keeps them)."""
        return frozenset(self._done)

    @property
    def pending(self) -> frozenset[str]:
        """Tensors written since the last :meth:`flush` (a crash may lose them)."""
        return frozenset(self._pending)

    @property
    def missing(self) -> frozenset[str]:
        """Tensors of the plan not written yet."""
        return frozenset(self._plan.where) - self._done - self._pending

    def write(self, name: str, tensor: torch.Tensor) -> None:
        """Write one tensor's bytes at its planned offset (any device; copied to CPU alone).

        Raises:
          TypeError: ``tensor`` is not a tensor.
          ValueError: ``name`` is not in the plan or was already written, the dtype or shape is
            not the planned one, or the writer is finished.
        """
        if self._finished:
            raise ValueError(f"ShardWriter.write: {name!r}: the writer is finished")
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"ShardWriter.write: {name!r} must be a tensor, got {type(tensor)}")
        found = self._plan.where.get(name)
        if found is None:
            raise ValueError(f"ShardWriter.write: {name!r} is not a tensor of the plan")
        if name in self._done or name in self._pending:
            raise ValueError(f"ShardWriter.write: {name!r} was already written")
        shard_no, slot = found
        if tensor.dtype != slot.dtype or tuple(tensor.shape) != slot.shape:
            raise ValueError(
                f"ShardWriter.write: {name!r} is {tensor.dtype} {tuple(tensor.shape)}; the plan "
                f"has {slot.dtype} {slot.shape}"
            )
        file = self._plan.shards[shard_no].file
        if slot.end > slot.start:
            data = _tensor_bytes(tensor)
            fd = os.open(self._directory / file, os.O_WRONLY)
            try:
                _pwrite_all(fd, data, slot.start)
            finally:
                os.close(fd)
            self._dirty.add(file)
        self._pending.add(name)

    def flush(self) -> None:
        """Sync the shards written since the last flush, then record their tensors as done.

        Call it at natural boundaries (a decoder layer): each call costs an ``fsync`` per
        touched shard and one rewrite of the progress record.
        """
        if self._finished or not self._pending:
            return
        for file in sorted(self._dirty):
            _fsync_file(self._directory / file)
        self._dirty.clear()
        self._done |= self._pending
        self._pending.clear()
        self._record()

    def finish(self) -> None:
        """Flush, check every tensor was written, sync every shard, write the index (sharded
        plans, as ``write_checkpoint`` formats it) and remove the progress record.

        Raises:
          ValueError: tensors are missing (names the count and the first few), or the writer is
            already finished.
        """
        if self._finished:
            raise ValueError("ShardWriter.finish: the writer is already finished")
        self.flush()
        missing = self.missing
        if missing:
            first = sorted(missing)[:5]
            raise ValueError(
                f"ShardWriter.finish: {len(missing)} tensors were never written (first: {first})"
            )
        for shard in self._plan.shards:
            _fsync_file(self._directory / shard.file)
        if self._plan.index is not None:
            _write_json(self._directory / INDEX_FILE, self._plan.index)
        (self._directory / PROGRESS_FILE).unlink(missing_ok=True)
        _fsync_dir(self._directory)
        self._finished = True

    def _record(self) -> None:
        """Replace the progress record atomically (written, synced, renamed, directory synced)."""
        numbers = {name: i for i, (name, _, _) in enumerate(self._plan.entries)}
        payload = {
            "format": _PROGRESS_FORMAT,
            "version": _PROGRESS_VERSION,
            "plan": _plan_record(self._plan),
            "done": sorted(numbers[name] for name in self._done),
        }
        tmp = self._directory / f".{PROGRESS_FILE}.tmp"
        with open(tmp, "w", encoding="utf-8") as fh:
            json.dump(payload, fh, ensure_ascii=False, separators=(",", ":"))
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, self._directory / PROGRESS_FILE)
        _fsync_dir(self._directory)
