"""Hostile metadata: JSON, config fields and scale values that used to load wrongly or end in a raw
error now end in a CheckpointError naming the file and the field or tensor, or load correctly.

Each case starts from a good checkpoint (producer fixtures in ``tests/fixtures``, a Comfy file
written by ``floatxq.testing.foreign``, or a one-layer W4A-NVFP4 Llama saved here) and changes
one thing. ``load`` and ``inspect`` decide a layout alike, so metadata refusals are checked on both.
"""

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torch import nn

import floatxq
from floatxq.config import ActivationConfig, GPTQConfig
from floatxq.interop.checkpoint import CheckpointError
from floatxq.interop.inspect import inspect_checkpoint
from floatxq.interop.sources import native_floatx_source_format, read_hf_quant_config

pytest.importorskip("transformers")

FIXTURES = Path(__file__).parent / "fixtures"
GPTQ = FIXTURES / "gptqmodel_gptq_desc_act"  # 4-bit g64 asym desc_act, bf16, 2 layers
PACKED = FIXTURES / "llmcompressor_w4a16_g64"  # compressed-tensors pack-quantized
TORCHAO = FIXTURES / "torchao_nvfp4"
FP8_BLOCK = FIXTURES / "gptqmodel_fp8_block64"
DENSE = FIXTURES / "tiny_random_llama"
DOWN = "model.layers.0.mlp.down_proj"
UP = "model.layers.0.mlp.up_proj"
BITS = "activation_global_scale_bits"
DEEP = "[" * 5000 + "]" * 5000
HUGE = "9" * 5000


def _copy(source: Path, target: Path) -> Path:
    shutil.copytree(source, target, ignore=shutil.ignore_patterns("*reference*", "*logits*"))
    return target


def _edit_json(path: Path, name: str, change) -> None:
    data = json.loads((path / name).read_text())
    change(data)
    (path / name).write_text(json.dumps(data))


def _edit_payloads(path: Path, change) -> None:
    """``change`` applied to config.json's quantization_config and quantize_config.json alike."""
    _edit_json(path, "config.json", lambda c: change(c["quantization_config"]))
    if (path / "quantize_config.json").is_file():
        _edit_json(path, "quantize_config.json", change)


def _edit_tensors(path: Path, change=None, metadata=None) -> None:
    file = path / "model.safetensors"
    with safe_open(str(file), "pt") as reader:
        stored = reader.metadata()
    state = load_file(str(file))
    if change is not None:
        change(state)
    save_file(state, str(file), metadata=metadata(dict(stored)) if metadata else stored)


def _refused(path: Path, match: str, *, inspect: bool = True, **load_kw) -> str:
    with pytest.raises(CheckpointError, match=match) as caught:
        floatxq.load(path, **load_kw)
    if inspect:
        with pytest.raises(CheckpointError, match=match):
            inspect_checkpoint(path)
    return str(caught.value)


# ----------------------------------------------------------------------------------------------
# A W4A-NVFP4 checkpoint: one Llama layer of RTN GPTQ modules, a policy with global scales
# ----------------------------------------------------------------------------------------------


def _w4a_llama(path: Path) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    from floatxq.gptq.solve import rtn_quantize
    from floatxq.lifecycle.gptq import gptq_solve_options
    from floatxq.lifecycle.model import QuantizedModel
    from floatxq.lifecycle.stream import set_stream_global_scales, stream_boundary_quantizers
    from floatxq.lifecycle.w4a_install import install_activation_stream, install_w4a_modules
    from floatxq.nn.gptq_linear import GPTQLinear

    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=128, intermediate_size=256, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=4, head_dim=32, vocab_size=64, max_position_embeddings=32,
    )  # fmt: skip
    model = LlamaForCausalLM(config).float().eval()
    options = gptq_solve_options(GPTQConfig())
    for name, module in list(model.named_modules()):
        if isinstance(module, nn.Linear) and name != "lm_head":
            solution = rtn_quantize(module.weight.detach().float(), options)
            model.set_submodule(name, GPTQLinear.from_solution(solution, bits=4, group_size=128))
    policy = ActivationConfig(mode="w4a_nvfp4", recipe="nvidia")
    backend = floatxq.backend_for_activation(policy)
    install_w4a_modules(model, backend, activation=policy, scales={f"{DOWN}": 0.5})
    install_activation_stream(model, policy)
    producers = list(stream_boundary_quantizers(model))
    scales = {key: 0.001 * (i + 1) for i, key in enumerate(producers)}
    set_stream_global_scales(model, scales)
    policy = ActivationConfig.from_dict({**policy.to_dict(), "global_scales": scales})
    config = GPTQConfig(activation=policy)
    QuantizedModel(model, quantize_config=config, backend=backend, quantized=True).save(path)
    return path


