"""GSQ's CUDA route: :func:`floatxq.refine_fp8_codes` with its elementwise step halves compiled.

A relaxation step is two elementwise halves around one GEMM (the error times the Hessian): the
noise gather, tempered softmax and soft weight (:func:`floatxq.gsq._soft_error`), and the
gradient and Adam update (:func:`floatxq.gsq._adam_update`). Eagerly each is a dozen passes over
the ``(rows, cols, candidates)`` FP64 state; here each is one ``torch.compile`` graph (Inductor
emits fused Triton kernels). Shapes are left to Dynamo's automatic dynamism: the first chunk
compiles for its shape, the next of another shape once more with rows and columns symbolic and
the candidate count static (a symbolic last dimension makes the softmax a slow looped reduction:
measured 2.5× slower than eager on an H200, against 2.2× faster with it static). Everything
else (the candidates, the GEMM, the hard checkpoints) is the pure function's own code.

The compiled halves compute the same expressions in FP64, but a fused kernel may contract a
multiply and an add into one rounding, so the logits can differ from the eager ones in the last
bits; the chosen codes are the argmax of logits that differ by ~1e-16 relative, and a checkpoint
is taken only on a margin of 1e-12 (:data:`floatxq.gsq._STRICT`), so the bytes agree (tested on
fuzzed shapes on the GPU).
"""

import torch

from floatxq._typing import Float, FP8Dtype, Tensor
from floatxq.config.gsq import GSQConfig
from floatxq.gsq import GSQResult, _adam_update, _refine, _soft_error, _StepFunctions

__all__ = ["refine_fp8_codes_compiled"]

_COMPILED: list[_StepFunctions] = []


def compiled_steps() -> _StepFunctions:
    """The two step halves, compiled (once per process; the first calls pay the compile)."""
    if not _COMPILED:
        _COMPILED.append(
            _StepFunctions(
                torch.compile(_soft_error, fullgraph=True),
                torch.compile(_adam_update, fullgraph=True),
            )
        )
    return _COMPILED[0]


def refine_fp8_codes_compiled(
    weight: Float[Tensor, "out in"],
    codes: FP8Dtype[Tensor, "out in"],
    scale_inv: Float[Tensor, "*scale"],
    *,
    hessian: Float[Tensor, "in in"] | None = None,
    config: GSQConfig | None = None,
) -> GSQResult:
    """:func:`floatxq.refine_fp8_codes` with the relaxation's elementwise halves compiled.

    Same arguments, result and errors; the same bytes (see the module docstring).

    Numerics: as :func:`floatxq.refine_fp8_codes` (FP64).
    """
    return _refine(
        weight, codes, scale_inv, hessian, config, compiled_steps(), "refine_fp8_codes_compiled"
    )
