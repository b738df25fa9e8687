"""``W4AActivation`` and ``pack_activation``: bytes, layouts, decode, token rescaling, validation.

Expectations come from floatxq's pure quantizers called independently (``fp8_token_quantize``,
``nvfp4_global_scale`` / ``nvfp4_quantize`` / ``nvfp4_dequantize``), from the swizzle offset
formula written out here, or by hand on small values. GPU tests compare the CUDA pack (the
Triton ``fp8_pack`` where it runs) with the CPU pack byte for byte.
"""

import dataclasses
import math

import pytest
import torch

import floatxq as fq
from floatxq.dispatch import fp8_pack_reason
from floatxq.testing import assert_bitwise_equal
from floatxq.testing.interpreter import can_interpret, needs_interpreter, run_interpreted_tests

E4M3 = torch.float8_e4m3fn
FP4X2 = torch.float4_e2m1fn_x2


def _randn(*shape: int, dtype: torch.dtype = torch.float32, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * 3).to(dtype)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


def _block_scales(a: fq.W4AActivation) -> torch.Tensor:
    return fq.unswizzle_scales_per_group(a.scales, rows=a.rows, cols=a.k // 16)


# ------------------------------------------------------------------------------------------------
# FP8
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_fp8_pack_is_fp8_token_quantize_and_decode_is_its_dequantize(dtype):
    x = _randn(2, 3, 256, dtype=dtype)
    x[1, 2] = 0  # an all-zero token: scale 1
    a = fq.pack_activation(x, "w4afp8")
    t = fq.fp8_token_quantize(x.reshape(6, 256))
    assert_bitwise_equal(a.codes, t.codes)
    assert_bitwise_equal(a.scales, t.scale[:, 0])
    assert a.scales[5].item() == 1.0
    assert (a.shape, a.rows, a.k, a.mode) == ((2, 3, 256), 6, 256, "w4afp8")
    assert a.global_scale is None and a.recipe is None and a.token_scale is None
    model = dtype if dtype in (torch.float16, torch.bfloat16) else torch.bfloat16
    assert a.model_dtype == model
    for out in (None, torch.float32, torch.float16):
        want = fq.fp8_token_dequantize(t.codes, t.scale, dtype=out or model).reshape(x.shape)
        assert_bitwise_equal(a.decode(out), want)


def test_fp8_pack_on_cpu_takes_the_pure_quantizer():
    reason = fp8_pack_reason(torch.zeros(1, 128))
    assert reason is not None and "cpu" in reason
    assert "float64" in fp8_pack_reason(torch.zeros(1, 128, dtype=torch.float64))


def test_fp8_zero_rows():
    a = fq.pack_activation(torch.zeros(0, 3, 128, dtype=torch.float16), "w4afp8")
    assert a.codes.shape == (0, 128) and a.scales.shape == (0,) and a.rows == 0
    assert a.decode().shape == (0, 3, 128) and a.decode().dtype == torch.float16


# ------------------------------------------------------------------------------------------------
# NVFP4: bytes, scales, decode
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("recipe", "canonical"),
    [(None, "least_squares"), ("nvidia", "nvidia"), ("lsq_grid", "least_squares_grid")],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_nvfp4_pack_and_decode_equal_the_pure_nvfp4_functions(recipe, canonical, dtype):
    x = _randn(2, 3, 256, dtype=dtype, seed=1)
    a = fq.pack_activation(x, "w4a_nvfp4", recipe=recipe)
    amax = x.float().abs().max()
    g = fq.nvfp4_global_scale(amax, grid_dtype=dtype, recipe=canonical)
    q = fq.nvfp4_quantize(x.reshape(6, 256), g, canonical)
    assert a.recipe == canonical and a.codes.dtype == FP4X2 and a.codes.shape == (6, 128)
    assert a.scales.dtype == E4M3 and a.scales.shape == (2, 128 * 8)
    assert_bitwise_equal(a.global_scale, g)
    assert_bitwise_equal(_bytes(a.codes), q.packed)
    assert_bitwise_equal(_block_scales(a), q.block_scales)
    for out in (torch.float32, dtype):
        want = fq.nvfp4_dequantize(*q, dtype=out).reshape(x.shape)
        assert_bitwise_equal(a.decode(out), want)
    assert a.decode().dtype == (dtype if dtype == torch.bfloat16 else torch.bfloat16)


def test_nvfp4_scales_sit_where_the_swizzle_formula_puts_them_and_padding_is_zero():
    rows, k = 130, 256  # two row tiles (the second mostly padding), two K groups
    x = _randn(rows, k, seed=2)
    x[:, :16] *= 1e-3  # vary the block scales across columns
    a = fq.pack_activation(x, "w4a_nvfp4", global_scale=0.01)
    want = fq.nvfp4_block_scales(x, 0.01, "least_squares").block_scales
    padded = 256  # ceil(130 / 128) * 128
    assert a.scales.shape == (k // 128, padded * 8)
    r = torch.arange(rows)[:, None]
    c = torch.arange(8)[None, :]
    # the offset of (r, c) in its group: 128x4 tiles (row tiles outer), inside a tile
    # (r % 32) * 16 + ((r % 128) // 32) * 4 + c % 4
    pos = ((r // 128) * 2 + c // 4) * 512 + (r % 32) * 16 + ((r % 128) // 32) * 4 + c % 4
    got = _bytes(a.scales)
    for j in range(k // 128):
        assert_bitwise_equal(got[j, pos], _bytes(want[:, 8 * j : 8 * j + 8]))
        used = torch.zeros(padded * 8, dtype=torch.bool)
        used[pos.flatten()] = True
        assert int(used.sum()) == rows * 8
        assert bool((got[j, ~used] == 0).all())
    assert_bitwise_equal(_block_scales(a), want)


def test_nvfp4_nibble_order_by_hand():
    # one block of exact E2M1 values with amax 6 under global scale 1: block scale 1 (zero SSE)
    x = torch.zeros(1, 128)
    x[0, :6] = torch.tensor([0.5, 6.0, -1.0, 0.0, 3.0, -6.0])
    a = fq.pack_activation(x, "w4a_nvfp4", global_scale=1.0)
    # code = sign << 3 | index into (0, .5, 1, 1.5, 2, 3, 4, 6); byte = code[2j] | code[2j+1] << 4
    assert _bytes(a.codes)[0, :4].tolist() == [0x71, 0x0A, 0xF5, 0x00]
    assert a.global_scale.item() == 1.0 and _block_scales(a)[0, 0].item() == 1.0
    assert a.decode(torch.float32)[0, :6].tolist() == [0.5, 6.0, -1.0, 0.0, 3.0, -6.0]


def test_nvfp4_zero_rows():
    a = fq.pack_activation(torch.zeros(2, 0, 256, dtype=torch.bfloat16), "w4a_nvfp4")
    assert a.codes.shape == (0, 128) and a.codes.dtype == FP4X2
    assert a.scales.shape == (2, 0) and a.global_scale.item() == 1.0
    assert a.decode().shape == (2, 0, 256)


def test_nvfp4_decode_saturates_to_the_output_dtype():
    # fp16 65504 with the nvidia recipe: g = fp16(65504 / 2688) = 24.375, 6 · 448 · g = 65520,
    # which rounds to inf in fp16: the decode clamps to 65504 instead
    x = torch.zeros(1, 128, dtype=torch.float16)
    x[0, 0] = 65504
    a = fq.pack_activation(x, "w4a_nvfp4", recipe="nvidia")
    assert a.global_scale.item() == 24.375
    assert a.decode(torch.float32)[0, 0].item() == 65520.0
    assert a.decode(torch.float16)[0, 0].item() == 65504.0


def test_dynamic_global_scale_depends_on_every_token_a_given_one_does_not():
    x = torch.zeros(2, 1, 128)
    x[0, 0, :16] = torch.linspace(-6, 6, 16)
    x[1, 0, 0] = 1e7  # g = 1e7 / 1792 ≈ 5580: row 0's block scale clamps at 2**-9
    both = fq.pack_activation(x, "w4a_nvfp4")
    alone = fq.pack_activation(x[:1], "w4a_nvfp4")
    assert both.global_scale.item() == (torch.tensor(1e7) / 1792).item()
    assert alone.global_scale.item() == (torch.tensor(6.0) / 1792).item()
    assert not torch.equal(_bytes(both.codes)[0], _bytes(alone.codes)[0])
    given_both = fq.pack_activation(x, "w4a_nvfp4", global_scale=0.5)
    given_alone = fq.pack_activation(x[:1], "w4a_nvfp4", global_scale=torch.tensor([0.5]))
    assert_bitwise_equal(_bytes(given_both.codes)[:1], _bytes(given_alone.codes))
    assert_bitwise_equal(_block_scales(given_both)[:1], _block_scales(given_alone))
    assert given_alone.global_scale.shape == () and given_alone.global_scale.item() == 0.5


# ------------------------------------------------------------------------------------------------
# rescale_tokens, exact, to, frozen
# ------------------------------------------------------------------------------------------------


def test_rescale_tokens_keeps_the_bytes_and_scales_each_row():
    x = _randn(2, 3, 128, dtype=torch.bfloat16, seed=3)
    a = fq.pack_activation(x, "w4a_nvfp4", reference=x)
    f = torch.tensor([0.5, 2.0, -1.0, 3.0, 0.0, 1e-3])
    b = a.rescale_tokens(f)
    assert b is not a and a.token_scale is None  # the old carrier is untouched
    assert b.codes is a.codes and b.scales is a.scales and b.global_scale is a.global_scale
    assert b.recipe == a.recipe and b.model_dtype == a.model_dtype
    assert_bitwise_equal(b.token_scale, f)
    want = (a.decode(torch.float32).reshape(6, 128) * f[:, None]).reshape(x.shape)
    assert_bitwise_equal(b.decode(torch.float32), want)
    want_ref = (x.reshape(6, 128).float() * f[:, None]).to(torch.bfloat16).reshape(x.shape)
    assert_bitwise_equal(b.reference, want_ref)
    f2 = torch.tensor([3.0, 0.1, 7.0, 1.0, 2.0, 0.3])
    c = b.rescale_tokens(f2)
    assert_bitwise_equal(c.token_scale, f * f2)
    assert_bitwise_equal(_bytes(c.codes), _bytes(a.codes))
    assert_bitwise_equal(_bytes(c.scales), _bytes(a.scales))
    # without a reference the rescaled carrier has none either
    assert fq.pack_activation(x, "w4a_nvfp4").rescale_tokens(f).reference is None


def test_rescale_tokens_decode_saturates_in_fp16():
    a = fq.pack_activation(torch.ones(1, 128, dtype=torch.float16), "w4a_nvfp4")
    y = a.rescale_tokens(torch.tensor([1e6])).decode()
    assert y.dtype == torch.float16 and bool((y == 65504).all())


def test_exact_is_the_reference_or_the_decode():
    x = _randn(3, 128, seed=4)
    ref = x.to(torch.bfloat16)
    a = fq.pack_activation(x, "w4afp8", reference=ref)
    assert_bitwise_equal(a.exact(), ref)
    assert_bitwise_equal(a.exact(torch.float32), ref.float())
    b = fq.pack_activation(x, "w4a_nvfp4")
    assert_bitwise_equal(b.exact(torch.float16), b.decode(torch.float16))
    assert b.exact().dtype == torch.bfloat16


@pytest.mark.parametrize("mode", ["w4afp8", "w4a_nvfp4"])
def test_to_returns_a_new_carrier_with_the_same_bytes(mode):
    x = _randn(2, 128, seed=5)
    a = fq.pack_activation(x, mode, reference=x)
    if mode == "w4a_nvfp4":
        a = a.rescale_tokens(torch.tensor([2.0, 0.5]))
    b = a.to("cpu")
    assert b is not a and b.codes.dtype == a.codes.dtype and b.scales.dtype == a.scales.dtype
    for name in ("codes", "scales", "global_scale", "token_scale", "reference"):
        old, new = getattr(a, name), getattr(b, name)
        assert (old is None) == (new is None), name
        if old is not None:
            assert_bitwise_equal(_bytes(new.reshape(-1)), _bytes(old.reshape(-1)), msg=name)


def test_the_carrier_is_frozen():
    a = fq.pack_activation(torch.ones(1, 128), "w4afp8")
    with pytest.raises(dataclasses.FrozenInstanceError):
        a.codes = a.codes  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        a.mode = "w4a_nvfp4"  # type: ignore[misc]


# ------------------------------------------------------------------------------------------------
# Validation: one test per message
# ------------------------------------------------------------------------------------------------


def _fp8_fields(**changes):
    fields = dict(
        codes=torch.ones(2, 128).to(E4M3),
        scales=torch.ones(2),
        shape=(2, 128),
        model_dtype=torch.bfloat16,
        mode="w4afp8",
    )
    return {**fields, **changes}


def _nvfp4_fields(**changes):
    fields = dict(
        codes=torch.zeros(2, 64, dtype=torch.uint8).view(FP4X2),
        scales=torch.zeros(1, 1024).to(E4M3),
        shape=(2, 128),
        model_dtype=torch.float16,
        mode="w4a_nvfp4",
        global_scale=torch.tensor(1.0),
        recipe="least_squares",
    )
    return {**fields, **changes}


META = torch.device("meta")

CARRIER_ERRORS = [
    ("mode", _fp8_fields(mode="w4a8"), ValueError, "mode must be one of w4afp8, w4a_nvfp4"),
    ("shape-kind", _fp8_fields(shape=[2, 128]), TypeError, "shape must be a tuple of ints"),
    ("shape-rank", _fp8_fields(shape=(128,)), ValueError, "at least two non-negative"),
    ("shape-k", _fp8_fields(shape=(2, 100)), ValueError, "positive multiple of 128"),
    ("dtype-kind", _fp8_fields(model_dtype="bf16"), TypeError, "model_dtype must be a torch.dtype"),
    ("dtype-fp64", _fp8_fields(model_dtype=torch.float64), ValueError, "bfloat16 or torch.float32"),
    ("codes-kind", _fp8_fields(codes=[[1.0]]), TypeError, "codes must be a torch.Tensor"),
    (
        "fp8-codes-dtype",
        _fp8_fields(codes=torch.ones(2, 128, dtype=torch.uint8)),
        TypeError,
        "codes must be torch.float8_e4m3fn",
    ),
    (
        "fp8-codes-shape",
        _fp8_fields(codes=torch.ones(3, 128).to(E4M3)),
        ValueError,
        r"codes must have shape \(2, 128\)",
    ),
    ("fp8-scales-dtype", _fp8_fields(scales=torch.ones(2).half()), TypeError, "scales must be t"),
    ("fp8-scales-shape", _fp8_fields(scales=torch.ones(2, 1)), ValueError, r"shape \(2,\)"),
    (
        "fp8-scales-value",
        _fp8_fields(scales=torch.tensor([1.0, 0.0])),
        ValueError,
        "scales must be finite and > 0",
    ),
    (
        "fp8-global-scale",
        _fp8_fields(global_scale=torch.tensor(1.0)),
        ValueError,
        "global_scale must be None in mode 'w4afp8'",
    ),
    ("fp8-recipe", _fp8_fields(recipe="nvidia"), ValueError, "recipe must be None"),
    ("fp8-token", _fp8_fields(token_scale=torch.ones(2)), ValueError, "token_scale must be None"),
    (
        "nvfp4-codes-dtype",
        _nvfp4_fields(codes=torch.zeros(2, 64, dtype=torch.uint8)),
        TypeError,
        "codes must be torch.float4_e2m1fn_x2",
    ),
    (
        "nvfp4-codes-shape",
        _nvfp4_fields(codes=torch.zeros(2, 128, dtype=torch.uint8).view(FP4X2)),
        ValueError,
        r"codes must have shape \(2, 64\)",
    ),
    (
        "nvfp4-scales-dtype",
        _nvfp4_fields(scales=torch.zeros(1, 1024, dtype=torch.uint8)),
        TypeError,
        "scales must be torch.float8_e4m3fn",
    ),
    (
        "nvfp4-scales-shape",
        _nvfp4_fields(scales=torch.zeros(1, 512).to(E4M3)),
        ValueError,
        r"scales must have shape \(1, 1024\)",
    ),
    ("gs-missing", _nvfp4_fields(global_scale=None), ValueError, "global_scale is required"),
    (
        "gs-dtype",
        _nvfp4_fields(global_scale=torch.tensor(1.0, dtype=torch.float64)),
        TypeError,
        "global_scale must be float32",
    ),
    ("gs-size", _nvfp4_fields(global_scale=torch.ones(2)), ValueError, "must hold one value"),
    (
        "gs-value",
        _nvfp4_fields(global_scale=torch.tensor([math.inf])),
        ValueError,
        "global_scale must be positive and finite",
    ),
    ("recipe-missing", _nvfp4_fields(recipe=None), ValueError, "recipe is required"),
    ("recipe-alias", _nvfp4_fields(recipe="lsq"), ValueError, "recipe must be a canonical name"),
    ("recipe-unknown", _nvfp4_fields(recipe="best"), ValueError, "Unsupported NVFP4 scale recipe"),
    (
        "token-dtype",
        _nvfp4_fields(token_scale=torch.ones(2).half()),
        TypeError,
        "token_scale must be torch.float32",
    ),
    ("token-shape", _nvfp4_fields(token_scale=torch.ones(3)), ValueError, r"shape \(2,\)"),
    (
        "token-value",
        _nvfp4_fields(token_scale=torch.tensor([1.0, math.nan])),
        ValueError,
        "token_scale contains NaN or infinity",
    ),
    (
        "reference-kind",
        _nvfp4_fields(reference=torch.ones(2, 128, dtype=torch.int32)),
        TypeError,
        "reference must be a floating-point tensor",
    ),
    (
        "reference-shape",
        _nvfp4_fields(reference=torch.ones(1, 2, 128)),
        ValueError,
        r"reference must have the logical shape \(2, 128\)",
    ),
    (
        "devices",
        _nvfp4_fields(reference=torch.ones(2, 128, device=META)),
        TypeError,
        "every tensor must be on one device, got codes on cpu, .* reference on meta",
    ),
    (
        "meta",
        _fp8_fields(
            codes=torch.ones(2, 128, device=META).to(E4M3), scales=torch.ones(2, device=META)
        ),
        TypeError,
        "codes is a meta tensor",
    ),
]


@pytest.mark.parametrize(
    ("fields", "error", "match"),
    [case[1:] for case in CARRIER_ERRORS],
    ids=[case[0] for case in CARRIER_ERRORS],
)
def test_carrier_validation(production_checks, fields, error, match):
    with pytest.raises(error, match=match):
        fq.W4AActivation(**fields)


def test_valid_carriers_build():
    assert fq.W4AActivation(**_fp8_fields()).rows == 2
    assert fq.W4AActivation(**_nvfp4_fields(token_scale=torch.zeros(2))).k == 128


PACK_ERRORS = [
    ("x-kind", dict(x=torch.ones(1, 128, dtype=torch.int32)), TypeError, "x must be a floating"),
    ("x-rank", dict(x=torch.ones(128)), ValueError, "x must have at least 2 dimensions"),
    ("x-k", dict(x=torch.ones(1, 100)), ValueError, "K must be a positive multiple of 128"),
    ("x-k0", dict(x=torch.ones(1, 0)), ValueError, "K must be a positive multiple of 128"),
    ("x-nan", dict(x=torch.full((1, 128), math.nan)), ValueError, "x contains NaN or infinity"),
    (
        "x-f64",
        dict(x=torch.full((1, 128), 1e300, dtype=torch.float64)),
        ValueError,
        "exceed FP32's range",
    ),
    ("mode", dict(mode="nvfp4"), ValueError, "mode must be one of"),
    (
        "fp8-recipe",
        dict(mode="w4afp8", recipe="nvidia"),
        ValueError,
        "recipe applies to mode 'w4a_nvfp4' only",
    ),
    (
        "fp8-gs",
        dict(mode="w4afp8", global_scale=1.0),
        ValueError,
        "global_scale applies to mode 'w4a_nvfp4' only",
    ),
    ("gs-zero", dict(global_scale=0.0), ValueError, "global_scale must be positive and finite"),
    ("gs-size", dict(global_scale=torch.ones(2)), ValueError, "global_scale must hold one value"),
    ("gs-kind", dict(global_scale="1"), TypeError, "global_scale must be a real number"),
    ("recipe", dict(recipe="best"), ValueError, "Unsupported NVFP4 scale recipe"),
    ("model-dtype", dict(model_dtype=torch.float64), ValueError, "model_dtype must be torch.f"),
    (
        "reference-kind",
        dict(reference=torch.ones(2, 128, dtype=torch.int64)),
        TypeError,
        "reference must be a floating-point tensor",
    ),
    (
        "reference-shape",
        dict(reference=torch.ones(1, 128)),
        ValueError,
        r"reference must have x's shape \(2, 128\)",
    ),
    (
        "reference-device",
        dict(reference=torch.ones(2, 128, device=META)),
        TypeError,
        "reference is on meta, x on cpu",
    ),
]


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [case[1:] for case in PACK_ERRORS],
    ids=[case[0] for case in PACK_ERRORS],
)
def test_pack_validation(production_checks, kwargs, error, match):
    kwargs = {"x": torch.ones(2, 128), "mode": "w4a_nvfp4", **kwargs}
    x, mode = kwargs.pop("x"), kwargs.pop("mode")
    with pytest.raises(error, match=match):
        fq.pack_activation(x, mode, **kwargs)


RESCALE_ERRORS = [
    ("fp8", "w4afp8", torch.ones(2), ValueError, "only a 'w4a_nvfp4' carrier has a token_scale"),
    ("dtype", "w4a_nvfp4", torch.ones(2).double(), TypeError, "f must be torch.float32"),
    ("shape", "w4a_nvfp4", torch.ones(2, 1), ValueError, r"f must have shape \(2,\)"),
    ("device", "w4a_nvfp4", torch.ones(2, device=META), TypeError, "f is on meta, the carrier"),
    ("finite", "w4a_nvfp4", torch.tensor([1.0, math.inf]), ValueError, "f contains NaN or inf"),
]


@pytest.mark.parametrize(
    ("mode", "f", "error", "match"),
    [case[1:] for case in RESCALE_ERRORS],
    ids=[case[0] for case in RESCALE_ERRORS],
)
def test_rescale_tokens_validation(production_checks, mode, f, error, match):
    a = fq.pack_activation(torch.ones(2, 128), mode)
    with pytest.raises(error, match=f"W4AActivation.rescale_tokens: {match}"):
        a.rescale_tokens(f)


def test_decode_dtype_validation(production_checks):
    a = fq.pack_activation(torch.ones(1, 128), "w4afp8")
    with pytest.raises(TypeError, match="decode: dtype must be a floating torch.dtype"):
        a.decode(torch.int32)
    with pytest.raises(TypeError, match="exact: dtype must be a floating torch.dtype"):
        a.exact("float16")


# ------------------------------------------------------------------------------------------------
# The interpreter: on CPU tensors under TRITON_INTERPRET=1 the pack takes the Triton fp8_pack
# ------------------------------------------------------------------------------------------------


@pytest.mark.skipif(
    not can_interpret(),
    reason="needs Triton installed and no CUDA device (with CUDA the compiled kernel is tested)",
)
def test_interpreter_suite():
    run_interpreted_tests(__file__, expected=1)


@needs_interpreter
def test_interpreted_fp8_pack_takes_the_kernel_and_gives_the_pure_bytes():
    for dtype in (torch.float16, torch.float32):  # the interpreter truncates into bfloat16
        x = _randn(2, 3, 256, dtype=dtype, seed=9)
        x[0, 1] = 0
        assert fp8_pack_reason(x.reshape(6, 256)) is None
        a = fq.pack_activation(x, "w4afp8")
        t = fq.fp8_token_quantize(x.reshape(6, 256))
        assert_bitwise_equal(a.codes, t.codes)
        assert_bitwise_equal(a.scales, t.scale[:, 0])
        view = _randn(6, 512, dtype=dtype, seed=10)[:, 128:384]  # rows 512 apart
        strided = fq.pack_activation(view, "w4afp8")
        assert_bitwise_equal(strided.codes, fq.fp8_token_quantize(view).codes)


# ------------------------------------------------------------------------------------------------
# GPU: the CUDA pack gives the CPU pack's bytes
# ------------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(1, 128), (3, 5, 256), (257, 1024), (0, 128)])
def test_cuda_fp8_pack_equals_cpu_pack_bitwise(dtype, shape):
    x = _randn(*shape, dtype=dtype, seed=6)
    if x.numel():
        x.reshape(-1, shape[-1])[0] = 0  # a zero token
    gpu = fq.pack_activation(x.cuda(), "w4afp8")
    cpu = fq.pack_activation(x, "w4afp8")
    assert gpu.codes.is_cuda and gpu.scales.is_cuda
    assert_bitwise_equal(gpu.codes.cpu(), cpu.codes)
    assert_bitwise_equal(gpu.scales.cpu(), cpu.scales)
    assert_bitwise_equal(gpu.decode().cpu(), cpu.decode())


@pytest.mark.gpu
def test_cuda_fp8_pack_takes_the_kernel_on_hopper():
    from floatxq.kernels.w4a_fp8 import w4a_fp8_unavailable_reason

    x = torch.ones(2, 128, device="cuda")
    assert fp8_pack_reason(x) == w4a_fp8_unavailable_reason(x.device)
    if torch.cuda.get_device_capability() >= (8, 9):
        assert fp8_pack_reason(x) is None


@pytest.mark.gpu
@pytest.mark.parametrize("recipe", ["nvidia", "least_squares"])
def test_cuda_nvfp4_pack_equals_cpu_pack_bitwise(recipe):
    x = _randn(3, 50, 256, dtype=torch.bfloat16, seed=7)
    gpu = fq.pack_activation(x.cuda(), "w4a_nvfp4", recipe=recipe)
    cpu = fq.pack_activation(x, "w4a_nvfp4", recipe=recipe)
    assert_bitwise_equal(_bytes(gpu.codes.cpu()), _bytes(cpu.codes))
    assert_bitwise_equal(_bytes(gpu.scales.cpu()), _bytes(cpu.scales))
    assert_bitwise_equal(gpu.global_scale.cpu(), cpu.global_scale)
    assert_bitwise_equal(gpu.decode().cpu(), cpu.decode())


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["w4afp8", "w4a_nvfp4"])
def test_to_cuda_and_back_moves_bytes_exactly(mode):
    x = _randn(2, 3, 256, seed=8)
    a = fq.pack_activation(x, mode, reference=x.to(torch.bfloat16))
    if mode == "w4a_nvfp4":
        a = a.rescale_tokens(torch.arange(1.0, 7.0))
    there = a.to("cuda")
    assert there.codes.is_cuda and there.codes.dtype == a.codes.dtype
    back = there.to(torch.device("cpu"))
    for name in ("codes", "scales", "global_scale", "token_scale", "reference"):
        old, new = getattr(a, name), getattr(back, name)
        if old is not None:
            assert_bitwise_equal(_bytes(new.reshape(-1)), _bytes(old.reshape(-1)), msg=name)
    assert_bitwise_equal(there.decode().cpu(), a.decode())


# ----------------------------------------------------------------------------------------------
# The pure pack and the dispatched one; the trusted constructor
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["w4afp8", "w4a_nvfp4"])
def test_pure_pack_equals_the_dispatched_pack_bytes(mode):
    from floatxq.w4a.activation import pack_activation as pure_pack

    x = _randn(3, 256, dtype=torch.bfloat16, seed=41)
    pure, routed = pure_pack(x, mode), fq.pack_activation(x, mode)
    assert fq.pack_activation is fq.dispatch.pack_activation
    assert_bitwise_equal(_bytes(pure.codes), _bytes(routed.codes))
    assert_bitwise_equal(pure.scales.view(torch.uint8), routed.scales.view(torch.uint8))
    if mode == "w4a_nvfp4":
        assert_bitwise_equal(pure.global_scale, routed.global_scale)


def test_trusted_skips_value_checks_but_the_test_hook_checks_structure():
    from floatxq._typing import CHECKING

    good = fq.pack_activation(torch.ones(2, 128), "w4a_nvfp4")
    fields = {f.name: getattr(good, f.name) for f in dataclasses.fields(good)}
    nan = torch.tensor(float("nan"))
    trusted = fq.W4AActivation.trusted(**{**fields, "global_scale": nan})  # no host read
    assert trusted.global_scale is nan
    with pytest.raises(ValueError, match="global_scale must be positive and finite"):
        fq.W4AActivation(**{**fields, "global_scale": nan})
    with pytest.raises(TypeError, match="field 'codes' is required"):
        fq.W4AActivation.trusted(**{k: v for k, v in fields.items() if k != "codes"})
    with pytest.raises(TypeError, match=r"unknown field\(s\) \['extra'\]"):
        fq.W4AActivation.trusted(**fields, extra=1)
    wrong = {**fields, "codes": good.codes.view(torch.uint8)}
    if CHECKING:  # the test run: structure still checked (dtype, shape, device)
        with pytest.raises(TypeError, match="codes"):
            fq.W4AActivation.trusted(**wrong)
    else:
        assert fq.W4AActivation.trusted(**wrong).codes.dtype == torch.uint8
