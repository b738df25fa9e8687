"""What a checkpoint is: its declared quantization, scale convention, layers and scales.

Only metadata and safetensors headers are read (no tensor data), so inspecting a large
checkpoint is instant. The scale direction is decided from the checkpoint's metadata, never
guessed from magnitudes (``docs/numerics.md`` lists the conventions).
"""

import os
from collections import Counter
from pathlib import Path
from typing import Any, NamedTuple

from floatxq.lifecycle.checkpoint import CONFIG_FILE, QUANTIZE_CONFIG_FILE, read_json, tensor_infos
from floatxq.lifecycle.payload import payload_format, payload_method

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
    "gptq": "GPTQ INT4: fp16 scales multiply (code - zero)",
    "none": "no quantized tensors",
    "undeclared": (
        "quantized tensors but no quantization_config: the direction is unknown (not guessed)"
    ),
}


class CheckpointReport(NamedTuple):
    """The result of :func:`inspect_checkpoint`."""

    path: str
    model_type: str | None
    method: str | None
    """Declared quantization method (``quantization_config``), None for a plain model."""
    format: str | None
    convention: str
    """A key of :data:`SCALE_CONVENTIONS`."""
    quantized_layers: tuple[str, ...]
    scale_layouts: dict[str, int]
    """Layout description → number of layers (``row``, ``block 128x128``, ``tensor``)."""
    dtypes: dict[str, int]
    """Tensor dtype → number of tensors."""
    total_bytes: int
    tensors: int
    quantize_config_file: bool


def _layout_of(weight_shape: tuple[int, ...], scale_shape: tuple[int, ...]) -> str:
    from floatxq.fp8 import infer_scale_layout

    try:
        layout, block = infer_scale_layout(weight_shape, scale_shape)
    except ValueError:
        return f"unrecognized {scale_shape}"
    return f"block {block[0]}x{block[1]}" if layout == "block" and block else layout


def _convention(qconfig: dict[str, Any] | None, names: set[str]) -> str:
    has = lambda suffix: any(n.endswith(suffix) for n in names)
    if qconfig is None:
        return "none" if not (has(".weight_scale_inv") or has(".qweight")) else "undeclared"
    method = payload_method(qconfig) or ""
    if method == "fp8":
        if "weight_scale_semantics" in qconfig or "checkpoint_format" in qconfig:
            return "floatxq_fp8"
        return "deepseek_fp8" if has(".weight_scale_inv") else "direct_fp8"
    if method in ("modelopt",) or has(".weight_scale_2"):
        return "modelopt_nvfp4"
    if method == "compressed-tensors" or has(".weight_global_scale"):
        return "compressed_tensors_nvfp4"
    if method == "gptq" or has(".qweight"):
        return "gptq"
    return f"unknown method {method!r}"


def inspect_checkpoint(path: str | os.PathLike[str]) -> CheckpointReport:
    """Describe a local model directory from its ``config.json`` and safetensors headers.

    Raises:
      CheckpointError (a ValueError): missing/corrupt ``config.json`` or shards.

    Numerics: none; metadata only.
    """
    root = Path(path)
    payload = read_json(root / CONFIG_FILE, what="inspect")
    qconfig = payload.get("quantization_config")
    if qconfig is not None and not isinstance(qconfig, dict):
        qconfig = None
    infos = tensor_infos(root)
    by_name = {info.name: info for info in infos}
    names = set(by_name)
    layers = []
    layouts: Counter[str] = Counter()
    for name, info in sorted(by_name.items()):
        for suffix in (".weight_scale_inv", ".weight_scale"):
            if name.endswith(suffix):
                prefix = name[: -len(suffix)]
                weight = by_name.get(f"{prefix}.weight")
                if weight is not None and len(weight.shape) == 2:
                    layers.append(prefix)
                    layouts[_layout_of(weight.shape, info.shape)] += 1
    sizes = {
        "BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E4M3FNUZ": 1,
        "F8_E5M2FNUZ": 1, "F8_E8M0": 1, "F16": 2, "BF16": 2, "I16": 2, "F32": 4, "I32": 4,
        "F64": 8, "I64": 8,
    }  # fmt: skip
    total = 0
    for info in infos:
        count = 1
        for dim in info.shape:
            count *= dim
        total += count * sizes.get(info.dtype, 4)
    method = (payload_method(qconfig) or None) if qconfig is not None else None
    fmt = payload_format(qconfig) if qconfig is not None else None
    return CheckpointReport(
        path=str(root),
        model_type=payload.get("model_type"),
        method=method,
        format=None if fmt is None else str(fmt),
        convention=_convention(qconfig, names),
        quantized_layers=tuple(layers),
        scale_layouts=dict(layouts),
        dtypes=dict(Counter(info.dtype for info in infos)),
        total_bytes=total,
        tensors=len(infos),
        quantize_config_file=(root / QUANTIZE_CONFIG_FILE).is_file(),
    )
