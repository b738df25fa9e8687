"""The calibrated NVFP4 lifecycle: ``NVFP4Config(method="gptq")`` (GPTQ's column solve onto the
NVFP4 grid, layer by layer) and ``activations="nvfp4"`` (W4A4 with calibrated input scales)."""

import pytest
import torch
from torch import nn

import floatxq as fq
from floatxq.gptq.nvfp4_grid import nvfp4_gptq_solve
from floatxq.lifecycle import nvfp4_config_from_payload, nvfp4_config_to_payload
from floatxq.nn.fp4_linear import TorchFP4Linear
from floatxq.testing import assert_bitwise_equal

transformers = pytest.importorskip("transformers")


def _llama(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(
        vocab_size=128, num_hidden_layers=2, max_position_embeddings=64, hidden_size=64,
        intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
        tie_word_embeddings=False,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(config).eval()


def _samples(n: int = 6, length: int = 24, seed: int = 2) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return list(torch.randint(0, 128, (n, length), generator=g).unbind(0))


def _ids() -> torch.Tensor:
    return torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(1))


def _fp4(model: nn.Module) -> dict[str, TorchFP4Linear]:
    return {n: m for n, m in model.named_modules() if isinstance(m, TorchFP4Linear)}


def _linears(model: nn.Module) -> dict[str, nn.Linear]:
    return {n: m for n, m in model.named_modules() if type(m) is nn.Linear}


def test_config_method_activations_and_payload_round_trip():
    cfg = fq.NVFP4Config(
        recipe="lsq", method="gptq", activations="nvfp4", damp_percent=0.05,
        global_scale="fused", dynamic={r".*down_proj": {"method": "rtn"}, "-:.*k_proj": {}},
        meta={"by": "test"},
    )  # fmt: skip
    assert cfg.needs_calibration and cfg.resolve("m.down_proj").method == "rtn"
    assert not fq.NVFP4Config().needs_calibration
    assert fq.NVFP4Config(dynamic={".*o_proj": {"activations": "nvfp4"}}).needs_calibration
    payload = nvfp4_config_to_payload(cfg)
    assert payload["quant_method"] == "nvfp4" and payload["method"] == "gptq"
    assert payload["activations"] == "nvfp4" and payload["recipe"] == "least_squares"
    assert nvfp4_config_from_payload(payload) == cfg
    assert nvfp4_config_to_payload(nvfp4_config_from_payload(payload)) == payload
    assert "activations" not in nvfp4_config_to_payload(fq.NVFP4Config())
    loaded = fq.load(_llama(), quantize_config=payload)
    assert loaded.quantize_config == cfg
    with pytest.raises(ValueError, match=r"method: expected one of \['rtn', 'gptq'\]"):
        fq.NVFP4Config(method="awq")
    with pytest.raises(ValueError, match=r"activations: expected one of \['nvfp4'\]"):
        fq.NVFP4Config(activations="fp8")
    with pytest.raises(ValueError, match="damp_percent"):
        fq.NVFP4Config(damp_percent=1.5)
    with pytest.raises(ValueError, match=r"dynamic\['\.\*'\]\.method"):
        fq.NVFP4Config(dynamic={".*": {"method": "awq"}})
    with pytest.raises(ValueError, match="quant_method: expected 'nvfp4'"):
        nvfp4_config_from_payload({"quant_method": "fp8"})
    with pytest.raises(ValueError, match="unsupported field"):
        nvfp4_config_from_payload({"quant_method": "nvfp4", "bits": 4})


def test_calibrated_methods_need_calibration_data():
    for cfg in (fq.NVFP4Config(method="gptq"), fq.NVFP4Config(activations="nvfp4")):
        model = _llama()
        before = _linears(model)
        with pytest.raises(ValueError, match="needs calibration data"):
            fq.load(model, quantize_config=cfg).quantize(progress=False)
        assert _linears(model) == before


def _hessians(model: nn.Module, samples: list[torch.Tensor], names: list[str]) -> dict:
    """Each module's Hessian (:data:`floatxq.stats.HESSIAN` folded over its inputs, batch by
    batch) recorded from the quantized model itself: the inputs the solve saw, for a module of
    the first group (no quantized module before it)."""
    from floatxq.stats import HESSIAN, finalize_all, fold_all

    states: dict[str, dict] = {}

    def hook(name):
        def fn(module, args):
            x = args[0].reshape(-1, args[0].shape[-1])
            state = states.get(name) or {"h": HESSIAN.init(x.shape[-1], device=x.device)}
            states[name] = fold_all({"h": HESSIAN}, state, x)

        return fn

    handles = [model.get_submodule(n).register_forward_pre_hook(hook(n)) for n in names]
    with torch.no_grad():
        for ids in samples:
            model(input_ids=ids[None])
    for h in handles:
        h.remove()
    return {n: finalize_all({"h": HESSIAN}, states[n])["h"] for n in names}


def test_gptq_keeps_the_rtn_scales_and_never_loses_to_rtn():
    samples = _samples()
    original = _llama()
    reference = {n: m.weight.detach().clone() for n, m in _linears(original).items()}
    rtn = fq.load(_llama(), quantize_config=fq.NVFP4Config()).quantize(progress=False)
    q = fq.load(original, quantize_config=fq.NVFP4Config(method="gptq"))
    q.quantize(samples, progress=False)
    fp4, rtn_fp4 = _fp4(q.model), _fp4(rtn.model)
    assert set(fp4) == set(q.quantized_modules) == set(reference) - {"lm_head"}
    assert len(q.report.modules) == len(fp4)
    changed = 0
    for name, module in fp4.items():  # the recipe's scales, computed from the original weights
        assert_bitwise_equal(module.weight_scale, rtn_fp4[name].weight_scale, msg=name)
        assert_bitwise_equal(module.weight_scale_2, rtn_fp4[name].weight_scale_2, msg=name)
        changed += not torch.equal(module.weight, rtn_fp4[name].weight)
    assert changed >= len(fp4) // 2  # GPTQ moved codes in most modules
    for report in q.report.modules:
        assert report.method == "gptq" and report.loss <= report.rtn_loss, report
    # the quantized model's own inputs give each module's Hessian: its codes are what
    # nvfp4_gptq_solve returns there (at the default damp), so the loss claim holds per module
    hessians = _hessians(q.model, samples, ["model.layers.0.self_attn.q_proj"])
    name = "model.layers.0.self_attn.q_proj"
    module = fp4[name]
    solution = nvfp4_gptq_solve(
        reference[name].float(), hessians[name], module.weight_scale_2,
        recipe=fq.NVFP4Config().recipe,
    )  # fmt: skip
    assert solution.loss <= solution.rtn_loss
    assert_bitwise_equal(module.weight, solution.packed, msg=name)


def test_gptq_rules_save_and_reload_bit_for_bit(tmp_path):
    cfg = fq.NVFP4Config(
        method="gptq", recipe="four_six", dynamic={r".*down_proj": {"method": "rtn"}}
    )
    q = fq.load(_llama(), quantize_config=cfg).quantize(_samples(), progress=False)
    rtn = fq.load(_llama(), quantize_config=fq.NVFP4Config(recipe="four_six")).quantize(
        progress=False
    )
    by_name = {r.name: r for r in q.report.modules}
    for i in range(2):
        name = f"model.layers.{i}.mlp.down_proj"
        assert by_name[name].method == "rtn" and by_name[name].loss is None
        assert_bitwise_equal(
            q.model.get_submodule(name).weight, rtn.model.get_submodule(name).weight
        )
    out = q.save(tmp_path / "gptq-nvfp4")
    loaded = fq.load(out)
    a, b = q.model.state_dict(), loaded.model.state_dict()
    assert sorted(a) == sorted(b)
    for key in a:
        assert_bitwise_equal(b[key], a[key], msg=key)
    ids = _ids()
    assert_bitwise_equal(loaded.model(input_ids=ids).logits, q.model(input_ids=ids).logits)


def test_a_failing_run_puts_every_original_module_back(monkeypatch):
    import floatxq.lifecycle.nvfp4_calibrated as calibrated

    model = _llama()
    before = _linears(model)
    weights = {n: m.weight.detach().clone() for n, m in before.items()}
    calls = []

    def failing(*args, **kwargs):
        calls.append(1)
        if len(calls) == 9:  # in the second layer: the first layer's modules are replaced
            raise KeyboardInterrupt
        return nvfp4_gptq_solve(*args, **kwargs)

    monkeypatch.setattr(calibrated, "nvfp4_gptq_solve_auto", failing)
    q = fq.load(model, quantize_config=fq.NVFP4Config(method="gptq"))
    with pytest.raises(KeyboardInterrupt):
        q.quantize(_samples(), progress=False)
    assert len(calls) == 9 and not q.quantized
    after = _linears(model)
    assert after.keys() == before.keys()
    for name, module in after.items():
        assert module is before[name], name
        assert_bitwise_equal(module.weight, weights[name], msg=name)
    assert not _fp4(model)


def _input_amax(model: nn.Module, samples: list[torch.Tensor], names: list[str]) -> dict:
    """``max|x|`` of each module's inputs over ``samples``, recorded on ``model`` as it is."""
    found: dict[str, torch.Tensor] = {}

    def hook(name):
        def fn(_module, args):
            amax = args[0].detach().abs().amax().float()
            found[name] = torch.maximum(found.get(name, amax), amax)

        return fn

    handles = [model.get_submodule(n).register_forward_pre_hook(hook(n)) for n in names]
    with torch.no_grad():
        for ids in samples:
            model(input_ids=ids[None])
    for h in handles:
        h.remove()
    return found


@pytest.mark.parametrize("method", ["rtn", "gptq"])
def test_w4a4_input_scales_are_the_calibrated_maxima_of_the_quantized_models_inputs(method):
    samples = _samples()
    cfg = fq.NVFP4Config(
        method=method, activations="nvfp4", dynamic={r".*o_proj": {"activations": None}}
    )
    # on the CPU, as the check below runs: the scales are compared to the maxima this process's
    # CPU arithmetic sees (a GPU calibration's matmuls round differently)
    q = fq.load(_llama(), quantize_config=cfg, device="cpu").quantize(samples, progress=False)
    fp4 = _fp4(q.model)
    w4a4 = {n for n, m in fp4.items() if m.input_scale is not None}
    assert w4a4 == {n for n in fp4 if not n.endswith("o_proj")} and len(w4a4) == 12
    # calibration ran each layer on modules that compute what the finished ones compute, so the
    # finished model's inputs are the calibration inputs: each scale is their maximum / 2688
    seen = _input_amax(q.model, samples, sorted(w4a4))
    for name in w4a4:
        g = fp4[name].input_scale
        assert g.dtype == torch.float32 and torch.equal(1.0 / (1.0 / g), g), name
        expected = fq.nvfp4_global_scale(seen[name], recipe="nvidia")
        ulps = g.view(torch.int32).item() - expected.view(torch.int32).item()
        assert abs(ulps) <= 2, (name, g.item(), expected.item())
    layer0 = q.model.model.layers[0]
    fused = (layer0.self_attn.q_proj, layer0.self_attn.k_proj, layer0.self_attn.v_proj)
    assert all(torch.equal(m.input_scale, fused[0].input_scale) for m in fused)  # one input
    if method == "rtn":  # the weights are round to nearest's bytes, whatever the activations
        rtn = _fp4(
            fq.load(_llama(), quantize_config=fq.NVFP4Config()).quantize(progress=False).model
        )
        for name, module in fp4.items():
            assert_bitwise_equal(module.weight, rtn[name].weight, msg=name)


def test_w4a4_runs_its_activation_quantization_and_reloads_bit_for_bit(tmp_path):
    samples = _samples()
    q = fq.load(_llama(), quantize_config=fq.NVFP4Config(activations="nvfp4"))
    q.quantize(samples, progress=False)
    ids = _ids()
    logits = q.model(input_ids=ids).logits
    module = q.model.model.layers[1].mlp.down_proj
    x = torch.randn(3, module.in_features, generator=torch.Generator().manual_seed(5))
    qdq = fq.nvfp4_block_qdq(x, module.input_scale, "nvidia")
    expected = nn.functional.linear(qdq, module.dequantize_weight(x.dtype))
    assert_bitwise_equal(module(x), expected)
    assert not torch.equal(module(x), nn.functional.linear(x, module.dequantize_weight(x.dtype)))
    out = q.save(tmp_path / "w4a4")
    loaded = fq.load(out)
    for name, m in _fp4(q.model).items():
        twin = loaded.model.get_submodule(name)
        assert_bitwise_equal(twin.input_scale, m.input_scale, msg=name)
        assert_bitwise_equal(twin.weight, m.weight, msg=name)
    assert_bitwise_equal(loaded.model(input_ids=ids).logits, logits)
