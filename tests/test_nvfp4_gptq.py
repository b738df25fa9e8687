"""GPTQ onto the NVFP4 grid (``floatxq.nvfp4_gptq_solve``): examples and refusals."""

import pytest
import torch

import floatxq as fq


def _correlated(k: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(512, 8, generator=g)
    x = base @ torch.randn(8, k, generator=g) + 0.1 * torch.randn(512, k, generator=g)
    return 2 * x.T @ x / 512


@pytest.mark.parametrize("recipe", ["nvidia", "least_squares", "exhaustive"])
def test_correlated_inputs_gptq_beats_round_to_nearest(recipe):
    w = torch.randn(32, 128, generator=torch.Generator().manual_seed(3)) * 0.02
    h = _correlated(128, 4)
    g = fq.nvfp4_global_scale(w.abs().amax(), recipe=recipe)
    s = fq.nvfp4_gptq_solve(w, h, g, recipe=recipe)
    assert s.solved and s.loss < 0.8 * s.rtn_loss, (s.loss, s.rtn_loss)
    decoded = fq.nvfp4_dequantize(s.packed, s.block_scales, s.global_scale)
    assert decoded.shape == w.shape and torch.isfinite(decoded).all()


def test_dead_inputs_and_bfloat16_weights():
    w = (torch.randn(4, 32, generator=torch.Generator().manual_seed(0)) * 0.1).bfloat16()
    h = _correlated(32, 1)
    h[5, :] = 0
    h[:, 5] = 0
    s = fq.nvfp4_gptq_solve(w, h, fq.nvfp4_global_scale(w.abs().amax().float()))
    decoded = fq.nvfp4_dequantize(s.packed, s.block_scales, s.global_scale)
    assert s.solved and torch.all(decoded[:, 5] == 0)  # an input never seen gets weight 0


def test_refusals_name_the_problem(production_checks):
    w, h = torch.randn(2, 32), torch.eye(32)
    with pytest.raises(ValueError, match="multiple of 16"):
        fq.nvfp4_gptq_solve(torch.randn(2, 24), torch.eye(24), 1.0)
    with pytest.raises(ValueError, match=r"hessian must be \(32, 32\)"):
        fq.nvfp4_gptq_solve(w, torch.eye(16), 1.0)
    with pytest.raises(ValueError, match="global_scale must be positive"):
        fq.nvfp4_gptq_solve(w, h, 0.0)
    with pytest.raises(ValueError, match="finite"):
        fq.nvfp4_gptq_solve(w.clone().fill_(float("nan")), h, 1.0)
    with pytest.raises(ValueError, match="not positive definite"):
        fq.nvfp4_gptq_solve(w, -torch.eye(32), 1.0, damp_percent=0.0)
    with pytest.raises(ValueError, match="Unsupported NVFP4 scale recipe"):
        fq.nvfp4_gptq_solve(w, h, 1.0, recipe="best")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize(("rows", "k", "blocksize"), [(96, 512, 128), (33, 400, 128), (5, 64, 16)])
def test_cuda_graph_replay_gives_the_eager_bytes(rows, k, blocksize):
    w = (torch.randn(rows, k, generator=torch.Generator().manual_seed(k)) * 0.02).cuda()
    h = _correlated(k, rows).cuda()
    g = fq.nvfp4_global_scale(w.abs().amax(), recipe="nvidia")
    graphed = fq.nvfp4_gptq_solve(w, h, g, blocksize=blocksize)
    eager = fq.nvfp4_gptq_solve(w, h, g, blocksize=blocksize, cuda_graph=False)
    assert torch.equal(graphed.packed, eager.packed)
    assert torch.equal(graphed.loss, eager.loss) and graphed.solved == eager.solved
    cpu = fq.nvfp4_gptq_solve(w.cpu(), h.cpu(), g.cpu(), blocksize=blocksize)
    assert cpu.loss <= cpu.rtn_loss and graphed.loss <= graphed.rtn_loss
