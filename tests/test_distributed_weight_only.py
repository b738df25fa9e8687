"""Weight-only FP8 and NVFP4 quantization spread over a process group
(``quantize_fp8_modules`` / ``quantize_nvfp4_modules`` with ``process_group``): gloo processes
on the CPU each build a share of the modules and send them to the others, so every process ends
with one process's model bit for bit; a build that fails on its process fails on all."""

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

VICTIM = "model.layers.3.mlp.up_proj"
"""The module whose build the failure run makes raise."""
CALLED = "model.layers.1."
"""The modules called once before they are sent (:func:`_run`)."""


def _configs() -> dict:
    import floatxq as fq

    gsq = fq.GSQConfig(steps=4, modules=[r"model\.layers\.[01]\.self_attn\.[kv]_proj"])
    return {
        "fp8_row": fq.FP8Config(weight_scale_method="row"),
        "fp8_block": fq.FP8Config(weight_block_size=[128, 128]),
        "fp8_gsq": fq.FP8Config(weight_scale_method="row", gsq=gsq),
        "nvfp4": fq.NVFP4Config(global_scale="fused"),
    }


def _quantize(config, group, *, fail: bool = False) -> dict:
    """The tiny Llama quantized with ``config`` over ``group``: the quantized modules' buffers,
    the modules this process built, the ``on_module`` calls and the GSQ reports (timings
    dropped); with ``fail``, :data:`VICTIM`'s build raises and the exception and whether the
    model came back as it was are returned instead."""
    import floatxq as fq
    import floatxq.lifecycle.fp8 as fp8_lifecycle
    import floatxq.lifecycle.nvfp4 as nvfp4_lifecycle
    from floatxq.tiny import TINY_LLAMA_DIR

    model = fq.load(TINY_LLAMA_DIR).model
    before = {k: v.clone() for k, v in model.state_dict().items()}
    built: list[str] = []
    called: list[str] = []
    reports: list = []
    fp8_module, quantized = fp8_lifecycle.fp8_module, nvfp4_lifecycle._quantized

    def counted_fp8(name, module, config, **options):
        built.append(name)
        if fail and name == VICTIM:
            raise ValueError("refused for the test")
        result = fp8_module(name, module, config, **options)
        return (_run(result[0]), result[1]) if name.startswith(CALLED) else result

    def counted_nvfp4(linear, amax, recipe):
        built.append(next(n for n, m in model.named_modules() if m is linear))
        result = quantized(linear, amax, recipe)
        return _run(result) if built[-1].startswith(CALLED) else result

    fp8_lifecycle.fp8_module, nvfp4_lifecycle._quantized = counted_fp8, counted_nvfp4
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # CPU kernels pick their blocking by thread count: one for all
    try:
        if isinstance(config, fq.NVFP4Config):
            nvfp4_lifecycle.quantize_nvfp4_modules(
                model, config, on_module=called.append, process_group=group
            )
        else:
            fp8_lifecycle.quantize_fp8_modules(
                model, config, on_module=called.append, reports=reports, process_group=group
            )
    except ValueError as error:
        if not fail:
            raise
        after = model.state_dict()
        same = after.keys() == before.keys() and all(
            torch.equal(after[k], v) for k, v in before.items()
        )
        return {"error": (type(error).__name__, str(error)), "unchanged": same, "called": called}
    finally:
        fp8_lifecycle.fp8_module, nvfp4_lifecycle._quantized = fp8_module, quantized
        torch.set_num_threads(threads)
    assert not fail, "the failing build did not raise"
    from floatxq.nn.fp4_linear import TorchFP4Linear
    from floatxq.nn.fp8_linear import TorchFP8Linear

    kinds = (TorchFP8Linear, TorchFP4Linear)
    buffers = {n: {k: _bytes(v) for k, v in m.state_dict().items()}
               for n, m in model.named_modules() if isinstance(m, kinds)}  # fmt: skip
    return {
        "buffers": buffers,
        "built": built,
        "called": called,
        "reports": [tuple(r._replace(seconds=0.0)) for r in reports],
    }


