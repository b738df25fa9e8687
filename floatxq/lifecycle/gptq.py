"""The GPTQ lifecycle: calibrated, layer by layer, one decoder layer on the accelerator at a time.

:func:`quantize_gptq_model` runs GPT-QModel's order on a Hugging Face causal LM:

1. the calibration batches (:mod:`floatxq.lifecycle.calibration`) go through the embeddings once,
   and the first decoder layer's inputs (hidden states and the keyword arguments the model passes
   it) are captured on the work device;
2. per decoder layer, moved to the work device alone: the selected linears are grouped by the
   input they read (in call order: q/k/v, o, gate/up, down in a Llama layer); per group the layer
   runs over every batch up to that input, and :data:`floatxq.stats.HESSIAN` is folded over the
   unpadded rows (:func:`floatxq.stats.fold_all`); each module is solved with
   :func:`floatxq.gptq_solve` on its own resolved settings and replaced by a
   :class:`~floatxq.nn.gptq_linear.GPTQLinear`, so later groups see earlier quantized outputs;
3. the layer runs again with its quantized modules, its outputs feed the next layer, and it goes
   back to where it lived (CPU), its Hessians freed;
4. with ``lm_head=True``, the output embedding is solved last, on the final norm's outputs.

With an activation policy (``config.activation``, a Llama model) each layer whose seven
projections are all targets is solved through the W4A stream's replay
(:mod:`floatxq.lifecycle.gptq_replay`): every GEMM operand rounded as the runtime stream rounds
it, a headroom pass per group freezing its global scale first under a headroom recipe. The run
reports each solved module's activation global scale (:attr:`GPTQRunReport.activation_scales`);
installing the W4A modules and stream is :mod:`floatxq.lifecycle.model`'s.

Sources already quantized (``TorchFP8Linear`` / ``TorchFP4Linear``) run their own forward for the
capture and are decoded one module at a time, in FP32, only for their solve.
"""

import contextlib
import time
import types
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import torch
from torch import nn

from floatxq.config import GPTQConfig
from floatxq.gptq.solve import GPTQSolveOptions, gptq_solve
from floatxq.lifecycle.calibration import CalibrationSet
from floatxq.lifecycle.decoder import (
    FINAL_NORM_NAMES,
    LayerHooks,
    LayerInput,
    Stop,
    call_layer,
    capture_inputs,
    decoder_layers,
    device_of,
    features,
    final_norm,
    kept_rows,
    layer_output,
    move_outside,
    next_input,
    output_embedding,
    spill_inputs,
)
from floatxq.lifecycle.distributed import (
    BatchFold,
    ProcessShare,
    gather_rows,
    row_share,
    share_calibration,
    spread,
)
from floatxq.lifecycle.gptq_replay import replay_outputs, replay_setup, replay_solve
from floatxq.lifecycle.replay import RoundingMemo
from floatxq.stats import HESSIAN, Statistic, finalize_all

PACKABLE_BITS: tuple[int, ...] = (2, 4, 8)
"""Bit widths a GPTQ checkpoint packs (32/bits values per int32 word)."""


def gptq_solve_options(config: GPTQConfig) -> GPTQSolveOptions:
    """The solver options of one module's settings (``config.resolve(module_name)``).

    Raises:
      TypeError: ``config`` is not a :class:`~floatxq.config.GPTQConfig`.
      ValueError: ``config`` still has ``dynamic`` rules (resolve them for a module first).

    Numerics: names only; the solver is described in ``docs/numerics.md``.

    Example:
      >>> cfg = GPTQConfig(bits=3, dynamic={r".*down_proj": {"bits": 8}})
      >>> gptq_solve_options(cfg.resolve("model.layers.0.mlp.down_proj")).bits
      8
    """
    if not isinstance(config, GPTQConfig):
        raise TypeError(f"config: expected a GPTQConfig, got {type(config).__name__}")
    if config.dynamic is not None:
        raise ValueError(
            f"config: has {len(config.dynamic)} dynamic rule(s), so its settings differ by "
            f"module; pass config.resolve(module_name) for the module being solved"
        )
    return GPTQSolveOptions(
        bits=config.bits,
        group_size=config.group_size,
        sym=config.sym,
        desc_act=config.desc_act,
        static_groups=config.static_groups,
        act_group_aware=config.act_group_aware,
        damp_percent=config.damp_percent,
        damp_auto_increment=config.damp_auto_increment,
        mse=config.mse,
    )


