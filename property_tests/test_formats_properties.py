"""Properties of the name normalizers (SPEC §1)."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import floatxq as fq
from floatxq.testing.strategies import FP8_ALIASES, alias_spellings

ALL_FP8 = tuple(sorted(set(FP8_ALIASES.values())))


@given(alias_spellings(ALL_FP8))
def test_format_case_and_space_insensitive_and_idempotent(pair):
    spelling, canonical = pair
    name = fq.normalize_fp8_format(spelling)
    assert name == canonical
    assert fq.normalize_fp8_format(name) == name
    assert fq.fp8_dtype(spelling) is getattr(torch, canonical)
    assert fq.normalize_fp8_format(fq.fp8_dtype(spelling)) == canonical


@given(st.text(alphabet="abcdefmnoprstuxz0123456789_ ", min_size=1, max_size=12))
def test_unknown_format_names_list_the_accepted_ones(text):
    key = text.strip().lower()
    if key in FP8_ALIASES or key in ("", "fp8"):
        assert fq.normalize_fp8_format(text) in ALL_FP8
        return
    with pytest.raises(ValueError) as info:
        fq.normalize_fp8_format(text)
    message = str(info.value)
    assert repr(text) in message
    for alias in FP8_ALIASES:
        assert repr(alias) in message


@given(
    st.sampled_from(["tensor", "row", "block", None]),
    st.one_of(st.none(), st.tuples(st.integers(1, 512), st.integers(1, 512))),
    st.sampled_from(["", " ", "\t"]),
    st.booleans(),
)
def test_scale_method_resolution(method, block, pad, upper):
    spelled = None if method is None else pad + (method.upper() if upper else method) + pad
    consistent = (method == "block") == (block is not None) or method is None
    if not consistent:
        with pytest.raises(ValueError, match="weight_block_size"):
            fq.normalize_fp8_scale_method(spelled, weight_block_size=block)
        return
    got = fq.normalize_fp8_scale_method(spelled, weight_block_size=block)
    assert got == (method or ("block" if block is not None else "row"))
    assert fq.normalize_fp8_scale_method(got, weight_block_size=block) == got
    if block is not None:
        assert fq.normalize_fp8_block_size(list(block)) == block
        assert fq.normalize_fp8_block_size(fq.normalize_fp8_block_size(block)) == block


@given(
    st.fixed_dictionaries(
        {},
        optional={
            "fmt": st.sampled_from(sorted(FP8_ALIASES)),
            "format": st.sampled_from(
                sorted(a for a, c in FP8_ALIASES.items() if c != "float8_e8m0fnu")
            ),
            "weight_block_size": st.tuples(st.integers(1, 256), st.integers(1, 256)),
            "weight_only": st.fixed_dictionaries({"smooth": st.integers(0, 3)}),
            "bits": st.just(8),
        },
    )
)
def test_fp8_kwargs_normalization_is_idempotent(payload):
    before = dict(payload)
    once = fq.normalize_fp8_kwargs(payload)
    assert payload == before
    assert fq.normalize_fp8_kwargs(once) == once
    assert "fmt" not in once and "weight_only" not in once
    expected = payload.get("format", payload.get("fmt"))
    assert once["format"] == fq.normalize_fp8_format(expected)
    assert (once["weight_scale_method"] == "block") == ("weight_block_size" in payload)
    if "weight_only" in payload:
        assert once["smoother"] == payload["weight_only"]["smooth"]


@given(st.sampled_from(["lsq", "lsq_headroom", "lsq_grid", *fq.NVFP4_RECIPES]))
def test_recipe_normalization_idempotent(name):
    canonical = fq.normalize_nvfp4_recipe(name)
    assert fq.normalize_nvfp4_recipe(canonical) == canonical
    assert fq.nvfp4_kernel_recipe(fq.nvfp4_kernel_recipe(name)) == fq.nvfp4_kernel_recipe(name)
    assert not fq.nvfp4_uses_headroom(fq.nvfp4_kernel_recipe(name))
