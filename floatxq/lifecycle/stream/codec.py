"""The stream's runtime codec: carriers packed once per boundary, and the producer quantizers.

On CUDA the carriers come from the Triton packers with device-side global scales and no host
reads, so a selected layer's forward can be captured in a CUDA graph (capture after calibration:
whether a boundary is calibrated is decided on the host). On the CPU they come from
:func:`floatxq.pack_activation` and the modules take their reference routes.
"""

import dataclasses
import math
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import torch
from torch import nn

from floatxq._typing import Float32, Int32, Tensor
from floatxq.dispatch import pack_activation, stream_pack_reason
from floatxq.formats import K_GROUP, NVFP4Recipe, normalize_nvfp4_recipe
from floatxq.lifecycle.stream.plan import _FP8, _NVFP4, StreamLane, _fp32
from floatxq.nvfp4.quantize import nvfp4_dynamic_global_scale
from floatxq.w4a.activation import (
    W4AActivation,
    checked_global_scale_bits,
    global_scale_from_bits,
)


def _scale_name(key: str) -> str:
    """The buffer name of a producer key inside its layer's :class:`StreamScales`
    (``model.layers.3.self_attn.o_proj.input`` -> ``o_proj_input``)."""
    suffix = key.split(".", 3)[3] if key.count(".") >= 3 else key
    for owner in ("self_attn.", "mlp."):
        suffix = suffix.removeprefix(owner)
    return suffix.replace(".", "_")


class StreamScales(nn.Module):
    """One decoder layer's calibrated NVFP4 producer scales, as int32 buffers (0: dynamic).

    Registered on the layer as ``w4a_stream_scales`` while a Llama stream is installed, so the
    scales show in ``state_dict``, move with ``.to()`` and deep-copy with the model. A buffer
    holds the FP32 scale's bit pattern, 0 for the dynamic scale (the convention of the linears'
    ``activation_global_scale_bits``). The exporters skip these entries: the same scales are
    the activation policy's ``global_scales``, which the files already carry.

    Args:
      producers: buffer name -> producer key, for the layer's NVFP4 producers.
      device: where the buffers live.

    Numerics: none; the bits are stored as given.
    """

    def __init__(
        self, producers: Mapping[str, str], *, device: torch.device | str | None = None
    ) -> None:
        super().__init__()
        self.producers = dict(producers)
        self.calibrated: set[str] = set()
        """The names whose bits are not 0: a host-side mirror, so packing reads no device."""
        for name in self.producers:
            self.register_buffer(name, torch.zeros((), dtype=torch.int32, device=device))

    def extra_repr(self) -> str:
        return ", ".join(self.producers)

    def assign(self, name: str, bits: Int32[Tensor, ""]) -> None:
        """Write one scale's bits in place (a captured CUDA graph reads the new value)."""
        buffer = getattr(self, name)
        buffer.copy_(bits.reshape(()).to(buffer.device))
        if int(bits) == 0:
            self.calibrated.discard(name)
        else:
            self.calibrated.add(name)

    def _load_from_state_dict(self, state_dict, prefix, *args: Any, **kwargs: Any) -> None:
        for name in self.producers:  # 0.0 (dynamic) or positive finite bits, as a file's
            key = prefix + name
            if key in state_dict:
                state_dict[key] = checked_global_scale_bits(state_dict[key], key=key)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)
        self.calibrated = {n for n in self.producers if int(getattr(self, n)) != 0}


