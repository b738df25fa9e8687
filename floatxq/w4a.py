"""Pure references of the INT4-weight GEMMs: W4A-FP8 (grouped, FP8 tokens) and W4A16.

Both take ordinary GPTQ checkpoints. The Triton kernels in :mod:`floatxq.kernels.w4a_fp8` and
:mod:`floatxq.kernels.w4a16` must equal these up to FP32 summation order (their tests bound the
difference per element against a float64 oracle of the same operands).

W4A-FP8 (a symmetric 4-bit GPTQ weight with groups of 128 and ``desc_act=False``): ``x`` is
quantized per token to E4M3 (:func:`floatxq.fp8_token_quantize`), the weight is the centered
integer ``c = code - 8`` (exact in E4M3, :func:`floatxq.int4.int4_to_e4m3`), and

    out[m, n] = (Σ_g scales[g, n] · Σ_{k in group g} codes[m, k] · c[k, n]) · row_scale[m] + bias[n]

with each group's 128 products summed in FP32 (every product of an E4M3 code and an integer of
magnitude ≤ 8 is exact), the groups added in ascending order, the token scale applied once at the
end, then the bias, then one rounding to the output dtype.

W4A16: the weight decoded exactly as :func:`floatxq.int4.dequantize_gptq` does, rounded once to
``x``'s dtype, then ``F.linear`` (FP32 accumulation) and the bias in ``x``'s dtype: what
:class:`floatxq.nn.GPTQLinear` computes.
"""

import torch
import torch.nn.functional as F

from floatxq._checks import (
    require_data,
    require_floating,
    require_positive_finite,
    require_tensor,
)
from floatxq._typing import Float, Float8e4m3fn, Float32, Shaped, Tensor
from floatxq.formats import GPTQ_W4A_GROUP_SIZE
from floatxq.fp8 import fp8_token_quantize
from floatxq.int4 import GPTQPacked, _unpack_fields, dequantize_gptq

__all__ = [
    "W4A_OUTPUT_DTYPES",
    "centered_weight",
    "w4a16_linear",
    "w4a_fp8_linear",
    "w4a_fp8_linear_prepacked",
]

W4A_OUTPUT_DTYPES: tuple[torch.dtype, ...] = (torch.float16, torch.bfloat16, torch.float32)
"""Output dtypes of the W4A-FP8 GEMM."""

_GROUP = GPTQ_W4A_GROUP_SIZE


def centered_weight(weight: Shaped[Tensor, "rows n"], *, where: str = "centered_weight") -> Tensor:
    """The centered integer weight ``(k, n)`` as FP32, from either W4A-FP8 weight operand.

    Args:
      weight: ``float8_e4m3fn (k, n)`` staged operand (values ``-8..7``), or ``int32 (k/8, n)``
        symmetric GPTQ words (zero point 8: each nibble ``code`` stands for ``code - 8``; input
        row ``k`` in word ``k // 8`` at bits ``4 * (k % 8)``).
      where: the caller's name, for error messages.

    Returns:
      FP32 ``(k, n)`` integers in ``-8..7`` (E4M3 values as they are).

    Raises:
      TypeError: another dtype, or not a 2-D tensor.

    Numerics: exact.

    Example:
      >>> centered_weight(torch.tensor([[0x76543210]], dtype=torch.int32)).flatten().tolist()
      [-8.0, -7.0, -6.0, -5.0, -4.0, -3.0, -2.0, -1.0]
    """
    _check_weight(weight, where=where)
    if weight.dtype == torch.int32:
        return (_unpack_fields(weight, 0, 4).to(torch.int16) - 8).to(torch.float32)
    return weight.to(torch.float32)


def _check_weight(weight: object, *, where: str) -> None:
    require_tensor(weight, name="weight", where=where)
    require_data(weight, name="weight", where=where)
    if weight.ndim != 2 or weight.dtype not in (torch.float8_e4m3fn, torch.int32):
        raise TypeError(
            f"{where}: weight must be a 2-D float8_e4m3fn (k, n) staged operand or int32 "
            f"(k/8, n) GPTQ words, got {weight.dtype} {tuple(weight.shape)}"
        )


