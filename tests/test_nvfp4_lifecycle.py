"""The NVFP4 weight-only lifecycle (NVFP4A16): ``load(model, quantize_config=NVFP4Config(...))
.quantize()`` → ``TorchFP4Linear`` modules → the compressed-tensors files → load, bit for bit."""

import pytest
import torch
from torch import nn

import floatxq as fq
from floatxq.lifecycle.nvfp4 import plan_nvfp4
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


def _ids() -> torch.Tensor:
    return torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(1))


def _check_scale(g: torch.Tensor, recipe_g: torch.Tensor, name: str) -> None:
    """The stored global scale reads back from compressed-tensors' ``1/g`` unchanged, and is the
    recipe's own scale or within two FP32 ulps of it."""
    assert g.dtype == torch.float32 and g.item() > 0, name
    assert torch.equal(1.0 / (1.0 / g), g), name
    ulps = g.view(torch.int32).item() - recipe_g.float().reshape(()).view(torch.int32).item()
    assert abs(ulps) <= 2, (name, ulps)


def _weights(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: m.weight.detach().clone() for n, m in model.named_modules()
            if isinstance(m, nn.Linear)}  # fmt: skip


def test_config_normalizes_and_refuses_clearly():
    cfg = fq.NVFP4Config(recipe="lsq_grid", global_scale="fused", meta={"by": "me"})
    assert (cfg.recipe, cfg.global_scale, cfg.lm_head) == ("least_squares_grid", "fused", False)
    assert cfg.quant_method == "nvfp4" and cfg.method == "rtn" and cfg.activations is None
    assert hash(cfg) is not None
    with pytest.raises(ValueError, match="Unsupported NVFP4 scale recipe"):
        fq.NVFP4Config(recipe="best")
    with pytest.raises(ValueError, match="global_scale: expected one of"):
        fq.NVFP4Config(global_scale="layer")
    with pytest.raises(ValueError, match=r"unsupported NVFP4 override\(s\) \['bits'\]"):
        fq.NVFP4Config(dynamic={".*": {"bits": 4}})
    with pytest.raises(ValueError, match=r"dynamic\['\.\*'\]\.recipe"):
        fq.NVFP4Config(dynamic={".*": {"recipe": "best"}})


def test_config_production_errors_without_the_annotation_check(production_checks):
    with pytest.raises(TypeError, match="lm_head: expected a bool, got int 1"):
        fq.NVFP4Config(lm_head=1)
    with pytest.raises(TypeError, match="meta: expected a mapping"):
        fq.NVFP4Config(meta=[("a", 1)])


@pytest.mark.parametrize("recipe", ["nvidia", "least_squares_headroom", "four_six"])
def test_rtn_weights_are_the_recipes_bytes_and_its_qdq(recipe):
    model = _llama()
    before = _weights(model)
    q = fq.load(model, quantize_config=fq.NVFP4Config(recipe=recipe)).quantize(progress=False)
    fp4 = {n: m for n, m in q.model.named_modules() if isinstance(m, TorchFP4Linear)}
    assert set(fp4) == set(q.quantized_modules) == set(before) - {"lm_head"}
    assert "NVFP4 modules" in repr(q)
    for name, module in fp4.items():
        w = before[name]
        g = module.weight_scale_2.reshape(())
        _check_scale(g, fq.nvfp4_global_scale(w.abs().amax().float(), recipe=recipe), name)
        packed, scales, g_ref = fq.nvfp4_quantize(w, g, recipe)
        assert_bitwise_equal(module.weight, packed, msg=name)
        assert_bitwise_equal(module.weight_scale, scales, msg=name)
        assert_bitwise_equal(module.weight_scale_2.reshape(()), g_ref.reshape(()), msg=name)
        decoded = fq.nvfp4_dequantize(packed, scales, g_ref, dtype=w.dtype)
        qdq = fq.nvfp4_block_qdq(w, g, recipe)
        assert torch.equal(decoded, qdq), name  # (equal values; qdq keeps the zeros' signs)
    logits = q.model(input_ids=_ids()).logits
    assert torch.isfinite(logits).all()


