"""The built-in corpus: the running Python's standard-library documentation as byte tokens.

Every Python installation carries it, so the tiny model can be trained, calibrated and evaluated
without downloads. Source files under ``sysconfig.get_paths()["stdlib"]`` are *parsed* with
``ast`` (never imported: some modules have import side effects), and one document per module holds
its module, class and function docstrings in source order, joined by blank lines; the module
``pydoc_data.topics`` contributes its topic texts (the language reference pages ``help()`` shows).
Trees ``test``, ``tests``, ``idlelib``, ``lib2to3``, ``turtledemo`` and ``site-packages`` are
skipped, as are files that fail to parse and path parts that are not identifiers.

Splits: a module's dotted name decides its split through ``sha256(name)`` (80% train, 10%
calibration, 10% evaluation), so splits never share a module and a module lands in the same split
on every Python version (the *texts* follow the running version). Documents are sorted by name.

Tokens: byte-level, vocabulary 256. Ids 0..255 are the bytes of the UTF-8 text; byte 0 (NUL,
:data:`SEPARATOR_ID`) precedes every document and never occurs inside one (NUL is stripped from
docstrings), so it acts as the BOS/EOS/separator token without growing the vocabulary past 256
(which keeps ``lm_head`` a multiple of 128 rows).
"""

import ast
import functools
import hashlib
import os
import sysconfig
import warnings
from pathlib import Path
from typing import NamedTuple

import torch

from floatxq._typing import Int64, Integer, Tensor

__all__ = [
    "SEPARATOR_ID",
    "SKIPPED_TREES",
    "SPLITS",
    "SPLIT_PERCENT",
    "VOCAB_SIZE",
    "StdlibDocument",
    "calibration_samples",
    "decode_tokens",
    "encode_text",
    "split_of",
    "stdlib_corpus",
    "stdlib_documents",
    "stdlib_tokens",
    "token_windows",
]

VOCAB_SIZE: int = 256
"""Byte-level vocabulary: token id ``i`` is byte ``i``."""
SEPARATOR_ID: int = 0
"""The NUL byte, placed before every document; never inside one."""
SPLITS: tuple[str, ...] = ("train", "calibration", "evaluation")
SPLIT_PERCENT: tuple[int, ...] = (80, 10, 10)
"""Share of the hash buckets (0..99) per split, in :data:`SPLITS` order."""
SKIPPED_TREES: frozenset[str] = frozenset(
    {"test", "tests", "idlelib", "lib2to3", "turtledemo", "site-packages", "__pycache__"}
)
"""Directory names never descended into (test suites, IDLE, 2to3, turtle demos, third party)."""

_TOPICS_MODULE = "pydoc_data.topics"


class StdlibDocument(NamedTuple):
    """One module's documentation text and the split its name hashes to."""

    name: str
    """Dotted module name (``"email.mime.text"``; a package's ``__init__`` is the package)."""
    split: str
    """``"train"``, ``"calibration"`` or ``"evaluation"`` (:func:`split_of` of ``name``)."""
    text: str
    """Docstrings (or topic texts) in source order, joined by blank lines; never contains NUL."""


# ----------------------------------------------------------------------------------------------
# Splits
# ----------------------------------------------------------------------------------------------


def _require_split(split: str, *, where: str) -> str:
    if split not in SPLITS:
        raise ValueError(f"{where}: split must be one of {list(SPLITS)}, got {split!r}")
    return split


def split_of(name: str) -> str:
    """The split of a module: bucket ``int(sha256(name)[:8]) % 100`` against :data:`SPLIT_PERCENT`.

    Args:
      name: a dotted module name.

    Returns:
      ``"train"``, ``"calibration"`` or ``"evaluation"``; the same on every Python version.

    Numerics: exact integer hashing of the UTF-8 name (first 8 digest bytes, big-endian).

    Example:
      >>> split_of("json"), split_of("os.path")
      ('train', 'evaluation')
    """
    if not isinstance(name, str) or not name:
        raise ValueError(f"split_of: name must be a non-empty module name, got {name!r}")
    bucket = int.from_bytes(hashlib.sha256(name.encode("utf-8")).digest()[:8], "big") % 100
    upper = 0
    for split, percent in zip(SPLITS[:-1], SPLIT_PERCENT[:-1], strict=True):
        upper += percent
        if bucket < upper:
            return split
    return SPLITS[-1]


