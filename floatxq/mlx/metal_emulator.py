"""Run floatxq's Metal kernel sources on the CPU: a C++ build of the same kernel bodies.

MLX compiles a kernel body into a function whose parameters are the named input and output
buffers and ``thread_position_in_grid``. Here the same body is compiled by the system C++
compiler under a small shim (address-space words erased, ``metal::fma``/``clamp``/``min``/
``precise::divide`` and ``as_type`` mapped to their IEEE C++ equivalents, ``float16_t`` as
``_Float16`` and ``bfloat16_t`` as a round-to-nearest-even struct like MLX's), and a launcher
calls it once per thread of the plan's grid. Each thread of these kernels writes only its own
outputs and never synchronises, so running the threads one after another computes what the GPU
computes; floating-point results agree bit for bit wherever the GPU's arithmetic is IEEE (MLX's
default "safe" math mode, no flushing of FP32 subnormals).

The tests use :func:`emulate` to check the kernels where Metal is absent; it needs a C++17
compiler with ``_Float16`` (``g++`` 12 or later; :func:`compiler` says which is found).
"""

import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import mlx.core as mx
import numpy as np

from floatxq.mlx.kernels import METAL_SOURCES, MetalLaunch

_SHIM = r"""
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#define device
#define constant
typedef unsigned int uint;
struct uint3 { uint x, y, z; };
typedef _Float16 float16_t;
template <class To, class From> static inline To as_type(From f) {
  static_assert(sizeof(To) == sizeof(From), "as_type needs equal sizes");
  To t;
  std::memcpy(&t, &f, sizeof(t));
  return t;
}
struct bfloat16_t {
  uint16_t bits;
  bfloat16_t() = default;
  explicit bfloat16_t(float f) {
    uint32_t b = as_type<uint32_t>(f);
    if ((b & 0x7FFFFFFFu) > 0x7F800000u) { bits = 0x7FC0; return; }
    b += ((b >> 16) & 1u) + 0x7FFFu;
    bits = (uint16_t)(b >> 16);
  }
  operator float() const { return as_type<float>((uint32_t)bits << 16); }
};
namespace metal {
static inline float fma(float a, float b, float c) { return std::fma(a, b, c); }
template <class T> static inline T min(T a, T b) { return a < b ? a : b; }
template <class T> static inline T max(T a, T b) { return a > b ? a : b; }
static inline float clamp(float x, float lo, float hi) { return std::fmin(std::fmax(x, lo), hi); }
static inline int clamp(int x, int lo, int hi) { return x < lo ? lo : (x > hi ? hi : x); }
namespace precise { static inline float divide(float a, float b) { return a / b; } }
}
"""

_CTYPE = {
    mx.float32: ("float", np.float32),
    mx.float16: ("float16_t", np.uint16),
    mx.bfloat16: ("bfloat16_t", np.uint16),
    mx.uint8: ("uint8_t", np.uint8),
    mx.uint32: ("uint32_t", np.uint32),
}
_CACHE = Path(tempfile.gettempdir()) / "floatxq-metal-emulator"


def compiler() -> str | None:
    """The C++ compiler the emulator uses, or None."""
    return shutil.which("g++")


def _template_value(value) -> tuple[str, str]:
    if isinstance(value, mx.Dtype):
        return "typename", _CTYPE[value][0]
    if isinstance(value, bool):
        return "bool", "true" if value else "false"
    return "int", str(int(value))


def _source(plan: MetalLaunch) -> str:
    in_names, out_names, body = METAL_SOURCES[plan.kernel]
    pairs = zip(in_names, plan.inputs, strict=True)
    params = [f"const {_CTYPE[a.dtype][0]}* {n}" for n, a in pairs]
    params += [f"{_CTYPE[plan.output_dtype][0]}* {n}" for n in out_names]
    params.append("uint3 thread_position_in_grid")
    kinds = [(name, *_template_value(v)) for name, v in plan.template]
    header = ", ".join(f"{kind} {name}" for name, kind, _ in kinds)
    args = ", ".join(value for _, _, value in kinds)
    casts = [f"(const {_CTYPE[a.dtype][0]}*)buffers[{i}]" for i, a in enumerate(plan.inputs)] + [
        f"({_CTYPE[plan.output_dtype][0]}*)buffers[{len(plan.inputs)}]"
    ]
    return (
        f"{_SHIM}\ntemplate <{header}>\nstatic void body({', '.join(params)}) {{\n{body}\n}}\n"
        'extern "C" void launch(void** buffers, uint gx, uint gy, uint gz) {\n'
        "  for (uint z = 0; z < gz; ++z)\n    for (uint y = 0; y < gy; ++y)\n"
        "      for (uint x = 0; x < gx; ++x)\n"
        f"        body<{args}>({', '.join(casts)}, uint3{{x, y, z}});\n}}\n"
    )


@functools.cache
def _library(source: str) -> ctypes.CDLL:
    key = hashlib.sha256(source.encode()).hexdigest()[:20]
    _CACHE.mkdir(parents=True, exist_ok=True)
    lib = _CACHE / f"{key}.so"
    if not lib.exists():  # build under this process's own names, then move into place
        src = _CACHE / f"{key}.{os.getpid()}.cpp"
        tmp = _CACHE / f"{key}.{os.getpid()}.so"
        src.write_text(source)
        cmd = [compiler() or "g++", "-std=c++17", "-O2", "-ffp-contract=off", "-shared", "-fPIC"]
        subprocess.run([*cmd, str(src), "-o", str(tmp)], check=True, capture_output=True)
        tmp.replace(lib)
        src.unlink()
    return ctypes.CDLL(str(lib))


def _host(a: mx.array) -> np.ndarray:
    storage = _CTYPE[a.dtype][1]
    if a.dtype in (mx.float16, mx.bfloat16):
        a = mx.view(a, mx.uint16)
    return np.ascontiguousarray(np.array(a, dtype=storage))


def emulate(plan: MetalLaunch) -> mx.array:
    """Run ``plan`` through the C++ build of its kernel source; the output as MLX computes it."""
    lib = _library(_source(plan))
    inputs = [_host(a) for a in plan.inputs]
    out = np.zeros(plan.output_shape, dtype=_CTYPE[plan.output_dtype][1])
    buffers = (ctypes.c_void_p * (len(inputs) + 1))(
        *[a.ctypes.data for a in inputs], out.ctypes.data
    )
    if out.size and all(plan.grid):
        lib.launch(buffers, *(ctypes.c_uint(g) for g in plan.grid))
    result = mx.array(out)
    return mx.view(result, plan.output_dtype) if plan.output_dtype != result.dtype else result
