"""Checkpoint sources: which floating-point family a checkpoint declares, and dense decoders.

Detection reads metadata only (``config.json``'s ``quantization_config`` and ModelOpt's
``hf_quant_config.json`` sidecar), never tensors, with GPT-QModel's inputs and precedence so both
libraries label a checkpoint alike. The decoders turn one encoded tensor of a source floatxq does
not run natively (OCP MX, multiplying FP8 block grids, MiMo's mixed FP8/MXFP4) into a dense
matrix, for requantization. Every scale here *multiplies* to decode (``w = code * scale``),
unlike floatxq's own ``weight_scale_inv``.
"""

import math
import os
import re
import typing
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any, Literal

import torch

from floatxq._checks import require_tensor
from floatxq._typing import Float, Shaped, Tensor
from floatxq.formats import FP8_WEIGHT_DTYPES, MODEL_DTYPES
from floatxq.fp8 import decode_e8m0
from floatxq.interop.checkpoint import CheckpointError
from floatxq.interop.shards import read_json
from floatxq.nvfp4.e2m1 import e2m1_decode, unpack_e2m1

__all__ = [
    "MODELOPT_ACTIVATION_REFUSAL",
    "SOURCE_FAMILIES",
    "NVFP4SourceLayout",
    "ScaleDirection",
    "SourceFamily",
    "decode_fp8_block_grid",
    "decode_mimo_weight",
    "decode_mx_weight",
    "fp4_module_from_source",
    "fp8_module_from_source",
    "is_mimo_mixed_source",
    "modelopt_activation_quantization",
    "native_floatx_source_format",
    "quark_floatx_formats",
    "read_hf_quant_config",
]

SourceFamily = Literal["mimo_mixed", "mixed-mx", "mxfp4", "mxfp8", "nvfp8", "nvfp4", "fp8"]
"""A native floating-point family a checkpoint can declare."""

SOURCE_FAMILIES: tuple[SourceFamily, ...] = typing.get_args(SourceFamily)
"""Every :data:`SourceFamily`, in the order :func:`native_floatx_source_format` tests them."""

HF_QUANT_CONFIG_FILE = "hf_quant_config.json"
_MX_BLOCK = 32  # OCP MX: one E8M0 scale per 32 consecutive values along K
_MX_ELEMENTS = ("e2m1", "float8_e4m3fn", "float8_e5m2")
_MIMO_EXPERT = re.compile(r"model\.layers\.\d+\.mlp\.experts\.\d+\.(?:gate|up|down)_proj\.weight")
_MIMO_ENCODED_NAME = re.compile(r"(?!model\.mtp\.).*\.weight")  # MTP predictors stay as stored
_MIMO_FUSED_QKV = re.compile(r"model\.layers\.\d+\.self_attn\.qkv_proj\.weight")

MODELOPT_ACTIVATION_REFUSAL: str = (
    "floatxq runs ModelOpt checkpoints weight-only (W8A16 FP8, W4A16 NVFP4), as FP8 W8A8 with "
    "static per-tensor input_scale (quant_algo FP8) or as NVFP4 W4A4 (quant_algo NVFP4); this "
    "one quantizes activations otherwise. Detected metadata: {mode}."
)
"""Refusal for :func:`modelopt_activation_quantization`'s reason (``.format(mode=reason)``),
when the checkpoint is neither FP8 W8A8 (:func:`floatxq.interop.fp8_static.modelopt_fp8_static`)
nor NVFP4 W4A4 (:func:`floatxq.interop.nvfp4_w4a4.modelopt_nvfp4_w4a4`).

Such checkpoints are refused as ready-to-run models only; they stay valid requantization sources.
"""


# ----------------------------------------------------------------------------------------------
# Metadata
# ----------------------------------------------------------------------------------------------


def _field(obj: object, key: str) -> Any:
    """``obj[key]`` for a mapping, ``obj.key`` otherwise (a ``PretrainedConfig``)."""
    return obj.get(key) if isinstance(obj, Mapping) else getattr(obj, key, None)


def _as_mapping(value: object) -> Mapping[str, Any] | None:
    """A mapping as is; a transformers quantization-config object through ``to_dict()``."""
    if isinstance(value, Mapping):
        return value
    to_dict = getattr(value, "to_dict", None)
    payload = to_dict() if callable(to_dict) else None
    return payload if isinstance(payload, Mapping) else None


def _lower(value: object) -> str | None:
    return value.strip().lower() if isinstance(value, str) else None