def _run(module):
    """``module`` after one forward, so it travels with whatever a call caches (route choices,
    prepared operands), which the broadcast must not need to send."""
    module(torch.ones(2, module.in_features))
    assert module.last_route != "none"
    return module


def _bytes(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor``'s bytes (FP8 compares bit for bit as bytes)."""
    return tensor.detach().reshape(-1).contiguous().view(torch.uint8).clone()


def _runs(group) -> dict:
    results = {name: _quantize(config, group) for name, config in _configs().items()}
    results["failure"] = _quantize(_configs()["fp8_row"], group, fail=True)
    return results


def _rank(rank: int, world: int, init: str, out: str) -> None:
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        torch.save(_runs(dist.group.WORLD), f"{out}.{rank}")
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def one() -> dict:
    """One process's runs (no group)."""
    return _runs(None)


@pytest.mark.parametrize("world", [2, 3])
def test_processes_build_each_module_once_and_end_with_one_process_bytes(tmp_path, one, world):
    """FP8 per channel, by block, with GSQ on some modules, and NVFP4 with fused global scales:
    each module built by exactly one process, and every process holds one process's buffers
    bit for bit, its GSQ reports in its order and an ``on_module`` call for every module."""
    init, out = f"file://{tmp_path / 'rendezvous'}", str(tmp_path / "result")
    mp.spawn(_rank, args=(world, init, out), nprocs=world, join=True)
    ranks = [torch.load(f"{out}.{r}") for r in range(world)]
    for method, expected in one.items():
        if method == "failure":
            continue
        names = list(expected["buffers"])
        assert len(names) == 56 and expected["called"] == names, method
        built = [name for result in ranks for name in result[method]["built"]]
        assert sorted(built) == sorted(names), method  # each once, by one process
        assert all(result[method]["built"] for result in ranks), method  # all took a share
        for rank, result in enumerate(ranks):
            got = result[method]
            assert got["called"] == names, (method, rank)
            assert got["reports"] == expected["reports"], (method, rank)
            assert got["buffers"].keys() == expected["buffers"].keys(), (method, rank)
            for name, buffers in expected["buffers"].items():
                assert got["buffers"][name].keys() == buffers.keys(), (method, rank, name)
                for key, value in buffers.items():
                    assert torch.equal(got["buffers"][name][key], value), (method, rank, name)
    assert len(one["fp8_gsq"]["reports"]) == 4
    # A build that raises on its process raises on every process, which all roll back.
    failure = one["failure"]
    assert failure["unchanged"] and VICTIM not in failure["called"]
    for result in ranks:
        assert result["failure"]["error"] == failure["error"]
        assert result["failure"]["unchanged"]
        assert result["failure"]["called"] == failure["called"]
    assert failure["error"] == ("ValueError", f"quantize: module {VICTIM!r}: refused for the test")


def test_a_failure_travels_as_its_type_and_message():
    """What the other processes raise for a build that failed on its owner: the same type and
    message, or a RuntimeError naming the type where the type cannot travel or be rebuilt."""
    import pickle

    from floatxq.lifecycle.distributed import _Failure

    class Local(ValueError):
        pass

    class TwoArguments(Exception):
        def __init__(self, a, b):
            super().__init__(f"{a}/{b}")

    sent = pickle.loads(pickle.dumps(_Failure.of(TypeError("quantize: module 'x': no"))))
    error = sent.error(2)
    assert type(error) is TypeError and str(error) == "quantize: module 'x': no"
    assert error.__notes__ == ["(raised by process 2, which built this module)"]
    local = pickle.loads(pickle.dumps(_Failure.of(Local("bad")))).error(0)
    assert type(local) is RuntimeError and str(local) == "Local: bad"
    odd = _Failure(TwoArguments, "1/2").error(0)
    assert type(odd) is RuntimeError and str(odd) == "TwoArguments: 1/2"
