"""Real model architectures with random weights, for benchmarks at real sizes (no weights can be downloaded).

Each shape is the published config.json of the model (sizes, rope, tying), with nothing trained in it.
Shapes small enough to write quickly become real safetensors checkpoints, so kvmesh and transformers load
the very same weights; the largest is written as config.json only: kvmesh loads it with random weights
(load_format dummy) and transformers builds it from the config with its own seeded initialisation.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch


@dataclass(frozen=True)
class RealShape:
    name: str
    model_class: str  # transformers class
    config: dict = field(default_factory=dict)
    write_weights: bool = True  # False: config.json only (too large to write for a benchmark run)

    @property
    def dtype(self) -> str:
        return self.config["dtype"]


_LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192}

SHAPES: dict[str, RealShape] = {
    "qwen3-0.6b": RealShape("qwen3-0.6b", "Qwen3ForCausalLM", dict(
        hidden_size=1024, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8, head_dim=128,
        intermediate_size=3072, vocab_size=151936, tie_word_embeddings=True, max_position_embeddings=40960,
        rms_norm_eps=1e-6, rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}, dtype="bfloat16",
        bos_token_id=151643, eos_token_id=151645)),
    "llama-3.2-1b": RealShape("llama-3.2-1b", "LlamaForCausalLM", dict(
        hidden_size=2048, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8, head_dim=64,
        intermediate_size=8192, vocab_size=128256, tie_word_embeddings=True, max_position_embeddings=131072,
        rms_norm_eps=1e-5, rope_parameters=_LLAMA3_ROPE | {"factor": 32.0}, dtype="bfloat16",
        bos_token_id=128000, eos_token_id=128001)),
    "llama-3.1-8b": RealShape("llama-3.1-8b", "LlamaForCausalLM", dict(
        hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
        intermediate_size=14336, vocab_size=128256, tie_word_embeddings=False, max_position_embeddings=131072,
        rms_norm_eps=1e-5, rope_parameters=_LLAMA3_ROPE | {"factor": 8.0}, dtype="bfloat16",
        bos_token_id=128000, eos_token_id=128001), write_weights=False),
    # Llama-3.1-70B: what tensor parallelism is for (141 GB of bf16 weights fit no single GPU): the GPU benchmark
    # `kvmesh bench offline --shape llama-3.1-70b --tensor-parallel-size 4|8 --device cuda` (random weights).
    "llama-3.1-70b": RealShape("llama-3.1-70b", "LlamaForCausalLM", dict(
        hidden_size=8192, num_hidden_layers=80, num_attention_heads=64, num_key_value_heads=8, head_dim=128,
        intermediate_size=28672, vocab_size=128256, tie_word_embeddings=False, max_position_embeddings=131072,
        rms_norm_eps=1e-5, rope_parameters=_LLAMA3_ROPE | {"factor": 8.0}, dtype="bfloat16",
        bos_token_id=128000, eos_token_id=128001), write_weights=False),
    # Mistral-7B-v0.1: the sliding-window shape (4096) of the family.
    "mistral-7b": RealShape("mistral-7b", "MistralForCausalLM", dict(
        hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
        intermediate_size=14336, vocab_size=32000, tie_word_embeddings=False, max_position_embeddings=32768,
        sliding_window=4096, rms_norm_eps=1e-5, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        dtype="bfloat16", bos_token_id=1, eos_token_id=2), write_weights=False),
    # SmolLM2-135M(-Instruct), the demo model: 9 query heads over 3 KV heads (a group of 3, not a power of 2),
    # head_dim 64.
    "smollm2-135m": RealShape("smollm2-135m", "LlamaForCausalLM", dict(
        hidden_size=576, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, head_dim=64,
        intermediate_size=1536, vocab_size=49152, tie_word_embeddings=True, max_position_embeddings=8192,
        rms_norm_eps=1e-5, rope_parameters={"rope_type": "default", "rope_theta": 100000.0}, dtype="bfloat16",
        bos_token_id=1, eos_token_id=2)),
}


def hf_config(shape: RealShape):
    import transformers

    cls = getattr(transformers, shape.model_class.replace("ForCausalLM", "Config"))
    return cls(**shape.config)


def build_shape_checkpoint(out_dir: str, shape: RealShape, seed: int = 0) -> str:
    """Writes the shape's checkpoint (weights in its dtype, or config.json only) and returns the directory."""
    import transformers

    config = hf_config(shape)
    if not shape.write_weights:
        config.architectures = [shape.model_class]
        config.save_pretrained(out_dir)
        return out_dir
    torch.manual_seed(seed)
    with torch.device("cpu"):
        model = getattr(transformers, shape.model_class)(config).to(getattr(torch, shape.dtype))
    model.save_pretrained(out_dir, safe_serialization=True)
    return out_dir


def has_weights(model_dir: str) -> bool:
    return any(Path(model_dir).glob("*.safetensors"))


def checkpoint_dtype(model_dir: str) -> str:
    raw = json.loads((Path(model_dir) / "config.json").read_text())
    return str(raw.get("dtype") or raw.get("torch_dtype") or "float32")
