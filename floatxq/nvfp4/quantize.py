"""NVFP4: the FP32 global scale, the E4M3 block-scale search, quantize / dequantize / qdq.

An NVFP4 tensor is three things, each named by its direction (all multiply to decode):
  * ``codes``: E2M1 codes (:mod:`floatxq.nvfp4.e2m1`), two per byte when packed;
  * ``block_scales``: one E4M3 scale per 16 consecutive values of the last axis;
  * ``global_scale``: one FP32 scale; ``x ≈ e2m1(code) * float(block_scale) * global_scale``.

The scale search runs per 16-value block, vectorized over all blocks (chunked, so memory stays
bounded), in exactly the operation order ``docs/numerics.md`` fixes: it evaluates the block's
candidate scales (those mapping its largest magnitude onto E2M1's 6 or 4), then, by recipe,
least-squares refinements, a grid of neighbouring E4M3 codes, or every E4M3 scale. Every block sum
(the SSE and the two least-squares dot products) is a fixed pairwise tree, ``(i, i+8)``, then
``(i, i+4)``, ``(i, i+2)``, ``(i, i+1)``: one addition per step, so CPU, CUDA and the Triton twins
agree bit for bit. All division is IEEE FP32 division by a tensor (never ``tensor /
python_float``, which CUDA turns into a multiply by the rounded reciprocal).

The tensor-core layout of the block scales is :mod:`floatxq.nvfp4.swizzle`, activation calibration
:mod:`floatxq.nvfp4.headroom`, and the per-recipe quality report :mod:`floatxq.nvfp4.report`.
"""

import math
from typing import NamedTuple

import torch

from floatxq._checks import (
    real_scalar,
    require_data,
    require_e4m3_scales,
    require_finite,
    require_floating,
    require_tensor,
    to_float32,
)
from floatxq._typing import Float, Float8e4m3fn, Float32, Shaped, Tensor, UInt8, checked_record
from floatxq.formats import (
    FLOAT32_MAX,
    FLOAT32_SMALLEST_SUBNORMAL,
    FP8_E4M3_MAX,
    MODEL_DTYPES,
    NVFP4_BLOCK,
    NVFP4_DEFAULT_RECIPE,
    NVFP4_E4M3_SEARCH_RADIUS,
    NVFP4_SCALE_MAX,
    NVFP4_SCALE_MIN,
    NVFP4RecipeName,
    normalize_nvfp4_recipe,
    nvfp4_kernel_recipe,
    nvfp4_uses_headroom,
)
from floatxq.nvfp4.e2m1 import (
    _e2m1_index,
    _e2m1_value,
    _e2m1_value_,
    e2m1_decode,
    pack_e2m1,
    unpack_e2m1,
)

__all__ = [
    "NVFP4Blocks",
    "NVFP4Packed",
    "nvfp4_block_qdq",
    "nvfp4_block_scales",
    "nvfp4_block_sse",
    "nvfp4_dequantize",
    "nvfp4_global_scale",
    "nvfp4_quantize",
]


_E4M3 = torch.float8_e4m3fn
_E4M3_FIRST_CODE, _E4M3_LAST_CODE = 1, 126  # 2**-9 ... 448: every positive finite E4M3 value
_SEARCH_CHUNK_BLOCKS = 1 << 15  # blocks per vectorized step: ~2 MiB per [chunk, 16] FP32 temporary
_SCAN_PAIRS = 1 << 14  # (block, scale) pairs per scan step: ~1 MiB per [pairs, 16] FP32 temporary
_GRID_DTYPES = MODEL_DTYPES  # the grids a global scale may be rounded through
_WINDOW_G_MIN, _WINDOW_G_MAX = 2.0**-110, 2.0**100  # every scale·g is a normal FP32 number
_WIDTH_BUCKETS = ((0, 7), (8, 15), (16, 23), (24, 31), (32, 47), (48, 125))  # window widths


@checked_record
class NVFP4Blocks(NamedTuple):
    """Unpacked result of the scale search."""

    codes: UInt8[Tensor, "*b k"]
    """E2M1 codes, one per element (sign bit 3 set iff the input element is < 0)."""
    block_scales: Float8e4m3fn[Tensor, "*b k//16"]
    """One E4M3 scale per 16 elements of the last axis: multiply to decode."""
    global_scale: Float32[Tensor, ""]
    """Multiply to decode."""


