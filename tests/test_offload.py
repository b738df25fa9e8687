"""``load(..., offload="disk")``: quantized layer by layer from the shards, written as layers
finish: the same files as the in-memory run, resumable, refusals, and its peak memory."""

import filecmp
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import transformers

import floatxq as fq
from floatxq.interop.stream_save import RUN_FILE, partial_dir
from floatxq.testing.checkpoints import write_random_llama
from floatxq.tiny import TINY_LLAMA_DIR

REPO = Path(__file__).resolve().parents[1]

CONFIGS = {
    "row": fq.FP8Config(),
    "block-gsq": fq.FP8Config(weight_block_size=[128, 128], gsq=fq.GSQConfig()),
    "e5m2-lm_head": fq.FP8Config(format="e5m2", lm_head=True, dynamic={"-:.*k_proj": {}}),
    "nvfp4-fused": fq.NVFP4Config(global_scale="fused"),
    "nvfp4-nvidia-lm_head": fq.NVFP4Config(recipe="nvidia", lm_head=True),
}


def _same_files(a: Path, b: Path) -> None:
    names = sorted(os.listdir(a))
    assert names == sorted(os.listdir(b))
    for name in names:
        assert filecmp.cmp(a / name, b / name, shallow=False), name


def _in_memory(config, out: Path, **save) -> Path:
    fq.load(TINY_LLAMA_DIR, quantize_config=config).quantize(progress=False).save(out, **save)
    return out


@pytest.mark.parametrize("key", list(CONFIGS))
def test_the_offloaded_run_writes_the_in_memory_runs_files(tmp_path, key):
    config = CONFIGS[key]
    save = {"layout": "gptqmodel"} if getattr(config, "format", None) == "float8_e5m2" else {}
    reference = _in_memory(config, tmp_path / "memory", **save)
    model = fq.load(TINY_LLAMA_DIR, quantize_config=config, offload="disk")
    model.quantize(out=tmp_path / "offload", progress=False, **save)
    _same_files(reference, tmp_path / "offload")
    assert model.quantized and model.report.layers == 8 and model.report.resumed_layers == 0
    if isinstance(config, fq.NVFP4Config):
        _same_files(_in_memory(config, tmp_path / "memory-mo", layout="modelopt"),
                    fq.load(TINY_LLAMA_DIR, quantize_config=config, offload="disk")
                    .quantize(out=tmp_path / "offload-mo", layout="modelopt", progress=False)
                    .report.out)  # fmt: skip
    assert not partial_dir(tmp_path / "offload").exists()
    loaded = fq.load(tmp_path / "offload")
    assert loaded.quantize_config == fq.load(reference).quantize_config


def test_many_shards_are_the_in_memory_runs_shards(tmp_path):
    config = CONFIGS["row"]
    reference = _in_memory(config, tmp_path / "memory", max_shard_size=1_000_000)
    model = fq.load(TINY_LLAMA_DIR, quantize_config=config, offload="disk")
    model.quantize(out=tmp_path / "offload", max_shard_size=1_000_000, progress=False)
    assert len([n for n in os.listdir(reference) if n.endswith(".safetensors")]) > 3
    _same_files(reference, tmp_path / "offload")


def test_a_run_cut_short_resumes_from_the_flushed_layers(tmp_path, monkeypatch):
    import floatxq.lifecycle.offload as offload

    config = CONFIGS["block-gsq"]
    out = tmp_path / "offload"
    real = offload.fp8_module
    calls = []

    def failing(name, *args, **kwargs):
        calls.append(name)
        if name == "model.layers.5.self_attn.q_proj":
            raise KeyboardInterrupt
        return real(name, *args, **kwargs)

    monkeypatch.setattr(offload, "fp8_module", failing)
    model = fq.load(TINY_LLAMA_DIR, quantize_config=config, offload="disk")
    with pytest.raises(KeyboardInterrupt):
        model.quantize(out=out, progress=False)
    assert not out.exists() and (partial_dir(out) / RUN_FILE).is_file()
    monkeypatch.setattr(offload, "fp8_module", real)

    again = fq.load(TINY_LLAMA_DIR, quantize_config=config, offload="disk")
    with pytest.raises(ValueError, match="interrupted run left .*resume=True"):
        again.quantize(out=out, progress=False)
    other = fq.load(TINY_LLAMA_DIR, quantize_config=fq.FP8Config(), offload="disk")
    with pytest.raises(ValueError, match="differs from the interrupted one in config"):
        other.quantize(out=out, resume=True, progress=False)
    again.quantize(out=out, resume=True, progress=False)
    assert (again.report.resumed_layers, again.report.layers) == (5, 3)
    _same_files(_in_memory(config, tmp_path / "memory"), out)
    assert not partial_dir(out).exists()


