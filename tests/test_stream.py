"""The Llama W4A activation stream on the embedded tiny Llama (two of its eight layers, FP32).

The tiny Llama's projections are replaced by round-to-nearest GPTQ weights as W4A modules. The
stream is checked against a straight-line hand-written dataflow (pack, norm, attention,
residual, with the same modules), its installation against every refusal, its removal against
the model as it was, and decoding with a KV cache against the full forward.
"""

import copy
import functools
import inspect

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from floatxq.gptq.solve import GPTQSolveOptions, rtn_quantize
from floatxq.lifecycle.stream import (
    LLAMA_STREAM_PROJECTIONS,
    NVFP4BoundaryQuantizer,
    StreamBoundary,
    StreamLane,
    install_w4a_llama_stream,
    installed_w4a_stream,
    llama_stream_boundaries,
    set_stream_global_scales,
    stream_boundary_quantizers,
    stream_lane,
    stream_layer_plans,
    stream_producer_keys,
    uninstall_w4a_llama_stream,
    validate_producer_scales,
    w4a_stream_policy,
)
from floatxq.nn.gptq_linear import GPTQLinear
from floatxq.nn.w4a_fp8_linear import W4AFP8Linear
from floatxq.nn.w4a_nvfp4_linear import W4ANVFP4Linear
from floatxq.tiny import calibration_samples, load_tiny_llama
from floatxq.w4a.activation import W4AActivation, pack_activation

pytest.importorskip("transformers")

DEPTH = 2
RTN = GPTQSolveOptions(bits=4, group_size=128)


@functools.cache
def _dense() -> nn.Module:
    model = load_tiny_llama(dtype=torch.float32)
    model.model.layers = model.model.layers[:DEPTH]
    model.config.num_hidden_layers = DEPTH
    model.set_attn_implementation("eager")
    return model


def _w4a_layer(layer: nn.Module, cls: type) -> None:
    for path in LLAMA_STREAM_PROJECTIONS:
        dense = layer.get_submodule(path)
        solution = rtn_quantize(dense.weight.detach(), RTN)
        packed = GPTQLinear.from_solution(solution, bits=4, group_size=128)
        layer.set_submodule(path, cls.from_gptq_linear(packed))


@functools.cache
def _w4a_base(kind: str) -> nn.Module:
    model = copy.deepcopy(_dense())
    cls = W4ANVFP4Linear if kind == "nvfp4" else W4AFP8Linear
    for layer in model.model.layers:
        _w4a_layer(layer, cls)
    return model


def _model(kind: str = "nvfp4") -> nn.Module:
    return copy.deepcopy(_w4a_base(kind))


@functools.cache
def _ids() -> torch.Tensor:
    return torch.stack(calibration_samples(num_samples=2, seq_len=24))


# ----------------------------------------------------------------------------------------------
# Boundaries, lanes, policies, quantizers
# ----------------------------------------------------------------------------------------------


def _keys(depth, selected, name, owner="layer"):
    return [
        (b.layer, b.key)
        for b in llama_stream_boundaries(depth, selected)
        if (b.owner, b.name) == (owner, name)
    ]


def test_boundaries_come_five_per_layer_in_execution_order():
    got = llama_stream_boundaries(3, [2, 0])
    assert [b.layer for b in got] == [0] * 5 + [2] * 5
    key = "model.layers.0."
    assert got[:5] == (
        StreamBoundary(0, "layer", "input", key + "input", "attention"),
        StreamBoundary(0, "self_attn", "output", key + "self_attn.o_proj.input", "attention"),
        StreamBoundary(0, "layer", "attention_residual", key + "post_attention_residual", "mlp"),
        StreamBoundary(0, "mlp", "product", key + "mlp.down_proj.input", "mlp"),
        StreamBoundary(0, "layer", "output", key + "output", "attention"),
    )


