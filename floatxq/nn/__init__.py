"""Thin ``nn.Module`` wrappers: stored buffers in, pure functions and kernels out.

``TorchFP8Linear`` holds FP8 codes, FP32 inverse scales and an FP16 bias, and multiplies them by
the fastest route :func:`select_fp8_route` allows for each call (``torch._scaled_mm`` or the fused
small-M kernel on CUDA, else decoding the weight for the call). The route policy is a pure
function of a :class:`FP8RouteFacts` record (:mod:`floatxq.nn.route_policy`); the routes
themselves are free functions (:mod:`floatxq.nn.fp8_routes`); convolution support lives in
:mod:`floatxq.nn.conv`. ``TorchFP4Linear`` holds NVFP4 weights (packed E2M1 codes, E4M3 block
scales, an FP32 global scale) and decodes them per call. ``GPTQLinear`` holds GPTQ-packed 2, 4 or
8-bit weights (GPT-QModel's ``qweight``/``qzeros``/``scales``/``g_idx``) and decodes them per call.
``W4AFP8Linear`` holds the same buffers for symmetric 4-bit g128 weights and multiplies them by
per-token FP8 activations (the W4A-FP8 GEMM; a non-persistent E4M3 staging of the weight).
``W4ANVFP4Linear`` holds them too and multiplies them by NVFP4 activations (the W4A-NVFP4 GEMM:
FP4 tensor cores on SM 12.1+, an exact emulation elsewhere).
"""

from floatxq.nn.conv import ConvGeometry
from floatxq.nn.fp4_linear import TorchFP4Linear
from floatxq.nn.fp8_linear import TorchFP8Linear
from floatxq.nn.gptq_linear import GPTQLinear
from floatxq.nn.route_policy import (
    ROUTES,
    FP8RouteChoice,
    FP8RouteFacts,
    FP8RouteTuning,
    select_fp8_route,
)
from floatxq.nn.w4a_fp8_linear import W4AFP8Linear
from floatxq.nn.w4a_nvfp4_linear import W4ANVFP4Linear

__all__ = [
    "ROUTES",
    "ConvGeometry",
    "FP8RouteChoice",
    "FP8RouteFacts",
    "FP8RouteTuning",
    "GPTQLinear",
    "TorchFP4Linear",
    "TorchFP8Linear",
    "W4AFP8Linear",
    "W4ANVFP4Linear",
    "select_fp8_route",
]
