"""The W4A activation carrier: one activation tensor quantized for an INT4-weight linear.

A W4A linear multiplies 4-bit weights by low-precision activations. Between the layer that makes
an activation and the GEMM that reads it, the activation travels as a :class:`W4AActivation`:
its quantized bytes, the scales that decode them, the logical shape (``(batch, seq, K)``, the
GEMM sees ``rows = batch · seq`` rows of ``K``) and, optionally, the exact tensor it came from
(``reference``) for the residual and norm arithmetic that must not see quantization error.

Two modes; every scale multiplies to decode:

* ``"w4afp8"``: ``codes`` are ``float8_e4m3fn (rows, K)`` and ``scales`` FP32 ``(rows,)``
  direct per-token scales, exactly :func:`floatxq.fp8_token_quantize` of the ``(rows, K)`` view.
* ``"w4a_nvfp4"``: ``codes`` are ``float4_e2m1fn_x2 (rows, K/2)``, two E2M1 codes per byte with
  element ``2j`` in the low nibble; ``scales`` are the ``(rows, K/16)`` E4M3 block scales
  swizzled per 128-wide K group (:func:`floatxq.swizzle_scales_per_group`) into
  ``(K/128, ceil(rows/128)·128·8)``, padding slots 0; plus one FP32 ``global_scale``, the
  canonical ``recipe`` the block scales were searched with, and an optional FP32 ``(rows,)``
  ``token_scale``.

NVFP4 decodes as ``((e2m1(code) · block_scale) · global_scale) · token_scale`` in FP32. The
``token_scale`` lets a caller fold a per-token factor (a norm's ``1/rms``, a routing weight) into
the activation without re-quantizing it: :meth:`W4AActivation.rescale_tokens` touches neither
codes nor block scales. :func:`pack_activation` builds a carrier with the pure quantizers
(:mod:`~floatxq.fp8`, :mod:`~floatxq.nvfp4.quantize`); :func:`floatxq.dispatch.pack_activation`
takes the Triton packers where they run (the same bytes).
"""

import dataclasses
import math
from collections.abc import Callable

import torch

from floatxq._checks import (
    real_scalar,
    require_data,
    require_finite,
    require_floating,
    require_positive_finite,
    require_tensor,
    to_float32,
)
from floatxq._typing import CHECKING, Float, Float32, Shaped, Tensor
from floatxq.formats import (
    K_GROUP,
    MODEL_DTYPES,
    NVFP4_BLOCK,
    NVFP4_DEFAULT_RECIPE,
    W4A_ACTIVATION_MODES,
    NVFP4Recipe,
    NVFP4RecipeName,
    W4AActivationMode,
    normalize_nvfp4_recipe,
)
from floatxq.fp8 import fp8_token_quantize
from floatxq.nvfp4.e2m1 import pack_e2m1
from floatxq.nvfp4.operand import padded_rows
from floatxq.nvfp4.quantize import (
    _saturated,
    nvfp4_block_scales,
    nvfp4_dequantize,
    nvfp4_dynamic_global_scale,
    nvfp4_global_scale,
)
from floatxq.nvfp4.swizzle import swizzle_scales_per_group, unswizzle_scales_per_group

__all__ = ["W4A_ACTIVATION_MODES", "W4AActivation", "W4AActivationMode", "pack_activation"]


_MODEL_DTYPES = (torch.float16, torch.bfloat16)
_E4M3 = torch.float8_e4m3fn
_FP4X2 = torch.float4_e2m1fn_x2
_BYTE_DTYPES = (_E4M3, _FP4X2)


def _check_model_dtype(value: object, *, where: str) -> None:
    if not isinstance(value, torch.dtype):
        raise TypeError(
            f"{where}: model_dtype must be a torch.dtype (float16, bfloat16 or float32), got "
            f"{type(value).__name__} {value!r:.40}"
        )
    if value not in MODEL_DTYPES:
        raise ValueError(
            f"{where}: model_dtype must be torch.float16, torch.bfloat16 or torch.float32, got "
            f"{value}"
        )


