"""GPTQ under an activation policy: each streamed layer solved on its replayed W4A operands.

Each layer whose seven projections are all targets runs through the W4A stream's replay
(:mod:`floatxq.lifecycle.replay`): the residual in FP32, every GEMM operand rounded as the runtime
stream rounds it (FP32 QDQ), the linears in FP32. Its input groups are fixed (q/k/v, o, gate/up,
down); under a headroom recipe a first pass per group collects the headroom histogram of the
un-rounded operand and freezes the group's global scale, then a second pass folds the Hessian of
the rounded operand (and, for a dynamic NVFP4 lane, the running ``max|x|`` of the un-rounded one).
Every statistic is a :mod:`floatxq.stats` record (``HEADROOM``, ``HESSIAN``, ``RUNNING_AMAX``),
folded the same way by one observer type (``_GroupFold``).
"""

import contextlib
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import torch
from torch import nn

from floatxq.config import GPTQConfig
from floatxq.lifecycle.decoder import (
    LayerInput,
    Stop,
    call_layer,
    features,
    kept_rows,
    layer_output,
)
from floatxq.stats import HEADROOM, HESSIAN, RUNNING_AMAX, Statistic


def replay_solve(
    step: Any,
    prefix: str,
    plan: Any,
    configs: dict[str, GPTQConfig],
    solved: dict[str, nn.Module],
    producer_scales: Mapping[str, float] | None,
    memo: Any = None,
    reports: list[Any] | None = None,
) -> tuple[dict[str, float], dict[str, float]]:
    """Solve a streamed Llama layer on the replayed W4A operands (module docstring, step 2
    with an activation policy): per input group, in call order, an optional headroom probe
    pass freezes the group's scale, then a pass folds the Hessian of the rounded operand
    (and the running ``max|x|`` of the un-rounded one), then the group is solved. The passes
    share ``memo`` (a :class:`~floatxq.lifecycle.replay.RoundingMemo`; a new one if None):
    pass the same to :func:`replay_outputs` to reuse its roundings there too. Each solved
    module's report is appended to ``reports`` as soon as it is solved (a new list if None).

    Returns ``(activation scales by module name, frozen headroom scales by site)``."""
    from floatxq.lifecycle.replay import ReplayCodec, RoundingMemo
    from floatxq.nvfp4.quantize import nvfp4_global_scale

    if memo is None:  # each site rounded once per batch while its operand is unchanged
        memo = RoundingMemo()
    reports = [] if reports is None else reports
    scales: dict[str, float] = {}
    frozen: dict[str, float] = {}
    for site, group_name, paths in _REPLAY_GROUPS:
        lane = plan.attention if group_name == "attention" else plan.mlp
        names = [prefix + p for p in paths]
        if lane.headroom:  # probe: the un-rounded operand's histogram freezes the scale
            probe = _GroupFold(names, {"headroom": (HEADROOM, HEADROOM.init())})
            _replay(step, plan, ReplayCodec(
                producer_scales=producer_scales, site_scales=frozen, memo=memo,
                pack_observers={site: probe.observer("headroom", stop=True)},
            ), probe)  # fmt: skip
            try:
                amax = probe.finalize("headroom")
            except ValueError as exc:
                raise ValueError(f"GPTQ: the inputs of {', '.join(names)}: {exc}") from None
            frozen[site] = float(nvfp4_global_scale(amax, recipe=lane.recipe))
        k = features(step.model.get_submodule(names[0]))[0]
        statistics = {"hessian": (HESSIAN, HESSIAN.init(k, device=step.device))}
        if lane.nvfp4 and not lane.headroom:  # the un-rounded operand's max|x| sets the scale
            statistics["amax"] = (RUNNING_AMAX, RUNNING_AMAX.init())
        fold = _GroupFold(names, statistics)
        observers = {site: fold.observer("amax")} if "amax" in statistics else {}
        _replay(step, plan, ReplayCodec(
            producer_scales=producer_scales, site_scales=frozen, memo=memo,
            pack_observers=observers,
            linear_observers={paths[0].rsplit(".", 1)[-1]: fold.observer("hessian", stop=True)},
        ), fold)  # fmt: skip
        try:
            hessian = fold.finalize("hessian")
        except ValueError as exc:
            raise ValueError(
                f"GPTQ: the replayed W4A activations reaching {', '.join(names)} are not "
                f"finite (inf or NaN); check the model in its dtype on this device ({exc})"
            ) from None
        if not lane.nvfp4:
            scale = 0.0
        elif lane.headroom:
            scale = frozen[site]
        else:
            scale = float(nvfp4_global_scale(fold.finalize("amax"), recipe=lane.recipe))
        scales.update(dict.fromkeys(names, scale))
        fold.states["hessian"] = None
        group = [(n, step.model.get_submodule(n)) for n in names]
        step.solve_group(group, hessian, configs, solved, reports)
        del hessian, group
    return scales, frozen