# ----------------------------------------------------------------------------------------------
# Plan
# ----------------------------------------------------------------------------------------------


class GptqPlan(NamedTuple):
    """One module's decision: solve with ``config`` (resolved), or skip with a reason."""

    name: str
    layer: int | None
    """Index of its decoder layer; None for the output embedding."""
    config: GPTQConfig | None
    reason: str | None


class GPTQModuleReport(NamedTuple):
    """What the solve of one module did."""

    name: str
    layer: int | None
    bits: int
    group_size: int
    rows: int
    """Calibration rows (unpadded tokens) folded into its Hessian."""
    loss: float
    """GPT-QModel's ``avg_loss``: the solution's Hessian-weighted error divided by ``rows``."""
    damp: float
    """The ``damp_percent`` that made its Hessian invertible."""
    seconds: float
    """Wall time of its solve and packing."""

    def to_dict(self) -> dict[str, Any]:
        """The report as a JSON-ready dict: each field's name and value."""
        return dict(self._asdict())


class GPTQRunReport(NamedTuple):
    """A whole GPTQ run: every module's report and the calibration it used."""

    modules: tuple[GPTQModuleReport, ...]
    layers: int
    samples: int
    dropped: int
    tokens: int
    seconds: float
    activation_scales: Mapping[str, float] = types.MappingProxyType({})
    """With an activation policy: each solved module's FP32 activation global scale (the
    headroom calibration's, or ``nvfp4_global_scale`` of its inputs' running ``max|x|``); 0.0
    where its inputs are FP8. Empty without a policy."""

    def to_dict(self) -> dict[str, Any]:
        """The run as a JSON-ready dict: ``modules`` (each module's
        :meth:`GPTQModuleReport.to_dict`, per-module losses included), the run's counts and
        ``activation_scales`` as a dict."""
        out = dict(self._asdict())
        out["modules"] = [m.to_dict() for m in self.modules]
        out["activation_scales"] = dict(self.activation_scales)
        return out


def _target_types() -> tuple[type, ...]:
    from floatxq.nn.fp4_linear import TorchFP4Linear
    from floatxq.nn.fp8_linear import TorchFP8Linear

    kinds: list[type] = [nn.Linear, TorchFP8Linear, TorchFP4Linear]
    with contextlib.suppress(ImportError):
        from transformers.pytorch_utils import Conv1D

        kinds.append(Conv1D)
    return tuple(kinds)


def _check_target(name: str, module: nn.Module, config: GPTQConfig) -> None:
    k, n = features(module)
    if config.bits not in PACKABLE_BITS:
        raise ValueError(
            f"GPTQ: module {name!r} resolves to bits={config.bits}, which no GPTQ checkpoint "
            f"packs; accepted: {list(PACKABLE_BITS)} (use a dynamic rule to change it)"
        )
    if config.group_size != -1 and k % config.group_size:
        raise ValueError(
            f"GPTQ: module {name!r} has in_features={k}, which group_size={config.group_size} "
            f"does not divide; pick a group size that divides it, use -1, or exclude the module "
            f"with a '-:' dynamic rule"
        )
    per_word = 32 // config.bits
    if k % per_word or n % per_word:
        raise ValueError(
            f"GPTQ: module {name!r} is ({n}, {k}) (out, in); {config.bits}-bit packing needs both "
            f"to be multiples of {per_word}; exclude it with a '-:' dynamic rule"
        )


