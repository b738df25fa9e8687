"""The Triton block solve of GPTQ onto the NVFP4 grid against the pure function, byte for byte.

``nvfp4_gptq_solve_fast`` must return :func:`floatxq.nvfp4_gptq_solve`'s record exactly (packed
codes, block scales, global scale, both losses' bits, ``solved``) on fuzzed shapes: no rows, one
row, rows ragged against every row tile, ``k`` from 16 up, ragged against the block size, block
sizes that are not powers of two; exact E2M1 ties, ``-0.0`` weights (the kernel's column
extraction must keep the sign), dead inputs, non-contiguous bfloat16 weights, correlated and
diagonal Hessians. On CUDA the same at the shapes of an 8B model's layers, every tuning, and
FP32 subnormal steps (the launch keeps them); on CPU the kernel runs in the Triton interpreter
(``test_interpreter_suite`` reruns the ``interpreted`` tests under ``TRITON_INTERPRET=1``).
The route choice (``floatxq.dispatch.nvfp4_gptq_route``) is tested on CPU with faked facts.
"""

import pytest
import torch

import floatxq as fq
from floatxq.dispatch import nvfp4_gptq as route_module
from floatxq.dispatch import nvfp4_gptq_route, nvfp4_gptq_solve_auto
from floatxq.gptq.nvfp4_grid import nvfp4_gptq_solve
from floatxq.kernels.nvfp4_gptq import NVFP4GPTQTuning, nvfp4_gptq_solve_fast
from floatxq.testing import assert_bitwise_equal, production_checks
from floatxq.testing.interpreter import (
    INTERPRETING,
    can_interpret,
    needs_interpreter,
    run_interpreted_tests,
)

TIE_POINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
"""Every E2M1 rounding boundary (ties to the even code: down at 0.25, 1.25, 2.5, 5)."""

# ----------------------------------------------------------------------------------------------
# Cases
# ----------------------------------------------------------------------------------------------


def _hessian(k, seed, device, *, samples=None):
    """``2/N · XᵀX`` of correlated inputs (a low-rank part plus noise): a realistic PSD Hessian
    (singular when ``N < k``; the damping makes it definite)."""
    n = samples or max(2 * k, 64)
    g = torch.Generator(device=device).manual_seed(seed)
    low = torch.randn(n, 16, generator=g, device=device)
    mix = torch.randn(16, k, generator=g, device=device)
    x = low @ mix + 0.3 * torch.randn(n, k, generator=g, device=device)
    x = x * torch.exp2(torch.randint(-2, 3, (1, k), generator=g, device=device).float())
    return 2 * x.T @ x / n


