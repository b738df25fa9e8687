"""``select_fp8_route``: the reasons it gives and the records it takes, case by case.

Every situation is a facts record, so a machine without CUDA or Triton checks what an H100 with a
broken Triton install, an Ada GPU or a CUDA graph capture would get. The general invariants
(eligibility, fastest-first, silence exactly at the fastest candidate) are hypothesis properties
in ``property_tests/test_fp8_route_properties.py``.
"""

import dataclasses

import pytest
import torch
from torch import nn

import floatxq as fq
import floatxq.kernels._triton as triton_env
from floatxq.dispatch import FP8RouteFacts, FP8RouteTuning, select_fp8_route
from floatxq.kernels import triton_unavailable_reason
from floatxq.nn import TorchFP8Linear
from floatxq.testing import unchecked

H100_DECODE = FP8RouteFacts(
    device_type="cuda", capability=(9, 0), x_dtype=torch.bfloat16, rows=4, in_features=512,
    out_features=384, format="float8_e4m3fn", scale_method="row",
)  # fmt: skip


def _facts(**changes):
    return dataclasses.replace(H100_DECODE, **changes)


def test_the_fastest_route_runs_silently():
    assert select_fp8_route(H100_DECODE) == ("fp8_small_m", None)
    assert select_fp8_route(_facts(rows=17)) == ("scaled_mm_rowwise", None)


def test_without_triton_the_reason_says_so(monkeypatch):
    monkeypatch.setattr(triton_env, "_import_error", lambda: "ModuleNotFoundError: no triton")
    why = triton_unavailable_reason(torch.device("cuda"))
    route, reason = select_fp8_route(_facts(small_m_unavailable=why))
    assert route == "scaled_mm_rowwise"
    assert reason == "fp8_small_m: Triton is not importable (ModuleNotFoundError: no triton)"
    # Prefill-sized calls never wanted the fused kernel: nothing to report.
    assert select_fp8_route(_facts(small_m_unavailable=why, rows=64)).reason is None


def test_without_cuda_the_reason_names_the_cuda_routes_and_the_opt_in():
    route, reason = select_fp8_route(_facts(device_type="cpu", capability=None))
    assert route == "dequant_matmul"
    assert "need CUDA" in reason and "fp8_small_m" in reason and "scaled_mm" in reason
    assert "compiled_cpu is opt-in (call optimize())" in reason
    opted = _facts(device_type="cpu", capability=None, compile_requested=True)
    assert select_fp8_route(opted) == ("compiled_cpu", None)
    off = dataclasses.replace(opted, disabled=(("compiled_cpu", "disabled after an error (X)"),))
    assert select_fp8_route(off) == (
        "dequant_matmul",
        "compiled_cpu: disabled after an error (X)",
    )


@pytest.mark.parametrize(
    ("changes", "route", "words"),
    [
        ({"capability": (8, 9)}, "dequant_matmul", "SM 8.9 < 9.0"),
        ({"capability": (8, 6), "scale_method": "tensor"}, "dequant_matmul", "SM 8.6 < 8.9"),
        ({"capability": (8, 9), "scale_method": "tensor"}, "fp8_small_m", None),
        ({"x_dtype": torch.float32}, "dequant_matmul", "float16/bfloat16"),
        ({"in_features": 520}, "dequant_matmul", "multiples of 16"),
        ({"format": "float8_e4m3fnuz"}, "dequant_matmul", "fnuz"),
        ({"format": "float8_e8m0fnu"}, "dequant_matmul", "decode-only"),
        ({"format": "float8_e5m2", "scale_method": "tensor"}, "dequant_matmul", "two e5m2"),
        ({"format": "float8_e5m2"}, "fp8_small_m", None),
        (
            {"scale_method": "block", "block_size": (64, 64)},
            "dequant_matmul",
            "[128, 128] blocks only",
        ),
        (
            {"scale_method": "block", "block_size": (128, 128), "capability": (10, 0)},
            "dequant_matmul",
            "SM 9.x only",
        ),
        (
            {"scale_method": "block", "block_size": (128, 128), "has_blockwise_scaled_mm": False},
            "dequant_matmul",
            "no torch.nn.functional.scaled_mm",
        ),
        ({"has_scaled_mm": False}, "dequant_matmul", "no torch._scaled_mm"),
    ],
)
def test_each_gate_names_its_cause(changes, route, words):
    got, reason = select_fp8_route(_facts(**changes))
    assert got == route
    if words is None:
        assert reason is None
    else:  # a decode-sized call: the fused kernel is named with the scaled_mm route it mirrors
        assert words in reason and "fp8_small_m" in reason and "scaled_mm_" in reason


