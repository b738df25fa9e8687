"""An interrupted ``QuantizedModel.quantize``: FP8 rolls back; GPTQ marks the model partly
quantized, refuses ``quantize()`` and ``save()`` with a named error, and resumes on request to the
bytes of an uninterrupted run.

GPTQ releases each replaced module as soon as it is solved (memory stays flat), so it cannot roll
back; the tests inject a failure at the k-th solve (a ``ValueError`` or a ``KeyboardInterrupt``)
on the 2-layer random Llama of ``tests/fixtures`` (14 targets).
"""

import copy
import gc
import weakref

import pytest
import torch
from torch import nn

import floatxq
import floatxq.lifecycle.gptq as gptq_lifecycle
from floatxq import FP8Config, GPTQConfig
from floatxq.nn.fp8_linear import TorchFP8Linear
from floatxq.nn.gptq_linear import GPTQLinear
from tests.test_gptq_lifecycle import CONFIG, _model, _samples

TARGETS = 14  # 7 projections x 2 layers; lm_head is not a target by default


def _order(model: nn.Module) -> list[str]:
    """Target names in solve order (q/k/v, o, gate/up, down per layer)."""
    local = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    sub = {p: ("self_attn." if p in local[:4] else "mlp.") + p for p in local}
    return [f"model.layers.{i}.{sub[p]}" for i in range(2) for p in local]


def _fail_at(monkeypatch, k: int, kind: type[BaseException]) -> list[str]:
    """Make the k-th GPTQ solve raise ``kind``; returns the list of calls made."""
    real = gptq_lifecycle.gptq_solve
    calls: list[str] = []

    def solve(*args, **kwargs):
        calls.append("solve")
        if len(calls) == k:
            raise kind("injected failure") if kind is not KeyboardInterrupt else kind()
        return real(*args, **kwargs)

    monkeypatch.setattr(gptq_lifecycle, "gptq_solve", solve)
    return calls


def _state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items()}


