"""``W4ANVFP4Linear``: symmetric INT4 GPTQ weights (groups of 128) times NVFP4 activations.

The module is a :class:`~floatxq.nn.gptq_linear.GPTQLinear` restricted to what the W4A-NVFP4
GEMM takes (the W4A-FP8 constraints: 4-bit codes, groups of 128, ``desc_act=False``, zero point
8 everywhere, ``in % 128 == 0``, ``out % 32 == 0``). It holds GPTQ's persistent buffers under
GPTQ's keys, moved as bytes, plus one persistent buffer of its own:

* ``activation_global_scale_bits``: int32 ``()``, the bit pattern of the FP32 global scale the
  activations are quantized with (bits, so that ``.to(torch.bfloat16)`` cannot round it). The
  value 0.0, the default of a fresh module and of checkpoints without the key, means "not
  calibrated": each call then derives the global scale from its own activation's amax, as
  :func:`floatxq.pack_activation` does with ``global_scale=None``. (A convention of floatxq's:
  GPT-QModel has no such key.)

and non-persistent caches built by :meth:`~W4ANVFP4Linear.post_init`, moved as bytes by
``.to()``, emptied by ``load_state_dict`` and :meth:`~W4ANVFP4Linear.pack`:

* ``_weight_e4m3``: ``float8_e4m3fn (in, out)``, the centered codes ``code - 8`` as exact E4M3
  values, K-contiguous (as :class:`~floatxq.nn.w4a_fp8_linear.W4AFP8Linear` stages them): the
  weight operand of the emulation and reference routes and of FP8 activation carriers.
* ``_weight_both`` and ``_unit_weight_scales`` (:func:`w4a_nvfp4_weight_planes`): the weight as
  two exact E2M1 planes side by side for the FP4 tensor cores, staged only where the native
  route can run (or on request: ``post_init(stage_planes=True)``).

A call quantizes ``x`` to NVFP4 (:func:`floatxq.pack_activation`, mode ``"w4a_nvfp4"``) and
multiplies it by the weight through one of three routes (:func:`w4a_nvfp4_route`):

* ``"native"``: FP4 tensor cores (CUDA SM 12.1+): per 128-row group one ``F.scaled_mm`` of the
  activation codes by both planes, recombined with the group scale in FP32.
* ``"emulation"``: the Triton kernel ``floatxq.kernels.nvfp4.nvfp4_linear_prepacked``, which
  decodes both operands exactly and multiplies them on FP16 tensor cores (Hopper, Ada, or the
  Triton interpreter).
* ``"reference"``: the pure :func:`floatxq.w4a_nvfp4_linear_prepacked`, on any device.

``last_route`` and ``last_reason`` (``None`` when the native route ran) record each call, as
:class:`~floatxq.nn.gptq_linear.GPTQLinear` records its routes.
"""

import math
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F

from floatxq._checks import real_scalar
from floatxq._typing import (
    Float,
    Float8e4m3fn,
    Integer,
    Shaped,
    Tensor,
    checked_record,
)
from floatxq.config import BACKEND
from floatxq.formats import GPTQ_W4A_GROUP_SIZE, normalize_nvfp4_recipe
from floatxq.gptq.int4 import (
    GPTQPacked,
    centered_int4,
    int4_planes_to_e2m1,
    int4_to_e4m3,
    split_int4_planes,
)
from floatxq.kernels._triton import capability_shortfall
from floatxq.nn.fp8_linear import _move_bytes
from floatxq.nn.gptq_linear import GPTQLinear
from floatxq.nn.w4a_fp8_linear import (
    _check_w4a_settings,
    _ineligibility,
    _is_carrier,
    _repack,
)
from floatxq.nvfp4.quantize import _device_global_scale
from floatxq.nvfp4.swizzle import swizzle_scales
from floatxq.w4a.linear import (
    W4A_OUTPUT_DTYPES,
    w4a_fp8_linear_prepacked,
    w4a_nvfp4_accumulate_group,
    w4a_nvfp4_linear_prepacked,
)

__all__ = [
    "W4A_NVFP4_ROUTES",
    "W4ANVFP4Linear",
    "W4ANVFP4WeightPlanes",
    "w4a_nvfp4_ineligibility",
    "w4a_nvfp4_native_unavailable_reason",
    "w4a_nvfp4_route",
    "w4a_nvfp4_weight_planes",
]

W4A_NVFP4_ROUTES: tuple[str, ...] = ("auto", "native", "emulation", "reference")
"""Values of :attr:`W4ANVFP4Linear.route`: ``"auto"`` takes the fastest that runs."""

