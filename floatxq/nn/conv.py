"""Convolutions as FP8 linear layers: the weight matrix a module multiplies by, and its geometry.

An ``nn.Conv1d/2d/3d`` weight ``(out, in/groups, *kernel)`` is stored flattened as the matrix
``(out, in/groups·k…)`` (one row per output channel, so row and block scales keep their meaning);
:class:`ConvGeometry` keeps what is needed to reshape the decoded matrix and run the convolution
again. Hugging Face's ``Conv1D`` is a linear layer that stores ``(in, out)``: its matrix is the
transpose. Nothing here quantizes or decodes; :class:`floatxq.nn.TorchFP8Linear` does.
"""

import dataclasses
import functools

import torch.nn.functional as F
from torch import nn

from floatxq._typing import Float, Tensor

__all__ = ["ConvGeometry", "conv_forward", "conv_geometry", "weight_matrix"]


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class ConvGeometry:
    """How a flattened convolution weight is reshaped and applied (kept from the source module).

    Numerics: shapes and conv arguments only.
    """

    dims: int
    """1, 2 or 3 (``F.conv1d``/``conv2d``/``conv3d``)."""
    weight_shape: tuple[int, ...]
    """``(out, in/groups, *kernel)``."""
    stride: tuple[int, ...]
    padding: tuple[int, ...] | str
    dilation: tuple[int, ...]
    groups: int
    padding_mode: str
    reversed_padding_repeated_twice: tuple[int, ...]
    """Used with ``padding_mode != "zeros"`` (explicit ``F.pad`` first, as ``nn.Conv`` does)."""

    def __post_init__(self) -> None:
        if self.dims not in (1, 2, 3):
            raise ValueError(f"ConvGeometry: dims must be 1, 2 or 3, got {self.dims}")
        if len(self.weight_shape) != self.dims + 2:
            raise ValueError(
                f"ConvGeometry: weight_shape must have dims + 2 = {self.dims + 2} axes, got "
                f"{self.weight_shape}"
            )


def conv_geometry(module: nn.Conv1d | nn.Conv2d | nn.Conv3d) -> ConvGeometry:
    """The geometry of an ``nn.Conv1d/2d/3d`` (its weight shape and convolution arguments).

    Numerics: none; shapes and arguments are copied.
    """
    weight = module.weight
    padding = module.padding
    return ConvGeometry(
        dims=weight.ndim - 2,
        weight_shape=tuple(weight.shape),
        stride=tuple(module.stride),
        padding=padding if isinstance(padding, str) else tuple(padding),
        dilation=tuple(module.dilation),
        groups=module.groups,
        padding_mode=module.padding_mode,
        reversed_padding_repeated_twice=tuple(module._reversed_padding_repeated_twice),
    )


def weight_matrix(
    module: nn.Module, *, where: str
) -> tuple[Float[Tensor, "out in"], ConvGeometry | None]:
    """The ``(out, in)`` weight matrix ``module`` multiplies by, and its conv geometry if any:
    an ``nn.Linear``'s weight, a Hugging Face ``Conv1D``'s transposed, an ``nn.Conv1d/2d/3d``'s
    flattened to ``(out, in/groups·k…)`` (a view when contiguous); ``where`` names the caller.

    Raises:
      TypeError: any other module, transposed convolutions included.

    Numerics: none; the module's own values, reshaped.
    """
    if isinstance(module, nn.Linear):
        return module.weight, None
    if isinstance(module, nn.modules.conv._ConvTransposeNd):
        raise TypeError(
            f"{where}: transposed convolutions ({type(module).__name__}) are not supported"
        )
    if isinstance(module, (nn.Conv1d, nn.Conv2d, nn.Conv3d)):
        weight = module.weight
        return weight.reshape(weight.shape[0], -1), conv_geometry(module)
    hf_conv1d = _hf_conv1d_type()
    if hf_conv1d is not None and isinstance(module, hf_conv1d):
        return module.weight.t(), None
    raise TypeError(
        f"{where}: expected nn.Linear, transformers' Conv1D or nn.Conv1d/2d/3d, got "
        f"{type(module).__name__}"
    )


def conv_forward(
    x: Float[Tensor, "..."],
    weight: Float[Tensor, "out ..."],
    bias: Float[Tensor, "out"] | None,  # noqa: F821
    geometry: ConvGeometry,
) -> Float[Tensor, "..."]:
    """The convolution of ``x`` by a decoded weight with the source module's geometry.

    Args:
      x: the input, as the source convolution takes it.
      weight: the decoded weight, flattened ``(out, in/groups·k…)`` or already reshaped.
      bias: ``(out,)`` in ``x.dtype``, or ``None``.
      geometry: the source module's :class:`ConvGeometry`.

    Returns:
      what the source module would return with ``weight`` and ``bias`` in place of its own
      (padding modes other than ``"zeros"`` pad explicitly first, as ``nn.Conv`` does).

    Numerics: torch's convolution in ``x.dtype``.
    """
    g = geometry
    conv = (F.conv1d, F.conv2d, F.conv3d)[g.dims - 1]
    weight = weight.reshape(g.weight_shape)
    if g.padding_mode != "zeros":
        padded = F.pad(x, g.reversed_padding_repeated_twice, mode=g.padding_mode)
        return conv(padded, weight, bias, g.stride, 0, g.dilation, g.groups)
    return conv(x, weight, bias, g.stride, g.padding, g.dilation, g.groups)


@functools.cache
def _hf_conv1d_type() -> type | None:
    try:
        from transformers.pytorch_utils import Conv1D
    except Exception:  # transformers missing or broken: no Conv1D to recognize
        return None
    return Conv1D
