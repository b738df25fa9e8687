"""Will a save in this layout hold the model? Answered before any work, from the quantize config
and the model's modules.

:func:`check_layout` predicts, module by module, what :meth:`QuantizedModel.quantize` will make
of each linear (the FP8 plan of :func:`~floatxq.lifecycle.fp8.plan_fp8`, the GPTQ plan of
:func:`~floatxq.lifecycle.gptq.plan_gptq`; modules already quantized are read as they are) and
refuses, with the message :func:`~floatxq.interop.export.export_layout` would give after the
work, every method × layout × module combination a layout cannot hold (``docs/interop.md``):

* ``hf``: float8_e4m3fn linear weights with tensor or block scales, one scale layout for the
  whole model; no NVFP4, no GPTQ, no W4A activation policy.
* ``compressed-tensors``: float8_e4m3fn linear FP8 weights (no E5M2 / ``fnuz``, no
  convolutions), NVFP4, GPTQ without ``desc_act`` group reordering; no W4A activation policy.
* ``gptq``: GPTQ modules only, from a ``GPTQConfig`` (a W4A policy is carried).
* ``gptqmodel``: the ``gptq`` files for a GPTQ model; every FP8 module for an FP8 model; no NVFP4.
* ``modelopt``: NVFP4 modules only (weight-only and W4A4); no FP8, no GPTQ, no W4A policy.

What depends on the solved numbers (a v1 zero point of 0, scales float16 cannot hold, tensors
``load`` would refuse) is still checked by the save itself.
"""

from typing import Any, NamedTuple

from torch import nn
from torch.nn.modules.conv import _ConvNd

from floatxq.config import FP8Config, GPTQConfig, NVFP4Config
from floatxq.interop.export import (
    DEFAULT_LAYOUT,
    CheckpointLayout,
    normalize_layout,
)
from floatxq.nn.fp8_linear import TorchFP8Linear

_E4M3 = "float8_e4m3fn"
_NVFP4_HELD = ("compressed-tensors", "modelopt")


class _Planned(NamedTuple):
    """One module as the save will find it."""

    name: str
    kind: str
    """``"fp8"``, ``"nvfp4"`` or ``"gptq"``."""
    what: str
    """How a refusal describes it."""
    held: tuple[str, ...]
    """The layouts that hold it."""
    scheme: Any = None
    """FP8: ``(scale method, block size)`` (``hf`` writes one for the whole model); NVFP4:
    whether it is W4A4 (``modelopt`` holds W4A4 or weight-only NVFP4 modules, not both)."""


def _fp8(name: str, fmt: str, method: str, block: Any, conv: bool) -> _Planned:
    plain = fmt == _E4M3 and not conv
    held = (
        *(("compressed-tensors",) if plain else ()),
        *(("hf",) if plain and method in ("tensor", "block") else ()),
        "gptqmodel",
    )
    scales = f"block scales {list(block)}" if block is not None else f"{method} scales"
    what = f"{fmt} weights with {scales}" + (", a convolution" if conv else "")
    return _Planned(name, "fp8", what, held, (method, block if method == "block" else None))


def _gptq(name: str, bits: int, group: int, reordered: bool) -> _Planned:
    groups = "one group per row" if group == -1 else f"groups of {group}"
    what = f"GPTQ {bits}-bit weights, {groups}" + (", desc_act reordering" if reordered else "")
    held = ("gptq", "gptqmodel", *(() if reordered else ("compressed-tensors",)))
    return _Planned(name, "gptq", what, held)


def _existing(model: nn.Module) -> dict[str, _Planned]:
    """The modules already quantized (a loaded checkpoint, a native source), as they are."""
    from floatxq.nn.fp4_linear import TorchFP4Linear
    from floatxq.nn.gptq_linear import GPTQLinear

    found: dict[str, _Planned] = {}
    for name, module in model.named_modules(remove_duplicate=False):
        if isinstance(module, TorchFP8Linear):
            method = module.weight_scale_method
            block = module.weight_block_size if method == "block" else None
            found[name] = _fp8(name, module.format, method, block, module.conv is not None)
        elif isinstance(module, TorchFP4Linear):
            w4a4 = getattr(module, "input_scale", None) is not None
            what = "NVFP4 weights and activations (W4A4)" if w4a4 else "NVFP4 weights"
            found[name] = _Planned(name, "nvfp4", what, _NVFP4_HELD, w4a4)
        elif isinstance(module, GPTQLinear):
            from floatxq.interop.export_gptq import _gptq_facts

            facts = _gptq_facts(module, name)
            found[name] = _gptq(name, module.bits, module.group_size, not facts.contiguous)
    return found