def _check_mode(value: object, *, where: str) -> None:
    if not isinstance(value, str) or value not in W4A_ACTIVATION_MODES:
        raise ValueError(
            f"{where}: mode must be one of {', '.join(W4A_ACTIVATION_MODES)}, got {value!r:.40}"
        )


def _check_shape(shape: object, *, where: str) -> tuple[int, int]:
    """``(rows, k)`` of a logical shape: a tuple of >= 2 non-negative ints, K a positive multiple
    of 128."""
    if not isinstance(shape, tuple) or not all(
        isinstance(d, int) and not isinstance(d, bool) for d in shape
    ):
        raise TypeError(f"{where}: shape must be a tuple of ints, got {shape!r:.60}")
    if len(shape) < 2 or any(d < 0 for d in shape):
        raise ValueError(
            f"{where}: shape must have at least two non-negative dimensions (..., K), got {shape}"
        )
    k = shape[-1]
    if k == 0 or k % K_GROUP:
        raise ValueError(
            f"{where}: the last dimension K must be a positive multiple of {K_GROUP}, got "
            f"shape {shape}"
        )
    return math.prod(shape[:-1]), k


def _check_dtype_shape(
    value: object, dtype: torch.dtype, shape: tuple[int, ...], *, name: str, where: str
) -> None:
    require_tensor(value, name=name, where=where)
    if value.dtype != dtype:
        raise TypeError(f"{where}: {name} must be {dtype}, got {value.dtype}")
    if tuple(value.shape) != shape:
        raise ValueError(f"{where}: {name} must have shape {shape}, got {tuple(value.shape)}")


