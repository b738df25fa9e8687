"""Walking a decoder layer by layer: finding the layers, capturing their inputs, running one.

The GPTQ lifecycle (and its activation-policy replay) runs a causal LM one decoder layer at a time:
the embeddings run once, the first layer's inputs are captured (:func:`capture_inputs`), and each
layer's outputs become the next one's inputs.
"""

import contextlib
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch import nn

from floatxq.lifecycle.calibration import CalibrationSet

LAYER_LIST_NAMES = ("layers", "h", "blocks", "layer")
FINAL_NORM_NAMES = ("norm", "final_layernorm", "ln_f", "final_layer_norm")


def features(module: nn.Module) -> tuple[int, int]:
    """``(in_features, out_features)`` of a linear-like target."""
    if hasattr(module, "in_features") and hasattr(module, "out_features"):
        return int(module.in_features), int(module.out_features)
    rows, cols = module.weight.shape  # transformers' Conv1D stores (in, out)
    return int(rows), int(cols)


def decoder_layers(model: nn.Module) -> tuple[str, nn.ModuleList]:
    """The model's list of decoder layers and its qualified name (``model.layers`` in a Llama).

    The list is the ``nn.ModuleList`` of modules of one type whose length is the config's
    ``num_hidden_layers`` (when it has one), preferring names ending in ``layers``/``h``/``blocks``.

    Raises:
      ValueError: no such list (the GPTQ lifecycle needs repeated decoder layers).

    Numerics: names only.
    """
    want = getattr(getattr(model, "config", None), "num_hidden_layers", None)
    found = []
    for name, module in model.named_modules():
        if not isinstance(module, nn.ModuleList) or len(module) == 0:
            continue
        if len({type(child) for child in module}) != 1:
            continue
        if want is not None and len(module) != want:
            continue
        named = name.rsplit(".", 1)[-1] in LAYER_LIST_NAMES
        found.append((not named, name.count("."), name, module))
    if not found:
        raise ValueError(
            f"GPTQ: {type(model).__name__} has no list of decoder layers (an nn.ModuleList of "
            f"{want if want is not None else 'repeated'} modules of one type, such as "
            f"model.layers); the layer-by-layer lifecycle needs one"
        )
    _, _, name, layers = min(found, key=lambda item: item[:3])
    return name, layers


def output_embedding(model: nn.Module) -> tuple[str, nn.Module] | None:
    getter = getattr(model, "get_output_embeddings", None)
    head = getter() if callable(getter) else None
    if head is None:
        return None
    name = next(n for n, m in model.named_modules() if m is head)
    return name, head


def final_norm(model: nn.Module, layers_name: str) -> nn.Module | None:
    parent = model.get_submodule(layers_name.rsplit(".", 1)[0]) if "." in layers_name else model
    for name in FINAL_NORM_NAMES:
        norm = getattr(parent, name, None)
        if isinstance(norm, nn.Module):
            return norm
    return None


# ----------------------------------------------------------------------------------------------
# Running layers
# ----------------------------------------------------------------------------------------------


class Stop(Exception):
    """Raised by a hook to end a forward once the wanted input has been seen."""


class LayerInput(NamedTuple):
    hidden: torch.Tensor
    args: tuple[Any, ...]
    """The layer's other positional arguments, as the model passed them."""
    kwargs: dict[str, Any]
    mask: torch.Tensor
    """bool (batch, length): True on real tokens."""


class LayerHooks(NamedTuple):
    """How a layer-by-layer run walks a model whose decoder layers it does not hold (models
    larger than memory, :mod:`floatxq.lifecycle.offload`): layers on the meta device, read when
    their turn comes and handed off once quantized."""

    enter: Callable[[int], None]
    """Before layer ``index`` moves to the work device: give it storage (read it)."""
    leave: Callable[[int, list[LayerInput]], None]
    """Once layer ``index`` holds its quantized modules (on the work device), with the next
    layer's inputs (the last layer's: stale unless the output embedding follows): write it and
    release its storage."""
    start: Callable[[list[LayerInput]], int]
    """Given the first layer's inputs: the first layer to run (0; a resumed run's later layer,
    the inputs' hidden states replaced by that layer's in place)."""


