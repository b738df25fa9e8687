"""``floatxq.load`` and :class:`QuantizedModel`: load → quantize → save → load.

A plain model (an ``nn.Module`` or a Hugging Face model directory) is wrapped for quantization; a
directory saved by floatxq (``config.json`` with an FP8 ``quantization_config`` and FP8 weights
with ``weight_scale_inv``) is rebuilt module by module from its files, without quantizing again.
Nothing is fetched from a hub: paths are local.
"""

import contextlib
import os
import re
import time
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from floatxq.config import (
    BACKEND,
    METHOD,
    FP8Config,
    GPTQConfig,
    backend_for_activation,
)
from floatxq.interop.checkpoint import (
    CONFIG_FILE,
    TOKENIZER_FILES,
    CheckpointError,
    iter_tensors,
    read_json,
    recover_interrupted_save,
    tensor_infos,
    write_checkpoint,
)
from floatxq.interop.export import DEFAULT_LAYOUT
from floatxq.interop.payload import (
    fp8_config_from_payload,
    gptq_config_from_payload,
    payload_method,
)
from floatxq.lifecycle.fp8 import quantize_fp8_modules
from floatxq.lifecycle.w4a_install import install_activation_stream, install_w4a_modules
from floatxq.nn.fp8_linear import TorchFP8Linear

_W4A_BACKENDS = (BACKEND.GPTQ_W4AFP8, BACKEND.GPTQ_W4A_NVFP4)
"""Backends that run a GPTQ checkpoint with quantized activations (explicit, never ``auto``)."""


def _resolve_backend(backend: Any, config: Any = None, *, checkpoint: bool = False) -> BACKEND:
    """The backend that runs the model: FP8 weight-only models run on ``fp8_torch``, GPTQ
    (W4A16) models on ``gptq_torch``; an explicit backend must be the one the method runs on.
    ``gptq_w4afp8`` and ``gptq_w4a_nvfp4`` run GPTQ ``checkpoint``s (directories already
    quantized), never by ``auto``."""
    runs_on = BACKEND.GPTQ_TORCH if isinstance(config, GPTQConfig) else BACKEND.FP8_TORCH
    if isinstance(backend, str):
        try:
            chosen = BACKEND(str.lower(str.strip(backend)))
        except ValueError:
            chosen = None
        if chosen == BACKEND.AUTO or chosen == runs_on:
            return runs_on
        if chosen in _W4A_BACKENDS and runs_on == BACKEND.GPTQ_TORCH:
            if checkpoint:
                return chosen
            raise ValueError(
                f"load: backend {backend!r} runs GPTQ checkpoints loaded from a directory; "
                f"quantize with backend 'auto', save with layout 'gptq', then load that "
                f"directory with backend={chosen.value!r}"
            )
        if chosen in (BACKEND.FP8_TORCH, BACKEND.GPTQ_TORCH, *_W4A_BACKENDS):
            what = "GPTQ (W4A16)" if runs_on == BACKEND.GPTQ_TORCH else "FP8 weight-only"
            raise ValueError(
                f"load: backend {backend!r} cannot run {what} models; use 'auto' or "
                f"{runs_on.value!r}"
            )
    accepted = ", ".join(repr(b.value) for b in BACKEND)
    raise ValueError(
        f"load: backend {backend!r} is not available in floatxq; accepted: {accepted} (FP8 "
        f"weight-only models run on 'fp8_torch', GPTQ W4A16 models on 'gptq_torch', symmetric "
        f"4-bit g128 GPTQ checkpoints also on 'gptq_w4afp8' and 'gptq_w4a_nvfp4')"
    )


def _is_mlx(backend: Any) -> bool:
    return isinstance(backend, str) and str.lower(str.strip(backend)) == BACKEND.MLX.value


def _load_mlx(model_or_path: Any, *, quantize_config: Any, device: Any, dtype: Any) -> Any:
    """``load(path, backend="mlx")``: the checkpoint read as for ``fp8_torch``, then converted
    whole to an MLX model (:func:`floatxq.mlx.convert_to_mlx`)."""
    if quantize_config is not None:
        raise ValueError(
            "load: backend 'mlx' runs a saved checkpoint; quantize with backend 'auto', save, "
            "then load the directory with backend='mlx'"
        )
    if device is not None and str(device) not in ("mps", "cpu", "gpu"):
        raise ValueError(
            f"load: backend 'mlx' runs on MLX's default device (Apple GPU, else CPU); device "
            f"must be None, 'mps', 'gpu' or 'cpu', got {device!r}"
        )
    if not isinstance(model_or_path, (str, os.PathLike)):
        raise TypeError(
            f"load: backend 'mlx' takes a checkpoint directory, got {type(model_or_path).__name__}"
        )
    try:
        from floatxq.mlx import convert_to_mlx
    except ImportError as exc:  # pragma: no cover - depends on the machine
        raise ImportError(f"load: backend 'mlx' needs MLX and mlx-lm: {exc}") from exc
    loaded = load(model_or_path, dtype=dtype, backend="auto")
    if isinstance(loaded.quantize_config, GPTQConfig):
        raise ValueError(
            f"load: backend 'mlx' runs FP8 (or unquantized) checkpoints of the model types "
            f"convert_to_mlx supports; {model_or_path} "
            f"is a GPTQ checkpoint"
        )
    conversion = convert_to_mlx(loaded.model)
    result = QuantizedModel(
        conversion.model,
        quantize_config=loaded.quantize_config,
        backend=BACKEND.MLX,
        quantized=False,
        source=loaded.source,
    )
    result.quantized = loaded.quantized
    result.quantized_modules = list(loaded.quantized_modules)
    result.mlx_routes = dict(conversion.routes)
    result.layout = loaded.layout
    return result


