"""Quality of a quantized causal LM: perplexity, and KL divergence / top-1 agreement vs a reference.

These are the numbers that say whether a quantization is good on a *trained* model: perplexity on
held-out text, and how far the next-token distributions moved from the unquantized model's.
"""

import math
from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import nn

from floatxq._typing import Integer, Tensor


class EvalReport(NamedTuple):
    """Next-token quality over ``tokens`` predicted positions."""

    perplexity: float
    """``exp(mean next-token NLL)``."""
    kl_divergence: float | None
    """Mean ``KL(reference ‖ model)`` per position in nats (None without a reference)."""
    top1_agreement: float | None
    """Share of positions where the argmax matches the reference's (None without a reference)."""
    tokens: int
    reference_perplexity: float | None = None
    """The reference's own perplexity on the same windows (None without a reference)."""

    def to_dict(self) -> dict[str, float | int | None]:
        """The report as a JSON-ready dict: each field's name and value."""
        return dict(self._asdict())


def _logits(model: nn.Module, ids: Tensor) -> Tensor:
    device = next(model.parameters()).device
    out = model(input_ids=ids.to(device))
    logits = out.logits if hasattr(out, "logits") else out
    return logits[:, :-1].to(torch.float32)


def _vocab_size(model: nn.Module) -> int | None:
    """The width of ``model``'s logits as far as it says: its output embedding's
    ``out_features``, else its config's ``vocab_size``; None when neither is known."""
    get_head = getattr(model, "get_output_embeddings", None)
    head = get_head() if callable(get_head) else None
    width = getattr(head, "out_features", None)
    if isinstance(width, int) and not isinstance(width, bool):
        return width
    width = getattr(getattr(model, "config", None), "vocab_size", None)
    return width if isinstance(width, int) and not isinstance(width, bool) else None


def _require_same_vocab(model_vocab: int | None, reference_vocab: int | None) -> None:
    if model_vocab is not None and reference_vocab is not None and model_vocab != reference_vocab:
        raise ValueError(
            f"evaluate_lm: the model has a vocabulary of {model_vocab} tokens (vocab_size) and "
            f"the reference {reference_vocab}; KL and top-1 compare next-token distributions, "
            f"so the reference must be a model of the same vocabulary (the same tokenizer)"
        )


def reference_logprobs(
    reference: nn.Module,
    windows: Integer[Tensor, "windows length"],
    *,
    batch_size: int = 8,
    progress: Callable[[int], None] | None = None,
) -> list[Tensor]:
    """The reference model's next-token log-probabilities per batch (compute once, compare often).

    ``progress``, when given, is called with each batch's number of windows after its forward.

    Numerics: FP32 log-softmax of the logits.
    """
    out = []
    with torch.inference_mode():
        for batch in windows.split(batch_size):
            out.append(torch.log_softmax(_logits(reference, batch), dim=-1).cpu())
            if progress is not None:
                progress(batch.shape[0])
    return out


def evaluate_lm(
    model: nn.Module,
    windows: Integer[Tensor, "windows length"],
    *,
    reference: nn.Module | list[Tensor] | None = None,
    batch_size: int = 8,
    progress: Callable[[int], None] | None = None,
) -> EvalReport:
    """Perplexity of ``model`` on ``windows`` and, with ``reference``, KL, top-1 agreement and
    the reference's own perplexity.

    Every position but the first of each window is predicted from the tokens before it.
    ``reference`` is a model or its :func:`reference_logprobs` for the same windows and batch size.
    ``progress``, when given, is called with each batch's number of windows after its forward
    (the reference model's batches included).

    Raises:
      ValueError: empty windows, ``length < 2`` or ``batch_size < 1``; a reference of another
        vocabulary (both sizes named, checked before any forward when both models say theirs,
        else on the first batch's logits).

    Numerics: FP32 log-softmax of the logits; sums in float64; KL as
    ``Σ p_ref · (log p_ref − log p_model)``.
    """
    if windows.ndim != 2 or windows.shape[0] < 1 or windows.shape[1] < 2:
        raise ValueError(
            f"evaluate_lm: windows must be (windows ≥ 1, length ≥ 2) ids, got "
            f"{tuple(windows.shape)}"
        )
    if batch_size < 1:
        raise ValueError(f"evaluate_lm: batch_size must be ≥ 1, got {batch_size}")
    if isinstance(reference, nn.Module):
        _require_same_vocab(_vocab_size(model), _vocab_size(reference))
    refs = (
        reference_logprobs(reference, windows, batch_size=batch_size, progress=progress)
        if isinstance(reference, nn.Module)
        else reference
    )
    batches = windows.split(batch_size)
    if refs is not None and len(refs) != len(batches):
        raise ValueError(
            f"evaluate_lm: {len(refs)} reference batches for {len(batches)} batches of windows"
        )
    nll = kl = ref_nll = 0.0
    agree = count = 0
    with torch.inference_mode():
        for i, batch in enumerate(batches):
            targets = batch[:, 1:]
            logp = torch.log_softmax(_logits(model, batch), dim=-1)
            nll -= float(logp.gather(-1, targets.to(logp.device)[..., None]).double().sum())
            count += targets.numel()
            if refs is not None:
                ref = refs[i].to(logp.device)
                if ref.shape != logp.shape:
                    _require_same_vocab(logp.shape[-1], ref.shape[-1])
                    raise ValueError(
                        f"evaluate_lm: reference batch {i} has log-probabilities of shape "
                        f"{tuple(ref.shape)}, the model's are {tuple(logp.shape)}; give the "
                        f"reference's for the same windows and batch size"
                    )
                kl += float((ref.exp() * (ref - logp)).sum(dim=-1).double().sum())
                agree += int((ref.argmax(-1) == logp.argmax(-1)).sum())
                picked = ref.gather(-1, targets.to(ref.device)[..., None])
                ref_nll -= float(picked.double().sum())
            if progress is not None:
                progress(batch.shape[0])
    return EvalReport(
        perplexity=math.exp(nll / count),
        kl_divergence=kl / count if reference is not None else None,
        top1_agreement=agree / count if reference is not None else None,
        tokens=count,
        reference_perplexity=math.exp(ref_nll / count) if reference is not None else None,
    )


