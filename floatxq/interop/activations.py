"""The activation scheme a checkpoint declares for its FP8 modules, read once for load and inspect.

vLLM serves a checkpoint with the activation quantization its metadata declares; floatxq reads
the same declaration so its modules compute what is served:

* compressed-tensors: each config group's ``input_activations`` (the groups whose ``targets``
  name the module). Dynamic E4M3 per ``token`` (llm-compressor's ``FP8_DYNAMIC``), per ``group``
  (``FP8_BLOCK``: 1×128) and per ``tensor`` are read, and static per ``tensor`` (``dynamic:
  false``, llm-compressor's ``FP8``: W8A8, the module's ``input_scale``); ``null`` is weight-only.
* transformers' fine-grained FP8 (``quant_method: fp8``): ``activation_scheme: dynamic`` (its
  default) quantizes each token per ``weight_block_size[1]`` columns (the whole row without a
  block size); ``static`` quantizes per tensor at each module's ``activation_scale``.
* ModelOpt: static per tensor on the FP8 modules with an ``input_scale`` (``quant_algo: FP8``,
  checked as a whole by :func:`floatxq.interop.fp8_static.modelopt_fp8_static`), else
  weight-only.
* GPT-QModel's / floatxq's FP8 payload (``gptqmodel``), Quark: weight-only (their activation
  scales, when present, are refused by :func:`refuse_activation_scales`).

Refused, for load and inspect alike (:class:`~floatxq.interop.checkpoint.CheckpointError`):
static activation quantization other than FP8 per tensor, a static declaration without its scale
tensor (or a scale without the declaration), activations other than 8-bit float, asymmetric
activations, ``output_activations``, and schemes that differ between the groups naming one module.
"""

import functools
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from floatxq.config.rules import RulePattern, _check_rule_pattern
from floatxq.fp8_activation import FP8InputQuant
from floatxq.interop.checkpoint import CheckpointError
from floatxq.interop.fp8_static import (
    fp8_static_scale_names,
    static_input_scale,
    static_scale_key,
)
from floatxq.interop.layouts import LayoutDecision
from floatxq.interop.nvfp4_w4a4 import nvfp4_w4a4_scale_names
from floatxq.nn.fp8_linear import TorchFP8Linear

__all__ = [
    "ACTIVATION_SCALE_SUFFIXES",
    "WEIGHT_ONLY",
    "ct_input_activations",
    "declared_input_quant",
    "describe_declared_activations",
    "refuse_activation_scales",
    "refuse_dropped_activations",
    "with_declared_activations",
]

ACTIVATION_SCALE_SUFFIXES = (
    ".input_scale",
    ".input_global_scale",
    ".k_scale",
    ".v_scale",
    ".input_zero_point",
    ".output_scale",
    ".activation_scale",
)
"""Tensor-name endings of activation-quantization scales (each producer's), run or refused."""

WEIGHT_ONLY = "none (weight-only)"
"""How :func:`describe_declared_activations` names a checkpoint that quantizes no activations."""


def _lower(value: Any) -> str:
    return str(value).strip().lower() if value is not None else ""


@functools.lru_cache(maxsize=1024)
def _pattern(entry: str) -> RulePattern:
    return _check_rule_pattern(entry, entry.removeprefix("re:"))


def _matches(entry: str, name: str, original: nn.Module) -> bool:
    """compressed-tensors' target matching, as the readers match ``ignore`` and block sizes."""
    if entry.startswith("re:"):
        return _pattern(entry).match(name) is not None
    return entry == name or entry in {c.__name__ for c in type(original).__mro__}


def _ct_args(args: Any, where: str) -> FP8InputQuant | None:
    """One group's ``input_activations`` as floatxq runs them (``None``: weight-only)."""
    if args is None:
        return None
    strategy = _lower(args.get("strategy"))
    dynamic = args.get("dynamic")
    if dynamic is False or _lower(dynamic) in ("false", "static"):
        if (
            _lower(args.get("type")) == "float"
            and args.get("num_bits") == 8
            and args.get("symmetric") is not False
            and strategy == "tensor"
        ):
            return FP8InputQuant("static")
        raise CheckpointError(
            f"load: {where} declares static activation quantization {dict(args)!r}; floatxq "
            f"runs static activations as symmetric 8-bit float per tensor only (llm-compressor's "
            f"FP8 scheme), besides weight-only and dynamic FP8 activations"
        )
    if (
        _lower(args.get("type")) != "float"
        or args.get("num_bits") != 8
        or args.get("symmetric") is False
        or dynamic is not True
        or strategy not in ("token", "group", "tensor")
    ):
        raise CheckpointError(
            f"load: {where} declares activations {dict(args)!r}; floatxq runs dynamic symmetric "
            f"8-bit float activations per token, token group or tensor only"
        )
    if strategy != "group":
        return FP8InputQuant(strategy)  # type: ignore[arg-type]
    size = args.get("group_size")
    if isinstance(size, bool) or not isinstance(size, int) or size <= 0:
        raise CheckpointError(f"load: {where} declares group activations without a group_size")
    return FP8InputQuant("group", size)


