"""The ``floatxq`` command line: a thin shell over the library.

Commands: demo, quantize, inspect, eval, recipes. Every user error ends the command with one
line ``error: <message>`` on stderr and exit code 2: arguments are checked before any work, and
the library's own errors (bad values, unreadable or damaged files, unusable devices) are caught
around the calls that can raise them, keeping the library's message.
"""

import contextlib
import json
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import click
import typer

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    help="floatxq: FP8 weight-only models end to end; NVFP4 and GPTQ quantization math.",
)

TINY = "tiny"
GENERATED_SOURCES: tuple[str, ...] = ("normal", "student_t3", "outliers")

# What the library raises on bad user input (CheckpointError is a ValueError; OSError covers
# PermissionError, FileNotFoundError and FileExistsError). RuntimeError joins them only around
# model work on a device (torch's device errors, an already-quantized model).
INPUT_ERRORS: tuple[type[Exception], ...] = (ValueError, TypeError, OSError)
DEVICE_ERRORS: tuple[type[Exception], ...] = (*INPUT_ERRORS, RuntimeError)
# An exit already decided (``_fail`` printed its line): typer's and click's Exit and Abort are
# RuntimeErrors, so ``DEVICE_ERRORS`` would catch them and print a second ``error: Exit`` line.
DECIDED_EXITS: tuple[type[Exception], ...] = (
    typer.Exit,
    typer.Abort,
    click.exceptions.Exit,
    click.exceptions.Abort,
)


def _fail(message: str) -> "typer.Exit":
    """Print ``error: <message>`` on one line of stderr; the caller raises the returned Exit."""
    typer.echo(f"error: {' '.join(message.split())}", err=True)
    return typer.Exit(code=2)


def _fail_from(exc: Exception) -> "typer.Exit":
    """``_fail`` with a library exception's own message (its type name when it has none)."""
    return _fail(str(exc).strip() or type(exc).__name__)


@contextlib.contextmanager
def _reported(kinds: tuple[type[Exception], ...] = INPUT_ERRORS) -> Iterator[None]:
    """Around library calls: an exception of ``kinds`` becomes one ``error:`` line and exit 2;
    an exit already decided inside (a ``_fail``) passes through as it is."""
    try:
        yield
    except DECIDED_EXITS:
        raise
    except kinds as exc:
        raise _fail_from(exc) from None


def _shown(text: str, limit: int = 60) -> str:
    """``text`` cut to ``limit`` characters for a message (user input can be megabytes)."""
    return repr(text if len(text) <= limit else text[: limit - 3] + "...")


def _check_device(device: str | None) -> None:
    """Refuse a ``--device`` that torch cannot parse or that this machine does not have."""
    if device is None:
        return
    import torch

    try:
        dev = torch.device(device)
    except (RuntimeError, ValueError):
        raise _fail(
            f"--device {device!r} is not a torch device; accepted: cpu, cuda, cuda:N, mps"
        ) from None
    if dev.type == "cpu":
        return
    if dev.type == "meta":
        raise _fail("--device meta holds no data to quantize or evaluate; use cpu or cuda")
    backend = getattr(torch, dev.type, None)
    is_available = getattr(backend, "is_available", None)
    if not callable(is_available) or not is_available():
        raise _fail(f"--device {device!r}: torch sees no {dev.type} device on this machine")
    count = getattr(backend, "device_count", None)
    if dev.index is not None and callable(count) and dev.index >= count():
        raise _fail(f"--device {device!r}: this machine has {count()} {dev.type} device(s)")


def _check_at_least(option: str, value: int, minimum: int) -> None:
    if value < minimum:
        raise _fail(f"{option} must be at least {minimum}, got {value}")


def _check_png(png: Path) -> None:
    """Refuse a chart path that cannot be written, before the work that precedes the chart."""
    if png.is_dir():
        raise _fail(f"--png {png} is a directory; give a file name")
    if not png.parent.is_dir():
        raise _fail(f"--png {png}: the directory {png.parent} does not exist")


def _source_model(model: str, *, device: str | None, quantize_config=None):
    """The built-in tiny Llama for ``tiny``, else a local directory."""
    import floatxq

    if model == TINY:
        from floatxq.tiny import TINY_LLAMA_DIR

        model = str(TINY_LLAMA_DIR)
    return floatxq.load(model, device=device, quantize_config=quantize_config)


