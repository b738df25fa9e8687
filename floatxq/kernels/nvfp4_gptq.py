"""GPTQ onto the NVFP4 grid with the column loop of each block in one Triton launch.

:func:`nvfp4_gptq_solve_fast` returns :func:`floatxq.nvfp4_gptq_solve`'s record, bit for bit.
Everything around the column loop is the pure function's own code (:mod:`floatxq.gptq.
nvfp4_grid`'s ``_prepare`` and ``_finish``: checks, the recipe's scales, the factor, the losses,
the comparison with round to nearest, packing), and so is the trailing update of each block (the
same FP64 GEMM on the same operands). Only the block's column loop changes: the pure function
runs about six tiny torch kernels per column (replayed as a CUDA graph); here one launch solves
the whole block, each program taking ``block_rows`` weight rows through every column with its
tile in registers (rows are independent within a block; see
:mod:`floatxq.kernels._nvfp4_gptq_jit` for the rounding order that keeps the bytes).

Import needs neither Triton nor CUDA; the Triton source loads on the first launch. Launch shapes
come from a frozen :class:`NVFP4GPTQTuning`.
"""

import dataclasses
import functools

import torch

from floatxq._typing import Float, Float32, Tensor
from floatxq.formats import NVFP4RecipeName
from floatxq.gptq.nvfp4_grid import NVFP4GPTQSolution, _finish, _prepare
from floatxq.kernels._triton import (
    CachedLauncher,
    import_kernel_sources,
    launch_device,
    require_kernel_device,
    triton_interpret_enabled,
)
from floatxq.kernels.nvfp4 import _specialized

__all__ = [
    "DEFAULT_NVFP4_GPTQ_TUNING",
    "NVFP4_GPTQ_MAX_BLOCK",
    "NVFP4GPTQTuning",
    "nvfp4_gptq_solve_fast",
]

NVFP4_GPTQ_MAX_BLOCK = 128
"""The widest block the kernel solves (its FP64 tile is ``block_rows × 128`` registers)."""


def _power_of_two(value: object) -> bool:
    return (
        isinstance(value, int)
        and not isinstance(value, bool)
        and value > 0
        and not (value & (value - 1))
    )


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class NVFP4GPTQTuning:
    """Launch shape of the block kernel: ``block_rows`` weight rows per program, ``warps``
    warps per program (both powers of two; not yet measured: ``benchmarks/nvfp4_gptq_solve.py``
    sweeps them).

    Raises:
      ValueError: a value that is not a power of two, ``block_rows`` above 64 or ``warps``
        above 16.

    Numerics: none; every tuning gives the same bytes.

    Example:
      >>> NVFP4GPTQTuning(block_rows=16).block_rows
      16
    """

    block_rows: int = 8
    warps: int = 4

    def __post_init__(self) -> None:
        for name, most in (("block_rows", 64), ("warps", 16)):
            value = getattr(self, name)
            if not _power_of_two(value) or value > most:
                raise ValueError(
                    f"NVFP4GPTQTuning: {name} must be a power of two from 1 to {most}, got "
                    f"{value!r}"
                )


DEFAULT_NVFP4_GPTQ_TUNING = NVFP4GPTQTuning()


@functools.cache
def _launcher(interpret: bool) -> CachedLauncher:
    sources = import_kernel_sources(
        "floatxq.kernels._nvfp4_gptq_jit", interpret=interpret, where="nvfp4_gptq_solve_fast"
    )
    return CachedLauncher(sources.nvfp4_gptq_block_kernel)


def _options(interpret: bool, warps: int) -> dict[str, object]:
    """No multiply-add contraction, IEEE division with subnormals kept (the interpreter computes
    each operation on its own in NumPy anyway)."""
    if interpret:
        return {"num_warps": warps}
    return {"num_warps": warps, "enable_fp_fusion": False, "enable_reflect_ftz": False}


