"""Whole-model conversion: a transformers decoder with floatxq FP8 linears to its mlx_lm model.

:func:`convert_to_mlx` picks the mlx_lm ``Model``/``ModelArgs`` pair for the Hugging Face
``config.model_type`` (``mistral`` runs as mlx_lm's ``llama``, as mlx_lm itself does),
builds the arguments from the Hugging Face config, copies every dense tensor by its Hugging Face
name in the model's dtype and gives each :class:`floatxq.nn.TorchFP8Linear` one of two MLX
layers: the native ``mxfp8`` :class:`~floatxq.mlx.MlxFP8Linear` where that transfer is exact,
else the decode-table :class:`~floatxq.mlx.MlxFP8PackedLinear`. The tensors must then match the
mlx_lm model's parameters one for one. The result records the route of every linear and, for
the packed ones, why the native route was not taken.
"""

from collections.abc import Mapping
from typing import Any, NamedTuple

import mlx.core as mx
import mlx.nn
import numpy as np
from mlx.utils import tree_flatten

from floatxq.mlx.linear import MlxFP8Linear, MlxFP8PackedLinear

__all__ = ["SUPPORTED_MODEL_TYPES", "MlxConversion", "convert_to_mlx"]

_WHERE = "convert_to_mlx"
# Hugging Face model types whose transformers and mlx_lm models are checked to agree (the tests
# compare logits for each); all four use SiLU-gated MLPs, RMSNorm and rotary attention.
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
# The mlx_lm module that runs each (mlx_lm runs Mistral with its Llama model).
_MLX_LM_MODULE = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}
# Rope types whose mlx_lm implementation reads the same keys as the Hugging Face config.
_ROPE_TYPES = ("default", "linear", "llama3")
# Every supported mlx_lm model hard-codes a SiLU-gated MLP (``swiglu``).
_HIDDEN_ACT = "silu"


class MlxConversion(NamedTuple):
    """The converted mlx_lm model and the route each linear took.

    Fields:
      model: the mlx_lm ``Model`` of the source's architecture (``mlx_lm.models.llama.Model``
        for Llama and Mistral, ``mlx_lm.models.qwen2.Model``, ``mlx_lm.models.qwen3.Model``),
        ready to call on token ids ``(batch, seq)``.
      routes: linear path (``"model.layers.0.self_attn.q_proj"``, ``"lm_head"``) to ``"dense"``
        (an ``mlx.nn.Linear``), ``"mxfp8"`` (:class:`MlxFP8Linear`) or ``"packed"``
        (:class:`MlxFP8PackedLinear`). A head tied to the embeddings has no entry.
      reasons: for each ``"packed"`` linear, why the native ``mxfp8`` route was not exact.
    """

    model: Any
    routes: Mapping[str, str]
    reasons: Mapping[str, str]


def _model_args(config: Any, args_class: Any) -> Any:
    """mlx_lm ``ModelArgs`` from a Hugging Face config (either rope spelling)."""
    cfg = dict(config.to_dict())
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in _ROPE_TYPES:
        raise ValueError(
            f"{_WHERE}: model.config rope type {rope_type!r} is not supported; accepted: "
            f"{', '.join(_ROPE_TYPES)}"
        )
    sliding = sorted({t for t in cfg.get("layer_types") or () if t != "full_attention"})
    window = cfg.get("sliding_window")
    longest = cfg.get("max_position_embeddings")
    if sliding:
        raise ValueError(
            f"{_WHERE}: model.config.layer_types has {sliding}; only 'full_attention' layers are "
            "supported (the mlx_lm model would attend to every position)"
        )
    if cfg["model_type"] == "mistral" and window is not None and (longest or 0) > window:
        raise ValueError(
            f"{_WHERE}: model.config.sliding_window is {window} (below max_position_embeddings "
            f"{longest}); mlx_lm runs Mistral as Llama with full attention, so accepted: None or "
            "a window of at least max_position_embeddings"
        )
    theta = rope.get("rope_theta", cfg.get("rope_theta", 10000.0))
    scaling = None if rope_type == "default" else {**rope, "rope_type": rope_type}
    cfg.update(
        rope_theta=float(theta),
        rope_scaling=scaling,
        rope_traditional=False,
        layer_types=None,
        sliding_window=None,
    )
    cfg.pop("rope_parameters", None)
    return args_class.from_dict(cfg)


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


