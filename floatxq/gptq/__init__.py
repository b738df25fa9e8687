"""GPTQ as pure functions: the Hessian fold, the column solve, round-to-nearest, INT4 packing.

- :mod:`~floatxq.gptq.solve`: Hessian statistics, the damped inverse and the column solve;
- :mod:`~floatxq.gptq.int4`: ``gptq`` / ``gptq_v2`` packing, decoding, centering, plane staging.
"""

from floatxq.gptq.int4 import GPTQPacked, GPTQUnpacked, dequantize_gptq, pack_gptq, unpack_gptq
from floatxq.gptq.solve import (
    GPTQSolution,
    GPTQSolveOptions,
    HessianState,
    gptq_solve,
    hessian_finalize,
    hessian_init,
    hessian_update,
    rtn_quantize,
)

__all__ = [
    "GPTQPacked",
    "GPTQSolution",
    "GPTQSolveOptions",
    "GPTQUnpacked",
    "HessianState",
    "dequantize_gptq",
    "gptq_solve",
    "hessian_finalize",
    "hessian_init",
    "hessian_update",
    "pack_gptq",
    "rtn_quantize",
    "unpack_gptq",
]
