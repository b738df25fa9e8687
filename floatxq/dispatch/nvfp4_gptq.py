"""The NVFP4-grid GPTQ solve's route: the Triton block kernel on CUDA, the pure function elsewhere.

Both routes return the same bytes (:func:`floatxq.kernels.nvfp4_gptq.nvfp4_gptq_solve_fast`
equals :func:`floatxq.nvfp4_gptq_solve` bit for bit), so the choice is speed alone.
"""

import torch

from floatxq._typing import Float, Float32, Tensor
from floatxq.formats import NVFP4RecipeName
from floatxq.gptq.nvfp4_grid import NVFP4GPTQSolution, nvfp4_gptq_solve
from floatxq.kernels._triton import triton_unavailable_reason
from floatxq.kernels.nvfp4_gptq import NVFP4_GPTQ_MAX_BLOCK, nvfp4_gptq_solve_fast

__all__ = ["NVFP4_GPTQ_ROUTES", "nvfp4_gptq_route", "nvfp4_gptq_solve_auto"]

NVFP4_GPTQ_ROUTES = ("triton", "torch")
"""Routes of the NVFP4-grid GPTQ solve: the Triton block kernel, the pure torch function."""


def nvfp4_gptq_route(device: torch.device, *, blocksize: int = 128) -> tuple[str, str | None]:
    """``(route, reason)`` of an NVFP4-grid GPTQ solve of a weight on ``device``.

    Args:
      device: the weight's device.
      blocksize: the solve's columns per block (the kernel takes at most 128).

    Returns:
      ``("triton", None)`` on CUDA where Triton imports and ``blocksize <= 128``; else
      ``("torch", why)``: the pure :func:`floatxq.nvfp4_gptq_solve` (a CUDA graph per block on
      CUDA). Off CUDA it is always ``"torch"``, ``TRITON_INTERPRET=1`` or not: the interpreter
      is for tests, far slower than torch.

    Example:
      >>> nvfp4_gptq_route(torch.device("cpu"))[0]
      'torch'
    """
    if device.type != "cuda":
        return "torch", (
            f"the weight is on {device}; the Triton block solve runs on CUDA (the pure function "
            f"is the CPU route)"
        )
    why = triton_unavailable_reason(device)
    if why is not None:
        return "torch", why
    if blocksize > NVFP4_GPTQ_MAX_BLOCK:
        return "torch", (
            f"blocksize {blocksize} > {NVFP4_GPTQ_MAX_BLOCK}: the Triton block solve holds at most "
            f"{NVFP4_GPTQ_MAX_BLOCK} columns"
        )
    return "triton", None


def nvfp4_gptq_solve_auto(
    weight: Float[Tensor, "n k"],
    hessian: Float[Tensor, "k k"],
    global_scale: Float32[Tensor, ""] | float,
    *,
    recipe: NVFP4RecipeName = "nvidia",
    damp_percent: float = 0.01,
    blocksize: int = 128,
) -> NVFP4GPTQSolution:
    """:func:`floatxq.nvfp4_gptq_solve` on the route :func:`nvfp4_gptq_route` picks.

    Raises: as :func:`floatxq.nvfp4_gptq_solve`.

    Numerics: bit for bit :func:`floatxq.nvfp4_gptq_solve` on either route.

    Example:
      >>> w = torch.randn(8, 32, generator=torch.Generator().manual_seed(0))
      >>> nvfp4_gptq_solve_auto(w, torch.eye(32), 0.01).packed.shape
      torch.Size([8, 16])
    """
    device = weight.device if isinstance(weight, torch.Tensor) else torch.device("cpu")
    route, _ = nvfp4_gptq_route(device, blocksize=blocksize)
    solve = nvfp4_gptq_solve_fast if route == "triton" else nvfp4_gptq_solve
    return solve(
        weight, hessian, global_scale, recipe=recipe, damp_percent=damp_percent,
        blocksize=blocksize,
    )  # fmt: skip