@pytest.mark.parametrize(
    ("depth", "selected", "inputs"),
    [
        (4, [0, 1, 2, 3], [(0, "model.layers.0.input"), (1, None), (2, None), (3, None)]),
        (4, [1, 2], [(1, "model.layers.1.input"), (2, None)]),  # first selected is interior
        (5, [0, 1, 3, 4], [(0, "model.layers.0.input"), (1, None), (3, "model.layers.3.input"),
                           (4, None)]),  # a gap: layer 3 takes an exact tensor again
        (4, [3], [(3, "model.layers.3.input")]),  # the last layer alone
    ],
)  # fmt: skip
def test_a_layer_input_is_a_producer_only_after_an_unselected_layer(depth, selected, inputs):
    assert _keys(depth, selected, "input") == inputs
    assert _keys(depth, selected, "output") == [(i, f"model.layers.{i}.output") for i in selected]


@pytest.mark.parametrize(
    ("depth", "selected", "error", "match"),
    [
        (0, [], ValueError, "depth must be a positive int"),
        (True, [0], ValueError, "depth must be a positive int"),
        (2, [2], ValueError, r"ints in \[0, 2\)"),
        (2, [-1], ValueError, r"ints in \[0, 2\)"),
        (2, [True], ValueError, r"ints in \[0, 2\)"),
        (2, [1, 1], ValueError, "distinct"),
        (2, "01", TypeError, "iterable of layer indices"),
    ],
)
def test_boundaries_refuse_bad_layer_sets(depth, selected, error, match, production_checks):
    with pytest.raises(error, match=match):
        llama_stream_boundaries(depth, selected)


def test_producer_keys_are_the_nvfp4_lanes_boundaries_with_a_key():
    split = w4a_stream_policy("w4a_nvfp4", attention_mode="w4afp8", mlp_fp8_layers=[1])
    assert stream_producer_keys(split, 3, [0, 1, 2]) == (
        "model.layers.0.post_attention_residual",
        "model.layers.0.mlp.down_proj.input",
        "model.layers.2.post_attention_residual",
        "model.layers.2.mlp.down_proj.input",
    )
    assert stream_producer_keys(w4a_stream_policy("w4afp8"), 3, [0, 1, 2]) == ()
    everything = stream_producer_keys(w4a_stream_policy("w4a_nvfp4"), 3, [0, 1])
    assert len(everything) == 9 and everything[0] == "model.layers.0.input"
    assert stream_lane(split, 1, "mlp") == StreamLane("w4afp8", None)
    assert stream_lane(split, 0, "mlp") == StreamLane("w4a_nvfp4", "least_squares")


def test_layer_plans_name_each_layers_lanes_and_keys():
    plans = stream_layer_plans(w4a_stream_policy("w4a_nvfp4", mlp_fp8_layers=[0]), 2, [0, 1])
    assert plans[0].mlp == StreamLane("w4afp8", None)
    assert plans[1].mlp == StreamLane("w4a_nvfp4", "least_squares")
    assert (plans[0].input_key, plans[1].input_key) == ("model.layers.0.input", None)
    assert plans[1].product_key == "model.layers.1.mlp.down_proj.input"


def test_validate_producer_scales_lists_missing_and_extra_keys():
    validate_producer_scales({"a": 1.0, "b": 2.0}, ["b", "a"])
    with pytest.raises(ValueError, match=r"missing \['c'\], extra \['z'\]"):
        validate_producer_scales({"a": 1.0, "z": 1.0}, ["a", "c"])


