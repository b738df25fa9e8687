"""Hypothesis strategies for testing quantizers: floatxq's own suites use them, and so can yours.

Every tensor here is built from Hypothesis draws (shapes, values, exponents, positions), never
from a random seed, so a failing example shrinks to a small one: fewer rows, simpler values.
Valid structure is built, never filtered (block-divisible shapes are drawn as multiples of the
block), and the values that break quantizers (±0, ±max of each FP8 format, round-to-nearest-even
ties, subnormals, FLT_MIN, FLT_MAX, and inf/NaN where errors are expected) are mixed in at high
probability instead of waiting for ``st.floats`` to find them.

What is here: scalars (:func:`f32_values`, :func:`signed`, :func:`power_of_two_exponents`);
float tensors (:func:`matrices`, :func:`spread_matrices`, :func:`token_batches`); FP8 weights
(:func:`fp8_layouts`, :func:`fp8_weight_cases`); integers (:func:`int_arrays`,
:func:`int32_words`, :func:`gptq_records`, :func:`gptq_packed`); NVFP4 (:func:`nvfp4_inputs`,
:func:`nvfp4_grid_points`); names (:func:`alias_spellings`, :func:`gptq_format_spellings`).

Example, testing your own FP8 weight quantizer against floatxq's bytes::

    from hypothesis import given
    from floatxq.testing.strategies import fp8_weight_cases

    @given(fp8_weight_cases())
    def test_mine_matches_floatxq(case):
        kw = dict(format=case.format, weight_scale_method=case.method,
                  weight_block_size=case.block)
        assert_bitwise_equal(my_quantize(case.weight, **kw).qweight,
                             floatxq.quantize_fp8_weight(case.weight, **kw).qweight)

Needs ``hypothesis`` (the ``test`` extra). Tuple parameters are bare ``tuple``: the type checker
samples ``tuple[X, ...]`` items with ``random``, which Hypothesis forbids while it draws.
"""

import math
from typing import Any, NamedTuple

import numpy as np
import torch
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from floatxq._typing import Float, Int32, Integer, Tensor, checked_record
from floatxq.formats import FP16_MAX
from floatxq.gptq.int4 import GPTQPacked
from floatxq.nvfp4.quantize import NVFP4Blocks

F32 = np.finfo(np.float32)

FINITE_EDGES: tuple[float, ...] = (
    0.0,
    float(F32.max),
    float(F32.tiny),  # FLT_MIN
    float(F32.smallest_subnormal),
    1e-37,
    1e-40,
    448.0,
    464.0,  # e4m3 tie between 448 and the (absent) 480
    480.0,
    240.0,  # e4m3fnuz max
    57344.0,
    61440.0,
    6.0,
    5.0,
    0.25,
    0.75,
    1.0,
    2.0**-6,  # e4m3 min normal
    2.0**-9,  # e4m3 min subnormal
    2.0**-10,
    3 * 2.0**-10,
    2.0**-16,  # e5m2 min subnormal
)
"""Finite edge magnitudes; strategies draw them with either sign."""

NONFINITE_EDGES: tuple[float, ...] = (math.inf, math.nan)

FP8_ENCODABLE: tuple[str, ...] = (
    "float8_e4m3fn",
    "float8_e5m2",
    "float8_e4m3fnuz",
    "float8_e5m2fnuz",
)
"""The FP8 formats a weight can be quantized to (E8M0 is decode-only)."""

FP8_ALIASES: dict[str, str] = {
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
}
"""Every FP8 alias with its canonical name: a copy kept independent of ``floatxq.formats`` (the
table in ``docs/numerics.md``), so a test comparing the two can fail."""

GPTQ_FORMAT_NAMES: tuple[str, ...] = ("gptq", "gptq_v2")
"""The GPTQ packing formats, written out independently of ``floatxq.formats``."""

FLOAT_DTYPES: tuple[torch.dtype, ...] = (torch.float32, torch.bfloat16, torch.float16)
"""Activation and weight dtypes the quantizers read."""

