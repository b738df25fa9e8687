"""FP8 with GSQ: round to nearest, then the codes re-chosen on the storage grid (scales frozen).

:class:`~floatxq.config.FP8Config` with ``gsq=GSQConfig()`` refines every module the GSQ config
selects (:meth:`~floatxq.config.GSQConfig.selects`) with :func:`floatxq.refine_fp8_codes`:

* weight-only (the default): the objective is the plain reconstruction error, module by module,
  no data (:func:`fp8_module`, called by :func:`floatxq.lifecycle.fp8.quantize_fp8_modules`);
* ``gsq_calibration=True``: the error weighted by each module's calibration Hessian, collected
  layer by layer with GPTQ's fold (:func:`quantize_fp8_calibrated`, through
  :func:`floatxq.lifecycle.layerwise.quantize_layerwise`): one decoder layer on the work device
  at a time, each module replaced by its FP8 module as soon as it is refined, so the next
  modules and layers see the quantized outputs. Targets outside the decoder layers (other than
  the output embedding) are refined weight-only.

Each refined module gets a :class:`GSQModuleReport`; the run a :class:`FP8RunReport`.
"""

import time
import typing
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import torch
from torch import nn

from floatxq.config import FP8Config
from floatxq.lifecycle.calibration import CalibrationSet
from floatxq.lifecycle.decoder import LayerHooks, decoder_layers, device_of, output_embedding
from floatxq.lifecycle.fp8 import (
    LINEAR_ONLY,
    GSQModuleReport,
    _check_divisible,
    fp8_module,
    plan_fp8,
)
from floatxq.lifecycle.layerwise import DecodedStandIn, quantize_layerwise
from floatxq.lifecycle.swap import swap_modules
from floatxq.stats import HESSIAN, Statistic

__all__ = ["FP8RunReport", "quantize_fp8_calibrated"]


class FP8RunReport(NamedTuple):
    """What an FP8 run with GSQ did: a report per refined module; ``layers``, ``samples`` and
    ``tokens`` of the calibration (0 weight-only)."""

    modules: tuple[GSQModuleReport, ...]
    layers: int
    samples: int
    tokens: int
    seconds: float


def quantize_fp8_calibrated(
    model: nn.Module,
    config: FP8Config,
    calibration: CalibrationSet,
    *,
    device: torch.device,
    on_module: Callable[[str], None] | None = None,
    hooks: LayerHooks | None = None,
    activation_budget: int | None = None,
    process_group: Any = None,
) -> FP8RunReport:
    """Quantize ``model``'s planned linears to FP8 in place, GSQ weighted by calibration
    Hessians layer by layer (``config.gsq_calibration``).

    Args:
      model: a Hugging Face causal LM (decoder layers in an ``nn.ModuleList``), in eval mode.
      config: the :class:`~floatxq.config.FP8Config` (rules resolved per module).
      calibration: prepared batches (:func:`~floatxq.lifecycle.calibration.prepare_calibration`).
      device: the work device (one decoder layer, its Hessians and the activations at a time);
        each FP8 module is moved back to where its original lived.
      on_module: called with each module's name once it is quantized.
      hooks, activation_budget: as :func:`~floatxq.lifecycle.gptq.quantize_gptq_model`'s.
      process_group: processes sharing the batches (its ``group``).

    Returns:
      :class:`FP8RunReport` (a report per refined module).

    Raises:
      ValueError: a block size that does not divide a target (before any change); a target that
        is a convolution inside the decoder layers (calibrated GSQ covers linears); non-finite
        calibration activations; as :func:`floatxq.refine_fp8_codes`.

    Numerics: baselines as :func:`floatxq.quantize_fp8_weight`; Hessians ``2/N Σ xᵀx`` over the
    unpadded rows in FP32; refinement as :func:`floatxq.refine_fp8_codes` (FP64).
    """
    start = time.perf_counter()
    plans = [p for p in plan_fp8(model, config) if p.config is not None]
    targets = {p.name: typing.cast(FP8Config, p.config) for p in plans}
    for name, cfg in targets.items():
        _check_divisible(name, model.get_submodule(name), cfg)
    layers_name, layers = decoder_layers(model)
    head = output_embedding(model)
    inside = {
        n for n in targets if n.startswith(f"{layers_name}.") or (head is not None and n == head[0])
    }
    for name in sorted(inside):
        if not isinstance(model.get_submodule(name), LINEAR_ONLY):
            raise ValueError(
                f"quantize: module {name!r} is a {type(model.get_submodule(name)).__name__}; "
                f"calibrated GSQ refines linears (their inputs give the Hessian); exclude it "
                f"with a '-:' dynamic rule or from GSQConfig.modules"
            )

    def statistics(group: list[str]) -> Mapping[str, Statistic]:
        gsq = config.gsq
        return {"hessian": HESSIAN} if gsq is not None and any(map(gsq.selects, group)) else {}

    def build(name: str, module: nn.Module, folded: Mapping[str, Any], layer: int | None) -> tuple:
        cfg = targets[name]
        built, report = fp8_module(
            name, module, cfg, hessian=folded.get("hessian"), layer=layer, work_device=device
        )
        return built.to(device), report

    reports: list[GSQModuleReport | None] = []
    rest = [n for n in targets if n not in inside]  # outside the decoder layers: weight-only
    originals = {n: (model.get_submodule(n), device_of(model.get_submodule(n))) for n in rest}

    def build_rest(name: str, source: nn.Module) -> nn.Module:
        built, report = fp8_module(name, source, targets[name], work_device=device)
        reports.append(report)
        return built

    swap_modules(model, rest, build_rest, on_module=on_module)
    try:
        reports += quantize_layerwise(
            model, [n for n in targets if n in inside], calibration, device=device,
            statistics=statistics, build=build, stand_in=DecodedStandIn, on_module=on_module,
            hooks=hooks,
            activation_budget=activation_budget,
            process_group=process_group,
        )  # fmt: skip
    except BaseException:
        for name, (module, home) in originals.items():
            model.set_submodule(name, module.to(home))
        raise
    return FP8RunReport(
        tuple(r for r in reports if r is not None), len(layers), calibration.samples,
        calibration.tokens, time.perf_counter() - start,
    )  # fmt: skip
