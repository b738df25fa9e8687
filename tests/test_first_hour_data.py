"""A user's first hour: layouts refused before the work, real calibration data (chunked,
truncated, Hugging Face datasets and their local files), and tokenizer detection."""

import json
import shutil
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

import floatxq
import floatxq.lifecycle.calibration as calibration_module
from floatxq.cli import app
from floatxq.interop.export import export_layout
from floatxq.lifecycle import check_layout, load_calibration_file, prepare_calibration
from floatxq.nn.gptq_linear import GPTQLinear
from floatxq.tiny import encode_text

datasets = pytest.importorskip("datasets")
pq = pytest.importorskip("pyarrow.parquet")

FIXTURE = Path(__file__).parent / "fixtures" / "tiny_random_llama"
LAYOUTS = ("compressed-tensors", "hf", "gptqmodel", "gptq")


def _ids(n: int, start: int = 1) -> torch.Tensor:
    return torch.arange(start, start + n, dtype=torch.int64) % 120 + 1


def _random_ids(count: int, length: int, seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(2, 128, (length,), generator=gen).tolist() for _ in range(count)]


# --------------------------------------------------------------------------------------------
# 1. method x layout x modules, before any work
# --------------------------------------------------------------------------------------------


def _never_read():
    raise AssertionError("the calibration was read, so the layout was not checked first")
    yield  # pragma: no cover


def test_gptq_into_hf_is_refused_before_the_calibration_is_read():
    qm = floatxq.load(FIXTURE, quantize_config=floatxq.GPTQConfig(bits=4, group_size=64))
    with pytest.raises(ValueError, match=r"quantize: layout 'hf' cannot hold module .*GPTQ 4-bit"):
        qm.quantize(_never_read(), layout="hf", progress=False)
    assert not any(isinstance(m, GPTQLinear) for m in qm.model.modules())
    assert not qm.quantized and qm.interrupted is None


@pytest.mark.parametrize(
    ("config", "layout", "message"),
    [
        (floatxq.FP8Config(), "hf", r"row scales\): transformers' fine-grained FP8"),
        (floatxq.FP8Config(format="e5m2"), "compressed-tensors", "float8_e5m2 weights"),
        (floatxq.FP8Config(), "gptq", "it holds GPTQ modules only"),
        (
            floatxq.FP8Config(
                weight_block_size=(32, 32),
                dynamic={r".*down_proj": {"weight_scale_method": "tensor"}},
            ),
            "hf",
            "one weight_block_size for the whole model",
        ),
        (floatxq.FP8Config(dynamic={"-:.*": {}}), "compressed-tensors", "no module would be"),
        (floatxq.GPTQConfig(activation="w4afp8"), "ct", "W4A activation"),
        (
            floatxq.GPTQConfig(bits=4, group_size=64, desc_act=True, act_group_aware=False),
            "ct",
            "desc_act reorders",
        ),
    ],
)
def test_refusals_name_the_module_or_the_reason(config, layout, message):
    model = "tiny" if getattr(config, "activation", None) is not None else FIXTURE
    with pytest.raises(ValueError, match=message):
        check_layout(floatxq.load(model), config, layout)


@pytest.mark.parametrize(
    ("config", "layout"),
    [
        (floatxq.FP8Config(weight_block_size=(32, 32)), "hf"),
        (floatxq.FP8Config(weight_scale_method="tensor"), "transformers"),
        (floatxq.FP8Config(format="e5m2"), "gptqmodel"),
        (floatxq.GPTQConfig(bits=4, group_size=64), "gptq"),
        (floatxq.GPTQConfig(bits=4, group_size=64), "compressed-tensors"),
        (floatxq.GPTQConfig(activation="w4afp8"), None),
    ],
)
def test_accepted_layouts_come_back_canonical(config, layout):
    model = "tiny" if getattr(config, "activation", None) is not None else FIXTURE
    name = check_layout(floatxq.load(model), config, layout)
    assert name == (layout if layout in LAYOUTS else {"transformers": "hf", None: "gptq"}[layout])


@pytest.mark.parametrize(
    "config",
    [
        floatxq.FP8Config(),
        floatxq.FP8Config(weight_scale_method="tensor"),
        floatxq.FP8Config(weight_block_size=(32, 64)),
        floatxq.FP8Config(format="e5m2"),
        floatxq.FP8Config(
            weight_block_size=(32, 32), dynamic={r".*o_proj": {"weight_scale_method": "row"}}
        ),
    ],
    ids=["row", "tensor", "block", "e5m2", "mixed"],
)
def test_the_early_check_agrees_with_the_save_for_fp8(config):
    before = floatxq.load(FIXTURE)
    answers = {}
    for layout in LAYOUTS:
        try:
            check_layout(before, config, layout)
            answers[layout] = True
        except ValueError:
            answers[layout] = False
    qm = floatxq.load(FIXTURE, quantize_config=config).quantize(progress=False)
    for layout in LAYOUTS:
        try:
            export_layout(qm.model, config, layout)
            saved = True
        except (ValueError, TypeError):
            saved = False
        assert answers[layout] == saved, layout
        assert (check_layout(qm, None, layout) == layout) if saved else True


