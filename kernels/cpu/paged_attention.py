"""Wrapper of paged_attention.cpp: every row of a step (prompt-chunk rows causal within their chunk, then decode
rows) over the paged cache, K/V already stored (oracle: kernels.paged_attention with k = v = None, i.e. the
decode and extend twins). Per-row loops, no matmul: meant for small steps (decode, verify, short chunks)."""
from __future__ import annotations

import torch

from kernels.attention_metadata import AttentionMetadata


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                    scale: float) -> torch.Tensor:
    """q [tokens, heads, head_dim] -> [tokens, heads, head_dim]."""
    assert q.dim() == 3 and k_cache.dim() == 4 and k_cache.shape == v_cache.shape, "q [t, h, d], caches [b, s, kvh, d]"
    assert q.shape[2] == k_cache.shape[3] and q.shape[1] % k_cache.shape[2] == 0, "head_dim and GQA grouping"
    assert k_cache.dtype == q.dtype, f"the C++ kernel reads {q.dtype} caches, got {k_cache.dtype}"
    return torch.ops.kvmesh_cpu.paged_attention(
        q.contiguous(), k_cache, v_cache, meta.num_prefill_tokens, meta.prefill_query_start, meta.prefill_context_lens,
        meta.prefill_block_tables, meta.decode_context_lens, meta.decode_block_tables, scale,
        meta.sliding_window or 0)