_GROUP = GPTQ_W4A_GROUP_SIZE
_HALF = _GROUP // 2  # bytes of one 128-wide K group of packed E2M1 codes
_BLOCKS = 8  # E4M3 block scales per 128-wide K group (one per 16 values)
_NATIVE_MIN_CAPABILITY = (12, 1)
_BITS = "activation_global_scale_bits"
_E4M3 = "_weight_e4m3"
_BOTH = "_weight_both"
_UNIT = "_unit_weight_scales"
_CACHES = (_E4M3, _BOTH, _UNIT)
_FP4X2 = torch.float4_e2m1fn_x2
_FP32_INF_BITS = 0x7F800000  # positive finite FP32 values are the int32 bit patterns 1..this-1
_DEFAULT_RECIPE = "least_squares"


# ----------------------------------------------------------------------------------------------
# Route policy
# ----------------------------------------------------------------------------------------------


def w4a_nvfp4_native_unavailable_reason(device: torch.device) -> str | None:
    """Why the native FP4 tensor-core route cannot run on ``device``'s tensors, or ``None``.

    It needs a torch with ``torch.float4_e2m1fn_x2``, ``F.scaled_mm``,
    ``F.ScalingType.BlockWise1x16`` and ``F.SwizzleType.SWIZZLE_32_4_4``, and a CUDA device of
    compute capability 12.1 or newer.

    Args:
      device: where the call's tensors are.

    Returns:
      ``None``, or one sentence naming what is missing.

    Numerics: none; an environment check.

    Example:
      >>> w4a_nvfp4_native_unavailable_reason(torch.device("cpu")) is not None
      True
    """
    scaling = getattr(F, "ScalingType", None)
    swizzle = getattr(F, "SwizzleType", None)
    needs = (
        ("torch.float4_e2m1fn_x2", hasattr(torch, "float4_e2m1fn_x2")),
        ("F.scaled_mm", hasattr(F, "scaled_mm")),
        ("F.ScalingType.BlockWise1x16", hasattr(scaling, "BlockWise1x16")),
        ("F.SwizzleType.SWIZZLE_32_4_4", hasattr(swizzle, "SWIZZLE_32_4_4")),
    )
    missing = [name for name, present in needs if not present]
    if missing:
        return f"torch {torch.__version__} has no {', '.join(missing)}"
    if device.type != "cuda":
        return f"the tensors are on {device}; the FP4 tensor cores need a CUDA device"
    return capability_shortfall(
        device, _NATIVE_MIN_CAPABILITY, need="no FP4 tensor cores for F.scaled_mm's NVFP4 GEMM"
    )


def _emulation_unavailable(device: torch.device) -> str | None:
    """The emulation kernels' own reason they cannot run on ``device``, or why they do not
    import."""
    try:
        from floatxq.kernels.nvfp4 import nvfp4_unavailable_reason
    except ImportError as exc:
        return f"floatxq.kernels.nvfp4 does not import ({exc})"
    return nvfp4_unavailable_reason(device)


def w4a_nvfp4_route(
    requested: str, device: torch.device, *, planes_staged: bool = True
) -> tuple[str, str | None]:
    """The route a call on ``device`` takes, and why the native route was not taken.

    Args:
      requested: ``"auto"``, ``"native"``, ``"emulation"`` or ``"reference"``.
      device: where the call's tensors are.
      planes_staged: whether the native weight operand (``_weight_both``) is staged; ``"auto"``
        passes over the native route without it.

    Returns:
      ``(route, reason)``: ``("native", None)`` where the FP4 tensor cores run; else
      ``("emulation", why)`` where the Triton emulation runs; else ``("reference", why)``.
      ``"auto"`` takes the first that runs; a forced route is taken or refused.

    Raises:
      ValueError: an unknown ``requested``.
      RuntimeError: ``"native"`` or ``"emulation"`` requested where it cannot run (the reason
        named), or ``"native"`` without the staged planes (call ``post_init()`` on the device).

    Numerics: none (every route computes :func:`floatxq.w4a_nvfp4_linear_prepacked`, up to
    FP32 summation order).

    Example:
      >>> w4a_nvfp4_route("reference", torch.device("cpu"))
      ('reference', "route='reference' was requested")
    """
    where = "W4ANVFP4Linear"
    if requested not in W4A_NVFP4_ROUTES:
        raise ValueError(f"{where}: route must be one of {W4A_NVFP4_ROUTES}, got {requested!r}")
    if requested == "reference":
        return "reference", "route='reference' was requested"
    if requested == "emulation":
        why = _emulation_unavailable(device)
        if why is not None:
            raise RuntimeError(f"{where}: route='emulation' cannot run on {device}: {why}")
        return "emulation", "route='emulation' was requested"
    native = w4a_nvfp4_native_unavailable_reason(device)
    if requested == "native":
        if native is not None:
            raise RuntimeError(f"{where}: route='native' cannot run on {device}: {native}")
        if not planes_staged:
            raise RuntimeError(
                f"{where}: the native weight cache is absent; call post_init() (after moving "
                f"the module to {device})"
            )
        return "native", None
    if native is None and not planes_staged:
        native = "the FP4 weight planes are not staged (call post_init() on this device)"
    if native is None:
        return "native", None
    emulation = _emulation_unavailable(device)
    if emulation is None:
        return "emulation", f"native: {native}"
    return "reference", f"native: {native}; emulation: {emulation}"


