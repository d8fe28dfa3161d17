"""Llama-family decoder (Llama, Mistral, Qwen2, Qwen3) over the paged KV cache.

q/k/v and gate/up are stored fused so each layer runs two matmuls where transformers runs five;
the loader splits checkpoint tensors into these fused parameters. The hot path runs on kernels/
(Triton on CUDA, their torch twins on CPU): rotary in place, the residual stream carried through fused
add+RMSNorm (vLLM's layout: each layer returns (hidden, residual)), store-KV and paged attention.
"""
from __future__ import annotations

import torch
from torch import nn

from kernels import AttentionMetadata, paged_attention
from kernels.rmsnorm import add_rms_norm, rms_norm
from kernels.qk_rope_store import qk_rope_store
from kernels.silu_mul import silu_mul
from shared.models.model_config import ModelConfig
from shared.models.rope import cos_sin_cache


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """rms_norm(x), or with a residual (rms_norm(x + residual), x + residual); x and residual may be
        overwritten (kernels/rmsnorm.py)."""
        if residual is None:
            return rms_norm(x, self.weight, self.eps)
        return add_rms_norm(x, residual, self.weight, self.eps)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.qkv_proj = nn.Linear(cfg.hidden_size, cfg.q_size + 2 * cfg.kv_size, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(cfg.q_size, cfg.hidden_size, bias=cfg.o_bias)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.scale = cfg.head_dim**-0.5
        # Per-tensor scales of an FP8 KV cache (1.0: vLLM's default without calibrated scales).
        self.k_scale = 1.0
        self.v_scale = 1.0

    def forward(self, x, positions, cos_sin_cache, meta: AttentionMetadata, kv_cache: tuple[torch.Tensor, torch.Tensor]):
        cfg = self.cfg
        tokens = x.shape[0]
        qkv = self.qkv_proj(x)
        # q/k norm, rotary and storing K/V in one kernel (kernels/qk_rope_store.py); q comes back contiguous.
        qw, kw = (self.q_norm.weight, self.k_norm.weight) if cfg.qk_norm else (None, None)
        q = qk_rope_store(qkv, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, qw, kw, cfg.rms_norm_eps, positions,
                          cos_sin_cache, kv_cache[0], kv_cache[1], meta.slot_mapping, self.k_scale, self.v_scale)
        out = paged_attention(q, None, None, kv_cache[0], kv_cache[1], meta, self.scale, self.k_scale, self.v_scale)
        return self.o_proj(out.view(tokens, cfg.q_size))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.inter = cfg.intermediate_size
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=cfg.mlp_bias)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu_mul(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, residual, positions, cos_sin_cache, meta, kv_cache):
        """(hidden, residual) in, (hidden, residual) out; the first layer gets residual None."""
        if residual is None:
            residual = x
            h = self.input_layernorm(x)
        else:
            h, residual = self.input_layernorm(x, residual)
        h = self.self_attn(h, positions, cos_sin_cache, meta, kv_cache)
        h, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(h), residual


class LlamaFamilyForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig, max_positions: int) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.register_buffer("cos_sin", self.rope_table(cfg, max_positions), persistent=False)

    @staticmethod
    def rope_table(cfg: ModelConfig, max_positions: int) -> torch.Tensor:
        return cos_sin_cache(cfg.rope, cfg.head_dim, max_positions)

    def forward(self, input_ids, positions, meta: AttentionMetadata, kv_caches) -> torch.Tensor:
        """Hidden states [tokens, hidden] for the flattened tokens of one step."""
        x = self.embed_tokens(input_ids)
        residual = None
        for layer, kv in zip(self.layers, kv_caches):
            x, residual = layer(x, residual, positions, self.cos_sin, meta, kv)
        return self.norm(x, residual)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits in the model dtype: the sampler makes float32 rows only when it needs them (not for greedy)."""
        return self.lm_head(hidden)
