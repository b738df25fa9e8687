"""Run every benchmark script in this folder (``make bench``); each prints its own table.

On a machine without CUDA the GPU-only scripts are skipped and the GPTQ benchmark runs at its CPU
size. Figures go into RESULTS.md by hand, with the date, machine, command, figure and the ratio to
the anchor measured in the same run.
"""

import pathlib
import subprocess
import sys

import torch

GPU_ONLY = {
    "eager_host.py",
    "fp8_limits.py",
    "fp8_linear.py",
    "fp8_linear_host.py",
    "fp8_small_m_sweep.py",
    "lifecycle.py",
    "w4a_decode_probe.py",
}
CPU_ARGS = {"gptq.py": ["--small"], "recipes.py": ["--size", "2048"], "w4a.py": ["--smoke"]}
GPU_ARGS = {"fp8_small_m_sweep.py": ["--quick"]}


def main() -> int:
    here = pathlib.Path(__file__).parent
    scripts = sorted(p for p in here.glob("*.py") if p.name != pathlib.Path(__file__).name)
    cuda = torch.cuda.is_available()
    failed = 0
    for script in scripts:
        if not cuda and script.name in GPU_ONLY:
            print(f"== {script.name}: skipped (needs a CUDA device)", flush=True)
            continue
        args = GPU_ARGS.get(script.name, []) if cuda else CPU_ARGS.get(script.name, [])
        print(f"== {script.name} {' '.join(args)}".rstrip(), flush=True)
        failed += subprocess.call([sys.executable, str(script), *args]) != 0
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