def w4a_nvfp4_ineligibility(module: GPTQLinear) -> str | None:
    """Why ``module``'s weight cannot run as W4A-NVFP4, or ``None`` when it can.

    The W4A-FP8 constraints, checked in the same order (:func:`floatxq.nn.w4a_fp8_linear.
    w4a_fp8_ineligibility`): 4-bit codes, groups of 128, ``in % 128``, ``out % 32``, no
    ``desc_act`` reordering, every zero point 8.

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
      >>> w4a_nvfp4_ineligibility(GPTQLinear.from_solution(sol, bits=8, group_size=128))
      'bits=8; W4A-NVFP4 takes 4-bit codes'
    """
    return _ineligibility(module, gemm="W4A-NVFP4", where="w4a_nvfp4_ineligibility")


# ----------------------------------------------------------------------------------------------
# The native weight operand and GEMM
# ----------------------------------------------------------------------------------------------


@checked_record
class W4ANVFP4WeightPlanes(NamedTuple):
    """The INT4 weight as the FP4 tensor cores read it: two E2M1 planes side by side."""

    both: Shaped[Tensor, "half_k two_n"]
    """``float4_e2m1fn_x2 (k/2, 2n)`` (byte view ``(k/2, 2n)``): columns ``0..n-1`` the low
    plane, ``n..2n-1`` the high plane, two codes per byte along K (even K in the low nibble),
    stored column-major (strides ``(1, k/2)``: each output column's K run contiguous)."""
    unit_scales: Float8e4m3fn[Tensor, " padded"]
    """``float8_e4m3fn``: the E4M3 block scales 1.0 of a ``(2n, 8)`` 128-row group, laid out
    ``SWIZZLE_32_4_4`` (rows padded to 128 with 0) and flattened; every group shares them."""


def w4a_nvfp4_weight_planes(c: Integer[Tensor, "k n"]) -> W4ANVFP4WeightPlanes:
    """Stage centered INT4 values ``c = code - 8`` as the native W4A-NVFP4 weight operand.

    ``c = low + 4·high`` (:func:`floatxq.split_int4_planes`), both planes exact E2M1 values
    (:func:`floatxq.int4_planes_to_e2m1`), so one FP4 GEMM of the activation by ``[low |
    high]`` with unit block scales gives both partial sums exactly as products.

    Args:
      c: ``(k, n)`` integers in ``-8..7``, ``k`` a positive multiple of 128 (input rows of the
        GPTQ weight), ``n`` output columns.

    Returns:
      :class:`W4ANVFP4WeightPlanes` on ``c``'s device.

    Raises:
      ValueError: ``k`` not a positive multiple of 128, a value outside ``-8..7``.
      TypeError: a non-integer ``c``.

    Numerics: exact (a permutation of exact codes; the unit scale 1.0 is E4M3 ``0x38``).

    Example:
      >>> p = w4a_nvfp4_weight_planes(torch.full((128, 32), 7, dtype=torch.int16))
      >>> p.both.shape, p.both.stride(), p.unit_scales.shape
      (torch.Size([64, 64]), (1, 64), torch.Size([1024]))
    """
    where = "w4a_nvfp4_weight_planes"
    if c.ndim != 2 or c.shape[0] == 0 or c.shape[0] % _GROUP:
        raise ValueError(
            f"{where}: c must be (k, n) with k a positive multiple of {_GROUP}, got "
            f"{tuple(c.shape)}"
        )
    planes = split_int4_planes(c)
    packed = int4_planes_to_e2m1(planes.low, planes.high)
    both = torch.cat([packed.low, packed.high], dim=1)  # (k/2, 2n) uint8
    both = both.T.contiguous().T.view(_FP4X2)  # column-major: strides (1, k/2)
    ones = torch.ones((2 * c.shape[1], _BLOCKS), dtype=torch.float8_e4m3fn, device=c.device)
    return W4ANVFP4WeightPlanes(both, swizzle_scales(ones))


