"""MLX FP8 linears: the decode-table layer and the native mxfp8 layer vs the torch reference."""

import numpy as np
import pytest
import torch
from torch import nn

mx = pytest.importorskip("mlx.core")

import floatxq as fq  # noqa: E402
import floatxq.mlx as fqm  # noqa: E402
from floatxq.nn.fp8_linear import TorchFP8Linear  # noqa: E402
from floatxq.testing import (  # noqa: E402
    assert_within_bound,
    decoded_linear_error_bound,
    production_checks,
)
from floatxq.testing.mlx import to_torch  # noqa: E402

ENCODABLE = ["float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz"]
MX_DTYPES = ["float32", "float16", "bfloat16"]
# (out, in, block for the block layout): ragged widths, a single output row, wide rows.
SHAPES = [(6, 12, (2, 4)), (1, 8, (1, 4)), (10, 36, (5, 12)), (7, 64, (7, 32))]
LEADING = [(1,), (5,), (2, 3), (33,)]


def _torch_layer(
    out: int, inp: int, *, fmt: str, method: str, block=None, bias: bool = True, seed: int = 0
) -> TorchFP8Linear:
    """A TorchFP8Linear quantized from a linear whose rows span magnitudes 2**-8 .. 2**8."""
    g = torch.Generator().manual_seed(seed)
    linear = nn.Linear(inp, out, bias=bias)
    with torch.no_grad():
        scale = torch.exp2(torch.randint(-8, 9, (out, 1), generator=g).float())
        linear.weight.copy_(torch.randn(out, inp, generator=g) * scale)
        if bias:
            linear.bias.copy_(torch.randn(out, generator=g))
    return TorchFP8Linear.from_linear(
        linear, format=fmt, weight_scale_method=method, weight_block_size=block
    )


def _x(lead: tuple[int, ...], inp: int, dtype: str, seed: int = 1) -> "mx.array":
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*lead, inp, generator=g)
    return mx.array(x.numpy()).astype(getattr(mx, dtype))


def _assert_matches_reference(got: "mx.array", x: "mx.array", layer: TorchFP8Linear) -> None:
    """``got`` is torch's ``x @ dequantize_fp8_weight(...).T + bias`` up to FP32 sums in any order
    and one rounding to ``x``'s dtype (``decoded_linear_error_bound``'s worst case)."""
    assert got.dtype == x.dtype and got.shape == (*x.shape[:-1], layer.out_features)
    w = fq.dequantize_fp8_weight(layer.weight, layer.weight_scale_inv)
    bound = decoded_linear_error_bound(
        to_torch(x).reshape(-1, layer.in_features), w, layer.bias, out_dtype=to_torch(x).dtype
    )
    assert_within_bound(to_torch(got).reshape(-1, layer.out_features), bound, which="worst_case")


# ----------------------------------------------------------------------------------------------
# Decode table
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", ENCODABLE)
def test_decode_table_equals_torch_decode_of_every_byte(fmt: str) -> None:
    want = torch.arange(256, dtype=torch.uint8).view(getattr(torch, fmt)).float().numpy()
    got = np.array(fqm.fp8_decode_table(fmt))
    assert got.dtype == np.float32 and got.shape == (256,)
    np.testing.assert_array_equal(
        got.view(np.uint32)[~np.isnan(want)], want.view(np.uint32)[~np.isnan(want)]
    )
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))


def test_decode_table_nan_codes() -> None:
    table = np.array(fqm.fp8_decode_table("float8_e4m3fn"))
    assert np.flatnonzero(np.isnan(table)).tolist() == [0x7F, 0xFF]
    table = np.array(fqm.fp8_decode_table("float8_e4m3fnuz"))
    assert np.flatnonzero(np.isnan(table)).tolist() == [0x80]


def test_decode_table_refuses_e8m0() -> None:
    with pytest.raises(ValueError, match="e8m0"):
        fqm.fp8_decode_table("float8_e8m0fnu")


# ----------------------------------------------------------------------------------------------
# MlxFP8PackedLinear
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", ENCODABLE)
@pytest.mark.parametrize("method", ["tensor", "row", "block"])
@pytest.mark.parametrize("shape", SHAPES)
def test_packed_matches_torch_reference(fmt: str, method: str, shape: tuple) -> None:
    out, inp, block = shape
    layer = _torch_layer(
        out, inp, fmt=fmt, method=method, block=block if method == "block" else None
    )
    packed = fqm.MlxFP8PackedLinear.from_torch(layer)
    for i, (lead, dtype) in enumerate(zip(LEADING, [*MX_DTYPES, "float32"], strict=True)):
        x = _x(lead, inp, dtype, seed=i)
        _assert_matches_reference(packed(x), x, layer)


