"""``GPTQLinear``: decode-per-call forward, buffers as bytes, checked state-dict loads."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import floatxq as fq
from floatxq.gptq.solve import GPTQSolveOptions, gptq_solve, rtn_quantize
from floatxq.nn.gptq_linear import GPTQLinear
from floatxq.testing import assert_bitwise_equal, unchecked

BITS = (2, 4, 8)
FORMATS = ("gptq", "gptq_v2")
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
KEYS = ("qweight", "qzeros", "scales", "g_idx")


def _weight(out: int = 32, k: int = 64, seed: int = 0) -> torch.Tensor:
    return torch.randn(out, k, generator=torch.Generator().manual_seed(seed))


def _hessian(k: int = 64, seed: int = 1) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(256, k, generator=gen) * torch.linspace(0.1, 3.0, k)  # uneven diag(H)
    return (x.T @ x / 256).float()


def _layer(bits=4, group_size=16, format="gptq", bias=True, out=32, k=64) -> GPTQLinear:
    sol = rtn_quantize(_weight(out, k), GPTQSolveOptions(bits=bits, group_size=group_size))
    b = torch.randn(out, generator=torch.Generator().manual_seed(5)).half() if bias else None
    return GPTQLinear.from_solution(sol, bits=bits, group_size=group_size, bias=b, format=format)


def _x(*shape: int, dtype=torch.float32) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(9)).to(dtype)


def _state(layer: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in layer.state_dict().items()}


# ------------------------------------------------------------------------------------------------
# Forward
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("format", FORMATS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_forward_is_f_linear_with_the_decoded_weight(bits, format, dtype):
    layer = _layer(bits=bits, format=format)
    x = _x(5, 64, dtype=dtype)
    w = fq.dequantize_gptq(layer.packed(), bits=bits, format=format, dtype=dtype)
    y = layer(x)
    assert y.dtype == dtype
    assert_bitwise_equal(y, F.linear(x, w, layer.bias.to(dtype)))
    assert layer.last_route == "dequant_matmul"


@pytest.mark.parametrize("bits", BITS)
def test_decoded_weight_is_the_solution_with_float16_scales(bits):
    sol = gptq_solve(_weight(), _hessian(), GPTQSolveOptions(bits=bits, group_size=16))
    layer = GPTQLinear.from_solution(sol, bits=bits, group_size=16)
    g = sol.g_idx.long()
    scales16 = sol.scales.half().double()[:, g]  # (out, in)
    expected = scales16 * (sol.codes.double() - sol.zeros.double()[:, g])
    assert torch.equal(layer.dequantize_weight().double(), expected)
    assert torch.equal(layer.unpacked().codes, sol.codes.T)
    assert torch.equal(layer.unpacked().zeros, sol.zeros.T)


@pytest.mark.parametrize("format", FORMATS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_desc_act_solution_with_scattered_groups(format, dtype):
    options = GPTQSolveOptions(bits=4, group_size=16, desc_act=True, act_group_aware=False)
    sol = gptq_solve(_weight(), _hessian(), options)
    g_idx = sol.g_idx.tolist()
    assert g_idx != sorted(g_idx)  # groups are not contiguous in the input rows
    layer = GPTQLinear.from_solution(sol, bits=4, group_size=16, format=format)
    assert layer.g_idx.tolist() == g_idx
    x = _x(3, 7, 64, dtype=dtype)
    w = fq.dequantize_gptq(layer.packed(), bits=4, format=format, dtype=dtype)
    assert_bitwise_equal(layer(x), F.linear(x, w))
    # the decoded weight is the solver's own dequantized weight (its scales are float16-exact
    # here or not: compare with the float16-rounded scales)
    g = sol.g_idx.long()
    expected = sol.scales.half().double()[:, g] * (sol.codes.double() - sol.zeros.double()[:, g])
    assert torch.equal(layer.dequantize_weight().double(), expected)


@pytest.mark.parametrize("shape", [(0, 64), (2, 0, 64), (3, 64), (2, 3, 64), (1, 1, 1, 64), (64,)])
def test_batch_shapes_ragged_and_empty(shape):
    layer = _layer()
    x = _x(*shape)
    y = layer(x)
    assert y.shape == (*shape[:-1], 32)
    rows = x.reshape(-1, 64)
    w = layer.dequantize_weight()
    assert_bitwise_equal(y.reshape(-1, 32), F.linear(rows, w, layer.bias.float()))


def test_no_dense_weight_is_kept():
    layer = _layer()
    layer(_x(4, 64))
    assert not hasattr(layer, "weight")
    assert list(layer.parameters()) == []
    assert sorted(n for n, _ in layer.named_buffers()) == sorted([*KEYS, "bias"])
    dense = [v for v in vars(layer).values() if isinstance(v, torch.Tensor)]
    assert dense == []


def test_forward_refuses_wrong_inputs():
    layer = _layer()
    assert layer.last_route == "none"
    forward = unchecked(GPTQLinear.forward)  # past the test run's annotation check
    with pytest.raises(TypeError, match="x must be a floating tensor"):
        forward(layer, torch.ones(2, 64, dtype=torch.int32))
    with pytest.raises(ValueError, match=r"\(\*, 64\)"):
        forward(layer, _x(2, 63))
    with pytest.raises(ValueError, match=r"\(\*, 64\)"):
        forward(layer, torch.tensor(1.0))


def test_bias_free_layer_and_extra_repr():
    layer = _layer(bits=8, group_size=-1, format="gptq_v2", bias=False)
    assert layer.bias is None and layer.groups == 1 and layer.scales.shape == (1, 32)
    x = _x(2, 64)
    assert_bitwise_equal(layer(x), F.linear(x, layer.dequantize_weight()))
    text = repr(layer)
    for part in ("bits=8", "group_size=-1", "format=gptq_v2", "in_features=64"):
        assert part in text


# ------------------------------------------------------------------------------------------------
# Construction
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("bits", "per"), [(2, 16), (4, 8), (8, 4)])
def test_constructor_shapes(bits, per):
    layer = GPTQLinear(96, 48, bits=bits, group_size=32, bias=True)
    assert layer.qweight.shape == (96 // per, 48) and layer.qweight.dtype == torch.int32
    assert layer.qzeros.shape == (3, 48 // per) and layer.qzeros.dtype == torch.int32
    assert layer.scales.shape == (3, 48) and layer.scales.dtype == torch.float16
    assert layer.g_idx.tolist() == [k // 32 for k in range(96)]
    assert layer.bias.shape == (48,) and layer.bias.dtype == torch.float16
    ragged = GPTQLinear(80, 16, bits=bits, group_size=32)  # ceil(80 / 32) = 3 groups
    assert ragged.scales.shape[0] == 3 and ragged.g_idx.max().item() == 2


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        (dict(bits=3), ValueError, "2, 4 or 8"),
        (dict(bits=6), ValueError, "2, 4 or 8"),
        (dict(bits=2, in_features=8), ValueError, "multiples of 16.*never pads"),
        (dict(bits=8, out_features=6), ValueError, "multiples of 4"),
        (dict(group_size=0), ValueError, "group_size"),
        (dict(group_size=-2), ValueError, "group_size"),
        (dict(format="awq"), ValueError, "accepted: 'gptq'"),
        (dict(in_features=-8), ValueError, "in_features must be >= 0"),
        (dict(scales_dtype=torch.int32), TypeError, "scales_dtype"),
    ],
)
def test_constructor_refusals(kwargs, error, match):
    args = {"in_features": 64, "out_features": 32, **kwargs}
    with pytest.raises(error, match=match):
        GPTQLinear(args.pop("in_features"), args.pop("out_features"), **args)


def test_from_packed_keeps_the_bytes():
    codes = torch.randint(0, 16, (64, 32), generator=torch.Generator().manual_seed(2))
    g_idx = (torch.arange(64) // 16).int()
    packed = fq.pack_gptq(codes, torch.full((4, 32), 8), torch.rand(4, 32) + 0.1, g_idx)
    packed = packed._replace(scales=packed.scales.bfloat16())  # a checkpoint's bf16 scales
    bias = torch.randn(32, dtype=torch.float32)
    layer = GPTQLinear.from_packed(packed, bits=4, group_size=16, format="gptq", bias=bias)
    for name, tensor in zip(KEYS, packed, strict=True):
        held = getattr(layer, name)
        assert held.data_ptr() == tensor.data_ptr() and held.dtype == tensor.dtype, name
    assert layer.bias.dtype == torch.float32 and torch.equal(layer.bias, bias)
    assert (layer.in_features, layer.out_features, layer.groups) == (64, 32, 4)


def test_from_packed_and_from_solution_refusals():
    layer = _layer(bits=4, group_size=16)
    packed = layer.packed()
    with pytest.raises(ValueError, match="group_size=32 gives 2"):
        GPTQLinear.from_packed(packed, bits=4, group_size=32, format="gptq")
    with pytest.raises(ValueError, match="packed"):
        GPTQLinear.from_packed(packed, bits=8, group_size=16, format="gptq")
    with pytest.raises(ValueError, match="g_idx must lie"):
        GPTQLinear.from_packed(
            packed._replace(g_idx=packed.g_idx + 4), bits=4, group_size=16, format="gptq"
        )
    with pytest.raises(ValueError, match="bias must have shape"):
        GPTQLinear.from_packed(packed, bits=4, group_size=16, format="gptq", bias=torch.ones(3))
    sol = rtn_quantize(_weight(), GPTQSolveOptions(bits=4, group_size=16))
    with pytest.raises(ValueError, match="group_size=-1 gives 1"):
        GPTQLinear.from_solution(sol, bits=4, group_size=-1)
    with pytest.raises(ValueError, match=r"codes must lie in \[0, 3\]"):
        GPTQLinear.from_solution(sol, bits=2, group_size=16)
    with pytest.raises(ValueError, match="2, 4 or 8"):
        GPTQLinear.from_solution(sol, bits=3, group_size=16)


# ------------------------------------------------------------------------------------------------
# Buffers as bytes
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "cast",
    [
        lambda m: m.half(),
        lambda m: m.bfloat16(),
        lambda m: m.float(),
        lambda m: m.double(),
        lambda m: m.to(torch.bfloat16),
        lambda m: m.to("cpu", torch.float16),
    ],
)
def test_dtype_casts_leave_every_buffer_as_stored(cast):
    layer = _layer(bias=True)
    before = _state(layer)
    model = nn.Sequential(layer)
    cast(model)
    after = layer.state_dict()
    assert after.keys() == before.keys()
    for key, tensor in before.items():
        assert_bitwise_equal(after[key], tensor, msg=key)
    x = _x(2, 64, dtype=torch.bfloat16)
    assert layer(x).dtype == torch.bfloat16


# ------------------------------------------------------------------------------------------------
# State dicts
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("format", FORMATS)
def test_state_dict_round_trip_is_bit_exact(bits, format):
    layer = _layer(bits=bits, format=format)
    state = layer.state_dict()
    assert sorted(state) == sorted([*KEYS, "bias"])
    fresh = GPTQLinear(64, 32, bits=bits, group_size=16, format=format, bias=True)
    fresh.load_state_dict(state)
    for key, tensor in state.items():
        assert_bitwise_equal(fresh.state_dict()[key], tensor, msg=key)
    x = _x(4, 64)
    assert_bitwise_equal(fresh(x), layer(x))


def test_load_adopts_stored_float_dtypes_and_int64_g_idx():
    layer = _layer()
    state = _state(layer)
    state["scales"] = state["scales"].bfloat16()
    state["bias"] = state["bias"].float()
    state["g_idx"] = state["g_idx"].long()
    fresh = GPTQLinear(64, 32, group_size=16, bias=True)  # float16 scales and bias
    fresh.load_state_dict(state)
    assert_bitwise_equal(fresh.scales, state["scales"])
    assert_bitwise_equal(fresh.bias, state["bias"])
    assert fresh.g_idx.dtype == torch.int32 and fresh.g_idx.tolist() == state["g_idx"].tolist()


def test_load_with_assign_keeps_the_format():
    layer = _layer()
    state = _state(layer)
    state["g_idx"] = state["g_idx"].long()
    fresh = GPTQLinear(64, 32, group_size=16, bias=True, device="meta")
    fresh.load_state_dict(state, assign=True)
    assert fresh.g_idx.dtype == torch.int32
    x = _x(2, 64)
    assert_bitwise_equal(fresh(x), layer(x))


def _damaged(name: str, change):
    def build(state):
        state[name] = change(state[name])
        return state

    return build


@pytest.mark.parametrize(
    ("damage", "key", "match"),
    [
        (_damaged("qweight", lambda t: t[:-1]), "qweight", "expected shape"),
        (_damaged("qweight", lambda t: t.float()), "qweight", "int32"),
        (_damaged("qzeros", lambda t: t.long()), "qzeros", "int32"),
        (_damaged("qzeros", lambda t: t[:, :2]), "qzeros", "expected shape"),
        (_damaged("scales", lambda t: t.int()), "scales", "floating"),
        (
            _damaged("scales", lambda t: t.index_fill(1, torch.tensor([3]), torch.nan)),
            "scales",
            "NaN",
        ),
        (_damaged("scales", lambda t: t[:2]), "scales", "expected shape"),
        (_damaged("g_idx", lambda t: t + 4), "g_idx", r"\[0, 3\]"),
        (_damaged("g_idx", lambda t: t - 1), "g_idx", r"\[0, 3\]"),
        (_damaged("g_idx", lambda t: t.float()), "g_idx", "integers"),
        (_damaged("g_idx", lambda t: t[:8]), "g_idx", "expected shape"),
        (_damaged("bias", lambda t: t * torch.inf), "bias", "NaN or infinity"),
        (_damaged("bias", lambda t: t[:4]), "bias", "expected shape"),
    ],
)
def test_damaged_state_dicts_are_refused_and_change_nothing(damage, key, match):
    layer = _layer()
    fresh = GPTQLinear(64, 32, group_size=16, bias=True)
    fresh.load_state_dict(layer.state_dict())
    before = _state(fresh)
    state = _state(layer)
    state["scales"] = state["scales"].bfloat16() if key != "scales" else state["scales"]
    with pytest.raises(ValueError, match=rf"{key}: .*{match}"):
        fresh.load_state_dict(damage(state))
    after = fresh.state_dict()
    for k, tensor in before.items():
        assert_bitwise_equal(after[k], tensor, msg=k)


def test_load_in_a_parent_module_names_the_full_key():
    model = nn.Sequential(GPTQLinear(64, 32, group_size=16))
    state = {f"0.{k}": v for k, v in _layer(bias=False).state_dict().items()}
    state["0.qzeros"] = state["0.qzeros"].long()
    with pytest.raises(ValueError, match=r"0\.qzeros: "):
        model.load_state_dict(state)


def test_missing_and_unexpected_keys_are_reported_as_usual():
    fresh = GPTQLinear(64, 32, group_size=16, bias=False)
    state = _layer(bias=True).state_dict()
    result = fresh.load_state_dict({k: v for k, v in state.items() if k != "g_idx"}, strict=False)
    assert result.missing_keys == ["g_idx"] and result.unexpected_keys == ["bias"]
