"""GSQ through the FP8 lifecycle (``FP8Config(gsq=GSQConfig(...))``), on the built-in tiny Llama
cut to its first two decoder layers (every kind of linear, a fraction of the time).

Weight-only GSQ may only lower each weight's reconstruction error; calibrated GSQ lowers each
module's Hessian-weighted error, changes codes, reports every refined module, leaves the modules
it does not select as round to nearest bit for bit, rolls back on failure and is deterministic.
"""

import re
import shutil

import pytest
import torch
from torch import nn

import floatxq as fq
from floatxq.dispatch import gsq_route
from floatxq.nn.fp8_linear import TorchFP8Linear
from floatxq.testing import assert_bitwise_equal
from floatxq.tiny import calibration_samples, load_tiny_llama

LAYERS = 2
ROW = {"format": "e4m3", "weight_scale_method": "row"}


def _tiny(dtype: torch.dtype = torch.float32) -> nn.Module:
    model = load_tiny_llama(dtype=dtype)
    model.model.layers = model.model.layers[:LAYERS]
    model.config.num_hidden_layers = LAYERS
    return model


def _samples() -> list[torch.Tensor]:
    return calibration_samples(num_samples=2, seq_len=32)


def _fp8(model: nn.Module) -> dict[str, TorchFP8Linear]:
    return {n: m for n, m in model.named_modules() if isinstance(m, TorchFP8Linear)}


def _bytes(module: TorchFP8Linear) -> torch.Tensor:
    return module.weight.view(torch.uint8)


def _quantized(config: fq.FP8Config, calibration=None, dtype=torch.float32) -> fq.QuantizedModel:
    return fq.load(_tiny(dtype), quantize_config=config).quantize(calibration, progress=False)


def _layer(name: str) -> int:
    return int(re.match(r"model\.layers\.(\d+)\.", name).group(1))


@pytest.fixture(scope="module")
def originals() -> dict[str, torch.Tensor]:
    return {
        n: m.weight.detach().clone() for n, m in _tiny().named_modules() if type(m) is nn.Linear
    }


@pytest.fixture(scope="module")
def rtn() -> dict[str, TorchFP8Linear]:
    return _fp8(_quantized(fq.FP8Config(**ROW)).model)


def _calibrated_config(**gsq) -> fq.FP8Config:
    return fq.FP8Config(**ROW, gsq=fq.GSQConfig(steps=3, **gsq), gsq_calibration=True)


@pytest.fixture(scope="module")
def calibrated() -> fq.QuantizedModel:
    return _quantized(_calibrated_config(), _samples())


# ------------------------------------------------------------------------------------------------
# weight-only
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("dtype", "config", "moves"),
    [
        (torch.float32, {"format": "e4m3", "weight_scale_method": "tensor"}, False),
        (torch.float32, {"format": "e5m2", "weight_scale_method": "row"}, True),
        (torch.bfloat16, ROW, True),
        (
            torch.bfloat16,
            {"format": "e4m3fnuz", "weight_scale_method": "block", "weight_block_size": (128, 128)},
            True,
        ),
    ],
)
def test_weight_only_gsq_never_raises_a_weights_reconstruction_error(dtype, config, moves):
    linears = [(n, m) for n, m in _tiny(dtype).named_modules() if type(m) is nn.Linear]
    weights = {n: m.weight.detach().clone() for n, m in linears}
    plain = _fp8(_quantized(fq.FP8Config(**config), dtype=dtype).model)
    refined = _quantized(fq.FP8Config(**config, gsq=fq.GSQConfig(steps=3)), dtype=dtype)
    gsq = _fp8(refined.model)
    assert sorted(gsq) == sorted(plain) == sorted(refined.quantized_modules)
    reports = {r.name: r for r in refined.report.modules}
    assert sorted(reports) == sorted(gsq) and refined.report.layers == 0
    changed = 0
    for name, module in gsq.items():
        w = weights[name].double()
        # the export arithmetic: decoded in the weight's dtype
        err = (w - module.dequantize_weight(dtype=dtype).double()).abs()
        base = (w - plain[name].dequantize_weight(dtype=dtype).double()).abs()
        assert (err <= base).all(), name
        relative = float((base**2).sum() / (w**2).sum())
        assert_bitwise_equal(module.weight_scale_inv, plain[name].weight_scale_inv)
        diff = int((_bytes(module) != _bytes(plain[name])).sum())
        report = reports[name]
        assert (report.layer, report.calibrated, report.codes) == (None, False, w.numel())
        assert report.changed == diff and report.objective_after <= report.objective_before
        assert report.objective_before == pytest.approx(relative, rel=1e-9)
        changed += diff
    # round to nearest multiplies by the inverse scale, the export divides by it: where the two
    # disagree on the nearest code, GSQ moves it (none did at this tensor scale)
    assert (changed > 0) == moves


