"""The W4A stream replayed in FP32 (floatxq.lifecycle.replay) and the GPTQ run built on it.

The replay must compute what the runtime stream computes: with the W4A GEMMs replaced by the
replay's own FP32 product (decoded operand times dequantized weight) the two are bit for bit
equal in every mode, so nothing but the GEMM's summation order separates them; with the real
GEMMs they agree to FP32 rounding, up to an occasional rounding step where an operand lies on a
quantization boundary. The GPTQ run is checked against Hessians built by hand from the rounded
operands.
"""

import copy
import functools

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import floatxq.lifecycle.gptq as gptq_lifecycle
from floatxq.config import GPTQConfig
from floatxq.fp8 import fp8_token_qdq
from floatxq.gptq.hessian import hessian_finalize, hessian_init, hessian_update
from floatxq.lifecycle.calibration import prepare_calibration
from floatxq.lifecycle.gptq import quantize_gptq_model
from floatxq.lifecycle.replay import (
    ReplayCodec,
    ReplayOperand,
    replay_llama_layer,
    round_w4a_activation,
    round_w4a_replay_operand,
)
from floatxq.lifecycle.stream import (
    StreamLane,
    install_w4a_llama_stream,
    installed_w4a_stream,
    stream_layer_plans,
    stream_producer_keys,
    w4a_stream_policy,
)
from floatxq.nn.gptq_linear import GPTQLinear
from floatxq.nn.w4a_nvfp4_linear import W4ANVFP4Linear
from floatxq.nvfp4.headroom import headroom_amax, headroom_init, headroom_update
from floatxq.nvfp4.quantize import nvfp4_block_qdq, nvfp4_global_scale
from floatxq.tiny import calibration_samples
from floatxq.w4a.activation import W4AActivation, pack_activation
from tests.test_stream import DEPTH, _dense, _ids, _model, _random_llama, _record

pytest.importorskip("transformers")

RECIPES = (
    "nvidia",
    "nvidia_headroom",
    "four_six",
    "least_squares",
    "least_squares_headroom",
    "least_squares_grid",
    "exhaustive",
)


def _activations(dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(3, 5, 256, generator=gen) * torch.logspace(-3, 2, 256)
    x[0, 0] = 0.0  # an all-zero row
    return x.to(dtype)


# ----------------------------------------------------------------------------------------------
# Rounding
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_round_w4a_activation_is_the_two_qdq_oracles(dtype):
    x = _activations(dtype)
    assert torch.equal(round_w4a_activation(x, "w4afp8"), fp8_token_qdq(x))
    for recipe in ("nvidia", "least_squares"):
        got = round_w4a_activation(x, "w4a_nvfp4", recipe=recipe)
        assert got.dtype == dtype and torch.equal(got, nvfp4_block_qdq(x, None, recipe))
    fixed = round_w4a_activation(x, "w4a_nvfp4", global_scale=0.01)
    assert torch.equal(fixed, nvfp4_block_qdq(x, 0.01, "least_squares"))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("recipe", [None, *RECIPES])
def test_the_replay_operand_is_the_carriers_fp32_decode(dtype, recipe):
    x = _activations(dtype, seed=1)
    mode = "w4afp8" if recipe is None else "w4a_nvfp4"
    got = round_w4a_replay_operand(x, mode, recipe=recipe)
    assert got.dtype == torch.float32 and got.shape == x.shape
    carrier = pack_activation(x, mode, recipe=recipe)  # dynamic scale on x's grid
    assert torch.equal(got, carrier.decode(torch.float32))  # (==: signed zeros may differ)
    if recipe is not None:
        fixed = round_w4a_replay_operand(x, mode, recipe=recipe, global_scale=0.25)
        assert torch.equal(fixed, pack_activation(x, mode, recipe=recipe, global_scale=0.25)
                           .decode(torch.float32))  # fmt: skip


def test_the_replay_operand_keeps_fp32_where_the_qdq_rounds_to_the_dtype():
    x = _activations(torch.bfloat16, seed=2)
    fp32 = round_w4a_replay_operand(x, "w4afp8")
    assert not torch.equal(fp32, fp32.to(torch.bfloat16).float())
    assert torch.equal(round_w4a_activation(x, "w4afp8"), fp32.to(torch.bfloat16))


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        (dict(mode="w4a_fp4"), ValueError, "mode must be one of"),
        (dict(mode="w4afp8", recipe="nvidia"), ValueError, "recipe applies to mode 'w4a_nvfp4'"),
        (dict(mode="w4afp8", global_scale=1.0), ValueError, "global_scale applies to mode"),
        (dict(mode="w4a_nvfp4", recipe="best"), ValueError, "Unsupported NVFP4 scale recipe"),
        (dict(mode="w4a_nvfp4", global_scale=-1.0), ValueError, "positive and finite"),
    ],
)
def test_rounding_refuses_bad_arguments(kwargs, error, match, production_checks):
    x = torch.ones(2, 128)
    for fn in (round_w4a_activation, round_w4a_replay_operand):
        with pytest.raises(error, match=match):
            fn(x, **kwargs)
    with pytest.raises(TypeError, match="floating"):
        round_w4a_replay_operand(torch.ones(2, 128, dtype=torch.int32), "w4afp8")
    with pytest.raises(ValueError, match="finite"):
        round_w4a_replay_operand(torch.full((2, 128), float("nan")), "w4a_nvfp4")


