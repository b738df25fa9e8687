"""``W4AFP8Linear``: symmetric INT4 GPTQ weights (groups of 128) times FP8 per-token activations.

A :class:`~floatxq.nn.w4a_base.W4ALinear` whose :meth:`W4AFP8Linear.post_init` stages the
centered codes ``code - 8`` three ways: ``_weight_e4m3`` (exact E4M3 ``(in, out)``, K-contiguous
for the E4M3 tiles), ``_weight_dwords`` (int16 decode words: at most 32 rows) and
``_weight_frag`` (fragment words: the fewest rows, where :mod:`floatxq.kernels.w4a_frag` runs).
A call quantizes each row of ``x`` to E4M3 with one FP32 scale and runs the grouped GEMM of
:func:`floatxq.w4a_fp8_linear` on the route :func:`floatxq.dispatch.w4a_fp8_route` gives:
``"triton"`` (:mod:`floatxq.kernels.w4a_fp8`) or ``"reference"`` (the pure function). An
FP8-mode activation carrier skips the quantization.
"""

from typing import Any

import torch

from floatxq import dispatch
from floatxq._typing import Tensor
from floatxq.config import BACKEND
from floatxq.dispatch import W4A_FP8_ROUTES, w4a_fp8_route  # re-exported: their old home
from floatxq.gptq.decode_words import stage_decode_words
from floatxq.gptq.fragment_words import stage_fragment_words
from floatxq.gptq.planes import centered_int4, int4_to_e4m3
from floatxq.kernels._triton import call_key, on_rows
from floatxq.nn.gptq_linear import GPTQLinear
from floatxq.nn.w4a_base import W4ALinear, w4a_ineligibility
from floatxq.w4a.linear import w4a_fp8_linear, w4a_fp8_linear_prepacked

__all__ = ["W4A_FP8_ROUTES", "W4AFP8Linear", "w4a_fp8_ineligibility", "w4a_fp8_route"]

_CACHE = "_weight_e4m3"
_DWORDS = "_weight_dwords"
_FRAG = "_weight_frag"
_FP8_MODES = ("w4afp8",)


def w4a_fp8_ineligibility(module: GPTQLinear) -> str | None:
    """Why ``module``'s weight cannot run as W4A-FP8, or ``None`` when it can.

    :func:`floatxq.w4a.weight.w4a_weight_ineligibility` of ``module``'s weight (4-bit codes,
    groups of 128, ``in % 128``, ``out % 32``, no ``desc_act``, every zero point 8).

    Raises:
      TypeError: ``module`` is not a ``GPTQLinear``.

    Numerics: exact comparisons of the stored words.

    Example:
      >>> from floatxq.gptq.solve import GPTQSolveOptions, rtn_quantize
      >>> sol = rtn_quantize(torch.randn(32, 128), GPTQSolveOptions(bits=8, group_size=128))
      >>> w4a_fp8_ineligibility(GPTQLinear.from_solution(sol, bits=8, group_size=128))
      'bits=8; W4A-FP8 takes 4-bit codes'
    """
    return w4a_ineligibility(module, gemm="W4A-FP8", where="w4a_fp8_ineligibility")


def _fp8_gemm(
    module: W4ALinear,
    codes: Tensor,
    row_scale: Tensor,
    route: str,
    dtype: torch.dtype,
    *,
    words: bool = True,
) -> Tensor:
    """The W4A-FP8 GEMM of token codes: the kernels (``route == "triton"``) on the weight form
    :func:`floatxq.dispatch.w4a_fp8_weight` picks (packed only if ``words``), else the pure one."""
    staged, held = module._staged(), module._buffers
    if route == "triton":
        from floatxq.kernels.w4a_fp8 import fp8_linear_prepacked

        packed = (held.get(_FRAG), held.get(_DWORDS), module.qweight) if words else ()
        weight, gemm = dispatch.w4a_fp8_weight(codes.shape[0], staged, *packed)
        return fp8_linear_prepacked(
            codes, row_scale, weight, module.scales, module.bias, dtype, route=gemm
        )
    return w4a_fp8_linear_prepacked(
        codes, row_scale, staged, module.scales, module.bias, output_dtype=dtype
    )


