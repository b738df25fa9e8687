"""``floatxq.load(path, backend="gptq_w4a_nvfp4")``: a GPTQ checkpoint run as W4ANVFP4Linear.

The checkpoints are the tiny random Llama of ``tests/fixtures`` with its decoder linears replaced
by round-to-nearest GPTQ modules and saved with ``layout="gptq"``; its ``down_proj`` takes 192
inputs (not a multiple of 128), so the eligible checkpoint leaves it dense with a ``-:`` rule.
The W4A-NVFP4 logits are checked against the ordinary ``gptq_torch`` load with every GPTQ
module's output replaced by the pure ``floatxq.w4a_nvfp4_linear`` of its input on its int32
words (dynamic global scale, as a checkpoint without calibrated scales runs).
"""

from pathlib import Path

import pytest
import torch
from torch import nn

import floatxq
from floatxq.config import BACKEND, FP8Config, GPTQConfig
from floatxq.gptq.solve import rtn_quantize
from floatxq.lifecycle.gptq import gptq_solve_options
from floatxq.lifecycle.model import QuantizedModel
from floatxq.nn.gptq_linear import GPTQLinear
from floatxq.nn.w4a_nvfp4_linear import W4ANVFP4Linear
from floatxq.w4a.linear import w4a_nvfp4_linear

pytest.importorskip("transformers")

BASE = Path(__file__).parent / "fixtures" / "tiny_random_llama"
IDS = torch.tensor([[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12]])
ELIGIBLE = GPTQConfig(bits=4, group_size=128, sym=True, dynamic={r"-:.*down_proj": {}})
BITS_KEY = "activation_global_scale_bits"


