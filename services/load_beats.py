"""Load beats of an engine worker: one per interval, and debounced ones as soon as its requests or KV usage
change, so the gateway's gauges follow the engine within a few tens of milliseconds instead of a beat interval."""
from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from shared.engine.llm_engine import EngineStats
from shared.kv_transport.outgoing import PushStats
from shared.protocol.events import MAX_DRAFT_POSITIONS, LoadBeat

log = logging.getLogger(__name__)

MIN_SPACING_S = 0.02  # at most 50 beats a second per worker, however busy it is
KV_CHANGE_FRACTION = 0.01  # a change of KV usage this large is worth a beat of its own


class LoadBeats:
    """`changed()` is called on the event loop whenever something a gauge shows may have moved."""

    def __init__(self, interval_s: float, snapshot: Callable[[], Awaitable[LoadBeat]],
                 publish: Callable[[LoadBeat], Awaitable[None]]) -> None:
        self.interval_s = interval_s
        self._snapshot = snapshot
        self._publish = publish
        self._dirty = asyncio.Event()
        self._last_free: int | None = None
        self._task: asyncio.Task | None = None
        self.sent = 0

    def start(self) -> None:
        self._task = asyncio.ensure_future(self._loop())

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()

    def changed(self) -> None:
        self._dirty.set()

    def kv_moved(self, free_blocks: int, total_blocks: int) -> None:
        """Cheap check after each step: a beat only when KV usage moved by KV_CHANGE_FRACTION or more."""
        last = self._last_free
        if last is None or abs(free_blocks - last) >= max(1, int(total_blocks * KV_CHANGE_FRACTION)):
            self._dirty.set()

    async def beat(self) -> None:
        msg = await self._snapshot()
        self._last_free = msg.free_blocks
        await self._publish(msg)
        self.sent += 1

    async def _loop(self) -> None:
        loop = asyncio.get_running_loop()
        last = 0.0
        while True:
            try:
                await asyncio.wait_for(self._dirty.wait(), self.interval_s)
            except asyncio.TimeoutError:
                pass
            wait = MIN_SPACING_S - (loop.time() - last)
            if wait > 0:
                await asyncio.sleep(wait)
            self._dirty.clear()
            last = loop.time()
            try:
                await self.beat()
            except RuntimeError as e:
                if "not running" in str(e):  # the engine thread ended (a crash is reported elsewhere): no more beats
                    return
                log.exception("load beat failed")
            except Exception:  # noqa: BLE001 - a lost beat is repaired by the next one
                log.exception("load beat failed")


def load_beat(worker_id: str, role: str, stats: EngineStats, kvstore_hit_tokens: int, block_size: int,
              hash_root: bytes, max_model_len: int, kv_cache_dtype: str, offloaded: int = 0,
              offload_dropped: int = 0, host_hit_tokens: int = 0, host_bytes: int = 0,
              kv_endpoint: str = "", kv_push: PushStats | None = None, bus_reconnects: int = 0,
              lora_adapters: list[str] | None = None, lora_resident: list[str] | None = None,
              incarnation: str = "") -> LoadBeat:
    push = kv_push or PushStats()
    hist = stats.iteration_tokens
    spec = stats.spec_decode
    verify = stats.verify_steps
    return LoadBeat(
        worker_id=worker_id, role=role, running=stats.running, waiting=stats.waiting,
        free_blocks=stats.free_blocks, total_blocks=stats.total_blocks, block_size=block_size,
        hash_root=hash_root, max_model_len=max_model_len, num_preemptions=stats.num_preemptions,
        prefix_cache_queries=stats.prefix_cache_queries, prefix_cache_hits=stats.prefix_cache_hits + kvstore_hit_tokens + host_hit_tokens,
        iteration_token_buckets=list(hist.buckets) if hist else [],
        iteration_token_counts=list(hist.counts) if hist else [],
        iteration_tokens_sum=hist.total if hist else 0, kv_cache_dtype=kv_cache_dtype,
        offloaded_blocks=offloaded, offload_dropped_blocks=offload_dropped, host_tier_hit_tokens=host_hit_tokens,
        kvstore_hit_tokens=kvstore_hit_tokens, host_tier_bytes=host_bytes, kv_endpoint=kv_endpoint,
        kv_pushes=push.pushes, kv_push_bytes=push.bytes, kv_push_wait_seconds=push.wait_s,
        kv_handout_seconds=stats.kv_handout_seconds,
        bus_reconnects=bus_reconnects, incarnation=incarnation, lora_adapters=lora_adapters or [],
        lora_resident=lora_resident or [],
        spec_num_drafts=spec.num_drafts if spec else 0, spec_num_draft_tokens=spec.num_draft_tokens if spec else 0,
        spec_num_accepted_tokens=spec.num_accepted_tokens if spec else 0,
        spec_num_accepted_tokens_per_pos=list(spec.num_accepted_tokens_per_pos[:MAX_DRAFT_POSITIONS]) if spec else [],
        spec_verify_graph_replays=verify.replays if verify else 0,
        spec_verify_padded_eager=verify.padded_eager if verify else 0,
        spec_verify_eager=verify.eager if verify else 0)
