"""Properties of the generic W4A stream's boundary (floatxq/lifecycle/stream/boundary.py).

For any finite activation of any float dtype, any lane and any stored global scale: a consumer
handed the very tensor a producer returned reads a carrier equal to the one
:func:`floatxq.pack_activation` packs for that consumer alone; a second consumer in the same lane
with an equal scale reads that same carrier object (packed once); another lane or another scale
gets its own carrier; a tensor that no producer returned (even an equal copy) is packed anew.
"""

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from floatxq.lifecycle.stream.boundary import _Consumer, _Handoff, _produce
from floatxq.lifecycle.stream.codec import _RuntimeCodec
from floatxq.lifecycle.stream.plan import StreamLane
from floatxq.testing.strategies import FLOAT_DTYPES, spread_matrices
from floatxq.w4a.activation import W4AActivation, pack_activation

# Each draw packs four carriers on the CPU reference route (least_squares searches its block
# scales): a fifth of the profile's examples (10 in ci, hundreds in nightly) keeps it under 1 s.
FIFTH = settings(max_examples=max(10, settings.default.max_examples // 5))
LANES = [
    StreamLane("w4afp8", None),
    StreamLane("w4a_nvfp4", "nvidia"),
    StreamLane("w4a_nvfp4", "least_squares"),
    StreamLane("w4a_nvfp4", "four_six"),
]


@st.composite
def activations(draw) -> torch.Tensor:
    dtype = draw(st.sampled_from(FLOAT_DTYPES))
    spread = 8 if dtype == torch.float16 else 30
    return draw(spread_matrices(block=(1, 128), max_blocks=(3, 2), spread=spread, dtype=dtype))


def _module(scale: float) -> nn.Module:
    module = nn.Module()
    bits = torch.tensor(scale, dtype=torch.float32).view(torch.int32)
    module.register_buffer("activation_global_scale_bits", bits)
    return module


def _same(a: W4AActivation, b: W4AActivation) -> bool:
    header = (a.mode, a.recipe, a.shape, a.model_dtype)
    if header != (b.mode, b.recipe, b.shape, b.model_dtype):
        return False
    return torch.equal(a.decode(torch.float32), b.decode(torch.float32))


@FIFTH
@given(
    activations(),
    st.sampled_from(LANES),
    st.sampled_from(LANES),
    st.sampled_from([0.0, 0.0078125, 0.5]),
    st.sampled_from([0.0, 0.5]),
)
def test_a_producers_tensor_is_packed_once_per_lane_and_scale(x, lane, other_lane, scale, other):
    codec = _RuntimeCodec({})
    handoff = _Handoff()
    output = x.clone()  # what the producer (a norm) returns
    _produce(handoff, nn.Identity(), (x,), output)
    consumer = _Consumer(lane, (handoff,), codec)
    first, second = _module(scale), _module(scale)
    (got,) = consumer(first, (output,))
    g = None if not lane.nvfp4 or scale == 0.0 else scale
    kw = {} if not lane.nvfp4 else dict(recipe=lane.recipe, global_scale=g)
    assert _same(got, pack_activation(x, lane.mode, model_dtype=x.dtype, **kw))
    assert consumer(second, (output,))[0] is got  # an equal scale: the same carrier
    (again,) = _Consumer(other_lane, (handoff,), codec)(_module(other), (output,))
    shared = other_lane == lane and (not lane.nvfp4 or other == scale)
    assert (again is got) == shared
    (copy,) = consumer(first, (output.clone(),))  # not the producer's tensor: packed anew
    assert copy is not got and _same(copy, got)


@FIFTH
@given(activations())
def test_a_dropped_producer_output_releases_its_carriers(x):
    handoff = _Handoff()
    output = x.clone()
    _produce(handoff, nn.Identity(), (x,), output)
    _Consumer(LANES[0], (handoff,), _RuntimeCodec({}))(_module(0.0), (output,))
    assert handoff.holds(output) and len(handoff.carriers) == 1
    del output
    assert handoff.ref is None and handoff.carriers == []


@given(st.sampled_from(LANES), st.sampled_from(LANES), st.integers(1, 4))
def test_a_given_operand_reaches_every_reader_of_its_tensor_and_no_other(lane, other, rows):
    from floatxq.lifecycle.stream.boundary import _receive

    stand_in, operand = torch.zeros(rows, 128), object()
    handoff = _Handoff()
    handoff.give(stand_in, operand)  # the Llama layer's norm operand, made from its residual

    def pack(_x):
        raise AssertionError("a given operand is never packed again")

    assert _receive((handoff,), stand_in, lane, None, pack) is operand
    assert _receive((handoff,), stand_in, other, None, pack) is operand
    assert _receive((handoff,), stand_in.clone(), lane, None, pack) is None  # another tensor
    del stand_in
    assert handoff.ref is None and handoff.carriers == []


@given(st.floats(min_value=1e-30, max_value=1e30, allow_nan=False, allow_infinity=False))
def test_a_producer_scale_round_trips_through_its_layers_state_dict(value):
    from floatxq.lifecycle.stream.codec import NVFP4BoundaryQuantizer, StreamScales

    key = "model.layers.2.self_attn.o_proj.input"
    ours = NVFP4BoundaryQuantizer(key, layer=2, recipe="nvidia")
    ours.set_scale(value)
    fp32 = torch.tensor(value, dtype=torch.float32)
    assert ours.calibrated and ours.scale_bits.view(torch.float32) == fp32
    holder = StreamScales({"o_proj_input": key})
    theirs = NVFP4BoundaryQuantizer(key, layer=2, recipe="nvidia", scales=holder)
    assert not theirs.calibrated and theirs.scale == 0.0  # 0 bits: dynamic
    holder.load_state_dict(ours.scales.state_dict())
    assert theirs.calibrated and torch.equal(theirs.scale_bits, ours.scale_bits)
    theirs.reset()
    assert not theirs.calibrated and int(holder.state_dict()["o_proj_input"]) == 0
