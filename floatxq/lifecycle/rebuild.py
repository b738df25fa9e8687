"""A model rebuilt from a checkpoint directory's files: the layout decided
(:func:`floatxq.interop.layouts.decide_layout`), each quantized module read from its stored tensors
(:func:`floatxq.interop.readers.read_module`) into a model built from ``config.json`` without
random initialization, and the config that describes what was read. Nothing is fetched from a
hub: paths are local.
"""

import dataclasses
import os
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
from floatxq.interop.activations import ACTIVATION_SCALE_SUFFIXES
from floatxq.interop.checkpoint import (
    CONFIG_FILE,
    QUANTIZE_CONFIG_FILE,
    CheckpointError,
)
from floatxq.interop.export_gptq import _gptq_facts, output_embedding_names
from floatxq.interop.fp8_static import modelopt_fp8_static
from floatxq.interop.layouts import (
    _torchao_metadata,
    decide_layout,
    read_fp8_config,
    read_gptq_config,
)
from floatxq.interop.nvfp4_w4a4 import modelopt_nvfp4_w4a4
from floatxq.interop.payload import FLOATXQ_KEY, fp8_gsq_from_record
from floatxq.interop.readers import module_sources, read_module, refuse_activation_scales
from floatxq.interop.shards import header_metadata, iter_tensors, read_json, tensor_infos
from floatxq.interop.sources import (
    MODELOPT_ACTIVATION_REFUSAL,
    modelopt_activation_quantization,
    read_hf_quant_config,
)
from floatxq.nn.fp8_linear import TorchFP8Linear
from floatxq.w4a.activation import global_scale_bits_problem


def _hf_config(config_payload: Mapping[str, Any]) -> Any:
    """transformers' config object for a ``config.json`` payload (its ``quantization_config``
    left out)."""
    from transformers import AutoConfig

    payload = {k: v for k, v in config_payload.items() if k != "quantization_config"}
    model_type = payload.pop("model_type", None)
    if not model_type:
        raise CheckpointError(f"load: {CONFIG_FILE} has no 'model_type'")
    return AutoConfig.for_model(model_type, **payload)


def _build_from_config(
    config_payload: Mapping[str, Any], *, device: Any, dtype: Any, config: Any = None
) -> nn.Module:
    from transformers import AutoModelForCausalLM

    config = config if config is not None else _hf_config(config_payload)
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


_SIZE_FIELDS: tuple[str, ...] = (
    "hidden_size", "intermediate_size", "vocab_size", "num_attention_heads",
    "num_key_value_heads", "head_dim", "num_hidden_layers", "max_position_embeddings",
    "moe_intermediate_size", "shared_expert_intermediate_size", "num_experts",
    "num_local_experts", "n_routed_experts", "num_experts_per_tok", "n_embd", "n_head", "n_inner",
    "n_layer", "n_positions", "n_ctx",
)  # fmt: skip
"""config.json fields that size the model's tensors: each must be an int in [0, 2**31 - 1]."""
_POSITIVE_FIELDS = frozenset(
    {"hidden_size", "vocab_size", "num_attention_heads", "num_key_value_heads", "n_embd", "n_head"}
)
_SIZE_LIMIT = 2**31 - 1
_EXPERT_FIELDS = ("num_experts", "num_local_experts", "n_routed_experts")
_EXPERT_INDEX = re.compile(r"\.experts\.(\d+)\.")
_ELEMENTS_PER_BYTE = 4
"""Most weights one stored byte can hold: 2-bit GPTQ codes, the densest layout floatxq reads."""
_ELEMENT_SLACK = 2**24
"""Elements a model may hold beyond its files' bytes (rotary tables and other small buffers)."""
_QUANTIZED_LEAVES = (
    "qweight", "weight_packed", "_weight_qdata", "weight_scale", "weight_scale_inv",
    "comfy_quant",
)  # fmt: skip


def _check_size_fields(config: Path, payload: Mapping[str, Any]) -> None:
    """Every size field an int in range, and the attention heads consistent, before any build."""
    for field in _SIZE_FIELDS:
        value = payload.get(field)
        if value is None:
            continue
        low = 1 if field in _POSITIVE_FIELDS else 0
        if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= _SIZE_LIMIT:
            raise CheckpointError(
                f"load: {config} {field} is {_short(value)}; a size must be an int from {low} to "
                f"{_SIZE_LIMIT}"
            )
    heads = payload.get("num_attention_heads", payload.get("n_head"))
    kv = payload.get("num_key_value_heads")
    if heads is not None and kv is not None and (kv > heads or heads % kv):
        raise CheckpointError(
            f"load: {config} num_key_value_heads {kv} does not divide num_attention_heads {heads}"
        )