def _planned(model: nn.Module, config: Any) -> dict[str, _Planned]:
    """Every quantized module the save will find once ``config`` has been applied."""
    found = _existing(model)
    modules = dict(model.named_modules())
    if isinstance(config, FP8Config):
        from floatxq.lifecycle.fp8 import plan_fp8

        for plan in plan_fp8(model, config):
            cfg = plan.config
            if cfg is None:
                continue
            conv = isinstance(modules[plan.name], _ConvNd)
            block = cfg.weight_block_size if cfg.weight_scale_method == "block" else None
            found[plan.name] = _fp8(plan.name, cfg.format, cfg.weight_scale_method, block, conv)
    elif isinstance(config, NVFP4Config):
        from floatxq.lifecycle.nvfp4 import plan_nvfp4

        for plan in plan_nvfp4(model, config):
            if plan.config is not None:
                found[plan.name] = _Planned(plan.name, "nvfp4", "NVFP4 weights", _NVFP4_HELD)
    elif isinstance(config, GPTQConfig):
        from floatxq.lifecycle.decoder import features
        from floatxq.lifecycle.gptq import plan_gptq

        for plan in plan_gptq(model, config):  # refuses unpackable modules itself
            cfg = plan.config
            if cfg is None:
                continue
            k, _ = features(modules[plan.name])
            reordered = bool(cfg.desc_act) and cfg.group_size != -1 and k > cfg.group_size
            found[plan.name] = _gptq(plan.name, cfg.bits, cfg.group_size, reordered)
    return found


def _refuse(where: str, layout: str, module: _Planned, why: str) -> ValueError:
    held = ", ".join(repr(n) for n in module.held)
    return ValueError(
        f"{where}: layout {layout!r} cannot hold module {module.name!r} ({module.what}): {why}; "
        f"layouts that hold it: {held}"
    )


def _check_gptq_layout(where: str, layout: str, found: list[_Planned], config: Any) -> None:
    for module in found:
        if module.kind != "gptq":
            raise _refuse(where, layout, module, "it holds GPTQ modules only")
    if not found:
        raise ValueError(
            f"{where}: layout {layout!r} describes quantized modules, and with this "
            f"quantize_config no module would be quantized (every linear is excluded)"
        )
    if not isinstance(config, GPTQConfig):
        raise ValueError(
            f"{where}: layout {layout!r} writes GPT-QModel's GPTQ payload from a GPTQConfig; "
            f"this model's quantize_config is {type(config).__name__}"
        )


_MODELOPT_WHY = "floatxq writes ModelOpt's NVFP4 layout, which holds NVFP4 modules only"


def _check_flat_layout(where: str, layout: str, found: list[_Planned], config: Any) -> None:
    """``hf``, ``compressed-tensors`` and ``modelopt``."""
    if not found:
        raise ValueError(
            f"{where}: layout {layout!r} describes quantized modules, and with this "
            f"quantize_config no module would be quantized (every linear is excluded)"
        )
    activation = getattr(config, "activation", None)
    if isinstance(config, GPTQConfig) and activation is not None and layout != "modelopt":
        raise ValueError(
            f"{where}: layout {layout!r} holds weight-only GPTQ; this config has a W4A "
            f"activation policy (mode {activation.mode!r}) that it would drop; save with layout "
            f"'gptq' (or 'gptqmodel'), which carry the policy and its scales"
        )
    why = {
        ("hf", "gptq"): "transformers' fine-grained FP8 holds FP8 weights only",
        ("hf", "nvfp4"): "transformers' fine-grained FP8 holds FP8 weights only",
        ("hf", "fp8"): "transformers' fine-grained FP8 holds float8_e4m3fn linear weights with "
        "tensor or block scales",
        ("compressed-tensors", "fp8"): "compressed-tensors' float-quantized FP8 holds "
        "float8_e4m3fn linear weights",
        ("compressed-tensors", "gptq"): "desc_act reorders the groups (g_idx), and "
        "compressed-tensors stores no g_idx",
        ("modelopt", "gptq"): _MODELOPT_WHY,
        ("modelopt", "fp8"): _MODELOPT_WHY + " (ModelOpt's FP8 is static W8A8, whose readers "
        "need an input_scale)",
    }
    for module in found:
        if layout not in module.held:
            raise _refuse(where, layout, module, why.get((layout, module.kind), "unsupported"))
    w4a4 = [m.name for m in found if m.kind == "nvfp4" and m.scheme is True]
    weight_only = [m.name for m in found if m.kind == "nvfp4" and m.scheme is not True]
    if layout == "modelopt" and w4a4 and weight_only:
        raise ValueError(
            f"{where}: layout 'modelopt' cannot hold module {weight_only[0]!r} (NVFP4 weights, "
            f"weight-only): the model mixes it with W4A4 modules (e.g. {w4a4[0]!r}), and "
            f"floatxq.load runs ModelOpt W4A4 only as quant_algo NVFP4 on every NVFP4 module; "
            f"layouts that hold it: 'compressed-tensors'"
        )
    if layout == "hf":
        first = found[0]
        for module in found[1:]:
            if module.scheme != first.scheme:
                raise ValueError(
                    f"{where}: layout 'hf' writes one weight_block_size for the whole model "
                    f"(transformers' fine-grained FP8), but module {first.name!r} would have "
                    f"{first.what} and module {module.name!r} {module.what}; layouts that hold "
                    f"both: 'compressed-tensors', 'gptqmodel'"
                )