def test_policies_are_normalized():
    p = w4a_stream_policy("w4a_nvfp4", recipe="lsq_headroom", mlp_fp8_layers=(2, 0))
    assert (p.recipe, p.attention_mode, p.attention_recipe) == (
        "least_squares_headroom",
        "w4a_nvfp4",
        "least_squares_headroom",
    )
    assert p.mlp_fp8_layers == (0, 2) and p.global_scales is None
    q = w4a_stream_policy("w4a_nvfp4", attention_recipe="nvidia", global_scales={"k": 1 / 3})
    assert q.attention_recipe == "nvidia" and q.recipe == "least_squares"
    assert q.global_scales["k"] == float(torch.tensor(1 / 3, dtype=torch.float32))
    assert w4a_stream_policy("w4afp8") == w4a_stream_policy("w4afp8", mlp_fp8_layers=[])


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(mode="w4a_fp8"), "mode must be one of"),
        (dict(mode="w4afp8", recipe="nvidia"), "FP8 stream takes no NVFP4 recipe"),
        (dict(mode="w4afp8", attention_mode="w4a_nvfp4"), "needs an NVFP4 stream"),
        (dict(mode="w4a_nvfp4", attention_mode="w4afp8", attention_recipe="nvidia"),
         "FP8 attention does not use"),
        (dict(mode="w4a_nvfp4", recipe="best"), "Unsupported NVFP4 scale recipe"),
        (dict(mode="w4afp8", global_scales={"model.layers.0.output": 1.0}),
         "an FP8 stream takes none"),
        (dict(mode="w4a_nvfp4", recipe="nvidia_headroom", global_scales={"k": 1.0}),
         "headroom recipe 'nvidia_headroom'"),
        (dict(mode="w4a_nvfp4", attention_recipe="lsq_headroom", global_scales={"k": 1.0}),
         "headroom recipe 'least_squares_headroom'"),
        (dict(mode="w4a_nvfp4", global_scales={"k": 0.0}), "positive and finite"),
        (dict(mode="w4a_nvfp4", global_scales={"k": 1e-60}), "in FP32"),
        (dict(mode="w4a_nvfp4", global_scales={"k": 1e60}), "in FP32"),
        (dict(mode="w4afp8", mlp_fp8_layers=[0]), "an FP8 stream"),
        (dict(mode="w4a_nvfp4", mlp_fp8_layers=[0, 0]), "distinct"),
        (dict(mode="w4a_nvfp4", mlp_fp8_layers=[-1]), "non-negative ints"),
        (dict(mode="w4a_nvfp4", mlp_fp8_layers=[True]), "non-negative ints"),
        (dict(mode="w4a_nvfp4", mlp_fp8_layers=3), "list or tuple"),
    ],
)  # fmt: skip
def test_policies_refuse_what_no_stream_runs(kwargs, match, production_checks):
    mode = kwargs.pop("mode")
    with pytest.raises(ValueError, match=match):
        w4a_stream_policy(mode, **kwargs)


def test_quantizers_check_their_scale():
    q = NVFP4BoundaryQuantizer("model.layers.0.output", layer=0, recipe="lsq")
    assert (q.calibrated, q.scale, q.recipe) == (False, 0.0, "least_squares")  # 0.0: dynamic
    q.set_scale(0.1)
    assert q.calibrated and q.scale == float(torch.tensor(0.1, dtype=torch.float32))
    assert q.scale_bits.dtype == torch.int32
    for bad in (0.0, -1.0, float("nan"), float("inf"), 1e-60, 1e60, 10**400):
        with pytest.raises(ValueError, match="positive and finite"):
            q.set_scale(bad)
    with pytest.raises(TypeError, match="real number"), _unchecked():
        q.set_scale(True)
    assert q.scale == float(torch.tensor(0.1, dtype=torch.float32))  # refusals changed nothing
    q.reset()
    assert (q.calibrated, q.scale) == (False, 0.0)
    assert q.scales.state_dict() == {"output": q.scale_bits}  # one buffer, in a module


def test_a_quantizer_refuses_a_holder_without_its_buffer():
    from floatxq.lifecycle.stream import StreamScales

    holder = StreamScales({"output": "model.layers.0.output"})
    with pytest.raises(ValueError, match="holds no buffer for 'model.layers.1.output'"):
        NVFP4BoundaryQuantizer("model.layers.1.output", layer=1, recipe="lsq", scales=holder)


def _unchecked():
    from floatxq.testing import production_checks

    return production_checks()


# ----------------------------------------------------------------------------------------------
# Installing
# ----------------------------------------------------------------------------------------------


def _random_llama(**overrides) -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    settings = dict(
        vocab_size=64, hidden_size=256, intermediate_size=256, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, head_dim=64,
    )  # fmt: skip
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(**{**settings, **overrides})).eval()


def test_install_refuses_a_model_that_is_not_a_llama():
    class NotLlama(nn.Module):
        def __init__(self):
            super().__init__()
            self.model = nn.Module()
            self.model.layers = nn.ModuleList([nn.Linear(128, 128)])

    with pytest.raises(ValueError, match="LlamaDecoderLayer"):
        install_w4a_llama_stream(NotLlama(), "w4afp8")
    with pytest.raises(ValueError, match="no model.layers"):
        install_w4a_llama_stream(nn.Linear(2, 2), "w4afp8")


