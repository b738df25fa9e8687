"""Checkpoint layouts written: the tensors and payloads a save writes for each reader.

floatxq keeps FP8 weights with INVERSE scales (``weight_scale_inv``: decode divides). Other
readers multiply, and transformers reads ``quant_method: "fp8"`` with a ``weight_scale_inv`` as
its own fine-grained FP8, where that tensor multiplies. So a save picks a layout
(:data:`CHECKPOINT_LAYOUTS`), and each writes what its reader expects:

* ``compressed-tensors`` (default): ``float-quantized`` FP8, ``nvfp4-pack-quantized`` NVFP4 and
  ``pack-quantized`` GPTQ (:mod:`floatxq.interop.export_gptq`), ``mixed-precision`` when mixed.
* ``hf``: transformers' / DeepSeek's fine-grained FP8 (tensor scales, or one block size).
* ``gptqmodel``: every FP8 module byte for byte (inverse scales), with ``activation_scheme`` =
  :data:`GPTQMODEL_REFUSAL_MARKER` so transformers and vLLM refuse the files; for a GPTQ model the
  ``gptq`` files.
* ``gptq``: GPTQ modules byte for byte in GPT-QModel's layout.
* ``modelopt``: NVIDIA ModelOpt's NVFP4 files (:mod:`floatxq.interop.export_modelopt`): the
  ``TorchFP4Linear`` buffers as they are, ``hf_quant_config.json`` and ``quant_method:
  "modelopt"``; NVFP4 modules only (weight-only and W4A4).

A model a layout cannot hold is refused with a ``ValueError`` naming the module and the layouts
that hold it, never written approximately; what ``floatxq.load`` would refuse is refused here
(``docs/checkpoint-safety.md``). ``docs/interop.md`` has the table of tensors, payloads and
readers. Biases: ``hf``, ``compressed-tensors`` and ``modelopt`` write FP8 / NVFP4 biases in the
model's dtype (the floating dtype of most parameters, what transformers loads a dense bias into);
``gptqmodel`` keeps the stored float16 bias; GPTQ modules keep theirs in every layout.

Numerics: codes and NVFP4 bytes are written unchanged. Multiplying FP8 scales are the FP32
reciprocal ``fl(1/s)`` of floatxq's inverse scale ``s``, and compressed-tensors' dividing
``weight_global_scale`` (and a W4A4 module's ``input_global_scale``) is ``fl(1/g)`` of the
NVFP4 tensor scale ``g`` (the activation global scale ``input_scale``): exact for powers of two,
else ``|fl(1/s) - 1/s| <= 2**-24 * |1/s|``, so a multiplying reader's decode lies within
``3 * 2**-24`` relative of floatxq's before rounding into the model dtype (``docs/interop.md``,
"Reciprocals").
"""

import typing
from collections import Counter
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal, NamedTuple

import torch
from torch import nn

from floatxq._typing import Float, Float32, Tensor
from floatxq.config import FP8Config, GPTQConfig, NVFP4Config
from floatxq.formats import ACTIVATION_SCALE_BITS
from floatxq.fp8 import fp32_reciprocal
from floatxq.interop.activations import ct_input_activations, refuse_dropped_activations
from floatxq.interop.checkpoint import CheckpointError
from floatxq.interop.export_gptq import (
    _check_dynamic_activation_scale,
    _check_no_activation_policy,
    _ct_int_weights,
    _describe_gptq,
    _gptq_ct_tensors,
    _gptq_facts,
    _gptq_layouts,
    _gptq_state,
    _GptqFacts,
    _refuse,
    output_embedding_names,
    stream_scale_entry,
)
from floatxq.interop.export_modelopt import (
    SIDECAR_FILE,
    check_one_algo,
    modelopt_nvfp4_algo,
    modelopt_payloads,
)
from floatxq.interop.fp8_static import modelopt_fp8_static
from floatxq.interop.layouts import LayoutDecision
from floatxq.interop.nvfp4_w4a4 import modelopt_nvfp4_w4a4
from floatxq.interop.payload import (
    FLOATXQ_KEY,
    fp8_config_to_payload,
    fp8_gsq_record,
    gptq_config_to_payload,
)
from floatxq.interop.readers import (
    ModuleSource,
    module_sources,
    read_module,
    refuse_activation_scales,
)
from floatxq.interop.sources import MODELOPT_ACTIVATION_REFUSAL, modelopt_activation_quantization
from floatxq.nn.fp8_linear import TorchFP8Linear
from floatxq.w4a.activation import global_scale_bits_problem