def _replay(step: Any, plan: Any, codec: Any, fold: "_GroupFold") -> None:
    """Run the replayed layer on every batch (an observer's ``Stop`` ends a batch)."""
    from floatxq.lifecycle.replay import replay_llama_layer

    for batch, item in enumerate(step.inputs):
        fold.mask = item.mask
        if codec.memo is not None:
            codec.memo.batch = batch
        with contextlib.suppress(Stop):
            replay_llama_layer(
                step.layer, item.hidden, *item.args, plan=plan, codec=codec, **item.kwargs
            )


class _GroupFold:
    """One input group's statistics (:mod:`floatxq.stats` records, by name) folded at the
    replay's observation points, batch by batch (``mask``: the current batch's keep-mask)."""

    def __init__(self, names: list[str], statistics: Mapping[str, tuple[Statistic, Any]]) -> None:
        self.names = names
        self.mask: torch.Tensor | None = None
        self.statistics = {name: stat for name, (stat, _) in statistics.items()}
        self.states: dict[str, Any] = {name: state for name, (_, state) in statistics.items()}

    def observer(self, name: str, *, stop: bool = False) -> Callable[[torch.Tensor], None]:
        """An observer folding the real-token rows it sees into ``name`` (``stop``: then end
        the batch, the layer's later work being of no use to this pass)."""
        statistic = self.statistics[name]

        def observe(x: torch.Tensor) -> None:
            rows = kept_rows(x, self.mask, self.names)
            self.states[name] = statistic.update(self.states[name], rows)
            if stop:
                raise Stop

        return observe

    def finalize(self, name: str) -> Any:
        return self.statistics[name].finalize(self.states[name])


_REPLAY_GROUPS = (
    ("attention_norm", "attention", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),
    ("o_proj", "attention", ("self_attn.o_proj",)),
    ("mlp_norm", "mlp", ("mlp.gate_proj", "mlp.up_proj")),
    ("down_proj", "mlp", ("mlp.down_proj",)),
)
"""A streamed Llama layer's input groups in call order: the site whose operand they read, the
lane (attention or MLP) it is rounded in, and the projections that read it."""


class ReplaySetup(NamedTuple):
    """An activation policy's replay: the stream policy and the plan of each streamed layer."""

    policy: Any
    plans: dict[int, Any]


