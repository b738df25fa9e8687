"""The replay's rounding memo: each site rounded once per batch while its bits are unchanged."""

import pytest
import torch

import floatxq.lifecycle.replay as replay
from floatxq.lifecycle.replay import RoundingMemo, round_w4a_replay_operand
from floatxq.lifecycle.stream import StreamLane
from tests.test_replay import DEPTH, _gptq

NVFP4 = StreamLane("w4a_nvfp4", "least_squares")


def _pack(memo, x, *, site="o_proj", lane=NVFP4, scale=None):
    return memo.operand(
        x, lane, site=site, global_scale=scale, reference=None, model_dtype=torch.bfloat16
    )


def _x(seed=0):
    return torch.randn(6, 128, generator=torch.Generator().manual_seed(seed))


def test_the_same_bits_reuse_the_rounding():
    memo = RoundingMemo()
    x = _x()
    first = _pack(memo, x).rounded()
    again = _pack(memo, x.clone())  # equal bits, another tensor
    assert again._base is first  # no second search
    assert torch.equal(again.rounded(), round_w4a_replay_operand(x, "w4a_nvfp4"))


@pytest.mark.parametrize("change", ["value", "signed_zero", "scale", "batch", "site", "lane"])
def test_other_bits_round_afresh(change):
    memo = RoundingMemo()
    x = _x()
    x[0, :16] = 0.0
    first = _pack(memo, x, scale=torch.tensor(0.01)).rounded()
    y, scale, site, lane = x.clone(), torch.tensor(0.01), "o_proj", NVFP4
    if change == "value":
        y[3, 7] = torch.nextafter(y[3, 7], torch.tensor(9.0))
    elif change == "signed_zero":
        y[0, :16] = -0.0  # equal values, other bits: the decoded zeros keep the input's sign
    elif change == "scale":
        scale = torch.tensor(0.02)
    elif change == "batch":
        memo.batch = 1
    elif change == "site":
        site = "down_proj"
    else:
        lane = StreamLane("w4a_nvfp4", "nvidia")
    op = _pack(memo, y, scale=scale, site=site, lane=lane)
    assert op._base is None  # rounded afresh, when read
    expected = round_w4a_replay_operand(y, "w4a_nvfp4", recipe=lane.recipe, global_scale=scale)
    assert torch.equal(op.rounded().view(torch.int32), expected.view(torch.int32))
    if change == "signed_zero":
        assert not torch.equal(op.rounded().view(torch.int32), first.view(torch.int32))


def test_an_unread_operand_is_not_reused():
    memo = RoundingMemo()
    x = _x()
    _pack(memo, x)  # never rounded
    assert _pack(memo, x)._base is None


@pytest.mark.parametrize(
    "activation",
    [
        {"mode": "w4a_nvfp4", "recipe": "least_squares"},
        {"mode": "w4a_nvfp4", "recipe": "nvidia_headroom"},
        {"mode": "w4a_nvfp4", "attention": {"mode": "w4afp8"}},
    ],
)
def test_gptq_solves_the_same_bits_with_and_without_the_memo(activation, monkeypatch):
    with_memo, report = _gptq(activation)

    def fresh(self, value, lane, *, site, global_scale, reference, model_dtype):
        return replay.ReplayOperand(
            value, lane, global_scale=global_scale, reference=reference, model_dtype=model_dtype
        )

    monkeypatch.setattr(RoundingMemo, "operand", fresh)  # a memo that never reuses
    without, plain = _gptq(activation)
    assert dict(report.activation_scales) == dict(plain.activation_scales)
    state, other = with_memo.state_dict(), without.state_dict()
    assert sorted(state) == sorted(other) and len(report.modules) == 7 * DEPTH
    for name, tensor in state.items():
        assert torch.equal(tensor, other[name]), name
