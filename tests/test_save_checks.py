"""``save`` refuses, before writing anything, a checkpoint that ``floatxq.load`` would refuse.

A user can replace a quantized module's buffer (an FP8 inverse scale set to NaN, a GPTQ scale
set to zero, a W4A activation global scale set negative); the export runs the tensors it is about
to write through the readers ``load`` runs, so the save fails with a ``ValueError`` naming the
module, the tensor and the fault, and leaves no directory (an existing one stays as it was).
Uncorrupted models of the same kinds still save and load, and with the check switched off the
same corrupted models write files that ``load`` refuses: the check is load's, no stricter.
"""

from pathlib import Path

import pytest
import torch
from torch import nn

import floatxq as fq
import floatxq.interop.export as export
from floatxq.config import BACKEND, ActivationConfig, FP8Config, GPTQConfig
from floatxq.interop.checkpoint import CheckpointError
from floatxq.lifecycle.model import QuantizedModel

transformers = pytest.importorskip("transformers")

MODULE = "model.layers.0.self_attn.q_proj"
BAD = {"nan": float("nan"), "zero": 0.0, "negative": -1.0, "inf": float("inf")}
FP8_LAYOUTS = {
    "tensor": ["compressed-tensors", "hf", "gptqmodel"],
    "row": ["compressed-tensors", "gptqmodel"],
    "block": ["compressed-tensors", "hf", "gptqmodel"],
}
NVFP4_POLICY = ActivationConfig(mode="w4a_nvfp4", recipe="nvidia")


def _llama(hidden: int = 64) -> nn.Module:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=128, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        tie_word_embeddings=False,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(config).eval()


def _fp8(method: str) -> QuantizedModel:
    block = {"weight_block_size": (32, 32)} if method == "block" else {}
    config = FP8Config(weight_scale_method=method, **block)
    return fq.load(_llama(), quantize_config=config).quantize(progress=False)


def _gptq(activation: ActivationConfig | None = None, scales=None) -> QuantizedModel:
    """Every decoder linear a round-to-nearest GPTQ module (hidden 256: the W4A stream's widths);
    under an activation policy, its W4A modules and stream installed as the lifecycle does."""
    from floatxq.gptq.solve import rtn_quantize
    from floatxq.lifecycle.gptq import gptq_solve_options
    from floatxq.lifecycle.w4a_install import install_activation_stream, install_w4a_modules
    from floatxq.nn.gptq_linear import GPTQLinear

    model = _llama(hidden=256)
    options = gptq_solve_options(GPTQConfig())
    for name, module in list(model.named_modules()):
        if isinstance(module, nn.Linear) and name != "lm_head":
            solution = rtn_quantize(module.weight.detach().float(), options)
            model.set_submodule(name, GPTQLinear.from_solution(solution, bits=4, group_size=128))
    backend = BACKEND.GPTQ_TORCH
    if activation is not None:
        backend = fq.backend_for_activation(activation)
        install_w4a_modules(model, backend, activation=activation, scales=scales or {})
        install_activation_stream(model, activation)
    config = GPTQConfig(activation=activation)
    return QuantizedModel(model, quantize_config=config, backend=backend, quantized=True)


def _nvfp4() -> QuantizedModel:
    from floatxq.nn.fp4_linear import TorchFP4Linear

    model = _llama()
    for name, module in list(model.named_modules()):
        if isinstance(module, nn.Linear) and name != "lm_head":
            model.set_submodule(name, TorchFP4Linear.from_linear(module))
    return QuantizedModel(model, quantize_config=None, backend=BACKEND.FP8_TORCH, quantized=True)


def _fp32_bits(value: float) -> torch.Tensor:
    return torch.tensor(value, dtype=torch.float32).view(torch.int32)


def _set(buffer: torch.Tensor, value: float | torch.Tensor) -> None:
    """Overwrite the first element of ``buffer`` in place (as a user replacing it would)."""
    with torch.no_grad():
        buffer.view(-1)[0] = value