__all__ = [
    "CHECKPOINT_LAYOUTS",
    "DEFAULT_LAYOUT",
    "GPTQMODEL_REFUSAL_MARKER",
    "CheckpointLayout",
    "LayoutExport",
    "export_layout",
    "normalize_layout",
]

CheckpointLayout = Literal["compressed-tensors", "hf", "gptqmodel", "gptq", "modelopt"]
"""The checkpoint layouts a save can write (see the module docstring's table)."""
CHECKPOINT_LAYOUTS: tuple[str, ...] = typing.get_args(CheckpointLayout)
DEFAULT_LAYOUT: CheckpointLayout = "compressed-tensors"
LAYOUT_ALIASES: Mapping[str, str] = {
    "ct": "compressed-tensors",
    "compressed_tensors": "compressed-tensors",
    "transformers": "hf",
    "deepseek": "hf",
    "nvidia-modelopt": "modelopt",
    "nvidia_modelopt": "modelopt",
}
"""Other spellings :func:`normalize_layout` accepts, and the layout each names."""

GPTQMODEL_REFUSAL_MARKER = (
    "unsupported: weight_scale_inv here is an inverse scale (decode divides); load with floatxq "
    "or GPT-QModel"
)
"""``activation_scheme`` of a ``gptqmodel`` export's ``config.json``: readers that take
``quant_method: "fp8"`` as multiplying scales refuse this value instead of misreading the files."""

_E4M3 = "float8_e4m3fn"
_CT_METHOD = "compressed-tensors"
_CT_FLOAT_FORMAT = "float-quantized"
_CT_NVFP4_FORMAT = "nvfp4-pack-quantized"
_CT_MIXED_FORMAT = "mixed-precision"
_CT_STRATEGY = {"tensor": "tensor", "row": "channel", "block": "block"}
"""floatxq's FP8 scale method → compressed-tensors' weight strategy."""
_NVFP4_GROUP = 16
_CT_PACKED_FORMAT = "pack-quantized"


class LayoutExport(NamedTuple):
    """What a save writes for one layout.

    Fields:
      state: every tensor to write, by name; tensors not part of a quantized module are the
        model's own (``model.state_dict()``'s), the rest new tensors in the layout's names.
      quantization_config: ``config.json``'s ``quantization_config``.
      quantize_config: ``quantize_config.json``'s payload (``gptqmodel`` only), else None.
      json_files: other JSON files by name (``modelopt``: ``hf_quant_config.json``), else None.
    """

    state: dict[str, Tensor]
    quantization_config: dict[str, Any]
    quantize_config: dict[str, Any] | None
    json_files: dict[str, dict[str, Any]] | None = None


def normalize_layout(value: Any) -> CheckpointLayout:
    """The canonical layout name for ``value`` (case and surrounding spaces ignored).

    Accepts ``"compressed-tensors"``, ``"hf"``, ``"gptqmodel"``, ``"gptq"``, ``"modelopt"`` and
    the aliases ``"ct"``, ``"compressed_tensors"`` (compressed-tensors), ``"transformers"``,
    ``"deepseek"`` (hf), ``"nvidia-modelopt"``, ``"nvidia_modelopt"`` (modelopt).

    Raises:
      TypeError: ``value`` is not a string. ValueError: an unknown name (the accepted ones are
        listed).

    Numerics: names only.

    Example:
      >>> normalize_layout(" CT "), normalize_layout("transformers")
      ('compressed-tensors', 'hf')
    """
    if not isinstance(value, str):
        raise TypeError(f"layout: expected a string, got {type(value).__name__} {value!r}")
    name = str.lower(str.strip(value))
    name = LAYOUT_ALIASES.get(name, name)
    if name not in CHECKPOINT_LAYOUTS:
        accepted = ", ".join(repr(n) for n in (*CHECKPOINT_LAYOUTS, *LAYOUT_ALIASES))
        raise ValueError(f"layout: unknown checkpoint layout {value!r}; accepted: {accepted}")
    return typing.cast(CheckpointLayout, name)


# --------------------------------------------------------------------------------------------
# The model's modules
# --------------------------------------------------------------------------------------------


