"""``fp8_scaled_linear_kernel`` equals ``fp8_scaled_linear`` up to FP32 summation order, fuzzed.

The bound (``floatxq.testing.assert_fp8_linear_close``) is per element: a statistical bound on
the accumulation error of FP32 sums (interpreter) or Hopper's FP8 MMAs (GPU) plus the output's
rounding, so an ``x`` code one step off the pure quantizer's (``tests/test_fp8_linear_bound.py``),
a wrong scale or a dropped tile would fail it. Beside it, the codes and scales the kernel
quantized ``x`` to (``fp8_scaled_linear_kernel_with_codes``) must equal the pure quantizer's bit
for bit, so a wrong code fails at any K, and its output must equal the plain entry's bit for bit.
GPU tests run the compiled kernel; without CUDA, ``test_interpreter_suite`` reruns the
``interpreted`` tests in a child process under ``TRITON_INTERPRET=1`` on small shapes. Argument
checks need neither.
"""

import dataclasses

import pytest
import torch

import floatxq as fq
from floatxq.kernels import (
    FP8ScaledLinearTrace,
    fp8_scaled_linear_kernel,
    fp8_scaled_linear_kernel_with_codes,
    fp8_small_m,
)
from floatxq.kernels.fp8_small_m import DEFAULT_SMALL_M_TUNING, FP8SmallMTiles, FP8SmallMTuning
from floatxq.testing import (
    FP32_ACCUMULATION,
    HOPPER_FP8_ACCUMULATION,
    assert_bitwise_equal,
    assert_fp8_linear_close,
    unchecked,
)
from floatxq.testing.interpreter import can_interpret, needs_interpreter, run_interpreted_tests

RECIPES = [
    ("tensorwise", "tensor", None, "float8_e4m3fn"),
    ("rowwise", "row", None, "float8_e4m3fn"),
    ("rowwise", "row", None, "float8_e5m2"),
    ("blockwise", "block", (128, 128), "float8_e4m3fn"),
]

# (m, n, k): one row, ragged rows and columns, K not a multiple of the tile (or of 16), more rows
# than one 16-row tile, and the empty edges. Blockwise takes the cases whose n and k divide 128.
GPU_SHAPES = [
    (1, 256, 256),
    (1, 128, 8192),
    (3, 48, 40),
    (16, 384, 512),
    (17, 256, 384),
    (5, 1000, 300),
    (40, 128, 1024),
    (2, 16, 16),
    (0, 256, 256),
    (4, 0, 256),
    (4, 256, 0),
]
INTERPRETER_SHAPES = [
    (1, 128, 512),
    (3, 48, 40),
    (4, 128, 1000),
    (17, 256, 128),
    (0, 128, 128),
    (2, 128, 0),
]


def _tuning(recipe, *, split=None, imprecise=None, unroll=None, **fields):
    """The default tuning with ``recipe``'s tiles (one-row and multi-row) given ``split`` K and
    ``imprecise`` products, and ``unroll`` 3: three 256-element amax loads in flight (several
    chunks of loads, the last one part masked)."""
    changes = {}
    tile_changes = {"split_k": split, "imprecise_k": imprecise}
    tile_changes = {k: v for k, v in tile_changes.items() if v is not None}
    for name in (recipe, f"{recipe}_one_row"):
        changes[name] = dataclasses.replace(getattr(DEFAULT_SMALL_M_TUNING, name), **tile_changes)
    if unroll == 3:
        changes.update(amax_unroll=3, amax_tile=256, amax_row_tile=256)
    return dataclasses.replace(DEFAULT_SMALL_M_TUNING, **changes, **fields)