def _accumulator(device: torch.device) -> Callable[..., Tensor]:
    """The group-accumulation step: the Triton kernel where floatxq ships it and it runs on
    ``device``, else the pure :func:`floatxq.w4a_nvfp4_accumulate_group` (the same FP32
    operations in the same order)."""
    from floatxq.kernels._triton import triton_unavailable_reason

    try:
        from floatxq.kernels.nvfp4_decoding import nvfp4_accumulate_group
    except ImportError:  # pragma: no cover - the kernels ship with floatxq
        return w4a_nvfp4_accumulate_group
    if triton_unavailable_reason(device) is not None:
        return w4a_nvfp4_accumulate_group
    return nvfp4_accumulate_group


def _native_gemm(
    codes: Tensor,
    scales: Tensor,
    global_scale: Tensor,
    both: Tensor,
    unit_scales: Tensor,
    group_scales: Tensor,
    bias: Tensor | None,
    token_scale: Tensor | None,
    output_dtype: torch.dtype,
) -> Tensor:
    """The W4A-NVFP4 GEMM on FP4 tensor cores, operands already checked (at least one row).

    Per 128-wide K group ``g``: ``F.scaled_mm`` of the codes ``[:, 64g : 64g+64]`` (block
    scales ``scales[g]``) by the planes ``both[64g : 64g+64]`` (unit scales), both scale grids
    ``SWIZZLE_32_4_4``, FP32 out: ``[Σ a·low | Σ a·high]`` with exact products; then the group
    step adds ``(low + 4·high) · group_scale`` to the FP32 sum, and the last group applies the
    global scale, the token scale and the bias and rounds once."""
    kind, swizzle = F.ScalingType.BlockWise1x16, F.SwizzleType.SWIZZLE_32_4_4
    accumulate = _accumulator(codes.device)

    def planes(g: int) -> Tensor:
        half = slice(_HALF * g, _HALF * (g + 1))
        return F.scaled_mm(
            codes[:, half], both[half], scales[g], kind, unit_scales, kind,
            swizzle_a=swizzle, swizzle_b=swizzle, output_dtype=torch.float32,
        )  # fmt: skip

    last = scales.shape[0] - 1
    acc: Tensor | None = None
    for g in range(last):  # ascending groups, FP32 running sum
        acc = accumulate(planes(g), group_scales[g], acc)
    return accumulate(
        planes(last), group_scales[last], acc, last=True, global_scale=global_scale,
        token_scale=token_scale, bias=bias, output_dtype=output_dtype,
    )  # fmt: skip


# ----------------------------------------------------------------------------------------------
# The activation global scale, stored as FP32 bits
# ----------------------------------------------------------------------------------------------


def _bits_problem(bits: Tensor) -> str | None:
    """Why a 0-d int32 bit pattern is not 0.0 or a positive finite FP32 value (or None)."""
    if bits.is_meta:
        return None
    value = int(bits)
    if 0 <= value < _FP32_INF_BITS:
        return None
    as_float = float(bits.view(torch.float32))
    return (
        f"the activation global scale must be 0.0 (dynamic) or positive and finite, got "
        f"{as_float!r} (bits 0x{value & 0xFFFFFFFF:08x})"
    )


def _checked_bits(value: Any, *, key: str) -> Tensor:
    """An incoming ``activation_global_scale_bits`` as a 0-d int32 tensor (ValueError naming
    ``key`` otherwise)."""
    if not isinstance(value, torch.Tensor):
        raise ValueError(f"{key}: expected a tensor, got {type(value).__name__}")
    if value.dtype != torch.int32:
        raise ValueError(
            f"{key}: the FP32 global scale is stored as its int32 bit pattern, got {value.dtype}"
        )
    if value.numel() != 1 or value.ndim > 1:
        raise ValueError(f"{key}: expected one value (shape ()), got shape {tuple(value.shape)}")
    value = value.reshape(())
    why = _bits_problem(value)
    if why is not None:
        raise ValueError(f"{key}: {why}")
    return value


