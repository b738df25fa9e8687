"""The MLX FP8 weight encoder gives the torch encoder's bytes and scales, bit for bit."""

import sys

import numpy as np
import pytest
import torch

mx = pytest.importorskip("mlx.core")

import floatxq as fq  # noqa: E402
import floatxq.mlx as fqm  # noqa: E402
from floatxq.formats import fp8_max  # noqa: E402
from floatxq.testing import production_checks  # noqa: E402

ENCODABLE = ["float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz"]
LAYOUTS = [
    ("tensor", None),
    ("row", None),
    ("block", (1, 1)),
    ("block", (2, 3)),
    ("block", (4, 8)),
    ("block", (1, 32)),
]
MX_DTYPES = {"float32": "float32", "float16": "float16", "bfloat16": "bfloat16"}


def _mx(w: torch.Tensor) -> "mx.array":
    """The MLX array holding exactly ``w``'s values (float32 via numpy, then cast in MLX)."""
    name = str(w.dtype).removeprefix("torch.")
    return mx.array(w.to(torch.float32).numpy()).astype(getattr(mx, name))


def _assert_same(w: torch.Tensor, **kwargs: object) -> None:
    """Quantize ``w`` with both encoders; assert equal bytes and bitwise-equal scales."""
    ref = fq.quantize_fp8_weight(w, **kwargs)
    got = fqm.quantize_fp8_weight_mlx(_mx(w), **kwargs)
    assert got.qweight.dtype == mx.uint8 and got.scale_inv.dtype == mx.float32
    want_codes = ref.qweight.view(torch.uint8).numpy()
    got_codes = np.array(got.qweight)
    bad = np.argwhere(want_codes != got_codes)
    assert bad.size == 0, (
        f"{kwargs}: {len(bad)} byte(s) differ, first at {bad[0].tolist()}: "
        f"torch {want_codes[tuple(bad[0])]:#04x} mlx {got_codes[tuple(bad[0])]:#04x}"
    )
    want_scale = ref.scale_inv.numpy().view(np.uint32)
    got_scale = np.array(got.scale_inv).view(np.uint32)
    assert got_scale.shape == want_scale.shape
    np.testing.assert_array_equal(got_scale, want_scale)


