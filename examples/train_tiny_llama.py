"""Train floatxq's embedded tiny Llama on the standard-library corpus and save it in bfloat16.

The model is ``floatxq.tiny.tiny_llama_config()`` (~6.4M parameters, byte vocabulary); it sees
only the train split. Validation perplexity (every ``--val-every`` steps) uses the calibration
split, and the weights of the best validation step are the ones saved (early stopping; turn it off
with ``--no-keep-best``). The final perplexity uses the evaluation split, which nothing else
touches, measured on the bfloat16-rounded weights, i.e. exactly what ``load_tiny_llama()`` returns.

Run from the repository root:
  python3 examples/train_tiny_llama.py                    # CUDA when present: the shipped weights
  python3 examples/train_tiny_llama.py --smoke --out /tmp/tiny   # 3 CPU steps, a few seconds

It writes ``config.json``, ``generation_config.json``, ``model.safetensors`` and ``training.json``
(arguments, timings, perplexities, corpus statistics) into a temporary directory next to ``--out``
and renames it into place, so an interrupted run never leaves half a model behind.
"""

import argparse
import contextlib
import json
import math
import os
import platform
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch
import torch.nn.functional as F
import transformers
from transformers import LlamaForCausalLM
from transformers.utils import logging as hf_logging

from floatxq.tiny.corpus import (
    SPLITS,
    VOCAB_SIZE,
    stdlib_corpus,
    stdlib_documents,
    stdlib_tokens,
    token_windows,
)
from floatxq.tiny.model import TINY_LLAMA_DIR, load_tiny_llama, perplexity, tiny_llama_config


class TrainResult(NamedTuple):
    """What one training run produced."""

    perplexity: float
    """Evaluation-split perplexity of the saved (bfloat16) weights."""
    parameters: int
    steps: int
    seconds: float
    """Wall time of the optimisation steps and validations (not the final save/evaluation)."""
    device: str
    out: Path


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=TINY_LLAMA_DIR, help="output directory")
    parser.add_argument("--steps", type=int, default=3000)
    parser.add_argument("--batch-size", type=int, default=64, help="windows per step")
    parser.add_argument("--seq-len", type=int, default=256, help="tokens per window")
    parser.add_argument("--lr", type=float, default=2e-3, help="peak AdamW learning rate")
    parser.add_argument("--min-lr-ratio", type=float, default=0.1, help="cosine floor / peak")
    parser.add_argument("--warmup", type=int, default=200, help="linear warmup steps")
    parser.add_argument("--weight-decay", type=float, default=0.1, help="on matrices only")
    parser.add_argument("--grad-clip", type=float, default=1.0, help="max global grad norm")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="auto", help="auto (CUDA if present), cpu, cuda:N")
    parser.add_argument("--val-every", type=int, default=250, help="0: no validation")
    parser.add_argument("--val-windows", type=int, default=256, help="calibration windows")
    parser.add_argument(
        "--keep-best",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="save the weights of the best validation step rather than the last",
    )
    parser.add_argument(
        "--eval-windows", type=int, default=None, help="evaluation windows (default: all)"
    )
    parser.add_argument("--log-every", type=int, default=100)
    parser.add_argument("--compile", action="store_true", help="torch.compile the training step")
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="3 steps of 2 windows, 4 evaluation windows: checks the pipeline in seconds",
    )
    args = parser.parse_args(argv)
    if args.smoke:
        args.steps, args.batch_size, args.warmup = 3, 2, 1
        args.val_every, args.eval_windows, args.log_every = 0, 4, 1
    for name in ("steps", "batch_size", "log_every", "val_windows"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be ≥ 1, got {getattr(args, name)}")
    for name in ("val_every", "warmup"):
        if getattr(args, name) < 0:
            parser.error(f"--{name.replace('_', '-')} must be ≥ 0, got {getattr(args, name)}")
    if not 2 <= args.seq_len <= tiny_llama_config().max_position_embeddings:
        parser.error(f"--seq-len must lie in 2..512, got {args.seq_len}")
    return args


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)  # seeds CUDA too


