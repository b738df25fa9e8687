"""Format names, aliases, constants and codebooks: every magic number of floatxq lives here.

Nothing in this module touches tensor data. It answers "which format is this name?", "what is its
largest finite value?" and "which NVFP4 scale recipe is this?"; a bad name raises an error that
names the argument, the value and the accepted names. The ``Literal`` aliases (``FP8Format``,
``FP8ScaleMethod``, ``GPTQFormat``, ``NVFP4Recipe`` ...) are the canonical names the normalizers
return and the pure functions accept.
"""

import enum
import math
import typing
from collections.abc import Mapping
from typing import Literal

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

SWIZZLE_TILE_ROWS: int = 128
"""Rows of one ``SWIZZLE_32_4_4`` tile of NVFP4 block scales (``rows x 4`` scales per tile)."""

SWIZZLE_TILE_COLS: int = 4
"""Scale columns (blocks of 16 along K) of one ``SWIZZLE_32_4_4`` tile."""

NVFP4_E4M3_SEARCH_RADIUS: int = 8
"""Offsets ``-8..8`` around the least-squares scale code tried by ``least_squares_grid``."""

NVFP4_SCALE_MIN: float = 2.0**-9
"""Smallest positive E4M3 value (subnormal code 1): the lower clamp for NVFP4 block scales."""

NVFP4_SCALE_MAX: float = FP8_E4M3_MAX
"""Upper clamp for NVFP4 block scales."""

FP16_MAX: float = 65504.0
"""Largest finite float16 value (``torch.finfo(torch.float16).max``)."""

MODEL_DTYPES: tuple[torch.dtype, ...] = (torch.float16, torch.bfloat16, torch.float32)
"""The floating dtypes floatxq's layers read and write (activations, outputs, model weights)."""

FLOAT32_TINY: float = float(torch.finfo(torch.float32).tiny)
"""Smallest positive normal float32 (``FLT_MIN``): the amax floor of FP8 weight scales."""

FLOAT32_MAX: float = float(torch.finfo(torch.float32).max)
"""Largest finite float32: no inverse scale floatxq writes exceeds it."""

FLOAT32_SMALLEST_SUBNORMAL: float = 2.0**-149
"""Smallest positive float32, used where a direct scale would otherwise underflow to zero."""

FP8_WEIGHT_BAND_ELEMENTS: int = 1 << 20
"""Elements of one band of rows that :func:`floatxq.fp8_bands.quantize_fp8_weight_banded` converts
to FP32 at a time (4 MiB per FP32 temporary; a whole 5632 x 2048 weight's are 46 MB each)."""

GPTQ_BITS: tuple[int, ...] = (2, 3, 4, 5, 6, 8)
"""Code widths the GPTQ solver and checkpoints accept."""

K_GROUP: int = 128
"""The 128-wide K group: the group size of every W4A (FP8/NVFP4 activation) GPTQ checkpoint, the K
span of one FP8 blockwise scale (``(1, 128)`` activations, ``(128, 128)`` weights) and one staged
NVFP4 operand group (eight blocks of 16)."""

DECODE_TILE_ROWS: int = 128
"""Input rows of one tile of the decode words (:mod:`floatxq.gptq.decode_words`): 32 int16 rows
of four 4-bit codes each."""

DECODE_SLICE_ROWS: int = 32
"""Input rows one nibble position of a decode-words tile holds (a quarter of the tile); a group
size that is a multiple of it keeps every slice in one group."""

FRAGMENT_COLUMNS: int = 16
"""Output columns of one fragment-words block (:mod:`floatxq.gptq.fragment_words`): the rows
of one ``mma.sync.m16n8k16`` A operand; out dims are padded to a multiple of it."""


W4AActivationMode = Literal["w4afp8", "w4a_nvfp4"]
"""How a W4A layer quantizes its activations: per-token E4M3, or NVFP4 with swizzled scales."""

W4A_ACTIVATION_MODES: tuple[W4AActivationMode, ...] = ("w4afp8", "w4a_nvfp4")
"""The W4A activation modes, FP8 first."""

