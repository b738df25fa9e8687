"""Format names, aliases, constants and codebooks: every magic number of floatxq lives here.

Nothing in this module touches tensor data. It answers "which format is this name?", "what is its
largest finite value?" and "which NVFP4 scale recipe is this?", with the errors SPEC §1 gives.
"""

import enum
import math
from collections.abc import Mapping
from typing import Any

import torch

# --------------------------------------------------------------------------------------------
# Constants
# --------------------------------------------------------------------------------------------

FP8_E4M3_MAX: float = 448.0
"""Largest finite ``float8_e4m3fn`` value (bit pattern ``0x7E``)."""

FP4_E2M1_MAX: float = 6.0
"""Largest E2M1 magnitude."""

E2M1_VALUES: tuple[float, ...] = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
"""E2M1 magnitudes indexed by the 3-bit magnitude code; bit 3 of a 4-bit code is the sign."""

NVFP4_BLOCK: int = 16
"""Elements per NVFP4 block (one E4M3 scale each), taken along the last (K) axis."""

NVFP4_E4M3_SEARCH_RADIUS: int = 8
"""Offsets ``-8..8`` around the least-squares scale code tried by ``least_squares_grid``."""

NVFP4_SCALE_MIN: float = 2.0**-9
"""Smallest positive E4M3 value (subnormal code 1): the lower clamp for NVFP4 block scales."""

NVFP4_SCALE_MAX: float = FP8_E4M3_MAX
"""Upper clamp for NVFP4 block scales."""

FLOAT32_TINY: float = float(torch.finfo(torch.float32).tiny)
"""Smallest positive normal float32 (``FLT_MIN``), the seed's amax floor."""

FLOAT32_MAX: float = float(torch.finfo(torch.float32).max)
"""Largest finite float32: no inverse scale floatxq writes exceeds it."""

FLOAT32_SMALLEST_SUBNORMAL: float = 2.0**-149
"""Smallest positive float32, used where a direct scale would otherwise underflow to zero."""

GPTQ_W4A_GROUP_SIZE: int = 128
"""Group size that every W4A (FP8/NVFP4 activation) GPTQ checkpoint uses."""

# --------------------------------------------------------------------------------------------
# FP8 format names
# --------------------------------------------------------------------------------------------

FP8_FORMATS: tuple[str, ...] = (
    "float8_e4m3fn",
    "float8_e5m2",
    "float8_e4m3fnuz",
    "float8_e5m2fnuz",
    "float8_e8m0fnu",
)
"""Canonical FP8 names (torch dtype names) in the seed's registry order."""

FP8_DECODE_ONLY_FORMATS: frozenset[str] = frozenset({"float8_e8m0fnu"})
"""Formats floatxq decodes (MX scales) but never quantizes weights to."""

_FP8_ALIASES: dict[str, str] = {
    "e4m3": "float8_e4m3fn",
    "float8_e4m3": "float8_e4m3fn",
    "float8_e4m3fn": "float8_e4m3fn",
    "e5m2": "float8_e5m2",
    "float8_e5m2": "float8_e5m2",
    "e4m3fnuz": "float8_e4m3fnuz",
    "float8_e4m3fnuz": "float8_e4m3fnuz",
    "e5m2fnuz": "float8_e5m2fnuz",
    "float8_e5m2fnuz": "float8_e5m2fnuz",
    "e8m0": "float8_e8m0fnu",
    "e8m0fnu": "float8_e8m0fnu",
    "float8_e8m0": "float8_e8m0fnu",
    "float8_e8m0fnu": "float8_e8m0fnu",
    # The FP8 family name (and FORMAT.FP8, a str enum equal to "fp8") means the default dtype.
    "": "float8_e4m3fn",
    "fp8": "float8_e4m3fn",
}

_FP8_MAX: dict[str, float] = {
    "float8_e4m3fn": 448.0,
    "float8_e5m2": 57344.0,
    "float8_e4m3fnuz": 240.0,
    "float8_e5m2fnuz": 57344.0,
    "float8_e8m0fnu": 2.0**127,
}

FP8_SCALE_METHODS: tuple[str, ...] = ("tensor", "row", "block")
FP8_SCALE_SEMANTICS: tuple[str, ...] = ("inverse",)


def _accepted(names: object) -> str:
    return ", ".join(repr(n) for n in names)  # type: ignore[union-attr]


