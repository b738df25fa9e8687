"""Fuzzed safetensors headers: refused, or read as exactly what the file says.

A small valid file (several dtypes, a zero-size tensor, metadata) is damaged: JSON values
replaced, fields dropped, dtypes / shapes / offsets changed, names added or renamed, the length
field changed, bytes flipped, inserted or deleted, the file truncated. For every result
``tensor_infos`` and ``iter_tensors`` either raise ``CheckpointError`` or return, for each name
the header lists, a tensor of the declared dtype and shape whose bytes are the bytes at its
declared offsets, with the offsets tiling the file to its last byte; a header that still says
what the original says gives back the original bits. The expected tensors come from the test's
own reading of the safetensors format (``struct`` + ``json``), not from the reader under test.
"""

import json
import struct
import tempfile
from pathlib import Path

import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st
from safetensors.torch import save_file

from floatxq.interop.checkpoint import CheckpointError
from floatxq.interop.shards import header_metadata, iter_tensors, tensor_infos

# The safetensors format's dtypes as torch reads them.
_TORCH = {
    "BOOL": torch.bool, "U8": torch.uint8, "I8": torch.int8, "I16": torch.int16,
    "U16": torch.uint16, "F16": torch.float16, "BF16": torch.bfloat16, "I32": torch.int32,
    "U32": torch.uint32, "F32": torch.float32, "F64": torch.float64, "I64": torch.int64,
    "U64": torch.uint64, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
    "F8_E8M0": torch.float8_e8m0fnu, "C64": torch.complex64,
}  # fmt: skip
_DTYPES = [*_TORCH, "f32", "F31", "", "F 32", "float32"]


def _original() -> tuple[bytes, dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    tensors = {
        "a": torch.randn(2, 3, generator=g),
        "b": torch.randn(4, generator=g).bfloat16(),
        "c": torch.arange(5, dtype=torch.uint8) + 65,
        "d": torch.tensor([-(2**40)], dtype=torch.int64),
        "e": torch.zeros(0, 2),
        "f": torch.tensor([0.5, -2.0, 448.0]).to(torch.float8_e4m3fn),
        "g": torch.tensor(3.0),
    }
    with tempfile.TemporaryDirectory() as tmp:
        file = Path(tmp) / "x.safetensors"
        save_file(tensors, str(file), metadata={"format": "pt", "note": "x"})
        return file.read_bytes(), tensors


ORIGINAL, TENSORS = _original()
(N,) = struct.unpack("<Q", ORIGINAL[:8])
HEADER = json.loads(ORIGINAL[8 : 8 + N])
DATA = ORIGINAL[8 + N :]
HALF = settings(max_examples=max(10, settings().max_examples // 2))  # each example reads it all


def _bytes_of(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def _read(blob: bytes) -> tuple[dict[str, torch.Tensor], dict[str, str]] | None:
    """What floatxq's readers make of ``blob`` as a model.safetensors (None: refused)."""
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "model.safetensors").write_bytes(blob)
        try:
            infos = tensor_infos(tmp)
            tensors = dict(iter_tensors(tmp))
            metadata = header_metadata(tmp)
        except CheckpointError:
            return None
    by_name = {info.name: info for info in infos}
    assert sorted(by_name) == sorted(tensors)
    for name, t in tensors.items():
        assert by_name[name].shape == tuple(t.shape)
    return tensors, metadata


def _assert_what_the_file_says(blob: bytes, read) -> None:
    """An accepted file: every tensor is exactly what its header says, read from the blob."""
    tensors, metadata = read
    (n,) = struct.unpack("<Q", blob[:8])
    header = json.loads(blob[8 : 8 + n])
    assert metadata == header.pop("__metadata__", {})
    assert sorted(tensors) == sorted(header)
    end = 0
    for name, t in tensors.items():
        entry = header[name]
        begin, stop = entry["data_offsets"]
        assert t.dtype == _TORCH[entry["dtype"]] and list(t.shape) == entry["shape"], name
        assert _bytes_of(t) == blob[8 + n + begin : 8 + n + stop], name
        end = max(end, stop)
    assert 8 + n + end == len(blob), "the offsets cover the file to its last byte"
    if header == {k: v for k, v in HEADER.items() if k != "__metadata__"} and (
        blob[8 + n :] == DATA
    ):
        for name, t in tensors.items():
            assert t.dtype == TENSORS[name].dtype and _bytes_of(t) == _bytes_of(TENSORS[name])


def _check(blob: bytes) -> bool:
    """Refused (False) or read as the file says (True)."""
    read = _read(blob)
    if read is not None:
        _assert_what_the_file_says(blob, read)
    return read is not None


def test_the_original_reads_bit_exactly():
    tensors, metadata = _read(ORIGINAL)
    assert metadata == {"format": "pt", "note": "x"}
    assert sorted(tensors) == sorted(TENSORS)
    for name, t in tensors.items():
        assert t.dtype == TENSORS[name].dtype and t.shape == TENSORS[name].shape
        assert _bytes_of(t) == _bytes_of(TENSORS[name])


# ----------------------------------------------------------------------------------------------
# JSON-level damage
# ----------------------------------------------------------------------------------------------

_JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=4),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=3), inner),
    max_leaves=6,
)
_NAMES = st.sampled_from([*sorted(TENSORS), "z", "__metadata__"])
_SMALL = st.integers(-2, 80)
_PLAUSIBLE = {
    "dtype": st.sampled_from(_DTYPES),
    "shape": st.lists(st.integers(-1, 8), max_size=3),
    "data_offsets": st.lists(_SMALL, min_size=2, max_size=2) | st.lists(_SMALL, max_size=3),
}


