"""``floatxq.load(path, backend="gptq_w4afp8")``: a GPTQ checkpoint run as W4AFP8Linear modules.

The checkpoints are the tiny random Llama of ``tests/fixtures`` with its decoder linears replaced
by round-to-nearest (or ``desc_act``-solved) GPTQ modules and saved with ``layout="gptq"``. Its
``down_proj`` takes 192 inputs (not a multiple of 128), so the eligible checkpoints leave it
dense with a ``-:`` rule. The W4A-FP8 logits are checked against an oracle built from the
ordinary ``gptq_torch`` load: the same model with every GPTQ module's input quantized and
dequantized per token through E4M3 (``fp8_token_qdq``), which W4A-FP8 equals up to FP32
summation order.
"""

import json
from pathlib import Path

import pytest
import torch
from torch import nn

import floatxq
from floatxq.config import BACKEND, FP8Config, GPTQConfig
from floatxq.fp8 import fp8_token_qdq
from floatxq.gptq.hessian import hessian_finalize, hessian_init, hessian_update
from floatxq.gptq.solve import gptq_solve, rtn_quantize
from floatxq.lifecycle.gptq import gptq_solve_options
from floatxq.lifecycle.model import QuantizedModel
from floatxq.nn.gptq_linear import GPTQLinear
from floatxq.nn.w4a_fp8_linear import W4AFP8Linear

pytest.importorskip("transformers")

BASE = Path(__file__).parent / "fixtures" / "tiny_random_llama"
IDS = torch.tensor([[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12]])
ELIGIBLE = GPTQConfig(bits=4, group_size=128, sym=True, dynamic={r"-:.*down_proj": {}})


def _save(path: Path, config: GPTQConfig, *, wide: bool = False) -> Path:
    """The tiny Llama with every linear ``config`` resolves replaced by a GPTQLinear, saved;
    ``wide``: 256 hidden and intermediate features (two groups of 128 in every linear)."""
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    if wide:
        options = json.loads((BASE / "config.json").read_text())
        options.update(hidden_size=256, intermediate_size=256, head_dim=64)
        torch.manual_seed(0)
        model = LlamaForCausalLM(LlamaConfig(**options)).float().eval()
    else:
        model = AutoModelForCausalLM.from_pretrained(BASE, dtype=torch.float32).eval()
    for seed, (name, module) in enumerate(list(model.named_modules())):
        resolved = config.resolve(name)
        if not isinstance(module, nn.Linear) or name == "lm_head" or resolved is None:
            continue
        weight, options = module.weight.detach().float(), gptq_solve_options(resolved)
        if resolved.desc_act:
            g = torch.Generator().manual_seed(seed)
            x = torch.randn(256, weight.shape[1], generator=g)
            x = x * torch.rand(weight.shape[1], generator=g)
            hessian = hessian_finalize(hessian_update(hessian_init(weight.shape[1]), x))
            solution = gptq_solve(weight, hessian, options)
        else:
            solution = rtn_quantize(weight, options)
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
        return model(IDS).logits.double()


def _fp8_token_oracle(model: nn.Module) -> torch.Tensor:
    """Logits with every GPTQLinear fed its input through per-token E4M3 (then removed)."""
    hooks = [
        m.register_forward_pre_hook(lambda _m, args: (fp8_token_qdq(args[0]),))
        for m in model.modules()
        if isinstance(m, GPTQLinear)
    ]
    try:
        return _logits(model)
    finally:
        for h in hooks:
            h.remove()


@pytest.fixture(scope="module")
def eligible(tmp_path_factory) -> Path:
    return _save(tmp_path_factory.mktemp("w4afp8") / "m", ELIGIBLE)


