"""Triton FP8 linear for decode-sized inputs: ``x`` is quantized inside the GEMM, one launch.

Twin of :func:`floatxq.fp8_scaled_linear` (the pure reference) for ``M`` up to a few dozen
rows, where ``quantize x`` + ``torch._scaled_mm`` costs two launches and their host time
(:func:`floatxq.dispatch.select_fp8_route` sends ``M <= 16`` here on CUDA). A program owns
``BLOCK_N`` output columns of every row: it takes ``x``'s amax (per tensor, row or 1×128
block), quantizes each ``x`` tile with the weight formula and encoder of
:func:`floatxq.quantize_fp8_weight`, multiplies on the tensor cores and applies the scales and
the bias in the epilogue; K may be split over programs (deterministic). How, step by step, and
the bound it meets: ``docs/numerics.md``, "Kernels: the fused small-M FP8 GEMM and the FP8
weight encoder". Tiles, splits and the amax pass come from a frozen :class:`FP8SmallMTuning`
(defaults measured, ``benchmarks/RESULTS.md``); the Triton sources
(:mod:`floatxq.kernels._fp8_small_m_jit`) are imported on the first launch.

:func:`fp8_scaled_linear_kernel_with_codes` runs the same kernel with a compile-time switch that
also stores the ``x`` codes and inverse scales, so tests compare them with
:func:`floatxq.quantize_fp8_weight`'s bit for bit (the output alone cannot show a code one step
off at large K).
"""

import dataclasses
import functools
from typing import Any, Literal, NamedTuple

import torch

from floatxq._typing import Float, Float8e4m3fn, Float32, FP8Dtype, Tensor, checked_record
from floatxq.formats import FLOAT32_MAX, K_GROUP, MODEL_DTYPES, fp8_max
from floatxq.fp8 import _scaled_linear_arguments
from floatxq.kernels import fp8_weight
from floatxq.kernels._triton import (
    CachedLauncher,
    import_kernel_sources,
    launch_device,
    triton_interpret_enabled,
)

__all__ = [
    "DEFAULT_SMALL_M_TUNING",
    "FP8ScaledLinearTrace",
    "FP8SmallMTiles",
    "FP8SmallMTuning",
    "fp8_scaled_linear_kernel",
    "fp8_scaled_linear_kernel_with_codes",
]

_X_TENSOR, _X_ROW, _X_BLOCK = 0, 1, 2
_RECIPE_MODE = {"tensorwise": _X_TENSOR, "rowwise": _X_ROW, "blockwise": _X_BLOCK}
_BLOCK_M = 16
"""Rows per program for inputs of two rows or more (the MMA's N; ``out.T = W · xq.T``)."""
_COOP_BANK = 64
"""Maxima per bank of the shared amax's words (one per row for rowwise, so rowwise reduces
together for at most this many rows). Fixed, so launches of any recipe and row count can share
the words: each launch starts on a bank of zeros."""
_SYNC_WORDS = 2 + 2 * _COOP_BANK
"""The shared amax's words: generation, arrival count, two banks of maxima (int32)."""


def _require_power_of_two(owner: str, name: str, value: int, low: int) -> None:
    if value < low or value & (value - 1):
        raise ValueError(f"{owner}: {name} must be a power of two >= {low}, got {value}")


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class FP8SmallMTiles:
    """One recipe's launch shape: never what the kernel computes beyond summation order.

    Attributes:
      block_n: output columns per program (blockwise takes at most 128).
      block_k: K per step (blockwise always takes 128: one weight scale per step).
      num_warps, num_stages: Triton launch options (software-pipeline depth of the K loop).
      split_k: split K over this many programs per output tile (the last to finish reduces the
        FP32 partials in split order); taken for few rows, or any rows for blockwise.
      imprecise_k: FP8 products the tensor core adds before each FP32 promotion (capped at
        ``block_k``); one Hopper MMA's K (32) by default: its FP8 sums keep fewer bits than
        FP32, and at 256 they left the tests' 22-bit bound (up to 2% off).

    Raises:
      ValueError: a tile size that is not a power of two (block_n >= 16, block_k >= 32) or a
        count below 1.

    Numerics: the summation order of the FP32 sums (split-K, FP32 promotion); the codes of ``x``
    never change.
    """

    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    split_k: int = 1
    imprecise_k: int = 32

    def __post_init__(self) -> None:
        _require_power_of_two("FP8SmallMTiles", "num_warps", self.num_warps, 1)
        _require_power_of_two("FP8SmallMTiles", "block_n", self.block_n, 16)
        _require_power_of_two("FP8SmallMTiles", "block_k", self.block_k, 32)
        for name in ("num_stages", "split_k", "imprecise_k"):
            if getattr(self, name) < 1:
                raise ValueError(f"FP8SmallMTiles: {name} must be >= 1, got {getattr(self, name)}")