class W4ANVFP4Linear(GPTQLinear):
    """A GPTQ INT4 linear layer whose calls multiply NVFP4 activations by the integer weight.

    ``y = (Σ_g scales[g] · Σ_{k in g} nvfp4(x)[k] · (code[k] - 8)) · global_scale · token_scale
    + bias`` (:func:`floatxq.w4a_nvfp4_linear_prepacked`), ``nvfp4(x)`` being the E2M1 code
    times its E4M3 block scale. The constructor allocates zero-filled GPTQ buffers for
    ``load_state_dict`` to fill (then :meth:`post_init`); :meth:`from_packed` and
    :meth:`from_gptq_linear` build a ready module.

    Args:
      in_features, out_features: the weight's ``(out, in)`` shape; ``in`` a multiple of 128,
        ``out`` a multiple of 32.
      bits, group_size, desc_act, sym: GPT-QModel's quantization settings, accepted only as
        4, 128, False, True.
      format: ``"gptq"`` (v1 zero words) or ``"gptq_v2"``, as ``qzeros`` is held; both run.
      bias, scales_dtype, bias_dtype, device: as :class:`~floatxq.nn.gptq_linear.GPTQLinear`.
      route: ``"auto"``, ``"native"``, ``"emulation"`` or ``"reference"``
        (:func:`w4a_nvfp4_route`).
      activation_recipe: the NVFP4 block-scale recipe of the activations (aliases accepted,
        stored canonical).

    Raises:
      TypeError: non-integer sizes or settings, non-floating dtypes.
      ValueError: a setting other than 4 / 128 / False / True, ``in % 128``, ``out % 32``, an
        unknown format, route or recipe.

    Numerics: activations by :func:`floatxq.pack_activation` (global scale: the stored one, or
    each call's own amax while it is 0.0); each group's 128 products (exact) summed in FP32,
    groups added in ascending order after their scale, then the global scale, the token scale
    and the bias, one rounding to the output dtype. The native and emulation routes equal the
    reference up to FP32 summation order.

    Example:
      >>> from floatxq.gptq.solve import GPTQSolveOptions, rtn_quantize
      >>> sol = rtn_quantize(torch.randn(32, 128), GPTQSolveOptions(bits=4, group_size=128))
      >>> layer = W4ANVFP4Linear.from_gptq_linear(GPTQLinear.from_solution(sol, bits=4,
      ...     group_size=128))
      >>> layer(torch.randn(3, 128)).shape, layer.activation_global_scale.item()
      (torch.Size([3, 32]), 0.0)
    """

    bits = 4
    group_size = _GROUP
    desc_act = False
    sym = True
    REQUIRES_FORMAT_V2 = True
    """GPT-QModel's flag (its loader converts v1 zero words to v2); here both formats run, the
    zero words are only checked."""
    backend = BACKEND.GPTQ_W4A_NVFP4
    MIN_COMPUTE_CAPABILITY = _NATIVE_MIN_CAPABILITY
    """FP4 tensor cores (SM 12.1 and newer) for the ``"native"`` route on CUDA."""

    activation_global_scale_bits: Tensor
    _weight_e4m3: Tensor | None
    _weight_both: Tensor | None
    _unit_weight_scales: Tensor | None

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
        activation_recipe: str = _DEFAULT_RECIPE,
    ) -> None:
        _check_w4a_settings(
            in_features, out_features, bits, group_size, desc_act, sym,
            where="W4ANVFP4Linear", gemm="W4A-NVFP4",
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
        self.register_buffer(_BITS, torch.zeros((), dtype=torch.int32, device=device))
        for name in _CACHES:
            self.register_buffer(name, None, persistent=False)
        self.route = route
        self.activation_recipe = activation_recipe

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
    ) -> "W4ANVFP4Linear":
        """A ready module holding ``packed``'s tensors as they are (no copy), staged.

        The activation global scale is 0.0 (dynamic); set :attr:`activation_global_scale` to
        calibrate it.

        Args:
          packed: a 4-bit :class:`floatxq.GPTQPacked` with ``in / 128`` groups.
          format: ``"gptq"`` or ``"gptq_v2"``, the convention of ``packed.qzeros``.
          bias: ``(out,)`` floating or ``None``, kept in its dtype.
          bits, group_size: accepted only as 4 and 128 (GPTQLinear's signature).

        Returns:
          A :class:`W4ANVFP4Linear` after :meth:`post_init`.

        Raises:
          TypeError, ValueError: what :meth:`GPTQLinear.from_packed` refuses, the class
            constraints, and :func:`floatxq.centered_int4`'s refusals (``g_idx`` not
            ``arange(in) // 128``, a zero point other than 8, naming its group and column).

        Numerics: exact; the staged operands equal ``code - 8``.
        """
        layer = super().from_packed(
            packed, bits=bits, group_size=group_size, format=format, bias=bias
        )
        # GPTQLinear builds on meta, then adopts packed's tensors: the scale lives beside them
        layer._buffers[_BITS] = torch.zeros((), dtype=torch.int32, device=packed.qweight.device)
        return layer.post_init()

    @classmethod
    def from_gptq_linear(cls, module: GPTQLinear) -> "W4ANVFP4Linear":
        """The W4A-NVFP4 module of an eligible :class:`GPTQLinear` (sharing its tensors).

        A :class:`W4ANVFP4Linear` given as ``module`` keeps its activation global scale and
        recipe; any other starts dynamic (0.0) with the default recipe.

        Raises:
          TypeError: ``module`` is not a ``GPTQLinear``.
          ValueError: what :func:`w4a_nvfp4_ineligibility` names (bits, group size, sizes,
            ``desc_act`` / reordered ``g_idx``, asymmetric zero points).

        Numerics: exact.
        """
        where = "W4ANVFP4Linear.from_gptq_linear"
        if not isinstance(module, GPTQLinear):
            raise TypeError(f"{where}: module must be a GPTQLinear, got {type(module).__name__}")
        why = w4a_nvfp4_ineligibility(module)
        if why is not None:
            raise ValueError(f"{where}: this GPTQLinear cannot run as W4A-NVFP4: {why}")
        layer = cls.from_packed(module.packed(), format=module.format, bias=module.bias)
        if isinstance(module, W4ANVFP4Linear):
            layer._buffers[_BITS] = module.activation_global_scale_bits
            layer.activation_recipe = module.activation_recipe
        return layer.train(module.training)

    def post_init(self, *, stage_planes: bool = False) -> "W4ANVFP4Linear":
        """Stage the weight caches from the buffers (after loading or :meth:`pack`); returns self.

        Args:
          stage_planes: also stage the native operands (``_weight_both``,
            ``_unit_weight_scales``) where the native route cannot run (they are staged anyway
            where it can): a module built on the CPU and moved to an SM 12.1 GPU afterwards.

        Raises:
          ValueError: :func:`floatxq.centered_int4`'s refusals (``g_idx`` not
            ``arange(in) // 128``, a zero point other than 8: its group and column named); an
            ``activation_global_scale_bits`` that is not 0.0 or a positive finite FP32 value.

        Numerics: exact integers ``code - 8`` in E4M3, and as exact E2M1 planes.
        """
        why = _bits_problem(self.activation_global_scale_bits)
        if why is not None:
            raise ValueError(f"W4ANVFP4Linear.post_init: {_BITS}: {why}")
        centered = centered_int4(self.packed(), format=self.format)
        # K-contiguous (strides (1, in)): the kernels' E4M3 tiles read 128-long runs of K
        self._buffers[_E4M3] = int4_to_e4m3(centered.T.contiguous()).T
        native = w4a_nvfp4_native_unavailable_reason(self.qweight.device) is None
        planes = w4a_nvfp4_weight_planes(centered) if stage_planes or native else None
        self._buffers[_BOTH] = None if planes is None else planes.both
        self._buffers[_UNIT] = None if planes is None else planes.unit_scales
        return self

    def pack(self, packed: GPTQPacked, *, format: str | None = None) -> None:
        """Replace the weight with ``packed``'s tensors (the same geometry); empties the caches.

        The activation global scale is kept. Call :meth:`post_init` before the next forward.

        Args:
          packed: a 4-bit :class:`floatxq.GPTQPacked` of this module's shapes.
          format: its ``qzeros`` convention (default: the module's).

        Raises:
          TypeError, ValueError: an invalid ``packed`` or one of other shapes than the module's.

        Numerics: exact; the tensors are held as given (no copy).
        """
        _repack(self, packed, format, _CACHES, where="W4ANVFP4Linear.pack")

    def extra_repr(self) -> str:
        bits = self.activation_global_scale_bits
        scale = "meta" if bits.is_meta else (float(bits.view(torch.float32)) or "dynamic")
        return (
            f"{super().extra_repr()}, route={self.route}, "
            f"activation_recipe={self.activation_recipe}, activation_global_scale={scale}"
        )

    # ------------------------------------------------------------------------------------------
    # The activation settings
    # ------------------------------------------------------------------------------------------

    @property
    def activation_global_scale(self) -> Float[Tensor, ""]:
        """The FP32 activation global scale (a 0-d view of ``activation_global_scale_bits``);
        0.0 means dynamic: each call uses its own activation's amax.

        Set it to a positive finite number or one-element floating tensor (rounded once to
        FP32); ``ValueError`` otherwise. Zero the bits buffer to return to dynamic scales."""
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
                f"{_BITS} buffer for a dynamic global scale)"
            )
        self._buffers[_BITS] = g.reshape(()).clone().view(torch.int32)

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

    @property
    def route(self) -> str:
        """The requested route: ``"auto"``, ``"native"``, ``"emulation"`` or ``"reference"``."""
        return self.__dict__["_route_choice"]

    @route.setter
    def route(self, value: str) -> None:
        if value not in W4A_NVFP4_ROUTES:
            raise ValueError(
                f"W4ANVFP4Linear: route must be one of {W4A_NVFP4_ROUTES}, got {value!r}"
            )
        self.__dict__["_route_choice"] = value

    # ------------------------------------------------------------------------------------------
    # Buffers as bytes; the caches emptied by loads
    # ------------------------------------------------------------------------------------------

    def _apply(self, fn: Callable[[Tensor], Tensor], recurse: bool = True) -> "W4ANVFP4Linear":
        """GPTQLinear's byte moves; the scale bits and the staged caches moved as bytes too."""
        held = {n: self._buffers.get(n) for n in (_BITS, *_CACHES)}
        for name in held:
            self._buffers[name] = None
        try:
            super()._apply(fn, recurse)
        except BaseException:
            self._buffers.update(held)
            raise
        for name, tensor in held.items():
            if tensor is not None:
                raw = tensor.view(torch.uint8) if tensor.element_size() == 1 else tensor
                self._buffers[name] = _move_bytes(fn, raw).view(tensor.dtype)
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
        key = prefix + _BITS
        present = key in state_dict
        if present:  # checked before anything changes
            state_dict = {**state_dict, key: _checked_bits(state_dict[key], key=key)}
        super()._load_from_state_dict(
            state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
        )
        if not present:  # a GPTQ checkpoint without the key: not calibrated, dynamic
            if key in missing_keys:
                missing_keys.remove(key)
            device = self.activation_global_scale_bits.device
            self._buffers[_BITS] = torch.zeros((), dtype=torch.int32, device=device)
        # stale once a buffer may have changed: post_init() rebuilds them
        for name in _CACHES:
            self._buffers[name] = None

    # ------------------------------------------------------------------------------------------
    # Forward
    # ------------------------------------------------------------------------------------------

    def _check_device(self, device: torch.device) -> None:
        if device != self.qweight.device:
            raise TypeError(
                f"W4ANVFP4Linear: x is on {device} but the module's buffers are on "
                f"{self.qweight.device}; move one of them with .to()"
            )

    def _staged(self) -> Tensor:
        cache = self._buffers.get(_E4M3)
        if cache is None:
            raise RuntimeError(
                "W4ANVFP4Linear: the staged weight cache is absent; call post_init() after "
                "loading or packing"
            )
        return cache

    def forward(self, x: Any) -> Float[Tensor, "..."]:
        """``x @ W.T + bias`` with ``x`` quantized to NVFP4.

        Args:
          x: a float16/bfloat16/float32 tensor ``(*, in)``, or an activation carrier
            (:class:`floatxq.W4AActivation`): mode ``"w4a_nvfp4"`` (its codes, block scales,
            global scale and token scale are used as they are) or ``"w4afp8"`` (the W4A-FP8
            GEMM of its E4M3 tokens: the FP8 kernels where they run and ``route`` is not
            ``"reference"``, else :func:`floatxq.w4a_fp8_linear_prepacked`).

        Returns:
          ``(*, out)`` in ``x``'s dtype (a carrier: ``model_dtype``, ``shape[:-1] + (out,)``).

        Raises:
          TypeError: another kind of ``x`` or dtype, ``x`` on another device than the buffers.
          ValueError: ``x``'s last axis is not ``in_features``; NaN or infinity in ``x``; a
            carrier of an unknown mode, with a rotation, or of inconsistent shapes.
          RuntimeError: a weight cache absent (see :meth:`post_init`); a forced route that
            cannot run here.

        Numerics: see the class docstring.
        """
        if isinstance(x, torch.Tensor):
            return self._forward_tensor(x)
        if _is_carrier(x):
            return self._forward_carrier(x)
        raise TypeError(
            f"W4ANVFP4Linear: x must be a floating tensor or a W4AActivation, got "
            f"{type(x).__name__}"
        )

    def _global_scale(self) -> Tensor | None:
        """The stored FP32 global scale, or None (dynamic) while it is 0.0 (one host read)."""
        bits = self.activation_global_scale_bits
        return None if int(bits) == 0 else bits.view(torch.float32)

    def _device_global_scale(self, x2: Tensor) -> Tensor:
        """The global scale a call uses, computed on the device with no host read: the stored
        one, or (stored 0.0) the dynamic one of ``max|x|`` on ``x``'s grid."""
        bits = self.activation_global_scale_bits
        amax = x2.abs().amax() if x2.numel() else torch.zeros((), device=x2.device)
        dynamic = _device_global_scale(amax, grid_dtype=x2.dtype, recipe=self.activation_recipe)
        return torch.where(bits == 0, dynamic, bits.view(torch.float32))

    def _forward_tensor(self, x: Tensor) -> Tensor:
        from floatxq.w4a.activation import pack_activation

        where = "W4ANVFP4Linear"
        if x.dtype not in W4A_OUTPUT_DTYPES:
            raise TypeError(
                f"{where}: x must be a float16, bfloat16 or float32 tensor, got {x.dtype}"
            )
        k, n = self.in_features, self.out_features
        if x.ndim == 0 or x.shape[-1] != k:
            raise ValueError(f"{where}: x must have shape (*, {k}), got {tuple(x.shape)}")
        self._check_device(x.device)
        rows = math.prod(x.shape[:-1])
        x2 = x.reshape(rows, k)
        chosen = self._chosen_route(x.device)
        if chosen[0] != "reference" and x.is_cuda:  # the packer kernel, no host read (graph-safe)
            from floatxq.kernels.nvfp4 import nvfp4_pack_and_swizzle

            g = self._device_global_scale(x2)
            codes, scales = nvfp4_pack_and_swizzle(x2, g, recipe=self.activation_recipe)
        else:  # checked packing (finite input, the scale's value) in the pure functions
            carrier = pack_activation(
                x2, "w4a_nvfp4", global_scale=self._global_scale(), recipe=self.activation_recipe
            )
            codes, scales, g = carrier.codes, carrier.scales, carrier.global_scale
        out = self._nvfp4_gemm(codes, scales, g, None, x.dtype, x.device, chosen)
        return out.reshape(*x.shape[:-1], n)

    def _chosen_route(self, device: torch.device) -> tuple[str, str | None]:
        return w4a_nvfp4_route(
            self.route, device, planes_staged=self._buffers.get(_BOTH) is not None
        )

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
        """The chosen route's GEMM (``codes`` checked to be ``(rows, in/2)``); ``chosen`` is
        the ``(route, reason)`` already decided for this call, if any."""
        staged = self._staged()
        both, unit = self._buffers.get(_BOTH), self._buffers.get(_UNIT)
        route, reason = chosen or self._chosen_route(device)
        rows, n = codes.shape[0], self.out_features
        if rows == 0:
            out = torch.empty((0, n), dtype=output_dtype, device=device)
        elif route == "native":
            out = _native_gemm(
                codes, scales, global_scale, both, unit, self.scales, self.bias, token_scale,
                output_dtype,
            )  # fmt: skip
        else:
            weight = staged
            if route == "emulation":
                from floatxq.kernels.nvfp4 import nvfp4_linear_prepacked as gemm
                from floatxq.kernels.nvfp4 import nvfp4_operand

                if nvfp4_operand(rows) == "words":  # few rows: half the bytes to stream
                    weight = self.qweight
            else:
                gemm = w4a_nvfp4_linear_prepacked
            out = gemm(
                codes, scales, global_scale, weight, self.scales, self.bias,
                token_scale=token_scale, output_dtype=output_dtype,
            )  # fmt: skip
        self._set_last(route, reason)
        return out

    def _forward_carrier(self, carrier: Any) -> Tensor:
        where = "W4ANVFP4Linear"
        mode = carrier.mode
        mode = mode.strip().lower() if isinstance(mode, str) else mode
        if mode not in ("w4a_nvfp4", "w4afp8"):
            raise ValueError(
                f"{where}: the activation carrier has mode {carrier.mode!r}; this module takes "
                f"'w4a_nvfp4' or 'w4afp8'"
            )
        if getattr(carrier, "rotation_applied", False):
            raise ValueError(
                f"{where}: the activation carrier is Hadamard-rotated (rotation_applied=True) "
                f"but this module's weight is not"
            )
        codes, shape, dtype = carrier.codes, tuple(carrier.shape), carrier.model_dtype
        k, n = self.in_features, self.out_features
        if not shape or shape[-1] != k:
            raise ValueError(f"{where}: the carrier's shape must be (*, {k}), got {shape}")
        rows = math.prod(shape[:-1])
        width, kind = (k // 2, _FP4X2) if mode == "w4a_nvfp4" else (k, torch.float8_e4m3fn)
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
        if mode == "w4a_nvfp4":
            out = self._nvfp4_gemm(
                codes, carrier.scales, carrier.global_scale, carrier.token_scale, dtype,
                codes.device,
            )  # fmt: skip
        else:
            out = self._fp8_gemm(codes, carrier.scales, dtype)
        return out.reshape(*shape[:-1], n)

    def _fp8_gemm(self, codes: Tensor, row_scale: Tensor, dtype: torch.dtype) -> Tensor:
        """The W4A-FP8 GEMM of an FP8 carrier over the staged E4M3 operand."""
        from floatxq.kernels.w4a_fp8 import w4a_fp8_unavailable_reason

        staged = self._staged()
        if self.route == "reference":
            route, reason = "fp8_reference", "route='reference' was requested"
        else:
            reason = w4a_fp8_unavailable_reason(codes.device)
            route = "fp8_triton" if reason is None else "fp8_reference"
        if route == "fp8_triton":
            from floatxq.kernels.w4a_fp8 import fp8_linear_prepacked

            out = fp8_linear_prepacked(codes, row_scale, staged, self.scales, self.bias, dtype)
        else:
            out = w4a_fp8_linear_prepacked(
                codes, row_scale, staged, self.scales, self.bias, output_dtype=dtype
            )
        self._set_last(route, reason)
        return out
