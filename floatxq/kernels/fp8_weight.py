"""Triton twin of :func:`floatxq.quantize_fp8_weight`: the same bytes, one launch per layout.

``quantize_fp8_weight_kernel`` returns exactly what ``quantize_fp8_weight`` returns (codes and
FP32 inverse scales, bit for bit, with the same validation errors) for CUDA tensors. Each program
owns whole scale regions, so both passes of the contract (amax per region, then scale + clamp +
convert) run in one program; a non-finite region sets a flag and the pure function's
``ValueError`` is raised after the launch (one read of the flag). How programs are shaped is a
frozen :class:`FP8WeightTuning` record (defaults measured, ``benchmarks/RESULTS.md``).

Numerics mirror :mod:`floatxq.fp8` (amax on IEEE bit patterns, ``scale_inv`` by IEEE
division, one round-to-nearest-even conversion, never through FP16); the per-layout program
shapes and the encoders used on each GPU: ``docs/numerics.md``, "Kernels: the fused small-M FP8
GEMM and the FP8 weight encoder". The Triton sources (:mod:`floatxq.kernels._fp8_weight_jit`)
are imported on the first launch: importing this module needs neither Triton nor CUDA.
"""

import dataclasses
import functools
import re
import struct
from typing import Any, Literal

import torch

from floatxq._checks import require_finite
from floatxq._typing import Float, Float32, Shaped, Tensor
from floatxq.formats import (
    FLOAT32_MAX,
    FLOAT32_TINY,
    FP8ScaleMethod,
    fp8_max,
)
from floatxq.fp8 import (
    FP8Weight,
    _amax,
    _inverse_scale,
    _saturating_cast,
    _weight_arguments,
    fp32_reciprocal,
)
from floatxq.kernels._triton import (
    CachedLauncher,
    import_kernel_sources,
    import_triton,
    launch_device,
    triton_available,
    triton_interpret_enabled,
    triton_unavailable_reason,
)

__all__ = ["DEFAULT_WEIGHT_TUNING", "FP8WeightTuning", "quantize_fp8_weight_kernel"]


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class FP8WeightTuning:
    """How the FP8 quantizer is launched; never what it computes (every setting gives the same
    bytes). The defaults were measured fastest (``benchmarks/fp8_linear.py``, see
    benchmarks/RESULTS.md).

    Attributes:
      row_tile: most elements one program holds in per-row layouts (``row``, ``(1, bc)`` blocks
        and both passes of two-pass tensor scaling); a power of two, at least 128.
      block_tile: the same for ``(br, bc)`` blocks and one-program tensor scaling.
      row_elements_per_warp, block_elements_per_warp: a program gets one warp per this many
        elements of its tile (1 to 16 warps); a power of two, at least 128 (4 per thread: the
        PTX conversion packs 4 values).
      tensor_one_program: tensor-scaled inputs up to this many elements run as one program.
      amax_programs_per_sm: programs per SM of the amax pass of two-pass tensor scaling.
      max_partials: most programs (partial maxima) of that pass; a power of two.

    Raises:
      ValueError: a size that is not a power of two of at least 128, or a count below 1.

    Numerics: none; launch shapes only.

    Example:
      >>> FP8WeightTuning(row_tile=4096).row_tile
      4096
    """

    row_tile: int = 8192
    block_tile: int = 16384
    row_elements_per_warp: int = 1024
    block_elements_per_warp: int = 512
    tensor_one_program: int = 1 << 16
    amax_programs_per_sm: int = 4
    max_partials: int = 1024

    def __post_init__(self) -> None:
        for name in (
            "row_tile", "block_tile", "row_elements_per_warp", "block_elements_per_warp",
            "max_partials",
        ):  # fmt: skip
            value = getattr(self, name)
            if value < 128 or value & (value - 1):
                raise ValueError(
                    f"FP8WeightTuning: {name} must be a power of two >= 128, got {value}"
                )
        for name in ("tensor_one_program", "amax_programs_per_sm"):
            if getattr(self, name) < 1:
                raise ValueError(f"FP8WeightTuning: {name} must be >= 1, got {getattr(self, name)}")


DEFAULT_WEIGHT_TUNING = FP8WeightTuning()
"""The tuning every call uses unless it passes its own."""