def test_install_refuses_a_layer_that_is_partly_w4a():
    model = _model()
    layer = model.model.layers[1]
    layer.mlp.down_proj = nn.Linear(768, 256)
    with pytest.raises(ValueError, match=r"layer 1 is partly W4A: .*mlp.down_proj \(Linear\)"):
        install_w4a_llama_stream(model, "w4a_nvfp4")
    assert installed_w4a_stream(model) is None


def test_install_refuses_a_model_without_w4a_layers():
    with pytest.raises(ValueError, match="no decoder layer has all seven"):
        install_w4a_llama_stream(copy.deepcopy(_dense()), "w4afp8")


def test_install_refuses_outputs_that_are_not_multiples_of_128():
    model = _random_llama(num_key_value_heads=1, head_dim=96)  # k/v_proj: 96 outputs
    _w4a_layer(model.model.layers[0], W4AFP8Linear)
    with pytest.raises(ValueError, match=r"self_attn.k_proj has out_features=96"):
        install_w4a_llama_stream(model, "w4afp8")


def test_install_refuses_fp8_modules_in_an_nvfp4_lane():
    model = _model("fp8")
    with pytest.raises(ValueError, match=r"W4AFP8Linear, which cannot run NVFP4 carriers"):
        install_w4a_llama_stream(model, "w4a_nvfp4")
    # FP8 attention and FP8 MLPs run on them
    install_w4a_llama_stream(model, "w4a_nvfp4", attention_mode="w4afp8", mlp_fp8_layers=[0, 1])


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(recipe="nvidia"), "FP8 stream takes no NVFP4 recipe"),
        (dict(global_scales={"model.layers.0.output": 1.0}), "an FP8 stream takes none"),
        (dict(mlp_fp8_layers=[1]), "an FP8 stream"),
    ],
)
def test_install_refuses_nvfp4_settings_on_an_fp8_stream(kwargs, match):
    with pytest.raises(ValueError, match=match):
        install_w4a_llama_stream(_model(), "w4afp8", **kwargs)


def test_install_refuses_mlp_layers_beyond_the_model():
    with pytest.raises(ValueError, match=r"mlp_fp8_layers \[2\] lie beyond the model's 2"):
        install_w4a_llama_stream(_model(), "w4a_nvfp4", mlp_fp8_layers=[0, 2])


def test_fused_norms_need_unit_norm_weights():
    model = _model()
    with pytest.raises(ValueError, match="layer 0 input_layernorm.weight is not all 1"):
        install_w4a_llama_stream(model, "w4a_nvfp4", fused_norms=True)
    for layer in model.model.layers:
        layer.input_layernorm.weight.data.fill_(1.0)
        layer.post_attention_layernorm.weight.data.fill_(1.0)
    assert install_w4a_llama_stream(model, "w4a_nvfp4", fused_norms=True).fused_norms


def test_headroom_needs_one_scale_on_modules_sharing_a_carrier():
    model = _model()
    attn = model.model.layers[1].self_attn
    attn.q_proj.activation_global_scale = 0.5
    attn.k_proj.activation_global_scale = 0.5
    with pytest.raises(ValueError, match=r"layer 1: self_attn.q_proj, .* identical"):
        install_w4a_llama_stream(model, "w4a_nvfp4", recipe="nvidia_headroom")
    attn.v_proj.activation_global_scale = 0.5
    mlp = model.model.layers[0].mlp
    mlp.gate_proj.activation_global_scale = 0.25
    with pytest.raises(ValueError, match=r"layer 0: mlp.gate_proj, mlp.up_proj"):
        install_w4a_llama_stream(model, "w4a_nvfp4", recipe="nvidia_headroom")
    # an FP8 MLP lane shares no NVFP4 scale
    install_w4a_llama_stream(model, "w4a_nvfp4", recipe="nvidia_headroom", mlp_fp8_layers=[0])


def test_global_scales_must_name_exactly_the_producers():
    model = _model()
    keys = stream_producer_keys(w4a_stream_policy("w4a_nvfp4"), DEPTH, range(DEPTH))
    scales = dict.fromkeys(keys, 0.01)
    with pytest.raises(ValueError, match=r"missing \['model.layers.1.output'\], extra \['x'\]"):
        install_w4a_llama_stream(
            model, "w4a_nvfp4", global_scales={**dict(list(scales.items())[:-1]), "x": 1.0}
        )
    install_w4a_llama_stream(model, "w4a_nvfp4", global_scales=scales)
    quantizers = stream_boundary_quantizers(model)
    assert list(quantizers) == list(keys)
    assert all(q.calibrated and q.scale == float(torch.tensor(0.01)) for q in quantizers.values())


