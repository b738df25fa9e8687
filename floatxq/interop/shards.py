"""Reading a model directory's files: shard paths, safetensors headers and JSON files, each
checked before any byte is trusted; every refusal is a :class:`CheckpointError` naming the file,
tensor or field.

What a model directory can make these readers do: open and read regular files inside the
directory (or, for a Hugging Face hub cache snapshot, in the cache's sibling ``blobs`` folder)
and nothing else. Index entries that are absolute, hold ``..`` or resolve outside, symlinks that
lead outside, FIFOs, sockets, devices and directories are refused before anything is opened;
headers and JSON files over 100 MB are refused before they are read. A safetensors header is
checked by ``safetensors.safe_open`` itself (dtypes, shapes, offsets tiling the data to the
file's last byte), after the checks it lacks: the header length, bounded JSON, a tensor or
metadata key given twice (safetensors keeps the last), ``"__metadata__": null``.
"""

import math
import os
import re
import stat
import struct
from collections.abc import Iterator
from pathlib import Path, PurePosixPath
from typing import Any, NamedTuple

import torch
from safetensors import safe_open

from floatxq._checks import bounded_json_loads
from floatxq.interop.checkpoint import INDEX_FILE, SINGLE_SHARD_FILE, CheckpointError


class TensorInfo(NamedTuple):
    """What a safetensors header says about one tensor (no data is read)."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    file: str


MAX_HEADER_BYTES = 100_000_000
"""The largest safetensors header or JSON file read (safetensors' own header limit)."""

# Bits per element of each safetensors dtype, only to name what safetensors refused.
_DTYPE_BITS = {
    "BOOL": 8, "U8": 8, "I8": 8, "F8_E5M2": 8, "F8_E4M3": 8, "F8_E8M0": 8, "F4": 4,
    "F8_E4M3FNUZ": 8, "F8_E5M2FNUZ": 8,
    "F6_E2M3": 6, "F6_E3M2": 6, "I16": 16, "U16": 16, "F16": 16, "BF16": 16, "I32": 32,
    "U32": 32, "F32": 32, "C64": 64, "F64": 64, "I64": 64, "U64": 64,
}  # fmt: skip
# A shard name of a sharded save (``model-00002-of-00003.safetensors``): one the index does not
# name is a stale shard of another save, so the directory is mixed or damaged.
_SHARD_NAME = re.compile(r".+-\d+-of-\d+\.safetensors")
_HEADER_FIELDS = ("dtype", "shape", "data_offsets")


class _Header(NamedTuple):
    """A checked safetensors header: tensor name → (dtype, shape), ``__metadata__``, and each
    tensor's data as ``[begin, end)`` byte offsets from the start of the file."""

    tensors: dict[str, tuple[str, tuple[int, ...]]]
    metadata: dict[str, str]
    spans: dict[str, tuple[int, int]]


def _kind(mode: int) -> str:
    for test, name in (
        (stat.S_ISDIR, "directory"),
        (stat.S_ISFIFO, "FIFO"),
        (stat.S_ISSOCK, "socket"),
        (stat.S_ISCHR, "character device"),
        (stat.S_ISBLK, "block device"),
    ):
        if test(mode):
            return name
    return "special file"


def _regular(file: Path, what: str) -> None:
    """Refuse a missing file, or anything but a regular file, without opening it."""
    try:
        mode = os.stat(file).st_mode
    except FileNotFoundError:
        raise CheckpointError(f"{what}: {file} is missing") from None
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{what}: cannot stat {file} ({exc})") from None
    if not stat.S_ISREG(mode):
        raise CheckpointError(f"{what}: {file} is a {_kind(mode)}, not a regular file")


def _open_regular(file: Path, what: str) -> tuple[Any, int]:
    """Open a checked regular file for reading: ``(binary file object, size)``.

    O_NONBLOCK keeps a file swapped for a FIFO after the check from blocking the open; the
    descriptor is checked again before anything is read.
    """
    _regular(file, what)
    try:
        fd = os.open(file, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        raise CheckpointError(f"{what}: cannot open {file} ({exc})") from None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise CheckpointError(f"{what}: {file} is a {_kind(st.st_mode)}, not a regular file")
    return os.fdopen(fd, "rb"), st.st_size


class _UniqueKeys:
    """A ``json`` object hook refusing a key given twice (``same_value_ok``: unless equal)."""

    def __init__(self, prefix: str, *, same_value_ok: bool) -> None:
        self.prefix, self.same_value_ok = prefix, same_value_ok

    def __call__(self, pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for key, value in pairs:
            if key in out and not (self.same_value_ok and out[key] == value):
                raise CheckpointError(f"{self.prefix} gives key {key!r} twice")
            out[key] = value
        return out


def bounded_json(raw: str | bytes, *, refusal: str, keys: str, same_value_ok: bool) -> Any:
    """Parse untrusted JSON text from a checkpoint, every refusal a :class:`CheckpointError`.

    :func:`~floatxq._checks.bounded_json_loads` first (nesting at most 64 deep, integers of at
    most 30 digits, finite numbers, UTF-8, valid JSON; its refusal is ``f"{refusal} (why)"``),
    then the keys of each object: one given twice is refused as ``f"{keys} gives key ... twice"``
    (``same_value_ok``: unless both give one value).
    """
    try:
        return bounded_json_loads(
            raw, where=refusal, error=_Refusal, max_bytes=MAX_HEADER_BYTES,
            object_pairs_hook=_UniqueKeys(keys, same_value_ok=same_value_ok),
        )  # fmt: skip
    except _Refusal as exc:
        why = str(exc).removeprefix(f"{refusal}: ")
        if why.startswith("not valid JSON (") and why.endswith(")"):
            why = why[len("not valid JSON (") : -1]
        raise CheckpointError(f"{refusal} ({why})") from None


class _Refusal(Exception):
    """What :func:`bounded_json_loads` raises here, reworded as a CheckpointError."""


def read_json(path: str | os.PathLike[str], *, what: str) -> dict[str, Any]:
    """Parse a JSON object file, raising :class:`CheckpointError` naming it when it is bad.

    Args:
      path: the JSON file.
      what: the caller's name for it, the start of every message (``"load"``).

    Raises:
      CheckpointError: the file is missing, not a regular file (a FIFO is never opened), over
        :data:`MAX_HEADER_BYTES`, not UTF-8 JSON, nested more than 64 deep, holds an integer of
        over 30 digits or a non-finite number, gives one key two different values, or is not a
        JSON object.

    Numerics: none.
    """
    file = Path(path)
    fh, size = _open_regular(file, what)
    with fh:
        if size > MAX_HEADER_BYTES:
            raise CheckpointError(
                f"{what}: {file} is {size} bytes; JSON files over {MAX_HEADER_BYTES} are refused"
            )
        raw = fh.read(MAX_HEADER_BYTES + 1)
    if len(raw) > MAX_HEADER_BYTES:
        raise CheckpointError(f"{what}: {file} grew past {MAX_HEADER_BYTES} bytes while read")
    payload = bounded_json(
        raw, refusal=f"{what}: {file} is not valid JSON", keys=f"{what}: {file}", same_value_ok=True
    )
    if not isinstance(payload, dict):
        raise CheckpointError(
            f"{what}: {file} must hold a JSON object, got {type(payload).__name__}"
        )
    return payload


def _inside(root: Path, file: Path) -> bool:
    """Whether ``file`` (symlinks followed) lies in ``root`` or a hub cache's ``blobs`` folder.

    ``huggingface_hub`` stores ``.../snapshots/<revision>/NAME`` as a symlink to
    ``.../blobs/<hash>``, so for a snapshot directory that sibling folder counts as inside.
    """
    real_root = Path(os.path.realpath(root))
    real = Path(os.path.realpath(file))
    allowed = [real_root]
    if real_root.parent.name == "snapshots":
        allowed.append(real_root.parent.parent / "blobs")
    return any(real != base and real.is_relative_to(base) for base in allowed)


def _shard(root: Path, file: Path, what: str) -> Path:
    """Check one shard path (inside ``root``, a regular file) before anything opens it."""
    if not _inside(root, file):
        raise CheckpointError(
            f"{what}: {file} resolves to {os.path.realpath(file)}, outside {root}; refusing to "
            f"read it"
        )
    _regular(file, what)
    return file


def _layout(root: Path) -> tuple[list[Path], dict[str, Path] | None]:
    """The shard files of a model directory, and the index's tensor → file map if it has one."""
    if not root.is_dir():
        raise CheckpointError(f"checkpoint: {root} is not a directory")
    index = root / INDEX_FILE
    if os.path.lexists(index):
        weight_map = read_json(index, what="checkpoint index").get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise CheckpointError(f"checkpoint index: {index} has no 'weight_map'")
        by_entry: dict[str, Path] = {}
        where: dict[str, Path] = {}
        for name, entry in weight_map.items():
            named = f"checkpoint index: {index}: {name!r} -> {_short(entry, 300)}"
            if not isinstance(entry, str) or not entry.strip() or "\x00" in entry:
                raise CheckpointError(f"{named} is not a file name")
            if entry not in by_entry:
                relative = PurePosixPath(entry)
                if relative.is_absolute() or ".." in relative.parts:
                    raise CheckpointError(
                        f"{named} is not a file inside {root} (absolute or '..'); refusing it"
                    )
                file = root / relative
                if not os.path.lexists(file):
                    raise CheckpointError(
                        f"checkpoint: shard {file} named by {index.name} is missing"
                    )
                by_entry[entry] = _shard(root, file, named)
            where[name] = by_entry[entry]
        files = sorted(set(by_entry.values()))
        for stray in sorted(root.glob("*.safetensors")):
            if stray not in files and (
                stray.name == SINGLE_SHARD_FILE or _SHARD_NAME.fullmatch(stray.name)
            ):
                raise CheckpointError(
                    f"checkpoint: {stray} is a shard {index.name} does not name (left from "
                    f"another save?); refusing a mixed directory"
                )
        return files, where
    single = root / SINGLE_SHARD_FILE
    if os.path.lexists(single):
        return [_shard(root, single, "checkpoint")], None
    found = sorted(root.glob("*.safetensors"))
    if not found:
        raise CheckpointError(f"checkpoint: no *.safetensors files in {root}")
    return [_shard(root, file, "checkpoint") for file in found], None


def shard_files(path: str | os.PathLike[str]) -> list[Path]:
    """The safetensors files of a model directory, checked before any is opened.

    With ``model.safetensors.index.json`` the files its ``weight_map`` names; else
    ``model.safetensors``; else every ``*.safetensors`` file of the directory.

    Args:
      path: the model directory.

    Raises:
      CheckpointError: not a directory; no shards; an index entry that is not a relative path
        inside the directory; a shard that resolves outside it (symlinks followed; a Hugging Face
        hub snapshot may point into its cache's ``blobs``) or is not a regular file (FIFOs,
        sockets, devices and directories are never opened); next to an index, a
        ``model.safetensors`` or ``*-NNNNN-of-NNNNN.safetensors`` file the index does not name
        (other ``*.safetensors`` files, such as ``consolidated.safetensors``, are ignored).

    Numerics: none; nothing is read but the index.
    """
    return _layout(Path(path))[0]


def _check_header(file: Path) -> _Header:
    """Read a safetensors header with ``safe_open``, after the checks safetensors lacks.

    Before safetensors sees the file: a regular file, its length field within
    :data:`MAX_HEADER_BYTES` and the file, and the header text bounded JSON that gives no key
    twice (safetensors keeps the last of two tensors or metadata keys of one name). The rest
    (dtypes, shapes, offsets tiling the data to the file's last byte) is safetensors' own; a
    refusal is named by :func:`_diagnosis` and carries safetensors' message.
    ``"__metadata__": null``, which safetensors reads as no metadata, is refused.
    """
    fh, size = _open_regular(file, "checkpoint")
    with fh:
        head = fh.read(8)
        if len(head) < 8:
            raise CheckpointError(f"checkpoint: {file} is truncated (no safetensors header)")
        (header_len,) = struct.unpack("<Q", head)
        if header_len == 0 or header_len > MAX_HEADER_BYTES:
            raise CheckpointError(
                f"checkpoint: {file} declares a {header_len}-byte safetensors header (1 to "
                f"{MAX_HEADER_BYTES} accepted); not a safetensors file, or a corrupt one"
            )
        raw = fh.read(header_len) if header_len <= size - 8 else b""
    if len(raw) < header_len:
        raise CheckpointError(f"checkpoint: {file} is truncated (header runs past the end)")
    header = bounded_json(
        raw,
        refusal=f"checkpoint: {file} has a corrupt safetensors header",
        keys=f"checkpoint: {file}: the safetensors header",
        same_value_ok=False,
    )
    try:
        with safe_open(str(file), framework="pt") as reader:
            metadata = reader.metadata()
            tensors = {}
            for name in reader.keys():
                sl = reader.get_slice(name)
                tensors[name] = (str(sl.get_dtype()), tuple(sl.get_shape()))
    except Exception as exc:  # safetensors raises its own error types
        why = _diagnosis(header, 8 + header_len, size) or ": not a valid safetensors file"
        raise CheckpointError(f"checkpoint: {file}{why} (safetensors: {exc})") from None
    if metadata is None and header.get("__metadata__", {}) is None:
        raise CheckpointError(
            f"checkpoint: {file}: safetensors __metadata__ must map strings to strings, got None"
        )
    start = 8 + header_len  # the data follows the header; safe_open checked these offsets
    spans = {}
    for name in tensors:
        begin, end = header[name]["data_offsets"]
        spans[name] = (start + begin, start + end)
    return _Header(tensors, metadata or {}, spans)


def _diagnosis(header: Any, data_start: int, size: int) -> str | None:
    """Which tensor and field of a parsed header safetensors refused, as the end of a message
    that starts with the file's name (``": tensor 'w': ..."``, ``" is truncated ..."``; None:
    none found).

    Only for the message: safetensors decides what is read, and its own message names neither
    the tensor nor the field of most refusals.
    """
    if not isinstance(header, dict):
        return f": the safetensors header is a JSON {type(header).__name__}, not an object"
    entries = dict(header)
    metadata = entries.pop("__metadata__", {})
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        return f": safetensors __metadata__ must map strings to strings, got {_short(metadata)}"
    spans = []
    for name, entry in entries.items():
        tensor = f": tensor {name!r}"
        if not isinstance(entry, dict):
            return f"{tensor}: header entry is {_short(entry)}, not an object"
        missing = [key for key in _HEADER_FIELDS if key not in entry]
        if missing:
            return f"{tensor}: header entry lacks {', '.join(missing)}"
        dtype, shape, offsets = (entry[key] for key in _HEADER_FIELDS)
        if not isinstance(dtype, str) or dtype not in _DTYPE_BITS:
            return f"{tensor}: dtype {_short(dtype)} is not a safetensors dtype"
        if not isinstance(shape, list) or not all(_is_count(d) for d in shape):
            return f"{tensor}: shape {_short(shape)} is not a list of non-negative ints"
        if (
            not (isinstance(offsets, list) and len(offsets) == 2 and all(map(_is_count, offsets)))
            or offsets[0] > offsets[1]
        ):
            return f"{tensor}: data_offsets {_short(offsets)} is not [begin, end], begin <= end"
        bits = math.prod(shape) * _DTYPE_BITS[dtype]
        if bits % 8 or offsets[1] - offsets[0] != bits // 8:  # F4/F6: only whole bytes
            odd = f" and {bits % 8} bits" if bits % 8 else ""
            return (
                f"{tensor}: data_offsets {offsets} hold {offsets[1] - offsets[0]} bytes, but "
                f"{dtype} of shape {shape} needs {bits // 8}{odd}"
            )
        spans.append((*offsets, name))
    covered, previous = 0, None
    for begin, end, name in sorted(spans):
        if begin != covered:
            return (
                f": tensor {name!r} (data_offsets [{begin}, {end}]) overlaps tensor {previous!r}"
                if begin < covered
                else f": {begin - covered} bytes before tensor {name!r} belong to no tensor "
                f"(data_offsets must tile the data)"
            )
        covered, previous = end, name
    needed = data_start + covered
    if needed > size:
        return f" is truncated ({size} bytes; the header needs {needed})"
    if needed < size:
        return f" has {size - needed} bytes past its last tensor (the header covers {needed})"
    return None


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _short(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _read_headers(path: str | os.PathLike[str]) -> list[tuple[Path, _Header]]:
    """Every shard's checked header, with the checks that span shards and the index."""
    root = Path(path)
    files, where = _layout(root)
    headers = [(file, _check_header(file)) for file in files]
    owner: dict[str, Path] = {}
    for file, header in headers:
        for name in header.tensors:
            if name in owner:
                raise CheckpointError(
                    f"checkpoint: tensor {name!r} is stored twice, in {owner[name]} and {file}; "
                    f"refusing to pick one"
                )
            owner[name] = file
    if where is not None:
        index = root / INDEX_FILE
        for name, file in where.items():
            if owner.get(name) != file:
                raise CheckpointError(
                    f"checkpoint index: {index} maps {name!r} to {file.name}, which does not "
                    f"hold it"
                )
        for name, file in owner.items():
            if name not in where:
                raise CheckpointError(
                    f"checkpoint index: {index} does not list tensor {name!r} of {file}"
                )
    return headers


def _relative(root: Path, file: Path) -> str:
    return file.relative_to(root).as_posix()


def tensor_infos(path: str | os.PathLike[str]) -> list[TensorInfo]:
    """Names, dtypes and shapes of every tensor in a checkpoint, read from headers only.

    Args:
      path: the model directory.

    Raises:
      CheckpointError: anything :func:`shard_files` refuses; a header that is not a valid
        safetensors header (named file and tensor); one tensor name in two shards; an index
        whose ``weight_map`` disagrees with the shards.

    Numerics: none; ``TensorInfo.file`` is the shard's path relative to ``path``.
    """
    root = Path(path)
    return [
        TensorInfo(name, dtype, shape, _relative(root, file))
        for file, header in _read_headers(root)
        for name, (dtype, shape) in header.tensors.items()
    ]


def iter_tensors(
    path: str | os.PathLike[str], *, device: str | torch.device = "cpu"
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(name, tensor)`` for every tensor of a checkpoint, one shard at a time.

    Every shard's header is checked (as :func:`tensor_infos` does) before the first tensor is
    yielded, so a damaged directory fails before any data is read.

    Args:
      path: the model directory.
      device: where the tensors are put.

    Raises:
      CheckpointError: as :func:`tensor_infos`, or a shard the safetensors reader cannot read.

    Numerics: bit-exact; each tensor is the bytes its header names, in its stored dtype.
    """
    headers = _read_headers(path)
    for file, _header in headers:
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

    Args:
      path: the model directory.

    Raises:
      CheckpointError: as :func:`tensor_infos`, or two shards that give one key (other than
        ``format``) different values (named).

    Numerics: none.
    """
    merged: dict[str, str] = {}
    origin: dict[str, str] = {}
    for file, header in _read_headers(path):
        for key, value in header.metadata.items():
            if key in merged and merged[key] != value and key != "format":
                raise CheckpointError(
                    f"checkpoint: safetensors metadata {key!r} differs between {origin[key]} and "
                    f"{file.name}"
                )
            merged.setdefault(key, value)
            origin.setdefault(key, file.name)
    return merged
