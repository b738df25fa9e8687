"""Triton twin of :func:`floatxq.quantize_fp8_weight`: the same bytes, one launch per layout.

``quantize_fp8_weight_kernel`` returns exactly what ``quantize_fp8_weight`` returns (codes and
FP32 inverse scales, bit for bit, with the same validation errors) for CUDA tensors. Each program
owns whole scale regions, so the two passes of the contract (amax per region, then
scale + clamp + convert) run inside one program and the second pass reads from registers or L2:

* ``row`` and ``(1, bc)`` blocks: a program takes a few rows of one column group; per-row amax.
* ``(br, bc)`` blocks with ``br > 1``: a program takes one block.
* ``tensor``: one program for up to 65536 elements; otherwise two launches: a few programs per
  SM each take the amax of strided row tiles, then one program per row tile takes the max of
  those partial maxima itself and quantizes, last tile first (the rows the first pass read last
  may still be in L2). Max is exact in any order, so the bytes never depend on the split.

Numerics, mirroring :mod:`floatxq.fp8` without re-deriving it:

* amax compares IEEE bit patterns (``bits & 0x7FFFFFFF``), so subnormals count exactly;
* ``scale_inv = fp8_max / max(amax, FLT_MIN)`` with ``tl.math.div_rn`` (IEEE division, never a
  reciprocal multiply), then capped at ``FLT_MAX``; an all-zero region gets 1;
* codes: ``w * scale_inv`` in FP32, clamped to ±fp8_max (NaN kept), then converted with one
  round-to-nearest-even step: the PTX ``cvt.rn.satfinite.{e4m3x2,e5m2x2}.f32`` instruction on
  SM 8.9+ for ``float8_e4m3fn``/``float8_e5m2``, or an integer RNE encoder for every other case
  (the ``fnuz`` formats, older GPUs, and ``TRITON_INTERPRET=1``, whose own float8 cast is not
  nearest-even for small values). Neither goes through FP16, so there is no double rounding.
  (On an H200, Triton 3.6's own ``.to(tl.float8e4nv)`` also matched torch on every bf16 value
  and every E4M3 midpoint; the kernel does not rely on that.)

Under ``TRITON_INTERPRET=1`` (CPU tensors, for tests) bf16/fp16 inputs are widened to FP32 by
torch first, because the interpreter's own widening flushes subnormals.

Triton is imported on the first launch; importing this module needs neither Triton nor CUDA.
"""

import dataclasses
import functools
import inspect
import re
import struct
from typing import Any

import torch

from floatxq._typing import Float, Float32, Shaped, Tensor
from floatxq.formats import (
    FLOAT32_MAX,
    FLOAT32_TINY,
    fp8_max,
)
from floatxq.fp8 import (
    FP8Weight,
    _amax,
    _inverse_scale,
    _require_finite,
    _saturating_cast,
    _weight_arguments,
)
from floatxq.kernels._triton import (
    CachedLauncher,
    import_triton,
    launch_device,
    triton_available,
    triton_interpret_enabled,
    triton_unavailable_reason,
)

__all__ = ["quantize_fp8_weight_kernel"]

tl: Any = None
"""``triton.language``, bound on the first launch (the kernel source below refers to it)."""


class constexpr:
    """Parameter marker for the kernel below: Triton reads annotations by name (``constexpr``),
    so this stands in for ``tl.constexpr`` while Triton is not imported yet."""


_MODE_FULL, _MODE_AMAX, _MODE_GIVEN = 0, 1, 2
_CONSTEXPR_ORDER = (
    "FMAX", "FLT_MAX", "TINY_BITS", "MODE", "PER_ROW", "DIRECT", "CONVERT", "MANT", "BIAS",
    "FNUZ", "TILE_R", "TILE_C", "R_ITERS", "C_ITERS", "P_BLOCK",
)  # fmt: skip
"""The kernel's constexpr parameters in signature order (every launch passes them by position)."""
_CONVERT_PTX_E4M3, _CONVERT_PTX_E5M2, _CONVERT_INTEGER = 0, 1, 2
_PTX_CONVERT = {"float8_e4m3fn": _CONVERT_PTX_E4M3, "float8_e5m2": _CONVERT_PTX_E5M2}
_PTX_MIN_CAPABILITY = (8, 9)
"""``cvt.rn.satfinite.{e4m3x2,e5m2x2}.f32`` exists from SM 8.9 (PTX ISA 7.8)."""

