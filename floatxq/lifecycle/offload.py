"""Models larger than memory: quantize a checkpoint layer by layer from its shards, streaming
the result to disk (``floatxq.load(path, quantize_config=..., offload="disk")``).

The model is a shell on the meta device (:func:`~floatxq.interop.lazy_source.build_shell`).
Only the pieces outside the decoder layers hold storage for the whole run: embeddings, final
norm, ``lm_head``, rotary tables. They are read when the model is loaded. Quantizing
(:func:`quantize_offloaded`, called by :meth:`QuantizedModel.quantize`) works as follows:

1. Each planned module of the decoder layers is replaced by its quantized module built empty on
   the meta device. The checkpoint's layout export runs over that structure and gives every
   tensor name, dtype and shape in the order an in-memory save writes them, and the payloads
   (config.json's ``quantization_config``, ``quantize_config.json``). Those fix the shards
   (:func:`~floatxq.interop.stream_shards.plan_shards`).
2. The output is written through
   :func:`~floatxq.interop.stream_save.write_checkpoint_streamed`: the long-lived tensors first,
   then, per decoder layer, its tensors are read from the source shards (their byte ranges
   only), its modules quantized as the in-memory run quantizes them, the layer exported, written
   and flushed, and its storage released. The directory appears at ``out`` only when complete.
   A run cut short leaves a staging folder that ``quantize(..., resume=True)`` with the same
   settings finishes, skipping the layers already flushed.

FP8 (GSQ weight-only included) and NVFP4 round to nearest run this way today; the calibrated
methods (GPTQ, NVFP4 GPTQ / W4A4, calibrated GSQ) are refused with ``offload="disk"``.
"""

import resource
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import torch
from torch import nn

from floatxq.config import FP8Config, NVFP4Config
from floatxq.interop.checkpoint import SIDE_FILES, _unique_names
from floatxq.interop.export import _export, _modules, normalize_layout
from floatxq.interop.lazy_source import LazyCheckpoint, build_shell, materialize, release
from floatxq.interop.payload import fp8_config_to_payload, nvfp4_config_to_payload
from floatxq.interop.stream_save import write_checkpoint_streamed
from floatxq.interop.stream_shards import ShardWriter, plan_shards
from floatxq.lifecycle.decoder import decoder_layers
from floatxq.lifecycle.fp8 import GSQModuleReport, _check_divisible, fp8_module, plan_fp8
from floatxq.lifecycle.nvfp4 import _own_amax, fused_amax, plan_nvfp4
from floatxq.lifecycle.nvfp4 import _quantized as _nvfp4_quantized
from floatxq.nn.fp4_linear import TorchFP4Linear
from floatxq.nn.fp8_linear import TorchFP8Linear

__all__ = [
    "OFFLOAD_MODES",
    "OffloadReport",
    "OffloadSource",
    "load_offloaded",
    "quantize_offloaded",
]

OFFLOAD_MODES = ("disk",)
"""``load(..., offload=...)``: ``"disk"`` reads each decoder layer from the shards when its turn
comes and writes the result as layers finish."""


class OffloadSource(NamedTuple):
    """Where an offloaded model's weights are: the checkpoint, read a piece at a time."""

    path: Path
    checkpoint: LazyCheckpoint
    dtype: torch.dtype | None
    layers_name: str
    resident: tuple[str, ...]
    """The submodules outside the decoder layers, materialized (on the CPU) for the whole run."""


class OffloadReport(NamedTuple):
    """What an offloaded run did: the layers quantized now and earlier (a resumed run's), the
    modules refined by GSQ, the wall time, the host's peak resident memory
    (``ru_maxrss``) and the work device's peak allocation (CUDA), in bytes."""

    layers: int
    resumed_layers: int
    modules: tuple[GSQModuleReport, ...]
    seconds: float
    peak_host_bytes: int
    peak_device_bytes: int | None
    out: Path


def load_offloaded(path: Path, *, dtype: torch.dtype | None) -> tuple[nn.Module, OffloadSource]:
    """The model shell of a plain checkpoint with its long-lived pieces read, and its source.

    Raises:
      ValueError: the model has no list of decoder layers.
      CheckpointError: as :class:`~floatxq.interop.lazy_source.LazyCheckpoint`.
    """
    checkpoint = LazyCheckpoint(path)
    shell = build_shell(path, dtype=dtype)
    layers_name, _ = decoder_layers(shell)
    resident = []
    for name, module in shell.named_modules():
        inside = name == layers_name or name.startswith(f"{layers_name}.")
        own = [
            t for t in (*module._parameters.values(), *module._buffers.values()) if t is not None
        ]
        if name and not inside and own:
            resident.append(name)
    for name in resident:
        materialize(shell, name, checkpoint, device="cpu", dtype=dtype)
    return shell, OffloadSource(path, checkpoint, dtype, layers_name, tuple(resident))


