"""Checkpoint layouts, as properties: what a save in each layout and a load give back.

For any weights (magnitudes from 1e-6 to 1e6, so inverse scales on both sides of 1) and any
scale layout a layout holds:

- the FP8 codes come back byte for byte, in every layout;
- ``gptqmodel`` gives back the inverse scales byte for byte;
- layouts whose scales multiply give back ``fl(1 / fl(1 / scale_inv))``: at most one FP32 ulp
  from the original, and the decoded weights within ``3 * 2**-24`` relative of floatxq's own;
- the direction comes from the metadata: weights with amax >= 448 (inverse scales <= 1, where a
  magnitude heuristic would flip the direction) decode like any other;
- ``hf`` declares ``activation_scheme: "dynamic"`` (the only scheme transformers' FP8 runs), so a
  weight-only model saved there reloads with E4M3 activations per token (per token and
  ``weight_block_size[1]`` group for block scales); the other layouts reload weight-only.
"""

import contextlib
import tempfile

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import LlamaConfig, LlamaForCausalLM

import floatxq
import floatxq.lifecycle  # imported at collection, not in the first example's time
from floatxq.fp8_activation import FP8InputQuant, input_qdq
from floatxq.nn import TorchFP8Linear

SLOW = settings(max_examples=max(8, settings().max_examples // 4))

_LAYOUTS = {
    # layout: the scale layouts it holds
    "gptqmodel": ("tensor", "row", "block"),
    "compressed-tensors": ("tensor", "row", "block"),
    "hf": ("tensor", "block"),
}


def _reloaded_activations(layout: str, block: list[int] | None) -> FP8InputQuant | None:
    """The activations a model saved weight-only in ``layout`` reloads with."""
    if layout != "hf":
        return None
    return FP8InputQuant("group", block[1]) if block else FP8InputQuant("token")


@contextlib.contextmanager
def _quantized_inputs(model: torch.nn.Module, declared: dict[str, FP8InputQuant]):
    """While open, each named weight-only FP8 module of ``model`` multiplies its input
    quantize-dequantized through E4M3 as ``declared`` says."""
    handles = []
    for name, quant in declared.items():
        module = model.get_submodule(name)
        assert isinstance(module, TorchFP8Linear) and module.input_quant is None, name
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


def _tiny_llama(seed: int, magnitude: float):
    torch.manual_seed(seed)
    config = LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        vocab_size=32,
        max_position_embeddings=16,
    )
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("proj.weight"):
                param.normal_(0.0, magnitude)
    return model


@SLOW
@given(
    layout=st.sampled_from(sorted(_LAYOUTS)),
    method=st.sampled_from(["tensor", "row", "block"]),
    exponent=st.integers(-6, 6),
    seed=st.integers(0, 2**16),
)
def test_save_load_keeps_codes_and_scales_within_one_reciprocal(layout, method, exponent, seed):
    if method not in _LAYOUTS[layout]:
        return
    block = [32, 32] if method == "block" else None
    config = floatxq.FP8Config(weight_scale_method=method, weight_block_size=block)
    quantized = floatxq.load(_tiny_llama(seed, 10.0**exponent), quantize_config=config)
    quantized.quantize(progress=False)
    with tempfile.TemporaryDirectory() as tmp:
        loaded = floatxq.load(quantized.save(f"{tmp}/m", layout=layout), dtype=torch.float32)
    assert loaded.layout.layout == layout
    before = {n: m for n, m in quantized.model.named_modules() if isinstance(m, TorchFP8Linear)}
    after = {n: m for n, m in loaded.model.named_modules() if isinstance(m, TorchFP8Linear)}
    assert set(after) == set(before)
    for name, ours in before.items():
        theirs = after[name]
        assert theirs.weight_scale_method == ours.weight_scale_method, name
        assert ours.input_quant is None, name
        assert theirs.input_quant == _reloaded_activations(layout, block), name
        assert torch.equal(theirs.weight.view(torch.uint8), ours.weight.view(torch.uint8)), name
        if layout == "gptqmodel":
            assert torch.equal(theirs.weight_scale_inv, ours.weight_scale_inv), name
            continue
        a, b = ours.weight_scale_inv, theirs.weight_scale_inv
        ulps = (a.view(torch.int32) - b.view(torch.int32)).abs()
        assert int(ulps.max()) <= 1, name
        want = ours.dequantize_weight(dtype=torch.float32)
        got = theirs.dequantize_weight(dtype=torch.float32)
        rel = (got - want).abs() / want.abs().clamp_min(torch.finfo(torch.float32).tiny)
        assert float(rel.max()) <= 3 * 2**-24, name


@pytest.mark.parametrize("layout", sorted(_LAYOUTS))
def test_scales_below_one_are_not_flipped(tmp_path, layout):
    # amax >= 448: every inverse scale is <= 1, where a magnitude heuristic would multiply
    config = floatxq.FP8Config(weight_scale_method="tensor")
    quantized = floatxq.load(_tiny_llama(0, 1000.0), quantize_config=config)
    quantized.quantize(progress=False)
    assert all(
        float(m.weight_scale_inv) < 1
        for m in quantized.model.modules()
        if isinstance(m, TorchFP8Linear)
    )
    loaded = floatxq.load(quantized.save(tmp_path / "m", layout=layout), dtype=torch.float32)
    after = {n: m for n, m in loaded.model.named_modules() if isinstance(m, TorchFP8Linear)}
    expected = _reloaded_activations(layout, None)  # hf: per token; the others weight-only
    assert after and all(m.input_quant == expected for m in after.values())
    declared = {n: m.input_quant for n, m in after.items() if m.input_quant is not None}
    ids = torch.tensor([[1, 2, 3, 4, 5]])
    # the reference: the model before saving, its inputs quantized as the reloaded one declares
    with torch.no_grad(), _quantized_inputs(quantized.model.float(), declared) as reference:
        want = reference(ids).logits
        got = loaded.model(ids).logits
    assert float((got - want).abs().max() / want.abs().max()) < 1e-5
