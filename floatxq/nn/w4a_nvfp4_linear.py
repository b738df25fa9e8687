"""``W4ANVFP4Linear``: symmetric INT4 GPTQ weights (groups of 128) times NVFP4 activations.

A :class:`~floatxq.nn.w4a_base.W4ALinear` with one persistent buffer of its own,
``activation_global_scale_bits`` (int32 ``()``: the bits of the FP32 activation global scale,
so that ``.to(torch.bfloat16)`` cannot round it; 0.0, the default and the value of GPTQ
checkpoints without the key, means dynamic: :func:`floatxq.nvfp4_dynamic_global_scale` of each
call), and caches built by :meth:`~W4ANVFP4Linear.post_init`: ``_weight_e4m3`` (as
``W4AFP8Linear``) and ``_weight_both`` / ``_unit_weight_scales``
(:func:`floatxq.w4a.weight.w4a_nvfp4_weight_planes`, where the native route runs).

A call quantizes ``x`` to NVFP4 and multiplies on the route
:func:`floatxq.dispatch.w4a_nvfp4_route` gives: ``"native"`` (FP4 tensor cores, SM 12.1+:
:func:`floatxq.kernels.nvfp4.nvfp4_native_gemm`), ``"emulation"`` (the Triton
``nvfp4_linear_prepacked``) or ``"reference"`` (:func:`floatxq.w4a_nvfp4_linear_prepacked`).
"""

from typing import Any

import torch

from floatxq import dispatch
from floatxq._checks import real_scalar
from floatxq._typing import Float, Tensor
from floatxq.config import BACKEND
from floatxq.dispatch import (  # re-exported: their old home
    W4A_NVFP4_ROUTES,
    w4a_nvfp4_native_unavailable_reason,
    w4a_nvfp4_route,
)
from floatxq.formats import (
    ACTIVATION_SCALE_BITS,
    NVFP4_DEFAULT_RECIPE,
    normalize_nvfp4_recipe,
)
from floatxq.gptq.decode_words import stage_decode_words
from floatxq.gptq.int4 import GPTQPacked
from floatxq.gptq.planes import centered_int4, int4_to_e4m3
from floatxq.kernels._triton import call_key, on_rows
from floatxq.nn.gptq_linear import GPTQLinear
from floatxq.nn.w4a_base import W4ALinear, w4a_ineligibility
from floatxq.nn.w4a_fp8_linear import _fp8_gemm
from floatxq.w4a.activation import checked_global_scale_bits, global_scale_bits_problem
from floatxq.w4a.linear import w4a_nvfp4_linear_prepacked
from floatxq.w4a.weight import W4ANVFP4WeightPlanes, w4a_nvfp4_weight_planes

__all__ = [
    "W4A_NVFP4_ROUTES",
    "W4ANVFP4Linear",
    "W4ANVFP4WeightPlanes",
    "w4a_nvfp4_ineligibility",
    "w4a_nvfp4_native_unavailable_reason",
    "w4a_nvfp4_route",
    "w4a_nvfp4_weight_planes",
]

_NATIVE_MIN_CAPABILITY = (12, 1)
_E4M3 = "_weight_e4m3"
_BOTH = "_weight_both"
_UNIT = "_unit_weight_scales"
_DWORDS = "_weight_dwords"
_FP4X2 = torch.float4_e2m1fn_x2


def w4a_nvfp4_ineligibility(module: GPTQLinear) -> str | None:
    """Why ``module``'s weight cannot run as W4A-NVFP4, or ``None`` when it can.

    The W4A-FP8 constraints (:func:`floatxq.w4a.weight.w4a_weight_ineligibility`).

    Raises:
      TypeError: ``module`` is not a ``GPTQLinear``.

    Numerics: exact comparisons of the stored words.

    Example:
      >>> from floatxq.gptq.solve import GPTQSolveOptions, rtn_quantize
      >>> sol = rtn_quantize(torch.randn(32, 128), GPTQSolveOptions(bits=8, group_size=128))
      >>> w4a_nvfp4_ineligibility(GPTQLinear.from_solution(sol, bits=8, group_size=128))
      'bits=8; W4A-NVFP4 takes 4-bit codes'
    """
    return w4a_ineligibility(module, gemm="W4A-NVFP4", where="w4a_nvfp4_ineligibility")


