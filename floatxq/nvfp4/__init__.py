"""NVFP4 as pure functions: E2M1 codes, E4M3 block-16 scales, an FP32 global scale.

- :mod:`~floatxq.nvfp4.e2m1`: the 4-bit element codec and nibble packing;
- :mod:`~floatxq.nvfp4.quantize`: the global scale, the block-scale recipes, quantize / dequantize;
- :mod:`~floatxq.nvfp4.swizzle`: the tensor-core layout of block scales;
- :mod:`~floatxq.nvfp4.operand`: activations packed as a tensor-core operand;
- :mod:`~floatxq.nvfp4.layouts`: weights as each producer stores them;
- :mod:`~floatxq.nvfp4.headroom`: percentile calibration of an activation's global scale;
- :mod:`~floatxq.nvfp4.report`: how close each recipe gets to the optimum.
"""

from floatxq.nvfp4.e2m1 import e2m1_decode, e2m1_encode, e2m1_round, pack_e2m1, unpack_e2m1
from floatxq.nvfp4.quantize import (
    NVFP4Blocks,
    NVFP4Packed,
    nvfp4_block_qdq,
    nvfp4_block_scales,
    nvfp4_block_sse,
    nvfp4_dequantize,
    nvfp4_dynamic_global_scale,
    nvfp4_global_scale,
    nvfp4_quantize,
)
from floatxq.nvfp4.swizzle import (
    swizzle_scales,
    swizzle_scales_per_group,
    unswizzle_scales,
    unswizzle_scales_per_group,
)

__all__ = [
    "NVFP4Blocks",
    "NVFP4Packed",
    "e2m1_decode",
    "e2m1_encode",
    "e2m1_round",
    "nvfp4_block_qdq",
    "nvfp4_block_scales",
    "nvfp4_block_sse",
    "nvfp4_dequantize",
    "nvfp4_dynamic_global_scale",
    "nvfp4_global_scale",
    "nvfp4_quantize",
    "pack_e2m1",
    "swizzle_scales",
    "swizzle_scales_per_group",
    "unpack_e2m1",
    "unswizzle_scales",
    "unswizzle_scales_per_group",
]
