"""Checkpoint layouts: the tensors and payloads a save writes for each reader of FP8 / NVFP4 / GPTQ
files.

floatxq keeps FP8 weights with INVERSE scales (``weight_scale_inv``: decode divides). Other
readers multiply, and transformers reads ``quant_method: "fp8"`` with a ``weight_scale_inv`` as
its own fine-grained FP8, where that tensor multiplies: GPT-QModel's files loaded there decode
silently wrong. So a save picks a layout, and each layout writes what its reader expects:

* ``compressed-tensors`` (default): E4M3 weights with tensor, row or block scales
  (``float-quantized``) and NVFP4 modules (``nvfp4-pack-quantized``), both at once as
  ``mixed-precision``. Read by transformers (with the compressed-tensors package), vLLM, SGLang.
* ``hf``: transformers' / DeepSeek's fine-grained FP8: E4M3 weights with tensor scales, or with
  block scales of one block size for the whole model. Read by transformers (vLLM reads the block
  form; it takes per-tensor ``fp8`` scales under another name, ``weight_scale``).
* ``gptqmodel``: every FP8 module floatxq holds, byte for byte (inverse scales). Read by floatxq
  and GPT-QModel. For a GPTQ model it writes the ``gptq`` files.
* ``gptq``: GPTQ modules (``GPTQLinear``) byte for byte in GPT-QModel's layout (``qweight``,
  ``qzeros``, float16 ``scales``, ``g_idx``), ``quant_method: "gptq"`` with ``checkpoint_format``
  the config's format. Read by GPT-QModel, transformers (through GPT-QModel), vLLM and floatxq.

``gptqmodel`` writes the model's own tensors and GPT-QModel's payload; its ``config.json``
``quantization_config`` also carries ``activation_scheme`` = :data:`GPTQMODEL_REFUSAL_MARKER`,
a value transformers and vLLM reject (``Activation scheme ... not supported``) before they read a
weight, so neither loads those files wrong. floatxq and GPT-QModel read ``quantize_config.json``
first. A model that a layout cannot hold is refused with a ``ValueError`` naming the module and
the layouts that hold it, never written approximately.

GPTQ modules in ``compressed-tensors`` are ``pack-quantized`` INT weights: ``weight_packed`` is
``qweight`` transposed (the same words: compressed-tensors packs ``32/bits`` consecutive input
values per int32, lowest first, as ``q + 2**(bits-1)``, which is the GPTQ code), ``weight_scale``
is ``scales`` transposed, ``weight_zero_point`` the v2 ``qzeros`` transposed (asymmetric modules
only; a symmetric module's zero points are all ``2**(bits-1)`` and are not written), and
``weight_shape`` the ``(out, in)`` shape. compressed-tensors has no ``g_idx`` any more (its
``actorder="group"`` was removed) and needs ``in`` divisible by the group size, so ``desc_act``
modules and ragged groups are refused there. Mixed FP8 / NVFP4 / GPTQ models are written as
``mixed-precision`` (one config group per scheme); ``gptq`` and ``hf`` refuse them. The
``docs/interop.md`` GPTQ section says why v1 zero points of 0 are refused.

Bias: ``TorchFP8Linear`` stores its bias in float16 and casts it to the input's dtype per call;
``hf`` and ``compressed-tensors`` write every quantized module's bias in the model's dtype (the
floating dtype holding most of the model's parameters, which is what transformers loads a dense
bias into), so a loaded model adds the bias floatxq adds when it runs in that dtype. ``gptqmodel``
keeps the stored float16 bias. GPTQ modules keep their stored bias in every layout (a reader casts
it to the model dtype when it loads it, as ``GPTQLinear`` does on every call).

Numerics: codes and NVFP4 bytes are written unchanged. Scales that multiply are the FP32
reciprocal ``fl(1/s)`` of floatxq's inverse scale ``s`` (FP8), and CT's dividing
``weight_global_scale`` is ``fl(1/g)`` of the multiplying NVFP4 tensor scale ``g``. One IEEE
division: exact when the scale is a power of two, otherwise ``|fl(1/s) - 1/s| <= 2**-24 * |1/s|``,
so a multiplying reader's FP32 decode ``fl(code * fl(1/s))`` lies within ``3 * 2**-24``
relative (about 1.5 FP32 ulp) of floatxq's ``fl(code / s)`` before both are rounded into the
model dtype: the decoded weights agree, except that an element whose exact value lies that close
to a rounding boundary of the model dtype may round one ulp apart.
"""