@pytest.mark.parametrize("dtype", MX_DTYPES)
def test_packed_without_bias_every_dtype(dtype: str) -> None:
    layer = _torch_layer(9, 20, fmt="float8_e5m2", method="row", bias=False)
    packed = fqm.MlxFP8PackedLinear.from_torch(layer)
    assert "bias" not in packed
    x = _x((4,), 20, dtype)
    _assert_matches_reference(packed(x), x, layer)


@pytest.mark.parametrize("fmt", ENCODABLE)
@pytest.mark.parametrize(("method", "block"), [("tensor", None), ("row", None), ("block", (2, 4))])
def test_packed_copies_and_decodes_exactly(fmt: str, method: str, block) -> None:
    layer = _torch_layer(6, 12, fmt=fmt, method=method, block=block)
    packed = fqm.MlxFP8PackedLinear.from_torch(layer)
    np.testing.assert_array_equal(np.array(packed.qweight), layer.weight.view(torch.uint8).numpy())
    np.testing.assert_array_equal(
        np.array(packed.scale_inv).view(np.uint32), layer.weight_scale_inv.numpy().view(np.uint32)
    )
    assert packed.bias.dtype == mx.float16
    np.testing.assert_array_equal(
        np.array(packed.bias).view(np.uint16), layer.bias.numpy().view(np.uint16)
    )
    want = fq.dequantize_fp8_weight(layer.weight, layer.weight_scale_inv).numpy()
    np.testing.assert_array_equal(
        np.array(packed.dequantize()).view(np.uint32), want.view(np.uint32)
    )
    assert packed.format == fmt
    assert sorted(packed.parameters()) == ["bias", "qweight", "scale_inv"]


def test_packed_nan_codes_decode_as_nan() -> None:
    codes = np.full((3, 4), 0x38, np.uint8)  # 1.0 in E4M3FN
    codes[0, 1], codes[2, 3] = 0x7F, 0xFF
    packed = fqm.MlxFP8PackedLinear(mx.array(codes), mx.array([1.0, 2.0, 4.0]))
    w = np.array(packed.dequantize())
    assert np.argwhere(np.isnan(w)).tolist() == [[0, 1], [2, 3]]
    assert w[1].tolist() == [0.5] * 4
    y = np.array(packed(mx.ones((2, 4))))
    assert np.isnan(y[:, 0]).all() and np.isnan(y[:, 2]).all() and (y[:, 1] == 2.0).all()
    fnuz = fqm.MlxFP8PackedLinear(
        mx.array([[0x80, 0x00]], dtype=mx.uint8), mx.array(1.0), format="e4m3fnuz"
    )
    assert np.isnan(np.array(fnuz.dequantize())[0, 0])


def test_packed_doc_example() -> None:
    layer = fqm.MlxFP8PackedLinear(mx.array([[0x38, 0xC0]], dtype=mx.uint8), mx.array(2.0))
    assert layer(mx.array([[1.0, 1.0]])).tolist() == [[-0.5]]


def test_packed_does_not_modify_inputs() -> None:
    codes, scale = mx.array([[0x38, 0x40]], dtype=mx.uint8), mx.array([3.0])
    x = mx.array([[1.5, -2.0]])
    fqm.MlxFP8PackedLinear(codes, scale)(x)
    assert codes.tolist() == [[0x38, 0x40]] and scale.tolist() == [3.0]
    assert x.tolist() == [[1.5, -2.0]]


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"qweight": mx.zeros((2, 4), dtype=mx.int8)}, TypeError, "uint8 FP8 bytes"),
        ({"qweight": np.zeros((2, 4), np.uint8)}, TypeError, "uint8 FP8 bytes, got ndarray"),
        ({"qweight": mx.zeros((4,), dtype=mx.uint8)}, ValueError, r"2-D \(out, in\)"),
        ({"qweight": mx.zeros((0, 4), dtype=mx.uint8)}, ValueError, "non-empty"),
        ({"scale_inv": mx.ones((2,), dtype=mx.float16)}, TypeError, "scale_inv must be"),
        ({"scale_inv": mx.ones((3,))}, ValueError, r"scale_inv shape \(3,\) fits no layout"),
        ({"scale_inv": mx.ones((2, 3))}, ValueError, r"scale_inv shape \(2, 3\)"),
        ({"scale_inv": mx.ones((1,))}, ValueError, r"scale_inv shape \(1,\)"),
        ({"scale_inv": mx.array([1.0, 0.0])}, ValueError, "positive and finite"),
        ({"scale_inv": mx.array([1.0, -1.0])}, ValueError, "positive and finite"),
        ({"scale_inv": mx.array(float("inf"))}, ValueError, "positive and finite"),
        ({"scale_inv": mx.array([float("nan"), 1.0])}, ValueError, "positive and finite"),
        ({"bias": mx.ones((3,))}, ValueError, r"bias must have shape \(2,\)"),
        ({"bias": mx.ones((2,), dtype=mx.int32)}, TypeError, "bias must be None or"),
        ({"bias": mx.array([1.0, float("nan")])}, ValueError, "bias contains NaN"),
        ({"format": "float8_e8m0fnu"}, ValueError, "e8m0"),
        ({"format": "int8"}, ValueError, "unsupported FP8 format"),
    ],
)
def test_packed_constructor_errors(kwargs: dict, error: type, match: str) -> None:
    args = {"qweight": mx.zeros((2, 4), dtype=mx.uint8), "scale_inv": mx.ones((2,))} | kwargs
    with production_checks(), pytest.raises(error, match=match):
        fqm.MlxFP8PackedLinear(**args)


