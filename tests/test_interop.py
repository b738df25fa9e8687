"""Checkpoints other tools write, read by floatxq.load; decided from metadata, checked by logits.

Every fixture is decoded here by an oracle written from the producer's documented convention (not
floatxq's readers); the model floatxq.load builds must give the logits of a dense model holding
those decoded weights. Producer fixtures in tests/fixtures/ were written by the producers' own
libraries (tests/fixtures/make_producer_fixtures.py, make_gptqmodel_fixtures.py). Where a checkpoint
declares dynamic FP8 activations, the dense model quantize-dequantizes those projections' inputs as
declared (what vLLM and transformers serve from the file), so the logits still match tightly.
"""

import contextlib
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

import floatxq
from floatxq.fp8_activation import FP8InputQuant, input_qdq
from floatxq.lifecycle import CheckpointError, inspect_checkpoint
from floatxq.nn import TorchFP4Linear, TorchFP8Linear

FIXTURES = Path(__file__).parent / "fixtures"
E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
IDS = torch.tensor([[1, 5, 9, 33, 77, 100, 2, 64]])


# ----------------------------------------------------------------------------------------------
# Oracles: each producer's decode, written from its documented convention
# ----------------------------------------------------------------------------------------------


def _e2m1(codes: torch.Tensor) -> torch.Tensor:
    magnitude = E2M1[(codes & 7).long()]
    return torch.where((codes & 8) != 0, -magnitude, magnitude)


def _unpack(packed: torch.Tensor, *, high_first: bool = False) -> torch.Tensor:
    low, high = packed & 0x0F, packed >> 4
    first, second = (high, low) if high_first else (low, high)
    return torch.stack([_e2m1(first), _e2m1(second)], dim=-1).flatten(-2)


