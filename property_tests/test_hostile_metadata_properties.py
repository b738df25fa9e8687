"""Hostile metadata, generalised: JSON nesting, config sizes and GPTQ scale dtypes and values.

* Nesting: a JSON value nested ``d`` deep inside ``config.json``, ``quantize_config.json`` or a
  torchao safetensors ``__metadata__`` entry is read (and the checkpoint inspected) exactly when
  the document stays within 64 levels; beyond, a CheckpointError names the file and the bound.
* Sizes: a config.json size field holding an int beyond int32, a negative one or one of more than
  30 digits is refused naming config.json and the field; any other int that is not what the
  tensors hold is refused before the model is built (no "loading state_dict" error).
* Scales: a GPTQ (or compressed-tensors ``pack-quantized``) module's scale tensor stored in any
  dtype with any values either builds a module holding exactly those scales whose decoded weight
  is finite in the model dtype, or is refused naming the tensor. Which one is decided here from
  the documented contract (float16 / bfloat16 / float32 / float64 scales, positive and finite in
  FP32, ``scale · (2**bits - 1)`` within the model dtype), not by the reader.

The base checkpoints are read once per module; each example copies small fixtures to a temporary
directory, or reads one module's tensors with :func:`floatxq.interop.readers.read_module`.
"""

import json
import re
import shutil
import tempfile
from pathlib import Path

import pytest
import torch
from hypothesis import event, example, given, settings
from hypothesis import strategies as st
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torch import nn

import floatxq
from floatxq.interop.checkpoint import CheckpointError
from floatxq.interop.inspect import inspect_checkpoint
from floatxq.interop.layouts import decide_layout, read_gptq_config
from floatxq.interop.readers import ModuleSource, read_module
from floatxq.interop.shards import header_metadata, read_json, tensor_infos

pytest.importorskip("transformers")

