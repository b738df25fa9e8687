"""Format names, aliases, constants and recipe names (the tables of ``docs/numerics.md``)."""

import enum
import typing

import pytest
import torch

import floatxq as fq
import floatxq.formats as formats

ALIAS_TABLE = [
    ("e4m3", "float8_e4m3fn"),
    ("float8_e4m3", "float8_e4m3fn"),
    ("float8_e4m3fn", "float8_e4m3fn"),
    ("e5m2", "float8_e5m2"),
    ("float8_e5m2", "float8_e5m2"),
    ("e4m3fnuz", "float8_e4m3fnuz"),
    ("float8_e4m3fnuz", "float8_e4m3fnuz"),
    ("e5m2fnuz", "float8_e5m2fnuz"),
    ("float8_e5m2fnuz", "float8_e5m2fnuz"),
    ("e8m0", "float8_e8m0fnu"),
    ("e8m0fnu", "float8_e8m0fnu"),
    ("float8_e8m0", "float8_e8m0fnu"),
    ("float8_e8m0fnu", "float8_e8m0fnu"),
    (None, "float8_e4m3fn"),
    ("", "float8_e4m3fn"),
    ("fp8", "float8_e4m3fn"),
    (" FP8 ", "float8_e4m3fn"),
    ("  E5M2\t", "float8_e5m2"),
    (torch.float8_e5m2, "float8_e5m2"),
]


@pytest.mark.parametrize(("value", "canonical"), ALIAS_TABLE)
def test_normalize_fp8_format_table(value, canonical):
    assert fq.normalize_fp8_format(value) == canonical
    assert fq.fp8_dtype(value) is getattr(torch, canonical)


class _Other(str, enum.Enum):
    GPTQ = "gptq"


@pytest.mark.parametrize("bad", ["e4m3fnx", "float16", "nvfp4", "gptq", _Other.GPTQ, "int8"])
def test_normalize_fp8_format_unknown_lists_accepted(bad):
    with pytest.raises(ValueError, match="Accepted names: .*'e4m3'.*'float8_e5m2'"):
        fq.normalize_fp8_format(bad)


def test_normalize_fp8_format_wrong_kind():
    with pytest.raises(TypeError, match="format must be a string"):
        fq.normalize_fp8_format(8)


def test_fp8_max_values():
    assert [fq.fp8_max(n) for n in fq.FP8_FORMATS] == [448.0, 57344.0, 240.0, 57344.0, 2.0**127]


def test_constants():
    assert fq.FP8_E4M3_MAX == 448.0 and fq.FP4_E2M1_MAX == 6.0
    assert fq.E2M1_VALUES == (0, 0.5, 1, 1.5, 2, 3, 4, 6)
    assert fq.NVFP4_BLOCK == 16 and fq.NVFP4_E4M3_SEARCH_RADIUS == 8
    assert (fq.NVFP4_SCALE_MIN, fq.NVFP4_SCALE_MAX) == (2.0**-9, 448.0)
    # 2**-9 is the smallest positive E4M3 value, 448 the largest
    e4m3 = torch.tensor([1, 0x7E], dtype=torch.uint8).view(torch.float8_e4m3fn).float().tolist()
    assert e4m3 == [fq.NVFP4_SCALE_MIN, fq.NVFP4_SCALE_MAX]


@pytest.mark.parametrize(
    ("value", "expected"),
    [(None, None), ([128, 128], (128, 128)), ((1, 32), (1, 32)), ([2.0, 4], (2, 4))],
)
def test_normalize_fp8_block_size(value, expected):
    assert fq.normalize_fp8_block_size(value) == expected


@pytest.mark.parametrize(
    "bad", [[128], (1, 2, 3), [0, 128], [-1, 4], [True, 4], [1.5, 2], "128", 128]
)
def test_normalize_fp8_block_size_rejects(bad):
    with pytest.raises(ValueError, match="weight_block_size"):
        fq.normalize_fp8_block_size(bad)


@pytest.mark.parametrize(
    ("method", "block", "expected"),
    [
        (None, None, "row"),
        (None, [128, 128], "block"),
        ("TENSOR", None, "tensor"),
        (" row ", None, "row"),
        ("Block", (64, 64), "block"),
    ],
)
def test_normalize_fp8_scale_method(method, block, expected):
    assert fq.normalize_fp8_scale_method(method, weight_block_size=block) == expected