def test_operands_round_lazily_and_rescale_by_rows():
    x = _activations(torch.float32, seed=3)
    lane = StreamLane("w4a_nvfp4", "least_squares")
    op = ReplayOperand(x, lane, reference=x, model_dtype=torch.bfloat16)
    assert op._base is None  # nothing rounded until the GEMM reads it
    inv = torch.linspace(0.5, 2.0, 15)
    scaled = op.rescaled(inv)
    carrier = pack_activation(x, "w4a_nvfp4", reference=x, model_dtype=torch.bfloat16)
    assert torch.equal(scaled.rounded(), carrier.rescale_tokens(inv).decode(torch.float32))
    assert torch.equal(scaled.exact(), carrier.rescale_tokens(inv).exact())
    assert torch.equal(op.exact32(), x) and op.exact().dtype == torch.bfloat16
    back = ReplayOperand.from_carrier(carrier)
    assert torch.equal(back.rounded(), op.rounded()) and back.lane == lane


# ----------------------------------------------------------------------------------------------
# Replay against the runtime stream
# ----------------------------------------------------------------------------------------------

MODES = [
    dict(mode="w4afp8"),
    dict(mode="w4a_nvfp4"),
    dict(mode="w4a_nvfp4", recipe="exhaustive"),
    dict(mode="w4a_nvfp4", recipe="nvidia"),
    dict(mode="w4a_nvfp4", attention_mode="w4afp8"),  # FP8 attention, NVFP4 MLP
    dict(mode="w4a_nvfp4", mlp_fp8_layers=[1]),
    dict(mode="w4a_nvfp4", recipe="nvidia_headroom"),
    dict(mode="w4a_nvfp4", fused_norms=True),
    dict(mode="w4a_nvfp4", global_scales=True),  # calibrated producers
]


def _streamed(kwargs: dict) -> tuple[nn.Module, dict]:
    """The tiny W4A Llama with a stream installed (headroom: per-module scales set; fused
    norms: unit norm weights; ``global_scales=True``: every producer calibrated)."""
    model = _model()
    kwargs = dict(kwargs)
    if kwargs.get("recipe", "").endswith("headroom"):
        shared = {"q": 0.002, "k": 0.002, "v": 0.002, "o": 0.003, "gate": 0.004, "up": 0.004}
        for name, module in model.named_modules():
            if isinstance(module, W4ANVFP4Linear):  # q/k/v share one scale, gate/up another
                module.activation_global_scale = shared.get(name.rsplit(".")[-1][:-5], 0.005)
    if kwargs.get("fused_norms"):
        for layer in model.model.layers:
            layer.input_layernorm.weight.data.fill_(1.0)
            layer.post_attention_layernorm.weight.data.fill_(1.0)
    if kwargs.get("global_scales") is True:
        keys = stream_producer_keys(w4a_stream_policy("w4a_nvfp4"), DEPTH, range(DEPTH))
        kwargs["global_scales"] = {k: 0.003 + 0.001 * i for i, k in enumerate(keys)}
    policy = install_w4a_llama_stream(model, **kwargs)
    return model, stream_layer_plans(policy, DEPTH, range(DEPTH))


