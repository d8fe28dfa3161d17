"""Checkpoint loading: each failure gives one clear error naming the file and the field."""
from __future__ import annotations

import json
import shutil
import struct

import pytest
import torch

from shared.config import EngineConfig
from shared.engine.llm_engine import LLMEngine
from shared.sampling_params import SamplingParams
from shared.models.errors import CheckpointError
from shared.models.loader import load_model


@pytest.fixture
def ckpt_copy(checkpoints, tmp_path):
    dst = tmp_path / "m"
    shutil.copytree(checkpoints["llama"].path, dst)
    return dst


def edit_config(path, **changes):
    raw = json.loads((path / "config.json").read_text())
    raw.update(changes)
    (path / "config.json").write_text(json.dumps(raw))


def rewrite_header(shard, mutate):
    """Rewrite one safetensors header in place (data untouched) to fake a corrupted checkpoint."""
    data = shard.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + n])
    mutate(header)
    new = json.dumps(header).encode()
    new += b" " * (-len(new) % 8)
    shard.write_bytes(struct.pack("<Q", len(new)) + new + data[8 + n :])


def first_tensor_shard(path, suffix):
    index = json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]
    name = next(k for k in index if k.endswith(suffix))
    return name, path / index[name]


def test_unsupported_architecture(ckpt_copy):
    edit_config(ckpt_copy, architectures=["GPT2LMHeadModel"])
    with pytest.raises(CheckpointError, match=r"config\.json: architectures: unsupported architecture 'GPT2LMHeadModel'"):
        load_model(ckpt_copy)


def test_missing_shard(ckpt_copy):
    shard = sorted(ckpt_copy.glob("model-*.safetensors"))[-1]
    shard.unlink()
    with pytest.raises(CheckpointError, match=rf"model\.safetensors\.index\.json: weight_map: shard {shard.name} .*missing"):
        load_model(ckpt_copy)


def test_wrong_shape(ckpt_copy):
    name, shard = first_tensor_shard(ckpt_copy, "mlp.down_proj.weight")

    def grow(h):
        h[name]["shape"] = [h[name]["shape"][0], h[name]["shape"][1] + 1]

    rewrite_header(shard, grow)
    with pytest.raises(CheckpointError, match=rf"{shard.name}: {name}: shape \[64, 161\] does not match the config's \[64, 160\]"):
        load_model(ckpt_copy)


def test_unknown_dtype_in_tensor(ckpt_copy):
    name, shard = first_tensor_shard(ckpt_copy, "input_layernorm.weight")

    def bad(h):
        h[name]["dtype"] = "F13"

    rewrite_header(shard, bad)
    with pytest.raises(CheckpointError, match=rf"{shard.name}: {name}: unknown dtype 'F13'"):
        load_model(ckpt_copy)


def test_unknown_dtype_in_config(ckpt_copy):
    edit_config(ckpt_copy, dtype="float8")
    with pytest.raises(CheckpointError, match=r"config\.json: dtype: unknown dtype 'float8'"):
        load_model(ckpt_copy)


def test_missing_tensor(ckpt_copy):
    name, shard = first_tensor_shard(ckpt_copy, "layers.1.self_attn.k_proj.weight")
    rewrite_header(shard, lambda h: h.pop(name))
    with pytest.raises(CheckpointError, match=rf"{name}: tensor missing from the checkpoint"):
        load_model(ckpt_copy)


def test_unknown_rope_type(ckpt_copy):
    edit_config(ckpt_copy, rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0})
    with pytest.raises(CheckpointError, match=r"rope_parameters\.rope_type: unsupported rope type 'yarn'"):
        load_model(ckpt_copy)


def test_single_file_checkpoint_and_dtypes(checkpoints, tmp_path):
    ckpt = checkpoints["qwen2"]
    single = tmp_path / "single"
    ckpt.hf_model.save_pretrained(single, max_shard_size="100MB")
    assert (single / "model.safetensors").exists()
    model, _ = load_model(single)
    assert model.lm_head.weight is model.embed_tokens.weight, "tied embeddings stay tied"
    torch.testing.assert_close(model.embed_tokens.weight, ckpt.hf_model.model.embed_tokens.weight)
    for dtype, torch_dtype in (("bfloat16", torch.bfloat16), ("float16", torch.float16)):
        engine = LLMEngine(EngineConfig(model=str(single), dtype=dtype, num_kv_blocks=32))
        assert engine.dtype == torch_dtype and engine.runner.kv_caches[0][0].dtype == torch_dtype
        out = engine.generate([[1, 2, 3, 4]], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True),
                              use_tqdm=False)[0]
        assert len(out.output_token_ids) == 4


def test_random_weights_from_config_alone(checkpoints, tmp_path):
    only_config = tmp_path / "cfg"
    only_config.mkdir()
    shutil.copy(checkpoints["qwen3"].path / "config.json", only_config)
    a = LLMEngine(EngineConfig(model=str(only_config), load_format="dummy", seed=3, num_kv_blocks=32))
    b = LLMEngine(EngineConfig(model=str(only_config), load_format="dummy", seed=3, num_kv_blocks=32))
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    assert a.generate([[5, 6, 7]], params, use_tqdm=False)[0].output_token_ids == \
        b.generate([[5, 6, 7]], params, use_tqdm=False)[0].output_token_ids
    with pytest.raises(CheckpointError, match="model.safetensors"):
        load_model(only_config)
