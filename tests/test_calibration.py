"""Calibration samples: kinds accepted, the minimum-length filter, batching and padding masks."""

import pytest
import torch

from floatxq.lifecycle.calibration import CALIBRATION_MIN_LENGTH, prepare_calibration
from floatxq.tiny import encode_text


def _ids(n: int, start: int = 1) -> torch.Tensor:
    return torch.arange(start, start + n, dtype=torch.int64)


def test_min_length_is_gptqmodels_default():
    assert CALIBRATION_MIN_LENGTH == 10


def test_samples_of_at_most_ten_tokens_are_dropped_and_counted():
    with pytest.warns(UserWarning, match="dropped 2 of 4 samples with at most 10 tokens"):
        cal = prepare_calibration([_ids(10), _ids(11), _ids(3), _ids(40)])
    assert (cal.samples, cal.dropped, cal.tokens) == (2, 2, 51)
    assert [b.input_ids.shape for b in cal.batches] == [(1, 11), (1, 40)]


def test_nothing_usable_left_is_an_error():
    with pytest.raises(ValueError, match="all 2 samples have at most 10 tokens"):
        prepare_calibration([_ids(10), _ids(2)])


def test_empty_calibration_is_an_error():
    with pytest.raises(ValueError, match="no samples"):
        prepare_calibration([])


def test_batches_are_right_padded_with_a_mask_false_exactly_on_padding():
    cal = prepare_calibration([_ids(12), _ids(20, start=5), _ids(15)], batch_size=2, pad_token_id=7)
    first = cal.batches[0]
    assert first.input_ids.shape == (2, 20)
    assert first.attention_mask.dtype == torch.bool
    assert first.attention_mask.sum(dim=1).tolist() == [12, 20]
    assert torch.equal(first.input_ids[0, :12], _ids(12))
    assert first.input_ids[0, 12:].tolist() == [7] * 8
    assert torch.equal(first.input_ids[1], _ids(20, start=5))
    assert cal.batches[1].input_ids.shape == (1, 15)
    assert bool(cal.batches[1].attention_mask.all())


def test_strings_need_a_tokenizer():
    with pytest.raises(ValueError, match="sample 0 is a string, but this model has no tokenizer"):
        prepare_calibration(["a string sample that is long enough"])


def test_strings_go_through_the_tokenizer():
    text = "def f(x): return x  # a sample"
    cal = prepare_calibration([text], tokenizer=encode_text)
    assert torch.equal(cal.batches[0].input_ids[0], encode_text(text))


def test_hf_style_tokenizer_output_is_read():
    def tokenizer(text):
        return {"input_ids": list(range(1, len(text) + 1))}

    cal = prepare_calibration(["x" * 13], tokenizer=tokenizer)
    assert cal.batches[0].input_ids[0].tolist() == list(range(1, 14))


def test_mapping_samples_have_their_padding_removed():
    ids = torch.tensor([0, 0, *range(1, 13), 0])
    mask = torch.tensor([0, 0, *([1] * 12), 0])
    cal = prepare_calibration([{"input_ids": ids, "attention_mask": mask}])
    assert cal.batches[0].input_ids[0].tolist() == list(range(1, 13))


def test_mask_with_interior_padding_is_refused():
    mask = torch.ones(14, dtype=torch.int64)
    mask[5] = 0
    with pytest.raises(ValueError, match="padding between real tokens"):
        prepare_calibration([{"input_ids": _ids(14), "attention_mask": mask}])


def test_two_d_tensor_is_one_sample_per_row():
    cal = prepare_calibration(torch.arange(48).reshape(3, 16), batch_size=3)
    assert cal.batches[0].input_ids.shape == (3, 16)
    assert cal.samples == 3


@pytest.mark.parametrize("bad", [torch.rand(12), [1.5] * 12, 12, object()])
def test_wrong_kinds_are_type_errors(bad):
    with pytest.raises(TypeError, match="calibration"):
        prepare_calibration([bad])


def test_ids_outside_the_vocabulary_are_refused():
    with pytest.raises(ValueError, match=r"token ids \[300\] outside the model's vocabulary"):
        prepare_calibration([torch.tensor([1] * 11 + [300])], vocab_size=256)
    with pytest.raises(ValueError, match="outside"):
        prepare_calibration([torch.tensor([-1] * 12)], vocab_size=256)


def test_samples_longer_than_the_model_are_refused_not_truncated():
    with pytest.raises(ValueError, match="more than the model's 16 positions"):
        prepare_calibration([_ids(17)], max_length=16)


@pytest.mark.parametrize("name", ["batch_size", "min_length"])
def test_bad_options(name):
    with pytest.raises(ValueError, match=name):
        prepare_calibration([_ids(12)], **{name: -1})
