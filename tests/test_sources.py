"""interop.sources: source-family detection from metadata, ModelOpt refusals, dense decoders.

Decoder expectations come from oracles written here (ml_dtypes' E2M1/FP8/E8M0 tables, numpy
float64/float32 arithmetic, explicit index loops), never from floatxq itself.
"""

import json
import math
from types import SimpleNamespace

import ml_dtypes
import numpy as np
import pytest
import torch

from floatxq.interop.checkpoint import CheckpointError
from floatxq.interop.sources import (
    MODELOPT_ACTIVATION_REFUSAL,
    SOURCE_FAMILIES,
    decode_fp8_block_grid,
    decode_mimo_weight,
    decode_mx_weight,
    is_mimo_mixed_source,
    modelopt_activation_quantization,
    native_floatx_source_format,
    quark_floatx_formats,
    read_hf_quant_config,
)

# ----------------------------------------------------------------------------------------------
# Detection: precedence table
# ----------------------------------------------------------------------------------------------

_CT_FP8_GROUP = {
    "targets": ["Linear"],
    "weights": {"num_bits": 8, "type": "float", "strategy": "channel", "dynamic": False},
    "input_activations": {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True},
    "format": "float-quantized",
}

PRECEDENCE = [
    # (id, quantization_config, expected)
    ("modelopt-fp8", {"quant_method": "modelopt", "quant_algo": "FP8"}, "fp8"),
    ("modelopt-fp8-block", {"quant_algo": "FP8_PB_WO"}, "fp8"),
    ("modelopt-nvfp4", {"quant_method": "modelopt", "quant_algo": "NVFP4"}, "nvfp4"),
    ("modelopt-w4a16-nvfp4", {"quant_algo": "W4A16_NVFP4"}, "nvfp4"),
    ("modelopt-mxfp8", {"quant_algo": "MXFP8"}, "mxfp8"),
    ("fp4-beats-fp8", {"quant_algo": "W4A8_NVFP4_FP8"}, "nvfp4"),
    (
        "deepseek-fp8",
        {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]},
        "fp8",
    ),
    ("gpt-oss-mxfp4", {"quant_method": "mxfp4"}, "mxfp4"),
    ("ct-nvfp4", {"quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized"}, "nvfp4"),
    ("ct-mxfp4", {"quant_method": "compressed-tensors", "format": "mxfp4-pack-quantized"}, "mxfp4"),
    ("ct-mxfp8", {"quant_method": "compressed-tensors", "format": "mxfp8-quantized"}, "mxfp8"),
    (
        "ct-fp8-float-quantized-is-none",
        {
            "quant_method": "compressed-tensors",
            "format": "float-quantized",
            "config_groups": {"group_0": _CT_FP8_GROUP},
        },
        None,
    ),
    (
        "ct-group-format",
        {"format": "mixed-precision", "config_groups": {"g": {"format": "nvfp4-pack-quantized"}}},
        "nvfp4",
    ),
    (
        "mixed-mx-beats-mxfp4",
        {
            "format": "mixed-precision",
            "config_groups": {
                "a": {"format": "mxfp4-pack-quantized"},
                "b": {"format": "mxfp8-quantized"},
            },
        },
        "mixed-mx",
    ),
    ("mxfp4-beats-nvfp4", {"quant_algo": "NVFP4", "format": "mxfp4-pack-quantized"}, "mxfp4"),
    ("mxfp8-beats-nvfp8", {"quant_algo": "NVFP8", "quant_format": "mxfp8"}, "mxfp8"),
    ("nvfp8-beats-fp4", {"quant_algo": "NVFP8", "quant_format": "nvfp4"}, "nvfp8"),
    ("quant-format-key", {"quant_format": "MXFP8"}, "mxfp8"),
    ("case-and-space", {"quant_algo": "  NvFp4 "}, "nvfp4"),
    ("gptq", {"quant_method": "gptq", "bits": 4}, None),
    ("non-string-values", {"quant_algo": 8, "format": ["fp8"]}, None),
    ("weights-type-is-not-read", {"config_groups": {"g": {"weights": {"type": "fp8"}}}}, None),
    ("empty", {}, None),
]


@pytest.mark.parametrize(
    ("qc", "expected"), [p[1:] for p in PRECEDENCE], ids=[p[0] for p in PRECEDENCE]
)
def test_precedence_table(qc, expected):
    assert native_floatx_source_format({"quantization_config": qc}) == expected


def test_every_label_is_a_source_family():
    labels = {p[2] for p in PRECEDENCE} - {None}
    assert labels | {"mimo_mixed"} == set(SOURCE_FAMILIES)


def test_no_quantization_config_is_none():
    assert native_floatx_source_format({"model_type": "llama"}) is None
    assert native_floatx_source_format(SimpleNamespace(quantization_config=None)) is None


def _mimo_config(**quant):
    qc = {"quant_method": "fp8", "store_dtype": "mxfp4", "mxfp4_block_size": 32}
    qc["weight_block_size"] = [2, 32]
    qc.update(quant)
    return {"model_type": "mimo_v2", "quantization_config": qc}