def _backend_for(backend: Any, config: Any) -> BACKEND:
    """The backend for a model to quantize with ``config``: a GPTQ config with an activation
    policy binds its W4A backend (``auto`` or that one accepted), any other as
    :func:`_resolve_backend`."""
    activation = getattr(config, "activation", None) if isinstance(config, GPTQConfig) else None
    if activation is None:
        return _resolve_backend(backend, config)
    try:
        return backend_for_activation(activation, _backend_name(backend))
    except ValueError as exc:
        raise ValueError(f"load: {exc}") from None


def _backend_name(backend: Any) -> BACKEND:
    """``backend`` as a BACKEND, or the standard refusal of an unknown one."""
    if isinstance(backend, str):
        with contextlib.suppress(ValueError):
            return BACKEND(str.lower(str.strip(backend)))
    _resolve_backend(backend)  # raises, naming what is accepted
    raise AssertionError("unreachable")  # pragma: no cover


_ACTIVATION_SCALE_BITS = "activation_global_scale_bits"


def _as_config(value: Any) -> FP8Config | GPTQConfig:
    if isinstance(value, (FP8Config, GPTQConfig)):
        return value
    if isinstance(value, Mapping):
        method = payload_method(value) or METHOD.FP8.value
        if method == METHOD.GPTQ:
            return gptq_config_from_payload(value)
        if method != METHOD.FP8:
            raise ValueError(
                f"load: quantize_config method {method!r} is not supported; accepted: 'fp8', 'gptq'"
            )
        return fp8_config_from_payload(value)
    raise TypeError(
        f"load: quantize_config must be an FP8Config, a GPTQConfig, a payload mapping of either "
        f"or None, got {type(value).__name__}"
    )


def _build_from_config(config_payload: Mapping[str, Any], *, device: Any, dtype: Any) -> nn.Module:
    from transformers import AutoConfig, AutoModelForCausalLM

    payload = {k: v for k, v in config_payload.items() if k != "quantization_config"}
    model_type = payload.pop("model_type", None)
    if not model_type:
        raise CheckpointError(f"load: {CONFIG_FILE} has no 'model_type'")
    config = AutoConfig.for_model(model_type, **payload)
    kwargs = {"dtype": dtype} if dtype is not None else {}
    # No random initialization: every tensor is loaded or replaced from the files next (a
    # missing one is refused), and the dense weights of modules that are replaced by packed ones
    # are never written, so their pages are never committed: a native source is not materialized
    # as a dense model in host memory.
    with _no_init_weights(), torch.device(device if device is not None else "cpu"):
        try:
            model = AutoModelForCausalLM.from_config(config, **kwargs)
        except TypeError:  # transformers releases that still call it torch_dtype
            model = AutoModelForCausalLM.from_config(config, torch_dtype=dtype)
    return model.eval()


def _no_init_weights() -> Any:
    try:
        from transformers.initialization import no_init_weights
    except ImportError:  # pragma: no cover - older transformers keep it in modeling_utils
        try:
            from transformers.modeling_utils import no_init_weights
        except ImportError:
            import contextlib

            return contextlib.nullcontext()
    return no_init_weights()


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


_LAYER_INDEX = re.compile(r"(?:^|\.)(?:layers|h|blocks|layer)\.(\d+)\.")


def _check_config_against_tensors(path: Path, payload: Mapping[str, Any], infos: list) -> None:
    """Refuse a config.json the tensors contradict, before a model is built from it.

    A config with far more layers than the checkpoint stores would allocate them all (and
    ``num_hidden_layers: 10**6`` would exhaust memory) before any tensor is read; a config that
    ties ``lm_head`` to the embeddings would silently drop a stored, different ``lm_head``.

    Raises:
      CheckpointError: naming config.json, the field and what the tensors hold.
    """
    layers = payload.get("num_hidden_layers", payload.get("n_layer"))
    indices = {int(m.group(1)) for info in infos for m in [_LAYER_INDEX.search(info.name)] if m}
    if indices and layers is not None:
        stored = max(indices) + 1
        if not isinstance(layers, int) or isinstance(layers, bool) or layers != stored:
            raise CheckpointError(
                f"load: {path / CONFIG_FILE} num_hidden_layers is {layers!r} but the tensors hold "
                f"{stored} layers (indices 0..{stored - 1}); refusing to build the model"
            )
    if payload.get("tie_word_embeddings") is True:
        names = {info.name: info for info in infos}
        heads = [n for n in names if n.endswith("lm_head.weight")]
        embeds = [n for n in names if n.endswith(("embed_tokens.weight", "wte.weight"))]
        if heads and embeds:
            head, embed = _read_one(path, names[heads[0]]), _read_one(path, names[embeds[0]])
            if head.shape != embed.shape or not torch.equal(head, embed):
                raise CheckpointError(
                    f"load: {path / CONFIG_FILE} sets tie_word_embeddings, but the checkpoint "
                    f"stores a {heads[0]} that differs from {embeds[0]}; tying would silently "
                    f"discard it"
                )


def _read_one(path: Path, info: Any) -> torch.Tensor:
    from safetensors import safe_open

    with safe_open(str(path / info.file), framework="pt") as reader:
        return reader.get_tensor(info.name)


def _model_dtype(config_payload: Mapping[str, Any], dtype: torch.dtype | None) -> torch.dtype:
    if dtype is not None:
        return dtype
    name = config_payload.get("dtype", config_payload.get("torch_dtype"))
    found = getattr(torch, str(name), None) if isinstance(name, str) else None
    return found if isinstance(found, torch.dtype) and found.is_floating_point else torch.float32


