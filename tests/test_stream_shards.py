"""Shards written tensor by tensor equal ``write_checkpoint``'s, byte for byte, and survive a crash.

``ShardWriter`` writes a plan's tensors in any order (shuffled here); the finished shard files and
index must be the very bytes ``write_checkpoint`` writes for the same state dict. A writer dropped
without ``finish`` (or SIGKILLed) is resumed by ``reopen`` from its last ``flush``.
"""

import json
import os
import random
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from floatxq.interop.checkpoint import INDEX_FILE, CheckpointError, write_checkpoint
from floatxq.interop.stream_shards import (
    PROGRESS_FILE,
    SAFETENSORS_DTYPES,
    ShardWriter,
    checkpoint_entries,
    plan_shards,
)

REPO = Path(__file__).resolve().parents[1]


def _tiny_llama_state() -> dict[str, torch.Tensor]:
    """A tiny Llama's state dict (tied embeddings, bf16) with FP8 codes and fp32 scales mixed in,
    as a quantized save holds them."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        tie_word_embeddings=True,
    )  # fmt: skip
    model = transformers.LlamaForCausalLM(config).to(torch.bfloat16)
    state = dict(model.state_dict())
    for name in [n for n in state if n.endswith("proj.weight")][::2]:
        state[name] = state[name].float().clamp(-448, 448).to(torch.float8_e4m3fn)
        state[name.replace(".weight", ".weight_scale_inv")] = torch.rand(state[name].shape[0], 1)
    return state


def _random_state(seed: int) -> dict[str, torch.Tensor]:
    """Mixed dtypes and shapes: empty tensors, scalars, odd names, one tensor over the limit."""
    g = torch.Generator().manual_seed(seed)
    dtypes = [torch.bfloat16, torch.float16, torch.float32, torch.int32, torch.uint8,
              torch.float8_e4m3fn, torch.float8_e5m2, torch.bool, torch.int64]  # fmt: skip
    state: dict[str, torch.Tensor] = {}
    for i in range(40):
        dtype = dtypes[i % len(dtypes)]
        shape = [(), (0,), (3, 0), (7,), (5, 9), (2, 3, 4)][
            int(torch.randint(6, (1,), generator=g))
        ]
        raw = torch.randint(0, 256, (*shape, dtype.itemsize), dtype=torch.uint8, generator=g)
        tensor = raw.view(dtype).reshape(shape) if shape else raw.view(dtype)[0]
        if dtype == torch.bool:
            tensor = (raw[..., 0] & 1).bool()
        state[f'm.{i}.{"ä" * (i % 3)}"{"x" * (i % 11)}'] = tensor
    state["huge"] = torch.randn(200, generator=g)  # 800 bytes: alone in its shard
    return state


def _write_shuffled(directory: Path, state: dict[str, torch.Tensor], max_bytes: int, seed: int):
    plan = plan_shards(checkpoint_entries(state), max_bytes)
    writer = ShardWriter(directory, plan)
    names = list(plan.where)
    random.Random(seed).shuffle(names)
    for i, name in enumerate(names):
        writer.write(name, state[name])
        if i % 5 == 4:
            writer.flush()
    writer.finish()
    return plan


def _checkpoint_files(directory: Path) -> dict[str, bytes]:
    """The shard and index files of a directory (write_checkpoint also writes config.json)."""
    return {
        f.name: f.read_bytes()
        for f in sorted(directory.iterdir())
        if f.name.endswith(".safetensors") or f.name == INDEX_FILE
    }


def _reference(tmp_path: Path, state: dict[str, torch.Tensor], max_bytes: int) -> dict[str, bytes]:
    ref = write_checkpoint(tmp_path / "ref", state, config={}, max_shard_bytes=max_bytes)
    return _checkpoint_files(ref)


@pytest.mark.parametrize("max_bytes", [1 << 30, 20_000, 3_000])
def test_tiny_llama_streamed_in_any_order_equals_write_checkpoint(tmp_path, max_bytes):
    state = _tiny_llama_state()
    expected = _reference(tmp_path, state, max_bytes)
    plan = _write_shuffled(tmp_path / "out", state, max_bytes, seed=max_bytes)
    assert "lm_head.weight" not in plan.where  # tied to the embedding: stored once
    assert len(plan.shards) == len(expected) - (len(expected) > 1)
    assert (len(plan.shards) > 1) == (max_bytes < 1 << 30)
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == sorted(expected)
    assert _checkpoint_files(tmp_path / "out") == expected


@pytest.mark.parametrize("max_bytes", [1, 64, 300, 1 << 20])
def test_random_dicts_streamed_equal_write_checkpoint(tmp_path, max_bytes):
    state = _random_state(max_bytes)
    expected = _reference(tmp_path, state, max_bytes)
    _write_shuffled(tmp_path / "out", state, max_bytes, seed=7)
    assert _checkpoint_files(tmp_path / "out") == expected
    assert not (tmp_path / "out" / PROGRESS_FILE).exists()


def test_an_empty_state_dict_is_one_header_only_file(tmp_path):
    expected = _reference(tmp_path, {}, 1 << 20)
    writer = ShardWriter(tmp_path / "out", plan_shards([], 1 << 20))
    writer.finish()
    assert _checkpoint_files(tmp_path / "out") == expected


def test_a_dropped_writer_resumes_from_its_last_flush(tmp_path):
    state = _random_state(3)
    expected = _reference(tmp_path, state, 300)
    plan = plan_shards(checkpoint_entries(state), 300)
    names = list(plan.where)
    random.Random(1).shuffle(names)
    half, unflushed = names[: len(names) // 2], names[len(names) // 2 : len(names) // 2 + 4]
    writer = ShardWriter(tmp_path / "out", plan)
    for name in half:
        writer.write(name, state[name])
    writer.flush()
    for name in unflushed:
        writer.write(name, state[name])
    assert writer.pending == set(unflushed)
    del writer  # the crash: no finish, the last writes never flushed
    for name in unflushed:  # a crash may lose unflushed bytes: garble them
        shard, slot = plan.where[name]
        with open(tmp_path / "out" / plan.shards[shard].file, "r+b") as fh:
            fh.seek(slot.start)
            fh.write(b"\xa5" * (slot.end - slot.start))
    resumed = ShardWriter.reopen(tmp_path / "out", plan)
    assert resumed.done == set(half)
    assert resumed.missing == set(names) - set(half)
    with pytest.raises(ValueError, match="already written"):
        resumed.write(half[0], state[half[0]])
    for name in sorted(resumed.missing):
        resumed.write(name, state[name])
    resumed.finish()
    assert _checkpoint_files(tmp_path / "out") == expected
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == sorted(expected)


_CHILD = """
import os, signal, sys, torch
sys.path.insert(0, {tests!r})
from test_stream_shards import _random_state
from floatxq.interop.stream_shards import ShardWriter, checkpoint_entries, plan_shards
state = _random_state(5)
plan = plan_shards(checkpoint_entries(state), 300)
writer = ShardWriter({out!r}, plan)
for i, name in enumerate(plan.where):
    writer.write(name, state[name])
    if i == 19:
        writer.flush()
    if i == 25:
        os.kill(os.getpid(), signal.SIGKILL)
