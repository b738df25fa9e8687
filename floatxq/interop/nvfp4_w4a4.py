"""NVFP4 W4A4 checkpoints: which activation scales floatxq runs, and how it reads them.

An NVFP4 W4A4 module quantizes its input per block of 16 along K at a static global scale
(:class:`~floatxq.nn.fp4_linear.TorchFP4Linear` with an ``input_scale``). Two producers write it:

* compressed-tensors / llm-compressor's ``NVFP4`` scheme (``nvfp4-pack-quantized``): a config
  group's ``input_activations`` ``{num_bits: 4, type: float, strategy: tensor_group,
  group_size: 16, dynamic: "local"}`` and, per module, ``input_global_scale`` (FP32 ``[1]``),
  which **divides** (``448·6 / amax``): floatxq's ``input_scale`` is its FP32 reciprocal, one
  IEEE division (the weight's ``weight_global_scale`` is read the same way).
* ModelOpt (``quant_algo: NVFP4``): ``input_activations`` ``{num_bits: 4, type: float,
  group_size: 16, dynamic: false}`` in ``config.json``'s ``quantization_config`` (or, in a
  sidecar-only export, no groups at all) and, per module, ``input_scale`` (FP32 ``()``), which
  **multiplies** (``amax / (448·6)``): floatxq's convention, taken as is.

Still refused (each with its own :class:`~floatxq.interop.checkpoint.CheckpointError`): other
activation schemes (dynamic global scales, other group sizes or widths), declared activations
without the scale tensors (or scales without the declaration), KV-cache scales and schemes,
output scales.
"""

from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import nn

from floatxq.config.rules import _check_rule_pattern
from floatxq.interop.checkpoint import CheckpointError
from floatxq.nvfp4.layouts import _reciprocal, _tensor_scale

__all__ = [
    "check_ct_nvfp4_inputs",
    "ct_nvfp4_input_declared",
    "describe_nvfp4_w4a4",
    "input_scale_from_source",
    "modelopt_nvfp4_w4a4",
    "nvfp4_w4a4_scale_names",
]

W4A4_LABEL = "nvfp4 e2m1 block 16, static global scale (W4A4)"
"""How ``inspect`` names the activations of an NVFP4 W4A4 module."""

_SIBLING = {
    "compressed-tensors": (".input_global_scale", ".weight_global_scale"),
    "modelopt": (".input_scale", ".weight_scale_2"),
}
_REFUSED_SUFFIXES = (".k_scale", ".v_scale", ".output_scale", ".input_zero_point")


def _lower(value: Any) -> str:
    return str(value).strip().lower() if value is not None else ""


def nvfp4_w4a4_scale_names(layout: str, names: Iterable[str]) -> set[str]:
    """The activation-scale tensor names of ``names`` that belong to NVFP4 modules of
    ``layout`` (compressed-tensors ``m.input_global_scale`` beside ``m.weight_global_scale``,
    ModelOpt ``m.input_scale`` beside ``m.weight_scale_2``): the ones W4A4 loads run.

    Example:
      >>> sorted(nvfp4_w4a4_scale_names("modelopt", ["a.weight_scale_2", "a.input_scale",
      ...                                             "b.input_scale"]))
      ['a.input_scale']
    """
    if layout not in _SIBLING:
        return set()
    scale, weight = _SIBLING[layout]
    every = set(names)
    return {n for n in every if n.endswith(scale) and n[: -len(scale)] + weight in every}


def _matches(entry: str, name: str, original: nn.Module) -> bool:
    """compressed-tensors' target matching (a ``re:`` pattern, a module name or class name)."""
    if entry.startswith("re:"):
        return _check_rule_pattern(entry, entry.removeprefix("re:")).match(name) is not None
    return entry == name or entry in {c.__name__ for c in type(original).__mro__}


def _nvfp4_input_spec(args: Mapping[str, Any], *, dynamic: Any) -> bool:
    """Whether ``args`` declare NVFP4 activations (4-bit float, groups of 16) with ``dynamic``."""
    return (
        args.get("num_bits") == 4
        and _lower(args.get("type")) == "float"
        and args.get("group_size") == 16
        and args.get("symmetric") is not False
        and args.get("dynamic") in dynamic
    )