@checked_record
class NVFP4Packed(NamedTuple):
    """Packed NVFP4: two codes per byte, even element in the low nibble."""

    packed: UInt8[Tensor, "*b half"]
    """Two E2M1 codes per byte (``half = k / 2``)."""
    block_scales: Float8e4m3fn[Tensor, "*b half//8"]
    """One E4M3 scale per 16 elements of the last axis: multiply to decode."""
    global_scale: Float32[Tensor, ""]
    """Multiply to decode."""


# ----------------------------------------------------------------------------------------------
# Validation shared by the NVFP4 entry points (and the headroom calibration)
# ----------------------------------------------------------------------------------------------


def _blocks_of(x: Tensor, *, where: str) -> Tensor:
    """``x`` as FP32 ``[n, 16]`` blocks of its last axis, after checking dtype, K and finiteness."""
    require_floating(x, name="x", where=where)
    require_data(x, name="x", where=where)
    if x.ndim == 0 or x.shape[-1] % NVFP4_BLOCK:
        raise ValueError(
            f"{where}: the last axis (K) of x must be divisible by {NVFP4_BLOCK}, got shape "
            f"{tuple(x.shape)}"
        )
    x32 = to_float32(x, name="x", where=where)
    require_finite(x32, name="x", where=where)
    return x32.reshape(-1, NVFP4_BLOCK)


def _validated_global_scale(global_scale: object, device: torch.device, *, where: str) -> Tensor:
    """One positive finite real number (a Python number or a one-element floating tensor) as a
    0-d FP32 tensor on ``device``."""
    g = real_scalar(global_scale, name="global_scale", where=where, device=device)
    if not bool(torch.isfinite(g) & (g > 0)):
        raise ValueError(f"{where}: global_scale must be positive and finite, got {g.item()!r}")
    return g


def _require_block_scales(block_scales: object, *, where: str) -> None:
    require_tensor(block_scales, name="block_scales", where=where)
    if block_scales.dtype != _E4M3:
        raise TypeError(f"{where}: block_scales must be float8_e4m3fn, got {block_scales.dtype}")
    require_data(block_scales, name="block_scales", where=where)


def _saturated(y32: Tensor, dtype: torch.dtype, *, where: str) -> Tensor:
    """FP32 values rounded once to ``dtype`` after clamping to its largest finite magnitude.

    A decoded value can exceed the output's range even when the input did not (fp16's 65504
    decodes to 6 * 448 * g with ``g`` rounded up on the fp16 grid): it saturates instead of
    rounding to ±inf, so finite input gives finite output.
    """
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(f"{where}: dtype must be a floating torch.dtype, got {dtype!r}")
    limit = min(float(torch.finfo(dtype).max), FLOAT32_MAX)
    return y32.clamp(-limit, limit).to(dtype)


# ----------------------------------------------------------------------------------------------
# Global scale
# ----------------------------------------------------------------------------------------------


def _divisor(recipe: str) -> float:
    """6 for ``nvidia`` and the headroom recipes, else 4: the E2M1 value the amax lands on."""
    local = nvfp4_kernel_recipe(recipe)  # raises the ValueError for an unknown name
    return 6.0 if local == "nvidia" or nvfp4_uses_headroom(recipe) else 4.0


