"""Every route choice in one place: torch, Triton, cuBLAS or Metal, each with its reason.

A route choice is a pure function of facts (device, dtype, shape, capability, what the torch and
Triton installs provide) returning ``(route, reason)``: ``reason`` is ``None`` exactly when the
fastest candidate was taken, else it names each faster route skipped and why. Kernel
availability (``*_unavailable_reason``) stays in :mod:`floatxq.kernels` as facts; the modules in
:mod:`floatxq.nn` and :mod:`floatxq.mlx` gather facts, ask here, and run the answer. A model's
preferences are one frozen :class:`RoutePreference` record (no per-module route setters).

By concept: :mod:`~floatxq.dispatch.fp8` (FP8 linear routes; the FP8 weight encoder: Triton,
MLX or torch), :mod:`~floatxq.dispatch.decode` (``TorchFP4Linear`` and ``GPTQLinear`` decodes),
:mod:`~floatxq.dispatch.w4a` (W4A GEMMs, the activation packers), :mod:`~floatxq.dispatch.mlx`
(MLX's Metal kernel choices), :mod:`~floatxq.dispatch.nvfp4_gptq` (the NVFP4-grid GPTQ solve:
Triton block kernel or torch), :mod:`~floatxq.dispatch.gsq` (GSQ's relaxation: compiled or
eager), :mod:`~floatxq.dispatch.preference` (the preference record).
A test that replaces a fact a choice reads patches the submodule that reads it.
"""

from floatxq.dispatch.decode import (
    FP4_DECODE_ROUTES,
    FP4_W4A4_ROUTES,
    GPTQ_DECODE_ROUTE,
    fp4_decode_route,
    fp4_w4a4_route,
    gptq_route,
    torchao_missing,
    w4a16_route,
)
from floatxq.dispatch.fp8 import (
    MLX_ENCODER_MIN_ELEMENTS,
    ROUTES,
    SCALED_MM_ROUTE,
    FP8RouteChoice,
    FP8RouteFacts,
    FP8RouteTuning,
    fp8_scaled_route,
    mlx_encoder_reason,
    quantize_fp8_weight_auto,
    select_fp8_route,
)
from floatxq.dispatch.gsq import GSQ_ROUTES, gsq_route, refine_fp8_codes_auto
from floatxq.dispatch.mlx import (
    FP8_ENCODE_MIN_ELEMENTS,
    PREFILL_MAX_IN,
    PREFILL_MIN_OUT,
    mlx_fp8_encode_route,
    mlx_packed_route,
)
from floatxq.dispatch.nvfp4_gptq import (
    NVFP4_GPTQ_ROUTES,
    nvfp4_gptq_route,
    nvfp4_gptq_solve_auto,
)
from floatxq.dispatch.preference import W4A_FP8_ROUTES, W4A_NVFP4_ROUTES, RoutePreference
from floatxq.dispatch.w4a import (
    ROWS_BUCKET_EXACT,
    fp8_pack_reason,
    nvfp4_accumulator,
    nvfp4_operand,
    nvfp4_pack_reason,
    pack_activation,
    rows_bucket,
    stream_pack_reason,
    w4a_fp8_carrier_route,
    w4a_fp8_gemm_route,
    w4a_fp8_operand,
    w4a_fp8_route,
    w4a_fp8_weight,
    w4a_fp8_words,
    w4a_nvfp4_native_unavailable_reason,
    w4a_nvfp4_route,
)

__all__ = [
    "FP4_DECODE_ROUTES",
    "FP4_W4A4_ROUTES",
    "FP8_ENCODE_MIN_ELEMENTS",
    "GPTQ_DECODE_ROUTE",
    "GSQ_ROUTES",
    "MLX_ENCODER_MIN_ELEMENTS",
    "NVFP4_GPTQ_ROUTES",
    "PREFILL_MAX_IN",
    "PREFILL_MIN_OUT",
    "ROUTES",
    "ROWS_BUCKET_EXACT",
    "SCALED_MM_ROUTE",
    "W4A_FP8_ROUTES",
    "W4A_NVFP4_ROUTES",
    "FP8RouteChoice",
    "FP8RouteFacts",
    "FP8RouteTuning",
    "RoutePreference",
    "fp4_decode_route",
    "fp4_w4a4_route",
    "fp8_pack_reason",
    "fp8_scaled_route",
    "gptq_route",
    "gsq_route",
    "mlx_encoder_reason",
    "mlx_fp8_encode_route",
    "mlx_packed_route",
    "nvfp4_accumulator",
    "nvfp4_gptq_route",
    "nvfp4_gptq_solve_auto",
    "nvfp4_operand",
    "nvfp4_pack_reason",
    "pack_activation",
    "quantize_fp8_weight_auto",
    "refine_fp8_codes_auto",
    "rows_bucket",
    "select_fp8_route",
    "stream_pack_reason",
    "torchao_missing",
    "w4a16_route",
    "w4a_fp8_carrier_route",
    "w4a_fp8_gemm_route",
    "w4a_fp8_operand",
    "w4a_fp8_route",
    "w4a_fp8_weight",
    "w4a_fp8_words",
    "w4a_nvfp4_native_unavailable_reason",
    "w4a_nvfp4_route",
]
