"""Config values: the ``str`` enums METHOD, FORMAT, BACKEND, read-only JSON-like values and the
small scalar checks every config shares.

Nothing here touches tensor data. Names in this file are private to :mod:`floatxq.config` except
the enums, which :mod:`floatxq` re-exports.
"""

import enum
from collections.abc import Iterator, Mapping
from typing import Any

# --------------------------------------------------------------------------------------------
# Enums
# --------------------------------------------------------------------------------------------


class _StrEnum(str, enum.Enum):
    """A ``str`` enum whose ``str()`` and f-string form is the bare value."""

    def __str__(self) -> str:
        return str.__str__(self)


class METHOD(_StrEnum):
    """Quantization method. ``METHOD.FP8 == "fp8"``; ``str(METHOD.GPTQ) == "gptq"``."""

    FP8 = "fp8"
    GPTQ = "gptq"
    NVFP4 = "nvfp4"


class FORMAT(_StrEnum):
    """Checkpoint format family. ``FORMAT.FP8`` also names the default FP8 dtype (E4M3)."""

    FP8 = "fp8"
    GPTQ = "gptq"
    GPTQ_V2 = "gptq_v2"


class BACKEND(_StrEnum):
    """Inference backend: ``AUTO`` lets the loader pick, ``FP8_TORCH`` runs ``TorchFP8Linear``,
    ``GPTQ_TORCH`` runs ``GPTQLinear`` (W4A16: INT weights decoded for each call),
    ``GPTQ_W4AFP8`` runs ``W4AFP8Linear`` (symmetric 4-bit g128 GPTQ weights × per-token FP8
    activations; chosen explicitly when loading a GPTQ checkpoint, never by ``AUTO``),
    ``GPTQ_W4A_NVFP4`` runs ``W4ANVFP4Linear`` (the same GPTQ weights × NVFP4 activations; also
    chosen explicitly, never by ``AUTO``), ``MLX`` converts a saved FP8 Llama checkpoint whole to
    an MLX model (``floatxq.mlx``; explicit only).

    Only backends with a runtime in floatxq are members; others join when their runtime lands.
    """

    AUTO = "auto"
    FP8_TORCH = "fp8_torch"
    GPTQ_TORCH = "gptq_torch"
    GPTQ_W4AFP8 = "gptq_w4afp8"
    GPTQ_W4A_NVFP4 = "gptq_w4a_nvfp4"
    MLX = "mlx"


# --------------------------------------------------------------------------------------------
# Immutable JSON-like values (meta, rule overrides)
# --------------------------------------------------------------------------------------------


class _FrozenMapping(Mapping[str, Any]):
    """Read-only, hashable ``str``-keyed mapping; compares equal to a dict with the same items."""

    __slots__ = ("_data",)

    def __init__(self, data: Mapping[str, Any]) -> None:
        self._data = dict(data)

    def __getitem__(self, key: object) -> Any:
        return self._data[key]  # type: ignore[index]

    def __iter__(self) -> Iterator[str]:
        return iter(self._data)

    def __len__(self) -> int:
        return len(self._data)

    def __hash__(self) -> int:
        return hash(frozenset(self._data.items()))

    def __repr__(self) -> str:
        return f"FrozenMapping({self._data!r})"


_JSON_KINDS = "None, bool, int, float, str, a mapping with str keys, or a list/tuple of these"


def _freeze(value: Any, *, where: str) -> Any:
    """A hashable copy of a JSON-like value: mappings become read-only, lists become tuples."""
    if value is None or isinstance(value, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)  # str enums become their plain value
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        return float(value)
    if isinstance(value, Mapping):
        items = {}
        for key, item in value.items():
            if not isinstance(key, str):
                raise TypeError(
                    f"{where}: mapping keys must be strings, got {type(key).__name__} {key!r}"
                )
            items[str.__str__(key)] = _freeze(item, where=f"{where}[{key!r}]")
        return _FrozenMapping(items)
    if isinstance(value, (list, tuple)):
        return tuple(_freeze(item, where=f"{where}[{i}]") for i, item in enumerate(value))
    raise TypeError(f"{where}: expected {_JSON_KINDS}; got {type(value).__name__} {value!r}")


def _frozen_meta(meta: Any) -> Mapping[str, Any] | None:
    """``meta`` stored read-only; None and ``{}`` both become None."""
    if meta is not None and not isinstance(meta, Mapping):
        raise TypeError(
            f"meta: expected a mapping with str keys or None, got {type(meta).__name__} {meta!r}"
        )
    frozen = _freeze(meta, where="meta")
    return frozen if frozen else None


# --------------------------------------------------------------------------------------------
# Scalar validators (one each, shared by both configs)
# --------------------------------------------------------------------------------------------


def _check_bool(value: Any, *, where: str) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{where}: expected a bool, got {type(value).__name__} {value!r}")
    return value


def _check_int(value: Any, *, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{where}: expected an int, got {type(value).__name__} {value!r}")
    return int(value)


def _check_real(value: Any, *, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{where}: expected a float, got {type(value).__name__} {value!r}")
    value = float(value)
    if value != value or value in (float("inf"), float("-inf")):
        raise ValueError(f"{where}: expected a finite number, got {value!r}")
    return value
