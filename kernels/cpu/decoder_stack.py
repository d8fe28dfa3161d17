"""Wrapper of decoder_stack.cpp: a Llama-family decoder stack held in C++ (weights handed over once) and run for a
whole CPU step in one call. shared/models/cpu_native.py builds one from a model; its oracle is the model's own
eager forward (the torch twins), compared token for token by tests/test_cpu_native_stack.py."""
from __future__ import annotations

import weakref

import torch

from kernels.attention_metadata import AttentionMetadata

DENSE, PACKED, INT4, INT8, W16, GGUF, DP = 0, 1, 2, 3, 5, 6, 7  # decoder_stack.cpp's Kind (4 is the row split)


class DecoderStack:
    def __init__(self, final_norm: torch.Tensor, eps: float, heads: int, kv_heads: int, head_dim: int, scale: float,
                 sliding_window: int | None) -> None:
        assert heads % kv_heads == 0 and head_dim % 2 == 0
        self.dtype = final_norm.dtype
        self.handle = torch.ops.kvmesh_cpu.stack_new(final_norm, eps, heads, kv_heads, head_dim, scale,
                                                     sliding_window or 0)
        weakref.finalize(self, torch.ops.kvmesh_cpu.stack_free, self.handle)
        self.num_layers = 0
        self._caches: list | None = None  # the KV cache list last handed over (the runner swaps in a temporary one)
        self.calls = 0  # steps run (tests check the C++ path was taken)

    def linear(self, kind: int, a: torch.Tensor, b: torch.Tensor | None = None, bias: torch.Tensor | None = None,
               group: int = 0) -> int:
        return torch.ops.kvmesh_cpu.stack_linear(self.handle, kind, a, b, bias, group)

    def split(self, quantized: int, dense: int, max_rows: int) -> int:
        return torch.ops.kvmesh_cpu.stack_split(self.handle, quantized, dense, max_rows)

    def layer(self, in_norm: torch.Tensor, post_norm: torch.Tensor, q_norm: torch.Tensor | None,
              k_norm: torch.Tensor | None, qkv: int, o: int, gate_up: int, down: int) -> None:
        for w in (in_norm, post_norm, q_norm, k_norm):
            assert w is None or (w.dtype == self.dtype and w.is_contiguous()), "norm weights in the model dtype"
        torch.ops.kvmesh_cpu.stack_layer(self.handle, in_norm, post_norm, q_norm, k_norm, qkv, o, gate_up, down)
        self.num_layers += 1

    def run(self, x: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor, meta: AttentionMetadata,
            kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """x: the step's embeddings [tokens, hidden] (consumed: overwritten). Returns the final norm's output."""
        assert x.dtype == self.dtype and x.dim() == 2
        if kv_caches is not self._caches:
            assert len(kv_caches) == self.num_layers, f"{len(kv_caches)} KV caches for {self.num_layers} layers"
            torch.ops.kvmesh_cpu.stack_caches(self.handle, [t for kv in kv_caches for t in kv])
            self._caches = kv_caches
        self.calls += 1
        return torch.ops.kvmesh_cpu.stack_run(
            self.handle, x.contiguous(), positions, cos_sin, meta.slot_mapping, meta.num_prefill_tokens,
            meta.prefill_query_start, meta.prefill_context_lens, meta.prefill_block_tables, meta.decode_context_lens,
            meta.decode_block_tables)