@st.composite
def _edit(draw, header: dict) -> None:
    """One change to a header (in place)."""
    kind = draw(
        st.sampled_from(["field", "any", "drop field", "drop", "add", "rename", "meta", "root"])
    )
    name = draw(_NAMES)
    field = draw(st.sampled_from(sorted(_PLAUSIBLE)))
    entry = header.get(name)
    if kind == "field" and isinstance(entry, dict):
        entry[field] = draw(_PLAUSIBLE[field])
    elif kind == "any" and isinstance(entry, dict):
        entry[field] = draw(_JSON)
    elif kind == "drop field" and isinstance(entry, dict):
        entry.pop(field, None)
    elif kind == "drop":
        header.pop(name, None)
    elif kind == "add":
        header[name] = {key: draw(value) for key, value in _PLAUSIBLE.items()}
    elif kind == "rename" and name in header:
        header[draw(_NAMES)] = header.pop(name)
    elif kind == "meta":
        header["__metadata__"] = draw(_JSON)
    elif kind == "root":
        header.clear()
        header["__root__"] = draw(_JSON)


@st.composite
def json_damage(draw) -> bytes:
    header = json.loads(json.dumps(HEADER))
    for _ in range(draw(st.integers(1, 3))):
        draw(_edit(header))
    root = header.pop("__root__") if "__root__" in header else header
    text = json.dumps(root, sort_keys=draw(st.booleans())) + " " * draw(st.integers(0, 7))
    blob = text.encode()
    n = len(blob) + draw(st.sampled_from([0, 0, 0, -1, 1, -8]))
    return struct.pack("<Q", max(n, 0)) + blob + DATA


def _swapped_offsets() -> bytes:
    """A valid file that says something else: two same-size tensors trade their bytes."""
    header = json.loads(json.dumps(HEADER))
    header["a"]["shape"], header["d"]["dtype"] = [6], "I64"
    header["c"]["data_offsets"], header["f"]["data_offsets"] = (
        header["f"]["data_offsets"],
        header["c"]["data_offsets"],
    )
    header["c"]["shape"], header["f"]["shape"] = [3], [5]
    blob = json.dumps(header).encode()
    return struct.pack("<Q", len(blob)) + blob + DATA


