"""Where Triton kernels can run: lazy imports, availability checks and the reasons they fail.

Nothing here imports Triton at module import time, so ``import floatxq`` works on a machine
without Triton or CUDA. Kernels ask :func:`import_triton` for the modules when they are first
launched; dispatchers ask :func:`triton_unavailable_reason` which fast path a tensor may take.
"""

import functools
import os
from types import ModuleType

import torch

__all__ = [
    "import_triton",
    "triton_available",
    "triton_interpret_enabled",
    "triton_unavailable_reason",
]


@functools.cache
def _import_error() -> str | None:
    try:
        import triton.language  # noqa: F401
    except Exception as exc:  # ImportError, or a broken install raising at import
        return f"{type(exc).__name__}: {exc}"
    return None


def triton_available() -> bool:
    """Whether ``import triton`` works in this environment (it is imported once, then cached).

    Numerics: none; an environment check.
    """
    return _import_error() is None


def triton_interpret_enabled() -> bool:
    """Whether ``TRITON_INTERPRET=1`` is set: kernels then run on CPU tensors (slowly, for tests).

    Numerics: none; an environment check.
    """
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def import_triton(*, where: str) -> tuple[ModuleType, ModuleType]:
    """``(triton, triton.language)``, or a ``RuntimeError`` naming what is missing.

    Args:
      where: the caller's name, used in the error message.

    Raises:
      RuntimeError: Triton is not installed or does not import.

    Numerics: none.
    """
    error = _import_error()
    if error is not None:
        raise RuntimeError(
            f"{where}: needs Triton, which does not import here ({error}); install it "
            f"(pip install 'floatxq[triton]', or a CUDA build of PyTorch that ships it) or use "
            f"the pure floatxq function instead"
        )
    import triton
    import triton.language as tl

    return triton, tl


def triton_unavailable_reason(device: torch.device) -> str | None:
    """Why a Triton kernel cannot run on tensors of ``device`` here, or ``None`` when it can.

    Args:
      device: the device of the tensors the kernel would read.

    Returns:
      ``None`` when Triton imports and ``device`` is CUDA (or any device under
      ``TRITON_INTERPRET=1``); otherwise a one-line reason naming the missing piece.

    Numerics: none; an environment check.
    """
    error = _import_error()
    if error is not None:
        return f"Triton is not importable ({error})"
    if triton_interpret_enabled():
        return None
    if device.type != "cuda":
        return (
            f"the tensor is on {device}; Triton kernels need a CUDA tensor (TRITON_INTERPRET=1 "
            f"runs them on CPU for testing)"
        )
    if not torch.cuda.is_available():
        return "torch.cuda is not available"
    return None
