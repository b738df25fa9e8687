"""``floatxq.load``: a model to quantize, a quantized checkpoint to run, or a native source to
requantize, wrapped in a :class:`~floatxq.lifecycle.model.QuantizedModel`.

A plain model (an ``nn.Module`` or a Hugging Face model directory) is wrapped for quantization; a
quantized directory (floatxq's or another tool's, ``docs/interop.md``) is rebuilt module by module
from its files (:mod:`floatxq.lifecycle.rebuild`), without quantizing again, on the backend that
runs it. A name is resolved first (:func:`resolve_model`): ``"tiny"`` is the built-in tiny Llama,
a local path is itself, and an ``org/name`` that is no local path is a Hugging Face Hub model
(read from the local Hub cache, downloaded only when ``HF_HUB_OFFLINE`` is not set).
"""

import contextlib
import os
import re
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from floatxq.config import (
    BACKEND,
    METHOD,
    FP8Config,
    GPTQConfig,
    NVFP4Config,
    backend_for_activation,
)
from floatxq.interop.checkpoint import (
    CONFIG_FILE,
    QUANTIZE_CONFIG_FILE,
    CheckpointError,
    recover_interrupted_save,
)
from floatxq.interop.payload import (
    fp8_config_from_payload,
    gptq_config_from_payload,
    nvfp4_config_from_payload,
    payload_method,
)
from floatxq.interop.shards import read_json
from floatxq.lifecycle.model import QuantizedModel, _quantized_types
from floatxq.lifecycle.rebuild import _load_plain, _load_quantized
from floatxq.lifecycle.w4a_install import install_activation_stream, install_w4a_modules

_W4A_BACKENDS = (BACKEND.GPTQ_W4AFP8, BACKEND.GPTQ_W4A_NVFP4)
"""Backends that run a GPTQ checkpoint with quantized activations (explicit, never ``auto``)."""


def _resolve_backend(backend: Any, config: Any = None, *, checkpoint: bool = False) -> BACKEND:
    """The backend that runs the model: FP8 weight-only models run on ``fp8_torch``, GPTQ
    (W4A16) models on ``gptq_torch``; an explicit backend must be the one the method runs on.
    ``gptq_w4afp8`` and ``gptq_w4a_nvfp4`` run GPTQ ``checkpoint``s (directories already
    quantized), never by ``auto``."""
    runs_on = BACKEND.GPTQ_TORCH if isinstance(config, GPTQConfig) else BACKEND.FP8_TORCH
    if isinstance(backend, str):
        try:
            chosen = BACKEND(str.lower(str.strip(backend)))
        except ValueError:
            chosen = None
        if chosen == BACKEND.AUTO or chosen == runs_on:
            return runs_on
        if chosen in _W4A_BACKENDS and runs_on == BACKEND.GPTQ_TORCH:
            if checkpoint:
                return chosen
            raise ValueError(
                f"load: backend {backend!r} runs GPTQ checkpoints loaded from a directory; "
                f"quantize with backend 'auto', save with layout 'gptq', then load that "
                f"directory with backend={chosen.value!r}"
            )
        if chosen in (BACKEND.FP8_TORCH, BACKEND.GPTQ_TORCH, *_W4A_BACKENDS):
            what = "GPTQ (W4A16)" if runs_on == BACKEND.GPTQ_TORCH else "FP8 weight-only"
            raise ValueError(
                f"load: backend {backend!r} cannot run {what} models; use 'auto' or "
                f"{runs_on.value!r}"
            )
    accepted = ", ".join(repr(b.value) for b in BACKEND)
    raise ValueError(
        f"load: backend {backend!r} is not available in floatxq; accepted: {accepted} (FP8 "
        f"weight-only models run on 'fp8_torch', GPTQ W4A16 models on 'gptq_torch', symmetric "
        f"4-bit g128 GPTQ checkpoints also on 'gptq_w4afp8' and 'gptq_w4a_nvfp4')"
    )


def _is_mlx(backend: Any) -> bool:
    return isinstance(backend, str) and str.lower(str.strip(backend)) == BACKEND.MLX.value