def plan_gptq(model: nn.Module, config: GPTQConfig) -> list[GptqPlan]:
    """Decide, module by module, what the GPTQ lifecycle does, checking every target first.

    Targets are the linear-like modules inside the decoder layers (``nn.Linear``, transformers'
    ``Conv1D``, and ``TorchFP8Linear`` / ``TorchFP4Linear`` of a native source) and, with
    ``config.lm_head``, the output embedding. A ``-:`` dynamic rule excludes a module.

    Raises:
      ValueError: no decoder layers; a target whose resolved bits no checkpoint packs, whose
        ``in_features`` its group size does not divide, or whose shape the packing does not
        hold; ``lm_head=True`` with a tied output embedding or without a final norm to feed it.

    Numerics: names only.
    """
    layers_name, layers = decoder_layers(model)
    kinds = _target_types()
    plans = []
    for index, layer in enumerate(layers):
        for local, module in layer.named_modules():
            if not local or not isinstance(module, kinds):
                continue
            name = f"{layers_name}.{index}.{local}"
            resolved = config.resolve(name)
            if resolved is None:
                plans.append(GptqPlan(name, index, None, "excluded by a '-:' dynamic rule"))
                continue
            _check_target(name, module, resolved)
            plans.append(GptqPlan(name, index, resolved, None))
    head = output_embedding(model)
    if head is not None:
        name, module = head
        resolved = config.resolve(name) if config.lm_head else None
        if not config.lm_head or resolved is None:
            why = "output embedding (lm_head=False)" if not config.lm_head else "excluded"
            plans.append(GptqPlan(name, None, None, why))
        else:
            inputs = getattr(model, "get_input_embeddings", lambda: None)()
            if inputs is not None and getattr(inputs, "weight", None) is module.weight:
                raise ValueError(
                    f"GPTQ: lm_head=True, but {name!r} shares its weight with the input "
                    f"embedding (tie_word_embeddings); quantizing it would change the embedding "
                    f"too. Untie them first or set lm_head=False"
                )
            if final_norm(model, layers_name) is None:
                raise ValueError(
                    f"GPTQ: lm_head=True, but no final norm ({', '.join(FINAL_NORM_NAMES)}) "
                    f"was found beside {layers_name!r} to compute {name!r}'s inputs"
                )
            if not isinstance(module, kinds):
                raise ValueError(f"GPTQ: {name!r} is a {type(module).__name__}, not a linear")
            _check_target(name, module, resolved)
            plans.append(GptqPlan(name, None, resolved, None))
    return plans


def _groups_by_input(
    layer: nn.Module, targets: list[tuple[str, nn.Module]], probe: LayerInput
) -> list[list[tuple[str, nn.Module]]]:
    """Group the targets of one layer by the tensor they read, in the order they are called."""
    seen: dict[str, tuple[int, tuple[int, ...], tuple[int, ...]]] = {}
    alive: list[torch.Tensor] = []  # held until grouped: a freed input's address can be reused
    order: list[str] = []

    def make(name: str) -> Callable[..., None]:
        def hook(_module: nn.Module, args: tuple) -> None:
            if name not in seen:
                x = args[0]
                alive.append(x)
                seen[name] = (x.data_ptr(), tuple(x.shape), tuple(x.stride()))
                order.append(name)

        return hook

    handles = [module.register_forward_pre_hook(make(name)) for name, module in targets]
    try:
        call_layer(layer, probe)
    finally:
        for handle in handles:
            handle.remove()
    alive.clear()
    silent = [name for name, _ in targets if name not in seen]
    if silent:
        raise ValueError(
            f"GPTQ: {silent[:4]} never ran in their layer's forward, so no calibration input "
            f"reaches them; exclude them with '-:' dynamic rules"
        )
    by_name = dict(targets)
    groups: list[list[tuple[str, nn.Module]]] = []
    key = None
    for name in order:
        if seen[name] != key:
            groups.append([])
            key = seen[name]
        groups[-1].append((name, by_name[name]))
    return groups


