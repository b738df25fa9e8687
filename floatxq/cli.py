"""The ``floatxq`` command line: a thin shell over the library.

Commands: demo, quantize, inspect, eval, recipes; global options ``--version`` and ``--quiet``
(no progress bars or info lines: results and errors still print). Every user error ends the
command with one line ``error: <message>`` on stderr and exit code 2: arguments are checked
before any work, and the library's own errors (bad values, unreadable or damaged files, unusable
devices) are caught around the calls that can raise them, keeping the library's message.

Importing this module is cheap (``floatxq`` loads its names on first use): torch and
transformers are imported inside the commands, so ``--help`` and ``--version`` answer at once.
The argument checks and the error lines are :mod:`floatxq.cli_checks`'s.
"""

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import typer

from floatxq.cli_checks import (
    DEVICE_ERRORS,
    INPUT_ERRORS,
    activation_policy,
    check_at_least,
    check_device,
    check_png,
    fail,
    reported,
    shown,
)

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    help=(
        "floatxq: quantize LLMs to FP8, NVFP4 or GPTQ INT4 weights (W4A16, W4A-FP8, W4A-NVFP4)"
        " and run them: load, quantize, save, inspect a checkpoint, evaluate perplexity / KL /"
        " top-1 (and lm-eval tasks), compare NVFP4 scale recipes, or run the demo."
    ),
)

TINY = "tiny"
GENERATED_SOURCES: tuple[str, ...] = ("normal", "student_t3", "outliers")
LM_EVAL_EXTRA = "lm-eval"
"""The extra that installs lm-eval (``pip install 'floatxq[lm-eval]'``) for ``eval --tasks``."""


# Set by the global options (``_root``) before each command runs.
_GLOBAL: dict[str, bool] = {"quiet": False}


def _quiet() -> bool:
    """Whether ``--quiet`` was given: commands then show no progress bars and no info lines
    (results and ``error:`` lines still print)."""
    return _GLOBAL["quiet"]


def _info(message: str) -> None:
    """An info line on stdout, unless ``--quiet``."""
    if not _quiet():
        typer.echo(message)


def _echo_json(value: Any) -> None:
    """``--json``: one JSON object on stdout (a value JSON lacks is written as its ``str``)."""
    typer.echo(json.dumps(value, default=str, allow_nan=True))


def _version(value: bool) -> bool:
    """``--version``: print ``floatxq <version>`` and exit (the value passes on otherwise)."""
    if value:
        import floatxq

        typer.echo(f"floatxq {floatxq.__version__}")
        raise typer.Exit()
    return value


def _source_model(
    model: str, *, device: str | None, quantize_config=None, revision: str | None = None,
    offload: bool = False,
):  # fmt: skip
    """The model ``floatxq.load`` resolves ``model`` to: the built-in tiny Llama for ``tiny``,
    a local directory, or a Hub id ``org/name`` (from the local Hub cache, downloaded unless
    ``HF_HUB_OFFLINE=1``; :func:`floatxq.lifecycle.loading.resolve_model`)."""
    import floatxq

    return floatxq.load(
        model, device=device, quantize_config=quantize_config, revision=revision,
        offload="disk" if offload else None,
    )  # fmt: skip


def _torchrun_group(device: str | None) -> tuple[Any, str | None]:
    """Under ``torchrun`` with more than one process (``WORLD_SIZE`` > 1): the process group
    that shares the run (:func:`~floatxq.lifecycle.distributed.torchrun_setup`) and the
    ``--device`` this process passes on: ``cuda:LOCAL_RANK`` for ``cuda``, a non-CUDA one as it
    is (every process works there, over gloo), none as none (the work then goes to the current
    CUDA device, this process's). Otherwise ``(None, device)``."""
    world = os.environ.get("WORLD_SIZE", "").strip()
    if not world.isdigit():
        if world:
            raise fail(f"WORLD_SIZE={shown(world)} is not a process count (torchrun sets it)")
        return None, device
    if int(world) <= 1:
        return None, device
    import torch

    from floatxq.lifecycle.distributed import torchrun_setup

    chosen = torch.device(device) if device is not None else None
    if chosen is not None and chosen.type == "cuda" and chosen.index is not None:
        raise fail(
            f"--device {device} names one GPU; under torchrun each process works on its own "
            f"(cuda:LOCAL_RANK): pass --device cuda or no --device"
        )
    elsewhere = chosen is not None and chosen.type != "cuda"
    with reported(DEVICE_ERRORS):
        group, work = torchrun_setup(backend="gloo" if elsewhere else None)
    # no --device: load's default, where the work goes to the current CUDA device (just set)
    return group, str(work) if chosen is not None and not elsewhere else device