# ----------------------------------------------------------------------------------------------
# Parsing the standard library (cached per root)
# ----------------------------------------------------------------------------------------------


_STATEMENT_LIKE = (ast.stmt, ast.excepthandler, ast.match_case)


def _docstrings(tree: ast.Module) -> list[str]:
    """Module, class and function docstrings in source order (nested definitions included).

    Only statements are descended into: a ``def``/``class`` never sits inside an expression.
    """
    found: list[str] = []
    stack: list[ast.AST] = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            doc = ast.get_docstring(node, clean=True)
            if doc:
                found.append(doc)
        children = [c for c in ast.iter_child_nodes(node) if isinstance(c, _STATEMENT_LIKE)]
        stack.extend(reversed(children))
    return found


def _topic_texts(tree: ast.Module) -> list[str]:
    """The string values of ``pydoc_data.topics``' module-level ``topics = {...}`` literal."""
    texts: list[str] = []
    for node in tree.body:
        if (
            isinstance(node, ast.Assign)
            and any(isinstance(t, ast.Name) and t.id == "topics" for t in node.targets)
            and isinstance(node.value, ast.Dict)
        ):
            texts.extend(
                v.value
                for v in node.value.values
                if isinstance(v, ast.Constant) and isinstance(v.value, str)
            )
    return texts


def _module_name(relative: Path) -> str | None:
    """``a/b/c.py`` → ``a.b.c``; ``a/b/__init__.py`` → ``a.b``; None if not importable-shaped."""
    parts = [*relative.parent.parts, relative.stem]
    if parts[-1] == "__init__":
        parts.pop()
    if not parts or not all(p.isidentifier() for p in parts):
        return None
    return ".".join(parts)


def _read_document(path: Path, name: str) -> str | None:
    try:
        source = path.read_bytes()
        with warnings.catch_warnings():  # e.g. invalid escape sequences on newer Pythons
            warnings.simplefilter("ignore", SyntaxWarning)
            tree = ast.parse(source, filename=str(path))
    except (OSError, SyntaxError, ValueError, RecursionError):
        return None  # unreadable or unparsable for this Python (e.g. a newer grammar): skip
    texts = _topic_texts(tree) if name == _TOPICS_MODULE else _docstrings(tree)
    kept = [clean for t in texts if (clean := t.replace("\x00", "").strip())]
    return "\n\n".join(kept) or None


@functools.lru_cache(maxsize=16)
def _parse_stdlib(root: str, split: str | None) -> tuple[StdlibDocument, ...]:
    """The documents of ``split`` (None: all): a module's split is decided from its name, so
    only the files of that split are parsed."""
    base = Path(root)
    if not base.is_dir():
        raise FileNotFoundError(f"stdlib_documents: root {root!r} is not a directory")
    documents: dict[str, StdlibDocument] = {}
    for dirpath, dirnames, filenames in os.walk(base):
        dirnames[:] = sorted(d for d in dirnames if d not in SKIPPED_TREES and d.isidentifier())
        for filename in sorted(filenames):
            if not filename.endswith(".py"):
                continue
            path = Path(dirpath, filename)
            name = _module_name(path.relative_to(base))
            if name is None or name in documents:
                continue
            if split is not None and split_of(name) != split:
                continue
            text = _read_document(path, name)
            if text is not None:
                documents[name] = StdlibDocument(name, split_of(name), text)
    return tuple(documents[name] for name in sorted(documents))


def _root_of(root: str | os.PathLike | None) -> str:
    return os.fspath(root) if root is not None else sysconfig.get_paths()["stdlib"]


