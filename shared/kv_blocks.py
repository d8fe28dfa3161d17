"""KVBlocks: the one type for KV that leaves the device pool, on any path (prefill outputs, the host
tier, offload, prefix fetches, the kvstore client, the data plane).

K and V of consecutive logical blocks of one prompt, a range of layers each:
[layers, blocks, block_size, kv_heads, head_dim]. `first_block` is the logical index of the first block
within its prompt, `first_layer` the first layer held; `hashes` names each block when known (the tiers
and the kvstore key blocks by it) and is empty when not (a transfer's blocks are named by the
receiver's reservation). Validated at construction, so a wrongly shaped payload fails where it is
made, not where it is written.
"""
from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass, field

import torch

from shared.protocol.kvstore import StoredBlock
from shared.wire import WireTensor, stacked_from_wire, tensor_to_wire


@dataclass(frozen=True)
class KVBlocks:
    k: torch.Tensor
    v: torch.Tensor
    first_block: int = 0
    first_layer: int = 0
    hashes: list[bytes] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.k.dim() != 5 or self.k.shape != self.v.shape or self.k.dtype != self.v.dtype:
            raise ValueError(f"KV blocks need K and V of one dtype shaped [layers, blocks, block_size, kv_heads, "
                             f"head_dim], got {tuple(self.k.shape)} {self.k.dtype} / {tuple(self.v.shape)} {self.v.dtype}")
        if self.hashes and len(self.hashes) != self.k.shape[1]:
            raise ValueError(f"{len(self.hashes)} hashes for {self.k.shape[1]} blocks")
        if self.first_block < 0 or self.first_layer < 0:
            raise ValueError(f"negative first block {self.first_block} or first layer {self.first_layer}")

    @property
    def num_blocks(self) -> int:
        return self.k.shape[1]

    @property
    def num_layers(self) -> int:
        return self.k.shape[0]

    @property
    def end_block(self) -> int:
        return self.first_block + self.num_blocks

    @property
    def nbytes(self) -> int:
        return 2 * self.k.numel() * self.k.element_size()

    @property
    def bytes_per_block(self) -> int:
        """K and V of one block, all layers held."""
        return 2 * self.k[:, :1].numel() * self.k.element_size()

    def blocks(self, start: int, stop: int | None = None) -> KVBlocks:
        """Blocks [start, stop) of these (indices relative to this payload), views of the same memory."""
        stop = self.num_blocks if stop is None else min(stop, self.num_blocks)
        start = min(max(start, 0), stop)
        return KVBlocks(self.k[:, start:stop], self.v[:, start:stop], self.first_block + start, self.first_layer,
                        self.hashes[start:stop])

    def layers(self, start: int, stop: int) -> KVBlocks:
        """Layers [start, stop) of these (relative), views of the same memory."""
        return KVBlocks(self.k[start:stop], self.v[start:stop], self.first_block, self.first_layer + start,
                        self.hashes)

    def split(self, at: int) -> tuple[KVBlocks, KVBlocks]:
        """The first `at` blocks and the rest."""
        return self.blocks(0, at), self.blocks(at)

    def split_every(self, n: int) -> list[KVBlocks]:
        """Consecutive runs of at most n blocks."""
        return [self.blocks(i, i + n) for i in range(0, self.num_blocks, max(n, 1))]

    @staticmethod
    def concat(parts: Seq[KVBlocks]) -> KVBlocks:
        """Consecutive runs of the same layers as one (no copy for a single part). Runs with hashes and
        runs without cannot be mixed: the result would name some blocks and not others."""
        if not parts:
            raise ValueError("nothing to concatenate")
        if len(parts) == 1:
            return parts[0]
        first = parts[0]
        for a, b in zip(parts, parts[1:]):
            if b.first_block != a.end_block:
                raise ValueError(f"KV blocks not consecutive: {a.first_block}..{a.end_block} then {b.first_block}")
        if any(p.first_layer != first.first_layer or p.num_layers != first.num_layers for p in parts):
            raise ValueError("KV blocks of different layer ranges")
        if len({bool(p.hashes) for p in parts if p.num_blocks}) > 1:
            raise ValueError("KV blocks with and without hashes")
        return KVBlocks(torch.cat([p.k for p in parts], dim=1), torch.cat([p.v for p in parts], dim=1),
                        first.first_block, first.first_layer, [h for p in parts for h in p.hashes])

    @staticmethod
    def gather(parts: Seq[KVBlocks]) -> KVBlocks:
        """Named blocks from anywhere (not one prompt's consecutive run: what is offloaded together), as
        one payload numbered from 0 that keeps every block's hash."""
        if not parts:
            raise ValueError("nothing to gather")
        if any(len(p.hashes) != p.num_blocks for p in parts):
            raise ValueError("gathered KV blocks must each name their blocks")
        return KVBlocks.concat(_renumbered(parts))

    def cpu(self) -> KVBlocks:
        if not self.k.is_cuda:
            return self
        return KVBlocks(self.k.cpu(), self.v.cpu(), self.first_block, self.first_layer, self.hashes)

    # --- the wire ---------------------------------------------------------------------------------

    def to_stored(self, parents: Seq[bytes | None] | None = None) -> list[StoredBlock]:
        """One kvstore StoredBlock per block (all layers; each k, v [layers, block_size, heads, dim])."""
        if not self.hashes:
            raise ValueError("KV blocks without hashes cannot be stored")
        if self.first_layer != 0:
            raise ValueError("the kvstore holds whole blocks: every layer from the first")
        parents = list(parents) if parents is not None else [None] * self.num_blocks
        return [StoredBlock(hash=h, parent=p, k=tensor_to_wire(self.k[:, i]), v=tensor_to_wire(self.v[:, i]))
                for i, (h, p) in enumerate(zip(self.hashes, parents))]

    @staticmethod
    def from_stored(blocks: Seq[StoredBlock], first_block: int = 0) -> KVBlocks:
        return KVBlocks(*_stacked([b.k for b in blocks], [b.v for b in blocks], 1), first_block, 0,
                        [b.hash for b in blocks])

    def to_layer_tensors(self) -> list[WireTensor]:
        """[k(first_layer), v(first_layer), k(first_layer + 1), ...], each [blocks, block_size, heads, dim]:
        a KVBlockChunk's tensors."""
        out = []
        for layer in range(self.num_layers):
            out += [tensor_to_wire(self.k[layer]), tensor_to_wire(self.v[layer])]
        return out

    @staticmethod
    def from_layer_tensors(tensors: Seq[WireTensor], first_block: int, first_layer: int) -> KVBlocks:
        if len(tensors) % 2:
            raise ValueError("expected one K and one V tensor per layer")
        return KVBlocks(*_stacked(list(tensors[0::2]), list(tensors[1::2]), 0), first_block, first_layer)

def _renumbered(parts: Seq[KVBlocks]) -> list[KVBlocks]:
    out, at = [], 0
    for p in parts:
        out.append(KVBlocks(p.k, p.v, at, p.first_layer, p.hashes))
        at += p.num_blocks
    return out


def _stacked(ks: list[WireTensor], vs: list[WireTensor], dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V stacked from wire tensors of one shape [.., block_size, heads, dim] (by numpy, on one thread:
    this runs on event loops; see shared/wire.py stacked_from_wire)."""
    if not ks or len(ks) != len(vs) or len(ks[0].shape) != 4:
        raise ValueError("K and V need one tensor each per block or layer, each [n, block_size, heads, dim]")
    return stacked_from_wire(ks + vs, dim).split(len(ks), dim)