def test_mimo_mixed_comes_first_and_needs_all_three_fields():
    assert native_floatx_source_format(_mimo_config()) == "mimo_mixed"
    assert is_mimo_mixed_source(SimpleNamespace(**_mimo_config()))
    not_mimo = [
        {**_mimo_config(), "model_type": "mimo"},
        _mimo_config(store_dtype="fp8"),
        _mimo_config(quant_method="gptq"),
    ]
    assert [is_mimo_mixed_source(c) for c in not_mimo] == [False, False, False]
    # Without the MiMo marker the same payload is an ordinary FP8 source.
    assert native_floatx_source_format(not_mimo[0]) == "fp8"


# ----------------------------------------------------------------------------------------------
# Detection: the ModelOpt sidecar
# ----------------------------------------------------------------------------------------------


def _sidecar(tmp_path, payload):
    (tmp_path / "hf_quant_config.json").write_text(
        payload if isinstance(payload, str) else json.dumps(payload), encoding="utf-8"
    )
    return tmp_path


def test_sidecar_only_detection(tmp_path):
    _sidecar(tmp_path, {"producer": {"name": "modelopt"}, "quantization": {"quant_algo": "NVFP4"}})
    config = SimpleNamespace(quantization_config=None)
    assert native_floatx_source_format(config, model_local_path=tmp_path) == "nvfp4"
    assert native_floatx_source_format(config, model_local_path=str(tmp_path)) == "nvfp4"
    assert native_floatx_source_format(config) is None  # no path: the sidecar is not consulted


def test_sidecar_quantization_subdict_wins_over_the_whole_file(tmp_path):
    # Read whole, this file would say MXFP4; only its "quantization" object counts.
    _sidecar(tmp_path, {"quant_algo": "MXFP4", "quantization": {"quant_algo": "FP8"}})
    assert native_floatx_source_format({}, model_local_path=tmp_path) == "fp8"


def test_sidecar_without_quantization_subdict_is_read_whole(tmp_path):
    _sidecar(tmp_path, {"quant_algo": "FP8", "kv_cache_quant_algo": None})
    assert native_floatx_source_format({}, model_local_path=tmp_path) == "fp8"


def test_sidecar_and_config_combine(tmp_path):
    _sidecar(tmp_path, {"quantization": {"quant_algo": "MXFP8"}})
    config = {"quantization_config": {"quant_method": "mxfp4"}}
    assert native_floatx_source_format(config, model_local_path=tmp_path) == "mixed-mx"


@pytest.mark.parametrize("content", ["{not json", "[1, 2]", b"\xff\xfe{}"])
def test_unreadable_sidecar_is_ignored_but_strict_read_raises(tmp_path, content):
    file = tmp_path / "hf_quant_config.json"
    if isinstance(content, bytes):
        file.write_bytes(content)
    else:
        file.write_text(content, encoding="utf-8")
    config = {"quantization_config": {"quant_method": "fp8"}}
    assert native_floatx_source_format(config, model_local_path=tmp_path) == "fp8"
    assert native_floatx_source_format({}, model_local_path=tmp_path) is None
    assert read_hf_quant_config(tmp_path) is None
    with pytest.raises(CheckpointError, match="hf_quant_config.json"):
        read_hf_quant_config(tmp_path, strict=True)
    with pytest.raises(ValueError):  # CheckpointError is a ValueError
        read_hf_quant_config(file, strict=True)


def test_read_hf_quant_config_missing_and_by_file(tmp_path):
    assert read_hf_quant_config(tmp_path) is None
    assert read_hf_quant_config(tmp_path, strict=True) is None
    payload = {"producer": {"name": "modelopt"}, "quantization": {"quant_algo": "FP8"}}
    _sidecar(tmp_path, payload)
    assert read_hf_quant_config(tmp_path) == payload
    assert read_hf_quant_config(tmp_path / "hf_quant_config.json", strict=True) == payload


# ----------------------------------------------------------------------------------------------
# Detection: transformers config objects
# ----------------------------------------------------------------------------------------------


def test_transformers_llama_config_with_quantization_dict():
    from transformers import LlamaConfig

    config = LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=1,
        num_attention_heads=4,
        quantization_config={"quant_method": "modelopt", "quant_algo": "W4A16_NVFP4"},
    )
    assert native_floatx_source_format(config) == "nvfp4"
    assert native_floatx_source_format(LlamaConfig(num_hidden_layers=1)) is None


def test_transformers_quantization_config_object_is_read_through_to_dict():
    from transformers import FineGrainedFP8Config

    config = SimpleNamespace(quantization_config=FineGrainedFP8Config())
    assert native_floatx_source_format(config) == "fp8"


# ----------------------------------------------------------------------------------------------
# Detection: AMD Quark (the schema Quark exports: dtype, qscheme, group_size, scale_format ...)
# ----------------------------------------------------------------------------------------------


