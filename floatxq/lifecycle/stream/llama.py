"""The Llama decoder layer's dataflow, written once over an operand codec.

The residual stays exact in FP32 between layers; the layer's own attention and MLP modules run
(so RoPE, the KV cache and the attention function are transformers' own), their projections
reading the codec's operands. The runtime codec (:mod:`floatxq.lifecycle.stream.codec`) packs
carriers for the W4A modules; :mod:`floatxq.lifecycle.replay`'s codec rounds the same operands
in FP32 for the GPTQ solve, so the two cannot drift apart.
"""

import contextlib
import functools
import inspect
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch import nn

from floatxq._typing import Tensor
from floatxq.lifecycle.stream.boundary import _Handoff, _receive
from floatxq.lifecycle.stream.plan import StreamLane, StreamLayerPlan

_CACHE_NAMES = ("cache", "past_key_values", "past_key_value")


class _LayerCall(NamedTuple):
    """A decoder layer call's arguments, as the dataflow reads them."""

    attention_mask: Tensor | None
    position_embeddings: tuple[Tensor, Tensor]
    cache: Any
    kwargs: dict[str, Any]
    """Everything else (``position_ids``, ``use_cache``, ...): given to the attention function."""


@functools.cache
def _positional_names(cls: type) -> tuple[str, ...]:
    """The names a decoder layer class's ``forward`` takes positionally, after ``self``."""
    params = list(inspect.signature(cls.forward).parameters.values())[1:]
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return tuple(p.name for p in params if p.kind in kinds)


@functools.cache
def _returns_tuple(cls: type) -> bool:
    """Whether a decoder layer class returns a tuple (older transformers) or the tensor."""
    annotation = inspect.signature(cls.forward).return_annotation
    plain = (inspect.Signature.empty, torch.Tensor, "torch.Tensor", "Tensor")
    return not any(annotation is a or annotation == a for a in plain)


@functools.cache
def _cache_name(cls: type) -> str | None:
    """The name an attention class's ``forward`` takes its KV cache by (None: none of ours)."""
    params = inspect.signature(cls.forward).parameters
    return next((name for name in _CACHE_NAMES if name in params), None)


def _bind_call(layer: nn.Module, args: tuple, kwargs: dict[str, Any]) -> tuple[Any, _LayerCall]:
    """``(hidden_states, call)`` of a decoder layer call, whatever was passed positionally."""
    names = _positional_names(type(layer))
    if len(args) > len(names):
        raise TypeError(
            f"{type(layer).__name__}: the stream forward takes at most {len(names)} positional "
            f"arguments, got {len(args)}"
        )
    bound = dict(kwargs)
    for name, value in zip(names, args, strict=False):
        if name in bound:
            raise TypeError(f"{type(layer).__name__}: got multiple values for argument {name!r}")
        bound[name] = value
    if "hidden_states" not in bound:
        raise TypeError(f"{type(layer).__name__}: hidden_states is required")
    hidden = bound.pop("hidden_states")
    cache = None
    for name in _CACHE_NAMES:
        value = bound.pop(name, None)
        cache = value if cache is None else cache
    embeddings = bound.pop("position_embeddings", None)
    if embeddings is None:
        raise ValueError(
            f"{type(layer).__name__}: the W4A stream needs position_embeddings (the rotary "
            f"(cos, sin) that transformers' Llama model passes to each decoder layer)"
        )
    mask = bound.pop("attention_mask", None)
    return hidden, _LayerCall(mask, embeddings, cache, bound)


def _routed(
    codec: Any,
    module: nn.Module,
    stand_in: Tensor,
    operand: Any,
    readers: tuple[str, ...],
    packs: dict[str, Callable[[Any], Any]],
) -> contextlib.ExitStack:
    """For the duration of one call, ``module``'s projections read the codec's operands through
    the streams' one hand-off (:func:`floatxq.lifecycle.stream.boundary._receive`): ``stand_in``
    is handed on as ``operand`` to the ``readers`` (the norm's consumers), and each projection
    of ``packs`` packs its own input. A codec that multiplies on its own
    (``codec.forward(projection, role)`` not None) replaces the projections' forwards meanwhile.
    """
    handoff = _Handoff()
    handoff.give(stand_in, operand)
    stack = contextlib.ExitStack()
    stack.callback(handoff.carriers.clear)  # the operand goes with the call
    for role in (*readers, *packs):
        projection = getattr(module, role)
        reader = functools.partial(_projection_input, handoff, role, packs.get(role))
        stack.callback(projection.register_forward_pre_hook(reader).remove)
        forward = codec.forward(projection, role)
        if forward is not None:
            stack.callback(_restore_forward, projection, _swap_forward(projection, forward))
    return stack


def _projection_input(
    handoff: _Handoff, role: str, pack: Callable[[Any], Any] | None, _module: nn.Module, args: tuple
) -> tuple:
    operand = _receive((handoff,), args[0], None, None, None)
    if operand is None:
        if pack is None:
            raise RuntimeError(
                f"W4A stream: {role} read a tensor other than the one its decoder layer handed "
                f"its attention / MLP module; this transformers version changed the module's "
                f"dataflow"
            )
        operand = pack(args[0])
    return (operand, *args[1:])


_ABSENT = object()


