"""The ``floatxq`` command line: a thin shell over the library's pure functions."""

import typer

app = typer.Typer(
    add_completion=False, no_args_is_help=True, help="floatxq: FP8 / NVFP4 / GPTQ W4A quantization."
)


@app.callback()
def _root() -> None:
    """floatxq: FP8 / NVFP4 / GPTQ W4A quantization."""


@app.command()
def demo(
    rows: int = typer.Option(1024, help="Output features of the demo weight."),
    cols: int = typer.Option(2048, help="Input features of the demo weight."),
    seed: int = typer.Option(0, help="Seed of the demo weight."),
) -> None:
    """Quantize a seeded LLM-like weight with every FP8 format x layout; print error, size."""
    from floatxq.demo import demo_weight, fp8_error_table

    weight = demo_weight(rows, cols, seed=seed)
    table = fp8_error_table(weight)
    typer.echo(
        f"FP8 weight quantization of a seeded {rows}x{cols} weight "
        f"(Gaussian rows of varied scale, 0.1% x50 outliers; bf16 would be 16 bits/weight)\n"
    )
    header = (
        f"{'format':<16} {'layout':<15} {'rel MSE':>10} {'SQNR dB':>8} {'max |err|':>10} "
        f"{'bytes':>10} {'bits/w':>7} {'ms':>7}"
    )
    typer.echo(header)
    typer.echo("-" * len(header))
    for r in table:
        typer.echo(
            f"{r.format:<16} {r.layout:<15} {r.rel_mse:>10.3e} {r.sqnr_db:>8.2f} "
            f"{r.max_abs_err:>10.3e} {r.bytes:>10d} {r.bits_per_weight:>7.3f} "
            f"{1e3 * r.seconds:>7.1f}"
        )
    best = min(table, key=lambda r: r.rel_mse)
    typer.echo(f"\nlowest error: {best.format} / {best.layout} (rel MSE {best.rel_mse:.3e})")


def main() -> None:
    """Console-script entry point."""
    app()


if __name__ == "__main__":
    main()