def is_mimo_mixed_source(config: object) -> bool:
    """Whether ``config`` is a MiMo mixed source (FP8 weights, MXFP4-stored experts).

    True when ``model_type == "mimo_v2"``, ``quantization_config.quant_method == "fp8"`` and
    ``quantization_config.store_dtype == "mxfp4"`` (method and dtype in any case).

    Numerics: metadata only.

    Example:
      >>> qc = {"quant_method": "fp8", "store_dtype": "mxfp4"}
      >>> is_mimo_mixed_source({"model_type": "mimo_v2", "quantization_config": qc})
      True
    """
    qc = _as_mapping(_field(config, "quantization_config")) or {}
    return (
        _field(config, "model_type") == "mimo_v2"
        and _lower(qc.get("quant_method")) == "fp8"
        and _lower(qc.get("store_dtype")) == "mxfp4"
    )


def read_hf_quant_config(
    path: str | os.PathLike[str], *, strict: bool = False
) -> dict[str, Any] | None:
    """The JSON object in ModelOpt's ``hf_quant_config.json``; None when the file is absent.

    Args:
      path: a model directory (its sidecar is read) or the sidecar file itself.
      strict: raise on a sidecar that is unreadable, not JSON or not an object (else: None).

    Raises:
      CheckpointError: with ``strict``, naming the file and the fault (not a regular file, not
        UTF-8 JSON, nested over 64 deep, an integer of over 30 digits, a non-finite number, not
        an object). Numerics: none.
    """
    file = Path(path)
    file = file / HF_QUANT_CONFIG_FILE if file.is_dir() else file
    if not file.is_file():
        return None
    try:  # a regular file only, at most 100 MB, bounded JSON (no RecursionError, no huge ints)
        return read_json(file, what="hf_quant_config")
    except CheckpointError:
        if strict:
            raise
        return None


def _quark_label(spec: Mapping[str, Any]) -> str | None:
    """The family of one Quark weight ``QuantizationSpec`` dict, or None."""
    dtype = _lower(spec.get("dtype")) or _lower(spec.get("fmt")) or ""
    legacy_mx = dtype == "mx"  # old Quark MXSpec: element in mx_element_dtype, E8M0 implied
    if legacy_mx:
        dtype = _lower(spec.get("mx_element_dtype")) or ""
    scale = _lower(spec.get("scale_format")) or _lower(spec.get("scale_type"))
    block = spec.get("block_size")
    grouped = spec.get("group_size") == _MX_BLOCK or (
        isinstance(block, (list, tuple)) and list(block) == [1, _MX_BLOCK]
    )
    mx = legacy_mx or (scale in ("e8m0", "ue8m0") and grouped)
    if "fp4" in dtype:
        return "mxfp4" if mx else "nvfp4"
    if "fp8" in dtype or dtype in ("e4m3", "e5m2"):
        return "mxfp8" if mx else "fp8"
    return None


def quark_floatx_formats(payload: object) -> list[str]:
    """Families the weight specs of an AMD Quark ``quantization_config`` declare.

    Reads the ``weight`` spec (a dict, or a list such as Quark's NVFP4 ``[fp4 per_group 16,
    fp8_e4m3 per_tensor]``) of ``global_quant_config`` and of every ``layer_quant_config`` /
    ``layer_type_quant_config`` entry. A ``dtype`` (or ``fmt``) containing ``fp4`` is
    ``"mxfp4"`` when ``scale_format`` (or ``scale_type``) is ``e8m0``/``ue8m0`` with
    ``group_size`` 32 (or ``block_size`` ``[1, 32]``), else ``"nvfp4"``; one containing ``fp8``
    (or ``e4m3``/``e5m2``) is ``"mxfp8"`` by the same rule, else ``"fp8"``. Legacy
    ``dtype: "mx"`` specs name the element in ``mx_element_dtype``. INT/FP6 specs add nothing.

    Returns:
      Labels in first-seen order, no repeats; ``[]`` unless ``quant_method`` is ``"quark"``.

    Numerics: metadata only.

    Example:
      >>> w = {"dtype": "fp4", "qscheme": "per_group", "group_size": 32, "scale_format": "e8m0"}
      >>> quark_floatx_formats({"quant_method": "quark", "global_quant_config": {"weight": w}})
      ['mxfp4']
    """
    qc = _as_mapping(payload)
    if qc is None or _lower(qc.get("quant_method")) != "quark":
        return []
    entries: list[object] = [qc.get("global_quant_config")]
    for key in ("layer_quant_config", "layer_type_quant_config"):
        table = qc.get(key)
        entries.extend(table.values() if isinstance(table, Mapping) else ())
    labels: list[str] = []
    for entry in entries:
        weight = entry.get("weight") if isinstance(entry, Mapping) else None
        for spec in weight if isinstance(weight, list) else [weight]:
            label = _quark_label(spec) if isinstance(spec, Mapping) else None
            if label is not None and label not in labels:
                labels.append(label)
    return labels