def _grid(scale: torch.Tensor, rows: int, cols: int, block=None) -> torch.Tensor:
    """Expand a [ceil(N/br), ceil(K/bc)] grid over an (N, K) weight (ragged edges trimmed)."""
    if scale.numel() == 1:
        return scale.reshape(1, 1).expand(rows, cols)
    if scale.shape[0] == rows and (scale.ndim == 1 or scale.shape[1] == 1):
        return scale.reshape(rows, 1).expand(rows, cols)
    br, bc = block if block is not None else (rows // scale.shape[0], cols // scale.shape[1])
    assert scale.shape == (-(-rows // br), -(-cols // bc)), (scale.shape, rows, cols, block)
    return scale.repeat_interleave(br, 0)[:rows].repeat_interleave(bc, 1)[:, :cols]


def _unswizzle(flat: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """cuBLAS 128x4 block-scale layout back to [rows, cols]: 128-row, 4-column tiles, each
    stored as [32][4][4] with index (r % 32, (r // 32) % 4, c % 4)."""
    pr, pc = -(-rows // 128) * 128, -(-cols // 4) * 4
    tiles = flat.reshape(pr // 128, pc // 4, 32, 4, 4)
    return tiles.permute(0, 3, 2, 1, 4).reshape(pr, pc)[:rows, :cols]


def _decode(
    kind: str, tensors: dict[str, torch.Tensor], shape: tuple[int, int], block=None
) -> torch.Tensor:
    rows, cols = shape
    f32 = lambda t: t.float()
    if kind == "inverse":  # floatxq / GPT-QModel
        return f32(tensors["weight"]) / _grid(f32(tensors["weight_scale_inv"]), rows, cols)
    if kind == "multiply_inv":  # transformers / DeepSeek
        return f32(tensors["weight"]) * _grid(f32(tensors["weight_scale_inv"]), rows, cols, block)
    if kind == "multiply":  # compressed-tensors / ModelOpt / Quark FP8
        return f32(tensors["weight"]) * _grid(f32(tensors["weight_scale"]), rows, cols, block)
    if kind == "ct_nvfp4":
        scale = f32(tensors["weight_scale"]).repeat_interleave(16, 1)
        return _unpack(tensors["weight_packed"]) * (scale / f32(tensors["weight_global_scale"]))
    if kind == "modelopt_nvfp4":
        scale = f32(tensors["weight_scale"]).repeat_interleave(16, 1)
        return _unpack(tensors["weight"]) * scale * f32(tensors["weight_scale_2"])
    if kind == "torchao_nvfp4":
        scale = tensors["_weight_scale"]
        if scale.numel() != rows * cols // 16 or scale.shape != (rows, cols // 16):
            scale = _unswizzle(scale.reshape(-1), rows, cols // 16)
        scale = f32(scale).repeat_interleave(16, 1)
        return _unpack(tensors["_weight_qdata"]) * scale * f32(tensors["_weight_per_tensor_scale"])
    if kind == "comfy_nvfp4":
        scale = _unswizzle(tensors["weight_scale"].reshape(-1), rows, cols // 16)
        scale = f32(scale).repeat_interleave(16, 1)
        values = _unpack(tensors["weight"], high_first=True)
        return values * scale * f32(tensors["weight_scale_2"])
    if kind in ("mxfp4", "mxfp8"):
        exponent = torch.exp2(tensors["weight_scale"].view(torch.uint8).float() - 127)
        codes = _unpack(tensors["weight_packed"]) if kind == "mxfp4" else f32(tensors["weight"])
        return codes * exponent.repeat_interleave(32, 1)
    raise AssertionError(kind)


@contextlib.contextmanager
def _quantized_inputs(model: torch.nn.Module, declared: dict[str, FP8InputQuant]):
    """While open, each named weight-only linear of ``model`` multiplies its input
    quantize-dequantized through E4M3 as ``declared`` says (the activations a W8A8 engine uses)."""
    handles = []
    for name, quant in declared.items():
        module = model.get_submodule(name)
        assert isinstance(module, (torch.nn.Linear, TorchFP8Linear)), (name, type(module))
        assert getattr(module, "input_quant", None) is None, name  # not quantized twice
        handles.append(
            module.register_forward_pre_hook(
                lambda _module, args, quant=quant: (input_qdq(args[0], quant), *args[1:])
            )
        )
    try:
        yield model
    finally:
        for handle in handles:
            handle.remove()


def _declared_activations(
    model: torch.nn.Module, expected: FP8InputQuant | None
) -> dict[str, FP8InputQuant]:
    """The loaded model's FP8 modules that quantize their activations, each checked to hold
    ``expected`` (None: every FP8 module is weight-only)."""
    fp8 = {n: m for n, m in model.named_modules() if isinstance(m, TorchFP8Linear)}
    for name, module in fp8.items():
        assert module.input_quant == expected, (name, module.input_quant, expected)
    return {n: m.input_quant for n, m in fp8.items() if m.input_quant is not None}


def _dense_logits(
    path: Path, kind: str, activations: dict[str, FP8InputQuant] | None = None
) -> torch.Tensor:
    """Logits of an FP32 dense model holding the oracle's decode of every quantized linear, the
    inputs of those named in ``activations`` quantize-dequantized as given there."""
    from transformers import AutoConfig, AutoModelForCausalLM

    payload = json.loads((path / "config.json").read_text())
    qconfig = payload.pop("quantization_config", None) or {}
    block = qconfig.get("weight_block_size")
    for group in (qconfig.get("config_groups") or {}).values():
        block = block or (group.get("weights") or {}).get("block_structure")
    config = AutoConfig.for_model(payload.pop("model_type"), **payload)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    state = load_file(str(path / "model.safetensors"))
    linears = {n: m for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    dense: dict[str, torch.Tensor] = {}
    for name, module in linears.items():
        tensors = {k[len(name) + 1 :]: v for k, v in state.items() if k.startswith(f"{name}.")}
        plain = set(tensors) <= {"weight", "bias"} and tensors["weight"].is_floating_point()
        if plain and tensors["weight"].element_size() > 1:
            dense[f"{name}.weight"] = tensors["weight"].float()
        else:
            shape = (module.out_features, module.in_features)
            dense[f"{name}.weight"] = _decode(kind, tensors, shape, block)
        for key in list(state):
            if key.startswith(f"{name}."):
                del state[key]
    dense.update({k: v.float() for k, v in state.items() if v.is_floating_point()})
    result = model.load_state_dict(dense, strict=False)
    assert not result.unexpected_keys and not result.missing_keys, result
    with torch.no_grad(), _quantized_inputs(model, activations or {}):
        return model(IDS).logits


def _floatxq_logits(path: Path) -> tuple[torch.Tensor, floatxq.QuantizedModel]:
    loaded = floatxq.load(path, dtype=torch.float32)
    with torch.no_grad():
        return loaded.model(IDS).logits, loaded


def _close(got: torch.Tensor, want: torch.Tensor, tol: float = 2e-5) -> None:
    err = float((got - want).abs().max() / want.abs().max())
    assert err < tol, f"relative max error {err:.3g} >= {tol}"


# ----------------------------------------------------------------------------------------------
# Real producers (files committed; written by the producers' own libraries)
# ----------------------------------------------------------------------------------------------

PRODUCERS = {
    # fixture: (layout, convention, family, oracle, module kind)
    "gptqmodel_fp8_row": ("gptqmodel", "floatxq_fp8", "fp8", "inverse", TorchFP8Linear),
    "gptqmodel_fp8_tensor": ("gptqmodel", "floatxq_fp8", "fp8", "inverse", TorchFP8Linear),
    "gptqmodel_fp8_block64": ("gptqmodel", "floatxq_fp8", "fp8", "inverse", TorchFP8Linear),
    "llmcompressor_fp8_dynamic": ("compressed-tensors", "direct_fp8", "fp8", "multiply", None),
    "llmcompressor_fp8_block": ("compressed-tensors", "direct_fp8", "fp8", "multiply", None),
    "llmcompressor_nvfp4a16": (
        "compressed-tensors",
        "compressed_tensors_nvfp4",
        "nvfp4",
        "ct_nvfp4",
        TorchFP4Linear,
    ),
    "llmcompressor_mxfp4a16": ("compressed-tensors", "mx_e8m0", "mxfp4", "mxfp4", torch.nn.Linear),
    "llmcompressor_mxfp8a16": ("compressed-tensors", "mx_e8m0", "mxfp8", "mxfp8", torch.nn.Linear),
    "torchao_nvfp4": ("torchao", "torchao_nvfp4", "nvfp4", "torchao_nvfp4", TorchFP4Linear),
    "torchao_nvfp4_swizzled": (
        "torchao",
        "torchao_nvfp4",
        "nvfp4",
        "torchao_nvfp4",
        TorchFP4Linear,
    ),
}
ACTIVATIONS = {
    # fixture: the dynamic FP8 activations its config declares (the others are weight-only)
    "llmcompressor_fp8_dynamic": FP8InputQuant("token"),  # FP8_DYNAMIC: per token
    "llmcompressor_fp8_block": FP8InputQuant("group", 128),  # FP8_BLOCK: per token and 1x128
}


@pytest.mark.parametrize("name", sorted(PRODUCERS))
def test_producer_checkpoint_is_detected_and_runs_its_dense_decode(name):
    layout, convention, family, oracle, kind = PRODUCERS[name]
    path = FIXTURES / name
    report = inspect_checkpoint(path)
    assert (report.layout, report.convention, report.family) == (layout, convention, family)
    assert len(report.quantized_layers) == 14  # 7 projections x 2 layers; lm_head stays dense
    got, loaded = _floatxq_logits(path)
    # ragged block grids decode to dense modules, which run weight-only: the reference too
    declared = _declared_activations(loaded.model, ACTIVATIONS.get(name))
    assert bool(declared) == (name in ACTIVATIONS)
    _close(got, _dense_logits(path, oracle, declared))
    assert loaded.layout.layout == layout
    projections = [m for n, m in loaded.model.named_modules() if n.endswith("_proj")]
    if kind is not None:
        assert all(type(m) is kind for m in projections)
    else:  # FP8: TorchFP8Linear, except ragged block grids, which are decoded to dense
        assert any(isinstance(m, TorchFP8Linear) for m in projections)


def test_ragged_fp8_block_grids_decode_to_dense_modules():
    loaded = floatxq.load(FIXTURES / "llmcompressor_fp8_block")
    layer = loaded.model.model.layers[0]
    # 192-wide MLP projections: a 128x128 grid has a ragged edge there
    assert type(layer.mlp.down_proj) is torch.nn.Linear
    assert type(layer.mlp.gate_proj) is torch.nn.Linear
    assert isinstance(layer.self_attn.q_proj, TorchFP8Linear)  # 128x128: exactly one block


# ----------------------------------------------------------------------------------------------
# Documented layouts of producers that do not install here (floatxq.testing.foreign)
# ----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def dense_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("tiny") / "dense"
    shutil.copytree(FIXTURES / "tiny_random_llama", out)  # the committed base model
    return out


def _weight_only_modelopt(path: Path) -> None:
    """Turn a ModelOpt export into its weight-only variant (no activation quantization)."""
    for name in ("config.json", "hf_quant_config.json"):
        file = path / name
        if not file.is_file():
            continue
        payload = json.loads(file.read_text())
        qconfig = payload.get("quantization_config", payload.get("quantization", payload))
        for group in (qconfig.get("config_groups") or {}).values():
            group["input_activations"] = None
        file.write_text(json.dumps(payload))


def _logits_match_writer(
    path: Path, dense: dict[str, torch.Tensor], activations: FP8InputQuant | None = None
) -> floatxq.QuantizedModel:
    """floatxq's logits against a dense model holding the writer's decode; ``activations``: the
    scheme the checkpoint declares, which every loaded FP8 module must hold and whose inputs the
    dense model quantize-dequantizes alike (modules decoded to dense run weight-only)."""
    from transformers import AutoModelForCausalLM

    got, loaded = _floatxq_logits(path)
    declared = _declared_activations(loaded.model, activations)
    payload = json.loads((path / "config.json").read_text())
    payload.pop("quantization_config", None)
    reference = AutoModelForCausalLM.from_config(
        loaded.model.config.__class__(**{k: v for k, v in payload.items() if k != "model_type"}),
        dtype=torch.float32,
    ).eval()
    state = {k: v.float() for k, v in load_file(str(path / "model.safetensors")).items()}
    for module, weight in dense.items():
        state[f"{module}.weight"] = weight.float()
    reference.load_state_dict(
        {k: v for k, v in state.items() if k in reference.state_dict()}, strict=True
    )
    with torch.no_grad(), _quantized_inputs(reference, declared):
        _close(got, reference(IDS).logits)
    return loaded


@pytest.mark.parametrize("sidecar", [True, False])
def test_modelopt_fp8_weight_only_loads_and_inconsistent_activations_are_refused(
    dense_dir, tmp_path, sidecar
):
    from floatxq.testing.foreign import write_modelopt_fp8

    full = write_modelopt_fp8(dense_dir, tmp_path / "w8a8", sidecar=sidecar)
    with pytest.raises(CheckpointError, match="input_scale is missing"):  # (W8A8 runs with one)
        floatxq.load(full.path)
    scales = write_modelopt_fp8(dense_dir, tmp_path / "scales", input_scale=True, sidecar=sidecar)
    _weight_only_modelopt(scales.path)
    with pytest.raises(CheckpointError, match="declares no input activations"):
        floatxq.load(scales.path)
    only = write_modelopt_fp8(dense_dir, tmp_path / "w8a16", sidecar=sidecar)
    _weight_only_modelopt(only.path)
    report = inspect_checkpoint(only.path)
    assert (report.layout, report.convention) == ("modelopt", "direct_fp8")
    loaded = _logits_match_writer(only.path, only.dense)
    assert isinstance(loaded.model.model.layers[1].mlp.up_proj, TorchFP8Linear)


def test_modelopt_nvfp4_weight_only_loads_as_fp4_linear(dense_dir, tmp_path):
    from floatxq.testing.foreign import write_modelopt_nvfp4

    full = write_modelopt_nvfp4(dense_dir, tmp_path / "w4a4")
    with pytest.raises(CheckpointError, match="activation"):
        floatxq.load(full.path)
    only = write_modelopt_nvfp4(dense_dir, tmp_path / "w4a16")
    _weight_only_modelopt(only.path)
    assert inspect_checkpoint(only.path).convention == "modelopt_nvfp4"
    loaded = _logits_match_writer(only.path, only.dense)
    assert isinstance(loaded.model.model.layers[0].self_attn.q_proj, TorchFP4Linear)


@pytest.mark.parametrize("ue8m0", [False, True])
def test_deepseek_fp8_multiplying_scale_inv_with_ragged_grids(dense_dir, tmp_path, ue8m0):
    from floatxq.testing.foreign import write_deepseek_fp8

    written = write_deepseek_fp8(dense_dir, tmp_path / "ds", ue8m0=ue8m0)
    report = inspect_checkpoint(written.path)
    assert (report.layout, report.convention) == ("hf", "deepseek_fp8")
    assert "block 128x128 (ragged edge)" in report.scale_layouts
    # activation_scheme "dynamic" with weight_block_size [128, 128]: per token and 1x128 group
    loaded = _logits_match_writer(written.path, written.dense, FP8InputQuant("group", 128))
    assert isinstance(loaded.model.model.layers[0].self_attn.o_proj, TorchFP8Linear)
    assert type(loaded.model.model.layers[0].mlp.up_proj) is torch.nn.Linear  # 192 rows: ragged


@pytest.mark.parametrize("per_channel", [False, True])
def test_quark_fp8(dense_dir, tmp_path, per_channel):
    from floatxq.testing.foreign import write_quark_fp8

    written = write_quark_fp8(dense_dir, tmp_path / "quark", per_channel=per_channel)
    report = inspect_checkpoint(written.path)
    assert (report.layout, report.convention, report.family) == ("quark", "direct_fp8", "fp8")
    loaded = _logits_match_writer(written.path, written.dense)
    module = loaded.model.model.layers[0].mlp.down_proj
    assert module.weight_scale_method == ("row" if per_channel else "tensor")


def test_comfy_nvfp4_high_nibble_first_and_swizzled(dense_dir, tmp_path):
    from floatxq.testing.foreign import write_comfy_nvfp4

    written = write_comfy_nvfp4(dense_dir, tmp_path / "comfy")
    report = inspect_checkpoint(written.path)
    assert (report.layout, report.convention) == ("comfy", "comfy_nvfp4")
    loaded = _logits_match_writer(written.path, written.dense)
    assert isinstance(loaded.model.model.layers[1].mlp.gate_proj, TorchFP4Linear)


def test_mimo_is_detected_and_load_explains_why_it_stops(dense_dir, tmp_path):
    from floatxq.testing.foreign import write_mimo_mixed

    written = write_mimo_mixed(dense_dir, tmp_path / "mimo")
    config = json.loads((written.path / "config.json").read_text())
    assert floatxq.native_floatx_source_format(config) == "mimo_mixed"
    report = inspect_checkpoint(written.path)
    assert (report.layout, report.convention) == ("mimo", "mimo_mixed")
    with pytest.raises((CheckpointError, ValueError)):
        floatxq.load(written.path)
    state = load_file(str(written.path / "model.safetensors"))
    name = "model.layers.0.mlp.experts.0.up_proj.weight"
    decoded = floatxq.decode_mimo_weight(config, name, state[name], state.get, dtype=torch.float32)
    assert torch.equal(decoded, written.dense["model.layers.0.mlp.experts.0.up_proj"].float())


# ----------------------------------------------------------------------------------------------
# Bad input: specific errors naming the file and tensor
# ----------------------------------------------------------------------------------------------


def _copy(name: str, tmp_path: Path) -> Path:
    out = tmp_path / name
    shutil.copytree(FIXTURES / name, out)
    return out


def _rewrite(path: Path, change) -> None:
    file = path / "model.safetensors"
    with safe_open(str(file), "pt") as reader:
        metadata = reader.metadata()
    state = load_file(str(file))
    change(state)
    save_file(state, str(file), metadata=metadata)


def test_missing_scale_tensor_is_named(tmp_path):
    path = _copy("llmcompressor_fp8_dynamic", tmp_path)
    _rewrite(path, lambda s: s.pop("model.layers.1.mlp.up_proj.weight_scale"))
    with pytest.raises(
        CheckpointError, match=r"model\.layers\.1\.mlp\.up_proj.*model\.safetensors"
    ):
        floatxq.load(path)


def test_wrong_scale_shape_is_named(tmp_path):
    path = _copy("gptqmodel_fp8_block64", tmp_path)
    name = "model.layers.0.self_attn.q_proj.weight_scale_inv"
    _rewrite(path, lambda s: s.__setitem__(name, torch.ones(3, 5)))
    with pytest.raises(CheckpointError, match=r"q_proj"):
        floatxq.load(path)


def test_unknown_quant_method_is_refused(tmp_path):
    path = _copy("llmcompressor_fp8_dynamic", tmp_path)
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"]["quant_method"] = "bitsandbytes"
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="bitsandbytes"):
        floatxq.load(path)
    with pytest.raises(CheckpointError, match="bitsandbytes"):
        inspect_checkpoint(path)


def test_contradictory_metadata_is_refused_by_load_and_inspect(tmp_path):
    path = _copy("gptqmodel_fp8_row", tmp_path)
    config = json.loads((path / "config.json").read_text())
    # config.json says transformers' fine-grained FP8; quantize_config.json says GPT-QModel's
    config["quantization_config"] = {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": None,
    }
    (path / "config.json").write_text(json.dumps(config))
    for call in (floatxq.load, inspect_checkpoint):
        with pytest.raises(CheckpointError, match="contradict"):
            call(path)


@pytest.mark.parametrize("bad", [0.0, float("nan"), float("inf")])
def test_bad_nvfp4_global_scale_is_named(tmp_path, bad):
    path = _copy("llmcompressor_nvfp4a16", tmp_path)
    name = "model.layers.0.mlp.down_proj.weight_global_scale"
    _rewrite(path, lambda s: s.__setitem__(name, torch.full_like(s[name], bad)))
    with pytest.raises(
        CheckpointError, match=r"down_proj.*weight_global_scale|weight_global_scale"
    ):
        floatxq.load(path)


def test_undeclared_fp8_tensors_are_refused(tmp_path):
    path = _copy("llmcompressor_fp8_dynamic", tmp_path)
    config = json.loads((path / "config.json").read_text())
    del config["quantization_config"]
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="undeclared"):
        floatxq.load(path)


@pytest.mark.parametrize(
    "name", ["gptqmodel_fp8_row", "gptqmodel_fp8_tensor", "gptqmodel_fp8_block64"]
)
def test_gptqmodel_checkpoints_give_gptqmodels_own_logits(name):
    # logits_fp32: GPT-QModel 7.7.0 running its own checkpoint in FP32
    expected = load_file(str(FIXTURES / name / "gptqmodel_logits.safetensors"))
    loaded = floatxq.load(FIXTURES / name, dtype=torch.float32)
    with torch.no_grad():
        got = loaded.model(expected["token_ids"]).logits
    _close(got, expected["logits_fp32"], tol=1e-5)


# ----------------------------------------------------------------------------------------------
# floatxq's own exports through transformers: the defect this work started from
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("layout", [None, "hf", "gptqmodel"])
def test_cli_export_of_the_tiny_llama_through_transformers(tmp_path, layout):
    from transformers import AutoModelForCausalLM
    from typer.testing import CliRunner

    from floatxq.cli import app

    out = tmp_path / "tiny-fp8"
    args = ["quantize", "tiny", "--out", str(out), "--block-size", "128", "128"]
    result = CliRunner().invoke(app, args + (["--layout", layout] if layout else []))
    assert result.exit_code == 0, result.output
    ids = torch.randint(0, 256, (2, 48), generator=torch.Generator().manual_seed(0))
    loaded = floatxq.load(out).model
    # the hf export declares activation_scheme "dynamic" (the one transformers' FP8 runs), so that
    # file reloads with x quantized per token and 1x128 group; the other layouts stay weight-only
    expected = FP8InputQuant("group", 128) if layout == "hf" else None
    declared = _declared_activations(loaded, expected)
    assert bool(declared) == (layout == "hf")
    with torch.no_grad():
        ours = loaded(ids).logits.float()
    if layout == "gptqmodel":  # transformers must refuse the inverse scales, not misread them
        with pytest.raises(ValueError, match="inverse scale"):
            AutoModelForCausalLM.from_pretrained(out)
        return
    kwargs = {}
    if layout == "hf":  # what transformers does on CPU by itself; with CUDA it wants `kernels`
        from transformers import FineGrainedFP8Config

        kwargs["quantization_config"] = FineGrainedFP8Config(dequantize=True)
    theirs_model = AutoModelForCausalLM.from_pretrained(out, **kwargs)
    # transformers' CPU dequantize runs its decoded weights weight-only; its CUDA FP8 kernels (and
    # vLLM) quantize x as the file declares, which the hooks do here
    with torch.no_grad(), _quantized_inputs(theirs_model, declared):
        theirs = theirs_model(ids).logits.float()
    # the defect: transformers read floatxq's inverse scales as multiplying ones (error 1.0)
    assert float((theirs - ours).norm() / ours.norm()) < 2e-2
    assert float((theirs.argmax(-1) == ours.argmax(-1)).float().mean()) > 0.97


# ----------------------------------------------------------------------------------------------
# Converting: read one tool's checkpoint, write another's
# ----------------------------------------------------------------------------------------------


def _assert_converted(source: floatxq.QuantizedModel, out: Path, layout: str, activations=None):
    """``out`` (``source`` saved as ``layout``) reloads in that layout with ``activations`` (the
    scheme its files declare; None: weight-only) on every FP8 module, gives ``source``'s logits
    with the inputs of those modules quantized alike, and carries the codes over byte for byte."""
    assert inspect_checkpoint(out).layout == layout
    converted = floatxq.load(out, dtype=torch.float32)
    declared = _declared_activations(converted.model, activations)
    with torch.no_grad(), _quantized_inputs(source.model, declared):
        _close(converted.model(IDS).logits, source.model(IDS).logits, tol=1e-5)
    before = dict(source.model.named_modules())
    for module_name, module in converted.model.named_modules():
        if isinstance(module, (TorchFP8Linear, TorchFP4Linear)):
            assert type(before[module_name]) is type(module), module_name
            assert torch.equal(  # codes are carried over byte for byte
                module.weight.view(torch.uint8), before[module_name].weight.view(torch.uint8)
            )


@pytest.mark.parametrize(
    ("name", "layout", "activations"),
    [
        ("gptqmodel_fp8_block64", "compressed-tensors", None),
        # floatxq's hf export declares activation_scheme "dynamic", per token without a block
        # size: a weight-only source reloads from it as transformers and vLLM serve the file
        ("gptqmodel_fp8_tensor", "hf", FP8InputQuant("token")),
        ("llmcompressor_nvfp4a16", "compressed-tensors", None),
        ("torchao_nvfp4_swizzled", "compressed-tensors", None),
    ],
)
def test_a_loaded_source_saves_in_another_layout(tmp_path, name, layout, activations):
    source = floatxq.load(FIXTURES / name, dtype=torch.float32)
    assert not _declared_activations(source.model, None)  # weight-only sources
    out = source.save(tmp_path / "converted", layout=layout)
    _assert_converted(source, out, layout, activations)


def test_a_source_with_quantized_activations_is_refused_by_a_layout_that_cannot_hold_them(
    tmp_path,
):
    source = floatxq.load(FIXTURES / "llmcompressor_fp8_dynamic", dtype=torch.float32)
    assert _declared_activations(source.model, FP8InputQuant("token"))
    # gptqmodel's files declare no activations: they would reload weight-only, so nothing is saved
    named = (
        r"layout 'gptqmodel' cannot hold module 'model\.layers\.0\.self_attn\.q_proj'.*per token"
    )
    with pytest.raises(ValueError, match=named):
        source.save(tmp_path / "converted", layout="gptqmodel")
    assert not (tmp_path / "converted").exists()
    assert list(tmp_path.iterdir()) == []  # no temporary directory left behind either
    # made weight-only (W8A16), the same compressed-tensors source converts to gptqmodel
    for module in source.model.modules():
        if isinstance(module, TorchFP8Linear):
            module.input_quant = None
    out = source.save(tmp_path / "converted", layout="gptqmodel")
    _assert_converted(source, out, "gptqmodel")


def test_modelopt_nvfp4_converts_to_compressed_tensors_that_transformers_reads(dense_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    from floatxq.testing.foreign import write_modelopt_nvfp4

    only = write_modelopt_nvfp4(dense_dir, tmp_path / "w4a16")
    _weight_only_modelopt(only.path)
    out = floatxq.load(only.path).save(tmp_path / "ct")
    qconfig = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qconfig["format"] == "nvfp4-pack-quantized"
    theirs = AutoModelForCausalLM.from_pretrained(out)  # bf16, as compressed-tensors runs it
    with torch.no_grad():
        got = theirs(IDS).logits.float()
    # the writer's dense decode of the ModelOpt files, run as a dense bf16 model
    from transformers import AutoConfig

    payload = json.loads((only.path / "config.json").read_text())
    payload.pop("quantization_config")
    reference = AutoModelForCausalLM.from_config(
        AutoConfig.for_model(payload.pop("model_type"), **payload), dtype=torch.bfloat16
    ).eval()
    state = load_file(str(dense_dir / "model.safetensors"))
    state.update({f"{m}.weight": w.bfloat16() for m, w in only.dense.items()})
    reference.load_state_dict(state)
    with torch.no_grad():
        # bf16 weights either way (compressed-tensors decodes e2m1 * block / fl(1/scale_2));
        # a misread nibble order or global-scale direction would move the logits by O(1)
        _close(got, reference(IDS).logits.float(), tol=1e-3)


# ----------------------------------------------------------------------------------------------
# On the GPU: the same checkpoints through floatxq's CUDA routes and transformers' FP8 kernels
# ----------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("name", sorted(PRODUCERS))
def test_producer_checkpoint_on_cuda_matches_cpu(name):
    path = FIXTURES / name
    ids = torch.randint(0, 128, (3, 40), generator=torch.Generator().manual_seed(0))
    cpu = floatxq.load(path)
    cuda = floatxq.load(path, device="cuda")
    on_cpu = dict(cpu.model.named_modules())
    for module_name, module in cuda.model.named_modules():
        if isinstance(module, (TorchFP8Linear, TorchFP4Linear)):  # the same decode, exactly
            want = on_cpu[module_name].dequantize_weight(dtype=torch.float32)
            got = module.dequantize_weight(dtype=torch.float32).cpu()
            assert torch.equal(got, want), module_name
    with torch.no_grad():
        want = cpu.model(ids).logits.float()
        got = cuda.model(ids.cuda()).logits.float().cpu()
    # bf16 models; CUDA's FP8 routes also quantize activations (about 6% relative noise on this
    # random model), so the logits are compared loosely: a misread scale moves them by O(1)
    err = float((got - want).norm() / want.norm())
    agree = float((got.argmax(-1) == want.argmax(-1)).float().mean())
    assert err < 0.15 and agree > 0.9, (err, agree)


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["hf", "compressed-tensors"])
def test_transformers_on_cuda_reads_floatxq_exports(tmp_path, layout):
    pytest.importorskip("accelerate")
    # transformers' CUDA FP8 kernels come from the `kernels` hub package; CT decompresses
    pytest.importorskip("compressed_tensors" if layout == "compressed-tensors" else "kernels")
    from transformers import AutoModelForCausalLM

    from floatxq.tiny import TINY_LLAMA_DIR

    config = floatxq.FP8Config(weight_block_size=[128, 128])
    quantized = floatxq.load(TINY_LLAMA_DIR, quantize_config=config).quantize(progress=False)
    out = quantized.save(tmp_path / layout, layout=layout)
    ids = torch.randint(0, 256, (2, 64), generator=torch.Generator().manual_seed(1)).cuda()
    ours = floatxq.load(out, device="cuda").model
    theirs = AutoModelForCausalLM.from_pretrained(out, device_map="cuda")
    with torch.no_grad():
        a, b = ours(ids).logits.float(), theirs(ids).logits.float()
    assert float((a - b).norm() / a.norm()) < 5e-2
    assert float((a.argmax(-1) == b.argmax(-1)).float().mean()) > 0.9


@pytest.mark.parametrize("bad", [-1.0, 0.0, float("nan"), float("inf")])
def test_bad_multiplying_fp8_scale_is_named(dense_dir, tmp_path, bad):
    from floatxq.testing.foreign import write_deepseek_fp8

    written = write_deepseek_fp8(dense_dir, tmp_path / "ds")
    for name in (
        "model.layers.1.mlp.up_proj.weight_scale_inv",
        "model.layers.0.self_attn.q_proj.weight_scale_inv",
    ):
        _rewrite(written.path, lambda s: s.__setitem__(name, torch.full_like(s[name], bad)))  # noqa: B023
        with pytest.raises(CheckpointError, match=name.replace(".", r"\.")):
            floatxq.load(written.path)
        shutil.rmtree(written.path)
        written = write_deepseek_fp8(dense_dir, tmp_path / "ds")