def _calibration(spec: str, *, samples: int, seq_len: int) -> list:
    """Calibration samples: ``tiny`` (the built-in corpus' calibration split, byte ids), a
    ``.jsonl`` file (one JSON string, or object with ``text`` or ``input_ids``, per line) or a
    text file (one sample per non-empty line)."""

    if spec == TINY:
        from floatxq.tiny import calibration_samples

        return calibration_samples(num_samples=samples, seq_len=seq_len)
    path = Path(spec)
    if not path.is_file():
        raise _fail(f"--calibration {spec!r} is neither 'tiny' nor a readable file")
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise _fail(f"--calibration {spec}: cannot read it as UTF-8 text ({exc})") from None
    lines = [line for line in text.splitlines() if line.strip()]
    if path.suffix.lower() != ".jsonl":
        return lines[:samples]
    from floatxq._checks import bounded_json_loads

    out = []
    for number, line in enumerate(lines[:samples], start=1):
        try:
            item = bounded_json_loads(line, where=f"--calibration {spec}: line {number}")
        except ValueError as exc:
            raise _fail(str(exc)) from None
        if isinstance(item, dict) and "text" in item:
            item = item["text"]
        if not isinstance(item, (str, dict, list)):
            raise _fail(
                f"--calibration {spec}: line {number} must be a string, an object with 'text' "
                f"or 'input_ids', or a list of token ids"
            )
        out.append(item)
    return out


@app.callback()
def _root() -> None:
    """floatxq: FP8 weight-only models end to end; NVFP4 and GPTQ quantization math."""


@app.command()
def demo(
    windows: int = typer.Option(24, help="Held-out windows of 256 byte tokens to evaluate."),
    png: Path = typer.Option(Path("floatxq-demo.png"), help="Where to write the chart."),
) -> None:
    """Every quantization path on the built-in trained tiny Llama: quality, size, time, chart."""
    _check_at_least("--windows", windows, 1)
    _check_png(png)
    from floatxq.demo import plot_demo, run_demo

    typer.echo("floatxq demo: the tiny Llama (6.4M parameters, trained on stdlib docstrings)")
    start = time.perf_counter()
    report = run_demo(max_windows=windows, on_path=lambda name: typer.echo(f"  running {name} ..."))
    typer.echo(
        f"\n{report.tokens} held-out byte tokens ({report.windows} windows); KL and top-1 are "
        f"against the unquantized model\n"
    )
    header = (
        f"{'path':<46} {'perplexity':>10} {'KL nats':>9} {'top-1':>7} {'size MB':>8} {'quant s':>8}"
    )
    typer.echo(header)
    typer.echo("-" * len(header))
    for r in report.rows:
        typer.echo(
            f"{r.path:<46} {r.perplexity:>10.4f} {r.kl_divergence:>9.5f} "
            f"{100 * r.top1_agreement:>6.2f}% {r.bytes / 1e6:>8.2f} {r.seconds:>8.2f}"
        )
    try:
        with _reported():
            plot_demo(report, str(png))
        typer.echo(f"\nchart: {png}")
    except ImportError:
        typer.echo("\n(matplotlib is not installed: pip install 'floatxq[plot]' for the chart)")
    typer.echo(f"done in {time.perf_counter() - start:.1f} s")


