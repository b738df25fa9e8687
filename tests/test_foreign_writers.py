"""Foreign-checkpoint writers hold each producer's documented contract, and their oracles are true.

Each file is read back here with the rule its producer documents (names, dtypes, shapes, scale
direction, nibble order, swizzle), decoded independently of the writer and compared with the
writer's ``dense`` oracle bitwise, and the oracle with the original bf16 weights.
"""

import hashlib
import json
import math
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from floatxq.fp8 import decode_e8m0
from floatxq.nvfp4.e2m1 import e2m1_decode, unpack_e2m1
from floatxq.nvfp4.quantize import nvfp4_dequantize
from floatxq.nvfp4.swizzle import swizzle_scales, unswizzle_scales
from floatxq.testing import foreign
from floatxq.testing.foreign import (
    ForeignCheckpoint,
    write_comfy_nvfp4,
    write_deepseek_fp8,
    write_mimo_mixed,
    write_modelopt_fp8,
    write_modelopt_nvfp4,
    write_quark_fp8,
)

FIXTURE = Path(__file__).parent / "fixtures" / "tiny_random_llama.py"
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
FP8_TOL, FP4_TOL = 0.05, 0.1
# OCP MXFP4 floors the block exponent, so a block's amax lands in [4, 8) x scale and its top
# (6..8) saturates to 6: on the tiny Llama's Gaussian rows this measures 0.118, above 0.1.
MXFP4_TOL = 0.125


# ----------------------------------------------------------------------------------------------
# Fixtures and readers
# ----------------------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def dense_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("foreign") / "dense"
    shutil.copytree(FIXTURE.parent / "tiny_random_llama", out)  # the committed base model
    return out


@pytest.fixture(scope="session")
def original(dense_dir) -> dict[str, torch.Tensor]:
    return _tensors(dense_dir)


def _tensors(path: Path) -> dict[str, torch.Tensor]:
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


def _header(path: Path) -> dict[str, str]:
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        return f.metadata() or {}


def _json(path: Path) -> dict:
    return json.loads(path.read_text())


def _modules(original: dict[str, torch.Tensor]) -> list[str]:
    return sorted(
        k.removesuffix(".weight")
        for k in original
        if k.startswith("model.layers.") and k.removesuffix(".weight").endswith(LINEARS)
    )


def _rel(decoded: torch.Tensor, reference: torch.Tensor) -> float:
    ref = reference.to(torch.float32)
    return float((decoded - ref).norm() / ref.norm())


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    )


def _grid_amax(w: torch.Tensor, bn: int, bk: int) -> torch.Tensor:
    """Block amax grid, one partial-tile slice at a time (no padding trick, so it can disagree)."""
    rows, cols = w.shape
    grid = torch.empty((math.ceil(rows / bn), math.ceil(cols / bk)))
    for i in range(grid.shape[0]):
        for j in range(grid.shape[1]):
            grid[i, j] = w[i * bn : (i + 1) * bn, j * bk : (j + 1) * bk].float().abs().max()
    return grid


def _expand(grid: torch.Tensor, bn: int, bk: int, shape: torch.Size) -> torch.Tensor:
    rows = torch.arange(shape[0]) // bn
    cols = torch.arange(shape[1]) // bk
    return grid[rows[:, None], cols[None, :]]


def _assert_passthrough(ckpt: ForeignCheckpoint, original: dict[str, torch.Tensor]) -> None:
    """Every tensor that is not a quantized linear comes through bitwise, in bf16."""
    written = _tensors(ckpt.path)
    modules = _modules(original)
    assert sorted(m for m in ckpt.dense if m in modules) == modules
    for name, tensor in original.items():
        if name.removesuffix(".weight") in modules:
            continue
        assert written[name].dtype == torch.bfloat16, name
        assert torch.equal(written[name], tensor), name
    for module, decoded in ckpt.dense.items():
        assert decoded.dtype == torch.float32, module


