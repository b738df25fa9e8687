"""Triton W4A-FP8: per-token E4M3 packing and the grouped INT4 × FP8 GEMM.

Twins of :func:`floatxq.fp8_token_quantize` (:func:`fp8_pack`, bit for bit) and of
:func:`floatxq.w4a_fp8_linear` / :func:`floatxq.w4a_fp8_linear_prepacked`
(:func:`fp8_linear` / :func:`fp8_linear_prepacked`, up to FP32 summation order). The signatures
are GPT-QModel's, so either library's callers can swap one for the other.

The GEMM reads its weight in one of two forms, each faster at its own size:

``"words"`` (decode-sized calls)
    the checkpoint's int32 GPTQ words ``(K/8, N)``: half a byte per weight, the bytes a
    memory-bound call must stream. Each program unpacks its ``128 × BLOCK_N`` tile in
    registers to the exact integers ``code - 8`` and multiplies on FP16 tensor cores (E4M3
    codes and integers of magnitude ≤ 8 are exact in FP16, so are their products); K is split
    over several programs so that a few rows still fill the GPU.
``"e4m3"`` (prefill-sized calls)
    the staged E4M3 operand ``(K, N)`` (one byte per weight, best stored K-contiguous):
    compute-bound tiles on the FP8 tensor cores (Hopper's wgmma through ``tl.dot`` on E4M3
    operands; SM 8.9's FP8 MMA).

Both accumulate each 128-wide group in a fresh FP32 tile, multiply it by the group's scales,
add the groups in ascending order, then apply the token scale once and the bias.
:func:`floatxq.dispatch.w4a_fp8_operand` says which form a row count should use (measured
crossover, ``benchmarks/RESULTS.md``) and :func:`floatxq.dispatch.w4a_fp8_gemm_route` whether
cuBLAS's blockwise FP8 GEMM takes the call instead; the kernels run the route they are given.
Launch shapes come from a frozen :class:`W4AFP8Tuning`.
"""

import dataclasses
import functools
from collections.abc import Callable
from typing import Any, Literal

import torch

from floatxq._typing import Float, Float8e4m3fn, Float32, Shaped, Tensor
from floatxq.formats import FP8_E4M3_MAX, K_GROUP
from floatxq.kernels import fp8_small_m, fp8_weight, w4a_frag
from floatxq.kernels._triton import (
    CachedLauncher,
    capability_shortfall,
    dependent_launches,
    import_kernel_sources,
    launch_device,
    new_output,
    require_kernel_device,
    triton_interpret_enabled,
    triton_unavailable_reason,
)
from floatxq.w4a.linear import W4A_OUTPUT_DTYPES, _check_operands

__all__ = [
    "DEFAULT_W4A_FP8_TUNING",
    "W4AFP8Tuning",
    "blockwise_unavailable_reason",
    "bound_linear",
    "fp8_linear",
    "fp8_linear_prepacked",
    "fp8_pack",
    "w4a_fp8_unavailable_reason",
]

W4AFP8Route = Literal["triton", "scaled_mm_blockwise", "fragment"]
W4A_FP8_GEMM_ROUTES = ("triton", "scaled_mm_blockwise", "fragment")