@app.command()
def quantize(
    model: str = typer.Argument(..., help="A local Hugging Face model directory, or 'tiny'."),
    out: Path = typer.Option(..., "--out", help="Directory to write the quantized model to."),
    method: str = typer.Option("fp8", help="Quantization method: fp8 or gptq."),
    format: str = typer.Option("float8_e4m3fn", "--format", help="FP8 format or alias."),
    scale_method: str | None = typer.Option(None, help="tensor, row or block."),
    block_size: tuple[int, int] | None = typer.Option(None, help="Block rows and columns."),
    lm_head: bool = typer.Option(False, help="Quantize the output embedding too."),
    exclude: list[str] | None = typer.Option(None, help="Regex of modules to leave alone."),
    device: str | None = typer.Option(None, help="Device to quantize on (cpu, cuda)."),
    overwrite: bool = typer.Option(False, help="Replace an existing --out directory."),
    layout: str | None = typer.Option(
        None,
        help="Checkpoint layout: compressed-tensors (the default; transformers with "
        "compressed-tensors, vLLM), hf (transformers/DeepSeek fine-grained FP8: tensor or block "
        "scales), gptq (GPTQ files vLLM, TGI and GPT-QModel read; the default with --activation, "
        "the one layout that holds a policy) or gptqmodel (GPT-QModel's files).",
    ),
    bits: int = typer.Option(4, help="GPTQ: bits per weight (2, 4 or 8)."),
    group_size: int = typer.Option(128, help="GPTQ: input columns per scale (-1: whole row)."),
    sym: bool = typer.Option(True, help="GPTQ: symmetric (fixed zero point)."),
    desc_act: bool = typer.Option(False, help="GPTQ: solve columns by descending activation."),
    act_group_aware: bool = typer.Option(
        True, help="GPTQ: group-aware reordering (turned off by --desc-act)."
    ),
    calibration: str | None = typer.Option(
        None,
        help="GPTQ: 'tiny' (the built-in corpus, byte ids), a text file (one sample per line) or "
        "a .jsonl file (strings, or objects with text / input_ids).",
    ),
    samples: int = typer.Option(128, help="GPTQ: calibration samples to use at most."),
    seq_len: int = typer.Option(256, help="GPTQ: tokens per sample for --calibration tiny."),
    batch_size: int = typer.Option(8, help="GPTQ: calibration samples per forward."),
    activation: str | None = typer.Option(
        None,
        help="GPTQ: a W4A activation policy, solved for and saved with the weights: w4afp8, "
        'w4a_nvfp4, or its JSON, e.g. \'{"mode": "w4a_nvfp4", "recipe": "nvidia", '
        '"attention": {"mode": "w4afp8"}}\' (needs 4 bits, group 128, sym, no desc-act).',
    ),
) -> None:
    """Quantize a model's linear layers and save the checkpoint in a chosen layout."""
    import floatxq
    from floatxq.interop.export import normalize_layout

    chosen = method.strip().lower()
    if chosen not in ("fp8", "gptq"):
        raise _fail(f"unsupported --method {method!r}; accepted: fp8, gptq")
    _check_device(device)
    if out.exists() and not overwrite:
        raise _fail(f"--out {out} already exists; choose a new directory or pass --overwrite")
    cal = None
    policy = _activation_policy(activation) if activation is not None else None
    if policy is not None and chosen != "gptq":
        raise _fail("--activation applies to --method gptq only (W4A runs GPTQ weights)")
    if chosen == "gptq":
        if calibration is None:
            raise _fail("--method gptq needs --calibration (tiny, a text file or a .jsonl file)")
        _check_at_least("--samples", samples, 1)
        _check_at_least("--seq-len", seq_len, 2)
        _check_at_least("--batch-size", batch_size, 1)
    if layout is None:
        layout = "gptq" if policy is not None else "compressed-tensors"
    with _reported(DEVICE_ERRORS):
        normalize_layout(layout)
        dynamic = {f"-:{pattern}": {} for pattern in exclude or ()} or None
        if chosen == "gptq":
            config = floatxq.GPTQConfig(
                bits=bits,
                group_size=group_size,
                sym=sym,
                desc_act=desc_act,
                act_group_aware=act_group_aware and not desc_act,
                lm_head=lm_head,
                activation=policy,
                dynamic=dynamic,
            )
            cal = _calibration(calibration or TINY, samples=samples, seq_len=seq_len)
        else:
            config = floatxq.FP8Config(
                format=format,
                weight_scale_method=scale_method,
                weight_block_size=block_size,
                lm_head=lm_head,
                dynamic=dynamic,
            )
        # GPTQ's config goes to load: the model then stays on CPU (one layer at a time on
        # --device) and a native FP8/NVFP4 source is requantized instead of refused.
        gptq = chosen == "gptq"
        source = _source_model(model, device=device, quantize_config=config if gptq else None)
    if source.quantized:
        raise _fail(f"quantize: {model} is already quantized; pass the unquantized model")
    with _reported(DEVICE_ERRORS):
        source.quantize_config = config
        start = time.perf_counter()
        source.quantize(cal, batch_size=batch_size, progress=True)
        written = source.save(out, layout=layout, overwrite=overwrite)
    what = (
        f"gptq {config.bits}-bit, group {config.group_size}"
        if isinstance(config, floatxq.GPTQConfig)
        else f"{config.format}, {config.weight_scale_method}"
    )
    if policy is not None:
        what += f", activations {policy.mode}" + (f" {policy.recipe}" if policy.recipe else "")
    typer.echo(
        f"quantized {len(source.quantized_modules)} modules ({what}) in "
        f"{time.perf_counter() - start:.1f} s -> {written} (layout {layout})"
    )


