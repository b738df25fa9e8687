"""Metal kernels of the MLX FP8 path, each beside the MLX-ops reference it must match.

Three kernels, compiled by MLX (``mx.fast.metal_kernel``) on Apple GPUs only:

* ``packed_general`` (reference: :meth:`floatxq.mlx.MlxFP8PackedLinear.reference`): one thread
  per output element; it reads the row's FP8 bytes once, looks each up in the 256-entry FP32
  table and accumulates ``x * table[code]`` with fused multiply-adds in input order, dividing
  each scale region's partial sum by its inverse scale (once per row for tensor and row scales,
  once per ``in/bc`` block for block scales).
* ``packed_prefill`` (same reference): one thread per output column and 16-row tile of ``x``;
  each decoded weight serves the 16 rows, so the bytes are read once per tile instead of once
  per row. Its arithmetic per output element is ``packed_general``'s, step for step, so the two
  routes return the same bytes.
* ``fp8_encode`` (reference: the array-ops encoder of :func:`floatxq.mlx.quantize_fp8_weight_mlx`):
  one thread per weight element; ``clamp(w * scale_inv)`` in FP32 and the FP8 byte built from the
  FP32 bits with integer operations, the same operations as the array-ops encoder.

A kernel runs from a :class:`MetalLaunch` plan (inputs, template arguments, grid, threadgroup,
output): :func:`packed_linear_launch` and :func:`fp8_encode_launch` build it from arrays and
:func:`run_metal` hands it to MLX. The tests run the same plans through a C++ build of the same
kernel sources on machines without Metal, and compare with the references.

The kernels compile in MLX's default ``"safe"`` math mode: IEEE multiply, add and division, and
explicit ``fma`` where the sources fuse. Which route a packed layer takes is
:func:`floatxq.dispatch.mlx_packed_route`'s choice; it never changes bytes between the two Metal
routes and changes them from the array-ops reference only by the order of the FP32 sums (see
:meth:`~floatxq.mlx.MlxFP8PackedLinear.reference`).
"""

import functools
from collections.abc import Mapping
from typing import Any, NamedTuple

import mlx.core as mx

from floatxq._typing import Float, Float32, UInt8
from floatxq.dispatch.mlx import (  # re-exported: their old home
    FP8_ENCODE_MIN_ELEMENTS,
    PREFILL_MAX_IN,
    PREFILL_MIN_OUT,
    mlx_packed_route,
)
from floatxq.formats import MODEL_DTYPES

__all__ = [
    "FP8_ENCODE_MIN_ELEMENTS",
    "METAL_SOURCES",
    "MLX_FLOAT_NAMES",
    "PREFILL_MAX_IN",
    "PREFILL_MIN_OUT",
    "PREFILL_TILE_ROWS",
    "MetalLaunch",
    "fp8_encode_launch",
    "metal_available",
    "packed_linear_launch",
    "packed_route",
    "run_metal",
]

MLX_FLOAT_NAMES: tuple[str, ...] = tuple(str(d).removeprefix("torch.") for d in MODEL_DTYPES)
"""MLX dtype names of floatxq's model dtypes (``float16``, ``bfloat16``, ``float32``)."""

PREFILL_TILE_ROWS = 16
"""Rows of ``x`` one prefill thread serves with each decoded weight."""

_PACKED_BODY = """
    uint n = thread_position_in_grid.x;
    uint M = dims[0];
    uint K = dims[1];
    uint N = dims[2];
    uint STEP = SCALE_KIND == 2 ? dims[4] : K;
    uint GC = K / STEP;
    if (n >= N) {
        return;
    }
"""

_PACKED_GENERAL = (
    _PACKED_BODY
    + """
    uint r = thread_position_in_grid.y;
    if (r >= M) {
        return;
    }
    float acc = 0.0f;
    for (uint b = 0; b < GC; ++b) {
        float part = 0.0f;
        for (uint k = b * STEP; k < (b + 1) * STEP; ++k) {
            float w = table[q[(size_t)n * K + k]];
            part = metal::fma(static_cast<float>(x[(size_t)r * K + k]), w, part);
        }
        float s = SCALE_KIND == 2 ? scale[(n / dims[3]) * GC + b]
                                  : scale[SCALE_KIND == 1 ? n : 0];
        acc = acc + metal::precise::divide(part, s);
    }
    if (HAS_BIAS) {
        acc = acc + bias[n];
    }
    y[(size_t)r * N + n] = static_cast<T>(acc);
"""
)