def ct_nvfp4_input_declared(
    qconfig: Mapping[str, Any], name: str, original: nn.Module, file: str
) -> bool:
    """Whether compressed-tensors' config groups naming NVFP4 module ``name`` declare the
    ``NVFP4`` scheme's activations (static global scale, local block scales); False when they
    declare none.

    Raises:
      CheckpointError: other ``input_activations`` (naming the group and what floatxq runs),
        ``output_activations``, or groups that disagree.

    Numerics: none; metadata only.
    """
    where = f"{file} quantization_config"
    seen: dict[str, bool] = {}
    for key, group in (qconfig.get("config_groups") or {}).items():
        if not isinstance(group, Mapping) or not any(
            _matches(str(t), name, original) for t in group.get("targets") or ()
        ):
            continue
        if group.get("output_activations"):
            raise CheckpointError(
                f"load: {where} group {key!r} quantizes output activations of {name}; floatxq "
                f"does not run output quantization"
            )
        args = group.get("input_activations")
        if args is None:
            seen[key] = False
            continue
        ok = isinstance(args, Mapping) and _lower(args.get("strategy")) == "tensor_group"
        if not (ok and _nvfp4_input_spec(args, dynamic=("local",))):
            raise CheckpointError(
                f"load: {where} group {key!r} declares input activations {args!r} for the NVFP4 "
                f"module {name}; floatxq runs NVFP4 activations only as compressed-tensors' NVFP4 "
                f"scheme does (num_bits 4, type float, strategy tensor_group, group_size 16, "
                f"dynamic 'local': a static input_global_scale)"
            )
        seen[key] = True
    if len(set(seen.values())) > 1:
        raise CheckpointError(
            f"load: {where} groups {sorted(seen)} disagree on {name}'s input activations"
        )
    return any(seen.values())


def check_ct_nvfp4_inputs(
    name: str,
    tensors: Mapping[str, torch.Tensor],
    qconfig: Mapping[str, Any],
    original: nn.Module,
    file: str,
) -> None:
    """A compressed-tensors NVFP4 module's ``input_global_scale`` and its groups' declared
    activations agree (:func:`ct_nvfp4_input_declared`).

    Raises:
      CheckpointError: declared activations without the scale, a scale without them, or a
        declaration :func:`ct_nvfp4_input_declared` refuses.
    """
    declared = ct_nvfp4_input_declared(qconfig, name, original, file)
    if declared and "input_global_scale" not in tensors:
        raise CheckpointError(
            f"load: {name} in {file}: the quantization_config declares NVFP4 input activations "
            f"but {name}.input_global_scale (the static global scale they need) is missing"
        )
    if not declared and "input_global_scale" in tensors:
        raise CheckpointError(
            f"load: {name} in {file}: {name}.input_global_scale is a static activation scale, "
            f"but the quantization_config declares no input activations for it"
        )


def _modelopt_groups(declared: Mapping[str, Any]) -> list[Any]:
    """Every ``config_groups[*].input_activations`` of ModelOpt's payload (and its sidecar's)."""
    layers = [declared, declared.get("quantization")]
    found = []
    for payload in layers:
        if not isinstance(payload, Mapping):
            continue
        groups = payload.get("config_groups")
        for group in groups.values() if isinstance(groups, Mapping) else ():
            if isinstance(group, Mapping):
                found.append(group.get("input_activations"))
    return found


def _algo(declared: Mapping[str, Any]) -> str:
    inner = declared.get("quantization")
    inner = inner if isinstance(inner, Mapping) else {}
    return _lower(declared.get("quant_algo") or inner.get("quant_algo"))