def _declared_strings(payload: Mapping[str, Any]) -> list[str]:
    """Lower-cased format names one payload declares (mode keys, group formats, Quark specs)."""
    found = [
        _lower(payload.get(k)) for k in ("quant_algo", "quant_format", "format", "quant_method")
    ]
    groups = payload.get("config_groups")
    if isinstance(groups, Mapping):
        found += [_lower(g.get("format")) for g in groups.values() if isinstance(g, Mapping)]
    return [s for s in found if s] + quark_floatx_formats(payload)


def native_floatx_source_format(
    config: object, *, model_local_path: str | os.PathLike[str] | None = None
) -> SourceFamily | None:
    """Which native floating-point family a checkpoint declares, from its metadata only.

    A MiMo mixed source (:func:`is_mimo_mixed_source`) is ``"mimo_mixed"``. Otherwise the
    payloads are ``config.quantization_config`` (a mapping, or an object with ``to_dict()``)
    and, when ``model_local_path`` holds a readable ``hf_quant_config.json``, its
    ``"quantization"`` object (else the whole file). Each payload's ``quant_algo``,
    ``quant_format``, ``format``, ``quant_method`` and ``config_groups[*].format`` strings,
    lower-cased, plus :func:`quark_floatx_formats`, are tested by substring: ``mxfp4`` with
    ``mxfp8`` → ``"mixed-mx"``; ``mxfp4``; ``mxfp8``; ``nvfp8``; any ``fp4`` → ``"nvfp4"``; any
    ``fp8`` → ``"fp8"``; else None. compressed-tensors FP8 (``format: "float-quantized"``,
    weights ``type: "float"``) names no family and gives None, as GPT-QModel's detector does.

    Args:
      config: a ``config.json`` payload (mapping) or a transformers ``PretrainedConfig``.
      model_local_path: the checkpoint directory, to consult the ModelOpt sidecar.

    Returns:
      One of :data:`SOURCE_FAMILIES`, or None.

    Numerics: metadata only; no tensor is read.

    Example:
      >>> native_floatx_source_format({"quantization_config": {"quant_algo": "W4A16_NVFP4"}})
      'nvfp4'
      >>> native_floatx_source_format({"quantization_config": {"format": "float-quantized"}})
    """
    if is_mimo_mixed_source(config):
        return "mimo_mixed"
    qc = _as_mapping(_field(config, "quantization_config"))
    payloads = [qc] if qc is not None else []
    sidecar = None if model_local_path is None else read_hf_quant_config(model_local_path)
    if sidecar is not None:
        inner = sidecar.get("quantization")
        payloads.append(inner if isinstance(inner, Mapping) else sidecar)
    strings = [s for payload in payloads for s in _declared_strings(payload)]

    def has(part: str) -> bool:
        return any(part in s for s in strings)

    if has("mxfp4") and has("mxfp8"):
        return "mixed-mx"
    for part, family in (("mxfp4", "mxfp4"), ("mxfp8", "mxfp8"), ("nvfp8", "nvfp8")):
        if has(part):
            return family  # type: ignore[return-value]
    return "nvfp4" if has("fp4") else "fp8" if has("fp8") else None


def _below_16_bits(scheme: object) -> bool:
    bits = scheme.get("num_bits") if isinstance(scheme, Mapping) else None
    return isinstance(bits, int) and not isinstance(bits, bool) and bits < 16


def modelopt_activation_quantization(qconfig: object, tensor_names: Iterable[str]) -> str | None:
    """The first sign that a ModelOpt checkpoint quantizes activations, or None.

    ``qconfig`` is ModelOpt when its ``quant_method`` or ``producer.name`` is ``"modelopt"``
    (any case; the sidecar carries ``producer``); a nested ``"quantization"`` object (the
    sidecar's) is read too. Reasons, in order: ``"input_activations"`` (a
    ``config_groups[*].input_activations``, or top-level ``input_activations``, with
    ``num_bits < 16``); ``"kv_cache_scheme"`` (``kv_cache_scheme.num_bits < 16``, or a
    ``kv_cache_quant_algo`` that is not null/``"none"``); ``"checkpoint_scales"`` (a tensor name
    ending ``.input_scale``, ``.k_scale`` or ``.v_scale``).

    Returns:
      The reason (for :data:`MODELOPT_ACTIVATION_REFUSAL`); None if weight-only or not ModelOpt.

    Numerics: metadata and names only.

    Example:
      >>> modelopt_activation_quantization({"quant_method": "ModelOpt"}, ["x.input_scale"])
      'checkpoint_scales'
    """
    qc = _as_mapping(qconfig) or {}
    producer = qc.get("producer")
    if _lower(qc.get("quant_method")) != "modelopt" and (
        not isinstance(producer, Mapping) or _lower(producer.get("name")) != "modelopt"
    ):
        return None
    inner = qc.get("quantization")
    layers = [qc, inner] if isinstance(inner, Mapping) else [qc]
    for payload in layers:
        groups = payload.get("config_groups")
        groups = groups.values() if isinstance(groups, Mapping) else ()
        schemes = [g.get("input_activations") for g in groups if isinstance(g, Mapping)]
        if any(map(_below_16_bits, [*schemes, payload.get("input_activations")])):
            return "input_activations"
    for payload in layers:
        algo = payload.get("kv_cache_quant_algo")
        if _below_16_bits(payload.get("kv_cache_scheme")) or (
            algo is not None and _lower(algo) not in ("", "none")
        ):
            return "kv_cache_scheme"
    if any(n.endswith((".input_scale", ".k_scale", ".v_scale")) for n in tensor_names):
        return "checkpoint_scales"
    return None