def _calibration(
    spec: str, *, samples: int, seq_len: int, text_column: str = "text"
) -> tuple[list, dict[str, Any]]:
    """Calibration samples and the ``quantize`` options that cut them: ``tiny`` (the built-in
    corpus' calibration split: ``samples`` windows of ``seq_len`` byte ids), or a local file
    (:func:`floatxq.lifecycle.calibration.load_calibration_file`: ``.txt`` whole, ``.jsonl`` /
    ``.json`` records with ``text_column`` or ``input_ids``, ``.parquet``) whose tokens are
    concatenated and cut into ``samples`` windows of ``seq_len`` tokens."""

    if spec == TINY:
        from floatxq.tiny import calibration_samples

        return calibration_samples(num_samples=samples, seq_len=seq_len), {}
    from floatxq.lifecycle.calibration import load_calibration_file

    path = Path(spec)
    if not path.is_file():
        raise fail(f"--calibration {spec!r} is neither 'tiny' nor a readable file")
    try:
        rows = load_calibration_file(path, text_column=text_column, lines=False)
    except (*INPUT_ERRORS, ImportError) as exc:  # ImportError: .parquet without pyarrow
        # the library names the file; the command line names the option that gave it
        raise fail(f"--calibration {str(exc).removeprefix('calibration file ')}") from None
    if not rows:
        raise fail(f"--calibration {spec}: the file holds no samples")
    options = {"max_length": seq_len, "overflow": "chunk", "num_samples": samples}
    return rows, options


@app.callback()
def _root(
    version: bool = typer.Option(
        False,
        "--version",
        callback=_version,
        is_eager=True,
        help="Print 'floatxq <version>' and exit.",
    ),
    quiet: bool = typer.Option(
        False, "--quiet", "-q", help="No progress bars or info lines (results and errors print)."
    ),
) -> None:
    """floatxq: FP8, NVFP4 and GPTQ (W4A16, W4A-FP8, W4A-NVFP4) quantization of LLMs."""
    _GLOBAL["quiet"] = quiet


@app.command()
def demo(
    windows: int = typer.Option(24, help="Held-out windows of 256 byte tokens to evaluate."),
    png: Path = typer.Option(Path("floatxq-demo.png"), help="Where to write the chart."),
) -> None:
    """Every quantization path on the built-in trained tiny Llama: quality, size, time, chart."""
    check_at_least("--windows", windows, 1)
    check_png(png)
    from floatxq.demo import plot_demo, run_demo

    _info("floatxq demo: the tiny Llama (6.4M parameters, trained on stdlib docstrings)")
    start = time.perf_counter()
    report = run_demo(max_windows=windows, on_path=lambda name: _info(f"  running {name} ..."))
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
        with reported():
            plot_demo(report, str(png))
        typer.echo(f"\nchart: {png}")
    except ImportError:
        typer.echo("\n(matplotlib is not installed: pip install 'floatxq[plot]' for the chart)")
    _info(f"done in {time.perf_counter() - start:.1f} s")


