"""``quantize_fp8_weight_kernel`` equals ``quantize_fp8_weight`` bit for bit, fuzzed.

GPU tests run the compiled kernel (both conversions: PTX and the integer encoder). Without CUDA,
``test_interpreter_suite`` reruns this file's ``interpreted`` tests in a child process under
``TRITON_INTERPRET=1`` (Triton picks interpreter or compiler when it jits the kernels, so the
variable must be set before that), on small shapes. The argument checks need neither. Small
tuning records (tiles of 128-256 elements, two-pass tensor scaling from 128 elements) make small
shapes take every loop and launch path of the kernel.
"""

import dataclasses
import itertools
import warnings

import pytest
import torch

import floatxq as fq
from floatxq.dispatch import quantize_fp8_weight_auto
from floatxq.kernels import (
    FP8WeightTuning,
    quantize_fp8_input,
    quantize_fp8_weight_kernel,
    triton_available,
    triton_unavailable_reason,
)
from floatxq.kernels import fp8_weight as kernel_module
from floatxq.testing import assert_bitwise_equal, unchecked
from floatxq.testing.interpreter import can_interpret, needs_interpreter, run_interpreted_tests

ENCODABLE = ["float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz"]
PTX_FORMATS = ["float8_e4m3fn", "float8_e5m2"]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]

# (rows, cols, method, block): empty, one row, ragged rows, large K, block layouts, odd blocks,
# single regions larger than one tile, and the two-pass tensor path (> 65536 elements).
GPU_CASES = [
    (0, 64, "row", None),
    (64, 0, "row", None),
    (0, 0, "tensor", None),
    (0, 256, "block", (128, 128)),
    (1, 1, "tensor", None),
    (1, 1, "row", None),
    (1, 8192, "tensor", None),
    (1, 4096, "row", None),
    (3, 5, "tensor", None),
    (7, 33, "row", None),
    (33, 20000, "row", None),
    (5, 70000, "tensor", None),
    (1024, 1024, "tensor", None),
    (300, 7, "row", None),
    (256, 384, "block", (128, 128)),
    (384, 256, "block", (128, 128)),
    (256, 512, "block", (1, 128)),
    (7, 4096, "block", (1, 128)),
    (96, 160, "block", (32, 32)),
    (64, 48, "block", (16, 3)),
    (6, 10, "block", (3, 5)),
    (512, 512, "block", (512, 512)),
    (300, 21, "block", (300, 7)),
    (4096, 16, "block", (1, 16)),
]

SMALL_TUNING = FP8WeightTuning(
    row_tile=128,
    block_tile=256,
    row_elements_per_warp=128,
    block_elements_per_warp=128,
    tensor_one_program=128,
    amax_programs_per_sm=1,
    max_partials=128,
)
"""Tiles of 128-256 elements: blocks and rows span several tiles (the kernel's loops), and tensor
scaling takes the two-launch path from 129 elements on, with a strided amax pass."""

# (rows, cols, method, block, tuning) per layout and launch path, each a few programs: a
# non-finite value anywhere in any of them must raise
LAYOUTS = [
    (6, 40, "tensor", None, None),  # one program
    (8, 40, "tensor", None, SMALL_TUNING),  # two launches: strided partial maxima, then codes
    (7, 33, "row", None, None),
    (3, 300, "row", None, SMALL_TUNING),  # rows wider than a tile
    (8, 10, "block", (4, 5), None),
    (16, 64, "block", (16, 32), SMALL_TUNING),  # blocks of several tiles
    (6, 256, "block", (1, 128), None),  # per-row blocks
]
NON_FINITE = [float("nan"), float("inf"), float("-inf")]


