"""Which checkpoint layout a directory holds, decided from its metadata, and how each is read.

A *layout* is who wrote the files and therefore what their tensors mean. The same tensor name can
mean opposite things: ``weight_scale_inv`` divides in floatxq's and GPT-QModel's files and
multiplies in transformers' / DeepSeek's. So the layout (and with it the scale *convention*) is
decided from metadata only, never from magnitudes:

1. ``config.json``'s ``quantization_config`` (its ``quant_method``, then its format keys), and
   ``quantize_config.json`` when present;
2. the ModelOpt sidecar ``hf_quant_config.json``;
3. markers that stand in for metadata: safetensors header metadata (torchao) and Comfy's
   ``<module>.comfy_quant`` tensors.

Anything left undecided, or metadata that contradicts itself, is refused with
:class:`~floatxq.interop.checkpoint.CheckpointError` naming the file and field. Reading then
turns each module's tensors into the module that runs them: FP8 sources become
:class:`~floatxq.nn.fp8_linear.TorchFP8Linear` (codes untouched; multiplying scales turned into
inverse ones with one FP32 reciprocal each, exact for powers of two), NVFP4 sources become
:class:`~floatxq.nn.fp4_linear.TorchFP4Linear` (bytes untouched, scales unswizzled and nibbles
reordered where the producer differs), GPTQ sources (``quant_method: gptq``, compressed-tensors
``pack-quantized``) become :class:`~floatxq.nn.gptq_linear.GPTQLinear` holding the file's words,
and MX sources or ragged block grids are decoded to dense ``nn.Linear`` weights, one module at a
time. ``docs/interop.md`` has the table.
"""

import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import torch
from torch import nn

from floatxq.config import GPTQConfig
from floatxq.interop.checkpoint import (
    CONFIG_FILE,
    QUANTIZE_CONFIG_FILE,
    CheckpointError,
    TensorInfo,
    read_json,
)
from floatxq.interop.payload import gptq_config_from_payload, payload_method

SIDECAR_FILE = "hf_quant_config.json"
GPTQMODEL_MARKER_PREFIX = "unsupported"
"""How floatxq's ``gptqmodel`` layout's ``activation_scheme`` starts: a value transformers and
vLLM refuse, so neither reads the inverse scales as multiplying ones."""

READ_LAYOUTS: dict[str, str] = {
    "gptqmodel": "floatxq / GPT-QModel FP8 (quantize_config.json; inverse weight_scale_inv)",
    "gptq": "GPTQ: GPT-QModel, transformers/optimum, vLLM, floatxq (quant_method gptq; qweight)",
    "hf": "transformers / DeepSeek / Qwen fine-grained FP8 (quant_method fp8)",
    "compressed-tensors": "compressed-tensors (llm-compressor, vLLM)",
    "modelopt": "NVIDIA ModelOpt (quant_method modelopt or hf_quant_config.json)",
    "quark": "AMD Quark (quant_method quark)",
    "torchao": "torchao safetensors (tensor subclass metadata)",
    "comfy": "Comfy NVFP4 (<module>.comfy_quant markers)",
    "mimo": "MiMo mixed MXFP4/FP8 source (model_type mimo_v2)",
    "dense": "not quantized",
}
"""Every layout floatxq reads, and who writes it."""

SCALE_CONVENTIONS: dict[str, str] = {
    "floatxq_fp8": (
        "inverse weight_scale_inv: multiply to quantize, divide to decode (floatxq / GPT-QModel)"
    ),
    "deepseek_fp8": "weight_scale_inv multiplies to decode (DeepSeek / fine-grained FP8)",
    "direct_fp8": "direct weight_scale: multiply to decode",
    "modelopt_nvfp4": (
        "ModelOpt NVFP4: E4M3 weight_scale and FP32 weight_scale_2 both multiply to decode"
    ),
    "compressed_tensors_nvfp4": (
        "compressed-tensors NVFP4: E4M3 weight_scale multiplies, weight_global_scale divides"
    ),
    "torchao_nvfp4": "torchao NVFP4: E4M3 scale and FP32 per_tensor_scale multiply to decode",
    "comfy_nvfp4": (
        "Comfy NVFP4: high nibble first, swizzled E4M3 weight_scale, weight_scale_2 multiplies"
    ),
    "mx_e8m0": "MX: E8M0 block scales (2**(byte-127)) multiply to decode",
    "mimo_mixed": "MiMo: FP8 weight_scale_inv multiplies; MXFP4 experts with E8M0 scales",
    "gptq": (
        "GPTQ INT (2/4/8-bit): scales multiply (code - zero) of each row's group g_idx; "
        "checkpoint_format gptq (v1) stores zero - 1 per field, gptq_v2 the zero"
    ),
    "compressed_tensors_int": (
        "compressed-tensors pack-quantized INT: weight_scale multiplies (q - weight_zero_point), "
        "codes stored as q + 2**(bits-1), contiguous groups"
    ),
    "none": "no quantized tensors",
    "undeclared": (
        "quantized tensors but no quantization_config: the direction is unknown (not guessed)"
    ),
}
"""Scale conventions by key: what a checkpoint's scale tensors mean."""


class LayoutDecision(NamedTuple):
    """What a checkpoint directory holds, decided from its metadata."""

    layout: str
    """A key of :data:`READ_LAYOUTS`."""
    convention: str
    """A key of :data:`SCALE_CONVENTIONS`."""
    family: str | None
    """The native family (:func:`floatxq.native_floatx_source_format`), or None."""
    scheme: str | None
    """The declared scheme: a compressed-tensors format, a ModelOpt ``quant_algo``, an FP8 dtype."""
    evidence: str
    """Which file and field decided it."""


def _lower(value: Any) -> str:
    return str.lower(str.strip(str(value))) if value is not None else ""


def _has_suffix(names: Sequence[str], *suffixes: str) -> bool:
    return any(name.endswith(suffixes) for name in names)


def _ct_formats(qconfig: Mapping[str, Any]) -> set[str]:
    formats = {_lower(qconfig.get("format"))} - {""}
    groups = qconfig.get("config_groups") or {}
    if isinstance(groups, Mapping):
        for group in groups.values():
            if isinstance(group, Mapping) and group.get("format"):
                formats.add(_lower(group["format"]))
    return formats


