"""Calibrating a W4A-NVFP4 stream's producer boundaries on sample text (activations only).

An installed NVFP4 stream (:mod:`floatxq.lifecycle.stream`) quantizes five boundary tensors per
Llama decoder layer (the layer input where no selected layer precedes it, the attention output,
the attention residual, the MLP product, the layer output). Left alone each takes a dynamic
global scale from its own batch, so one token's codes depend on the others. Calibration fixes
one FP32 global scale per producer, once, from sample text:

1. every sample runs through the embeddings alone, and the first decoder layer's inputs
   (hidden states and keyword arguments) are kept;
2. layer by layer, for each of its NVFP4 producers in execution order, the layer runs on every
   kept input until that producer is reached (its observer records ``max|x|`` and stops the
   forward); the producer's scale becomes ``nvfp4_global_scale(max, recipe)`` (the maximum maps
   to E2M1 value 6 for ``nvidia`` and 4 for the other recipes, at block scale 448) and is set at
   once, so later producers of the layer see calibrated upstream carriers;
3. the layer then runs completely on every kept input; its outputs (calibrated carriers) are the
   next layer's inputs.

The weights are not touched. The scales go into the stream (each layer's
:class:`~floatxq.lifecycle.stream.StreamScales` buffers), the model's
:class:`~floatxq.config.GPTQConfig` (``activation.global_scales``) and the Hugging Face config's
``quantization_config``, so :meth:`~floatxq.lifecycle.model.QuantizedModel.save` writes them and
loading installs them bit for bit. Any failure restores every scale and config as it was.
"""

import contextlib
import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from floatxq.config import ActivationConfig
from floatxq.formats import normalize_nvfp4_recipe
from floatxq.lifecycle.calibration import exact_int64
from floatxq.nvfp4.quantize import nvfp4_global_scale

CALIBRATED_RECIPES: tuple[str, ...] = ("nvidia", "four_six", "least_squares", "least_squares_grid")
"""Recipes whose producers take a calibrated global scale (the headroom recipes calibrate per
linear during the GPTQ solve instead; ``exhaustive`` searches its own)."""


class _Stop(Exception):
    """Raised by an observer or a capture hook to end a forward early."""


@dataclasses.dataclass
class _Maximum:
    """The running ``max|x|`` one producer sees over the calibration samples."""

    key: str
    amax: float = 0.0
    tokens: int = 0
    calls: int = 0

    def observe(self, value: Any) -> None:
        if not isinstance(value, torch.Tensor) or value.ndim < 2 or value.numel() == 0:
            shape = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
            raise ValueError(
                f"calibrate_activations: producer {self.key} saw {shape}; a boundary value is a "
                f"non-empty tensor of at least 2 dimensions"
            )
        peak = float(value.detach().abs().amax().float())
        if not math.isfinite(peak):
            raise ValueError(
                f"calibrate_activations: producer {self.key} saw a non-finite value (inf or "
                f"NaN); the model overflows in its dtype on these samples"
            )
        self.amax = max(self.amax, peak)
        self.tokens += value.numel() // value.shape[-1]
        self.calls += 1
        raise _Stop


def _moved(value: Any, device: torch.device) -> Any:
    """``value`` (tensors, carriers, tuples, lists, dicts of them) on ``device``."""
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if hasattr(value, "codes") and callable(getattr(value, "to", None)):  # a W4AActivation
        return value.to(device)
    if isinstance(value, tuple):
        return tuple(_moved(v, device) for v in value)
    if isinstance(value, list):
        return [_moved(v, device) for v in value]
    if isinstance(value, dict):
        return {k: _moved(v, device) for k, v in value.items()}
    return value


def _check_samples(samples: Any, vocab: int | None) -> list[torch.Tensor]:
    where = "calibrate_activations"
    if not isinstance(samples, Sequence) or isinstance(samples, (str, bytes, torch.Tensor)):
        raise TypeError(
            f"{where}: samples must be a list of 1-D token-id tensors, got {type(samples).__name__}"
        )
    if len(samples) == 0:
        raise ValueError(f"{where}: samples is empty; give at least one token-id tensor")
    out = []
    for i, ids in enumerate(samples):
        if not isinstance(ids, torch.Tensor):
            raise TypeError(f"{where}: samples[{i}] must be a torch.Tensor of token ids, got "
                            f"{type(ids).__name__}")  # fmt: skip
        if ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool:
            raise TypeError(f"{where}: samples[{i}] must hold integer token ids, got {ids.dtype}")
        if ids.ndim != 1 or ids.numel() == 0:
            raise ValueError(
                f"{where}: samples[{i}] must be one unpadded 1-D sequence of ids, got shape "
                f"{tuple(ids.shape)}"
            )
        # exact for every integer width (torch compares no uint16/32/64; uint64 may not fit)
        wide = exact_int64(ids, label=f"samples[{i}]", where=where)
        low, high = int(wide.min()), int(wide.max())
        if low < 0 or (vocab is not None and high >= vocab):
            raise ValueError(
                f"{where}: samples[{i}] ({ids.dtype}) holds ids {low}..{high}, outside the "
                f"vocabulary [0, {vocab if vocab is not None else 'vocab_size'})"
            )
        out.append(wide)
    return out


