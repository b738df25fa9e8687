"""The calibrated methods offloaded to disk (GPTQ, NVFP4 GPTQ / W4A4, calibrated GSQ): the same
files as the in-memory run, resumed from an activation checkpoint or from the start, refusals."""

import filecmp
import os
from pathlib import Path

import pytest
import torch

import floatxq as fq
import floatxq.lifecycle.offload_calibrated as offload_calibrated
from floatxq.interop.stream_save import RUN_FILE, partial_dir
from floatxq.tiny import TINY_LLAMA_DIR, calibration_samples

CONFIGS = {
    "gptq": (fq.GPTQConfig(bits=4, group_size=32), None),
    "gptq-v2-asym-lm_head": (
        fq.GPTQConfig(bits=4, group_size=32, sym=False, format="gptq_v2", lm_head=True),
        "gptq",
    ),
    "gptq-desc_act-8bit-rule": (
        fq.GPTQConfig(
            bits=4,
            group_size=64,
            desc_act=True,
            act_group_aware=False,
            dynamic={r".*down_proj": {"bits": 8}},
        ),
        "gptq",
    ),
    "nvfp4-gptq": (fq.NVFP4Config(method="gptq"), None),
    "nvfp4-gptq-modelopt": (fq.NVFP4Config(method="gptq", global_scale="fused"), "modelopt"),
    "w4a4-fused": (fq.NVFP4Config(method="gptq", activations="nvfp4", global_scale="fused"), None),
    "gsq-calibrated": (
        fq.FP8Config(gsq=fq.GSQConfig(steps=10, modules=[r".*down_proj"]), gsq_calibration=True),
        None,
    ),
}


def _samples():
    return calibration_samples(num_samples=8, seq_len=64)


def _same_files(a: Path, b: Path) -> None:
    names = sorted(os.listdir(a))
    assert names == sorted(os.listdir(b))
    for name in names:
        assert filecmp.cmp(a / name, b / name, shallow=False), name


def _in_memory(config, out: Path, layout=None) -> Path:
    model = fq.load(TINY_LLAMA_DIR, quantize_config=config)
    model.quantize(_samples(), progress=False).save(out, layout=layout)
    return out


@pytest.mark.parametrize("key", list(CONFIGS))
def test_the_offloaded_run_writes_the_in_memory_runs_files(tmp_path, key):
    config, layout = CONFIGS[key]
    reference = _in_memory(config, tmp_path / "memory", layout)
    model = fq.load(TINY_LLAMA_DIR, quantize_config=config, offload="disk")
    model.quantize(_samples(), out=tmp_path / "offload", layout=layout, progress=False)
    _same_files(reference, tmp_path / "offload")
    report = model.report
    assert (report.layers, report.resumed_layers) == (8, 0)
    assert len(report.modules) == len(report.run.modules) >= 8
    assert not partial_dir(tmp_path / "offload").exists()
    layer = model.model.model.layers[5]
    assert all(t.is_meta for t in (*layer.parameters(), *layer.buffers()))


def _interrupt_at_layer(monkeypatch, layer: int) -> None:
    """A KeyboardInterrupt when decoder layer ``layer`` is read."""
    import floatxq.lifecycle.offload as offload

    real = offload.materialize

    def failing(model, prefix, *args, **kwargs):
        if prefix == f"model.layers.{layer}":
            raise KeyboardInterrupt
        return real(model, prefix, *args, **kwargs)

    monkeypatch.setattr(offload, "materialize", failing)


@pytest.mark.parametrize("every", [0.0, 1e9], ids=["checkpointed", "from-the-start"])
def test_a_gptq_run_cut_short_resumes(tmp_path, monkeypatch, every):
    """With activation checkpoints (every layer here) the resumed run starts at the layer cut
    short; without one it solves the flushed layers again, writing none of them twice."""
    config = CONFIGS["gptq-v2-asym-lm_head"][0]
    out = tmp_path / "offload"
    monkeypatch.setattr(offload_calibrated, "CHECKPOINT_SECONDS", every)
    _interrupt_at_layer(monkeypatch, 5)
    model = fq.load(TINY_LLAMA_DIR, quantize_config=config, offload="disk")
    with pytest.raises(KeyboardInterrupt):
        model.quantize(_samples(), out=out, layout="gptq", progress=False)
    staging = partial_dir(out)
    assert not out.exists() and (staging / RUN_FILE).is_file()
    kept = (staging / offload_calibrated.POINTER_FILE).is_file()
    assert kept == (every == 0.0)
    monkeypatch.undo()
    monkeypatch.setattr(offload_calibrated, "CHECKPOINT_SECONDS", every)

    again = fq.load(TINY_LLAMA_DIR, quantize_config=config, offload="disk")
    with pytest.raises(ValueError, match="differs from the interrupted one in calibration"):
        again.quantize(_samples()[:7], out=out, layout="gptq", resume=True, progress=False)
    again.quantize(_samples(), out=out, layout="gptq", resume=True, progress=False)
    resumed, solved = again.report.resumed_layers, again.report.layers
    assert (resumed, solved) == (5, 3)
    first = min(m.layer for m in again.report.modules if m.layer is not None)
    assert first == (5 if every == 0.0 else 0)
    _same_files(_in_memory(config, tmp_path / "memory", "gptq"), out)
    assert not staging.exists()


