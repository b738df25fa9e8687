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

FP8 (GSQ weight-only included) and NVFP4 round to nearest run this way. The calibrated methods
(GPTQ, NVFP4 GPTQ / W4A4, calibrated GSQ; :mod:`floatxq.lifecycle.offload_calibrated`) run
their own lifecycle over the shell instead, hooked to read each layer before it runs and write
it once solved; their long-lived tensors are written last (the output embedding is solved last).
GPTQ with an activation policy is refused.
"""

import resource
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import torch
from torch import nn

from floatxq.config import FP8Config, GPTQConfig, NVFP4Config
from floatxq.interop.checkpoint import SIDE_FILES, _unique_names
from floatxq.interop.export import _export, _modules, normalize_layout
from floatxq.interop.lazy_source import LazyCheckpoint, build_shell, materialize, release
from floatxq.interop.payload import (
    fp8_config_to_payload,
    gptq_config_to_payload,
    nvfp4_config_to_payload,
)
from floatxq.interop.stream_save import write_checkpoint_streamed
from floatxq.interop.stream_shards import ShardWriter, plan_shards
from floatxq.lifecycle import offload_calibrated
from floatxq.lifecycle.calibration import CalibrationSet
from floatxq.lifecycle.decoder import LayerHooks, LayerInput, decoder_layers
from floatxq.lifecycle.fp8 import fp8_module
from floatxq.lifecycle.nvfp4 import _own_amax, fused_amax
from floatxq.lifecycle.nvfp4 import _quantized as _nvfp4_quantized
from floatxq.lifecycle.offload_calibrated import (
    ActivationCheckpoint,
    CalibratedMethod,
    calibrated_method,
    calibration_fingerprint,
    fp8_empty,
    fp8_plans,
    nvfp4_empty,
    nvfp4_plans,
    weight_amax,
)

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
    modules: tuple[Any, ...]
    """Each module's report as the method's lifecycle gives it (GSQ's, GPTQ's, NVFP4's);
    weight-only FP8 without GSQ and NVFP4 round to nearest give none."""
    seconds: float
    peak_host_bytes: int
    peak_device_bytes: int | None
    out: Path
    names: tuple[str, ...] = ()
    """The quantized modules, in plan order."""
    run: Any = None
    """A calibrated method's run report (:class:`~floatxq.lifecycle.gptq.GPTQRunReport`, ...);
    None for the weight-only ones."""

    def describe(self) -> str:
        """One line: layers quantized and resumed, time, peak host and device memory, output."""
        device = (
            "" if self.peak_device_bytes is None
            else f", peak device memory {self.peak_device_bytes / 1e9:.2f} GB"
        )  # fmt: skip
        resumed = f" ({self.resumed_layers} resumed)" if self.resumed_layers else ""
        return (
            f"offloaded: {self.layers} decoder layers quantized{resumed} in {self.seconds:.1f} s; "
            f"peak host memory {self.peak_host_bytes / 1e9:.2f} GB{device}; wrote {self.out}"
        )


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


def _fp8_method(config: FP8Config) -> _Method:
    def quantize(shell: nn.Module, names: list[str], cfgs: dict, work: torch.device) -> list:
        reports = []
        for module_name in names:
            module = shell.get_submodule(module_name)
            built, report = fp8_module(module_name, module, cfgs[module_name], work_device=work)
            shell.set_submodule(module_name, built)
            reports += [report] if report is not None else []
        return reports

    return _Method(fp8_plans(config), fp8_empty, quantize)


def _nvfp4_method(config: NVFP4Config) -> _Method:
    def quantize(shell: nn.Module, names: list[str], cfgs: dict, work: torch.device) -> list:
        fused = config.global_scale == "fused"  # siblings share a layer: all read by now
        amax = fused_amax(shell, names) if fused else _own_amax(shell, names)
        for module_name in names:
            module = shell.get_submodule(module_name)
            home = module.weight.device
            built = _nvfp4_quantized(module.to(work), amax[module_name], cfgs[module_name].recipe)
            shell.set_submodule(module_name, built.to(home))
        return []

    return _Method(nvfp4_plans(config), nvfp4_empty, quantize)


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
    calibration: CalibrationSet | None = None,
    activation_budget: int | None = None,
    on_layer: Callable[[int, int], None] | None = None,
    on_module: Callable[[str], None] | None = None,
    process_group: Any = None,
    split_rows: bool = False,
) -> OffloadReport:
    """Quantize an offloaded model (see the module docstring) and write it to ``out``.

    Raises:
      ValueError: a method offloading does not run (GPTQ with an activation policy); a
        calibrated method without ``calibration``; as the method's plan and the save (a layout
        that cannot hold the modules; ``out`` exists without ``overwrite``; a staging folder
        without ``resume``, or ``resume`` with other settings or calibration); with a
        ``process_group``, a weight-only method or ``resume``.

    With a ``process_group`` (calibrated methods) every process reads the layers and shares
    the calibration; the group's first process writes ``out``, the others wait for it.
    """
    config = qm.quantize_config
    source: OffloadSource = qm.offload
    calibrated = calibrated_method(config)
    method = _method(config) if calibrated is None else None
    if calibrated is not None and calibration is None:
        raise ValueError(
            "quantize: this method is calibrated (GPTQ, NVFP4 GPTQ or W4A4, calibrated GSQ) and "
            "needs calibration data (strings or token-id tensors)"
        )
    writes = _check_shared(process_group, calibrated is not None, resume)
    start = time.perf_counter()
    if work_device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(work_device)
    shell = qm.model
    name = normalize_layout(layout or "compressed-tensors")
    plans = (method or calibrated).plans(shell)  # type: ignore[union-attr]
    layers_name, layers = decoder_layers(shell)
    inside = {n: cfg for n, cfg in plans if n.startswith(f"{layers_name}.")}
    outside = {n: shell.get_submodule(n) for n, _ in plans if n not in inside}
    reports: list[Any] = []
    if method is not None:  # outside the layers (lm_head=True): quantized now, on the CPU
        reports += method.quantize(shell, list(outside), dict(plans), torch.device("cpu"))
    swapped = dict(plans) if calibrated is not None else inside
    originals = {n: shell.get_submodule(n) for n in swapped}
    empty = (method or calibrated).empty  # type: ignore[union-attr]
    empties = {n: empty(originals[n], cfg) for n, cfg in swapped.items()}
    for module_name, module in empties.items():  # the target structure, on meta
        shell.set_submodule(module_name, module)
    try:
        planned = _export(shell, _modules(shell), config, name)
    finally:
        if calibrated is not None:  # the lifecycle plans and runs over the originals
            for module_name, module in originals.items():
                shell.set_submodule(module_name, module)
    entries = _entries(planned.state)
    shards = plan_shards(entries, max_shard_bytes)
    hf = shell.config.to_dict()
    hf["quantization_config"] = planned.quantization_config
    run = {
        "source": str(source.path), "layout": name, "config": config_payload(config),
        "dtype": str(source.dtype), "max_shard_bytes": max_shard_bytes,
    }  # fmt: skip
    if calibration is not None and calibrated is not None:
        run["calibration"] = calibration_fingerprint(calibration)
    walk = _Walk(shell, source, layers_name, len(layers), entries, config, name, on_layer)
    if calibrated is None:
        fill = walk.weight_only(planned.state, inside, originals, work_device, reports, on_module,
                                method)  # fmt: skip
    else:
        fill = walk.calibrated(calibrated, calibration, empties, originals, inside, resume,
                               work_device, on_module, reports, activation_budget,
                               process_group, split_rows)  # fmt: skip
    extra = {n: source.path / n for n in SIDE_FILES if (source.path / n).is_file()}
    try:
        if writes:
            target = write_checkpoint_streamed(
                out, shards, fill, config=hf, quantize_config=planned.quantize_config,
                extra_files=extra, json_files=planned.json_files, run=run, resume=resume,
                overwrite=overwrite,
            )  # fmt: skip
        else:  # another process of the group writes: this one only computes
            fill(None)
            target = Path(out)
        if process_group is not None:
            import torch.distributed as dist

            dist.barrier(group=process_group)  # returns once the writer has finished

    except BaseException:  # the shell as loaded: the original modules, no storage in the layers
        for module_name, module in originals.items():
            if module_name in inside:
                release(module, "")
            else:
                module.to("cpu")
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
        walk.counts["done"], walk.counts["resumed"], tuple(reports), time.perf_counter() - start,
        _peak_host_bytes(), device_peak, target, tuple(n for n, _ in plans), walk.result,
    )  # fmt: skip


def _check_shared(group: Any, calibrated: bool, resume: bool) -> bool:
    """Whether this process writes the checkpoint (the group's first, or the only one); a
    group is refused for what it does not share."""
    if group is None:
        return True
    if not calibrated:
        raise ValueError(
            "quantize: an offloaded weight-only run (FP8 / NVFP4 round to nearest) reads and "
            "writes at disk speed and is not shared by a process group; run it in one process"
        )
    if resume:
        raise ValueError(
            "quantize: resume=True is not taken with process_group; finish the run in one "
            "process (it resumes from what the group wrote)"
        )
    import torch.distributed as dist

    return dist.get_rank(group) == 0


def config_payload(config: Any) -> Any:
    """The settings of a run as JSON (a resumed run must give the same)."""
    if isinstance(config, GPTQConfig):
        return gptq_config_to_payload(config)
    if isinstance(config, NVFP4Config):
        return nvfp4_config_to_payload(config)
    return fp8_config_to_payload(config)


class _Walk:
    """One offloaded run's pass over the decoder layers, writing each as it is done."""

    def __init__(
        self, shell: nn.Module, source: OffloadSource, layers_name: str, count: int,
        entries: list[tuple[str, torch.dtype, tuple[int, ...]]], config: Any, layout: str,
        on_layer: Callable[[int, int], None] | None,
    ) -> None:  # fmt: skip
        self.shell, self.source, self.layers_name, self.count = shell, source, layers_name, count
        self.entries, self.config, self.layout, self.on_layer = entries, config, layout, on_layer
        self.counts = {"done": 0, "resumed": 0}
        self.result: Any = None

    def names(self, index: int) -> list[str]:
        prefix = f"{self.layers_name}.{index}."
        return [e for e, _, _ in self.entries if e.startswith(prefix)]

    def write(self, writer: ShardWriter | None, names: list[str]) -> None:
        """Export the shell and write ``names`` (those not yet done), then flush (nothing
        without a writer: another process writes)."""
        if writer is None:
            return
        todo = [e for e in names if e not in writer.done]
        if todo:
            exported = _export(self.shell, _modules(self.shell), self.config, self.layout).state
            for entry in todo:
                writer.write(entry, exported[entry])
            del exported
        writer.flush()

    def outside(self) -> list[str]:
        return [e for e, _, _ in self.entries if not e.startswith(f"{self.layers_name}.")]

    def weight_only(
        self, state: dict[str, torch.Tensor], inside: dict[str, Any],
        originals: dict[str, nn.Module], work_device: torch.device, reports: list[Any],
        on_module: Callable[[str], None] | None, method: Any,
    ) -> Callable[[ShardWriter], None]:  # fmt: skip
        """FP8 and NVFP4 round to nearest: the long-lived tensors first, then layer by layer."""

        def fill(writer: ShardWriter) -> None:
            for entry in self.outside():
                if entry not in writer.done:
                    writer.write(entry, state[entry])
            writer.flush()
            for index in range(self.count):
                names = self.names(index)
                if names and all(n in writer.done for n in names):
                    self.counts["resumed"] += 1
                else:
                    _quantize_layer(self.shell, index, self.source, inside, originals,
                                    work_device, reports, on_module, method)  # fmt: skip
                    self.write(writer, names)
                    release(self.shell, f"{self.layers_name}.{index}")
                    self.counts["done"] += 1
                if self.on_layer is not None:
                    self.on_layer(index, self.count)

        return fill

    def calibrated(
        self, calibrated: CalibratedMethod, calibration: Any, empties: dict[str, nn.Module],
        originals: dict[str, nn.Module], inside: dict[str, Any], resume: bool,
        work_device: torch.device,
        on_module: Callable[[str], None] | None, reports: list[Any], budget: int | None,
        group: Any = None, split_rows: bool = False,
    ) -> Callable[[ShardWriter | None], None]:  # fmt: skip
        """GPTQ, NVFP4 GPTQ / W4A4, calibrated GSQ: the method's own lifecycle, hooked to read
        each layer before it runs and write it once solved; the long-lived tensors last (the
        output embedding is solved last)."""
        shell, layers_name = self.shell, self.layers_name
        held: set[int] = set()

        def enter(index: int) -> None:
            if index not in held:
                materialize(shell, f"{layers_name}.{index}", self.source.checkpoint,
                            device="cpu", dtype=self.source.dtype)  # fmt: skip
                held.add(index)

        def drop(index: int) -> None:
            release(shell, f"{layers_name}.{index}")
            held.discard(index)

        def fill(writer: ShardWriter | None) -> None:
            checkpoint = None  # a group's run is not resumed: no activation checkpoints
            if group is None and writer is not None:
                seconds = offload_calibrated.CHECKPOINT_SECONDS
                checkpoint = ActivationCheckpoint(writer.directory, seconds)

            def done(index: int) -> bool:
                return writer is not None and all(n in writer.done for n in self.names(index))

            def leave(index: int, inputs: list[LayerInput]) -> None:
                prefix = f"{layers_name}.{index}."
                if done(index):
                    self.counts["resumed"] += 1
                else:
                    self.write(writer, self.names(index))
                    self.counts["done"] += 1
                for module_name in inside:  # the planned structure back, the solved freed
                    if module_name.startswith(prefix):
                        shell.set_submodule(module_name, empties[module_name])
                        release(originals[module_name], "")  # its storage: on the work device
                drop(index)
                if checkpoint is not None and index < self.count - 1 and checkpoint.due():
                    checkpoint.save(index + 1, inputs)
                if self.on_layer is not None:
                    self.on_layer(index, self.count)

            def begin(inputs: list[LayerInput]) -> int:
                first = checkpoint.restore(inputs, done) if resume and checkpoint else 0
                self.counts["resumed"] += first
                return first

            amax = None
            if calibrated.reads_amax:
                by_layer = {i: [n for n in inside if n.startswith(f"{layers_name}.{i}.")]
                            for i in range(self.count)}  # fmt: skip
                fused = getattr(self.config, "global_scale", None) == "fused"
                amax = weight_amax(shell, list(empties), by_layer, fused, enter, drop)
            self.result = calibrated.run(
                shell, calibration, device=work_device, hooks=LayerHooks(enter, leave, begin),
                on_module=on_module, amax=amax, activation_budget=budget,
                process_group=group, **({"split_rows": True} if split_rows else {}),
            )  # fmt: skip
            reports.extend(self.result.modules)
            self.write(writer, self.outside())
            if checkpoint is not None:
                checkpoint.remove()

        return fill


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