def _weight(seed: int, rows: int, cols: int, dtype: torch.dtype) -> torch.Tensor:
    """Seeded rows spanning many binades, plus zero rows and subnormal-only rows/blocks."""
    g = torch.Generator().manual_seed(seed)
    span = 12 if dtype == torch.float16 else 40
    w = torch.randn(rows, cols, generator=g) * torch.exp2(
        torch.randint(-span, span, (rows, 1), generator=g).float()
    )
    if rows > 2 and cols:
        w[1] = 0.0  # an all-zero row (and block rows)
        # a row whose amax is subnormal: scale_inv is capped at FLT_MAX, codes still nonzero
        w[2] = 0.0
        tiny = 2.0**-20 if dtype == torch.float16 else 2.0**-130
        w[2, :: max(1, cols // 3)] = tiny
    if rows > 3 and cols > 1:
        w[3, 0] = 2.0**-149 if dtype == torch.float32 else 0.0  # the smallest FP32
    if dtype == torch.float16:
        w = w.clamp(-6e4, 6e4)
    return w.to(dtype)


def _check(w: torch.Tensor, name: str, method: str, block, tuning=None, **kernel_kw) -> None:
    kw = dict(format=name, weight_scale_method=method, weight_block_size=block)
    if tuning is not None:
        kernel_kw["tuning"] = tuning
    if kernel_kw and set(kernel_kw) != {"tuning"}:
        block_ = fq.normalize_fp8_block_size(block)
        codes, scale = kernel_module._launch(
            w, name, fq.normalize_fp8_scale_method(method, weight_block_size=block_), block_,
            **kernel_kw,
        )  # fmt: skip
        got = fq.FP8Weight(codes, scale)
    else:
        got = quantize_fp8_weight_kernel(w, **kw, **kernel_kw)
    want = fq.quantize_fp8_weight(w, **kw)
    label = f"{name} {method} {block} {tuple(w.shape)} {w.dtype}"
    assert got.qweight.device == w.device and got.scale_inv.device == w.device
    assert_bitwise_equal(got.qweight, want.qweight, msg=f"codes {label}")
    assert_bitwise_equal(got.scale_inv, want.scale_inv, msg=f"scale_inv {label}")


# ----------------------------------------------------------------------------------------------
# GPU: the compiled kernel
# ----------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("name", ENCODABLE)
@pytest.mark.parametrize("dtype", DTYPES)
def test_kernel_equals_pure_on_fuzzed_shapes(name, dtype):
    for seed, (rows, cols, method, block) in enumerate(GPU_CASES):
        _check(_weight(seed, rows, cols, dtype).cuda(), name, method, block)


@pytest.mark.gpu
@pytest.mark.parametrize("name", PTX_FORMATS)
@pytest.mark.parametrize("convert", ["ptx", "integer"])
def test_both_conversions_equal_pure(name, convert):
    for seed, (rows, cols, method, block) in enumerate(GPU_CASES[:16]):
        w = _weight(100 + seed, rows, cols, torch.float32).cuda()
        _check(w, name, method, block, convert=convert)


@pytest.mark.gpu
@pytest.mark.parametrize("name", ENCODABLE)
def test_every_bf16_value_and_every_midpoint_converts_like_torch(name):
    """Rows whose amax is fp8_max (scale_inv = 1) carry every bf16 value and every FP32 midpoint
    between neighbouring FP8 values (and its two FP32 neighbours): the conversion itself."""
    fmax = fq.fp8_max(name)
    values = _conversion_values(name).clamp(-fmax, fmax)
    width = 255
    pad = (-values.numel()) % width
    rows = torch.cat([values, torch.zeros(pad)]).reshape(-1, width)
    w = torch.cat([torch.full((rows.shape[0], 1), fmax), rows], dim=1).cuda()
    _check(w, name, "row", None)
    assert bool((fq.quantize_fp8_weight(w, format=name).scale_inv == 1).all())


@pytest.mark.gpu
def test_tensor_scale_with_many_partial_maxima():
    # 8200 rows of 8192: the amax pass's programs (a few per SM) each loop over ~30 strided row
    # tiles, the last loop partly past the end; the global amax sits in a middle row, then in
    # the last row (the last tile of the last loop)
    w = _weight(9, 8200, 8192, torch.bfloat16).cuda()
    w[4321, 77] = 3.0e30
    _check(w, "float8_e4m3fn", "tensor", None)
    w[8199, 8191] = -5.0e30
    _check(w, "float8_e4m3fn", "tensor", None)
    _check(w[:8190], "float8_e5m2", "tensor", None)  # without it: the amax of the rest


@pytest.mark.gpu
def test_repeated_and_misaligned_launches_equal_pure():
    """From the second launch of a configuration on, Triton's argument binding is skipped (the
    compiled kernel is called directly): new data, and views whose data pointer is not 16-byte
    aligned (a different specialization of the kernel), still give the pure function's bytes."""
    for seed, (rows, cols, method, block) in enumerate(GPU_CASES):
        for repeat in range(3):
            w = _weight(1000 * repeat + seed, rows, cols, torch.bfloat16).cuda()
            _check(w, "float8_e4m3fn", method, block)
        if rows * cols:
            flat = torch.empty(rows * cols + 1, dtype=torch.bfloat16, device="cuda")
            flat[1:] = w.flatten()
            shifted = flat[1:].view(rows, cols)
            assert shifted.data_ptr() % 16
            _check(shifted, "float8_e4m3fn", method, block)
            _check(w, "float8_e4m3fn", method, block)  # and the aligned one again
    assert len(kernel_module.compiled_kernels()) > 0  # the compiled kernels were kept
    x = _weight(77, 33, 512, torch.bfloat16).cuda()
    want = fq.quantize_fp8_weight(x, weight_scale_method="block", weight_block_size=(1, 128))
    for source in (x, torch.cat([x.flatten()[:1], x.flatten()])[1:].view(33, 512)):
        for _ in range(2):
            scale = torch.empty(4, 48, device="cuda").t()
            codes = quantize_fp8_input(
                source, format="float8_e4m3fn", method="block", block=(1, 128),
                scale_out=scale, rows_out=48,
            )  # fmt: skip
            assert_bitwise_equal(codes[:33], want.qweight)
            assert_bitwise_equal(scale[:33].contiguous(), 1 / want.scale_inv)


@pytest.mark.gpu
def test_strided_and_transposed_inputs():
    w = _weight(7, 256, 384, torch.bfloat16).cuda()
    _check(w.t(), "float8_e4m3fn", "row", None)  # a transposed view (HF Conv1D's weight)
    _check(w[:, ::2], "float8_e5m2", "block", (128, 64))
    _check(w.double(), "float8_e4m3fn", "tensor", None)  # fp64 goes through FP32 first


@pytest.mark.gpu
def test_kernel_rejects_what_pure_rejects_on_cuda():
    w = torch.ones(8, 8, device="cuda")
    for bad in (float("inf"), float("nan")):
        x = w.clone()
        x[3, 4] = bad
        for method, block in (("row", None), ("tensor", None), ("block", (4, 4))):
            with pytest.raises(ValueError, match="NaN or infinity"):
                unchecked(quantize_fp8_weight_kernel)(
                    x, weight_scale_method=method, weight_block_size=block
                )
    big = torch.full((600, 200), 1.0, device="cuda")
    big[599, 199] = float("inf")  # the two-pass tensor path
    with pytest.raises(ValueError, match="NaN or infinity"):
        unchecked(quantize_fp8_weight_kernel)(big, weight_scale_method="tensor")
    with pytest.raises(ValueError, match="NaN or infinity"):  # checked before divisibility
        unchecked(quantize_fp8_weight_kernel)(
            torch.full((6, 6), float("nan"), device="cuda"),
            weight_scale_method="block",
            weight_block_size=(4, 4),
        )


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["float8_e4m3fn", "float8_e5m2fnuz"])
def test_tuning_records_change_no_byte(name):
    for seed, (rows, cols, method, block) in enumerate(GPU_CASES):
        _check(_weight(200 + seed, rows, cols, torch.bfloat16).cuda(), name, method, block,
               SMALL_TUNING)  # fmt: skip


@pytest.mark.gpu
def test_non_finite_weights_raise_from_the_kernel_itself(monkeypatch):
    _check_non_finite("cuda", monkeypatch)


@pytest.mark.gpu
def test_dispatcher_takes_triton_on_cuda():
    w = _weight(3, 128, 256, torch.bfloat16).cuda()
    kw = dict(weight_scale_method="block", weight_block_size=(128, 128))
    q, route, reason = quantize_fp8_weight_auto(w, **kw)
    assert (route, reason) == ("triton", None)
    want = fq.quantize_fp8_weight(w.cpu(), **kw)
    assert_bitwise_equal(q.qweight.cpu(), want.qweight)
    assert_bitwise_equal(q.scale_inv.cpu(), want.scale_inv)


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("method", "block", "scale_shape", "transposed"),
    [
        ("tensor", None, (), False),
        ("row", None, (37, 1), False),
        ("block", (1, 128), (37, 4), True),
    ],
)
def test_input_quantization_codes_and_direct_scales(method, block, scale_shape, transposed):
    x = _weight(11, 37, 512, torch.bfloat16).cuda()
    if transposed:  # the (M, K/128) grid with strides (1, M) that blockwise scaled_mm wants
        scale = torch.empty(scale_shape[::-1], device="cuda").t()
    else:
        scale = torch.empty(scale_shape, device="cuda")
    codes = quantize_fp8_input(
        x, format="float8_e4m3fn", method=method, block=block, scale_out=scale
    )
    want = fq.quantize_fp8_weight(x, weight_scale_method=method, weight_block_size=block)
    assert_bitwise_equal(codes, want.qweight)
    inverse = want.scale_inv.reshape(scale_shape)
    assert_bitwise_equal(scale.contiguous(), torch.ones_like(inverse) / inverse)
    if method != "tensor":  # padding to more rows: zero codes and unit scales below x's rows
        rows_out = 48
        grid = (scale_shape[1], rows_out) if transposed else (rows_out, *scale_shape[1:])
        padded = torch.empty(grid, device="cuda")
        padded = padded.t() if transposed else padded
        codes = quantize_fp8_input(
            x, format="float8_e4m3fn", method=method, block=block, scale_out=padded,
            rows_out=rows_out,
        )  # fmt: skip
        zeros = torch.nn.functional.pad(x, (0, 0, 0, rows_out - 37))
        want_padded = fq.quantize_fp8_weight(
            zeros, weight_scale_method=method, weight_block_size=block
        )
        assert_bitwise_equal(codes, want_padded.qweight)
        inverse = want_padded.scale_inv.reshape(padded.shape)
        assert_bitwise_equal(padded.contiguous(), torch.ones_like(inverse) / inverse)
    torch_codes = quantize_fp8_input(  # the no-Triton path gives the same bytes
        x.cpu(), format="float8_e4m3fn", method=method, block=block,
        scale_out=torch.empty(scale_shape),
    )  # fmt: skip
    assert_bitwise_equal(torch_codes, want.qweight.cpu())


