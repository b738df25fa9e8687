"""Properties of the route choices moved into ``floatxq.dispatch``: MLX's Metal kernel choices
and ``TorchFP4Linear``'s torchao-first order.

A choice returns ``(route, reason)`` with ``reason`` ``None`` exactly for the fastest candidate;
the MLX choices take sizes and a Metal flag only, and the thin wrappers in ``floatxq.mlx`` give
the same route string.
"""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from floatxq import dispatch

DTYPES = st.sampled_from([torch.float16, torch.bfloat16, torch.float32, torch.float64])
SIZES = st.integers(0, 20000)


@given(st.integers(0, 4096), SIZES, SIZES, st.booleans())
def test_packed_route_reason_is_none_exactly_for_prefill(rows, inp, out, metal):
    route, reason = dispatch.mlx_packed_route(rows, inp, out, metal=metal)
    assert route in ("prefill", "general", "array-ops")
    assert (reason is None) == (route == "prefill")
    assert (route == "array-ops") == (not metal)
    if route == "prefill":  # many rows only, and more rows keep the prefill kernel
        assert rows > 1
        assert dispatch.mlx_packed_route(rows + 1, inp, out, metal=True) == ("prefill", None)
        assert dispatch.mlx_packed_route(1, inp, out, metal=True)[0] == "general"


@given(st.integers(2, 64), st.integers(1, 128), st.integers(256, 512))
def test_packed_route_takes_prefill_for_wide_aligned_shapes(rows, in_blocks, out_blocks):
    inp, out = 64 * in_blocks, 32 * out_blocks  # in <= 8192, out >= 8192, both aligned
    assert dispatch.mlx_packed_route(rows, inp, out, metal=True) == ("prefill", None)
    _, reason = dispatch.mlx_packed_route(rows, inp + 1, out, metal=True)
    assert "in_features" in reason
    _, reason = dispatch.mlx_packed_route(rows, inp, out - 1, metal=True)
    assert "out_features" in reason


@given(st.integers(0, 1 << 22), st.booleans())
def test_fp8_encode_route_is_monotone_in_size(elements, metal):
    route, reason = dispatch.mlx_fp8_encode_route(elements, metal=metal)
    assert (reason is None) == (route == "metal")
    if route == "metal":
        assert metal and dispatch.mlx_fp8_encode_route(elements + 1, metal=True)[0] == "metal"
    elif metal:
        assert elements < dispatch.FP8_ENCODE_MIN_ELEMENTS
        assert dispatch.mlx_fp8_encode_route(max(elements - 1, 0), metal=True)[0] == "array-ops"


@given(st.integers(0, 64), st.integers(1, 64), st.integers(1, 64))
def test_mlx_wrappers_give_the_dispatch_route(rows, in_blocks, out_blocks):
    kernels = pytest.importorskip("floatxq.mlx.kernels")
    inp, out = 64 * in_blocks, 256 * out_blocks
    want = dispatch.mlx_packed_route(rows, inp, out, metal=True)[0]
    assert kernels.packed_route(rows, inp, out) == want


@given(DTYPES, st.text(min_size=1, max_size=20))
def test_fp4_route_with_torchao_switched_off_is_the_decode(dtype, off):
    cuda = torch.device("cuda")
    route, reason = dispatch.fp4_decode_route(cuda, dtype, torchao=True, torchao_off=off)
    decode, why = dispatch.fp4_decode_route(cuda, dtype)
    assert route == decode and route != "torchao_nvfp4"
    no_torchao = dispatch.torchao_missing() or off
    assert reason.startswith(f"{no_torchao}; the weight was decoded for this call")
    assert (why is None) == reason.endswith("for this call")
    if why is not None:
        assert reason.endswith(f"the Triton decode cannot run ({why})")


@given(DTYPES, st.one_of(st.none(), st.text(max_size=20)))
def test_fp4_route_off_cuda_is_the_pure_decode(dtype, off):
    cpu = torch.device("cpu")
    assert dispatch.fp4_decode_route(cpu, dtype, torchao=True, torchao_off=off) == (
        "dequant_matmul",
        None,
    )


@given(DTYPES)
def test_fp4_route_takes_torchao_exactly_when_installed_and_on(dtype):
    route, reason = dispatch.fp4_decode_route(torch.device("cuda"), dtype, torchao=True)
    assert (route == "torchao_nvfp4") == (dispatch.torchao_missing() is None)
    assert (reason is None) == (route == "torchao_nvfp4")