def _moved(t: Tensor, device: torch.device) -> Tensor:
    """``t`` on ``device``; FP8/FP4 codes and scales travel as their bytes."""
    if t.dtype in _BYTE_DTYPES:
        return t.view(torch.uint8).to(device).view(t.dtype)
    return t.to(device)


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True, eq=False)
class W4AActivation:
    """One activation tensor quantized for a W4A linear (see the module docstring for layouts).

    Built by :func:`pack_activation`; every field is validated when built. Immutable: the
    methods return new carriers and never touch the tensors of this one. Compared by identity
    (``eq=False``: fields are tensors).

    Raises:
      TypeError: a field of the wrong kind or dtype, tensors on different devices, a meta tensor.
      ValueError: an unknown mode, a shape that does not fit ``shape`` and ``mode``, FP8 scales
        that are not positive and finite, a NVFP4 global scale that is not one positive finite
        value, a non-canonical recipe, a non-finite ``token_scale``, a field the mode forbids.

    Numerics: FP8 ``x ≈ float32(code) · scale[row]``; NVFP4 ``x ≈ ((e2m1(code) ·
    block_scale) · global_scale) · token_scale[row]``, all products in FP32.

    Example:
      >>> a = pack_activation(torch.ones(2, 3, 128), "w4afp8")
      >>> a.rows, a.k, a.codes.dtype, a.scales.shape, a.decode().shape
      (6, 128, torch.float8_e4m3fn, torch.Size([6]), torch.Size([2, 3, 128]))
    """

    codes: Shaped[Tensor, "rows width"]
    """``float8_e4m3fn (rows, K)`` (FP8) or ``float4_e2m1fn_x2 (rows, K/2)`` (NVFP4, element
    ``2j`` in the low nibble)."""
    scales: Shaped[Tensor, "*scale_shape"]
    """FP32 ``(rows,)`` direct token scales (FP8) or E4M3 ``(K/128, padded_rows·8)`` block scales
    swizzled per 128-wide K group, padding 0 (NVFP4). Multiply to decode."""
    shape: tuple
    """The logical shape, e.g. ``(batch, seq, K)``; ``rows`` is the product of all but the last."""
    model_dtype: torch.dtype
    """float16, bfloat16 or float32: what :meth:`decode` and :meth:`exact` return by default."""
    mode: W4AActivationMode
    """``"w4afp8"`` or ``"w4a_nvfp4"``."""
    global_scale: Float32[Tensor, "*one"] | None = None
    """NVFP4: one positive finite FP32 value (multiply to decode). FP8: None."""
    recipe: NVFP4Recipe | None = None
    """NVFP4: the canonical block-scale recipe the codes were searched with. FP8: None."""
    token_scale: Float32[Tensor, "rows"] | None = None
    """NVFP4 only, optional: a finite FP32 ``(rows,)`` multiplier applied after the decode."""
    reference: Float[Tensor, "*logical"] | None = None
    """Optional: the exact activation of the logical shape (for residual and norm arithmetic)."""

    def __post_init__(self) -> None:
        where = "W4AActivation"
        self._check_structure(where)
        # value checks last: each is one host sync
        if self.mode == "w4a_nvfp4":
            g = self.global_scale
            if not bool(torch.isfinite(g).all() & (g > 0).all()):
                raise ValueError(
                    f"{where}: global_scale must be positive and finite, got {g.item()!r}"
                )
            if self.token_scale is not None:
                require_finite(self.token_scale, name="token_scale", where=where)
        else:
            require_positive_finite(self.scales, name="scales", where=where)

    def _check_structure(self, where: str) -> None:
        """Kinds, dtypes, shapes and devices: every check that reads no tensor value."""
        _check_mode(self.mode, where=where)
        rows, k = _check_shape(self.shape, where=where)
        _check_model_dtype(self.model_dtype, where=where)
        nvfp4 = self.mode == "w4a_nvfp4"
        if nvfp4:
            _check_dtype_shape(self.codes, _FP4X2, (rows, k // 2), name="codes", where=where)
            groups, padded = k // K_GROUP, padded_rows(rows) * (K_GROUP // NVFP4_BLOCK)
            _check_dtype_shape(self.scales, _E4M3, (groups, padded), name="scales", where=where)
        else:
            _check_dtype_shape(self.codes, _E4M3, (rows, k), name="codes", where=where)
            _check_dtype_shape(self.scales, torch.float32, (rows,), name="scales", where=where)
            for name in ("global_scale", "recipe", "token_scale"):
                if getattr(self, name) is not None:
                    raise ValueError(f"{where}: {name} must be None in mode 'w4afp8'")
        tensors = {"codes": self.codes, "scales": self.scales}
        if nvfp4:
            tensors["global_scale"] = self._check_global_scale(where)
            self._check_recipe(where)
            if self.token_scale is not None:
                shape = (rows,)
                _check_dtype_shape(
                    self.token_scale, torch.float32, shape, name="token_scale", where=where
                )
                tensors["token_scale"] = self.token_scale
        if self.reference is not None:
            require_floating(self.reference, name="reference", where=where)
            if tuple(self.reference.shape) != self.shape:
                raise ValueError(
                    f"{where}: reference must have the logical shape {self.shape}, got "
                    f"{tuple(self.reference.shape)}"
                )
            tensors["reference"] = self.reference
        devices = {name: t.device for name, t in tensors.items()}
        if len(set(devices.values())) != 1:
            listed = ", ".join(f"{name} on {device}" for name, device in devices.items())
            raise TypeError(f"{where}: every tensor must be on one device, got {listed}")
        require_data(self.codes, name="codes", where=where)

    def _check_global_scale(self, where: str) -> Tensor:
        g = self.global_scale
        if g is None:
            raise ValueError(f"{where}: global_scale is required in mode 'w4a_nvfp4'")
        require_tensor(g, name="global_scale", where=where)
        if g.dtype != torch.float32:
            raise TypeError(f"{where}: global_scale must be float32, got {g.dtype}")
        if g.numel() != 1:
            raise ValueError(
                f"{where}: global_scale must hold one value (shape () or (1,)), got shape "
                f"{tuple(g.shape)}"
            )
        return g

    def _check_recipe(self, where: str) -> None:
        if self.recipe is None:
            raise ValueError(f"{where}: recipe is required in mode 'w4a_nvfp4'")
        canonical = normalize_nvfp4_recipe(self.recipe)  # ValueError for an unknown name
        if canonical != self.recipe:
            raise ValueError(
                f"{where}: recipe must be a canonical name, got {self.recipe!r} (use {canonical!r})"
            )

    @property
    def rows(self) -> int:
        """Rows the GEMM sees: the product of the logical shape's leading dimensions."""
        return math.prod(self.shape[:-1])

    @property
    def k(self) -> int:
        """The reduction dimension K (the logical shape's last)."""
        return self.shape[-1]

    def decode(self, dtype: torch.dtype | None = None) -> Float[Tensor, "*logical"]:
        """The quantized activation decoded, in the logical shape.

        Args:
          dtype: the output dtype (default ``model_dtype``).

        Returns:
          A ``dtype`` tensor of shape ``shape`` on the carrier's device.

        Raises:
          TypeError: a ``dtype`` that is not a floating ``torch.dtype``.

        Numerics: FP8: ``float32(code) · scale[row]`` (exact product), one nearest-even rounding
        into ``dtype``, equal to :func:`floatxq.fp8_token_dequantize`. NVFP4: ``(e2m1(code) ·
        block_scale) · global_scale`` (as :func:`floatxq.nvfp4_dequantize` in FP32), times
        ``token_scale[row]`` in FP32 when present, then one nearest-even rounding into ``dtype``
        after clamping to its largest finite magnitude.
        """
        dtype = self._dtype(dtype, where="W4AActivation.decode")
        if self.mode == "w4afp8":
            return (
                (self.codes.to(torch.float32) * self.scales[:, None]).to(dtype).reshape(self.shape)
            )
        block_scales = unswizzle_scales_per_group(
            self.scales, rows=self.rows, cols=self.k // NVFP4_BLOCK
        )
        y = nvfp4_dequantize(self.codes, block_scales, self.global_scale, dtype=torch.float32)
        if self.token_scale is not None:
            y = y * self.token_scale[:, None]
        return _saturated(y, dtype, where="W4AActivation.decode").reshape(self.shape)

    def exact(self, dtype: torch.dtype | None = None) -> Float[Tensor, "*logical"]:
        """The exact activation where the carrier holds it (``reference``), else :meth:`decode`.

        Args:
          dtype: the output dtype (default ``model_dtype``).

        Raises:
          TypeError: a ``dtype`` that is not a floating ``torch.dtype``.

        Numerics: ``reference`` rounded once to ``dtype`` (nearest-even), or as :meth:`decode`.
        """
        dtype = self._dtype(dtype, where="W4AActivation.exact")
        if self.reference is None:
            return self.decode(dtype)
        return self.reference.to(dtype)

    def rescale_tokens(self, f: Float32[Tensor, "rows"]) -> "W4AActivation":
        """A new NVFP4 carrier whose row ``r`` decodes ``f[r]`` times larger; bytes unchanged.

        Args:
          f: FP32 ``(rows,)`` finite factors on the carrier's device.

        Returns:
          A carrier with the same ``codes``, ``scales`` and ``global_scale`` tensors,
          ``token_scale = token_scale · f`` (or ``f``), and ``reference`` (when present) rescaled
          as ``(reference · f[row])`` rounded to ``model_dtype``.

        Raises:
          ValueError: an FP8 carrier (its token scales are the quantization's own); ``f`` not
            ``(rows,)`` or not finite.
          TypeError: ``f`` not a float32 tensor, or on another device.

        Numerics: one FP32 product per token scale; the reference product in FP32, then one
        nearest-even rounding to ``model_dtype``.
        """
        where = "W4AActivation.rescale_tokens"
        if self.mode != "w4a_nvfp4":
            raise ValueError(
                f"{where}: only a 'w4a_nvfp4' carrier has a token_scale, got mode {self.mode!r}"
            )
        rows = self.rows
        _check_dtype_shape(f, torch.float32, (rows,), name="f", where=where)
        if f.device != self.codes.device:
            raise TypeError(f"{where}: f is on {f.device}, the carrier on {self.codes.device}")
        require_finite(f, name="f", where=where)
        token_scale = f if self.token_scale is None else self.token_scale * f
        reference = self.reference
        if reference is not None:
            rescaled = reference.reshape(rows, self.k).to(torch.float32) * f[:, None]
            reference = rescaled.to(self.model_dtype).reshape(self.shape)
        return dataclasses.replace(self, token_scale=token_scale, reference=reference)

    def to(self, device: torch.device | str) -> "W4AActivation":
        """A new carrier with every tensor on ``device``; FP8/FP4 bytes are moved, never cast.

        Numerics: exact (a copy of every byte).
        """
        device = torch.device(device)

        def move(t: Tensor | None) -> Tensor | None:
            return None if t is None else _moved(t, device)

        return dataclasses.replace(
            self,
            codes=move(self.codes),
            scales=move(self.scales),
            global_scale=move(self.global_scale),
            token_scale=move(self.token_scale),
            reference=move(self.reference),
        )

    @classmethod
    def trusted(cls, **fields: object) -> "W4AActivation":
        """A carrier of fields its producer already guarantees, built without the value checks.

        Skips ``__post_init__``, whose checks read tensors on the host (finite scales, a positive
        global scale), which a CUDA graph capture forbids. For producers whose dtypes and shapes
        are right by construction, such as the Triton packers of the CUDA activation stream
        (non-finite input shows up there as NaN scales). Never for user input: every field is
        taken as given. In the test run (jaxtyping's import hook on, ``floatxq._typing.CHECKING``)
        the structural checks still run: kinds, dtypes, shapes and devices, none a host read.

        Raises:
          TypeError: a missing required field or an unknown one; in the test run, what the
            structural checks of :class:`W4AActivation` raise (ValueError too).
        """
        carrier = object.__new__(cls)
        for field in dataclasses.fields(cls):
            value = fields.pop(field.name, field.default)
            if value is dataclasses.MISSING:
                raise TypeError(f"W4AActivation.trusted: field {field.name!r} is required")
            object.__setattr__(carrier, field.name, value)
        if fields:
            raise TypeError(f"W4AActivation.trusted: unknown field(s) {sorted(fields)}")
        if CHECKING:
            carrier._check_structure("W4AActivation.trusted")
        return carrier

    def _dtype(self, dtype: object, *, where: str) -> torch.dtype:
        if dtype is None:
            return self.model_dtype
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise TypeError(f"{where}: dtype must be a floating torch.dtype, got {dtype!r:.40}")
        return dtype


# ----------------------------------------------------------------------------------------------
# Packing
# ----------------------------------------------------------------------------------------------


def pack_fp8_tokens(x2: Float[Tensor, "rows k"]) -> tuple[Tensor, Tensor]:
    """``(codes, row_scale)`` of :func:`floatxq.fp8_token_quantize` of ``x2`` (pure)."""
    tokens = fp8_token_quantize(x2)
    return tokens.codes, tokens.scale[:, 0]


def pack_nvfp4_blocks(
    x2: Float[Tensor, "rows k"], x32: Float32[Tensor, "rows k"], g: Float32[Tensor, ""], recipe: str
) -> tuple[Tensor, Tensor]:
    """``(codes, swizzled block scales)`` of ``x32`` (``x2`` in FP32) at global scale ``g``."""
    blocks = nvfp4_block_scales(x32, g, recipe)
    codes = pack_e2m1(blocks.codes).view(_FP4X2)
    return codes, swizzle_scales_per_group(blocks.block_scales)


def _global_scale(
    x2: Tensor, x32: Tensor, global_scale: object, recipe: str, *, where: str
) -> Tensor:
    """The NVFP4 global scale of a pack: given (checked), or dynamic from ``max|x|``."""
    if global_scale is None:  # dynamic: the amax of the whole tensor, on x's grid
        if x32.numel():
            amax = x32.abs().amax()
            grid = x2.dtype if x2.dtype in MODEL_DTYPES else None
            return nvfp4_global_scale(amax, grid_dtype=grid, recipe=recipe)
        return torch.ones((), dtype=torch.float32, device=x2.device)
    g = real_scalar(global_scale, name="global_scale", where=where, device=x2.device)
    if not bool(torch.isfinite(g) & (g > 0)):
        raise ValueError(f"{where}: global_scale must be positive and finite, got {g.item()!r}")
    return g


FP8Packer = Callable[[Tensor], tuple[Tensor, Tensor]]
NVFP4Packer = Callable[[Tensor, Tensor, Tensor, str], tuple[Tensor, Tensor]]


def pack_activation(
    x: Float[Tensor, "*lead k"],
    mode: W4AActivationMode,
    *,
    global_scale: Float[Tensor, "*one"] | float | None = None,
    model_dtype: torch.dtype | None = None,
    recipe: NVFP4RecipeName | None = None,
    reference: Float[Tensor, "*lead k"] | None = None,
) -> W4AActivation:
    """Quantize an activation into a :class:`W4AActivation` for a W4A linear (pure functions;
    :func:`floatxq.pack_activation` takes the Triton packers where they run: the same bytes).

    Args:
      x: ``(..., K)`` floating activation, at least 2-D, finite; ``K`` a positive multiple of
        128. The GEMM sees ``rows = prod(x.shape[:-1])`` rows.
      mode: ``"w4afp8"`` (per-token E4M3) or ``"w4a_nvfp4"``.
      global_scale: NVFP4 only: one positive finite value (read as FP32), or None for the
        dynamic scale of ``max|x|`` over the whole tensor (each token's codes depend on all).
      model_dtype: float16, bfloat16 or float32 (default ``x.dtype`` when half, else bfloat16).
      recipe: NVFP4 only: the block-scale recipe (default ``least_squares``; stored canonical).
      reference: the exact activation to carry, ``x``'s shape and device, or None.

    Raises:
      TypeError: a non-floating ``x`` or ``reference``, a ``model_dtype`` that is not a dtype,
        a ``reference`` on another device, a ``global_scale`` that is not a number.
      ValueError: ``x`` below 2-D, ``K`` not a positive multiple of 128, NaN or infinity in
        ``x``, an unknown mode or recipe, a recipe or global scale in FP8 mode, a global scale
        that is not positive and finite, another ``model_dtype``, a ``reference`` of another shape.

    Numerics: FP8 as :func:`floatxq.fp8_token_quantize` per row; NVFP4 as
    :func:`floatxq.nvfp4_block_scales` of the ``(rows, K)`` tensor (dynamic global scale: of
    ``max|x|`` on ``x.dtype``'s grid, 1 for no rows), block scales swizzled per 128-wide group.

    Example:
      >>> a = pack_activation(torch.full((1, 128), 3.0), "w4a_nvfp4", global_scale=1.0)
      >>> a.codes.shape, a.scales.shape, a.recipe, a.decode(torch.float32)[0, :2].tolist()
      (torch.Size([1, 64]), torch.Size([1, 1024]), 'least_squares', [3.0, 3.0])
    """
    return pack_activation_with(
        x, mode, global_scale=global_scale, model_dtype=model_dtype, recipe=recipe,
        reference=reference, fp8_packer=pack_fp8_tokens,
        nvfp4_packer=pack_nvfp4_blocks,
    )  # fmt: skip


def pack_activation_with(
    x: Tensor,
    mode: W4AActivationMode,
    *,
    global_scale: Tensor | float | None,
    model_dtype: torch.dtype | None,
    recipe: NVFP4RecipeName | None,
    reference: Tensor | None,
    fp8_packer: FP8Packer,
    nvfp4_packer: NVFP4Packer,
) -> W4AActivation:
    """:func:`pack_activation` with the byte packers given (checks and scales stay here):
    :func:`floatxq.dispatch.pack_activation` passes the Triton packers where they run."""
    where = "pack_activation"
    require_floating(x, name="x", where=where)
    require_data(x, name="x", where=where)
    _check_mode(mode, where=where)
    if mode == "w4afp8":
        for name, value in (("recipe", recipe), ("global_scale", global_scale)):
            if value is not None:
                raise ValueError(
                    f"{where}: {name} applies to mode 'w4a_nvfp4' only, got {value!r:.40}"
                )
    else:
        canonical = normalize_nvfp4_recipe(NVFP4_DEFAULT_RECIPE if recipe is None else recipe)
    if x.ndim < 2:
        raise ValueError(f"{where}: x must have at least 2 dimensions (..., K), got {x.ndim}-D")
    shape = tuple(x.shape)
    rows, k = _check_shape(shape, where=where)
    if model_dtype is None:
        model_dtype = x.dtype if x.dtype in _MODEL_DTYPES else torch.bfloat16
    _check_model_dtype(model_dtype, where=where)
    if reference is not None:
        require_floating(reference, name="reference", where=where)
        if tuple(reference.shape) != shape:
            raise ValueError(
                f"{where}: reference must have x's shape {shape}, got {tuple(reference.shape)}"
            )
        if reference.device != x.device:
            raise TypeError(f"{where}: reference is on {reference.device}, x on {x.device}")
    x2 = x.reshape(rows, k)
    x32 = to_float32(x2, name="x", where=where)
    require_finite(x32, name="x", where=where)
    common = dict(
        shape=shape,
        model_dtype=model_dtype,
        mode=mode,
        reference=reference,
    )
    if mode == "w4afp8":
        codes, row_scale = fp8_packer(x2)
        return W4AActivation(codes=codes, scales=row_scale, **common)
    g = _global_scale(x2, x32, global_scale, canonical, where=where)
    codes, scales = nvfp4_packer(x2, x32, g, canonical)
    return W4AActivation(
        codes=codes, scales=scales, global_scale=g.reshape(()), recipe=canonical, **common
    )


# ----------------------------------------------------------------------------------------------
# A stored activation global scale: its FP32 bits in an int32 buffer
# ----------------------------------------------------------------------------------------------

_FP32_INF_BITS = 0x7F800000  # positive finite FP32 values are the int32 bit patterns 1..this-1


def global_scale_bits_problem(bits: Tensor) -> str | None:
    """Why a 0-d int32 bit pattern is not 0.0 (dynamic) or a positive finite FP32 value, or
    ``None`` (one host read; a meta tensor passes)."""
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


def global_scale_from_bits(bits: Tensor, x2: Tensor, *, recipe: str) -> Tensor:
    """The global scale an NVFP4 activation ``x2`` is packed with, on the device with no host
    read: the stored FP32 value of ``bits`` (0-d int32), or, while it is 0.0, the dynamic
    :func:`floatxq.nvfp4_dynamic_global_scale` of ``x2``."""
    dynamic = nvfp4_dynamic_global_scale(x2, recipe=recipe)
    return torch.where(bits == 0, dynamic, bits.view(torch.float32))


def checked_global_scale_bits(value: object, *, key: str) -> Tensor:
    """An incoming FP32 global scale's int32 bit pattern as a 0-d tensor (``ValueError``
    naming ``key`` otherwise)."""
    if not isinstance(value, torch.Tensor):
        raise ValueError(f"{key}: expected a tensor, got {type(value).__name__}")
    if value.dtype != torch.int32:
        raise ValueError(
            f"{key}: the FP32 global scale is stored as its int32 bit pattern, got {value.dtype}"
        )
    if value.numel() != 1 or value.ndim > 1:
        raise ValueError(f"{key}: expected one value (shape ()), got shape {tuple(value.shape)}")
    value = value.reshape(())
    why = global_scale_bits_problem(value)
    if why is not None:
        raise ValueError(f"{key}: {why}")
    return value
