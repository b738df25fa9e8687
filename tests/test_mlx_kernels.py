"""The Metal kernels of the MLX FP8 path against their array-ops references.

Without Metal the kernel sources run through a C++ build (``metal_emulator``), launched from
the same plans the library hands to MLX; with Metal (an Apple GPU) the last tests run them on
the GPU as well.
"""

import numpy as np
import pytest
import torch

mx = pytest.importorskip("mlx.core")

import floatxq as fq  # noqa: E402
import floatxq.mlx as fqm  # noqa: E402
import floatxq.mlx.fp8 as mlx_fp8  # noqa: E402
import floatxq.mlx.linear as mlx_linear  # noqa: E402
from floatxq.formats import fp8_max  # noqa: E402
from floatxq.mlx import kernels  # noqa: E402
from floatxq.mlx import metal_emulator as emulator  # noqa: E402
from floatxq.mlx.fp8 import _FP8_BITS  # noqa: E402
from floatxq.testing.mlx import assert_mlx_linear_close  # noqa: E402

if emulator.compiler() is None:
    pytest.skip("the Metal emulator needs g++", allow_module_level=True)

ENCODABLE = ["float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz"]
DTYPES = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}
METAL = kernels.metal_available()


def _weight(seed: int, out: int, inp: int, fmt: str, layout: tuple) -> "fqm.MlxFP8Weight":
    g = np.random.default_rng(seed)
    w = g.standard_normal((out, inp)).astype(np.float32)
    w *= np.exp2(g.integers(-6, 6, (out, 1))).astype(np.float32)
    method, block = layout
    return fqm.quantize_fp8_weight_mlx(
        mx.array(w), format=fmt, weight_scale_method=method, weight_block_size=block
    )


def _x(seed: int, rows: int, inp: int, dtype) -> "mx.array":
    g = np.random.default_rng(seed + 1000)
    return mx.array(g.standard_normal((rows, inp)).astype(np.float32)).astype(dtype)


def _assert_close(got: "mx.array", x: "mx.array", layer) -> None:
    assert_mlx_linear_close(got, x, layer)


def _run_both(layer, x) -> tuple["mx.array", "mx.array"]:
    bias = layer.bias if "bias" in layer else None
    args = (x, layer.qweight, layer._table, layer.scale_inv, bias)
    general = emulator.emulate(kernels.packed_linear_launch(*args, route="general"))
    prefill = emulator.emulate(kernels.packed_linear_launch(*args, route="prefill"))
    return general, prefill


# ----------------------------------------------------------------------------------------------
# Route choice
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("rows", "inp", "out", "route"),
    [
        (2, 4096, 14336, "prefill"),
        (16, 8192, 8192, "prefill"),
        (1000, 64, 8224, "prefill"),
        (1, 4096, 14336, "general"),  # one row: decode
        (0, 4096, 14336, "general"),
        (64, 8256, 8192, "general"),  # input too wide
        (64, 4032 + 32, 8192, "general"),  # input not a multiple of 64
        (64, 4096, 8160, "general"),  # output below 8192
        (64, 4096, 8192 + 16, "general"),  # output not a multiple of 32
    ],
)
def test_packed_route_rules(rows: int, inp: int, out: int, route: str) -> None:
    assert kernels.packed_route(rows, inp, out) == route


def test_layer_route_without_metal_is_array_ops() -> None:
    layer = fqm.MlxFP8PackedLinear(mx.zeros((8192, 64), dtype=mx.uint8), mx.array(1.0))
    assert layer.route(32) == ("prefill" if METAL else "array-ops")


@pytest.mark.skipif(METAL, reason="checks the refusal where Metal is absent")
def test_run_metal_refuses_without_metal() -> None:
    layer = fqm.MlxFP8PackedLinear(mx.zeros((4, 8), dtype=mx.uint8), mx.array(1.0))
    plan = kernels.packed_linear_launch(
        mx.zeros((1, 8)), layer.qweight, layer._table, layer.scale_inv, None, route="general"
    )
    with pytest.raises(RuntimeError, match="needs MLX's Metal backend"):
        kernels.run_metal(plan)


def test_launch_refuses_unknown_route() -> None:
    with pytest.raises(ValueError, match="route must be 'prefill' or 'general'"):
        kernels.packed_linear_launch(
            mx.zeros((1, 8)),
            mx.zeros((4, 8), dtype=mx.uint8),
            fqm.fp8_decode_table(),
            mx.array(1.0),
            None,
            route="tiled",
        )


# ----------------------------------------------------------------------------------------------
# Packed-byte kernels: same bytes on both routes, within the FP32 bound of the reference
# ----------------------------------------------------------------------------------------------

