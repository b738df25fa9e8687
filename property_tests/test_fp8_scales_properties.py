"""FP8 scales and names: E8M0 decoding, the layout of an inverse-scale tensor read back from its
shape, and the spellings the FP8 configuration accepts."""

import hypothesis.extra.numpy as hnp
import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import floatxq as fq
from floatxq.testing import assert_bitwise_equal
from floatxq.testing.strategies import alias_spellings, fp8_weight_cases


@given(hnp.arrays(np.uint8, hnp.array_shapes(min_dims=0, max_dims=3, max_side=5)))
def test_decode_e8m0_is_two_to_the_biased_exponent_and_nan_for_255(data):
    got = fq.decode_e8m0(torch.from_numpy(data))
    assert got.dtype == torch.float32 and got.shape == data.shape
    b = data.astype(np.int64)
    # an independent oracle: ldexp in float64 (exact for 2**-127 .. 2**127), then to FP32
    expected = np.where(b == 255, np.nan, np.ldexp(1.0, b - 127)).astype(np.float32)
    np.testing.assert_array_equal(got.numpy(), expected)
    if hasattr(torch, "float8_e8m0fnu"):  # the dtype's own view decodes the same
        view = torch.from_numpy(data).view(torch.float8_e8m0fnu)
        assert_bitwise_equal(fq.decode_e8m0(view), got)


@given(fp8_weight_cases(max_blocks=(4, 4), max_shape=(6, 8)))
def test_infer_scale_layout_recovers_the_layout_quantize_fp8_weight_wrote(case):
    q = fq.quantize_fp8_weight(
        case.weight,
        format=case.format,
        weight_scale_method=case.method,
        weight_block_size=case.block,
    )
    shape = tuple(case.weight.shape)
    rows, cols = shape
    method, block = fq.infer_scale_layout(shape, tuple(q.scale_inv.shape))
    if q.scale_inv.numel() == 1:  # one scale (a tensor, a one-row weight, one block) is a tensor
        assert (method, block) == ("tensor", None)
    else:
        assert (method, block) == (case.method, case.block)
    # the flattened grid of a block layout reads back to a grid with as many blocks
    if method == "block" and q.scale_inv.numel() > 1 and q.scale_inv.numel() != rows:
        flat_method, flat_block = fq.infer_scale_layout(shape, (q.scale_inv.numel(),))
        assert flat_method == "block"
        assert (rows // flat_block[0]) * (cols // flat_block[1]) == q.scale_inv.numel()


@given(
    st.sampled_from(["inverse", None]),
    st.sampled_from(["", " ", "\t"]),
    st.lists(st.booleans(), min_size=7, max_size=7),
)
def test_scale_semantics_accepts_inverse_in_any_case_and_padding(value, pad, upper):
    if value is not None:
        value = (
            pad + "".join(c.upper() if u else c for c, u in zip(value, upper, strict=True)) + pad
        )
    assert fq.normalize_fp8_scale_semantics(value) == "inverse"


@given(st.one_of(st.text(max_size=8), st.integers(), st.floats(allow_nan=False)))
def test_scale_semantics_refuses_everything_else_by_name(value):
    if isinstance(value, str) and value.strip().lower() == "inverse":
        return
    with pytest.raises(ValueError, match="weight_scale_semantics"):
        fq.normalize_fp8_scale_semantics(value)


@given(alias_spellings(), st.sampled_from(["format", "weight format"]))
def test_weight_format_spellings_normalize_and_round_trip(pair, where):
    spelling, canonical = pair
    assert fq.normalize_fp8_weight_format(spelling, where=where) == canonical
    assert fq.normalize_fp8_weight_format(canonical, where=where) == canonical  # idempotent


@given(st.sampled_from(["e8m0", "float8_e8m0fnu", "E8M0"]), st.sampled_from(["fmt", "format"]))
def test_weight_format_refuses_the_decode_only_e8m0_naming_the_argument(spelling, where):
    with pytest.raises(ValueError, match=f"^{where}: .*decode-only"):
        fq.normalize_fp8_weight_format(spelling, where=where)
