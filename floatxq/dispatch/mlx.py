"""MLX's Metal kernel choices: the packed-byte linear kernel and the FP8 weight encoder.

Every choice takes sizes and booleans (``metal_available()`` is passed in), never MLX arrays,
and nothing here imports :mod:`floatxq.mlx` (which imports these choices). Whether torch hands a
weight to MLX at all is :func:`floatxq.dispatch.fp8.mlx_encoder_reason`.
"""

__all__ = [
    "FP8_ENCODE_MIN_ELEMENTS",
    "PREFILL_MAX_IN",
    "PREFILL_MIN_OUT",
    "mlx_fp8_encode_route",
    "mlx_packed_route",
]

# ----------------------------------------------------------------------------------------------
# MLX's Metal kernels (MlxFP8PackedLinear, quantize_fp8_weight_mlx)
# ----------------------------------------------------------------------------------------------

PREFILL_MAX_IN = 8192
"""The prefill kernel takes ``in_features`` up to this (and a multiple of 64)."""
PREFILL_MIN_OUT = 8192
"""The prefill kernel takes ``out_features`` from this up (and a multiple of 32)."""
FP8_ENCODE_MIN_ELEMENTS = 1 << 20
"""Weights with at least this many elements are encoded by the Metal kernel where Metal runs."""


def mlx_packed_route(
    rows: int, in_features: int, out_features: int, *, metal: bool
) -> tuple[str, str | None]:
    """``(route, reason)`` of an ``MlxFP8PackedLinear`` call: ``rows`` rows of ``x`` by an
    ``(out_features, in_features)`` FP8 weight, ``metal`` whether MLX runs Metal kernels here.

    Returns:
      ``("prefill", None)`` for more than one row with ``in_features <= PREFILL_MAX_IN``,
      ``in_features % 64 == 0``, ``out_features >= PREFILL_MIN_OUT`` and ``out_features % 32 ==
      0`` (wide outputs, where reading each byte once per 16 rows pays); else ``("general",
      why not prefill)``; without Metal, ``("array-ops", why)``.

    Numerics: a choice only; both kernels compute each output element identically.

    Example:
      >>> mlx_packed_route(64, 4096, 14336, metal=True), mlx_packed_route(1, 64, 8192, metal=False)
      (('prefill', None), ('array-ops', 'MLX has no Metal backend here'))
    """
    if not metal:
        return "array-ops", "MLX has no Metal backend here"
    if rows <= 1:
        return "general", f"{rows} row(s): the prefill kernel pays from two rows"
    if out_features < PREFILL_MIN_OUT or out_features % 32:
        return "general", (
            f"out_features={out_features}: the prefill kernel takes multiples of 32 from "
            f"{PREFILL_MIN_OUT}"
        )
    if in_features > PREFILL_MAX_IN or in_features % 64:
        return "general", (
            f"in_features={in_features}: the prefill kernel takes multiples of 64 up to "
            f"{PREFILL_MAX_IN}"
        )
    return "prefill", None


def mlx_fp8_encode_route(elements: int, *, metal: bool) -> tuple[str, str | None]:
    """``(route, reason)`` of ``quantize_fp8_weight_mlx``'s byte encoder for a weight of
    ``elements`` elements, ``metal`` whether MLX runs Metal kernels here: ``("metal", None)``
    from ``FP8_ENCODE_MIN_ELEMENTS`` elements with Metal, else ``("array-ops", why)``. Both
    give the same bytes.

    Example:
      >>> mlx_fp8_encode_route(16, metal=True)
      ('array-ops', 'fewer than 1048576 elements')
    """
    if not metal:
        return "array-ops", "MLX has no Metal backend here"
    if elements < FP8_ENCODE_MIN_ELEMENTS:
        return "array-ops", f"fewer than {FP8_ENCODE_MIN_ELEMENTS} elements"
    return "metal", None