def _ct_declared(
    qconfig: Mapping[str, Any], name: str, original: nn.Module, file: str
) -> FP8InputQuant | None:
    where = f"{file} quantization_config"
    groups = qconfig.get("config_groups") or {}
    named = [(k, g) for k, g in groups.items() if isinstance(g, Mapping)]
    try:
        mine = [
            (k, g)
            for k, g in named
            if any(
                _matches(t, name, original) for t in g.get("targets") or () if isinstance(t, str)
            )
        ]
    except ValueError as exc:  # a target pattern the rule check refuses
        raise CheckpointError(f"load: {where} targets: {exc}") from None
    found: dict[FP8InputQuant | None, str] = {}
    for key, group in mine or named:
        field = f"{where}.config_groups[{key!r}]"
        if group.get("output_activations") is not None:
            raise CheckpointError(
                f"load: {field}.output_activations is {dict(group['output_activations'])!r}; "
                f"floatxq does not quantize outputs"
            )
        found.setdefault(
            _ct_args(group.get("input_activations"), f"{field}.input_activations"), key
        )
    if len(found) > 1:
        raise CheckpointError(
            f"load: {where}: config groups {sorted(found.values())} declare different activations "
            f"for {name}; a module runs one scheme"
        )
    return next(iter(found), None)


def declared_input_quant(
    decision: LayoutDecision,
    qconfig: Mapping[str, Any] | None,
    name: str,
    original: nn.Module,
    file: str,
    *,
    scaled: bool = False,
) -> FP8InputQuant | None:
    """The FP8 activations ``qconfig`` declares for FP8 module ``name`` (the module docstring's
    table), ``None`` for weight-only. ``scaled``: whether the module's tensors hold a static
    activation scale (ModelOpt declares static activations by it).

    Raises:
      CheckpointError: a declaration floatxq does not run (the module docstring lists them).

    Numerics: none; metadata only.
    """
    qconfig = qconfig or {}
    if decision.layout == "compressed-tensors":
        return _ct_declared(qconfig, name, original, file)
    if decision.layout == "modelopt":
        return FP8InputQuant("static") if scaled else None
    if decision.layout != "hf":
        return None
    scheme = _lower(qconfig.get("activation_scheme", "dynamic"))
    if scheme == "static":
        return FP8InputQuant("static")
    if scheme != "dynamic":
        raise CheckpointError(
            f"load: {file} quantization_config activation_scheme is "
            f"{qconfig.get('activation_scheme')!r}; floatxq runs transformers' fine-grained FP8 "
            f"with 'dynamic' or 'static' activations"
        )
    block = qconfig.get("weight_block_size")
    if isinstance(block, list | tuple) and len(block) == 2 and isinstance(block[1], int):
        return FP8InputQuant("group", block[1])
    return FP8InputQuant("token")


def with_declared_activations(
    module: nn.Module,
    decision: LayoutDecision,
    qconfig: Mapping[str, Any] | None,
    name: str,
    original: nn.Module,
    file: str,
    tensors: Mapping[str, torch.Tensor] | None = None,
    weight_only: bool = False,
) -> nn.Module:
    """``module`` (a just-read FP8 module) with the activations its checkpoint declares; a
    static declaration takes the module's scale from ``tensors`` (its stored tensors).
    ``weight_only`` (a requantization source): ``module`` as read, weight-only.

    Raises:
      CheckpointError: as :func:`declared_input_quant`; a group size that does not divide the
        module's ``in_features``; static activations declared without the scale tensor, a scale
        tensor without them, or a scale that is not one finite value > 0.
    """
    if weight_only:
        return module
    scale = static_input_scale(tensors or {}, decision.layout)
    if not isinstance(module, TorchFP8Linear):
        if scale is not None:  # (a ragged block grid is decoded to a dense nn.Linear)
            raise CheckpointError(
                f"load: {name} in {file} is decoded to a dense {type(module).__name__} (no FP8 "
                f"module holds its scales), which cannot run its static activation scale"
            )
        return module
    quant = declared_input_quant(decision, qconfig, name, original, file, scaled=scale is not None)
    key = _check_static_scale(quant, scale is not None, decision.layout, name, file)
    try:
        if scale is not None:
            module.use_static_input(scale)
        else:
            module.input_quant = quant
    except (TypeError, ValueError) as exc:
        where = key if scale is not None else name
        raise CheckpointError(f"load: {where} in {file}: {exc}") from None
    return module


def _check_static_scale(
    quant: FP8InputQuant | None, scaled: bool, layout: str, name: str, file: str
) -> str:
    """The name of module ``name``'s static scale tensor, once its declared activations and
    whether it holds that tensor (``scaled``) agree; else a CheckpointError naming both."""
    static = quant is not None and not quant.dynamic
    key = f"{name}.{static_scale_key(layout)}"
    if static and not scaled:
        raise CheckpointError(
            f"load: {name} in {file}: the quantization_config declares static FP8 activations, "
            f"but {key} (the static scale they need) is missing"
        )
    if scaled and not static:
        raise CheckpointError(
            f"load: {name} in {file}: {key} is a static activation scale, but the "
            f"quantization_config declares {quant.describe() if quant else 'weight-only'} "
            f"activations for the module"
        )
    return key


