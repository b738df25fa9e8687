"""Installing the Llama stream on a model, and reading or calibrating an installed one."""

import dataclasses
import functools
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
from torch import nn

from floatxq.formats import K_GROUP
from floatxq.interop.export_gptq import STREAM_SCALES_MODULE
from floatxq.lifecycle.stream.boundary import _attach, _attached, uninstall_w4a_stream
from floatxq.lifecycle.stream.codec import (
    NVFP4BoundaryQuantizer,
    StreamScales,
    _RuntimeCodec,
    _scale_name,
)
from floatxq.lifecycle.stream.llama import (
    _bind_call,
    _llama_layer_flow,
    _restore_forward,
    _returns_tuple,
    _swap_forward,
)
from floatxq.lifecycle.stream.plan import (
    LLAMA_STREAM_PROJECTIONS,
    StreamLayerPlan,
    W4AStreamPolicy,
    _policy_of,
    llama_stream_boundaries,
    stream_lane,
    stream_layer_plans,
    stream_producer_keys,
    validate_producer_scales,
)
from floatxq.w4a.activation import W4AActivation


@dataclasses.dataclass(slots=True)
class _Rebound:
    """One rebinding of a module's forward: where (``attr``) and what to put back."""

    module: nn.Module
    attr: str
    previous: Any  # the instance attribute before, or llama._ABSENT


@dataclasses.dataclass(slots=True)
class _StreamState:
    """What an installed Llama stream holds (in a no-op hook on the model's root); only the
    producer scales are in the module tree (:class:`StreamScales`, one per layer)."""

    policy: W4AStreamPolicy
    depth: int
    selected: tuple[int, ...]
    plans: dict[int, StreamLayerPlan]
    quantizers: dict[str, NVFP4BoundaryQuantizer]
    codec: _RuntimeCodec
    rebound: list[_Rebound]
    hooks: list[Any]
    held: list[tuple[nn.Module, StreamScales]]
    """Each layer with the producer-scale holder registered on it."""

    def remove(self) -> None:
        """Forwards, hooks and submodules back as they were."""
        for record in reversed(self.rebound):
            _restore(record)
        for handle in self.hooks:
            handle.remove()
        for layer, holder in self.held:
            if layer._modules.get(STREAM_SCALES_MODULE) is holder:
                del layer._modules[STREAM_SCALES_MODULE]
        self.rebound.clear()
        self.hooks.clear()
        self.held.clear()


def _llama_layers(model: nn.Module, *, where: str) -> nn.ModuleList:
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    layers = getattr(getattr(model, "model", None), "layers", None)
    if not isinstance(layers, nn.ModuleList) or len(layers) == 0:
        raise ValueError(
            f"{where}: the model has no model.layers list; the W4A stream runs Llama causal LMs "
            f"(LlamaForCausalLM), got {type(model).__name__}"
        )
    if not isinstance(layers[0], LlamaDecoderLayer):
        raise ValueError(
            f"{where}: model.model.layers[0] is a {type(layers[0]).__name__}; the W4A stream "
            f"runs Llama decoder layers (LlamaDecoderLayer)"
        )
    return layers


def _w4a_classes() -> tuple[type, type]:
    from floatxq.nn.w4a_fp8_linear import W4AFP8Linear
    from floatxq.nn.w4a_nvfp4_linear import W4ANVFP4Linear

    return W4AFP8Linear, W4ANVFP4Linear


def _selected_layers(layers: nn.ModuleList, *, where: str) -> tuple[int, ...]:
    """Indices of the layers whose seven projections are all W4A modules (a layer with some but
    not all is refused)."""
    kinds = _w4a_classes()
    selected = []
    for i, layer in enumerate(layers):
        modules = {p: layer.get_submodule(p) for p in LLAMA_STREAM_PROJECTIONS}
        w4a = [p for p, m in modules.items() if isinstance(m, kinds)]
        if len(w4a) == len(modules):
            selected.append(i)
        elif w4a:
            others = ", ".join(
                f"{p} ({type(m).__name__})" for p, m in modules.items() if p not in w4a
            )
            raise ValueError(
                f"{where}: layer {i} is partly W4A: {', '.join(w4a)} are W4A modules but "
                f"{others} are not; a layer streams only when all seven projections are "
                f"W4AFP8Linear or W4ANVFP4Linear"
            )
    if not selected:
        raise ValueError(
            f"{where}: no decoder layer has all seven projections as W4A modules "
            f"(W4AFP8Linear / W4ANVFP4Linear); convert the GPTQ modules first"
        )
    return tuple(selected)