def _load_mlx(model_or_path: Any, *, quantize_config: Any, device: Any, dtype: Any) -> Any:
    """``load(path, backend="mlx")``: the checkpoint read as for ``fp8_torch``, then converted
    whole to an MLX model (:func:`floatxq.mlx.convert_to_mlx`)."""
    if quantize_config is not None:
        raise ValueError(
            "load: backend 'mlx' runs a saved checkpoint; quantize with backend 'auto', save, "
            "then load the directory with backend='mlx'"
        )
    if device is not None and str(device) not in ("mps", "cpu", "gpu"):
        raise ValueError(
            f"load: backend 'mlx' runs on MLX's default device (Apple GPU, else CPU); device "
            f"must be None, 'mps', 'gpu' or 'cpu', got {device!r}"
        )
    if not isinstance(model_or_path, (str, os.PathLike)):
        raise TypeError(
            f"load: backend 'mlx' takes a checkpoint directory, got {type(model_or_path).__name__}"
        )
    try:
        from floatxq.mlx import convert_to_mlx
    except ImportError as exc:  # pragma: no cover - depends on the machine
        raise ImportError(f"load: backend 'mlx' needs MLX and mlx-lm: {exc}") from exc
    loaded = load(model_or_path, dtype=dtype, backend="auto")
    if isinstance(loaded.quantize_config, GPTQConfig):
        raise ValueError(
            f"load: backend 'mlx' runs FP8 (or unquantized) checkpoints of the model types "
            f"convert_to_mlx supports; {model_or_path} "
            f"is a GPTQ checkpoint"
        )
    conversion = convert_to_mlx(loaded.model)
    result = QuantizedModel(
        conversion.model,
        quantize_config=loaded.quantize_config,
        backend=BACKEND.MLX,
        quantized=False,
        source=loaded.source,
    )
    result.quantized = loaded.quantized
    result.quantized_modules = list(loaded.quantized_modules)
    result.mlx_routes = dict(conversion.routes)
    result.layout = loaded.layout
    return result


def _backend_for(backend: Any, config: Any) -> BACKEND:
    """The backend for a model to quantize with ``config``: a GPTQ config with an activation
    policy binds its W4A backend (``auto`` or that one accepted), any other as
    :func:`_resolve_backend`."""
    activation = getattr(config, "activation", None) if isinstance(config, GPTQConfig) else None
    if activation is None:
        return _resolve_backend(backend, config)
    try:
        return backend_for_activation(activation, _backend_name(backend))
    except ValueError as exc:
        raise ValueError(f"load: {exc}") from None


def _backend_name(backend: Any) -> BACKEND:
    """``backend`` as a BACKEND, or the standard refusal of an unknown one."""
    if isinstance(backend, str):
        with contextlib.suppress(ValueError):
            return BACKEND(str.lower(str.strip(backend)))
    _resolve_backend(backend)  # raises, naming what is accepted
    raise AssertionError("unreachable")  # pragma: no cover


TINY_NAME = "tiny"
"""The name :func:`resolve_model` (and the command line) gives the built-in tiny Llama."""
HUB_FILES: tuple[str, ...] = (
    "*.json",
    "*.safetensors",
    "tokenizer*",
    "*.model",
    "*.tiktoken",
    "*.txt",
    "*.jinja",
)
"""What a Hub download fetches: configs, safetensors shards and the tokenizer (never pickles or
code)."""
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]{0,95}/[\w.-]{1,96}")
"""``org/name``: what :func:`resolve_model` takes for a Hub repository id."""
_TRUE = ("1", "on", "yes", "true")


def _hub_offline() -> bool:
    """``HF_HUB_OFFLINE`` (read now, so a setting made after import counts)."""
    value = os.environ.get("HF_HUB_OFFLINE")
    if value is not None:
        return value.strip().lower() in _TRUE
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE)


def _hub_cache() -> str:
    """The Hub cache ``snapshot_download`` uses: ``HF_HUB_CACHE``, else ``HF_HOME/hub``, else
    huggingface_hub's default (read now, so a setting made after import counts)."""
    if os.environ.get("HF_HUB_CACHE"):
        return os.environ["HF_HUB_CACHE"]
    if os.environ.get("HF_HOME"):
        return os.path.join(os.environ["HF_HOME"], "hub")
    from huggingface_hub import constants

    return str(constants.HF_HUB_CACHE)