def _fp4_linear_class() -> type | None:
    """``TorchFP4Linear`` when its module imports (the class is looked up lazily)."""
    try:
        from floatxq.nn.fp4_linear import TorchFP4Linear
    except ImportError:
        return None
    return TorchFP4Linear


def _gptq_linear_class() -> type | None:
    """``GPTQLinear`` when its module imports (the class is looked up lazily)."""
    try:
        from floatxq.nn.gptq_linear import GPTQLinear
    except ImportError:
        return None
    return GPTQLinear


class _Modules(NamedTuple):
    """The model's quantized and dense linear modules by name, in ``named_modules`` order (a
    shared module under each of its names)."""

    fp8: list[tuple[str, TorchFP8Linear]]
    nvfp4: list[tuple[str, nn.Module]]
    quantized: list[tuple[str, nn.Module]]
    """The FP8, NVFP4 and GPTQ modules together."""
    dense: list[str]
    gptq: list[tuple[str, nn.Module]]


def _modules(model: nn.Module) -> _Modules:
    fp4_class, gptq_class = _fp4_linear_class(), _gptq_linear_class()
    found = _Modules(fp8=[], nvfp4=[], quantized=[], dense=[], gptq=[])
    for name, module in model.named_modules(remove_duplicate=False):
        if isinstance(module, TorchFP8Linear):
            found.fp8.append((name, module))
            found.quantized.append((name, module))
        elif fp4_class is not None and isinstance(module, fp4_class):
            found.nvfp4.append((name, module))
            found.quantized.append((name, module))
        elif gptq_class is not None and isinstance(module, gptq_class):
            found.gptq.append((name, module))
            found.quantized.append((name, module))
        elif isinstance(module, nn.Linear):
            found.dense.append(name)
    return found


def _fp8_scheme(module: TorchFP8Linear) -> tuple[str, str, tuple[int, int] | None]:
    """(format, scale method, block size) of an FP8 module."""
    block = module.weight_block_size if module.weight_scale_method == "block" else None
    return module.format, module.weight_scale_method, block


def _describe_fp8(module: TorchFP8Linear) -> str:
    fmt, method, block = _fp8_scheme(module)
    scales = f"block scales {list(block)}" if block is not None else f"{method} scales"
    what = f"{fmt} weights with {scales}"
    if module.input_scale is not None:
        what += ", static FP8 activations (an input_scale)"
    if module.conv is not None:
        what += ", a convolution flattened to (out, in*k)"
    return what


def _fp8_layouts(module: TorchFP8Linear) -> list[str]:
    """The layouts that hold an FP8 module (static activations: not ``gptqmodel``, whose payload
    declares none; ModelOpt's FP8 is static W8A8 with tensor scales)."""
    fmt, method, _ = _fp8_scheme(module)
    plain_e4m3 = fmt == _E4M3 and module.conv is None
    static = module.input_scale is not None
    held = []
    if plain_e4m3:
        held.append("compressed-tensors")
    if plain_e4m3 and method in ("tensor", "block"):
        held.append("hf")
    if plain_e4m3 and method == "tensor" and static:
        held.append("modelopt")
    if not static:
        held.append("gptqmodel")
    return held


def _check_fp8(layout: str, modules: _Modules, why: str) -> None:
    for name, module in modules.fp8:
        held = _fp8_layouts(module)
        if layout not in held:
            raise _refuse(layout, name, _describe_fp8(module), why, held)


_NVFP4_LAYOUTS = ["compressed-tensors", "modelopt"]
"""The layouts that hold an NVFP4 module (weight-only or W4A4)."""


def _check_no_nvfp4(layout: str, modules: _Modules, why: str) -> None:
    if modules.nvfp4:
        name = modules.nvfp4[0][0]
        raise _refuse(layout, name, "NVFP4 weights", why, _NVFP4_LAYOUTS)


def _require_quantized(layout: str, modules: _Modules) -> None:
    if not modules.quantized:
        raise ValueError(
            f"export: layout {layout!r} describes quantized modules, and the model has none "
            f"(no TorchFP8Linear or TorchFP4Linear, no GPTQLinear); quantize() it first"
        )


def _check_no_gptq(layout: str, modules: _Modules, why: str) -> None:
    if modules.gptq:
        name, module = modules.gptq[0]
        facts = _gptq_facts(module, name)
        raise _refuse(layout, name, _describe_gptq(module), why, _gptq_layouts(module, facts))


