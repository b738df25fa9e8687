"""The NVFP4 packer and the emulated W4A-NVFP4 GEMM against their pure references.

* ``nvfp4_pack_and_swizzle`` equals :func:`floatxq.nvfp4_pack_swizzled` bit for
  bit for every recipe (rows 0, 1, 7, 129, 1000; K 128 to 8192; float16/bfloat16/float32; zero,
  huge, tiny and subnormal blocks; global scales from 1e-30 to 1e30; strided input), and marks a
  block holding NaN or infinity with the NaN scale 0x7F;
* ``nvfp4_global_scale_from_bits`` equals the pure ``global_scale_from_bits`` (the stored
  scale, else ``nvfp4_dynamic_global_scale``) bit for bit: zero, NaN, infinite, subnormal,
  huge inputs, scales that round to 0 on the FP16 grid, strided input, every grid dtype;
* ``nvfp4_linear_prepacked`` / ``nvfp4_linear`` (both weight forms) hold the float64 value of
  the same operands within the statistical bound of FP32 summation
  (:func:`floatxq.testing.w4a_nvfp4_linear_error_bound`).

GPU tests run the compiled kernels; without CUDA, ``test_interpreter_suite`` reruns the
``interpreted`` tests in a child process under ``TRITON_INTERPRET=1`` on small shapes.
"""

import pytest
import torch

import floatxq as fq
from floatxq.dispatch import nvfp4_operand
from floatxq.gptq.decode_words import stage_decode_words
from floatxq.gptq.int4 import pack_gptq, unpack_gptq
from floatxq.gptq.planes import centered_int4, int4_to_e4m3
from floatxq.kernels import nvfp4 as nvfp4_kernels
from floatxq.kernels.nvfp4 import (
    NVFP4Tuning,
    nvfp4_global_scale_from_bits,
    nvfp4_linear,
    nvfp4_linear_prepacked,
    nvfp4_pack_and_swizzle,
)
from floatxq.nvfp4.operand import nvfp4_pack_swizzled
from floatxq.testing import (
    assert_bitwise_equal,
    assert_within_bound,
    production_checks,
    w4a_nvfp4_linear_error_bound,
)
from floatxq.testing.interpreter import can_interpret, needs_interpreter, run_interpreted_tests
from floatxq.w4a.activation import global_scale_from_bits
from floatxq.w4a.linear import w4a_nvfp4_linear

RECIPES = ("nvidia", "nvidia_headroom", "four_six", "least_squares", "least_squares_headroom",
           "least_squares_grid", "exhaustive")  # fmt: skip

# ----------------------------------------------------------------------------------------------
# Cases
# ----------------------------------------------------------------------------------------------


