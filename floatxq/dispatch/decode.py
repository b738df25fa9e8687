"""Weight-only decode routes: ``TorchFP4Linear`` (torchao, Triton, pure) and ``GPTQLinear``."""

import functools
import importlib.util

import torch

from floatxq.formats import K_GROUP, MODEL_DTYPES
from floatxq.kernels._triton import cuda_capability, triton_unavailable_reason
from floatxq.kernels.nvfp4 import nvfp4_unavailable_reason
from floatxq.kernels.w4a16 import DEFAULT_W4A16_TUNING, W4A16Route, W4A16Tuning
from floatxq.kernels.w4a_frag import DEFAULT_FRAG_TUNING, FragTuning, fragment_unavailable_reason

__all__ = [
    "FP4_DECODE_ROUTES",
    "FP4_W4A4_ROUTES",
    "GPTQ_DECODE_ROUTE",
    "fp4_decode_route",
    "fp4_w4a4_route",
    "gptq_route",
    "torchao_missing",
    "w4a16_route",
]

_HALF_DTYPES = (torch.float16, torch.bfloat16)

FP4_DECODE_ROUTES = ("dequant_matmul", "triton_decode", "torchao_nvfp4")
"""Routes of ``TorchFP4Linear``: the pure decode, the Triton decode, torchao's NVFP4Tensor."""
GPTQ_DECODE_ROUTE = "dequant_matmul"
FP4_W4A4_ROUTES = ("w4a4_dequant_matmul", "w4a4_triton")
"""Routes of a W4A4 ``TorchFP4Linear`` (one with an ``input_scale``): the activation's NVFP4
quantize-dequantize in torch or by the Triton packer and decoder, then the weight's decode."""


@functools.cache
def torchao_missing() -> str | None:
    """Why torchao cannot be used (``None`` when it is installed)."""
    if importlib.util.find_spec("torchao") is None:
        return "torchao is not installed"
    return None


def fp4_decode_route(
    device: torch.device,
    dtype: torch.dtype,
    *,
    torchao: bool = False,
    torchao_off: str | None = None,
) -> tuple[str, str | None]:
    """``(route, reason)`` of a ``TorchFP4Linear`` call's weight on ``device`` in ``dtype``.

    Args:
      device, dtype: the call's ``x``.
      torchao: whether torchao's ``NVFP4Tensor`` is a candidate (the module asks with True;
        without it the answer is the CUDA decode alone).
      torchao_off: why the module switched torchao off after it raised (``None``: it did not).

    Returns:
      With ``torchao`` on CUDA: ``("torchao_nvfp4", None)`` where torchao is installed and not
      switched off. Else, on CUDA, the decode: ``"triton_decode"`` where the kernel runs for
      ``dtype``, else ``"dequant_matmul"``; ``reason`` names each skipped route and why (``None``
      for the kernel when torchao was not asked). Off CUDA with ``torchao``:
      ``("dequant_matmul", None)``, the only route there.

    Example:
      >>> fp4_decode_route(torch.device("cuda"), torch.float64)[0]
      'dequant_matmul'
      >>> cuda = torch.device("cuda")
      >>> route, reason = fp4_decode_route(cuda, torch.float64, torchao=True, torchao_off="raised")
      >>> route, "decoded for this call" in reason, reason.endswith("not torch.float64)")
      ('dequant_matmul', True, True)
      >>> fp4_decode_route(torch.device("cpu"), torch.bfloat16, torchao=True)
      ('dequant_matmul', None)
    """
    if torchao and device.type != "cuda":
        return GPTQ_DECODE_ROUTE, None
    if dtype not in MODEL_DTYPES:
        route, why = "dequant_matmul", f"it writes float16, bfloat16 or float32, not {dtype}"
    else:
        why = triton_unavailable_reason(device)
        route = "triton_decode" if why is None else "dequant_matmul"
    if not torchao:
        return route, why
    no_torchao = torchao_missing() or torchao_off
    if no_torchao is None:
        return "torchao_nvfp4", None
    reason = f"{no_torchao}; the weight was decoded for this call"
    if why is not None:
        reason = f"{reason}, in torch: the Triton decode cannot run ({why})"
    return route, reason


