"""The FP8 weight-only lifecycle: which modules are quantized, and swapping them one at a time.

It walks the linear-like modules, resolves each one's effective
:class:`~floatxq.config.FP8Config` (dynamic ``+:``/``-:`` rules, ``lm_head``), and replaces it by a
:class:`~floatxq.nn.fp8_linear.TorchFP8Linear` built from its weight (:func:`fp8_module`: round
to nearest, then GSQ's refinement of the codes where the config's ``gsq`` selects the module).
Calibrated GSQ runs layer by layer in :mod:`floatxq.lifecycle.fp8_gsq` on these pieces.
"""

import time
import typing
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch import nn
from torch.nn.modules.conv import _ConvNd

from floatxq.config import FP8Config
from floatxq.dispatch import quantize_fp8_weight_auto, refine_fp8_codes_auto
from floatxq.interop.export_gptq import output_embedding_names
from floatxq.interop.lazy_source import _return_freed_memory
from floatxq.lifecycle.swap import swap_modules
from floatxq.nn.fp8_linear import TorchFP8Linear, _source_matrix

try:  # transformers is a dependency, but keep the module importable without it
    from transformers.pytorch_utils import Conv1D as _HFConv1D
except ImportError:  # pragma: no cover
    _HFConv1D = None

LINEAR_TYPES: tuple[type, ...] = tuple(t for t in (nn.Linear, _HFConv1D, _ConvNd) if t is not None)
LINEAR_ONLY: tuple[type, ...] = tuple(t for t in (nn.Linear, _HFConv1D) if t is not None)
"""The linear types without convolutions: those whose inputs give a Hessian."""


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


class GSQModuleReport(NamedTuple):
    """One module's refinement: its objective before and after (relative, as
    :func:`floatxq.gsq_objective`), the codes changed of all, and the seconds it took."""

    name: str
    layer: int | None
    calibrated: bool
    objective_before: float
    objective_after: float
    changed: int
    codes: int
    seconds: float


def fp8_module(
    name: str,
    module: nn.Module,
    config: FP8Config,
    *,
    hessian: torch.Tensor | None = None,
    layer: int | None = None,
    work_device: torch.device | None = None,
) -> tuple[TorchFP8Linear, GSQModuleReport | None]:
    """``module`` as a :class:`~floatxq.nn.fp8_linear.TorchFP8Linear` (on the module's device),
    its codes refined by GSQ when ``config.gsq`` selects ``name``, and the refinement's report.

    The baseline is :func:`floatxq.quantize_fp8_weight`'s (bit for bit); the refinement runs on
    ``work_device`` (default: the module's), weighted by ``hessian`` when given. The heap's free
    pages go back to the OS before it returns (``malloc_trim``): the freed temporaries of one
    module otherwise stay resident under the next ones (measured on a layer-by-layer FP8 run of
    a TinyLlama-shaped model: peaks of 0.83-0.87 GiB in half the runs, 0.78-0.80 GiB with it).

    Raises:
      ValueError, TypeError: as :meth:`TorchFP8Linear.from_linear` and
        :func:`floatxq.refine_fp8_codes`.
    """
    gsq = config.gsq
    if gsq is None or not gsq.selects(name):
        built = TorchFP8Linear.from_linear(
            module,
            format=config.format,
            weight_scale_method=config.weight_scale_method,
            weight_block_size=config.weight_block_size,
        )
        _return_freed_memory()
        return built, None
    start = time.perf_counter()
    matrix, conv = _source_matrix(module, where="quantize")
    home = matrix.device
    work = work_device or home
    weight = matrix.detach().to(work)
    q, _, _ = quantize_fp8_weight_auto(
        weight,
        format=config.format,
        weight_scale_method=config.weight_scale_method,
        weight_block_size=config.weight_block_size,
    )
    h = None if hessian is None else hessian.to(work)
    result = refine_fp8_codes_auto(weight, q.qweight, q.scale_inv, hessian=h, config=gsq)
    built = TorchFP8Linear.from_quantized(
        result.codes.to(home),
        q.scale_inv.to(home),
        getattr(module, "bias", None),
        weight_scale_method=config.weight_scale_method,
        weight_block_size=config.weight_block_size,
    )
    built.conv = conv
    report = GSQModuleReport(
        name,
        layer,
        hessian is not None,
        float(result.objective_before),
        float(result.objective_after),
        int(result.changed),
        result.codes.numel(),
        time.perf_counter() - start,
    )
    del weight, q, h, result
    _return_freed_memory()
    return built, report


def quantize_fp8_modules(
    model: nn.Module,
    config: FP8Config,
    *,
    device: torch.device | None = None,
    on_module: Callable[[str], None] | None = None,
    work_device: torch.device | None = None,
    reports: list[GSQModuleReport] | None = None,
    process_group: Any = None,
) -> list[str]:
    """Replace every planned module of ``model`` by a ``TorchFP8Linear``, one module at a time.

    With ``config.gsq``, each module it selects has its codes refined weight-only
    (:func:`fp8_module`, on ``work_device``), its report appended to ``reports``.

    Each module's weight is moved to ``device`` (when given) only while it is quantized, and the
    FP8 module stays there; other modules are untouched. Every target's shape is checked before
    the first one is changed, so a bad block size leaves the model as it was.

    With a ``torch.distributed`` ``process_group``, each module is built by one process
    (balanced by ``out·in``, times GSQ's candidates and steps) and sent to all: every process
    ends with the one-process model, ``reports`` and ``on_module`` calls, bit for bit.

    Any exception during the swaps (``KeyboardInterrupt`` included) rolls back: every replaced
    module is put back (the same object, its tensors moved back to the devices they were on,
    so bit for bit) before the exception propagates. The originals are referenced until the
    run ends either way, so this costs no memory. A build that fails on its process fails on
    every process of a group (the same type and message), and each rolls back.

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
    names = list(configs)
    costs = [_build_cost(n, modules[n], configs[n]) for n in names]
    places = [device or modules[n].weight.device for n in names]
    del modules

    def build(name: str, source: nn.Module) -> tuple[nn.Module, GSQModuleReport | None]:
        return fp8_module(name, source, configs[name], work_device=work_device)

    return swap_modules(
        model, names, build, device=device, on_module=on_module,
        reports=reports if reports is not None else [], process_group=process_group,
        costs=costs, places=places,
    )  # fmt: skip


def _build_cost(name: str, module: nn.Module, config: FP8Config) -> float:
    """``module``'s weight size, times GSQ's candidates and steps where it refines ``name``."""
    size = float(module.weight.numel())
    gsq = config.gsq
    return size * gsq.candidates * gsq.steps if gsq is not None and gsq.selects(name) else size
