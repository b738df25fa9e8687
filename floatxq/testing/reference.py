"""Independent oracles: slow, obviously correct numpy + ml_dtypes versions of floatxq's math.

They share no code with the library (only the format *names*), so a test comparing the two can
fail. ml_dtypes rounds to nearest-even; its out-of-range casts give NaN, so every oracle here
clamps first, exactly as the contract says the library does.
"""

from typing import Any

import ml_dtypes
import numpy as np
import torch

from floatxq._typing import Float, Shaped, Tensor

ML_DTYPES: dict[str, Any] = {
    "float8_e4m3fn": ml_dtypes.float8_e4m3fn,
    "float8_e5m2": ml_dtypes.float8_e5m2,
    "float8_e4m3fnuz": ml_dtypes.float8_e4m3fnuz,
    "float8_e5m2fnuz": ml_dtypes.float8_e5m2fnuz,
    "float8_e8m0fnu": ml_dtypes.float8_e8m0fnu,
}
"""ml_dtypes scalar type for each canonical FP8 name."""

FP8_PAYLOAD_KEYS: frozenset[str] = frozenset(
    {
        "bits",
        "group_size",
        "desc_act",
        "lm_head",
        "method",
        "quant_method",
        "format",
        "checkpoint_format",
        "pack_dtype",
        "weight_scale_method",
        "weight_scale_semantics",
        "sym",
    }
)
"""The keys every GPT-QModel FP8 ``quantize_config`` payload carries, whatever the config."""


def ml_decode_codes(codes: np.ndarray, name: str) -> np.ndarray:
    """Decode uint8 codes of format ``name`` to float32 with ml_dtypes."""
    return codes.astype(np.uint8).view(ML_DTYPES[name]).astype(np.float32)


def ml_encode(values: np.ndarray, name: str) -> np.ndarray:
    """Clamp float32 ``values`` to ±max finite, round with ml_dtypes, return the uint8 codes."""
    fmax = np.float32(ml_dtypes.finfo(ML_DTYPES[name]).max)
    clipped = np.clip(values.astype(np.float32), -fmax, fmax)
    return clipped.astype(ML_DTYPES[name]).view(np.uint8)


