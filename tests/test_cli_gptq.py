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