def describe_declared_activations(
    decision: LayoutDecision,
    qconfig: Mapping[str, Any] | None,
    fp8_modules: Iterable[str],
    *,
    policy: str | None = None,
    static: frozenset[str] = frozenset(),
) -> str:
    """What ``inspect`` shows: the declared activations of the checkpoint's FP8 modules
    (``fp8 e4m3 dynamic per token``, ``fp8 e4m3 static per tensor``), a GPTQ W4A policy's mode,
    or :data:`WEIGHT_ONLY`. ``static``: the FP8 modules holding a static activation scale.

    Raises:
      CheckpointError: as :func:`declared_input_quant` (inspect refuses what load refuses).
    """
    stand_in = nn.Linear(1, 1, device="meta")  # what compressed-tensors' "Linear" target names
    file = f"{decision.evidence.split(':')[0]}"
    counts: dict[str, int] = {}
    names = list(fp8_modules)
    for name in names:
        scaled = name in static
        quant = declared_input_quant(decision, qconfig, name, stand_in, file, scaled=scaled)
        _check_static_scale(quant, scaled, decision.layout, name, file)
        label = quant.describe() if quant is not None else WEIGHT_ONLY
        counts[label] = counts.get(label, 0) + 1
    if policy is not None:
        counts[f"{policy} (the W4A activation policy)"] = 0
    if not counts:
        return WEIGHT_ONLY
    if len(counts) == 1:
        return next(iter(counts))
    return "; ".join(
        f"{label} on {n} of {len(names)} FP8 modules" if n else label for label, n in counts.items()
    )


def refuse_activation_scales(decision: LayoutDecision, names: Sequence[str], root: Path) -> None:
    """Refuse checkpoints whose tensors carry activation-quantization scales floatxq does not run.

    floatxq runs weight-only sources, dynamic FP8 activations, static FP8 activations per tensor
    (:mod:`floatxq.interop.fp8_static`) and NVFP4 W4A4 (:mod:`floatxq.interop.nvfp4_w4a4`); any
    other activation scale is part of the producer's numerics that floatxq would drop, so it is
    refused rather than run differently (each module's scale is checked against its declaration
    when the module is read).

    Raises:
      CheckpointError: naming the first such tensor and the layout.
    """
    runs = nvfp4_w4a4_scale_names(decision.layout, names)
    runs |= fp8_static_scale_names(decision.layout, names)
    found = [n for n in names if n.endswith(ACTIVATION_SCALE_SUFFIXES) and n not in runs]
    if not found:
        return
    raise CheckpointError(
        f"load: {root} ({decision.layout}) carries activation-quantization scales, e.g. "
        f"{found[0]!r} ({len(found)} tensors); floatxq runs static activation scales only on FP8 "
        f"modules (per tensor: compressed-tensors / ModelOpt input_scale, transformers' "
        f"activation_scale) and NVFP4 W4A4 modules, besides weight-only and dynamic FP8"
    )


def refuse_dropped_activations(layout: str, name: str, module: nn.Module, read: Any) -> None:
    """A save must not drop (or change) a module's declared activations: ``read`` is the module
    the layout's files load back as.

    Raises:
      ValueError: naming the module, its activations, what the layout would declare instead and
        the layout that holds them (``compressed-tensors``).
    """
    mine = getattr(module, "input_quant", None)
    theirs = getattr(read, "input_quant", None)
    if mine is not None and not mine.dynamic and theirs == mine:
        kept, back = module.input_scale, read.input_scale
        if torch.equal(kept.float().cpu().view(torch.int32), back.float().cpu().view(torch.int32)):
            return
        raise ValueError(
            f"export: layout {layout!r} cannot hold module {name!r} bit for bit: its static "
            f"input_scale {float(kept)!r} would load as {float(back)!r}"
        )
    if mine is None or theirs == mine:
        return
    raise ValueError(
        f"export: layout {layout!r} cannot hold module {name!r}: it runs {mine.describe()} "
        f"activations, which the layout's files would load as "
        f"{theirs.describe() if theirs is not None else 'weight-only'}; layouts that hold it: "
        f"'compressed-tensors'"
    )


def ct_input_activations(quant: FP8InputQuant | None) -> dict[str, Any] | None:
    """compressed-tensors' ``input_activations`` for ``quant`` (``None``: weight-only), the
    QuantizationArgs llm-compressor writes for ``FP8_DYNAMIC`` (``token``), ``FP8_BLOCK`` and
    ``FP8`` (``static``: per tensor, ``dynamic: false``, each module's ``input_scale``).

    Example:
      >>> ct_input_activations(FP8InputQuant("static"))["dynamic"]
      False
    """
    if quant is None:
        return None
    static = not quant.dynamic
    return {
        "num_bits": 8,
        "type": "float",
        "symmetric": True,
        "group_size": quant.group_size,
        "strategy": "tensor" if static else quant.strategy,
        "dynamic": not static,
    }
