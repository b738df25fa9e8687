"""A user's first hour with the ``floatxq`` command: --version, --quiet, --json, eval's reference
perplexity, progress bar, --text and --tasks, a fast --help (no torch at import), the help text,
and the reports' dicts and tables."""

import importlib.metadata
import json
import shutil
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

import floatxq
from floatxq import cli
from floatxq.cli import app
from floatxq.tiny import TINY_LLAMA_DIR

runner = CliRunner()


def _invoke(*args):
    return runner.invoke(app, [str(a) for a in args])


def _ok(*args):
    result = _invoke(*args)
    assert result.exit_code == 0, result.output
    return result


def _only_error(*args) -> str:
    """A user error decided before any work: exit 2, one ``error:`` line, nothing else."""
    result = _invoke(*args)
    assert result.exit_code == 2, result.output
    assert result.stdout == "", result.stdout
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    return lines[0]


def _fresh_python(code: str) -> str:
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    )
    return done.stdout.strip()


# --- --version, --help, the lazy package ----------------------------------------------------


def test_version_prints_the_installed_version():
    result = _ok("--version")
    assert result.stdout == f"floatxq {floatxq.__version__}\n"
    try:
        installed = importlib.metadata.version("floatxq")
    except (importlib.metadata.PackageNotFoundError, StopIteration):
        pytest.skip("floatxq runs from a source tree here (not installed): no metadata to compare")
    assert floatxq.__version__ == installed


def test_help_describes_what_floatxq_does_now():
    text = " ".join(_ok("--help").stdout.split())
    assert "FP8 weight-only" not in text
    for word in ("FP8", "NVFP4", "GPTQ", "W4A16", "W4A-FP8", "W4A-NVFP4", "--version", "--quiet"):
        assert word in text, word
    for command in ("quantize", "inspect", "eval", "recipes", "demo"):
        assert command in text, command


def test_import_and_help_load_neither_torch_nor_transformers():
    """What makes ``floatxq --help`` fast: the console script's imports stay off torch."""
    heavy = "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))"
    assert _fresh_python(f"import sys, floatxq\n{heavy}") == "[]"
    assert _fresh_python(f"import sys, floatxq.cli\n{heavy}") == "[]"
    help_run = (
        "import sys, floatxq.cli\nsys.argv = ['floatxq', '--help']\n"
        "try:\n    floatxq.cli.main()\nexcept SystemExit:\n    pass\n" + heavy
    )
    assert _fresh_python(help_run).endswith("[]")
    version_run = help_run.replace("'--help'", "'--version'")
    assert _fresh_python(version_run).splitlines() == [f"floatxq {floatxq.__version__}", "[]"]


def test_every_public_name_imports_from_the_lazy_package():
    out = _fresh_python(
        "import floatxq\n"
        "print(floatxq.nvfp4.report.recipes_report is floatxq.recipes_report)\n"  # subpackages
        "for name in floatxq.__all__:\n"
        "    exec(f'from floatxq import {name}')\n"
        "print(len(floatxq.__all__), set(floatxq.__all__) <= set(dir(floatxq)))"
    )
    assert out.splitlines() == ["True", f"{len(floatxq.__all__)} True"]
    with pytest.raises(AttributeError, match="no attribute 'no_such_name'"):
        _ = floatxq.no_such_name


# --- --quiet ------------------------------------------------------------------------------------


def test_quiet_silences_the_eval_progress_bar_but_not_results():
    loud = _ok("eval", "tiny", "--windows", "2", "--seq-len", "32")
    assert "window" in loud.stderr  # tqdm's bar, on stderr
    assert not cli._quiet()
    quiet = _ok("--quiet", "eval", "tiny", "--windows", "2", "--seq-len", "32")
    assert cli._quiet()
    assert quiet.stderr == "" and quiet.stdout == loud.stdout
    _ok("eval", "tiny", "--windows", "1", "--seq-len", "32")
    assert not cli._quiet()  # reset by each invocation


def test_quiet_keeps_error_lines():
    assert _only_error("-q", "eval", "tiny", "--windows", "0").startswith("error: --windows")


# --- --json -------------------------------------------------------------------------------------


def test_inspect_json_is_one_object_of_the_report_fields():
    from floatxq.interop.inspect import inspect_checkpoint

    out = json.loads(_ok("inspect", TINY_LLAMA_DIR, "--json").stdout)
    report = inspect_checkpoint(TINY_LLAMA_DIR)
    assert set(report._fields) <= set(out)
    assert out["layout"] == report.layout and out["tensors"] == report.tensors
    assert out["quantized_layers"] == list(report.quantized_layers) and out["method"] is None
    assert out["layout_description"] and out["convention_description"]