def check_layout(
    model: Any,
    quantize_config: FP8Config | GPTQConfig | NVFP4Config | None = None,
    layout: str | None = None,
    *,
    where: str = "layout",
) -> CheckpointLayout:
    """Refuse, before any work, a save ``layout`` that cannot hold what quantizing gives.

    Args:
      model: an ``nn.Module`` or a :class:`~floatxq.lifecycle.model.QuantizedModel` (quantized
        or not; its ``quantize_config`` is the default config).
      quantize_config: the ``FP8Config`` / ``GPTQConfig`` the model will be (or was) quantized
        with; None takes the ``QuantizedModel``'s.
      layout: a name :func:`~floatxq.interop.export.normalize_layout` accepts; None is the
        default a save picks (``"gptq"`` for a config with a W4A activation policy, else
        ``"compressed-tensors"``).
      where: the prefix of the messages (``"quantize"``, ``"save"``, ...).

    Returns:
      The canonical layout name.

    Raises:
      ValueError: an unknown layout; a module the layout cannot hold (named, with what it would
        be and the layouts that hold it); an activation policy outside ``gptq`` / ``gptqmodel``;
        ``hf`` over FP8 modules of different scale layouts; no module to quantize; a GPTQ
        target no checkpoint packs (as :func:`~floatxq.lifecycle.gptq.plan_gptq`).
      TypeError: a layout that is not a string, or a config of another kind.

    Numerics: names and shapes only; nothing is quantized or changed.

    Example:
      >>> check_layout(model, GPTQConfig(bits=4), "hf")  # doctest: +SKIP
      ValueError: layout: layout 'hf' cannot hold module 'model.layers.0.self_attn.q_proj' ...
    """
    config = quantize_config
    module = model
    if not isinstance(model, nn.Module) and hasattr(model, "quantize_config"):
        config = config if config is not None else model.quantize_config
        module = model.model
    if not isinstance(module, nn.Module):
        raise TypeError(
            f"{where}: expected an nn.Module or a QuantizedModel, got {type(model).__name__}"
        )
    if config is not None and not isinstance(config, (FP8Config, GPTQConfig, NVFP4Config)):
        raise TypeError(
            f"{where}: quantize_config must be an FP8Config, a GPTQConfig, an NVFP4Config or "
            f"None, got {type(config).__name__}"
        )
    if layout is None:
        layout = DEFAULT_LAYOUT if getattr(config, "activation", None) is None else "gptq"
    name = normalize_layout(layout)
    quantized = bool(getattr(model, "quantized", False))
    found = list((_existing(module) if quantized else _planned(module, config)).values())
    gptq = [m for m in found if m.kind == "gptq"]
    if name == "gptq" or (name == "gptqmodel" and gptq):
        _check_gptq_layout(where, name, found, config)
    elif name == "gptqmodel":
        if not isinstance(config, FP8Config):
            raise ValueError(
                f"{where}: layout 'gptqmodel' writes GPT-QModel's FP8 payload from an "
                f"FP8Config (or the gptq files of a GPTQ model); this quantize_config is "
                f"{type(config).__name__} and no module would be quantized"
            )
        for planned in found:
            if planned.kind == "nvfp4":
                why = "GPT-QModel's FP8 payload describes FP8 modules only"
                raise _refuse(where, name, planned, why)
    else:
        _check_flat_layout(where, name, found, config)
    return name


__all__ = ["check_layout"]
