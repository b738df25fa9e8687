"""The NVFP4 weight-only lifecycle (NVFP4A16): which linears are quantized, their global scales,
and swapping them one at a time for :class:`~floatxq.nn.fp4_linear.TorchFP4Linear`.

Round to nearest on the recipe's grid: each weight becomes ``nvfp4_quantize(W, g, recipe)``
with ``g = nvfp4_global_scale(amax, recipe)``, where ``amax`` is the weight's own largest
magnitude (``global_scale="module"``) or the largest of the sibling projections a serving
engine fuses into one GEMM (``"fused"``: ``q_proj``/``k_proj``/``v_proj`` and
``gate_proj``/``up_proj`` of one parent module), so the fused weight has one global scale.

The global scale is then moved (by at most an FP32 ulp or two, rarely) to the nearest value whose
reciprocal round-trips, ``fl(1/fl(1/g)) = g``: compressed-tensors stores ``1/g``, and only such
a ``g`` reads back bit for bit.
"""

import typing
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch import nn

from floatxq.config import NVFP4Config
from floatxq.formats import NVFP4_BLOCK
from floatxq.fp8 import fp32_reciprocal
from floatxq.interop.export_gptq import output_embedding_names
from floatxq.lifecycle.swap import swap_modules
from floatxq.nn.fp4_linear import TorchFP4Linear
from floatxq.nvfp4.layouts import NVFP4Weight
from floatxq.nvfp4.quantize import nvfp4_global_scale, nvfp4_quantize

__all__ = [
    "FUSED_SIBLINGS",
    "Nvfp4Plan",
    "fused_amax",
    "plan_nvfp4",
    "quantize_nvfp4_modules",
    "round_trip_scale",
]

FUSED_SIBLINGS: tuple[tuple[str, ...], ...] = (("q_proj", "k_proj", "v_proj"),
                                                ("gate_proj", "up_proj"))  # fmt: skip
"""Sibling projections (last name parts under one parent) that share a global scale with
``global_scale="fused"``."""


class Nvfp4Plan(NamedTuple):
    """One module's decision: quantize with ``config``, or skip with a reason."""

    name: str
    config: NVFP4Config | None
    reason: str | None


def plan_nvfp4(model: nn.Module, config: NVFP4Config) -> list[Nvfp4Plan]:
    """Decide, module by module, what the NVFP4 lifecycle does (nothing is changed).

    Targets are the ``nn.Linear`` modules. The output embedding is skipped unless
    ``config.lm_head``; a ``-:`` dynamic rule excludes; ``+:`` rules override per module.

    Raises:
      ValueError: a target whose ``in_features`` is not a multiple of 16 (the NVFP4 block),
        naming it and how to exclude it.

    Numerics: names only.
    """
    heads = output_embedding_names(model)
    plans = []
    for name, module in model.named_modules():
        if not isinstance(module, nn.Linear) or isinstance(module, TorchFP4Linear):
            continue
        if name in heads and not config.lm_head:
            plans.append(Nvfp4Plan(name, None, "output embedding (lm_head=False)"))
            continue
        resolved = config.resolve(name)
        if resolved is None:
            plans.append(Nvfp4Plan(name, None, "excluded by a '-:' dynamic rule"))
            continue
        if module.in_features % NVFP4_BLOCK:
            raise ValueError(
                f"quantize: module {name!r} has in_features={module.in_features}, not a multiple "
                f"of the NVFP4 block ({NVFP4_BLOCK}); exclude it with a '-:' dynamic rule"
            )
        plans.append(Nvfp4Plan(name, resolved, None))
    return plans


def _own_amax(model: nn.Module, names: list[str]) -> dict[str, torch.Tensor]:
    """Each module's ``max|W|`` (FP32, on the CPU), every weight checked finite first."""
    modules, found = dict(model.named_modules()), {}
    for name in names:
        weight = modules[name].weight.detach()
        if not torch.isfinite(weight).all():
            raise ValueError(f"quantize: module {name!r}: the weight holds NaN or infinity")
        found[name] = weight.abs().amax().float().cpu() if weight.numel() else torch.zeros(())
    return found