def _same_bits(modules: dict[str, nn.Module]) -> bool:
    first = next(iter(modules.values())).activation_global_scale_bits
    return all(
        torch.equal(m.activation_global_scale_bits.to(first.device), first)
        for m in modules.values()
    )


def _check_layers(
    layers: nn.ModuleList, selected: tuple[int, ...], policy: W4AStreamPolicy, *, where: str
) -> None:
    """Every model-dependent rule: module classes per lane, ``out % 128``, unit norm weights
    for ``fused_norms``, identical headroom scales on modules sharing a carrier."""
    nvfp4_class = _w4a_classes()[1]
    for i in selected:
        layer = layers[i]
        for path in LLAMA_STREAM_PROJECTIONS:
            module = layer.get_submodule(path)
            group = "attention" if path.startswith("self_attn.") else "mlp"
            lane = stream_lane(policy, i, group)
            if lane.nvfp4 and not isinstance(module, nvfp4_class):
                raise ValueError(
                    f"{where}: layer {i} {path} is a {type(module).__name__}, which cannot run "
                    f"NVFP4 carriers; the {group} lane is NVFP4 ({lane.recipe}), use "
                    f"W4ANVFP4Linear"
                )
            if module.out_features % K_GROUP:
                raise ValueError(
                    f"{where}: layer {i} {path} has out_features={module.out_features}; every "
                    f"streamed projection needs a multiple of {K_GROUP}"
                )
        if policy.fused_norms:
            for name in ("input_layernorm", "post_attention_layernorm"):
                weight = getattr(layer, name).weight
                if not bool((weight == 1).all()):
                    raise ValueError(
                        f"{where}: fused_norms=True needs unit RMSNorm weights (the norm operand "
                        f"reuses the residual's codes), but layer {i} {name}.weight is not all 1"
                    )
        for group, paths in (
            ("attention", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),
            ("mlp", ("mlp.gate_proj", "mlp.up_proj")),
        ):
            if stream_lane(policy, i, group).headroom:
                modules = {p: layer.get_submodule(p) for p in paths}
                if not _same_bits(modules):
                    raise ValueError(
                        f"{where}: layer {i}: {', '.join(paths)} read one shared NVFP4 carrier, "
                        f"so their calibrated activation_global_scale must be identical under a "
                        f"headroom recipe; got "
                        + ", ".join(
                            f"{p}={float(m.activation_global_scale)!r}" for p, m in modules.items()
                        )
                    )


def _rebind(module: nn.Module, forward: Callable[..., Any]) -> _Rebound:
    """Replace ``module``'s forward (accelerate's ``_old_forward`` where its hook wraps it)."""
    return _Rebound(module, *_swap_forward(module, forward))


def _restore(record: _Rebound) -> None:
    _restore_forward(record.module, (record.attr, record.previous))


def _stream_forward(state: _StreamState, index: int, layer: nn.Module, *args: Any, **kwargs: Any):
    hidden, call = _bind_call(layer, args, kwargs)
    out = _llama_layer_flow(layer, state.plans[index], state.codec, hidden, call)
    return (out,) if _returns_tuple(type(layer)) else out


