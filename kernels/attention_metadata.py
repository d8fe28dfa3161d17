"""Per-step attention metadata over the paged KV cache, built once per step and shared by all layers.

The KV cache contract (design.md): per layer, K and V are [num_blocks, block_size, kv_heads, head_dim];
slot = block_id * block_size + offset; slot -1 means "do not write".

A step's rows are ordered: first the sequences with several new tokens (prompt chunks; extend attention),
then the sequences with exactly one (decode attention). Every tensor here is a view into the one buffer the
runner copies to the device per step; only the host ints (row counts, the longest chunk) are Python values.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [tokens] int32; -1: do not write
    num_prefill_tokens: int  # rows [0, num_prefill_tokens) are prompt chunks, the rest decode rows
    prefill_query_start: torch.Tensor  # [prefills + 1] int32, offsets of each chunk's rows
    prefill_context_lens: torch.Tensor  # [prefills] int32, cached prefix + chunk
    prefill_block_tables: torch.Tensor  # [prefills, max blocks] int32
    max_prefill_query_len: int
    decode_context_lens: torch.Tensor  # [decodes] int32, context including the new token
    decode_block_tables: torch.Tensor  # [decodes, max blocks] int32
    sliding_window: int | None = None
    # The CPU path's per-step derived data (decode grouping and masks), computed by the first layer and
    # reused by the others; never used on CUDA, where the kernels read the tensors above directly.
    cpu_cache: dict[str, Any] = field(default_factory=dict)

    @property
    def num_prefills(self) -> int:
        return self.prefill_context_lens.shape[0]

    @property
    def num_decodes(self) -> int:
        return self.decode_context_lens.shape[0]
