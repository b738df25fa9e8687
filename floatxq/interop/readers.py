"""Reading each layout's modules: one module's stored tensors become the module that runs them.

FP8 sources become :class:`~floatxq.nn.fp8_linear.TorchFP8Linear` (codes untouched; multiplying
scales turned into inverse ones with one FP32 reciprocal each, exact for powers of two), NVFP4
sources become :class:`~floatxq.nn.fp4_linear.TorchFP4Linear` (bytes untouched, scales
unswizzled and nibbles reordered where the producer differs), GPTQ sources (``quant_method:
gptq``, compressed-tensors ``pack-quantized``) become :class:`~floatxq.nn.gptq_linear.GPTQLinear`
holding the file's words, and MX sources or ragged block grids are decoded to dense ``nn.Linear``
weights, one module at a time. Which layout a directory holds is decided first, by
:func:`floatxq.interop.layouts.decide_layout`; every refusal is a
:class:`~floatxq.interop.checkpoint.CheckpointError` naming the tensor and its file.
"""

import functools
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import torch
from torch import nn

from floatxq._checks import to_float32
from floatxq.config import GPTQConfig
from floatxq.config.rules import RulePattern, _check_rule_pattern
from floatxq.formats import FP8_WEIGHT_DTYPES
from floatxq.interop.activations import (
    ACTIVATION_SCALE_SUFFIXES,
    refuse_activation_scales,
    with_declared_activations,
)
from floatxq.interop.checkpoint import CheckpointError
from floatxq.interop.layouts import LayoutDecision, _lower
from floatxq.interop.nvfp4_w4a4 import check_ct_nvfp4_inputs
from floatxq.interop.shards import bounded_json


class ModuleSource(NamedTuple):
    """One module's tensors, as stored (names without the module prefix)."""

    name: str
    tensors: dict[str, torch.Tensor]


def _fp8_module(
    source: ModuleSource,
    scale_key: str,
    *,
    multiply: bool,
    block: tuple[int, int] | None,
    dtype: torch.dtype,
    file: str,
) -> nn.Module:
    """:func:`floatxq.fp8_module_from_source`, its errors naming the tensor and file."""
    from floatxq.interop.sources import fp8_module_from_source

    try:
        return fp8_module_from_source(
            source.tensors["weight"],
            source.tensors[scale_key],
            source.tensors.get("bias"),
            direction="multiply" if multiply else "inverse",
            block=block,
            dtype=dtype,
        )
    except (TypeError, ValueError) as exc:
        raise CheckpointError(f"load: {source.name}.{scale_key} in {file}: {exc}") from None


def _fp4_module(
    source: ModuleSource, layout: str, original: nn.Module, dtype: torch.dtype, file: str, **kw: Any
) -> nn.Module:
    """:func:`floatxq.fp4_module_from_source`, its errors naming the module and file."""
    from floatxq.interop.sources import fp4_module_from_source

    shape = (original.out_features, original.in_features)
    try:
        return fp4_module_from_source(
            source.tensors,
            layout=layout,
            shape=shape,
            dtype=dtype,
            **kw,  # type: ignore[arg-type]
        )
    except (TypeError, ValueError) as exc:
        raise CheckpointError(f"load: {source.name} in {file}: {exc}") from None


def _require(source: ModuleSource, keys: Sequence[str], where: str) -> None:
    missing = [k for k in keys if k not in source.tensors]
    if missing:
        raise CheckpointError(
            f"load: {where} lacks {', '.join(f'{source.name}.{k}' for k in missing)} "
            f"(has {sorted(source.tensors)})"
        )


def _extra(source: ModuleSource, allowed: Sequence[str], where: str) -> None:
    extra = sorted(set(source.tensors) - set(allowed))
    if extra:
        raise CheckpointError(
            f"load: {where} has tensors floatxq does not know for this layout: "
            f"{', '.join(f'{source.name}.{k}' for k in extra)}"
        )


def _block_of(value: Any, where: str) -> tuple[int, int] | None:
    if value is None:
        return None
    if (
        not isinstance(value, (list, tuple))
        or len(value) != 2
        or not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in value)
    ):
        raise CheckpointError(
            f"load: {where} weight_block_size must be two positive ints, got {value!r}"
        )
    return (int(value[0]), int(value[1]))


