"""The calibrated methods offloaded to disk: GPTQ, NVFP4 GPTQ / W4A4 and calibrated FP8 GSQ run
layer by layer from the shards (:mod:`floatxq.lifecycle.offload` drives them).

Each method runs its own in-memory lifecycle (:func:`~floatxq.lifecycle.gptq.quantize_gptq_model`,
:func:`~floatxq.lifecycle.nvfp4_calibrated.quantize_nvfp4_calibrated`,
:func:`~floatxq.lifecycle.fp8_gsq.quantize_fp8_calibrated`) over the meta-device shell, with
:class:`~floatxq.lifecycle.decoder.LayerHooks` that read each decoder layer before it runs and
hand it to the writer once solved: the same per-layer steps, so the same bytes.

A resumed run needs the inputs of the first layer it runs. They are kept, at most every
:data:`CHECKPOINT_SECONDS`, in the staging folder (:class:`ActivationCheckpoint`, a safetensors
file written a batch at a time); a resumed run starts from the last one kept, solving again (but
not writing again) the layers flushed after it.
"""

import hashlib
import json
import os
import shutil
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, NamedTuple

import torch
from safetensors import safe_open
from torch import nn

from floatxq.config import FP8Config, GPTQConfig, NVFP4Config
from floatxq.interop.checkpoint import CheckpointError
from floatxq.interop.export_gptq import _GptqFacts
from floatxq.interop.stream_shards import ShardWriter, plan_shards
from floatxq.lifecycle.calibration import CalibrationSet
from floatxq.lifecycle.decoder import LayerInput, features
from floatxq.lifecycle.fp8 import _check_divisible, plan_fp8
from floatxq.lifecycle.nvfp4 import _own_amax, fused_amax, plan_nvfp4
from floatxq.nn.fp4_linear import TorchFP4Linear
from floatxq.nn.fp8_linear import TorchFP8Linear
from floatxq.nn.gptq_linear import GPTQLinear

__all__ = [
    "CHECKPOINT_SECONDS",
    "ActivationCheckpoint",
    "CalibratedMethod",
    "calibrated_method",
    "calibration_fingerprint",
    "fp8_empty",
    "fp8_plans",
    "nvfp4_empty",
    "nvfp4_plans",
]

CHECKPOINT_SECONDS = 600.0
"""The least time between two activation checkpoints of a calibrated offloaded run (the inputs
of the next layer kept for a resume): a resumed run redoes at most about this much work."""

POINTER_FILE = "offload-activations.json"
"""The staging folder's record of its newest activation checkpoint (removed when done)."""


class CalibratedMethod(NamedTuple):
    """How one calibrated method plans, builds empty and runs offloaded."""

    plans: Callable[[nn.Module], list[tuple[str, Any]]]
    """``(name, resolved config)`` of every module the run quantizes (checked first)."""
    empty: Callable[[nn.Module, Any], nn.Module]
    """The quantized module of an original, empty, on the meta device (what the export plans)."""
    run: Callable[..., Any]
    """``run(shell, calibration, device=, hooks=, on_module=, amax=)``: the lifecycle's report."""
    reads_amax: bool
    """The run needs every weight's amax first (NVFP4's global scales): a pass over the layers."""


def _gptq_empty(original: nn.Module, cfg: GPTQConfig) -> nn.Module:
    k, n = features(original)
    bias = getattr(original, "bias", None)
    empty = GPTQLinear(
        k, n, bits=cfg.bits, group_size=cfg.group_size, format=cfg.format,
        bias=bias is not None, bias_dtype=bias.dtype if bias is not None else torch.float16,
        device="meta",
    )  # fmt: skip
    # what its solved buffers will hold: the export reads this of a module without values
    empty.planned_facts = _GptqFacts(cfg.sym, not cfg.desc_act, None)
    return empty


def _gptq_method(config: GPTQConfig) -> CalibratedMethod:
    from floatxq.lifecycle.gptq import plan_gptq, quantize_gptq_model

    if config.activation is not None:
        raise ValueError(
            "quantize: offload='disk' runs GPTQ without an activation policy (W4A16); a W4A "
            "policy's replay and installed stream need the model in memory, so load it without "
            "offload"
        )

    def plans(shell: nn.Module) -> list[tuple[str, Any]]:
        return [(p.name, p.config) for p in plan_gptq(shell, config) if p.config is not None]

    def run(shell: nn.Module, calibration: CalibrationSet, **kw: Any) -> Any:
        kw.pop("amax")
        return quantize_gptq_model(shell, config, calibration, **kw)

    return CalibratedMethod(plans, _gptq_empty, run, False)