@app.command()
def quantize(
    model: str = typer.Argument(
        ...,
        help="A local Hugging Face model directory, 'tiny', or a Hub id org/name (from the local "
        "Hub cache, downloaded unless HF_HUB_OFFLINE=1).",
    ),
    out: Path = typer.Option(..., "--out", help="Directory to write the quantized model to."),
    revision: str | None = typer.Option(None, help="A Hub model's branch, tag or commit."),
    method: str = typer.Option("fp8", help="Quantization method: fp8, gptq or nvfp4."),
    format: str = typer.Option("float8_e4m3fn", "--format", help="FP8 format or alias."),
    scale_method: str | None = typer.Option(None, help="tensor, row or block."),
    block_size: tuple[int, int] | None = typer.Option(None, help="Block rows and columns."),
    lm_head: bool = typer.Option(False, help="Quantize the output embedding too."),
    exclude: list[str] | None = typer.Option(None, help="Regex of modules to leave alone."),
    device: str | None = typer.Option(None, help="Device to quantize on (cpu, cuda)."),
    overwrite: bool = typer.Option(False, help="Replace an existing --out directory."),
    offload: bool = typer.Option(
        False, help="Read MODEL a decoder layer at a time, writing --out as it goes."
    ),
    resume: bool = typer.Option(False, help="With --offload: finish a run cut short."),
    split_rows: bool = typer.Option(
        False, help="Under torchrun, GPTQ: split every module's rows over the processes."
    ),
    layout: str | None = typer.Option(
        None,
        help="Checkpoint layout: compressed-tensors (the default; transformers with "
        "compressed-tensors, vLLM), hf (transformers/DeepSeek fine-grained FP8: tensor or block "
        "scales), gptq (GPTQ files vLLM, TGI and GPT-QModel read; the default with --activation, "
        "the one layout that holds a policy), gptqmodel (GPT-QModel's files) or modelopt "
        "(NVIDIA ModelOpt's NVFP4 files: TensorRT-LLM, vLLM, SGLang; --method nvfp4 only).",
    ),
    recipe: str = typer.Option(
        "least_squares", help="NVFP4: the block-scale recipe (NVFP4Config's default)."
    ),
    global_scale: str = typer.Option(
        "module", help="NVFP4: each module's own global scale, or 'fused' (q/k/v, gate/up share)."
    ),
    activations: str | None = typer.Option(
        None,
        help="NVFP4: 'nvfp4' quantizes each linear's input too (W4A4, a calibrated static "
        "global scale per module; needs --calibration). Default: weight-only (NVFP4A16).",
    ),
    nvfp4_gptq: bool = typer.Option(
        False,
        "--gptq",
        help="NVFP4: GPTQ's column solve onto the NVFP4 grid with the recipe's block scales "
        "instead of round to nearest (needs --calibration).",
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
        help="GPTQ: 'tiny' (the built-in corpus, byte ids) or a local file: text (.txt), "
        ".jsonl / .json records (strings, or objects with --text-column or input_ids) or "
        ".parquet (needs pyarrow); a file's tokens are concatenated and cut into --samples "
        "windows of --seq-len tokens.",
    ),
    text_column: str = typer.Option(
        "text", help="GPTQ: the field / column of a .jsonl, .json or .parquet file with the text."
    ),
    samples: int = typer.Option(128, help="GPTQ: calibration samples (windows) to use at most."),
    seq_len: int | None = typer.Option(
        None,
        help="GPTQ: tokens per calibration window (default: 256 for tiny; for a file the "
        "model's max_position_embeddings, at most 2048).",
    ),
    batch_size: int = typer.Option(8, help="GPTQ: calibration samples per forward."),
    activation: str | None = typer.Option(
        None,
        help="GPTQ: a W4A activation policy, solved for and saved with the weights: w4afp8, "
        'w4a_nvfp4, or its JSON, e.g. \'{"mode": "w4a_nvfp4", "recipe": "nvidia", '
        '"attention": {"mode": "w4afp8"}}\' (needs 4 bits, group 128, sym, no desc-act).',
    ),
    gsq: bool = typer.Option(
        False, "--gsq", help="FP8: re-choose the codes with GSQ after round to nearest."
    ),
    gsq_calibration: bool = typer.Option(
        False,
        "--gsq-calibration",
        help="FP8 with --gsq: weight GSQ by calibration Hessians (needs --calibration; row or "
        "block scales).",
    ),
    gsq_steps: int | None = typer.Option(None, help="FP8 with --gsq: Adam steps (default 100)."),
    gsq_candidates: int | None = typer.Option(
        None, help="FP8 with --gsq: codes per weight, 2 to 33 (default 5)."
    ),
    gsq_seed: int | None = typer.Option(None, help="FP8 with --gsq: the seed (default 0)."),
    as_json: bool = typer.Option(
        False,
        "--json",
        help="Print one JSON object: the output, layout, modules and (GPTQ) each module's loss "
        "(GSQ: each module's objective).",
    ),
) -> None:
    """Quantize a model's linear layers and save the checkpoint in a chosen layout."""
    import floatxq
    from floatxq.interop.export import normalize_layout

    chosen = method.strip().lower()
    if chosen not in ("fp8", "gptq", "nvfp4"):
        raise fail(f"unsupported --method {method!r}; accepted: fp8, gptq, nvfp4")
    check_device(device)
    if out.exists() and not overwrite:
        raise fail(f"--out {out} already exists; choose a new directory or pass --overwrite")
    cal = None
    policy = activation_policy(activation) if activation is not None else None
    if policy is not None and chosen != "gptq":
        raise fail("--activation applies to --method gptq only (W4A runs GPTQ weights)")
    if chosen != "nvfp4" and (activations is not None or nvfp4_gptq):
        raise fail("--activations and --gptq apply to --method nvfp4 only")
    settings = {"steps": gsq_steps, "candidates": gsq_candidates, "seed": gsq_seed}
    from floatxq import cli_gsq

    with reported():
        gsq_config = cli_gsq.gsq_config(chosen, gsq, gsq_calibration, settings)
    calibrated = chosen == "gptq" or (chosen == "nvfp4" and (nvfp4_gptq or activations is not None))
    calibrated = calibrated or gsq_calibration
    if calibrated:
        if calibration is None:
            what = {"gptq": "gptq", "fp8": "fp8 with --gsq-calibration"}.get(
                chosen, "nvfp4 with --gptq or --activations"
            )
            raise fail(
                f"--method {what} needs --calibration (tiny, or a .txt, .jsonl, .json or "
                f".parquet file)"
            )
        check_at_least("--samples", samples, 1)
        if seq_len is not None:
            check_at_least("--seq-len", seq_len, 2)
        check_at_least("--batch-size", batch_size, 1)
        if calibration != TINY and not Path(calibration).is_file():
            raise fail(f"--calibration {calibration!r} is neither 'tiny' nor a readable file")
    group, device = _torchrun_group(device)  # one process per GPU: they share the run
    first = group is None or group.rank() == 0  # the process that saves and prints
    processes = 1 if group is None else group.size()
    if layout is None:
        layout = "gptq" if policy is not None else "compressed-tensors"
    with reported(DEVICE_ERRORS):
        layout = normalize_layout(layout)
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
        elif chosen == "nvfp4":
            config = floatxq.NVFP4Config(
                recipe=recipe, method="gptq" if nvfp4_gptq else "rtn", activations=activations,
                global_scale=global_scale, lm_head=lm_head, dynamic=dynamic,
            )  # fmt: skip
        else:
            config = floatxq.FP8Config(
                format=format,
                weight_scale_method=scale_method,
                weight_block_size=block_size,
                lm_head=lm_head,
                dynamic=dynamic,
                gsq=gsq_config,
                gsq_calibration=gsq_calibration,
            )
        # A calibrated config goes to load: the model then stays on CPU (one layer at a time on
        # --device) and a native FP8/NVFP4 source is requantized instead of refused.
        source = _source_model(
            model, device=device, quantize_config=config if calibrated or offload else None,
            revision=revision, offload=offload,
        )  # fmt: skip
    if source.quantized:
        raise fail(f"quantize: {model} is already quantized; pass the unquantized model")
    from floatxq.lifecycle.layout_check import check_layout

    with reported(DEVICE_ERRORS):  # method x layout x modules, before calibration and solve
        check_layout(source, config, layout, where="quantize")
    options: dict[str, Any] = {}
    if calibrated:
        assert calibration is not None  # checked above
        positions = getattr(getattr(source.model, "config", None), "max_position_embeddings", None)
        positions = positions if isinstance(positions, int) and positions > 0 else None
        if seq_len is not None and positions is not None and seq_len > positions:
            raise fail(
                f"--seq-len {seq_len} is longer than {model}'s max_position_embeddings "
                f"({positions})"
            )
        window = seq_len or (256 if calibration == TINY else min(2048, positions or 2048))
        cal, options = _calibration(
            calibration, samples=samples, seq_len=window, text_column=text_column
        )
    with reported(DEVICE_ERRORS):
        source.quantize_config = config
        start = time.perf_counter()
        if offload:
            options.update(out=out, overwrite=overwrite, resume=resume)
        if split_rows:
            options.update(split_rows=True)
        source.quantize(
            cal, batch_size=batch_size, progress=not _quiet(), layout=layout,
            process_group=group, **options,
        )  # fmt: skip
        written = source.report.out if offload else out
        if first and not offload:
            written = source.save(out, layout=layout, overwrite=overwrite)
    if group is not None:
        import torch.distributed

        torch.distributed.destroy_process_group()
    if not first:
        return
    if isinstance(config, floatxq.GPTQConfig):
        what = f"gptq {config.bits}-bit, group {config.group_size}"
    elif isinstance(config, floatxq.NVFP4Config):
        what = f"nvfp4 {config.recipe} {config.method}, {config.global_scale} global scales"
        what += ", W4A4" if config.activations else ""
    else:
        what = f"{config.format}, {config.weight_scale_method}"
        what += (", gsq calibrated" if gsq_calibration else ", gsq") if gsq else ""
    if policy is not None:
        what += f", activations {policy.mode}" + (f" {policy.recipe}" if policy.recipe else "")
    seconds = time.perf_counter() - start
    report = getattr(source, "report", None)
    if as_json:
        _echo_json({
            "out": str(written), "layout": layout, "scheme": what, "seconds": seconds,
            "processes": processes,
            "modules": list(source.quantized_modules),
            "gptq": report.to_dict() if hasattr(report, "to_dict") else None,
            "gsq": cli_gsq.gsq_report_dict(report) if gsq else None,
        })  # fmt: skip
        return
    typer.echo(
        f"quantized {len(source.quantized_modules)} modules ({what}) in "
        f"{seconds:.1f} s{f' by {processes} processes' if processes > 1 else ''} -> {written} "
        f"(layout {layout})"
    )
    if gsq:
        typer.echo(cli_gsq.gsq_summary(report))
        for module in report.modules:
            _info(cli_gsq.gsq_module_line(module))


