"""A calibrated run shared by processes on CUDA: two processes on one GPU (gloo, CUDA tensors
staged through host memory) and, where there are two GPUs, one per GPU over NCCL; both give one
process's codes bit for bit."""

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

pytestmark = pytest.mark.gpu

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _job(group, device: torch.device) -> dict:
    """GPTQ, NVFP4 GPTQ with W4A4 scales, NVFP4 round to nearest and FP8 with weight-only GSQ of
    the tiny Llama on ``device``: every buffer."""
    import floatxq as fq
    from floatxq.lifecycle.calibration import prepare_calibration
    from floatxq.lifecycle.fp8 import quantize_fp8_modules
    from floatxq.lifecycle.gptq import quantize_gptq_model
    from floatxq.lifecycle.nvfp4 import quantize_nvfp4_modules
    from floatxq.lifecycle.nvfp4_calibrated import quantize_nvfp4_calibrated
    from floatxq.tiny import TINY_LLAMA_DIR, calibration_samples

    prepared = prepare_calibration(calibration_samples(num_samples=8, seq_len=64))
    out = {}
    model = fq.load(TINY_LLAMA_DIR).model
    config = fq.GPTQConfig(bits=4, group_size=32)
    quantize_gptq_model(model, config, prepared, device=device, process_group=group)
    out["gptq"] = {k: v.cpu() for k, v in model.state_dict().items()}
    model = fq.load(TINY_LLAMA_DIR).model
    config = fq.NVFP4Config(method="gptq", activations="nvfp4")
    quantize_nvfp4_calibrated(model, config, prepared, device=device, process_group=group)
    out["nvfp4"] = {k: v.cpu() for k, v in model.state_dict().items()}
    model = fq.load(TINY_LLAMA_DIR).model  # weight-only: modules spread, built on the GPU
    config = fq.NVFP4Config(global_scale="fused")
    quantize_nvfp4_modules(model, config, device=device, work_device=device, process_group=group)
    out["nvfp4-rtn"] = {k: v.cpu() for k, v in model.state_dict().items()}
    model = fq.load(TINY_LLAMA_DIR).model
    config = fq.FP8Config(gsq=fq.GSQConfig(steps=5, modules=[r".*o_proj"]))
    quantize_fp8_modules(model, config, device=device, work_device=device, process_group=group)
    out["fp8-gsq"] = {k: v.cpu() for k, v in model.state_dict().items()}
    return out


def _rank(rank: int, world: int, init: str, out: str, backend: str, same_gpu: bool) -> None:
    device = torch.device("cuda", 0 if same_gpu else rank)
    torch.cuda.set_device(device)
    dist.init_process_group(backend, init_method=init, rank=rank, world_size=world)
    try:
        torch.save(_job(dist.group.WORLD, device), f"{out}.{rank}")
    finally:
        dist.destroy_process_group()


@needs_cuda
@pytest.mark.parametrize(
    "backend,same_gpu",
    [
        ("gloo", True),
        pytest.param(
            "nccl",
            False,
            marks=pytest.mark.skipif(
                torch.cuda.is_available() and torch.cuda.device_count() < 2,
                reason="needs two GPUs",
            ),
        ),
    ],
)
def test_two_processes_on_cuda_give_one_processs_buffers(tmp_path, backend, same_gpu):
    init = f"file://{tmp_path / 'rendezvous'}"
    out = str(tmp_path / "result")
    mp.spawn(_rank, args=(2, init, out, backend, same_gpu), nprocs=2, join=True)
    one = _job(None, torch.device("cuda", 0))
    for rank in range(2):
        got = torch.load(f"{out}.{rank}")
        for method, state in one.items():
            assert got[method].keys() == state.keys()
            for key, value in state.items():
                assert torch.equal(got[method][key], value), (rank, method, key)


@needs_cuda
@pytest.mark.parametrize("out,k,extra", [(4096, 14336, {}), (1024, 4096, {"desc_act": True})])
def test_row_slices_solve_as_the_whole_on_cuda(out, k, extra):
    """What ``split_rows`` relies on, at Llama-3-8B shapes on this GPU: GPTQ of row slices with
    the same Hessian gives the whole solve's rows bit for bit (on CPUs at small row counts it
    does not always, so ``split_rows`` is opt-in)."""
    import floatxq as fq
    from floatxq.lifecycle.gptq import gptq_solve_options

    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(out, k, generator=gen).cuda()
    x = torch.randn(2 * k, k, generator=gen).cuda()
    hessian = x.T @ x * (2 / x.shape[0])
    options = gptq_solve_options(
        fq.GPTQConfig(
            bits=4, group_size=128, **extra, **({"act_group_aware": False} if extra else {})
        )
    )
    whole = fq.gptq_solve(weight, hessian, options)
    for parts in (2, 4):
        step = out // parts
        pieces = [
            fq.gptq_solve(weight[i : i + step], hessian, options) for i in range(0, out, step)
        ]
        for field in ("codes", "scales", "zeros", "dequantized"):
            joined = torch.cat([getattr(p, field) for p in pieces])
            assert torch.equal(joined, getattr(whole, field)), (parts, field)
        total = sum(float(p.loss) for p in pieces)
        assert total == pytest.approx(float(whole.loss), rel=1e-12)