LAYOUTS = [("tensor", None), ("row", None), ("block", (2, 32)), ("block", (1, 16))]
# Ragged on purpose: rows that leave a partial 16-row tile, outputs that are not multiples of
# the threadgroup width, a single row and a single output.
SHAPES = [(1, 32, 1), (3, 64, 5), (17, 96, 40), (33, 128, 70), (16, 32, 64)]


@pytest.mark.parametrize("fmt", ENCODABLE)
@pytest.mark.parametrize("layout", LAYOUTS, ids=str)
@pytest.mark.parametrize("dtype", DTYPES)
def test_packed_kernels_agree_and_match_reference(fmt: str, layout: tuple, dtype: str) -> None:
    for seed, (rows, inp, out) in enumerate(SHAPES):
        if layout[0] == "block" and out % layout[1][0]:
            out *= layout[1][0]
        q = _weight(seed, out, inp, fmt, layout)
        bias = None if seed % 2 else _x(seed, 1, out, mx.float16).reshape(out)
        layer = fqm.MlxFP8PackedLinear(q.qweight, q.scale_inv, bias, format=fmt)
        x = _x(seed, rows, inp, DTYPES[dtype])
        general, prefill = _run_both(layer, x)
        assert general.dtype == x.dtype and general.shape == (rows, out)
        np.testing.assert_array_equal(
            np.array(mx.view(general, mx.uint8 if dtype != "float32" else mx.uint32)),
            np.array(mx.view(prefill, mx.uint8 if dtype != "float32" else mx.uint32)),
        )
        _assert_close(general, x, layer)
        _assert_close(layer.reference(x), x, layer)


def test_packed_kernels_bias_dtypes_and_zero_weight() -> None:
    for bias_dtype in (mx.float32, mx.float16, mx.bfloat16):
        q = _weight(5, 24, 64, "float8_e4m3fn", ("row", None))
        bias = _x(9, 1, 24, bias_dtype).reshape(24)
        layer = fqm.MlxFP8PackedLinear(q.qweight, q.scale_inv, bias)
        x = _x(3, 19, 64, mx.float32)
        general, prefill = _run_both(layer, x)
        assert mx.array_equal(general, prefill).item()
        _assert_close(general, x, layer)
    zero = fqm.MlxFP8PackedLinear(mx.zeros((8, 32), dtype=mx.uint8), mx.array([1.0] * 8))
    general, _ = _run_both(zero, _x(1, 4, 32, mx.float16))
    assert not mx.any(general).item()


def test_packed_kernels_special_codes_match_reference() -> None:
    # E4M3FN NaN codes (0x7F, 0xFF) and E5M2 infinities (0x7C, 0xFC): the same NaN and infinity
    # positions as the array-ops reference, the finite outputs within the bound.
    for fmt, specials in (("float8_e4m3fn", (0x7F, 0xFF)), ("float8_e5m2", (0x7C, 0xFC))):
        q = _weight(2, 12, 64, fmt, ("row", None))
        codes = np.array(q.qweight)
        codes[3, 5], codes[7, 0], codes[7, 9] = specials[0], specials[1], specials[0]
        layer = fqm.MlxFP8PackedLinear(mx.array(codes), q.scale_inv, format=fmt)
        x = _x(4, 5, 64, mx.float32)
        x = mx.where(mx.arange(64) == 9, 0.0, x)  # 0 * inf is NaN in both
        general, prefill = _run_both(layer, x)
        ref = np.array(layer.reference(x))
        got = np.array(general)
        np.testing.assert_array_equal(np.isnan(got), np.isnan(ref))
        np.testing.assert_array_equal(np.isinf(got), np.isinf(ref))
        np.testing.assert_array_equal(got[np.isinf(got)], ref[np.isinf(ref)])
        assert np.isnan(got).any() or np.isinf(got).any()
        assert mx.array_equal(general, prefill, equal_nan=True).item()


def test_packed_kernels_long_inputs_stay_in_bound() -> None:
    # A long K with one block per 128 inputs: many partial sums and divisions per output.
    q = _weight(11, 64, 1024, "float8_e4m3fn", ("block", (64, 128)))
    layer = fqm.MlxFP8PackedLinear(q.qweight, q.scale_inv)
    x = _x(2, 18, 1024, mx.bfloat16)
    general, prefill = _run_both(layer, x)
    assert mx.array_equal(general, prefill).item()
    _assert_close(general, x, layer)


# ----------------------------------------------------------------------------------------------
# The layer's call goes through the plan where Metal runs (the emulator stands in for the GPU)
# ----------------------------------------------------------------------------------------------


