"""Thin ``nn.Module`` wrappers: stored buffers in, pure functions and kernels out.

``TorchFP8Linear`` holds FP8 codes, FP32 inverse scales and an FP16 bias, and multiplies them with
``torch._scaled_mm`` where the GPU, layout and shapes allow it, else by decoding the weight for
the call (see :mod:`floatxq.nn.fp8_linear`).
"""

from floatxq.nn.fp8_linear import ROUTES, ConvGeometry, TorchFP8Linear

__all__ = ["ROUTES", "ConvGeometry", "TorchFP8Linear"]
