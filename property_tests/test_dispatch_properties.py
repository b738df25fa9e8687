"""Properties of the route choices (``floatxq.dispatch``) and the W4A weight operand.

Route choices are pure functions of facts: a requested ``"reference"`` is always honoured with
its reason, ``reason`` is ``None`` exactly for the fastest candidate, and the answer never
depends on anything but its arguments. The W4A weight operand: :func:`floatxq.centered_weight`
reads both operand forms as the same integers, one accumulation step of
:func:`floatxq.w4a_nvfp4_accumulate_group` computes its stated FP32 formula, and the
dispatched :func:`floatxq.pack_activation` gives the pure function's bytes.
"""

import dataclasses

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import floatxq as fq
from floatxq import dispatch
from floatxq.gptq.int4 import pack_gptq
from floatxq.testing import assert_bitwise_equal
from floatxq.w4a.activation import pack_activation as pure_pack
from floatxq.w4a.weight import w4a_nvfp4_weight_planes, w4a_weight_ineligibility

CPU = torch.device("cpu")
DTYPES = st.sampled_from([torch.float16, torch.bfloat16, torch.float32, torch.float64])


@given(st.sampled_from(dispatch.W4A_NVFP4_ROUTES), st.booleans())
def test_w4a_nvfp4_route_off_cuda_is_never_native(requested, staged):
    try:
        route, reason = dispatch.w4a_nvfp4_route(requested, CPU, planes_staged=staged)
    except RuntimeError as exc:  # a forced route that cannot run says so
        assert requested in ("native", "emulation") and "cannot run on cpu" in str(exc)
        return
    assert route != "native" and reason is not None
    if requested == "reference":
        assert (route, reason) == ("reference", "route='reference' was requested")
    assert dispatch.w4a_nvfp4_route(requested, CPU, planes_staged=staged) == (route, reason)


@given(st.sampled_from(dispatch.W4A_FP8_ROUTES))
def test_w4a_fp8_route_reason_is_none_exactly_for_the_kernels(requested):
    try:
        route, reason = dispatch.w4a_fp8_route(requested, CPU)
    except RuntimeError:
        assert requested == "triton"
        return
    assert route in ("triton", "reference") and (reason is None) == (route == "triton")


@given(DTYPES, st.integers(0, 4096))
def test_gptq_and_fp4_routes_off_cuda_decode_in_torch(dtype, rows):
    route, reason = dispatch.gptq_route(CPU, dtype, rows)
    assert route == dispatch.GPTQ_DECODE_ROUTE and "cpu" in reason
    route, reason = dispatch.fp4_decode_route(torch.device("cuda"), dtype)
    if dtype == torch.float64:  # no Triton decode writes float64
        assert (route, "float64" in reason) == ("dequant_matmul", True)
    else:
        assert (route == "triton_decode") == (reason is None)


@given(st.sampled_from(dispatch.W4A_FP8_ROUTES), st.sampled_from(dispatch.W4A_NVFP4_ROUTES))
def test_route_preference_is_frozen_and_validated(fp8, nvfp4):
    pref = dispatch.RoutePreference(w4a_fp8=fp8, w4a_nvfp4=nvfp4)
    assert dataclasses.replace(pref, w4a_fp8="auto").w4a_nvfp4 == nvfp4
    with pytest.raises(dataclasses.FrozenInstanceError):
        pref.w4a_fp8 = "auto"  # type: ignore[misc]
    with pytest.raises(ValueError, match="route must be one of"):
        dataclasses.replace(pref, w4a_nvfp4=fp8 + "_unknown")


