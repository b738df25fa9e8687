"""The layer-by-layer driver of the calibrated weight lifecycles (NVFP4 GPTQ / W4A4, FP8 GSQ).

:func:`quantize_layerwise` runs a causal LM one decoder layer on the work device at a time, as
the GPTQ lifecycle does (:mod:`floatxq.lifecycle.gptq`):

1. the calibration batches go through the embeddings once and the first decoder layer's inputs
   are kept on the work device;
2. per layer, the selected linears are grouped by the input they read (q/k/v, o, gate/up, down);
   per group the layer runs over every batch up to that input and folds, over the unpadded rows,
   the statistics the caller asks for (none: no run);
3. each module is built by the caller from its original and the folded statistics, and a
   stand-in computing as the built module does replaces the original at once, so later groups
   and layers see the quantized outputs;
4. the layer runs again to give the next layer's inputs; the output embedding, when selected, is
   done last on the final norm's outputs.

Any exception (``KeyboardInterrupt`` included) puts every original module back, on the device it
lived on, before it propagates: the model is as it was. Each built module ends where its
original lived.
"""

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from floatxq.lifecycle.calibration import CalibrationSet
from floatxq.lifecycle.decoder import (
    LayerHooks,
    call_layer,
    capture_inputs,
    decoder_layers,
    device_of,
    features,
    final_norm,
    layer_output,
    move_outside,
    next_input,
    output_embedding,
    spill_inputs,
)
from floatxq.lifecycle.distributed import BatchFold, ProcessShare, share_calibration, spread
from floatxq.lifecycle.gptq import _finalized, _fold_group, _groups_by_input
from floatxq.stats import Statistic

__all__ = ["DecodedStandIn", "quantize_layerwise"]

Statistics = Callable[[list[str]], Mapping[str, Statistic]]
"""``statistics(group_names)``: the statistics one input group needs (keyed; may be empty)."""

Build = Callable[[str, nn.Module, Mapping[str, Any], "int | None"], tuple[nn.Module, Any]]
"""``build(name, original, folded, layer_index)``: the quantized module (on the work device) and
its report entry; ``layer_index`` is None for the output embedding."""


class DecodedStandIn(nn.Module):
    """A quantized module's stand-in while its layer still runs: its weight decoded once per
    input dtype (``packed.dequantize_weight(dtype=...)``), then ``F.linear`` with its bias in
    that dtype; ``prepare(x)`` (identity by default) transforms the input first, as the module
    does (activation quantization)."""

    def __init__(
        self, packed: nn.Module, prepare: Callable[[torch.Tensor], torch.Tensor] | None = None
    ) -> None:
        super().__init__()
        self.packed = packed
        self.prepare = prepare
        self.decoded: dict[torch.dtype, torch.Tensor] = {}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype not in self.decoded:
            self.decoded[x.dtype] = self.packed.dequantize_weight(dtype=x.dtype)
        if self.prepare is not None:
            x = self.prepare(x)
        bias = self.packed.bias
        return nn.functional.linear(
            x, self.decoded[x.dtype], None if bias is None else bias.to(x.dtype)
        )


def _states(statistics: Mapping[str, Statistic], k: int, device: torch.device) -> dict:
    return {key: s.init(k, device=device) if key == "hessian" else s.init(device=device)
            for key, s in statistics.items()}  # fmt: skip


