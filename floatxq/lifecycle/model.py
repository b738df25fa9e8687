"""``floatxq.load`` and :class:`QuantizedModel`: load → quantize → save → load.

A plain model (an ``nn.Module`` or a Hugging Face model directory) is wrapped for quantization; a
directory saved by floatxq (``config.json`` with an FP8 ``quantization_config`` and FP8 weights
with ``weight_scale_inv``) is rebuilt module by module from its files, without quantizing again.
Nothing is fetched from a hub: paths are local.
"""

import os
import time
import warnings
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from floatxq.config import BACKEND, METHOD, FP8Config, GPTQConfig
from floatxq.fp8 import infer_scale_layout
from floatxq.lifecycle.checkpoint import (
    CONFIG_FILE,
    TOKENIZER_FILES,
    CheckpointError,
    TensorInfo,
    iter_tensors,
    read_json,
    tensor_infos,
    write_checkpoint,
)
from floatxq.lifecycle.fp8 import quantize_fp8_modules
from floatxq.lifecycle.payload import fp8_config_from_payload, fp8_config_to_payload, payload_method
from floatxq.nn.fp8_linear import TorchFP8Linear


def _resolve_backend(backend: Any) -> BACKEND:
    """The backend that runs the model: FP8 weight-only models run on ``fp8_torch``."""
    if isinstance(backend, str):
        try:
            chosen = BACKEND(str.lower(str.strip(backend)))
        except ValueError:
            chosen = None
        if chosen is not None:
            return BACKEND.FP8_TORCH if chosen == BACKEND.AUTO else chosen
    accepted = ", ".join(repr(b.value) for b in BACKEND)
    raise ValueError(
        f"load: backend {backend!r} is not available in floatxq; accepted: {accepted} (FP8 "
        f"weight-only models run on 'fp8_torch')"
    )


_GPTQ_NOT_YET = (
    "GPTQ models are not available yet in floatxq.load (only the solver is: floatxq.gptq_solve "
    "with floatxq.lifecycle.gptq_solve_options(config.resolve(module_name)))"
)


def _as_fp8_config(value: Any) -> FP8Config:
    if isinstance(value, FP8Config):
        return value
    if isinstance(value, GPTQConfig):
        raise TypeError(f"load: quantize_config is a GPTQConfig; {_GPTQ_NOT_YET}")
    if isinstance(value, Mapping):
        method = payload_method(value) or METHOD.FP8.value
        if method == METHOD.GPTQ:
            raise ValueError(f"load: quantize_config method 'gptq': {_GPTQ_NOT_YET}")
        if method != METHOD.FP8:
            raise ValueError(
                f"load: quantize_config method {method!r} is not supported; accepted: 'fp8'"
            )
        return fp8_config_from_payload(value)
    raise TypeError(
        f"load: quantize_config must be an FP8Config, its payload mapping or None, got "
        f"{type(value).__name__}"
    )


def _build_from_config(config_payload: Mapping[str, Any], *, device: Any, dtype: Any) -> nn.Module:
    from transformers import AutoConfig, AutoModelForCausalLM

    payload = {k: v for k, v in config_payload.items() if k != "quantization_config"}
    model_type = payload.pop("model_type", None)
    if not model_type:
        raise CheckpointError(f"load: {CONFIG_FILE} has no 'model_type'")
    config = AutoConfig.for_model(model_type, **payload)
    kwargs = {"dtype": dtype} if dtype is not None else {}
    with torch.device(device if device is not None else "cpu"):
        try:
            model = AutoModelForCausalLM.from_config(config, **kwargs)
        except TypeError:  # transformers releases that still call it torch_dtype
            model = AutoModelForCausalLM.from_config(config, torch_dtype=dtype)
    return model.eval()


def _load_plain(path: Path, *, device: Any, dtype: Any) -> nn.Module:
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    kwargs: dict[str, Any] = {"local_files_only": True}
    if dtype is not None:
        kwargs["dtype"] = dtype
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # floatxq shows its own progress where work is long
    try:
        model = AutoModelForCausalLM.from_pretrained(str(path), **kwargs)
    finally:
        if bars:
            hf_logging.enable_progress_bar()
    if device is not None:
        model = model.to(device)
    return model.eval()


