"""How close each NVFP4 scale recipe gets to the exact optimum on a given tensor.

:func:`recipes_report` runs the recipes of :mod:`~floatxq.nvfp4.quantize` on one tensor and
measures each against ``exhaustive`` (the best of all 126 positive E4M3 block scales under the
same global scale): its summed block SSE, the relative MSE of its decoded output and the share of
blocks at the optimum. ``floatxq recipes`` and ``benchmarks/recipes.py`` print it.
"""

import time
from collections.abc import Sequence
from typing import NamedTuple

import torch

from floatxq._typing import Float, Tensor, checked_record
from floatxq.formats import NVFP4_BLOCK, NVFP4Recipe, NVFP4RecipeName, normalize_nvfp4_recipe
from floatxq.nvfp4.quantize import (
    _blocks_of,
    nvfp4_block_scales,
    nvfp4_block_sse,
    nvfp4_dequantize,
    nvfp4_quantize,
)

__all__ = ["DEFAULT_REPORT_RECIPES", "RecipeRow", "RecipesReport", "recipes_report"]


@checked_record
class RecipeRow(NamedTuple):
    """One recipe's quality on one tensor (see :func:`recipes_report`)."""

    recipe: NVFP4Recipe
    """The canonical recipe name."""
    global_scale: float
    """The FP32 global scale the recipe ran under."""
    sse: float
    """Sum over blocks of the search's block SSE (float64 accumulation)."""
    rel_mse: float
    """``mean((qdq(x) - x)**2) / mean(x**2)`` of the decoded output (0 for an all-zero ``x``)."""
    optimal_share: float
    """Share of blocks whose SSE equals the ``exhaustive`` optimum under the same global scale."""
    seconds: float
    """Wall time of the quantization (informational)."""


@checked_record
class RecipesReport(NamedTuple):
    """Per-recipe quality of NVFP4 quantization of one tensor."""

    rows: tuple[RecipeRow, ...]
    """One row per requested recipe, in the requested order."""
    blocks: int
    """Number of 16-value blocks in the tensor."""
    shape: tuple[int, ...]
    """The tensor's shape."""

    def to_dict(self) -> dict:
        """The report as a JSON-ready dict: ``rows`` (one dict of fields per recipe), ``blocks``
        and ``shape`` (a list)."""
        return {
            "rows": [dict(row._asdict()) for row in self.rows],
            "blocks": self.blocks,
            "shape": list(self.shape),
        }

    def table(self) -> str:
        """The rows as a Markdown table: recipe, relative MSE, share of blocks at the optimum,
        global scale and seconds.

        Example:
          >>> row = RecipeRow("nvidia", 1.0, 2.0, 1.5e-2, 0.25, 0.001)
          >>> print(RecipesReport((row,), 4, (4, 16)).table())
          | recipe | rel MSE | optimal | global scale | seconds |
          | --- | ---: | ---: | ---: | ---: |
          | nvidia | 1.500e-02 | 25.0% | 1 | 0.00 |
        """
        lines = [
            "| recipe | rel MSE | optimal | global scale | seconds |",
            "| --- | ---: | ---: | ---: | ---: |",
        ]
        lines += [
            f"| {r.recipe} | {r.rel_mse:.3e} | {100 * r.optimal_share:.1f}% | "
            f"{r.global_scale:.6g} | {r.seconds:.2f} |"
            for r in self.rows
        ]
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()


DEFAULT_REPORT_RECIPES: tuple[NVFP4Recipe, ...] = (
    "nvidia",
    "four_six",
    "least_squares",
    "least_squares_grid",
    "exhaustive",
)
"""The recipes :func:`recipes_report` compares by default (the local algorithms, cheapest first)."""


def recipes_report(
    x: Float[Tensor, "*b k"],
    *,
    global_scale: Float[Tensor, ""] | float | None = None,
    recipes: Sequence[NVFP4RecipeName] = DEFAULT_REPORT_RECIPES,
) -> RecipesReport:
    """Measure each NVFP4 recipe against the exact optimum (``exhaustive``) on ``x``.

    With ``global_scale=None`` each recipe gets its own dynamic global scale (divisor 6 for
    ``nvidia``, 4 otherwise, on ``x``'s dtype grid), and its optimal share is measured against the
    exhaustive search under that same scale.

    Raises:
      ValueError: as :func:`~floatxq.nvfp4_block_scales` (``k % 16``, non-finite ``x``, a bad
        global scale or recipe). TypeError: a non-floating ``x``.

    Numerics: as :func:`~floatxq.nvfp4_block_scales`; sums and MSE accumulated in float64.

    Example:
      >>> r = recipes_report(torch.randn(4, 64, generator=torch.Generator().manual_seed(0)))
      >>> [row.recipe for row in r.rows][:2], r.rows[-1].optimal_share
      (['nvidia', 'four_six'], 1.0)
    """
    names = [normalize_nvfp4_recipe(r) for r in recipes]
    x64 = _blocks_of(x, where="recipes_report").to(torch.float64).reshape(x.shape)
    power = float(x64.pow(2).mean()) if x64.numel() else 0.0
    optimum: dict[float, Tensor] = {}
    rows = []
    for name in names:
        start = time.perf_counter()
        q = nvfp4_quantize(x, global_scale, name)
        seconds = time.perf_counter() - start
        g = q.global_scale
        sse = nvfp4_block_sse(x, q.block_scales, g)
        key = float(g)
        if key not in optimum:
            exact = q if name == "exhaustive" else nvfp4_block_scales(x, g, "exhaustive")
            optimum[key] = nvfp4_block_sse(x, exact.block_scales, g)
        out = nvfp4_dequantize(*q).to(torch.float64)
        mse = float((out - x64).pow(2).mean()) if x64.numel() else 0.0
        share = float((sse <= optimum[key]).double().mean()) if sse.numel() else 1.0
        rows.append(
            RecipeRow(
                recipe=name,
                global_scale=key,
                sse=float(sse.double().sum()),
                rel_mse=mse / power if power > 0 else 0.0,
                optimal_share=share,
                seconds=seconds,
            )
        )
    return RecipesReport(tuple(rows), x64.numel() // NVFP4_BLOCK, tuple(x.shape))