# ----------------------------------------------------------------------------------------------
# CPU: the interpreter (small shapes) and the argument checks
# ----------------------------------------------------------------------------------------------


@pytest.mark.skipif(
    not can_interpret(),
    reason="needs Triton installed and no CUDA device (with CUDA the compiled kernel is tested)",
)
def test_interpreter_suite():
    run_interpreted_tests(__file__, expected=11)  # every interpreted test below ran


INTERPRETER_CASES = [
    (0, 16, "row", None),
    (5, 0, "row", None),
    (1, 1, "tensor", None),
    (7, 33, "row", None),
    (5, 40, "tensor", None),
    (200, 400, "tensor", None),
    (2, 20000, "row", None),
    (32, 96, "block", (16, 32)),
    (6, 10, "block", (3, 5)),
    (9, 256, "block", (1, 128)),
    (64, 64, "block", (64, 64)),
    (256, 128, "block", (256, 128)),
]


@pytest.fixture
def interpret():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # numpy overflow in 448 / FLT_MIN
        yield


@needs_interpreter
@pytest.mark.parametrize("name", ENCODABLE)
def test_interpreted_kernel_equals_pure(interpret, name):
    for seed, (rows, cols, method, block) in enumerate(INTERPRETER_CASES):
        dtype = DTYPES[seed % 3]
        _check(_weight(seed, rows, cols, dtype), name, method, block)