def _fp32_gemm(module: nn.Module, args: tuple, out: torch.Tensor) -> torch.Tensor | None:
    x = args[0]
    if isinstance(x, ReplayOperand):  # a replayed call: the replay multiplies in FP32 itself
        return None
    x = x.decode(torch.float32) if isinstance(x, W4AActivation) else x.float()
    return F.linear(x, module.dequantize_weight(dtype=torch.float32)).to(out.dtype)


def _replayed_layers(model, plans, kwargs):
    """(runtime output, replay output) per layer, both FP32, the replay fed each layer's
    runtime input."""
    calls, hooks = _record(model)
    with torch.no_grad():
        model(_ids(), use_cache=False)
        pairs = []
        for (i, plan), (args, kw, out) in zip(plans.items(), calls, strict=True):
            codec = ReplayCodec(producer_scales=kwargs.get("global_scales"))
            replayed = replay_llama_layer(model.model.layers[i], *args, plan=plan, codec=codec,
                                          **kw)  # fmt: skip
            assert isinstance(replayed, ReplayOperand)
            pairs.append((out.exact(torch.float32), replayed.exact32()))
    for h in hooks:
        h.remove()
    return pairs


@pytest.mark.parametrize("kwargs", MODES, ids=lambda k: "-".join(map(str, k.values())))
def test_the_replay_is_the_runtime_stream_bit_for_bit_with_the_same_gemm(kwargs):
    model, plans = _streamed(kwargs)
    for module in model.modules():
        if isinstance(module, GPTQLinear):
            module.register_forward_hook(_fp32_gemm)
    producer = installed_w4a_stream(model).global_scales
    for runtime, replayed in _replayed_layers(model, plans, {"global_scales": producer}):
        assert torch.equal(replayed, runtime)


def test_the_replay_matches_the_runtime_stream_with_the_w4a_gemms():
    errors = []
    for kwargs in MODES:
        model, plans = _streamed(kwargs)
        producer = installed_w4a_stream(model).global_scales
        for runtime, replayed in _replayed_layers(model, plans, {"global_scales": producer}):
            errors.append(float((replayed - runtime).norm() / runtime.norm()))
    errors = torch.tensor(errors)
    # The W4A GEMMs sum in another order than F.linear (about 1e-7 apart); where that moves an
    # operand across a rounding boundary of the next pack, an element (or, for a block scale, a
    # block of 16) moves by a step: a few layers differ by up to ~1e-3 (the CPU decides which).
    assert float(errors.median()) < 1e-6, errors
    assert float(errors.max()) < 1e-2, errors


def test_a_replayed_layer_reads_a_tensor_an_operand_or_a_carrier():
    model, plans = _streamed(dict(mode="w4afp8"))
    for module in model.modules():  # the runtime multiplies as the replay does
        if isinstance(module, GPTQLinear):
            module.register_forward_hook(_fp32_gemm)
    calls, hooks = _record(model)
    with torch.no_grad():
        model(_ids(), use_cache=False)
    for h in hooks:
        h.remove()
    args, kw, runtime = calls[1]
    assert isinstance(args[0], W4AActivation)  # layer 0 handed layer 1 a carrier
    expected = runtime.exact(torch.float32)  # what the runtime stream's layer 1 computed
    from_carrier = replay_llama_layer(model.model.layers[1], args[0], plan=plans[1], **kw)
    assert torch.equal(from_carrier.exact32(), expected)
    operand = ReplayOperand.from_carrier(args[0])
    from_operand = replay_llama_layer(model.model.layers[1], operand, plan=plans[1], **kw)
    assert torch.equal(from_operand.exact32(), expected)
    # an FP32 tensor (the carrier's exact value) is packed at the layer's input in the same lane
    from_tensor = replay_llama_layer(model.model.layers[1], args[0].exact(), plan=plans[1], **kw)
    assert torch.equal(from_tensor.exact32(), expected)
    with pytest.raises(ValueError, match="position_embeddings"):
        replay_llama_layer(model.model.layers[1], operand, plan=plans[1])


