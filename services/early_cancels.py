"""Cancels that arrived before their request, remembered (a bounded number) so the request is refused when it comes.

A worker handles requests and cancels in separate tasks (and a prefill request may wait in its subscription while
the engine thread is busy), so a cancel can overtake its request: forgotten, the request would then run to its end
for a client that is gone, holding KV blocks and engine slots meanwhile.
"""
from __future__ import annotations

from collections import OrderedDict

KEPT = 10_000


class EarlyCancels:
    def __init__(self, kept: int = KEPT) -> None:
        self._kept = kept
        self._ids: OrderedDict[str, None] = OrderedDict()

    def remember(self, rid: str) -> None:
        self._ids[rid] = None
        while len(self._ids) > self._kept:
            self._ids.popitem(last=False)

    def take(self, rid: str) -> bool:
        """True once for a request whose cancel came first."""
        return self._ids.pop(rid, "missing") is None