@pytest.mark.parametrize(
    ("method", "block", "match"),
    [
        ("block", None, "needs weight_block_size"),
        ("row", [128, 128], "only valid with weight_scale_method='block'"),
        ("tensor", [1, 1], "only valid with"),
        ("channel", None, "expected one of 'tensor', 'row', 'block'"),
        (3, None, "expected one of"),
    ],
)
def test_normalize_fp8_scale_method_rejects(method, block, match):
    with pytest.raises(ValueError, match=match):
        fq.normalize_fp8_scale_method(method, weight_block_size=block)


def test_normalize_fp8_scale_semantics():
    assert fq.normalize_fp8_scale_semantics(None) == "inverse"
    assert fq.normalize_fp8_scale_semantics(" INVERSE ") == "inverse"
    for bad in ("direct", "scale", 1):
        with pytest.raises(ValueError, match="weight_scale_semantics"):
            fq.normalize_fp8_scale_semantics(bad)


RECIPES = [
    ("nvidia", "nvidia", False),
    ("nvidia_headroom", "nvidia", True),
    ("four_six", "four_six", False),
    ("least_squares", "least_squares", False),
    ("least_squares_headroom", "least_squares", True),
    ("least_squares_grid", "least_squares_grid", False),
    ("exhaustive", "exhaustive", False),
    ("lsq", "least_squares", False),
    ("lsq_headroom", "least_squares", True),
    ("lsq_grid", "least_squares_grid", False),
]


@pytest.mark.parametrize(("name", "local", "headroom"), RECIPES)
def test_nvfp4_recipe_names(name, local, headroom):
    canonical = fq.normalize_nvfp4_recipe(name)
    assert canonical in fq.NVFP4_RECIPES
    assert fq.nvfp4_kernel_recipe(name) == local
    assert fq.nvfp4_uses_headroom(name) is headroom


@pytest.mark.parametrize(
    ("alias", "names"),
    [
        (formats.FP8Format, fq.FP8_FORMATS),
        (formats.FP8ScaleMethod, formats.FP8_SCALE_METHODS),
        (formats.FP8ScaleSemantics, formats.FP8_SCALE_SEMANTICS),
        (formats.GPTQFormat, fq.GPTQ_FORMATS),
        (formats.NVFP4Recipe, fq.NVFP4_RECIPES),
    ],
)
def test_literal_aliases_name_exactly_the_accepted_values(alias, names):
    assert typing.get_args(alias) == tuple(names)


def test_local_recipes_are_the_recipes_without_headroom():
    local = {r.removesuffix("_headroom") for r in fq.NVFP4_RECIPES}
    assert set(typing.get_args(formats.NVFP4LocalRecipe)) == local


@pytest.mark.parametrize(
    ("value", "canonical"),
    [("gptq", "gptq"), ("gptq_v2", "gptq_v2"), (" GPTQ ", "gptq"), ("Gptq_V2\n", "gptq_v2")],
)
def test_normalize_gptq_format(value, canonical):
    assert fq.normalize_gptq_format(value) == canonical


@pytest.mark.parametrize(
    ("value", "error", "match"),
    [
        ("gptq_v1", ValueError, r"where: source='gptq_v1' is not a GPTQ packing format; accepted"),
        ("v2", ValueError, r"'gptq' \(v1, stores zero - 1\) or 'gptq_v2'"),
        (2, TypeError, r"where: source must be a str \('gptq', 'gptq_v2'\), got int 2"),
        (None, TypeError, "got NoneType None"),
    ],
)
def test_normalize_gptq_format_rejects(value, error, match):
    with pytest.raises(error, match=match):
        fq.normalize_gptq_format(value, where="where", name="source")


def test_nvfp4_recipe_errors():
    assert fq.nvfp4_uses_headroom(None) is False
    for bad in ("mse", "NVIDIA", None, 3):
        with pytest.raises(ValueError, match="Unsupported NVFP4 scale recipe.*'least_squares'"):
            fq.normalize_nvfp4_recipe(bad)


def test_normalize_fp8_weight_format_refuses_only_the_decode_only_format():
    spellings = [*formats._FP8_ALIASES, torch.float8_e4m3fn, torch.float8_e8m0fnu]
    for spelling in spellings:
        name = fq.normalize_fp8_format(spelling)
        if name == "float8_e8m0fnu":
            with pytest.raises(ValueError, match=r"^weight\.fmt: .*decode-only"):
                fq.normalize_fp8_weight_format(spelling, where="weight.fmt")
        else:
            assert fq.normalize_fp8_weight_format(spelling) == name
            assert name in typing.get_args(formats.FP8WeightFormat)
    with pytest.raises(ValueError, match=r"^where: unsupported FP8 format"):
        fq.normalize_fp8_weight_format("e3m4", where="where")