EDGE_WORDS: tuple[int, ...] = (
    0,
    -1,
    -(2**31),
    2**31 - 1,
    0x77777777,
    0x11111111,
    -0x77777778,  # 0x88888888 as int32
    0x0F0F0F0F,
    -0x0F0F0F10,  # 0xF0F0F0F0 as int32
)
"""int32 words that stress nibble packing: all-zero, all-ones, the sign nibble, the symmetric
GPTQ zero words of v1 (``0x77777777``) and v2 (``0x88888888``), and alternating nibbles."""


def _dtype_max(dtype: torch.dtype) -> float | None:
    """The largest float32 that stays finite when cast to ``dtype`` (None for float32)."""
    return None if dtype == torch.float32 else float(torch.finfo(dtype).max)


def signed(values: tuple) -> st.SearchStrategy[float]:
    """One of ``values`` with either sign (so ``-0.0`` and ``-inf`` appear too)."""
    return st.sampled_from(values).flatmap(lambda v: st.sampled_from([v, -v]))


def f32_values(
    *,
    finite: bool = True,
    max_magnitude: float | None = None,
    min_magnitude: float | None = None,
) -> st.SearchStrategy[float]:
    """Float32 scalars with :data:`FINITE_EDGES` mixed in; ``finite=False`` adds ±inf and NaN.

    Args:
      finite: without it, ±inf and NaN are drawn too.
      max_magnitude: no finite value above it in magnitude.
      min_magnitude: no nonzero value below it in magnitude (±0 are still drawn); use it to stay
        clear of subnormals, e.g. for power-of-two equivariance.
    """
    edges = FINITE_EDGES + (() if finite else NONFINITE_EDGES)
    hi = None if max_magnitude is None else float(np.float32(max_magnitude))
    lo = None if min_magnitude is None else float(np.float32(min_magnitude))
    edges = tuple(
        e
        for e in edges
        if not (hi is not None and abs(e) > hi) and not (lo is not None and 0 < abs(e) < lo)
    )
    if lo is None:
        body: st.SearchStrategy[float] = st.floats(
            width=32,
            allow_subnormal=True,
            allow_nan=not finite,
            allow_infinity=not finite,
            min_value=None if hi is None else -hi,
            max_value=hi,
        )
    else:
        magnitude = st.floats(lo, hi if hi is not None else float(F32.max), width=32)
        body = st.one_of(magnitude, magnitude.map(lambda v: -v))
    return st.one_of(signed(edges), body)


def power_of_two_exponents(low: int = -20, high: int = 20) -> st.SearchStrategy[int]:
    """Exponents ``e`` for power-of-two equivariance checks (``x * 2**e``)."""
    return st.integers(low, high)


def alias_spellings(canonical: tuple = FP8_ENCODABLE) -> st.SearchStrategy[tuple[str, str]]:
    """``(spelling, canonical)``: an alias of one of ``canonical`` in random case and padding."""
    pairs = sorted((a, c) for a, c in FP8_ALIASES.items() if c in canonical)
    return _spellings(pairs)


def gptq_format_spellings() -> st.SearchStrategy[tuple[str, str]]:
    """``(spelling, canonical)``: ``"gptq"`` or ``"gptq_v2"`` in random case and padding."""
    return _spellings([(name, name) for name in GPTQ_FORMAT_NAMES])


def _spellings(pairs: list[tuple[str, str]]) -> st.SearchStrategy[tuple[str, str]]:
    @st.composite
    def build(draw: Any) -> tuple[str, str]:
        alias, name = draw(st.sampled_from(pairs))
        cased = "".join(ch.upper() if draw(st.booleans()) else ch for ch in alias)
        pad = draw(st.sampled_from(["", " ", "\t", "  "]))
        return pad + cased + draw(st.sampled_from(["", " ", "\n"])), name

    return build()


# ------------------------------------------------------------------------------------------------
# Float tensors
# ------------------------------------------------------------------------------------------------


