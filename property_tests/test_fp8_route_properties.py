"""Properties of the FP8 route policy ``select_fp8_route``: the route it returns can run, nothing
faster could, and its reason is silent exactly when the fastest candidate runs.

The policy is pure, so every GPU, torch and Triton situation is drawn here as a facts record on
any machine. Eligibility is restated below from the routes' requirements (what cuBLAS, the fused
kernel and ``torch.compile`` accept), independently of the policy's code.
"""

import dataclasses

import torch
from hypothesis import example, given
from hypothesis import strategies as st

from floatxq.dispatch import FP8RouteFacts, FP8RouteTuning, select_fp8_route
from floatxq.formats import FP8_FORMATS

SWITCHABLE = (
    "fp8_small_m",
    "scaled_mm_tensorwise",
    "scaled_mm_rowwise",
    "scaled_mm_blockwise",
    "compiled_cpu",
)
CUDA_ONLY = frozenset(
    {"fp8_small_m", "scaled_mm_tensorwise", "scaled_mm_rowwise", "scaled_mm_blockwise"}
)
LAYOUT_ROUTE = {
    "tensor": "scaled_mm_tensorwise",
    "row": "scaled_mm_rowwise",
    "block": "scaled_mm_blockwise",
}
GRAPH_FIELD = {
    "scaled_mm_tensorwise": "graph_rows_tensorwise",
    "scaled_mm_rowwise": "graph_rows_rowwise",
    "scaled_mm_blockwise": "graph_rows_blockwise",
}
CAPABILITIES = [(7, 5), (8, 0), (8, 6), (8, 9), (9, 0), (10, 0), (12, 0)]
SPOILERS = {
    "device_type": st.sampled_from(["cpu", "mps"]),
    "capability": st.sampled_from(CAPABILITIES),
    "x_dtype": st.sampled_from([torch.float32, torch.float64, torch.float16]),
    "in_features": st.one_of(st.sampled_from([0, 8, 520]), st.integers(0, 1024)),
    "out_features": st.one_of(st.sampled_from([0, 8, 520]), st.integers(0, 1024)),
    "format": st.sampled_from(FP8_FORMATS),
    "block_size": st.sampled_from([(64, 64), (16, 32), (128, 64), (1, 128)]),
    "small_m_unavailable": st.just("Triton is not importable (test)"),
    "has_scaled_mm": st.just(False),
    "has_blockwise_scaled_mm": st.just(False),
    "disabled": st.lists(st.sampled_from(SWITCHABLE), min_size=1, max_size=2, unique=True),
}
"""Each fact that can rule a fast route out, and the values to try for it."""


@st.composite
def fact_kwargs(draw):
    """Keyword arguments of an ``FP8RouteFacts``: a call every fast route accepts, then a few
    facts spoiled (so each rule is met alone and in company; shrinking removes spoilers). The
    record is built in the test body: a strategy must not call type-checked code."""
    method = draw(st.sampled_from(["tensor", "row", "block"]))
    kwargs = dict(
        device_type="cuda",
        capability=(9, 0),
        x_dtype=draw(st.sampled_from([torch.bfloat16, torch.float16])),
        rows=draw(st.one_of(st.integers(1, 40), st.sampled_from([1, 2, 16, 17, 4096]))),
        in_features=128 * draw(st.integers(1, 8)),
        out_features=128 * draw(st.integers(1, 8)),
        format="float8_e4m3fn",
        scale_method=method,
        block_size=(128, 128) if method == "block" else None,
        small_m_unavailable=None,
        capturing=draw(st.booleans()),
        compile_requested=draw(st.booleans()),
        disabled=(),
        has_scaled_mm=True,
        has_blockwise_scaled_mm=True,
    )
    first = draw(st.sampled_from([None, *sorted(SPOILERS)]))
    more = draw(st.lists(st.sampled_from(sorted(SPOILERS)), unique=True, max_size=3))
    for name in dict.fromkeys([first, *more]):
        if name is not None and (name != "block_size" or method == "block"):
            kwargs[name] = draw(SPOILERS[name])
    if kwargs["device_type"] != "cuda":
        kwargs["capability"] = None
    kwargs["disabled"] = tuple((r, f"off in the test ({r})") for r in kwargs["disabled"])
    return kwargs


def tuning_kwargs():
    return st.fixed_dictionaries(
        {
            "small_m_rows": st.integers(0, 32),
            "graph_rows_tensorwise": st.integers(0, 32),
            "graph_rows_rowwise": st.integers(0, 32),
            "graph_rows_blockwise": st.integers(0, 32),
        }
    )


