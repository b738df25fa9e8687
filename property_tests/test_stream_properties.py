"""Properties of the Llama W4A stream's naming and of the replay's rounding.

Boundaries: for any layer count and any set of selected layers, five boundaries per selected
layer in execution order, a layer input named only after an unselected layer (or at layer 0),
every key distinct; the NVFP4 producers are exactly the keyed boundaries of NVFP4 lanes. The
replay operand: for any finite activation of any float dtype, the FP32 value the replay rounds to
is the FP32 decode of the carrier the runtime packs.
"""

import torch
from hypothesis import example, given
from hypothesis import strategies as st

from floatxq.lifecycle.replay import round_w4a_replay_operand
from floatxq.lifecycle.stream import (
    llama_stream_boundaries,
    stream_lane,
    stream_producer_keys,
    w4a_stream_policy,
)
from floatxq.testing.strategies import FLOAT_DTYPES, spread_matrices
from floatxq.w4a.activation import pack_activation

ORDER = [
    ("layer", "input"),
    ("self_attn", "output"),
    ("layer", "attention_residual"),
    ("mlp", "product"),
    ("layer", "output"),
]


@st.composite
def layer_sets(draw) -> tuple[int, list[int]]:
    depth = draw(st.integers(1, 12))
    selected = draw(st.lists(st.integers(0, depth - 1), min_size=1, unique=True))
    return depth, selected


@given(layer_sets())
@example((1, [0]))
@example((5, [4, 0, 2, 3]))
def test_boundaries_follow_the_selected_layers(case):
    depth, selected = case
    got = llama_stream_boundaries(depth, selected)
    chosen = sorted(selected)
    assert [b.layer for b in got] == [i for i in chosen for _ in ORDER]
    assert [(b.owner, b.name) for b in got] == ORDER * len(chosen)
    inputs = {b.layer: b.key for b in got if b.name == "input"}
    for i in chosen:
        first = i == 0 or i - 1 not in selected
        assert (inputs[i] is not None) == first
    keys = [b.key for b in got if b.key is not None]
    assert (
        len(keys) == len(set(keys)) == 4 * len(chosen) + sum(k is not None for k in inputs.values())
    )
    assert all(k.startswith(f"model.layers.{b.layer}.") for b in got if (k := b.key) is not None)


@given(layer_sets(), st.data())
def test_producers_are_the_keyed_boundaries_of_nvfp4_lanes(case, data):
    depth, selected = case
    promoted = data.draw(st.lists(st.integers(0, depth - 1), unique=True))
    attention = data.draw(st.sampled_from(["w4afp8", "w4a_nvfp4"]))
    policy = w4a_stream_policy("w4a_nvfp4", attention_mode=attention, mlp_fp8_layers=promoted)
    keys = stream_producer_keys(policy, depth, selected)
    boundaries = llama_stream_boundaries(depth, selected)
    assert keys == tuple(
        b.key for b in boundaries
        if b.key is not None and stream_lane(policy, b.layer, b.group).mode == "w4a_nvfp4"
    )  # fmt: skip
    for i in promoted:
        assert not any(k.startswith(f"model.layers.{i}.mlp.") for k in keys)
        assert f"model.layers.{i}.post_attention_residual" not in keys
    if attention == "w4afp8":
        assert all(k.endswith(("post_attention_residual", "down_proj.input")) for k in keys)


@st.composite
def activations(draw) -> torch.Tensor:
    """``(rows, 128·n)`` of a drawn float dtype: rows of very different magnitudes."""
    dtype = draw(st.sampled_from(FLOAT_DTYPES))
    spread = 8 if dtype == torch.float16 else 30
    x = draw(spread_matrices(block=(1, 128), max_blocks=(3, 2), spread=spread, dtype=dtype))
    return x


@given(
    activations(),
    st.sampled_from([None, "nvidia", "four_six", "least_squares", "least_squares_grid"]),
)
@example(torch.zeros(2, 128), "least_squares")
@example(torch.full((1, 128), 65504.0, dtype=torch.float16), "nvidia")
def test_the_replay_operand_is_the_runtime_carriers_fp32_decode(x, recipe):
    mode = "w4afp8" if recipe is None else "w4a_nvfp4"
    got = round_w4a_replay_operand(x, mode, recipe=recipe)
    assert got.dtype == torch.float32
    assert torch.equal(got, pack_activation(x, mode, recipe=recipe).decode(torch.float32))
