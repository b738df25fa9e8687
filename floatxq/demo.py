"""The demo's measurements: FP8 error and size for every format × scale layout on one weight.

Pure: a weight in, frozen rows out; ``floatxq demo`` (``floatxq/cli.py``) prints them.
"""

import time
from typing import NamedTuple

import torch

from floatxq._typing import Float, Tensor
from floatxq.fp8 import dequantize_fp8_weight, quantize_fp8_weight

DEMO_FORMATS: tuple[str, ...] = (
    "float8_e4m3fn",
    "float8_e5m2",
    "float8_e4m3fnuz",
    "float8_e5m2fnuz",
)
DEMO_LAYOUTS: tuple[tuple[str, tuple[int, int] | None], ...] = (
    ("tensor", None),
    ("row", None),
    ("block", (128, 128)),
)


class FP8ErrorRow(NamedTuple):
    """One format × layout measurement of :func:`fp8_error_table`."""

    format: str
    layout: str
    rel_mse: float
    """``mean((w_hat - w)**2) / mean(w**2)``."""
    sqnr_db: float
    """``-10 log10(rel_mse)``."""
    max_abs_err: float
    bytes: int
    """Codes (1 byte each) plus FP32 inverse scales (4 bytes each)."""
    bits_per_weight: float
    seconds: float
    """Wall time of quantize + dequantize (informational only)."""


def demo_weight(
    rows: int = 1024, cols: int = 2048, *, seed: int = 0, outlier_rate: float = 1e-3
) -> Float[Tensor, "rows cols"]:
    """A seeded LLM-like weight: Gaussian rows of varied scale plus rare ×50 outliers (FP32).

    Numerics: deterministic for a seed (torch CPU generator), FP32.
    """
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, cols, generator=g) * 0.02
    w = w * torch.exp2(torch.randn(rows, 1, generator=g))  # per-channel spread
    spikes = torch.rand(rows, cols, generator=g) < outlier_rate
    return torch.where(spikes, w * 50, w)


def fp8_error_table(
    weight: Float[Tensor, "out in"],
    *,
    formats: tuple[str, ...] = DEMO_FORMATS,
    layouts: tuple[tuple[str, tuple[int, int] | None], ...] = DEMO_LAYOUTS,
) -> tuple[FP8ErrorRow, ...]:
    """Quantize ``weight`` with each format × layout and measure reconstruction error and size.

    Numerics: errors in float64 from the FP32 reconstruction; timings are wall-clock, for display.
    """
    w64 = weight.double()
    power = float(w64.pow(2).mean())
    rows = []
    for fmt in formats:
        for method, block in layouts:
            start = time.perf_counter()
            q = quantize_fp8_weight(
                weight, format=fmt, weight_scale_method=method, weight_block_size=block
            )
            back = dequantize_fp8_weight(q.qweight, q.scale_inv)
            seconds = time.perf_counter() - start
            err = back.double() - w64
            rel = float(err.pow(2).mean()) / power if power > 0 else 0.0
            size = q.qweight.numel() + 4 * q.scale_inv.numel()
            rows.append(
                FP8ErrorRow(
                    format=fmt,
                    layout=method if block is None else f"block {block[0]}x{block[1]}",
                    rel_mse=rel,
                    sqnr_db=float("inf")
                    if rel == 0
                    else -10.0 * torch.log10(torch.tensor(rel)).item(),
                    max_abs_err=float(err.abs().max()) if err.numel() else 0.0,
                    bytes=size,
                    bits_per_weight=8.0 * size / max(weight.numel(), 1),
                    seconds=seconds,
                )
            )
    return tuple(rows)
