"""Bitwise comparisons (NaN equals NaN, +0 differs from -0) and the FP8 GEMM's error bounds."""

import contextlib
import dataclasses
import inspect
import typing
from collections.abc import Callable, Iterator
from typing import Any, Literal, NamedTuple

import jaxtyping
import torch
from beartype.door import is_bearable

from floatxq._typing import Float, Float32, Float64, FP8Dtype, Shaped, Tensor, checked_record
from floatxq.formats import K_GROUP

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


@contextlib.contextmanager
def production_checks() -> Iterator[None]:
    """The test run's jaxtyping/beartype check switched off inside the block; restored after it.

    Unlike :func:`unchecked` (one function), it covers everything the block calls, such as a
    config's constructor: the errors users get are then those of floatxq's own checks.
    """
    before = jaxtyping.config.jaxtyping_disable
    jaxtyping.config.update("jaxtyping_disable", True)
    try:
        yield
    finally:
        jaxtyping.config.update("jaxtyping_disable", before)


def assert_fields_match_annotations(record: object) -> None:
    """Assert every field of the dataclass ``record`` holds a value of its declared type.

    For configs whose fields are normalized when built: ``"e4m3"`` given for a ``FORMAT`` field
    must be stored as the enum member, not as the string.

    Raises:
      AssertionError: naming the field, its value and its declared type.
    """
    hints = typing.get_type_hints(type(record))
    for field in dataclasses.fields(record):
        value = getattr(record, field.name)
        if not is_bearable(value, hints[field.name]):
            raise AssertionError(f"field {field.name} holds {value!r}, not a {hints[field.name]}")


_MANTISSA_BITS = {torch.bfloat16: 7, torch.float16: 10, torch.float32: 23}
_FP32_UNIT = 2.0**-24
"""FP32's unit roundoff: a round-to-nearest result is within ``2**-24`` of its exact value."""
_SPREAD = 2.0
"""The statistical bound's factor on its estimates (see :func:`fp8_linear_error_bound`)."""
_X_QUANTIZATION = {"tensorwise": ("tensor", None), "rowwise": ("row", None),
                   "blockwise": ("block", (1, K_GROUP))}  # fmt: skip
"""How :func:`floatxq.fp8_scaled_linear` quantizes ``x`` per recipe (its docstring states it)."""


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Accumulation:
    """How a GEMM adds the ``k`` exact FP8 products of one output element: the error model.

    Consecutive stretches of ``chunk`` products (``k`` cut from 0, the last stretch short) are
    summed with ``chunk_bits`` fraction bits: each product is aligned to the largest magnitude
    then held and truncated there, in any order. The stretch sums are then added in FP32 with
    round-to-nearest, in any order. ``chunk = 1`` is plain FP32 accumulation (one FP8 product
    is exact in FP32).

    Raises:
      TypeError: a field that is not an int.
      ValueError: ``chunk < 1`` or ``chunk_bits`` outside ``[1, 52]``.

    Numerics: a description; :func:`fp8_linear_error_bound` turns it into bounds.

    Example:
      >>> Accumulation(chunk=32, chunk_bits=13).chunk
      32
    """

    chunk: int
    """Products summed before each promotion to FP32 (1: every product added in FP32)."""
    chunk_bits: int
    """Fraction bits kept inside a stretch: a truncation there loses less than
    ``2**-chunk_bits`` times the largest magnitude then held (unused when ``chunk == 1``)."""

    def __post_init__(self) -> None:
        for name, low, high in (("chunk", 1, None), ("chunk_bits", 1, 52)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"Accumulation: {name} must be an int, got {type(value).__name__}")
            if value < low or (high is not None and value > high):
                accepted = f">= {low}" if high is None else f"in [{low}, {high}]"
                raise ValueError(f"Accumulation: {name} must be {accepted}, got {value}")


