"""Example-based tests: one torch thread per xdist worker, GPU tests skipped without CUDA.

floatxq is not imported here: the jaxtyping import hook must see it first.
"""

import pytest
import torch

torch.set_num_threads(1)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def production_checks():
    """The test run's annotation check off: the errors users get from floatxq's own checks."""
    from floatxq.testing import production_checks as checks_off

    with checks_off():
        yield