def _gptqmodel_config(path: Path, qpayload: Mapping[str, Any]) -> FP8Config:
    """The FP8Config of a floatxq / GPT-QModel directory.

    GPT-QModel reads ``quantize_config.json`` first; floatxq reads both files (``config.json``
    without floatxq's refusal marker) and refuses them when they describe different configs, so
    neither file is silently ignored.
    """
    from floatxq.interop.checkpoint import QUANTIZE_CONFIG_FILE
    from floatxq.interop.layouts import GPTQMODEL_MARKER_PREFIX

    def parse(file: Path, payload: Mapping[str, Any]) -> FP8Config:
        try:
            return fp8_config_from_payload(payload)
        except (TypeError, ValueError) as exc:
            raise CheckpointError(f"load: {file} quantization payload: {exc}") from None

    config_file = path / CONFIG_FILE
    payload = dict(qpayload)
    scheme = payload.get("activation_scheme")
    if isinstance(scheme, str) and scheme.strip().lower().startswith(GPTQMODEL_MARKER_PREFIX):
        del payload["activation_scheme"]
    from_config = parse(config_file, payload)
    quantize_file = path / QUANTIZE_CONFIG_FILE
    if not quantize_file.is_file():
        return from_config
    from_quantize = parse(quantize_file, read_json(quantize_file, what="load"))
    if from_quantize != from_config:
        raise CheckpointError(
            f"load: {quantize_file} and {config_file} describe different FP8 configs "
            f"({from_quantize!r} vs {from_config!r}); refusing to pick one"
        )
    return from_quantize


def _gptq_config(path: Path, qpayload: Mapping[str, Any]) -> GPTQConfig:
    """The GPTQConfig of a ``quant_method: gptq`` directory (GPT-QModel, transformers, floatxq):
    ``quantize_config.json`` when present (GPT-QModel reads it first), which must agree with
    ``config.json`` on every field that decides how the tensors are read."""
    from floatxq.interop.checkpoint import QUANTIZE_CONFIG_FILE
    from floatxq.interop.layouts import read_gptq_config

    quantize_file = path / QUANTIZE_CONFIG_FILE
    quantize = read_json(quantize_file, what="load") if quantize_file.is_file() else None
    return read_gptq_config(path, qpayload, quantize)


def _pop_activation_bits(
    state: dict[str, torch.Tensor], qconfig: Any, files: Mapping[str, str], path: Path
) -> dict[str, torch.Tensor]:
    """Take each module's ``activation_global_scale_bits`` out of ``state``: GPT-QModel's int32
    0-d bit pattern of an FP32 scale, which only a GPTQ checkpoint with an NVFP4 activation policy
    carries (0.0 = dynamic, else positive and finite)."""
    suffix = f".{_ACTIVATION_SCALE_BITS}"
    found = {k[: -len(suffix)]: v for k, v in state.items() if k.endswith(suffix)}
    if not found:
        return {}
    activation = getattr(qconfig, "activation", None)
    if activation is None or activation.mode != "w4a_nvfp4":
        name = next(iter(found))
        raise CheckpointError(
            f"load: {path}: {name}{suffix} in {files.get(name + suffix, '?')} is an NVFP4 "
            f"activation global scale, but the quantization config declares no NVFP4 "
            f"activation policy (activation.mode 'w4a_nvfp4') to run it with"
        )
    for name, bits in found.items():
        where = f"{name}{suffix} in {files.get(name + suffix, '?')}"
        if bits.dtype != torch.int32 or bits.numel() != 1 or bits.ndim > 1:
            raise CheckpointError(
                f"load: {where} must be one int32 value (an FP32 bit pattern), got "
                f"{bits.dtype} {tuple(bits.shape)}"
            )
        value = float(bits.reshape(()).view(torch.float32))
        if value != 0.0 and not (value > 0.0 and value < float("inf")):
            raise CheckpointError(
                f"load: {where} holds {value!r}; an activation global scale is 0.0 (dynamic) or "
                f"a positive finite FP32 value"
            )
        del state[f"{name}{suffix}"]
    return {name: bits.reshape(()) for name, bits in found.items()}