def _fuzzed(seed: int, rows: int, cols: int, spread: int = 40) -> torch.Tensor:
    """Row magnitudes spread over 2**±spread, an all-zero row, -0s and a subnormal-only row."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, cols, generator=g) * torch.exp2(
        torch.randint(-spread, spread, (rows, 1), generator=g).float()
    )
    if rows > 2:
        w[1] = 0.0
        w[2] = -w[2].abs() * 2.0**-170  # FP32 subnormals only (and some -0)
    if rows * cols > 3:
        w.view(-1)[3] = -0.0
    return w


# ----------------------------------------------------------------------------------------------
# Same bytes as quantize_fp8_weight
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", ENCODABLE)
@pytest.mark.parametrize(("method", "block"), LAYOUTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_fuzzed_shapes_match_torch(fmt: str, method: str, block, dtype: torch.dtype) -> None:
    br, bc = block or (1, 1)
    for seed, (rows, cols) in enumerate([(1, 1), (3, 5), (7, 13), (12, 96), (1, 64)]):
        rows, cols = rows * br, cols * bc  # every shape divisible by the block
        spread = 10 if dtype == torch.float16 else 40  # float16 overflows beyond 65504
        w = _fuzzed(seed, rows, cols, spread).to(dtype)
        _assert_same(w, format=fmt, weight_scale_method=method, weight_block_size=block)


@pytest.mark.parametrize("fmt", ENCODABLE)
def test_defaults_match_torch(fmt: str) -> None:
    w = _fuzzed(7, 9, 17)
    _assert_same(w)
    _assert_same(w, format=fmt, weight_scale_method=None)  # None without a block size: row
    _assert_same(w, format=fmt, weight_scale_method=None, weight_block_size=[3, 17])


@pytest.mark.parametrize("fmt", ENCODABLE)
def test_every_grid_point_and_tie(fmt: str) -> None:
    """With scale_inv = 1 (the tensor holds ±fp8_max), values reach the encoder unchanged: every
    code, every midpoint between neighbouring codes (ties), and their FP32 neighbours."""
    fp8 = getattr(torch, fmt)
    grid = torch.arange(256, dtype=torch.uint8).view(fp8).float()
    grid = grid[torch.isfinite(grid)].unique()  # sorted, -0 and +0 merged
    mids = (grid[1:] + grid[:-1]) / 2  # exact in FP32: FP8 has far fewer mantissa bits
    pts = torch.cat([grid, mids, torch.tensor([-0.0, 0.0])])
    up = torch.nextafter(pts, torch.tensor(float("inf")))
    down = torch.nextafter(pts, torch.tensor(float("-inf")))
    values = torch.cat([pts, up, down]).clamp(-fp8_max(fmt), fp8_max(fmt))
    w = values[None, :]
    assert float(w.abs().max()) == fp8_max(fmt)
    _assert_same(w, format=fmt, weight_scale_method="tensor")
    q = fqm.quantize_fp8_weight_mlx(_mx(w), format=fmt, weight_scale_method="tensor")
    assert q.scale_inv.item() == 1.0


@pytest.mark.parametrize("fmt", ENCODABLE)
def test_signed_zeros(fmt: str) -> None:
    w = torch.tensor([[-0.0, 0.0, 1.0, -1e-30], [-0.0, -0.0, 0.0, 0.0]])
    _assert_same(w, format=fmt, weight_scale_method="row")
    codes = np.array(fqm.quantize_fp8_weight_mlx(_mx(w), format=fmt).qweight)
    negative_zero = 0x00 if fmt.endswith("fnuz") else 0x80  # fnuz: 0x80 is NaN, -0 is +0
    assert codes[0, 0] == negative_zero and codes[0, 3] == negative_zero
    assert codes[1].tolist() == [negative_zero, negative_zero, 0, 0]


@pytest.mark.parametrize("fmt", ENCODABLE)
def test_saturation_boundary(fmt: str) -> None:
    """Products that round just past ±fp8_max clamp to the largest finite code, never NaN."""
    fmax = fp8_max(fmt)
    g = torch.Generator().manual_seed(3)
    amax = torch.rand(64, 1, generator=g) * 1e3 + 1e-3
    near = amax * torch.tensor([1.0, -1.0, 0.9999999, -0.99999994, 0.5])
    w = torch.cat([amax, near], dim=1)
    _assert_same(w, format=fmt, weight_scale_method="row")
    codes = np.array(fqm.quantize_fp8_weight_mlx(_mx(w), format=fmt).qweight)
    top = fq.fp8_cast(torch.tensor([fmax, -fmax]), format=fmt).view(torch.uint8).tolist()
    assert (codes[:, :2] == top[0]).all() and (codes[:, 2] == top[1]).all()


@pytest.mark.parametrize("fmt", ENCODABLE)
@pytest.mark.parametrize("method", ["tensor", "row"])
def test_tiny_and_subnormal_regions(fmt: str, method: str) -> None:
    """amax below FLT_MIN: the inverse scale is capped at FLT_MAX (finite), codes still match."""
    w = torch.tensor(
        [
            [2.0**-149, -(2.0**-149), 3 * 2.0**-149, 0.0],
            [2.0**-130, -(2.0**-127), 2.0**-140, -0.0],
            [2.0**-126, 2.0**-149, -(2.0**-126), 1.5 * 2.0**-126],
            [1.0, 2.0**-149, -(2.0**-133), 2.0**-100],
        ]
    )
    _assert_same(w, format=fmt, weight_scale_method=method)
    _assert_same(w, format=fmt, weight_scale_method="block", weight_block_size=(2, 2))


@pytest.mark.parametrize("fmt", ENCODABLE)
def test_random_fp32_bit_patterns(fmt: str) -> None:
    """Finite FP32 values of every exponent, subnormals included, per row and per block."""
    rng = np.random.default_rng(11)
    bits = rng.integers(0, 2**32, size=(64, 96), dtype=np.uint64).astype(np.uint32)
    values = bits.view(np.float32).copy()
    values[~np.isfinite(values)] = 0.0
    w = torch.from_numpy(values)
    _assert_same(w, format=fmt, weight_scale_method="row")
    _assert_same(w, format=fmt, weight_scale_method="tensor")
    _assert_same(w, format=fmt, weight_scale_method="block", weight_block_size=(8, 4))


@pytest.mark.parametrize("fmt", ENCODABLE)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_every_half_precision_value(fmt: str, dtype: torch.dtype) -> None:
    """All 65,536 fp16 / bf16 bit patterns (non-finite ones zeroed) in a 256 x 256 matrix."""
    w = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(dtype)
    w = torch.where(torch.isfinite(w), w, torch.zeros_like(w)).reshape(256, 256)
    _assert_same(w, format=fmt, weight_scale_method="row")
    _assert_same(w, format=fmt, weight_scale_method="block", weight_block_size=(16, 32))


def test_input_is_not_modified() -> None:
    w = _mx(_fuzzed(5, 6, 10))
    before = np.array(w).copy()
    fqm.quantize_fp8_weight_mlx(w, format="e5m2", weight_scale_method="tensor")
    np.testing.assert_array_equal(np.array(w).view(np.uint32), before.view(np.uint32))


def test_doc_example_values() -> None:
    q = fqm.quantize_fp8_weight_mlx(mx.array([[1.0, -2.0], [0.0, 0.0]]))
    assert q.scale_inv.tolist() == [224.0, 1.0]
    assert q.qweight.tolist() == [[0x76, 0xFE], [0, 0]]  # 224 and -448 in E4M3FN
    assert q.qweight.shape == (2, 2) and q.scale_inv.shape == (2,)


# ----------------------------------------------------------------------------------------------
# Errors
# ----------------------------------------------------------------------------------------------


def test_missing_mlx_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without MLX the package still imports; its names then raise an ImportError that says so."""
    monkeypatch.setitem(sys.modules, "floatxq.mlx.fp8", None)  # as if mlx.core failed to import
    with pytest.raises(ImportError, match="needs MLX"):
        fqm.__getattr__("quantize_fp8_weight_mlx")


