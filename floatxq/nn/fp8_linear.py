"""``TorchFP8Linear``: FP8 weight codes with FP32 inverse scales, and the routes that multiply them.

The module holds three buffers, the bytes of the checkpoint format:

* ``weight``: FP8 codes ``(out, in)`` (a convolution's weight flattened to ``(out, in/groups·k…)``);
* ``weight_scale_inv``: FP32 inverse scales (decode: divide), ``()``, ``(out,)`` or a block grid;
* ``bias``: FP16 ``(out,)`` or ``None``.

They move with ``.to()`` as bytes and are never cast: ``module.to(torch.bfloat16)``, ``.half()`` and
``.float()`` change nothing here, only device moves apply (the bias stays FP16 too: it is part of
the stored format, and it is cast to the output dtype per call). Everything else is a per-device
cache, dropped whenever the buffers move or are loaded.

Forward routes (``last_route`` names the one taken, ``last_fallback_reason`` why a faster one was
not), for ``x`` of shape ``(*, in_features)`` and any floating dtype, output in ``x.dtype``:

``scaled_mm_tensorwise``
    The seed's route: CUDA (SM 8.9+), tensor-scaled ``float8_e4m3fn`` weight, fp16/bf16 ``x``,
    ``in % 16 == out % 16 == 0``. ``x`` is quantized tensor-wise to the weight's format with the
    weight formula (``scale_inv = fp8_max / max(amax, FLT_MIN)``), then
    ``_scaled_mm(xq, weight.t(), scale_a=1/sx, scale_b=1/weight_scale_inv, out_dtype=x.dtype)``.
    (A ``float8_e5m2`` weight would make both operands E5M2, which ``scaled_mm`` refuses.)
``scaled_mm_rowwise``
    Row-scaled E4M3 or E5M2 weights on SM 9.0+: ``x`` quantized per token to E4M3 with the same
    formula (the inverse form, so ``scale_a = 1/sx`` of shape ``(M, 1)``; not the direct
    ``amax/448`` of ``fp8_token_quantize``), ``scale_b = 1/weight_scale_inv`` of shape ``(1, N)``.
``scaled_mm_blockwise``
    ``[128, 128]`` block-scaled ``float8_e4m3fn`` weights on SM 9.x (cuBLAS's 1x128 x 128x128
    "DeepSeek" recipe through ``torch.nn.functional.scaled_mm``): ``x`` quantized per 1x128 block
    (E4M3, same formula); rows are padded to a multiple of 16 (cuBLAS refuses M = 1 or 17) with
    zero codes, and the padded outputs dropped.
``fp8_small_m``
    Where one of the three ``scaled_mm`` routes applies and ``x`` has at most :data:`SMALL_M`
    rows (decode), and Triton imports: :func:`floatxq.kernels.fp8_scaled_linear_kernel`, one
    launch that quantizes ``x`` with that route's recipe inside the GEMM (same ``x`` codes,
    FP32 accumulation of exact products, the same direct scales and epilogue bias). Eager
    decode is bound by host time: back to back, one launch instead of two is 1.0-2.4x faster
    on an H200 (N = K = 8192, ``benchmarks/RESULTS.md``). While
    a CUDA graph is being captured (launches then cost nothing) it is kept where it is also the
    faster GPU code: rowwise and blockwise layers up to 16 rows, tensorwise layers for one row;
    other calls capture cuBLAS's ``scaled_mm`` (see ``benchmarks/RESULTS.md``). The result
    equals the ``scaled_mm`` route's up to summation order (both are checked against
    :func:`floatxq.fp8_scaled_linear`).
``dequant_matmul``
    Everywhere else: the weight is decoded for this call only (``dequantize_fp8_weight`` in
    ``x.dtype``) and multiplied; no dense weight is kept between calls.
``compiled_cpu``
    Opt-in (:meth:`TorchFP8Linear.optimize`): the same decode-and-multiply under ``torch.compile``
    for CPU inputs.
``conv_dequant``
    Modules built from ``nn.Conv1d/2d/3d``: the convolution runs with the decoded weight reshaped
    back, with the original stride, padding, dilation, groups and padding mode.

In the three ``scaled_mm`` routes the bias goes into the GEMM epilogue (added in FP32 before the
single rounding to ``x.dtype``; the seed adds it after, one rounding more).

A fast route that raises is switched off for this module and that input dtype (the reason is
kept and warned once), and the call falls back to ``dequant_matmul``. The LoRA hook ``adapter``
runs last: ``out = adapter(x_flat, out)`` (for a convolution, ``adapter(x, out)``).
"""

import dataclasses
import functools
import inspect
import math
import typing
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from floatxq._typing import Float, FP8Dtype, Tensor
from floatxq.formats import (
    FP8_DECODE_ONLY_FORMATS,
    fp8_dtype,
    normalize_fp8_block_size,
    normalize_fp8_format,
    normalize_fp8_scale_method,
)
from floatxq.fp8 import dequantize_fp8_weight, infer_scale_layout
from floatxq.kernels import (
    quantize_fp8_input,
    quantize_fp8_weight_auto,
    triton_unavailable_reason,
)
from floatxq.kernels.fp8_small_m import _launch as small_m_launch

__all__ = ["ROUTES", "SMALL_M", "ConvGeometry", "TorchFP8Linear"]

ROUTES: tuple[str, ...] = (
    "fp8_small_m",
    "scaled_mm_tensorwise",
    "scaled_mm_rowwise",
    "scaled_mm_blockwise",
    "dequant_matmul",
    "compiled_cpu",
    "conv_dequant",
)
"""Every value ``TorchFP8Linear.last_route`` takes (plus ``"none"`` before the first call)."""