@pytest.fixture(scope="module")
def w4a(tmp_path_factory) -> Path:
    return _w4a_llama(tmp_path_factory.mktemp("w4a") / "nvfp4")


def _policy(payload: dict) -> dict:
    return payload["activation"]


def test_the_w4a_checkpoint_loads_with_its_policy(w4a):
    loaded = floatxq.load(w4a)
    assert loaded.quantize_config.activation.recipe == "nvidia"
    assert len(loaded.quantize_config.activation.global_scales) == 5
    module = loaded.model.get_submodule(DOWN)
    assert float(module.activation_global_scale_bits.view(torch.float32)) == 0.5


# ----------------------------------------------------------------------------------------------
# 2. config.json and quantize_config.json disagreeing on the activation policy
# ----------------------------------------------------------------------------------------------


def _first_scale(q: dict) -> None:
    scales = _policy(q)["global_scales"]
    scales[sorted(scales)[0]] = 0.25


@pytest.mark.parametrize(
    ("change", "match"),
    [
        (lambda q: _policy(q).update(recipe="least_squares"), r"activation\.recipe: "
         r"'least_squares' vs 'nvidia'"),
        (_first_scale, r"activation\.global_scales\['model\.layers\.0\.input'\]: 0\.25 vs 0\.001"),
        (lambda q: _policy(q).update(mlp={"mode": "w4afp8", "layers": [0]}),
         r"activation\.mlp: \{'mode': 'w4afp8', 'layers': \[0\]\} vs None"),
    ],
    ids=["recipe", "global-scale", "mlp"],
)  # fmt: skip
def test_policies_that_differ_between_the_two_files_are_refused(w4a, tmp_path, change, match):
    path = _copy(w4a, tmp_path / "m")
    _edit_json(path, "quantize_config.json", change)
    message = _refused(path, match)
    assert "quantize_config.json and " in message and "config.json describe different" in message


@pytest.mark.parametrize("dropped", ["config.json", "quantize_config.json"])
def test_a_policy_in_one_file_only_is_refused(w4a, tmp_path, dropped):
    path = _copy(w4a, tmp_path / "m")
    if dropped == "config.json":
        _edit_json(path, dropped, lambda c: c["quantization_config"].pop("activation"))
    else:
        _edit_json(path, dropped, lambda q: q.pop("activation"))
    kept = "quantize_config.json" if dropped == "config.json" else "config.json"
    message = _refused(path, rf"/{kept} declares the W4A activation policy \(field 'activation'\)")
    assert f"/{dropped} declares none (plain W4A16)" in message
    assert "{'mode': 'w4a_nvfp4', 'recipe': 'nvidia'} with 5 global scales" in message


def test_a_policy_that_does_not_fit_the_stored_model_is_a_checkpoint_error(w4a, tmp_path):
    path = _copy(w4a, tmp_path / "m")
    extra = "model.layers.0.self_attn.q_proj"  # not a stream producer: install refuses it
    _edit_payloads(path, lambda q: _policy(q)["global_scales"].update({extra: 0.5}))
    message = _refused(path, r"the activation policy its quantize_config\.json and config\.json",
                       inspect=False)  # fmt: skip
    assert f"extra ['{extra}']" in message


