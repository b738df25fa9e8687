"""W4A modules and the activation stream installed on a quantized model.

After a GPTQ run or a load with a W4A backend, every ``GPTQLinear`` is replaced by the backend's
W4A module (:func:`install_w4a_modules`), then the activation stream is installed where the model
supports it (:func:`install_activation_stream`: the Llama stream, else the generic one).
"""

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from floatxq.config import BACKEND, ActivationConfig

_ATTENTION_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj")


def module_recipe(name: str, activation: ActivationConfig | None) -> str | None:
    """The NVFP4 recipe a module's inputs use under ``activation`` (None: the module default)."""
    if activation is None or activation.recipe is None:
        return None
    attention = activation.attention
    if (
        attention is not None
        and attention.mode == "w4a_nvfp4"
        and name.rsplit(".", 1)[-1] in _ATTENTION_PROJECTIONS
    ):
        return attention.recipe
    return activation.recipe


def install_w4a_modules(
    model: nn.Module,
    backend: BACKEND,
    *,
    activation: ActivationConfig | None = None,
    scale_bits: Mapping[str, torch.Tensor] | None = None,
    scales: Mapping[str, float] | None = None,
) -> None:
    """Replace every GPTQLinear by the ``backend``'s W4A module sharing its tensors.

    NVFP4 modules take their activation global scale from ``scale_bits`` (a checkpoint's int32
    bits) or ``scales`` (a GPTQ run's values; 0.0 stays dynamic), and their recipe from the
    ``activation`` policy.

    Raises:
      ValueError: naming the first module that cannot run on ``backend`` and why, before any
        module is replaced.
    """
    from floatxq.nn.gptq_linear import GPTQLinear
    from floatxq.nn.w4a_fp8_linear import W4AFP8Linear, w4a_fp8_ineligibility
    from floatxq.nn.w4a_nvfp4_linear import W4ANVFP4Linear, w4a_nvfp4_ineligibility

    nvfp4 = backend == BACKEND.GPTQ_W4A_NVFP4
    ineligibility = w4a_nvfp4_ineligibility if nvfp4 else w4a_fp8_ineligibility
    gptq = [(n, m) for n, m in model.named_modules() if type(m) is GPTQLinear]
    for name, module in gptq:
        why = ineligibility(module)
        if why is not None:
            raise ValueError(
                f"load: backend {backend.value!r} cannot run {name}: {why}; load with backend "
                f"'auto' to run the checkpoint as W4A16 (gptq_torch)"
            )
    for name, module in gptq:
        if not nvfp4:
            model.set_submodule(name, W4AFP8Linear.from_gptq_linear(module))
            continue
        layer = W4ANVFP4Linear.from_gptq_linear(module)
        recipe = module_recipe(name, activation)
        if recipe is not None:
            layer.activation_recipe = recipe
        if scale_bits is not None and name in scale_bits:
            bits = scale_bits[name].to(layer.activation_global_scale_bits.device)
            layer.activation_global_scale_bits = bits.reshape(()).clone()
            layer.post_init()  # checks the stored value (0.0 or positive finite)
        elif scales is not None and scales.get(name, 0.0) != 0.0:
            layer.activation_global_scale = scales[name]
        model.set_submodule(name, layer)


def install_activation_stream(model: nn.Module, activation: ActivationConfig) -> bool:
    """Install the activation stream for ``activation``: the Llama stream (FP32 residual,
    calibratable producers) on a Llama, else the generic boundary stream (each norm's output
    packed once for the W4A linears it feeds). False (nothing done) for a model without a
    decoder layer list: its W4A modules then quantize their own inputs, call by call.

    Raises:
      ValueError: the stream's refusals; producer ``global_scales`` on a model that is not a
        Llama (only the Llama stream has producers).
    """
    from floatxq.lifecycle.decoder import decoder_layers
    from floatxq.lifecycle.stream import install_w4a_llama_stream, install_w4a_stream
    from floatxq.lifecycle.stream.install import _llama_layers

    arguments = stream_arguments(activation)
    try:
        _llama_layers(model, where="load")  # the stream's own test of a Llama
    except ValueError:
        pass
    else:
        install_w4a_llama_stream(model, **arguments)
        return True
    try:
        decoder_layers(model)
    except ValueError:
        return False
    if arguments.pop("global_scales") is not None:
        raise ValueError(
            f"load: the activation policy has calibrated producer scales (global_scales), which "
            f"only the Llama stream has; {type(model).__name__} is not a Llama"
        )
    install_w4a_stream(model, **arguments)
    return True


def stream_arguments(activation: ActivationConfig) -> dict[str, Any]:
    """:func:`~floatxq.lifecycle.stream.install_w4a_llama_stream`'s keyword arguments for a
    stored activation policy (no rotation in floatxq: ``fused_norms`` stays False).

    Example:
      >>> policy = ActivationConfig(mode="w4a_nvfp4", mlp={"mode": "w4afp8", "layers": [1]})
      >>> args = stream_arguments(policy)
      >>> args["mode"], args["recipe"], args["attention_mode"], args["mlp_fp8_layers"]
      ('w4a_nvfp4', 'least_squares', None, (1,))
    """
    attention, mlp = activation.attention, activation.mlp
    return {
        "mode": activation.mode,
        "recipe": activation.recipe,
        "global_scales": None
        if activation.global_scales is None
        else dict(activation.global_scales),
        "attention_mode": None if attention is None else attention.mode,
        "attention_recipe": None if attention is None else attention.recipe,
        "mlp_fp8_layers": None if mlp is None else tuple(mlp.layers),
    }
