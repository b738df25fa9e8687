"""The embedded tiny Llama: stdlib corpus, byte tokens, architecture, loader, training script.

Passes whether or not the trained weights exist yet (the test of the shipped weights skips).
"""

import importlib.util
import json
import math
import sysconfig
import textwrap
from pathlib import Path

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st
from safetensors import safe_open
from transformers import LlamaForCausalLM

from floatxq.testing import unchecked
from floatxq.tiny import (
    SEPARATOR_ID,
    SPLITS,
    TINY_LLAMA_DIR,
    TINY_LLAMA_TRAIN_COMMAND,
    VOCAB_SIZE,
    calibration_samples,
    decode_tokens,
    encode_text,
    load_tiny_llama,
    perplexity,
    split_of,
    stdlib_corpus,
    stdlib_documents,
    stdlib_tokens,
    tiny_llama_config,
    token_windows,
)

REPO = Path(__file__).resolve().parents[1]


# ----------------------------------------------------------------------------------------------
# Corpus and splits
# ----------------------------------------------------------------------------------------------


def test_splits_partition_the_modules():
    documents = stdlib_documents()
    names = [d.name for d in documents]
    assert names == sorted(names) and len(set(names)) == len(names)
    by_split = {s: {d.name for d in stdlib_documents(s)} for s in SPLITS}
    for i, a in enumerate(SPLITS):
        for b in SPLITS[i + 1 :]:
            assert not by_split[a] & by_split[b], (a, b)
    assert set().union(*by_split.values()) == set(names)
    assert all(d.split == split_of(d.name) for d in documents)


def test_every_split_is_non_empty_and_train_is_largest():
    sizes = {s: len(stdlib_corpus(s)) for s in SPLITS}
    counts = {s: len(stdlib_documents(s)) for s in SPLITS}
    assert all(counts[s] > 0 and sizes[s] > 0 for s in SPLITS), (counts, sizes)
    assert sizes["train"] > sizes["calibration"] + sizes["evaluation"]
    assert counts["train"] > counts["calibration"] + counts["evaluation"]
    # enough text for 64 calibration samples of 512 tokens and 256 evaluation windows of 256
    assert sizes["calibration"] >= 64 * 512 and sizes["evaluation"] >= 256 * 256


def test_split_assignment_is_pinned_to_the_module_name():
    # sha256 of the dotted name: these never move between Python versions or runs
    assert [split_of(n) for n in ("json", "os.path", "typing", "email")] == [
        "train",
        "evaluation",
        "train",
        "train",
    ]
    buckets = [split_of(f"module{i}") for i in range(3000)]
    shares = [buckets.count(s) / len(buckets) for s in SPLITS]
    assert shares[0] == pytest.approx(0.8, abs=0.03)
    assert shares[1] == pytest.approx(0.1, abs=0.02) and shares[2] == pytest.approx(0.1, abs=0.02)


def test_reparsing_the_stdlib_gives_the_same_documents():
    stdlib = sysconfig.get_paths()["stdlib"]
    again = stdlib_documents(root=stdlib.rstrip("/") + "/")  # another cache key: a fresh parse
    assert again == stdlib_documents()
    assert again is not stdlib_documents()


def test_corpus_layout_separator_before_each_document():
    for split in SPLITS:
        data = stdlib_corpus(split)
        documents = stdlib_documents(split)
        assert data.count(bytes([SEPARATOR_ID])) == len(documents)
        assert data == b"".join(b"\x00" + d.text.encode("utf-8") for d in documents)
        assert stdlib_tokens(split).tolist()[:64] == list(data[:64])


def test_the_corpus_is_documentation_without_tests_or_idle():
    names = {d.name for d in stdlib_documents()}
    assert {"json", "collections", "pydoc_data.topics"} <= names
    assert not any(
        part in {"test", "tests", "idlelib", "lib2to3", "turtledemo"}
        for n in names
        for part in n.split(".")
    )
    json_doc = next(d for d in stdlib_documents() if d.name == "json")
    assert json_doc.text.startswith("JSON (JavaScript Object Notation)")


def _write(root: Path, relative: str, source: str | bytes) -> None:
    path = root / relative
    path.parent.mkdir(parents=True, exist_ok=True)
    if isinstance(source, bytes):
        path.write_bytes(source)
    else:
        path.write_text(textwrap.dedent(source), encoding="utf-8")


