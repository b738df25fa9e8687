"""The calibrated NVFP4 lifecycle: GPTQ onto the NVFP4 grid and W4A4 input scales, layer by layer.

:func:`quantize_nvfp4_calibrated` runs when an :class:`~floatxq.config.NVFP4Config` asks for
``method="gptq"`` or ``activations="nvfp4"`` (for any module); RTN weight-only needs no data and
goes through :func:`floatxq.lifecycle.nvfp4.quantize_nvfp4_modules` instead. The order is the
GPTQ lifecycle's (:mod:`floatxq.lifecycle.gptq`), one decoder layer on the work device at a time:

1. each weight's FP32 global scale is fixed first, from the original weights, exactly as RTN
   fixes it (the module's own amax or the fused siblings', moved to a value whose reciprocal
   round-trips: :func:`~floatxq.lifecycle.nvfp4.round_trip_scale`);
2. the calibration batches go through the embeddings once and the first decoder layer's inputs
   are kept on the work device;
3. per layer, the selected linears are grouped by the input they read (q/k/v, o, gate/up, down);
   per group the layer runs over every batch up to that input and folds, over the unpadded rows,
   :data:`floatxq.stats.HESSIAN` (when a module of the group uses ``gptq``) and
   :data:`floatxq.stats.RUNNING_AMAX` (when one quantizes its activations);
4. each module becomes a :class:`~floatxq.nn.fp4_linear.TorchFP4Linear`: codes from
   :func:`floatxq.nvfp4_gptq_solve` (``gptq``, through
   :func:`floatxq.dispatch.nvfp4_gptq_solve_auto`: the Triton block kernel on CUDA, the same
   bytes; the recipe's block scales, never a higher Hessian loss than round to nearest at those
   scales) or :func:`floatxq.nvfp4_quantize` (``rtn``), and for W4A4 the input scale
   ``round_trip_scale(nvfp4_global_scale(amax, recipe="nvidia"))`` of the group's input. It
   replaces the original at once, so later groups and layers see the quantized outputs
   (activation quantization included);
5. the layer runs again to give the next layer's inputs; with ``lm_head=True`` the output
   embedding is done last, on the final norm's outputs.

Any exception (``KeyboardInterrupt`` included) puts every original module back, on the device it
lived on, before it propagates: the model is as it was.
"""

import time
import typing
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch import nn

from floatxq import dispatch
from floatxq.config import NVFP4Config
from floatxq.dispatch.nvfp4_gptq import nvfp4_gptq_solve_auto
from floatxq.kernels.nvfp4_qdq import nvfp4_activation_qdq
from floatxq.lifecycle.calibration import CalibrationSet
from floatxq.lifecycle.decoder import LayerHooks, decoder_layers
from floatxq.lifecycle.gptq import _dense_weight
from floatxq.lifecycle.layerwise import DecodedStandIn, quantize_layerwise
from floatxq.lifecycle.nvfp4 import _own_amax, fused_amax, plan_nvfp4, round_trip_scale
from floatxq.nn.fp4_linear import TorchFP4Linear
from floatxq.nvfp4.layouts import NVFP4Weight
from floatxq.nvfp4.quantize import nvfp4_global_scale, nvfp4_quantize
from floatxq.stats import HESSIAN, RUNNING_AMAX, Statistic

__all__ = ["NVFP4ModuleReport", "NVFP4RunReport", "quantize_nvfp4_calibrated"]

ACTIVATION_RECIPE = "nvidia"
"""The block-scale recipe of W4A4 activations: serving engines quantize them with max/6."""


class NVFP4ModuleReport(NamedTuple):
    """One quantized module: its settings, Hessian losses (``gptq`` only, per calibration row:
    ``loss`` of the chosen codes, ``rtn_loss`` of round to nearest at the same scales) and input
    scale (W4A4 only)."""

    name: str
    layer: int | None
    method: str
    recipe: str
    loss: float | None
    rtn_loss: float | None
    input_scale: float | None
    seconds: float


class NVFP4RunReport(NamedTuple):
    """What :func:`quantize_nvfp4_calibrated` did."""

    modules: tuple[NVFP4ModuleReport, ...]
    layers: int
    samples: int
    tokens: int
    seconds: float


def _activation_prepare(packed: TorchFP4Linear) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """W4A4: the activations through :func:`~floatxq.kernels.nvfp4_qdq.nvfp4_activation_qdq` at
    the input scale, on the route :func:`floatxq.dispatch.fp4_w4a4_route` gives (the same bytes
    as :func:`floatxq.nvfp4_block_qdq`), as the module computes them."""
    scale = getattr(packed, "input_scale", None)
    if scale is None:
        return None

    def prepare(x: torch.Tensor) -> torch.Tensor:
        route, _ = dispatch.fp4_w4a4_route(x.device, x.dtype, x.shape[-1])
        return nvfp4_activation_qdq(x, scale, triton=route == "w4a4_triton")

    return prepare


def _stand_in(packed: nn.Module) -> nn.Module:
    """A module's stand-in while its layer still runs: the same forward as the
    :class:`~floatxq.nn.fp4_linear.TorchFP4Linear`, the weight decoded once per dtype."""
    assert isinstance(packed, TorchFP4Linear)
    return DecodedStandIn(packed, _activation_prepare(packed))