def _short(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _sizes(payload: Mapping[str, Any]) -> str:
    return ", ".join(f"{f}={payload[f]}" for f in _SIZE_FIELDS if payload.get(f) is not None)


def _stored_linear(prefix: str, by_name: Mapping[str, Any]) -> tuple[int | None, int | None, str]:
    """``(out, in, tensor)`` of a quantized linear as its stored tensors give them (None where a
    size is not in the headers alone), whatever the layout: GPTQ ``qweight (in·bits/32, out)``;
    packed words ``(out, in·bits/32)``; FP4 bytes ``(out, in/2)``; FP8 codes ``(out, in)``."""
    qweight = by_name.get(f"{prefix}.qweight")
    if qweight is not None and len(qweight.shape) == 2:
        return qweight.shape[1], None, qweight.name  # (its rows depend on the bits: read later)
    for leaf in ("weight_packed", "_weight_qdata", "weight"):
        info = by_name.get(f"{prefix}.{leaf}")
        if info is None or len(info.shape) != 2:
            continue
        cols = info.shape[1] * 2 if info.dtype == "U8" else None  # two FP4 codes per byte
        if info.dtype.startswith("F8"):
            cols = info.shape[1]
        return info.shape[0], cols, info.name
    return None, None, ""


def _check_config_builds_the_tensors(
    path: Path, payload: Mapping[str, Any], infos: list, dtype: Any
) -> None:
    """Build the model on the meta device (no memory) and compare it with the headers: a dense
    tensor must have the model's shape, a quantized linear its ``(out, in)``, and the model may
    not need more elements than its files can hold."""
    from floatxq.lifecycle.fp8 import LINEAR_TYPES

    config = path / CONFIG_FILE
    try:
        hf_config = _hf_config(payload)
    except (CheckpointError, ImportError):
        raise
    except Exception as exc:  # transformers' own refusals of the config's values
        raise CheckpointError(
            f"load: {config} does not build a model ({type(exc).__name__}: {_short(str(exc), 200)})"
        ) from None
    try:
        model = _build_from_config(payload, device="meta", dtype=dtype, config=hf_config)
    except Exception:  # an architecture that cannot be built on the meta device: the real build
        return  # (after the checks above) raises whatever this one did

    by_name = {info.name: info for info in infos}
    quantized = {
        name.rpartition(".")[0] for name in by_name if name.rpartition(".")[2] in _QUANTIZED_LEAVES
    }
    for name, tensor in model.state_dict().items():
        info = by_name.get(name)
        if info is None or name.rpartition(".")[0] in quantized:
            continue
        if tuple(info.shape) != tuple(tensor.shape):
            raise CheckpointError(
                f"load: {config} ({_sizes(payload)}) builds {name} of shape "
                f"{tuple(tensor.shape)}, but {info.file} stores it as {tuple(info.shape)}; "
                f"refusing to build the model"
            )
    for name, module in model.named_modules():
        if name not in quantized or not isinstance(module, LINEAR_TYPES):
            continue
        if not isinstance(module, nn.Linear):
            continue  # Conv1D / convolutions: their stored forms are checked when read
        out, rows, tensor = _stored_linear(name, by_name)
        want = (module.out_features, module.in_features)
        if (out is not None and out != want[0]) or (rows is not None and rows != want[1]):
            held = f"({out if out is not None else '?'}, {rows if rows is not None else '?'})"
            raise CheckpointError(
                f"load: {config} ({_sizes(payload)}) builds {name} as a {want} linear, but "
                f"{by_name[tensor].file} stores {tensor} of shape {by_name[tensor].shape} (a "
                f"{held} weight); refusing to build the model"
            )
    elements = sum(p.numel() for p in model.parameters()) + sum(b.numel() for b in model.buffers())
    stored = sum(os.path.getsize(path / file) for file in {info.file for info in infos})
    if elements > _ELEMENTS_PER_BYTE * stored + _ELEMENT_SLACK:
        raise CheckpointError(
            f"load: {config} ({_sizes(payload)}) builds a model of {elements} elements, but the "
            f"files hold {stored} bytes (at most {_ELEMENTS_PER_BYTE} weights a byte); refusing "
            f"to allocate it"
        )


def _check_config_against_tensors(
    path: Path, payload: Mapping[str, Any], infos: list, *, dtype: Any = None
) -> None:
    """Refuse a config.json the tensors contradict, before a model is built from it.

    A config with far more layers, experts or wider layers than the checkpoint stores would
    allocate them all (``num_hidden_layers: 10**6`` or ``intermediate_size: 10**8`` would
    exhaust memory) before any tensor is read; a config that ties ``lm_head`` to the embeddings
    would silently drop a stored, different ``lm_head``. So the size fields are checked (ints in
    range, heads that divide), the layer and expert counts compared with the tensor names, and
    the model built on the meta device (no memory) is compared with the headers' shapes.

    Raises:
      CheckpointError: naming config.json, the field and what the tensors hold.
    """
    config = path / CONFIG_FILE
    _check_size_fields(config, payload)
    layers = payload.get("num_hidden_layers", payload.get("n_layer"))
    indices = {int(m.group(1)) for info in infos for m in [_LAYER_INDEX.search(info.name)] if m}
    if indices and layers is not None:
        stored = max(indices) + 1
        if not isinstance(layers, int) or isinstance(layers, bool) or layers != stored:
            raise CheckpointError(
                f"load: {config} num_hidden_layers is {layers!r} but the tensors hold "
                f"{stored} layers (indices 0..{stored - 1}); refusing to build the model"
            )
    experts = {int(m.group(1)) for info in infos for m in [_EXPERT_INDEX.search(info.name)] if m}
    for field in _EXPERT_FIELDS:
        declared = payload.get(field)
        if experts and isinstance(declared, int) and declared > max(experts) + 1:
            raise CheckpointError(
                f"load: {config} {field} is {declared} but the tensors hold "
                f"{max(experts) + 1} experts; refusing to build the model"
            )
    _check_config_builds_the_tensors(path, payload, infos, dtype)
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
    """The FP8Config of a floatxq / GPT-QModel directory: both files, which must agree
    (:func:`floatxq.interop.layouts.read_fp8_config`)."""
    quantize_file = path / QUANTIZE_CONFIG_FILE
    quantize = read_json(quantize_file, what="load") if quantize_file.is_file() else None
    return read_fp8_config(path, qpayload, quantize)


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
        if global_scale_bits_problem(bits.reshape(())) is not None:  # -0.0 (0x80000000) too
            pattern = int(bits.reshape(())) & 0xFFFFFFFF
            raise CheckpointError(
                f"load: {where} holds {value!r}; an activation global scale is 0.0 (dynamic) or "
                f"a positive finite FP32 value (got bits 0x{pattern:08x}; 0.0 is 0x00000000)"
            )
        del state[f"{name}{suffix}"]
    return {name: bits.reshape(()) for name, bits in found.items()}


def _load_quantized(
    path: Path,
    config_payload: Mapping[str, Any],
    *,
    device: Any,
    dtype: Any,
    weight_only: bool = False,
) -> "tuple[nn.Module | None, FP8Config | GPTQConfig | None, Any, dict[str, torch.Tensor]]":
    """The model a quantized directory holds (``None`` for a dense one), its config, layout
    decision and W4A activation scales. ``weight_only`` (a requantization source): activation
    scales and declared activation schemes are dropped, not refused; the modules are built
    weight-only from their stored weights."""
    from floatxq.lifecycle.fp8 import LINEAR_TYPES

    infos = tensor_infos(path)
    metadata = header_metadata(path)
    decision = decide_layout(path, config_payload, infos, header_metadata=metadata)
    _check_config_against_tensors(path, config_payload, infos, dtype=dtype)
    if decision.layout == "dense":
        return None, None, decision, {}
    names = [info.name for info in infos]
    qpayload = config_payload.get("quantization_config") or {}
    if decision.layout == "modelopt" and not weight_only:
        declared = dict(read_hf_quant_config(path, strict=True) or {})
        declared.update(qpayload)
        declared.setdefault("quant_method", "modelopt")
        mode = modelopt_activation_quantization(declared, names)
        if (
            mode is not None
            and not modelopt_nvfp4_w4a4(declared, names, path)
            and not modelopt_fp8_static(declared, names, path)
        ):
            raise CheckpointError(f"load: {path}: " + MODELOPT_ACTIVATION_REFUSAL.format(mode=mode))
    if not weight_only:
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
    if weight_only:  # the activation scales of a requantization source are not read
        state = {k: v for k, v in state.items() if not k.endswith(ACTIVATION_SCALE_SUFFIXES)}
    activation_bits = _pop_activation_bits(state, qconfig, files, path)
    sources, rest = module_sources(state, linear_names, layout=decision.layout)
    torchao = _torchao_metadata(metadata, path) if decision.layout == "torchao" else None
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
            weight_only=weight_only,
        )
        if built is None:
            rest.update({f"{source.name}.{k}": v for k, v in source.tensors.items()})
            continue
        _check_built(source.name, built, modules[source.name], qconfig, file)
        model.set_submodule(source.name, built)
        built_names.append(source.name)
    try:
        result = model.load_state_dict(rest, strict=False)
    except RuntimeError as exc:  # a dense tensor of another shape than the model's
        raise CheckpointError(f"load: {path} does not match the model: {exc}") from None
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
        if decision.layout == "compressed-tensors" and FLOATXQ_KEY in qpayload:
            qconfig = _with_recorded_gsq(path, qpayload[FLOATXQ_KEY], qconfig)
    return model.eval(), qconfig, decision, activation_bits


def _with_recorded_gsq(path: Path, record: Any, described: Any) -> FP8Config:
    """The config described from the modules, with the GSQ settings floatxq recorded in a
    compressed-tensors payload (``quantization_config.floatxq``)."""
    try:
        gsq, calibration = fp8_gsq_from_record(record)
        if not isinstance(described, FP8Config):
            raise ValueError("GSQ settings describe FP8 modules, and the checkpoint holds others")
        return dataclasses.replace(described, gsq=gsq, gsq_calibration=calibration)
    except (TypeError, ValueError) as exc:
        where = f"{path / CONFIG_FILE} quantization_config.{FLOATXQ_KEY}"
        raise CheckpointError(f"load: {where}: {exc}") from None


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
