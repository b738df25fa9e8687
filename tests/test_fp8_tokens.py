"""Per-token E4M3 activations (``docs/numerics.md``) against the numpy/ml_dtypes oracle."""

import pytest
import torch

import floatxq as fq
from floatxq.testing import assert_bitwise_equal, unchecked
from floatxq.testing.reference import ref_fp8_token_qdq


def _tokens(seed: int, rows: int = 64, k: int = 96) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=g) * torch.exp2(
        torch.randint(-40, 40, (rows, 1), generator=g)
    )
    x[0] = 0.0  # all-zero row: scale 1
    x[1] = 0.0
    x[1, 3] = 2.0**-149  # amax / 448 underflows to 0: smallest positive scale
    x[2] = 0.0
    x[2, :4] = torch.tensor([1e-38, -5e-39, 2.0**-140, 0.0])
    return x


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_qdq_matches_reference(dtype):
    x = _tokens(0).clamp(-6e4, 6e4).to(dtype)
    got = fq.fp8_token_qdq(x)
    assert got.dtype == dtype and got.shape == x.shape
    assert_bitwise_equal(got, ref_fp8_token_qdq(x))
    assert torch.isfinite(got).all()


def test_quantize_record_and_batch_axes():
    x = _tokens(1).reshape(4, 16, 96)
    t = fq.fp8_token_quantize(x)
    assert t.codes.dtype == torch.float8_e4m3fn and t.codes.shape == (4, 16, 96)
    assert t.scale.dtype == torch.float32 and t.scale.shape == (4, 16, 1)
    flat = x.reshape(64, 96)
    amax = flat.abs().amax(dim=1)
    expected = torch.where(amax > 0, amax / 448, torch.ones_like(amax))
    expected[1] = 2.0**-149
    assert_bitwise_equal(t.scale.reshape(64), expected)
    assert_bitwise_equal(
        fq.fp8_token_dequantize(*t, dtype=torch.bfloat16), fq.fp8_token_dequantize(*t).bfloat16()
    )
    assert_bitwise_equal(fq.fp8_token_dequantize(*t), fq.fp8_token_qdq(x))


def test_division_not_reciprocal_multiply():
    # x / (13/448) is the E4M3 tie 0.65625 (-> 0.625); multiplying by the FP32 reciprocal of the
    # scale lands one ulp above the tie (-> 0.6875). The contract divides.
    x = torch.tensor([[13.0, 0.01904296875]])
    t = fq.fp8_token_quantize(x)
    assert t.codes.float().tolist() == [[448.0, 0.625]]


def test_hand_values():
    x = torch.tensor([[1.0, -4.0, 0.0], [0.0, 0.0, 0.0]])
    t = fq.fp8_token_quantize(x)
    assert t.codes.float().tolist() == [[112.0, -448.0, 0.0], [0.0, 0.0, 0.0]]
    assert t.scale[1].item() == 1.0
    assert fq.fp8_token_qdq(x).tolist() == x.tolist()


def test_empty_inputs_returned_unchanged():
    for shape in [(0, 16), (3, 0), (2, 0, 4)]:
        x = torch.empty(shape, dtype=torch.bfloat16)
        assert fq.fp8_token_qdq(x) is x
    t = fq.fp8_token_quantize(torch.empty(3, 0))
    assert t.codes.shape == (3, 0) and t.scale.shape == (3, 1)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_rejected(bad):
    x = torch.ones(2, 4)
    x[1, 2] = bad
    for fn in (fq.fp8_token_qdq, fq.fp8_token_quantize):
        with pytest.raises(ValueError, match="NaN or infinity"):
            fn(x)


def test_wrong_kinds():
    with pytest.raises(TypeError, match="floating-point"):
        unchecked(fq.fp8_token_qdq)(torch.ones(2, 2, dtype=torch.int64))
    with pytest.raises(ValueError, match="at least one axis"):
        unchecked(fq.fp8_token_quantize)(torch.tensor(1.0))