def _is_gptqmodel_payload(payload: Mapping[str, Any]) -> bool:
    scheme = payload.get("activation_scheme")
    marked = isinstance(scheme, str) and _lower(scheme).startswith(GPTQMODEL_MARKER_PREFIX)
    return marked or any(
        key in payload for key in ("weight_scale_semantics", "checkpoint_format", "method")
    )


def _decide_fp8(
    root: Path, qconfig: Mapping[str, Any], quantize_config: Mapping[str, Any] | None
) -> LayoutDecision:
    from floatxq.interop.sources import is_mimo_mixed_source

    config_file = root / CONFIG_FILE
    if _lower(qconfig.get("store_dtype")) == "mxfp4" or is_mimo_mixed_source(
        read_json(config_file, what="load")
    ):
        return LayoutDecision(
            "mimo", "mimo_mixed", "mimo_mixed", "fp8+mxfp4", f"{config_file}: store_dtype mxfp4"
        )
    inverse = _is_gptqmodel_payload(qconfig)
    scheme = qconfig.get("activation_scheme")
    hf_keys = [k for k in ("fmt", "activation_scheme", "scale_fmt") if k in qconfig]
    if inverse and isinstance(scheme, str) and _lower(scheme) in ("dynamic", "static"):
        raise CheckpointError(
            f"load: {config_file} quantization_config is contradictory: GPT-QModel/floatxq keys "
            f"(inverse weight_scale_inv) together with transformers' activation_scheme "
            f"{scheme!r} (multiplying weight_scale_inv); refusing to guess the scale direction"
        )
    if quantize_config is not None and payload_method(quantize_config) == "fp8":
        if not _is_gptqmodel_payload(quantize_config):
            raise CheckpointError(
                f"load: {root / QUANTIZE_CONFIG_FILE} declares method 'fp8' without GPT-QModel's "
                f"keys (weight_scale_semantics / checkpoint_format); its scale direction is unknown"
            )
        if not inverse:
            raise CheckpointError(
                f"load: {root / QUANTIZE_CONFIG_FILE} declares GPT-QModel's inverse scales but "
                f"{config_file} declares transformers' fine-grained FP8 ({', '.join(hf_keys)}), "
                f"where weight_scale_inv multiplies; the two files contradict each other"
            )
    fmt = qconfig.get("format", qconfig.get("fmt"))
    if inverse:
        evidence = (
            f"{root / QUANTIZE_CONFIG_FILE if quantize_config is not None else config_file}: "
            f"quant_method fp8 with GPT-QModel's keys"
        )
        return LayoutDecision("gptqmodel", "floatxq_fp8", "fp8", _lower(fmt) or None, evidence)
    return LayoutDecision(
        "hf",
        "deepseek_fp8",
        "fp8",
        _lower(fmt) or "e4m3",
        f"{config_file}: quant_method fp8 without GPT-QModel's keys (transformers' format)",
    )


# ----------------------------------------------------------------------------------------------
# GPTQ (quant_method gptq)
# ----------------------------------------------------------------------------------------------

GPTQ_READER_KEYS: frozenset[str] = frozenset(
    {
        "tokenizer",
        "dataset",
        "true_sequential",
        "use_exllama",
        "exllama_config",
        "disable_exllama",
        "use_cuda_fp16",
        "model_seqlen",
        "block_name_to_quantize",
        "module_name_preceding_first_block",
        "batch_size",
        "pad_token_id",
        "max_input_length",
        "cache_block_outputs",
        "modules_in_block_to_quantize",
        "backend",
        "model_name_or_path",
        "model_file_base_name",
        "is_marlin_format",
    }
)
"""Keys transformers' / optimum's ``GPTQConfig`` (and AutoGPTQ) write next to GPT-QModel's
payload in ``config.json``. They describe the calibration run or pick a kernel, not what the
tensors mean, so they are dropped before the payload is read (``is_marlin_format: true``, a
repacked layout, is refused first). Which modules are quantized is read from the tensors."""

GPTQ_LOAD_FIELDS: tuple[str, ...] = (
    "bits",
    "group_size",
    "sym",
    "desc_act",
    "lm_head",
    "format",
    "dynamic",
)
"""The GPTQConfig fields that decide how a GPTQ checkpoint's tensors are read: ``config.json``
and ``quantize_config.json`` must agree on each (solver settings and ``meta`` may differ)."""


def _gptq_payload(file: Path, payload: Mapping[str, Any]) -> GPTQConfig:
    marlin = payload.get("is_marlin_format")
    if marlin not in (None, False):
        raise CheckpointError(
            f"load: {file} declares is_marlin_format={marlin!r}: Marlin-repacked GPTQ words, "
            f"which floatxq does not read (only GPT-QModel's gptq / gptq_v2 layouts)"
        )
    data = {k: v for k, v in payload.items() if k not in GPTQ_READER_KEYS}
    try:
        config = gptq_config_from_payload(data)
    except (TypeError, ValueError) as exc:
        raise CheckpointError(f"load: {file} GPTQ quantization payload: {exc}") from None
    return config


def read_gptq_config(
    root: str | os.PathLike[str],
    qconfig: Mapping[str, Any],
    quantize_config: Mapping[str, Any] | None,
) -> GPTQConfig:
    """The GPTQConfig of a ``quant_method: gptq`` directory, from both of its payloads.

    ``config.json``'s ``quantization_config`` is read without :data:`GPTQ_READER_KEYS`;
    ``quantize_config.json`` (GPT-QModel's, which it reads first), when present, must be a GPTQ
    payload agreeing with it on :data:`GPTQ_LOAD_FIELDS`, and is the one returned.

    Raises:
      CheckpointError: a payload floatxq does not read (an unknown key or value, a packing format
        other than ``gptq`` / ``gptq_v2``, Marlin-repacked words), or the two files disagree
        (naming both files and the fields).

    Numerics: none; metadata only.
    """
    base = Path(root)
    from_config = _gptq_payload(base / CONFIG_FILE, qconfig)
    if quantize_config is None:
        return from_config
    quantize_file = base / QUANTIZE_CONFIG_FILE
    method = payload_method(quantize_config)
    if method not in (None, "gptq"):
        raise CheckpointError(
            f"load: {quantize_file} declares method {method!r} but {base / CONFIG_FILE} declares "
            f"'gptq'; the two files contradict each other"
        )
    from_quantize = _gptq_payload(quantize_file, quantize_config)
    differ = [
        f"{field}: {getattr(from_quantize, field)!r} vs {getattr(from_config, field)!r}"
        for field in GPTQ_LOAD_FIELDS
        if getattr(from_quantize, field) != getattr(from_config, field)
    ]
    if differ:
        raise CheckpointError(
            f"load: {quantize_file} and {base / CONFIG_FILE} describe different GPTQ checkpoints "
            f"({'; '.join(differ)}); refusing to pick one"
        )
    return from_quantize


