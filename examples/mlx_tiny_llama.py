"""Run FP8 checkpoints of the tiny Llama with MLX: quantize, save, load with MLX, generate.

Run: python examples/mlx_tiny_llama.py   (needs ``pip install 'floatxq[mlx]'``)

Two checkpoints: row scales (every linear moves to MLX's native ``mxfp8`` matmul) and 128×128
block scales (every linear stays on FP8 bytes in ``MlxFP8PackedLinear``; Metal kernels on an
Apple GPU). Each is generated from greedily with the same prompt by torch and by MLX (with
mlx_lm's KV cache); the script prints the routes, the largest logit difference on the prompt
and both continuations.
"""

import tempfile
from collections import Counter
from pathlib import Path

import mlx.core as mx
import torch
from mlx_lm.models.cache import make_prompt_cache

import floatxq as fq
from floatxq.tiny import decode_tokens, encode_text, load_tiny_llama

PROMPT = "Return the number of "
NEW_TOKENS = 48


def torch_greedy(model: torch.nn.Module, ids: torch.Tensor) -> tuple[torch.Tensor, list[int]]:
    """Prompt logits and ``NEW_TOKENS`` greedy tokens from the torch model."""
    with torch.no_grad():
        logits = model(ids[None]).logits[0]
        out = model.generate(ids[None], max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0)
    return logits, out[0, len(ids) :].tolist()


def mlx_greedy(model, ids: torch.Tensor) -> tuple[mx.array, list[int]]:
    """Prompt logits and ``NEW_TOKENS`` greedy tokens from the mlx_lm model, one step at a time."""
    cache = make_prompt_cache(model)
    logits = model(mx.array(ids.tolist())[None], cache=cache)[0]
    prompt_logits, tokens = logits, []
    for _ in range(NEW_TOKENS):
        token = int(mx.argmax(logits[-1]).item())
        tokens.append(token)
        logits = model(mx.array([[token]]), cache=cache)[0]
    return prompt_logits, tokens


def main() -> None:
    ids = encode_text(PROMPT)
    configs = {
        "row scales": fq.FP8Config(weight_scale_method="row"),
        "128x128 blocks": fq.FP8Config(weight_scale_method="block", weight_block_size=[128, 128]),
    }
    with tempfile.TemporaryDirectory() as tmp:
        for name, config in configs.items():
            quantized = fq.load(load_tiny_llama(dtype=torch.float32), quantize_config=config)
            quantized.quantize(progress=False)
            path = quantized.save(Path(tmp) / name.replace(" ", "-"))
            on_mlx = fq.load(path, backend="mlx")
            routes = dict(sorted(Counter(on_mlx.mlx_routes.values()).items()))

            torch_logits, torch_tokens = torch_greedy(quantized.model, ids)
            mlx_logits, mlx_tokens = mlx_greedy(on_mlx.model, ids)
            gap = (torch.tensor(mlx_logits.tolist()) - torch_logits).abs().max().item()
            agree = next(
                (
                    i
                    for i, (a, b) in enumerate(zip(torch_tokens, mlx_tokens, strict=True))
                    if a != b
                ),
                NEW_TOKENS,
            )
            print(f"{name}: routes {routes}")
            print(f"  largest prompt-logit gap torch vs MLX: {gap:.2e}")
            print(f"  greedy tokens agree: {agree}/{NEW_TOKENS}")
            print(f"  torch: {PROMPT}{decode_tokens(torch.tensor(torch_tokens))!r}")
            print(f"  mlx:   {PROMPT}{decode_tokens(torch.tensor(mlx_tokens))!r}")


if __name__ == "__main__":
    main()