class W4AFP8Linear(W4ALinear):
    """A GPTQ INT4 linear layer whose calls multiply FP8 E4M3 tokens by the integer weight.

    ``y = (Σ_g scales[g] · Σ_{k in g} e4m3(x)[k] · (code[k] - 8)) · row_scale + bias``
    (:func:`floatxq.w4a_fp8_linear`). The constructor allocates zero-filled GPTQ buffers for
    ``load_state_dict`` (then :meth:`post_init`); :meth:`from_packed` and
    :meth:`from_gptq_linear` build a ready module.

    Args:
      in_features, out_features: the weight's ``(out, in)`` shape; ``in`` a multiple of 128,
        ``out`` a multiple of 32.
      bits, group_size, desc_act, sym: accepted only as 4, 128, False, True.
      format: ``"gptq"`` (v1 zero words) or ``"gptq_v2"``, as ``qzeros`` is held; both run.
      bias, scales_dtype, bias_dtype, device: as :class:`~floatxq.nn.gptq_linear.GPTQLinear`.
      route: ``"auto"``, ``"triton"`` (refused where the kernels cannot run) or ``"reference"``.

    Raises:
      TypeError: non-integer sizes or settings, non-floating dtypes.
      ValueError: another setting, ``in % 128``, ``out % 32``, an unknown format or route.

    Numerics: E4M3 token codes by :func:`floatxq.fp8_token_quantize`, then the reference order of
    :func:`floatxq.w4a_fp8_linear`; the kernels equal it up to FP32 summation order.

    Example:
      >>> from floatxq.gptq.solve import GPTQSolveOptions, rtn_quantize
      >>> sol = rtn_quantize(torch.randn(32, 128), GPTQSolveOptions(bits=4, group_size=128))
      >>> layer = W4AFP8Linear.from_gptq_linear(GPTQLinear.from_solution(sol, bits=4,
      ...     group_size=128))
      >>> layer(torch.randn(3, 128)).shape, layer._weight_e4m3.shape, layer.last_route
      (torch.Size([3, 32]), torch.Size([128, 32]), 'reference')
    """

    backend = BACKEND.GPTQ_W4AFP8
    MIN_COMPUTE_CAPABILITY = (8, 9)
    """FP8 tensor cores (Ada SM 8.9 and newer) for the ``"triton"`` route on CUDA."""
    _CACHES = (_CACHE, _DWORDS, _FRAG)
    _ROUTE_FIELD = "w4a_fp8"
    _GEMM = "W4A-FP8"

    _weight_e4m3: Tensor | None
    _weight_dwords: Tensor | None
    _weight_frag: Tensor | None

    def post_init(self) -> "W4AFP8Linear":
        """Stage the three caches from the buffers (after loading or :meth:`pack`); returns self.

        Raises:
          ValueError: :func:`floatxq.centered_int4`'s refusals (``g_idx`` not
            ``arange(in) // 128``, a zero point other than 8: its group and column named).

        Numerics: exact integers ``code - 8`` in E4M3.
        """
        centered = centered_int4(self.packed(), format=self.format)
        # K-contiguous (strides (1, in)): the E4M3 GEMM tiles read 128-long runs of K
        self._buffers[_CACHE] = int4_to_e4m3(centered.T.contiguous()).T
        self._buffers[_DWORDS] = stage_decode_words(centered + 8)
        self._buffers[_FRAG] = stage_fragment_words(self._buffers[_DWORDS])
        self.__dict__["_plans"] = {}
        return self

    def _forward_tensor(self, x: Tensor) -> Tensor:
        held = self.__dict__.setdefault("_plans", {}).get(key := call_key(x))
        if held is not None and held[1] is self.route_preference:  # bound for inputs like x
            self._set_last("triton")
            return held[0](x)
        x2d, n = self._rows_of(x), self.out_features
        route, reason, weight, gemm = self._plan(x2d)
        if route == "triton":  # (the arguments were checked when the module was built)
            from floatxq.kernels.w4a_fp8 import _linear, bound_linear

            out = _linear(x2d, weight, self.scales, self.bias, gemm)
            bound = on_rows(bound_linear(x2d, weight, self.scales, self.bias, gemm), x, n)
            if bound is not None:
                self._plans[key] = (bound, self.route_preference)
        else:
            out = w4a_fp8_linear(x2d, weight, self.scales, self.bias)
        self._set_last(route, reason)
        return out.reshape(*x.shape[:-1], n)

    def _plan(self, x: Tensor) -> tuple[str, str | None, Tensor, str | None]:
        """``(route, reason, weight operand, GEMM route)`` of a call on ``x`` ``(rows, in)``:
        decided once per device, row class (:func:`floatxq.dispatch.rows_bucket`) and route
        preference, until the caches are rebuilt or the buffers move or load."""
        key = (x.device, dispatch.rows_bucket(x.shape[0]), self.route_preference)
        plan = self.__dict__.setdefault("_plans", {}).get(key)
        if plan is None:
            staged = self._staged()
            route, reason = dispatch.w4a_fp8_route(self.route, x.device)
            weight, gemm = staged, None
            if route == "triton":
                held = self._buffers
                weight, gemm = dispatch.w4a_fp8_weight(x.shape[0], staged, held.get(_FRAG),
                                                       held.get(_DWORDS), self.qweight)  # fmt: skip
            plan = self.__dict__["_plans"][key] = (route, reason, weight, gemm)
        return plan

    def _forward_carrier(self, carrier: Any) -> Tensor:
        where = "W4AFP8Linear"
        mode = carrier.mode
        if not isinstance(mode, str) or mode.strip().lower() not in _FP8_MODES:
            raise ValueError(
                f"{where}: the activation carrier has mode {mode!r}; this module takes FP8 "
                f"tokens (mode 'w4afp8'), not NVFP4 ones"
            )
        if getattr(carrier, "token_scale", None) is not None:
            raise ValueError(f"{where}: an FP8 activation carrier takes no token_scale")
        k = self.in_features
        codes, shape, dtype = self._carrier_codes(carrier, "w4afp8", k, torch.float8_e4m3fn)
        self._staged()
        route, reason = dispatch.w4a_fp8_route(self.route, codes.device)
        out = _fp8_gemm(self, codes, carrier.scales, route, dtype)
        self._set_last(route, reason)
        return out.reshape(*shape[:-1], self.out_features)
