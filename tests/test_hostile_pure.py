"""Hostile input to the pure FP8 / NVFP4 / INT4 functions: each ends in a specific exception.

Decoders refuse what their encoders never write (integer "codes", NaN / negative / zero scales,
scales shaped for another layout, group ids outside the groups); finite input never decodes to
inf; meta tensors, float64 values beyond FP32 and global scales of the wrong kind are named as
such. Expected values come from the formats' definitions (fp16's largest finite value, E4M3 byte
meanings, hand-computed quotients), never from the functions under test.

The calls run under :func:`production_checks`: the errors are floatxq's own, those users get
(the test run's type checker would otherwise refuse some arguments first).
"""

import math
import re
from collections.abc import Callable
from typing import Any

import pytest
import torch

import floatxq as fq
from floatxq.testing import production_checks

E4M3 = torch.float8_e4m3fn
FP16_MAX = 65504.0  # largest finite float16 (IEEE binary16)
BF16_MAX = float(torch.finfo(torch.bfloat16).max)
NVFP4_RECIPES = (
    "nvidia",
    "nvidia_headroom",
    "four_six",
    "least_squares",
    "least_squares_headroom",
    "least_squares_grid",
    "exhaustive",
)
META = "meta tensors hold no data"
FP32_RANGE = "exceeds? FP32's range"


def _raises(error: type[Exception], match: str, fn: Callable[..., Any], *args, **kwargs) -> None:
    with production_checks(), pytest.raises(error, match=match):
        fn(*args, **kwargs)


def _e4m3_bytes(values: list[int], shape: tuple[int, ...]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.uint8).reshape(shape).view(E4M3)


# ------------------------------------------------------------------------------------------------
# NVFP4 quantize-dequantize: finite in, finite out
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("recipe", NVFP4_RECIPES)
@pytest.mark.parametrize(("dtype", "top"), [(torch.float16, FP16_MAX), (torch.bfloat16, BF16_MAX)])
def test_qdq_of_the_largest_finite_input_saturates_instead_of_overflowing(recipe, dtype, top):
    x = torch.tensor([[top, -top] + [1.0] * 14], dtype=dtype)
    out = fq.nvfp4_block_qdq(x, None, recipe)
    assert out.dtype == dtype and bool(torch.isfinite(out).all()), out
    assert out[0, 0].item() == top and out[0, 1].item() == -top  # ±max finite


def test_the_fp16_case_needs_saturation_at_all():
    """The decoded FP32 value of 65504 lies above 65519, which rounds to inf in fp16."""
    x = torch.tensor([[FP16_MAX] * 16], dtype=torch.float16)
    g = fq.nvfp4_global_scale(x.float().abs().amax(), grid_dtype=torch.float16, recipe="nvidia")
    decoded32 = fq.nvfp4_block_qdq(x.float(), g, "nvidia")
    assert decoded32[0, 0].item() >= 65520.0
    assert math.isinf(decoded32.half()[0, 0].item())
    assert fq.nvfp4_block_qdq(x, g, "nvidia")[0, 0].item() == FP16_MAX


def test_random_fp16_up_to_its_maximum_stays_finite_for_every_recipe():
    gen = torch.Generator().manual_seed(14)
    x = (torch.rand(8, 64, generator=gen) * 2 - 1) * FP16_MAX
    x[:, ::16] = FP16_MAX  # every block holds the maximum
    x = x.half()
    for recipe in NVFP4_RECIPES:
        assert bool(torch.isfinite(fq.nvfp4_block_qdq(x, None, recipe)).all()), recipe


def test_dequantize_saturates_into_the_output_dtype_too():
    """A valid NVFP4 tensor (code 6, scale 448, global scale 32) is 86016: beyond fp16."""
    packed = torch.full((1, 8), 0x77, dtype=torch.uint8)  # E2M1 code 7 = 6.0 in both nibbles
    scales = _e4m3_bytes([0x7E], (1, 1))  # 448
    out = fq.nvfp4_dequantize(packed, scales, 32.0, dtype=torch.float16)
    assert out.dtype == torch.float16 and bool((out == FP16_MAX).all())
    assert bool((fq.nvfp4_dequantize(packed, scales, 32.0) == 6 * 448 * 32).all())
    _raises(
        TypeError,
        "floating torch.dtype",
        fq.nvfp4_dequantize,
        packed,
        scales,
        1.0,
        dtype=torch.int32,
    )


