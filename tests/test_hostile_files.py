"""Hostile and damaged checkpoint files: the readers refuse them before opening or misreading.

Each case used to be read (a file outside the model directory, a stray or duplicated tensor,
last one silently winning), to block (a FIFO), or to end in a raw KeyError / TypeError /
AttributeError / OSError; each must now be a CheckpointError naming the file (and the tensor or
index entry). Shards are built with safetensors directly; the end-to-end cases copy a good
GPT-QModel-written checkpoint.
"""

import json
import os
import shutil
import socket
import stat
import struct
import threading
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import floatxq
from floatxq.interop.shards import (
    header_metadata,
    iter_tensors,
    read_json,
    shard_files,
    tensor_infos,
)
from floatxq.lifecycle import CheckpointError

GOOD = Path(__file__).parent / "fixtures" / "gptqmodel_fp8_row"
INDEX = "model.safetensors.index.json"
ONE = "model-00001-of-00002.safetensors"
TWO = "model-00002-of-00002.safetensors"


def _tensors(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "a": torch.randn(2, 3, generator=g),
        "b": torch.randn(4, generator=g).bfloat16(),
        "c": torch.randint(0, 255, (5,), generator=g, dtype=torch.uint8),
    }


def _sharded(root: Path, shards: dict[str, dict[str, torch.Tensor]], weight_map=None) -> Path:
    """Write shards and, unless ``weight_map`` is False, an index naming each tensor's file."""
    root.mkdir(parents=True, exist_ok=True)
    for name, tensors in shards.items():
        save_file(tensors, str(root / name), metadata={"format": "pt"})
    if weight_map is None:
        weight_map = {t: name for name, tensors in shards.items() for t in tensors}
    if weight_map is not False:
        (root / INDEX).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return root


@pytest.fixture
def two(tmp_path) -> Path:
    t = _tensors()
    return _sharded(tmp_path / "m", {ONE: {"a": t["a"]}, TWO: {"b": t["b"], "c": t["c"]}})


def _read_all(root: Path) -> dict[str, torch.Tensor]:
    tensor_infos(root)
    header_metadata(root)
    return dict(iter_tensors(root))


def _within(seconds: float, fn, unblock: Path | None = None):
    """Run ``fn``; fail (instead of hanging the run) when it blocks, e.g. on a FIFO."""
    box: dict[str, object] = {}

    def target():
        try:
            box["value"] = fn()
        except BaseException as exc:  # handed back to the test below
            box["error"] = exc

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        if unblock is not None:  # a writer end lets a reader stuck in open() go
            fd = os.open(unblock, os.O_WRONLY | os.O_NONBLOCK)
            os.close(fd)
        pytest.fail(f"blocked for {seconds} s")
    if "error" in box:
        raise box["error"]
    return box.get("value")


def test_a_good_sharded_directory_reads_bit_exactly(two):
    t = _tensors()
    assert shard_files(two) == [two / ONE, two / TWO]
    got = _read_all(two)
    assert sorted(got) == ["a", "b", "c"]
    for name, value in t.items():
        assert torch.equal(got[name].view(torch.uint8), value.view(torch.uint8))


# ----------------------------------------------------------------------------------------------
# Files outside the model directory
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("entry", ["../x.safetensors", "sub/../../x.safetensors", "absolute"])
def test_index_entries_outside_the_directory_are_refused(two, entry):
    outside = two.parent / "x.safetensors"
    shutil.copyfile(two / TWO, outside)
    entry = str(outside) if entry == "absolute" else entry
    (two / "sub").mkdir()
    payload = json.loads((two / INDEX).read_text())
    payload["weight_map"].update(b=entry, c=entry)
    (two / INDEX).write_text(json.dumps(payload))
    with pytest.raises(CheckpointError, match=rf"{INDEX}.*'b' -> '{entry}'.*refusing"):
        shard_files(two)
    with pytest.raises(CheckpointError, match="refusing"):
        dict(iter_tensors(two))