def fused_amax(model: nn.Module, names: list[str]) -> dict[str, torch.Tensor]:
    """Each of ``names``' shared amax under ``global_scale="fused"``: the largest ``|W|`` among
    its :data:`FUSED_SIBLINGS` group in ``names`` (its own where it has no planned sibling).

    Raises:
      ValueError: a weight with NaN or infinity, naming the module.

    Numerics: exact (maxima of magnitudes, in FP32 on the CPU).
    """
    own = _own_amax(model, names)
    shared = dict(own)
    for name in names:
        parent, _, leaf = name.rpartition(".")
        group = next((g for g in FUSED_SIBLINGS if leaf in g), None)
        if group is None:
            continue
        siblings = [f"{parent}.{s}" if parent else s for s in group]
        shared[name] = torch.stack([own[s] for s in siblings if s in own]).amax()
    return shared


def quantize_nvfp4_modules(
    model: nn.Module,
    config: NVFP4Config,
    *,
    device: torch.device | None = None,
    work_device: torch.device | None = None,
    on_module: Callable[[str], None] | None = None,
    process_group: Any = None,
) -> list[str]:
    """Replace every planned linear of ``model`` by a ``TorchFP4Linear``, one at a time.

    Each weight moves to ``device`` (when given, else ``work_device`` when given) only while it
    is quantized; the NVFP4 module stays on ``device``, or goes back where the weight lived.
    Any exception during the swaps (``KeyboardInterrupt`` included) puts every replaced module
    back, its tensors on the devices they were on, before it propagates.

    With a ``torch.distributed`` ``process_group`` of several processes, each linear is built
    by one of them (balanced by ``out·in``) and sent to all, so every process ends with the
    one-process model bit for bit and ``on_module`` called for every module; a build that fails
    fails on every process (the same type and message), and each puts its modules back. The
    global scales need no messages: every process computes the same maxima from its own copy of
    the weights.

    Returns:
      the names of the quantized modules, in model order.

    Raises:
      ValueError: as :func:`plan_nvfp4`; a non-finite weight (before any module is changed);
        as :meth:`~floatxq.nn.fp4_linear.TorchFP4Linear.from_nvfp4`, naming the module.
      TypeError: a weight dtype other than float16, bfloat16 or float32, naming the module.

    Numerics: each weight's bytes are ``nvfp4_quantize(W, nvfp4_global_scale(amax, recipe),
    recipe)`` (bit for bit), ``amax`` as the module docstring says.
    """
    plans = [p for p in plan_nvfp4(model, config) if p.config is not None]
    names = [p.name for p in plans]
    amax = fused_amax(model, names) if config.global_scale == "fused" else _own_amax(model, names)
    recipes = {p.name: typing.cast(NVFP4Config, p.config).recipe for p in plans}
    modules = dict(model.named_modules())
    homes = {n: device or modules[n].weight.device for n in names}
    costs = [float(modules[n].weight.numel()) for n in names]
    del modules

    def build(name: str, source: nn.Module) -> nn.Module:
        return _quantized(source, amax[name], recipes[name]).to(homes[name])

    work = device if device is not None else work_device
    return swap_modules(
        model, names, build, device=work, on_module=on_module, process_group=process_group,
        costs=costs, places=[homes[n] for n in names],
    )  # fmt: skip


def _quantized(linear: nn.Module, amax: torch.Tensor, recipe: str) -> TorchFP4Linear:
    weight = linear.weight.detach()
    if weight.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise TypeError(
            f"the weight must be float16, bfloat16 or float32 to quantize to NVFP4, got "
            f"{weight.dtype}"
        )
    g = round_trip_scale(nvfp4_global_scale(amax, recipe=recipe)).to(weight.device)
    q = nvfp4_quantize(weight, g, recipe)
    return TorchFP4Linear.from_nvfp4(NVFP4Weight(*q), linear.bias, dtype=weight.dtype)


def round_trip_scale(g: torch.Tensor) -> torch.Tensor:
    """``g`` (FP32) moved to a value whose reciprocal round-trips: ``fl(1/fl(1/g)) = g``, the
    scale a compressed-tensors file (which stores ``fl(1/g)``) reads back unchanged. Iterates
    ``g ← fl(1/fl(1/g))`` (a step moves at most an ulp); a power of two, exact both ways, if
    that has not settled after 8 steps.

    Numerics: exact IEEE divisions; the result is within a few FP32 ulps of ``g``.
    """
    g = g.float()
    for _ in range(8):
        back = fp32_reciprocal(fp32_reciprocal(g))
        if torch.equal(back, g):
            return g
        g = back
    return torch.exp2(torch.round(torch.log2(g)))