def _fold_group(
    layer: nn.Module,
    first: nn.Module,
    names: list[str],
    inputs: list[LayerInput],
    statistics: Mapping[str, Statistic],
    states: Mapping[str, Any],
    share: ProcessShare | None = None,
) -> dict[str, Any]:
    """Fold ``statistics`` over one input group's rows: run the layer up to the group's input on
    every batch (padding dropped) and return each statistic's value; with a ``share``, every
    process's batches folded in batch order (:class:`BatchFold`: the one-process bits)."""
    fold = BatchFold(statistics, states, share)
    current: dict[str, torch.Tensor] = {}

    def hook(_module: nn.Module, args: tuple) -> None:
        fold.add(kept_rows(args[0], current["mask"], names))
        raise Stop

    handle = first.register_forward_pre_hook(hook)
    try:
        for item in inputs:
            current["mask"] = item.mask
            with contextlib.suppress(Stop):
                call_layer(layer, item)
    finally:
        handle.remove()
    return _finalized(statistics, fold.states(), names)


def _finalized(
    statistics: Mapping[str, Statistic], states: Mapping[str, Any], names: list[str]
) -> dict[str, Any]:
    try:
        return finalize_all(statistics, states)
    except ValueError as exc:
        raise ValueError(
            f"GPTQ: the calibration activations reaching {', '.join(names)} are not finite (inf "
            f"or NaN); check the model in its dtype on this device ({exc})"
        ) from None


def _group_hessian(
    layer: nn.Module,
    first: nn.Module,
    names: list[str],
    inputs: list[LayerInput],
    device: torch.device,
    share: ProcessShare | None = None,
) -> torch.Tensor:
    """The Hessian of one input group (:data:`floatxq.stats.HESSIAN` folded over its rows)."""
    state = HESSIAN.init(features(first)[0], device=device)
    folded = _fold_group(
        layer, first, names, inputs, {"hessian": HESSIAN}, {"hessian": state}, share
    )
    return folded["hessian"]


def _dense_weight(module: nn.Module, device: torch.device) -> torch.Tensor:
    """A target's ``(out, in)`` weight in FP32 on ``device`` (decoded for FP8/NVFP4 sources)."""
    decode = getattr(module, "dequantize_weight", None)
    if callable(decode):  # TorchFP8Linear / TorchFP4Linear: decoded for this solve only
        return decode(dtype=torch.float32).to(device)
    weight = module.weight.detach()
    if not isinstance(module, nn.Linear):  # transformers' Conv1D: (in, out)
        weight = weight.T
    return weight.to(device=device, dtype=torch.float32)


def _solve_cost(module: nn.Module) -> float:
    """A module's solve work in the units :func:`~floatxq.lifecycle.distributed.owners` balances:
    ``out · in²`` (the block updates; the inverse's ``in³`` is shared by a group)."""
    k, n = features(module)
    return float(n) * k * k


def _solve_module(
    name: str,
    module: nn.Module,
    hessian: torch.Tensor,
    config: GPTQConfig,
    rows: int,
    layer: int | None,
    device: torch.device,
    share: ProcessShare | None = None,
) -> tuple[nn.Module, GPTQModuleReport]:
    """Solve and pack one module; with a row-splitting ``share``, this process's rows solved and
    every process's joined (each row's solve is independent given the Hessian)."""
    from floatxq.nn.gptq_linear import GPTQLinear

    start = time.perf_counter()
    weight = _dense_weight(module, device)
    rows_here = row_share(weight.shape[0], share)
    if rows_here is None:
        solution = gptq_solve(weight, hessian, gptq_solve_options(config))
    else:
        assert share is not None
        mine = gptq_solve(weight[rows_here], hessian, gptq_solve_options(config))
        fields = (mine.dequantized, mine.codes, mine.scales, mine.zeros, mine.loss.reshape(1))
        dequantized, codes, scales, zeros, losses = gather_rows(fields, share)
        solution = mine._replace(
            dequantized=dequantized, codes=codes, scales=scales, zeros=zeros, loss=losses.sum()
        )  # the loss: the parts' sum in rank order (the FP64 sum reassociated)
    del weight
    bias = getattr(module, "bias", None)
    packed = GPTQLinear.from_solution(
        solution,
        bits=config.bits,
        group_size=config.group_size,
        bias=None if bias is None else bias.detach(),
        format=config.format,
    )
    loss = float(solution.loss) / max(rows, 1)
    report = GPTQModuleReport(
        name,
        layer,
        config.bits,
        config.group_size,
        rows,
        loss,
        float(solution.damp),
        time.perf_counter() - start,
    )
    return packed, report


