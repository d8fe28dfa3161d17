"""Chained content hashes of full KV blocks, identical in every process and on every machine.

h_0 = H(root, tokens of block 0), h_i = H(h_{i-1}, tokens of block i), where the root folds in the
model id, block size, KV dtype and an optional cache salt, so blocks of different models or tenants
never collide. blake2b, never Python's salted hash().
"""
from __future__ import annotations

import hashlib
import sys
from array import array
from collections.abc import Collection, Sequence

DIGEST_SIZE = 16
BlockHash = bytes


def root_hash(model_id: str, block_size: int, kv_dtype: str, salt: str = "") -> BlockHash:
    seed = f"kvmesh-v1|{model_id}|{block_size}|{kv_dtype}|{salt}".encode()
    return hashlib.blake2b(seed, digest_size=DIGEST_SIZE).digest()


def salted_root(root: BlockHash, salt: str | None) -> BlockHash:
    """A request's own root under a per-request cache salt (vLLM's cache_salt): its blocks hash apart from
    every other salt's and from unsalted ones, on every tier, since all of them key blocks by these hashes."""
    if not salt:
        return root
    return hashlib.blake2b(root + b"|salt|" + salt.encode(), digest_size=DIGEST_SIZE).digest()


def lora_root(root: BlockHash, adapter_digest: str | None) -> BlockHash:
    """A request's root under a LoRA adapter (its digest: the adapter's config and weight bytes,
    shared/models/lora_files.py): KV computed with an adapter differs from the base model's and every other
    adapter's, so its blocks hash apart on every tier, in every prefix hit and KV transfer."""
    if not adapter_digest:
        return root
    return hashlib.blake2b(root + b"|lora|" + adapter_digest.encode(), digest_size=DIGEST_SIZE).digest()


def hash_block(parent: BlockHash, token_ids: Sequence[int]) -> BlockHash:
    h = hashlib.blake2b(parent, digest_size=DIGEST_SIZE)
    # Fixed-width little-endian ids: the byte string is the same on every platform.
    ids = array("q", token_ids)
    if sys.byteorder == "big":
        ids.byteswap()
    h.update(ids.tobytes())
    return h.digest()


def hash_blocks(root: BlockHash, token_ids: Sequence[int], block_size: int, start_parent: BlockHash | None = None,
                start_block: int = 0) -> list[BlockHash]:
    """Hashes of every full block of token_ids from block start_block on (earlier ones chained into start_parent)."""
    hashes: list[BlockHash] = []
    parent = root if start_parent is None else start_parent
    for i in range(start_block, len(token_ids) // block_size):
        parent = hash_block(parent, token_ids[i * block_size : (i + 1) * block_size])
        hashes.append(parent)
    return hashes


def held_prefix(chain: Sequence[BlockHash], held: Collection[BlockHash]) -> int:
    """How many of chain's blocks, from the first, `held` has: a block is only reusable after its whole
    prefix, so the count stops at the first one missing."""
    n = 0
    for h in chain:
        if h not in held:
            break
        n += 1
    return n
