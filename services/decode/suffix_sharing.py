"""Shared suffix decoding: the decode workers of one mesh teach each other's worker-wide suffix tables.

Each worker publishes the output tokens of the requests it finished (stop or length, the last
MAX_SHARED_TOKENS of each, batched per step) on its own subject; every decode worker of the same model (same
block-hash root) adds the others' to its suffix table under the output's cache salt, so a salted request still
drafts only from its own salt's outputs. Neither the salt nor the root is sent (every decode identity reads every
message): one-way tags keyed by the root stand for them (shared/protocol/suffix.py). A worker knows a salt's
tag once a request of that salt came to it (the last MAX_KNOWN_SALTS salts); a peer's output under a salt it
has not served is dropped, as no request of its own could draft from it yet. The table's own bound (suffix_decoding_max_cached_requests) applies to
all outputs alike, so peers can never grow it. Only workers whose speculative method is suffix take part.

Counting an output costs the engine thread about depth x its length dict updates (tens of microseconds a token
on this 2-core CPU), and every worker counts every peer's outputs: a mesh of many busy workers would spend its
engine threads on the others' answers. So peers' tokens are learned within a budget of learn_tokens_per_s
(a token bucket holding one second's worth); outputs past it are dropped and counted (a lost hint costs
acceptance only, never a request's tokens: verification is exact).
"""
from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from collections import OrderedDict

from nats.aio.client import Client

from shared import bus, subjects
from shared.engine.commands import LearnOutputs
from shared.engine.engine_thread import EngineThread
from shared.protocol.suffix import SharedOutput, SuffixOutputs

log = logging.getLogger(__name__)
MAX_SHARED_TOKENS = 512  # an output's last tokens that travel: bounds each message and what a peer counts
LEARN_TOKENS_PER_S = 4096  # peers' tokens a worker counts per second at most (see above)
MAX_KNOWN_SALTS = 4096  # salts of this worker's recent requests whose tags it recognises


def model_tag(root: bytes) -> bytes:
    return hashlib.blake2b(b"kvmesh suffix model", key=root[:64], digest_size=16).digest()


def salt_tag(root: bytes, salt: str | None) -> bytes | None:
    if not salt:
        return None
    return hashlib.blake2b(b"kvmesh suffix salt|" + salt.encode(), key=root[:64], digest_size=16).digest()


class SuffixSharing:
    def __init__(self, nc: Client, worker_id: str, hash_root: bytes, thread: EngineThread,
                 learn_tokens_per_s: float = LEARN_TOKENS_PER_S) -> None:
        self.nc, self.worker_id, self.hash_root, self.thread = nc, worker_id, hash_root, thread
        self.model_tag = model_tag(hash_root)
        self._salts: OrderedDict[bytes, str] = OrderedDict()  # tag -> salt, of this worker's recent requests
        self.unknown_salt = 0  # peers' outputs under a salt this worker has not served (dropped)
        self.published = 0  # outputs sent to the other workers
        self.learned = 0  # outputs of other workers added to this worker's table
        self.dropped = 0  # outputs of other workers past the learning budget
        self.rate = learn_tokens_per_s
        self._budget = learn_tokens_per_s  # tokens that may be learned now (refilled with time, up to rate)
        self._refilled = time.monotonic()
        self._sends: set[asyncio.Task] = set()
        self._sub = None

    async def start(self) -> None:
        self._sub = await bus.subscribe(self.nc, subjects.DECODE_SUFFIX_ALL, self._on_outputs, SuffixOutputs)

    async def stop(self) -> None:
        if self._sends:
            await asyncio.gather(*self._sends, return_exceptions=True)
        if self._sub is not None:
            await self._sub.unsubscribe()

    def saw_salt(self, salt: str | None) -> None:
        """A request of this cache salt came to this worker: peers' outputs under it are learned from now on."""
        tag = salt_tag(self.hash_root, salt)
        if tag is None:
            return
        self._salts[tag] = salt  # type: ignore[assignment]
        self._salts.move_to_end(tag)
        while len(self._salts) > MAX_KNOWN_SALTS:
            self._salts.popitem(last=False)

    def publish(self, outputs: list[tuple[str | None, list[int]]]) -> None:
        """(cache salt, output tokens) of requests this worker finished in one step (called on the event loop)."""
        shared = [SharedOutput(salt_tag=salt_tag(self.hash_root, salt), token_ids=tokens[-MAX_SHARED_TOKENS:])
                  for salt, tokens in outputs if len(tokens) >= 2]
        if not shared:
            return
        msg = SuffixOutputs(worker_id=self.worker_id, model_tag=self.model_tag, outputs=shared)
        task = asyncio.ensure_future(self._send(msg))
        self._sends.add(task)
        task.add_done_callback(self._sends.discard)

    async def _send(self, msg: SuffixOutputs) -> None:
        try:
            await bus.publish(self.nc, subjects.decode_suffix(self.worker_id), msg)
            self.published += len(msg.outputs)
        except Exception:  # noqa: BLE001 - a lost hint costs acceptance only, never a request
            log.warning("could not share %d finished output(s)", len(msg.outputs), exc_info=True)

    async def _on_outputs(self, msg: SuffixOutputs, ctx: bus.RequestContext) -> None:
        if msg.worker_id == self.worker_id or msg.model_tag != self.model_tag:
            return  # our own, or another model's tokens
        now = time.monotonic()
        self._budget = min(self.rate, self._budget + (now - self._refilled) * self.rate)
        self._refilled = now
        outputs = []
        for o in msg.outputs:
            salt = None if o.salt_tag is None else self._salts.get(o.salt_tag)
            if o.salt_tag is not None and salt is None:
                self.unknown_salt += 1
                continue
            tokens = tuple(o.token_ids[-MAX_SHARED_TOKENS:])
            if len(tokens) > self._budget:
                self.dropped += 1
                continue
            self._budget -= len(tokens)
            outputs.append((salt, tokens))
        if outputs:
            self.learned += await self.thread.run(LearnOutputs(tuple(outputs)))
