"""The fragment-words kernels: W4A16 and W4A-FP8 for the fewest rows (decode steps).

Twins of :func:`floatxq.w4a16_linear` and :func:`floatxq.w4a_fp8_linear_prepacked` for calls
of up to :attr:`FragTuning.w4a16_max_rows` (W4A16) / :attr:`FragTuning.w4a_fp8_max_rows`
(W4A-FP8) rows. They read the fragment words of :mod:`floatxq.gptq.fragment_words`, staged once
by the modules, and hand the decoded weights to ``mma.sync`` as its register operand (the
weights' transpose times the activations' transpose, see
:mod:`floatxq.kernels._w4a_frag_jit`): no shared memory, no layout shuffles, K split over
programs and reduced in a fixed order. W4A16 decodes exactly the reference's operands (FP32
accumulation in another order); W4A-FP8 accumulates each 128-row group exactly as the
decode-words kernel does (the same bits, measured).

The kernels are written in Gluon (Triton's layout-explicit dialect), which has no interpreter:
:func:`fragment_unavailable_reason` says where they cannot run (no CUDA, compute capability below
8.0, ``TRITON_INTERPRET=1``, a Triton without Gluon); :mod:`floatxq.dispatch` then keeps the
decode-words kernels.
"""

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import torch

from floatxq._typing import Tensor
from floatxq.formats import DECODE_TILE_ROWS, FRAGMENT_COLUMNS
from floatxq.gptq.decode_words import DecodeOperands
from floatxq.gptq.fragment_words import stage_fragment_words
from floatxq.kernels import fp8_small_m
from floatxq.kernels._triton import (
    CachedLauncher,
    dependent_launches,
    import_triton,
    launch_device,
    new_output,
    triton_interpret_enabled,
)

__all__ = [
    "DEFAULT_FRAG_TUNING",
    "FragTuning",
    "bound_fp8_gemm",
    "bound_w4a16",
    "cached_fragment",
    "fragment_unavailable_reason",
]


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class FragTuning:
    """Launch shapes of the fragment kernels (defaults measured on an H200, 8192 × 8192).

    Raises:
      ValueError: a count below 1, ``stages`` other than 1 or 2, ``reduce_chunk`` not a power
        of two up to 16, ``warps`` not dividing ``blocks``.

    Numerics: none; results agree for every tuning up to FP32 summation order.

    Example:
      >>> FragTuning(w4a16_max_rows=4).w4a16_max_rows
      4
    """

    w4a16_max_rows: int = 8
    """Largest row count :func:`floatxq.dispatch.w4a16_route` sends here (W4A16)."""
    w4a_fp8_max_rows: int = 4
    """Largest row count :func:`floatxq.dispatch.w4a_fp8_operand` sends here (W4A-FP8)."""
    blocks: int = 8
    """Blocks of 16 output columns a program of the W4A-FP8 kernel computes."""
    warps: int = 4
    stages: int = 2
    """Tiles of 128 input rows loaded ahead (1 or 2)."""
    target_programs: int = 6
    """The W4A-FP8 kernel splits K until about this many programs per SM are launched."""
    w4a16_blocks: int = 4
    """``blocks`` of the W4A16 kernel (measured on the Llama-3-8B layer shapes and 8192 × 8192,
    ``benchmarks/w4a_tuning_sweep.py``: 1.0–1.3× faster than 8 blocks at 6 programs)."""
    w4a16_target_programs: int = 8
    """``target_programs`` of the W4A16 kernel."""
    reduce_chunk: int = 8
    """Partial tiles the last program of a split-K tile loads before adding them (1, 2, 4, 8 or
    16; the sum's order, and so its bits, do not depend on it). One at a time made 2 to 8 rows
    on the narrow layers 1.4–1.6× slower (``benchmarks/w4a_narrow_probe.py``)."""

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"FragTuning: {f.name} must be an int >= 1, got {value!r}")
        if self.stages > 2:
            raise ValueError(f"FragTuning: stages must be 1 or 2, got {self.stages}")
        if self.reduce_chunk not in (1, 2, 4, 8, 16):
            raise ValueError(
                f"FragTuning: reduce_chunk must be 1, 2, 4, 8 or 16, got {self.reduce_chunk}"
            )
        for name in ("blocks", "w4a16_blocks"):
            blocks = getattr(self, name)
            if blocks % self.warps or blocks & (blocks - 1):
                raise ValueError(
                    f"FragTuning: {name} must be a power of two and a multiple of warps, got "
                    f"{name}={blocks}, warps={self.warps}"
                )