def normalize_fp8_format(value: Any) -> str:
    """Canonical torch dtype name of an FP8 format name or alias.

    Args:
      value: a name or alias (``"e4m3"``, ``"float8_e5m2"``, ``"E8M0"`` ...), ``None``, ``""``,
        ``"fp8"`` / ``FORMAT.FP8`` (all meaning ``float8_e4m3fn``), or an FP8 ``torch.dtype``.

    Returns:
      One of :data:`FP8_FORMATS` that the installed torch provides.

    Raises:
      ValueError: unknown alias, another ``FORMAT`` member, or a dtype this torch lacks.
      TypeError: a value that is neither a string, ``None`` nor a ``torch.dtype``.

    Numerics: names only; no tensor is touched.

    Example:
      >>> normalize_fp8_format(" E4M3 ")
      'float8_e4m3fn'
    """
    if value is None:
        return "float8_e4m3fn"
    if isinstance(value, torch.dtype):
        key = str(value).removeprefix("torch.")
    elif isinstance(value, str):
        key = str.lower(str.strip(value))
    else:
        raise TypeError(
            f"format must be a string, None or an FP8 torch.dtype; got {type(value).__name__} "
            f"{value!r}. Accepted names: {_accepted(sorted(_FP8_ALIASES))}"
        )
    if key not in _FP8_ALIASES:
        shown = (
            f"{type(value).__name__}.{value.name}" if isinstance(value, enum.Enum) else repr(value)
        )
        raise ValueError(
            f"format: unsupported FP8 format {shown}. Accepted names: "
            f"{_accepted(sorted(k for k in _FP8_ALIASES if k))} (or None / '' / 'fp8' for "
            f"float8_e4m3fn)"
        )
    canonical = _FP8_ALIASES[key]
    if not hasattr(torch, canonical):
        raise ValueError(
            f"format: the installed PyTorch {torch.__version__} does not provide torch.{canonical} "
            f"(requested as {value!r})"
        )
    return canonical


def fp8_dtype(name: Any) -> torch.dtype:
    """The ``torch.dtype`` of an FP8 format name or alias (normalized first).

    Numerics: names only. Example: ``fp8_dtype("e5m2") is torch.float8_e5m2``.
    """
    return getattr(torch, normalize_fp8_format(name))


def fp8_max(name: Any) -> float:
    """Largest finite value of an FP8 format: 448, 57344, 240, 57344 and ``2**127`` (E8M0).

    Numerics: exact; equals ``torch.finfo(fp8_dtype(name)).max``.

    Example: ``fp8_max("e4m3") == 448.0``.
    """
    return _FP8_MAX[normalize_fp8_format(name)]


def _positive_int(item: Any, *, what: str, value: Any) -> int:
    if isinstance(item, bool):
        raise ValueError(f"{what}: expected positive integers, got a bool in {value!r}")
    if isinstance(item, float):
        if not (math.isfinite(item) and item.is_integer()):
            raise ValueError(f"{what}: expected positive integers, got {item!r} in {value!r}")
        item = int(item)
    try:
        number = int(item)
    except (TypeError, ValueError):
        raise ValueError(f"{what}: expected positive integers, got {item!r} in {value!r}") from None
    if number <= 0:
        raise ValueError(f"{what}: expected positive integers, got {number} in {value!r}")
    return number


def normalize_fp8_block_size(value: Any) -> tuple[int, int] | None:
    """``None`` or a positive ``(block_rows, block_cols)`` pair; divisibility is not checked.

    Block rows index output rows (weight storage order), block columns index input columns.

    Raises:
      ValueError: not a 2-item list/tuple, or an item that is not a positive integer.

    Numerics: names only. Example: ``normalize_fp8_block_size([128, 128]) == (128, 128)``.
    """
    if value is None:
        return None
    if not isinstance(value, (list, tuple)) or len(value) != 2:
        raise ValueError(
            f"weight_block_size: expected None or a 2-item list/tuple [block_rows, block_cols] of "
            f"positive integers, got {value!r}"
        )
    rows, cols = (_positive_int(v, what="weight_block_size", value=value) for v in value)
    return (rows, cols)


def normalize_fp8_scale_method(value: Any, *, weight_block_size: Any) -> str:
    """Resolve the FP8 scale layout: ``tensor``, ``row`` or ``block``.

    ``None`` means ``block`` when a block size is given and ``row`` otherwise.

    Raises:
      ValueError: an unknown method, ``block`` without a block size, or a block size with a
        non-block method.

    Numerics: names only.

    Example: ``normalize_fp8_scale_method(None, weight_block_size=None) == "row"``.
    """
    block = normalize_fp8_block_size(weight_block_size)
    if value is None:
        return "block" if block is not None else "row"
    if not isinstance(value, str):
        raise ValueError(
            f"weight_scale_method: expected one of {_accepted(FP8_SCALE_METHODS)}, got {value!r}"
        )
    method = str.lower(str.strip(value))
    if method not in FP8_SCALE_METHODS:
        raise ValueError(
            f"weight_scale_method: expected one of {_accepted(FP8_SCALE_METHODS)}, got {value!r}"
        )
    if method == "block" and block is None:
        raise ValueError(
            "weight_scale_method='block' needs weight_block_size=[block_rows, block_cols]; got None"
        )
    if method != "block" and block is not None:
        raise ValueError(
            f"weight_block_size={list(block)} is only valid with weight_scale_method='block'; "
            f"got weight_scale_method={value!r}"
        )
    return method