class _DecodedStandIn(nn.Module):
    """A solved module's stand-in while its layer is still being run: the same forward as the
    :class:`~floatxq.nn.gptq_linear.GPTQLinear` it wraps (decode in ``x``'s dtype, then
    ``F.linear``), but decoded once per dtype instead of on every calibration batch. Swapped for
    the ``GPTQLinear`` itself when the layer is done."""

    def __init__(self, packed: nn.Module) -> None:
        super().__init__()
        self.packed = packed
        self.decoded: dict[torch.dtype, torch.Tensor] = {}

    @property
    def bias(self) -> torch.Tensor | None:
        """The solved module's bias (the replay's ``F.linear`` reads it)."""
        return self.packed.bias

    def dequantize_weight(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The solved weight decoded in ``dtype`` (once per dtype; the replay reads FP32)."""
        if dtype not in self.decoded:
            self.decoded[dtype] = self.packed.dequantize_weight(dtype)
        return self.decoded[dtype]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype not in self.decoded:
            self.decoded[x.dtype] = self.packed.dequantize_weight(x.dtype)
        bias = self.packed.bias
        rows = x.reshape(-1, x.shape[-1])  # 2-D, as GPTQLinear multiplies (same GEMM, same bits)
        out = nn.functional.linear(
            rows, self.decoded[x.dtype], None if bias is None else bias.to(x.dtype)
        )
        return out.reshape(*x.shape[:-1], out.shape[-1])


class _LayerStep(NamedTuple):
    """One decoder layer's solves (a function's scope, so no replaced module outlives it)."""

    model: nn.Module
    layer: nn.Module
    index: int
    inputs: list[LayerInput]
    device: torch.device
    rows: int
    on_module: Callable[[str], None] | None
    share: ProcessShare | None = None
    """This process's part when a process group shares the calibration."""

    def solve(
        self,
        configs: dict[str, GPTQConfig],
        solved: dict[str, nn.Module],
        reports: list[GPTQModuleReport],
    ) -> None:
        """Solve ``configs``' modules group by group; each is replaced by a stand-in (and its
        ``GPTQLinear`` kept in ``solved``) so later groups see its quantized outputs; each
        module's report is appended to ``reports`` as soon as it is solved."""
        wanted = [(n, self.model.get_submodule(n)) for n in configs]
        groups = _groups_by_input(self.layer, wanted, self.inputs[0])
        del wanted
        for group in groups:
            names = [n for n, _ in group]
            first = group[0][1]
            hessian = _group_hessian(self.layer, first, names, self.inputs, self.device, self.share)
            del first
            self.solve_group(group, hessian, configs, solved, reports)
            del hessian

    def solve_group(
        self,
        group: list[tuple[str, nn.Module]],
        hessian: torch.Tensor,
        configs: dict[str, GPTQConfig],
        solved: dict[str, nn.Module],
        reports: list[GPTQModuleReport],
    ) -> None:
        def install(name: str, built: nn.Module, report: GPTQModuleReport) -> None:
            solved[name] = built
            self.model.set_submodule(name, _DecodedStandIn(built))
            reports.append(report)
            if self.on_module is not None:
                self.on_module(name)

        share = self.share
        if share is not None and share.world > 1 and not share.split_rows:  # each solved once

            def solve(i: int) -> tuple[nn.Module, GPTQModuleReport]:
                name, module = group[i]
                return _solve_module(
                    name, module, hessian, configs[name], self.rows, self.index, self.device
                )

            costs = [_solve_cost(module) for _, module in group]
            results = spread(costs, solve, share, self.device)
            for (name, _), result in zip(list(group), results, strict=True):
                install(name, *result)
            group.clear()
        while group:  # popped, so the replaced module is released once it is solved
            name, module = group.pop(0)
            result = _solve_module(
                name, module, hessian, configs[name], self.rows, self.index, self.device, share
            )
            del module
            install(name, *result)


