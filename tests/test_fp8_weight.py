"""FP8 weights with inverse scales (``docs/numerics.md``), against the numpy/ml_dtypes oracle."""

import numpy as np
import pytest
import torch

import floatxq as fq
from floatxq.testing import assert_bitwise_equal, unchecked
from floatxq.testing.reference import ref_quantize_fp8_weight

ENCODABLE = ["float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz"]
LAYOUTS = [
    ("tensor", None),
    ("row", None),
    ("block", (4, 8)),
    ("block", (16, 16)),
    ("block", (1, 32)),
]


def _weight(seed: int, rows: int = 32, cols: int = 64, dtype=torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, cols, generator=g) * torch.exp2(
        torch.randint(-30, 30, (rows, 1), generator=g)
    )
    w[3, :] = 0.0  # an all-zero row
    w[5, 7] = 2.0**-140  # a denormal-only region in row 5 of the block layouts
    w[5, :7] = 0.0
    w[5, 8:] = 0.0
    return w.to(dtype)


@pytest.mark.parametrize("name", ENCODABLE)
@pytest.mark.parametrize(("method", "block"), LAYOUTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_matches_reference_bit_for_bit(name, method, block, dtype):
    w = _weight(7, dtype=dtype) if dtype != torch.float16 else _weight(7).clamp(-6e4, 6e4).half()
    got = fq.quantize_fp8_weight(
        w, format=name, weight_scale_method=method, weight_block_size=block
    )
    codes, scale_inv = ref_quantize_fp8_weight(w, name=name, method=method, block=block)
    assert_bitwise_equal(got.qweight, codes, msg="codes")
    assert_bitwise_equal(got.scale_inv, scale_inv, msg="scale_inv")


@pytest.mark.parametrize(
    ("method", "block", "shape"),
    [
        ("tensor", None, ()),
        ("row", None, (32,)),
        ("block", [8, 16], (4, 4)),
        (None, (32, 64), (1, 1)),
    ],
)
def test_scale_shapes_and_dtypes(method, block, shape):
    q = fq.quantize_fp8_weight(_weight(1), weight_scale_method=method, weight_block_size=block)
    assert q.scale_inv.shape == shape and q.scale_inv.dtype == torch.float32
    assert q.qweight.shape == (32, 64) and q.qweight.dtype == torch.float8_e4m3fn


def test_scale_formula_by_hand():
    w = torch.tensor([[1.0, -2.0, 0.5], [0.0, 0.0, 0.0], [3.0, 1e-3, -448.0]])
    q = fq.quantize_fp8_weight(w)
    assert q.scale_inv.tolist() == [224.0, 1.0, 1.0]
    assert q.qweight.float().tolist() == [
        [224.0, -448.0, 112.0],
        [0, 0, 0],
        [3.0, 0.001953125, -448],
    ]
    # a single tensor scale takes the global amax (448): scale_inv = 1
    assert fq.quantize_fp8_weight(w, weight_scale_method="tensor").scale_inv.item() == 1.0


def test_tiny_amax_keeps_finite_scale_and_no_nan():
    # GPT-QModel divides 448 by amax = 1e-38 to inf and writes NaN codes (0 * inf); floatxq caps it
    w = torch.tensor([[1e-38, 0.0, -5e-39], [2.0**-149, 0.0, 0.0]])
    q = fq.quantize_fp8_weight(w)
    assert torch.isfinite(q.scale_inv).all() and (q.scale_inv > 0).all()
    assert q.scale_inv.tolist() == [fq.FLOAT32_MAX, fq.FLOAT32_MAX]
    codes = q.qweight.float()
    assert not torch.isnan(codes).any()
    assert codes[0, 1] == 0 and codes[1, 1] == 0
    back = fq.dequantize_fp8_weight(*q)
    assert torch.isfinite(back).all() and torch.signbit(back[0, 2])


def test_dequantize_layouts_and_transpose():
    w = _weight(3)
    for method, block in LAYOUTS:
        q = fq.quantize_fp8_weight(w, weight_scale_method=method, weight_block_size=block)
        d = fq.dequantize_fp8_weight(q.qweight, q.scale_inv)
        assert d.dtype == torch.float32 and d.shape == w.shape
        # codes / expanded scale, computed here by broadcasting region by region
        if method == "tensor":
            expanded = q.scale_inv.expand(w.shape)
        elif method == "row":
            expanded = q.scale_inv[:, None].expand(w.shape)
        else:
            br, bc = block
            expanded = q.scale_inv.reshape(32 // br, 1, 64 // bc, 1).expand(
                32 // br, br, 64 // bc, bc
            )
            expanded = expanded.reshape(w.shape)
        assert_bitwise_equal(d, q.qweight.float() / expanded)
        t = fq.dequantize_fp8_weight_transposed(q.qweight, q.scale_inv, dtype=torch.bfloat16)
        assert t.is_contiguous() and t.shape == (64, 32)
        assert_bitwise_equal(t, d.to(torch.bfloat16).t().contiguous())


def test_empty_and_degenerate_shapes():
    for rows, cols in [(0, 8), (4, 0), (0, 0)]:
        w = torch.zeros(rows, cols)
        q = fq.quantize_fp8_weight(w)
        assert q.qweight.shape == (rows, cols) and q.scale_inv.shape == (rows,)
        assert (q.scale_inv == 1).all()
        t = fq.quantize_fp8_weight(w, weight_scale_method="tensor")
        assert t.scale_inv.item() == 1.0
    q = fq.quantize_fp8_weight(
        torch.zeros(0, 8), weight_block_size=[4, 4], weight_scale_method="block"
    )
    assert q.scale_inv.shape == (0, 2)


def test_input_not_mutated_and_device_kept():
    w = _weight(5)
    before = w.clone()
    q = fq.quantize_fp8_weight(w, weight_scale_method="block", weight_block_size=[8, 8])
    assert_bitwise_equal(w, before)
    assert q.qweight.device == w.device and q.scale_inv.device == w.device


@pytest.mark.parametrize(
    ("kwargs", "weight", "error", "match"),
    [
        ({}, torch.ones(4), ValueError, "2-D"),
        ({}, torch.ones(2, 2, 2), ValueError, "2-D"),
        ({"format": "e8m0"}, torch.ones(2, 2), ValueError, "decode-only"),
        ({"format": "e3m4"}, torch.ones(2, 2), ValueError, "unsupported FP8 format"),
        ({"weight_scale_method": "block"}, torch.ones(2, 2), ValueError, "needs weight_block_size"),
        ({"weight_block_size": [2, 2]}, torch.ones(4, 4), ValueError, "only valid with"),
        (
            {"weight_scale_method": "block", "weight_block_size": [3, 2]},
            torch.ones(4, 4),
            ValueError,
            "not divisible",
        ),
        ({}, torch.tensor([[1.0, float("nan")]]), ValueError, "NaN or infinity"),
        ({}, torch.tensor([[1.0, float("inf")]]), ValueError, "NaN or infinity"),
        ({}, torch.ones(2, 2, dtype=torch.int32), TypeError, "floating-point"),
    ],
)
def test_errors(kwargs, weight, error, match):
    # the library's own checks, as production (no type-check hook) runs them
    with pytest.raises(error, match=match):
        unchecked(fq.quantize_fp8_weight)(weight, **kwargs)


def test_type_hook_rejects_wrong_rank_in_tests():
    with pytest.raises(TypeError):
        fq.quantize_fp8_weight(torch.ones(4))


@pytest.mark.parametrize(
    ("weight_shape", "scale_shape", "expected"),
    [
        ((8, 16), (), ("tensor", None)),
        ((8, 16), (1,), ("tensor", None)),
        ((8, 16), (1, 1), ("tensor", None)),
        ((8, 16), (8,), ("row", None)),
        ((256, 512), (2, 4), ("block", (128, 128))),
        ((8, 16), (8, 16), ("block", (1, 1))),
        ((8, 16), (8, 1), ("block", (1, 16))),
        # 1-D of another length: the most square tiling (8 blocks of a 128x256 -> 64x64)
        ((128, 256), (8,), ("block", (64, 64))),
    ],
)
def test_infer_scale_layout(weight_shape, scale_shape, expected):
    assert fq.infer_scale_layout(weight_shape, scale_shape) == expected


@pytest.mark.parametrize(
    ("weight_shape", "scale_shape"), [((8, 16), (3, 5)), ((8, 16), (7,)), ((8,), (1,))]
)
def test_infer_scale_layout_rejects(weight_shape, scale_shape):
    with pytest.raises(ValueError, match="infer_scale_layout"):
        fq.infer_scale_layout(weight_shape, scale_shape)


def test_direct_to_inverse_scale():
    s = torch.tensor([0.5, 3.0, 0.0, 1e-3])
    got = fq.direct_to_inverse_scale(s)
    with np.errstate(divide="ignore"):
        expected = np.float32(1) / s.numpy()
    expected[2] = np.float32(1) / np.finfo(np.float32).tiny
    assert_bitwise_equal(got, torch.from_numpy(expected.astype(np.float32)))
    assert got.dtype == torch.float32
    # a direct bf16 scale is widened first
    assert fq.direct_to_inverse_scale(torch.tensor([0.25], dtype=torch.bfloat16)).tolist() == [4.0]
    for bad in (torch.tensor([-1.0]), torch.tensor([float("nan")]), torch.tensor([float("inf")])):
        with pytest.raises(ValueError, match="direct_to_inverse_scale"):
            fq.direct_to_inverse_scale(bad)
    # 1 / 1e-40 overflows float32: such a direct scale has no finite inverse scale
    with pytest.raises(ValueError, match="overflows float32"):
        fq.direct_to_inverse_scale(torch.tensor([1.0, 1e-40]))
    smallest = torch.tensor([2.0**-127])  # the smallest direct scale with a finite inverse
    assert fq.direct_to_inverse_scale(smallest).item() == 2.0**127


def test_direct_scale_checkpoint_round_trip():
    """A direct-scale checkpoint (w = code * scale) decodes the same after the conversion."""
    q = fq.quantize_fp8_weight(_weight(11)[6:], weight_scale_method="row")
    direct = 1.0 / q.scale_inv.double()  # what a direct-scale exporter would store
    inv = fq.direct_to_inverse_scale(direct.float())
    np.testing.assert_allclose(inv.numpy(), q.scale_inv.numpy(), rtol=2**-23)
