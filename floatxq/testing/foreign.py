"""Foreign checkpoints for loader tests: what other producers ship, written here from a dense model.

Each writer turns a dense Hugging Face Llama directory (bf16 safetensors + ``config.json``) into the
checkpoint one producer writes (ModelOpt FP8 / NVFP4, DeepSeek block FP8, Quark FP8, ComfyUI
NVFP4, MiMo mixed FP8 + MXFP4), with that producer's tensor names, dtypes, shapes and config keys,
and returns the dense FP32 decode of what it wrote: the oracle a loader's output is compared with.

The quantizers are a few lines each, written here from each producer's formula and sharing nothing
with floatxq's readers; only the NVFP4 code and block-scale choice comes from
:func:`floatxq.nvfp4_block_scales`, while nibble order, the 128x4 scale swizzle and the
global-scale direction are this module's own. Every ``*_proj`` linear of the decoder layers is
quantized; embeddings, norms and ``lm_head`` stay bf16.

Scale directions, as each producer stores them (all multiply to decode):

=================  ==================================================================
ModelOpt FP8       ``weight`` E4M3, ``weight_scale`` FP32 0-d ``= amax / 448``
ModelOpt NVFP4     ``weight`` uint8 [N, K/2] even element low nibble, ``weight_scale``
                   E4M3 [N, K/16], ``weight_scale_2`` FP32 0-d ``= amax / (6 * 448)``
DeepSeek FP8       ``weight_scale_inv`` FP32 grid [ceil(N/bn), ceil(K/bk)] ``= block amax / 448``
                   (``scale_fmt: ue8m0``: rounded up to a power of two, still FP32)
Quark FP8          ``weight_scale`` FP32 0-d (per tensor) or [N] (per channel)
ComfyUI NVFP4      as ModelOpt NVFP4 but even element HIGH nibble, ``weight_scale`` swizzled
                   128x4 and stored as the padded 2-D matrix, ``comfy_quant`` marker bytes
MiMo mixed         FP8 ``weight_scale_inv`` FP32 grids, MXFP4 expert ``weight`` uint8
                   [N, K/2] low nibble first with ``weight_scale`` E8M0 bytes [N, K/32]
=================  ==================================================================
"""

import json
import os
import re
import shutil
import uuid
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, NamedTuple

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from floatxq._typing import Float, Float8e4m3fn, Float32, Tensor, UInt8
from floatxq.nvfp4.quantize import nvfp4_block_scales

__all__ = [
    "ForeignCheckpoint",
    "write_comfy_nvfp4",
    "write_deepseek_fp8",
    "write_mimo_mixed",
    "write_modelopt_fp8",
    "write_modelopt_nvfp4",
    "write_quark_fp8",
]

E4M3_MAX = 448.0
E2M1_MAX = 6.0
E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
"""E2M1 code ``c`` (0..7) decodes to ``E2M1_MAGNITUDES[c]``; bit 3 is the sign."""
NVFP4_GROUP = 16
MX_BLOCK = 32
E8M0_BIAS = 127
MODELOPT_VERSION = "0.37.0"
QUARK_VERSION = "0.11"
ACTIVATION_AMAX = 8.0
"""The activation amax the static ``input_scale`` tensors are written for (no calibration here)."""
MIMO_EXPERT = "model.layers.0.mlp.experts.0.up_proj"
"""The MXFP4 expert the MiMo writer adds, quantized from ``model.layers.0.mlp.up_proj``."""

_LINEAR = re.compile(r"^model\.layers\.\d+\..+_proj\.weight$")
_OUT_FILE = "model.safetensors"
_CONFIG_FILE = "config.json"
_SKIPPED_FILES = (_CONFIG_FILE, "model.safetensors.index.json")


class ForeignCheckpoint(NamedTuple):
    """A checkpoint written by one of this module's writers."""

    path: Path
    """The directory written (``config.json``, ``model.safetensors``, producer side files)."""
    dense: dict[str, torch.Tensor]
    """Module name → FP32 ``[out, in]`` decode of every quantized linear, as written."""
    layout: str
    """Which producer's layout, e.g. ``"modelopt-fp8"``."""


# ----------------------------------------------------------------------------------------------
# Reading the dense model and writing the foreign one
# ----------------------------------------------------------------------------------------------