_MAX_TILE = 16384
"""Largest tile (elements) a program holds; a 128×128 block or an 8192-wide row fits whole."""
_TENSOR_ONE_PROGRAM = 1 << 16
"""Tensor-scaled inputs up to this many elements run as a single program (one launch)."""
_IN_KERNEL_PARTIALS = 1024
"""Tensor scaling: at most this many amax programs (each quantize program reduces their maxima)."""
_AMAX_PROGRAMS_PER_SM = 4
"""Tensor scaling: amax-pass programs per SM (swept on the H200, see benchmarks/RESULTS.md: 4 was
1-2 us faster than 2 at 2048-16384 rows of 8192, 6 and 8 slower)."""
_KERNEL_INPUT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)

_TINY_BITS = struct.unpack("<I", struct.pack("<f", FLOAT32_TINY))[0]
"""Bit pattern of FLT_MIN: the amax floor, applied to bit patterns (0x00800000)."""


def _fp8_encode(y, CONVERT: constexpr, MANT: constexpr, BIAS: constexpr, FNUZ: constexpr):
    """int8 FP8 codes of FP32 ``y`` (clamped to ±fp8_max, NaN kept) with one nearest-even step.

    CONVERT 0/1: the PTX ``cvt.rn.satfinite.{e4m3x2,e5m2x2}.f32`` instruction; 2: an integer
    encoder into (MANT, BIAS, FNUZ). Jitted on the first launch and called by every FP8 kernel
    that writes codes, so their codes cannot drift apart.
    """
    if CONVERT == 0:
        code = tl.inline_asm_elementwise(
            "{ .reg .b16 lo, hi;\n"
            "cvt.rn.satfinite.e4m3x2.f32 lo, $2, $1;\n"
            "cvt.rn.satfinite.e4m3x2.f32 hi, $4, $3;\n"
            "mov.b32 $0, {lo, hi}; }",
            "=r,r,r,r,r",
            [y],
            dtype=tl.int8,
            is_pure=True,
            pack=4,
        )
    elif CONVERT == 1:
        code = tl.inline_asm_elementwise(
            "{ .reg .b16 lo, hi;\n"
            "cvt.rn.satfinite.e5m2x2.f32 lo, $2, $1;\n"
            "cvt.rn.satfinite.e5m2x2.f32 hi, $4, $3;\n"
            "mov.b32 $0, {lo, hi}; }",
            "=r,r,r,r,r",
            [y],
            dtype=tl.int8,
            is_pure=True,
            pack=4,
        )
    else:
        # Integer round-to-nearest-even into (MANT, BIAS); |y| <= FMAX, so no overflow.
        bits = y.to(tl.int32, bitcast=True)
        sign = (bits >> 31) & 1
        a = bits & 0x7FFFFFFF
        # normal range: round the FP32 mantissa to MANT bits, then re-bias
        kept = (a + ((1 << (22 - MANT)) - 1) + ((a >> (23 - MANT)) & 1)) >> (23 - MANT)
        normal = kept - ((127 - BIAS) << MANT)
        # subnormal range: the code is round(|y| / 2**(1 - BIAS - MANT))
        mant = (a & 0x7FFFFF) | 0x800000
        shift = tl.minimum(tl.maximum((151 - BIAS - MANT) - (a >> 23), 1), 25)
        sub = (mant + (1 << (shift - 1)) - 1 + ((mant >> shift) & 1)) >> shift
        mag = tl.where(a >= ((128 - BIAS) << 23), normal, sub)
        if FNUZ:
            code32 = tl.where(mag == 0, 0, mag | (sign << 7))
            code32 = tl.where(a > 0x7F800000, 0x80, code32)
        else:
            code32 = tl.where(a > 0x7F800000, 0x7F, mag) | (sign << 7)
        code = code32.to(tl.int8)
    return code