DEFAULT_FRAG_TUNING = FragTuning()


def fragment_unavailable_reason(device: torch.device) -> str | None:
    """Why the fragment kernels cannot run on ``device`` (``None`` when they can).

    Numerics: none.

    Example:
      >>> fragment_unavailable_reason(torch.device("cpu"))
      'the fragment kernels run on CUDA GPUs (Gluon has no interpreter)'
    """
    if device.type != "cuda" or triton_interpret_enabled():
        return "the fragment kernels run on CUDA GPUs (Gluon has no interpreter)"
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _device_reason(index)


@functools.cache
def _device_reason(index: int) -> str | None:
    major, minor = torch.cuda.get_device_capability(index)
    if major < 8:
        return f"compute capability {major}.{minor} < 8.0 (mma.sync on bf16)"
    try:
        import_triton(where="fragment_unavailable_reason")
        import triton.experimental.gluon  # noqa: F401
    except (ImportError, RuntimeError) as exc:
        return f"Triton's Gluon does not import ({type(exc).__name__}: {exc})"
    return None


def cached_fragment(cache: dict[Any, Any], ops: DecodeOperands | None) -> Tensor | None:
    """The fragment words of ``ops.words`` where the fragment kernels run on its device, kept in
    a module's ``cache`` under ``"frag"`` (staged once per staging of the words, never during
    CUDA graph capture), else None."""
    if ops is None or fragment_unavailable_reason(ops.words.device) is not None:
        return None
    held = cache.get("frag")
    stale = held is None or held[0] is not ops.words
    if stale and not torch.cuda.is_current_stream_capturing():
        held = cache["frag"] = (ops.words, stage_fragment_words(ops.words))
    return held[1] if held is not None and held[0] is ops.words else None


@functools.cache
def _launchers() -> tuple[CachedLauncher, CachedLauncher]:
    import_triton(where="floatxq.kernels.w4a_frag")
    from floatxq.kernels import _w4a_frag_jit as jit

    return CachedLauncher(jit.w4a16_frag_kernel), CachedLauncher(jit.w4a_fp8_frag_kernel)


_MAX_ROWS = 32
"""Rows of one launch (the widest B operand the kernels build)."""

_PLANS: dict[Any, tuple[tuple[int, int, int], tuple[Any, ...], dict[str, Any]]] = {}
"""Launch plans by shapes, dtypes, device and tuning (computed once each, never replaced)."""


def _kind(bias: Tensor | None) -> torch.dtype | None:
    return None if bias is None else bias.dtype


def _aligned(*tensors: Tensor | None) -> tuple[bool, ...]:
    """Which tensors start on 16 bytes (what a compiled launch is specialized on)."""
    return tuple(t is not None and t.data_ptr() % 16 == 0 for t in tensors)