# ----------------------------------------------------------------------------------------------
# ModelOpt
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("input_scale", "sidecar"), [(False, True), (True, False)])
def test_modelopt_fp8_contract(dense_dir, original, tmp_path, input_scale, sidecar):
    ckpt = write_modelopt_fp8(dense_dir, tmp_path / "m", input_scale=input_scale, sidecar=sidecar)
    assert ckpt.layout == "modelopt-fp8"
    _assert_passthrough(ckpt, original)
    t = _tensors(ckpt.path)
    for m in _modules(original):
        w = original[f"{m}.weight"]
        codes, scale = t[f"{m}.weight"], t[f"{m}.weight_scale"]
        assert codes.dtype == torch.float8_e4m3fn and codes.shape == w.shape
        assert scale.dtype == torch.float32 and scale.shape == ()
        assert scale.item() == pytest.approx(w.float().abs().max().item() / 448, rel=1e-6)
        assert torch.equal(codes.float() * scale, ckpt.dense[m])  # multiplies
        assert _rel(ckpt.dense[m], w) < FP8_TOL
        if input_scale:
            assert t[f"{m}.input_scale"].dtype == torch.float32
            assert t[f"{m}.input_scale"].shape == () and t[f"{m}.input_scale"].item() > 0
        else:
            assert f"{m}.input_scale" not in t
    qc = _json(ckpt.path / "config.json")["quantization_config"]
    assert qc["quant_method"] == "modelopt" and qc["quant_algo"] == "FP8"
    assert qc["ignore"] == ["lm_head"] and qc["producer"]["name"] == "modelopt"
    assert qc["config_groups"]["group_0"]["weights"]["num_bits"] == 8
    side = ckpt.path / "hf_quant_config.json"
    assert side.exists() == sidecar
    if sidecar:
        payload = _json(side)
        assert payload["producer"]["name"] == "modelopt"
        assert payload["quantization"] == {
            "quant_algo": "FP8",
            "kv_cache_quant_algo": None,
            "exclude_modules": ["lm_head"],
        }