_PACKED_PREFILL = (
    _PACKED_BODY
    + """
    uint r0 = thread_position_in_grid.y * 16;
    if (r0 >= M) {
        return;
    }
    uint rows = metal::min(16u, M - r0);
    float acc[16];
    float part[16];
    for (uint i = 0; i < 16; ++i) {
        acc[i] = 0.0f;
    }
    for (uint b = 0; b < GC; ++b) {
        for (uint i = 0; i < 16; ++i) {
            part[i] = 0.0f;
        }
        for (uint k = b * STEP; k < (b + 1) * STEP; ++k) {
            float w = table[q[(size_t)n * K + k]];
            for (uint i = 0; i < rows; ++i) {
                part[i] = metal::fma(static_cast<float>(x[(size_t)(r0 + i) * K + k]), w, part[i]);
            }
        }
        float s = SCALE_KIND == 2 ? scale[(n / dims[3]) * GC + b]
                                  : scale[SCALE_KIND == 1 ? n : 0];
        for (uint i = 0; i < rows; ++i) {
            acc[i] = acc[i] + metal::precise::divide(part[i], s);
        }
    }
    for (uint i = 0; i < rows; ++i) {
        float v = acc[i];
        if (HAS_BIAS) {
            v = v + bias[n];
        }
        y[(size_t)(r0 + i) * N + n] = static_cast<T>(v);
    }
"""
)

_FP8_ENCODE = """
    uint c = thread_position_in_grid.x;
    uint r = thread_position_in_grid.y;
    uint R = dims[0];
    uint C = dims[1];
    if (c >= C || r >= R) {
        return;
    }
    float s = SCALE_KIND == 2 ? scale[(r / dims[2]) * (C / dims[3]) + c / dims[3]]
                              : scale[SCALE_KIND == 1 ? r : 0];
    float v = metal::clamp(static_cast<float>(w[(size_t)r * C + c]) * s, -fp8max[0], fp8max[0]);
    uint bits = as_type<uint>(v);
    uint sign = (bits >> 31) << 7;
    uint mag = bits & 0x7FFFFFFFu;
    uint exp32 = mag >> 23;
    uint drop = 23u - MBITS;
    uint lsb = (mag >> drop) & 1u;
    uint normal = ((mag + ((1u << (drop - 1u)) - 1u) + lsb) >> drop) - ((127u - BIAS) << MBITS);
    uint mant = mag & 0x7FFFFFu;
    uint sig = exp32 > 0u ? (mant | 0x800000u) : mant;
    int e_eff = (int)metal::max(exp32, 1u);
    uint shift = (uint)metal::clamp(151 - (int)BIAS - (int)MBITS - e_eff, 1, 25);
    uint odd = (sig >> shift) & 1u;
    uint sub = (sig + ((1u << (shift - 1u)) - 1u) + odd) >> shift;
    uint code = exp32 >= (128u - BIAS) ? normal : sub;
    uint out = code | sign;
    if (NEG_ZERO == 0 && code == 0u) {
        out = 0u;
    }
    codes[(size_t)r * C + c] = (uint8_t)out;
"""

METAL_SOURCES: Mapping[str, tuple[tuple[str, ...], tuple[str, ...], str]] = {
    # name: (input names, output names, kernel body)
    "packed_general": (
        ("x", "q", "table", "scale", "bias", "dims"),
        ("y",),
        _PACKED_GENERAL,
    ),
    "packed_prefill": (
        ("x", "q", "table", "scale", "bias", "dims"),
        ("y",),
        _PACKED_PREFILL,
    ),
    "fp8_encode": (("w", "scale", "dims", "fp8max"), ("codes",), _FP8_ENCODE),
}
"""Each kernel's input names, output names and Metal body (MLX writes the signature)."""


