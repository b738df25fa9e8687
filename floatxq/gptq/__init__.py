"""GPTQ as pure functions: the Hessian fold, the column solve, round-to-nearest, INT4 packing.

- :mod:`~floatxq.gptq.hessian`: the Hessian fold ``H = 2/N · Σ xᵀx``;
- :mod:`~floatxq.gptq.quantizer`: the elementwise quantizer both solvers round with (private);
- :mod:`~floatxq.gptq.solve`: the damped inverse, the column solve and round-to-nearest;
- :mod:`~floatxq.gptq.int4`: ``gptq`` / ``gptq_v2`` packing, unpacking, decoding, conversion;
- :mod:`~floatxq.gptq.planes`: centered INT4 and its W4A staging (E2M1 planes, E4M3);
- :mod:`~floatxq.gptq.nvfp4_grid`: GPTQ onto the NVFP4 grid (a recipe's block scales held fixed).
"""

from floatxq.gptq.hessian import (
    HessianState,
    hessian_finalize,
    hessian_init,
    hessian_merge,
    hessian_update,
)
from floatxq.gptq.int4 import GPTQPacked, GPTQUnpacked, dequantize_gptq, pack_gptq, unpack_gptq
from floatxq.gptq.nvfp4_grid import NVFP4GPTQSolution, nvfp4_gptq_solve
from floatxq.gptq.solve import GPTQSolution, GPTQSolveOptions, gptq_solve, rtn_quantize

__all__ = [
    "GPTQPacked",
    "GPTQSolution",
    "GPTQSolveOptions",
    "GPTQUnpacked",
    "HessianState",
    "NVFP4GPTQSolution",
    "dequantize_gptq",
    "gptq_solve",
    "hessian_finalize",
    "hessian_init",
    "hessian_merge",
    "hessian_update",
    "nvfp4_gptq_solve",
    "pack_gptq",
    "rtn_quantize",
    "unpack_gptq",
]
