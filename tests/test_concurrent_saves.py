"""Concurrent saves to one directory: serialized by the target's lock, never destroying each other.

Real processes race: a server subprocess imports floatxq once and forks one saver per request
(each saving a distinct checkpoint of several shards), starting them together at a barrier, or
pausing one at a chosen point of its save (holding the lock) until the test resumes or SIGKILLs
it. Whatever the interleaving: of two saves with ``overwrite=False`` exactly one publishes and the
other gets ``FileExistsError``; with ``overwrite=True`` the target ends as one complete checkpoint;
a killed save leaves no partial directory and no lock that blocks; a live save's temporary folder
is never swept.
"""

import json
import os
import queue
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from floatxq.interop.checkpoint import (
    lock_file,
    recover_interrupted_save,
    write_checkpoint,
)

TENSORS, SIDE, SHARD_BYTES = 6, 256, 300_000  # six 256 KB tensors: six shards of one tensor
TIMEOUT = 60  # seconds any one step may take before the test fails instead of hanging


def _state(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {f"layer{i}.weight": torch.randn(SIDE, SIDE, generator=g) for i in range(TENSORS)}


def _write(path: Path, seed: int, **kwargs) -> Path:
    return write_checkpoint(
        path,
        _state(seed),
        config={"seed": seed},
        quantize_config={"seed": seed},
        max_shard_bytes=SHARD_BYTES,
        **kwargs,
    )


def _snapshot(path: Path) -> dict[str, bytes]:
    return {str(f.relative_to(path)): f.read_bytes() for f in sorted(path.rglob("*"))}


# One JSON request per line on stdin; every event is one JSON line on stdout (os.write of a short
# line is atomic, so the server's and its children's lines never interleave).
_SERVER = """
import json, multiprocessing, os, signal, sys, torch
import floatxq.interop.checkpoint as ckpt
TENSORS, SIDE, SHARD_BYTES = map(int, sys.argv[1:4])
def state(seed):
    g = torch.Generator().manual_seed(seed)
    return {f"layer{i}.weight": torch.randn(SIDE, SIDE, generator=g) for i in range(TENSORS)}
def say(**event):
    event["pid"] = os.getpid()
    os.write(1, (json.dumps(event)[:3000] + "\\n").encode())
def pause_after(name, k):
    module, attr = (os, "replace") if name == "replace" else (ckpt, "save_file")
    real, calls = getattr(module, attr), [0]
    def paused(*args, **kwargs):
        out = real(*args, **kwargs)
        calls[0] += 1
        if calls[0] == k:
            signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1})
            say(event="paused", at=str(args[1]))  # the file written, or the rename's target
            signal.sigwait({signal.SIGUSR1})
        return out
    setattr(module, attr, paused)
def child(req, barrier):
    try:
        if req.get("pause"):
            pause_after(*req["pause"])
        tensors = state(req["seed"])
        if barrier is not None:
            barrier.wait(timeout=60)
        ckpt.write_checkpoint(req["target"], tensors, config={"seed": req["seed"]},
            quantize_config={"seed": req["seed"]}, max_shard_bytes=SHARD_BYTES,
            overwrite=req["overwrite"], lock_timeout=60)
        result = "ok"
    except BaseException as exc:
        result = f"{type(exc).__name__}: {exc}"
    say(event="done", seed=req["seed"], result=result)
children = set()
for line in sys.stdin:
    req = json.loads(line)
    if req["op"] == "start":
        seeds = req.pop("seeds")
        barrier = multiprocessing.get_context("fork").Barrier(len(seeds)) if seeds[1:] else None
        pids = []
        for seed in seeds:
            pid = os.fork()
            if pid == 0:
                child({**req, "seed": seed}, barrier)
                os._exit(0)
            children.add(pid)
            pids.append(pid)
        say(event="started", pids=pids)
    elif req["op"] == "reap":
        _, status = os.waitpid(req["child"], 0)
        children.discard(req["child"])
        say(event="reaped", child=req["child"], killed=os.WIFSIGNALED(status))
for pid in children:  # the test failed midway: stop what it left paused
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
"""


class _Server:
    """The forking saver (see ``_SERVER``), with the events it and its children report."""

    def __init__(self, cwd: Path) -> None:
        args = [sys.executable, "-c", _SERVER, str(TENSORS), str(SIDE), str(SHARD_BYTES)]
        self.proc = subprocess.Popen(
            args, cwd=cwd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        self.lines: queue.Queue[str] = queue.Queue()
        self.pending: list[dict] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.put(line)

    def send(self, **request) -> None:
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()

    def expect(self, event: str, pid: int | None = None) -> dict:
        """The next ``event`` (of process ``pid``), keeping the others for later."""
        while True:
            for i, got in enumerate(self.pending):
                if got["event"] == event and pid in (None, got["pid"]):
                    return self.pending.pop(i)
            try:
                line = self.lines.get(timeout=TIMEOUT)
            except queue.Empty:
                raise AssertionError(f"no {event!r} event; got {self.pending}") from None
            self.pending.append(json.loads(line))

    def start(self, target: Path, seeds: list[int], *, overwrite: bool, pause=None) -> list[int]:
        self.send(op="start", target=str(target), seeds=seeds, overwrite=overwrite, pause=pause)
        return self.expect("started")["pids"]

    def finish(self, pid: int) -> str:
        """Wait for child ``pid``: its result ("ok" or the exception), once reaped."""
        result = self.expect("done", pid)["result"]
        self.send(op="reap", child=pid)
        assert not self.expect("reaped")["killed"]
        return result

    def kill(self, pid: int) -> None:
        os.kill(pid, signal.SIGKILL)
        self.send(op="reap", child=pid)
        assert self.expect("reaped")["killed"]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = _Server(tmp_path_factory.mktemp("server"))
    yield srv
    srv.proc.stdin.close()
    srv.proc.wait(timeout=TIMEOUT)


@pytest.fixture(scope="module")
def refs(tmp_path_factory) -> dict[int, dict[str, bytes]]:
    root = tmp_path_factory.mktemp("refs")
    out = {seed: _snapshot(_write(root / str(seed), seed)) for seed in (1, 2, 3)}
    assert sum(name.endswith(".safetensors") for name in out[1]) == TENSORS
    return out


def _only(target: Path) -> None:
    """Nothing is left beside ``target``: no temporary, no old copy, no lock file."""
    assert [p.name for p in target.parent.iterdir()] == [target.name]


# ----------------------------------------------------------------------------------------------
# Races
# ----------------------------------------------------------------------------------------------


def test_overwrite_false_race_has_one_winner_and_one_file_exists_error(tmp_path, server, refs):
    for round_ in range(4):
        target = tmp_path / str(round_) / "m"
        pids = server.start(target, [1, 2], overwrite=False)
        results = {seed: server.finish(pid) for seed, pid in zip([1, 2], pids, strict=True)}
        winners = [seed for seed, result in results.items() if result == "ok"]
        assert len(winners) == 1, results
        (loser,) = set(results) - set(winners)
        assert results[loser].startswith("FileExistsError: save: "), results
        assert _snapshot(target) == refs[winners[0]]
        _only(target)


@pytest.mark.parametrize("existing", [False, True])
def test_overwrite_true_race_ends_as_one_complete_checkpoint(tmp_path, server, refs, existing):
    for round_ in range(3):
        target = tmp_path / str(round_) / "m"
        if existing:
            _write(target, 3)
        pids = server.start(target, [1, 2], overwrite=True)
        results = [server.finish(pid) for pid in pids]
        assert results == ["ok", "ok"]
        assert _snapshot(target) in (refs[1], refs[2])
        _only(target)


def test_threads_of_one_process_are_serialized_too(tmp_path, refs):
    target = tmp_path / "m"
    barrier, results = threading.Barrier(2), {}

    def save(seed: int) -> None:
        barrier.wait(timeout=TIMEOUT)
        try:
            _write(target, seed, lock_timeout=TIMEOUT)
            results[seed] = "ok"
        except FileExistsError:
            results[seed] = "exists"

    threads = [threading.Thread(target=save, args=(seed,)) for seed in (1, 2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(TIMEOUT)
    assert sorted(results.values()) == ["exists", "ok"], results
    (winner,) = [seed for seed, result in results.items() if result == "ok"]
    assert _snapshot(target) == refs[winner]
    _only(target)


# ----------------------------------------------------------------------------------------------
# Killed saves
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("existing", [False, True])
def test_a_save_killed_mid_write_leaves_no_partial_directory_and_no_blocking_lock(
    tmp_path, server, refs, existing
):
    target = tmp_path / "m"
    if existing:
        _write(target, 3)
    (pid,) = server.start(target, [1], overwrite=True, pause=["save_file", 2])
    tmp = Path(server.expect("paused", pid)["at"]).parent
    assert tmp.name.startswith(f".m.floatxq-tmp-{pid}-")
    assert len(list(tmp.glob("*.safetensors"))) == 2  # two of six shards written
    server.kill(pid)
    # the killed save's temporary folder stays (nobody removed it), its lock file too; the target
    # is what it was before
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [lock_file(target).name, tmp.name, *(["m"] if existing else [])]
    )
    if existing:
        assert _snapshot(target) == refs[3]
    # the kernel released the lock: the next save takes it at once, and sweeps the dead temporary
    _write(target, 2, overwrite=existing, lock_timeout=0)
    assert _snapshot(target) == refs[2]
    _only(target)


# ----------------------------------------------------------------------------------------------
# Live saves are never disturbed
# ----------------------------------------------------------------------------------------------


def test_a_live_save_keeps_its_temporary_and_the_next_save_waits_for_it(tmp_path, server, refs):
    target = tmp_path / "m"
    _write(target, 3)
    (first,) = server.start(target, [1], overwrite=True, pause=["save_file", 2])
    tmp = Path(server.expect("paused", first)["at"]).parent
    written = _snapshot(tmp)
    # a concurrent save cannot start while the first holds the lock: it neither sweeps the first
    # one's folder nor touches the target
    with pytest.raises(TimeoutError, match="lock file .*" + lock_file(target).name):
        _write(target, 2, overwrite=True, lock_timeout=0.2)
    assert _snapshot(tmp) == written
    assert {name: refs[1][name] for name in written} == written
    assert _snapshot(target) == refs[3]
    # a waiting save, started while the first one holds the lock, publishes after it
    (second,) = server.start(target, [2], overwrite=True)
    os.kill(first, signal.SIGUSR1)
    assert server.finish(first) == "ok"
    assert server.finish(second) == "ok"
    assert _snapshot(target) == refs[2]
    _only(target)


def test_a_restore_waits_for_a_live_save_between_its_renames(tmp_path, server, refs):
    target = tmp_path / "m"
    _write(target, 3)
    (pid,) = server.start(target, [1], overwrite=True, pause=["replace", 1])
    old = Path(server.expect("paused", pid)["at"])  # renamed the target aside, not yet back
    assert old.name.startswith(".m.floatxq-old-") and not target.exists()
    # a save arriving now must not "restore" the live save's old copy
    with pytest.raises(TimeoutError, match="being saved by another process"):
        _write(target, 2, overwrite=True, lock_timeout=0.2)
    assert not target.exists() and _snapshot(old) == refs[3]
    os.kill(pid, signal.SIGUSR1)
    assert server.finish(pid) == "ok"
    assert _snapshot(target) == refs[1]
    assert recover_interrupted_save(target) is False
    _only(target)


def test_only_provably_dead_temporaries_are_swept(tmp_path, refs):
    target = tmp_path / "m"
    target.parent.mkdir(exist_ok=True)
    # a writer that does not take the lock (an earlier floatxq, say), alive meanwhile
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait(timeout=TIMEOUT)
    try:
        folders = {
            "live": f".m.floatxq-tmp-{sleeper.pid}-0123abcd",
            "dead": f".m.floatxq-tmp-{gone.pid}-0123abcd",
            "ours": f".m.floatxq-tmp-{os.getpid()}-0123abcd",  # a failed save of this process
            "no pid": ".m.floatxq-tmp-89abcdef",  # an earlier floatxq's name
        }
        for name in folders.values():
            (tmp_path / name).mkdir()
            (tmp_path / name / "model.safetensors").write_bytes(b"partial")
        _write(target, 1)
        assert _snapshot(target) == refs[1]
        left = sorted(p.name for p in tmp_path.iterdir())
        assert left == sorted(["m", folders["live"]])
        assert (tmp_path / folders["live"] / "model.safetensors").read_bytes() == b"partial"
    finally:
        sleeper.kill()
        sleeper.wait(timeout=TIMEOUT)
    _write(target, 2, overwrite=True)  # its writer is gone now
    assert _snapshot(target) == refs[2]
    _only(target)


def test_a_lock_file_left_by_a_killed_save_is_reused_and_removed(tmp_path, refs):
    target = tmp_path / "m"
    lock_file(target).write_bytes(b"")
    _write(target, 1, lock_timeout=0)
    assert _snapshot(target) == refs[1]
    _only(target)


@pytest.mark.parametrize("bad", [-1, float("nan"), float("inf"), True, "5"])
def test_bad_lock_timeouts_are_refused_before_anything_is_written(tmp_path, production_checks, bad):
    with pytest.raises(ValueError, match="lock_timeout"):
        _write(tmp_path / "a" / "m", 1, lock_timeout=bad)
    assert list(tmp_path.iterdir()) == []
