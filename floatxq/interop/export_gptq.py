"""GPTQ modules in a checkpoint: GPT-QModel's ``gptq`` files and compressed-tensors'
``pack-quantized`` tensors, each written only after checking that the config describes the module
as its readers will take it. :func:`floatxq.interop.export.export_layout` calls these; the
layouts' table and the zero-point rules are in ``docs/interop.md``.

Numerics: GPTQ words are written unchanged; zero words are converted between ``gptq`` (v1) and
``gptq_v2`` by exact integer arithmetic; ``gptq`` scales are float16 only when that is exact.
"""

from typing import Any, NamedTuple

import torch
from torch import nn

from floatxq._typing import Float, Int32, Tensor
from floatxq.config import GPTQConfig
from floatxq.formats import ACTIVATION_SCALE_BITS
from floatxq.interop.checkpoint import CheckpointError
from floatxq.w4a.activation import global_scale_bits_problem

__all__ = ["STREAM_SCALES_MODULE", "output_embedding_names"]

STREAM_SCALES_MODULE = "w4a_stream_scales"
"""The name under which an installed Llama W4A stream registers each layer's producer-scale
holder (:class:`floatxq.lifecycle.stream.StreamScales`). Its buffers are never written: they are
the activation policy's ``global_scales``, which the ``gptq`` files carry in their config."""


def _refuse(layout: str, name: str, what: str, why: str, held: list[str]) -> ValueError:
    """The ValueError of every layout that cannot hold a module: the module and who holds it."""
    where = ", ".join(repr(n) for n in held)
    return ValueError(
        f"export: layout {layout!r} cannot hold module {name!r} ({what}): {why}; layouts that "
        f"hold it: {where}"
    )


class _GptqFacts(NamedTuple):
    """What a GPTQ module's tensors hold beyond its bits and group size (read from its buffers)."""

    symmetric: bool
    """Every zero point is ``2**(bits-1)``."""
    contiguous: bool
    """``g_idx`` is ``arange(in) // group_size`` (all 0 for ``group_size=-1``): no ``desc_act``
    reordering of the groups."""
    zero_at: tuple[int, int] | None
    """``(group, output column)`` of the first logical zero point equal to 0, or None."""


def _gptq_facts(module: nn.Module, name: str | None = None) -> _GptqFacts:
    """What ``module``'s buffers hold. Buffers that cannot be unpacked (NaN or infinite scales,
    words of the wrong shape; floatxq.load refuses them too) raise a CheckpointError (a
    ValueError) naming module ``name``, when given. A module without values (meta buffers, an
    offloaded run's plan) gives the facts it was planned with (its ``planned_facts``)."""
    if module.qzeros.is_meta:
        planned = getattr(module, "planned_facts", None)
        if not isinstance(planned, _GptqFacts):
            raise ValueError(f"export: module {name!r} has no values (meta) and no planned facts")
        return planned
    try:
        zeros = module.unpacked().zeros
    except ValueError as exc:
        if name is None:
            raise
        raise CheckpointError(f"export: module {name!r} cannot be written: {exc}") from None
    symmetric = bool((zeros == (1 << (module.bits - 1))).all())
    rows = torch.arange(module.in_features, device=module.g_idx.device, dtype=torch.int64)
    expected = rows * 0 if module.group_size == -1 else rows // module.group_size
    contiguous = torch.equal(module.g_idx.to(torch.int64), expected)
    found = (zeros == 0).nonzero()
    zero_at = (int(found[0, 0]), int(found[0, 1])) if found.numel() else None
    return _GptqFacts(symmetric, contiguous, zero_at)


def _describe_gptq(module: nn.Module) -> str:
    groups = "one group per row" if module.group_size == -1 else f"groups of {module.group_size}"
    return f"GPTQ {module.bits}-bit weights, {groups}"


def _ct_holds_gptq(module: nn.Module, facts: _GptqFacts) -> str | None:
    """Why compressed-tensors' ``pack-quantized`` cannot hold a GPTQ module, or None."""
    if not facts.contiguous:
        return (
            "its g_idx reorders the groups (desc_act), and compressed-tensors stores no g_idx "
            "(its actorder='group' was removed)"
        )
    if module.group_size != -1 and module.in_features % module.group_size:
        return (
            f"in_features={module.in_features} is not a multiple of group_size="
            f"{module.group_size}, and compressed-tensors' group strategy needs whole groups"
        )
    return None


def _gptq_layouts(module: nn.Module, facts: _GptqFacts) -> list[str]:
    """The layouts that hold a GPTQ module."""
    held = ["gptq", "gptqmodel"]
    if _ct_holds_gptq(module, facts) is None:
        held.append("compressed-tensors")
    return held


