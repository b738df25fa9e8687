"""Thin ``nn.Module`` wrappers: stored buffers in, pure functions and kernels out.

``TorchFP8Linear`` (FP8 codes, FP32 inverse scales), ``TorchFP4Linear`` (NVFP4 weights),
``GPTQLinear`` (GPTQ-packed 2/4/8-bit weights) and its W4A subclasses ``W4AFP8Linear`` (FP8
activations) and ``W4ANVFP4Linear`` (NVFP4 activations) hold their checkpoint's buffers, moved
as bytes (:mod:`floatxq.nn._bytes`), and run the route :mod:`floatxq.dispatch` chooses.
"""

from floatxq.dispatch import (
    ROUTES,
    FP8RouteChoice,
    FP8RouteFacts,
    FP8RouteTuning,
    select_fp8_route,
)
from floatxq.nn.conv import ConvGeometry
from floatxq.nn.fp4_linear import TorchFP4Linear
from floatxq.nn.fp8_linear import TorchFP8Linear
from floatxq.nn.gptq_linear import GPTQLinear
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