def _check_source(model: Any) -> str:
    """The source's ``model_type`` once it is a supported transformers causal LM."""
    from transformers import PreTrainedModel

    if not isinstance(model, PreTrainedModel) or not type(model).__name__.endswith("ForCausalLM"):
        raise ValueError(
            f"{_WHERE}: model must be a transformers *ForCausalLM model, got {type(model).__name__}"
        )
    model_type = getattr(model.config, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"{_WHERE}: model.config.model_type is {model_type!r}; accepted: "
            f"{', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    act = getattr(model.config, "hidden_act", None)
    if act != _HIDDEN_ACT:
        raise ValueError(
            f"{_WHERE}: model.config.hidden_act is {act!r}; mlx_lm's {model_type} model uses "
            f"{_HIDDEN_ACT!r}"
        )
    return model_type


def _source_tensors(model: Any, target_modules: Mapping[str, Any]) -> tuple[dict, dict, dict]:
    """Split the source into FP8 linears, dense linears and named dense tensors.

    Returns ``(fp8, dense_linears, tensors)``: path to ``TorchFP8Linear``, path to plain
    ``torch.nn.Linear`` where the mlx_lm model has an ``mlx.nn.Linear``, and Hugging Face tensor
    name to (tensor, owning module path). Refuses any other module type at a linear's place and
    any module holding persistent buffers (quantized layers keep their codes there).
    """
    import torch

    from floatxq.nn.fp8_linear import TorchFP8Linear

    fp8: dict[str, Any] = {}
    linears: dict[str, Any] = {}
    tensors: dict[str, tuple[Any, str]] = {}
    inside_fp8: tuple[str, ...] = ()
    for path, module in model.named_modules():
        if inside_fp8 and path.startswith(inside_fp8):
            continue
        if isinstance(module, TorchFP8Linear):
            fp8[path] = module
            inside_fp8 = (*inside_fp8, f"{path}.")
            continue
        if isinstance(target_modules.get(path), mlx.nn.Linear):
            if type(module) is not torch.nn.Linear:
                raise ValueError(
                    f"{_WHERE}: {path} is a {type(module).__name__}; accepted: torch.nn.Linear "
                    "or floatxq TorchFP8Linear"
                )
            linears[path] = module
        persistent = [
            n
            for n, _ in module.named_buffers(recurse=False)
            if n not in module._non_persistent_buffers_set
        ]
        if persistent:
            raise ValueError(
                f"{_WHERE}: module {path!r} ({type(module).__name__}) holds buffers {persistent}; "
                "accepted: dense parameters, torch.nn.Linear or floatxq TorchFP8Linear"
            )
        for name, tensor in module.named_parameters(recurse=False):
            tensors[f"{path}.{name}" if path else name] = (tensor, path)
    return fp8, linears, tensors


def convert_to_mlx(model: Any) -> MlxConversion:
    """Convert a transformers decoder whose linears may be FP8 (floatxq) to its mlx_lm model.

    Args:
      model: a transformers ``LlamaForCausalLM``, ``MistralForCausalLM``, ``Qwen2ForCausalLM`` or
        ``Qwen3ForCausalLM`` (``config.model_type`` in :data:`SUPPORTED_MODEL_TYPES`; float32,
        bfloat16 or float16 parameters) whose linears are ``torch.nn.Linear`` or
        :class:`floatxq.nn.TorchFP8Linear`.

    Returns:
      An :class:`MlxConversion`: the mlx_lm ``Model`` of that architecture, the route of every
      linear and the reason each packed linear could not use ``mxfp8``.

    Raises:
      ValueError: not a supported transformers causal LM (``model_type``, ``hidden_act`` other
        than ``"silu"``, rope type, sliding-window attention, parameter dtype, mixed dense
        dtypes); a linear other than ``nn.Linear`` / ``TorchFP8Linear`` or another module
        holding buffers; parameters the mlx_lm model lacks, missing, unexpected or misshapen
        tensors; an FP8 linear that cannot transfer (:meth:`MlxFP8PackedLinear.from_torch`).

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
    import importlib

    import torch

    from floatxq.nn.fp8_linear import TorchFP8Linear

    model_type = _check_source(model)
    module = importlib.import_module(f"mlx_lm.models.{_MLX_LM_MODULE[model_type]}")
    model_class, args_class = module.Model, module.ModelArgs
    embed = model.get_input_embeddings().weight
    dtype = _mx_dtype(embed.dtype)
    args = _model_args(model.config, args_class)
    head = model.get_output_embeddings()
    tied = bool(args.tie_word_embeddings)
    if isinstance(head, TorchFP8Linear):
        tied = False  # the quantized head is its own tensor even when the config ties it
    elif tied and head is not None and head.weight is not embed:
        with torch.no_grad():
            same = head.weight.shape == embed.shape and torch.equal(head.weight, embed)
        if not same:
            raise ValueError(
                f"{_WHERE}: model.config.tie_word_embeddings is True but lm_head.weight differs "
                "from the input embeddings; tie them or set tie_word_embeddings=False"
            )
    args.tie_word_embeddings = tied
    target = model_class(args)
    target_modules = dict(target.named_modules())
    fp8, linears, sources = _source_tensors(model, target_modules)
    kept = target.sanitize({name: name for name in sources})  # drops tied heads, rope buffers

    routes: dict[str, str] = {}
    reasons: dict[str, str] = {}
    for name in kept:
        path = sources[name][1]
        if path not in target_modules:
            module = model.get_submodule(path)
            raise ValueError(
                f"{_WHERE}: module {path!r} ({type(module).__name__}) holds parameters outside "
                f"the layout of mlx_lm's {model_type} model"
            )
    for path in linears:
        routes[path] = "dense"
    for path, module in fp8.items():
        expected = target_modules.get(path)
        if not isinstance(expected, mlx.nn.Linear):
            raise ValueError(
                f"{_WHERE}: {path} is an FP8 linear but mlx_lm's {model_type} model has no "
                "linear there"
            )
        out_f, in_f = expected.weight.shape
        if (module.out_features, module.in_features) != (out_f, in_f):
            raise ValueError(
                f"{_WHERE}: {path} is ({module.out_features}, {module.in_features}); the config "
                f"implies {(out_f, in_f)}"
            )
        if (module.bias is not None) != ("bias" in expected):
            raise ValueError(
                f"{_WHERE}: {path} bias presence ({module.bias is not None}) differs from the "
                f"config's ({'bias' in expected}) for mlx_lm's {model_type} model"
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

    quantized = tuple(f"{p}." for p, r in routes.items() if r != "dense")
    wanted = {
        k: v.shape for k, v in tree_flatten(target.parameters()) if not k.startswith(quantized)
    }
    missing = sorted(set(wanted) - set(kept))
    extra = sorted(set(kept) - set(wanted))
    if missing or extra:
        raise ValueError(
            f"{_WHERE}: the model's tensors do not match mlx_lm's {model_type} model (missing "
            f"{missing}, unexpected {extra})"
        )
    for key, shape in wanted.items():
        got = tuple(sources[key][0].shape)
        if got != tuple(shape):
            raise ValueError(f"{_WHERE}: {key} has shape {got}; the config implies {tuple(shape)}")
    dense = {key: _dense(sources[key][0], dtype, name=key) for key in sorted(wanted)}
    target.load_weights(list(dense.items()), strict=False)
    target.eval()
    mx.eval(target.parameters())
    return MlxConversion(model=target, routes=routes, reasons=reasons)