def nvfp4_plans(config: NVFP4Config) -> Callable[[nn.Module], list[tuple[str, Any]]]:
    """NVFP4's planned modules of a shell with their resolved settings."""

    def plans(shell: nn.Module) -> list[tuple[str, Any]]:
        return [(p.name, p.config) for p in plan_nvfp4(shell, config) if p.config is not None]

    return plans


def nvfp4_empty(original: nn.Module, cfg: NVFP4Config) -> nn.Module:
    """An original's ``TorchFP4Linear``, empty on meta (an input scale under W4A4)."""
    out_features, in_features = original.weight.shape
    return TorchFP4Linear(
        in_features, out_features, bias=original.bias is not None,
        dtype=original.weight.dtype, device="meta", input_scale=cfg.activations is not None,
    )  # fmt: skip


def fp8_plans(config: FP8Config) -> Callable[[nn.Module], list[tuple[str, Any]]]:
    """FP8's planned modules of a shell with their resolved settings (block sizes checked)."""

    def plans(shell: nn.Module) -> list[tuple[str, Any]]:
        found = [(p.name, p.config) for p in plan_fp8(shell, config) if p.config is not None]
        for module_name, cfg in found:
            _check_divisible(module_name, shell.get_submodule(module_name), cfg)
        return found

    return plans


def fp8_empty(original: nn.Module, cfg: FP8Config) -> nn.Module:
    """An original's ``TorchFP8Linear``, empty on meta."""
    return TorchFP8Linear.empty_like(
        original, format=cfg.format, weight_scale_method=cfg.weight_scale_method,
        weight_block_size=cfg.weight_block_size, device="meta",
    )  # fmt: skip


def _nvfp4_method(config: NVFP4Config) -> CalibratedMethod:
    from floatxq.lifecycle.nvfp4_calibrated import quantize_nvfp4_calibrated

    def run(shell: nn.Module, calibration: CalibrationSet, **kw: Any) -> Any:
        return quantize_nvfp4_calibrated(shell, config, calibration, **kw)

    return CalibratedMethod(nvfp4_plans(config), nvfp4_empty, run, True)


def _fp8_method(config: FP8Config) -> CalibratedMethod:
    from floatxq.lifecycle.fp8_gsq import quantize_fp8_calibrated

    def run(shell: nn.Module, calibration: CalibrationSet, **kw: Any) -> Any:
        kw.pop("amax")
        return quantize_fp8_calibrated(shell, config, calibration, **kw)

    return CalibratedMethod(fp8_plans(config), fp8_empty, run, False)


def calibrated_method(config: Any) -> CalibratedMethod | None:
    """The offloaded run of a calibrated ``config``; None for the weight-only ones.

    Raises:
      ValueError: GPTQ with an activation policy (W4A), which offloading does not run.
    """
    if isinstance(config, GPTQConfig):
        return _gptq_method(config)
    if isinstance(config, NVFP4Config) and config.needs_calibration:
        return _nvfp4_method(config)
    if isinstance(config, FP8Config) and config.needs_calibration:
        return _fp8_method(config)
    return None


def weight_amax(
    shell: nn.Module, names: list[str], layer_names: Mapping[int, list[str]], fused: bool,
    read: Callable[[int], None], drop: Callable[[int], None],
) -> dict[str, torch.Tensor]:  # fmt: skip
    """NVFP4's amax of every planned weight, a layer read at a time (fused siblings share a
    layer, so a layer's maxima are those of the whole-model pass)."""
    found: dict[str, torch.Tensor] = {}
    amax = fused_amax if fused else _own_amax
    for index, here in layer_names.items():
        read(index)
        found.update(amax(shell, here))
        drop(index)
    inside = {n for here in layer_names.values() for n in here}
    rest = [n for n in names if n not in inside]
    found.update(amax(shell, rest) if rest else {})
    return found


