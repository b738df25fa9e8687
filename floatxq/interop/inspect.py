"""What a checkpoint is: its declared quantization, scale convention, layers and scales.

GPTQ modules (``quant_method: gptq`` and compressed-tensors ``pack-quantized``) are described by
their bits, group size, symmetry and ``desc_act`` (``"gptq int4 group 128 sym"``,
``"gptq int4 group 64 asym desc_act"``, ``"pack-quantized int8 channel sym"``), from the
declared config and the tensors' header shapes.

Only metadata and safetensors headers are read (no tensor data), so inspecting a large
checkpoint is instant. The scale direction is decided from the checkpoint's metadata, never
guessed from magnitudes (``docs/numerics.md`` lists the conventions).
"""

import os
from collections import Counter
from pathlib import Path
from typing import Any, NamedTuple

from floatxq.config import GPTQConfig
from floatxq.formats import ACTIVATION_SCALE_BITS
from floatxq.interop.activations import WEIGHT_ONLY, describe_declared_activations
from floatxq.interop.checkpoint import CONFIG_FILE, QUANTIZE_CONFIG_FILE
from floatxq.interop.fp8_static import fp8_static_scale_names
from floatxq.interop.layouts import decide_layout, read_gptq_config
from floatxq.interop.nvfp4_w4a4 import describe_nvfp4_w4a4, nvfp4_w4a4_scale_names
from floatxq.interop.payload import payload_format, payload_method
from floatxq.interop.readers import _ct_int_schemes
from floatxq.interop.shards import header_metadata, read_json, tensor_infos


class CheckpointReport(NamedTuple):
    """The result of :func:`inspect_checkpoint`."""

    path: str
    model_type: str | None
    method: str | None
    """Declared quantization method (``quantization_config``), None for a plain model."""
    format: str | None
    layout: str
    """Who wrote it: a key of :data:`~floatxq.interop.layouts.READ_LAYOUTS`."""
    convention: str
    """A key of :data:`SCALE_CONVENTIONS`."""
    family: str | None
    """The native family GPT-QModel's detector names (``fp8``, ``nvfp4``, ``mxfp4``, ...)."""
    evidence: str
    """The file and field the layout was decided from."""
    quantized_layers: tuple[str, ...]
    scale_layouts: dict[str, int]
    """Layout description → number of layers (``row``, ``block 128x128``, ``tensor``)."""
    dtypes: dict[str, int]
    """Tensor dtype → number of tensors."""
    total_bytes: int
    tensors: int
    quantize_config_file: bool
    activation: dict | None = None
    """A GPTQ checkpoint's W4A activation policy (its stored form), None without one."""
    activation_scales: int = 0
    """Modules with an NVFP4 activation global scale (``activation_global_scale_bits``)."""
    activations: str = WEIGHT_ONLY
    """The declared activation quantization, as load runs it: ``fp8 e4m3 dynamic per token``
    (``... per token group of 128``), a W4A policy's mode, or ``none (weight-only)``
    (:func:`floatxq.interop.activations.describe_declared_activations`)."""


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _layout_of(
    weight: tuple[int, ...], scale: tuple[int, ...], block: tuple[int, int] | None
) -> str:
    """How one FP8 module's scales are laid out, from header shapes."""
    from floatxq.fp8 import infer_scale_layout

    count = 1
    for dim in scale:
        count *= dim
    rows, cols = weight
    if count == 1:
        return "tensor"
    if scale in ((rows,), (rows, 1)):
        return "row"
    if block is not None and len(scale) == 2:
        if scale == (_ceil_div(rows, block[0]), _ceil_div(cols, block[1])):
            ragged = rows % block[0] or cols % block[1]
            return f"block {block[0]}x{block[1]}" + (" (ragged edge)" if ragged else "")
    try:
        layout, found = infer_scale_layout(weight, scale)
    except ValueError:
        return f"unrecognized {scale}"
    return f"block {found[0]}x{found[1]}" if layout == "block" and found else layout


def _declared_block(qconfig: dict[str, Any] | None) -> tuple[int, int] | None:
    if not qconfig:
        return None
    candidates = [qconfig.get("weight_block_size")]
    groups = qconfig.get("config_groups")
    for group in groups.values() if isinstance(groups, dict) else ():
        if isinstance(group, dict) and isinstance(group.get("weights"), dict):
            candidates.append(group["weights"].get("block_structure"))
    for value in candidates:  # decide_layout has refused a block that is not two positive ints
        if (
            isinstance(value, list)
            and len(value) == 2
            and all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in value)
        ):
            return (value[0], value[1])
    return None


_MODULE_MARKERS = (
    ".qweight",
    ".weight_scale_inv",
    ".weight_scale",
    ".weight_packed",
    ".comfy_quant",
    "._weight_qdata",
)


def _int_label(prefix: str, bits: int, group_size: int, sym: bool, desc_act: bool) -> str:
    groups = "channel" if group_size == -1 else f"group {group_size}"
    return f"{prefix} int{bits} {groups} {'sym' if sym else 'asym'}" + (
        " desc_act" if desc_act else ""
    )


def _gptq_label(name: str, config: GPTQConfig | None) -> str:
    """``gptq int4 group 128 sym`` for a ``quant_method: gptq`` module, from its config."""
    resolved = config.resolve(name) if config is not None else None
    if resolved is None:
        return "gptq (excluded by the config)"
    return _int_label("gptq", resolved.bits, resolved.group_size, resolved.sym, resolved.desc_act)