def _decide_gptq(
    root: Path, qconfig: Mapping[str, Any], quantize_config: Mapping[str, Any] | None
) -> LayoutDecision:
    config = read_gptq_config(root, qconfig, quantize_config)
    which = QUANTIZE_CONFIG_FILE if quantize_config is not None else CONFIG_FILE
    evidence = f"{root / which}: quant_method gptq, checkpoint_format {config.format}"
    return LayoutDecision("gptq", "gptq", None, config.format, evidence)


def _decide_compressed_tensors(root: Path, qconfig: Mapping[str, Any]) -> LayoutDecision:
    formats = _ct_formats(qconfig)
    where = f"{root / CONFIG_FILE}: compressed-tensors format {sorted(formats)}"
    supported = {
        "float-quantized": "direct_fp8",
        "naive-quantized": "direct_fp8",
        "nvfp4-pack-quantized": "compressed_tensors_nvfp4",
        "mxfp4-pack-quantized": "mx_e8m0",
        "mxfp8-quantized": "mx_e8m0",
        "pack-quantized": "compressed_tensors_int",
    }
    formats.discard("mixed-precision")
    if not formats:
        raise CheckpointError(
            f"load: {root / CONFIG_FILE} compressed-tensors payload has no format"
        )
    unknown = sorted(f for f in formats if f not in supported)
    if unknown:
        raise CheckpointError(
            f"load: {root / CONFIG_FILE} uses compressed-tensors format(s) {unknown}; floatxq "
            f"reads {sorted(supported)}"
        )
    conventions = sorted({supported[f] for f in formats})
    convention = conventions[0] if len(conventions) == 1 else "+".join(conventions)
    family = None
    if any("mx" in f for f in formats):
        family = "mxfp4" if "mxfp4-pack-quantized" in formats else "mxfp8"
    elif "nvfp4-pack-quantized" in formats:
        family = "nvfp4"
    elif formats & {"float-quantized", "naive-quantized"}:
        family = "fp8"
    return LayoutDecision(
        "compressed-tensors", convention, family, ",".join(sorted(formats)), where
    )


def decide_layout(
    root: str | os.PathLike[str],
    config: Mapping[str, Any],
    infos: Sequence[TensorInfo],
    *,
    header_metadata: Mapping[str, str] | None = None,
) -> LayoutDecision:
    """Decide a checkpoint's layout and scale convention from its metadata.

    Args:
      root: the model directory (sidecar files are looked up there; named in errors).
      config: its ``config.json`` payload.
      infos: its tensors' headers (names and dtypes; no data).
      header_metadata: the merged safetensors ``__metadata__`` maps.

    Raises:
      CheckpointError: a quant_method floatxq does not read, contradictory metadata (e.g.
        ``quantize_config.json`` and ``config.json`` disagree on the scale direction), or
        quantized tensors with no declaration at all.

    Numerics: none; metadata only.
    """
    from floatxq.interop.sources import native_floatx_source_format, read_hf_quant_config

    base = Path(root)
    names = [info.name for info in infos]
    qconfig = config.get("quantization_config")
    if qconfig is not None and not isinstance(qconfig, Mapping):
        raise CheckpointError(f"load: {base / CONFIG_FILE} 'quantization_config' is not an object")
    quantize_file = base / QUANTIZE_CONFIG_FILE
    quantize_config = read_json(quantize_file, what="load") if quantize_file.is_file() else None
    sidecar = read_hf_quant_config(base, strict=True)
    family = native_floatx_source_format(config, model_local_path=base)
    if qconfig is not None:
        method = payload_method(qconfig) or ""
        if method == "fp8":
            return _decide_fp8(base, qconfig, quantize_config)
        if method == "compressed-tensors":
            return _decide_compressed_tensors(base, qconfig)
        if method == "modelopt":
            algo = qconfig.get("quant_algo") or (sidecar or {}).get("quant_algo")
            return _modelopt_decision(base, algo, names, family, f"{base / CONFIG_FILE}")
        if method == "quark":
            convention = "mx_e8m0" if family in ("mxfp4", "mxfp8", "mixed-mx") else "direct_fp8"
            return LayoutDecision(
                "quark", convention, family, family, f"{base / CONFIG_FILE}: quant_method quark"
            )
        if method == "torchao":
            return _torchao_decision(base, header_metadata, family, declared=True)
        if method == "gptq":
            return _decide_gptq(base, qconfig, quantize_config)
        raise CheckpointError(
            f"load: {base / CONFIG_FILE} quantization_config quant_method {method!r} is not read "
            f"by floatxq; accepted: 'fp8', 'gptq', 'compressed-tensors', 'modelopt', 'quark', "
            f"'torchao'"
        )
    if sidecar is not None:
        algo = sidecar.get("quant_algo")
        return _modelopt_decision(base, algo, names, family, f"{base / SIDECAR_FILE}")
    if header_metadata and _torchao_metadata(header_metadata) is not None:
        return _torchao_decision(base, header_metadata, family, declared=False)
    if _has_suffix(names, ".comfy_quant"):
        return LayoutDecision(
            "comfy", "comfy_nvfp4", "nvfp4", "nvfp4", "<module>.comfy_quant marker tensors"
        )
    fp8_names = {"F8_E4M3", "F8_E5M2", "F8_E4M3FNUZ", "F8_E5M2FNUZ"}
    quantized = _has_suffix(
        names, ".weight_scale_inv", ".weight_scale", ".weight_packed", ".qweight"
    ) or any(info.dtype in fp8_names for info in infos)
    if quantized:
        raise CheckpointError(
            f"load: {base / CONFIG_FILE} has no 'quantization_config' (and there is no "
            f"{SIDECAR_FILE}) but the tensors are quantized (FP8 codes or scale tensors): the "
            f"checkpoint's quantization is undeclared, and floatxq does not guess a scale "
            f"direction"
        )
    return LayoutDecision("dense", "none", None, None, f"{base / CONFIG_FILE}: no quantization")