def move_outside(model: nn.Module, skip: set[int], device: torch.device) -> None:
    """Move every module of ``model`` except those in ``skip`` (by id) to ``device``."""

    def walk(module: nn.Module) -> bool:
        """Move ``module``'s own tensors and its children; False when a skipped one is inside."""
        if id(module) in skip:
            return False
        children = list(module.children())
        inside = [walk(child) for child in children]
        if all(inside):
            module.to(device)
            return True
        for param in list(module.parameters(recurse=False)):
            param.data = param.data.to(device)
        for name, buf in list(module.named_buffers(recurse=False)):
            if buf is not None:
                module._buffers[name] = buf.to(device)
        return False

    walk(model)


def layer_output(result: Any) -> Any:
    return result[0] if isinstance(result, (tuple, list)) else result


def capture_inputs(
    model: nn.Module,
    first_layer: nn.Module,
    calibration: CalibrationSet,
    device: torch.device,
) -> list[LayerInput]:
    """Run the embeddings on every batch and keep the first decoder layer's inputs."""
    captured: list[LayerInput] = []
    current: dict[str, torch.Tensor] = {}

    def hook(_module: nn.Module, args: tuple, kwargs: dict) -> None:
        kwargs = dict(kwargs)
        hidden = args[0] if args else kwargs.pop("hidden_states")
        captured.append(LayerInput(hidden, tuple(args[1:]), kwargs, current["mask"]))
        raise Stop

    handle = first_layer.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        for batch in calibration.batches:
            mask = batch.attention_mask.to(device)
            current["mask"] = mask
            # Unpadded batches pass no mask: the model then takes its causal fast path, as it
            # does in use; padded ones pass the keep-mask, which also masks attention.
            attention = None if bool(batch.attention_mask.all()) else mask.to(torch.int64)
            with contextlib.suppress(Stop):
                model(
                    input_ids=batch.input_ids.to(device),
                    attention_mask=attention,
                    use_cache=False,
                )
    finally:
        handle.remove()
    if len(captured) != len(calibration.batches):
        raise RuntimeError(
            f"GPTQ: the model's forward reached its first decoder layer for {len(captured)} of "
            f"{len(calibration.batches)} calibration batches"
        )
    return captured


def call_layer(layer: nn.Module, item: LayerInput) -> Any:
    """Run ``layer`` on one batch: its hidden states on the work device (where the mask is)."""
    return layer(item.hidden.to(item.mask.device), *item.args, **item.kwargs)


def next_input(item: LayerInput, hidden: torch.Tensor) -> LayerInput:
    """``item`` with the layer's output as its hidden states, kept where the input was (host
    memory when the activations were spilled, :func:`spill_inputs`)."""
    return item._replace(hidden=hidden.to(item.hidden.device))


def activation_bytes(inputs: list[LayerInput]) -> int:
    """The bytes of the hidden states of every batch."""
    return sum(item.hidden.numel() * item.hidden.element_size() for item in inputs)


def spill_inputs(inputs: list[LayerInput], budget: int | None) -> bool:
    """Move every batch's hidden states to host memory (pinned when CUDA is there) when they
    take more than ``budget`` bytes of the work device, in place; whether they moved.

    The layers still run on the work device: :func:`call_layer` copies one batch at a time
    there and :func:`next_input` copies its output back. The values are the same bytes.
    """
    if budget is None or not inputs or activation_bytes(inputs) <= budget:
        return False
    if inputs[0].hidden.device.type == "cpu":
        return False
    pin = torch.cuda.is_available()
    for i, item in enumerate(inputs):
        host = item.hidden.to("cpu")
        inputs[i] = item._replace(hidden=host.pin_memory() if pin else host)
    return True


def kept_rows(x: torch.Tensor, mask: torch.Tensor, names: list[str]) -> torch.Tensor:
    """The ``(n, k)`` rows of ``x`` on real tokens (padding dropped by the keep-mask)."""
    if tuple(x.shape[:-1]) == tuple(mask.shape):
        return x[mask]
    if bool(mask.all()):
        return x.reshape(-1, x.shape[-1])
    raise ValueError(
        f"GPTQ: {names[0]} reads inputs of shape {tuple(x.shape)}, which the padding mask "
        f"{tuple(mask.shape)} cannot be matched to; calibrate it with batch_size=1 (no padding)"
    )


def device_of(module: nn.Module) -> torch.device:
    for tensor in module.parameters():
        return tensor.device
    for tensor in module.buffers():
        return tensor.device
    return torch.device("cpu")