def _swap_forward(module: nn.Module, forward: Callable[..., Any]) -> tuple[str, Any]:
    """Put ``forward`` in place of ``module``'s (accelerate's ``_old_forward`` where its hook
    wraps it); ``(attribute, what was there or _ABSENT)`` for :func:`_restore_forward`."""
    attr = "_old_forward" if "_old_forward" in module.__dict__ else "forward"
    previous = module.__dict__.get(attr, _ABSENT)
    module.__dict__[attr] = forward
    return attr, previous


def _restore_forward(module: nn.Module, record: tuple[str, Any]) -> None:
    attr, previous = record
    if previous is _ABSENT:
        module.__dict__.pop(attr, None)
    else:
        module.__dict__[attr] = previous


def _attention(attention: nn.Module, stand_in: Tensor, call: _LayerCall) -> Tensor:
    """The layer's own attention module called as its decoder layer calls it (RoPE, the KV
    cache and the attention function are transformers'); ``stand_in`` gives the row shape."""
    kwargs = dict(call.kwargs)
    name = _cache_name(type(attention))
    if name is not None:
        kwargs[name] = call.cache
    out = attention(
        hidden_states=stand_in, attention_mask=call.attention_mask,
        position_embeddings=call.position_embeddings, **kwargs,
    )  # fmt: skip
    return out[0] if isinstance(out, tuple) else out


def _norm_operand(
    codec: Any,
    norm: nn.Module,
    x: Any,
    xr: Tensor,
    lane: StreamLane,
    fused: bool,
    *,
    site: str,
    headroom: nn.Module,
    model_dtype: torch.dtype,
) -> Any:
    """The RMS-normed GEMM operand of the residual ``x`` (FP32 ``xr``): ``x``'s own codes scaled
    by ``1/rms`` (the fused shortcut), or the packed FP32 ``xr · 1/rms · weight``."""
    inv = torch.rsqrt(xr.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon)
    if fused and lane.nvfp4 and not lane.headroom and codec.fits(x, lane):
        return codec.rescale(x, inv.reshape(-1), site=site, lane=lane)
    normed = xr * inv * norm.weight.to(torch.float32)
    return codec.pack(
        normed, lane, site=site, key=None, headroom=headroom, reference=normed,
        model_dtype=model_dtype,
    )  # fmt: skip


def _llama_layer_flow(
    layer: nn.Module, plan: StreamLayerPlan, codec: Any, hidden: Any, call: _LayerCall
) -> Any:
    """One selected Llama decoder layer over ``codec``'s operands (the package docstring's
    dataflow); returns the ``output`` operand. The residual and the two RMS norms are computed
    here in FP32; attention and MLP are the layer's own modules, whose projections read the
    codec's operands (:func:`_routed`).

    ``codec`` provides: ``is_operand(x)``, ``model_dtype(op)``, ``place(op, like)``,
    ``exact32(op)`` (the FP32 residual), ``fits(op, lane)``, ``pack(value, lane, *, site, key,
    headroom, reference, model_dtype)``, ``rescale(op, inv, *, site, lane)`` and
    ``forward(projection, role)`` (None, or the forward a projection takes meanwhile). Sites
    name what is packed: ``input``, ``attention_norm``, ``o_proj``, ``attention_residual``,
    ``mlp_norm``, ``down_proj``, ``output``; roles are the projections' names.
    """
    attn, mlp = layer.self_attn, layer.mlp
    if codec.is_operand(hidden):
        x = codec.place(hidden, layer.input_layernorm.weight)
        model_dtype = codec.model_dtype(x)
    else:
        model_dtype = hidden.dtype
        x = codec.pack(
            hidden, plan.attention, site="input", key=plan.input_key, headroom=None,
            reference=hidden, model_dtype=model_dtype,
        )  # fmt: skip
    xr = codec.exact32(x)
    a = _norm_operand(
        codec, layer.input_layernorm, x, xr, plan.attention, plan.fused_norms,
        site="attention_norm", headroom=attn.q_proj, model_dtype=model_dtype,
    )  # fmt: skip

    def packed(site: str, key: str | None, lane: StreamLane, module: nn.Module) -> Any:
        return lambda t: codec.pack(
            t, lane, site=site, key=key, headroom=module, reference=None, model_dtype=model_dtype
        )

    qkv = ("q_proj", "k_proj", "v_proj")
    o_proj = {"o_proj": packed("o_proj", plan.attention_output_key, plan.attention, attn.o_proj)}
    with _routed(codec, attn, xr, a, qkv, o_proj):
        r1 = xr + _attention(attn, xr, call).to(torch.float32)
    del a, xr, x
    r1c = codec.pack(
        r1, plan.mlp, site="attention_residual", key=plan.residual_key, headroom=None,
        reference=r1, model_dtype=model_dtype,
    )  # fmt: skip
    b = _norm_operand(
        codec, layer.post_attention_layernorm, r1c, r1, plan.mlp, plan.fused_norms,
        site="mlp_norm", headroom=mlp.gate_proj, model_dtype=model_dtype,
    )  # fmt: skip
    del r1c
    down = {"down_proj": packed("down_proj", plan.product_key, plan.mlp, mlp.down_proj)}
    with _routed(codec, mlp, r1, b, ("gate_proj", "up_proj"), down):
        r2 = r1 + mlp(r1).to(torch.float32)
    return codec.pack(
        r2, plan.attention, site="output", key=plan.output_key, headroom=None, reference=r2,
        model_dtype=model_dtype,
    )  # fmt: skip