def fp4_w4a4_route(device: torch.device, dtype: torch.dtype, k: int) -> tuple[str, str | None]:
    """``(route, reason)`` of a W4A4 ``TorchFP4Linear`` call (input ``x`` on ``device`` in
    ``dtype``, ``k`` columns).

    Returns:
      ``("w4a4_triton", None)`` on CUDA where the Triton NVFP4 packer and decoder run for ``x``
      (float16/bfloat16/float32, ``k % 128 == 0``, SM 8.9+): the activation is packed and decoded
      in two launches, the weight decoded by the Triton decode (on SM 10+ the reason says the
      tensor cores' native NVFP4 GEMM is not used: :data:`NATIVE_FP4_REASON`). Else
      ``"w4a4_dequant_matmul"``: the activation's quantize-dequantize in torch (the same bytes;
      on CUDA without host checks), the weight decoded by :func:`fp4_decode_route`'s decode;
      ``reason`` says why the kernels were skipped (``None`` off CUDA, where torch is the only
      route). torchao is never a candidate: its weight-only route does not quantize the
      activation.

    Example:
      >>> fp4_w4a4_route(torch.device("cpu"), torch.bfloat16, 256)
      ('w4a4_dequant_matmul', None)
      >>> fp4_w4a4_route(torch.device("cuda"), torch.bfloat16, 64)[1]
      "K=64 is not a multiple of 128 (the Triton NVFP4 packer's group); quantized in torch"
    """
    if device.type != "cuda":
        return "w4a4_dequant_matmul", None
    if dtype not in MODEL_DTYPES:
        why = f"x is {dtype}; the Triton NVFP4 packer reads float16, bfloat16 or float32"
    elif k % K_GROUP:
        why = f"K={k} is not a multiple of {K_GROUP} (the Triton NVFP4 packer's group)"
    else:
        why = nvfp4_unavailable_reason(device)
    if why is None:
        return "w4a4_triton", _native_fp4_not_taken(device)
    return "w4a4_dequant_matmul", f"{why}; quantized in torch"


NATIVE_FP4_REASON = (
    "SM {major}.{minor} has NVFP4 tensor cores, but floatxq has no native NVFP4 GEMM route "
    "yet (not verified against the reference on Blackwell hardware): emulated with the Triton "
    "packer and decode"
)
"""The reason a W4A4 call on SM 10.x/12.x gives for taking the emulation."""


def _native_fp4_not_taken(device: torch.device) -> str | None:
    """On SM 10+ (Blackwell), why the native NVFP4 GEMM was not used; else ``None``."""
    major, minor = cuda_capability(device)
    return NATIVE_FP4_REASON.format(major=major, minor=minor) if major >= 10 else None


def w4a16_route(
    rows: int,
    tuning: W4A16Tuning = DEFAULT_W4A16_TUNING,
    *,
    decode_words: bool = False,
    fragment: bool = False,
    frag_tuning: FragTuning = DEFAULT_FRAG_TUNING,
) -> W4A16Route:
    """The faster W4A16 kernel route for an ``rows``-row call: ``"w4a16_frag"`` (the fragment
    words, decoded in the MMA's register operand) up to ``frag_tuning.w4a16_max_rows`` rows
    where the caller holds decode words and the fragment kernels run (``fragment``),
    ``"w4a16_words"`` (the decode words, two weights decoded per instruction) up to
    ``tuning.words_max_rows`` rows where the caller holds them (``decode_words``),
    ``"w4a16_fused"`` (one launch decoding the checkpoint words in registers) up to
    ``tuning.fused_max_rows``, else ``"w4a16_decode_gemm"`` (decode once, then the library GEMM
    at its full rate). Measured crossovers: RESULTS.md.

    Example:
      >>> w4a16_route(1), w4a16_route(1, decode_words=True), w4a16_route(4096)
      ('w4a16_fused', 'w4a16_words', 'w4a16_decode_gemm')
      >>> w4a16_route(8, decode_words=True, fragment=True), w4a16_route(9, decode_words=True,
      ...                                                               fragment=True)
      ('w4a16_frag', 'w4a16_words')
    """
    if decode_words and fragment and rows <= frag_tuning.w4a16_max_rows:
        return "w4a16_frag"
    if decode_words and rows <= tuning.words_max_rows:
        return "w4a16_words"
    return "w4a16_fused" if rows <= tuning.fused_max_rows else "w4a16_decode_gemm"


def gptq_route(
    device: torch.device, dtype: torch.dtype, rows: int, *, decode_words: bool = False
) -> tuple[str, str | None]:
    """``(route, reason)`` of a ``GPTQLinear`` call of ``rows`` rows: ``"w4a16_frag"`` or
    ``"w4a16_words"`` (where the module holds decode words for ``dtype``: ``decode_words``;
    the first where :func:`floatxq.kernels.w4a_frag.fragment_unavailable_reason` names no
    reason), ``"w4a16_fused"`` or
    ``"w4a16_decode_gemm"`` (the W4A16 kernels, by row count) where Triton runs on CUDA for
    ``dtype``, else ``"dequant_matmul"`` and why not the kernels.

    Example:
      >>> gptq_route(torch.device("cpu"), torch.float16, 4)
      ('dequant_matmul', 'x is on cpu; the W4A16 kernels run on CUDA')
    """
    if device.type != "cuda":
        return GPTQ_DECODE_ROUTE, f"x is on {device}; the W4A16 kernels run on CUDA"
    if dtype not in _HALF_DTYPES:
        return GPTQ_DECODE_ROUTE, f"x is {dtype}; the W4A16 kernels take float16/bfloat16"
    reason = triton_unavailable_reason(device)
    if reason is not None:
        return GPTQ_DECODE_ROUTE, reason
    fragment = decode_words and fragment_unavailable_reason(device) is None
    return w4a16_route(rows, decode_words=decode_words, fragment=fragment), None
