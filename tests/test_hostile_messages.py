"""Hostile inputs that used to end in an unnamed error: each now names what is wrong.

The command line prints exactly one ``error:`` line (never a second ``error: Exit``) and exits
2; JSON it reads from the user (``--activation``, ``--calibration`` JSONL lines) goes through
``bounded_json_loads``. Token ids beyond int64 (Python ints, ``uint64`` tensors) and unsigned
tensors are named by sample; a reference of another vocabulary is named by both sizes.
"""

import json
from pathlib import Path

import pytest
import torch
from torch import nn
from typer.testing import CliRunner

import floatxq
from floatxq.cli import app
from floatxq.lifecycle.calibration import prepare_calibration
from floatxq.lifecycle.evaluate import evaluate_lm, reference_logprobs

runner = CliRunner()
FIXTURE = Path(__file__).parent / "fixtures" / "tiny_random_llama"  # vocab_size 128


def _error_line(result) -> str:
    """Exactly one ``error:`` line (the last one on stderr), exit code 2, no traceback."""
    assert isinstance(result.exception, SystemExit), result.exception
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    lines = [line for line in result.stderr.replace("\r", "\n").splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("error: ")]
    assert len(errors) == 1 and lines[-1] == errors[0], result.stderr
    assert "error: Exit" not in result.stderr
    return errors[0]


def _quantize_gptq(tmp_path: Path, *extra: str):
    out = tmp_path / "out"
    args = ["quantize", "tiny", "--method", "gptq", "--out", str(out), "--samples", "2"]
    result = runner.invoke(app, [*args, "--seq-len", "32", *extra])
    assert not out.exists()  # nothing is written by a failed command
    return _error_line(result)


def _jsonl(tmp_path: Path, *lines: str) -> Path:
    path = tmp_path / "calibration.jsonl"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


# ----------------------------------------------------------------------------------------------
# The command line
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("line", "fragment"),
    [
        ("not json", "line 1: not valid JSON (Expecting value"),
        ("[" * 200 + "]" * 200, "line 1: JSON nested deeper than 64 levels"),
        ('{"input_ids": [' + "9" * 40 + "]}", "line 1: an integer of 40 digits"),
        ('{"input_ids": [NaN]}', "line 1: NaN is not a finite number"),
        ('{"input_ids": [1e999]}', "line 1: the number 1e999 overflows a float"),
    ],
)
def test_a_bad_calibration_line_is_one_error_line(tmp_path, line, fragment):
    path = _jsonl(tmp_path, '"a fine first sample of text"', line)
    message = _quantize_gptq(tmp_path, "--calibration", str(path))
    assert message.startswith(f"error: --calibration {path}: "), message
    assert fragment.replace("line 1", "line 2") in message, message


def test_calibration_ids_beyond_int64_are_named_by_sample(tmp_path):
    ids = [65] * 20 + [2**70]
    path = _jsonl(tmp_path, json.dumps({"input_ids": list(range(66, 90))}), json.dumps(ids))
    message = _quantize_gptq(tmp_path, "--calibration", str(path))
    assert "sample 1 has the id 1180591620717411303424 at position 20, beyond int64" in message


@pytest.mark.parametrize(
    ("spec", "fragment"),
    [
        ('{"a": ' * 100 + "1" + "}" * 100, "is not JSON floatxq accepts: JSON nested deeper than"),
        ("[" * 5000 + "]" * 5000, "is not JSON floatxq accepts: JSON nested deeper than 64"),
        ('{"mode": "w4afp8", "x": ' + "7" * 400 + "}", "an integer of 400 digits"),
        ('{"mode": NaN}', "NaN is not a finite number"),
        ("{mode", "is not JSON floatxq accepts: not valid JSON"),
        ('["w4afp8"]', "--activation '[\"w4afp8\"]': "),
    ],
)
def test_a_hostile_activation_policy_is_one_short_error_line(tmp_path, spec, fragment):
    message = _quantize_gptq(tmp_path, "--calibration", "tiny", "--activation", spec)
    assert message.startswith("error: --activation "), message
    assert fragment in message, message
    assert len(message) < 400  # the policy is quoted cut short, not in full


def test_eval_names_a_reference_of_another_vocabulary():
    result = runner.invoke(
        app, ["eval", "tiny", "--reference", str(FIXTURE), "--windows", "1", "--seq-len", "16"]
    )
    message = _error_line(result)
    assert "vocabulary of 256 tokens" in message and f"--reference {FIXTURE} 128" in message
    assert "size of tensor" not in message


# ----------------------------------------------------------------------------------------------
# evaluate_lm
# ----------------------------------------------------------------------------------------------


def _llama(vocab: int) -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=2, head_dim=16,
    )  # fmt: skip
    return LlamaForCausalLM(config).eval()


def test_evaluate_lm_names_both_vocabularies_before_any_forward():
    model, reference = _llama(64), _llama(80)

    def never(*args, **kwargs):
        raise AssertionError("the reference ran")

    reference.forward = never
    windows = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match=r"vocabulary of 64 tokens .* the reference 80"):
        evaluate_lm(model, windows, reference=reference)


