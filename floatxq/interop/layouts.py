"""Which checkpoint layout a directory holds, decided from its metadata.

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
:class:`~floatxq.interop.checkpoint.CheckpointError` naming the file and field. How each layout's
modules are then read is :mod:`floatxq.interop.readers`; ``docs/interop.md`` has the table.
"""

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple

from floatxq.config import FP8Config, GPTQConfig
from floatxq.interop.checkpoint import CONFIG_FILE, QUANTIZE_CONFIG_FILE, CheckpointError
from floatxq.interop.payload import (
    fp8_config_from_payload,
    gptq_config_from_payload,
    payload_method,
)
from floatxq.interop.shards import TensorInfo, bounded_json, read_json

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


_SIZE_LIMIT = 2**31 - 1
"""The largest size (bits, group size, block edge) a payload may give: int32's range."""


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _short(value: Any, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


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
        read_fp8_config(root, qconfig, quantize_config)  # refused here, for load and inspect alike
        evidence = (
            f"{root / QUANTIZE_CONFIG_FILE if quantize_config is not None else config_file}: "
            f"quant_method fp8 with GPT-QModel's keys"
        )
        return LayoutDecision("gptqmodel", "floatxq_fp8", "fp8", _lower(fmt) or None, evidence)
    _check_block_pair(qconfig.get("weight_block_size"), f"{config_file} weight_block_size")
    return LayoutDecision(
        "hf",
        "deepseek_fp8",
        "fp8",
        _lower(fmt) or "e4m3",
        f"{config_file}: quant_method fp8 without GPT-QModel's keys (transformers' format)",
    )


def _check_block_pair(value: Any, where: str) -> None:
    """``None`` or two positive ints (a block size); else a CheckpointError naming ``where``."""
    if value is None:
        return
    if not (
        isinstance(value, list | tuple)
        and len(value) == 2
        and all(_is_int(v) and 0 < v <= _SIZE_LIMIT for v in value)
    ):
        raise CheckpointError(
            f"load: {where} must be two positive ints (at most {_SIZE_LIMIT}), got {_short(value)}"
        )


def read_fp8_config(
    root: str | os.PathLike[str],
    qconfig: Mapping[str, Any],
    quantize_config: Mapping[str, Any] | None,
) -> FP8Config:
    """The FP8Config of a floatxq / GPT-QModel FP8 directory, from both of its payloads.

    GPT-QModel reads ``quantize_config.json`` first; floatxq reads both files (``config.json``
    without floatxq's refusal marker) and refuses them when they describe different configs, so
    neither file is silently ignored.

    Raises:
      CheckpointError: a payload floatxq does not read, or the two files disagree (naming both).

    Numerics: none; metadata only.
    """

    def parse(file: Path, payload: Mapping[str, Any]) -> FP8Config:
        try:
            return fp8_config_from_payload(payload)
        except (TypeError, ValueError, OverflowError) as exc:
            raise CheckpointError(f"load: {file} quantization payload: {exc}") from None

    base = Path(root)
    config_file = base / CONFIG_FILE
    payload = dict(qconfig)
    scheme = payload.get("activation_scheme")
    if isinstance(scheme, str) and _lower(scheme).startswith(GPTQMODEL_MARKER_PREFIX):
        del payload["activation_scheme"]
    from_config = parse(config_file, payload)
    if quantize_config is None:
        return from_config
    quantize_file = base / QUANTIZE_CONFIG_FILE
    from_quantize = parse(quantize_file, quantize_config)
    if from_quantize != from_config:
        raise CheckpointError(
            f"load: {quantize_file} and {config_file} describe different FP8 configs "
            f"({from_quantize!r} vs {from_config!r}); refusing to pick one"
        )
    return from_quantize


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
    "activation",
)
"""The GPTQConfig fields that decide how a GPTQ checkpoint's tensors are read and run (the W4A
``activation`` policy with its global scales included): ``config.json`` and
``quantize_config.json`` must agree on each (solver settings and ``meta`` may differ)."""


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
    except (TypeError, ValueError, OverflowError) as exc:
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
    payload agreeing with it on :data:`GPTQ_LOAD_FIELDS`, and is the one returned. A W4A
    ``activation`` policy in one file only is refused too: GPT-QModel and floatxq both write one
    payload to both files (``config.quantization_config = quantize_config.to_dict()``).

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
    mine, theirs = from_quantize.activation, from_config.activation
    if (mine is None) != (theirs is None):
        has, lacks = (quantize_file, base / CONFIG_FILE) if theirs is None else (
            base / CONFIG_FILE, quantize_file)  # fmt: skip
        raise CheckpointError(
            f"load: {has} declares the W4A activation policy (field 'activation') "
            f"{_policy_summary(mine or theirs)}, but {lacks} declares none (plain W4A16); both "
            f"writers put one payload in both files, so one was edited: refusing to pick one"
        )
    differ = [
        f"{field}: {getattr(from_quantize, field)!r} vs {getattr(from_config, field)!r}"
        for field in GPTQ_LOAD_FIELDS
        if field != "activation" and getattr(from_quantize, field) != getattr(from_config, field)
    ]
    if mine is not None and theirs is not None and mine != theirs:
        differ += _policy_differences(mine.to_dict(), theirs.to_dict())
    if differ:
        raise CheckpointError(
            f"load: {quantize_file} and {base / CONFIG_FILE} describe different GPTQ checkpoints "
            f"({'; '.join(differ)}); refusing to pick one"
        )
    return from_quantize


