"""Attention over the paged KV cache. `paged_attention` is the one dispatch point: the torch reference
runs on CPU (and is the test oracle); Triton kernels plug in here for CUDA."""
from kernels.attention_metadata import AttentionMetadata, DecodeBatch, PrefillSpan
from kernels.attention_ref import paged_attention_ref, write_kv


def paged_attention(q, k, v, k_cache, v_cache, meta: AttentionMetadata, scale: float):
    write_kv(k, v, k_cache, v_cache, meta)
    return paged_attention_ref(q, k, v, k_cache, v_cache, meta, scale)


__all__ = ["AttentionMetadata", "DecodeBatch", "PrefillSpan", "paged_attention", "write_kv"]
