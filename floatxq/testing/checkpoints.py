"""Random Llama checkpoints on disk, for tests and benchmarks that read a model from its shards.

Needs transformers (the model class and ``save_pretrained``).
"""

import os

import torch

__all__ = ["write_random_llama"]


def write_random_llama(
    path: str | os.PathLike[str], config: object, *, seed: int = 0, max_shard_size: str = "100MB"
) -> dict[str, int]:
    """Write a random bf16 ``LlamaForCausalLM`` of ``config`` to ``path`` with
    ``save_pretrained``; return its bytes: ``embeddings``, ``lm_head``, one ``layer``, ``total``.

    The model is built on the meta device and given CPU storage (no initialisation pass), every
    weight drawn N(0, 0.02²) from a generator seeded with ``seed``, every norm weight 1.

    Numerics: bf16 ``normal_`` draws; the bytes are those ``save_pretrained`` writes.
    """
    import transformers

    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config)
    model = model.to(torch.bfloat16).to_empty(device="cpu")
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            else:
                param.normal_(0.0, 0.02, generator=gen)
    sizes = {
        "embeddings": model.model.embed_tokens.weight.nbytes,
        "lm_head": model.lm_head.weight.nbytes,
        "layer": sum(p.nbytes for p in model.model.layers[0].parameters()),
        "total": sum(p.nbytes for p in model.parameters()),
    }
    model.save_pretrained(path, max_shard_size=max_shard_size)
    return sizes
