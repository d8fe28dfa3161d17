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
        kf[meta.slot_mapping] = k
        vf[meta.slot_mapping] = v
    else:
        slots = meta.slot_mapping[meta.write_rows]
        kf[slots] = k[meta.write_rows]
        vf[slots] = v[meta.write_rows]


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
    kf = k_cache.view(-1, *k_cache.shape[2:])
    vf = v_cache.view(-1, *v_cache.shape[2:])
    for span in meta.prefills:
        rows = slice(span.q_start, span.q_start + span.q_len)
        qs = q[rows].transpose(0, 1).unsqueeze(0)
        if span.key_slots is None:
            ks, vs = k[rows], v[rows]
        else:
            ks, vs = kf[span.key_slots], vf[span.key_slots]
        ks = ks.transpose(0, 1).unsqueeze(0)
        vs = vs.transpose(0, 1).unsqueeze(0)
        o = F.scaled_dot_product_attention(
            qs, ks, vs, attn_mask=span.mask, is_causal=span.mask is None, scale=scale, enable_gqa=True
        )
        out[rows] = o.squeeze(0).transpose(0, 1)
    if meta.decode is not None:
        d = meta.decode
        qs = q[d.rows].unsqueeze(2)  # [B, heads, 1, head_dim]
        ks = kf[d.key_slots].transpose(1, 2)  # [B, kv_heads, ctx, head_dim]
        vs = vf[d.key_slots].transpose(1, 2)
        o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=d.mask, scale=scale, enable_gqa=True)
        out[d.rows] = o.squeeze(2)
    return out