def _layers(inp: int) -> list:
    packed = fqm.MlxFP8PackedLinear(mx.zeros((2, inp), dtype=mx.uint8), mx.ones((2,)))
    return [packed, fqm.MlxFP8Linear.from_packed(packed)]


@pytest.mark.parametrize(
    ("x", "error", "match"),
    [
        (mx.ones((2, 33)), ValueError, r"x must have shape \(\.\.\., 32\), got \(2, 33\)"),
        (mx.ones((32, 2)), ValueError, r"x must have shape \(\.\.\., 32\), got \(32, 2\)"),
        (mx.ones(()), ValueError, r"x must have shape \(\.\.\., 32\), got \(\)"),
        (mx.ones((2, 32), dtype=mx.int32), TypeError, "x must be an MLX float16"),
        (mx.ones((2, 32), dtype=mx.float64), TypeError, "x must be an MLX float16"),
        (np.ones((2, 32), np.float32), TypeError, "got ndarray"),
    ],
)
def test_call_errors(x: object, error: type, match: str) -> None:
    for layer in _layers(32):
        with production_checks(), pytest.raises(error, match=match):
            layer(x)


def test_from_torch_errors() -> None:
    with production_checks(), pytest.raises(TypeError, match="must be a TorchFP8Linear"):
        fqm.MlxFP8PackedLinear.from_torch(nn.Linear(4, 4))
    conv = TorchFP8Linear.from_linear(nn.Conv1d(2, 4, 3))
    with pytest.raises(ValueError, match="flattened convolution"):
        fqm.MlxFP8PackedLinear.from_torch(conv)
    lora = _torch_layer(4, 8, fmt="float8_e4m3fn", method="row")
    lora.adapter = lambda x, out: out
    with pytest.raises(ValueError, match="LoRA adapter"):
        fqm.MlxFP8PackedLinear.from_torch(lora)
    e8m0 = TorchFP8Linear(8, 4, format="float8_e8m0fnu")
    with pytest.raises(ValueError, match="e8m0"):
        fqm.MlxFP8PackedLinear.from_torch(e8m0)


# ----------------------------------------------------------------------------------------------
# MlxFP8Linear (native mxfp8)
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("method", ["tensor", "row"])
@pytest.mark.parametrize(("out", "inp"), [(1, 32), (6, 64), (17, 96)])
@pytest.mark.parametrize("bias", [True, False])
def test_native_matches_torch_reference_and_packed(
    method: str, out: int, inp: int, bias: bool
) -> None:
    layer = _torch_layer(out, inp, fmt="float8_e4m3fn", method=method, bias=bias, seed=out)
    assert fqm.MlxFP8Linear.eligibility(layer) is None
    native = fqm.MlxFP8Linear.from_torch(layer)
    packed = fqm.MlxFP8PackedLinear.from_torch(layer)
    assert ("bias" in native) is bias
    for i, (lead, dtype) in enumerate(zip(LEADING, [*MX_DTYPES, "float32"], strict=True)):
        x = _x(lead, inp, dtype, seed=i)
        got = native(x)
        _assert_matches_reference(got, x, layer)
        _assert_matches_reference(packed(x), x, layer)


def test_native_layout_keeps_bytes_with_unit_group_scales() -> None:
    layer = _torch_layer(5, 96, fmt="float8_e4m3fn", method="row")
    native = fqm.MlxFP8Linear.from_torch(layer)
    q = native.linear
    assert (q.group_size, q.bits, q.mode) == (32, 8, "mxfp8")
    assert q.weight.dtype == mx.uint32 and q.weight.shape == (5, 24)
    assert q.scales.dtype == mx.uint8 and q.scales.shape == (5, 3)
    assert np.array(q.scales).tolist() == [[127] * 3] * 5
    codes = layer.weight.view(torch.uint8).numpy()
    np.testing.assert_array_equal(np.array(q.weight).view(np.uint8), codes)
    # MLX's own decode of the packed codes is the table decode of the bytes, value for value.
    decoded = mx.dequantize(
        q.weight, q.scales, group_size=32, bits=8, mode="mxfp8", dtype=mx.float32
    )
    want = np.array(fqm.fp8_decode_table("float8_e4m3fn"))[codes]
    np.testing.assert_array_equal(np.array(decoded), want)