def _refused(qm: QuantizedModel, path: Path, *patterns: str, **kwargs) -> str:
    """Save must raise a ValueError whose message holds every pattern, and write nothing."""
    before = sorted(p.name for p in path.parent.iterdir()) if path.parent.exists() else None
    with pytest.raises(ValueError) as info:
        qm.save(path, **kwargs)
    message = str(info.value)
    for pattern in patterns:
        assert pattern in message, (pattern, message)
    after = sorted(p.name for p in path.parent.iterdir()) if path.parent.exists() else None
    assert after == before  # no directory, no temporary, no lock file
    return message


def _load_refuses_unchecked(qm: QuantizedModel, path: Path, monkeypatch, **kwargs) -> None:
    """With the export's check switched off the files are written, and load refuses them."""
    with monkeypatch.context() as patch:
        patch.setattr(export, "_check_loadable", lambda *args, **kw: None)
        qm.save(path, **kwargs)
    with pytest.raises(CheckpointError):
        fq.load(path)


@pytest.fixture(scope="module", params=sorted(FP8_LAYOUTS))
def fp8(request) -> tuple[str, QuantizedModel]:
    return request.param, _fp8(request.param)


@pytest.fixture(scope="module")
def gptq() -> QuantizedModel:
    return _gptq()


@pytest.fixture(scope="module")
def w4a_nvfp4() -> QuantizedModel:
    return _gptq(NVFP4_POLICY, {MODULE: 0.5})


# ----------------------------------------------------------------------------------------------
# FP8
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("bad", sorted(BAD))
def test_fp8_scales_load_refuses_are_refused_by_save(tmp_path, fp8, bad):
    method, qm = fp8
    scale = qm.model.get_submodule(MODULE).weight_scale_inv
    kept = scale.clone()
    try:
        _set(scale, BAD[bad])
        for layout in FP8_LAYOUTS[method]:
            stored = "weight_scale" if layout == "compressed-tensors" else "weight_scale_inv"
            why = "finite and > 0"
            _refused(qm, tmp_path / layout, f"module {MODULE!r}", f"{MODULE}.{stored}", why,
                     layout=layout)  # fmt: skip
    finally:
        scale.copy_(kept)
    # the same model, its scale put back, saves and loads (byte for byte where scales divide;
    # through two FP32 reciprocals, within an FP32 ulp, where they multiply)
    for layout in FP8_LAYOUTS[method]:
        loaded = fq.load(qm.save(tmp_path / f"ok-{layout}", layout=layout))
        got = loaded.model.get_submodule(MODULE).weight_scale_inv
        if layout == "gptqmodel":
            assert torch.equal(got, kept)
        else:
            torch.testing.assert_close(got, kept, rtol=2**-23, atol=0)


def test_fp8_nan_codes_are_refused(tmp_path, fp8):
    _, qm = fp8
    weight = qm.model.get_submodule(MODULE).weight
    kept = weight.clone()
    try:
        _set(weight.view(torch.uint8), 0x7F)  # E4M3's NaN
        _refused(qm, tmp_path / "m", f"module {MODULE!r}", "NaN", layout="gptqmodel")
    finally:
        weight.copy_(kept)


@pytest.mark.parametrize("layout", ["compressed-tensors", "gptqmodel"])
def test_the_check_is_loads_own(tmp_path, monkeypatch, layout):
    qm = _fp8("row")
    _set(qm.model.get_submodule(MODULE).weight_scale_inv, float("nan"))
    _refused(qm, tmp_path / "checked", MODULE, layout=layout)
    _load_refuses_unchecked(qm, tmp_path / "unchecked", monkeypatch, layout=layout)


def test_a_refused_overwrite_keeps_the_existing_directory(tmp_path):
    qm = _fp8("tensor")
    target = qm.save(tmp_path / "m")
    before = {f.name: f.read_bytes() for f in target.iterdir()}
    _set(qm.model.get_submodule(MODULE).weight_scale_inv, -2.0)
    _refused(qm, target, MODULE, overwrite=True)
    assert {f.name: f.read_bytes() for f in target.iterdir()} == before


# ----------------------------------------------------------------------------------------------
# GPTQ
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("layout", ["gptq", "compressed-tensors"])
@pytest.mark.parametrize("bad", sorted(BAD))
def test_gptq_scales_load_refuses_are_refused_by_save(tmp_path, gptq, layout, bad):
    scales = gptq.model.get_submodule(MODULE).scales
    kept = scales.clone()
    try:
        _set(scales, BAD[bad])
        message = _refused(gptq, tmp_path / "m", f"module {MODULE!r}", "scales", layout=layout)
        assert any(word in message for word in ("NaN", "infin", "zero", "negative")), message
    finally:
        scales.copy_(kept)


