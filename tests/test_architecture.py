"""The package's shape, read from its own source (docs/architecture.md states the rules).

Every ``floatxq`` import of every module (module-level and inside functions) is parsed with
``ast``; each module belongs to a layer; an import may only reach a layer before its own. Import
cycles between modules are refused (a package re-exporting its own children is not a cycle), and
no file grows past 800 lines.
"""

import ast
import pathlib

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parents[1] / "floatxq"

LAYERS: dict[str, int] = {
    # base
    "formats": 0,
    "_typing": 0,
    "_checks": 0,
    "config": 0,
    "tiny": 0,  # the built-in corpus and tiny Llama: data that imports only _typing
    # pure math
    "fp8": 1,
    "nvfp4": 1,
    "gptq": 1,
    "w4a": 1,
    "stats": 1,
    "fp8_activation": 1,
    "fp8_bands": 1,
    "gsq": 1,
    # kernels, then the route choices
    "kernels": 2,
    "dispatch": 3,
    # modules
    "nn": 4,
    "mlx": 4,
    # checkpoint interop, then the model lifecycle
    "interop": 5,
    "lifecycle": 6,
    # the shell: free to import anything
    "cli": 7,
    "cli_checks": 7,
    "cli_gsq": 7,
    "demo": 7,
    "testing": 7,
    "__init__": 7,
}
"""The layer of each top-level name under ``floatxq``: lower numbers come first."""

ALLOWED_UPWARD: set[tuple[str, str]] = {
    # dispatch chooses the Metal encoder on Apple Silicon (imported lazily, on that route only)
    ("dispatch", "mlx"),
}
"""Imports that reach a later layer by design (importer area, imported area)."""


def _module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, pathlib.Path]:
    return {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _imports(name: str, path: pathlib.Path, known: set[str]) -> set[str]:
    """The floatxq modules ``name`` imports (``from pkg import child`` counts the child)."""
    found: set[str] = set()
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            children = {f"{target}.{a.name}" for a in node.names} & known
            found.update(children)
            if len(children) < len(node.names):  # names defined in the module itself
                found.add(target)
    return {m for m in found if m in known and m != name and m != "floatxq"}


def _area(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(name, path, set(modules)) for name, path in modules.items()}


def test_every_module_has_a_layer(graph):
    unknown = sorted({_area(m) for m in graph} - set(LAYERS))
    assert not unknown, (
        f"modules in no layer (add them to LAYERS and docs/architecture.md): {unknown}"
    )


def test_no_import_reaches_a_later_layer(graph):
    against = []
    for module, imported in graph.items():
        for target in imported:
            a, b = _area(module), _area(target)
            if a == b or (a, b) in ALLOWED_UPWARD:
                continue
            if LAYERS.get(b, 0) > LAYERS.get(a, 0):
                against.append(f"{module} -> {target}")
    assert not against, f"imports against the layering: {sorted(against)}"


def test_no_import_cycles(graph):
    def parent_child(a: str, b: str) -> bool:  # a package's __init__ re-exporting its children
        return a.startswith(b + ".") or b.startswith(a + ".")

    edges = {m: {t for t in ts if not parent_child(m, t)} for m, ts in graph.items()}
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    cycles: list[list[str]] = []

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(edges[node]):
            if state.get(nxt) == 1:
                cycles.append([*path[path.index(nxt) :], nxt])
            elif nxt not in state:
                visit(nxt, [*path, nxt])
        state[node] = 2

    for start in sorted(edges):
        if start not in state:
            visit(start, [start])
    assert not cycles, f"import cycles: {cycles[:3]}"


def test_no_file_over_800_lines():
    long = {
        _module_name(p): n
        for p in PACKAGE.rglob("*.py")
        if (n := len(p.read_text().splitlines())) > 800
    }
    assert not long, f"files over 800 lines: {long}"


def test_the_checks_can_fail():
    """The parser sees what a layering check must see: a function-level import, a relative one,
    and a package import naming a child module."""
    source = (
        "import torch\ndef f():\n    from floatxq.lifecycle import model\nfrom .quantize import x\n"
    )
    path = PACKAGE / "nvfp4" / "probe.py"
    known = {"floatxq.lifecycle.model", "floatxq.nvfp4.quantize"}
    original = pathlib.Path.read_text
    try:
        pathlib.Path.read_text = lambda self, *a, **k: (
            source if self == path else original(self, *a, **k)
        )
        found = _imports("floatxq.nvfp4.probe", path, known)
    finally:
        pathlib.Path.read_text = original
    assert found == known
    assert LAYERS[_area("floatxq.lifecycle.model")] > LAYERS[_area("floatxq.nvfp4.probe")]