_MIN_CAPABILITY = (8, 9)
"""FP8 tensor cores and the E4M3 conversion instruction: Ada (SM 8.9) and newer."""
_SMALLEST_SUBNORMAL_BITS = 1
"""The scale of a row whose ``amax / 448`` underflows (as :func:`floatxq.fp8_token_quantize`)."""


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class W4AFP8Tuning:
    """Launch shapes of the W4A-FP8 kernels (defaults measured on an H200).

    Raises:
      ValueError: a tile that is not a power of two, or a count below 1.

    Numerics: none; the results are the same for every tuning up to FP32 summation order.

    Example:
      >>> W4AFP8Tuning(words_block_n=128).words_block_n
      128
    """

    dwords_max_rows: int = 32
    """Largest row count that reads the int16 decode words (where the module holds them), as
    :func:`floatxq.dispatch.w4a_fp8_operand` picks."""
    dwords_block_n: int = 128
    dwords_stages: int = 2
    dwords_target_programs: int = 4
    dwords_small_weight: int = 4096 * 4096
    """Up to this many weights (N·K) the decode-words launch below ``dwords_wide_rows`` takes
    ``dwords_small_block_n``-wide tiles (measured at 16 rows, ``benchmarks/w4a_tuning_sweep.py``:
    1.3× faster at 4096 × 4096, 2.2× at 1024 × 4096; slower on larger layers)."""
    dwords_small_block_n: int = 64
    dwords_wide_rows: int = 17
    """From this row count on the decode-words launch takes the ``dwords_wide_*`` shapes."""
    dwords_wide_block_n: int = 256
    dwords_wide_stages: int = 3
    dwords_wide_target_programs: int = 2
    words_max_rows: int = 64
    """Largest row count that reads the int32 words (above it: the staged E4M3 operand), as
    :func:`floatxq.dispatch.w4a_fp8_operand` picks; also the largest that gets the split-K
    launch shapes."""
    words_block_n: int = 64
    """Output columns per program on the words form."""
    words_warps: int = 4
    words_stages: int = 3
    target_programs: int = 4
    """The words form splits K until about this many programs per SM are launched."""
    e4m3_block_m: int = 128
    e4m3_block_n: int = 128
    e4m3_warps: int = 8
    e4m3_stages: int = 3
    e4m3_group_m: int = 8
    """M tiles per band of programs (L2 reuse of the weight tiles)."""
    pack_rows: int = 1
    """Rows per program of :func:`fp8_pack`."""
    pack_block_k: int = 8192
    """Widest chunk of a row :func:`fp8_pack` holds at once (longer rows are read twice)."""
    pack_warps: int = 8
    cublas_min_rows: int = 128
    """From this many rows on :func:`floatxq.dispatch.w4a_fp8_gemm_route` picks cuBLAS's
    blockwise FP8 GEMM (where it runs) over the Triton one."""

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"W4AFP8Tuning: {f.name} must be an int >= 1, got {value!r}")
        for name in ("words_block_n", "dwords_block_n", "dwords_wide_block_n",
                     "dwords_small_block_n", "e4m3_block_m", "e4m3_block_n", "pack_rows",
                     "pack_block_k"):  # fmt: skip
            value = getattr(self, name)
            if value & (value - 1):
                raise ValueError(f"W4AFP8Tuning: {name} must be a power of two, got {value}")


DEFAULT_W4A_FP8_TUNING = W4AFP8Tuning()


def w4a_fp8_unavailable_reason(device: torch.device) -> str | None:
    """Why the W4A-FP8 kernels cannot run on ``device``'s tensors here, or ``None``.

    They need Triton and CUDA SM 8.9 or newer (FP8 tensor cores); ``TRITON_INTERPRET=1`` runs
    them on CPU tensors.

    Numerics: none; an environment check.
    """
    reason = triton_unavailable_reason(device)
    if reason is not None or device.type != "cuda":
        return reason
    return capability_shortfall(
        device, _MIN_CAPABILITY, need="the W4A-FP8 kernels need FP8 tensor cores"
    )


@functools.cache
def _launchers(interpret: bool) -> tuple[CachedLauncher, CachedLauncher]:
    sources = import_kernel_sources(
        "floatxq.kernels._w4a_jit", interpret=interpret, where="floatxq.kernels.w4a_fp8"
    )
    return CachedLauncher(sources.fp8_pack_kernel), CachedLauncher(sources.w4a_fp8_kernel)


@functools.cache
def _dwords_launcher(interpret: bool) -> CachedLauncher:
    sources = import_kernel_sources(
        "floatxq.kernels._w4a_words_jit", interpret=interpret, where="floatxq.kernels.w4a_fp8"
    )
    return CachedLauncher(sources.w4a_fp8_words_kernel)


