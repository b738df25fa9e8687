"""Every ```python block of README.md and docs/*.md runs, on the built-in tiny Llama, on CPU.

Each Markdown file's blocks run in order in one namespace, in a fresh temporary working
directory (so the files they save land there). A block that cannot run on a CI machine says why
in an HTML comment on the line just before its fence:

    <!-- needs: cuda -->             a CUDA GPU (the Triton kernels, device="cuda")
    <!-- needs: network -->          a download from the Hugging Face Hub
    <!-- needs: cuda, network -->    both

Such a block still has to compile; it runs where its requirements are met (``cuda`` with a CUDA
device, ``mlx`` where MLX imports, ``network`` only with ``FLOATXQ_DOCS_NETWORK=1``). A block that
runs must not need anything else: the doc is wrong otherwise, not the machine.
"""

import importlib.util
import os
import pathlib
import re
import time
from collections.abc import Callable

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]
DOCS = (REPO / "README.md", *sorted((REPO / "docs").glob("*.md")))
FENCE = re.compile(r"^```python\s*$")
MARKER = re.compile(r"^<!--\s*needs:\s*(.*?)\s*-->\s*$")
MARKER_ANYWHERE = re.compile(r"<!--\s*needs:")


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


REQUIREMENTS: dict[str, Callable[[], bool]] = {
    "cuda": _cuda,
    "mlx": lambda: importlib.util.find_spec("mlx") is not None,
    "network": lambda: os.environ.get("FLOATXQ_DOCS_NETWORK") == "1",
}
"""Every requirement a doc block may name, and whether this machine meets it."""


def python_blocks(doc: pathlib.Path) -> list[tuple[int, str, tuple[str, ...]]]:
    """``(line of the fence, source, requirements)`` for each ```python block of ``doc``."""
    lines = doc.read_text().splitlines()
    blocks = []
    i = 0
    while i < len(lines):
        if not FENCE.match(lines[i]):
            i += 1
            continue
        start = i
        previous = next((line for line in reversed(lines[:start]) if line.strip()), "")
        marker = MARKER.match(previous.strip())
        needs = tuple(n.strip() for n in marker[1].split(",")) if marker else ()
        i += 1
        body = []
        while i < len(lines) and lines[i].strip() != "```":
            body.append(lines[i])
            i += 1
        assert i < len(lines), f"{doc.name}:{start + 1}: a python block is never closed"
        blocks.append((start + 1, "\n".join(body) + "\n", needs))
        i += 1
    return blocks


def test_the_docs_have_python_blocks():
    assert sum(len(python_blocks(doc)) for doc in DOCS) >= 10


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_markers_name_known_requirements_and_sit_on_a_block(doc):
    lines = doc.read_text().splitlines()
    fences = {line for line, _, _ in python_blocks(doc)}
    for number, line in enumerate(lines, start=1):
        if not MARKER_ANYWHERE.search(line):
            continue
        marker = MARKER.match(line.strip())
        assert marker, f"{doc.name}:{number}: write the marker alone as <!-- needs: a, b -->"
        needs = [n.strip() for n in marker[1].split(",")]
        unknown = sorted(set(needs) - set(REQUIREMENTS))
        assert not unknown, f"{doc.name}:{number}: unknown requirement {unknown}"
        following = next(
            (k for k in range(number, len(lines)) if lines[k].strip()), len(lines)
        )  # 0-based index of the next non-blank line
        assert following + 1 in fences, f"{doc.name}:{number}: the marker is not on a python block"


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_doc_python_blocks_run(doc, tmp_path, monkeypatch):
    blocks = python_blocks(doc)
    if not blocks:
        pytest.skip(f"{doc.name} has no python blocks")
    monkeypatch.chdir(tmp_path)
    namespace: dict = {"__name__": f"docs.{doc.stem}"}
    ran, skipped = [], []
    for line, source, needs in blocks:
        code = compile(source, f"{doc.relative_to(REPO)}:{line}", "exec")  # marked ones too
        unmet = [n for n in needs if not REQUIREMENTS[n]()]
        if unmet:
            skipped.append(f"line {line} needs {', '.join(unmet)}")
            continue
        started = time.perf_counter()
        try:
            exec(code, namespace)
        except Exception as error:
            pytest.fail(f"{doc.name}, the block at line {line} raised {error!r}")
        ran.append((line, time.perf_counter() - started))
    if doc.name == "README.md":  # the functions' block computed what its comments say
        assert str(namespace["q"].qweight.dtype) == "torch.float8_e4m3fn"
        assert namespace["report"].rows[-1].recipe == "exhaustive"
    if not ran:
        pytest.skip(f"{doc.name}: every block needs what this machine lacks: {skipped}")
