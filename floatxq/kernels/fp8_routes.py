"""How each FP8 linear route computes: one builder per route, free functions over stored operands.

A builder takes a layer's stored operands, already in the form its GEMM wants (FP8 codes, the
weight scales as ``scaled_mm`` multiplies by them, the bias in the output dtype), binds them once
and returns a *runner*: a function of ``x`` ``(rows, in)`` alone, computing
``x @ decode(weight).T + bias`` in ``x``'s dtype. :class:`floatxq.nn.TorchFP8Linear` caches one
runner per route and input dtype, and :func:`floatxq.dispatch.select_fp8_route` decides which runs.

Weight scales: the module stores inverse scales ``scale_inv`` (decode divides by them); cuBLAS
and the fused kernel multiply by direct scales, so the ``scaled_mm`` routes take
``1 / scale_inv`` (:func:`direct_weight_scale`, an IEEE division) in the layout their API wants.
``x`` is quantized per call with the weight formula (``scale_inv = fp8_max / max(amax,
FLT_MIN)``), per tensor, per row or per 1x128 block. The bias enters the GEMM epilogue (added in
FP32 before the single rounding to ``x``'s dtype). The numerics contract, and how the routes
relate to :func:`floatxq.fp8_scaled_linear`, are in ``docs/numerics.md``.
"""

import inspect
from collections.abc import Callable
from typing import Any, Literal

import torch
import torch.nn.functional as F

from floatxq._typing import Float, Float32, FP8Dtype, Tensor
from floatxq.formats import K_GROUP
from floatxq.fp8 import _dequantize_stored, fp32_reciprocal
from floatxq.kernels import quantize_fp8_input
from floatxq.kernels._triton import call_key
from floatxq.kernels.fp8_small_m import _launch as small_m_launch
from floatxq.kernels.fp8_small_m import bound_launch

__all__ = [
    "Runner",
    "blockwise_runner",
    "blockwise_weight_scale",
    "compile_dequant_linear",
    "compiled_cpu_runner",
    "dequant_linear",
    "dequant_runner",
    "direct_weight_scale",
    "rowwise_runner",
    "rowwise_weight_scale",
    "scaled_mm_blockwise_api",
    "scaled_mm_fn",
    "small_m_runner",
    "tensorwise_runner",
]

Runner = Callable[[Tensor], Tensor]
"""A route's call with every operand but ``x`` bound: ``runner(x) -> out``."""

BLOCKWISE_M_ALIGN = 16
"""Rows the blockwise route pads ``x`` to a multiple of (cuBLAS refuses other row counts)."""


def scaled_mm_fn() -> Callable[..., Tensor] | None:
    """``torch._scaled_mm`` where this torch has it, else ``None``.

    Numerics: none; a feature probe.
    """
    return getattr(torch, "_scaled_mm", None)


def scaled_mm_blockwise_api() -> tuple[Callable[..., Tensor], Any, Any] | None:
    """``(F.scaled_mm, BlockWise1x128, BlockWise128x128)`` where this torch has them, else None.

    Numerics: none; a feature probe.
    """
    fn = getattr(F, "scaled_mm", None)
    kinds = getattr(F, "ScalingType", None)
    if fn is None or kinds is None:
        return None
    a = getattr(kinds, "BlockWise1x128", None) or getattr(kinds, "Blockwise_1x128", None)
    b = getattr(kinds, "BlockWise128x128", None) or getattr(kinds, "Blockwise_128x128", None)
    return None if a is None or b is None else (fn, a, b)


# ----------------------------------------------------------------------------------------------
# Weight-side operands (computed once per placement by the module)
# ----------------------------------------------------------------------------------------------


def direct_weight_scale(scale_inv: Float32[Tensor, "*scale"]) -> Float32[Tensor, "*scale"]:
    """``1 / scale_inv``: the direct scales ``scaled_mm`` and the fused kernel multiply by.

    Numerics: :func:`floatxq.fp8.fp32_reciprocal` (one IEEE FP32 division), same shape.
    """
    return fp32_reciprocal(scale_inv)


def rowwise_weight_scale(direct: Float32[Tensor, "n"]) -> Float32[Tensor, "1 n"]:  # noqa: F821
    """Row scales as rowwise ``scaled_mm`` takes them for ``weight.t()``: ``(1, n)`` contiguous.

    Numerics: a copy.
    """
    return direct.reshape(1, -1).contiguous()


