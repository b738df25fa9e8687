"""Hypothesis strategies for floatxq's executable specification.

Valid structure is built, never filtered (block-divisible shapes are drawn as multiples), and the
edge values that break quantizers (±0, ±max, RNE ties, subnormals, FLT_MIN, inf, NaN) are mixed in
at high probability instead of waiting for ``st.floats`` to find them.
"""

import math
from typing import Any

import numpy as np
import torch
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

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
"""Every FP8 alias the contract names, with its canonical name (an independent copy of SPEC §1)."""


def signed(values: tuple) -> st.SearchStrategy[float]:
    """One of ``values`` with either sign (so ``-0.0`` and ``-inf`` appear too)."""
    return st.sampled_from(values).flatmap(lambda v: st.sampled_from([v, -v]))


def f32_values(
    *, finite: bool = True, max_magnitude: float | None = None
) -> st.SearchStrategy[float]:
    """Float32 values, edges mixed in; ``finite=False`` adds ±inf and NaN."""
    edges = FINITE_EDGES + (() if finite else NONFINITE_EDGES)
    if max_magnitude is not None:
        max_magnitude = float(np.float32(max_magnitude))
        edges = tuple(e for e in edges if not (abs(e) > max_magnitude))
    body = st.floats(
        width=32,
        allow_subnormal=True,
        allow_nan=not finite,
        allow_infinity=not finite,
        min_value=None if max_magnitude is None else -max_magnitude,
        max_value=max_magnitude,
    )
    return st.one_of(signed(edges), body)


def alias_spellings(canonical: tuple = FP8_ENCODABLE) -> st.SearchStrategy[tuple[str, str]]:
    """``(spelling, canonical)``: an alias of one of ``canonical`` in random case and padding."""
    pairs = sorted((a, c) for a, c in FP8_ALIASES.items() if c in canonical)

    @st.composite
    def build(draw: Any) -> tuple[str, str]:
        alias, name = draw(st.sampled_from(pairs))
        cased = "".join(ch.upper() if draw(st.booleans()) else ch for ch in alias)
        pad = draw(st.sampled_from(["", " ", "\t", "  "]))
        return pad + cased + draw(st.sampled_from(["", " ", "\n"])), name

    return build()


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
) -> torch.Tensor:
    """A ``(rows, cols)`` tensor whose shape is a multiple of ``block`` (built, not filtered)."""
    rows = block[0] * draw(st.integers(min_blocks, max_blocks[0]))
    cols = block[1] * draw(st.integers(min_blocks, max_blocks[1]))
    arr = draw(
        hnp.arrays(
            np.float32,
            (rows, cols),
            elements=f32_values(finite=finite) if elements is None else elements,
        )
    )
    return torch.from_numpy(arr).to(dtype)


@st.composite
def scaled_gaussian(
    draw: Any,
    *,
    block: tuple[int, int] = (1, 1),
    max_blocks: tuple[int, int] = (6, 6),
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Seeded Gaussian bulk with per-row exponent spread; Hypothesis draws seed, shape, spread."""
    seed = draw(st.integers(0, 2**31 - 1))
    rows = block[0] * draw(st.integers(1, max_blocks[0]))
    cols = block[1] * draw(st.integers(1, max_blocks[1]))
    spread = draw(st.integers(0, 60))
    g = torch.Generator().manual_seed(seed)
    exps = torch.randint(-spread, spread + 1, (rows, 1), generator=g).to(torch.float32)
    x = torch.randn(rows, cols, generator=g) * torch.exp2(exps)
    for _ in range(draw(st.integers(0, 3))):
        x[draw(st.integers(0, rows - 1)), draw(st.integers(0, cols - 1))] = draw(
            f32_values(max_magnitude=1e30)
        )
    return x.to(dtype)


def power_of_two_exponents(low: int = -20, high: int = 20) -> st.SearchStrategy[int]:
    """Exponents ``e`` for power-of-two equivariance checks (``x * 2**e``)."""
    return st.integers(low, high)
