"""Hypothesis profiles for the executable specification.

``ci`` (the default of ``make test``): derandomized, few examples, every test well under a second.
``nightly``: thousands of random examples; run with ``HYPOTHESIS_PROFILE=nightly make test``.
A property that runs several searches per example takes a fraction of the profile's examples
(``settings(max_examples=max(10, settings.default.max_examples // k))``), so it scales with the
profile. Every public pure function in ``floatxq.__all__`` has at least one property here; none is
exempt.
floatxq is not imported here: the jaxtyping import hook must see it first.
"""

import os

import torch
from hypothesis import HealthCheck, settings

settings.register_profile(
    "ci",
    max_examples=50,
    deadline=None,
    derandomize=True,
    database=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile("dev", max_examples=200, deadline=None)
settings.register_profile(
    "nightly", max_examples=3000, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

torch.set_num_threads(1)