def fp8_pack(
    x: Float[Tensor, "rows k"],
    *,
    tuning: W4AFP8Tuning = DEFAULT_W4A_FP8_TUNING,
) -> tuple[Float8e4m3fn[Tensor, "rows k"], Float32[Tensor, "rows"]]:  # noqa: F821
    """Per-token E4M3 codes and FP32 direct scales of ``x``: :func:`floatxq.fp8_token_quantize`
    in one launch.

    Args:
      x: ``(rows, k)`` float16/bfloat16/float32 CUDA tensor (any strides).
      tuning: launch shape (:class:`W4AFP8Tuning`).

    Returns:
      ``(codes, row_scale)``: ``float8_e4m3fn (rows, k)`` contiguous and ``float32 (rows,)``.

    Raises:
      TypeError: a CPU tensor (without ``TRITON_INTERPRET=1``), another dtype, not 2-D.
      RuntimeError: Triton missing, or a GPU below SM 8.9.

    Numerics: bit for bit ``fp8_token_quantize(x)`` (scale squeezed): ``amax / 448`` and
    ``x / scale`` by IEEE division, one nearest-even saturating E4M3 conversion. No finiteness
    check (no host sync): a NaN in a row gives that row a NaN scale.

    Example:
      >>> codes, scale = fp8_pack(torch.randn(4, 256, device="cuda"))  # doctest: +SKIP
    """
    where = "fp8_pack"
    if not isinstance(x, torch.Tensor) or x.ndim != 2 or x.dtype not in W4A_OUTPUT_DTYPES:
        got = f"{x.dtype} {tuple(x.shape)}" if isinstance(x, torch.Tensor) else type(x).__name__
        raise TypeError(f"{where}: x must be a 2-D float16/bfloat16/float32 tensor, got {got}")
    device = require_kernel_device((x,), where=where, reason=w4a_fp8_unavailable_reason)
    return _pack(x, device, tuning)


