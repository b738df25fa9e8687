"""Quantize one linear layer's weight to FP8 with each scale layout and compare its outputs.

Run: python examples/fp8_weight.py
"""

import torch

import floatxq as fq

torch.manual_seed(0)
linear = torch.nn.Linear(1024, 512, bias=False)
x = torch.randn(16, 1024)
reference = linear(x)

for method, block in [("tensor", None), ("row", None), ("block", [128, 128])]:
    q = fq.quantize_fp8_weight(
        linear.weight.detach(), format="e4m3", weight_scale_method=method, weight_block_size=block
    )
    # the transposed decode gives the (in, out) matrix that multiplies flattened inputs
    w_t = fq.dequantize_fp8_weight_transposed(q.qweight, q.scale_inv)
    out = x @ w_t
    rel = ((out - reference).pow(2).mean() / reference.pow(2).mean()).item()
    print(f"{method:<6} scale_inv {tuple(q.scale_inv.shape)!s:<10} output rel. MSE {rel:.2e}")

# Per-token activations: one direct scale per row, decode multiplies.
tokens = fq.fp8_token_quantize(x)
x_hat = fq.fp8_token_dequantize(tokens.codes, tokens.scale)
print("tokens: rel. MSE", ((x_hat - x).pow(2).mean() / x.pow(2).mean()).item())
