"""The NVFP4 decode kernels and the W4A-NVFP4 group accumulation against their pure twins.

* ``nvfp4_decode`` equals :func:`floatxq.nvfp4_decode_swizzled` and
  ``nvfp4_dequantize_kernel`` equals :func:`floatxq.nvfp4_dequantize` bit for bit (rows
  0, 1, 7, 129; widths 128..512; signed zeros, zero scales, values clamped to the dtype's
  largest finite magnitude; the global scale as a number and as a device tensor);
* all 256 scale bytes (NaN and negative ones included, which the pure functions refuse) decode
  as an oracle computed here says: ``clamp(e2m1 · e4m3 · g)`` with torch's own conversions;
* ``nvfp4_accumulate_group`` equals :func:`floatxq.w4a_nvfp4_accumulate_group` bit for bit
  (first, middle and last groups; token scale, bias of every dtype, overflow to inf, signed
  zeros) and is compiled without fused multiply-adds (its PTX, on the GPU);
* every argument check raises the exception kind of the pure twin (CPU, below).

GPU tests run the compiled kernels on fuzzed shapes with bfloat16 too; without CUDA,
``test_interpreter_suite`` reruns the ``interpreted`` tests in a child process under
``TRITON_INTERPRET=1`` (float16/float32 only: the interpreter truncates to bfloat16).
"""

import importlib
import math

import pytest
import torch
import torch.nn.functional as F

from floatxq.formats import E2M1_VALUES
from floatxq.kernels.nvfp4_decoding import (
    DEFAULT_NVFP4_DECODE_TUNING,
    NVFP4DecodeTuning,
    nvfp4_accumulate_group,
    nvfp4_decode,
    nvfp4_dequantize_kernel,
)
from floatxq.nn.fp4_linear import TorchFP4Linear
from floatxq.nvfp4.layouts import NVFP4Weight
from floatxq.nvfp4.operand import nvfp4_decode_swizzled, nvfp4_pack_swizzled
from floatxq.nvfp4.quantize import nvfp4_dequantize
from floatxq.nvfp4.swizzle import swizzle_scales_per_group
from floatxq.testing import assert_bitwise_equal, production_checks
from floatxq.testing.interpreter import can_interpret, needs_interpreter, run_interpreted_tests
from floatxq.w4a.linear import w4a_nvfp4_accumulate_group

decode_kernels = importlib.import_module("floatxq.kernels.nvfp4_decoding")
"""The module (``floatxq.kernels.nvfp4_decoding`` may name the function of the same name)."""

E4M3 = torch.float8_e4m3fn
FP4X2 = torch.float4_e2m1fn_x2

# ----------------------------------------------------------------------------------------------
# Cases
# ----------------------------------------------------------------------------------------------


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _block_scales(seed, rows, blocks):
    """Row-major E4M3 block scales: every valid byte 0 (zero block) .. 0x7E (448)."""
    raw = torch.randint(0, 0x7F, (rows, blocks), generator=_gen(seed), dtype=torch.uint8)
    return raw.view(E4M3)


