"""Argument validators shared by every pure function: one definition of each check.

Each raises the exception kind floatxq promises for its kind of mistake (``TypeError`` for a wrong
kind of object or dtype, ``ValueError`` for a wrong value or shape) with a message that names the
calling function (``where``), the argument (``name``), what was received and what is accepted.
"""

import json
import math
import numbers
import re
from typing import Any

import torch
from torch import Tensor

from floatxq.formats import FLOAT32_MAX, FP8_FORMATS, FP16_MAX


def require_tensor(x: Any, *, name: str, where: str) -> None:
    """``TypeError`` unless ``x`` is a ``torch.Tensor``."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{where}: {name} must be a torch.Tensor, got {type(x).__name__}")


def require_floating(x: Any, *, name: str, where: str) -> None:
    """``TypeError`` unless ``x`` is a floating-point tensor."""
    require_tensor(x, name=name, where=where)
    if not x.is_floating_point():
        raise TypeError(f"{where}: {name} must be a floating-point tensor, got dtype {x.dtype}")


def require_integer(x: Any, *, name: str, where: str) -> None:
    """``TypeError`` unless ``x`` is an integer tensor (bool and complex are not integers)."""
    require_tensor(x, name=name, where=where)
    if x.is_floating_point() or x.is_complex() or x.dtype == torch.bool:
        raise TypeError(
            f"{where}: {name} must be an integer tensor (uint8/int8/int16/int32/int64), "
            f"got dtype {x.dtype}"
        )


def require_finite(x: Tensor, *, name: str, where: str) -> None:
    """``ValueError`` when ``x`` holds NaN or ±inf (one host sync; empty tensors pass)."""
    if x.numel() and not bool(torch.isfinite(x).all()):
        raise ValueError(f"{where}: {name} contains NaN or infinity; finite values are required")


def require_range(x: Tensor, low: int, high: int, *, name: str, where: str) -> None:
    """``ValueError`` when an element of the integer tensor ``x`` lies outside ``[low, high]``."""
    wide = x.to(torch.int64)  # compare in int64: uint8 would wrap a negative bound
    outside = (wide < low) | (wide > high)
    if x.numel() and bool(outside.any()):
        bad = wide[outside]
        raise ValueError(
            f"{where}: {name} must lie in [{low}, {high}]; got values such as {bad[:4].tolist()}"
        )


def require_shape(x: Tensor, shape: tuple[int, ...], *, name: str, where: str) -> None:
    """``ValueError`` unless ``x.shape == shape``."""
    if tuple(x.shape) != shape:
        raise ValueError(f"{where}: {name} must have shape {shape}, got {tuple(x.shape)}")


def require_data(x: Tensor, *, name: str, where: str) -> None:
    """``TypeError`` for a meta tensor: it has a shape and a dtype but no values to compute with."""
    if x.is_meta:
        raise TypeError(
            f"{where}: {name} is a meta tensor (device='meta'); meta tensors hold no data, so "
            f"there is nothing to quantize or decode: materialize it on cpu or cuda first"
        )


def require_fp8(x: Any, *, name: str, where: str) -> None:
    """``TypeError`` unless ``x`` is a tensor of an FP8 dtype (E8M0 included).

    Integer tensors are refused rather than reinterpreted: ``uint8`` values 0..255 are not the
    bit patterns of FP8 codes unless they are viewed as such (``x.view(torch.float8_e4m3fn)``).
    """
    require_tensor(x, name=name, where=where)
    accepted = [n for n in FP8_FORMATS if hasattr(torch, n)]
    if str(x.dtype).removeprefix("torch.") not in accepted:
        hint = (
            "; integer values are not FP8 bit patterns: view the bytes with "
            "x.view(torch.float8_e4m3fn)"
            if x.dtype in (torch.uint8, torch.int8)
            else ""
        )
        raise TypeError(
            f"{where}: {name} must be an FP8 tensor ({', '.join(accepted)}), got dtype "
            f"{x.dtype}{hint}"
        )


def to_float32(x: Tensor, *, name: str, where: str) -> Tensor:
    """``x`` converted to FP32; ``ValueError`` where a finite value of a wider dtype overflows.

    float64 values beyond ±FLT_MAX (~3.4e38) become ±inf in FP32; naming them as out of range
    keeps the error truthful ("NaN or infinity" would misdescribe a finite input). NaN and ±inf
    already in ``x`` pass through unchanged for the caller's own check.
    """
    x32 = x.to(torch.float32)
    if x.dtype.itemsize > 4 and x.numel():  # only a wider dtype can overflow FP32
        over = torch.isinf(x32) & torch.isfinite(x)
        if bool(over.any()):
            raise ValueError(
                f"{where}: {name} has {int(over.sum())} value(s) that exceed FP32's range "
                f"(|x| <= {FLOAT32_MAX:.7g}), such as "
                f"{x[over][:4].tolist()}; floatxq computes in FP32"
            )
    return x32


def require_positive_finite(x: Tensor, *, name: str, where: str) -> None:
    """``ValueError`` naming the count and examples of NaN, infinite, zero or negative entries.

    One host sync when every entry is positive and finite (empty tensors pass).
    """
    good = torch.isfinite(x) & (x > 0)
    if x.numel() and not bool(good.all()):
        bad = ~good
        raise ValueError(
            f"{where}: {name} must be finite and > 0; {int(bad.sum())} of {x.numel()} entries "
            f"are not, such as {x[bad][:4].tolist()}"
        )


_E4M3_LARGEST_BYTE = 0x7E  # 448: bytes above it are NaN (0x7F) or have the sign bit set


def require_e4m3_scales(scales: Tensor, *, name: str, where: str) -> None:
    """``ValueError`` for NaN (bytes 0x7F, 0xFF) or negative (sign bit set, -0 included) E4M3
    scales; zero is allowed (an all-zero block). ``scales`` must be ``float8_e4m3fn``."""
    raw = scales.view(torch.uint8)
    bad = raw > _E4M3_LARGEST_BYTE
    if scales.numel() and bool(bad.any()):
        raise ValueError(
            f"{where}: {name} holds {int(bad.sum())} NaN or negative E4M3 scale(s) (bytes such "
            f"as {[hex(b) for b in raw[bad][:4].tolist()]}); block scales must lie in [0, 448]"
        )


def real_scalar(value: Any, *, name: str, where: str, device: torch.device) -> Tensor:
    """One real number as a 0-d FP32 tensor on ``device`` (exact for FP32/FP16/BF16 values).

    Accepts a real Python or NumPy number (``bool`` is not a number here) or a floating tensor
    holding exactly one value. ``TypeError`` for any other kind (strings included), ``ValueError``
    for a tensor of several values or a finite value beyond FP32's range. NaN and ±inf pass
    through for the caller's own range check.
    """
    if isinstance(value, torch.Tensor):
        require_data(value, name=name, where=where)
        if not value.is_floating_point():
            raise TypeError(
                f"{where}: {name} must be a floating-point scalar tensor, got dtype {value.dtype}"
            )
        if value.numel() != 1:
            raise ValueError(
                f"{where}: {name} must hold one value (shape () or (1,)), got shape "
                f"{tuple(value.shape)}"
            )
        scalar = value.detach().reshape(())
    elif isinstance(value, numbers.Real) and not isinstance(value, bool):
        try:
            scalar = torch.tensor(float(value), dtype=torch.float64)
        except OverflowError:  # an int beyond float64
            raise ValueError(
                f"{where}: {name} is an integer of {int(value).bit_length()} bits, which exceeds "
                f"FP32's range (|x| <= {FLOAT32_MAX:.7g})"
            ) from None
    else:
        raise TypeError(
            f"{where}: {name} must be a real number (int, float or a one-element floating "
            f"tensor), got {type(value).__name__} {value!r:.40}"
        )
    return to_float32(scalar, name=name, where=where).to(device)


def fp8_scale_shape(
    rows: int, cols: int, method: str, block: tuple[int, int] | None, *, where: str
) -> tuple[int, ...]:
    """The stored shape of an ``(rows, cols)`` FP8 weight's inverse scales in one layout.

    ``()`` for ``tensor``, ``(rows,)`` for ``row``, ``(rows // br, cols // bc)`` for ``block``
    with ``block = (br, bc)`` (block rows index output rows). ``ValueError`` (named with
    ``where``) when the block does not tile the weight: floatxq never pads.

    Example:
      >>> fp8_scale_shape(256, 512, "block", (128, 128), where="f")
      (2, 4)
    """
    if method == "tensor":
        return ()
    if method == "row":
        return (rows,)
    if method != "block" or block is None:
        raise ValueError(f"{where}: unknown scale layout {method!r} with block {block!r}")
    br, bc = block
    if br <= 0 or bc <= 0 or rows % br or cols % bc:
        raise ValueError(
            f"{where}: weight shape ({rows}, {cols}) is not divisible by weight_block_size "
            f"{[br, bc]} (block rows index output rows); floatxq never pads"
        )
    return (rows // br, cols // bc)


JSON_MAX_DEPTH = 64
"""Deepest nesting of objects and arrays a metadata document may have (real ones use < 10)."""
JSON_MAX_BYTES = 100 * 1024 * 1024
"""Largest metadata document read (safetensors' own header limit)."""
JSON_MAX_INT_DIGITS = 30
"""Longest integer literal accepted (byte counts and sizes need under 20 digits)."""
_JSON_STRING = re.compile(r'"(?:[^"\\]|\\.)*"', re.DOTALL)
_JSON_BRACKET = re.compile(r"[\[\]{}]")


class _JSONNumbers:
    """The number hooks of :func:`bounded_json_loads` for one call (a class, not closures: no
    per-call function objects)."""

    __slots__ = ("error", "where")

    def __init__(self, where: str, error: type[Exception]) -> None:
        self.where, self.error = where, error

    def integer(self, literal: str) -> int:
        digits = len(literal.lstrip("-"))
        if digits > JSON_MAX_INT_DIGITS:
            raise self.error(
                f"{self.where}: an integer of {digits} digits (at most {JSON_MAX_INT_DIGITS} "
                f"are read)"
            )
        return int(literal)

    def real(self, literal: str) -> float:
        value = float(literal)
        if not math.isfinite(value):
            raise self.error(f"{self.where}: the number {literal[:40]} overflows a float")
        return value

    def constant(self, name: str) -> float:
        raise self.error(
            f"{self.where}: {name} is not a finite number; JSON metadata must not hold it"
        )


def bounded_json_loads(
    text: str | bytes,
    *,
    where: str,
    error: type[Exception] = ValueError,
    max_depth: int = JSON_MAX_DEPTH,
    max_bytes: int = JSON_MAX_BYTES,
    object_pairs_hook: Any = None,
) -> Any:
    """``json.loads`` for untrusted metadata, failing with ``error`` (naming ``where``) instead
    of ``RecursionError``, ``OverflowError`` or a bare ``JSONDecodeError``.

    Refused: more than ``max_bytes`` bytes, nesting deeper than ``max_depth``, an integer of
    more than ``JSON_MAX_INT_DIGITS`` digits, a non-finite number (``NaN``, ``Infinity``, or a
    float literal that overflows), text that is not UTF-8 or not JSON. ``object_pairs_hook`` is
    passed to ``json.loads`` (what it raises propagates).

    Example:
      >>> bounded_json_loads('{"a": [1, 2.5]}', where="config.json")
      {'a': [1, 2.5]}
      >>> bounded_json_loads("[" * 100 + "]" * 100, where="config.json")
      Traceback (most recent call last):
      ...
      ValueError: config.json: JSON nested deeper than 64 levels
    """
    if isinstance(text, bytes | bytearray):
        if len(text) > max_bytes:
            raise error(f"{where}: {len(text)} bytes of JSON, more than the {max_bytes} read")
        try:
            text = bytes(text).decode("utf-8")
        except UnicodeDecodeError as exc:
            raise error(f"{where}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    elif not isinstance(text, str):
        raise error(f"{where}: expected JSON text, got {type(text).__name__}")
    elif len(text) > max_bytes:
        raise error(f"{where}: {len(text)} characters of JSON, more than the {max_bytes} read")
    depth = deepest = 0
    for match in _JSON_BRACKET.finditer(_JSON_STRING.sub("", text)):
        depth += 1 if match.group() in "[{" else -1
        deepest = max(deepest, depth)
        if deepest > max_depth:
            raise error(f"{where}: JSON nested deeper than {max_depth} levels")
    numbers = _JSONNumbers(where, error)
    try:
        return json.loads(
            text,
            parse_int=numbers.integer,
            parse_float=numbers.real,
            parse_constant=numbers.constant,
            object_pairs_hook=object_pairs_hook,
        )
    except json.JSONDecodeError as exc:
        raise error(f"{where}: not valid JSON ({exc.msg} at line {exc.lineno})") from None
    except RecursionError:  # (the bracket count above makes this unreachable; kept as a net)
        raise error(f"{where}: JSON nested too deeply") from None


def fp16_bias(bias: Any, out_features: int, device: torch.device, *, where: str) -> Tensor:
    """The bias as stored: FP16 ``(out,)``; a value FP16 cannot hold is an error, never inf."""
    require_floating(bias, name="bias", where=where)
    require_shape(bias, (out_features,), name="bias", where=where)
    b = bias.detach()
    require_finite(b, name="bias", where=where)
    if b.numel() and bool((b.abs() > FP16_MAX).any()):
        worst = float(b.abs().max())
        raise ValueError(
            f"{where}: bias is stored as float16 (the FP8 checkpoint format), whose finite range "
            f"is ±{FP16_MAX:g}; got |bias| up to {worst:g}, which would become inf"
        )
    return b.to(device=device, dtype=torch.float16)


def check_fp8_operands(qweight: Any, scale_inv: Any, *, where: str) -> None:
    """FP8 codes and their scales as a module wraps them: ``TypeError`` for non-FP8 codes or
    non-floating scales, ``ValueError`` for codes that are not 2-D ``(out, in)``."""
    from floatxq.formats import FP8_DTYPES

    if not isinstance(qweight, torch.Tensor) or qweight.dtype not in FP8_DTYPES:
        got = qweight.dtype if isinstance(qweight, torch.Tensor) else type(qweight).__name__
        raise TypeError(f"{where}: qweight must be an FP8 tensor, got {got}")
    if qweight.ndim != 2:
        raise ValueError(f"{where}: qweight must be 2-D (out, in), got {tuple(qweight.shape)}")
    if not isinstance(scale_inv, torch.Tensor) or not scale_inv.is_floating_point():
        got = scale_inv.dtype if isinstance(scale_inv, torch.Tensor) else type(scale_inv)
        raise TypeError(f"{where}: scale_inv must be a floating tensor, got {got}")


def stored_fp8_scale(
    scale_inv: Tensor, qweight: Tensor, method: str, block: tuple[int, int] | None, *, where: str
) -> Tensor:
    """``scale_inv`` as an FP8 module stores it for ``method`` / ``block``: FP32 on the codes'
    device, in the layout's exact shape; ``ValueError`` for a shape that does not fit the layout
    or values that are not finite and > 0."""
    rows, cols = qweight.shape
    expected = fp8_scale_shape(rows, cols, method, block, where=where)
    if not scale_fits_layout(tuple(scale_inv.shape), expected, method):
        raise ValueError(
            f"{where}: scale_inv shape {tuple(scale_inv.shape)} does not fit the {method} "
            f"layout of a {tuple(qweight.shape)} weight"
            + (f" with block {list(block)}" if block else "")
            + f"; expected {expected}"
        )
    scale = scale_inv.detach().to(device=qweight.device, dtype=torch.float32)
    scale = scale.reshape(expected).contiguous()
    if scale.numel() and not bool((torch.isfinite(scale) & (scale > 0)).all()):
        raise ValueError(
            f"{where}: scale_inv must be finite and > 0 (codes are divided by it); got "
            f"values in [{float(scale.min()):g}, {float(scale.max()):g}]"
        )
    return scale


def scale_fits_layout(shape: tuple[int, ...], expected: tuple[int, ...], method: str) -> bool:
    """Whether a stored scale tensor holds the layout's values in its order (size-1 axes aside)."""
    if shape == expected:
        return True
    count = 1
    for s in shape:
        count *= s
    if method == "tensor":
        return count == 1 and len(shape) <= 2
    squeezed = tuple(s for s in shape if s != 1)
    want = tuple(s for s in expected if s != 1)
    if method == "block" and len(shape) == 1:  # a flattened grid (row-major), as infer accepts
        return count == (expected[0] * expected[1] if expected else 1)
    return squeezed == want and len(shape) <= 2


def fp8_state_problems(
    state_dict: dict[str, Any],
    prefix: str,
    dtype: torch.dtype,
    out_features: int,
    *,
    bias: bool,
    input_scale: bool = False,
) -> tuple[dict[str, Any], list[tuple[str, str]]]:
    """``(replacements, (key, message) problems)`` of an incoming FP8-linear state dict: codes
    of another FP8 dtype (bytes are never cast), inverse scales that are not finite and > 0, a
    bias :func:`fp16_bias` refuses are problems; with ``input_scale``, the static activation
    scale as :func:`scalar_scale_entries` takes it. Meta and empty tensors pass."""
    names = ("input_scale",) if input_scale else ()
    replaced, problems = scalar_scale_entries(state_dict, prefix, names, what="static input scale")
    key = prefix + "weight"
    incoming = state_dict.get(key)
    if isinstance(incoming, torch.Tensor) and incoming.dtype != dtype:
        fmt = str(dtype).removeprefix("torch.")
        problems.append((key, (
            f"{key}: codes of dtype {incoming.dtype} cannot load into this {fmt} module (FP8 "
            f"codes are bytes and are never cast); build it with "
            f"format={str(incoming.dtype).removeprefix('torch.')!r}"
        )))  # fmt: skip
    key = prefix + "weight_scale_inv"
    incoming = state_dict.get(key)
    if (
        isinstance(incoming, torch.Tensor)
        and incoming.is_floating_point()
        and incoming.device.type != "meta"
        and incoming.numel()
        and not bool((torch.isfinite(incoming) & (incoming > 0)).all())
    ):
        problems.append((key, (
            f"{key}: inverse scales must be finite and > 0 (codes are divided by them); got "
            f"values in [{float(incoming.min()):g}, {float(incoming.max()):g}]"
        )))  # fmt: skip
    key = prefix + "bias"
    incoming = state_dict.get(key)
    if isinstance(incoming, torch.Tensor) and bias:
        try:
            fp16_bias(incoming, out_features, incoming.device, where=key)
        except (TypeError, ValueError) as exc:
            problems.append((key, str(exc)))
    return replaced, problems


def check_model_dtype(dtype: Any, *, where: str) -> torch.dtype:
    """A model dtype: float16, bfloat16 or float32 (``ValueError`` otherwise)."""
    if dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(
            f"{where}: dtype must be torch.float16, torch.bfloat16 or torch.float32, got {dtype}"
        )
    return dtype


def positive_scale(value: Any, *, name: str, where: str, device: Any) -> Tensor:
    """One positive finite real number (:func:`real_scalar`'s kinds) as a 0-d FP32 tensor on
    ``device``: ``ValueError`` naming ``name`` for zero, negative, NaN or infinity."""
    g = real_scalar(value, name=name, where=where, device=torch.device("cpu"))
    if not (math.isfinite(g.item()) and g.item() > 0):
        raise ValueError(f"{where}: {name} must be finite and > 0, got {g.item()!r}")
    return g.to(device)


def fp4_state_problems(
    state_dict: dict[str, Any], prefix: str, scalars: tuple[str, ...]
) -> tuple[dict[str, Any], list[tuple[str, str]]]:
    """``(replacements, (key, message) problems)`` of an incoming NVFP4-linear state dict:
    ``weight`` as ``float4_e2m1fn_x2`` and ``weight_scale`` as uint8 are viewed as the stored
    bytes, any other dtype is refused (bytes are never converted); each one-value scale named in
    ``scalars`` (``weight_scale_2``, ``input_scale``) becomes a 0-d FP32 tensor, refused unless
    finite and > 0. Other shapes are left to ``nn.Module``'s size check."""
    replaced: dict[str, Any] = {}
    problems = []
    for name, want, also in (
        ("weight", torch.uint8, getattr(torch, "float4_e2m1fn_x2", None)),
        ("weight_scale", torch.float8_e4m3fn, torch.uint8),
    ):
        key = prefix + name
        incoming = state_dict.get(key)
        if not isinstance(incoming, torch.Tensor) or incoming.dtype == want:
            continue
        if incoming.dtype == also:
            replaced[key] = incoming.view(want)
            continue
        problems.append((key, (
            f"{key}: got dtype {incoming.dtype}; the NVFP4 {name} is {want} bytes (or {also}) "
            f"and is never converted"
        )))  # fmt: skip
    for name in scalars:
        what = "activation global scale" if name == "input_scale" else "tensor scale"
        more, found = scalar_scale_entries(state_dict, prefix, (name,), what=what)
        replaced.update(more)
        problems.extend(found)
    return replaced, problems


def scalar_scale_entries(
    state_dict: dict[str, Any], prefix: str, names: tuple[str, ...], *, what: str
) -> tuple[dict[str, Any], list[tuple[str, str]]]:
    """``(replacements, (key, message) problems)`` for one-value scales of an incoming state
    dict: each named entry holding one value becomes a 0-d FP32 tensor, refused (as ``what``)
    unless finite and > 0; meta tensors and other shapes are left to ``nn.Module``'s checks."""
    replaced: dict[str, Any] = {}
    problems = []
    for name in names:
        key = prefix + name
        incoming = state_dict.get(key)
        if not isinstance(incoming, torch.Tensor) or incoming.numel() != 1 or incoming.is_meta:
            continue
        g = incoming.detach().float().reshape(())
        if bool(torch.isfinite(g)) and bool(g > 0):
            replaced[key] = g
        else:
            problems.append((key, f"{key}: the {what} must be finite and > 0, got {g.item()!r}"))
    return replaced, problems


def check_linear_input(x: Any, in_features: int, device: torch.device, *, where: str) -> None:
    """A linear module's input: a floating tensor ``(*, in_features)`` on ``device`` (where the
    module's buffers are): ``TypeError`` for another kind, dtype or device, ``ValueError`` for
    another last axis."""
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        got = x.dtype if isinstance(x, torch.Tensor) else type(x).__name__
        raise TypeError(f"{where}: x must be a floating tensor, got {got}")
    if x.ndim == 0 or x.shape[-1] != in_features:
        raise ValueError(f"{where}: x must have shape (*, {in_features}), got {tuple(x.shape)}")
    if x.device != device:
        raise TypeError(
            f"{where}: x is on {x.device} but the module's buffers are on {device}; move one "
            f"of them with .to()"
        )


def check_size(value: Any, *, name: str, where: str) -> int:
    """A size argument: a non-negative int (``TypeError`` / ``ValueError`` otherwise)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{where}: {name} must be an int, got {type(value).__name__}")
    if value < 0:
        raise ValueError(f"{where}: {name} must be >= 0, got {value}")
    return value


def check_group_size(group_size: Any, *, where: str) -> int:
    """A GPTQ group size: -1 (one group) or an int >= 1."""
    if isinstance(group_size, bool) or not isinstance(group_size, int):
        raise TypeError(
            f"{where}: group_size must be an int (-1 or >= 1), got {type(group_size).__name__}"
        )
    if group_size != -1 and group_size < 1:
        raise ValueError(f"{where}: group_size must be -1 (one group) or >= 1, got {group_size}")
    return group_size


def check_float_dtype(dtype: Any, *, name: str, where: str) -> torch.dtype:
    """A floating ``torch.dtype`` (``TypeError`` otherwise)."""
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(f"{where}: {name} must be a floating torch.dtype, got {dtype!r}")
    return dtype


def contiguous_group(
    g_idx: Tensor, in_features: int, group_size: int, seen: Any
) -> tuple[int | None, Any]:
    """``(size, seen)``: ``GPTQLinear.contiguous_group_size`` of a ``g_idx`` (``group_size``
    ``-1``: one group), checked once per tensor and version (one host sync) and remembered in
    ``seen`` (pass back the returned one); during CUDA graph capture an unchecked ``g_idx``
    answers None (the kernels then read each row's group: always correct)."""
    key = (g_idx.data_ptr(), g_idx._version, g_idx.device)
    if seen is not None and seen[0] == key:
        return seen[1], seen
    if g_idx.is_cuda and torch.cuda.is_current_stream_capturing():
        return None, seen
    size = in_features if group_size == -1 else group_size
    rows = torch.arange(in_features, device=g_idx.device, dtype=torch.int64)
    contiguous = bool(torch.equal(g_idx.to(torch.int64), rows // max(size, 1)))
    seen = (key, size if contiguous else None)
    return seen[1], seen


def check_gptq_state(
    state_dict: dict[str, Any], prefix: str, buffers: dict[str, Any], *, in_features: int,
    out_features: int, bits: int, group_size: int, groups: int,
) -> tuple[dict[str, Any], dict[str, Any]]:  # fmt: skip
    """A GPTQ module's incoming state-dict tensors checked (``ValueError`` naming the key):
    shapes, int32 words, integer ``g_idx`` within the groups, finite floating scales and bias.
    Returns ``(replaced, adopt)``: entries to replace (``g_idx`` as int32) and the buffers to
    reallocate in an incoming floating dtype (``buffers``: the module's, not changed here)."""
    per = 32 // bits
    out = out_features
    shapes = {
        "qweight": (in_features // per, out),
        "qzeros": (groups, out // per),
        "scales": (groups, out),
        "g_idx": (in_features,),
        "bias": (out,),
    }
    replaced: dict[str, Tensor] = {}
    adopt: dict[str, Tensor] = {}
    for name, shape in shapes.items():
        key = prefix + name
        if key not in state_dict or buffers.get(name) is None:
            continue  # missing / unexpected keys are the loader's to report
        t = state_dict[key]
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{key}: expected a tensor, got {type(t).__name__}")
        if tuple(t.shape) != shape:
            raise ValueError(
                f"{key}: expected shape {shape} for this GPTQLinear (in={in_features}, "
                f"out={out}, bits={bits}, group_size={group_size}), got "
                f"{tuple(t.shape)}"
            )
        if name in ("qweight", "qzeros") and t.dtype != torch.int32:
            raise ValueError(
                f"{key}: packed GPTQ words are int32, got {t.dtype} (bytes are never converted)"
            )
        if name == "g_idx":
            if t.is_floating_point() or t.is_complex() or t.dtype == torch.bool:
                raise ValueError(f"{key}: g_idx must hold integers, got {t.dtype}")
            if not t.is_meta and t.numel():
                low, high = int(t.min()), int(t.max())
                if low < 0 or high >= groups:
                    raise ValueError(
                        f"{key}: every group index must lie in [0, {groups - 1}] "
                        f"({groups} group(s)), got values in [{low}, {high}]"
                    )
            if t.dtype != torch.int32:
                replaced[key] = t.to(torch.int32)
        if name in ("scales", "bias"):
            if not t.is_floating_point():
                raise ValueError(f"{key}: {name} must be floating, got {t.dtype}")
            if not t.is_meta and t.numel() and not bool(torch.isfinite(t).all()):
                raise ValueError(f"{key}: {name} contains NaN or infinity")
            held = buffers[name]
            if held is not None and held.dtype != t.dtype:
                adopt[name] = torch.empty(shape, dtype=t.dtype, device=held.device)
    return replaced, adopt


def stored_bias_of(
    bias: Any, out_features: int, dtype: torch.dtype | None, device: Any, *, where: str
) -> Tensor:
    """A module's bias as stored: floating ``(out,)``, in ``dtype`` (``None``: its own), on
    ``device``, finite (``TypeError`` / ``ValueError`` naming what is wrong)."""
    if not isinstance(bias, torch.Tensor) or not bias.is_floating_point():
        got = bias.dtype if isinstance(bias, torch.Tensor) else type(bias).__name__
        raise TypeError(f"{where}: bias must be a floating tensor or None, got {got}")
    if tuple(bias.shape) != (out_features,):
        raise ValueError(
            f"{where}: bias must have shape ({out_features},), got {tuple(bias.shape)}"
        )
    b = bias.detach()
    if dtype is not None:
        b = b.to(device=device, dtype=dtype)
    if not b.is_meta and b.numel() and not bool(torch.isfinite(b).all()):
        stored = f" once stored as {dtype}" if dtype is not None else ""
        raise ValueError(
            f"{where}: bias contains NaN or infinity{stored}; finite values are required"
        )
    return b.to(device=device)
