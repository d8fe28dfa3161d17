"""Tiny real checkpoints of each supported architecture, built with transformers' own classes,
saved sharded with save_pretrained, plus a locally trained byte-level BPE tokenizer."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import (LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM, Qwen2Config,
                          Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM)

from shared.models.demo_tokenizer import cached_byte_bpe, write_tokenizer_files

VOCAB = 512
EOS = 511  # a real id the models can emit, so stopping on eos is exercised

COMMON = dict(hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=512, initializer_range=0.1,
              bos_token_id=None, eos_token_id=EOS, pad_token_id=None)

ARCHS = {
    # Llama with llama3 rope scaling and untied embeddings.
    "llama": (LlamaConfig, LlamaForCausalLM, dict(
        tie_word_embeddings=False,
        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 64})),
    # Mistral with a sliding window shorter than the longer test prompts.
    "mistral": (MistralConfig, MistralForCausalLM, dict(tie_word_embeddings=False, sliding_window=48)),
    # Qwen2: q/k/v bias, tied embeddings.
    "qwen2": (Qwen2Config, Qwen2ForCausalLM, dict(tie_word_embeddings=True)),
    # Qwen3: q/k norm, head_dim that is not hidden/heads, linear rope scaling.
    "qwen3": (Qwen3Config, Qwen3ForCausalLM, dict(
        tie_word_embeddings=False, head_dim=32,
        rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0})),
}


@dataclass
class Checkpoint:
    arch: str
    path: Path
    hf_model: torch.nn.Module


def build_checkpoint(arch: str, out_dir: Path, seed: int = 0, **overrides) -> Checkpoint:
    """overrides: config fields on top of COMMON and the architecture's (e.g. a longer max_position_embeddings)."""
    config_cls, model_cls, extra = ARCHS[arch]
    config = config_cls(**(COMMON | extra | overrides))
    torch.manual_seed(seed)
    model = model_cls(config).eval()
    model.generation_config.eos_token_id = EOS
    model.generation_config.pad_token_id = EOS
    model.save_pretrained(out_dir, max_shard_size="200KB")
    write_tokenizer_files(cached_byte_bpe(VOCAB), out_dir)
    assert len(list(out_dir.glob("*.safetensors"))) >= 2, "tests need a sharded checkpoint"
    return Checkpoint(arch, out_dir, model)


def to_transformers4_config(path: Path) -> None:
    """Rewrite config.json the way transformers 4.x saved it: rope_theta and rope_scaling at the top level."""
    cfg_path = path / "config.json"
    raw = json.loads(cfg_path.read_text())
    rope = raw.pop("rope_parameters")
    raw["rope_theta"] = rope.pop("rope_theta")
    if rope.get("rope_type", "default") != "default":
        raw["rope_scaling"] = {"type": rope.pop("rope_type"), **rope}
    raw["torch_dtype"] = raw.pop("dtype", "float32")
    cfg_path.write_text(json.dumps(raw, indent=2))


def hf_greedy(model: torch.nn.Module, prompt: list[int], max_new_tokens: int) -> tuple[list[int], torch.Tensor]:
    """transformers' greedy tokens and the log-softmax of its logits at every step."""
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=max_new_tokens, do_sample=False,
                             output_logits=True, return_dict_in_generate=True)
    tokens = out.sequences[0, len(prompt):].tolist()
    logprobs = torch.stack(out.logits)[:, 0].float().log_softmax(-1)
    return tokens, logprobs