import typing
from collections import Counter
from collections.abc import Mapping
from typing import Any, Literal, NamedTuple

import torch
from torch import nn

from floatxq._typing import Float, Float32, Int32, Tensor
from floatxq.config import FP8Config, GPTQConfig
from floatxq.interop.payload import fp8_config_to_payload, gptq_config_to_payload
from floatxq.nn.fp8_linear import TorchFP8Linear

__all__ = [
    "CHECKPOINT_LAYOUTS",
    "DEFAULT_LAYOUT",
    "GPTQMODEL_REFUSAL_MARKER",
    "CheckpointLayout",
    "LayoutExport",
    "export_layout",
    "normalize_layout",
]

CheckpointLayout = Literal["compressed-tensors", "hf", "gptqmodel", "gptq"]
"""The checkpoint layouts a save can write (see the module docstring's table)."""
CHECKPOINT_LAYOUTS: tuple[str, ...] = typing.get_args(CheckpointLayout)
DEFAULT_LAYOUT: CheckpointLayout = "compressed-tensors"
LAYOUT_ALIASES: Mapping[str, str] = {
    "ct": "compressed-tensors",
    "compressed_tensors": "compressed-tensors",
    "transformers": "hf",
    "deepseek": "hf",
}
"""Other spellings :func:`normalize_layout` accepts, and the layout each names."""

GPTQMODEL_REFUSAL_MARKER = (
    "unsupported: weight_scale_inv here is an inverse scale (decode divides); load with floatxq "
    "or GPT-QModel"
)
"""``activation_scheme`` of a ``gptqmodel`` export's ``config.json``: readers that take
``quant_method: "fp8"`` as multiplying scales refuse this value instead of misreading the files."""

_E4M3 = "float8_e4m3fn"
_CT_METHOD = "compressed-tensors"
_CT_FLOAT_FORMAT = "float-quantized"
_CT_NVFP4_FORMAT = "nvfp4-pack-quantized"
_CT_MIXED_FORMAT = "mixed-precision"
_CT_STRATEGY = {"tensor": "tensor", "row": "channel", "block": "block"}
"""floatxq's FP8 scale method → compressed-tensors' weight strategy."""
_NVFP4_GROUP = 16
_CT_PACKED_FORMAT = "pack-quantized"


class LayoutExport(NamedTuple):
    """What a save writes for one layout.

    Fields:
      state: every tensor to write, by name; tensors not part of a quantized module are the
        model's own (``model.state_dict()``'s), the rest new tensors in the layout's names.
      quantization_config: ``config.json``'s ``quantization_config``.
      quantize_config: ``quantize_config.json``'s payload (``gptqmodel`` only), else None.
    """

    state: dict[str, Tensor]
    quantization_config: dict[str, Any]
    quantize_config: dict[str, Any] | None


def normalize_layout(value: Any) -> CheckpointLayout:
    """The canonical layout name for ``value`` (case and surrounding spaces ignored).

    Accepts ``"compressed-tensors"``, ``"hf"``, ``"gptqmodel"``, ``"gptq"`` and the aliases
    ``"ct"``, ``"compressed_tensors"`` (compressed-tensors), ``"transformers"``, ``"deepseek"``
    (hf).

    Raises:
      TypeError: ``value`` is not a string. ValueError: an unknown name (the accepted ones are
        listed).

    Numerics: names only.

    Example:
      >>> normalize_layout(" CT "), normalize_layout("transformers")
      ('compressed-tensors', 'hf')
    """
    if not isinstance(value, str):
        raise TypeError(f"layout: expected a string, got {type(value).__name__} {value!r}")
    name = str.lower(str.strip(value))
    name = LAYOUT_ALIASES.get(name, name)
    if name not in CHECKPOINT_LAYOUTS:
        accepted = ", ".join(repr(n) for n in (*CHECKPOINT_LAYOUTS, *LAYOUT_ALIASES))
        raise ValueError(f"layout: unknown checkpoint layout {value!r}; accepted: {accepted}")
    return typing.cast(CheckpointLayout, name)


# --------------------------------------------------------------------------------------------
# The model's modules
# --------------------------------------------------------------------------------------------