def _load_quantized(
    path: Path, config_payload: Mapping[str, Any], *, device: Any, dtype: Any
) -> "tuple[nn.Module | None, FP8Config | GPTQConfig | None, Any, dict[str, torch.Tensor]]":
    from floatxq.interop.checkpoint import header_metadata
    from floatxq.interop.layouts import (
        _torchao_metadata,
        decide_layout,
        module_sources,
        read_module,
        refuse_activation_scales,
    )
    from floatxq.interop.sources import (
        MODELOPT_ACTIVATION_REFUSAL,
        modelopt_activation_quantization,
        read_hf_quant_config,
    )
    from floatxq.lifecycle.fp8 import LINEAR_TYPES

    infos = tensor_infos(path)
    metadata = header_metadata(path)
    decision = decide_layout(path, config_payload, infos, header_metadata=metadata)
    _check_config_against_tensors(path, config_payload, infos)
    if decision.layout == "dense":
        return None, None, decision, {}
    names = [info.name for info in infos]
    qpayload = config_payload.get("quantization_config") or {}
    if decision.layout == "modelopt":
        declared = dict(read_hf_quant_config(path, strict=True) or {})
        declared.update(qpayload)
        declared.setdefault("quant_method", "modelopt")
        mode = modelopt_activation_quantization(declared, names)
        if mode is not None:
            raise CheckpointError(f"load: {path}: " + MODELOPT_ACTIVATION_REFUSAL.format(mode=mode))
    refuse_activation_scales(decision, names, path)
    qconfig: FP8Config | GPTQConfig | None = None
    if decision.layout == "gptqmodel":
        qconfig = _gptqmodel_config(path, qpayload)
    elif decision.layout == "gptq":
        qconfig = _gptq_config(path, qpayload)
    model_dtype = _model_dtype(config_payload, dtype)
    model = _build_from_config(config_payload, device=None, dtype=dtype)
    modules = dict(model.named_modules())
    linear_names = [n for n, m in modules.items() if isinstance(m, LINEAR_TYPES)]
    files = {info.name: info.file for info in infos}
    state = dict(iter_tensors(path))
    activation_bits = _pop_activation_bits(state, qconfig, files, path)
    sources, rest = module_sources(state, linear_names, layout=decision.layout)
    torchao = _torchao_metadata(metadata) if decision.layout == "torchao" else None
    built_names: list[str] = []
    for source in sources:
        first = next(iter(source.tensors))
        file = files.get(f"{source.name}.{first}", files.get(f"{source.name}.weight.{first}", "?"))
        declared, gptq = None, None
        if qconfig is not None:
            resolved = qconfig.resolve(source.name)
            head = source.name in _head_names(model) and not qconfig.lm_head
            if isinstance(resolved, GPTQConfig) and not head:
                gptq = resolved
            elif isinstance(resolved, FP8Config) and not head:
                declared = (resolved.weight_scale_method, resolved.weight_block_size)
        built = read_module(
            decision,
            source,
            modules[source.name],
            qconfig=qpayload,
            dtype=model_dtype,
            file=file,
            metadata=torchao,
            declared=declared,
            gptq=gptq,
        )
        if built is None:
            rest.update({f"{source.name}.{k}": v for k, v in source.tensors.items()})
            continue
        _check_built(source.name, built, modules[source.name], qconfig, file)
        model.set_submodule(source.name, built)
        built_names.append(source.name)
    result = model.load_state_dict(rest, strict=False)
    tied = _tied_names(model)
    done = tuple(f"{name}." for name in built_names)
    missing = [k for k in result.missing_keys if k not in tied and not k.startswith(done)]
    if missing or result.unexpected_keys:
        raise CheckpointError(
            f"load: {path} does not match the model: missing tensors {missing[:8]}, unexpected "
            f"tensors {result.unexpected_keys[:8]}"
        )
    if tied:
        model.tie_weights()
    if device is not None:
        model = model.to(device)
    unbuilt = sorted(set(activation_bits) - set(built_names))
    if unbuilt:
        raise CheckpointError(
            f"load: {path}: {unbuilt[0]}.{_ACTIVATION_SCALE_BITS} belongs to no GPTQ module "
            f"({len(unbuilt)} such tensors)"
        )
    if qconfig is None:
        qconfig = _describe_loaded(model)
    return model.eval(), qconfig, decision, activation_bits


def _head_names(model: nn.Module) -> set[str]:
    from floatxq.interop.export import output_embedding_names

    return output_embedding_names(model)


def _check_built(
    name: str,
    built: nn.Module,
    original: nn.Module,
    qconfig: FP8Config | GPTQConfig | None,
    file: str,
) -> None:
    from floatxq.nn.fp8_linear import _source_matrix

    matrix, _ = _source_matrix(original, where="load")
    expected = tuple(matrix.shape)
    shape = (getattr(built, "out_features", -1), getattr(built, "in_features", -1))
    if shape != expected:
        raise CheckpointError(
            f"load: {name}.weight in {file} holds a {shape} weight, but the model's "
            f"{type(original).__name__} {name!r} needs {expected}"
        )
    if isinstance(qconfig, FP8Config) and isinstance(built, TorchFP8Linear):
        resolved = qconfig.resolve(name) or qconfig
        if built.format != resolved.format:
            raise CheckpointError(
                f"load: {name}.weight in {file} is {built.format} but the quantization config "
                f"declares format {resolved.format!r}"
            )
    if isinstance(qconfig, GPTQConfig):
        from floatxq.nn.gptq_linear import GPTQLinear

        resolved = qconfig.resolve(name)
        held = (getattr(built, "bits", None), getattr(built, "group_size", None))
        if (
            not isinstance(built, GPTQLinear)
            or resolved is None
            or held != (resolved.bits, resolved.group_size)
        ):
            raise CheckpointError(
                f"load: {name} in {file} was built as {type(built).__name__} {held}, not the "
                f"GPTQ module the quantization config declares"
            )


def _describe_fp8(model: nn.Module) -> FP8Config | None:
    """An FP8Config describing the TorchFP8Linear modules of a model read from another layout:
    the most common (format, scale method, block) as the base, exact-name rules for the others."""
    from collections import Counter

    fp8 = {n: m for n, m in model.named_modules() if isinstance(m, TorchFP8Linear)}
    if not fp8:
        return None
    key = lambda m: (m.format, m.weight_scale_method, m.weight_block_size)
    base, _ = Counter(key(m) for m in fp8.values()).most_common(1)[0]
    dynamic = {}
    for name, module in fp8.items():
        if key(module) != base:
            fmt, method, block = key(module)
            dynamic[f"+:^{re.escape(name)}$"] = {
                "format": fmt,
                "weight_scale_method": method,
                "weight_block_size": list(block) if block else None,
            }
    return FP8Config(
        format=base[0],
        weight_scale_method=base[1],
        weight_block_size=list(base[2]) if base[2] else None,
        lm_head=any(n.split(".")[-1] == "lm_head" for n in fp8),
        dynamic=dynamic or None,
    )


def _describe_gptq(model: nn.Module) -> GPTQConfig | None:
    """A GPTQConfig describing the GPTQLinear modules of a model read from compressed-tensors:
    the most common (bits, group size, symmetric) as the base, exact-name rules for the others;
    ``format`` is that of the modules (``gptq_v2``: compressed-tensors stores the zero points
    themselves)."""
    from collections import Counter

    from floatxq.interop.export import _gptq_facts
    from floatxq.nn.gptq_linear import GPTQLinear

    gptq = {n: m for n, m in model.named_modules() if isinstance(m, GPTQLinear)}
    if not gptq:
        return None
    key = {n: (m.bits, m.group_size, _gptq_facts(m).symmetric) for n, m in gptq.items()}
    base, _ = Counter(key.values()).most_common(1)[0]
    dynamic = {
        f"+:^{re.escape(name)}$": {"bits": bits, "group_size": size, "sym": sym}
        for name, (bits, size, sym) in key.items()
        if (bits, size, sym) != base
    }
    formats = sorted({m.format for m in gptq.values()})
    return GPTQConfig(
        bits=base[0],
        group_size=base[1],
        sym=base[2],
        format=formats[0] if len(formats) == 1 else "gptq_v2",
        lm_head=any(n in _head_names(model) for n in gptq),
        dynamic=dynamic or None,
    )