FP32_ACCUMULATION = Accumulation(chunk=1, chunk_bits=23)
"""Every product added in FP32 (CPU matmuls, the Triton interpreter, FP32 GEMMs)."""
HOPPER_FP8_ACCUMULATION = Accumulation(chunk=128, chunk_bits=13)
"""Hopper FP8 tensor cores (``torch._scaled_mm``, the Triton ``fp8_small_m`` kernel): the MMA
adds FP8 products in a register of about 13 fraction bits that truncates, and the GEMMs promote
its sums to FP32 at least every 128 products (the Triton kernel every 32 unless told otherwise,
blockwise GEMMs at each 128-wide scale block; cuBLAS's tensorwise and rowwise ``scaled_mm``
measured within this model on an H200)."""


@checked_record
class FP8LinearBound(NamedTuple):
    """:func:`fp8_linear_error_bound`'s result: the exact value and two bounds per element."""

    exact: Float64[Tensor, "m n"]
    """``Σ_k code_x · code_w · sx · sw + bias`` in float64, before any rounding."""
    worst_case: Float64[Tensor, "m n"]
    """Bound on ``|actual - exact|`` for any data and any summation order of the model."""
    statistical: Float64[Tensor, "m n"]
    """The tighter bound for terms of random sign in no particular order (at most
    ``worst_case``)."""


def fp8_linear_error_bound(
    x: Float[Tensor, "m k"],
    weight: FP8Dtype[Tensor, "n k"],
    weight_scale_inv: Float32[Tensor, "*scale"],
    bias: Float[Tensor, "n"] | None,  # noqa: F821
    *,
    recipe: str,
    accumulation: Accumulation = FP32_ACCUMULATION,
) -> FP8LinearBound:
    """How far a GEMM that adds the products as ``accumulation`` says may land from the exact sum.

    With the terms ``t_k = code_x · code_w · sx · sw`` of :func:`floatxq.fp8_scaled_linear`
    (blockwise scales per 128-wide K block), ``S = Σ|t_k|``, ``T = Σ t_k``, ``k`` cut into ``c``
    stretches of ``C = accumulation.chunk`` products with sums ``P_j`` and absolute sums ``A_j``,
    ``b = accumulation.chunk_bits`` and ``u = 2**-24``:

    * ``worst_case = 2C · 2**-b · S + (c + 8) · u · S + 2u · |bias|`` (the first term only for
      ``C > 1``), valid for any data;
    * ``statistical = min(worst_case, 2 · (2**-b · √(Σ A_j²) + u · √(c · (T² + Σ P_j²)))
      + 3u · (Σ|P_j| + |bias|))``, for terms of random sign in no particular order.

    Both then add the output's own rounding at ``|exact| + bound`` (one unit in the last place
    of ``x.dtype`` and half a unit of FP32). The derivation, the factor 2's margin and why one
    wrong code exceeds the statistical bound: ``docs/numerics.md``, "Constants that live once".

    Numerics: float64 on ``x``'s device, about ``m · n · ⌈k / C⌉`` values at once (``m · n ·
    k / 128`` for blockwise with ``C = 1``).

    Example:
      >>> from floatxq import quantize_fp8_weight
      >>> q = quantize_fp8_weight(torch.randn(8, 64))
      >>> b = fp8_linear_error_bound(torch.randn(2, 64), *q, None, recipe="rowwise")
      >>> bool((b.statistical <= b.worst_case).all())
      True
    """
    from floatxq.fp8 import fp8_scaled_linear, fp32_reciprocal, quantize_fp8_weight

    fp8_scaled_linear(x[:0], weight, weight_scale_inv, bias, recipe=recipe)  # argument checks
    where = "fp8_linear_error_bound"
    if not isinstance(accumulation, Accumulation):
        raise TypeError(
            f"{where}: accumulation must be an Accumulation, got {type(accumulation).__name__}"
        )
    chunk = accumulation.chunk
    if recipe == "blockwise" and K_GROUP % chunk:
        raise ValueError(
            f"{where}: blockwise GEMMs promote at each 128-wide scale block, so chunk must "
            f"divide {K_GROUP}, got {chunk}"
        )
    k, n = x.shape[1], weight.shape[0]
    method, block = _X_QUANTIZATION[recipe]
    x_format = str(weight.dtype).removeprefix("torch.") if recipe == "tensorwise" else None
    xq = quantize_fp8_weight(
        x, format=x_format or "float8_e4m3fn", weight_scale_method=method, weight_block_size=block
    )
    # the direct scales as the GEMMs are given them: FP32 IEEE quotients
    sx = fp32_reciprocal(xq.scale_inv).double()
    sw = fp32_reciprocal(weight_scale_inv).double()
    cx, cw = xq.qweight.float().double(), weight.float().double()
    width = chunk if chunk > 1 else (K_GROUP if recipe == "blockwise" else max(k, 1))
    parts = _stretch_sums(cx, cw, sx, sw, recipe, width)
    absolute = _stretch_sums(cx.abs(), cw.abs(), sx, sw, recipe, width)
    squares = None
    if chunk == 1:
        squares = _stretch_sums(cx.square(), cw.square(), sx.square(), sw.square(), recipe, width)
    rounded_bias = (
        bias.to(x.dtype).double() if bias is not None else parts.new_zeros(n)
    )  # as the routes add it
    return _bounds(parts, absolute, squares, k, accumulation, rounded_bias, x.dtype)


