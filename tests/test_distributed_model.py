"""``QuantizedModel.quantize(..., process_group=...)``: two gloo processes on the CPU share the
calibrated methods (in memory and offloaded to disk) and the weight-only ones (in memory), and
write exactly one process's files."""

import filecmp
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import floatxq as fq
from floatxq.tiny import TINY_LLAMA_DIR, calibration_samples

CONFIGS = {
    "gptq": (fq.GPTQConfig(bits=4, group_size=32), None),
    "gptq-v2-asym-lm_head": (
        fq.GPTQConfig(bits=4, group_size=32, sym=False, format="gptq_v2", lm_head=True),
        "gptq",
    ),
    "w4a4-fused": (fq.NVFP4Config(method="gptq", activations="nvfp4", global_scale="fused"), None),
    "gsq-calibrated": (
        fq.FP8Config(gsq=fq.GSQConfig(steps=10, modules=[r".*down_proj"]), gsq_calibration=True),
        None,
    ),
}

WEIGHT_ONLY = {
    "fp8-gsq": fq.FP8Config(gsq=fq.GSQConfig(steps=5, modules=[r".*o_proj"])),
    "nvfp4-rtn": fq.NVFP4Config(global_scale="fused"),
}


def _samples():
    return calibration_samples(num_samples=6, seq_len=64)


def _runs(out: Path, group) -> None:
    """Every config in memory (the first process saves) and offloaded (it writes), into
    ``out/KEY/{memory,offload}``."""
    first = group is None or dist.get_rank(group) == 0
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # CPU kernels block their work by thread count: one everywhere
    try:
        for key, (config, layout) in CONFIGS.items():
            model = fq.load(TINY_LLAMA_DIR, quantize_config=config)
            model.quantize(_samples(), progress=False, process_group=group)
            if first:
                model.save(out / key / "memory", layout=layout)
            offloaded = fq.load(TINY_LLAMA_DIR, quantize_config=config, offload="disk")
            offloaded.quantize(
                _samples(), out=out / key / "offload", layout=layout, progress=False,
                process_group=group,
            )  # fmt: skip
            assert (out / key / "offload").is_dir()  # every process returns once it is written
        if group is not None:  # GPTQ's solves split by rows: one process's files here too
            config = CONFIGS["gptq"][0]
            model = fq.load(TINY_LLAMA_DIR, quantize_config=config)
            model.quantize(_samples(), progress=False, process_group=group, split_rows=True)
            if first:
                model.save(out / "gptq-split" / "memory")
            offloaded = fq.load(TINY_LLAMA_DIR, quantize_config=config, offload="disk")
            offloaded.quantize(
                _samples(), out=out / "gptq-split" / "offload", progress=False,
                process_group=group, split_rows=True,
            )  # fmt: skip
        for key, config in WEIGHT_ONLY.items():  # in memory (offloaded, they are not shared)
            model = fq.load(TINY_LLAMA_DIR, quantize_config=config)
            model.quantize(progress=False, process_group=group)
            if first:
                model.save(out / key / "memory")
    finally:
        torch.set_num_threads(threads)


def _rank(rank: int, world: int, init: str, out: str) -> None:
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        _runs(Path(out), dist.group.WORLD)
        one = calibration_samples(num_samples=1, seq_len=64)
        model = fq.load(TINY_LLAMA_DIR, quantize_config=fq.GPTQConfig(bits=4, group_size=32))
        with pytest.raises(ValueError, match="1 calibration batches cannot be shared by 2"):
            model.quantize(one, progress=False, process_group=dist.group.WORLD)
    finally:
        dist.destroy_process_group()


def _same_files(a: Path, b: Path) -> None:
    names = sorted(os.listdir(a))
    assert names == sorted(os.listdir(b))
    for name in names:
        assert filecmp.cmp(a / name, b / name, shallow=False), (a, name)