def _encoder(model_dir: str | None, vocab_size: int) -> Callable[[str], list[int]]:
    """How text becomes ``model``'s token ids: its bytes for a byte-vocabulary model
    (``vocab_size == 256``), else the tokenizer in ``model_dir`` (loaded locally)."""
    if vocab_size == 256:
        return lambda text: list(text.encode("utf-8"))
    if model_dir is None:
        raise ValueError(
            f"eval: a model with vocab_size {vocab_size} needs its tokenizer; pass a model "
            f"directory that holds one"
        )
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    except (OSError, ValueError) as exc:
        raise ValueError(f"eval: no usable tokenizer in {model_dir} ({exc})") from None
    return lambda text: list(tokenizer(text, add_special_tokens=False)["input_ids"])


def _windows(
    ids: list[int], *, seq_len: int, max_windows: int, vocab_size: int, what: str, where: str
) -> Tensor:
    """``ids`` cut into ``seq_len`` windows (the ragged tail dropped), at most ``max_windows``
    of them evenly spaced (window ``(i * n) // max_windows`` of ``n``)."""
    count = len(ids) // seq_len
    if count == 0:
        raise ValueError(
            f"eval: {what} gives {len(ids)} tokens, fewer than one window of {seq_len} (--seq-len)"
        )
    windows = torch.tensor(ids[: count * seq_len], dtype=torch.int64).reshape(count, seq_len)
    if max_windows < count:
        windows = windows[(torch.arange(max_windows) * count) // max_windows]
    if int(windows.max()) >= vocab_size:
        raise ValueError(
            f"eval: the tokenizer in {where} produces ids up to {int(windows.max())}, beyond "
            f"the model's vocab_size {vocab_size}"
        )
    return windows.contiguous()


def heldout_windows(
    model_dir: str | None,
    *,
    vocab_size: int,
    seq_len: int = 256,
    max_windows: int = 64,
) -> Tensor:
    """Held-out evaluation windows for a model: the stdlib evaluation split in its own tokens.

    A byte-vocabulary model (``vocab_size == 256``, like the built-in tiny Llama) reads the split's
    bytes; any other model needs a tokenizer in ``model_dir`` (loaded locally with
    ``AutoTokenizer``), which encodes the split's text. Windows are evenly spaced over the split.

    Raises:
      ValueError: a non-byte model without a local tokenizer, or too little text for one window.

    Numerics: exact token ids.
    """
    from floatxq.tiny import stdlib_corpus, token_windows

    if vocab_size == 256:
        return token_windows("evaluation", seq_len=seq_len, max_windows=max_windows)
    encode = _encoder(model_dir, vocab_size)
    documents = stdlib_corpus("evaluation").decode("utf-8", errors="replace").split("\x00")
    ids = [t for doc in documents if doc for t in encode(doc)]
    return _windows(
        ids,
        seq_len=seq_len,
        max_windows=max_windows,
        vocab_size=vocab_size,
        what="the evaluation split",
        where=str(model_dir),
    )


def text_windows(
    text: str,
    model_dir: str | None,
    *,
    vocab_size: int,
    seq_len: int = 256,
    max_windows: int = 64,
) -> Tensor:
    """Evaluation windows of the user's own ``text`` in a model's tokens.

    Tokenized as :func:`heldout_windows` tokenizes the held-out split (bytes for a
    byte-vocabulary model, else the tokenizer in ``model_dir``), cut into ``seq_len``-token
    windows (the ragged tail dropped), at most ``max_windows`` of them evenly spaced.

    Raises:
      ValueError: a non-byte model without a local tokenizer, or a text too short for one window.

    Numerics: exact token ids.

    Example:
      >>> text_windows("abcdefgh", None, vocab_size=256, seq_len=4).tolist()
      [[97, 98, 99, 100], [101, 102, 103, 104]]
    """
    ids = _encoder(model_dir, vocab_size)(text)
    return _windows(
        ids,
        seq_len=seq_len,
        max_windows=max_windows,
        vocab_size=vocab_size,
        what="the text",
        where=str(model_dir),
    )