# ------------------------------------------------------------------------------------------------
# FP8 weight decode: codes must be FP8, scales finite and positive, shapes a known layout
# ------------------------------------------------------------------------------------------------

DEQUANTIZERS = [fq.dequantize_fp8_weight, fq.dequantize_fp8_weight_transposed]


def _fp8_weight() -> fq.FP8Weight:
    return fq.quantize_fp8_weight(torch.tensor([[1.0, -2.0, 0.5, 4.0]] * 4))


@pytest.mark.parametrize("decode", DEQUANTIZERS)
@pytest.mark.parametrize(
    "as_codes", [lambda q: q.view(torch.uint8), lambda q: q.view(torch.int8), lambda q: q.float()]
)
def test_fp8_decoders_refuse_integer_or_float_codes(decode, as_codes):
    q = _fp8_weight()
    _raises(TypeError, "qweight must be an FP8 tensor", decode, as_codes(q.qweight), q.scale_inv)


def test_fp8_decode_refuses_bytes_and_names_the_view():
    codes = torch.tensor([0x7E], dtype=torch.uint8)  # 448 as E4M3 bits, 126 as an integer
    _raises(TypeError, r"view\(torch.float8_e4m3fn\)", fq.fp8_decode, codes)


@pytest.mark.parametrize("decode", DEQUANTIZERS)
@pytest.mark.parametrize("bad", [0.0, -1.0, float("nan"), float("inf"), -float("inf")])
def test_fp8_decoders_refuse_non_positive_or_non_finite_scales(decode, bad):
    q = _fp8_weight()
    scale_inv = q.scale_inv.clone()
    scale_inv[2] = bad
    _raises(
        ValueError, r"scale_inv .* must be finite and > 0; 1 of 4", decode, q.qweight, scale_inv
    )


@pytest.mark.parametrize("decode", DEQUANTIZERS)
def test_fp8_decoders_name_the_float64_scale_beyond_fp32_and_refuse_integer_scales(decode):
    q = _fp8_weight()
    _raises(ValueError, FP32_RANGE, decode, q.qweight, torch.full((4,), 1e300, dtype=torch.float64))
    _raises(TypeError, "scale_inv must be a floating-point", decode, q.qweight, torch.ones(4).int())


@pytest.mark.parametrize("decode", DEQUANTIZERS)
@pytest.mark.parametrize("shape", [(3,), (5,), (3, 3), (4, 8, 1), (0,)])
def test_fp8_decoders_name_both_shapes_for_a_scale_no_layout_explains(decode, shape):
    q = _fp8_weight()  # (4, 4)
    message = f"scale_inv of shape {re.escape(str(shape))} fits no scale layout of qweight of "
    _raises(ValueError, message + r"shape \(4, 4\)", decode, q.qweight, torch.ones(shape))


def test_a_flattened_block_grid_decodes_as_the_grid_row_major():
    """(2,) scales of a (4, 8) weight: infer_scale_layout's most square grid, 1 x 2 blocks."""
    codes = torch.tensor([[8.0] * 8] * 4).to(E4M3)
    assert fq.infer_scale_layout((4, 8), (2,)) == ("block", (4, 4))
    out = fq.dequantize_fp8_weight(codes, torch.tensor([2.0, 4.0]))
    assert out.tolist() == [[4.0] * 4 + [2.0] * 4] * 4  # 8 / 2 left, 8 / 4 right
    t = fq.dequantize_fp8_weight_transposed(codes, torch.tensor([2.0, 4.0]))
    assert torch.equal(t, out.t())