# Pinned: the shipped thresholds and the situations each rule is about.
FAST_H100 = dict(
    device_type="cuda", capability=(9, 0), x_dtype=torch.bfloat16, rows=4, in_features=512,
    out_features=384, format="float8_e4m3fn", scale_method="row", block_size=None,
    small_m_unavailable=None, capturing=False, compile_requested=False, disabled=(),
    has_scaled_mm=True, has_blockwise_scaled_mm=True,
)  # fmt: skip
SHIPPED = dataclasses.asdict(FP8RouteTuning())
SINGLE_SPOILERS = {
    "device_type": ["cpu"],
    "capability": [(8, 0), (8, 9), (10, 0)],
    "x_dtype": [torch.float32],
    "in_features": [520, 0],
    "out_features": [8],
    "format": ["float8_e5m2", "float8_e4m3fnuz", "float8_e8m0fnu"],
    "block_size": [(64, 64)],
    "small_m_unavailable": ["Triton is not importable (test)"],
    "has_scaled_mm": [False],
    "has_blockwise_scaled_mm": [False],
    "disabled": [(("fp8_small_m", "raised"),), (("scaled_mm_{}", "raised"),)],
}


def pinned(test):
    """Pin each layout's fastest decode call, and that call with each single fact spoiled."""
    for method, block, recipe in [
        ("tensor", None, "tensorwise"),
        ("row", None, "rowwise"),
        ("block", (128, 128), "blockwise"),
    ]:
        base = dict(FAST_H100, scale_method=method, block_size=block)
        cases = [base, dict(base, rows=64)]
        for name, values in SINGLE_SPOILERS.items():
            for value in values:
                if name == "block_size" and method != "block":
                    continue
                if name == "disabled":
                    value = tuple((r.format(recipe), why) for r, why in value)
                case = dict(base, **{name: value})
                if name == "device_type":
                    case["capability"] = None
                cases.append(case)
        for case in cases:
            test = example(case, SHIPPED)(test)
    return test


def _small_m_limit(facts, tuning):
    route = LAYOUT_ROUTE[facts.scale_method]
    if not facts.capturing:
        return tuning.small_m_rows
    return min(tuning.small_m_rows, getattr(tuning, GRAPH_FIELD[route]))


def _scaled_mm_can_run(facts, route):
    """What cuBLAS's FP8 GEMMs accept, as torch exposes them."""
    n, k = facts.out_features, facts.in_features
    common = (
        facts.device_type == "cuda"
        and facts.has_scaled_mm
        and facts.format in ("float8_e4m3fn", "float8_e5m2")
        and facts.x_dtype in (torch.float16, torch.bfloat16)
        and n > 0
        and k > 0
        and n % 16 == 0
        and k % 16 == 0
    )
    if not common:
        return False
    cap = facts.capability
    if route == "scaled_mm_tensorwise":  # x takes the weight's format: two e5m2 are refused
        return cap >= (8, 9) and facts.format == "float8_e4m3fn"
    if route == "scaled_mm_rowwise":
        return cap >= (9, 0)
    return (
        facts.block_size == (128, 128)
        and cap[0] == 9
        and facts.format == "float8_e4m3fn"
        and facts.has_blockwise_scaled_mm
    )


def eligible(route, facts, tuning):
    """Whether ``route`` could compute this call."""
    off = {r for r, _ in facts.disabled}
    if route in off:
        return False
    if route == "dequant_matmul":
        return True
    if route == "compiled_cpu":
        return facts.device_type != "cuda" and facts.compile_requested
    layout_route = LAYOUT_ROUTE[facts.scale_method]
    if route == "fp8_small_m":  # the fused kernel runs the layout route's recipe
        return (
            eligible(layout_route, facts, tuning)
            and facts.small_m_unavailable is None
            and facts.rows <= _small_m_limit(facts, tuning)
        )
    return route == layout_route and _scaled_mm_can_run(facts, route)


def candidates(facts, tuning):
    """The routes a call of this kind could take, fastest first."""
    if facts.device_type != "cuda":
        return ["compiled_cpu", "dequant_matmul"]
    layout_route = LAYOUT_ROUTE[facts.scale_method]
    small = ["fp8_small_m"] if facts.rows <= _small_m_limit(facts, tuning) else []
    return [*small, layout_route, "dequant_matmul"]


@given(fact_kwargs(), tuning_kwargs())
@pinned
@example(FAST_H100, SHIPPED)
@example(dict(FAST_H100, small_m_unavailable="Triton is not importable (test)"), SHIPPED)
@example(dict(FAST_H100, device_type="cpu", capability=None), SHIPPED)
@example(dict(FAST_H100, scale_method="tensor", rows=2, capturing=True), SHIPPED)
@example(dict(FAST_H100, capability=(8, 9)), SHIPPED)
@example(dict(FAST_H100, capability=(8, 9), scale_method="tensor"), SHIPPED)
@example(dict(FAST_H100, capability=(8, 6), scale_method="tensor"), SHIPPED)
@example(dict(FAST_H100, capability=(10, 0), scale_method="block", block_size=(128, 128)), SHIPPED)
@example(dict(FAST_H100, scale_method="block", block_size=(128, 128), rows=17), SHIPPED)
@example(
    dict(FAST_H100, scale_method="block", block_size=(128, 128), has_blockwise_scaled_mm=False),
    SHIPPED,
)
@example(
    dict(FAST_H100, scale_method="block", block_size=(128, 128), format="float8_e5m2"), SHIPPED
)
@example(dict(FAST_H100, format="float8_e5m2", scale_method="tensor"), SHIPPED)
@example(dict(FAST_H100, format="float8_e5m2"), SHIPPED)
@example(dict(FAST_H100, in_features=520), SHIPPED)
def test_the_route_is_the_fastest_eligible_one(kwargs, tuning_kw):
    facts, tuning = FP8RouteFacts(**kwargs), FP8RouteTuning(**tuning_kw)
    route, _ = select_fp8_route(facts, tuning=tuning)
    order = candidates(facts, tuning)
    assert route in order
    assert eligible(route, facts, tuning)
    faster = order[: order.index(route)]
    assert not any(eligible(r, facts, tuning) for r in faster), (route, faster)


