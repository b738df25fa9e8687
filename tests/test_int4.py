"""GPTQ INT4 packing, centering and W4A staging (GPT-QModel's layout, ``docs/numerics.md``).

Expected words come from plain Python integer arithmetic (an oracle that shares no code with the
library) or from tables and words written out by hand.
"""

import ml_dtypes
import numpy as np
import pytest
import torch

import floatxq as fq
from floatxq.formats import E2M1_VALUES
from floatxq.testing import assert_bitwise_equal, unchecked

FORMATS = ["gptq", "gptq_v2"]


def _signed(word: int) -> int:
    """An unsigned 32-bit word as the int32 value with the same bits."""
    word %= 1 << 32
    return word - (1 << 32) if word >= 1 << 31 else word


def _word(nibbles: list[int]) -> int:
    """Eight 4-bit values, the first in the lowest nibble, as a signed int32 value."""
    assert len(nibbles) == 8
    return _signed(sum(v << (4 * i) for i, v in enumerate(nibbles)))


def _every_code_everywhere(rows: int, cols: int) -> torch.Tensor:
    """``(rows, cols)`` codes in which every value 0..15 meets every nibble position."""
    k = torch.arange(rows)[:, None]
    n = torch.arange(cols)[None, :]
    return ((k + n) % 16).to(torch.int32)


def _packed_inputs(rows: int = 128, out: int = 16, groups: int = 1):
    codes = _every_code_everywhere(rows, out)
    zeros = _every_code_everywhere(groups, out)
    scales = torch.linspace(0.01, 2.0, groups * out).reshape(groups, out)
    g_idx = torch.arange(rows, dtype=torch.int32) * groups // rows
    return codes, zeros, scales, g_idx


# ------------------------------------------------------------------------------------------------
# pack / unpack
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("format", FORMATS)
def test_every_code_in_every_nibble_position_packs_like_python_ints(format):
    codes, zeros, scales, g_idx = _packed_inputs(rows=128, out=16, groups=16)
    packed = fq.pack_gptq(codes, zeros, scales, g_idx, format=format)
    assert packed.qweight.dtype == torch.int32 and packed.qweight.shape == (16, 16)
    expected = [
        [_word([int(codes[8 * i + p, n]) for p in range(8)]) for n in range(16)] for i in range(16)
    ]
    assert packed.qweight.tolist() == expected
    # every (code, position) pair really occurs: the test is exhaustive
    pairs = {(int(codes[k, n]), k % 8) for k in range(128) for n in range(16)}
    assert len(pairs) == 16 * 8
    unpacked = fq.unpack_gptq(packed, format=format)
    assert unpacked.codes.dtype == torch.uint8
    assert torch.equal(unpacked.codes.to(torch.int32), codes)


@pytest.mark.parametrize("format", FORMATS)
def test_every_zero_in_every_nibble_position_round_trips(format):
    codes, zeros, scales, g_idx = _packed_inputs(rows=128, out=16, groups=16)
    packed = fq.pack_gptq(codes, zeros, scales, g_idx, format=format)
    assert packed.qzeros.shape == (16, 2)
    v2 = [
        [_word([int(zeros[g, 8 * j + p]) for p in range(8)]) for j in range(2)] for g in range(16)
    ]
    offset = 0x11111111 if format == "gptq" else 0  # v1 stores the words minus 0x11111111
    assert packed.qzeros.tolist() == [[_signed(w - offset) for w in row] for row in v2]
    unpacked = fq.unpack_gptq(packed, format=format)
    assert torch.equal(unpacked.zeros.to(torch.int32), zeros)  # zero point 0 survives v1 too


def test_top_nibble_words_by_hand():
    codes = torch.zeros(8, 8, dtype=torch.int32)
    codes[7, 0] = 15  # bits 28..31: 0xF0000000
    codes[:, 1] = 15  # 0xFFFFFFFF
    codes[0, 2] = 15  # 0x0000000F
    codes[7, 3] = 8  # 0x80000000, the most negative int32
    codes[:, 4] = torch.arange(8)  # 0x76543210
    packed = fq.pack_gptq(
        codes, torch.full((1, 8), 8), torch.ones(1, 8), torch.zeros(8, dtype=torch.int32)
    )
    assert packed.qweight[0, :5].tolist() == [-268435456, -1, 15, -(2**31), 0x76543210]
    assert torch.equal(fq.unpack_gptq(packed).codes.to(torch.int32), codes)


