"""``W4ANVFP4Linear``: GPTQ buffers, the stored global scale, staged operands, routes, carriers.

On CPU the module takes the reference route; its outputs are checked bit for bit against the
pure ``w4a.linear`` functions fed the other weight operand (the int32 GPTQ words). The native
route (FP4 tensor cores, SM 12.1+) cannot run here: its gating is checked with the availability
monkeypatched, its staged operand is decoded by hand, and its GEMM loop is run against a stand-in
``F.scaled_mm`` written from the NVFP4 operand format (decode both operands, multiply in
float64). The emulation route is checked on the GPU (``gpu`` marks).
"""

import types

import pytest
import torch
import torch.nn.functional as F

import floatxq.dispatch.w4a as wmod
import floatxq.kernels._triton as _triton
from floatxq.config import BACKEND
from floatxq.gptq.int4 import GPTQPacked, pack_gptq
from floatxq.gptq.solve import GPTQSolveOptions, rtn_quantize
from floatxq.nn.gptq_linear import GPTQLinear
from floatxq.nn.w4a_fp8_linear import W4AFP8Linear
from floatxq.nn.w4a_nvfp4_linear import (
    W4ANVFP4Linear,
    w4a_nvfp4_ineligibility,
    w4a_nvfp4_native_unavailable_reason,
    w4a_nvfp4_route,
    w4a_nvfp4_weight_planes,
)
from floatxq.testing import w4a_nvfp4_linear_error_bound
from floatxq.testing.interpreter import can_interpret, needs_interpreter, run_interpreted_tests
from floatxq.w4a.activation import pack_activation
from floatxq.w4a.linear import (
    w4a_fp8_linear_prepacked,
    w4a_nvfp4_linear,
    w4a_nvfp4_linear_prepacked,
)

K, N = 256, 64
CACHE_ABSENT = "weight cache is absent; call post_init"
BITS_KEY = "activation_global_scale_bits"
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
CPU = torch.device("cpu")


def _gptq(
    seed: int = 0,
    *,
    k: int = K,
    n: int = N,
    bits: int = 4,
    group_size: int = 128,
    sym: bool = True,
    format: str = "gptq",
    bias: bool = False,
) -> GPTQLinear:
    g = torch.Generator().manual_seed(seed)
    weight = torch.randn(n, k, generator=g)
    sol = rtn_quantize(weight, GPTQSolveOptions(bits=bits, group_size=group_size, sym=sym))
    b = torch.randn(n, generator=g).half() if bias else None
    return GPTQLinear.from_solution(sol, bits=bits, group_size=group_size, format=format, bias=b)


def _x(seed: int, *shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 + seed)
    return (torch.randn(*shape, generator=g) * 3).to(dtype)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.element_size() == 1 else t


def _f32_bits(value: float) -> torch.Tensor:
    return torch.tensor(value, dtype=torch.float32).view(torch.int32)


def _hand_codes(k: int = K, n: int = N) -> torch.Tensor:
    """codes[k, n] = (k + 3n) % 16: every code in every column."""
    return (torch.arange(k)[:, None] + 3 * torch.arange(n)[None, :]) % 16