def _same_state(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(
        a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in a
    )


@pytest.fixture(scope="module")
def uninterrupted():
    qm = floatxq.load(_model(), quantize_config=CONFIG, device="cpu")
    return qm.quantize(_samples(2), progress=False)


def _interrupted(monkeypatch, k: int, kind: type[BaseException], config=CONFIG):
    """A model whose GPTQ run failed at the k-th solve, its pristine copy and originals."""
    model = _model()
    pristine = copy.deepcopy(model)
    originals = {n: m for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    qm = floatxq.load(model, quantize_config=config, device="cpu")
    _fail_at(monkeypatch, k, kind)
    with pytest.raises(kind, match="injected" if kind is not KeyboardInterrupt else None):
        qm.quantize(_samples(2), progress=False)
    monkeypatch.undo()
    return qm, pristine, originals


@pytest.mark.parametrize("kind", [ValueError, KeyboardInterrupt])
@pytest.mark.parametrize("k", [3, 6, 12])
def test_failure_mid_run_leaves_a_marked_consistent_model(monkeypatch, k, kind):
    qm, pristine, originals = _interrupted(monkeypatch, k, kind)
    done = _order(qm.model)[: k - 1]
    assert qm.quantized is False and qm.partially_quantized
    assert qm.interrupted.done == tuple(done) and qm.interrupted.total == TARGETS
    assert qm.interrupted.error.startswith(kind.__name__)
    assert [r.name for r in qm.interrupted.reports] == done
    expected = dict(pristine.named_modules())
    for name, module in qm.model.named_modules():
        assert type(module).__name__ != "_DecodedStandIn", name  # no stand-in is left behind
        if name in done:
            assert isinstance(module, GPTQLinear), name
        elif name in originals:  # untouched: the very same object, the same bits
            assert module is originals[name], name
            assert torch.equal(module.weight, expected[name].weight), name
    assert not qm.model.training  # the mode it had
    assert all(t.device.type == "cpu" for t in qm.model.state_dict().values())
    assert "interrupted after" in repr(qm) and f"{k - 1} of {TARGETS}" in repr(qm)


def test_an_interrupted_model_is_refused_by_quantize_save_and_calibrate(monkeypatch, tmp_path):
    qm, _, _ = _interrupted(monkeypatch, 6, KeyboardInterrupt)
    before = _state(qm.model)
    with pytest.raises(ValueError, match="interrupted") as info:
        qm.quantize(_samples(2), progress=False)
    message = str(info.value)
    for fragment in ("KeyboardInterrupt", "5 of 14", "floatxq.load", "resume=True", "9 modules"):
        assert fragment in message, message
    with pytest.raises(ValueError, match=r"interrupted .* 5 of 14 .* not saved") as info:
        qm.save(tmp_path / "out")
    assert "floatxq.load" in str(info.value) and "resume=True" in str(info.value)
    assert not (tmp_path / "out").exists()
    with pytest.raises(ValueError, match="calibrate_activations: an earlier quantize"):
        qm.calibrate_activations([torch.arange(20)])
    assert _same_state(before, _state(qm.model))  # refusals change nothing
    assert qm.partially_quantized and not qm.quantized


def test_a_failure_at_the_first_solve_changes_nothing_and_marks_nothing(monkeypatch):
    qm, pristine, originals = _interrupted(monkeypatch, 1, ValueError)
    assert qm.interrupted is None and not qm.partially_quantized and not qm.quantized
    assert {n: m for n, m in qm.model.named_modules() if n in originals} == originals
    assert _same_state(_state(pristine), _state(qm.model))
    qm.quantize(_samples(2), progress=False)  # a plain second run quantizes everything
    assert qm.quantized and len(qm.quantized_modules) == TARGETS


@pytest.mark.parametrize("k", [2, 6, 14])
def test_resume_gives_the_uninterrupted_bytes_and_report(monkeypatch, uninterrupted, k):
    qm, _, _ = _interrupted(monkeypatch, k, KeyboardInterrupt)
    seen: list[str] = []
    qm.quantize(_samples(2), progress=seen.append, resume=True)
    assert seen == _order(qm.model)[k - 1 :]  # only the remaining modules are solved
    assert qm.quantized and qm.interrupted is None and not qm.partially_quantized
    assert qm.quantized_modules == uninterrupted.quantized_modules
    assert _same_state(_state(qm.model), _state(uninterrupted.model))
    ours = [(m.name, m.rows, m.loss, m.damp) for m in qm.report.modules]
    assert ours == [(m.name, m.rows, m.loss, m.damp) for m in uninterrupted.report.modules]


def test_an_interrupted_resume_keeps_counting_from_the_first_run(monkeypatch, uninterrupted):
    qm, _, _ = _interrupted(monkeypatch, 4, ValueError)
    _fail_at(monkeypatch, 5, KeyboardInterrupt)  # the 5th solve of the resumed run
    with pytest.raises(KeyboardInterrupt):
        qm.quantize(_samples(2), progress=False, resume=True)
    monkeypatch.undo()
    assert qm.interrupted.done == tuple(_order(qm.model)[:7]) and qm.interrupted.total == 14
    assert [r.name for r in qm.interrupted.reports] == _order(qm.model)[:7]
    qm.quantize(_samples(2), progress=False, resume=True)
    assert _same_state(_state(qm.model), _state(uninterrupted.model))
    assert [m.name for m in qm.report.modules] == uninterrupted.quantized_modules


def test_an_interrupt_from_the_progress_callback_counts_the_replaced_module(uninterrupted):
    qm = floatxq.load(_model(), quantize_config=CONFIG, device="cpu")
    names = _order(qm.model)

    def progress(name: str) -> None:
        if name == names[8]:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        qm.quantize(_samples(2), progress=progress)
    assert qm.interrupted.done == tuple(names[:9])  # the 9th was replaced before the callback
    qm.quantize(_samples(2), progress=False, resume=True)
    assert _same_state(_state(qm.model), _state(uninterrupted.model))


def test_a_failure_at_the_output_embedding_leaves_it_the_original(monkeypatch):
    config = GPTQConfig(bits=4, group_size=64, lm_head=True)
    qm, pristine, originals = _interrupted(monkeypatch, TARGETS + 1, ValueError, config)
    assert qm.interrupted.done == tuple(_order(qm.model)) and qm.interrupted.total == 15
    assert qm.model.lm_head is originals["lm_head"]
    assert torch.equal(qm.model.lm_head.weight, pristine.lm_head.weight)
    seen: list[str] = []
    qm.quantize(_samples(2), progress=seen.append, resume=True)
    assert seen == ["lm_head"] and isinstance(qm.model.lm_head, GPTQLinear)
    assert len(qm.report.modules) == 15 and qm.report.modules[-1].name == "lm_head"


def test_the_replaced_originals_are_not_kept_for_a_rollback(monkeypatch):
    # the reason GPTQ marks instead of rolling back: nothing holds the solved originals
    qm = floatxq.load(_model(), quantize_config=CONFIG, device="cpu")
    refs = {n: weakref.ref(m) for n, m in qm.model.named_modules() if isinstance(m, nn.Linear)}
    _fail_at(monkeypatch, 9, ValueError)
    with pytest.raises(ValueError, match="injected"):
        qm.quantize(_samples(2), progress=False)
    gc.collect()
    alive = {n for n, ref in refs.items() if ref() is not None}
    assert alive == set(refs) - set(_order(qm.model)[:8])


def test_resume_is_refused_without_an_interrupted_run_or_with_another_config(monkeypatch):
    qm = floatxq.load(_model(), quantize_config=CONFIG, device="cpu")
    with pytest.raises(ValueError, match="resume=True, but no earlier quantize"):
        qm.quantize(_samples(2), progress=False, resume=True)
    with pytest.raises(TypeError, match="resume"):  # (the test run type-checks calls too)
        qm.quantize(_samples(2), progress=False, resume="yes")
    assert not qm.quantized and qm.interrupted is None
    qm, _, _ = _interrupted(monkeypatch, 6, ValueError)
    before = _state(qm.model)
    qm.quantize_config = GPTQConfig(bits=8, group_size=64)
    with pytest.raises(ValueError, match="quantize_config changed since the interrupted run"):
        qm.quantize(_samples(2), progress=False, resume=True)
    qm.quantize_config = FP8Config()
    with pytest.raises(ValueError, match="an earlier quantize\\(\\) was interrupted"):
        qm.quantize()
    assert _same_state(before, _state(qm.model)) and qm.partially_quantized


def _w4a_llama() -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=64, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, head_dim=32, max_position_embeddings=64,
    )  # fmt: skip
    return LlamaForCausalLM(config).eval()


def test_a_run_with_an_activation_policy_is_marked_and_not_resumable(monkeypatch, tmp_path):
    config = GPTQConfig(bits=4, group_size=128, activation="w4afp8")
    qm = floatxq.load(_w4a_llama(), quantize_config=config, device="cpu")
    samples = [
        torch.randint(0, 64, (24,), generator=torch.Generator().manual_seed(i)) for i in range(2)
    ]
    _fail_at(monkeypatch, 9, KeyboardInterrupt)
    with pytest.raises(KeyboardInterrupt):
        qm.quantize(samples, progress=False)
    monkeypatch.undo()
    assert qm.interrupted.done == tuple(_order(qm.model)[:8]) and qm.interrupted.total == 14
    assert not any(type(m).__name__.startswith("W4A") for m in qm.model.modules())
    for resume in (False, True):
        with pytest.raises(ValueError, match="activation policy cannot be resumed") as info:
            qm.quantize(samples, progress=False, resume=resume)
        assert "floatxq.load" in str(info.value)
    with pytest.raises(ValueError, match="not saved") as info:
        qm.save(tmp_path / "out")
    assert "resume" not in str(info.value)
    assert not (tmp_path / "out").exists()


# ----------------------------------------------------------------------------------------------
# FP8: rolled back
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", [ValueError, KeyboardInterrupt])
def test_fp8_rolls_back_every_replaced_module(monkeypatch, kind):
    model = _model()
    pristine = _state(model)
    originals = {n: m for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    qm = floatxq.load(model, quantize_config=FP8Config())
    real = TorchFP8Linear.from_linear.__func__
    calls: list[str] = []

    def from_linear(cls, module, **kwargs):
        calls.append("call")
        if len(calls) == 9:
            raise kind("injected failure") if kind is not KeyboardInterrupt else kind()
        return real(cls, module, **kwargs)

    monkeypatch.setattr(TorchFP8Linear, "from_linear", classmethod(from_linear))
    with pytest.raises(kind):
        qm.quantize(progress=False)
    monkeypatch.undo()
    assert len(calls) == 9  # eight modules were replaced before the failure
    assert {n: m for n, m in model.named_modules() if n in originals} == originals
    assert not any(isinstance(m, TorchFP8Linear) for m in model.modules())
    assert _same_state(pristine, _state(model))
    assert not qm.quantized and qm.interrupted is None and qm.quantized_modules == []
    qm.quantize(progress=False)  # a second run quantizes every module
    assert len(qm.quantized_modules) == TARGETS and qm.quantized


def test_fp8_rolls_back_after_a_bias_fp16_cannot_hold():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=2, head_dim=32, attention_bias=True,
    )  # fmt: skip
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        model.model.layers[1].self_attn.v_proj.bias[3] = 1e6  # beyond FP16's 65504
    pristine = _state(model)
    qm = floatxq.load(model, quantize_config=FP8Config())
    with pytest.raises(ValueError, match=r"'model\.layers\.1\.self_attn\.v_proj'.*65504"):
        qm.quantize(progress=False)
    assert not any(isinstance(m, TorchFP8Linear) for m in model.modules())
    assert _same_state(pristine, _state(model)) and not qm.quantized
