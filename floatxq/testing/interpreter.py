"""Running a test file's Triton kernels under ``TRITON_INTERPRET=1`` on a machine without CUDA.

Triton chooses between its compiler and its interpreter when it is first imported, so the
interpreted tests of a file run in a child pytest process with the variable set: the parent
calls :func:`run_interpreted_tests` from one ordinary test, and the interpreted tests carry
:data:`needs_interpreter` so they run only in that child. Needs ``pytest`` (the test extra).

Without Triton the parent test skips, unless ``FLOATXQ_REQUIRE_TRITON=1`` (CI sets it): then it
runs and fails, so a CI machine that lost Triton cannot pass without executing the kernels.
"""

import importlib.util
import os
import re
import subprocess
import sys

import pytest
import torch

from floatxq.kernels._triton import triton_available

__all__ = ["INTERPRETING", "can_interpret", "needs_interpreter", "run_interpreted_tests"]

INTERPRETING = os.environ.get("TRITON_INTERPRET", "0") == "1"
"""Whether this process runs Triton kernels in the interpreter."""

needs_interpreter = pytest.mark.skipif(
    not INTERPRETING or torch.cuda.is_available() or not triton_available(),
    reason="runs in the child process run_interpreted_tests starts (TRITON_INTERPRET=1, no CUDA)",
)
"""Mark for the tests that only the interpreting child process runs."""


def can_interpret() -> bool:
    """Whether this (parent) process should start the interpreter run: no CUDA (with CUDA the
    compiled kernels are tested instead), not already interpreting, and Triton installed (or
    required by ``FLOATXQ_REQUIRE_TRITON=1``, so that its absence fails the run)."""
    if INTERPRETING or torch.cuda.is_available():
        return False
    required = os.environ.get("FLOATXQ_REQUIRE_TRITON", "0") == "1"
    return required or importlib.util.find_spec("triton") is not None


def run_interpreted_tests(path: str, *, expected: int, keyword: str = "interpreted") -> None:
    """Run ``path``'s tests matching ``keyword`` in a child pytest with ``TRITON_INTERPRET=1``.

    Raises:
      AssertionError: the child failed, or it did not pass exactly ``expected`` tests (so a test
        that silently skipped there cannot pass for one that ran), with the tail of its log.
    """
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    command = [sys.executable, "-m", "pytest", "-q", path, "-k", keyword]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=900)
    log = done.stdout[-4000:] + done.stderr[-2000:]
    assert done.returncode == 0, log
    passed = re.search(r"(\d+) passed", done.stdout)
    assert passed is not None and int(passed[1]) == expected, log