def _ct_block(
    qconfig: Mapping[str, Any], where: str, name: str, original: nn.Module
) -> tuple[int, int] | None:
    """The FP8 block size of module ``name``: that of the config groups whose ``targets`` name it
    (compressed-tensors' matching, as for ``ignore``), else of every group (one size only)."""
    groups = [g for g in (qconfig.get("config_groups") or {}).values() if isinstance(g, Mapping)]
    mine = [g for g in groups if any(_ct_matches(t, name, original) for t in _targets(g))]
    blocks = set()
    for group in mine or groups:
        weights = group.get("weights")
        if isinstance(weights, Mapping) and _lower(weights.get("strategy")) == "block":
            block = _block_of(weights.get("block_structure"), where)
            if block is not None:
                blocks.add(block)
    if len(blocks) > 1:
        raise CheckpointError(
            f"load: {where} declares several block structures {sorted(blocks)} for {name}; a "
            f"module is read with one block size"
        )
    return next(iter(blocks)) if blocks else None


def _targets(group: Mapping[str, Any]) -> list[str]:
    targets = group.get("targets")
    return [t for t in targets if isinstance(t, str)] if isinstance(targets, list) else []


def _ct_matches(entry: str, name: str, original: nn.Module) -> bool:
    """compressed-tensors' module matching: an exact name, ``re:<regex>`` from the start of
    the name (its time bounded as a ``dynamic`` rule's is), or a class name in the MRO."""
    if entry.startswith("re:"):
        return _ignore_pattern(entry).match(name) is not None
    return entry == name or entry in {c.__name__ for c in type(original).__mro__}


_CT_QUANTIZED_KEYS = frozenset(
    {"weight_packed", "weight_scale", "weight_global_scale", "weight_zero_point", "weight_shape"}
)


@functools.lru_cache(maxsize=1024)
def _ignore_pattern(entry: str) -> RulePattern:
    return _check_rule_pattern(entry, entry.removeprefix("re:"))


def _refuse_ignored(source: ModuleSource, original: nn.Module, ignore: Any, file: str) -> None:
    """A compressed-tensors module whose tensors are quantized may not be one ``ignore`` names.

    compressed-tensors' matching: an exact module name, ``re:<regex>`` matched from the start of
    the name (its time bounded as a ``dynamic`` rule's is), or the name of a class in the
    module's MRO (``"Linear"``).
    """
    for entry in ignore or ():
        try:
            hit = _ct_matches(entry, source.name, original)
        except ValueError as exc:
            raise CheckpointError(
                f"load: {file} quantization_config.ignore entry {entry[:80]!r}: {exc}"
            ) from None
        if hit:
            raise CheckpointError(
                f"load: {source.name} in {file} holds quantized tensors "
                f"({', '.join(sorted(set(source.tensors) & _CT_QUANTIZED_KEYS))}), but the "
                f"quantization_config's ignore entry {entry!r} leaves it unquantized; the "
                f"metadata contradicts the tensors"
            )


