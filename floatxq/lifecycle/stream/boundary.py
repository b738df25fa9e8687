"""The generic W4A stream: a norm's output packed once and handed to the W4A linears it feeds.

Works on any decoder whose layers (:func:`floatxq.lifecycle.decoder.decoder_layers`) hold W4A
modules (:class:`~floatxq.nn.W4AFP8Linear`, :class:`~floatxq.nn.W4ANVFP4Linear`). Each norm of
such a layer (a module whose class name ends in ``Norm``) is a *producer*: a forward hook marks
its output. Each W4A module is a *consumer*: a forward pre-hook packs its input into a
:class:`~floatxq.W4AActivation` in its lane (:func:`~floatxq.lifecycle.stream.stream_lane`;
attention when its path in the layer names ``attn``/``attention``, else MLP). When that input
is the very tensor a producer of its layer returned, the carrier is packed once and handed to
every consumer that reads it in the same lane with the same global scale (q/k/v after the
attention norm, gate/up after the MLP norm): the consumers are found at call time, by tensor
identity, so no probe forward and no model-specific wiring are needed.

The global scale (NVFP4) is the consumer's own ``activation_global_scale`` buffer (in its
``state_dict``: calibrated or headroom scales load with the checkpoint), else the dynamic one of
the tensor's ``max|x|``: the carrier holds exactly what each module would pack alone, once
(sharing an NVFP4 carrier compares the two consumers' scale buffers: a host read on CUDA).
The state lives in the hooks: their handles, and a no-op hook on the model's root holding them.
The hand-off itself (:class:`_Handoff`, :func:`_receive`) is also the Llama adapter's.
"""

import dataclasses
import functools
import weakref
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from floatxq.lifecycle.stream.codec import _device_pack, _host_pack, _RuntimeCodec, _Scale
from floatxq.lifecycle.stream.plan import StreamLane, W4AStreamPolicy, _policy_of, stream_lane
from floatxq.w4a.activation import W4AActivation

_ATTENTION_WORDS = ("attn", "attention")


# ----------------------------------------------------------------------------------------------
# Where an installed stream's state lives: a no-op forward pre-hook on the model's root
# ----------------------------------------------------------------------------------------------


class _StreamHold:
    """A forward pre-hook that does nothing but hold an installed stream's state."""

    def __init__(self, state: Any) -> None:
        self.state = state
        self.handle: Any = None

    def __call__(self, _module: nn.Module, _args: tuple) -> None:
        return None


def _attach(model: nn.Module, state: Any) -> None:
    hold = _StreamHold(state)
    hold.handle = model.register_forward_pre_hook(hold)


def _hold(model: nn.Module) -> _StreamHold | None:
    for hook in getattr(model, "_forward_pre_hooks", {}).values():
        if isinstance(hook, _StreamHold):
            return hook
    return None


def _attached(model: nn.Module) -> Any:
    """The installed stream's state (a Llama or a generic one), or None."""
    hold = _hold(model)
    return None if hold is None else hold.state


def _detach(model: nn.Module) -> Any:
    """Remove the installed stream (its ``remove()`` undoes its hooks); its state, or None."""
    hold = _hold(model)
    if hold is None:
        return None
    hold.handle.remove()
    hold.state.remove()
    return hold.state


# ----------------------------------------------------------------------------------------------
# Producers and consumers
# ----------------------------------------------------------------------------------------------