def _activation_policy(spec: str) -> Any:
    """``--activation``: a mode name or the policy's JSON (read by ``bounded_json_loads``: no
    deep nesting, huge integers or non-finite numbers)."""
    import floatxq
    from floatxq._checks import bounded_json_loads

    text = spec.strip()
    if text[:1] in ("{", "["):
        try:
            value = bounded_json_loads(text, where="--activation")
        except ValueError as exc:
            detail = str(exc).removeprefix("--activation: ")
            raise _fail(
                f"--activation {_shown(spec)} is not JSON floatxq accepts: {detail}"
            ) from None
    else:
        value = text.lower()
    try:
        return floatxq.ActivationConfig.from_value(value)
    except (TypeError, ValueError) as exc:
        raise _fail(f"--activation {_shown(spec)}: {exc}") from None


@app.command()
def inspect(path: Path = typer.Argument(..., help="A model directory.")) -> None:
    """What a checkpoint is: layout, declared format, scale convention, layers and scales."""
    from floatxq.interop.inspect import inspect_checkpoint
    from floatxq.interop.layouts import READ_LAYOUTS, SCALE_CONVENTIONS

    with _reported():
        report = inspect_checkpoint(path)
    typer.echo(f"path:        {report.path}")
    typer.echo(f"model type:  {report.model_type}")
    typer.echo(f"layout:      {report.layout}: {READ_LAYOUTS.get(report.layout, '')}")
    typer.echo(f"decided by:  {report.evidence}")
    typer.echo(f"method:      {report.method or 'none (not quantized)'}")
    typer.echo(f"family:      {report.family}")
    typer.echo(f"format:      {report.format}")
    typer.echo(f"convention:  {report.convention}: {SCALE_CONVENTIONS.get(report.convention, '')}")
    typer.echo(f"quantized:   {len(report.quantized_layers)} layers")
    for layout, count in sorted(report.scale_layouts.items()):
        typer.echo(f"  scales {layout}: {count} layers")
    typer.echo(f"tensors:     {report.tensors} ({report.total_bytes / 1e6:.2f} MB)")
    typer.echo("dtypes:      " + ", ".join(f"{k} x{v}" for k, v in sorted(report.dtypes.items())))
    typer.echo(f"quantize_config.json: {'yes' if report.quantize_config_file else 'no'}")
    if report.activation is not None:
        typer.echo(f"activation:  {json.dumps(report.activation)} (W4A policy)")
        typer.echo(f"  activation global scales: {report.activation_scales} modules")


@app.command(name="eval")
def eval_(
    model: str = typer.Argument(..., help="A model directory, or 'tiny'."),
    reference: str | None = typer.Option(None, help="Reference model for KL / top-1."),
    windows: int = typer.Option(64, help="Held-out windows to evaluate."),
    seq_len: int = typer.Option(256, help="Tokens per window."),
    device: str | None = typer.Option(None, help="Device (cpu, cuda)."),
) -> None:
    """Perplexity on held-out stdlib text, and KL / top-1 agreement against a reference.

    Byte-vocabulary models read the evaluation split's bytes; other models need a tokenizer in
    their directory.
    """
    from floatxq.lifecycle.evaluate import evaluate_lm, heldout_windows

    _check_at_least("--windows", windows, 1)
    _check_at_least("--seq-len", seq_len, 2)
    _check_device(device)
    with _reported(DEVICE_ERRORS):
        candidate = _source_model(model, device=device).model
        ref = _source_model(reference, device=device).model if reference else None
    for name, m in ((model, candidate), (reference, ref)):
        limit = getattr(getattr(m, "config", None), "max_position_embeddings", None)
        if isinstance(limit, int) and seq_len > limit:
            raise _fail(
                f"--seq-len {seq_len} is longer than {name}'s max_position_embeddings ({limit})"
            )
    with _reported(DEVICE_ERRORS):
        vocab = int(getattr(getattr(candidate, "config", None), "vocab_size", 0) or 0)
        if ref is not None:  # named before the windows: they are tokenized for the candidate
            theirs = getattr(getattr(ref, "config", None), "vocab_size", None)
            if isinstance(theirs, int) and vocab and theirs != vocab:
                raise _fail(
                    f"eval: {model} has a vocabulary of {vocab} tokens (vocab_size) and "
                    f"--reference {reference} {theirs}; KL and top-1 need a reference of the "
                    f"same vocabulary (the same tokenizer)"
                )
        model_dir = None if model == TINY else model
        ids = heldout_windows(model_dir, vocab_size=vocab, seq_len=seq_len, max_windows=windows)
        report = evaluate_lm(candidate, ids, reference=ref)
    typer.echo(f"tokens:      {report.tokens}")
    typer.echo(f"perplexity:  {report.perplexity:.4f}")
    if report.kl_divergence is not None:
        typer.echo(f"KL:          {report.kl_divergence:.6f} nats/token")
        typer.echo(f"top-1:       {100 * report.top1_agreement:.2f}%")


