"""Swapping a model's modules one at a time, all put back if any swap fails.

The weight-only lifecycles (FP8, NVFP4) replace each planned module by its quantized form here:
the module moves to the work device only while it is converted, and any exception (a bad
weight, ``KeyboardInterrupt``) restores every replaced module, its tensors on the devices they
were on, before it propagates. With a process group, each module is built by one process and
sent to all (:func:`~floatxq.lifecycle.distributed.spread`); a build that fails on its process
fails on every process, and each rolls back.
"""

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from floatxq.lifecycle.distributed import ProcessShare, spread

__all__ = ["swap_modules"]


def swap_modules(
    model: nn.Module,
    names: list[str],
    build: Callable[[str, nn.Module], Any],
    *,
    device: torch.device | None = None,
    on_module: Callable[[str], None] | None = None,
    reports: list[Any] | None = None,
    process_group: Any = None,
    costs: Sequence[float] | None = None,
    places: Sequence[torch.device] | None = None,
) -> list[str]:
    """Replace each of ``names`` in ``model`` by ``build(name, module)`` (the module moved to
    ``device`` first when given), in order; ``on_module(name)`` after each. With ``reports``,
    ``build`` returns ``(module, report)`` and each report that is not None is appended.

    With a ``process_group`` of more than one process, module ``i`` is built by one process
    only (:func:`~floatxq.lifecycle.distributed.spread` by ``costs[i]``) and sent to all, the
    others putting it on ``places[i]`` (where its builder puts it): every process ends with the
    same modules, reports, ``on_module`` calls and, on failure, the same exception.

    Returns:
      ``names``, all replaced.

    Raises:
      ValueError, TypeError: ``build``'s, prefixed with ``quantize: module {name!r}:``;
      anything else as raised. Either way every replaced module is put back first (the same
      objects, their tensors moved back to their devices: bit for bit). ValueError also for a
      ``process_group`` without one cost and place per name.
    """
    share = _share(process_group)
    if share is not None and (len(costs or ()) != len(names) or len(places or ()) != len(names)):
        raise ValueError("swap_modules: a process_group needs costs and places, one per name")
    modules = dict(model.named_modules())
    done: list[str] = []
    homes: dict[str, list[tuple[nn.Module, str, str, torch.device]]] = {}

    def built(i: int) -> tuple[nn.Module, Any]:
        name = names[i]
        module = modules[name]
        homes[name] = _tensor_homes(module)
        source = module.to(device) if device is not None else module
        try:
            with torch.no_grad():
                result = build(name, source)
        except (ValueError, TypeError) as exc:  # named: which of the modules it was
            kind = ValueError if isinstance(exc, ValueError) else TypeError
            raise kind(f"quantize: module {name!r}: {exc}") from exc
        return result if reports is not None else (result, None)

    try:
        if share is None:
            results = (built(i) for i in range(len(names)))
        else:
            assert costs is not None and places is not None
            landing = torch.device("cpu") if share.gloo else _cuda_here()
            results = (
                (module.to(places[i]), report)
                for i, (module, report) in enumerate(spread(costs, built, share, landing))
            )
        for name, (replacement, report) in zip(names, results, strict=True):
            model.set_submodule(name, replacement)
            del replacement
            done.append(name)
            if reports is not None and report is not None:
                reports.append(report)
            if on_module is not None:
                on_module(name)
    except BaseException:
        for name in dict.fromkeys([*done, *homes]):  # the failing module may have moved
            model.set_submodule(name, modules[name])
            if name in homes:
                _restore_homes(homes[name])
        raise
    return done


def _share(group: Any) -> ProcessShare | None:
    """``group``'s share of a swap (None: no group, or one process)."""
    if group is None or dist.get_world_size(group) == 1:
        return None
    return ProcessShare.of(group)


def _cuda_here() -> torch.device:
    """The device NCCL broadcasts on: this process's current GPU."""
    return torch.device("cuda", torch.cuda.current_device())


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
