"""The router weighs what the gateway observes over what load beats claim (services/gateway/router.py,
services/gateway/observed_load.py): the streams it sent to each worker and has not seen end, and how fast each
worker answers them. Scoring with fake observations and a fake clock."""
from __future__ import annotations

from collections import Counter

from services.gateway.router import Router, RouterConfig
from shared.block_hash import hash_blocks
from shared.protocol.events import BlockStored
from tests.router_fakes import ROOT, Clock, beat


def prompt(i: int) -> list[int]:
    return [1000 + i * 40 + k for k in range(40)]  # distinct prompts: no cache hit anywhere, load decides


def send(r: Router, clock: Clock, i: int, first_token_after: float | None = 0.01) -> str:
    """Routes and dispatches one stream as the gateway does; its first token arrives after `first_token_after`."""
    worker = r.pick(prompt(i)).worker_id
    r.dispatched(worker, f"req-{i}", 40)
    if first_token_after is not None:
        clock.t += first_token_after
        r.arrived(worker, f"req-{i}", 1)
    return worker


def test_a_beat_claiming_no_load_does_not_hide_the_streams_the_gateway_sent_there() -> None:
    clock = Clock()
    r = Router(RouterConfig(expiry_s=60, max_waiting=16), clock)
    for w in ("liar", "honest"):
        r.on_beat(beat(w))
    picks = Counter()
    for i in range(24):
        w = send(r, clock, i)
        picks[w] += 1
        clock.t += 0.1
        # The honest worker's beat shows what it runs (8 KV blocks per request of 40 tokens + output, 4 a block);
        # the liar's claims nothing, again and again, however much it holds (none of its streams ever end).
        honest = len(r.observed("honest").flights)
        r.on_beat(beat("honest", running=honest, free=100 - 11 * honest))
        r.on_beat(beat("liar"))
        if w == "honest" and i % 2:
            r.landed("honest", f"req-{i}")  # the honest worker finishes some
    assert picks["liar"] <= picks["honest"], picks
    # The router counted what it sent: the liar's observed in-flight streams, whatever its beats say.
    assert len(r.observed("liar").flights) == picks["liar"] and r.observed("liar").routed == picks["liar"]


def test_a_consistent_beat_is_believed_and_counts_are_the_higher_of_beat_and_observation() -> None:
    clock = Clock()
    r = Router(RouterConfig(expiry_s=60, max_waiting=10), clock)
    r.on_beat(beat("a", running=2, free=90))
    w = r._workers["a"]
    r.dispatched("a", "x", 40)
    r.arrived("a", "x", 1)
    clock.t += 2
    r.on_beat(beat("a", running=2, free=90))  # it runs our stream and another gateway's: believed
    assert abs(r._load(w) - (0.1 + (0.1 * 2 + 1) / 10)) < 1e-9
    for k in range(5):
        r.dispatched("a", f"y{k}", 40)
        r.arrived("a", f"y{k}", 1)
    # Six streams streaming here, the beat (before they count as held) says two: the count is the gateway's.
    assert abs(r._load(w) - (0.1 + (0.1 * 6 + 1) / 10)) < 1e-9
    clock.t += 2
    r.on_beat(beat("a", running=2, free=90))  # it still claims two while holding six for two seconds
    assert r._load(w) > 0.1 + 6 * 10 / 100  # the KV its six sequences span, not the beat's 10%
    for k in range(5):
        r.landed("a", f"y{k}")
    r.landed("a", "x")
    assert abs(r._load(w) - (0.1 + (0.1 * 2 + 1) / 10)) < 1e-9 and r.observed("a").flights == {}


def test_a_slow_worker_gets_less_until_the_fast_one_is_that_much_busier() -> None:
    clock = Clock()
    r = Router(RouterConfig(expiry_s=600, max_waiting=8, running_weight=1.0), clock)
    for w in ("fast", "slow"):
        r.on_beat(beat(w))
    # A few streams measured on each: the slow worker's first token takes 60 ms more (a 20 ms link each way and
    # then some), its tokens come at the same pace.
    for i, (w, ttft) in enumerate([("fast", 0.02), ("slow", 0.08)] * 4):
        r.dispatched(w, f"m{i}", 40)
        clock.t += ttft
        r.arrived(w, f"m{i}", 1)
        r.landed(w, f"m{i}")
    assert r._slowness(r._workers["slow"], r._fastest(r.alive()), clock.t) > 2.5
    picks = Counter(r.pick(prompt(i)).worker_id for i in range(30))  # a burst: nothing ends meanwhile
    assert picks["fast"] > 2 * picks["slow"] > 0, picks  # less, not nothing: nobody waits on the fast one alone
    # Nothing measured on the slow worker for a while: its slowness fades and it is tried again first in turn.
    r2 = Router(RouterConfig(expiry_s=600, max_waiting=8), clock)
    for w in ("fast", "slow"):
        r2.on_beat(beat(w))
    r2.dispatched("slow", "s", 40)
    clock.t += 0.5
    r2.arrived("slow", "s", 1)
    r2.landed("slow", "s")
    r2.dispatched("fast", "f", 40)
    clock.t += 0.01
    r2.arrived("fast", "f", 1)
    r2.landed("fast", "f")
    slow = r2._workers["slow"]
    fresh = r2._slowness(slow, r2._fastest(r2.alive()), clock.t)
    clock.t += 90
    for w in ("fast", "slow"):
        r2.on_beat(beat(w))
    faded = r2._slowness(slow, r2._fastest(r2.alive()), clock.t)
    assert fresh > 8 * 0.9 and faded < 1.1


def test_prefix_affinity_outweighs_observed_slowness_at_low_load() -> None:
    clock = Clock()
    r = Router(RouterConfig(expiry_s=600), clock)
    for w in ("fast", "slow"):
        r.on_beat(beat(w))
    for w, ttft in (("fast", 0.01), ("slow", 0.05)):
        r.dispatched(w, w, 40)
        clock.t += ttft
        r.arrived(w, w, 1)
        r.landed(w, w)
    cached = prompt(1)
    r.on_stored(BlockStored(worker_id="slow", hashes=hash_blocks(ROOT, cached, 4)))
    assert r.pick(cached).worker_id == "slow"  # its cache saves the whole prefill
    assert r.pick(prompt(2)).worker_id == "fast"  # nothing cached anywhere: the faster one


def test_flights_end_with_the_stream_and_die_with_the_worker() -> None:
    clock = Clock()
    r = Router(RouterConfig(expiry_s=60), clock)
    r.on_beat(beat("a"))
    r.dispatched("a", "x", 10)
    r.dispatched("a", "y", 10)
    r.dispatched("nobody", "z", 10)  # a worker the router does not know: nothing is made for it
    assert r.observed("nobody") is None and len(r.observed("a").flights) == 2
    r.arrived("a", "x", 3)
    assert (r.observed("a").waiting, r.observed("a").running) == (1, 1)
    r.landed("a", "x")
    r.landed("a", "x")  # twice: no harm
    assert list(r.observed("a").flights) == ["y"]
    r.forget("a")  # it died: its flights go with it, and a worker coming back under its id starts clean
    r.on_beat(beat("a"))
    r.landed("a", "y")
    assert r.observed("a").flights == {} and r.observed("a").routed == 0