def test_a_shard_symlinked_outside_the_directory_is_refused(two):
    elsewhere = two.parent / "elsewhere"
    elsewhere.mkdir()
    os.replace(two / TWO, elsewhere / TWO)
    (two / TWO).symlink_to(Path("..") / "elsewhere" / TWO)
    with pytest.raises(CheckpointError, match=rf"{TWO} resolves to .*elsewhere.*outside"):
        tensor_infos(two)


def test_a_symlinked_model_safetensors_outside_is_refused_by_load(tmp_path):
    copy = tmp_path / "ckpt"
    shutil.copytree(GOOD, copy)
    os.replace(copy / "model.safetensors", tmp_path / "real.safetensors")
    (copy / "model.safetensors").symlink_to(tmp_path / "real.safetensors")
    with pytest.raises(CheckpointError, match=r"model\.safetensors resolves to .*outside"):
        floatxq.load(copy)


def test_symlinks_that_stay_inside_and_hub_cache_snapshots_are_read(tmp_path):
    t = _tensors()
    inside = _sharded(tmp_path / "in", {"real.safetensors": t}, weight_map=False)
    (inside / "model.safetensors").symlink_to("real.safetensors")
    # a huggingface_hub cache: snapshots/<rev>/NAME -> ../../blobs/<hash>
    repo = tmp_path / "models--org--tiny"
    (repo / "blobs").mkdir(parents=True)
    snapshot = repo / "snapshots" / "0123abc"
    snapshot.mkdir(parents=True)
    os.replace(inside / "real.safetensors", repo / "blobs" / "deadbeef")
    (inside / "real.safetensors").symlink_to(repo / "blobs" / "deadbeef")
    (snapshot / "model.safetensors").symlink_to(Path("..") / ".." / "blobs" / "deadbeef")
    got = _read_all(snapshot)
    assert all(torch.equal(got[k].view(torch.uint8), v.view(torch.uint8)) for k, v in t.items())
    # the same symlink from a directory that is not a hub snapshot leads outside
    with pytest.raises(CheckpointError, match="outside"):
        tensor_infos(inside)


# ----------------------------------------------------------------------------------------------
# Special files in place of shards (never opened)
# ----------------------------------------------------------------------------------------------


def _fifo(path: Path) -> Path:
    os.mkfifo(path)
    return path


def _socket(path: Path) -> Path:
    with socket.socket(socket.AF_UNIX) as sock:
        sock.bind(str(path))
    return path


def _device(path: Path) -> Path:
    try:
        os.mknod(path, 0o600 | stat.S_IFCHR, os.makedev(1, 5))  # like /dev/zero
    except PermissionError:
        pytest.skip("creating a device node needs privileges")
    return path


def _directory(path: Path) -> Path:
    path.mkdir()
    return path


SPECIALS = {"FIFO": _fifo, "socket": _socket, "character device": _device, "directory": _directory}


@pytest.mark.parametrize("kind", sorted(SPECIALS))
@pytest.mark.parametrize("where", ["indexed", "single", "glob"])
def test_special_files_in_place_of_shards_are_refused_unopened(tmp_path, kind, where):
    t = _tensors()
    if where == "indexed":
        root = _sharded(tmp_path / "m", {ONE: {"a": t["a"]}, TWO: {"b": t["b"]}})
        (root / TWO).unlink()
        special = SPECIALS[kind](root / TWO)
    elif where == "single":
        root = tmp_path / "m"
        root.mkdir()
        special = SPECIALS[kind](root / "model.safetensors")
    else:
        root = _sharded(tmp_path / "m", {"a.safetensors": {"a": t["a"]}}, weight_map=False)
        special = SPECIALS[kind](root / "b.safetensors")
    name = special.name.replace(".", r"\.")
    with pytest.raises(CheckpointError, match=rf"{name} is a {kind}, not a regular file"):
        _within(10, lambda: tensor_infos(root), unblock=special if kind == "FIFO" else None)


@pytest.mark.parametrize("kind", ["FIFO", "directory"])
def test_a_special_file_in_place_of_config_json_is_refused_unopened(tmp_path, kind):
    special = SPECIALS[kind](tmp_path / "config.json")
    with pytest.raises(CheckpointError, match=rf"load: .*config\.json is a {kind}"):
        _within(10, lambda: read_json(special, what="load"), unblock=special)