def _policy_summary(policy: Any) -> str:
    stored = dict(policy.to_dict())
    scales = stored.pop("global_scales", None)
    return f"{stored}" + (f" with {len(scales)} global scales" if scales else "")


def _policy_differences(mine: Mapping[str, Any], theirs: Mapping[str, Any]) -> list[str]:
    """``activation.<field>: A vs B`` for each field of two stored policies that differs (the
    first few differing producers of ``global_scales``)."""
    out = []
    for key in sorted(set(mine) | set(theirs)):
        a, b = mine.get(key), theirs.get(key)
        if a == b:
            continue
        if key == "global_scales" and isinstance(a, Mapping) and isinstance(b, Mapping):
            names = sorted(n for n in set(a) | set(b) if a.get(n) != b.get(n))
            out += [
                f"activation.global_scales[{n!r}]: {a.get(n)!r} vs {b.get(n)!r}" for n in names[:3]
            ]
            out += [f"... {len(names) - 3} more global scales"] if len(names) > 3 else []
        else:
            out.append(f"activation.{key}: {a!r} vs {b!r}")
    return out


def _decide_gptq(
    root: Path, qconfig: Mapping[str, Any], quantize_config: Mapping[str, Any] | None
) -> LayoutDecision:
    config = read_gptq_config(root, qconfig, quantize_config)
    which = QUANTIZE_CONFIG_FILE if quantize_config is not None else CONFIG_FILE
    evidence = f"{root / which}: quant_method gptq, checkpoint_format {config.format}"
    return LayoutDecision("gptq", "gptq", None, config.format, evidence)


# ----------------------------------------------------------------------------------------------
# compressed-tensors
# ----------------------------------------------------------------------------------------------

_CT_STRINGS = ("format", "quant_method", "quantization_status", "version")
_CT_ARG_STRINGS = ("strategy", "type", "observer")


def _ct_refuse(where: str, field: str, value: Any, wanted: str) -> CheckpointError:
    return CheckpointError(f"load: {where}.{field} is {_short(value)}; {wanted}")


