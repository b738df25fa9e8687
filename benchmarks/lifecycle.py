"""Seconds to FP8-quantize and save a random 1B-parameter Llama-shaped model.

Run: python benchmarks/lifecycle.py [--device cuda] [--layers 16] [--out /tmp/fp8-1b]

The model has Llama-3.2-1B's shapes (hidden 2048, MLP 8192, 32 heads / 8 KV heads, vocab 128256,
16 layers, untied lm_head; 1.50B parameters) with random bf16 weights: quantization cost does
not depend on what the weights have learned. The anchor measured in the same run is a plain
bf16 save of the same model (its safetensors write), so the ratio says what FP8 adds on top of
writing the bytes.
"""

import argparse
import datetime
import shutil
import tempfile
import time

import torch
import transformers
from safetensors.torch import save_file

import floatxq as fq


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--method", default="row", choices=["tensor", "row", "block"])
    parser.add_argument("--out", default=None)
    parser.add_argument(
        "--layout", default="compressed-tensors", choices=["compressed-tensors", "hf", "gptqmodel"]
    )
    args = parser.parse_args()
    device = torch.device(args.device)
    config = transformers.LlamaConfig(
        hidden_size=2048, intermediate_size=8192, num_attention_heads=32, num_key_value_heads=8,
        num_hidden_layers=args.layers, vocab_size=128256, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    with torch.device(device):
        model = transformers.LlamaForCausalLM(config).to(torch.bfloat16).eval()
    params = sum(p.numel() for p in model.parameters())
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    root = args.out or tempfile.mkdtemp(prefix="floatxq-bench-")
    print(
        f"# FP8 lifecycle  {datetime.date.today()}  {name}  torch {torch.__version__}  "
        f"transformers {transformers.__version__}  {params / 1e9:.3f}B params  {args.method}"
    )

    start = time.perf_counter()
    state = {k: v.detach().cpu().contiguous() for k, v in model.state_dict().items()}
    save_file(state, f"{root}/bf16.safetensors", metadata={"format": "pt"})
    bf16_save = time.perf_counter() - start
    del state

    block = (128, 128) if args.method == "block" else None
    qconfig = fq.FP8Config(weight_scale_method=args.method, weight_block_size=block)
    q = fq.load(model, quantize_config=qconfig, device=device)
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    q.quantize(progress=False)
    if device.type == "cuda":
        torch.cuda.synchronize()
    quantize_s = time.perf_counter() - start
    start = time.perf_counter()
    q.save(f"{root}/fp8", layout=args.layout)
    save_s = time.perf_counter() - start
    print(f"bf16 safetensors save (anchor): {bf16_save:8.2f} s")
    print(f"fp8 quantize ({len(q.quantized_modules)} modules): {quantize_s:8.2f} s")
    print(f"fp8 save ({args.layout}, atomic, shards+configs): {save_s:8.2f} s")
    print(
        f"quantize + save: {quantize_s + save_s:8.2f} s = "
        f"{(quantize_s + save_s) / bf16_save:.2f}x the bf16 save"
    )
    if args.out is None:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