# ------------------------------------------------------------------------------------------------
# calibrated
# ------------------------------------------------------------------------------------------------


def test_calibrated_gsq_lowers_each_modules_hessian_objective(calibrated, rtn, originals):
    report = calibrated.report
    names = sorted(_fp8(calibrated.model))
    assert sorted(r.name for r in report.modules) == names == sorted(rtn)
    assert (report.layers, report.samples, report.tokens) == (LAYERS, 2, 64)
    lower = 0
    for r in report.modules:
        module = calibrated.model.get_submodule(r.name)
        assert r.calibrated and r.layer == _layer(r.name) and r.codes == module.weight.numel()
        assert r.objective_after <= r.objective_before
        lower += r.objective_after < r.objective_before
        assert r.changed == int((_bytes(module) != _bytes(rtn[r.name])).sum()), r.name
        assert_bitwise_equal(module.weight_scale_inv, rtn[r.name].weight_scale_inv)
    assert lower >= len(report.modules) // 2 and sum(r.changed for r in report.modules) > 0
    # modules appear in the order they were refined: layer by layer
    assert [r.layer for r in report.modules] == sorted(r.layer for r in report.modules)


def test_the_first_modules_objective_is_its_calibration_hessians(calibrated, rtn, originals):
    # The first layer's q_proj reads the (unquantized) embeddings' normalized output, so its
    # Hessian is computable here: Σ xᵀx over every calibration token (the ratio drops the 2/N).
    name = "model.layers.0.self_attn.q_proj"
    model, rows = _tiny(), []
    hook = model.get_submodule(name).register_forward_hook(lambda m, a, o: rows.append(a[0]))
    with torch.no_grad():
        for ids in _samples():
            model(input_ids=ids[None])
    hook.remove()
    x = torch.cat([r.reshape(-1, r.shape[-1]) for r in rows]).double()
    h = x.T @ x
    w = originals[name]
    report = next(r for r in calibrated.report.modules if r.name == name)
    gsq = calibrated.model.get_submodule(name)
    before = fq.gsq_objective(w, rtn[name].weight, rtn[name].weight_scale_inv, hessian=h)
    after = fq.gsq_objective(w, gsq.weight, gsq.weight_scale_inv, hessian=h)
    assert report.objective_before == pytest.approx(float(before), rel=1e-4)
    assert report.objective_after == pytest.approx(float(after), rel=1e-4)
    assert after < before


def test_calibrated_output_runs_as_its_dequantized_weights(calibrated):
    reference = _tiny()
    for name, module in _fp8(calibrated.model).items():
        reference.get_submodule(name).weight.data = module.dequantize_weight(dtype=torch.float32)
    ids = _samples()[1][None, :16]
    with torch.no_grad():
        got, want = calibrated.model(input_ids=ids).logits, reference(input_ids=ids).logits
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("layout", ["compressed-tensors", "gptqmodel"])
def test_a_refined_model_saves_and_loads_bit_for_bit(calibrated, tmp_path, layout):
    loaded = fq.load(calibrated.save(tmp_path / layout, layout=layout))
    back = _fp8(loaded.model)
    for name, module in _fp8(calibrated.model).items():
        assert_bitwise_equal(_bytes(back[name]), _bytes(module), msg=name)
        if layout == "gptqmodel":  # inverse scales as they are
            assert_bitwise_equal(back[name].weight_scale_inv, module.weight_scale_inv, msg=name)
        else:  # the FP32 reciprocal of the reciprocal: within an FP32 ulp
            torch.testing.assert_close(
                back[name].weight_scale_inv, module.weight_scale_inv, rtol=2**-23, atol=0
            )


