"""NVFP4 activations on the GPU: the packer for every recipe and the emulated W4A-NVFP4 GEMM.

* :func:`nvfp4_pack_and_swizzle` quantizes ``(rows, K)`` activations to NVFP4 and lays them
  out as the tensor-core operand, bit for bit :func:`floatxq.nvfp4_pack_swizzled`
  (every recipe, ``exhaustive`` included). One program takes ``pack_rows`` rows of one 128-wide
  K group; zero rows launch nothing.
* :func:`nvfp4_linear_prepacked` / :func:`nvfp4_linear` compute the W4A-NVFP4 GEMM (an NVFP4
  activation times a symmetric INT4 GPTQ weight) on FP16 tensor cores, for GPUs without FP4
  ones (Hopper, Ada, Ampere). Every operand is exact in FP16: an activation value ``e2m1 ×
  block scale`` has at most 6 significant bits between ``2**-10`` and 2688, a weight value is an
  integer in ``-8..7``. So each 128-wide group's products are exact and their FP32 sum differs
  from the native FP4 route (which sums the weight's two E2M1 planes separately) only in
  summation order; the group scale, the ascending group sum, the global scale, the token scale
  and the bias follow :func:`floatxq.w4a_nvfp4_linear_prepacked` exactly.

Import needs neither Triton nor CUDA; the Triton sources load on the first launch. Launch shapes
come from a frozen :class:`NVFP4Tuning` (defaults measured on an H200, ``benchmarks/nvfp4.py``).
"""

import dataclasses
import functools
import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from floatxq._checks import real_scalar, require_floating
from floatxq._typing import Float, Float8e4m3fn, Float32, Int32, Shaped, Tensor
from floatxq.formats import (
    K_GROUP,
    MODEL_DTYPES,
    NVFP4_DEFAULT_RECIPE,
    NVFP4RecipeName,
    normalize_nvfp4_recipe,
    nvfp4_kernel_recipe,
)
from floatxq.gptq.decode_words import unstage_decode_words
from floatxq.gptq.int4 import _unpack_fields
from floatxq.kernels import fp8_small_m
from floatxq.kernels._triton import (
    CachedLauncher,
    capability_shortfall,
    import_kernel_sources,
    launch_device,
    require_kernel_device,
    triton_interpret_enabled,
    triton_unavailable_reason,
)
from floatxq.nvfp4.operand import padded_rows
from floatxq.nvfp4.quantize import _divisor
from floatxq.w4a.linear import _check_nvfp4_shapes, _check_nvfp4_weight_side

__all__ = [
    "DEFAULT_NVFP4_TUNING",
    "NVFP4Tuning",
    "nvfp4_global_scale_from_bits",
    "nvfp4_linear",
    "nvfp4_linear_prepacked",
    "nvfp4_native_gemm",
    "nvfp4_pack_and_swizzle",
    "nvfp4_unavailable_reason",
]

_MIN_CAPABILITY = (8, 9)
"""Triton's E4M3 conversions (the staged weight and the block scales are E4M3): Ada and newer."""
_LOCAL = {"nvidia": 0, "four_six": 1, "least_squares": 2, "least_squares_grid": 3, "exhaustive": 4}
_FP4X2 = torch.float4_e2m1fn_x2
_E4M3 = torch.float8_e4m3fn


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class NVFP4Tuning:
    """Launch shapes of the NVFP4 kernels (defaults measured on an H200).

    Raises:
      ValueError: a count below 1, or a row tile that does not divide 128.

    Numerics: none; every tuning gives the same bytes (packer) and the same sums up to FP32
    order (GEMM).

    Example:
      >>> NVFP4Tuning(pack_rows=4).pack_rows
      4
    """

    pack_rows: int = 16
    """Rows per program of the cheap recipes (``nvidia``, ``four_six``); divides 128."""
    pack_rows_search: int = 16
    """Rows per program of the searching recipes (``least_squares*``, ``exhaustive``)."""
    pack_warps: int = 4
    dwords_max_rows: int = 32
    """Largest row count for which :func:`floatxq.dispatch.nvfp4_operand` picks the int16 decode
    words (where the module holds them); 0 turns them off."""
    words_max_rows: int = 64
    """Largest row count for which the GEMM reads the int32 words when it is given them (above
    it the staged E4M3 operand is faster; :func:`floatxq.dispatch.nvfp4_operand` picks)."""
    words_block_n: int = 64
    words_warps: int = 4
    words_stages: int = 3
    target_programs: int = 4
    """The words form splits K until about this many programs per SM are launched."""
    e4m3_block_m: int = 128
    e4m3_block_n: int = 128
    e4m3_warps: int = 8
    e4m3_stages: int = 3
    e4m3_group_m: int = 8

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            low = 0 if f.name == "dwords_max_rows" else 1
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise ValueError(f"NVFP4Tuning: {f.name} must be an int >= {low}, got {value!r}")
        for name in ("pack_rows", "pack_rows_search"):
            value = getattr(self, name)
            if 128 % value:
                raise ValueError(f"NVFP4Tuning: {name} must divide 128, got {value}")