# ----------------------------------------------------------------------------------------------
# Dense decoders
# ----------------------------------------------------------------------------------------------


def _check_out_dtype(dtype: torch.dtype, *, where: str) -> None:
    if dtype not in MODEL_DTYPES:
        raise ValueError(f"{where}: dtype must be float16, bfloat16 or float32, got {dtype}")


def _finished(values32: Tensor, dtype: torch.dtype, *, name: str, where: str) -> Tensor:
    """Round the FP32 result once to ``dtype``; refuse NaN/inf (NaN codes or overflow)."""
    out = values32.to(dtype)
    if out.numel() and not bool(torch.isfinite(out).all()):
        raise ValueError(
            f"{where}: {name} decodes to NaN or infinity in {dtype} (a NaN/inf code or a value "
            f"beyond the dtype's range); finite values are required"
        )
    return out


def _is_e8m0(x: Tensor) -> bool:
    return x.dtype in (torch.uint8, getattr(torch, "float8_e8m0fnu", None))


def _block_pair(block: object, *, where: str) -> tuple[int, int]:
    ok = isinstance(block, (tuple, list)) and len(block) == 2
    if not ok or not all(type(b) is int and b > 0 for b in block):  # type: ignore[union-attr]
        raise ValueError(f"{where}: block must be two positive ints [br, bc], got {block!r}")
    return block[0], block[1]  # type: ignore[index]