def test_a_huge_json_file_is_refused_unread(tmp_path):
    config = tmp_path / "config.json"
    with open(config, "wb") as fh:  # sparse: 200 MB that take no disk
        fh.write(b"{")
        fh.truncate(200_000_000)
    with pytest.raises(CheckpointError, match=r"config\.json is 200000000 bytes; JSON files over"):
        read_json(config, what="load")


# ----------------------------------------------------------------------------------------------
# Shards that disagree with each other or with the index
# ----------------------------------------------------------------------------------------------


def test_one_tensor_in_two_unindexed_shards_is_refused(tmp_path):
    root = _sharded(
        tmp_path / "m",
        {"a.safetensors": _tensors(0), "b.safetensors": {"a": _tensors(1)["a"]}},
        weight_map=False,
    )
    match = r"tensor 'a' is stored twice, in .*a\.safetensors and .*b\.safetensors"
    for read in (tensor_infos, lambda r: dict(iter_tensors(r)), header_metadata):
        with pytest.raises(CheckpointError, match=match):
            read(root)


def test_one_tensor_in_two_indexed_shards_is_refused(two):
    t = _tensors(1)
    save_file({"a": t["a"], "b": t["b"], "c": t["c"]}, str(two / TWO))  # TWO now also holds 'a'
    with pytest.raises(CheckpointError, match=rf"'a' is stored twice, in .*{ONE} and .*{TWO}"):
        dict(iter_tensors(two))


def test_one_tensor_in_two_shards_is_refused_by_load(tmp_path):
    copy = tmp_path / "ckpt"
    shutil.copytree(GOOD, copy)
    state = load_file(str(copy / "model.safetensors"))
    first = sorted(state)[0]
    (copy / "model.safetensors").unlink()
    save_file(state, str(copy / ONE), metadata={"format": "pt"})
    save_file({first: torch.zeros_like(state[first])}, str(copy / TWO), metadata={"format": "pt"})
    weight_map = dict(dict.fromkeys(state, ONE), **{first: TWO})
    (copy / INDEX).write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(CheckpointError, match=rf"{first}' is stored twice"):
        floatxq.load(copy)


def test_an_index_naming_a_tensor_its_shard_lacks_is_refused(two):
    payload = json.loads((two / INDEX).read_text())
    payload["weight_map"]["a"] = TWO
    payload["weight_map"]["ghost"] = ONE
    (two / INDEX).write_text(json.dumps(payload))
    with pytest.raises(CheckpointError, match=rf"{INDEX} maps 'a' to {TWO}, which does not hold"):
        tensor_infos(two)


def test_a_shard_tensor_missing_from_the_index_is_refused(two):
    payload = json.loads((two / INDEX).read_text())
    del payload["weight_map"]["c"]
    (two / INDEX).write_text(json.dumps(payload))
    with pytest.raises(CheckpointError, match=rf"{INDEX} does not list tensor 'c' of .*{TWO}"):
        dict(iter_tensors(two))


@pytest.mark.parametrize("stray", ["model-00003-of-00003.safetensors", "model.safetensors"])
def test_a_stray_shard_next_to_an_index_is_refused(two, stray):
    save_file({"z": torch.zeros(3)}, str(two / stray))
    with pytest.raises(CheckpointError, match=rf"{stray} is a shard {INDEX} does not name"):
        shard_files(two)


def test_other_safetensors_files_next_to_an_index_are_ignored(two):
    # Mistral's repositories ship consolidated.safetensors next to the sharded copy.
    save_file({"a": torch.zeros(2, 3)}, str(two / "consolidated.safetensors"))
    assert shard_files(two) == [two / ONE, two / TWO]
    assert sorted(_read_all(two)) == ["a", "b", "c"]


@pytest.mark.parametrize("entry", [7, None, "", "   ", ["x"]])
def test_index_entries_that_are_not_file_names_are_refused(two, entry):
    payload = json.loads((two / INDEX).read_text())
    payload["weight_map"]["b"] = entry
    (two / INDEX).write_text(json.dumps(payload))
    with pytest.raises(CheckpointError, match=rf"{INDEX}: 'b' -> .* is not a file name"):
        shard_files(two)


