"""The generic W4A stream (floatxq/lifecycle/stream/boundary.py) on decoders that are not Llamas."""

import copy
import functools

import pytest
import torch
from torch import nn

from floatxq.config import ActivationConfig
from floatxq.gptq.solve import GPTQSolveOptions, rtn_quantize
from floatxq.lifecycle.stream import (
    install_w4a_llama_stream,
    install_w4a_stream,
    installed_w4a_stream,
    stream_boundary_quantizers,
    uninstall_w4a_llama_stream,
    uninstall_w4a_stream,
)
from floatxq.lifecycle.w4a_install import install_activation_stream
from floatxq.nn.gptq_linear import GPTQLinear
from floatxq.nn.w4a_fp8_linear import W4AFP8Linear
from floatxq.nn.w4a_nvfp4_linear import W4ANVFP4Linear
from floatxq.w4a.activation import W4AActivation, pack_activation

pytest.importorskip("transformers")

RTN = GPTQSolveOptions(bits=4, group_size=128)
W4A = (W4AFP8Linear, W4ANVFP4Linear)


@functools.cache
def _base(kind: str) -> nn.Module:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=64, hidden_size=256, intermediate_size=384, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=64,
    )  # fmt: skip
    model = Qwen2ForCausalLM(config).eval()
    cls = W4ANVFP4Linear if kind == "nvfp4" else W4AFP8Linear
    for name, module in list(model.named_modules()):
        if isinstance(module, nn.Linear) and name != "lm_head":
            packed = GPTQLinear.from_solution(
                rtn_quantize(module.weight.detach(), RTN), bits=4, group_size=128
            )
            model.set_submodule(name, cls.from_gptq_linear(packed))
    return model


def _model(kind: str = "nvfp4") -> nn.Module:
    return copy.deepcopy(_base(kind))


@functools.cache
def _ids() -> torch.Tensor:
    return torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(1))