@pytest.mark.parametrize(("input_scale", "sidecar"), [(False, True), (True, False)])
def test_modelopt_nvfp4_contract(dense_dir, original, tmp_path, input_scale, sidecar):
    ckpt = write_modelopt_nvfp4(dense_dir, tmp_path / "m", input_scale=input_scale, sidecar=sidecar)
    assert ckpt.layout == "modelopt-nvfp4"
    _assert_passthrough(ckpt, original)
    t = _tensors(ckpt.path)
    for m in _modules(original):
        w = original[f"{m}.weight"]
        n, k = w.shape
        packed, scales, scale_2 = t[f"{m}.weight"], t[f"{m}.weight_scale"], t[f"{m}.weight_scale_2"]
        assert packed.dtype == torch.uint8 and packed.shape == (n, k // 2)
        assert scales.dtype == torch.float8_e4m3fn and scales.shape == (n, k // 16)
        assert scale_2.dtype == torch.float32 and scale_2.shape == ()
        assert scale_2.item() == pytest.approx(w.float().abs().max().item() / (6 * 448), rel=1e-6)
        # floatxq's reader: low nibble first, (e2m1 * block scale) * weight_scale_2
        assert torch.equal(nvfp4_dequantize(packed, scales, scale_2), ckpt.dense[m])
        assert _rel(ckpt.dense[m], w) < FP4_TOL
        assert (f"{m}.input_scale" in t) == input_scale
    qc = _json(ckpt.path / "config.json")["quantization_config"]
    assert qc["quant_method"] == "modelopt" and qc["quant_algo"] == "NVFP4"
    assert qc["config_groups"]["group_0"]["weights"]["group_size"] == 16
    assert (ckpt.path / "hf_quant_config.json").exists() == sidecar
    if sidecar:
        quantization = _json(ckpt.path / "hf_quant_config.json")["quantization"]
        assert quantization["quant_algo"] == "NVFP4" and quantization["group_size"] == 16


# ----------------------------------------------------------------------------------------------
# DeepSeek block FP8
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("ue8m0", [False, True])
def test_deepseek_fp8_contract(dense_dir, original, tmp_path, ue8m0):
    ckpt = write_deepseek_fp8(dense_dir, tmp_path / "d", ue8m0=ue8m0)
    _assert_passthrough(ckpt, original)
    t = _tensors(ckpt.path)
    grids = {}
    for m in _modules(original):
        w = original[f"{m}.weight"]
        codes, grid = t[f"{m}.weight"], t[f"{m}.weight_scale_inv"]
        assert codes.dtype == torch.float8_e4m3fn and codes.shape == w.shape
        assert grid.dtype == torch.float32
        assert grid.shape == (math.ceil(w.shape[0] / 128), math.ceil(w.shape[1] / 128))
        grids[m.rsplit(".", 1)[-1]] = tuple(grid.shape)
        need = _grid_amax(w, 128, 128) / 448
        if ue8m0:
            mantissa, _ = torch.frexp(grid)
            assert torch.all(mantissa == 0.5), "ue8m0 scales must be powers of two"
            assert torch.all(grid >= need) and torch.all(grid / 2 < need), "rounded up, minimal"
        else:
            torch.testing.assert_close(grid, need, rtol=1e-6, atol=0)
        assert torch.equal(codes.float() * _expand(grid, 128, 128, w.shape), ckpt.dense[m])
        assert _rel(ckpt.dense[m], w) < FP8_TOL
    assert grids["gate_proj"] == (2, 1) and grids["down_proj"] == (1, 2)  # ragged 192
    qc = _json(ckpt.path / "config.json")["quantization_config"]
    expected = {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": [128, 128],
    }
    assert qc == ({**expected, "scale_fmt": "ue8m0"} if ue8m0 else expected)


def test_deepseek_fp8_other_block(dense_dir, original, tmp_path):
    ckpt = write_deepseek_fp8(dense_dir, tmp_path / "d", block=(64, 48))
    t = _tensors(ckpt.path)
    w = original["model.layers.1.mlp.down_proj.weight"]  # [128, 192]
    grid = t["model.layers.1.mlp.down_proj.weight_scale_inv"]
    assert grid.shape == (2, 4)
    torch.testing.assert_close(grid, _grid_amax(w, 64, 48) / 448, rtol=1e-6, atol=0)
    assert _json(ckpt.path / "config.json")["quantization_config"]["weight_block_size"] == [64, 48]


@pytest.mark.parametrize("block", [(0, 128), (128, -1), (True, 128)])
def test_deepseek_fp8_rejects_bad_block(dense_dir, tmp_path, block):
    with pytest.raises(ValueError, match="block"):
        write_deepseek_fp8(dense_dir, tmp_path / "d", block=block)
    assert not (tmp_path / "d").exists()


# ----------------------------------------------------------------------------------------------
# Quark
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("per_channel", [False, True])
def test_quark_fp8_contract(dense_dir, original, tmp_path, per_channel):
    ckpt = write_quark_fp8(dense_dir, tmp_path / "q", per_channel=per_channel)
    _assert_passthrough(ckpt, original)
    t = _tensors(ckpt.path)
    for m in _modules(original):
        w = original[f"{m}.weight"]
        codes, scale = t[f"{m}.weight"], t[f"{m}.weight_scale"]
        assert codes.dtype == torch.float8_e4m3fn and codes.shape == w.shape
        assert scale.dtype == torch.float32
        if per_channel:
            assert scale.shape == (w.shape[0],)
            need = w.float().abs().amax(dim=1) / 448
            torch.testing.assert_close(scale, need, rtol=1e-6, atol=0)
            assert torch.equal(codes.float() * scale[:, None], ckpt.dense[m])
        else:
            assert scale.shape == ()
            assert scale.item() == pytest.approx(w.float().abs().max().item() / 448, rel=1e-6)
            assert torch.equal(codes.float() * scale, ckpt.dense[m])
        assert _rel(ckpt.dense[m], w) < FP8_TOL
    qc = _json(ckpt.path / "config.json")["quantization_config"]
    assert qc["quant_method"] == "quark" and qc["exclude"] == ["lm_head"]
    spec = qc["global_quant_config"]
    assert spec["input_tensors"] is None and spec["output_tensors"] is None
    assert spec["weight"]["dtype"] == "fp8_e4m3"
    assert spec["weight"]["qscheme"] == ("per_channel" if per_channel else "per_tensor")
    assert spec["weight"]["ch_axis"] == (0 if per_channel else None)
    assert qc["export"]["weight_format"] == "real_quantized"


# ----------------------------------------------------------------------------------------------
# ComfyUI NVFP4
# ----------------------------------------------------------------------------------------------


def _swap_nibbles(x: torch.Tensor) -> torch.Tensor:
    return ((x & 0x0F) << 4) | (x >> 4)


def test_comfy_nvfp4_contract(dense_dir, original, tmp_path):
    ckpt = write_comfy_nvfp4(dense_dir, tmp_path / "c")
    _assert_passthrough(ckpt, original)
    t = _tensors(ckpt.path)
    modules = _modules(original)
    for m in modules:
        w = original[f"{m}.weight"]
        n, k = w.shape
        packed, swizzled = t[f"{m}.weight"], t[f"{m}.weight_scale"]
        scale_2 = t[f"{m}.weight_scale_2"]
        assert packed.dtype == torch.uint8 and packed.shape == (n, k // 2)
        assert swizzled.dtype == torch.float8_e4m3fn
        assert swizzled.shape == (math.ceil(n / 128) * 128, math.ceil(k // 16 / 4) * 4)
        assert scale_2.dtype == torch.float32 and scale_2.shape == ()
        marker = t[f"{m}.comfy_quant"]
        assert marker.dtype == torch.uint8 and marker.ndim == 1
        assert json.loads(bytes(marker.tolist()).decode("utf-8")) == {"format": "nvfp4"}
        # the documented reader: unswizzle the flat 128x4 layout, even element in the high nibble
        scales = unswizzle_scales(swizzled.reshape(-1), rows=n, cols=k // 16)
        assert torch.equal(nvfp4_dequantize(_swap_nibbles(packed), scales, scale_2), ckpt.dense[m])
        assert _rel(ckpt.dense[m], w) < FP4_TOL
    layers = json.loads(_header(ckpt.path)["_quantization_metadata"])
    assert layers["format_version"] == "1.0"
    assert layers["layers"] == {m: {"format": "nvfp4"} for m in modules}
    assert _json(ckpt.path / "config.json") == _json(dense_dir / "config.json")


def test_comfy_nibbles_are_high_first(dense_dir, original, tmp_path):
    ckpt = write_comfy_nvfp4(dense_dir, tmp_path / "c")
    m = "model.layers.0.self_attn.q_proj"
    t = _tensors(ckpt.path)
    packed, scale_2 = t[f"{m}.weight"], t[f"{m}.weight_scale_2"]
    scales = unswizzle_scales(t[f"{m}.weight_scale"].reshape(-1), rows=128, cols=8)
    # element 0 of row 0 is the high nibble of byte 0: its value over its scales is its E2M1 code
    first = ckpt.dense[m][0, 0] / (scales[0, 0].float() * scale_2)
    assert e2m1_decode(packed[:1, :1] >> 4).item() == first.item()
    high = nvfp4_dequantize(_swap_nibbles(packed), scales, scale_2)
    low = nvfp4_dequantize(packed, scales, scale_2)
    assert torch.equal(high, ckpt.dense[m]) and not torch.equal(low, ckpt.dense[m])


def test_comfy_matches_modelopt_up_to_layout(dense_dir, original, tmp_path):
    comfy = write_comfy_nvfp4(dense_dir, tmp_path / "c")
    modelopt = write_modelopt_nvfp4(dense_dir, tmp_path / "m")
    tc, tm = _tensors(comfy.path), _tensors(modelopt.path)
    for m in _modules(original):
        linear = tm[f"{m}.weight_scale"]
        assert _bits_equal(tc[f"{m}.weight_scale"].reshape(-1), swizzle_scales(linear))
        assert torch.equal(tc[f"{m}.weight"], _swap_nibbles(tm[f"{m}.weight"]))
        assert torch.equal(tc[f"{m}.weight_scale_2"], tm[f"{m}.weight_scale_2"])
        assert torch.equal(comfy.dense[m], modelopt.dense[m])


@pytest.mark.parametrize(("rows", "cols"), [(1, 1), (128, 4), (130, 7), (300, 12)])
def test_comfy_swizzle_is_cublas_layout(rows, cols):
    g = torch.Generator().manual_seed(rows * 31 + cols)
    scales = torch.randint(1, 127, (rows, cols), generator=g, dtype=torch.uint8)
    scales = scales.view(torch.float8_e4m3fn)
    ours = foreign._swizzle_128x4(scales)
    assert ours.shape == (math.ceil(rows / 128) * 128, math.ceil(cols / 4) * 4)
    assert _bits_equal(ours.reshape(-1), swizzle_scales(scales))


# ----------------------------------------------------------------------------------------------
# MiMo mixed
# ----------------------------------------------------------------------------------------------


def test_mimo_mixed_contract(dense_dir, original, tmp_path):
    ckpt = write_mimo_mixed(dense_dir, tmp_path / "x")
    _assert_passthrough(ckpt, original)
    t = _tensors(ckpt.path)
    for m in _modules(original):
        w = original[f"{m}.weight"]
        codes, grid = t[f"{m}.weight"], t[f"{m}.weight_scale_inv"]
        assert codes.dtype == torch.float8_e4m3fn and grid.dtype == torch.float32
        torch.testing.assert_close(grid, _grid_amax(w, 128, 128) / 448, rtol=1e-6, atol=0)
        assert torch.equal(codes.float() * _expand(grid, 128, 128, w.shape), ckpt.dense[m])
        assert _rel(ckpt.dense[m], w) < FP8_TOL
    expert = "model.layers.0.mlp.experts.0.up_proj"
    source = original["model.layers.0.mlp.up_proj.weight"]  # [192, 128]
    packed, scale_bytes = t[f"{expert}.weight"], t[f"{expert}.weight_scale"]
    assert packed.dtype == torch.uint8 and packed.shape == (192, 64)
    assert scale_bytes.dtype == torch.uint8 and scale_bytes.shape == (192, 4)
    # OCP: exponent floor(log2(block amax)) - 2, biased by 127
    amax = source.float().abs().reshape(192, 4, 32).amax(dim=-1)
    expected = torch.tensor(
        [[math.floor(math.log2(a)) - 2 + 127 for a in row] for row in amax.tolist()]
    )
    assert torch.equal(scale_bytes.long(), expected)
    values = e2m1_decode(unpack_e2m1(packed)).reshape(192, 4, 32)  # low nibble first
    decoded = (values * decode_e8m0(scale_bytes)[..., None]).reshape(192, 128)
    assert torch.equal(decoded, ckpt.dense[expert])
    assert _rel(ckpt.dense[expert], source) < MXFP4_TOL
    config = _json(ckpt.path / "config.json")
    assert config["model_type"] == "mimo_v2"
    assert config["quantization_config"] == {
        "quant_method": "fp8",
        "store_dtype": "mxfp4",
        "weight_block_size": [128, 128],
        "mxfp4_block_size": 32,
    }


def test_mxfp4_rounds_ties_to_even_and_saturates():
    # scale 2**0 for amax in [4, 8): 7 saturates to 6, 2.5 ties to 2, 3.5 ties to 4, 0.25 to 0
    row = torch.zeros(1, 32)
    row[0, :6] = torch.tensor([7.0, 2.5, 3.5, 0.25, -0.75, 5.0])
    codes, scale_bytes, decoded = foreign._mxfp4(row)
    assert scale_bytes.tolist() == [[127]]
    assert decoded[0, :6].tolist() == [6.0, 2.0, 4.0, 0.0, -1.0, 4.0]
    assert codes[0, 4].item() == 0b1010  # -1.0: sign bit 3, magnitude code 2


# ----------------------------------------------------------------------------------------------
# Every writer
# ----------------------------------------------------------------------------------------------

WRITERS = {
    "modelopt-fp8": write_modelopt_fp8,
    "modelopt-nvfp4": write_modelopt_nvfp4,
    "deepseek-fp8": write_deepseek_fp8,
    "quark-fp8": write_quark_fp8,
    "comfy-nvfp4": write_comfy_nvfp4,
    "mimo-mixed": write_mimo_mixed,
}


@pytest.mark.parametrize("name", sorted(set(WRITERS) - {"mimo-mixed"}))
def test_autoconfig_reads_config(dense_dir, tmp_path, name):
    from transformers import AutoConfig

    ckpt = WRITERS[name](dense_dir, tmp_path / "w")
    config = AutoConfig.from_pretrained(str(ckpt.path))
    assert config.model_type == "llama" and config.hidden_size == 128
    written = _json(ckpt.path / "config.json").get("quantization_config")
    read = getattr(config, "quantization_config", None)
    assert (written is None) == (name == "comfy-nvfp4")
    if written is not None:
        read = read if isinstance(read, dict) else read.to_dict()
        assert read["quant_method"] == written["quant_method"]


def _digest(path: Path) -> dict[str, str]:
    return {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in sorted(path.iterdir())}


def test_writers_leave_dense_dir_alone_and_refuse_existing_out(dense_dir, tmp_path):
    before = _digest(dense_dir)
    for name, writer in WRITERS.items():
        out = tmp_path / name
        ckpt = writer(dense_dir, out)
        assert ckpt.path == out and ckpt.layout.startswith(name)
        assert (out / "generation_config.json").exists()  # side files come along
        stamp = _digest(out)
        with pytest.raises(FileExistsError, match="already exists"):
            writer(dense_dir, out)
        assert _digest(out) == stamp
    assert _digest(dense_dir) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(WRITERS)  # no temp dirs left


def test_missing_dense_dir_is_refused(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        write_quark_fp8(tmp_path / "nothing", tmp_path / "out")
