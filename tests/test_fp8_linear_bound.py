"""The FP8 GEMM check of ``floatxq.testing`` can fail: one ``x`` code one step off is caught.

``assert_fp8_linear_close`` holds a route's output to the exact sum of
``code_x · code_w · sx · sw`` (plus bias) within a statistical bound on the route's accumulation
error (``fp8_linear_error_bound``). Here, on the data the kernel tests draw (rows of ``x`` and
``W`` spread over binades, bf16 activations, a bias), at K from 40 to 16384 and for every
recipe:

* an output computed exactly from ``x`` codes with ONE code moved by one step fails it, for
  FP32 accumulation (a middle-sized code) and for Hopper's (the row's largest code: a smaller
  code's step is within what truncated FP8 sums may lose at K = 16384);
* the worst-case bound, which grows like ``k · Σ|terms|``, lets that output pass at large K:
  the reason the statistical one exists;
* correct arithmetic passes: FP32 accumulation in K order and in BLAS order, and a CPU
  emulation of Hopper's FP8 tensor cores (products summed in a register that keeps 13
  fraction bits and truncates, promoted to FP32 every 32 or 128 products);
* a GEMM that never promotes (whole rows of K in the 13-bit register) fails.

The sums are computed here from the codes (products in float64), not by the functions under
test; only the quantization of ``x`` is floatxq's (its codes are pinned elsewhere).
"""

import functools
import math

import numpy
import pytest
import torch

import floatxq as fq
from floatxq.testing import (
    FP32_ACCUMULATION,
    HOPPER_FP8_ACCUMULATION,
    Accumulation,
    assert_bitwise_equal,
    assert_fp8_linear_close,
    fp8_linear_error_bound,
)

RECIPES = {
    "tensorwise": ("tensor", None, ("tensor", None)),
    "rowwise": ("row", None, ("row", None)),
    "blockwise": ("block", (128, 128), ("block", (1, 128))),
}
"""recipe: (weight scale method, weight block, (x scale method, x block))."""

K_VALUES = (40, 512, 8192, 16384)
CASES = [
    # blockwise scales each 128-wide K block of x and W, so K must be a multiple of 128: its
    # smallest case is one block (128) instead of 40
    (recipe, 128 if recipe == "blockwise" and k == 40 else k)
    for recipe in RECIPES
    for k in K_VALUES
]
ROWS, COLS = 2, 128
"""Few rows and columns keep K = 16384 cheap (blockwise needs COLS to be a multiple of 128)."""

HOPPER_FRACTION_BITS = 13
"""Fraction bits of the emulated FP8 MMA register (Hopper's FP8 accumulation keeps about 13)."""


def _operands(recipe, k, seed):
    """x (bf16, rows 2**-6..2**5), W quantized (rows 2**-4..2**3), a bf16 bias: the kernel
    tests' distribution."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(ROWS, k, generator=g) * torch.exp2(torch.randint(-6, 6, (ROWS, 1), generator=g))
    w = torch.randn(COLS, k, generator=g) * torch.exp2(torch.randint(-4, 4, (COLS, 1), generator=g))
    bias = torch.randn(COLS, generator=g) * 4
    method, block, _ = RECIPES[recipe]
    q = fq.quantize_fp8_weight(w, weight_scale_method=method, weight_block_size=block)
    return x.bfloat16(), q.qweight, q.scale_inv, bias.bfloat16()


def _x_codes(recipe, x):
    """x's codes and direct scales (FP32 quotients) as the recipe quantizes it."""
    _, _, (method, block) = RECIPES[recipe]
    xq = fq.quantize_fp8_weight(x, weight_scale_method=method, weight_block_size=block)
    return xq.qweight, torch.ones_like(xq.scale_inv) / xq.scale_inv


def _term_scales(recipe, sx, sw, k):
    """``(m, n, k)``-broadcastable FP32 scale ``sx · sw`` of each term (as FP32 products)."""
    if recipe == "tensorwise":
        return (sx * sw).reshape(1, 1, 1)
    if recipe == "rowwise":
        return (sx[:, None] * sw[None, :])[:, :, None]
    block = torch.arange(k) // 128
    return (sx[:, None, :] * sw.repeat_interleave(128, dim=0)[None, :, :])[:, :, block]