def _hand_packed(k: int = K, n: int = N) -> GPTQPacked:
    zeros = torch.full((k // 128, n), 8)
    scales = torch.full((k // 128, n), 0.25)
    g_idx = (torch.arange(k) // 128).to(torch.int32)
    return pack_gptq(_hand_codes(k, n), zeros, scales, g_idx, format="gptq_v2")


def _decode_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """E2M1 bytes ``(r, c)`` → float64 values ``(r, 2c)`` along the last axis, low nibble first
    (from the format: sign bit 3, magnitude index into 0, .5, 1, 1.5, 2, 3, 4, 6)."""
    u = packed.view(torch.uint8).to(torch.int64)
    nibbles = torch.stack([u & 0xF, u >> 4], dim=-1).reshape(*u.shape[:-1], -1)
    magnitude = torch.tensor(E2M1, dtype=torch.float64)[nibbles & 7]
    return torch.where(nibbles >= 8, -magnitude, magnitude)


def _swizzle_offset(r: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Where block scale ``b`` (0..7) of row ``r`` sits in one group's SWIZZLE_32_4_4 layout."""
    return (r // 128) * 1024 + (b // 4) * 512 + (r % 32) * 16 + ((r % 128) // 32) * 4 + (b % 4)


def _unswizzle(flat: torch.Tensor, rows: int) -> torch.Tensor:
    """One group's swizzled E4M3 scales → float64 ``(rows, 8)``."""
    r, b = torch.arange(rows)[:, None], torch.arange(8)[None, :]
    return flat.to(torch.float64)[_swizzle_offset(r, b)]


# ----------------------------------------------------------------------------------------------
# Buffers, class attributes, constraints
# ----------------------------------------------------------------------------------------------


def test_buffers_are_gptqs_plus_the_scale_bits_and_the_caches_are_not_persistent():
    layer = W4ANVFP4Linear(K, N, bias=True)
    shapes = {name: (t.dtype, tuple(t.shape)) for name, t in layer.state_dict().items()}
    assert shapes == {
        "qweight": (torch.int32, (K // 8, N)),
        "qzeros": (torch.int32, (K // 128, N // 8)),
        "scales": (torch.float16, (K // 128, N)),
        "g_idx": (torch.int32, (K,)),
        "bias": (torch.float16, (N,)),
        BITS_KEY: (torch.int32, ()),
    }
    assert int(layer.activation_global_scale_bits) == 0
    assert layer.activation_global_scale.dtype == torch.float32
    assert float(layer.activation_global_scale) == 0.0
    assert (layer._weight_e4m3, layer._weight_both, layer._unit_weight_scales) == (None,) * 3
    with pytest.raises(RuntimeError, match=CACHE_ABSENT):
        layer(torch.zeros(1, K))
    ready = W4ANVFP4Linear.from_gptq_linear(_gptq(bias=True))
    assert ready._weight_e4m3.dtype == torch.float8_e4m3fn
    assert tuple(ready._weight_e4m3.shape) == (K, N) and ready._weight_e4m3.stride() == (1, K)
    # no FP4 tensor cores on the CPU: the native operands are not staged unless asked for
    assert ready._weight_both is None and ready._unit_weight_scales is None
    assert sorted(ready.state_dict()) == sorted(shapes)
    assert ready.activation_global_scale_bits.device == ready.qweight.device


def test_class_attributes():
    assert (W4ANVFP4Linear.bits, W4ANVFP4Linear.group_size) == (4, 128)
    assert (W4ANVFP4Linear.desc_act, W4ANVFP4Linear.sym) == (False, True)
    assert W4ANVFP4Linear.REQUIRES_FORMAT_V2 is True
    assert W4ANVFP4Linear.backend is BACKEND.GPTQ_W4A_NVFP4
    assert BACKEND("gptq_w4a_nvfp4") is BACKEND.GPTQ_W4A_NVFP4
    assert W4ANVFP4Linear.MIN_COMPUTE_CAPABILITY == (12, 1)


@pytest.mark.parametrize(
    ("args", "kwargs", "match"),
    [
        ((K, N), {"bits": 8}, "bits=8"),
        ((K, N), {"group_size": 64}, "group_size=64"),
        ((K, N), {"desc_act": True}, "desc_act=True"),
        ((K, N), {"sym": False}, "sym=False"),
        ((192, N), {}, "in_features=192"),
        ((K, 48), {}, "out_features=48"),
        ((K, N), {"format": "awq"}, "awq"),
        ((K, N), {"route": "triton"}, "'triton'"),
        ((K, N), {"activation_recipe": "best"}, "activation_recipe: .*'best'"),
    ],
)
def test_every_constraint_is_a_value_error_naming_the_value(args, kwargs, match):
    with pytest.raises(ValueError, match=match):
        W4ANVFP4Linear(*args, **kwargs)


def test_wrong_kinds_are_type_errors_and_settings_are_checked():
    with pytest.raises(TypeError, match="bits"):
        W4ANVFP4Linear(K, N, bits=4.0)
    with pytest.raises(TypeError, match="sym"):
        W4ANVFP4Linear(K, N, sym=1)
    layer = W4ANVFP4Linear.from_gptq_linear(_gptq())
    with pytest.raises(ValueError, match="'fast'"):
        layer.route = "fast"
    with pytest.raises(ValueError, match="activation_recipe"):
        layer.activation_recipe = "nope"
    layer.activation_recipe = "lsq"  # a legacy alias, stored canonical
    assert layer.activation_recipe == "least_squares"
    with pytest.raises(TypeError, match="float64"):
        layer(torch.zeros(1, K, dtype=torch.float64))
    with pytest.raises(TypeError, match="x must be"):
        layer([0.0] * K)
    with pytest.raises(ValueError, match=r"\(\*, 256\)"):
        layer(torch.zeros(2, 128))
    with pytest.raises(ValueError, match="NaN or inf"):
        layer(torch.full((1, K), float("nan")))


# ----------------------------------------------------------------------------------------------
# Staged operands
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("n", [N, 32])
def test_the_staged_planes_decode_back_to_the_centered_weight(n):
    layer = W4ANVFP4Linear.from_packed(_hand_packed(n=n), format="gptq_v2")
    assert layer._weight_both is None
    assert layer.post_init(stage_planes=True) is layer
    both, unit = layer._weight_both, layer._unit_weight_scales
    centered = (_hand_codes(n=n) - 8).to(torch.float64)  # (K, n)
    assert torch.equal(layer._weight_e4m3.to(torch.float64), centered)
    assert both.dtype == torch.float4_e2m1fn_x2
    assert tuple(both.shape) == (K // 2, 2 * n) and both.stride() == (1, K // 2)
    # byte (i, j) holds K rows 2i (low nibble) and 2i + 1 (high nibble) of column j
    values = _decode_nibbles(both.T).T  # (K, 2n)
    low, high = values[:, :n], values[:, n:]
    assert torch.equal(low + 4 * high, centered)
    assert torch.equal(high, torch.floor((centered + 2) / 4))
    assert set(low.unique().tolist()) == {-2.0, -1.0, 0.0, 1.0}
    assert set(high.unique().tolist()) == {-2.0, -1.0, 0.0, 1.0, 2.0}
    # unit scales: E4M3 1.0 (0x38) for each of the 2n rows' 8 blocks, padding rows 0
    padded = -(-2 * n // 128) * 128
    assert unit.dtype == torch.float8_e4m3fn and tuple(unit.shape) == (padded * 8,)
    r, b = torch.arange(padded)[:, None], torch.arange(8)[None, :]
    expected = torch.zeros(padded * 8, dtype=torch.uint8)
    expected[_swizzle_offset(r, b)] = torch.where(r < 2 * n, 0x38, 0).to(torch.uint8)
    assert torch.equal(unit.view(torch.uint8), expected)


def test_weight_planes_by_hand_and_their_refusals():
    # c = -8: low 0, high -2 (E2M1 code 0b1100); c = 7: low -1 (0b1010), high 2 (0b0100)
    c = torch.tensor([[-8], [7]] * 64, dtype=torch.int16)  # (128, 1)
    planes = w4a_nvfp4_weight_planes(c)
    assert planes.both.view(torch.uint8)[:, 0].unique().tolist() == [0xA0]  # low: 0, -1
    assert planes.both.view(torch.uint8)[:, 1].unique().tolist() == [0x4C]  # high: -2, 2
    with pytest.raises(ValueError, match="positive multiple of 128"):
        w4a_nvfp4_weight_planes(torch.zeros(64, 1, dtype=torch.int16))
    with pytest.raises(ValueError, match="-8"):
        w4a_nvfp4_weight_planes(torch.full((128, 1), -9, dtype=torch.int16))
    with pytest.raises(TypeError):
        w4a_nvfp4_weight_planes(torch.zeros(128, 1))


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda: _gptq(bits=8), "bits=8; W4A-NVFP4 takes 4-bit codes"),
        (lambda: _gptq(group_size=64), "group_size=64; W4A-NVFP4"),
        (lambda: _gptq(k=192), "in_features=192"),
        (lambda: _gptq(sym=False), r"asymmetric zero points: group \d+, output column \d+"),
    ],
)
def test_from_gptq_linear_refuses_ineligible_modules_naming_why(make, match):
    module = make()
    assert w4a_nvfp4_ineligibility(module) is not None
    with pytest.raises(ValueError, match=match):
        W4ANVFP4Linear.from_gptq_linear(module)
    with pytest.raises(TypeError, match="GPTQLinear"):
        W4ANVFP4Linear.from_gptq_linear(torch.nn.Linear(K, N))


def test_a_reordered_g_idx_is_refused_at_post_init():
    p = _hand_packed()
    reordered = GPTQPacked(p.qweight, p.qzeros, p.scales, (1 - p.g_idx).contiguous())
    with pytest.raises(ValueError, match=r"g_idx must equal arange\(in\) // 128"):
        W4ANVFP4Linear.from_packed(reordered, format="gptq_v2")


# ----------------------------------------------------------------------------------------------
# Forward on CPU: the reference route
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_forward_equals_the_pure_reference_on_the_words_bitwise(dtype):
    source = _gptq(1, bias=True)
    layer = W4ANVFP4Linear.from_gptq_linear(source)
    assert layer.qweight.data_ptr() == source.qweight.data_ptr()  # shared, not copied
    x = _x(1, 7, K, dtype=dtype)
    out = layer(x)
    assert out.dtype == dtype and out.shape == (7, N)
    assert layer.last_route == "reference" and "native: " in layer.last_reason
    # the carrier's bytes through the pure prepacked GEMM, reading the int32 words
    a = pack_activation(x, "w4a_nvfp4")
    words = w4a_nvfp4_linear_prepacked(
        a.codes, a.scales, a.global_scale, layer.qweight, layer.scales, layer.bias,
        output_dtype=dtype,
    )  # fmt: skip
    assert torch.equal(out, words)
    assert torch.equal(out, w4a_nvfp4_linear(x, layer.qweight, layer.scales, layer.bias))


def test_v1_and_v2_zero_words_run_the_same():
    a = W4ANVFP4Linear.from_gptq_linear(_gptq(2, format="gptq"))
    b = W4ANVFP4Linear.from_gptq_linear(_gptq(2, format="gptq_v2"))
    x = _x(2, 5, K)
    assert torch.equal(a(x), b(x))


def test_a_stored_global_scale_is_used_and_zero_means_dynamic():
    layer = W4ANVFP4Linear.from_gptq_linear(_gptq(3, bias=True))
    x = _x(3, 4, K)
    big = torch.cat([x, 100 * x[:1]])  # a fifth row that raises the tensor's amax
    dynamic = layer(big)
    assert torch.equal(dynamic, w4a_nvfp4_linear(big, layer.qweight, layer.scales, layer.bias))
    # dynamic: row 0's codes depend on the other rows (the global scale follows the amax)
    assert not torch.equal(dynamic[:1], layer(x[:1]))
    layer.activation_global_scale = 0.0625
    assert int(layer.activation_global_scale_bits) == int(_f32_bits(0.0625))
    stored = layer(big)
    expected = w4a_nvfp4_linear(big, layer.qweight, layer.scales, layer.bias, global_scale=0.0625)
    assert torch.equal(stored, expected)
    assert torch.equal(stored[:1], layer(x[:1]))  # a fixed scale: rows are independent
    assert not torch.equal(stored, dynamic)
    layer.activation_recipe = "nvidia"
    expected = w4a_nvfp4_linear(
        big, layer.qweight, layer.scales, layer.bias, global_scale=0.0625, recipe="nvidia"
    )
    assert torch.equal(layer(big), expected)


def test_the_global_scale_setter():
    layer = W4ANVFP4Linear.from_gptq_linear(_gptq(4))
    layer.activation_global_scale = torch.tensor([0.375], dtype=torch.bfloat16)
    assert int(layer.activation_global_scale_bits) == int(_f32_bits(0.375))
    layer.activation_global_scale = 0.1  # rounded once to FP32
    assert torch.equal(layer.activation_global_scale, torch.tensor(0.1, dtype=torch.float32))
    for bad in (0.0, -1.0, float("nan"), float("inf"), 1e-50):
        with pytest.raises(ValueError, match="positive and finite"):
            layer.activation_global_scale = bad
    with pytest.raises(ValueError, match="FP32"):
        layer.activation_global_scale = 1e39
    with pytest.raises(ValueError, match="one value"):
        layer.activation_global_scale = torch.ones(2)
    with pytest.raises(TypeError):
        layer.activation_global_scale = "0.5"
    assert torch.equal(layer.activation_global_scale, torch.tensor(0.1, dtype=torch.float32))
    assert "activation_global_scale=0.1" in repr(layer)


def test_empty_rows_and_three_dimensional_input():
    layer = W4ANVFP4Linear.from_gptq_linear(_gptq(5, bias=True))
    for scale in (None, 0.5):  # dynamic, then a fixed scale (the 3-D call is the 2-D one)
        if scale is not None:
            layer.activation_global_scale = scale
        for shape in ((0, K), (2, 0, K)):
            out = layer(torch.zeros(shape, dtype=torch.bfloat16))
            assert out.shape == (*shape[:-1], N) and out.dtype == torch.bfloat16
    x = _x(5, 2, 3, K)
    out = layer(x)
    assert out.shape == (2, 3, N)
    assert torch.equal(out, layer(x.reshape(6, K)).reshape(2, 3, N))


# ----------------------------------------------------------------------------------------------
# Moves, loads, state dicts
# ----------------------------------------------------------------------------------------------


def test_casts_and_moves_keep_every_byte():
    layer = W4ANVFP4Linear.from_gptq_linear(_gptq(6, bias=True)).post_init(stage_planes=True)
    layer.activation_global_scale = 0.01  # not a bfloat16 value
    before = {n: (t.dtype, t.stride(), _bytes(t).clone()) for n, t in layer.named_buffers()}
    assert {"_weight_both", "_unit_weight_scales", BITS_KEY} <= set(before)
    for cast in (lambda m: m.to(torch.bfloat16), lambda m: m.half(), lambda m: m.float(),
                 lambda m: m.to("cpu"), lambda m: m._apply(lambda v: v.float())):  # fmt: skip
        cast(layer)
        after = dict(layer.named_buffers())
        assert sorted(after) == sorted(before)
        for name, t in after.items():
            dtype, stride, raw = before[name]
            assert (t.dtype, t.stride()) == (dtype, stride), name
            assert torch.equal(_bytes(t), raw), name
    assert torch.equal(layer.activation_global_scale, torch.tensor(0.01, dtype=torch.float32))
    x = _x(6, 3, K, dtype=torch.bfloat16)
    expected = w4a_nvfp4_linear(
        x, layer.qweight, layer.scales, layer.bias, global_scale=torch.tensor(0.01)
    )
    assert torch.equal(layer(x), expected)


def test_the_scale_bits_round_trip_through_a_state_dict_after_bfloat16():
    source = W4ANVFP4Linear.from_gptq_linear(_gptq(7, bias=True))
    source.activation_global_scale = 0.01
    source.to(torch.bfloat16)
    state = source.state_dict()
    assert state[BITS_KEY].dtype == torch.int32
    assert torch.equal(state[BITS_KEY], _f32_bits(0.01))
    layer = W4ANVFP4Linear(K, N, bias=True)
    layer.load_state_dict(state)
    assert torch.equal(layer.activation_global_scale_bits, _f32_bits(0.01))
    layer.post_init()
    x = _x(7, 3, K)
    assert torch.equal(layer(x), source(x))
    # a (1,)-shaped value loads as the 0-d buffer
    layer.load_state_dict({**state, BITS_KEY: _f32_bits(0.5).reshape(1)})
    assert layer.activation_global_scale_bits.shape == ()
    assert float(layer.activation_global_scale) == 0.5


def test_a_gptq_state_dict_without_the_key_loads_strictly_as_dynamic():
    source = _gptq(8, bias=True)
    layer = W4ANVFP4Linear.from_gptq_linear(source)
    layer.activation_global_scale = 0.25
    result = layer.load_state_dict(source.state_dict())  # strict: no missing key reported
    assert result.missing_keys == [] and result.unexpected_keys == []
    assert int(layer.activation_global_scale_bits) == 0
    x = _x(8, 3, K)
    with pytest.raises(RuntimeError, match=CACHE_ABSENT):
        layer(x)
    layer.post_init()
    assert torch.equal(layer(x), w4a_nvfp4_linear(x, layer.qweight, layer.scales, layer.bias))


@pytest.mark.parametrize(
    ("value", "match"),
    [
        (_f32_bits(float("nan")), "positive and finite, got nan"),
        (_f32_bits(float("inf")), "positive and finite, got inf"),
        (_f32_bits(-0.5), "bits 0xbf000000"),
        (_f32_bits(-0.0), "bits 0x80000000"),
        (torch.tensor(0.5), "int32 bit pattern, got torch.float32"),
        (torch.zeros(2, dtype=torch.int32), r"shape \(2,\)"),
        (0, "expected a tensor"),
    ],
    ids=["nan", "inf", "negative", "negative_zero", "float32", "two_values", "int"],
)
def test_a_bad_scale_is_refused_at_load_naming_the_key_and_changes_nothing(value, match):
    source = _gptq(9, bias=True)
    layer = W4ANVFP4Linear.from_gptq_linear(source)
    layer.activation_global_scale = 0.5
    x = _x(9, 2, K)
    expected = layer(x)
    state = {**source.state_dict(), BITS_KEY: value}
    with pytest.raises(ValueError, match=f"{BITS_KEY}: .*{match}"):
        layer.load_state_dict(state)
    assert float(layer.activation_global_scale) == 0.5
    assert torch.equal(layer(x), expected)  # the caches were kept


def test_post_init_refuses_bad_scale_bits_set_directly():
    layer = W4ANVFP4Linear.from_gptq_linear(_gptq(10))
    layer.activation_global_scale_bits = _f32_bits(float("inf"))
    with pytest.raises(ValueError, match=f"post_init: {BITS_KEY}: .*got inf"):
        layer.post_init()


def test_load_state_dict_and_pack_empty_every_cache():
    source = _gptq(11, bias=True)
    layer = W4ANVFP4Linear.from_gptq_linear(source).post_init(stage_planes=True)
    x = _x(11, 4, K)
    expected = layer(x)
    layer.load_state_dict(source.state_dict())
    caches = ("_weight_e4m3", "_weight_both", "_unit_weight_scales")
    assert all(getattr(layer, name) is None for name in caches)
    with pytest.raises(RuntimeError, match=CACHE_ABSENT):
        layer(x)
    layer.post_init(stage_planes=True)
    assert torch.equal(layer(x), expected)
    other = _gptq(12, format="gptq_v2")
    layer.activation_global_scale = 0.5
    layer.pack(other.packed(), format="gptq_v2")
    assert all(getattr(layer, name) is None for name in caches)
    assert layer.format == "gptq_v2" and float(layer.activation_global_scale) == 0.5
    with pytest.raises(RuntimeError, match=CACHE_ABSENT):
        layer(x)
    layer.post_init()
    expected = w4a_nvfp4_linear(x, other.qweight, other.scales, layer.bias, global_scale=0.5)
    assert torch.equal(layer(x), expected)  # the new weight, the bias kept
    with pytest.raises(ValueError, match=r"\(32, 256\)"):
        layer.pack(_gptq(13, n=32).packed())


def test_from_gptq_linear_of_a_w4a_nvfp4_module_keeps_its_activation_settings():
    layer = W4ANVFP4Linear.from_gptq_linear(_gptq(14))
    layer.activation_global_scale = 0.75
    layer.activation_recipe = "nvidia"
    copy = W4ANVFP4Linear.from_gptq_linear(layer)
    assert float(copy.activation_global_scale) == 0.75 and copy.activation_recipe == "nvidia"
    fresh = W4ANVFP4Linear.from_gptq_linear(W4AFP8Linear.from_gptq_linear(_gptq(14)))
    assert float(fresh.activation_global_scale) == 0.0
    assert fresh.activation_recipe == "least_squares"


# ----------------------------------------------------------------------------------------------
# Activation carriers
# ----------------------------------------------------------------------------------------------


def test_an_nvfp4_carrier_is_used_as_it_is():
    layer = W4ANVFP4Linear.from_gptq_linear(_gptq(15, bias=True))
    for dtype in (torch.bfloat16, torch.float16):
        x = _x(15, 2, 3, K, dtype=dtype)
        a = pack_activation(x, "w4a_nvfp4", global_scale=0.25, recipe="nvidia")
        f = torch.linspace(0.5, 2.0, 6)
        for carrier, token in ((a, None), (a.rescale_tokens(f), f)):
            out = layer(carrier)
            assert out.dtype == dtype and out.shape == (2, 3, N)
            assert layer.last_route == "reference"
            expected = w4a_nvfp4_linear_prepacked(
                a.codes, a.scales, a.global_scale, layer.qweight, layer.scales, layer.bias,
                token_scale=token, output_dtype=dtype,
            )  # fmt: skip
            assert torch.equal(out, expected.reshape(2, 3, N))
        # the module's own scale and recipe play no part for a carrier
        layer.activation_global_scale = 4.0
        assert torch.equal(layer(a), layer(a.rescale_tokens(torch.ones(6))))
        layer.activation_global_scale_bits = torch.zeros((), dtype=torch.int32)
    empty = layer(pack_activation(torch.zeros(0, K, dtype=torch.bfloat16), "w4a_nvfp4"))
    assert empty.shape == (0, N) and empty.dtype == torch.bfloat16


def test_an_fp8_carrier_runs_the_w4a_fp8_gemm():
    source = _gptq(16, bias=True)
    layer = W4ANVFP4Linear.from_gptq_linear(source)
    fp8 = W4AFP8Linear.from_gptq_linear(source)
    x = _x(16, 2, 5, K, dtype=torch.bfloat16)
    a = pack_activation(x, "w4afp8")
    out = layer(a)
    assert out.dtype == torch.bfloat16 and out.shape == (2, 5, N)
    assert layer.last_route == "fp8_reference" and "cpu" in layer.last_reason
    expected = w4a_fp8_linear_prepacked(
        a.codes, a.scales, layer.qweight, layer.scales, layer.bias, output_dtype=torch.bfloat16
    )
    assert torch.equal(out, expected.reshape(2, 5, N))
    assert torch.equal(out, fp8(a))
    layer.route = "reference"
    assert torch.equal(layer(a), out)
    assert layer.last_reason == "route='reference' was requested"


def test_carrier_refusals():
    layer = W4ANVFP4Linear.from_gptq_linear(_gptq(17))
    x = _x(17, 2, K, dtype=torch.bfloat16)
    wide = pack_activation(_x(17, 2, 2 * K, dtype=torch.bfloat16), "w4a_nvfp4")
    with pytest.raises(ValueError, match=r"shape must be \(\*, 256\)"):
        layer(wide)
    a = pack_activation(x, "w4a_nvfp4")
    fields = dict(codes=a.codes, scales=a.scales, shape=a.shape, model_dtype=a.model_dtype,
                  global_scale=a.global_scale, token_scale=None)  # fmt: skip
    with pytest.raises(ValueError, match="mode 'mxfp4'"):
        layer(types.SimpleNamespace(**fields, mode="mxfp4"))
    with pytest.raises(ValueError, match=r"codes must have shape \(2, 128\)"):
        layer(types.SimpleNamespace(**{**fields, "codes": a.codes[:, :64]}, mode="w4a_nvfp4"))
    with pytest.raises(TypeError, match="codes must be torch.float4_e2m1fn_x2"):
        codes = a.codes.view(torch.uint8)
        layer(types.SimpleNamespace(**{**fields, "codes": codes}, mode="w4a_nvfp4"))
    with pytest.raises(TypeError, match="model_dtype"):
        layer(types.SimpleNamespace(**{**fields, "model_dtype": torch.int8}, mode="w4a_nvfp4"))


# ----------------------------------------------------------------------------------------------
# Route gating
# ----------------------------------------------------------------------------------------------


def _no_emulation(monkeypatch) -> None:
    monkeypatch.setattr(wmod, "_nvfp4_emulation_unavailable", lambda device: "no emulation here")


def test_routes_on_this_machine(monkeypatch):
    layer = W4ANVFP4Linear.from_gptq_linear(_gptq(18))
    x = _x(18, 2, K)
    assert layer.last_route == "none" and layer.last_reason is None
    layer(x)
    assert layer.last_route == "reference"
    assert layer.last_reason.startswith("native: the tensors are on cpu")
    assert "; emulation: " in layer.last_reason
    assert w4a_nvfp4_route("reference", CPU) == ("reference", "route='reference' was requested")
    _no_emulation(monkeypatch)
    layer.route = "native"
    with pytest.raises(RuntimeError, match="route='native' cannot run on cpu: the tensors are"):
        layer(x)
    layer.route = "emulation"
    with pytest.raises(RuntimeError, match="route='emulation' cannot run on cpu: no emulation"):
        layer(x)
    with pytest.raises(ValueError, match="route must be one of"):
        w4a_nvfp4_route("fast", CPU)
    assert "route=emulation" in repr(layer)


def test_auto_prefers_native_then_emulation_then_reference(monkeypatch):
    monkeypatch.setattr(wmod, "w4a_nvfp4_native_unavailable_reason", lambda device: None)
    monkeypatch.setattr(wmod, "_nvfp4_emulation_unavailable", lambda device: None)
    assert w4a_nvfp4_route("auto", CPU) == ("native", None)
    assert w4a_nvfp4_route("native", CPU) == ("native", None)
    route, reason = w4a_nvfp4_route("auto", CPU, planes_staged=False)
    assert route == "emulation" and "planes are not staged" in reason
    with pytest.raises(RuntimeError, match="native weight cache is absent; call post_init"):
        w4a_nvfp4_route("native", CPU, planes_staged=False)
    assert w4a_nvfp4_route("emulation", CPU) == ("emulation", "route='emulation' was requested")
    _no_emulation(monkeypatch)
    route, reason = w4a_nvfp4_route("auto", CPU, planes_staged=False)
    assert route == "reference" and reason.endswith("; emulation: no emulation here")
    # where the native route runs, post_init stages its operands on its own
    layer = W4ANVFP4Linear.from_gptq_linear(_gptq(19))
    assert layer._weight_both is not None and layer._unit_weight_scales is not None


def test_the_native_reason_names_what_is_missing(monkeypatch):
    assert "on cpu" in w4a_nvfp4_native_unavailable_reason(CPU)
    cuda = torch.device("cuda", 0)
    for cap, ok in (((9, 0), False), ((10, 0), False), ((12, 0), False), ((12, 1), True)):
        monkeypatch.setattr(_triton, "cuda_capability", lambda device, cap=cap: cap)
        reason = w4a_nvfp4_native_unavailable_reason(cuda)
        assert (reason is None) == ok, cap
        if not ok:
            assert f"SM {cap[0]}.{cap[1]} < 12.1" in reason
    monkeypatch.delattr(F, "scaled_mm")
    assert "has no F.scaled_mm" in w4a_nvfp4_native_unavailable_reason(cuda)


# ----------------------------------------------------------------------------------------------
# The native route's GEMM loop against a stand-in F.scaled_mm
# ----------------------------------------------------------------------------------------------


def _fake_scaled_mm(calls: list):
    """``F.scaled_mm`` for NVFP4 operands written from the format: checks the arguments the
    native route must pass, decodes both operands and multiplies them in float64 (exact here),
    one rounding to FP32."""

    def scaled_mm(a, b, scale_a, recipe_a, scale_b, recipe_b, *, swizzle_a, swizzle_b,
                  output_dtype):  # fmt: skip
        fp4 = torch.float4_e2m1fn_x2
        assert a.dtype == fp4 and b.dtype == fp4
        m, n2 = a.shape[0], b.shape[1]
        assert a.shape[1] == 64 and b.shape[0] == 64 and a.stride(1) == 1 and b.stride(0) == 1
        assert recipe_a == recipe_b == F.ScalingType.BlockWise1x16
        assert swizzle_a == swizzle_b == F.SwizzleType.SWIZZLE_32_4_4
        assert output_dtype == torch.float32
        pad = lambda rows: -(-rows // 128) * 128
        assert tuple(scale_a.shape) == (pad(m) * 8,) and tuple(scale_b.shape) == (pad(n2) * 8,)
        assert scale_a.dtype == scale_b.dtype == torch.float8_e4m3fn
        av = _decode_nibbles(a) * _unswizzle(scale_a, m).repeat_interleave(16, dim=1)
        bv = _decode_nibbles(b.T) * _unswizzle(scale_b, n2).repeat_interleave(16, dim=1)
        calls.append(m)
        return (av @ bv.T).to(torch.float32)

    return scaled_mm


def test_the_native_route_equals_the_reference_with_a_stand_in_scaled_mm(monkeypatch):
    calls: list = []
    monkeypatch.setattr(wmod, "w4a_nvfp4_native_unavailable_reason", lambda device: None)
    monkeypatch.setattr(F, "scaled_mm", _fake_scaled_mm(calls), raising=False)
    layer = W4ANVFP4Linear.from_gptq_linear(_gptq(20, bias=True))
    assert layer._weight_both is not None
    x = _grid_activation(20, 3, 5, K, dtype=torch.bfloat16)  # both routes exact
    layer.activation_global_scale = 1.0
    a = pack_activation(x, "w4a_nvfp4", global_scale=1.0)
    assert torch.equal(a.decode(torch.float32), x.float())
    for carrier in (None, a.rescale_tokens(torch.linspace(0.5, 1, 15))):
        out = layer(x if carrier is None else carrier)
        assert layer.last_route == "native" and layer.last_reason is None
        layer.route = "reference"
        assert torch.equal(out, layer(x if carrier is None else carrier))
        assert layer.last_route == "reference"
        layer.route = "auto"
    assert calls == [15] * 4  # two groups of 128, two calls
    # random activations: both within the planes GEMM's worst-case rounding bound
    x = _x(20, 33, K)
    out = layer(x)
    layer.route = "reference"
    reference = layer(x)
    assert not torch.equal(out, torch.zeros_like(out))
    a = pack_activation(x, "w4a_nvfp4", global_scale=1.0)
    bound = w4a_nvfp4_linear_error_bound(
        a.codes, a.scales, a.global_scale, layer.qweight, layer.scales, layer.bias,
        output_dtype=torch.float32,
    )  # fmt: skip
    for result in (out, reference):
        assert bool(((result.double() - bound.exact).abs() <= bound.worst_case).all())


def _grid_activation(seed: int, *shape: int, dtype: torch.dtype) -> torch.Tensor:
    """Values on the E2M1 grid: with a global scale of 1 every block scale is exact and every
    group sum an exact FP32 value, so any two routes agree bit for bit."""
    g = torch.Generator().manual_seed(seed)
    grid = torch.tensor([-6.0, -3.0, -1.5, -0.5, 0.0, 0.5, 1.0, 2.0, 4.0, 6.0])
    return grid[torch.randint(0, 10, shape, generator=g)].to(dtype)


@pytest.mark.skipif(
    not can_interpret(),
    reason="needs Triton installed and no CUDA device (with CUDA the compiled kernel is tested)",
)
def test_interpreter_suite():
    run_interpreted_tests(__file__, expected=1)


@needs_interpreter
def test_interpreted_native_loop_with_the_accumulate_kernel(monkeypatch):
    from floatxq.kernels.nvfp4_decoding import nvfp4_accumulate_group

    calls: list = []
    monkeypatch.setattr(wmod, "w4a_nvfp4_native_unavailable_reason", lambda device: None)
    monkeypatch.setattr(F, "scaled_mm", _fake_scaled_mm(calls), raising=False)
    assert wmod.nvfp4_accumulator(CPU) is nvfp4_accumulate_group
    layer = W4ANVFP4Linear.from_gptq_linear(_gptq(21, bias=True))
    layer.activation_global_scale = 1.0
    x = _grid_activation(21, 9, K, dtype=torch.float16)
    out = layer(x)
    assert layer.last_route == "native" and calls == [9, 9]
    layer.route = "reference"
    assert torch.equal(out, layer(x))


# ----------------------------------------------------------------------------------------------
# GPU: the emulation route against the reference (the lead runs these)
# ----------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 5, 64, 300])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_gpu_emulation_route_is_the_reference_within_its_bound(rows, dtype):
    device = torch.device("cuda")
    why = wmod._nvfp4_emulation_unavailable(device)
    if why is not None:
        pytest.skip(why)
    layer = W4ANVFP4Linear.from_gptq_linear(_gptq(30 + rows, bias=True)).to(device)
    layer.route = "emulation"
    x = _x(rows, rows, K, dtype=dtype).to(device)
    out = layer(x)
    assert layer.last_route == "emulation" and out.shape == (rows, N) and out.dtype == dtype
    a = pack_activation(x, "w4a_nvfp4")
    bound = w4a_nvfp4_linear_error_bound(
        a.codes, a.scales, a.global_scale, layer.qweight, layer.scales, layer.bias,
        output_dtype=dtype,
    )  # fmt: skip
    error = (out.double() - bound.exact).abs()
    assert bool((error <= bound.statistical).all()), float((error / bound.statistical).max())
    layer.route = "reference"
    reference = layer(x).double()
    assert bool(((reference - bound.exact).abs() <= bound.statistical).all())


@pytest.mark.gpu
def test_gpu_moves_keep_the_staged_bytes():
    layer = W4ANVFP4Linear.from_gptq_linear(_gptq(40)).post_init(stage_planes=True)
    layer.activation_global_scale = 0.01
    before = {n: _bytes(t).clone() for n, t in layer.named_buffers()}
    layer.to("cuda").to(torch.bfloat16)
    for name, t in layer.named_buffers():
        assert t.is_cuda and torch.equal(_bytes(t).cpu(), before[name]), name
    assert layer._weight_both.stride() == (1, K // 2)


def test_the_device_global_scale_is_the_dynamic_one_or_the_stored_one_bitwise():
    """The no-host-read global scale of a call (``global_scale_from_bits``, whose Triton twin
    the CUDA path launches) equals nvfp4_global_scale of max|x| on x's grid while the stored
    value is 0.0, and the stored value otherwise."""
    from floatxq.nvfp4.quantize import nvfp4_global_scale
    from floatxq.w4a.activation import global_scale_from_bits

    dynamic = torch.zeros((), dtype=torch.int32)
    for dtype in (torch.float16, torch.bfloat16, torch.float32):
        for recipe in ("least_squares", "nvidia"):
            x2 = _x(51, 3, K, dtype=dtype)
            want = nvfp4_global_scale(x2.float().abs().amax(), grid_dtype=dtype, recipe=recipe)
            got = global_scale_from_bits(dynamic, x2, recipe=recipe)
            assert torch.equal(got.view(torch.int32), want.view(torch.int32)), (dtype, recipe)
    assert global_scale_from_bits(dynamic, _x(52, 0, K), recipe="nvidia").item() == 1.0
    got = global_scale_from_bits(_f32_bits(0.0375), _x(53, 2, K), recipe="nvidia")
    assert torch.equal(got.view(torch.int32), _f32_bits(0.0375))


@pytest.mark.gpu
@pytest.mark.parametrize("stored", [None, 0.02])
def test_gpu_forward_captures_in_a_cuda_graph(stored):
    """The CUDA forward reads nothing on the host (dynamic or stored global scale, either
    operand form): it captures in a CUDA graph, and the replay equals the eager call."""
    layer = W4ANVFP4Linear.from_gptq_linear(_gptq(54, bias=True)).to("cuda")
    if stored is not None:
        layer.activation_global_scale = stored
    for rows in (4, 200):
        x = _x(55, rows, K, dtype=torch.bfloat16).cuda()
        eager = layer(x)
        assert layer.last_route == "emulation"
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            layer(x)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = layer(x)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, eager), rows