def test_eval_json_reports_the_reference_perplexity():
    out = json.loads(
        _ok(
            "eval", "tiny", "--reference", "tiny", "--windows", "2", "--seq-len", "32", "--json"
        ).stdout
    )
    assert out["tokens"] == 2 * 31 and out["windows"] == 2 and out["model"] == "tiny"
    assert out["reference_perplexity"] == pytest.approx(out["perplexity"], rel=1e-6)
    assert out["kl_divergence"] == pytest.approx(0.0, abs=1e-6) and out["top1_agreement"] == 1.0
    table = _ok("eval", "tiny", "--reference", "tiny", "--windows", "2", "--seq-len", "32")
    assert f"reference:   perplexity {out['reference_perplexity']:.4f} (tiny)" in table.stdout


def test_reference_perplexity_is_the_reference_models_own():
    from floatxq.lifecycle.evaluate import evaluate_lm
    from floatxq.tiny import token_windows

    model = floatxq.load(str(TINY_LLAMA_DIR)).model
    other = floatxq.load(str(TINY_LLAMA_DIR)).model
    with torch.no_grad():
        for p in other.parameters():
            p.mul_(0.9)
    ids = token_windows("evaluation", seq_len=32, max_windows=3)
    steps = []
    report = evaluate_lm(model, ids, reference=other, batch_size=2, progress=steps.append)
    alone = evaluate_lm(other, ids, batch_size=2)
    assert report.reference_perplexity == pytest.approx(alone.perplexity, rel=1e-5)
    assert report.reference_perplexity != pytest.approx(report.perplexity, rel=1e-3)
    assert steps == [2, 1, 2, 1]  # the reference's batches, then the model's
    assert evaluate_lm(model, ids).to_dict()["reference_perplexity"] is None
    assert json.loads(json.dumps(report.to_dict())) == report._asdict()


def test_recipes_json_table_and_dict():
    out = json.loads(_ok("recipes", "--size", "32", "--json").stdout)
    assert [r["recipe"] for r in out["rows"]] == list(floatxq.DEFAULT_REPORT_RECIPES)
    assert out["shape"] == [32, 32] and out["blocks"] == 64 and out["source"] == "normal"
    report = floatxq.recipes_report(torch.randn(4, 32, generator=torch.Generator().manual_seed(0)))
    lines = str(report).splitlines()
    assert lines[0].startswith("| recipe | rel MSE |") and len(lines) == 2 + len(report.rows)
    assert report.table() == str(report)
    assert json.loads(json.dumps(report.to_dict()))["rows"][-1]["optimal_share"] == 1.0
    table = _ok("recipes", "--size", "32").stdout
    assert "| least_squares_grid |" in table and "| exhaustive |" in table


def test_gptq_reports_to_dict_carry_per_module_losses():
    from floatxq.lifecycle.gptq import GPTQModuleReport, GPTQRunReport

    module = GPTQModuleReport("model.layers.0.mlp.up_proj", 0, 4, 128, 500, 0.125, 0.01, 0.5)
    run = GPTQRunReport((module,), 1, 8, 0, 500, 1.5, types.MappingProxyType({module.name: 2.0}))
    out = json.loads(json.dumps(run.to_dict()))
    assert out["modules"] == [module._asdict()] and out["modules"][0]["loss"] == 0.125
    assert out["activation_scales"] == {module.name: 2.0} and out["samples"] == 8
    assert GPTQRunReport((), 0, 0, 0, 0, 0.0).to_dict()["activation_scales"] == {}


# --- eval --text ----------------------------------------------------------------------------------


def test_eval_text_reads_the_users_file(tmp_path):
    from floatxq.lifecycle.evaluate import evaluate_lm, text_windows

    text = "def add(a, b):\n    return a + b\n" * 20
    path = tmp_path / "mine.txt"
    path.write_text(text, encoding="utf-8")
    out = json.loads(
        _ok("eval", "tiny", "--text", path, "--seq-len", "64", "--windows", "3", "--json").stdout
    )
    ids = text_windows(text, None, vocab_size=256, seq_len=64, max_windows=3)
    assert ids.shape == (3, 64) and ids[0].tolist() == list(text.encode()[:64])
    expected = evaluate_lm(floatxq.load(str(TINY_LLAMA_DIR)).model, ids)
    assert out["text"] == str(path) and out["tokens"] == 3 * 63
    assert out["perplexity"] == pytest.approx(expected.perplexity, rel=1e-5)


def test_eval_text_errors(tmp_path):
    missing = _only_error("eval", "tiny", "--text", tmp_path / "none.txt")
    assert missing.startswith("error: --text") and "none.txt" in missing
    (tmp_path / "bin.txt").write_bytes(b"\xff\xfe\x00bad")
    assert "UTF-8" in _only_error("eval", "tiny", "--text", tmp_path / "bin.txt")
    (tmp_path / "short.txt").write_text("too short")
    result = _invoke("eval", "tiny", "--text", tmp_path / "short.txt", "--seq-len", "64")
    assert result.exit_code == 2
    assert "error: eval: the text gives 9 tokens, fewer than one window of 64" in result.stderr


