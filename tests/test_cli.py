"""The ``floatxq`` command line, end to end on the built-in tiny Llama."""

import json
import re

import pytest
from typer.testing import CliRunner

import floatxq
from floatxq.cli import app

runner = CliRunner()


def _run(*args: str):
    result = runner.invoke(app, list(args))
    return result.exit_code, result.output


@pytest.fixture(scope="module")
def quantized_tiny(tmp_path_factory):
    out = tmp_path_factory.mktemp("cli") / "tiny-fp8"
    code, output = _run("quantize", "tiny", "--out", str(out), "--block-size", "128", "128")
    assert code == 0, output
    return out, output


def test_quantize_tiny_block_scales(quantized_tiny):
    out, output = quantized_tiny
    assert "quantized 56 modules (float8_e4m3fn, block)" in output
    assert "(layout compressed-tensors)" in output
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    weights = qc["config_groups"]["group_0"]["weights"]
    assert qc["quant_method"] == "compressed-tensors" and qc["format"] == "float-quantized"
    assert weights["strategy"] == "block" and weights["block_structure"] == [128, 128]
    assert not (out / "quantize_config.json").exists()


@pytest.mark.parametrize(
    ("layout", "method", "convention"),
    [("gptqmodel", "fp8", "floatxq_fp8"), ("hf", "fp8", "deepseek_fp8")],
)
def test_quantize_layout_option(tmp_path, layout, method, convention):
    out = tmp_path / layout
    code, output = _run(
        "quantize", "tiny", "--out", str(out), "--block-size", "128", "128", "--layout", layout
    )
    assert code == 0, output
    code, output = _run("inspect", str(out))
    assert code == 0, output
    assert f"layout:      {layout}:" in output and f"convention:  {convention}:" in output
    assert f"method:      {method}" in output
    assert (out / "quantize_config.json").exists() == (layout == "gptqmodel")
    code, output = _run("quantize", "tiny", "--out", str(tmp_path / "bad"), "--layout", "hf")
    assert code == 2 and "row" in output  # the default row scales have no hf form


def test_inspect_reports_convention_and_layouts(quantized_tiny):
    out, _ = quantized_tiny
    code, output = _run("inspect", str(out))
    assert code == 0, output
    assert "layout:      compressed-tensors:" in output
    assert "method:      compressed-tensors" in output and "family:      fp8" in output
    assert "convention:  direct_fp8: direct weight_scale: multiply to decode" in output
    assert "quantized:   56 layers" in output
    assert "scales block 128x128: 56 layers" in output
    assert "F8_E4M3 x56" in output


def test_inspect_plain_model():
    from floatxq.tiny import TINY_LLAMA_DIR

    code, output = _run("inspect", str(TINY_LLAMA_DIR))
    assert code == 0, output
    assert "none (not quantized)" in output and "convention:  none" in output


def test_eval_against_reference(quantized_tiny):
    out, _ = quantized_tiny
    code, output = _run("eval", str(out), "--reference", "tiny", "--windows", "4")
    assert code == 0, output
    lines = dict(line.split(":", 1) for line in output.strip().splitlines())
    assert float(lines["perplexity"]) < 5.0
    assert 0 < float(lines["KL"].split()[0]) < 0.05
    assert float(lines["top-1"].strip().rstrip("%")) > 90


def test_quantize_errors_exit_2(tmp_path):
    code, output = _run("quantize", "tiny", "--out", str(tmp_path / "x"), "--method", "awq")
    assert code == 2 and "unsupported --method 'awq'" in output
    code, output = _run("quantize", "tiny", "--out", str(tmp_path / "x"), "--format", "e3m4")
    assert code == 2 and "unsupported FP8 format" in output
    code, output = _run("quantize", str(tmp_path / "missing"), "--out", str(tmp_path / "y"))
    assert code == 2 and "not a model directory" in output
    code, output = _run("inspect", str(tmp_path))
    assert code == 2 and "config.json is missing" in output