def nvfp4_global_scale(
    amax: Float[Tensor, ""] | float,
    *,
    grid_dtype: torch.dtype | None = None,
    recipe: NVFP4RecipeName = NVFP4_DEFAULT_RECIPE,
) -> Float32[Tensor, ""]:
    """The FP32 global scale that maps ``amax`` onto the top of the E4M3 × E2M1 range.

    ``amax / (448 * d)`` (one FP32 division by 2688 or 1792) for ``amax > 0``, else 1, with
    ``d = 6`` for ``nvidia`` and the headroom recipes and ``d = 4`` otherwise (so the amax→4
    candidate of the largest block lands at block scale 448 and value 6 stays as headroom). A
    positive ``amax`` whose quotient underflows (below about ``2.5e-42``) gets FP32's smallest
    subnormal ``2**-149``, so tiny finite tensors still quantize (never a scale of 0).

    Args:
      amax: the tensor's largest magnitude (finite, ≥ 0).
      grid_dtype: round the result through fp16/bf16/fp32 (the runtime passes the activation
        dtype); a value that rounds to 0 keeps its FP32 value.
      recipe: an NVFP4 recipe name (legacy aliases accepted).

    Raises:
      ValueError: non-finite or negative ``amax`` (or one beyond FP32's range), an ``amax``
        tensor of several values, another ``grid_dtype``, an unknown recipe.
      TypeError: an ``amax`` that is not a real number or a floating tensor (strings, bools).

    Numerics: IEEE FP32 division; optional nearest-even rounding through ``grid_dtype`` (fp16
    overflow gives +inf, as GPT-QModel's does); returns a 0-d FP32 tensor on ``amax``'s device.

    Example:
      >>> nvfp4_global_scale(torch.tensor(1792.0)).item(), nvfp4_global_scale(0.0).item()
      (1.0, 1.0)
    """
    divisor = _divisor(recipe)
    if grid_dtype is not None and grid_dtype not in _GRID_DTYPES:
        raise ValueError(
            f"nvfp4_global_scale: grid_dtype must be torch.float16, torch.bfloat16 or "
            f"torch.float32, got {grid_dtype}"
        )
    device = amax.device if isinstance(amax, torch.Tensor) else torch.device("cpu")
    v = real_scalar(amax, name="amax", where="nvfp4_global_scale", device=device)
    if not bool(torch.isfinite(v) & (v >= 0)):
        raise ValueError(f"nvfp4_global_scale: amax must be finite and >= 0, got {v.item()!r}")
    return _scale_of_amax(v, divisor, grid_dtype)


def _scale_of_amax(v: Tensor, divisor: float, grid_dtype: torch.dtype | None) -> Tensor:
    """``v / (448 · divisor)`` for ``v > 0`` (at least FP32's smallest subnormal: a positive
    ``amax`` below about ``2.5e-42`` would otherwise divide to 0), else 1; then the optional
    rounding through ``grid_dtype`` (a value that rounds to 0 keeps its FP32 value)."""
    quotient = (v / torch.full_like(v, FP8_E4M3_MAX * divisor)).clamp_min(
        FLOAT32_SMALLEST_SUBNORMAL
    )
    scale = torch.where(v > 0, quotient, torch.ones_like(v))
    if grid_dtype is not None:
        rounded = scale.to(grid_dtype).to(torch.float32)
        scale = torch.where(rounded > 0, rounded, scale)
    return scale


def _device_global_scale(
    amax: Tensor, *, grid_dtype: torch.dtype | None, recipe: str
) -> Float32[Tensor, ""]:
    """:func:`nvfp4_global_scale` of an ``amax`` tensor without reading it on the host (no
    checks: a non-finite ``amax`` gives a non-finite scale, which the kernels mark as NaN)."""
    return _scale_of_amax(amax.to(torch.float32), _divisor(recipe), grid_dtype)


def nvfp4_dynamic_global_scale(
    x: Float[Tensor, "*shape"], *, recipe: NVFP4RecipeName = NVFP4_DEFAULT_RECIPE
) -> Float32[Tensor, ""]:
    """The dynamic global scale of a whole activation tensor, computed where ``x`` lives.

    :func:`nvfp4_global_scale` of ``max|x|`` over every element, rounded through ``x.dtype``'s
    grid when it is float16, bfloat16 or float32; 1 for an empty ``x``. Every dynamic NVFP4
    activation (the W4A modules, the activation stream, its replay) takes its scale from here.

    Raises:
      ValueError: an unknown recipe. No host read: a non-finite ``x`` gives a non-finite scale
      (callers that must refuse it check ``x`` first).

    Numerics: the maximum is exact; one IEEE FP32 division by ``448·6`` or ``448·4``; one
    nearest-even rounding through ``x.dtype``'s grid (a result that rounds to 0 keeps its FP32
    value). Equal to ``nvfp4_global_scale(x.abs().amax(), grid_dtype=x.dtype, recipe=recipe)``.

    Example:
      >>> nvfp4_dynamic_global_scale(torch.full((2, 16), 1792.0)).item()
      1.0
    """
    if x.numel() == 0:
        return torch.ones((), dtype=torch.float32, device=x.device)
    amax = x.detach().abs().amax().to(torch.float32)
    grid = x.dtype if x.dtype in _GRID_DTYPES else None
    return _device_global_scale(amax, grid_dtype=grid, recipe=normalize_nvfp4_recipe(recipe))