@app.command()
def inspect(
    path: str = typer.Argument(
        ..., help="A model directory, 'tiny', or a Hub id org/name (from the local Hub cache)."
    ),
    as_json: bool = typer.Option(
        False, "--json", help="Print one JSON object (the report's fields) instead."
    ),
) -> None:
    """What a checkpoint is: layout, declared format, scale convention, layers and scales."""
    from floatxq.interop.inspect import inspect_checkpoint
    from floatxq.interop.layouts import READ_LAYOUTS, SCALE_CONVENTIONS

    with reported():
        if not Path(path).exists():  # a name: the built-in model or a Hub id
            from floatxq.lifecycle.loading import resolve_model

            path = str(resolve_model(path))
        report = inspect_checkpoint(path)
    if as_json:
        _echo_json(_checkpoint_report_dict(report))
        return
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
    typer.echo(f"activations: {report.activations}")
    typer.echo(f"tensors:     {report.tensors} ({report.total_bytes / 1e6:.2f} MB)")
    typer.echo("dtypes:      " + ", ".join(f"{k} x{v}" for k, v in sorted(report.dtypes.items())))
    typer.echo(f"quantize_config.json: {'yes' if report.quantize_config_file else 'no'}")
    if report.activation is not None:
        typer.echo(f"activation:  {json.dumps(report.activation)} (W4A policy)")
        typer.echo(f"  activation global scales: {report.activation_scales} modules")