def test_reinstalling_checks_again_and_a_new_policy_is_refused():
    model = _model()
    policy = install_w4a_llama_stream(model, "w4a_nvfp4", attention_mode="w4afp8")
    hooks = len(model.model.layers[0]._forward_pre_hooks)
    again = install_w4a_llama_stream(model, "w4a_nvfp4", attention_mode="w4afp8", recipe="lsq")
    assert again == policy and len(model.model.layers[0]._forward_pre_hooks) == hooks
    with pytest.raises(ValueError, match="another policy is installed"):
        install_w4a_llama_stream(model, "w4a_nvfp4")
    model.model.layers[1].mlp.up_proj = nn.Linear(256, 768)
    with pytest.raises(ValueError, match="layer 1 is partly W4A"):  # checked again
        install_w4a_llama_stream(model, "w4a_nvfp4", attention_mode="w4afp8")


def _state(model: nn.Module) -> dict:
    return {k: v.clone() for k, v in model.state_dict().items()}


def test_uninstall_restores_the_model_exactly():
    model = _model()
    ids = _ids()[:1]
    with torch.no_grad():
        before = model(ids).logits
    state, modules = _state(model), [n for n, _ in model.named_modules()]
    keys = stream_producer_keys(w4a_stream_policy("w4a_nvfp4"), DEPTH, range(DEPTH))
    policy = install_w4a_llama_stream(model, "w4a_nvfp4", global_scales=dict.fromkeys(keys, 0.02))
    assert installed_w4a_stream(model) == policy
    # the producer scales are one submodule per layer, with one state-dict entry per producer
    added = [n for n, _ in model.named_modules() if n not in modules]
    assert added == [f"model.layers.{i}.w4a_stream_scales" for i in range(DEPTH)]
    scales = {k: v for k, v in model.state_dict().items() if k not in state}
    assert len(scales) == len(keys)
    for key in keys:
        i, _, suffix = key.removeprefix("model.layers.").partition(".")
        name = suffix.removeprefix("self_attn.").removeprefix("mlp.").replace(".", "_")
        bits = scales[f"model.layers.{i}.w4a_stream_scales.{name}"]
        assert bits.dtype == torch.int32 and bits.view(torch.float32) == torch.tensor(0.02)
    assert all("forward" in layer.__dict__ for layer in model.model.layers)
    assert "forward" in model.model.norm.__dict__  # the last layer is selected
    with torch.no_grad():
        streamed = model(ids).logits
    assert not torch.equal(streamed, before)
    assert uninstall_w4a_llama_stream(model) == policy
    assert installed_w4a_stream(model) is None
    assert uninstall_w4a_llama_stream(model) is None
    for module in [*model.model.layers, model.model.norm]:
        assert "forward" not in module.__dict__ and not module._forward_pre_hooks
    after = _state(model)
    assert after.keys() == state.keys() and all(torch.equal(after[k], state[k]) for k in state)
    with torch.no_grad():
        assert torch.equal(model(ids).logits, before)


def test_unselected_layers_read_exact_values_and_accelerate_forwards_are_honoured():
    model = _model()
    model.model.layers[0] = copy.deepcopy(_dense().model.layers[0])  # layer 0 stays dense
    norm = model.model.norm
    norm._old_forward = norm.forward  # as accelerate's hook leaves a module
    norm.forward = functools.partial(lambda module, *a, **k: module._old_forward(*a, **k), norm)
    policy = install_w4a_llama_stream(model, "w4afp8")
    assert stream_producer_keys(policy, DEPTH, [1]) == ()
    assert len(model.model.layers[0]._forward_pre_hooks) == 1
    assert "_old_forward" in norm.__dict__ and norm.__dict__["_old_forward"] is not norm.forward
    with torch.no_grad():
        logits = model(_ids()).logits
    assert torch.isfinite(logits).all()
    uninstall_w4a_llama_stream(model)
    assert norm.__dict__["_old_forward"] == type(norm).forward.__get__(norm)  # put back