def _quark_spec(dtype, qscheme, **extra):
    spec = {
        "dtype": dtype,
        "is_dynamic": False,
        "qscheme": qscheme,
        "ch_axis": None,
        "group_size": None,
        "block_size": None,
        "symmetric": True,
        "round_method": "half_even",
        "scale_type": "float",
        "scale_format": None,
        "scale_calculation_mode": None,
        "mx_element_dtype": None,
        "observer_cls": "PerTensorMinMaxObserver",
        "is_scale_quant": False,
    }
    spec.update(extra)
    return spec


MXFP4 = _quark_spec(
    "fp4", "per_group", ch_axis=-1, group_size=32, symmetric=None, scale_format="e8m0",
    scale_calculation_mode="even", observer_cls="PerBlockMXObserver",
)  # fmt: skip
MXFP8 = {**MXFP4, "dtype": "fp8_e4m3"}
FP8_TENSOR = _quark_spec("fp8_e4m3", "per_tensor")
FP8_BLOCK = _quark_spec("fp8_e4m3", "per_block", block_size=[128, 128])
NVFP4_W = [_quark_spec("fp4", "per_group", ch_axis=-1, group_size=16), FP8_TENSOR]
INT8 = _quark_spec("int8", "per_channel", ch_axis=0)


def _quark(global_weight, layers=None, layer_types=None):
    return {
        "quant_method": "quark",
        "export": {"kv_cache_group": [], "pack_method": "reorder"},
        "global_quant_config": {
            "weight": global_weight,
            "input_tensors": None,
            "output_tensors": None,
            "bias": None,
        },
        "layer_quant_config": {k: {"weight": w} for k, w in (layers or {}).items()},
        "layer_type_quant_config": {k: {"weight": w} for k, w in (layer_types or {}).items()},
        "exclude": ["lm_head"],
    }


QUARK = [
    ("mxfp4", _quark(MXFP4), ["mxfp4"], "mxfp4"),
    ("mxfp8", _quark(MXFP8), ["mxfp8"], "mxfp8"),
    ("fp8-per-tensor", _quark(FP8_TENSOR), ["fp8"], "fp8"),
    ("fp8-per-block-128-is-not-mx", _quark(FP8_BLOCK), ["fp8"], "fp8"),
    ("nvfp4-list", _quark(NVFP4_W), ["nvfp4", "fp8"], "nvfp4"),
    (
        "fp4-group-32-float-scale-is-nvfp4",
        _quark({**MXFP4, "scale_format": None}),
        ["nvfp4"],
        "nvfp4",
    ),
    (
        "block-1x32-ue8m0",
        _quark({**MXFP4, "group_size": None, "block_size": [1, 32], "scale_format": "ue8m0"}),
        ["mxfp4"],
        "mxfp4",
    ),
    (
        "fmt-key",
        _quark({"fmt": "e4m3", "group_size": 32, "scale_format": "e8m0"}),
        ["mxfp8"],
        "mxfp8",
    ),
    (
        "legacy-mx-spec",
        _quark({"dtype": "mx", "mx_element_dtype": "fp8_e4m3", "group_size": 32}),
        ["mxfp8"],
        "mxfp8",
    ),
    ("layer-override", _quark(MXFP4, layers={"*down_proj": MXFP8}), ["mxfp4", "mxfp8"], "mixed-mx"),
    ("layer-type", _quark(INT8, layer_types={"Linear": FP8_TENSOR}), ["fp8"], "fp8"),
    ("int8-only", _quark(INT8), [], None),
]


@pytest.mark.parametrize(
    ("qc", "labels", "family"), [q[1:] for q in QUARK], ids=[q[0] for q in QUARK]
)
def test_quark_schema(qc, labels, family):
    assert quark_floatx_formats(qc) == labels
    assert native_floatx_source_format({"quantization_config": qc}) == family


def test_quark_specs_are_ignored_for_other_methods():
    assert quark_floatx_formats({**_quark(MXFP4), "quant_method": "fp8"}) == []
    assert quark_floatx_formats(None) == []


# ----------------------------------------------------------------------------------------------
# ModelOpt activation quantization
# ----------------------------------------------------------------------------------------------

_W4A16 = {
    "quant_method": "modelopt",
    "quant_algo": "W4A16_NVFP4",
    "config_groups": {
        "group_0": {
            "targets": ["Linear"],
            "weights": {"num_bits": 4, "type": "float", "group_size": 16},
            "input_activations": None,
        }
    },
    "kv_cache_scheme": None,
}
_WEIGHT_NAMES = ["m.q_proj.weight", "m.q_proj.weight_scale", "m.q_proj.weight_scale_2"]


def test_weight_only_modelopt_is_accepted():
    assert modelopt_activation_quantization(_W4A16, _WEIGHT_NAMES) is None