def test_parsing_rules_on_a_fake_stdlib(tmp_path):
    good = '''
        """Module doc."""
        import sys
        if sys:
            class A:
                """Class doc.

                Detail.
                    Indented detail.
                """
                def f(self):
                    """Method doc."""
                    def inner():
                        """Inner doc."""
        async def g():
            """Async doc with a NUL: \\x00 gone."""
        x = lambda: None
        '''
    _write(tmp_path, "good.py", good)
    _write(tmp_path, "pkg/__init__.py", '"""Package doc."""\n')
    _write(tmp_path, "pkg/mod.py", '"""Submodule doc."""\n')
    _write(tmp_path, "pkg/nodocs.py", "x = 1\n")
    _write(tmp_path, "pydoc_data/topics.py", "topics = {'a': 'Topic A.', 'b': 'Topic B.'}\n")
    _write(tmp_path, "broken.py", '"""Never seen."""\ndef (:\n')
    _write(tmp_path, "latin.py", b'# -*- coding: latin-1 -*-\n"""caf\xe9"""\n')
    for skipped in (
        "test/test_x.py",
        "pkg/tests/t.py",
        "idlelib/a.py",
        "lib2to3/b.py",
        "turtledemo/c.py",
        "site-packages/d.py",
        "lib-dynload/e.py",
        "not-a-module.py",
    ):
        _write(tmp_path, skipped, '"""Skipped."""\n')

    documents = stdlib_documents(root=tmp_path)
    texts = {d.name: d.text for d in documents}
    assert list(texts) == ["good", "latin", "pkg", "pkg.mod", "pydoc_data.topics"]
    assert texts["good"] == (
        "Module doc.\n\nClass doc.\n\nDetail.\n    Indented detail.\n\n"
        "Method doc.\n\nInner doc.\n\nAsync doc with a NUL:  gone."
    )
    assert texts["latin"] == "café"
    assert texts["pydoc_data.topics"] == "Topic A.\n\nTopic B."
    assert all(d.split == split_of(d.name) for d in documents)
    corpus = b"".join(stdlib_corpus(s, root=tmp_path) for s in SPLITS)
    assert sorted(corpus.split(b"\x00")[1:]) == sorted(t.encode() for t in texts.values())


def test_unknown_split_and_missing_root_are_rejected(tmp_path):
    with pytest.raises(ValueError, match="split must be one of"):
        stdlib_corpus("validation")
    with pytest.raises(ValueError, match="split must be one of"):
        token_windows("test", seq_len=8)
    with pytest.raises(FileNotFoundError, match="not a directory"):
        stdlib_documents(root=tmp_path / "absent")


# ----------------------------------------------------------------------------------------------
# Byte tokens, windows, calibration samples
# ----------------------------------------------------------------------------------------------


@settings(deadline=None)
@given(st.text())
@example("")
@example("\x00")
@example("déjà vu 😀\n\t")
def test_encode_decode_round_trip(text):
    ids = encode_text(text)
    assert ids.dtype == torch.int64 and ids.ndim == 1
    assert ids.tolist() == list(text.encode("utf-8"))
    assert decode_tokens(ids) == text


def test_decode_replaces_invalid_utf8_and_rejects_out_of_range_ids():
    assert decode_tokens(torch.tensor([104, 0xC3])) == "h\ufffd"
    assert decode_tokens(torch.tensor([], dtype=torch.int64)) == ""
    with pytest.raises(ValueError, match=r"0\.\.255"):
        decode_tokens(torch.tensor([65, 256]))
    with pytest.raises(ValueError, match=r"0\.\.255"):
        decode_tokens(torch.tensor([-1]))
    with pytest.raises(TypeError, match="must be a str"):
        unchecked(encode_text)(b"bytes")


