"""Static FP8 activations (W8A8): which checkpoint scales floatxq runs, and how it reads them.

A static FP8 module quantizes its input per tensor at a stored scale fixed at calibration
(:class:`~floatxq.nn.fp8_linear.TorchFP8Linear` with ``input_quant="static"`` and its
``input_scale``: :func:`floatxq.fp8_activation.static_input_qdq`). Three producers write it, each
scale the activation's decode multiplier (``x ≈ e4m3(x / s) · s``), read as is (widened to FP32):

* compressed-tensors / llm-compressor's ``FP8`` scheme (``float-quantized``): a config group's
  ``input_activations`` ``{num_bits: 8, type: float, strategy: tensor, dynamic: false}`` and, per
  module, ``input_scale`` (``[1]``, in the model dtype).
* ModelOpt (``quant_algo: FP8``): ``input_scale`` (FP32 ``()``) beside each FP8 ``weight_scale``;
  its ``input_activations``, when declared, 8-bit float and not dynamic.
* transformers' fine-grained FP8 (``quant_method: fp8``, ``activation_scheme: static``):
  ``activation_scale`` (FP32 ``()``) beside each ``weight_scale_inv``.

Still refused (each with its own :class:`~floatxq.interop.checkpoint.CheckpointError`): static
FP8 activations other than per tensor, declared static activations without their scale (or a
scale without the declaration), a ModelOpt FP8 checkpoint with the scale on some FP8 modules
only, KV-cache and output scales.
"""

from collections.abc import Iterable, Mapping
from typing import Any

import torch

from floatxq.interop.checkpoint import CheckpointError
from floatxq.interop.nvfp4_w4a4 import _algo, _lower, _modelopt_groups

__all__ = [
    "fp8_static_scale_names",
    "modelopt_fp8_static",
    "static_input_scale",
    "static_scale_key",
]

_SCALE_KEY = {
    "compressed-tensors": "input_scale",
    "modelopt": "input_scale",
    "hf": "activation_scale",
}
_WEIGHT_SCALE = {
    "compressed-tensors": "weight_scale",
    "modelopt": "weight_scale",
    "hf": "weight_scale_inv",
}
_NOT_FP8 = ("weight_scale_2", "weight_packed", "weight_global_scale")
"""Sibling tensors of NVFP4 / packed modules, whose input scales are not FP8 ones."""


def static_scale_key(layout: str) -> str | None:
    """The per-module tensor that holds a static FP8 activation scale in ``layout`` (``None``:
    the layout has none that floatxq runs).

    Example:
      >>> static_scale_key("hf"), static_scale_key("gptqmodel")
      ('activation_scale', None)
    """
    return _SCALE_KEY.get(layout)


def fp8_static_scale_names(layout: str, names: Iterable[str]) -> set[str]:
    """The activation-scale tensor names of ``names`` that belong to FP8 modules of ``layout``
    (``m.input_scale`` beside ``m.weight_scale`` and no NVFP4 sibling; transformers'
    ``m.activation_scale`` beside ``m.weight_scale_inv``): the ones static FP8 loads run.

    Example:
      >>> sorted(fp8_static_scale_names("modelopt", ["a.weight_scale", "a.input_scale",
      ...                                            "b.weight_scale_2", "b.input_scale"]))
      ['a.input_scale']
    """
    key = _SCALE_KEY.get(layout)
    if key is None:
        return set()
    every = set(names)
    weight = _WEIGHT_SCALE[layout]
    found = set()
    for name in every:
        module, _, leaf = name.rpartition(".")
        if leaf != key or f"{module}.{weight}" not in every:
            continue
        if not any(f"{module}.{other}" in every for other in _NOT_FP8):
            found.add(name)
    return found


def _fp8_input_spec(args: Any) -> bool:
    """Whether ModelOpt's declared ``input_activations`` are static per-tensor FP8."""
    return (
        isinstance(args, Mapping)
        and args.get("num_bits") == 8
        and _lower(args.get("type")) in ("", "float")
        and args.get("dynamic") in (False, None)
        and _lower(args.get("strategy")) in ("", "tensor")
        and args.get("symmetric") is not False
    )


def modelopt_fp8_static(declared: Mapping[str, Any], names: Iterable[str], root: Any) -> bool:
    """Whether a ModelOpt checkpoint that quantizes activations is FP8 W8A8 that floatxq runs:
    ``quant_algo: FP8``, every declared ``input_activations`` static 8-bit float, an
    ``input_scale`` on every FP8 module, no KV-cache or output scales. False for what is not
    ModelOpt FP8 at all (the caller's generic refusal applies).

    Raises:
      CheckpointError: a ModelOpt FP8 checkpoint floatxq cannot run faithfully, naming what.

    Numerics: none; metadata and names only.
    """
    every = list(names)
    if _algo(declared) != "fp8":
        return False
    inner = declared.get("quantization")
    for payload in (declared, inner if isinstance(inner, Mapping) else {}):
        algo = payload.get("kv_cache_quant_algo")
        if payload.get("kv_cache_scheme") or _lower(algo) not in ("", "none"):
            raise CheckpointError(
                f"load: {root}: the ModelOpt FP8 checkpoint quantizes the KV cache "
                f"(kv_cache_scheme / kv_cache_quant_algo); floatxq runs static FP8 linears but "
                f"not KV-cache quantization"
            )
    groups = _modelopt_groups(declared)
    specs = [s for s in groups if s is not None]
    bad = [s for s in specs if not _fp8_input_spec(s)]
    if bad:
        raise CheckpointError(
            f"load: {root}: ModelOpt FP8 declares input activations {bad[0]!r}; floatxq runs "
            f"ModelOpt FP8 activations only static per tensor (num_bits 8, type float, dynamic "
            f"false) with an input_scale"
        )
    extra = [n for n in every if n.endswith((".k_scale", ".v_scale", ".output_scale"))]
    if extra:
        raise CheckpointError(
            f"load: {root}: the ModelOpt checkpoint carries {extra[0]!r} ({len(extra)} such "
            f"tensors): floatxq does not run KV-cache or output quantization"
        )
    runs = fp8_static_scale_names("modelopt", every)
    stray = sorted(n for n in every if n.endswith(".input_scale") and n not in runs)
    if stray:
        raise CheckpointError(
            f"load: {root}: {stray[0]!r} is the input scale of a module that is not FP8; "
            f"floatxq runs static input scales on ModelOpt FP8 modules only"
        )
    if groups and not specs and runs:  # groups declare weight-only: scales contradict them
        raise CheckpointError(
            f"load: {root}: {sorted(runs)[0]!r} is a static activation scale, but the ModelOpt "
            f"quantization_config declares no input activations (weight-only)"
        )
    modules = {n.rpartition(".")[0] for n in every if n.endswith(".weight_scale")}
    missing = sorted(m for m in modules if f"{m}.input_scale" not in runs)
    if missing and (specs or runs):
        raise CheckpointError(
            f"load: {root}: ModelOpt FP8 quantizes activations statically, but "
            f"{missing[0]}.input_scale is missing ({len(missing)} of {len(modules)} FP8 modules "
            f"lack one); the activation's static scale is needed to run it"
        )
    return bool(runs)


def static_input_scale(tensors: Mapping[str, torch.Tensor], layout: str) -> torch.Tensor | None:
    """A module's stored static FP8 activation scale under ``layout``, as stored (``None``:
    none)."""
    key = _SCALE_KEY.get(layout)
    return tensors.get(key) if key is not None else None