# ----------------------------------------------------------------------------------------------
# 5. raw exceptions: deep JSON, huge integers, fields of the wrong kind, zero sizes, FP8 scales
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["config.json", "quantize_config.json"])
@pytest.mark.parametrize(
    ("inserted", "why"),
    [(DEEP, r"JSON nested deeper than 64 levels"), (HUGE, r"an integer of 5000 digits")],
    ids=["deep", "huge-int"],
)
def test_deep_or_huge_json_in_the_config_files_is_named(tmp_path, name, inserted, why):
    path = _copy(GPTQ, tmp_path / "m")
    text = (path / name).read_text()
    (path / name).write_text(text.replace('"meta": {', f'"meta": {{"x": {inserted},', 1))
    with pytest.raises(CheckpointError, match=rf"load: .*/m/{name} is not valid JSON \({why}"):
        floatxq.load(path)
    with pytest.raises(CheckpointError, match=rf"/m/{name} is not valid JSON \({why}"):
        inspect_checkpoint(path)


@pytest.mark.parametrize(
    ("content", "why"),
    [
        ('{"quantization": ' + DEEP + "}", r"JSON nested deeper than 64 levels"),
        ('{"quantization": {"quant_algo": ' + HUGE + "}}", r"an integer of 5000 digits"),
        ('{"quant_algo": NaN}', r"NaN is not a finite number"),
    ],
    ids=["deep", "huge-int", "nan"],
)
def test_a_hostile_modelopt_sidecar_is_named(tmp_path, content, why):
    path = _copy(TORCHAO, tmp_path / "m")
    (path / "hf_quant_config.json").write_text(content)
    _refused(path, rf"hf_quant_config: .*/m/hf_quant_config\.json is not valid JSON \({why}")
    with pytest.raises(CheckpointError, match=why):
        read_hf_quant_config(path, strict=True)
    assert read_hf_quant_config(path) is None  # the lenient read ignores it
    assert native_floatx_source_format({}, model_local_path=path) is None


@pytest.mark.parametrize(
    ("key", "value", "why"),
    [
        (f"{UP}.weight", DEEP, r"'model\.layers\.0\.mlp\.up_proj\.weight' \(torchao\) is not valid "
         r"JSON \(JSON nested deeper than 64 levels"),
        (f"{UP}.weight", '{"_type": "NVFP4Tensor", "_data": ' + HUGE + "}",
         r"'model\.layers\.0\.mlp\.up_proj\.weight' \(torchao\) is not valid JSON \(an integer of "
         r"5000 digits"),
        ("tensor_names", DEEP, r"'tensor_names' \(torchao\) is not valid JSON \(JSON nested"),
        ("tensor_names", '{"a": 1}', r"'tensor_names' \(torchao\) must be a list of tensor names"),
        (f"{UP}.weight", "[1, 2]", r"'model\.layers\.0\.mlp\.up_proj\.weight' \(torchao\) must be "
         r"a JSON object"),
    ],
    ids=["entry-deep", "entry-huge-int", "names-deep", "names-not-a-list", "entry-not-an-object"],
)  # fmt: skip
def test_hostile_torchao_header_metadata_is_named(tmp_path, key, value, why):
    path = _copy(TORCHAO, tmp_path / "m")
    _edit_tensors(path, metadata=lambda m: {**m, key: value})
    _refused(path, rf"load: .*/m: safetensors __metadata__ {why}")


def _ct_group(q: dict) -> dict:
    return q["config_groups"]["group_0"]


