"""``W4AFP8Linear``: symmetric INT4 GPTQ weights (groups of 128) times FP8 per-token activations.

The module is a :class:`~floatxq.nn.gptq_linear.GPTQLinear` restricted to what the W4A-FP8 GEMM
takes (4-bit codes, groups of 128, ``desc_act=False``, zero point 8 everywhere, ``in % 128 ==
0``, ``out % 32 == 0``), so it holds GPTQ's persistent buffers under GPTQ's state-dict keys,
moves them as bytes, checks incoming state dicts the same way and saves as an ordinary GPTQ
checkpoint. Beside them it keeps one non-persistent cache, built by :meth:`post_init`:

* ``_weight_e4m3``: ``float8_e4m3fn (in, out)``, the centered codes ``code - 8`` staged as exact
  E4M3 values (:func:`floatxq.int4_to_e4m3`), stored K-contiguous (strides ``(1, in)``:
  the layout the kernel's E4M3 tiles read fastest). ``.to()`` moves it as ``uint8`` bytes, so a
  dtype cast of the model never rounds or reinterprets it. ``load_state_dict`` and :meth:`pack`
  empty it; a forward without it raises ``RuntimeError`` until :meth:`post_init` runs again.

A call quantizes each row of ``x`` to E4M3 with one FP32 scale (:func:`floatxq.fp8_token_quantize`)
and runs the grouped GEMM of :func:`floatxq.w4a_fp8_linear`: through the kernels of
:mod:`floatxq.kernels.w4a_fp8` (route ``"triton"``: ``fp8_pack``, then the Triton GEMM on the
int32 words for decode-sized calls, on the staged E4M3 operand above, and cuBLAS's blockwise
FP8 GEMM from 128 rows on Hopper) where they can run, else through the pure reference (route
``"reference"``, any device). An FP8-mode activation carrier (codes already
quantized) skips the quantization. ``last_route`` (``"triton"`` or ``"reference"``, ``"none"``
before any call) and ``last_reason`` (``None`` when the kernels ran) say what the last call did,
recorded as GPTQLinear records its routes.
"""

import math
from collections.abc import Callable
from typing import Any

import torch

from floatxq._typing import Float, Tensor
from floatxq.config import BACKEND
from floatxq.formats import GPTQ_W4A_GROUP_SIZE
from floatxq.gptq.int4 import GPTQPacked, centered_int4, int4_to_e4m3
from floatxq.nn.fp8_linear import _move_bytes
from floatxq.nn.gptq_linear import GPTQLinear, _check_size
from floatxq.w4a.linear import W4A_OUTPUT_DTYPES, w4a_fp8_linear, w4a_fp8_linear_prepacked

__all__ = ["W4A_FP8_ROUTES", "W4AFP8Linear", "w4a_fp8_ineligibility", "w4a_fp8_route"]

W4A_FP8_ROUTES: tuple[str, ...] = ("auto", "triton", "reference")
"""Values of :attr:`W4AFP8Linear.route`: ``"auto"`` takes the kernels where they run."""

_GROUP = GPTQ_W4A_GROUP_SIZE
_COLUMNS = 32  # out_features multiple: GPT-QModel's W4A-FP8 constraint (the GEMM's column tiles)
_CACHE = "_weight_e4m3"
# a symmetric 4-bit zero word, every field 8: v1 stores zero - 1 (0x77777777), v2 the zero
# (0x88888888, held as the int32 with those bits)
_SYM_WORD = {"gptq": 0x77777777, "gptq_v2": 0x88888888 - (1 << 32)}
_FP8_MODES = ("w4afp8",)


def _kernels_unavailable(device: torch.device) -> str | None:
    """The kernels' own reason they cannot run on ``device``, or why they do not import."""
    try:
        from floatxq.kernels.w4a_fp8 import w4a_fp8_unavailable_reason
    except ImportError as exc:  # pragma: no cover - the kernels ship with floatxq
        return f"floatxq.kernels.w4a_fp8 does not import ({exc})"
    return w4a_fp8_unavailable_reason(device)