def _model_dtype(model: nn.Module) -> torch.dtype | None:
    """The floating dtype holding most of the model's parameters (quantized modules hold
    buffers, so these are the dense ones), or None when it has none."""
    counts: Counter[torch.dtype] = Counter()
    for p in model.parameters():
        if p.is_floating_point():
            counts[p.dtype] += p.numel()
    return counts.most_common(1)[0][0] if counts else None


# --------------------------------------------------------------------------------------------
# GPTQ modules
# --------------------------------------------------------------------------------------------


def _gptq_export(model: nn.Module, modules: _Modules, config: Any, layout: str) -> LayoutExport:
    """The ``gptq`` files (``gptqmodel`` writes the same for a GPTQ model)."""
    if not isinstance(config, GPTQConfig):
        raise TypeError(
            f"export: layout {layout!r} writes GPT-QModel's GPTQ payload from a GPTQConfig; got "
            f"quantize_config={type(config).__name__}"
        )
    why = "a GPTQ checkpoint declares one quant_method ('gptq') for every quantized module"
    for name, module in modules.fp8:
        raise _refuse(layout, name, _describe_fp8(module), why, _fp8_layouts(module))
    _check_no_nvfp4(layout, modules, why)
    state = _gptq_state(model, modules.gptq, config, layout)
    return LayoutExport(state, gptq_config_to_payload(config), gptq_config_to_payload(config))


# --------------------------------------------------------------------------------------------
# Scales
# --------------------------------------------------------------------------------------------


def _multiplying_fp8_scale(module: TorchFP8Linear, layout: str) -> Float32[Tensor, "*s"]:
    """The module's scales as a multiplying reader of ``layout`` shapes them."""
    direct = fp32_reciprocal(module.weight_scale_inv)
    method = module.weight_scale_method
    if layout in ("hf", "modelopt"):  # (modelopt: tensor scales only, 0-d as ModelOpt writes)
        return direct.reshape(()) if method == "tensor" else direct
    if method == "tensor":
        return direct.reshape(1)
    if method == "row":
        return direct.reshape(-1, 1)
    return direct


def _bias(bias: Float[Tensor, "out"], dtype: torch.dtype | None) -> Float[Tensor, "out"]:  # noqa: F821
    return bias if dtype is None or bias.dtype == dtype else bias.to(dtype)


def _nvfp4_entries(module: nn.Module, layout: str) -> dict[str, tuple[str, Tensor] | None]:
    """An NVFP4 module's buffers by name → (the name ``layout`` writes, the tensor): ModelOpt's
    are the module's own; compressed-tensors' global scales divide (their FP32 reciprocals)."""
    input_scale = getattr(module, "input_scale", None)  # W4A4: the activation global scale
    if layout == "modelopt":
        entries: dict[str, tuple[str, Tensor] | None] = {
            leaf: (leaf, getattr(module, leaf))
            for leaf in ("weight", "weight_scale", "weight_scale_2")
        }
        if input_scale is not None:
            entries["input_scale"] = ("input_scale", input_scale)
        return entries
    entries = {
        "weight": ("weight_packed", module.weight),
        "weight_scale": ("weight_scale", module.weight_scale),
        "weight_scale_2": (
            "weight_global_scale",
            fp32_reciprocal(module.weight_scale_2).reshape(1),
        ),
    }
    if input_scale is not None:
        entries["input_scale"] = ("input_global_scale", fp32_reciprocal(input_scale).reshape(1))
    return entries