def _exact_hidden(_module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
    """Pre-hook of an unselected layer or the final norm: a carrier becomes its exact value in
    the model dtype."""
    if args and isinstance(args[0], W4AActivation):
        return (args[0].exact(), *args[1:]), kwargs
    if isinstance(kwargs.get("hidden_states"), W4AActivation):
        return args, {**kwargs, "hidden_states": kwargs["hidden_states"].exact()}
    return None


def _final_norm_forward(original: Callable[..., Any], hidden: Any, *args: Any, **kwargs: Any):
    """The final norm after a selected last layer: RMSNorm of ``exact()`` in the model dtype."""
    if isinstance(hidden, W4AActivation):
        hidden = hidden.exact()
    return original(hidden, *args, **kwargs)


def _quantizers(
    policy: W4AStreamPolicy, depth: int, selected: tuple[int, ...], layers: nn.ModuleList
) -> tuple[dict[str, NVFP4BoundaryQuantizer], list[tuple[nn.Module, StreamScales]]]:
    """The NVFP4 producers' quantizers by key, and each layer's holder of their buffers."""
    producers: dict[int, list[tuple[str, str]]] = {}
    for b in llama_stream_boundaries(depth, selected):
        lane = stream_lane(policy, b.layer, b.group)
        if b.key is not None and lane.nvfp4:
            producers.setdefault(b.layer, []).append((b.key, lane.recipe))
    out, holders = {}, []
    for i, rows in producers.items():
        device = layers[i].input_layernorm.weight.device
        holder = StreamScales({_scale_name(key): key for key, _ in rows}, device=device)
        holders.append((layers[i], holder))
        for key, recipe in rows:
            out[key] = NVFP4BoundaryQuantizer(key, layer=i, recipe=recipe, scales=holder)
    return out, holders


def _hold_scales(state: "_StreamState", holders: list[tuple[nn.Module, StreamScales]]) -> None:
    """Register each holder on its layer (``state.remove`` takes it away again)."""
    for layer, _ in holders:
        if STREAM_SCALES_MODULE in layer._modules or hasattr(layer, STREAM_SCALES_MODULE):
            raise ValueError(
                f"install_w4a_llama_stream: a decoder layer already has a "
                f"{STREAM_SCALES_MODULE!r} attribute; the stream registers its producer scales "
                f"under that name"
            )
    for layer, holder in holders:
        layer.add_module(STREAM_SCALES_MODULE, holder)
        state.held.append((layer, holder))


def install_w4a_llama_stream(
    model: nn.Module,
    mode: str,
    recipe: str | None = None,
    global_scales: Mapping[str, float] | None = None,
    attention_mode: str | None = None,
    attention_recipe: str | None = None,
    mlp_fp8_layers: Iterable[int] | None = None,
    fused_norms: bool = False,
) -> W4AStreamPolicy:
    """Install the W4A activation stream on a Llama causal LM (see the package docstring).

    A layer whose seven projections are all W4A modules is selected: its forward (accelerate's
    ``_old_forward`` where a hook wraps it) takes and returns carriers, and so does the final
    norm's after a selected last layer; other layers (and otherwise the final norm) read a
    carrier's ``exact()``. Installing again with an equal policy only checks the model again.

    Args:
      model: a ``LlamaForCausalLM`` (``model.model.layers``) holding W4A modules.
      mode, recipe, global_scales, attention_mode, attention_recipe, mlp_fp8_layers,
        fused_norms: as :func:`w4a_stream_policy`; ``mlp_fp8_layers`` must also lie below the
        layer count, and ``global_scales`` must name exactly the NVFP4 producers
        (:func:`stream_producer_keys`).

    Returns:
      The installed :class:`W4AStreamPolicy`.

    Raises:
      ValueError: every :func:`w4a_stream_policy` refusal; not a Llama; no selected layer; a
        layer partly W4A; a W4AFP8Linear in an NVFP4 lane; ``out_features % 128``; fused norms
        with norm weights other than 1; q/k/v (gate/up) with different headroom scales; a
        ``mlp_fp8_layers`` entry beyond the layers; global-scale keys other than the producers';
        another stream or policy installed (uninstall it first).
      TypeError: as :func:`w4a_stream_policy`.

    Numerics: see the module docstring; nothing is computed while installing.

    Example:
      >>> install_w4a_llama_stream(model, "w4a_nvfp4", attention_mode="w4afp8")  # doctest: +SKIP
    """
    where = "install_w4a_llama_stream"
    policy = _policy_of(
        mode, recipe, global_scales, attention_mode, attention_recipe, mlp_fp8_layers,
        fused_norms, where=where,
    )  # fmt: skip
    layers = _llama_layers(model, where=where)
    depth = len(layers)
    beyond = [i for i in policy.mlp_fp8_layers if i >= depth]
    if beyond:
        raise ValueError(
            f"{where}: mlp_fp8_layers {beyond} lie beyond the model's {depth} decoder layers"
        )
    selected = _selected_layers(layers, where=where)
    _check_layers(layers, selected, policy, where=where)
    if policy.global_scales is not None:
        validate_producer_scales(
            policy.global_scales, stream_producer_keys(policy, depth, selected)
        )
    state = _attached(model)
    if state is not None and not isinstance(state, _StreamState):
        raise ValueError(
            f"{where}: the generic stream (install_w4a_stream) is installed; call "
            f"uninstall_w4a_llama_stream(model) first"
        )
    if state is not None:
        if state.policy != policy:
            raise ValueError(
                f"{where}: a stream with another policy is installed ({state.policy}); call "
                f"uninstall_w4a_llama_stream(model) first"
            )
        if state.selected != selected:
            raise ValueError(
                f"{where}: the installed stream streams layers {list(state.selected)}, the model "
                f"now has W4A layers {list(selected)}; call uninstall_w4a_llama_stream(model) "
                f"first"
            )
        return state.policy
    quantizers, holders = _quantizers(policy, depth, selected, layers)
    if policy.global_scales is not None:
        for key, value in policy.global_scales.items():
            quantizers[key].set_scale(value)
    state = _StreamState(
        policy, depth, selected, stream_layer_plans(policy, depth, selected), quantizers,
        _RuntimeCodec(quantizers), [], [], [],
    )  # fmt: skip
    _hold_scales(state, holders)
    members = set(selected)
    for i, layer in enumerate(layers):
        if i in members:
            forward = functools.partial(_stream_forward, state, i, layer)
            state.rebound.append(_rebind(layer, forward))
        else:
            state.hooks.append(layer.register_forward_pre_hook(_exact_hidden, with_kwargs=True))
    norm = getattr(model.model, "norm", None)
    if isinstance(norm, nn.Module):
        if depth - 1 in members:
            original = norm.__dict__.get("_old_forward", norm.forward)
            state.rebound.append(_rebind(norm, functools.partial(_final_norm_forward, original)))
        else:
            state.hooks.append(norm.register_forward_pre_hook(_exact_hidden, with_kwargs=True))
    _attach(model, state)
    return policy


uninstall_w4a_llama_stream = uninstall_w4a_stream
"""Remove the installed stream (Llama or generic): :func:`uninstall_w4a_stream` under its older
name."""


def installed_w4a_stream(model: nn.Module) -> W4AStreamPolicy | None:
    """The installed stream's policy, or None.

    Numerics: none.

    Example:
      >>> installed_w4a_stream(torch.nn.Linear(2, 2)) is None
      True
    """
    state = _attached(model)
    return None if state is None else state.policy


def _installed(model: nn.Module, *, where: str) -> _StreamState:
    state = _attached(model)
    if state is None:
        raise ValueError(f"{where}: no W4A stream is installed on this model")
    if not isinstance(state, _StreamState):
        raise ValueError(
            f"{where}: the installed stream is the generic one (install_w4a_stream), which has "
            f"no producer quantizers: its NVFP4 scales are the consuming modules' "
            f"activation_global_scale"
        )
    return state


def stream_boundary_quantizers(model: nn.Module) -> dict[str, NVFP4BoundaryQuantizer]:
    """The installed stream's NVFP4 producer quantizers by key, in execution order.

    The quantizers themselves (not copies): setting ``observer`` or calling ``set_scale`` acts
    on the stream. Prefer :func:`set_stream_global_scales` to set them all at once.

    Raises:
      ValueError: no stream is installed.

    Numerics: none.

    Example:
      >>> quantizers = stream_boundary_quantizers(model)  # doctest: +SKIP
      >>> quantizers["model.layers.0.output"].observer = print  # doctest: +SKIP
    """
    return dict(_installed(model, where="stream_boundary_quantizers").quantizers)


def set_stream_global_scales(model: nn.Module, scales: Mapping[str, float] | None) -> None:
    """Calibrate every NVFP4 producer of the installed stream at once, or return all to dynamic.

    Args:
      model: a model with an installed stream.
      scales: exactly the producer keys (:func:`stream_producer_keys`) with positive finite
        values (FP32-rounded), or None: every quantizer back to dynamic (stored bits 0,
        not calibrated).

    Raises:
      ValueError: no stream installed; a key set other than the producers' (missing and extra
        listed); a value not positive and finite in FP32; a headroom recipe. Nothing changes
        when it raises.
      TypeError: ``scales`` not a mapping of str to real numbers.

    Numerics: each value rounded once to FP32; the policy's ``global_scales`` are updated.

    Example:
      >>> set_stream_global_scales(model, None)  # doctest: +SKIP
    """
    where = "set_stream_global_scales"
    state = _installed(model, where=where)
    if scales is None:
        for quantizer in state.quantizers.values():
            quantizer.reset()
        state.policy = dataclasses.replace(state.policy, global_scales=None)
        return
    policy = _policy_of(
        state.policy.mode, state.policy.recipe, scales, state.policy.attention_mode,
        state.policy.attention_recipe, state.policy.mlp_fp8_layers, state.policy.fused_norms,
        where=where,
    )  # fmt: skip
    validate_producer_scales(policy.global_scales, state.quantizers)
    for key, value in policy.global_scales.items():
        state.quantizers[key].set_scale(value)
    state.policy = policy
