"""Triton NVFP4 decodes and the W4A-NVFP4 group accumulation, each bit for bit its pure twin.

``nvfp4_decode``
    :func:`floatxq.nvfp4_decode_swizzled`: an activation operand (packed codes,
    block scales swizzled per 128-wide K group) back to ``(rows, width)``.
``nvfp4_dequantize_kernel``
    :func:`floatxq.nvfp4_dequantize`: a weight in the ModelOpt layout (packed codes,
    row-major block scales), as :class:`floatxq.nn.TorchFP4Linear` stores it.
``nvfp4_accumulate_group``
    :func:`floatxq.w4a_nvfp4_accumulate_group`: one 128-row group of the W4A-NVFP4 GEMM
    folded into the running FP32 sum, compiled without fused multiply-adds.

The host checks the same shapes, dtypes and devices as the pure functions, with the same
exception kinds, but reads no value held on the device (no host sync): NaN or negative block
scale bytes decode to NaN or negative values where the pure functions raise, and a global scale
given as a tensor is used as it is (a Python number is checked on the host, as the pure
functions check it). Launch shapes come from a frozen :class:`NVFP4DecodeTuning`.
"""

import dataclasses
import functools
import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from floatxq._checks import real_scalar, require_data, require_tensor
from floatxq._typing import Float, Float8e4m3fn, Float32, Shaped, Tensor
from floatxq.formats import FLOAT32_MAX, MODEL_DTYPES, NVFP4_BLOCK
from floatxq.kernels._triton import (
    CachedLauncher,
    import_kernel_sources,
    launch_device,
    require_kernel_device,
    triton_interpret_enabled,
)
from floatxq.nvfp4.operand import _check_decode_operands
from floatxq.nvfp4.quantize import _validated_global_scale
from floatxq.w4a.linear import _check_accumulate_operands

__all__ = [
    "DEFAULT_NVFP4_DECODE_TUNING",
    "NVFP4DecodeTuning",
    "nvfp4_accumulate_group",
    "nvfp4_decode",
    "nvfp4_dequantize_kernel",
    "torchao_nvfp4_linear",
]

_FP4X2 = getattr(torch, "float4_e2m1fn_x2", None)
_E4M3 = torch.float8_e4m3fn
_CPU = torch.device("cpu")


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class NVFP4DecodeTuning:
    """Launch shapes of the NVFP4 decode and accumulation kernels.

    Raises:
      ValueError: a tile that is not a power of two, or a count below 1.

    Numerics: none; every element is computed on its own, so results are the same for every
    tuning.

    Example:
      >>> NVFP4DecodeTuning(decode_block_k=256).decode_block_k
      256
    """

    decode_block_rows: int = 16
    decode_block_k: int = 128
    decode_warps: int = 4
    accumulate_block_m: int = 32
    accumulate_block_n: int = 128
    accumulate_warps: int = 4

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"NVFP4DecodeTuning: {f.name} must be an int >= 1, got {value!r}")
        for name in ("decode_block_rows", "decode_block_k", "accumulate_block_m",
                     "accumulate_block_n"):  # fmt: skip
            value = getattr(self, name)
            if value & (value - 1):
                raise ValueError(f"NVFP4DecodeTuning: {name} must be a power of two, got {value}")


DEFAULT_NVFP4_DECODE_TUNING = NVFP4DecodeTuning()


@functools.cache
def _launchers(interpret: bool) -> tuple[CachedLauncher, CachedLauncher]:
    sources = import_kernel_sources(
        "floatxq.kernels._nvfp4_decode_jit",
        interpret=interpret,
        where="floatxq.kernels.nvfp4_decoding",
    )
    return CachedLauncher(sources.nvfp4_decode_kernel), CachedLauncher(
        sources.nvfp4_accumulate_kernel
    )