def _codes(seed, rows, half):
    """Packed codes with every byte; row 0 all signed zeros (codes 0 and 8), row 1 all ±6 (the
    values that overflow float16 under a large global scale)."""
    codes = torch.randint(0, 256, (rows, half), generator=_gen(seed + 100), dtype=torch.uint8)
    if rows > 1:
        codes[0] = torch.tensor([0x80, 0x08, 0x88, 0x00], dtype=torch.uint8).repeat(half // 4)
        codes[1] = torch.tensor([0x7F, 0xF7], dtype=torch.uint8).repeat(half // 2)
    return codes


def _operand(seed, rows, width, device):
    """``(codes, swizzled scales)`` of a ``(rows, width)`` operand; row 1's scales at 448."""
    block = _block_scales(seed, rows, width // 16)
    if rows > 1:
        block[1] = torch.tensor(448.0).to(E4M3)
    scales = swizzle_scales_per_group(block)
    return _codes(seed, rows, width // 2).to(device), scales.to(device)


GLOBAL_SCALES = {
    # a plain one, a small one, one that pushes ±6 · 448 past the dtype's largest finite value
    torch.float16: (1.0, 0.0123, 1000.0),
    torch.bfloat16: (1.0, 0.0123, 2.0**120),
    torch.float32: (1.0, 0.0123, 3.0e38),
}


def _as_given(g, device, as_tensor):
    return torch.tensor(g, dtype=torch.float32, device=device) if as_tensor else g


INTERPRETER_TUNING = NVFP4DecodeTuning(decode_block_rows=64, decode_block_k=512)
"""Wider tiles: the interpreter's time goes by program, not by element."""


def _check_decode(seed, rows, width, dtype, device, tuning=DEFAULT_NVFP4_DECODE_TUNING):
    codes, scales = _operand(seed, rows, width, device)
    for i, g in enumerate(GLOBAL_SCALES[dtype]):
        gs = _as_given(g, device, as_tensor=(seed + i) % 2 == 0)
        out = nvfp4_decode(codes, scales, gs, width, dtype, tuning=tuning)
        expected = nvfp4_decode_swizzled(codes, scales, gs, width, dtype)
        assert_bitwise_equal(out, expected, msg=f"decode {(rows, width)} {dtype} g={g}")
        if rows > 1 and g == GLOBAL_SCALES[dtype][2]:  # the clamp was exercised
            assert out[1].abs().max().item() == torch.finfo(dtype).max
    if rows:  # float4_e2m1fn_x2 storage and strided rows read the same bytes
        wide = torch.zeros((rows, width), dtype=torch.uint8, device=device)
        wide[:, : width // 2] = codes
        strided = wide[:, : width // 2].view(FP4X2)
        again = nvfp4_decode(strided, scales, 1.0, width, dtype, tuning=tuning)
        assert_bitwise_equal(again, nvfp4_decode_swizzled(codes, scales, 1.0, width, dtype))


WEIGHT_SHAPES = [(0, 64), (1, 8), (7, 64), (129, 128), (2, 3, 24), (5, 256), (3, 0)]
"""``packed`` shapes ``(*b, k/2)``: no rows, k = 16, ragged rows, a batch axis, no columns."""


def _check_dequantize(seed, shape, dtype, device, tuning=DEFAULT_NVFP4_DECODE_TUNING):
    *batch, half = shape
    rows = math.prod(batch)
    packed = _codes(seed, rows, half).reshape(shape).to(device)
    block = _block_scales(seed, rows, half // 8).reshape(*batch, half // 8).to(device)
    for i, g in enumerate(GLOBAL_SCALES[dtype]):
        gs = _as_given(g, device, as_tensor=(seed + i) % 2 == 1)
        out = nvfp4_dequantize_kernel(packed, block, gs, dtype=dtype, tuning=tuning)
        expected = nvfp4_dequantize(packed, block, gs, dtype=dtype)
        assert_bitwise_equal(out, expected, msg=f"dequantize {shape} {dtype} g={g}")


def _accumulate_inputs(seed, m, n, device):
    """FP32 plane sums over many binades with signed zeros, an FP16 group scale."""
    g = _gen(seed)
    both = torch.randn(m, 2 * n, generator=g) * torch.exp2(
        torch.randint(-20, 20, (m, 2 * n), generator=g).float()
    )
    if m and n:
        both[0, :n] = -0.0  # -0 + 4 · -0 = -0: the first group's +0 start makes it +0
        both[0, n:] = -0.0
    acc = torch.randn(m, n, generator=g) * 1e3
    if m and n:
        acc[0, ::2] = -0.0
    group_scale = (torch.rand(n, generator=g) * 0.02 + 1e-3).half()
    token_scale = torch.rand(m, generator=g) + 0.5
    return both.to(device), group_scale.to(device), acc.to(device), token_scale.to(device)


def _check_accumulate(seed, m, n, output_dtype, bias_dtype, device):
    both, group_scale, acc, token_scale = _accumulate_inputs(seed, m, n, device)
    saved = acc.clone()
    for start in (None, acc):
        first = nvfp4_accumulate_group(both, group_scale, start)
        assert_bitwise_equal(first, w4a_nvfp4_accumulate_group(both, group_scale, start))
        bias = (torch.randn(n, generator=_gen(seed + 1)) * 8).to(bias_dtype).to(device)
        for g, ts, b in ((0.37, token_scale, bias), (torch.tensor(2.0**-7), None, None)):
            g = g.to(device) if isinstance(g, torch.Tensor) else g
            kw = dict(last=True, global_scale=g, token_scale=ts, bias=b, output_dtype=output_dtype)
            out = nvfp4_accumulate_group(both, group_scale, start, **kw)
            expected = w4a_nvfp4_accumulate_group(both, group_scale, start, **kw)
            assert_bitwise_equal(out, expected, msg=f"last {(m, n)} {output_dtype} {bias_dtype}")
    assert_bitwise_equal(acc, saved, msg="acc is not modified")
    if m and n:  # strided views of the same values
        kw = dict(last=True, global_scale=0.37, token_scale=token_scale, bias=bias)
        strided = [
            t.repeat_interleave(2, dim=-1)[..., ::2] for t in (group_scale, token_scale, bias)
        ]
        out = nvfp4_accumulate_group(
            both.T.contiguous().T, strided[0], acc.T.contiguous().T, last=True,
            global_scale=0.37, token_scale=strided[1], bias=strided[2],
        )  # fmt: skip
        assert_bitwise_equal(out, w4a_nvfp4_accumulate_group(both, group_scale, acc, **kw))


def _all_scale_bytes(rows=256):
    """Every E4M3 byte against every E2M1 code: row ``r`` holds the 16 codes twice (16 values
    per block, one block per row) under scale byte ``r``."""
    codes = torch.arange(16, dtype=torch.uint8)
    packed = (codes[0::2] | (codes[1::2] << 4)).repeat(rows, 1)  # (rows, 8): k = 16
    scales = torch.arange(rows, dtype=torch.uint8).reshape(rows, 1).view(E4M3)
    return packed, scales


def _oracle(packed, scales, g, dtype):
    """``clamp((e2m1 · e4m3) · g)`` to ``dtype``: the table of E2M1 values and torch's E4M3
    conversion (NaN and negative bytes included), FP32 products, one rounding."""
    table = torch.tensor(E2M1_VALUES + tuple(-v for v in E2M1_VALUES), dtype=torch.float32)
    low, high = packed & 0xF, packed >> 4
    values = table[torch.stack([low, high], dim=-1).reshape(packed.shape[0], -1).long()]
    scale = scales.float().repeat_interleave(16, dim=1)
    limit = min(torch.finfo(dtype).max, torch.finfo(torch.float32).max)
    return ((values * scale) * torch.tensor(g)).clamp(-limit, limit).to(dtype)


def _check_all_scale_bytes(dtype, device, tuning=DEFAULT_NVFP4_DECODE_TUNING):
    packed, scales = _all_scale_bytes()
    for g in GLOBAL_SCALES[dtype]:
        expected = _oracle(packed, scales, g, dtype)
        out = nvfp4_dequantize_kernel(
            packed.to(device), scales.to(device), g, dtype=dtype, tuning=tuning
        )
        assert_bitwise_equal(out, expected.to(device), msg=f"all scale bytes {dtype} g={g}")
    # the same bytes through the swizzled layout: 128 rows × 8 blocks of 16 values
    rows = 128
    block = torch.arange(rows * 8, dtype=torch.int32).reshape(rows, 8) * 37 % 256
    block = block.to(torch.uint8).view(E4M3)
    codes = torch.randint(0, 256, (rows, 64), generator=_gen(5), dtype=torch.uint8)
    expected = _oracle(codes, block, 0.5, dtype)
    swizzled = swizzle_scales_per_group(block).to(device)
    out = nvfp4_decode(codes.to(device), swizzled, 0.5, 128, dtype, tuning=tuning)
    assert_bitwise_equal(out, expected.to(device), msg=f"swizzled scale bytes {dtype}")
    assert bool(out.isnan().any()) and bool((out.float() < 0).any())


def _hand_checked(device):
    """Values worked out by hand: byte 0x21 is codes (1, 2) = (0.5, 1.0), byte 0xF8 is codes
    (8, 15) = (-0.0, -6.0); scale 2 (E4M3 0x40), global scale 3."""
    packed = torch.tensor([[0x21] * 4 + [0xF8] * 4], dtype=torch.uint8, device=device)
    scales = torch.tensor([[0x40]], dtype=torch.uint8, device=device).view(E4M3)
    out = nvfp4_dequantize_kernel(packed, scales, 3.0, dtype=torch.float32)
    assert out[0, :4].tolist() == [3.0, 6.0, 3.0, 6.0]
    assert out[0, 8:].tolist() == [0.0, -36.0] * 4
    assert torch.signbit(out[0, 8::2]).all()
    both = torch.tensor([[1.0, 2.0, 0.5, -1.0]], device=device)  # low | high sums, n = 2
    s = torch.tensor([2.0, 1.0], device=device)
    assert nvfp4_accumulate_group(both, s).tolist() == [[6.0, -2.0]]  # (1 + 2) · 2, (2 - 4) · 1
    last = nvfp4_accumulate_group(
        both, s, torch.ones(1, 2, device=device), last=True, global_scale=0.5,
        token_scale=torch.tensor([4.0], device=device), bias=torch.tensor([1.0, -1.0],
        device=device), output_dtype=torch.float16,
    )  # fmt: skip
    assert last.tolist() == [[15.0, -3.0]] and last.dtype == torch.float16  # (7·.5·4) + 1, ...


# ----------------------------------------------------------------------------------------------
# CPU: argument checks, tuning
# ----------------------------------------------------------------------------------------------


def _decode_args(**change):
    args = dict(
        codes=torch.zeros(3, 64, dtype=torch.uint8),
        scales=torch.zeros(1, 1024, dtype=torch.uint8).view(E4M3),
        global_scale=1.0,
        width=128,
        out_dtype=torch.float32,
    )
    args.update(change)
    return args


DECODE_ERRORS = [
    (dict(codes=[0]), TypeError, "codes must be a torch.Tensor"),
    (dict(scales="s"), TypeError, "scales must be a torch.Tensor"),
    (dict(codes=torch.zeros(3, 64, dtype=torch.int32)), TypeError, "2-D uint8 or float4"),
    (dict(codes=torch.zeros(3, 64, 1, dtype=torch.uint8)), TypeError, "2-D uint8 or float4"),
    (dict(scales=torch.zeros(1, 1024)), TypeError, "scales must be float8_e4m3fn"),
    (dict(out_dtype=torch.float64), TypeError, "out_dtype must be float16, bfloat16"),
    (dict(width=100), ValueError, "width must be a positive multiple of 128"),
    (dict(width=0), ValueError, "width must be a positive multiple of 128"),
    (dict(width=True), ValueError, "width must be a positive multiple of 128"),
    (dict(width=256), ValueError, r"codes must have shape \(rows, 128\)"),
    (dict(scales=torch.zeros(1, 512).to(E4M3)), ValueError, r"scales must have shape \(1, 1024\)"),
    (dict(scales=torch.zeros(1, 1024, device="meta").to(E4M3)), TypeError, "scales are on meta"),
    (
        dict(
            codes=torch.zeros(3, 64, dtype=torch.uint8, device="meta"),
            scales=torch.zeros(1, 1024, device="meta").to(E4M3),
        ),
        TypeError,
        "meta tensor",
    ),
    (dict(global_scale=-1.0), ValueError, "global_scale must be positive and finite"),
    (dict(global_scale=0.0), ValueError, "global_scale must be positive and finite"),
    (dict(global_scale=float("nan")), ValueError, "global_scale must be positive and finite"),
    (dict(global_scale=float("inf")), ValueError, "global_scale must be positive and finite"),
    (dict(global_scale=1e39), ValueError, "exceed FP32's range"),
    (dict(global_scale="1"), TypeError, "global_scale must be a real number"),
    (dict(global_scale=True), TypeError, "global_scale must be a real number"),
    (dict(global_scale=torch.ones(2)), ValueError, "global_scale must hold one value"),
    (dict(global_scale=torch.ones((), dtype=torch.int32)), TypeError, "global_scale must be a"),
]


@pytest.mark.parametrize(("change", "kind", "match"), DECODE_ERRORS)
def test_nvfp4_decode_refuses_what_its_twin_refuses(change, kind, match):
    args = _decode_args(**change)
    with production_checks():
        with pytest.raises(kind) as pure:
            nvfp4_decode_swizzled(**args)
        with pytest.raises(kind, match=match):
            nvfp4_decode(**args)
    assert pure.type is kind


def _dequantize_args(**change):
    args = dict(
        packed=torch.zeros(4, 16, dtype=torch.uint8),
        block_scales=torch.zeros(4, 2, dtype=torch.uint8).view(E4M3),
        global_scale=1.0,
    )
    args.update(change)
    return args


DEQUANTIZE_ERRORS = [
    (dict(packed=None), TypeError, "packed must be a torch.Tensor"),
    (dict(packed=torch.zeros(4, 16, dtype=torch.int32)), TypeError, "packed must be uint8 or"),
    (dict(packed=torch.zeros(4, 16, device="meta", dtype=torch.uint8)), TypeError, "meta"),
    (dict(packed=torch.tensor(3, dtype=torch.uint8)), ValueError, "at least one axis"),
    (dict(block_scales=torch.zeros(4, 2)), TypeError, "block_scales must be float8_e4m3fn"),
    (dict(block_scales=torch.zeros(4, 3).to(E4M3)), ValueError, "expected \\(\\*b, k/16\\)"),
    (  # k = 8: not a whole block
        dict(packed=torch.zeros(4, 4, dtype=torch.uint8), block_scales=torch.zeros(4, 0).to(E4M3)),
        ValueError,
        "expected \\(\\*b, k/16\\)",
    ),
    (dict(global_scale=-2.0), ValueError, "global_scale must be positive and finite"),
    (dict(global_scale=[1.0]), TypeError, "global_scale must be a real number"),
    (dict(global_scale=torch.ones(1, 2)), ValueError, "global_scale must hold one value"),
]


@pytest.mark.parametrize(("change", "kind", "match"), DEQUANTIZE_ERRORS)
def test_nvfp4_dequantize_kernel_refuses_what_its_twin_refuses(change, kind, match):
    args = _dequantize_args(**change)
    with production_checks():
        with pytest.raises(kind) as pure:
            nvfp4_dequantize(**args)
        with pytest.raises(kind, match=match):
            nvfp4_dequantize_kernel(**args)
    assert pure.type is kind


def _accumulate_args(**change):
    args = dict(both=torch.zeros(3, 8), group_scale=torch.ones(4), acc=None)
    args.update(change)
    return args


_LAST = dict(last=True, global_scale=1.0)
ACCUMULATE_ERRORS = [
    (dict(both=torch.zeros(3, 8).half()), TypeError, "both must be float32"),
    (dict(both=[1.0]), TypeError, "both must be a torch.Tensor"),
    (dict(acc=torch.zeros(3, 4).double()), TypeError, "acc must be float32"),
    (dict(token_scale=torch.ones(3).half(), **_LAST), TypeError, "token_scale must be float32"),
    (dict(both=torch.zeros(8)), ValueError, r"both must be \(m, 2n\)"),
    (dict(both=torch.zeros(3, 7)), ValueError, r"both must be \(m, 2n\)"),
    (dict(group_scale=torch.ones(4, dtype=torch.int32)), TypeError, "floating-point tensor"),
    (dict(group_scale=torch.ones(5)), ValueError, r"group_scale must have shape \(4,\)"),
    (dict(acc=torch.zeros(3, 5)), ValueError, r"acc must have shape \(3, 4\)"),
    (dict(global_scale=1.0), ValueError, "global_scale apply only to the last group"),
    (dict(bias=torch.zeros(4)), ValueError, "bias apply only to the last group"),
    (dict(output_dtype=torch.float16), ValueError, "output_dtype=torch.float16 apply only"),
    (dict(last=True), ValueError, "the last group needs the activation's global_scale"),
    (dict(output_dtype=torch.int32, **_LAST), TypeError, "output_dtype must be float16"),
    (dict(token_scale=torch.ones(4), **_LAST), ValueError, r"token_scale must have shape \(3,\)"),
    (dict(bias=torch.ones(4, dtype=torch.int64), **_LAST), TypeError, "floating-point tensor"),
    (dict(bias=torch.ones(3), **_LAST), ValueError, r"bias must have shape \(4,\)"),
    (dict(acc=torch.zeros(3, 4, device="meta")), TypeError, "every tensor must be on one device"),
    (dict(last=True, global_scale="g"), TypeError, "global_scale must be a real number"),
    (dict(last=True, global_scale=torch.ones(3)), ValueError, "global_scale must hold one value"),
]


@pytest.mark.parametrize(("change", "kind", "match"), ACCUMULATE_ERRORS)
def test_nvfp4_accumulate_group_refuses_what_its_twin_refuses(change, kind, match):
    args = _accumulate_args(**change)
    with production_checks():
        with pytest.raises(kind) as pure:
            w4a_nvfp4_accumulate_group(**args)
        with pytest.raises(kind, match=match):
            nvfp4_accumulate_group(**args)
    assert pure.type is kind


@pytest.mark.usefixtures("production_checks")
def test_what_the_kernels_refuse_beyond_their_twins():
    """A global-scale tensor must be float32 (the pure functions convert any float); the decode
    writes float16, bfloat16 or float32 only (the pure one any floating dtype)."""
    half_scale = torch.ones((), dtype=torch.float16)
    assert nvfp4_decode_swizzled(**_decode_args(global_scale=half_scale)).shape == (3, 128)
    with pytest.raises(TypeError, match="global_scale must be a float32 tensor"):
        nvfp4_decode(**_decode_args(global_scale=half_scale))
    assert nvfp4_dequantize(**_dequantize_args(), dtype=torch.float64).dtype == torch.float64
    with pytest.raises(TypeError, match="dtype must be float16, bfloat16 or float32"):
        nvfp4_dequantize_kernel(**_dequantize_args(), dtype=torch.float64)
    both, s = torch.zeros(2, 4), torch.ones(2)
    assert w4a_nvfp4_accumulate_group(both, s, last=True, global_scale=half_scale).shape == (2, 2)
    with pytest.raises(TypeError, match="global_scale must be a float32 tensor"):
        nvfp4_accumulate_group(both, s, last=True, global_scale=half_scale)


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU tensors are refused only without CUDA")
def test_the_kernels_refuse_cpu_tensors_unless_interpreting(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises((TypeError, RuntimeError), match="^nvfp4_decode: "):
        nvfp4_decode(**_decode_args())
    with pytest.raises((TypeError, RuntimeError), match="^nvfp4_dequantize_kernel: "):
        nvfp4_dequantize_kernel(**_dequantize_args())
    with pytest.raises((TypeError, RuntimeError), match="^nvfp4_accumulate_group: "):
        nvfp4_accumulate_group(**_accumulate_args())
    with pytest.raises((TypeError, RuntimeError), match="^nvfp4_decode: "):  # no rows either
        nvfp4_decode(**_decode_args(codes=torch.zeros(0, 64, dtype=torch.uint8),
                                    scales=torch.zeros(1, 0).to(E4M3)))  # fmt: skip


def test_tuning_checks():
    assert DEFAULT_NVFP4_DECODE_TUNING == NVFP4DecodeTuning()
    with pytest.raises(ValueError, match="decode_block_k must be a power of two"):
        NVFP4DecodeTuning(decode_block_k=96)
    with pytest.raises(ValueError, match="accumulate_warps must be an int >= 1"):
        NVFP4DecodeTuning(accumulate_warps=0)
    with pytest.raises(ValueError, match="decode_block_rows must be an int >= 1"):
        NVFP4DecodeTuning(decode_block_rows=True)


def test_the_oracle_agrees_with_the_pure_decode_on_valid_scales():
    """The all-bytes oracle is independent of floatxq's decode; on the bytes that decode accepts
    (0..0x7E) both give the same bits, so a kernel matching one matches the other."""
    packed, scales = _all_scale_bytes(0x7F)
    for dtype, gs in GLOBAL_SCALES.items():
        for g in gs:
            expected = nvfp4_dequantize(packed, scales, g, dtype=dtype)
            assert_bitwise_equal(_oracle(packed, scales, g, dtype), expected, msg=f"{dtype} {g}")


# ----------------------------------------------------------------------------------------------
# The interpreter (CPU, float16/float32)
# ----------------------------------------------------------------------------------------------


@pytest.mark.skipif(
    not can_interpret(),
    reason="needs Triton installed and no CUDA device (with CUDA the compiled kernel is tested)",
)
def test_interpreter_suite():
    run_interpreted_tests(__file__, expected=6)


@needs_interpreter
def test_interpreted_values_worked_by_hand():
    _hand_checked("cpu")


@needs_interpreter
@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_interpreted_nvfp4_decode(dtype):
    _check_decode(0, 7, 256, dtype, "cpu")  # the default tiles
    for seed, (rows, width) in enumerate([(0, 128), (1, 128), (129, 512), (1, 512), (129, 128)]):
        _check_decode(seed, rows, width, dtype, "cpu", INTERPRETER_TUNING)
    packed, scales = nvfp4_pack_swizzled(torch.randn(9, 256, generator=_gen(3)), 0.25)
    out = nvfp4_decode(packed, scales, 0.25, 256, dtype)
    assert_bitwise_equal(out, nvfp4_decode_swizzled(packed, scales, 0.25, 256, dtype))


@needs_interpreter
@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
def test_interpreted_nvfp4_dequantize_kernel():
    for dtype in (torch.float16, torch.float32):
        _check_dequantize(0, (2, 3, 24), dtype, "cpu")  # the default tiles
        for seed, shape in enumerate(WEIGHT_SHAPES):
            _check_dequantize(seed, shape, dtype, "cpu", INTERPRETER_TUNING)
        _check_all_scale_bytes(dtype, "cpu", INTERPRETER_TUNING)


@needs_interpreter
@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
def test_interpreted_nvfp4_accumulate_group():
    cases = [(0, 4, torch.float32, torch.float32), (1, 1, torch.float16, torch.float16),
             (7, 64, torch.float16, torch.bfloat16), (129, 130, torch.float32, torch.float64),
             (5, 0, torch.float16, torch.float32)]  # fmt: skip
    for seed, (m, n, output_dtype, bias_dtype) in enumerate(cases):
        _check_accumulate(seed, m, n, output_dtype, bias_dtype, "cpu")
    huge = torch.full((2, 4), 6.0e4)  # (6e4 + 2.4e5) · 1 overflows float16: inf, as .to() gives
    out = nvfp4_accumulate_group(
        huge, torch.ones(2), last=True, global_scale=1.0, output_dtype=torch.float16
    )
    assert out.isinf().all() and out.tolist() == [[float("inf")] * 2] * 2


@needs_interpreter
def test_interpreted_fp4_linear_triton_decode():
    """TorchFP4Linear's ``triton_decode`` weight equals its pure decode, then ``F.linear``."""
    g = _gen(11)
    w = NVFP4Weight(
        torch.randint(0, 256, (24, 64), generator=g, dtype=torch.uint8),
        _block_scales(12, 24, 8),
        torch.tensor(0.0123),
    )
    layer = TorchFP4Linear.from_nvfp4(w, torch.randn(24, generator=g), dtype=torch.float16)
    x = torch.randn(3, 128, generator=g)
    for dtype in (torch.float16, torch.float32):
        decoded = layer._decoded("triton_decode", dtype)
        assert_bitwise_equal(decoded, layer.dequantize_weight(dtype), msg=str(dtype))
        pure = F.linear(x.to(dtype), layer.dequantize_weight(dtype), layer.bias.to(dtype))
        assert_bitwise_equal(F.linear(x.to(dtype), decoded, layer.bias.to(dtype)), pure)


# ----------------------------------------------------------------------------------------------
# GPU: the compiled kernels
# ----------------------------------------------------------------------------------------------


@pytest.mark.gpu
def test_values_worked_by_hand_on_cuda():
    _hand_checked("cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_nvfp4_decode_is_bitwise_its_twin(dtype):
    shapes = [(0, 128), (1, 128), (7, 384), (129, 512), (1000, 1024), (300, 8192), (128, 4096)]
    for seed, (rows, width) in enumerate(shapes):
        _check_decode(seed, rows, width, dtype, "cuda")
    x = torch.randn(33, 2048, generator=_gen(4)).cuda()
    packed, scales = nvfp4_pack_swizzled(x, 0.03)
    out = nvfp4_decode(packed, scales, torch.tensor([0.03], device="cuda"), 2048, dtype)
    assert_bitwise_equal(out, nvfp4_decode_swizzled(packed, scales, 0.03, 2048, dtype))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_nvfp4_dequantize_kernel_is_bitwise_its_twin(dtype):
    for seed, shape in enumerate([*WEIGHT_SHAPES, (4096, 2048), (3, 1000, 8)]):
        _check_dequantize(seed, shape, dtype, "cuda")
    _check_all_scale_bytes(dtype, "cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("output_dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_nvfp4_accumulate_group_is_bitwise_its_twin(output_dtype):
    shapes = [(0, 64), (1, 1), (7, 96), (129, 130), (1000, 4096), (16, 11008)]
    for seed, (m, n) in enumerate(shapes):
        for bias_dtype in (torch.bfloat16, torch.float32, torch.float64):
            _check_accumulate(seed, m, n, output_dtype, bias_dtype, "cuda")


@pytest.mark.gpu
def test_nvfp4_accumulate_group_compiles_without_fused_multiply_adds():
    """Every compiled accumulation has no ``fma`` in its PTX; the same kernel compiled with
    fusion allowed has one (so the check can fail)."""
    both, s, acc, ts = _accumulate_inputs(0, 64, 256, "cuda")
    kw = dict(last=True, global_scale=0.5, token_scale=ts, bias=torch.ones(256, device="cuda"))
    nvfp4_accumulate_group(both, s, acc)
    nvfp4_accumulate_group(both, s, acc, **kw)
    launcher = decode_kernels._launchers(False)[1]
    compiled = launcher.compiled()
    assert compiled
    for kernel in compiled:
        assert "fma.rn" not in kernel.asm["ptx"]
    sources = pytest.importorskip("floatxq.kernels._nvfp4_decode_jit")
    out = torch.empty(64, 256, device="cuda")
    fused = sources.nvfp4_accumulate_kernel[(2, 2, 1)](
        both, s, acc, out, 0.5, ts, out, out, 64, 256, *both.stride(), *acc.stride(), 0,
        ts.stride(0), 0, out.stride(0), True, True, False, True, False, 32, 128,
        enable_fp_fusion=True,
    )  # fmt: skip
    assert "fma.rn" in fused.asm["ptx"]


@pytest.mark.gpu
def test_nan_and_negative_scales_decode_unchecked_on_cuda():
    """No host sync: a NaN global-scale tensor decodes to NaN, a negative one to negated
    values (the pure decode raises for both)."""
    codes, scales = _operand(1, 7, 256, "cuda")
    positive = nvfp4_decode(codes, scales, 0.5, 256, torch.float32)
    negative = nvfp4_decode(codes, scales, torch.tensor(-0.5, device="cuda"), 256, torch.float32)
    assert_bitwise_equal(negative, -positive)
    nan = nvfp4_decode(codes, scales, torch.tensor(float("nan"), device="cuda"), 256, torch.float16)
    assert nan.isnan().all()


@pytest.mark.gpu
def test_the_kernels_refuse_a_global_scale_on_another_device():
    codes, scales = _operand(2, 3, 128, "cuda")
    with pytest.raises(TypeError, match="every tensor must be on one device"):
        nvfp4_decode(codes, scales, torch.tensor(1.0), 128, torch.float32)
    packed = torch.zeros(2, 8, dtype=torch.uint8, device="cuda")
    block = torch.ones(2, 1, device="cuda").to(E4M3)
    with pytest.raises(TypeError, match="every tensor must be on one device"):
        nvfp4_dequantize_kernel(packed, block, torch.tensor(1.0))


@pytest.mark.gpu
def test_repeated_launches_reuse_the_compiled_kernel():
    codes, scales = _operand(3, 7, 256, "cuda")
    first = nvfp4_decode(codes, scales, 2.0, 256, torch.bfloat16)
    launcher = decode_kernels._launchers(False)[0]
    kept = len(launcher)
    for g in (2.0, 3.0):  # a new global-scale value needs no new compilation
        again = nvfp4_decode(codes, scales, g, 256, torch.bfloat16)
        assert_bitwise_equal(again, nvfp4_decode_swizzled(codes, scales, g, 256, torch.bfloat16))
    assert len(launcher) == kept
    assert_bitwise_equal(nvfp4_decode(codes, scales, 2.0, 256, torch.bfloat16), first)