def _pack_quantized_label(
    name: str, by_name: dict[str, Any], qconfig: dict[str, Any] | None
) -> str:
    """``pack-quantized int4 group 64 asym``: the declared scheme its header shapes fit."""
    packed, scale = by_name[f"{name}.weight_packed"], by_name.get(f"{name}.weight_scale")
    symmetric = f"{name}.weight_zero_point" not in by_name
    words = packed.shape[-1] if packed.shape else 0
    groups = scale.shape[-1] if scale is not None and scale.shape else 0
    try:
        schemes = _ct_int_schemes(qconfig or {}, "inspect")
    except ValueError:
        schemes = []
    for d in schemes:
        rows = groups * d.group_size if d.group_size > 0 else words * 32 // d.bits
        if (
            d.symmetric == symmetric
            and (d.group_size > 0 or groups == 1)
            and rows * d.bits == 32 * words
        ):
            return _int_label("pack-quantized", d.bits, d.group_size, d.symmetric, False)
    return "pack-quantized int (no declared scheme fits)"


def _module_scales(
    by_name: dict[str, Any],
    block: tuple[int, int] | None,
    qconfig: dict[str, Any] | None = None,
    gptq: GPTQConfig | None = None,
) -> dict[str, str]:
    """Quantized module -> scale layout, from tensor names and header shapes only."""
    found: dict[str, str] = {}
    for name, info in sorted(by_name.items()):
        marker = next((m for m in _MODULE_MARKERS if name.endswith(m)), None)
        if marker is None:
            continue
        prefix = name[: -len(marker)]
        if prefix in found:
            continue
        weight = by_name.get(f"{prefix}.weight")
        scale = by_name.get(f"{prefix}.weight_scale")
        if marker == ".qweight":
            found[prefix] = _gptq_label(prefix, gptq)
        elif marker == ".weight_packed" and info.dtype == "I32":
            found[prefix] = _pack_quantized_label(prefix, by_name, qconfig)
        elif marker == "._weight_qdata":
            found[prefix] = "nvfp4 block 16 (torchao)"
        elif f"{prefix}.weight_scale_2" in by_name or f"{prefix}.weight_global_scale" in by_name:
            found[prefix] = "nvfp4 block 16"
        elif marker == ".comfy_quant":
            found[prefix] = "comfy"
        elif f"{prefix}.weight_packed" in by_name or (
            scale is not None and scale.dtype in ("U8", "F8_E8M0")
        ):
            found[prefix] = "mx block 32"
        elif weight is not None and len(weight.shape) == 2:
            found[prefix] = _layout_of(tuple(weight.shape), tuple(info.shape), block)
    return found


def inspect_checkpoint(path: str | os.PathLike[str]) -> CheckpointReport:
    """Describe a local model directory from its ``config.json`` and safetensors headers.

    The layout and scale convention are decided exactly as :func:`floatxq.load` decides them
    (:func:`floatxq.interop.layouts.decide_layout`), so a directory ``load`` refuses is
    refused here with the same error.

    Raises:
      CheckpointError (a ValueError): missing/corrupt files, or metadata that is undeclared,
        unknown or contradictory.

    Numerics: none; metadata only.
    """
    root = Path(path)
    payload = read_json(root / CONFIG_FILE, what="inspect")
    qconfig = payload.get("quantization_config")
    if qconfig is not None and not isinstance(qconfig, dict):
        qconfig = None
    infos = tensor_infos(root)
    decision = decide_layout(root, payload, infos, header_metadata=header_metadata(root))
    by_name = {info.name: info for info in infos}
    gptq = None
    if decision.layout == "gptq" and qconfig is not None:
        quantize_file = root / QUANTIZE_CONFIG_FILE
        quantize = read_json(quantize_file, what="inspect") if quantize_file.is_file() else None
        gptq = read_gptq_config(root, qconfig, quantize)
    scales = _module_scales(by_name, _declared_block(qconfig), qconfig, gptq)
    layers = list(scales)
    layouts: Counter[str] = Counter(scales.values())
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
    fp8 = [
        name
        for name, label in scales.items()
        if label.startswith(("tensor", "row", "block"))
        and str(getattr(by_name.get(f"{name}.weight"), "dtype", "")).startswith("F8_")
    ]
    policy = gptq.activation.mode if gptq is not None and gptq.activation is not None else None
    static = frozenset(
        n.rpartition(".")[0] for n in fp8_static_scale_names(decision.layout, by_name)
    )
    activations = describe_declared_activations(
        decision, qconfig, fp8, policy=policy, static=static
    )
    w4a4 = len(nvfp4_w4a4_scale_names(decision.layout, by_name))
    activations = describe_nvfp4_w4a4(activations, w4a4, WEIGHT_ONLY)
    method = (payload_method(qconfig) or None) if qconfig is not None else None
    fmt = payload_format(qconfig) if qconfig is not None else None
    return CheckpointReport(
        path=str(root),
        model_type=payload.get("model_type"),
        method=method,
        format=None if fmt is None else str(fmt),
        layout=decision.layout,
        convention=decision.convention,
        family=decision.family,
        evidence=decision.evidence,
        quantized_layers=tuple(layers),
        scale_layouts=dict(layouts),
        dtypes=dict(Counter(info.dtype for info in infos)),
        total_bytes=total,
        tensors=len(infos),
        quantize_config_file=(root / QUANTIZE_CONFIG_FILE).is_file(),
        activation=None if gptq is None or gptq.activation is None else gptq.activation.to_dict(),
        activation_scales=sum(n.endswith(f".{ACTIVATION_SCALE_BITS}") for n in by_name),
        activations=activations,
    )