def _scalar_or_tensor(
    global_scale: Any, *, where: str, checked: bool
) -> tuple[Tensor | None, float]:
    """``(tensor, 0.0)`` for a one-element FP32 tensor (its value is not read), or ``(None,
    value)`` for a real number, rounded to FP32 on the host (and, when ``checked``, required
    positive and finite, as the pure decode requires)."""
    if isinstance(global_scale, torch.Tensor):
        require_data(global_scale, name="global_scale", where=where)
        if global_scale.dtype != torch.float32:
            raise TypeError(
                f"{where}: global_scale must be a float32 tensor (or a Python number), got "
                f"dtype {global_scale.dtype}"
            )
        if global_scale.numel() != 1:
            raise ValueError(
                f"{where}: global_scale must hold one value (shape () or (1,)), got shape "
                f"{tuple(global_scale.shape)}"
            )
        return global_scale, 0.0
    if checked:
        g = _validated_global_scale(global_scale, _CPU, where=where)
    else:
        g = real_scalar(global_scale, name="global_scale", where=where, device=_CPU)
    return None, float(g)


def _tuning_key(tuning: NVFP4DecodeTuning) -> NVFP4DecodeTuning | None:
    """The tuning's part of a launch key: ``None`` for the default (cheaper to hash)."""
    return None if tuning is DEFAULT_NVFP4_DECODE_TUNING else tuning


def _aligned(*tensors: Tensor) -> tuple[bool, ...]:
    """The 16-byte alignment of each pointer (what Triton specializes a compiled kernel on)."""
    return tuple(t.data_ptr() % 16 == 0 for t in tensors)


