"""Exhaustive tables: every FP8 code, every midpoint, every bf16 input, against ml_dtypes."""

import ml_dtypes
import numpy as np
import pytest
import torch

import floatxq as fq
from floatxq.testing import assert_bitwise_equal
from floatxq.testing.reference import ML_DTYPES, ml_decode_codes, ml_encode

CODES = torch.arange(256, dtype=torch.int32).to(torch.uint8)
ENCODABLE = ["float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz"]


def _as_f32(values: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(values.astype(np.float32))


@pytest.mark.parametrize("name", ENCODABLE)
def test_decode_every_code_matches_ml_dtypes(name):
    decoded = fq.fp8_decode(CODES.view(fq.fp8_dtype(name)))
    assert_bitwise_equal(decoded, _as_f32(ml_decode_codes(CODES.numpy(), name)), msg=name)


def test_decode_every_e8m0_byte_matches_ml_dtypes():
    expected = _as_f32(ml_decode_codes(CODES.numpy(), "float8_e8m0fnu"))
    assert_bitwise_equal(fq.decode_e8m0(CODES), expected, msg="uint8 storage")
    assert_bitwise_equal(fq.decode_e8m0(CODES.view(torch.float8_e8m0fnu)), expected, msg="dtype")
    assert_bitwise_equal(
        fq.fp8_decode(CODES.view(torch.float8_e8m0fnu)), expected, msg="fp8_decode"
    )
    # the named corners: byte 0 is the FP32 subnormal 2**-127, 127 is 1, 254 is 2**127, 255 NaN
    assert fq.decode_e8m0(torch.tensor([0, 127, 254], dtype=torch.uint8)).tolist() == [
        2.0**-127,
        1.0,
        2.0**127,
    ]
    assert torch.isnan(fq.decode_e8m0(torch.tensor([255], dtype=torch.uint8))).all()


def test_decode_e8m0_rejects_other_dtypes():
    with pytest.raises(TypeError, match="uint8 or float8_e8m0fnu"):
        fq.decode_e8m0(torch.zeros(3, dtype=torch.int32))


@pytest.mark.parametrize("name", ENCODABLE)
def test_every_finite_code_round_trips_through_fp8_cast(name):
    dtype = fq.fp8_dtype(name)
    values = fq.fp8_decode(CODES.view(dtype))
    finite = torch.isfinite(values)
    back = fq.fp8_cast(values[finite], format=name).view(torch.uint8)
    codes = CODES[finite]
    if name.endswith("fnuz"):  # no negative zero: 0x80 is NaN there
        assert not bool(finite[0x80])
    assert_bitwise_equal(back, codes, msg=name)


def _ordered_positive_codes(name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Positive finite codes sorted by value (0 first) and their FP32 values."""
    dtype = fq.fp8_dtype(name)
    values = fq.fp8_decode(CODES.view(dtype))
    keep = torch.isfinite(values) & (values >= 0) & ~torch.signbit(values)
    codes, vals = CODES[keep], values[keep]
    order = torch.argsort(vals)
    return codes[order], vals[order]


@pytest.mark.parametrize("name", ENCODABLE)
def test_midpoints_round_to_even_code(name):
    codes, vals = _ordered_positive_codes(name)
    assert bool((vals[1:] > vals[:-1]).all()), "decoded values must be strictly increasing"
    lo, hi = vals[:-1].double(), vals[1:].double()
    mid = ((lo + hi) / 2).to(torch.float32)
    assert torch.equal(mid.double(), (lo + hi) / 2), "FP8 midpoints are exact in FP32"
    even_code = torch.where(codes[:-1] % 2 == 0, codes[:-1], codes[1:])
    for sign in (1.0, -1.0):
        got = fq.fp8_cast(sign * mid, format=name).view(torch.uint8)
        expected = even_code if sign > 0 else even_code | 0x80
        if sign < 0 and name.endswith("fnuz"):  # -0 does not exist there: it rounds to +0
            expected = torch.where(even_code == 0, even_code, expected)
        assert_bitwise_equal(got, expected, msg=f"{name} sign {sign}")
    # one FP32 ulp either side of a midpoint goes to the nearer neighbour
    above = fq.fp8_cast(torch.nextafter(mid, torch.full_like(mid, np.inf)), format=name)
    below = fq.fp8_cast(torch.nextafter(mid, torch.zeros_like(mid)), format=name)
    assert_bitwise_equal(above.view(torch.uint8), codes[1:], msg=f"{name} above")
    assert_bitwise_equal(below.view(torch.uint8), codes[:-1], msg=f"{name} below")


@pytest.mark.parametrize("name", ENCODABLE)
def test_every_bf16_input_matches_ml_dtypes_with_saturation(name):
    bf16 = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    as_f32 = bf16.to(torch.float32)
    finite = torch.isfinite(as_f32)
    got = fq.fp8_cast(bf16[finite], format=name).view(torch.uint8)
    expected = torch.from_numpy(ml_encode(as_f32[finite].numpy(), name))
    assert_bitwise_equal(got, expected, msg=name)


@pytest.mark.parametrize("name", ENCODABLE)
def test_saturation_and_nan_policy(name):
    fmax = fq.fp8_max(name)
    x = torch.tensor([np.inf, -np.inf, 1e30, -1e30, fmax * 1.0625, np.nan])
    got = fq.fp8_cast(x, format=name).float()
    assert got[:5].tolist() == [fmax, -fmax, fmax, -fmax, fmax]
    assert torch.isnan(got[5])


@pytest.mark.parametrize("name", [*ENCODABLE, "float8_e8m0fnu"])
def test_fp8_max_matches_both_libraries(name):
    assert fq.fp8_max(name) == float(torch.finfo(fq.fp8_dtype(name)).max)
    assert fq.fp8_max(name) == float(ml_dtypes.finfo(ML_DTYPES[name]).max)


def test_fp8_cast_rejects_e8m0():
    with pytest.raises(ValueError, match="decode-only"):
        fq.fp8_cast(torch.ones(2), format="e8m0")