_MULTI_ROW = FP8SmallMTiles(block_n=128, block_k=256, num_warps=8, num_stages=4, split_k=2)
_ONE_ROW = FP8SmallMTiles(block_n=64, block_k=256, num_warps=4, num_stages=6)
_BLOCKWISE = FP8SmallMTiles(block_n=128, block_k=128, num_warps=8, num_stages=4, split_k=4)


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class FP8SmallMTuning:
    """How ``fp8_small_m`` is launched, per recipe and row count (defaults measured at
    N = K = 8192, ``benchmarks/fp8_small_m_sweep.py``; see benchmarks/RESULTS.md).

    Attributes:
      tensorwise, rowwise, blockwise: tiles for inputs of two rows or more.
      tensorwise_one_row, rowwise_one_row, blockwise_one_row: tiles for a one-row ``x``, whose
        programs take ``block_m_one_row`` rows (less shared memory per step leaves room for
        deeper pipelines).
      block_m_one_row: rows per program for a one-row ``x`` (8: the MMA's narrowest N; 16 rows
        otherwise).
      amax_tile: elements of ``x`` per load of the amax pass over a program's rows.
      amax_row_tile: columns per load of the amax pass over a one-row ``x``.
      amax_unroll: loads of the amax pass in flight at once (chunks run one after another).
      split_max_m: split K only for at most this many rows (any for blockwise, or where the
        programs reduce x's amax together): each split re-reads all of ``x`` for the amax.
      coop_min_rows: from this many rows on, tensorwise and rowwise programs reduce x's amax
        together (a grid barrier in a cooperative launch, when the grid fits one program per
        SM) instead of each reading all of ``x``.
      coop_max_piece: widest piece of a row one program reads for that shared amax.

    Raises:
      ValueError: a size that is not a power of two, or a count below 1.

    Numerics: as :class:`FP8SmallMTiles` (summation order only).

    Example:
      >>> FP8SmallMTuning().tiles("rowwise", 1).block_n
      64
    """

    tensorwise: FP8SmallMTiles = _MULTI_ROW
    rowwise: FP8SmallMTiles = _MULTI_ROW
    blockwise: FP8SmallMTiles = _BLOCKWISE
    tensorwise_one_row: FP8SmallMTiles = _ONE_ROW
    rowwise_one_row: FP8SmallMTiles = _ONE_ROW
    blockwise_one_row: FP8SmallMTiles = _BLOCKWISE
    block_m_one_row: int = 8
    amax_tile: int = 4096
    amax_row_tile: int = 8192
    amax_unroll: int = 16
    split_max_m: int = 4
    coop_min_rows: int = 2
    coop_max_piece: int = 4096

    def __post_init__(self) -> None:
        _require_power_of_two("FP8SmallMTuning", "block_m_one_row", self.block_m_one_row, 8)
        for name in ("amax_tile", "amax_row_tile", "coop_max_piece"):
            _require_power_of_two("FP8SmallMTuning", name, getattr(self, name), 16)
        for name in ("amax_unroll", "split_max_m", "coop_min_rows"):
            if getattr(self, name) < 1:
                raise ValueError(f"FP8SmallMTuning: {name} must be >= 1, got {getattr(self, name)}")

    def tiles(self, recipe: str, rows: int) -> FP8SmallMTiles:
        """The tiles of ``recipe`` for an ``x`` of ``rows`` rows."""
        return getattr(self, recipe if rows > 1 else f"{recipe}_one_row")