def _check_ready(core: Any, policy: Any) -> None:
    """The preconditions: a quantized model in eval mode with an installed NVFP4 stream whose
    recipes calibrate, matching the model's saved policy."""
    where = "calibrate_activations"
    if not core.quantized:
        raise RuntimeError(f"{where}: quantize() the model (or load a quantized checkpoint) first")
    if policy is None:
        raise RuntimeError(
            f"{where}: the model has no W4A activation stream installed; quantize or load it "
            f"with an NVFP4 activation policy (GPTQConfig(activation='w4a_nvfp4'))"
        )
    if policy.mode != "w4a_nvfp4":
        raise RuntimeError(
            f"{where}: the installed stream is {policy.mode!r}; only NVFP4 producers take "
            f"calibrated global scales (FP8 scales are per token)"
        )
    if core.model.training:
        raise RuntimeError(f"{where}: the model is in training mode; call model.eval() first")
    used = [policy.recipe]
    if policy.attention_mode == "w4a_nvfp4" and policy.attention_recipe is not None:
        used.append(policy.attention_recipe)
    for recipe in used:
        if normalize_nvfp4_recipe(recipe) not in CALIBRATED_RECIPES:
            raise ValueError(
                f"{where}: recipe {recipe!r} does not take calibrated producer scales; accepted: "
                f"{', '.join(CALIBRATED_RECIPES)} (headroom recipes calibrate per linear while "
                f"solving)"
            )
    config = core.quantize_config
    activation = getattr(config, "activation", None)
    if activation is None:
        raise RuntimeError(
            f"{where}: the model's quantize_config has no activation policy, so calibrated "
            f"scales could not be saved; load or quantize it with one"
        )
    from floatxq.lifecycle.stream import w4a_stream_policy
    from floatxq.lifecycle.w4a_install import stream_arguments

    saved = w4a_stream_policy(**stream_arguments(activation))
    if saved != dataclasses.replace(policy, fused_norms=False):
        raise RuntimeError(
            f"{where}: the installed stream's policy {policy} differs from the model's saved "
            f"activation policy {saved}; reinstall the stream from the config first"
        )


def _capture(model: nn.Module, first: nn.Module, samples: list[torch.Tensor]) -> list[tuple]:
    """Run the embeddings on every sample; keep the first decoder layer's (args, kwargs)."""
    kept: list[tuple] = []

    def hook(_module: nn.Module, args: tuple, kwargs: dict) -> None:
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        if cache is not None:
            raise RuntimeError(
                "calibrate_activations: the model passed a KV cache to its first layer; "
                "calibration runs with use_cache=False"
            )
        kept.append((_moved(args, torch.device("cpu")), _moved(dict(kwargs), torch.device("cpu"))))
        raise _Stop

    device = next(iter(model.parameters())).device
    handle = first.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        for ids in samples:
            with contextlib.suppress(_Stop):
                model(input_ids=ids[None].to(device), use_cache=False)
    finally:
        handle.remove()
    if len(kept) != len(samples):
        raise RuntimeError(
            f"calibrate_activations: the forward reached the first decoder layer for {len(kept)} "
            f"of {len(samples)} samples"
        )
    return kept


def _run_layer(layer: nn.Module, item: tuple, device: torch.device) -> Any:
    args, kwargs = _moved(item[0], device), _moved(item[1], device)
    out = layer(*args, **kwargs)
    return out[0] if isinstance(out, (tuple, list)) else out