def test_set_stream_global_scales_calibrates_and_resets_every_producer():
    model = _model()
    install_w4a_llama_stream(model, "w4a_nvfp4", attention_mode="w4afp8")
    quantizers = stream_boundary_quantizers(model)
    keys = list(quantizers)
    assert len(keys) == 2 * DEPTH and all(not q.calibrated for q in quantizers.values())
    with pytest.raises(ValueError, match=r"missing \['model.layers.1.mlp.down_proj.input'\]"):
        set_stream_global_scales(model, dict.fromkeys(keys[:-1], 0.5))
    with pytest.raises(ValueError, match="positive and finite"):
        set_stream_global_scales(model, {**dict.fromkeys(keys, 0.5), keys[0]: -1.0})
    assert all(not q.calibrated for q in quantizers.values())  # refusals change nothing
    set_stream_global_scales(model, dict.fromkeys(keys, 0.5))
    assert all(q.calibrated and q.scale == 0.5 for q in quantizers.values())
    assert dict(installed_w4a_stream(model).global_scales) == dict.fromkeys(keys, 0.5)
    # reinstalling with the calibrated policy is the same policy
    install_w4a_llama_stream(
        model, "w4a_nvfp4", attention_mode="w4afp8", global_scales=dict.fromkeys(keys, 0.5)
    )
    set_stream_global_scales(model, None)
    assert all(not q.calibrated and q.scale == 0.0 for q in quantizers.values())
    assert installed_w4a_stream(model).global_scales is None
    with pytest.raises(ValueError, match="no W4A stream is installed"):
        set_stream_global_scales(_model(), None)


# ----------------------------------------------------------------------------------------------
# The dataflow against a hand-written one
# ----------------------------------------------------------------------------------------------


def _record(model: nn.Module) -> tuple[list, list]:
    """Each decoder layer call's (args, kwargs, output), hooks to remove."""
    calls: list = []

    def pre(_m, args, kwargs):
        calls.append([args, kwargs])

    def post(_m, _args, _kwargs, out):
        calls[-1].append(out)

    hooks = [m.register_forward_pre_hook(pre, with_kwargs=True) for m in model.model.layers]
    hooks += [m.register_forward_hook(post, with_kwargs=True) for m in model.model.layers]
    return calls, hooks


def _by_hand(layer, index, hidden, kwargs, attention, mlp, scales=None):
    """One streamed layer written out: every operand packed with floatxq.pack_activation (a
    producer with a scale in ``scales`` at that scale), the residual in FP32, eager attention,
    the layer's own W4A modules."""
    from transformers.models.llama.modeling_llama import (
        apply_rotary_pos_emb,
        eager_attention_forward,
    )

    scales = {k.removeprefix(f"model.layers.{index}."): v for k, v in (scales or {}).items()}

    def pack(x, lane, ref=None, key=None):
        if lane.mode == "w4afp8":
            return pack_activation(x, "w4afp8", model_dtype=torch.float32, reference=ref)
        return pack_activation(
            x, "w4a_nvfp4", model_dtype=torch.float32, recipe=lane.recipe, reference=ref,
            global_scale=scales.get(key),
        )  # fmt: skip

    x = hidden
    if not isinstance(x, W4AActivation):
        x = pack(hidden, attention, ref=hidden, key="input")
    xr = x.exact(torch.float32)

    def normed(norm, value):
        inv = torch.rsqrt(value.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon)
        return value * inv * norm.weight

    attn, block = layer.self_attn, layer.mlp
    n1 = normed(layer.input_layernorm, xr)
    a = pack(n1, attention, ref=n1)
    batch, seq, _ = xr.shape
    heads = (batch, seq, -1, attn.head_dim)
    q, k, v = (m(a).view(heads).transpose(1, 2) for m in (attn.q_proj, attn.k_proj, attn.v_proj))
    cos, sin = kwargs["position_embeddings"]
    q, k = apply_rotary_pos_emb(q, k, cos, sin)
    out, _ = eager_attention_forward(attn, q, k, v, kwargs["attention_mask"], scaling=attn.scaling)
    r1 = xr + attn.o_proj(
        pack(out.reshape(batch, seq, -1), attention, key="self_attn.o_proj.input")
    )
    n2 = normed(layer.post_attention_layernorm, r1)
    b = pack(n2, mlp, ref=n2)
    p = F.silu(block.gate_proj(b)) * block.up_proj(b)
    r2 = r1 + block.down_proj(pack(p, mlp, key="mlp.down_proj.input"))
    return pack(r2, attention, ref=r2, key="output")


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(mode="w4a_nvfp4"),
        dict(mode="w4a_nvfp4", attention_mode="w4afp8", mlp_fp8_layers=[1]),
        dict(mode="w4afp8"),
    ],
)
def test_the_stream_equals_its_dataflow_written_by_hand(kwargs):
    model = _model()
    policy = install_w4a_llama_stream(model, **kwargs)
    plans = stream_layer_plans(policy, DEPTH, range(DEPTH))
    calls, hooks = _record(model)
    with torch.no_grad():
        logits = model(_ids()).logits
        for layer, (args, kw, out), (i, plan) in zip(
            model.model.layers, calls, plans.items(), strict=True
        ):
            assert isinstance(out, W4AActivation) and out.model_dtype == torch.float32
            want = _by_hand(layer, i, args[0], kw, plan.attention, plan.mlp)
            assert out.mode == plan.attention.mode
            assert torch.equal(out.reference, want.reference)
            assert torch.equal(out.codes.view(torch.uint8), want.codes.view(torch.uint8))
        final = model.lm_head(model.model.norm(calls[-1][2].exact()))
    for h in hooks:
        h.remove()
    assert torch.equal(logits, final)


