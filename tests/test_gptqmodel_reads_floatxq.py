"""GPT-QModel reads floatxq's ``layout="gptqmodel"`` exports: evidence checked without GPT-QModel.

``fixtures/gptqmodel_reads_floatxq/<config>.safetensors`` were written by GPT-QModel 7.7.0 loading
floatxq's exports of the tiny random Llama (``make_gptqmodel_fixtures.py --reads-floatxq``): its
FP32 logits for ``token_ids``, and the sha256 of the ``model.safetensors`` and
``quantize_config.json`` it read. Here floatxq exports the same model today; equal hashes mean
GPT-QModel read the bytes floatxq writes now, and floatxq's own logits on those files must equal
GPT-QModel's. The recorded ``config.json`` payload carried floatxq's ``activation_scheme`` refusal
marker, so GPT-QModel loaded the files transformers and vLLM refuse.
"""

import hashlib
import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

import floatxq
from floatxq.interop.export import GPTQMODEL_REFUSAL_MARKER

FIXTURES = Path(__file__).parent / "fixtures"
RECORDS = FIXTURES / "gptqmodel_reads_floatxq"
CONFIGS = {
    "row": dict(weight_scale_method="row"),
    "tensor": dict(weight_scale_method="tensor"),
    "block64": dict(weight_block_size=[64, 64]),
}
HASHED = {
    "model.safetensors": "model_safetensors_sha256",
    "quantize_config.json": "quantize_config_json_sha256",
}


def _record(name: str) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    with safe_open(str(RECORDS / f"{name}.safetensors"), "pt") as f:
        return {key: f.get_tensor(key) for key in f.keys()}, f.metadata()


@pytest.fixture(scope="module")
def exports(tmp_path_factory) -> dict[str, Path]:
    # the committed base: a random init is not the same bits across torch/transformers releases
    root = tmp_path_factory.mktemp("gptqmodel_reads_floatxq")
    out = {}
    for name, options in CONFIGS.items():
        config = floatxq.FP8Config(**options)
        base = FIXTURES / "tiny_random_llama"
        model = floatxq.load(base, quantize_config=config).quantize(progress=False)
        out[name] = model.save(root / name, layout="gptqmodel")
    return out


@pytest.mark.parametrize("name", list(CONFIGS))
def test_floatxq_writes_today_the_bytes_gptqmodel_read(exports, name):
    _, metadata = _record(name)
    assert json.loads(metadata["floatxq_fp8config_options"]) == CONFIGS[name]
    for filename, key in HASHED.items():
        digest = hashlib.sha256((exports[name] / filename).read_bytes()).hexdigest()
        assert digest == metadata[key], f"{name}/{filename} differs from what GPT-QModel read"
    # config.json is not hashed (it holds the base model's path); its payload is compared
    payload = json.loads((exports[name] / "config.json").read_text())["quantization_config"]
    recorded = json.loads(metadata["config_json_quantization_config"])
    assert payload == recorded
    assert recorded["activation_scheme"] == GPTQMODEL_REFUSAL_MARKER


@pytest.mark.parametrize("name", list(CONFIGS))
def test_floatxq_logits_equal_gptqmodels_on_the_same_files(exports, name):
    tensors, metadata = _record(name)
    assert metadata["gptqmodel_version"] == "7.7.0"
    want = tensors["logits_fp32"]  # GPT-QModel's, loaded with dtype=torch.float32
    assert want.shape == (1, 4, 128) and bool(want.abs().max() > 0.1)
    loaded = floatxq.load(exports[name], dtype=torch.float32)
    with torch.no_grad():
        got = loaded.model(tensors["token_ids"]).logits
    err = float((got - want).abs().max() / want.abs().max())
    assert err < 1e-5, f"{name}: relative max error {err:.3g} against GPT-QModel's logits"
