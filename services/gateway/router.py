"""KV-aware routing: send a prompt to the decode worker that already caches most of it.

Workers publish BlockStored/BlockRemoved (what they cache) and a LoadBeat about once a second
(how busy they are, and how they hash blocks). A worker is alive while its beats keep coming, judged by
the beats the gateway manages to handle, not by the wall clock alone (Router._silent).
Tier-aware: a worker loads a prompt's blocks from its device pool, then its host tier, then the
kvstore (which every worker reaches alike), and computes the rest. Score = 1 - the prompt's cost on
that worker as a fraction of computing it all (a block costs 0 on the device, `host_cost` from the
host tier, `kvstore_cost` from the kvstore, 1 computed) - load, where load mixes KV usage and queue
length, so a worker with the whole prefix still loses to an idle one once it is busy enough.
Workers whose waiting queue is at the bound take nothing new.

Load is what the gateway knows before what a worker says (Router._load). The gateway counts the streams it
sent to each worker and has not seen end, and measures how fast each worker answers them (dispatch to first
token, gap per token: services/gateway/observed_load.py). A beat's counts are a hint, taken only where they
exceed that count (another gateway's requests, a beat ahead of the streams); a beat that claims fewer
requests than the worker has held for a while is not believed on its KV usage either. A worker that answers
slower than the fastest one (a slow link, a slow device) has its load multiplied by how much slower, as in
least-response-time balancing (Finagle's peak EWMA): it gets work only once the faster ones are that much
busier, and nothing waits on it for lack of capacity elsewhere. A worker's slowness fades while nothing
is measured there, so it is tried again.

Bounded state: a worker exists for the router only once it has beaten (block events for ids never seen
beating are dropped, so made-up ids cost nothing), it is forgotten some time after its beats stop, and
each of its block sets keeps at most a cap of hashes, oldest stored dropped first. The device set's cap is
the pool size its beats report (a pool cannot hold more, so the cap costs no routing quality while the
events arrive); the host set's is `max_worker_hashes`.
"""
from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from services.gateway.observed_load import Ewma, ObservedLoad
from shared.block_hash import hash_blocks, held_prefix, lora_root, salted_root
from shared.protocol.events import BlockRemoved, BlockStored, LoadBeat

DEFAULT_EXPIRY_S = 3.0


class NoWorkerError(Exception):
    """No decode worker is alive."""


class OverloadedError(Exception):
    """Every alive worker's waiting queue is at the bound."""


@dataclass
class WorkerState:
    worker_id: str
    # Insertion-ordered sets (values unused): the oldest stored hash is the first one dropped at the cap.
    blocks: OrderedDict[bytes, None] = field(default_factory=OrderedDict)  # in its device pool
    host_blocks: OrderedDict[bytes, None] = field(default_factory=OrderedDict)  # in its host tier
    beat: LoadBeat | None = None
    seen: float = float("-inf")  # local monotonic time of the last beat (never the sender's clock)
    pending: int = 0  # requests routed here since its last beat, which the beat cannot show yet
    observed: ObservedLoad = field(default_factory=ObservedLoad)  # what the gateway saw, whatever the beats say

    @property
    def kv_usage(self) -> float:
        b = self.beat
        return 1.0 - b.free_blocks / b.total_blocks if b and b.total_blocks else 0.0


@dataclass(frozen=True)
class Route:
    worker_id: str
    cached_blocks: int  # prompt blocks the worker is believed to hold in its device pool
    prompt_blocks: int
    host_blocks: int = 0  # the prompt's next blocks, in its host tier
    kvstore_blocks: int = 0  # the next ones after those, in the kvstore