@st.composite
def matrices(
    draw: Any,
    *,
    block: tuple[int, int] = (1, 1),
    max_blocks: tuple[int, int] = (4, 4),
    min_blocks: int = 1,
    finite: bool = True,
    dtype: torch.dtype = torch.float32,
    elements: st.SearchStrategy[float] | None = None,
) -> Float[Tensor, "rows cols"]:
    """A ``(rows, cols)`` tensor whose shape is a multiple of ``block`` (built, not filtered).

    Values come from ``elements`` (default :func:`f32_values`, limited to ``dtype``'s finite
    range so the cast to ``dtype`` adds no infinity), drawn in float32 and then cast.
    """
    rows = block[0] * draw(st.integers(min_blocks, max_blocks[0]))
    cols = block[1] * draw(st.integers(min_blocks, max_blocks[1]))
    if elements is None:
        elements = f32_values(finite=finite, max_magnitude=_dtype_max(dtype))
    arr = draw(hnp.arrays(np.float32, (rows, cols), elements=elements))
    return torch.from_numpy(arr).to(dtype)


@st.composite
def spread_matrices(
    draw: Any,
    *,
    block: tuple[int, int] = (1, 1),
    max_blocks: tuple[int, int] = (6, 6),
    spread: int = 60,
    dtype: torch.dtype = torch.float32,
) -> Float[Tensor, "rows cols"]:
    """Rows of ordinary values whose magnitudes differ by up to ``2**±spread`` between rows.

    The bulk is drawn in ``[-4, 4]`` (where most of a standard normal lies), each row is scaled
    by its own drawn power of two, and up to three drawn positions receive a drawn edge value:
    the dynamic range real weights and activations have, with every value shrinkable.
    """
    rows = block[0] * draw(st.integers(1, max_blocks[0]))
    cols = block[1] * draw(st.integers(1, max_blocks[1]))
    bulk = draw(hnp.arrays(np.float32, (rows, cols), elements=st.floats(-4, 4, width=32)))
    exps = draw(hnp.arrays(np.int32, (rows, 1), elements=st.integers(-spread, spread)))
    x = torch.from_numpy(bulk) * torch.exp2(torch.from_numpy(exps).to(torch.float32))
    limit = _dtype_max(dtype)
    for _ in range(draw(st.integers(0, 3))):
        row, col = draw(st.integers(0, rows - 1)), draw(st.integers(0, cols - 1))
        x[row, col] = draw(f32_values(max_magnitude=1e30 if limit is None else limit))
    return x.to(dtype)


@st.composite
def token_batches(
    draw: Any,
    *,
    dtypes: tuple = FLOAT_DTYPES,
    max_rows: int = 5,
    max_k: int = 12,
    elements: st.SearchStrategy[float] | None = None,
) -> Float[Tensor, "rows k"]:
    """``(rows, k)`` activations of a drawn dtype whose values all survive the cast to it."""
    dtype = draw(st.sampled_from(dtypes))
    return draw(matrices(max_blocks=(max_rows, max_k), dtype=dtype, elements=elements))


# ------------------------------------------------------------------------------------------------
# FP8 weights
# ------------------------------------------------------------------------------------------------


@checked_record
class FP8WeightCase(NamedTuple):
    """One call of ``quantize_fp8_weight``: its format, scale layout and weight."""

    format: str
    """A canonical encodable FP8 name (one of :data:`FP8_ENCODABLE`)."""
    method: str
    """``"tensor"``, ``"row"`` or ``"block"``."""
    block: tuple[int, int] | None
    """``(block_rows, block_cols)`` for ``"block"``, else None."""
    weight: Float[Tensor, "out in"]
    """An ``(out, in)`` weight whose shape the block divides."""


def fp8_layouts(
    *, max_block: tuple[int, int] = (4, 8)
) -> st.SearchStrategy[tuple[str, tuple[int, int] | None]]:
    """``(weight_scale_method, weight_block_size)``: tensor, row, or a drawn block size."""
    blocks = st.tuples(st.integers(1, max_block[0]), st.integers(1, max_block[1]))
    return st.one_of(
        st.sampled_from([("tensor", None), ("row", None)]),
        blocks.map(lambda b: ("block", b)),
    )