# --- eval --tasks (lm-eval) -----------------------------------------------------------------------


def test_tasks_without_lm_eval_name_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "lm_eval", None)  # `import lm_eval` raises ImportError
    line = _only_error("eval", "tiny", "--tasks", "hellaswag")
    assert f"pip install 'floatxq[{cli.LM_EVAL_EXTRA}]'" in line
    assert cli.LM_EVAL_EXTRA == "lm-eval"
    assert "names no task" in _only_error("eval", "tiny", "--tasks", " , ")


def test_tasks_run_lm_eval_on_the_loaded_model(monkeypatch):
    """The wiring only (lm-eval is an optional extra): a stand-in ``lm_eval`` records what
    floatxq hands it, the loaded model through ``HFLM`` and the tasks and limit."""
    import transformers

    seen = {}

    class HFLM:
        def __init__(self, pretrained, tokenizer):
            seen.update(pretrained=pretrained, tokenizer=tokenizer)

    def simple_evaluate(model, tasks, limit):
        seen.update(model=model, tasks=tasks, limit=limit)
        return {"results": {"hellaswag": {"alias": "hellaswag", "acc,none": 0.25}}}

    lm_eval = types.ModuleType("lm_eval")
    lm_eval.simple_evaluate = simple_evaluate
    models = types.ModuleType("lm_eval.models")
    huggingface = types.ModuleType("lm_eval.models.huggingface")
    huggingface.HFLM = HFLM
    for name, module in (
        ("lm_eval", lm_eval),
        ("lm_eval.models", models),
        ("lm_eval.models.huggingface", huggingface),
    ):
        monkeypatch.setitem(sys.modules, name, module)
    monkeypatch.setattr(
        transformers.AutoTokenizer, "from_pretrained", lambda path, **kw: f"tokenizer of {path}"
    )
    assert "tokenizer" in _only_error("eval", "tiny", "--tasks", "hellaswag")
    args = ("eval", TINY_LLAMA_DIR, "--windows", "1", "--seq-len", "32")
    result = _ok(*args, "--tasks", "hellaswag, arc_easy", "--limit", "5", "--json")
    assert seen["tasks"] == ["hellaswag", "arc_easy"] and seen["limit"] == 5
    assert isinstance(seen["pretrained"], transformers.PreTrainedModel)
    assert seen["tokenizer"] == f"tokenizer of {TINY_LLAMA_DIR}"
    assert json.loads(result.stdout)["tasks"]["hellaswag"]["acc,none"] == 0.25
    table = _ok(*args, "--tasks", "hellaswag").stdout
    assert "hellaswag" in table and "acc,none" in table and "0.2500" in table


_TASK = """task: floatxq_local_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
"""


def test_tasks_run_the_real_lm_eval_harness_on_a_quantized_model(tmp_path, monkeypatch):
    """lm-eval itself (when installed): HFLM wraps the loaded FP8 model, a local task (no
    download) scores it, and the result reaches --json."""
    pytest.importorskip("lm_eval")
    tokenizers = pytest.importorskip("tokenizers")
    from transformers import PreTrainedTokenizerFast

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    source = tmp_path / "model"
    shutil.copytree(Path(__file__).parent / "fixtures" / "tiny_random_llama", source)
    words = "the cat sat on mat sky one two three four blue red green seven".split()
    vocab = {"[UNK]": 0, "[PAD]": 1, "[EOS]": 2, **{w: i + 3 for i, w in enumerate(words)}}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]", eos_token="[EOS]"
    ).save_pretrained(source)
    qm = floatxq.load(source, quantize_config=floatxq.FP8Config())
    qm.quantize()
    qm.save(tmp_path / "fp8")
    rows = [
        {"question": "the cat sat on the", "choices": ["mat", "sky"], "answer": 0},
        {"question": "one two three", "choices": ["four", "blue"], "answer": 1},
    ]
    data = tmp_path / "tasks" / "data.jsonl"
    data.parent.mkdir()
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "tasks" / "task.yaml").write_text(_TASK.format(data=data))
    args = ["eval", str(tmp_path / "fp8"), "--tasks", "floatxq_local_mc", "--limit", "2"]
    args += ["--include-path", str(tmp_path / "tasks"), "--windows", "1", "--seq-len", "16"]
    result = CliRunner().invoke(app, [*args, "--json"])
    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout.strip().splitlines()[-1])
    task = out["tasks"]["floatxq_local_mc"]
    assert task["sample_len"] == 2 and 0.0 <= task["acc,none"] <= 1.0