def _fp4_linear_class() -> type | None:
    """``TorchFP4Linear`` when its module imports (the class is looked up lazily)."""
    try:
        from floatxq.nn.fp4_linear import TorchFP4Linear
    except ImportError:
        return None
    return TorchFP4Linear


def _gptq_linear_class() -> type | None:
    """``GPTQLinear`` when its module imports (the class is looked up lazily)."""
    try:
        from floatxq.nn.gptq_linear import GPTQLinear
    except ImportError:
        return None
    return GPTQLinear


class _Modules(NamedTuple):
    """The model's quantized and dense linear modules by name, in ``named_modules`` order (a
    shared module under each of its names)."""

    fp8: list[tuple[str, TorchFP8Linear]]
    nvfp4: list[tuple[str, nn.Module]]
    quantized: list[tuple[str, nn.Module]]
    """The FP8, NVFP4 and GPTQ modules together."""
    dense: list[str]
    gptq: list[tuple[str, nn.Module]]


def _modules(model: nn.Module) -> _Modules:
    fp4_class, gptq_class = _fp4_linear_class(), _gptq_linear_class()
    found = _Modules(fp8=[], nvfp4=[], quantized=[], dense=[], gptq=[])
    for name, module in model.named_modules(remove_duplicate=False):
        if isinstance(module, TorchFP8Linear):
            found.fp8.append((name, module))
            found.quantized.append((name, module))
        elif fp4_class is not None and isinstance(module, fp4_class):
            found.nvfp4.append((name, module))
            found.quantized.append((name, module))
        elif gptq_class is not None and isinstance(module, gptq_class):
            found.gptq.append((name, module))
            found.quantized.append((name, module))
        elif isinstance(module, nn.Linear):
            found.dense.append(name)
    return found


def _fp8_scheme(module: TorchFP8Linear) -> tuple[str, str, tuple[int, int] | None]:
    """(format, scale method, block size) of an FP8 module."""
    block = module.weight_block_size if module.weight_scale_method == "block" else None
    return module.format, module.weight_scale_method, block


def _describe_fp8(module: TorchFP8Linear) -> str:
    fmt, method, block = _fp8_scheme(module)
    scales = f"block scales {list(block)}" if block is not None else f"{method} scales"
    what = f"{fmt} weights with {scales}"
    if module.conv is not None:
        what += ", a convolution flattened to (out, in*k)"
    return what


def _fp8_layouts(module: TorchFP8Linear) -> list[str]:
    """The layouts that hold an FP8 module."""
    fmt, method, _ = _fp8_scheme(module)
    plain_e4m3 = fmt == _E4M3 and module.conv is None
    held = []
    if plain_e4m3:
        held.append("compressed-tensors")
    if plain_e4m3 and method in ("tensor", "block"):
        held.append("hf")
    held.append("gptqmodel")
    return held


def _refuse(layout: str, name: str, what: str, why: str, held: list[str]) -> ValueError:
    where = ", ".join(repr(n) for n in held)
    return ValueError(
        f"export: layout {layout!r} cannot hold module {name!r} ({what}): {why}; layouts that "
        f"hold it: {where}"
    )


def _check_fp8(layout: str, modules: _Modules, why: str) -> None:
    for name, module in modules.fp8:
        held = _fp8_layouts(module)
        if layout not in held:
            raise _refuse(layout, name, _describe_fp8(module), why, held)


def _check_no_nvfp4(layout: str, modules: _Modules, why: str) -> None:
    if modules.nvfp4:
        name = modules.nvfp4[0][0]
        raise _refuse(layout, name, "NVFP4 weights", why, ["compressed-tensors"])


def _require_quantized(layout: str, modules: _Modules) -> None:
    if not modules.quantized:
        raise ValueError(
            f"export: layout {layout!r} describes quantized modules, and the model has none "
            f"(no TorchFP8Linear or TorchFP4Linear, no GPTQLinear); quantize() it first"
        )


def _check_no_gptq(layout: str, modules: _Modules, why: str) -> None:
    if modules.gptq:
        name, module = modules.gptq[0]
        facts = _gptq_facts(module)
        raise _refuse(layout, name, _describe_gptq(module), why, _gptq_layouts(module, facts))


