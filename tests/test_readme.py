"""The README's Python snippets run as written."""

import pathlib
import re

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"


def test_readme_python_blocks_run():
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    assert blocks, "README has python examples"
    namespace: dict = {}
    for block in blocks:
        if "install_import_hook" in block:  # needs a fresh interpreter; covered by pytest's hook
            continue
        if "path/to/" in block:  # needs a user's model directory; tests/test_lifecycle.py runs it
            continue
        exec(compile(block, str(README), "exec"), namespace)
    assert namespace["q"].qweight.dtype.__str__() == "torch.float8_e4m3fn"
    assert namespace["report"].rows[-1].recipe == "exhaustive"