@app.command()
def recipes(
    source: str = typer.Option("normal", help="normal, student_t3, outliers, or a checkpoint dir."),
    tensor: str | None = typer.Option(None, help="Tensor name inside a checkpoint."),
    size: int = typer.Option(
        1024, help="Rows and columns of a generated input (a positive multiple of 16)."
    ),
    png: Path | None = typer.Option(None, help="Write a bar chart here."),
) -> None:
    """NVFP4 scale recipes: relative MSE and share of blocks at the exact optimum."""
    import floatxq
    from floatxq.formats import NVFP4_BLOCK

    if source in GENERATED_SOURCES:
        if tensor is not None:
            raise _fail(f"--tensor names a tensor of a checkpoint --source, not of {source!r}")
        if size < 1 or size % NVFP4_BLOCK:
            raise _fail(f"--size must be a positive multiple of {NVFP4_BLOCK}, got {size}")
    elif not Path(source).is_dir():
        accepted = ", ".join(GENERATED_SOURCES)
        raise _fail(f"--source {source!r} is neither {accepted} nor a checkpoint directory")
    if png is not None:
        _check_png(png)
        try:
            import matplotlib
        except ImportError:
            raise _fail("--png needs matplotlib: pip install 'floatxq[plot]'") from None
    with _reported():
        x = _recipe_input(source, tensor, size)
        report = floatxq.recipes_report(x)
    typer.echo(
        f"NVFP4 recipes on {source}{f':{tensor}' if tensor else ''} {tuple(x.shape)} {x.dtype}"
    )
    typer.echo(f"{'recipe':<20} {'rel MSE':>10} {'optimal':>8} {'seconds':>8}")
    for row in report.rows:
        typer.echo(
            f"{row.recipe:<20} {row.rel_mse:>10.3e} {100 * row.optimal_share:>7.1f}% "
            f"{row.seconds:>8.2f}"
        )
    if png is not None:
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7, 3.2))
        ax.barh([r.recipe for r in report.rows], [r.rel_mse for r in report.rows], color="#d9822b")
        ax.invert_yaxis()
        ax.set_xlabel("relative MSE (lower is better)")
        ax.set_title(f"NVFP4 recipes: {source} {tuple(x.shape)}")
        fig.tight_layout()
        try:  # without a suffix matplotlib would write png + ".png" instead of png
            with _reported():
                fig.savefig(png, dpi=110, format=png.suffix[1:].lower() or "png")
        finally:
            plt.close(fig)
        typer.echo(f"chart: {png}")


def _recipe_input(source: str, tensor: str | None, size: int):
    import torch

    g = torch.Generator().manual_seed(0)
    if source == "normal":
        return torch.randn(size, size, generator=g).bfloat16()
    if source == "student_t3":
        torch.manual_seed(0)
        return torch.distributions.StudentT(3.0).sample((size, size)).bfloat16()
    if source == "outliers":
        x = torch.randn(size, size, generator=g)
        return torch.where(torch.rand(size, size, generator=g) < 1e-3, x * 50, x).bfloat16()
    from floatxq.interop.shards import iter_tensors

    if tensor is None:
        raise ValueError("--tensor NAME is needed with a checkpoint --source")
    for name, value in iter_tensors(source):
        if name == tensor:
            if not value.is_floating_point() or value.element_size() < 2:
                raise ValueError(f"tensor {name} is {value.dtype}; pick a bf16/fp16/fp32 tensor")
            return value
    raise ValueError(f"no tensor {tensor!r} in {source}")


def main() -> None:
    """Console-script entry point."""
    app()


if __name__ == "__main__":
    sys.exit(main())