def _converted_state(
    model: nn.Module,
    modules: _Modules,
    layout: str,
    facts: Mapping[str, _GptqFacts] | None = None,
) -> dict[str, Tensor]:
    """``model.state_dict()`` with each quantized module's tensors in ``layout``'s names (GPTQ
    modules as compressed-tensors ``pack-quantized``, from their ``facts``)."""
    dtype = _model_dtype(model)
    gptq = {
        name: _gptq_ct_tensors(name, module, (facts or {})[name]) for name, module in modules.gptq
    }
    renamed: dict[str, dict[str, tuple[str, Tensor] | None]] = {}
    for name, module in modules.fp8:
        scale_name = "weight_scale_inv" if layout == "hf" else "weight_scale"
        entries: dict[str, tuple[str, Tensor] | None] = {
            "weight": ("weight", module.weight),
            "weight_scale_inv": (scale_name, _multiplying_fp8_scale(module, layout)),
        }
        if module.bias is not None:
            entries["bias"] = ("bias", _bias(module.bias, dtype))
        if module.input_scale is not None:  # static activations: (1,) in compressed-tensors
            scalar = layout in ("hf", "modelopt")
            stored = module.input_scale.reshape(() if scalar else (1,))
            entries["input_scale"] = (
                "activation_scale" if layout == "hf" else "input_scale",
                stored,
            )
        renamed[name] = entries
    for name, module in modules.nvfp4:
        entries = _nvfp4_entries(module, layout)
        if module.bias is not None:
            entries["bias"] = ("bias", _bias(module.bias, dtype))
        renamed[name] = entries
    state: dict[str, Tensor] = {}
    for key, tensor in model.state_dict().items():
        if stream_scale_entry(model, key, tensor, None, layout):  # refused when calibrated
            continue
        prefix, _, leaf = key.rpartition(".")
        if leaf == ACTIVATION_SCALE_BITS:  # a W4A-NVFP4 module's activation global scale
            _check_dynamic_activation_scale(layout, prefix, tensor)
            continue
        if prefix in gptq:
            continue
        entry = renamed.get(prefix, {}).get(leaf)
        if entry is None:
            state[key] = tensor
            continue
        new_leaf, new_tensor = entry
        state[f"{prefix}.{new_leaf}" if prefix else new_leaf] = new_tensor
    for prefix, tensors in gptq.items():
        state.update({f"{prefix}.{leaf}" if prefix else leaf: t for leaf, t in tensors.items()})
    return state


# --------------------------------------------------------------------------------------------
# Payloads
# --------------------------------------------------------------------------------------------


def _hf_payload(modules: _Modules) -> dict[str, Any]:
    """transformers' fine-grained FP8 payload; every FP8 module must share one scale layout and
    one activation scheme (``static`` where every module holds an ``input_scale``)."""
    first_name, first = modules.fp8[0]
    _, method, block = _fp8_scheme(first)
    static = first.input_scale is not None
    for name, module in modules.fp8[1:]:
        if (module.input_scale is not None) != static:
            raise ValueError(
                f"export: layout 'hf' declares one activation_scheme for the whole model, but "
                f"module {first_name!r} has {_describe_fp8(first)} and module {name!r} has "
                f"{_describe_fp8(module)}; layouts that hold both: 'compressed-tensors'"
            )
        if _fp8_scheme(module)[1:] != (method, block):
            raise ValueError(
                f"export: layout 'hf' writes one weight_block_size for the whole model "
                f"(transformers' fine-grained FP8), but module {first_name!r} has "
                f"{_describe_fp8(first)} and module {name!r} has {_describe_fp8(module)}; "
                f"layouts that hold both: 'compressed-tensors', 'gptqmodel'"
            )
    return {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "static" if static else "dynamic",
        "weight_block_size": list(block) if block is not None else None,
        "modules_to_not_convert": list(modules.dense),
    }


def _ct_fp8_weights(method: str, block: tuple[int, int] | None) -> dict[str, Any]:
    weights: dict[str, Any] = {
        "num_bits": 8,
        "type": "float",
        "symmetric": True,
        "group_size": None,
        "strategy": _CT_STRATEGY[method],
    }
    if block is not None:
        weights["block_structure"] = list(block)
    weights["dynamic"] = False
    return weights


def _ct_nvfp4_weights() -> dict[str, Any]:
    return {
        "num_bits": 4,
        "type": "float",
        "symmetric": True,
        "group_size": _NVFP4_GROUP,
        "strategy": "tensor_group",
        "dynamic": False,
        "scale_dtype": "torch.float8_e4m3fn",
    }


def _ct_nvfp4_activations() -> dict[str, Any]:
    """llm-compressor's ``NVFP4`` scheme's ``input_activations``: E2M1 per 16 inputs with E4M3
    block scales computed per call ("local") under the stored ``input_global_scale``."""
    return {
        "num_bits": 4,
        "type": "float",
        "symmetric": True,
        "group_size": _NVFP4_GROUP,
        "strategy": "tensor_group",
        "dynamic": "local",
        "scale_dtype": "torch.float8_e4m3fn",
        "observer": "static_minmax",
    }


def _ct_activations(key: tuple[Any, ...]) -> dict[str, Any] | None:
    """A config group's ``input_activations``, from its scheme key (``_ct_payload``'s)."""
    if key[0] == "fp8":
        return ct_input_activations(key[3])
    if key[0] == "nvfp4" and key[1]:
        return _ct_nvfp4_activations()
    return None


