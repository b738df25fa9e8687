"""Bitwise comparisons (NaN equals NaN, +0 differs from -0) and the FP8 GEMM's stated bound."""

import inspect
from collections.abc import Callable
from typing import Any

import torch

from floatxq._typing import Shaped, Tensor

_UINT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def bits_of(x: Shaped[Tensor, "*shape"]) -> Shaped[Tensor, "*shape"]:
    """The raw bit patterns of ``x`` as an integer tensor of the same element size.

    Numerics: a reinterpretation (``view``), no conversion.
    """
    return x.contiguous().view(_UINT_OF_SIZE[x.element_size()])


def assert_bitwise_equal(
    actual: Shaped[Tensor, "*shape"], expected: Shaped[Tensor, "*shape"], *, msg: str = ""
) -> None:
    """Assert identical dtype, shape and bits; any two NaNs compare equal, ``+0 != -0``.

    Raises:
      AssertionError: naming the first differing positions and their values.

    Numerics: exact; this is the comparison for every contract floatxq states bit for bit.
    """
    prefix = f"{msg}: " if msg else ""
    if actual.dtype != expected.dtype:
        raise AssertionError(f"{prefix}dtype {actual.dtype} != expected {expected.dtype}")
    if actual.shape != expected.shape:
        raise AssertionError(
            f"{prefix}shape {tuple(actual.shape)} != expected {tuple(expected.shape)}"
        )
    a, e = actual.detach().cpu(), expected.detach().cpu()
    same = bits_of(a) == bits_of(e)
    if a.is_floating_point():
        same = same | (a.float().isnan() & e.float().isnan())
    if bool(same.all()):
        return
    bad = (~same).nonzero()
    shown = [
        (tuple(i.tolist()), a[tuple(i)].float().item(), e[tuple(i)].float().item()) for i in bad[:8]
    ]
    raise AssertionError(
        f"{prefix}{bad.shape[0]} of {a.numel()} elements differ bitwise "
        f"(index, actual, expected): {shown}"
    )


def unchecked(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` without the test run's jaxtyping/beartype wrapper: what production code calls.

    Tests of floatxq's own argument checks use it, since the hook rejects a wrong shape first.
    """
    return inspect.unwrap(fn)


_MANTISSA_BITS = {torch.bfloat16: 7, torch.float16: 10, torch.float32: 23}


def assert_fp8_linear_close(
    actual: Shaped[Tensor, "m n"],
    x: Shaped[Tensor, "m k"],
    weight: Shaped[Tensor, "n k"],
    weight_scale_inv: Shaped[Tensor, "*scale"],
    bias: Shaped[Tensor, "n"] | None,  # noqa: F821
    *,
    recipe: str,
    accumulator_bits: int = 24,
    msg: str = "",
) -> None:
    """Assert ``actual`` is :func:`floatxq.fp8_scaled_linear` up to its summation order.

    Per element: ``|actual - reference| <= (k + 8) * 2**-p * S + ulp(|reference|)`` where ``S``
    is the same sum over absolute values (``Σ |code_x · code_w · sx · sw|`` plus ``|bias|``),
    the bound on any order of accumulation with ``p = accumulator_bits`` significant bits and
    on the FP32 roundings of the scale products, and ``ulp`` is one unit in the last place of
    ``x.dtype`` (the two results may round to neighbouring values). ``p = 24`` is FP32; Hopper's
    FP8 tensor cores add products with fewer bits before a GEMM promotes them to FP32 (cuBLAS's
    ``scaled_mm`` measured within 2x of the FP32 bound on an H200), so GPU tests of those GEMMs
    pass 22. Codes that differed from the reference's would break either bound.

    Raises:
      AssertionError: naming the worst elements and the bound.

    Numerics: the reference and ``S`` in float64 on ``actual``'s device.
    """
    from floatxq.fp8 import _quantize_x, _scaled_sum, fp8_scaled_linear

    prefix = f"{msg}: " if msg else ""
    reference = fp8_scaled_linear(x, weight, weight_scale_inv, bias, recipe=recipe)
    if actual.dtype != reference.dtype or actual.shape != reference.shape:
        raise AssertionError(
            f"{prefix}{actual.dtype} {tuple(actual.shape)} != expected {reference.dtype} "
            f"{tuple(reference.shape)}"
        )
    xq = _quantize_x(x, weight, recipe)
    sx = torch.ones_like(xq.scale_inv) / xq.scale_inv
    sw = torch.ones_like(weight_scale_inv) / weight_scale_inv
    total = _scaled_sum(xq.qweight, weight, sx, sw, recipe, absolute=True)
    if bias is not None:
        total = total + bias.to(x.dtype).double().abs()
    n = weight.shape[0]
    k = x.shape[1]
    ref = reference.double()
    magnitude = ref.abs().clamp_min(torch.finfo(reference.dtype).tiny)
    ulp = torch.exp2(torch.floor(torch.log2(magnitude)) - _MANTISSA_BITS[reference.dtype])
    bound = (k + 8) * 2.0**-accumulator_bits * total + ulp
    error = (actual.double() - ref).abs()
    bad = ~(error <= bound) & ~(actual.isnan() & reference.isnan())
    if not bool(bad.any()):
        return
    worst = (error - bound).flatten().argsort(descending=True)[:5]
    shown = [
        (divmod(int(i), n), actual.flatten()[i].item(), reference.flatten()[i].item(),
         bound.flatten()[i].item())
        for i in worst
    ]  # fmt: skip
    raise AssertionError(
        f"{prefix}{int(bad.sum())} of {actual.numel()} elements outside the FP32-order bound "
        f"(index, actual, reference, bound): {shown}"
    )