def _resolve_global_scale(
    x: Tensor, global_scale: Tensor | float | None, recipe: str, *, where: str
) -> Tensor:
    if global_scale is None:  # checked: an amax beyond FP32's range is refused, not inf
        amax = x.abs().amax().to(torch.float32) if x.numel() else torch.zeros((), device=x.device)
        grid = x.dtype if x.dtype in _GRID_DTYPES else None
        return nvfp4_global_scale(amax, grid_dtype=grid, recipe=recipe)
    return _validated_global_scale(global_scale, x.device, where=where)


# ----------------------------------------------------------------------------------------------
# The scale search
# ----------------------------------------------------------------------------------------------


def _tree_sum16(x: Tensor) -> Tensor:
    """Sum the last axis of 16 in the fixed order (i, i+8), (i, i+4), (i, i+2), (i, i+1)."""
    x = x[..., :8] + x[..., 8:]
    x = x[..., :4] + x[..., 4:]
    x = x[..., :2] + x[..., 2:]
    return x[..., 0] + x[..., 1]


def _tree_sum16_lead(x: Tensor) -> Tensor:
    """:func:`_tree_sum16` of the first axis (16 long): the same additions on contiguous halves."""
    x = x[:8] + x[8:]
    x = x[:4].add_(x[4:])
    x = x[:2].add_(x[2:])
    return x[0] + x[1]


def _clamped_scale(t: Tensor, valid: Tensor) -> Tensor:
    """The FP32 value of E4M3 (nearest-even) of ``clamp(t, 2**-9, 448)`` where ``valid``, else 1."""
    clamped = t.clamp(NVFP4_SCALE_MIN, NVFP4_SCALE_MAX)
    return torch.where(valid, clamped, torch.ones_like(clamped)).to(_E4M3).to(torch.float32)


class _Scored(NamedTuple):
    """Scales with their E2M1 rounding and error: one per block (``n``), or ``c`` per block
    (``n c``) while :func:`_first_best` scans them. The search's private working record."""

    scale: Float32[Tensor, "*n"]  # FP32 values of E4M3 block scales
    value: Float32[Tensor, "*n 16"]  # E2M1 magnitudes (the sign is the input's)
    err: Float32[Tensor, "*n"]  # SSE

    @property
    def index(self) -> UInt8[Tensor, "*n 16"]:
        """The E2M1 magnitude indices of :attr:`value` (exact: each is an E2M1 value)."""
        return _e2m1_index(self.value)


def _evaluate(mag: Tensor, scale: Tensor, g: Tensor) -> _Scored:
    """SSE of ``scale`` [n] on block magnitudes ``mag`` [n, 16] (or [n, c] scales on [n, 1, 16]).

    The contract's ``sum((e2m1_round(v / e) * e - v)**2)`` computed on magnitudes: the rounded
    value carries the sign of ``v``, so ``q*e - v == ±(|q|*e - |v|)`` exactly and the SSE is the
    same bits.
    """
    e = (scale * g)[..., None]  # FP32 product
    value = _e2m1_value_(mag / e)
    err = _tree_sum16((value * e).sub_(mag).square_())  # (q·e − |v|)², then in place
    return _Scored(scale, value, err)


def _better(best: _Scored, other: _Scored) -> _Scored:
    take = other.err < best.err  # strict: ties keep the incumbent
    return _Scored(
        torch.where(take, other.scale, best.scale),
        torch.where(take[:, None], other.value, best.value),
        torch.where(take, other.err, best.err),
    )


def _least_squares_scale(mag: Tensor, values: Tensor, g: Tensor) -> Tensor:
    # magnitudes: <|v|, |q|> equals <v, q> bit for bit
    den = _tree_sum16(values * values)
    opt = _tree_sum16(mag * values) / den.clamp_min(1.0)
    return _clamped_scale(opt / g, den > 0)


def _scale_of_bits(bits: Tensor) -> Tensor:
    return bits.to(torch.uint8).view(_E4M3).to(torch.float32)