NVFP4_DEFAULT_RECIPE: Literal["least_squares"] = "least_squares"
"""The NVFP4 block-scale recipe used when none is named (weights, activations, streams)."""

ACTIVATION_SCALE_BITS: str = "activation_global_scale_bits"
"""The buffer (and checkpoint leaf) name of a W4A-NVFP4 module's activation global scale: one
int32, the bit pattern of an FP32 scale (0.0: derived per call), GPT-QModel's name and form."""

# --------------------------------------------------------------------------------------------
# FP8 format names
# --------------------------------------------------------------------------------------------

FP8Format = Literal[
    "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu"
]
"""A canonical FP8 format name: the name of its ``torch.dtype``."""

FP8_FORMATS: tuple[FP8Format, ...] = (
    "float8_e4m3fn",
    "float8_e5m2",
    "float8_e4m3fnuz",
    "float8_e5m2fnuz",
    "float8_e8m0fnu",
)
"""Canonical FP8 names (torch dtype names): the four encodable formats, then E8M0."""

FP8_DECODE_ONLY_FORMATS: frozenset[FP8Format] = frozenset({"float8_e8m0fnu"})
"""Formats floatxq decodes (MX scales) but never quantizes weights to."""

_FP8_ALIASES: Mapping[str, FP8Format] = {
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

_FP8_MAX: Mapping[FP8Format, float] = {
    "float8_e4m3fn": 448.0,
    "float8_e5m2": 57344.0,
    "float8_e4m3fnuz": 240.0,
    "float8_e5m2fnuz": 57344.0,
    "float8_e8m0fnu": 2.0**127,
}

FP8ScaleMethod = Literal["tensor", "row", "block"]
"""An FP8 weight-scale layout: one scale per tensor, per output row, or per 2-D block."""

FP8_SCALE_METHODS: tuple[FP8ScaleMethod, ...] = ("tensor", "row", "block")
"""Every :data:`FP8ScaleMethod`."""

FP8ScaleSemantics = Literal["inverse"]
"""How a stored FP8 weight scale applies: ``inverse`` (multiply to quantize, divide to decode)."""

FP8_SCALE_SEMANTICS: tuple[FP8ScaleSemantics, ...] = ("inverse",)
"""Every :data:`FP8ScaleSemantics`."""


def _accepted(names: object) -> str:
    return ", ".join(repr(n) for n in names)  # type: ignore[union-attr]


def normalize_fp8_format(value: object) -> FP8Format:
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


FP8WeightFormat = Literal["float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz"]
"""An FP8 format that can hold weights and activations (every FP8 format but decode-only E8M0)."""

FP8_WEIGHT_FORMATS: tuple[FP8WeightFormat, ...] = typing.get_args(FP8WeightFormat)
"""Every :data:`FP8WeightFormat`: :data:`FP8_FORMATS` without the decode-only E8M0."""

FP8_DTYPES: frozenset[torch.dtype] = frozenset(
    getattr(torch, name) for name in FP8_FORMATS if hasattr(torch, name)
)
"""The FP8 ``torch.dtype`` objects of :data:`FP8_FORMATS` that the installed torch provides."""

FP8_WEIGHT_DTYPES: frozenset[torch.dtype] = frozenset(
    getattr(torch, name) for name in FP8_WEIGHT_FORMATS if hasattr(torch, name)
)
"""The FP8 ``torch.dtype`` objects that hold codes (:data:`FP8_DTYPES` without E8M0)."""


def normalize_fp8_weight_format(value: object, *, where: str = "format") -> FP8WeightFormat:
    """:func:`normalize_fp8_format`, refusing the decode-only E8M0 (it holds MX scales, not values).

    Raises:
      ValueError: as :func:`normalize_fp8_format`, or an E8M0 spelling (named with ``where``).
      TypeError: as :func:`normalize_fp8_format`.

    Numerics: names only. Example: ``normalize_fp8_weight_format("e5m2") == "float8_e5m2"``.
    """
    try:
        name = normalize_fp8_format(value)
    except (TypeError, ValueError) as exc:
        raise type(exc)(f"{where}: {str(exc).removeprefix('format: ')}") from None
    if name in FP8_DECODE_ONLY_FORMATS:
        raise ValueError(
            f"{where}: {name} (from {value!r}) is decode-only (E8M0 holds power-of-two MX scales, "
            f"not values); accepted: {', '.join(FP8_WEIGHT_FORMATS)} or their aliases"
        )
    return name  # type: ignore[return-value]


def fp8_dtype(name: str | torch.dtype | None) -> torch.dtype:
    """The ``torch.dtype`` of an FP8 format name or alias (normalized first).

    Numerics: names only. Example: ``fp8_dtype("e5m2") is torch.float8_e5m2``.
    """
    return getattr(torch, normalize_fp8_format(name))


def fp8_max(name: str | torch.dtype | None) -> float:
    """Largest finite value of an FP8 format: 448, 57344, 240, 57344 and ``2**127`` (E8M0).

    Numerics: exact; equals ``torch.finfo(fp8_dtype(name)).max``.

    Example: ``fp8_max("e4m3") == 448.0``.
    """
    return _FP8_MAX[normalize_fp8_format(name)]


def _positive_int(item: object, *, what: str, value: object) -> int:
    if isinstance(item, bool):
        raise ValueError(f"{what}: expected positive integers, got a bool in {value!r}")
    if isinstance(item, float):
        if not (math.isfinite(item) and item.is_integer()):
            raise ValueError(f"{what}: expected positive integers, got {item!r} in {value!r}")
        item = int(item)
    try:
        number = int(item)  # type: ignore[call-overload]
    except (TypeError, ValueError):
        raise ValueError(f"{what}: expected positive integers, got {item!r} in {value!r}") from None
    if number <= 0:
        raise ValueError(f"{what}: expected positive integers, got {number} in {value!r}")
    return number


def normalize_fp8_block_size(value: object) -> tuple[int, int] | None:
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


def normalize_fp8_scale_method(value: object, *, weight_block_size: object) -> FP8ScaleMethod:
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
    method = next((m for m in FP8_SCALE_METHODS if m == str.lower(str.strip(value))), None)
    if method is None:
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


def normalize_fp8_scale_semantics(value: object) -> FP8ScaleSemantics:
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


# --------------------------------------------------------------------------------------------
# GPTQ packing formats
# --------------------------------------------------------------------------------------------

GPTQFormat = Literal["gptq", "gptq_v2"]
"""A GPTQ zero-point convention: ``gptq`` (v1) stores ``zero - 1``, ``gptq_v2`` the zero."""

GPTQ_FORMATS: tuple[GPTQFormat, ...] = ("gptq", "gptq_v2")
"""Packed zero-point conventions: ``gptq`` (v1, the export default) and ``gptq_v2``."""


def normalize_gptq_format(
    value: object, *, where: str = "normalize_gptq_format", name: str = "format"
) -> GPTQFormat:
    """Canonical GPTQ packing-format name: ``"gptq"`` (v1) or ``"gptq_v2"``.

    Case and surrounding spaces are ignored; ``FORMAT.GPTQ`` / ``FORMAT.GPTQ_V2`` (str enums)
    are accepted as their values. ``where`` and ``name`` only shape the error message.

    Raises:
      TypeError: a value that is not a string.
      ValueError: any other name (the message lists the accepted ones).

    Numerics: names only; no tensor is touched.

    Example:
      >>> normalize_gptq_format(" GPTQ_v2 ")
      'gptq_v2'
    """
    if not isinstance(value, str):
        raise TypeError(
            f"{where}: {name} must be a str ({_accepted(GPTQ_FORMATS)}), got "
            f"{type(value).__name__} {value!r}"
        )
    key = str.lower(str.strip(value))
    if key == "gptq":
        return "gptq"
    if key == "gptq_v2":
        return "gptq_v2"
    shown = f"{type(value).__name__}.{value.name}" if isinstance(value, enum.Enum) else repr(value)
    raise ValueError(
        f"{where}: {name}={shown} is not a GPTQ packing format; accepted: 'gptq' (v1, stores "
        f"zero - 1) or 'gptq_v2' (stores the zero)"
    )


# --------------------------------------------------------------------------------------------
# NVFP4 scale recipes
# --------------------------------------------------------------------------------------------

NVFP4Recipe = Literal[
    "nvidia",
    "nvidia_headroom",
    "four_six",
    "least_squares",
    "least_squares_headroom",
    "least_squares_grid",
    "exhaustive",
]
"""A canonical NVFP4 block-scale recipe name (one of :data:`NVFP4_RECIPES`)."""

NVFP4RecipeName = Literal[NVFP4Recipe, "lsq", "lsq_headroom", "lsq_grid"]
"""What a ``recipe`` argument accepts: a canonical :data:`NVFP4Recipe` or a legacy alias."""

NVFP4LocalRecipe = Literal[
    "nvidia", "four_six", "least_squares", "least_squares_grid", "exhaustive"
]
"""The per-block algorithm of a recipe: its name without the ``_headroom`` global-scale step."""

NVFP4_RECIPES: tuple[NVFP4Recipe, ...] = typing.get_args(NVFP4Recipe)
"""Canonical NVFP4 block-scale recipes; ``exhaustive`` (all 126 positive E4M3 scales) is new."""

NVFP4_LEGACY_RECIPE_ALIASES: Mapping[str, NVFP4Recipe] = {
    "lsq": "least_squares",
    "lsq_headroom": "least_squares_headroom",
    "lsq_grid": "least_squares_grid",
}

_LOCAL_RECIPE: Mapping[NVFP4Recipe, NVFP4LocalRecipe] = {
    "nvidia": "nvidia",
    "nvidia_headroom": "nvidia",
    "four_six": "four_six",
    "least_squares": "least_squares",
    "least_squares_headroom": "least_squares",
    "least_squares_grid": "least_squares_grid",
    "exhaustive": "exhaustive",
}

_HEADROOM_LOCAL: Mapping[NVFP4Recipe, NVFP4LocalRecipe] = {
    "nvidia_headroom": "nvidia",
    "least_squares_headroom": "least_squares",
}


def normalize_nvfp4_recipe(recipe: object) -> NVFP4Recipe:
    """Canonical NVFP4 scale-recipe name (legacy ``lsq*`` aliases expanded).

    Raises:
      ValueError: a non-string or an unknown name (the message lists the accepted names).

    Numerics: names only. Example: ``normalize_nvfp4_recipe("lsq_grid") == "least_squares_grid"``.
    """
    accepted = f"{_accepted(NVFP4_RECIPES)} (legacy: {_accepted(NVFP4_LEGACY_RECIPE_ALIASES)})"
    if not isinstance(recipe, str):
        raise ValueError(f"Unsupported NVFP4 scale recipe: {recipe!r}. Accepted: {accepted}")
    name = NVFP4_LEGACY_RECIPE_ALIASES.get(recipe)
    if name is None:
        name = next((r for r in NVFP4_RECIPES if r == recipe), None)
    if name is None:
        raise ValueError(f"Unsupported NVFP4 scale recipe: {recipe!r}. Accepted: {accepted}")
    return name


def nvfp4_kernel_recipe(recipe: object) -> NVFP4LocalRecipe:
    """The local (per-block) algorithm of a recipe: headroom variants map to their base recipe.

    Numerics: names only. Example: ``nvfp4_kernel_recipe("nvidia_headroom") == "nvidia"``.
    """
    return _LOCAL_RECIPE[normalize_nvfp4_recipe(recipe)]


def nvfp4_uses_headroom(recipe: object) -> bool:
    """True for ``nvidia_headroom`` and ``least_squares_headroom``; ``None`` gives False.

    Numerics: names only. Example: ``nvfp4_uses_headroom("lsq_headroom") is True``.
    """
    if recipe is None:
        return False
    return normalize_nvfp4_recipe(recipe) in _HEADROOM_LOCAL