# ----------------------------------------------------------------------------------------------
# GPTQ with an activation policy
# ----------------------------------------------------------------------------------------------


@functools.cache
def _samples() -> tuple[torch.Tensor, ...]:
    return tuple(calibration_samples(num_samples=3, seq_len=24))


def _gptq(activation, model=None, **config):
    model = copy.deepcopy(_dense()) if model is None else model
    calibration = prepare_calibration(list(_samples()), batch_size=1)
    cfg = GPTQConfig(bits=4, group_size=128, activation=activation, **config)
    with torch.no_grad():
        report = quantize_gptq_model(model, cfg, calibration, device=torch.device("cpu"))
    return model, report


def _hessians(monkeypatch) -> list[torch.Tensor]:
    """Record each solve's Hessian, in solve order."""
    seen = []
    solve = gptq_lifecycle.gptq_solve

    def recording(weight, hessian, options):
        seen.append(hessian.clone())
        return solve(weight, hessian, options)

    monkeypatch.setattr(gptq_lifecycle, "gptq_solve", recording)
    return seen


def _normed_inputs() -> list[torch.Tensor]:
    """Layer 0's attention norm operand (FP32) for each calibration sample."""
    model = _dense()
    norm = model.model.layers[0].input_layernorm
    out = []
    with torch.no_grad():
        for ids in _samples():
            xr = model.model.embed_tokens(ids[None]).float()
            inv = torch.rsqrt(xr.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon)
            out.append(xr * inv * norm.weight.float())
    return out


def _hessian_of(rows: list[torch.Tensor]) -> torch.Tensor:
    state = hessian_init(rows[0].shape[-1])
    for x in rows:
        state = hessian_update(state, x)
    return hessian_finalize(state)


@pytest.mark.parametrize("recipe", [None, "nvidia", "least_squares"])
def test_gptq_folds_the_hessian_of_the_rounded_norm_operand(recipe, monkeypatch):
    mode = "w4afp8" if recipe is None else "w4a_nvfp4"
    seen = _hessians(monkeypatch)
    activation = {"mode": mode} if recipe is None else {"mode": mode, "recipe": recipe}
    _, report = _gptq(activation)
    normed = _normed_inputs()
    rounded = [round_w4a_replay_operand(x, mode, recipe=recipe) for x in normed]
    assert torch.equal(seen[0], _hessian_of(rounded))  # q_proj of layer 0
    assert not torch.equal(seen[0], _hessian_of(normed))
    scale = report.activation_scales["model.layers.0.self_attn.q_proj"]
    if recipe is None:
        assert scale == 0.0
    else:  # the running max|x| of the un-rounded operand, no dtype grid
        amax = torch.stack([x.abs().amax() for x in normed]).amax()
        assert scale == float(nvfp4_global_scale(amax, recipe=recipe))


def test_gptq_freezes_a_headroom_scale_before_folding(monkeypatch):
    seen = _hessians(monkeypatch)
    _, report = _gptq({"mode": "w4a_nvfp4", "recipe": "nvidia_headroom"})
    normed = _normed_inputs()
    state = headroom_init()
    for x in normed:
        state = headroom_update(state, x.reshape(-1, x.shape[-1]))
    scale = float(nvfp4_global_scale(headroom_amax(state), recipe="nvidia_headroom"))
    names = [f"model.layers.0.self_attn.{p}_proj" for p in "qkv"]
    assert [report.activation_scales[n] for n in names] == [scale] * 3
    rounded = [
        round_w4a_replay_operand(x, "w4a_nvfp4", recipe="nvidia_headroom", global_scale=scale)
        for x in normed
    ]
    assert torch.equal(seen[0], _hessian_of(rounded))


