"""A checkpoint read a submodule at a time (floatxq/interop/lazy_source.py): a meta shell filled
piece by piece equals ``from_pretrained``'s model bit for bit, holds no storage before and after,
reads only the byte ranges asked for, and keeps host memory to the pieces it holds."""

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import save_file

from floatxq.interop.checkpoint import CheckpointError
from floatxq.interop.lazy_source import (
    LazyCheckpoint,
    build_shell,
    materialize,
    release,
    storage_bytes,
    tied_sources,
)
from floatxq.lifecycle.rebuild import _load_plain
from floatxq.testing.checkpoints import write_random_llama
from floatxq.tiny import TINY_LLAMA_DIR

REPO = Path(__file__).resolve().parents[1]


def _small_llama(tmp: Path, *, tied: bool, layers: int = 3, seed: int = 0) -> Path:
    config = transformers.LlamaConfig(
        vocab_size=96, hidden_size=64, intermediate_size=160, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        tie_word_embeddings=tied,
    )  # fmt: skip
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(config).to(torch.bfloat16)
    with torch.no_grad():  # norms away from 1, so a norm read from the wrong place shows
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.uniform_(0.5, 1.5)
    model.save_pretrained(tmp, max_shard_size="60KB")
    return tmp


@pytest.fixture(scope="module")
def sharded_tied(tmp_path_factory) -> Path:
    path = _small_llama(tmp_path_factory.mktemp("tied"), tied=True)
    assert len(list(path.glob("model-*-of-*.safetensors"))) >= 3
    return path


@pytest.fixture(scope="module")
def sharded_untyped(tmp_path_factory) -> Path:
    """Untied, sharded, and a config.json without ``dtype``: from_pretrained takes the weights'."""
    path = _small_llama(tmp_path_factory.mktemp("untyped"), tied=False, seed=1)
    config = json.loads((path / "config.json").read_text())
    config.pop("dtype", None)
    config.pop("torch_dtype", None)
    (path / "config.json").write_text(json.dumps(config))
    return path


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    """A tensor's bytes, for a bitwise comparison (NaN- and signed-zero-exact)."""
    return tensor.detach().contiguous().reshape(-1).view(torch.uint8)


def _pieces(model: torch.nn.Module) -> list[str]:
    layers = [f"model.layers.{i}" for i in range(model.config.num_hidden_layers)]
    # lm_head first: for a tied model it has to read the embedding itself
    return ["lm_head", *reversed(layers), "model.norm", "model.embed_tokens", "model.rotary_emb"]


def _checkpoint(name: str, request: pytest.FixtureRequest) -> Path:
    return Path(TINY_LLAMA_DIR) if name == "tiny" else request.getfixturevalue(name)


@pytest.mark.parametrize("dtype", [None, torch.float32])
@pytest.mark.parametrize("which", ["tiny", "sharded_tied", "sharded_untyped"])
def test_piecewise_shell_equals_load_plain_bitwise(which, dtype, request):
    path = _checkpoint(which, request)
    reference = _load_plain(path, device=None, dtype=dtype)
    shell = build_shell(path, dtype=dtype)
    assert type(shell) is type(reference) and not shell.training
    source = LazyCheckpoint(path)
    for prefix in _pieces(shell):
        materialize(shell, prefix, source)
    ours, theirs = shell.state_dict(), reference.state_dict()
    assert list(ours) == list(theirs)
    for name in theirs:
        assert ours[name].dtype == theirs[name].dtype, name
        assert ours[name].shape == theirs[name].shape, name
        assert torch.equal(_bits(ours[name]), _bits(theirs[name])), name
    ours_buffers, their_buffers = dict(shell.named_buffers()), dict(reference.named_buffers())
    assert list(ours_buffers) == list(their_buffers)
    for name, buffer in their_buffers.items():  # rotary inv_freq: not in the files
        assert ours_buffers[name].dtype == buffer.dtype, name
        assert torch.equal(_bits(ours_buffers[name]), _bits(buffer)), name
    tied = reference.config.tie_word_embeddings
    assert (shell.lm_head.weight is shell.model.embed_tokens.weight) == tied
    assert (reference.lm_head.weight is reference.model.embed_tokens.weight) == tied
    tokens = torch.randint(0, reference.config.vocab_size, (2, 11), generator=torch.Generator())
    with torch.no_grad():
        assert torch.equal(_bits(shell(tokens).logits), _bits(reference(tokens).logits))


