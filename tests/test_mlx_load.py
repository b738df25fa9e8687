"""``floatxq.load(path, backend="mlx")``: a saved FP8 checkpoint converted whole to MLX."""

import copy

import pytest
import torch

import floatxq
from floatxq.config import BACKEND, FP8Config, GPTQConfig

mx = pytest.importorskip("mlx.core")
pytest.importorskip("mlx_lm")

IDS = [[10, 20, 30, 40, 50, 60, 70, 80]]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    from floatxq.tiny import load_tiny_llama

    qm = floatxq.load(load_tiny_llama(dtype=torch.float32), quantize_config=FP8Config())
    qm.quantize(progress=False)
    return qm, qm.save(tmp_path_factory.mktemp("mlx") / "fp8", layout="gptqmodel")


def test_a_saved_fp8_checkpoint_runs_as_an_mlx_model(saved):
    qm, path = saved
    loaded = floatxq.load(path, backend="mlx", device="mps")
    assert loaded.backend == BACKEND.MLX and loaded.quantized
    assert loaded.quantize_config == qm.quantize_config
    assert set(loaded.mlx_routes.values()) == {"mxfp8", "dense"}  # row scales: native mxfp8
    assert loaded.mlx_routes["lm_head"] == "dense"
    logits = loaded.model(mx.array(IDS))
    with torch.no_grad():
        want = qm.model(torch.tensor(IDS)).logits
    got = torch.tensor(logits.tolist())
    scale = float(want.abs().max())
    assert float((got - want).abs().max()) <= 1e-4 * scale  # FP32 sums in another order
    with pytest.raises(RuntimeError, match="save: this is an MLX model"):
        loaded.save(path.parent / "again")


def test_mlx_refuses_what_it_cannot_run(saved, tmp_path):
    _, path = saved
    with pytest.raises(ValueError, match="backend 'mlx' runs a saved checkpoint"):
        floatxq.load(path, backend="mlx", quantize_config=FP8Config())
    with pytest.raises(ValueError, match="device must be None, 'mps', 'gpu' or 'cpu'"):
        floatxq.load(path, backend="mlx", device="cuda")
    with pytest.raises(TypeError, match="takes a checkpoint directory"):
        floatxq.load(torch.nn.Linear(2, 2), backend="mlx")
    from floatxq.tiny import load_tiny_llama

    model = load_tiny_llama(dtype=torch.float32)
    model.model.layers = model.model.layers[:1]
    model.config.num_hidden_layers = 1
    gptq = floatxq.load(copy.deepcopy(model), quantize_config=GPTQConfig())
    from floatxq.tiny import calibration_samples

    gptq.quantize(calibration_samples(num_samples=2, seq_len=32), progress=False)
    directory = gptq.save(tmp_path / "gptq", layout="gptq")
    with pytest.raises(ValueError, match="is a GPTQ checkpoint"):
        floatxq.load(directory, backend="mlx")


def test_the_mlx_example_runs(capsys):
    import re
    import runpy
    from pathlib import Path

    script = Path(__file__).resolve().parent.parent / "examples" / "mlx_tiny_llama.py"
    runpy.run_path(str(script), run_name="__main__")
    out = capsys.readouterr().out
    assert "row scales: routes {'dense': 1, 'mxfp8': 56}" in out
    assert "128x128 blocks: routes {'dense': 1, 'packed': 56}" in out
    gaps = [float(g) for g in re.findall(r"torch vs MLX: (\S+)", out)]
    assert len(gaps) == 2 and max(gaps) < 1e-3  # logits reach about 16: FP32 order only
    agreed = [int(a) for a in re.findall(r"greedy tokens agree: (\d+)/48", out)]
    assert len(agreed) == 2 and min(agreed) > 0
