"""MLX linear layers over FP8 weight bytes: a general decode-table layer and a native MXFP8 one.

* :class:`MlxFP8PackedLinear` keeps the checkpoint as it is (FP8 bytes ``(out, in)``, FP32
  inverse scales in the tensor, row or block layout, an optional bias) and decodes the bytes
  through a 256-entry FP32 table of the format at every call. On an Apple GPU one of two Metal
  kernels runs the product straight from the bytes: ``prefill`` (several rows, a wide output:
  16-row tiles, each decoded weight serving 16 rows) or ``general`` (everything else); see
  :func:`floatxq.dispatch.mlx_packed_route`. Elsewhere (and as their reference,
  :meth:`MlxFP8PackedLinear.reference`) array ops decode the whole weight in FP32 and multiply in
  FP32. Any of the four encodable FP8 formats and any scale layout.
* :class:`MlxFP8Linear` hands the multiplication to MLX's own ``mxfp8`` quantized matmul when
  that is exact: E4M3FN codes, one inverse scale per tensor or per output row, ``in % 32 == 0``,
  positive finite inverse scales with finite reciprocals, no NaN codes. The E4M3 bytes become
  the ``mxfp8`` codes unchanged, every 32-wide group gets the E8M0 scale 1 (byte 127), and the
  checkpoint's inverse scale divides the FP32 dot product afterwards.
  :meth:`MlxFP8Linear.eligibility` says why a module cannot take this route.

Both decode like :func:`floatxq.dequantize_fp8_weight`: ``float32(code) / scale_inv``.
"""

import math
from collections.abc import Mapping
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from floatxq._checks import fp8_scale_shape
from floatxq._typing import Float, Float32, UInt8
from floatxq.dispatch.mlx import mlx_packed_route
from floatxq.formats import FP8WeightFormat, normalize_fp8_weight_format
from floatxq.mlx.kernels import (
    MLX_FLOAT_NAMES,
    metal_available,
    packed_linear_launch,
    run_metal,
)

__all__ = ["MlxFP8Linear", "MlxFP8PackedLinear", "fp8_decode_table"]

_FP8_LAYOUT: Mapping[FP8WeightFormat, tuple[int, int, str]] = {
    # format: (mantissa bits, exponent bias, special codes); the sign is bit 7 in all four.
    #   "fn":   only S.1111.111 is NaN, no infinities (E4M3FN)
    #   "ieee": exponent all ones is inf (mantissa 0) or NaN (E5M2)
    #   "fnuz": 0x80 is the only NaN, no infinities, no negative zero
    "float8_e4m3fn": (3, 7, "fn"),
    "float8_e5m2": (2, 15, "ieee"),
    "float8_e4m3fnuz": (3, 8, "fnuz"),
    "float8_e5m2fnuz": (2, 16, "fnuz"),
}

_MX_GROUP = 32
_E8M0_ONE = 127
_E4M3FN_NAN = (0x7F, 0xFF)


def _dtype_name(a: mx.array) -> str:
    return str(a.dtype).removeprefix("mlx.core.")


def _byte_value(code: int, mbits: int, bias: int, special: str) -> float:
    sign = -1.0 if code & 0x80 else 1.0
    ebits = 7 - mbits
    exp = (code >> mbits) & ((1 << ebits) - 1)
    mant = code & ((1 << mbits) - 1)
    if special == "fnuz" and code == 0x80:
        return math.nan
    if special == "fn" and exp == (1 << ebits) - 1 and mant == (1 << mbits) - 1:
        return math.nan
    if special == "ieee" and exp == (1 << ebits) - 1:
        return sign * math.inf if mant == 0 else math.nan
    if exp == 0:
        return sign * math.ldexp(mant, 1 - bias - mbits)
    return sign * math.ldexp((1 << mbits) + mant, exp - bias - mbits)


def fp8_decode_table(format: str = "float8_e4m3fn") -> Float32[mx.array, "256"]:
    """The FP32 value of each of the 256 byte codes of an FP8 format, from its bit layout.

    Args:
      format: an encodable FP8 name or alias (``float8_e8m0fnu`` is refused: it holds scales).

    Returns:
      ``mx.float32`` array of 256 values, entry ``b`` the value of byte ``b`` (NaN codes give NaN,
      E5M2's infinity codes ±inf).

    Raises:
      ValueError: an unknown format name, or E8M0.

    Numerics: exact (every FP8 value is an FP32 value); equals torch's decode of the 256 codes.

    Example:
      >>> fp8_decode_table("e4m3")[[0x38, 0x7E, 0xC0]].tolist()
      [1.0, 448.0, -2.0]
    """
    name = normalize_fp8_weight_format(format, where="fp8_decode_table: format")
    mbits, bias, special = _FP8_LAYOUT[name]
    values = [_byte_value(code, mbits, bias, special) for code in range(256)]
    return mx.array(np.array(values, dtype=np.float32))