def test_recipes_table_and_png(tmp_path):
    png = tmp_path / "recipes.png"
    code, output = _run("recipes", "--size", "64", "--png", str(png))
    assert code == 0, output
    assert "least_squares_grid" in output and "exhaustive" in output
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_eval_tokenizer_model_against_its_fp8_version(tmp_path):
    """A model with its own tokenizer: the held-out split is encoded with that tokenizer."""
    import torch
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    from floatxq.tiny import stdlib_corpus

    text = stdlib_corpus("train").decode("utf-8", errors="replace")[:200_000]
    tok = Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.train_from_iterator([text], trainers.BpeTrainer(vocab_size=384, special_tokens=["[UNK]"]))
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=384, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
        tie_word_embeddings=False,
    )  # fmt: skip
    plain = tmp_path / "plain"
    transformers.LlamaForCausalLM(config).save_pretrained(plain)
    fast.save_pretrained(plain)
    out = tmp_path / "fp8"
    code, output = _run("quantize", str(plain), "--out", str(out))
    assert code == 0, output
    assert (out / "tokenizer.json").is_file()  # tokenizer files travel with the checkpoint
    code, output = _run(
        "eval", str(out), "--reference", str(plain), "--windows", "4", "--seq-len", "64"
    )
    assert code == 0, output
    assert int(re.search(r"tokens:\s+(\d+)", output).group(1)) == 4 * 63, output
    assert 0 <= float(re.search(r"KL:\s+(\S+)", output).group(1)) < 0.05
    # a non-byte model without a tokenizer is refused with the reason
    (plain / "tokenizer.json").unlink()
    (plain / "tokenizer_config.json").unlink()
    code, output = _run("eval", str(plain), "--windows", "2")
    assert code == 2 and "tokenizer" in output


def test_quantize_tiny_to_nvfp4_and_inspect(tmp_path):
    out = tmp_path / "nvfp4"
    code, output = _run(
        "quantize", "tiny", "--out", str(out), "--method", "nvfp4", "--global-scale", "fused"
    )
    assert code == 0, output
    assert "quantized 56 modules (nvfp4 least_squares rtn, fused global scales)" in output
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc["format"] == "nvfp4-pack-quantized"
    code, output = _run("inspect", str(out))
    assert code == 0, output
    assert "quantized:   56 layers" in output and "nvfp4" in output.lower()
    code, output = _run("quantize", "tiny", "--out", str(tmp_path / "x"), "--method", "nvfp4",
                        "--recipe", "best")  # fmt: skip
    assert code == 2 and "Unsupported NVFP4 scale recipe: 'best'" in output
    code, output = _run("quantize", "tiny", "--out", str(tmp_path / "y"), "--method", "nvfp4",
                        "--global-scale", "layer")  # fmt: skip
    assert code == 2 and "global_scale: expected one of ['module', 'fused']" in output


def test_quantize_tiny_to_nvfp4_w4a4_with_gptq_and_inspect(tmp_path):
    out = tmp_path / "w4a4"
    base = ("quantize", "tiny", "--method", "nvfp4", "--activations", "nvfp4", "--gptq")
    code, output = _run(*base, "--out", str(out))
    assert code == 2 and "needs --calibration" in output and not out.exists()
    code, output = _run(*base, "--out", str(out), "--calibration", "tiny", "--samples", "4",
                        "--seq-len", "64", "--json")  # fmt: skip
    assert code == 0, output
    record = json.loads(output.strip().splitlines()[-1])
    assert record["scheme"] == "nvfp4 least_squares gptq, module global scales, W4A4"
    assert len(record["modules"]) == 56
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc["format"] == "nvfp4-pack-quantized"
    group = next(iter(qc["config_groups"].values()))
    assert group["input_activations"]["num_bits"] == 4
    code, output = _run("inspect", str(out))
    assert code == 0 and "W4A4" in output, output
    loaded = floatxq.load(out)
    scales = [
        m.input_scale for m in loaded.model.modules() if getattr(m, "input_scale", None) is not None
    ]
    assert len(scales) == 56
    code, output = _run("quantize", "tiny", "--out", str(tmp_path / "z"), "--activations", "nvfp4")
    assert code == 2 and "--activations and --gptq apply to --method nvfp4 only" in output
