"""Pure references of the INT4-weight GEMMs: W4A-FP8, W4A-NVFP4 (grouped) and W4A16.

All take ordinary GPTQ checkpoints (a symmetric 4-bit weight, groups of 128, ``desc_act=False``
for the W4A GEMMs). The Triton kernels in :mod:`floatxq.kernels.w4a_fp8`,
:mod:`floatxq.kernels.nvfp4` and :mod:`floatxq.kernels.w4a16` must equal these up to FP32
summation order (their tests bound the difference per element against a float64 oracle).

* W4A-FP8: per-token E4M3 ``x`` times the centered weight ``c = code - 8`` (exact in E4M3),
  ``out = (Σ_g scales[g] · Σ_{k in g} codes · c) · row_scale + bias``.
* W4A-NVFP4: an NVFP4 operand ``a = e2m1(code) · block_scale`` times ``c = low + 4·high`` as
  two exact E2M1 planes, ``out = (Σ_g scales[g] · Σ_{k in g} a · c) · gs · token_scale + bias``.
* W4A16: the weight decoded as :func:`floatxq.dequantize_gptq` does, then ``F.linear``.

Each group's products are exact and summed in FP32, groups added in ascending order, the
scales, the bias and one rounding at the end: ``docs/numerics.md``, "The W4A GEMMs' reference
order", says why each step is exact and in which order it runs.
"""

import torch
import torch.nn.functional as F

from floatxq._checks import (
    real_scalar,
    require_data,
    require_e4m3_scales,
    require_finite,
    require_floating,
    require_positive_finite,
    require_tensor,
)
from floatxq._typing import Float, Float8e4m3fn, Float32, Shaped, Tensor
from floatxq.formats import (
    K_GROUP,
    MODEL_DTYPES,
    NVFP4_DEFAULT_RECIPE,
    NVFP4RecipeName,
    normalize_nvfp4_recipe,
)
from floatxq.fp8 import fp8_token_quantize
from floatxq.gptq.decode_words import unstage_decode_words
from floatxq.gptq.int4 import GPTQPacked, _unpack_fields, dequantize_gptq
from floatxq.gptq.planes import Int4Planes, split_int4_planes
from floatxq.nvfp4.operand import nvfp4_decode_swizzled, nvfp4_pack_swizzled, padded_rows
from floatxq.nvfp4.quantize import _validated_global_scale, nvfp4_global_scale

__all__ = [
    "W4A_OUTPUT_DTYPES",
    "centered_weight",
    "w4a16_linear",
    "w4a_fp8_linear",
    "w4a_fp8_linear_prepacked",
    "w4a_nvfp4_accumulate_group",
    "w4a_nvfp4_linear",
    "w4a_nvfp4_linear_prepacked",
]

W4A_OUTPUT_DTYPES: tuple[torch.dtype, ...] = MODEL_DTYPES
"""Output dtypes of the W4A-FP8 GEMM."""


