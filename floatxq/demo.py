"""The demo: every quantization path on the trained tiny Llama, measured against the original.

Quality is meaningless on random weights, so the demo uses the shipped tiny Llama (6.4M
parameters, trained on the standard library's docstrings) and its held-out evaluation split:
perplexity, KL divergence and top-1 agreement against the unquantized model, size, time.
``floatxq demo`` (``floatxq/cli.py``) prints the table and draws the chart.
"""

import copy
import time
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch import nn

from floatxq.config import FP8Config, GPTQConfig, NVFP4Config
from floatxq.gptq.solve import GPTQSolveOptions, rtn_quantize
from floatxq.lifecycle.evaluate import EvalReport, evaluate_lm, reference_logprobs
from floatxq.lifecycle.loading import load

FP8_PATHS: tuple[tuple[str, FP8Config], ...] = (
    ("fp8 e4m3 tensor", FP8Config(format="float8_e4m3fn", weight_scale_method="tensor")),
    ("fp8 e4m3 row", FP8Config(format="float8_e4m3fn", weight_scale_method="row")),
    ("fp8 e4m3 block 128x128", FP8Config(format="float8_e4m3fn", weight_block_size=(128, 128))),
    ("fp8 e5m2 row", FP8Config(format="float8_e5m2", weight_scale_method="row")),
)
NVFP4_RECIPES: tuple[str, ...] = ("nvidia", "four_six", "least_squares", "least_squares_grid")
W4A_PATHS: tuple[tuple[str, dict[str, Any], int], ...] = (
    ("int4 gptq W4A-FP8 (W4AFP8Linear)", {"mode": "w4afp8"}, 1),
    ("int4 gptq W4A-NVFP4 least_squares", {"mode": "w4a_nvfp4", "recipe": "least_squares"}, 1),
    ("int4 gptq W4A-NVFP4 exhaustive", {"mode": "w4a_nvfp4", "recipe": "exhaustive"}, 4),
    (
        "int4 gptq W4A fp8 attention, nvfp4 lsq mlp",
        {"mode": "w4a_nvfp4", "recipe": "least_squares", "attention": {"mode": "w4afp8"}},
        1,
    ),
)
"""W4A GPTQ rows: name, activation policy (``GPTQConfig(activation=...)``), and the divisor of the
calibration windows the row solves on. ``exhaustive`` takes a quarter of them: on the CPU its
reference search (the windowed scan of ``docs/numerics.md``) still costs about 4× ``least_squares``
per activation, in the solve's replay and in the evaluation alike."""


class DemoRow(NamedTuple):
    """One path's measurements."""

    path: str
    perplexity: float
    kl_divergence: float
    top1_agreement: float
    bytes: int
    """Checkpoint size: quantized tensors as stored, every other tensor counted as bf16."""
    seconds: float
    """Wall time of the quantization (informational)."""
    simulated: bool
    """True for weight QDQ without a packed runtime module (numerics only)."""


class DemoReport(NamedTuple):
    """The demo's rows and the evaluation it used."""

    rows: tuple[DemoRow, ...]
    windows: int
    tokens: int


def _size(model: nn.Module, *, packed_linear_bits: float | None = None) -> int:
    """Bytes as stored: FP8 modules exactly, every other floating tensor as bf16.

    With ``packed_linear_bits``, the weights of ``nn.Linear`` modules other than the output
    embedding count at that many bits per value (a packed format's size).
    """
    from floatxq.nn.fp8_linear import TorchFP8Linear
    from floatxq.nn.gptq_linear import GPTQLinear

    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    total = 0.0
    for module in model.modules():
        # saved tensors only: a W4A module's staged operands are non-persistent caches
        transient = module._non_persistent_buffers_set
        tensors = list(module.named_parameters(recurse=False)) + [
            (name, buffer)
            for name, buffer in module.named_buffers(recurse=False)
            if name not in transient
        ]
        for name, tensor in tensors:
            if isinstance(module, (TorchFP8Linear, GPTQLinear)):
                total += tensor.numel() * tensor.element_size()
            elif (
                packed_linear_bits is not None
                and isinstance(module, nn.Linear)
                and module is not head
                and name == "weight"
            ):
                total += tensor.numel() * packed_linear_bits / 8
            elif tensor.is_floating_point():
                total += tensor.numel() * 2
            else:
                total += tensor.numel() * tensor.element_size()
    return int(total)