def _download(repo_id: str, revision: str | None) -> Path:
    """A Hub model's snapshot directory: from the local cache, else downloaded into it."""
    try:
        from huggingface_hub import snapshot_download
        from huggingface_hub.errors import (
            GatedRepoError,
            HFValidationError,
            LocalEntryNotFoundError,
            RepositoryNotFoundError,
            RevisionNotFoundError,
        )
    except ImportError as exc:  # pragma: no cover - a dependency of transformers
        raise ImportError(
            f"load: {repo_id!r} names a Hub model, which needs huggingface_hub"
        ) from exc
    offline, cache = _hub_offline(), _hub_cache()
    at = f" at revision {revision!r}" if revision else ""
    try:
        found = snapshot_download(
            repo_id,
            revision=revision,
            allow_patterns=list(HUB_FILES),
            cache_dir=cache,
            local_files_only=offline,
        )
    except HFValidationError as exc:
        raise ValueError(f"load: {repo_id!r} is not a Hub model id ({exc})") from None
    except (RepositoryNotFoundError, GatedRepoError) as exc:  # Gated is a RepositoryNotFound
        raise FileNotFoundError(
            f"load: no Hub model {repo_id!r}{at} that this account can read "
            f"({type(exc).__name__}), and no local directory of that name"
        ) from None
    except RevisionNotFoundError:
        raise FileNotFoundError(
            f"load: Hub model {repo_id!r} has no revision {revision!r}"
        ) from None
    except LocalEntryNotFoundError:
        why = "HF_HUB_OFFLINE is set" if offline else "the Hub could not be reached"
        raise FileNotFoundError(
            f"load: {repo_id!r}{at} is neither a local directory nor in the Hub cache {cache}, "
            f"and {why}; download it (huggingface-cli download {repo_id}) or pass a directory"
        ) from None
    return Path(found)


def resolve_model(name: str | os.PathLike[str], *, revision: str | None = None) -> Path:
    """The local directory a model name stands for.

    * ``"tiny"``: the built-in tiny Llama (:data:`floatxq.tiny.TINY_LLAMA_DIR`);
    * an existing path (or one an interrupted save can restore): itself;
    * a string ``org/name`` that is no local path: a Hugging Face Hub model, taken from the
      local Hub cache (``HF_HUB_CACHE`` / ``HF_HOME``) or downloaded into it
      (``huggingface_hub.snapshot_download`` of :data:`HUB_FILES` only; nothing is downloaded
      when ``HF_HUB_OFFLINE=1``).

    ``revision`` (a branch, tag or commit) applies to Hub models only.

    Raises:
      CheckpointError (a ValueError): a path that does not exist and is no Hub id.
      ValueError: an invalid Hub id, or ``revision`` with a local model.
      FileNotFoundError: a Hub model that is not in the cache (offline), does not exist, or
        lacks the revision; the id and the cache are named.

    Numerics: none.
    """
    text = os.fspath(name)
    if isinstance(name, str) and text == TINY_NAME:
        from floatxq.tiny import TINY_LLAMA_DIR

        path = TINY_LLAMA_DIR
    else:
        path = Path(text)
        if not os.path.lexists(path) and recover_interrupted_save(path):
            warnings.warn(
                f"load: {path} was missing after an interrupted save; its previous contents "
                f"were restored from the save's hidden backup",
                UserWarning,
                stacklevel=3,
            )
        if not os.path.lexists(path) and isinstance(name, str) and _HUB_ID.fullmatch(text):
            return _download(text, revision)
        if not os.path.lexists(path):
            raise CheckpointError(
                f"load: {text} is not a model directory (no such path), nor 'tiny' or a Hub "
                f"model id 'org/name'"
            )
    if revision is not None:
        raise ValueError(
            f"load: revision={revision!r} applies to Hub models; {text} is a local directory"
        )
    return path


def _as_config(value: Any) -> FP8Config | GPTQConfig | NVFP4Config:
    if isinstance(value, (FP8Config, GPTQConfig, NVFP4Config)):
        return value
    if isinstance(value, Mapping):
        method = payload_method(value) or METHOD.FP8.value
        if method == METHOD.GPTQ:
            return gptq_config_from_payload(value)
        if method == METHOD.NVFP4:
            return nvfp4_config_from_payload(value)
        if method != METHOD.FP8:
            raise ValueError(
                f"load: quantize_config method {method!r} is not supported; accepted: 'fp8', "
                f"'gptq', 'nvfp4'"
            )
        return fp8_config_from_payload(value)
    raise TypeError(
        f"load: quantize_config must be an FP8Config, a GPTQConfig, an NVFP4Config, a payload "
        f"mapping of one of them or None, got {type(value).__name__}"
    )