DEFAULT_SMALL_M_TUNING = FP8SmallMTuning()
"""The tuning every call uses unless it passes its own."""


@functools.cache
def _launcher(interpret: bool) -> CachedLauncher:
    """The kernel's cached launches, jitted on first use for the mode ``interpret``."""
    sources = import_kernel_sources(
        "floatxq.kernels._fp8_small_m_jit", interpret=interpret, where="fp8_scaled_linear_kernel"
    )
    return CachedLauncher(sources.fp8_small_m_kernel)


def fp8_scaled_linear_kernel(
    x: Float[Tensor, "m k"],
    weight: FP8Dtype[Tensor, "n k"],
    weight_scale: Float32[Tensor, "*scale"],
    bias: Float[Tensor, "n"] | None = None,  # noqa: F821
    *,
    recipe: Literal["tensorwise", "rowwise", "blockwise"],
    tuning: FP8SmallMTuning = DEFAULT_SMALL_M_TUNING,
) -> Float[Tensor, "m n"]:
    """Triton version of :func:`floatxq.fp8_scaled_linear` for small ``m`` (one launch).

    Args:
      x: ``(m, k)`` fp16/bf16/fp32 CUDA activations (any strides); the output takes its dtype.
      weight: ``(n, k)`` FP8 codes (``float8_e4m3fn``; ``float8_e5m2`` for ``rowwise``).
      weight_scale: FP32 DIRECT weight scales ``1 / weight_scale_inv`` (what ``scaled_mm``
        takes): ``()``, ``(n,)`` or ``(n/128, k/128)`` by recipe (any strides).
      bias: ``(n,)`` in ``x.dtype`` or None.
      recipe: ``"tensorwise"``, ``"rowwise"`` or ``"blockwise"``.
      tuning: tiles, splits and the amax pass's shape (:class:`FP8SmallMTuning`).

    Returns:
      ``(m, n)`` in ``x.dtype``.

    Raises:
      ValueError: an unknown recipe, shapes or scale layouts that do not fit.
      TypeError: devices, dtypes or a weight format the recipe does not take.
      RuntimeError: Triton is not importable.

    Numerics: ``x``'s FP8 codes are bit-identical to the reference's; the output equals
    :func:`floatxq.fp8_scaled_linear` up to FP32 summation order and the FP32 rounding of the
    scale products. No finiteness check (no host sync): NaN in ``x`` gives NaN rows.

    Example:
      >>> w = floatxq.quantize_fp8_weight(torch.randn(256, 512, device="cuda"))  # doctest: +SKIP
      >>> fp8_scaled_linear_kernel(  # doctest: +SKIP
      ...     torch.randn(1, 512, device="cuda"), w.qweight, 1 / w.scale_inv, recipe="rowwise"
      ... ).shape
      torch.Size([1, 256])
    """
    _check_arguments(x, weight, weight_scale, bias, recipe, where="fp8_scaled_linear_kernel")
    return _launch(x, weight, weight_scale, bias, recipe, tuning=tuning)


@checked_record
class FP8ScaledLinearTrace(NamedTuple):
    """:func:`fp8_scaled_linear_kernel`'s output and what it quantized ``x`` to on the way."""

    out: Float[Tensor, "m n"]
    """``(m, n)`` in ``x.dtype``: bit for bit what ``fp8_scaled_linear_kernel`` returns."""
    x_codes: Float8e4m3fn[Tensor, "m k"]
    """``(m, k)`` E4M3 codes of ``x`` that the tensor cores multiplied."""
    x_scale_inv: Float32[Tensor, "*x_scale"]
    """FP32 inverse scales of ``x`` (multiply to quantize): ``()`` tensorwise, ``(m,)`` rowwise,
    ``(m, k/128)`` blockwise, the layout of :func:`floatxq.quantize_fp8_weight` on ``x``."""


