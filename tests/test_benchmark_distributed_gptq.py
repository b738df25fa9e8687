"""The distributed GPTQ benchmark (``benchmarks/distributed_gptq.py``): its ``--cpu`` smoke mode
end to end (torchrun with one and with two gloo processes give the same codes and losses), and
its comparison of two runs on synthetic records."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
_PATH = ROOT / "benchmarks" / "distributed_gptq.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("distributed_gptq_under_test", _PATH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _run(name, hashes, losses, seconds, ranks_agree=True):
    return {
        "processes": name, "quantize_seconds": seconds, "hashes": hashes, "losses": losses,
        "ranks_agree": ranks_agree,
    }  # fmt: skip


def test_compare_names_the_modules_whose_codes_differ(bench):
    base = _run(1, {"a": "1", "b": "2"}, {"a": 1.0, "b": 4.0}, 10.0)
    same = bench.compare(base, _run(2, {"a": "1", "b": "2"}, {"a": 1.0, "b": 4.0}, 4.0))
    assert same["codes_equal"] and same["speedup"] == 2.5 and same["max_rel_loss_diff"] == 0.0
    other = bench.compare(base, _run(2, {"a": "1", "b": "3"}, {"a": 1.0, "b": 5.0}, 5.0))
    assert not other["codes_equal"] and other["modules_differing"] == ["b"]
    assert other["max_rel_loss_diff"] == 0.25 and other["losses_compared"] == 2
    split = bench.compare(base, _run(2, base["hashes"], base["losses"], 5.0, ranks_agree=False))
    assert not split["codes_equal"]  # the processes of the run disagree with each other


def test_the_cpu_smoke_run_gives_one_processs_codes_with_two(tmp_path):
    out = tmp_path / "r.json"
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK")}
    done = subprocess.run(
        [sys.executable, str(_PATH), "--cpu", "--gpus", "1,2", "--out", str(out)],
        capture_output=True, text=True, env=env, cwd=ROOT, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    record = json.loads(out.read_text())
    one, two = record["runs"]["1"], record["runs"]["2"]
    assert (one["processes"], two["processes"]) == (1, 2)
    assert two["backend"] == "gloo" and [p["rank"] for p in two["per_process"]] == [0, 1]
    assert len(one["hashes"]) == 14  # 2 layers x 7 linears, lm_head left alone
    assert two["hashes"] == one["hashes"] and two["ranks_agree"]
    assert two["losses"] == one["losses"] and len(one["losses"]) == 14
    assert [row["codes_equal"] for row in record["comparison"]] == [True, True]
    assert record["comparison"][1]["max_rel_loss_diff"] == 0.0


def test_the_projection_divides_the_forwards_and_spreads_each_groups_solves(bench):
    """One layer: 19 s of solves in a 40 s run; two processes take 21/2 s of the rest, then per
    input group the slower process: q (4) against k+v (2), o (2), gate | up (3), down (5)."""
    solves = {"q_proj": 4.0, "k_proj": 1.0, "v_proj": 1.0, "o_proj": 2.0, "gate_proj": 3.0,
              "up_proj": 3.0, "down_proj": 5.0}  # fmt: skip
    parent = {"q": "self_attn", "k": "self_attn", "v": "self_attn", "o": "self_attn"}
    named = {
        f"model.layers.0.{parent.get(leaf[0], 'mlp')}.{leaf}": seconds
        for leaf, seconds in solves.items()
    }
    run = {"quantize_seconds": 40.0, "solve_seconds": named}
    assert bench.project(run, 1) == pytest.approx(40.0)
    assert bench.project(run, 2) == pytest.approx(21.0 / 2 + 4 + 2 + 3 + 5)