class MetalLaunch(NamedTuple):
    """Everything one kernel launch needs: which kernel, its arrays, template and geometry.

    Fields:
      kernel: a key of :data:`METAL_SOURCES`.
      inputs: arrays in the kernel's input order (all 1-D or 2-D, row-contiguous).
      template: ``(name, value)`` pairs: ``T`` a dtype, the others ints.
      grid: threads per axis ``(x, y, z)`` (MLX dispatches threads, not groups).
      threadgroup: threads per group.
      output_shape: the output's shape.
      output_dtype: the output's dtype.
    """

    kernel: str
    inputs: tuple[mx.array, ...]
    template: tuple[tuple[str, Any], ...]
    grid: tuple[int, int, int]
    threadgroup: tuple[int, int, int]
    output_shape: tuple[int, ...]
    output_dtype: Any


def metal_available() -> bool:
    """Whether MLX can run Metal kernels here (an Apple GPU with MLX's Metal backend)."""
    try:
        return bool(mx.metal.is_available())
    except AttributeError:  # an MLX build without the metal module
        return False


def packed_route(rows: int, in_features: int, out_features: int) -> str:
    """Which packed-byte kernel serves a product of ``rows`` by a ``(out, in)`` FP8 weight.

    The route of :func:`floatxq.dispatch.mlx_packed_route` where Metal runs (the choice and its
    rules live there): ``"prefill"`` for many rows by a wide output, else ``"general"``.

    Example:
      >>> packed_route(64, 4096, 14336), packed_route(1, 4096, 14336), packed_route(64, 4096, 4096)
      ('prefill', 'general', 'general')
    """
    return mlx_packed_route(rows, in_features, out_features, metal=True)[0]


