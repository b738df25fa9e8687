"""NVFP4 activation quantize-dequantize at a fixed global scale, with no host read.

:func:`nvfp4_activation_qdq` is what a W4A4 ``TorchFP4Linear`` does to its input: every block of
16 values along K is quantized to E2M1 codes under an E4M3 block scale (the ``nvidia`` recipe:
``max|block| / (6·g)``) at the module's fixed global scale ``g`` and decoded back in ``x``'s
dtype. Its routes give the bytes of :func:`floatxq.nvfp4_block_qdq` (``recipe="nvidia"``):

* ``triton``: :func:`floatxq.kernels.nvfp4.nvfp4_pack_and_swizzle` then
  :func:`floatxq.kernels.nvfp4_decoding.nvfp4_decode` (two launches, ``K % 128 == 0``, CUDA SM 8.9+
  or ``TRITON_INTERPRET=1``);
* on CUDA otherwise: the pure scale search in torch without its host checks;
* elsewhere: :func:`floatxq.nvfp4_block_qdq` itself (checked: non-finite input raises).

Which route runs is :func:`floatxq.dispatch.fp4_w4a4_route`'s choice.
"""

import math

import torch

from floatxq._typing import Float, Tensor
from floatxq.formats import NVFP4_BLOCK
from floatxq.kernels.nvfp4 import nvfp4_pack_and_swizzle
from floatxq.kernels.nvfp4_decoding import nvfp4_decode
from floatxq.nvfp4.quantize import _decoded, _saturated, _search, nvfp4_block_qdq

__all__ = ["nvfp4_activation_qdq"]

_RECIPE = "nvidia"


def nvfp4_activation_qdq(
    x: Float[Tensor, "*lead k"], global_scale: Float[Tensor, ""], *, triton: bool
) -> Float[Tensor, "*lead k"]:
    """``x`` quantized to NVFP4 (``nvidia`` recipe) at ``global_scale`` and decoded in ``x.dtype``.

    Args:
      x: ``(*lead, K)`` float16/bfloat16/float32, ``K % 16 == 0`` (``K % 128 == 0`` for
        ``triton``).
      global_scale: a 0-d FP32 tensor on ``x``'s device, positive and finite (the caller's
        checked buffer: on CUDA it is not read on the host).
      triton: run the Triton packer and decoder (the caller checked they can run).

    Raises:
      ValueError: off CUDA, as :func:`floatxq.nvfp4_block_qdq` (non-finite ``x``, a bad scale).
      TypeError, ValueError, RuntimeError: with ``triton``, as the two kernels.

    Numerics: bit for bit :func:`floatxq.nvfp4_block_qdq` ``(x, global_scale, "nvidia")`` on
    finite input, zeros' signs included (the decoded value takes ``x``'s sign). On CUDA nothing
    is checked on the device: a block holding NaN or infinity decodes to NaN. Serving engines
    use the same grid but round in another order: compressed-tensors' fake quantization computes
    the block scale as ``(max/6)·(1/g)`` with ``max/6`` in ``x``'s dtype, lets an underflowing
    E4M3 scale become 0.125, and decodes ``code·(scale·(1/g))``; vLLM's kernel multiplies by
    reciprocals (``x·(1/(scale·g))``) and applies both global scales after the FP4 product. A
    block then rarely lands on a neighbouring E4M3 or E2M1 value, and a decoded value whose
    exact product is a tie of ``x.dtype``'s grid can round the other way.

    Example:
      >>> nvfp4_activation_qdq(torch.tensor([[1.0] * 15 + [6.0]]), torch.tensor(1.0),
      ...                      triton=False)[0, -2:].tolist()
      [1.0, 6.0]
    """
    if triton:
        k = x.shape[-1]
        flat = x.reshape(-1, k)
        codes, scales = nvfp4_pack_and_swizzle(flat, global_scale, recipe=_RECIPE)
        decoded = nvfp4_decode(codes, scales, global_scale.reshape(1), k, x.dtype)
        return decoded.copysign(flat).reshape(x.shape)  # -0.0 in, -0.0 out (as the reference)
    if x.device.type != "cuda" or math.prod(x.shape) == 0:
        return nvfp4_block_qdq(x, global_scale, _RECIPE)
    blocks = x.reshape(-1, NVFP4_BLOCK).to(torch.float32)
    g = global_scale.to(torch.float32).reshape(())
    decoded = _decoded(blocks, _search(blocks, g, _RECIPE), g).reshape(x.shape)
    return _saturated(decoded, x.dtype, where="nvfp4_activation_qdq")
