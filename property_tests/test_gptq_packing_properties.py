"""Properties of GPTQ packing for 2, 4 and 8 bits: pack and unpack are inverse bijections, and
decoding is the per-element formula ``scale[g_idx[k], o] * (code[k, o] - zero[g_idx[k], o])``.

Every tensor is built from Hypothesis draws, so a failure shrinks to a small example.
"""

from typing import Any, NamedTuple

import numpy as np
import torch
from hypothesis import example, given
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import floatxq as fq
from floatxq.testing import assert_bitwise_equal
from floatxq.testing.strategies import GPTQ_FORMAT_NAMES, int32_words, int_arrays

BITS = st.sampled_from([2, 4, 8])
FORMATS = st.sampled_from(GPTQ_FORMAT_NAMES)
FINITE16 = st.floats(-65504, 65504, width=16, allow_nan=False, allow_infinity=False)


class Record(NamedTuple):
    bits: int
    codes: torch.Tensor  # (in, out) 0..2**bits-1
    zeros: torch.Tensor  # (groups, out)
    scales: torch.Tensor  # float16 (groups, out)
    g_idx: torch.Tensor  # int32 (in,)


@st.composite
def records(
    draw: Any, *, bits: int | None = None, max_words: int = 4, max_out_words: int = 3
) -> Record:
    """Valid ``pack_gptq`` input for ``bits`` (drawn when ``None``): sizes are multiples of
    ``32 / bits``."""
    bits = draw(BITS) if bits is None else bits
    per = 32 // bits
    rows = per * draw(st.integers(1, max_words))
    out = per * draw(st.integers(1, max_out_words))
    groups = draw(st.integers(1, min(rows, 8)))
    top = (1 << bits) - 1
    dtype = draw(st.sampled_from([torch.uint8, torch.int16, torch.int32, torch.int64]))
    codes = draw(int_arrays((rows, out), 0, top, dtype=dtype))
    zeros = draw(int_arrays((groups, out), 0, top, dtype=dtype))
    scales = torch.from_numpy(
        draw(hnp.arrays(np.float16, (groups, out), elements=FINITE16, fill=FINITE16))
    )
    g_idx = draw(int_arrays((rows,), 0, groups - 1, dtype=torch.int32))
    return Record(bits, codes, zeros, scales, g_idx)