class _Method(NamedTuple):
    """How one method plans, builds and quantizes offloaded modules."""

    plans: Callable[[nn.Module], list[tuple[str, Any]]]
    """``(name, resolved config)`` of every module the run quantizes (checked first)."""
    empty: Callable[[nn.Module, Any], nn.Module]
    """The quantized module of an original, empty, on the meta device."""
    quantize: Callable[[nn.Module, list[str], dict[str, Any], torch.device], list[Any]]
    """Quantize these modules of the shell in place (their weights read); their reports."""
    run: Callable[[], Any]
    """The settings as JSON (a resumed run must give the same)."""


def _fp8_method(config: FP8Config) -> _Method:
    def plans(shell: nn.Module) -> list[tuple[str, Any]]:
        found = [(p.name, p.config) for p in plan_fp8(shell, config) if p.config is not None]
        for module_name, cfg in found:
            _check_divisible(module_name, shell.get_submodule(module_name), cfg)
        return found

    def empty(original: nn.Module, cfg: Any) -> nn.Module:
        return TorchFP8Linear.empty_like(
            original, format=cfg.format, weight_scale_method=cfg.weight_scale_method,
            weight_block_size=cfg.weight_block_size, device="meta",
        )  # fmt: skip

    def quantize(shell: nn.Module, names: list[str], cfgs: dict, work: torch.device) -> list:
        reports = []
        for module_name in names:
            module = shell.get_submodule(module_name)
            built, report = fp8_module(module_name, module, cfgs[module_name], work_device=work)
            shell.set_submodule(module_name, built)
            reports += [report] if report is not None else []
        return reports

    return _Method(plans, empty, quantize, lambda: fp8_config_to_payload(config))


def _nvfp4_method(config: NVFP4Config) -> _Method:
    def plans(shell: nn.Module) -> list[tuple[str, Any]]:
        return [(p.name, p.config) for p in plan_nvfp4(shell, config) if p.config is not None]

    def empty(original: nn.Module, cfg: Any) -> nn.Module:
        out_features, in_features = original.weight.shape
        return TorchFP4Linear(
            in_features, out_features, bias=original.bias is not None,
            dtype=original.weight.dtype, device="meta",
        )  # fmt: skip

    def quantize(shell: nn.Module, names: list[str], cfgs: dict, work: torch.device) -> list:
        fused = config.global_scale == "fused"  # siblings share a layer: all read by now
        amax = fused_amax(shell, names) if fused else _own_amax(shell, names)
        for module_name in names:
            module = shell.get_submodule(module_name)
            home = module.weight.device
            built = _nvfp4_quantized(module.to(work), amax[module_name], cfgs[module_name].recipe)
            shell.set_submodule(module_name, built.to(home))
        return []

    return _Method(plans, empty, quantize, lambda: nvfp4_config_to_payload(config))


def _method(config: Any) -> _Method:
    if isinstance(config, FP8Config) and not config.needs_calibration:
        return _fp8_method(config)
    if isinstance(config, NVFP4Config) and not config.needs_calibration:
        return _nvfp4_method(config)
    raise ValueError(
        "quantize: offload='disk' quantizes FP8 (round to nearest, GSQ weight-only) and NVFP4 "
        "round to nearest so far; load the model without offload for GPTQ, NVFP4 GPTQ or W4A4 "
        "and calibrated GSQ"
    )


def _peak_host_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB


def _entries(state: dict[str, torch.Tensor]) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
    """The checkpoint's tensors: ties among the materialized ones dropped as a save drops them
    (meta tensors, the layers' quantized ones, are never tied)."""
    real = {k: v for k, v in state.items() if not v.is_meta}
    keep = set(_unique_names(real))
    return [(k, v.dtype, tuple(v.shape)) for k, v in state.items() if v.is_meta or k in keep]