def _logits(model: nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model(_ids()).logits


def _inputs(model: nn.Module) -> tuple[dict[str, object], list]:
    """What each W4A module receives (after the stream's hooks), by name; hooks to remove."""
    seen: dict[str, object] = {}
    hooks = [
        module.register_forward_pre_hook(lambda _m, args, n=name: seen.setdefault(n, args[0]))
        for name, module in model.named_modules()
        if isinstance(module, W4A)
    ]
    return seen, hooks


def _layer(seen: dict, index: int) -> dict[str, object]:
    prefix = f"model.layers.{index}."
    return {k.removeprefix(prefix): v for k, v in seen.items() if k.startswith(prefix)}


@pytest.mark.parametrize("kind", ["nvfp4", "fp8"])
def test_each_norm_output_is_packed_once_and_no_logit_changes(kind):
    model = _model(kind)
    plain = _logits(model)
    mode = "w4a_nvfp4" if kind == "nvfp4" else "w4afp8"
    assert install_w4a_stream(model, mode) == installed_w4a_stream(model)
    seen, _ = _inputs(model)
    streamed = _logits(model)
    assert torch.equal(streamed, plain)  # the modules would pack exactly these carriers alone
    for index in range(2):
        got = _layer(seen, index)
        assert all(isinstance(v, W4AActivation) and v.mode == mode for v in got.values())
        q, k, v = got["self_attn.q_proj"], got["self_attn.k_proj"], got["self_attn.v_proj"]
        assert q is k is v  # one carrier for the attention norm's three readers
        assert got["mlp.gate_proj"] is got["mlp.up_proj"]
        assert got["mlp.gate_proj"] is not q and got["self_attn.o_proj"] is not q
        assert got["mlp.down_proj"] is not got["mlp.gate_proj"]


def test_the_lanes_follow_the_policy_as_separate_packs_would():
    model = _model()
    expected_model = _model()

    def fp8_input(_module, args):  # an independent expectation: each input packed on its own
        return (pack_activation(args[0], "w4afp8", model_dtype=args[0].dtype), *args[1:])

    for name, module in expected_model.named_modules():
        if isinstance(module, W4ANVFP4Linear) and ".self_attn." in name:
            module.register_forward_pre_hook(fp8_input)
    install_w4a_stream(model, "w4a_nvfp4", attention_mode="w4afp8", mlp_fp8_layers=[1])
    seen, _ = _inputs(model)
    assert torch.equal(_logits(model), _logits_with_fp8_mlp(expected_model, layer=1))
    assert seen["model.layers.0.self_attn.q_proj"].mode == "w4afp8"
    assert seen["model.layers.0.mlp.gate_proj"].mode == "w4a_nvfp4"
    assert seen["model.layers.1.mlp.down_proj"].mode == "w4afp8"


def _logits_with_fp8_mlp(model: nn.Module, *, layer: int) -> torch.Tensor:
    def fp8_input(_module, args):
        return (pack_activation(args[0], "w4afp8", model_dtype=args[0].dtype), *args[1:])

    for module in model.model.layers[layer].mlp.modules():
        if isinstance(module, W4ANVFP4Linear):
            module.register_forward_pre_hook(fp8_input)
    return _logits(model)


def test_a_consumers_calibrated_scale_is_its_buffer_and_decides_the_sharing():
    model = _model()
    attention = model.model.layers[0].self_attn
    for proj in (attention.q_proj, attention.k_proj):
        proj.activation_global_scale = 0.125
    attention.v_proj.activation_global_scale = 0.25
    keys = set(model.state_dict())
    install_w4a_stream(model, "w4a_nvfp4")
    assert set(model.state_dict()) == keys  # the stream adds no state of its own
    assert "model.layers.0.self_attn.q_proj.activation_global_scale_bits" in keys
    seen, _ = _inputs(model)
    _logits(model)
    got = _layer(seen, 0)
    q, k, v = got["self_attn.q_proj"], got["self_attn.k_proj"], got["self_attn.v_proj"]
    assert q is k and v is not q  # another scale: another carrier
    assert float(q.global_scale) == 0.125 and float(v.global_scale) == 0.25
    assert got["mlp.gate_proj"].global_scale is not None  # dynamic: its own max|x|


def test_uninstall_leaves_no_hook_and_the_model_runs_as_before():
    model = _model()
    plain = _logits(model)
    install_w4a_stream(model, "w4a_nvfp4")
    assert model._forward_pre_hooks  # the state's holder
    assert uninstall_w4a_stream(model).mode == "w4a_nvfp4"
    assert installed_w4a_stream(model) is None and uninstall_w4a_stream(model) is None
    for module in model.modules():
        assert not module._forward_pre_hooks and not module._forward_hooks
    assert torch.equal(_logits(model), plain)


def test_install_refusals():
    model = _model("fp8")
    with pytest.raises(ValueError, match="cannot run NVFP4 carriers"):
        install_w4a_stream(model, "w4a_nvfp4")
    assert installed_w4a_stream(model) is None  # nothing installed by a refusal
    with pytest.raises(ValueError, match="beyond the model's 2 decoder layers"):
        install_w4a_stream(_model(), "w4a_nvfp4", mlp_fp8_layers=[2])
    model = _model()
    install_w4a_stream(model, "w4a_nvfp4")
    assert install_w4a_stream(model, "w4a_nvfp4").mode == "w4a_nvfp4"  # same policy: no-op
    with pytest.raises(ValueError, match="another policy is installed"):
        install_w4a_stream(model, "w4a_nvfp4", recipe="nvidia")
    with pytest.raises(ValueError, match="has no producer quantizers"):
        stream_boundary_quantizers(model)
    dense = _model()
    for name, module in list(dense.named_modules()):
        if isinstance(module, W4A):
            dense.set_submodule(name, nn.Linear(module.in_features, module.out_features))
    with pytest.raises(ValueError, match="no decoder layer holds a W4A module"):
        install_w4a_stream(dense, "w4afp8")


def test_a_llama_takes_either_stream_but_not_both():
    from tests.test_stream import _model as llama

    model = llama()
    plain = _logits_of(model)
    install_w4a_stream(model, "w4a_nvfp4")
    assert torch.equal(_logits_of(model), plain)  # the generic stream runs on a Llama too
    with pytest.raises(ValueError, match="the generic stream"):
        install_w4a_llama_stream(model, "w4a_nvfp4")
    assert uninstall_w4a_llama_stream(model).mode == "w4a_nvfp4"  # removes either stream
    install_w4a_llama_stream(model, "w4a_nvfp4")
    with pytest.raises(ValueError, match="another policy is installed"):
        install_w4a_stream(model, "w4afp8")


def _logits_of(model: nn.Module) -> torch.Tensor:
    from tests.test_stream import _ids as llama_ids

    with torch.no_grad():
        return model(llama_ids(), use_cache=False).logits


def test_loading_installs_the_generic_stream_on_a_decoder_that_is_not_a_llama():
    model = _model()
    policy = ActivationConfig(mode="w4a_nvfp4", attention={"mode": "w4afp8"})
    assert install_activation_stream(model, policy)
    installed = installed_w4a_stream(model)
    assert installed.mode == "w4a_nvfp4" and installed.attention_mode == "w4afp8"
    scaled = ActivationConfig(mode="w4a_nvfp4", global_scales={"model.layers.0.output": 1.0})
    with pytest.raises(ValueError, match="only the Llama stream has"):
        install_activation_stream(_model(), scaled)
    assert not install_activation_stream(nn.Sequential(nn.Linear(2, 2)), policy)


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["nvfp4", "fp8"])
def test_on_cuda_the_stream_packs_what_the_modules_pack_alone(kind):
    model = _model(kind).cuda()
    with torch.no_grad():
        plain = model(_ids().cuda()).logits
        install_w4a_stream(model, "w4a_nvfp4" if kind == "nvfp4" else "w4afp8")
        seen, _ = _inputs(model)
        streamed = model(_ids().cuda()).logits
    got = _layer(seen, 0)
    assert got["self_attn.q_proj"] is got["self_attn.v_proj"]
    assert got["self_attn.q_proj"].codes.is_cuda
    torch.testing.assert_close(streamed, plain, rtol=0, atol=0)