def calibration_fingerprint(calibration: CalibrationSet) -> str:
    """A digest of the prepared batches (ids and masks): a resumed run must give the same."""
    digest = hashlib.sha256()
    for batch in calibration.batches:
        for tensor in (batch.input_ids, batch.attention_mask):
            flat = tensor.detach().to("cpu", torch.int64).contiguous()
            digest.update(repr(tuple(flat.shape)).encode())
            digest.update(flat.numpy().tobytes())
    return digest.hexdigest()


class ActivationCheckpoint:
    """The inputs of a decoder layer, kept in a staging folder so a resumed run starts there.

    Each checkpoint is a folder ``offload-activations-N`` (``hidden.J``: batch J's hidden
    states, written one batch at a time through a
    :class:`~floatxq.interop.stream_shards.ShardWriter`); :data:`POINTER_FILE`, replaced
    atomically, names the newest complete one, and the older one is removed after it.
    """

    def __init__(self, staging: Path, every: float) -> None:
        self.staging = staging
        self.every = every
        self.last = time.monotonic()

    def due(self) -> bool:
        return time.monotonic() - self.last >= self.every

    def save(self, layer: int, inputs: list[LayerInput]) -> None:
        """Keep ``inputs`` (layer ``layer``'s) as the newest checkpoint."""
        entries = [(f"hidden.{j}", x.hidden.dtype, x.hidden.shape) for j, x in enumerate(inputs)]
        folder = self.staging / f"offload-activations-{layer}"
        shutil.rmtree(folder, ignore_errors=True)
        writer = ShardWriter(folder, plan_shards(entries, 1 << 62))
        for j, item in enumerate(inputs):
            writer.write(f"hidden.{j}", item.hidden)
        writer.finish()
        old = self._pointed()
        tmp = self.staging / f".{POINTER_FILE}.tmp"
        with open(tmp, "w", encoding="utf-8") as fh:
            json.dump({"layer": layer, "folder": folder.name, "batches": len(inputs)}, fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, self.staging / POINTER_FILE)
        if old is not None and old["folder"] != folder.name:
            shutil.rmtree(self.staging / old["folder"], ignore_errors=True)
        self.last = time.monotonic()

    def _pointed(self) -> dict[str, Any] | None:
        path = self.staging / POINTER_FILE
        if not path.is_file():
            return None
        try:
            record = json.loads(path.read_text(encoding="utf-8"))
            return {"layer": int(record["layer"]), "folder": str(record["folder"]),
                    "batches": int(record["batches"])}  # fmt: skip
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise CheckpointError(
                f"quantize: {path} cannot be read ({exc}); delete {self.staging} to start over"
            ) from None

    def restore(self, inputs: list[LayerInput], done: Callable[[int], bool]) -> int:
        """Replace ``inputs``' hidden states by the newest checkpoint's, in place, and return
        its layer; 0 (nothing changed) when there is none or a layer before it is not done.

        Raises:
          CheckpointError: a checkpoint whose batches differ from ``inputs`` in count, dtype or
            shape (the run record matched, so the folder was damaged).
        """
        record = self._pointed()
        if record is None or not all(done(i) for i in range(record["layer"])):
            return 0
        path = self.staging / record["folder"] / "model.safetensors"
        if record["batches"] != len(inputs):
            raise CheckpointError(
                f"quantize: {path} holds {record['batches']} batches, the calibration "
                f"{len(inputs)}; delete {self.staging} to start over"
            )
        with safe_open(str(path), framework="pt") as fh:
            for j, item in enumerate(inputs):
                hidden = fh.get_tensor(f"hidden.{j}")
                if hidden.dtype != item.hidden.dtype or hidden.shape != item.hidden.shape:
                    raise CheckpointError(
                        f"quantize: {path}: batch {j} is {hidden.dtype} {tuple(hidden.shape)}, "
                        f"the run's {item.hidden.dtype} {tuple(item.hidden.shape)}; delete "
                        f"{self.staging} to start over"
                    )
                inputs[j] = item._replace(hidden=hidden.to(item.hidden.device))
        return record["layer"]

    def remove(self) -> None:
        """Remove every checkpoint (the run is done)."""
        record = self._pointed()
        (self.staging / POINTER_FILE).unlink(missing_ok=True)
        if record is not None:
            shutil.rmtree(self.staging / record["folder"], ignore_errors=True)
        for folder in self.staging.glob("offload-activations-*"):
            shutil.rmtree(folder, ignore_errors=True)
