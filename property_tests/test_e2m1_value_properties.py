"""The arithmetic E2M1 rounding of the scale search equals the comparison ladder, bit for bit."""

import itertools
import math

import torch
from hypothesis import given
from hypothesis import strategies as st

from floatxq.formats import E2M1_VALUES
from floatxq.nvfp4.e2m1 import _e2m1_index, _e2m1_table, _e2m1_value, _e2m1_value_


def _ladder(m: torch.Tensor) -> torch.Tensor:
    """The E2M1 magnitude through the comparison ladder and the table (the reference)."""
    return _e2m1_table(m.device)[_e2m1_index(m).long()]


def _bits(t: torch.Tensor) -> list[int]:
    return t.contiguous().view(torch.int32).tolist()


@given(st.lists(st.floats(width=32).map(abs), min_size=1, max_size=64))
def test_the_arithmetic_rounding_is_the_ladder(values):
    m = torch.tensor(values, dtype=torch.float32)
    assert _bits(_e2m1_value(m)) == _bits(_ladder(m))
    assert _bits(_e2m1_value_(m.clone())) == _bits(_ladder(m))


def test_every_boundary_and_its_neighbours():
    # the midpoints between E2M1 values (ties go to the even index), the values themselves,
    # saturation, specials, and one FP32 step either side of each
    grid = list(E2M1_VALUES)
    points = grid + [(a + b) / 2 for a, b in itertools.pairwise(grid)]
    points += [7.0, 8.0, 1e30, 3.4e38, math.inf, 1e-45, 1.2e-38, math.nan]
    m = torch.tensor(points, dtype=torch.float32)
    near = torch.cat(
        [m, torch.nextafter(m, torch.tensor(math.inf)), torch.nextafter(m, torch.tensor(0.0))]
    )
    assert _bits(_e2m1_value(near)) == _bits(_ladder(near))
    assert _e2m1_value(torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])).tolist() == [
        0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0,
    ]  # fmt: skip


def test_a_dense_sweep_of_the_rounding_range():
    # every 97th FP32 value in [0, 8]: all the exponents and mantissa patterns E2M1 distinguishes
    top = int(torch.tensor(8.0).view(torch.int32))
    m = torch.arange(0, top + 1, 97, dtype=torch.int32).view(torch.float32)
    assert torch.equal(_e2m1_value(m).view(torch.int32), _ladder(m).view(torch.int32))