def _weight(rows, k, seed, device):
    g = torch.Generator(device=device).manual_seed(seed)
    w = torch.randn(rows, k, generator=g, device=device) * 0.02
    blocks = torch.randint(-3, 3, (rows, k // 16), generator=g, device=device).float()
    return w * torch.exp2(blocks).repeat_interleave(16, dim=1)


def _scale(w):
    amax = w.float().abs().amax() if w.numel() else torch.ones((), device=w.device)
    return fq.nvfp4_global_scale(amax.clamp_min(1e-6), recipe="nvidia")


def _ties(rows, k, device):
    """``(weight, g)``: every 16-block ``[-0.0, 6, ties, 0.0, -ties] · s · g`` with ``s`` an E4M3
    value, so the recipe's block scale is ``s`` and ``w / step`` lands on every E2M1 boundary.
    Column 0 keeps its ``-0.0`` through the solve (no column before it; later ones may turn a
    ``-0.0`` into ``+0.0``: ``-0.0 - (h·err)`` is ``+0.0`` when ``h·err`` is ``-0.0``)."""
    g = 2.0**-8
    pattern = torch.tensor([-0.0, 6.0, *TIE_POINTS, 0.0, *(-t for t in TIE_POINTS[:6])])
    s = torch.tensor([0.5, 1.0, 1.5, 2.0, 0.375, 3.0, 0.75])
    blocks = torch.arange(rows * (k // 16)).reshape(rows, k // 16)
    scales = s[blocks % len(s)]
    w = (pattern.repeat(rows, k // 16) * scales.repeat_interleave(16, dim=1) * g).to(device)
    assert torch.equal(fq.nvfp4_block_scales(w, g, "nvidia").block_scales.float().cpu(), scales)
    return w, g


def _check(weight, hessian, g, *, msg="", **kwargs):
    tuning = kwargs.pop("tuning", None)
    want = nvfp4_gptq_solve(weight, hessian, g, **kwargs)
    extra = {} if tuning is None else {"tuning": tuning}
    got = nvfp4_gptq_solve_fast(weight, hessian, g, **kwargs, **extra)
    where = f"{msg} {tuple(weight.shape)} {kwargs} {tuning}"
    assert_bitwise_equal(got.packed, want.packed, msg=f"packed {where}")
    assert_bitwise_equal(got.block_scales, want.block_scales, msg=f"block_scales {where}")
    assert_bitwise_equal(got.global_scale, want.global_scale, msg=f"global_scale {where}")
    assert_bitwise_equal(got.loss, want.loss, msg=f"loss {where}")
    assert_bitwise_equal(got.rtn_loss, want.rtn_loss, msg=f"rtn_loss {where}")
    assert got.solved == want.solved, where
    return got


SMALL_SHAPES = [(1, 16), (0, 32), (5, 32), (13, 160), (3, 272), (33, 48)]
"""Interpreter shapes: one row; no rows; rows ragged against every tile; k one 16-block, a full
block plus a ragged one, two plus 16."""


def _check_fuzzed(device, shapes, tunings):
    for seed, (rows, k) in enumerate(shapes):
        w = _weight(rows, k, seed, device)
        h = _hessian(k, seed + 100, device)
        for tuning in tunings:
            _check(w, h, _scale(w), tuning=tuning, msg=f"seed {seed}")


def _check_special(device):
    w, g = _ties(6, 64, device)
    _check(w, torch.eye(64, device=device), g, msg="ties, identity")
    h = _hessian(64, 1, device)
    solved = _check(w, h, g, msg="ties, correlated")
    assert solved.loss <= solved.rtn_loss
    dead = h.clone()
    dead[[3, 40], :] = 0
    dead[:, [3, 40]] = 0
    _check(w, dead, g, msg="dead inputs")
    x = _weight(7, 64, 5, device).to(torch.bfloat16).T.contiguous().T  # column-major
    _check(x, h, _scale(x), recipe="four_six", msg="bfloat16 column-major")
    _check(x.float(), h, _scale(x), recipe="least_squares", damp_percent=0.1, msg="lsq")


def _check_blocksizes(device):
    w = _weight(5, 176, 8, device)
    h = _hessian(176, 9, device)
    for blocksize in (16, 48, 100, 128):  # widths 16; 48 and 32; 100 and 76; 128 and 48
        _check(w, h, _scale(w), blocksize=blocksize, msg=f"blocksize {blocksize}")


# ----------------------------------------------------------------------------------------------
# CPU: refusals, tunings, the route
# ----------------------------------------------------------------------------------------------


def test_refusals_name_the_problem():
    w, h = torch.randn(2, 32), torch.eye(32)
    if can_interpret() or not torch.cuda.is_available():
        with pytest.raises((TypeError, RuntimeError), match="^nvfp4_gptq_solve_fast: "):
            nvfp4_gptq_solve_fast(w, h, 1.0)
    with pytest.raises(ValueError, match="blocksize must be at most 128"):
        nvfp4_gptq_solve_fast(w, h, 1.0, blocksize=256)
    with production_checks(), pytest.raises(TypeError, match="blocksize must be an int"):
        nvfp4_gptq_solve_fast(w, h, 1.0, blocksize=64.0)
    with production_checks(), pytest.raises(TypeError, match="tuning must be an NVFP4GPTQTuning"):
        nvfp4_gptq_solve_fast(w, h, 1.0, tuning={"block_rows": 8})


def test_tunings_are_checked():
    assert NVFP4GPTQTuning(block_rows=1, warps=16).warps == 16
    for bad in ({"block_rows": 3}, {"block_rows": 128}, {"warps": 0}, {"warps": True}):
        with pytest.raises(ValueError, match="must be a power of two"):
            NVFP4GPTQTuning(**bad)


def test_route_is_torch_off_cuda_with_its_reason():
    route, reason = nvfp4_gptq_route(torch.device("cpu"))
    assert route == "torch" and "the weight is on cpu" in reason and "CUDA" in reason
    w = _weight(4, 32, 0, "cpu")
    h = _hessian(32, 1, "cpu")
    auto = nvfp4_gptq_solve_auto(w, h, _scale(w), recipe="four_six")
    pure = nvfp4_gptq_solve(w, h, _scale(w), recipe="four_six")
    assert_bitwise_equal(auto.packed, pure.packed)
    assert_bitwise_equal(auto.loss, pure.loss)


def test_route_on_cuda_follows_triton_and_the_block_size(monkeypatch):
    cuda = torch.device("cuda")
    monkeypatch.setattr(route_module, "triton_unavailable_reason", lambda device: None)
    assert nvfp4_gptq_route(cuda) == ("triton", None)
    route, reason = nvfp4_gptq_route(cuda, blocksize=256)
    assert route == "torch" and reason.startswith("blocksize 256 > 128")
    monkeypatch.setattr(route_module, "triton_unavailable_reason", lambda device: "no Triton")
    assert nvfp4_gptq_route(cuda) == ("torch", "no Triton")


# ----------------------------------------------------------------------------------------------
# Interpreter (CPU, TRITON_INTERPRET=1, child process)
# ----------------------------------------------------------------------------------------------


@pytest.mark.skipif(
    not can_interpret(),
    reason="needs Triton installed and no CUDA device (with CUDA the compiled kernel is tested)",
)
def test_interpreter_suite():
    run_interpreted_tests(__file__, expected=4)


@needs_interpreter
def test_interpreted_fuzzed_shapes():
    _check_fuzzed("cpu", SMALL_SHAPES[:3], (NVFP4GPTQTuning(block_rows=1),))
    _check_fuzzed("cpu", SMALL_SHAPES[:4], (None, NVFP4GPTQTuning(block_rows=16, warps=2)))
    _check_fuzzed("cpu", SMALL_SHAPES[4:], (NVFP4GPTQTuning(block_rows=4),))


@needs_interpreter
def test_interpreted_ties_signed_zeros_dead_inputs_strides():
    _check_special("cpu")


@needs_interpreter
def test_interpreted_block_sizes():
    _check_blocksizes("cpu")


if INTERPRETING:  # (the interpreter resolves a kernel's names in its module)
    import triton
    import triton.language as tl

    @triton.jit
    def _lossy_column(tile, here):
        return tl.sum(tl.where(here, tile, 0.0), axis=1)  # -0.0 + 0.0 is +0.0


@needs_interpreter
def test_interpreted_check_can_fail(monkeypatch):
    """A kernel that extracts a column by a float sum with ``+0.0`` fillers loses ``-0.0`` and
    fails the comparison: the tie case holds ``-0.0`` weights, code 8 (code 0 when lost)."""
    import floatxq.kernels._nvfp4_gptq_jit as sources

    w, g = _ties(2, 32, "cpu")
    h = torch.eye(32)
    assert (_check(w, h, g).packed[:, 0] & 0xF).tolist() == [8, 8]  # -0.0 in column 0
    monkeypatch.setattr(sources, "column", _lossy_column)
    with pytest.raises(AssertionError, match="packed"):
        _check(w, h, g)


# ----------------------------------------------------------------------------------------------
# GPU (compiled kernel)
# ----------------------------------------------------------------------------------------------


@pytest.mark.gpu
def test_fuzzed_shapes_and_tunings_on_cuda():
    tunings = [NVFP4GPTQTuning(block_rows=b, warps=n) for b, n in ((1, 1), (4, 2), (8, 4),
               (16, 4), (32, 8), (64, 8))]  # fmt: skip
    _check_fuzzed("cuda", [*SMALL_SHAPES, (300, 1040), (129, 4096)], [None, *tunings])


@pytest.mark.gpu
def test_ties_signed_zeros_dead_inputs_strides_and_block_sizes_on_cuda():
    _check_special("cuda")
    _check_blocksizes("cuda")


@pytest.mark.gpu
def test_subnormal_steps_on_cuda():
    """Global scales so small that ``step = block_scale · g`` and ``v · step`` are FP32
    subnormals: a launch that flushed them would change codes and errors."""
    w = _weight(64, 256, 3, "cuda") * 1e-36
    h = _hessian(256, 4, "cuda")
    for g in (1e-38, 3e-40):
        _check(w, h, torch.tensor(g, device="cuda"), msg=f"g={g}")


@pytest.mark.gpu
@pytest.mark.parametrize(("rows", "k"), [(4096, 4096), (512, 14336), (1024, 4112)])
def test_model_shapes_on_cuda(rows, k):
    w = _weight(rows, k, rows + k, "cuda")
    h = _hessian(k, k, "cuda", samples=4096)
    assert nvfp4_gptq_route(w.device) == ("triton", None)
    _check(w, h, _scale(w), msg="model shape")