def _plan(
    m: int, n: int, k: int, device: torch.device, tuning: FragTuning, head: tuple[Any, ...],
    w4a16: bool = False,
) -> tuple[tuple[int, int, int], tuple[Any, ...], dict[str, Any]]:  # fmt: skip
    """``(grid, constexpr tail, options)``: the even K split that keeps about
    ``tuning.target_programs`` (``w4a16``: ``w4a16_target_programs``) programs per SM."""
    blocks = tuning.w4a16_blocks if w4a16 else tuning.blocks
    target = tuning.w4a16_target_programs if w4a16 else tuning.target_programs
    tiles = -(-n // (FRAGMENT_COLUMNS * blocks))
    steps = -(-k // DECODE_TILE_ROWS)
    programs = target * (fp8_small_m._sm_count(device) or 1)
    fits = [d for d in range(1, steps + 1) if steps % d == 0 and tiles * d <= programs]
    split = max(fits, default=1)
    width = 8 if m <= 8 else (16 if m <= 16 else _MAX_ROWS)
    # PREFETCH_X (the constexpr after the warps) stays off: measured slower (RESULTS.md)
    tail = (*head, k % DECODE_TILE_ROWS == 0, n % (FRAGMENT_COLUMNS * blocks) == 0,
            blocks, width, steps // split, split, tuning.reduce_chunk, tuning.stages, tuning.warps,
            False)  # fmt: skip
    return (tiles, split, 1), tail, {"num_warps": tuning.warps}


def _w4a16_spec(
    x: Tensor, ops: DecodeOperands, bias: Tensor | None, k: int, n: int, group: int,
    device: torch.device, has_lo: bool, tuning: FragTuning,
) -> tuple[Any, tuple[tuple[int, int, int], tuple[Any, ...], dict[str, Any]]]:  # fmt: skip
    """``(key, (grid, constexpr tail, options))`` of a W4A16 launch of at most 32 rows."""
    m = x.shape[0]
    key = ("w4a16", m, n, k, group, x.dtype, x.stride(), has_lo, _kind(bias), device, tuning,
           _aligned(x, ops.zeros, bias))  # fmt: skip
    plan = _PLANS.get(key)
    if plan is None:
        head = (group, group >= k or group % DECODE_TILE_ROWS == 0, has_lo, bias is not None)
        plan = _PLANS[key] = _plan(m, n, k, device, tuning, head, w4a16=True)
    return key, plan


def _w4a16_args(
    frag: Tensor, ops: DecodeOperands, bias: Tensor | None, m: int, n: int, k: int,
    x_stride: int, tail: tuple[Any, ...],
) -> tuple[tuple[Any, ...], tuple[Any, ...]]:  # fmt: skip
    """The W4A16 launch's ``(tensors after x, arguments after the workspace)``."""
    fixed = (frag, ops.zeros, ops.hi, ops.lo, bias if bias is not None else ops.hi)
    return fixed, (m, n, k, ops.zeros.shape[0], x_stride, n, *tail)


def w4a16_frag_linear(
    x: Tensor,
    frag: Tensor,
    ops: DecodeOperands,
    bias: Tensor | None,
    k: int,
    n: int,
    group: int,
    device: torch.device,
    has_lo: bool,
    tuning: FragTuning = DEFAULT_FRAG_TUNING,
) -> Tensor:
    """``x @ W.T + bias`` from fragment words, arguments already checked (``GPTQLinear`` and
    :func:`floatxq.kernels.w4a16.w4a16_linear_kernel`'s ``"w4a16_frag"`` route call this):
    ``frag`` the fragment words of ``ops.words``, ``ops`` staged for ``x.dtype``, ``group``
    the contiguous group size (``k`` for one group); ``has_lo``: the scales' low parts may be
    nonzero (scales of another dtype than ``x``; else the decode skips them)."""
    m = x.shape[0]
    out, done = new_output(m, n, k, x.dtype, device, bias)
    if done:
        return out
    if m > _MAX_ROWS:  # (one launch per block of rows: the kernel's widest operand is 32)
        for i in range(0, m, _MAX_ROWS):
            out[i : i + _MAX_ROWS] = w4a16_frag_linear(
                x[i : i + _MAX_ROWS], frag, ops, bias, k, n, group, device, has_lo, tuning
            )
        return out
    key, (grid, tail, options) = _w4a16_spec(x, ops, bias, k, n, group, device, has_lo, tuning)
    fixed, rest = _w4a16_args(frag, ops, bias, m, n, k, x.stride(0), tail)
    guard, index = launch_device(device)
    with guard:
        part = counts = out
        if grid[1] > 1:
            part, counts, _ = fp8_small_m._workspace(device, index, grid[1] * m * n, grid[0])
        _launchers()[0](key, grid, (x, *fixed, out, part, counts, *rest), options, index)
    return out


def bound_w4a16(
    x: Tensor, frag: Tensor, ops: DecodeOperands, bias: Tensor | None, k: int, n: int,
    group: int, has_lo: bool,
) -> Callable[[Tensor], Tensor] | None:  # fmt: skip
    """:func:`w4a16_frag_linear` (default tuning) bound for every call on an ``x`` like this one
    (shape, dtype, strides, device, alignment) once it has launched; None where it has not (or
    for no rows, columns or K, or more than 32 rows)."""
    m, device = x.shape[0], x.device
    if not (0 < m <= _MAX_ROWS and n and k) or fragment_unavailable_reason(device) is not None:
        return None
    key, (grid, tail, _) = _w4a16_spec(
        x, ops, bias, k, n, group, device, has_lo, DEFAULT_FRAG_TUNING
    )
    launch = _launchers()[0].bind(key, grid, device.index)
    if launch is None:
        return None
    fixed, rest = _w4a16_args(frag, ops, bias, m, n, k, x.stride(0), tail)
    return fp8_small_m.bound_gemm(launch, m, n, x.dtype, device, fixed, rest, grid)


def _fp8_spec(
    codes: Tensor, row_scale: Tensor, scales: Tensor, bias: Tensor | None,
    out_dtype: torch.dtype, tuning: FragTuning,
) -> tuple[Any, tuple[tuple[int, int, int], tuple[Any, ...], dict[str, Any]]]:  # fmt: skip
    """``(key, (grid, constexpr tail, options))`` of a W4A-FP8 launch of at most 32 rows."""
    (m, k), n, device = codes.shape, scales.shape[1], codes.device
    key = ("w4afp8", m, n, k, out_dtype, codes.stride(), scales.dtype, scales.stride(),
           _kind(bias), device, tuning, _aligned(codes, row_scale, scales, bias))  # fmt: skip
    plan = _PLANS.get(key)
    if plan is None:
        grid, tail, options = _plan(m, n, k, device, tuning, (bias is not None,))
        pdl = dependent_launches(device)  # (it starts while the token packing ends)
        plan = _PLANS[key] = (grid, (*tail, pdl), {**options, "launch_pdl": pdl})
    return key, plan


def w4a_fp8_frag_gemm(
    codes: Tensor,
    row_scale: Tensor,
    frag: Tensor,
    scales: Tensor,
    bias: Tensor | None,
    out_dtype: torch.dtype,
    tuning: FragTuning = DEFAULT_FRAG_TUNING,
) -> Tensor:
    """The W4A-FP8 GEMM of packed tokens (``codes`` ``(m, k)`` E4M3, ``row_scale`` ``(m,)``
    float32) and the fragment words of the centered codes (``code - 8`` stored as ``code``),
    ``scales`` ``(k / 128, n)``, arguments already checked (``W4AFP8Linear`` and
    :func:`floatxq.kernels.w4a_fp8.fp8_linear_prepacked` call this)."""
    m, k = codes.shape
    n = scales.shape[1]
    device = codes.device
    out, done = new_output(m, n, k, out_dtype, device, bias)
    if done:
        return out
    if m > _MAX_ROWS:
        for i in range(0, m, _MAX_ROWS):
            rows = slice(i, i + _MAX_ROWS)
            out[rows] = w4a_fp8_frag_gemm(
                codes[rows], row_scale[rows], frag, scales, bias, out_dtype, tuning
            )
        return out
    key, (grid, tail, options) = _fp8_spec(codes, row_scale, scales, bias, out_dtype, tuning)
    guard, index = launch_device(device)
    with guard:
        part = counts = out
        if grid[1] > 1:
            part, counts, _ = fp8_small_m._workspace(device, index, grid[1] * m * n, grid[0])
        args = (
            codes.view(torch.uint8), row_scale, frag, scales,
            bias if bias is not None else scales, out, part, counts, m, n, k, codes.stride(0),
            scales.stride(0), scales.stride(1), out.stride(0), *tail,
        )  # fmt: skip
        _launchers()[1](key, grid, args, options, index)
    return out


def bound_fp8_gemm(
    codes: Tensor, row_scale: Tensor, frag: Tensor, scales: Tensor, bias: Tensor | None,
    out_dtype: torch.dtype,
) -> Callable[[Tensor, Tensor], Tensor] | None:  # fmt: skip
    """:func:`w4a_fp8_frag_gemm` (default tuning) bound for every call on tokens like these
    (``codes`` as :func:`floatxq.kernels.w4a_fp8.fp8_pack` makes them) once it has launched;
    None where it has not (or for no rows, columns or K, or more than 32 rows)."""
    (m, k), n, device = codes.shape, scales.shape[1], codes.device
    if not (0 < m <= _MAX_ROWS and n and k) or fragment_unavailable_reason(device) is not None:
        return None
    key, (grid, tail, _) = _fp8_spec(codes, row_scale, scales, bias, out_dtype,
                                     DEFAULT_FRAG_TUNING)  # fmt: skip
    launch = _launchers()[1].bind(key, grid, device.index)
    if launch is None:
        return None
    fixed = (frag, scales, bias if bias is not None else scales)
    rest = (m, n, k, codes.stride(0), scales.stride(0), scales.stride(1), n, *tail)
    gemm = fp8_small_m.bound_gemm(launch, m, n, out_dtype, device, fixed, rest, grid)
    return lambda codes, row_scale: gemm(codes.view(torch.uint8), row_scale)