def quantize_layerwise(
    model: nn.Module,
    names: list[str],
    calibration: CalibrationSet,
    *,
    device: torch.device,
    statistics: Statistics,
    build: Build,
    stand_in: Callable[[nn.Module], nn.Module],
    on_module: Callable[[str], None] | None = None,
    hooks: LayerHooks | None = None,
    activation_budget: int | None = None,
    process_group: Any = None,
) -> list[Any]:
    """Replace ``names`` (linears of ``model``'s decoder layers, and its output embedding) by
    ``build``'s modules, calibrated layer by layer; the reports in the order built. ``hooks``,
    ``activation_budget`` and ``process_group``: as
    :func:`~floatxq.lifecycle.gptq.quantize_gptq_model`'s ``hooks``, ``activation_budget`` and
    ``group``.

    Raises:
      ValueError: as ``build``; non-finite calibration activations (naming the modules).
    """
    layers_name, layers = decoder_layers(model)
    head = output_embedding(model)
    head_name = head[0] if head is not None and head[0] in names else None
    homes = {n: device_of(model.get_submodule(n)) for n in names}
    originals: dict[str, nn.Module] = {}
    reports: list[Any] = []
    skip = {id(layers)} | ({id(head[1])} if head is not None else set())
    home = {id(m): device_of(m) for m in layers}
    outside_home = device_of(
        model.get_submodule(layers_name.rsplit(".", 1)[0]) if "." in layers_name else model
    )
    was_training = model.training
    solved: dict[str, nn.Module] = {}  # a layer's modules while it runs on stand-ins
    share: ProcessShare | None = None

    def replace(name: str, module: nn.Module, folded: Mapping[str, Any], index: int | None) -> None:
        install(name, module, build(name, module, folded, index))

    def replace_all(
        group: list[tuple[str, nn.Module]], folded: Mapping[str, Any], index: int | None
    ) -> None:
        """``group``'s modules built (each once, sent to all, with a share), emptied as done."""
        if share is None or share.world == 1:
            while group:  # popped, so the replaced module is released once it is built
                name, module = group.pop(0)
                replace(name, module, folded, index)
                del module
            return
        members = list(group)
        group.clear()
        costs = [float(features(m)[0]) * features(m)[1] for _, m in members]
        results = spread(
            costs, lambda i: build(*members[i], folded, index), share, device
        )  # fmt: skip
        for (name, module), result in zip(members, results, strict=True):
            install(name, module, result)

    def install(name: str, module: nn.Module, result: tuple[nn.Module, Any]) -> None:
        built, report = result
        originals[name] = module
        solved[name] = built
        model.set_submodule(name, stand_in(built))
        reports.append(report)
        if on_module is not None:
            on_module(name)

    model.eval()
    try:
        with torch.no_grad():
            move_outside(model, skip, device)
            if hooks is not None:
                hooks.enter(0)
            layers[0].to(device)
            if process_group is not None:
                calibration, share = share_calibration(
                    calibration, process_group, where="quantize"
                )  # fmt: skip
            inputs = capture_inputs(model, layers[0], calibration, device)
            spill_inputs(inputs, activation_budget)
            move_outside(model, skip, outside_home)
            begin = 0 if hooks is None else hooks.start(inputs)
            for index, layer in enumerate(layers):
                if index < begin:
                    layer.to(home[id(layer)])
                    continue
                if hooks is not None:
                    hooks.enter(index)
                layer.to(device)
                prefix = f"{layers_name}.{index}."
                wanted = [(n, model.get_submodule(n)) for n in names if n.startswith(prefix)]
                groups = _groups_by_input(layer, wanted, inputs[0]) if wanted else []
                del wanted
                for group in groups:
                    group_names = [n for n, _ in group]
                    needed = statistics(group_names)
                    states = _states(needed, features(group[0][1])[0], device)
                    folded = (
                        _fold_group(layer, group[0][1], group_names, inputs, needed, states, share)
                        if needed
                        else {}
                    )
                    replace_all(group, folded, index)
                    del folded, states
                if index < len(layers) - 1 or head_name is not None:
                    for i, item in enumerate(inputs):
                        inputs[i] = next_input(item, layer_output(call_layer(layer, item)))
                for name, built in solved.items():
                    model.set_submodule(name, built)
                    originals[name].to(homes[name])  # kept for a rollback, off the work device
                solved.clear()
                if hooks is not None:
                    hooks.leave(index, inputs)
                layer.to(home[id(layer)])
            if head_name is not None and head is not None:
                _head(model, head, inputs, layers_name, device, outside_home, statistics,
                      replace_all, share)  # fmt: skip
                for name, built in solved.items():
                    model.set_submodule(name, built)
            del inputs
    except BaseException:
        for name, module in originals.items():
            model.set_submodule(name, module.to(homes[name]))
        raise
    finally:
        move_outside(model, skip, outside_home)
        for layer in layers:
            layer.to(home[id(layer)])
        model.train(was_training)
    for name in originals:  # each quantized module where its original lived
        model.get_submodule(name).to(homes[name])
    return reports


def _head(
    model: nn.Module,
    head: tuple[str, nn.Module],
    inputs: list,
    layers_name: str,
    device: torch.device,
    outside_home: torch.device,
    statistics: Statistics,
    replace_all: Callable[..., None],
    share: ProcessShare | None = None,
) -> None:
    """The output embedding, last, on the final norm's outputs (folded in batch order across
    the ``share``'s processes)."""
    name, module = head
    norm = final_norm(model, layers_name)
    if norm is not None:
        norm.to(device)
    module.to(device)
    needed = statistics([name])
    fold = BatchFold(needed, _states(needed, features(module)[0], device), share)
    for item in inputs:
        hidden = item.hidden.to(device)
        fold.add(norm(hidden) if norm is not None else hidden, mask=item.mask)
    folded = _finalized(needed, fold.states(), [name]) if needed else {}
    replace_all([(name, module)], folded, None)
    module.to(outside_home)
    if norm is not None:
        norm.to(outside_home)