def _load_quantized(path: Path, config_payload: Mapping[str, Any], *, device: Any, dtype: Any):
    qpayload = config_payload["quantization_config"]
    if not isinstance(qpayload, Mapping):
        raise CheckpointError(f"load: {path / CONFIG_FILE} 'quantization_config' is not an object")
    method = payload_method(qpayload)
    if method == METHOD.GPTQ:
        raise CheckpointError(f"load: {path / CONFIG_FILE} declares method 'gptq'; {_GPTQ_NOT_YET}")
    if method != METHOD.FP8:
        raise CheckpointError(
            f"load: {path / CONFIG_FILE} quantization_config method {method!r} is not supported; "
            f"accepted: 'fp8'"
        )
    try:
        qconfig = fp8_config_from_payload(qpayload)
    except (TypeError, ValueError) as exc:
        raise CheckpointError(f"load: {path / CONFIG_FILE} quantization_config: {exc}") from None
    infos = {info.name: info for info in tensor_infos(path)}
    model = _build_from_config(config_payload, device=device, dtype=dtype)
    modules = dict(model.named_modules())
    for name, info in infos.items():
        if not name.endswith(".weight_scale_inv"):
            continue
        prefix = name[: -len(".weight_scale_inv")]
        weight = infos.get(f"{prefix}.weight")
        if weight is None:
            raise CheckpointError(f"load: {info.file} has {name} but no {prefix}.weight")
        if prefix not in modules:
            raise CheckpointError(
                f"load: tensor {name} names no module of the {type(model).__name__}"
            )
        if len(weight.shape) != 2:
            raise CheckpointError(f"load: {prefix}.weight must be 2-D, got {weight.shape}")
        try:
            layout, block = infer_scale_layout(weight.shape, info.shape)
        except ValueError as exc:
            raise CheckpointError(f"load: {name} in {info.file}: {exc}") from None
        resolved = qconfig.resolve(prefix) or qconfig
        original = modules[prefix]
        fp8 = TorchFP8Linear.empty_like(
            original,
            format=_stored_fp8_format(weight, resolved.format),
            weight_scale_method=layout,
            weight_block_size=block if layout == "block" else None,
            device=device,
        )
        if tuple(fp8.weight.shape) != tuple(weight.shape):
            raise CheckpointError(
                f"load: {prefix}.weight in {weight.file} is {weight.shape}, but the model's "
                f"{type(original).__name__} {prefix!r} needs {tuple(fp8.weight.shape)}"
            )
        model.set_submodule(prefix, fp8)
    state = dict(iter_tensors(path, device=device if device is not None else "cpu"))
    result = model.load_state_dict(state, strict=False)
    tied = _tied_names(model)
    missing = [k for k in result.missing_keys if k not in tied]
    if missing or result.unexpected_keys:
        raise CheckpointError(
            f"load: {path} does not match the model: missing tensors {missing[:8]}, unexpected "
            f"tensors {result.unexpected_keys[:8]}"
        )
    if tied:
        model.tie_weights()
    return model.eval(), qconfig


_SAFETENSORS_FP8 = {
    "F8_E4M3": "float8_e4m3fn",
    "F8_E5M2": "float8_e5m2",
    "F8_E4M3FNUZ": "float8_e4m3fnuz",
    "F8_E5M2FNUZ": "float8_e5m2fnuz",
}


def _stored_fp8_format(weight: TensorInfo, declared: str) -> str:
    stored = _SAFETENSORS_FP8.get(weight.dtype)
    if stored is None:
        raise CheckpointError(
            f"load: {weight.name} in {weight.file} has dtype {weight.dtype}; FP8 weights must be "
            f"one of {sorted(_SAFETENSORS_FP8)}"
        )
    if stored != declared:
        raise CheckpointError(
            f"load: {weight.name} in {weight.file} is {stored} but quantization_config declares "
            f"format {declared!r}"
        )
    return stored


def _tied_names(model: nn.Module) -> set[str]:
    config = getattr(model, "config", None)
    if not getattr(config, "tie_word_embeddings", False):
        return set()
    getter = getattr(model, "get_output_embeddings", None)
    head = getter() if callable(getter) else None
    return {f"{n}.weight" for n, m in model.named_modules() if head is not None and m is head}