@given(fact_kwargs(), tuning_kwargs())
@pinned
@example(FAST_H100, SHIPPED)
@example(dict(FAST_H100, disabled=(("fp8_small_m", "raised"),)), SHIPPED)
@example(dict(FAST_H100, device_type="cpu", capability=None, compile_requested=True), SHIPPED)
def test_reason_is_silent_exactly_when_the_fastest_candidate_runs(kwargs, tuning_kw):
    facts, tuning = FP8RouteFacts(**kwargs), FP8RouteTuning(**tuning_kw)
    route, reason = select_fp8_route(facts, tuning=tuning)
    order = candidates(facts, tuning)
    assert (reason is None) == (route == order[0]), (route, reason)
    for skipped in order[: order.index(route)]:  # each faster route is named
        assert skipped in reason, (skipped, reason)


@given(fact_kwargs(), tuning_kwargs())
@pinned
@example(FAST_H100, SHIPPED)
@example(dict(FAST_H100, rows=64), SHIPPED)
@example(dict(FAST_H100, device_type="cpu", capability=None, compile_requested=True), SHIPPED)
def test_switching_the_chosen_route_off_moves_to_another_and_says_why(kwargs, tuning_kw):
    facts, tuning = FP8RouteFacts(**kwargs), FP8RouteTuning(**tuning_kw)
    route, _ = select_fp8_route(facts, tuning=tuning)
    if route == "dequant_matmul":  # the fallback of last resort is never switched off
        return
    why = "raised RuntimeError: planted"
    off = dataclasses.replace(facts, disabled=(*facts.disabled, (route, why)))
    new_route, reason = select_fp8_route(off, tuning=tuning)
    assert new_route != route
    assert route in reason and why in reason
    order = candidates(facts, tuning)
    assert order.index(new_route) > order.index(route)  # never a faster one


@given(fact_kwargs(), tuning_kwargs(), st.sampled_from(["cpu", "mps", "meta"]))
def test_off_cuda_no_cuda_route_is_taken(kwargs, tuning_kw, device):
    facts = FP8RouteFacts(**dict(kwargs, device_type=device, capability=None))
    route, reason = select_fp8_route(facts, tuning=FP8RouteTuning(**tuning_kw))
    assert route not in CUDA_ONLY
    assert route == "compiled_cpu" or "compiled_cpu" in reason


@given(fact_kwargs(), tuning_kwargs(), st.integers(1, 4096))
@example(dict(FAST_H100, rows=16), SHIPPED, 17)
def test_rows_matter_only_through_the_thresholds(kwargs, tuning_kw, rows):
    """``TorchFP8Linear`` caches the choice by ``min(rows, small_m_rows + 1)`` and asks torch
    about graph capture only where ``capture_matters``: both shortcuts are exact."""
    facts, tuning = FP8RouteFacts(**kwargs), FP8RouteTuning(**tuning_kw)
    other = dataclasses.replace(facts, rows=rows)
    bucket = min(tuning.small_m_rows + 1, facts.rows)
    if min(tuning.small_m_rows + 1, rows) == bucket:
        assert select_fp8_route(other, tuning=tuning) == select_fp8_route(facts, tuning=tuning)
    layout_route = LAYOUT_ROUTE[facts.scale_method]
    if not tuning.capture_matters(facts.rows, layout_route):
        flipped = dataclasses.replace(facts, capturing=not facts.capturing)
        assert select_fp8_route(flipped, tuning=tuning) == select_fp8_route(facts, tuning=tuning)


@given(fact_kwargs())
def test_a_missing_feature_never_makes_a_faster_route(kwargs):
    """Taking a capability away (Triton, a torch API, a newer GPU) keeps or slows the route."""
    facts = FP8RouteFacts(**kwargs)
    order = candidates(facts, FP8RouteTuning())
    before = order.index(select_fp8_route(facts).route)
    worse = [
        dataclasses.replace(facts, small_m_unavailable="no Triton"),
        dataclasses.replace(facts, has_scaled_mm=False),
        dataclasses.replace(facts, has_blockwise_scaled_mm=False),
        dataclasses.replace(facts, compile_requested=False),
    ]
    if facts.device_type == "cuda":
        worse.append(dataclasses.replace(facts, capability=(8, 0)))
    for fewer in worse:
        assert order.index(select_fp8_route(fewer).route) >= before
