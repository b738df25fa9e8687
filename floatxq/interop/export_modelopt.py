"""NVIDIA ModelOpt's NVFP4 and FP8 (W8A8) checkpoint layouts, written: what TensorRT-LLM, vLLM
and SGLang read as ``quant_method: "modelopt"``. :func:`floatxq.interop.export.export_layout`
calls these for ``layout="modelopt"``; ``docs/interop.md`` has the table.

A :class:`~floatxq.nn.fp4_linear.TorchFP4Linear` already holds ModelOpt's tensors: ``weight``
(uint8 ``[out, in/2]``, even element in the low nibble), ``weight_scale`` (float8_e4m3fn
``[out, in/16]``), ``weight_scale_2`` (FP32 ``()``, multiplies) and, for W4A4, ``input_scale``
(FP32 ``()``, the activation's global decode multiplier ``amax / (6 * 448)``). They are written
under those names, unchanged. A static FP8 :class:`~floatxq.nn.fp8_linear.TorchFP8Linear`
with tensor scales is ModelOpt's FP8 (``quant_algo: FP8``): ``weight`` (float8_e4m3fn),
``weight_scale`` (FP32 ``()``, multiplies: ``fl(1 / weight_scale_inv)``) and ``input_scale``
(FP32 ``()``, as held). The metadata says which modules quantize what:

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
    "MODELOPT_ALGOS",
    "MODELOPT_NVFP4_ALGOS",
    "SIDECAR_FILE",
    "check_one_algo",
    "modelopt_nvfp4_algo",
    "modelopt_payloads",
]

SIDECAR_FILE = "hf_quant_config.json"
W4A4_ALGO = "NVFP4"
W4A16_ALGO = "W4A16_NVFP4"
MIXED_ALGO = "MIXED_PRECISION"
FP8_ALGO = "FP8"
MODELOPT_NVFP4_ALGOS: tuple[str, ...] = (W4A4_ALGO, W4A16_ALGO)
"""The ``quant_algo`` values this layout writes for NVFP4 modules: W4A4, weight-only."""
MODELOPT_ALGOS: tuple[str, ...] = (*MODELOPT_NVFP4_ALGOS, FP8_ALGO)
"""Every ``quant_algo`` this layout writes (``FP8``: static W8A8, per-tensor scales)."""
_GROUP = 16


def modelopt_nvfp4_algo(module: nn.Module) -> str:
    """A module's ``quant_algo``: ``"NVFP4"`` for an NVFP4 module that quantizes its activations
    (an ``input_scale``), ``"W4A16_NVFP4"`` for a weight-only one, ``"FP8"`` for an FP8 module
    (the export has checked it is static W8A8).

    Numerics: names only.

    Example:
      >>> from floatxq.nn.fp4_linear import TorchFP4Linear
      >>> modelopt_nvfp4_algo(TorchFP4Linear(32, 8))
      'W4A16_NVFP4'
    """
    if hasattr(module, "weight_scale_inv"):  # a TorchFP8Linear
        return FP8_ALGO
    return W4A4_ALGO if getattr(module, "input_scale", None) is not None else W4A16_ALGO


def check_one_algo(algos: Mapping[str, str]) -> None:
    """Refuse a model whose modules need several ``quant_algo`` values: ModelOpt declares the
    mix ``MIXED_PRECISION``, which ``floatxq.load`` runs neither as W4A4 nor as W8A8.

    Raises:
      ValueError: naming a module of each algorithm; compressed-tensors holds the mix.
    """
    kinds = list(dict.fromkeys(algos.values()))
    if len(kinds) < 2:
        return
    if set(kinds) == set(MODELOPT_NVFP4_ALGOS):
        weight_only = next(n for n, algo in algos.items() if algo == W4A16_ALGO)
        w4a4 = next(n for n, algo in algos.items() if algo != W4A16_ALGO)
        raise ValueError(
            f"export: layout 'modelopt' cannot hold module {weight_only!r} (NVFP4 weights, "
            f"weight-only): the model mixes it with W4A4 modules (e.g. {w4a4!r}), which ModelOpt "
            f"declares as MIXED_PRECISION, and floatxq.load runs ModelOpt W4A4 only as quant_algo "
            f"NVFP4 on every NVFP4 module; compressed-tensors holds both in separate config "
            f"groups; layouts that hold it: 'compressed-tensors'"
        )
    first = {kind: next(n for n, a in algos.items() if a == kind) for kind in kinds}
    raise ValueError(
        f"export: layout 'modelopt' cannot hold module {first[kinds[1]]!r} (quant_algo "
        f"{kinds[1]}): the model mixes it with {kinds[0]} modules (e.g. {first[kinds[0]]!r}), "
        f"which ModelOpt declares as MIXED_PRECISION, and floatxq.load runs ModelOpt checkpoints "
        f"of one quant_algo only; layouts that hold it: 'compressed-tensors'"
    )


def _producer() -> dict[str, str]:
    try:
        version = metadata.version("floatxq")
    except metadata.PackageNotFoundError:
        version = "unknown"
    return {"name": "floatxq", "version": version}


def _group(algo: str) -> dict[str, Any]:
    """One ``config_groups`` entry of the embedded config (targets added by the caller)."""
    spec: dict[str, Any] = {"dynamic": False, "num_bits": 4, "type": "float", "group_size": _GROUP}
    if algo == FP8_ALGO:
        spec = {"dynamic": False, "num_bits": 8, "type": "float"}
    group: dict[str, Any] = {"weights": dict(spec)}
    if algo in (W4A4_ALGO, FP8_ALGO):
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
    unknown = sorted(set(algos.values()) - set(MODELOPT_ALGOS))
    if unknown:
        raise ValueError(
            f"export: layout 'modelopt' writes quant_algo {list(MODELOPT_ALGOS)}; got {unknown}"
        )
    kinds = list(dict.fromkeys(algos.values()))
    producer = _producer()
    quantization: dict[str, Any] = {"quant_algo": None, "kv_cache_quant_algo": None}
    if len(kinds) == 1:
        quantization["quant_algo"] = kinds[0]
        if kinds[0] != FP8_ALGO:
            quantization["group_size"] = _GROUP
        quantization["exclude_modules"] = sorted(excluded)
        groups = {"group_0": {**_group(kinds[0]), "targets": ["Linear"]}}
    else:
        quantization["quant_algo"] = MIXED_ALGO
        layers = {
            name: {"quant_algo": algo, **({} if algo == FP8_ALGO else {"group_size": _GROUP})}
            for name, algo in algos.items()
        }
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
    if len(kinds) == 1 and kinds[0] != FP8_ALGO:
        embedded["group_size"] = _GROUP
    elif len(kinds) > 1:
        embedded["quantized_layers"] = {k: dict(v) for k, v in layers.items()}
    return sidecar, embedded