@dataclass
class RouterConfig:
    expiry_s: float = DEFAULT_EXPIRY_S
    max_waiting: int = 128  # per worker; at or above it a worker takes nothing new
    load_weight: float = 1.0
    # What loading a block costs, as a fraction of computing it (measured: `kvmesh bench tiers`).
    host_cost: float = 0.1
    kvstore_cost: float = 0.3
    max_kvstore_hashes: int = 1 << 21  # what the router remembers of the kvstore (oldest forgotten first)
    # Per worker and tier (the device tier: also at most the pool size its beat reports). 1 << 18 hashes
    # of 16-token blocks is 4M tokens of host tier, about 40 MB of router memory per worker at the cap.
    max_worker_hashes: int = 1 << 18
    forget_after_expiries: int = 10  # a worker silent this many expiry periods is dropped with its blocks
    # While the gateway hears no beat from anyone, a worker is dead only after this many expiry periods
    # (see Router._silent: a gateway that hears nobody is more likely late itself than every worker dead).
    deaf_expiries: float = 3.0
    policy: str = "kv"  # "round-robin": the next open worker in turn, caches ignored (a baseline)
    # A LoRA request: the score bonus of a worker whose beat says it holds the adapter (no load before its first
    # step), worth about one prompt's worth of cache hits; load still outweighs it, which spreads a hot adapter.
    lora_bonus: float = 0.5
    # A running request's weight in the queue, against a waiting one's 1 (it shares the batch; its KV is counted
    # apart). Small, so a cached prefix still outweighs a few running requests.
    running_weight: float = 0.1
    # Observed slowness (Router._slowness): the time a stream takes on a worker (its smoothed time to first token +
    # gap per token x the streams' mean length) against the fastest's, each plus a floor (latencies within it count
    # as equal, so tiny ones' noise is not a ratio), at most max_slowdown, fading towards 1 with this half-life
    # while nothing is measured there.
    latency_floor_s: float = 0.01
    max_slowdown: float = 8.0
    slowness_half_life_s: float = 10.0
    # A beat is not believed on KV usage when it claims fewer requests than the gateway has had in flight there
    # since this long before the beat arrived, beyond a tolerance of 1 + a quarter (streams whose last chunk
    # the gateway has not read yet).
    beat_grace_s: float = 1.0

    def __post_init__(self) -> None:
        assert self.policy in ("kv", "round-robin"), f"unknown routing policy {self.policy!r}"


