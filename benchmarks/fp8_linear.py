"""Time every ``TorchFP8Linear`` route and the FP8 weight-quantize kernel against anchors measured
in the same run.

Usage (GPU): ``python3 benchmarks/fp8_linear.py [--weight-only] [--sweep]`` (M in {1, 16, 4096},
N = K = 8192, bf16 input).
``--probe-only`` prints the environment and the capability probe and stops.

Sections, each printed as a table:

1. Environment: date (UTC), GPU and SM version, torch / Triton / CUDA versions.
2. Probe: which ``scaled_mm`` recipes this torch + GPU accept (tensorwise, rowwise, blockwise
   1x128 x 128x128; output dtypes; e5m2; a bias epilogue), what Triton's ``.to(tl.float8e4nv)``
   does against torch's nearest-even cast, and the PTX of the weight kernel (``div.rn.f32``,
   ``cvt.rn.satfinite``, no ``.ftz`` multiply).
3. Forward: median time (``triton.testing.do_bench``, L2 flushed before each call, CUDA events) of
   each module route and of the raw kernels, with the ratio of each route to raw tensorwise
   ``torch._scaled_mm`` (inputs already FP8: ``x`` cast, no bias), to its own raw recipe, and to
   bf16 ``F.linear``. For tensorwise and rowwise, "own" is the raw call on the very operands the
   route gives cuBLAS (its FP8 codes of ``x``, both scales, the layer's bias): what the module
   adds over the same GEMM. Blockwise's own anchor has no bias.
   A second column times CUDA-graph replays (``do_bench_cudagraph``: no launch gaps).
4. Weight quantize: ``quantize_fp8_weight_kernel`` on an 8192 x 8192 bf16 weight per layout, as
   effective bandwidth (bytes the contract must move: read the weight once, write codes and
   scales) over the bandwidth of a device-to-device copy of the same weight timed in the same
   run; beside it what the entry's time is made of (the kernel alone, with its finiteness flag,
   plus the wait for the GPU that an entry raising on bad values must pay, and the alternatives
   measured: a device flag read with ``.item()``, the previous scale check, a second pass).
   ``--weight-only`` runs only this section (and the environment); ``--sweep`` adds a sweep of
   the kernel's tuning records (``FP8WeightTuning``) per layout.
"""

import argparse
import dataclasses
import datetime
import functools
import itertools
import pathlib
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import floatxq as fq
from floatxq.kernels import fp8_small_m, quantize_fp8_weight_kernel
from floatxq.kernels import fp8_weight as kernel_module

MS = (1, 16, 4096)
N = K = 8192


def _line(*cells: object, widths: tuple[int, ...] = (28, 14, 14, 12, 12, 12)) -> str:
    return "  ".join(str(c).ljust(w) for c, w in zip(cells, widths, strict=False))


def environment() -> None:
    import triton

    props = torch.cuda.get_device_properties(0)
    print("== environment")
    now = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    print(f"date          {now}")
    sm = f"SM {props.major}.{props.minor}, {props.multi_processor_count} SMs"
    print(f"gpu           {props.name}, {sm}")
    print(f"torch         {torch.__version__} (CUDA {torch.version.cuda})")
    print(f"triton        {triton.__version__}")
    blas = getattr(torch.backends.cuda, "preferred_blas_library", lambda: "n/a")()
    print(f"blas          {blas}")


def _try(fn) -> str:
    try:
        out = fn()
        torch.cuda.synchronize()
        return f"ok ({out})" if isinstance(out, str) else "ok"
    except Exception as exc:  # the probe reports every refusal as a row
        return f"NO: {type(exc).__name__}: {str(exc).splitlines()[0][:110]}"