def test_an_index_giving_one_tensor_two_shards_is_refused(two):
    text = (two / INDEX).read_text().replace('"a": ', f'"a": "{TWO}", "a": ', 1)
    (two / INDEX).write_text(text)
    with pytest.raises(CheckpointError, match=rf"{INDEX} gives key 'a' twice"):
        shard_files(two)


# ----------------------------------------------------------------------------------------------
# Damaged safetensors headers
# ----------------------------------------------------------------------------------------------

_DATA = bytes(range(22))  # a: F32 [2, 2] (16 bytes), b: BF16 [3] (6 bytes)
_HEADER = {
    "__metadata__": {"format": "pt"},
    "a": {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16]},
    "b": {"dtype": "BF16", "shape": [3], "data_offsets": [16, 22]},
}


def _raw(root: Path, header, data: bytes = _DATA, length: int | None = None) -> Path:
    """A ``model.safetensors`` with the header given (an object, or bytes as they are)."""
    root.mkdir(exist_ok=True)
    blob = header if isinstance(header, bytes) else json.dumps(header).encode()
    n = len(blob) if length is None else length
    (root / "model.safetensors").write_bytes(struct.pack("<Q", n) + blob + data)
    return root


def _edited(change) -> dict:
    header = json.loads(json.dumps(_HEADER))
    change(header)
    return header


def test_the_hand_written_header_reads(tmp_path):
    got = _read_all(_raw(tmp_path / "m", _HEADER))
    assert got["a"].shape == (2, 2) and got["b"].shape == (3,)
    assert got["a"].flatten().view(torch.uint8).tolist() == list(range(16))
    assert got["b"].view(torch.uint8).tolist() == list(range(16, 22))


HEADERS = {
    "a JSON list": ([1, 2], r"header is a JSON list, not an object"),
    "a JSON scalar": (17, r"header is a JSON int, not an object"),
    "an int entry": (_edited(lambda h: h.update(a=5)), r"'a': header entry is 5, not an object"),
    "a list entry": (_edited(lambda h: h.update(a=[0, 16])), r"'a': header entry is \[0, 16\]"),
    "no dtype": (_edited(lambda h: h["a"].pop("dtype")), r"'a': header entry lacks dtype"),
    "no shape": (_edited(lambda h: h["b"].pop("shape")), r"'b': header entry lacks shape"),
    "no offsets": (
        _edited(lambda h: h["a"].pop("data_offsets")),
        r"'a': header entry lacks data_offsets",
    ),
    "unknown dtype": (_edited(lambda h: h["a"].update(dtype="F31")), r"'a': dtype 'F31' is not"),
    "dtype not a str": (_edited(lambda h: h["a"].update(dtype=32)), r"'a': dtype 32 is not"),
    "negative dim": (_edited(lambda h: h["b"].update(shape=[-3])), r"'b': shape \[-3\] is not"),
    "float dim": (_edited(lambda h: h["b"].update(shape=[3.0])), r"'b': shape \[3\.0\] is not"),
    "shape a str": (_edited(lambda h: h["b"].update(shape="3")), r"'b': shape '3' is not"),
    "three offsets": (
        _edited(lambda h: h["b"].update(data_offsets=[16, 19, 22])),
        r"'b': data_offsets \[16, 19, 22\] is not \[begin, end\]",
    ),
    "str offsets": (
        _edited(lambda h: h["b"].update(data_offsets=["16", "22"])),
        r"'b': data_offsets \['16', '22'\] is not",
    ),
    "bool offsets": (
        _edited(lambda h: h["a"].update(data_offsets=[False, 16])),
        r"'a': data_offsets \[False, 16\] is not",
    ),
    "reversed offsets": (
        _edited(lambda h: h["b"].update(data_offsets=[22, 16])),
        r"'b': data_offsets \[22, 16\] is not",
    ),
    "span not the shape's": (
        _edited(lambda h: h["b"].update(shape=[2])),
        r"'b': data_offsets \[16, 22\] hold 6 bytes, but BF16 of shape \[2\] needs 4",
    ),
    "overlapping": (
        _edited(lambda h: h.update(c={"dtype": "U8", "shape": [2], "data_offsets": [15, 17]})),
        r"tensor 'c' \(data_offsets \[15, 17\]\) overlaps tensor 'a'",
    ),
    "a gap": (
        _edited(lambda h: h["b"].update(dtype="U8", shape=[4], data_offsets=[18, 22])),
        r"2 bytes before tensor 'b' belong to no tensor",
    ),
    "past the data": (
        _edited(lambda h: h["b"].update(shape=[5], data_offsets=[16, 26])),
        r"is truncated \(\d+ bytes; the header needs \d+\)",
    ),
    "short of the data": (
        _edited(lambda h: h["b"].update(shape=[2], data_offsets=[16, 20])),
        r"has 2 bytes past its last tensor",
    ),
    "metadata a list": (
        _edited(lambda h: h.update(__metadata__=["pt"])),
        r"__metadata__ must map strings to strings, got \['pt'\]",
    ),
    "metadata an int value": (
        _edited(lambda h: h["__metadata__"].update(format=1)),
        r"__metadata__ must map strings to strings",
    ),
    "metadata null": (
        _edited(lambda h: h.update(__metadata__=None)),
        r"__metadata__ must map strings to strings, got None",
    ),
    "a name twice": (
        json.dumps(_HEADER).replace('"b": ', '"a": {}, "b": ').encode(),
        r"the safetensors header gives key 'a' twice",
    ),
    "NaN": (
        json.dumps(_HEADER).replace("[2, 2]", "[2, NaN]").encode(),
        r"corrupt safetensors header \(NaN is not a finite number",
    ),
    "a 5000-digit int": (
        json.dumps(_HEADER).replace("[2, 2]", "[2, " + "9" * 5000 + "]").encode(),
        r"corrupt safetensors header \(an integer of 5000 digits \(at most 30 are read\)\)",
    ),
    "nested deep": (
        json.dumps(_HEADER).replace("[2, 2]", "[" * 100_000 + "]" * 100_000).encode(),
        r"corrupt safetensors header \(JSON nested deeper than 64 levels\)",
    ),
    "not UTF-8": (b'{"\xff": 1}', r"corrupt safetensors header \(not UTF-8 text"),
}