def test_gptq_scales_a_clean_model_saves_and_loads(tmp_path, gptq):
    for layout in ("gptq", "compressed-tensors"):
        loaded = fq.load(gptq.save(tmp_path / layout, layout=layout))
        twin = loaded.model.get_submodule(MODULE)
        assert torch.equal(twin.scales, gptq.model.get_submodule(MODULE).scales)


@pytest.mark.parametrize("bad", ["zero", "negative"])
def test_gptq_check_is_loads_own(tmp_path, monkeypatch, gptq, bad):
    scales = gptq.model.get_submodule(MODULE).scales
    kept = scales.clone()
    try:
        _set(scales, BAD[bad])
        _load_refuses_unchecked(gptq, tmp_path / "unchecked", monkeypatch, layout="gptq")
    finally:
        scales.copy_(kept)


# ----------------------------------------------------------------------------------------------
# W4A: activation global scales
# ----------------------------------------------------------------------------------------------

BITS = "activation_global_scale_bits"


@pytest.mark.parametrize("bad", [float("nan"), -1.0, float("inf"), -0.0])
def test_w4a_nvfp4_activation_scales_load_refuses_are_refused(tmp_path, w4a_nvfp4, bad):
    bits = w4a_nvfp4.model.get_submodule(MODULE).activation_global_scale_bits
    kept = bits.clone()
    try:
        bits.copy_(_fp32_bits(bad))
        _refused(w4a_nvfp4, tmp_path / "m", f"module {MODULE!r}", BITS, repr(bad))
    finally:
        bits.copy_(kept)
    loaded = fq.load(w4a_nvfp4.save(tmp_path / "ok"))  # put back: saved and read back exactly
    assert torch.equal(loaded.model.get_submodule(MODULE).activation_global_scale_bits, kept)


def test_w4a_nvfp4_check_is_loads_own(tmp_path, monkeypatch, w4a_nvfp4):
    bits = w4a_nvfp4.model.get_submodule(MODULE).activation_global_scale_bits
    kept = bits.clone()
    try:
        bits.copy_(_fp32_bits(-1.0))
        _load_refuses_unchecked(w4a_nvfp4, tmp_path / "unchecked", monkeypatch)
    finally:
        bits.copy_(kept)


@pytest.mark.parametrize("bad", [float("nan"), -1.0])
def test_w4a_nvfp4_stream_scales_load_refuses_are_refused(tmp_path, w4a_nvfp4, bad):
    key = "model.layers.0.w4a_stream_scales.input"
    buffer = w4a_nvfp4.model.state_dict()[key]
    kept = buffer.clone()
    try:
        buffer.copy_(_fp32_bits(bad))
        _refused(w4a_nvfp4, tmp_path / "m", key, "'model.layers.0.input'", repr(bad))
    finally:
        buffer.copy_(kept)


def test_w4a_fp8_models_are_checked_too(tmp_path):
    qm = _gptq(ActivationConfig(mode="w4afp8"))
    # the FP8 policy stores no activation scale (each call quantizes its activations)
    assert not [k for k in qm.model.state_dict() if k.endswith(BITS) or "w4a_stream" in k]
    _set(qm.model.get_submodule(MODULE).scales, -1.0)
    _refused(qm, tmp_path / "m", f"module {MODULE!r}", "scales")


# ----------------------------------------------------------------------------------------------
# NVFP4
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("tensor", ["weight_scale", "weight_scale_2"])
def test_nvfp4_scales_load_refuses_are_refused(tmp_path, monkeypatch, tensor):
    qm = _nvfp4()
    module = qm.model.get_submodule(MODULE)
    if tensor == "weight_scale":
        _set(module.weight_scale.view(torch.uint8), 0x7F)  # an E4M3 NaN block scale
    else:
        _set(module.weight_scale_2, float("nan"))
    _refused(qm, tmp_path / "m", f"module {MODULE!r}")
    _load_refuses_unchecked(qm, tmp_path / "unchecked", monkeypatch)