class Router:
    def __init__(self, config: RouterConfig | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config or RouterConfig()
        self._clock = clock
        self._workers: dict[str, WorkerState] = {}
        self._kvstore_blocks: OrderedDict[bytes, None] = OrderedDict()
        self._turn = 0  # round robin's position
        self._stream_tokens = Ewma(0.1)  # tokens per stream, over every worker (what a token gap is multiplied by)
        # The gateway's own hearing (Router._silent): when it last handled any load beat (decode or prefill),
        # and when it started hearing again after a stretch of an expiry period or more with no beat at all.
        self._last_heard = float("-inf")
        self._resumed = float("-inf")

    # --- events -----------------------------------------------------------------------------------

    def on_stored(self, ev: BlockStored) -> None:
        """A worker's event (its device pool or host tier; a worker cannot speak for the kvstore)."""
        w = self._workers.get(ev.worker_id)
        held = self._held(w, ev)
        if w is None or held is None:
            return
        for h in ev.hashes:
            held[h] = None
            held.move_to_end(h)
        cap = self.config.max_worker_hashes
        if held is w.blocks and w.beat is not None and w.beat.total_blocks > 0:
            cap = min(cap, w.beat.total_blocks)
        while len(held) > cap:
            held.popitem(last=False)

    def on_removed(self, ev: BlockRemoved) -> None:
        held = self._held(self._workers.get(ev.worker_id), ev)
        if held is not None:
            for h in ev.hashes:
                held.pop(h, None)

    @staticmethod
    def _held(w: WorkerState | None, ev: BlockStored | BlockRemoved) -> OrderedDict[bytes, None] | None:
        """The worker's block set the event's tier speaks of; None for an unknown worker (it has never
        beaten: nothing is created for it) or a tier not the worker's."""
        if w is None:
            return None
        return {"device": w.blocks, "host": w.host_blocks}.get(ev.tier)

    def on_kvstore_removed(self, ev: BlockRemoved) -> None:
        """Blocks that left every tier of the kvstore."""
        for h in ev.hashes:
            self._kvstore_blocks.pop(h, None)

    def on_kvstore_stored(self, ev: BlockStored) -> None:
        """The kvstore's puts (its own subject)."""
        held = self._kvstore_blocks
        for h in ev.hashes:
            held[h] = None
            held.move_to_end(h)
        while len(held) > self.config.max_kvstore_hashes:
            held.popitem(last=False)

    def on_beat(self, beat: LoadBeat) -> None:
        self.heard()
        self._expire()
        w = self._worker(beat.worker_id)
        w.beat, w.seen, w.pending = beat, self._clock(), 0

    def heard(self) -> None:
        """The gateway handled a load beat (any worker's, prefill ones too: the service calls this for them)."""
        now = self._clock()
        if now - self._last_heard > self.config.expiry_s:
            self._resumed = now
        self._last_heard = now

    def heard_from_all(self) -> None:
        """Count every known worker as just heard from (the gateway itself could not hear: gateway/service.py)."""
        now = self._clock()
        for w in self._workers.values():
            if w.beat is not None:
                w.seen = max(w.seen, now)

    def forget(self, worker_id: str) -> None:
        """A worker that answered "no responders" is gone whatever its last beat said."""
        self._workers.pop(worker_id, None)

    # --- queries ----------------------------------------------------------------------------------

    def _silent(self, w: WorkerState, now: float) -> bool:
        """Whether the worker is dead to the router: silent past the expiry by the gateway's own hearing.

        A beat reaches the router only after the gateway's event loop gets to it, behind every token message
        that came first on the same connection. A gateway that falls behind (2,000 streams on 2
        cores) hears every beat late at once; judged by the wall clock, every worker then looks dead
        together, their requests migrate (more work) and the mesh collapses. So silence is judged against the
        beats the gateway does handle:
        - a worker is silent from its last beat or from when the gateway started hearing again after hearing
          nobody for an expiry period, whichever is later (a backlog handled after a stall gives each worker
          an expiry period for its own beat in it);
        - while others' beats arrive (one handled within an expiry period), past the expiry it is dead: its
          silence is its own;
        - while the gateway hears nobody at all, it cannot tell its own lateness from every worker dying
          (a lone worker that died looks the same): dead only after `deaf_expiries` expiry periods.
        """
        if w.beat is None:
            return True
        c = self.config
        if now - max(w.seen, self._resumed) <= c.expiry_s:
            return False
        if now - self._last_heard <= c.expiry_s:
            return True
        return now - w.seen > c.expiry_s * c.deaf_expiries

    def _expire(self) -> None:
        """Drop workers long silent, with their block sets (called on every beat and query, so a gateway
        that receives only other workers' beats still forgets the silent ones). By the wall clock: ten expiry
        periods is longer than the gateway's own lateness ever runs while it still serves (Router._silent)."""
        now = self._clock()
        limit = self.config.expiry_s * self.config.forget_after_expiries
        for wid in [wid for wid, w in self._workers.items() if now - w.seen > limit]:
            del self._workers[wid]

    def worker_count(self) -> int:
        return len(self._workers)

    def alive(self) -> list[WorkerState]:
        self._expire()
        now = self._clock()
        return [w for w in self._workers.values() if not self._silent(w, now)]

    def is_alive(self, worker_id: str) -> bool:
        w = self._workers.get(worker_id)
        return w is not None and not self._silent(w, self._clock())

    def bus_reconnects(self, worker_id: str) -> int | None:
        """How often the worker's bus connection reconnected, as its last beat says (None: unknown)."""
        w = self._workers.get(worker_id)
        return w.beat.bus_reconnects if w is not None and w.beat is not None else None

    def incarnation(self, worker_id: str) -> str | None:
        """The worker process's incarnation, as its last beat says (None or "": unknown)."""
        w = self._workers.get(worker_id)
        return w.beat.incarnation if w is not None and w.beat is not None else None

    def max_model_len(self) -> int | None:
        lens = [w.beat.max_model_len for w in self.alive() if w.beat and w.beat.max_model_len > 0]
        return min(lens) if lens else None

    def pick(self, prompt_token_ids: Sequence[int], exclude: frozenset[str] = frozenset(),
             cache_salt: str | None = None, lora: tuple[str, str] | None = None) -> Route:
        """lora: the request's adapter (name, digest): its blocks hash from its own root, and workers holding it
        are preferred (only those, while any alive one does)."""
        workers = [w for w in self.alive() if w.worker_id not in exclude]
        if lora is not None:
            holding = [w for w in workers if w.beat is not None and lora[0] in w.beat.lora_adapters]
            workers = holding or workers
        if not workers:
            raise NoWorkerError("no decode worker is alive")
        open_ = [w for w in workers if w.beat and w.beat.waiting < self.config.max_waiting]
        if not open_:
            raise OverloadedError(f"every decode worker has {self.config.max_waiting} or more requests waiting")
        if self.config.policy == "round-robin":
            open_.sort(key=lambda w: w.worker_id)
            open_ = [open_[self._turn % len(open_)]]  # scored alone below: the route still says what it holds
            self._turn += 1
        hashes: dict[tuple[bytes, int], list[bytes]] = {}  # workers of one model share a hashing scheme
        now = self._clock()
        fastest = self._fastest(workers)
        best: tuple[float, int, str] | None = None
        best_route: Route | None = None
        for w in open_:
            assert w.beat is not None
            key = (w.beat.hash_root, w.beat.block_size)
            if key not in hashes:
                # A salted request's blocks hash from its own root (shared/block_hash.py), as the workers hash them.
                root = salted_root(w.beat.hash_root, cache_salt) if w.beat.hash_root else None
                root = lora_root(root, lora[1]) if root is not None and lora is not None else root
                hashes[key] = hash_blocks(root, prompt_token_ids, w.beat.block_size) if root else []
            chain = hashes[key]
            cached = held_prefix(chain, w.blocks)
            host = held_prefix(chain[cached:], w.host_blocks)
            stored = held_prefix(chain[cached + host:], self._kvstore_blocks)
            c = self.config
            cost = host * c.host_cost + stored * c.kvstore_cost + (len(chain) - cached - host - stored)
            load = self._load(w) * self._slowness(w, fastest, now)
            score = (1.0 - cost / len(chain) if chain else 0.0) - self.config.load_weight * load
            if lora is not None and lora[0] in w.beat.lora_resident:
                score += c.lora_bonus
            busy = max(w.beat.running + w.beat.waiting + w.pending, len(w.observed.flights))
            rank = (score, -busy, w.worker_id)  # ties: the less busy, then a stable order
            if best is None or rank[:2] > best[:2] or (rank[:2] == best[:2] and rank[2] < best[2]):
                best, best_route = rank, Route(w.worker_id, cached, len(chain), host, stored)
        assert best_route is not None
        self._workers[best_route.worker_id].pending += 1
        return best_route

    # --- what the gateway observes (services/gateway/token_stream.py reports its streams) ------------------

    def dispatched(self, worker_id: str, key: str, prompt_tokens: int) -> None:
        """A token stream (key: its request id) went to the worker."""
        w = self._workers.get(worker_id)
        if w is not None:
            w.observed.dispatched(key, prompt_tokens, self._clock())

    def arrived(self, worker_id: str, key: str, tokens: int) -> None:
        """A chunk of the stream arrived (the first one: its time to first token)."""
        w = self._workers.get(worker_id)
        if w is not None:
            w.observed.arrived(key, tokens, self._clock())

    def landed(self, worker_id: str, key: str) -> None:
        """The stream is over on the worker: finished, refused, aborted or moved away. (A worker that died took
        its flights with it: Router.forget.)"""
        w = self._workers.get(worker_id)
        f = w.observed.landed(key) if w is not None else None
        if f is not None and f.tokens > 0:
            self._stream_tokens.add(f.tokens)

    def observed(self, worker_id: str) -> ObservedLoad | None:
        w = self._workers.get(worker_id)
        return w.observed if w is not None else None

    def _load(self, w: WorkerState) -> float:
        """KV usage + queue / max_waiting, each count the higher of the beat's and the gateway's own, + 1 for the
        request being placed (so the slowness factor tells idle workers apart)."""
        b, o, c = w.beat, w.observed, self.config
        assert b is not None
        queue = max(b.waiting + w.pending, o.waiting) + c.running_weight * max(b.running, o.running)
        kv = w.kv_usage
        claimed = b.running + b.waiting
        held = o.sent_before(w.seen - c.beat_grace_s) if len(o.flights) > claimed + 1 else 0
        if held > claimed + 1 + held // 4 and b.total_blocks > 0:
            # The beat hides requests the worker has had for a while: its KV usage is no better than its counts.
            kv = max(kv, min(1.0, o.blocks(b.block_size) / b.total_blocks))
        return kv + (queue + 1) / c.max_waiting

    def _latency(self, w: WorkerState) -> float | None:
        """What a stream takes on the worker, as the gateway measured them: first token, then the mean length's
        tokens at the smoothed gap (None: nothing measured yet)."""
        o = w.observed
        if o.ttft.value is None:
            return None
        return o.ttft.value + (o.gap.value or 0.0) * (self._stream_tokens.value or 1.0)

    def _fastest(self, workers: list[WorkerState]) -> float | None:
        """The lowest measured latency among the candidates."""
        measured = [t for t in map(self._latency, workers) if t is not None]
        return min(measured) if measured else None

    def _slowness(self, w: WorkerState, fastest: float | None, now: float) -> float:
        """How much slower than the fastest candidate the worker answers (1: as fast, or nothing measured)."""
        c, mine = self.config, self._latency(w)
        if mine is None or fastest is None:
            return 1.0
        slow = min((mine + c.latency_floor_s) / (fastest + c.latency_floor_s), c.max_slowdown)
        return 1.0 + (slow - 1.0) * 0.5 ** (max(0.0, now - w.observed.last_sample) / c.slowness_half_life_s)

    def _worker(self, worker_id: str) -> WorkerState:
        w = self._workers.get(worker_id)
        if w is None:
            w = self._workers[worker_id] = WorkerState(worker_id)
        return w