FP16_MAX = 65504.0
"""Largest finite float16: the range a stored bias must fit."""

_SCALED_MM_FORMATS = ("float8_e4m3fn", "float8_e5m2")
_BLOCKWISE_BLOCK = (128, 128)
_BLOCKWISE_K_GROUP = 128
_BLOCKWISE_M_ALIGN = 16
_SCALED_MM_ALIGN = 16
_TENSORWISE_MIN_CAPABILITY = (8, 9)
_ROWWISE_MIN_CAPABILITY = (9, 0)
_BLOCKWISE_MAJOR = 9
_HALF_DTYPES = (torch.float16, torch.bfloat16)
SMALL_M = 16
"""Inputs of at most this many rows (after flattening) take the ``fp8_small_m`` kernel."""
_SMALL_M_IN_GRAPHS = {"scaled_mm_tensorwise": 1, "scaled_mm_rowwise": 16, "scaled_mm_blockwise": 16}
"""Most rows a route's calls send to ``fp8_small_m`` while a CUDA graph is captured (launch costs
then vanish, so only GPU time counts): where the fused kernel is the faster GPU code. Graph
replays on an H200, N = K = 8192 (``benchmarks/fp8_small_m_sweep.py --crossover``): rowwise
1.5-1.9x faster than quantize + cuBLAS up to 16 rows, blockwise 1.17-1.25x up to 16, tensorwise
1.08x at one row but even from 2 to 16 rows (0.92-1.24x, programs reducing x's amax together),
so tensorwise captures keep cuBLAS from 2 rows on."""
_METHOD_RECIPE = {"tensor": "tensorwise", "row": "rowwise", "block": "blockwise"}

_METHOD_ROUTE = {
    "tensor": "scaled_mm_tensorwise",
    "row": "scaled_mm_rowwise",
    "block": "scaled_mm_blockwise",
}


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class ConvGeometry:
    """How a flattened convolution weight is reshaped and applied (kept from the source module).

    Numerics: shapes and conv arguments only.
    """

    dims: int
    """1, 2 or 3 (``F.conv1d``/``conv2d``/``conv3d``)."""
    weight_shape: tuple[int, ...]
    """``(out, in/groups, *kernel)``."""
    stride: tuple[int, ...]
    padding: tuple[int, ...] | str
    dilation: tuple[int, ...]
    groups: int
    padding_mode: str
    reversed_padding_repeated_twice: tuple[int, ...]
    """Used with ``padding_mode != "zeros"`` (explicit ``F.pad`` first, as ``nn.Conv`` does)."""


@functools.cache
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def _device_capability(device: torch.device) -> tuple[int, int]:
    return _capability(device.index if device.index is not None else torch.cuda.current_device())


