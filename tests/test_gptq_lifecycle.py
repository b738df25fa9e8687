"""The GPTQ lifecycle on CPU: layer by layer in GPT-QModel's order, checked against hand-run
solves."""

import copy
import weakref
from pathlib import Path

import pytest
import torch
from torch import nn

import floatxq
from floatxq import GPTQConfig
from floatxq.gptq.hessian import hessian_finalize, hessian_init, hessian_update
from floatxq.gptq.solve import gptq_solve
from floatxq.lifecycle.gptq import gptq_solve_options, plan_gptq
from floatxq.nn.gptq_linear import GPTQLinear

FIXTURE = Path(__file__).parent / "fixtures" / "tiny_random_llama"
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
CONFIG = GPTQConfig(bits=4, group_size=64)  # intermediate 192: 128 does not divide it


def _model() -> nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(FIXTURE, dtype=torch.float32).eval()


def _samples(count: int = 6, *, seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(24, 64, (count,), generator=gen).tolist()
    return [torch.randint(2, 128, (n,), generator=gen) for n in lengths]


def _quantized(config=CONFIG, samples=None, *, batch_size=1, model=None):
    # device="cpu": these tests compare against hand runs on the CPU (CUDA would be the default)
    qm = floatxq.load(
        model if model is not None else _model(), quantize_config=config, device="cpu"
    )
    return qm.quantize(
        samples if samples is not None else _samples(), batch_size=batch_size, progress=False
    )


def _codes(module: GPTQLinear) -> torch.Tensor:
    return module.unpacked().codes


def _hessian_of(model, module_name, samples):
    state = {"h": hessian_init(model.get_submodule(module_name).in_features)}

    def hook(_m, args):
        state["h"] = hessian_update(state["h"], args[0])

    handle = model.get_submodule(module_name).register_forward_pre_hook(hook)
    with torch.no_grad():
        for ids in samples:
            model(input_ids=ids[None], use_cache=False)
    handle.remove()
    return hessian_finalize(state["h"])


def test_every_decoder_linear_becomes_gptq_linear_and_lm_head_stays():
    qm = _quantized()
    names = [
        f"model.layers.{i}.{p}.{n}"
        for i in range(2)
        for p, ns in (("self_attn", LINEARS[:4]), ("mlp", LINEARS[4:]))
        for n in ns
    ]
    for name in names:
        assert isinstance(qm.model.get_submodule(name), GPTQLinear), name
    assert type(qm.model.lm_head) is nn.Linear
    assert qm.quantized and sorted(qm.quantized_modules) == sorted(names)
    report = qm.report
    assert [m.name for m in report.modules] == [
        f"model.layers.{i}.{p}.{n}"
        for i in range(2)
        for p, n in [
            ("self_attn", "q_proj"),
            ("self_attn", "k_proj"),
            ("self_attn", "v_proj"),
            ("self_attn", "o_proj"),
            ("mlp", "gate_proj"),
            ("mlp", "up_proj"),
            ("mlp", "down_proj"),
        ]
    ]
    assert all(m.rows == report.tokens and m.loss >= 0 and m.damp == 0.05 for m in report.modules)
    assert report.samples == 6 and report.dropped == 0
    assert next(qm.model.parameters()).device.type == "cpu"


def test_first_layer_solves_match_a_hand_run_on_the_unquantized_model():
    samples = _samples()
    reference = _model()
    qm = _quantized(samples=samples, model=copy.deepcopy(reference))
    name = "model.layers.0.self_attn.q_proj"
    hessian = _hessian_of(reference, name, samples)
    for proj in ("q_proj", "k_proj", "v_proj"):  # one input, one Hessian
        full = f"model.layers.0.self_attn.{proj}"
        weight = reference.get_submodule(full).weight
        solved = gptq_solve(weight, hessian, gptq_solve_options(CONFIG))
        assert torch.equal(_codes(qm.model.get_submodule(full)).T, solved.codes), proj


def test_later_modules_see_the_quantized_outputs_of_earlier_ones():
    # o_proj of layer 0 is solved on inputs computed with q/k/v already quantized; layer 1's
    # q_proj on inputs from the fully quantized layer 0 (GPT-QModel's order).
    samples = _samples()
    reference = _model()
    qm = _quantized(samples=samples, model=copy.deepcopy(reference))
    staged = copy.deepcopy(reference)
    for proj in ("q_proj", "k_proj", "v_proj"):
        full = f"model.layers.0.self_attn.{proj}"
        staged.set_submodule(full, qm.model.get_submodule(full))
    o_name = "model.layers.0.self_attn.o_proj"
    solved = gptq_solve(
        reference.get_submodule(o_name).weight,
        _hessian_of(staged, o_name, samples),
        gptq_solve_options(CONFIG),
    )
    assert torch.equal(_codes(qm.model.get_submodule(o_name)).T, solved.codes)
    unstaged = gptq_solve(
        reference.get_submodule(o_name).weight,
        _hessian_of(reference, o_name, samples),
        gptq_solve_options(CONFIG),
    )
    assert not torch.equal(unstaged.codes, solved.codes)  # the order matters, so it is tested

    for proj in LINEARS:
        prefix = "self_attn" if proj in LINEARS[:4] else "mlp"
        full = f"model.layers.0.{prefix}.{proj}"
        staged.set_submodule(full, qm.model.get_submodule(full))
    q1 = "model.layers.1.self_attn.q_proj"
    solved = gptq_solve(
        reference.get_submodule(q1).weight,
        _hessian_of(staged, q1, samples),
        gptq_solve_options(CONFIG),
    )
    assert torch.equal(_codes(qm.model.get_submodule(q1)).T, solved.codes)


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_padding_content_changes_nothing(attn):
    # The same batches, padded with two different ids (so every activation at a padded position
    # differs): if padding reached a Hessian, or a real token's activations, some code would move.
    from transformers import AutoModelForCausalLM

    samples = _samples(4)
    results = []
    for pad in (0, 77):
        model = AutoModelForCausalLM.from_pretrained(
            FIXTURE, dtype=torch.float32, attn_implementation=attn
        ).eval()
        model.config.pad_token_id = pad
        results.append(_quantized(samples=samples, batch_size=4, model=model))
    first, second = results
    assert max(s.numel() for s in samples) > min(s.numel() for s in samples)  # there is padding
    for name in first.quantized_modules:
        a, b = first.model.get_submodule(name), second.model.get_submodule(name)
        assert torch.equal(a.qweight, b.qweight), name
        assert torch.equal(a.scales, b.scales), name
    assert [m.loss for m in first.report.modules] == [m.loss for m in second.report.modules]


def test_batching_before_attention_is_exact():
    # Before the first attention, rows do not interact: batch size only changes GEMM shapes,
    # and layer 0's q/k/v codes are the same bytes for batch sizes 1 and 4.
    samples = _samples(4)
    one = _quantized(samples=samples, batch_size=1)
    four = _quantized(samples=samples, batch_size=4)
    for proj in ("q_proj", "k_proj", "v_proj"):
        name = f"model.layers.0.self_attn.{proj}"
        assert torch.equal(
            one.model.get_submodule(name).qweight, four.model.get_submodule(name).qweight
        )


def test_forward_of_the_quantized_model_uses_the_packed_weights():
    qm = _quantized()
    ids = _samples(1, seed=3)[0][None]
    with torch.no_grad():
        got = qm.model(input_ids=ids).logits
        dense = copy.deepcopy(qm.model)
        for name in qm.quantized_modules:
            module = dense.get_submodule(name)
            linear = nn.Linear(module.in_features, module.out_features, bias=False)
            linear.weight.copy_(module.dequantize_weight(torch.float32))
            dense.set_submodule(name, linear)
        want = dense(input_ids=ids).logits
    assert torch.equal(got, want)


@pytest.mark.parametrize(
    "config",
    [
        GPTQConfig(bits=4, group_size=32, desc_act=True, act_group_aware=False),
        GPTQConfig(bits=4, group_size=32, desc_act=True, static_groups=True, act_group_aware=False),
        GPTQConfig(bits=4, group_size=64, act_group_aware=False, sym=False),
        GPTQConfig(bits=8, group_size=-1),
        GPTQConfig(bits=2, group_size=64, mse=2.0),
    ],
    ids=["desc_act", "desc_act+static", "plain-asym", "8bit-rowwise", "2bit-mse"],
)
def test_options_reach_every_module(config):
    samples = _samples(3)
    reference = _model()
    qm = _quantized(config, samples=samples, model=copy.deepcopy(reference))
    name = "model.layers.0.mlp.gate_proj"
    module = qm.model.get_submodule(name)
    assert module.bits == config.bits and module.group_size == config.group_size
    hessian = _hessian_of(reference, "model.layers.0.mlp.gate_proj", samples)
    # gate_proj's input follows the quantized attention: solve it on the staged model instead
    staged = copy.deepcopy(reference)
    for proj in LINEARS[:4]:
        full = f"model.layers.0.self_attn.{proj}"
        staged.set_submodule(full, qm.model.get_submodule(full))
    hessian = _hessian_of(staged, name, samples)
    solved = gptq_solve(reference.get_submodule(name).weight, hessian, gptq_solve_options(config))
    assert torch.equal(_codes(module).T.int(), solved.codes.int())
    assert torch.equal(module.g_idx, solved.g_idx)
    if config.desc_act and not config.static_groups:
        assert not torch.equal(module.g_idx, torch.arange(128, dtype=torch.int32) // 32)


def test_dynamic_rules_pick_settings_per_module_and_exclude():
    config = GPTQConfig(
        bits=4,
        group_size=64,
        dynamic={r"-:.*\.1\.mlp\..*": {}, r".*down_proj": {"bits": 8, "group_size": 32}},
    )
    qm = _quantized(config)
    down0 = qm.model.get_submodule("model.layers.0.mlp.down_proj")
    assert (down0.bits, down0.group_size) == (8, 32)
    assert qm.model.get_submodule("model.layers.0.mlp.up_proj").bits == 4
    for proj in LINEARS[4:]:
        assert type(qm.model.get_submodule(f"model.layers.1.mlp.{proj}")) is nn.Linear
    assert isinstance(qm.model.get_submodule("model.layers.1.self_attn.o_proj"), GPTQLinear)


def test_lm_head_is_solved_on_the_final_norm_outputs():
    qm = _quantized(GPTQConfig(bits=4, group_size=64, lm_head=True))
    assert isinstance(qm.model.lm_head, GPTQLinear)
    assert qm.report.modules[-1].name == "lm_head"


# ----------------------------------------------------------------------------------------------
# Errors
# ----------------------------------------------------------------------------------------------


def test_gptq_needs_calibration():
    with pytest.raises(ValueError, match="GPTQ needs calibration data"):
        floatxq.load(_model(), quantize_config=CONFIG).quantize(progress=False)


def test_empty_and_too_short_calibration_are_refused():
    qm = floatxq.load(_model(), quantize_config=CONFIG)
    with pytest.raises(ValueError, match="no samples"):
        qm.quantize([], progress=False)
    with pytest.raises(ValueError, match="all 2 samples have at most 10 tokens"):
        qm.quantize([torch.arange(5), torch.arange(10)], progress=False)
    assert not qm.quantized


def test_strings_without_a_tokenizer_are_refused():
    qm = floatxq.load(_model(), quantize_config=CONFIG)
    with pytest.raises(
        ValueError, match="string samples need a tokenizer, and this model was given as a module"
    ):
        qm.quantize(["some calibration text of a reasonable length"], progress=False)


def test_group_size_that_does_not_divide_is_refused_before_any_change():
    model = _model()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    qm = floatxq.load(model, quantize_config=GPTQConfig(bits=4, group_size=128))
    with pytest.raises(ValueError, match=r"down_proj.*in_features=192.*group_size=128"):
        qm.quantize(_samples(), progress=False)
    assert not any(isinstance(m, GPTQLinear) for m in model.modules())
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


@pytest.mark.parametrize("bits", [3, 5, 6])
def test_bits_no_checkpoint_packs_are_refused(bits):
    with pytest.raises(ValueError, match=r"which no GPTQ checkpoint packs; accepted: \[2, 4, 8\]"):
        plan_gptq(_model(), GPTQConfig(bits=bits, group_size=64))


def test_nan_activations_are_named():
    model = _model()
    with torch.no_grad():
        model.model.layers[1].post_attention_layernorm.weight[3] = float("nan")
    qm = floatxq.load(model, quantize_config=CONFIG)
    with pytest.raises(ValueError, match=r"reaching model\.layers\.1\.mlp\.gate_proj.*not finite"):
        qm.quantize(_samples(2), progress=False)


def test_tied_lm_head_is_refused():
    model = _model()
    model.lm_head.weight = model.model.embed_tokens.weight
    with pytest.raises(ValueError, match="tie_word_embeddings"):
        plan_gptq(model, GPTQConfig(bits=4, group_size=64, lm_head=True))


# ----------------------------------------------------------------------------------------------
# Requantization from native sources
# ----------------------------------------------------------------------------------------------


def _decoded_twin(source: nn.Module) -> nn.Module:
    """A dense copy of a loaded native source whose linears hold the decoded weights."""
    from floatxq.lifecycle.gptq import _target_types

    twin = copy.deepcopy(source)
    for name, module in list(twin.named_modules()):
        if isinstance(module, _target_types()) and not isinstance(module, nn.Linear):
            linear = nn.Linear(module.in_features, module.out_features, bias=False)
            with torch.no_grad():
                linear.weight.copy_(module.dequantize_weight(dtype=torch.float32))
            twin.set_submodule(name, linear)
    return twin


def _requantize_and_compare(path: Path, monkeypatch, module_type: type) -> None:
    samples = _samples(3)
    source = floatxq.load(path, quantize_config=CONFIG, dtype=torch.float32, device="cpu")
    assert not source.quantized
    twin = _decoded_twin(source.model)
    live: list[weakref.ref] = []
    original = module_type.dequantize_weight

    def tracked(self, *args, **kwargs):
        assert all(ref() is None for ref in live), "two decoded source weights alive at once"
        out = original(self, *args, **kwargs)
        live.append(weakref.ref(out))
        return out

    monkeypatch.setattr(module_type, "dequantize_weight", tracked)
    source.quantize(samples, progress=False)
    monkeypatch.undo()
    assert live, "no source module was decoded"
    expected = floatxq.load(twin, quantize_config=CONFIG, device="cpu")
    expected.quantize(samples, progress=False)
    assert source.quantized_modules == expected.quantized_modules
    for name in expected.quantized_modules:
        got, want = source.model.get_submodule(name), expected.model.get_submodule(name)
        assert torch.equal(got.qweight, want.qweight), name
        assert torch.equal(got.scales, want.scales), name


def test_requantization_from_an_fp8_source(tmp_path, monkeypatch):
    from floatxq.nn.fp8_linear import TorchFP8Linear

    fp8 = floatxq.load(_model(), quantize_config=floatxq.FP8Config(weight_scale_method="row"))
    fp8.quantize(progress=False)
    fp8.model.config.dtype = torch.float32
    fp8.save(tmp_path / "fp8", layout="gptqmodel")
    _requantize_and_compare(tmp_path / "fp8", monkeypatch, TorchFP8Linear)


def test_requantization_from_an_nvfp4_source(monkeypatch):
    from floatxq.nn.fp4_linear import TorchFP4Linear

    _requantize_and_compare(FIXTURE.parent / "llmcompressor_nvfp4a16", monkeypatch, TorchFP4Linear)


def _activation_quantized_source(kind: str, tmp_path: Path) -> Path:
    """A checkpoint that quantizes activations: llm-compressor's own (the committed fixtures) or
    ModelOpt's documented layout (:mod:`floatxq.testing.foreign`); ``modelopt_kv`` adds FP8
    KV-cache scales, which floatxq does not run (the checkpoint loads only as a source)."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    from floatxq.testing.foreign import write_modelopt_fp8, write_modelopt_nvfp4

    if kind.startswith("llmcompressor"):
        return FIXTURE.parent / kind
    dense = tmp_path / "dense"
    shutil.copytree(FIXTURE, dense)
    writer = write_modelopt_nvfp4 if kind == "modelopt_nvfp4" else write_modelopt_fp8
    path = writer(dense, tmp_path / kind, input_scale=True).path
    if kind == "modelopt_kv":
        for name in ("config.json", "hf_quant_config.json"):
            payload = json.loads((path / name).read_text())
            qconfig = payload.get("quantization_config", payload.get("quantization"))
            qconfig["kv_cache_quant_algo"] = "FP8"
            (path / name).write_text(json.dumps(payload))
        state = load_file(path / "model.safetensors")
        for layer in range(2):
            for proj in ("k", "v"):
                attn = f"model.layers.{layer}.self_attn.{proj}_proj"
                state[f"{attn}.{proj}_scale"] = torch.tensor(0.05)
        save_file(state, path / "model.safetensors", metadata={"format": "pt"})
        with pytest.raises(floatxq.CheckpointError, match="KV"):
            floatxq.load(path)  # not runnable as is
    return path


@pytest.mark.parametrize(
    "kind",
    [
        "llmcompressor_fp8_static",
        "llmcompressor_nvfp4",
        "modelopt_fp8",
        "modelopt_nvfp4",
        "modelopt_kv",
    ],
)
def test_requantization_from_an_activation_quantized_source(kind, tmp_path, monkeypatch):
    """A GPTQ run on a checkpoint whose modules quantize their inputs (static FP8 W8A8, NVFP4
    W4A4, with or without KV-cache scales) decodes the weights and ignores the activation
    scales: the result is the GPTQ run on a dense model of the decoded weights, bit for bit."""
    from floatxq.nn.fp4_linear import TorchFP4Linear
    from floatxq.nn.fp8_linear import TorchFP8Linear

    path = _activation_quantized_source(kind, tmp_path)
    source = floatxq.load(path, quantize_config=CONFIG, dtype=torch.float32, device="cpu")
    kinds = {
        type(m) for m in source.model.modules() if isinstance(m, (TorchFP8Linear, TorchFP4Linear))
    }
    assert len(kinds) == 1, kinds
    for module in source.model.modules():  # every source module multiplies x as given
        assert getattr(module, "input_scale", None) is None
        assert getattr(module, "input_quant", None) is None
    _requantize_and_compare(path, monkeypatch, kinds.pop())


def test_fp8_and_nvfp4_configs_on_an_activation_quantized_source_load_it_as_quantized():
    """FP8Config / NVFP4Config do not requantize a quantized checkpoint: a static FP8 or W4A4
    one loads as it runs (its activation scales kept), the config ignored with a warning."""
    for kind, config in (
        ("llmcompressor_fp8_static", floatxq.FP8Config()),
        ("llmcompressor_nvfp4", floatxq.NVFP4Config()),
    ):
        with pytest.warns(UserWarning, match="already quantized"):
            loaded = floatxq.load(FIXTURE.parent / kind, quantize_config=config)
        assert loaded.quantized
        held = [getattr(m, "input_scale", None) for m in loaded.model.modules()]
        assert sum(scale is not None for scale in held) == 14


def test_llama_layers_group_by_the_input_their_modules_read():
    from floatxq.lifecycle.calibration import prepare_calibration
    from floatxq.lifecycle.decoder import capture_inputs as _capture_inputs
    from floatxq.lifecycle.gptq import _groups_by_input

    model = _model()
    layer = model.model.layers[0]
    inputs = _capture_inputs(
        model, layer, prepare_calibration(_samples(2), batch_size=2), torch.device("cpu")
    )
    targets = [(n, m) for n, m in layer.named_modules() if isinstance(m, nn.Linear)]
    for _ in range(5):  # freed inputs' addresses are reused between calls: never merge on that
        groups = _groups_by_input(layer, targets, inputs[0])
        assert [[n for n, _ in g] for g in groups] == [
            ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"],
            ["self_attn.o_proj"],
            ["mlp.gate_proj", "mlp.up_proj"],
            ["mlp.down_proj"],
        ]


# ----------------------------------------------------------------------------------------------
# End to end: quantize, save in both layouts, load back (floatxq and transformers)
# ----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def quantized_tiny():
    return _quantized(samples=_samples(4), batch_size=2)


@pytest.mark.parametrize("layout", ["gptq", "compressed-tensors"])
def test_save_load_logits_equal(quantized_tiny, tmp_path, layout):
    qm = quantized_tiny
    out = qm.save(tmp_path / layout, layout=layout)
    loaded = floatxq.load(out)
    assert isinstance(loaded.quantize_config, GPTQConfig)
    assert sorted(loaded.quantized_modules) == sorted(qm.quantized_modules)
    for name in qm.quantized_modules:
        a, b = qm.model.get_submodule(name), loaded.model.get_submodule(name)
        assert torch.equal(a.dequantize_weight(), b.dequantize_weight()), name
    ids = _samples(1, seed=5)[0][None]
    with torch.no_grad():
        assert torch.equal(qm.model(input_ids=ids).logits, loaded.model(input_ids=ids).logits)


def test_transformers_reads_the_compressed_tensors_export(quantized_tiny, tmp_path):
    from transformers import AutoModelForCausalLM

    out = quantized_tiny.save(tmp_path / "ct", layout="compressed-tensors")
    theirs = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    ids = _samples(1, seed=6)[0][None]
    with torch.no_grad():
        ours = quantized_tiny.model(input_ids=ids).logits
        got = theirs(input_ids=ids).logits
    # compressed-tensors decompresses to the same FP32 weights; only GEMM order may differ
    assert torch.allclose(got, ours, rtol=0, atol=1e-5), (got - ours).abs().max()


def test_replaced_modules_are_released_layer_by_layer():
    # A replaced module kept alive would keep its weights on the work device for the whole run.
    import gc

    model = _model()
    originals = {n: weakref.ref(m) for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    alive_at: dict[str, list[str]] = {}

    def on_module(name: str) -> None:
        gc.collect()
        alive_at[name] = [n for n, ref in originals.items() if ref() is not None]

    qm = floatxq.load(model, quantize_config=CONFIG)
    qm.quantize(_samples(2), progress=on_module)
    # once layer 1 is being solved, none of layer 0's replaced linears is referenced any more
    assert not [n for n in alive_at["model.layers.1.self_attn.q_proj"] if ".layers.0." in n]
    gc.collect()
    assert [n for n, ref in originals.items() if ref() is not None] == ["lm_head"]