def learning_rate(step: int, *, steps: int, warmup: int, peak: float, floor_ratio: float) -> float:
    """Linear warmup to ``peak`` over ``warmup`` steps, then cosine down to ``floor_ratio*peak``."""
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return peak * (floor_ratio + (1 - floor_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def sample_batch(
    tokens: torch.Tensor, *, batch_size: int, seq_len: int, generator: torch.Generator
) -> torch.Tensor:
    """``(batch_size, seq_len + 1)`` windows at uniform random offsets of the token stream."""
    offsets = torch.randint(0, tokens.numel() - seq_len, (batch_size,), generator=generator)
    index = offsets[:, None] + torch.arange(seq_len + 1)
    return tokens[index.to(tokens.device)]


def build_optimizer(
    model: torch.nn.Module, *, lr: float, weight_decay: float, fused: bool
) -> torch.optim.AdamW:
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]  # RMSNorm gains
    groups = [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95), eps=1e-8, fused=fused)


def save_atomically(model: LlamaForCausalLM, out: Path, *, record: dict) -> None:
    """Write the model and ``training.json`` into a sibling temporary directory, then rename."""
    out = out.resolve()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}-tmp-", dir=out.parent))
    old = out.with_name(f".{out.name}-old-{os.getpid()}")
    try:
        model.save_pretrained(tmp)
        (tmp / "training.json").write_text(json.dumps(record, indent=2, sort_keys=True) + "\n")
        for file in tmp.iterdir():
            file.chmod(0o644)
        tmp.chmod(0o755)
        if out.exists():
            os.rename(out, old)
        os.rename(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        if old.exists() and not out.exists():
            os.rename(old, out)
        raise
    shutil.rmtree(old, ignore_errors=True)


def _device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def _device_label(device: torch.device) -> str:
    if device.type == "cuda":
        return f"{device} ({torch.cuda.get_device_name(device)})"
    return f"cpu ({torch.get_num_threads()} threads)"


def main(argv: list[str] | None = None) -> TrainResult:
    args = parse_args(argv)
    hf_logging.disable_progress_bar()
    device = _device(args.device)
    seed_everything(args.seed)
    on_cuda = device.type == "cuda"
    if on_cuda:
        torch.set_float32_matmul_precision("high")  # TF32 for the FP32 validation passes

    started = time.perf_counter()
    train_tokens = stdlib_tokens("train").to(device)
    val_windows = token_windows("calibration", seq_len=args.seq_len, max_windows=args.val_windows)
    eval_windows = token_windows("evaluation", seq_len=args.seq_len, max_windows=args.eval_windows)
    corpus = {
        split: {"documents": len(stdlib_documents(split)), "bytes": len(stdlib_corpus(split))}
        for split in SPLITS
    }
    print(f"corpus ({time.perf_counter() - started:.1f} s): {corpus}", flush=True)

    config = tiny_llama_config()
    model = LlamaForCausalLM(config)  # initialised on the CPU: the same weights on every device
    model.to(device).train()
    parameters = sum(p.numel() for p in model.parameters())
    optimizer = build_optimizer(model, lr=args.lr, weight_decay=args.weight_decay, fused=on_cuda)
    forward = torch.compile(model) if args.compile else model
    autocast = (
        (lambda: torch.autocast(device_type="cuda", dtype=torch.bfloat16))
        if on_cuda
        else contextlib.nullcontext
    )
    generator = torch.Generator().manual_seed(args.seed)
    tokens_per_step = args.batch_size * args.seq_len
    print(
        f"model: {parameters:,} parameters; {args.steps} steps × {args.batch_size} × "
        f"{args.seq_len} tokens on {_device_label(device)}",
        flush=True,
    )

    history = []
    best = (math.inf, 0, None)  # (validation perplexity, step, CPU copy of the weights)
    running = torch.zeros((), device=device)
    window_started = time.perf_counter()
    train_started = time.perf_counter()
    for step in range(args.steps):
        lr = learning_rate(
            step, steps=args.steps, warmup=args.warmup, peak=args.lr, floor_ratio=args.min_lr_ratio
        )
        for group in optimizer.param_groups:
            group["lr"] = lr
        batch = sample_batch(
            train_tokens, batch_size=args.batch_size, seq_len=args.seq_len, generator=generator
        )
        with autocast():
            logits = forward(input_ids=batch[:, :-1], use_cache=False).logits
        loss = F.cross_entropy(logits.float().reshape(-1, VOCAB_SIZE), batch[:, 1:].reshape(-1))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
        optimizer.step()
        running += loss.detach()

        done = step + 1
        if done % args.log_every == 0 or done == args.steps:
            steps_logged = (done - 1) % args.log_every + 1
            mean_loss = float(running) / steps_logged
            elapsed = time.perf_counter() - window_started
            print(
                f"step {done:>6}/{args.steps}  loss {mean_loss:.4f}  lr {lr:.2e}  "
                f"{steps_logged * tokens_per_step / elapsed:,.0f} tok/s",
                flush=True,
            )
            running.zero_()
            window_started = time.perf_counter()
        if args.val_every and (done % args.val_every == 0 or done == args.steps):
            model.eval()
            val_ppl = perplexity(model, val_windows, batch_size=64)
            model.train()
            history.append({"step": done, "calibration_perplexity": val_ppl})
            print(f"step {done:>6}  validation (calibration split) perplexity {val_ppl:.3f}")
            if args.keep_best and val_ppl < best[0]:
                state = {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}
                best = (val_ppl, done, state)
            window_started = time.perf_counter()
    if on_cuda:
        torch.cuda.synchronize(device)
    seconds = time.perf_counter() - train_started

    selected = args.steps
    if best[2] is not None and best[1] != args.steps:
        model.load_state_dict(best[2])
        selected = best[1]
        print(f"keeping step {selected} (best validation perplexity {best[0]:.3f})")
    model.eval()
    fp32_ppl = perplexity(model, eval_windows, batch_size=64)
    with torch.no_grad():  # round the parameters once to bfloat16, as shipped (buffers such
        for p in model.parameters():  # as RoPE's inv_freq stay FP32, as they are when loaded)
            p.copy_(p.to(torch.bfloat16))
    final = perplexity(model, eval_windows, batch_size=64)
    model.to(torch.bfloat16)  # exact for the parameters: the saved file holds these values
    command = sys.argv[1:] if argv is None else argv
    record = {
        "command": " ".join(["python3", "examples/train_tiny_llama.py", *command]),
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "parameters": parameters,
        "steps": args.steps,
        "selected_step": selected,
        "tokens_seen": args.steps * tokens_per_step,
        "train_seconds": seconds,
        "device": _device_label(device),
        "versions": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "transformers": transformers.__version__,
        },
        "corpus": corpus,
        "validation": history,
        "eval_windows": int(eval_windows.shape[0]),
        "eval_perplexity": final,
        "eval_perplexity_fp32_master": fp32_ppl,
    }
    save_atomically(model, args.out, record=record)

    saved = load_tiny_llama(args.out, dtype=torch.bfloat16, device=device).state_dict()
    for name, tensor in model.state_dict().items():
        if not torch.equal(saved[name], tensor):
            raise RuntimeError(f"{args.out}: reloaded {name} differs from the trained weights")
    size_mb = (args.out.resolve() / "model.safetensors").stat().st_size / 1e6
    print(f"eval perplexity of the FP32 master weights: {fp32_ppl:.3f}")
    print(f"saved {args.out} (model.safetensors {size_mb:.1f} MB, bfloat16)")
    print(
        f"final eval perplexity: {final:.3f} ({parameters:,} params, {args.steps} steps, "
        f"{seconds:.1f} s, {_device_label(device)})",
        flush=True,
    )
    return TrainResult(final, parameters, args.steps, seconds, _device_label(device), args.out)


if __name__ == "__main__":
    main()