def w4a_fp8_route(requested: str, device: torch.device) -> tuple[str, str | None]:
    """The route a call on ``device`` takes, and why the kernels were not taken.

    Args:
      requested: ``"auto"``, ``"triton"`` or ``"reference"``.
      device: where the call's tensors are.

    Returns:
      ``(route, reason)``: ``("triton", None)`` where the kernels can run (``"auto"`` or
      ``"triton"``); else ``("reference", why)``.

    Raises:
      ValueError: an unknown ``requested``.
      RuntimeError: ``"triton"`` requested where the kernels cannot run (the reason named).

    Numerics: none (both routes compute :func:`floatxq.w4a_fp8_linear`, up to FP32 order).

    Example:
      >>> w4a_fp8_route("reference", torch.device("cpu"))
      ('reference', "route='reference' was requested")
    """
    if requested not in W4A_FP8_ROUTES:
        raise ValueError(f"W4AFP8Linear: route must be one of {W4A_FP8_ROUTES}, got {requested!r}")
    if requested == "reference":
        return "reference", "route='reference' was requested"
    reason = _kernels_unavailable(device)
    if reason is None:
        return "triton", None
    if requested == "triton":
        raise RuntimeError(f"W4AFP8Linear: route='triton' cannot run on {device}: {reason}")
    return "reference", reason


def w4a_fp8_ineligibility(module: GPTQLinear) -> str | None:
    """Why ``module``'s weight cannot run as W4A-FP8, or ``None`` when it can.

    Checked in this order (the first failure is named): 4-bit codes, groups of 128, ``in`` a
    multiple of 128, ``out`` a multiple of 32, ``g_idx == arange(in) // 128`` (no ``desc_act``
    reordering), every zero point 8 (symmetric).

    Args:
      module: a :class:`~floatxq.nn.gptq_linear.GPTQLinear` holding data (not on ``meta``).

    Returns:
      ``None``, or one sentence naming the value that disqualifies it.

    Raises:
      TypeError: ``module`` is not a ``GPTQLinear``.

    Numerics: exact comparisons of the stored words.

    Example:
      >>> from floatxq.gptq.solve import GPTQSolveOptions, rtn_quantize
      >>> sol = rtn_quantize(torch.randn(32, 128), GPTQSolveOptions(bits=8, group_size=128))
      >>> w4a_fp8_ineligibility(GPTQLinear.from_solution(sol, bits=8, group_size=128))
      'bits=8; W4A-FP8 takes 4-bit codes'
    """
    return _ineligibility(module, gemm="W4A-FP8", where="w4a_fp8_ineligibility")


