"""The shared INT4 base of the W4A modules: a :class:`~floatxq.nn.gptq_linear.GPTQLinear`
restricted to symmetric 4-bit codes in groups of 128 (``desc_act=False``, zero point 8,
``in % 128 == 0``, ``out % 32 == 0``), GPTQ's buffers under GPTQ's keys plus staged caches
(moved as bytes, emptied by loads and :meth:`W4ALinear.pack`), and a requested route held in
the module's :class:`floatxq.dispatch.RoutePreference` (the choice is :mod:`floatxq.dispatch`'s).
"""

import dataclasses
import math
from typing import Any

import torch

from floatxq._checks import check_linear_input, check_size
from floatxq._typing import Float, Tensor
from floatxq.dispatch import RoutePreference
from floatxq.formats import K_GROUP
from floatxq.gptq.int4 import GPTQPacked
from floatxq.nn._preference import RoutePreferenceHolder
from floatxq.nn.gptq_linear import _BUFFERS, GPTQLinear
from floatxq.w4a.linear import W4A_OUTPUT_DTYPES
from floatxq.w4a.weight import W4A_COLUMNS, w4a_weight_ineligibility

__all__ = ["W4ALinear", "is_carrier", "w4a_ineligibility"]


def w4a_ineligibility(module: GPTQLinear, *, gemm: str, where: str) -> str | None:
    """:func:`floatxq.w4a.weight.w4a_weight_ineligibility` of ``module``'s weight (``TypeError``
    for a module that is not a ``GPTQLinear``)."""
    if not isinstance(module, GPTQLinear):
        raise TypeError(f"{where}: module must be a GPTQLinear, got {type(module).__name__}")
    return w4a_weight_ineligibility(
        module.packed(), bits=module.bits, group_size=module.group_size, format=module.format,
        gemm=gemm,
    )  # fmt: skip


def is_carrier(x: Any) -> bool:
    """Duck-typed :class:`floatxq.W4AActivation`."""
    return all(hasattr(x, a) for a in ("codes", "scales", "shape", "model_dtype", "mode"))