@st.composite
def fp8_weight_cases(
    draw: Any,
    *,
    formats: tuple = FP8_ENCODABLE,
    finite: bool = True,
    elements: st.SearchStrategy[float] | None = None,
    max_blocks: tuple[int, int] = (3, 3),
    max_shape: tuple[int, int] = (8, 12),
    dtype: torch.dtype = torch.float32,
) -> FP8WeightCase:
    """A format, a layout and a weight of a shape that layout divides (see :class:`FP8WeightCase`).

    A block layout gets up to ``max_blocks`` blocks each way; tensor and row layouts get up to
    ``max_shape`` rows and columns.
    """
    method, block = draw(fp8_layouts())
    tile = block if block is not None else (1, 1)
    blocks = max_blocks if block is not None else max_shape
    weight = draw(
        matrices(block=tile, max_blocks=blocks, finite=finite, dtype=dtype, elements=elements)
    )
    return FP8WeightCase(draw(st.sampled_from(formats)), method, block, weight)


# ------------------------------------------------------------------------------------------------
# Integers (INT4 codes, planes, packed GPTQ words)
# ------------------------------------------------------------------------------------------------


def int_arrays(
    shape: tuple, low: int, high: int, *, dtype: torch.dtype = torch.int64
) -> st.SearchStrategy[Integer[Tensor, "..."]]:
    """Integer tensors of ``shape`` and ``dtype`` with values in ``[low, high]`` (both drawn)."""
    edges = st.sampled_from(sorted({low, high, min(max(0, low), high)}))
    values = st.one_of(edges, st.integers(low, high))
    return hnp.arrays(np.int64, shape, elements=values).map(lambda a: torch.from_numpy(a).to(dtype))


def int32_words(shape: tuple) -> st.SearchStrategy[Int32[Tensor, "..."]]:
    """int32 tensors of arbitrary bits, :data:`EDGE_WORDS` mixed in (packed GPTQ words)."""
    values = st.one_of(st.sampled_from(EDGE_WORDS), st.integers(-(2**31), 2**31 - 1))
    return hnp.arrays(np.int32, shape, elements=values).map(torch.from_numpy)


@checked_record
class GPTQRecord(NamedTuple):
    """Valid ``pack_gptq`` input: codes and zero points ``0..15``, scales and group ids."""

    codes: Integer[Tensor, "rows out"]
    """``(in, out)`` codes ``0..15``; ``in`` and ``out`` are multiples of 8."""
    zeros: Integer[Tensor, "groups out"]
    """``(groups, out)`` zero points ``0..15``, the dtype of ``codes``."""
    scales: Float[Tensor, "groups out"]
    """float16 ``(groups, out)`` finite scales (exact in the checkpoint's float16)."""
    g_idx: Int32[Tensor, "rows"]  # noqa: F821
    """int32 ``(in,)`` group of each input row, in ``[0, groups)``."""


@st.composite
def gptq_records(
    draw: Any,
    *,
    max_words: int = 6,
    max_out_words: int = 4,
    zeros: int | None = None,
    dtypes: tuple = (torch.uint8, torch.int16, torch.int32, torch.int64),
) -> GPTQRecord:
    """A :class:`GPTQRecord` with up to ``8 * max_words`` rows and ``8 * max_out_words`` columns.

    ``zeros`` pins every zero point (8: symmetric 4-bit); otherwise each is drawn.
    """
    rows = 8 * draw(st.integers(1, max_words))
    out = 8 * draw(st.integers(1, max_out_words))
    groups = draw(st.integers(1, rows))
    dtype = draw(st.sampled_from(dtypes))
    codes = draw(int_arrays((rows, out), 0, 15, dtype=dtype))
    if zeros is None:
        zero = draw(int_arrays((groups, out), 0, 15, dtype=dtype))
    else:
        zero = torch.full((groups, out), zeros, dtype=dtype)
    finite16 = st.floats(-FP16_MAX, FP16_MAX, width=16, allow_nan=False, allow_infinity=False)
    scales = draw(hnp.arrays(np.float16, (groups, out), elements=finite16))
    g_idx = draw(int_arrays((rows,), 0, groups - 1, dtype=torch.int32))
    return GPTQRecord(codes, zero, torch.from_numpy(scales), g_idx)