def test_calibrated_producers_pack_with_their_scale_and_observers_see_the_raw_value():
    model = _model()
    keys = stream_producer_keys(w4a_stream_policy("w4a_nvfp4"), DEPTH, range(DEPTH))
    scales = {k: 0.001 * (i + 1) for i, k in enumerate(keys)}
    install_w4a_llama_stream(model, "w4a_nvfp4", global_scales=scales)
    seen = []
    quantizer = stream_boundary_quantizers(model)["model.layers.1.mlp.down_proj.input"]
    quantizer.observer = lambda x: seen.append(x.clone())
    calls, hooks = _record(model)
    with torch.no_grad():
        model(_ids())
    for h in hooks:
        h.remove()
    lane = StreamLane("w4a_nvfp4", "least_squares")
    for i, (layer, (args, kw, out)) in enumerate(zip(model.model.layers, calls, strict=True)):
        want = _by_hand(layer, i, args[0], kw, lane, lane, scales)
        fp32 = torch.tensor(scales[f"model.layers.{i}.output"], dtype=torch.float32)
        assert torch.equal(out.global_scale, fp32)
        assert torch.equal(out.reference, want.reference)
    assert len(seen) == 1 and seen[0].shape == (2, 24, 768)

    def abort(_x):
        raise KeyboardInterrupt  # an observer ends the forward

    quantizer.observer = abort
    with pytest.raises(KeyboardInterrupt), torch.no_grad():
        model(_ids())


# ----------------------------------------------------------------------------------------------
# Decoding with a KV cache
# ----------------------------------------------------------------------------------------------


def _cache_argument(model: nn.Module) -> str:
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


@pytest.mark.parametrize(
    ("kwargs", "scale"),
    [
        (dict(mode="w4afp8"), None),  # per-token FP8: each row quantized alone
        (dict(mode="w4a_nvfp4", recipe="nvidia_headroom"), 0.004),  # static NVFP4 scales
    ],
)
def test_decoding_with_a_kv_cache_matches_the_full_forward(kwargs, scale):
    model = _model()
    if scale is not None:
        for module in model.modules():
            if isinstance(module, W4ANVFP4Linear):
                module.activation_global_scale = scale
    install_w4a_llama_stream(model, **kwargs)
    ids = _ids()[:1]
    name = _cache_argument(model)
    with torch.no_grad():
        full = model(ids, use_cache=False).logits[:, -1]
        prefix = model(ids[:, :-1], use_cache=True)
        cache = getattr(prefix, name, None) or prefix.past_key_values
        step = model(ids[:, -1:], use_cache=True, **{name: cache}).logits[:, -1]
        wrong = model(ids[:, -1:], use_cache=False).logits[:, -1]  # without the cache
    error = float((step - full).norm() / full.norm())
    assert error < 1e-4, error
    assert float((wrong - full).norm() / full.norm()) > 1e-2