@pytest.mark.parametrize(
    ("change", "field"),
    [
        (lambda q: q.update(config_groups=[_ct_group(q)]), r"config_groups is \[\{"),
        (lambda q: q.update(config_groups="group_0"), r"config_groups is 'group_0'"),
        (lambda q: _ct_group(q).update(weights=["int"]), r"\['group_0'\]\.weights is \['int'\]"),
        (lambda q: _ct_group(q)["weights"].update(num_bits=0), r"weights\.num_bits is 0"),
        (lambda q: _ct_group(q)["weights"].update(num_bits="4"), r"weights\.num_bits is '4'"),
        (lambda q: _ct_group(q)["weights"].update(num_bits=True), r"weights\.num_bits is True"),
        (lambda q: _ct_group(q)["weights"].update(group_size=0), r"weights\.group_size is 0"),
        (lambda q: _ct_group(q)["weights"].update(group_size=10**25),
         r"weights\.group_size is 10000000000000000000000000"),
        (lambda q: _ct_group(q)["weights"].update(block_structure=[0, 128]),
         r"weights\.block_structure must be two positive ints"),
        (lambda q: _ct_group(q)["weights"].update(strategy=["group"]), r"weights\.strategy is"),
        (lambda q: _ct_group(q)["weights"].update(symmetric="yes"), r"weights\.symmetric is 'yes'"),
        (lambda q: _ct_group(q).update(targets="Linear"), r"\['group_0'\]\.targets is 'Linear'"),
        (lambda q: _ct_group(q).update(format=["pack-quantized"]), r"\]\.format is \["),
        (lambda q: q.update(ignore="lm_head"), r"\.ignore is 'lm_head'; expected a list of"),
        (lambda q: q.update(format=7), r"\.format is 7; expected a string"),
        (lambda q: q.update(kv_cache_scheme=[8]), r"\.kv_cache_scheme is \[8\]; expected an"),
    ],
    ids=["groups-list", "groups-str", "weights-list", "bits-0", "bits-str", "bits-bool",
         "group-size-0", "group-size-huge", "block-0", "strategy-list", "symmetric-str",
         "targets-str", "group-format-list", "ignore-str", "format-int", "kv-list"],
)  # fmt: skip
def test_compressed_tensors_fields_of_the_wrong_kind_are_named(tmp_path, change, field):
    path = _copy(PACKED, tmp_path / "m")
    _edit_json(path, "config.json", lambda c: change(c["quantization_config"]))
    _refused(path, rf"load: .*/m/config\.json quantization_config.*{field}")


@pytest.mark.parametrize("block", [[0, 64], [64, -64], [64], [True, 64], "64x64"])
def test_an_fp8_block_size_that_is_not_two_positive_ints_is_refused_by_inspect_too(tmp_path, block):
    path = _copy(FP8_BLOCK, tmp_path / "m")
    _edit_payloads(path, lambda q: q.update(weight_block_size=block))
    # (under the test suite's type-checking import hook, "64x64" fails FP8Config's annotation)
    _refused(path, r"(?s)/m/config\.json quantization payload: .*weight_block_size")