class _Dense(NamedTuple):
    config: dict[str, Any]
    state: dict[str, torch.Tensor]
    extra_files: list[Path]


def _read_dense(dense_dir: Path, out: Path, *, where: str) -> _Dense:
    if out.exists():
        raise FileExistsError(f"{where}: out {str(out)!r} already exists; pass a new directory")
    config_file = dense_dir / _CONFIG_FILE
    shards = sorted(dense_dir.glob("*.safetensors"))
    if not config_file.is_file() or not shards:
        raise FileNotFoundError(
            f"{where}: dense_dir {str(dense_dir)!r} must hold config.json and *.safetensors"
        )
    config = json.loads(config_file.read_text())
    state: dict[str, torch.Tensor] = {}
    for shard in shards:
        with safe_open(str(shard), framework="pt") as handle:
            for name in handle.keys():
                state[name] = handle.get_tensor(name)
    extra = [
        f
        for f in sorted(dense_dir.iterdir())
        if f.is_file() and f.suffix != ".safetensors" and f.name not in _SKIPPED_FILES
    ]
    return _Dense(config, state, extra)


def _is_quantized_linear(name: str, tensor: torch.Tensor) -> bool:
    return bool(_LINEAR.match(name)) and tensor.ndim == 2


def _module(name: str) -> str:
    return name.removesuffix(".weight")


def _write_dir(
    out: Path,
    tensors: Mapping[str, torch.Tensor],
    config: Mapping[str, Any],
    *,
    dense: _Dense,
    json_files: Mapping[str, Any] | None = None,
    metadata: Mapping[str, str] | None = None,
) -> Path:
    """Write into a hidden sibling directory, then rename it to ``out`` (no partial ``out``)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.foreign-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        contiguous = {k: v.detach().cpu().contiguous() for k, v in tensors.items()}
        save_file(contiguous, str(tmp / _OUT_FILE), metadata={"format": "pt", **(metadata or {})})
        (tmp / _CONFIG_FILE).write_text(json.dumps(dict(config), indent=2) + "\n")
        for name, payload in (json_files or {}).items():
            (tmp / name).write_text(json.dumps(payload, indent=2) + "\n")
        for file in dense.extra_files:
            shutil.copyfile(file, tmp / file.name)
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


_Quantizer = Callable[[str, torch.Tensor], tuple[dict[str, torch.Tensor], torch.Tensor]]


def _quantize_linears(
    dense: _Dense, quantize: _Quantizer
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Each quantized linear's tensors from ``quantize(module, weight)``; the rest kept as is."""
    tensors: dict[str, torch.Tensor] = {}
    decoded: dict[str, torch.Tensor] = {}
    for name, tensor in dense.state.items():
        if _is_quantized_linear(name, tensor):
            module = _module(name)
            written, decode = quantize(module, tensor)
            tensors.update(written)
            decoded[module] = decode
        else:
            tensors[name] = tensor
    return tensors, decoded


def _with_quantization_config(config: Mapping[str, Any], payload: Any) -> dict[str, Any]:
    merged = dict(config)
    merged["quantization_config"] = payload
    return merged


# ----------------------------------------------------------------------------------------------
# The producers' formulas
# ----------------------------------------------------------------------------------------------


def _scale_of(amax: Float32[Tensor, "*s"], top: float) -> Float32[Tensor, "*s"]:
    """``amax / top`` (one FP32 division), 1 where ``amax == 0``: the scale that multiplies."""
    scale = amax / torch.full_like(amax, top)
    return torch.where(amax > 0, scale, torch.ones_like(scale))


def _fp8_codes(
    w32: Float32[Tensor, "n k"], scale: Float32[Tensor, "n k"]
) -> Float8e4m3fn[Tensor, "n k"]:
    """``w / scale`` clamped to ±448, rounded nearest-even into E4M3."""
    return (w32 / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)


def _fp8_per_tensor(
    w: Float[Tensor, "n k"],
) -> tuple[Float8e4m3fn[Tensor, "n k"], Float32[Tensor, ""], Float32[Tensor, "n k"]]:
    w32 = w.to(torch.float32)
    scale = _scale_of(w32.abs().amax(), E4M3_MAX)
    codes = _fp8_codes(w32, scale.expand_as(w32))
    return codes, scale, codes.to(torch.float32) * scale