def _first_best(mag: Tensor, scales: Tensor, g: Tensor) -> _Scored:
    """Per block, the first of its ``c`` scales (``scales`` [n, c]) with the lowest SSE.

    Trying the scales one by one, each replacing the best only when strictly lower, ends on the
    same scale: the first minimum. NaN errors (a scale whose product with ``g`` overflows) never
    win, as ``NaN < best`` is false.
    """
    n, c = scales.shape
    step = max(1, _SCAN_PAIRS // c)
    parts = []
    for start in range(0, n, step):
        # _evaluate with the 16 values leading ([16, s, c]): the same operations, faster sums
        scale = scales[start : start + step]
        e = scale * g
        lead = mag[start : start + step].T[..., None]
        value = _e2m1_value_(lead / e)
        err = _tree_sum16_lead(value.mul_(e).sub_(lead).square_())
        err.nan_to_num_(nan=math.inf, posinf=math.inf)  # NaN never wins
        first = err.argmin(dim=1, keepdim=True)  # the first index of the minimum
        best = scale.gather(1, first)[:, 0]
        values = _e2m1_value(mag[start : start + step] / (best * g)[:, None])  # the same bits
        parts.append(_Scored(best, values, err.gather(1, first)[:, 0]))
    return _Scored(*(torch.cat(field) for field in zip(*parts, strict=True)))


def _e4m3_code(t: Tensor) -> Tensor:
    """The bits of E4M3 nearest-even of ``t`` (in ``[2**-9, 448]``) as int16."""
    return t.to(_E4M3).view(torch.uint8).to(torch.int16)


def _exhaustive_window(amax: Tensor, seed_err: Tensor, g: Tensor) -> tuple[Tensor, Tensor]:
    """Per block, the E4M3 codes ``first..last`` outside which no scale's SSE is below the
    seeds' ``seed_err``: the Triton packer's window (``docs/numerics.md``, "The exhaustive
    window"), every code where its arithmetic is not safe, one code where ``seed_err == 0``."""
    f32 = torch.float32
    r = seed_err.sqrt() * torch.tensor(1.05, dtype=f32)
    low = (amax - r) * torch.tensor(0.98 / 6.0, dtype=f32) / g
    first = torch.where(
        low > NVFP4_SCALE_MIN, _e4m3_code(low.clamp(max=NVFP4_SCALE_MAX)) - 1, _E4M3_FIRST_CODE
    )
    high = (amax + r) * torch.tensor(2.04, dtype=f32) / g
    cut = (high < NVFP4_SCALE_MAX) & (amax > r * torch.tensor(1.01, dtype=f32))
    last = torch.where(cut, _e4m3_code(high.clamp(min=NVFP4_SCALE_MIN)) + 1, _E4M3_LAST_CODE)
    safe = (g >= _WINDOW_G_MIN) & (g <= _WINDOW_G_MAX) & (seed_err < 3.0e38) & (amax > 0)
    first = torch.where(safe, first.clamp(min=_E4M3_FIRST_CODE), _E4M3_FIRST_CODE)
    last = torch.where(safe, last.clamp(max=_E4M3_LAST_CODE), _E4M3_LAST_CODE)
    last = torch.where(seed_err == 0, first, last)  # nothing is strictly below 0
    return first, torch.maximum(first, last)


def _scan_range(mag: Tensor, best: _Scored, g: Tensor, first: Tensor, last: Tensor) -> _Scored:
    """Per block, the first of codes ``first..last`` (ascending) with the lowest SSE, taken when
    strictly below ``best``. Blocks are scanned in buckets of similar width, each padded only to
    its own widest range (repeats of ``last`` never change a first minimum)."""
    width = last - first
    scale, value, err = best.scale.clone(), best.value.clone(), best.err.clone()
    for low, high in _WIDTH_BUCKETS:
        rows = ((width >= low) & (width <= high)).nonzero()[:, 0]
        if rows.numel() == 0:
            continue
        lo, hi = first[rows, None], last[rows, None]
        span = torch.arange(int((hi - lo).max()) + 1, dtype=torch.int16, device=mag.device)
        bits = torch.minimum(lo + span, hi)
        seed = _Scored(scale[rows], value[rows], err[rows])
        found = _better(seed, _first_best(mag[rows], _scale_of_bits(bits), g))
        scale[rows], value[rows], err[rows] = found
    return _Scored(scale, value, err)


def _exhaustive_scan(mag: Tensor, best: _Scored, g: Tensor) -> _Scored:
    """``exhaustive`` after the seeds: the first minimum over each block's window, taken when
    strictly below the seeds. Equal bit for bit to scanning all 126 codes
    (:func:`_exhaustive_full_scan`): a code outside the window never beats the seeds, so never
    any later best, and the window keeps the ascending order."""
    first, last = _exhaustive_window(mag.amax(dim=1), best.err, g)
    return _scan_range(mag, best, g, first, last)


def _exhaustive_full_scan(mag: Tensor, best: _Scored, g: Tensor) -> _Scored:
    """``exhaustive`` after the seeds, the literal definition: all 126 codes, ascending (the
    oracle of :func:`_exhaustive_scan` in the tests)."""
    codes = torch.arange(_E4M3_FIRST_CODE, _E4M3_LAST_CODE + 1, device=mag.device)
    every = _scale_of_bits(codes).expand(mag.shape[0], -1)
    return _better(best, _first_best(mag, every, g))


def _search_chunk(blocks: Tensor, g: Tensor, local: str) -> _Scored:
    """Best block scales for ``blocks`` [n, 16] FP32 under global scale ``g`` (0-d FP32)."""
    mag = blocks.abs()
    amax = mag.amax(dim=1)
    maxima = (6.0,) if local == "nvidia" else (4.0, 6.0)  # E2M1 values the amax is mapped onto
    candidates = [_evaluate(mag, _clamped_scale(amax / (g * m), amax > 0), g) for m in maxima]
    # The contract starts from error +inf; taking the first candidate outright differs only when
    # its SSE overflows FP32 (|x| > ~1e19), where "+inf < +inf" would leave the block at zero.
    best = candidates[0]
    for candidate in candidates[1:]:
        best = _better(best, candidate)
    if local in ("nvidia", "four_six"):
        return best
    if local == "exhaustive":  # every code that can beat the seeds, in increasing order
        return _exhaustive_scan(mag, best, g)
    for candidate in candidates:
        scale = _least_squares_scale(mag, candidate.value, g)
        best = _better(best, _evaluate(mag, scale, g))
    scale = _least_squares_scale(mag, best.value, g)
    best = _better(best, _evaluate(mag, scale, g))
    if local == "least_squares":
        return best
    center = best.scale.to(_E4M3).view(torch.uint8).to(torch.int16)
    radius = NVFP4_E4M3_SEARCH_RADIUS
    offsets = torch.arange(-radius, radius + 1, dtype=torch.int16, device=blocks.device)
    bits = (center[:, None] + offsets).clamp(_E4M3_FIRST_CODE, _E4M3_LAST_CODE)
    return _better(best, _first_best(mag, _scale_of_bits(bits), g))


def _search(blocks: Tensor, g: Tensor, recipe: str) -> _Scored:
    local = nvfp4_kernel_recipe(recipe)
    if blocks.shape[0] == 0:
        empty = blocks.new_zeros((0,))
        return _Scored(empty, blocks.new_zeros((0, NVFP4_BLOCK)), empty)
    parts = [_search_chunk(chunk, g, local) for chunk in blocks.split(_SEARCH_CHUNK_BLOCKS, dim=0)]
    return _Scored(*(torch.cat(field) for field in zip(*parts, strict=True)))


def _codes_of(blocks: Tensor, index: Tensor) -> Tensor:
    return index | ((blocks < 0).to(torch.uint8) << 3)


def _decoded(blocks: Tensor, best: _Scored, g: Tensor) -> Tensor:
    """``(e2m1 value * block scale) * g`` with the input's signs (exact value × scale product)."""
    values = best.value.copysign(blocks)
    return (values * best.scale[:, None]) * g


def nvfp4_block_scales(
    x: Float[Tensor, "*b k"],
    global_scale: Float[Tensor, ""] | float | None = None,
    recipe: NVFP4RecipeName = NVFP4_DEFAULT_RECIPE,
) -> NVFP4Blocks:
    """Search the E4M3 scale of every 16-value block and encode ``x`` as E2M1 codes.

    Per block ``v`` with global scale ``g``, in the order ``docs/numerics.md`` fixes: evaluate
    the candidates (``amax / (M·g)`` for ``M`` in ``(6,)`` for ``nvidia``, ``(4, 6)``
    otherwise), then for ``least_squares*`` the closed-form least-squares scale of each
    candidate's values and of the best's, then for ``least_squares_grid`` the 17 E4M3 codes
    around the best; ``exhaustive`` the first best of all 126 positive E4M3 scales (only the
    window that can beat the seeds is scanned: the same bits). Ties keep the earlier scale.

    Args:
      x: ``(*b, k)`` floating input, ``k % 16 == 0``; blocks are 16 consecutive elements of K.
      global_scale: FP32 global scale (finite, > 0); ``None`` derives it dynamically with
        :func:`nvfp4_global_scale` from ``max|x|`` on ``x.dtype``'s grid (as the runtime does).
      recipe: a name of :data:`floatxq.formats.NVFP4RecipeName` or a legacy alias (``lsq``...).

    Returns:
      ``NVFP4Blocks(codes, block_scales, global_scale)``; all-zero blocks get scale 1.

    Raises:
      ValueError: ``k % 16``, non-finite ``x``, a bad global scale or recipe.
      TypeError: a non-floating ``x``.

    Numerics: IEEE FP32 division and products; E2M1 nearest with ties to the even code; scales
    E4M3 nearest-even of a value clamped to ``[2**-9, 448]``; SSE in the fixed pairwise order.

    Example:
      >>> b = nvfp4_block_scales(torch.arange(16.0)[None], 1.0, "nvidia")
      >>> b.block_scales.float().tolist(), b.codes[0, :4].tolist()
      ([[2.5]], [0, 1, 2, 2])
    """
    where = "nvfp4_block_scales"
    recipe = normalize_nvfp4_recipe(recipe)
    blocks = _blocks_of(x, where=where)
    g = _resolve_global_scale(x, global_scale, recipe, where=where)
    best = _search(blocks, g, recipe)
    lead = tuple(x.shape[:-1])
    k = x.shape[-1]
    return NVFP4Blocks(
        codes=_codes_of(blocks, best.index).reshape(*lead, k),
        block_scales=best.scale.to(_E4M3).reshape(*lead, k // NVFP4_BLOCK),
        global_scale=g,
    )


def nvfp4_block_sse(
    x: Float[Tensor, "*b k"],
    block_scales: Float8e4m3fn[Tensor, "*b k//16"],
    global_scale: Float[Tensor, ""] | float,
) -> Float32[Tensor, "*b k//16"]:
    """The scale search's objective: each block's SSE under the given E4M3 scales.

    ``sum((e2m1_round(v / e) * e - v)**2)`` with ``e = float(block_scale) * global_scale``,
    summed in the fixed pairwise order, exactly as the recipes compare candidates. Use it to
    compare recipes block by block or to score scales from another quantizer.

    Raises:
      ValueError: as :func:`nvfp4_block_scales`, ``block_scales`` not shaped ``(*b, k/16)``, or
        a NaN or negative block scale.
      TypeError: ``block_scales`` that are not ``float8_e4m3fn``.

    Numerics: IEEE FP32 throughout (the same bits the search compares).

    Example:
      >>> x = torch.full((1, 16), 3.0)
      >>> nvfp4_block_sse(x, torch.tensor([[0.5]]).to(torch.float8_e4m3fn), 1.0).tolist()
      [[0.0]]
    """
    where = "nvfp4_block_sse"
    blocks = _blocks_of(x, where=where)
    k = x.shape[-1]
    _require_block_scales(block_scales, where=where)
    if tuple(block_scales.shape) != (*x.shape[:-1], k // NVFP4_BLOCK):
        raise ValueError(
            f"{where}: block_scales shape {tuple(block_scales.shape)} does not match x of shape "
            f"{tuple(x.shape)} (expected (*b, k/16))"
        )
    g = _validated_global_scale(global_scale, x.device, where=where)
    require_e4m3_scales(block_scales, name="block_scales", where=where)
    scale = block_scales.to(torch.float32).reshape(-1)
    err = _evaluate(blocks.abs(), scale, g).err
    return err.reshape(block_scales.shape)


def nvfp4_quantize(
    x: Float[Tensor, "*b k"],
    global_scale: Float[Tensor, ""] | float | None = None,
    recipe: NVFP4RecipeName = NVFP4_DEFAULT_RECIPE,
) -> NVFP4Packed:
    """:func:`nvfp4_block_scales` with the codes packed two per byte (even element low nibble).

    Numerics: as :func:`nvfp4_block_scales`; packing is exact.

    Example:
      >>> q = nvfp4_quantize(torch.full((1, 16), 3.0), 1.0)
      >>> q.packed.shape, q.block_scales.float().item(), q.global_scale.item()
      (torch.Size([1, 8]), 0.75, 1.0)
    """
    blocks = nvfp4_block_scales(x, global_scale, normalize_nvfp4_recipe(recipe))
    return NVFP4Packed(pack_e2m1(blocks.codes), blocks.block_scales, blocks.global_scale)


def nvfp4_dequantize(
    packed: Shaped[Tensor, "*b half"],
    block_scales: Float8e4m3fn[Tensor, "*b half//8"],
    global_scale: Float[Tensor, ""] | float,
    *,
    dtype: torch.dtype = torch.float32,
) -> Float[Tensor, "*b 2*half"]:
    """Decode packed NVFP4: ``(e2m1(code) * float(block_scale)) * global_scale`` → ``dtype``.

    Checks what :func:`nvfp4_quantize` guarantees of its output: E4M3 block scales in
    ``[0, 448]`` (0 is an all-zero block) and one positive finite global scale.

    Raises:
      ValueError: ``block_scales`` not ``(*b, k/16)`` for the unpacked ``k``; a NaN (bytes 0x7F,
        0xFF) or negative (sign bit set) block scale; a global scale that is not positive and
        finite, holds several values, or exceeds FP32's range.
      TypeError: ``block_scales`` that are not ``float8_e4m3fn``, ``packed`` that is not uint8,
        meta tensors, a global scale that is not a real number, a non-floating ``dtype``.

    Numerics: ``e2m1 * block_scale`` is exact in FP32; one FP32 rounding for the global scale,
    then one nearest-even rounding into ``dtype`` after clamping to ``dtype``'s largest finite
    magnitude (finite saturation: a finite NVFP4 tensor never decodes to ±inf).

    Example:
      >>> q = nvfp4_quantize(torch.full((1, 16), 3.0), 1.0)
      >>> nvfp4_dequantize(*q)[0, :2].tolist()
      [3.0, 3.0]
    """
    where = "nvfp4_dequantize"
    require_tensor(packed, name="packed", where=where)
    require_data(packed, name="packed", where=where)
    codes = unpack_e2m1(packed)
    k = codes.shape[-1]
    _require_block_scales(block_scales, where=where)
    if k % NVFP4_BLOCK or tuple(block_scales.shape) != (*codes.shape[:-1], k // NVFP4_BLOCK):
        raise ValueError(
            f"{where}: block_scales shape {tuple(block_scales.shape)} does not match "
            f"codes of shape {tuple(codes.shape)} (expected (*b, k/16))"
        )
    g = _validated_global_scale(global_scale, codes.device, where=where)
    require_e4m3_scales(block_scales, name="block_scales", where=where)
    values = e2m1_decode(codes).reshape(*codes.shape[:-1], k // NVFP4_BLOCK, NVFP4_BLOCK)
    local = block_scales.to(torch.float32)[..., None]
    return _saturated(((values * local) * g).reshape(codes.shape), dtype, where=where)


def nvfp4_block_qdq(
    x: Float[Tensor, "*b k"],
    global_scale: Float[Tensor, ""] | float | None = None,
    recipe: NVFP4RecipeName = NVFP4_DEFAULT_RECIPE,
) -> Float[Tensor, "*b k"]:
    """Quantize-dequantize through NVFP4 (the replay oracle): ``x``'s shape and dtype back.

    Empty input is returned unchanged; ``global_scale=None`` derives it dynamically. Equals
    :func:`nvfp4_dequantize` of :func:`nvfp4_quantize` except that zeros keep ``x``'s sign.

    Raises:
      ValueError: ``k % 16``, non-finite ``x``, a global scale that is not positive and finite.

    Numerics: as :func:`nvfp4_block_scales`; output ``(value * block_scale) * global_scale`` in
    FP32, rounded once to ``x.dtype`` after clamping to its largest finite magnitude (finite
    saturation, as :func:`nvfp4_dequantize`): finite input gives finite output, e.g. fp16's 65504
    decodes above 65519 (6 · 448 · g, g rounded up on the fp16 grid) and saturates to 65504.

    Example:
      >>> nvfp4_block_qdq(torch.tensor([[1.0] * 15 + [6.0]]), 1.0).tolist()[0][-2:]
      [1.0, 6.0]
    """
    recipe = normalize_nvfp4_recipe(recipe)
    where = "nvfp4_block_qdq"
    require_floating(x, name="x", where=where)
    require_data(x, name="x", where=where)
    if x.numel() == 0:
        if global_scale is not None:  # empty input is no excuse for a bad argument
            _validated_global_scale(global_scale, x.device, where=where)
        return x
    blocks = _blocks_of(x, where=where)
    g = _resolve_global_scale(x, global_scale, recipe, where=where)
    decoded = _decoded(blocks, _search(blocks, g, recipe), g).reshape(x.shape)
    return _saturated(decoded, x.dtype, where=where)