def _check_ct_args(where: str, args: Mapping[str, Any]) -> None:
    """One compressed-tensors ``QuantizationArgs`` dict: each field floatxq reads has its kind."""
    bits = args.get("num_bits")
    if bits is not None and not (_is_int(bits) and 1 <= bits <= 64):
        raise _ct_refuse(where, "num_bits", bits, "expected an int from 1 to 64")
    size = args.get("group_size")
    if size is not None and not (_is_int(size) and (0 < size <= _SIZE_LIMIT or size == -1)):
        raise _ct_refuse(where, "group_size", size, f"expected None, -1 or 1..{_SIZE_LIMIT}")
    _check_block_pair(args.get("block_structure"), f"{where}.block_structure")
    for key in _CT_ARG_STRINGS:
        if args.get(key) is not None and not isinstance(args[key], str):
            raise _ct_refuse(where, key, args[key], "expected a string or null")
    if args.get("symmetric") is not None and not isinstance(args["symmetric"], bool):
        raise _ct_refuse(where, "symmetric", args["symmetric"], "expected true, false or null")
    if not isinstance(args.get("dynamic"), bool | str | None):
        raise _ct_refuse(where, "dynamic", args["dynamic"], "expected a bool, a string or null")
    if not isinstance(args.get("actorder"), bool | str | None):
        raise _ct_refuse(where, "actorder", args["actorder"], "expected a bool, a string or null")


def _string_list(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(v, str) for v in value)


def check_compressed_tensors_payload(file: Path, qconfig: Mapping[str, Any]) -> None:
    """Check the kind of every compressed-tensors field floatxq reads, before any is used.

    ``config_groups`` maps names to a scheme (a dict) or a preset's target list, each scheme's
    ``weights`` / ``input_activations`` / ``output_activations`` is a dict or null with ints,
    strings and bools where compressed-tensors has them; ``ignore`` and ``targets`` are lists of
    strings; ``format`` and the other names are strings.

    Raises:
      CheckpointError: naming the file and the field (``config_groups['group_0'].weights
        .num_bits``), the value found and what is accepted.
    """
    where = f"{file} quantization_config"
    for key in _CT_STRINGS:
        if qconfig.get(key) is not None and not isinstance(qconfig[key], str):
            raise _ct_refuse(where, key, qconfig[key], "expected a string")
    if qconfig.get("ignore") is not None and not _string_list(qconfig["ignore"]):
        raise _ct_refuse(where, "ignore", qconfig["ignore"], "expected a list of module names")
    groups = qconfig.get("config_groups")
    if groups is not None and not isinstance(groups, Mapping):
        raise _ct_refuse(where, "config_groups", groups, "expected an object of named schemes")
    for name, group in (groups or {}).items():
        field = f"{where}.config_groups[{name!r}]"
        if _string_list(group):
            continue  # a preset scheme's name with its targets
        if not isinstance(group, Mapping):
            raise CheckpointError(
                f"load: {field} is {_short(group)}; expected a scheme object (or a preset's "
                f"target list)"
            )
        if group.get("format") is not None and not isinstance(group["format"], str):
            raise _ct_refuse(field, "format", group["format"], "expected a string")
        if group.get("targets") is not None and not _string_list(group["targets"]):
            raise _ct_refuse(field, "targets", group["targets"], "expected a list of strings")
        for part in ("weights", "input_activations", "output_activations"):
            args = group.get(part)
            if args is not None and not isinstance(args, Mapping):
                raise _ct_refuse(field, part, args, "expected a QuantizationArgs object or null")
            if args is not None:
                _check_ct_args(f"{field}.{part}", args)
    kv = qconfig.get("kv_cache_scheme")
    if kv is not None and not isinstance(kv, Mapping):
        raise _ct_refuse(where, "kv_cache_scheme", kv, "expected an object or null")
    if kv is not None:
        _check_ct_args(f"{where}.kv_cache_scheme", kv)


def _decide_compressed_tensors(root: Path, qconfig: Mapping[str, Any]) -> LayoutDecision:
    check_compressed_tensors_payload(root / CONFIG_FILE, qconfig)
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