def test_refusals(tmp_path):
    with pytest.raises(ValueError, match="offload must be None or one of"):
        fq.load(TINY_LLAMA_DIR, quantize_config=fq.FP8Config(), offload="ram")
    with pytest.raises(TypeError, match="reads a checkpoint directory"):
        fq.load(torch.nn.Linear(2, 2), quantize_config=fq.FP8Config(), offload="disk")
    with pytest.raises(ValueError, match="needs a quantize_config"):
        fq.load(TINY_LLAMA_DIR, offload="disk")
    saved = _in_memory(fq.FP8Config(), tmp_path / "fp8")
    with pytest.raises(ValueError, match="already quantized"):
        fq.load(saved, quantize_config=fq.FP8Config(), offload="disk")
    model = fq.load(TINY_LLAMA_DIR, quantize_config=fq.FP8Config(), offload="disk")
    with pytest.raises(ValueError, match="pass out=DIRECTORY"):
        model.quantize(progress=False)
    with pytest.raises(ValueError, match="resume=True, but no interrupted run"):
        model.quantize(out=tmp_path / "new", resume=True, progress=False)
    with pytest.raises(FileExistsError):
        model.quantize(out=saved, progress=False)
    plain = fq.load(TINY_LLAMA_DIR, quantize_config=fq.FP8Config())
    with pytest.raises(ValueError, match="out= is for models loaded with offload='disk'"):
        plain.quantize(out=tmp_path / "x", progress=False)
    gptq = fq.load(TINY_LLAMA_DIR, quantize_config=fq.GPTQConfig(), offload="disk")
    with pytest.raises(ValueError, match="calibrated .* needs calibration data"):
        gptq.quantize(out=tmp_path / "g", progress=False)


def test_the_shell_holds_only_the_long_lived_pieces(tmp_path):
    model = fq.load(TINY_LLAMA_DIR, quantize_config=fq.FP8Config(), offload="disk")
    real = {n for n, p in model.model.named_parameters() if not p.is_meta}
    assert real == {"model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"}
    model.quantize(out=tmp_path / "out", progress=False)
    layer = model.model.model.layers[3]
    assert all(t.is_meta for t in (*layer.parameters(), *layer.buffers()))


_MEASURE = textwrap.dedent(
    """
    import json, sys
    import torch, transformers
    from transformers.models.llama import modeling_llama  # noqa: F401
    import floatxq as fq

    def status(key):
        for line in open("/proc/self/status"):
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024

    path, out, mode = sys.argv[1], sys.argv[2], sys.argv[3]
    # a warm-up run of the tiny Llama: every module the run imports, the allocator's first pools
    from floatxq.tiny import TINY_LLAMA_DIR
    fq.load(TINY_LLAMA_DIR, quantize_config=fq.FP8Config(), offload="disk", device="cpu").quantize(
        out=out + "-warm-up", progress=False
    )
    baseline = status("VmHWM")
    if mode == "offload":
        model = fq.load(path, quantize_config=fq.FP8Config(), offload="disk", device="cpu")
        model.quantize(out=out, progress=False)
    else:  # the in-memory run, which the same budget must refuse
        model = fq.load(path, quantize_config=fq.FP8Config(), device="cpu")
        model.quantize(progress=False).save(out)
    print(json.dumps({"baseline": baseline, "peak": status("VmHWM")}))
    """
)


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/status").is_file(), reason="reads /proc/self/status")
def test_peak_memory_is_the_long_lived_pieces_and_two_layers(tmp_path):
    config = transformers.LlamaConfig(
        vocab_size=16384, hidden_size=1024, intermediate_size=4096, num_hidden_layers=8,
        num_attention_heads=16, num_key_value_heads=16, tie_word_embeddings=False,
        dtype="bfloat16",
    )  # fmt: skip
    sizes = write_random_llama(tmp_path / "src", config, max_shard_size="100MB")
    layer, embed_and_head = sizes["layer"], sizes["embeddings"] + sizes["lm_head"]
    env = {**os.environ, "PYTHONPATH": str(REPO)}

    def measure(mode: str) -> dict[str, int]:
        done = subprocess.run(
            [sys.executable, "-c", _MEASURE, str(tmp_path / "src"), str(tmp_path / mode), mode],
            capture_output=True, text=True, env=env, check=False, timeout=600,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr[-4000:]
        return json.loads(done.stdout.strip().splitlines()[-1])

    # the slack: a module's transient FP32 copies while it is quantized, the writer's buffers
    slack = 250 * 2**20
    measured = measure("offload")
    budget = measured["baseline"] + embed_and_head + 2 * layer + slack
    assert measured["peak"] < budget, (measured, budget, layer)
    assert fq.load(tmp_path / "offload").quantized
    in_memory = measure("memory")  # the budget is tight enough to refuse the in-memory run
    refused = in_memory["baseline"] + embed_and_head + 2 * layer + slack
    assert in_memory["peak"] >= refused, in_memory
