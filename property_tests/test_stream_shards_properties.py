"""``plan_shards`` lays a shard out exactly as ``safetensors.torch.save_file`` does.

For random tensor sets (every dtype safetensors stores, empty tensors, 0-d scalars, names with
quotes, backslashes, control characters and non-ASCII text), the planned header bytes are the
first bytes of ``save_file``'s file, the planned length is its length, and each planned slot
holds that tensor's bytes. Written in a random order by ``ShardWriter``, split by a random
shard limit, the files are ``write_checkpoint``'s.
"""

import random
import tempfile
from pathlib import Path

import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st
from safetensors.torch import save_file

from floatxq.interop.checkpoint import INDEX_FILE, write_checkpoint
from floatxq.interop.stream_shards import (
    SAFETENSORS_DTYPES,
    ShardWriter,
    checkpoint_entries,
    plan_shards,
)

F4 = getattr(torch, "float4_e2m1fn_x2", None)
DTYPES = sorted(SAFETENSORS_DTYPES, key=str)
NAMES = st.one_of(
    st.text(st.characters(exclude_categories=("Cs",)), max_size=12),
    st.text(st.sampled_from('a.\\"\n\t\x00\x1f\x7fé€😀_'), min_size=20, max_size=120),
).filter(lambda name: name != "__metadata__")


@st.composite
def tensor_specs(draw) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
    names = draw(st.lists(NAMES, max_size=10, unique=True))
    specs = []
    for name in names:
        dtype = draw(st.sampled_from(DTYPES))
        shape = tuple(draw(st.lists(st.integers(0, 4), min_size=dtype == F4, max_size=3)))
        specs.append((name, dtype, shape))
    return specs


def _tensors(specs, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, dtype, shape in specs:
        count = 1
        for d in shape:
            count *= d
        raw = torch.randint(0, 256, (count * dtype.itemsize,), dtype=torch.uint8, generator=g)
        if dtype == torch.bool:
            raw = raw & 1
        out[name] = raw.view(dtype).reshape(shape)
    return out


def _bytes(tensor: torch.Tensor) -> bytes:
    return tensor.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


PINNED = [
    ("", torch.float32, ()),
    ('q"\\\n\x01\x7fé😀', torch.bfloat16, (2, 0)),
    ("z", torch.bool, (3,)),
    ("a" * 150, torch.float8_e4m3fn, (4, 3)),
    ("m", torch.int64, ()),
    ("k", torch.float8_e5m2, (0,)),
    ("b", torch.uint8, (1, 1, 1)),
]


@settings(max_examples=max(10, settings.default.max_examples))
@given(specs=tensor_specs(), seed=st.integers(0, 2**16))
@example(specs=PINNED, seed=0)
@example(specs=[], seed=0)
@example(specs=[(f"t{i}", d, (2,)) for i, d in enumerate(DTYPES)], seed=1)
def test_plan_is_save_files_layout(specs, seed):
    tensors = _tensors(specs, seed)
    plan = plan_shards(specs, 1 << 40)
    (shard,) = plan.shards
    with tempfile.TemporaryDirectory() as tmp:
        file = Path(tmp) / "ref.safetensors"
        save_file(tensors, str(file), metadata={"format": "pt"})
        data = file.read_bytes()
    assert data[: len(shard.header)] == shard.header
    assert len(data) == shard.size
    assert {slot.name for slot in shard.slots} == set(tensors)
    for slot in shard.slots:
        assert data[slot.start : slot.end] == _bytes(tensors[slot.name])


@settings(max_examples=max(10, settings.default.max_examples // 2))
@given(
    specs=tensor_specs(),
    seed=st.integers(0, 2**16),
    max_bytes=st.integers(1, 200),
    order=st.randoms(use_true_random=False),
)
@example(specs=PINNED, seed=0, max_bytes=8, order=random.Random(0))
def test_streamed_files_are_write_checkpoints(specs, seed, max_bytes, order):
    tensors = _tensors(specs, seed)
    plan = plan_shards(checkpoint_entries(tensors), max_bytes)
    names = list(plan.where)
    order.shuffle(names)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        writer = ShardWriter(root / "out", plan)
        for i, name in enumerate(names):
            writer.write(name, tensors[name])
            if i % 3 == 2:
                writer.flush()
        writer.finish()
        ref = write_checkpoint(root / "ref", tensors, config={}, max_shard_bytes=max_bytes)
        expected = {f.name: f.read_bytes() for f in ref.iterdir() if f.name != "config.json"}
        got = {f.name: f.read_bytes() for f in (root / "out").iterdir()}
    assert got == expected
    assert (INDEX_FILE in got) == (len(plan.shards) > 1)