def test_a_transformers_fp8_block_size_of_zero_is_refused_by_inspect_too(tmp_path):
    path = _copy(FP8_BLOCK, tmp_path / "m")
    (path / "quantize_config.json").unlink()
    _edit_json(
        path,
        "config.json",
        lambda c: c.update(
            quantization_config={"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [0, 64]}
        ),
    )
    _refused(path, r"config\.json weight_block_size must be two positive ints .* got \[0, 64\]")


@pytest.mark.parametrize(
    ("stored", "dtype"),
    [
        (lambda t: t.float().to(torch.float8_e4m3fn), "torch.float8_e4m3fn"),
        (lambda t: t.float().to(torch.float8_e5m2), "torch.float8_e5m2"),
        (lambda t: (t.float() * 1000).to(torch.int32), "torch.int32"),
        (lambda t: t.float().to(torch.complex64), "torch.complex64"),
    ],
    ids=["e4m3", "e5m2", "int32", "complex"],
)
def test_gptq_scales_of_a_dtype_no_producer_writes_are_named(tmp_path, stored, dtype):
    path = _copy(GPTQ, tmp_path / "m")
    _edit_tensors(path, lambda s: s.__setitem__(f"{DOWN}.scales", stored(s[f"{DOWN}.scales"])))
    _refused(
        path,
        rf"{DOWN}\.scales in model\.safetensors has dtype {dtype}; GPTQ scales are floating: "
        r"float16, bfloat16 or float32",
        inspect=False,
    )


# ----------------------------------------------------------------------------------------------
# 6. values that pass a check and break later
# ----------------------------------------------------------------------------------------------


def _logits(model: nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([[3, 17, 42, 99, 5]])).logits


def test_float64_scales_in_fp32_range_load_as_the_float16_ones(tmp_path):
    path = _copy(GPTQ, tmp_path / "m")
    _edit_tensors(path, lambda s: s.__setitem__(f"{DOWN}.scales", s[f"{DOWN}.scales"].double()))
    reference = floatxq.load(GPTQ, dtype=torch.float32)
    loaded = floatxq.load(path, dtype=torch.float32)
    assert loaded.model.get_submodule(DOWN).scales.dtype == torch.float64
    assert torch.equal(_logits(loaded.model), _logits(reference.model))


@pytest.mark.parametrize(
    ("value", "whole", "match"),
    [
        (1e300, True, r"has 384 value\(s\) that exceed FP32's range"),
        (1e-300, True, r"holds 384 scale\(s\) that are NaN or infinite, zero or negative, such "
         r"as \[0\.0"),  # positive in float64, zero in FP32
        (-1e-3, False, r"holds 1 scale\(s\) that are NaN or infinite, zero or negative, such as "
         r"\[-0\.001"),
        (0.0, False, r"holds 1 scale\(s\) that are NaN .* zero or negative, such as \[0\.0\]"),
        (-0.0, False, r"holds 1 scale\(s\) that are NaN .* zero or negative, such as \[-0\.0\]"),
    ],
    ids=["f64-overflow", "f64-underflow", "negative", "zero", "negative-zero"],
)  # fmt: skip
def test_gptq_scales_that_are_not_positive_and_finite_in_fp32_are_named(
    tmp_path, value, whole, match
):
    path = _copy(GPTQ, tmp_path / "m")
    name = f"{DOWN}.scales"

    def damage(state):
        if whole:  # every scale, stored as float64
            state[name] = torch.full(state[name].shape, value, dtype=torch.float64)
        else:  # one scale of the float16 tensor
            state[name][0, 0] = value

    _edit_tensors(path, damage)
    _refused(path, rf"load: {name} in model\.safetensors {match}", inspect=False)


def test_a_scale_whose_weights_overflow_the_model_dtype_is_refused_in_that_dtype(tmp_path):
    path = _copy(GPTQ, tmp_path / "m")
    name = f"{DOWN}.scales"
    _edit_tensors(path, lambda s: s[name].__setitem__((1, 3), 8192.0))  # x 15 > 65504
    assert floatxq.load(path, dtype=torch.bfloat16).quantized  # 8192 * 15 fits bfloat16
    _refused(
        path,
        rf"{name} in model\.safetensors holds a scale of 8192: with 4-bit codes \(\|code - zero\| "
        r"up to 15\) it decodes to weights beyond torch\.float16's range \(65504\)",
        inspect=False,
        dtype=torch.float16,
    )


def test_pack_quantized_scales_of_zero_are_named(tmp_path):
    path = _copy(PACKED, tmp_path / "m")
    name = "model.layers.1.mlp.down_proj.weight_scale"
    _edit_tensors(path, lambda s: s[name].__setitem__((0, 0), 0.0))
    _refused(path, rf"{name} in model\.safetensors holds 1 scale\(s\) .* zero or negative",
             inspect=False)  # fmt: skip


@pytest.mark.parametrize(
    ("value", "bits"),
    [(-0.0, "0x80000000"), (-1e-45, "0x80000001"), (float("-inf"), "0xff800000")],
    ids=["negative-zero", "negative-subnormal", "negative-inf"],
)
def test_activation_scale_bits_other_than_zero_or_positive_finite_are_named(
    w4a, tmp_path, value, bits
):
    path = _copy(w4a, tmp_path / "m")
    key = f"{DOWN}.{BITS}"
    pattern = torch.tensor(value, dtype=torch.float32).view(torch.int32)
    _edit_tensors(path, lambda s: s.__setitem__(key, pattern))
    match = (
        rf"load: .*{key} in model\.safetensors holds .*; an activation global scale is 0\.0 "
        rf"\(dynamic\) or a positive finite FP32 value \(got bits {bits}"
    )
    _refused(path, match, inspect=False)


@pytest.mark.parametrize(
    ("field", "value", "match"),
    [
        ("intermediate_size", 10**8, r"builds model\.layers\.0\.mlp\.gate_proj as a "
         r"\(100000000, 128\) linear, but model\.safetensors stores "
         r"model\.layers\.0\.mlp\.gate_proj\.qweight of shape \(16, 192\)"),
        ("intermediate_size", 256, r"intermediate_size=256.* builds model\.layers\.0\.mlp\."
         r"gate_proj as a \(256, 128\) linear"),
        ("vocab_size", 10**6, r"vocab_size=1000000.* builds model\.embed_tokens\.weight of shape "
         r"\(1000000, 128\), but model\.safetensors stores it as \(128, 128\)"),
        ("hidden_size", 256, r"hidden_size=256.* builds model\.embed_tokens\.weight of shape "
         r"\(128, 256\)"),
        ("num_key_value_heads", 4, r"builds model\.layers\.0\.self_attn\.k_proj as a \(128, 128\) "
         r"linear, but .*k_proj\.qweight of shape \(16, 64\) \(a \(64, \?\) weight\)"),
        ("head_dim", 64, r"head_dim=64.* builds model\.layers\.0\.self_attn\.q_proj as a "
         r"\(256, 128\) linear"),
        ("num_key_value_heads", 3, r"num_key_value_heads 3 does not divide num_attention_heads 4"),
        ("hidden_size", "128", r"hidden_size is '128'; a size must be an int from 1 to 2147483647"),
        ("hidden_size", True, r"hidden_size is True; a size must be an int"),
        ("vocab_size", 2**40, r"vocab_size is 1099511627776; a size must be an int from 1 to"),
        ("num_attention_heads", 0, r"num_attention_heads is 0; a size must be an int from 1"),
        ("intermediate_size", -5, r"intermediate_size is -5; a size must be an int from 0"),
        ("max_position_embeddings", 1.5, r"max_position_embeddings is 1\.5; a size must be an int"),
    ],
    ids=["intermediate-huge", "intermediate", "vocab", "hidden", "kv-heads", "head-dim",
         "kv-not-dividing", "str", "bool", "beyond-int32", "zero-heads", "negative", "float"],
)  # fmt: skip
def test_config_sizes_the_tensors_contradict_are_refused_before_the_build(
    tmp_path, field, value, match
):
    path = _copy(GPTQ, tmp_path / "m")
    _edit_json(path, "config.json", lambda c: c.update({field: value}))
    message = _refused(path, rf"load: .*/m/config\.json .*{match}", inspect=False)
    assert "Error(s) in loading state_dict" not in message


def test_a_dense_checkpoint_whose_config_sizes_differ_is_refused_by_name(tmp_path):
    path = _copy(DENSE, tmp_path / "m")
    _edit_json(path, "config.json", lambda c: c.update(vocab_size=1000))
    _refused(path, r"vocab_size=1000.* builds model\.embed_tokens\.weight of shape \(1000, 128\)",
             inspect=False)  # fmt: skip


def test_missing_tensors_that_a_config_sizes_huge_are_refused_before_allocation(tmp_path):
    # No stored tensor to compare the MLP with: the model's element count against the files'.
    path = _copy(DENSE, tmp_path / "m")
    _edit_tensors(path, lambda s: [s.pop(k) for k in list(s) if ".mlp." in k])
    _edit_json(path, "config.json", lambda c: c.update(intermediate_size=10**7))
    match = (
        r"intermediate_size=10000000.* builds a model of \d+ elements, but the files hold \d+ "
        r"bytes \(at most 4 weights a byte\)"
    )
    message = _refused(path, match, inspect=False)
    assert int(message.split(" builds a model of ")[1].split()[0]) > 7 * 10**9


def test_an_unbuildable_config_is_a_checkpoint_error(tmp_path):
    path = _copy(GPTQ, tmp_path / "m")
    _edit_json(path, "config.json", lambda c: c.update(model_type="no_such_model"))
    _refused(path, r"config\.json does not build a model \(ValueError", inspect=False)


# ----------------------------------------------------------------------------------------------
# 7. contradictions that were accepted silently
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("entry", "module"),
    [
        ("model.layers.1.mlp.down_proj", r"model\.layers\.1\.mlp\.down_proj"),
        ("re:.*mlp\\.up_proj$", r"model\.layers\.0\.mlp\.up_proj"),
        ("Linear", r"model\.layers\.\d\.\S+_proj"),  # a class name: every Linear
    ],
    ids=["exact", "regex", "class"],
)
def test_a_compressed_tensors_ignore_entry_naming_a_quantized_module_is_refused(
    tmp_path, entry, module
):
    path = _copy(PACKED, tmp_path / "m")
    _edit_json(path, "config.json", lambda c: c["quantization_config"]["ignore"].append(entry))
    quoted = re.escape(repr(entry))
    _refused(
        path,
        rf"load: {module} in model\.safetensors holds quantized tensors \(weight_packed, "
        rf"weight_scale, weight_shape\), but the quantization_config's ignore entry "
        rf"{quoted} leaves it unquantized",
        inspect=False,
    )