def _describe_loaded(model: nn.Module) -> FP8Config | GPTQConfig | None:
    """The config describing a model read from a layout that does not carry floatxq's own:
    FP8 modules give an FP8Config, GPTQ modules a GPTQConfig, and a model holding both None (a
    config describes one method; such a model saves to ``compressed-tensors`` only)."""
    fp8, gptq = _describe_fp8(model), _describe_gptq(model)
    if fp8 is not None and gptq is not None:
        return None
    return fp8 if gptq is None else gptq


def _tied_names(model: nn.Module) -> set[str]:
    config = getattr(model, "config", None)
    if not getattr(config, "tie_word_embeddings", False):
        return set()
    getter = getattr(model, "get_output_embeddings", None)
    head = getter() if callable(getter) else None
    return {f"{n}.weight" for n, m in model.named_modules() if head is not None and m is head}


def _quantized_types() -> tuple[type, ...]:
    """The module classes a quantized model holds; ``GPTQLinear`` last."""
    from floatxq.nn.fp4_linear import TorchFP4Linear
    from floatxq.nn.gptq_linear import GPTQLinear

    return (TorchFP8Linear, TorchFP4Linear, GPTQLinear)


class QuantizedModel:
    """A model plus the quantization that was or will be applied to it.

    ``quantize()`` replaces modules in place (one at a time), ``save(path)`` writes a checkpoint
    that ``floatxq.load(path)`` rebuilds bit for bit, and ``model`` is the ``nn.Module`` to run.

    Numerics: FP8 weight-only as :func:`floatxq.quantize_fp8_weight`.
    """

    def __init__(
        self,
        model: Any,  # an nn.Module; an mlx_lm model for backend "mlx"
        *,
        quantize_config: FP8Config | GPTQConfig | None,
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
            [n for n, m in model.named_modules() if isinstance(m, _quantized_types())]
            if quantized
            else []
        )
        self.layout: Any = None
        """The :class:`~floatxq.interop.layouts.LayoutDecision` a checkpoint was read with."""
        self.source = source
        self.device = device
        self.quantize_seconds: float | None = None
        self.report: Any = None
        """The last :meth:`quantize` run's :class:`~floatxq.lifecycle.gptq.GPTQRunReport` (GPTQ)."""
        self.tokenizer: Any = None
        """Turns calibration strings into ids (set it, or pass ``quantize(tokenizer=...)``);
        when None, the source directory's tokenizer is loaded the first time a string sample
        needs it (the byte tokenizer for the built-in tiny Llama)."""

    def __repr__(self) -> str:
        kind = "GPTQ" if isinstance(self.quantize_config, GPTQConfig) else "FP8"
        state = (
            f"{len(self.quantized_modules)} {kind} modules" if self.quantized else "not quantized"
        )
        return f"QuantizedModel({type(self.model).__name__}, {state}, backend={self.backend.value})"

    mlx_routes: dict[str, str] | None = None
    """``backend="mlx"``: each linear's MLX route (``dense``, ``mxfp8`` or ``packed``)."""

    def quantize(
        self,
        calibration: Iterable[Any] | None = None,
        *,
        batch_size: int = 1,
        progress: bool | Callable[[str], None] = True,
        tokenizer: Any = None,
    ) -> "QuantizedModel":
        """Quantize the model's linear modules in place.

        FP8 is weight-only (no calibration). GPTQ is calibrated and runs layer by layer
        (:mod:`floatxq.lifecycle.gptq`): only one decoder layer, its Hessians and the calibration
        activations are on the work device (``device`` given to :func:`load`, else CUDA when
        available, else CPU) at a time; the model ends on ``device`` when one was given.

        Args:
          calibration: GPTQ's samples: strings, 1-D token-id tensors, lists of ints or mappings
            with ``input_ids`` (:func:`~floatxq.lifecycle.calibration.prepare_calibration`);
            samples of at most 10 tokens are dropped with a warning. FP8 ignores it (warning).
          batch_size: GPTQ samples per forward (right-padded; padding is masked out).
          progress: show progress bars (True), stay quiet (False), or a callback per module.
          tokenizer: GPTQ: turns string samples into ids (default: the source's tokenizer).

        Raises:
          RuntimeError: no quantize_config, or the model is already quantized.
          ValueError: GPTQ without calibration, unusable calibration (empty, all too short,
            strings without a tokenizer, ids outside the vocabulary, non-finite activations),
            a module the settings cannot pack (see :func:`~floatxq.lifecycle.gptq.plan_gptq`).

        Numerics: FP8 as :func:`floatxq.quantize_fp8_weight`; GPTQ as :func:`floatxq.gptq_solve`.
        """
        if self.quantize_config is None:
            raise RuntimeError("quantize: no quantize_config was given to floatxq.load")
        if self.quantized:
            raise RuntimeError("quantize: this model is already quantized")
        if isinstance(self.quantize_config, GPTQConfig):
            return self._quantize_gptq(calibration, batch_size, progress, tokenizer)
        if calibration is not None:
            warnings.warn(
                "quantize: FP8 weight-only quantization needs no calibration data; the given "
                "dataset is ignored",
                UserWarning,
                stacklevel=2,
            )
        from floatxq.lifecycle.fp8 import plan_fp8

        total = sum(p.config is not None for p in plan_fp8(self.model, self.quantize_config))
        callback, bar = _progress(progress, total, "fp8 quantize")
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

    def _quantize_gptq(
        self, calibration: Any, batch_size: int, progress: Any, tokenizer: Any
    ) -> "QuantizedModel":
        from floatxq.lifecycle.calibration import prepare_calibration
        from floatxq.lifecycle.gptq import plan_gptq, quantize_gptq_model

        config = self.quantize_config
        assert isinstance(config, GPTQConfig)
        if calibration is None:
            raise ValueError(
                "quantize: GPTQ needs calibration data (strings or token-id tensors); "
                "floatxq.tiny.calibration_samples(...) gives some for the built-in tiny Llama"
            )
        plans = plan_gptq(self.model, config)  # refuses unpackable modules before any work
        hf_config = getattr(self.model, "config", None)
        pad = getattr(hf_config, "pad_token_id", None)
        prepared = prepare_calibration(
            calibration,
            tokenizer=tokenizer or self.tokenizer or _LazyTokenizer(self.source),
            batch_size=batch_size,
            pad_token_id=pad if isinstance(pad, int) else 0,
            vocab_size=getattr(hf_config, "vocab_size", None),
            max_length=getattr(hf_config, "max_position_embeddings", None),
        )
        work = self.device or _default_work_device(self.model)
        callback, bar = _progress(progress, sum(p.config is not None for p in plans), "gptq")
        start = time.perf_counter()
        try:
            self.report = quantize_gptq_model(
                self.model, config, prepared, device=work, on_module=callback
            )
        finally:
            if bar is not None:
                bar.close()
        if self.device is not None:
            self.model.to(self.device)
        if config.activation is not None:  # W4A: the solved modules run the policy's GEMMs
            scales = getattr(self.report, "activation_scales", None) or {}
            install_w4a_modules(
                self.model, self.backend, activation=config.activation, scales=scales
            )
            install_activation_stream(self.model, config.activation)
        self.quantize_seconds = time.perf_counter() - start
        self.quantized = True
        self.quantized_modules = [m.name for m in self.report.modules]
        return self

    def calibrate_activations(
        self,
        samples: Sequence[torch.Tensor],
        *,
        progress: Callable[[str, Mapping[str, Any]], None] | bool | None = None,
    ) -> dict[str, Any]:
        """Calibrate the installed NVFP4 stream's producer global scales on ``samples``.

        Activations only: the weights are not touched. Each producer boundary (reference:
        :mod:`floatxq.lifecycle.activation_calibration`) gets the FP32 scale that maps the
        largest magnitude it sees onto E2M1 value 6 (``nvidia``) or 4 (other recipes) at block
        scale 448; the scales go into the stream, ``quantize_config.activation.global_scales``
        and the saved files. On any failure everything is restored and the error re-raised.

        Args:
          samples: a non-empty list of unpadded 1-D token-id tensors.
          progress: ``None``/``False`` (quiet), ``True`` (a progress bar), or a callable given
            ``(producer_key, row)`` as each producer is done.

        Returns:
          The report: ``algorithm`` (``"producer_maximum"``), ``recipe``, ``global_scales``,
          ``boundaries`` (per key: ``recipe``, ``amax``, ``global_scale``, ``tokens``,
          ``samples``), ``upstream_activations``, ``weight_updates`` (0).

        Raises:
          RuntimeError / ValueError / TypeError: as
          :func:`~floatxq.lifecycle.activation_calibration.calibrate_nvfp4_producers`.

        Numerics: ``scale = max|x| / (448·6)`` for ``nvidia``, ``/ (448·4)`` otherwise (FP32).
        """
        from floatxq.lifecycle.activation_calibration import calibrate_nvfp4_producers
        from floatxq.lifecycle.stream import stream_boundary_quantizers

        if progress is True:
            total = len(stream_boundary_quantizers(self.model))
            step, bar = _progress(True, total, "calibrate activations")
            try:
                shown = None if step is None else (lambda key, _row: step(key))
                return calibrate_nvfp4_producers(self, samples, progress=shown)
            finally:
                if bar is not None:
                    bar.close()
        if progress is False:
            progress = None
        if progress is not None and not callable(progress):
            raise TypeError(
                f"calibrate_activations: progress must be None, a bool or a callable, got "
                f"{type(progress).__name__}"
            )
        return calibrate_nvfp4_producers(self, samples, progress=progress)

    def save(
        self,
        path: str | os.PathLike[str],
        *,
        layout: str | None = None,
        max_shard_size: int | str = "4GB",
        overwrite: bool = False,
    ) -> Path:
        """Write the model in a checkpoint ``layout`` atomically (temporary directory, rename).

        Args:
          path: the directory to create.
          layout: None (``"gptq"`` for a model with a W4A activation policy, whose files carry
            the policy and its activation global scales; else ``"compressed-tensors"``),
            ``"compressed-tensors"`` (transformers with the compressed-tensors
            package, vLLM and SGLang read it; GPTQ modules as ``pack-quantized``), ``"hf"``
            (transformers' / DeepSeek's fine-grained FP8: tensor or block scales),
            ``"gptqmodel"`` (GPT-QModel's inverse-scale FP8 files, byte-exact; transformers and
            vLLM refuse them; for a GPTQ model the ``"gptq"`` files) or ``"gptq"`` (GPTQ models:
            GPT-QModel's ``qweight``/``qzeros``/``scales``/``g_idx`` files, byte-exact, read by
            GPT-QModel, transformers through it and vLLM). ``docs/interop.md`` has the table.
          max_shard_size: bytes per safetensors shard (an int or like ``"4GB"``).
          overwrite: replace an existing directory (only once the new one is complete).

        Raises:
          RuntimeError: the model is not quantized. FileExistsError: ``path`` exists (or is a
            file). ValueError: a layout that cannot hold the model's modules (named), an unknown
            layout, a bad ``max_shard_size``, or a target that is the working directory, the
            home directory, a filesystem root, one of their parents, a file or a symlink.
          OSError: the directory cannot be written (named); nothing is left behind, and an
            interrupted replacement is restored by the next save or load.

        Numerics: FP8 codes, NVFP4 bytes and GPTQ words are written as they are (GPTQ zero
        words converted exactly between v1 and v2 where the layout or config needs the other).
        Layouts whose scales multiply store the FP32 reciprocal of floatxq's inverse FP8 scales
        (exact for powers of two, else within half an FP32 ulp); ``gptqmodel`` stores them
        unchanged.
        """
        from floatxq.interop.export import export_layout

        if self.backend == BACKEND.MLX:
            raise RuntimeError(
                "save: this is an MLX model converted from a checkpoint; save the checkpoint "
                "from its torch model (floatxq.load(path) without backend='mlx')"
            )
        if not self.quantized:
            raise RuntimeError("save: quantize() the model first (or load a quantized checkpoint)")
        config_obj = getattr(self.model, "config", None)
        if config_obj is None or not hasattr(config_obj, "to_dict"):
            raise TypeError("save: the model has no Hugging Face config to write as config.json")
        if layout is None:
            activation = getattr(self.quantize_config, "activation", None)
            layout = DEFAULT_LAYOUT if activation is None else "gptq"
        exported = export_layout(self.model, self.quantize_config, layout)
        config = config_obj.to_dict()
        config["quantization_config"] = exported.quantization_config
        extra = {}
        if self.source is not None:
            extra = {n: self.source / n for n in TOKENIZER_FILES if (self.source / n).is_file()}
        return write_checkpoint(
            path,
            exported.state,
            config=config,
            quantize_config=exported.quantize_config,
            extra_files=extra,
            max_shard_bytes=_parse_size(max_shard_size),
            overwrite=overwrite,
        )