def _statistics(configs: list[NVFP4Config]) -> dict[str, Statistic]:
    """The statistics one input group needs."""
    statistics: dict[str, Statistic] = {}
    if any(c.method == "gptq" for c in configs):
        statistics["hessian"] = HESSIAN
    if any(c.activations is not None for c in configs):
        statistics["amax"] = RUNNING_AMAX
    return statistics


def _build(
    name: str,
    module: nn.Module,
    config: NVFP4Config,
    weight_scale: torch.Tensor,
    folded: dict[str, Any],
    rows: int,
    layer: int | None,
    device: torch.device,
) -> tuple[TorchFP4Linear, NVFP4ModuleReport]:
    """One module's ``TorchFP4Linear`` (on ``device``) and report."""
    start = time.perf_counter()
    dtype = module.weight.dtype
    if dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise TypeError(
            f"quantize: module {name!r}: the weight must be float16, bfloat16 or float32 to "
            f"quantize to NVFP4, got {dtype}"
        )
    weight = _dense_weight(module, device)
    g = weight_scale.to(device)
    loss = rtn_loss = None
    if config.method == "gptq":
        solution = nvfp4_gptq_solve_auto(  # the Triton block solve on CUDA, same bytes
            weight, folded["hessian"], g, recipe=config.recipe, damp_percent=config.damp_percent
        )
        packed = NVFP4Weight(solution.packed, solution.block_scales, solution.global_scale)
        loss = float(solution.loss) / max(rows, 1)
        rtn_loss = float(solution.rtn_loss) / max(rows, 1)
    else:
        packed = NVFP4Weight(*nvfp4_quantize(weight, g, config.recipe))
    del weight
    input_scale = None
    if config.activations is not None:
        amax = folded["amax"].to(device)
        input_scale = round_trip_scale(nvfp4_global_scale(amax, recipe=ACTIVATION_RECIPE))
    bias = getattr(module, "bias", None)
    bias = None if bias is None else bias.detach().to(device)
    built = TorchFP4Linear.from_nvfp4(packed, bias, dtype=dtype, input_scale=input_scale)
    scale = None if input_scale is None else float(input_scale)
    report = NVFP4ModuleReport(
        name, layer, config.method, config.recipe, loss, rtn_loss, scale,
        time.perf_counter() - start,
    )  # fmt: skip
    return built, report


def quantize_nvfp4_calibrated(
    model: nn.Module,
    config: NVFP4Config,
    calibration: CalibrationSet,
    *,
    device: torch.device,
    on_module: Callable[[str], None] | None = None,
    hooks: LayerHooks | None = None,
    activation_budget: int | None = None,
    amax: dict[str, torch.Tensor] | None = None,
    process_group: Any = None,
) -> NVFP4RunReport:
    """Quantize ``model``'s planned linears to NVFP4 in place, calibrated layer by layer.

    Args:
      model: a Hugging Face causal LM (decoder layers in an ``nn.ModuleList``), in eval mode.
      config: the :class:`~floatxq.config.NVFP4Config` (rules resolved per module).
      calibration: prepared batches (:func:`~floatxq.lifecycle.calibration.prepare_calibration`).
      device: the work device (one decoder layer, its statistics and the activations at a time);
        each NVFP4 module is moved back to where its original lived.
      on_module: called with each module's name once it is quantized.
      hooks, activation_budget: as :func:`~floatxq.lifecycle.gptq.quantize_gptq_model`'s.
      process_group: processes sharing the batches (its ``group``).
      amax: each planned weight's ``max|W|`` (its fused siblings' under ``"fused"``), read
        before when the layers are not held (None: from the model).

    Returns:
      :class:`NVFP4RunReport`.

    Raises:
      ValueError: as :func:`~floatxq.lifecycle.nvfp4.plan_nvfp4` and before any change, a
        non-finite weight (naming it); non-finite calibration activations or a module no batch
        reaches (naming them); as :func:`floatxq.nvfp4_gptq_solve`.
      TypeError: a weight dtype other than float16, bfloat16 or float32, naming the module.

    Numerics: as the module docstring; Hessians ``2/N Σ xᵀx`` over the unpadded rows in FP32.
    """
    plans = [p for p in plan_nvfp4(model, config) if p.config is not None]
    targets = {p.name: typing.cast(NVFP4Config, p.config) for p in plans}
    names = list(targets)
    if amax is None:
        fused = config.global_scale == "fused"
        amax = fused_amax(model, names) if fused else _own_amax(model, names)
    weight_scales = {
        n: round_trip_scale(nvfp4_global_scale(amax[n], recipe=targets[n].recipe)) for n in names
    }
    rows = calibration.tokens
    start = time.perf_counter()

    def build(name: str, module: nn.Module, folded: Any, layer: int | None) -> tuple:
        return _build(name, module, targets[name], weight_scales[name], folded, rows, layer, device)

    reports = quantize_layerwise(
        model, names, calibration, device=device,
        statistics=lambda group: _statistics([targets[n] for n in group]),
        build=build, stand_in=_stand_in, on_module=on_module, hooks=hooks,
        activation_budget=activation_budget,
        process_group=process_group,
    )  # fmt: skip
    layers = len(decoder_layers(model)[1])
    return NVFP4RunReport(
        tuple(reports), layers, calibration.samples, calibration.tokens,
        time.perf_counter() - start,
    )  # fmt: skip
