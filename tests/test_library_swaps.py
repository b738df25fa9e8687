"""Where a kept library now does the job: safetensors checks headers, huggingface_hub splits shards
and reads sizes, the regex package bounds rule matching with a timeout.

Each test pins what floatxq still adds on top (the checks the library lacks, the names in the
messages) and what the library decides.
"""

import json
import struct
from pathlib import Path

import pytest
import torch
from huggingface_hub import split_torch_state_dict_into_shards
from safetensors.torch import load_file
from torch import nn

from floatxq.config import RULE_MATCH_TIMEOUT_S, DynamicRule
from floatxq.interop.checkpoint import INDEX_FILE, write_checkpoint
from floatxq.interop.shards import header_metadata, iter_tensors, tensor_infos
from floatxq.lifecycle import CheckpointError
from floatxq.lifecycle.model import _parse_size

_DATA = bytes(range(22))
_HEADER = {
    "__metadata__": {"format": "pt"},
    "a": {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16]},
    "b": {"dtype": "BF16", "shape": [3], "data_offsets": [16, 22]},
}


def _raw(root: Path, text: str, data: bytes = _DATA) -> Path:
    root.mkdir(exist_ok=True)
    blob = text.encode()
    (root / "model.safetensors").write_bytes(struct.pack("<Q", len(blob)) + blob + data)
    return root


# ----------------------------------------------------------------------------------------------
# safetensors headers
# ----------------------------------------------------------------------------------------------


def test_a_safetensors_refusal_carries_its_message_and_the_tensor(tmp_path):
    header = json.loads(json.dumps(_HEADER))
    header["b"]["data_offsets"] = [18, 22]
    header["b"]["dtype"], header["b"]["shape"] = "U8", [4]
    root = _raw(tmp_path / "m", json.dumps(header))
    with pytest.raises(CheckpointError) as caught:
        tensor_infos(root)
    message = str(caught.value)
    assert "model.safetensors: 2 bytes before tensor 'b' belong to no tensor" in message
    assert "(safetensors: " in message and "invalid offset for tensor `b`" in message


@pytest.mark.parametrize(
    ("text", "named"),
    [
        # safetensors reads both and keeps the last entry: floatxq refuses the file
        (
            json.dumps(_HEADER).replace(
                '"b": ', '"a": {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16]}, "b": '
            ),
            r"safetensors header gives key 'a' twice",
        ),
        (
            json.dumps(_HEADER).replace('{"format": "pt"}', '{"format": "pt", "format": "np"}'),
            r"safetensors header gives key 'format' twice",
        ),
        # safetensors reads it as no metadata
        (
            json.dumps({**_HEADER, "__metadata__": None}),
            r"__metadata__ must map strings to strings, got None",
        ),
    ],
    ids=["tensor twice", "metadata key twice", "metadata null"],
)
def test_what_safetensors_accepts_floatxq_still_refuses(tmp_path, text, named):
    root = _raw(tmp_path / "m", text)
    for read in (tensor_infos, lambda r: dict(iter_tensors(r)), header_metadata):
        with pytest.raises(CheckpointError, match=rf"model\.safetensors.*{named}"):
            read(root)


def test_what_safetensors_reads_is_read(tmp_path):
    # a dtype floatxq's own table lacked: safetensors decides, and reads the bytes as stored
    header = json.loads(json.dumps(_HEADER))
    header["b"] = {"dtype": "F8_E4M3FNUZ", "shape": [6], "data_offsets": [16, 22]}
    root = _raw(tmp_path / "m", json.dumps(header))
    infos = {info.name: info for info in tensor_infos(root)}
    assert infos["b"].dtype == "F8_E4M3FNUZ" and infos["b"].shape == (6,)
    got = dict(iter_tensors(root))
    assert got["b"].dtype == torch.float8_e4m3fnuz
    assert got["b"].view(torch.uint8).tolist() == list(range(16, 22))
    assert header_metadata(root) == {"format": "pt"}


# ----------------------------------------------------------------------------------------------
# Shards and sizes as Hugging Face reads them
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("given", "expected"),
    [("4GB", 4_000_000_000), ("4GiB", 4 * 2**30), ("5MB", 5_000_000), ("3 KiB", 3072)],
)
def test_sizes_are_read_as_hugging_face_reads_them(given, expected):
    assert _parse_size(given) == expected


def test_shards_are_split_as_transformers_splits_them(tmp_path):
    g = torch.Generator().manual_seed(0)
    sizes = [(16, 16), (64, 64), (8,), (16, 16), (16, 16)]  # 1 KiB, 16 KiB, 32 B, 1 KiB, 1 KiB
    state = {f"t{i}": torch.randn(*s, generator=g) for i, s in enumerate(sizes)}
    out = write_checkpoint(tmp_path / "m", state, config={}, max_shard_bytes=2100)
    index = json.loads((out / INDEX_FILE).read_text())
    hf = split_torch_state_dict_into_shards(
        state, filename_pattern="model{suffix}.safetensors", max_shard_size=2100
    )
    assert index["weight_map"] == hf.tensor_to_filename
    assert index["metadata"]["total_size"] == sum(t.nbytes for t in state.values())
    for file, names in hf.filename_to_tensors.items():
        stored = load_file(str(out / file))
        assert sorted(stored) == sorted(names)
        assert all(torch.equal(stored[n], state[n]) for n in names)
    # t1 (16 KiB, over the limit) alone in its shard, listed first as transformers lists it
    shard = {name: int(file[6:11]) for name, file in index["weight_map"].items()}
    assert shard == {"t0": 2, "t1": 1, "t2": 2, "t3": 2, "t4": 3}
    assert set(index["weight_map"].values()) == {
        f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)
    }


def test_everything_that_fits_is_one_model_safetensors(tmp_path):
    state = {"a": torch.zeros(4), "b": torch.ones(2, 2)}
    out = write_checkpoint(tmp_path / "m", state, config={}, max_shard_bytes=_parse_size("1KB"))
    assert (out / "model.safetensors").is_file() and not (out / INDEX_FILE).exists()


# ----------------------------------------------------------------------------------------------
# Rule patterns bounded by the regex package's timeout
# ----------------------------------------------------------------------------------------------


def test_a_compressed_tensors_ignore_regex_is_bounded_too(production_checks):
    from floatxq.interop.readers import _ct_matches

    linear = nn.Linear(1, 1)
    assert _ct_matches("re:.*mlp", "model.layers.0.mlp", linear)
    with pytest.raises(ValueError, match=r"'re:\(a\|aa\)\+\$': matching module 'a+!' took over"):
        _ct_matches("re:(a|aa)+$", "a" * 40 + "!", linear)


def test_the_timeout_is_small():
    assert 0 < RULE_MATCH_TIMEOUT_S <= 0.1
    assert DynamicRule(key="-:(a+)+$", overrides={}).matches("a" * 255 + "!") is False
