"""``floatxq quantize --method gptq``: the lifecycle from the command line."""

import json
from pathlib import Path

import torch
from typer.testing import CliRunner

import floatxq
from floatxq.cli import app
from floatxq.nn.gptq_linear import GPTQLinear

FIXTURE = Path(__file__).parent / "fixtures" / "tiny_random_llama"


def _write_jsonl(path: Path, count: int = 4) -> Path:
    gen = torch.Generator().manual_seed(0)
    lines = [
        json.dumps({"input_ids": torch.randint(2, 128, (40,), generator=gen).tolist()})
        for _ in range(count)
    ]
    lines.append(json.dumps({"input_ids": [5, 6, 7]}))  # too short: dropped
    path.write_text("\n".join(lines) + "\n")
    return path


def test_quantize_gptq_writes_a_loadable_checkpoint(tmp_path):
    cal = _write_jsonl(tmp_path / "cal.jsonl")
    out = tmp_path / "out"
    result = CliRunner().invoke(
        app,
        [
            "quantize",
            str(FIXTURE),
            "--method",
            "gptq",
            "--bits",
            "4",
            "--group-size",
            "64",
            "--calibration",
            str(cal),
            "--batch-size",
            "2",
            "--layout",
            "gptq",
            "--out",
            str(out),
        ],
    )
    assert result.exit_code == 0, result.output
    assert "gptq 4-bit, group 64" in result.output
    loaded = floatxq.load(out)
    assert len(loaded.quantized_modules) == 14
    assert all(
        isinstance(loaded.model.get_submodule(n), GPTQLinear) for n in loaded.quantized_modules
    )


def test_quantize_gptq_needs_calibration(tmp_path):
    result = CliRunner().invoke(
        app,
        [
            "quantize",
            str(FIXTURE),
            "--method",
            "gptq",
            "--out",
            str(tmp_path / "o"),
        ],
    )
    assert result.exit_code == 2
    assert "--method gptq needs --calibration" in result.output


def test_quantize_gptq_reports_a_group_that_does_not_divide(tmp_path):
    cal = _write_jsonl(tmp_path / "cal.jsonl")
    result = CliRunner().invoke(
        app,
        [
            "quantize",
            str(FIXTURE),
            "--method",
            "gptq",
            "--group-size",
            "128",
            "--calibration",
            str(cal),
            "--out",
            str(tmp_path / "o"),
        ],
    )
    assert result.exit_code == 2
    assert "in_features=192" in result.output and "group_size=128" in result.output
    assert not (tmp_path / "o").exists()


def test_quantize_with_an_activation_policy_saves_it_and_inspect_reports_it(tmp_path):
    out = tmp_path / "w4a"
    policy = '{"mode": "w4a_nvfp4", "recipe": "nvidia", "attention": {"mode": "w4afp8"}}'
    args = ["quantize", "tiny", "--method", "gptq", "--calibration", "tiny", "--samples", "4"]
    args += ["--seq-len", "64", "--batch-size", "2", "--activation", policy, "--out", str(out)]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    assert "activations w4a_nvfp4 nvidia" in result.output and "(layout gptq)" in result.output
    loaded = floatxq.load(out)
    assert loaded.quantize_config.activation.to_dict() == json.loads(policy)
    assert loaded.backend == floatxq.BACKEND.GPTQ_W4A_NVFP4
    shown = CliRunner().invoke(app, ["inspect", str(out)])
    assert shown.exit_code == 0, shown.output
    assert f"activation:  {json.dumps(json.loads(policy))} (W4A policy)" in shown.output
    assert "activation global scales: 56 modules" in shown.output


def test_quantize_refuses_a_bad_activation_policy(tmp_path):
    base = ["quantize", "tiny", "--calibration", "tiny", "--out", str(tmp_path / "o")]
    for extra, message in [
        (["--method", "gptq", "--activation", "w4a_mxfp4"], "--activation 'w4a_mxfp4': "),
        (["--method", "gptq", "--activation", "{mode"], "is not JSON"),
        (["--method", "fp8", "--activation", "w4afp8"], "applies to --method gptq only"),
        (["--method", "gptq", "--bits", "8", "--activation", "w4afp8"], "bits=8 (needs 4)"),
    ]:
        result = CliRunner().invoke(app, base + extra)
        assert result.exit_code == 2, (extra, result.output)
        assert message in result.output, (extra, result.output)
    assert not (tmp_path / "o").exists()
