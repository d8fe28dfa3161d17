"""Paged decode attention: one query token per sequence against its block table.

Contract: q [batch, heads, head_dim]; k_cache, v_cache [num_blocks, block_size, kv_heads, head_dim]
(model dtype, or float8_e4m3fn dequantized with k_scale / v_scale); block_tables [batch, max_blocks]
int32 (entries past a sequence's last block are ignored); context_lens [batch] int32, the number of
tokens each query attends to, its own included (its K/V is already stored). With sliding_window w
a query at position p sees keys in (p - w, p]. Returns [batch, heads, head_dim] in q's dtype.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.store_kv import FP8_DTYPE


def gather_blocks(cache: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
    """[len(block_ids) * block_size, kv_heads, head_dim]: whole blocks copied at once (much faster on
    CPU than gathering slot by slot)."""
    return cache.view(cache.shape[0], -1).index_select(0, block_ids.long()).view(-1, *cache.shape[2:])


def dequant(x: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    return x.to(dtype) * scale if x.dtype == FP8_DTYPE else x


def group_by_length(lens: list[int], min_group: int = 8, max_waste: float = 1.3) -> list[list[int]]:
    """Indices in groups of similar length: each group is padded to its longest member, and on CPU
    the padded K/V copy is the cost of decode attention at large batch."""
    order = sorted(range(len(lens)), key=lambda i: lens[i])
    groups: list[list[int]] = []
    for i in order:
        if groups and (len(groups[-1]) < min_group or lens[i] <= max_waste * lens[groups[-1][0]]):
            groups[-1].append(i)
        else:
            groups.append([i])
    return groups


def decode_attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                         context_lens: torch.Tensor, scale: float, sliding_window: int | None = None,
                         k_scale: float = 1.0, v_scale: float = 1.0) -> torch.Tensor:
    """Torch twin (the CPU path and the oracle)."""
    out = torch.empty_like(q)
    bs = k_cache.shape[1]
    lens = context_lens.tolist()
    for group in group_by_length(lens):
        rows = torch.tensor(group, dtype=torch.long, device=q.device)
        max_ctx = max(lens[i] for i in group)
        nblk = -(-max_ctx // bs)
        table = block_tables[rows, :nblk].reshape(-1)
        b = len(group)
        ks = dequant(gather_blocks(k_cache, table), k_scale, q.dtype).view(b, nblk * bs, *k_cache.shape[2:])
        vs = dequant(gather_blocks(v_cache, table), v_scale, q.dtype).view(b, nblk * bs, *v_cache.shape[2:])
        ctx = context_lens[rows].long()[:, None]
        k_pos = torch.arange(nblk * bs, device=q.device)[None, :]
        allowed = k_pos < ctx
        if sliding_window is not None:
            allowed &= k_pos > ctx - 1 - sliding_window
        mask = torch.zeros(allowed.shape, dtype=q.dtype, device=q.device).masked_fill_(~allowed, float("-inf"))
        o = F.scaled_dot_product_attention(q[rows].unsqueeze(2), ks.transpose(1, 2), vs.transpose(1, 2),
                                           attn_mask=mask[:, None, None, :], scale=scale, enable_gqa=True)
        out[rows] = o.squeeze(2)
    return out


def check_decode_attention(q, k_cache, v_cache, block_tables, context_lens) -> None:
    assert q.dim() == 3, f"q must be [batch, heads, head_dim], got {tuple(q.shape)}"
    assert k_cache.dim() == 4 and k_cache.shape == v_cache.shape, "caches must be [blocks, block_size, kv_heads, head_dim]"
    assert q.shape[2] == k_cache.shape[3], f"head_dim of q ({q.shape[2]}) and cache ({k_cache.shape[3]}) differ"
    assert q.shape[1] % k_cache.shape[2] == 0, f"{q.shape[1]} query heads are not a multiple of {k_cache.shape[2]} KV heads"
    assert block_tables.dim() == 2 and block_tables.shape[0] == q.shape[0], "block_tables must be [batch, max_blocks]"
    assert context_lens.shape == (q.shape[0],), "context_lens must be [batch]"
    assert block_tables.dtype == torch.int32 and context_lens.dtype == torch.int32, "block_tables/context_lens must be int32"
    assert k_cache.dtype in (q.dtype, FP8_DTYPE), f"cache dtype {k_cache.dtype} vs q dtype {q.dtype}"


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                     context_lens: torch.Tensor, scale: float, sliding_window: int | None = None,
                     k_scale: float = 1.0, v_scale: float = 1.0) -> torch.Tensor:
    check_decode_attention(q, k_cache, v_cache, block_tables, context_lens)
    return decode_attention_ref(q, k_cache, v_cache, block_tables, context_lens, scale, sliding_window, k_scale, v_scale)