def probe() -> None:
    print("== probe: scaled_mm recipes on this GPU")
    dev = "cuda"
    e4, e5 = torch.float8_e4m3fn, torch.float8_e5m2
    one = torch.ones((), device=dev)

    def mats(m, n, k, da=e4, db=e4):
        a = torch.randn(m, k, device=dev).to(da)
        b = torch.randn(n, k, device=dev).to(db).t()
        return a, b

    rows = []
    for m in (1, 16, 17):
        a, b = mats(m, 256, 512)
        rows.append(
            (
                f"tensorwise e4m3 M={m} bf16",
                lambda a=a, b=b: torch._scaled_mm(a, b, one, one, out_dtype=torch.bfloat16),
            )
        )
    a, b = mats(16, 256, 512)
    rows.append(
        (
            "tensorwise e4m3 fp16 out",
            lambda: torch._scaled_mm(a, b, one, one, out_dtype=torch.float16),
        )
    )
    rows.append(
        (
            "tensorwise e4m3 fp32 out",
            lambda: torch._scaled_mm(a, b, one, one, out_dtype=torch.float32),
        )
    )
    bias = torch.randn(256, device=dev, dtype=torch.bfloat16)
    rows.append(
        (
            "tensorwise bias bf16 epilogue",
            lambda: torch._scaled_mm(a, b, one, one, bias=bias, out_dtype=torch.bfloat16),
        )
    )
    a5, b5 = mats(16, 256, 512, e5, e5)
    rows.append(
        (
            "tensorwise e5m2 x e5m2",
            lambda: torch._scaled_mm(a5, b5, one, one, out_dtype=torch.bfloat16),
        )
    )
    a4, b5b = mats(16, 256, 512, e4, e5)
    rows.append(
        (
            "tensorwise e4m3 x e5m2",
            lambda: torch._scaled_mm(a4, b5b, one, one, out_dtype=torch.bfloat16),
        )
    )
    for m in (1, 16, 17):
        a, b = mats(m, 256, 512)
        sa = torch.rand(m, 1, device=dev) + 0.5
        sb = torch.rand(1, 256, device=dev) + 0.5
        rows.append(
            (
                f"rowwise e4m3 M={m} bf16",
                lambda a=a, b=b, sa=sa, sb=sb: torch._scaled_mm(
                    a, b, sa, sb, out_dtype=torch.bfloat16
                ),
            )
        )
    a, b = mats(16, 256, 512)
    sa, sb = torch.rand(16, 1, device=dev) + 0.5, torch.rand(1, 256, device=dev) + 0.5
    for od in (torch.float16, torch.float32):
        rows.append(
            (f"rowwise e4m3 {od} out", lambda od=od: torch._scaled_mm(a, b, sa, sb, out_dtype=od))
        )
    rows.append(
        (
            "rowwise bias bf16 epilogue",
            lambda: torch._scaled_mm(a, b, sa, sb, bias=bias, out_dtype=torch.bfloat16),
        )
    )
    a4, b5b = mats(16, 256, 512, e4, e5)
    rows.append(
        ("rowwise e4m3 x e5m2", lambda: torch._scaled_mm(a4, b5b, sa, sb, out_dtype=torch.bfloat16))
    )
    recipes = getattr(F, "ScalingType", None)
    rows.append(("F.scaled_mm (v2 API) present", lambda: str(recipes)))
    if recipes is not None:
        r1 = getattr(recipes, "BlockWise1x128", None) or getattr(recipes, "Blockwise_1x128", None)
        r128 = getattr(recipes, "BlockWise128x128", None) or getattr(
            recipes, "Blockwise_128x128", None
        )
        for m in (1, 16, 17, 256):
            for od in (torch.bfloat16, torch.float16, torch.float32):
                if od != torch.bfloat16 and m != 16:
                    continue
                a, b = mats(m, 256, 512)
                kb = 512 // 128
                sa = (torch.rand(kb, m, device=dev) + 0.5).t()
                grid = torch.ones(256 // 128, -(-kb // 4) * 4, device=dev)
                sb = grid.t()
                rows.append(
                    (
                        f"blockwise 1x128.128x128 M={m} {od}",
                        lambda a=a, b=b, sa=sa, sb=sb, od=od: F.scaled_mm(
                            a, b, sa, r1, sb, r128, output_dtype=od
                        ),
                    )
                )
        a, b = mats(16, 256, 512)
        sa = (torch.rand(4, 16, device=dev) + 0.5).t()
        sb = torch.ones(2, 4, device=dev).t()
        rows.append(
            (
                "blockwise bias bf16 epilogue",
                lambda: F.scaled_mm(a, b, sa, r1, sb, r128, bias=bias, output_dtype=torch.bfloat16),
            )
        )
        rows.append(
            (
                "blockwise via torch._scaled_mm v1",
                lambda: torch._scaled_mm(a, b, sa, sb, out_dtype=torch.bfloat16),
            )
        )
    for name, fn in rows:
        print(_line(name, _try(fn), widths=(40, 100)))
    probe_triton()


def probe_triton() -> None:
    import triton
    import triton.language as tl

    print("== probe: Triton float8 conversion and the weight kernel's PTX")

    @triton.jit
    def cast_kernel(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        x = tl.load(x_ptr + offs, mask=mask)
        tl.store(y_ptr + offs, x.to(tl.float8e4nv).to(tl.int8, bitcast=True), mask=mask)

    bf16 = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    values = bf16.float()
    values = values[torch.isfinite(values)].clamp(-448, 448)
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).float()
    finite = torch.unique(codes[torch.isfinite(codes)])
    mids = (finite[1:] + finite[:-1]) / 2
    values = torch.cat(
        [values, mids, torch.nextafter(mids, finite[1:]), torch.nextafter(mids, finite[:-1])]
    )
    x = values.cuda()
    y = torch.empty(x.numel(), dtype=torch.int8, device="cuda")
    cast_kernel[(triton.cdiv(x.numel(), 1024),)](x, y, x.numel(), BLOCK=1024)
    ref = x.to(torch.float8_e4m3fn).view(torch.int8)
    bad = int((ref != y).sum())
    print(
        _line(
            ".to(tl.float8e4nv) vs torch RNE",
            f"{bad} of {x.numel()} differ (bf16 values, midpoints, neighbours)",
            widths=(40, 100),
        )
    )
    w = torch.randn(256, 512, device="cuda")
    for name in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz"):
        quantize_fp8_weight_kernel(w, format=name, weight_scale_method="row")
        ptx = kernel_module.compiled_kernels()[-1].asm["ptx"]  # this format's (a new launch)
        found = {
            "div.rn.f32": "div.rn.f32" in ptx,
            "div.full/approx": "div.full" in ptx or "div.approx" in ptx,
            "cvt.rn.satfinite.e4m3x2": "e4m3x2" in ptx,
            "cvt.rn.satfinite.e5m2x2": "e5m2x2" in ptx,
            ".ftz": ".ftz" in ptx,
        }
        print(
            _line(
                f"kernel PTX {name}",
                ", ".join(f"{k}={v}" for k, v in found.items()),
                widths=(40, 100),
            )
        )


def _loop_us(fn, calls: int = 200) -> float:
    """Back-to-back calls, one sync at the end: max(host time, GPU time) per call."""
    fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / calls * 1e6


def _bench(fn) -> tuple[float, float]:
    from triton.testing import do_bench, do_bench_cudagraph

    events = do_bench(fn, warmup=25, rep=100, return_mode="median")
    try:
        graph = do_bench_cudagraph(fn, rep=30, return_mode="median")
    except Exception:  # a route that cannot be captured shows no graph figure
        graph = float("nan")
    return events, graph


def _same_operands(x, layers) -> dict:
    """Raw ``_scaled_mm`` on exactly what the tensorwise and rowwise routes hand cuBLAS for this
    ``x`` (their FP8 codes of x, both scales, the layer's bias): the same GEMM without the
    module's input quantization. (cuBLAS's time depends on the bias epilogue and on the codes.)"""
    from floatxq.kernels import quantize_fp8_input

    out = {}
    for method, recipe in (("tensor", "tensorwise"), ("row", "rowwise")):
        layer = layers[method]
        shape = () if method == "tensor" else (x.shape[0], 1)
        sa = torch.empty(shape, dtype=torch.float32, device=x.device)
        xq = quantize_fp8_input(x, format="float8_e4m3fn", method=method, block=None, scale_out=sa)
        sb = layer._direct_weight_scale()
        sb = sb if method == "tensor" else sb.reshape(1, -1).contiguous()
        bias, wt = layer._bias_as(x.dtype), layer.weight.t()
        out[f"raw _scaled_mm {recipe}, same operands + bias"] = (
            lambda xq=xq, wt=wt, sa=sa, sb=sb, bias=bias: torch._scaled_mm(
                xq, wt, sa, sb, bias, None, x.dtype
            )
        )
    return out


def _raw_anchors(x, weight, dense, r1, r128) -> dict:
    """The raw kernels each route wraps, on inputs already in FP8 (no input quantization)."""
    m, dev = x.shape[0], x.device
    xq = x.to(torch.float8_e4m3fn)
    one = torch.ones((), device=dev)
    sa_row = torch.rand(m, 1, device=dev) + 0.5
    sb_row = torch.rand(1, N, device=dev) + 0.5
    # cuBLAS's blockwise recipe needs M % 16 == 0 (the route pads): time the padded product
    m16 = -(-m // 16) * 16
    xq16 = torch.nn.functional.pad(x, (0, 0, 0, m16 - m)).to(torch.float8_e4m3fn)
    sa_blk = (torch.rand(K // 128, m16, device=dev) + 0.5).t()
    sb_blk = torch.ones(N // 128, K // 128, device=dev).t()
    bf16 = torch.bfloat16
    return {
        "raw _scaled_mm tensorwise": lambda: torch._scaled_mm(
            xq, weight.t(), one, one, out_dtype=bf16
        ),
        "raw _scaled_mm rowwise": lambda: torch._scaled_mm(
            xq, weight.t(), sa_row, sb_row, out_dtype=bf16
        ),
        "raw scaled_mm blockwise": lambda: F.scaled_mm(
            xq16, weight.t(), sa_blk, r1, sb_blk, r128, output_dtype=bf16
        ),
        "bf16 F.linear": lambda: F.linear(x, dense.weight, dense.bias),
    }


def forward() -> None:
    from floatxq.dispatch import FP8RouteTuning
    from floatxq.nn import TorchFP8Linear

    small_m = FP8RouteTuning().small_m_rows
    print(f"== forward: N = K = {K}, x bfloat16, times in microseconds (median)")
    torch.manual_seed(0)
    dev = "cuda"
    dense = torch.nn.Linear(K, N, bias=True, device=dev, dtype=torch.bfloat16)
    layers = {
        m: TorchFP8Linear.from_linear(dense, weight_scale_method=m, weight_block_size=b)
        for m, b in (("tensor", None), ("row", None), ("block", (128, 128)))
    }
    cublas = {  # the same layers with the small-M kernel switched off: scaled_mm at every M
        m: TorchFP8Linear.from_linear(dense, weight_scale_method=m, weight_block_size=b)
        for m, b in (("tensor", None), ("row", None), ("block", (128, 128)))
    }
    for layer in cublas.values():
        for dtype in (torch.bfloat16, torch.float16):
            layer._runtime.disabled[("fp8_small_m", dtype)] = "off for the benchmark"
    forced = TorchFP8Linear.from_linear(dense, weight_scale_method="row")
    forced._runtime.disabled[("scaled_mm_rowwise", torch.bfloat16)] = "forced by the benchmark"
    wt = layers["tensor"]
    recipes = F.ScalingType
    r1 = getattr(recipes, "BlockWise1x128", None) or getattr(recipes, "Blockwise_1x128", None)
    r128 = getattr(recipes, "BlockWise128x128", None) or getattr(recipes, "Blockwise_128x128", None)
    print(
        "ev = do_bench events (L2 flushed), gr = CUDA-graph replay, loop = back-to-back calls "
        "(host-bound when > gr); ratios = anchor time / case time"
    )
    head = ("case", "ev_us", "gr_us", "loop_us", "ev/rawTW", "gr/rawTW", "ev/own", "gr/own")
    widths = (34, 9, 9, 9, 9, 9, 9, 9, 9)
    print(_line(*head, "ev/bf16", widths=widths))
    nan3 = (float("nan"),) * 3
    for m in MS:
        x = torch.randn(m, K, device=dev, dtype=torch.bfloat16)
        raw = _raw_anchors(x, wt.weight, dense, r1, r128)
        raw.update(_same_operands(x, layers))
        times, owns = {}, {}
        for name, fn in raw.items():
            try:
                times[name] = (*_bench(fn), _loop_us(fn))
            except Exception as exc:
                print(_line(f"{name} M={m}", f"failed: {exc}"[:80]))
        routes = {}
        if m <= small_m:
            # the module as shipped: eager calls take fp8_small_m, graph captures follow the
            # capture policy (tensorwise/blockwise: scaled_mm; rowwise: fp8_small_m)
            routes["module default (tensor)"] = (
                layers["tensor"],
                "raw _scaled_mm tensorwise, same operands + bias",
            )
            routes["module default (row)"] = (
                layers["row"],
                "raw _scaled_mm rowwise, same operands + bias",
            )
            routes["module default (block)"] = (layers["block"], "raw scaled_mm blockwise")
            for method, recipe, own in (
                ("tensor", "tensorwise", "raw _scaled_mm tensorwise, same operands + bias"),
                ("row", "rowwise", "raw _scaled_mm rowwise, same operands + bias"),
                ("block", "blockwise", "raw scaled_mm blockwise"),
            ):
                layer = layers[method]
                scale = layer._direct_weight_scale()
                bias = layer._bias_as(x.dtype)
                fn = functools.partial(fp8_small_m._launch, x, layer.weight, scale, bias, recipe)
                name = f"kernel fp8_small_m ({method})"
                times[name] = (*_bench(fn), _loop_us(fn))
                owns[name] = times.get(own, nan3)
        routes["route scaled_mm_tensorwise"] = (
            cublas["tensor"],
            "raw _scaled_mm tensorwise, same operands + bias",
        )
        routes["route scaled_mm_rowwise"] = (
            cublas["row"],
            "raw _scaled_mm rowwise, same operands + bias",
        )
        routes["route scaled_mm_blockwise"] = (cublas["block"], "raw scaled_mm blockwise")
        routes["route dequant_matmul (row)"] = (forced, "bf16 F.linear")
        for name, (layer, own) in routes.items():
            layer(x)
            expected = "fp8_small_m" if name.startswith("module") else name.split()[1]
            if layer.last_route != expected:
                print(
                    _line(
                        f"{name} M={m}",
                        f"took {layer.last_route}: {layer.last_fallback_reason}"[:100],
                        widths=(28, 100),
                    )
                )
            fn = lambda layer=layer, x=x: layer(x)
            times[name] = (*_bench(fn), _loop_us(fn))
            owns[name] = times.get(own, nan3)
        anchor = times.get("raw _scaled_mm tensorwise", nan3)
        bf16 = times.get("bf16 F.linear", nan3)
        for name, (ev, gr, loop) in times.items():
            own = owns.get(name, (ev, gr, loop))
            cells = (
                f"{ev * 1e3:.1f}",
                f"{gr * 1e3:.1f}",
                f"{loop:.1f}",
                f"{anchor[0] / ev:.3f}",
                f"{anchor[1] / gr:.3f}",
                f"{own[0] / ev:.3f}",
                f"{own[1] / gr:.3f}",
                f"{bf16[0] / ev:.3f}",
            )
            print(_line(f"{name} M={m}", *cells, widths=widths))


def _bytes_once(w: torch.Tensor, scales: int) -> int:
    """Bytes the contract must move: read the weight once, write one code per element + scales."""
    return w.numel() * (w.element_size() + 1) + scales * 4


def _tunings(method: str) -> list:
    """Tuning records swept per layout (the shipped default first)."""
    from floatxq.kernels import FP8WeightTuning

    base = kernel_module.DEFAULT_WEIGHT_TUNING
    out = [base]
    if method == "row":
        for tile, per_warp in itertools.product((4096, 8192, 16384), (512, 1024, 2048)):
            out.append(FP8WeightTuning(row_tile=tile, row_elements_per_warp=per_warp))
    elif method == "block":
        for tile, per_warp in itertools.product((4096, 8192, 16384), (256, 512, 1024, 2048)):
            out.append(FP8WeightTuning(block_tile=tile, block_elements_per_warp=per_warp))
    else:
        for per_sm, tile in itertools.product((2, 4, 8), (4096, 8192)):
            out.append(FP8WeightTuning(amax_programs_per_sm=per_sm, row_tile=tile))
    return list(dict.fromkeys(out))


def weight_quantize(sweep: bool) -> None:
    """The public ``quantize_fp8_weight_kernel`` against a bf16 copy, and what its time is made
    of: the kernel alone, the kernel with its finiteness flag, the wait for the GPU that any
    entry point raising on bad values must pay, and the alternatives to the pinned host flag."""
    from triton.testing import do_bench

    from floatxq._checks import require_finite

    print(f"== weight quantize: {N} x {K} bfloat16 -> float8_e4m3fn")
    print(
        "ms = do_bench median (L2 flushed before each call, CUDA events); vs_copy = GB/s over the "
        "copy's GB/s, counting the bytes the contract must move once (read bf16, write codes + "
        "scales); time/copy = copy ms / case ms; wall_us = back-to-back calls, wall clock"
    )
    torch.manual_seed(0)
    w = torch.randn(N, K, device="cuda", dtype=torch.bfloat16)
    dst = torch.empty_like(w)
    copy = lambda: dst.copy_(w)
    copy_ms = do_bench(copy, warmup=25, rep=200, return_mode="median")
    copy_bw = 2 * w.numel() * w.element_size() / copy_ms / 1e6
    widths = (58, 8, 8, 8, 10, 9)
    print(_line("case", "ms", "GB/s", "vs_copy", "time/copy", "wall_us", widths=widths))

    def row(label: str, fn, moved: int, wall: bool = False) -> float:
        try:
            ms = do_bench(fn, warmup=10, rep=100, return_mode="median")
        except Exception as exc:  # a refused configuration is a row, not the end of the run
            print(_line(label, f"failed: {type(exc).__name__}: {exc}"[:120], widths=(58, 120)))
            return float("nan")
        bw = moved / ms / 1e6
        cells = (f"{ms:.4f}", f"{bw:.0f}", f"{bw / copy_bw:.3f}", f"{copy_ms / ms:.3f}")
        print(_line(label, *cells, f"{_loop_us(fn, 50):.1f}" if wall else "", widths=widths))
        return bw / copy_bw

    row("copy (read + write bf16; the anchor)", copy, 2 * w.numel() * w.element_size(), True)
    stream = torch.cuda.current_stream()
    for method, block in (("row", None), ("block", (128, 128)), ("tensor", None)):
        shape = {"row": (N,), "block": (N // 128, K // 128), "tensor": ()}[method]
        scale = torch.empty(shape, device="cuda")
        once = _bytes_once(w, scale.numel())
        pinned = torch.zeros(1, dtype=torch.int32, pin_memory=True)
        kw = dict(scale_out=scale)

        def launch(flag=None, tuning=kernel_module.DEFAULT_WEIGHT_TUNING, method=method,
                   block=block, kw=kw):  # fmt: skip
            return kernel_module._launch(w, "float8_e4m3fn", method, block, flag=flag,
                                         tuning=tuning, **kw)  # fmt: skip

        def synced(method=method, block=block, launch=launch):
            launch()
            stream.synchronize()

        def device_flag(launch=launch):
            flag = torch.zeros(1, dtype=torch.int32, device="cuda")
            launch(flag)
            return flag.item()

        def scale_amin(method=method, block=block):  # the entry before this session
            _, s = kernel_module._launch(w, "float8_e4m3fn", method, block)
            return float(s.amin()) > 0

        def two_pass(launch=launch):  # validation reading the weight a second time
            require_finite(w, name="weight", where="benchmark")
            launch()

        public = lambda method=method, block=block: quantize_fp8_weight_kernel(
            w, weight_scale_method=method, weight_block_size=block
        )
        pure = lambda method=method, block=block: fq.quantize_fp8_weight(
            w, weight_scale_method=method, weight_block_size=block
        )
        print(f"-- {method} {block or ''}".rstrip())
        row(f"kernel {method} (no check)", launch, once)
        row("  + finiteness flag in the kernel (pinned host word, not read)",
            lambda launch=launch, pinned=pinned: launch(pinned), once)  # fmt: skip
        row("  + wait for the GPU (stream sync): floor of any raising entry", synced, once, True)
        row("  + flag on the device: zero-fill launch + .item()", device_flag, once, True)
        row("  before: scale amin launch + float() (previous entry's check)", scale_amin, once)
        row("  before: isfinite pass over the weight + kernel", two_pass, once)
        row(f"quantize_fp8_weight_kernel {method} (the entry, fused check)", public, once, True)
        row(f"pure torch {method}", pure, once)
        if method == "tensor":
            # a global amax must be known before the first code: a weight larger than L2 is
            # read twice
            twice = once + w.numel() * w.element_size()
            row("  kernel tensor, counting its two reads", launch, twice)
        if sweep:
            for tuning in _tunings(method):
                fn = lambda tuning=tuning, launch=launch: launch(tuning=tuning)
                changed = {
                    f.name: getattr(tuning, f.name)
                    for f in dataclasses.fields(tuning)
                    if getattr(tuning, f.name)
                    != getattr(kernel_module.DEFAULT_WEIGHT_TUNING, f.name)
                }
                row(f"  sweep {changed or 'default'}", fn, once)
        try:
            got, want = public(), pure()
            same = torch.equal(got.qweight.view(torch.uint8), want.qweight.view(torch.uint8))
            same = "yes" if same and torch.equal(got.scale_inv, want.scale_inv) else "NO"
        except Exception as exc:
            same = f"failed: {type(exc).__name__}: {exc}"[:120]
        print(_line(f"  codes and scales equal to pure ({method})", same, widths=(58, 120)))
        bad = w.clone()
        bad[N // 2, K // 3] = float("nan")
        try:
            quantize_fp8_weight_kernel(bad, weight_scale_method=method, weight_block_size=block)
            raised = "NO"
        except ValueError:
            raised = "yes"
        print(_line(f"  a NaN raises ValueError ({method})", raised, widths=(58, 8)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--probe-only", action="store_true")
    parser.add_argument(
        "--weight-only", action="store_true", help="environment and the weight quantizer only"
    )
    parser.add_argument(
        "--sweep", action="store_true", help="also sweep the weight quantizer's tuning records"
    )
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/fp8_linear.py needs a CUDA device")
    environment()
    if not args.weight_only:
        probe()
        if args.probe_only:
            return
        forward()
    weight_quantize(args.sweep)


if __name__ == "__main__":
    main()