def test_input_activations_reason():
    groups = {"group_0": {**_W4A16["config_groups"]["group_0"]}}
    groups["group_0"]["input_activations"] = {"num_bits": 4, "type": "float", "group_size": 16}
    qc = {**_W4A16, "quant_algo": "NVFP4", "config_groups": groups}
    assert modelopt_activation_quantization(qc, _WEIGHT_NAMES) == "input_activations"
    # It is the first reason: kv-cache metadata and scale tensors come later.
    qc["kv_cache_scheme"] = {"num_bits": 8, "type": "float"}
    assert modelopt_activation_quantization(qc, ["x.input_scale"]) == "input_activations"
    top_level = {"quant_method": "modelopt", "input_activations": {"num_bits": 8}}
    assert modelopt_activation_quantization(top_level, []) == "input_activations"
    sixteen = {**_W4A16, "config_groups": {"g": {"input_activations": {"num_bits": 16}}}}
    assert modelopt_activation_quantization(sixteen, []) is None


def test_kv_cache_reason():
    qc = {**_W4A16, "kv_cache_scheme": {"num_bits": 8, "type": "float", "dynamic": False}}
    assert modelopt_activation_quantization(qc, ["x.k_scale"]) == "kv_cache_scheme"
    sidecar = {
        "producer": {"name": "modelopt", "version": "0.29.0"},
        "quantization": {"quant_algo": "FP8", "kv_cache_quant_algo": "FP8"},
    }
    assert modelopt_activation_quantization(sidecar, []) == "kv_cache_scheme"
    sidecar["quantization"]["kv_cache_quant_algo"] = None
    assert modelopt_activation_quantization(sidecar, []) is None


@pytest.mark.parametrize("suffix", [".input_scale", ".k_scale", ".v_scale"])
def test_checkpoint_scales_reason(suffix):
    names = [*_WEIGHT_NAMES, "model.layers.0.self_attn.k_proj" + suffix]
    assert modelopt_activation_quantization(_W4A16, names) == "checkpoint_scales"
    assert modelopt_activation_quantization(_W4A16, iter(names)) == "checkpoint_scales"


def test_non_modelopt_payloads_are_not_judged():
    ct = {"quant_method": "compressed-tensors", "config_groups": {"group_0": _CT_FP8_GROUP}}
    assert modelopt_activation_quantization(ct, ["x.input_scale"]) is None
    assert modelopt_activation_quantization(None, ["x.input_scale"]) is None
    upper = {**_W4A16, "quant_method": "ModelOpt"}
    assert modelopt_activation_quantization(upper, ["x.v_scale"]) == "checkpoint_scales"


def test_refusal_message_names_the_mode_and_the_supported_variants():
    text = MODELOPT_ACTIVATION_REFUSAL.format(mode="checkpoint_scales")
    assert "checkpoint_scales" in text and "W8A16 FP8" in text and "W4A16 NVFP4" in text


# ----------------------------------------------------------------------------------------------
# Oracles
# ----------------------------------------------------------------------------------------------

_ROUND = {torch.bfloat16: ml_dtypes.bfloat16, torch.float16: np.float16, torch.float32: np.float32}


def _e2m1_oracle(packed: np.ndarray) -> np.ndarray:
    """float64 values of uint8 [r, c] packed E2M1 (even element in the low nibble) -> [r, 2c]."""
    nibbles = np.stack([packed & 0xF, packed >> 4], axis=-1).reshape(packed.shape[0], -1)
    return nibbles.astype(np.uint8).view(ml_dtypes.float4_e2m1fn).astype(np.float64)


def _e8m0_oracle(scale_bytes: np.ndarray) -> np.ndarray:
    return scale_bytes.astype(np.uint8).view(ml_dtypes.float8_e8m0fnu).astype(np.float64)


