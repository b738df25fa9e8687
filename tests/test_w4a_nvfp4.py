"""The W4A-NVFP4 GEMM's pure reference (``w4a.linear``), its per-group step and its error bound.

Expectations come from hand-computed small cases (E2M1 codes and E4M3 block scales placed by the
swizzle offset formula written out here, integer weights, FP32 values chosen so that another
order of operations rounds differently), from a float64 oracle of the decoded operands, from an
FP32 emulation of a kernel that sums ``a · c`` directly, and from exact identities (power-of-two
scales, the two weight forms).
"""

import pytest
import torch

from floatxq.nvfp4.operand import nvfp4_pack_swizzled
from floatxq.testing import (
    FP32_ACCUMULATION,
    Accumulation,
    assert_bitwise_equal,
    assert_within_bound,
    unchecked,
    w4a_nvfp4_linear_error_bound,
)
from floatxq.w4a.activation import pack_activation
from floatxq.w4a.linear import (
    w4a_nvfp4_accumulate_group,
    w4a_nvfp4_linear,
    w4a_nvfp4_linear_prepacked,
)

E4M3 = torch.float8_e4m3fn
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
DTYPES = (torch.float32, torch.float16, torch.bfloat16)


# ----------------------------------------------------------------------------------------------
# Operands built by hand
# ----------------------------------------------------------------------------------------------


def _e2m1_codes(values: torch.Tensor) -> torch.Tensor:
    """``sign << 3 | index`` of E2M1 values (each must be one of ``±E2M1``)."""
    table = torch.tensor(E2M1)
    index = (values.abs()[..., None] == table).to(torch.uint8).argmax(-1).to(torch.uint8)
    assert torch.equal(table[index.long()], values.abs()), "not an E2M1 value"
    return index | torch.where(values.signbit(), 8, 0).to(torch.uint8)


def _packed(values: torch.Tensor) -> torch.Tensor:
    """``(m, k)`` E2M1 values as ``(m, k/2)`` bytes, element ``2j`` in the low nibble."""
    codes = _e2m1_codes(values)
    return codes[:, 0::2] | (codes[:, 1::2] << 4)