class QuantizedModel:
    """A model plus the quantization that was or will be applied to it.

    ``quantize()`` replaces modules in place (one at a time), ``save(path)`` writes a checkpoint
    that ``floatxq.load(path)`` rebuilds bit for bit, and ``model`` is the ``nn.Module`` to run.

    Numerics: FP8 weight-only as :func:`floatxq.quantize_fp8_weight`.
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        quantize_config: FP8Config | None,
        backend: BACKEND,
        quantized: bool = False,
        source: Path | None = None,
        device: torch.device | None = None,
    ) -> None:
        self.model = model
        self.quantize_config = quantize_config
        self.backend = backend
        self.quantized = quantized
        self.quantized_modules: list[str] = (
            [n for n, m in model.named_modules() if isinstance(m, TorchFP8Linear)]
            if quantized
            else []
        )
        self.source = source
        self.device = device
        self.quantize_seconds: float | None = None

    def __repr__(self) -> str:
        state = f"{len(self.quantized_modules)} FP8 modules" if self.quantized else "not quantized"
        return f"QuantizedModel({type(self.model).__name__}, {state}, backend={self.backend.value})"

    def quantize(
        self,
        calibration: Iterable[Any] | None = None,
        *,
        batch_size: int = 1,
        progress: bool | Callable[[str], None] = True,
    ) -> "QuantizedModel":
        """Quantize the model's linear modules in place (FP8 weight-only: no calibration).

        Args:
          calibration: ignored by the FP8 weight-only lifecycle (a warning says so).
          batch_size: unused by FP8 (kept for the calibrated lifecycles' signature).
          progress: show a progress bar (True), stay quiet (False), or a callback per module.

        Raises:
          RuntimeError: no quantize_config, or the model is already quantized.

        Numerics: as :func:`floatxq.quantize_fp8_weight`.
        """
        del batch_size
        if self.quantize_config is None:
            raise RuntimeError("quantize: no quantize_config was given to floatxq.load")
        if self.quantized:
            raise RuntimeError("quantize: this model is already quantized")
        if calibration is not None:
            warnings.warn(
                "quantize: FP8 weight-only quantization needs no calibration data; the given "
                "dataset is ignored",
                UserWarning,
                stacklevel=2,
            )
        callback, bar = _progress(progress, self.model, self.quantize_config)
        start = time.perf_counter()
        try:
            self.quantized_modules = quantize_fp8_modules(
                self.model, self.quantize_config, device=self.device, on_module=callback
            )
        finally:
            if bar is not None:
                bar.close()
        self.quantize_seconds = time.perf_counter() - start
        self.quantized = True
        return self

    def save(
        self,
        path: str | os.PathLike[str],
        *,
        max_shard_size: int | str = "4GB",
        overwrite: bool = False,
    ) -> Path:
        """Write safetensors shards, ``config.json`` (with ``quantization_config``) and
        ``quantize_config.json`` into ``path`` atomically (temporary directory, then rename).

        Raises:
          RuntimeError: the model is not quantized. FileExistsError: ``path`` exists.

        Numerics: bytes as stored (FP8 codes, FP32 inverse scales, FP16 biases).
        """
        if not self.quantized or self.quantize_config is None:
            raise RuntimeError("save: quantize() the model first (or load a quantized checkpoint)")
        qdict = fp8_config_to_payload(self.quantize_config)
        config_obj = getattr(self.model, "config", None)
        if config_obj is None or not hasattr(config_obj, "to_dict"):
            raise TypeError("save: the model has no Hugging Face config to write as config.json")
        config = config_obj.to_dict()
        config["quantization_config"] = qdict
        extra = {}
        if self.source is not None:
            extra = {n: self.source / n for n in TOKENIZER_FILES if (self.source / n).is_file()}
        return write_checkpoint(
            path,
            self.model.state_dict(),
            config=config,
            quantize_config=qdict,
            extra_files=extra,
            max_shard_bytes=_parse_size(max_shard_size),
            overwrite=overwrite,
        )


def _parse_size(value: int | str) -> int:
    if isinstance(value, int):
        return value
    text = value.strip().upper()
    for unit, factor in (("GB", 1024**3), ("MB", 1024**2), ("KB", 1024), ("B", 1)):
        if text.endswith(unit):
            try:
                return int(float(text[: -len(unit)]) * factor)
            except ValueError:
                break
    raise ValueError(f"save: max_shard_size must be bytes or like '4GB'/'500MB', got {value!r}")


def _progress(progress: Any, model: nn.Module, config: FP8Config):
    if callable(progress) and not isinstance(progress, bool):
        return progress, None
    if not progress:
        return None, None
    try:
        from tqdm.auto import tqdm
    except ImportError:  # pragma: no cover - tqdm comes with transformers
        return None, None
    from floatxq.lifecycle.fp8 import plan_fp8

    total = sum(p.config is not None for p in plan_fp8(model, config))
    bar = tqdm(total=total, desc="fp8 quantize", unit="module", leave=False)
    return (lambda _name: bar.update(1)), bar


def load(
    model_or_path: nn.Module | str | os.PathLike[str],
    *,
    quantize_config: FP8Config | Mapping[str, Any] | None = None,
    device: str | torch.device | None = None,
    dtype: torch.dtype | None = None,
    backend: str | BACKEND = "auto",
) -> QuantizedModel:
    """Load a model to quantize, or a floatxq-quantized checkpoint to run.

    Args:
      model_or_path: an ``nn.Module`` (used as is, not copied) or a local Hugging Face model
        directory. A directory whose ``config.json`` holds an FP8 ``quantization_config`` is
        rebuilt from its files: its ``TorchFP8Linear`` modules get the saved bytes.
      quantize_config: an ``FP8Config`` (or its payload, see :mod:`floatxq.lifecycle.payload`)
        for :meth:`QuantizedModel.quantize`; ignored with a warning for an already-quantized
        checkpoint. GPTQ models are not available yet here (a ``GPTQConfig`` is refused).
      device: where the model (and each quantized module) lives.
      dtype: dtype of the unquantized parameters (default: the checkpoint's / the model's).
      backend: ``"auto"`` or ``"fp8_torch"`` (the members of :class:`~floatxq.config.BACKEND`).

    Raises:
      CheckpointError (a ValueError): missing/corrupt/truncated files, inconsistent tensors.
      ValueError: unknown method or backend. TypeError: a wrong kind of argument.

    Numerics: loading is bit-exact; quantization as :func:`floatxq.quantize_fp8_weight`.
    """
    dev = torch.device(device) if device is not None else None
    if isinstance(model_or_path, nn.Module):
        config = _as_fp8_config(quantize_config) if quantize_config is not None else None
        chosen = _resolve_backend(backend)
        model = model_or_path.to(dev) if dev is not None else model_or_path
        already = any(isinstance(m, TorchFP8Linear) for m in model.modules())
        return QuantizedModel(
            model, quantize_config=config, backend=chosen, quantized=already, device=dev
        )
    if not isinstance(model_or_path, (str, os.PathLike)):
        raise TypeError(
            f"load: model_or_path must be an nn.Module or a directory path, got "
            f"{type(model_or_path).__name__}"
        )
    path = Path(model_or_path)
    if not path.is_dir():
        raise CheckpointError(f"load: {path} is not a model directory (no hub downloads here)")
    payload = read_json(path / CONFIG_FILE, what="load")
    if "quantization_config" in payload:
        model, qconfig = _load_quantized(path, payload, device=dev, dtype=dtype)
        chosen = _resolve_backend(backend)
        if quantize_config is not None:
            warnings.warn(
                f"load: {path} is already quantized; quantize_config is ignored",
                UserWarning,
                stacklevel=2,
            )
        return QuantizedModel(
            model, quantize_config=qconfig, backend=chosen, quantized=True, source=path, device=dev
        )
    if any(info.name.endswith(".weight_scale_inv") for info in tensor_infos(path)):
        raise CheckpointError(
            f"load: {path / CONFIG_FILE} has no 'quantization_config' but the tensors hold FP8 "
            f"scales (weight_scale_inv): the checkpoint's quantization is undeclared"
        )
    config = _as_fp8_config(quantize_config) if quantize_config is not None else None
    chosen = _resolve_backend(backend)
    model = _load_plain(path, device=dev, dtype=dtype)
    return QuantizedModel(model, quantize_config=config, backend=chosen, source=path, device=dev)


__all__ = ["QuantizedModel", "load"]