def _parse_size(value: object) -> int:
    """``max_shard_size`` in bytes: a positive int, or a size like ``"4GB"``, ``"500MB"``,
    ``"1.5GB"`` (units B, KB, MB, GB of 1024; any case; rounded down to whole bytes).

    Takes any object because it is the check: bools, floats, zero, negatives, NaN/inf and unknown
    units are refused with ValueError, other kinds with TypeError.
    """
    accepted = "a positive int of bytes or a size like '4GB', '500MB' or '1.5GB' (B, KB, MB, GB)"
    if isinstance(value, (bool, float)):
        raise ValueError(f"save: max_shard_size must be {accepted}, got {value!r}")
    if isinstance(value, int):
        if value < 1:
            raise ValueError(f"save: max_shard_size must be {accepted}, got {value!r}")
        return value
    if not isinstance(value, str):
        raise TypeError(
            f"save: max_shard_size must be {accepted}, got {type(value).__name__} {value!r}"
        )
    found = re.fullmatch(r"(\d{0,20})(?:\.(\d{0,20}))?\s*([KMG]?B)", value.strip().upper())
    size = 0
    if found and (found[1] or found[2]):  # exact integer arithmetic: no float rounding, no inf
        factor = {"B": 1, "KB": 1024, "MB": 1024**2, "GB": 1024**3}[found[3]]
        digits = found[2] or ""
        size = int(found[1] + digits or "0") * factor // 10 ** len(digits)
    if size < 1:
        raise ValueError(f"save: max_shard_size must be {accepted}, got {value!r}")
    return size