def test_modules_patterns_refine_only_what_they_select(rtn):
    q = _quantized(_calibrated_config(modules=[".*mlp.*"]), _samples())
    fp8 = _fp8(q.model)
    assert sorted(fp8) == sorted(rtn)
    refined = {r.name for r in q.report.modules}
    assert refined == {n for n in fp8 if ".mlp." in n}
    for name, module in fp8.items():
        if name not in refined:  # round to nearest, bit for bit
            assert_bitwise_equal(_bytes(module), _bytes(rtn[name]), msg=name)
    assert sum(int((_bytes(fp8[n]) != _bytes(rtn[n])).sum()) for n in refined) > 0
    reference = _tiny()
    for name, module in fp8.items():
        reference.get_submodule(name).weight.data = module.dequantize_weight(dtype=torch.float32)
    ids = _samples()[0][None, :16]
    with torch.no_grad():
        torch.testing.assert_close(
            q.model(input_ids=ids).logits, reference(input_ids=ids).logits, rtol=1e-5, atol=1e-5
        )


def test_quantized_modules_lists_every_fp8_module_when_gsq_selects_some():
    q = _quantized(_calibrated_config(modules=[".*down_proj"]), _samples())
    assert sorted(q.quantized_modules) == sorted(_fp8(q.model))


# ------------------------------------------------------------------------------------------------
# errors and rollback
# ------------------------------------------------------------------------------------------------


def test_calibrated_gsq_needs_calibration_data():
    model = _tiny()
    before = dict(model.named_modules())
    with pytest.raises(ValueError, match="gsq_calibration=True needs calibration data"):
        fq.load(model, quantize_config=_calibrated_config()).quantize(progress=False)
    assert dict(model.named_modules()) == before


def test_calibrated_gsq_refuses_tensor_scales_when_configured():
    with pytest.raises(ValueError, match="needs weight_scale_method 'row' or 'block'"):
        fq.FP8Config(weight_scale_method="tensor", gsq=fq.GSQConfig(), gsq_calibration=True)
    with pytest.raises(ValueError, match=r"dynamic\['.*'\]: tensor scales"):
        fq.FP8Config(
            **ROW, dynamic={".*down_proj": {"weight_scale_method": "tensor"}},
            gsq=fq.GSQConfig(), gsq_calibration=True,
        )  # fmt: skip
    with pytest.raises(ValueError, match="GSQ is off"):
        fq.FP8Config(**ROW, gsq=fq.GSQConfig(enabled=False), gsq_calibration=True)
    # weight-only GSQ takes tensor scales
    assert fq.FP8Config(weight_scale_method="tensor", gsq=fq.GSQConfig()).gsq is not None


def _state(model: nn.Module) -> tuple[dict, dict]:
    modules = {n: id(m) for n, m in model.named_modules()}
    tensors = {n: t.detach().clone() for n, t in model.state_dict(keep_vars=True).items()}
    return modules, tensors