def test_symmetric_zero_words_are_the_reference_words():
    # GPT-QModel: symmetric 4-bit is 0x88888888 in memory (v2) and 0x77777777 on disk (v1)
    args = (torch.zeros(8, 16, dtype=torch.int32), torch.full((1, 16), 8), torch.ones(1, 16))
    g_idx = torch.zeros(8, dtype=torch.int32)
    v2 = fq.pack_gptq(*args, g_idx, format="gptq_v2").qzeros
    v1 = fq.pack_gptq(*args, g_idx, format="gptq").qzeros
    assert v2.tolist() == [[_signed(0x88888888)] * 2]
    assert v1.tolist() == [[0x77777777] * 2]


@pytest.mark.parametrize(("source", "target"), [("gptq", "gptq_v2"), ("gptq_v2", "gptq")])
def test_convert_equals_packing_in_the_target_format(source, target):
    codes, zeros, scales, g_idx = _packed_inputs(rows=64, out=16, groups=16)
    g_idx = torch.arange(64, dtype=torch.int32) // 4
    src = fq.pack_gptq(codes, zeros, scales, g_idx, format=source)
    dst = fq.pack_gptq(codes, zeros, scales, g_idx, format=target)
    got = fq.convert_gptq_format(src, source=source, target=target)
    for a, b in zip(got, dst, strict=True):
        assert_bitwise_equal(a, b)
    back = fq.convert_gptq_format(got, source=target, target=source)
    for a, b in zip(back, src, strict=True):
        assert_bitwise_equal(a, b)
    same = fq.convert_gptq_format(src, source=source, target=source)
    assert same.qzeros is not src.qzeros and torch.equal(same.qzeros, src.qzeros)


def test_scales_are_stored_as_float16_rounded_to_nearest():
    # scales fp16 cannot hold (flushed to 0 or overflowing) are refused: tests/test_hostile_pure.py
    codes = torch.zeros(8, 8, dtype=torch.int32)
    scales = torch.tensor([[1e-3, 1.0, 3.0, 65504.0, 65519.0, -65519.0, 2.0**-24, 0.1]])
    packed = fq.pack_gptq(codes, torch.full((1, 8), 8), scales, torch.zeros(8, dtype=torch.int32))
    assert packed.scales.dtype == torch.float16
    expected = np.array([1e-3, 1.0, 3.0, 65504.0, 65504.0, -65504.0, 2.0**-24, 0.1])
    assert packed.scales[0].tolist() == expected.astype(np.float16).astype(float).tolist()
    assert packed.g_idx.dtype == torch.int32


def test_inputs_are_not_mutated_and_g_idx_dtype_is_kept_as_int32():
    codes, zeros, scales, g_idx = _packed_inputs(rows=16, out=8, groups=2)
    g_idx = g_idx.to(torch.int64)
    before = [t.clone() for t in (codes, zeros, scales, g_idx)]
    packed = fq.pack_gptq(codes, zeros, scales, g_idx)
    for t, b in zip((codes, zeros, scales, g_idx), before, strict=True):
        assert_bitwise_equal(t, b)
    assert packed.g_idx.tolist() == [0] * 8 + [1] * 8


@pytest.mark.parametrize(
    ("change", "error", "match"),
    [
        (lambda a: {**a, "codes": a["codes"].float()}, TypeError, "codes must be an integer"),
        (lambda a: {**a, "zeros": a["zeros"].bool()}, TypeError, "zeros must be an integer"),
        (lambda a: {**a, "scales": a["scales"].int()}, TypeError, "scales must be a floating"),
        (lambda a: {**a, "codes": a["codes"] + 16}, ValueError, r"codes must lie in \[0, 15\]"),
        (lambda a: {**a, "codes": a["codes"] - 1}, ValueError, "codes must lie"),
        (lambda a: {**a, "zeros": a["zeros"] * 0 + 16}, ValueError, "zeros must lie"),
        (lambda a: {**a, "g_idx": a["g_idx"] + 5}, ValueError, "g_idx must lie"),
        (lambda a: {**a, "codes": a["codes"][:12]}, ValueError, "g_idx must have shape"),
        (lambda a: {**a, "scales": a["scales"][:, :4]}, ValueError, "scales must have shape"),
        (lambda a: {**a, "scales": a["scales"] * torch.nan}, ValueError, "NaN or infinity"),
        (lambda a: {**a, "format": "gptq_v3"}, ValueError, "accepted: 'gptq'"),
        (lambda a: {**a, "format": 2}, TypeError, "format must be a str"),
    ],
)
def test_pack_rejects_bad_arguments(change, error, match):
    codes, zeros, scales, g_idx = _packed_inputs(rows=16, out=8, groups=2)
    args = change(dict(codes=codes, zeros=zeros, scales=scales, g_idx=g_idx, format="gptq"))
    with pytest.raises(error, match=match):
        unchecked(fq.pack_gptq)(
            args["codes"], args["zeros"], args["scales"], args["g_idx"], format=args["format"]
        )


