"""Triton W4A16: GPTQ weights decoded in registers and multiplied in ``x``'s dtype.

Twin of :func:`floatxq.w4a16_linear` (what :class:`floatxq.nn.GPTQLinear` computes): every
weight element is decoded exactly as :func:`floatxq.dequantize_gptq` decodes it (an FP32
product ``scale · (code - zero)`` rounded once to ``x``'s float16/bfloat16), so the kernels
multiply the very operands of the reference and differ from it only in FP32 summation order.

Two routes (the caller picks; :func:`floatxq.dispatch.w4a16_route` names the faster for a row
count):

``w4a16_fused`` (decode-sized calls)
    one launch: each program streams its ``BLOCK_K × BLOCK_N`` tiles of the packed words
    (``bits / 8`` bytes per weight), unpacks and decodes them in registers and feeds the
    tensor cores with FP32 accumulation; K is split over programs so a few rows fill the GPU.
``w4a16_decode_gemm`` (prefill-sized calls)
    :func:`dequantize_gptq_kernel` writes the decoded weight once (a pass over ``2 · K · N``
    bytes), then the library GEMM multiplies at its full rate; for thousands of rows the
    decode is a few percent of the product.

Both read 2, 4 or 8-bit words in either zero-point convention, contiguous groups of any size
(every ``group_size`` that is a multiple of the tile) or any ``g_idx`` (``desc_act``
checkpoints: each row's group gathered). Launch shapes come from a frozen :class:`W4A16Tuning`.
"""

import dataclasses
import functools
from collections.abc import Callable
from typing import Any, Literal

import torch
import torch.nn.functional as F

from floatxq._typing import Float, Tensor
from floatxq.formats import normalize_gptq_format
from floatxq.gptq.decode_words import DecodeOperands, gptq_decode_operands
from floatxq.gptq.fragment_words import stage_fragment_words
from floatxq.gptq.int4 import GPTQPacked, _check_bits, _check_packed
from floatxq.kernels import fp8_small_m, w4a_frag
from floatxq.kernels._triton import (
    CachedLauncher,
    import_kernel_sources,
    launch_device,
    new_output,
    require_kernel_device,
    triton_interpret_enabled,
)

__all__ = [
    "DEFAULT_W4A16_TUNING",
    "W4A16Tuning",
    "dequantize_gptq_kernel",
    "w4a16_linear_kernel",
]

W4A16Route = Literal["w4a16_frag", "w4a16_words", "w4a16_fused", "w4a16_decode_gemm"]
W4A16_ROUTES = ("w4a16_frag", "w4a16_words", "w4a16_fused", "w4a16_decode_gemm")
_DTYPES = (torch.float16, torch.bfloat16)


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class W4A16Tuning:
    """Launch shapes of the W4A16 kernels (defaults measured on an H200).

    Raises:
      ValueError: a tile that is not a power of two >= 16, or a count below 1.

    Numerics: none; results agree for every tuning up to FP32 summation order.

    Example:
      >>> W4A16Tuning(fused_max_rows=32).fused_max_rows
      32
    """

    fused_max_rows: int = 64
    """Largest row count for which :func:`floatxq.dispatch.w4a16_route` picks the fused route
    (above it: decode, then the library GEMM)."""
    block_n: int = 64
    block_k: int = 128
    warps: int = 4
    stages: int = 3
    target_programs: int = 4
    """K is split until about this many programs per SM are launched."""
    decode_block_k: int = 64
    decode_block_n: int = 128
    decode_warps: int = 4
    words_max_rows: int = 32
    """Largest row count for which :func:`floatxq.dispatch.w4a16_route` picks the decode-words
    route (when the module holds its decode words)."""
    words_block_n: int = 64
    """Output columns a decode-words program computes (measured on the Llama-3-8B layer shapes
    and 8192 × 8192 at 16 rows, ``benchmarks/w4a_tuning_sweep.py``: within 3% of the fastest
    shape on each, up to 2.4× faster than 256 on narrow layers)."""
    words_warps: int = 4
    words_stages: int = 3
    words_target_programs: int = 2

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"W4A16Tuning: {f.name} must be an int >= 1, got {value!r}")
        for name in ("block_n", "block_k", "decode_block_k", "decode_block_n", "words_block_n"):
            value = getattr(self, name)
            if value < 16 or value & (value - 1):
                raise ValueError(f"W4A16Tuning: {name} must be a power of two >= 16, got {value}")


DEFAULT_W4A16_TUNING = W4A16Tuning()


