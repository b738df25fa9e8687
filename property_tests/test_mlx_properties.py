"""Properties of the MLX path: the encoder's bytes, the Metal kernels' agreement, the linears.

Weights come from ``floatxq.testing.strategies`` (every format, every scale layout, values
spread over the FP32 range), so a failure shrinks to a small matrix. The Metal kernels run
through ``floatxq.mlx.metal_emulator`` (a C++ build of their sources) where Metal is absent.
"""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

mx = pytest.importorskip("mlx.core")

import floatxq as fq  # noqa: E402
import floatxq.mlx as fqm  # noqa: E402
from floatxq.formats import fp8_max  # noqa: E402
from floatxq.mlx import kernels  # noqa: E402
from floatxq.mlx import metal_emulator as emulator  # noqa: E402
from floatxq.mlx.fp8 import _FP8_BITS  # noqa: E402
from floatxq.testing.mlx import assert_mlx_linear_close  # noqa: E402
from floatxq.testing.strategies import (  # noqa: E402
    FP8WeightCase,
    f32_values,
    fp8_weight_cases,
)

needs_compiler = pytest.mark.skipif(emulator.compiler() is None, reason="the emulator needs g++")
DTYPES = st.sampled_from([torch.float32, torch.float16, torch.bfloat16])
MX_DTYPE = {torch.float32: mx.float32, torch.float16: mx.float16, torch.bfloat16: mx.bfloat16}


def _mx(w: torch.Tensor) -> "mx.array":
    return mx.array(w.to(torch.float32).numpy()).astype(MX_DTYPE[w.dtype])


def _mlx_case(case: FP8WeightCase) -> "fqm.MlxFP8Weight":
    return fqm.quantize_fp8_weight_mlx(
        _mx(case.weight),
        format=case.format,
        weight_scale_method=case.method,
        weight_block_size=case.block,
    )


# Weights whose products with N(0, 1) inputs stay finite in every output dtype (|y| < 65504).
BOUNDED = f32_values(max_magnitude=2.0**7)


@st.composite
def cases_in_dtype(draw, elements=None) -> FP8WeightCase:
    """A weight case, its weight cast to a drawn float dtype (finite after the cast)."""
    dtype = draw(DTYPES)
    case = draw(fp8_weight_cases(elements=elements))
    w = case.weight.to(dtype)
    if not torch.isfinite(w).all():
        w = torch.nan_to_num(w, posinf=1.0, neginf=-1.0)
    return case._replace(weight=w)


@given(case=cases_in_dtype())
def test_mlx_encoder_gives_torch_bytes(case: FP8WeightCase) -> None:
    got = _mlx_case(case)
    want = fq.quantize_fp8_weight(
        case.weight,
        format=case.format,
        weight_scale_method=case.method,
        weight_block_size=case.block,
    )
    np.testing.assert_array_equal(np.array(got.qweight), want.qweight.view(torch.uint8).numpy())
    np.testing.assert_array_equal(
        np.array(got.scale_inv).view(np.uint32), want.scale_inv.numpy().view(np.uint32)
    )


@needs_compiler
@given(case=cases_in_dtype())
def test_metal_encoder_gives_array_ops_bytes(case: FP8WeightCase) -> None:
    q = _mlx_case(case)
    mbits, bias, negative_zero = _FP8_BITS[case.format]
    plan = kernels.fp8_encode_launch(
        _mx(case.weight),
        q.scale_inv,
        mbits=mbits,
        bias=bias,
        negative_zero=negative_zero,
        fmax=fp8_max(case.format),
    )
    np.testing.assert_array_equal(np.array(emulator.emulate(plan)), np.array(q.qweight))


@needs_compiler
@given(
    case=cases_in_dtype(elements=BOUNDED),
    rows=st.integers(1, 8),  # the emulated kernels cost time in proportion to the rows
    seed=st.integers(0, 2**16),
    data=st.data(),
)
@settings(max_examples=max(10, settings.default.max_examples // 2))
def test_packed_kernels_agree_and_bound(case: FP8WeightCase, rows: int, seed: int, data) -> None:
    q = _mlx_case(case)
    layer = fqm.MlxFP8PackedLinear(q.qweight, q.scale_inv, format=case.format)
    dtype = MX_DTYPE[data.draw(DTYPES)]
    g = np.random.default_rng(seed)
    x = mx.array(g.standard_normal((rows, layer.in_features)).astype(np.float32)).astype(dtype)
    args = (x, layer.qweight, layer._table, layer.scale_inv, None)
    general = emulator.emulate(kernels.packed_linear_launch(*args, route="general"))
    prefill = emulator.emulate(kernels.packed_linear_launch(*args, route="prefill"))
    assert mx.array_equal(general, prefill).item()
    for got in (general, layer.reference(x)):
        assert_mlx_linear_close(got, x, layer)


@given(
    case=fp8_weight_cases(formats=("float8_e4m3fn",), max_shape=(6, 3), elements=BOUNDED),
    seed=st.integers(0, 2**16),
)
def test_native_mxfp8_within_bound_of_packed(case: FP8WeightCase, seed: int) -> None:
    if case.method == "block":
        case = case._replace(method="row", block=None)
    w = case.weight.repeat(1, 32)  # widths that are multiples of 32
    q = fqm.quantize_fp8_weight_mlx(_mx(w), format=case.format, weight_scale_method=case.method)
    packed = fqm.MlxFP8PackedLinear(q.qweight, q.scale_inv)
    assert fqm.MlxFP8Linear.eligibility(packed) is None
    native = fqm.MlxFP8Linear.from_packed(packed)
    g = np.random.default_rng(seed)
    x = mx.array(g.standard_normal((3, packed.in_features)).astype(np.float32))
    assert_mlx_linear_close(native(x), x, packed)
