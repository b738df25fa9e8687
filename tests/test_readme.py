"""The docs' links point at what exists (tests/test_docs_run.py runs their Python blocks)."""

import pathlib
import re

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]
README = REPO / "README.md"
DOCS = (README, REPO / "docs" / "numerics.md")


def _anchor(heading: str) -> str:
    """GitHub's anchor of a Markdown heading: lower case, punctuation dropped, spaces to '-'."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_links_point_at_existing_files_names_and_sections(doc):
    text = doc.read_text()
    links = re.findall(r"\[([^\]]+)\]\(([^)\s]+)\)", text)
    assert links, f"{doc.name} links to the code"
    for label, target in links:
        if target.startswith(("http://", "https://")):
            continue
        path, _, anchor = target.partition("#")
        file = (doc.parent / path).resolve() if path else doc
        assert file.exists(), f"{doc.name}: [{label}]({target}) names a missing file"
        if anchor:
            headings = re.findall(r"^#+ (.*)$", file.read_text(), flags=re.M)
            assert anchor in {_anchor(h) for h in headings}, f"{doc.name}: no section #{anchor}"
        name = re.match(r"`([A-Za-z_]\w*)[`(]", label)
        if name and file.suffix == ".py":  # [`quantize_fp8_weight`](../floatxq/fp8.py)
            defined = rf"^\s*(?:def|class) {name[1]}\b|^{name[1]}\s*[:=]"
            assert re.search(defined, file.read_text(), flags=re.M), (
                f"{doc.name}: {name[1]} is not defined in {path}"
            )