def _solve_block(
    w: Tensor, step: Tensor, h: Tensor, value: Tensor, err: Tensor, tuning: NVFP4GPTQTuning,
    interpret: bool, index: int,
) -> None:  # fmt: skip
    """One launch over the rows of one block (views of any strides but ``h``, row-major: the
    factor is column-major, so the caller copies its diagonal block, 128 KiB, and each row the
    kernel loads is contiguous)."""
    rows, width = w.shape
    bw = max(16, 1 << (width - 1).bit_length())
    tensors = (w, step, h, value, err)
    ints = (
        rows, *w.stride(), *step.stride(), h.stride(0), *value.stride(), *err.stride(),
    )  # fmt: skip
    key = (
        tuple(t.data_ptr() % 16 == 0 for t in tensors), _specialized(*ints), width,
        tuning.block_rows, bw, tuning.warps,
    )  # fmt: skip
    grid = (-(-rows // tuning.block_rows), 1, 1)
    args = (*tensors, *ints, width, tuning.block_rows, bw)
    _launcher(interpret)(key, grid, args, _options(interpret, tuning.warps), index)


def nvfp4_gptq_solve_fast(
    weight: Float[Tensor, "n k"],
    hessian: Float[Tensor, "k k"],
    global_scale: Float32[Tensor, ""] | float,
    *,
    recipe: NVFP4RecipeName = "nvidia",
    damp_percent: float = 0.01,
    blocksize: int = 128,
    tuning: NVFP4GPTQTuning = DEFAULT_NVFP4_GPTQ_TUNING,
) -> NVFP4GPTQSolution:
    """:func:`floatxq.nvfp4_gptq_solve` with each block's column loop in one Triton launch.

    Args: as :func:`floatxq.nvfp4_gptq_solve` (no ``cuda_graph``), on a CUDA device (or any
    under ``TRITON_INTERPRET=1``), with ``1 <= blocksize <= 128``; ``tuning`` the launch shape.

    Raises:
      ValueError: as :func:`floatxq.nvfp4_gptq_solve`; ``blocksize`` above 128.
      TypeError: non-floating tensors, a CPU weight (without ``TRITON_INTERPRET=1``).
      RuntimeError: Triton missing.

    Numerics: bit for bit :func:`floatxq.nvfp4_gptq_solve` on the same device (the same
    preparation, GEMMs and finishing; the kernel rounds each column as ``_solve_block`` does).

    Example:
      >>> w = torch.randn(8, 32, device="cuda")  # doctest: +SKIP
      >>> x = torch.randn(64, 32, device="cuda")  # doctest: +SKIP
      >>> nvfp4_gptq_solve_fast(w, x.T @ x, 0.01).packed.shape  # doctest: +SKIP
      torch.Size([8, 16])
    """
    where = "nvfp4_gptq_solve_fast"
    if not isinstance(tuning, NVFP4GPTQTuning):
        raise TypeError(f"{where}: tuning must be an NVFP4GPTQTuning, got {type(tuning).__name__}")
    if isinstance(blocksize, bool) or not isinstance(blocksize, int):
        raise TypeError(f"{where}: blocksize must be an int, got {type(blocksize).__name__}")
    if blocksize > NVFP4_GPTQ_MAX_BLOCK:
        raise ValueError(
            f"{where}: blocksize must be at most {NVFP4_GPTQ_MAX_BLOCK} (the kernel's tile), got "
            f"{blocksize}; nvfp4_gptq_solve takes any blocksize"
        )
    if isinstance(weight, torch.Tensor):
        require_kernel_device((weight,), where=where)
    prep = _prepare(
        weight, hessian, global_scale, recipe=recipe, damp_percent=damp_percent,
        blocksize=blocksize, where=where,
    )  # fmt: skip
    rows, k = prep.w32.shape
    values = torch.empty_like(prep.w32)
    interpret = triton_interpret_enabled()
    errs: dict[int, Tensor] = {}
    guard, index = launch_device(prep.w32.device)
    with guard:
        for i1 in range(0, k, blocksize):
            i2 = min(i1 + blocksize, k)
            err = errs.get(i2 - i1)
            if err is None:
                err = errs[i2 - i1] = prep.work.new_empty((rows, i2 - i1))
            if rows:
                _solve_block(
                    prep.work[:, i1:i2], prep.step[:, i1:i2],
                    prep.upper[i1:i2, i1:i2].contiguous(),
                    values[:, i1:i2], err, tuning, interpret, index,
                )  # fmt: skip
            prep.work[:, i2:] -= err @ prep.upper[i1:i2, i2:]
    return _finish(prep, values, hessian)