def _check_operands(
    k: int, device: torch.device, weight: Tensor, scales: Tensor,
    bias: Tensor | None, *, where: str,
) -> int:  # fmt: skip
    """Shapes, dtypes and devices of the weight side; returns ``n``."""
    _check_weight(weight, where=where)  # dtype and rank (no data read: no device work)
    packed = weight.dtype == torch.int32
    depth = weight.shape[0] * 8 if packed else weight.shape[0]
    n = weight.shape[1]
    if k % _GROUP:
        raise ValueError(
            f"{where}: k={k} must be a multiple of {_GROUP} (GPTQ groups of {_GROUP}, "
            f"desc_act=False)"
        )
    if depth != k:
        got = f"({weight.shape[0]}, {n}) int32 words" if packed else f"({depth}, {n})"
        raise ValueError(f"{where}: weight must hold k={k} input rows, got {got}")
    require_floating(scales, name="scales", where=where)
    require_data(scales, name="scales", where=where)
    if tuple(scales.shape) != (k // _GROUP, n):
        raise ValueError(
            f"{where}: scales must have shape {(k // _GROUP, n)} (one per group of {_GROUP} "
            f"input rows and output column), got {tuple(scales.shape)}"
        )
    if bias is not None:
        require_floating(bias, name="bias", where=where)
        require_data(bias, name="bias", where=where)
        if tuple(bias.shape) != (n,):
            raise ValueError(f"{where}: bias must have shape ({n},), got {tuple(bias.shape)}")
    others = (weight, scales) + ((bias,) if bias is not None else ())
    devices = {t.device for t in others} | {device}
    if len(devices) != 1:
        raise TypeError(
            f"{where}: every tensor must be on one device, got {sorted(map(str, devices))}"
        )
    return n


def w4a_fp8_linear_prepacked(
    codes: Float8e4m3fn[Tensor, "m k"],
    row_scale: Float32[Tensor, "m"],  # noqa: F821
    weight: Shaped[Tensor, "rows n"],
    scales: Float[Tensor, "groups n"],
    bias: Float[Tensor, "n"] | None = None,  # noqa: F821
    *,
    output_dtype: torch.dtype,
) -> Float[Tensor, "m n"]:
    """The grouped W4A-FP8 GEMM on already quantized tokens.

    Args:
      codes: ``(m, k)`` E4M3 token codes; ``k`` a multiple of 128.
      row_scale: ``(m,)`` FP32 direct token scales (multiply to decode), positive and finite.
      weight: the centered weight as a ``float8_e4m3fn (k, n)`` staged operand or ``int32
        (k/8, n)`` symmetric GPTQ words (see :func:`centered_weight`).
      scales: ``(k/128, n)`` GPTQ group scales, any floating dtype (read as FP32).
      bias: ``(n,)`` floating or None (read as FP32).
      output_dtype: float16, bfloat16 or float32.

    Returns:
      ``(m, n)`` in ``output_dtype``.

    Raises:
      TypeError: wrong dtypes, tensors on different devices.
      ValueError: shapes that do not fit, ``k`` not a multiple of 128, a ``row_scale`` that is
        not positive and finite.

    Numerics: FP32 per group (exact products), ``total += partial_g · float32(scales[g])`` in
    ascending ``g``, ``× row_scale``, ``+ float32(bias)``, one nearest-even rounding.

    Example:
      >>> codes = torch.full((1, 128), 2.0).to(torch.float8_e4m3fn)
      >>> w = torch.full((128, 2), -3.0).to(torch.float8_e4m3fn)
      >>> w4a_fp8_linear_prepacked(codes, torch.tensor([0.5]), w, torch.ones(1, 2).half(),
      ...     output_dtype=torch.float32).tolist()
      [[-384.0, -384.0]]
    """
    where = "w4a_fp8_linear_prepacked"
    require_tensor(codes, name="codes", where=where)
    require_data(codes, name="codes", where=where)
    if codes.dtype != torch.float8_e4m3fn or codes.ndim != 2:
        raise TypeError(
            f"{where}: codes must be a 2-D float8_e4m3fn (m, k) tensor, got {codes.dtype} "
            f"{tuple(codes.shape)}"
        )
    m, k = codes.shape
    require_tensor(row_scale, name="row_scale", where=where)
    if row_scale.dtype != torch.float32:
        raise TypeError(f"{where}: row_scale must be float32, got {row_scale.dtype}")
    if tuple(row_scale.shape) != (m,):
        raise ValueError(
            f"{where}: row_scale must have shape ({m},) (one per row of codes), got "
            f"{tuple(row_scale.shape)}"
        )
    if output_dtype not in W4A_OUTPUT_DTYPES:
        raise TypeError(
            f"{where}: output_dtype must be float16, bfloat16 or float32, got {output_dtype!r}"
        )
    n = _check_operands(k, codes.device, weight, scales, bias, where=where)
    if row_scale.device != codes.device:
        raise TypeError(f"{where}: row_scale is on {row_scale.device}, codes on {codes.device}")
    require_positive_finite(row_scale, name="row_scale", where=where)
    groups = k // _GROUP
    a = codes.to(torch.float32).reshape(m, groups, _GROUP).transpose(0, 1)  # (g, m, 128)
    w = centered_weight(weight, where=where).reshape(groups, _GROUP, n)
    partials = torch.bmm(a, w)  # (g, m, n): FP32 sums of exact products
    s = scales.to(torch.float32)
    total = torch.zeros((m, n), dtype=torch.float32, device=codes.device)
    for g in range(groups):  # ascending, strictly in FP32
        total = total + partials[g] * s[g]
    total = total * row_scale[:, None]
    if bias is not None:
        total = total + bias.to(torch.float32)
    return total.to(output_dtype)


def w4a_fp8_linear(
    x: Float[Tensor, "m k"],
    weight: Shaped[Tensor, "rows n"],
    scales: Float[Tensor, "groups n"],
    bias: Float[Tensor, "n"] | None = None,  # noqa: F821
) -> Float[Tensor, "m n"]:
    """The W4A-FP8 linear: ``x`` quantized per token to E4M3, then the grouped GEMM.

    Args:
      x: ``(m, k)`` float16/bfloat16/float32 activations, finite; ``k`` a multiple of 128.
      weight, scales, bias: as :func:`w4a_fp8_linear_prepacked`.

    Returns:
      ``(m, n)`` in ``x.dtype``.

    Raises:
      TypeError, ValueError: as :func:`w4a_fp8_linear_prepacked`; NaN or infinity in ``x``.

    Numerics: :func:`floatxq.fp8_token_quantize` (``amax / 448`` per row, IEEE division,
    nearest-even saturating E4M3), then :func:`w4a_fp8_linear_prepacked`.

    Example:
      >>> w = torch.full((128, 2), 1.0).to(torch.float8_e4m3fn)
      >>> w4a_fp8_linear(torch.ones(1, 128), w, torch.full((1, 2), 0.5)).tolist()
      [[64.0, 64.0]]
    """
    where = "w4a_fp8_linear"
    require_floating(x, name="x", where=where)
    if x.ndim != 2 or x.dtype not in W4A_OUTPUT_DTYPES:
        raise TypeError(
            f"{where}: x must be a 2-D float16/bfloat16/float32 (m, k) tensor, got {x.dtype} "
            f"{tuple(x.shape)}"
        )
    _check_operands(x.shape[1], x.device, weight, scales, bias, where=where)
    tokens = fp8_token_quantize(x)
    return w4a_fp8_linear_prepacked(
        tokens.codes, tokens.scale[:, 0], weight, scales, bias, output_dtype=x.dtype
    )


def w4a16_linear(
    x: Float[Tensor, "m k"],
    packed: GPTQPacked,
    bias: Float[Tensor, "n"] | None = None,  # noqa: F821
    *,
    bits: int = 4,
    format: str = "gptq",
) -> Float[Tensor, "m n"]:
    """The W4A16 linear: the GPTQ weight decoded in ``x``'s dtype, then ``F.linear``.

    Args:
      x: ``(m, k)`` floating activations.
      packed: a :class:`floatxq.int4.GPTQPacked` (any group layout, 2/4/8 bits).
      bias: ``(n,)`` floating or None (cast to ``x``'s dtype).
      bits: the code width of ``packed``.
      format: ``"gptq"`` (v1 zeros) or ``"gptq_v2"``.

    Returns:
      ``(m, n)`` in ``x.dtype``.

    Raises:
      TypeError, ValueError: as :func:`floatxq.int4.dequantize_gptq`; ``x`` not ``(m, k)``.

    Numerics: ``W = round_x.dtype(float32(scale) · (code - zero))`` (exact product), then
    ``F.linear(x, W, bias)`` with FP32 accumulation.

    Example:
      >>> from floatxq.int4 import pack_gptq_int4
      >>> p = pack_gptq_int4(torch.full((128, 8), 9), torch.full((1, 8), 8),
      ...     torch.full((1, 8), 0.5), torch.zeros(128, dtype=torch.int32))
      >>> w4a16_linear(torch.ones(1, 128), p)[0, :2].tolist()
      [64.0, 64.0]
    """
    where = "w4a16_linear"
    require_floating(x, name="x", where=where)
    weight = dequantize_gptq(packed, bits=bits, format=format, dtype=x.dtype)
    if x.ndim != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"{where}: x must have shape (m, {weight.shape[1]}), got {tuple(x.shape)}")
    return F.linear(x, weight, None if bias is None else bias.to(x.dtype))
