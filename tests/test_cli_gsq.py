"""``floatxq quantize --gsq``: GSQ from the command line, its report, and its refusals."""

import json
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

import floatxq
from floatxq.cli import app
from floatxq.config import GSQConfig
from floatxq.nn.fp8_linear import TorchFP8Linear

FIXTURE = Path(__file__).parent / "fixtures" / "tiny_random_llama"
MODULES = 14
"""The tiny random Llama's linears (2 layers of q, k, v, o, gate, up, down; no lm_head)."""

runner = CliRunner()


def _quantize(*args: str):
    return runner.invoke(app, ["quantize", str(FIXTURE), *args])


def _codes(model) -> dict[str, torch.Tensor]:
    return {
        name: module.weight.view(torch.uint8).clone()
        for name, module in model.named_modules()
        if isinstance(module, TorchFP8Linear)
    }


def test_weight_only_gsq_saves_its_config_and_the_library_codes(tmp_path):
    out = tmp_path / "out"
    result = _quantize(
        "--gsq", "--gsq-steps", "2", "--gsq-seed", "3", "--gsq-candidates", "3",
        "--layout", "gptqmodel", "--out", str(out),
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert f"quantized {MODULES} modules (float8_e4m3fn, row, gsq)" in result.output
    summary = [line for line in lines if line.startswith("gsq: ")]
    assert len(summary) == 1 and f"{MODULES} modules refined (weight-only)" in summary[0]
    assert "mean objective after/before" in summary[0]
    per_module = [line for line in lines if line.startswith("  model.layers.")]
    assert len(per_module) == MODULES
    assert all(" -> " in line and "codes changed" in line for line in per_module)

    want = floatxq.FP8Config(gsq=GSQConfig(steps=2, seed=3, candidates=3))
    loaded = floatxq.load(out)
    assert loaded.quantize_config == want
    library = floatxq.load(FIXTURE, quantize_config=want).quantize(progress=False)
    mine, theirs = _codes(library.model), _codes(loaded.model)
    assert mine.keys() == theirs.keys() and len(mine) == MODULES
    assert all(torch.equal(mine[name], theirs[name]) for name in mine)
    changed = sum(int(r.changed) for r in library.report.modules)
    assert f"{changed} of " in summary[0]


def test_quiet_prints_the_summary_without_module_lines(tmp_path):
    result = runner.invoke(
        app,
        ["--quiet", "quantize", str(FIXTURE), "--gsq", "--gsq-steps", "2",
         "--out", str(tmp_path / "out")],
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    assert sum(line.startswith("gsq: ") for line in result.output.splitlines()) == 1
    assert "model.layers." not in result.output


def test_calibrated_gsq_json_report_has_every_module(tmp_path):
    result = _quantize(
        "--gsq", "--gsq-calibration", "--gsq-steps", "2", "--calibration", "tiny",
        "--samples", "2", "--seq-len", "32", "--batch-size", "2", "--json",
        "--out", str(tmp_path / "out"),
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["scheme"] == "float8_e4m3fn, row, gsq calibrated"
    gsq = report["gsq"]
    assert gsq["modules_refined"] == MODULES and len(gsq["modules"]) == MODULES
    assert {m["name"] for m in gsq["modules"]} == set(report["modules"])
    assert all(m["calibrated"] and m["layer"] in (0, 1) for m in gsq["modules"])
    assert (gsq["layers"], gsq["samples"]) == (2, 2) and gsq["tokens"] == 64
    assert gsq["codes"] == sum(m["codes"] for m in gsq["modules"]) == 245760
    assert gsq["changed"] == sum(m["changed"] for m in gsq["modules"])
    loaded = floatxq.load(tmp_path / "out")  # compressed-tensors records the GSQ settings
    assert loaded.quantize_config == floatxq.FP8Config(gsq=GSQConfig(steps=2), gsq_calibration=True)


def test_json_without_gsq_has_no_gsq_entry(tmp_path):
    result = _quantize("--json", "--out", str(tmp_path / "out"))
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["gsq"] is None


@pytest.mark.parametrize(
    "args, message",
    [
        (["--method", "gptq", "--gsq"], "--gsq refines FP8 codes: it applies to --method fp8"),
        (["--method", "nvfp4", "--gsq-steps", "2"], "--gsq-steps refines FP8 codes"),
        (["--gsq-steps", "2"], "--gsq-steps needs --gsq"),
        (["--gsq-seed", "1"], "--gsq-seed needs --gsq"),
        (["--gsq-calibration"], "--gsq-calibration needs --gsq"),
        (["--gsq", "--gsq-steps", "0"], "--gsq-steps: steps: got 0"),
        (["--gsq", "--gsq-candidates", "34"], "--gsq-candidates: candidates: got 34"),
        (["--gsq", "--gsq-seed", "-1"], "--gsq-seed: seed: got -1"),
        (["--gsq", "--gsq-calibration"], "fp8 with --gsq-calibration needs --calibration"),
        (
            ["--gsq", "--gsq-calibration", "--calibration", "tiny", "--scale-method", "tensor"],
            "gsq_calibration=True needs weight_scale_method 'row' or 'block'",
        ),
    ],
)
def test_gsq_option_errors_exit_2(tmp_path, args, message):
    result = _quantize(*args, "--out", str(tmp_path / "out"))
    assert result.exit_code == 2, result.output
    assert result.output.startswith("error: ") and message in result.output
    assert not (tmp_path / "out").exists()
