"""KVBlocks (shared/kv_blocks.py): split, concat, the wire both ways, and bad shapes refused where made."""
from __future__ import annotations

import pytest
import torch

from shared import wire
from shared.kv_blocks import KVBlocks
from shared.protocol.kvstore import PutRequest

L, BS, H, D = 3, 4, 2, 8


def make(n: int, first_block: int = 0, hashed: bool = True, dtype: torch.dtype = torch.float32) -> KVBlocks:
    k = torch.randn(L, n, BS, H, D).to(dtype)
    v = torch.randn(L, n, BS, H, D).to(dtype)
    hashes = [bytes([first_block + i]) * 8 for i in range(n)] if hashed else []
    return KVBlocks(k, v, first_block, 0, hashes)


def same(a: KVBlocks, b: KVBlocks) -> bool:
    return (a.first_block, a.first_layer, a.hashes) == (b.first_block, b.first_layer, b.hashes) and \
        torch.equal(a.k.view(torch.uint8), b.k.view(torch.uint8)) and torch.equal(a.v.view(torch.uint8), b.v.view(torch.uint8))


def test_split_and_concat_are_inverse() -> None:
    kv = make(5, first_block=2)
    head, tail = kv.split(2)
    assert (head.first_block, head.num_blocks, tail.first_block, tail.num_blocks) == (2, 2, 4, 3)
    assert head.hashes == kv.hashes[:2] and tail.hashes == kv.hashes[2:]
    assert same(KVBlocks.concat([head, tail]), kv)
    assert same(KVBlocks.concat(kv.split_every(2)), kv) and [p.num_blocks for p in kv.split_every(2)] == [2, 2, 1]
    assert kv.nbytes == 5 * kv.bytes_per_block == 2 * L * 5 * BS * H * D * 4


def test_concat_refuses_gaps_layer_mismatch_and_mixed_naming() -> None:
    a, b = make(2, 0), make(2, 3)
    with pytest.raises(ValueError, match="not consecutive"):
        KVBlocks.concat([a, b])
    with pytest.raises(ValueError, match="layer"):
        KVBlocks.concat([a, make(2, 2).layers(1, 3)])
    with pytest.raises(ValueError, match="with and without"):
        KVBlocks.concat([a, make(2, 2, hashed=False)])
    with pytest.raises(ValueError):
        KVBlocks.concat([])


def test_gather_keeps_hashes_of_blocks_from_anywhere() -> None:
    a, b = make(2, 7), make(1, 3)
    g = KVBlocks.gather([a, b])
    assert g.first_block == 0 and g.hashes == a.hashes + b.hashes and torch.equal(g.k[:, 2], b.k[:, 0])
    with pytest.raises(ValueError, match="name"):
        KVBlocks.gather([make(1, hashed=False)])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn])
def test_kvstore_wire_round_trip(dtype: torch.dtype) -> None:
    kv = make(3, first_block=5, dtype=dtype)
    parents = [None, kv.hashes[0], kv.hashes[1]]
    msg = wire.decode(wire.encode(PutRequest(blocks=kv.to_stored(parents))), PutRequest)
    assert [b.parent for b in msg.blocks] == parents
    assert same(KVBlocks.from_stored(msg.blocks, first_block=5), kv)


def test_layer_tensors_round_trip_keeps_the_layer_range() -> None:
    part = make(2, first_block=4).layers(1, 3)
    back = KVBlocks.from_layer_tensors(part.to_layer_tensors(), first_block=4, first_layer=1)
    assert back.first_layer == 1 and torch.equal(back.k, part.k) and torch.equal(back.v, part.v)


def test_bad_shapes_are_refused_where_made() -> None:
    k = torch.zeros(L, 2, BS, H, D)
    with pytest.raises(ValueError, match="shaped"):
        KVBlocks(k, torch.zeros(L, 3, BS, H, D))
    with pytest.raises(ValueError, match="shaped"):
        KVBlocks(k[0], k[0].clone())
    with pytest.raises(ValueError, match="shaped"):
        KVBlocks(k, k.to(torch.float16))
    with pytest.raises(ValueError, match="hashes"):
        KVBlocks(k, k.clone(), hashes=[b"x"])
    with pytest.raises(ValueError, match="without hashes"):
        make(2, hashed=False).to_stored()
    with pytest.raises(ValueError, match="every layer"):
        make(2).layers(1, 2).to_stored()
    stored = make(2).to_stored()
    odd = stored[1].model_copy(update={"k": wire.tensor_to_wire(torch.zeros(L, BS + 1, H, D))})
    with pytest.raises(ValueError, match="differ in dtype or shape"):
        KVBlocks.from_stored([stored[0], odd])
    with pytest.raises(ValueError, match="per layer"):
        KVBlocks.from_layer_tensors(make(1).to_layer_tensors()[:1], 0, 0)