def load(
    model_or_path: nn.Module | str | os.PathLike[str],
    *,
    quantize_config: FP8Config | GPTQConfig | NVFP4Config | Mapping[str, Any] | None = None,
    device: str | torch.device | None = None,
    dtype: torch.dtype | None = None,
    backend: str | BACKEND = "auto",
    revision: str | None = None,
    offload: str | None = None,
) -> QuantizedModel:
    """Load a model to quantize, a quantized checkpoint to run, or a native source to requantize.

    Args:
      model_or_path: an ``nn.Module`` (used as is, not copied), a local Hugging Face model
        directory, ``"tiny"`` (the built-in tiny Llama) or a Hub id ``"org/name"`` (from the
        local Hub cache, else downloaded: :func:`resolve_model`). A directory holding a quantized
        checkpoint (floatxq's or another tool's, see ``docs/interop.md``) is rebuilt from its
        files: its quantized modules get the saved bytes.
      quantize_config: an ``FP8Config``, ``GPTQConfig`` or ``NVFP4Config`` (or a payload of the
        first two, see
        :mod:`floatxq.interop.payload`) for :meth:`QuantizedModel.quantize`. Given a native
        FP8 / NVFP4 checkpoint, a ``GPTQConfig`` requantizes it: the source modules keep their
        bytes, run their own forward for the calibration capture and are decoded one at a time
        for their solve. Ignored with a warning for any other quantized checkpoint.
      device: where the model lives. GPTQ keeps the model on CPU while it works and uses this
        device for one decoder layer at a time, then moves the result here.
      dtype: dtype of the unquantized parameters (default: the checkpoint's / the model's).
      backend: ``"auto"``, ``"fp8_torch"`` (FP8) or ``"gptq_torch"`` (GPTQ W4A16);
        ``"gptq_w4afp8"`` / ``"gptq_w4a_nvfp4"`` run a GPTQ checkpoint (4-bit, groups of 128,
        symmetric, no ``desc_act``) as ``W4AFP8Linear`` / ``W4ANVFP4Linear`` modules (FP8
        per-token / NVFP4 activations); ``"mlx"`` converts a saved FP8 (or unquantized) Llama,
        Mistral, Qwen2 or Qwen3 checkpoint to MLX (``floatxq.mlx.convert_to_mlx``; ``device``
        None, ``"mps"``, ``"gpu"`` or ``"cpu"``). An activation policy binds its backend
        (:func:`~floatxq.config.backend_for_activation`); a loaded W4A checkpoint gets its saved
        activation scales and, on a Llama, the activation stream.
      revision: a Hub model's branch, tag or commit (Hub ids only).
      offload: ``"disk"``: build the model without weights and read each decoder layer from
        the checkpoint's shards when ``quantize(out=...)`` reaches it, writing the result as
        layers finish (``docs/offload.md``; a plain checkpoint directory and a
        ``quantize_config`` needed).

    Raises:
      CheckpointError (a ValueError): missing/corrupt/truncated files, inconsistent tensors, a
        path that does not exist and is no Hub id.
      ValueError: unknown method, or a backend that cannot run the model. TypeError: wrong kind.
      FileNotFoundError: a Hub id not in the local cache when offline, or not on the Hub.

    Numerics: loading is bit-exact; quantization as :func:`floatxq.quantize_fp8_weight` or
    :func:`floatxq.gptq_solve`.
    """
    if _is_mlx(backend):
        if isinstance(model_or_path, (str, os.PathLike)):
            model_or_path = resolve_model(model_or_path, revision=revision)
        return _load_mlx(model_or_path, quantize_config=quantize_config, device=device, dtype=dtype)
    dev = torch.device(device) if device is not None else None
    config = _as_config(quantize_config) if quantize_config is not None else None
    if offload is not None:
        return _load_offloaded(model_or_path, config, offload, dev, dtype, backend, revision)
    gptq = isinstance(config, GPTQConfig)
    if isinstance(model_or_path, nn.Module):
        chosen = _backend_for(backend, config)
        model = model_or_path.to(dev) if dev is not None and not gptq else model_or_path
        already = any(isinstance(m, _quantized_types()) for m in model.modules())
        return QuantizedModel(
            model,
            quantize_config=config,
            backend=chosen,
            quantized=already and not gptq,
            device=dev,
        )
    if not isinstance(model_or_path, (str, os.PathLike)):
        raise TypeError(
            f"load: model_or_path must be an nn.Module or a directory path, got "
            f"{type(model_or_path).__name__}"
        )
    path = resolve_model(model_or_path, revision=revision)
    if not path.is_dir():
        raise CheckpointError(f"load: {path} is not a model directory (it is a file)")
    payload = read_json(path / CONFIG_FILE, what="load")
    model, qconfig, decision, activation_bits = _load_quantized(
        path, payload, device=None if gptq else dev, dtype=dtype, weight_only=gptq
    )
    if model is not None and gptq and not isinstance(qconfig, GPTQConfig):
        # A native FP8 / NVFP4 source: a fresh GPTQ solve of its decoded weights.
        source = QuantizedModel(
            model,
            quantize_config=config,
            backend=_backend_for(backend, config),
            source=path,
            device=dev,
        )
        source.layout = decision
        return source
    if model is not None:
        activation = getattr(qconfig, "activation", None)
        if activation is not None:
            try:
                chosen = backend_for_activation(activation, _backend_name(backend))
            except ValueError as exc:
                raise ValueError(f"load: {path}: {exc}") from None
        else:
            chosen = _resolve_backend(backend, qconfig, checkpoint=True)
        try:
            if chosen in _W4A_BACKENDS:
                install_w4a_modules(
                    model, chosen, activation=activation, scale_bits=activation_bits
                )
            if activation is not None:
                install_activation_stream(model, activation)
        except ValueError as exc:
            if activation is None or isinstance(exc, CheckpointError):
                raise  # a backend the caller chose, which this checkpoint cannot run
            raise CheckpointError(
                f"load: {path}: the activation policy its {QUANTIZE_CONFIG_FILE} and "
                f"{CONFIG_FILE} declare ('activation') does not fit its model: {exc}"
            ) from None
        if quantize_config is not None:
            warnings.warn(
                f"load: {path} is already quantized; quantize_config is ignored",
                UserWarning,
                stacklevel=2,
            )
        loaded = QuantizedModel(
            model, quantize_config=qconfig, backend=chosen, quantized=True, source=path, device=dev
        )
        loaded.layout = decision
        return loaded
    chosen = _backend_for(backend, config)
    model = _load_plain(path, device=None if gptq else dev, dtype=dtype)
    loaded = QuantizedModel(model, quantize_config=config, backend=chosen, source=path, device=dev)
    return loaded


