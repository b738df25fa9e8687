"""Saves that fail, are killed or are pointed somewhere dangerous never lose a model.

A save that replaces a directory must leave, at every instant, the target holding the complete
old checkpoint or the complete new one, or the target missing while its old contents wait,
complete, in a hidden ``.NAME.floatxq-old-*`` folder that the next save (or
``recover_interrupted_save``) puts back. Failures are injected at every call of ``os.replace``,
``shutil.rmtree`` and ``os.fsync`` a save makes, and a subprocess is SIGKILLed at each of them.
"""

import errno
import functools
import os
import random
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import floatxq as fq
from floatxq.interop.checkpoint import recover_interrupted_save, write_checkpoint
from floatxq.lifecycle.model import _parse_size

transformers = pytest.importorskip("transformers")

# A: three shards and an index; B: one file. A directory mixing the two is neither.
A_SHARD_BYTES, B_SHARD_BYTES = 1100, 1 << 20


def _state(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {f"layer{i}.weight": torch.randn(16, 16, generator=g) for i in range(3)}


def _write(path: Path, seed: int, shard_bytes: int, **kwargs) -> Path:
    return write_checkpoint(
        path,
        _state(seed),
        config={"seed": seed},
        quantize_config={"seed": seed},
        max_shard_bytes=shard_bytes,
        **kwargs,
    )


def _snapshot(path: Path) -> dict[str, bytes]:
    return {str(f.relative_to(path)): f.read_bytes() for f in sorted(path.rglob("*"))}


def _olds(target: Path) -> list[Path]:
    return sorted(target.parent.glob(f".{target.name}.floatxq-old-*"))


@pytest.fixture(scope="module")
def refs(tmp_path_factory) -> dict[str, dict[str, bytes]]:
    root = tmp_path_factory.mktemp("refs")
    a = _snapshot(_write(root / "a", 1, A_SHARD_BYTES))
    b = _snapshot(_write(root / "b", 2, B_SHARD_BYTES))
    assert "model.safetensors.index.json" in a and "model.safetensors" in b
    return {"A": a, "B": b}


# ----------------------------------------------------------------------------------------------
# 1. Replacement is recoverable at every instant
# ----------------------------------------------------------------------------------------------


class _Injected(OSError):
    pass


_TARGETS = {"os.replace": (os, "replace"), "shutil.rmtree": (shutil, "rmtree"),
            "os.fsync": (os, "fsync")}  # fmt: skip


def _calls_of(monkeypatch, which: str, fail_at: int, *, sticky: bool) -> list[int]:
    """Patch ``which`` to raise at its ``fail_at``-th call (and every later one when sticky)."""
    module, attr = _TARGETS[which]
    real = getattr(module, attr)
    count = [0]

    def patched(*args, **kwargs):
        count[0] += 1
        if count[0] == fail_at or (sticky and 0 < fail_at < count[0]):
            raise _Injected(f"injected: {which} call {count[0]} fails")
        return real(*args, **kwargs)

    monkeypatch.setattr(module, attr, patched)
    return count


@functools.cache
def _dead_pid() -> int:
    """The PID of a child process that has exited (and been reaped)."""
    child = subprocess.Popen([sys.executable, "-c", ""])
    child.wait()
    return child.pid


def _setup(scenario: str, target: Path) -> None:
    """``replace``: the target holds A. ``interrupted``: a replacement of A was cut short between
    its renames (in the naming of an earlier floatxq release) and a stale temporary folder
    remains. ``fresh``: nothing there."""
    if scenario == "fresh":
        target.parent.mkdir(parents=True)
        return
    _write(target, 1, A_SHARD_BYTES)
    if scenario == "interrupted":
        os.rename(target, target.parent / f".{target.name}.floatxq-old-0123abcd")
        # a temporary of a process that is gone (a fixed PID could be alive on another host)
        stale = target.parent / f".{target.name}.floatxq-tmp-{_dead_pid()}-89abcdef"
        stale.mkdir()
        (stale / "model.safetensors").write_bytes(b"partial")


def _check_after(target: Path, refs, *, previous: str | None, saved: bool, step: int) -> None:
    """The invariant, then the way back: recover (odd steps) or a next save (even steps)."""
    if saved:
        assert _snapshot(target) == refs["B"]
    elif target.exists():
        assert _snapshot(target) in (refs["B"], refs[previous] if previous else None)
    elif previous is None:
        assert _olds(target) == []
    else:
        olds = _olds(target)
        assert olds, "the target is gone and nothing is left to restore it"
        assert _snapshot(olds[-1]) == refs[previous]
        if step % 2:
            assert recover_interrupted_save(target)
        else:  # a save refused for the existing directory still restores it first
            with pytest.raises(FileExistsError):
                _write(target, 2, B_SHARD_BYTES)
        assert _snapshot(target) == refs[previous]
    # a clean save after any failure sweeps everything stale and writes B
    _write(target, 2, B_SHARD_BYTES, overwrite=True)
    assert _snapshot(target) == refs["B"]
    assert [p.name for p in target.parent.iterdir()] == [target.name]


@pytest.mark.parametrize("which", sorted(_TARGETS))
@pytest.mark.parametrize("scenario", ["replace", "interrupted", "fresh"])
def test_failure_at_every_call_keeps_old_or_new(tmp_path, monkeypatch, refs, scenario, which):
    previous = None if scenario == "fresh" else "A"
    probe = tmp_path / "probe" / "m"
    _setup(scenario, probe)
    with monkeypatch.context() as patch:
        count = _calls_of(patch, which, 0, sticky=False)
        _write(probe, 2, B_SHARD_BYTES, overwrite=True)
    total = count[0]
    assert total or (scenario, which) == ("fresh", "shutil.rmtree")
    step = 0
    for fail_at in range(1, total + 1):
        for sticky in (False, True):
            step += 1
            target = tmp_path / f"{fail_at}-{sticky}" / "m"
            _setup(scenario, target)
            saved = False
            with monkeypatch.context() as patch:
                _calls_of(patch, which, fail_at, sticky=sticky)
                try:
                    _write(target, 2, B_SHARD_BYTES, overwrite=True)
                    saved = True
                except _Injected:
                    pass
            _check_after(target, refs, previous=previous, saved=saved, step=step)


def test_second_rename_failing_puts_the_old_directory_back(tmp_path, monkeypatch, refs):
    target = tmp_path / "m"
    _write(target, 1, A_SHARD_BYTES)
    real = os.replace

    def no_moving_in(src, dst):
        if Path(dst) == target and ".floatxq-tmp-" in Path(src).name:
            raise _Injected("injected: the new directory cannot be moved in")
        return real(src, dst)

    monkeypatch.setattr(os, "replace", no_moving_in)
    with pytest.raises(_Injected):
        _write(target, 2, B_SHARD_BYTES, overwrite=True)
    assert _snapshot(target) == refs["A"]
    assert [p.name for p in tmp_path.iterdir()] == ["m"]


def test_recover_leaves_existing_targets_and_other_models_alone(tmp_path, refs):
    assert recover_interrupted_save(tmp_path / "nothing") is False
    assert recover_interrupted_save(tmp_path / "missing-parent" / "m") is False
    # "mx" was cut short mid-replacement; saves and recovers of "m*" and "m[x]" must not touch it
    _write(tmp_path / "mx", 1, A_SHARD_BYTES)
    os.rename(tmp_path / "mx", tmp_path / ".mx.floatxq-old-0123abcd")
    for name in ("m*", "m[x]"):
        _write(tmp_path / name, 2, B_SHARD_BYTES)
        _write(tmp_path / name, 2, B_SHARD_BYTES, overwrite=True)
        assert recover_interrupted_save(tmp_path / name) is False
    assert not (tmp_path / "mx").exists()
    assert _snapshot(tmp_path / ".mx.floatxq-old-0123abcd") == refs["A"]
    assert recover_interrupted_save(tmp_path / "mx") is True
    assert _snapshot(tmp_path / "mx") == refs["A"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m*", "m[x]", "mx"]
    assert recover_interrupted_save(tmp_path / "mx") is False  # it exists now


# Forks one saver per request, each paused before the k-th call of os.replace, os.fsync,
# shutil.rmtree or save_file, so the test can SIGKILL it at exactly that point.
_KILL_SERVER = """
import os, shutil, signal, sys, torch
import floatxq.interop.checkpoint as ckpt
target = sys.argv[1]
def state(seed):
    g = torch.Generator().manual_seed(seed)
    return {f"layer{i}.weight": torch.randn(16, 16, generator=g) for i in range(3)}
def pause_before(k):
    calls = [0]
    for module, name in ((os, "replace"), (os, "fsync"), (shutil, "rmtree"), (ckpt, "save_file")):
        def paused(*args, _real=getattr(module, name), _name=name, **kwargs):
            calls[0] += 1
            if calls[0] == k:
                print("paused", _name, os.getpid(), flush=True)
                while True:
                    signal.pause()
            return _real(*args, **kwargs)
        setattr(module, name, paused)
    return calls
for line in sys.stdin:
    seed, shard_bytes, k = map(int, line.split())
    pid = os.fork()
    if pid == 0:
        try:
            calls = pause_before(k)
            ckpt.write_checkpoint(target, state(seed), config={"seed": seed},
                quantize_config={"seed": seed}, max_shard_bytes=shard_bytes, overwrite=True)
            print("finished", calls[0], flush=True)
        except BaseException as exc:
            print("failed", repr(exc).replace(chr(10), " "), flush=True)
        os._exit(0)
    os.waitpid(pid, 0)
    print("reaped", pid, flush=True)
"""


def test_sigkill_at_every_point_of_a_save_in_random_order(tmp_path, refs):
    target = tmp_path / "out" / "m"
    target.parent.mkdir()
    proc = subprocess.Popen(
        [sys.executable, "-c", _KILL_SERVER, str(target)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )

    def save(seed: int, k: int) -> int | None:
        """Run one save paused before hooked call ``k``; SIGKILL it there. None: killed."""
        shard_bytes = A_SHARD_BYTES if seed == 1 else B_SHARD_BYTES
        proc.stdin.write(f"{seed} {shard_bytes} {k}\n")
        proc.stdin.flush()
        outcome = proc.stdout.readline().split()
        assert outcome and outcome[0] in ("paused", "finished"), outcome
        if outcome[0] == "paused":
            os.kill(int(outcome[2]), signal.SIGKILL)
        reaped = proc.stdout.readline().split()
        assert reaped[0] == "reaped", reaped
        return int(outcome[1]) if outcome[0] == "finished" else None

    try:
        assert save(2, 0) is not None  # B, complete
        calls = save(1, 0), save(2, 0)  # how many pause points a replacing save has
        assert None not in calls and min(calls) >= 8
        assert _snapshot(target) == refs["B"]
        rng = random.Random(14)
        points = list(range(1, max(calls) + 1))
        rng.shuffle(points)
        current = "B"
        for step, k in enumerate(points):
            new = "A" if current == "B" else "B"
            finished = save(1 if new == "A" else 2, k)
            if target.exists():
                assert _snapshot(target) in (refs[current], refs[new]), (k, step)
                current = "A" if _snapshot(target) == refs["A"] else "B"
            else:
                olds = _olds(target)
                assert finished is None and olds, (k, step)
                assert _snapshot(olds[-1]) == refs[current]
                if step % 2:  # else the next save restores it
                    assert recover_interrupted_save(target)
                    assert _snapshot(target) == refs[current]
        assert save(1, 0) is not None
        assert _snapshot(target) == refs["A"]
        assert [p.name for p in target.parent.iterdir()] == ["m"]
    finally:
        proc.stdin.close()
        proc.wait(timeout=30)


# ----------------------------------------------------------------------------------------------
# 2. Dangerous targets are refused
# ----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def quantized():
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        tie_word_embeddings=False,
    )  # fmt: skip
    model = transformers.LlamaForCausalLM(config).eval()
    return fq.load(model, quantize_config=fq.FP8Config()).quantize(progress=False)


def test_working_directory_home_and_root_are_refused(tmp_path, monkeypatch, quantized):
    work, home = tmp_path / "work", tmp_path / "users" / "me"
    for folder in (work, home):
        folder.mkdir(parents=True)
        (folder / "notes.txt").write_text("keep me")
    monkeypatch.chdir(work)
    monkeypatch.setenv("HOME", str(home))
    cases = {
        "": "the current working directory",
        ".": "the current working directory",
        "../work": "the current working directory",
        str(work): "the current working directory",
        "..": "a directory holding the current working directory",
        str(home): "the home directory",
        "../users": "a directory holding the home directory",
        "/": "a filesystem root",
    }
    for path, why in cases.items():
        for overwrite in (True, False):
            with pytest.raises(ValueError, match=f"save: path '{path}' resolves to .*, {why}"):
                quantized.save(path, overwrite=overwrite)
    for folder in (work, home):
        assert [p.name for p in folder.iterdir()] == ["notes.txt"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["users", "work"]
    assert [p.name for p in home.parent.iterdir()] == ["me"]


def test_a_plain_file_is_never_replaced(tmp_path, quantized):
    file = tmp_path / "model"
    file.write_bytes(b"not a model")
    with pytest.raises(FileExistsError, match="not a directory"):
        quantized.save(file)
    with pytest.raises(ValueError, match="not a directory"):
        quantized.save(file, overwrite=True)
    assert file.read_bytes() == b"not a model"
    assert [p.name for p in tmp_path.iterdir()] == ["model"]


def test_a_symlink_is_never_replaced(tmp_path, refs):
    real = _write(tmp_path / "real", 1, A_SHARD_BYTES)
    (tmp_path / "link").symlink_to(real)
    with pytest.raises(ValueError, match="symbolic link"):
        _write(tmp_path / "link", 2, B_SHARD_BYTES, overwrite=True)
    assert (tmp_path / "link").is_symlink() and _snapshot(real) == refs["A"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link", "real"]


# ----------------------------------------------------------------------------------------------
# 3. max_shard_size
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("given", "expected"),
    [("4GB", 4 * 10**9), ("500MB", 500 * 10**6), ("1.5GB", 15 * 10**8), (" 2 kb ", 2000),
     ("1e3MB", 10**9), ("4GiB", 4 << 30), ("1.5GiB", 3 << 29), ("2 kib", 2048), (1000, 1000)],
)  # fmt: skip
def test_shard_sizes_that_keep_working(given, expected):
    """KB-TB of 1000 as transformers' save_pretrained reads them; KiB-TiB of 1024."""
    assert _parse_size(given) == expected


@pytest.mark.parametrize(
    "bad", [True, False, 0, -1, 1.5, float("nan"), "nanGB", "infGB", "4XB", "0GB", "-1GB", "",
            "0.1B", "1000B", "infGiB", "nanGiB", "GiB", "1" * 400 + "GB"],
)  # fmt: skip
def test_bad_shard_sizes_are_refused_naming_the_value(bad):
    with pytest.raises(ValueError, match=r"max_shard_size must be a positive int.*'4GB'") as info:
        _parse_size(bad)
    assert repr(bad) in str(info.value)


def test_bad_shard_sizes_through_save(tmp_path, quantized, production_checks):
    for bad in (True, 1.5, 0, "4XB"):
        with pytest.raises(ValueError, match="max_shard_size"):
            quantized.save(tmp_path / "m", max_shard_size=bad)
    with pytest.raises(ValueError, match="max_shard_bytes"):
        _write(tmp_path / "m", 1, True)
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(TypeError, match="max_shard_size"):
        quantized.save(tmp_path / "m", max_shard_size=None)
    out = quantized.save(tmp_path / "m", max_shard_size="1.5KB")
    shards = sorted(out.glob("*.safetensors"))
    assert len(shards) > 1 and (out / "model.safetensors.index.json").is_file()


# ----------------------------------------------------------------------------------------------
# 4. An output directory that cannot be written
# ----------------------------------------------------------------------------------------------


@pytest.fixture
def read_only(tmp_path, monkeypatch) -> Iterator[Path]:
    """A directory nobody may create entries in (as root, the kernel's EACCES is imitated)."""
    ro = tmp_path / "ro"
    ro.mkdir()
    (ro / "m").mkdir()
    (ro / "m" / "config.json").write_text("{}")
    ro.chmod(0o555)
    if os.access(ro, os.W_OK):  # root ignores the mode bits
        real = os.mkdir

        def mkdir(path, mode=0o777, *, dir_fd=None):
            if Path(path).parent == ro:
                raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(path))
            return real(path, mode, dir_fd=dir_fd)

        monkeypatch.setattr(os, "mkdir", mkdir)
    yield ro
    ro.chmod(0o755)


def test_read_only_parent_is_named_and_nothing_is_left(read_only, quantized):
    for path, overwrite in ((read_only / "new", False), (read_only / "m", True),
                            (read_only / "a" / "b" / "m", False)):  # fmt: skip
        with pytest.raises(PermissionError) as info:
            quantized.save(path, overwrite=overwrite)
        message = str(info.value)
        assert message.startswith(f"save: cannot write in {read_only} (")
        assert info.value.errno == errno.EACCES
        assert sorted(p.name for p in read_only.iterdir()) == ["m"]
        assert [p.name for p in (read_only / "m").iterdir()] == ["config.json"]


def test_failed_save_removes_the_parents_it_created(tmp_path, monkeypatch, quantized):
    import floatxq.interop.checkpoint as ckpt

    def full(tensors, filename, metadata=None):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(ckpt, "save_file", full)
    (tmp_path / "kept").mkdir()
    with pytest.raises(OSError, match="No space"):
        quantized.save(tmp_path / "kept" / "a" / "b" / "m")
    assert [p.name for p in tmp_path.iterdir()] == ["kept"]
    assert list((tmp_path / "kept").iterdir()) == []


def test_load_restores_a_directory_an_interrupted_save_left_hidden(tmp_path, quantized):
    target = quantized.save(tmp_path / "m", layout="gptqmodel")
    before = _snapshot(target)
    os.rename(target, tmp_path / ".m.floatxq-old-0123abcd")  # cut short between the two renames
    with pytest.warns(UserWarning, match="restored"):
        loaded = fq.load(target)
    assert _snapshot(target) == before
    assert loaded.quantized_modules == quantized.quantized_modules
