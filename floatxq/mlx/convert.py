"""Whole-model conversion: a transformers Llama with floatxq FP8 linears to an mlx_lm Llama.

:func:`convert_to_mlx` builds ``mlx_lm.models.llama.Model`` from the Hugging Face config, copies
every dense tensor (embeddings, norms, dense linears, an untied ``lm_head``) in the model's
dtype and gives each :class:`floatxq.nn.TorchFP8Linear` one of two MLX layers: the native
``mxfp8`` :class:`~floatxq.mlx.MlxFP8Linear` where that transfer is exact, else the
decode-table :class:`~floatxq.mlx.MlxFP8PackedLinear`. The result records the route of every
linear and, for the packed ones, why the native route was not taken.
"""

from collections.abc import Mapping
from typing import Any, NamedTuple

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten
from mlx_lm.models.llama import Model, ModelArgs

from floatxq.lifecycle.stream import LLAMA_STREAM_PROJECTIONS
from floatxq.mlx.linear import MlxFP8Linear, MlxFP8PackedLinear

__all__ = ["MlxConversion", "convert_to_mlx"]

_WHERE = "convert_to_mlx"
# Rope types whose mlx_lm implementation reads the same keys as the Hugging Face config.
_ROPE_TYPES = ("default", "linear", "llama3")


class MlxConversion(NamedTuple):
    """The converted mlx_lm model and the route each linear took.

    Fields:
      model: an ``mlx_lm.models.llama.Model`` ready to call on token ids ``(batch, seq)``.
      routes: linear path (``"model.layers.0.self_attn.q_proj"``, ``"lm_head"``) to ``"dense"``
        (an ``mlx.nn.Linear``), ``"mxfp8"`` (:class:`MlxFP8Linear`) or ``"packed"``
        (:class:`MlxFP8PackedLinear`).
      reasons: for each ``"packed"`` linear, why the native ``mxfp8`` route was not exact.
    """

    model: Any
    routes: Mapping[str, str]
    reasons: Mapping[str, str]


def _model_args(config: Any) -> Any:
    """mlx_lm ``ModelArgs`` from a Hugging Face Llama config (either rope spelling)."""
    cfg = dict(config.to_dict())
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in _ROPE_TYPES:
        raise ValueError(
            f"{_WHERE}: model.config rope type {rope_type!r} is not supported; accepted: "
            f"{', '.join(_ROPE_TYPES)}"
        )
    theta = rope.get("rope_theta", cfg.get("rope_theta", 10000.0))
    scaling = None if rope_type == "default" else {**rope, "rope_type": rope_type}
    cfg.update(rope_theta=float(theta), rope_scaling=scaling, rope_traditional=False)
    cfg.pop("rope_parameters", None)
    return ModelArgs.from_dict(cfg)


def _mx_dtype(dtype: Any) -> Any:
    import torch

    table = {torch.float32: mx.float32, torch.bfloat16: mx.bfloat16, torch.float16: mx.float16}
    if dtype not in table:
        raise ValueError(
            f"{_WHERE}: model parameters are {dtype}; accepted: float32, bfloat16, float16"
        )
    return table[dtype]


def _dense(tensor: Any, dtype: Any, *, name: str) -> mx.array:
    """A torch tensor as an MLX array of ``dtype`` (through FP32, exact for the three dtypes)."""
    import torch

    if _mx_dtype(tensor.dtype) != dtype:
        raise ValueError(
            f"{_WHERE}: {name} is {tensor.dtype} but the embeddings are {dtype}; convert the "
            "model to one dtype first (a silent cast would round)"
        )
    with torch.no_grad():
        values = tensor.detach().cpu().to(torch.float32).contiguous().numpy()
    return mx.array(np.array(values, copy=True)).astype(dtype)


def _check_source(model: Any) -> None:
    from transformers import LlamaForCausalLM

    if not isinstance(model, LlamaForCausalLM):
        raise ValueError(
            f"{_WHERE}: model must be a transformers LlamaForCausalLM, got {type(model).__name__}"
        )
    model_type = getattr(model.config, "model_type", None)
    if model_type != "llama":
        raise ValueError(f"{_WHERE}: model.config.model_type is {model_type!r}; only 'llama'")
    act = getattr(model.config, "hidden_act", None)
    if act != "silu":
        raise ValueError(
            f"{_WHERE}: model.config.hidden_act is {act!r}; mlx_lm's Llama uses 'silu'"
        )