@needs_interpreter
@pytest.mark.parametrize("name", ENCODABLE)
def test_interpreted_integer_encoder_on_every_bf16_and_midpoint(interpret, name):
    fmax = fq.fp8_max(name)
    values = _conversion_values(name).clamp(-fmax, fmax)
    width = 255
    pad = (-values.numel()) % width
    rows = torch.cat([values, torch.zeros(pad)]).reshape(-1, width)
    w = torch.cat([torch.full((rows.shape[0], 1), fmax), rows], dim=1)
    _check(w, name, "row", None)


@needs_interpreter
def test_interpreted_direct_scales_for_inputs(interpret):
    x = _weight(5, 6, 256, torch.float32)
    scale = torch.empty(2, 6).t()
    codes, _ = kernel_module._launch(
        x, "float8_e4m3fn", "block", (1, 128), scale_out=scale, direct=True
    )
    want = fq.quantize_fp8_weight(x, weight_scale_method="block", weight_block_size=(1, 128))
    assert_bitwise_equal(codes, want.qweight)
    assert_bitwise_equal(scale.contiguous(), torch.ones_like(want.scale_inv) / want.scale_inv)
    # padded to 16 rows without copying x: zero codes and unit scales in the extra rows
    padded = torch.empty(2, 16).t()
    codes, _ = kernel_module._launch(
        x, "float8_e4m3fn", "block", (1, 128), scale_out=padded, direct=True, rows_out=16
    )
    zeros = torch.nn.functional.pad(x, (0, 0, 0, 10))
    want = fq.quantize_fp8_weight(zeros, weight_scale_method="block", weight_block_size=(1, 128))
    assert_bitwise_equal(codes, want.qweight)
    assert_bitwise_equal(padded.contiguous(), torch.ones_like(want.scale_inv) / want.scale_inv)


