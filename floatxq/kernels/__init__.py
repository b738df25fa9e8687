"""Triton twins of floatxq's pure functions.

Each kernel equals its pure reference bit for bit. Importing this package needs neither Triton
nor CUDA: the Triton sources (``_*_jit`` modules) are imported on a kernel's first launch, and a
kernel called without Triton raises a ``RuntimeError`` naming what is missing. How a kernel is
launched (tiles, warps, splits) is a frozen tuning record with measured defaults, passed as the
``tuning`` keyword. Which route a call takes (kernel, torch, cuBLAS or Metal) is chosen in
:mod:`floatxq.dispatch`; this package only says whether a kernel can run (``*_unavailable_reason``).
"""

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
from floatxq.kernels.nvfp4_gptq import NVFP4GPTQTuning, nvfp4_gptq_solve_fast
from floatxq.kernels.w4a16 import (
    W4A16Tuning,
    dequantize_gptq_kernel,
    w4a16_linear_kernel,
)
from floatxq.kernels.w4a_fp8 import (
    W4AFP8Tuning,
    fp8_linear,
    fp8_linear_prepacked,
    fp8_pack,
    w4a_fp8_unavailable_reason,
)

__all__ = [
    "FP8ScaledLinearTrace",
    "FP8SmallMTiles",
    "FP8SmallMTuning",
    "FP8WeightTuning",
    "NVFP4DecodeTuning",
    "NVFP4GPTQTuning",
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
    "nvfp4_gptq_solve_fast",
    "nvfp4_linear",
    "nvfp4_linear_prepacked",
    "nvfp4_pack_and_swizzle",
    "nvfp4_unavailable_reason",
    "quantize_fp8_input",
    "quantize_fp8_weight_kernel",
    "triton_available",
    "triton_interpret_enabled",
    "triton_unavailable_reason",
    "w4a16_linear_kernel",
    "w4a_fp8_unavailable_reason",
]
