"""``floatxq quantize`` under ``torchrun``: two gloo processes on the CPU share a GPTQ run (in
memory, and offloaded to disk) and write the one-process command's files byte for byte; only the
first process prints."""

import filecmp
import os
import subprocess
import sys
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from floatxq import cli
from floatxq.cli import app

ROOT = Path(__file__).resolve().parents[1]
GPTQ = [
    "--quiet",
    "quantize",
    "tiny",
    "--method",
    "gptq",
    "--group-size",
    "32",
    "--calibration",
    "tiny",
]
GPTQ += ["--samples", "2", "--seq-len", "32", "--batch-size", "1"]


def _env() -> dict[str, str]:
    """One CPU thread in every process (CPU kernels block their work by thread count; torchrun
    sets OMP_NUM_THREADS=1 for more than one process unless it is set): equal threads, equal
    bits. The distributed variables of an enclosing run are dropped."""
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK")}
    env["OMP_NUM_THREADS"] = "1"
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return env


def _cli(args: list[str], processes: int) -> str:
    """The command line's stdout, run alone (``processes`` 1) or under torchrun."""
    launch = [sys.executable]
    if processes > 1:
        launch += ["-m", "torch.distributed.run", "--standalone"]
        launch += ["--nproc-per-node", str(processes)]
    done = subprocess.run(
        [*launch, "-m", "floatxq.cli", *args],
        capture_output=True, text=True, env=_env(), cwd=ROOT, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def _same_files(a: Path, b: Path) -> None:
    names = sorted(p.relative_to(a) for p in a.rglob("*"))
    assert names == sorted(p.relative_to(b) for p in b.rglob("*"))
    for name in names:
        if (a / name).is_file():
            assert filecmp.cmp(a / name, b / name, shallow=False), name


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["memory", "offload", "split-rows"])
def test_two_processes_write_the_one_process_commands_files(tmp_path, kind):
    extra = {"memory": [], "offload": ["--offload", "--device", "cpu"], "split-rows": []}[kind]
    one = _cli([*GPTQ, *extra, "--out", str(tmp_path / "one")], 1)  # cpu: gloo, whatever the host
    split = ["--split-rows"] if kind == "split-rows" else []  # each process solves half the rows
    two = _cli([*GPTQ, *extra, *split, "--out", str(tmp_path / "two")], 2)
    _same_files(tmp_path / "one", tmp_path / "two")
    assert one.count("quantized ") == 1
    assert two.count("quantized ") == 1  # the first process's summary only
    assert two.replace("two", "one").split(" in ")[0] == one.split(" in ")[0]
    assert " by 2 processes -> " in two and " processes" not in one


@pytest.mark.slow
def test_the_processes_share_the_calibration(tmp_path):
    """One calibration batch cannot be dealt to two processes: the run is shared, not repeated."""
    args = [*GPTQ, "--samples", "1", "--out", str(tmp_path / "o")]
    with pytest.raises(AssertionError, match="1 calibration batches cannot be shared by 2"):
        _cli(args, 2)
    assert not (tmp_path / "o").exists()


def test_a_world_size_that_is_no_count_is_refused(tmp_path, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "two")
    result = CliRunner().invoke(app, [*GPTQ, "--out", str(tmp_path / "o")])
    assert result.exit_code == 2
    assert "error: WORLD_SIZE='two' is not a process count" in result.output
    assert not (tmp_path / "o").exists()


def test_one_gpu_for_every_process_is_refused(monkeypatch, capsys):
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(typer.Exit):
        cli._torchrun_group("cuda:1")
    assert (
        "error: --device cuda:1 names one GPU; under torchrun each process"
        in capsys.readouterr().err
    )
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert cli._torchrun_group("cuda:1") == (None, "cuda:1")  # one process: as it was


def test_split_rows_without_torchrun_is_refused(tmp_path):
    result = CliRunner().invoke(app, [*GPTQ, "--split-rows", "--out", str(tmp_path / "o")])
    assert result.exit_code != 0
    assert "split_rows=True splits GPTQ's module solves over a process_group" in result.output
    assert not (tmp_path / "o").exists()