def _fp8_quantize_kernel(
    w_ptr,
    q_ptr,
    s_ptr,
    aux_ptr,
    rows,
    rows_valid,
    cols,
    stride_wr,
    stride_wc,
    stride_sr,
    stride_sc,
    region_rows,
    region_cols,
    n_groups,
    n_partials,
    n_iters,
    FMAX: constexpr,
    FLT_MAX: constexpr,
    TINY_BITS: constexpr,
    MODE: constexpr,
    PER_ROW: constexpr,
    DIRECT: constexpr,
    CONVERT: constexpr,
    MANT: constexpr,
    BIAS: constexpr,
    FNUZ: constexpr,
    TILE_R: constexpr,
    TILE_C: constexpr,
    R_ITERS: constexpr,
    C_ITERS: constexpr,
    P_BLOCK: constexpr,
):
    """One program quantizes whole scale regions (see the module docstring).

    PER_ROW: regions are ``(1, region_cols)``; the program takes TILE_R rows of column group
    ``pid % n_groups``; rows ``>= rows_valid`` read as zeros (padding: codes 0, scale 1).
    Otherwise the program takes region ``(pid // n_groups, pid % n_groups)`` of size
    ``(region_rows, region_cols)``. MODE 0 computes amax per region; MODE 1 (per-row tiles) only
    stores the amax (FP32) of row tiles ``pid + i * n_partials`` (``i < n_iters``) at
    ``aux_ptr[pid]`` (``n_partials`` programs); MODE 2 runs its programs last to first and
    takes the global amax as the max of ``aux_ptr[:n_partials]`` (P_BLOCK > 0) or
    ``aux_ptr[0]`` (P_BLOCK == 0). DIRECT stores ``1 / scale_inv`` instead of ``scale_inv``. A
    region spans R_ITERS × C_ITERS tiles (loop counts are compile-time constants); a one-tile
    region is loaded once.
    """
    pid = tl.program_id(0)
    if MODE == 2:
        # Last-to-first: the rows the amax pass read last may still sit in L2.
        pid = tl.num_programs(0) - 1 - pid
    pr = pid // n_groups
    pc = pid % n_groups
    if PER_ROW:
        r_start = pr * TILE_R
        r_stop = tl.minimum(r_start + TILE_R, rows)
    else:
        r_start = pr * region_rows
        r_stop = r_start + region_rows
    r_load = tl.minimum(r_stop, rows_valid)
    c_start = pc * region_cols
    c_stop = c_start + region_cols
    offs_r = tl.arange(0, TILE_R)
    offs_c = tl.arange(0, TILE_C)

    if R_ITERS * C_ITERS == 1 and MODE != 1:
        rr = r_start + offs_r
        cc = c_start + offs_c
        m = (rr < r_load)[:, None] & (cc < c_stop)[None, :]
        ptrs = w_ptr + rr.to(tl.int64)[:, None] * stride_wr + cc.to(tl.int64)[None, :] * stride_wc
        x_single = tl.load(ptrs, mask=m, other=0.0).to(tl.float32)

    # Pass 1: amax per region, on bit patterns (exact for subnormals, NaN sorts above inf).
    if MODE == 2:
        if P_BLOCK > 0:
            offs_p = tl.arange(0, P_BLOCK)
            parts = tl.load(aux_ptr + offs_p, mask=offs_p < n_partials, other=0.0)
            amax_bits = tl.max(parts.to(tl.int32, bitcast=True), axis=0)
        else:
            amax_bits = tl.load(aux_ptr).to(tl.int32, bitcast=True)
        acc = tl.zeros([TILE_R], dtype=tl.int32) + amax_bits
    elif MODE == 1:
        # Row tiles pid, pid + n_partials, ... (n_partials programs in all), elementwise max.
        wide = tl.zeros([TILE_R, TILE_C], dtype=tl.int32)
        i = 0
        while i < n_iters:  # (a while loop: the interpreter cannot range() over a runtime int)
            for j in range(C_ITERS):
                rr = (pid + i * n_partials) * TILE_R + offs_r
                cc = j * TILE_C + offs_c
                m = (rr < rows_valid)[:, None] & (cc < cols)[None, :]
                ptrs = w_ptr + rr.to(tl.int64)[:, None] * stride_wr
                ptrs += cc.to(tl.int64)[None, :] * stride_wc
                x = tl.load(ptrs, mask=m, other=0.0).to(tl.float32)
                wide = tl.maximum(wide, x.to(tl.int32, bitcast=True) & 0x7FFFFFFF)
            i += 1
        acc = tl.max(wide, axis=1)
    else:
        if R_ITERS * C_ITERS == 1:
            acc = tl.max(x_single.to(tl.int32, bitcast=True) & 0x7FFFFFFF, axis=1)
        else:
            acc = tl.zeros([TILE_R], dtype=tl.int32)
            for i in range(R_ITERS):
                for j in range(C_ITERS):
                    rr = r_start + i * TILE_R + offs_r
                    cc = c_start + j * TILE_C + offs_c
                    m = (rr < r_load)[:, None] & (cc < c_stop)[None, :]
                    ptrs = (
                        w_ptr
                        + rr.to(tl.int64)[:, None] * stride_wr
                        + cc.to(tl.int64)[None, :] * stride_wc
                    )
                    x = tl.load(ptrs, mask=m, other=0.0).to(tl.float32)
                    bits = x.to(tl.int32, bitcast=True) & 0x7FFFFFFF
                    acc = tl.maximum(acc, tl.max(bits, axis=1))
        if not PER_ROW:
            acc = tl.zeros([TILE_R], dtype=tl.int32) + tl.max(acc, axis=0)

    rows_here = r_start + offs_r
    if MODE == 1:
        tl.store(aux_ptr + pid, tl.max(acc, axis=0).to(tl.float32, bitcast=True))
    else:
        # scale_inv = fmax / max(amax, FLT_MIN), IEEE division, capped at FLT_MAX; 1 for amax 0.
        den = tl.maximum(acc, TINY_BITS).to(tl.float32, bitcast=True)
        inv = tl.math.div_rn(tl.full([TILE_R], FMAX, tl.float32), den)
        inv = tl.where(inv > FLT_MAX, FLT_MAX, inv)
        inv = tl.where(acc > 0, inv, 1.0)
        if DIRECT:
            scale = tl.math.div_rn(tl.full([TILE_R], 1.0, tl.float32), inv)
        else:
            scale = inv
        if MODE == 2:
            tl.store(s_ptr + offs_r * 0, scale, mask=(offs_r == 0) & (pid == 0))
        elif PER_ROW:
            s_ptrs = s_ptr + rows_here.to(tl.int64) * stride_sr + pc * stride_sc
            tl.store(s_ptrs, scale, mask=rows_here < r_stop)
        else:
            tl.store(s_ptr + pr * stride_sr + pc * stride_sc + offs_r * 0, scale, mask=offs_r == 0)

        # Pass 2: scale, clamp (NaN kept), convert with one nearest-even rounding.
        for i in range(R_ITERS):
            for j in range(C_ITERS):
                rr = r_start + i * TILE_R + offs_r
                cc = c_start + j * TILE_C + offs_c
                m = (rr < r_stop)[:, None] & (cc < c_stop)[None, :]
                if R_ITERS * C_ITERS == 1:
                    x = x_single
                else:
                    ptrs = (
                        w_ptr
                        + rr.to(tl.int64)[:, None] * stride_wr
                        + cc.to(tl.int64)[None, :] * stride_wc
                    )
                    x = tl.load(ptrs, mask=m & (rr < r_load)[:, None], other=0.0).to(tl.float32)
                y = x * inv[:, None]
                y = tl.where(y > FMAX, FMAX, tl.where(y < -FMAX, -FMAX, y))
                code = _fp8_encode(y, CONVERT, MANT, BIAS, FNUZ)
                q_ptrs = q_ptr + rr.to(tl.int64)[:, None] * cols + cc.to(tl.int64)[None, :]
                tl.store(q_ptrs, code, mask=m)


