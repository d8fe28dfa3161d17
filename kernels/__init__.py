"""Attention over the paged KV cache. `paged_attention` is the one dispatch point: it stores the step's K/V,
then runs extend attention over the prompt-chunk rows and decode attention over the decode rows. Each kernel
picks its Triton version on CUDA and its torch twin (the CPU path and the test oracle) elsewhere."""
from __future__ import annotations

import torch

from kernels.attention_metadata import AttentionMetadata
from kernels.decode_attention import decode_attention, decode_groups
from kernels.extend_attention import extend_attention
from kernels.store_kv import store_kv


def paged_attention(q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None, k_cache: torch.Tensor,
                    v_cache: torch.Tensor, meta: AttentionMetadata, scale: float, k_scale: float = 1.0,
                    v_scale: float = 1.0) -> torch.Tensor:
    """q [tokens, heads, head_dim], k/v [tokens, kv_heads, head_dim] -> [tokens, heads, head_dim]. k and v None:
    the step's K/V are already in the cache (kernels/qk_rope_store.py stored them)."""
    if k is not None:
        store_kv(k, v, k_cache, v_cache, meta.slot_mapping, k_scale, v_scale)
    p = meta.num_prefill_tokens
    out = torch.empty_like(q)
    if meta.num_prefills:
        extend_attention(q[:p], k_cache, v_cache, meta.prefill_query_start, meta.prefill_context_lens,
                         meta.prefill_block_tables, meta.max_prefill_query_len, scale, meta.sliding_window,
                         k_scale, v_scale, out=out[:p])
    if meta.num_decodes:
        groups = None
        if not q.is_cuda and not torch.compiler.is_compiling():  # compiled: the op groups (decode_attention.py)
            groups = meta.cpu_cache.get("decode_groups")
            if groups is None:
                groups = meta.cpu_cache["decode_groups"] = decode_groups(
                    meta.decode_block_tables, meta.decode_context_lens, k_cache.shape[1], meta.sliding_window, q.dtype)
        decode_attention(q[p:], k_cache, v_cache, meta.decode_block_tables, meta.decode_context_lens, scale,
                         meta.sliding_window, k_scale, v_scale, out=out[p:], groups=groups)
    return out


__all__ = ["AttentionMetadata", "paged_attention"]
