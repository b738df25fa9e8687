"""GPTQ as pure functions: the Hessian fold, the column solve, round-to-nearest, INT4 packing.

- :mod:`~floatxq.gptq.hessian`: the Hessian fold ``H = 2/N · Σ xᵀx``;
- :mod:`~floatxq.gptq.quantizer`: the elementwise quantizer both solvers round with (private);
- :mod:`~floatxq.gptq.solve`: the damped inverse, the column solve and round-to-nearest;
- :mod:`~floatxq.gptq.int4`: ``gptq`` / ``gptq_v2`` packing, unpacking, decoding, conversion;
- :mod:`~floatxq.gptq.planes`: centered INT4 and its W4A staging (E2M1 planes, E4M3).
"""

from floatxq.gptq.hessian import HessianState, hessian_finalize, hessian_init, hessian_update
from floatxq.gptq.int4 import GPTQPacked, GPTQUnpacked, dequantize_gptq, pack_gptq, unpack_gptq
from floatxq.gptq.solve import GPTQSolution, GPTQSolveOptions, gptq_solve, rtn_quantize

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
