"""Test helpers that floatxq's own suites use and users can import into theirs.

``floatxq.testing.assertions`` (bitwise, NaN- and signed-zero-aware comparisons) needs only torch.
``floatxq.testing.reference`` (independent numpy/ml_dtypes oracles) needs ``ml_dtypes`` and
``floatxq.testing.strategies`` (shrinkable Hypothesis strategies for weights, activations, INT4
codes and packed GPTQ words, for testing your own quantizers) needs ``hypothesis``, and
``floatxq.testing.interpreter`` (Triton kernels under ``TRITON_INTERPRET=1`` in a child pytest)
needs ``pytest``: they come with the
``test`` extra and are imported only when those modules are. ``assert_fp8_linear_close`` is the
per-element bound every FP8 GEMM path is held to against ``floatxq.fp8_scaled_linear``, for an
error model of its accumulation (``FP32_ACCUMULATION``, ``HOPPER_FP8_ACCUMULATION``);
``w4a_fp8_linear_error_bound``, ``w4a_nvfp4_linear_error_bound`` and
``w4a16_linear_error_bound`` give the same bounds for the INT4-weight GEMMs and
``decoded_linear_error_bound`` for FP32 products with a decoded weight (the MLX layers),
checked with ``assert_within_bound``.
``unchecked`` (one function) and ``production_checks`` (a block) switch the test run's
jaxtyping/beartype check off, to see the errors users get; ``assert_fields_match_annotations``
checks that a config's fields hold their declared types.
"""

from floatxq.testing.assertions import (
    FP32_ACCUMULATION,
    HOPPER_FP8_ACCUMULATION,
    Accumulation,
    FP8LinearBound,
    assert_bitwise_equal,
    assert_fields_match_annotations,
    assert_fp8_linear_close,
    assert_within_bound,
    bits_of,
    decoded_linear_error_bound,
    fp8_linear_error_bound,
    production_checks,
    unchecked,
    w4a16_linear_error_bound,
    w4a_fp8_linear_error_bound,
    w4a_nvfp4_linear_error_bound,
)

__all__ = [
    "FP32_ACCUMULATION",
    "HOPPER_FP8_ACCUMULATION",
    "Accumulation",
    "FP8LinearBound",
    "assert_bitwise_equal",
    "assert_fields_match_annotations",
    "assert_fp8_linear_close",
    "assert_within_bound",
    "bits_of",
    "decoded_linear_error_bound",
    "fp8_linear_error_bound",
    "production_checks",
    "unchecked",
    "w4a16_linear_error_bound",
    "w4a_fp8_linear_error_bound",
    "w4a_nvfp4_linear_error_bound",
]