def test_the_early_check_agrees_with_the_save_for_gptq_and_save_remembers_the_layout(tmp_path):
    config = floatxq.GPTQConfig(bits=4, group_size=64)
    qm = floatxq.load(FIXTURE, quantize_config=config)
    accepted = {}
    for layout in LAYOUTS:
        try:
            accepted[layout] = check_layout(qm, None, layout) == layout
        except ValueError:
            accepted[layout] = False
    assert accepted == {"compressed-tensors": True, "hf": False, "gptqmodel": True, "gptq": True}
    qm.quantize(_random_ids(4, 40), layout="gptq", progress=False)
    for layout in LAYOUTS:
        try:
            export_layout(qm.model, config, layout)
            saved = True
        except (ValueError, TypeError):
            saved = False
        assert accepted[layout] == saved, layout
    out = qm.save(tmp_path / "m")  # the layout given to quantize()
    assert json.loads((out / "config.json").read_text())["quantization_config"]["quant_method"] == (
        "gptq"
    )


def test_cli_gptq_into_hf_fails_before_calibration(tmp_path, monkeypatch):
    def boom(*args, **kwargs):
        raise AssertionError("calibration was loaded before the layout check")

    monkeypatch.setattr("floatxq.cli._calibration", boom)
    cal = tmp_path / "cal.txt"
    cal.write_text("x" * 100)
    args = ["quantize", str(FIXTURE), "--method", "gptq", "--group-size", "64"]
    result = CliRunner().invoke(
        app, [*args, "--calibration", str(cal), "--layout", "hf", "--out", str(tmp_path / "o")]
    )
    assert result.exit_code == 2, result.output
    assert "layout 'hf' cannot hold module" in result.output
    assert not (tmp_path / "o").exists()


# --------------------------------------------------------------------------------------------
# 2. real calibration data
# --------------------------------------------------------------------------------------------


def test_refuse_is_the_default_and_names_the_options():
    with pytest.raises(ValueError, match="overflow='chunk'.*overflow='truncate'"):
        prepare_calibration([_ids(17)], max_length=16)


def test_truncate_keeps_each_samples_first_tokens():
    cal = prepare_calibration([_ids(40), _ids(12, 50)], max_length=16, overflow="truncate")
    assert [b.input_ids[0].tolist() for b in cal.batches] == [
        _ids(16).tolist(),
        _ids(12, 50).tolist(),
    ]


def test_chunk_concatenates_in_order_and_cuts_windows():
    samples = [_ids(30), _ids(30, 40), _ids(30, 80)]
    cal = prepare_calibration(samples, max_length=32, overflow="chunk", batch_size=2)
    rows = [
        r[m].tolist()
        for b in cal.batches
        for r, m in zip(b.input_ids, b.attention_mask, strict=True)
    ]
    assert [len(r) for r in rows] == [32, 32, 26]
    assert [t for r in rows for t in r] == torch.cat(samples).tolist()
    assert (cal.samples, cal.dropped, cal.tokens) == (3, 0, 90)


def test_chunk_stops_reading_once_it_has_num_samples_windows():
    calls = []

    def tokenizer(text):
        calls.append(text)
        return encode_text(text)

    texts = ["y" * 50 for _ in range(100)]
    cal = prepare_calibration(
        texts, tokenizer=tokenizer, max_length=20, overflow="chunk", num_samples=3
    )
    assert cal.samples == 3 and all(b.input_ids.shape == (1, 20) for b in cal.batches)
    assert len(calls) == 2  # 100 tokens cover three windows of 20


def test_a_short_last_window_is_dropped_without_a_warning(recwarn):
    cal = prepare_calibration([_ids(36)], max_length=32, overflow="chunk")
    assert cal.samples == 1 and not [w for w in recwarn if "dropped" in str(w.message)]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"overflow": "chunk"}, "no max_length was given"),
        ({"overflow": "split", "max_length": 8}, "overflow must be one of"),
        ({"num_samples": 0}, "num_samples must be None or an int >= 1"),
        ({"max_length": True}, "max_length must be None"),
    ],
)
def test_bad_options_are_named(kwargs, message):
    with pytest.raises(ValueError, match=message):
        prepare_calibration([_ids(20)], **kwargs)


def test_a_datasets_dataset_is_read_by_its_text_column():
    ds = datasets.Dataset.from_dict({"text": ["z" * 30, "w" * 5, "v" * 25], "n": [1, 2, 3]})
    with pytest.warns(UserWarning, match="dropped 1 of 3"):
        cal = prepare_calibration(ds, tokenizer=encode_text)
    assert cal.samples == 2 and cal.tokens == 55
    other = datasets.Dataset.from_dict({"content": ["q" * 30]})
    cal = prepare_calibration(other, tokenizer=encode_text, text_column="content")
    assert torch.equal(cal.batches[0].input_ids[0], encode_text("q" * 30))