def _modelopt_decision(
    root: Path, algo: Any, names: Sequence[str], family: str | None, where: str
) -> LayoutDecision:
    scheme = str(algo) if algo is not None else None
    upper = (scheme or "").upper()
    if "FP4" in upper or _has_suffix(names, ".weight_scale_2"):
        convention = "modelopt_nvfp4"
    else:
        convention = "direct_fp8"
    if upper == "MIXED_PRECISION":
        convention = "modelopt_nvfp4+direct_fp8"
    return LayoutDecision("modelopt", convention, family, scheme, f"{where}: ModelOpt {scheme}")


def _torchao_metadata(metadata: Mapping[str, str]) -> dict[str, Any] | None:
    """torchao's per-tensor JSON metadata (by tensor-subclass name), or None."""
    raw = metadata.get("tensor_names")
    if raw is None:
        return None
    try:
        names = json.loads(raw)
    except json.JSONDecodeError:
        raise CheckpointError(
            "load: safetensors metadata 'tensor_names' (torchao) is not valid JSON"
        ) from None
    found: dict[str, Any] = {}
    for name in names if isinstance(names, list) else []:
        entry = metadata.get(name)
        if entry is None:
            raise CheckpointError(
                f"load: torchao safetensors metadata names tensor {name!r} but has no entry for it"
            )
        try:
            found[name] = json.loads(entry)
        except json.JSONDecodeError:
            raise CheckpointError(
                f"load: torchao safetensors metadata for {name!r} is not valid JSON"
            ) from None
    return found


def _torchao_decision(
    root: Path, metadata: Mapping[str, str] | None, family: str | None, *, declared: bool
) -> LayoutDecision:
    entries = _torchao_metadata(metadata or {}) or {}
    types = sorted({str(e.get("_type")) for e in entries.values() if isinstance(e, Mapping)})
    if set(types) - {"NVFP4Tensor", "Tensor"}:
        raise CheckpointError(
            f"load: {root} holds torchao tensors of type(s) {types}; floatxq reads torchao's "
            f"NVFP4Tensor"
        )
    where = f"{root / CONFIG_FILE}: quant_method torchao" if declared else "safetensors metadata"
    return LayoutDecision("torchao", "torchao_nvfp4", family or "nvfp4", "NVFP4Tensor", where)


# ----------------------------------------------------------------------------------------------
# Reading modules
# ----------------------------------------------------------------------------------------------

_ACTIVATION_SUFFIXES = (
    ".input_scale",
    ".input_global_scale",
    ".k_scale",
    ".v_scale",
    ".input_zero_point",
    ".output_scale",
)


class ModuleSource(NamedTuple):
    """One module's tensors, as stored (names without the module prefix)."""

    name: str
    tensors: dict[str, torch.Tensor]


def refuse_activation_scales(decision: LayoutDecision, names: Sequence[str], root: Path) -> None:
    """Refuse checkpoints whose tensors carry activation-quantization scales.

    floatxq runs weight-only sources (its FP8 routes quantize activations dynamically, per call);
    a static activation scale in the files is part of the producer's numerics that floatxq would
    drop, so such checkpoints are refused rather than run differently.

    Raises:
      CheckpointError: naming the first such tensor and the layout.
    """
    found = [n for n in names if n.endswith(_ACTIVATION_SUFFIXES)]
    if not found:
        return
    raise CheckpointError(
        f"load: {root} ({decision.layout}) carries activation-quantization scales, e.g. "
        f"{found[0]!r} ({len(found)} tensors); floatxq loads weight-only checkpoints (W8A16 FP8, "
        f"W4A16 NVFP4, dynamic FP8 activations) and does not run static activation quantization"
    )


def _fp8_module(
    source: ModuleSource,
    scale_key: str,
    *,
    multiply: bool,
    block: tuple[int, int] | None,
    dtype: torch.dtype,
    file: str,
) -> nn.Module:
    """:func:`floatxq.fp8_module_from_source`, its errors naming the tensor and file."""
    from floatxq.interop.sources import fp8_module_from_source

    try:
        return fp8_module_from_source(
            source.tensors["weight"],
            source.tensors[scale_key],
            source.tensors.get("bias"),
            direction="multiply" if multiply else "inverse",
            block=block,
            dtype=dtype,
        )
    except (TypeError, ValueError) as exc:
        raise CheckpointError(f"load: {source.name}.{scale_key} in {file}: {exc}") from None


def _fp4_module(
    source: ModuleSource, layout: str, original: nn.Module, dtype: torch.dtype, file: str, **kw: Any
) -> nn.Module:
    """:func:`floatxq.fp4_module_from_source`, its errors naming the module and file."""
    from floatxq.interop.sources import fp4_module_from_source

    shape = (original.out_features, original.in_features)
    try:
        return fp4_module_from_source(
            source.tensors,
            layout=layout,
            shape=shape,
            dtype=dtype,
            **kw,  # type: ignore[arg-type]
        )
    except (TypeError, ValueError) as exc:
        raise CheckpointError(f"load: {source.name} in {file}: {exc}") from None


def _require(source: ModuleSource, keys: Sequence[str], where: str) -> None:
    missing = [k for k in keys if k not in source.tensors]
    if missing:
        raise CheckpointError(
            f"load: {where} lacks {', '.join(f'{source.name}.{k}' for k in missing)} "
            f"(has {sorted(source.tensors)})"
        )


def _extra(source: ModuleSource, allowed: Sequence[str], where: str) -> None:
    extra = sorted(set(source.tensors) - set(allowed))
    if extra:
        raise CheckpointError(
            f"load: {where} has tensors floatxq does not know for this layout: "
            f"{', '.join(f'{source.name}.{k}' for k in extra)}"
        )


def _block_of(value: Any, where: str) -> tuple[int, int] | None:
    if value is None:
        return None
    if (
        not isinstance(value, (list, tuple))
        or len(value) != 2
        or not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in value)
    ):
        raise CheckpointError(
            f"load: {where} weight_block_size must be two positive ints, got {value!r}"
        )
    return (int(value[0]), int(value[1]))


