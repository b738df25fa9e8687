"""The FP8 weight-only lifecycle: which modules are quantized, and swapping them one at a time.

This is the only code that mutates a model for FP8: it walks the linear-like modules, resolves each
one's effective :class:`~floatxq.config.FP8Config` (dynamic ``+:``/``-:`` rules, ``lm_head``), and
replaces it by a :class:`~floatxq.nn.fp8_linear.TorchFP8Linear` built from its weight.
"""

import typing
from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import nn
from torch.nn.modules.conv import _ConvNd

from floatxq.config import FP8Config
from floatxq.interop.export_gptq import output_embedding_names
from floatxq.lifecycle.swap import swap_modules
from floatxq.nn.fp8_linear import TorchFP8Linear

try:  # transformers is a dependency, but keep the module importable without it
    from transformers.pytorch_utils import Conv1D as _HFConv1D
except ImportError:  # pragma: no cover
    _HFConv1D = None

LINEAR_TYPES: tuple[type, ...] = tuple(t for t in (nn.Linear, _HFConv1D, _ConvNd) if t is not None)


class Fp8Plan(NamedTuple):
    """One module's decision: quantize with ``config``, or skip with a reason."""

    name: str
    config: FP8Config | None
    reason: str | None


def plan_fp8(model: nn.Module, config: FP8Config) -> list[Fp8Plan]:
    """Decide, module by module, what the FP8 lifecycle does (nothing is changed).

    A module is a target when it is an ``nn.Linear``, a Hugging Face ``Conv1D`` or a convolution
    and not already quantized. The output embedding (``lm_head``) is skipped unless
    ``config.lm_head``; a ``-:`` dynamic rule excludes; ``+:`` rules override per module.

    Numerics: names only.
    """
    heads = output_embedding_names(model)
    plans = []
    for name, module in model.named_modules():
        if isinstance(module, TorchFP8Linear) or not isinstance(module, LINEAR_TYPES):
            continue
        if name in heads and not config.lm_head:
            plans.append(Fp8Plan(name, None, "output embedding (lm_head=False)"))
            continue
        resolved = config.resolve(name)
        if resolved is None:
            plans.append(Fp8Plan(name, None, "excluded by a '-:' dynamic rule"))
            continue
        plans.append(Fp8Plan(name, resolved, None))
    return plans


def _check_divisible(name: str, module: nn.Module, config: FP8Config) -> None:
    if config.weight_scale_method != "block" or config.weight_block_size is None:
        return
    weight = module.weight
    if isinstance(module, _ConvNd):
        rows, cols = weight.shape[0], weight[0].numel()
    elif _HFConv1D is not None and isinstance(module, _HFConv1D):
        cols, rows = weight.shape
    else:
        rows, cols = weight.shape
    br, bc = config.weight_block_size
    if rows % br or cols % bc:
        raise ValueError(
            f"quantize: module {name!r} weight ({rows}, {cols}) is not divisible by "
            f"weight_block_size {[br, bc]}; exclude it with a '-:' dynamic rule or pick a block "
            f"size that divides it"
        )


def quantize_fp8_modules(
    model: nn.Module,
    config: FP8Config,
    *,
    device: torch.device | None = None,
    on_module: Callable[[str], None] | None = None,
) -> list[str]:
    """Replace every planned module of ``model`` by a ``TorchFP8Linear``, one module at a time.

    Each module's weight is moved to ``device`` (when given) only while it is quantized, and the
    FP8 module stays there; other modules are untouched. Every target's shape is checked before
    the first one is changed, so a bad block size leaves the model as it was.

    Any exception during the swaps (``KeyboardInterrupt`` included) rolls back: every replaced
    module is put back (the same object, its tensors moved back to the devices they were on,
    so bit for bit) before the exception propagates. The originals are referenced until the
    run ends either way, so this costs no memory.

    Returns:
      the names of the quantized modules, in model order.

    Raises:
      ValueError: a target whose shape a block size does not divide; as
        :meth:`~floatxq.nn.fp8_linear.TorchFP8Linear.from_linear` (a bias outside FP16's range),
        naming the module.

    Numerics: each weight through :func:`floatxq.quantize_fp8_weight` (bit for bit).
    """
    plans = [p for p in plan_fp8(model, config) if p.config is not None]
    modules = dict(model.named_modules())
    for plan in plans:
        _check_divisible(plan.name, modules[plan.name], plan.config)  # type: ignore[arg-type]
    configs = {plan.name: typing.cast(FP8Config, plan.config) for plan in plans}

    def build(name: str, source: nn.Module) -> nn.Module:
        cfg = configs[name]
        return TorchFP8Linear.from_linear(
            source,
            format=cfg.format,
            weight_scale_method=cfg.weight_scale_method,
            weight_block_size=cfg.weight_block_size,
        )

    return swap_modules(model, list(configs), build, device=device, on_module=on_module)