def quantize_offloaded(
    qm: Any,
    *,
    out: str | Path,
    layout: str | None,
    resume: bool,
    overwrite: bool,
    max_shard_bytes: int,
    work_device: torch.device,
    on_layer: Callable[[int, int], None] | None = None,
    on_module: Callable[[str], None] | None = None,
) -> OffloadReport:
    """Quantize an offloaded model (see the module docstring) and write it to ``out``.

    Raises:
      ValueError: a method offloading does not run yet; as :func:`plan_fp8` and the save (a
        layout that cannot hold the modules; ``out`` exists without ``overwrite``; a staging
        folder without ``resume``, or ``resume`` with other settings).
    """
    config = qm.quantize_config
    source: OffloadSource = qm.offload
    method = _method(config)
    start = time.perf_counter()
    if work_device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(work_device)
    shell = qm.model
    name = normalize_layout(layout or "compressed-tensors")
    plans = method.plans(shell)
    layers_name, layers = decoder_layers(shell)
    inside = {n: cfg for n, cfg in plans if n.startswith(f"{layers_name}.")}
    outside = {n: shell.get_submodule(n) for n, _ in plans if n not in inside}
    # outside the layers (lm_head=True): quantized now, on the CPU
    reports: list[Any] = method.quantize(shell, list(outside), dict(plans), torch.device("cpu"))
    originals = {n: shell.get_submodule(n) for n in inside}
    for module_name, cfg in inside.items():  # the layers' target structure, on meta
        shell.set_submodule(module_name, method.empty(originals[module_name], cfg))
    planned = _export(shell, _modules(shell), config, name)
    entries = _entries(planned.state)
    shards = plan_shards(entries, max_shard_bytes)
    hf = shell.config.to_dict()
    hf["quantization_config"] = planned.quantization_config
    run = {
        "source": str(source.path), "layout": name, "config": method.run(),
        "dtype": str(source.dtype), "max_shard_bytes": max_shard_bytes,
    }  # fmt: skip
    counts = {"done": 0, "resumed": 0}

    def fill(writer: ShardWriter) -> None:
        for entry, _, _ in entries:
            if not entry.startswith(f"{layers_name}.") and entry not in writer.done:
                writer.write(entry, planned.state[entry])
        writer.flush()
        for index in range(len(layers)):
            prefix = f"{layers_name}.{index}."
            names = [e for e, _, _ in entries if e.startswith(prefix)]
            if names and all(n in writer.done for n in names):
                counts["resumed"] += 1
            else:
                _quantize_layer(shell, index, source, inside, originals, work_device, reports,
                                on_module, method)  # fmt: skip
                exported = _export(shell, _modules(shell), config, name).state
                for entry in names:
                    writer.write(entry, exported[entry])
                writer.flush()
                del exported
                release(shell, f"{layers_name}.{index}")
                counts["done"] += 1
            if on_layer is not None:
                on_layer(index, len(layers))

    extra = {n: source.path / n for n in SIDE_FILES if (source.path / n).is_file()}
    try:
        target = write_checkpoint_streamed(
            out, shards, fill, config=hf, quantize_config=planned.quantize_config,
            extra_files=extra, json_files=planned.json_files, run=run, resume=resume,
            overwrite=overwrite,
        )  # fmt: skip
    except BaseException:  # the shell as loaded: the layers' original modules, no storage
        for module_name, module in originals.items():
            release(module, "")
            shell.set_submodule(module_name, module)
        for index in range(len(layers)):
            release(shell, f"{layers_name}.{index}")
        for module_name, module in outside.items():
            shell.set_submodule(module_name, module)
        raise
    device_peak = (
        torch.cuda.max_memory_allocated(work_device) if work_device.type == "cuda" else None
    )
    return OffloadReport(
        counts["done"], counts["resumed"], tuple(reports), time.perf_counter() - start,
        _peak_host_bytes(), device_peak, target,
    )  # fmt: skip


def _quantize_layer(
    shell: nn.Module,
    index: int,
    source: OffloadSource,
    inside: dict[str, Any],
    originals: dict[str, nn.Module],
    work_device: torch.device,
    reports: list[Any],
    on_module: Callable[[str], None] | None,
    method: _Method,
) -> None:
    """Read decoder layer ``index`` from the shards (CPU) and quantize its planned modules as
    the in-memory run does (:func:`~floatxq.lifecycle.fp8.fp8_module`, NVFP4's
    round to nearest), each original's storage released as soon as it is replaced."""
    prefix = f"{source.layers_name}.{index}"
    here = [n for n in inside if n.startswith(f"{prefix}.")]
    for module_name in here:
        shell.set_submodule(module_name, originals[module_name])
    materialize(shell, prefix, source.checkpoint, device="cpu", dtype=source.dtype)
    reports += method.quantize(shell, here, inside, work_device)
    for module_name in here:
        release(originals[module_name], "")
        if on_module is not None:
            on_module(module_name)