def blockwise_weight_scale(
    direct: Float32[Tensor, "n_blocks k_blocks"],
) -> Float32[Tensor, "k_padded n_blocks"]:
    """Block scales as ``F.scaled_mm``'s 128x128 recipe takes them for ``weight.t()``.

    Returns:
      a ``(round_up(k/128, 4), n/128)`` view with strides ``(1, round_up(k/128, 4))`` whose
      entry ``[kb, nb]`` is ``direct[nb, kb]``; the padding rows hold 1.

    Numerics: a copy; padding entries are 1.
    """
    n_blocks, k_blocks = direct.shape
    padded = -(-k_blocks // 4) * 4
    grid = torch.ones((n_blocks, padded), dtype=torch.float32, device=direct.device)
    grid[:, :k_blocks] = direct
    return grid.t()


# ----------------------------------------------------------------------------------------------
# Route builders
# ----------------------------------------------------------------------------------------------


def small_m_runner(
    weight: FP8Dtype[Tensor, "n k"],
    weight_scale: Float32[Tensor, "*scale"],
    bias: Float[Tensor, "n"] | None,  # noqa: F821
    *,
    recipe: Literal["tensorwise", "rowwise", "blockwise"],
) -> Runner:
    """``fp8_small_m``: the fused Triton kernel (``x`` quantized inside the GEMM, one launch).

    Args:
      weight: ``(n, k)`` FP8 codes.
      weight_scale: direct scales (:func:`direct_weight_scale`) in the recipe's layout.
      bias: ``(n,)`` in the output dtype, or ``None``.
      recipe: the ``scaled_mm`` recipe the kernel reproduces.

    Numerics: ``x``'s codes equal the matching ``scaled_mm`` route's; FP32 accumulation.
    """
    bound: dict[Any, Runner] = {}  # launches bound per input like x (fp8_small_m.bound_launch)

    def run(x: Tensor) -> Tensor:
        held = bound.get(key := call_key(x))
        if held is not None:
            return held(x)
        out = small_m_launch(x, weight, weight_scale, bias, recipe)
        launch = bound_launch(x, weight, weight_scale, bias, recipe)
        if launch is not None:
            bound[key] = launch
        return out

    return run


def tensorwise_runner(
    weight: FP8Dtype[Tensor, "n k"],
    weight_scale: Float32[Tensor, ""],
    bias: Float[Tensor, "n"] | None,  # noqa: F821
    *,
    format: str,
    out_dtype: torch.dtype,
) -> Runner:
    """``scaled_mm_tensorwise``: ``x`` quantized per tensor to the weight's format, then cuBLAS.

    Numerics: ``_scaled_mm(xq, weight.t(), 1/sx, weight_scale, bias)``, FP32 accumulation, one
    rounding to ``out_dtype``.
    """
    return _scaled_mm_runner(
        weight, weight_scale, bias, format=format, method="tensor", out_dtype=out_dtype
    )


def rowwise_runner(
    weight: FP8Dtype[Tensor, "n k"],
    weight_scale: Float32[Tensor, "1 n"],
    bias: Float[Tensor, "n"] | None,  # noqa: F821
    *,
    out_dtype: torch.dtype,
) -> Runner:
    """``scaled_mm_rowwise``: ``x`` quantized per row to E4M3, then cuBLAS with row scales.

    Args:
      weight_scale: :func:`rowwise_weight_scale` of the direct scales.

    Numerics: ``_scaled_mm(xq, weight.t(), (m, 1) scales, (1, n) scales, bias)``, FP32
    accumulation, one rounding to ``out_dtype``.
    """
    return _scaled_mm_runner(
        weight, weight_scale, bias, format="float8_e4m3fn", method="row", out_dtype=out_dtype
    )


def _scaled_mm_runner(
    weight: Tensor,
    weight_scale: Tensor,
    bias: Tensor | None,
    *,
    format: str,
    method: Literal["tensor", "row"],
    out_dtype: torch.dtype,
) -> Runner:
    """``x`` quantized per tensor (a ``()`` scale) or per row (``(m, 1)``), then ``_scaled_mm``."""
    mm, device, weight_t = scaled_mm_fn(), weight.device, weight.t()

    def run(x: Tensor) -> Tensor:
        shape = () if method == "tensor" else (x.shape[0], 1)
        scale_a = torch.empty(shape, dtype=torch.float32, device=device)
        xq = quantize_fp8_input(x, format=format, method=method, block=None, scale_out=scale_a)
        return mm(xq, weight_t, scale_a, weight_scale, bias, None, out_dtype)  # type: ignore[misc]

    return run


def blockwise_runner(
    weight: FP8Dtype[Tensor, "n k"],
    weight_scale: Float32[Tensor, "k_padded n_blocks"],
    bias: Float[Tensor, "n"] | None,  # noqa: F821
    *,
    out_dtype: torch.dtype,
) -> Runner:
    """``scaled_mm_blockwise``: ``x`` quantized per 1x128 block to E4M3, then cuBLAS's
    1x128 x 128x128 recipe through ``F.scaled_mm``.

    Args:
      weight_scale: :func:`blockwise_weight_scale` of the direct ``(n/128, k/128)`` scales.

    Numerics: FP32 accumulation, one rounding to ``out_dtype``; ``x`` is padded with zero rows
    (codes 0, scale 1) to a multiple of 16 rows and those outputs dropped.
    """
    fn, recipe_a, recipe_b = scaled_mm_blockwise_api()  # type: ignore[misc]
    device, weight_t = weight.device, weight.t()
    groups = weight.shape[1] // K_GROUP

    def run(x: Tensor) -> Tensor:
        m = x.shape[0]
        # cuBLAS's blockwise kernels refuse row counts that are not a multiple of 16 (M = 1 and
        # 17 fail with torch 2.11 on Hopper, 16 and 256 run): pad with zero rows and drop their
        # outputs.
        padded_m = -(-m // BLOCKWISE_M_ALIGN) * BLOCKWISE_M_ALIGN
        # scale_a: (M, K/128) with strides (1, M), the column-major layout the recipe reads.
        scale_a = torch.empty((groups, padded_m), dtype=torch.float32, device=device).t()
        xq = quantize_fp8_input(
            x, format="float8_e4m3fn", method="block", block=(1, K_GROUP),
            scale_out=scale_a, rows_out=padded_m,
        )  # fmt: skip
        out = fn(
            xq, weight_t, scale_a, recipe_a, weight_scale, recipe_b, bias=bias,
            output_dtype=out_dtype,
        )  # fmt: skip
        return out if padded_m == m else out[:m]

    return run


def dequant_linear(
    x: Float[Tensor, "m k"],
    weight: FP8Dtype[Tensor, "n k"],
    scale_inv: Float[Tensor, "*scale"],
    bias: Float[Tensor, "n"] | None,  # noqa: F821
) -> Float[Tensor, "m n"]:
    """``x @ decode(weight).T + bias``, the weight decoded in ``x.dtype`` for this call only.

    Numerics: decode ``float32(code) / scale_inv`` rounded once to ``x.dtype``, then
    ``F.linear`` in ``x.dtype``.
    """
    # the module checked its buffers when it was built or loaded: no per-call host sync here
    return F.linear(x, _dequantize_stored(weight, scale_inv, x.dtype), bias)


def dequant_runner(
    weight: FP8Dtype[Tensor, "n k"],
    scale_inv: Float32[Tensor, "*scale"],
    bias: Float[Tensor, "n"] | None,  # noqa: F821
) -> Runner:
    """``dequant_matmul``: :func:`dequant_linear` with the stored operands bound (no dense
    weight is kept between calls).

    Numerics: as :func:`dequant_linear`.
    """

    def run(x: Tensor) -> Tensor:
        return dequant_linear(x, weight, scale_inv, bias)

    return run


def compile_dequant_linear(*, backend: str) -> Callable[..., Tensor]:
    """:func:`dequant_linear` under ``torch.compile`` (compiled lazily, on its first call).

    Numerics: as :func:`dequant_linear` (the FP32 summation order may differ).
    """
    return torch.compile(inspect.unwrap(dequant_linear), backend=backend)


def compiled_cpu_runner(
    weight: FP8Dtype[Tensor, "n k"],
    scale_inv: Float32[Tensor, "*scale"],
    bias: Float[Tensor, "n"] | None,  # noqa: F821
    *,
    compiled: Callable[..., Tensor],
) -> Runner:
    """``compiled_cpu``: the compiled :func:`dequant_linear` with the stored operands bound.

    Numerics: as :func:`compile_dequant_linear`.
    """

    def run(x: Tensor) -> Tensor:
        return compiled(x, weight, scale_inv, bias)

    return run
