"""``GPTQLinear``: a GPTQ weight-only linear layer (2, 4 or 8-bit codes; x keeps its dtype).

The buffers are GPT-QModel's checkpoint layout (:mod:`floatxq.gptq.int4`) under its state-dict
keys: ``qweight`` (int32 ``(in·bits/32, out)``), ``qzeros`` (int32 ``(groups, out·bits/32)``,
``gptq`` v1 stores ``zero - 1``, ``gptq_v2`` the zero), ``scales`` (``(groups, out)``, any
floating dtype a checkpoint holds), ``g_idx`` (int32 ``(in,)``, each input row's group) and
``bias``. They move with ``.to()`` as bytes (scales and bias are cast per call);
``load_state_dict`` checks every incoming tensor and raises a ``ValueError`` naming the key;
incoming scales and bias keep their own floating dtype.

A call takes the route :func:`floatxq.dispatch.gptq_route` gives, each computing
:func:`floatxq.w4a16_linear`: ``w4a16_frag``, ``w4a16_words`` (staged operands),
``w4a16_fused`` or ``w4a16_decode_gemm`` (the kernels of :mod:`floatxq.kernels.w4a_frag` and
:mod:`floatxq.kernels.w4a16`, by row count) or ``dequant_matmul`` (decoded in torch per call).
``last_route`` names the route, ``last_reason`` why the Triton routes were not taken.
"""

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from floatxq._checks import (
    check_float_dtype,
    check_gptq_state,
    check_group_size,
    check_linear_input,
    check_size,
    contiguous_group,
    stored_bias_of,
)
from floatxq._typing import Float, Tensor
from floatxq.dispatch import GPTQ_DECODE_ROUTE as DECODE_ROUTE
from floatxq.dispatch import gptq_route, rows_bucket
from floatxq.formats import normalize_gptq_format
from floatxq.gptq.decode_words import DecodeOperands, gptq_decode_operands
from floatxq.gptq.int4 import (
    GPTQPacked,
    GPTQUnpacked,
    _check_bits,
    _check_packed,
    _dequantize_stored,
    dequantize_gptq,
    pack_gptq,
    unpack_gptq,
)
from floatxq.gptq.solve import GPTQSolution
from floatxq.kernels import w4a16
from floatxq.kernels._triton import call_key, on_rows
from floatxq.kernels.w4a_frag import cached_fragment, w4a16_frag_linear
from floatxq.nn._bytes import ByteBuffers

__all__ = ["GPTQLinear"]

_BUFFERS = ("qweight", "qzeros", "scales", "g_idx", "bias")
_HALF = (torch.float16, torch.bfloat16)