FIXTURES = Path(__file__).parents[1] / "tests" / "fixtures"
GPTQ = FIXTURES / "gptqmodel_gptq_desc_act"  # 4-bit g64 asym desc_act, bfloat16, 2 layers
PACKED = FIXTURES / "llmcompressor_w4a16_g64"  # compressed-tensors pack-quantized, 4-bit
TORCHAO = FIXTURES / "torchao_nvfp4"
FILES = ("config.json", "quantize_config.json", "model.safetensors")
FEW = settings(max_examples=max(10, settings().max_examples // 5))  # each example reads files
BOUND = 64
INT32_MAX = 2**31 - 1


def _copy(source: Path, target: Path) -> Path:
    target.mkdir()
    for name in FILES:
        if (source / name).is_file():
            shutil.copyfile(source / name, target / name)
    return target


def _depth(value) -> int:
    """Levels of lists in ``value`` (the test's own count)."""
    return 1 + max(map(_depth, value), default=0) if isinstance(value, list) else 0


# ----------------------------------------------------------------------------------------------
# Nesting
# ----------------------------------------------------------------------------------------------

# Where a nested list goes in each file, and how many levels of the document enclose it.
_SLOTS = {
    "config.json": (lambda d, v: d["quantization_config"]["meta"].update(x=v), 3),
    "quantize_config.json": (lambda d, v: d["meta"].update(x=v), 2),
}


@FEW
@given(depth=st.integers(1, 3 * BOUND), name=st.sampled_from(sorted(_SLOTS)))
@example(depth=BOUND - 3, name="config.json")  # the deepest read, and one level more
@example(depth=BOUND - 2, name="config.json")
@example(depth=BOUND - 2, name="quantize_config.json")
@example(depth=BOUND - 1, name="quantize_config.json")
def test_config_nesting_is_read_within_the_bound_and_refused_beyond(depth, name):
    place, enclosing = _SLOTS[name]
    with tempfile.TemporaryDirectory() as tmp:
        root = _copy(GPTQ, Path(tmp) / "m")
        data = json.loads((root / name).read_text())
        place(data, "@")
        text = json.dumps(data).replace('"@"', "[" * depth + "]" * depth)
        (root / name).write_text(text)
        if depth + enclosing > BOUND:
            with pytest.raises(
                CheckpointError, match=rf"/m/{name} is not valid JSON \(JSON nested"
            ):
                inspect_checkpoint(root)
            with pytest.raises(CheckpointError, match=rf"nested deeper than {BOUND} levels"):
                read_json(root / name, what="load")
        else:
            assert inspect_checkpoint(root).layout == "gptq"
            read = read_json(root / name, what="load")
            meta = read["quantization_config"]["meta"] if name == "config.json" else read["meta"]
            assert _depth(meta["x"]) == depth


UP = "model.layers.0.mlp.up_proj.weight"


@pytest.fixture(scope="module")
def torchao_base(tmp_path_factory) -> Path:
    """torchao's checkpoint with ``tensor_names`` listing one tensor (fewer entries to parse)."""
    root = _copy(TORCHAO, tmp_path_factory.mktemp("torchao") / "m")
    file = root / "model.safetensors"
    with safe_open(str(file), "pt") as reader:
        metadata = reader.metadata()
    metadata = {"format": "pt", "tensor_names": json.dumps([UP]), UP: metadata[UP]}
    save_file(load_file(str(file)), str(file), metadata=metadata)
    assert inspect_checkpoint(root).layout == "torchao"
    return root


@FEW
@given(depth=st.integers(1, 3 * BOUND))
@example(depth=BOUND - 1)
@example(depth=BOUND)
def test_torchao_metadata_nesting_is_read_within_the_bound_and_refused_beyond(torchao_base, depth):
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "m"
        shutil.copytree(torchao_base, root)
        file = root / "model.safetensors"
        with safe_open(str(file), "pt") as reader:
            metadata = reader.metadata()
        entry = metadata[UP][:-1] + ', "x": ' + "[" * depth + "]" * depth + "}"
        save_file(load_file(str(file)), str(file), metadata={**metadata, UP: entry})
        assert header_metadata(root)[UP] == entry  # a string: the header itself is shallow
        if depth + 1 > BOUND:
            match = rf"__metadata__ '{re.escape(UP)}' \(torchao\) is not valid JSON \(JSON nested"
            with pytest.raises(CheckpointError, match=match):
                inspect_checkpoint(root)
        else:
            assert inspect_checkpoint(root).layout == "torchao"


# ----------------------------------------------------------------------------------------------
# Sizes
# ----------------------------------------------------------------------------------------------

_FIELDS = ("hidden_size", "intermediate_size", "vocab_size", "num_attention_heads",
           "num_key_value_heads", "head_dim", "num_hidden_layers", "max_position_embeddings",
)  # fmt: skip
_STORED = {"hidden_size": 128, "intermediate_size": 192, "vocab_size": 128, "head_dim": 32,
           "num_key_value_heads": 2}  # fmt: skip


@pytest.fixture(scope="module")
def base_loads() -> None:
    """The unchanged checkpoint loads (and transformers' Llama is imported once, not per test)."""
    assert floatxq.load(GPTQ).quantized_modules


def _load_with(field: str, literal: str) -> CheckpointError:
    """The refusal of GPTQ's checkpoint with ``field`` set to the JSON ``literal``."""
    with tempfile.TemporaryDirectory() as tmp:
        root = _copy(GPTQ, Path(tmp) / "m")
        data = json.loads((root / "config.json").read_text())
        data[field] = "@"
        (root / "config.json").write_text(json.dumps(data).replace('"@"', literal))
        with pytest.raises(CheckpointError) as caught:
            floatxq.load(root)
    return caught.value


@FEW
@given(
    field=st.sampled_from(_FIELDS),
    value=st.one_of(
        st.integers(INT32_MAX + 1, 10**29), st.integers(-(10**29), -1), st.integers(10**30, 10**80)
    ),
)
def test_huge_or_negative_config_sizes_are_refused_naming_the_field(base_loads, field, value):
    message = str(_load_with(field, str(value)))
    digits = len(str(abs(value)))
    if digits > 30:
        assert re.search(
            rf"/m/config\.json is not valid JSON \(an integer of {digits} digits", message
        )
    else:
        assert re.search(
            rf"/m/config\.json {field} is -?\d+.*; a size must be an int from", message
        )


@FEW
@given(field=st.sampled_from(sorted(_STORED)), value=st.integers(1, INT32_MAX))
def test_config_sizes_other_than_the_stored_ones_are_refused_before_the_build(
    base_loads, field, value
):
    if value == _STORED[field]:
        value += 1
    message = str(_load_with(field, str(value)))
    assert "/m/config.json" in message and "loading state_dict" not in message
    assert re.search(
        r"builds .* (linear|of shape)|does not divide num_attention_heads|does not build a model",
        message,
    )


# ----------------------------------------------------------------------------------------------
# GPTQ scales
# ----------------------------------------------------------------------------------------------


def _source_modules(path: Path, marker: str) -> dict:
    """The checkpoint's layout decision, payloads and each quantized module's tensors."""
    config = read_json(path / "config.json", what="test")
    infos = tensor_infos(path)
    decision = decide_layout(path, config, infos, header_metadata=header_metadata(path))
    qpayload = config["quantization_config"]
    quantize_file = path / "quantize_config.json"
    quantize = read_json(quantize_file, what="test") if quantize_file.is_file() else None
    gptq = read_gptq_config(path, qpayload, quantize) if decision.layout == "gptq" else None
    state = load_file(str(path / "model.safetensors"))
    modules = {}
    for name in state:
        if name.endswith(f".{marker}"):
            prefix = name[: -len(marker) - 1]
            modules[prefix] = {
                k[len(prefix) + 1 :]: v for k, v in state.items() if k.startswith(prefix + ".")
            }
    return {"decision": decision, "qpayload": qpayload, "gptq": gptq, "modules": modules}


SOURCES = {
    "gptq": (_source_modules(GPTQ, "qweight"), "scales"),
    "packed": (_source_modules(PACKED, "weight_packed"), "weight_scale"),
}
_DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.float8_e4m3fn,
           torch.float8_e5m2, torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8,
           torch.bool]  # fmt: skip
_ACCEPTED = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_ODD = [0.0, -0.0, -1e-3, float("nan"), float("inf"), float("-inf"), 1e300, 1e-300, 1e38, 65504.0]
MODEL_DTYPE = torch.bfloat16


def _linear(tensors: dict, kind: str) -> nn.Module:
    if kind == "gptq":
        out, rows = tensors["qweight"].shape[1], tensors["g_idx"].shape[0]
    else:
        out, rows = (int(v) for v in tensors["weight_shape"])
    return nn.Linear(rows, out, bias=False, device="meta")


def _accepted(stored: torch.Tensor, bits: int) -> bool:
    """The contract: a producer's floating dtype, positive and finite in FP32, and the largest
    decoded weight ``scale · (2**bits - 1)`` finite in the model dtype."""
    if stored.dtype not in _ACCEPTED:
        return False
    fp32 = stored.to(torch.float64).to(torch.float32)
    if not bool((torch.isfinite(fp32) & (fp32 > 0)).all()):
        return False
    return float(fp32.max()) * ((1 << bits) - 1) <= torch.finfo(MODEL_DTYPE).max


@settings(max_examples=max(20, settings().max_examples))
@given(
    kind=st.sampled_from(sorted(SOURCES)),
    pick=st.integers(0, 13),
    dtype=st.one_of(st.sampled_from(_ACCEPTED), st.sampled_from(_DTYPES)),
    power=st.one_of(st.just(0), st.integers(-12, 12), st.integers(-330, 330)),
    odd=st.one_of(st.none(), st.sampled_from(_ODD)),
    where=st.integers(0, 10**6),
)
def test_scales_in_any_dtype_load_exactly_or_are_refused_by_name(
    kind, pick, dtype, power, odd, where
):
    source, key = SOURCES[kind]
    names = sorted(source["modules"])
    name = names[pick % len(names)]
    tensors = dict(source["modules"][name])
    values = tensors[key].to(torch.float64) * torch.tensor(10.0, dtype=torch.float64) ** power
    if odd is not None:
        values.view(-1)[where % values.numel()] = odd
    stored = values.to(dtype)
    tensors[key] = stored
    gptq = source["gptq"].resolve(name) if source["gptq"] is not None else None
    bits = gptq.bits if gptq is not None else 4
    call = lambda: read_module(
        source["decision"],
        ModuleSource(name, tensors),
        _linear(tensors, kind),
        qconfig=source["qpayload"],
        dtype=MODEL_DTYPE,
        file="model.safetensors",
        gptq=gptq,
    )
    accepted = _accepted(stored, bits)
    event(f"{'loaded' if accepted else 'refused'} ({kind})")
    if accepted:
        built = call()
        held = built.scales if kind == "gptq" else built.scales.T
        assert held.dtype == stored.dtype and torch.equal(held, stored)
        assert bool(torch.isfinite(built.dequantize_weight(MODEL_DTYPE)).all())
    else:
        with pytest.raises(
            CheckpointError, match=rf"{re.escape(name)}\.{key} in model\.safetensors"
        ):
            call()