def test_evaluate_lm_names_precomputed_reference_logprobs_of_another_width():
    windows = torch.randint(0, 64, (3, 12), generator=torch.Generator().manual_seed(0))
    refs = reference_logprobs(_llama(80), windows, batch_size=2)
    with pytest.raises(ValueError, match=r"vocabulary of 64 tokens .* the reference 80"):
        evaluate_lm(_llama(64), windows, reference=refs, batch_size=2)
    other = reference_logprobs(_llama(64), windows[:, :8], batch_size=2)  # other windows
    with pytest.raises(ValueError, match=r"reference batch 0 has log-probabilities of shape"):
        evaluate_lm(_llama(64), windows, reference=other, batch_size=2)
    same = reference_logprobs(_llama(64), windows, batch_size=2)  # the check passes a match
    assert evaluate_lm(_llama(64), windows, reference=same, batch_size=2).kl_divergence == 0.0


# ----------------------------------------------------------------------------------------------
# Calibration samples
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("samples", "fragment"),
    [
        ([list(range(12)), [1, 2, 3, 2**70, 5]], "sample 1 has the id 1180591620717411303424 at"),
        ([[1] * 12 + [-(2**64)]], "sample 0 has the id -18446744073709551616 at position 12"),
        ([[10**5000]], "sample 0 has an id of 16610 bits at position 0, beyond int64"),
        ([{"input_ids": [3] * 12 + [2**63]}], "sample 0 has the id 9223372036854775808 at"),
        (
            [{"input_ids": [3] * 12, "attention_mask": [1] * 11 + [2**64]}],
            "the attention_mask of sample 0 has the id 18446744073709551616 at position 11",
        ),
        (
            [list(range(12)), torch.tensor([1] * 12 + [2**63 + 5], dtype=torch.uint64)],
            "sample 1 holds the torch.uint64 id 9223372036854775813 at position 12",
        ),
        ([list(range(12)), [-1] * 12], "sample 1 has token ids [-1, -1, -1, -1] outside [0,"),
    ],
)
def test_ids_that_do_not_fit_are_named_by_sample(samples, fragment):
    with pytest.raises(ValueError) as info:
        prepare_calibration(samples)
    assert fragment in str(info.value), str(info.value)
    assert str(info.value).startswith("calibration: ")


def test_ids_of_the_wrong_kind_are_named_by_sample_and_position():
    with pytest.raises(TypeError, match=r"sample 0 must be a list of int token ids; position 2 is"):
        prepare_calibration([[1, 2, 3.0] + [4] * 10])
    with pytest.raises(TypeError, match=r"sample 1 is a meta tensor"):
        prepare_calibration([list(range(12)), torch.zeros(12, dtype=torch.int64, device="meta")])


@pytest.mark.parametrize("dtype", [torch.uint8, torch.uint16, torch.uint32, torch.uint64])
def test_unsigned_ids_in_range_are_read_exactly(dtype):
    ids = torch.tensor([0, 1, 7, 200, 255] * 3)
    got = prepare_calibration([ids.to(dtype)], vocab_size=256)
    assert got.batches[0].input_ids.dtype == torch.int64
    assert torch.equal(got.batches[0].input_ids[0], ids)
    if dtype != torch.uint8:  # too wide for the vocabulary: named with the sample's values
        with pytest.raises(ValueError, match=r"sample 0 has token ids \[300\] outside"):
            prepare_calibration([torch.tensor([300] + [1] * 11).to(dtype)], vocab_size=256)


def test_quantize_refuses_ids_beyond_int64_before_touching_the_model():
    from tests.test_gptq_lifecycle import CONFIG, _model

    qm = floatxq.load(_model(), quantize_config=CONFIG, device="cpu")
    before = {k: v.clone() for k, v in qm.model.state_dict().items()}
    with pytest.raises(ValueError, match=r"sample 0 has the id 36893488147419103232 at position"):
        qm.quantize([[5] * 20 + [2**65]], progress=False)
    after = qm.model.state_dict()
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in after)
    assert not qm.quantized and qm.interrupted is None


# ----------------------------------------------------------------------------------------------
# calibrate_activations
# ----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def w4a():
    from floatxq.config import ActivationConfig
    from tests.test_w4a_checkpoints import _w4a_model

    return _w4a_model(ActivationConfig(mode="w4a_nvfp4", recipe="least_squares"))


def test_calibrate_activations_names_uint64_ids_beyond_int64(w4a):
    from tests.test_activation_calibration import _same, _state

    before = _state(w4a)
    samples = [torch.arange(5, 25), torch.tensor([7, 2**64 - 1, 9], dtype=torch.uint64)]
    with pytest.raises(ValueError) as info:
        w4a.calibrate_activations(samples)
    message = str(info.value)
    assert "samples[1] holds the torch.uint64 id 18446744073709551615 at position 1" in message
    assert _same(before, _state(w4a))
    wide = [torch.arange(5, 25), torch.tensor([7, 300, 9], dtype=torch.uint16)]
    with pytest.raises(ValueError, match=r"samples\[1\] \(torch.uint16\) holds ids 7..300, out"):
        w4a.calibrate_activations(wide)
    assert _same(before, _state(w4a))


def test_calibrate_activations_reads_unsigned_ids_exactly(w4a):
    ids = torch.tensor([3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 200])
    signed = w4a.calibrate_activations([ids])
    unsigned = w4a.calibrate_activations([ids.to(torch.uint32)])
    assert unsigned["global_scales"] == signed["global_scales"]
    assert unsigned["boundaries"] == signed["boundaries"]
