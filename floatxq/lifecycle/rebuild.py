"""A model rebuilt from a checkpoint directory's files: the layout decided
(:func:`floatxq.interop.layouts.decide_layout`), each quantized module read from its stored tensors
(:func:`floatxq.interop.readers.read_module`) into a model built from ``config.json`` without
random initialization, and the config that describes what was read. Nothing is fetched from a
hub: paths are local.
"""

import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from floatxq.config import (
    FP8Config,
    GPTQConfig,
)
from floatxq.formats import ACTIVATION_SCALE_BITS
from floatxq.interop.checkpoint import (
    CONFIG_FILE,
    QUANTIZE_CONFIG_FILE,
    CheckpointError,
)
from floatxq.interop.export_gptq import _gptq_facts, output_embedding_names
from floatxq.interop.layouts import (
    GPTQMODEL_MARKER_PREFIX,
    _torchao_metadata,
    decide_layout,
    read_gptq_config,
)
from floatxq.interop.payload import (
    fp8_config_from_payload,
)
from floatxq.interop.readers import module_sources, read_module, refuse_activation_scales
from floatxq.interop.shards import header_metadata, iter_tensors, read_json, tensor_infos
from floatxq.interop.sources import (
    MODELOPT_ACTIVATION_REFUSAL,
    modelopt_activation_quantization,
    read_hf_quant_config,
)
from floatxq.nn.fp8_linear import TorchFP8Linear


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
    quantize_file = path / QUANTIZE_CONFIG_FILE
    quantize = read_json(quantize_file, what="load") if quantize_file.is_file() else None
    return read_gptq_config(path, qpayload, quantize)


def _pop_activation_bits(
    state: dict[str, torch.Tensor], qconfig: Any, files: Mapping[str, str], path: Path
) -> dict[str, torch.Tensor]:
    """Take each module's ``activation_global_scale_bits`` out of ``state``: GPT-QModel's int32
    0-d bit pattern of an FP32 scale, which only a GPTQ checkpoint with an NVFP4 activation policy
    carries (0.0 = dynamic, else positive and finite)."""
    suffix = f".{ACTIVATION_SCALE_BITS}"
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
            f"load: {path}: {unbuilt[0]}.{ACTIVATION_SCALE_BITS} belongs to no GPTQ module "
            f"({len(unbuilt)} such tensors)"
        )
    if qconfig is None:
        qconfig = _describe_loaded(model)
    return model.eval(), qconfig, decision, activation_bits


def _head_names(model: nn.Module) -> set[str]:
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