def replay_setup(
    model: nn.Module,
    config: GPTQConfig,
    targets: dict[str, Any],
    layers_name: str,
    layers: nn.ModuleList,
    head_plan: Any,
) -> ReplaySetup | None:
    """The replay of ``config.activation`` (None without one), after every check that needs
    no work: a Llama, each layer's seven projections all targets or none (at least one layer
    with all), each of them 4-bit symmetric groups of 128 with ``in`` and ``out`` multiples of
    128, ``mlp`` layers that exist, producer scales naming exactly the stream's producers."""
    activation = getattr(config, "activation", None)
    if activation is None:
        return None
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    from floatxq.lifecycle.stream import (
        LLAMA_STREAM_PROJECTIONS,
        stream_layer_plans,
        stream_producer_keys,
        validate_producer_scales,
        w4a_stream_policy,
    )

    where = f"GPTQ: activation policy (mode {activation.mode!r})"
    if layers_name != "model.layers" or not isinstance(layers[0], LlamaDecoderLayer):
        raise ValueError(
            f"{where}: the W4A activation stream runs Llama causal LMs (model.model.layers of "
            f"LlamaDecoderLayer); {type(model).__name__} has {layers_name} of "
            f"{type(layers[0]).__name__}"
        )
    if head_plan is not None:
        raise ValueError(f"{where}: the output embedding (lm_head=True) has no W4A stream")
    selected = []
    for index in range(len(layers)):
        prefix = f"{layers_name}.{index}."
        names = [prefix + p for p in LLAMA_STREAM_PROJECTIONS]
        chosen = [n for n in names if n in targets]
        extra = [n for n in targets if n.startswith(prefix) and n not in names]
        if extra:
            raise ValueError(
                f"{where}: {extra[:3]} are not among a Llama layer's seven projections; only "
                f"those run W4A (exclude the others with '-:' rules)"
            )
        if not chosen:
            continue
        if len(chosen) != len(names):
            missing = [n.removeprefix(prefix) for n in names if n not in targets]
            raise ValueError(
                f"{where}: layer {index} quantizes {len(chosen)} of its seven projections but "
                f"not {missing}; a W4A layer quantizes all seven or none ('-:' rules exclude "
                f"all of a layer's or none)"
            )
        for name in names:
            resolved = targets[name].config
            k, n = features(model.get_submodule(name))
            settings = (resolved.bits, resolved.group_size, resolved.sym, resolved.desc_act)
            if settings != (4, 128, True, False):
                raise ValueError(
                    f"{where}: {name} resolves to bits={resolved.bits}, group_size="
                    f"{resolved.group_size}, sym={resolved.sym}, desc_act={resolved.desc_act}; "
                    f"the W4A GEMMs take 4, 128, True, False"
                )
            if k % 128 or n % 128:
                raise ValueError(
                    f"{where}: {name} is ({n}, {k}) (out, in); a streamed projection needs both "
                    f"to be multiples of 128"
                )
        selected.append(index)
    if not selected:
        raise ValueError(
            f"{where}: no decoder layer quantizes all seven projections, so nothing would run W4A"
        )
    attention, mlp = activation.attention, activation.mlp
    policy = w4a_stream_policy(
        activation.mode,
        recipe=activation.recipe,
        global_scales=activation.global_scales,
        attention_mode=None if attention is None else attention.mode,
        attention_recipe=None if attention is None else attention.recipe,
        mlp_fp8_layers=None if mlp is None else mlp.layers,
    )
    depth = len(layers)
    beyond = [i for i in policy.mlp_fp8_layers if i >= depth]
    if beyond:
        raise ValueError(f"{where}: mlp layers {beyond} lie beyond the model's {depth} layers")
    if policy.global_scales is not None:
        try:
            validate_producer_scales(
                policy.global_scales, stream_producer_keys(policy, depth, selected)
            )
        except ValueError as exc:
            raise ValueError(f"{where}: {exc}") from None
    return ReplaySetup(policy, stream_layer_plans(policy, depth, selected))


def replay_outputs(
    layer: nn.Module,
    plan: Any,
    inputs: list[LayerInput],
    producer_scales: Mapping[str, float] | None,
    frozen: Mapping[str, float],
    memo: Any = None,
) -> None:
    """Each batch's next-layer input, as the runtime stream computes it: a streamed layer's
    replayed ``output`` operand; an unstreamed layer run on the exact input in the model dtype.
    ``memo``: the :class:`~floatxq.lifecycle.replay.RoundingMemo` :func:`replay_solve` used."""
    from floatxq.lifecycle.replay import ReplayCodec, ReplayOperand, replay_llama_layer

    codec = ReplayCodec(producer_scales=producer_scales, site_scales=frozen, memo=memo)
    for i, item in enumerate(inputs):
        if memo is not None:
            memo.batch = i
        if plan is not None:
            out = replay_llama_layer(
                layer, item.hidden, *item.args, plan=plan, codec=codec, **item.kwargs
            )
        else:
            hidden = item.hidden
            if isinstance(hidden, ReplayOperand):
                hidden = hidden.exact()
            out = call_layer(layer, item._replace(hidden=hidden))
        inputs[i] = item._replace(hidden=layer_output(out))
