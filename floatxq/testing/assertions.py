"""Bitwise comparisons: NaN equals NaN (any payload), and +0 differs from -0."""

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
