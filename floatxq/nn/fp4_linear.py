"""``TorchFP4Linear``: an NVFP4 linear layer, weight-only or W4A4 (a static activation scale).

The buffers are the ModelOpt checkpoint layout (:mod:`floatxq.nvfp4.layouts`): ``weight``
(uint8 ``(out, in/2)``, two E2M1 codes per byte, even element in the low nibble),
``weight_scale`` (float8_e4m3fn ``(out, in/16)`` block scales), ``weight_scale_2`` (FP32 ``()``
tensor scale; both scales multiply to decode) and ``bias`` (``(out,)`` in the module's ``dtype``).
The first three move as bytes, never cast; a cast to fp16, bf16 or fp32 becomes the module's
``dtype`` and casts the bias, any other (``.double()``) leaves both alone. A W4A4 module also holds
``input_scale`` (FP32 ``()``, moved as bytes): the activation's NVFP4 global scale.

A call takes the route :func:`floatxq.dispatch.fp4_decode_route` gives: on CUDA torchao's
``NVFP4Tensor`` first (an error switches it off until the buffers move or load), else a decode of
the weight in ``x``'s dtype for that call only and ``F.linear``: the Triton
``nvfp4_dequantize_kernel`` (``"triton_decode"``, the same bits) or the pure decode
(``"dequant_matmul"``, the only route off CUDA). ``last_fallback_reason`` says why. W4A4 calls
take :func:`floatxq.dispatch.fp4_w4a4_route`'s route (``"w4a4_triton"``, ``"w4a4_dequant_matmul"``).
"""

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from floatxq import dispatch
from floatxq._checks import (
    check_linear_input,
    check_model_dtype,
    check_size,
    fp4_state_problems,
    positive_scale,
    stored_bias_of,
)
from floatxq._typing import Float, Tensor
from floatxq.formats import MODEL_DTYPES, NVFP4_BLOCK, NVFP4RecipeName
from floatxq.kernels._triton import call_key
from floatxq.kernels.nvfp4_decoding import (
    bound_linear,
    nvfp4_dequantize_kernel,
    torchao_nvfp4_linear,
)
from floatxq.kernels.nvfp4_qdq import nvfp4_activation_qdq
from floatxq.nn._bytes import ByteBuffers
from floatxq.nvfp4.layouts import NVFP4Weight, nvfp4_from_modelopt
from floatxq.nvfp4.quantize import nvfp4_dequantize, nvfp4_global_scale, nvfp4_quantize

__all__ = ["TorchFP4Linear"]

_BYTE_BUFFERS = ("weight", "weight_scale", "weight_scale_2", "input_scale")
DECODE_ROUTE, TRITON_DECODE_ROUTE, TORCHAO_ROUTE = dispatch.FP4_DECODE_ROUTES