def decode_mx_weight(
    codes: Shaped[Tensor, "out packed"],
    scales: Shaped[Tensor, "out blocks"],
    *,
    element: str,
    dtype: torch.dtype = torch.bfloat16,
    name: str = "weight",
) -> Float[Tensor, "out in"]:
    """Decode an OCP MX weight: ``element(code) * 2**(byte - 127)``, blocks of 32 along ``in``.

    Args:
      codes: ``element="e2m1"``: uint8 (or ``float4_e2m1fn_x2``) ``[out, in/2]``, the even
        element in the low nibble; ``"float8_e4m3fn"``/``"float8_e5m2"``: that dtype, ``[out, in]``.
      scales: E8M0 bytes (uint8 or ``float8_e8m0fnu``) ``[out, in/32]``.
      element: ``"e2m1"``, ``"float8_e4m3fn"`` or ``"float8_e5m2"`` (any case).
      dtype: float16, bfloat16 or float32. name: the tensor's name, for errors.

    Raises:
      TypeError: codes or scales of another dtype or device.
      ValueError: an unknown element/dtype, shapes that disagree (``in`` a multiple of 32), an
        E8M0 byte 255 (NaN), a result that is NaN/inf in ``dtype``.

    Numerics: the FP32 product is exact (short significand times a power of two); one
    nearest-even rounding into ``dtype``.

    Example:
      >>> codes = torch.full((1, 16), 0x72, dtype=torch.uint8)  # codes 2, 7: 1.0, 6.0
      >>> w = decode_mx_weight(codes, torch.tensor([[126]], dtype=torch.uint8), element="e2m1")
      >>> w[0, :2].tolist()
      [0.5, 3.0]
    """
    where = "decode_mx_weight"
    kind = _lower(element)
    if kind not in _MX_ELEMENTS:
        raise ValueError(f"{where}: element must be one of {_MX_ELEMENTS}, got {element!r}")
    _check_out_dtype(dtype, where=where)
    require_tensor(codes, name="codes", where=where)
    require_tensor(scales, name="scales", where=where)
    wanted = (
        (torch.uint8, getattr(torch, "float4_e2m1fn_x2", None))
        if kind == "e2m1"
        else (getattr(torch, kind),)
    )
    if codes.dtype not in wanted or not _is_e8m0(scales) or scales.device != codes.device:
        raise TypeError(
            f"{where}: {name} needs {kind} codes ({wanted[0]}) and uint8/float8_e8m0fnu scales "
            f"on one device, got {codes.dtype} on {codes.device} and {scales.dtype} on "
            f"{scales.device}"
        )
    if codes.ndim != 2 or scales.ndim != 2:
        raise ValueError(
            f"{where}: codes and scales of {name} must be 2-D, got {tuple(codes.shape)} and "
            f"{tuple(scales.shape)}"
        )
    values = e2m1_decode(unpack_e2m1(codes)) if kind == "e2m1" else codes.to(torch.float32)
    rows, cols = values.shape
    if cols % _MX_BLOCK or tuple(scales.shape) != (rows, cols // _MX_BLOCK):
        raise ValueError(
            f"{where}: {name} decodes to ({rows}, {cols}), so its scales must be "
            f"({rows}, {cols}/{_MX_BLOCK}) with {cols} a multiple of {_MX_BLOCK}; got "
            f"{tuple(scales.shape)}"
        )
    if scales.numel() and bool((scales.view(torch.uint8) == 255).any()):
        raise ValueError(f"{where}: scales of {name} hold the E8M0 NaN byte 255")
    blocks = values.reshape(rows, cols // _MX_BLOCK, _MX_BLOCK) * decode_e8m0(scales)[..., None]
    return _finished(blocks.reshape(rows, cols), dtype, name=name, where=where)


def decode_fp8_block_grid(
    weight: Shaped[Tensor, "n k"],
    scale: Shaped[Tensor, "grid_rows grid_cols"],
    *,
    block: tuple[int, int] | list[int],
    dtype: torch.dtype = torch.bfloat16,
    name: str = "weight",
) -> Float[Tensor, "n k"]:
    """Decode FP8 codes with a multiplying block-scale grid (DeepSeek / transformers layout).

    ``w[i, j] = float32(code[i, j]) * scale[i // br, j // bc]`` over the grid
    ``[ceil(n / br), ceil(k / bc)]``; ragged edge blocks are expanded, then trimmed to
    ``[n, k]``. Transformers' fine-grained FP8 stores this grid as ``weight_scale_inv`` although
    it multiplies; floatxq's own inverse scales decode with
    :func:`~floatxq.fp8.dequantize_fp8_weight` instead.

    Args:
      weight: FP8 codes ``[n, k]`` (any FP8 value dtype; E8M0 is refused).
      scale: float32 (bfloat16/float16 widen exactly) or E8M0 bytes (uint8/``float8_e8m0fnu``,
        as ``scale_fmt: "ue8m0"`` writes them), decoded by :func:`~floatxq.fp8.decode_e8m0`.
      block: ``[br, bc]``, two positive ints.
      dtype: float16, bfloat16 or float32. name: the tensor's name, for errors.

    Raises:
      TypeError: a weight that is not FP8, a scale of another dtype or device.
      ValueError: a bad block/dtype, a grid not exactly ``[ceil(n/br), ceil(k/bc)]`` (both shapes
        named), a scale that is not finite and > 0, a NaN/inf result.

    Numerics: one FP32 multiply per element, then one nearest-even rounding into ``dtype``.

    Example:
      >>> w = torch.tensor([[1.0, 2.0, 4.0]]).to(torch.float8_e4m3fn)
      >>> decode_fp8_block_grid(w, torch.tensor([[0.5, 3.0]]), block=[1, 2]).tolist()
      [[0.5, 1.0, 12.0]]
    """
    where = "decode_fp8_block_grid"
    _check_out_dtype(dtype, where=where)
    br, bc = _block_pair(block, where=where)
    require_tensor(weight, name="weight", where=where)
    require_tensor(scale, name="scale", where=where)
    if weight.element_size() != 1 or not weight.is_floating_point() or _is_e8m0(weight):
        raise TypeError(f"{where}: {name} must hold FP8 codes, got {weight.dtype}")
    if not (_is_e8m0(scale) or scale.dtype in MODEL_DTYPES) or scale.device != weight.device:
        raise TypeError(
            f"{where}: the scale of {name} must be float32/bfloat16/float16 or E8M0 bytes on "
            f"{weight.device}, got {scale.dtype} on {scale.device}"
        )
    if weight.ndim != 2:
        raise ValueError(f"{where}: {name} must be 2-D [n, k], got {tuple(weight.shape)}")
    rows, cols = weight.shape
    grid = (math.ceil(rows / br), math.ceil(cols / bc))
    if tuple(scale.shape) != grid:
        raise ValueError(
            f"{where}: the scale grid of {name} {tuple(weight.shape)} with block {[br, bc]} must "
            f"have shape {grid}, got {tuple(scale.shape)}"
        )
    s32 = decode_e8m0(scale) if _is_e8m0(scale) else scale.to(torch.float32)
    if s32.numel() and not bool((torch.isfinite(s32) & (s32 > 0)).all()):
        raise ValueError(f"{where}: the scale of {name} must be finite and > 0 everywhere")
    expanded = s32.repeat_interleave(br, dim=0).repeat_interleave(bc, dim=1)[:rows, :cols]
    return _finished(weight.to(torch.float32) * expanded, dtype, name=name, where=where)


def decode_mimo_weight(
    config: object,
    name: str,
    weight: Shaped[Tensor, "*shape"],
    lookup: Callable[[str], Tensor | None],
    *,
    dtype: torch.dtype = torch.bfloat16,
) -> Float[Tensor, "out in"] | None:
    """Decode one tensor of a MiMo mixed source (:func:`is_mimo_mixed_source`), or None.

    Encoded: ``float8_e4m3fn`` ``<name>`` with a float32 ``<name>_scale_inv`` grid that
    multiplies (:func:`decode_fp8_block_grid`, block ``quantization_config.weight_block_size``),
    and uint8 MXFP4 experts ``model.layers.N.mlp.experts.E.{gate,up,down}_proj.weight`` with E8M0
    ``<name>_scale`` (:func:`decode_mx_weight`; ``mxfp4_block_size`` must be 32). Fused
    ``self_attn.qkv_proj`` weights (scale rows padded per tensor-parallel shard) are refused.

    Args:
      config: the ``config.json`` payload or ``PretrainedConfig``; ``name``, ``weight``: the
        stored tensor; ``lookup``: a companion tensor by name, or None; ``dtype``: the output's.

    Returns:
      The dense ``[out, in]`` weight; None when the config is not a MiMo mixed source or the
      tensor is not encoded (not a ``.weight``, under ``model.mtp.``, or a dense dtype).

    Raises:
      ValueError: another storage dtype, a missing scale (named), a fused ``qkv_proj``, bad
        ``weight_block_size`` / ``mxfp4_block_size``, anything the decoders refuse.
      TypeError: a ``_scale_inv`` grid that is not float32.

    Numerics: as :func:`decode_fp8_block_grid` and :func:`decode_mx_weight`.
    """
    where = "decode_mimo_weight"
    dense = weight.is_floating_point() and weight.element_size() > 1
    if not is_mimo_mixed_source(config) or dense or not _MIMO_ENCODED_NAME.fullmatch(name):
        return None
    qc = _as_mapping(_field(config, "quantization_config")) or {}
    if weight.dtype == torch.uint8 and _MIMO_EXPERT.fullmatch(name):
        if qc.get("mxfp4_block_size") != _MX_BLOCK:
            raise ValueError(
                f"{where}: MXFP4 experts need mxfp4_block_size {_MX_BLOCK}, got "
                f"{qc.get('mxfp4_block_size')!r}"
            )
        scales = _companion(lookup, name + "_scale", weight, where=where)
        return decode_mx_weight(weight, scales, element="e2m1", dtype=dtype, name=name)
    if weight.dtype != torch.float8_e4m3fn:
        raise ValueError(
            f"{where}: unsupported MiMo source storage {weight.dtype} for {name}; encoded "
            f"tensors are float8_e4m3fn, or uint8 MXFP4 expert projections"
        )
    if _MIMO_FUSED_QKV.fullmatch(name):
        raise ValueError(f"{where}: fused qkv_proj MiMo sources are not supported ({name})")
    block = _block_pair(qc.get("weight_block_size"), where=f"{where}: weight_block_size")
    scale = _companion(lookup, name + "_scale_inv", weight, where=where)
    if scale.dtype != torch.float32:
        raise TypeError(f"{where}: {name}_scale_inv must be float32, got {scale.dtype}")
    return decode_fp8_block_grid(weight, scale, block=block, dtype=dtype, name=name)


def _companion(
    lookup: Callable[[str], Tensor | None], key: str, weight: Tensor, *, where: str
) -> Tensor:
    """The scale tensor ``key`` on ``weight``'s device; ``ValueError`` naming it when absent."""
    found = lookup(key)
    if found is None:
        raise ValueError(f"{where}: missing scale tensor {key}")
    require_tensor(found, name=key, where=where)
    return found.to(weight.device)


# ----------------------------------------------------------------------------------------------
# Modules from source tensors
# ----------------------------------------------------------------------------------------------

ScaleDirection = Literal["inverse", "multiply"]
"""How a stored FP8 scale decodes: ``inverse`` divides (floatxq, GPT-QModel), ``multiply``
multiplies (transformers / DeepSeek ``weight_scale_inv``, compressed-tensors, ModelOpt, Quark)."""

NVFP4SourceLayout = Literal["modelopt", "compressed-tensors", "torchao", "comfy"]
"""Producers whose NVFP4 weight tensors :func:`fp4_module_from_source` reads."""


def _block_or_none(block: object) -> tuple[int, int] | None:
    return None if block is None else _block_pair(block, where="fp8_module_from_source: block")


def fp8_module_from_source(
    weight: Shaped[Tensor, "out in"],
    scale: Shaped[Tensor, "*scale"],
    bias: Float[Tensor, " out"] | None = None,
    *,
    direction: ScaleDirection,
    block: tuple[int, int] | list[int] | None = None,
    dtype: torch.dtype = torch.bfloat16,
) -> torch.nn.Module:
    """The module that runs a source's FP8 codes and scales, without repacking the codes.

    The layout follows the scale's shape: one element → tensor; ``[out]`` or ``[out, 1]`` (no
    ``block``) → row; a ``[out/br, in/bc]`` grid → block. A *ragged* grid ``[ceil(out/br),
    ceil(in/bc)]`` fits no ``TorchFP8Linear`` layout and is decoded instead
    (:func:`decode_fp8_block_grid`) into a dense ``nn.Linear`` of ``dtype``.

    Args:
      weight: FP8 codes ``[out, in]``.
      scale: FP32 / bf16 / fp16 scales, or E8M0 bytes (``ue8m0``: powers of two).
      bias: kept as the module stores biases (FP16 for TorchFP8Linear, ``dtype`` for Linear).
      direction: ``"inverse"`` or ``"multiply"``, from the checkpoint's metadata only.
      block: the declared block ``(br, bc)``, needed for ragged grids and for 2-D grids.
      dtype: the dense dtype of a decoded module.

    Raises:
      ValueError: a scale shape that fits no layout, non-positive or non-finite scales (zero
        included: no producer writes one), NaN/inf codes, a bad direction.
      TypeError: non-FP8 codes; an inverse scale that is not FP32, a multiplying one that is
        not FP32/bf16/fp16 or E8M0 bytes (an FP8- or integer-typed scale is a damaged file).

    Numerics: codes untouched; a multiplying scale ``s`` becomes the inverse ``fl(1/s)`` (exact
    for powers of two, else within 2**-24 relative); decoded: ``fl(code * s)`` in ``dtype``.

    Example:
      >>> w = torch.tensor([[2.0, -4.0]]).to(torch.float8_e4m3fn)
      >>> layer = fp8_module_from_source(w, torch.tensor(0.5), direction="multiply")
      >>> layer.weight_scale_method, layer.dequantize_weight().tolist()
      ('tensor', [[1.0, -2.0]])
    """
    from floatxq.fp8 import direct_to_inverse_scale
    from floatxq.nn.fp8_linear import TorchFP8Linear

    where = "fp8_module_from_source"
    if direction not in ("inverse", "multiply"):
        raise ValueError(f"{where}: direction must be 'inverse' or 'multiply', got {direction!r}")
    require_tensor(weight, name="weight", where=where)
    require_tensor(scale, name="scale", where=where)
    if weight.ndim != 2:
        raise ValueError(f"{where}: weight must be 2-D [out, in], got {tuple(weight.shape)}")
    pair = _block_or_none(block)
    rows, cols = weight.shape
    if weight.dtype not in FP8_WEIGHT_DTYPES:
        raise TypeError(f"{where}: weight must hold FP8 codes, got {weight.dtype}")
    allowed = (torch.float32,) if direction == "inverse" else MODEL_DTYPES
    if not (scale.dtype in allowed or (direction == "multiply" and _is_e8m0(scale))):
        raise TypeError(
            f"{where}: {direction} FP8 weight scales must be "
            f"{' / '.join(str(d).removeprefix('torch.') for d in allowed)}"
            f"{' or E8M0 bytes' if direction == 'multiply' else ''}, got {scale.dtype} (a "
            f"relabelled or mis-typed scale tensor)"
        )
    if weight.numel() and not bool(torch.isfinite(weight.to(torch.float16)).all()):
        bad = int((~torch.isfinite(weight.to(torch.float16))).sum())
        raise ValueError(
            f"{where}: weight holds {bad} NaN/inf FP8 codes; a quantizer never writes them, so "
            f"the file is damaged"
        )
    s32 = decode_e8m0(scale) if _is_e8m0(scale) else scale
    s32 = s32.to(torch.float32)
    if (
        direction == "multiply"
        and s32.numel()
        and not bool((torch.isfinite(s32) & (s32 > 0)).all())
    ):
        bad = s32[~(torch.isfinite(s32) & (s32 > 0))][:4].tolist()
        raise ValueError(
            f"{where}: multiplying scales must be finite and > 0, got {bad}; producers write "
            f"positive scales even for all-zero regions, so the file is damaged"
        )
    count = s32.numel()
    ragged = pair is not None and (rows % pair[0] or cols % pair[1])
    if pair is not None and count > 1 and s32.ndim == 2 and ragged:
        multiplier = s32 if direction == "multiply" else direct_to_inverse_scale(s32)
        dense = decode_fp8_block_grid(weight, multiplier, block=pair, dtype=dtype)
        layer = torch.nn.Linear(cols, rows, bias=bias is not None, device="meta")
        layer.weight = torch.nn.Parameter(dense, requires_grad=False)
        if bias is not None:
            layer.bias = torch.nn.Parameter(bias.to(dtype), requires_grad=False)
        return layer
    if count == 1:
        method, layout_block, shaped = "tensor", None, s32.reshape(())
    elif pair is None and tuple(s32.shape) in ((rows,), (rows, 1)):
        method, layout_block, shaped = "row", None, s32.reshape(rows)
    else:
        if pair is None:
            raise ValueError(
                f"{where}: scale shape {tuple(scale.shape)} for a {(rows, cols)} weight is a "
                f"block grid, and no block size was given"
            )
        expected = (rows // pair[0], cols // pair[1])
        if tuple(s32.shape) != expected:
            raise ValueError(
                f"{where}: scale grid {tuple(scale.shape)} does not fit a {(rows, cols)} weight "
                f"with block {list(pair)} (expected {expected})"
            )
        method, layout_block, shaped = "block", pair, s32
    inverse = direct_to_inverse_scale(shaped) if direction == "multiply" else shaped
    return TorchFP8Linear.from_quantized(
        weight, inverse, bias, weight_scale_method=method, weight_block_size=layout_block
    )


def fp4_module_from_source(
    tensors: Mapping[str, Tensor],
    *,
    layout: NVFP4SourceLayout,
    shape: tuple[int, int],
    is_swizzled_scales: bool = False,
    dtype: torch.dtype = torch.bfloat16,
) -> torch.nn.Module:
    """A :class:`~floatxq.nn.fp4_linear.TorchFP4Linear` from one module's NVFP4 source tensors.

    Tensor names, by ``layout`` (without the module prefix):
    ``modelopt``: ``weight``, ``weight_scale``, ``weight_scale_2``; ``compressed-tensors``:
    ``weight_packed``, ``weight_scale``, ``weight_global_scale`` (divides); ``torchao``:
    ``_weight_qdata``, ``_weight_scale``, ``_weight_per_tensor_scale`` (optional);
    ``comfy``: ``weight`` (high nibble first), swizzled ``weight_scale``, ``weight_scale_2``.
    An optional ``bias`` is kept in ``dtype``. An activation global scale makes the module W4A4
    (:func:`floatxq.interop.nvfp4_w4a4.input_scale_from_source`): ModelOpt's ``input_scale``,
    compressed-tensors' ``input_global_scale`` (divides: its FP32 reciprocal is taken).

    Raises:
      ValueError: a missing tensor (named), bad shapes, a global or input scale that is not
        finite and positive, an unknown layout. TypeError: wrong dtypes.

    Numerics: codes and E4M3 block scales byte for byte (nibbles reordered, scales
    unswizzled where the producer differs); compressed-tensors' dividing global scale becomes
    its FP32 reciprocal.
    """
    from floatxq.interop.nvfp4_w4a4 import input_scale_from_source
    from floatxq.nn.fp4_linear import TorchFP4Linear
    from floatxq.nvfp4.layouts import (
        nvfp4_from_comfy,
        nvfp4_from_compressed_tensors,
        nvfp4_from_modelopt,
        nvfp4_from_torchao,
    )

    where = "fp4_module_from_source"
    names = {
        "modelopt": ("weight", "weight_scale", "weight_scale_2"),
        "compressed-tensors": ("weight_packed", "weight_scale", "weight_global_scale"),
        "torchao": ("_weight_qdata", "_weight_scale"),
        "comfy": ("weight", "weight_scale", "weight_scale_2"),
    }
    if layout not in names:
        raise ValueError(f"{where}: layout must be one of {sorted(names)}, got {layout!r}")
    missing = [n for n in names[layout] if n not in tensors]
    if missing:
        raise ValueError(f"{where}: {layout} NVFP4 weights need {missing} (got {sorted(tensors)})")
    t = tensors
    if layout == "modelopt":
        w = nvfp4_from_modelopt(t["weight"], t["weight_scale"], t["weight_scale_2"])
    elif layout == "compressed-tensors":
        w = nvfp4_from_compressed_tensors(
            t["weight_packed"], t["weight_scale"], t["weight_global_scale"]
        )
    elif layout == "torchao":
        w = nvfp4_from_torchao(
            t["_weight_qdata"],
            t["_weight_scale"],
            t.get("_weight_per_tensor_scale"),
            shape=shape,
            is_swizzled_scales=is_swizzled_scales,
        )
    else:
        w = nvfp4_from_comfy(t["weight"], t["weight_scale"], t["weight_scale_2"], shape=shape)
    if tuple(w.shape) != tuple(shape):
        raise ValueError(f"{where}: the weight decodes to {tuple(w.shape)}, expected {shape}")
    g = input_scale_from_source(t, layout, w.packed.device)
    return TorchFP4Linear.from_nvfp4(w, t.get("bias"), dtype=dtype, input_scale=g)