def _ct_payload(modules: _Modules, facts: Mapping[str, _GptqFacts] | None = None) -> dict[str, Any]:
    """compressed-tensors' payload: one config group per distinct scheme (numbered in module
    order); FP8 modules' dynamic activations and W4A4 NVFP4 modules' activations declared."""
    schemes: dict[Any, tuple[str, dict[str, Any], list[str]]] = {}
    gptq = {name for name, _ in modules.gptq}
    for name, module in modules.quantized:
        if name in gptq:
            sym = (facts or {})[name].symmetric
            key = ("int", module.bits, module.group_size, sym)
            if key not in schemes:
                weights = _ct_int_weights(module.bits, module.group_size, sym)
                schemes[key] = (_CT_PACKED_FORMAT, weights, [])
        elif isinstance(module, TorchFP8Linear):
            _, method, block = _fp8_scheme(module)
            key: tuple[Any, ...] = ("fp8", method, block, module.input_quant)
            if key not in schemes:
                schemes[key] = (_CT_FLOAT_FORMAT, _ct_fp8_weights(method, block), [])
        else:
            key = ("nvfp4", getattr(module, "input_scale", None) is not None)
            if key not in schemes:
                schemes[key] = (_CT_NVFP4_FORMAT, _ct_nvfp4_weights(), [])
        schemes[key][2].append(name)
    one = len(schemes) == 1
    groups = {
        f"group_{i}": {
            "targets": ["Linear"] if one else names,
            "weights": weights,
            "input_activations": _ct_activations(key),
            "output_activations": None,
            "format": fmt,
        }
        for i, (key, (fmt, weights, names)) in enumerate(schemes.items())
    }
    formats = {fmt for fmt, _, _ in schemes.values()}
    return {
        "quant_method": _CT_METHOD,
        "format": formats.pop() if len(formats) == 1 else _CT_MIXED_FORMAT,
        "quantization_status": "compressed",
        "config_groups": groups,
        "kv_cache_scheme": None,
        "global_compression_ratio": None,
        "ignore": list(modules.dense),
        "moe_sparsity_config": None,
        "sparsity_config": {},
        "transform_config": {},
    }


# --------------------------------------------------------------------------------------------
# Export
# --------------------------------------------------------------------------------------------


def export_layout(
    model: nn.Module, quantize_config: FP8Config | GPTQConfig | NVFP4Config | None, layout: str
) -> LayoutExport:
    """The tensors and payloads that save ``model`` in a checkpoint ``layout``.

    Reads the model's ``TorchFP8Linear`` / ``TorchFP4Linear`` / ``GPTQLinear`` and dense
    ``nn.Linear`` modules and returns new tensors and dicts; the model is not changed. What each
    layout writes (tensor names, shapes, payload keys) is the table in ``docs/interop.md``; for
    ``gptq`` the config must describe every module as readers take it (``docs/gptq.md``).

    Args:
      model: the quantized model.
      quantize_config: an ``FP8Config`` for ``gptqmodel`` FP8 files, a ``GPTQConfig`` for ``gptq``
        (and ``gptqmodel`` with GPTQ modules); unused by the others.
      layout: a name :func:`normalize_layout` accepts.

    Every module's tensors pass the checks ``load`` runs (:func:`~floatxq.interop.readers.
    read_module`) before they are returned.
    Raises:
      ValueError: an unknown layout; a module the layout cannot hold (named, with the layouts
        that hold it); a W4A activation policy outside ``gptq`` / ``gptqmodel``; a GPTQ config
        that misdescribes a module, or scales float16 cannot hold; no quantized module.
      CheckpointError: (a ValueError) a tensor ``floatxq.load`` would refuse: the module, the
        tensor and what is wrong with it named.
      TypeError: ``gptqmodel`` or ``gptq`` without the config its payload is written from.

    Numerics: as the module docstring (FP8 / NVFP4 biases rounded once into the model dtype).
    Example:
      >>> model = nn.Sequential(TorchFP8Linear.from_linear(nn.Linear(64, 32)), nn.Linear(32, 8))
      >>> out = export_layout(model, FP8Config(), "ct")
      >>> out.quantization_config["ignore"], sorted(out.state)[:3]
      (['1'], ['0.bias', '0.weight', '0.weight_scale'])
    """
    name = normalize_layout(layout)
    modules = _modules(model)
    exported = _export(model, modules, quantize_config, name)
    _check_loadable(model, modules, exported, quantize_config, name)
    return exported