@pytest.fixture
def fake_metal(monkeypatch: pytest.MonkeyPatch) -> list:
    launched: list = []

    def run(plan: "kernels.MetalLaunch") -> "mx.array":
        launched.append(plan.kernel)
        return emulator.emulate(plan)

    for module in (mlx_linear, mlx_fp8):
        monkeypatch.setattr(module, "metal_available", lambda: True)
        monkeypatch.setattr(module, "run_metal", run)
    return launched


def test_layer_call_takes_the_kernel_route(fake_metal: list, monkeypatch) -> None:
    q = _weight(1, 96, 64, "float8_e5m2", ("block", (32, 32)))
    layer = fqm.MlxFP8PackedLinear(
        q.qweight, q.scale_inv, _x(0, 1, 96, mx.float16).reshape(96), format="e5m2"
    )
    x = _x(7, 2 * 3 * 5, 64, mx.bfloat16)
    y = layer(x.reshape(2, 3, 5, 64))
    assert fake_metal == ["packed_general"] and y.shape == (2, 3, 5, 96)
    assert y.dtype == mx.bfloat16
    _assert_close(y.reshape(30, 96), x, layer)
    # Make the output count as wide: the same layer now takes the prefill kernel for many rows
    # and the general one for a single row; the bytes agree.
    monkeypatch.setattr(
        mlx_linear,
        "mlx_packed_route",
        lambda r, i, o, *, metal: ("prefill" if r > 1 else "general", None),
    )
    y2 = layer(x.reshape(2, 3, 5, 64))
    assert fake_metal[-1] == "packed_prefill"
    assert mx.array_equal(y, y2).item()
    one = layer(x[:1])
    assert fake_metal[-1] == "packed_general"
    assert mx.array_equal(one, y.reshape(30, 96)[:1]).item()


def test_layer_call_with_no_rows_launches_nothing(fake_metal: list) -> None:
    layer = fqm.MlxFP8PackedLinear(mx.zeros((4, 32), dtype=mx.uint8), mx.array(1.0))
    y = layer(mx.zeros((0, 3, 32), dtype=mx.float16))
    assert y.shape == (0, 3, 4) and y.dtype == mx.float16 and fake_metal == []


def test_layer_call_through_kernel_matches_torch(fake_metal: list) -> None:
    torch.manual_seed(0)
    linear = torch.nn.Linear(128, 48, bias=True)
    module = fq.nn.TorchFP8Linear.from_linear(linear, weight_scale_method="row")
    layer = fqm.MlxFP8PackedLinear.from_torch(module)
    x = torch.randn(9, 128)
    want = module(x).detach().numpy()
    got = np.array(layer(mx.array(x.numpy())))
    assert fake_metal == ["packed_general"]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------------------------------------
# Encoder kernel: the array-ops encoder's bytes
# ----------------------------------------------------------------------------------------------


def _encode_kernel(w: "mx.array", scale_inv: "mx.array", fmt: str) -> "mx.array":
    mbits, bias, negative_zero = _FP8_BITS[fmt]
    plan = kernels.fp8_encode_launch(
        w, scale_inv, mbits=mbits, bias=bias, negative_zero=negative_zero, fmax=fp8_max(fmt)
    )
    return emulator.emulate(plan)


def _edge_values(fmt: str) -> np.ndarray:
    """Every finite code value of ``fmt``, the midpoints between neighbours (ties) and values a
    hair either side of each midpoint, FP32 subnormals, signed zeros and past-the-top values."""
    table = np.array(fqm.fp8_decode_table(fmt)).astype(np.float32)
    pos = np.unique(table[np.isfinite(table) & (table >= 0)])
    mids = ((pos[:-1].astype(np.float64) + pos[1:]) / 2).astype(np.float32)
    up, down = np.nextafter(mids, np.float32(np.inf)), np.nextafter(mids, np.float32(0))
    tiny = np.array([1e-45, 2e-40, 1.1754942e-38, 3e-39], dtype=np.float32)
    top = np.float32(fp8_max(fmt))
    values = np.concatenate([pos, mids, up, down, tiny, [0.0, top * 1.0001, top * 1.5]])
    values = np.concatenate([values, -values]).astype(np.float32)
    values[-1] = top  # amax == fp8_max keeps the tensor scale at exactly 1
    return values


