"""Run every benchmark script in this folder (``make bench``); each prints its own table.

Benchmarks time on the device (an H200) and on CPU; their figures go into RESULTS.md by hand,
with the date, GPU, command, figure and the ratio to the anchor measured in the same run.
"""

import pathlib
import subprocess
import sys


def main() -> int:
    here = pathlib.Path(__file__).parent
    scripts = sorted(p for p in here.glob("*.py") if p.name != pathlib.Path(__file__).name)
    if not scripts:
        print("no benchmark scripts yet")
        return 0
    failed = 0
    for script in scripts:
        print(f"== {script.name}", flush=True)
        failed += subprocess.call([sys.executable, str(script)]) != 0
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
