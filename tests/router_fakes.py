"""A fake clock and load beats for the router's unit tests (tests/test_gateway_units.py,
tests/test_router_observed.py)."""
from __future__ import annotations

from shared.block_hash import root_hash
from shared.protocol.events import LoadBeat

ROOT = root_hash("tiny", 4, "float32")


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def beat(worker: str, running: int = 0, waiting: int = 0, free: int = 100) -> LoadBeat:
    return LoadBeat(worker_id=worker, running=running, waiting=waiting, free_blocks=free, total_blocks=100,
                    block_size=4, hash_root=ROOT, max_model_len=512)