def _checkpoint_report_dict(report: Any) -> dict[str, Any]:
    """``inspect --json``: a ``CheckpointReport``'s fields (tuples as lists) and the one-line
    descriptions of its layout and scale convention."""
    from floatxq.interop.layouts import READ_LAYOUTS, SCALE_CONVENTIONS

    out = {k: list(v) if isinstance(v, tuple) else v for k, v in report._asdict().items()}
    out["layout_description"] = READ_LAYOUTS.get(report.layout, "")
    out["convention_description"] = SCALE_CONVENTIONS.get(report.convention, "")
    return out


@app.command(name="eval")
def eval_(
    model: str = typer.Argument(..., help="A model directory, or 'tiny'."),
    reference: str | None = typer.Option(
        None, help="Reference model: KL / top-1 against it, and its own perplexity."
    ),
    windows: int = typer.Option(64, help="Windows to evaluate (at most)."),
    seq_len: int = typer.Option(256, help="Tokens per window."),
    device: str | None = typer.Option(None, help="Device (cpu, cuda)."),
    text: Path | None = typer.Option(
        None,
        "--text",
        help="Evaluate on this UTF-8 text file (in the model's tokens) instead of the built-in "
        "held-out text.",
    ),
    tasks: str | None = typer.Option(
        None,
        "--tasks",
        help=f"lm-eval tasks, comma-separated (e.g. hellaswag,arc_easy), run through lm-eval's "
        f"HFLM on the loaded model; needs pip install 'floatxq[{LM_EVAL_EXTRA}]'.",
    ),
    task_limit: int | None = typer.Option(None, "--limit", help="lm-eval: examples per task."),
    include_path: Path | None = typer.Option(
        None, help="lm-eval: a folder of your own task YAML files (with --tasks)."
    ),
    as_json: bool = typer.Option(
        False, "--json", help="Print one JSON object (the report's fields) instead."
    ),
) -> None:
    """Perplexity on held-out text (or --text); KL, top-1 and perplexity of a --reference.

    Byte-vocabulary models read the text's bytes; other models need a tokenizer in their
    directory. --tasks runs lm-eval tasks on the loaded model.
    """
    from floatxq.lifecycle.evaluate import evaluate_lm, heldout_windows, text_windows

    check_at_least("--windows", windows, 1)
    check_at_least("--seq-len", seq_len, 2)
    check_device(device)
    task_names = _lm_eval_tasks(tasks, model, task_limit) if tasks is not None else None
    if text is not None:
        try:
            own_text = text.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise fail(f"--text {text}: cannot read it as UTF-8 text ({exc})") from None
    with reported(DEVICE_ERRORS):
        loaded = _source_model(model, device=device)
        candidate = loaded.model
        ref = _source_model(reference, device=device).model if reference else None
    for name, m in ((model, candidate), (reference, ref)):
        limit = getattr(getattr(m, "config", None), "max_position_embeddings", None)
        if isinstance(limit, int) and seq_len > limit:
            raise fail(
                f"--seq-len {seq_len} is longer than {name}'s max_position_embeddings ({limit})"
            )
    with reported(DEVICE_ERRORS):
        vocab = int(getattr(getattr(candidate, "config", None), "vocab_size", 0) or 0)
        if ref is not None:  # named before the windows: they are tokenized for the candidate
            theirs = getattr(getattr(ref, "config", None), "vocab_size", None)
            if isinstance(theirs, int) and vocab and theirs != vocab:
                raise fail(
                    f"eval: {model} has a vocabulary of {vocab} tokens (vocab_size) and "
                    f"--reference {reference} {theirs}; KL and top-1 need a reference of the "
                    f"same vocabulary (the same tokenizer)"
                )
        model_dir = None if model == TINY else str(loaded.source)  # a Hub id: its snapshot
        if text is not None:
            ids = text_windows(
                own_text, model_dir, vocab_size=vocab, seq_len=seq_len, max_windows=windows
            )
        else:
            ids = heldout_windows(model_dir, vocab_size=vocab, seq_len=seq_len, max_windows=windows)
        from tqdm.auto import tqdm

        passes = 2 if ref is not None else 1
        with tqdm(
            total=passes * ids.shape[0], desc="eval", unit="window", leave=False, disable=_quiet()
        ) as bar:
            report = evaluate_lm(candidate, ids, reference=ref, progress=bar.update)
        results = (
            _run_lm_eval(candidate, str(loaded.source), task_names, task_limit, include_path)
            if task_names
            else None
        )
    from floatxq.lifecycle.activation_summary import activation_summary

    summary = activation_summary(candidate)  # what the scored model does to its activations
    if as_json:
        out = {"model": model, "reference": reference, "text": str(text) if text else None}
        out["activations"] = summary
        out.update(windows=int(ids.shape[0]), seq_len=seq_len, **report.to_dict())
        if results is not None:
            out["tasks"] = results
        _echo_json(out)
        return
    typer.echo(f"activations: {summary}")
    typer.echo(f"tokens:      {report.tokens}")
    typer.echo(f"perplexity:  {report.perplexity:.4f}")
    if report.kl_divergence is not None:
        typer.echo(f"reference:   perplexity {report.reference_perplexity:.4f} ({reference})")
        typer.echo(f"KL:          {report.kl_divergence:.6f} nats/token")
        typer.echo(f"top-1:       {100 * report.top1_agreement:.2f}%")
    for task, metrics in (results or {}).items():
        for metric, value in metrics.items():
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                typer.echo(f"{task:<24} {metric:<28} {value:.4f}")