def _ct_block(qconfig: Mapping[str, Any], where: str) -> tuple[int, int] | None:
    blocks = set()
    for group in (qconfig.get("config_groups") or {}).values():
        weights = group.get("weights") if isinstance(group, Mapping) else None
        if isinstance(weights, Mapping) and _lower(weights.get("strategy")) == "block":
            block = _block_of(weights.get("block_structure"), where)
            if block is not None:
                blocks.add(block)
    if len(blocks) > 1:
        raise CheckpointError(
            f"load: {where} declares several block structures {sorted(blocks)}; floatxq reads "
            f"compressed-tensors FP8 checkpoints with one block size"
        )
    return next(iter(blocks)) if blocks else None


def read_module(
    decision: LayoutDecision,
    source: ModuleSource,
    original: nn.Module,
    *,
    qconfig: Mapping[str, Any] | None,
    dtype: torch.dtype,
    file: str,
    metadata: Mapping[str, Any] | None = None,
    declared: tuple[str, tuple[int, int] | None] | None = None,
    gptq: GPTQConfig | None = None,
) -> nn.Module | None:
    """The module that runs one quantized module's tensors under ``decision``'s convention.

    Returns None when the module's tensors are plain (nothing quantized about it). ``declared``
    is the ``(weight_scale_method, weight_block_size)`` the payload gives this module
    (``gptqmodel`` layout): the scale tensor must have exactly that layout's shape, so a grid that
    happens to tile the weight another way (a ``1x256`` grid read as ``256x3`` blocks) is refused.
    ``gptq`` is the module's resolved GPTQConfig (``gptq`` layout; None when the config excludes
    the module): its bits, group size, ``sym`` and ``desc_act`` must be what the tensors hold.

    Raises:
      CheckpointError: missing, unknown or mis-shaped tensors (named with their file).
    """
    where = f"{source.name} in {file}"
    keys = set(source.tensors)
    weight = source.tensors.get("weight")
    qconfig = qconfig or {}
    layout = decision.layout
    if layout == "gptq":
        return _gptq_module(source, original, gptq, decision.scheme or "gptq", file)
    packed_words = source.tensors.get("weight_packed")
    if layout == "compressed-tensors" and packed_words is not None:
        if packed_words.dtype == torch.int32:
            return _ct_int_module(source, original, qconfig, file)
    fp8 = weight is not None and weight.dtype in _FP8_DTYPES
    if layout in ("gptqmodel", "hf"):
        if "weight_scale_inv" not in keys and not fp8:
            return None
        _require(source, ("weight", "weight_scale_inv"), where)
        _extra(source, ("weight", "weight_scale_inv", "bias", "activation_scale"), where)
        if "activation_scale" in keys:
            raise CheckpointError(
                f"load: {where} carries a static activation_scale; floatxq loads weight-only and "
                f"dynamic-activation FP8 checkpoints"
            )
        if layout == "gptqmodel":
            block = _declared_block(source, declared, file)
        else:
            block = _block_of(qconfig.get("weight_block_size"), f"{file} quantization_config")
        return _fp8_module(
            source,
            "weight_scale_inv",
            multiply=layout == "hf",
            block=block,
            dtype=dtype,
            file=file,
        )
    if layout == "mimo":
        raise CheckpointError(
            f"load: {where}: MiMo mixed sources need the mimo_v2 architecture, which transformers "
            f"does not have; decode their tensors with floatxq.interop.sources.decode_mimo_weight"
        )
    if layout == "comfy":
        if "comfy_quant" not in keys:
            return None
        marker = _comfy_marker(source.tensors["comfy_quant"], where)
        if marker != "nvfp4":
            raise CheckpointError(
                f"load: {where} Comfy format {marker!r} is not read by floatxq; accepted: 'nvfp4'"
            )
        _extra(source, ("weight", "weight_scale", "weight_scale_2", "comfy_quant", "bias"), where)
        tensors = {k: v for k, v in source.tensors.items() if k != "comfy_quant"}
        return _fp4_module(ModuleSource(source.name, tensors), "comfy", original, dtype, file)
    if layout == "torchao":
        return _torchao_module(source, original, metadata or {}, dtype, file)
    # compressed-tensors, modelopt, quark: weight(_packed) + weight_scale (+ a global scale)
    if "weight_packed" in keys:
        if "weight_global_scale" in keys:
            allowed = ("weight_packed", "weight_scale", "weight_global_scale", "bias")
            _extra(source, allowed, where)
            return _fp4_module(source, "compressed-tensors", original, dtype, file)
        _require(source, ("weight_packed", "weight_scale"), where)
        _extra(source, ("weight_packed", "weight_scale", "weight_shape", "bias"), where)
        return _mx_dense(source, source.tensors["weight_packed"], "e2m1", dtype, where)
    if "weight_scale" not in keys:
        if fp8:
            raise CheckpointError(
                f"load: {where} holds FP8 codes but no {source.name}.weight_scale"
            )
        return None
    _require(source, ("weight", "weight_scale"), where)
    scale = source.tensors["weight_scale"]
    if "weight_scale_2" in keys:
        _extra(source, ("weight", "weight_scale", "weight_scale_2", "bias"), where)
        return _fp4_module(source, "modelopt", original, dtype, file)
    _extra(source, ("weight", "weight_scale", "weight_zero_point", "bias"), where)
    _check_zero_point(source, where)
    if scale.dtype in (torch.uint8, getattr(torch, "float8_e8m0fnu", None)):
        assert weight is not None
        element = "e2m1" if weight.dtype == torch.uint8 else str(weight.dtype).split(".")[-1]
        return _mx_dense(source, weight, element, dtype, where)
    if not fp8:
        raise CheckpointError(
            f"load: {where} weight has dtype {weight.dtype if weight is not None else None}; a "
            f"{layout} FP8 weight must be an FP8 dtype"
        )
    block = None
    if layout == "compressed-tensors":
        block = _ct_block(qconfig, f"{file} quantization_config")
    elif scale.ndim == 2 and scale.numel() > 1 and scale.shape[1] != 1:
        block = _inferred_block(weight, scale)
    return _fp8_module(source, "weight_scale", multiply=True, block=block, dtype=dtype, file=file)