def test_two_processes_write_one_processs_files(tmp_path):
    """GPTQ (plain; asymmetric v2 with lm_head), NVFP4 GPTQ with W4A4 input scales and calibrated
    GSQ: shared by two processes, in memory and offloaded, the files are one process's."""
    init = f"file://{tmp_path / 'rendezvous'}"
    mp.spawn(_rank, args=(2, init, str(tmp_path / "two")), nprocs=2, join=True)
    _runs(tmp_path / "one", None)
    for key in CONFIGS:
        for kind in ("memory", "offload"):
            _same_files(tmp_path / "one" / key / kind, tmp_path / "two" / key / kind)
        _same_files(tmp_path / "one" / "gptq" / kind, tmp_path / "two" / "gptq-split" / kind)
    for key in WEIGHT_ONLY:
        _same_files(tmp_path / "one" / key / "memory", tmp_path / "two" / key / "memory")


def test_a_group_is_refused_where_it_cannot_be_used(tmp_path):
    config = fq.GPTQConfig(bits=4, group_size=32)
    with pytest.raises(RuntimeError, match="needs torch.distributed initialised first"):
        fq.load(TINY_LLAMA_DIR, quantize_config=config).quantize(_samples(), process_group=3)
    init = f"file://{tmp_path / 'rendezvous'}"
    dist.init_process_group("gloo", init_method=init, rank=0, world_size=1)
    try:
        group = dist.group.WORLD
        offloaded = fq.load(TINY_LLAMA_DIR, quantize_config=config, offload="disk")
        with pytest.raises(ValueError, match="resume=True is not taken with process_group"):
            offloaded.quantize(_samples(), out=tmp_path / "x", resume=True, process_group=group)
        fp8 = fq.load(TINY_LLAMA_DIR, quantize_config=fq.FP8Config(), offload="disk")
        with pytest.raises(ValueError, match="not shared by a process group"):
            fp8.quantize(out=tmp_path / "y", process_group=group)
        with pytest.raises(ValueError, match="give both a GPTQConfig and a process_group"):
            fq.load(TINY_LLAMA_DIR, quantize_config=fq.FP8Config()).quantize(
                process_group=group, split_rows=True
            )
        model = fq.load(TINY_LLAMA_DIR, quantize_config=config)
        with pytest.raises(ValueError, match="give both a GPTQConfig and a process_group"):
            model.quantize(_samples(), split_rows=True)
        with pytest.raises(TypeError, match="must be a torch.distributed ProcessGroup"):
            model.quantize(_samples(), process_group="world")
        few = calibration_samples(num_samples=1, seq_len=64)
        gptq = fq.load(TINY_LLAMA_DIR, quantize_config=config)
        gptq.quantize(few, progress=False, process_group=group)  # one process: one batch is enough
    finally:
        dist.destroy_process_group()


def test_torchrun_setup_joins_the_run_torchrun_describes(monkeypatch):
    """``torchrun_setup`` reads torchrun's variables (here a one-process run on the CPU: gloo)
    and refuses a script torchrun did not start."""
    import socket

    for name in ("WORLD_SIZE", "LOCAL_RANK", "RANK"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(RuntimeError, match="start the script with torchrun"):
        fq.torchrun_setup()
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    env = {"WORLD_SIZE": "1", "RANK": "0", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(port)}  # fmt: skip
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    group, device = fq.torchrun_setup()
    try:
        assert device == torch.device("cpu")
        assert dist.get_backend(group) == "gloo" and dist.get_world_size(group) == 1
        again, _ = fq.torchrun_setup()  # already joined: the same group
        assert again is group
    finally:
        dist.destroy_process_group()


def test_split_rows_must_be_a_bool(production_checks):
    model = fq.load(TINY_LLAMA_DIR, quantize_config=fq.GPTQConfig(bits=4, group_size=32))
    with pytest.raises(TypeError, match="split_rows must be a bool, got int"):
        model.quantize(_samples(), split_rows=1)
