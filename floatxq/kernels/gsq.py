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

_COMPILED: dict[int, _StepFunctions] = {}

_RECOMPILE_LIMIT = getattr(
    torch._dynamo.exc, "FailOnRecompileLimitHit", torch._dynamo.exc.Unsupported
)


class _Guarded:
    """A compiled step half that turns eager for good once Dynamo refuses another recompile
    (its limit is per code object: a process that refines many shapes, dtypes and devices
    reaches it). The refusal comes before the graph runs, so nothing is half done; the eager
    half computes the same expressions (see the module docstring on the bytes)."""

    def __init__(self, fn) -> None:
        self.fn = fn
        self.compiled = torch.compile(fn, fullgraph=True)
        self.eager = False

    def __call__(self, *args, **kwargs):
        if not self.eager:
            try:
                return self.compiled(*args, **kwargs)
            except _RECOMPILE_LIMIT:
                self.eager = True
        return self.fn(*args, **kwargs)


def compiled_steps(candidates: int) -> _StepFunctions:
    """The two step halves compiled for ``candidates`` codes per weight (once per process and
    candidate count; the first calls pay the compile)."""
    if candidates not in _COMPILED:
        _COMPILED[candidates] = _StepFunctions(_Guarded(_soft_error), _Guarded(_adam_update))
    return _COMPILED[candidates]


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
    candidates = (config or GSQConfig()).candidates
    return _refine(
        weight, codes, scale_inv, hessian, config, compiled_steps(candidates),
        "refine_fp8_codes_compiled",
    )  # fmt: skip