def _row(name: str, model: nn.Module, refs, windows, seconds, size, *, simulated) -> DemoRow:
    report: EvalReport = evaluate_lm(model, windows, reference=refs)
    return DemoRow(
        name,
        report.perplexity,
        float(report.kl_divergence or 0.0),
        float(report.top1_agreement or 0.0),
        size,
        seconds,
        simulated,
    )


def _linear_targets(model: nn.Module) -> dict[str, nn.Linear]:
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    return {n: m for n, m in model.named_modules() if isinstance(m, nn.Linear) and m is not head}


def _rtn_weights(model: nn.Module, options: GPTQSolveOptions) -> nn.Module:
    """A copy whose linear weights (not lm_head) are round-to-nearest INT4 values (dense)."""
    out = copy.deepcopy(model)
    with torch.no_grad():
        for module in _linear_targets(out).values():
            module.weight.copy_(rtn_quantize(module.weight.detach(), options).dequantized)
    return out


def run_demo(
    *,
    model: nn.Module | None = None,
    windows: torch.Tensor | None = None,
    max_windows: int = 24,
    seq_len: int = 256,
    calibration_windows: int = 32,
    on_path: Callable[[str], None] | None = None,
) -> DemoReport:
    """Run every available quantization path on the tiny Llama and measure each one.

    Args:
      model: the reference model (default: the shipped tiny Llama in FP32).
      windows: evaluation token windows (default: ``max_windows`` windows of ``seq_len`` from the
        held-out evaluation split).
      calibration_windows: windows of 256 tokens from the calibration split that the GPTQ rows
        solve on (a row of :data:`W4A_PATHS` with a divisor above 1 takes that share, named in
        the row).
      on_path: called with each path's name before it runs (progress).

    Numerics: FP8 paths through the real ``TorchFP8Linear`` modules; NVFP4 rows through the NVFP4
    lifecycle (``NVFP4Config``: round to nearest per recipe, GPTQ onto the grid and W4A4 on the
    calibration windows) and its ``TorchFP4Linear`` modules; the INT4 RTN row the dequantized
    round-to-nearest weights, marked ``simulated`` (numerics without a packed runtime); the GPTQ
    rows are the real lifecycle: ``calibration_windows`` windows, layer by layer, ``GPTQLinear``
    modules (W4A16) evaluated as they run, and the W4A rows (:data:`W4A_PATHS`) GPTQ solved
    against the activation policy they then run: ``W4AFP8Linear`` / ``W4ANVFP4Linear`` modules
    under the Llama activation stream (per-token FP8 or NVFP4 activations with dynamic global
    scales; the CPU takes the modules' reference routes).

    Raises:
      ValueError: ``calibration_windows`` is not a positive int.
    """
    from floatxq.tiny import load_tiny_llama, token_windows

    if type(calibration_windows) is not int or calibration_windows < 1:
        raise ValueError(
            f"run_demo: calibration_windows must be a positive int, got {calibration_windows!r}"
        )

    reference = model if model is not None else load_tiny_llama(dtype=torch.float32)
    if windows is None:
        windows = token_windows("evaluation", seq_len=seq_len, max_windows=max_windows)
    refs = reference_logprobs(reference, windows)
    rows = [
        _row("bf16 (reference)", reference, refs, windows, 0.0, _size(reference), simulated=False)
    ]
    for name, config in FP8_PATHS:
        if on_path is not None:
            on_path(name)
        start = time.perf_counter()
        qmodel = load(copy.deepcopy(reference), quantize_config=config).quantize(progress=False)
        seconds = time.perf_counter() - start
        rows.append(
            _row(name, qmodel.model, refs, windows, seconds, _size(qmodel.model), simulated=False)
        )
    from floatxq.tiny import calibration_samples

    samples = calibration_samples(num_samples=calibration_windows, seq_len=256)
    nvfp4_paths = [(f"nvfp4 {r} (NVFP4A16)", NVFP4Config(recipe=r))
                   for r in NVFP4_RECIPES]  # fmt: skip
    nvfp4_paths += [
        ("nvfp4 least_squares gptq (NVFP4A16)", NVFP4Config(method="gptq")),
        ("nvfp4 least_squares W4A4 (NVFP4 activations)",
         NVFP4Config(activations="nvfp4")),
    ]  # fmt: skip
    for name, config in nvfp4_paths:
        if on_path is not None:
            on_path(name)
        start = time.perf_counter()
        nvfp4 = load(copy.deepcopy(reference), quantize_config=config, device="cpu")
        nvfp4.quantize(samples if config.needs_calibration else None, batch_size=8, progress=False)
        seconds = time.perf_counter() - start
        size = _size(nvfp4.model)  # the modules as stored: codes, E4M3 and FP32 scales
        rows.append(_row(name, nvfp4.model, refs, windows, seconds, size, simulated=False))
    gptq = GPTQSolveOptions(bits=4, group_size=128, sym=True)
    # 4 bits per value + an fp16 scale per 128 values (zeros are implied by sym)
    int4_bits = 4 + 16 / 128
    if on_path is not None:
        on_path("int4 rtn g128 (weights, simulated)")
    start = time.perf_counter()
    rtn = _rtn_weights(reference, gptq)
    seconds = time.perf_counter() - start
    size = _size(rtn, packed_linear_bits=int4_bits)
    rows.append(
        _row(
            "int4 rtn g128 (weights, simulated)", rtn, refs, windows, seconds, size, simulated=True
        )
    )
    gptq_paths = (("int4 gptq g128 (GPTQLinear, W4A16)", None, 1), *W4A_PATHS)
    for name, activation, divisor in gptq_paths:
        used = samples[: max(1, len(samples) // divisor)]
        if len(used) < len(samples):
            name = f"{name} ({len(used)} calib.)"
        if on_path is not None:
            on_path(name)
        config = GPTQConfig(bits=4, group_size=128, activation=activation)
        start = time.perf_counter()
        gptq_model = load(copy.deepcopy(reference), quantize_config=config, device="cpu")
        gptq_model.quantize(used, batch_size=8, progress=False)
        seconds = time.perf_counter() - start
        size = _size(gptq_model.model)
        rows.append(_row(name, gptq_model.model, refs, windows, seconds, size, simulated=False))
    return DemoReport(
        tuple(rows), int(windows.shape[0]), int(windows.shape[0] * (windows.shape[1] - 1))
    )


def plot_demo(report: DemoReport, path: str) -> None:
    """Save a two-panel PNG (KL divergence and perplexity per path) to ``path``.

    Numerics: none (drawing).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = report.rows
    names = [r.path for r in rows]
    fig, axes = plt.subplots(1, 2, figsize=(13, 0.45 * len(rows) + 1.8))
    palette = {"reference": "#888888", "gptq W4A": "#8e44ad", "nvfp4": "#d9822b", "int4": "#3aa655"}
    colors = [next((c for k, c in palette.items() if k in n), "#2b7bd9") for n in names]
    axes[0].barh(names, [r.kl_divergence for r in rows], color=colors)
    axes[0].set_xlabel("KL(reference ‖ quantized), nats per token (lower is better)")
    axes[0].invert_yaxis()
    axes[1].barh(names, [r.perplexity for r in rows], color=colors)
    axes[1].set_xlabel("held-out perplexity (lower is better)")
    axes[1].invert_yaxis()
    axes[1].set_yticklabels([])
    base = rows[0].perplexity
    axes[1].axvline(base, color="#444444", linestyle="--", linewidth=1)
    axes[1].set_xlim(base * 0.98, max(r.perplexity for r in rows) * 1.01)
    fig.suptitle(
        f"floatxq demo: tiny Llama, {report.tokens} held-out byte tokens\n(blue: FP8 modules, "
        f"orange: NVFP4 weight QDQ, green: INT4 W4A16, purple: INT4 with FP8/NVFP4 activations)"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
