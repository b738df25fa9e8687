"""GSQ's route: the relaxation's elementwise halves compiled on CUDA, eager elsewhere.

Both routes give the same bytes (:mod:`floatxq.kernels.gsq` says why and the GPU tests check
it on fuzzed shapes), so the choice is speed alone: eagerly a step is ~20 passes over the FP64
``(rows, cols, candidates)`` state, compiled it is two fused kernels around the GEMM.
"""

import torch

from floatxq._typing import Float, FP8Dtype, Tensor
from floatxq.config.gsq import GSQConfig
from floatxq.gsq import GSQResult, refine_fp8_codes
from floatxq.kernels._triton import triton_unavailable_reason
from floatxq.kernels.gsq import refine_fp8_codes_compiled

__all__ = ["GSQ_ROUTES", "gsq_route", "refine_fp8_codes_auto"]

GSQ_ROUTES = ("compiled", "eager")
"""Routes of :func:`floatxq.refine_fp8_codes`: its step halves through ``torch.compile``, or the
pure function as written."""


def gsq_route(device: torch.device) -> tuple[str, str | None]:
    """``(route, reason)`` of a GSQ refinement of a weight on ``device``.

    Returns:
      ``("compiled", None)`` on CUDA where Triton imports (Inductor's code generator); else
      ``("eager", why)``. Off CUDA it is always eager: compiling for the CPU needs a C++
      toolchain and saves little against the FP64 GEMM.

    Example:
      >>> gsq_route(torch.device("cpu"))[0]
      'eager'
    """
    if device.type != "cuda":
        return "eager", (
            f"the weight is on {device}; the compiled relaxation steps run on CUDA (the pure "
            f"function is the CPU route)"
        )
    why = triton_unavailable_reason(device)
    if why is not None:
        return "eager", why
    return "compiled", None


def refine_fp8_codes_auto(
    weight: Float[Tensor, "out in"],
    codes: FP8Dtype[Tensor, "out in"],
    scale_inv: Float[Tensor, "*scale"],
    *,
    hessian: Float[Tensor, "in in"] | None = None,
    config: GSQConfig | None = None,
) -> GSQResult:
    """:func:`floatxq.refine_fp8_codes` on the route :func:`gsq_route` picks (same bytes).

    Numerics: as :func:`floatxq.refine_fp8_codes`.
    """
    route, _ = gsq_route(weight.device)
    if route == "compiled" and hessian is not None:
        return refine_fp8_codes_compiled(weight, codes, scale_inv, hessian=hessian, config=config)
    return refine_fp8_codes(weight, codes, scale_inv, hessian=hessian, config=config)