def _case(seed, m, n, k, recipe, method, block, name, dtype, device):
    g = torch.Generator().manual_seed(seed)
    # rows spanning binades (so per-row scales matter), a zero row, a subnormal-only row
    x = torch.randn(m, k, generator=g) * torch.exp2(torch.randint(-6, 6, (m, 1), generator=g))
    if m > 2 and k:
        x[1] = 0.0
        x[2] = 0.0
        x[2, :: max(1, k // 5)] = 2.0**-20
    w = torch.randn(n, k, generator=g) * torch.exp2(torch.randint(-4, 4, (n, 1), generator=g))
    bias = torch.randn(n, generator=g) * 4
    q = fq.quantize_fp8_weight(w, format=name, weight_scale_method=method, weight_block_size=block)
    move = dict(device=device)
    return (
        x.to(dtype).to(**move),
        q.qweight.to(**move),
        q.scale_inv.to(**move),
        bias.to(dtype).to(**move),
    )


GPU_SUMS = HOPPER_FP8_ACCUMULATION
"""How the compiled kernel adds FP8 products (the bound's error model; see
``assert_fp8_linear_close``)."""


def _check(
    seed, m, n, k, recipe, method, block, name, dtype, device, *, with_bias=True,
    tuning=DEFAULT_SMALL_M_TUNING,
):  # fmt: skip
    x, codes, scale_inv, bias = _case(seed, m, n, k, recipe, method, block, name, dtype, device)
    bias = bias if with_bias else None
    direct = torch.ones_like(scale_inv) / scale_inv
    got = fp8_scaled_linear_kernel(x, codes, direct, bias, recipe=recipe, tuning=tuning)
    assert got.dtype == dtype and got.shape == (m, n) and got.device == x.device
    assert_fp8_linear_close(
        got, x, codes, scale_inv, bias, recipe=recipe, msg=f"{recipe} {name} {(m, n, k)} {dtype}",
        accumulation=GPU_SUMS if x.is_cuda else FP32_ACCUMULATION,
    )  # fmt: skip


def _check_steps_past_k(device):
    """Blockwise K split so that a split's last step lies past K (640 = 5 steps in splits of
    2) or would leave a split empty (512 = 4 steps, 3 splits): the weight scale is a view whose
    next columns hold NaN, so a step past K that read a scale there would give NaN."""
    for k, split, used in ((640, 4, 3), (512, 3, 2)):
        tuning = _tuning("blockwise", split=split)
        for m in (1, 3):
            x, codes, scale_inv, bias = _case(
                7, m, 256, k, "blockwise", "block", (128, 128), "float8_e4m3fn", torch.bfloat16,
                device,
            )  # fmt: skip
            poisoned = torch.full((2, k // 128 + 2), float("nan"), device=device)
            poisoned[:, : k // 128] = 1 / scale_inv
            direct = poisoned[:, : k // 128]
            plan = fp8_small_m._plan(x, codes, direct, True, "blockwise", tuning, not x.is_cuda)
            assert plan[1] == used, "splits cover the steps with none left empty"
            got = fp8_scaled_linear_kernel(
                x, codes, direct, bias, recipe="blockwise", tuning=tuning
            )
            assert_fp8_linear_close(
                got, x, codes, scale_inv, bias, recipe="blockwise",
                accumulation=GPU_SUMS if x.is_cuda else FP32_ACCUMULATION,
            )  # fmt: skip


X_LAYOUT = {
    "tensorwise": ("tensor", None),
    "rowwise": ("row", None),
    "blockwise": ("block", (1, 128)),
}
"""How each recipe quantizes ``x`` with the weight formula (docs/numerics.md): per tensor, per
row, per 1×128 block."""

# (m, n, k) for the codes: no rows, one, a ragged tile, a full 16-row tile, K not a multiple of
# 16 or 128 (not blockwise), no columns (the kernel still quantizes x), no K.
CODE_SHAPES = {
    "interpreter": [(0, 48, 40), (1, 48, 40), (7, 48, 300), (16, 48, 40), (5, 0, 40), (3, 48, 0)],
    "interpreter_blockwise": [(0, 128, 128), (1, 128, 256), (7, 128, 384), (16, 128, 128)],
    "gpu": [
        (0, 256, 300), (1, 256, 40), (1, 1000, 8192), (7, 256, 300), (16, 256, 16384),
        (16, 1000, 1000), (5, 0, 300), (3, 256, 0),
    ],
    "gpu_blockwise": [(0, 256, 256), (1, 256, 16384), (7, 256, 384), (16, 256, 8192)],
}  # fmt: skip
DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _check_codes(seed, m, n, k, recipe, method, block, name, dtype, device, *, tuning):
    """The kernel's ``x`` codes and inverse scales are the pure quantizer's bit for bit, and its
    output is the plain entry's. ``x`` has a zero row, a row of 2**-20 and (bf16/fp32) a row of
    FP32 subnormals, whose inverse scale is capped at FLT_MAX."""
    x, codes, scale_inv, bias = _case(seed, m, n, k, recipe, method, block, name, dtype, device)
    if m > 3 and k and dtype != torch.float16:
        x[3] = 0.0
        x[3, ::3] = 2.0**-130
    direct = torch.ones_like(scale_inv) / scale_inv
    trace = fp8_scaled_linear_kernel_with_codes(
        x, codes, direct, bias, recipe=recipe, tuning=tuning
    )
    assert isinstance(trace, FP8ScaledLinearTrace)
    x_method, x_block = X_LAYOUT[recipe]
    expected = fq.quantize_fp8_weight(x, weight_scale_method=x_method, weight_block_size=x_block)
    msg = f"{recipe} {name} {(m, n, k)} {dtype} split {tuning.tiles(recipe, m).split_k}"
    assert_bitwise_equal(trace.x_codes, expected.qweight, msg=f"{msg}: x codes")
    assert_bitwise_equal(trace.x_scale_inv, expected.scale_inv, msg=f"{msg}: x scale_inv")
    plain = fp8_scaled_linear_kernel(x, codes, direct, bias, recipe=recipe, tuning=tuning)
    assert_bitwise_equal(trace.out, plain, msg=f"{msg}: output")


def _code_cases(where, recipe):
    shapes = CODE_SHAPES[f"{where}_blockwise" if recipe == "blockwise" else where]
    for seed, (m, n, k) in enumerate(shapes):
        yield seed, m, n, k, DTYPES[seed % 3]


def _fits(recipe, n, k):
    return recipe != "blockwise" or (n % 128 == 0 and k % 128 == 0)


# ----------------------------------------------------------------------------------------------
# GPU: the compiled kernel
# ----------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize(("recipe", "method", "block", "name"), RECIPES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    ("split", "unroll", "imprecise", "together", "piece"),
    [(1, 16, 32, 2, 4096), (3, 3, 32, 1, 16), (2, 16, 128, 1 << 30, 4096)],
)
def test_kernel_matches_the_reference_on_fuzzed_shapes(
    recipe, method, block, name, dtype, split, unroll, imprecise, together, piece
):
    # split 3: K split over three programs per tile (uneven steps; the last one reduces);
    # unroll 3 with 256-element amax tiles: several chunks of amax loads, the last part masked;
    # imprecise: FP8 products added in the tensor core before each FP32 promotion;
    # together: rows from which the programs reduce x's amax together (a grid barrier), with
    # pieces of at most `piece` columns (16: many pieces per program, ragged row ends);
    # 1 << 30: never (every program reads all of x)
    tuning = _tuning(
        recipe, split=split, imprecise=imprecise, unroll=unroll, coop_min_rows=together,
        coop_max_piece=piece,
    )  # fmt: skip
    for seed, (m, n, k) in enumerate(GPU_SHAPES):
        if _fits(recipe, n, k):
            _check(seed, m, n, k, recipe, method, block, name, dtype, "cuda", tuning=tuning)
            _check(
                seed, m, n, k, recipe, method, block, name, dtype, "cuda", with_bias=False,
                tuning=tuning,
            )  # fmt: skip


@pytest.mark.gpu
@pytest.mark.parametrize(("recipe", "method", "block", "name"), RECIPES)
@pytest.mark.parametrize(
    ("split", "unroll", "together", "piece"),
    [(1, 16, 2, 4096), (3, 3, 1 << 30, 4096), (2, 16, 1, 16)],
)
def test_kernel_codes_equal_the_reference_bitwise(
    recipe, method, block, name, split, unroll, together, piece
):
    # split 3 (for up to 16 rows): K split over programs, each storing its own steps' codes;
    # unroll 3: chunked amax loads; together 1 with 16-column pieces: the programs reduce x's
    # amax together (tensorwise and rowwise, where the grid fits the SMs)
    tuning = _tuning(
        recipe, split=split, unroll=unroll, coop_min_rows=together, coop_max_piece=piece,
        split_max_m=16,
    )  # fmt: skip
    for seed, m, n, k, dtype in _code_cases("gpu", recipe):
        _check_codes(seed, m, n, k, recipe, method, block, name, dtype, "cuda", tuning=tuning)


@pytest.mark.gpu
def test_codes_of_strided_x_and_the_shared_amax_path():
    tuning = dataclasses.replace(DEFAULT_SMALL_M_TUNING, coop_min_rows=1)
    x, codes, scale_inv, bias = _case(
        3, 8, 256, 512, "tensorwise", "tensor", None, "float8_e4m3fn", torch.bfloat16, "cuda"
    )
    plan = fp8_small_m._plan(x, codes, 1 / scale_inv, True, "tensorwise", tuning, False, True)
    assert plan[2], "the programs reduce the amax together here"
    expected = fq.quantize_fp8_weight(x, weight_scale_method="tensor")
    plain = fp8_scaled_linear_kernel(x, codes, 1 / scale_inv, bias, recipe="tensorwise")
    for view in (x, x.t().contiguous().t()):  # row-major, column-major
        for _ in range(2):  # the second launch of a configuration skips Triton's binding
            trace = fp8_scaled_linear_kernel_with_codes(
                view, codes, 1 / scale_inv, bias, recipe="tensorwise", tuning=tuning
            )
            assert_bitwise_equal(trace.x_codes, expected.qweight)
            assert_bitwise_equal(trace.x_scale_inv, expected.scale_inv)
            assert_bitwise_equal(trace.out, plain)


@pytest.mark.gpu
def test_strided_inputs_and_repeated_launches():
    x, codes, scale_inv, bias = _case(
        3, 8, 256, 512, "rowwise", "row", None, "float8_e4m3fn", torch.bfloat16, "cuda"
    )
    direct = 1 / scale_inv
    wide = torch.zeros(8, 1024, dtype=x.dtype, device="cuda")
    wide[:, ::2] = x
    for view in (x, x.t().contiguous().t(), wide[:, ::2]):  # row-major, column-major, strided
        for _ in range(2):  # the second launch of a configuration skips Triton's binding
            got = fp8_scaled_linear_kernel(view, codes, direct, bias, recipe="rowwise")
            assert_fp8_linear_close(
                got, x, codes, scale_inv, bias, recipe="rowwise", accumulation=GPU_SUMS
            )


@pytest.mark.gpu
@pytest.mark.parametrize("captured", [False, True])
def test_shared_amax_across_launches_recipes_and_graphs(captured):
    """Launch after launch on one stream's shared amax words: tensorwise and rowwise, several
    row counts, each ``x`` with a smaller amax than the one before (a bank left unreset would
    keep the larger one and give wrong codes), eagerly and replayed from a CUDA graph."""
    tuning = dataclasses.replace(DEFAULT_SMALL_M_TUNING, coop_min_rows=1)
    cases = []
    for i, (recipe, method, m) in enumerate(
        [("tensorwise", "tensor", 16), ("rowwise", "row", 5), ("tensorwise", "tensor", 1),
         ("rowwise", "row", 16), ("tensorwise", "tensor", 3)]
    ):  # fmt: skip
        x, codes, scale_inv, bias = _case(
            10 + i, m, 256, 512, recipe, method, None, "float8_e4m3fn", torch.bfloat16, "cuda"
        )
        cases.append((recipe, x * 2.0 ** (8 - 3 * i), codes, scale_inv, bias))
    _, first, codes, scale_inv, _ = cases[0]
    plan = fp8_small_m._plan(first, codes, 1 / scale_inv, True, "tensorwise", tuning, False)
    assert plan[2], "the programs reduce the amax together here"

    def run_all():
        return [
            fp8_scaled_linear_kernel(x, codes, 1 / s, bias, recipe=recipe, tuning=tuning)
            for recipe, x, codes, s, bias in cases
        ]

    for _ in range(2):
        outs = run_all()
    if captured:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            outs = run_all()
        for scale in (0.5, 64.0):  # new contents, new amaxes, replayed twice
            for case in cases:
                case[1].mul_(scale)
            graph.replay()
            graph.replay()
            torch.cuda.synchronize()
            for (recipe, x, codes, s, bias), got in zip(cases, outs, strict=True):
                assert_fp8_linear_close(
                    got, x, codes, s, bias, recipe=recipe, accumulation=GPU_SUMS
                )
    for (recipe, x, codes, s, bias), got in zip(cases, outs, strict=True):
        assert_fp8_linear_close(got, x, codes, s, bias, recipe=recipe, accumulation=GPU_SUMS)


@pytest.mark.gpu
def test_blockwise_steps_past_k_read_no_weight_scale():
    _check_steps_past_k("cuda")


@pytest.mark.gpu
def test_kernel_and_scaled_mm_agree_within_the_bound():
    """The same recipe through cuBLAS's scaled_mm: both inside the reference's bound."""
    x, codes, scale_inv, bias = _case(
        4, 16, 512, 1024, "tensorwise", "tensor", None, "float8_e4m3fn", torch.bfloat16, "cuda"
    )
    xq = fq.quantize_fp8_weight(x, weight_scale_method="tensor")
    one = torch.ones((), device="cuda")
    cublas = torch._scaled_mm(
        xq.qweight, codes.t(), one / xq.scale_inv, one / scale_inv, bias, None, x.dtype
    )
    kw = dict(recipe="tensorwise", accumulation=GPU_SUMS)
    assert_fp8_linear_close(cublas, x, codes, scale_inv, bias, **kw)
    got = fp8_scaled_linear_kernel(x, codes, one / scale_inv, bias, recipe="tensorwise")
    assert_fp8_linear_close(got, x, codes, scale_inv, bias, **kw)


@pytest.mark.gpu
def test_nan_inputs_give_nan_rows():
    x, codes, scale_inv, bias = _case(
        5, 4, 128, 256, "rowwise", "row", None, "float8_e4m3fn", torch.bfloat16, "cuda"
    )
    x[1, 7] = float("nan")
    got = fp8_scaled_linear_kernel(x, codes, 1 / scale_inv, bias, recipe="rowwise")
    assert bool(got[1].isnan().all()) and not bool(got[[0, 2, 3]].isnan().any())


# ----------------------------------------------------------------------------------------------
# CPU: the interpreter (small shapes) and the argument checks
# ----------------------------------------------------------------------------------------------


@pytest.mark.skipif(
    not can_interpret(),
    reason="needs Triton installed and no CUDA device (with CUDA the compiled kernel is tested)",
)
def test_interpreter_suite():
    run_interpreted_tests(__file__, expected=9)  # every interpreted test below ran


OVERFLOW = "ignore:overflow encountered:RuntimeWarning"
"""numpy's warning when the interpreter divides fp8_max by FLT_MIN (the scale cap handles it)."""


@needs_interpreter
@pytest.mark.filterwarnings(OVERFLOW)
@pytest.mark.parametrize(("recipe", "method", "block", "name"), RECIPES)
def test_interpreted_kernel_matches_the_reference(recipe, method, block, name):
    # unroll 3 with 256-element amax tiles: several chunks of loads, the last one part masked
    for split, unroll in ((1, 16), (3, 16), (2, 3)):
        tuning = _tuning(recipe, split=split, unroll=unroll)
        for seed, (m, n, k) in enumerate(INTERPRETER_SHAPES):
            if _fits(recipe, n, k):
                dtype = (torch.bfloat16, torch.float16)[seed % 2]
                for _ in range(2):  # the second launch: the counters were reset
                    _check(seed, m, n, k, recipe, method, block, name, dtype, "cpu", tuning=tuning)


@needs_interpreter
@pytest.mark.filterwarnings(OVERFLOW)
@pytest.mark.parametrize(("recipe", "method", "block", "name"), RECIPES)
def test_interpreted_codes_equal_the_reference_bitwise(recipe, method, block, name):
    # split 2 for up to 16 rows: every K split stores its own steps' codes (and block scales)
    for split in (1, 2):
        tuning = _tuning(recipe, split=split, unroll=3, split_max_m=16)
        for seed, m, n, k, dtype in _code_cases("interpreter", recipe):
            _check_codes(seed, m, n, k, recipe, method, block, name, dtype, "cpu", tuning=tuning)


@needs_interpreter
@pytest.mark.filterwarnings(OVERFLOW)
def test_interpreted_blockwise_steps_past_k_read_no_weight_scale():
    _check_steps_past_k("cpu")


def _bad(**changes):
    x = torch.randn(2, 256)
    q = fq.quantize_fp8_weight(torch.randn(128, 256))
    args = dict(x=x, weight=q.qweight, weight_scale=1 / q.scale_inv, bias=None, recipe="rowwise")
    args.update(changes)
    return args


@pytest.mark.parametrize(
    ("args", "error", "match"),
    [
        (_bad(recipe="columnwise"), ValueError, "recipe must be one of"),
        (_bad(x=torch.ones(2, 256, dtype=torch.int32)), TypeError, "float16/bfloat16/float32"),
        (_bad(x=torch.randn(2, 128)), ValueError, "must share k"),
        (
            _bad(weight=torch.zeros(128, 256, dtype=torch.float8_e5m2), recipe="tensorwise"),
            TypeError,
            "takes float8_e4m3fn",
        ),
        (_bad(weight=torch.zeros(128, 256, dtype=torch.uint8)), TypeError, "takes float8"),
        (
            _bad(
                weight_scale=torch.ones(()),
            ),
            ValueError,
            r"shape \(128,\)",
        ),
        (_bad(weight_scale=torch.ones(128, dtype=torch.float16)), ValueError, "float32"),
        (_bad(bias=torch.zeros(127)), ValueError, "bias must have shape"),
        (_bad(bias=torch.zeros(128, dtype=torch.float16)), ValueError, "bias must be in"),
        (_bad(recipe="blockwise", weight_scale=torch.ones(2, 1)), ValueError, r"shape \(1, 2\)"),
        (
            _bad(weight=torch.zeros(100, 256, dtype=torch.float8_e4m3fn), recipe="blockwise"),
            ValueError,
            "divisible by 128",
        ),
    ],
)
def test_kernel_rejects_bad_arguments_before_launching(args, error, match):
    with pytest.raises(error, match=match):
        unchecked(fp8_scaled_linear_kernel)(**args)
    with pytest.raises(error, match=match):
        unchecked(fp8_scaled_linear_kernel_with_codes)(**args)


def test_kernel_on_cpu_names_what_is_missing(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(TypeError, match="fp8_scaled_linear_kernel: .*one CUDA device"):
        fp8_scaled_linear_kernel(**_bad())
    with pytest.raises(TypeError, match="fp8_scaled_linear_kernel_with_codes: .*one CUDA"):
        fp8_scaled_linear_kernel_with_codes(**_bad())


def test_tuning_records_reject_what_the_kernel_cannot_launch():
    with pytest.raises(ValueError, match="block_n must be a power of two >= 16, got 48"):
        FP8SmallMTiles(block_n=48, block_k=256, num_warps=8, num_stages=4)
    with pytest.raises(ValueError, match="split_k must be >= 1, got 0"):
        FP8SmallMTiles(block_n=64, block_k=256, num_warps=8, num_stages=4, split_k=0)
    with pytest.raises(ValueError, match="amax_tile must be a power of two >= 16, got 1000"):
        FP8SmallMTuning(amax_tile=1000)
    tuning = _tuning("rowwise", split=3)
    assert tuning.tiles("rowwise", 1).split_k == tuning.tiles("rowwise", 16).split_k == 3
    assert tuning.tiles("tensorwise", 16) == DEFAULT_SMALL_M_TUNING.tiles("tensorwise", 16)


def test_reference_rejects_bad_arguments():
    x, q = torch.randn(2, 256), fq.quantize_fp8_weight(torch.randn(128, 256))
    with pytest.raises(ValueError, match="recipe must be one of"):
        unchecked(fq.fp8_scaled_linear)(x, *q, recipe="per-channel")
    with pytest.raises(ValueError, match=r"shape \(\)"):
        fq.fp8_scaled_linear(x, *q, recipe="tensorwise")
    with pytest.raises(ValueError, match="must share k"):
        unchecked(fq.fp8_scaled_linear)(x[:, :128], *q, recipe="rowwise")
    with pytest.raises(ValueError, match="NaN or infinity"):
        fq.fp8_scaled_linear(x.fill_(float("inf")), *q, recipe="rowwise")


def test_reference_equals_the_decoded_product_when_scales_are_exact():
    """Powers of two everywhere: the direct scales are exact, so the reference is the product of
    the decoded operands (a check of the formula that does not restate it)."""
    g = torch.Generator().manual_seed(0)
    w = torch.randint(-8, 9, (128, 256), generator=g).float() * 32  # amax 256 per row...
    w[:, 0] = 448.0  # ...pinned at fp8_max: scale_inv 1
    x = torch.randint(-8, 9, (3, 256), generator=g).float()
    x[:, 0] = 448.0
    q = fq.quantize_fp8_weight(w)
    assert bool((q.scale_inv == 1).all())
    got = fq.fp8_scaled_linear(x, *q, recipe="rowwise")
    assert torch.equal(got, x @ w.T)