# ------------------------------------------------------------------------------------------------
# FP8 tokens: one scale per row, never broadcast along k
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("codes_shape", "scale_shape"),
    [((1, 4), (1, 4)), ((3, 4), (1, 4)), ((3, 4), (1, 1)), ((4, 4), (4,)), ((2, 3, 4), (3, 1))],
)
def test_token_dequantize_refuses_scales_that_are_not_one_per_row(codes_shape, scale_shape):
    codes = torch.ones(codes_shape).to(E4M3)
    rows = (*codes_shape[:-1], 1)
    message = f"scale must have shape {re.escape(str(rows))} .* got {re.escape(str(scale_shape))}"
    _raises(ValueError, message, fq.fp8_token_dequantize, codes, torch.ones(scale_shape))


@pytest.mark.parametrize("bad", [0.0, -0.5, float("nan"), float("inf")])
def test_token_dequantize_refuses_scales_the_quantizer_never_writes(bad):
    tokens = fq.fp8_token_quantize(torch.tensor([[1.0, -4.0], [2.0, 3.0]]))
    scale = tokens.scale.clone()
    scale[1, 0] = bad
    _raises(
        ValueError, "scale must be finite and > 0", fq.fp8_token_dequantize, tokens.codes, scale
    )


def test_token_dequantize_refuses_integer_codes():
    tokens = fq.fp8_token_quantize(torch.tensor([[1.0, -4.0]]))
    _raises(
        TypeError,
        "codes must be an FP8 tensor",
        fq.fp8_token_dequantize,
        tokens.codes.view(torch.uint8),
        tokens.scale,
    )


# ------------------------------------------------------------------------------------------------
# NVFP4 decode: E4M3 block scales in [0, 448]
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("byte", [0x7F, 0xFF, 0x80, 0xB8, 0xFE])  # NaN, NaN, -0, -1, -448
def test_nvfp4_dequantize_refuses_nan_and_negative_block_scales(byte):
    packed = torch.full((2, 8), 0x22, dtype=torch.uint8)  # 1.0 everywhere
    scales = _e4m3_bytes([0x38, byte], (2, 1))  # 1.0 for row 0, the bad byte for row 1
    _raises(
        ValueError,
        rf"1 NaN or negative E4M3 scale.*'{hex(byte)}'",
        fq.nvfp4_dequantize,
        packed,
        scales,
        1.0,
    )
    x = torch.ones(2, 16)
    _raises(ValueError, "NaN or negative E4M3", fq.nvfp4_block_sse, x, scales, 1.0)


def test_nvfp4_dequantize_accepts_a_zero_block_scale_as_an_all_zero_block():
    packed = torch.full((1, 16), 0x77, dtype=torch.uint8)  # 6.0 everywhere, two blocks
    scales = _e4m3_bytes([0x00, 0x38], (1, 2))  # 0 and 1.0
    out = fq.nvfp4_dequantize(packed, scales, 2.0)
    assert out[0, :16].tolist() == [0.0] * 16 and out[0, 16:].tolist() == [12.0] * 16


# ------------------------------------------------------------------------------------------------
# NVFP4 global scales: one real number
# ------------------------------------------------------------------------------------------------


def _global_scale_calls() -> list[tuple[str, Callable[[Any], Any]]]:
    x = torch.ones(2, 16)
    q = fq.nvfp4_quantize(x, 1.0)
    return [
        ("nvfp4_block_scales", lambda g: fq.nvfp4_quantize(x, g)),
        ("nvfp4_block_scales", lambda g: fq.nvfp4_block_scales(x, g)),
        ("nvfp4_block_qdq", lambda g: fq.nvfp4_block_qdq(x, g)),
        ("nvfp4_block_qdq", lambda g: fq.nvfp4_block_qdq(torch.empty(0, 16), g)),
        ("nvfp4_block_sse", lambda g: fq.nvfp4_block_sse(x, q.block_scales, g)),
        ("nvfp4_dequantize", lambda g: fq.nvfp4_dequantize(q.packed, q.block_scales, g)),
    ]