def _offsets(m: int) -> torch.Tensor:
    """``(m, 8)`` positions of row ``r``, block ``b`` inside one group's swizzled scales."""
    r, b = torch.arange(m)[:, None], torch.arange(8)[None, :]
    return (r // 128) * 1024 + (b // 4) * 512 + (r % 32) * 16 + ((r % 128) // 32) * 4 + b % 4


def _swizzled(block_scales: torch.Tensor) -> torch.Tensor:
    """``(m, k/16)`` block scales (E4M3 values) laid out per 128-wide group, padding 0."""
    m, blocks = block_scales.shape
    padded = -(-m // 128) * 128
    out = torch.zeros(blocks // 8, padded * 8)
    for g in range(blocks // 8):
        out[g, _offsets(m).flatten()] = block_scales[:, 8 * g : 8 * g + 8].flatten()
    assert torch.equal(out.to(E4M3).float(), out), "not an E4M3 value"
    return out.to(E4M3)


def _words(c: torch.Tensor) -> torch.Tensor:
    """GPTQ words of the centered weight ``c`` ``(k, n)``: nibble ``c + 8`` of row ``k`` in
    word ``k // 8`` at bits ``4 · (k % 8)``."""
    k, n = c.shape
    nibbles = (c.to(torch.int64) + 8).reshape(k // 8, 8, n)
    words = (nibbles << (4 * torch.arange(8))[None, :, None]).sum(1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def _staged(c: torch.Tensor) -> torch.Tensor:
    return c.to(torch.float32).to(E4M3)  # integers of magnitude <= 8 are exact in E4M3


def _decoded(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """float64 ``e2m1(code) · block_scale`` (no global scale) read back by hand."""
    raw = codes.view(torch.uint8).to(torch.int64)
    m, k = raw.shape[0], raw.shape[1] * 2
    nibbles = torch.stack([raw & 15, raw >> 4], dim=-1).reshape(m, k)
    magnitude = torch.tensor(E2M1, dtype=torch.float64)[nibbles & 7]
    values = torch.where(nibbles >= 8, -magnitude, magnitude)
    groups = scales.float().double()[:, _offsets(m)]  # (k/128, m, 8)
    block = groups.permute(1, 0, 2).reshape(m, k // 16)
    return values * block.repeat_interleave(16, dim=1)


def _oracle(act, c, group_scales, bias=None, token_scale=None):
    """float64 ``(a · global_scale) @ (c · group scale) · token_scale + bias`` and the same of
    magnitudes (for a tolerance on float64's own rounding)."""
    a = _decoded(act[0], act[1]) * float(act[2])
    w = c.double() * group_scales.double().repeat_interleave(128, dim=0)
    ts = token_scale.double()[:, None] if token_scale is not None else 1.0
    b = bias.double() if bias is not None else torch.zeros(c.shape[1], dtype=torch.float64)
    return (a @ w) * ts + b, (a.abs() @ w.abs()) * ts + b.abs()


def _case(seed: int, m: int, k: int, n: int, dtype: torch.dtype = torch.float32):
    """Activations ``x``, a centered weight ``c`` in -8..7, fp16 group scales, a bias."""
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(m, k, generator=g) * 3).to(dtype)
    c = torch.randint(-8, 8, (k, n), generator=g)
    group_scales = (torch.rand(k // 128, n, generator=g) * 0.02 + 0.005).half()
    bias = torch.randn(n, generator=g).to(dtype)
    return x, c, group_scales, bias


def _activation(x: torch.Tensor):
    """``(codes, scales, global_scale)`` with the dynamic global scale (as the linear takes)."""
    a = pack_activation(x, "w4a_nvfp4")
    return a.codes, a.scales, a.global_scale


def _bits(t: torch.Tensor) -> list[int]:
    return t.contiguous().view(torch.int32).flatten().tolist()


# ----------------------------------------------------------------------------------------------
# Hand-computed cases
# ----------------------------------------------------------------------------------------------


def test_hand_case_reads_block_scales_through_the_swizzled_layout():
    # m = 130 rows (two row tiles), k = 256 (two groups), every code e2m1 1.0; block scale of
    # row r, block b: (r % 5 + 1) · 2**(b - 9). Column 0 has c = 1, column 1 c = -2; group
    # scales 1 then 0.5; global scale 2.
    m, k = 130, 256
    r, b = torch.arange(m)[:, None], torch.arange(16)[None, :]
    block_scales = (r % 5 + 1).float() * torch.exp2(b - 9.0)
    codes = _packed(torch.ones(m, k))
    assert bool((codes == 0x22).all())
    c = torch.tensor([1, -2]).repeat(k, 1)
    group_scales = torch.tensor([[1.0, 1.0], [0.5, 0.5]])
    out = w4a_nvfp4_linear_prepacked(
        codes, _swizzled(block_scales), 2.0, _words(c), group_scales, output_dtype=torch.float32
    )
    # group 0: 16 · (2**-9 + ... + 2**-2) = 16 · 255/512 = 255/32; group 1: 16 · (2**-1 + ... +
    # 2**6) = 16 · 127.5 = 2040, times 0.5
    per_unit = 2 * (255 / 32 + 0.5 * 2040)
    expected = (r % 5 + 1).float() * per_unit * torch.tensor([[1.0, -2.0]])
    assert torch.equal(out, expected)
    assert out[129, 0].item() == 5 * 2055.9375  # row 129: the second row tile


def test_hand_case_with_every_code_and_sign():
    # one row, k = 128: element j holds ±E2M1[j % 8] (negative in odd runs of 8), block b has
    # scale 2**(b - 3); the weight is c[j] = j % 16 - 8.
    j = torch.arange(128)
    magnitude = torch.tensor(E2M1)[j % 8]
    values = torch.where((j // 8) % 2 == 1, -magnitude, magnitude)
    block_scales = torch.exp2(torch.arange(8.0) - 3)[None]
    c = (j % 16 - 8)[:, None]
    out = w4a_nvfp4_linear_prepacked(
        _packed(values[None]), _swizzled(block_scales), 2.0, _words(c), torch.tensor([[0.5]]),
        output_dtype=torch.float32,
    )  # fmt: skip
    # within each block of 16 the first 8 elements (codes 0..7, c = -8..-1) and the last 8
    # (codes 8..15 negated, c = 0..7) give Σ E2M1[i] · (i - 8) - Σ E2M1[i] · i = -8 · 18 = -144
    block_sum = sum(v * (i - 8) - v * i for i, v in enumerate(E2M1))
    assert block_sum == -144
    expected = block_sum * sum(2.0 ** (b - 3) for b in range(8)) * 0.5 * 2.0
    assert out.tolist() == [[expected]] and expected == -144 * 31.875


def test_the_plane_sums_are_recombined_and_rounded_before_the_group_scale():
    # H = Σ a·high = 8 · 512 = 4096 (codes e2m1 4, block scale 128, c = 4: low 0, high 1) and
    # L = Σ a·low = 3 · 2**-10 (code e2m1 1.5, block scale 2**-9, c = 1: low 1, high 0): both
    # exact. L + 4H = 16384 + 3 · 2**-10 lies halfway between FP32 neighbours 2**-9 apart:
    # nearest-even gives 16384 + 2**-8; times 0.75 that is 12288 + 3 · 2**-10, exact.
    values = torch.zeros(1, 128)
    values[0, :8], values[0, 16] = 4.0, 1.5
    block_scales = torch.zeros(1, 8)
    block_scales[0, 0], block_scales[0, 1] = 128.0, 2.0**-9
    c = torch.zeros(128, 1, dtype=torch.int64)
    c[:8], c[16] = 4, 1
    out = w4a_nvfp4_linear_prepacked(
        _packed(values), _swizzled(block_scales), 1.0, _words(c), torch.tensor([[0.75]]),
        output_dtype=torch.float32,
    )  # fmt: skip
    assert out.item() == 12288 + 3 * 2.0**-10
    # one rounding of the exact value would give 12288 + 2.25 · 2**-10 -> 12288 + 2 · 2**-10
    assert out.item() != 12288 + 2 * 2.0**-10


def test_the_low_plane_rounds_on_its_own():
    # 32 elements a = 1024 (e2m1 4, block scale 256) with c = 2 (low -2, high 1), then one
    # a = y = 5 · 2**-10 (e2m1 0.5, block scale 5 · 2**-9) with c = 1 (low 1, high 0).
    # L = -65536 + y: in any order y ends as 2**-8 (ties to even between 2**14 and 2**15, or
    # nearest between 2**15 and 2**16), so L = -65536 + 2**-8; H = 32768 exactly. L + 4H =
    # 65536 + 2**-8 is halfway between FP32 neighbours 2**-7 apart: 65536.
    values = torch.zeros(1, 128)
    values[0, :32], values[0, 32] = 4.0, 0.5
    block_scales = torch.zeros(1, 8)
    block_scales[0, :2], block_scales[0, 2] = 256.0, 5 * 2.0**-9
    c = torch.zeros(128, 1, dtype=torch.int64)
    c[:32], c[32] = 2, 1
    out = w4a_nvfp4_linear_prepacked(
        _packed(values), _swizzled(block_scales), 1.0, _words(c), torch.ones(1, 1),
        output_dtype=torch.float32,
    )  # fmt: skip
    assert out.item() == 65536.0
    # the exact value 65536 + 1.25 · 2**-8 rounds once to 65536 + 2**-7, as does a direct sum
    # that adds y last
    assert torch.tensor(65536 + 1.25 * 2.0**-8, dtype=torch.float32).item() == 65536 + 2.0**-7


def test_negative_zero_codes_give_positive_zero_outputs():
    codes = torch.full((3, 128), 0x88, dtype=torch.uint8)  # every element -0.0
    scales = _swizzled(torch.ones(3, 16))
    c = torch.randint(-8, 8, (256, 4), generator=torch.Generator().manual_seed(0))
    for dtype in DTYPES:
        out = w4a_nvfp4_linear_prepacked(
            codes, scales, 1.0, _words(c), torch.ones(2, 4), output_dtype=dtype
        )
        assert out.dtype == dtype and not bool(out.signbit().any()) and bool((out == 0).all())


@pytest.mark.parametrize("dtype", DTYPES)
def test_no_rows_give_an_empty_output(dtype):
    c = torch.zeros(256, 8, dtype=torch.int64)
    codes = torch.empty(0, 128, dtype=torch.uint8)
    scales = torch.empty(2, 0, dtype=E4M3)
    out = w4a_nvfp4_linear_prepacked(
        codes, scales, 1.0, _words(c), torch.ones(2, 8), output_dtype=dtype
    )
    assert out.dtype == dtype and out.shape == (0, 8)
    out = w4a_nvfp4_linear(torch.empty(0, 256, dtype=dtype), _staged(c), torch.ones(2, 8))
    assert out.dtype == dtype and out.shape == (0, 8)


# ----------------------------------------------------------------------------------------------
# Against the float64 oracle, both weight forms, the dynamic global scale
# ----------------------------------------------------------------------------------------------

SHAPES = [
    (0, 256, 32, torch.float32),
    (1, 128, 96, torch.float16),
    (1, 1024, 32, torch.bfloat16),
    (7, 384, 64, torch.float32),
    (7, 1024, 96, torch.float16),
    (7, 128, 32, torch.bfloat16),
    (129, 256, 48, torch.bfloat16),
    (129, 640, 32, torch.float32),
]


@pytest.mark.parametrize(("m", "k", "n", "dtype"), SHAPES)
def test_within_the_bound_of_the_float64_oracle(m, k, n, dtype):
    x, c, group_scales, bias = _case(m + k + n, m, k, n, dtype)
    words = w4a_nvfp4_linear(x, _words(c), group_scales, bias)
    staged = w4a_nvfp4_linear(x, _staged(c), group_scales, bias)
    assert_bitwise_equal(words, staged)
    assert words.dtype == dtype and words.shape == (m, n)
    act = _activation(x)
    prepacked = w4a_nvfp4_linear_prepacked(*act, _words(c), group_scales, bias, output_dtype=dtype)
    assert_bitwise_equal(words, prepacked)  # the dynamic global scale is pack_activation's
    bound = w4a_nvfp4_linear_error_bound(*act, _words(c), group_scales, bias, output_dtype=dtype)
    oracle, magnitude = _oracle(act, c, group_scales, bias)
    assert bool(((bound.exact - oracle).abs() <= 1e-12 * magnitude).all())
    assert bool((bound.statistical <= bound.worst_case).all())
    assert_within_bound(words, bound)


def _direct_route(act, c, group_scales, bias, token_scale, dtype):
    """A kernel that sums ``a · c`` in FP32 per group, last product first, then as the
    reference: ``acc += part · scale``, ``· global``, ``· token``, ``+ bias``, one rounding."""
    a = _decoded(act[0], act[1]).float()  # exact in FP32
    m, k = a.shape
    acc = torch.zeros(m, c.shape[1])
    for g in range(k // 128):
        part = torch.zeros(m, c.shape[1])
        for j in reversed(range(128 * g, 128 * g + 128)):
            part = part + a[:, j, None] * c[j].float()
        acc = acc + part * group_scales[g].float()
    acc = acc * act[2]
    acc = acc * token_scale[:, None]
    return (acc + bias.float()).to(dtype)


@pytest.mark.parametrize(("m", "k", "dtype"), [(7, 512, torch.float32), (3, 256, torch.float16)])
def test_the_bound_also_covers_a_kernel_that_sums_a_times_c_directly(m, k, dtype):
    x, c, group_scales, bias = _case(11, m, k, 48, dtype)
    act = _activation(x)
    token_scale = torch.rand(m, generator=torch.Generator().manual_seed(1)) + 0.5
    bound = w4a_nvfp4_linear_error_bound(
        *act, _staged(c), group_scales, bias, token_scale=token_scale, output_dtype=dtype
    )
    reference = w4a_nvfp4_linear_prepacked(
        *act, _staged(c), group_scales, bias, token_scale=token_scale, output_dtype=dtype
    )
    direct = _direct_route(act, c, group_scales, bias, token_scale, dtype)
    oracle, magnitude = _oracle(act, c, group_scales, bias, token_scale)
    assert bool(((bound.exact - oracle).abs() <= 1e-12 * magnitude).all())
    assert_within_bound(reference, bound, msg="planes")
    assert_within_bound(direct, bound, msg="direct")


def test_a_chunked_accumulation_model_is_wider_and_still_holds():
    x, c, group_scales, _ = _case(12, 5, 512, 32)
    act = _activation(x)
    out = w4a_nvfp4_linear_prepacked(*act, _words(c), group_scales, output_dtype=torch.float32)
    fp32 = w4a_nvfp4_linear_error_bound(
        *act, _words(c), group_scales, None, output_dtype=torch.float32
    )
    chunked = w4a_nvfp4_linear_error_bound(
        *act, _words(c), group_scales, None, output_dtype=torch.float32,
        accumulation=Accumulation(chunk=32, chunk_bits=13),
    )  # fmt: skip
    assert torch.equal(chunked.exact, fp32.exact)
    assert bool((chunked.worst_case >= fp32.worst_case).all())
    assert_within_bound(out, chunked)


@pytest.mark.parametrize(
    ("k", "which"), [(128, "worst_case"), (128, "statistical"), (1024, "statistical")]
)
def test_one_weight_code_off_by_one_step_fails_the_bound(k, which):
    x, c, group_scales, _ = _case(13, 4, k, 32)
    act = _activation(x)
    bound = w4a_nvfp4_linear_error_bound(
        *act, _words(c), group_scales, None, output_dtype=torch.float32
    )
    good = w4a_nvfp4_linear_prepacked(*act, _words(c), group_scales, output_dtype=torch.float32)
    assert_within_bound(good, bound, which=which)
    j = int(_decoded(act[0], act[1])[0].abs().argmax())  # row 0's largest activation
    wrong = c.clone()
    wrong[j, 0] += 1 if c[j, 0] < 7 else -1
    bad = w4a_nvfp4_linear_prepacked(*act, _words(wrong), group_scales, output_dtype=torch.float32)
    with pytest.raises(AssertionError, match=rf"outside the {which} bound.*\(0, 0\)"):
        assert_within_bound(bad, bound, which=which)


# ----------------------------------------------------------------------------------------------
# Order of the scales and the bias
# ----------------------------------------------------------------------------------------------


def test_power_of_two_scales_scale_the_output_exactly():
    x, c, group_scales, _ = _case(14, 7, 384, 32)
    codes, scales = nvfp4_pack_swizzled(x, 0.01)
    words = _words(c)

    def run(g, gs, ts=None):
        return w4a_nvfp4_linear_prepacked(
            codes, scales, g, words, gs, token_scale=ts, output_dtype=torch.float32
        )

    base = run(0.01, group_scales)
    for e in (-3, 5):
        assert_bitwise_equal(run(0.01 * 2.0**e, group_scales), base * 2.0**e)
        assert_bitwise_equal(run(0.01, group_scales.float() * 2.0**e), base * 2.0**e)
    rows = torch.exp2(torch.tensor([-2.0, 0, 1, 3, -5, 2, 0]))
    assert_bitwise_equal(run(0.01, group_scales, rows), base * rows[:, None])


def test_the_token_scale_follows_the_global_scale_and_the_bias_comes_last():
    x, c, group_scales, bias = _case(15, 7, 256, 32)
    codes, scales = nvfp4_pack_swizzled(x, 0.3)
    words = _words(c)

    def run(g, **kwargs):
        kwargs.setdefault("output_dtype", torch.float32)
        return w4a_nvfp4_linear_prepacked(codes, scales, g, words, group_scales, **kwargs)

    acc = run(1.0)  # the FP32 sum of the groups (times 1: exact)
    g = torch.tensor(0.3)
    assert_bitwise_equal(run(0.3), acc * g)
    token_scale = torch.rand(7, generator=torch.Generator().manual_seed(2)) + 0.5
    scaled = run(0.3, token_scale=token_scale)
    assert_bitwise_equal(scaled, (acc * g) * token_scale[:, None])
    assert not torch.equal(scaled, acc * (g * token_scale[:, None]))  # another order differs
    with_bias = run(0.3, token_scale=token_scale, bias=bias)
    assert_bitwise_equal(with_bias, scaled + bias)
    half = run(0.3, token_scale=token_scale, bias=bias.half(), output_dtype=torch.float16)
    assert_bitwise_equal(half, (scaled + bias.half().float()).half())  # one rounding


def test_an_explicit_global_scale_and_a_recipe_alias_pack_as_nvfp4_pack_swizzled():
    x, c, group_scales, bias = _case(16, 5, 256, 32, torch.float16)
    codes, scales = nvfp4_pack_swizzled(x, 0.002, recipe="nvidia")
    expected = w4a_nvfp4_linear_prepacked(
        codes, scales, 0.002, _words(c), group_scales, bias, output_dtype=torch.float16
    )
    out = w4a_nvfp4_linear(x, _words(c), group_scales, bias, global_scale=0.002, recipe="nvidia")
    assert_bitwise_equal(out, expected)
    lsq = w4a_nvfp4_linear(x, _words(c), group_scales, bias)
    assert_bitwise_equal(w4a_nvfp4_linear(x, _words(c), group_scales, bias, recipe="lsq"), lsq)


def test_inputs_are_not_modified():
    x, c, group_scales, bias = _case(17, 3, 256, 32)
    act = _activation(x)
    token_scale = torch.full((3,), 0.5)
    inputs = [*act, _words(c), group_scales, bias, token_scale, x]
    before = [t.view(torch.uint8).clone() if t.element_size() == 1 else t.clone() for t in inputs]
    w4a_nvfp4_linear_prepacked(
        *act, inputs[3], group_scales, bias, token_scale=token_scale, output_dtype=torch.float32
    )
    w4a_nvfp4_linear(x, inputs[3], group_scales, bias)
    for t, b in zip(inputs, before, strict=True):
        assert_bitwise_equal(t.view(torch.uint8) if t.element_size() == 1 else t, b)


# ----------------------------------------------------------------------------------------------
# w4a_nvfp4_accumulate_group by hand
# ----------------------------------------------------------------------------------------------


def _f32(*rows: list[float]) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.float32)


def test_accumulate_recombines_the_planes_and_adds_to_acc():
    both = _f32([1.0, -2.0, 2.0, -1.0], [0.0, 1.0, -2.0, 0.5])  # low | high, n = 2
    scale = torch.tensor([0.5, 3.0], dtype=torch.float16)
    # (low + 4·high) = [[9, -6], [-8, 3]]; times the scales [[4.5, -18], [-4, 9]]
    assert w4a_nvfp4_accumulate_group(both, scale).tolist() == [[4.5, -18.0], [-4.0, 9.0]]
    acc = _f32([1.0, 1.0], [-1.0, 0.25])
    out = w4a_nvfp4_accumulate_group(both, scale, acc)
    assert out.tolist() == [[5.5, -17.0], [-5.0, 9.25]] and out.dtype == torch.float32
    last = w4a_nvfp4_accumulate_group(
        both, scale, acc, last=True, global_scale=2.0, token_scale=torch.tensor([1.0, 0.5]),
        bias=torch.tensor([1.0, -1.0]), output_dtype=torch.bfloat16,
    )  # fmt: skip
    # [[5.5, -17] · 2 · 1, [-5, 9.25] · 2 · 0.5] + [1, -1]
    assert last.dtype == torch.bfloat16 and last.tolist() == [[12.0, -35.0], [-4.0, 8.25]]


def test_accumulate_starts_the_first_group_from_positive_zero():
    both, one = _f32([-0.0, -0.0]), torch.ones(1)
    assert _bits(w4a_nvfp4_accumulate_group(both, one)) == [0]  # +0 + (-0) = +0
    negative_acc = _f32([-0.0])
    assert _bits(w4a_nvfp4_accumulate_group(both, one, negative_acc)) == [_bits(negative_acc)[0]]
    # a zero group scale times a negative partial sum is -0: normalised to +0 in the first group
    product = w4a_nvfp4_accumulate_group(_f32([-3.0, 0.0]), torch.zeros(1))
    assert _bits(product) == [0]
    last = w4a_nvfp4_accumulate_group(
        both, one, last=True, global_scale=1.0, output_dtype=torch.float16
    )
    assert last.view(torch.int16).tolist() == [[0]]


def test_accumulate_adds_the_planes_before_scaling():
    # low + 4·high = 1 + 2**24 rounds (tie) to 2**24, times 3 exact: 3 · 2**24. Scaling each
    # plane first would give 3 + 3 · 2**24 -> 3 · 2**24 + 4 (FP32 spacing 4 there).
    out = w4a_nvfp4_accumulate_group(_f32([1.0, 2.0**22]), torch.tensor([3.0]))
    assert out.item() == 3 * 2**24


def test_accumulate_rounds_the_product_before_adding_acc():
    # (1 + 2**-23) · (1 + 2**-23) = 1 + 2**-22 + 2**-46 rounds to 1 + 2**-22; plus acc = -1
    # gives 2**-22. A fused multiply-add would keep 2**-22 + 2**-46.
    third = 1 + 2.0**-23
    out = w4a_nvfp4_accumulate_group(_f32([third, 0.0]), torch.tensor([third]), _f32([-1.0]))
    assert out.item() == 2.0**-22


def test_accumulate_last_group_order_global_token_bias_then_one_rounding():
    both, one = _f32([3.0, 0.0]), torch.ones(1)
    # 3 · 2 · 3 + 1 = 19 (bias first: (3 + 1) · 6 = 24; token scale after the bias: 21)
    out = w4a_nvfp4_accumulate_group(
        both, one, last=True, global_scale=2.0, token_scale=_f32([3.0])[0], bias=torch.ones(1)
    )
    assert out.item() == 19.0
    # the token-scale product is rounded before the bias: (1 + 2**-23)² -> 1 + 2**-22, minus 1
    third = 1 + 2.0**-23
    out = w4a_nvfp4_accumulate_group(
        _f32([third, 0.0]), one, last=True, global_scale=1.0, token_scale=_f32([third])[0],
        bias=-torch.ones(1),
    )  # fmt: skip
    assert out.item() == 2.0**-22
    # 2049 + 1 in FP32, then float16: 2050 (rounding 2049 to float16 first gives 2048 + 1 ->
    # 2048 again, ties to even)
    out = w4a_nvfp4_accumulate_group(
        _f32([2049.0, 0.0]), one, last=True, global_scale=1.0, bias=torch.ones(1).half(),
        output_dtype=torch.float16,
    )  # fmt: skip
    assert out.dtype == torch.float16 and out.item() == 2050.0
    # the global scale as a tensor reads the same
    tensor = w4a_nvfp4_accumulate_group(both, one, last=True, global_scale=torch.tensor([2.0]))
    assert tensor.item() == 6.0


ACC = unchecked(w4a_nvfp4_accumulate_group)
BOTH, SCALE = torch.ones(2, 4), torch.ones(2)


@pytest.mark.parametrize(
    ("args", "kwargs", "error", "match"),
    [
        (([1.0] * 4, SCALE), {}, TypeError, "both must be a torch.Tensor"),
        ((BOTH.half(), SCALE), {}, TypeError, "both must be float32, got torch.float16"),
        ((BOTH, SCALE, torch.ones(2, 2).double()), {}, TypeError, "acc must be float32"),
        ((BOTH, SCALE), {"last": True, "global_scale": 1.0,
                         "token_scale": torch.ones(2).half()}, TypeError,
         "token_scale must be float32"),
        ((torch.ones(4), SCALE), {}, ValueError, r"both must be \(m, 2n\), got \(4,\)"),
        ((torch.ones(2, 3), SCALE), {}, ValueError, r"both must be \(m, 2n\), got \(2, 3\)"),
        ((BOTH, torch.ones(2, dtype=torch.int32)), {}, TypeError,
         "group_scale must be a floating-point tensor"),
        ((BOTH, torch.ones(3)), {}, ValueError, r"group_scale must have shape \(2,\), got \(3,\)"),
        ((BOTH, SCALE, torch.ones(2, 3)), {}, ValueError, r"acc must have shape \(2, 2\)"),
        ((BOTH, SCALE), {"global_scale": 1.0}, ValueError,
         "global_scale apply only to the last group"),
        ((BOTH, SCALE), {"token_scale": torch.ones(2)}, ValueError,
         "token_scale apply only to the last group"),
        ((BOTH, SCALE), {"bias": torch.ones(2)}, ValueError, "bias apply only to the last"),
        ((BOTH, SCALE), {"output_dtype": torch.float16}, ValueError,
         "output_dtype=torch.float16 apply only to the last group"),
        ((BOTH, SCALE), {"last": True}, ValueError, "the last group needs the activation's"),
        ((BOTH, SCALE), {"last": True, "global_scale": 1.0, "output_dtype": torch.float64},
         TypeError, "output_dtype must be float16, bfloat16 or float32, got torch.float64"),
        ((BOTH, SCALE), {"last": True, "global_scale": 1.0, "token_scale": torch.ones(3)},
         ValueError, r"token_scale must have shape \(2,\), got \(3,\)"),
        ((BOTH, SCALE), {"last": True, "global_scale": 1.0,
                         "bias": torch.ones(2, dtype=torch.int64)}, TypeError,
         "bias must be a floating-point tensor"),
        ((BOTH, SCALE), {"last": True, "global_scale": 1.0, "bias": torch.ones(4)},
         ValueError, r"bias must have shape \(2,\), got \(4,\)"),
        ((BOTH, torch.ones(2, device="meta")), {}, TypeError,
         r"every tensor must be on one device, got \['cpu', 'meta'\]"),
        ((BOTH, SCALE), {"last": True, "global_scale": "2"}, TypeError,
         "global_scale must be a real number"),
        ((BOTH, SCALE), {"last": True, "global_scale": torch.ones(2)}, ValueError,
         "global_scale must hold one value"),
    ],
)  # fmt: skip
def test_accumulate_validation_errors(args, kwargs, error, match):
    with pytest.raises(error, match=match) as info:
        ACC(*args, **kwargs)
    assert str(info.value).startswith("w4a_nvfp4_accumulate_group: ")


# ----------------------------------------------------------------------------------------------
# Validation of the GEMM, the linear and the bound
# ----------------------------------------------------------------------------------------------

PREPACKED = unchecked(w4a_nvfp4_linear_prepacked)
LINEAR = unchecked(w4a_nvfp4_linear)
BOUND = unchecked(w4a_nvfp4_linear_error_bound)


def _valid() -> dict:
    x, c, group_scales, _ = _case(20, 2, 256, 32)
    codes, scales = nvfp4_pack_swizzled(x, 0.01)
    return dict(
        codes=codes, scales=scales, global_scale=0.01, weight=_words(c),
        group_scales=group_scales, bias=None, token_scale=None, output_dtype=torch.float32,
    )  # fmt: skip


def _with_scale_byte(byte: int) -> torch.Tensor:
    scales = _valid()["scales"].clone()
    scales.view(torch.uint8)[1, 16] = byte  # row 1, block 0 of group 1
    return scales


def _staged_with(value: float) -> torch.Tensor:
    c = torch.zeros(256, 32)
    c[5, 3] = value
    return c.to(E4M3)


META = torch.device("meta")
PREPACKED_ERRORS = [
    ({"codes": [0] * 128}, TypeError, "codes must be a torch.Tensor"),
    ({"codes": torch.zeros(2, 128, dtype=torch.int16)}, TypeError,
     r"codes must be a 2-D float4_e2m1fn_x2 or uint8 \(m, k/2\) tensor, got torch.int16"),
    ({"codes": torch.zeros(256, dtype=torch.uint8)}, TypeError, r"codes must be a 2-D .*\(256,\)"),
    ({"codes": torch.zeros(2, 128, dtype=torch.uint8, device=META)}, TypeError,
     "codes is a meta tensor"),
    ({"codes": torch.zeros(2, 32, dtype=torch.uint8)}, ValueError,
     r"k = 2 \* codes.shape\[1\] = 64 must be a positive multiple of 128"),
    ({"codes": torch.zeros(2, 0, dtype=torch.uint8)}, ValueError, "= 0 must be a positive"),
    ({"scales": torch.zeros(2, 1024, dtype=torch.uint8)}, TypeError,
     "scales must be float8_e4m3fn, got torch.uint8"),
    ({"scales": torch.zeros(2, 1024, dtype=E4M3, device=META)}, TypeError,
     "scales is a meta tensor"),
    ({"scales": torch.zeros(2, 512, dtype=E4M3)}, ValueError,
     r"scales must have shape \(2, 1024\) \(k/128, padded_rows\(m\)\*8\) for m=2 rows, got "
     r"\(2, 512\)"),
    ({"scales": torch.zeros(1, 1024, dtype=E4M3)}, ValueError, r"scales must have shape \(2, 1024"),
    ({"weight": torch.zeros(32, 32)}, TypeError,
     "weight must be a 2-D float8_e4m3fn .* got torch.float32"),
    ({"weight": torch.zeros(16, 32, dtype=torch.int32)}, ValueError,
     r"weight must hold k=256 input rows, got \(16, 32\) int32 words"),
    ({"weight": torch.zeros(128, 32, dtype=E4M3)}, ValueError,
     r"weight must hold k=256 input rows, got \(128, 32\)"),
    ({"weight": _staged_with(0.5)}, ValueError,
     r"float8_e4m3fn weight must hold integers in -8..7 \(code - 8\), got 1 other value\(s\), "
     r"such as \[0.5\]"),
    ({"weight": _staged_with(8.0)}, ValueError, r"integers in -8..7 .* such as \[8.0\]"),
    ({"weight": _staged_with(float("nan"))}, ValueError, r"integers in -8..7 .* such as \[nan\]"),
    ({"group_scales": torch.ones(2, 32, dtype=torch.int32)}, TypeError,
     "group_scales must be a floating-point tensor"),
    ({"group_scales": torch.ones(1, 32)}, ValueError,
     r"group_scales must have shape \(2, 32\) \(one per group of 128 input rows and output "
     r"column\), got \(1, 32\)"),
    ({"bias": torch.zeros(31)}, ValueError, r"bias must have shape \(32,\), got \(31,\)"),
    ({"bias": torch.zeros(32, dtype=torch.int64)}, TypeError, "bias must be a floating-point"),
    ({"token_scale": torch.ones(2).half()}, TypeError,
     "token_scale must be float32, got torch.float16"),
    ({"token_scale": [1.0, 1.0]}, TypeError, "token_scale must be a torch.Tensor"),
    ({"token_scale": torch.ones(3)}, ValueError,
     r"token_scale must have shape \(2,\) \(one per row of codes\), got \(3,\)"),
    ({"token_scale": torch.ones(2, device=META)}, TypeError,
     "token_scale is on meta, codes on cpu"),
    ({"token_scale": torch.tensor([1.0, float("nan")])}, ValueError,
     "token_scale contains NaN or infinity"),
    ({"token_scale": torch.tensor([float("inf"), 1.0])}, ValueError,
     "token_scale contains NaN or infinity"),
    ({"output_dtype": torch.float64}, TypeError,
     "output_dtype must be float16, bfloat16 or float32, got torch.float64"),
    ({"output_dtype": "float32"}, TypeError, "output_dtype must be .* got 'float32'"),
    ({"global_scale": 0.0}, ValueError, "global_scale must be positive and finite, got 0.0"),
    ({"global_scale": -1.0}, ValueError, "global_scale must be positive and finite, got -1.0"),
    ({"global_scale": float("nan")}, ValueError, "global_scale must be positive and finite"),
    ({"global_scale": float("inf")}, ValueError, "global_scale must be positive and finite"),
    ({"global_scale": "1"}, TypeError, "global_scale must be a real number"),
    ({"global_scale": torch.ones(2)}, ValueError, "global_scale must hold one value"),
    ({"scales": _with_scale_byte(0x7F)}, ValueError,
     r"scales holds 1 NaN or negative E4M3 scale\(s\) \(bytes such as \['0x7f'\]\)"),
    ({"scales": _with_scale_byte(0xB8)}, ValueError, r"bytes such as \['0xb8'\]"),
]  # fmt: skip


@pytest.mark.parametrize(("change", "error", "match"), PREPACKED_ERRORS)
def test_prepacked_validation_errors(change, error, match):
    kwargs = _valid() | change
    with pytest.raises(error, match=match) as info:
        PREPACKED(**kwargs)
    assert str(info.value).startswith("w4a_nvfp4_linear_prepacked: ")


@pytest.mark.parametrize(("change", "error", "match"), PREPACKED_ERRORS[::4])
def test_the_bound_checks_its_operands_as_the_gemm_does(change, error, match):
    kwargs = _valid() | change
    with pytest.raises(error, match=match) as info:
        BOUND(**kwargs)
    assert str(info.value).startswith("w4a_nvfp4_linear_error_bound: ")


def test_the_bound_refuses_an_accumulation_it_cannot_model():
    kwargs = _valid()
    with pytest.raises(TypeError, match="accumulation must be an Accumulation, got str"):
        BOUND(**kwargs, accumulation="fp32")
    with pytest.raises(ValueError, match="chunk must divide 128, got 48"):
        BOUND(**kwargs, accumulation=Accumulation(chunk=48, chunk_bits=13))
    assert BOUND(**kwargs, accumulation=FP32_ACCUMULATION).exact.shape == (2, 32)


def _linear_args() -> tuple:
    x, c, group_scales, _ = _case(21, 2, 256, 32)
    return x, _words(c), group_scales


def _with(x: torch.Tensor, value: float) -> torch.Tensor:
    x = x.clone()
    x[1, 7] = value
    return x


X, WORDS, GROUP_SCALES = _linear_args()
LINEAR_ERRORS = [
    ((X.tolist(), WORDS, GROUP_SCALES), {}, TypeError, "x must be a torch.Tensor"),
    ((X.int(), WORDS, GROUP_SCALES), {}, TypeError, "x must be a floating-point tensor"),
    ((X.double(), WORDS, GROUP_SCALES), {}, TypeError,
     r"x must be a 2-D float16/bfloat16/float32 \(m, k\) tensor, got torch.float64"),
    ((X[None], WORDS, GROUP_SCALES), {}, TypeError, r"x must be a 2-D .*\(1, 2, 256\)"),
    ((X.to(META), WORDS, GROUP_SCALES), {}, TypeError, "x is a meta tensor"),
    ((X[:, :64], WORDS, GROUP_SCALES), {}, ValueError, "k=64 must be a positive multiple of 128"),
    ((X[:, :0], WORDS, GROUP_SCALES), {}, ValueError, "k=0 must be a positive multiple of 128"),
    ((_with(X, float("nan")), WORDS, GROUP_SCALES), {}, ValueError, "x contains NaN or infinity"),
    ((_with(X, float("-inf")), WORDS, GROUP_SCALES), {}, ValueError, "x contains NaN or inf"),
    ((X, WORDS.float(), GROUP_SCALES), {}, TypeError, "weight must be a 2-D float8_e4m3fn"),
    ((X, WORDS[:16], GROUP_SCALES), {}, ValueError, "weight must hold k=256 input rows"),
    ((X, WORDS, GROUP_SCALES[:1]), {}, ValueError, r"group_scales must have shape \(2, 32\)"),
    ((X, WORDS, GROUP_SCALES, torch.zeros(3)), {}, ValueError, r"bias must have shape \(32,\)"),
    ((X, WORDS, GROUP_SCALES), {"recipe": "bogus"}, ValueError, "bogus"),
    ((X, WORDS, GROUP_SCALES), {"global_scale": 0.0}, ValueError,
     "global_scale must be positive and finite"),
    ((X, WORDS, GROUP_SCALES), {"global_scale": "0.5"}, TypeError,
     "global_scale must be a real number"),
]  # fmt: skip


@pytest.mark.parametrize(("args", "kwargs", "error", "match"), LINEAR_ERRORS)
def test_linear_validation_errors(args, kwargs, error, match):
    with pytest.raises(error, match=match):
        LINEAR(*args, **kwargs)


def test_linear_errors_name_the_function():
    with pytest.raises(TypeError, match=r"^w4a_nvfp4_linear: x must be a 2-D"):
        LINEAR(X.double(), WORDS, GROUP_SCALES)
    with pytest.raises(ValueError, match=r"^w4a_nvfp4_linear: group_scales must have shape"):
        LINEAR(X, WORDS, GROUP_SCALES[:1])


@pytest.mark.gpu
def test_operands_on_two_devices_are_type_errors():
    kwargs = _valid()
    for name in ("weight", "group_scales", "scales"):
        moved = kwargs | {name: kwargs[name].cuda()}
        with pytest.raises(TypeError, match="device|is on cuda|are on cuda"):
            PREPACKED(**moved)


@pytest.mark.gpu
def test_on_cuda_the_reference_is_within_the_bound():
    x, c, group_scales, bias = _case(22, 129, 512, 64, torch.bfloat16)
    act = [t.cuda() for t in _activation(x)]
    args = (*act, _words(c).cuda(), group_scales.cuda(), bias.cuda())
    out = w4a_nvfp4_linear_prepacked(*args, output_dtype=torch.bfloat16)
    bound = w4a_nvfp4_linear_error_bound(*args, output_dtype=torch.bfloat16)
    assert_within_bound(out, bound)


@pytest.mark.parametrize("recipe", ["nvidia", "least_squares", "exhaustive"])
def test_the_gemm_is_the_nvfp4_qdq_of_x_times_the_dequantized_weight(recipe):
    """W4A-NVFP4 is the NVFP4 quantize-dequantize of x (floatxq.nvfp4_block_qdq, the replay
    oracle) times the dequantized GPTQ weight: the activation the GEMM multiplies decodes to
    qdq(x) exactly, and the output lies within the GEMM's bound of that float64 product, plus
    one FP32 rounding per term for qdq's own product with the global scale."""
    from floatxq.gptq.int4 import dequantize_gptq, pack_gptq
    from floatxq.nvfp4.operand import nvfp4_decode_swizzled
    from floatxq.nvfp4.quantize import nvfp4_block_qdq

    g = torch.Generator().manual_seed(7)
    m, k, n = 5, 384, 64
    x = torch.randn(m, k, generator=g) * torch.exp2(torch.randint(-4, 4, (m, 1), generator=g))
    codes = torch.randint(0, 16, (k, n), generator=g)
    scales = torch.rand(k // 128, n, generator=g) * 0.02 + 0.001
    packed = pack_gptq(codes, torch.full((k // 128, n), 8), scales,
                       torch.arange(k, dtype=torch.int32) // 128)  # fmt: skip
    gs = 0.0125
    qdq = nvfp4_block_qdq(x, gs, recipe)
    a_codes, a_scales = nvfp4_pack_swizzled(x, gs, recipe=recipe)
    assert torch.equal(nvfp4_decode_swizzled(a_codes, a_scales, gs, k, torch.float32), qdq)
    out = w4a_nvfp4_linear(x, packed.qweight, packed.scales, global_scale=gs, recipe=recipe)
    weight = dequantize_gptq(packed, dtype=torch.float32).double()  # (n, k), exact
    oracle = qdq.double() @ weight.T
    bound = w4a_nvfp4_linear_error_bound(
        a_codes, a_scales, gs, packed.qweight, packed.scales, None, output_dtype=torch.float32
    )
    qdq_rounding = (qdq.double().abs() @ weight.abs().T) * 2.0**-24
    assert bool(((out.double() - oracle).abs() <= bound.worst_case + qdq_rounding).all())
    # and the bound is not loose enough to take another recipe's activation
    other = nvfp4_block_qdq(x, gs, "four_six" if recipe != "four_six" else "nvidia")
    if not torch.equal(other, qdq):
        assert not bool(((out.double() - other.double() @ weight.T).abs()
                         <= bound.worst_case + qdq_rounding).all())  # fmt: skip


def test_a_zero_or_negative_token_scale_multiplies_as_it_is():
    """Any finite token scale is a plain factor (a carrier's rescale_tokens accepts any finite
    one): a zero row gives zeros (then the bias), a factor of -2 doubles and negates the row
    (power of two: exact)."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 128, generator=g)
    w = torch.randint(-8, 8, (128, 32), generator=g).float().to(torch.float8_e4m3fn)
    s = torch.rand(1, 32, generator=g) + 0.5
    bias = torch.randn(32, generator=g)
    codes, scales = nvfp4_pack_swizzled(x, 0.01)
    plain = w4a_nvfp4_linear_prepacked(codes, scales, 0.01, w, s, output_dtype=torch.float32)
    out = w4a_nvfp4_linear_prepacked(codes, scales, 0.01, w, s, bias,
                                     token_scale=torch.tensor([0.0, -2.0]),
                                     output_dtype=torch.float32)  # fmt: skip
    assert torch.equal(out[0], torch.zeros(32) + bias)
    assert torch.equal(out[1], plain[1] * -2.0 + bias)
