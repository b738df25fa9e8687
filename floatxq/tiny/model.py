"""The embedded default model: a small trained byte-level Llama and its perplexity.

Quantization quality is meaningless on random weights, so floatxq ships a ~6.4M-parameter
``LlamaForCausalLM`` trained on the standard-library corpus (:mod:`floatxq.tiny.corpus`) by
``examples/train_tiny_llama.py``; its bfloat16 weights live in :data:`TINY_LLAMA_DIR`. Every
Linear has in/out features that are multiples of 128, so FP8 128×128 blocks and GPTQ group 128
apply to all of them, and ``lm_head`` is a separate (untied) Linear as in real Llamas.
"""

import math
import os
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.utils import logging as hf_logging

from floatxq._typing import Integer, Tensor
from floatxq.tiny.corpus import SEPARATOR_ID, VOCAB_SIZE

__all__ = [
    "TINY_LLAMA_DIR",
    "TINY_LLAMA_TRAIN_COMMAND",
    "load_tiny_llama",
    "perplexity",
    "tiny_llama_config",
]

TINY_LLAMA_DIR: Path = Path(__file__).resolve().with_name("tiny_llama")
"""Where the trained weights ship: ``config.json`` + ``model.safetensors`` (bfloat16)."""
TINY_LLAMA_TRAIN_COMMAND: str = "python3 examples/train_tiny_llama.py --out floatxq/tiny/tiny_llama"
"""The command (from the repository root) that trains and writes :data:`TINY_LLAMA_DIR`."""


def tiny_llama_config() -> LlamaConfig:
    """The tiny Llama's architecture: 8 layers, hidden 256, 4 heads of 64, 2 KV heads, MLP 768.

    Byte vocabulary (256 ids; byte 0 is BOS/EOS), 512 positions, RoPE θ = 10 000, untied
    ``lm_head``. Linear shapes (out × in): q/o 256×256, k/v 128×256, gate/up 768×256,
    down 256×768, lm_head 256×256: every feature count is a multiple of 128. About 6.4M
    parameters (12.8 MB in bfloat16).

    Numerics: RMSNorm ε = 1e-5; weights initialised N(0, 0.02²) by transformers when built.

    Example:
      >>> cfg = tiny_llama_config()
      >>> cfg.hidden_size, cfg.num_hidden_layers, cfg.vocab_size
      (256, 8, 256)
    """
    return LlamaConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=256,
        intermediate_size=768,
        num_hidden_layers=8,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        hidden_act="silu",
        max_position_embeddings=512,
        initializer_range=0.02,
        rms_norm_eps=1e-5,
        bos_token_id=SEPARATOR_ID,
        eos_token_id=SEPARATOR_ID,
        pad_token_id=None,
        tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        attention_bias=False,
        mlp_bias=False,
    )


def load_tiny_llama(
    path: str | os.PathLike = TINY_LLAMA_DIR,
    *,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
) -> LlamaForCausalLM:
    """Load the trained tiny Llama (or any saved ``LlamaForCausalLM`` directory) in eval mode.

    Args:
      path: a directory holding ``config.json`` and ``model.safetensors``.
      dtype: parameter dtype after loading (the shipped weights are bfloat16).
      device: where to put the model.

    Returns:
      A ``LlamaForCausalLM`` in eval mode on ``device`` with ``dtype`` parameters.

    Raises:
      FileNotFoundError: ``path`` lacks the files; the message names the command that makes them.

    Numerics: bfloat16 → float32 is exact; to a narrower dtype, one nearest-even rounding.

    Example:
      >>> model = load_tiny_llama()  # doctest: +SKIP
      >>> model.lm_head.weight.shape  # doctest: +SKIP
      torch.Size([256, 256])
    """
    directory = Path(path)
    missing = [n for n in ("config.json", "model.safetensors") if not (directory / n).is_file()]
    if missing:
        raise FileNotFoundError(
            f"load_tiny_llama: {', '.join(missing)} not found in {str(directory)!r}; train and "
            f"write the tiny Llama with `{TINY_LLAMA_TRAIN_COMMAND}` from the repository root "
            f"(or pass path= a directory saved by examples/train_tiny_llama.py --out DIR)"
        )
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # a 6M-parameter load needs no progress bar
    try:
        model = LlamaForCausalLM.from_pretrained(directory, dtype=dtype, local_files_only=True)
    finally:
        if bars:
            hf_logging.enable_progress_bar()
    return model.to(device).eval()


def perplexity(
    model: torch.nn.Module,
    windows: Integer[Tensor, "windows length"],
    *,
    batch_size: int = 16,
) -> float:
    """Perplexity of a causal LM on token windows: ``exp(mean next-token NLL)``.

    Every position but the first of each window is predicted from the tokens before it (within
    the window); all ``windows × (length − 1)`` predictions weigh equally. Runs under
    ``torch.inference_mode`` on the model's device; the model's train/eval mode is left as is.

    Args:
      model: a causal LM whose forward takes ``input_ids`` and returns ``.logits``.
      windows: ``(windows, length)`` token ids, ``length ≥ 2``.
      batch_size: windows per forward pass (≥ 1).

    Returns:
      The perplexity as a Python float.

    Raises:
      ValueError: no windows, ``length < 2``, ``batch_size < 1``.

    Numerics: log-softmax of FP32-cast logits; NLL summed in FP64 across batches, exp at the end.

    Example:
      >>> from transformers import LlamaForCausalLM
      >>> _ = torch.manual_seed(0)
      >>> model = LlamaForCausalLM(tiny_llama_config()).eval()
      >>> ppl = perplexity(model, torch.randint(0, 256, (2, 16)))
      >>> 200 < ppl < 400  # untrained: about the vocabulary size
      True
    """
    where = "perplexity"
    if windows.ndim != 2 or windows.shape[0] < 1 or windows.shape[1] < 2:
        raise ValueError(
            f"{where}: windows must be (windows ≥ 1, length ≥ 2) ids, got {tuple(windows.shape)}"
        )
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"{where}: batch_size must be an int ≥ 1, got {batch_size!r}")
    device = next(model.parameters()).device
    total = 0.0
    count = 0
    with torch.inference_mode():
        for start in range(0, windows.shape[0], batch_size):
            ids = windows[start : start + batch_size].to(device=device, dtype=torch.long)
            logits = model(input_ids=ids, use_cache=False).logits[:, :-1].float()
            nll = F.cross_entropy(
                logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1), reduction="sum"
            )
            total += float(nll.double())
            count += ids[:, 1:].numel()
    return math.exp(total / count)