@pytest.mark.parametrize(
    ("bad", "error", "match"),
    [
        ("1.0", TypeError, "global_scale must be a real number .* got str"),
        (b"1", TypeError, "global_scale must be a real number .* got bytes"),
        ([1.0, 2.0], TypeError, "global_scale must be a real number .* got list"),
        (True, TypeError, "global_scale must be a real number .* got bool"),
        (None, TypeError, "global_scale must be a real number .* got NoneType"),
        (torch.tensor(2), TypeError, "global_scale must be a floating-point scalar"),
        (torch.ones(2), ValueError, r"global_scale must hold one value .* got shape \(2,\)"),
        (torch.ones(1, 2), ValueError, r"global_scale must hold one value"),
        (1e300, ValueError, f"global_scale .*{FP32_RANGE}"),
        (10**400, ValueError, f"global_scale .*{FP32_RANGE}"),
        (torch.tensor(1e300, dtype=torch.float64), ValueError, f"global_scale .*{FP32_RANGE}"),
        (torch.ones((), device="meta"), TypeError, f"global_scale is a meta tensor.*{META}"),
    ],
)
def test_global_scales_of_the_wrong_kind_are_named(bad, error, match):
    for where, call in _global_scale_calls():
        if bad is None and where not in ("nvfp4_dequantize", "nvfp4_block_sse"):
            continue  # None asks the quantizers for the dynamic global scale
        _raises(error, f"{where}: {match}", call, bad)


def test_one_element_global_scales_of_any_shape_are_accepted():
    x = torch.full((1, 16), 3.0)
    for g in (1, 1.0, torch.tensor([1.0]), torch.ones(1, 1, dtype=torch.float64)):
        with production_checks():  # the annotation names the 0-d tensor; the code takes more
            assert fq.nvfp4_block_qdq(x, g).tolist() == x.tolist()


@pytest.mark.parametrize(
    ("amax", "error", "match"),
    [
        ("3.0", TypeError, "amax must be a real number"),
        (torch.ones(3), ValueError, "amax must hold one value"),
        (torch.tensor(1e300, dtype=torch.float64), ValueError, f"amax .*{FP32_RANGE}"),
        (1e300, ValueError, f"amax .*{FP32_RANGE}"),
    ],
)
def test_global_scale_amax_of_the_wrong_kind_is_named(amax, error, match):
    _raises(error, f"nvfp4_global_scale: {match}", fq.nvfp4_global_scale, amax)


# ------------------------------------------------------------------------------------------------
# float64 beyond FP32, meta tensors
# ------------------------------------------------------------------------------------------------

HUGE = torch.tensor([[1e300] + [1.0] * 15], dtype=torch.float64)


@pytest.mark.parametrize(
    ("where", "call"),
    [
        ("quantize_fp8_weight", lambda: fq.quantize_fp8_weight(HUGE)),
        ("fp8_token_quantize", lambda: fq.fp8_token_quantize(HUGE)),
        ("fp8_token_quantize", lambda: fq.fp8_token_qdq(HUGE)),
        ("direct_to_inverse_scale", lambda: fq.direct_to_inverse_scale(HUGE)),
        ("nvfp4_block_scales", lambda: fq.nvfp4_quantize(HUGE, 1.0)),
        ("nvfp4_block_scales", lambda: fq.nvfp4_block_scales(HUGE)),
        ("nvfp4_block_qdq", lambda: fq.nvfp4_block_qdq(HUGE, 1.0)),
        ("nvfp4_block_sse", lambda: fq.nvfp4_block_sse(HUGE, torch.ones(1, 1).to(E4M3), 1.0)),
    ],
)
def test_float64_beyond_fp32_is_named_as_such_not_as_nan_or_infinity(where, call):
    _raises(ValueError, rf"{where}: \w+ has 1 value\(s\) that {FP32_RANGE}.*1e\+300", call)


def test_float64_infinity_is_still_called_infinity():
    inf = torch.full((1, 16), math.inf, dtype=torch.float64)
    _raises(ValueError, "NaN or infinity", fq.quantize_fp8_weight, inf)
    _raises(ValueError, "NaN or infinity", fq.nvfp4_quantize, inf, 1.0)


def _meta(shape: tuple[int, ...], dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype, device="meta")