def _save(path: Path, config: GPTQConfig) -> Path:
    """The tiny Llama with every linear ``config`` resolves replaced by an RTN GPTQLinear."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(BASE, dtype=torch.float32).eval()
    for name, module in list(model.named_modules()):
        resolved = config.resolve(name)
        if not isinstance(module, nn.Linear) or name == "lm_head" or resolved is None:
            continue
        solution = rtn_quantize(module.weight.detach().float(), gptq_solve_options(resolved))
        layer = GPTQLinear.from_solution(
            solution, bits=resolved.bits, group_size=resolved.group_size, format=config.format
        )
        model.set_submodule(name, layer)
    QuantizedModel(model, quantize_config=config, backend=BACKEND.GPTQ_TORCH, quantized=True).save(
        path, layout="gptq"
    )
    return path


def _logits(model: nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model(IDS).logits


def _w4a_nvfp4_oracle(model: nn.Module) -> torch.Tensor:
    """Logits with every GPTQLinear's output replaced by the pure W4A-NVFP4 linear (then the
    hooks removed)."""

    def replace(m: GPTQLinear, args: tuple, out: torch.Tensor) -> torch.Tensor:
        x = args[0].reshape(-1, m.in_features)
        return w4a_nvfp4_linear(x, m.qweight, m.scales, m.bias).reshape(out.shape)

    hooks = [m.register_forward_hook(replace) for m in model.modules() if type(m) is GPTQLinear]
    try:
        return _logits(model)
    finally:
        for h in hooks:
            h.remove()


@pytest.fixture(scope="module")
def eligible(tmp_path_factory) -> Path:
    return _save(tmp_path_factory.mktemp("w4anvfp4") / "m", ELIGIBLE)


def test_a_gptq_checkpoint_runs_as_w4a_nvfp4_modules(eligible):
    plain = floatxq.load(eligible, dtype=torch.float32)
    assert plain.backend == BACKEND.GPTQ_TORCH  # auto never picks W4A-NVFP4
    loaded = floatxq.load(eligible, dtype=torch.float32, backend=" GPTQ_W4A_NVFP4 ")
    assert loaded.backend == BACKEND.GPTQ_W4A_NVFP4 and loaded.quantized
    gptq = {n for n, m in plain.model.named_modules() if type(m) is GPTQLinear}
    assert len(gptq) == 12  # q, k, v, o, gate, up in each of the 2 layers
    kinds = {n: type(m) for n, m in loaded.model.named_modules() if n in gptq or "down_proj" in n}
    assert {n for n, k in kinds.items() if k is W4ANVFP4Linear} == gptq
    assert {n for n, k in kinds.items() if k is nn.Linear} == {
        "model.layers.0.mlp.down_proj",
        "model.layers.1.mlp.down_proj",
    }
    assert sorted(loaded.quantized_modules) == sorted(gptq)
    # the checkpoint's tensors under their keys, plus one dynamic (0.0) scale per module
    left, right = plain.model.state_dict(), loaded.model.state_dict()
    scales = {k for k in right if k.endswith("." + BITS_KEY)}
    assert scales == {f"{n}.{BITS_KEY}" for n in gptq}
    assert all(int(right[k]) == 0 for k in scales)
    assert sorted(left) == sorted(set(right) - scales)
    assert all(torch.equal(left[k], right[k]) for k in left)

    logits = _logits(loaded.model)
    modules = [m for m in loaded.model.modules() if isinstance(m, W4ANVFP4Linear)]
    assert {m.last_route for m in modules} == {"reference"}
    assert torch.equal(logits, _w4a_nvfp4_oracle(plain.model))
    # close to W4A16, but not equal to it: the activations were quantized to NVFP4
    dense = _logits(plain.model).double()
    error = float((logits.double() - dense).abs().max())
    assert 0 < error <= 0.25 * float(dense.abs().max())


@pytest.mark.parametrize(
    ("config", "match"),
    [
        (
            GPTQConfig(bits=4, group_size=128, sym=False, dynamic={r"-:.*down_proj": {}}),
            r"cannot run model\.layers\.0\.self_attn\.q_proj: asymmetric zero points: group 0",
        ),
        (
            GPTQConfig(bits=4, group_size=128),
            r"cannot run model\.layers\.0\.mlp\.down_proj: in_features=192 is not a multiple",
        ),
    ],
    ids=["asymmetric", "in_192"],
)
def test_an_ineligible_checkpoint_is_refused_naming_the_module(tmp_path, config, match):
    path = _save(tmp_path / "m", config)
    with pytest.raises(ValueError, match=match):
        floatxq.load(path, dtype=torch.float32, backend="gptq_w4a_nvfp4")


def test_the_backend_runs_gptq_checkpoints_only():
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(BASE, dtype=torch.float32)
    with pytest.raises(ValueError, match="with backend='gptq_w4a_nvfp4'"):
        floatxq.load(model, quantize_config=GPTQConfig(), backend="gptq_w4a_nvfp4")
    with pytest.raises(ValueError, match="'gptq_w4a_nvfp4' cannot run FP8 weight-only models"):
        floatxq.load(model, quantize_config=FP8Config(), backend="gptq_w4a_nvfp4")
    with pytest.raises(ValueError, match="'gptq_w4afp8', 'gptq_w4a_nvfp4'"):
        floatxq.load(model, backend="w4a")


@pytest.mark.parametrize("layout", ["gptq", "compressed-tensors"])
def test_a_w4a_nvfp4_model_saves_as_gptq_and_a_calibrated_scale_is_refused(
    eligible, tmp_path, layout
):
    """The saved files are ordinary GPTQ (no activation-scale key): they reload, as W4A-NVFP4
    again, to the same logits while every scale is 0.0 (dynamic). A calibrated scale has no
    place in those files, so saving refuses it (naming the module) instead of dropping it."""
    loaded = floatxq.load(eligible, dtype=torch.float32, backend="gptq_w4a_nvfp4")
    logits = _logits(loaded.model)
    again = floatxq.load(loaded.save(tmp_path / "a", layout=layout), dtype=torch.float32,
                         backend="gptq_w4a_nvfp4")  # fmt: skip
    assert not any(k.endswith(BITS_KEY) for k in _saved_keys(tmp_path / "a"))
    assert torch.equal(_logits(again.model), logits)
    module = loaded.model.get_submodule("model.layers.1.self_attn.o_proj")
    module.activation_global_scale = 0.125
    with pytest.raises(ValueError, match=r"model\.layers\.1\.self_attn\.o_proj holds a calib"):
        loaded.save(tmp_path / "b", layout=layout)
    assert not (tmp_path / "b").exists()


def _saved_keys(path: Path) -> set[str]:
    from safetensors import safe_open

    keys: set[str] = set()
    for file in path.glob("*.safetensors"):
        with safe_open(str(file), "pt") as f:
            keys |= set(f.keys())
    return keys
