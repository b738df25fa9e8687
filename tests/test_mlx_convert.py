"""Whole-model conversion of transformers decoders (Llama, Mistral, Qwen2, Qwen3) with FP8
linears to their mlx_lm models."""

import numpy as np
import pytest
import torch
from torch import nn

mx = pytest.importorskip("mlx.core")
pytest.importorskip("mlx_lm")

import floatxq as fq  # noqa: E402
import floatxq.mlx as fqm  # noqa: E402
from floatxq.nn.fp4_linear import TorchFP4Linear  # noqa: E402
from floatxq.nn.fp8_linear import TorchFP8Linear  # noqa: E402
from floatxq.nn.gptq_linear import GPTQLinear  # noqa: E402
from floatxq.tiny import load_tiny_llama  # noqa: E402

IDS = [[1, 5, 9, 200, 33, 7, 0, 255], [4, 4, 4, 4, 90, 91, 92, 93]]
# The MLX and torch models run the same FP32 arithmetic in a different order (matmul blocking,
# MLX's fused RMSNorm, RoPE and attention kernels). One FP32 dot product of length K carries a
# worst-case relative error near K * 2**-24 (K <= 768 here: about 5e-5 of the magnitude sum),
# and such errors pass through the 8 layers; observed differences are about 1e-6 of the largest
# logit. A tolerance of 1e-4 of the largest |logit| (about 1.6e-3 on the tiny model) leaves a
# wide margin, while rounding the weights to FP8 moves the logits by about 0.36: a wrong byte,
# scale, route or tensor copy is orders of magnitude above it (checked below).
REL_TOL = 1e-4


def _torch_logits(model) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor(IDS)).logits.float().numpy()


def _mlx_logits(out: "fqm.MlxConversion") -> np.ndarray:
    return np.array(out.model(mx.array(IDS)).astype(mx.float32))


def _max_diff(model, out) -> tuple[float, float]:
    ref = _torch_logits(model)
    got = _mlx_logits(out)
    assert got.shape == ref.shape
    return float(np.abs(ref - got).max()), REL_TOL * float(np.abs(ref).max())


def _fp8(**config) -> "nn.Module":
    model = load_tiny_llama(dtype=torch.float32)
    return fq.load(model, quantize_config=fq.FP8Config(**config)).quantize().model


@pytest.fixture(scope="module")
def dense():
    return load_tiny_llama(dtype=torch.float32)


@pytest.fixture(scope="module")
def fp8_row():
    return _fp8()


@pytest.fixture(scope="module")
def fp8_block():
    return _fp8(weight_block_size=[128, 128])


def test_dense_conversion_matches_torch(dense) -> None:
    out = fqm.convert_to_mlx(dense)
    assert len(out.routes) == 8 * 7 + 1 and set(out.routes.values()) == {"dense"}
    assert out.reasons == {}
    diff, tol = _max_diff(dense, out)
    assert diff <= tol, (diff, tol)


def test_dense_tensors_copied_exactly_in_bfloat16() -> None:
    model = load_tiny_llama(dtype=torch.bfloat16)
    out = fqm.convert_to_mlx(model)
    pairs = [
        (model.model.embed_tokens.weight, out.model.model.embed_tokens.weight),
        (model.model.norm.weight, out.model.model.norm.weight),
        (model.lm_head.weight, out.model.lm_head.weight),
        (
            model.model.layers[3].mlp.down_proj.weight,
            out.model.model.layers[3].mlp.down_proj.weight,
        ),
        (
            model.model.layers[5].post_attention_layernorm.weight,
            out.model.model.layers[5].post_attention_layernorm.weight,
        ),
    ]
    for src, got in pairs:
        assert got.dtype == mx.bfloat16
        want = src.detach().view(torch.int16).numpy()
        assert np.array_equal(np.array(got.view(mx.int16)), want)


def test_fp8_row_scales_take_mxfp8_and_match_torch(fp8_row) -> None:
    out = fqm.convert_to_mlx(fp8_row)
    linears = [p for p in out.routes if p != "lm_head"]
    assert len(linears) == 56 and all(out.routes[p] == "mxfp8" for p in linears)
    assert out.routes["lm_head"] == "dense" and out.reasons == {}
    layer = out.model.model.layers[2].self_attn.k_proj
    assert isinstance(layer, fqm.MlxFP8Linear)
    src = fp8_row.model.layers[2].self_attn.k_proj
    assert np.array_equal(np.array(layer.scale_inv), src.weight_scale_inv.numpy())
    diff, tol = _max_diff(fp8_row, out)
    assert diff <= tol, (diff, tol)