def _overlap() -> bytes:
    header = json.loads(json.dumps(HEADER))
    begin = header["a"]["data_offsets"][0]
    header["z"] = {"dtype": "U8", "shape": [4], "data_offsets": [begin, begin + 4]}
    blob = json.dumps(header).encode()
    return struct.pack("<Q", len(blob)) + blob + DATA


def _padding_taken_from_the_length() -> bytes:
    """A header padded with spaces and a length one short: still JSON, but the data shifts."""
    text = ORIGINAL[8 : 8 + N] + b"   "
    return struct.pack("<Q", len(text) - 1) + text + DATA


@given(json_damage())
@example(_swapped_offsets())
@example(_overlap())
@example(_padding_taken_from_the_length())
def test_damaged_json_is_refused_or_read_as_it_says(blob):
    _check(blob)


def test_the_pinned_examples_go_both_ways():
    """The valid rewrite is read (as it says: swapped bytes); the damaged ones are refused."""
    assert _check(_swapped_offsets())
    tensors, _ = _read(_swapped_offsets())
    assert _bytes_of(tensors["c"]) == _bytes_of(TENSORS["f"])
    assert not _check(_overlap())
    assert not _check(_padding_taken_from_the_length())


@HALF
@given(st.data())
def test_a_rewritten_header_that_says_the_same_reads_the_original(data):
    """Key order, spacing and padding do not matter; the original bits come back."""
    header = dict(HEADER)
    keys = data.draw(st.permutations(sorted(header)))
    text = json.dumps({k: header[k] for k in keys}, indent=data.draw(st.sampled_from([None, 1])))
    blob = (text + " " * data.draw(st.integers(0, 9))).encode()
    assert _check(struct.pack("<Q", len(blob)) + blob + DATA)


# ----------------------------------------------------------------------------------------------
# Byte-level damage
# ----------------------------------------------------------------------------------------------


@st.composite
def byte_damage(draw) -> bytes:
    blob = bytearray(ORIGINAL)
    for _ in range(draw(st.integers(1, 3))):
        # mostly the length field and the header, sometimes the data
        where = draw(st.integers(0, 8 + N - 1) | st.integers(0, max(len(blob) - 1, 0)))
        where = min(where, max(len(blob) - 1, 0))
        kind = draw(st.sampled_from(["flip", "insert", "delete", "set"]))
        if kind == "flip" and blob:
            blob[where] ^= draw(st.integers(1, 255))
        elif kind == "set" and blob:
            blob[where] = draw(st.sampled_from(b' "{}[],:0123456789-.eEaxF\\\x00\xff'))
        elif kind == "insert":
            blob.insert(where, draw(st.integers(0, 255)))
        elif kind == "delete" and blob:
            del blob[where]
    return bytes(blob)


@given(byte_damage())
def test_damaged_bytes_are_refused_or_read_as_they_say(blob):
    _check(blob)


@given(st.integers(0, len(ORIGINAL) - 1))
@example(8 + N)  # the header whole, no data
@example(len(ORIGINAL) - 1)
def test_a_truncated_file_is_always_refused(size):
    assert not _check(ORIGINAL[:size])


@given(st.integers(0, 2**64 - 1).filter(lambda n: n != N))
@example(N - 1)
@example(N + 1)
@example(2**64 - 1)
def test_a_changed_length_field_is_always_refused(n):
    assert not _check(struct.pack("<Q", n) + ORIGINAL[8:])


@HALF
@given(st.integers(8 + N, len(ORIGINAL) - 1), st.integers(1, 255))
def test_flipped_data_bytes_are_read_as_stored(where, xor):
    """Damage inside the data is not detectable from the header: it reads back as stored."""
    blob = bytearray(ORIGINAL)
    blob[where] ^= xor
    assert _check(bytes(blob))