@pytest.mark.parametrize("case", sorted(HEADERS))
def test_damaged_headers_are_named(tmp_path, case):
    header, message = HEADERS[case]
    root = _raw(tmp_path / "m", header)
    for read in (tensor_infos, lambda r: dict(iter_tensors(r)), header_metadata):
        with pytest.raises(CheckpointError, match=rf"model\.safetensors.*{message}"):
            read(root)


@pytest.mark.parametrize("length", [2**64 - 1, 100_000_001, 2**40, 0])
def test_absurd_header_lengths_are_refused_unread(tmp_path, length):
    root = _raw(tmp_path / "m", _HEADER, length=length)
    with pytest.raises(CheckpointError, match=rf"declares a {length}-byte safetensors header"):
        tensor_infos(root)


def test_a_header_longer_than_the_file_is_truncation(tmp_path):
    root = _raw(tmp_path / "m", _HEADER, length=5000)
    with pytest.raises(CheckpointError, match=r"is truncated \(header runs past the end\)"):
        tensor_infos(root)


def test_a_huge_header_in_a_huge_file_is_refused_unread(tmp_path):
    root = tmp_path / "m"
    root.mkdir()
    with open(root / "model.safetensors", "wb") as fh:  # sparse: 300 MB that take no disk
        fh.write(struct.pack("<Q", 250_000_000) + b"{")
        fh.truncate(300_000_000)
    with pytest.raises(CheckpointError, match=r"declares a 250000000-byte safetensors header"):
        tensor_infos(root)


def test_a_symlink_loop_in_place_of_a_shard_is_refused(tmp_path):
    root = tmp_path / "m"
    root.mkdir()
    (root / "model.safetensors").symlink_to("model.safetensors")
    with pytest.raises(CheckpointError, match=r"cannot stat .*model\.safetensors"):
        tensor_infos(root)