def normalize_fp8_scale_semantics(value: Any) -> str:
    """``None`` → ``"inverse"``; ``"inverse"`` (any case/space) is the only accepted value.

    Inverse semantics: the stored ``scale_inv`` multiplies to quantize and divides to decode.

    Numerics: names only. Example: ``normalize_fp8_scale_semantics(" Inverse ") == "inverse"``.
    """
    if value is None:
        return "inverse"
    if isinstance(value, str) and str.lower(str.strip(value)) in FP8_SCALE_SEMANTICS:
        return "inverse"
    raise ValueError(
        f"weight_scale_semantics: expected one of {_accepted(FP8_SCALE_SEMANTICS)}, got {value!r}"
    )


def normalize_fp8_kwargs(payload: Mapping[str, Any]) -> dict[str, Any]:
    """Normalize a saved or user FP8 payload (legacy keys included) into ``FP8Config`` fields.

    Returns a new dict (``payload`` is not modified):
      * legacy ``fmt`` is used when ``format`` is absent, and dropped;
      * ``format`` becomes the canonical dtype name, ``weight_block_size`` a list or ``None``,
        ``weight_scale_method`` is resolved against the block size;
      * legacy ``weight_only`` is dropped; when neither ``smoother`` nor ``smooth`` is given and it
        is a mapping carrying ``smoother`` (or ``smooth``), that setting becomes ``smoother``.

    Numerics: names only.

    Example:
      >>> normalize_fp8_kwargs({"fmt": "e5m2", "weight_block_size": (128, 128)})["format"]
      'float8_e5m2'
    """
    if not isinstance(payload, Mapping):
        raise TypeError(f"payload: expected a mapping, got {type(payload).__name__}")
    out = dict(payload)
    weight_only = out.pop("weight_only", None)
    fmt = out.pop("fmt", None)
    if "smoother" not in out and "smooth" not in out and isinstance(weight_only, Mapping):
        for key in ("smoother", "smooth"):
            if weight_only.get(key) is not None:
                out["smoother"] = weight_only[key]
                break
    out["format"] = normalize_fp8_format(out["format"] if "format" in out else fmt)
    block = normalize_fp8_block_size(out.get("weight_block_size"))
    out["weight_block_size"] = list(block) if block is not None else None
    out["weight_scale_method"] = normalize_fp8_scale_method(
        out.get("weight_scale_method"), weight_block_size=block
    )
    return out


# --------------------------------------------------------------------------------------------
# NVFP4 scale recipes
# --------------------------------------------------------------------------------------------

NVFP4_RECIPES: tuple[str, ...] = (
    "nvidia",
    "nvidia_headroom",
    "four_six",
    "least_squares",
    "least_squares_headroom",
    "least_squares_grid",
    "exhaustive",
)
"""Canonical NVFP4 block-scale recipes; ``exhaustive`` (all 126 positive E4M3 scales) is new."""

NVFP4_LEGACY_RECIPE_ALIASES: Mapping[str, str] = {
    "lsq": "least_squares",
    "lsq_headroom": "least_squares_headroom",
    "lsq_grid": "least_squares_grid",
}

_HEADROOM_LOCAL: Mapping[str, str] = {
    "nvidia_headroom": "nvidia",
    "least_squares_headroom": "least_squares",
}


def normalize_nvfp4_recipe(recipe: Any) -> str:
    """Canonical NVFP4 scale-recipe name (legacy ``lsq*`` aliases expanded).

    Raises:
      ValueError: a non-string or an unknown name (the message lists the accepted names).

    Numerics: names only. Example: ``normalize_nvfp4_recipe("lsq_grid") == "least_squares_grid"``.
    """
    accepted = f"{_accepted(NVFP4_RECIPES)} (legacy: {_accepted(NVFP4_LEGACY_RECIPE_ALIASES)})"
    if not isinstance(recipe, str):
        raise ValueError(f"Unsupported NVFP4 scale recipe: {recipe!r}. Accepted: {accepted}")
    name = NVFP4_LEGACY_RECIPE_ALIASES.get(recipe, recipe)
    if name not in NVFP4_RECIPES:
        raise ValueError(f"Unsupported NVFP4 scale recipe: {recipe!r}. Accepted: {accepted}")
    return name


def nvfp4_kernel_recipe(recipe: Any) -> str:
    """The local (per-block) algorithm of a recipe: headroom variants map to their base recipe.

    Numerics: names only. Example: ``nvfp4_kernel_recipe("nvidia_headroom") == "nvidia"``.
    """
    name = normalize_nvfp4_recipe(recipe)
    return _HEADROOM_LOCAL.get(name, name)


def nvfp4_uses_headroom(recipe: Any) -> bool:
    """True for ``nvidia_headroom`` and ``least_squares_headroom``; ``None`` gives False.

    Numerics: names only. Example: ``nvfp4_uses_headroom("lsq_headroom") is True``.
    """
    if recipe is None:
        return False
    return normalize_nvfp4_recipe(recipe) in _HEADROOM_LOCAL