def _fp8_per_channel(
    w: Float[Tensor, "n k"],
) -> tuple[Float8e4m3fn[Tensor, "n k"], Float32[Tensor, " n"], Float32[Tensor, "n k"]]:
    w32 = w.to(torch.float32)
    scale = _scale_of(w32.abs().amax(dim=1), E4M3_MAX)
    codes = _fp8_codes(w32, scale[:, None].expand_as(w32))
    return codes, scale, codes.to(torch.float32) * scale[:, None]


def _ceil_pow2(x: Float32[Tensor, "*s"]) -> Float32[Tensor, "*s"]:
    """The smallest power of two ``>= x`` for positive finite ``x`` (exact, via frexp)."""
    mantissa, exponent = torch.frexp(x)  # x = mantissa · 2**exponent, mantissa in [0.5, 1)
    up = torch.ldexp(torch.ones_like(x), exponent)
    return torch.where(mantissa == 0.5, x, up)


def _expand_grid(
    grid: Float32[Tensor, "gn gk"], block: tuple[int, int], shape: tuple[int, int]
) -> Float32[Tensor, "n k"]:
    rows, cols = shape
    full = grid.repeat_interleave(block[0], dim=0).repeat_interleave(block[1], dim=1)
    return full[:rows, :cols]


def _fp8_blocks(
    w: Float[Tensor, "n k"], block: tuple[int, int], *, ue8m0: bool
) -> tuple[Float8e4m3fn[Tensor, "n k"], Float32[Tensor, "gn gk"], Float32[Tensor, "n k"]]:
    """Block FP8: one scale per ``block`` tile (edge tiles partial), ``= tile amax / 448``."""
    w32 = w.to(torch.float32)
    rows, cols = w32.shape
    bn, bk = block
    gn, gk = -(-rows // bn), -(-cols // bk)
    padded = torch.zeros((gn * bn, gk * bk), dtype=torch.float32)
    padded[:rows, :cols] = w32.abs()
    amax = padded.reshape(gn, bn, gk, bk).amax(dim=(1, 3))
    scale = _scale_of(amax, E4M3_MAX)
    if ue8m0:
        scale = _ceil_pow2(scale)
    full = _expand_grid(scale, block, (rows, cols))
    codes = _fp8_codes(w32, full)
    return codes, scale, codes.to(torch.float32) * full


def _e2m1_decode(codes: UInt8[Tensor, "*s"]) -> Float32[Tensor, "*s"]:
    magnitudes = torch.tensor(E2M1_MAGNITUDES, dtype=torch.float32)
    values = magnitudes[(codes & 7).long()]
    return torch.where((codes & 8) != 0, -values, values)


def _e2m1_encode(q: Float32[Tensor, "*s"]) -> UInt8[Tensor, "*s"]:
    """Nearest E2M1 code of ``q`` (ties to the even code, saturating at ±6), sign in bit 3."""
    magnitudes = torch.tensor(E2M1_MAGNITUDES, dtype=torch.float32)
    midpoints = (magnitudes[:-1] + magnitudes[1:]) / 2
    mag = q.abs().clamp(max=E2M1_MAX)
    index = (mag[..., None] > midpoints).sum(dim=-1)  # a tie lands on the lower neighbour
    at_tie = (mag == midpoints[index.clamp(max=len(midpoints) - 1)]) & (index % 2 == 1)
    index = torch.where(at_tie & (index < len(midpoints)), index + 1, index)
    sign = torch.where(q < 0, 8, 0)
    return (index + sign).to(torch.uint8)


def _pack_low_first(codes: UInt8[Tensor, "n k"]) -> UInt8[Tensor, "n k//2"]:
    """Two codes per byte, element ``2j`` in the low nibble (ModelOpt, OCP MX)."""
    return codes[:, 0::2] | (codes[:, 1::2] << 4)


def _pack_high_first(codes: UInt8[Tensor, "n k"]) -> UInt8[Tensor, "n k//2"]:
    """Two codes per byte, element ``2j`` in the high nibble (ComfyUI)."""
    return (codes[:, 0::2] << 4) | codes[:, 1::2]


class _NVFP4(NamedTuple):
    codes: torch.Tensor  # uint8 [n, k], one E2M1 code per element
    block_scales: torch.Tensor  # float8_e4m3fn [n, k/16], multiply
    scale_2: torch.Tensor  # FP32 0-d = amax / (6 * 448), multiply
    decoded: torch.Tensor  # FP32 [n, k] = (e2m1 * block_scale) * scale_2


def _nvfp4(w: Float[Tensor, "n k"]) -> _NVFP4:
    w32 = w.to(torch.float32)
    scale_2 = _scale_of(w32.abs().amax(), E2M1_MAX * E4M3_MAX)
    blocks = nvfp4_block_scales(w32, scale_2)
    rows, cols = w32.shape
    local = blocks.block_scales.to(torch.float32).repeat_interleave(NVFP4_GROUP, dim=1)
    decoded = (_e2m1_decode(blocks.codes) * local) * scale_2
    return _NVFP4(blocks.codes, blocks.block_scales, scale_2, decoded.reshape(rows, cols))


def _swizzle_128x4(scales: Float8e4m3fn[Tensor, "r c"]) -> Float8e4m3fn[Tensor, "rp cp"]:
    """The cuBLAS block-scale layout, kept as the zero-padded ``(rows↑128, cols↑4)`` matrix.

    Tiles of 128 rows x 4 columns, row tiles outer; inside a tile row ``r`` and column ``c`` go
    to ``(r % 32) * 16 + ((r // 32) % 4) * 4 + c % 4``. Flattened, it is the 1-D layout.
    """
    rows, cols = scales.shape
    rp, cp = -(-rows // 128) * 128, -(-cols // 4) * 4
    padded = torch.zeros((rp, cp), dtype=torch.uint8)
    padded[:rows, :cols] = scales.view(torch.uint8)
    tiles = padded.reshape(rp // 128, 4, 32, cp // 4, 4).permute(0, 3, 2, 1, 4)
    return tiles.reshape(rp, cp).view(torch.float8_e4m3fn)


def _mxfp4(
    w: Float[Tensor, "n k"],
) -> tuple[UInt8[Tensor, "n k"], UInt8[Tensor, "n k//32"], Float32[Tensor, "n k"]]:
    """OCP MXFP4: per 32 values of K, scale ``2**(floor(log2(amax)) - 2)`` as an E8M0 byte.

    Returns the E2M1 codes (one per element), the E8M0 scale bytes and the decode.
    """
    w32 = w.to(torch.float32)
    rows, cols = w32.shape
    blocks = w32.reshape(rows, cols // MX_BLOCK, MX_BLOCK)
    amax = blocks.abs().amax(dim=-1)
    _, exponent = torch.frexp(amax)  # amax = m · 2**exponent, m in [0.5, 1)
    floor_log2 = exponent - 1
    shared = torch.where(amax > 0, floor_log2 - 2, torch.full_like(floor_log2, -E8M0_BIAS))
    scale_bytes = (shared + E8M0_BIAS).clamp(0, 254).to(torch.uint8)
    scale = torch.ldexp(torch.ones_like(amax), scale_bytes.to(torch.int32) - E8M0_BIAS)
    codes = _e2m1_encode(blocks / scale[..., None])
    decoded = _e2m1_decode(codes) * scale[..., None]
    return codes.reshape(rows, cols), scale_bytes, decoded.reshape(rows, cols)


# ----------------------------------------------------------------------------------------------
# ModelOpt
# ----------------------------------------------------------------------------------------------


def _modelopt_configs(quantization: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """``hf_quant_config.json`` and the ``quantization_config`` newer ModelOpt embeds."""
    producer = {"name": "modelopt", "version": MODELOPT_VERSION}
    sidecar = {"producer": producer, "quantization": quantization}
    algo = quantization["quant_algo"]
    if algo == "FP8":
        spec: dict[str, Any] = {"dynamic": False, "num_bits": 8, "type": "float"}
        group = {"input_activations": spec, "weights": dict(spec), "targets": ["Linear"]}
    else:
        size = quantization["group_size"]
        spec = {"dynamic": False, "num_bits": 4, "type": "float", "group_size": size}
        group = {"input_activations": spec, "weights": dict(spec), "targets": ["Linear"]}
    embedded = {
        "config_groups": {"group_0": group},
        "ignore": list(quantization["exclude_modules"]),
        "quant_algo": algo,
        "producer": producer,
        "quant_method": "modelopt",
    }
    return sidecar, embedded


def write_modelopt_fp8(
    dense_dir: str | os.PathLike[str],
    out: str | os.PathLike[str],
    *,
    input_scale: bool = False,
    sidecar: bool = True,
) -> ForeignCheckpoint:
    """Write the checkpoint NVIDIA ModelOpt exports for FP8 (per-tensor E4M3).

    Per quantized linear ``m``: ``m.weight`` float8_e4m3fn, ``m.weight_scale`` FP32 0-d
    ``= amax / 448`` (multiply to decode) and, with ``input_scale``, ``m.input_scale`` FP32 0-d
    ``= 8 / 448``. ``config.json`` carries ``quantization_config`` (``quant_method: modelopt``,
    ``quant_algo: FP8``, ``config_groups``, ``ignore``, ``producer``); ``hf_quant_config.json``
    (``producer`` + ``quantization``) is written too unless ``sidecar=False``.

    Args:
      dense_dir: a dense Hugging Face Llama directory (read, never modified).
      out: the directory to create.
      input_scale: also write a static activation scale per linear.
      sidecar: write ``hf_quant_config.json``.

    Raises:
      FileExistsError: ``out`` exists. FileNotFoundError: ``dense_dir`` lacks config or weights.

    Numerics: codes ``e4m3(clamp(w / scale, ±448))`` nearest-even; decode ``code * scale``.
    """
    where = "write_modelopt_fp8"
    out_path = Path(out)
    dense = _read_dense(Path(dense_dir), out_path, where=where)

    def quantize(module: str, w: torch.Tensor) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        codes, scale, decoded = _fp8_per_tensor(w)
        written = {f"{module}.weight": codes, f"{module}.weight_scale": scale}
        if input_scale:
            written[f"{module}.input_scale"] = _scale_of(torch.tensor(ACTIVATION_AMAX), E4M3_MAX)
        return written, decoded

    tensors, decoded = _quantize_linears(dense, quantize)
    quantization = {
        "quant_algo": "FP8",
        "kv_cache_quant_algo": None,
        "exclude_modules": ["lm_head"],
    }
    side, embedded = _modelopt_configs(quantization)
    config = _with_quantization_config(dense.config, embedded)
    extra = {"hf_quant_config.json": side} if sidecar else None
    path = _write_dir(out_path, tensors, config, dense=dense, json_files=extra)
    return ForeignCheckpoint(path, decoded, "modelopt-fp8")


def write_modelopt_nvfp4(
    dense_dir: str | os.PathLike[str],
    out: str | os.PathLike[str],
    *,
    input_scale: bool = False,
    sidecar: bool = True,
) -> ForeignCheckpoint:
    """Write the checkpoint NVIDIA ModelOpt exports for NVFP4.

    Per quantized linear ``m``: ``m.weight`` uint8 ``[N, K/2]`` (element ``2j`` in the low
    nibble), ``m.weight_scale`` float8_e4m3fn ``[N, K/16]`` (linear layout), ``m.weight_scale_2``
    FP32 0-d ``= amax / (6 * 448)``, and with ``input_scale`` ``m.input_scale`` FP32 0-d
    ``= 8 / (6 * 448)``. Configs as :func:`write_modelopt_fp8` with ``quant_algo: NVFP4`` and
    ``group_size: 16``.

    Args:
      dense_dir: a dense Hugging Face Llama directory (read, never modified).
      out: the directory to create.
      input_scale: also write a static activation scale per linear.
      sidecar: write ``hf_quant_config.json``.

    Raises:
      FileExistsError: ``out`` exists. FileNotFoundError: ``dense_dir`` lacks config or weights.

    Numerics: block scales from floatxq's NVFP4 search under this global scale; decode
    ``(e2m1 * f32(weight_scale)) * weight_scale_2`` in FP32.
    """
    where = "write_modelopt_nvfp4"
    out_path = Path(out)
    dense = _read_dense(Path(dense_dir), out_path, where=where)

    def quantize(module: str, w: torch.Tensor) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        q = _nvfp4(w)
        written = {
            f"{module}.weight": _pack_low_first(q.codes),
            f"{module}.weight_scale": q.block_scales,
            f"{module}.weight_scale_2": q.scale_2,
        }
        if input_scale:
            activation = torch.tensor(ACTIVATION_AMAX)
            written[f"{module}.input_scale"] = _scale_of(activation, E2M1_MAX * E4M3_MAX)
        return written, q.decoded

    tensors, decoded = _quantize_linears(dense, quantize)
    quantization = {
        "quant_algo": "NVFP4",
        "kv_cache_quant_algo": None,
        "group_size": NVFP4_GROUP,
        "exclude_modules": ["lm_head"],
    }
    side, embedded = _modelopt_configs(quantization)
    config = _with_quantization_config(dense.config, embedded)
    extra = {"hf_quant_config.json": side} if sidecar else None
    path = _write_dir(out_path, tensors, config, dense=dense, json_files=extra)
    return ForeignCheckpoint(path, decoded, "modelopt-nvfp4")


# ----------------------------------------------------------------------------------------------
# DeepSeek block FP8
# ----------------------------------------------------------------------------------------------


def _check_block(block: tuple[int, int], *, where: str) -> None:
    if any(isinstance(b, bool) or b <= 0 for b in block):
        raise ValueError(f"{where}: block must be two positive ints, got {block!r}")


def write_deepseek_fp8(
    dense_dir: str | os.PathLike[str],
    out: str | os.PathLike[str],
    *,
    block: tuple[int, int] = (128, 128),
    ue8m0: bool = False,
) -> ForeignCheckpoint:
    """Write DeepSeek-V3's block FP8 layout (what transformers' fine-grained FP8 reads).

    Per quantized linear ``m``: ``m.weight`` float8_e4m3fn and ``m.weight_scale_inv`` FP32
    ``[ceil(N/bn), ceil(K/bk)]`` ``= tile amax / 448`` — despite the name it MULTIPLIES to decode;
    edge tiles are partial. ``quantization_config``: ``quant_method: fp8``, ``fmt: e4m3``,
    ``activation_scheme: dynamic``, ``weight_block_size``, and with ``ue8m0`` ``scale_fmt:
    ue8m0``: every scale rounded up to a power of two (so no code saturates) and stored as FP32,
    as DeepSeek-V3.1 ships it.

    Args:
      dense_dir: a dense Hugging Face Llama directory (read, never modified).
      out: the directory to create.
      block: ``(bn, bk)`` tile of one scale.
      ue8m0: power-of-two scales and ``scale_fmt: ue8m0``.

    Raises:
      ValueError: a non-positive block. FileExistsError: ``out`` exists. FileNotFoundError:
        ``dense_dir`` lacks config or weights.

    Numerics: codes ``e4m3(clamp(w / scale, ±448))`` nearest-even; decode ``code * scale``.
    """
    where = "write_deepseek_fp8"
    _check_block(block, where=where)
    out_path = Path(out)
    dense = _read_dense(Path(dense_dir), out_path, where=where)

    def quantize(module: str, w: torch.Tensor) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        codes, grid, decoded = _fp8_blocks(w, block, ue8m0=ue8m0)
        return {f"{module}.weight": codes, f"{module}.weight_scale_inv": grid}, decoded

    tensors, decoded = _quantize_linears(dense, quantize)
    payload: dict[str, Any] = {
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "quant_method": "fp8",
        "weight_block_size": list(block),
    }
    if ue8m0:
        payload["scale_fmt"] = "ue8m0"
    config = _with_quantization_config(dense.config, payload)
    path = _write_dir(out_path, tensors, config, dense=dense)
    return ForeignCheckpoint(path, decoded, "deepseek-fp8-ue8m0" if ue8m0 else "deepseek-fp8")


# ----------------------------------------------------------------------------------------------
# AMD Quark
# ----------------------------------------------------------------------------------------------


def _quark_weight_spec(per_channel: bool) -> dict[str, Any]:
    return {
        "dtype": "fp8_e4m3",
        "is_dynamic": False,
        "qscheme": "per_channel" if per_channel else "per_tensor",
        "ch_axis": 0 if per_channel else None,
        "group_size": None,
        "symmetric": True,
        "round_method": "half_even",
        "scale_type": "float",
        "scale_format": None,
        "scale_calculation_mode": None,
        "mx_element_dtype": None,
        "observer_cls": "PerChannelMinMaxObserver" if per_channel else "PerTensorMinMaxObserver",
        "is_scale_quant": False,
    }


def write_quark_fp8(
    dense_dir: str | os.PathLike[str],
    out: str | os.PathLike[str],
    *,
    per_channel: bool = False,
) -> ForeignCheckpoint:
    """Write AMD Quark's weight-only FP8 export (``weight_format: real_quantized``).

    Per quantized linear ``m``: ``m.weight`` float8_e4m3fn and ``m.weight_scale`` FP32 (multiply
    to decode): 0-d ``= amax / 448`` per tensor, ``[N]`` ``= row amax / 448`` per channel.
    ``quantization_config``: ``quant_method: quark``, ``global_quant_config`` with the weight
    spec (``dtype: fp8_e4m3``, ``qscheme``) and ``input_tensors: null``, ``exclude: [lm_head]``,
    ``export`` and the other keys Quark writes.

    Args:
      dense_dir: a dense Hugging Face Llama directory (read, never modified).
      out: the directory to create.
      per_channel: one scale per output row instead of one per tensor.

    Raises:
      FileExistsError: ``out`` exists. FileNotFoundError: ``dense_dir`` lacks config or weights.

    Numerics: codes ``e4m3(clamp(w / scale, ±448))`` nearest-even; decode ``code * scale``.
    """
    where = "write_quark_fp8"
    out_path = Path(out)
    dense = _read_dense(Path(dense_dir), out_path, where=where)

    def quantize(module: str, w: torch.Tensor) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        codes, scale, decoded = _fp8_per_channel(w) if per_channel else _fp8_per_tensor(w)
        return {f"{module}.weight": codes, f"{module}.weight_scale": scale}, decoded

    tensors, decoded = _quantize_linears(dense, quantize)
    payload = {
        "global_quant_config": {
            "input_tensors": None,
            "output_tensors": None,
            "weight": _quark_weight_spec(per_channel),
            "bias": None,
            "target_device": None,
        },
        "exclude": ["lm_head"],
        "algo_config": None,
        "softmax_quant_spec": None,
        "quant_method": "quark",
        "layer_type_quant_config": {},
        "layer_quant_config": {},
        "kv_cache_quant_config": {},
        "kv_cache_post_rope": False,
        "quant_mode": "eager_mode",
        "version": QUARK_VERSION,
        "export": {
            "kv_cache_group": [],
            "min_kv_scale": 0.0,
            "pack_method": "reorder",
            "weight_format": "real_quantized",
            "weight_merge_groups": None,
        },
    }
    config = _with_quantization_config(dense.config, payload)
    path = _write_dir(out_path, tensors, config, dense=dense)
    layout = "quark-fp8-per-channel" if per_channel else "quark-fp8-per-tensor"
    return ForeignCheckpoint(path, decoded, layout)


# ----------------------------------------------------------------------------------------------
# ComfyUI (comfy-kitchen) NVFP4
# ----------------------------------------------------------------------------------------------


def write_comfy_nvfp4(
    dense_dir: str | os.PathLike[str], out: str | os.PathLike[str]
) -> ForeignCheckpoint:
    """Write ComfyUI's NVFP4 layout, as comfy-kitchen's ``TensorCoreNVFP4Layout`` saves it.

    Per quantized linear ``m``: ``m.weight`` uint8 ``[N, K/2]`` with element ``2j`` in the HIGH
    nibble, ``m.weight_scale`` float8_e4m3fn block scales swizzled into cuBLAS's 128x4 layout and
    kept as the zero-padded 2-D ``[ceil(N/128)*128, ceil(K/16/4)*4]`` matrix, ``m.weight_scale_2``
    FP32 0-d ``= amax / (6 * 448)`` (multiply), and the marker ``m.comfy_quant``: uint8 bytes of
    the JSON ``{"format": "nvfp4"}``. The safetensors header carries ``_quantization_metadata``
    (``{"format_version": "1.0", "layers": {m: {"format": "nvfp4"}}}``); ``config.json`` is the
    dense one, unchanged (ComfyUI files have no ``quantization_config``).

    Args:
      dense_dir: a dense Hugging Face Llama directory (read, never modified).
      out: the directory to create.

    Raises:
      FileExistsError: ``out`` exists. FileNotFoundError: ``dense_dir`` lacks config or weights.

    Numerics: as :func:`write_modelopt_nvfp4` (same codes and scales); only the layout differs.
    """
    where = "write_comfy_nvfp4"
    out_path = Path(out)
    dense = _read_dense(Path(dense_dir), out_path, where=where)
    layer_conf = {"format": "nvfp4"}
    marker = torch.tensor(list(json.dumps(layer_conf).encode("utf-8")), dtype=torch.uint8)

    def quantize(module: str, w: torch.Tensor) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        q = _nvfp4(w)
        written = {
            f"{module}.weight": _pack_high_first(q.codes),
            f"{module}.weight_scale": _swizzle_128x4(q.block_scales),
            f"{module}.weight_scale_2": q.scale_2,
            f"{module}.comfy_quant": marker.clone(),
        }
        return written, q.decoded

    tensors, decoded = _quantize_linears(dense, quantize)
    metadata = {
        "_quantization_metadata": json.dumps(
            {"format_version": "1.0", "layers": {m: dict(layer_conf) for m in decoded}}
        )
    }
    path = _write_dir(out_path, tensors, dense.config, dense=dense, metadata=metadata)
    return ForeignCheckpoint(path, decoded, "comfy-nvfp4")


# ----------------------------------------------------------------------------------------------
# MiMo mixed FP8 + MXFP4
# ----------------------------------------------------------------------------------------------


def write_mimo_mixed(
    dense_dir: str | os.PathLike[str], out: str | os.PathLike[str]
) -> ForeignCheckpoint:
    """Write Xiaomi MiMo's mixed layout: block FP8 linears plus MXFP4-stored experts.

    Metadata and tensors only (transformers has no ``mimo_v2`` model to load it). Every quantized
    linear ``m`` is block FP8 as :func:`write_deepseek_fp8` (``m.weight`` E4M3,
    ``m.weight_scale_inv`` FP32 128x128 grid that multiplies, ragged edges); one expert,
    ``model.layers.0.mlp.experts.0.up_proj``, quantized from layer 0's ``up_proj``, is MXFP4:
    ``.weight`` uint8 ``[N, K/2]`` (element ``2j`` low nibble) and ``.weight_scale`` uint8
    ``[N, K/32]`` E8M0 bytes (``2**(byte - 127)``). ``config.json`` has ``model_type: mimo_v2``
    and ``quantization_config`` ``{quant_method: fp8, store_dtype: mxfp4, weight_block_size:
    [128, 128], mxfp4_block_size: 32}``.

    Args:
      dense_dir: a dense Hugging Face Llama directory (read, never modified).
      out: the directory to create.

    Raises:
      FileExistsError: ``out`` exists. FileNotFoundError: ``dense_dir`` lacks config or weights.
      ValueError: ``dense_dir`` has no ``model.layers.0.mlp.up_proj.weight`` to make the expert.

    Numerics: FP8 as :func:`write_deepseek_fp8`; MXFP4 per the OCP rule, scale exponent
    ``floor(log2(block amax)) - 2`` clamped to the E8M0 range, codes E2M1 nearest with ties to
    even, saturating at ±6; decode ``e2m1 * 2**(byte - 127)``.
    """
    where = "write_mimo_mixed"
    out_path = Path(out)
    dense = _read_dense(Path(dense_dir), out_path, where=where)
    source = "model.layers.0.mlp.up_proj.weight"
    if source not in dense.state:
        raise ValueError(f"{where}: dense_dir has no {source!r} to quantize as the MXFP4 expert")
    block = (128, 128)

    def quantize(module: str, w: torch.Tensor) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        codes, grid, decoded = _fp8_blocks(w, block, ue8m0=False)
        return {f"{module}.weight": codes, f"{module}.weight_scale_inv": grid}, decoded

    tensors, decoded = _quantize_linears(dense, quantize)
    codes, scale_bytes, expert = _mxfp4(dense.state[source])
    tensors[f"{MIMO_EXPERT}.weight"] = _pack_low_first(codes)
    tensors[f"{MIMO_EXPERT}.weight_scale"] = scale_bytes
    decoded[MIMO_EXPERT] = expert
    config = dict(dense.config)
    config["model_type"] = "mimo_v2"
    config["architectures"] = ["MiMoV2FlashForCausalLM"]
    config["quantization_config"] = {
        "quant_method": "fp8",
        "store_dtype": "mxfp4",
        "weight_block_size": list(block),
        "mxfp4_block_size": MX_BLOCK,
    }
    path = _write_dir(out_path, tensors, config, dense=dense)
    return ForeignCheckpoint(path, decoded, "mimo-mixed")