def _model_dtype(model: nn.Module) -> torch.dtype | None:
    """The floating dtype holding most of the model's parameters (quantized modules hold
    buffers, so these are the dense ones), or None when it has none."""
    counts: Counter[torch.dtype] = Counter()
    for p in model.parameters():
        if p.is_floating_point():
            counts[p.dtype] += p.numel()
    return counts.most_common(1)[0][0] if counts else None


# --------------------------------------------------------------------------------------------
# GPTQ modules
# --------------------------------------------------------------------------------------------


class _GptqFacts(NamedTuple):
    """What a GPTQ module's tensors hold beyond its bits and group size (read from its buffers)."""

    symmetric: bool
    """Every zero point is ``2**(bits-1)``."""
    contiguous: bool
    """``g_idx`` is ``arange(in) // group_size`` (all 0 for ``group_size=-1``): no ``desc_act``
    reordering of the groups."""
    zero_at: tuple[int, int] | None
    """``(group, output column)`` of the first logical zero point equal to 0, or None."""


def _gptq_facts(module: nn.Module) -> _GptqFacts:
    zeros = module.unpacked().zeros
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
    facts = _gptq_facts(module)
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


def _gptq_export(model: nn.Module, modules: _Modules, config: Any, layout: str) -> LayoutExport:
    """The ``gptq`` files (``gptqmodel`` writes the same for a GPTQ model)."""
    if not isinstance(config, GPTQConfig):
        raise TypeError(
            f"export: layout {layout!r} writes GPT-QModel's GPTQ payload from a GPTQConfig; got "
            f"quantize_config={type(config).__name__}"
        )
    why = "a GPTQ checkpoint declares one quant_method ('gptq') for every quantized module"
    for name, module in modules.fp8:
        raise _refuse(layout, name, _describe_fp8(module), why, _fp8_layouts(module))
    _check_no_nvfp4(layout, modules, why)
    heads = output_embedding_names(model)
    replaced: dict[str, dict[str, Tensor]] = {}
    for name, module in modules.gptq:
        resolved = config.resolve(name) if name not in heads or config.lm_head else None
        replaced[name] = _gptq_module_tensors(name, module, resolved, config.format, heads)
    keeps_scales = config.activation is not None and config.activation.mode == "w4a_nvfp4"
    state: dict[str, Tensor] = {}
    for key, tensor in model.state_dict().items():
        prefix, _, leaf = key.rpartition(".")
        if leaf == _ACTIVATION_SCALE_BITS:  # a W4A-NVFP4 module's activation global scale
            if not keeps_scales:
                _check_dynamic_activation_scale(layout, prefix, tensor)
                continue
        state[key] = replaced.get(prefix, {}).get(leaf, tensor)
    return LayoutExport(state, gptq_config_to_payload(config), gptq_config_to_payload(config))


_ACTIVATION_SCALE_BITS = "activation_global_scale_bits"


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
            f"mode 'w4a_nvfp4') or set activation_global_scale_bits to 0 (dynamic)"
        )


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


# --------------------------------------------------------------------------------------------
# Scales
# --------------------------------------------------------------------------------------------


def _reciprocal(scale: Float32[Tensor, "*s"]) -> Float32[Tensor, "*s"]:
    """``fl(1 / scale)`` in FP32: one IEEE division, exact for powers of two."""
    return torch.ones_like(scale, dtype=torch.float32) / scale.to(torch.float32)


def _multiplying_fp8_scale(module: TorchFP8Linear, layout: str) -> Float32[Tensor, "*s"]:
    """The module's scales as a multiplying reader of ``layout`` shapes them."""
    direct = _reciprocal(module.weight_scale_inv)
    method = module.weight_scale_method
    if layout == "hf":
        return direct.reshape(()) if method == "tensor" else direct
    if method == "tensor":
        return direct.reshape(1)
    if method == "row":
        return direct.reshape(-1, 1)
    return direct


def _bias(bias: Float[Tensor, "out"], dtype: torch.dtype | None) -> Float[Tensor, "out"]:  # noqa: F821
    return bias if dtype is None or bias.dtype == dtype else bias.to(dtype)