def test_a_gptq_checkpoint_runs_as_w4a_fp8_modules(eligible):
    plain = floatxq.load(eligible, dtype=torch.float32)
    assert plain.backend == BACKEND.GPTQ_TORCH  # auto never picks W4A-FP8
    w4a = floatxq.load(eligible, dtype=torch.float32, backend=" GPTQ_W4AFP8 ")
    assert w4a.backend == BACKEND.GPTQ_W4AFP8 and w4a.quantized
    gptq = {n for n, m in plain.model.named_modules() if type(m) is GPTQLinear}
    assert len(gptq) == 12  # q, k, v, o, gate, up in each of the 2 layers
    kinds = {n: type(m) for n, m in w4a.model.named_modules() if n in gptq or "down_proj" in n}
    assert {n for n, k in kinds.items() if k is W4AFP8Linear} == gptq
    assert {n for n, k in kinds.items() if k is nn.Linear} == {
        "model.layers.0.mlp.down_proj",
        "model.layers.1.mlp.down_proj",
    }
    assert sorted(w4a.quantized_modules) == sorted(gptq)
    # the same tensors under the same keys (the staged cache is not state)
    left, right = plain.model.state_dict(), w4a.model.state_dict()
    assert sorted(left) == sorted(right)
    assert all(torch.equal(left[k], right[k]) for k in left)

    logits = _logits(w4a.model)
    assert {m.last_route for m in w4a.model.modules() if isinstance(m, W4AFP8Linear)} == {
        "reference"
    }
    oracle, dense = _fp8_token_oracle(plain.model), _logits(plain.model)
    # W4A-FP8 is the FP8-token model up to FP32 summation order ...
    scale = float(dense.abs().max())
    assert float((logits - oracle).abs().max()) <= 1e-5 * scale
    # ... and close to W4A16, but not equal to it: the tokens were quantized
    fp8_error = float((logits - dense).abs().max())
    assert 0 < fp8_error <= 0.1 * scale


@pytest.mark.parametrize(
    ("config", "match"),
    [
        (
            GPTQConfig(bits=4, group_size=128, sym=False, dynamic={r"-:.*down_proj": {}}),
            r"cannot run model\.layers\.0\.self_attn\.q_proj: asymmetric zero points: group 0",
        ),
        (
            GPTQConfig(bits=4, group_size=128, desc_act=True, act_group_aware=False),
            r"cannot run model\.layers\.0\.self_attn\.q_proj: g_idx is not arange\(in\) // 128",
        ),
        (
            GPTQConfig(bits=4, group_size=128),
            r"cannot run model\.layers\.0\.mlp\.down_proj: in_features=192 is not a multiple",
        ),
        (
            GPTQConfig(bits=8, group_size=128, dynamic={r"-:.*down_proj": {}}),
            r"cannot run model\.layers\.0\.self_attn\.q_proj: bits=8",
        ),
    ],
    ids=["asymmetric", "desc_act", "in_192", "bits_8"],
)
def test_an_ineligible_checkpoint_is_refused_naming_the_module(tmp_path, config, match):
    # desc_act: every input row in one group of 128 is no reordering; 256 inputs make two
    path = _save(tmp_path / "m", config, wide=config.desc_act)
    with pytest.raises(ValueError, match=match):
        floatxq.load(path, dtype=torch.float32, backend="gptq_w4afp8")
    assert floatxq.load(path, dtype=torch.float32).backend == BACKEND.GPTQ_TORCH


def test_the_backend_runs_gptq_checkpoints_only():
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(BASE, dtype=torch.float32)
    with pytest.raises(ValueError, match="runs GPTQ checkpoints loaded from a directory"):
        floatxq.load(model, quantize_config=GPTQConfig(), backend="gptq_w4afp8")
    with pytest.raises(ValueError, match="'gptq_w4afp8' cannot run FP8 weight-only models"):
        floatxq.load(model, quantize_config=FP8Config(), backend="gptq_w4afp8")
    with pytest.raises(
        ValueError, match="accepted: 'auto', 'fp8_torch', 'gptq_torch', 'gptq_w4afp8'"
    ):
        floatxq.load(model, backend="w4a")