@pytest.mark.parametrize(("rows", "out"), [(12, 8), (16, 12)])
def test_pack_needs_multiples_of_eight(rows, out):
    with pytest.raises(ValueError, match="multiples of 8"):
        fq.pack_gptq(
            torch.zeros(rows, out, dtype=torch.int32),
            torch.full((1, out), 8),
            torch.ones(1, out),
            torch.zeros(rows, dtype=torch.int32),
        )


def test_unpack_rejects_inconsistent_records():
    codes, zeros, scales, g_idx = _packed_inputs(rows=16, out=8, groups=2)
    packed = fq.pack_gptq(codes, zeros, scales, g_idx)
    with pytest.raises(ValueError, match="g_idx must have shape"):
        fq.unpack_gptq(packed._replace(g_idx=g_idx[:8]))
    with pytest.raises(TypeError, match="must be int32"):
        fq.unpack_gptq(packed._replace(qweight=packed.qweight.to(torch.int64)))
    with pytest.raises(TypeError, match="g_idx must be int32"):
        unchecked(fq.unpack_gptq)(packed._replace(g_idx=packed.g_idx.to(torch.int64)))
    with pytest.raises(TypeError, match="GPTQPacked"):
        fq.unpack_gptq((packed.qweight, packed.qzeros))
    with pytest.raises(ValueError, match="source="):
        fq.convert_gptq_format(packed, source="v1", target="gptq")


# ------------------------------------------------------------------------------------------------
# centering
# ------------------------------------------------------------------------------------------------


def _symmetric_g128(rows: int = 256, out: int = 16, format: str = "gptq"):
    codes = _every_code_everywhere(rows, out)
    groups = rows // 128
    g_idx = torch.arange(rows, dtype=torch.int32) // 128
    zeros = torch.full((groups, out), 8)
    scales = torch.ones(groups, out)
    return codes, fq.pack_gptq(codes, zeros, scales, g_idx, format=format)


@pytest.mark.parametrize("format", FORMATS)
def test_centered_is_code_minus_eight(format):
    codes, packed = _symmetric_g128(format=format)
    centered = fq.centered_int4(packed, format=format)
    assert centered.dtype == torch.int16 and centered.shape == (256, 16)
    assert torch.equal(centered.to(torch.int32), codes - 8)
    assert int(centered.min()) == -8 and int(centered.max()) == 7


def test_centered_rejects_desc_act_order_and_other_group_sizes():
    codes, packed = _symmetric_g128()
    shuffled = packed._replace(g_idx=packed.g_idx.flip(0).contiguous())
    with pytest.raises(ValueError, match=r"arange\(in\) // 128"):
        fq.centered_int4(shuffled)
    g64 = fq.pack_gptq(
        codes,
        torch.full((4, 16), 8),
        torch.ones(4, 16),
        torch.arange(256, dtype=torch.int32) // 64,
    )
    with pytest.raises(ValueError, match="contiguous GPTQ groups of 128"):
        fq.centered_int4(g64)
    with pytest.raises(ValueError, match="multiple of 128"):
        fq.centered_int4(
            fq.pack_gptq(codes[:64], torch.full((1, 16), 8), torch.ones(1, 16), packed.g_idx[:64])
        )


@pytest.mark.parametrize("format", FORMATS)
def test_centered_rejects_asymmetric_zero_points(format):
    codes = _every_code_everywhere(128, 16)
    zeros = torch.full((1, 16), 8)
    zeros[0, 5] = 7
    packed = fq.pack_gptq(
        codes, zeros, torch.ones(1, 16), torch.zeros(128, dtype=torch.int32), format=format
    )
    with pytest.raises(ValueError, match="column 5 has zero point 7"):
        fq.centered_int4(packed, format=format)


def test_centered_reads_v1_zeros_with_the_wrong_format_as_an_error():
    _, packed = _symmetric_g128(format="gptq")  # words 0x77777777
    with pytest.raises(ValueError, match="zero point 7"):
        fq.centered_int4(packed, format="gptq_v2")


# ------------------------------------------------------------------------------------------------
# two planes and staging (exhaustive)
# ------------------------------------------------------------------------------------------------

# the two-plane table of docs/numerics.md, written out by hand (c = -8..7)
TABLE_HIGH = [-2, -2, -1, -1, -1, -1, 0, 0, 0, 0, 1, 1, 1, 1, 2, 2]
TABLE_LOW = [0, 1, -2, -1, 0, 1, -2, -1, 0, 1, -2, -1, 0, 1, -2, -1]


