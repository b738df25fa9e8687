"""NVFP4 scale recipes: relative MSE, share of blocks at the exact optimum, and CPU seconds.

Run: python benchmarks/recipes.py [--size 4096] [--device cpu]

Inputs (seeded, bf16 like real activations): N(0,1), Student-t(3), and N(0,1) with 0.1% of the
entries multiplied by 50. Each recipe gets its own dynamic global scale on the bf16 grid (divisor 6
for nvidia, 4 otherwise); "optimal" is the share of blocks whose SSE equals the exhaustive search
over all 126 E4M3 scales under the same global scale. "vs anchor" divides the normal input's
relative MSE by GPT-QModel's own figures on 8192² N(0,1) bf16 (nvidia 9.05e-3, four_six 7.56e-3,
least_squares 7.10e-3, least_squares_grid 6.60e-3); docs/numerics.md states the search itself.
"""

import argparse
import datetime
import platform

import torch

import floatxq as fq

ANCHOR = {
    "nvidia": 9.05e-3,
    "four_six": 7.56e-3,
    "least_squares": 7.10e-3,
    "least_squares_grid": 6.60e-3,
}


def inputs(size: int, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    normal = torch.randn(size, size, generator=g)
    t3 = torch.distributions.StudentT(3.0).sample((size, size))  # uses the global RNG below
    outliers = torch.randn(size, size, generator=g)
    spikes = torch.rand(size, size, generator=g) < 1e-3
    outliers = torch.where(spikes, outliers * 50, outliers)
    return {"normal": normal, "student_t3": t3, "outliers_0.1%x50": outliers}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=int, default=4096)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    torch.manual_seed(0)
    device = torch.device(args.device)
    name = (
        torch.cuda.get_device_name(device)
        if device.type == "cuda"
        else platform.processor() or "cpu"
    )
    print(
        f"# NVFP4 recipes  {datetime.date.today()}  {name}  torch {torch.__version__}  "
        f"threads {torch.get_num_threads()}  {args.size}x{args.size} bf16"
    )
    print(
        f"{'input':<18} {'recipe':<20} {'rel MSE':>10} {'vs anchor':>9} "
        f"{'optimal':>8} {'seconds':>8}"
    )
    data = inputs(args.size)
    fq.recipes_report(data["normal"][:64].to(device=device, dtype=torch.bfloat16))  # warm-up
    for label, x in data.items():
        report = fq.recipes_report(x.to(device=device, dtype=torch.bfloat16))
        for row in report.rows:
            ratio = (
                f"{row.rel_mse / ANCHOR[row.recipe]:.3f}"
                if label == "normal" and row.recipe in ANCHOR
                else ""
            )
            print(
                f"{label:<18} {row.recipe:<20} {row.rel_mse:>10.3e} {ratio:>9} "
                f"{100 * row.optimal_share:>7.2f}% {row.seconds:>8.2f}"
            )


if __name__ == "__main__":
    main()