_BUILT: dict[bool, CachedLauncher] = {}
_LAST_COMPILED: list[Any] = [None]
"""The last launch's compiled kernel (its ``.asm["ptx"]`` is read by the benchmark's probe)."""


_ENCODE_SOURCE = _fp8_encode
_JITTED: dict[bool, Any] = {}
"""``triton.jit(_fp8_encode)`` per mode (compiled or interpreted)."""


def bind_triton(where: str) -> tuple[Any, Any]:
    """Import Triton and bind it where this module's kernel sources look it up (idempotent).

    Returns ``(triton, jitted _fp8_encode)`` for the current mode: other kernel modules bind the
    helper as their own global ``_fp8_encode`` so every kernel writes codes through it.
    """
    triton, language = import_triton(where=where)
    global tl, constexpr, _fp8_encode
    tl = language
    # The compiler resolves the parameter annotations in this module's globals: from now on
    # ``constexpr`` is Triton's own (the placeholder only served while Triton was absent).
    constexpr = language.constexpr
    interpret = triton_interpret_enabled()
    encode = _JITTED.get(interpret)
    if encode is None:
        # inspect.unwrap: the test run's jaxtyping hook wraps every floatxq function, and Triton
        # must see the plain function (its source and this module's globals).
        encode = _JITTED[interpret] = triton.jit(inspect.unwrap(_ENCODE_SOURCE))
    _fp8_encode = encode
    return triton, encode