@pytest.mark.parametrize("dtype", [torch.int16, torch.int8, torch.int32, torch.int64])
def test_split_matches_the_reference_table_for_every_value(dtype):
    c = torch.arange(-8, 8, dtype=dtype)
    low, high = fq.split_int4_planes(c)
    assert low.dtype == dtype and high.dtype == dtype
    assert high.tolist() == TABLE_HIGH
    assert low.tolist() == TABLE_LOW
    assert torch.equal(fq.merge_int4_planes(low, high), c)


def test_split_of_unsigned_input_gives_int16():
    low, high = fq.split_int4_planes(torch.arange(0, 8, dtype=torch.uint8))
    assert low.dtype == torch.int16 and high.tolist() == TABLE_HIGH[8:]


def test_split_and_merge_reject_values_out_of_range():
    with pytest.raises(ValueError, match=r"c must lie in \[-8, 7\]"):
        fq.split_int4_planes(torch.tensor([8], dtype=torch.int16))
    with pytest.raises(TypeError, match="integer"):
        unchecked(fq.split_int4_planes)(torch.tensor([1.0]))
    with pytest.raises(ValueError, match=r"high must lie in \[-2, 2\]"):
        fq.merge_int4_planes(torch.tensor([0]), torch.tensor([3]))
    with pytest.raises(ValueError, match=r"low must lie in \[-2, 1\]"):
        fq.merge_int4_planes(torch.tensor([2]), torch.tensor([0]))
    with pytest.raises(ValueError, match="low \\+ 4 \\* high"):  # (1, 2) is no split's output
        fq.merge_int4_planes(torch.tensor([1]), torch.tensor([2]))


def _decode_e2m1_nibble(nibble: int) -> float:
    """An independent E2M1 decode: bit 3 is the sign, bits 0..2 index E2M1_VALUES."""
    value = E2M1_VALUES[nibble & 7]
    return -value if nibble & 8 else value


def test_e2m1_staging_of_every_pair_of_centered_values():
    # K = 2 (one byte per plane and column), N = 256 columns: every (even, odd) pair of values
    values = torch.arange(-8, 8, dtype=torch.int16)
    pairs = torch.cartesian_prod(values, values).T.contiguous()  # (2, 256)
    low, high = fq.split_int4_planes(pairs)
    staged = fq.int4_planes_to_e2m1(low, high)
    assert staged.low.dtype == torch.uint8 and staged.low.shape == (1, 256)
    for n in range(256):
        for k in range(2):  # even K in the low nibble
            lo_nibble = (int(staged.low[0, n]) >> (4 * k)) & 0xF
            hi_nibble = (int(staged.high[0, n]) >> (4 * k)) & 0xF
            decoded = _decode_e2m1_nibble(lo_nibble) + 4 * _decode_e2m1_nibble(hi_nibble)
            assert decoded == float(pairs[k, n]), (n, k)


def test_e2m1_plane_codes_are_the_reference_codes():
    # E2M1 codes: |v| 0→0, 1→2, 2→4, sign bit 3 for v < 0; even K index in the low nibble
    low = torch.tensor([[-2, -1, 0, 1, 0], [0, 0, 0, 0, 0]], dtype=torch.int16)
    high = torch.tensor([[-2, -1, 0, 1, 2], [2, 2, 2, 2, 1]], dtype=torch.int16)
    staged = fq.int4_planes_to_e2m1(low, high)
    assert staged.low.tolist() == [[0xC, 0xA, 0x0, 0x2, 0x0]]
    assert staged.high.tolist() == [[0x4C, 0x4A, 0x40, 0x42, 0x24]]


def test_e2m1_staging_rejects_odd_k_and_inexact_values():
    with pytest.raises(ValueError, match="must be even"):
        fq.int4_planes_to_e2m1(torch.zeros(3, 2, dtype=torch.int16), torch.zeros(3, 2).short())
    with pytest.raises(ValueError, match="exactly"):
        fq.int4_planes_to_e2m1(torch.tensor([[5], [0]]), torch.tensor([[0], [0]]))
    with pytest.raises(ValueError, match="one shape"):
        unchecked(fq.int4_planes_to_e2m1)(torch.zeros(2, 2).int(), torch.zeros(2, 3).int())


def test_e4m3_staging_of_every_centered_value_is_exact():
    c = torch.arange(-8, 8, dtype=torch.int16)
    staged = fq.int4_to_e4m3(c)
    assert staged.dtype == torch.float8_e4m3fn
    expected = np.arange(-8, 8, dtype=np.float32).astype(ml_dtypes.float8_e4m3fn).view(np.uint8)
    assert staged.view(torch.uint8).tolist() == expected.tolist()
    assert staged.float().tolist() == [float(v) for v in range(-8, 8)]
    with pytest.raises(ValueError, match="c must lie"):
        fq.int4_to_e4m3(torch.tensor([-9]))