def _export(model: nn.Module, modules: _Modules, quantize_config: Any, name: str) -> LayoutExport:
    """:func:`export_layout` before its check that load reads the result back."""
    if name == "gptq" or (name == "gptqmodel" and modules.gptq):
        if not modules.gptq:
            _require_quantized(name, modules)
            for module_name, module in modules.fp8:
                raise _refuse(
                    name,
                    module_name,
                    _describe_fp8(module),
                    "it holds GPTQ modules only",
                    _fp8_layouts(module),
                )
            _check_no_nvfp4(name, modules, "it holds GPTQ modules only")
        return _gptq_export(model, modules, quantize_config, name)
    if name == "gptqmodel":
        if not isinstance(quantize_config, FP8Config):
            raise TypeError(
                f"export: layout 'gptqmodel' writes GPT-QModel's payload from an FP8Config; got "
                f"quantize_config={type(quantize_config).__name__}"
            )
        _check_no_nvfp4(name, modules, "GPT-QModel's FP8 payload describes FP8 modules only")
        _check_fp8(name, modules, "GPT-QModel's FP8 payload declares no activation scheme")
        payload = fp8_config_to_payload(quantize_config)
        config = {**payload, "activation_scheme": GPTQMODEL_REFUSAL_MARKER}
        return LayoutExport(dict(model.state_dict()), config, payload)
    _require_quantized(name, modules)
    _check_no_activation_policy(name, quantize_config)
    if name == "modelopt":
        return _modelopt_export(model, modules)
    if name == "hf":
        _check_no_gptq(name, modules, "transformers' fine-grained FP8 holds FP8 weights only")
        _check_no_nvfp4(name, modules, "transformers' fine-grained FP8 holds FP8 weights only")
        _check_fp8(
            name,
            modules,
            "transformers' fine-grained FP8 holds float8_e4m3fn linear weights with tensor or "
            "block scales",
        )
        return LayoutExport(_converted_state(model, modules, name), _hf_payload(modules), None)
    _check_fp8(
        name,
        modules,
        "compressed-tensors' float-quantized FP8 holds float8_e4m3fn linear weights",
    )
    facts = {module_name: _gptq_facts(module, module_name) for module_name, module in modules.gptq}
    state = _converted_state(model, modules, name, facts)
    payload = _ct_payload(modules, facts)
    if isinstance(quantize_config, FP8Config) and quantize_config.gsq is not None:
        payload[FLOATXQ_KEY] = fp8_gsq_record(quantize_config)  # read back by floatxq.load
    return LayoutExport(state, payload, None)


def _modelopt_export(model: nn.Module, modules: _Modules) -> LayoutExport:
    """ModelOpt's NVFP4 or FP8 files: the modules' buffers, ``hf_quant_config.json`` and the
    embedded ``quantization_config`` (:mod:`floatxq.interop.export_modelopt`)."""
    why = "floatxq writes ModelOpt's NVFP4 layout and its FP8 one, which is static W8A8"
    _check_no_gptq("modelopt", modules, why)
    _check_fp8("modelopt", modules, why + " with tensor scales (its readers need an input_scale)")
    algos = {module_name: modelopt_nvfp4_algo(module) for module_name, module in modules.quantized}
    check_one_algo(algos)
    sidecar, embedded = modelopt_payloads(algos, modules.dense)
    state = _converted_state(model, modules, "modelopt")
    return LayoutExport(state, embedded, None, {SIDECAR_FILE: sidecar})


# --------------------------------------------------------------------------------------------
# What load reads back
# --------------------------------------------------------------------------------------------

_SAVED = "the files being saved"
"""Where the readers' messages say the tensors are (nothing is on disk yet)."""


def _read_decision(exported: LayoutExport, layout: str, config: Any) -> LayoutDecision:
    """The layout ``load`` decides for ``exported``'s payload (a GPTQ payload is read as
    ``gptq``, in its config's format, whatever layout name wrote it)."""
    if exported.quantization_config.get("quant_method") == "gptq":
        scheme = config.format if isinstance(config, GPTQConfig) else "gptq"
        return LayoutDecision("gptq", "gptq", None, scheme, "save")
    return LayoutDecision(layout, layout, None, None, "save")