def _decode_spec(
    codes: Tensor, scales: Tensor, gs: Tensor | None, rows: int, k: int, out_dtype: torch.dtype,
    swizzled: bool, device: torch.device, tuning: NVFP4DecodeTuning, interpret: bool,
) -> tuple[Any, tuple[int, int, int], tuple[Any, ...], dict[str, Any]]:  # fmt: skip
    """``(key, grid, arguments after the output, options)`` of a decode launch."""
    limit = min(float(torch.finfo(out_dtype).max), FLOAT32_MAX)
    block_r, block_k = tuning.decode_block_rows, tuning.decode_block_k
    grid = (-(-rows // block_r), -(-k // block_k), 1)
    tail = (
        rows, k, *codes.stride(), *scales.stride(), k, limit, swizzled, gs is not None, block_r,
        block_k,
    )  # fmt: skip
    key = (
        rows, k, codes.stride(), scales.stride(), out_dtype, swizzled, gs is not None,
        _aligned(codes, scales, *(() if gs is None else (gs,))), device, interpret,
        _tuning_key(tuning),
    )  # fmt: skip
    return key, grid, tail, {"num_warps": tuning.decode_warps, "enable_fp_fusion": False}


def _launch_decode(
    codes: Tensor, scales: Tensor, gs: Tensor | None, gs_value: float, rows: int, k: int,
    out_dtype: torch.dtype, swizzled: bool, device: torch.device, tuning: NVFP4DecodeTuning,
) -> Tensor:  # fmt: skip
    """The decode launch over ``(rows, k)`` (``rows, k > 0``), arguments already checked."""
    out = torch.empty((rows, k), dtype=out_dtype, device=device)
    interpret = triton_interpret_enabled()
    key, grid, tail, options = _decode_spec(
        codes, scales, gs, rows, k, out_dtype, swizzled, device, tuning, interpret
    )
    guard, index = launch_device(device)
    with guard:
        args = (codes, scales, out if gs is None else gs, gs_value, out, *tail)
        _launchers(interpret)[0](key, grid, args, options, index)
    return out


def bound_linear(
    x: Tensor, packed: Tensor, block_scales: Tensor, global_scale: Tensor, bias: Tensor | None
) -> Callable[[Tensor], Tensor] | None:
    """``TorchFP4Linear``'s ``"triton_decode"`` call — the weight decoded in ``x``'s dtype by
    :func:`nvfp4_dequantize_kernel` (default tuning), then ``F.linear`` — bound for every ``x``
    like this one (of at most 32 rows: decode-sized calls, where host time shows) once the
    decode has launched; None where nothing is kept. ``packed`` and
    ``block_scales``: the module's contiguous ``(out, in/2)`` and ``(out, in/16)`` buffers,
    ``global_scale`` its one-element FP32 tensor (all checked when they were loaded)."""
    device, dtype = x.device, x.dtype
    if device.type != "cuda" or triton_interpret_enabled() or not packed.is_contiguous():
        return None
    if not 0 < x.numel() <= 32 * x.shape[-1]:
        return None
    rows, k = packed.shape[0], 2 * packed.shape[1]
    codes, scales = packed.view(torch.uint8), block_scales.view(torch.uint8)
    key, grid, tail, _ = _decode_spec(
        codes, scales, global_scale, rows, k, dtype, False, device, DEFAULT_NVFP4_DECODE_TUNING,
        False,
    )  # fmt: skip
    launch = _launchers(False)[0].bind(key, grid, device.index)
    if launch is None or not (rows and k):
        return None

    def linear(x: Tensor) -> Tensor:
        weight = torch.empty((rows, k), dtype=dtype, device=device)
        launch(codes, scales, global_scale, 0.0, weight, *tail)
        return F.linear(x, weight, None if bias is None else bias.to(dtype))

    return linear


def torchao_nvfp4_linear(
    x: Tensor, packed: Tensor, block_scales: Tensor, global_scale: Tensor, bias: Tensor | None
) -> Tensor:
    """``F.linear`` of ``x`` and torchao's weight-only ``NVFP4Tensor`` of a ``TorchFP4Linear``'s
    buffers (``x`` stays as it is; torchao decodes the weight with its own rounding order).

    Raises:
      Exception: whatever torchao raises (missing, or a shape or device it does not take)."""
    from torchao.prototype.mx_formats.nvfp4_tensor import NVFP4Tensor

    weight = NVFP4Tensor(  # torchao 0.18's constructor (positional: the layout)
        packed,
        block_scales,
        NVFP4_BLOCK,
        x.dtype,
        per_tensor_scale=global_scale,
        is_swizzled_scales=False,
    )
    return F.linear(x, weight, bias)


def nvfp4_decode(
    codes: Shaped[Tensor, "rows half"],
    scales: Float8e4m3fn[Tensor, "groups padded"],
    global_scale: Float32[Tensor, "*one"] | float,
    width: int,
    out_dtype: torch.dtype,
    *,
    tuning: NVFP4DecodeTuning = DEFAULT_NVFP4_DECODE_TUNING,
) -> Float[Tensor, "rows {width}"]:
    """:func:`floatxq.nvfp4_decode_swizzled` in one launch.

    Args:
      codes, scales, width, out_dtype: as the pure function (codes uint8 or ``float4_e2m1fn_x2``,
        any strides).
      global_scale: a one-element FP32 tensor on the codes' device (not read on the host), or a
        positive finite number.
      tuning: launch shapes.

    Returns:
      ``(rows, width)`` in ``out_dtype``, contiguous (no rows: empty, without a launch).

    Raises:
      ValueError, TypeError: as the pure function; a global-scale tensor of several values or not
        float32; tensors on different devices or on CPU (without ``TRITON_INTERPRET=1``).
      RuntimeError: Triton missing.

    Numerics: bit for bit the pure decode on the scales it accepts (exact code-scale product, one
    FP32 rounding for the global scale, a clamp to ``out_dtype``'s range, one nearest-even
    rounding). Unchecked on the device: a NaN scale byte (0x7F, 0xFF) or global scale decodes to
    NaN, a negative one to values of the opposite sign.

    Example:
      >>> codes = torch.full((1, 64), 0x55, dtype=torch.uint8, device="cuda")  # doctest: +SKIP
      >>> scales = torch.zeros(1, 1024, device="cuda").to(torch.float8_e4m3fn)  # doctest: +SKIP
      >>> nvfp4_decode(codes, scales, 1.0, 128, torch.float32).shape  # doctest: +SKIP
      torch.Size([1, 128])
    """
    where = "nvfp4_decode"
    rows = _check_decode_operands(codes, scales, width, out_dtype, where=where)
    require_data(codes, name="codes", where=where)
    require_data(scales, name="scales", where=where)
    gs, gs_value = _scalar_or_tensor(global_scale, where=where, checked=True)
    extra = () if gs is None else (gs,)
    device = require_kernel_device((codes, scales, *extra), where=where)
    if rows == 0:
        return torch.empty((0, width), dtype=out_dtype, device=device)
    return _launch_decode(
        codes.view(torch.uint8), scales.view(torch.uint8), gs, gs_value, rows, width, out_dtype,
        True, device, tuning,
    )  # fmt: skip


def nvfp4_dequantize_kernel(
    packed: Shaped[Tensor, "*b half"],
    block_scales: Float8e4m3fn[Tensor, "*b half//8"],
    global_scale: Float32[Tensor, "*one"] | float,
    *,
    dtype: torch.dtype = torch.float32,
    tuning: NVFP4DecodeTuning = DEFAULT_NVFP4_DECODE_TUNING,
) -> Float[Tensor, "*b 2*half"]:
    """:func:`floatxq.nvfp4_dequantize` in one launch (the ModelOpt weight layout).

    Args:
      packed: ``(*b, k/2)`` uint8 or ``float4_e2m1fn_x2`` (even element in the low nibble).
      block_scales: ``float8_e4m3fn (*b, k/16)``.
      global_scale: a one-element FP32 tensor on the codes' device (not read on the host), or a
        positive finite number.
      dtype: float16, bfloat16 or float32.
      tuning: launch shapes.

    Returns:
      ``(*b, k)`` in ``dtype``, contiguous.

    Raises:
      ValueError, TypeError: a 0-d ``packed``, mismatched shapes or dtypes, meta tensors, a
        global scale of several values, not float32, or not positive and finite; tensors on
        different devices or on CPU (without ``TRITON_INTERPRET=1``).
      RuntimeError: Triton missing.

    Numerics: bit for bit the pure decode, unchecked on the device as :func:`nvfp4_decode`.

    Example:
      >>> packed = torch.full((2, 8), 0x21, dtype=torch.uint8, device="cuda")  # doctest: +SKIP
      >>> scales = torch.ones(2, 1, device="cuda").to(torch.float8_e4m3fn)  # doctest: +SKIP
      >>> nvfp4_dequantize_kernel(packed, scales, 2.0)[0, :2].tolist()  # doctest: +SKIP
      [1.0, 2.0]
    """
    where = "nvfp4_dequantize_kernel"
    require_tensor(packed, name="packed", where=where)
    require_data(packed, name="packed", where=where)
    if packed.dtype not in (torch.uint8, _FP4X2):
        raise TypeError(f"{where}: packed must be uint8 or float4_e2m1fn_x2, got {packed.dtype}")
    if packed.ndim == 0:
        raise ValueError(f"{where}: packed must have at least one axis, got a 0-d tensor")
    require_tensor(block_scales, name="block_scales", where=where)
    if block_scales.dtype != _E4M3:
        raise TypeError(f"{where}: block_scales must be float8_e4m3fn, got {block_scales.dtype}")
    require_data(block_scales, name="block_scales", where=where)
    *batch, half = packed.shape
    k = 2 * half
    if k % NVFP4_BLOCK or tuple(block_scales.shape) != (*batch, k // NVFP4_BLOCK):
        raise ValueError(
            f"{where}: block_scales shape {tuple(block_scales.shape)} does not match "
            f"codes of shape {(*batch, k)} (expected (*b, k/16))"
        )
    if dtype not in MODEL_DTYPES:
        raise TypeError(f"{where}: dtype must be float16, bfloat16 or float32, got {dtype!r}")
    gs, gs_value = _scalar_or_tensor(global_scale, where=where, checked=True)
    extra = () if gs is None else (gs,)
    device = require_kernel_device((packed, block_scales, *extra), where=where)
    rows = math.prod(batch)
    if rows == 0 or k == 0:
        return torch.empty((*batch, k), dtype=dtype, device=device)
    codes = packed.view(torch.uint8).reshape(rows, half)
    scales = block_scales.view(torch.uint8).reshape(rows, k // NVFP4_BLOCK)
    out = _launch_decode(codes, scales, gs, gs_value, rows, k, dtype, False, device, tuning)
    return out.reshape(*batch, k)


def nvfp4_accumulate_group(
    both: Float32[Tensor, "m two_n"],
    group_scale: Float[Tensor, "n"],  # noqa: F821
    acc: Float32[Tensor, "m n"] | None = None,
    *,
    last: bool = False,
    global_scale: Float32[Tensor, "*one"] | float | None = None,
    token_scale: Float32[Tensor, "m"] | None = None,  # noqa: F821
    bias: Float[Tensor, "n"] | None = None,  # noqa: F821
    output_dtype: torch.dtype = torch.float32,
    tuning: NVFP4DecodeTuning = DEFAULT_NVFP4_DECODE_TUNING,
) -> Float[Tensor, "m n"]:
    """:func:`floatxq.w4a_nvfp4_accumulate_group` in one launch.

    Args:
      both, group_scale, acc, last, token_scale, bias, output_dtype: as the pure function (``both``
        any strides; ``acc`` is not modified).
      global_scale: (``last`` only, then required) a one-element FP32 tensor on the device (not
        read on the host) or a number.
      tuning: launch shapes.

    Returns:
      ``(m, n)``, contiguous: the FP32 running sum, or the output in ``output_dtype`` when ``last``.

    Raises:
      ValueError, TypeError: as the pure function; a global-scale tensor of several values or not
        float32; tensors on CPU (without ``TRITON_INTERPRET=1``).
      RuntimeError: Triton missing.

    Numerics: bit for bit the pure function (FP32 in its order, one nearest-even rounding);
    compiled with ``enable_fp_fusion=False``, so no multiply-add is fused.

    Example:
      >>> both = torch.tensor([[1.0, 2.0, 0.5, -1.0]], device="cuda")  # doctest: +SKIP
      >>> s = torch.tensor([2.0, 1.0], device="cuda")  # doctest: +SKIP
      >>> nvfp4_accumulate_group(both, s).tolist()  # doctest: +SKIP
      [[6.0, -2.0]]
    """
    where = "nvfp4_accumulate_group"
    m, n = _check_accumulate_operands(
        both, group_scale, acc, last, global_scale, token_scale, bias, output_dtype, where=where
    )
    gs, gs_value = None, 0.0
    if last:
        gs, gs_value = _scalar_or_tensor(global_scale, where=where, checked=False)
    tensors = [t for t in (both, group_scale, acc, token_scale, bias, gs) if t is not None]
    device = require_kernel_device(tuple(tensors), where=where)
    out = torch.empty((m, n), dtype=output_dtype, device=device)
    if m == 0 or n == 0:
        return out
    return _launch_accumulate(
        both, group_scale, acc, gs, gs_value, token_scale, bias, out, last, device, tuning
    )


def _launch_accumulate(
    both: Tensor, group_scale: Tensor, acc: Tensor | None, gs: Tensor | None, gs_value: float,
    token_scale: Tensor | None, bias: Tensor | None, out: Tensor, last: bool,
    device: torch.device, tuning: NVFP4DecodeTuning,
) -> Tensor:  # fmt: skip
    """The accumulation launch (``m, n > 0``), arguments already checked."""
    m, n = out.shape
    block_m, block_n = tuning.accumulate_block_m, tuning.accumulate_block_n
    grid = (-(-m // block_m), -(-n // block_n), 1)
    pointers = (
        both, group_scale, out if acc is None else acc, out if gs is None else gs, gs_value,
        out if token_scale is None else token_scale, out if bias is None else bias, out,
    )  # fmt: skip
    strides = (
        *both.stride(), *((0, 0) if acc is None else acc.stride()), group_scale.stride(0),
        0 if token_scale is None else token_scale.stride(0), 0 if bias is None else bias.stride(0),
        out.stride(0),
    )  # fmt: skip
    flags = (acc is not None, last, gs is not None, token_scale is not None, bias is not None)
    args = (*pointers, m, n, *strides, *flags, block_m, block_n)
    interpret = triton_interpret_enabled()
    tensors = [p for p in pointers if isinstance(p, torch.Tensor)]
    key = (
        m, n, strides, flags, tuple(t.dtype for t in tensors), _aligned(*tensors), device,
        interpret, _tuning_key(tuning),
    )  # fmt: skip
    options = {"num_warps": tuning.accumulate_warps, "enable_fp_fusion": False}
    guard, index = launch_device(device)
    with guard:
        _launchers(interpret)[1](key, grid, args, options, index)
    return out
