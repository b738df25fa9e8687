"""The ``exhaustive`` recipe's windowed scan equals the literal 126-code scan bit for bit, and the
per-recipe report measures each recipe against that optimum (docs/numerics.md, "The exhaustive
window")."""

import itertools
import math

import hypothesis.extra.numpy as hnp
import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import floatxq as fq
from floatxq.nvfp4 import quantize as q
from floatxq.testing import assert_bitwise_equal
from floatxq.testing.strategies import nvfp4_inputs, power_of_two_exponents

LADDER = ("nvidia", "four_six", "least_squares", "least_squares_grid", "exhaustive")


def _dense_blocks(rows: int):
    """Blocks of ordinary values (an outlier beside a dense body is where windows are tight)."""
    body = hnp.arrays(np.float32, (rows, 16), elements=st.floats(-3, 3, width=32))
    return body.map(torch.from_numpy)


@given(
    st.one_of(nvfp4_inputs(max_rows=4, max_blocks=4, block_spread=30), _dense_blocks(24)),
    power_of_two_exponents(-118, 110),
    st.floats(1.0, 2.0, exclude_max=True, width=32),
)
def test_windowed_exhaustive_scan_equals_the_literal_scan(x, e, mantissa):
    # global scales inside and outside the window's safe range [2**-110, 2**100]
    g = torch.tensor(mantissa * 2.0**e, dtype=torch.float32)
    blocks = x.reshape(-1, 16)
    mag = blocks.abs()
    seeds = q._search_chunk(blocks, g, "four_six")  # exhaustive's seeds: amax → 4, then 6
    windowed = q._exhaustive_scan(mag, seeds, g)
    literal = q._exhaustive_full_scan(mag, seeds, g)
    assert_bitwise_equal(windowed.scale, literal.scale)
    assert_bitwise_equal(windowed.index, literal.index)
    assert_bitwise_equal(windowed.err, literal.err)
    # and the public search is that scan
    found = fq.nvfp4_block_scales(x, g, "exhaustive").block_scales.float().reshape(-1)
    assert_bitwise_equal(found, literal.scale)


# eleven searches per example: a quarter of the profile's examples (the nightly profile keeps more)
@settings(max_examples=max(10, settings.default.max_examples // 4))
@given(nvfp4_inputs(max_rows=1, max_blocks=3, block_spread=6, max_magnitude=2.0**8))
def test_recipes_report_measures_every_recipe_against_the_exhaustive_optimum(x):
    g = fq.nvfp4_global_scale(x.abs().amax(), recipe="least_squares")
    report = fq.recipes_report(x, global_scale=g, recipes=LADDER)
    assert [row.recipe for row in report.rows] == list(LADDER)
    assert report.blocks == x.numel() // 16 and report.shape == tuple(x.shape)
    optimum = fq.nvfp4_block_sse(x, fq.nvfp4_block_scales(x, g, "exhaustive").block_scales, g)
    for row in report.rows:
        sse = fq.nvfp4_block_sse(x, fq.nvfp4_block_scales(x, g, row.recipe).block_scales, g)
        assert row.global_scale == g.item()
        assert math.isclose(row.sse, sse.double().sum().item(), rel_tol=1e-12, abs_tol=0.0)
        assert row.optimal_share == (sse == optimum).double().mean().item()
    # each recipe's candidates extend the previous one's: the SSE never rises along the ladder
    sses = [row.sse for row in report.rows]
    assert all(a >= b for a, b in itertools.pairwise(sses))
    assert report.rows[-1].optimal_share == 1.0