def _lm_eval_tasks(tasks: str, model: str, limit: int | None) -> list[str]:
    """``--tasks``' names, checked before any work: lm-eval installed, a tokenizer to give it."""
    names = [t.strip() for t in tasks.split(",") if t.strip()]
    if not names:
        raise fail(f"--tasks {shown(tasks)} names no task; e.g. --tasks hellaswag,arc_easy")
    if limit is not None:
        check_at_least("--limit", limit, 1)
    try:
        import lm_eval  # noqa: F401
    except ImportError:
        raise fail(
            f"--tasks needs lm-eval, which is not installed: pip install 'floatxq[{LM_EVAL_EXTRA}]'"
        ) from None
    if model == TINY:
        raise fail("--tasks needs a model directory with a tokenizer; 'tiny' reads bytes")
    return names


def _run_lm_eval(
    model: Any, model_dir: str, tasks: list[str], limit: int | None, include: Path | None = None
) -> dict:
    """lm-eval's ``simple_evaluate`` on the loaded (quantized) model through its ``HFLM``
    wrapper (``include``: a folder of task YAML files for its ``TaskManager``); returns its
    ``results`` (task → metric → value)."""
    import lm_eval
    from lm_eval.models.huggingface import HFLM
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    extra: dict[str, Any] = {}
    if include is not None:
        from lm_eval.tasks import TaskManager

        extra["task_manager"] = TaskManager(include_path=str(include))
    out = lm_eval.simple_evaluate(
        model=HFLM(pretrained=model, tokenizer=tokenizer), tasks=tasks, limit=limit, **extra
    )
    return dict((out or {}).get("results", {}))