def test_dtype_rule_follows_from_pretrained(sharded_untyped):
    # no dtype in config.json: from_pretrained takes the stored one, and so does the shell
    assert next(build_shell(sharded_untyped).parameters()).dtype == torch.bfloat16
    assert next(build_shell(TINY_LLAMA_DIR, dtype=torch.float16).parameters()).dtype == (
        torch.float16
    )


def _all_meta(model: torch.nn.Module) -> bool:
    return all(t.is_meta for t in [*model.parameters(), *model.buffers()])


def test_shell_holds_no_storage_before_materialize_and_after_release(sharded_tied):
    shell = build_shell(sharded_tied)
    assert _all_meta(shell) and storage_bytes(shell) == 0
    source = LazyCheckpoint(sharded_tied)
    layer = materialize(shell, "model.layers.1", source)
    names = source.names_under("model.layers.1")
    stored = sum(source.info(n).end - source.info(n).begin for n in names)
    assert storage_bytes(shell) == storage_bytes(layer) == stored > 0
    assert all(not t.is_meta for t in layer.parameters())
    release(shell, "model.layers.1")
    assert _all_meta(shell) and storage_bytes(shell) == 0

    # tied: lm_head alone gives the embedding its tensor too; releasing lm_head keeps it there
    materialize(shell, "lm_head", source)
    assert shell.lm_head.weight is shell.model.embed_tokens.weight
    embed = source.info("model.embed_tokens.weight")
    assert storage_bytes(shell) == embed.end - embed.begin
    release(shell, "lm_head")
    assert shell.lm_head.weight.is_meta and not shell.model.embed_tokens.weight.is_meta
    materialize(shell, "lm_head", source)  # shares what the embedding holds, reads nothing
    assert shell.lm_head.weight is shell.model.embed_tokens.weight
    release(shell, "")
    assert _all_meta(shell) and storage_bytes(shell) == 0


def test_tied_sources_name_the_shared_parameter(sharded_tied):
    assert tied_sources(build_shell(sharded_tied)) == {
        "lm_head.weight": "model.embed_tokens.weight"
    }
    assert tied_sources(build_shell(TINY_LLAMA_DIR)) == {}


def _recording_preadv(monkeypatch) -> list[tuple[str, int, int]]:
    calls: list[tuple[str, int, int]] = []
    real = os.preadv

    def preadv(fd, buffers, offset, *args):
        got = real(fd, buffers, offset, *args)
        calls.append((os.path.realpath(f"/proc/self/fd/{fd}"), offset, offset + got))
        return got

    monkeypatch.setattr(os, "preadv", preadv)
    return calls


def _merge(spans: list[tuple[str, int, int]]) -> list[tuple[str, int, int]]:
    merged: list[tuple[str, int, int]] = []
    for file, begin, end in sorted(spans):
        if merged and merged[-1][0] == file and merged[-1][2] >= begin:
            merged[-1] = (file, merged[-1][1], max(end, merged[-1][2]))
        else:
            merged.append((file, begin, end))
    return merged


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="needs /proc/self/fd")
def test_read_of_one_layer_touches_only_its_byte_ranges(sharded_tied, monkeypatch):
    source = LazyCheckpoint(sharded_tied)
    names = source.names_under("model.layers.1")
    assert names and {source.info(n).file for n in names}  # at least one shard
    calls = _recording_preadv(monkeypatch)
    read = source.read(names)
    expected = [
        (os.path.realpath(sharded_tied / i.file), i.begin, i.end) for i in map(source.info, names)
    ]
    assert _merge(calls) == _merge(expected)
    assert list(read) == names
    for name in names:
        info = source.info(name)
        assert read[name].dtype == info.dtype and tuple(read[name].shape) == info.shape


