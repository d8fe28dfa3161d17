"""Engine block events -> the wire events routers subscribe to (chains of stored hashes, removals)."""
from __future__ import annotations

from shared.engine.block_events import BlockEvent, BlockRemoved, BlockStored
from shared.protocol import events as wire_events


def to_wire(worker_id: str, events: list[BlockEvent]) -> list[wire_events.BlockStored | wire_events.BlockRemoved]:
    """Consecutive stores that extend one chain become one message; order is kept."""
    out: list[wire_events.BlockStored | wire_events.BlockRemoved] = []
    for e in events:
        last = out[-1] if out else None
        if isinstance(e, BlockStored):
            if isinstance(last, wire_events.BlockStored) and last.hashes[-1] == e.parent_hash:
                last.hashes.append(e.block_hash)
            else:
                out.append(wire_events.BlockStored(worker_id=worker_id, hashes=[e.block_hash], parent=e.parent_hash))
        elif isinstance(e, BlockRemoved):
            if isinstance(last, wire_events.BlockRemoved):
                last.hashes.append(e.block_hash)
            else:
                out.append(wire_events.BlockRemoved(worker_id=worker_id, hashes=[e.block_hash]))
    return out
