"""The activation scheme a checkpoint declares for its FP8 modules, read once for load and inspect.

vLLM serves a checkpoint with the activation quantization its metadata declares; floatxq reads
the same declaration so its modules compute what is served:

* compressed-tensors: each config group's ``input_activations`` (the groups whose ``targets``
  name the module). Dynamic E4M3 per ``token`` (llm-compressor's ``FP8_DYNAMIC``), per ``group``
  (``FP8_BLOCK``: 1×128) and per ``tensor`` are read; ``null`` is weight-only.
* transformers' fine-grained FP8 (``quant_method: fp8``): ``activation_scheme: dynamic`` (its
  default) quantizes each token per ``weight_block_size[1]`` columns (the whole row without a
  block size).
* GPT-QModel's / floatxq's FP8 payload (``gptqmodel``), ModelOpt, Quark: weight-only (their
  activation scales, when present, are refused by :func:`floatxq.interop.readers.
  refuse_activation_scales`).

Refused, for load and inspect alike (:class:`~floatxq.interop.checkpoint.CheckpointError`):
static activation quantization, activations other than 8-bit float, asymmetric activations,
``output_activations``, and schemes that differ between the groups naming one module.
"""

import functools
from collections.abc import Iterable, Mapping
from typing import Any

from torch import nn

from floatxq.config.rules import RulePattern, _check_rule_pattern
from floatxq.fp8_activation import FP8InputQuant
from floatxq.interop.checkpoint import CheckpointError
from floatxq.interop.layouts import LayoutDecision
from floatxq.nn.fp8_linear import TorchFP8Linear

__all__ = [
    "WEIGHT_ONLY",
    "ct_input_activations",
    "declared_input_quant",
    "describe_declared_activations",
    "refuse_dropped_activations",
    "with_declared_activations",
]

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
        raise CheckpointError(
            f"load: {where} declares static activation quantization (dynamic: {dynamic!r}); "
            f"floatxq runs weight-only and dynamic FP8 activations only"
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
) -> FP8InputQuant | None:
    """The dynamic FP8 activations ``qconfig`` declares for FP8 module ``name`` (the module
    docstring's table), ``None`` for weight-only.

    Raises:
      CheckpointError: a declaration floatxq does not run (the module docstring lists them).

    Numerics: none; metadata only.
    """
    qconfig = qconfig or {}
    if decision.layout == "compressed-tensors":
        return _ct_declared(qconfig, name, original, file)
    if decision.layout != "hf":
        return None
    scheme = _lower(qconfig.get("activation_scheme", "dynamic"))
    if scheme != "dynamic":
        raise CheckpointError(
            f"load: {file} quantization_config activation_scheme is "
            f"{qconfig.get('activation_scheme')!r}; floatxq runs transformers' fine-grained FP8 "
            f"with dynamic activations only"
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
) -> nn.Module:
    """``module`` (a just-read FP8 module) with the activations its checkpoint declares.

    Raises:
      CheckpointError: as :func:`declared_input_quant`, or a group size that does not divide the
        module's ``in_features``.
    """
    if not isinstance(module, TorchFP8Linear):
        return module
    quant = declared_input_quant(decision, qconfig, name, original, file)
    try:
        module.input_quant = quant
    except ValueError as exc:
        raise CheckpointError(f"load: {name} in {file}: {exc}") from None
    return module


def describe_declared_activations(
    decision: LayoutDecision,
    qconfig: Mapping[str, Any] | None,
    fp8_modules: Iterable[str],
    *,
    policy: str | None = None,
) -> str:
    """What ``inspect`` shows: the declared activations of the checkpoint's FP8 modules
    (``fp8 e4m3 dynamic per token``), a GPTQ W4A policy's mode, or :data:`WEIGHT_ONLY`.

    Raises:
      CheckpointError: as :func:`declared_input_quant` (inspect refuses what load refuses).
    """
    stand_in = nn.Linear(1, 1, device="meta")  # what compressed-tensors' "Linear" target names
    file = f"{decision.evidence.split(':')[0]}"
    counts: dict[str, int] = {}
    names = list(fp8_modules)
    for name in names:
        quant = declared_input_quant(decision, qconfig, name, stand_in, file)
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


def refuse_dropped_activations(layout: str, name: str, module: nn.Module, read: Any) -> None:
    """A save must not drop (or change) a module's declared activations: ``read`` is the module
    the layout's files load back as.

    Raises:
      ValueError: naming the module, its activations, what the layout would declare instead and
        the layout that holds them (``compressed-tensors``).
    """
    mine = getattr(module, "input_quant", None)
    if mine is None or getattr(read, "input_quant", None) == mine:
        return
    theirs = getattr(read, "input_quant", None)
    raise ValueError(
        f"export: layout {layout!r} cannot hold module {name!r}: it runs {mine.describe()} "
        f"activations, which the layout's files would load as "
        f"{theirs.describe() if theirs is not None else 'weight-only'}; layouts that hold it: "
        f"'compressed-tensors'"
    )


def ct_input_activations(quant: FP8InputQuant | None) -> dict[str, Any] | None:
    """compressed-tensors' ``input_activations`` for ``quant`` (``None``: weight-only), the
    QuantizationArgs llm-compressor writes for ``FP8_DYNAMIC`` (``token``) and ``FP8_BLOCK``.

    Example:
      >>> ct_input_activations(FP8InputQuant("token"))["strategy"]
      'token'
    """
    if quant is None:
        return None
    return {
        "num_bits": 8,
        "type": "float",
        "symmetric": True,
        "group_size": quant.group_size,
        "strategy": quant.strategy,
        "dynamic": True,
    }