@pytest.mark.parametrize("split", SPLITS)
@pytest.mark.parametrize("seq_len", [2, 257])
def test_windows_are_consecutive_slices_of_the_stream(split, seq_len):
    tokens = stdlib_tokens(split)
    windows = token_windows(split, seq_len=seq_len)
    assert windows.dtype == torch.int64 and windows.shape == (tokens.numel() // seq_len, seq_len)
    assert torch.equal(windows.flatten(), tokens[: windows.numel()])
    assert 0 <= int(windows.min()) and int(windows.max()) < VOCAB_SIZE


def test_max_windows_spreads_a_subset_over_the_split():
    full = token_windows("evaluation", seq_len=256)
    subset = token_windows("evaluation", seq_len=256, max_windows=10)
    assert subset.shape == (10, 256)
    keep = [(i * full.shape[0]) // 10 for i in range(10)]
    assert torch.equal(subset, full[keep])
    assert keep[-1] > 0.85 * full.shape[0]  # reaches the end of the split
    assert torch.equal(token_windows("evaluation", seq_len=256, max_windows=10**9), full)
    with pytest.raises(ValueError, match="seq_len"):
        token_windows("evaluation", seq_len=1)
    with pytest.raises(ValueError, match="max_windows"):
        token_windows("evaluation", seq_len=8, max_windows=0)


def test_calibration_samples_come_from_the_calibration_split_only():
    samples = calibration_samples(num_samples=16, seq_len=128)
    assert len(samples) == 16
    assert all(s.shape == (128,) and s.dtype == torch.int64 for s in samples)
    calibration = token_windows("calibration", seq_len=128)
    rows = {tuple(r) for r in calibration.tolist()}
    assert all(tuple(s.tolist()) in rows for s in samples)
    assert len({tuple(s.tolist()) for s in samples}) == 16
    available = len(stdlib_corpus("calibration")) // 512
    with pytest.raises(ValueError, match="fewer than num_samples"):
        calibration_samples(num_samples=available + 1, seq_len=512)


# ----------------------------------------------------------------------------------------------
# Architecture, perplexity, loader
# ----------------------------------------------------------------------------------------------


def test_config_linears_are_multiples_of_128_and_size_is_5_to_10m():
    config = tiny_llama_config()
    assert config.vocab_size == VOCAB_SIZE and not config.tie_word_embeddings
    assert config.bos_token_id == config.eos_token_id == SEPARATOR_ID
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    linears = {n: m for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    assert len(linears) == 7 * config.num_hidden_layers + 1  # q k v o gate up down, lm_head
    for name, linear in linears.items():
        assert linear.in_features % 128 == 0 and linear.out_features % 128 == 0, name
        assert linear.bias is None, name
    assert model.lm_head.weight.data_ptr() != model.model.embed_tokens.weight.data_ptr()
    parameters = sum(p.numel() for p in model.parameters())
    assert 5_000_000 <= parameters <= 10_000_000
    assert parameters * 2 <= 25 * 2**20  # bfloat16 file under 25 MB


class _FixedLM(torch.nn.Module):
    """A causal LM whose logits are the same table row for every position: known perplexity."""

    def __init__(self, log_probs: torch.Tensor):
        super().__init__()
        self.log_probs = torch.nn.Parameter(log_probs)

    def forward(self, input_ids, use_cache=False):
        del use_cache
        logits = self.log_probs.expand(*input_ids.shape, -1)
        return type("Output", (), {"logits": logits})()


FP32_NLL_TOLERANCE = (VOCAB_SIZE + 16) * 2.0**-24
"""How far ``perplexity``'s FP32 log-softmax may move one token's NLL (an absolute error in nats,
hence the relative error of ``exp(mean NLL)``): the sum of the ``VOCAB_SIZE`` exponentials may
lose up to one FP32 rounding (2**-24 relative) per addition, and the logits, the exponentials,
the log and the subtractions a few more. About 1.6e-5; the summation order (and so the actual
error, ~1e-6 measured) depends on the CPU's vector width and thread count."""


def test_perplexity_of_known_distributions():
    uniform = _FixedLM(torch.zeros(VOCAB_SIZE))
    windows = torch.randint(0, VOCAB_SIZE, (5, 9), generator=torch.Generator().manual_seed(0))
    # zero logits: exp(0) = 1 exactly and the sum 256 is exact, so only ln 256 rounds (2**-22)
    assert perplexity(uniform, windows, batch_size=2) == pytest.approx(VOCAB_SIZE, rel=1e-6)

    # p(token 7) = 1/2, the rest share 1/2: NLL of 7 is ln 2, of others ln(2 * 255)
    probs = torch.full((VOCAB_SIZE,), 0.5 / (VOCAB_SIZE - 1))
    probs[7] = 0.5
    skewed = _FixedLM(probs.log())
    windows = torch.tensor([[3, 7, 7, 7], [7, 7, 1, 7]])  # predicted: 7 7 7 | 7 1 7
    expected = math.exp((5 * math.log(2) + math.log(2 * (VOCAB_SIZE - 1))) / 6)
    # any counting mistake moves the result by far more than the FP32 tolerance: predicting the
    # first token of each window too, or dropping the last prediction, changes it by > 10%
    wrong = math.exp((6 * math.log(2) + 2 * math.log(2 * (VOCAB_SIZE - 1))) / 8)
    assert abs(wrong / expected - 1) > 1000 * FP32_NLL_TOLERANCE
    for batch_size in (1, 2, 64):
        got = perplexity(skewed, windows, batch_size=batch_size)
        assert got == pytest.approx(expected, rel=FP32_NLL_TOLERANCE)


def test_perplexity_rejects_bad_windows():
    model = _FixedLM(torch.zeros(VOCAB_SIZE))
    with pytest.raises(ValueError, match="length ≥ 2"):
        unchecked(perplexity)(model, torch.zeros(3, 1, dtype=torch.int64))
    with pytest.raises(ValueError, match="length ≥ 2"):
        unchecked(perplexity)(model, torch.zeros(0, 4, dtype=torch.int64))
    with pytest.raises(ValueError, match="batch_size"):
        perplexity(model, torch.zeros(2, 4, dtype=torch.int64), batch_size=0)


def test_missing_weights_name_the_path_and_the_command(tmp_path):
    missing = tmp_path / "no_model_here"
    with pytest.raises(FileNotFoundError) as info:
        load_tiny_llama(missing)
    message = str(info.value)
    assert str(missing) in message and TINY_LLAMA_TRAIN_COMMAND in message
    assert "config.json" in message and "model.safetensors" in message
    assert TINY_LLAMA_DIR == REPO / "floatxq" / "tiny" / "tiny_llama"


# ----------------------------------------------------------------------------------------------
# The training script and the shipped weights
# ----------------------------------------------------------------------------------------------


def _training_script():
    spec = importlib.util.spec_from_file_location(
        "train_tiny_llama", REPO / "examples" / "train_tiny_llama.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_training_smoke_run_writes_a_loadable_bfloat16_model(tmp_path, capsys):
    script = _training_script()
    out = tmp_path / "tiny"
    argv = ["--smoke", "--device", "cpu", "--out", str(out)]
    result = script.main(argv)
    assert result.steps == 3 and result.out == out
    assert 5_000_000 <= result.parameters <= 10_000_000
    assert math.isfinite(result.perplexity) and result.perplexity < VOCAB_SIZE  # learnt bytes
    assert "final eval perplexity:" in capsys.readouterr().out

    with safe_open(out / "model.safetensors", framework="pt") as f:
        names = list(f.keys())
        assert {f.get_tensor(n).dtype for n in names} == {torch.bfloat16}
    assert "lm_head.weight" in names and "model.embed_tokens.weight" in names
    record = json.loads((out / "training.json").read_text())
    assert record["eval_perplexity"] == result.perplexity and record["steps"] == 3

    model = load_tiny_llama(out)
    assert not model.training and model.config.to_dict()["hidden_size"] == 256
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    windows = token_windows("evaluation", seq_len=256, max_windows=4)
    assert perplexity(model, windows) == pytest.approx(result.perplexity, rel=1e-5)

    # with validation: the best calibration-split step is kept; the directory is replaced
    flags = "--seed 1 --steps 4 --batch-size 2 --warmup 1 --val-every 2 --val-windows 2"
    again = script.main(
        [*flags.split(), "--eval-windows", "4", "--device", "cpu", "--out", str(out)]
    )
    assert again.perplexity != result.perplexity
    record = json.loads((out / "training.json").read_text())
    assert [h["step"] for h in record["validation"]] == [2, 4]
    best = min(record["validation"], key=lambda h: h["calibration_perplexity"])
    assert record["selected_step"] == best["step"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tiny"]  # no temporary leftovers


def test_the_shipped_weights_match_the_config():
    # the weights ship with the package (pyproject package-data); their absence is a bug
    assert (TINY_LLAMA_DIR / "model.safetensors").is_file(), TINY_LLAMA_TRAIN_COMMAND
    assert (TINY_LLAMA_DIR / "model.safetensors").stat().st_size <= 25 * 10**6
    model = load_tiny_llama()
    expected = tiny_llama_config().to_dict()
    for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "vocab_size"):
        assert model.config.to_dict()[key] == expected[key], key
    windows = token_windows("evaluation", seq_len=256, max_windows=8)
    assert perplexity(model, windows) < 8.0  # trained: far below the 256 of a uniform guess