def test_refusals(tmp_path):
    policy = fq.GPTQConfig(activation="w4afp8")
    model = fq.load(TINY_LLAMA_DIR, quantize_config=policy, offload="disk")
    with pytest.raises(ValueError, match="without an activation policy"):
        model.quantize(_samples(), out=tmp_path / "w4a", progress=False)
    gsq = fq.load(TINY_LLAMA_DIR, quantize_config=CONFIGS["gsq-calibrated"][0], offload="disk")
    with pytest.raises(ValueError, match="needs calibration data"):
        gsq.quantize(out=tmp_path / "gsq", progress=False)
    assert not partial_dir(tmp_path / "w4a").exists() and not partial_dir(tmp_path / "gsq").exists()


@pytest.mark.gpu
@pytest.mark.parametrize("key", ["gptq", "w4a4-fused"])
def test_on_cuda_offloaded_and_spilled_runs_write_the_in_memory_runs_files(tmp_path, key):
    """On the GPU: the in-memory run, the same with its activations spilled to host memory
    (``activation_budget=0``), and the offloaded run with spilled activations agree byte for
    byte (and the spill moved them: their bytes exceed the budget)."""
    config, layout = CONFIGS[key]
    runs = {}
    for name, offload, budget in (("memory", None, None), ("spilled", None, 0),
                                  ("offload", "disk", 0)):  # fmt: skip
        model = fq.load(TINY_LLAMA_DIR, quantize_config=config, offload=offload, device="cuda")
        if offload is None:
            model.quantize(_samples(), progress=False, activation_budget=budget)
            model.save(tmp_path / name, layout=layout)
        else:
            model.quantize(_samples(), out=tmp_path / name, layout=layout, progress=False,
                           activation_budget=budget)  # fmt: skip
        runs[name] = tmp_path / name
    _same_files(runs["memory"], runs["spilled"])
    _same_files(runs["memory"], runs["offload"])


class _Double(torch.nn.Module):
    """A layer doubling its input, noting the device it ran on."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[torch.device] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen.append(x.device)
        return x * 2


def test_spilled_inputs_live_in_host_memory_and_run_on_the_work_device():
    """``spill_inputs`` moves nothing within its budget or when already on the host, and
    ``call_layer`` / ``next_input`` move a spilled batch over and its output back."""
    from floatxq.lifecycle.decoder import LayerInput, call_layer, next_input, spill_inputs

    hidden = torch.randn(2, 3, 4)
    inputs = [LayerInput(hidden, (), {}, torch.ones(2, 3, dtype=torch.bool))]
    assert not spill_inputs(inputs, None) and not spill_inputs(inputs, 0)  # on the host already
    layer = _Double()
    out = call_layer(layer, inputs[0])
    assert torch.equal(next_input(inputs[0], out).hidden, hidden * 2)
    assert layer.seen == [hidden.device]


@pytest.mark.gpu
def test_spilled_cuda_inputs_move_to_pinned_host_memory_and_back():
    from floatxq.lifecycle.decoder import LayerInput, call_layer, next_input, spill_inputs

    hidden = torch.randn(2, 3, 4, device="cuda")
    mask = torch.ones(2, 3, dtype=torch.bool, device="cuda")
    inputs = [LayerInput(hidden, (), {}, mask)]
    assert not spill_inputs(inputs, hidden.numel() * 4)  # within the budget: stays
    assert spill_inputs(inputs, hidden.numel() * 4 - 1)
    item = inputs[0]
    assert item.hidden.device.type == "cpu" and item.hidden.is_pinned()
    layer = _Double()
    out = call_layer(layer, item)
    assert out.device.type == "cuda" and layer.seen == [out.device]
    back = next_input(item, out).hidden
    assert back.device.type == "cpu" and torch.equal(back, (hidden * 2).cpu())


def test_the_cli_offloads_and_writes_the_in_memory_runs_files(tmp_path):
    from typer.testing import CliRunner

    from floatxq.cli import app

    runner = CliRunner()
    common = ["quantize", str(TINY_LLAMA_DIR), "--method", "gptq", "--group-size", "32",
              "--calibration", "tiny", "--samples", "8", "--seq-len", "64"]  # fmt: skip
    memory = runner.invoke(app, [*common, "--out", str(tmp_path / "memory")])
    assert memory.exit_code == 0, memory.output
    offloaded = runner.invoke(app, [*common, "--offload", "--out", str(tmp_path / "offload")])
    assert offloaded.exit_code == 0, offloaded.output
    assert "quantized 56 modules" in offloaded.output
    _same_files(tmp_path / "memory", tmp_path / "offload")
    again = runner.invoke(app, [*common, "--offload", "--out", str(tmp_path / "offload")])
    assert again.exit_code != 0 and "already exists" in again.output


def test_activation_budget_takes_zero_sizes_and_refuses_the_rest(tmp_path):
    """``activation_budget``: 0 (everything in host memory; on the CPU nothing moves) runs and
    writes the same files; a negative or unreadable budget is refused before any work."""
    config, _ = CONFIGS["gptq"]
    fq.load(TINY_LLAMA_DIR, quantize_config=config).quantize(
        _samples(), progress=False, activation_budget=0
    ).save(tmp_path / "zero")
    fq.load(TINY_LLAMA_DIR, quantize_config=config).quantize(
        _samples(), progress=False, activation_budget="1GB"
    ).save(tmp_path / "sized")
    _same_files(tmp_path / "zero", tmp_path / "sized")
    for bad in (-1, "lots"):
        model = fq.load(TINY_LLAMA_DIR, quantize_config=config)
        with pytest.raises(ValueError, match="activation_budget"):
            model.quantize(_samples(), progress=False, activation_budget=bad)