DEFAULT_NVFP4_TUNING = NVFP4Tuning()


def nvfp4_unavailable_reason(device: torch.device) -> str | None:
    """Why the NVFP4 kernels cannot run on ``device``'s tensors here, or ``None``.

    They need Triton and CUDA SM 8.9 or newer; ``TRITON_INTERPRET=1`` runs them on CPU tensors.

    Numerics: none; an environment check.

    Example:
      >>> nvfp4_unavailable_reason(torch.device("cpu")) is not None or triton_interpret_enabled()
      True
    """
    reason = triton_unavailable_reason(device)
    if reason is not None or device.type != "cuda":
        return reason
    return capability_shortfall(
        device, _MIN_CAPABILITY, need="the NVFP4 kernels need Triton's E4M3 conversions"
    )


@functools.cache
def _launchers(interpret: bool) -> tuple[CachedLauncher, ...]:
    sources = import_kernel_sources(
        "floatxq.kernels._nvfp4_jit", interpret=interpret, where="floatxq.kernels.nvfp4"
    )
    return (
        CachedLauncher(sources.nvfp4_pack_kernel),
        CachedLauncher(sources.w4a_nvfp4_kernel),
        CachedLauncher(sources.nvfp4_global_scale_kernel),
    )


def _options(interpret: bool, warps: int) -> dict[str, object]:
    """Launch options: no multiply-add contraction and IEEE division with subnormals kept (the
    interpreter computes each operation on its own in NumPy anyway)."""
    if interpret:
        return {"num_warps": warps}
    return {"num_warps": warps, "enable_fp_fusion": False, "enable_reflect_ftz": False}


def _specialized(*values: int) -> tuple[tuple[bool, bool], ...]:
    """What Triton specializes a compiled kernel on for each integer argument (equal to 1,
    divisible by 16): a launch key must hold it, or a kernel compiled for ``M == 1`` would be
    reused for other row counts."""
    return tuple((v == 1, v % 16 == 0) for v in values)


def _global_scale(global_scale: object, device: torch.device, *, where: str) -> Tensor:
    """The global scale as a one-element FP32 tensor on ``device``.

    A number (or a CPU tensor) is checked here: one positive finite value. A tensor already on
    the GPU is not read on the host (no synchronization); the kernel stores NaN scales when it
    is not positive and finite.
    """
    if isinstance(global_scale, torch.Tensor) and global_scale.device == device:
        require_floating(global_scale, name="global_scale", where=where)
        if global_scale.numel() != 1:
            raise ValueError(
                f"{where}: global_scale must hold one value, got shape {tuple(global_scale.shape)}"
            )
        if device.type == "cuda":
            return global_scale.reshape(1).to(torch.float32)
    g = real_scalar(global_scale, name="global_scale", where=where, device=torch.device("cpu"))
    if not (math.isfinite(g.item()) and g.item() > 0):
        raise ValueError(f"{where}: global_scale must be positive and finite, got {g.item()!r}")
    return g.reshape(1).to(device)


