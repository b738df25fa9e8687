"""Triton twins of floatxq's pure functions, and the dispatchers that choose between them.

Each kernel equals its pure reference bit for bit. Importing this package needs neither Triton
nor CUDA: the Triton sources (``_*_jit`` modules) are imported on a kernel's first launch, and a
kernel called without Triton raises a ``RuntimeError`` naming what is missing. How a kernel is
launched (tiles, warps, splits) is a frozen tuning record with measured defaults, passed as the
``tuning`` keyword. Dispatchers (``*_auto``) take the kernel where it can
run and otherwise the pure function, and say which they took and why.
"""

import platform

import torch

from floatxq._typing import Float, Tensor
from floatxq.formats import FP8ScaleMethod
from floatxq.fp8 import FP8Weight, quantize_fp8_weight
from floatxq.kernels._triton import (
    triton_available,
    triton_interpret_enabled,
    triton_unavailable_reason,
)
from floatxq.kernels.fp8_small_m import (
    FP8ScaledLinearTrace,
    FP8SmallMTiles,
    FP8SmallMTuning,
    fp8_scaled_linear_kernel,
    fp8_scaled_linear_kernel_with_codes,
)
from floatxq.kernels.fp8_weight import (
    FP8WeightTuning,
    quantize_fp8_input,
    quantize_fp8_weight_kernel,
)
from floatxq.kernels.nvfp4 import (
    NVFP4Tuning,
    nvfp4_linear,
    nvfp4_linear_prepacked,
    nvfp4_pack_and_swizzle,
    nvfp4_unavailable_reason,
)
from floatxq.kernels.nvfp4_decoding import (
    NVFP4DecodeTuning,
    nvfp4_accumulate_group,
    nvfp4_decode,
    nvfp4_dequantize_kernel,
)
from floatxq.kernels.w4a16 import (
    W4A16Tuning,
    dequantize_gptq_kernel,
    w4a16_linear_kernel,
    w4a16_route,
)
from floatxq.kernels.w4a_fp8 import (
    W4AFP8Tuning,
    fp8_linear,
    fp8_linear_prepacked,
    fp8_pack,
    w4a_fp8_operand,
    w4a_fp8_unavailable_reason,
)

__all__ = [
    "MLX_ENCODER_MIN_ELEMENTS",
    "FP8ScaledLinearTrace",
    "FP8SmallMTiles",
    "FP8SmallMTuning",
    "FP8WeightTuning",
    "NVFP4DecodeTuning",
    "NVFP4Tuning",
    "W4A16Tuning",
    "W4AFP8Tuning",
    "dequantize_gptq_kernel",
    "fp8_linear",
    "fp8_linear_prepacked",
    "fp8_pack",
    "fp8_scaled_linear_kernel",
    "fp8_scaled_linear_kernel_with_codes",
    "nvfp4_accumulate_group",
    "nvfp4_decode",
    "nvfp4_dequantize_kernel",
    "nvfp4_linear",
    "nvfp4_linear_prepacked",
    "nvfp4_pack_and_swizzle",
    "nvfp4_unavailable_reason",
    "quantize_fp8_input",
    "quantize_fp8_weight_auto",
    "quantize_fp8_weight_kernel",
    "triton_available",
    "triton_interpret_enabled",
    "triton_unavailable_reason",
    "w4a16_linear_kernel",
    "w4a16_route",
    "w4a_fp8_operand",
    "w4a_fp8_unavailable_reason",
]


MLX_ENCODER_MIN_ELEMENTS = 60 * 2**20
"""CPU weights at least this large are encoded by MLX's Metal encoder on Apple Silicon."""


def _apple_silicon() -> bool:
    return platform.system() == "Darwin" and platform.machine() == "arm64"


def _mlx_encoder_reason(weight: torch.Tensor) -> str | None:
    """Why the MLX (Metal) encoder does not take ``weight`` (``None``: it does)."""
    if weight.device.type not in ("cpu", "mps") or not _apple_silicon():
        return "not a CPU/MPS weight on Apple Silicon"
    if weight.numel() < MLX_ENCODER_MIN_ELEMENTS:
        return f"fewer than {MLX_ENCODER_MIN_ELEMENTS} elements"
    try:
        from floatxq.mlx import kernels as mlx_kernels
    except ImportError:
        return "MLX is not installed"
    if not mlx_kernels.metal_available():
        return "MLX has no Metal backend"
    return None


def quantize_fp8_weight_auto(
    weight: Float[Tensor, "out in"],
    *,
    format: str | torch.dtype = "float8_e4m3fn",
    weight_scale_method: FP8ScaleMethod | None = "row",
    weight_block_size: tuple[int, int] | list[int] | None = None,
) -> tuple[FP8Weight, str, str | None]:
    """:func:`floatxq.quantize_fp8_weight` through the Triton kernel where it runs, else in torch.

    Args:
      weight, format, weight_scale_method, weight_block_size: as ``quantize_fp8_weight``.

    Returns:
      ``(FP8Weight, route, reason)``: ``route`` is ``"triton"`` (CUDA tensor, Triton imports),
      ``"mlx"`` (a CPU or MPS weight of at least ``MLX_ENCODER_MIN_ELEMENTS`` elements on Apple
      Silicon with MLX's Metal backend: :func:`floatxq.mlx.fp8.quantize_fp8_weight_torch_via_mlx`,
      results on the CPU) or ``"torch"``; ``reason`` says why the kernel was not taken (``None``
      when it was). All routes give the same bytes.

    Raises:
      ValueError, TypeError: as :func:`floatxq.quantize_fp8_weight`.

    Numerics: identical bytes on either route (the kernel's tests prove it on fuzzed shapes).

    Example:
      >>> q, route, reason = quantize_fp8_weight_auto(torch.ones(2, 2))
      >>> route, q.scale_inv.tolist()
      ('torch', [448.0, 448.0])
    """
    kwargs = dict(
        format=format,
        weight_scale_method=weight_scale_method,
        weight_block_size=weight_block_size,
    )
    if not isinstance(weight, torch.Tensor):
        return quantize_fp8_weight(weight, **kwargs), "torch", "weight is not a tensor"
    if weight.device.type != "cuda":
        if _mlx_encoder_reason(weight) is None:
            from floatxq.mlx.fp8 import quantize_fp8_weight_torch_via_mlx

            return quantize_fp8_weight_torch_via_mlx(weight, **kwargs), "mlx", None
        reason = f"weight is on {weight.device}; the Triton kernel runs on CUDA tensors"
    else:
        reason = triton_unavailable_reason(weight.device)
    if reason is None:
        return quantize_fp8_weight_kernel(weight, **kwargs), "triton", None
    return quantize_fp8_weight(weight, **kwargs), "torch", reason