@st.composite
def gptq_packed(draw: Any, *, max_words: int = 6, max_out_words: int = 4) -> GPTQPacked:
    """A :class:`floatxq.GPTQPacked` whose ``qweight`` and ``qzeros`` words hold arbitrary bits.

    Every word is a valid checkpoint word in either format (``gptq`` or ``gptq_v2``), so the
    record tests that unpacking and packing are bijective, not only that packing round-trips.
    """
    words = draw(st.integers(1, max_words))
    out = 8 * draw(st.integers(1, max_out_words))
    groups = draw(st.integers(1, 8 * words))
    finite16 = st.floats(-FP16_MAX, FP16_MAX, width=16, allow_nan=False, allow_infinity=False)
    scales = draw(hnp.arrays(np.float16, (groups, out), elements=finite16))
    return GPTQPacked(
        draw(int32_words((words, out))),
        draw(int32_words((groups, out // 8))),
        torch.from_numpy(scales),
        draw(int_arrays((8 * words,), 0, groups - 1, dtype=torch.int32)),
    )


# ------------------------------------------------------------------------------------------------
# NVFP4 (E2M1 elements in 16-value blocks, E4M3 block scales)
# ------------------------------------------------------------------------------------------------

E2M1_MAGNITUDES: tuple[float, ...] = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
"""The eight E2M1 magnitudes, written out independently of ``floatxq.formats``."""

E2M1_TIES: tuple[float, ...] = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
"""The midpoints between neighbouring E2M1 magnitudes: rounding ties at a power-of-two scale."""


@st.composite
def nvfp4_inputs(
    draw: Any,
    *,
    max_rows: int = 3,
    max_blocks: int = 3,
    block_spread: int = 40,
    max_magnitude: float = 2.0**20,
) -> Float[Tensor, "rows k"]:
    """``(rows, 16 · blocks)`` float32 whose 16-value blocks differ in magnitude by ``2**±spread``.

    Values are E2M1 values and their midpoints (ties at a power-of-two scale) or
    :func:`f32_values` up to ``max_magnitude`` (±0, FLT_MIN, subnormals, E4M3 edges), each
    block multiplied by its own drawn power of two: huge and tiny blocks side by side, with
    every value and exponent shrinkable. The defaults keep every block's SSE finite in FP32.
    """
    rows = draw(st.integers(1, max_rows))
    blocks = draw(st.integers(1, max_blocks))
    elements = st.one_of(
        signed(E2M1_MAGNITUDES + E2M1_TIES), f32_values(max_magnitude=max_magnitude)
    )
    body = draw(hnp.arrays(np.float32, (rows, blocks, 16), elements=elements))
    exps = draw(
        hnp.arrays(np.int32, (rows, blocks, 1), elements=st.integers(-block_spread, block_spread))
    )
    x = torch.from_numpy(body) * torch.exp2(torch.from_numpy(exps).to(torch.float32))
    return x.reshape(rows, 16 * blocks)


@st.composite
def nvfp4_grid_points(
    draw: Any, *, max_rows: int = 3, max_blocks: int = 3, global_exponents: tuple = (-20, 20)
) -> NVFP4Blocks:
    """An :class:`~floatxq.NVFP4Blocks` whose decoded tensor every recipe must reproduce exactly.

    Codes are drawn (0..15), then one drawn element per block is set to ±6 (code 7 or 15); block
    scales are drawn from every positive finite E4M3 code (1..126) and the global scale is a drawn
    power of two ``2**e``. So each block's largest magnitude is ``6 · scale · 2**e``, decoding is
    exact, and the amax→6 candidate finds the block's own scale with zero error.
    """
    rows = draw(st.integers(1, max_rows))
    blocks = draw(st.integers(1, max_blocks))
    codes = draw(hnp.arrays(np.uint8, (rows, blocks, 16), elements=st.integers(0, 15)))
    top = draw(hnp.arrays(np.int64, (rows, blocks), elements=st.integers(0, 15)))
    top_sign = draw(hnp.arrays(np.uint8, (rows, blocks), elements=st.sampled_from([7, 15])))
    np.put_along_axis(codes, top[..., None], top_sign[..., None], axis=2)
    scale_bits = draw(hnp.arrays(np.uint8, (rows, blocks), elements=st.integers(1, 126)))
    e = draw(st.integers(*global_exponents))
    return NVFP4Blocks(
        torch.from_numpy(codes).reshape(rows, 16 * blocks),
        torch.from_numpy(scale_bits).view(torch.float8_e4m3fn),
        torch.tensor(2.0**e, dtype=torch.float32),
    )