def _v2_zero_words(module: nn.Module) -> Int32[Tensor, "groups words"]:
    """The module's ``qzeros`` in the ``gptq_v2`` convention (the logical zero in every field)."""
    from floatxq.gptq.int4 import convert_gptq_format

    if module.format == "gptq_v2":
        return module.qzeros
    packed = convert_gptq_format(
        module.packed(), source=module.format, target="gptq_v2", bits=module.bits
    )
    return packed.qzeros


def _float16_scales(name: str, scales: Float[Tensor, "groups out"]) -> Tensor:
    """``scales`` as float16 when that conversion is exact, else a ValueError naming the module."""
    if scales.dtype == torch.float16:
        return scales
    half = scales.to(torch.float16)
    if not torch.equal(half.to(scales.dtype), scales):
        lost = half.to(scales.dtype) != scales
        raise ValueError(
            f"export: layout 'gptq' stores float16 scales, and module {name!r} holds "
            f"{scales.dtype} scales that float16 cannot hold exactly (such as "
            f"{scales[lost][:3].tolist()}); layouts that keep them: 'compressed-tensors'"
        )
    return half


def _gptq_module_tensors(
    name: str, module: nn.Module, resolved: GPTQConfig | None, fmt: str, heads: set[str]
) -> dict[str, Tensor]:
    """One module's tensors in the ``gptq`` layout, after checking the config describes them."""
    from floatxq.gptq.int4 import convert_gptq_format

    what = _describe_gptq(module)
    if resolved is None:
        why = "lm_head=False" if name in heads else "a '-:' dynamic rule"
        raise ValueError(
            f"export: module {name!r} holds {what}, but the quantize_config excludes it ({why}); "
            f"a reader would build it unquantized"
        )
    if (module.bits, module.group_size) != (resolved.bits, resolved.group_size):
        raise ValueError(
            f"export: module {name!r} holds {what}, but the quantize_config gives it "
            f"bits={resolved.bits}, group_size={resolved.group_size}; the saved config would "
            f"misdescribe it (add a dynamic rule for it)"
        )
    facts = _gptq_facts(module, name)
    mid = 1 << (module.bits - 1)
    if resolved.sym and not facts.symmetric:
        raise ValueError(
            f"export: module {name!r} has zero points other than {mid}, but the quantize_config "
            f"declares sym=True, which readers take as every zero point being {mid} (vLLM's "
            f"Marlin kernels then ignore qzeros); set sym=False for it"
        )
    if not resolved.desc_act and not facts.contiguous:
        raise ValueError(
            f"export: module {name!r} has a g_idx that reorders its groups, but the "
            f"quantize_config declares desc_act=False, which readers take as contiguous groups "
            f"(they ignore g_idx then); set desc_act=True for it"
        )
    if fmt == "gptq" and facts.zero_at is not None:
        group, column = facts.zero_at
        raise ValueError(
            f"export: module {name!r} has a zero point of 0 (group {group}, output column "
            f"{column}), which the v1 'gptq' format cannot store: its field would hold -1 and "
            f"borrow from the next one, which readers that add 1 per field (vLLM) misread; save "
            f"with format 'gptq_v2' (dataclasses.replace(model.quantize_config, "
            f"format='gptq_v2')) or layout 'compressed-tensors'"
        )
    qzeros = module.qzeros
    if module.format != fmt:
        qzeros = convert_gptq_format(
            module.packed(), source=module.format, target=fmt, bits=module.bits
        ).qzeros
    tensors = {
        "qweight": module.qweight,
        "qzeros": qzeros,
        "scales": _float16_scales(name, module.scales),
        "g_idx": module.g_idx,
    }
    if module.bias is not None:
        tensors["bias"] = module.bias
    return tensors


def output_embedding_names(model: nn.Module) -> set[str]:
    """The names under which ``model`` holds its output embedding (``lm_head`` and aliases)."""
    names = {"lm_head"}
    getter = getattr(model, "get_output_embeddings", None)
    head = getter() if callable(getter) else None
    if head is not None:
        names.update(n for n, m in model.named_modules() if m is head)
    return names


def _check_dynamic_activation_scale(layout: str, name: str, bits: Tensor) -> None:
    """Without an NVFP4 activation policy in the config, a W4A-NVFP4 module's activation scale is
    not written: the checkpoint is ordinary GPTQ. That loses nothing while the scale is 0.0
    (derived per call); a calibrated one is refused rather than dropped."""
    if int(bits) != 0:
        value = float(bits.view(torch.float32))
        raise ValueError(
            f"export: layout {layout!r} writes ordinary GPTQ tensors here; {name} holds a "
            f"calibrated activation global scale ({value!r}) but the config has no NVFP4 "
            f"activation policy to save it with. Give the config one (GPTQConfig.activation, "
            f"mode 'w4a_nvfp4') or set {ACTIVATION_SCALE_BITS} to 0 (dynamic)"
        )