class NVFP4BoundaryQuantizer:
    """The global-scale state of one NVFP4 producer boundary of an installed stream.

    A handle held by the stream onto one buffer of its layer's :class:`StreamScales` (so the
    scale itself is in ``state_dict``, moves with ``.to()`` and deep-copies). Uncalibrated, the
    boundary packs with the dynamic global scale of its tensor; calibrated (:meth:`set_scale`),
    with the stored FP32 scale.

    Args:
      key: the producer key (``model.layers.{i}....``).
      layer: its decoder layer index.
      recipe: the canonical NVFP4 recipe its lane packs with.
      device, scales: the layer's holder with a buffer for ``key``, else a new one on ``device``.

    Attributes:
      scale_bits: int32 ``()``: the FP32 scale's bit pattern (0 until calibrated).
      calibrated: whether the stored scale is used.
      observer: None, or a callable given each un-quantized boundary tensor before it is packed
        (calibration reads maxima here; raising aborts the forward).

    Raises:
      ValueError: a key not under ``model.layers.``, a bad layer, ``scales`` without its buffer.

    Numerics: the scale is FP32, stored and used as its bits (no rounding after
    :meth:`set_scale`).

    Example:
      >>> q = NVFP4BoundaryQuantizer("model.layers.0.output", layer=0, recipe="least_squares")
      >>> q.set_scale(0.5); q.calibrated, q.scale
      (True, 0.5)
    """

    def __init__(
        self,
        key: str,
        *,
        layer: int,
        recipe: str,
        device: torch.device | str | None = None,
        scales: StreamScales | None = None,
    ) -> None:
        where = "NVFP4BoundaryQuantizer"
        if not isinstance(key, str) or not key.startswith("model.layers."):
            raise ValueError(f"{where}: key must be a 'model.layers.' producer key, got {key!r}")
        if isinstance(layer, bool) or not isinstance(layer, int) or layer < 0:
            raise ValueError(f"{where}: layer must be a non-negative int, got {layer!r}")
        self.key = key
        self.layer = layer
        self.recipe: NVFP4Recipe = normalize_nvfp4_recipe(recipe)
        self.name = _scale_name(key)
        if scales is None:
            scales = StreamScales({self.name: key}, device=device)
        elif scales.producers.get(self.name) != key:
            raise ValueError(f"{where}: scales holds no buffer for {key!r}")
        self.scales = scales
        self.observer: Callable[[Tensor], Any] | None = None

    def __repr__(self) -> str:
        state = f"scale={self.scale!r}" if self.calibrated else "dynamic"
        return f"NVFP4BoundaryQuantizer({self.key!r}, {self.recipe}, {state})"

    @property
    def scale_bits(self) -> Int32[Tensor, ""]:
        """The FP32 scale's bit pattern: the layer's :class:`StreamScales` buffer (0: dynamic)."""
        return getattr(self.scales, self.name)

    @property
    def calibrated(self) -> bool:
        """Whether the stored scale is used (else the dynamic one)."""
        return self.name in self.scales.calibrated

    @property
    def scale(self) -> float:
        """The stored FP32 scale as a Python float, 0.0 when dynamic (one host read)."""
        return float(self.scale_bits.view(torch.float32))

    def set_scale(self, value: float | int) -> None:
        """Store a calibrated scale and use it from now on.

        Raises:
          TypeError: ``value`` is not a real number (bools refused).
          ValueError: not positive and finite, as a Python float or after rounding to FP32.

        Numerics: one nearest-even rounding to FP32; written in place (a captured CUDA graph
        reads the new value).
        """
        v = _fp32(value, name="value", where=f"NVFP4BoundaryQuantizer({self.key!r}).set_scale")
        self.scales.assign(self.name, torch.tensor(v, dtype=torch.float32).view(torch.int32))

    def reset(self) -> None:
        """Back to the dynamic global scale (stored bits 0, not calibrated)."""
        self.scales.assign(self.name, torch.zeros((), dtype=torch.int32))

    def global_scale(self, device: torch.device) -> Float32[Tensor, ""]:
        """The stored scale as a 0-d FP32 view on ``device`` (the buffer moved there once)."""
        bits = self.scale_bits
        if bits.device != device:
            bits = bits.to(device)
            setattr(self.scales, self.name, bits)
        return bits.view(torch.float32)


class _Scale(NamedTuple):
    """A pack's global scale: ``fixed`` (FP32 0-d), else a linear's ``bits`` (0.0: dynamic),
    else dynamic."""

    fixed: Tensor | None = None
    bits: Tensor | None = None


def _check_width(value: Tensor, *, site: str) -> tuple[tuple[int, ...], int, int]:
    shape = tuple(value.shape)
    if len(shape) < 2 or shape[-1] == 0 or shape[-1] % K_GROUP:
        raise ValueError(
            f"W4A stream: the {site} operand must be (..., K) with K a positive multiple of "
            f"{K_GROUP}, got shape {shape}"
        )
    return shape, math.prod(shape[:-1]), shape[-1]