def read_module(
    decision: LayoutDecision,
    source: ModuleSource,
    original: nn.Module,
    *,
    qconfig: Mapping[str, Any] | None,
    dtype: torch.dtype,
    file: str,
    metadata: Mapping[str, Any] | None = None,
    declared: tuple[str, tuple[int, int] | None] | None = None,
    gptq: GPTQConfig | None = None,
    weight_only: bool = False,
) -> nn.Module | None:
    """The module that runs one quantized module's tensors under ``decision``'s convention.

    Returns None when the module's tensors are plain (nothing quantized about it). ``declared``
    is the ``(weight_scale_method, weight_block_size)`` the payload gives this module
    (``gptqmodel`` layout): the scale tensor must have exactly that layout's shape, so a grid that
    happens to tile the weight another way (a ``1x256`` grid read as ``256x3`` blocks) is refused.
    ``gptq`` is the module's resolved GPTQConfig (``gptq`` layout; None when the config excludes
    the module): its bits, group size, ``sym`` and ``desc_act`` must be what the tensors hold.
    ``weight_only`` (a requantization source): activation scales and declared activations are
    ignored, the module multiplies ``x`` as given.

    Raises:
      CheckpointError: missing, unknown or mis-shaped tensors (named with their file).
    """
    if weight_only:
        kept = {k for k in source.tensors if f".{k}" not in ACTIVATION_SCALE_SUFFIXES}
        tensors = {k: v for k, v in source.tensors.items() if k in kept}
        source = ModuleSource(source.name, tensors)
    where = f"{source.name} in {file}"
    keys = set(source.tensors)
    weight = source.tensors.get("weight")
    qconfig = qconfig or {}
    layout = decision.layout
    if layout == "gptq":
        return _gptq_module(source, original, gptq, decision.scheme or "gptq", file, dtype)
    if layout == "compressed-tensors" and keys & _CT_QUANTIZED_KEYS:
        _refuse_ignored(source, original, qconfig.get("ignore"), file)
    packed_words = source.tensors.get("weight_packed")
    if layout == "compressed-tensors" and packed_words is not None:
        if packed_words.dtype == torch.int32:
            return _ct_int_module(source, original, qconfig, file, dtype)
    fp8 = weight is not None and weight.dtype in FP8_WEIGHT_DTYPES
    if layout in ("gptqmodel", "hf"):
        if "weight_scale_inv" not in keys and not fp8:
            return None
        _require(source, ("weight", "weight_scale_inv"), where)
        _extra(source, ("weight", "weight_scale_inv", "bias", "activation_scale"), where)
        if "activation_scale" in keys and layout == "gptqmodel":
            raise CheckpointError(
                f"load: {where} carries a static activation_scale; GPT-QModel's FP8 payload "
                f"declares no activation scheme to run it with"
            )
        if layout == "gptqmodel":
            block = _declared_block(source, declared, file)
        else:
            block = _block_of(qconfig.get("weight_block_size"), f"{file} quantization_config")
        module = _fp8_module(
            source, "weight_scale_inv", multiply=layout == "hf", block=block, dtype=dtype, file=file
        )
        return with_declared_activations(
            module, decision, qconfig, source.name, original, file, source.tensors, weight_only
        )
    if layout == "mimo":
        raise CheckpointError(
            f"load: {where}: MiMo mixed sources need the mimo_v2 architecture, which transformers "
            f"does not have; decode their tensors with floatxq.interop.sources.decode_mimo_weight"
        )
    if layout == "comfy":
        if "comfy_quant" not in keys:
            return None
        marker = _comfy_marker(source.tensors["comfy_quant"], source.name, file)
        if marker != "nvfp4":
            raise CheckpointError(
                f"load: {where} Comfy format {marker!r} is not read by floatxq; accepted: 'nvfp4'"
            )
        _extra(source, ("weight", "weight_scale", "weight_scale_2", "comfy_quant", "bias"), where)
        tensors = {k: v for k, v in source.tensors.items() if k != "comfy_quant"}
        return _fp4_module(ModuleSource(source.name, tensors), "comfy", original, dtype, file)
    if layout == "torchao":
        return _torchao_module(source, original, metadata or {}, dtype, file)
    # compressed-tensors, modelopt, quark: weight(_packed) + weight_scale (+ a global scale)
    if "weight_packed" in keys:
        if "weight_global_scale" in keys:
            allowed = ("weight_packed", "weight_scale", "weight_global_scale", "bias")
            _extra(source, (*allowed, "input_global_scale"), where)
            if not weight_only:
                check_ct_nvfp4_inputs(source.name, source.tensors, qconfig, original, file)
            return _fp4_module(source, "compressed-tensors", original, dtype, file)
        _require(source, ("weight_packed", "weight_scale"), where)
        _extra(source, ("weight_packed", "weight_scale", "weight_shape", "bias"), where)
        return _mx_dense(source, source.tensors["weight_packed"], "e2m1", dtype, where)
    if "weight_scale" not in keys:
        if fp8:
            raise CheckpointError(
                f"load: {where} holds FP8 codes but no {source.name}.weight_scale"
            )
        return None
    _require(source, ("weight", "weight_scale"), where)
    scale = source.tensors["weight_scale"]
    if "weight_scale_2" in keys:
        allowed = ("weight", "weight_scale", "weight_scale_2", "bias")
        _extra(source, (*allowed, "input_scale") if layout == "modelopt" else allowed, where)
        return _fp4_module(source, "modelopt", original, dtype, file)
    mx = scale.dtype in (torch.uint8, getattr(torch, "float8_e8m0fnu", None))
    w8a8 = layout in ("compressed-tensors", "modelopt") and fp8 and not mx
    static = ("input_scale",) if w8a8 else ()  # a static FP8 module's activation scale
    _extra(source, ("weight", "weight_scale", "weight_zero_point", "bias", *static), where)
    _check_zero_point(source, where)
    if mx:
        assert weight is not None
        element = "e2m1" if weight.dtype == torch.uint8 else str(weight.dtype).split(".")[-1]
        return _mx_dense(source, weight, element, dtype, where)
    if not fp8:
        raise CheckpointError(
            f"load: {where} weight has dtype {weight.dtype if weight is not None else None}; a "
            f"{layout} FP8 weight must be an FP8 dtype"
        )
    block = None
    if layout == "compressed-tensors":
        try:
            block = _ct_block(qconfig, f"{file} quantization_config", source.name, original)
        except ValueError as exc:  # a target pattern the rule check refuses
            if isinstance(exc, CheckpointError):
                raise
            raise CheckpointError(f"load: {file} quantization_config targets: {exc}") from None
    elif scale.ndim == 2 and scale.numel() > 1 and scale.shape[1] != 1:
        block = _inferred_block(weight, scale)
    module = _fp8_module(source, "weight_scale", multiply=True, block=block, dtype=dtype, file=file)
    return with_declared_activations(
        module, decision, qconfig, source.name, original, file, source.tensors, weight_only
    )


