"""User errors of the ``floatxq`` command: one ``error:`` line on stderr, exit code 2, no traceback.

Checks that run before any work also leave stdout empty and stderr a single line.
"""

import json
import os
import re
import shutil
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from floatxq.cli import app
from floatxq.tiny import TINY_LLAMA_DIR

runner = CliRunner()


def _invoke(*args: str | Path):
    return runner.invoke(app, [str(a) for a in args])


def _error_line(result) -> str:
    """Require a clean user error and return its ``error:`` line."""
    assert isinstance(result.exception, SystemExit), result.exception  # no other exception
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    lines = [line for line in result.stderr.replace("\r", "\n").splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("error: ")]
    assert len(errors) == 1 and lines[-1] == errors[0], result.stderr
    return errors[0]


def _error(*args: str | Path) -> str:
    """Run the command; it must end in a clean user error, whose ``error:`` line is returned."""
    return _error_line(_invoke(*args))


def _early_error(*args: str | Path) -> str:
    """``_error`` for a check made before any work: nothing else is printed."""
    result = _invoke(*args)
    line = _error_line(result)
    assert result.stdout == "" and result.stderr == line + "\n", result.output
    return line


@pytest.fixture(scope="module")
def quantized(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("cli-errors") / "tiny-fp8"
    result = runner.invoke(app, ["quantize", "tiny", "--out", str(out)])
    assert result.exit_code == 0, result.output
    return out


@pytest.fixture(scope="module")
def corrupt_header(quantized, tmp_path_factory) -> Path:
    """The quantized checkpoint with its safetensors header JSON overwritten by garbage."""
    bad = tmp_path_factory.mktemp("cli-errors") / "corrupt"
    shutil.copytree(quantized, bad)
    shard = bad / "model.safetensors"
    data = shard.read_bytes()
    shard.write_bytes(data[:8] + b"{not json" + data[17:])
    return bad


@pytest.mark.parametrize(
    ("device", "expected"),
    [
        ("bogus", "--device 'bogus' is not a torch device"),
        ("cuda:-1", "--device 'cuda:-1' is not a torch device"),
        ("meta", "--device meta holds no data"),
    ],
)
def test_quantize_refuses_unusable_device(tmp_path, device, expected):
    line = _early_error("quantize", "tiny", "--out", tmp_path / "x", "--device", device)
    assert expected in line
    assert not (tmp_path / "x").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_cuda_device_without_cuda(tmp_path):
    line = _early_error("quantize", "tiny", "--out", tmp_path / "x", "--device", "cuda")
    assert "torch sees no cuda device" in line
    assert "torch sees no cuda device" in _early_error("eval", "tiny", "--device", "cuda")


def test_cuda_index_past_the_device_count(tmp_path, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    line = _early_error("quantize", "tiny", "--out", tmp_path / "x", "--device", "cuda:3")
    assert "--device 'cuda:3': this machine has 1 cuda device(s)" in line


def _unwritable_dir(tmp_path: Path) -> Path:
    """A directory in which creating a subdirectory fails with PermissionError."""
    if os.geteuid() != 0:
        ro = tmp_path / "ro"
        ro.mkdir()
        ro.chmod(0o555)
        return ro
    if Path("/sys/kernel").is_dir():
        return Path("/sys")  # sysfs refuses mkdir even to root
    pytest.skip("running as root without sysfs: no unwritable directory to test with")


def test_quantize_into_unwritable_directory(tmp_path):
    unwritable = _unwritable_dir(tmp_path)
    line = _error("quantize", "tiny", "--out", unwritable / "floatxq-test" / "x")
    assert str(unwritable) in line


def test_quantize_under_a_regular_file(tmp_path):
    (tmp_path / "file").write_text("not a directory")
    line = _error("quantize", "tiny", "--out", tmp_path / "file" / "x")
    assert str(tmp_path / "file") in line


def test_quantize_existing_out_refused_before_work(quantized):
    before = sorted(p.name for p in quantized.iterdir())
    line = _early_error("quantize", "tiny", "--out", quantized)
    assert f"--out {quantized} already exists" in line and "--overwrite" in line
    assert sorted(p.name for p in quantized.iterdir()) == before


def test_quantize_unknown_layout_refused_before_work(tmp_path):
    line = _early_error("quantize", "tiny", "--out", tmp_path / "x", "--layout", "bogus")
    assert "unknown checkpoint layout 'bogus'" in line


def test_quantize_an_already_quantized_model(quantized, tmp_path):
    line = _error("quantize", quantized, "--out", tmp_path / "again")
    assert f"{quantized} is already quantized" in line
    assert not (tmp_path / "again").exists()


def test_inspect_and_eval_of_a_corrupt_header(corrupt_header):
    shard = corrupt_header / "model.safetensors"
    assert str(shard) in _error("inspect", corrupt_header)
    assert str(shard) in _error("eval", corrupt_header, "--windows", "1")


def test_eval_seq_len_past_the_model_positions(tmp_path, monkeypatch):
    import transformers

    import floatxq.lifecycle.evaluate

    limit = json.loads((TINY_LLAMA_DIR / "config.json").read_text())["max_position_embeddings"]
    line = _early_error("eval", "tiny", "--seq-len", str(limit + 1), "--windows", "1")
    assert f"--seq-len {limit + 1}" in line and f"max_position_embeddings ({limit})" in line
    # the limit itself is accepted; a small model and stand-in windows (the held-out split is
    # parsed from the stdlib on first use, seconds) keep this fast
    config = transformers.LlamaConfig(
        vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=16,
    )  # fmt: skip
    transformers.LlamaForCausalLM(config).save_pretrained(tmp_path / "small")
    assert "max_position_embeddings (16)" in _early_error(
        "eval", tmp_path / "small", "--seq-len", "17", "--windows", "1"
    )

    def windows(model_dir, *, vocab_size, seq_len, max_windows):
        return torch.arange(max_windows * seq_len).reshape(max_windows, seq_len) % vocab_size

    monkeypatch.setattr(floatxq.lifecycle.evaluate, "heldout_windows", windows)
    result = _invoke("eval", tmp_path / "small", "--seq-len", "16", "--windows", "2")
    assert result.exit_code == 0, result.output
    assert re.search(r"tokens:\s+30\n", result.output), result.output  # 2 windows of 15 targets


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (("--windows", "0"), "--windows must be at least 1, got 0"),
        (("--seq-len", "1"), "--seq-len must be at least 2, got 1"),
        (("--seq-len", "-5"), "--seq-len must be at least 2, got -5"),
    ],
)
def test_eval_argument_ranges(args, expected):
    assert expected in _early_error("eval", "tiny", *args)