@pytest.mark.parametrize("calibrated_run", [True, False])
@pytest.mark.parametrize("fail_at", [3, 10])
def test_a_failing_refinement_leaves_the_model_as_it_was(monkeypatch, calibrated_run, fail_at):
    real = fq.refine_fp8_codes_auto
    calls = []

    def flaky(*args, **kwargs):
        calls.append(1)
        if len(calls) == fail_at:
            raise RuntimeError("refinement failed")
        return real(*args, **kwargs)

    monkeypatch.setattr("floatxq.lifecycle.fp8.refine_fp8_codes_auto", flaky)
    model = _tiny()
    modules, tensors = _state(model)
    config = _calibrated_config() if calibrated_run else fq.FP8Config(**ROW, gsq=fq.GSQConfig())
    loaded = fq.load(model, quantize_config=config)
    with pytest.raises(RuntimeError, match="refinement failed"):
        loaded.quantize(_samples() if calibrated_run else None, progress=False)
    assert len(calls) == fail_at  # the failure came after modules had been replaced
    assert {n: id(m) for n, m in model.named_modules()} == modules
    after = model.state_dict(keep_vars=True)
    assert sorted(after) == sorted(tensors)
    for name, tensor in tensors.items():
        assert_bitwise_equal(after[name].detach(), tensor, msg=name)
        assert after[name].device == tensor.device
    assert not loaded.quantized and not model.training


# ------------------------------------------------------------------------------------------------
# determinism
# ------------------------------------------------------------------------------------------------


def test_the_same_seed_gives_the_same_bytes(calibrated):
    again = _fp8(_quantized(_calibrated_config(), _samples()).model)
    for name, module in _fp8(calibrated.model).items():
        assert_bitwise_equal(_bytes(again[name]), _bytes(module), msg=name)


def _problem(seed: int, rows: int, cols: int, fmt: str, method: str, block=None):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, cols, generator=g)
    x = torch.randn(2 * cols, cols, generator=g) @ torch.randn(cols, cols, generator=g)
    x[:, 0] = 0.0  # a dead input
    q = fq.quantize_fp8_weight(w, format=fmt, weight_scale_method=method, weight_block_size=block)
    return w, q, x.T @ x / (2 * cols)


def test_the_seed_drives_the_relaxation():
    w, q, h = _problem(0, 16, 64, "e4m3", "row")
    runs = [
        fq.refine_fp8_codes(w, q.qweight, q.scale_inv, hessian=h,
                            config=fq.GSQConfig(steps=20, seed=seed))
        for seed in range(3)
    ]  # fmt: skip
    assert all(int(r.changed) > 0 for r in runs)
    assert any(not torch.equal(_u8(r.codes), _u8(runs[0].codes)) for r in runs[1:])


def _u8(codes: torch.Tensor) -> torch.Tensor:
    return codes.view(torch.uint8)


# ------------------------------------------------------------------------------------------------
# the route: compiled step halves give the eager bytes


def test_the_route_is_eager_off_cuda_and_compiled_on_cuda(monkeypatch):
    import floatxq.dispatch.gsq as route_module

    route, reason = gsq_route(torch.device("cpu"))
    assert route == "eager" and "cpu" in reason
    monkeypatch.setattr(route_module, "triton_unavailable_reason", lambda device: None)
    assert gsq_route(torch.device("cuda", 0)) == ("compiled", None)
    monkeypatch.setattr(route_module, "triton_unavailable_reason", lambda device: "no triton")
    assert gsq_route(torch.device("cuda", 0)) == ("eager", "no triton")


@pytest.mark.skipif(
    shutil.which("c++") is None and shutil.which("g++") is None,
    reason="Inductor compiles for the CPU with a C++ toolchain",
)
def test_the_compiled_step_halves_give_the_eager_bytes():
    # The CUDA route's twin, compiled for the CPU here (CUDA: the gpu test below): fuzzed shapes,
    # ragged and empty ones included, both formats, row and block scales.
    from floatxq.kernels.gsq import refine_fp8_codes_compiled

    problems = [
        (0, 24, "e4m3", "row", None),
        (1, 5, "e5m2", "row", None),
        (33, 50, "e5m2", "block", (11, 25)),
        (48, 80, "e4m3", "block", (16, 16)),
    ]
    changed = 0
    for i, (rows, cols, fmt, method, block) in enumerate(problems):
        w, q, h = _problem(100 + i, rows, cols, fmt, method, block)
        config = fq.GSQConfig(steps=12, seed=i)
        eager = fq.refine_fp8_codes(w, q.qweight, q.scale_inv, hessian=h, config=config)
        compiled = refine_fp8_codes_compiled(w, q.qweight, q.scale_inv, hessian=h, config=config)
        assert_bitwise_equal(_u8(compiled.codes), _u8(eager.codes))
        assert int(compiled.changed) == int(eager.changed)
        changed += int(eager.changed)
    assert changed > 0


