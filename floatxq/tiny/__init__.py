"""The embedded default model: a small byte-level Llama trained on the standard library's docs.

:mod:`floatxq.tiny.corpus` builds the corpus and its byte tokens (torch only);
:mod:`floatxq.tiny.model` holds the architecture, the loader and perplexity (transformers).
"""

from floatxq.tiny.corpus import (
    SEPARATOR_ID,
    SKIPPED_TREES,
    SPLIT_PERCENT,
    SPLITS,
    VOCAB_SIZE,
    StdlibDocument,
    calibration_samples,
    decode_tokens,
    encode_text,
    split_of,
    stdlib_corpus,
    stdlib_documents,
    stdlib_tokens,
    token_windows,
)
from floatxq.tiny.model import (
    TINY_LLAMA_DIR,
    TINY_LLAMA_TRAIN_COMMAND,
    load_tiny_llama,
    perplexity,
    tiny_llama_config,
)

__all__ = [
    "SEPARATOR_ID",
    "SKIPPED_TREES",
    "SPLITS",
    "SPLIT_PERCENT",
    "TINY_LLAMA_DIR",
    "TINY_LLAMA_TRAIN_COMMAND",
    "VOCAB_SIZE",
    "StdlibDocument",
    "calibration_samples",
    "decode_tokens",
    "encode_text",
    "load_tiny_llama",
    "perplexity",
    "split_of",
    "stdlib_corpus",
    "stdlib_documents",
    "stdlib_tokens",
    "tiny_llama_config",
    "token_windows",
]
