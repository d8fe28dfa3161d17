"""Prefill/extend attention over the paged cache: the new tokens of several sequences packed in one
step, each attending causally to its cached prefix plus its own chunk.

Contract: q [tokens, heads, head_dim], sequence s owns rows query_start[s]:query_start[s+1];
context_lens [seqs] int32 counts its tokens after this step (cached prefix + this chunk, whose K/V is
already stored in the cache); block_tables [seqs, max_blocks] int32. Query row i of sequence s sits at
position context_lens[s] - q_len_s + i and sees keys at positions <= its own (and, with sliding_window
w, > its own - w). max_query_len is the longest chunk (a host int for the launch grid). Caches as in
decode_attention. Returns [tokens, heads, head_dim] in q's dtype.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.decode_attention import dequant, gather_blocks
from kernels.store_kv import FP8_DTYPE


def extend_attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, query_start: torch.Tensor,
                         context_lens: torch.Tensor, block_tables: torch.Tensor, max_query_len: int, scale: float,
                         sliding_window: int | None = None, k_scale: float = 1.0, v_scale: float = 1.0) -> torch.Tensor:
    """Torch twin (the CPU path and the oracle)."""
    out = torch.empty_like(q)
    bs = k_cache.shape[1]
    starts = query_start.tolist()
    lens = context_lens.tolist()
    for s, ctx in enumerate(lens):
        q0, q1 = starts[s], starts[s + 1]
        n = q1 - q0
        if n == 0:
            continue
        table = block_tables[s, : -(-ctx // bs)]
        ks = dequant(gather_blocks(k_cache, table), k_scale, q.dtype)[:ctx]
        vs = dequant(gather_blocks(v_cache, table), v_scale, q.dtype)[:ctx]
        qs = q[q0:q1].transpose(0, 1).unsqueeze(0)
        ks = ks.transpose(0, 1).unsqueeze(0)
        vs = vs.transpose(0, 1).unsqueeze(0)
        if ctx == n and (sliding_window is None or n <= sliding_window):
            o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale, enable_gqa=True)
        else:
            q_pos = torch.arange(ctx - n, ctx, device=q.device)[:, None]
            k_pos = torch.arange(ctx, device=q.device)[None, :]
            allowed = k_pos <= q_pos
            if sliding_window is not None:
                allowed &= k_pos > q_pos - sliding_window
            o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=allowed, scale=scale, enable_gqa=True)
        out[q0:q1] = o.squeeze(0).transpose(0, 1)
    return out


def check_extend_attention(q, k_cache, v_cache, query_start, context_lens, block_tables) -> None:
    assert q.dim() == 3, f"q must be [tokens, heads, head_dim], got {tuple(q.shape)}"
    assert k_cache.dim() == 4 and k_cache.shape == v_cache.shape, "caches must be [blocks, block_size, kv_heads, head_dim]"
    assert q.shape[2] == k_cache.shape[3], f"head_dim of q ({q.shape[2]}) and cache ({k_cache.shape[3]}) differ"
    assert q.shape[1] % k_cache.shape[2] == 0, f"{q.shape[1]} query heads are not a multiple of {k_cache.shape[2]} KV heads"
    seqs = context_lens.shape[0]
    assert query_start.shape == (seqs + 1,), "query_start must be [seqs + 1]"
    assert block_tables.dim() == 2 and block_tables.shape[0] == seqs, "block_tables must be [seqs, max_blocks]"
    for t in (query_start, context_lens, block_tables):
        assert t.dtype == torch.int32, "query_start/context_lens/block_tables must be int32"
    assert k_cache.dtype in (q.dtype, FP8_DTYPE), f"cache dtype {k_cache.dtype} vs q dtype {q.dtype}"


def extend_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, query_start: torch.Tensor,
                     context_lens: torch.Tensor, block_tables: torch.Tensor, max_query_len: int, scale: float,
                     sliding_window: int | None = None, k_scale: float = 1.0, v_scale: float = 1.0) -> torch.Tensor:
    check_extend_attention(q, k_cache, v_cache, query_start, context_lens, block_tables)
    return extend_attention_ref(q, k_cache, v_cache, query_start, context_lens, block_tables, max_query_len, scale,
                                sliding_window, k_scale, v_scale)
