"""Which quantized linears of a model quantize their activations, and how: one line for a report.

Example:
  >>> from torch import nn
  >>> from floatxq.nn.fp8_linear import TorchFP8Linear
  >>> model = nn.Sequential(TorchFP8Linear(8, 8, input_quant="token"), TorchFP8Linear(8, 8))
  >>> activation_summary(model)
  'FP8 per-token activations on 1 of 2 quantized linears; weight-only on 1'
"""

from collections import Counter

from torch import nn

from floatxq.nn.fp4_linear import TorchFP4Linear
from floatxq.nn.fp8_linear import TorchFP8Linear
from floatxq.nn.gptq_linear import GPTQLinear
from floatxq.nn.w4a_fp8_linear import W4AFP8Linear
from floatxq.nn.w4a_nvfp4_linear import W4ANVFP4Linear

__all__ = ["activation_summary", "module_activations"]

_WEIGHT_ONLY = "weight-only"


def module_activations(module: nn.Module) -> str | None:
    """How one module quantizes its activations (``"weight-only"`` when it does not), or
    ``None`` for a module that is not a floatxq quantized linear.

    Example:
      >>> module_activations(TorchFP8Linear(256, 8, input_quant="group:128"))
      'FP8 per-token-group (128) activations'
    """
    if isinstance(module, TorchFP8Linear):
        quant = module.input_quant
        if quant is None:
            return _WEIGHT_ONLY
        if quant.strategy == "group":
            return f"FP8 per-token-group ({quant.group_size}) activations"
        return f"FP8 per-{quant.strategy} activations"
    if isinstance(module, W4AFP8Linear):  # before GPTQLinear: a subclass
        return "FP8 per-token activations (W4A-FP8)"
    if isinstance(module, W4ANVFP4Linear):
        return "NVFP4 activations (W4A-NVFP4)"
    if isinstance(module, (GPTQLinear, TorchFP4Linear)):
        return _WEIGHT_ONLY
    return None


def activation_summary(model: nn.Module) -> str:
    """One line for an evaluation report: which quantized linears quantize their activations.

    ``"FP8 per-token activations on 14 of 14 quantized linears"``, ``"weight-only (14 quantized
    linears)"``, ``"no quantized linears"``, or the kinds joined (most common first, weight-only
    last): ``"FP8 per-token activations on 10 of 14 quantized linears; weight-only on 4"``.

    Numerics: none; reads module settings.
    """
    kinds = Counter(k for k in map(module_activations, model.modules()) if k is not None)
    total = sum(kinds.values())
    if total == 0:
        return "no quantized linears"
    weight_only = kinds.pop(_WEIGHT_ONLY, 0)
    if not kinds:
        return f"{_WEIGHT_ONLY} ({total} quantized linear{'s' if total != 1 else ''})"
    parts = [f"{kind} on {n} of {total} quantized linears" for kind, n in kinds.most_common()]
    parts[1:] = [p.replace(f" of {total} quantized linears", "") for p in parts[1:]]
    if weight_only:
        parts.append(f"{_WEIGHT_ONLY} on {weight_only}")
    return "; ".join(parts)
