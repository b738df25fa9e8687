"""Calibration statistics across processes (``floatxq.lifecycle.distributed``): gloo processes
on the CPU fold their shares of the batches in batch order, as one process folds them all."""

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from floatxq.lifecycle.distributed import BatchFold, ProcessShare, shard_batches
from floatxq.stats import HEADROOM, HESSIAN, RUNNING_AMAX

K = 32


def _batches() -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return [torch.randn(5 + i, K, generator=gen) * (i + 1) for i in range(7)]


def _fold(batches):
    states = {"hessian": HESSIAN.init(K), "amax": RUNNING_AMAX.init()}
    for x in batches:
        states = {"hessian": HESSIAN.update(states["hessian"], x),
                  "amax": RUNNING_AMAX.update(states["amax"], x)}  # fmt: skip
    return states


def _folded(group) -> dict:
    """This process's share of the batches through a :class:`BatchFold` over ``group``."""
    stats = {"hessian": HESSIAN, "amax": RUNNING_AMAX}
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    share = ProcessShare(group, rank, world, len(_batches()))
    fold = BatchFold(stats, {"hessian": HESSIAN.init(K), "amax": RUNNING_AMAX.init()}, share)
    for x in shard_batches(_batches(), rank, world):
        fold.add(x)
    return {k: tuple(v) for k, v in fold.states().items()}


def _rank(rank: int, world: int, init: str, out: str, job) -> None:
    """One gloo process: ``job(group)`` saved to ``out.RANK``."""
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        torch.save(job(dist.group.WORLD), f"{out}.{rank}")
    finally:
        dist.destroy_process_group()


def _spawn(tmp_path, job, world: int) -> list:
    init = f"file://{tmp_path / 'rendezvous'}"
    out = str(tmp_path / "result")
    mp.spawn(_rank, args=(world, init, out, job), nprocs=world, join=True)
    return [torch.load(f"{out}.{r}") for r in range(world)]


@pytest.mark.parametrize("world", [1, 2, 3])
def test_processes_fold_their_shares_into_the_one_process_statistics(tmp_path, world):
    """Any value, any share: the batch-order fold across processes is the one-process fold
    bit for bit (the same FP32 additions in the same order), on every process."""
    results = _spawn(tmp_path, _folded, world)
    for other in results[1:]:  # every process holds the same bits
        for key in results[0]:
            for a, b in zip(results[0][key], other[key], strict=True):
                assert torch.equal(a, b)
    whole = _fold(_batches())
    xtx, rows = results[0]["hessian"]
    assert int(rows) == int(whole["hessian"].rows)
    assert torch.equal(results[0]["amax"][0], whole["amax"].amax)
    assert torch.equal(xtx, whole["hessian"].xtx)


def test_shards_cover_the_batches_in_order_and_bad_input_is_refused():
    for n in range(7):
        for world in range(1, 5):
            parts = [shard_batches(list(range(n)), r, world) for r in range(world)]
            assert sorted(b for part in parts for b in part) == list(range(n))
            assert all(b % world == r for r, part in enumerate(parts) for b in part)
            assert max(map(len, parts)) - min(map(len, parts)) <= 1
    with pytest.raises(ValueError, match="rank 2 of world 2"):
        shard_batches([1, 2], 2, 2)
    with pytest.raises(ValueError, match="has no merge"):
        share = ProcessShare(None, 0, 2, 4)
        BatchFold({"headroom": HEADROOM}, {"headroom": HEADROOM.init()}, share)
    fold = BatchFold({"amax": RUNNING_AMAX}, {"amax": RUNNING_AMAX.init()})  # no group: local
    fold.add(torch.tensor([[1.0, -4.0]]))
    assert fold.states()["amax"].amax.item() == 4.0


def _gptq_split(group) -> dict:
    return _gptq(group, split_rows=True)