def test_ignore_entries_that_match_no_quantized_module_load(tmp_path):
    path = _copy(PACKED, tmp_path / "m")
    extra = ["re:.*norm$", "model.layers.0.mlp.down", "Embedding", "re:lm_head"]
    _edit_json(path, "config.json", lambda c: c["quantization_config"]["ignore"].extend(extra))
    assert len(floatxq.load(path).quantized_modules) == 14


def test_a_nested_quantifier_ignore_regex_is_matched_within_its_time_bound(tmp_path):
    # not refused up front: the regex engine matches it in microseconds on module names, and a
    # match that runs past the timeout is refused by name (tests/test_library_swaps.py)
    path = _copy(PACKED, tmp_path / "m")
    _edit_json(
        path, "config.json", lambda c: c["quantization_config"]["ignore"].append("re:(a*)*$")
    )
    assert len(floatxq.load(path).quantized_modules) == 14


def _torchao_data(metadata: dict, **changes) -> dict:
    entry = json.loads(metadata[f"{UP}.weight"])
    entry["_data"].update(changes)
    return {**metadata, f"{UP}.weight": json.dumps(entry)}


@pytest.mark.parametrize(
    ("changes", "match"),
    [
        ({"block_size": 32}, r"declares block_size 32; NVFP4 .* uses blocks of 16"),
        ({"block_size": "16"}, r"declares block_size '16'; NVFP4"),
        ({"block_size": None}, r"declares block_size None; NVFP4"),
        ({"is_swizzled_scales": "false"}, r"is_swizzled_scales is 'false'; expected true or false"),
    ],
    ids=["block-32", "block-str", "block-null", "swizzled-str"],
)
def test_torchao_metadata_that_contradicts_the_layout_is_refused(tmp_path, changes, match):
    path = _copy(TORCHAO, tmp_path / "m")
    _edit_tensors(path, metadata=lambda m: _torchao_data(m, **changes))
    _refused(path, rf"'model\.layers\.0\.mlp\.up_proj\.weight' \(torchao\) {match}")