# ----------------------------------------------------------------------------------------------
# GPTQ modules
# ----------------------------------------------------------------------------------------------

_GPTQ_READ_BITS = (2, 4, 8)
"""Widths whose fields tile an int32 word (GPTQ's 3-bit packing crosses words; not read)."""


def _repeated_field_words(value: int, bits: int, shape: tuple[int, int]) -> torch.Tensor:
    """int32 words holding ``value`` in every ``bits``-wide field (e.g. ``0x88888888``)."""
    word = 0
    for field in range(32 // bits):
        word |= value << (bits * field)
    signed = word - (1 << 32) if word >= 1 << 31 else word
    return torch.full(shape, signed, dtype=torch.int32)


def _linear_shape(original: nn.Module, where: str) -> tuple[int, int]:
    """``(out, in)`` of the module the checkpoint's tensors replace."""
    from floatxq.nn.fp8_linear import _source_matrix

    try:
        matrix, _ = _source_matrix(original, where="load")
    except (TypeError, ValueError) as exc:
        raise CheckpointError(f"load: {where}: {exc}") from None
    return int(matrix.shape[0]), int(matrix.shape[1])


def _require_dtype(source: ModuleSource, key: str, accepted: str, ok: bool, where: str) -> None:
    if not ok:
        tensor = source.tensors[key]
        raise CheckpointError(
            f"load: {source.name}.{key} in {where} has dtype {tensor.dtype}; {accepted}"
        )


def _require_tensor_shape(
    source: ModuleSource, key: str, shape: tuple[int, ...], why: str, where: str
) -> None:
    got = tuple(source.tensors[key].shape)
    if got != shape:
        raise CheckpointError(
            f"load: {source.name}.{key} in {where} has shape {got}; {why} gives {shape}"
        )


_GPTQ_SCALE_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_GPTQ_SCALE_KINDS = "floating: float16, bfloat16 or float32 (float64 where its values fit FP32)"


def _check_gptq_scales_and_bias(
    source: ModuleSource, scale_key: str, where: str, *, bits: int, dtype: torch.dtype
) -> None:
    """GPTQ scales in the dtypes producers write, positive and finite in FP32 (the dtype every
    GPTQ route multiplies in), and small enough that the largest decoded weight,
    ``scale · (2**bits - 1)``, stays finite in the model dtype; a bias finite in it."""
    scales = source.tensors[scale_key]
    name = f"{source.name}.{scale_key} in {where}"
    ok = scales.dtype in _GPTQ_SCALE_DTYPES  # (isfinite has no FP8 kernel; ints are not scales)
    _require_dtype(source, scale_key, f"GPTQ scales are {_GPTQ_SCALE_KINDS}", ok, where)
    try:
        fp32 = to_float32(scales, name=name, where="load")
    except ValueError as exc:
        raise CheckpointError(str(exc)) from None
    good = torch.isfinite(fp32) & (fp32 > 0)
    if fp32.numel() and not bool(good.all()):
        raise CheckpointError(
            f"load: {name} holds {int((~good).sum())} scale(s) that are NaN or infinite, zero or "
            f"negative, such as {fp32[~good][:4].tolist()}; GPTQ scales are positive and finite"
        )
    span = (1 << bits) - 1  # the largest |code - zero|
    largest = float(fp32.max()) if fp32.numel() else 0.0
    if largest * span > torch.finfo(dtype).max:
        raise CheckpointError(
            f"load: {name} holds a scale of {largest:g}: with {bits}-bit codes (|code - zero| up "
            f"to {span}) it decodes to weights beyond {dtype}'s range "
            f"({torch.finfo(dtype).max:g})"
        )
    bias = source.tensors.get("bias")
    if bias is not None:
        ok = bias.dtype in _GPTQ_SCALE_DTYPES
        why = "a bias is floating (float16, bfloat16, float32, float64)"
        _require_dtype(source, "bias", why, ok, where)
        if bias.numel() and not bool(torch.isfinite(bias.to(dtype)).all()):
            raise CheckpointError(
                f"load: {source.name}.bias in {where} holds NaN or infinity (in {dtype})"
            )


def _build_gptq(
    source: ModuleSource,
    words: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
    *,
    bits: int,
    group_size: int,
    fmt: str,
    where: str,
) -> nn.Module:
    """:meth:`GPTQLinear.from_packed` on checked tensors, its errors naming the module."""
    from floatxq.gptq.int4 import GPTQPacked
    from floatxq.nn.gptq_linear import GPTQLinear

    try:
        return GPTQLinear.from_packed(
            GPTQPacked(*words),
            bits=bits,
            group_size=group_size,
            format=fmt,
            bias=source.tensors.get("bias"),
        )
    except (TypeError, ValueError) as exc:
        raise CheckpointError(f"load: {source.name} in {where}: {exc}") from None


def _contiguous_groups(rows: int, group_size: int) -> torch.Tensor:
    index = torch.arange(rows, dtype=torch.int32)
    return index * 0 if group_size == -1 else torch.div(index, group_size, rounding_mode="floor")


def _gptq_module(
    source: ModuleSource,
    original: nn.Module,
    config: GPTQConfig | None,
    fmt: str,
    file: str,
    dtype: torch.dtype,
) -> nn.Module | None:
    """A ``quant_method: gptq`` module (``qweight``, ``qzeros``, ``scales``, ``g_idx``) as a
    GPTQLinear holding the file's tensors, after checking them against the config."""
    gptq_keys = ("qweight", "qzeros", "scales", "g_idx")
    where = f"{source.name} in {file}"
    if not set(source.tensors) & set(gptq_keys):
        return None
    if config is None:
        raise CheckpointError(
            f"load: {where} holds GPTQ tensors, but the quantization config excludes the module "
            f"(a '-:' dynamic rule or lm_head=false)"
        )
    _require(source, gptq_keys, where)
    _extra(source, (*gptq_keys, "bias"), where)
    bits, group_size = config.bits, config.group_size
    if bits not in _GPTQ_READ_BITS:
        raise CheckpointError(
            f"load: {where}: the config declares bits={bits}; floatxq reads GPTQ words of "
            f"{', '.join(map(str, _GPTQ_READ_BITS))} bits (whole fields per int32)"
        )
    qweight, qzeros, scales, g_idx = (source.tensors[k] for k in gptq_keys)
    for key in ("qweight", "qzeros", "g_idx"):
        ok = source.tensors[key].dtype == torch.int32
        _require_dtype(source, key, "GPTQ checkpoints store it as int32", ok, file)
    out, rows = _linear_shape(original, where)
    per = 32 // bits
    groups = 1 if group_size == -1 else -(-rows // group_size)
    if tuple(qweight.shape) != (rows // per, out) or rows % per:
        implied = ""
        if qweight.ndim == 2 and qweight.shape[0] and (32 * qweight.shape[0]) % rows == 0:
            implied = f" (its {qweight.shape[0]} rows are {32 * qweight.shape[0] // rows}-bit)"
        raise CheckpointError(
            f"load: {source.name}.qweight in {file} has shape {tuple(qweight.shape)}{implied}, "
            f"but the config's bits={bits} for the model's ({out}, {rows}) weight gives "
            f"({rows // per}, {out})"
        )
    why = f"the config's group_size={group_size} for in={rows} ({groups} groups)"
    _require_tensor_shape(source, "scales", (groups, out), why, file)
    _require_tensor_shape(source, "qzeros", (groups, out // per), why, file)
    _require_tensor_shape(source, "g_idx", (rows,), "the model's in_features", file)
    _check_gptq_scales_and_bias(source, "scales", file, bits=bits, dtype=dtype)
    if rows and (int(g_idx.min()) < 0 or int(g_idx.max()) >= groups):
        raise CheckpointError(
            f"load: {source.name}.g_idx in {file} holds group indices "
            f"{int(g_idx.min())}..{int(g_idx.max())}, outside [0, {groups - 1}] ({why})"
        )
    if not config.desc_act and not torch.equal(g_idx, _contiguous_groups(rows, group_size)):
        raise CheckpointError(
            f"load: {source.name}.g_idx in {file} reorders the groups, but the config declares "
            f"desc_act=false (readers then ignore g_idx and read contiguous groups)"
        )
    if config.sym:
        mid = 1 << (bits - 1)
        stored = mid - 1 if fmt == "gptq" else mid
        if not torch.equal(qzeros, _repeated_field_words(stored, bits, tuple(qzeros.shape))):
            raise CheckpointError(
                f"load: {source.name}.qzeros in {file} holds zero points other than {mid}, but "
                f"the config declares sym=true (readers then ignore qzeros)"
            )
    return _build_gptq(
        source,
        (qweight, qzeros, scales, g_idx),
        bits=bits,
        group_size=group_size,
        fmt=fmt,
        where=file,
    )


class _CtIntScheme(NamedTuple):
    bits: int
    group_size: int
    """-1 for the channel strategy."""
    symmetric: bool


def _ct_int_schemes(qconfig: Mapping[str, Any], where: str) -> list[_CtIntScheme]:
    """The ``pack-quantized`` INT weight schemes a compressed-tensors payload declares."""
    schemes: list[_CtIntScheme] = []
    top = _lower(qconfig.get("format"))
    groups = qconfig.get("config_groups") or {}
    for key, group in groups.items() if isinstance(groups, Mapping) else ():
        if not isinstance(group, Mapping) or _lower(group.get("format") or top) != "pack-quantized":
            continue
        weights = group.get("weights")
        if not isinstance(weights, Mapping):
            raise CheckpointError(f"load: {where} config group {key!r} has no weights")
        if group.get("input_activations") or group.get("output_activations"):
            raise CheckpointError(
                f"load: {where} config group {key!r} quantizes activations; floatxq loads "
                f"weight-only (W*A16) pack-quantized checkpoints"
            )
        strategy = _lower(weights.get("strategy"))
        size = weights.get("group_size")
        bits = weights.get("num_bits")
        if (
            _lower(weights.get("type")) != "int"
            or weights.get("dynamic") not in (None, False)
            or strategy not in ("group", "channel")
            or weights.get("actorder") not in (None, "weight", "static")
            or not isinstance(bits, int)
            or isinstance(bits, bool)
            or (strategy == "group" and not (isinstance(size, int) and size > 0))
        ):
            raise CheckpointError(
                f"load: {where} config group {key!r} weights {dict(weights)!r}: floatxq reads "
                f"static int weights with the group or channel strategy and no activation "
                f"ordering g_idx (actorder 'group')"
            )
        symmetric = weights.get("symmetric", True)
        gs = size if strategy == "group" else -1
        schemes.append(_CtIntScheme(bits, gs, bool(symmetric)))
    return schemes


def _ct_int_module(
    source: ModuleSource,
    original: nn.Module,
    qconfig: Mapping[str, Any],
    file: str,
    dtype: torch.dtype,
) -> nn.Module:
    """A compressed-tensors ``pack-quantized`` module as a GPTQLinear (``gptq_v2`` zero words:
    compressed-tensors stores the zero point itself, as ``zp + 2**(bits-1)``)."""
    where = f"{source.name} in {file}"
    keys = ("weight_packed", "weight_scale", "weight_shape")
    _require(source, keys, where)
    _extra(source, (*keys, "weight_zero_point", "bias"), where)
    packed, scale, shape = (source.tensors[k] for k in keys)
    shape_ok = not shape.is_floating_point() and shape.dtype != torch.bool and shape.numel() == 2
    _require_dtype(source, "weight_shape", "it holds two integers (out, in)", shape_ok, file)
    out, rows = _linear_shape(original, where)
    if [int(v) for v in shape.flatten()] != [out, rows]:
        raise CheckpointError(
            f"load: {source.name}.weight_shape in {file} is {shape.flatten().tolist()}, but the "
            f"model's weight is ({out}, {rows})"
        )
    words = packed.shape[1] if packed.ndim == 2 else -1
    bits = 32 * words // rows if rows and words > 0 and (32 * words) % rows == 0 else -1
    if packed.ndim != 2 or packed.shape[0] != out or bits not in _GPTQ_READ_BITS:
        raise CheckpointError(
            f"load: {source.name}.weight_packed in {file} has shape {tuple(packed.shape)}: not "
            f"{' / '.join(f'{b}-bit ({out}, {rows * b // 32})' for b in _GPTQ_READ_BITS)} "
            f"packing of the ({out}, {rows}) weight"
        )
    groups = scale.shape[1] if scale.ndim == 2 and scale.shape[0] == out else -1
    if groups < 1 or rows % groups:
        raise CheckpointError(
            f"load: {source.name}.weight_scale in {file} has shape {tuple(scale.shape)}; "
            f"expected ({out}, groups) with groups dividing in={rows}"
        )
    _check_gptq_scales_and_bias(source, "weight_scale", file, bits=bits, dtype=dtype)
    symmetric = "weight_zero_point" not in source.tensors
    declared = _ct_int_schemes(qconfig, f"{file} quantization_config")
    fits = [
        d
        for d in declared
        if d.bits == bits
        and d.symmetric == symmetric
        and (
            (d.group_size == -1 and groups == 1)
            or (d.group_size > 0 and d.group_size * groups == rows)
        )
    ]
    if not fits:
        held = f"{bits}-bit, {groups} group(s) of {rows // groups}, " + (
            "symmetric" if symmetric else "asymmetric (weight_zero_point)"
        )
        raise CheckpointError(
            f"load: {where} holds {held} pack-quantized weights, which no pack-quantized config "
            f"group declares ({[tuple(d) for d in declared]})"
        )
    group_size = fits[0].group_size
    per = 32 // bits
    if symmetric:
        qzeros = _repeated_field_words(1 << (bits - 1), bits, (groups, out // per))
    else:
        zero = source.tensors["weight_zero_point"]
        ok = zero.dtype == torch.int32
        _require_dtype(source, "weight_zero_point", "packed zero points are int32", ok, file)
        why = f"{bits}-bit packing of ({out}, {groups}) zero points"
        _require_tensor_shape(source, "weight_zero_point", (out // per, groups), why, file)
        qzeros = zero.T.contiguous()
    g_idx = _contiguous_groups(rows, group_size)
    return _build_gptq(
        source,
        (packed.T.contiguous(), qzeros, scale.T.contiguous(), g_idx),
        bits=bits,
        group_size=group_size,
        fmt="gptq_v2",
        where=file,
    )


def _declared_block(
    source: ModuleSource, declared: tuple[str, tuple[int, int] | None] | None, file: str
) -> tuple[int, int] | None:
    """Check a GPT-QModel scale against the layout the payload declares for its module."""
    weight, scale = source.tensors["weight"], source.tensors["weight_scale_inv"]
    if declared is None:
        raise CheckpointError(
            f"load: {source.name} in {file} holds FP8 tensors, but the quantization config "
            f"excludes the module (a '-:' dynamic rule or lm_head=false)"
        )
    method, block = declared
    rows, cols = weight.shape if weight.ndim == 2 else (-1, -1)
    expected: tuple[tuple[int, ...], ...]
    if method == "tensor":
        expected = ((), (1,))
    elif method == "row":
        expected = ((rows,),)
    else:
        assert block is not None
        expected = ((rows // block[0], cols // block[1]),)
        if rows % block[0] or cols % block[1]:
            expected = ()
    if tuple(scale.shape) not in expected:
        want = " or ".join(str(e) for e in expected) or "a block size that divides the weight"
        raise CheckpointError(
            f"load: {source.name}.weight_scale_inv in {file} has shape {tuple(scale.shape)}, "
            f"but the config declares {method} scales"
            + (f" with block {list(block)}" if block else "")
            + f" for a {tuple(weight.shape)} weight: expected {want}"
        )
    return block


def _inferred_block(weight: torch.Tensor | None, scale: torch.Tensor) -> tuple[int, int] | None:
    from floatxq.fp8 import infer_scale_layout

    if weight is None or weight.ndim != 2:
        return None
    try:
        layout, block = infer_scale_layout(tuple(weight.shape), tuple(scale.shape))
    except ValueError:
        return None
    return block if layout == "block" else None


def _check_zero_point(source: ModuleSource, where: str) -> None:
    zero = source.tensors.get("weight_zero_point")
    if zero is not None and zero.numel() and bool((zero != 0).any()):
        raise CheckpointError(
            f"load: {where} has a nonzero {source.name}.weight_zero_point; floatxq reads "
            f"symmetric floating-point weights"
        )


def _mx_dense(
    source: ModuleSource, codes: torch.Tensor, element: str, dtype: torch.dtype, where: str
) -> nn.Module:
    """An MX module decoded to a dense ``nn.Linear`` (no MX runtime module exists)."""
    from floatxq.interop.sources import decode_mx_weight

    try:
        dense = decode_mx_weight(
            codes, source.tensors["weight_scale"], element=element, dtype=dtype, name=where
        )
    except (TypeError, ValueError) as exc:
        raise CheckpointError(f"load: {where}: {exc}") from None
    bias = source.tensors.get("bias")
    out_features, in_features = dense.shape
    layer = nn.Linear(in_features, out_features, bias=bias is not None, device="meta")
    layer.weight = nn.Parameter(dense, requires_grad=False)
    if bias is not None:
        layer.bias = nn.Parameter(bias.to(dtype), requires_grad=False)
    return layer


def _comfy_marker(marker: torch.Tensor, name: str, file: str) -> str:
    """The ``format`` of a ``<module>.comfy_quant`` marker: the UTF-8 bytes of a JSON object, a
    1-D uint8 tensor (any other dtype is refused, not wrapped to bytes)."""
    where = f"load: {name}.comfy_quant in {file}"
    if marker.dtype != torch.uint8 or marker.ndim != 1:
        raise CheckpointError(
            f"{where} is a {marker.dtype} tensor of shape {tuple(marker.shape)}; Comfy's marker "
            f"is the UTF-8 bytes of a JSON object, a 1-D uint8 tensor"
        )
    payload = bounded_json(
        bytes(marker.tolist()),
        refusal=f"{where} is not UTF-8 JSON",
        keys=where,
        same_value_ok=True,
    )
    if not isinstance(payload, Mapping) or not isinstance(payload.get("format"), str):
        raise CheckpointError(f"{where} has no 'format' string (got {str(payload)[:60]!r})")
    return _lower(payload["format"])


def _torchao_module(
    source: ModuleSource,
    original: nn.Module,
    metadata: Mapping[str, Any],
    dtype: torch.dtype,
    file: str,
) -> nn.Module | None:
    entry = metadata.get(f"{source.name}.weight")
    if not isinstance(entry, Mapping) or entry.get("_type") != "NVFP4Tensor":
        return None
    data = entry.get("_data", {})
    data = data if isinstance(data, Mapping) else {}
    where = f"{source.name} in {file}"
    if data.get("act_quant_kwargs") or "_weight_act_per_tensor_scale" in source.tensors:
        raise CheckpointError(
            f"load: {where} torchao NVFP4 weight quantizes activations too "
            f"(act_quant_kwargs / act_per_tensor_scale); floatxq loads weight-only NVFP4"
        )
    allowed = ("_weight_qdata", "_weight_scale", "_weight_per_tensor_scale", "bias")
    _extra(source, allowed, where)
    swizzled = bool(data.get("is_swizzled_scales", False))
    return _fp4_module(source, "torchao", original, dtype, file, is_swizzled_scales=swizzled)


def module_sources(
    state: Mapping[str, torch.Tensor], module_names: Sequence[str], *, layout: str
) -> tuple[list[ModuleSource], dict[str, torch.Tensor]]:
    """Split a state dict into per-module sources (for ``module_names``) and the rest.

    torchao names a subclass weight's parts ``<module>._weight_qdata`` (and so on), so they fall
    under their module like any other tensor.
    """
    wanted = set(module_names)
    grouped: dict[str, dict[str, torch.Tensor]] = {}
    rest: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        module, _, leaf = name.rpartition(".")
        if module in wanted:
            grouped.setdefault(module, {})[leaf] = tensor
        else:
            rest[name] = tensor
    sources = [ModuleSource(name, tensors) for name, tensors in grouped.items()]
    return sources, rest


__all__ = [
    "ModuleSource",
    "module_sources",
    "read_module",
    "refuse_activation_scales",
]
