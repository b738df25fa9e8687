"""Test helpers that floatxq's own suites use and users can import into theirs.

``floatxq.testing.assertions`` (bitwise, NaN- and signed-zero-aware comparisons) needs only torch.
``floatxq.testing.reference`` (independent numpy/ml_dtypes oracles) needs ``ml_dtypes`` and
``floatxq.testing.strategies`` needs ``hypothesis``, ``floatxq.testing.interpreter`` (Triton
kernels under ``TRITON_INTERPRET=1`` in a child pytest) needs ``pytest``: they come with the
``test`` extra and are imported only when those modules are. ``assert_fp8_linear_close`` is the
per-element bound every FP8 GEMM path is held to against ``floatxq.fp8_scaled_linear``.
"""

from floatxq.testing.assertions import (
    assert_bitwise_equal,
    assert_fp8_linear_close,
    bits_of,
    unchecked,
)

__all__ = ["assert_bitwise_equal", "assert_fp8_linear_close", "bits_of", "unchecked"]