def nvfp4_pack_and_swizzle(
    x: Float[Tensor, "rows k"],
    global_scale: Float[Tensor, "*one"] | float,
    *,
    recipe: NVFP4RecipeName = NVFP4_DEFAULT_RECIPE,
    tuning: NVFP4Tuning = DEFAULT_NVFP4_TUNING,
) -> tuple[Shaped[Tensor, "rows k//2"], Float8e4m3fn[Tensor, "k//128 padded"]]:
    """NVFP4 codes and swizzled block scales of ``x`` in one launch.

    Args:
      x: ``(rows, K)`` float16/bfloat16/float32 CUDA tensor (any strides), ``K`` a positive
        multiple of 128.
      global_scale: a positive finite number, or a one-element FP32 tensor (not read on the host).
      recipe: any NVFP4 recipe or legacy alias (:data:`floatxq.NVFP4_RECIPES`).
      tuning: launch shape (:class:`NVFP4Tuning`).

    Returns:
      ``(packed, scales)``: ``float4_e2m1fn_x2 (rows, K/2)`` and ``float8_e4m3fn (K/128,
      padded_rows·8)`` (padding scales 0). No rows: empty tensors without a launch.

    Raises:
      TypeError: a CPU tensor (without ``TRITON_INTERPRET=1``), another dtype, not 2-D.
      ValueError: ``K`` not a positive multiple of 128, an unknown recipe, a global-scale number
        that is not positive and finite.
      RuntimeError: Triton missing, or a GPU below SM 8.9.

    Numerics: bit for bit :func:`floatxq.nvfp4_pack_swizzled` on finite input; no host check: a
    block holding NaN or infinity gets the NaN scale byte 0x7F (it decodes to NaN).

    Example:
      >>> packed, scales = nvfp4_pack_and_swizzle(
      ...     torch.randn(4, 256, device="cuda"), 0.01)  # doctest: +SKIP
    """
    where = "nvfp4_pack_and_swizzle"
    if not isinstance(x, torch.Tensor) or x.ndim != 2 or x.dtype not in MODEL_DTYPES:
        got = f"{x.dtype} {tuple(x.shape)}" if isinstance(x, torch.Tensor) else type(x).__name__
        raise TypeError(f"{where}: x must be a 2-D float16/bfloat16/float32 tensor, got {got}")
    rows, k = x.shape
    if k == 0 or k % K_GROUP:
        raise ValueError(f"{where}: K must be a positive multiple of {K_GROUP}, got K={k}")
    local = nvfp4_kernel_recipe(normalize_nvfp4_recipe(recipe))
    device = require_kernel_device((x,), where=where, reason=nvfp4_unavailable_reason)
    g = _global_scale(global_scale, device, where=where)
    groups = k // K_GROUP
    packed = torch.empty((rows, k // 2), dtype=torch.uint8, device=device)
    scales = torch.empty((groups, padded_rows(rows) * 8), dtype=torch.uint8, device=device)
    if rows == 0:
        return packed.view(_FP4X2), scales.view(_E4M3)
    interpret = triton_interpret_enabled()
    if interpret:
        x = x.float()  # (the interpreter's own widening flushes subnormals)
    key, grid, tail = _pack_spec(x, local, tuning)
    guard, index = launch_device(device)
    with guard:
        launcher = _launchers(interpret)[0]
        launcher(key, grid, (x, g, packed, scales, *tail), _options(interpret, tuning.pack_warps),
                 index)  # fmt: skip
    return packed.view(_FP4X2), scales.view(_E4M3)


def _pack_spec(
    x: Tensor, local: str, tuning: NVFP4Tuning
) -> tuple[Any, tuple[int, int, int], tuple[Any, ...]]:
    """``(launch key, grid, arguments after the four pointers)`` of a packer launch."""
    rows, k = x.shape
    block_r = tuning.pack_rows if local in ("nvidia", "four_six") else tuning.pack_rows_search
    grid = (padded_rows(rows) // block_r, k // K_GROUP, 1)
    tail = (rows, k, padded_rows(rows), x.stride(0), x.stride(1), _LOCAL[local], block_r)
    key = (x.dtype, x.data_ptr() % 16 == 0, _specialized(rows, x.stride(0), x.stride(1)),
           _LOCAL[local], block_r, tuning.pack_warps)  # fmt: skip
    return key, grid, tail


BOUND_MAX_ROWS = 32
"""The most rows :func:`bound_linear` binds (decode-sized calls, where host time shows)."""
_SCALE_GRIDS = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}
_SCALE_WORDS: dict[Any, Tensor] = {}
_SCALE_WARPS = 4


def nvfp4_global_scale_from_bits(
    x: Float[Tensor, "rows k"],
    bits: Int32[Tensor, "*one"],
    *,
    recipe: NVFP4RecipeName = NVFP4_DEFAULT_RECIPE,
) -> Float32[Tensor, ""]:
    """The FP32 global scale an NVFP4 activation ``x`` is packed with, in one launch and with
    no host read: the value whose bit pattern ``bits`` holds, or, while it is 0, the dynamic
    :func:`floatxq.nvfp4_dynamic_global_scale` of ``x`` (as a W4A-NVFP4 module holds its scale).

    Args:
      x: ``(rows, K)`` float16/bfloat16/float32 CUDA tensor (any strides).
      bits: a one-element int32 tensor on ``x``'s device (the FP32 scale's bits; not read on
        the host).
      recipe: the NVFP4 recipe (its E2M1 divisor: 6 or 4).

    Returns:
      A 0-d FP32 tensor on ``x``'s device (an empty ``x`` with bits 0: 1, without a launch).

    Raises:
      TypeError: a CPU tensor (without ``TRITON_INTERPRET=1``), another dtype, not 2-D; ``bits``
        not a one-element int32 tensor on ``x``'s device.
      ValueError: an unknown recipe.
      RuntimeError: Triton missing, or a GPU below SM 8.9.

    Numerics: bit for bit the pure ``torch.where(bits == 0, nvfp4_dynamic_global_scale(x),
    bits.view(float32))``: the maximum is exact (NaN propagates: the scale is then 1, as
    there), one IEEE division, one nearest-even rounding through ``x.dtype``'s grid.

    Example:
      >>> nvfp4_global_scale_from_bits(torch.full((2, 16), 1792.0, device="cuda"),
      ...     torch.zeros((), dtype=torch.int32, device="cuda")).item()  # doctest: +SKIP
      1.0
    """
    where = "nvfp4_global_scale_from_bits"
    if not isinstance(x, torch.Tensor) or x.ndim != 2 or x.dtype not in MODEL_DTYPES:
        got = f"{x.dtype} {tuple(x.shape)}" if isinstance(x, torch.Tensor) else type(x).__name__
        raise TypeError(f"{where}: x must be a 2-D float16/bfloat16/float32 tensor, got {got}")
    if not isinstance(bits, torch.Tensor) or bits.dtype != torch.int32 or bits.numel() != 1:
        got = f"{bits.dtype} {tuple(bits.shape)}" if isinstance(bits, torch.Tensor) else bits
        raise TypeError(f"{where}: bits must be one int32 value (the FP32 bits), got {got}")
    divisor = _divisor(normalize_nvfp4_recipe(recipe))
    device = require_kernel_device((x, bits), where=where, reason=nvfp4_unavailable_reason)
    if x.numel() == 0:
        return torch.where(bits.reshape(()) == 0, 1.0, bits.reshape(()).view(torch.float32))
    g = torch.empty((), dtype=torch.float32, device=device)
    interpret = triton_interpret_enabled()
    grid_dtype = _SCALE_GRIDS[x.dtype]
    if interpret:
        x = x.float()  # (the interpreter's own widening flushes subnormals)
    key, grid, tail = _scale_spec(x, bits, divisor, grid_dtype)
    guard, index = launch_device(device)
    with guard:
        args = (x, bits, g, _scale_words(device, index), *tail)
        _launchers(interpret)[2](key, grid, args, _options(interpret, _SCALE_WARPS), index)
    return g


def _scale_spec(
    x: Tensor, bits: Tensor, divisor: float, grid_dtype: int
) -> tuple[Any, tuple[int, int, int], tuple[Any, ...]]:
    """``(launch key, grid, arguments after the four pointers)`` of a global-scale launch."""
    rows, k = x.shape
    block_r = 1 << min(3, (rows - 1).bit_length())  # up to 8 rows ...
    block_k = 1 << min(10, (k - 1).bit_length())  # ... by up to 1024 columns a program
    grid = (-(-rows // block_r), -(-k // block_k), 1)
    tail = (rows, k, x.stride(0), x.stride(1), divisor, grid_dtype, block_r, block_k)
    key = (x.dtype, x.data_ptr() % 16 == 0, bits.data_ptr() % 16 == 0,
           _specialized(rows, k, x.stride(0), x.stride(1)), *tail[4:])  # fmt: skip
    return key, grid, tail


def _scale_words(device: torch.device, index: int) -> Tensor:
    """The two int32 words (maximum, arrivals) of a global-scale launch on the current stream
    (one pair per device and stream: launches on one stream run in order); zero between
    launches, as the kernel leaves them."""
    stream = torch._C._cuda_getCurrentRawStream(index) if device.type == "cuda" else 0
    words = _SCALE_WORDS.get((device, stream))
    if words is None:
        words = _SCALE_WORDS[(device, stream)] = torch.zeros(2, dtype=torch.int32, device=device)
    return words


def nvfp4_linear_prepacked(
    codes: Shaped[Tensor, "m half"],
    scales: Float8e4m3fn[Tensor, "groups padded"],
    global_scale: Float[Tensor, "*one"] | float,
    weight: Shaped[Tensor, "rows n"],
    group_scales: Float[Tensor, "groups n"],
    bias: Float[Tensor, "n"] | None = None,  # noqa: F821
    *,
    token_scale: Float32[Tensor, "m"] | None = None,  # noqa: F821
    output_dtype: torch.dtype,
    tuning: NVFP4Tuning = DEFAULT_NVFP4_TUNING,
) -> Float[Tensor, "m n"]:
    """The W4A-NVFP4 GEMM emulated on FP16 tensor cores (one launch).

    Args:
      codes: ``(m, k/2)`` ``float4_e2m1fn_x2``/uint8 CUDA codes (unit K stride).
      scales: ``float8_e4m3fn (k/128, padded_rows(m)·8)`` swizzled block scales (contiguous).
      global_scale: the activation's FP32 global scale (a GPU tensor is not read on the host).
      weight: int32 GPTQ words ``(k/8, n)`` or the staged ``float8_e4m3fn (k, n)`` operand
        (any strides; K-contiguous is fastest).
      group_scales: ``(k/128, n)`` GPTQ group scales (any floating dtype).
      bias: ``(n,)`` floating or None.
      token_scale: ``(m,)`` FP32 per-row factors or None.
      output_dtype: float16, bfloat16 or float32.
      tuning: launch shapes.

    Returns:
      ``(m, n)`` in ``output_dtype``.

    Raises:
      TypeError, ValueError: the shape and kind errors of
        :func:`floatxq.w4a_nvfp4_linear_prepacked` (values are not read: no host sync).
      RuntimeError: Triton missing, or a GPU below SM 8.9.

    Numerics: :func:`floatxq.w4a_nvfp4_linear_prepacked` up to FP32 summation order: each
    group's exact products summed in FP32 by the tensor cores (the native route sums the two
    weight planes separately), split-K partial sums added in split order for few rows; the
    group scale, global scale, token scale, bias and rounding in the reference's order.
    """
    where = "nvfp4_linear_prepacked"
    _check_nvfp4_shapes(
        codes, scales, weight, group_scales, bias, token_scale, output_dtype, where=where
    )
    extras = tuple(t for t in (bias, token_scale) if t is not None)
    others = (codes, scales, weight, group_scales, *extras)
    device = require_kernel_device(others, where=where, reason=nvfp4_unavailable_reason)
    g = _global_scale(global_scale, device, where=where)
    return _gemm(codes, scales, g, weight, group_scales, bias, token_scale, output_dtype, tuning)


def nvfp4_linear(
    x: Float[Tensor, "m k"],
    weight: Shaped[Tensor, "rows n"],
    group_scales: Float[Tensor, "groups n"],
    bias: Float[Tensor, "n"] | None = None,  # noqa: F821
    *,
    global_scale: Float[Tensor, "*one"] | float,
    recipe: NVFP4RecipeName = NVFP4_DEFAULT_RECIPE,
    tuning: NVFP4Tuning = DEFAULT_NVFP4_TUNING,
) -> Float[Tensor, "m n"]:
    """The W4A-NVFP4 linear on the GPU: :func:`nvfp4_pack_and_swizzle`, then the emulated GEMM.

    Args:
      x: ``(m, k)`` float16/bfloat16/float32 CUDA activations; ``k`` a multiple of 128.
      weight, group_scales, bias, tuning: as :func:`nvfp4_linear_prepacked`.
      global_scale: the activation's FP32 global scale (calibrated; derive a dynamic one with
        :func:`floatxq.nvfp4_global_scale`).
      recipe: the block-scale recipe.

    Returns:
      ``(m, n)`` in ``x.dtype``.

    Raises:
      TypeError, ValueError, RuntimeError: as the two kernels.

    Numerics: :func:`floatxq.w4a_nvfp4_linear` with that global scale, up to FP32
    summation order.
    """
    where = "nvfp4_linear"
    if not isinstance(x, torch.Tensor) or x.ndim != 2 or x.dtype not in MODEL_DTYPES:
        got = f"{x.dtype} {tuple(x.shape)}" if isinstance(x, torch.Tensor) else type(x).__name__
        raise TypeError(f"{where}: x must be a 2-D float16/bfloat16/float32 tensor, got {got}")
    _check_nvfp4_weight_side(x.shape[1], x.device, weight, group_scales, bias, where=where)
    codes, scales = nvfp4_pack_and_swizzle(x, global_scale, recipe=recipe, tuning=tuning)
    return nvfp4_linear_prepacked(
        codes, scales, global_scale, weight, group_scales, bias, output_dtype=x.dtype,
        tuning=tuning,
    )  # fmt: skip


_PLANS: dict[Any, tuple[tuple[int, int, int], tuple[Any, ...], dict[str, Any]]] = {}


def _plan(
    m: int, n: int, groups: int, words: bool, device: torch.device, tuning: NVFP4Tuning,
    interpret: bool,
) -> tuple[tuple[int, int, int], tuple[Any, ...], dict[str, Any]]:  # fmt: skip
    """``(grid, constexpr tail, options)`` of one GEMM launch."""
    if m <= tuning.words_max_rows or interpret:
        block_m = 16 if m <= 16 else (32 if m <= 32 else 64)
        block_n = tuning.words_block_n
        tiles = -(-m // block_m) * -(-n // block_n)
        sms = fp8_small_m._sm_count(device) or 1
        split = 1
        for d in range(1, groups + 1):  # the largest split that stays near the target programs
            if groups % d == 0 and tiles * d <= tuning.target_programs * sms:
                split = d
        warps, stages, group_m = tuning.words_warps, tuning.words_stages, 1
    else:
        block_m, block_n, split = tuning.e4m3_block_m, tuning.e4m3_block_n, 1
        tiles = -(-m // block_m) * -(-n // block_n)
        warps, stages, group_m = tuning.e4m3_warps, tuning.e4m3_stages, tuning.e4m3_group_m
    tail = (block_m, block_n, groups // split, split, group_m)
    del words
    options: dict[str, Any] = {"num_warps": warps, "num_stages": stages}
    if not interpret:
        options["enable_fp_fusion"] = False
    return (tiles, split, 1), tail, options


def _gemm(
    codes: Tensor, scales: Tensor, g: Tensor, weight: Tensor, group_scales: Tensor,
    bias: Tensor | None, token_scale: Tensor | None, output_dtype: torch.dtype,
    tuning: NVFP4Tuning,
) -> Tensor:  # fmt: skip
    """The GEMM launch, arguments already checked."""
    m, k = codes.shape[0], codes.shape[1] * 2
    n = weight.shape[1]
    device = codes.device
    out = torch.empty((m, n), dtype=output_dtype, device=device)
    if m == 0 or n == 0:
        return out
    interpret = triton_interpret_enabled()
    c = codes.view(torch.uint8)
    key, grid, tail, options, mode, decoded = _gemm_spec(
        c, weight, group_scales, bias, token_scale, output_dtype, device, tuning, interpret
    )
    split, act = grid[1], c
    if mode == 3:
        weight = weight.contiguous()  # (the kernel steps the decode words' rows by n)
    if decoded:  # prefill: both operands decoded exactly to FP16 first (pipelined MMA loads)
        from floatxq.kernels.nvfp4_decoding import nvfp4_decode

        act = nvfp4_decode(codes, scales, 1.0, k, torch.float16)  # e2m1 · block scale: exact
        if mode == 0:
            weight = (_unpack_fields(weight, 0, 4).to(torch.int16) - 8).to(torch.float16)
        elif mode == 3:
            weight = (unstage_decode_words(weight, k).to(torch.int16) - 8).to(torch.float16)
        else:
            weight = weight.to(torch.float16)  # (keeps the operand's strides)
    w = weight.view(torch.int8) if mode == 1 and not decoded else weight
    guard, index = launch_device(device)
    with guard:
        if split > 1:
            part, counts, _ = fp8_small_m._workspace(device, index, split * m * n, grid[0])
        else:
            part = counts = out
        args = (
            act, scales.view(torch.uint8), g, token_scale if token_scale is not None else g, w,
            group_scales, bias if bias is not None else group_scales, out, part, counts,
            *_gemm_rest(m, n, k, act, w, group_scales), *tail,
        )  # fmt: skip
        aligned = tuple(a.data_ptr() % 16 == 0 for a in args[:10])
        _launchers(interpret)[1]((key, aligned), grid, args, options, index)
    return out


def _gemm_rest(
    m: int, n: int, k: int, act: Tensor, w: Tensor, group_scales: Tensor
) -> tuple[int, ...]:
    """The GEMM's integer arguments after its ten pointers (the output contiguous)."""
    return (
        m, n, k, padded_rows(m), act.stride(0), w.stride(0), w.stride(1), group_scales.stride(0),
        group_scales.stride(1), n,
    )  # fmt: skip


def _gemm_spec(
    c: Tensor, weight: Tensor, group_scales: Tensor, bias: Tensor | None,
    token_scale: Tensor | None, output_dtype: torch.dtype, device: torch.device,
    tuning: NVFP4Tuning, interpret: bool,
) -> tuple[Any, tuple[int, int, int], tuple[Any, ...], dict[str, Any], int, bool]:  # fmt: skip
    """``(launch key, grid, constexpr tail, options, weight mode, decoded)`` of a GEMM of the
    uint8 codes ``c``: mode 0 int32 words, 1 staged E4M3, 2 FP16 (``decoded``: both operands
    decoded first, many rows), 3 int16 decode words."""
    m, k, n = c.shape[0], c.shape[1] * 2, weight.shape[1]
    mode = {torch.int32: 0, torch.int16: 3}.get(weight.dtype, 1)
    decoded = m > tuning.words_max_rows and not interpret
    # the key names every compile-time choice (the weight form and the decoded path included:
    # int32 and int16 words of one shape have the same strides)
    key = (
        m, n, k, mode, decoded, weight.stride(), group_scales.stride(), group_scales.dtype,
        c.stride(0), None if bias is None else bias.dtype, token_scale is not None, output_dtype,
        device, interpret, None if tuning is DEFAULT_NVFP4_TUNING else tuning,
    )  # fmt: skip
    plan = _PLANS.get(key)
    if plan is None:
        plan = _PLANS[key] = _plan(m, n, k // 128, mode in (0, 3), device, tuning, interpret)
    grid, tail, options = plan
    flags = (2 if decoded else mode, decoded, token_scale is not None, bias is not None)
    return key, grid, (*flags, *tail, not interpret), options, mode, decoded


def bound_linear(
    x: Tensor, bits: Tensor, recipe: str, weight: Tensor, group_scales: Tensor,
    bias: Tensor | None,
) -> Callable[[Tensor], Tensor] | None:  # fmt: skip
    """``W4ANVFP4Linear``'s emulated call — :func:`nvfp4_global_scale_from_bits`,
    :func:`nvfp4_pack_and_swizzle`, then the GEMM on ``weight`` (its int32 words, int16 decode
    words or staged E4M3 operand), default tuning — bound for every ``x`` like this one (shape,
    dtype, strides, device, alignment; at most 32 rows: decode-sized calls, where host time
    shows) once those three have launched; None where nothing is kept. ``bits``: the module's
    0-d int32 global-scale bits; the rest its checked buffers."""
    device, tuning = x.device, DEFAULT_NVFP4_TUNING
    (m, k), n = x.shape, weight.shape[1]
    if device.type != "cuda" or triton_interpret_enabled() or not 0 < m <= BOUND_MAX_ROWS or not n:
        return None
    if weight.dtype == torch.int16 and not weight.is_contiguous():
        return None
    recipe = normalize_nvfp4_recipe(recipe)
    scale_key, scale_grid, scale_tail = _scale_spec(
        x, bits, _divisor(recipe), _SCALE_GRIDS[x.dtype]
    )
    pack_key, pack_grid, pack_tail = _pack_spec(x, nvfp4_kernel_recipe(recipe), tuning)
    c = torch.empty((m, k // 2), dtype=torch.uint8, device=device)
    key, grid, tail, _, mode, _ = _gemm_spec(
        c, weight, group_scales, bias, None, x.dtype, device, tuning, False
    )
    w = weight.view(torch.int8) if mode == 1 else weight
    fixed = (w, group_scales, bias if bias is not None else group_scales)
    aligned = (True,) * 4 + tuple(a.data_ptr() % 16 == 0 for a in fixed) + (True,) * 3
    launchers = _launchers(False)
    scale = launchers[2].bind(scale_key, scale_grid, device.index)
    pack = launchers[0].bind(pack_key, pack_grid, device.index)
    gemm = launchers[1].bind((key, aligned), grid, device.index)
    if scale is None or pack is None or gemm is None:
        return None
    rest = (*_gemm_rest(m, n, k, c, w, group_scales), *tail)
    gemm_call = fp8_small_m.bound_gemm(gemm, m, n, x.dtype, device, fixed, rest, grid)
    index, shapes = device.index, ((m, k // 2), (k // K_GROUP, padded_rows(m) * 8))

    def linear(x: Tensor) -> Tensor:
        stream = torch._C._cuda_getCurrentRawStream(index)
        held = _SCRATCH.get((device, stream, m, k))
        if held is None:
            held = _scratch(device, index, stream, m, k, shapes)
        g, codes, block_scales, words = held
        scale(x, bits, g, words, *scale_tail)
        pack(x, g, codes, block_scales, *pack_tail)
        return gemm_call(codes, block_scales, g, g)

    return linear


_SCRATCH: dict[Any, tuple[Tensor, ...]] = {}


def _scratch(
    device: torch.device, index: int, stream: int, m: int, k: int,
    shapes: tuple[tuple[int, int], tuple[int, int]],
) -> tuple[Tensor, ...]:  # fmt: skip
    """The bound calls' global scale, codes, block scales and scale words for ``m × k``
    activations on one stream: shared by every module, since a stream runs its launches in
    order (a call's GEMM has read them before the next call's first launch writes them). Two
    CUDA graphs captured on one stream share them too: replay those on one stream."""
    held = _SCRATCH[(device, stream, m, k)] = (
        torch.empty((), dtype=torch.float32, device=device),
        torch.empty(shapes[0], dtype=torch.uint8, device=device),
        torch.empty(shapes[1], dtype=torch.uint8, device=device),
        _scale_words(device, index),
    )
    return held


def nvfp4_native_gemm(
    codes: Shaped[Tensor, "rows half_k"],
    scales: Float8e4m3fn[Tensor, "groups padded"],
    global_scale: Float32[Tensor, "*one"],
    both: Shaped[Tensor, "half_k two_n"],
    unit_scales: Float8e4m3fn[Tensor, " unit"],
    group_scales: Float[Tensor, "groups n"],
    bias: Float[Tensor, " n"] | None,
    token_scale: Float32[Tensor, " rows"] | None,
    output_dtype: torch.dtype,
    *,
    accumulate: Callable[..., Tensor],
) -> Float[Tensor, "rows n"]:
    """The W4A-NVFP4 GEMM on FP4 tensor cores (cuBLAS through ``F.scaled_mm``), operands
    already checked (at least one row; ``both`` / ``unit_scales`` from
    :func:`floatxq.w4a.weight.w4a_nvfp4_weight_planes`).

    Per 128-wide K group ``g``: ``F.scaled_mm`` of the codes ``[:, 64g : 64g+64]`` (block
    scales ``scales[g]``) by the planes ``both[64g : 64g+64]`` (unit scales), both scale grids
    ``SWIZZLE_32_4_4``, FP32 out: ``[Σ a·low | Σ a·high]`` with exact products; then
    ``accumulate`` (:func:`floatxq.w4a_nvfp4_accumulate_group` or its Triton twin) adds
    ``(low + 4·high) · group_scale`` to the FP32 sum, and the last group applies the global
    scale, the token scale and the bias and rounds once.

    Numerics: equal to :func:`floatxq.w4a_nvfp4_linear_prepacked` up to FP32 summation order.
    """
    kind, swizzle = F.ScalingType.BlockWise1x16, F.SwizzleType.SWIZZLE_32_4_4
    half = K_GROUP // 2

    def planes(g: int) -> Tensor:
        cols = slice(half * g, half * (g + 1))
        return F.scaled_mm(
            codes[:, cols], both[cols], scales[g], kind, unit_scales, kind,
            swizzle_a=swizzle, swizzle_b=swizzle, output_dtype=torch.float32,
        )  # fmt: skip

    last = scales.shape[0] - 1
    acc: Tensor | None = None
    for g in range(last):  # ascending groups, FP32 running sum
        acc = accumulate(planes(g), group_scales[g], acc)
    return accumulate(
        planes(last), group_scales[last], acc, last=True, global_scale=global_scale,
        token_scale=token_scale, bias=bias, output_dtype=output_dtype,
    )  # fmt: skip