class W4ALinear(RoutePreferenceHolder, GPTQLinear):
    """Base of ``W4AFP8Linear`` and ``W4ANVFP4Linear`` (not used alone).

    Subclasses set :attr:`_CACHES` (their staged operands), :attr:`_ROUTE_FIELD` (their field
    of :class:`~floatxq.dispatch.RoutePreference`) and :attr:`_GEMM` (the GEMM's name in
    messages), and implement ``post_init``, ``_forward_tensor`` and ``_forward_carrier``.
    """

    bits = 4
    group_size = K_GROUP
    desc_act = False
    sym = True
    REQUIRES_FORMAT_V2 = True
    """GPT-QModel's flag (its loader converts v1 zero words to v2); here both formats run, the
    zero words are only checked."""

    _CACHES: tuple[str, ...] = ()
    _PERSISTENT: tuple[str, ...] = ()
    _ROUTE_FIELD = ""
    _GEMM = ""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        bits: int = 4,
        group_size: int = K_GROUP,
        desc_act: bool = False,
        sym: bool = True,
        format: str = "gptq",
        bias: bool = False,
        scales_dtype: torch.dtype = torch.float16,
        bias_dtype: torch.dtype = torch.float16,
        device: torch.device | str | None = None,
        route: str = "auto",
    ) -> None:
        self._check_settings(in_features, out_features, bits, group_size, desc_act, sym)
        super().__init__(
            in_features, out_features, bits=4, group_size=K_GROUP, format=format, bias=bias,
            scales_dtype=scales_dtype, bias_dtype=bias_dtype, device=device,
        )  # fmt: skip
        for name in self._CACHES:
            self.register_buffer(name, None, persistent=False)
        self.route_preference = RoutePreference()
        self.route = route

    def _check_settings(
        self, in_features: int, out_features: int, bits: object, group_size: object,
        desc_act: object, sym: object,
    ) -> None:  # fmt: skip
        """The constructor checks: sizes, the only settings the GEMMs take (4 / 128 / False /
        True), ``in % 128`` and ``out % 32``."""
        where, gemm = type(self).__name__, self._GEMM
        check_size(in_features, name="in_features", where=where)
        check_size(out_features, name="out_features", where=where)
        for name, value, kind, wanted in (
            ("bits", bits, int, 4),
            ("group_size", group_size, int, K_GROUP),
            ("desc_act", desc_act, bool, False),
            ("sym", sym, bool, True),
        ):
            if type(value) is not kind:
                raise TypeError(f"{where}: {name} must be a {kind.__name__}, got {value!r}")
            if value != wanted:
                raise ValueError(
                    f"{where}: {name}={value} is not supported; the {gemm} GEMM takes bits=4, "
                    f"group_size={K_GROUP}, desc_act=False, sym=True"
                )
        for name, value, multiple in (
            ("in_features", in_features, K_GROUP),
            ("out_features", out_features, W4A_COLUMNS),
        ):
            if value % multiple:
                raise ValueError(f"{where}: {name}={value} must be a multiple of {multiple}")

    @classmethod
    def from_packed(
        cls,
        packed: GPTQPacked,
        *,
        format: str,
        bias: Float[Tensor, "out"] | None = None,  # noqa: F821
        bits: int = 4,
        group_size: int = K_GROUP,
    ) -> Any:
        """A ready module holding ``packed``'s tensors as they are (no copy), staged
        (``W4ANVFP4Linear``: its activation global scale 0.0, dynamic).

        Args:
          packed, format, bias: as :meth:`GPTQLinear.from_packed` (4-bit, ``in / 128`` groups).
          bits, group_size: accepted only as 4 and 128.

        Raises:
          TypeError, ValueError: what :meth:`GPTQLinear.from_packed` refuses, the class
            constraints, and :func:`floatxq.centered_int4`'s refusals.

        Numerics: exact; the staged operands equal ``code - 8``.
        """
        return cls._built(packed, format=format, bias=bias, bits=bits, group_size=group_size)

    @classmethod
    def _built(cls, packed: GPTQPacked, *, module: GPTQLinear | None = None, **kw: Any) -> Any:
        layer = super().from_packed(packed, **kw)
        layer._adopt(packed, module)
        return layer.post_init()

    @classmethod
    def from_gptq_linear(cls, module: GPTQLinear) -> Any:
        """The module of an eligible :class:`GPTQLinear` (sharing its tensors); a module of
        this class keeps its activation settings.

        Raises:
          TypeError: ``module`` is not a ``GPTQLinear``.
          ValueError: what ``w4a_*_ineligibility`` names.

        Numerics: exact.
        """
        where = f"{cls.__name__}.from_gptq_linear"
        if not isinstance(module, GPTQLinear):
            raise TypeError(f"{where}: module must be a GPTQLinear, got {type(module).__name__}")
        why = w4a_ineligibility(module, gemm=cls._GEMM, where=where)
        if why is not None:
            raise ValueError(f"{where}: this GPTQLinear cannot run as {cls._GEMM}: {why}")
        layer = cls._built(
            module.packed(), module=module, format=module.format, bias=module.bias, bits=4,
            group_size=K_GROUP,
        )  # fmt: skip
        return layer.train(module.training)

    def _adopt(self, packed: GPTQPacked, module: GPTQLinear | None) -> None:
        """After ``GPTQLinear.from_packed``: buffers of the subclass's own (``module``: the
        module converted, if any)."""

    def pack(self, packed: GPTQPacked, *, format: str | None = None) -> None:
        """Replace the weight with ``packed``'s tensors (4-bit, this module's shapes, ``qzeros``
        in ``format``, default the module's); empties the caches: call ``post_init()`` next.

        Raises:
          TypeError, ValueError: an invalid ``packed`` or one of other shapes than the module's.

        Numerics: exact; the tensors are held as given (no copy).
        """
        where = f"{type(self).__name__}.pack"
        like = GPTQLinear.from_packed(
            packed, bits=4, group_size=K_GROUP, format=format or self.format
        )
        if (like.in_features, like.out_features) != (self.in_features, self.out_features):
            raise ValueError(
                f"{where}: packed holds a ({like.out_features}, {like.in_features}) weight; this "
                f"module is ({self.out_features}, {self.in_features})"
            )
        for name in self._CACHES:
            self._buffers[name] = None
        self.__dict__["_plans"] = {}
        for name in ("qweight", "qzeros", "scales", "g_idx"):
            self._buffers[name] = like._buffers[name]
        self.format = like.format

    def _byte_buffer_names(self) -> tuple[str, ...]:
        return (*_BUFFERS, *self._PERSISTENT, *self._CACHES)

    def _loaded(self, prefix: str, missing_keys: list[str]) -> None:
        # stale once a buffer may have changed (a refused load raised and changed nothing)
        for name in self._CACHES:
            self._buffers[name] = None
        self.__dict__["_plans"] = {}

    @property
    def route(self) -> str:
        """The requested route: a field of :attr:`route_preference` (setting it replaces the
        record)."""
        return getattr(self.route_preference, self._ROUTE_FIELD)

    @route.setter
    def route(self, value: str) -> None:
        self.route_preference = dataclasses.replace(
            self.route_preference, **{self._ROUTE_FIELD: value}
        )

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, route={self.route}"

    def _staged(self, name: str = "_weight_e4m3") -> Tensor:
        cache = self._buffers.get(name)
        if cache is None:
            raise RuntimeError(
                f"{type(self).__name__}: the staged weight cache is absent; call post_init() "
                f"after loading or packing"
            )
        return cache

    def _check_device(self, device: torch.device) -> None:
        if device != self.qweight.device:
            raise TypeError(
                f"{type(self).__name__}: x is on {device} but the module's buffers are on "
                f"{self.qweight.device}; move one of them with .to()"
            )

    def forward(self, x: Any) -> Float[Tensor, "..."]:
        """``x @ W.T + bias``: ``x`` a float16/bfloat16/float32 tensor ``(*, in)`` quantized for
        the GEMM, or a :class:`floatxq.W4AActivation` of a mode the module takes (used as is).
        Returns ``(*, out)`` in ``x``'s dtype (a carrier's ``model_dtype``).

        Raises:
          TypeError: another kind of ``x`` or dtype, ``x`` on another device than the buffers.
          ValueError: ``x``'s last axis is not ``in_features``; NaN or infinity in ``x`` (checked
            routes); a carrier of another mode or of inconsistent shapes.
          RuntimeError: a weight cache absent (call ``post_init()``); a forced route that
            cannot run here.

        Numerics: see the class docstring.
        """
        if isinstance(x, torch.Tensor):
            return self._forward_tensor(x)
        if is_carrier(x):
            return self._forward_carrier(x)
        raise TypeError(
            f"{type(self).__name__}: x must be a floating tensor or a W4AActivation, got "
            f"{type(x).__name__}"
        )

    def _rows_of(self, x: Tensor) -> Tensor:
        """``x`` ``(*, in)`` checked (dtype, shape, device) and flattened to ``(rows, in)``."""
        where = type(self).__name__
        if x.dtype not in W4A_OUTPUT_DTYPES:
            raise TypeError(
                f"{where}: x must be a float16, bfloat16 or float32 tensor, got {x.dtype}"
            )
        check_linear_input(x, self.in_features, self.qweight.device, where=where)
        return x.reshape(math.prod(x.shape[:-1]), self.in_features)

    def _carrier_codes(
        self, carrier: Any, mode: str, width: int, kind: torch.dtype
    ) -> tuple[Tensor, tuple, torch.dtype]:
        """``(codes, shape, model_dtype)`` of a carrier of ``mode`` (already accepted), checked
        against this module: shape ``(*, in)``, codes ``(rows, width)`` of
        ``kind``, a float16/bfloat16/float32 model dtype, the buffers' device."""
        where = type(self).__name__
        codes, shape, dtype = carrier.codes, tuple(carrier.shape), carrier.model_dtype
        k = self.in_features
        if not shape or shape[-1] != k:
            raise ValueError(f"{where}: the carrier's shape must be (*, {k}), got {shape}")
        rows = math.prod(shape[:-1])
        if not isinstance(codes, torch.Tensor) or tuple(codes.shape) != (rows, width):
            got = tuple(codes.shape) if isinstance(codes, torch.Tensor) else type(codes).__name__
            raise ValueError(
                f"{where}: the carrier's codes must have shape ({rows}, {width}) for shape "
                f"{shape} in mode {mode!r}, got {got}"
            )
        if codes.dtype != kind:
            raise TypeError(
                f"{where}: a {mode!r} carrier's codes must be {kind}, got {codes.dtype}"
            )
        if dtype not in W4A_OUTPUT_DTYPES:
            raise TypeError(
                f"{where}: the carrier's model_dtype must be float16, bfloat16 or float32, got "
                f"{dtype!r}"
            )
        self._check_device(codes.device)
        return codes, shape, dtype
