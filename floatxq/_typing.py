"""jaxtyping vocabulary shared by every floatxq module.

Annotations only: checking is switched on by the test run (pytest's
``--jaxtyping-packages=floatxq,beartype.beartype``) and costs nothing in production.

Result records are ``NamedTuple`` classes whose fields carry jaxtyping shapes. The import hook
checks functions and dataclasses but not ``NamedTuple`` fields, so records are declared with
:func:`checked_record`: where floatxq was imported under the hook, building a record checks every
field against its annotation (with one set of shape names across the fields, so ``"rows k"`` in
one field and ``"rows"`` in another must agree); elsewhere the decorator returns the class as is.
"""

import inspect
from typing import Any, TypeVar

from jaxtyping import (
    AbstractDtype,
    Bool,
    Float,
    Float8e4m3fn,
    Float32,
    Float64,
    Int,
    Int16,
    Int32,
    Int64,
    Integer,
    Real,
    Shaped,
    UInt8,
)
from torch import Tensor

from floatxq.formats import FP8_FORMATS

_R = TypeVar("_R", bound=type)


def _hook_probe(x: Float[Tensor, ""]) -> None:
    """Decorated by jaxtyping's import hook when the test run switches checking on."""


CHECKING: bool = hasattr(_hook_probe, "__wrapped__")
"""True when floatxq was imported under jaxtyping's import hook (the test run)."""


def checked_record(cls: _R) -> _R:
    """Make a ``NamedTuple`` record check its fields' jaxtyping annotations when it is built.

    Free in production: without the import hook the class is returned unchanged. Under the hook,
    ``cls(...)`` (and so every function returning one) raises ``jaxtyping.TypeCheckError`` (a
    ``TypeError``) when a field's dtype or shape disagrees with its annotation. The fields share
    one set of dimension names, fresh for each record: ``"out in"`` on the codes and ``"out"`` on
    the scales must agree with each other, not with the caller's names. A variadic name
    (``"*scale"``) fits a field whose rank varies (a scalar, a row or a block grid of scales);
    a symbolic one (``"out//8"``, ``"words*8"``) relates a field to names bound by the fields
    before it.

    Not checked: ``_replace`` / ``_make`` (tests use them to build invalid records on purpose),
    and records built inside a ``torch.compile``d region should not be, since the check does not
    trace (production never checks, so this matters only in the test run).

    Example:
      >>> from typing import NamedTuple
      >>> @checked_record
      ... class Pair(NamedTuple):
      ...     codes: UInt8[Tensor, "rows k"]
      ...     scale: Float32[Tensor, "rows"]
      >>> Pair._fields
      ('codes', 'scale')
    """
    if not CHECKING:
        return cls
    from beartype import beartype
    from jaxtyping import jaxtyped

    hints = dict(cls.__annotations__)
    parameters = [
        inspect.Parameter(name, inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=hints[name])
        for name in cls._fields  # type: ignore[attr-defined]
    ]

    def fields(*args: Any, **kwargs: Any) -> None:
        return None

    fields.__signature__ = inspect.Signature(parameters)  # type: ignore[attr-defined]
    fields.__annotations__ = {name: hints[name] for name in cls._fields}  # type: ignore[attr-defined]
    fields.__name__ = fields.__qualname__ = cls.__name__
    fields.__module__ = cls.__module__
    check = jaxtyped(typechecker=beartype)(fields)
    build = cls.__new__

    def __new__(klass: type, *args: Any, **kwargs: Any) -> Any:
        check(*args, **kwargs)
        return build(klass, *args, **kwargs)

    cls.__new__ = __new__  # type: ignore[method-assign]
    return cls


class Float8e8m0fnu(AbstractDtype):
    """``torch.float8_e8m0fnu`` (power-of-two MX scales); jaxtyping's ``Float`` misses it."""

    dtypes = ["float8_e8m0fnu"]  # noqa: RUF012


class Float4e2m1fnx2(AbstractDtype):
    """``torch.float4_e2m1fn_x2``: two packed E2M1 codes per byte (torch's shell dtype)."""

    dtypes = ["float4_e2m1fn_x2"]  # noqa: RUF012


class FP8Dtype(AbstractDtype):
    """Any FP8 storage dtype floatxq handles (E8M0 included)."""

    dtypes = list(FP8_FORMATS)  # noqa: RUF012


__all__ = [
    "CHECKING",
    "Bool",
    "FP8Dtype",
    "Float",
    "Float4e2m1fnx2",
    "Float8e4m3fn",
    "Float8e8m0fnu",
    "Float32",
    "Float64",
    "Int",
    "Int16",
    "Int32",
    "Int64",
    "Integer",
    "Real",
    "Shaped",
    "Tensor",
    "UInt8",
    "checked_record",
]