def _converted_state(
    model: nn.Module,
    modules: _Modules,
    layout: str,
    facts: Mapping[str, _GptqFacts] | None = None,
) -> dict[str, Tensor]:
    """``model.state_dict()`` with each quantized module's tensors in ``layout``'s names (GPTQ
    modules as compressed-tensors ``pack-quantized``, from their ``facts``)."""
    dtype = _model_dtype(model)
    gptq = {
        name: _gptq_ct_tensors(name, module, (facts or {})[name]) for name, module in modules.gptq
    }
    renamed: dict[str, dict[str, tuple[str, Tensor] | None]] = {}
    for name, module in modules.fp8:
        scale_name = "weight_scale_inv" if layout == "hf" else "weight_scale"
        entries: dict[str, tuple[str, Tensor] | None] = {
            "weight": ("weight", module.weight),
            "weight_scale_inv": (scale_name, _multiplying_fp8_scale(module, layout)),
        }
        if module.bias is not None:
            entries["bias"] = ("bias", _bias(module.bias, dtype))
        renamed[name] = entries
    for name, module in modules.nvfp4:
        entries = {
            "weight": ("weight_packed", module.weight),
            "weight_scale": ("weight_scale", module.weight_scale),
            "weight_scale_2": (
                "weight_global_scale",
                _reciprocal(module.weight_scale_2).reshape(1),
            ),
        }
        if module.bias is not None:
            entries["bias"] = ("bias", _bias(module.bias, dtype))
        renamed[name] = entries
    state: dict[str, Tensor] = {}
    for key, tensor in model.state_dict().items():
        prefix, _, leaf = key.rpartition(".")
        if leaf == _ACTIVATION_SCALE_BITS:  # a W4A-NVFP4 module's activation global scale
            _check_dynamic_activation_scale(layout, prefix, tensor)
            continue
        if prefix in gptq:
            continue
        entry = renamed.get(prefix, {}).get(leaf)
        if entry is None:
            state[key] = tensor
            continue
        new_leaf, new_tensor = entry
        state[f"{prefix}.{new_leaf}" if prefix else new_leaf] = new_tensor
    for prefix, tensors in gptq.items():
        state.update({f"{prefix}.{leaf}" if prefix else leaf: t for leaf, t in tensors.items()})
    return state


# --------------------------------------------------------------------------------------------
# Payloads
# --------------------------------------------------------------------------------------------


def _hf_payload(modules: _Modules) -> dict[str, Any]:
    """transformers' fine-grained FP8 payload; every FP8 module must share one scale layout."""
    first_name, first = modules.fp8[0]
    _, method, block = _fp8_scheme(first)
    for name, module in modules.fp8[1:]:
        if _fp8_scheme(module)[1:] != (method, block):
            raise ValueError(
                f"export: layout 'hf' writes one weight_block_size for the whole model "
                f"(transformers' fine-grained FP8), but module {first_name!r} has "
                f"{_describe_fp8(first)} and module {name!r} has {_describe_fp8(module)}; "
                f"layouts that hold both: 'compressed-tensors', 'gptqmodel'"
            )
    return {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": list(block) if block is not None else None,
        "modules_to_not_convert": list(modules.dense),
    }


def _ct_fp8_weights(method: str, block: tuple[int, int] | None) -> dict[str, Any]:
    weights: dict[str, Any] = {
        "num_bits": 8,
        "type": "float",
        "symmetric": True,
        "group_size": None,
        "strategy": _CT_STRATEGY[method],
    }
    if block is not None:
        weights["block_structure"] = list(block)
    weights["dynamic"] = False
    return weights


def _ct_nvfp4_weights() -> dict[str, Any]:
    return {
        "num_bits": 4,
        "type": "float",
        "symmetric": True,
        "group_size": _NVFP4_GROUP,
        "strategy": "tensor_group",
        "dynamic": False,
        "scale_dtype": "torch.float8_e4m3fn",
    }