@pytest.mark.parametrize("size", ["-3", "0", "17"])
def test_recipes_size_must_be_a_positive_multiple_of_16(size):
    assert f"--size must be a positive multiple of 16, got {size}" in _early_error(
        "recipes", "--size", size
    )


def test_recipes_unknown_source():
    line = _early_error("recipes", "--source", "bogus")
    assert "--source 'bogus' is neither normal, student_t3, outliers nor a checkpoint" in line


def test_recipes_tensor_needs_a_checkpoint_source():
    line = _early_error("recipes", "--source", "normal", "--tensor", "w")
    assert "--tensor" in line and "'normal'" in line


def test_recipes_missing_tensor_in_checkpoint(quantized):
    line = _error("recipes", "--source", quantized, "--tensor", "no.such.weight")
    assert f"no tensor 'no.such.weight' in {quantized}" in line


def test_recipes_png_paths_checked_before_work(tmp_path):
    line = _early_error("recipes", "--size", "16", "--png", "/nonexistent/x.png")
    assert "the directory /nonexistent does not exist" in line
    line = _early_error("recipes", "--size", "16", "--png", tmp_path)
    assert f"--png {tmp_path} is a directory" in line


def test_recipes_png_without_suffix_is_written_where_asked(tmp_path):
    chart = tmp_path / "chart"
    result = runner.invoke(app, ["recipes", "--size", "16", "--png", str(chart)])
    assert result.exit_code == 0, result.output
    assert chart.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not (tmp_path / "chart.png").exists()


def test_demo_checks_arguments_before_any_work(tmp_path, monkeypatch):
    import floatxq.demo

    def no_work(**kwargs):
        raise AssertionError("run_demo ran")

    monkeypatch.setattr(floatxq.demo, "run_demo", no_work)
    assert "--windows must be at least 1, got 0" in _early_error("demo", "--windows", "0")
    line = _early_error("demo", "--png", tmp_path / "missing" / "demo.png")
    assert f"the directory {tmp_path / 'missing'} does not exist" in line