@st.composite
def packed_words(draw: Any) -> tuple[int, fq.GPTQPacked]:
    """``(bits, GPTQPacked)`` whose ``qweight`` / ``qzeros`` words hold arbitrary bits."""
    bits = draw(BITS)
    per = 32 // bits
    words = draw(st.integers(1, 3))
    out = per * draw(st.integers(1, 3))
    groups = draw(st.integers(1, min(per * words, 8)))
    scales = torch.from_numpy(
        draw(hnp.arrays(np.float16, (groups, out), elements=FINITE16, fill=FINITE16))
    )
    return bits, fq.GPTQPacked(
        draw(int32_words((words, out))),
        draw(int32_words((groups, out // per))),
        scales,
        draw(int_arrays((per * words,), 0, groups - 1, dtype=torch.int32)),
    )


def _symmetric(bits: int) -> Record:
    """Every code at the top, every zero at ``2**(bits-1)``, one group."""
    per = 32 // bits
    return Record(
        bits,
        torch.full((per, per), (1 << bits) - 1),
        torch.full((1, per), 1 << (bits - 1)),
        torch.full((1, per), 65504.0).half(),
        torch.zeros(per, dtype=torch.int32),
    )


def _zero_zeros(bits: int) -> Record:
    """Zero points of 0: v1 cannot store them, the word borrows (and comes back)."""
    per = 32 // bits
    return Record(
        bits,
        torch.zeros((per, per), dtype=torch.int64),
        torch.zeros((1, per), dtype=torch.int64),
        torch.ones(1, per).half(),
        torch.zeros(per, dtype=torch.int32),
    )


def _pack(record: Record, format: str) -> fq.GPTQPacked:
    return fq.pack_gptq(
        record.codes, record.zeros, record.scales, record.g_idx, bits=record.bits, format=format
    )


@given(records(), FORMATS)
@example(_zero_zeros(2), "gptq")
@example(_zero_zeros(8), "gptq")
@example(_symmetric(8), "gptq")
def test_pack_then_unpack_is_the_identity(record, format):
    u = fq.unpack_gptq(_pack(record, format), bits=record.bits, format=format)
    assert u.codes.tolist() == record.codes.tolist()
    assert u.zeros.tolist() == record.zeros.tolist()
    assert_bitwise_equal(u.scales, record.scales)
    assert_bitwise_equal(u.g_idx, record.g_idx)


@given(packed_words(), FORMATS)
def test_unpack_then_pack_gives_the_same_words(case, format):
    bits, packed = case
    u = fq.unpack_gptq(packed, bits=bits, format=format)
    again = fq.pack_gptq(u.codes, u.zeros, u.scales, u.g_idx, bits=bits, format=format)
    for a, b in zip(again, packed, strict=True):
        assert_bitwise_equal(a, b)


@given(records())
def test_each_code_sits_in_its_field(record):
    # field (k % per) of word (k // per) holds row k: read with Python integers, not the library
    packed = _pack(record, "gptq_v2")
    bits, per = record.bits, 32 // record.bits
    words = packed.qweight.tolist()
    codes = record.codes.tolist()
    for k, row in enumerate(codes):
        for o, code in enumerate(row):
            word = words[k // per][o] % (1 << 32)
            assert (word >> (bits * (k % per))) & ((1 << bits) - 1) == code


@given(records())
@example(_zero_zeros(2))
@example(_zero_zeros(4))
def test_v1_words_are_v2_words_minus_one_per_field(record):
    v1 = _pack(record, "gptq").qzeros.tolist()
    v2 = _pack(record, "gptq_v2").qzeros.tolist()
    ones = sum(1 << shift for shift in range(0, 32, record.bits))
    for row1, row2 in zip(v1, v2, strict=True):
        for w1, w2 in zip(row1, row2, strict=True):
            assert w1 % (1 << 32) == (w2 - ones) % (1 << 32)


@given(records(), FORMATS)
@example(_symmetric(8), "gptq")
@example(_symmetric(2), "gptq_v2")
def test_dequantize_is_the_per_element_formula(record, format):
    w = fq.dequantize_gptq(_pack(record, format), bits=record.bits, format=format)
    codes, zeros = record.codes.tolist(), record.zeros.tolist()
    scales, g_idx = record.scales.tolist(), record.g_idx.tolist()
    expected = [
        [scales[g_idx[k]][o] * (codes[k][o] - zeros[g_idx[k]][o]) for k in range(len(codes))]
        for o in range(len(codes[0]))
    ]  # Python floats (binary64): exact products of float16 scales and small integers
    assert w.shape == (len(expected), len(codes)) and w.dtype == torch.float32
    assert w.double().tolist() == expected


@given(records(), FORMATS, st.sampled_from([torch.bfloat16, torch.float16]))
def test_dequantize_rounds_once_and_ignores_the_format(record, format, dtype):
    reference = fq.dequantize_gptq(_pack(record, "gptq_v2"), bits=record.bits, format="gptq_v2")
    w = fq.dequantize_gptq(_pack(record, format), bits=record.bits, format=format, dtype=dtype)
    assert_bitwise_equal(w, reference.to(dtype))


@given(records(bits=4), FORMATS)
def test_bits_defaults_to_4(record, format):
    general = _pack(record, format)
    int4 = fq.pack_gptq(record.codes, record.zeros, record.scales, record.g_idx, format=format)
    for a, b in zip(general, int4, strict=True):
        assert_bitwise_equal(a, b)
    for a, b in zip(
        fq.unpack_gptq(general, bits=4, format=format),
        fq.unpack_gptq(general, format=format),
        strict=True,
    ):
        assert_bitwise_equal(a, b)