def test_read_ignores_bytes_outside_the_requested_ranges(sharded_tied, tmp_path):
    damaged = tmp_path / "damaged"
    shutil.copytree(sharded_tied, damaged)
    source = LazyCheckpoint(sharded_tied)
    names = source.names_under("model.layers.2")
    keep: dict[str, list[tuple[int, int]]] = {}
    for info in map(source.info, names):
        keep.setdefault(info.file, []).append((info.begin, info.end))
    data_start = {i.file: min(j.begin for j in source.tensors.values() if j.file == i.file)
                  for i in source.tensors.values()}  # fmt: skip
    for file, start in data_start.items():  # every data byte but layer 2's becomes 0xFF
        raw = bytearray((damaged / file).read_bytes())
        ranges = sorted(keep.get(file, []))
        cursor = start
        for begin, end in [*ranges, (len(raw), len(raw))]:
            raw[cursor:begin] = b"\xff" * (begin - cursor)
            cursor = end
        (damaged / file).write_bytes(bytes(raw))
    broken = LazyCheckpoint(damaged)
    good, got = source.read(names), broken.read(names)
    for name in names:
        assert torch.equal(_bits(good[name]), _bits(got[name])), name
    other = source.names_under("model.layers.0")  # the damage is real elsewhere
    assert any(
        not torch.equal(_bits(a), _bits(b))
        for a, b in zip(source.read(other).values(), broken.read(other).values(), strict=True)
    )


def test_read_casts_and_places_on_request(sharded_tied):
    source = LazyCheckpoint(sharded_tied)
    name = "model.norm.weight"
    stored = source.read([name])[name]
    cast = source.read((name,), device="cpu", dtype=torch.float32)[name]
    assert stored.dtype == torch.bfloat16 and cast.dtype == torch.float32
    assert torch.equal(cast, stored.float())


def test_names_under_takes_whole_module_names(sharded_tied):
    source = LazyCheckpoint(sharded_tied)
    everything = source.names_under("")
    assert everything == list(source.tensors)
    assert source.names_under("model.layers.1") == [
        n for n in everything if n.startswith("model.layers.1.")
    ]
    assert source.names_under("model.layers.") == []  # a prefix is a module name, not text
    assert source.names_under("lm_head") == []  # tied: not stored