def test_package_surface() -> None:
    assert fqm.__all__ == [
        "MlxConversion",
        "MlxFP8Linear",
        "MlxFP8PackedLinear",
        "MlxFP8Weight",
        "convert_to_mlx",
        "fp8_decode_table",
        "fp8_encode_route",
        "quantize_fp8_weight_mlx",
    ]
    assert fqm.MlxFP8Weight._fields == ("qweight", "scale_inv")
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        _ = fqm.nope


@pytest.mark.parametrize(
    ("weight", "match"),
    [
        (np.ones((2, 2), np.float32), "must be an mlx.core.array, got ndarray"),
        (torch.ones(2, 2), "must be an mlx.core.array, got Tensor"),
        ([[1.0]], "must be an mlx.core.array, got list"),
        (mx.ones((2, 2), dtype=mx.int32), "float16, bfloat16 or float32 array, got dtype"),
        (mx.ones((2, 2), dtype=mx.uint8), "float16, bfloat16 or float32 array, got dtype"),
        (mx.ones((2, 2), dtype=mx.bool_), "float16, bfloat16 or float32 array, got dtype"),
        (mx.ones((2, 2), dtype=mx.float64), "float16, bfloat16 or float32 array, got dtype"),
        (mx.ones((2, 2), dtype=mx.complex64), "float16, bfloat16 or float32 array, got dtype"),
    ],
)
def test_weight_type_errors(weight: object, match: str) -> None:
    with production_checks(), pytest.raises(TypeError, match=match):
        fqm.quantize_fp8_weight_mlx(weight)


@pytest.mark.parametrize(
    ("weight", "match"),
    [
        (mx.ones((4,)), r"2-D \(out, in\) matrix, got shape \(4,\)"),
        (mx.ones((2, 2, 2)), r"2-D \(out, in\) matrix, got shape \(2, 2, 2\)"),
        (mx.ones(()), r"2-D \(out, in\) matrix, got shape \(\)"),
        (mx.ones((0, 4)), r"shape \(0, 4\) is empty"),
        (mx.ones((3, 0)), r"shape \(3, 0\) is empty"),
        (mx.array([[1.0, float("nan")]]), "NaN or infinity"),
        (mx.array([[1.0], [float("-inf")]]), "NaN or infinity"),
        (mx.array([[float("inf")]], dtype=mx.float16), "NaN or infinity"),
    ],
)
def test_weight_value_errors(weight: object, match: str) -> None:
    with production_checks(), pytest.raises(ValueError, match=match):
        fqm.quantize_fp8_weight_mlx(weight)


BAD_OPTIONS = [
    ({"format": "e8m0"}, ValueError, "decode-only"),
    ({"format": "float8_e8m0fnu"}, ValueError, "decode-only"),
    ({"format": "E8M0FNU"}, ValueError, "decode-only"),
    ({"format": "float16"}, ValueError, "unsupported FP8 format"),
    ({"format": 8}, TypeError, "format must be a string"),
    ({"weight_scale_method": "column"}, ValueError, "weight_scale_method: expected one of"),
    ({"weight_scale_method": 1}, ValueError, "weight_scale_method: expected one of"),
    ({"weight_scale_method": "block"}, ValueError, "needs weight_block_size"),
    ({"weight_block_size": (2, 2)}, ValueError, "only valid with weight_scale_method='block'"),
    ({"weight_scale_method": None, "weight_block_size": (4, 4)}, ValueError, "not divisible"),
    ({"weight_scale_method": "block", "weight_block_size": (3, 2)}, ValueError, "not divisible"),
    ({"weight_scale_method": "block", "weight_block_size": (2,)}, ValueError, "2-item"),
    ({"weight_scale_method": "block", "weight_block_size": (0, 2)}, ValueError, "positive"),
    ({"weight_scale_method": "block", "weight_block_size": (2, 1.5)}, ValueError, "positive"),
    ({"weight_scale_method": "block", "weight_block_size": (True, 2)}, ValueError, "a bool"),
    ({"weight_scale_method": "block", "weight_block_size": 2}, ValueError, "2-item"),
]


@pytest.mark.parametrize(("kwargs", "error", "match"), BAD_OPTIONS)
def test_option_errors_match_torch(kwargs: dict, error: type, match: str) -> None:
    """Every bad option is refused with the error type (and words) the torch encoder uses."""
    w = torch.ones(4, 6)
    with production_checks():
        with pytest.raises(error, match=match) as got:
            fqm.quantize_fp8_weight_mlx(_mx(w), **kwargs)
        with pytest.raises(error, match=match):
            fq.quantize_fp8_weight(w, **kwargs)
    assert "quantize_fp8_weight_mlx" in str(got.value) or "format" not in kwargs