def test_a_dataset_of_ids_and_the_refusals():
    ds = datasets.Dataset.from_dict({"input_ids": _random_ids(2, 20)})
    assert prepare_calibration(ds).tokens == 40
    with pytest.raises(
        ValueError, match=r"no 'text' or 'input_ids' column \(columns: \['body'\]\)"
    ):
        prepare_calibration(datasets.Dataset.from_dict({"body": ["x" * 20]}))
    splits = datasets.DatasetDict({"train": ds})
    with pytest.raises(TypeError, match=r"pass one split, e.g. dataset\['train'\]"):
        prepare_calibration(splits)


def test_local_files(tmp_path):
    texts = ["a" * 20, "b" * 30]
    (tmp_path / "c.txt").write_text("\n".join(texts) + "\n\n")
    assert load_calibration_file(tmp_path / "c.txt") == texts
    assert load_calibration_file(tmp_path / "c.txt", lines=False) == ["\n".join(texts) + "\n\n"]
    records = [{"text": texts[0]}, texts[1], {"input_ids": [1, 2, 3]}, [4, 5]]
    (tmp_path / "c.jsonl").write_text("\n".join(json.dumps(r) for r in records))
    expected = [texts[0], texts[1], {"input_ids": [1, 2, 3]}, [4, 5]]
    assert load_calibration_file(tmp_path / "c.jsonl") == expected
    (tmp_path / "c.json").write_text(json.dumps(records))
    assert load_calibration_file(tmp_path / "c.json") == expected
    ds = datasets.Dataset.from_dict({"body": texts, "n": [1, 2]})
    ds.to_json(tmp_path / "lines.json")  # JSON lines under a .json name
    ds.to_parquet(tmp_path / "c.parquet")
    assert load_calibration_file(tmp_path / "lines.json", text_column="body") == texts
    assert load_calibration_file(tmp_path / "c.parquet", text_column="body") == texts
    with pytest.raises(
        ValueError, match=r"no 'text' or 'input_ids' column \(columns: \['body', 'n'\]\)"
    ):
        load_calibration_file(tmp_path / "c.parquet")
    (tmp_path / "bad.jsonl").write_text('{"text": 3}\n')
    with pytest.raises(ValueError, match="bad.jsonl: line 1 must be a string"):
        load_calibration_file(tmp_path / "bad.jsonl")
    with pytest.raises(FileNotFoundError, match="no such file"):
        load_calibration_file(tmp_path / "missing.txt")


def test_cli_seq_len_cuts_a_file_into_windows(tmp_path, monkeypatch):
    seen = []

    def spy(*args, **kwargs):
        result = prepare_calibration(*args, **kwargs)
        seen.append(result)
        return result

    monkeypatch.setattr(calibration_module, "prepare_calibration", spy)
    cal = tmp_path / "cal.jsonl"  # one record far longer than the model's 64 positions
    cal.write_text(json.dumps({"input_ids": _random_ids(1, 500)[0]}) + "\n")
    args = ["quantize", str(FIXTURE), "--method", "gptq", "--group-size", "64", "--layout", "gptq"]
    args += ["--calibration", str(cal), "--seq-len", "48", "--samples", "5"]
    result = CliRunner().invoke(app, [*args, "--out", str(tmp_path / "o")])
    assert result.exit_code == 0, result.output
    assert seen[0].samples == 5 and seen[0].tokens == 5 * 48
    too_long = CliRunner().invoke(
        app, [*args[:-4], "--seq-len", "65", "--out", str(tmp_path / "p")]
    )
    assert too_long.exit_code == 2 and "max_position_embeddings (64)" in too_long.output


# --------------------------------------------------------------------------------------------
# 4. tokenizer detection
# --------------------------------------------------------------------------------------------


def test_generation_config_is_no_tokenizer_but_is_still_copied(tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(FIXTURE, copy)
    assert (copy / "generation_config.json").is_file()
    qm = floatxq.load(copy, quantize_config=floatxq.GPTQConfig(bits=4, group_size=64))
    with pytest.raises(ValueError, match=rf"no tokenizer files in {copy}; .*pass tokenizer="):
        qm.quantize(["a string sample that is long enough to keep"], progress=False)
    fp8 = floatxq.load(copy, quantize_config=floatxq.FP8Config()).quantize(progress=False)
    out = fp8.save(tmp_path / "saved")
    assert (out / "generation_config.json").read_bytes() == (
        copy / "generation_config.json"
    ).read_bytes()


def test_a_given_tokenizer_is_used_for_such_a_directory(tmp_path):
    qm = floatxq.load(FIXTURE, quantize_config=floatxq.GPTQConfig(bits=4, group_size=64))

    def tokenizer(text):
        return [ord(c) % 120 + 2 for c in text]

    qm.quantize(["the first calibration text " * 2], tokenizer=tokenizer, progress=False)
    assert qm.quantized