@app.command()
def recipes(
    source: str = typer.Option("normal", help="normal, student_t3, outliers, or a checkpoint dir."),
    tensor: str | None = typer.Option(None, help="Tensor name inside a checkpoint."),
    size: int = typer.Option(
        1024, help="Rows and columns of a generated input (a positive multiple of 16)."
    ),
    png: Path | None = typer.Option(None, help="Write a bar chart here."),
    as_json: bool = typer.Option(
        False, "--json", help="Print one JSON object (the report's rows) instead of the table."
    ),
) -> None:
    """NVFP4 scale recipes: relative MSE and share of blocks at the exact optimum."""
    import floatxq
    from floatxq.formats import NVFP4_BLOCK

    if source in GENERATED_SOURCES:
        if tensor is not None:
            raise fail(f"--tensor names a tensor of a checkpoint --source, not of {source!r}")
        if size < 1 or size % NVFP4_BLOCK:
            raise fail(f"--size must be a positive multiple of {NVFP4_BLOCK}, got {size}")
    elif not Path(source).is_dir():
        accepted = ", ".join(GENERATED_SOURCES)
        raise fail(f"--source {source!r} is neither {accepted} nor a checkpoint directory")
    if png is not None:
        check_png(png)
        try:
            import matplotlib
        except ImportError:
            raise fail("--png needs matplotlib: pip install 'floatxq[plot]'") from None
    with reported():
        x = _recipe_input(source, tensor, size)
        report = floatxq.recipes_report(x)
    if as_json:
        source_info = {"source": source, "tensor": tensor, "dtype": str(x.dtype).split(".")[-1]}
        _echo_json({**source_info, **report.to_dict()})
    else:
        typer.echo(
            f"NVFP4 recipes on {source}{f':{tensor}' if tensor else ''} {tuple(x.shape)} {x.dtype}"
        )
        typer.echo(report.table())
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
            with reported():
                fig.savefig(png, dpi=110, format=png.suffix[1:].lower() or "png")
        finally:
            plt.close(fig)
        if not as_json:  # stdout holds the one JSON object
            _info(f"chart: {png}")


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
