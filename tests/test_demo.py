"""The demo on the trained tiny Llama: every path runs and the measurements make sense."""

import pytest

from floatxq.demo import plot_demo, run_demo


@pytest.fixture(scope="module")
def report():
    return run_demo(max_windows=4)


def test_every_path_is_measured(report):
    names = [r.path for r in report.rows]
    assert names[0] == "bf16 (reference)"
    for expected in ("fp8 e4m3 row", "fp8 e4m3 block 128x128", "fp8 e5m2 row", "int4 gptq g128"):
        assert any(n.startswith(expected) for n in names), expected
    reference = report.rows[0]
    assert reference.kl_divergence == pytest.approx(0.0, abs=1e-6)
    assert reference.top1_agreement == 1.0
    assert report.tokens == 4 * 255


def test_quality_ordering_on_a_trained_model(report):
    rows = {r.path: r for r in report.rows}
    e4m3, e5m2 = rows["fp8 e4m3 row"], rows["fp8 e5m2 row"]
    rtn, gptq = (
        rows["int4 rtn g128 (weights, simulated)"],
        rows["int4 gptq g128 (GPTQLinear, W4A16)"],
    )
    # the GPTQ row is the real lifecycle: packed GPTQLinear modules, counted as stored
    assert not gptq.simulated and gptq.bytes < 0.5 * report.rows[0].bytes
    # one more mantissa bit halves the rounding step: E4M3 moves the model less than E5M2
    assert e4m3.kl_divergence < e5m2.kl_divergence
    # GPTQ's Hessian-aware rounding beats plain rounding at the same grid
    assert gptq.kl_divergence < rtn.kl_divergence
    # FP8 (8 bits) beats every 4-bit path
    four_bit = [r.kl_divergence for n, r in rows.items() if n.startswith(("nvfp4", "int4"))]
    assert four_bit and e4m3.kl_divergence < min(four_bit)
    assert rows["fp8 e4m3 row"].bytes < 0.6 * report.rows[0].bytes


def test_chart_is_a_png(report, tmp_path):
    out = tmp_path / "demo.png"
    plot_demo(report, str(out))
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