def _device_pack(
    value: Tensor,
    lane: StreamLane,
    scale: _Scale,
    model_dtype: torch.dtype,
    reference: Tensor | None,
    *,
    site: str,
) -> W4AActivation:
    """A carrier through the Triton packers with the global scale computed on the device: no
    host read, so a CUDA graph can capture it."""
    shape, rows, k = _check_width(value, site=site)
    x2 = value.reshape(rows, k)
    if lane.mode == _FP8:
        from floatxq.kernels.w4a_fp8 import fp8_pack

        codes, row_scale = fp8_pack(x2)
        return W4AActivation.trusted(
            codes=codes, scales=row_scale, shape=shape, model_dtype=model_dtype, mode=_FP8,
            reference=reference,
        )  # fmt: skip
    from floatxq.kernels.nvfp4 import nvfp4_pack_and_swizzle

    if scale.fixed is not None:
        g = scale.fixed.to(torch.float32).reshape(())
    elif scale.bits is not None:
        g = global_scale_from_bits(scale.bits, x2, recipe=lane.recipe)
    else:
        g = nvfp4_dynamic_global_scale(x2, recipe=lane.recipe)
    codes, scales = nvfp4_pack_and_swizzle(x2, g, recipe=lane.recipe)
    return W4AActivation.trusted(
        codes=codes, scales=scales, shape=shape, model_dtype=model_dtype, mode=_NVFP4,
        global_scale=g, recipe=lane.recipe, reference=reference,
    )  # fmt: skip


def _host_pack(
    value: Tensor,
    lane: StreamLane,
    scale: _Scale,
    model_dtype: torch.dtype,
    reference: Tensor | None,
    *,
    site: str,
) -> W4AActivation:
    """A carrier through :func:`floatxq.pack_activation` (checked; the modules' reference
    routes read it)."""
    _check_width(value, site=site)
    if lane.mode == _FP8:
        return pack_activation(value, _FP8, model_dtype=model_dtype, reference=reference)
    g = scale.fixed
    if g is None and scale.bits is not None and int(scale.bits) != 0:
        g = scale.bits.view(torch.float32)
    return pack_activation(
        value, _NVFP4, global_scale=g, model_dtype=model_dtype, recipe=lane.recipe,
        reference=reference,
    )  # fmt: skip


class _RuntimeCodec:
    """Operands are :class:`~floatxq.W4AActivation` carriers; linears are the W4A modules."""

    def __init__(self, quantizers: Mapping[str, NVFP4BoundaryQuantizer]) -> None:
        self.quantizers = quantizers
        self._reasons: dict[tuple[torch.device, str], str | None] = {}

    def _on_device(self, device: torch.device, mode: str) -> bool:
        key = (device, mode)
        if key not in self._reasons:
            self._reasons[key] = stream_pack_reason(device, mode)
        return self._reasons[key] is None

    @staticmethod
    def is_operand(x: Any) -> bool:
        return isinstance(x, W4AActivation)

    @staticmethod
    def model_dtype(op: W4AActivation) -> torch.dtype:
        return op.model_dtype

    @staticmethod
    def place(op: W4AActivation, like: Tensor) -> W4AActivation:
        return op if op.codes.device == like.device else op.to(like.device)

    @staticmethod
    def exact32(op: W4AActivation) -> Tensor:
        return op.exact(torch.float32)

    @staticmethod
    def fits(op: W4AActivation, lane: StreamLane) -> bool:
        return op.mode == lane.mode and op.recipe == lane.recipe

    def pack(
        self,
        value: Tensor,
        lane: StreamLane,
        *,
        site: str,
        key: str | None,
        headroom: nn.Module | None,
        reference: Tensor | None,
        model_dtype: torch.dtype,
    ) -> W4AActivation:
        scale = _Scale()
        if lane.nvfp4:
            quantizer = self.quantizers.get(key) if key is not None else None
            if quantizer is not None:
                if quantizer.observer is not None:
                    quantizer.observer(value)
                if quantizer.calibrated:
                    scale = _Scale(fixed=quantizer.global_scale(value.device))
            if scale.fixed is None and lane.headroom and headroom is not None:
                scale = _Scale(bits=headroom.activation_global_scale_bits)
        pack = _device_pack if self._on_device(value.device, lane.mode) else _host_pack
        return pack(value, lane, scale, model_dtype, reference, site=site)

    def rescale(
        self, op: W4AActivation, inv: Tensor, *, site: str, lane: StreamLane
    ) -> W4AActivation:
        if not self._on_device(op.codes.device, _NVFP4):
            return op.rescale_tokens(inv)
        fields = {f.name: getattr(op, f.name) for f in dataclasses.fields(op)}
        fields["token_scale"] = inv if op.token_scale is None else op.token_scale * inv
        if op.reference is not None:
            rows = op.reference.reshape(op.rows, op.k).to(torch.float32) * inv[:, None]
            fields["reference"] = rows.to(op.model_dtype).reshape(op.shape)
        return W4AActivation.trusted(**fields)

    @staticmethod
    def forward(module: nn.Module, role: str) -> None:
        """None: the W4A modules multiply the carriers with their own forward."""
        return None
