"""Per-step attention metadata over the paged KV cache, built once per step and shared by all layers.

The KV cache contract (design.md): per layer, K and V are [num_blocks, block_size, kv_heads, head_dim];
slot = block_id * block_size + offset; slot -1 means "do not write".
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class PrefillSpan:
    """A sequence with several query tokens this step (a prompt chunk)."""

    q_start: int  # first row of this sequence in the flattened step
    q_len: int
    ctx_len: int  # tokens of context after this step (cached + new)
    block_table: torch.Tensor | None  # [ceil(ctx_len / block_size)] blocks holding the context; None: no
    # earlier context, attend to this step's fresh K/V
    mask: torch.Tensor | None  # [q_len, ctx_len] bool, True = attend; None: plain causal


@dataclass
class DecodeBatch:
    """Sequences with exactly one query token this step, attended to in one padded batch."""

    rows: torch.Tensor  # [B] rows of these tokens in the flattened step
    block_tables: torch.Tensor  # [B, max_blocks], padded with block 0 (masked out)
    mask: torch.Tensor  # [B, 1, 1, max_blocks * block_size] additive float mask: 0 attend, -inf skip


@dataclass
class AttentionMetadata:
    num_tokens: int
    slot_mapping: torch.Tensor  # [num_tokens] long
    write_rows: torch.Tensor | None  # rows whose slot is not -1; None when all are written
    prefills: list[PrefillSpan]
    # Single-token queries, grouped by context length so padding to the longest wastes little.
    decodes: list[DecodeBatch]