def _as_torch(values: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    """Round float64 ``values`` once to ``dtype`` with numpy/ml_dtypes and bring them to torch."""
    rounded = values.astype(_ROUND[dtype])
    if dtype == torch.bfloat16:
        return torch.from_numpy(rounded.view(np.uint16).astype(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(rounded)


def _assert_bitwise(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    width = {2: torch.int16, 4: torch.int32}[actual.element_size()]
    assert torch.equal(actual.view(width), expected.view(width))


# ----------------------------------------------------------------------------------------------
# decode_mx_weight
# ----------------------------------------------------------------------------------------------

_SCALE_BYTES = [0, 1, 60, 100, 126, 127, 128, 131, 200, 251]  # 251: 6 * 2**124 is finite


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_mx_e2m1_every_packed_byte_against_ml_dtypes(dtype):
    packed = np.arange(256, dtype=np.uint8).reshape(16, 16)  # every byte, in = 32
    packed = np.concatenate([packed] * len(_SCALE_BYTES))  # each row block per scale byte
    scales = np.repeat(np.array(_SCALE_BYTES, dtype=np.uint8), 16)[:, None]
    expected = _e2m1_oracle(packed) * _e8m0_oracle(scales)  # exact in float64
    codes_t, scales_t = torch.from_numpy(packed), torch.from_numpy(scales)
    before = codes_t.clone(), scales_t.clone()
    actual = decode_mx_weight(codes_t, scales_t, element="e2m1", dtype=dtype)
    _assert_bitwise(actual, _as_torch(expected, dtype))
    assert torch.equal(codes_t, before[0]) and torch.equal(scales_t, before[1])


def test_mx_e2m1_float16_and_e8m0_dtype_scales():
    packed = np.arange(256, dtype=np.uint8).reshape(8, 32)  # in = 64: two blocks a row
    scales = np.array([[110, 140]] * 8, dtype=np.uint8)  # 6 * 2**13 = 49152 < 65504
    expected = _e2m1_oracle(packed) * np.repeat(_e8m0_oracle(scales), 32, axis=1)
    e8m0 = torch.from_numpy(scales).view(torch.float8_e8m0fnu)
    actual = decode_mx_weight(torch.from_numpy(packed), e8m0, element="E2M1", dtype=torch.float16)
    _assert_bitwise(actual, _as_torch(expected, torch.float16))


@pytest.mark.parametrize(
    ("element", "np_dtype"),
    [("float8_e4m3fn", ml_dtypes.float8_e4m3fn), ("float8_e5m2", ml_dtypes.float8_e5m2)],
)
def test_mx_fp8_elements_every_finite_code(element, np_dtype):
    codes = np.arange(256, dtype=np.uint8)
    codes = codes[np.isfinite(codes.view(np_dtype).astype(np.float64))]
    codes = np.concatenate([codes, np.zeros(-len(codes) % 32, dtype=np.uint8)]).reshape(-1, 32)
    scales = np.array([[120 + i % 12] for i in range(codes.shape[0])], dtype=np.uint8)
    expected = codes.view(np_dtype).astype(np.float64) * _e8m0_oracle(scales)
    codes_t = torch.from_numpy(codes).view(getattr(torch, element))
    actual = decode_mx_weight(codes_t, torch.from_numpy(scales), element=element)
    _assert_bitwise(actual, _as_torch(expected, torch.bfloat16))


def test_mx_refuses_e8m0_nan_byte_naming_the_tensor():
    codes = torch.zeros(2, 16, dtype=torch.uint8)
    scales = torch.tensor([[127], [255]], dtype=torch.uint8)
    with pytest.raises(ValueError, match=r"experts\.0\.up_proj.*255"):
        decode_mx_weight(codes, scales, element="e2m1", name="experts.0.up_proj")


def test_mx_refuses_nan_codes_and_overflow():
    nan_code = torch.full((1, 32), 0x7F, dtype=torch.uint8).view(torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="NaN or infinity"):
        decode_mx_weight(
            nan_code, torch.tensor([[127]], dtype=torch.uint8), element="float8_e4m3fn"
        )
    six = torch.full((1, 16), 0x77, dtype=torch.uint8)  # 6.0 everywhere
    with pytest.raises(ValueError, match="w9"):  # 6 * 2**127 overflows FP32
        decode_mx_weight(six, torch.tensor([[254]], dtype=torch.uint8), element="e2m1", name="w9")
    with pytest.raises(ValueError, match="float16"):  # 6 * 2**14 overflows float16 only
        decode_mx_weight(
            six, torch.tensor([[141]], dtype=torch.uint8), element="e2m1", dtype=torch.float16
        )


def test_mx_refuses_bad_arguments(production_checks):
    codes, scales = (
        torch.zeros(2, 16, dtype=torch.uint8),
        torch.full((2, 1), 127, dtype=torch.uint8),
    )
    with pytest.raises(ValueError, match="element"):
        decode_mx_weight(codes, scales, element="e3m2")
    with pytest.raises(ValueError, match="dtype"):
        decode_mx_weight(codes, scales, element="e2m1", dtype=torch.float8_e4m3fn)
    with pytest.raises(ValueError, match=r"\(2, 2\)"):
        decode_mx_weight(codes, torch.full((2, 2), 127, dtype=torch.uint8), element="e2m1")
    with pytest.raises(ValueError, match="multiple of 32"):
        decode_mx_weight(torch.zeros(2, 8, dtype=torch.uint8), scales, element="e2m1")
    with pytest.raises(TypeError, match="float32"):
        decode_mx_weight(codes, scales.float(), element="e2m1")
    with pytest.raises(TypeError):
        decode_mx_weight(codes, scales, element="float8_e4m3fn")  # uint8 codes for an FP8 element


# ----------------------------------------------------------------------------------------------
# decode_fp8_block_grid
# ----------------------------------------------------------------------------------------------


def _grid_oracle(codes: np.ndarray, grid: np.ndarray, block) -> np.ndarray:
    """float32(code) * scale[i // br, j // bc] by explicit loops, rounded to float32."""
    br, bc = block
    out = np.empty(codes.shape, dtype=np.float32)
    for i in range(codes.shape[0]):
        for j in range(codes.shape[1]):
            out[i, j] = np.float32(codes[i, j]) * np.float32(grid[i // br, j // bc])
    return out.astype(np.float64)  # exact: the float32 product is what gets rounded once more


def _fp8_codes(rows: int, cols: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    finite = np.arange(256, dtype=np.uint8)
    finite = finite[np.isfinite(finite.view(ml_dtypes.float8_e4m3fn).astype(np.float64))]
    return rng.choice(finite, size=(rows, cols)).astype(np.uint8)


@pytest.mark.parametrize(
    ("shape", "block"),
    [((5, 7), (2, 3)), ((4, 6), (2, 3)), ((1, 1), (128, 128)), ((130, 20), (128, 8))],
)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fp8_grid_ragged_and_exact_against_loops(shape, block, dtype):
    rows, cols = shape
    grid_shape = (math.ceil(rows / block[0]), math.ceil(cols / block[1]))
    codes = _fp8_codes(rows, cols, seed=rows * cols)
    rng = np.random.default_rng(7)
    grid = (rng.uniform(0.01, 3.0, size=grid_shape)).astype(np.float32)
    expected = _grid_oracle(codes.view(ml_dtypes.float8_e4m3fn).astype(np.float64), grid, block)
    weight = torch.from_numpy(codes).view(torch.float8_e4m3fn)
    scale = torch.from_numpy(grid)
    actual = decode_fp8_block_grid(weight, scale, block=list(block), dtype=dtype)
    _assert_bitwise(actual, _as_torch(expected, dtype))


def test_fp8_grid_e8m0_and_bf16_scales():
    codes = _fp8_codes(3, 5, seed=1)
    values = codes.view(ml_dtypes.float8_e4m3fn).astype(np.float64)
    weight = torch.from_numpy(codes).view(torch.float8_e4m3fn)
    grid_bytes = np.array([[120, 130], [127, 140]], dtype=np.uint8)
    expected = _grid_oracle(values, _e8m0_oracle(grid_bytes), (2, 3))
    for scale in (
        torch.from_numpy(grid_bytes),
        torch.from_numpy(grid_bytes).view(torch.float8_e8m0fnu),
    ):
        actual = decode_fp8_block_grid(weight, scale, block=(2, 3), dtype=torch.float32)
        _assert_bitwise(actual, _as_torch(expected, torch.float32))
    bf16 = torch.tensor([[0.3, 1.7], [2.5, 0.1]], dtype=torch.bfloat16)
    expected = _grid_oracle(values, bf16.float().numpy(), (2, 3))
    actual = decode_fp8_block_grid(weight, bf16, block=(2, 3), dtype=torch.float32)
    _assert_bitwise(actual, _as_torch(expected, torch.float32))


def test_fp8_grid_wrong_shape_names_both_shapes():
    weight = torch.zeros(5, 7).to(torch.float8_e4m3fn)
    with pytest.raises(ValueError, match=r"\(3, 3\).*\(2, 2\)"):  # floor grid instead of ceil
        decode_fp8_block_grid(weight, torch.ones(2, 2), block=[2, 3])
    with pytest.raises(ValueError, match=r"\(3, 3\).*\(3, 4\)"):
        decode_fp8_block_grid(weight, torch.ones(3, 4), block=[2, 3])


@pytest.mark.parametrize("bad", [0.0, -1.0, float("inf"), float("nan")])
def test_fp8_grid_scale_must_be_finite_and_positive(bad):
    weight = torch.ones(4, 4).to(torch.float8_e4m3fn)
    scale = torch.tensor([[1.0, 1.0], [1.0, bad]])
    with pytest.raises(ValueError, match="layers.3.o_proj.weight.*finite and > 0"):
        decode_fp8_block_grid(weight, scale, block=[2, 2], name="layers.3.o_proj.weight")
    with pytest.raises(ValueError, match="finite and > 0"):  # the E8M0 NaN byte
        decode_fp8_block_grid(weight, torch.tensor([[127, 255]], dtype=torch.uint8), block=[4, 2])


def test_fp8_grid_refuses_bad_arguments():
    weight = torch.ones(4, 4).to(torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="NaN or infinity"):
        nan = torch.full((4, 4), 0x7F, dtype=torch.uint8).view(torch.float8_e4m3fn)
        decode_fp8_block_grid(nan, torch.ones(1, 1), block=[4, 4])
    with pytest.raises(TypeError, match="FP8"):
        decode_fp8_block_grid(torch.ones(4, 4), torch.ones(1, 1), block=[4, 4])
    with pytest.raises(TypeError, match="int32"):
        decode_fp8_block_grid(weight, torch.ones(1, 1, dtype=torch.int32), block=[4, 4])
    for block in ([0, 4], [4], [4, 4, 4]):
        with pytest.raises(ValueError, match="block"):
            decode_fp8_block_grid(weight, torch.ones(1, 1), block=block)


# ----------------------------------------------------------------------------------------------
# decode_mimo_weight
# ----------------------------------------------------------------------------------------------

_EXPERT = "model.layers.1.mlp.experts.3.down_proj.weight"
_DENSE_FP8 = "model.layers.0.self_attn.o_proj.weight"


def test_mimo_fp8_block_grid_multiplies():
    codes = _fp8_codes(5, 40, seed=3)
    grid = np.array(
        [[0.5, 2.0], [0.25, 4.0], [1.5, 0.125]], dtype=np.float32
    )  # ceil(5/2), ceil(40/32)
    expected = _grid_oracle(codes.view(ml_dtypes.float8_e4m3fn).astype(np.float64), grid, (2, 32))
    tensors = {_DENSE_FP8 + "_scale_inv": torch.from_numpy(grid)}
    weight = torch.from_numpy(codes).view(torch.float8_e4m3fn)
    for config in (_mimo_config(), SimpleNamespace(**_mimo_config())):
        actual = decode_mimo_weight(config, _DENSE_FP8, weight, tensors.get, dtype=torch.float32)
        _assert_bitwise(actual, _as_torch(expected, torch.float32))


def test_mimo_mxfp4_expert():
    packed = np.arange(128, dtype=np.uint8).reshape(4, 32)  # in = 64
    scales = np.array([[127, 128], [126, 130], [100, 127], [127, 127]], dtype=np.uint8)
    expected = _e2m1_oracle(packed) * np.repeat(_e8m0_oracle(scales), 32, axis=1)
    lookup = {_EXPERT + "_scale": torch.from_numpy(scales)}.get
    actual = decode_mimo_weight(_mimo_config(), _EXPERT, torch.from_numpy(packed), lookup)
    _assert_bitwise(actual, _as_torch(expected, torch.bfloat16))


@pytest.mark.parametrize(
    ("config", "name", "weight"),
    [
        (_mimo_config(quant_method="gptq"), _EXPERT, torch.zeros(2, 16, dtype=torch.uint8)),
        ({"model_type": "llama"}, _DENSE_FP8, torch.zeros(2, 32).to(torch.float8_e4m3fn)),
        (
            _mimo_config(),
            "model.layers.0.input_layernorm.weight",
            torch.ones(8, dtype=torch.bfloat16),
        ),
        (_mimo_config(), _DENSE_FP8, torch.ones(2, 32, dtype=torch.float32)),
        (
            _mimo_config(),
            "model.mtp.layers.0.proj.weight",
            torch.ones(2, 32).to(torch.float8_e4m3fn),
        ),
        (_mimo_config(), _DENSE_FP8 + "_scale_inv", torch.ones(1, 1).to(torch.float8_e4m3fn)),
    ],
    ids=["not-mimo-method", "not-mimo-model", "dense-norm", "dense-fp32", "mtp", "not-a-weight"],
)
def test_mimo_returns_none_for_tensors_it_does_not_encode(config, name, weight):
    def lookup(key):
        raise AssertionError(f"no scale should be fetched, asked for {key}")

    assert decode_mimo_weight(config, name, weight, lookup) is None


def test_mimo_missing_scales_are_named():
    weight = torch.zeros(2, 32).to(torch.float8_e4m3fn)
    with pytest.raises(ValueError, match=r"o_proj\.weight_scale_inv"):
        decode_mimo_weight(_mimo_config(), _DENSE_FP8, weight, {}.get)
    with pytest.raises(ValueError, match=r"down_proj\.weight_scale\b"):
        decode_mimo_weight(_mimo_config(), _EXPERT, torch.zeros(2, 16, dtype=torch.uint8), {}.get)


@pytest.mark.parametrize(
    ("name", "dtype"),
    [
        ("model.layers.0.mlp.experts.0.up_proj.weight", torch.int8),
        ("model.layers.0.mlp.gate_proj.weight", torch.uint8),  # uint8 outside the experts
        (_DENSE_FP8, torch.float8_e4m3fnuz),
        (_DENSE_FP8, torch.float8_e5m2),
    ],
)
def test_mimo_unsupported_storage_fails_closed(name, dtype):
    weight = torch.zeros(2, 32, dtype=torch.uint8).view(dtype)
    with pytest.raises(ValueError, match="unsupported MiMo source storage"):
        decode_mimo_weight(_mimo_config(), name, weight, {}.get)


def test_mimo_refuses_fused_qkv_and_bad_metadata():
    weight = torch.zeros(2, 32).to(torch.float8_e4m3fn)
    lookup = {"model.layers.2.self_attn.qkv_proj.weight_scale_inv": torch.ones(1, 1)}.get
    with pytest.raises(ValueError, match="fused qkv_proj MiMo sources are not supported"):
        decode_mimo_weight(
            _mimo_config(), "model.layers.2.self_attn.qkv_proj.weight", weight, lookup
        )
    scale = {_DENSE_FP8 + "_scale_inv": torch.ones(1, 1)}.get
    with pytest.raises(ValueError, match="weight_block_size"):
        decode_mimo_weight(_mimo_config(weight_block_size=None), _DENSE_FP8, weight, scale)
    with pytest.raises(TypeError, match="float32"):
        bf16 = {_DENSE_FP8 + "_scale_inv": torch.ones(1, 1, dtype=torch.bfloat16)}.get
        decode_mimo_weight(_mimo_config(weight_block_size=[2, 32]), _DENSE_FP8, weight, bf16)
    packed = torch.zeros(2, 16, dtype=torch.uint8)
    scales = {_EXPERT + "_scale": torch.full((2, 1), 127, dtype=torch.uint8)}.get
    with pytest.raises(ValueError, match="mxfp4_block_size"):
        decode_mimo_weight(_mimo_config(mxfp4_block_size=16), _EXPERT, packed, scales)
    reserved = {_EXPERT + "_scale": torch.tensor([[127], [255]], dtype=torch.uint8)}.get
    with pytest.raises(ValueError, match="255"):
        decode_mimo_weight(_mimo_config(), _EXPERT, packed, reserved)


# ----------------------------------------------------------------------------------------------
# Modules from source tensors
# ----------------------------------------------------------------------------------------------


def _codes(rows: int, cols: int) -> torch.Tensor:
    torch.manual_seed(0)
    return (torch.randn(rows, cols) * 100).clamp(-448, 448).to(torch.float8_e4m3fn)


@pytest.mark.parametrize(
    ("scale_shape", "block", "method"),
    [((), None, "tensor"), ((1,), None, "tensor"), ((64,), None, "row"), ((64, 1), None, "row"),
     ((2, 4), (32, 32), "block")],
)  # fmt: skip
def test_fp8_module_from_source_layouts_and_directions(scale_shape, block, method):
    from floatxq.interop.sources import fp8_module_from_source
    from floatxq.nn import TorchFP8Linear

    codes = _codes(64, 128)
    scale = torch.rand(scale_shape) + 0.5
    multiplied = fp8_module_from_source(codes, scale, direction="multiply", block=block)
    divided = fp8_module_from_source(codes, scale, direction="inverse", block=block)
    assert isinstance(multiplied, TorchFP8Linear) and multiplied.weight_scale_method == method
    assert multiplied.weight.data_ptr() == codes.data_ptr()  # codes are not repacked
    full = scale.reshape(-1, 1) if scale.ndim and scale.shape[0] == 64 else scale
    if method == "block":
        full = scale.repeat_interleave(32, 0).repeat_interleave(32, 1)
    want = codes.float() * full
    got = multiplied.dequantize_weight()
    assert float(((got - want).abs() / want.abs().clamp_min(1e-30)).max()) <= 3 * 2**-24
    assert torch.equal(divided.dequantize_weight(), codes.float() / full)


def test_fp8_module_from_source_ragged_grid_decodes_to_dense():
    from floatxq.interop.sources import fp8_module_from_source

    codes = _codes(192, 128)
    scale = torch.tensor([[0.5], [0.25]])  # [ceil(192/128), ceil(128/128)]
    layer = fp8_module_from_source(
        codes, scale, direction="multiply", block=(128, 128), dtype=torch.float32
    )
    assert type(layer) is torch.nn.Linear
    want = torch.cat([codes[:128].float() * 0.5, codes[128:].float() * 0.25])
    assert torch.equal(layer.weight, want)


def test_fp8_module_from_source_refusals(production_checks):
    from floatxq.interop.sources import fp8_module_from_source

    codes = _codes(64, 128)
    with pytest.raises(ValueError, match="direction"):
        fp8_module_from_source(codes, torch.tensor(1.0), direction="guess")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="no block size"):
        fp8_module_from_source(codes, torch.ones(2, 4), direction="multiply")
    with pytest.raises(ValueError, match="does not fit"):
        fp8_module_from_source(codes, torch.ones(3, 4), direction="multiply", block=(32, 32))
    with pytest.raises(ValueError, match="finite"):
        fp8_module_from_source(codes, torch.tensor(float("nan")), direction="multiply")


def test_fp4_module_from_source_names_what_is_missing_and_reads_each_layout(production_checks):
    from floatxq.interop.sources import fp4_module_from_source
    from floatxq.nvfp4.layouts import nvfp4_to_compressed_tensors, nvfp4_to_modelopt
    from floatxq.nvfp4.quantize import nvfp4_dequantize, nvfp4_quantize

    torch.manual_seed(1)
    q = nvfp4_quantize(torch.randn(32, 64), None, recipe="nvidia")
    from floatxq.nvfp4.layouts import NVFP4Weight

    canonical = NVFP4Weight(q.packed, q.block_scales, q.global_scale)
    want = nvfp4_dequantize(*q)
    modelopt = fp4_module_from_source(
        nvfp4_to_modelopt(canonical), layout="modelopt", shape=(32, 64)
    )
    assert torch.equal(modelopt.dequantize_weight(torch.float32), want)
    ct = fp4_module_from_source(
        nvfp4_to_compressed_tensors(canonical), layout="compressed-tensors", shape=(32, 64)
    )
    err = (ct.dequantize_weight(torch.float32) - want).abs().max() / want.abs().max()
    assert float(err) <= 2**-23
    with pytest.raises(ValueError, match="weight_scale_2"):
        fp4_module_from_source({"weight": q.packed, "weight_scale": q.block_scales},
                               layout="modelopt", shape=(32, 64))  # fmt: skip
    with pytest.raises(ValueError, match="layout"):
        fp4_module_from_source({}, layout="nvidia", shape=(32, 64))  # type: ignore[arg-type]