def _progress(progress: Any, total: int, desc: str):
    """``(callback per module name, bar to close)`` for ``quantize(progress=...)``: the user's
    callable as is, nothing for False, else a tqdm bar over ``total`` modules."""
    if callable(progress) and not isinstance(progress, bool):
        return progress, None
    if not progress:
        return None, None
    try:
        from tqdm.auto import tqdm
    except ImportError:  # pragma: no cover - tqdm comes with transformers
        return None, None
    bar = tqdm(total=total, desc=desc, unit="module", leave=False)

    def step(name: str) -> None:
        bar.set_postfix_str(name)
        bar.update(1)

    return step, bar


def _default_work_device(model: nn.Module) -> torch.device:
    """Where GPTQ works when ``load`` was given no device: the model's CUDA device if it is
    on one, else the first CUDA device when there is one, else the CPU."""
    first = next(model.parameters(), None)
    if first is not None and first.device.type == "cuda":
        return first.device
    return torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")


class _LazyTokenizer:
    """The source directory's tokenizer, loaded on the first string it is asked to encode (the
    byte tokenizer for the built-in tiny Llama); a clear error when there is none."""

    def __init__(self, path: Path | None) -> None:
        self.path = path
        self.tokenizer: Any = None

    def __call__(self, text: str) -> Any:
        if self.tokenizer is None:
            self.tokenizer = self._load()
        return self.tokenizer(text)

    def _load(self) -> Any:
        from floatxq.tiny import TINY_LLAMA_DIR, encode_text

        where = "calibration"
        if self.path is None:
            raise ValueError(
                f"{where}: string samples need a tokenizer, and this model was given as a module; "
                f"pass token-id tensors or quantize(..., tokenizer=...)"
            )
        if self.path.resolve() == TINY_LLAMA_DIR.resolve():
            return encode_text
        if not any((self.path / n).is_file() for n in TOKENIZER_FILES):
            raise ValueError(
                f"{where}: string samples need a tokenizer, and {self.path} has no tokenizer "
                f"files; pass token-id tensors or quantize(..., tokenizer=...)"
            )
        try:
            from transformers import AutoTokenizer

            return AutoTokenizer.from_pretrained(str(self.path), local_files_only=True)
        except Exception as exc:  # transformers raises many kinds for damaged tokenizer files
            raise ValueError(
                f"{where}: the tokenizer in {self.path} could not be loaded "
                f"({type(exc).__name__}: {exc}); pass token-id tensors or a tokenizer"
            ) from exc