def test_missing_tensor_is_named_with_the_directory(sharded_tied, tmp_path):
    source = LazyCheckpoint(sharded_tied)
    with pytest.raises(CheckpointError, match=r"holds no tensor 'model\.nope'") as info:
        source.read(["model.nope"])
    assert str(sharded_tied) in str(info.value)
    # a directory that lacks one layer tensor: the shell asks for it at materialize time
    state = source.read(source.names_under(""))
    del state["model.layers.0.mlp.up_proj.weight"]
    shutil.copy(sharded_tied / "config.json", tmp_path / "config.json")
    save_file(state, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    shell = build_shell(tmp_path)
    lacking = LazyCheckpoint(tmp_path)
    materialize(shell, "model.layers.1", lacking)
    with pytest.raises(CheckpointError, match=r"'model\.layers\.0\.mlp\.up_proj\.weight'") as err:
        materialize(shell, "model.layers.0", lacking)
    assert str(tmp_path) in str(err.value)


def test_shape_or_dtype_other_than_the_shell_is_refused(sharded_tied):
    source = LazyCheckpoint(sharded_tied)
    shell = build_shell(sharded_tied)
    norm = shell.model.layers[0].input_layernorm
    norm.weight = torch.nn.Parameter(torch.empty(65, device="meta", dtype=torch.bfloat16))
    with pytest.raises(CheckpointError, match=r"input_layernorm\.weight.*\(64,\).*\(65,\)"):
        materialize(shell, "model.layers.0", source)
    norm.weight = torch.nn.Parameter(
        torch.empty(64, device="meta", dtype=torch.int32), requires_grad=False
    )
    with pytest.raises(CheckpointError, match=r"input_layernorm\.weight.*bfloat16.*int32"):
        materialize(shell, "model.layers.0", source)


def test_bad_prefix_is_named(sharded_tied):
    source = LazyCheckpoint(sharded_tied)
    shell = build_shell(sharded_tied)
    with pytest.raises(ValueError, match=r"no submodule 'model\.layers\.9'"):
        materialize(shell, "model.layers.9", source)
    with pytest.raises(ValueError, match=r"release: the model has no submodule 'nope'"):
        release(shell, "nope")


def test_bad_arguments_are_named(sharded_tied, production_checks):
    source = LazyCheckpoint(sharded_tied)
    shell = build_shell(sharded_tied)
    with pytest.raises(TypeError, match="prefix must be a str"):
        materialize(shell, 3, source)
    with pytest.raises(TypeError, match="dtype must be a torch.dtype"):
        materialize(shell, "model.norm", source, dtype="bfloat16")
    with pytest.raises(TypeError, match="names must be a list"):
        source.read("model.norm.weight")
    with pytest.raises(TypeError, match="dtype"):
        source.read(["model.norm.weight"], dtype="bfloat16")


def test_a_shard_changed_after_opening_is_refused(sharded_tied, tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(sharded_tied, copy)
    source = LazyCheckpoint(copy)
    name = "model.norm.weight"
    with open(copy / source.info(name).file, "ab") as fh:
        fh.write(b"\0" * 8)
    with pytest.raises(CheckpointError, match="changed since"):
        source.read([name])


def test_a_directory_without_config_is_refused(tmp_path):
    with pytest.raises(CheckpointError, match="config.json"):
        build_shell(tmp_path)


_MEASURE = textwrap.dedent(
    """
    import json, sys
    import torch, transformers
    from transformers.models.llama import modeling_llama  # noqa: F401
    from floatxq.interop.lazy_source import LazyCheckpoint, build_shell, materialize, release

    def status(key):
        for line in open("/proc/self/status"):
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024

    path, keep = sys.argv[1], sys.argv[2] == "keep"
    baseline = status("VmHWM")
    source = LazyCheckpoint(path)
    shell = build_shell(path)
    for prefix in ("model.embed_tokens", "lm_head", "model.norm", "model.rotary_emb"):
        materialize(shell, prefix, source)
    total = 0.0
    for i in range(shell.config.num_hidden_layers):
        layer = materialize(shell, f"model.layers.{i}", source)
        total += float(layer.mlp.down_proj.weight.float().sum())  # the weights are used
        if not keep:
            release(shell, f"model.layers.{i}")
    print(json.dumps({"baseline": baseline, "peak": status("VmHWM"), "sum": total}))
    """
)


@pytest.fixture(scope="module")
def big_llama(tmp_path_factory) -> Path:
    """A ~330 MB bf16 Llama checkpoint: 32 MB embeddings, 32 MB lm_head, 8 layers of 32 MB."""
    config = transformers.LlamaConfig(
        vocab_size=16384, hidden_size=1024, intermediate_size=4096, num_hidden_layers=8,
        num_attention_heads=16, num_key_value_heads=16, tie_word_embeddings=False,
        dtype="bfloat16",
    )  # fmt: skip
    path = tmp_path_factory.mktemp("big")
    write_random_llama(path, config, max_shard_size="100MB")
    return path


def _peak(path: Path, mode: str) -> dict[str, int]:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run(
        [sys.executable, "-c", _MEASURE, str(path), mode],
        capture_output=True, text=True, env=env, check=False, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/status").is_file(), reason="reads /proc/self/status")
def test_layer_by_layer_peak_memory_is_two_layers_not_the_model(big_llama):
    source = LazyCheckpoint(big_llama)
    size = {n: i.end - i.begin for n, i in source.tensors.items()}
    embed, head = size["model.embed_tokens.weight"], size["lm_head.weight"]
    layer = sum(size[n] for n in source.names_under("model.layers.0"))
    assert sum(size.values()) > 300e6
    slack = 100 * 2**20
    measured = _peak(big_llama, "release")
    budget = measured["baseline"] + embed + head + 2 * layer + slack
    assert measured["peak"] < budget, (measured, budget)
    kept = _peak(big_llama, "keep")  # holding every layer breaks the same budget: it can fail
    assert kept["peak"] >= kept["baseline"] + embed + head + 2 * layer + slack, kept
    assert kept["sum"] == measured["sum"]


def test_whole_model_at_once_shares_the_tie_and_reads_each_tensor_once(sharded_tied, monkeypatch):
    reference = _load_plain(sharded_tied, device=None, dtype=None)
    shell, source = build_shell(sharded_tied), LazyCheckpoint(sharded_tied)
    calls = _recording_preadv(monkeypatch) if Path("/proc/self/fd").is_dir() else None
    materialize(shell, "", source)
    assert shell.lm_head.weight is shell.model.embed_tokens.weight
    stored = sum(i.end - i.begin for i in source.tensors.values())
    buffers = sum(b.numel() * b.element_size() for b in shell.buffers())
    assert storage_bytes(shell) == stored + buffers
    if calls is not None:
        assert sum(end - begin for _, begin, end in calls) == stored
    for name, tensor in reference.state_dict().items():
        assert torch.equal(_bits(shell.state_dict()[name]), _bits(tensor)), name