def _ineligibility(module: GPTQLinear, *, gemm: str, where: str) -> str | None:
    """:func:`w4a_fp8_ineligibility` with the sentence naming ``gemm`` (the W4A GEMMs share
    these constraints)."""
    if not isinstance(module, GPTQLinear):
        raise TypeError(f"{where}: module must be a GPTQLinear, got {type(module).__name__}")
    if module.bits != 4:
        return f"bits={module.bits}; {gemm} takes 4-bit codes"
    if module.group_size != _GROUP:
        return f"group_size={module.group_size}; {gemm} takes groups of {_GROUP}"
    k, n = module.in_features, module.out_features
    if k % _GROUP:
        return f"in_features={k} is not a multiple of {_GROUP}"
    if n % _COLUMNS:
        return f"out_features={n} is not a multiple of {_COLUMNS}"
    g_idx = module.g_idx.to(torch.int64)
    if not torch.equal(g_idx, torch.arange(k, device=g_idx.device) // _GROUP):
        return (
            f"g_idx is not arange(in) // {_GROUP} (a desc_act / reordered checkpoint, starting "
            f"{module.g_idx[:4].tolist()}); {gemm} takes contiguous groups (desc_act=False)"
        )
    if bool((module.qzeros != _SYM_WORD[module.format]).any()):
        zeros = module.unpacked().zeros
        group, column = (int(i) for i in (zeros != 8).nonzero()[0])
        return (
            f"asymmetric zero points: group {group}, output column {column} has zero point "
            f"{int(zeros[group, column])}; {gemm} takes symmetric weights (zero point 8)"
        )
    return None


def _check_w4a_settings(
    in_features: int, out_features: int, bits: object, group_size: object, desc_act: object,
    sym: object, *, where: str, gemm: str,
) -> None:  # fmt: skip
    """A W4A module's constructor checks: sizes, the only settings the GEMMs take (4 / 128 /
    False / True), ``in % 128`` and ``out % 32``."""
    _check_size(in_features, name="in_features", where=where)
    _check_size(out_features, name="out_features", where=where)
    for name, value, kind, wanted in (
        ("bits", bits, int, 4),
        ("group_size", group_size, int, _GROUP),
        ("desc_act", desc_act, bool, False),
        ("sym", sym, bool, True),
    ):
        if type(value) is not kind:
            raise TypeError(f"{where}: {name} must be a {kind.__name__}, got {value!r}")
        if value != wanted:
            raise ValueError(
                f"{where}: {name}={value} is not supported; the {gemm} GEMM takes bits=4, "
                f"group_size={_GROUP}, desc_act=False, sym=True"
            )
    if in_features % _GROUP:
        raise ValueError(
            f"{where}: in_features={in_features} must be a multiple of {_GROUP} (one GPTQ "
            f"group per 128 input rows)"
        )
    if out_features % _COLUMNS:
        raise ValueError(f"{where}: out_features={out_features} must be a multiple of {_COLUMNS}")


def _repack(
    module: GPTQLinear, packed: GPTQPacked, format: str | None, caches: tuple[str, ...], *,
    where: str,
) -> None:  # fmt: skip
    """A W4A module's :meth:`pack`: ``packed``'s tensors (checked, of the module's geometry)
    replace its GPTQ buffers, and its staged caches are emptied."""
    like = GPTQLinear.from_packed(packed, bits=4, group_size=_GROUP, format=format or module.format)
    if (like.in_features, like.out_features) != (module.in_features, module.out_features):
        raise ValueError(
            f"{where}: packed holds a ({like.out_features}, {like.in_features}) weight; this "
            f"module is ({module.out_features}, {module.in_features})"
        )
    for name in caches:
        module._buffers[name] = None
    for name in ("qweight", "qzeros", "scales", "g_idx"):
        module._buffers[name] = like._buffers[name]
    module.format = like.format


def _is_carrier(x: Any) -> bool:
    """Duck-typed :class:`floatxq.W4AActivation` (not imported: no cycle)."""
    return all(hasattr(x, a) for a in ("codes", "scales", "shape", "model_dtype", "mode"))


class W4AFP8Linear(GPTQLinear):
    """A GPTQ INT4 linear layer whose calls multiply FP8 E4M3 tokens by the integer weight.

    ``y = (Σ_g scales[g] · Σ_{k in g} e4m3(x)[k] · (code[k] - 8)) · row_scale + bias``
    (:func:`floatxq.w4a_fp8_linear`). The constructor allocates zero-filled GPTQ buffers for
    ``load_state_dict`` to fill (then :meth:`post_init`); :meth:`from_packed` and
    :meth:`from_gptq_linear` build a ready module.

    Args:
      in_features, out_features: the weight's ``(out, in)`` shape; ``in`` a multiple of 128,
        ``out`` a multiple of 32.
      bits, group_size, desc_act, sym: GPT-QModel's quantization settings, accepted only as
        4, 128, False, True (the only ones the W4A-FP8 GEMM takes).
      format: ``"gptq"`` (v1 zero words) or ``"gptq_v2"``, as ``qzeros`` is held; both run.
      bias, scales_dtype, bias_dtype, device: as :class:`~floatxq.nn.gptq_linear.GPTQLinear`.
      route: ``"auto"`` (the kernels where they run, else the reference), ``"triton"`` (raise
        ``RuntimeError`` where they cannot run) or ``"reference"``.

    Raises:
      TypeError: non-integer sizes or settings, non-floating dtypes.
      ValueError: a setting other than 4 / 128 / False / True, ``in % 128``, ``out % 32``, an
        unknown format or route.

    Numerics: E4M3 token codes by :func:`floatxq.fp8_token_quantize`; each group's 128 products
    (exact) summed in FP32, groups added in ascending order after their scale, the token scale
    once, then the bias, one rounding to ``x``'s dtype. The kernels equal the reference up to
    FP32 summation order.

    Example:
      >>> from floatxq.gptq.solve import GPTQSolveOptions, rtn_quantize
      >>> sol = rtn_quantize(torch.randn(32, 128), GPTQSolveOptions(bits=4, group_size=128))
      >>> layer = W4AFP8Linear.from_gptq_linear(GPTQLinear.from_solution(sol, bits=4,
      ...     group_size=128))
      >>> layer(torch.randn(3, 128)).shape, layer._weight_e4m3.shape, layer.last_route
      (torch.Size([3, 32]), torch.Size([128, 32]), 'reference')
    """

    bits = 4
    group_size = _GROUP
    desc_act = False
    sym = True
    REQUIRES_FORMAT_V2 = True
    """GPT-QModel's flag (its loader converts v1 zero words to v2); here both formats run, the
    zero words are only checked."""
    backend = BACKEND.GPTQ_W4AFP8
    MIN_COMPUTE_CAPABILITY = (8, 9)
    """FP8 tensor cores (Ada SM 8.9 and newer) for the ``"triton"`` route on CUDA."""

    _weight_e4m3: Tensor | None

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        bits: int = 4,
        group_size: int = _GROUP,
        desc_act: bool = False,
        sym: bool = True,
        format: str = "gptq",
        bias: bool = False,
        scales_dtype: torch.dtype = torch.float16,
        bias_dtype: torch.dtype = torch.float16,
        device: torch.device | str | None = None,
        route: str = "auto",
    ) -> None:
        _check_w4a_settings(
            in_features, out_features, bits, group_size, desc_act, sym,
            where="W4AFP8Linear", gemm="W4A-FP8",
        )  # fmt: skip
        super().__init__(
            in_features,
            out_features,
            bits=4,
            group_size=_GROUP,
            format=format,
            bias=bias,
            scales_dtype=scales_dtype,
            bias_dtype=bias_dtype,
            device=device,
        )
        self.register_buffer(_CACHE, None, persistent=False)
        self.route = route

    # ------------------------------------------------------------------------------------------
    # Construction, staging and export
    # ------------------------------------------------------------------------------------------

    @classmethod
    def from_packed(
        cls,
        packed: GPTQPacked,
        *,
        format: str,
        bias: Float[Tensor, "out"] | None = None,  # noqa: F821
        bits: int = 4,
        group_size: int = _GROUP,
    ) -> "W4AFP8Linear":
        """A ready module holding ``packed``'s tensors as they are (no copy), staged.

        Args:
          packed: a 4-bit :class:`floatxq.GPTQPacked` with ``in / 128`` groups.
          format: ``"gptq"`` or ``"gptq_v2"``, the convention of ``packed.qzeros``.
          bias: ``(out,)`` floating or ``None``, kept in its dtype.
          bits, group_size: accepted only as 4 and 128 (GPTQLinear's signature).

        Returns:
          A :class:`W4AFP8Linear` after :meth:`post_init`.

        Raises:
          TypeError, ValueError: what :meth:`GPTQLinear.from_packed` refuses, the class
            constraints, and :func:`floatxq.centered_int4`'s refusals (``g_idx`` not
            ``arange(in) // 128``, a zero point other than 8, naming its group and column).

        Numerics: exact; the staged operand equals ``code - 8``.
        """
        layer = super().from_packed(
            packed, bits=bits, group_size=group_size, format=format, bias=bias
        )
        return layer.post_init()

    @classmethod
    def from_gptq_linear(cls, module: GPTQLinear) -> "W4AFP8Linear":
        """The W4A-FP8 module of an eligible :class:`GPTQLinear` (sharing its tensors).

        Raises:
          TypeError: ``module`` is not a ``GPTQLinear``.
          ValueError: what :func:`w4a_fp8_ineligibility` names (bits, group size, sizes,
            ``desc_act`` / reordered ``g_idx``, asymmetric zero points).

        Numerics: exact.
        """
        where = "W4AFP8Linear.from_gptq_linear"
        if not isinstance(module, GPTQLinear):
            raise TypeError(f"{where}: module must be a GPTQLinear, got {type(module).__name__}")
        why = w4a_fp8_ineligibility(module)
        if why is not None:
            raise ValueError(f"{where}: this GPTQLinear cannot run as W4A-FP8: {why}")
        layer = cls.from_packed(module.packed(), format=module.format, bias=module.bias)
        return layer.train(module.training)

    def post_init(self) -> "W4AFP8Linear":
        """Stage ``_weight_e4m3`` from the buffers (after loading or :meth:`pack`); returns self.

        Raises:
          ValueError: :func:`floatxq.centered_int4`'s refusals (``g_idx`` not
            ``arange(in) // 128``, a zero point other than 8: its group and column named).

        Numerics: exact integers ``code - 8`` in E4M3.
        """
        centered = centered_int4(self.packed(), format=self.format)
        # K-contiguous (strides (1, in)): the E4M3 GEMM tiles read 128-long runs of K
        self._buffers[_CACHE] = int4_to_e4m3(centered.T.contiguous()).T
        return self

    def pack(self, packed: GPTQPacked, *, format: str | None = None) -> None:
        """Replace the weight with ``packed``'s tensors (the same geometry); empties the cache.

        Call :meth:`post_init` before the next forward.

        Args:
          packed: a 4-bit :class:`floatxq.GPTQPacked` of this module's shapes.
          format: its ``qzeros`` convention (default: the module's).

        Raises:
          TypeError, ValueError: an invalid ``packed`` or one of other shapes than the module's.

        Numerics: exact; the tensors are held as given (no copy).
        """
        _repack(self, packed, format, (_CACHE,), where="W4AFP8Linear.pack")

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, route={self.route}"

    # ------------------------------------------------------------------------------------------
    # Buffers as bytes; the cache emptied by loads
    # ------------------------------------------------------------------------------------------

    def _apply(self, fn: Callable[[Tensor], Tensor], recurse: bool = True) -> "W4AFP8Linear":
        """GPTQLinear's byte moves, and the staged cache moved as ``uint8`` (never cast)."""
        cache = self._buffers.get(_CACHE)
        self._buffers[_CACHE] = None
        try:
            super()._apply(fn, recurse)
        except BaseException:
            self._buffers[_CACHE] = cache
            raise
        if cache is not None:
            moved = _move_bytes(fn, cache.view(torch.uint8))
            self._buffers[_CACHE] = moved.view(torch.float8_e4m3fn)
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
        super()._load_from_state_dict(
            state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
        )
        # stale once a buffer may have changed (a refused load raised above and changed
        # nothing): post_init() rebuilds it
        self._buffers[_CACHE] = None

    # ------------------------------------------------------------------------------------------
    # Forward
    # ------------------------------------------------------------------------------------------

    @property
    def route(self) -> str:
        """The requested route: ``"auto"``, ``"triton"`` or ``"reference"``."""
        return self.__dict__["_route_choice"]

    @route.setter
    def route(self, value: str) -> None:
        if value not in W4A_FP8_ROUTES:
            raise ValueError(f"W4AFP8Linear: route must be one of {W4A_FP8_ROUTES}, got {value!r}")
        self.__dict__["_route_choice"] = value

    def _staged(self) -> Tensor:
        cache = self._buffers.get(_CACHE)
        if cache is None:
            raise RuntimeError(
                "W4AFP8Linear: the staged weight cache is absent; call post_init() after loading "
                "or packing"
            )
        return cache

    def forward(self, x: Any) -> Float[Tensor, "..."]:
        """``x @ W.T + bias`` with ``x`` quantized per token to E4M3.

        Args:
          x: a float16/bfloat16/float32 tensor ``(*, in)``, or an FP8-mode activation carrier
            (``codes`` E4M3 ``(rows, in)``, ``scales`` FP32 ``(rows,)``, ``shape``,
            ``model_dtype``): its codes are used as they are.

        Returns:
          ``(*, out)`` in ``x``'s dtype (a carrier: ``model_dtype``, ``shape[:-1] + (out,)``).

        Raises:
          TypeError: another kind of ``x`` or dtype, ``x`` on another device than the buffers.
          ValueError: ``x``'s last axis is not ``in_features``; a carrier of another mode, with
            a rotation or token scale, or of inconsistent shapes; NaN or infinity in ``x``
            (reference route).
          RuntimeError: the cache is absent (see :meth:`post_init`); ``route="triton"`` where
            the kernels cannot run.

        Numerics: see the class docstring.
        """
        if isinstance(x, torch.Tensor):
            return self._forward_tensor(x)
        if _is_carrier(x):
            return self._forward_carrier(x)
        raise TypeError(
            f"W4AFP8Linear: x must be a floating tensor or an FP8 W4AActivation, got "
            f"{type(x).__name__}"
        )

    def _check_device(self, device: torch.device) -> None:
        if device != self.qweight.device:
            raise TypeError(
                f"W4AFP8Linear: x is on {device} but the module's buffers are on "
                f"{self.qweight.device}; move one of them with .to()"
            )

    def _weight_for(self, rows: int, staged: Tensor) -> Tensor:
        from floatxq.kernels.w4a_fp8 import w4a_fp8_operand

        return self.qweight if w4a_fp8_operand(rows) == "words" else staged

    def _forward_tensor(self, x: Tensor) -> Tensor:
        where = "W4AFP8Linear"
        if x.dtype not in W4A_OUTPUT_DTYPES:
            raise TypeError(
                f"{where}: x must be a float16, bfloat16 or float32 tensor, got {x.dtype}"
            )
        k, n = self.in_features, self.out_features
        if x.ndim == 0 or x.shape[-1] != k:
            raise ValueError(f"{where}: x must have shape (*, {k}), got {tuple(x.shape)}")
        self._check_device(x.device)
        staged = self._staged()
        route, reason = w4a_fp8_route(self.route, x.device)
        rows = math.prod(x.shape[:-1])
        x2d = x.reshape(rows, k)
        if route == "triton":
            from floatxq.kernels.w4a_fp8 import fp8_linear

            out = fp8_linear(x2d, self._weight_for(rows, staged), self.scales, self.bias)
        else:
            out = w4a_fp8_linear(x2d, staged, self.scales, self.bias)
        self._set_last(route, reason)
        return out.reshape(*x.shape[:-1], n)

    def _forward_carrier(self, carrier: Any) -> Tensor:
        where = "W4AFP8Linear"
        mode = carrier.mode
        if not isinstance(mode, str) or mode.strip().lower() not in _FP8_MODES:
            raise ValueError(
                f"{where}: the activation carrier has mode {mode!r}; this module takes FP8 "
                f"tokens (mode 'w4afp8'), not NVFP4 ones"
            )
        if getattr(carrier, "rotation_applied", False):
            raise ValueError(
                f"{where}: the activation carrier is Hadamard-rotated (rotation_applied=True) "
                f"but this module's weight is not"
            )
        if getattr(carrier, "token_scale", None) is not None:
            raise ValueError(f"{where}: an FP8 activation carrier takes no token_scale")
        codes, row_scale = carrier.codes, carrier.scales
        shape, dtype = tuple(carrier.shape), carrier.model_dtype
        k, n = self.in_features, self.out_features
        if not shape or shape[-1] != k:
            raise ValueError(f"{where}: the carrier's shape must be (*, {k}), got {shape}")
        rows = math.prod(shape[:-1])
        if not isinstance(codes, torch.Tensor) or tuple(codes.shape) != (rows, k):
            got = tuple(codes.shape) if isinstance(codes, torch.Tensor) else type(codes).__name__
            raise ValueError(
                f"{where}: the carrier's codes must have shape ({rows}, {k}) for shape {shape}, "
                f"got {got}"
            )
        if dtype not in W4A_OUTPUT_DTYPES:
            raise TypeError(
                f"{where}: the carrier's model_dtype must be float16, bfloat16 or float32, got "
                f"{dtype!r}"
            )
        self._check_device(codes.device)
        staged = self._staged()
        route, reason = w4a_fp8_route(self.route, codes.device)
        if route == "triton":
            from floatxq.kernels.w4a_fp8 import fp8_linear_prepacked

            weight = self._weight_for(rows, staged)
            out = fp8_linear_prepacked(codes, row_scale, weight, self.scales, self.bias, dtype)
        else:
            out = w4a_fp8_linear_prepacked(
                codes, row_scale, staged, self.scales, self.bias, output_dtype=dtype
            )
        self._set_last(route, reason)
        return out.reshape(*shape[:-1], n)