def stdlib_documents(
    split: str | None = None, *, root: str | os.PathLike | None = None
) -> tuple[StdlibDocument, ...]:
    """The standard library's documentation, one :class:`StdlibDocument` per module, by name.

    Args:
      split: ``"train"``, ``"calibration"``, ``"evaluation"``, or None for all documents.
      root: the directory to read (default: the running Python's ``stdlib`` path).

    Returns:
      The documents of ``split`` sorted by module name; parsed once per root and process.

    Raises:
      ValueError: an unknown ``split``.
      FileNotFoundError: ``root`` is not a directory.

    Numerics: none (text); deterministic for a given Python installation.

    Example:
      >>> docs = stdlib_documents("evaluation")  # parses the stdlib once: about 2-3 s
      >>> docs == tuple(sorted(docs)) and all(d.split == "evaluation" for d in docs)
      True
    """
    if split is not None:
        _require_split(split, where="stdlib_documents")
    return _parse_stdlib(_root_of(root), split)


@functools.lru_cache(maxsize=12)
def _split_bytes(split: str, root: str) -> bytes:
    sep = bytes([SEPARATOR_ID])
    return b"".join(sep + d.text.encode("utf-8") for d in stdlib_documents(split, root=root))


def stdlib_corpus(split: str, *, root: str | os.PathLike | None = None) -> bytes:
    """A split's documents as one UTF-8 byte string, each document preceded by byte 0.

    Args:
      split: ``"train"``, ``"calibration"`` or ``"evaluation"``.
      root: the directory to read (default: the running Python's ``stdlib`` path).

    Returns:
      ``b"".join(b"\\x00" + text.encode("utf-8") for each document)`` (cached per process).

    Numerics: none (bytes); byte 0 appears exactly once per document, at its start.

    Example:
      >>> stdlib_corpus("calibration")[:1]
      b'\\x00'
    """
    return _split_bytes(_require_split(split, where="stdlib_corpus"), _root_of(root))


def _ids_of(data: bytes) -> Tensor:
    """Bytes as a fresh 1-D int64 tensor (``torch.frombuffer`` refuses an empty buffer)."""
    if not data:
        return torch.zeros(0, dtype=torch.int64)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).to(torch.int64)


def stdlib_tokens(split: str, *, root: str | os.PathLike | None = None) -> Int64[Tensor, " tokens"]:
    """A split's token stream: :func:`stdlib_corpus` as a fresh 1-D int64 tensor of byte ids.

    Numerics: exact (ids are the bytes, 0..255).

    Example:
      >>> stdlib_tokens("evaluation").dtype
      torch.int64
    """
    return _ids_of(stdlib_corpus(split, root=root))


# ----------------------------------------------------------------------------------------------
# Byte-level tokens
# ----------------------------------------------------------------------------------------------


def encode_text(text: str) -> Int64[Tensor, " tokens"]:
    """Token ids of a string: its UTF-8 bytes as a 1-D int64 tensor (no separator added).

    Args:
      text: any string without lone surrogates (UTF-8 cannot encode them: ``ValueError``).

    Numerics: exact; ``decode_tokens(encode_text(s)) == s`` for every encodable ``s``.

    Example:
      >>> encode_text("hé").tolist()
      [104, 195, 169]
    """
    if not isinstance(text, str):
        raise TypeError(f"encode_text: text must be a str, got {type(text).__name__}")
    return _ids_of(text.encode("utf-8"))  # UnicodeEncodeError (a ValueError): lone surrogates