@pytest.mark.parametrize("fmt", ENCODABLE)
def test_encode_kernel_edge_values(fmt: str) -> None:
    values = _edge_values(fmt)
    cols = 16
    values = np.concatenate([values, np.zeros((-len(values)) % cols, np.float32)])
    w = mx.array(values.reshape(-1, cols))
    q = fqm.quantize_fp8_weight_mlx(w, format=fmt, weight_scale_method="tensor")
    assert q.scale_inv.item() == pytest.approx(fp8_max(fmt) / float(np.abs(values).max()))
    got = _encode_kernel(w, q.scale_inv, fmt)
    np.testing.assert_array_equal(np.array(got), np.array(q.qweight))
    with_unit = _encode_kernel(w, mx.array(1.0), fmt)
    ref = fq.quantize_fp8_weight(
        torch.from_numpy(np.clip(values, -fp8_max(fmt), fp8_max(fmt))).reshape(-1, cols),
        format=fmt,
        weight_scale_method="tensor",
    )
    assert ref.scale_inv.item() == 1.0
    np.testing.assert_array_equal(np.array(with_unit), ref.qweight.view(torch.uint8).numpy())


@pytest.mark.parametrize("fmt", ENCODABLE)
@pytest.mark.parametrize(
    "layout", [("tensor", None), ("row", None), ("block", (4, 8)), ("block", (1, 1))], ids=str
)
@pytest.mark.parametrize("dtype", DTYPES)
def test_encode_kernel_fuzzed(fmt: str, layout: tuple, dtype: str) -> None:
    g = np.random.default_rng(3)
    for rows, cols in ((4, 8), (12, 40), (20, 96)):
        spread = 8 if dtype == "float16" else 30
        w = g.standard_normal((rows, cols)) * np.exp2(g.integers(-spread, spread, (rows, cols)))
        w = mx.array(w.astype(np.float32)).astype(DTYPES[dtype])
        method, block = layout
        q = fqm.quantize_fp8_weight_mlx(
            w, format=fmt, weight_scale_method=method, weight_block_size=block
        )
        np.testing.assert_array_equal(
            np.array(_encode_kernel(w, q.scale_inv, fmt)), np.array(q.qweight)
        )


def test_encoder_routes_large_weights_to_the_kernel(fake_metal: list) -> None:
    g = np.random.default_rng(0)
    w = mx.array(g.standard_normal((1024, 1024)).astype(np.float32)).astype(mx.bfloat16)
    assert fqm.fp8_encode_route(w) == "metal"
    assert fqm.fp8_encode_route(w[:1023]) == "array-ops"
    for kwargs in (
        {"weight_scale_method": "row"},
        {"weight_scale_method": "block", "weight_block_size": [128, 128]},
    ):
        got = fqm.quantize_fp8_weight_mlx(w, **kwargs)
        want = fq.quantize_fp8_weight(
            torch.from_numpy(np.array(w.astype(mx.float32))).bfloat16(), **kwargs
        )
        np.testing.assert_array_equal(np.array(got.qweight), want.qweight.view(torch.uint8).numpy())
        np.testing.assert_array_equal(np.array(got.scale_inv), want.scale_inv.numpy())
    assert fake_metal == ["fp8_encode", "fp8_encode"]


def test_encoder_off_metal_uses_array_ops() -> None:
    w = mx.zeros((1024, 1024))
    assert fqm.fp8_encode_route(w) == ("metal" if METAL else "array-ops")


# ----------------------------------------------------------------------------------------------
# On an Apple GPU: the compiled kernels give the emulator's bytes
# ----------------------------------------------------------------------------------------------


