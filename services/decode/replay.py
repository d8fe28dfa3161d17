"""The token chunks a decode worker sent recently, per stream, so the gateway can ask for the ones it lost.

When the gateway's NATS connection drops and comes back (its server restarted; it moved to another server of
the cluster), chunks sent meanwhile had no subscriber and are gone. The gateway then asks this worker to resend
from the first chunk it lacks (ReplayRequest on `kvmesh.decode.replay.<worker>`, services/decode/service.py)
instead of migrating the request (a re-prefill elsewhere, and for a sampled stream a different continuation).

What is kept is a reference to each TokenChunk the worker already built (no copy, no encoding), in a deque per
stream. Bounds: chunks and (approximate, resident) bytes per stream, bytes across all streams (the streams
that appended least recently lose their oldest chunks first: finished tails before live streams), and a stream
that ended (finished, aborted, failed) is kept LINGER_S more so its tail can be replayed, then freed. A replay
asking for a chunk no longer kept is a miss: the gateway migrates as before.
"""
from __future__ import annotations

import time
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from itertools import islice

from shared.protocol.generate import TokenChunk

# Approximate resident size of a kept TokenChunk (pydantic model, its lists, boxed ints and floats), measured
# with tracemalloc: ~670 B for a one-token chunk, ~730 B more for one logprob with 5 alternatives.
CHUNK_BYTES = 600
TOKEN_BYTES = 40
LOGPROB_BYTES = 400
TOP_BYTES = 70


@dataclass(frozen=True)
class ReplayLimits:
    # Per stream: a gateway reconnect takes a few seconds (nats-py's reconnect wait, then RECONNECT_GRACE_S of
    # silence in services/gateway/token_stream.py); 1024 one-token chunks are seconds of decoding at the fastest.
    max_chunks: int = 1024
    max_bytes: int = 1 << 20
    total_bytes: int = 64 << 20  # across every stream of the worker
    linger_s: float = 10.0  # a stream's tail is kept this long after its last chunk


def chunk_bytes(c: TokenChunk) -> int:
    """The approximate resident size of a kept chunk: cheap (no walk of its lists but for logprobs)."""
    n = CHUNK_BYTES + TOKEN_BYTES * len(c.token_ids)
    if c.logprobs is not None:
        for lp in c.logprobs:
            n += LOGPROB_BYTES + TOP_BYTES * len(lp.top_ids)
    if c.prompt_logprobs is not None:
        for plp in c.prompt_logprobs:
            n += LOGPROB_BYTES + (TOP_BYTES * len(plp.top_ids) if plp is not None else 0)
    return n


@dataclass
class _Tail:
    chunks: deque[TokenChunk] = field(default_factory=deque)
    bytes: int = 0
    next_seq: int = 0  # the seq of the chunk after the last one kept
    ended: bool = False  # its last chunk (finished, aborted, failed) is kept


class ReplayBuffer:
    """Event-loop only (the decode worker's _emit, _abort and replay handler): no lock."""

    def __init__(self, limits: ReplayLimits = ReplayLimits(), clock: Callable[[], float] = time.monotonic) -> None:
        self.limits = limits
        self._clock = clock
        # Least recently appended first: where the total bound takes chunks from.
        self._tails: OrderedDict[str, _Tail] = OrderedDict()
        self._ended: deque[tuple[float, str]] = deque()  # (when its last chunk was kept, request id), in order
        self.bytes = 0
        self.served = 0  # replays answered with the chunks asked for (cumulative; the worker's load beats carry it)
        self.missed = 0  # replays asked for chunks no longer kept, or of an unknown request

    def __len__(self) -> int:
        return len(self._tails)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._tails

    def keep(self, chunk: TokenChunk) -> None:
        """Called for every chunk the worker sends, in seq order: one reference appended, sizes counted."""
        rid = chunk.request_id
        tail = self._tails.get(rid)
        if tail is None:
            tail = self._tails[rid] = _Tail(next_seq=chunk.seq)
        else:
            self._tails.move_to_end(rid)
        size = chunk_bytes(chunk)
        tail.chunks.append(chunk)
        tail.bytes += size
        tail.next_seq = chunk.seq + 1
        self.bytes += size
        limits = self.limits
        while len(tail.chunks) > limits.max_chunks or tail.bytes > limits.max_bytes:
            self._drop_oldest(tail)
        if self.bytes > limits.total_bytes:
            self._shrink()
        if chunk.finish_reason is not None:
            tail.ended = True
            self._ended.append((self._clock(), rid))
            self.expire()

    def since(self, request_id: str, from_seq: int, live_next_seq: int | None) -> list[TokenChunk] | None:
        """The kept chunks from `from_seq` on (empty: nothing sent after it yet), or None, a miss: the first of
        them is no longer kept, the request is unknown, or its stream neither goes on nor ended with a kept last
        chunk. live_next_seq: the seq of the next chunk of a request the worker still runs (None: it does not).
        Counts the replay as served or missed."""
        self.expire()
        if live_next_seq is not None and from_seq == live_next_seq:  # nothing lost (e.g. still prefilling)
            self.served += 1
            return []
        tail = self._tails.get(request_id)
        first = tail.next_seq - len(tail.chunks) if tail is not None else 0
        if tail is None or not first <= from_seq <= tail.next_seq or not (live_next_seq is not None or tail.ended):
            self.missed += 1
            return None
        self.served += 1
        return list(islice(tail.chunks, from_seq - first, None))

    def forget(self, request_id: str) -> None:
        tail = self._tails.pop(request_id, None)
        if tail is not None:
            self.bytes -= tail.bytes

    def expire(self) -> None:
        """Frees the tails of streams that ended more than linger_s ago (called on every end and replay)."""
        ended = self._ended
        if not ended:
            return
        cutoff = self._clock() - self.limits.linger_s
        while ended and ended[0][0] <= cutoff:
            self.forget(ended.popleft()[1])

    def _drop_oldest(self, tail: _Tail) -> None:
        size = chunk_bytes(tail.chunks.popleft())
        tail.bytes -= size
        self.bytes -= size

    def _shrink(self) -> None:
        tails = self._tails
        while self.bytes > self.limits.total_bytes and tails:
            rid, tail = next(iter(tails.items()))
            self._drop_oldest(tail)
            if not tail.chunks:
                # Emptied: nothing left to replay; keep no entry (a later chunk of a live stream starts a new one,
                # from its seq, so a replay from before it is a miss).
                del tails[rid]