def _meta_calls() -> list[tuple[str, Callable[[], Any]]]:
    w = _meta((4, 16))
    codes8 = _meta((4, 16), E4M3)
    q = fq.quantize_fp8_weight(torch.ones(4, 16))
    packed = fq.nvfp4_quantize(torch.ones(4, 16), 1.0)
    gptq = fq.pack_gptq(
        torch.zeros(8, 8, dtype=torch.int32),
        torch.full((1, 8), 8),
        torch.ones(1, 8),
        torch.zeros(8, dtype=torch.int32),
    )
    return [
        ("fp8_cast", lambda: fq.fp8_cast(w)),
        ("fp8_decode", lambda: fq.fp8_decode(codes8)),
        ("decode_e8m0", lambda: fq.decode_e8m0(_meta((4,), torch.uint8))),
        ("quantize_fp8_weight", lambda: fq.quantize_fp8_weight(w)),
        ("dequantize_fp8_weight", lambda: fq.dequantize_fp8_weight(codes8, _meta((4,)))),
        ("dequantize_fp8_weight", lambda: fq.dequantize_fp8_weight(q.qweight, _meta((4,)))),
        (
            "dequantize_fp8_weight_transposed",
            lambda: fq.dequantize_fp8_weight_transposed(codes8, q.scale_inv),
        ),
        ("direct_to_inverse_scale", lambda: fq.direct_to_inverse_scale(w)),
        ("fp8_token_quantize", lambda: fq.fp8_token_quantize(w)),
        ("fp8_token_qdq", lambda: fq.fp8_token_qdq(w)),
        ("fp8_token_dequantize", lambda: fq.fp8_token_dequantize(codes8, _meta((4, 1)))),
        (
            "fp8_scaled_linear",
            lambda: fq.fp8_scaled_linear(w, codes8, _meta(()), recipe="tensorwise"),
        ),
        ("nvfp4_block_scales", lambda: fq.nvfp4_quantize(w, 1.0)),
        ("nvfp4_block_scales", lambda: fq.nvfp4_block_scales(w)),
        ("nvfp4_block_qdq", lambda: fq.nvfp4_block_qdq(w, 1.0)),
        ("nvfp4_block_sse", lambda: fq.nvfp4_block_sse(w, packed.block_scales, 1.0)),
        (
            "nvfp4_dequantize",
            lambda: fq.nvfp4_dequantize(_meta((4, 8), torch.uint8), packed.block_scales, 1.0),
        ),
        ("nvfp4_dequantize", lambda: fq.nvfp4_dequantize(packed.packed, _meta((4, 1), E4M3), 1.0)),
        ("nvfp4_global_scale", lambda: fq.nvfp4_global_scale(_meta(()))),
        (
            "pack_gptq",
            lambda: fq.pack_gptq(_meta((8, 8), torch.int32), *fq.unpack_gptq(gptq)[1:]),
        ),
        ("unpack_gptq", lambda: fq.unpack_gptq(gptq._replace(scales=_meta((1, 8))))),
        (
            "convert_gptq_format",
            lambda: fq.convert_gptq_format(
                gptq._replace(qweight=_meta((1, 8), torch.int32)), source="gptq", target="gptq_v2"
            ),
        ),
        ("int4_to_e4m3", lambda: fq.int4_to_e4m3(_meta((4,), torch.int16))),
        ("split_int4_planes", lambda: fq.split_int4_planes(_meta((4,), torch.int16))),
        (
            "int4_planes_to_e2m1",
            lambda: fq.int4_planes_to_e2m1(_meta((2, 4), torch.int16), _meta((2, 4), torch.int16)),
        ),
    ]


@pytest.mark.parametrize(
    ("where", "call"), _meta_calls(), ids=lambda v: v if isinstance(v, str) else None
)
def test_meta_tensors_are_refused_as_holding_no_data(where, call):
    _raises(TypeError, f"{where}: .*{META}", call)


# ------------------------------------------------------------------------------------------------
# GPTQ INT4: unpack refuses what pack refuses; pack refuses scales float16 cannot store
# ------------------------------------------------------------------------------------------------


def _gptq(rows: int = 16, groups: int = 2) -> fq.GPTQPacked:
    return fq.pack_gptq(
        (torch.arange(rows)[:, None] + torch.arange(8)[None, :]) % 16,
        torch.full((groups, 8), 8),
        torch.full((groups, 8), 0.5),
        torch.arange(rows, dtype=torch.int32) * groups // rows,
    )