def _tuning_key(tuning: W4A16Tuning) -> W4A16Tuning | None:
    """The tuning's part of a plan key: ``None`` for the default (hashing a record field by
    field costs microseconds a decode-sized call should not pay)."""
    return None if tuning is DEFAULT_W4A16_TUNING else tuning


@functools.cache
def _launchers(interpret: bool) -> tuple[CachedLauncher, CachedLauncher]:
    sources = import_kernel_sources(
        "floatxq.kernels._w4a_jit", interpret=interpret, where="floatxq.kernels.w4a16"
    )
    return CachedLauncher(sources.w4a16_kernel), CachedLauncher(sources.gptq_decode_kernel)


@functools.cache
def _words_launcher(interpret: bool) -> CachedLauncher:
    sources = import_kernel_sources(
        "floatxq.kernels._w4a_words_jit", interpret=interpret, where="floatxq.kernels.w4a16"
    )
    return CachedLauncher(sources.w4a16_words_kernel)


def _checked(
    packed: GPTQPacked, bits: int, format: str, group_size: int | None, *, where: str
) -> tuple[int, int, int, bool, int]:
    """``(k, n, bits, v1, group_size or 0)`` after the argument checks (no host sync when
    ``group_size`` is given: the caller vouches that ``g_idx == arange(k) // group_size``)."""
    bits = _check_bits(bits, where=where)
    fmt = normalize_gptq_format(format, where=where)
    if group_size is None:
        k, n, _ = _check_packed(packed, where=where, bits=bits)
        return k, n, bits, fmt == "gptq", 0
    if not isinstance(group_size, int) or isinstance(group_size, bool) or group_size < 1:
        raise ValueError(f"{where}: group_size must be a positive int or None, got {group_size!r}")
    qweight, qzeros, scales = packed.qweight, packed.qzeros, packed.scales
    k, n = qweight.shape[0] * 32 // bits, qweight.shape[1]
    groups = -(-k // group_size)
    if tuple(qzeros.shape) != (groups, n * bits // 32) or tuple(scales.shape) != (groups, n):
        raise ValueError(
            f"{where}: qzeros {tuple(qzeros.shape)} and scales {tuple(scales.shape)} do not "
            f"fit k={k}, n={n}, group_size={group_size}"
        )
    return k, n, bits, fmt == "gptq", group_size


def _tile_k(group_size: int, k: int, preferred: int) -> tuple[int, bool]:
    """``(BLOCK_K, gather)``: the widest power-of-two tile (16..preferred) that divides the
    group size (so a tile lies in one group), else gathering each row's group."""
    if group_size:
        tile = preferred
        while tile >= 16:
            if group_size % tile == 0 or group_size >= k:
                return tile, False
            tile //= 2
    return preferred, True


def dequantize_gptq_kernel(
    packed: GPTQPacked,
    *,
    bits: int = 4,
    format: str = "gptq",
    dtype: torch.dtype = torch.bfloat16,
    group_size: int | None = None,
    tuning: W4A16Tuning = DEFAULT_W4A16_TUNING,
) -> Float[Tensor, "out in"]:
    """:func:`floatxq.dequantize_gptq` in one launch.

    Args:
      packed: a :class:`floatxq.GPTQPacked` on CUDA.
      bits: 2, 4 or 8. format: ``"gptq"`` (v1) or ``"gptq_v2"``.
      dtype: float16 or bfloat16.
      group_size: the contiguous group size the caller guarantees (``g_idx == arange(in) //
        group_size``; ``in`` for one group), or None to read each row's group from ``g_idx``.
      tuning: launch shapes.

    Returns:
      ``(out, in)`` in ``dtype``: the transposed view of a contiguous ``(in, out)`` tensor.

    Raises:
      TypeError, ValueError: as :func:`floatxq.dequantize_gptq`; another dtype.
      RuntimeError: Triton missing.

    Numerics: bit for bit :func:`floatxq.dequantize_gptq`.
    """
    where = "dequantize_gptq_kernel"
    if dtype not in _DTYPES:
        raise TypeError(f"{where}: dtype must be float16 or bfloat16, got {dtype!r}")
    k, n, bits, v1, group = _checked(packed, bits, format, group_size, where=where)
    device = require_kernel_device(tuple(packed), where=where)
    return _decode(packed, k, n, bits, v1, group, dtype, device, tuning).T


def _decode(
    packed: GPTQPacked, k: int, n: int, bits: int, v1: bool, group: int, dtype: torch.dtype,
    device: torch.device, tuning: W4A16Tuning,
) -> Tensor:  # fmt: skip
    qweight, qzeros, scales, g_idx = packed
    w = torch.empty((k, n), dtype=dtype, device=device)
    if k == 0 or n == 0:
        return w
    block_k, gather = _tile_k(group, k, tuning.decode_block_k)
    block_n = tuning.decode_block_n
    interpret = triton_interpret_enabled()
    grid = (-(-k // block_k), -(-n // block_n), 1)
    args = (
        qweight, qzeros, scales, g_idx, w, k, n, group or k, *qweight.stride(),
        *qzeros.stride(), *scales.stride(), bits, v1, gather, block_k, block_n,
    )  # fmt: skip
    key = (k, n, bits, v1, gather, group, scales.dtype, dtype, qweight.stride(),
           qzeros.stride(), scales.stride(), device, interpret, _tuning_key(tuning))  # fmt: skip
    guard, index = launch_device(device)
    with guard:
        _launchers(interpret)[1](key, grid, args, {"num_warps": tuning.decode_warps}, index)
    return w


_PLANS: dict[Any, tuple[tuple[int, int, int], tuple[Any, ...], dict[str, Any]]] = {}


def w4a16_linear_kernel(
    x: Float[Tensor, "m k"],
    packed: GPTQPacked,
    bias: Float[Tensor, "n"] | None = None,  # noqa: F821
    *,
    bits: int = 4,
    format: str = "gptq",
    group_size: int | None = None,
    route: W4A16Route | None = None,
    tuning: W4A16Tuning = DEFAULT_W4A16_TUNING,
    operands: DecodeOperands | None = None,
) -> Float[Tensor, "m n"]:
    """:func:`floatxq.w4a16_linear` on CUDA.

    Args:
      x: ``(m, k)`` float16/bfloat16 CUDA activations (any strides).
      packed: the GPTQ tensors on ``x``'s device.
      bias: ``(n,)`` floating or None.
      bits, format: as :func:`floatxq.dequantize_gptq`.
      group_size: the contiguous group size the caller guarantees, or None (gather by
        ``g_idx``; see :func:`dequantize_gptq_kernel`).
      route: ``"w4a16_fused"`` (also for None), ``"w4a16_words"`` (4-bit, contiguous groups:
        the decode words of :mod:`floatxq.gptq.decode_words`), ``"w4a16_frag"`` (the same, in
        the order of :mod:`floatxq.gptq.fragment_words`, read by
        :mod:`floatxq.kernels.w4a_frag`; staged for this call) or ``"w4a16_decode_gemm"``;
        :func:`floatxq.dispatch.w4a16_route` names the faster for a row count.
      tuning: launch shapes.
      operands: the routes ``"w4a16_words"`` / ``"w4a16_frag"``'s staged operands for ``x``'s
        dtype (:func:`floatxq.gptq.decode_words.gptq_decode_operands`; staged here when None).

    Returns:
      ``(m, n)`` in ``x.dtype``.

    Raises:
      TypeError, ValueError: wrong dtypes, shapes, devices (as the pure function); an unknown
        route; ``"w4a16_words"`` / ``"w4a16_frag"`` for a weight they cannot read exactly (the
        reason named).
      RuntimeError: Triton missing; ``"w4a16_frag"`` where the fragment kernels cannot run
        (:func:`floatxq.kernels.w4a_frag.fragment_unavailable_reason`).

    Numerics: the reference's decoded operands (bit for bit), FP32 accumulation in another
    order, the bias (in ``x``'s dtype) added in FP32 (the fused and words routes) or by the
    library GEMM, one rounding.
    """
    where = "w4a16_linear_kernel"
    if route is not None and route not in W4A16_ROUTES:
        raise ValueError(f"{where}: route must be None or one of {W4A16_ROUTES}, got {route!r}")
    if not isinstance(x, torch.Tensor) or x.ndim != 2 or x.dtype not in _DTYPES:
        got = f"{x.dtype} {tuple(x.shape)}" if isinstance(x, torch.Tensor) else type(x).__name__
        raise TypeError(f"{where}: x must be a 2-D float16/bfloat16 tensor, got {got}")
    k, n, bits, v1, group = _checked(packed, bits, format, group_size, where=where)
    if x.shape[1] != k:
        raise ValueError(f"{where}: x must have shape (m, {k}), got {tuple(x.shape)}")
    if bias is not None and (
        not isinstance(bias, torch.Tensor) or not bias.is_floating_point() or bias.shape != (n,)
    ):
        raise ValueError(f"{where}: bias must be a floating ({n},) tensor")
    extra = (bias,) if bias is not None else ()
    device = require_kernel_device((x, *packed, *extra), where=where)
    if route in ("w4a16_words", "w4a16_frag"):
        if bits != 4 or not group:
            raise ValueError(f"{where}: the route {route!r} reads 4-bit contiguous groups")
        if operands is None:
            operands, why = gptq_decode_operands(
                packed, format="gptq" if v1 else "gptq_v2", group_size=group, dtype=x.dtype
            )
            if operands is None:
                raise ValueError(f"{where}: the route {route!r} cannot run: {why}")
        # (the kernel steps the operands' rows by n; staged ones already are contiguous)
        operands = DecodeOperands(*(t.contiguous() for t in operands))
        if route == "w4a16_words":
            return _words_linear(x, operands, packed.scales, bias, k, n, group, device, tuning)
        why = w4a_frag.fragment_unavailable_reason(device)
        if why is not None:
            raise RuntimeError(f"{where}: the route 'w4a16_frag' cannot run: {why}")
        frag = stage_fragment_words(operands.words)
        has_lo = packed.scales.dtype != x.dtype
        return w4a_frag.w4a16_frag_linear(x, frag, operands, bias, k, n, group, device, has_lo)
    return _linear(x, packed, bias, k, n, bits, v1, group, device, route, tuning)


def _even_split(steps: int, tiles: int, programs: int) -> int:
    """The largest divisor of ``steps`` (K steps) that keeps ``tiles`` times it within
    ``programs`` (about the programs the GPU runs at once): an even split of K."""
    fits = [d for d in range(1, steps + 1) if steps % d == 0 and tiles * d <= programs]
    return max(fits, default=1)


_WORD_PLANS: dict[Any, tuple[tuple[int, int, int], tuple[Any, ...], dict[str, Any]]] = {}


def _words_spec(
    x: Tensor, ops: DecodeOperands, bias: Tensor | None, k: int, n: int, group: int,
    device: torch.device, tuning: W4A16Tuning, interpret: bool,
) -> tuple[Any, tuple[tuple[int, int, int], tuple[Any, ...], dict[str, Any]]]:  # fmt: skip
    """``(key, (grid, constexpr tail, options))`` of a decode-words launch (the key holds what
    a compiled launch is specialized on: strides and 16-byte alignment too)."""
    m = x.shape[0]
    key = (
        m, n, k, group, x.dtype, x.stride(), x.data_ptr() % 16 == 0, bias is not None and
        (bias.dtype, bias.data_ptr() % 16 == 0), device, interpret, _tuning_key(tuning),
    )  # fmt: skip
    plan = _WORD_PLANS.get(key)
    if plan is None:
        block_m = 16 if m <= 16 else (32 if m <= 32 else 64)
        block_n = tuning.words_block_n
        tiles = -(-m // block_m) * -(-n // block_n)
        steps = ops.words.shape[0] // 32
        sms = fp8_small_m._sm_count(device) or 1
        split = _even_split(steps, tiles, tuning.words_target_programs * sms)
        per_tile = group >= k or group % 128 == 0
        tail = (group, per_tile, bias is not None, not interpret, block_m, block_n,
                steps // split, split)  # fmt: skip
        options = {"num_warps": tuning.words_warps, "num_stages": tuning.words_stages}
        plan = _WORD_PLANS[key] = ((tiles, split, 1), tail, options)
    return key, plan


def _words_args(
    x: Tensor, ops: DecodeOperands, scales: Tensor, bias: Tensor | None, k: int, n: int,
    tail: tuple[Any, ...],
) -> tuple[tuple[Any, ...], tuple[Any, ...]]:  # fmt: skip
    """The decode-words launch's ``(tensors after x, arguments after the workspace)``."""
    fixed = (ops.words, ops.zeros, ops.hi, ops.lo, scales, bias if bias is not None else ops.hi)
    rest = (x.shape[0], n, k, ops.zeros.shape[0], x.stride(0), x.stride(1), n, *tail)
    return fixed, rest


def _words_linear(
    x: Tensor, ops: DecodeOperands, scales: Tensor, bias: Tensor | None, k: int, n: int,
    group: int, device: torch.device, tuning: W4A16Tuning,
) -> Tensor:  # fmt: skip
    """The decode-words launch, arguments already checked and the operands contiguous
    (``GPTQLinear`` calls this with the operands it staged)."""
    m = x.shape[0]
    out, done = new_output(m, n, k, x.dtype, device, bias)
    if done:
        return out
    interpret = triton_interpret_enabled()
    key, (grid, tail, options) = _words_spec(x, ops, bias, k, n, group, device, tuning, interpret)
    fixed, rest = _words_args(x, ops, scales, bias, k, n, tail)
    split = grid[1]
    guard, index = launch_device(device)
    with guard:
        if split > 1:
            part, counts, _ = fp8_small_m._workspace(device, index, split * m * n, grid[0])
        else:
            part = counts = out
        _words_launcher(interpret)(key, grid, (x, *fixed, out, part, counts, *rest), options,
                                   index)  # fmt: skip
    return out


def bound_linear(
    x: Tensor, route: str, ops: DecodeOperands, frag: Tensor | None, scales: Tensor,
    bias: Tensor | None, k: int, n: int, group: int,
) -> Callable[[Tensor], Tensor] | None:  # fmt: skip
    """``GPTQLinear``'s ``"w4a16_frag"`` or ``"w4a16_words"`` launch (default tunings) bound for
    every call on an ``x`` like this one (shape, dtype, strides, device, alignment) once it has
    launched; None for other routes, no rows, columns or K, or where nothing is kept."""
    device, m = x.device, x.shape[0]
    if device.type != "cuda" or triton_interpret_enabled() or not (m and n and k):
        return None
    if route == "w4a16_frag" and frag is not None:
        return w4a_frag.bound_w4a16(x, frag, ops, bias, k, n, group, scales.dtype != x.dtype)
    if route != "w4a16_words":
        return None
    key, (grid, tail, _) = _words_spec(
        x, ops, bias, k, n, group, device, DEFAULT_W4A16_TUNING, False
    )
    launch = _words_launcher(False).bind(key, grid, device.index)
    if launch is None:
        return None
    fixed, rest = _words_args(x, ops, scales, bias, k, n, tail)
    return fp8_small_m.bound_gemm(launch, m, n, x.dtype, device, fixed, rest, grid)


def _linear(
    x: Tensor, packed: GPTQPacked, bias: Tensor | None, k: int, n: int, bits: int, v1: bool,
    group: int, device: torch.device, route: str | None, tuning: W4A16Tuning,
) -> Tensor:  # fmt: skip
    """The launch(es), arguments already checked (``GPTQLinear`` calls this directly)."""
    m = x.shape[0]
    if route == "w4a16_decode_gemm":
        w = _decode(packed, k, n, bits, v1, group, x.dtype, device, tuning)
        return F.linear(x, w.T, None if bias is None else bias.to(x.dtype))
    out, done = new_output(m, n, k, x.dtype, device, bias)
    if done:
        return out
    qweight, qzeros, scales, g_idx = packed
    interpret = triton_interpret_enabled()
    key = (
        m, n, k, bits, v1, group, x.dtype, x.stride(), scales.dtype, qweight.stride(),
        qzeros.stride(), scales.stride(), None if bias is None else bias.dtype, device,
        interpret, _tuning_key(tuning),
    )  # fmt: skip
    plan = _PLANS.get(key)
    if plan is None:
        block_k, gather = _tile_k(group, k, tuning.block_k)
        block_m = 16 if m <= 16 else (32 if m <= 32 else 64)
        block_n = tuning.block_n
        tiles = -(-m // block_m) * -(-n // block_n)
        steps = -(-k // block_k)
        sms = fp8_small_m._sm_count(device) or 1
        split = _even_split(steps, tiles, tuning.target_programs * sms)
        tail = (bits, v1, gather, bias is not None, block_m, block_n, block_k, steps // split,
                split)  # fmt: skip
        options = {"num_warps": tuning.warps, "num_stages": tuning.stages}
        plan = _PLANS[key] = ((tiles, split, 1), tail, options)
    grid, tail, options = plan
    split = grid[1]
    guard, index = launch_device(device)
    with guard:
        if split > 1:
            part, counts, _ = fp8_small_m._workspace(device, index, split * m * n, grid[0])
        else:
            part = counts = out
        args = (
            x, qweight, qzeros, scales, g_idx, bias if bias is not None else scales, out, part,
            counts, m, n, k, group or k, x.stride(0), x.stride(1), *qweight.stride(),
            *qzeros.stride(), *scales.stride(), out.stride(0), *tail,
        )  # fmt: skip
        aligned = tuple(a.data_ptr() % 16 == 0 for a in args[:9])
        _launchers(interpret)[0]((key, aligned), grid, args, options, index)
    return out