@needs_interpreter
def test_interpreted_non_finite_weights_raise_from_the_kernel_itself(interpret, monkeypatch):
    _check_non_finite("cpu", monkeypatch)


@needs_interpreter
def test_interpreted_tuning_records_change_no_byte(interpret):
    for seed, (rows, cols, method, block) in enumerate(INTERPRETER_CASES):
        if rows * cols <= 20000:  # (every layout and path, at interpreter cost)
            _check(_weight(seed, rows, cols, DTYPES[seed % 3]), "float8_e4m3fn", method, block,
                   SMALL_TUNING)  # fmt: skip


def _no_second_pass(*args, **kwargs):
    raise AssertionError("the weight was read a second time to check finiteness")


def _check_non_finite(device, monkeypatch):
    """NaN, +inf and -inf as the first, a middle and the last element of every layout and launch
    path (on the GPU every value at every place; interpreted, every value and every place once
    per layout, rotating): the kernel's own flag raises the pure function's error (no pass of its
    own over the weight), nothing is returned, and the next finite call is unaffected."""
    monkeypatch.setattr(kernel_module, "require_finite", _no_second_pass)
    for i, (rows, cols, method, block, tuning) in enumerate(LAYOUTS):
        w = _weight(300 + i, rows, cols, DTYPES[i % 3]).to(device)
        kw = dict(weight_scale_method=method, weight_block_size=block)
        tuned = kw if tuning is None else dict(kw, tuning=tuning)
        places = [(0, 0), (rows // 2, cols // 2), (rows - 1, cols - 1)]
        if device == "cpu":  # the interpreter: each value and each place once per layout
            cases = [(NON_FINITE[j], places[(i + j) % 3]) for j in range(3)]
        else:
            cases = list(itertools.product(NON_FINITE, places))
        for value, (r, c) in cases:
            bad = w.clone()
            bad[r, c] = value
            with pytest.raises(ValueError) as pure:
                fq.quantize_fp8_weight(bad.cpu(), **kw)
            with pytest.raises(ValueError, match="weight contains NaN or infinity") as kernel:
                quantize_fp8_weight_kernel(bad, **tuned)
            assert str(pure.value).split(":", 1)[1] in str(kernel.value)
        _check(w, "float8_e4m3fn", method, block, tuning)


def test_tuning_records_reject_what_the_kernel_cannot_launch():
    with pytest.raises(ValueError, match="row_tile must be a power of two >= 128, got 100"):
        FP8WeightTuning(row_tile=100)
    with pytest.raises(ValueError, match="block_elements_per_warp must be a power of two"):
        FP8WeightTuning(block_elements_per_warp=64)
    with pytest.raises(ValueError, match="amax_programs_per_sm must be >= 1, got 0"):
        FP8WeightTuning(amax_programs_per_sm=0)
    assert dataclasses.replace(SMALL_TUNING, row_tile=256).row_tile == 256


BAD_ARGUMENTS = [
    (torch.ones(4, 4, dtype=torch.int32), {}, TypeError),
    (torch.ones(2, 2, 2), {}, ValueError),
    (torch.ones(4, 4), {"format": "float8_e8m0fnu"}, ValueError),
    (torch.ones(4, 4), {"format": "e3m4"}, ValueError),
    (torch.ones(4, 4), {"weight_scale_method": "column"}, ValueError),
    (torch.ones(4, 4), {"weight_scale_method": "block"}, ValueError),
    (torch.ones(4, 4), {"weight_block_size": (3, 4)}, ValueError),
    (torch.tensor([[1.0, float("inf")]]), {}, ValueError),
    (torch.tensor([[1.0, float("nan")]]), {"weight_block_size": (1, 3)}, ValueError),
]


@pytest.mark.parametrize(("weight", "kwargs", "error"), BAD_ARGUMENTS)
def test_kernel_raises_the_pure_functions_errors_first(weight, kwargs, error):
    with pytest.raises(error) as pure:
        unchecked(fq.quantize_fp8_weight)(weight, **kwargs)
    with pytest.raises(error) as kernel:
        unchecked(quantize_fp8_weight_kernel)(weight, **kwargs)
    first = str(pure.value).split(":", 1)[-1]
    assert first.strip() and first in str(kernel.value)  # same message after the function name


def test_kernel_on_cpu_names_what_is_missing(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    if triton_available():
        with pytest.raises(TypeError, match="CUDA tensor"):
            quantize_fp8_weight_kernel(torch.ones(4, 4))
    else:
        with pytest.raises(RuntimeError, match="Triton"):
            quantize_fp8_weight_kernel(torch.ones(4, 4))


def test_dispatcher_falls_back_to_torch_with_a_reason(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    w = _weight(4, 64, 128, torch.bfloat16)
    for method, block in (("tensor", None), ("row", None), ("block", (32, 64))):
        q, route, reason = quantize_fp8_weight_auto(
            w, format="e5m2", weight_scale_method=method, weight_block_size=block
        )
        assert route == "torch" and "cpu" in reason
        want = fq.quantize_fp8_weight(
            w, format="e5m2", weight_scale_method=method, weight_block_size=block
        )
        assert_bitwise_equal(q.qweight, want.qweight)
        assert_bitwise_equal(q.scale_inv, want.scale_inv)
    assert "cpu" in triton_unavailable_reason(torch.device("cpu")) or not triton_available()
    with pytest.raises(ValueError):
        quantize_fp8_weight_auto(w, weight_block_size=(7, 7))


def test_format_constants_come_from_the_names():
    # (mantissa bits, bias) that give each format's largest value: (2 - 2**-m) * 2**(emax - bias)
    for name, (mant, bias, fnuz) in {
        "float8_e4m3fn": (3, 7, False),
        "float8_e5m2": (2, 15, False),
        "float8_e4m3fnuz": (3, 8, True),
        "float8_e5m2fnuz": (2, 16, True),
    }.items():
        assert kernel_module._format_bits(name) == (mant, bias, fnuz)
        smallest_normal = 2.0 ** (1 - bias)
        assert torch.finfo(fq.fp8_dtype(name)).smallest_normal == smallest_normal


def _conversion_values(name: str) -> torch.Tensor:
    """Every finite bf16 value, and each midpoint between neighbouring finite values of ``name``
    with its two FP32 neighbours (the round-half-to-even cases)."""
    bf16 = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    values = bf16.float()
    values = values[torch.isfinite(values)]
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(fq.fp8_dtype(name)).float()
    finite = torch.unique(codes[torch.isfinite(codes)])
    mids = (finite[1:] + finite[:-1]) / 2
    above = torch.nextafter(mids, finite[1:])
    below = torch.nextafter(mids, finite[:-1])
    return torch.cat([values, mids, above, below, -mids])