def test_fused_siblings_share_one_global_scale():
    model = _llama(1)
    with torch.no_grad():  # q_proj's weights the largest of their group in layer 0
        model.model.layers[0].self_attn.q_proj.weight.mul_(4)
    before = _weights(model)
    cfg = fq.NVFP4Config(global_scale="fused")
    q = fq.load(model, quantize_config=cfg).quantize(progress=False)
    for i, layer in enumerate(q.model.model.layers):
        attn, mlp = layer.self_attn, layer.mlp
        for group in (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj")):
            parent = f"model.layers.{i}.{'self_attn' if 'q_proj' in group else 'mlp'}"
            amax = torch.stack([before[f"{parent}.{p}"].abs().amax().float() for p in group])
            g = fq.nvfp4_global_scale(amax.amax(), recipe=cfg.recipe)
            scales = [getattr(attn if "q_proj" in group else mlp, leaf).weight_scale_2
                      for leaf in group]  # fmt: skip
            assert all(torch.equal(t, scales[0]) for t in scales), parent
            _check_scale(scales[0].reshape(()), g, f"{parent} {group}")
        own = before[f"model.layers.{i}.self_attn.o_proj"].abs().amax()
        o_g = fq.nvfp4_global_scale(own, recipe=cfg.recipe)
        _check_scale(attn.o_proj.weight_scale_2.reshape(()), o_g, "o_proj")
    layer0 = q.model.model.layers[0].self_attn
    assert not torch.equal(layer0.k_proj.weight_scale_2, layer0.o_proj.weight_scale_2)


def test_dynamic_rules_lm_head_and_a_module_that_does_not_fit():
    cfg = fq.NVFP4Config(
        lm_head=True, dynamic={"-:.*k_proj": {}, r"+:.*down_proj": {"recipe": "exhaustive"}}
    )
    plans = {p.name: p for p in plan_nvfp4(_llama(), cfg)}
    assert plans["model.layers.0.self_attn.k_proj"].config is None
    assert plans["model.layers.1.mlp.down_proj"].config.recipe == "exhaustive"
    assert plans["lm_head"].config is not None and plans["model.layers.0.mlp.up_proj"].config
    model = nn.Sequential(nn.Linear(24, 8))
    before = model[0]
    with pytest.raises(ValueError, match=r"module '0' has in_features=24, not a multiple"):
        fq.load(model, quantize_config=fq.NVFP4Config()).quantize(progress=False)
    assert model[0] is before


def test_a_nonfinite_weight_is_refused_before_any_module_changes():
    model = _llama()
    with torch.no_grad():
        model.model.layers[1].mlp.up_proj.weight[0, 0] = float("nan")
    first = model.model.layers[0].self_attn.q_proj
    with pytest.raises(ValueError, match=r"'model.layers.1.mlp.up_proj'.*NaN or infinity"):
        fq.load(model, quantize_config=fq.NVFP4Config()).quantize(progress=False)
    assert model.model.layers[0].self_attn.q_proj is first


def test_calibration_is_ignored_with_a_warning():
    with pytest.warns(UserWarning, match="NVFP4 weight-only quantization needs no calibration"):
        fq.load(_llama(), quantize_config=fq.NVFP4Config()).quantize(["text"], progress=False)


def test_save_load_is_bit_exact_in_compressed_tensors(tmp_path):
    q = fq.load(_llama(), quantize_config=fq.NVFP4Config(recipe="least_squares"))
    q.quantize(progress=False)
    out = q.save(tmp_path / "nvfp4")
    config = (out / "config.json").read_text()
    assert "nvfp4-pack-quantized" in config
    loaded = fq.load(out)
    assert loaded.quantized and sorted(loaded.quantized_modules) == sorted(q.quantized_modules)
    a, b = q.model.state_dict(), loaded.model.state_dict()
    for name in a:
        assert_bitwise_equal(b[name], a[name], msg=name)
    ids = _ids()
    assert_bitwise_equal(loaded.model(input_ids=ids).logits, q.model(input_ids=ids).logits)


def test_layouts_that_cannot_hold_nvfp4_are_refused_before_any_work():
    q = fq.load(_llama(), quantize_config=fq.NVFP4Config())
    with pytest.raises(ValueError, match="layout 'gptqmodel' writes GPT-QModel's FP8 payload"):
        q.quantize(progress=False, layout="gptqmodel")
    with pytest.raises(ValueError, match="layout 'hf' cannot hold module"):
        q.quantize(progress=False, layout="hf")
    assert not q.quantized