@given(st.integers(1, 2), st.integers(1, 2), st.randoms(use_true_random=False))
def test_centered_weight_reads_words_and_staged_operand_alike(groups, col_tiles, rnd):
    k, n = 128 * groups, 32 * col_tiles
    gen = torch.Generator().manual_seed(rnd.randrange(2**31))
    codes = torch.randint(0, 16, (k, n), generator=gen)
    packed = pack_gptq(
        codes, torch.full((groups, n), 8), torch.ones(groups, n),
        torch.arange(k, dtype=torch.int32) // 128, bits=4,
    )  # fmt: skip
    assert w4a_weight_ineligibility(
        packed, bits=4, group_size=128, format="gptq", gemm="W4A-FP8"
    ) is None  # fmt: skip
    centered = fq.centered_weight(packed.qweight)
    assert torch.equal(centered, (codes - 8).float())
    staged = (codes - 8).float().to(torch.float8_e4m3fn)
    assert torch.equal(fq.centered_weight(staged), centered)
    planes = w4a_nvfp4_weight_planes((codes - 8).to(torch.int16))
    assert planes.both.shape == (k // 2, 2 * n) and planes.both.stride() == (1, k // 2)


@given(
    st.integers(1, 4),
    st.integers(1, 8),
    st.lists(st.integers(-64, 64), min_size=1, max_size=64),
    st.sampled_from([0.5, 1.0, 2.0, 0.125]),
)
def test_accumulate_group_is_its_fp32_formula(m, n, values, scale):
    # small integers and power-of-two scales: every term is exact, so the formula is exact too
    both = torch.tensor(values * (2 * m * n), dtype=torch.float32)[: 2 * m * n].reshape(m, 2 * n)
    group_scale = torch.full((n,), scale)
    first = fq.w4a_nvfp4_accumulate_group(both, group_scale)
    expected = (both[:, :n] + 4 * both[:, n:]) * scale
    assert_bitwise_equal(first, expected + 0.0)
    again = fq.w4a_nvfp4_accumulate_group(both, group_scale, first)
    assert_bitwise_equal(again, 2 * expected)
    out = fq.w4a_nvfp4_accumulate_group(
        both, group_scale, first, last=True, global_scale=2.0, output_dtype=torch.float32
    )
    assert_bitwise_equal(out, 4 * expected)


@given(st.sampled_from(["w4afp8", "w4a_nvfp4"]), st.integers(1, 3), st.integers(0, 2**31 - 1))
def test_dispatched_pack_gives_the_pure_bytes(mode, rows, seed):
    x = torch.randn(rows, 128, generator=torch.Generator().manual_seed(seed)).bfloat16()
    pure, routed = pure_pack(x, mode), fq.pack_activation(x, mode)
    assert_bitwise_equal(pure.codes.view(torch.uint8), routed.codes.view(torch.uint8))
    assert_bitwise_equal(pure.scales.view(torch.uint8), routed.scales.view(torch.uint8))


@given(st.integers(0, 1 << 20), st.integers(0, 1 << 20), st.booleans(), st.booleans())
def test_row_counts_of_one_class_get_the_same_int4_routes(a, b, decode_words, fragment):
    """Modules keep one route decision per :func:`floatxq.dispatch.rows_bucket` class: every
    row-count switch of the default tunings agrees across a class."""
    if dispatch.rows_bucket(a) != dispatch.rows_bucket(b):
        return
    for choice in (dispatch.w4a16_route, dispatch.w4a_fp8_operand):
        held = {"decode_words": decode_words, "fragment": fragment}
        assert choice(a, **held) == choice(b, **held)
    staged = torch.zeros(256, 8, dtype=torch.float8_e4m3fn).T.contiguous().T  # K-contiguous
    (route_a, why_a), (route_b, why_b) = (dispatch.w4a_fp8_gemm_route(r, staged) for r in (a, b))
    assert route_a == route_b
    assert (why_a is None) == (why_b is None)  # (a reason may name its own row count)


@given(st.integers(0, 1 << 12), st.booleans(), st.booleans())
def test_w4a_fp8_words_returns_the_held_form_it_names(rows, frag_held, dwords_held):
    """The words a W4A-FP8 call reads are the form :func:`floatxq.dispatch.w4a_fp8_operand`
    names, the very tensor held; the fragment words only where their kernels run (never on the
    CPU); None exactly when the staged E4M3 operand is faster."""
    frag = torch.zeros(32, 16, dtype=torch.int16) if frag_held else None
    dwords = torch.zeros(32, 16, dtype=torch.int16) if dwords_held else None
    words = torch.zeros(16, 16, dtype=torch.int32)
    pick = dispatch.w4a_fp8_words(rows, frag, dwords, words)
    form = dispatch.w4a_fp8_operand(rows, decode_words=dwords_held, fragment=False)
    if form == "e4m3":
        assert pick is None
    else:
        assert pick[1] == "triton"
        assert pick[0] is {"decode_words": dwords, "words": words}[form]


@given(st.integers(0, 1 << 12), st.booleans(), st.booleans())
def test_w4a_fp8_weight_is_the_words_pick_else_the_staged_operand(rows, dwords_held, allowed):
    """A W4A-FP8 kernel call reads :func:`floatxq.dispatch.w4a_fp8_words`' pick where packed
    forms may be read and one is picked, else the staged E4M3 operand under
    :func:`floatxq.dispatch.w4a_fp8_gemm_route`'s GEMM."""
    staged = torch.zeros(256, 16, dtype=torch.float8_e4m3fn).T.contiguous().T
    dwords = torch.zeros(64, 16, dtype=torch.int16) if dwords_held else None
    words = torch.zeros(32, 16, dtype=torch.int32)
    packed = (None, dwords, words) if allowed else ()
    weight, route = dispatch.w4a_fp8_weight(rows, staged, *packed)
    pick = dispatch.w4a_fp8_words(rows, None, dwords, words) if allowed else None
    if pick is not None:
        assert weight is pick[0] and route == pick[1]
    else:
        assert weight is staged and route == dispatch.w4a_fp8_gemm_route(rows, staged)[0]