@pytest.mark.parametrize(
    ("method", "block", "rows", "route"),
    [
        ("tensor", None, 1, "fp8_small_m"),
        ("tensor", None, 2, "scaled_mm_tensorwise"),
        ("row", None, 16, "fp8_small_m"),
        ("row", None, 17, "scaled_mm_rowwise"),
        ("block", (128, 128), 16, "fp8_small_m"),
        ("block", (128, 128), 64, "scaled_mm_blockwise"),
    ],
)
def test_graph_capture_keeps_the_kernel_only_where_it_is_the_faster_gpu_code(
    method, block, rows, route
):
    facts = _facts(scale_method=method, block_size=block, rows=rows, capturing=True)
    assert select_fp8_route(facts) == (route, None)
    eager = dataclasses.replace(facts, capturing=False)
    assert select_fp8_route(eager).route == ("fp8_small_m" if rows <= 16 else route)


def test_tuning_moves_the_thresholds():
    tuning = FP8RouteTuning(small_m_rows=4, graph_rows_rowwise=2)
    assert select_fp8_route(_facts(rows=4), tuning=tuning).route == "fp8_small_m"
    assert select_fp8_route(_facts(rows=5), tuning=tuning) == ("scaled_mm_rowwise", None)
    capturing = _facts(rows=3, capturing=True)
    assert select_fp8_route(capturing, tuning=tuning) == ("scaled_mm_rowwise", None)
    assert tuning.capture_matters(3, "scaled_mm_rowwise")
    assert not tuning.capture_matters(2, "scaled_mm_rowwise")
    assert not tuning.capture_matters(5, "scaled_mm_rowwise")
    off = FP8RouteTuning(small_m_rows=0)
    assert select_fp8_route(_facts(rows=1), tuning=off) == ("scaled_mm_rowwise", None)


@pytest.mark.parametrize(
    ("changes", "error", "match"),
    [
        ({"rows": 0}, ValueError, "rows must be >= 1"),
        ({"in_features": -1}, ValueError, "in_features"),
        ({"rows": 2.0}, TypeError, "rows must be an int"),
        ({"format": "float8"}, ValueError, "format must be one of"),
        ({"scale_method": "column"}, ValueError, "scale_method must be one of"),
        ({"scale_method": "block"}, ValueError, "block_size is given exactly"),
        ({"block_size": (128, 128)}, ValueError, "block_size is given exactly"),
        ({"capability": None}, ValueError, "capability is given exactly"),
        ({"device_type": "cpu"}, ValueError, "capability is given exactly"),
        ({"disabled": (("dequant_matmul", "x"),)}, ValueError, "disabled routes must be"),
        (
            {"disabled": (("fp8_small_m", "a"), ("fp8_small_m", "b"))},
            ValueError,
            "more than once",
        ),
    ],
)
def test_facts_reject_what_no_call_has(changes, error, match):
    kwargs = {f.name: getattr(H100_DECODE, f.name) for f in dataclasses.fields(H100_DECODE)}
    with pytest.raises(error, match=match):
        unchecked(FP8RouteFacts.__init__)(
            FP8RouteFacts.__new__(FP8RouteFacts), **dict(kwargs, **changes)
        )


@pytest.mark.parametrize(
    ("kwargs", "error"),
    [({"small_m_rows": -1}, ValueError), ({"graph_rows_rowwise": True}, TypeError)],
)
def test_tuning_rejects_bad_thresholds(kwargs, error):
    with pytest.raises(error, match=next(iter(kwargs))):
        unchecked(FP8RouteTuning.__init__)(FP8RouteTuning.__new__(FP8RouteTuning), **kwargs)


# ----------------------------------------------------------------------------------------------
# The module reports the policy's answer
# ----------------------------------------------------------------------------------------------


def _cpu_layer():
    torch.manual_seed(0)
    return TorchFP8Linear.from_linear(nn.Linear(64, 48), weight_scale_method="tensor")


def test_a_cpu_module_reports_why_the_compiled_route_did_not_run():
    layer = _cpu_layer()
    x = torch.randn(3, 64)
    layer(x)
    facts = FP8RouteFacts(
        device_type="cpu", x_dtype=torch.float32, rows=3, in_features=64, out_features=48,
        format="float8_e4m3fn", scale_method="tensor",
    )  # fmt: skip
    assert (layer.last_route, layer.last_fallback_reason) == select_fp8_route(facts)
    assert layer.last_fallback_reason is not None and "optimize()" in layer.last_fallback_reason


def test_module_tuning_is_a_frozen_record_and_replacing_it_drops_cached_choices():
    layer = _cpu_layer()
    layer(torch.randn(2, 64))
    assert layer._runtime.choices
    layer.route_tuning = FP8RouteTuning(small_m_rows=4)
    assert layer.route_tuning.small_m_rows == 4 and not layer._runtime.choices
    with pytest.raises(TypeError, match="FP8RouteTuning"):
        layer.route_tuning = {"small_m_rows": 4}
    with pytest.raises(dataclasses.FrozenInstanceError):
        layer.route_tuning.small_m_rows = 8  # type: ignore[misc]


def test_the_policy_is_exported_at_the_top_level():
    assert fq.select_fp8_route is select_fp8_route
    assert fq.FP8RouteFacts is FP8RouteFacts and fq.FP8RouteTuning is FP8RouteTuning
