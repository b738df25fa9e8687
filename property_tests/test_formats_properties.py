"""Properties of the name normalizers: every spelling maps to one canonical name, idempotently,
and every other value is refused with an error that lists the accepted names."""

import pytest
import torch
from hypothesis import example, given
from hypothesis import strategies as st

import floatxq as fq
from floatxq.testing.strategies import (
    FP8_ALIASES,
    GPTQ_FORMAT_NAMES,
    alias_spellings,
    gptq_format_spellings,
)

ALL_FP8 = tuple(sorted(set(FP8_ALIASES.values())))


@given(alias_spellings(ALL_FP8))
def test_format_case_and_space_insensitive_and_idempotent(pair):
    spelling, canonical = pair
    name = fq.normalize_fp8_format(spelling)
    assert name == canonical
    assert fq.normalize_fp8_format(name) == name
    assert fq.fp8_dtype(spelling) is getattr(torch, canonical)
    assert fq.normalize_fp8_format(fq.fp8_dtype(spelling)) == canonical
    assert fq.fp8_max(spelling) == float(torch.finfo(getattr(torch, canonical)).max)


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


LEGACY_RECIPES = {
    "lsq": "least_squares",
    "lsq_headroom": "least_squares_headroom",
    "lsq_grid": "least_squares_grid",
}
"""The legacy recipe aliases, written out independently of ``floatxq.formats``."""


@given(st.sampled_from(sorted(LEGACY_RECIPES) + list(fq.NVFP4_RECIPES)))
def test_recipe_names_resolve_to_a_local_algorithm_and_a_headroom_flag(name):
    canonical = fq.normalize_nvfp4_recipe(name)
    assert canonical == LEGACY_RECIPES.get(name, name)
    assert fq.normalize_nvfp4_recipe(canonical) == canonical
    # a recipe is its per-block algorithm, plus the headroom global scale when it is named so
    headroom = canonical.endswith("_headroom")
    assert fq.nvfp4_uses_headroom(name) is headroom
    local = fq.nvfp4_kernel_recipe(name)
    assert local == canonical.removesuffix("_headroom")
    assert fq.nvfp4_kernel_recipe(local) == local and not fq.nvfp4_uses_headroom(local)


@given(st.one_of(st.text(max_size=12), st.integers(), st.none()))
@example("NVIDIA")
@example("least_squares ")
def test_unknown_recipe_names_are_refused_with_the_accepted_ones(value):
    if isinstance(value, str) and (value in fq.NVFP4_RECIPES or value in LEGACY_RECIPES):
        return
    with pytest.raises(ValueError, match="Unsupported NVFP4 scale recipe") as info:
        fq.normalize_nvfp4_recipe(value)
    for name in (*fq.NVFP4_RECIPES, *LEGACY_RECIPES):
        assert repr(name) in str(info.value)


@given(gptq_format_spellings())
def test_gptq_format_case_and_space_insensitive_and_idempotent(pair):
    spelling, canonical = pair
    assert fq.normalize_gptq_format(spelling) == canonical
    assert fq.normalize_gptq_format(canonical) == canonical
    assert canonical in fq.GPTQ_FORMATS


@given(st.one_of(st.text(alphabet="gptqv_12 GPTQV", max_size=10), st.integers(), st.none()))
@example("gptq_v1")
@example(b"gptq")
def test_gptq_format_refuses_other_values_naming_the_argument(value):
    if isinstance(value, str) and value.strip().lower() in GPTQ_FORMAT_NAMES:
        return
    error = ValueError if isinstance(value, str) else TypeError
    with pytest.raises(error) as info:
        fq.normalize_gptq_format(value, where="pack_gptq_int4", name="format")
    message = str(info.value)
    assert message.startswith("pack_gptq_int4: format") and "'gptq_v2'" in message