def decode_tokens(ids: Integer[Tensor, " tokens"]) -> str:
    """Text of 1-D byte ids; invalid UTF-8 (e.g. model samples) decodes to U+FFFD.

    Args:
      ids: integer ids in ``0..255`` (byte 0, the separator, decodes to ``"\\x00"``).

    Raises:
      ValueError: an id outside ``0..255``.

    Numerics: exact inverse of :func:`encode_text` on valid UTF-8; ``errors="replace"`` otherwise.

    Example:
      >>> decode_tokens(torch.tensor([104, 195, 169]))
      'hé'
    """
    values = ids.tolist()
    if values and (min(values) < 0 or max(values) >= VOCAB_SIZE):
        raise ValueError(
            f"decode_tokens: ids must lie in 0..{VOCAB_SIZE - 1}, got range "
            f"{min(values)}..{max(values)}"
        )
    return bytes(values).decode("utf-8", errors="replace")


# ----------------------------------------------------------------------------------------------
# Windows and calibration samples
# ----------------------------------------------------------------------------------------------


def token_windows(
    split: str,
    *,
    seq_len: int,
    max_windows: int | None = None,
    root: str | os.PathLike | None = None,
) -> Int64[Tensor, "windows length"]:
    """Non-overlapping ``seq_len``-token windows of a split's stream (the ragged tail dropped).

    Args:
      split: ``"train"``, ``"calibration"`` or ``"evaluation"``.
      seq_len: tokens per window (≥ 2, so each window predicts at least one token).
      max_windows: keep at most this many, evenly spaced over the split (window
        ``(i * n) // max_windows`` of ``n``), so a subset still spans every module; None: all.
      root: the directory to read (default: the running Python's ``stdlib`` path).

    Returns:
      ``(windows, seq_len)`` int64 ids; window ``w`` is ``tokens[w*seq_len:(w+1)*seq_len]``.

    Raises:
      ValueError: an unknown split, ``seq_len < 2``, ``max_windows < 1``.

    Numerics: exact integer slicing; deterministic.

    Example:
      >>> token_windows("evaluation", seq_len=128, max_windows=4).shape
      torch.Size([4, 128])
    """
    where = "token_windows"
    _require_split(split, where=where)
    if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 2:
        raise ValueError(f"{where}: seq_len must be an int ≥ 2, got {seq_len!r}")
    if max_windows is not None and (
        isinstance(max_windows, bool) or not isinstance(max_windows, int) or max_windows < 1
    ):
        raise ValueError(f"{where}: max_windows must be None or an int ≥ 1, got {max_windows!r}")
    tokens = stdlib_tokens(split, root=root)
    count = tokens.numel() // seq_len
    windows = tokens[: count * seq_len].reshape(count, seq_len)
    if max_windows is not None and max_windows < count:
        keep = (torch.arange(max_windows) * count) // max_windows
        windows = windows[keep]
    return windows.contiguous()


def calibration_samples(
    *, num_samples: int, seq_len: int, root: str | os.PathLike | None = None
) -> list[Int64[Tensor, " length"]]:
    """Calibration inputs: ``num_samples`` evenly spaced windows of the calibration split.

    Args:
      num_samples: how many samples (≥ 1); the split must hold that many windows.
      seq_len: tokens per sample (≥ 2).
      root: the directory to read (default: the running Python's ``stdlib`` path).

    Returns:
      A list of 1-D int64 tensors of length ``seq_len`` (never from train or evaluation text).

    Raises:
      ValueError: bad sizes, or fewer than ``num_samples`` windows in the calibration split.

    Numerics: exact; deterministic (no random sampling).

    Example:
      >>> [s.shape for s in calibration_samples(num_samples=2, seq_len=64)]
      [torch.Size([64]), torch.Size([64])]
    """
    where = "calibration_samples"
    if isinstance(num_samples, bool) or not isinstance(num_samples, int) or num_samples < 1:
        raise ValueError(f"{where}: num_samples must be an int ≥ 1, got {num_samples!r}")
    windows = token_windows("calibration", seq_len=seq_len, max_windows=num_samples, root=root)
    if windows.shape[0] < num_samples:
        raise ValueError(
            f"{where}: the calibration split holds only {windows.shape[0]} windows of "
            f"seq_len={seq_len}, fewer than num_samples={num_samples}; lower either"
        )
    return list(windows.unbind(0))
