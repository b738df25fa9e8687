"""NVIDIA ModelOpt's NVFP4 checkpoint layout, written: what TensorRT-LLM, vLLM and SGLang read as
``quant_method: "modelopt"``. :func:`floatxq.interop.export.export_layout` calls these for
``layout="modelopt"``; ``docs/interop.md`` has the table.

A :class:`~floatxq.nn.fp4_linear.TorchFP4Linear` already holds ModelOpt's tensors: ``weight``
(uint8 ``[out, in/2]``, even element in the low nibble), ``weight_scale`` (float8_e4m3fn
``[out, in/16]``), ``weight_scale_2`` (FP32 ``()``, multiplies) and, for W4A4, ``input_scale``
(FP32 ``()``, the activation's global decode multiplier ``amax / (6 * 448)``). They are written
under those names, unchanged. The metadata says which modules quantize what:

* ``hf_quant_config.json``: ``producer`` and ``quantization`` with ``quant_algo`` (``NVFP4`` for
  W4A4 modules, ``W4A16_NVFP4`` for weight-only ones; :func:`modelopt_payloads` describes a mix
  as ModelOpt does, ``MIXED_PRECISION`` with a per-module ``quantized_layers``, which the save
  refuses because ``floatxq.load`` runs ModelOpt W4A4 only as ``NVFP4``),
  ``kv_cache_quant_algo: null``, ``group_size: 16`` and ``exclude_modules`` (the dense linears,
  ``lm_head`` among them);
* ``config.json``'s ``quantization_config``: the same with ``quant_method: "modelopt"``, one
  ``config_groups`` entry per algorithm and ``ignore`` for ``exclude_modules``, as ModelOpt embeds
  it.

Numerics: bytes and FP32 scales are written as they are; nothing is converted.
"""

from collections.abc import Mapping, Sequence
from importlib import metadata
from typing import Any

from torch import nn

__all__ = [
    "MODELOPT_NVFP4_ALGOS",
    "SIDECAR_FILE",
    "modelopt_nvfp4_algo",
    "modelopt_payloads",
]

SIDECAR_FILE = "hf_quant_config.json"
W4A4_ALGO = "NVFP4"
W4A16_ALGO = "W4A16_NVFP4"
MIXED_ALGO = "MIXED_PRECISION"
MODELOPT_NVFP4_ALGOS: tuple[str, ...] = (W4A4_ALGO, W4A16_ALGO)
"""The ``quant_algo`` values this layout writes for NVFP4 modules: W4A4, weight-only."""
_GROUP = 16


def modelopt_nvfp4_algo(module: nn.Module) -> str:
    """``"NVFP4"`` for an NVFP4 module that quantizes its activations (an ``input_scale``),
    ``"W4A16_NVFP4"`` for a weight-only one.

    Numerics: names only.

    Example:
      >>> from floatxq.nn.fp4_linear import TorchFP4Linear
      >>> modelopt_nvfp4_algo(TorchFP4Linear(32, 8))
      'W4A16_NVFP4'
    """
    return W4A4_ALGO if getattr(module, "input_scale", None) is not None else W4A16_ALGO


def _producer() -> dict[str, str]:
    try:
        version = metadata.version("floatxq")
    except metadata.PackageNotFoundError:
        version = "unknown"
    return {"name": "floatxq", "version": version}


def _group(algo: str) -> dict[str, Any]:
    """One ``config_groups`` entry of the embedded config (targets added by the caller)."""
    spec = {"dynamic": False, "num_bits": 4, "type": "float", "group_size": _GROUP}
    group: dict[str, Any] = {"weights": dict(spec)}
    if algo == W4A4_ALGO:
        group["input_activations"] = dict(spec)
    return group


def modelopt_payloads(
    algos: Mapping[str, str], excluded: Sequence[str]
) -> tuple[dict[str, Any], dict[str, Any]]:
    """``hf_quant_config.json``'s payload and ``config.json``'s ``quantization_config``.

    Args:
      algos: each quantized module's name and its ``quant_algo`` (:func:`modelopt_nvfp4_algo`),
        in module order.
      excluded: the linear modules left dense (``exclude_modules`` / ``ignore``).

    Raises:
      ValueError: no module, or an algorithm this layout does not write.

    Numerics: names only.

    Example:
      >>> side, embedded = modelopt_payloads({"0": "W4A16_NVFP4"}, ["lm_head"])
      >>> side["quantization"]["quant_algo"], embedded["quant_method"], embedded["ignore"]
      ('W4A16_NVFP4', 'modelopt', ['lm_head'])
    """
    if not algos:
        raise ValueError("export: layout 'modelopt' describes quantized modules; got none")
    unknown = sorted(set(algos.values()) - set(MODELOPT_NVFP4_ALGOS))
    if unknown:
        raise ValueError(
            f"export: layout 'modelopt' writes quant_algo {list(MODELOPT_NVFP4_ALGOS)}; got "
            f"{unknown}"
        )
    kinds = list(dict.fromkeys(algos.values()))
    producer = _producer()
    quantization: dict[str, Any] = {"quant_algo": None, "kv_cache_quant_algo": None}
    if len(kinds) == 1:
        quantization.update(quant_algo=kinds[0], group_size=_GROUP)
        quantization["exclude_modules"] = sorted(excluded)
        groups = {"group_0": {**_group(kinds[0]), "targets": ["Linear"]}}
    else:
        quantization["quant_algo"] = MIXED_ALGO
        layers = {name: {"quant_algo": algo, "group_size": _GROUP} for name, algo in algos.items()}
        quantization["quantized_layers"] = layers
        quantization["exclude_modules"] = sorted(excluded)
        groups = {
            f"group_{i}": {
                **_group(kind),
                "targets": sorted(name for name, algo in algos.items() if algo == kind),
            }
            for i, kind in enumerate(kinds)
        }
    sidecar = {"producer": producer, "quantization": quantization}
    embedded: dict[str, Any] = {
        "config_groups": groups,
        "ignore": list(quantization["exclude_modules"]),
        "quant_algo": quantization["quant_algo"],
        "kv_cache_quant_algo": None,
        "producer": dict(producer),
        "quant_method": "modelopt",
    }
    if len(kinds) == 1:
        embedded["group_size"] = _GROUP
    else:
        embedded["quantized_layers"] = {k: dict(v) for k, v in layers.items()}
    return sidecar, embedded