# ------------------------------------------------------------------------------------------------
# CUDA gives the CPU's bytes
# ------------------------------------------------------------------------------------------------

GPU_PROBLEMS = [
    (16, 64, "e4m3", "row", None),
    (37, 96, "e5m2", "row", None),
    (48, 80, "e4m3", "block", (16, 16)),
    (33, 50, "e5m2", "block", (11, 25)),
    (5, 7, "e4m3", "row", None),
    (130, 200, "e5m2", "block", (13, 8)),
]


@pytest.mark.gpu
@pytest.mark.parametrize(("rows", "cols", "fmt", "method", "block"), GPU_PROBLEMS)
def test_refine_gives_the_same_bytes_on_cuda_as_on_cpu(rows, cols, fmt, method, block):
    w, q, h = _problem(rows * cols, rows, cols, fmt, method, block)
    config = fq.GSQConfig(steps=30, candidates=5, seed=7)
    cpu = fq.refine_fp8_codes(w, q.qweight, q.scale_inv, hessian=h, config=config)
    args = (w.cuda(), q.qweight.cuda(), q.scale_inv.cuda())
    assert gsq_route(args[0].device)[0] == "compiled"
    for refine in (fq.refine_fp8_codes, fq.refine_fp8_codes_auto):  # eager, then compiled steps
        gpu = refine(*args, hessian=h.cuda(), config=config)
        assert gpu.codes.is_cuda and int(cpu.changed) > 0
        assert_bitwise_equal(_u8(gpu.codes).cpu(), _u8(cpu.codes))
        assert int(gpu.changed) == int(cpu.changed)
        torch.testing.assert_close(
            gpu.objective_after.cpu(), cpu.objective_after, rtol=1e-9, atol=0
        )


@pytest.mark.gpu
def test_the_calibrated_lifecycle_on_cuda_refines_every_module(calibrated):
    # The CUDA run's Hessians come from CUDA forwards, which round differently from the CPU's, so
    # its bytes are not the CPU run's; given the same inputs the refinement is (test above).
    gpu = fq.load(_tiny(), quantize_config=_calibrated_config(), device="cuda")
    gpu.quantize(_samples(), progress=False)
    cuda = _fp8(gpu.model)
    assert set(cuda) == set(_fp8(calibrated.model))
    for module in cuda.values():
        assert module.weight.is_cuda
    for report in gpu.report.modules:
        assert report.objective_after <= report.objective_before, report.name
    assert sum(r.changed for r in gpu.report.modules) > 0


def test_a_compiled_step_half_turns_eager_once_dynamo_refuses_a_recompile(monkeypatch):
    """The CUDA route's guard: a recompile refusal (Dynamo's per-function limit) makes the
    half run eagerly from then on, with the eager function's result."""
    import torch._dynamo.exc

    from floatxq.kernels import gsq as kernels_gsq

    calls = []

    def half(x):
        calls.append("eager")
        return x + 1

    guarded = kernels_gsq._Guarded(half)

    def refusing(*args, **kwargs):
        calls.append("compiled")
        raise kernels_gsq._RECOMPILE_LIMIT("recompile limit")

    guarded.compiled = refusing
    assert guarded(torch.tensor(1.0)).item() == 2.0
    assert guarded(torch.tensor(2.0)).item() == 3.0
    assert calls == ["compiled", "eager", "eager"] and guarded.eager
    assert issubclass(kernels_gsq._RECOMPILE_LIMIT, Exception) and torch._dynamo.exc
