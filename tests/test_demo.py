"""The demo on the trained tiny Llama: every path runs and the measurements make sense."""

import math

import pytest

from floatxq.demo import W4A_PATHS, plot_demo, run_demo

W4A16 = "int4 gptq g128 (GPTQLinear, W4A16)"


# Every test that takes the ``report`` fixture is marked slow: the fixture runs the whole demo
# (pytest applies no mark placed on a fixture, so the mark sits on each test that uses it).
slow = pytest.mark.slow


@pytest.fixture(scope="module")
def report():
    # 4 calibration windows instead of the CLI's 32 keep the six GPTQ solves short (the
    # exhaustive row then solves on one)
    return run_demo(max_windows=4, calibration_windows=4)


@pytest.fixture(scope="module")  # the scope of `report`: pytest then sets up in argument order
def matplotlib():
    """The optional ``plot`` extra: the chart test skips without it, before the demo runs."""
    return pytest.importorskip("matplotlib")


def _w4a_rows(report):
    """W4A row name (as in W4A_PATHS, without the calibration note) → its DemoRow."""
    rows = {}
    for name, _, _ in W4A_PATHS:
        found = [r for r in report.rows if r.path.startswith(name)]
        assert len(found) == 1, (name, [r.path for r in report.rows])
        rows[name] = found[0]
    return rows


@slow
def test_every_path_is_measured(report):
    names = [r.path for r in report.rows]
    assert names[0] == "bf16 (reference)"
    for expected in ("fp8 e4m3 row", "fp8 e4m3 block 128x128", "fp8 e5m2 row", "int4 gptq g128"):
        assert any(n.startswith(expected) for n in names), expected
    assert len(_w4a_rows(report)) == 4
    reference = report.rows[0]
    assert reference.kl_divergence == pytest.approx(0.0, abs=1e-6)
    assert reference.top1_agreement == 1.0
    assert report.tokens == 4 * 255


@slow
def test_quality_ordering_on_a_trained_model(report):
    rows = {r.path: r for r in report.rows}
    e4m3, e5m2 = rows["fp8 e4m3 row"], rows["fp8 e5m2 row"]
    rtn, gptq = rows["int4 rtn g128 (weights, simulated)"], rows[W4A16]
    # the GPTQ row is the real lifecycle: packed GPTQLinear modules, counted as stored
    assert not gptq.simulated and gptq.bytes < 0.5 * report.rows[0].bytes
    # one more mantissa bit halves the rounding step: E4M3 moves the model less than E5M2
    assert e4m3.kl_divergence < e5m2.kl_divergence
    # GPTQ's Hessian-aware rounding beats plain rounding at the same grid
    assert gptq.kl_divergence < rtn.kl_divergence
    # FP8 (8 bits) beats every 4-bit path, W4A rows included
    four_bit = [r.kl_divergence for n, r in rows.items() if n.startswith(("nvfp4", "int4"))]
    assert len(four_bit) == 6 + 2 + 4 and e4m3.kl_divergence < min(four_bit)
    assert rows["fp8 e4m3 row"].bytes < 0.6 * report.rows[0].bytes


@slow
def test_nvfp4_rows_run_the_lifecycle_modules(report):
    rows = {r.path: r for r in report.rows}
    rtn = rows["nvfp4 least_squares (NVFP4A16)"]
    gptq = rows["nvfp4 least_squares gptq (NVFP4A16)"]
    w4a4 = rows["nvfp4 least_squares W4A4 (NVFP4 activations)"]
    nvfp4 = [r for n, r in rows.items() if n.startswith("nvfp4")]
    assert len(nvfp4) == 6 and not any(r.simulated for r in nvfp4)
    # packed codes and scales as stored: about a third of the bf16 reference's linear bytes
    assert all(r.bytes < 0.5 * report.rows[0].bytes for r in nvfp4)
    # W4A4 stores one FP32 input scale more per module than the weight-only row
    assert 0 < w4a4.bytes - rtn.bytes <= 4 * 64 and (w4a4.bytes - rtn.bytes) % 4 == 0
    # Hessian-aware rounding on the same grid moves the model less; quantizing the activations
    # too moves it more
    assert gptq.kl_divergence < rtn.kl_divergence < w4a4.kl_divergence


@slow
def test_w4a_rows_run_the_packed_weights_with_quantized_activations(report):
    w4a = _w4a_rows(report)
    gptq = next(r for r in report.rows if r.path == W4A16)
    for name, row in w4a.items():
        assert not row.simulated, name
        assert math.isfinite(row.perplexity) and row.kl_divergence > 0.0, name
        assert 0.0 < row.top1_agreement < 1.0, name
        # the same packed INT4 weights as W4A16 (staged operands are caches, not stored); an
        # NVFP4 row adds only int32 activation global scales (the modules' and the stream's
        # calibrated producer scales, held as buffers): a few hundred bytes, whole int32s
        extra = row.bytes - gptq.bytes
        assert 0 <= extra <= 1024 and extra % 4 == 0, (name, extra)
        assert (extra == 0) == name.startswith("int4 gptq W4A-FP8"), (name, extra)
    fp8 = w4a["int4 gptq W4A-FP8 (W4AFP8Linear)"]
    lsq = w4a["int4 gptq W4A-NVFP4 least_squares"]
    split = w4a["int4 gptq W4A fp8 attention, nvfp4 lsq mlp"]
    # per-token E4M3 activations (3 mantissa bits, one scale per token) against E2M1 codes in
    # blocks of 16: the NVFP4 stream moves the model well over twice as far (about 2.6x here)
    assert fp8.kl_divergence < lsq.kl_divergence
    # the split quantizes the attention operands to FP8 instead: between the two (about 0.7x
    # the all-NVFP4 KL here, on both 4 and 24 evaluation windows)
    assert fp8.kl_divergence < split.kl_divergence < lsq.kl_divergence


def test_calibration_windows_must_be_positive():
    with pytest.raises(ValueError, match="calibration_windows must be a positive int"):
        run_demo(max_windows=1, calibration_windows=0)


@slow
def test_chart_is_a_png(matplotlib, report, tmp_path):
    out = tmp_path / "demo.png"
    plot_demo(report, str(out))
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