def test_torchao_metadata_that_states_the_block_of_16_loads(tmp_path):
    path = _copy(TORCHAO, tmp_path / "m")
    _edit_tensors(path, metadata=lambda m: _torchao_data(m, block_size=16))
    assert UP in floatxq.load(path).quantized_modules


@pytest.fixture(scope="module")
def comfy(tmp_path_factory) -> Path:
    from floatxq.testing.foreign import write_comfy_nvfp4

    return write_comfy_nvfp4(DENSE, tmp_path_factory.mktemp("comfy") / "c").path


Q = "model.layers.0.self_attn.q_proj"
MARKER = list(b'{"format": "nvfp4"}')


@pytest.mark.parametrize(
    ("marker", "match"),
    [
        (torch.tensor(MARKER, dtype=torch.int32), r"is a torch\.int32 tensor of shape \(19,\)"),
        (torch.tensor(MARKER, dtype=torch.float32), r"is a torch\.float32 tensor"),
        (torch.tensor(MARKER, dtype=torch.int8), r"is a torch\.int8 tensor"),
        (torch.tensor([MARKER], dtype=torch.uint8), r"is a torch\.uint8 tensor of shape \(1, 19\)"),
        (torch.tensor(list(DEEP.encode()), dtype=torch.uint8),
         r"is not UTF-8 JSON \(JSON nested deeper than 64 levels\)"),
        (torch.tensor([0xFF, 0xFE], dtype=torch.uint8), r"is not UTF-8 JSON \(not UTF-8 text"),
        (torch.tensor(list(b'{"format": 4}'), dtype=torch.uint8), r"has no 'format' string"),
    ],
    ids=["int32", "float32", "int8", "2-d", "deep", "not-utf8", "format-int"],
)  # fmt: skip
def test_a_comfy_marker_that_is_not_uint8_json_bytes_is_refused(comfy, tmp_path, marker, match):
    path = _copy(comfy, tmp_path / "m")
    _edit_tensors(path, lambda s: s.__setitem__(f"{Q}.comfy_quant", marker))
    _refused(path, rf"load: {Q}\.comfy_quant in model\.safetensors {match}", inspect=False)