def _load_offloaded(
    model_or_path: Any, config: Any, offload: Any, dev: Any, dtype: Any, backend: Any, revision: Any
) -> QuantizedModel:
    """``load(..., offload="disk")``: the shell of a plain checkpoint, its long-lived pieces
    read (:func:`~floatxq.lifecycle.offload.load_offloaded`)."""
    from floatxq.lifecycle.offload import OFFLOAD_MODES, load_offloaded

    if offload not in OFFLOAD_MODES:
        raise ValueError(
            f"load: offload must be None or one of {list(OFFLOAD_MODES)}, got {offload!r}"
        )
    if not isinstance(model_or_path, (str, os.PathLike)):
        raise TypeError(
            f"load: offload={offload!r} reads a checkpoint directory layer by layer; got "
            f"{type(model_or_path).__name__} (an nn.Module is already in memory)"
        )
    if config is None:
        raise ValueError(f"load: offload={offload!r} needs a quantize_config (it only quantizes)")
    path = resolve_model(model_or_path, revision=revision)
    payload = read_json(path / CONFIG_FILE, what="load")
    if "quantization_config" in payload:
        raise ValueError(
            f"load: offload={offload!r} quantizes a plain checkpoint; {path} is already "
            f"quantized (config.json has a quantization_config)"
        )
    shell, source = load_offloaded(path, dtype=dtype)
    loaded = QuantizedModel(
        shell, quantize_config=config, backend=_backend_for(backend, config), source=path,
        device=dev,
    )  # fmt: skip
    loaded.offload = source
    return loaded


__all__ = ["HUB_FILES", "TINY_NAME", "load", "resolve_model"]