def test_fp8_block_scales_take_packed_and_match_torch(fp8_block) -> None:
    out = fqm.convert_to_mlx(fp8_block)
    packed = [p for p, r in out.routes.items() if r == "packed"]
    assert len(packed) == 56 and set(out.reasons) == set(packed)
    assert all("block scales" in why for why in out.reasons.values())
    layer = out.model.model.layers[7].mlp.down_proj
    src = fp8_block.model.layers[7].mlp.down_proj
    assert isinstance(layer, fqm.MlxFP8PackedLinear)
    assert np.array_equal(np.array(layer.qweight), src.weight.view(torch.uint8).numpy())
    diff, tol = _max_diff(fp8_block, out)
    assert diff <= tol, (diff, tol)


def test_tolerance_separates_fp8_from_dense(dense, fp8_row) -> None:
    """The logit tolerance is far below the effect of FP8 weights, so the comparisons can fail."""
    out = fqm.convert_to_mlx(fp8_row)
    diff, tol = _max_diff(dense, out)
    assert diff > 100 * tol, (diff, tol)


def test_quantized_lm_head_unties_and_matches() -> None:
    model = _fp8(lm_head=True)
    out = fqm.convert_to_mlx(model)
    assert out.routes["lm_head"] == "mxfp8"
    assert isinstance(out.model.lm_head, fqm.MlxFP8Linear)
    diff, tol = _max_diff(model, out)
    assert diff <= tol, (diff, tol)


_CONFIGS = {
    "llama": "LlamaConfig",
    "mistral": "MistralConfig",
    "qwen2": "Qwen2Config",
    "qwen3": "Qwen3Config",
}