def _one_step(codes, row, col):
    """``codes`` with ``codes[row, col]`` moved to the next E4M3 magnitude (down from 448)."""
    bits = codes.view(torch.uint8).clone()
    magnitude = int(bits[row, col]) & 0x7F
    bits[row, col] += -1 if magnitude == 0x7E else 1
    return bits.view(torch.float8_e4m3fn)


def _exact_output(recipe, cx, sx, codes, scale_inv, bias):
    """``Σ code_x · code_w · sx · sw + bias`` in float64, rounded to FP32 then bf16: the
    reference's arithmetic, written out here from the codes."""
    sw = torch.ones_like(scale_inv) / scale_inv
    products = cx.double()[:, None, :] * codes.double()[None, :, :]
    k = cx.shape[1]
    if recipe == "blockwise":  # each block's partial sum takes its own scales
        parts = products.reshape(*products.shape[:2], k // 128, 128).sum(-1)
        total = (parts * _term_scales(recipe, sx, sw, k)[:, :, ::128].double()).sum(-1)
    else:
        total = products.sum(-1) * _term_scales(recipe, sx, sw, k)[:, :, 0].double()
    return (total + bias.double()).float().bfloat16()


def _truncated(v, exponent, bits):
    """``v`` cut toward zero to a multiple of ``2**(exponent - bits)``."""
    step = torch.exp2((exponent - bits).double())
    return torch.trunc(v / step) * step


def _exponent(v):
    """``floor(log2 |v|)`` (any value for 0)."""
    return torch.frexp(v).exponent - 1


def _gemm(recipe, cx, sx, codes, scale_inv, bias, *, chunk, bits=None, group=8):
    """The GEMM a route runs, emulated: stretches of ``chunk`` products summed in a register
    (``bits`` fraction bits: ``group`` products at a time aligned with the register to their
    largest exponent and truncated there, then the sum truncated; exact when ``bits`` is None),
    each stretch added into an FP32 accumulator in K order (scaled per block for blockwise),
    then the FP32 epilogue (scales, bias) and one rounding to bf16."""
    k = cx.shape[1]
    sw = torch.ones_like(scale_inv) / scale_inv
    products = cx.double()[:, None, :] * codes.double()[None, :, :]
    pad = -k % chunk
    if pad:
        products = torch.cat([products, products.new_zeros(ROWS, COLS, pad)], dim=-1)
    products = products.reshape(ROWS, COLS, -1, chunk)
    if bits is None:
        sums = products.sum(-1) if chunk > 1 else products[..., 0]  # exact
    else:
        steps = products.reshape(*products.shape[:3], chunk // group, group)
        sums = torch.zeros(products.shape[:3], dtype=torch.float64)
        for j in range(chunk // group):
            part = steps[..., j, :]
            top = _exponent(torch.maximum(sums.abs(), part.abs().amax(-1)))
            sums = _truncated(sums, top, bits) + _truncated(part, top[..., None], bits).sum(-1)
            sums = _truncated(sums, _exponent(sums), bits)
    sums = sums.float()  # exact: at most 24 significant bits either way
    scales = _term_scales(recipe, sx, sw, k + pad)[:, :, ::chunk].expand_as(sums)
    if recipe == "blockwise":
        sums = sums * scales  # each stretch lies in one block: its scale product, in FP32
    # numpy's accumulate adds one element at a time in float32 (torch's cumsum would not)
    acc = torch.from_numpy(numpy.add.accumulate(sums.numpy(), axis=-1)[..., -1])
    if recipe != "blockwise":
        acc = acc * scales[..., 0]
    return (acc + bias.float()).bfloat16()


def _largest_code(cx, row):
    return int(cx[row].float().abs().argmax())


def _middle_code(cx, row):
    """A code of median magnitude among the row's nonzero codes."""
    a = cx[row].float().abs()
    nonzero = a[a > 0]
    return int((a - nonzero.median()).abs().argmin())


# ----------------------------------------------------------------------------------------------
# One code off fails
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("recipe", "k"), CASES)
def test_one_code_one_step_off_fails(recipe, k):
    """Each row in turn: FP32's bound catches a middle-sized code one step off, Hopper's the
    row's largest code one step off. From K = 8192 the worst-case bound lets the latter pass
    (``(k + 8) · 2**-24 · Σ|terms|``, kept as ``bound="worst_case"``): why the statistical one
    is the default."""
    x, codes, scale_inv, bias = _operands(recipe, k, seed=k)
    cx, sx = _x_codes(recipe, x)
    exact = _exact_output(recipe, cx, sx, codes, scale_inv, bias)
    assert_bitwise_equal(exact, fq.fp8_scaled_linear(x, codes, scale_inv, bias, recipe=recipe))
    for accumulation, pick in ((FP32_ACCUMULATION, _middle_code),
                               (HOPPER_FP8_ACCUMULATION, _largest_code)):  # fmt: skip
        check = functools.partial(
            assert_fp8_linear_close, x=x, weight=codes, weight_scale_inv=scale_inv, bias=bias,
            recipe=recipe, accumulation=accumulation,
        )  # fmt: skip
        check(exact)
        for row in range(ROWS):
            planted = _exact_output(
                recipe, _one_step(cx, row, pick(cx, row)), sx, codes, scale_inv, bias
            )
            with pytest.raises(AssertionError, match=r"outside the statistical bound") as failed:
                check(planted)
            # only the planted row moved
            assert all(index[0] == row for index, *_ in _shown(str(failed.value)))
    if k >= 8192:
        planted = _exact_output(
            recipe, _one_step(cx, 0, _largest_code(cx, 0)), sx, codes, scale_inv, bias
        )
        assert_fp8_linear_close(
            planted, x, codes, scale_inv, bias, recipe=recipe, bound="worst_case"
        )


def _shown(message):
    """The ``(index, actual, exact, ratio)`` tuples an assertion message names."""
    return eval(message[message.index("[(") :])  # (our own message: tuples of numbers)


# ----------------------------------------------------------------------------------------------
# Correct arithmetic passes
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("recipe", "k"), CASES)
def test_correct_accumulation_passes(recipe, k):
    """FP32 sums in K order (one product at a time) and in BLAS order (a float32 matmul) pass
    FP32's bound; emulated Hopper FP8 MMAs (13 fraction bits, truncating, promoted to FP32
    every 32 or 128 products) pass Hopper's."""
    x, codes, scale_inv, bias = _operands(recipe, k, seed=k + 1)
    cx, sx = _x_codes(recipe, x)
    in_order = _gemm(recipe, cx, sx, codes, scale_inv, bias, chunk=1)
    assert_fp8_linear_close(in_order, x, codes, scale_inv, bias, recipe=recipe)
    sw = torch.ones_like(scale_inv) / scale_inv
    if recipe == "blockwise":
        per_block = torch.einsum(
            "mbj,nbj->mnb", cx.float().reshape(ROWS, -1, 128), codes.float().reshape(COLS, -1, 128)
        )
        blas = (per_block * _term_scales(recipe, sx, sw, k)[:, :, ::128]).sum(-1)
    else:
        blas = (cx.float() @ codes.float().T) * _term_scales(recipe, sx, sw, k)[:, :, 0]
    blas = (blas + bias.float()).bfloat16()
    assert_fp8_linear_close(blas, x, codes, scale_inv, bias, recipe=recipe)
    for chunk in (32, 128):
        got = _gemm(recipe, cx, sx, codes, scale_inv, bias, chunk=chunk, bits=HOPPER_FRACTION_BITS)
        assert_fp8_linear_close(
            got, x, codes, scale_inv, bias, recipe=recipe, accumulation=HOPPER_FP8_ACCUMULATION
        )


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_a_gemm_that_never_promotes_fails(recipe):
    """All of K = 16384 in the 13-bit register (no FP32 promotion): the accumulation error
    the bound exists to catch besides wrong codes."""
    k = 16384
    x, codes, scale_inv, bias = _operands(recipe, k, seed=3)
    cx, sx = _x_codes(recipe, x)
    got = _gemm(
        recipe, cx, sx, codes, scale_inv, bias, chunk=k, bits=HOPPER_FRACTION_BITS, group=32
    )
    with pytest.raises(AssertionError, match="outside the statistical bound"):
        assert_fp8_linear_close(
            got, x, codes, scale_inv, bias, recipe=recipe, accumulation=HOPPER_FP8_ACCUMULATION
        )


# ----------------------------------------------------------------------------------------------
# The bounds themselves
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("recipe", list(RECIPES))
def test_how_the_bounds_grow_with_k(recipe):
    """Against the outputs' typical size (√k terms), from K = 512 to 8192 (16x) the worst case
    grows like k**1.5 (64x), the FP32 statistical bound like √k (4x) and Hopper's not at all
    (its truncated stretches dominate, each the size of C terms)."""
    growth = {}
    for k in (512, 8192):
        x, codes, scale_inv, _ = _operands(recipe, k, seed=5)
        for name, accumulation in (
            ("fp32", FP32_ACCUMULATION),
            ("hopper", HOPPER_FP8_ACCUMULATION),
        ):
            b = fp8_linear_error_bound(
                x.float(), codes, scale_inv, None, recipe=recipe, accumulation=accumulation
            )
            # (float32 x: the output's own rounding does not dominate)
            rms = b.exact.square().mean().sqrt()  # √k times a typical term
            growth.setdefault(name, []).append(
                (b.worst_case.median() / rms, b.statistical.median() / rms)
            )
    (worst_512, fp32_512), (worst_8192, fp32_8192) = growth["fp32"]
    assert 32 < worst_8192 / worst_512 < 128
    assert 2 < fp32_8192 / fp32_512 < 8
    (_, hopper_512), (_, hopper_8192) = growth["hopper"]
    assert 0.5 < hopper_8192 / hopper_512 < 2


def test_bounds_on_exact_products_and_empty_shapes():
    """Powers of two with exact scales: the bound's exact value is the decoded product, and
    empty rows, columns or K give empty or bias-only results."""
    w = torch.tensor([[448.0, -2.0, 0.5, 1.0]] * 16)
    x = torch.tensor([[448.0, 4.0, -8.0, 0.25]])
    q = fq.quantize_fp8_weight(w)
    assert bool((q.scale_inv == 1).all())
    b = fp8_linear_error_bound(x, *q, None, recipe="rowwise")
    assert torch.equal(b.exact, (x @ w.T).double())
    assert bool((b.statistical <= b.worst_case).all())
    for m, n, k in ((0, 16, 4), (2, 0, 4), (2, 16, 0)):
        q = fq.quantize_fp8_weight(torch.ones(n, k))
        bias = torch.full((n,), 3.0)
        b = fp8_linear_error_bound(torch.ones(m, k), *q, bias, recipe="rowwise")
        assert b.exact.shape == (m, n) and bool((b.exact == 3.0).all())


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"chunk": 0, "chunk_bits": 13}, ValueError, r"chunk must be >= 1, got 0"),
        ({"chunk": 32, "chunk_bits": 0}, ValueError, r"chunk_bits must be in \[1, 52\], got 0"),
        ({"chunk": 32.0, "chunk_bits": 13}, TypeError, "chunk must be an int, got float"),
        ({"chunk": 32, "chunk_bits": True}, TypeError, "chunk_bits must be an int, got bool"),
    ],
)
def test_accumulation_rejects_bad_fields(kwargs, error, match, production_checks):
    with pytest.raises(error, match=match):
        Accumulation(**kwargs)


def test_bad_bound_names_and_chunks_are_refused(production_checks):
    x, q = torch.randn(2, 256), fq.quantize_fp8_weight(torch.randn(128, 256))
    got = fq.fp8_scaled_linear(x, *q, recipe="rowwise")
    with pytest.raises(ValueError, match="bound must be 'statistical' or 'worst_case', got 'l2'"):
        assert_fp8_linear_close(got, x, *q, None, recipe="rowwise", bound="l2")
    qb = fq.quantize_fp8_weight(torch.randn(128, 256), weight_scale_method="block",
                                weight_block_size=(128, 128))  # fmt: skip
    with pytest.raises(ValueError, match="chunk must divide 128, got 96"):
        fp8_linear_error_bound(
            x, *qb, None, recipe="blockwise", accumulation=Accumulation(chunk=96, chunk_bits=13)
        )
    with pytest.raises(TypeError, match="accumulation must be an Accumulation, got int"):
        fp8_linear_error_bound(x, *q, None, recipe="rowwise", accumulation=24)
    assert math.isfinite(float(fp8_linear_error_bound(x, *q, None, recipe="rowwise").exact.sum()))