def calibrate_nvfp4_producers(
    core: Any,
    samples: Sequence[torch.Tensor],
    *,
    progress: Callable[[str, Mapping[str, Any]], None] | None = None,
) -> dict[str, Any]:
    """Calibrate every NVFP4 producer of ``core``'s installed stream (see the module docstring).

    Args:
      core: a :class:`~floatxq.lifecycle.model.QuantizedModel`: quantized, in eval mode, with an
        installed NVFP4 stream whose recipes are in :data:`CALIBRATED_RECIPES` and whose policy
        is the config's.
      samples: a non-empty list of unpadded 1-D integer token-id tensors.
      progress: called with ``(key, row)`` as each producer is calibrated (``row`` as in the
        report's ``boundaries``).

    Returns:
      ``{"algorithm": "producer_maximum", "recipe", "global_scales": {key: scale},
      "boundaries": {key: {"recipe", "amax", "global_scale", "tokens", "samples"}},
      "upstream_activations": "calibrated_encoded_carriers", "weight_updates": 0}``.

    Raises:
      TypeError / ValueError: bad samples (named by index); a headroom or ``exhaustive`` recipe;
        a producer that sees a non-finite value.
      RuntimeError: a model that is not quantized, has no NVFP4 stream, is in training mode, or
        whose installed policy differs from its config's; a producer the forward never reaches.
      Whatever the forward raises. In every case each quantizer scale, the stream's policy, the
      config and the Hugging Face ``quantization_config`` are restored exactly first.

    Numerics: each scale is ``nvfp4_global_scale(amax, recipe=...)``: one FP32 division of the
    observed ``max|x|`` by ``448·6`` (``nvidia``) or ``448·4``, no grid rounding.
    """
    from floatxq.interop.payload import gptq_config_to_payload
    from floatxq.lifecycle.decoder import decoder_layers
    from floatxq.lifecycle.stream import (
        installed_w4a_stream,
        set_stream_global_scales,
        stream_boundary_quantizers,
    )

    model = core.model
    policy = installed_w4a_stream(model)
    _check_ready(core, policy)
    vocab = getattr(getattr(model, "config", None), "vocab_size", None)
    ids = _check_samples(samples, vocab if isinstance(vocab, int) else None)
    quantizers = stream_boundary_quantizers(model)
    busy = [key for key, q in quantizers.items() if q.observer is not None]
    if busy:
        raise RuntimeError(
            f"calibrate_activations: producer {busy[0]} already has an observer attached; "
            f"remove it first"
        )
    hf_config = getattr(model, "config", None)
    snapshot = {
        "bits": {key: q.scale_bits.cpu() for key, q in quantizers.items()},
        "scales": None if policy.global_scales is None else dict(policy.global_scales),
        "config": core.quantize_config,
        "hf": getattr(hf_config, "quantization_config", None),
    }
    _, layers = decoder_layers(model)
    device = next(iter(model.parameters())).device
    report: dict[str, dict[str, Any]] = {}
    scales: dict[str, float] = {}
    try:
        with torch.no_grad():
            cache = _capture(model, layers[0], ids)
            for index, layer in enumerate(layers):
                prefix = f"model.layers.{index}."
                for key in [k for k in quantizers if k.startswith(prefix)]:
                    quantizer, seen = quantizers[key], _Maximum(key)
                    quantizer.observer = seen.observe
                    try:
                        for item in cache:
                            with contextlib.suppress(_Stop):
                                _run_layer(layer, item, device)
                    finally:
                        quantizer.observer = None
                    if seen.calls != len(cache):
                        raise RuntimeError(
                            f"calibrate_activations: layer {index}'s forward reached producer "
                            f"{key} on {seen.calls} of {len(cache)} samples"
                        )
                    recipe = quantizer.recipe
                    scale = float(nvfp4_global_scale(seen.amax, recipe=recipe))
                    quantizer.set_scale(scale)
                    scales[key] = scale
                    row = {
                        "recipe": recipe,
                        "amax": seen.amax,
                        "global_scale": scale,
                        "tokens": seen.tokens,
                        "samples": seen.calls,
                    }
                    report[key] = row
                    if progress is not None:
                        progress(key, row)
                cache = [
                    ((_moved(_run_layer(layer, item, device), torch.device("cpu")),
                      *item[0][1:]), item[1])
                    for item in cache
                ]  # fmt: skip
            set_stream_global_scales(model, scales)
            activation = core.quantize_config.activation
            stored = {**activation.to_dict(), "global_scales": scales}
            config = dataclasses.replace(
                core.quantize_config, activation=ActivationConfig.from_dict(stored)
            )
            core.quantize_config = config
            if hf_config is not None and hasattr(hf_config, "quantization_config"):
                hf_config.quantization_config = gptq_config_to_payload(config)
    except BaseException:
        for quantizer in quantizers.values():
            quantizer.observer = None
        set_stream_global_scales(model, snapshot["scales"])
        for key, quantizer in quantizers.items():  # in place: a captured graph reads these
            quantizer.scales.assign(quantizer.name, snapshot["bits"][key])
        core.quantize_config = snapshot["config"]
        if hf_config is not None and hasattr(hf_config, "quantization_config"):
            hf_config.quantization_config = snapshot["hf"]
        raise
    return {
        "algorithm": "producer_maximum",
        "recipe": normalize_nvfp4_recipe(policy.recipe),
        "global_scales": dict(scales),
        "boundaries": report,
        "upstream_activations": "calibrated_encoded_carriers",
        "weight_updates": 0,
    }


__all__ = ["CALIBRATED_RECIPES", "calibrate_nvfp4_producers"]