def quantize_gptq_model(
    model: nn.Module,
    config: GPTQConfig,
    calibration: CalibrationSet,
    *,
    device: torch.device,
    on_module: Callable[[str], None] | None = None,
    on_layer: Callable[[int, int], None] | None = None,
    reports: list[GPTQModuleReport] | None = None,
    hooks: LayerHooks | None = None,
    activation_budget: int | None = None,
    process_group: Any = None,
    split_rows: bool = False,
) -> GPTQRunReport:
    """Quantize ``model`` with GPTQ in place, layer by layer (see the module docstring).

    Args:
      model: a Hugging Face causal LM (decoder layers in an ``nn.ModuleList``), in eval mode;
        modules stay where they are between layers (CPU for large models).
      config: the :class:`~floatxq.config.GPTQConfig` (dynamic rules resolved per module).
      calibration: prepared batches (:func:`~floatxq.lifecycle.calibration.prepare_calibration`).
      device: the work device (one decoder layer, its Hessians, the activations at a time).
      on_module, on_layer: called with a module's name once solved, ``(index, count)`` per layer.
      reports: a list each module's report is appended to once solved (what a failed run did).
      hooks: layers on the meta device, read before they run, handed off once solved.
      activation_budget: the work device's bytes for calibration activations (more: on host).
      process_group: a ``torch.distributed`` group sharing the run (the same bits as one
        process: :mod:`~floatxq.lifecycle.distributed`); ``split_rows``: each module's rows
        split over it instead (``docs/distributed.md``).

    Returns:
      :class:`GPTQRunReport`.

    Raises:
      ValueError: any :func:`plan_gptq` refusal (before anything changes); ``activation_budget``
        with an activation policy; non-finite calibration activations (naming the modules they
        reach), a module no batch reaches.

    On any exception the solved modules stay ``GPTQLinear``, the others their originals, each
    back where it lived (``docs/gptq.md``, "An interrupted run"); the exception propagates.

    Numerics: each module as :func:`floatxq.gptq_solve` on ``H = 2/N Σ xᵀx`` over the unpadded
    calibration rows, x its input with the earlier modules and layers already quantized.
    """
    plans = plan_gptq(model, config)
    targets = {p.name: p for p in plans if p.config is not None}
    layers_name, layers = decoder_layers(model)
    head = output_embedding(model)
    head_plan = targets.get(head[0]) if head is not None else None
    replay = replay_setup(model, config, targets, layers_name, layers, head_plan)
    share = None
    if process_group is not None:
        if replay is not None:
            raise ValueError("GPTQ: a process group is not taken with an activation policy")
        calibration, share = share_calibration(
            calibration, process_group, where="GPTQ", split_rows=split_rows
        )
    if replay is not None and activation_budget is not None:
        raise ValueError(
            "GPTQ: activation_budget is not taken with an activation policy, whose replay keeps "
            "the calibration activations on the work device; leave it None"
        )
    start = time.perf_counter()
    reports = [] if reports is None else reports
    activation_scales: dict[str, float] = {}
    skip = {id(layers)} | ({id(head[1])} if head is not None else set())
    home = {id(m): device_of(m) for m in layers}
    head_home = device_of(head[1]) if head is not None else None
    outside_home = device_of(
        model.get_submodule(layers_name.rsplit(".", 1)[0]) if "." in layers_name else model
    )
    was_training = model.training
    solved: dict[str, nn.Module] = {}  # a layer's solved modules while it runs on stand-ins
    model.eval()
    try:
        with torch.no_grad():
            move_outside(model, skip, device)
            first = layers[0]
            if hooks is not None:
                hooks.enter(0)
            first.to(device)
            inputs = capture_inputs(model, first, calibration, device)
            spill_inputs(inputs, activation_budget)
            move_outside(model, skip, outside_home)  # the embeddings are done with: off the device
            begin = 0 if hooks is None else hooks.start(inputs)
            rows = calibration.tokens
            for index, layer in enumerate(layers):
                if index < begin:
                    layer.to(home[id(layer)])
                    continue
                if hooks is not None:
                    hooks.enter(index)
                layer.to(device)
                prefix = f"{layers_name}.{index}."
                names = [n for n in targets if n.startswith(prefix)]
                plan = None if replay is None else replay.plans.get(index)
                frozen: dict[str, float] = {}
                memo = RoundingMemo()  # one layer's rounded operands, reused while unchanged
                if names and plan is not None:
                    step = _LayerStep(model, layer, index, inputs, device, rows, on_module, share)
                    configs = {n: targets[n].config for n in names}
                    scales, frozen = replay_solve(
                        step, prefix, plan, configs, solved, replay.policy.global_scales,
                        memo=memo, reports=reports,
                    )  # fmt: skip
                    activation_scales.update(scales)
                elif names:
                    step = _LayerStep(model, layer, index, inputs, device, rows, on_module, share)
                    step.solve({n: targets[n].config for n in names}, solved, reports)
                last = index == len(layers) - 1
                if (not last or head_plan is not None) and replay is None:
                    for i, item in enumerate(inputs):
                        out = layer_output(call_layer(layer, item))
                        inputs[i] = next_input(item, out)
                elif not last:
                    replay_outputs(
                        layer, plan, inputs, replay.policy.global_scales, frozen, memo=memo
                    )
                for name, built in solved.items():
                    model.set_submodule(name, built)
                solved.clear()
                if hooks is not None:
                    hooks.leave(index, inputs)
                layer.to(home[id(layer)])
                if on_layer is not None:
                    on_layer(index, len(layers))
            if head_plan is not None and head is not None:
                name, module = head
                norm = final_norm(model, layers_name)
                norm.to(device)
                module.to(device)
                statistics = {"hessian": HESSIAN}
                states = {"hessian": HESSIAN.init(features(module)[0], device=device)}
                fold = BatchFold(statistics, states, share)
                for item in inputs:
                    fold.add(norm(item.hidden.to(device)), mask=item.mask)
                hessian = _finalized(statistics, fold.states(), [name])["hessian"]
                solve = lambda _: _solve_module(
                    name, module, hessian, head_plan.config, rows, None, device, share
                )
                whole = share if share is None or not share.split_rows else None
                built, report = next(spread([0.0], solve, whole, device))
                model.set_submodule(name, built.to(outside_home))
                reports.append(report)
                if on_module is not None:
                    on_module(name)
            del inputs
            if head_plan is not None:
                final_norm(model, layers_name).to(outside_home)
    finally:  # also after an error: no stand-in stays, nothing is left on the work device
        for name, built in solved.items():
            model.set_submodule(name, built)
        solved.clear()
        move_outside(model, skip, outside_home)
        for layer in layers:
            layer.to(home[id(layer)])
        if head is not None and model.get_submodule(head[0]) is head[1]:  # unsolved: back home
            head[1].to(head_home)
        model.train(was_training)
    return GPTQRunReport(
        tuple(reports),
        len(layers),
        calibration.samples,
        calibration.dropped,
        calibration.tokens,
        time.perf_counter() - start,
        types.MappingProxyType(activation_scales),
    )


__all__ = [
    "PACKABLE_BITS",
    "GPTQModuleReport",
    "GPTQRunReport",
    "GptqPlan",
    "decoder_layers",
    "gptq_solve_options",
    "plan_gptq",
    "quantize_gptq_model",
]