def _small(model_type: str, **overrides):
    """A seeded two-layer model of ``model_type`` with non-trivial norm weights and biases."""
    import transformers

    config = dict(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    if model_type == "mistral":
        config["sliding_window"] = None
    if model_type == "qwen3":
        config["head_dim"] = 32  # not hidden_size // heads, so the q/k/v shapes follow the config
    torch.manual_seed(0)
    cfg = getattr(transformers, _CONFIGS[model_type])(**{**config, **overrides})
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():  # norms start at one and biases at zero: make a dropped one show
        for name, param in model.named_parameters():
            if "norm" in name:
                param.uniform_(0.5, 1.5)
            elif name.endswith(".bias"):
                param.normal_()
    return model


def _small_llama(**overrides):
    return _small("llama", **overrides)


@pytest.mark.parametrize(
    "overrides",
    [
        {"tie_word_embeddings": True},
        {"attention_bias": True, "mlp_bias": True, "tie_word_embeddings": False},
        {
            "rope_parameters": {
                "rope_type": "llama3",
                "rope_theta": 50000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 4,
            }
        },
        {"rope_parameters": {"rope_type": "linear", "rope_theta": 20000.0, "factor": 2.0}},
    ],
    ids=["tied", "bias", "llama3-rope", "linear-rope"],
)
def test_config_variants_match_torch(overrides) -> None:
    model = _small_llama(**overrides)
    with torch.no_grad():
        for block in model.model.layers:  # non-trivial biases, so a dropped bias shows
            for linear in (block.self_attn.q_proj, block.mlp.down_proj):
                if linear.bias is not None:
                    linear.bias.normal_()
    model = fq.load(model, quantize_config=fq.FP8Config()).quantize().model
    out = fqm.convert_to_mlx(model)
    routes = set(out.routes.values())
    assert "mxfp8" in routes
    assert ("lm_head" in out.routes) == (not model.config.tie_word_embeddings)
    diff, tol = _max_diff(model, out)
    assert diff <= tol, (diff, tol)


@pytest.mark.parametrize("model_type", sorted(_CONFIGS))
@pytest.mark.parametrize("scales", ["row", "block"])
@pytest.mark.parametrize("tie", [True, False], ids=["tied", "untied"])
def test_architectures_match_torch(model_type, scales, tie) -> None:
    model = _small(model_type, tie_word_embeddings=tie)
    dense_logits = _torch_logits(model)
    block = {"weight_block_size": [32, 32]} if scales == "block" else {}
    model = fq.load(model, quantize_config=fq.FP8Config(**block)).quantize().model
    out = fqm.convert_to_mlx(model)
    mlx_module = {"mistral": "llama"}.get(model_type, model_type)
    assert type(out.model).__module__ == f"mlx_lm.models.{mlx_module}"
    route = "mxfp8" if scales == "row" else "packed"
    linears = [p for p in out.routes if p != "lm_head"]
    assert len(linears) == 2 * 7 and all(out.routes[p] == route for p in linears)
    assert set(out.reasons) == ({p for p in linears} if route == "packed" else set())
    assert out.routes.get("lm_head") == (None if tie else "dense")
    layer = out.model.model.layers[1].self_attn.k_proj
    src = model.model.layers[1].self_attn.k_proj
    assert isinstance(layer, fqm.MlxFP8Linear if route == "mxfp8" else fqm.MlxFP8PackedLinear)
    if model_type == "qwen2":  # q/k/v carry biases, copied exactly
        assert np.array_equal(np.array(layer.bias), src.bias.detach().numpy())
    if model_type == "qwen3":
        q_norm = out.model.model.layers[0].self_attn.q_norm.weight
        want = model.model.layers[0].self_attn.q_norm.weight.detach().numpy()
        assert np.array_equal(np.array(q_norm), want)
    diff, tol = _max_diff(model, out)
    assert diff <= tol, (diff, tol)
    # FP8 weights move the logits far beyond the tolerance, so the comparison above can fail.
    assert np.abs(dense_logits - _mlx_logits(out)).max() > 100 * tol


def test_quantized_head_of_tied_qwen3_unties_and_matches() -> None:
    model = _small("qwen3", tie_word_embeddings=True)
    model = fq.load(model, quantize_config=fq.FP8Config(lm_head=True)).quantize().model
    out = fqm.convert_to_mlx(model)
    assert out.routes["lm_head"] == "mxfp8" and not out.model.args.tie_word_embeddings
    diff, tol = _max_diff(model, out)
    assert diff <= tol, (diff, tol)


def test_mistral_window_covering_every_position_is_accepted() -> None:
    model = _small("mistral", sliding_window=64)  # = max_position_embeddings: never bites
    out = fqm.convert_to_mlx(model)
    diff, tol = _max_diff(model, out)
    assert diff <= tol, (diff, tol)


def test_refuses_other_architectures() -> None:
    from transformers import Phi3Config, Phi3ForCausalLM

    config = Phi3Config(
        vocab_size=32,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        pad_token_id=0,
    )
    with pytest.raises(
        ValueError, match="model_type is 'phi3'; accepted: llama, mistral, qwen2, qwen3"
    ):
        fqm.convert_to_mlx(Phi3ForCausalLM(config))
    with pytest.raises(ValueError, match="ForCausalLM model, got Linear"):
        fqm.convert_to_mlx(nn.Linear(4, 4))
    with pytest.raises(ValueError, match="ForCausalLM model, got LlamaModel"):
        fqm.convert_to_mlx(_small_llama().model)


def test_refuses_sliding_window_attention() -> None:
    with pytest.raises(ValueError, match="sliding_window is 8 .below max_position_embeddings 64"):
        fqm.convert_to_mlx(_small("mistral", sliding_window=8))
    model = _small("qwen2", use_sliding_window=True, sliding_window=8, max_window_layers=1)
    with pytest.raises(ValueError, match=r"layer_types has \['sliding_attention'\]"):
        fqm.convert_to_mlx(model)


def test_refuses_untied_head_under_tied_config_and_missing_norms() -> None:
    model = _small("qwen2", tie_word_embeddings=True)
    model.lm_head.weight = nn.Parameter(model.lm_head.weight.detach() + 1.0)
    with pytest.raises(ValueError, match="lm_head.weight differs from the input embeddings"):
        fqm.convert_to_mlx(model)
    model = _small("qwen3")
    model.model.layers[1].self_attn.k_norm = nn.Identity()
    with pytest.raises(ValueError, match=r"missing \['model\.layers\.1\.self_attn\.k_norm"):
        fqm.convert_to_mlx(model)


def test_refuses_quantized_or_fp8_modules_outside_the_linears() -> None:
    model = _small("qwen3")
    model.model.layers[0].extra = GPTQLinear(64, 64, bits=4, group_size=32, bias=False)
    with pytest.raises(ValueError, match=r"model\.layers\.0\.extra' \(GPTQLinear\) holds buffers"):
        fqm.convert_to_mlx(model)
    model = _small("qwen3")
    model.model.layers[0].extra = TorchFP8Linear.from_linear(nn.Linear(64, 64, bias=False))
    with pytest.raises(ValueError, match=r"extra is an FP8 linear but mlx_lm's qwen3 model"):
        fqm.convert_to_mlx(model)
    model = _small("qwen2")
    model.model.layers[0].self_attn.k_proj = TorchFP8Linear.from_linear(
        nn.Linear(64, 32, bias=False)
    )
    with pytest.raises(ValueError, match=r"k_proj bias presence \(False\) differs"):
        fqm.convert_to_mlx(model)


@pytest.mark.parametrize(
    "make",
    [
        lambda: GPTQLinear(64, 64, bits=4, group_size=32, bias=False),
        lambda: TorchFP4Linear.from_linear(nn.Linear(64, 64, bias=False)),
    ],
    ids=["gptq", "nvfp4"],
)
def test_refuses_unknown_linear_modules(make) -> None:
    model = _small_llama()
    model.model.layers[1].self_attn.q_proj = make()
    name = type(model.model.layers[1].self_attn.q_proj).__name__
    with pytest.raises(ValueError, match=rf"model\.layers\.1\.self_attn\.q_proj is a {name}"):
        fqm.convert_to_mlx(model)


def test_refuses_shape_mismatches() -> None:
    model = _small_llama()
    model.model.layers[0].mlp.up_proj = nn.Linear(64, 32, bias=False)
    with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp\.up_proj\.weight has shape"):
        fqm.convert_to_mlx(model)
    model = _small_llama()
    model.model.layers[0].mlp.up_proj = TorchFP8Linear.from_linear(nn.Linear(64, 32, bias=False))
    with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp\.up_proj is \(32, 64\)"):
        fqm.convert_to_mlx(model)
    model = _small_llama()
    with torch.no_grad():
        model.model.norm.weight = nn.Parameter(torch.ones(32))
    with pytest.raises(ValueError, match=r"model\.norm\.weight has shape \(32,\)"):
        fqm.convert_to_mlx(model)


def test_refuses_extra_parameters_and_unknown_rope() -> None:
    model = _small_llama()
    model.model.layers[0].extra = nn.LayerNorm(64)
    with pytest.raises(ValueError, match=r"model\.layers\.0\.extra.*LayerNorm"):
        fqm.convert_to_mlx(model)
    model = _small_llama()
    model.config.rope_parameters = {"rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0}
    with pytest.raises(ValueError, match="rope type 'yarn'"):
        fqm.convert_to_mlx(model)


def test_refuses_fp8_linear_with_bias_the_config_lacks() -> None:
    model = _small_llama()
    model.model.layers[0].self_attn.o_proj = TorchFP8Linear.from_linear(nn.Linear(64, 64))
    with pytest.raises(ValueError, match=r"o_proj bias presence"):
        fqm.convert_to_mlx(model)


def test_refuses_other_activation_and_mixed_dtypes() -> None:
    model = _small_llama(hidden_act="gelu")
    with pytest.raises(ValueError, match="hidden_act is 'gelu'; mlx_lm's llama model uses 'silu'"):
        fqm.convert_to_mlx(model)
    with pytest.raises(ValueError, match="hidden_act is 'gelu_pytorch_tanh'; mlx_lm's qwen3"):
        fqm.convert_to_mlx(_small("qwen3", hidden_act="gelu_pytorch_tanh"))
    model = _small_llama()
    model.model.layers[1].mlp.gate_proj.to(torch.bfloat16)
    with pytest.raises(
        ValueError, match=r"model\.layers\.1\.mlp\.gate_proj\.weight is torch\.bfloat16"
    ):
        fqm.convert_to_mlx(model)


def test_saved_bf16_checkpoint_converts(tmp_path) -> None:
    """An FP8 checkpoint saved and loaded back (bfloat16 dense tensors) converts and runs."""
    model = load_tiny_llama(dtype=torch.bfloat16)
    config = fq.FP8Config(weight_block_size=[128, 128])
    fq.load(model, quantize_config=config).quantize().save(tmp_path / "ckpt")
    loaded = fq.load(tmp_path / "ckpt").model
    out = fqm.convert_to_mlx(loaded)
    assert set(out.routes.values()) == {"packed", "dense"}
    assert out.model.model.embed_tokens.weight.dtype == mx.bfloat16
    want = loaded.model.embed_tokens.weight.detach().view(torch.int16).numpy()
    assert np.array_equal(np.array(out.model.model.embed_tokens.weight.view(mx.int16)), want)
    # Both sides round activations to bfloat16 after every op, in different places; the
    # observed gap is one bfloat16 step of the largest logit (0.125 at 16.6). Two steps bound it.
    ref = _torch_logits(loaded)
    got = _mlx_logits(out)
    assert got.shape == ref.shape and np.isfinite(got).all()
    assert np.abs(ref - got).max() <= 2.0**-6 * np.abs(ref).max()
