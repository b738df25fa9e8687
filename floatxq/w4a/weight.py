"""The W4A weight operand: which GPTQ weights the W4A GEMMs take, and the native NVFP4 staging.

Pure functions over GPTQ-packed tensors (:mod:`floatxq.gptq.int4`): no modules, no kernels.
"""

from typing import NamedTuple

import torch

from floatxq._typing import Float8e4m3fn, Integer, Shaped, Tensor, checked_record
from floatxq.formats import K_GROUP
from floatxq.gptq.int4 import GPTQPacked, unpack_gptq
from floatxq.gptq.planes import int4_planes_to_e2m1, split_int4_planes
from floatxq.nvfp4.swizzle import swizzle_scales

__all__ = ["W4ANVFP4WeightPlanes", "w4a_nvfp4_weight_planes", "w4a_weight_ineligibility"]

W4A_COLUMNS = 32
"""``out_features`` multiple of the W4A GEMMs (GPT-QModel's constraint: their column tiles)."""
# a symmetric 4-bit zero word, every field 8: v1 stores zero - 1 (0x77777777), v2 the zero
# (0x88888888, held as the int32 with those bits)
_SYM_WORD = {"gptq": 0x77777777, "gptq_v2": 0x88888888 - (1 << 32)}


def w4a_weight_ineligibility(
    packed: GPTQPacked, *, bits: int, group_size: int, format: str, gemm: str
) -> str | None:
    """Why a GPTQ weight cannot run on the ``gemm`` W4A GEMM, or ``None`` when it can.

    Checked in this order (the first failure is named): 4-bit codes, groups of 128, ``in`` a
    multiple of 128, ``out`` a multiple of 32, ``g_idx == arange(in) // 128`` (no ``desc_act``
    reordering), every zero point 8 (symmetric).

    Args:
      packed: the weight's GPTQ tensors (holding data, not on ``meta``).
      bits, group_size, format: its GPTQ settings.
      gemm: the GEMM's name in the sentence.

    Returns:
      ``None``, or one sentence naming the value that disqualifies the weight.

    Numerics: exact comparisons of the stored words.

    Example:
      >>> from floatxq.gptq.int4 import pack_gptq
      >>> z = torch.full((1, 32), 8)
      >>> p = pack_gptq(torch.zeros(128, 32, dtype=torch.int64), z, torch.ones(1, 32),
      ...     torch.zeros(128, dtype=torch.int32), bits=4)
      >>> w4a_weight_ineligibility(p, bits=4, group_size=128, format="gptq", gemm="W4A-FP8")
    """
    if bits != 4:
        return f"bits={bits}; {gemm} takes 4-bit codes"
    if group_size != K_GROUP:
        return f"group_size={group_size}; {gemm} takes groups of {K_GROUP}"
    k, n = packed.qweight.shape[0] * (32 // bits), packed.qweight.shape[1]
    if k % K_GROUP:
        return f"in_features={k} is not a multiple of {K_GROUP}"
    if n % W4A_COLUMNS:
        return f"out_features={n} is not a multiple of {W4A_COLUMNS}"
    g_idx = packed.g_idx.to(torch.int64)
    if not torch.equal(g_idx, torch.arange(k, device=g_idx.device) // K_GROUP):
        return (
            f"g_idx is not arange(in) // {K_GROUP} (a desc_act / reordered checkpoint, starting "
            f"{packed.g_idx[:4].tolist()}); {gemm} takes contiguous groups (desc_act=False)"
        )
    if bool((packed.qzeros != _SYM_WORD[format]).any()):
        zeros = unpack_gptq(packed, bits=bits, format=format).zeros
        group, column = (int(i) for i in (zeros != 8).nonzero()[0])
        return (
            f"asymmetric zero points: group {group}, output column {column} has zero point "
            f"{int(zeros[group, column])}; {gemm} takes symmetric weights (zero point 8)"
        )
    return None


@checked_record
class W4ANVFP4WeightPlanes(NamedTuple):
    """The INT4 weight as the FP4 tensor cores read it: two E2M1 planes side by side."""

    both: Shaped[Tensor, "half_k two_n"]
    """``float4_e2m1fn_x2 (k/2, 2n)`` (byte view ``(k/2, 2n)``): columns ``0..n-1`` the low
    plane, ``n..2n-1`` the high plane, two codes per byte along K (even K in the low nibble),
    stored column-major (strides ``(1, k/2)``: each output column's K run contiguous)."""
    unit_scales: Float8e4m3fn[Tensor, " padded"]
    """``float8_e4m3fn``: the E4M3 block scales 1.0 of a ``(2n, 8)`` 128-row group, laid out
    ``SWIZZLE_32_4_4`` (rows padded to 128 with 0) and flattened; every group shares them."""


def w4a_nvfp4_weight_planes(c: Integer[Tensor, "k n"]) -> W4ANVFP4WeightPlanes:
    """Stage centered INT4 values ``c = code - 8`` as the native W4A-NVFP4 weight operand.

    ``c = low + 4·high`` (:func:`floatxq.split_int4_planes`), both planes exact E2M1 values
    (:func:`floatxq.int4_planes_to_e2m1`), so one FP4 GEMM of the activation by ``[low |
    high]`` with unit block scales gives both partial sums exactly as products.

    Args:
      c: ``(k, n)`` integers in ``-8..7``, ``k`` a positive multiple of 128.

    Returns:
      :class:`W4ANVFP4WeightPlanes` on ``c``'s device.

    Raises:
      ValueError: ``k`` not a positive multiple of 128, a value outside ``-8..7``.
      TypeError: a non-integer ``c``.

    Numerics: exact (a permutation of exact codes; the unit scale 1.0 is E4M3 ``0x38``).

    Example:
      >>> p = w4a_nvfp4_weight_planes(torch.full((128, 32), 7, dtype=torch.int16))
      >>> p.both.shape, p.both.stride(), p.unit_scales.shape
      (torch.Size([64, 64]), (1, 64), torch.Size([1024]))
    """
    where = "w4a_nvfp4_weight_planes"
    if c.ndim != 2 or c.shape[0] == 0 or c.shape[0] % K_GROUP:
        raise ValueError(
            f"{where}: c must be (k, n) with k a positive multiple of {K_GROUP}, got "
            f"{tuple(c.shape)}"
        )
    planes = split_int4_planes(c)
    packed = int4_planes_to_e2m1(planes.low, planes.high)
    both = torch.cat([packed.low, packed.high], dim=1)  # (k/2, 2n) uint8
    both = both.T.contiguous().T.view(torch.float4_e2m1fn_x2)  # column-major: strides (1, k/2)
    ones = torch.ones((2 * c.shape[1], K_GROUP // 16), dtype=torch.float8_e4m3fn, device=c.device)
    return W4ANVFP4WeightPlanes(both, swizzle_scales(ones))