def test_native_unscaled_sum_does_not_overflow_fp16() -> None:
    """448 * 60000 * 32 is far past FP16's range; divided by the scale it fits again."""
    codes = mx.full((2, 32), 0x7E, dtype=mx.uint8)  # 448
    packed = fqm.MlxFP8PackedLinear(codes, mx.array([2.0**20, 2.0**21]))
    native = fqm.MlxFP8Linear.from_packed(packed)
    x = mx.full((1, 32), 60000.0, dtype=mx.float16)
    want = 448 * 60000 * 32 / np.array([2.0**20, 2.0**21])
    for layer in (native, packed):
        y = layer(x)
        assert y.dtype == mx.float16
        np.testing.assert_allclose(np.array(y.astype(mx.float32))[0], want, rtol=2.0**-10)


def test_native_doc_example() -> None:
    codes = mx.array([[0x38] * 32], dtype=mx.uint8)
    native = fqm.MlxFP8Linear.from_packed(fqm.MlxFP8PackedLinear(codes, mx.array([4.0])))
    assert native(mx.ones((1, 32))).tolist() == [[8.0]]


def _packed(**kwargs: object) -> "fqm.MlxFP8PackedLinear":
    args: dict = {
        "qweight": mx.full((2, 64), 0x38, dtype=mx.uint8),
        "scale_inv": mx.array([1.0, 2.0]),
        "format": "float8_e4m3fn",
    } | kwargs
    return fqm.MlxFP8PackedLinear(args.pop("qweight"), args.pop("scale_inv"), **args)


@pytest.mark.parametrize(
    ("kwargs", "reason"),
    [
        ({}, None),
        ({"scale_inv": mx.array(3.0)}, None),
        ({"format": "float8_e5m2"}, "format is float8_e5m2"),
        ({"format": "float8_e4m3fnuz"}, "format is float8_e4m3fnuz"),
        ({"scale_inv": mx.ones((1, 2))}, "block scales"),
        ({"qweight": mx.full((2, 48), 0x38, dtype=mx.uint8)}, "in_features 48 is not a multiple"),
        ({"scale_inv": mx.array([1.0, 2.0**-149])}, "finite reciprocals"),
        ({"qweight": mx.full((2, 64), 0x7F, dtype=mx.uint8)}, "NaN codes"),
        ({"qweight": mx.full((2, 64), 0xFF, dtype=mx.uint8)}, "NaN codes"),
    ],
)
def test_eligibility_rules(kwargs: dict, reason: str | None) -> None:
    packed = _packed(**kwargs)
    got = fqm.MlxFP8Linear.eligibility(packed)
    if reason is None:
        assert got is None
        fqm.MlxFP8Linear.from_packed(packed)
    else:
        assert got is not None and reason in got
        with pytest.raises(ValueError, match="cannot use mxfp8 exactly"):
            fqm.MlxFP8Linear.from_packed(packed)


def test_eligibility_of_torch_modules() -> None:
    ok = _torch_layer(4, 64, fmt="float8_e4m3fn", method="tensor")
    assert fqm.MlxFP8Linear.eligibility(ok) is None
    block = _torch_layer(4, 64, fmt="float8_e4m3fn", method="block", block=(2, 32))
    assert "block scales" in fqm.MlxFP8Linear.eligibility(block)
    e5m2 = _torch_layer(4, 64, fmt="float8_e5m2", method="row")
    assert "format is float8_e5m2" in fqm.MlxFP8Linear.eligibility(e5m2)
    conv = TorchFP8Linear.from_linear(nn.Conv1d(32, 4, 1))
    assert "convolution" in fqm.MlxFP8Linear.eligibility(conv)
    assert "e8m0" in fqm.MlxFP8Linear.eligibility(TorchFP8Linear(64, 4, format="e8m0"))
    with pytest.raises(ValueError, match="in_features 40"):
        fqm.MlxFP8Linear.from_torch(_torch_layer(4, 40, fmt="float8_e4m3fn", method="row"))
    with production_checks(), pytest.raises(TypeError, match="must be a TorchFP8Linear"):
        fqm.MlxFP8Linear.eligibility(nn.Linear(32, 4))
    with production_checks(), pytest.raises(TypeError, match="must be an MlxFP8PackedLinear"):
        fqm.MlxFP8Linear.from_packed(ok)


def test_package_exports_linears() -> None:
    for name in ("MlxFP8Linear", "MlxFP8PackedLinear", "fp8_decode_table"):
        assert name in fqm.__all__ and getattr(fqm, name) is not None