_MODE_FULL, _MODE_AMAX, _MODE_GIVEN = 0, 1, 2
_CONSTEXPR_ORDER = (
    "FMAX", "FLT_MAX", "TINY_BITS", "MODE", "PER_ROW", "DIRECT", "CHECK", "CONVERT", "MANT",
    "BIAS", "FNUZ", "TILE_R", "TILE_C", "R_ITERS", "C_ITERS", "P_BLOCK",
)  # fmt: skip
"""The kernel's constexpr parameters in signature order (every launch passes them by position)."""
_CONVERT_PTX_E4M3, _CONVERT_PTX_E5M2, _CONVERT_INTEGER = 0, 1, 2
_PTX_CONVERT = {"float8_e4m3fn": _CONVERT_PTX_E4M3, "float8_e5m2": _CONVERT_PTX_E5M2}
_PTX_MIN_CAPABILITY = (8, 9)
"""``cvt.rn.satfinite.{e4m3x2,e5m2x2}.f32`` exists from SM 8.9 (PTX ISA 7.8)."""
_MAX_WARPS = 16
_KERNEL_INPUT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)

_TINY_BITS = struct.unpack("<I", struct.pack("<f", FLOAT32_TINY))[0]
"""Bit pattern of FLT_MIN: the amax floor, applied to bit patterns (0x00800000)."""


@functools.cache
def _launcher(interpret: bool) -> CachedLauncher:
    """The quantize kernel's cached launches, jitted on first use for the mode ``interpret``
    (a process that changes ``TRITON_INTERPRET`` later gets a ``RuntimeError`` naming it)."""
    sources = import_kernel_sources(
        "floatxq.kernels._fp8_weight_jit", interpret=interpret, where="quantize_fp8_weight_kernel"
    )
    return CachedLauncher(sources.fp8_quantize_kernel)


def compiled_kernels() -> list[Any]:
    """The compiled quantize kernels kept so far (Triton ``CompiledKernel`` objects, whose
    ``.asm["ptx"]`` a benchmark can read); empty when interpreted.

    Numerics: none.
    """
    return _launcher(triton_interpret_enabled()).compiled()


@functools.cache
def _format_bits(name: str) -> tuple[int, int, bool]:
    """``(mantissa bits, exponent bias, fnuz)`` of an encodable FP8 format, read off its name.

    ``float8_e{E}m{M}[fn|fnuz]``: IEEE-style bias ``2**(E-1) - 1``, one more for ``fnuz``
    (``torch.finfo`` is not used: it reports eps 0.125 for ``float8_e5m2fnuz``).
    """
    match = re.fullmatch(r"float8_e(\d)m(\d)(fn|fnuz)?", name)
    if match is None:
        raise ValueError(f"_format_bits: {name!r} is not an encodable FP8 format name")
    exponent, mant, fnuz = int(match[1]), int(match[2]), match[3] == "fnuz"
    return mant, (1 << (exponent - 1)) - 1 + fnuz, fnuz


@functools.cache
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def _conversion(name: str, device: torch.device, convert: str | None) -> int:
    if convert not in (None, "ptx", "integer"):
        raise ValueError(f"convert: expected None, 'ptx' or 'integer', got {convert!r}")
    if convert == "integer" or triton_interpret_enabled() or device.type != "cuda":
        return _CONVERT_INTEGER
    ptx = _PTX_CONVERT.get(name)
    cap = _capability(device.index if device.index is not None else torch.cuda.current_device())
    capable = cap >= _PTX_MIN_CAPABILITY
    if convert == "ptx" and (ptx is None or not capable):
        raise ValueError(
            f"convert='ptx': {name} on SM {cap[0]}.{cap[1]} has no PTX conversion "
            f"(float8_e4m3fn/float8_e5m2 on SM 8.9+ only)"
        )
    return ptx if ptx is not None and capable else _CONVERT_INTEGER