# ----------------------------------------------------------------------------------------------
# GPTQ modules
# ----------------------------------------------------------------------------------------------

_GPTQ_READ_BITS = (2, 4, 8)
"""Widths whose fields tile an int32 word (GPTQ's 3-bit packing crosses words; not read)."""


def _repeated_field_words(value: int, bits: int, shape: tuple[int, int]) -> torch.Tensor:
    """int32 words holding ``value`` in every ``bits``-wide field (e.g. ``0x88888888``)."""
    word = 0
    for field in range(32 // bits):
        word |= value << (bits * field)
    signed = word - (1 << 32) if word >= 1 << 31 else word
    return torch.full(shape, signed, dtype=torch.int32)


def _linear_shape(original: nn.Module, where: str) -> tuple[int, int]:
    """``(out, in)`` of the module the checkpoint's tensors replace."""
    from floatxq.nn.fp8_linear import _source_matrix

    try:
        matrix, _ = _source_matrix(original, where="load")
    except (TypeError, ValueError) as exc:
        raise CheckpointError(f"load: {where}: {exc}") from None
    return int(matrix.shape[0]), int(matrix.shape[1])


def _require_dtype(source: ModuleSource, key: str, accepted: str, ok: bool, where: str) -> None:
    if not ok:
        tensor = source.tensors[key]
        raise CheckpointError(
            f"load: {source.name}.{key} in {where} has dtype {tensor.dtype}; {accepted}"
        )


def _require_tensor_shape(
    source: ModuleSource, key: str, shape: tuple[int, ...], why: str, where: str
) -> None:
    got = tuple(source.tensors[key].shape)
    if got != shape:
        raise CheckpointError(
            f"load: {source.name}.{key} in {where} has shape {got}; {why} gives {shape}"
        )


def _check_gptq_scales_and_bias(source: ModuleSource, scale_key: str, where: str) -> None:
    scales = source.tensors[scale_key]
    _require_dtype(source, scale_key, "GPTQ scales are floating", scales.is_floating_point(), where)
    if scales.numel() and not bool(torch.isfinite(scales).all()):
        raise CheckpointError(
            f"load: {source.name}.{scale_key} in {where} holds NaN or infinite scales"
        )
    bias = source.tensors.get("bias")
    if bias is not None:
        _require_dtype(source, "bias", "a bias is floating", bias.is_floating_point(), where)
        if bias.numel() and not bool(torch.isfinite(bias).all()):
            raise CheckpointError(f"load: {source.name}.bias in {where} holds NaN or infinity")


def _build_gptq(
    source: ModuleSource,
    words: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
    *,
    bits: int,
    group_size: int,
    fmt: str,
    where: str,
) -> nn.Module:
    """:meth:`GPTQLinear.from_packed` on checked tensors, its errors naming the module."""
    from floatxq.gptq.int4 import GPTQPacked
    from floatxq.nn.gptq_linear import GPTQLinear

    try:
        return GPTQLinear.from_packed(
            GPTQPacked(*words),
            bits=bits,
            group_size=group_size,
            format=fmt,
            bias=source.tensors.get("bias"),
        )
    except (TypeError, ValueError) as exc:
        raise CheckpointError(f"load: {source.name} in {where}: {exc}") from None


def _contiguous_groups(rows: int, group_size: int) -> torch.Tensor:
    index = torch.arange(rows, dtype=torch.int32)
    return index * 0 if group_size == -1 else torch.div(index, group_size, rounding_mode="floor")


def _gptq_module(
    source: ModuleSource,
    original: nn.Module,
    config: GPTQConfig | None,
    fmt: str,
    file: str,
) -> nn.Module | None:
    """A ``quant_method: gptq`` module (``qweight``, ``qzeros``, ``scales``, ``g_idx``) as a
    GPTQLinear holding the file's tensors, after checking them against the config."""
    gptq_keys = ("qweight", "qzeros", "scales", "g_idx")
    where = f"{source.name} in {file}"
    if not set(source.tensors) & set(gptq_keys):
        return None
    if config is None:
        raise CheckpointError(
            f"load: {where} holds GPTQ tensors, but the quantization config excludes the module "
            f"(a '-:' dynamic rule or lm_head=false)"
        )
    _require(source, gptq_keys, where)
    _extra(source, (*gptq_keys, "bias"), where)
    bits, group_size = config.bits, config.group_size
    if bits not in _GPTQ_READ_BITS:
        raise CheckpointError(
            f"load: {where}: the config declares bits={bits}; floatxq reads GPTQ words of "
            f"{', '.join(map(str, _GPTQ_READ_BITS))} bits (whole fields per int32)"
        )
    qweight, qzeros, scales, g_idx = (source.tensors[k] for k in gptq_keys)
    for key in ("qweight", "qzeros", "g_idx"):
        ok = source.tensors[key].dtype == torch.int32
        _require_dtype(source, key, "GPTQ checkpoints store it as int32", ok, file)
    _check_gptq_scales_and_bias(source, "scales", file)
    out, rows = _linear_shape(original, where)
    per = 32 // bits
    groups = 1 if group_size == -1 else -(-rows // group_size)
    if tuple(qweight.shape) != (rows // per, out) or rows % per:
        implied = ""
        if qweight.ndim == 2 and qweight.shape[0] and (32 * qweight.shape[0]) % rows == 0:
            implied = f" (its {qweight.shape[0]} rows are {32 * qweight.shape[0] // rows}-bit)"
        raise CheckpointError(
            f"load: {source.name}.qweight in {file} has shape {tuple(qweight.shape)}{implied}, "
            f"but the config's bits={bits} for the model's ({out}, {rows}) weight gives "
            f"({rows // per}, {out})"
        )
    why = f"the config's group_size={group_size} for in={rows} ({groups} groups)"
    _require_tensor_shape(source, "scales", (groups, out), why, file)
    _require_tensor_shape(source, "qzeros", (groups, out // per), why, file)
    _require_tensor_shape(source, "g_idx", (rows,), "the model's in_features", file)
    if rows and (int(g_idx.min()) < 0 or int(g_idx.max()) >= groups):
        raise CheckpointError(
            f"load: {source.name}.g_idx in {file} holds group indices "
            f"{int(g_idx.min())}..{int(g_idx.max())}, outside [0, {groups - 1}] ({why})"
        )
    if not config.desc_act and not torch.equal(g_idx, _contiguous_groups(rows, group_size)):
        raise CheckpointError(
            f"load: {source.name}.g_idx in {file} reorders the groups, but the config declares "
            f"desc_act=false (readers then ignore g_idx and read contiguous groups)"
        )
    if config.sym:
        mid = 1 << (bits - 1)
        stored = mid - 1 if fmt == "gptq" else mid
        if not torch.equal(qzeros, _repeated_field_words(stored, bits, tuple(qzeros.shape))):
            raise CheckpointError(
                f"load: {source.name}.qzeros in {file} holds zero points other than {mid}, but "
                f"the config declares sym=true (readers then ignore qzeros)"
            )
    return _build_gptq(
        source,
        (qweight, qzeros, scales, g_idx),
        bits=bits,
        group_size=group_size,
        fmt=fmt,
        where=file,
    )


class _CtIntScheme(NamedTuple):
    bits: int
    group_size: int
    """-1 for the channel strategy."""
    symmetric: bool


def _ct_int_schemes(qconfig: Mapping[str, Any], where: str) -> list[_CtIntScheme]:
    """The ``pack-quantized`` INT weight schemes a compressed-tensors payload declares."""
    schemes: list[_CtIntScheme] = []
    top = _lower(qconfig.get("format"))
    groups = qconfig.get("config_groups") or {}
    for key, group in groups.items() if isinstance(groups, Mapping) else ():
        if not isinstance(group, Mapping) or _lower(group.get("format") or top) != "pack-quantized":
            continue
        weights = group.get("weights")
        if not isinstance(weights, Mapping):
            raise CheckpointError(f"load: {where} config group {key!r} has no weights")
        if group.get("input_activations") or group.get("output_activations"):
            raise CheckpointError(
                f"load: {where} config group {key!r} quantizes activations; floatxq loads "
                f"weight-only (W*A16) pack-quantized checkpoints"
            )
        strategy = _lower(weights.get("strategy"))
        size = weights.get("group_size")
        bits = weights.get("num_bits")
        if (
            _lower(weights.get("type")) != "int"
            or weights.get("dynamic") not in (None, False)
            or strategy not in ("group", "channel")
            or weights.get("actorder") not in (None, "weight", "static")
            or not isinstance(bits, int)
            or isinstance(bits, bool)
            or (strategy == "group" and not (isinstance(size, int) and size > 0))
        ):
            raise CheckpointError(
                f"load: {where} config group {key!r} weights {dict(weights)!r}: floatxq reads "
                f"static int weights with the group or channel strategy and no activation "
                f"ordering g_idx (actorder 'group')"
            )
        symmetric = weights.get("symmetric", True)
        gs = size if strategy == "group" else -1
        schemes.append(_CtIntScheme(bits, gs, bool(symmetric)))
    return schemes


def _ct_int_module(
    source: ModuleSource, original: nn.Module, qconfig: Mapping[str, Any], file: str
) -> nn.Module:
    """A compressed-tensors ``pack-quantized`` module as a GPTQLinear (``gptq_v2`` zero words:
    compressed-tensors stores the zero point itself, as ``zp + 2**(bits-1)``)."""
    where = f"{source.name} in {file}"
    keys = ("weight_packed", "weight_scale", "weight_shape")
    _require(source, keys, where)
    _extra(source, (*keys, "weight_zero_point", "bias"), where)
    packed, scale, shape = (source.tensors[k] for k in keys)
    shape_ok = not shape.is_floating_point() and shape.dtype != torch.bool and shape.numel() == 2
    _require_dtype(source, "weight_shape", "it holds two integers (out, in)", shape_ok, file)
    out, rows = _linear_shape(original, where)
    if [int(v) for v in shape.flatten()] != [out, rows]:
        raise CheckpointError(
            f"load: {source.name}.weight_shape in {file} is {shape.flatten().tolist()}, but the "
            f"model's weight is ({out}, {rows})"
        )
    _check_gptq_scales_and_bias(source, "weight_scale", file)
    words = packed.shape[1] if packed.ndim == 2 else -1
    bits = 32 * words // rows if rows and words > 0 and (32 * words) % rows == 0 else -1
    if packed.ndim != 2 or packed.shape[0] != out or bits not in _GPTQ_READ_BITS:
        raise CheckpointError(
            f"load: {source.name}.weight_packed in {file} has shape {tuple(packed.shape)}: not "
            f"{' / '.join(f'{b}-bit ({out}, {rows * b // 32})' for b in _GPTQ_READ_BITS)} "
            f"packing of the ({out}, {rows}) weight"
        )
    groups = scale.shape[1] if scale.ndim == 2 and scale.shape[0] == out else -1
    if groups < 1 or rows % groups:
        raise CheckpointError(
            f"load: {source.name}.weight_scale in {file} has shape {tuple(scale.shape)}; "
            f"expected ({out}, groups) with groups dividing in={rows}"
        )
    symmetric = "weight_zero_point" not in source.tensors
    declared = _ct_int_schemes(qconfig, f"{file} quantization_config")
    fits = [
        d
        for d in declared
        if d.bits == bits
        and d.symmetric == symmetric
        and (
            (d.group_size == -1 and groups == 1)
            or (d.group_size > 0 and d.group_size * groups == rows)
        )
    ]
    if not fits:
        held = f"{bits}-bit, {groups} group(s) of {rows // groups}, " + (
            "symmetric" if symmetric else "asymmetric (weight_zero_point)"
        )
        raise CheckpointError(
            f"load: {where} holds {held} pack-quantized weights, which no pack-quantized config "
            f"group declares ({[tuple(d) for d in declared]})"
        )
    group_size = fits[0].group_size
    per = 32 // bits
    if symmetric:
        qzeros = _repeated_field_words(1 << (bits - 1), bits, (groups, out // per))
    else:
        zero = source.tensors["weight_zero_point"]
        ok = zero.dtype == torch.int32
        _require_dtype(source, "weight_zero_point", "packed zero points are int32", ok, file)
        why = f"{bits}-bit packing of ({out}, {groups}) zero points"
        _require_tensor_shape(source, "weight_zero_point", (out // per, groups), why, file)
        qzeros = zero.T.contiguous()
    g_idx = _contiguous_groups(rows, group_size)
    return _build_gptq(
        source,
        (packed.T.contiguous(), qzeros, scale.T.contiguous(), g_idx),
        bits=bits,
        group_size=group_size,
        fmt="gptq_v2",
        where=file,
    )


_FP8_DTYPES = frozenset(
    getattr(torch, n)
    for n in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz")
    if hasattr(torch, n)
)


def _declared_block(
    source: ModuleSource, declared: tuple[str, tuple[int, int] | None] | None, file: str
) -> tuple[int, int] | None:
    """Check a GPT-QModel scale against the layout the payload declares for its module."""
    weight, scale = source.tensors["weight"], source.tensors["weight_scale_inv"]
    if declared is None:
        raise CheckpointError(
            f"load: {source.name} in {file} holds FP8 tensors, but the quantization config "
            f"excludes the module (a '-:' dynamic rule or lm_head=false)"
        )
    method, block = declared
    rows, cols = weight.shape if weight.ndim == 2 else (-1, -1)
    expected: tuple[tuple[int, ...], ...]
    if method == "tensor":
        expected = ((), (1,))
    elif method == "row":
        expected = ((rows,),)
    else:
        assert block is not None
        expected = ((rows // block[0], cols // block[1]),)
        if rows % block[0] or cols % block[1]:
            expected = ()
    if tuple(scale.shape) not in expected:
        want = " or ".join(str(e) for e in expected) or "a block size that divides the weight"
        raise CheckpointError(
            f"load: {source.name}.weight_scale_inv in {file} has shape {tuple(scale.shape)}, "
            f"but the config declares {method} scales"
            + (f" with block {list(block)}" if block else "")
            + f" for a {tuple(weight.shape)} weight: expected {want}"
        )
    return block


def _inferred_block(weight: torch.Tensor | None, scale: torch.Tensor) -> tuple[int, int] | None:
    from floatxq.fp8 import infer_scale_layout

    if weight is None or weight.ndim != 2:
        return None
    try:
        layout, block = infer_scale_layout(tuple(weight.shape), tuple(scale.shape))
    except ValueError:
        return None
    return block if layout == "block" else None


def _check_zero_point(source: ModuleSource, where: str) -> None:
    zero = source.tensors.get("weight_zero_point")
    if zero is not None and zero.numel() and bool((zero != 0).any()):
        raise CheckpointError(
            f"load: {where} has a nonzero {source.name}.weight_zero_point; floatxq reads "
            f"symmetric floating-point weights"
        )


def _mx_dense(
    source: ModuleSource, codes: torch.Tensor, element: str, dtype: torch.dtype, where: str
) -> nn.Module:
    """An MX module decoded to a dense ``nn.Linear`` (no MX runtime module exists)."""
    from floatxq.interop.sources import decode_mx_weight

    try:
        dense = decode_mx_weight(
            codes, source.tensors["weight_scale"], element=element, dtype=dtype, name=where
        )
    except (TypeError, ValueError) as exc:
        raise CheckpointError(f"load: {where}: {exc}") from None
    bias = source.tensors.get("bias")
    out_features, in_features = dense.shape
    layer = nn.Linear(in_features, out_features, bias=bias is not None, device="meta")
    layer.weight = nn.Parameter(dense, requires_grad=False)
    if bias is not None:
        layer.bias = nn.Parameter(bias.to(dtype), requires_grad=False)
    return layer


def _comfy_marker(marker: torch.Tensor, where: str) -> str:
    try:
        payload = json.loads(bytes(marker.to(torch.uint8).flatten().tolist()).decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RuntimeError):
        raise CheckpointError(f"load: {where}.comfy_quant is not UTF-8 JSON") from None
    if not isinstance(payload, Mapping) or "format" not in payload:
        raise CheckpointError(f"load: {where}.comfy_quant has no 'format'")
    return _lower(payload["format"])


def _torchao_module(
    source: ModuleSource,
    original: nn.Module,
    metadata: Mapping[str, Any],
    dtype: torch.dtype,
    file: str,
) -> nn.Module | None:
    entry = metadata.get(f"{source.name}.weight")
    if not isinstance(entry, Mapping) or entry.get("_type") != "NVFP4Tensor":
        return None
    data = entry.get("_data", {})
    data = data if isinstance(data, Mapping) else {}
    where = f"{source.name} in {file}"
    if data.get("act_quant_kwargs") or "_weight_act_per_tensor_scale" in source.tensors:
        raise CheckpointError(
            f"load: {where} torchao NVFP4 weight quantizes activations too "
            f"(act_quant_kwargs / act_per_tensor_scale); floatxq loads weight-only NVFP4"
        )
    allowed = ("_weight_qdata", "_weight_scale", "_weight_per_tensor_scale", "bias")
    _extra(source, allowed, where)
    swizzled = bool(data.get("is_swizzled_scales", False))
    return _fp4_module(source, "torchao", original, dtype, file, is_swizzled_scales=swizzled)


def module_sources(
    state: Mapping[str, torch.Tensor], module_names: Sequence[str], *, layout: str
) -> tuple[list[ModuleSource], dict[str, torch.Tensor]]:
    """Split a state dict into per-module sources (for ``module_names``) and the rest.

    torchao names a subclass weight's parts ``<module>._weight_qdata`` (and so on), so they fall
    under their module like any other tensor.
    """
    wanted = set(module_names)
    grouped: dict[str, dict[str, torch.Tensor]] = {}
    rest: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        module, _, leaf = name.rpartition(".")
        if module in wanted:
            grouped.setdefault(module, {})[leaf] = tensor
        else:
            rest[name] = tensor
    sources = [ModuleSource(name, tensors) for name, tensors in grouped.items()]
    return sources, rest


__all__ = [
    "GPTQ_LOAD_FIELDS",
    "GPTQ_READER_KEYS",
    "READ_LAYOUTS",
    "SCALE_CONVENTIONS",
    "LayoutDecision",
    "ModuleSource",
    "decide_layout",
    "module_sources",
    "read_gptq_config",
    "read_module",
    "refuse_activation_scales",
]