def test_the_comfy_checkpoint_loads(comfy):
    assert Q in floatxq.load(comfy).quantized_modules


@pytest.mark.parametrize("recipe", [False, "", 0, [], "lsq-typo"])
def test_a_recipe_that_is_not_a_name_is_refused_not_defaulted(w4a, tmp_path, recipe):
    path = _copy(w4a, tmp_path / "m")
    _edit_payloads(path, lambda q: _policy(q).update(recipe=recipe))
    why = (
        r"Unsupported NVFP4 scale recipe: 'lsq-typo'"
        if recipe == "lsq-typo"
        else rf"ActivationConfig\.from_dict: recipe must be an NVFP4 recipe name \(a non-empty "
        rf"string\), or None for the default 'least_squares'; got {re.escape(repr(recipe))}"
    )
    _refused(path, rf"/m/config\.json GPTQ quantization payload: {why}")


def test_a_missing_or_null_recipe_keeps_meaning_the_default():
    assert ActivationConfig(mode="w4a_nvfp4").recipe == "least_squares"
    assert ActivationConfig.from_dict({"mode": "w4a_nvfp4", "recipe": None}).recipe == (
        "least_squares"
    )
    with pytest.raises(ValueError, match=r"from_dict: recipe must be an NVFP4 recipe name"):
        ActivationConfig.from_dict({"mode": "w4a_nvfp4", "recipe": False})
    with pytest.raises(ValueError, match=r"from_dict: FP8 activations do not use an NVFP4 scale"):
        ActivationConfig.from_dict({"mode": "w4afp8", "recipe": ""})


def test_a_global_scale_beyond_float64_is_a_value_error():
    with pytest.raises(ValueError, match=r"= an int of 1329 bits is inf in FP32"):
        ActivationConfig(mode="w4a_nvfp4", global_scales={"model.layers.0.input": 10**400})


@pytest.mark.parametrize("value", [-0.0, float("nan"), float("inf"), -1.0])
def test_stream_scale_buffers_refuse_what_a_file_check_refuses(value):
    from floatxq.lifecycle.stream.codec import StreamScales

    scales = StreamScales({"a": "model.layers.0.input"})
    with pytest.raises(ValueError, match=r"a: the activation global scale must be 0.0"):
        scales.load_state_dict({"a": torch.tensor(value).view(torch.int32)})
    assert int(scales.a) == 0 and scales.calibrated == set()
    scales.load_state_dict({"a": torch.tensor(0.5).view(torch.int32)})
    assert scales.calibrated == {"a"} and float(scales.a.view(torch.float32)) == 0.5