def _bounds(
    parts: Tensor,
    absolute: Tensor,
    squares: Tensor | None,
    k: int,
    accumulation: Accumulation,
    rounded_bias: Tensor,
    dtype: torch.dtype,
) -> FP8LinearBound:
    """The two bounds of :func:`fp8_linear_error_bound` from the ``(m, n, stretches)`` sums of
    the terms and of their magnitudes (``squares``: per-stretch sums of squared terms, for FP32
    accumulation, where every term is its own stretch)."""
    chunk = accumulation.chunk
    total, s = parts.sum(-1), absolute.sum(-1)
    if chunk > 1:
        stretches = parts.shape[-1]
        sq = parts.square().sum(-1)
        truncation = 2.0**-accumulation.chunk_bits * absolute.square().sum(-1).sqrt()
        worst_truncation = 2 * chunk * 2.0**-accumulation.chunk_bits * s
    else:
        stretches = k
        sq = squares.sum(-1)
        truncation = worst_truncation = torch.zeros_like(s)
    b = rounded_bias.abs()
    u = _FP32_UNIT
    worst = worst_truncation + (stretches + 8) * u * s + 2 * u * b
    summing = u * (stretches * (total.square() + sq)).sqrt()
    statistical = _SPREAD * (truncation + summing) + 3 * u * (parts.abs().sum(-1) + b)
    statistical = torch.minimum(statistical, worst)
    exact = total + rounded_bias
    return FP8LinearBound(
        exact,
        worst + _rounding(exact, worst, dtype),
        statistical + _rounding(exact, statistical, dtype),
    )