def _scale_shape(
    out_features: int, in_features: int, method: str, block: tuple[int, int] | None, *, where: str
) -> tuple[int, ...]:
    if method == "tensor":
        return ()
    if method == "row":
        return (out_features,)
    br, bc = block  # type: ignore[misc]  # "block" always carries a block size
    if out_features % br or in_features % bc:
        raise ValueError(
            f"{where}: weight shape ({out_features}, {in_features}) is not divisible by "
            f"weight_block_size {[br, bc]} (block rows index output rows); floatxq never pads"
        )
    return (out_features // br, in_features // bc)


def _fp16_bias(bias: Any, out_features: int, device: torch.device, *, where: str) -> Tensor:
    """The bias as stored: FP16 ``(out,)``; a value FP16 cannot hold is an error, never inf."""
    if not isinstance(bias, torch.Tensor) or not bias.is_floating_point():
        raise TypeError(
            f"{where}: bias must be a floating tensor or None, got {type(bias).__name__}"
            + (f" of dtype {bias.dtype}" if isinstance(bias, torch.Tensor) else "")
        )
    if tuple(bias.shape) != (out_features,):
        raise ValueError(
            f"{where}: bias must have shape ({out_features},), got {tuple(bias.shape)}"
        )
    b = bias.detach()
    if b.numel() and not bool(torch.isfinite(b).all()):
        raise ValueError(f"{where}: bias contains NaN or infinity; finite values are required")
    if b.numel() and bool((b.abs() > FP16_MAX).any()):
        worst = float(b.abs().max())
        raise ValueError(
            f"{where}: bias is stored as float16 (the FP8 checkpoint format), whose finite range "
            f"is ±{FP16_MAX:g}; got |bias| up to {worst:g}, which would become inf"
        )
    return b.to(device=device, dtype=torch.float16)


def _dequant_linear(
    x: Float[Tensor, "m k"],
    weight: FP8Dtype[Tensor, "n k"],
    scale_inv: Float[Tensor, "*scale"],
    bias: Float[Tensor, "n"] | None,  # noqa: F821
) -> Float[Tensor, "m n"]:
    """``x @ decode(weight).T + bias``, the weight decoded in ``x.dtype`` for this call only."""
    return F.linear(x, dequantize_fp8_weight(weight, scale_inv, dtype=x.dtype), bias)


def _scaled_mm_fn() -> Callable[..., Tensor] | None:
    return getattr(torch, "_scaled_mm", None)


def _blockwise_recipes() -> tuple[Callable[..., Tensor], Any, Any] | None:
    """``(F.scaled_mm, BlockWise1x128, BlockWise128x128)`` where this torch has the v2 API."""
    fn = getattr(F, "scaled_mm", None)
    kinds = getattr(F, "ScalingType", None)
    if fn is None or kinds is None:
        return None
    a = getattr(kinds, "BlockWise1x128", None) or getattr(kinds, "Blockwise_1x128", None)
    b = getattr(kinds, "BlockWise128x128", None) or getattr(kinds, "Blockwise_128x128", None)
    return None if a is None or b is None else (fn, a, b)


class _Runtime:
    """Per-device caches and route switches; rebuilt whenever the buffers move or are loaded."""

    __slots__ = ("compiled", "disabled", "plans", "prepared", "runners", "warned")

    def __init__(self) -> None:
        self.plans: dict[tuple[torch.device, torch.dtype], tuple[str, str | None]] = {}
        self.runners: dict[tuple[str, torch.dtype], tuple[Callable[[Tensor], Tensor], tuple]] = {}
        """A ``scaled_mm`` route's call with everything but ``x`` bound, and the buffers it
        bound (the runner is rebuilt when one of them is replaced)."""
        self.prepared: dict[Any, Tensor] = {}
        self.disabled: dict[tuple[str, torch.dtype | None], str] = {}
        self.compiled: Callable[..., Tensor] | None = None
        self.warned: set[tuple[str, torch.dtype | None]] = set()


class TorchFP8Linear(nn.Module):
    """A linear layer (or a flattened convolution) whose weight is FP8 with FP32 inverse scales.

    Buffers ``weight`` (FP8 ``(out, in)``), ``weight_scale_inv`` (FP32: ``()``, ``(out,)`` or
    ``(out/br, in/bc)``) and ``bias`` (FP16 ``(out,)`` or ``None``) are the stored format; the
    constructor allocates them (zeros / ones) so ``load_state_dict`` can fill them. See the module
    docstring for the forward routes and the ``.to()`` policy.

    Args:
      in_features, out_features: the weight's ``(out, in)`` shape (non-negative ints).
      bias: allocate an FP16 bias buffer.
      format: FP8 name/alias of the codes (``float8_e8m0fnu`` is accepted for decode-only
        checkpoints; quantizing to it is not).
      weight_scale_method: ``"tensor"``, ``"row"`` or ``"block"`` (``None``: by block size).
      weight_block_size: ``[block_rows, block_cols]`` for ``"block"``; must divide the shape.
      device: where the buffers live.

    Raises:
      ValueError: bad names, negative sizes, a block size that does not divide the shape.
      TypeError: non-integer sizes.

    Numerics: decode is ``float32(code) / scale_inv`` rounded once to ``x.dtype``; the
    ``scaled_mm`` routes also round ``x`` to FP8 (per tensor, token or 1×128 block, the weight
    formula) and accumulate in FP32 on the tensor cores; results match the decoded reference
    within that rounding (see the tests' stated tolerances).

    Example:
      >>> layer = TorchFP8Linear.from_linear(nn.Linear(64, 32))
      >>> layer(torch.randn(4, 64)).shape, layer.last_route
      (torch.Size([4, 32]), 'dequant_matmul')
    """

    weight: Tensor
    weight_scale_inv: Tensor
    bias: Tensor | None
    adapter: Callable[[Tensor, Tensor], Tensor] | None
    """LoRA hook: ``out = adapter(x_flat, out)`` after the bias (``None``: no adapter)."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        bias: bool = True,
        format: Any = "float8_e4m3fn",
        weight_scale_method: Any = "row",
        weight_block_size: Any = None,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        where = "TorchFP8Linear"
        for arg, value in (("in_features", in_features), ("out_features", out_features)):
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"{where}: {arg} must be an int, got {type(value).__name__}")
            if value < 0:
                raise ValueError(f"{where}: {arg} must be >= 0, got {value}")
        name = normalize_fp8_format(format)
        block = normalize_fp8_block_size(weight_block_size)
        method = normalize_fp8_scale_method(weight_scale_method, weight_block_size=block)
        scale_shape = _scale_shape(out_features, in_features, method, block, where=where)
        self.in_features = in_features
        self.out_features = out_features
        self.format = name
        self.weight_scale_method = method
        self.weight_block_size = block
        self.conv: ConvGeometry | None = None
        codes = torch.zeros((out_features, in_features), dtype=torch.uint8, device=device)
        self.register_buffer("weight", codes.view(fp8_dtype(name)))
        self.register_buffer(
            "weight_scale_inv", torch.ones(scale_shape, dtype=torch.float32, device=device)
        )
        fp16 = torch.zeros(out_features, dtype=torch.float16, device=device) if bias else None
        self.register_buffer("bias", fp16)
        self.adapter = None
        self._set_last("none", None)
        self._compile_requested = False
        self._compile_backend = "inductor"
        self._runtime = _Runtime()

    # ------------------------------------------------------------------------------------------
    # Construction
    # ------------------------------------------------------------------------------------------

    @classmethod
    def from_linear(
        cls,
        module: nn.Module,
        *,
        format: Any = "float8_e4m3fn",
        weight_scale_method: Any = "row",
        weight_block_size: Any = None,
    ) -> "TorchFP8Linear":
        """Quantize an ``nn.Linear``, a Hugging Face ``Conv1D`` or an ``nn.Conv1d/2d/3d``.

        ``Conv1D`` stores ``(in, out)`` and is transposed; a convolution's weight is flattened to
        ``(out, in/groups·k…)`` and its geometry kept for the forward. The weight is quantized on
        its own device (the Triton kernel on CUDA, else :func:`floatxq.quantize_fp8_weight`: the
        same bytes); the bias becomes FP16.

        Raises:
          TypeError: another module type (transposed convolutions included).
          ValueError: as ``quantize_fp8_weight``, or a bias outside FP16's range.

        Numerics: codes and scales bit-identical to ``quantize_fp8_weight(weight_matrix, ...)``.
        """
        matrix, conv = _weight_matrix(module)
        with torch.no_grad():
            q, _, _ = quantize_fp8_weight_auto(
                matrix.detach(),
                format=format,
                weight_scale_method=weight_scale_method,
                weight_block_size=weight_block_size,
            )
        block = normalize_fp8_block_size(weight_block_size)
        method = normalize_fp8_scale_method(weight_scale_method, weight_block_size=block)
        layer = cls.from_quantized(
            q.qweight,
            q.scale_inv,
            getattr(module, "bias", None),
            weight_scale_method=method,
            weight_block_size=block,
        )
        layer.conv = conv
        return layer

    @classmethod
    def empty_like(
        cls,
        module: nn.Module,
        *,
        format: Any = "float8_e4m3fn",
        weight_scale_method: Any = "row",
        weight_block_size: Any = None,
        device: torch.device | str | None = None,
    ) -> "TorchFP8Linear":
        """An unfilled module shaped for ``module`` (convolution geometry included), to load into.

        Numerics: none; buffers are zeros (codes, bias) and ones (scales) until loaded.
        """
        matrix, conv = _weight_matrix(module)
        layer = cls(
            matrix.shape[1],
            matrix.shape[0],
            bias=getattr(module, "bias", None) is not None,
            format=format,
            weight_scale_method=weight_scale_method,
            weight_block_size=weight_block_size,
            device=device if device is not None else matrix.device,
        )
        layer.conv = conv
        return layer

    @classmethod
    def from_quantized(
        cls,
        qweight: FP8Dtype[Tensor, "out in"],
        scale_inv: Float[Tensor, "*scale"],
        bias: Float[Tensor, "out"] | None = None,  # noqa: F821
        *,
        weight_scale_method: Any = None,
        weight_block_size: Any = None,
    ) -> "TorchFP8Linear":
        """Wrap existing FP8 codes and FP32 inverse scales (no copy of the codes when contiguous).

        Args:
          qweight: ``(out, in)`` FP8 codes; the format is its dtype.
          scale_inv: inverse scales (decode: divide); converted to FP32 on ``qweight``'s device.
            Its layout is inferred with :func:`floatxq.infer_scale_layout` unless a method or
            block size is given, in which case the shape must fit it.
          bias: ``(out,)`` floating, stored FP16 (must be finite and within ±65504), or ``None``.
          weight_scale_method, weight_block_size: the layout, when known.

        Raises:
          TypeError: non-FP8 codes, non-floating scales or bias.
          ValueError: shapes that fit no layout, non-finite or non-positive scales, a bias
            outside FP16's range.

        Numerics: scales widened to FP32 exactly; codes untouched.
        """
        where = "TorchFP8Linear.from_quantized"
        if not isinstance(qweight, torch.Tensor) or qweight.dtype not in _fp8_dtypes():
            got = qweight.dtype if isinstance(qweight, torch.Tensor) else type(qweight).__name__
            raise TypeError(f"{where}: qweight must be an FP8 tensor, got {got}")
        if qweight.ndim != 2:
            raise ValueError(f"{where}: qweight must be 2-D (out, in), got {tuple(qweight.shape)}")
        if not isinstance(scale_inv, torch.Tensor) or not scale_inv.is_floating_point():
            got = scale_inv.dtype if isinstance(scale_inv, torch.Tensor) else type(scale_inv)
            raise TypeError(f"{where}: scale_inv must be a floating tensor, got {got}")
        out_features, in_features = qweight.shape
        block = normalize_fp8_block_size(weight_block_size)
        if weight_scale_method is None and block is None:
            method, block = infer_scale_layout(qweight.shape, scale_inv.shape)
        else:
            method = normalize_fp8_scale_method(weight_scale_method, weight_block_size=block)
        expected = _scale_shape(out_features, in_features, method, block, where=where)
        if not _scale_fits(tuple(scale_inv.shape), expected, method):
            raise ValueError(
                f"{where}: scale_inv shape {tuple(scale_inv.shape)} does not fit the {method} "
                f"layout of a {tuple(qweight.shape)} weight"
                + (f" with block {list(block)}" if block else "")
                + f"; expected {expected}"
            )
        scale = scale_inv.detach().to(device=qweight.device, dtype=torch.float32)
        scale = scale.reshape(expected).contiguous()
        if scale.numel() and not bool((torch.isfinite(scale) & (scale > 0)).all()):
            raise ValueError(
                f"{where}: scale_inv must be finite and > 0 (codes are divided by it); got "
                f"values in [{float(scale.min()):g}, {float(scale.max()):g}]"
            )
        stored_bias = None
        if bias is not None:
            stored_bias = _fp16_bias(bias, out_features, qweight.device, where=where)
        layer = cls(
            in_features,
            out_features,
            bias=bias is not None,
            format=qweight.dtype,
            weight_scale_method=method,
            weight_block_size=block,
            device="meta",
        )
        layer.weight = qweight.detach().contiguous()
        layer.weight_scale_inv = scale
        if stored_bias is not None:
            layer.bias = stored_bias
        return layer

    # ------------------------------------------------------------------------------------------
    # Buffers as bytes
    # ------------------------------------------------------------------------------------------

    def _apply(self, fn: Callable[[Tensor], Tensor], recurse: bool = True) -> "TorchFP8Linear":
        """``nn.Module._apply`` with the stored buffers moved as bytes: device moves only."""
        names = [
            n for n in ("weight", "weight_scale_inv", "bias") if self._buffers.get(n) is not None
        ]
        held = {n: self._buffers[n] for n in names}
        for n in names:
            self._buffers[n] = None
        try:
            super()._apply(fn, recurse)
        except BaseException:
            self._buffers.update(held)
            raise
        for n, tensor in held.items():
            self._buffers[n] = _move_bytes(fn, tensor)
        self._runtime = _Runtime()
        return self

    def _load_from_state_dict(
        self,
        state_dict: dict[str, Any],
        prefix: str,
        local_metadata: dict[str, Any],
        strict: bool,
        missing_keys: list[str],
        unexpected_keys: list[str],
        error_msgs: list[str],
    ) -> None:
        rejected = []
        key = prefix + "weight"
        incoming = state_dict.get(key)
        if isinstance(incoming, torch.Tensor) and incoming.dtype != self.weight.dtype:
            rejected.append(key)
            error_msgs.append(
                f"{key}: codes of dtype {incoming.dtype} cannot load into this {self.format} "
                f"module (FP8 codes are bytes and are never cast); build it with "
                f"format={str(incoming.dtype).removeprefix('torch.')!r}"
            )
        key = prefix + "bias"
        incoming = state_dict.get(key)
        if isinstance(incoming, torch.Tensor) and self.bias is not None:
            try:
                _fp16_bias(incoming, self.out_features, incoming.device, where=key)
            except (TypeError, ValueError) as exc:
                rejected.append(key)
                error_msgs.append(str(exc))
        if rejected:
            state_dict = {k: v for k, v in state_dict.items() if k not in rejected}
        super()._load_from_state_dict(
            state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
        )
        for k in rejected:  # reported above, not as "missing"
            if k in missing_keys:
                missing_keys.remove(k)
        # load_state_dict(assign=True) puts the incoming tensors in place: restore the format.
        if self.bias is not None and self.bias.dtype != torch.float16:
            self._buffers["bias"] = self.bias.to(torch.float16)
        if self.weight_scale_inv.dtype != torch.float32:
            self._buffers["weight_scale_inv"] = self.weight_scale_inv.to(torch.float32)
        self._runtime = _Runtime()

    # ------------------------------------------------------------------------------------------
    # Public helpers
    # ------------------------------------------------------------------------------------------

    def dequantize_weight(self, *, dtype: torch.dtype = torch.float32) -> Float[Tensor, "out in"]:
        """The decoded ``(out, in)`` weight (a convolution's flattened weight), in ``dtype``.

        Numerics: ``float32(code) / scale_inv`` (IEEE), one nearest-even rounding to ``dtype``.
        """
        return dequantize_fp8_weight(self.weight, self.weight_scale_inv, dtype=dtype)

    def optimize(self, *, backend: str = "inductor") -> "TorchFP8Linear":
        """Opt in to the compiled CPU forward (``torch.compile`` of decode-and-multiply).

        Applies to CPU inputs only (CUDA inputs keep their routes). Compilation happens on the
        first CPU call; if it fails, a warning is given and the module falls back to
        ``dequant_matmul`` until ``optimize()`` is called again or the buffers move.

        Args:
          backend: the ``torch.compile`` backend (``"inductor"`` generates fused C++).

        Returns:
          ``self``.

        Numerics: the decode-and-multiply of ``dequant_matmul`` (FP32 summation order may differ).
        """
        self._compile_requested = True
        self._compile_backend = backend
        self._runtime.compiled = None
        self._runtime.disabled.pop(("compiled_cpu", None), None)
        self._runtime.warned.discard(("compiled_cpu", None))
        return self

    def extra_repr(self) -> str:
        block = (
            f", weight_block_size={list(self.weight_block_size)}" if self.weight_block_size else ""
        )
        conv = f", conv{self.conv.dims}d" if self.conv is not None else ""
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"bias={self.bias is not None}, format={self.format}, "
            f"weight_scale_method={self.weight_scale_method}{block}{conv}"
        )

    # ------------------------------------------------------------------------------------------
    # Forward
    # ------------------------------------------------------------------------------------------

    @property
    def last_route(self) -> str:
        """The route the last forward took (one of :data:`ROUTES`; ``"none"`` before any call)."""
        return self._last[0]

    @property
    def last_fallback_reason(self) -> str | None:
        """Why a faster route was not taken for the last call (``None`` when the fastest ran)."""
        return self._last[1]

    def _set_last(self, route: str, reason: str | None) -> None:
        # A plain attribute, set past nn.Module.__setattr__ (whose checks cost microseconds per
        # call on the decode path).
        self.__dict__["_last"] = (route, reason)

    def forward(self, x: Float[Tensor, "..."]) -> Float[Tensor, "..."]:
        """``x @ W.T + bias`` (then the adapter) through the fastest eligible route.

        Numerics: see the class docstring; output dtype is ``x.dtype``.
        """
        if not isinstance(x, torch.Tensor) or not x.is_floating_point():
            got = x.dtype if isinstance(x, torch.Tensor) else type(x).__name__
            raise TypeError(f"TorchFP8Linear: x must be a floating tensor, got {got}")
        device = x.device
        if device != self._buffers["weight"].device:
            raise TypeError(
                f"TorchFP8Linear: x is on {device} but the module's buffers are on "
                f"{self.weight.device}; move one of them with .to()"
            )
        if self.conv is not None:
            return self._conv_forward(x)
        if x.ndim == 0 or x.shape[-1] != self.in_features:
            raise ValueError(
                f"TorchFP8Linear: x must have shape (*, {self.in_features}), got {tuple(x.shape)}"
            )
        x_flat = x.reshape(math.prod(x.shape[:-1]), self.in_features)
        out = self._linear(x_flat)
        if self.adapter is not None:
            out = self.adapter(x_flat, out)
        return out.reshape(*x.shape[:-1], self.out_features)

    def _linear(self, x: Tensor) -> Tensor:
        if x.shape[0] == 0:  # no rows: nothing to multiply (and no kernel launched)
            self._set_last("dequant_matmul", "x has no rows")
            return x.new_empty((0, self.out_features))
        route, reason = self._plan(x)
        out = None
        if (
            route in _SCALED_ROUTES
            and x.shape[0] <= SMALL_M
            and (
                x.shape[0] <= _SMALL_M_IN_GRAPHS[route]
                or not torch.cuda.is_current_stream_capturing()
            )
        ):
            small = self._small_m_runner(x.dtype)
            if small is not None:
                try:
                    out = small(x)
                    route = "fp8_small_m"
                except Exception as exc:  # the scaled_mm route takes over for this dtype
                    self._disable("fp8_small_m", x.dtype, exc, fallback=route)
        if out is None and route in _SCALED_ROUTES:
            try:
                out = self._runner(route, x.dtype)(x)
            except Exception as exc:
                reason = self._disable(route, x.dtype, exc)
                route = "dequant_matmul"
        elif route == "compiled_cpu":
            try:
                out = self._compiled()(
                    x, self.weight, self.weight_scale_inv, self._bias_as(x.dtype)
                )
            except Exception as exc:
                reason = self._disable(route, None, exc)
                route = "dequant_matmul"
        if out is None:
            out = _dequant_linear(x, self.weight, self.weight_scale_inv, self._bias_as(x.dtype))
        self._set_last(route, reason)
        return out

    def _small_m_runner(self, dtype: torch.dtype) -> Callable[[Tensor], Tensor] | None:
        """The ``fp8_small_m`` call for ``dtype`` inputs, or None (Triton absent, switched off)."""
        runtime = self._runtime
        if ("fp8_small_m", dtype) in runtime.disabled:
            return None
        entry = runtime.runners.get(("fp8_small_m", dtype))
        if entry is None:  # first use on this placement: is Triton there at all?
            reason = triton_unavailable_reason(self._buffers["weight"].device)
            if reason is not None:
                runtime.disabled[("fp8_small_m", dtype)] = reason
                return None
        return self._runner("fp8_small_m", dtype)

    def _runner(self, route: str, dtype: torch.dtype) -> Callable[[Tensor], Tensor]:
        """The route's call for ``dtype`` inputs with its weight-side operands bound once."""
        buffers = self._buffers
        weight, scale, bias = buffers["weight"], buffers["weight_scale_inv"], buffers.get("bias")
        entry = self._runtime.runners.get((route, dtype))
        if entry is not None:
            bound = entry[1]
            if bound[0] is weight and bound[1] is scale and bound[2] is bias:
                return entry[0]
            self._runtime.prepared.clear()  # a buffer was replaced: the cached operands are stale
        entry = (_ROUTE_BUILDERS[route](self, dtype), (weight, scale, bias))
        self._runtime.runners[(route, dtype)] = entry
        return entry[0]

    def _plan(self, x: Tensor) -> tuple[str, str | None]:
        """The route for ``x`` and, when it is ``dequant_matmul``, why no faster one applies."""
        if x.device.type != "cuda":
            if not self._compile_requested:
                return "dequant_matmul", (
                    f"x is on {x.device}: the scaled_mm routes need CUDA, and the compiled CPU "
                    f"path is opt-in (call optimize())"
                )
            off = self._runtime.disabled.get(("compiled_cpu", None))
            return ("compiled_cpu", None) if off is None else ("dequant_matmul", off)
        key = (x.device, x.dtype)
        plan = self._runtime.plans.get(key)
        if plan is None:
            route = _METHOD_ROUTE[self.weight_scale_method]
            reason = self._gate(route, x)
            if reason is None:
                reason = self._runtime.disabled.get((route, x.dtype))
            plan = self._runtime.plans[key] = (
                (route, None) if reason is None else ("dequant_matmul", reason)
            )
        return plan

    def _gate(self, route: str, x: Tensor) -> str | None:
        """Why ``route`` cannot run for ``x`` (capability, format, dtype, shape), or None."""
        if _scaled_mm_fn() is None:
            return f"this torch {torch.__version__} has no torch._scaled_mm"
        if self.format in FP8_DECODE_ONLY_FORMATS:
            return f"{self.format} is decode-only: no scaled_mm takes it"
        if self.format not in _SCALED_MM_FORMATS:
            return f"{self.format} has no scaled_mm on CUDA (the fnuz formats are ROCm's)"
        if x.dtype not in _HALF_DTYPES:
            return f"x is {x.dtype}: the scaled_mm routes take float16/bfloat16 inputs"
        n, k = self.out_features, self.in_features
        if n == 0 or k == 0 or n % _SCALED_MM_ALIGN or k % _SCALED_MM_ALIGN:
            return (
                f"weight ({n}, {k}): scaled_mm needs in_features and out_features to be positive "
                f"multiples of {_SCALED_MM_ALIGN}"
            )
        cap = _device_capability(x.device)
        if route == "scaled_mm_tensorwise":
            if cap < _TENSORWISE_MIN_CAPABILITY:
                return f"SM {cap[0]}.{cap[1]} < 8.9: no FP8 tensor cores for tensorwise scaled_mm"
            if self.format == "float8_e5m2":
                return (
                    "float8_e5m2 weight: x is quantized to the weight's format (the seed's rule) "
                    "and scaled_mm cannot multiply two e5m2 operands"
                )
            return None
        if route == "scaled_mm_rowwise":
            if cap < _ROWWISE_MIN_CAPABILITY:
                return f"SM {cap[0]}.{cap[1]} < 9.0: rowwise scaled_mm needs Hopper or newer"
            return None
        if self.weight_block_size != _BLOCKWISE_BLOCK:
            return (
                f"block size {list(self.weight_block_size or ())}: the blockwise scaled_mm route "
                f"takes [128, 128] blocks only"
            )
        if cap[0] != _BLOCKWISE_MAJOR:
            return (
                f"SM {cap[0]}.{cap[1]}: torch's blockwise (1x128 x 128x128) scaled_mm runs on "
                f"SM 9.x only"
            )
        if self.format != "float8_e4m3fn":
            return f"{self.format} weight: blockwise scaled_mm takes float8_e4m3fn only"
        if _blockwise_recipes() is None:
            return f"this torch {torch.__version__} has no torch.nn.functional.scaled_mm"
        return None

    def _disable(
        self,
        route: str,
        dtype: torch.dtype | None,
        exc: Exception,
        *,
        fallback: str = "dequant_matmul",
    ) -> str:
        reason = f"{route} raised {type(exc).__name__}: {exc}".strip()
        key = (route, dtype)
        self._runtime.disabled[key] = f"disabled after an error: {reason}"
        self._runtime.plans.clear()
        if key not in self._runtime.warned:
            self._runtime.warned.add(key)
            warnings.warn(
                f"TorchFP8Linear: {reason}; this module now uses {fallback} for "
                f"{dtype or 'CPU'} inputs (until its buffers move or are reloaded)",
                RuntimeWarning,
                stacklevel=3,
            )
        if route == "compiled_cpu":
            self._runtime.compiled = None
        return self._runtime.disabled[key]

    def _compiled(self) -> Callable[..., Tensor]:
        if self._runtime.compiled is None:
            fn = inspect.unwrap(_dequant_linear)
            self._runtime.compiled = torch.compile(fn, backend=self._compile_backend)
        return self._runtime.compiled

    def _bias_as(self, dtype: torch.dtype) -> Tensor | None:
        if self.bias is None:
            return None
        key = ("bias", dtype)
        cached = self._runtime.prepared.get(key)
        if cached is None:
            cached = self._runtime.prepared[key] = self.bias.to(dtype)
        return cached

    def _prepared(self, key: str, build: Callable[[], Tensor]) -> Tensor:
        cached = self._runtime.prepared.get(key)
        if cached is None:
            cached = self._runtime.prepared[key] = build()
        return cached

    def _direct_weight_scale(self) -> Tensor:
        """``1 / weight_scale_inv`` (IEEE division by a tensor), cached per placement."""
        s = self.weight_scale_inv
        return self._prepared("direct", lambda: torch.ones_like(s) / s)

    def _small_m(self, dtype: torch.dtype) -> Callable[[Tensor], Tensor]:
        recipe = _METHOD_RECIPE[self.weight_scale_method]
        weight, scale, bias = self.weight, self._direct_weight_scale(), self._bias_as(dtype)

        def run(x: Tensor) -> Tensor:
            return small_m_launch(x, weight, scale, bias, recipe, False)

        return run

    def _tensorwise(self, dtype: torch.dtype) -> Callable[[Tensor], Tensor]:
        mm, name, device = _scaled_mm_fn(), self.format, self.weight.device
        weight_t, scale_b, bias = self.weight.t(), self._direct_weight_scale(), self._bias_as(dtype)

        def run(x: Tensor) -> Tensor:
            scale_a = torch.empty((), dtype=torch.float32, device=device)
            xq = quantize_fp8_input(x, format=name, method="tensor", block=None, scale_out=scale_a)
            return mm(xq, weight_t, scale_a, scale_b, bias, None, dtype)  # type: ignore[misc]

        return run

    def _rowwise(self, dtype: torch.dtype) -> Callable[[Tensor], Tensor]:
        mm, device = _scaled_mm_fn(), self.weight.device
        weight_t, bias = self.weight.t(), self._bias_as(dtype)
        scale_b = self._prepared(
            "rowwise_b", lambda: self._direct_weight_scale().reshape(1, -1).contiguous()
        )

        def run(x: Tensor) -> Tensor:
            scale_a = torch.empty((x.shape[0], 1), dtype=torch.float32, device=device)
            xq = quantize_fp8_input(
                x, format="float8_e4m3fn", method="row", block=None, scale_out=scale_a
            )
            return mm(xq, weight_t, scale_a, scale_b, bias, None, dtype)  # type: ignore[misc]

        return run

    def _blockwise(self, dtype: torch.dtype) -> Callable[[Tensor], Tensor]:
        fn, recipe_a, recipe_b = _blockwise_recipes()  # type: ignore[misc]
        device, weight_t, bias = self.weight.device, self.weight.t(), self._bias_as(dtype)
        scale_b = self._prepared("blockwise_b", self._blockwise_weight_scale)
        groups = self.in_features // _BLOCKWISE_K_GROUP

        def run(x: Tensor) -> Tensor:
            m = x.shape[0]
            # cuBLAS's blockwise kernels refuse row counts that are not a multiple of 16 (M = 1
            # and 17 fail on the H200 with torch 2.11, 16 and 256 run): pad with zero rows,
            # whose codes are 0 with scale 1, and drop their outputs.
            padded_m = -(-m // _BLOCKWISE_M_ALIGN) * _BLOCKWISE_M_ALIGN
            # scale_a: (M, K/128) with strides (1, M); scale_b: (round_up(K/128, 4), N/128)
            # with strides (1, round_up(K/128, 4)), entry [kb, nb] = 1 / weight_scale_inv[nb, kb].
            scale_a = torch.empty((groups, padded_m), dtype=torch.float32, device=device).t()
            xq = quantize_fp8_input(
                x, format="float8_e4m3fn", method="block", block=(1, _BLOCKWISE_K_GROUP),
                scale_out=scale_a, rows_out=padded_m,
            )  # fmt: skip
            out = fn(
                xq, weight_t, scale_a, recipe_a, scale_b, recipe_b, bias=bias, output_dtype=dtype
            )
            return out if padded_m == m else out[:m]

        return run

    def _blockwise_weight_scale(self) -> Tensor:
        direct = self._direct_weight_scale()  # (N/128, K/128)
        n_blocks, k_blocks = direct.shape
        padded = -(-k_blocks // 4) * 4
        grid = torch.ones((n_blocks, padded), dtype=torch.float32, device=direct.device)
        grid[:, :k_blocks] = direct
        return grid.t()

    def _conv_forward(self, x: Tensor) -> Tensor:
        g = typing.cast(ConvGeometry, self.conv)  # forward() only routes convolutions here
        weight = self.dequantize_weight(dtype=x.dtype).reshape(g.weight_shape)
        conv = (F.conv1d, F.conv2d, F.conv3d)[g.dims - 1]
        bias = self._bias_as(x.dtype)
        if g.padding_mode != "zeros":
            padded = F.pad(x, g.reversed_padding_repeated_twice, mode=g.padding_mode)
            out = conv(padded, weight, bias, g.stride, 0, g.dilation, g.groups)
        else:
            out = conv(x, weight, bias, g.stride, g.padding, g.dilation, g.groups)
        self._set_last(
            "conv_dequant",
            "convolution: no FP8 convolution kernel, the weight is decoded for this call",
        )
        if self.adapter is not None:
            out = self.adapter(x, out)
        return out


_ROUTE_BUILDERS: dict[str, Callable[[TorchFP8Linear, torch.dtype], Callable[[Tensor], Tensor]]] = {
    "fp8_small_m": TorchFP8Linear._small_m,
    "scaled_mm_tensorwise": TorchFP8Linear._tensorwise,
    "scaled_mm_rowwise": TorchFP8Linear._rowwise,
    "scaled_mm_blockwise": TorchFP8Linear._blockwise,
}
_SCALED_ROUTES = frozenset(_ROUTE_BUILDERS) - {"fp8_small_m"}


@functools.cache
def _fp8_dtypes() -> frozenset[torch.dtype]:
    names = ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu")
    return frozenset(getattr(torch, n) for n in names if hasattr(torch, n))


def _scale_fits(shape: tuple[int, ...], expected: tuple[int, ...], method: str) -> bool:
    """Whether a stored scale tensor holds the layout's values in its order (size-1 axes aside)."""
    if shape == expected:
        return True
    count = 1
    for s in shape:
        count *= s
    if method == "tensor":
        return count == 1 and len(shape) <= 2
    squeezed = tuple(s for s in shape if s != 1)
    want = tuple(s for s in expected if s != 1)
    if method == "block" and len(shape) == 1:  # a flattened grid (row-major), as infer accepts
        return count == (expected[0] * expected[1] if expected else 1)
    return squeezed == want and len(shape) <= 2


def _move_bytes(fn: Callable[[Tensor], Tensor], tensor: Tensor) -> Tensor:
    """Apply ``fn``'s device move to ``tensor`` but never its dtype cast."""
    try:
        probe = fn(tensor.new_empty(0))
    except Exception:  # a cast this dtype does not support: learn the device from FP32
        probe = fn(torch.empty(0, device=tensor.device))
        return tensor.to(device=probe.device)
    return fn(tensor) if probe.dtype == tensor.dtype else tensor.to(device=probe.device)


def _weight_matrix(module: nn.Module) -> tuple[Tensor, ConvGeometry | None]:
    """The ``(out, in)`` weight matrix a module multiplies by, and its conv geometry if any."""
    if isinstance(module, TorchFP8Linear):
        raise TypeError("from_linear: the module is already a TorchFP8Linear")
    if isinstance(module, nn.Linear):
        return module.weight, None
    if isinstance(module, nn.modules.conv._ConvTransposeNd):
        raise TypeError(
            f"from_linear: transposed convolutions ({type(module).__name__}) are not supported"
        )
    if isinstance(module, (nn.Conv1d, nn.Conv2d, nn.Conv3d)):
        weight = module.weight
        geometry = ConvGeometry(
            dims=weight.ndim - 2,
            weight_shape=tuple(weight.shape),
            stride=tuple(module.stride),
            padding=module.padding if isinstance(module.padding, str) else tuple(module.padding),
            dilation=tuple(module.dilation),
            groups=module.groups,
            padding_mode=module.padding_mode,
            reversed_padding_repeated_twice=tuple(module._reversed_padding_repeated_twice),
        )
        return weight.reshape(weight.shape[0], -1), geometry
    hf_conv1d = _hf_conv1d_type()
    if hf_conv1d is not None and isinstance(module, hf_conv1d):
        return module.weight.t(), None
    raise TypeError(
        f"from_linear: expected nn.Linear, transformers' Conv1D or nn.Conv1d/2d/3d, got "
        f"{type(module).__name__}"
    )


@functools.cache
def _hf_conv1d_type() -> type | None:
    try:
        from transformers.pytorch_utils import Conv1D
    except Exception:  # transformers missing or broken: no Conv1D to recognize
        return None
    return Conv1D