def load(
    model_or_path: nn.Module | str | os.PathLike[str],
    *,
    quantize_config: FP8Config | GPTQConfig | Mapping[str, Any] | None = None,
    device: str | torch.device | None = None,
    dtype: torch.dtype | None = None,
    backend: str | BACKEND = "auto",
) -> QuantizedModel:
    """Load a model to quantize, a quantized checkpoint to run, or a native source to requantize.

    Args:
      model_or_path: an ``nn.Module`` (used as is, not copied) or a local Hugging Face model
        directory. A directory holding a quantized checkpoint (floatxq's or another tool's, see
        ``docs/interop.md``) is rebuilt from its files: its quantized modules get the saved bytes.
      quantize_config: an ``FP8Config`` or ``GPTQConfig`` (or a payload of either, see
        :mod:`floatxq.interop.payload`) for :meth:`QuantizedModel.quantize`. Given a native
        FP8 / NVFP4 checkpoint, a ``GPTQConfig`` requantizes it: the source modules keep their
        bytes, run their own forward for the calibration capture and are decoded one at a time
        for their solve. Ignored with a warning for any other quantized checkpoint.
      device: where the model lives. GPTQ keeps the model on CPU while it works and uses this
        device for one decoder layer at a time, then moves the result here.
      dtype: dtype of the unquantized parameters (default: the checkpoint's / the model's).
      backend: ``"auto"``, ``"fp8_torch"`` (FP8 models) or ``"gptq_torch"`` (GPTQ W4A16);
        ``"gptq_w4afp8"`` runs a GPTQ checkpoint (4-bit, groups of 128, symmetric, no
        ``desc_act``) as ``W4AFP8Linear`` modules (FP8 per-token activations),
        ``"gptq_w4a_nvfp4"`` as ``W4ANVFP4Linear`` modules (NVFP4 activations, dynamic global
        scales); ``"mlx"`` converts a saved FP8 (or unquantized) Llama, Mistral, Qwen2 or
        Qwen3 checkpoint whole to an MLX model (``floatxq.mlx.convert_to_mlx``; needs ``mlx``
        and ``mlx-lm``; ``device`` None, ``"mps"``, ``"gpu"`` or ``"cpu"``: MLX runs on its
        default device). A GPTQ config or checkpoint with an activation policy binds its backend
        (:func:`~floatxq.config.backend_for_activation`: ``auto`` or that one); a loaded W4A
        checkpoint gets its modules' saved activation scales and, on a Llama, the activation
        stream.

    Raises:
      CheckpointError (a ValueError): missing/corrupt/truncated files, inconsistent tensors.
      ValueError: unknown method, or a backend that cannot run the model. TypeError: a wrong kind
        of argument.

    Numerics: loading is bit-exact; quantization as :func:`floatxq.quantize_fp8_weight` or
    :func:`floatxq.gptq_solve`.
    """
    if _is_mlx(backend):
        return _load_mlx(model_or_path, quantize_config=quantize_config, device=device, dtype=dtype)
    dev = torch.device(device) if device is not None else None
    config = _as_config(quantize_config) if quantize_config is not None else None
    gptq = isinstance(config, GPTQConfig)
    if isinstance(model_or_path, nn.Module):
        chosen = _backend_for(backend, config)
        model = model_or_path.to(dev) if dev is not None and not gptq else model_or_path
        already = any(isinstance(m, _quantized_types()) for m in model.modules())
        return QuantizedModel(
            model,
            quantize_config=config,
            backend=chosen,
            quantized=already and not gptq,
            device=dev,
        )
    if not isinstance(model_or_path, (str, os.PathLike)):
        raise TypeError(
            f"load: model_or_path must be an nn.Module or a directory path, got "
            f"{type(model_or_path).__name__}"
        )
    path = Path(model_or_path)
    if not os.path.lexists(path) and recover_interrupted_save(path):
        warnings.warn(
            f"load: {path} was missing after an interrupted save; its previous contents were "
            f"restored from the save's hidden backup",
            UserWarning,
            stacklevel=2,
        )
    if not path.is_dir():
        raise CheckpointError(f"load: {path} is not a model directory (no hub downloads here)")
    payload = read_json(path / CONFIG_FILE, what="load")
    model, qconfig, decision, activation_bits = _load_quantized(
        path, payload, device=None if gptq else dev, dtype=dtype
    )
    if model is not None and gptq and not isinstance(qconfig, GPTQConfig):
        # A native FP8 / NVFP4 source: a fresh GPTQ solve of its decoded weights.
        source = QuantizedModel(
            model,
            quantize_config=config,
            backend=_backend_for(backend, config),
            source=path,
            device=dev,
        )
        source.layout = decision
        return source
    if model is not None:
        activation = getattr(qconfig, "activation", None)
        if activation is not None:
            try:
                chosen = backend_for_activation(activation, _backend_name(backend))
            except ValueError as exc:
                raise ValueError(f"load: {path}: {exc}") from None
        else:
            chosen = _resolve_backend(backend, qconfig, checkpoint=True)
        if chosen in _W4A_BACKENDS:
            install_w4a_modules(model, chosen, activation=activation, scale_bits=activation_bits)
        if activation is not None:
            install_activation_stream(model, activation)
        if quantize_config is not None:
            warnings.warn(
                f"load: {path} is already quantized; quantize_config is ignored",
                UserWarning,
                stacklevel=2,
            )
        loaded = QuantizedModel(
            model, quantize_config=qconfig, backend=chosen, quantized=True, source=path, device=dev
        )
        loaded.layout = decision
        return loaded
    chosen = _backend_for(backend, config)
    model = _load_plain(path, device=None if gptq else dev, dtype=dtype)
    loaded = QuantizedModel(model, quantize_config=config, backend=chosen, source=path, device=dev)
    return loaded


__all__ = ["QuantizedModel", "load"]