def _pack_spec(
    x: Tensor, device: torch.device, tuning: W4AFP8Tuning
) -> tuple[Any, tuple[int, int, int], tuple[Any, ...], dict[str, Any]]:
    """``(key, grid, arguments after the three tensors, options)`` of :func:`_pack`'s launch."""
    rows, k = x.shape
    block_k = min(fp8_weight._next_pow2(k), tuning.pack_block_k)
    block_r = tuning.pack_rows
    convert = fp8_weight._conversion("float8_e4m3fn", device, None)
    pdl = dependent_launches(device)  # (the GEMM after it may start at once)
    tail = (
        rows, k, x.stride(0), x.stride(1), FP8_E4M3_MAX, _SMALLEST_SUBNORMAL_BITS, convert,
        block_r, block_k, -(-k // block_k), pdl,
    )  # fmt: skip
    key = (
        x.dtype, x.stride(1) == 1, x.data_ptr() % 16 == 0, rows, k, convert, block_r, block_k,
        tuning.pack_warps, pdl,
    )  # fmt: skip
    return key, (-(-rows // block_r), 1, 1), tail, {"num_warps": tuning.pack_warps}


def _pack(x: Tensor, device: torch.device, tuning: W4AFP8Tuning) -> tuple[Tensor, Tensor]:
    """:func:`fp8_pack`'s launch, arguments already checked."""
    rows, k = x.shape
    codes = torch.empty((rows, k), dtype=torch.float8_e4m3fn, device=device)
    scale = torch.empty((rows,), dtype=torch.float32, device=device)
    if rows == 0:
        return codes, scale
    if k == 0:
        return codes, scale.fill_(1.0)
    interpret = triton_interpret_enabled()
    if interpret:
        x = x.float()  # (the interpreter's own widening flushes subnormals)
    key, grid, tail, options = _pack_spec(x, device, tuning)
    guard, index = launch_device(device)
    with guard:
        _launchers(interpret)[0](key, grid, (x, codes.view(torch.int8), scale, *tail), options,
                                 index)  # fmt: skip
    return codes, scale


def _bound_pack(x: Tensor) -> Callable[[Tensor], tuple[Tensor, Tensor]] | None:
    """:func:`_pack` with the default tuning for every ``x`` like this one (shape, dtype,
    strides, device, 16-byte alignment), bound after its first launch (None before, or where
    nothing is kept)."""
    device = x.device
    rows, k = x.shape
    if not rows or not k or device.type != "cuda" or triton_interpret_enabled():
        return None
    key, grid, tail, _ = _pack_spec(x, device, DEFAULT_W4A_FP8_TUNING)
    launch = _launchers(False)[0].bind(key, grid, device.index)
    if launch is None:
        return None

    def pack(x: Tensor) -> tuple[Tensor, Tensor]:
        codes = torch.empty((rows, k), dtype=torch.float8_e4m3fn, device=device)
        scale = torch.empty((rows,), dtype=torch.float32, device=device)
        launch(x, codes.view(torch.int8), scale, *tail)
        return codes, scale

    return pack


def fp8_linear(
    x: Float[Tensor, "m k"],
    weight: Shaped[Tensor, "rows n"],
    scales: Float[Tensor, "groups n"],
    bias: Float[Tensor, "n"] | None = None,  # noqa: F821
    *,
    route: W4AFP8Route | None = None,
    tuning: W4AFP8Tuning = DEFAULT_W4A_FP8_TUNING,
) -> Float[Tensor, "m n"]:
    """The W4A-FP8 linear on CUDA: :func:`fp8_pack`, then the grouped GEMM.

    Args:
      x: ``(m, k)`` float16/bfloat16/float32 CUDA activations; ``k`` a multiple of 128.
      weight: int32 GPTQ words ``(k/8, n)`` (symmetric, zero point 8), their int16 decode
        words ``(k/4, n)`` (:func:`floatxq.gptq.decode_words.stage_decode_words`) or the staged
        ``float8_e4m3fn (k, n)`` operand (see :func:`floatxq.centered_weight`).
      scales: ``(k/128, n)`` GPTQ group scales (any floating dtype).
      bias: ``(n,)`` floating or None.
      route: ``"triton"`` (the grouped Triton GEMM; also for None, as GPT-QModel's kernel),
        ``"scaled_mm_blockwise"`` (cuBLAS, staged E4M3 operand only; refused where
        :func:`blockwise_unavailable_reason` names a reason) or ``"fragment"`` (``weight`` the
        fragment words of the decode words, :mod:`floatxq.gptq.fragment_words`, read by
        :mod:`floatxq.kernels.w4a_frag`; refused where
        :func:`~floatxq.kernels.w4a_frag.fragment_unavailable_reason` names a reason).
        :func:`floatxq.dispatch.w4a_fp8_gemm_route` names the faster for a row count.
      tuning: launch shapes.

    Returns:
      ``(m, n)`` in ``x.dtype``.

    Raises:
      TypeError, ValueError: as :func:`floatxq.w4a_fp8_linear` (no finiteness checks); an
        unknown route.
      RuntimeError: Triton missing, a GPU below SM 8.9, or ``"scaled_mm_blockwise"`` where it
        cannot run.

    Numerics: :func:`floatxq.w4a_fp8_linear` up to FP32 summation order (within a group,
    across K splits) and, on FP8 tensor cores, their truncating accumulation of a group's 128
    products (docs/numerics.md states the bound the tests hold it to).
    """
    where = "fp8_linear"
    _check_route(route, where)
    if not isinstance(x, torch.Tensor) or x.ndim != 2 or x.dtype not in W4A_OUTPUT_DTYPES:
        got = f"{x.dtype} {tuple(x.shape)}" if isinstance(x, torch.Tensor) else type(x).__name__
        raise TypeError(f"{where}: x must be a 2-D float16/bfloat16/float32 tensor, got {got}")
    _check_operands(x.shape[1], x.device, weight, scales, bias, where=where)
    device = require_kernel_device((x,), where=where, reason=w4a_fp8_unavailable_reason)
    codes, row_scale = _pack(x, device, tuning)
    return _run(codes, row_scale, weight, scales, bias, x.dtype, route, tuning, where=where)


def _linear(
    x: Tensor, weight: Tensor, scales: Tensor, bias: Tensor | None, route: str | None
) -> Tensor:
    """:func:`fp8_linear` with its arguments already checked (``W4AFP8Linear`` checked them when
    it was built, and its plan chose the weight form and the GEMM route)."""
    codes, row_scale = _pack(x, x.device, DEFAULT_W4A_FP8_TUNING)
    return _run(codes, row_scale, weight, scales, bias, x.dtype, route, DEFAULT_W4A_FP8_TUNING,
                where="W4AFP8Linear")  # fmt: skip


def fp8_linear_prepacked(
    codes: Float8e4m3fn[Tensor, "m k"],
    row_scale: Float32[Tensor, "m"],  # noqa: F821
    weight: Shaped[Tensor, "rows n"],
    scales: Float[Tensor, "groups n"],
    bias: Float[Tensor, "n"] | None,  # noqa: F821
    output_dtype: torch.dtype,
    *,
    route: W4AFP8Route | None = None,
    tuning: W4AFP8Tuning = DEFAULT_W4A_FP8_TUNING,
) -> Float[Tensor, "m n"]:
    """The grouped W4A-FP8 GEMM on already packed tokens (:func:`fp8_pack`'s outputs).

    Args:
      codes: ``(m, k)`` E4M3 codes (any row stride, unit K stride).
      row_scale: ``(m,)`` FP32 direct token scales.
      weight, scales, bias: as :func:`fp8_linear`.
      output_dtype: float16, bfloat16 or float32.
      route, tuning: as :func:`fp8_linear`.

    Returns:
      ``(m, n)`` in ``output_dtype``.

    Raises:
      TypeError, ValueError: as :func:`floatxq.w4a_fp8_linear_prepacked` (the scale's
        values are not checked: no host sync).
      RuntimeError: Triton missing, or a GPU below SM 8.9.

    Numerics: :func:`floatxq.w4a_fp8_linear_prepacked` up to FP32 summation order (see
    :func:`fp8_linear`).
    """
    where = "fp8_linear_prepacked"
    _check_route(route, where)
    if not isinstance(codes, torch.Tensor) or codes.dtype != torch.float8_e4m3fn or codes.ndim != 2:
        raise TypeError(f"{where}: codes must be a 2-D float8_e4m3fn (m, k) tensor")
    m, k = codes.shape
    if not isinstance(row_scale, torch.Tensor) or row_scale.dtype != torch.float32:
        raise TypeError(f"{where}: row_scale must be a float32 tensor")
    if tuple(row_scale.shape) != (m,):
        raise ValueError(f"{where}: row_scale must have shape ({m},), got {tuple(row_scale.shape)}")
    if output_dtype not in W4A_OUTPUT_DTYPES:
        raise TypeError(f"{where}: output_dtype must be float16, bfloat16 or float32")
    _check_operands(k, codes.device, weight, scales, bias, where=where)
    require_kernel_device((codes, row_scale), where=where, reason=w4a_fp8_unavailable_reason)
    if k and codes.stride(1) != 1:
        codes = codes.contiguous()
    return _run(codes, row_scale, weight, scales, bias, output_dtype, route, tuning, where=where)


def _blockwise_api() -> tuple[Any, Any] | None:
    """``(F.scaled_mm, ScalingType.BlockWise1x128)`` where this torch has them."""
    fn = getattr(torch.nn.functional, "scaled_mm", None)
    kinds = getattr(torch.nn.functional, "ScalingType", None)
    kind = getattr(kinds, "BlockWise1x128", None) if kinds is not None else None
    return (fn, kind) if fn is not None and kind is not None else None


def blockwise_unavailable_reason(rows: int, weight: Shaped[Tensor, "rows n"]) -> str | None:
    """Why cuBLAS's blockwise FP8 GEMM cannot take an ``rows``-row call on ``weight`` (``None``:
    it can).

    The GEMM (``F.scaled_mm`` with one scale per 1×128 block of each operand: the token scale
    repeated along K for ``x``, the GPTQ group scale for each output column) needs a multiple of
    4 rows (cuBLAS refused 129 on an H200), the staged E4M3 operand stored K-contiguous, a torch
    with ``F.scaled_mm`` and ``BlockWise1x128``, and SM 9.0+.

    Numerics: none.
    """
    if rows % 4:
        return f"{rows} rows: cuBLAS's token-scale grid needs a multiple of 4 rows"
    if weight.dtype != torch.float8_e4m3fn or weight.stride(0) != 1:
        return "cuBLAS takes the staged E4M3 operand stored K-contiguous"
    if _blockwise_api() is None:
        return "this torch has no F.scaled_mm with BlockWise1x128 scales"
    if weight.device.type != "cuda":
        return f"the weight is on {weight.device}"
    index = weight.device.index if weight.device.index is not None else torch.cuda.current_device()
    cap = fp8_weight._capability(index)
    if cap < (9, 0):
        return f"SM {cap[0]}.{cap[1]} < 9.0: cuBLAS's blockwise FP8 GEMM needs Hopper"
    return None


def _check_route(route: object, where: str) -> None:
    if route is not None and route not in W4A_FP8_GEMM_ROUTES:
        raise ValueError(
            f"{where}: route must be None or one of {W4A_FP8_GEMM_ROUTES}, got {route!r}"
        )


def _run(
    codes: Tensor,
    row_scale: Tensor,
    weight: Tensor,
    scales: Tensor,
    bias: Tensor | None,
    output_dtype: torch.dtype,
    route: str | None,
    tuning: W4AFP8Tuning,
    *,
    where: str,
) -> Tensor:
    if route == "fragment":
        reason = w4a_frag.fragment_unavailable_reason(codes.device)
        if weight.dtype != torch.int16:
            reason = f"it reads int16 fragment words, not {weight.dtype}"
        if reason is not None:
            raise RuntimeError(f"{where}: route 'fragment' cannot run here: {reason}")
        return w4a_frag.w4a_fp8_frag_gemm(codes, row_scale, weight, scales, bias, output_dtype)
    if route == "scaled_mm_blockwise":
        reason = blockwise_unavailable_reason(codes.shape[0], weight)
        if reason is not None:
            raise RuntimeError(f"{where}: route 'scaled_mm_blockwise' cannot run here: {reason}")
        if codes.shape[0] and weight.shape[1]:
            return _blockwise(codes, row_scale, weight, scales, bias, output_dtype)
    return _gemm(codes, row_scale, weight, scales, bias, output_dtype, tuning)


def _blockwise(
    codes: Tensor,
    row_scale: Tensor,
    weight: Tensor,
    scales: Tensor,
    bias: Tensor | None,
    output_dtype: torch.dtype,
) -> Tensor:
    """cuBLAS's blockwise FP8 GEMM: ``Σ_g (Σ_k a·c) · row_scale[m] · scales[g, n]`` (the
    token scale rides in each block's scale product), FP32 accumulation per block; the bias,
    where there is one, added in FP32 to an FP32 product, then one rounding."""
    fn, kind = _blockwise_api()  # type: ignore[misc]
    m, k = codes.shape
    groups = k // K_GROUP
    # both scale grids outer-dim-major: (m, k/128) and (n, k/128) with unit stride along m / n
    sa = row_scale.expand(groups, m).contiguous().t()
    sb = scales.to(torch.float32).contiguous().t()
    out_dtype = torch.float32 if bias is not None else output_dtype
    out = fn(codes, weight, sa, kind, sb, kind, output_dtype=out_dtype)
    if bias is not None:
        out = (out + bias.to(torch.float32)).to(output_dtype)
    return out


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


_PLANS: dict[Any, tuple[tuple[int, int, int], tuple[Any, ...], dict[str, Any]]] = {}


def _plan(
    m: int, n: int, groups: int, words: bool, device: torch.device, tuning: W4AFP8Tuning,
    interpret: bool,
) -> tuple[tuple[int, int, int], tuple[Any, ...], dict[str, Any]]:  # fmt: skip
    """``(grid, constexpr tail, options)`` of one GEMM launch."""
    small = words or m <= tuning.words_max_rows
    if small:
        block_m = 16 if m <= 16 else (32 if m <= 32 else 64)
        block_n = tuning.words_block_n
        tiles = -(-m // block_m) * -(-n // block_n)
        sms = fp8_small_m._sm_count(device) or 1
        split = 1
        for d in _divisors(groups):  # the largest split that stays near the target programs
            if tiles * d <= tuning.target_programs * sms:
                split = d
        warps, stages, group_m, mma_fp8 = tuning.words_warps, tuning.words_stages, 1, False
    else:
        block_m, block_n, split = tuning.e4m3_block_m, tuning.e4m3_block_n, 1
        tiles = -(-m // block_m) * -(-n // block_n)
        warps, stages, group_m, mma_fp8 = (
            tuning.e4m3_warps, tuning.e4m3_stages, tuning.e4m3_group_m, True
        )  # fmt: skip
    if interpret or words:
        mma_fp8 = False  # (the words form feeds 16-row planes to FP16 MMAs; the interpreter
        # multiplies FP8 operands in FP32 either way)
    tail = (
        words, mma_fp8, block_m, block_n, groups // split, split, group_m,
    )  # fmt: skip
    return (tiles, split, 1), tail, {"num_warps": warps, "num_stages": stages}


def _gemm(
    codes: Tensor,
    row_scale: Tensor,
    weight: Tensor,
    scales: Tensor,
    bias: Tensor | None,
    output_dtype: torch.dtype,
    tuning: W4AFP8Tuning,
) -> Tensor:
    """The GEMM launch, arguments already checked."""
    (m, k), n = codes.shape, weight.shape[1]
    device = codes.device
    out, done = new_output(m, n, k, output_dtype, device, bias)
    if done:
        return out
    if weight.dtype == torch.int16:
        return _dwords_gemm(codes, row_scale, weight, scales, bias, out, tuning)
    words = weight.dtype == torch.int32
    interpret = triton_interpret_enabled()
    key = (
        m, n, k, words, weight.stride(), scales.stride(), scales.dtype, codes.stride(0),
        None if bias is None else bias.dtype, output_dtype, device, interpret,
        None if tuning is DEFAULT_W4A_FP8_TUNING else tuning,
    )  # fmt: skip
    plan = _PLANS.get(key)
    if plan is None:
        plan = _PLANS[key] = _plan(m, n, k // K_GROUP, words, device, tuning, interpret)
    grid, tail, options = plan
    split = grid[1]
    w = weight if words else weight.view(torch.int8)
    guard, index = launch_device(device)
    with guard:
        if split > 1:
            tiles_m = -(-m // tail[2])
            part, counts, _ = fp8_small_m._workspace(
                device, index, split * m * n, tiles_m * -(-n // tail[3])
            )
        else:
            part = counts = out
        args = (
            codes.view(torch.int8), row_scale, w, scales, bias if bias is not None else scales,
            out, part, counts, m, n, k, codes.stride(0), w.stride(0), w.stride(1),
            scales.stride(0), scales.stride(1), out.stride(0), tail[0], tail[1],
            bias is not None, *tail[2:],
        )  # fmt: skip
        aligned = tuple(a.data_ptr() % 16 == 0 for a in args[:8])
        _launchers(interpret)[1]((key, aligned), grid, args, options, index)
    return out


_DWORD_PLANS: dict[Any, tuple[tuple[int, int, int], tuple[Any, ...], dict[str, Any]]] = {}


def _dwords_spec(
    codes: Tensor, words: Tensor, scales: Tensor, bias: Tensor | None, out_dtype: torch.dtype,
    tuning: W4AFP8Tuning, interpret: bool,
) -> tuple[Any, tuple[tuple[int, int, int], tuple[Any, ...], dict[str, Any]]]:  # fmt: skip
    """``(key, (grid, constexpr tail, options))`` of a decode-words launch."""
    (m, k), n, device = codes.shape, words.shape[1], codes.device
    key = (
        m, n, k, codes.stride(0), scales.dtype, scales.stride(), None if bias is None else
        bias.dtype, out_dtype, device, interpret, None if tuning is DEFAULT_W4A_FP8_TUNING else
        tuning,
    )  # fmt: skip
    plan = _DWORD_PLANS.get(key)
    if plan is None:
        wide = m >= tuning.dwords_wide_rows
        block_n = tuning.dwords_wide_block_n if wide else tuning.dwords_block_n
        if not wide and n * k <= tuning.dwords_small_weight:
            block_n = tuning.dwords_small_block_n
        stages = tuning.dwords_wide_stages if wide else tuning.dwords_stages
        target = tuning.dwords_wide_target_programs if wide else tuning.dwords_target_programs
        block_m = 16 if m <= 16 else (32 if m <= 32 else 64)
        tiles = -(-m // block_m) * -(-n // block_n)
        groups = k // K_GROUP
        sms = fp8_small_m._sm_count(device) or 1
        split = 1
        for d in _divisors(groups):  # (at least two groups a program: one alone runs slower)
            if tiles * d <= target * sms and (groups // d >= 2 or d == 1):
                split = d
        pdl = dependent_launches(device)  # (it starts while the token packing ends)
        tail = (bias is not None, not interpret, block_m, block_n, groups // split, split, pdl)
        options: dict[str, Any] = {"num_warps": 4, "num_stages": stages, "launch_pdl": pdl}
        if not interpret and not wide:
            # at most 128 registers a thread: four programs of 4 warps fit an SM. A row count
            # Triton does not specialize (2..15) otherwise compiles to 136 and runs the grid in
            # two waves (RESULTS.md: 25 against 18.6 µs at M = 2..8); ptxas spills nothing at 128.
            # (Not the wide shapes: capped, 32 rows took 49 µs against 26 uncapped.)
            options["maxnreg"] = 128
        plan = _DWORD_PLANS[key] = ((tiles, split, 1), tail, options)
    return key, plan


def _dwords_gemm(
    codes: Tensor, row_scale: Tensor, words: Tensor, scales: Tensor, bias: Tensor | None,
    out: Tensor, tuning: W4AFP8Tuning,
) -> Tensor:  # fmt: skip
    """The decode-words launch (``out`` allocated, at least one row, column and group)."""
    (m, k), n = codes.shape, words.shape[1]
    words = words.contiguous()  # (the kernel steps rows by n; the modules' words already are)
    device = codes.device
    interpret = triton_interpret_enabled()
    key, (grid, tail, options) = _dwords_spec(
        codes, words, scales, bias, out.dtype, tuning, interpret
    )
    split = grid[1]
    guard, index = launch_device(device)
    with guard:
        if split > 1:
            part, counts, _ = fp8_small_m._workspace(device, index, split * m * n, grid[0])
        else:
            part = counts = out
        args = (
            codes.view(torch.int8), row_scale, words, scales, bias if bias is not None else scales,
            out, part, counts, m, n, k, codes.stride(0), scales.stride(0), scales.stride(1),
            out.stride(0), *tail,
        )  # fmt: skip
        _dwords_launcher(interpret)(key, grid, args, options, index)
    return out


def bound_linear(
    x: Tensor, weight: Tensor, scales: Tensor, bias: Tensor | None, route: str | None
) -> Callable[[Tensor], Tensor] | None:
    """The module path's :func:`_linear` (default tuning) bound for every call on an ``x`` like
    this one (shape, dtype, strides, device, 16-byte alignment) once it has launched: the token
    packing, then the fragment (``route == "fragment"``) or decode-words (int16 ``weight``)
    GEMM of at most 32 rows. None for other forms, or where nothing is kept."""
    pack = _bound_pack(x)
    if pack is None or weight.dtype != torch.int16 or route == "scaled_mm_blockwise":
        return None
    (m, k), n, device = x.shape, scales.shape[1], x.device
    codes = torch.empty((m, k), dtype=torch.float8_e4m3fn, device=device)  # (as _pack's)
    row_scale = torch.empty((m,), dtype=torch.float32, device=device)
    if route == "fragment":
        gemm = w4a_frag.bound_fp8_gemm(codes, row_scale, weight, scales, bias, x.dtype)
    elif m <= DEFAULT_W4A_FP8_TUNING.dwords_max_rows and weight.is_contiguous():
        key, (grid, tail, _) = _dwords_spec(
            codes, weight, scales, bias, x.dtype, DEFAULT_W4A_FP8_TUNING, False
        )
        launch = _dwords_launcher(False).bind(key, grid, device.index)
        fixed = (weight, scales, bias if bias is not None else scales)
        rest = (m, n, k, k, scales.stride(0), scales.stride(1), n, *tail)
        words = launch and fp8_small_m.bound_gemm(launch, m, n, x.dtype, device, fixed, rest, grid)
        gemm = words and (lambda codes, row_scale: words(codes.view(torch.int8), row_scale))
    else:
        return None
    if not gemm:
        return None
    return lambda x: gemm(*pack(x))