class _Handoff:
    """The latest tensor a producer handed on and the operands made from it (dropped with it).

    The one hand-off of both streams: a producer marks a tensor (:meth:`hold`: the generic
    stream's norm output; :meth:`give`: the Llama layer's stand-in, with the operand it made
    from the FP32 residual), and each consumer finds its operand by the identity of its input
    (:func:`_receive`)."""

    __slots__ = ("carriers", "ref")

    def __init__(self) -> None:
        self.ref: weakref.ref | None = None
        self.carriers: list[tuple[StreamLane | None, torch.Tensor | None, Any]] = []

    def hold(self, output: torch.Tensor) -> None:
        self.carriers = []
        self.ref = weakref.ref(output, self._release)

    def give(self, stand_in: torch.Tensor, operand: Any) -> None:
        """Hand ``operand`` to every consumer that reads ``stand_in``, whatever its lane."""
        self.hold(stand_in)
        self.carriers.append((None, None, operand))

    def _release(self, ref: weakref.ref) -> None:
        if ref is self.ref:
            self.ref, self.carriers = None, []

    def holds(self, x: torch.Tensor) -> bool:
        return self.ref is not None and self.ref() is x

    def carrier(self, lane: StreamLane | None, bits: torch.Tensor | None) -> Any:
        for held_lane, held_bits, carrier in self.carriers:
            if held_lane is None:
                return carrier  # given by the producer
            if held_lane != lane:
                continue
            if held_bits is bits or (
                held_bits is not None and bits is not None and torch.equal(held_bits, bits)
            ):
                return carrier
        return None


def _receive(
    handoffs: Iterable[_Handoff],
    x: Any,
    lane: StreamLane | None,
    bits: torch.Tensor | None,
    pack: Callable[[torch.Tensor], Any] | None,
) -> Any:
    """The operand a consumer reads for its input ``x``: the one handed on for that very
    tensor (packed once per lane and scale by the first consumer with ``pack``), or None when
    no producer handed ``x`` on."""
    for handoff in handoffs:
        if handoff.holds(x):
            carrier = handoff.carrier(lane, bits)
            if carrier is None and pack is not None:
                carrier = pack(x)
                handoff.carriers.append((lane, bits, carrier))
            return carrier
    return None


def _produce(handoff: _Handoff, _module: nn.Module, _args: tuple, output: Any) -> None:
    if isinstance(output, torch.Tensor):
        handoff.hold(output)


@dataclasses.dataclass(frozen=True, slots=True)
class _Consumer:
    """One W4A module's pre-hook: its lane and the producers of its layer."""

    lane: StreamLane
    handoffs: tuple[_Handoff, ...]
    codec: _RuntimeCodec

    def pack(self, x: torch.Tensor, bits: torch.Tensor | None, *, site: str) -> W4AActivation:
        on_device = self.codec._on_device(x.device, self.lane.mode)
        pack = _device_pack if on_device else _host_pack
        return pack(x, self.lane, _Scale(bits=bits), x.dtype, None, site=site)

    def __call__(self, module: nn.Module, args: tuple) -> tuple | None:
        if not args or not isinstance(args[0], torch.Tensor):
            return None  # a carrier (or anything else) goes to the module as it is
        x = args[0]
        bits = module.activation_global_scale_bits if self.lane.nvfp4 else None
        norm = functools.partial(self.pack, bits=bits, site="norm output")
        carrier = _receive(self.handoffs, x, self.lane, bits, norm)
        if carrier is None:
            carrier = self.pack(x, bits, site=f"{type(module).__name__} input")
        return (carrier, *args[1:])


# ----------------------------------------------------------------------------------------------
# Installing
# ----------------------------------------------------------------------------------------------


@dataclasses.dataclass(slots=True)
class _BoundaryState:
    """An installed generic stream: its policy and its hooks' handles."""

    policy: W4AStreamPolicy
    layers: tuple[int, ...]
    handles: list[Any]

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles.clear()


def _is_norm(module: nn.Module) -> bool:
    return isinstance(module, (nn.LayerNorm, nn.RMSNorm)) or type(module).__name__.endswith("Norm")


def _group(path: str) -> str:
    return "attention" if any(w in path.lower() for w in _ATTENTION_WORDS) else "mlp"