def _pack_input(seed, rows, k, dtype, *, subnormal=True):
    """Rows over many binades, with special blocks in the first rows: all zero, the dtype's
    largest values, tiny values (subnormal in ``dtype`` unless ``subnormal=False``: the
    interpreter flushes FP32 subnormals), one value and fifteen zeros, equal values, and blocks
    of small integers (exact ties of the E2M1 rounding)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=g) * torch.exp2(torch.randint(-8, 8, (rows, 1), generator=g))
    x = x * torch.exp2(torch.randint(-3, 3, (rows, k // 16), generator=g)).repeat_interleave(16, 1)
    specials = [
        torch.zeros(16),
        torch.finfo(dtype).max * torch.sign(torch.randn(16, generator=g)),
        torch.randn(16, generator=g) * (torch.finfo(dtype).tiny / 4 if subnormal else 2.0**-20),
        torch.tensor([3.0] + [0.0] * 15),
        torch.full((16,), -2.5),
        torch.randint(-12, 13, (16,), generator=g).float(),
        torch.randint(-5, 6, (16,), generator=g).float() / 4,
    ]
    for i, block in enumerate(specials[: rows * (k // 16)]):
        x.view(-1, 16)[i * 7 % (rows * (k // 16))] = block
    return x.to(dtype)


def _global_scales(x):
    """Dynamic (the runtime's, on x's grid), 1, and the extremes the kernel must still match."""
    amax = x.float().abs().amax() if x.numel() else torch.zeros(())
    dynamic = fq.nvfp4_global_scale(amax, grid_dtype=x.dtype).item()
    return (dynamic, 1.0, 1e-30, 3e30)


def _check_pack(x, recipe, g, *, tuning=None):
    kwargs = {} if tuning is None else {"tuning": tuning}
    packed, scales = nvfp4_pack_and_swizzle(x, g, recipe=recipe, **kwargs)
    ref_packed, ref_scales = nvfp4_pack_swizzled(x, g, recipe=recipe)
    where = f"{recipe} {tuple(x.shape)} {x.dtype} g={g}"
    assert packed.dtype == torch.float4_e2m1fn_x2 and scales.dtype == torch.float8_e4m3fn
    assert_bitwise_equal(scales.view(torch.uint8), ref_scales.view(torch.uint8), msg=where)
    assert_bitwise_equal(packed.view(torch.uint8), ref_packed.view(torch.uint8), msg=where)


def _weight(seed, k, n, device):
    """A symmetric 4-bit g128 GPTQ weight (v1 words) and scales spread over binades."""
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (k, n), generator=g)
    scales = torch.rand(k // 128, n, generator=g) * 0.02 + 0.001
    g_idx = torch.arange(k, dtype=torch.int32) // 128
    packed = pack_gptq(codes, torch.full((k // 128, n), 8), scales, g_idx, format="gptq")
    return type(packed)(*(t.to(device) for t in packed))


def _operand(packed, form):
    if form == "words":
        return packed.qweight
    if form == "dwords":  # the int16 decode words of the same codes
        return stage_decode_words(unpack_gptq(packed).codes)
    e4m3 = int4_to_e4m3(centered_int4(packed, format="gptq"))
    return e4m3 if form == "e4m3" else e4m3.T.contiguous().T  # row-major or K-contiguous


def _check_linear(seed, m, n, k, dtype, form, device, *, token=True):
    packed = _weight(seed, k, n, device)
    weight = _operand(packed, form)
    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(m, k, generator=g) * torch.exp2(torch.randint(-6, 6, (m, 1), generator=g))
    x = x.to(dtype).to(device)
    bias = (torch.randn(n, generator=g) * 4).to(dtype).to(device)
    gs = fq.nvfp4_global_scale(x.float().abs().amax() if m else torch.zeros(()), grid_dtype=dtype)
    gs = gs.to(device)
    ts = (torch.rand(m, generator=g) + 0.5).to(device) if token else None
    codes, scales = nvfp4_pack_and_swizzle(x, gs, recipe="least_squares")
    out = nvfp4_linear_prepacked(
        codes, scales, gs, weight, packed.scales, bias, token_scale=ts, output_dtype=dtype
    )
    assert out.dtype == dtype and out.shape == (m, n)
    bound = w4a_nvfp4_linear_error_bound(
        codes, scales, gs, weight, packed.scales, bias, token_scale=ts, output_dtype=dtype
    )
    assert_within_bound(out, bound, msg=f"{form} {(m, n, k)} {dtype}")
    if not token:  # the one-call form packs the same bytes
        again = nvfp4_linear(x, weight, packed.scales, bias, global_scale=gs)
        assert_bitwise_equal(again, out, msg="nvfp4_linear")
        reference = w4a_nvfp4_linear(x, weight, packed.scales, bias, global_scale=gs)
        assert_within_bound(reference, bound, msg="reference")


def _scale_inputs(seed, device, *, subnormal):
    """``(x, why)`` cases of the global-scale kernel: random rows of several shapes (one
    strided), all zero, one NaN, one infinity, values whose scale rounds to 0 on the FP16
    grid, huge values, FP32 subnormals (``subnormal``: the interpreter flushes them)."""
    g = torch.Generator().manual_seed(seed)
    shapes = [(1, 128), (3, 300), (9, 2100), (17, 64), (40, 1030)]
    if device == "cuda":
        shapes += [(1, 8192), (32, 28672)]
    for dtype in (torch.float16, torch.bfloat16, torch.float32):
        for rows, k in shapes:
            yield torch.randn(rows, k, generator=g).to(dtype).to(device), (dtype, rows, k)
        wide = torch.randn(7, 512, generator=g).to(dtype).to(device)
        yield wide[:, ::2], (dtype, "strided")
        base = torch.randn(5, 256, generator=g)
        cases = {"zero": base * 0, "tiny": base * 5e-5 / base.abs().max(), "huge": base * 6e4}
        for name, value in (("nan", float("nan")), ("inf", float("inf")), ("-inf", -float("inf"))):
            cases[name] = base.clone().index_put_((torch.tensor([2]), torch.tensor([7])),
                                                  torch.tensor(value))  # fmt: skip
        for name, x in cases.items():
            yield x.to(dtype).to(device), (dtype, name)
    if subnormal:
        yield (torch.randn(4, 256, generator=g) * 1e-40).to(device), ("float32", "subnormal")


def _check_global_scale(device, *, subnormal):
    stored = torch.tensor(0.0375).view(torch.int32)
    for x, why in _scale_inputs(1, device, subnormal=subnormal):
        for recipe in ("nvidia", "four_six", "least_squares_headroom"):
            for bits in (torch.zeros((), dtype=torch.int32), stored):
                got = nvfp4_global_scale_from_bits(x, bits.to(device), recipe=recipe)
                want = global_scale_from_bits(bits, x.cpu(), recipe=recipe)  # the pure function
                assert got.shape == () and got.device == x.device
                assert got.view(torch.int32).item() == want.view(torch.int32).item(), (
                    why, recipe, bits.item(), got.item(), want.item(),
                )  # fmt: skip
    for words in nvfp4_kernels._SCALE_WORDS.values():  # left as they were found
        assert words.tolist() == [0, 0]
    empty = torch.zeros(0, 128, device=device)
    zero = torch.zeros((), dtype=torch.int32, device=device)
    assert nvfp4_global_scale_from_bits(empty, zero).item() == 1.0
    with pytest.raises(TypeError, match="one int32 value"):
        nvfp4_global_scale_from_bits(empty, torch.zeros(2, dtype=torch.int32, device=device))


# ----------------------------------------------------------------------------------------------
# CPU: argument checks
# ----------------------------------------------------------------------------------------------


def test_kernels_refuse_cpu_tensors_and_bad_arguments():
    if can_interpret() or not torch.cuda.is_available():
        with pytest.raises((TypeError, RuntimeError), match="^nvfp4_pack_and_swizzle: "):
            nvfp4_pack_and_swizzle(torch.ones(2, 128), 1.0)
    with pytest.raises(TypeError, match="2-D float16/bfloat16/float32"):
        nvfp4_pack_and_swizzle(torch.ones(2, 128, dtype=torch.float64), 1.0)
    with pytest.raises(ValueError, match="positive multiple of 128"):
        nvfp4_pack_and_swizzle(torch.ones(2, 96), 1.0)
    with production_checks(), pytest.raises(ValueError, match="recipe"):
        nvfp4_pack_and_swizzle(torch.ones(2, 128), 1.0, recipe="best")
    codes = torch.zeros(2, 64, dtype=torch.uint8)
    scales = torch.zeros(1, 1024, dtype=torch.float8_e4m3fn)
    w = torch.zeros(128, 32, dtype=torch.float8_e4m3fn)
    with pytest.raises(ValueError, match=r"scales must have shape \(1, 1024\)"):
        nvfp4_linear_prepacked(codes, scales[:, :512], 1.0, w, torch.ones(1, 32),
                               output_dtype=torch.float32)  # fmt: skip
    with pytest.raises(TypeError, match="output_dtype"):
        nvfp4_linear_prepacked(codes, scales, 1.0, w, torch.ones(1, 32), output_dtype=torch.int8)
    with production_checks(), pytest.raises(ValueError, match=r"token_scale must have shape"):
        nvfp4_linear_prepacked(codes, scales, 1.0, w, torch.ones(1, 32),
                               token_scale=torch.ones(3), output_dtype=torch.float32)  # fmt: skip


def test_operand_choice_and_tuning_checks():
    assert nvfp4_operand(1) == "words" and nvfp4_operand(65) == "e4m3"
    assert nvfp4_operand(200, NVFP4Tuning(words_max_rows=256)) == "words"
    with pytest.raises(ValueError, match="divide 128"):
        NVFP4Tuning(pack_rows=3)
    with pytest.raises(ValueError, match=">= 1"):
        NVFP4Tuning(pack_warps=0)


# ----------------------------------------------------------------------------------------------
# Interpreter (CPU, TRITON_INTERPRET=1, child process)
# ----------------------------------------------------------------------------------------------


@pytest.mark.skipif(
    not can_interpret(),
    reason="needs Triton installed and no CUDA device (with CUDA the compiled kernel is tested)",
)
def test_interpreter_suite():
    run_interpreted_tests(__file__, expected=6)


@needs_interpreter
@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
def test_interpreted_pack_every_recipe():
    for seed, recipe in enumerate(RECIPES):
        rows, k = (1, 128) if recipe == "exhaustive" else (3, 256)
        for dtype in (torch.float16, torch.float32):
            x = _pack_input(seed, rows, k, dtype, subnormal=False)
            _check_pack(x, recipe, _global_scales(x)[0])
    x = _pack_input(9, 7, 128, torch.float32, subnormal=False)
    _check_pack(x, "least_squares_grid", 1.0)
    _check_pack(x.T.contiguous().T, "nvidia", 1e-30)  # K-strided input, a tiny global scale


@needs_interpreter
def test_interpreted_pack_rows_and_padding():
    x = _pack_input(3, 130, 128, torch.float16, subnormal=False)
    _check_pack(x, "four_six", 0.01, tuning=NVFP4Tuning(pack_rows=8))
    packed, scales = nvfp4_pack_and_swizzle(x[:0], 1.0)
    assert packed.shape == (0, 64) and scales.shape == (1, 0)


@needs_interpreter
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
def test_interpreted_pack_marks_non_finite_blocks():
    _check_non_finite("cpu")


@needs_interpreter
def test_interpreted_global_scale():
    _check_global_scale("cpu", subnormal=False)


@needs_interpreter
def test_interpreted_linear():
    for seed, (m, n, k) in enumerate([(1, 64, 128), (5, 96, 384), (70, 64, 256)]):
        for form in ("words", "dwords", "e4m3_kmajor"):
            _check_linear(seed, m, n, k, torch.float16, form, "cpu", token=seed % 2 == 0)


@needs_interpreter
def test_interpreted_launch_keys_name_the_weight_form(monkeypatch):
    """A kept launch is found by its key alone, so the key must name every compile-time choice:
    the int32 words and the int16 decode words of one shape have the same strides and must not
    share a compiled kernel (they did, and the decode words read as int32 words gave wrong sums
    on the GPU)."""
    from floatxq.kernels import _triton

    keys = []
    launch = _triton.CachedLauncher.__call__
    monkeypatch.setattr(
        _triton.CachedLauncher, "__call__",
        lambda self, key, *a: (keys.append(key), launch(self, key, *a))[1],
    )  # fmt: skip
    packed = _weight(2, 128, 64, "cpu")
    x = torch.randn(1, 128).half()
    gs = fq.nvfp4_global_scale(x.float().abs().amax(), grid_dtype=torch.float16)
    codes, scales = nvfp4_pack_and_swizzle(x, gs, recipe="least_squares")
    for form in ("words", "dwords"):
        weight = _operand(packed, form)
        assert weight.stride() == (64, 1)
        nvfp4_linear_prepacked(
            codes, scales, gs, weight, packed.scales, None, output_dtype=torch.float16
        )
    gemm_keys = [key for key in keys if isinstance(key, tuple) and isinstance(key[0], tuple)]
    assert len(gemm_keys) == 2 and gemm_keys[0] != gemm_keys[1]


def _check_non_finite(device):
    x = torch.randn(3, 256, device=device)
    x[0, 5] = float("nan")
    x[2, 200] = float("inf")
    _, scales = nvfp4_pack_and_swizzle(x, 0.01)
    clean = x.clone()
    clean[0, 5] = clean[2, 200] = 0.0
    _, expected = nvfp4_pack_swizzled(clean, 0.01)
    bad = torch.zeros_like(expected, dtype=torch.bool)
    rows = 128 * 8  # one row tile: slot of (row r, block b) per the swizzle
    for r, b in ((0, 0), (2, 12)):
        group, block = divmod(b, 8)
        slot = (block // 4) * 512 + (r % 32) * 16 + ((r % 128) // 32) * 4 + block % 4
        assert slot < rows
        bad[group, slot] = True
    got = scales.view(torch.uint8)
    assert bool((got[bad] == 0x7F).all()), got[bad]
    assert_bitwise_equal(got[~bad], expected.view(torch.uint8)[~bad], msg="finite blocks")
    nan = torch.tensor([float("nan")], device=device)
    if device == "cpu":  # a global scale on the host is checked there
        with pytest.raises(ValueError, match="positive and finite"):
            nvfp4_pack_and_swizzle(clean, nan)
        return
    _, poisoned = nvfp4_pack_and_swizzle(clean, nan)  # on the GPU it is not read: NaN scales
    live = nvfp4_pack_swizzled(clean, 1.0)[1].view(torch.uint8) != 0  # non-padding slots
    assert bool((poisoned.view(torch.uint8)[live] == 0x7F).all())


# ----------------------------------------------------------------------------------------------
# GPU: the compiled kernels
# ----------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_pack_is_bitwise_the_reference(recipe, dtype):
    big = (1000, 8192) if recipe != "exhaustive" else (129, 8192)
    for seed, (rows, k) in enumerate([(0, 128), (1, 128), (7, 1024), (129, 256), big]):
        x = _pack_input(seed, rows, k, dtype).cuda()
        for g in _global_scales(x):
            _check_pack(x, recipe, g)
    x = _pack_input(11, 64, 1024, dtype).cuda()
    _check_pack(x[:, ::2][:, :384], recipe, 0.05)  # strided rows and columns
    _check_pack(x, recipe, torch.tensor(0.02, device="cuda"))  # a device global scale


@pytest.mark.gpu
@pytest.mark.parametrize("pack_rows", [1, 16, 128])
def test_pack_tunings_give_the_same_bytes(pack_rows):
    x = _pack_input(5, 300, 512, torch.bfloat16).cuda()
    tuning = NVFP4Tuning(pack_rows=pack_rows, pack_rows_search=pack_rows, pack_warps=8)
    for recipe in ("nvidia", "least_squares_grid"):
        _check_pack(x, recipe, 0.03, tuning=tuning)


@pytest.mark.gpu
def test_global_scale_is_bitwise_the_pure_one():
    _check_global_scale("cuda", subnormal=True)


@pytest.mark.gpu
def test_pack_marks_non_finite_blocks():
    _check_non_finite("cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("form", ["words", "dwords", "e4m3", "e4m3_kmajor"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_linear_within_the_bound(form, dtype):
    shapes = [(0, 96, 128), (1, 96, 128), (7, 160, 384), (16, 256, 4096), (33, 1024, 8192),
              (64, 96, 1024), (65, 256, 1024), (300, 160, 2048), (1, 4096, 8192)]  # fmt: skip
    for seed, (m, n, k) in enumerate(shapes):
        _check_linear(seed, m, n, k, dtype, form, "cuda", token=seed % 2 == 1)


@pytest.mark.gpu
def test_linear_repeats_bitwise_after_split_k():
    packed = _weight(3, 4096, 512, "cuda")
    x = torch.randn(4, 4096, device="cuda", dtype=torch.bfloat16)
    first = nvfp4_linear(x, packed.qweight, packed.scales, global_scale=0.01)
    for _ in range(3):
        assert_bitwise_equal(
            nvfp4_linear(x, packed.qweight, packed.scales, global_scale=0.01), first, msg="rerun"
        )