"""


def test_a_killed_writer_resumes_with_what_it_flushed(tmp_path):
    out = tmp_path / "out"
    code = _CHILD.format(tests=str(REPO / "tests"), out=str(out))
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, timeout=120)
    assert run.returncode == -signal.SIGKILL, run.stderr.decode()
    state = _random_state(5)
    plan = plan_shards(checkpoint_entries(state), 300)
    resumed = ShardWriter.reopen(out, plan)
    assert resumed.done == set(list(plan.where)[:20])
    for name in sorted(resumed.missing):
        resumed.write(name, state[name])
    resumed.finish()
    assert _checkpoint_files(out) == _reference(tmp_path, state, 300)


def test_reopen_refuses_another_plan_naming_the_difference(tmp_path):
    state = _random_state(4)
    entries = checkpoint_entries(state)
    ShardWriter(tmp_path / "out", plan_shards(entries, 300))
    with pytest.raises(ValueError, match="max_shard_bytes: recorded 300, plan 301"):
        ShardWriter.reopen(tmp_path / "out", plan_shards(entries, 301))
    changed = list(entries)
    changed[2] = (changed[2][0], torch.float64, changed[2][2])
    with pytest.raises(ValueError, match="entry 2: recorded .* plan .*F64"):
        ShardWriter.reopen(tmp_path / "out", plan_shards(changed, 300))
    with pytest.raises(ValueError, match="tensor count: recorded 41, plan 42"):
        ShardWriter.reopen(tmp_path / "out", plan_shards([*entries, ("z", torch.int8, (1,))], 300))
    assert ShardWriter.reopen(tmp_path / "out", plan_shards(entries, 300)).done == set()


def test_reopen_refuses_missing_records_and_damaged_shards(tmp_path):
    state = _random_state(6)
    plan = plan_shards(checkpoint_entries(state), 300)
    with pytest.raises(CheckpointError, match="nothing to resume"):
        ShardWriter.reopen(tmp_path / "none", plan)
    writer = ShardWriter(tmp_path / "out", plan)
    record = json.loads((tmp_path / "out" / PROGRESS_FILE).read_text())
    (tmp_path / "out" / PROGRESS_FILE).write_text(json.dumps({**record, "done": [0, 0]}))
    with pytest.raises(CheckpointError, match="'done' must list distinct entry numbers below 41"):
        ShardWriter.reopen(tmp_path / "out", plan)
    (tmp_path / "out" / PROGRESS_FILE).write_text(json.dumps(record))
    shard = tmp_path / "out" / plan.shards[1].file
    shard.write_bytes(shard.read_bytes()[:-1])
    with pytest.raises(CheckpointError, match="is not the planned shard"):
        ShardWriter.reopen(tmp_path / "out", plan)
    (tmp_path / "out" / PROGRESS_FILE).write_text('{"format": "floatxq-stream-shards"}')
    with pytest.raises(CheckpointError, match="not a version-1"):
        ShardWriter.reopen(tmp_path / "out", plan)
    (tmp_path / "out" / PROGRESS_FILE).write_text(
        '{"format": "floatxq-stream-shards", "version": 1, "plan": [], "done": []}'
    )
    with pytest.raises(CheckpointError, match="holds no plan"):
        ShardWriter.reopen(tmp_path / "out", plan)
    del writer
    finished = tmp_path / "finished"
    _write_shuffled(finished, state, 300, seed=0)
    with pytest.raises(CheckpointError, match="finished, or never"):
        ShardWriter.reopen(finished, plan)


def test_write_refuses_what_the_plan_does_not_hold(tmp_path, production_checks):
    plan = plan_shards([("a", torch.float32, (2, 3)), ("b", torch.uint8, ())], 1 << 20)
    writer = ShardWriter(tmp_path / "out", plan)
    with pytest.raises(ValueError, match="'c' is not a tensor of the plan"):
        writer.write("c", torch.zeros(2, 3))
    with pytest.raises(ValueError, match="the plan has torch.float32 \\(2, 3\\)"):
        writer.write("a", torch.zeros(2, 3, dtype=torch.float16))
    with pytest.raises(ValueError, match="the plan has torch.float32 \\(2, 3\\)"):
        writer.write("a", torch.zeros(3, 2))
    with pytest.raises(TypeError, match="must be a tensor"):
        writer.write("a", [[0.0] * 3] * 2)
    writer.write("a", torch.zeros(2, 3).t().contiguous().t())  # a non-contiguous view is fine
    with pytest.raises(ValueError, match="'a' was already written"):
        writer.write("a", torch.zeros(2, 3))
    with pytest.raises(ValueError, match="1 tensors were never written \\(first: \\['b'\\]\\)"):
        writer.finish()
    writer.write("b", torch.tensor(7, dtype=torch.uint8))
    writer.finish()
    with pytest.raises(ValueError, match="finished"):
        writer.write("b", torch.tensor(7, dtype=torch.uint8))
    with pytest.raises(ValueError, match="already finished"):
        writer.finish()
    with pytest.raises(FileExistsError, match="model.safetensors already exists"):
        ShardWriter(tmp_path / "out", plan)


@pytest.mark.parametrize(
    ("entries", "error", "match"),
    [
        ([("a", torch.float32, (1,)), ("a", torch.float32, (1,))], ValueError, "'a' twice"),
        ([("__metadata__", torch.float32, (1,))], ValueError, "metadata key"),
        ([("a", torch.complex128, (1,))], ValueError, "safetensors stores"),
        ([("a", torch.float32, (2, -1))], ValueError, "ints >= 0"),
        ([("a", torch.float32, (2.0,))], ValueError, "ints >= 0"),
        ([("a", torch.float32, 3)], TypeError, "must be a sequence"),
        ([("\ud800", torch.float32, (1,))], ValueError, "not UTF-8"),
        ([(1, torch.float32, (1,))], TypeError, "name must be a str"),
        ([("a", torch.float32)], TypeError, "must be \\(name, dtype, shape\\)"),
    ],
)
def test_plan_shards_refuses_bad_entries(entries, error, match, production_checks):
    with pytest.raises(error, match=match):
        plan_shards(entries, 1 << 20)


@pytest.mark.parametrize("bad", [0, -5, True, 1.5, "4GB"])
def test_plan_shards_refuses_bad_limits(bad, production_checks):
    with pytest.raises(ValueError, match="max_shard_bytes"):
        plan_shards([], bad)


def test_zero_dim_float4_is_refused_as_save_file_refuses_it():
    if torch.float4_e2m1fn_x2 not in SAFETENSORS_DTYPES:
        pytest.skip("this torch has no float4_e2m1fn_x2")
    with pytest.raises(ValueError, match="0-d float4_e2m1fn_x2"):
        plan_shards([("a", torch.float4_e2m1fn_x2, ())], 1 << 20)


def test_checkpoint_entries_drop_ties_as_write_checkpoint_does():
    base = torch.zeros(4, 4)
    state = {"a": base, "b": base, "c": base[1:], "d": torch.zeros(0), "e": torch.zeros(0)}
    assert [e[0] for e in checkpoint_entries(state)] == ["a", "c", "d", "e"]
    with pytest.raises(ValueError, match="meta tensor"):
        checkpoint_entries({"m": torch.empty(2, device="meta")})
