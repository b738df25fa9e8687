"""GPTQ checkpoints: floatxq's ``gptq`` and ``compressed-tensors`` saves, and other tools' files.

The model is the tiny random Llama of ``tests/fixtures`` with its decoder linears replaced by
``GPTQLinear`` modules (round-to-nearest, or a ``desc_act`` solve for non-contiguous ``g_idx``).
Where another tool reads or writes the same files it is the judge: compressed-tensors' own schema
and compressor, transformers with compressed-tensors, GPT-QModel's recorded logits and decoded
weights (``tests/fixtures/make_gptq_fixtures.py``), llm-compressor's files.
"""

import dataclasses
import hashlib
import json
import runpy
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file
from torch import nn

import floatxq
from floatxq.config import BACKEND, FP8Config, GPTQConfig
from floatxq.gptq.hessian import hessian_finalize, hessian_init, hessian_update
from floatxq.gptq.solve import gptq_solve, rtn_quantize
from floatxq.interop.export import export_layout
from floatxq.lifecycle import inspect_checkpoint
from floatxq.lifecycle.gptq import gptq_solve_options
from floatxq.lifecycle.model import QuantizedModel
from floatxq.nn.fp8_linear import TorchFP8Linear
from floatxq.nn.gptq_linear import GPTQLinear

transformers = pytest.importorskip("transformers")

FIXTURES = Path(__file__).parent / "fixtures"
BASE = FIXTURES / "tiny_random_llama"
IDS = torch.tensor([[1, 2, 3, 4, 5, 6, 7]])
DOWN = "model.layers.0.mlp.down_proj"


def _solution(weight: torch.Tensor, config: GPTQConfig, seed: int):
    options = gptq_solve_options(config)
    if not config.desc_act:
        return rtn_quantize(weight, options)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(256, weight.shape[1], generator=g) * torch.rand(weight.shape[1], generator=g)
    hessian = hessian_finalize(hessian_update(hessian_init(weight.shape[1]), x))
    return gptq_solve(weight, hessian, options)


def gptq_model(
    config: GPTQConfig,
    dtype: torch.dtype = torch.float32,
    *,
    bias: bool = False,
    edit=None,
    head: bool = False,
) -> QuantizedModel:
    """The tiny Llama with every decoder linear the config resolves (and ``lm_head`` when
    ``head``) replaced by a GPTQLinear."""
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    if bias:  # attention and MLP biases (a random init of the same shapes)
        options = json.loads((BASE / "config.json").read_text())
        options.update(attention_bias=True, mlp_bias=True)
        torch.manual_seed(0)
        model = LlamaForCausalLM(LlamaConfig(**options)).to(dtype).eval()
    else:
        model = AutoModelForCausalLM.from_pretrained(BASE, dtype=dtype).eval()
    for seed, (name, module) in enumerate(list(model.named_modules())):
        if not isinstance(module, nn.Linear) or (name == "lm_head" and not head):
            continue
        resolved = config.resolve(name)
        if resolved is None:
            continue
        weight = module.weight.detach().float()
        if edit is not None:
            weight = edit(name, weight)
        layer = GPTQLinear.from_solution(
            _solution(weight, resolved, seed),
            bits=resolved.bits,
            group_size=resolved.group_size,
            format=config.format,
            bias=None if module.bias is None else module.bias.detach().half(),
        )
        model.set_submodule(name, layer)
    return QuantizedModel(model, quantize_config=config, backend=BACKEND.GPTQ_TORCH, quantized=True)