def test_gptq_with_an_activation_policy_reports_every_modules_scale():
    model, report = _gptq({"mode": "w4a_nvfp4", "attention": {"mode": "w4afp8"},
                           "mlp": {"mode": "w4afp8", "layers": [1]}})  # fmt: skip
    scales = dict(report.activation_scales)
    assert sorted(scales) == sorted(m.name for m in report.modules)
    assert len(scales) == 7 * DEPTH
    fp8 = [n for n in scales if "self_attn" in n or ".1.mlp" in n]
    assert all(scales[n] == 0.0 for n in fp8)
    nvfp4 = [n for n in scales if n not in fp8]
    assert len(nvfp4) == 3 and all(scales[n] > 0 for n in nvfp4)
    assert scales["model.layers.0.mlp.gate_proj"] == scales["model.layers.0.mlp.up_proj"]
    assert all(type(model.get_submodule(n)) is GPTQLinear for n in scales)
    _, plain = _gptq(None)
    assert dict(plain.activation_scales) == {}


def test_gptq_replays_a_layer_after_an_unquantized_one():
    model, report = _gptq("w4afp8", dynamic={r"-:model\.layers\.0\..*": {}})
    assert sorted(report.activation_scales) == sorted(
        f"model.layers.1.{p}" for p in ("self_attn.q_proj", "self_attn.k_proj",
        "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
    )  # fmt: skip
    assert type(model.model.layers[0].mlp.down_proj) is nn.Linear


def _mistral() -> nn.Module:
    from transformers import MistralConfig, MistralForCausalLM

    torch.manual_seed(0)
    config = MistralConfig(
        vocab_size=256, hidden_size=256, intermediate_size=256, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, head_dim=64,
    )  # fmt: skip
    return MistralForCausalLM(config).eval()


@pytest.mark.parametrize(
    ("model", "activation", "config", "match"),
    [
        (_mistral, "w4afp8", {}, "runs Llama causal LMs"),
        (None, "w4afp8", {"dynamic": {r"-:.*\.1\.mlp\.down_proj": {}}},
         r"layer 1 quantizes 6 of its seven projections but not \['mlp.down_proj'\]"),
        (lambda: _random_llama(num_key_value_heads=1, head_dim=96), "w4afp8", {},
         r"self_attn.k_proj is \(96, 256\)"),
        (None, {"mode": "w4a_nvfp4", "mlp": {"mode": "w4afp8", "layers": [2]}}, {},
         r"mlp layers \[2\] lie beyond"),
        (None, {"mode": "w4a_nvfp4", "global_scales": {"model.layers.0.output": 1.0}}, {},
         r"missing \['model.layers.0.input'"),
        (None, "w4afp8", {"dynamic": {r"-:model\.layers\..*": {}}}, "no decoder layer"),
    ],
)  # fmt: skip
def test_gptq_refuses_an_activation_policy_it_cannot_replay(model, activation, config, match):
    dense = model() if model is not None else copy.deepcopy(_dense())
    before = {n: type(m) for n, m in dense.named_modules()}
    with pytest.raises(ValueError, match=match):
        _gptq(activation, model=dense, **config)
    assert {n: type(m) for n, m in dense.named_modules()} == before  # before any work


@pytest.mark.gpu
def test_gptq_replays_the_stream_on_cuda():
    activation = {"mode": "w4a_nvfp4", "mlp": {"mode": "w4afp8", "layers": [1]}}
    samples = [s[:n] for s, n in zip(_samples(), (24, 17, 20), strict=True)]
    calibration = prepare_calibration(samples, batch_size=2)  # padding in the first batch
    cfg = GPTQConfig(bits=4, group_size=128, activation=activation)
    reports = []
    for device in ("cpu", "cuda"):
        model = copy.deepcopy(_dense())
        with torch.no_grad():
            run = quantize_gptq_model(model, cfg, calibration, device=torch.device(device))
        reports.append(run)
        assert next(model.parameters()).device.type == "cpu"
    cpu, gpu = (dict(r.activation_scales) for r in reports)
    assert cpu.keys() == gpu.keys()
    # layer 0's q_proj reads the normed embeddings (one ulp apart at most); later operands pass
    # through solves, which round a few weights differently on each device
    assert gpu["model.layers.0.self_attn.q_proj"] == pytest.approx(
        cpu["model.layers.0.self_attn.q_proj"], rel=1e-5
    )
    assert gpu["model.layers.0.mlp.down_proj"] == pytest.approx(
        cpu["model.layers.0.mlp.down_proj"], rel=5e-2
    )
    assert gpu["model.layers.1.mlp.down_proj"] == cpu["model.layers.1.mlp.down_proj"] == 0.0