def stream_scale_entry(
    model: nn.Module, key: str, tensor: Tensor, config: Any, layout: str
) -> bool:
    """Whether ``key`` is a stream producer scale (left out of the files), after checking that
    ``config``'s activation policy carries it: a calibrated scale is refused rather than dropped.

    Raises:
      ValueError: a producer scale that is neither 0.0 (dynamic) nor positive and finite, or a
        calibrated one that ``config.activation.global_scales`` lacks or holds with another FP32
        value.
    """
    prefix, _, leaf = key.rpartition(".")
    if prefix.rpartition(".")[2] != STREAM_SCALES_MODULE:
        return False
    if int(tensor) == 0:
        return True  # dynamic: nothing to keep
    value = float(tensor.view(torch.float32))
    producer = getattr(model.get_submodule(prefix), "producers", {}).get(leaf, key)
    why = global_scale_bits_problem(tensor)
    if why is not None:
        raise ValueError(
            f"export: layout {layout!r}: the installed W4A stream's {key} (producer "
            f"{producer!r}) is no activation global scale floatxq.load accepts: {why}"
        )
    activation = getattr(config, "activation", None)
    scales = getattr(activation, "global_scales", None) or {}
    stored = scales.get(producer)
    if stored is None or float(torch.tensor(stored, dtype=torch.float32)) != value:
        raise ValueError(
            f"export: layout {layout!r}: the installed W4A stream holds a calibrated scale "
            f"{value!r} for producer {producer!r}, but the quantize_config's activation "
            f"global_scales give it {stored!r}; the files carry the config's scales only. "
            f"Calibrate with QuantizedModel.calibrate_activations (it updates both) or put the "
            f"stream's scales in the config"
        )
    return True


def _check_no_activation_policy(layout: str, config: Any) -> None:
    """Only GPT-QModel's GPTQ files carry a W4A activation policy; other layouts would drop it."""
    activation = getattr(config, "activation", None)
    if isinstance(config, GPTQConfig) and activation is not None:
        raise ValueError(
            f"export: layout {layout!r} holds weight-only GPTQ; this model's config has a W4A "
            f"activation policy (mode {activation.mode!r}) that it would drop; save with layout "
            f"'gptq' (GPT-QModel's files carry the policy and its scales)"
        )


def _gptq_ct_tensors(name: str, module: nn.Module, facts: _GptqFacts) -> dict[str, Tensor]:
    """One GPTQ module as compressed-tensors ``pack-quantized`` tensors."""
    why = _ct_holds_gptq(module, facts)
    if why is not None:
        raise _refuse(
            "compressed-tensors", name, _describe_gptq(module), why, _gptq_layouts(module, facts)
        )
    tensors = {
        "weight_packed": module.qweight.T.contiguous(),
        "weight_scale": module.scales.T.contiguous(),
        "weight_shape": torch.tensor([module.out_features, module.in_features], dtype=torch.int64),
    }
    if not facts.symmetric:
        tensors["weight_zero_point"] = _v2_zero_words(module).T.contiguous()
    if module.bias is not None:
        tensors["bias"] = module.bias
    return tensors


def _ct_int_weights(bits: int, group_size: int, symmetric: bool) -> dict[str, Any]:
    weights: dict[str, Any] = {
        "num_bits": bits,
        "type": "int",
        "symmetric": symmetric,
        "group_size": None if group_size == -1 else group_size,
        "strategy": "channel" if group_size == -1 else "group",
        "dynamic": False,
    }
    if not symmetric:
        weights["zp_dtype"] = "torch.int8"
    return weights


def _gptq_state(
    model: nn.Module, modules: list[tuple[str, nn.Module]], config: GPTQConfig, layout: str
) -> dict[str, Tensor]:
    """``model.state_dict()`` with each GPTQ module's tensors in the ``gptq`` layout; a W4A-NVFP4
    module's activation scale kept only under an NVFP4 activation policy."""
    heads = output_embedding_names(model)
    replaced: dict[str, dict[str, Tensor]] = {}
    for name, module in modules:
        resolved = config.resolve(name) if name not in heads or config.lm_head else None
        replaced[name] = _gptq_module_tensors(name, module, resolved, config.format, heads)
    keeps_scales = config.activation is not None and config.activation.mode == "w4a_nvfp4"
    state: dict[str, Tensor] = {}
    for key, tensor in model.state_dict().items():
        if stream_scale_entry(model, key, tensor, config, layout):
            continue
        prefix, _, leaf = key.rpartition(".")
        if leaf == ACTIVATION_SCALE_BITS and not keeps_scales:
            _check_dynamic_activation_scale(layout, prefix, tensor)
            continue
        state[key] = replaced.get(prefix, {}).get(leaf, tensor)
    return state
