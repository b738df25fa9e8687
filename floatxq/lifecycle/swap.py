"""Swapping a model's modules one at a time, all put back if any swap fails.

The weight-only lifecycles (FP8, NVFP4) replace each planned module by its quantized form here:
the module moves to the work device only while it is converted, and any exception (a bad
weight, ``KeyboardInterrupt``) restores every replaced module, its tensors on the devices they
were on, before it propagates.
"""

from collections.abc import Callable

import torch
from torch import nn

__all__ = ["swap_modules"]


def swap_modules(
    model: nn.Module,
    names: list[str],
    build: Callable[[str, nn.Module], nn.Module],
    *,
    device: torch.device | None = None,
    on_module: Callable[[str], None] | None = None,
) -> list[str]:
    """Replace each of ``names`` in ``model`` by ``build(name, module)`` (the module moved to
    ``device`` first when given), in order; ``on_module(name)`` after each.

    Returns:
      ``names``, all replaced.

    Raises:
      ValueError, TypeError: ``build``'s, prefixed with ``quantize: module {name!r}:``;
      anything else as raised. Either way every replaced module is put back first (the same
      objects, their tensors moved back to their devices: bit for bit).
    """
    modules = dict(model.named_modules())
    done: list[str] = []
    homes: dict[str, list[tuple[nn.Module, str, str, torch.device]]] = {}
    try:
        for name in names:
            module = modules[name]
            homes[name] = _tensor_homes(module)
            source = module.to(device) if device is not None else module
            try:
                with torch.no_grad():
                    replacement = build(name, source)
            except (ValueError, TypeError) as exc:  # named: which of the modules it was
                kind = ValueError if isinstance(exc, ValueError) else TypeError
                raise kind(f"quantize: module {name!r}: {exc}") from exc
            model.set_submodule(name, replacement)
            del source, module
            done.append(name)
            if on_module is not None:
                on_module(name)
    except BaseException:
        for name, places in homes.items():  # the failing module may have moved, not swapped
            model.set_submodule(name, modules[name])
            _restore_homes(places)
        raise
    return done


def _tensor_homes(module: nn.Module) -> list[tuple[nn.Module, str, str, torch.device]]:
    """Where each parameter and buffer of ``module`` (and its children) lives now."""
    places = []
    for owner in module.modules():
        for kind, tensors in (("param", owner._parameters), ("buffer", owner._buffers)):
            for key, tensor in tensors.items():
                if tensor is not None:
                    places.append((owner, kind, key, tensor.device))
    return places


def _restore_homes(places: list[tuple[nn.Module, str, str, torch.device]]) -> None:
    """Move tensors back where :func:`_tensor_homes` found them, as ``Module.to`` moved them
    (a parameter keeps its object, a buffer is replaced); a copy between devices is exact."""
    for owner, kind, key, home in places:
        tensor = owner._parameters[key] if kind == "param" else owner._buffers[key]
        if tensor is None or tensor.device == home:
            continue
        if kind == "param":
            tensor.data = tensor.data.to(home)
        else:
            owner._buffers[key] = tensor.to(home)