def modelopt_nvfp4_w4a4(declared: Mapping[str, Any], names: Iterable[str], root: Any) -> bool:
    """Whether a ModelOpt checkpoint that quantizes activations is NVFP4 W4A4 that floatxq runs:
    ``quant_algo: NVFP4``, every declared ``input_activations`` NVFP4 with a static scale (or no
    config groups at all, the sidecar-only export), an ``input_scale`` on every NVFP4 module and
    on nothing else, no KV-cache or output scales. False for what is not NVFP4 W4A4 at all (the
    caller's generic refusal applies).

    Raises:
      CheckpointError: an NVFP4 W4A4 checkpoint floatxq cannot run faithfully, naming what.

    Numerics: none; metadata and names only.
    """
    every = list(names)
    if _algo(declared) != "nvfp4":
        return False
    groups = _modelopt_groups(declared)
    specs = [g for g in groups if g is not None]
    inner = declared.get("quantization")
    for payload in (declared, inner if isinstance(inner, Mapping) else {}):
        algo = payload.get("kv_cache_quant_algo")
        if payload.get("kv_cache_scheme") or _lower(algo) not in ("", "none"):
            raise CheckpointError(
                f"load: {root}: the ModelOpt NVFP4 checkpoint quantizes the KV cache "
                f"(kv_cache_scheme / kv_cache_quant_algo); floatxq runs NVFP4 W4A4 linears but "
                f"not KV-cache quantization"
            )
    ok = [isinstance(s, Mapping) and _nvfp4_input_spec(s, dynamic=(False, None)) for s in specs]
    bad = [s for s, fine in zip(specs, ok, strict=True) if not fine]
    if bad:
        raise CheckpointError(
            f"load: {root}: ModelOpt declares input activations {bad[0]!r}; floatxq runs "
            f"ModelOpt NVFP4 activations only with a static input_scale (num_bits 4, type "
            f"float, group_size 16, dynamic false)"
        )
    extra = [n for n in every if n.endswith(_REFUSED_SUFFIXES)]
    if extra:
        raise CheckpointError(
            f"load: {root}: the ModelOpt checkpoint carries {extra[0]!r} ({len(extra)} such "
            f"tensors): floatxq does not run KV-cache or output quantization"
        )
    runs = nvfp4_w4a4_scale_names("modelopt", every)
    stray = sorted(n for n in every if n.endswith(".input_scale") and n not in runs)
    if stray:
        raise CheckpointError(
            f"load: {root}: {stray[0]!r} is the input scale of a module that is not NVFP4; "
            f"floatxq runs static input scales on ModelOpt NVFP4 modules only"
        )
    modules = [n.removesuffix(".weight_scale_2") for n in every if n.endswith(".weight_scale_2")]
    missing = [m for m in modules if f"{m}.input_scale" not in runs]
    if groups and not specs:  # groups declare weight-only: scales would contradict them
        if runs:
            raise CheckpointError(
                f"load: {root}: {sorted(runs)[0]!r} is a static activation scale, but the "
                f"ModelOpt quantization_config declares no input activations (weight-only)"
            )
        return False
    if missing and (specs or runs):
        raise CheckpointError(
            f"load: {root}: ModelOpt NVFP4 quantizes activations, but {missing[0]}.input_scale "
            f"is missing ({len(missing)} of {len(modules)} NVFP4 modules lack one); the "
            f"activation's static global scale is needed to run it"
        )
    return bool(runs)


def input_scale_from_source(
    tensors: Mapping[str, torch.Tensor], layout: str, device: torch.device
) -> torch.Tensor | None:
    """A module's activation global scale in floatxq's convention (multiply), or None without
    one: ModelOpt's ``input_scale`` as is, compressed-tensors' ``input_global_scale`` as its
    FP32 reciprocal.

    Raises:
      TypeError, ValueError: a tensor of another dtype or several values, not finite and > 0,
        or (compressed-tensors) whose reciprocal is not a normal FP32 number.

    Numerics: exact for ModelOpt; one IEEE FP32 division for compressed-tensors (relative
    error at most ``2**-24``; a stored ``s`` with ``fl(1/fl(1/s)) != s`` is still read, its grid
    then differs from the producer's by that half ulp and a save writes ``fl(1/fl(1/s))``).
    """
    where = "input_scale_from_source"
    if layout == "modelopt" and "input_scale" in tensors:
        return _tensor_scale(tensors["input_scale"], device, name="input_scale", where=where)
    if layout == "compressed-tensors" and "input_global_scale" in tensors:
        name = "input_global_scale"
        divisor = _tensor_scale(tensors[name], device, name=name, where=where)
        return _reciprocal(divisor, name=name, where=where)
    return None


def describe_nvfp4_w4a4(activations: str, w4a4: int, weight_only: str) -> str:
    """``inspect``'s activations line with ``w4a4`` NVFP4 W4A4 modules added to what the FP8
    modules declare (``activations``; ``weight_only`` when they declare none).

    Example:
      >>> describe_nvfp4_w4a4("none (weight-only)", 14, "none (weight-only)")
      'nvfp4 e2m1 block 16, static global scale (W4A4) on 14 NVFP4 modules'
    """
    if not w4a4:
        return activations
    label = f"{W4A4_LABEL} on {w4a4} NVFP4 modules"
    return label if activations == weight_only else f"{activations}; {label}"