def _reader_hint(module: nn.Module, layout: str) -> str:
    """What the module's own buffer is, when the layout writes another tensor from it."""
    if isinstance(module, TorchFP8Linear) and layout in ("compressed-tensors", "hf"):
        stored = "weight_scale_inv" if layout == "hf" else "weight_scale"
        return (
            f" ({layout!r} writes {stored} as the FP32 reciprocal of the module's "
            f"weight_scale_inv, which holds values in "
            f"[{float(module.weight_scale_inv.min())}, {float(module.weight_scale_inv.max())}])"
        )
    return ""


def _check_loadable(
    model: nn.Module,
    modules: _Modules,
    exported: LayoutExport,
    config: Any,
    layout: str,
) -> None:
    """Refuse, before anything is written, what :func:`floatxq.load` would refuse to read back:
    each quantized module's tensors as ``exported`` holds them go through the reader load runs
    (:func:`floatxq.interop.readers.read_module`, the module built and dropped), each W4A-NVFP4
    activation global scale through load's check (0.0, or positive and finite), and the tensor
    names through its refusal of static activation scales.

    Raises:
      CheckpointError: naming the module, the tensor and what is wrong.
    """
    decision = _read_decision(exported, layout, config)
    refuse_activation_scales(decision, list(exported.state), Path(_SAVED))
    if decision.layout == "modelopt":  # the metadata check load runs before the modules
        declared = {**(exported.json_files or {}).get(SIDECAR_FILE, {})}
        declared.update(exported.quantization_config)
        mode = modelopt_activation_quantization(declared, list(exported.state))
        if (
            mode is not None
            and not modelopt_nvfp4_w4a4(declared, exported.state, _SAVED)
            and not modelopt_fp8_static(declared, exported.state, _SAVED)
        ):
            raise CheckpointError(
                f"export: layout 'modelopt' is not written: {_SAVED}: "
                + MODELOPT_ACTIVATION_REFUSAL.format(mode=mode)
            )
    weights: dict[str, Tensor] = {}
    for key, tensor in exported.state.items():
        prefix, _, leaf = key.rpartition(".")
        if leaf != ACTIVATION_SCALE_BITS:
            weights[key] = tensor
            continue
        why = global_scale_bits_problem(tensor)  # load takes these out before the modules
        if why is not None:
            raise CheckpointError(
                f"export: module {prefix!r} holds an {ACTIVATION_SCALE_BITS} that floatxq.load "
                f"refuses, so layout {layout!r} is not written: {why}"
            )
    heads = output_embedding_names(model)
    by_name = dict(modules.quantized)
    sources, _ = module_sources(weights, list(by_name), layout=decision.layout)
    dtype = _model_dtype(model) or torch.bfloat16
    for found in sources:
        # on the CPU, as load reads them (one module at a time; the readers build CPU tensors)
        source = ModuleSource(found.name, {k: v.detach().cpu() for k, v in found.tensors.items()})
        module = by_name[source.name]
        declared, gptq = None, None
        resolved = getattr(config, "resolve", None)
        head = source.name in heads and not getattr(config, "lm_head", False)
        resolved = None if resolved is None or head else resolved(source.name)
        if isinstance(resolved, GPTQConfig):
            gptq = resolved
        elif isinstance(resolved, FP8Config):
            declared = (resolved.weight_scale_method, resolved.weight_block_size)
        shape = (module.out_features, module.in_features)
        original = nn.Linear(shape[1], shape[0], bias=False, device="meta")
        try:
            read = read_module(
                decision,
                source,
                original,
                qconfig=exported.quantization_config,
                dtype=dtype,
                file=_SAVED,
                declared=declared,
                gptq=gptq,
            )
        except CheckpointError as exc:
            raise CheckpointError(
                f"export: module {source.name!r} holds tensors that floatxq.load refuses, so "
                f"layout {layout!r} is not written: {exc}{_reader_hint(module, decision.layout)}"
            ) from None
        refuse_dropped_activations(layout, source.name, module, read)
        if (
            getattr(module, "input_scale", None) is not None
            and getattr(read, "input_scale", None) is None
        ):
            raise CheckpointError(
                f"export: module {source.name!r} is W4A4 (an input_scale), and layout "
                f"{layout!r}'s files would load it as weight-only; not written"
            )