def _torchao_metadata(
    metadata: Mapping[str, str], root: str | os.PathLike[str] | None = None
) -> dict[str, Any] | None:
    """torchao's per-tensor JSON metadata (tensor name → its dict), or None without any.

    Each value is bounded JSON (:func:`~floatxq.interop.shards.bounded_json`); ``tensor_names``
    must be a list of strings and each entry it names an object.
    """
    raw = metadata.get("tensor_names")
    if raw is None:
        return None
    where = f"load: {root}: safetensors __metadata__" if root is not None else "load: safetensors"
    names = bounded_json(
        raw,
        refusal=f"{where} 'tensor_names' (torchao) is not valid JSON",
        keys=f"{where} 'tensor_names'",
        same_value_ok=False,
    )
    if not _string_list(names):
        raise CheckpointError(
            f"{where} 'tensor_names' (torchao) must be a list of tensor names, got {_short(names)}"
        )
    found: dict[str, Any] = {}
    for name in names:
        entry = metadata.get(name)
        if entry is None:
            raise CheckpointError(
                f"{where} (torchao) names tensor {name!r} in 'tensor_names' but has no entry for it"
            )
        value = bounded_json(
            entry,
            refusal=f"{where} {name!r} (torchao) is not valid JSON",
            keys=f"{where} {name!r}",
            same_value_ok=False,
        )
        if not isinstance(value, Mapping):
            raise CheckpointError(
                f"{where} {name!r} (torchao) must be a JSON object, got {_short(value)}"
            )
        found[name] = value
    return found


TORCHAO_NVFP4_BLOCK = 16
"""The one block size of torchao's NVFP4Tensor (and of NVFP4): ``_data.block_size``."""


def _check_torchao_entry(where: str, name: str, entry: Mapping[str, Any]) -> None:
    """An NVFP4Tensor entry's ``_data`` fields floatxq reads, each of the kind torchao writes."""
    data = entry.get("_data", {})
    if not isinstance(data, Mapping):
        raise CheckpointError(
            f"{where} {name!r} (torchao) '_data' is {_short(data)}, not an object"
        )
    block = data.get("block_size", TORCHAO_NVFP4_BLOCK)
    if not _is_int(block) or block != TORCHAO_NVFP4_BLOCK:
        raise CheckpointError(
            f"{where} {name!r} (torchao) declares block_size {_short(block)}; NVFP4 (and floatxq's "
            f"reader of torchao's layout) uses blocks of {TORCHAO_NVFP4_BLOCK}"
        )
    swizzled = data.get("is_swizzled_scales", False)
    if not isinstance(swizzled, bool):
        raise CheckpointError(
            f"{where} {name!r} (torchao) is_swizzled_scales is {_short(swizzled)}; expected true "
            f"or false"
        )


def _torchao_decision(
    root: Path, metadata: Mapping[str, str] | None, family: str | None, *, declared: bool
) -> LayoutDecision:
    entries = _torchao_metadata(metadata or {}, root) or {}
    types = sorted({str(e.get("_type")) for e in entries.values()})
    if set(types) - {"NVFP4Tensor", "Tensor"}:
        raise CheckpointError(
            f"load: {root} holds torchao tensors of type(s) {types}; floatxq reads torchao's "
            f"NVFP4Tensor"
        )
    for name, entry in entries.items():
        if entry.get("_type") == "NVFP4Tensor":
            _check_torchao_entry(f"load: {root}: safetensors __metadata__", name, entry)
    where = f"{root / CONFIG_FILE}: quant_method torchao" if declared else "safetensors metadata"
    return LayoutDecision("torchao", "torchao_nvfp4", family or "nvfp4", "NVFP4Tensor", where)


__all__ = [
    "GPTQMODEL_MARKER_PREFIX",
    "GPTQ_LOAD_FIELDS",
    "GPTQ_READER_KEYS",
    "READ_LAYOUTS",
    "SCALE_CONVENTIONS",
    "SIDECAR_FILE",
    "LayoutDecision",
    "check_compressed_tensors_payload",
    "decide_layout",
    "read_fp8_config",
    "read_gptq_config",
]