def fp8_scaled_linear_kernel_with_codes(
    x: Float[Tensor, "m k"],
    weight: FP8Dtype[Tensor, "n k"],
    weight_scale: Float32[Tensor, "*scale"],
    bias: Float[Tensor, "n"] | None = None,  # noqa: F821
    *,
    recipe: Literal["tensorwise", "rowwise", "blockwise"],
    tuning: FP8SmallMTuning = DEFAULT_SMALL_M_TUNING,
) -> FP8ScaledLinearTrace:
    """:func:`fp8_scaled_linear_kernel`, also returning the ``x`` codes and scales it computed.

    The same kernel and launch shape, compiled with its stores of what the K loop quantized
    ``x`` to switched on (each element written once, by the programs of the first output tile
    of every K split). For tests: an output can hide one wrong code in its accumulation error,
    the codes cannot.

    Args:
      x, weight, weight_scale, bias, recipe, tuning: as :func:`fp8_scaled_linear_kernel`.

    Returns:
      ``FP8ScaledLinearTrace(out, x_codes, x_scale_inv)``.

    Raises:
      ValueError, TypeError, RuntimeError: as :func:`fp8_scaled_linear_kernel`.

    Numerics: ``out`` is bit for bit ``fp8_scaled_linear_kernel``'s; ``x_codes`` and
    ``x_scale_inv`` are bit for bit ``quantize_fp8_weight(x, weight_scale_method=...)`` with
    ``"tensor"``, ``"row"`` or ``"block"`` 1×128 by recipe (an empty ``x`` has scale 1).

    Example:
      >>> w = floatxq.quantize_fp8_weight(torch.randn(256, 512, device="cuda"))  # doctest: +SKIP
      >>> t = fp8_scaled_linear_kernel_with_codes(  # doctest: +SKIP
      ...     torch.randn(2, 512, device="cuda"), w.qweight, 1 / w.scale_inv, recipe="rowwise"
      ... )
      >>> t.out.shape, t.x_codes.dtype, t.x_scale_inv.shape  # doctest: +SKIP
      (torch.Size([2, 256]), torch.float8_e4m3fn, torch.Size([2]))
    """
    _check_arguments(
        x, weight, weight_scale, bias, recipe, where="fp8_scaled_linear_kernel_with_codes"
    )
    m, k = x.shape
    scale_shape = {"tensorwise": (), "rowwise": (m,), "blockwise": (m, k // K_GROUP)}
    codes = torch.empty((m, k), dtype=torch.float8_e4m3fn, device=x.device)
    scale_inv = torch.empty(scale_shape[recipe], dtype=torch.float32, device=x.device)
    out = _launch(
        x, weight, weight_scale, bias, recipe, tuning=tuning,
        trace=(codes.view(torch.int8), scale_inv),
    )  # fmt: skip
    return FP8ScaledLinearTrace(out, codes, scale_inv)


def _check_arguments(
    x: Tensor,
    weight: Tensor,
    weight_scale: Tensor,
    bias: Tensor | None,
    recipe: str,
    *,
    where: str,
) -> None:
    """The kernel's argument checks (recipe, dtypes, shapes, devices), before any launch."""
    for label, t in (("x", x), ("weight", weight), ("weight_scale", weight_scale)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{where}: {label} must be a tensor, got {type(t).__name__}")
    if x.dtype not in MODEL_DTYPES:
        raise TypeError(f"{where}: x must be float16/bfloat16/float32, got {x.dtype}")
    _scaled_linear_arguments(
        x, weight, weight_scale, bias, recipe=recipe, scale_name="weight_scale", where=where
    )
    if bias is not None and bias.dtype != x.dtype:
        raise ValueError(f"{where}: bias must be in {x.dtype} (x's dtype), got {bias.dtype}")
    devices = {t.device for t in (x, weight, weight_scale) + ((bias,) if bias is not None else ())}
    if len(devices) != 1 or (x.device.type != "cuda" and not triton_interpret_enabled()):
        raise TypeError(f"{where}: every tensor must be on one CUDA device, got {devices}")


_WORKSPACES: dict[Any, tuple[Tensor, Tensor, Tensor]] = {}
"""Per (device, stream, size class): split-K partials (FP32), per-tile arrival counters and the
shared amax's words (int32). Kernels on one stream run in order, so launches can share them;
counters are zero between launches (the last split of a tile resets its own; the last program at
the amax barrier resets the count and the next bank). A class's buffers are never replaced, so a
CUDA graph that captured them keeps valid memory; sizes are powers of two, so a workload needs
few classes. (Two CUDA graphs captured on one stream and replayed on two streams at once would
share them: capture them on different streams.)"""


def _workspace(
    device: torch.device, index: int, part_numel: int, tiles: int
) -> tuple[Tensor, Tensor, Tensor]:
    stream = torch._C._cuda_getCurrentRawStream(index) if device.type == "cuda" else 0
    part, count = fp8_weight._next_pow2(part_numel), fp8_weight._next_pow2(tiles)
    key = (device, stream, part, count)
    held = _WORKSPACES.get(key)
    if held is None:
        held = _WORKSPACES[key] = (
            torch.empty(part, dtype=torch.float32, device=device),
            torch.zeros(count, dtype=torch.int32, device=device),
            torch.zeros(_SYNC_WORDS, dtype=torch.int32, device=device),
        )
    return held


def bound_gemm(
    launch: Any, m: int, n: int, out_dtype: torch.dtype, device: torch.device,
    fixed: tuple[Any, ...], tail: tuple[Any, ...], grid: tuple[int, int, int], *,
    workspace: tuple[int, int] | bool | None = True, sync: bool = False,
) -> Any:  # fmt: skip
    """A split-K GEMM launch bound for repeated calls (``launch`` a
    :class:`~floatxq.kernels._triton.BoundLaunch`): called with the per-call tensors, it
    allocates the ``(m, n)`` output, takes the stream's workspace (looked up once per stream)
    and launches ``(*inputs, *fixed, out, part, counts[, sync], *tail)``, the argument order of
    every split-K kernel here. ``workspace``: ``(partials, tiles)`` of :func:`_workspace`, None
    for none (``out`` stands in), or True for ``grid[1]`` splits of ``grid[0]`` tiles (none
    without a split); ``sync``: the kernel also takes the workspace's amax words."""
    if workspace is True:
        workspace = (grid[1] * m * n, grid[0]) if grid[1] > 1 else None
    index, spaces = device.index, {}

    def gemm(*inputs: Tensor) -> Tensor:
        out = torch.empty((m, n), dtype=out_dtype, device=device)
        held: tuple[Tensor, ...] = (out, out, out)
        if workspace:
            stream = torch._C._cuda_getCurrentRawStream(index)
            held = spaces.get(stream)  # type: ignore[assignment]
            if held is None:
                held = spaces[stream] = _workspace(device, index, *workspace)
        launch(*inputs, *fixed, out, *held[: 3 if sync else 2], *tail)
        return out

    return gemm


def _plan(
    x: Tensor,
    weight: Tensor,
    weight_scale: Tensor,
    has_bias: bool,
    recipe: str,
    tuning: FP8SmallMTuning,
    interpret: bool,
    store_x: bool = False,
) -> tuple[tuple[int, int, int], int, bool, tuple[Any, ...], dict[str, Any]]:
    """``(grid, split, together, arguments after the ten pointers, launch options)`` of one
    launch (``together``: the programs reduce x's amax together behind a grid barrier;
    ``store_x``: the kernel also stores x's codes and scales, one N tile even for ``n = 0``)."""
    (m, k), n = x.shape, weight.shape[0]
    mode = _RECIPE_MODE[recipe]
    tiles = tuning.tiles(recipe, m)
    block_n, block_k = tiles.block_n, tiles.block_k
    if mode == _X_BLOCK:
        block_k = K_GROUP
        block_n = min(block_n, 128)
    steps = -(-k // block_k)
    block_m = tuning.block_m_one_row if m == 1 else _BLOCK_M
    tiles_n = max(1, -(-n // block_n))  # (n = 0 launches only to store x's codes)
    split = max(1, min(tiles.split_k, steps))
    split = -(-steps // -(-steps // split))  # no split left without steps (4 steps, 3 -> 2)
    # x's amax: reduced by all programs together behind a grid barrier (a cooperative launch:
    # at most one program per SM, so all are resident) from coop_min_rows rows on, where each
    # program reading all of x would re-read it once per program; otherwise every program
    # reads all of x, so K is split only where that stays cheap (few rows; blockwise needs no
    # amax pass).
    programs = -(-m // block_m) * tiles_n * split
    together = (
        mode != _X_BLOCK
        and m >= tuning.coop_min_rows
        and not interpret  # (the interpreter runs programs one after another: no barrier)
        and programs <= _sm_count(x.device)
        and (mode == _X_TENSOR or m <= _COOP_BANK)
    )
    if not together and m > tuning.split_max_m and mode != _X_BLOCK:
        split = 1
    grid = (-(-m // block_m), tiles_n, split)
    coop_k = coop_iters = 1
    if together:
        per_row = -(-grid[0] * grid[1] * grid[2] // m)  # pieces per row: about one per program
        coop_k = min(max(16, fp8_weight._next_pow2(-(-k // per_row))), tuning.coop_max_piece)
        coop_iters = -(-m * -(-k // coop_k) // (grid[0] * grid[1] * grid[2]))
    # the amax pass: one-row tiles for a one-row x, else this program's BLOCK_M rows
    amax_m = 1 if m == 1 else block_m
    width = tuning.amax_row_tile if m == 1 else tuning.amax_tile // amax_m
    amax_k = min(fp8_weight._next_pow2(k), max(16, width))
    amax_tiles = -(-k // amax_k)
    unroll = min(tuning.amax_unroll, amax_tiles)
    tail = (
        m, n, k, x.stride(0), x.stride(1), weight.stride(0), weight.stride(1),
        *(*weight_scale.stride(), 0, 0)[:2], n,
        mode, weight.dtype == torch.float8_e5m2, has_bias, fp8_max("float8_e4m3fn"),
        FLOAT32_MAX, fp8_weight._TINY_BITS,
        fp8_weight._conversion("float8_e4m3fn", x.device, None),
        min(tiles.imprecise_k, block_k),
        block_m, block_n, block_k, amax_m, amax_k, unroll,
        -(-m // amax_m) if mode == _X_TENSOR else 1, -(-amax_tiles // unroll),
        -(-steps // split), split, together, coop_k, coop_iters, _COOP_BANK, store_x,
    )  # fmt: skip
    options: dict[str, Any] = {"num_warps": tiles.num_warps, "num_stages": tiles.num_stages}
    if together:
        options["launch_cooperative_grid"] = True
    return grid, split, together, tail, options


def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 0
    index = device.index if device.index is not None else torch.cuda.current_device()
    return fp8_weight._sm_count(index)


_PLANS: dict[Any, tuple[tuple[int, int, int], int, bool, tuple[Any, ...], dict[str, Any]]] = {}
"""Launch plans by shapes, strides, dtypes, recipe, device, mode and tuning (computed once each,
never replaced)."""


def _launch_spec(
    x: Tensor, weight: Tensor, weight_scale: Tensor, bias: Tensor | None, recipe: str,
    tuning: FP8SmallMTuning, interpret: bool, trace: tuple[Tensor, Tensor] | None,
) -> tuple[Any, Any]:  # fmt: skip
    """``(key, plan)`` of a :func:`_launch` (the launcher's key adds the pointers' alignment;
    the plan is :func:`_plan`'s)."""
    key = (
        x.shape, x.stride(), x.dtype, weight.shape, weight.stride(), weight.dtype,
        weight_scale.stride(), None if bias is None else bias.dtype, recipe, x.device, interpret,
        # (hashing a record field by field costs microseconds: the default is keyed by None)
        None if tuning is DEFAULT_SMALL_M_TUNING else tuning, trace is not None,
    )  # fmt: skip
    plan = _PLANS.get(key)
    if plan is None:
        plan = _PLANS[key] = _plan(
            x, weight, weight_scale, bias is not None, recipe, tuning, interpret, trace is not None
        )
    return key, plan


def bound_launch(
    x: Tensor, weight: Tensor, weight_scale: Tensor, bias: Tensor | None, recipe: str
) -> Any:
    """:func:`_launch` (default tuning, no trace) bound for every ``x`` like this one (shape,
    dtype, strides, device, alignment) once it has launched: ``x -> out``; None where it has
    not, where nothing is kept, or for no rows, columns or K."""
    (m, k), n, device = x.shape, weight.shape[0], x.device
    if device.type != "cuda" or triton_interpret_enabled() or not (m and n and k):
        return None
    key, (grid, split, together, tail, _) = _launch_spec(
        x, weight, weight_scale, bias, recipe, DEFAULT_SMALL_M_TUNING, False, None
    )
    fixed = (weight, weight_scale, bias if bias is not None else weight_scale)
    aligned = tuple(a.data_ptr() % 16 == 0 for a in (x, *fixed)) + (True,) * 4  # (allocations)
    launch = _launcher(False).bind((key, aligned), grid, device.index)
    if launch is None:
        return None
    space = (split * m * n if split > 1 else 1, grid[0] * grid[1])
    return bound_gemm(launch, m, n, x.dtype, device, fixed, (None, None, *tail), grid,
                      workspace=(split > 1 or together) and space, sync=True)  # fmt: skip


def _launch(
    x: Tensor,
    weight: Tensor,
    weight_scale: Tensor,
    bias: Tensor | None,
    recipe: str,
    *,
    tuning: FP8SmallMTuning = DEFAULT_SMALL_M_TUNING,
    trace: tuple[Tensor, Tensor] | None = None,
) -> Tensor:
    """The launch, arguments already checked (``TorchFP8Linear`` calls this directly).

    ``trace``: contiguous ``(codes as int8, scale_inv)`` buffers the kernel also fills with
    what it quantized ``x`` to (:func:`fp8_scaled_linear_kernel_with_codes`).
    """
    (m, k), n = x.shape, weight.shape[0]
    device = x.device
    out = torch.empty((m, n), dtype=x.dtype, device=device)
    if trace is not None and (m == 0 or k == 0):
        trace[1].fill_(1.0)  # no element: amax 0, scale_inv 1 (the codes are empty)
    if m == 0 or (n == 0 and (trace is None or k == 0)):
        return out
    if k == 0:
        return out.copy_(bias.expand(m, n)) if bias is not None else out.zero_()
    interpret = triton_interpret_enabled()
    if interpret:
        x = x.float()  # (the interpreter's own widening flushes subnormals)
    key, plan = _launch_spec(x, weight, weight_scale, bias, recipe, tuning, interpret, trace)
    grid, split, together, tail, options = plan
    guard, index = launch_device(device)
    with guard:
        if split > 1 or together:
            part, counts, sync = _workspace(
                device, index, split * m * n if split > 1 else 1, grid[0] * grid[1]
            )
        else:  # neither split-K nor the shared amax: no workspace (nothing reads these)
            part = counts = sync = out
        stores = trace if trace is not None else (None, None)  # None: compile-time constants
        args = (
            x, weight, weight_scale, bias if bias is not None else weight_scale, out, part,
            counts, sync, *stores, *tail,
        )  # fmt: skip
        aligned = tuple(a.data_ptr() % 16 == 0 for a in args[:10] if a is not None)
        _launcher(interpret)((key, aligned), grid, args, options, index)
    return out