class TorchFP4Linear(ByteBuffers, nn.Module):
    """A linear layer whose weight is NVFP4 (E2M1 codes, E4M3 block scales, an FP32 scale).

    ``y = x @ W.T + bias`` with ``W = e2m1(code) * float32(weight_scale) * weight_scale_2``
    decoded in ``x``'s dtype; W4A4 first replaces ``x`` by ``nvfp4_block_qdq(x, input_scale,
    "nvidia")`` (per 16 along K the E4M3 scale of ``max / (6·input_scale)``, E2M1 codes, decoded
    in ``x.dtype``), ``input_scale`` the decode multiplier ``nvfp4_global_scale(amax)`` (ModelOpt's
    ``input_scale``; compressed-tensors stores its reciprocal). The constructor allocates zero
    codes and block scales, scales of 1 and a zero bias, for ``load_state_dict`` to fill.

    Args:
      in_features, out_features: the weight's shape; ``in_features`` a multiple of 16.
      bias, input_scale: allocate a bias buffer, the W4A4 ``input_scale`` (else ``None``).
      dtype: float16, bfloat16 or float32: the bias's storage and :meth:`dequantize_weight`'s
        default (the output has ``x``'s dtype). device: where the buffers live.

    Raises:
      TypeError: non-integer sizes. ValueError: negative sizes, ``in_features % 16``, dtype.

    Numerics: the decode is :func:`floatxq.nvfp4_dequantize` (exact code-scale product,
    one FP32 rounding for the tensor scale, one rounding into ``x.dtype``), or its Triton twin
    on CUDA (the same bits), then ``F.linear``. torchao's route (CUDA, when installed) decodes
    with its own rounding order. W4A4: the reference's activation bytes on every route
    (:func:`floatxq.kernels.nvfp4_qdq.nvfp4_activation_qdq`, which says where serving engines
    round differently); off CUDA a non-finite ``x`` raises, on CUDA it gives NaN.

    Example:
      >>> layer = TorchFP4Linear.from_linear(nn.Linear(32, 8))
      >>> layer(torch.randn(3, 32)).shape, layer.weight.dtype, layer.weight_scale.shape
      (torch.Size([3, 8]), torch.uint8, torch.Size([8, 2]))
    """

    weight: Tensor
    weight_scale: Tensor
    weight_scale_2: Tensor
    input_scale: Tensor | None
    bias: Tensor | None

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        bias: bool = False,
        dtype: torch.dtype = torch.bfloat16,
        device: torch.device | str | None = None,
        input_scale: bool = False,
    ) -> None:
        super().__init__()
        where = "TorchFP4Linear"
        for arg, value in (("in_features", in_features), ("out_features", out_features)):
            check_size(value, name=arg, where=where)
        if in_features % NVFP4_BLOCK:
            raise ValueError(
                f"{where}: in_features must be a multiple of {NVFP4_BLOCK} (one E4M3 block scale "
                f"per {NVFP4_BLOCK} values), got {in_features}"
            )
        self.in_features = in_features
        self.out_features = out_features
        self.dtype = check_model_dtype(dtype, where=where)
        blocks = in_features // NVFP4_BLOCK
        self.register_buffer(
            "weight",
            torch.zeros((out_features, in_features // 2), dtype=torch.uint8, device=device),
        )
        scales = torch.zeros((out_features, blocks), dtype=torch.uint8, device=device)
        self.register_buffer("weight_scale", scales.view(torch.float8_e4m3fn))
        self.register_buffer("weight_scale_2", torch.ones((), dtype=torch.float32, device=device))
        one = torch.ones((), dtype=torch.float32, device=device) if input_scale else None
        self.register_buffer("input_scale", one)
        zeros = torch.zeros(out_features, dtype=dtype, device=device) if bias else None
        self.register_buffer("bias", zeros)
        self._set_last("none", None)
        self._torchao_off: str | None = None

    @classmethod
    def from_nvfp4(
        cls,
        w: NVFP4Weight,
        bias: Float[Tensor, "out"] | None = None,  # noqa: F821
        *,
        dtype: torch.dtype = torch.bfloat16,
        input_scale: Float[Tensor, ""] | float | None = None,
    ) -> "TorchFP4Linear":
        """Wrap a canonical NVFP4 record (its tensors become the buffers, no copy when contiguous).

        Args:
          w: the weight (:func:`floatxq.nvfp4_from_modelopt` and friends).
          bias, dtype: ``(out,)`` floating stored in ``dtype`` (the class's), or ``None``.
          input_scale: the activation's global scale (W4A4), or ``None`` (weight-only).

        Raises:
          TypeError, ValueError: a record with other dtypes or shapes, NaN or negative block
            scales, a global scale or ``input_scale`` that is not finite and > 0; a bias of
            another shape, or one that is not finite in ``dtype``.

        Numerics: the weight bytes are kept; the bias is rounded once into ``dtype``,
        ``input_scale`` into FP32.
        """
        where = "TorchFP4Linear.from_nvfp4"
        if not isinstance(w, NVFP4Weight):
            raise TypeError(f"{where}: w must be an NVFP4Weight, got {type(w).__name__}")
        dtype = check_model_dtype(dtype, where=where)
        checked = nvfp4_from_modelopt(w.packed, w.block_scales, w.global_scale)
        out_features, in_features = checked.shape
        stored_bias = None
        if bias is not None:
            stored_bias = stored_bias_of(
                bias, out_features, dtype, checked.packed.device, where=where
            )
        layer = cls(in_features, out_features, bias=bias is not None, dtype=dtype, device="meta")
        layer.weight = checked.packed
        layer.weight_scale = checked.block_scales
        layer.weight_scale_2 = checked.global_scale
        if input_scale is not None:
            device = checked.packed.device
            layer.input_scale = positive_scale(input_scale, name="input_scale", where=where,
                                               device=device)  # fmt: skip
        if stored_bias is not None:
            layer.bias = stored_bias
        return layer

    @classmethod
    def from_linear(
        cls,
        linear: nn.Linear,
        *,
        recipe: NVFP4RecipeName = "nvidia",
        input_scale: Float[Tensor, ""] | float | None = None,
    ) -> "TorchFP4Linear":
        """Quantize an ``nn.Linear``: global scale from the weight's amax, then the block search.

        ``global_scale = nvfp4_global_scale(max|W|, recipe=recipe)`` and the codes and block
        scales of :func:`floatxq.nvfp4_quantize` under it. The bias is kept in the
        linear's dtype, which becomes the module's ``dtype``. ``input_scale``: as
        :meth:`from_nvfp4` (W4A4; e.g. ``nvfp4_global_scale(activation_amax)``).

        Raises:
          TypeError: not an ``nn.Linear``, or a weight dtype other than fp16/bf16/fp32.
          ValueError: ``in_features % 16``, a non-finite weight, an unknown recipe, an
            ``input_scale`` that is not finite and > 0.

        Numerics: the bytes of ``nvfp4_quantize(W, nvfp4_global_scale(amax), recipe)``.
        """
        where = "TorchFP4Linear.from_linear"
        if not isinstance(linear, nn.Linear):
            raise TypeError(f"{where}: linear must be an nn.Linear, got {type(linear).__name__}")
        weight = linear.weight.detach()
        if weight.dtype not in MODEL_DTYPES:
            raise TypeError(
                f"{where}: the linear's weight must be float16, bfloat16 or float32, got "
                f"{weight.dtype}"
            )
        in_features = weight.shape[1]
        if in_features % NVFP4_BLOCK:
            raise ValueError(
                f"{where}: in_features must be a multiple of {NVFP4_BLOCK}, got {in_features}"
            )
        with torch.no_grad():
            amax = weight.abs().amax().float() if weight.numel() else torch.zeros(())
            g = nvfp4_global_scale(amax, recipe=recipe).to(weight.device)
            q = nvfp4_quantize(weight, g, recipe)
        return cls.from_nvfp4(
            NVFP4Weight(*q), linear.bias, dtype=weight.dtype, input_scale=input_scale
        )

    def to_nvfp4(self) -> NVFP4Weight:
        """The buffers as a canonical record (the same tensors, not copies).

        Numerics: exact.
        """
        return NVFP4Weight(self.weight, self.weight_scale, self.weight_scale_2)

    def dequantize_weight(self, dtype: torch.dtype | None = None) -> Float[Tensor, "out in"]:
        """The decoded ``(out, in)`` weight in ``dtype`` (default: the module's ``dtype``).

        Numerics: :func:`floatxq.nvfp4_dequantize`.
        """
        return nvfp4_dequantize(
            self.weight, self.weight_scale, self.weight_scale_2, dtype=dtype or self.dtype
        )

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"bias={self.bias is not None}, dtype={self.dtype}"
            + (", w4a4=True" if self.input_scale is not None else "")
        )

    def _byte_buffer_names(self) -> tuple[str, ...]:
        return (*_BYTE_BUFFERS, "bias")

    def _before_moves(self, fn: Callable[[Tensor], Tensor]) -> None:
        """A cast to fp16, bf16 or fp32 becomes the module's ``dtype`` (and the bias's); any
        other leaves both as they are. The byte buffers are never cast."""
        cast = fn(torch.empty(0, dtype=self.dtype)).dtype
        self.__dict__["_cast"] = cast if cast in MODEL_DTYPES else self.dtype

    def _moved(self, name: str, fn: Callable[[Tensor], Tensor], tensor: Tensor) -> Tensor:
        moved = super()._moved(name, fn, tensor)
        return moved.to(self.__dict__["_cast"]) if name == "bias" else moved

    def _applied(self, fn: Callable[[Tensor], Tensor]) -> None:
        self.dtype = self.__dict__.pop("_cast")
        self._torchao_off = None

    def _incoming(
        self, state_dict: dict[str, Any], prefix: str, error_msgs: list[str]
    ) -> tuple[dict[str, Any], list[str]]:
        # checked once here, so the forward routes need no per-call check (or host sync)
        scalars = ("weight_scale_2", "input_scale") if self.input_scale is not None else ()
        replaced, problems = fp4_state_problems(state_dict, prefix, scalars or ("weight_scale_2",))
        error_msgs.extend(message for _, message in problems)
        return replaced, [key for key, _ in problems]

    def _loaded(self, prefix: str, missing_keys: list[str]) -> None:
        # load_state_dict(assign=True) puts the incoming tensors in place: restore the format.
        for name in ("weight_scale_2", "input_scale"):
            held = self._buffers[name]
            if held is not None and held.dtype != torch.float32:
                self._buffers[name] = held.float()
        if self.bias is not None and self.bias.dtype != self.dtype:
            self._buffers["bias"] = self.bias.to(self.dtype)
        self._torchao_off = None

    @property
    def last_route(self) -> str:
        """The route of the last call: ``"dequant_matmul"``, ``"triton_decode"``,
        ``"torchao_nvfp4"``, ``"w4a4_triton"``, ``"w4a4_dequant_matmul"``, or ``"none"``."""
        return self._last[0]

    @property
    def last_fallback_reason(self) -> str | None:
        """Why the last CUDA call decoded the weight instead of using torchao, or (W4A4)
        quantized the activation in torch (``None`` when the fastest route ran, or off CUDA)."""
        return self._last[1]

    def _set_last(self, route: str, reason: str | None) -> None:
        self.__dict__["_last"] = (route, reason)

    def forward(self, x: Float[Tensor, "*batch in"]) -> Float[Tensor, "*batch out"]:
        """``x @ W.T + bias`` in ``x``'s dtype.

        Raises:
          TypeError: a non-floating ``x``, or ``x`` on another device than the buffers.
          ValueError: ``x``'s last axis is not ``in_features``.
        """
        key = call_key(x) if isinstance(x, torch.Tensor) else None
        held = self.__dict__.setdefault("_plans", {}).get(key)
        if held is not None:  # a launch bound for inputs like x (checked when it was bound)
            self._set_last(TRITON_DECODE_ROUTE, held[1])
            return held[0](x)
        check_linear_input(x, self.in_features, self.weight.device, where="TorchFP4Linear")
        if math.prod(x.shape[:-1]) == 0:  # no rows: nothing to decode or multiply
            self._set_last("none", None)
            return x.new_empty((*x.shape[:-1], self.out_features))
        bias = self.bias.to(x.dtype) if self.bias is not None else None
        if self.input_scale is not None:  # W4A4: the activation's NVFP4 qdq, then the decode
            route, reason = dispatch.fp4_w4a4_route(x.device, x.dtype, self.in_features)
            self._set_last(route, reason)
            x = nvfp4_activation_qdq(x, self.input_scale, triton=route == "w4a4_triton")
            weight = self._decoded(dispatch.fp4_decode_route(x.device, x.dtype)[0], x.dtype)
            return F.linear(x, weight, bias)
        route, reason = self._route(x)
        if route == TORCHAO_ROUTE:
            out = self._torchao_linear(x, bias)
            if out is not None:
                self._set_last(TORCHAO_ROUTE, None)
                return out
            route, reason = self._route(x)  # torchao is now switched off: ask again
        self._set_last(route, reason)
        out = F.linear(x, self._decoded(route, x.dtype), bias)
        if route == TRITON_DECODE_ROUTE:
            b = self._buffers
            bound = bound_linear(x, b["weight"], b["weight_scale"], b["weight_scale_2"], b["bias"])
            if bound is not None:
                self._plans[key] = (bound, reason)
        return out

    def _route(self, x: Tensor) -> tuple[str, str | None]:
        """:func:`floatxq.dispatch.fp4_decode_route`'s answer for ``x`` with torchao a candidate."""
        return dispatch.fp4_decode_route(
            x.device, x.dtype, torchao=True, torchao_off=self._torchao_off
        )

    def _decoded(self, route: str, dtype: torch.dtype) -> Tensor:
        """The ``(out, in)`` weight in ``dtype`` for one call, decoded by ``route``'s code."""
        if route == TRITON_DECODE_ROUTE:
            return nvfp4_dequantize_kernel(
                self.weight, self.weight_scale, self.weight_scale_2, dtype=dtype
            )
        return self.dequantize_weight(dtype)

    def _torchao_linear(self, x: Tensor, bias: Tensor | None) -> Tensor | None:
        """torchao's weight-only NVFP4 linear, or ``None`` when it raised (it is then switched
        off until the buffers move or load; the reason is kept for the route choice)."""
        try:
            return torchao_nvfp4_linear(x, *self.to_nvfp4(), bias)
        except Exception as exc:
            error = f"{type(exc).__name__}: {exc}".strip()
            self._torchao_off = f"torchao's NVFP4Tensor raised ({error})"
            return None
