"""Llama-family decoder (Llama, Mistral, Qwen2, Qwen3) over the paged KV cache.

q/k/v and gate/up are stored fused so each layer runs two matmuls where transformers runs five;
the loader splits checkpoint tensors into these fused parameters.
With a tensor-parallel group of more than one rank the projections and the embedding/head are the parallel
layers of shared/models/tp/ over this rank's heads; with none (or one rank) the modules are plain nn.Linear
and nn.Embedding, the single-device path unchanged. The hot path runs on kernels/
(Triton on CUDA, their torch twins on CPU): rotary in place, the residual stream carried through fused
add+RMSNorm (vLLM's layout: each layer returns (hidden, residual)), store-KV and paged attention.
"""
from __future__ import annotations

import dataclasses

import torch
from torch import nn

from kernels import AttentionMetadata, paged_attention
from kernels.rmsnorm import add_rms_norm, rms_norm
from kernels.qk_rope_store import qk_rope_store
from kernels.rotary import rope_rows
from kernels.store_kv import kept_slots
from kernels.silu_mul import silu_mul
from shared.models.model_config import ModelConfig
from shared.models.rope import cos_sin_cache
from shared.models.tp.column_linear import ColumnParallelLinear
from shared.models.tp.degree import shard_of
from shared.models.tp.group import TPGroup
from shared.models.tp.lm_head import ParallelLMHead
from shared.models.tp.row_linear import RowParallelLinear
from shared.models.tp.vocab_embedding import VocabParallelEmbedding


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


def _split(tp: TPGroup | None) -> bool:
    return tp is not None and tp.size > 1


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TPGroup | None = None) -> None:
        super().__init__()
        self.cfg = cfg
        if _split(tp):
            s = shard_of(cfg, tp.rank, tp.size)
            self.num_heads, self.num_kv_heads, self.q_size = s.num_heads, s.num_kv_heads, s.q_size
            self.qkv_proj = ColumnParallelLinear(cfg.hidden_size, s.q_size + 2 * s.kv_size, cfg.qkv_bias, tp.size)
            self.o_proj = RowParallelLinear(s.q_size, cfg.hidden_size, cfg.o_bias, tp)
        else:
            self.num_heads, self.num_kv_heads, self.q_size = cfg.num_heads, cfg.num_kv_heads, cfg.q_size
            self.qkv_proj = nn.Linear(cfg.hidden_size, cfg.q_size + 2 * cfg.kv_size, bias=cfg.qkv_bias)
            self.o_proj = nn.Linear(cfg.q_size, cfg.hidden_size, bias=cfg.o_bias)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.scale = cfg.head_dim**-0.5
        # Per-tensor scales of an FP8 KV cache (1.0: vLLM's default without calibrated scales).
        self.k_scale = 1.0
        self.v_scale = 1.0
        self.lora = None  # the layer's LoRA hook (shared/engine/lora_manager.py LayerLoRA) when adapters are served

    def forward(self, x, positions, cos_sin_cache, meta: AttentionMetadata, kv_cache: tuple[torch.Tensor, torch.Tensor]):
        cfg = self.cfg
        tokens = x.shape[0]
        qkv = self.qkv_proj(x)
        if self.lora is not None:
            self.lora("qkv", x, qkv)
        # q/k norm, rotary and storing K/V in one kernel (kernels/qk_rope_store.py); q comes back contiguous.
        qw, kw = (self.q_norm.weight, self.k_norm.weight) if cfg.qk_norm else (None, None)
        rope = kept = None
        if not x.is_cuda and not torch.compiler.is_compiling():
            # The CPU twin's cos/sin rows and kept KV slots, derived by the first layer for all (a compiled step
            # fuses the rows and runs the store as one op).
            # Keyed by the table and dtype: a second model run over the same metadata must not read these rows.
            key = (id(cos_sin_cache), x.dtype)
            cached = meta.cpu_cache.get("rope")
            if cached is None or cached[0] != key:
                cached = meta.cpu_cache["rope"] = (key, rope_rows(cos_sin_cache, positions, x.dtype))
            rope = cached[1]
            kept = meta.cpu_cache.get("kept_slots")
            if kept is None:
                kept = meta.cpu_cache["kept_slots"] = kept_slots(meta.slot_mapping)
        q = qk_rope_store(qkv, self.num_heads, self.num_kv_heads, cfg.head_dim, qw, kw, cfg.rms_norm_eps, positions,
                          cos_sin_cache, kv_cache[0], kv_cache[1], meta.slot_mapping, self.k_scale, self.v_scale, rope,
                          kept)
        out = paged_attention(q, None, None, kv_cache[0], kv_cache[1], meta, self.scale, self.k_scale, self.v_scale)
        out = out.view(tokens, self.q_size)
        o = self.o_proj(out)
        if self.lora is not None:
            self.lora("o", out, o)
        return o


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TPGroup | None = None) -> None:
        super().__init__()
        if _split(tp):
            self.inter = inter = shard_of(cfg, tp.rank, tp.size).intermediate_size
            self.gate_up_proj = ColumnParallelLinear(cfg.hidden_size, 2 * inter, cfg.mlp_bias, tp.size)
            self.down_proj = RowParallelLinear(inter, cfg.hidden_size, cfg.mlp_bias, tp)
        else:
            self.inter = cfg.intermediate_size
            self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=cfg.mlp_bias)
            self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)
        self.lora = None  # the layer's LoRA hook, as Attention's

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.lora is None:
            return self.down_proj(silu_mul(self.gate_up_proj(x)))
        gate_up = self.gate_up_proj(x)
        self.lora("gate_up", x, gate_up)
        h = silu_mul(gate_up)
        down = self.down_proj(h)
        self.lora("down", h, down)
        return down


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TPGroup | None = None) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, tp)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg, tp)

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
    def __init__(self, cfg: ModelConfig, max_positions: int, tp: TPGroup | None = None) -> None:
        super().__init__()
        self.cfg = cfg
        self.tp = tp if _split(tp) else None
        # Modules in the single-device order: dummy weights are drawn parameter by parameter in this order.
        vocab = shard_of(cfg, tp.rank, tp.size).vocab_per_rank if self.tp is not None else cfg.vocab_size
        if self.tp is not None:
            self.embed_tokens = VocabParallelEmbedding(vocab, cfg.hidden_size, tp)
        else:
            self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, tp) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        if self.tp is not None:
            self.lm_head = ParallelLMHead(vocab, cfg.hidden_size, cfg.vocab_size, tp)
        else:
            self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.register_buffer("cos_sin", self.rope_table(cfg, max_positions), persistent=False)
        # The shape of this rank's KV cache: its own KV heads only.
        self.cache_config = cfg if self.tp is None else dataclasses.replace(
            cfg, num_heads=shard_of(cfg, tp.rank, tp.size).num_heads,
            num_kv_heads=shard_of(cfg, tp.rank, tp.size).num_kv_heads)

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
        """Logits in the model dtype: the sampler makes float32 rows only when it needs them (not for greedy).
        Under tensor parallelism every rank must call this (the head gathers), and only rank 0 gets logits."""
        return self.lm_head(hidden)