def _ct_payload(modules: _Modules, facts: Mapping[str, _GptqFacts] | None = None) -> dict[str, Any]:
    """compressed-tensors' payload: one config group per distinct scheme (numbered in module
    order), weight-only."""
    schemes: dict[Any, tuple[str, dict[str, Any], list[str]]] = {}
    gptq = {name for name, _ in modules.gptq}
    for name, module in modules.quantized:
        if name in gptq:
            sym = (facts or {})[name].symmetric
            key = ("int", module.bits, module.group_size, sym)
            if key not in schemes:
                weights = _ct_int_weights(module.bits, module.group_size, sym)
                schemes[key] = (_CT_PACKED_FORMAT, weights, [])
        elif isinstance(module, TorchFP8Linear):
            _, method, block = _fp8_scheme(module)
            key: tuple[Any, ...] = ("fp8", method, block)
            if key not in schemes:
                schemes[key] = (_CT_FLOAT_FORMAT, _ct_fp8_weights(method, block), [])
        else:
            key = ("nvfp4",)
            if key not in schemes:
                schemes[key] = (_CT_NVFP4_FORMAT, _ct_nvfp4_weights(), [])
        schemes[key][2].append(name)
    one = len(schemes) == 1
    groups = {
        f"group_{i}": {
            "targets": ["Linear"] if one else names,
            "weights": weights,
            "input_activations": None,
            "output_activations": None,
            "format": fmt,
        }
        for i, (fmt, weights, names) in enumerate(schemes.values())
    }
    formats = {fmt for fmt, _, _ in schemes.values()}
    return {
        "quant_method": _CT_METHOD,
        "format": formats.pop() if len(formats) == 1 else _CT_MIXED_FORMAT,
        "quantization_status": "compressed",
        "config_groups": groups,
        "kv_cache_scheme": None,
        "global_compression_ratio": None,
        "ignore": list(modules.dense),
        "moe_sparsity_config": None,
        "sparsity_config": {},
        "transform_config": {},
    }


# --------------------------------------------------------------------------------------------
# Export
# --------------------------------------------------------------------------------------------