def _grouped_sums(a: Tensor, w: Tensor, width: int) -> Tensor:
    """``(m, n, k / width)`` sums of ``a[m, k] · w[k, n]`` over consecutive ``width``-wide
    stretches of k (``width`` divides k)."""
    (m, k), n = a.shape, w.shape[1]
    return torch.einsum(
        "mjc,jcn->mnj", a.reshape(m, k // width, width), w.reshape(k // width, width, n)
    )


def w4a_fp8_linear_error_bound(
    codes: Shaped[Tensor, "m k"],
    row_scale: Float32[Tensor, "m"],  # noqa: F821
    weight: Shaped[Tensor, "rows n"],
    scales: Float[Tensor, "groups n"],
    bias: Float[Tensor, "n"] | None,  # noqa: F821
    *,
    output_dtype: torch.dtype,
    accumulation: Accumulation = FP32_ACCUMULATION,
) -> FP8LinearBound:
    """:func:`fp8_linear_error_bound` for the grouped W4A-FP8 GEMM.

    The terms are ``t_k = code[m, k] · c[k, n] · scales[k // 128, n] · row_scale[m]`` (every
    product exact), summed per 128-wide group in stretches of ``accumulation.chunk`` (which
    must divide 128) and then across groups in FP32; the bounds are those of
    :func:`fp8_linear_error_bound` for these terms, the bias as the GEMM adds it (FP32 of its
    stored value) and one rounding to ``output_dtype``. ``exact`` is the float64 value of
    :func:`floatxq.w4a_fp8_linear_prepacked` before any rounding.

    Numerics: float64 on ``codes``' device.
    """
    from floatxq.w4a.linear import centered_weight

    chunk = accumulation.chunk
    if K_GROUP % chunk:
        raise ValueError(f"w4a_fp8_linear_error_bound: chunk must divide {K_GROUP}, got {chunk}")
    k = codes.shape[1]
    a = codes.float().double()
    w = centered_weight(weight).double()
    n = w.shape[1]
    width = chunk if chunk > 1 else K_GROUP
    groups = torch.arange(k // width, device=a.device) * width // K_GROUP
    scale = scales.double()[groups].T[None] * row_scale.double()[:, None, None]  # (m, n, j)
    parts = _grouped_sums(a, w, width) * scale
    absolute = _grouped_sums(a.abs(), w.abs(), width) * scale.abs()
    squares = None
    if chunk == 1:
        squares = _grouped_sums(a.square(), w.square(), width) * scale.square()
    b = bias.double() if bias is not None else parts.new_zeros(n)
    return _bounds(parts, absolute, squares, k, accumulation, b, output_dtype)


def w4a_nvfp4_linear_error_bound(
    codes: Shaped[Tensor, "m half"],
    scales: Shaped[Tensor, "groups padded"],
    global_scale: Float[Tensor, "*one"] | float,
    weight: Shaped[Tensor, "rows n"],
    group_scales: Float[Tensor, "groups n"],
    bias: Float[Tensor, "n"] | None,  # noqa: F821
    *,
    token_scale: Float32[Tensor, "m"] | None = None,  # noqa: F821
    output_dtype: torch.dtype,
    accumulation: Accumulation = FP32_ACCUMULATION,
) -> FP8LinearBound:
    """:func:`fp8_linear_error_bound` for the W4A-NVFP4 GEMM, its two summation routes at once.

    The terms are ``t_k = a[m, k] · c[k, n] · group_scales[k // 128, n] · global_scale ·
    token_scale[m]`` (``a`` the decoded activation without the global scale, ``c`` the centered
    weight); ``exact``: the prepacked GEMM in float64. Element by element the larger bound of:

    * direct (a kernel summing ``a · c``): :func:`fp8_linear_error_bound`'s bounds for these
      terms, each 128-wide group summed in stretches of ``accumulation.chunk``, then in FP32;
    * planes (the reference, as NVFP4 tensor cores): the same bounds on the ``2k`` terms
      ``{a·low·s, 4·a·high·s}`` (``S`` at most ``3 Σ|t_k|``).

    Output rounding as in :func:`fp8_linear_error_bound`; the statistical bound assumes
    activations of random sign (derivation: ``docs/numerics.md``, "Constants that live once").

    Raises:
      TypeError, ValueError: as :func:`floatxq.w4a_nvfp4_linear_prepacked`; an ``accumulation``
        that is not an :class:`Accumulation` or whose chunk does not divide 128.

    Numerics: float64 on ``codes``' device, a few ``(m, n, k / C)`` tensors at once.

    Example:
      >>> codes = torch.full((1, 64), 0x22, dtype=torch.uint8)  # every element e2m1 1.0
      >>> scales = torch.zeros(1, 1024, dtype=torch.float8_e4m3fn)
      >>> scales[0, [0, 1, 2, 3, 512, 513, 514, 515]] = 0.5  # row 0's 8 block scales
      >>> w = torch.full((128, 2), 3.0).to(torch.float8_e4m3fn)
      >>> b = w4a_nvfp4_linear_error_bound(codes, scales, 2.0, w, torch.ones(1, 2), None,
      ...     output_dtype=torch.float32)
      >>> b.exact.tolist(), bool((b.statistical <= b.worst_case).all())
      ([[384.0, 384.0]], True)
    """
    from floatxq.nvfp4.operand import nvfp4_decode_swizzled
    from floatxq.w4a.linear import _check_nvfp4_operands, _weight_planes

    where = "w4a_nvfp4_linear_error_bound"
    if not isinstance(accumulation, Accumulation):
        raise TypeError(
            f"{where}: accumulation must be an Accumulation, got {type(accumulation).__name__}"
        )
    chunk = accumulation.chunk
    if K_GROUP % chunk:
        raise ValueError(f"{where}: chunk must divide {K_GROUP}, got {chunk}")
    m, k, n, g = _check_nvfp4_operands(
        codes, scales, global_scale, weight, group_scales, bias, token_scale, output_dtype,
        where=where,
    )  # fmt: skip
    a = nvfp4_decode_swizzled(codes, scales, 1.0, k, torch.float32).double()  # exact
    c, (low, high) = _weight_planes(weight, where=where)
    width = chunk if chunk > 1 else K_GROUP
    groups = torch.arange(k // width, device=a.device) * width // K_GROUP
    row = g.double() * (token_scale.double() if token_scale is not None else a.new_ones(m))
    scale = group_scales.to(torch.float32).double()[groups].T[None] * row[:, None, None]

    def sums(w: Tensor) -> tuple[Tensor, Tensor, Tensor | None]:
        """Per-stretch sums of the terms ``a · w · scale``, of their magnitudes and squares."""
        parts = _grouped_sums(a, w, width) * scale
        absolute = _grouped_sums(a.abs(), w.abs(), width) * scale.abs()
        squares = None
        if chunk == 1:
            squares = _grouped_sums(a.square(), w.square(), width) * scale.square()
        return parts, absolute, squares

    b = bias.to(torch.float32).double() if bias is not None else a.new_zeros(n)
    direct = _bounds(*sums(c.double()), k, accumulation, b, output_dtype)
    (lp, la, ls), (hp, ha, hs) = sums(low.double()), sums(4 * high.double())
    joined = None if ls is None else torch.cat([ls, hs], dim=-1)
    planes = _bounds(
        torch.cat([lp, hp], dim=-1), torch.cat([la, ha], dim=-1), joined, 2 * k, accumulation,
        b, output_dtype,
    )  # fmt: skip
    return FP8LinearBound(
        direct.exact,
        torch.maximum(direct.worst_case, planes.worst_case),
        torch.maximum(direct.statistical, planes.statistical),
    )


def w4a16_linear_error_bound(
    x: Float[Tensor, "m k"],
    weight: Float[Tensor, "n k"],
    bias: Float[Tensor, "n"] | None,  # noqa: F821
    *,
    accumulation: Accumulation = FP32_ACCUMULATION,
) -> FP8LinearBound:
    """:func:`fp8_linear_error_bound` for ``F.linear(x, weight, bias)`` with FP32 accumulation
    of exact products (``x`` and ``weight`` in float16/bfloat16, the W4A16 kernels' operands:
    ``weight`` is the decoded GPTQ weight in ``x``'s dtype), the bias in ``x``'s dtype, one
    rounding to ``x``'s dtype.

    Numerics: float64 on ``x``'s device.
    """
    k = x.shape[1]
    a, w = x.double(), weight.double().T
    width = accumulation.chunk if accumulation.chunk > 1 else max(k, 1)
    pad = -k % width
    if pad:
        a = torch.cat([a, a.new_zeros(a.shape[0], pad)], 1)
        w = torch.cat([w, w.new_zeros(pad, w.shape[1])], 0)
    parts = _grouped_sums(a, w, width)
    absolute = _grouped_sums(a.abs(), w.abs(), width)
    squares = _grouped_sums(a.square(), w.square(), width) if accumulation.chunk == 1 else None
    b = bias.to(x.dtype).double() if bias is not None else parts.new_zeros(weight.shape[0])
    return _bounds(parts, absolute, squares, k, accumulation, b, x.dtype)


def decoded_linear_error_bound(
    x: Float[Tensor, "m k"],
    weight: Float32[Tensor, "n k"],
    bias: Float[Tensor, "n"] | None,  # noqa: F821
    *,
    out_dtype: torch.dtype,
) -> FP8LinearBound:
    """:func:`fp8_linear_error_bound` for ``x @ weight.T + bias`` evaluated in FP32 in any order
    (``x`` and ``bias`` widened to FP32 exactly, ``weight`` an FP32 decoded weight such as
    ``code / scale_inv``), then rounded once to ``out_dtype``: the FP8 layers that decode their
    weight and multiply in FP32 (the MLX linears and kernels, whose division by the inverse
    scale may come after a partial sum instead of before each product).

    ``worst_case`` is ``(k + 8) · u · Σ|x · w| + 2u · |bias|`` plus the output's rounding, which
    covers the rounding of each product, of the decoded weight, of each scale division and of
    every FP32 addition in any order.

    Numerics: float64 on ``x``'s device.

    Example:
      >>> b = decoded_linear_error_bound(torch.ones(1, 4), torch.ones(2, 4), None,
      ...                                out_dtype=torch.float16)
      >>> b.exact.tolist()
      [[4.0, 4.0]]
    """
    k = x.shape[1]
    a, w = x.double(), weight.double().T
    width = max(k, 1)
    parts = _grouped_sums(a, w, width)
    absolute = _grouped_sums(a.abs(), w.abs(), width)
    squares = _grouped_sums(a.square(), w.square(), width)
    b = bias.double() if bias is not None else parts.new_zeros(weight.shape[0])
    return _bounds(parts, absolute, squares, k, FP32_ACCUMULATION, b, out_dtype)


def assert_within_bound(
    actual: Shaped[Tensor, "m n"],
    bound: FP8LinearBound,
    *,
    which: Literal["statistical", "worst_case"] = "statistical",
    msg: str = "",
) -> None:
    """Assert ``|actual - bound.exact| <= bound.<which>`` element by element.

    Raises:
      AssertionError: a shape other than the bound's, or elements outside it (the worst ones
        named, with ``error / bound``).
    """
    prefix = f"{msg}: " if msg else ""
    if tuple(actual.shape) != tuple(bound.exact.shape):
        raise AssertionError(
            f"{prefix}shape {tuple(actual.shape)} != expected {tuple(bound.exact.shape)}"
        )
    limit = bound.statistical if which == "statistical" else bound.worst_case
    error = (actual.double() - bound.exact).abs()
    bad = ~(error <= limit)
    if not bool(bad.any()):
        return
    raise AssertionError(
        f"{prefix}{_outside(actual, bad)} the {which} bound "
        f"(index, actual, exact, error / bound): {_worst(actual, bound.exact, error, limit, bad)}"
    )


def _outside(actual: Tensor, bad: Tensor) -> str:
    return f"{int(bad.sum())} of {actual.numel()} elements outside"


def _worst(
    actual: Tensor, exact: Tensor, error: Tensor, limit: Tensor, bad: Tensor
) -> list[tuple[Any, ...]]:
    """The five elements furthest outside their bound: ``((row, col), actual, exact, ratio)``."""
    n = actual.shape[1]
    ratio = torch.where(bad, error / limit, torch.zeros_like(error))
    worst = ratio.flatten().argsort(descending=True)[: min(int(bad.sum()), 5)]
    return [
        (divmod(int(i), n), actual.flatten()[i].item(), exact.flatten()[i].item(),
         round(ratio.flatten()[i].item(), 3))
        for i in worst
    ]  # fmt: skip


def _stretch_sums(
    cx: Tensor, cw: Tensor, sx: Tensor, sw: Tensor, recipe: str, width: int
) -> Tensor:
    """``(m, n, ⌈k / width⌉)`` sums of ``cx · cw · sx · sw`` over consecutive ``width``-wide
    stretches of k (blockwise: ``width`` divides 128 or is 128, each stretch in one block)."""
    (m, k), n = cx.shape, cw.shape[0]
    stretches = -(-k // width)
    pad = stretches * width - k
    if pad:  # (a zero-filled copy: F.pad is slow on CPU)
        cx = torch.cat([cx, cx.new_zeros(m, pad)], dim=1)
        cw = torch.cat([cw, cw.new_zeros(n, pad)], dim=1)
    a, w = cx.reshape(m, stretches, width), cw.reshape(n, stretches, width)
    sums = torch.einsum("mjc,njc->mnj", a, w)
    if recipe == "tensorwise":
        return sums * (sx * sw)
    if recipe == "rowwise":
        return sums * (sx[:, None, None] * sw[None, :, None])
    block = torch.arange(sums.shape[-1], device=cx.device) * width // K_GROUP
    scale = sx[:, None, :] * sw.repeat_interleave(K_GROUP, dim=0)[None, :n, :]
    return sums * scale[:, :, block]


def _rounding(exact: Tensor, bound: Tensor, dtype: torch.dtype) -> Tensor:
    """One unit in the last place of ``dtype`` and half of FP32's at ``|exact| + bound``."""
    magnitude = exact.abs() + bound
    return _spacing(magnitude, dtype) + 0.5 * _spacing(magnitude, torch.float32)


def _spacing(magnitude: Tensor, dtype: torch.dtype) -> Tensor:
    """The gap between neighbouring ``dtype`` values at ``magnitude`` (subnormals included)."""
    tiny = torch.finfo(dtype).tiny
    exponent = torch.floor(torch.log2(magnitude.clamp_min(tiny)))
    return torch.exp2(exponent - _MANTISSA_BITS[dtype])


def assert_fp8_linear_close(
    actual: Shaped[Tensor, "m n"],
    x: Shaped[Tensor, "m k"],
    weight: Shaped[Tensor, "n k"],
    weight_scale_inv: Shaped[Tensor, "*scale"],
    bias: Shaped[Tensor, "n"] | None,  # noqa: F821
    *,
    recipe: str,
    accumulation: Accumulation = FP32_ACCUMULATION,
    bound: Literal["statistical", "worst_case"] = "statistical",
    msg: str = "",
) -> None:
    """Assert ``actual`` is :func:`floatxq.fp8_scaled_linear` up to its GEMM's accumulation error.

    Per element, ``|actual - exact| <= bound`` (or ``actual`` equals the reference bit for bit,
    infinities included, or both are NaN), with ``exact`` and the bound of
    :func:`fp8_linear_error_bound` for ``accumulation``: ``FP32_ACCUMULATION`` (the default)
    for FP32 sums, ``HOPPER_FP8_ACCUMULATION`` for Hopper FP8 tensor cores (cuBLAS's
    ``scaled_mm`` and the Triton kernel). ``bound="statistical"`` (the default) is the one a
    single FP8 code of ``x`` moved by one step exceeds on random data; ``"worst_case"`` holds
    for any data but grows like ``k · Σ|terms|`` and lets such an error pass at large ``k``.

    Raises:
      AssertionError: a dtype or shape other than the reference's, or elements outside the
        bound (the worst ones named, with ``error / bound``).
      ValueError: an unknown ``bound``.

    Numerics: float64 on ``x``'s device.
    """
    from floatxq.fp8 import fp8_scaled_linear

    if bound not in ("statistical", "worst_case"):
        raise ValueError(
            f"assert_fp8_linear_close: bound must be 'statistical' or 'worst_case', got {bound!r}"
        )
    prefix = f"{msg}: " if msg else ""
    reference = fp8_scaled_linear(x, weight, weight_scale_inv, bias, recipe=recipe)
    if actual.dtype != reference.dtype or actual.shape != reference.shape:
        raise AssertionError(
            f"{prefix}{actual.dtype} {tuple(actual.shape)} != expected {reference.dtype} "
            f"{tuple(reference.shape)}"
        )
    bounds = fp8_linear_error_bound(
        x, weight, weight_scale_inv, bias, recipe=recipe, accumulation=accumulation
    )
    limit = bounds.statistical if bound == "statistical" else bounds.worst_case
    error = (actual.double() - bounds.exact).abs()
    same = (actual == reference) | (actual.isnan() & reference.isnan())
    bad = ~(error <= limit) & ~same
    if not bool(bad.any()):
        return
    shown = _worst(actual, bounds.exact, error, limit, bad)
    raise AssertionError(
        f"{prefix}{_outside(actual, bad)} the {bound} bound for "
        f"{accumulation} (index, actual, exact, error / bound): {shown}"
    )