def _check_codes(qweight: object, *, where: str) -> mx.array:
    if not isinstance(qweight, mx.array) or qweight.dtype != mx.uint8:
        got = qweight.dtype if isinstance(qweight, mx.array) else type(qweight).__name__
        raise TypeError(f"{where}: qweight must be an mlx.core.array of uint8 FP8 bytes, got {got}")
    if qweight.ndim != 2 or qweight.size == 0:
        raise ValueError(
            f"{where}: qweight must be a non-empty 2-D (out, in) matrix, got shape "
            f"{tuple(qweight.shape)}"
        )
    return qweight


def _check_scales(scale_inv: object, shape: tuple[int, int], *, where: str) -> mx.array:
    if not isinstance(scale_inv, mx.array) or scale_inv.dtype != mx.float32:
        got = scale_inv.dtype if isinstance(scale_inv, mx.array) else type(scale_inv).__name__
        raise TypeError(f"{where}: scale_inv must be an mlx.core.array of float32, got {got}")
    out, inp = shape
    s = tuple(
        scale_inv.shape
    )  # the kernels read the layout from the rank: 0 tensor, 1 row, 2 block
    method = ("tensor", "row", "block")[len(s)] if len(s) <= 2 else None
    block = (out // s[0], inp // s[1]) if method == "block" and s[0] > 0 and s[1] > 0 else None
    try:
        fits = method is not None and s == fp8_scale_shape(out, inp, method, block, where=where)
    except ValueError:  # a grid that does not tile the weight
        fits = False
    if not fits:
        raise ValueError(
            f"{where}: scale_inv shape {s} fits no layout of a {shape} weight; accepted: () for "
            f"tensor, ({out},) for row, (out/br, in/bc) for block"
        )
    if not mx.all(mx.isfinite(scale_inv) & (scale_inv > 0)).item():
        raise ValueError(f"{where}: scale_inv entries must be positive and finite")
    return scale_inv


def _check_bias(bias: object, out: int, *, where: str) -> mx.array | None:
    if bias is None:
        return None
    if not isinstance(bias, mx.array) or _dtype_name(bias) not in MLX_FLOAT_NAMES:
        got = bias.dtype if isinstance(bias, mx.array) else type(bias).__name__
        raise TypeError(
            f"{where}: bias must be None or an MLX float16, bfloat16 or float32 array, got {got}"
        )
    if tuple(bias.shape) != (out,):
        raise ValueError(f"{where}: bias must have shape ({out},), got {tuple(bias.shape)}")
    if not mx.all(mx.isfinite(bias)).item():
        raise ValueError(f"{where}: bias contains NaN or infinity; finite values are required")
    return bias


def _check_x(x: object, in_features: int, *, where: str) -> mx.array:
    if not isinstance(x, mx.array) or _dtype_name(x) not in MLX_FLOAT_NAMES:
        got = x.dtype if isinstance(x, mx.array) else type(x).__name__
        raise TypeError(f"{where}: x must be an MLX float16, bfloat16 or float32 array, got {got}")
    if x.ndim < 1 or x.shape[-1] != in_features:
        raise ValueError(f"{where}: x must have shape (..., {in_features}), got {tuple(x.shape)}")
    return x


def _torch_parts(module: Any, *, where: str) -> tuple[mx.array, mx.array, mx.array | None, str]:
    """Bytes, canonical-shape FP32 scales, FP16 bias and format of a ``TorchFP8Linear``."""
    import torch

    from floatxq.nn.fp8_linear import TorchFP8Linear

    if not isinstance(module, TorchFP8Linear):
        raise TypeError(f"{where}: module must be a TorchFP8Linear, got {type(module).__name__}")
    if module.conv is not None:
        raise ValueError(f"{where}: module is a flattened convolution; only linears transfer")
    if module.adapter is not None:
        raise ValueError(f"{where}: module has a LoRA adapter, which does not transfer to MLX")
    name = normalize_fp8_weight_format(module.format, where=f"{where}: module.format")
    out, inp = module.out_features, module.in_features
    if module.weight_scale_method == "tensor":
        shape: tuple[int, ...] = ()
    elif module.weight_scale_method == "row":
        shape = (out,)
    else:
        br, bc = module.weight_block_size
        shape = (out // br, inp // bc)
    with torch.no_grad():
        codes = module.weight.detach().cpu().view(torch.uint8).contiguous().numpy()
        scales = module.weight_scale_inv.detach().cpu().to(torch.float32).reshape(shape).numpy()
        bias = None if module.bias is None else module.bias.detach().cpu().numpy()
    return (
        mx.array(codes),
        mx.array(scales),
        None if bias is None else mx.array(bias),
        name,
    )


class MlxFP8PackedLinear(nn.Module):
    """An MLX linear layer over FP8 bytes and FP32 inverse scales, decoded per call by table.

    Parameters ``qweight`` (``mx.uint8`` ``(out, in)``), ``scale_inv`` (``mx.float32`` ``()``,
    ``(out,)`` or ``(out/br, in/bc)``) and ``bias`` (``(out,)`` or absent) are the checkpoint's
    values, never re-encoded; the decode table is a private constant of the format.

    Args:
      qweight: FP8 byte codes of ``format``.
      scale_inv: FP32 inverse scales (decode divides by them), positive and finite.
      bias: ``(out,)`` float16/bfloat16/float32, finite, or ``None``.
      format: an encodable FP8 name or alias.

    Raises:
      TypeError: non-uint8 codes, non-float32 scales, a non-float bias.
      ValueError: empty or non-2-D codes, a scale shape that fits no layout, zero, negative or
        non-finite scales, a bias of the wrong shape or not finite, E8M0 or unknown formats.

    Numerics: ``x`` widened to FP32 exactly, FP32 products and sums, one rounding to
    ``x.dtype``; NaN codes give NaN. The routes differ only by FP32 rounding order
    (``docs/numerics.md``, "Constants that live once"); the two Metal routes agree bit for bit.

    Example:
      >>> layer = MlxFP8PackedLinear(mx.array([[0x38, 0xC0]], dtype=mx.uint8), mx.array(2.0))
      >>> layer(mx.array([[1.0, 1.0]])).tolist()
      [[-0.5]]
    """

    def __init__(
        self,
        qweight: UInt8[mx.array, "out in"],
        scale_inv: Float32[mx.array, "*scale"],
        bias: Float[mx.array, "out"] | None = None,  # noqa: F821
        *,
        format: str = "float8_e4m3fn",
    ) -> None:
        super().__init__()
        where = "MlxFP8PackedLinear"
        _check_codes(qweight, where=where)
        out, inp = qweight.shape
        _check_scales(scale_inv, (out, inp), where=where)
        _check_bias(bias, out, where=where)
        self.format: FP8WeightFormat = normalize_fp8_weight_format(format, where=f"{where}: format")
        self.out_features = out
        self.in_features = inp
        self.qweight = qweight
        self.scale_inv = scale_inv
        if bias is not None:
            self.bias = bias
        self._table = fp8_decode_table(self.format)

    @classmethod
    def from_torch(cls, module: Any) -> "MlxFP8PackedLinear":
        """Copy a :class:`floatxq.nn.TorchFP8Linear`'s bytes, scales and bias exactly.

        Args:
          module: a ``TorchFP8Linear`` of one of the four encodable formats, any scale layout.

        Returns:
          The MLX layer holding the same bytes, the FP32 scales in the canonical layout shape
          and the FP16 bias.

        Raises:
          TypeError: another module type.
          ValueError: a flattened convolution, an attached adapter, E8M0 codes, or scales that
            are not positive and finite.

        Numerics: exact copies (bytes, FP32 scales, FP16 bias).
        """
        codes, scales, bias, name = _torch_parts(module, where="MlxFP8PackedLinear.from_torch")
        return cls(codes, scales, bias, format=name)

    def dequantize(self) -> Float32[mx.array, "out in"]:
        """The decoded FP32 weight ``table[code] / scale_inv`` (NaN codes give NaN).

        Numerics: FP32 true division, bit-identical to :func:`floatxq.dequantize_fp8_weight`.
        """
        w = mx.take(self._table, self.qweight)
        s = self.scale_inv
        if s.ndim == 0:
            return w / s
        if s.ndim == 1:
            return w / s[:, None]
        out, inp = w.shape
        gr, gc = s.shape
        blocks = w.reshape(gr, out // gr, gc, inp // gc) / s[:, None, :, None]
        return blocks.reshape(out, inp)

    def route(self, rows: int) -> str:
        """The route a call with ``rows`` rows of ``x`` takes here.

        Returns:
          ``"prefill"`` or ``"general"`` (Metal kernels, where MLX has its Metal backend; the
          choice is :func:`floatxq.dispatch.mlx_packed_route`'s), else ``"array-ops"``.

        Example:
          >>> layer = MlxFP8PackedLinear(mx.zeros((8192, 64), dtype=mx.uint8), mx.array(1.0))
          >>> layer.route(32) in ("prefill", "array-ops")
          True
        """
        return mlx_packed_route(rows, self.in_features, self.out_features, metal=metal_available())[
            0
        ]

    def reference(self, x: Float[mx.array, "*batch in"]) -> Float[mx.array, "*batch out"]:
        """The array-ops product ``x @ dequantize().T + bias`` in FP32, returned in ``x``'s dtype.

        This is the route off Apple GPUs and the reference the Metal kernels are tested against.

        Raises:
          TypeError: ``x`` not an MLX float16/bfloat16/float32 array.
          ValueError: a last axis other than ``in_features``.
        """
        _check_x(x, self.in_features, where="MlxFP8PackedLinear")
        return self._array_ops(x)

    def _array_ops(self, x: mx.array) -> mx.array:
        y = x.astype(mx.float32) @ self.dequantize().T
        if "bias" in self:
            y = y + self.bias.astype(mx.float32)
        return y.astype(x.dtype)

    def __call__(self, x: Float[mx.array, "*batch in"]) -> Float[mx.array, "*batch out"]:
        """``x @ W.T + bias`` in FP32 from the FP8 bytes, returned in ``x``'s dtype.

        Raises:
          TypeError: ``x`` not an MLX float16/bfloat16/float32 array.
          ValueError: a last axis other than ``in_features``.
        """
        _check_x(x, self.in_features, where="MlxFP8PackedLinear")
        lead = tuple(x.shape[:-1])
        rows = math.prod(lead)
        route = self.route(rows)
        if route == "array-ops":
            return self._array_ops(x)
        if rows == 0:
            return mx.zeros((*lead, self.out_features), dtype=x.dtype)
        bias = self.bias if "bias" in self else None
        plan = packed_linear_launch(
            x.reshape(rows, self.in_features),
            self.qweight,
            self._table,
            self.scale_inv,
            bias,
            route=route,
        )
        return run_metal(plan).reshape(*lead, self.out_features)


def _packed_eligibility(layer: MlxFP8PackedLinear) -> str | None:
    if layer.format != "float8_e4m3fn":
        return f"format is {layer.format}; the native mxfp8 route needs float8_e4m3fn codes"
    if layer.scale_inv.ndim == 2:
        return "block scales; the native mxfp8 route needs tensor or row scales"
    if layer.in_features % _MX_GROUP:
        return f"in_features {layer.in_features} is not a multiple of {_MX_GROUP}"
    s = layer.scale_inv
    if not mx.all(mx.isfinite(s) & (s > 0) & mx.isfinite(1.0 / s)).item():
        return "inverse scales must be positive and finite with finite reciprocals"
    q = layer.qweight
    if mx.any((q == _E4M3FN_NAN[0]) | (q == _E4M3FN_NAN[1])).item():
        return "the weight holds E4M3FN NaN codes (0x7F/0xFF), which mxfp8 does not keep"
    return None


class MlxFP8Linear(nn.Module):
    """E4M3FN weights run through MLX's native ``mxfp8`` quantized matmul, exactly.

    ``linear`` is an ``mlx.nn.QuantizedLinear(group_size=32, bits=8, mode="mxfp8")`` without
    bias whose codes are the checkpoint's E4M3 bytes (packed four to a ``uint32``, little-endian)
    and whose E8M0 group scales are all 1 (byte 127); ``scale_inv`` (``()`` or ``(out,)``, FP32)
    and ``bias`` are applied after the product. Build it with :meth:`from_packed` or
    :meth:`from_torch`; :meth:`eligibility` says why a module cannot be transferred.

    Numerics: ``y = (x32 @ codes.T) / scale_inv + bias`` in FP32 (``x`` widened exactly, so a
    large unscaled sum cannot overflow FP16), rounded once to ``x.dtype``; it differs from the
    decoded reference only by FP32 summation order and where the division happens.

    Example:
      >>> codes = mx.array([[0x38] * 32], dtype=mx.uint8)
      >>> packed = MlxFP8PackedLinear(codes, mx.array([4.0]))
      >>> MlxFP8Linear.from_packed(packed)(mx.ones((1, 32))).tolist()
      [[8.0]]
    """

    def __init__(
        self,
        linear: nn.QuantizedLinear,
        scale_inv: Float32[mx.array, "*scale"],
        bias: Float[mx.array, "out"] | None = None,  # noqa: F821
    ) -> None:
        super().__init__()
        self.linear = linear
        self.scale_inv = scale_inv
        if bias is not None:
            self.bias = bias
        self.out_features, self.in_features = linear.weight.shape[0], linear.weight.shape[1] * 4

    @staticmethod
    def eligibility(module: Any) -> str | None:
        """Why ``module`` cannot take the native ``mxfp8`` route (``None``: it can).

        Args:
          module: a :class:`MlxFP8PackedLinear` or a :class:`floatxq.nn.TorchFP8Linear`.

        Returns:
          ``None`` when the transfer is exact, else the first failed rule in words: format not
          E4M3FN, block scales, ``in_features % 32 != 0``, scales not positive and finite with
          finite reciprocals, E4M3FN NaN codes (and, for torch modules, a convolution, an
          adapter or an E8M0 format).

        Raises:
          TypeError: another module type.

        Numerics: checks only (one pass over the bytes and scales).

        Example:
          >>> codes = mx.zeros((1, 16), dtype=mx.uint8)
          >>> MlxFP8Linear.eligibility(MlxFP8PackedLinear(codes, mx.array(1.0)))
          'in_features 16 is not a multiple of 32'
        """
        if isinstance(module, MlxFP8PackedLinear):
            return _packed_eligibility(module)
        try:
            packed = MlxFP8PackedLinear.from_torch(module)
        except ValueError as exc:
            return str(exc)
        return _packed_eligibility(packed)

    @classmethod
    def from_packed(cls, layer: MlxFP8PackedLinear) -> "MlxFP8Linear":
        """Transfer an eligible :class:`MlxFP8PackedLinear` to the native ``mxfp8`` route.

        Raises:
          TypeError: ``layer`` is not an ``MlxFP8PackedLinear``.
          ValueError: the layer is not eligible (the reason from :meth:`eligibility`).

        Numerics: codes copied bit for bit; group scales exactly 1.
        """
        if not isinstance(layer, MlxFP8PackedLinear):
            raise TypeError(
                f"MlxFP8Linear.from_packed: layer must be an MlxFP8PackedLinear, got "
                f"{type(layer).__name__}"
            )
        why = _packed_eligibility(layer)
        if why is not None:
            raise ValueError(f"MlxFP8Linear.from_packed: cannot use mxfp8 exactly: {why}")
        out, inp = layer.out_features, layer.in_features
        linear = nn.QuantizedLinear(inp, out, bias=False, group_size=32, bits=8, mode="mxfp8")
        codes = np.array(layer.qweight, copy=True)
        linear.weight = mx.array(codes.view("<u4"))
        linear.scales = mx.full((out, inp // _MX_GROUP), _E8M0_ONE, dtype=mx.uint8)
        bias = layer.bias if "bias" in layer else None
        return cls(linear, layer.scale_inv, bias)

    @classmethod
    def from_torch(cls, module: Any) -> "MlxFP8Linear":
        """Transfer an eligible :class:`floatxq.nn.TorchFP8Linear` to the native route.

        Raises:
          TypeError: another module type.
          ValueError: as :meth:`MlxFP8PackedLinear.from_torch`, or not eligible.

        Numerics: as :meth:`from_packed`.
        """
        return cls.from_packed(MlxFP8PackedLinear.from_torch(module))

    def __call__(self, x: Float[mx.array, "*batch in"]) -> Float[mx.array, "*batch out"]:
        """``(x @ codes.T) / scale_inv + bias`` in FP32, returned in ``x``'s dtype.

        Raises:
          TypeError: ``x`` not an MLX float16/bfloat16/float32 array.
          ValueError: a last axis other than ``in_features``.
        """
        _check_x(x, self.in_features, where="MlxFP8Linear")
        y = self.linear(x.astype(mx.float32)).astype(mx.float32) / self.scale_inv
        if "bias" in self:
            y = y + self.bias.astype(mx.float32)
        return y.astype(x.dtype)