def centered_weight(weight: Shaped[Tensor, "rows n"], *, where: str = "centered_weight") -> Tensor:
    """The centered integer weight ``(k, n)`` as FP32, from either W4A-FP8 weight operand.

    Args:
      weight: ``float8_e4m3fn (k, n)`` staged operand (values ``-8..7``), ``int32 (k/8, n)``
        symmetric GPTQ words (zero point 8: each nibble ``code`` stands for ``code - 8``; input
        row ``k`` in word ``k // 8`` at bits ``4 * (k % 8)``), or ``int16 (k/4, n)`` decode words
        of the same codes (:func:`floatxq.gptq.decode_words.stage_decode_words`).
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
    if weight.dtype == torch.int16:
        codes = unstage_decode_words(weight, weight.shape[0] * 4)
        return (codes.to(torch.int16) - 8).to(torch.float32)
    return weight.to(torch.float32)


def _check_weight(weight: object, *, where: str) -> None:
    require_tensor(weight, name="weight", where=where)
    require_data(weight, name="weight", where=where)
    if weight.ndim != 2 or weight.dtype not in (torch.float8_e4m3fn, torch.int32, torch.int16):
        raise TypeError(
            f"{where}: weight must be a 2-D float8_e4m3fn (k, n) staged operand, int32 "
            f"(k/8, n) GPTQ words or int16 (k/4, n) decode words, got {weight.dtype} "
            f"{tuple(weight.shape)}"
        )


def _check_operands(
    k: int, device: torch.device, weight: Tensor, scales: Tensor,
    bias: Tensor | None, *, where: str,
) -> int:  # fmt: skip
    """Shapes, dtypes and devices of the weight side; returns ``n``."""
    _check_weight(weight, where=where)  # dtype and rank (no data read: no device work)
    per_row = {torch.int32: 8, torch.int16: 4}.get(weight.dtype, 1)
    packed = per_row > 1
    depth = weight.shape[0] * per_row
    n = weight.shape[1]
    if k % K_GROUP:
        raise ValueError(
            f"{where}: k={k} must be a multiple of {K_GROUP} (GPTQ groups of {K_GROUP}, "
            f"desc_act=False)"
        )
    if depth != k:
        kind = "int32" if weight.dtype == torch.int32 else "int16 decode"
        got = f"({weight.shape[0]}, {n}) {kind} words" if packed else f"({depth}, {n})"
        raise ValueError(f"{where}: weight must hold k={k} input rows, got {got}")
    require_floating(scales, name="scales", where=where)
    require_data(scales, name="scales", where=where)
    if tuple(scales.shape) != (k // K_GROUP, n):
        raise ValueError(
            f"{where}: scales must have shape {(k // K_GROUP, n)} (one per group of {K_GROUP} "
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
    groups = k // K_GROUP
    a = codes.to(torch.float32).reshape(m, groups, K_GROUP).transpose(0, 1)  # (g, m, 128)
    w = centered_weight(weight, where=where).reshape(groups, K_GROUP, n)
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
      packed: a :class:`floatxq.GPTQPacked` (any group layout, 2/4/8 bits).
      bias: ``(n,)`` floating or None (cast to ``x``'s dtype).
      bits: the code width of ``packed``.
      format: ``"gptq"`` (v1 zeros) or ``"gptq_v2"``.

    Returns:
      ``(m, n)`` in ``x.dtype``.

    Raises:
      TypeError, ValueError: as :func:`floatxq.dequantize_gptq`; ``x`` not ``(m, k)``.

    Numerics: ``W = round_x.dtype(float32(scale) · (code - zero))`` (exact product), then
    ``F.linear(x, W, bias)`` with FP32 accumulation.

    Example:
      >>> from floatxq.gptq.int4 import pack_gptq
      >>> p = pack_gptq(torch.full((128, 8), 9), torch.full((1, 8), 8),
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


def _check_accumulate_operands(
    both: object, group_scale: object, acc: object, last: bool, global_scale: object,
    token_scale: object, bias: object, output_dtype: object, *, where: str,
) -> tuple[int, int]:  # fmt: skip
    """Kinds and shapes of :func:`w4a_nvfp4_accumulate_group`'s operands, and which apply only
    to the last group (no value is read); returns ``(m, n)``."""
    for name, t in (("both", both), ("acc", acc), ("token_scale", token_scale)):
        if t is not None:
            require_tensor(t, name=name, where=where)
            if t.dtype != torch.float32:
                raise TypeError(f"{where}: {name} must be float32, got {t.dtype}")
    if both.ndim != 2 or both.shape[1] % 2:
        raise ValueError(f"{where}: both must be (m, 2n), got {tuple(both.shape)}")
    m, n = both.shape[0], both.shape[1] // 2
    require_floating(group_scale, name="group_scale", where=where)
    if tuple(group_scale.shape) != (n,):
        raise ValueError(
            f"{where}: group_scale must have shape ({n},), got {tuple(group_scale.shape)}"
        )
    if acc is not None and tuple(acc.shape) != (m, n):
        raise ValueError(f"{where}: acc must have shape {(m, n)}, got {tuple(acc.shape)}")
    if not last:
        extras = (("global_scale", global_scale), ("token_scale", token_scale), ("bias", bias))
        given = [name for name, value in extras if value is not None]
        if given or output_dtype != torch.float32:
            what = ", ".join(given) or f"output_dtype={output_dtype}"
            raise ValueError(f"{where}: {what} apply only to the last group (last=True)")
    elif global_scale is None:
        raise ValueError(f"{where}: the last group needs the activation's global_scale")
    if output_dtype not in W4A_OUTPUT_DTYPES:
        raise TypeError(
            f"{where}: output_dtype must be float16, bfloat16 or float32, got {output_dtype!r}"
        )
    if token_scale is not None and tuple(token_scale.shape) != (m,):
        raise ValueError(
            f"{where}: token_scale must have shape ({m},), got {tuple(token_scale.shape)}"
        )
    if bias is not None:
        require_floating(bias, name="bias", where=where)
        if tuple(bias.shape) != (n,):
            raise ValueError(f"{where}: bias must have shape ({n},), got {tuple(bias.shape)}")
    return m, n


def w4a_nvfp4_accumulate_group(
    both: Float32[Tensor, "m two_n"],
    group_scale: Float[Tensor, "n"],  # noqa: F821
    acc: Float32[Tensor, "m n"] | None = None,
    *,
    last: bool = False,
    global_scale: Float[Tensor, "*one"] | float | None = None,
    token_scale: Float32[Tensor, "m"] | None = None,  # noqa: F821
    bias: Float[Tensor, "n"] | None = None,  # noqa: F821
    output_dtype: torch.dtype = torch.float32,
) -> Float[Tensor, "m n"]:
    """One 128-row group of the W4A-NVFP4 GEMM folded into the running FP32 sum.

    The NVFP4 tensor cores multiply the activation by the weight's two exact E2M1 planes side by
    side, giving ``both = [Σ a·low | Σ a·high]``; this step recombines them with the group scale.

    Args:
      both: ``(m, 2n)`` FP32: columns ``0..n-1`` the low plane's sums, ``n..2n-1`` the high's.
      group_scale: ``(n,)`` this group's GPTQ scales (any floating dtype, read as FP32).
      acc: ``(m, n)`` FP32 sum of the earlier groups, or None for the first group.
      last: the last group: apply ``global_scale`` (then required), ``token_scale`` (``(m,)``
        FP32) and ``bias`` (``(n,)``), and round once to ``output_dtype`` (FP16, BF16 or FP32).

    Returns:
      ``(m, n)``: the FP32 running sum, or the output in ``output_dtype`` when ``last``.

    Raises:
      ValueError: shapes that do not fit; a ``global_scale`` missing when ``last`` or given when
        not; ``token_scale``, ``bias`` or a non-FP32 ``output_dtype`` without ``last``.
      TypeError: non-FP32 ``both``/``acc``/``token_scale``, another ``output_dtype``, tensors on
        different devices.

    Numerics: FP32 in this order, no fused multiply-add: ``t = (acc or +0) + (low + 4·high) ·
    float32(group_scale)``, then when ``last``: ``· global_scale``, ``· token_scale[row]``,
    ``+ float32(bias)``, one nearest-even rounding.

    Example:
      >>> both = torch.tensor([[1.0, 2.0, 0.5, -1.0]])  # n = 2: low sums | high sums
      >>> w4a_nvfp4_accumulate_group(both, torch.tensor([2.0, 1.0])).tolist()
      [[6.0, -2.0]]
    """
    where = "w4a_nvfp4_accumulate_group"
    _, n = _check_accumulate_operands(
        both, group_scale, acc, last, global_scale, token_scale, bias, output_dtype, where=where
    )
    tensors = [t for t in (both, group_scale, acc, token_scale, bias) if t is not None]
    devices = {t.device for t in tensors}
    if len(devices) != 1:
        raise TypeError(
            f"{where}: every tensor must be on one device, got {sorted(map(str, devices))}"
        )
    low, high = both[:, :n], both[:, n:]
    start = torch.zeros((), dtype=torch.float32, device=both.device) if acc is None else acc
    t = start + (low + high * 4.0) * group_scale.to(torch.float32)
    if not last:
        return t
    g = real_scalar(global_scale, name="global_scale", where=where, device=both.device)
    t = t * g
    if token_scale is not None:
        t = t * token_scale[:, None]
    if bias is not None:
        t = t + bias.to(torch.float32)
    return t.to(output_dtype)


_E2M1_CODE_DTYPES = (torch.uint8, torch.float4_e2m1fn_x2)


def _check_nvfp4_weight_side(
    k: int, device: torch.device, weight: object, group_scales: object, bias: object, *,
    where: str,
) -> int:  # fmt: skip
    """:func:`_check_operands` with the group scales named ``group_scales``; returns ``n``."""
    _check_weight(weight, where=where)
    n = weight.shape[1]
    require_floating(group_scales, name="group_scales", where=where)
    if tuple(group_scales.shape) != (k // K_GROUP, n):
        raise ValueError(
            f"{where}: group_scales must have shape {(k // K_GROUP, n)} (one per group of "
            f"{K_GROUP} input rows and output column), got {tuple(group_scales.shape)}"
        )
    return _check_operands(k, device, weight, group_scales, bias, where=where)


def _check_nvfp4_shapes(
    codes: object, scales: object, weight: object, group_scales: object, bias: object,
    token_scale: object, output_dtype: object, *, where: str,
) -> tuple[int, int, int]:  # fmt: skip
    """Kinds, shapes and devices of the W4A-NVFP4 GEMM's operands (no value is read; the
    kernels share it); returns ``(m, k, n)``."""
    require_tensor(codes, name="codes", where=where)
    if codes.dtype not in _E2M1_CODE_DTYPES or codes.ndim != 2:
        raise TypeError(
            f"{where}: codes must be a 2-D float4_e2m1fn_x2 or uint8 (m, k/2) tensor, got "
            f"{codes.dtype} {tuple(codes.shape)}"
        )
    require_data(codes, name="codes", where=where)
    m, k = codes.shape[0], codes.shape[1] * 2
    if k == 0 or k % K_GROUP:
        raise ValueError(
            f"{where}: k = 2 * codes.shape[1] = {k} must be a positive multiple of {K_GROUP} "
            f"(GPTQ groups of {K_GROUP}, desc_act=False)"
        )
    require_tensor(scales, name="scales", where=where)
    if scales.dtype != torch.float8_e4m3fn:
        raise TypeError(f"{where}: scales must be float8_e4m3fn, got {scales.dtype}")
    require_data(scales, name="scales", where=where)
    n = _check_nvfp4_weight_side(k, codes.device, weight, group_scales, bias, where=where)
    expected = (k // K_GROUP, padded_rows(m) * 8)
    if tuple(scales.shape) != expected:
        raise ValueError(
            f"{where}: scales must have shape {expected} (k/128, padded_rows(m)*8) for m={m} "
            f"rows, got {tuple(scales.shape)}"
        )
    if scales.device != codes.device:
        raise TypeError(f"{where}: scales are on {scales.device}, codes on {codes.device}")
    if token_scale is not None:
        require_tensor(token_scale, name="token_scale", where=where)
        if token_scale.dtype != torch.float32:
            raise TypeError(f"{where}: token_scale must be float32, got {token_scale.dtype}")
        if tuple(token_scale.shape) != (m,):
            raise ValueError(
                f"{where}: token_scale must have shape ({m},) (one per row of codes), got "
                f"{tuple(token_scale.shape)}"
            )
        if token_scale.device != codes.device:
            raise TypeError(
                f"{where}: token_scale is on {token_scale.device}, codes on {codes.device}"
            )
    if output_dtype not in W4A_OUTPUT_DTYPES:
        raise TypeError(
            f"{where}: output_dtype must be float16, bfloat16 or float32, got {output_dtype!r}"
        )
    return m, k, n


def _check_nvfp4_operands(
    codes: object, scales: object, global_scale: object, weight: object, group_scales: object,
    bias: object, token_scale: object, output_dtype: object, *, where: str,
) -> tuple[int, int, int, Tensor]:  # fmt: skip
    """Every check of the W4A-NVFP4 GEMM's operands; returns ``(m, k, n, global scale)`` with
    the global scale a 0-d FP32 tensor on ``codes``' device. Kinds, shapes and devices first,
    then the value checks (each one host sync)."""
    m, k, n = _check_nvfp4_shapes(
        codes, scales, weight, group_scales, bias, token_scale, output_dtype, where=where
    )
    g = _validated_global_scale(global_scale, codes.device, where=where)
    if token_scale is not None:
        require_finite(token_scale, name="token_scale", where=where)  # (as the carrier's)
    require_e4m3_scales(scales, name="scales", where=where)
    return m, k, n, g


def _weight_planes(weight: Tensor, *, where: str) -> tuple[Tensor, Int4Planes]:
    """The centered weight as int16 ``(k, n)`` and its two E2M1 planes. A staged E4M3 operand
    must hold integers in ``-8..7``: only those split into exact planes (GPTQ words always do).
    """
    c = centered_weight(weight, where=where)
    if weight.dtype == torch.float8_e4m3fn:
        bad = (c != c.round()) | (c < -8) | (c > 7)  # (NaN is not its own rounding)
        if bool(bad.any()):
            raise ValueError(
                f"{where}: a float8_e4m3fn weight must hold integers in -8..7 (code - 8), got "
                f"{int(bad.sum())} other value(s), such as {c[bad][:4].tolist()}"
            )
    c = c.to(torch.int16)
    return c, split_int4_planes(c)


def w4a_nvfp4_linear_prepacked(
    codes: Shaped[Tensor, "m half"],
    scales: Float8e4m3fn[Tensor, "groups padded"],
    global_scale: Float[Tensor, "*one"] | float,
    weight: Shaped[Tensor, "rows n"],
    group_scales: Float[Tensor, "groups n"],
    bias: Float[Tensor, "n"] | None = None,  # noqa: F821
    *,
    token_scale: Float32[Tensor, "m"] | None = None,  # noqa: F821
    output_dtype: torch.dtype,
) -> Float[Tensor, "m n"]:
    """The W4A-NVFP4 GEMM on an NVFP4 activation operand: what the FP4 tensor cores compute.

    Args:
      codes, scales, global_scale: the NVFP4 operand (:func:`floatxq.nvfp4_pack_swizzled`):
        ``(m, k/2)`` packed codes, ``k`` a multiple of 128; swizzled E4M3 block scales; one
        positive finite FP32 value.
      weight: ``int32 (k/8, n)`` symmetric GPTQ words or a ``float8_e4m3fn (k, n)`` staged operand.
      group_scales: ``(k/128, n)`` GPTQ group scales; bias: ``(n,)`` or None (both read as FP32).
      token_scale, output_dtype: ``(m,)`` finite FP32 per-row factors or None; FP16/BF16/FP32.

    Returns ``(m, n)`` in ``output_dtype`` (``(0, n)`` for no rows).
    Raises:
      TypeError: wrong dtypes or ranks or ``output_dtype``, tensors on different devices, meta
        tensors, a global scale that is not a real number.
      ValueError: shapes that do not fit ``k``, ``n`` or ``m``, a global scale that is not one
        positive finite value, a non-finite ``token_scale``, a NaN or negative block scale, a
        staged weight value other than an integer in ``-8..7``.

    Numerics: per group ascending, ``[Σ a·low | Σ a·high]`` as one FP32 matmul (products exact),
    then :func:`w4a_nvfp4_accumulate_group` (``docs/numerics.md``: the W4A reference order).

    Example:
      >>> codes = torch.full((1, 64), 0x22, dtype=torch.uint8)  # every element e2m1 1.0
      >>> scales = torch.zeros(1, 1024, dtype=torch.float8_e4m3fn)
      >>> scales[0, [0, 1, 2, 3, 512, 513, 514, 515]] = 0.5  # row 0's 8 block scales
      >>> w = torch.full((128, 2), 3.0).to(torch.float8_e4m3fn)
      >>> w4a_nvfp4_linear_prepacked(codes, scales, 2.0, w, torch.ones(1, 2),
      ...     output_dtype=torch.float32).tolist()
      [[384.0, 384.0]]
    """
    where = "w4a_nvfp4_linear_prepacked"
    m, k, n, g = _check_nvfp4_operands(
        codes, scales, global_scale, weight, group_scales, bias, token_scale, output_dtype,
        where=where,
    )  # fmt: skip
    _, planes = _weight_planes(weight, where=where)
    if m == 0:
        return torch.empty((0, n), dtype=output_dtype, device=codes.device)
    groups = k // K_GROUP
    a = nvfp4_decode_swizzled(codes, scales, 1.0, k, torch.float32)  # exact: no global scale
    w = torch.cat([planes.low, planes.high], dim=1).to(torch.float32)  # (k, 2n): [low | high]
    both = torch.bmm(
        a.reshape(m, groups, K_GROUP).transpose(0, 1), w.reshape(groups, K_GROUP, 2 * n)
    )
    acc = None
    for i in range(groups):  # ascending, strictly in FP32
        if i < groups - 1:
            acc = w4a_nvfp4_accumulate_group(both[i], group_scales[i], acc)
            continue
        acc = w4a_nvfp4_accumulate_group(
            both[i], group_scales[i], acc, last=True, global_scale=g, token_scale=token_scale,
            bias=bias, output_dtype=output_dtype,
        )  # fmt: skip
    return acc


def w4a_nvfp4_linear(
    x: Float[Tensor, "m k"],
    weight: Shaped[Tensor, "rows n"],
    group_scales: Float[Tensor, "groups n"],
    bias: Float[Tensor, "n"] | None = None,  # noqa: F821
    *,
    global_scale: Float[Tensor, "*one"] | float | None = None,
    recipe: NVFP4RecipeName = NVFP4_DEFAULT_RECIPE,
) -> Float[Tensor, "m n"]:
    """The W4A-NVFP4 linear: ``x`` quantized to the NVFP4 operand, then the INT4-plane GEMM.

    Args:
      x: ``(m, k)`` float16/bfloat16/float32 activations, finite; ``k`` a positive multiple of
        128.
      weight, group_scales, bias: as :func:`w4a_nvfp4_linear_prepacked`.
      global_scale: one positive finite value (read as FP32), or None for the dynamic one:
        :func:`floatxq.nvfp4_global_scale` of ``max|x|`` over the whole tensor on ``x.dtype``'s
        grid (1 for no rows), as :func:`floatxq.pack_activation` derives it.
      recipe: the block-scale recipe (:func:`floatxq.nvfp4_block_scales`; aliases
        accepted).

    Returns:
      ``(m, n)`` in ``x.dtype``.

    Raises:
      TypeError, ValueError: as :func:`w4a_nvfp4_linear_prepacked`; NaN or infinity in ``x``,
        an unknown recipe.

    Numerics: :func:`floatxq.nvfp4_pack_swizzled` with that global scale (the
    bytes :func:`floatxq.pack_activation` makes), then
    :func:`w4a_nvfp4_linear_prepacked` with ``output_dtype = x.dtype``.

    Example:
      >>> w = torch.full((128, 2), 3.0).to(torch.float8_e4m3fn)
      >>> x = torch.ones(1, 128)  # block scale 1/4, code 4: exact
      >>> w4a_nvfp4_linear(x, w, torch.full((1, 2), 0.5), global_scale=1.0).tolist()
      [[192.0, 192.0]]
    """
    where = "w4a_nvfp4_linear"
    require_floating(x, name="x", where=where)
    require_data(x, name="x", where=where)
    if x.ndim != 2 or x.dtype not in W4A_OUTPUT_DTYPES:
        raise TypeError(
            f"{where}: x must be a 2-D float16/bfloat16/float32 (m, k) tensor, got {x.dtype} "
            f"{tuple(x.shape)}"
        )
    rows, k = x.shape
    if k == 0 or k % K_GROUP:
        raise ValueError(
            f"{where}: k={k} must be a positive multiple of {K_GROUP} (GPTQ groups of {K_GROUP}, "
            f"desc_act=False)"
        )
    _check_nvfp4_weight_side(k, x.device, weight, group_scales, bias, where=where)
    recipe = normalize_nvfp4_recipe(recipe)
    require_finite(x, name="x", where=where)
    if global_scale is not None:
        g = _validated_global_scale(global_scale, x.device, where=where)
    elif rows:
        amax = x.to(torch.float32).abs().amax()
        g = nvfp4_global_scale(amax, grid_dtype=x.dtype, recipe=recipe)
    else:
        g = torch.ones((), dtype=torch.float32, device=x.device)
    codes, scales = nvfp4_pack_swizzled(x, g, recipe=recipe)
    return w4a_nvfp4_linear_prepacked(
        codes, scales, g, weight, group_scales, bias, output_dtype=x.dtype
    )
