"""W4A operands: the centered INT4 weight read from either operand, one group of the W4A-NVFP4 GEMM
folded into the running sum, and the backend a saved activation policy binds."""

import hypothesis.extra.numpy as hnp
import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import floatxq as fq
from floatxq.testing import assert_bitwise_equal
from floatxq.testing.strategies import int32_words

SIZES = st.integers(1, 4)


@given(SIZES.flatmap(lambda words: SIZES.flatmap(lambda n: int32_words((words, n)))))
def test_centered_weight_of_words_is_each_nibble_minus_eight(words):
    got = fq.centered_weight(words)
    k, n = 8 * words.shape[0], words.shape[1]
    assert got.dtype == torch.float32 and got.shape == (k, n)
    # an independent oracle: row r is nibble r % 8 of word r // 8, as unsigned 32-bit numbers
    unsigned = words.numpy().astype(np.int64) & 0xFFFFFFFF
    rows = np.arange(k)
    nibbles = (unsigned[rows // 8] >> (4 * (rows % 8))[:, None]) & 0xF
    np.testing.assert_array_equal(got.numpy(), (nibbles - 8).astype(np.float32))
    # the staged E4M3 operand holding those integers reads back the same (-8..7 are exact)
    assert_bitwise_equal(fq.centered_weight(got.to(torch.float8_e4m3fn)), got)


def _small_ints(shape):
    """Float tensors of small integers: every FP32 operation on them below is exact."""
    return hnp.arrays(np.int32, shape, elements=st.integers(-64, 64)).map(
        lambda a: torch.from_numpy(a).to(torch.float32)
    )


@st.composite
def groups(draw):
    m, n, count = draw(SIZES), draw(SIZES), draw(st.integers(1, 3))
    both = [draw(_small_ints((m, 2 * n))) for _ in range(count)]
    scales = [draw(_small_ints((n,))) / 8 for _ in range(count)]  # eighths: still exact
    return both, scales


@given(groups(), st.sampled_from([0.5, 1.0, 2.0**-3]))
def test_accumulate_group_folds_low_plus_four_high_times_the_group_scale(case, g):
    both, scales = case
    n = scales[0].shape[0]
    acc = None
    for i, (b, s) in enumerate(zip(both, scales, strict=True)):
        last = i == len(both) - 1
        acc = fq.w4a_nvfp4_accumulate_group(b, s, acc, last=last, global_scale=g if last else None)
    # on small integers and eighths every product and sum is exact: the fold is the math
    exact = sum((b[:, :n] + 4 * b[:, n:]) * s for b, s in zip(both, scales, strict=True)) * g
    assert_bitwise_equal(acc, exact)


@given(groups(), st.sampled_from([torch.float32, torch.bfloat16, torch.float16]))
def test_accumulate_group_last_applies_token_scale_and_bias_then_rounds_once(case, dtype):
    both, scales = case
    b, s = both[0], scales[0]
    m, n = b.shape[0], s.shape[0]
    token = torch.arange(1, m + 1, dtype=torch.float32) / 4
    bias = torch.arange(n, dtype=torch.float32) - 1
    running = fq.w4a_nvfp4_accumulate_group(b, s)
    got = fq.w4a_nvfp4_accumulate_group(
        b, s, None, last=True, global_scale=2.0, token_scale=token, bias=bias, output_dtype=dtype
    )
    assert got.dtype == dtype and got.shape == (m, n)
    assert_bitwise_equal(got, ((running * 2.0) * token[:, None] + bias).to(dtype))


ACTIVATIONS = st.sampled_from(
    [
        fq.ActivationConfig(mode="w4afp8"),
        fq.ActivationConfig(mode="w4a_nvfp4"),
        fq.ActivationConfig(mode="w4a_nvfp4", recipe="exhaustive"),
    ]
)
SPELLING = st.sampled_from(["", " ", "\t"]).flatmap(
    lambda pad: st.booleans().map(lambda up: (pad, up))
)


def _spelled(backend: fq.BACKEND, spelling) -> str:
    pad, upper = spelling
    return pad + (backend.value.upper() if upper else backend.value) + pad


@given(ACTIVATIONS, SPELLING)
def test_backend_for_activation_binds_the_policy_backend(activation, spelling):
    bound = fq.BACKEND.GPTQ_W4AFP8 if activation.mode == "w4afp8" else fq.BACKEND.GPTQ_W4A_NVFP4
    assert fq.backend_for_activation(activation) is bound
    assert fq.backend_for_activation(activation, _spelled(fq.BACKEND.AUTO, spelling)) is bound
    assert fq.backend_for_activation(activation, _spelled(bound, spelling)) is bound
    # idempotent: the bound backend asked for again binds the same
    assert fq.backend_for_activation(activation, fq.backend_for_activation(activation)) is bound


@given(ACTIVATIONS, st.sampled_from(list(fq.BACKEND)))
def test_backend_for_activation_refuses_any_other_backend(activation, backend):
    bound = fq.backend_for_activation(activation)
    if backend in (fq.BACKEND.AUTO, bound):
        return
    with pytest.raises(ValueError, match="backend_for_activation: a checkpoint"):
        fq.backend_for_activation(activation, backend)


@given(st.sampled_from(list(fq.BACKEND)), SPELLING)
def test_backend_for_activation_without_a_policy_normalizes_the_name(backend, spelling):
    assert fq.backend_for_activation(None, _spelled(backend, spelling)) is backend
    assert fq.backend_for_activation(None) is None