@functools.cache
def _tiles(rows: int, width: int, *, per_row: bool, tuning: FP8WeightTuning) -> dict[str, int]:
    """Tile shape, loop counts and warps for regions ``rows`` deep (per_row: rows per program).

    Tiles hold at least 128 elements and every thread at least 4 (the PTX conversion packs 4).
    """
    max_tile = tuning.row_tile if per_row else tuning.block_tile
    per_warp = tuning.row_elements_per_warp if per_row else tuning.block_elements_per_warp
    tile_c = max(16, min(_next_pow2(width), max_tile))
    tile_r = max(1, min(_next_pow2(rows), max_tile // tile_c))
    while tile_r * tile_c < 128:
        tile_r *= 2
    return dict(
        TILE_R=tile_r,
        TILE_C=tile_c,
        R_ITERS=1 if per_row else _cdiv(rows, tile_r),
        C_ITERS=_cdiv(width, tile_c),
        num_warps=max(1, min(_MAX_WARPS, tile_r * tile_c // per_warp)),
    )


def _next_pow2(n: int) -> int:
    return 1 << max(0, (max(n, 1) - 1).bit_length())


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _scale_strides(scale: Tensor) -> tuple[int, int]:
    if scale.ndim == 0:
        return 0, 0
    if scale.ndim == 1:
        return scale.stride(0), 0
    return scale.stride(0), scale.stride(1)


@dataclasses.dataclass(frozen=True, slots=True)
class _Plan:
    """Everything about one launch configuration that does not depend on the tensors' data.

    ``steps``: ``(grid, arguments after the five pointers, launch options, aux)`` per launch,
    where aux 1 passes the partial-maxima buffer as ``aux_ptr`` (else the scale tensor).
    """

    rows: int
    codes_dtype: torch.dtype
    scale_shape: tuple[int, ...]
    partials: int
    steps: tuple[tuple[tuple[int, int, int], tuple[Any, ...], dict[str, Any], int], ...]


_PLANS: dict[Any, _Plan] = {}
"""Plans by (shape, strides, dtype, device, format, layout, scale strides, options, tuning,
mode): computed once each, never replaced."""


def _amax_programs(device: torch.device, row_tiles: int, tuning: FP8WeightTuning) -> int:
    """Programs of the tensor layout's amax pass: a few per SM, each looping over row tiles."""
    if device.type == "cuda":
        sms = _sm_count(device.index if device.index is not None else torch.cuda.current_device())
    else:
        sms = 2  # the interpreter (CPU tensors): small enough that tests reach the strided loop
    return max(1, min(row_tiles, tuning.amax_programs_per_sm * sms, tuning.max_partials))


@functools.cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _layout_shape(
    method: str, block: tuple[int, int] | None, rows: int, cols: int
) -> tuple[int, ...]:
    if method == "tensor":
        return ()
    if method == "row":
        return (rows,)
    return (rows // block[0], cols // block[1])  # type: ignore[index]


def _make_plan(
    w: Tensor,
    name: str,
    method: str,
    block: tuple[int, int] | None,
    scale_strides: tuple[int, int],
    *,
    direct: bool,
    check: bool,
    convert: str | None,
    rows: int,
    tuning: FP8WeightTuning,
) -> _Plan:
    rows_valid, cols = w.shape
    per_row = method == "row" or (method == "block" and block[0] == 1)  # type: ignore[index]
    scale_shape = _layout_shape(method, block, rows, cols)
    mant, bias, fnuz = _format_bits(name)
    constants = dict(
        FMAX=fp8_max(name),
        FLT_MAX=FLOAT32_MAX,
        TINY_BITS=_TINY_BITS,
        DIRECT=direct,
        CHECK=check,
        CONVERT=_conversion(name, w.device, convert),
        MANT=mant,
        BIAS=bias,
        FNUZ=fnuz,
    )
    dims = (rows, rows_valid, cols, w.stride(0), w.stride(1), *scale_strides)

    def step(grid: int, ints: tuple[int, ...], mode: int, per: bool, p_block: int, aux: int,
             tiles: dict[str, int]) -> tuple[Any, ...]:  # fmt: skip
        tiles = dict(tiles)
        options = {"num_warps": tiles.pop("num_warps")}
        named = dict(constants, MODE=mode, PER_ROW=per, P_BLOCK=p_block, **tiles)
        tail = (*dims, *ints, *(named[k] for k in _CONSTEXPR_ORDER))
        return ((grid, 1, 1), tail, options, aux)

    partials = 0
    if per_row:
        width = cols if method == "row" else block[1]  # type: ignore[index]
        groups = cols // width
        tiles = _tiles(rows, width, per_row=True, tuning=tuning)
        grid = _cdiv(rows, tiles["TILE_R"]) * groups
        steps = (step(grid, (1, width, groups, 0, 0), _MODE_FULL, True, 0, 0, tiles),)
    elif method == "block":
        br, bc = block  # type: ignore[misc]
        tiles = _tiles(br, bc, per_row=False, tuning=tuning)
        grid = (rows // br) * (cols // bc)
        steps = (step(grid, (br, bc, cols // bc, 0, 0), _MODE_FULL, False, 0, 0, tiles),)
    elif rows * cols <= tuning.tensor_one_program:
        tiles = _tiles(rows, cols, per_row=False, tuning=tuning)
        steps = (step(1, (rows, cols, 1, 0, 0), _MODE_FULL, False, 0, 0, tiles),)
    else:
        # Two launches: a few programs per SM take the amax of strided row tiles, then one
        # program per row tile reduces those partial maxima itself and quantizes.
        tiles = _tiles(rows, cols, per_row=True, tuning=tuning)
        row_tiles = _cdiv(rows, tiles["TILE_R"])
        partials = _amax_programs(w.device, row_tiles, tuning)
        ints = (1, cols, 1, partials, _cdiv(row_tiles, partials))
        steps = (
            step(partials, ints, _MODE_AMAX, True, 0, 1, tiles),
            step(row_tiles, ints, _MODE_GIVEN, True, _next_pow2(partials), 1, tiles),
        )
    return _Plan(rows, getattr(torch, name), scale_shape, partials, steps)


def _launch(
    w: Tensor,
    name: str,
    method: str,
    block: tuple[int, int] | None,
    *,
    scale_out: Tensor | None = None,
    direct: bool = False,
    convert: str | None = None,
    rows_out: int | None = None,
    flag: Tensor | None = None,
    tuning: FP8WeightTuning = DEFAULT_WEIGHT_TUNING,
) -> tuple[Tensor, Tensor]:
    """Codes and scales of a validated 2-D ``w``; no checks beyond shapes (see the callers).

    ``scale_out`` (FP32, the layout's shape, any strides) receives the scales when given; with
    ``direct`` they are ``1 / scale_inv`` (decode by multiplying), else ``scale_inv``.
    ``rows_out`` (row and ``(1, bc)`` layouts) pads the result with rows of zeros (codes 0,
    scale 1) without copying ``w``. ``flag`` (one int32 holding 0, on the device or in pinned
    host memory) is set to 1 by the kernel when ``w`` holds NaN or ±inf; without it nothing is
    checked. The caller reads it once the launch has finished.

    Host cost: the launch configuration is computed once per shape, strides, dtype and options
    (``_PLANS``), and Triton binds the arguments once per configuration and alignment
    (:class:`CachedLauncher`); a repeated call allocates its outputs and launches.
    """
    interpret = triton_interpret_enabled()
    if w.dtype not in _KERNEL_INPUT_DTYPES or (interpret and w.dtype != torch.float32):
        # (The interpreter's bf16 -> fp32 cast flushes subnormals; torch's is exact.)
        w = w.to(torch.float32)
    rows_valid, cols = w.shape
    rows = rows_valid if rows_out is None else rows_out
    device = w.device
    scale_strides = (0, 0) if scale_out is None else _scale_strides(scale_out)
    check = flag is not None
    key = (
        w.shape, w.stride(), w.dtype, device, name, method, block, scale_strides, direct, check,
        convert, rows, interpret,
        # (hashing a record field by field costs microseconds: the default is keyed by None)
        None if tuning is DEFAULT_WEIGHT_TUNING else tuning,
    )  # fmt: skip
    plan = _PLANS.get(key)
    if plan is None:
        per_row = method == "row" or (method == "block" and block[0] == 1)  # type: ignore[index]
        if rows < rows_valid or (rows != rows_valid and not per_row):
            raise ValueError(
                f"_launch: rows_out={rows_out} needs a per-row layout and >= {rows_valid}"
            )
        if w.numel() == 0:  # every region is empty: amax 0, codes 0, scale 1
            codes = torch.zeros((rows, cols), dtype=torch.uint8, device=device)
            if scale_out is None:
                shape = _layout_shape(method, block, rows, cols)
                scale_out = torch.empty(shape, dtype=torch.float32, device=device)
            return codes.view(getattr(torch, name)), scale_out.fill_(1.0)
        if scale_out is None:
            # the scale tensor this call allocates is contiguous: plan with its strides
            shape = _layout_shape(method, block, rows, cols)
            scale_strides = _scale_strides(torch.empty(shape, device="meta"))
        plan = _make_plan(
            w, name, method, block, scale_strides, direct=direct, check=check, convert=convert,
            rows=rows, tuning=tuning,
        )  # fmt: skip
        _PLANS[key] = plan
    codes = torch.empty((plan.rows, cols), dtype=plan.codes_dtype, device=device)
    if scale_out is None:
        scale_out = torch.empty(plan.scale_shape, dtype=torch.float32, device=device)
    partials = (
        torch.empty(plan.partials, dtype=torch.float32, device=device) if plan.partials else None
    )
    launcher = _launcher(interpret)
    flag_arg = flag if flag is not None else scale_out  # (CHECK off: never read or written)
    aligned = tuple(t.data_ptr() % 16 == 0 for t in (w, scale_out, flag_arg))
    guard, index = launch_device(device)
    with guard:
        for i, (grid, tail, options, aux) in enumerate(plan.steps):
            args = (
                w, codes.view(torch.int8), scale_out, partials if aux else scale_out, flag_arg,
                *tail,
            )  # fmt: skip
            launcher((key, i, aligned), grid, args, options, index)
    return codes, scale_out


def quantize_fp8_weight_kernel(
    weight: Float[Tensor, "out in"],
    *,
    format: str | torch.dtype = "float8_e4m3fn",
    weight_scale_method: FP8ScaleMethod | None = "row",
    weight_block_size: tuple[int, int] | list[int] | None = None,
    tuning: FP8WeightTuning = DEFAULT_WEIGHT_TUNING,
) -> FP8Weight:
    """Triton version of :func:`floatxq.quantize_fp8_weight`: the same bytes, on the GPU.

    Args:
      weight: ``(out, in)`` floating CUDA tensor (fp16/bf16/fp32 read directly; fp64 and other
        floating dtypes go through FP32 first, as the pure function does). Any strides.
      format: FP8 name/alias; ``float8_e8m0fnu`` is decode-only (``ValueError``).
      weight_scale_method: ``"tensor"``, ``"row"`` or ``"block"`` (``None``: by block size).
      weight_block_size: ``[block_rows, block_cols]`` for ``"block"``; must divide the shape.
      tuning: how programs are shaped (:class:`FP8WeightTuning`); never changes the bytes.

    Returns:
      ``FP8Weight(qweight, scale_inv)`` on ``weight``'s device, bit-identical to
      ``quantize_fp8_weight`` with the same arguments.

    Raises:
      ValueError, TypeError: as :func:`floatxq.quantize_fp8_weight`. Argument errors come
        first; a non-finite weight is found by the kernel itself (one flag, read once the launch
        has finished: the call waits for the GPU), and nothing is returned then. A tensor that
        is not on CUDA gives ``TypeError`` (any device is taken under TRITON_INTERPRET=1).
      RuntimeError: Triton is not importable.

    Numerics: FP32 IEEE division (``div.rn``), amax floored at FLT_MIN and ``scale_inv`` capped at
    FLT_MAX, multiply-to-quantize, clamp to ±max, one nearest-even conversion (PTX
    ``cvt.rn.satfinite`` for E4M3/E5M2 on SM 8.9+, an integer encoder otherwise).

    Example:
      >>> q = quantize_fp8_weight_kernel(torch.randn(256, 512, device="cuda"))  # doctest: +SKIP
      >>> q.scale_inv.shape  # doctest: +SKIP
      torch.Size([256])
    """
    where = "quantize_fp8_weight_kernel"
    name, method, block = _weight_arguments(
        weight,
        format=format,
        weight_scale_method=weight_scale_method,
        weight_block_size=weight_block_size,
        where=where,
    )
    w = weight if weight.dtype in _KERNEL_INPUT_DTYPES[:3] else weight.to(torch.float32)
    if method == "block":
        rows, cols = w.shape
        br, bc = block  # type: ignore[misc]
        if rows % br or cols % bc:
            require_finite(w, name="weight", where=where)  # the pure function checks this first
            raise ValueError(
                f"{where}: weight shape {tuple(w.shape)} is not divisible by weight_block_size "
                f"{[br, bc]} (block rows index output rows); floatxq never pads"
            )
    if triton_unavailable_reason(w.device) is not None:
        require_finite(w, name="weight", where=where)  # report bad values before the setup
    import_triton(where=where)
    if w.device.type != "cuda" and not triton_interpret_enabled():
        raise TypeError(
            f"{where}: weight is on {w.device}; the kernel needs a CUDA tensor (use "
            f"floatxq.quantize_fp8_weight or floatxq.quantize_fp8_weight_auto instead)"
        )
    # The flag lives in pinned host memory: the kernel writes it over the bus only when it
    # finds a non-finite value, so reading it needs no copy launch, only the end of the kernel.
    flag = torch.zeros(1, dtype=torch.int32, pin_memory=w.is_cuda)
    codes, scale_inv = _launch(w, name, method, block, flag=flag, tuning=tuning)
    if w.is_cuda:
        torch.cuda.current_stream(w.device).synchronize()
    if flag.item():
        raise ValueError(f"{where}: weight contains NaN or infinity; finite values are required")
    return FP8Weight(codes, scale_inv)


def _quantize_direct_torch(
    x: Tensor, name: str, method: str, block: tuple[int, int] | None
) -> tuple[Tensor, Tensor]:
    """The kernel's ``direct=True`` result through :mod:`floatxq.fp8`'s own helpers (no Triton)."""
    fmax, dtype = fp8_max(name), getattr(torch, name)
    x32 = x.to(torch.float32)
    if method == "tensor":
        inv = _inverse_scale(_amax(x32, None), fmax)
        codes = _saturating_cast(x32 * inv, dtype, fmax)
    elif method == "row":
        inv = _inverse_scale(_amax(x32, (1,)), fmax)
        codes = _saturating_cast(x32 * inv[:, None], dtype, fmax)
    else:
        rows, cols = x32.shape
        br, bc = block  # type: ignore[misc]
        blocks = x32.reshape(rows // br, br, cols // bc, bc)
        inv = _inverse_scale(_amax(blocks, (1, 3)), fmax)
        codes = _saturating_cast(blocks * inv[:, None, :, None], dtype, fmax).reshape(rows, cols)
    return codes, fp32_reciprocal(inv)


def quantize_fp8_input(
    x: Float[Tensor, "rows k"],
    *,
    format: str,
    method: Literal["tensor", "row", "block"],
    block: tuple[int, int] | None,
    scale_out: Float32[Tensor, "*scale"],
    rows_out: int | None = None,
    tuning: FP8WeightTuning = DEFAULT_WEIGHT_TUNING,
) -> Shaped[Tensor, "padded k"]:
    """Quantize activations for ``scaled_mm``: codes returned, DIRECT scales into ``scale_out``.

    The same formula as the weights (``scale_inv = fp8_max / max(amax, FLT_MIN)``), written as the
    direct scale ``1 / scale_inv`` that ``scaled_mm`` multiplies by, into ``scale_out`` whatever
    its strides (e.g. the column-major ``(M, K/128)`` grid of blockwise scaling). Used by
    :class:`floatxq.nn.TorchFP8Linear`; it skips the finiteness check (no host sync): non-finite
    input gives NaN codes, as the torch formula does.

    Args:
      x: ``(rows, k)`` activations (any floating dtype), names already canonical.
      format: canonical encodable FP8 name.
      method: ``"tensor"``, ``"row"`` or ``"block"``.
      block: the block size for ``"block"`` (dividing ``x``), else ``None``.
      scale_out: FP32 tensor of the layout's shape (for ``rows_out`` rows) on ``x``'s device.
      rows_out: pad the result to this many rows (zero codes, scale 1); per-row layouts only.
      tuning: how the kernel's programs are shaped (:class:`FP8WeightTuning`).

    Returns:
      the FP8 codes of ``x`` (``rows_out`` rows when given).

    Numerics: codes bit-identical to ``quantize_fp8_weight(x, ...)`` (of ``x`` padded with zero
    rows); scales are the IEEE quotient ``1 / scale_inv`` (Triton on CUDA when it imports, the
    pure helpers otherwise).
    """
    if x.is_cuda and triton_available():
        codes, _ = _launch(
            x, format, method, block, scale_out=scale_out, direct=True, rows_out=rows_out,
            tuning=tuning,
        )  # fmt: skip
        return codes
    if rows_out is not None and rows_out != x.shape[0]:
        x = torch.nn.functional.pad(x, (0, 0, 0, rows_out - x.shape[0]))
    codes, scale = _quantize_direct_torch(x, format, method, block)
    scale_out.copy_(scale.reshape(scale_out.shape))
    return codes