def convert_to_mlx(model: Any) -> MlxConversion:
    """Convert a transformers Llama whose linears may be FP8 (floatxq) to an mlx_lm Llama.

    Args:
      model: a ``transformers.LlamaForCausalLM`` (float32, bfloat16 or float16 parameters) whose
        linears are ``torch.nn.Linear`` or :class:`floatxq.nn.TorchFP8Linear`.

    Returns:
      An :class:`MlxConversion`: the ``mlx_lm.models.llama.Model``, the route of every linear
      and the reason each packed linear could not use ``mxfp8``.

    Raises:
      ValueError: ``model`` is not a ``LlamaForCausalLM`` or has another ``model_type`` or
        ``hidden_act`` than ``"silu"``; an unsupported rope type or parameter dtype, or dense
        tensors of mixed dtypes; a linear of a type other than ``nn.Linear``
        or ``TorchFP8Linear`` (GPTQ, NVFP4, ...); another module holding parameters outside the
        Llama layout; a tensor or bias whose shape differs from what the config implies; an FP8
        linear that cannot transfer (as :meth:`MlxFP8PackedLinear.from_torch`).

    Numerics: dense tensors are copied exactly in the model's dtype (widened to FP32 and
    rounded back, exact for all three); FP8 bytes, FP32 inverse scales and biases are copied
    exactly. The MLX model's logits differ from torch's only by summation order and the
    attention, rope and norm kernels of each library.

    Example:
      >>> from floatxq.tiny import load_tiny_llama
      >>> out = convert_to_mlx(load_tiny_llama())
      >>> sorted(set(out.routes.values())), out.model(mx.array([[1, 2, 3]])).shape
      (['dense'], (1, 3, 256))
    """
    import torch

    from floatxq.nn.fp8_linear import TorchFP8Linear

    _check_source(model)
    dtype = _mx_dtype(model.model.embed_tokens.weight.dtype)
    args = _model_args(model.config)
    torch_modules = dict(model.named_modules())
    _check_known_modules(torch_modules)
    paths = [
        f"model.layers.{i}.{name}"
        for i in range(model.config.num_hidden_layers)
        for name in LLAMA_STREAM_PROJECTIONS
    ]
    lm_head = torch_modules.get("lm_head")
    tied = bool(args.tie_word_embeddings)
    if isinstance(lm_head, TorchFP8Linear):
        tied = False  # the quantized head is its own tensor even when the config ties it
    if not tied:
        paths.append("lm_head")
    args.tie_word_embeddings = tied
    target = Model(args)
    target_modules = dict(target.named_modules())

    routes: dict[str, str] = {}
    reasons: dict[str, str] = {}
    dense: dict[str, mx.array] = {}
    for path in paths:
        module = torch_modules.get(path)
        if module is None:
            raise ValueError(f"{_WHERE}: model has no module {path!r}, which Llama needs")
        expected = target_modules[path]
        out_f, in_f = expected.weight.shape
        if type(module) is torch.nn.Linear:
            if tuple(module.weight.shape) != (out_f, in_f):
                raise ValueError(
                    f"{_WHERE}: {path}.weight has shape {tuple(module.weight.shape)}; the config "
                    f"implies {(out_f, in_f)}"
                )
            dense[f"{path}.weight"] = _dense(module.weight, dtype, name=f"{path}.weight")
            if module.bias is not None:
                dense[f"{path}.bias"] = _dense(module.bias, dtype, name=f"{path}.bias")
            routes[path] = "dense"
            continue
        if not isinstance(module, TorchFP8Linear):
            raise ValueError(
                f"{_WHERE}: {path} is a {type(module).__name__}; accepted: torch.nn.Linear or "
                "floatxq TorchFP8Linear"
            )
        if (module.out_features, module.in_features) != (out_f, in_f):
            raise ValueError(
                f"{_WHERE}: {path} is ({module.out_features}, {module.in_features}); the config "
                f"implies {(out_f, in_f)}"
            )
        if (module.bias is not None) != ("bias" in expected):
            raise ValueError(
                f"{_WHERE}: {path} bias presence ({module.bias is not None}) differs from the "
                "config's attention_bias/mlp_bias"
            )
        why = MlxFP8Linear.eligibility(module)
        if why is None:
            layer: Any = MlxFP8Linear.from_torch(module)
            routes[path] = "mxfp8"
        else:
            layer = MlxFP8PackedLinear.from_torch(module)
            routes[path] = "packed"
            reasons[path] = why
        parent, _, leaf = path.rpartition(".")
        setattr(target_modules[parent] if parent else target, leaf, layer)

    named = {
        "model.embed_tokens.weight": model.model.embed_tokens.weight,
        "model.norm.weight": model.model.norm.weight,
    }
    for i, block in enumerate(model.model.layers):
        for norm in ("input_layernorm", "post_attention_layernorm"):
            named[f"model.layers.{i}.{norm}.weight"] = getattr(block, norm).weight
    for key, tensor in named.items():
        dense[key] = _dense(tensor, dtype, name=key)

    quantized = tuple(f"{p}." for p, r in routes.items() if r != "dense")
    wanted = {
        k: v.shape for k, v in tree_flatten(target.parameters()) if not k.startswith(quantized)
    }
    missing = sorted(set(wanted) - set(dense))
    extra = sorted(set(dense) - set(wanted))
    if missing or extra:
        raise ValueError(
            f"{_WHERE}: the model's tensors do not match the Llama layout (missing {missing}, "
            f"unexpected {extra})"
        )
    for key, shape in wanted.items():
        if tuple(dense[key].shape) != tuple(shape):
            raise ValueError(
                f"{_WHERE}: {key} has shape {tuple(dense[key].shape)}; the config implies "
                f"{tuple(shape)}"
            )
    target.load_weights(list(dense.items()), strict=False)
    target.eval()
    mx.eval(target.parameters())
    return MlxConversion(model=target, routes=routes, reasons=reasons)


def _check_known_modules(torch_modules: Mapping[str, Any]) -> None:
    """Refuse modules with parameters outside the Llama layout this converter copies."""
    from floatxq.nn.fp8_linear import TorchFP8Linear

    known = {"embed_tokens", "norm", "input_layernorm", "post_attention_layernorm"}
    for path, module in torch_modules.items():
        if isinstance(module, TorchFP8Linear):
            continue
        own = [n for n, _ in module.named_parameters(recurse=False)]
        if not own:
            continue
        leaf = path.rpartition(".")[2]
        projections = {n.rpartition(".")[2] for n in LLAMA_STREAM_PROJECTIONS}
        if leaf in known or leaf == "lm_head" or leaf in projections:
            continue
        raise ValueError(
            f"{_WHERE}: module {path!r} ({type(module).__name__}) holds parameters outside the "
            "Llama layout this converter copies"
        )