def export_layout(
    model: nn.Module, quantize_config: FP8Config | GPTQConfig | None, layout: str
) -> LayoutExport:
    """The tensors and payloads that save ``model`` in a checkpoint ``layout``.

    Reads the model (``TorchFP8Linear`` / ``TorchFP4Linear`` / ``GPTQLinear`` modules, dense
    ``nn.Linear`` modules) and returns new tensors and dicts; the model is not changed.

    * ``"gptqmodel"``: ``model.state_dict()`` as it is; ``quantize_config`` =
      :func:`~floatxq.interop.payload.fp8_config_to_payload`; ``quantization_config`` = that
      payload with ``activation_scheme`` = :data:`GPTQMODEL_REFUSAL_MARKER`. For a model with
      GPTQ modules, the ``"gptq"`` files.
    * ``"gptq"``: ``model.state_dict()`` with each ``GPTQLinear``'s ``qweight``, ``qzeros``,
      ``scales`` (float16: converted when exact, else refused), ``g_idx`` and ``bias`` (as
      stored); ``qzeros`` converted exactly to the config's ``format`` when the module holds the
      other one; with an NVFP4 activation policy, each W4A-NVFP4 module's int32
      ``activation_global_scale_bits`` too (GPT-QModel's name and form). ``quantize_config``
      and ``quantization_config`` =
      :func:`~floatxq.interop.payload.gptq_config_to_payload` (``quant_method: "gptq"``,
      ``checkpoint_format`` = ``format``). The config must describe every module as readers will
      take it: the module's bits and group size, ``sym`` only when every zero point is
      ``2**(bits-1)``, ``desc_act`` when ``g_idx`` reorders the groups, and no zero point of 0
      in the v1 ``"gptq"`` format (its field would borrow from the next).
    * ``"hf"``: ``<m>.weight`` (E4M3 codes) and ``<m>.weight_scale_inv`` (FP32 scale that
      MULTIPLIES: ``()`` for tensor scales, the ``(out/br, in/bc)`` grid for block scales);
      payload ``{"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
      "weight_block_size", "modules_to_not_convert"}`` (the dense ``nn.Linear`` names).
    * ``"compressed-tensors"``: FP8 modules as ``float-quantized`` (``<m>.weight``, FP32
      multiplying ``<m>.weight_scale``: ``(1,)`` tensor, ``(out, 1)`` channel, block grid);
      NVFP4 modules as ``nvfp4-pack-quantized`` (``<m>.weight_packed``, ``<m>.weight_scale``
      E4M3, FP32 ``<m>.weight_global_scale`` ``(1,)`` that DIVIDES); GPTQ modules as
      ``pack-quantized`` INT (``<m>.weight_packed`` int32 ``(out, in*bits/32)``,
      ``<m>.weight_scale`` ``(out, groups)`` as stored, ``<m>.weight_shape``, and
      ``<m>.weight_zero_point`` int32 ``(out*bits/32, groups)`` when a zero point is not
      ``2**(bits-1)``); ``mixed-precision`` when formats mix. One config group per distinct
      scheme, targeting ``"Linear"`` when there is one scheme, else the exact module names;
      ``ignore`` lists the dense ``nn.Linear`` modules; no activation quantization (the files are
      weight-only).

    ``hf`` and ``compressed-tensors`` write FP8 and NVFP4 modules' biases in the model's dtype;
    GPTQ modules keep their stored bias.

    Args:
      model: the quantized model.
      quantize_config: its config: an ``FP8Config`` for ``"gptqmodel"`` FP8 files, a
        ``GPTQConfig`` for ``"gptq"`` (and ``"gptqmodel"`` with GPTQ modules); unused by the
        others.
      layout: a name :func:`normalize_layout` accepts.

    Raises:
      ValueError: an unknown layout; a module the layout cannot hold (named, with the layouts
        that hold it): ``hf`` takes E4M3 with tensor or block scales and one block size for the
        model, ``compressed-tensors`` E4M3, NVFP4 and GPTQ modules with contiguous whole groups,
        ``gptqmodel`` FP8 only or GPTQ only, ``gptq`` GPTQ only; convolutions go to
        ``gptqmodel`` only; a W4A activation policy to any layout but ``gptq`` /
        ``gptqmodel``; a GPTQ config that misdescribes a module (see ``"gptq"`` above) or
        scales float16 cannot hold; a layout other than ``gptqmodel`` for a model with no
        quantized module.
      TypeError: ``"gptqmodel"`` without an ``FP8Config`` (FP8 model) or ``GPTQConfig`` (GPTQ
        model); ``"gptq"`` without a ``GPTQConfig``.

    Numerics: codes, NVFP4 bytes, GPTQ words and ``gptqmodel`` tensors unchanged (GPTQ zero words
    converted between v1 and v2 by exact integer arithmetic); multiplying FP8 scales are one
    FP32 reciprocal of floatxq's (bound in the module docstring); FP8/NVFP4 biases rounded once
    into the model dtype.

    Example:
      >>> model = nn.Sequential(TorchFP8Linear.from_linear(nn.Linear(64, 32)), nn.Linear(32, 8))
      >>> out = export_layout(model, FP8Config(), "ct")
      >>> out.quantization_config["ignore"], sorted(out.state)[:3]
      (['1'], ['0.bias', '0.weight', '0.weight_scale'])
    """
    name = normalize_layout(layout)
    modules = _modules(model)
    if name == "gptq" or (name == "gptqmodel" and modules.gptq):
        if not modules.gptq:
            _require_quantized(name, modules)
            for module_name, module in modules.fp8:
                raise _refuse(
                    name,
                    module_name,
                    _describe_fp8(module),
                    "it holds GPTQ modules only",
                    _fp8_layouts(module),
                )
            _check_no_nvfp4(name, modules, "it holds GPTQ modules only")
        return _gptq_export(model, modules, quantize_config, name)
    if name == "gptqmodel":
        if not isinstance(quantize_config, FP8Config):
            raise TypeError(
                f"export: layout 'gptqmodel' writes GPT-QModel's payload from an FP8Config; got "
                f"quantize_config={type(quantize_config).__name__}"
            )
        _check_no_nvfp4(name, modules, "GPT-QModel's FP8 payload describes FP8 modules only")
        payload = fp8_config_to_payload(quantize_config)
        config = {**payload, "activation_scheme": GPTQMODEL_REFUSAL_MARKER}
        return LayoutExport(dict(model.state_dict()), config, payload)
    _require_quantized(name, modules)
    _check_no_activation_policy(name, quantize_config)
    if name == "hf":
        _check_no_gptq(name, modules, "transformers' fine-grained FP8 holds FP8 weights only")
        _check_no_nvfp4(name, modules, "transformers' fine-grained FP8 holds FP8 weights only")
        _check_fp8(
            name,
            modules,
            "transformers' fine-grained FP8 holds float8_e4m3fn linear weights with tensor or "
            "block scales",
        )
        return LayoutExport(_converted_state(model, modules, name), _hf_payload(modules), None)
    _check_fp8(
        name,
        modules,
        "compressed-tensors' float-quantized FP8 holds float8_e4m3fn linear weights",
    )
    facts = {module_name: _gptq_facts(module) for module_name, module in modules.gptq}
    state = _converted_state(model, modules, name, facts)
    return LayoutExport(state, _ct_payload(modules, facts), None)
