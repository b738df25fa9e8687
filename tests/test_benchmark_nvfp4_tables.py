"""The NVFP4 quality benchmark's tables (``benchmarks/nvfp4_quality.py``) on a synthetic record:
KL ratios to the anchor of the same activation kind, the goal marks, and the RTN trade-off. No
model runs."""

import importlib.util
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parents[1] / "benchmarks" / "nvfp4_quality.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("nvfp4_quality_under_test", _PATH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _row(recipe, method, activations, kl, seconds, perplexity=4.0):
    return {
        "settings": {"recipe": recipe, "method": method, "activations": activations},
        "seconds": seconds,
        "eval": {"perplexity": perplexity, "kl_divergence": kl, "top1_agreement": 0.9},
    }


ANCHOR = {
    "versions": {"llmcompressor": "0.14.0.1"},
    "settings": {"samples": 32, "seq_len": 256, "windows": 64},
    "schemes": {
        "NVFP4A16": {
            "oneshot_seconds": 2.0,
            "in_memory": {"perplexity": 4.0, "kl_divergence": 0.010, "top1_agreement": 0.9},
            "reloaded": {"perplexity": 4.0, "kl_divergence": 0.010, "top1_agreement": 0.9},
        },
        "NVFP4": {
            "oneshot_seconds": 40.0,
            "in_memory": {"perplexity": 5.0, "kl_divergence": 0.050, "top1_agreement": 0.8},
            "reloaded": None,  # a failed reload: the in-memory report stands in
        },
    },
}


def test_plan_rows_names_every_combination(bench):
    rows = bench.plan_rows(["nvidia", "least_squares"], ["rtn", "gptq"], ["A16", "W4A4"])
    assert len(rows) == 8
    assert rows["least_squares/gptq/W4A4"] == {
        "recipe": "least_squares",
        "method": "gptq",
        "activations": "nvfp4",
    }
    assert rows["nvidia/rtn/A16"]["activations"] is None


def test_compare_divides_by_the_anchor_of_the_same_activation_kind(bench):
    results = {
        "nvidia/rtn/A16": _row("nvidia", "rtn", None, kl=0.0085, seconds=0.5),
        "least_squares/rtn/A16": _row("least_squares", "rtn", None, kl=0.0075, seconds=1.0),
        "nvidia/gptq/W4A4": _row("nvidia", "gptq", "nvfp4", kl=0.0440, seconds=80.0),
        "nvidia/rtn/W4A4": _row("nvidia", "rtn", "nvfp4", kl=0.0460, seconds=10.0),
        "broken/rtn/A16": {"settings": {"recipe": "x", "method": "rtn", "activations": None}},
    }
    table = bench.compare(results, ANCHOR)
    assert "broken/rtn/A16" not in table  # no evaluation, no ratio
    a16, ls = table["nvidia/rtn/A16"], table["least_squares/rtn/A16"]
    assert a16["scheme"] == "NVFP4A16" and a16["goal"] == 0.8
    assert a16["kl_ratio"] == pytest.approx(0.85) and not a16["met"]  # 0.85 > 0.8
    assert ls["kl_ratio"] == pytest.approx(0.75) and ls["met"]
    assert a16["anchor_over_row_seconds"] == pytest.approx(4.0)
    w4a4, rtn4 = table["nvidia/gptq/W4A4"], table["nvidia/rtn/W4A4"]
    assert w4a4["scheme"] == "NVFP4" and w4a4["anchor_kl"] == 0.050  # the in-memory report
    assert w4a4["kl_ratio"] == pytest.approx(0.88) and w4a4["met"]  # 0.88 ≤ 0.9
    assert rtn4["kl_ratio"] == pytest.approx(0.92) and not rtn4["met"]
    assert w4a4["perplexity_ratio"] == pytest.approx(0.8)
    assert w4a4["anchor_over_row_seconds"] == pytest.approx(0.5)

    lines = bench.format_comparison(table)
    marks = {line.split("|")[0].strip(): line.split("|")[5].strip() for line in lines[2:]}
    assert marks == {
        "nvidia/rtn/A16": "≤0.8 ✗",
        "least_squares/rtn/A16": "≤0.8 ✓",
        "nvidia/gptq/W4A4": "≤0.9 ✓",
        "nvidia/rtn/W4A4": "≤0.9 ✗",
    }
    assert "0.880" in lines[4] and "4.00x" in lines[2]


def test_a_missing_anchor_scheme_leaves_the_row_out(bench):
    anchor = {**ANCHOR, "schemes": {"NVFP4A16": ANCHOR["schemes"]["NVFP4A16"]}}
    results = {"nvidia/rtn/W4A4": _row("nvidia", "rtn", "nvfp4", kl=0.04, seconds=1.0)}
    assert bench.compare(results, anchor) == {}


def test_rtn_a16_tradeoff_is_kl_removed_per_extra_second(bench):
    results = {
        "nvidia/rtn/A16": _row("nvidia", "rtn", None, kl=0.010, seconds=0.5),
        "four_six/rtn/A16": _row("four_six", "rtn", None, kl=0.009, seconds=0.5),
        "least_squares/rtn/A16": _row("least_squares", "rtn", None, kl=0.008, seconds=1.5),
        "least_squares/gptq/A16": _row("least_squares", "gptq", None, kl=0.004, seconds=50.0),
        "least_squares/rtn/W4A4": _row("least_squares", "rtn", "nvfp4", kl=0.03, seconds=9.0),
    }
    trade = bench.rtn_a16_tradeoff(results)
    assert list(trade) == ["nvidia", "four_six", "least_squares"]  # RTN NVFP4A16 only
    assert trade["nvidia"]["kl_gain"] == 0.0 and trade["nvidia"]["gain_per_extra_second"] is None
    assert trade["four_six"]["kl_gain"] == pytest.approx(0.1)
    assert trade["four_six"]["gain_per_extra_second"] is None  # not slower: no rate
    assert trade["least_squares"]["kl_gain"] == pytest.approx(0.2)
    assert trade["least_squares"]["gain_per_extra_second"] == pytest.approx(0.2)
    lines = bench.format_tradeoff(trade)
    assert lines[4].split("|")[3].strip() == "20.0%" and lines[4].split("|")[4].strip() == "0.200"
    assert bench.rtn_a16_tradeoff({"x": results["least_squares/rtn/A16"]}) == {}