def _logits(model: nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model(IDS).logits


def _assert_same_state(a: nn.Module, b: nn.Module) -> None:
    left, right = a.state_dict(), b.state_dict()
    assert sorted(left) == sorted(right)
    for key in left:
        assert left[key].dtype == right[key].dtype, key
        assert torch.equal(left[key], right[key]), key
    kinds = lambda m: {n: type(x).__name__ for n, x in m.named_modules() if "proj" in n}
    assert kinds(a) == kinds(b)


# ----------------------------------------------------------------------------------------------
# layout="gptq": save -> load is bit-exact
# ----------------------------------------------------------------------------------------------

ROUND_TRIPS = {
    "sym4_g128_v1": GPTQConfig(bits=4, group_size=128, sym=True),  # 192-wide down_proj: 2 groups
    "asym4_g32_v2": GPTQConfig(bits=4, group_size=32, sym=False, format="gptq_v2"),
    "sym2_g32_v1": GPTQConfig(bits=2, group_size=32, sym=True),
    "asym8_row_v2": GPTQConfig(bits=8, group_size=-1, sym=False, format="gptq_v2"),
    "desc_act_asym4_g64": GPTQConfig(
        bits=4, group_size=64, sym=False, desc_act=True, act_group_aware=False, format="gptq_v2"
    ),
    "dynamic": GPTQConfig(
        bits=4,
        group_size=64,
        dynamic={r"+:.*down_proj": {"bits": 8, "group_size": 32}, r"-:.*o_proj": {}},
    ),
}


@pytest.mark.parametrize("name", sorted(ROUND_TRIPS))
def test_gptq_save_load_is_bit_exact(tmp_path, name):
    config = ROUND_TRIPS[name]
    model = gptq_model(config)
    model.save(tmp_path / "m", layout="gptq")
    back = floatxq.load(tmp_path / "m")
    assert back.quantized and back.quantize_config == config
    assert back.backend == BACKEND.GPTQ_TORCH and back.layout.layout == "gptq"
    _assert_same_state(model.model, back.model)
    assert torch.equal(_logits(model.model), _logits(back.model))
    if name == "desc_act_asym4_g64":
        g_idx = back.model.get_submodule(DOWN).g_idx
        assert not torch.equal(g_idx, torch.arange(192, dtype=torch.int32) // 64)
    if name == "dynamic":
        assert type(back.model.get_submodule("model.layers.1.self_attn.o_proj")) is nn.Linear
        assert back.model.get_submodule(DOWN).bits == 8


def test_a_quantized_lm_head_round_trips_and_needs_lm_head_true(tmp_path):
    config = GPTQConfig(bits=8, group_size=32, lm_head=True)
    model = gptq_model(config, head=True)
    model.save(tmp_path / "m", layout="gptq")
    back = floatxq.load(tmp_path / "m")
    assert isinstance(back.model.lm_head, GPTQLinear) and back.quantize_config.lm_head
    _assert_same_state(model.model, back.model)
    model.quantize_config = dataclasses.replace(config, lm_head=False)
    with pytest.raises(ValueError, match=r"'lm_head' .* excludes it \(lm_head=False\)"):
        model.save(tmp_path / "refused", layout="gptq")


def test_gptq_files_are_gptqmodels_keys_and_payload(tmp_path):
    config = ROUND_TRIPS["dynamic"]
    model = gptq_model(config)
    model.save(tmp_path / "m", layout="gptqmodel")  # the same files for a GPTQ model
    payload = json.loads((tmp_path / "m" / "config.json").read_text())["quantization_config"]
    quantize = json.loads((tmp_path / "m" / "quantize_config.json").read_text())
    assert payload == quantize
    assert {k: payload[k] for k in ("quant_method", "checkpoint_format", "pack_dtype")} == {
        "quant_method": "gptq",
        "checkpoint_format": "gptq",
        "pack_dtype": "int32",
    }
    assert (payload["bits"], payload["group_size"], payload["sym"], payload["desc_act"]) == (
        4,
        64,
        True,
        False,
    )
    assert payload["dynamic"] == {r"+:.*down_proj": {"bits": 8, "group_size": 32}, "-:.*o_proj": {}}
    state = load_file(str(tmp_path / "m" / "model.safetensors"))
    got = {k.rsplit(".", 1)[1]: (v.dtype, tuple(v.shape)) for k, v in state.items() if DOWN in k}
    assert got == {  # 8-bit, group 32: in=192 -> 48 rows of words, 6 groups
        "qweight": (torch.int32, (48, 128)),
        "qzeros": (torch.int32, (6, 32)),
        "scales": (torch.float16, (6, 128)),
        "g_idx": (torch.int32, (192,)),
    }
    assert not any(k.startswith("model.layers.0.self_attn.o_proj.q") for k in state)


def test_symmetric_v1_zero_words_are_gptqmodels(tmp_path):
    gptq_model(GPTQConfig(bits=4, group_size=64)).save(tmp_path / "m", layout="gptq")
    qzeros = load_file(str(tmp_path / "m" / "model.safetensors"))[f"{DOWN}.qzeros"]
    assert bool((qzeros == 0x77777777).all())  # zero 8 stored as 7 in every nibble


def test_a_module_held_in_the_other_format_is_converted_exactly(tmp_path):
    model = gptq_model(GPTQConfig(bits=4, group_size=32, sym=False, format="gptq_v2"))
    model.quantize_config = dataclasses.replace(model.quantize_config, format="gptq")
    # a zero point of 0 has no v1 form (refused elsewhere); this model must not hold one
    assert not any(
        m.unpacked().zeros.eq(0).any() for m in model.model.modules() if hasattr(m, "qzeros")
    )
    model.save(tmp_path / "m", layout="gptq")
    back = floatxq.load(tmp_path / "m")
    for name, module in model.model.named_modules():
        if isinstance(module, GPTQLinear):
            loaded = back.model.get_submodule(name)
            assert loaded.format == "gptq"
            for a, b in zip(module.unpacked(), loaded.unpacked(), strict=True):
                assert torch.equal(a, b), name
    assert torch.equal(_logits(model.model), _logits(back.model))


def test_biases_are_kept_as_stored(tmp_path):
    config = GPTQConfig(bits=4, group_size=32)
    model = gptq_model(config, bias=True)
    assert model.model.get_submodule(DOWN).bias.dtype == torch.float16
    for layout in ("gptq", "compressed-tensors"):
        model.save(tmp_path / layout, layout=layout)
        back = floatxq.load(tmp_path / layout, dtype=torch.float32)
        loaded = back.model.get_submodule(DOWN)
        assert loaded.bias.dtype == torch.float16
        assert torch.equal(loaded.bias, model.model.get_submodule(DOWN).bias)
        assert torch.equal(_logits(model.model), _logits(back.model))


def test_bfloat16_scales_are_written_as_float16_when_exact(tmp_path):
    model = gptq_model(GPTQConfig(bits=4, group_size=64))
    module = model.model.get_submodule(DOWN)
    module.scales = module.scales.to(torch.bfloat16)  # every bf16 value here is an fp16 value
    model.save(tmp_path / "m", layout="gptq")
    loaded = floatxq.load(tmp_path / "m").model.get_submodule(DOWN)
    assert loaded.scales.dtype == torch.float16
    assert torch.equal(loaded.scales.to(torch.bfloat16), module.scales)


# ----------------------------------------------------------------------------------------------
# What a save refuses (the ValueError names the module and the layouts that hold it)
# ----------------------------------------------------------------------------------------------


def _positive_group(name: str, weight: torch.Tensor) -> torch.Tensor:
    """Make the first group of row 3 all positive, so its asymmetric zero point is 0."""
    if name == DOWN:
        weight = weight.clone()
        weight[3, :64] = weight[3, :64].abs() + 0.01
    return weight


def test_a_zero_point_of_zero_is_refused_in_v1_and_written_in_v2(tmp_path):
    config = GPTQConfig(bits=4, group_size=64, sym=False)
    model = gptq_model(config, edit=_positive_group)
    assert int(model.model.get_submodule(DOWN).unpacked().zeros[0, 3]) == 0
    with pytest.raises(ValueError, match=rf"{DOWN}.*zero point of 0 \(group 0, output column 3\)"):
        model.save(tmp_path / "v1", layout="gptq")
    assert not (tmp_path / "v1").exists()
    model.quantize_config = dataclasses.replace(config, format="gptq_v2")
    model.save(tmp_path / "v2", layout="gptq")
    back = floatxq.load(tmp_path / "v2")
    assert back.quantize_config.format == "gptq_v2"
    assert torch.equal(_logits(model.model), _logits(back.model))


@pytest.mark.parametrize(
    "change, match",
    [
        (dict(sym=True), "declares sym=True"),
        (dict(bits=8), r"gives it bits=8, group_size=64"),
        (dict(group_size=32), r"gives it bits=4, group_size=32"),
        (dict(dynamic={r"-:.*up_proj": {}}), r"up_proj.*excludes it \(a '-:' dynamic rule\)"),
    ],
    ids=["sym", "bits", "group_size", "excluded"],
)
def test_a_config_that_misdescribes_the_modules_is_refused(tmp_path, change, match):
    model = gptq_model(GPTQConfig(bits=4, group_size=64, sym=False, format="gptq_v2"))
    model.quantize_config = dataclasses.replace(model.quantize_config, **change)
    with pytest.raises(ValueError, match=match):
        model.save(tmp_path / "m", layout="gptq")


def test_a_reordering_g_idx_needs_desc_act(tmp_path):
    config = ROUND_TRIPS["desc_act_asym4_g64"]
    model = gptq_model(config)
    model.quantize_config = dataclasses.replace(config, desc_act=False)
    with pytest.raises(ValueError, match=r"reorders its groups.*desc_act=False"):
        model.save(tmp_path / "m", layout="gptq")


def test_scales_float16_cannot_hold_are_refused_naming_the_module(tmp_path):
    model = gptq_model(GPTQConfig(bits=4, group_size=64))
    module = model.model.get_submodule(DOWN)
    module.scales = module.scales.float() * (1 + 2**-20)  # between float16 values
    with pytest.raises(ValueError, match=rf"{DOWN}.*float32 scales that float16 cannot hold"):
        model.save(tmp_path / "m", layout="gptq")


@pytest.mark.parametrize(
    "config, why",
    [
        (ROUND_TRIPS["desc_act_asym4_g64"], "reorders the groups"),
        (GPTQConfig(bits=4, group_size=128), "in_features=192 is not a multiple of group_size"),
    ],
    ids=["desc_act", "ragged"],
)
def test_compressed_tensors_refuses_what_it_cannot_store(tmp_path, config, why):
    model = gptq_model(config)
    with pytest.raises(
        ValueError, match=rf"'compressed-tensors' cannot hold module .*{why}.*'gptq'"
    ):
        model.save(tmp_path / "m", layout="compressed-tensors")
    model.save(tmp_path / "gptq", layout="gptq")


def test_layouts_that_cannot_mix_fp8_and_gptq_refuse(tmp_path):
    model = gptq_model(GPTQConfig(bits=4, group_size=64, dynamic={r"-:.*o_proj": {}}))
    o_proj = "model.layers.0.self_attn.o_proj"
    model.model.set_submodule(o_proj, TorchFP8Linear.from_linear(model.model.get_submodule(o_proj)))
    with pytest.raises(ValueError, match=rf"'gptq' cannot hold module '{o_proj}'"):
        export_layout(model.model, model.quantize_config, "gptq")
    with pytest.raises(ValueError, match=r"'hf' cannot hold module .*GPTQ 4-bit"):
        export_layout(model.model, FP8Config(), "hf")
    out = export_layout(model.model, None, "compressed-tensors")
    assert out.quantization_config["format"] == "mixed-precision"
    formats = {g["format"] for g in out.quantization_config["config_groups"].values()}
    assert formats == {"pack-quantized", "float-quantized"}
    model.save(tmp_path / "mixed", layout="compressed-tensors")
    back = floatxq.load(tmp_path / "mixed")
    assert back.quantize_config is None  # one config cannot describe both methods
    assert isinstance(back.model.get_submodule(o_proj), TorchFP8Linear)
    for name, module in model.model.named_modules():
        if isinstance(module, GPTQLinear):
            loaded = back.model.get_submodule(name)
            assert torch.equal(loaded.dequantize_weight(), module.dequantize_weight()), name
    # the FP8 scale is stored as its FP32 reciprocal: weights within 1.5 FP32 ulp (export.py)
    torch.testing.assert_close(_logits(back.model), _logits(model.model), rtol=0, atol=1e-5)


def test_gptq_layout_needs_a_gptq_config_and_gptq_modules():
    model = gptq_model(GPTQConfig(bits=4, group_size=64))
    with pytest.raises(TypeError, match="GPTQConfig"):
        export_layout(model.model, FP8Config(), "gptq")
    fp8 = nn.Sequential(TorchFP8Linear.from_linear(nn.Linear(64, 32)))
    with pytest.raises(ValueError, match=r"'gptq' cannot hold module '0'.*GPTQ modules only"):
        export_layout(fp8, GPTQConfig(), "gptq")


# ----------------------------------------------------------------------------------------------
# layout="compressed-tensors": judged by compressed-tensors and transformers
# ----------------------------------------------------------------------------------------------

CT_CONFIGS = {
    "sym4_g64": GPTQConfig(bits=4, group_size=64),
    "asym4_g32": GPTQConfig(bits=4, group_size=32, sym=False, format="gptq_v2"),
    "sym8_row": GPTQConfig(bits=8, group_size=-1),
    "asym2_g64": GPTQConfig(bits=2, group_size=64, sym=False),
    "dynamic": GPTQConfig(bits=4, group_size=64, dynamic={r"+:.*down_proj": {"bits": 8}}),
}


def _ct_scheme(payload: dict, name: str):
    from compressed_tensors.quantization import QuantizationScheme

    groups = payload["config_groups"]
    for group in groups.values():
        if group["targets"] == ["Linear"] or name in group["targets"]:
            fields = ("targets", "weights", "input_activations", "output_activations")
            return QuantizationScheme(**{k: group[k] for k in fields}), group["format"]
    raise AssertionError(f"no config group targets {name}")


@pytest.mark.parametrize("name", sorted(CT_CONFIGS))
def test_compressed_tensors_export_is_what_compressed_tensors_writes(name):
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationConfig

    model = gptq_model(CT_CONFIGS[name])
    out = export_layout(model.model, model.quantize_config, "compressed-tensors")
    payload = QuantizationConfig.model_validate(out.quantization_config)  # its own schema
    assert payload.format == "pack-quantized" and payload.ignore == ["lm_head"]
    for module_name, module in model.model.named_modules():
        if not isinstance(module, GPTQLinear):
            continue
        scheme, fmt = _ct_scheme(out.quantization_config, module_name)
        compressor = BaseCompressor.get_value_from_registry(fmt)
        ours = {k.rsplit(".", 1)[1]: v for k, v in out.state.items() if k.startswith(module_name)}
        # compressed-tensors compresses the dense weight with our scales and zero points
        u = module.unpacked()
        zero = (u.zeros.T.to(torch.int16) - (1 << (module.bits - 1))).to(torch.int8)
        local = {"weight": module.dequantize_weight(torch.float32)}
        local["weight_scale"] = u.scales.T.float()
        if not scheme.weights.symmetric:
            local["weight_zero_point"] = zero
        theirs = compressor.compress(local, scheme)
        assert sorted(theirs) == sorted(ours), module_name
        for key in ("weight_packed", "weight_shape", "weight_zero_point"):
            if key in theirs:
                assert torch.equal(theirs[key], ours[key]), (module_name, key)
        assert torch.equal(theirs["weight_scale"], ours["weight_scale"].float())
        assert scheme.weights.symmetric == bool((u.zeros == 1 << (module.bits - 1)).all())
        # and decompresses our tensors to floatxq's weight (FP32 scales: the exact product)
        dense = compressor.decompress(
            {**ours, "weight_scale": ours["weight_scale"].float()}, scheme
        )
        assert torch.equal(dense["weight"], module.dequantize_weight(torch.float32)), module_name


@pytest.mark.parametrize("name", ["sym4_g64", "sym8_row", "dynamic"])
def test_transformers_runs_the_symmetric_export_like_floatxq(tmp_path, name):
    from transformers import AutoModelForCausalLM

    model = gptq_model(CT_CONFIGS[name])
    model.save(tmp_path / "m", layout="compressed-tensors")
    theirs = AutoModelForCausalLM.from_pretrained(tmp_path / "m")  # float32, decoded on load
    # float16 scales load exactly into float32 parameters and compressed-tensors forms the
    # FP32 product scale * (q - zero) that floatxq forms: the same weights, the same F.linear
    assert theirs.dtype == torch.float32
    assert torch.equal(_logits(theirs), _logits(model.model))


def test_transformers_rounds_float16_scales_into_a_bfloat16_model(tmp_path):
    # transformers allocates weight_scale in the model dtype: a bfloat16 model decodes with the
    # float16 scales rounded to bfloat16 (floatxq keeps them as stored); modelled exactly here
    from transformers import AutoModelForCausalLM

    from floatxq.gptq.int4 import GPTQPacked, dequantize_gptq

    model = gptq_model(CT_CONFIGS["sym4_g64"], torch.bfloat16)
    model.save(tmp_path / "m", layout="compressed-tensors")
    theirs = AutoModelForCausalLM.from_pretrained(tmp_path / "m")
    _logits(theirs)  # compressed-tensors decompresses on the first call
    assert theirs.dtype == torch.bfloat16
    rounded = 0
    for name, module in model.model.named_modules():
        if isinstance(module, GPTQLinear):
            p = module.packed()
            scales = p.scales.to(torch.bfloat16)
            rounded += int((scales.to(torch.float16) != p.scales).sum())
            packed = GPTQPacked(p.qweight, p.qzeros, scales, p.g_idx)
            expected = dequantize_gptq(packed, bits=4, format=module.format, dtype=torch.bfloat16)
            assert torch.equal(theirs.get_submodule(name).weight, expected), name
    assert rounded  # the rounding happened: floatxq's own weights differ from these


def test_transformers_never_misreads_asymmetric_pack_quantized_files(tmp_path):
    # transformers 5.24 + compressed-tensors 0.20.1 allocate weight_zero_point unpacked and stop
    # at the packed one (llm-compressor's own W4A16 asymmetric files too): refused, not misread.
    # Releases that do load them (5.17 here on the GPU machine) must compute floatxq's logits.
    from transformers import AutoModelForCausalLM

    model = gptq_model(CT_CONFIGS["asym4_g32"])
    model.save(tmp_path / "m", layout="compressed-tensors")
    try:
        theirs = AutoModelForCausalLM.from_pretrained(tmp_path / "m", dtype=torch.float32)
    except RuntimeError as exc:
        assert "mismatched_sizes" in str(exc)
    else:
        torch.testing.assert_close(_logits(theirs.eval()), _logits(model.model), rtol=0, atol=1e-5)
    try:
        AutoModelForCausalLM.from_pretrained(FIXTURES / "llmcompressor_w4a16_asym_g64")
    except RuntimeError as exc:
        assert "mismatched_sizes" in str(exc)


@pytest.mark.parametrize("name", ["asym4_g32", "dynamic"])
def test_compressed_tensors_save_load_keeps_every_value(tmp_path, name):
    model = gptq_model(CT_CONFIGS[name])
    model.save(tmp_path / "m", layout="compressed-tensors")
    back = floatxq.load(tmp_path / "m")
    assert back.layout.layout == "compressed-tensors"
    config = back.quantize_config
    assert isinstance(config, GPTQConfig) and config.format == "gptq_v2"  # the file's zero words
    for module_name, module in model.model.named_modules():
        if isinstance(module, GPTQLinear):
            loaded = back.model.get_submodule(module_name)
            assert (loaded.bits, loaded.group_size) == (module.bits, module.group_size)
            resolved = config.resolve(module_name)
            assert (resolved.bits, resolved.group_size) == (module.bits, module.group_size)
            for a, b in zip(module.unpacked(), loaded.unpacked(), strict=True):
                assert torch.equal(a, b), module_name
    assert torch.equal(_logits(model.model), _logits(back.model))
    if model.quantize_config.format == "gptq_v2":
        _assert_same_state(model.model, back.model)
    back.save(tmp_path / "again", layout="gptq")  # the described config is a valid gptq one
    assert torch.equal(_logits(floatxq.load(tmp_path / "again").model), _logits(model.model))


# ----------------------------------------------------------------------------------------------
# Other tools' files
# ----------------------------------------------------------------------------------------------

GPTQMODEL_FIXTURES = ["gptqmodel_gptq_desc_act", "gptqmodel_gptq_dynamic"]


@pytest.mark.parametrize("name", GPTQMODEL_FIXTURES)
def test_gptqmodels_files_load_holding_their_bytes(name):
    path = FIXTURES / name
    model = floatxq.load(path, dtype=torch.float16)
    stored = load_file(str(path / "model.safetensors"))
    state = model.model.state_dict()
    quantized = {k.rsplit(".", 1)[0] for k in stored if k.endswith(".qweight")}
    assert quantized and quantized == set(model.quantized_modules)
    for key, tensor in stored.items():
        if key.rsplit(".", 1)[0] in quantized:
            assert state[key].dtype == tensor.dtype and torch.equal(state[key], tensor), key
    payload = json.loads((path / "quantize_config.json").read_text())
    config = model.quantize_config
    assert (config.bits, config.group_size, config.sym, config.desc_act) == (
        payload["bits"],
        payload["group_size"],
        payload["sym"],
        payload["desc_act"],
    )


def _assert_decodes_alike(model: nn.Module, reference: dict, *, symmetric: bool) -> None:
    """floatxq's float16 weights against the ones GPT-QModel's kernel multiplies by.

    floatxq rounds the exact product ``scale * (code - zero)`` once. GPT-QModel's CPU kernel
    (aten int4pack) adds two float16 terms, ``scale * (code - 8)`` and the folded zero offset
    ``scale * (8 - zero)``, each up to ``8 * scale`` and rounded (error up to ``2**-8 * scale``
    each), so for asymmetric zero points it may land a few float16 ulps away: within
    ``2**-6 * scale`` (a different code or zero would be a whole ``scale`` away). For symmetric
    zero points (8) the offset is 0 and the weights are equal.
    """
    for key, theirs in reference.items():
        if not key.endswith(".dequantized"):
            continue
        module = model.get_submodule(key.rsplit(".", 1)[0])
        ours = module.dequantize_weight(torch.float16)
        if symmetric:
            assert torch.equal(ours, theirs), key
            continue
        step = module.scales.float()[module.g_idx.long()].T  # (out, in): each weight's scale
        assert bool(((ours.float() - theirs.float()).abs() <= step * 2**-6).all()), key
        assert float((ours != theirs).float().mean()) < 0.05, key


@pytest.mark.parametrize("name", GPTQMODEL_FIXTURES)
def test_floatxq_decodes_gptqmodels_files_as_gptqmodel_does(name):
    path = FIXTURES / name
    reference = load_file(str(path / "gptqmodel_reference.safetensors"))
    model = floatxq.load(path, dtype=torch.float16)
    _assert_decodes_alike(model.model, reference, symmetric=model.quantize_config.sym)
    ours = _logits_of(model.model, reference["token_ids"])
    # float16 logits (ulp 2**-10 near 1): same weights (up to the ulp above), the matmuls sum
    # in another order
    torch.testing.assert_close(ours, reference["logits_fp16"], rtol=0, atol=4e-3)


def _logits_of(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(ids).logits


READS = FIXTURES / "gptqmodel_reads_floatxq_gptq"


@pytest.fixture(scope="module")
def floatxq_exports(tmp_path_factory) -> Path:
    """floatxq's ``layout="gptq"`` exports that GPT-QModel read, written again."""
    root = tmp_path_factory.mktemp("exports")
    runpy.run_path(str(FIXTURES / "make_gptq_fixtures.py"))["floatxq_exports"](root)
    return root


@pytest.mark.parametrize("name", ["sym_v1", "asym_v2_dynamic", "desc_act"])
def test_gptqmodel_decodes_floatxqs_gptq_files_as_floatxq_does(floatxq_exports, name):
    tmp_path = floatxq_exports
    record = READS / f"{name}.safetensors"
    with safe_open(str(record), "pt") as reader:
        metadata = reader.metadata()
    reference = load_file(str(record))
    for file, key in (("model.safetensors", "model_safetensors_sha256"),
                      ("quantize_config.json", "quantize_config_json_sha256")):  # fmt: skip
        digest = hashlib.sha256((tmp_path / name / file).read_bytes()).hexdigest()
        if digest != metadata[key]:  # GPT-QModel's record holds for these exact bytes only
            pytest.skip(
                f"{name}/{file} exports differently here (float sums of the solve or "
                f"another torch), so GPT-QModel's recorded results do not apply"
            )
    model = floatxq.load(tmp_path / name, dtype=torch.float16)
    _assert_decodes_alike(model.model, reference, symmetric=name == "sym_v1")
    ours = _logits_of(model.model, reference["token_ids"])
    torch.testing.assert_close(ours, reference["logits_fp16"], rtol=0, atol=4e-3)


@pytest.mark.parametrize("name", ["llmcompressor_w4a16_g64", "llmcompressor_w4a16_asym_g64"])
def test_llmcompressor_pack_quantized_files_decode_as_compressed_tensors_does(name):
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    path = FIXTURES / name
    payload = json.loads((path / "config.json").read_text())["quantization_config"]
    group = payload["config_groups"]["group_0"]
    scheme = QuantizationScheme(targets=["Linear"], weights=QuantizationArgs(**group["weights"]))
    compressor = BaseCompressor.get_value_from_registry(group["format"])
    stored = load_file(str(path / "model.safetensors"))
    model = floatxq.load(path)
    assert model.quantize_config.sym == group["weights"]["symmetric"]
    assert len(model.quantized_modules) == 14
    for module_name in model.quantized_modules:
        module = model.model.get_submodule(module_name)
        local = {k.rsplit(".", 1)[1]: v for k, v in stored.items() if k.startswith(module_name)}
        dense = compressor.decompress(local, scheme)["weight"]  # bf16, its scales' dtype
        assert torch.equal(module.dequantize_weight(torch.bfloat16), dense), module_name
        assert torch.equal(module.qweight, local["weight_packed"].T)


def test_transformers_and_floatxq_run_llmcompressors_symmetric_file_alike():
    from transformers import AutoModelForCausalLM

    path = FIXTURES / "llmcompressor_w4a16_g64"
    theirs = AutoModelForCausalLM.from_pretrained(path)  # bf16
    ours = floatxq.load(path).model
    assert torch.equal(_logits(theirs), _logits(ours))


# ----------------------------------------------------------------------------------------------
# inspect
# ----------------------------------------------------------------------------------------------


def test_inspect_reports_bits_groups_symmetry_and_desc_act(tmp_path):
    report = inspect_checkpoint(FIXTURES / "gptqmodel_gptq_desc_act")
    assert (report.layout, report.method, report.format) == ("gptq", "gptq", "gptq")
    assert report.scale_layouts == {"gptq int4 group 64 asym desc_act": 14}
    report = inspect_checkpoint(FIXTURES / "gptqmodel_gptq_dynamic")
    assert report.scale_layouts == {"gptq int4 group 32 sym": 10, "gptq int8 group 64 sym": 2}
    report = inspect_checkpoint(FIXTURES / "llmcompressor_w4a16_asym_g64")
    assert report.convention == "compressed_tensors_int"
    assert report.scale_layouts == {"pack-quantized int4 group 64 asym": 14}
    gptq_model(CT_CONFIGS["dynamic"]).save(tmp_path / "ct", layout="compressed-tensors")
    report = inspect_checkpoint(tmp_path / "ct")
    assert report.scale_layouts == {
        "pack-quantized int4 group 64 sym": 12,
        "pack-quantized int8 group 64 sym": 2,
    }