def _gptq(group, split_rows: bool = False) -> dict:
    """The tiny Llama's GPTQ run (this process's share of 8 batches with ``group``)."""
    import floatxq as fq
    import floatxq.lifecycle.gptq as gptq
    from floatxq.lifecycle.calibration import prepare_calibration
    from floatxq.lifecycle.gptq import quantize_gptq_model
    from floatxq.nn.gptq_linear import GPTQLinear
    from floatxq.tiny import TINY_LLAMA_DIR, calibration_samples

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # CPU kernels pick their blocking by thread count: one for all
    real, solved = gptq._solve_module, []
    gptq._solve_module = lambda name, *args: solved.append(name) or real(name, *args)
    real_solve, rows = gptq.gptq_solve, []
    gptq.gptq_solve = lambda w, *args: rows.append(w.shape[0]) or real_solve(w, *args)
    try:
        model = fq.load(TINY_LLAMA_DIR).model
        samples = calibration_samples(num_samples=8, seq_len=64)
        prepared = prepare_calibration(samples, batch_size=1)
        config = fq.GPTQConfig(bits=4, group_size=32)
        cpu = torch.device("cpu")
        report = quantize_gptq_model(
            model, config, prepared, device=cpu, process_group=group, split_rows=split_rows
        )
    finally:
        torch.set_num_threads(threads)
        gptq._solve_module = real
        gptq.gptq_solve = real_solve
    codes = {n: m.qweight.clone() for n, m in model.named_modules() if isinstance(m, GPTQLinear)}
    return {"loss": {m.name: m.loss for m in report.modules}, "codes": codes, "solved": solved,
            "rows": rows}  # fmt: skip


def test_two_processes_solve_the_tiny_llama_as_one_does(tmp_path):
    """GPTQ with the calibration shared by two gloo processes: the Hessians are folded in batch
    order across them, so both solve exactly the codes and losses of one process's run."""
    ranks = _spawn(tmp_path, _gptq, 2)
    one = _gptq(None)
    assert ranks[0]["loss"] == ranks[1]["loss"]
    for name, codes in ranks[0]["codes"].items():
        assert torch.equal(codes, ranks[1]["codes"][name])
    assert ranks[0]["loss"].keys() == one["loss"].keys() and len(one["loss"]) == 56
    for name, codes in one["codes"].items():  # the one-process bits
        assert torch.equal(codes, ranks[0]["codes"][name]), name
    assert ranks[0]["loss"] == one["loss"]
    # each module solved once, by one process; q | k, v and gate | up split, o and down alone
    assert sorted(ranks[0]["solved"] + ranks[1]["solved"]) == sorted(one["solved"])
    assert len(ranks[0]["solved"]) == 32 and len(ranks[1]["solved"]) == 24


def _nvfp4(group) -> dict:
    """The tiny Llama's NVFP4 GPTQ / W4A4 run (this process's share with ``group``)."""
    import floatxq as fq
    from floatxq.lifecycle.calibration import prepare_calibration
    from floatxq.lifecycle.nvfp4_calibrated import quantize_nvfp4_calibrated
    from floatxq.nn.fp4_linear import TorchFP4Linear
    from floatxq.tiny import TINY_LLAMA_DIR, calibration_samples

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as _gptq
    try:
        model = fq.load(TINY_LLAMA_DIR).model
        prepared = prepare_calibration(calibration_samples(num_samples=6, seq_len=64))
        config = fq.NVFP4Config(method="gptq", activations="nvfp4")
        cpu = torch.device("cpu")
        quantize_nvfp4_calibrated(model, config, prepared, device=cpu, process_group=group)
    finally:
        torch.set_num_threads(threads)
    return {n: dict(m.state_dict()) for n, m in model.named_modules()
            if isinstance(m, TorchFP4Linear)}  # fmt: skip


def test_three_processes_calibrate_nvfp4_as_one_does(tmp_path):
    """NVFP4 GPTQ with W4A4 input scales (the layer-by-layer driver): Hessians and activation
    maxima folded in batch order across three processes give one process's buffers exactly."""
    results = _spawn(tmp_path, _nvfp4, 3)
    one = _nvfp4(None)
    assert len(one) == 56
    for rank, got in enumerate(results):
        for name, buffers in one.items():
            for key, value in buffers.items():
                assert torch.equal(got[name][key], value), (rank, name, key)


def test_two_processes_splitting_rows_solve_half_of_every_module(tmp_path):
    """``split_rows``: each process solves half the rows of every module and both end with the
    joined solutions; on this CPU the codes are one process's too, and the losses agree to FP64
    rounding (the parts' losses are summed in another order)."""
    ranks = _spawn(tmp_path, _gptq_split, 2)
    one = _gptq(None)
    assert ranks[0]["solved"] == ranks[1]["solved"] == one["solved"]
    assert ranks[0]["rows"] == ranks[1]["rows"] == [r // 2 for r in one["rows"]]
    for name, codes in one["codes"].items():
        assert torch.equal(ranks[0]["codes"][name], ranks[1]["codes"][name])
        assert torch.equal(codes, ranks[0]["codes"][name]), name
    assert ranks[0]["loss"] == ranks[1]["loss"]
    for name, loss in one["loss"].items():
        assert ranks[0]["loss"][name] == pytest.approx(loss, rel=1e-12, abs=0)