class W4ANVFP4Linear(W4ALinear):
    """A GPTQ INT4 linear layer whose calls multiply NVFP4 activations by the integer weight.

    ``y = (Σ_g scales[g] · Σ_{k in g} nvfp4(x)[k] · (code[k] - 8)) · global_scale · token_scale
    + bias`` (:func:`floatxq.w4a_nvfp4_linear_prepacked`), ``nvfp4(x)`` the E2M1 code times its
    E4M3 block scale. Built as :class:`~floatxq.nn.w4a_fp8_linear.W4AFP8Linear` is.

    Args:
      in_features, out_features, bits, group_size, desc_act, sym, format, bias, scales_dtype,
        bias_dtype, device: as ``W4AFP8Linear``.
      route: ``"auto"``, ``"native"``, ``"emulation"`` or ``"reference"``.
      activation_recipe: the NVFP4 block-scale recipe of the activations (stored canonical).

    Raises:
      TypeError: non-integer sizes or settings, non-floating dtypes.
      ValueError: another setting, ``in % 128``, ``out % 32``, an unknown format, route or
        recipe.

    Numerics: activations as :func:`floatxq.pack_activation` packs them (global scale: the
    stored one, or each call's own while it is 0.0), then the reference order of
    :func:`floatxq.w4a_nvfp4_linear_prepacked`; native and emulation equal it up to FP32
    summation order. A ``"w4afp8"`` carrier runs the W4A-FP8 GEMM on the staged operand.

    Example:
      >>> from floatxq.gptq.solve import GPTQSolveOptions, rtn_quantize
      >>> sol = rtn_quantize(torch.randn(32, 128), GPTQSolveOptions(bits=4, group_size=128))
      >>> layer = W4ANVFP4Linear.from_gptq_linear(GPTQLinear.from_solution(sol, bits=4,
      ...     group_size=128))
      >>> layer(torch.randn(3, 128)).shape, layer.activation_global_scale.item()
      (torch.Size([3, 32]), 0.0)
    """

    backend = BACKEND.GPTQ_W4A_NVFP4
    MIN_COMPUTE_CAPABILITY = _NATIVE_MIN_CAPABILITY
    """FP4 tensor cores (SM 12.1 and newer) for the ``"native"`` route on CUDA."""
    _CACHES = (_E4M3, _BOTH, _UNIT, _DWORDS)
    _PERSISTENT = (ACTIVATION_SCALE_BITS,)
    _ROUTE_FIELD = "w4a_nvfp4"
    _GEMM = "W4A-NVFP4"

    activation_global_scale_bits: Tensor
    _weight_e4m3: Tensor | None
    _weight_both: Tensor | None
    _unit_weight_scales: Tensor | None

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        activation_recipe: str = NVFP4_DEFAULT_RECIPE,
        device: torch.device | str | None = None,
        **settings: Any,
    ) -> None:
        super().__init__(in_features, out_features, device=device, **settings)
        self.register_buffer(
            ACTIVATION_SCALE_BITS, torch.zeros((), dtype=torch.int32, device=device)
        )
        self.activation_recipe = activation_recipe

    def _adopt(self, packed: GPTQPacked, module: GPTQLinear | None) -> None:
        # GPTQLinear builds on meta, then adopts packed's tensors: the scale lives beside them
        device = packed.qweight.device
        self._buffers[ACTIVATION_SCALE_BITS] = torch.zeros((), dtype=torch.int32, device=device)
        if isinstance(module, W4ANVFP4Linear):  # keeps its global scale and recipe
            self._buffers[ACTIVATION_SCALE_BITS] = module.activation_global_scale_bits
            self.activation_recipe = module.activation_recipe

    def post_init(self, *, stage_planes: bool = False) -> "W4ANVFP4Linear":
        """Stage the weight caches from the buffers (after loading or :meth:`pack`); returns self.

        Args:
          stage_planes: also stage the native operands where the native route cannot run
            (they are staged anyway where it can): e.g. before moving to an SM 12.1 GPU.

        Raises:
          ValueError: :func:`floatxq.centered_int4`'s refusals; an
            ``activation_global_scale_bits`` that is not 0.0 or a positive finite FP32 value.

        Numerics: exact integers ``code - 8`` in E4M3, and as exact E2M1 planes.
        """
        why = global_scale_bits_problem(self.activation_global_scale_bits)
        if why is not None:
            raise ValueError(f"W4ANVFP4Linear.post_init: {ACTIVATION_SCALE_BITS}: {why}")
        centered = centered_int4(self.packed(), format=self.format)
        # K-contiguous (strides (1, in)): the kernels' E4M3 tiles read 128-long runs of K
        self._buffers[_E4M3] = int4_to_e4m3(centered.T.contiguous()).T
        held = dispatch.nvfp4_operand(1, decode_words=True) == "decode_words"  # (0: off)
        self._buffers[_DWORDS] = stage_decode_words(centered + 8) if held else None
        native = dispatch.w4a.w4a_nvfp4_native_unavailable_reason(self.qweight.device) is None
        planes = w4a_nvfp4_weight_planes(centered) if stage_planes or native else None
        self._buffers[_BOTH] = None if planes is None else planes.both
        self._buffers[_UNIT] = None if planes is None else planes.unit_scales
        return self

    def extra_repr(self) -> str:
        bits = self.activation_global_scale_bits
        scale = "meta" if bits.is_meta else (float(bits.view(torch.float32)) or "dynamic")
        return (
            f"{super().extra_repr()}, activation_recipe={self.activation_recipe}, "
            f"activation_global_scale={scale}"
        )

    @property
    def activation_global_scale(self) -> Float[Tensor, ""]:
        """The FP32 activation global scale (a 0-d view of ``activation_global_scale_bits``);
        0.0 means dynamic. Set it to a positive finite number or one-element floating tensor
        (rounded once to FP32); ``ValueError`` otherwise. Zero the bits to return to dynamic."""
        return self.activation_global_scale_bits.view(torch.float32)

    @activation_global_scale.setter
    def activation_global_scale(self, value: Any) -> None:
        where = "W4ANVFP4Linear.activation_global_scale"
        device = self.activation_global_scale_bits.device
        g = real_scalar(value, name="activation_global_scale", where=where, device=device)
        g = g.to(torch.float32)
        if not bool(torch.isfinite(g) & (g > 0)):
            raise ValueError(
                f"{where}: must be positive and finite (as FP32), got {float(g)!r} (zero the "
                f"{ACTIVATION_SCALE_BITS} buffer for a dynamic global scale)"
            )
        setattr(self, ACTIVATION_SCALE_BITS, g.reshape(()).clone().view(torch.int32))  # drops plans

    @property
    def activation_recipe(self) -> str:
        """The canonical NVFP4 block-scale recipe the activations are quantized with."""
        return self.__dict__["_activation_recipe"]

    @activation_recipe.setter
    def activation_recipe(self, value: str) -> None:
        try:
            canonical = normalize_nvfp4_recipe(value)
        except ValueError as exc:
            raise ValueError(f"W4ANVFP4Linear: activation_recipe: {exc}") from None
        self.__dict__["_activation_recipe"] = canonical

    def _incoming(
        self, state_dict: dict[str, Any], prefix: str, error_msgs: list[str]
    ) -> tuple[dict[str, Any], list[str]]:
        key = prefix + ACTIVATION_SCALE_BITS
        present = self.__dict__["_bits_present"] = key in state_dict
        bits = checked_global_scale_bits(state_dict[key], key=key) if present else None
        replaced, rejected = super()._incoming(state_dict, prefix, error_msgs)
        if bits is not None:  # checked before anything changes
            replaced[key] = bits
        return replaced, rejected

    def _loaded(self, prefix: str, missing_keys: list[str]) -> None:
        key = prefix + ACTIVATION_SCALE_BITS
        if not self.__dict__.pop("_bits_present", True):  # GPTQ checkpoint: dynamic
            if key in missing_keys:
                missing_keys.remove(key)
            device = self.activation_global_scale_bits.device
            self._buffers[ACTIVATION_SCALE_BITS] = torch.zeros((), dtype=torch.int32, device=device)
        super()._loaded(prefix, missing_keys)

    def _forward_tensor(self, x: Tensor) -> Tensor:
        held = self.__dict__.setdefault("_plans", {}).get(key := call_key(x))
        if held is not None and held[1] is self.route_preference:  # bound for inputs like x
            self._set_last(*held[2])
            return held[0](x)
        from floatxq.kernels import nvfp4
        from floatxq.w4a.activation import pack_activation

        x2, bits = self._rows_of(x), self.activation_global_scale_bits
        recipe = self.activation_recipe
        chosen = self._chosen_route(x.device)
        if chosen[0] != "reference" and x.is_cuda:  # the kernels, no host read (graph-safe)
            g = nvfp4.nvfp4_global_scale_from_bits(x2, bits, recipe=recipe)
            codes, scales = nvfp4.nvfp4_pack_and_swizzle(x2, g, recipe=recipe)
        else:  # checked packing (finite input, the scale's value; one host read of it)
            stored = None if int(bits) == 0 else bits.view(torch.float32)  # (None: dynamic)
            carrier = pack_activation(x2, "w4a_nvfp4", global_scale=stored, recipe=recipe)
            codes, scales, g = carrier.codes, carrier.scales, carrier.global_scale
        out = self._nvfp4_gemm(codes, scales, g, None, x.dtype, x.device, chosen)
        if chosen[0] == "emulation" and x2.shape[0] <= nvfp4.BOUND_MAX_ROWS:  # later calls: bound
            weight = self._emulation_weight(x2.shape[0])
            bound = nvfp4.bound_linear(x2, bits, recipe, weight, self.scales, self.bias)
            if (bound := on_rows(bound, x, self.out_features)) is not None:
                self._plans[key] = (bound, self.route_preference, chosen)
        return out.reshape(*x.shape[:-1], self.out_features)

    def _emulation_weight(self, rows: int) -> Tensor:
        """The emulation GEMM's weight operand for ``rows`` rows (few rows: half the bytes)."""
        form = dispatch.nvfp4_operand(rows, decode_words=True)
        if form == "e4m3":
            return self._staged()
        return self.qweight if form == "words" else self._buffers[_DWORDS]

    def _chosen_route(self, device: torch.device) -> tuple[str, str | None]:
        staged = self._buffers.get(_BOTH) is not None
        return dispatch.w4a_nvfp4_route(self.route, device, planes_staged=staged)

    def _nvfp4_gemm(
        self,
        codes: Tensor,
        scales: Tensor,
        global_scale: Tensor,
        token_scale: Tensor | None,
        output_dtype: torch.dtype,
        device: torch.device,
        chosen: tuple[str, str | None] | None = None,
    ) -> Tensor:
        """The chosen route's GEMM (``codes`` checked to be ``(rows, in/2)``)."""
        staged = self._staged()
        route, reason = chosen or self._chosen_route(device)
        rows, n = codes.shape[0], self.out_features
        if rows == 0:
            out = torch.empty((0, n), dtype=output_dtype, device=device)
        elif route == "native":
            from floatxq.kernels.nvfp4 import nvfp4_native_gemm

            out = nvfp4_native_gemm(
                codes, scales, global_scale, self._buffers[_BOTH], self._buffers[_UNIT],
                self.scales, self.bias, token_scale, output_dtype,
                accumulate=dispatch.nvfp4_accumulator(codes.device),
            )  # fmt: skip
        else:
            weight, gemm = staged, w4a_nvfp4_linear_prepacked
            if route == "emulation":
                from floatxq.kernels.nvfp4 import nvfp4_linear_prepacked as gemm

                weight = self._emulation_weight(rows)
            out = gemm(
                codes, scales, global_scale, weight, self.scales, self.bias,
                token_scale=token_scale, output_dtype=output_dtype,
            )  # fmt: skip
        self._set_last(route, reason)
        return out

    def _forward_carrier(self, carrier: Any) -> Tensor:
        mode = carrier.mode
        mode = mode.strip().lower() if isinstance(mode, str) else mode
        if mode not in ("w4a_nvfp4", "w4afp8"):
            raise ValueError(
                f"W4ANVFP4Linear: the activation carrier has mode {carrier.mode!r}; this module "
                f"takes 'w4a_nvfp4' or 'w4afp8'"
            )
        k = self.in_features
        width, kind = (k // 2, _FP4X2) if mode == "w4a_nvfp4" else (k, torch.float8_e4m3fn)
        codes, shape, dtype = self._carrier_codes(carrier, mode, width, kind)
        if mode == "w4a_nvfp4":
            out = self._nvfp4_gemm(
                codes, carrier.scales, carrier.global_scale, carrier.token_scale, dtype,
                codes.device,
            )  # fmt: skip
        else:  # the W4A-FP8 GEMM over the staged E4M3 operand (never the int32 words)
            self._staged()
            route, reason = dispatch.w4a_fp8_carrier_route(self.route, codes.device)
            kernel = "triton" if route == "fp8_triton" else "reference"
            out = _fp8_gemm(self, codes, carrier.scales, kernel, dtype, words=False)
            self._set_last(route, reason)
        return out.reshape(*shape[:-1], self.out_features)
