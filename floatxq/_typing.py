"""jaxtyping vocabulary shared by every floatxq module.

Annotations only: checking is switched on by the test run (pytest's
``--jaxtyping-packages=floatxq,beartype.beartype``) and costs nothing in production.
"""

from jaxtyping import (
    AbstractDtype,
    Bool,
    Float,
    Float8e4m3fn,
    Float32,
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


class Float8e8m0fnu(AbstractDtype):
    """``torch.float8_e8m0fnu`` (power-of-two MX scales); jaxtyping's ``Float`` misses it."""

    dtypes = ["float8_e8m0fnu"]  # noqa: RUF012


class Float4e2m1fnx2(AbstractDtype):
    """``torch.float4_e2m1fn_x2``: two packed E2M1 codes per byte (torch's shell dtype)."""

    dtypes = ["float4_e2m1fn_x2"]  # noqa: RUF012


class FP8Dtype(AbstractDtype):
    """Any FP8 storage dtype floatxq handles (E8M0 included)."""

    dtypes = [  # noqa: RUF012
        "float8_e4m3fn",
        "float8_e5m2",
        "float8_e4m3fnuz",
        "float8_e5m2fnuz",
        "float8_e8m0fnu",
    ]


__all__ = [
    "Bool",
    "FP8Dtype",
    "Float",
    "Float4e2m1fnx2",
    "Float8e4m3fn",
    "Float8e8m0fnu",
    "Float32",
    "Int",
    "Int16",
    "Int32",
    "Int64",
    "Integer",
    "Real",
    "Shaped",
    "Tensor",
    "UInt8",
]