GPTQ_READERS = [
    ("unpack_gptq", lambda p: fq.unpack_gptq(p)),
    ("convert_gptq_format", lambda p: fq.convert_gptq_format(p, source="gptq", target="gptq_v2")),
]


@pytest.mark.parametrize(("where", "read"), GPTQ_READERS)
@pytest.mark.parametrize("bad", [2, 7, -1, 2**31 - 1])
def test_gptq_readers_refuse_g_idx_outside_the_groups(where, read, bad):
    p = _gptq()
    g_idx = p.g_idx.clone()
    g_idx[5] = bad
    _raises(
        ValueError, rf"{where}: packed.g_idx must lie in \[0, 1\]", read, p._replace(g_idx=g_idx)
    )


@pytest.mark.parametrize(("where", "read"), GPTQ_READERS)
def test_gptq_readers_refuse_nan_or_integer_scales(where, read):
    p = _gptq()
    scales = p.scales.clone()
    scales[1, 3] = float("nan")
    _raises(ValueError, f"{where}: packed.scales contains NaN", read, p._replace(scales=scales))
    _raises(
        ValueError,
        "packed.scales contains NaN or infinity",
        read,
        p._replace(scales=p.scales.float() * math.inf),
    )
    _raises(
        TypeError,
        f"{where}: packed.scales must be a floating-point",
        read,
        p._replace(scales=p.scales.to(torch.int32)),
    )


def test_centered_int4_refuses_nan_scales():
    p = fq.pack_gptq(
        torch.full((128, 8), 3),
        torch.full((1, 8), 8),
        torch.ones(1, 8),
        torch.zeros(128, dtype=torch.int32),
    )
    _raises(
        ValueError,
        "centered_int4: packed.scales contains NaN",
        fq.centered_int4,
        p._replace(scales=p.scales * math.nan),
    )


def test_gptq_readers_refuse_rows_without_any_group():
    p = _gptq(rows=8, groups=1)
    empty = p._replace(qzeros=p.qzeros[:0], scales=p.scales[:0])
    _raises(ValueError, "hold no group for 8 rows", fq.unpack_gptq, empty)


@pytest.mark.parametrize("bad", [2.0**-30, -(2.0**-26), 1e-12, 1e6, -1e6, 65520.0])
def test_pack_refuses_scales_that_float16_would_flush_or_overflow(bad):
    scales = torch.tensor([[0.5, bad, 0.25, bad, 1.0, 0.0, 2.0, 3.0]])
    _raises(
        ValueError,
        r"pack_gptq: 2 scale\(s\) do not survive the float16",
        fq.pack_gptq,
        torch.zeros(8, 8, dtype=torch.int32),
        torch.full((1, 8), 8),
        scales,
        torch.zeros(8, dtype=torch.int32),
    )
    wide = torch.tensor([[0.5, bad, 0.25, bad, 1.0, 0.0, 2.0, 3.0]], dtype=torch.float64)
    _raises(
        ValueError,
        re.escape(f"such as [{bad!r}"),
        fq.pack_gptq,
        torch.zeros(8, 8, dtype=torch.int32),
        torch.full((1, 8), 8),
        wide,
        torch.zeros(8, dtype=torch.int32),
    )


def test_pack_keeps_scales_that_float16_stores_and_rounds_the_rest_to_nearest():
    """Zero stays zero; the smallest subnormal (2**-24) and 65519 (rounds down to 65504) store."""
    scales = torch.tensor([[0.0, 2.0**-24, 65519.0, -FP16_MAX, 0.1, 1.0, 2.0**-25 * 1.5, 3.0]])
    packed = fq.pack_gptq(
        torch.zeros(8, 8, dtype=torch.int32),
        torch.full((1, 8), 8),
        scales,
        torch.zeros(8, dtype=torch.int32),
    )
    expected = [0.0, 2.0**-24, FP16_MAX, -FP16_MAX, 0.0999755859375, 1.0, 2.0**-24, 3.0]
    assert packed.scales.dtype == torch.float16 and packed.scales[0].tolist() == expected
