"""Models by name: ``"tiny"``, local paths and Hugging Face Hub ids (from a pre-filled local Hub
cache with ``HF_HUB_OFFLINE=1``: nothing is downloaded here)."""

import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

import floatxq
from floatxq.cli import app
from floatxq.interop.checkpoint import CheckpointError
from floatxq.lifecycle import resolve_model
from floatxq.tiny import TINY_LLAMA_DIR

FIXTURE = Path(__file__).parent / "fixtures" / "tiny_random_llama"
COMMIT = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture
def hub(tmp_path, monkeypatch) -> Path:
    """A Hub cache holding ``acme/tiny-llama`` (main = COMMIT) in huggingface_hub's layout."""
    cache = tmp_path / "hub"
    repo = cache / "models--acme--tiny-llama"
    shutil.copytree(FIXTURE, repo / "snapshots" / COMMIT)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return cache


def test_tiny_is_the_built_in_llama():
    qm = floatxq.load("tiny")
    assert qm.source == TINY_LLAMA_DIR
    assert type(qm.model).__name__ == "LlamaForCausalLM"
    assert resolve_model("tiny") == TINY_LLAMA_DIR


def test_a_hub_id_is_read_from_the_local_cache_offline(hub):
    snapshot = hub / "models--acme--tiny-llama" / "snapshots" / COMMIT
    assert resolve_model("acme/tiny-llama") == snapshot
    assert resolve_model("acme/tiny-llama", revision=COMMIT) == snapshot
    qm = floatxq.load("acme/tiny-llama", quantize_config=floatxq.FP8Config())
    assert qm.source == snapshot
    assert qm.quantize(progress=False).quantized


def test_a_hub_id_not_in_the_cache_offline_names_the_id_and_the_cache(hub):
    with pytest.raises(FileNotFoundError, match=rf"'acme/other'.*Hub cache {hub}.*HF_HUB_OFFLINE"):
        floatxq.load("acme/other")
    with pytest.raises(FileNotFoundError, match=r"'acme/tiny-llama' at revision 'v2'"):
        floatxq.load("acme/tiny-llama", revision="v2")


def test_an_invalid_hub_id_is_a_value_error(hub):
    with pytest.raises(ValueError, match=r"'acme/a\.\.b' is not a Hub model id"):
        resolve_model("acme/a..b")


def test_a_missing_path_that_is_no_hub_id(hub, tmp_path):
    with pytest.raises(CheckpointError, match="not a model directory .*Hub model id 'org/name'"):
        floatxq.load(tmp_path / "nowhere")  # a Path is always local
    with pytest.raises(CheckpointError, match="not a model directory"):
        floatxq.load("no/such/dir")


def test_a_local_directory_wins_over_a_hub_id(hub, tmp_path, monkeypatch):
    local = tmp_path / "acme" / "tiny-llama"
    shutil.copytree(FIXTURE, local)
    monkeypatch.chdir(tmp_path)
    assert resolve_model("acme/tiny-llama") == Path("acme/tiny-llama")
    with pytest.raises(ValueError, match="revision='main' applies to Hub models"):
        resolve_model("acme/tiny-llama", revision="main")


def test_the_cli_quantizes_a_hub_id_from_the_cache(hub, tmp_path):
    out = tmp_path / "out"
    result = CliRunner().invoke(app, ["quantize", "acme/tiny-llama", "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert floatxq.load(out).quantized
    missing = CliRunner().invoke(app, ["quantize", "acme/none", "--out", str(tmp_path / "n")])
    assert missing.exit_code == 2 and "'acme/none' is neither a local directory" in missing.output