# ----------------------------------------------------------------------------------------------
# CUDA: the Triton packers, no host reads, CUDA graphs
# ----------------------------------------------------------------------------------------------


def _bytes(t: torch.Tensor | None) -> torch.Tensor | None:
    if t is None:
        return None
    return (t.view(torch.uint8) if t.element_size() == 1 else t).cpu()


def _same_carrier(a: W4AActivation, b: W4AActivation) -> bool:
    fields = ("codes", "scales", "global_scale", "token_scale", "reference")
    return all(
        (getattr(a, f) is None) == (getattr(b, f) is None)
        and (getattr(a, f) is None or torch.equal(_bytes(getattr(a, f)), _bytes(getattr(b, f))))
        for f in fields
    ) and (a.mode, a.recipe, a.shape, a.model_dtype) == (b.mode, b.recipe, b.shape, b.model_dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "recipe", [None, "nvidia", "least_squares", "four_six", "exhaustive", "nvidia_headroom"]
)
def test_cuda_packs_the_same_carriers_as_the_cpu(dtype, recipe):
    from floatxq.lifecycle.stream.codec import _RuntimeCodec

    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(2, 33, 256, generator=gen) * torch.logspace(-2, 1, 256)).to(dtype)
    lane = StreamLane("w4afp8", None) if recipe is None else StreamLane("w4a_nvfp4", recipe)
    codec = _RuntimeCodec({})
    layer = nn.Module()
    for bits in (0.0, 0.01):  # a headroom linear's scale: 0.0 is dynamic
        layer.activation_global_scale_bits = torch.tensor(bits).view(torch.int32)
        got = codec.pack(
            x.cuda(), lane, site="input", key=None, headroom=layer.cuda(), reference=x.cuda(),
            model_dtype=dtype,
        )  # fmt: skip
        gs = None if recipe is None or not lane.headroom or bits == 0 else bits
        kw = {} if recipe is None else dict(recipe=recipe, global_scale=gs)
        want = pack_activation(x, lane.mode, model_dtype=dtype, reference=x, **kw)
        assert _same_carrier(got, want)
        if recipe is not None:
            inv = torch.linspace(0.5, 2.0, 66)
            scaled = codec.rescale(got, inv.cuda(), site="attention_norm", lane=lane)
            assert _same_carrier(scaled, want.rescale_tokens(inv))


@pytest.mark.gpu
@pytest.mark.parametrize(
    "kwargs",
    [
        dict(mode="w4afp8"),
        dict(mode="w4a_nvfp4"),
        dict(mode="w4a_nvfp4", attention_mode="w4afp8", mlp_fp8_layers=[0]),
        dict(mode="w4a_nvfp4", recipe="nvidia_headroom"),
    ],
)
def test_a_cuda_layer_is_captured_in_a_cuda_graph(kwargs):
    model = _model()
    if kwargs.get("recipe") == "nvidia_headroom":
        for module in model.modules():
            if isinstance(module, W4ANVFP4Linear):
                module.activation_global_scale = 0.003
    install_w4a_llama_stream(model, **kwargs)
    ids = _ids()
    with torch.no_grad():
        on_cpu = model(ids, use_cache=False).logits
    model.cuda()
    calls, hooks = _record(model)
    with torch.no_grad():
        on_gpu = model(ids.cuda(), use_cache=False).logits
    for h in hooks:
        h.remove()
    error = float((on_gpu.cpu() - on_cpu).norm() / on_cpu.norm())
    assert error < 1e-2, error  # other GEMM routes (Triton), other summation order
    args, kw, eager = calls[1]  # layer 1 reads layer 0's carrier
    layer = model.model.layers[1]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side), torch.no_grad():
        for _ in range(2):  # warm up: Triton compiles, caches fill
            layer(*args, **kw)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph), torch.no_grad():  # a host read here raises
        captured = layer(*args, **kw)
    graph.replay()
    torch.cuda.synchronize()
    assert _same_carrier(captured, eager)
