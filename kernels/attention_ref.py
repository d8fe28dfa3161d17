"""Torch reference for paged attention: the CPU path and the oracle for the Triton kernels."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.attention_metadata import AttentionMetadata


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata) -> None:
    """Store this step's K/V ([tokens, kv_heads, head_dim]) at their slots."""
    kf = k_cache.view(-1, *k_cache.shape[2:])
    vf = v_cache.view(-1, *v_cache.shape[2:])
    if meta.write_rows is None:
        kf.index_copy_(0, meta.slot_mapping, k)
        vf.index_copy_(0, meta.slot_mapping, v)
    else:
        slots = meta.slot_mapping[meta.write_rows]
        kf.index_copy_(0, slots, k[meta.write_rows])
        vf.index_copy_(0, slots, v[meta.write_rows])


def gather_blocks(cache: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
    """[len(block_ids) * block_size, kv_heads, head_dim]: whole blocks copied at once (much faster on CPU
    than gathering slot by slot)."""
    return cache.view(cache.shape[0], -1).index_select(0, block_ids).view(-1, *cache.shape[2:])


def paged_attention_ref(
    q: torch.Tensor,  # [tokens, heads, head_dim]
    k: torch.Tensor,  # [tokens, kv_heads, head_dim] (already written to the cache)
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    out = torch.empty_like(q)
    for span in meta.prefills:
        rows = slice(span.q_start, span.q_start + span.q_len)
        qs = q[rows].transpose(0, 1).unsqueeze(0)
        if span.block_table is None:
            ks, vs = k[rows], v[rows]
        else:
            ks = gather_blocks(k_cache, span.block_table)[: span.ctx_len]
            vs = gather_blocks(v_cache, span.block_table)[: span.ctx_len]
        ks = ks.transpose(0, 1).unsqueeze(0)
        vs = vs.transpose(0, 1).unsqueeze(0)
        o = F.scaled_dot_product_attention(
            qs, ks, vs, attn_mask=span.mask, is_causal=span.mask is None, scale=scale, enable_gqa=True
        )
        out[rows] = o.squeeze(0).transpose(0, 1)
    for d in meta.decodes:
        batch = d.block_tables.shape[0]
        qs = q[d.rows].unsqueeze(2)  # [B, heads, 1, head_dim]
        ks = gather_blocks(k_cache, d.block_tables.reshape(-1)).view(batch, -1, *k_cache.shape[2:]).transpose(1, 2)
        vs = gather_blocks(v_cache, d.block_tables.reshape(-1)).view(batch, -1, *v_cache.shape[2:]).transpose(1, 2)
        o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=d.mask, scale=scale, enable_gqa=True)
        out[d.rows] = o.squeeze(2)
    return out
