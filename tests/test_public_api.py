"""The public surface: every name exported, sorted, documented, annotated (optax-style checks)."""

import inspect
import typing

import jaxtyping
import torch

import floatxq as fq
import floatxq.config
import floatxq.formats
import floatxq.fp8
import floatxq.gptq.hessian
import floatxq.gptq.int4
import floatxq.gptq.planes
import floatxq.gptq.solve
import floatxq.kernels
import floatxq.nn
import floatxq.nvfp4.e2m1
import floatxq.nvfp4.headroom
import floatxq.nvfp4.quantize
import floatxq.nvfp4.report
import floatxq.nvfp4.swizzle
import floatxq.w4a.activation
import floatxq.w4a.linear

OWNERS = (
    floatxq.config,
    floatxq.nvfp4.e2m1,
    floatxq.formats,
    floatxq.fp8,
    floatxq.gptq.solve,
    floatxq.gptq.hessian,
    floatxq.gptq.planes,
    floatxq.nvfp4.headroom,
    floatxq.gptq.int4,
    floatxq.nn,
    floatxq.nvfp4.quantize,
    floatxq.nvfp4.layouts,
    floatxq.nvfp4.report,
    floatxq.interop.sources,
    floatxq.nvfp4.swizzle,
    floatxq.w4a.linear,
    floatxq.w4a.activation,
)


def _public_callables():
    for name in fq.__all__:
        obj = getattr(fq, name)
        if inspect.isfunction(inspect.unwrap(obj)) or inspect.isclass(obj):
            yield name, obj


def _isort_key(name: str) -> tuple[int, str]:
    """ruff's RUF022 order: CONSTANTS, then Classes, then functions, each alphabetical."""
    kind = 0 if name.isupper() else 1 if name[0].isupper() else 2
    return (kind, name)


def test_all_is_sorted_unique_and_resolvable():
    assert list(fq.__all__) == sorted(fq.__all__, key=_isort_key)
    assert len(set(fq.__all__)) == len(fq.__all__)
    for name in fq.__all__:
        assert hasattr(fq, name), name


def test_every_public_name_of_the_owning_modules_is_reexported():
    for module in OWNERS:
        public = getattr(module, "__all__", None) or [
            n
            for n, v in vars(module).items()
            if not n.startswith("_")
            and getattr(v, "__module__", module.__name__) == module.__name__
            and (inspect.isfunction(v) or inspect.isclass(v))
        ]
        missing = sorted(set(public) - set(fq.__all__))
        assert not missing, f"{module.__name__} exports {missing} that floatxq does not"


def test_kernel_entry_points_are_reexported():
    # floatxq.kernels keeps its availability helpers to itself; the entry points are top-level
    for name in (
        "quantize_fp8_weight_kernel",
        "fp8_scaled_linear_kernel",
        "fp8_scaled_linear_kernel_with_codes",
        "FP8ScaledLinearTrace",
        "fp8_pack",
        "fp8_linear",
        "fp8_linear_prepacked",
        "dequantize_gptq_kernel",
        "w4a16_linear_kernel",
    ):
        assert getattr(fq, name) is getattr(floatxq.kernels, name)
    assert fq.quantize_fp8_weight_auto is fq.dispatch.quantize_fp8_weight_auto  # a route choice


def test_docstrings_are_google_style_with_numerics_line():
    for name, obj in _public_callables():
        doc = inspect.getdoc(obj) or ""
        if inspect.isclass(obj) and issubclass(obj, tuple):  # NamedTuple records: field docs
            assert doc, name
            continue
        if inspect.isclass(obj) and issubclass(obj, str):  # str enums
            assert doc, name
            continue
        assert "Numerics:" in doc, f"{name} lacks a Numerics: line"
        assert len(doc.splitlines()) >= 3, f"{name} docstring is too short"


def _mentions_jaxtyping(annotation) -> bool:
    if isinstance(annotation, type) and issubclass(annotation, jaxtyping.AbstractArray):
        return True
    return any(_mentions_jaxtyping(a) for a in typing.get_args(annotation))


def test_tensor_arguments_carry_jaxtyping_annotations():
    checked = 0
    for name, obj in _public_callables():
        if inspect.isclass(obj):
            continue
        sig = inspect.signature(inspect.unwrap(obj))
        for param in sig.parameters.values():
            ann = param.annotation
            if ann is inspect.Parameter.empty:
                raise AssertionError(f"{name}({param.name}) is not annotated")
            if ann is torch.Tensor:
                raise AssertionError(f"{name}({param.name}) is a bare Tensor: give it a shape")
            checked += _mentions_jaxtyping(ann)
        assert sig.return_annotation is not inspect.Signature.empty, f"{name} return"
    assert checked >= 11  # every tensor argument of the FP8 API


def test_records_are_named_tuples_and_configs_frozen():
    assert fq.FP8Weight._fields == ("qweight", "scale_inv")
    assert fq.FP8Tokens._fields == ("codes", "scale")
    cfg = fq.FP8Config()
    try:
        cfg.bits = 4  # type: ignore[misc]
    except (AttributeError, TypeError):
        pass
    else:
        raise AssertionError("FP8Config is mutable")
    assert hash(cfg) == hash(fq.FP8Config())