def _group_count(in_features: int, group_size: int) -> int:
    """``ceil(in / group_size)``, or 1 for ``group_size == -1`` (one group per output column)."""
    return 1 if group_size == -1 else -(-in_features // group_size)


class GPTQLinear(ByteBuffers, nn.Module):
    """A linear layer whose weight is GPTQ-packed (2, 4 or 8-bit codes, zero points, scales).

    ``y = x @ W.T + bias`` with ``W[o, k] = scales[g, o] * (code[k, o] - zero[g, o])``,
    ``g = g_idx[k]``, decoded in ``x``'s dtype. The constructor allocates zero-filled buffers
    (``g_idx = arange(in) // group_size``) for ``load_state_dict``; :meth:`from_solution` and
    :meth:`from_packed` build a ready module.

    Args:
      in_features, out_features: the weight's ``(out, in)`` shape; both multiples of
        ``32 / bits`` (16, 8 or 4), never padded.
      bits, group_size: 2, 4 or 8; input rows per group (-1: one group).
      format: the zero-point convention of ``qzeros`` as held: ``"gptq"`` (v1) or ``"gptq_v2"``.
      bias, scales_dtype, bias_dtype, device: allocate a bias; the stored floating dtypes of
        the scales and the bias; where the buffers live.

    Raises:
      TypeError: non-integer sizes, ``bits`` or ``group_size``; non-floating dtypes.
      ValueError: negative sizes, sizes that are not multiples of ``32 / bits``, ``bits`` other
        than 2, 4 or 8, ``group_size`` 0 or below -1, an unknown format.

    Numerics: :func:`floatxq.dequantize_gptq` (exact FP32 products for half scales, one
    rounding into ``x``'s dtype), then ``F.linear`` with the bias cast to ``x``'s dtype.

    Example:
      >>> from floatxq.gptq.solve import GPTQSolveOptions, rtn_quantize
      >>> sol = rtn_quantize(torch.randn(16, 64), GPTQSolveOptions(bits=4, group_size=32))
      >>> layer = GPTQLinear.from_solution(sol, bits=4, group_size=32)
      >>> layer(torch.randn(3, 64)).shape, layer.qweight.shape, layer.last_route
      (torch.Size([3, 16]), torch.Size([8, 16]), 'dequant_matmul')
    """

    qweight: Tensor
    qzeros: Tensor
    scales: Tensor
    g_idx: Tensor
    bias: Tensor | None

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        bits: int = 4,
        group_size: int = 128,
        format: str = "gptq",
        bias: bool = False,
        scales_dtype: torch.dtype = torch.float16,
        bias_dtype: torch.dtype = torch.float16,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        where = "GPTQLinear"
        check_size(in_features, name="in_features", where=where)
        check_size(out_features, name="out_features", where=where)
        bits = _check_bits(bits, where=where)
        group_size = check_group_size(group_size, where=where)
        fmt = normalize_gptq_format(format, where=where)
        check_float_dtype(scales_dtype, name="scales_dtype", where=where)
        check_float_dtype(bias_dtype, name="bias_dtype", where=where)
        per = 32 // bits
        if in_features % per or out_features % per:
            raise ValueError(
                f"{where}: in_features={in_features} and out_features={out_features} must both "
                f"be multiples of {per} for bits={bits} ({per} values per int32 word); floatxq "
                f"never pads"
            )
        self.in_features = in_features
        self.out_features = out_features
        self.bits = bits
        self.group_size = group_size
        self.format = fmt
        self.groups = groups = _group_count(in_features, group_size)
        words = torch.zeros((in_features // per, out_features), dtype=torch.int32, device=device)
        self.register_buffer("qweight", words)
        zero_words = torch.zeros((groups, out_features // per), dtype=torch.int32, device=device)
        self.register_buffer("qzeros", zero_words)
        scales = torch.zeros((groups, out_features), dtype=scales_dtype, device=device)
        self.register_buffer("scales", scales)
        rows = torch.arange(in_features, dtype=torch.int32, device=device)
        g_idx = rows * 0 if group_size == -1 else torch.div(rows, group_size, rounding_mode="floor")
        self.register_buffer("g_idx", g_idx)
        stored = torch.zeros(out_features, dtype=bias_dtype, device=device) if bias else None
        self.register_buffer("bias", stored)
        self._set_last("none")
        self.__dict__["_groups_seen"] = None

    @classmethod
    def from_solution(
        cls,
        solution: GPTQSolution,
        *,
        bits: int,
        group_size: int,
        bias: Float[Tensor, "out"] | None = None,  # noqa: F821
        format: str = "gptq",
    ) -> "GPTQLinear":
        """Pack a solved (or round-to-nearest) weight into a new module.

        Args:
          solution: a :class:`floatxq.GPTQSolution`.
          bits: the code width the solution was made with (2, 4 or 8).
          group_size: the solve's group size (-1: one group), giving its group count.
          bias: the layer's ``(out,)`` bias, kept in its dtype, or ``None``.
          format: ``"gptq"`` (v1) or ``"gptq_v2"``, the convention ``qzeros`` is packed in.

        Raises:
          ValueError, TypeError: what :func:`floatxq.pack_gptq` refuses; a group count that
            ``group_size`` does not give; a bias of the wrong shape or non-finite.

        Numerics: the scales are rounded to float16 nearest-even (:func:`pack_gptq`); codes,
        zeros and ``g_idx`` are stored exactly.
        """
        where = "GPTQLinear.from_solution"
        if not isinstance(solution, GPTQSolution):
            raise TypeError(
                f"{where}: solution must be a GPTQSolution, got {type(solution).__name__}"
            )
        group_size = check_group_size(group_size, where=where)
        rows, groups = solution.codes.shape[1], solution.scales.shape[1]
        if groups != _group_count(rows, group_size):
            raise ValueError(
                f"{where}: the solution has {groups} group(s) for in={rows}, but "
                f"group_size={group_size} gives {_group_count(rows, group_size)}"
            )
        packed = pack_gptq(
            solution.codes.T,
            solution.zeros.T,
            solution.scales.T,
            solution.g_idx,
            bits=bits,
            format=format,
        )
        return cls.from_packed(packed, bits=bits, group_size=group_size, format=format, bias=bias)

    @classmethod
    def from_packed(
        cls,
        packed: GPTQPacked,
        *,
        bits: int,
        group_size: int,
        format: str,
        bias: Float[Tensor, "out"] | None = None,  # noqa: F821
    ) -> "GPTQLinear":
        """A module holding ``packed``'s tensors as they are (the same tensors, no copy or cast).

        Args:
          packed: a :class:`floatxq.GPTQPacked`, valid for ``bits`` (as :func:`unpack_gptq`).
          bits, group_size, format: as the constructor; ``group_size`` must give the packed
            group count.
          bias: ``(out,)`` floating, kept in its dtype (moved to ``packed``'s device), or ``None``.

        Raises:
          ValueError, TypeError: an invalid ``packed`` (shapes, dtypes, ``g_idx`` range,
            non-finite scales), a group count ``group_size`` does not give, tensors on different
            devices, a bad bias.

        Numerics: exact; the tensors are stored as given.
        """
        where = "GPTQLinear.from_packed"
        bits = _check_bits(bits, where=where)
        fmt = normalize_gptq_format(format, where=where)
        group_size = check_group_size(group_size, where=where)
        rows, out, groups = _check_packed(packed, where=where, bits=bits)
        if groups != _group_count(rows, group_size):
            raise ValueError(
                f"{where}: packed holds {groups} group(s) for in={rows}, but "
                f"group_size={group_size} gives {_group_count(rows, group_size)}"
            )
        device = packed.qweight.device
        devices = {t.device for t in packed}
        if len(devices) != 1:
            raise TypeError(
                f"{where}: packed's tensors must share one device, got {sorted(map(str, devices))}"
            )
        stored = None if bias is None else stored_bias_of(bias, out, None, device, where=where)
        layer = cls(
            rows,
            out,
            bits=bits,
            group_size=group_size,
            format=fmt,
            bias=stored is not None,
            scales_dtype=packed.scales.dtype,
            bias_dtype=stored.dtype if stored is not None else torch.float16,
            device="meta",
        )
        layer.qweight = packed.qweight.detach()
        layer.qzeros = packed.qzeros.detach()
        layer.scales = packed.scales.detach()
        layer.g_idx = packed.g_idx.detach()
        if stored is not None:
            layer.bias = stored
        return layer

    def packed(self) -> GPTQPacked:
        """The buffers as a :class:`floatxq.GPTQPacked` (the same tensors, not copies).

        Numerics: exact.
        """
        return GPTQPacked(self.qweight, self.qzeros, self.scales, self.g_idx)

    def unpacked(self) -> GPTQUnpacked:
        """The logical codes and zero points (v2 meaning, whatever ``format``), scales, ``g_idx``.

        Numerics: exact (:func:`floatxq.unpack_gptq`).
        """
        return unpack_gptq(self.packed(), bits=self.bits, format=self.format)

    def dequantize_weight(self, dtype: torch.dtype = torch.float32) -> Float[Tensor, "out in"]:
        """The decoded ``(out, in)`` weight in ``dtype``.

        Numerics: :func:`floatxq.dequantize_gptq` (FP32 product, one rounding to ``dtype``).
        """
        return dequantize_gptq(self.packed(), bits=self.bits, format=self.format, dtype=dtype)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"bits={self.bits}, group_size={self.group_size}, format={self.format}, "
            f"bias={self.bias is not None}"
        )

    def _byte_buffer_names(self) -> tuple[str, ...]:
        return _BUFFERS

    def _applied(self, *_: Any) -> None:  # (staged for the old device: restaged on use)
        self.__dict__["_decode"] = {}
        self.__dict__["_plans"] = {}

    _loaded = _applied

    def post_init(self) -> "GPTQLinear":
        """Stage the decode (and fragment) words on CUDA for both half dtypes now (else the first
        call of a dtype does, reading the weight back once); returns self. Again after edits."""
        self._applied()
        for dtype in _HALF if self.qweight.is_cuda else ():
            cached_fragment(self.__dict__["_decode"], self.decode_operands(dtype)[0])
        return self

    def decode_operands(self, dtype: torch.dtype) -> tuple[DecodeOperands | None, str | None]:
        """``(operands, None)``: the decode words for ``dtype`` activations (:func:`floatxq.gptq.
        decode_words.gptq_decode_operands`, staged once per dtype and device; the words shared by
        both dtypes), or ``(None, why not)`` (also when unstaged during graph capture)."""
        cache = self.__dict__.setdefault("_decode", {})
        held = cache.get(dtype)
        if held is not None:
            return held
        if self.bits != 4:
            return None, f"bits={self.bits}; the decode words hold 4-bit codes"
        if self.qweight.is_cuda and torch.cuda.is_current_stream_capturing():
            return None, "the decode words are staged outside CUDA graph capture (post_init())"
        group = self.contiguous_group_size()
        if group is None:
            held = (None, "g_idx is not arange(in) // group_size (desc_act)")
        else:
            other = cache.get(_HALF[1] if dtype == _HALF[0] else _HALF[0], (None,))[0]
            held = gptq_decode_operands(
                self.packed(), format=self.format, group_size=group, dtype=dtype,
                words=None if other is None else other.words,
            )  # fmt: skip
        cache[dtype] = held
        return held

    def _plan(self, x: Tensor) -> tuple[str, str | None, Any, int | None]:
        """``(route, reason, (decode operands, fragment words), group size)`` of a call on ``x``
        ``(rows, in)``: decided once per device, dtype and row class (:func:`floatxq.dispatch.
        rows_bucket`) until the buffers move or load (not kept during graph capture)."""
        key = (x.device, x.dtype, rows_bucket(x.shape[0]))
        plan = self.__dict__.setdefault("_plans", {}).get(key)
        if plan is not None:
            return plan
        rows, ops = x.shape[0], None
        if x.is_cuda and x.dtype in _HALF and rows <= w4a16.DEFAULT_W4A16_TUNING.words_max_rows:
            ops = self.decode_operands(x.dtype)[0]
        route, reason = gptq_route(x.device, x.dtype, rows, decode_words=ops is not None)
        frag = cached_fragment(self._decode, ops) if route == "w4a16_frag" else None
        if route == "w4a16_frag" and frag is None:  # (first seen during graph capture)
            route = "w4a16_words"
        group = None if route == DECODE_ROUTE else self.contiguous_group_size()
        plan = (route, reason, (ops, frag), group)
        if not (x.is_cuda and torch.cuda.is_current_stream_capturing()):
            self.__dict__["_plans"][key] = plan
        return plan

    def _incoming(
        self, state_dict: dict[str, Any], prefix: str, error_msgs: list[str]
    ) -> tuple[dict[str, Any], list[str]]:
        """Check this module's incoming tensors (:func:`floatxq._checks.check_gptq_state`).
        Scales and bias of another floating dtype are adopted: their buffers are reallocated in
        that dtype (once every key passed: a refused load changes nothing)."""
        replaced, adopt = check_gptq_state(
            state_dict, prefix, self._buffers, in_features=self.in_features,
            out_features=self.out_features, bits=self.bits, group_size=self.group_size,
            groups=self.groups,
        )  # fmt: skip
        self._buffers.update(adopt)
        return replaced, []

    @property
    def last_route(self) -> str:
        """The last forward's route (:func:`floatxq.dispatch.gptq_route`'s; ``"none"`` before)."""
        return self._last

    @property
    def last_reason(self) -> str | None:
        """Why the last forward did not take a Triton route (``None`` when it did)."""
        return self.__dict__.get("_reason")

    def _set_last(self, route: str, reason: str | None = None) -> None:
        self.__dict__.update(_last=route, _reason=reason)  # past nn.Module.__setattr__

    def contiguous_group_size(self) -> int | None:
        """The group size when ``g_idx == arange(in) // group_size`` (``in`` for one group),
        else ``None`` (``desc_act``: the kernels then read each row's group from ``g_idx``);
        checked once per ``g_idx`` version (:func:`floatxq._checks.contiguous_group`)."""
        size, seen = contiguous_group(
            self.g_idx, self.in_features, self.group_size, self.__dict__.get("_groups_seen")
        )
        self.__dict__["_groups_seen"] = seen
        return size

    def forward(self, x: Float[Tensor, "*batch in"]) -> Float[Tensor, "*batch out"]:
        """``x @ W.T + bias`` in ``x``'s dtype.

        Raises:
          TypeError: a non-floating ``x``, or ``x`` on another device than the buffers.
          ValueError: ``x``'s last axis is not ``in_features``.

        Numerics: see the class docstring.
        """
        key = call_key(x) if isinstance(x, torch.Tensor) else None
        held = self.__dict__.setdefault("_plans", {}).get(key)
        if held is not None:  # a launch bound for inputs like x (checked when it was bound)
            self._set_last(held[1])
            return held[0](x)
        check_linear_input(x, self.in_features, self.qweight.device, where="GPTQLinear")
        x_flat = x.reshape(math.prod(x.shape[:-1]), self.in_features)
        route, reason, (ops, frag), group = self._plan(x_flat)
        k, n, tuning = self.in_features, self.out_features, w4a16.DEFAULT_W4A16_TUNING
        if route == DECODE_ROUTE:
            out = _dequant_matmul(self, x_flat)
        elif route == "w4a16_frag":
            has_lo = self.scales.dtype != x.dtype
            out = w4a16_frag_linear(x_flat, frag, ops, self.bias, k, n, group, x.device, has_lo)
        elif route == "w4a16_words":
            out = w4a16._words_linear(
                x_flat, ops, self.scales, self.bias, k, n, group, x.device, tuning
            )
        else:  # the W4A16 kernels (floatxq.kernels.w4a16) on the buffers
            out = w4a16._linear(
                x_flat, self.packed(), self.bias, k, n, self.bits, self.format == "gptq",
                group or 0, x.device, route, tuning,
            )  # fmt: skip
        self._set_last(route, reason)
        if ops is not None:
            bound = w4a16.bound_linear(x_flat, route, ops, frag, self.scales, self.bias, k, n,
                                       group)  # fmt: skip
            if (bound := on_rows(bound, x, n)) is not None:
                self._plans[key] = (bound, route)
        return out.reshape(*x.shape[:-1], self.out_features)


def _dequant_matmul(module: GPTQLinear, x: Tensor) -> Tensor:
    """Decode the weight in ``x``'s dtype for this call and multiply (rows ``x`` ``(m, in)``)."""
    if x.shape[0] == 0:  # no rows: nothing to decode or multiply
        return x.new_empty((0, module.out_features))
    bias = module.bias
    # The buffers were validated when built or loaded: decode without per-call checks (which
    # would synchronise with the device on every call).
    weight = _dequantize_stored(module.packed(), module.bits, module.format, x.dtype)
    return F.linear(x, weight, None if bias is None else bias.to(x.dtype))