def packed_linear_launch(
    x: Float[mx.array, "rows in"],
    qweight: UInt8[mx.array, "out in"],
    table: Float32[mx.array, "256"],
    scale_inv: Float32[mx.array, "*scale"],
    bias: Float[mx.array, "out"] | None,  # noqa: F821
    *,
    route: str,
) -> MetalLaunch:
    """The launch plan of ``x @ decode(qweight).T + bias`` on one packed-byte kernel.

    Args:
      x: ``(rows, in)`` float16/bfloat16/float32 inputs.
      qweight: FP8 byte codes ``(out, in)``.
      table: the format's 256-entry FP32 decode table (:func:`floatxq.mlx.fp8_decode_table`).
      scale_inv: FP32 inverse scales ``()``, ``(out,)`` or ``(out/br, in/bc)``.
      bias: ``(out,)`` float bias or ``None``.
      route: ``"prefill"`` or ``"general"`` (see :func:`packed_route`).

    Returns:
      A :class:`MetalLaunch` whose output is ``(rows, out)`` in ``x``'s dtype. Inputs go in as
      the kernel reads them: the scale grid flattened (a tensor scale as one element), the bias
      widened to FP32 exactly (a one-element placeholder without bias, never read) and the sizes
      ``(rows, in, out, block rows, block cols)`` as ``uint32``.

    Raises:
      ValueError: an unknown route. (Shapes and values are the caller's to check:
        :class:`floatxq.mlx.MlxFP8PackedLinear` does.)

    Numerics: a plan only; see the module docstring for the kernels' arithmetic.

    Example:
      >>> plan = packed_linear_launch(
      ...     mx.zeros((20, 64)), mx.zeros((8, 64), dtype=mx.uint8), mx.zeros((256,)),
      ...     mx.array(1.0), None, route="prefill")
      >>> plan.kernel, plan.grid, plan.output_shape
      ('packed_prefill', (8, 2, 1), (20, 8))
    """
    rows, inp = x.shape
    out = qweight.shape[0]
    kind = scale_inv.ndim  # the kernels' SCALE_KIND: 0 tensor, 1 row, 2 block
    br, bc = (out // scale_inv.shape[0], inp // scale_inv.shape[1]) if kind == 2 else (1, inp)
    dims = mx.array([rows, inp, out, br, bc], dtype=mx.uint32)
    b = mx.zeros((1,), mx.float32) if bias is None else bias.astype(mx.float32)
    template = (("T", x.dtype), ("HAS_BIAS", int(bias is not None)), ("SCALE_KIND", kind))
    if route == "prefill":
        tiles = -(-rows // PREFILL_TILE_ROWS)
        grid, group = (out, tiles, 1), (32, 1, 1)
    elif route == "general":
        grid, group = (out, rows, 1), (min(out, 64), 1, 1)
    else:
        raise ValueError(
            f"packed_linear_launch: route must be 'prefill' or 'general', got {route!r}"
        )
    inputs = (x, qweight, table, scale_inv.reshape(-1), b, dims)
    return MetalLaunch(f"packed_{route}", inputs, template, grid, group, (rows, out), x.dtype)


def fp8_encode_launch(
    w: Float[mx.array, "rows cols"],
    scale_inv: Float32[mx.array, "*scale"],
    *,
    mbits: int,
    bias: int,
    negative_zero: bool,
    fmax: float,
) -> MetalLaunch:
    """The launch plan of the FP8 byte encoder over ``w`` with its region scales.

    Args:
      w: the ``(rows, cols)`` weight, float16/bfloat16/float32, finite.
      scale_inv: its FP32 inverse scales (multiply to quantize) ``()``, ``(rows,)`` or a block
        grid ``(rows/br, cols/bc)``.
      mbits, bias, negative_zero: the format's mantissa bits, exponent bias and whether it keeps
        ``-0`` (E4M3FN: 3, 7, True; E5M2: 2, 15, True; the fnuz formats: bias + 1, False).
      fmax: the format's largest finite value (the clamp).

    Returns:
      A :class:`MetalLaunch` whose output is the ``(rows, cols)`` ``uint8`` codes.

    Numerics: a plan only; the kernel computes the array-ops encoder's bytes.

    Example:
      >>> fp8_encode_launch(mx.ones((3, 5)), mx.array(448.0), mbits=3, bias=7,
      ...                   negative_zero=True, fmax=448.0).grid
      (5, 3, 1)
    """
    rows, cols = w.shape
    kind = scale_inv.ndim  # the kernel's SCALE_KIND: 0 tensor, 1 row, 2 block
    br, bc = (rows // scale_inv.shape[0], cols // scale_inv.shape[1]) if kind == 2 else (1, 1)
    dims = mx.array([rows, cols, br, bc], dtype=mx.uint32)
    template = (
        ("T", w.dtype),
        ("MBITS", mbits),
        ("BIAS", bias),
        ("NEG_ZERO", int(negative_zero)),
        ("SCALE_KIND", kind),
    )
    inputs = (w, scale_inv.reshape(-1), dims, mx.array([fmax], dtype=mx.float32))
    grid, group = (cols, rows, 1), (min(cols, 256), 1, 1)
    return MetalLaunch("fp8_encode", inputs, template, grid, group, (rows, cols), mx.uint8)


@functools.cache
def _compiled(kernel: str) -> Any:
    inputs, outputs, body = METAL_SOURCES[kernel]
    return mx.fast.metal_kernel(
        name=f"floatxq_{kernel}", input_names=list(inputs), output_names=list(outputs), source=body
    )


def run_metal(plan: MetalLaunch) -> mx.array:
    """Run a launch plan on the Metal GPU and return its output.

    Raises:
      RuntimeError: MLX has no Metal backend here (use the array-ops reference instead).
    """
    if not metal_available():
        raise RuntimeError(
            f"run_metal: kernel {plan.kernel!r} needs MLX's Metal backend (an Apple GPU); use "
            "the array-ops reference elsewhere"
        )
    (result,) = _compiled(plan.kernel)(
        inputs=list(plan.inputs),
        template=list(plan.template),
        grid=plan.grid,
        threadgroup=plan.threadgroup,
        output_shapes=[plan.output_shape],
        output_dtypes=[plan.output_dtype],
    )
    return result