def install_w4a_stream(
    model: nn.Module,
    mode: str,
    *,
    recipe: str | None = None,
    attention_mode: str | None = None,
    attention_recipe: str | None = None,
    mlp_fp8_layers: Iterable[int] | None = None,
) -> W4AStreamPolicy:
    """Install the generic W4A stream on any decoder (see the module docstring).

    Args:
      model: a model with a list of decoder layers holding W4A modules.
      mode, recipe, attention_mode, attention_recipe, mlp_fp8_layers: as
        :func:`~floatxq.lifecycle.stream.w4a_stream_policy` (no ``global_scales``: the
        calibrated scales are the consumers' ``activation_global_scale`` buffers).

    Returns:
      The installed :class:`~floatxq.lifecycle.stream.W4AStreamPolicy`.

    Raises:
      ValueError: every policy refusal; no decoder layer list; no W4A module in any layer; a
        W4AFP8Linear in an NVFP4 lane; ``mlp_fp8_layers`` beyond the layers; a stream already
        installed with another policy (uninstall it first).
      TypeError: as the policy.

    Numerics: nothing is computed while installing; a call packs as the module would alone.

    Example:
      >>> install_w4a_stream(model, "w4a_nvfp4", attention_mode="w4afp8")  # doctest: +SKIP
    """
    from floatxq.lifecycle.decoder import decoder_layers
    from floatxq.nn.w4a_fp8_linear import W4AFP8Linear
    from floatxq.nn.w4a_nvfp4_linear import W4ANVFP4Linear

    where = "install_w4a_stream"
    policy = _policy_of(
        mode, recipe, None, attention_mode, attention_recipe, mlp_fp8_layers, False, where=where
    )
    _, layers = decoder_layers(model)
    beyond = [i for i in policy.mlp_fp8_layers if i >= len(layers)]
    if beyond:
        raise ValueError(
            f"{where}: mlp_fp8_layers {beyond} lie beyond the model's {len(layers)} decoder layers"
        )
    installed = _attached(model)
    if installed is not None:
        if installed.policy != policy:
            raise ValueError(
                f"{where}: a stream with another policy is installed ({installed.policy}); call "
                f"uninstall_w4a_stream(model) first"
            )
        return installed.policy
    plan: list[tuple[int, list[nn.Module], list[tuple[nn.Module, StreamLane]]]] = []
    for i, layer in enumerate(layers):
        consumers = []
        for path, module in layer.named_modules():
            if not isinstance(module, (W4AFP8Linear, W4ANVFP4Linear)):
                continue
            group = _group(path)
            lane = stream_lane(policy, i, group)
            if lane.nvfp4 and not isinstance(module, W4ANVFP4Linear):
                raise ValueError(
                    f"{where}: layer {i} {path} is a {type(module).__name__}, which cannot run "
                    f"NVFP4 carriers; the {group} lane is NVFP4 ({lane.recipe}), use "
                    f"W4ANVFP4Linear"
                )
            consumers.append((module, lane))
        if consumers:
            plan.append((i, [m for _, m in layer.named_modules() if _is_norm(m)], consumers))
    if not plan:
        raise ValueError(
            f"{where}: no decoder layer holds a W4A module (W4AFP8Linear / W4ANVFP4Linear); "
            f"convert the GPTQ modules first"
        )
    codec = _RuntimeCodec({})
    state = _BoundaryState(policy, tuple(i for i, _, _ in plan), [])
    for _, norms, consumers in plan:
        handoffs = tuple(_Handoff() for _ in norms)
        for norm, handoff in zip(norms, handoffs, strict=True):
            hook = functools.partial(_produce, handoff)
            state.handles.append(norm.register_forward_hook(hook))
        for module, lane in consumers:
            state.handles.append(module.register_forward_pre_hook(_Consumer(lane, handoffs, codec)))
    _attach(model, state)
    return policy


def uninstall_w4a_stream(model: nn.Module) -> W4AStreamPolicy | None:
    """Remove the installed stream, generic or Llama: hooks and forwards back as they were.

    Returns:
      The policy that was installed, or None when no stream was.

    Numerics: none.

    Example:
      >>> uninstall_w4a_stream(torch.nn.Linear(2, 2)) is None
      True
    """
    state = _detach(model)
    return None if state is None else state.policy