def _launcher(interpret: bool) -> CachedLauncher:
    """The kernel for the mode (compiled, or interpreted under TRITON_INTERPRET)."""
    launcher = _BUILT.get(interpret)
    if launcher is None:
        triton, _ = bind_triton("quantize_fp8_weight_kernel")
        launcher = CachedLauncher(triton.jit(inspect.unwrap(_fp8_quantize_kernel)))
        _BUILT[interpret] = launcher
    return launcher


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
def _tiles(rows: int, width: int, *, per_row: bool) -> dict[str, int]:
    """Tile shape, loop counts and warps for regions ``rows`` deep (per_row: rows per program).

    Tiles hold at least 128 elements and every thread at least 4 (the PTX conversion packs 4).
    """
    # Swept on an H200 (8192² bf16 → E4M3, CUDA events, L2 flushed; bytes moved over a bf16
    # copy): per-row layouts peak with 8192-element tiles and a warp per 1024 elements (0.95×),
    # 128×128 blocks with 16384-element tiles and two warps per 1024 (0.86×).
    max_tile = _MAX_TILE // 2 if per_row else _MAX_TILE
    tile_c = max(16, min(_next_pow2(width), max_tile))
    tile_r = max(1, min(_next_pow2(rows), max_tile // tile_c))
    while tile_r * tile_c < 128:
        tile_r *= 2
    warps_per_1k = 1 if per_row else 2
    return dict(
        TILE_R=tile_r,
        TILE_C=tile_c,
        R_ITERS=1 if per_row else _cdiv(rows, tile_r),
        C_ITERS=_cdiv(width, tile_c),
        num_warps=max(1, min(16, tile_r * tile_c * warps_per_1k // 1024)),
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

    ``steps``: ``(grid, arguments after the four pointers, launch options, aux)`` per launch,
    where aux 1 passes the partial-maxima buffer as ``aux_ptr`` (else the scale tensor).
    """

    rows: int
    codes_dtype: torch.dtype
    scale_shape: tuple[int, ...]
    partials: int
    steps: tuple[tuple[tuple[int, int, int], tuple[Any, ...], dict[str, Any], int], ...]


_PLANS: dict[Any, _Plan] = {}
"""Plans by (shape, strides, dtype, device, format, layout, scale strides, options, mode)."""


def _amax_programs(device: torch.device, row_tiles: int) -> int:
    """Programs of the tensor layout's amax pass: a few per SM, each looping over row tiles."""
    if device.type == "cuda":
        sms = _sm_count(device.index if device.index is not None else torch.cuda.current_device())
    else:
        sms = 2  # the interpreter (CPU tensors): small enough that tests reach the strided loop
    return max(1, min(row_tiles, _AMAX_PROGRAMS_PER_SM * sms, _IN_KERNEL_PARTIALS))


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
    convert: str | None,
    rows: int,
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
        tiles = _tiles(rows, width, per_row=True)
        grid = _cdiv(rows, tiles["TILE_R"]) * groups
        steps = (step(grid, (1, width, groups, 0, 0), _MODE_FULL, True, 0, 0, tiles),)
    elif method == "block":
        br, bc = block  # type: ignore[misc]
        tiles = _tiles(br, bc, per_row=False)
        grid = (rows // br) * (cols // bc)
        steps = (step(grid, (br, bc, cols // bc, 0, 0), _MODE_FULL, False, 0, 0, tiles),)
    elif rows * cols <= _TENSOR_ONE_PROGRAM:
        tiles = _tiles(rows, cols, per_row=False)
        steps = (step(1, (rows, cols, 1, 0, 0), _MODE_FULL, False, 0, 0, tiles),)
    else:
        # Two launches: a few programs per SM take the amax of strided row tiles, then one
        # program per row tile reduces those partial maxima itself and quantizes.
        tiles = _tiles(rows, cols, per_row=True)
        row_tiles = _cdiv(rows, tiles["TILE_R"])
        partials = _amax_programs(w.device, row_tiles)
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
) -> tuple[Tensor, Tensor]:
    """Codes and scales of a validated 2-D ``w``; no checks beyond shapes (see the callers).

    ``scale_out`` (FP32, the layout's shape, any strides) receives the scales when given; with
    ``direct`` they are ``1 / scale_inv`` (decode by multiplying), else ``scale_inv``.
    ``rows_out`` (row and ``(1, bc)`` layouts) pads the result with rows of zeros (codes 0,
    scale 1) without copying ``w``.

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
    key = (
        w.shape, w.stride(), w.dtype, device, name, method, block, scale_strides, direct,
        convert, rows, interpret,
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
            w, name, method, block, scale_strides, direct=direct, convert=convert, rows=rows
        )
        _PLANS[key] = plan
    codes = torch.empty((plan.rows, cols), dtype=plan.codes_dtype, device=device)
    if scale_out is None:
        scale_out = torch.empty(plan.scale_shape, dtype=torch.float32, device=device)
    partials = (
        torch.empty(plan.partials, dtype=torch.float32, device=device) if plan.partials else None
    )
    launcher = _launcher(interpret)
    head = (w, codes.view(torch.int8), scale_out)
    aligned = (w.data_ptr() % 16 == 0, scale_out.data_ptr() % 16 == 0)
    guard, index = launch_device(device)
    with guard:
        for i, (grid, tail, options, aux) in enumerate(plan.steps):
            _LAST_COMPILED[0] = launcher(
                (key, i, aligned),
                grid,
                (*head, partials if aux else scale_out, *tail),
                options,
                index,
            )
    return codes, scale_out


def quantize_fp8_weight_kernel(
    weight: Float[Tensor, "out in"],
    *,
    format: Any = "float8_e4m3fn",
    weight_scale_method: Any = "row",
    weight_block_size: Any = None,
) -> FP8Weight:
    """Triton version of :func:`floatxq.quantize_fp8_weight`: the same bytes, on the GPU.

    Args:
      weight: ``(out, in)`` floating CUDA tensor (fp16/bf16/fp32 read directly; fp64 and other
        floating dtypes go through FP32 first, as the pure function does). Any strides.
      format: FP8 name/alias; ``float8_e8m0fnu`` is decode-only (``ValueError``).
      weight_scale_method: ``"tensor"``, ``"row"`` or ``"block"`` (``None``: by block size).
      weight_block_size: ``[block_rows, block_cols]`` for ``"block"``; must divide the shape.

    Returns:
      ``FP8Weight(qweight, scale_inv)`` on ``weight``'s device, bit-identical to
      ``quantize_fp8_weight`` with the same arguments.

    Raises:
      ValueError, TypeError: exactly as :func:`floatxq.quantize_fp8_weight` (checked first);
        then ``TypeError`` for a tensor that is not on CUDA (any device under TRITON_INTERPRET=1).
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
            _require_finite(w, name="weight", where=where)  # the pure function checks this first
            raise ValueError(
                f"{where}: weight shape {tuple(w.shape)} is not divisible by weight_block_size "
                f"{[br, bc]} (block rows index output rows); floatxq never pads"
            )
    if triton_unavailable_reason(w.device) is not None:
        _require_finite(w, name="weight", where=where)  # report bad values before the setup
    import_triton(where=where)
    if w.device.type != "cuda" and not triton_interpret_enabled():
        raise TypeError(
            f"{where}: weight is on {w.device}; the kernel needs a CUDA tensor (use "
            f"floatxq.quantize_fp8_weight or floatxq.kernels.quantize_fp8_weight_auto instead)"
        )
    codes, scale_inv = _launch(w, name, method, block)
    # Finite weights always give finite, positive scales (the floor and the cap); an inf makes
    # its region's scale 0 and a NaN makes it NaN. Checking the scales replaces a second full
    # pass over the weight.
    if scale_inv.numel() and not float(scale_inv.amin()) > 0:  # NaN fails the comparison
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
    return codes, torch.ones_like(inv) / inv


def quantize_fp8_input(
    x: Float[Tensor, "rows k"],
    *,
    format: str,
    method: str,
    block: tuple[int, int] | None,
    scale_out: Float32[Tensor, "*scale"],
    rows_out: int | None = None,
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

    Returns:
      the FP8 codes of ``x`` (``rows_out`` rows when given).

    Numerics: codes bit-identical to ``quantize_fp8_weight(x, ...)`` (of ``x`` padded with zero
    rows); scales are the IEEE quotient ``1 / scale_inv`` (Triton on CUDA when it imports, the
    pure helpers otherwise).
    """
    if x.is_cuda and triton_available():
        codes, _ = _launch(
            x, format, method, block, scale_out=scale_out, direct=True, rows_out=rows_out
        )
        return codes
    if rows_out is not None and rows_out != x.shape[0]:
        x = torch.nn.functional.pad(x, (0, 0, 0, rows_out - x.shape[0]))
    codes, scale = _quantize_direct_torch(x, format, method, block)
    scale_out.copy_(scale.reshape(scale_out.shape))
    return codes