@pytest.mark.skipif(not METAL, reason="needs MLX's Metal backend (an Apple GPU)")
@pytest.mark.parametrize("fmt", ENCODABLE)
def test_metal_encoder_equals_emulator(fmt: str) -> None:
    values = _edge_values(fmt)
    w = mx.array(np.resize(values, (len(values) // 8, 8)))
    q = fqm.quantize_fp8_weight_mlx(w, format=fmt, weight_scale_method="row")
    mbits, bias, negative_zero = _FP8_BITS[fmt]
    plan = kernels.fp8_encode_launch(
        w, q.scale_inv, mbits=mbits, bias=bias, negative_zero=negative_zero, fmax=fp8_max(fmt)
    )
    assert mx.array_equal(kernels.run_metal(plan), emulator.emulate(plan)).item()
    assert mx.array_equal(kernels.run_metal(plan), q.qweight).item()


@pytest.mark.skipif(not METAL, reason="needs MLX's Metal backend (an Apple GPU)")
@pytest.mark.parametrize("route", ["general", "prefill"])
@pytest.mark.parametrize("layout", LAYOUTS, ids=str)
def test_metal_packed_kernels_equal_emulator(route: str, layout: tuple) -> None:
    for seed, (rows, inp, out) in enumerate(SHAPES):
        q = _weight(seed, out * 2, inp, "float8_e4m3fn", layout)
        layer = fqm.MlxFP8PackedLinear(q.qweight, q.scale_inv)
        x = _x(seed, rows, inp, mx.float16)
        plan = kernels.packed_linear_launch(
            x, layer.qweight, layer._table, layer.scale_inv, None, route=route
        )
        got = kernels.run_metal(plan)
        assert mx.array_equal(got, emulator.emulate(plan)).item()
        _assert_close(got, x, layer)


def test_shapes_cover_partial_tiles() -> None:
    # Guard the fuzz list itself: a partial 16-row tile and an output narrower than a group.
    assert any(r % kernels.PREFILL_TILE_ROWS for r, _, _ in SHAPES)
    assert any(o % 32 for _, _, o in SHAPES)


# ----------------------------------------------------------------------------------------------
# quantize_fp8_weight_auto hands very large CPU weights to MLX on Apple Silicon
# ----------------------------------------------------------------------------------------------


@pytest.fixture
def apple(monkeypatch: pytest.MonkeyPatch) -> None:
    import floatxq.dispatch.fp8 as fk

    monkeypatch.setattr(fk, "_apple_silicon", lambda: True)
    monkeypatch.setattr(fk, "MLX_ENCODER_MIN_ELEMENTS", 64)
    monkeypatch.setattr(kernels, "metal_available", lambda: True)


@pytest.mark.parametrize("fmt", ENCODABLE)
@pytest.mark.parametrize(
    "kwargs",
    [
        {"weight_scale_method": "tensor"},
        {"weight_scale_method": "row"},
        {"weight_scale_method": "block", "weight_block_size": [4, 16]},
    ],
    ids=str,
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_auto_route_through_mlx_gives_torch_bytes(apple, fmt: str, kwargs: dict, dtype) -> None:
    g = torch.Generator().manual_seed(2)
    w = (torch.randn(12, 48, generator=g) * torch.exp2(torch.randint(-8, 8, (12, 1)))).to(dtype)
    got, route, reason = fq.dispatch.quantize_fp8_weight_auto(w, format=fmt, **kwargs)
    assert (route, reason) == ("mlx", None)
    want = fq.quantize_fp8_weight(w, format=fmt, **kwargs)
    assert got.qweight.dtype == want.qweight.dtype and got.qweight.is_contiguous()
    assert torch.equal(got.qweight.view(torch.uint8), want.qweight.view(torch.uint8))
    assert torch.equal(got.scale_inv.view(torch.int32), want.scale_inv.view(torch.int32))


def test_auto_route_keeps_small_weights_on_torch(apple) -> None:
    got, route, reason = fq.dispatch.quantize_fp8_weight_auto(torch.ones(4, 8))
    assert route == "torch" and "CUDA" in reason
    assert torch.equal(got.scale_inv, torch.full((4,), 448.0))


def test_auto_route_off_apple_is_torch() -> None:
    _, route, _ = fq.dispatch.quantize_fp8_weight_auto(torch.ones(8, 8))
    assert route == "torch"


def test_fp8_linear_from_linear_through_mlx_route(apple, monkeypatch) -> None:
    import floatxq.dispatch.fp8 as fk

    torch.manual_seed(1)
    linear = torch.nn.Linear(64, 32)
    bridge = mlx_fp8.quantize_fp8_weight_torch_via_mlx
    calls: list = []

    def spy(weight, **kwargs):
        calls.append(tuple(weight.shape))
        return bridge(weight, **kwargs)

    monkeypatch.setattr(mlx_fp8, "quantize_fp8_weight_torch_via_mlx", spy)
    via_mlx = fq.nn.TorchFP8Linear.from_linear(linear, weight_scale_method="row")
    assert calls == [(32, 64)]
    monkeypatch.setattr(fk, "_apple_silicon", lambda: False)
    plain = fq.nn.TorchFP8Linear.from_linear(linear, weight_scale_method="row")
    assert torch.equal(via_mlx.weight.view(torch.uint8), plain.weight.view(torch.uint8))
    assert torch.equal(via_mlx.weight_scale_inv, plain.weight_scale_inv)


def test_torch_bridge_refuses_non_float_tensors() -> None:
    from floatxq.mlx.fp8 import quantize_fp8_weight_torch_via_mlx
    from floatxq.testing import production_checks

    with production_checks(), pytest.raises(TypeError, match="float16, bfloat16 or float32 torch"):
        quantize_fp8_weight_torch_via_mlx(torch.ones(2, 2, dtype=torch.int32))
    with pytest.raises(ValueError, match="NaN or infinity"):
        quantize_fp8_weight_torch_via_mlx(torch.tensor([[float("nan"), 1.0]]))
