"""Dynamic FP8 activations declared by a checkpoint are read, run on every route, shown and kept.

An llm-compressor ``FP8_DYNAMIC`` checkpoint (FP8 per-channel weights, E4M3 per-token dynamic
activations) is written here by compressed-tensors itself on a tiny random Llama; vLLM serves it
with ``x`` quantized per token, so floatxq's CPU route must multiply the same quantized ``x``.
"""

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import floatxq as fq
from floatxq.fp8 import fp8_token_qdq, fp8_token_quantize
from floatxq.fp8_activation import FP8InputQuant, input_qdq
from floatxq.interop.checkpoint import CheckpointError, write_checkpoint
from floatxq.interop.inspect import inspect_checkpoint
from floatxq.lifecycle.activation_summary import activation_summary
from floatxq.nn.fp8_linear import TorchFP8Linear
from floatxq.testing import assert_bitwise_equal

transformers = pytest.importorskip("transformers")
ct = pytest.importorskip("compressed_tensors")

BF16 = torch.bfloat16
LINEARS = 14  # 2 layers x (q, k, v, o, gate, up, down); lm_head is ignored


def _llama(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=128,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )
    return transformers.AutoModelForCausalLM.from_config(config, dtype=BF16).eval()


def _write_fp8_dynamic(path: Path, scheme_name: str = "FP8_DYNAMIC") -> Path:
    """The checkpoint compressed-tensors writes for the ``FP8_DYNAMIC`` preset: its own scheme,
    its own qparams (per-channel ``amax / 448``) and its own compressor."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (
        QuantizationConfig,
        apply_quantization_config,
        preset_name_to_scheme,
    )
    from compressed_tensors.quantization.utils import calculate_qparams

    model = _llama()
    scheme = preset_name_to_scheme(scheme_name, ["Linear"])
    config = QuantizationConfig(config_groups={"group_0": scheme}, ignore=["lm_head"])
    apply_quantization_config(model, config)
    with torch.no_grad():
        for module in model.modules():
            if hasattr(module, "weight_scale"):
                w = module.weight.float()
                lo, hi = w.amin(dim=1, keepdim=True), w.amax(dim=1, keepdim=True)
                scale, _ = calculate_qparams(lo, hi, module.quantization_scheme.weights)
                module.weight_scale.data.copy_(scale.reshape(module.weight_scale.shape))
    compressor = ModelCompressor.from_pretrained_model(model, quantization_format=None)
    compressor.compress_model(model)
    path.mkdir(parents=True)
    (path / "config.json").write_text("{}")
    compressor.update_config(str(path))
    qconfig = json.loads((path / "config.json").read_text())["quantization_config"]
    payload = {**model.config.to_dict(), "quantization_config": qconfig}
    return write_checkpoint(path, dict(model.state_dict()), config=payload, overwrite=True)


@pytest.fixture(scope="module")
def fp8_dynamic(tmp_path_factory) -> Path:
    return _write_fp8_dynamic(tmp_path_factory.mktemp("ct") / "fp8-dynamic")


def _fp8_modules(model: nn.Module) -> dict[str, TorchFP8Linear]:
    return {n: m for n, m in model.named_modules() if isinstance(m, TorchFP8Linear)}


def _reference(x: torch.Tensor, module: TorchFP8Linear) -> torch.Tensor:
    """What vLLM's W8A8 GEMM computes, in float64: ``Σ_k e4m3(x/sx)·sx · code_w / scale_inv``
    (x quantized per token by :func:`floatxq.fp8_token_quantize`)."""
    tokens = fp8_token_quantize(x)
    xq = tokens.codes.double() * tokens.scale.double()
    w = module.weight.double() / module.weight_scale_inv.double().reshape(-1, 1)
    return xq @ w.T


# ----------------------------------------------------------------------------------------------
# Load: the declared scheme reaches the modules
# ----------------------------------------------------------------------------------------------


def test_fp8_dynamic_loads_with_per_token_activations(fp8_dynamic):
    qconfig = json.loads((fp8_dynamic / "config.json").read_text())["quantization_config"]
    declared = qconfig["config_groups"]["group_0"]["input_activations"]
    assert (declared["strategy"], declared["dynamic"], declared["type"]) == ("token", True, "float")
    model = fq.load(fp8_dynamic, dtype=torch.float32).model
    modules = _fp8_modules(model)
    assert len(modules) == LINEARS
    for name, module in modules.items():
        assert module.input_quant == FP8InputQuant("token"), name
        assert module.weight_scale_method == "row"
        assert "input_quant=token" in repr(module)
    assert (
        activation_summary(model) == f"FP8 per-token activations on {LINEARS} of {LINEARS} "
        "quantized linears"
    )


@pytest.mark.parametrize("dtype", [torch.float32, BF16], ids=["fp32", "bf16"])
def test_cpu_route_multiplies_per_token_quantized_activations(fp8_dynamic, dtype):
    model = fq.load(fp8_dynamic, dtype=dtype).model
    x = torch.randn(3, 5, 128, generator=torch.Generator().manual_seed(1)).to(dtype) * 3
    for name, module in _fp8_modules(model).items():
        xin = x if module.in_features == 128 else torch.randn(7, 256).to(dtype)
        with torch.no_grad():
            got = module(xin)
        assert module.last_route == "dequant_matmul"
        assert "quantize-dequantized fp8 e4m3 dynamic per token" in module.last_fallback_reason
        assert module.last_activations.startswith("fp8 e4m3 dynamic per token")
        # bit for bit: the per-token E4M3 quantize-dequantize of x times the decoded weight
        want = F.linear(fp8_token_qdq(xin), module.dequantize_weight(dtype=dtype))
        assert_bitwise_equal(got, want, msg=name)
        if dtype is torch.float32:  # and the W8A8 GEMM's value, within FP32 summation error
            flat = xin.reshape(-1, module.in_features)
            exact = _reference(flat, module)
            tokens = fp8_token_quantize(flat)
            terms = (tokens.codes.double().abs() * tokens.scale.double()) @ (
                module.weight.double().abs() / module.weight_scale_inv.double()[:, None]
            ).T
            bound = 2 * module.in_features * 2**-24 * terms + 2**-126
            err = (got.reshape(exact.shape).double() - exact).abs()
            assert bool((err <= bound).all()), (name, float((err / bound).max()))


def test_the_setting_changes_the_output_and_weight_only_is_unchanged(fp8_dynamic):
    model = fq.load(fp8_dynamic, dtype=torch.float32).model
    module = next(iter(_fp8_modules(model).values()))
    x = torch.randn(4, 128, generator=torch.Generator().manual_seed(2))
    quantized = module(x)
    module.input_quant = None  # the module without the setting: weight-only, as before
    weight_only = module(x)
    assert_bitwise_equal(weight_only, F.linear(x, module.dequantize_weight()))
    assert module.last_activations.startswith("none")
    assert not torch.equal(quantized, weight_only)
    assert activation_summary(model).endswith("weight-only on 1")
    plain = TorchFP8Linear.from_linear(nn.Linear(64, 32))
    y = torch.randn(3, 64)
    assert_bitwise_equal(plain(y), F.linear(y, plain.dequantize_weight(), plain.bias.float()))
    assert plain.input_quant is None and "input_quant" not in repr(plain)
    assert activation_summary(nn.Sequential(plain)) == "weight-only (1 quantized linear)"
    assert activation_summary(nn.Linear(2, 2)) == "no quantized linears"


@pytest.mark.parametrize(
    ("method", "block", "quant"),
    [
        ("block", [128, 128], "group:128"),
        ("row", None, "group:64"),
        ("tensor", None, "tensor"),
        ("tensor", None, "token"),
    ],
)
def test_every_strategy_on_the_cpu_routes(method, block, quant):
    torch.manual_seed(3)
    layer = TorchFP8Linear.from_linear(
        nn.Linear(256, 128), weight_scale_method=method, weight_block_size=block, input_quant=quant
    )
    x = torch.randn(2, 3, 256, dtype=BF16)
    setting = layer.input_quant
    want = F.linear(input_qdq(x, setting), layer.dequantize_weight(dtype=BF16), layer.bias.to(BF16))
    assert_bitwise_equal(layer(x), want)
    rows = x.reshape(-1, 256)
    if setting.strategy == "group":  # each group of columns, as fp8_token_qdq over that slice
        size = setting.group_size
        for g in range(256 // size):
            part = rows[:, g * size : (g + 1) * size]
            assert_bitwise_equal(
                input_qdq(rows, setting)[:, g * size : (g + 1) * size], fp8_token_qdq(part)
            )
    if setting.strategy == "tensor":
        assert_bitwise_equal(
            input_qdq(rows, setting), fp8_token_qdq(rows.reshape(1, -1)).reshape(rows.shape)
        )


def test_route_policy_takes_the_recipe_that_quantizes_x_as_declared():
    from floatxq.dispatch import FP8RouteFacts, fp8_scaled_route, select_fp8_route

    assert fp8_scaled_route("row") == ("scaled_mm_rowwise", None)
    assert fp8_scaled_route("tensor", None, "token") == ("scaled_mm_rowwise", None)
    assert fp8_scaled_route("block", (128, 128), "group", 128) == ("scaled_mm_blockwise", None)
    route, why = fp8_scaled_route("block", (128, 128), "token")
    assert route is None and "per-token" in why
    facts = dict(
        device_type="cuda", capability=(9, 0), x_dtype=BF16, rows=64, in_features=256,
        out_features=256, format="float8_e4m3fn", scale_method="tensor",
    )  # fmt: skip
    assert select_fp8_route(FP8RouteFacts(**facts)).route == "scaled_mm_tensorwise"
    assert select_fp8_route(FP8RouteFacts(**facts, input_quant="token")).route == (
        "scaled_mm_rowwise"
    )
    blocks = {**facts, "scale_method": "block", "block_size": (128, 128)}
    choice = select_fp8_route(FP8RouteFacts(**blocks, input_quant="token"))
    assert choice.route == "dequant_matmul" and "per-token" in choice.reason
    with pytest.raises(ValueError, match="input_group_size"):
        FP8RouteFacts(**facts, input_quant="group")


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="multiple of its group size"):
        TorchFP8Linear(100, 8, input_quant="group:64")
    with pytest.raises(ValueError, match="input_quant must be"):
        TorchFP8Linear(64, 8, input_quant="channel")
    with pytest.raises(TypeError):
        FP8InputQuant("group", None)


# ----------------------------------------------------------------------------------------------
# inspect, save and the real readers
# ----------------------------------------------------------------------------------------------


def test_inspect_shows_the_declared_scheme(fp8_dynamic, tmp_path):
    report = inspect_checkpoint(fp8_dynamic)
    assert report.activations == "fp8 e4m3 dynamic per token"
    weight_only = fq.load(_llama(), quantize_config=fq.FP8Config()).quantize(progress=False)
    out = weight_only.save(tmp_path / "w8a16")
    assert inspect_checkpoint(out).activations == "none (weight-only)"
    from typer.testing import CliRunner

    from floatxq.cli import app

    result = CliRunner().invoke(app, ["inspect", str(fp8_dynamic)])
    assert result.exit_code == 0, result.output
    assert "activations: fp8 e4m3 dynamic per token" in result.output


@pytest.mark.parametrize(
    ("field", "value", "match"),
    [
        ("dynamic", False, "static activation"),
        ("num_bits", 4, "8-bit float"),
        ("strategy", "channel", "per token"),
    ],
)
def test_load_and_inspect_refuse_schemes_floatxq_does_not_run(
    fp8_dynamic, tmp_path, field, value, match
):
    import shutil

    path = tmp_path / "edited"
    shutil.copytree(fp8_dynamic, path)
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"]["config_groups"]["group_0"]["input_activations"][field] = value
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=match):
        inspect_checkpoint(path)
    with pytest.raises(CheckpointError, match=match):
        fq.load(path)


def test_save_and_load_keep_the_activations(fp8_dynamic, tmp_path):
    from compressed_tensors.quantization import QuantizationConfig

    source = fq.load(fp8_dynamic, dtype=torch.float32)
    out = source.save(tmp_path / "again")
    ours = json.loads((out / "config.json").read_text())["quantization_config"]
    theirs = json.loads((fp8_dynamic / "config.json").read_text())["quantization_config"]
    mine, written = (
        QuantizationConfig.model_validate(q).config_groups["group_0"].input_activations
        for q in (ours, theirs)
    )  # compressed-tensors' own parse of both payloads: the same activation arguments
    assert mine == written
    assert inspect_checkpoint(out).activations == "fp8 e4m3 dynamic per token"
    again = fq.load(out, dtype=torch.float32)
    ids = torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        assert_bitwise_equal(again.model(ids).logits, source.model(ids).logits)
    for name, module in _fp8_modules(again.model).items():
        assert module.input_quant == FP8InputQuant("token"), name
    with pytest.raises(ValueError, match="cannot hold module .*per token.*compressed-tensors"):
        source.save(tmp_path / "gptqmodel", layout="gptqmodel")


def test_transformers_reads_floatxq_save_as_fp8_dynamic(fp8_dynamic, tmp_path):
    """transformers + compressed-tensors load floatxq's save with the same per-token scheme, and
    their decoded weights times floatxq's per-token activations give floatxq's outputs."""
    import warnings

    out = fq.load(fp8_dynamic, dtype=BF16).save(tmp_path / "for-transformers")
    ours = fq.load(out, dtype=BF16).model
    config = transformers.CompressedTensorsConfig.from_dict(
        json.loads((out / "config.json").read_text())["quantization_config"]
    )  # transformers' parse of floatxq's payload: compressed-tensors' QuantizationConfig
    scheme = config.quantization_config.config_groups["group_0"].input_activations
    assert (scheme.strategy, scheme.dynamic, scheme.num_bits, scheme.type) == (
        "token",
        True,
        8,
        "float",
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        theirs = transformers.AutoModelForCausalLM.from_pretrained(
            out, quantization_config=transformers.CompressedTensorsConfig(dequantize=True)
        ).eval()
        with torch.no_grad():
            theirs(torch.zeros(1, 2, dtype=torch.long))  # compressed-tensors decompresses here
    x = torch.randn(5, 128, generator=torch.Generator().manual_seed(5)).to(BF16)
    checked = 0
    for name, module in _fp8_modules(ours).items():
        other = theirs.get_submodule(name)
        # their decode multiplies by fl(1/scale_inv) (docs/interop.md, "Reciprocals"): within
        # one bf16 rounding of ours
        mine = module.dequantize_weight(dtype=torch.float32)
        assert bool(((other.weight.float() - mine).abs() <= mine.abs() * 2**-8).all()), name
        if module.in_features == 128:  # their decoded weight times per-token x: ours
            with torch.no_grad():
                want = F.linear(fp8_token_qdq(x).float(), other.weight.float())
                got = module(x).float()
            assert float((got - want).norm() / want.norm()) < 1e-2, name
        checked += 1
    assert checked == LINEARS


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("method", "block", "quant", "route"),
    [
        ("row", None, "token", "scaled_mm_rowwise"),
        ("tensor", None, "token", "scaled_mm_rowwise"),
        ("block", [128, 128], "group:128", "scaled_mm_blockwise"),
        ("tensor", None, "tensor", "scaled_mm_tensorwise"),
    ],
)
def test_cuda_gemm_routes_multiply_the_declared_quantized_activations(method, block, quant, route):
    """On CUDA the declared scheme picks the cuBLAS recipe that quantizes ``x`` the same way:
    the output is the per-token (group, tensor) W8A8 product, far closer to it than to the
    weight-only product."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("the FP8 scaled_mm recipes need SM 9.0+ here")
    torch.manual_seed(5)
    layer = TorchFP8Linear.from_linear(
        nn.Linear(512, 256), weight_scale_method=method, weight_block_size=block, input_quant=quant
    ).to("cuda")
    x = (torch.randn(64, 512) * torch.exp2(torch.randint(-3, 4, (64, 1)))).to(BF16).cuda()
    out = layer(x).double()
    assert layer.last_route == route, (layer.last_route, layer.last_reason)
    weight = layer.dequantize_weight(dtype=torch.float32).double()
    bias = layer.bias.double()
    w8a8 = F.linear(input_qdq(x.float(), layer.input_quant).double(), weight, bias)
    weight_only = F.linear(x.double(), weight, bias)
    to_w8a8 = float((out - w8a8).norm() / w8a8.norm())
    to_weight_only = float((out - weight_only).norm() / w8a8.norm())
    assert to_w8a8 < 0.25 * to_weight_only, (to_w8a8, to_weight_only)
    assert to_w8a8 < 1e-2, to_w8a8