def ref_quantize_fp8_weight(
    weight: Float[Tensor, "out in"],
    *,
    name: str,
    method: str,
    block: tuple[int, int] | None = None,
) -> tuple[Shaped[Tensor, "out in"], Tensor]:
    """Reference FP8 weight quantization, one region at a time in numpy float32.

    ``scale_inv = min(fmax / max(amax, FLT_MIN), FLT_MAX)`` (1 for amax == 0), codes
    ``round(clip(w * scale_inv))``; returns ``(codes as torch FP8, scale_inv as torch float32)``.
    """
    w = weight.detach().cpu().to(torch.float32).numpy()
    fmax = np.float32(ml_dtypes.finfo(ML_DTYPES[name]).max)
    tiny, big = np.finfo(np.float32).tiny, np.finfo(np.float32).max
    rows, cols = w.shape
    if method == "tensor":
        regions = [(slice(0, rows), slice(0, cols))]
        grid: tuple[int, ...] = ()
    elif method == "row":
        regions = [(slice(r, r + 1), slice(0, cols)) for r in range(rows)]
        grid = (rows,)
    else:
        assert block is not None
        br, bc = block
        regions = [
            (slice(i * br, (i + 1) * br), slice(j * bc, (j + 1) * bc))
            for i in range(rows // br)
            for j in range(cols // bc)
        ]
        grid = (rows // br, cols // bc)
    codes = np.zeros((rows, cols), dtype=np.uint8)
    scales = np.ones(len(regions), dtype=np.float32)
    with np.errstate(over="ignore"):
        for k, (rs, cs) in enumerate(regions):
            region = w[rs, cs]
            amax = np.float32(np.abs(region).max()) if region.size else np.float32(0)
            if amax > 0:
                s = np.float32(fmax / np.float32(max(amax, tiny)))
                scales[k] = min(s, big)
            codes[rs, cs] = ml_encode(region * scales[k], name)
    dtype = getattr(torch, name)
    return (
        torch.from_numpy(codes).view(dtype),
        torch.from_numpy(scales.reshape(grid).copy()),
    )


def ref_fp8_token_qdq(x: Float[Tensor, "rows k"]) -> Float[Tensor, "rows k"]:
    """Reference per-row E4M3 QDQ in numpy float32 (2-D input), returned in ``x.dtype``."""
    v = x.detach().cpu().to(torch.float32).numpy()
    out = np.empty_like(v)
    for r in range(v.shape[0]):
        amax = np.float32(np.abs(v[r]).max()) if v.shape[1] else np.float32(0)
        scale = np.float32(amax / np.float32(448.0)) if amax > 0 else np.float32(1.0)
        if scale == 0:
            scale = np.float32(2.0**-149)
        codes = ml_encode(v[r] / scale, "float8_e4m3fn")
        out[r] = ml_decode_codes(codes, "float8_e4m3fn") * scale
    return torch.from_numpy(out).to(x.dtype)


# ------------------------------------------------------------------------------------------------
# NVFP4 (docs/numerics.md), one block at a time in numpy float32
# ------------------------------------------------------------------------------------------------

_E2M1 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=np.float32)


def ref_e2m1_round(q: float | np.floating) -> tuple[float, int]:
    """``(signed value, magnitude index)`` of one float32 by the E2M1 rounding boundaries.

    Magnitudes above a boundary round up; a magnitude exactly on one rounds to the even code
    (0.25 → 0, 0.75 → 1, 1.25 → 1, 1.75 → 2, 2.5 → 2, 3.5 → 4, 5 → 4).
    """
    m = min(abs(float(q)), 6.0)
    index = 0
    for bound, inclusive in ((0.25, False), (0.75, True), (1.25, False), (1.75, True),
                             (2.5, False), (3.5, True), (5.0, False)):  # fmt: skip
        if m > bound or (inclusive and m == bound):
            index += 1
    return float(np.copysign(_E2M1[index], np.float32(q))), index


def _tree_sum(values: np.ndarray) -> np.float32:
    v = values.astype(np.float32)
    while v.shape[0] > 1:
        half = v.shape[0] // 2
        v = (v[:half] + v[half:]).astype(np.float32)
    return np.float32(v[0])


def _e4m3(t: float | np.floating) -> np.float32:
    return np.float32(np.float32(t).astype(ml_dtypes.float8_e4m3fn).astype(np.float32))


def _e4m3_bits(t: float | np.floating) -> int:
    return int(np.array(t, dtype=np.float32).astype(ml_dtypes.float8_e4m3fn).view(np.uint8))


def _from_bits(bits: int) -> np.float32:
    return np.float32(
        np.array(bits, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    )


def ref_nvfp4_block(
    block: np.ndarray, g: float | np.floating, recipe: str
) -> tuple[np.float32, np.ndarray, np.float32]:
    """``(scale, signed values, sse)`` of one 16-value block, following ``docs/numerics.md``.

    ``recipe`` is a *local* algorithm (``nvidia``, ``four_six``, ``least_squares``,
    ``least_squares_grid`` or ``exhaustive``). Sums use the contract's pairwise order.
    """
    v = block.astype(np.float32)
    g = np.float32(g)
    amax = np.float32(np.abs(v).max())

    def evaluate(s: np.float32) -> tuple[np.ndarray, np.float32]:
        e = np.float32(s * g)
        q = np.array([ref_e2m1_round(np.float32(x / e))[0] for x in v], dtype=np.float32)
        return q, _tree_sum(((q * e).astype(np.float32) - v) ** 2)

    def clamp_e4m3(t: np.float32, valid: bool) -> np.float32:
        return _e4m3(np.float32(min(max(t, 2.0**-9), 448.0))) if valid else np.float32(1.0)

    best_s, best_q, best_e = None, None, None
    candidates = []
    for m in (6.0,) if recipe == "nvidia" else (4.0, 6.0):
        s = clamp_e4m3(np.float32(amax / np.float32(np.float32(m) * g)), bool(amax > 0))
        q, err = evaluate(s)
        candidates.append(q)
        if best_e is None or err < best_e:
            best_s, best_q, best_e = s, q, err

    def accept(s: np.float32) -> None:
        nonlocal best_s, best_q, best_e
        q, err = evaluate(s)
        if err < best_e:
            best_s, best_q, best_e = s, q, err

    def least_squares(q: np.ndarray) -> np.float32:
        den = _tree_sum(q * q)
        opt = np.float32(_tree_sum(v * q) / np.float32(max(den, np.float32(1.0))))
        return clamp_e4m3(np.float32(opt / g), bool(den > 0))

    if recipe in ("nvidia", "four_six"):
        return best_s, best_q, best_e
    if recipe == "exhaustive":
        for bits in range(1, 127):
            accept(_from_bits(bits))
        return best_s, best_q, best_e
    for q in candidates:
        accept(least_squares(q))
    accept(least_squares(best_q))
    if recipe == "least_squares":
        return best_s, best_q, best_e
    center = _e4m3_bits(best_s)
    for offset in range(-8, 9):
        accept(_from_bits(min(max(center + offset, 1), 126)))
    return best_s, best_q, best_e
