"""Gateway pieces without a mesh: stop strings, router (the detokenizer has tests/test_detokenizer.py)."""
from __future__ import annotations

import pytest

from services.gateway.router import NoWorkerError, OverloadedError, Router, RouterConfig
from services.gateway.stop import StopMatcher
from shared.block_hash import hash_blocks
from shared.protocol.events import BlockRemoved, BlockStored, LoadBeat
from tests.router_fakes import ROOT, Clock, beat


def feed(stops: list[str], pieces: list[str]) -> tuple[list[str], StopMatcher]:
    m = StopMatcher(stops)
    out = [m.push(p) for p in pieces]
    out.append(m.flush())
    return out, m


def test_stop_string_spanning_pieces_is_held_back_and_cut() -> None:
    out, m = feed(["END"], ["hello E", "N", "D and more"])
    assert out == ["hello ", "", "", ""] and m.stopped and m.matched == "END"


def test_stop_false_alarm_is_released() -> None:
    out, m = feed(["END"], ["an E", "Nx", " tail"])
    assert "".join(out) == "an ENx tail" and not m.stopped
    assert out[0] == "an "  # "E" held until the next piece shows it is not "END"


def test_stop_earliest_of_several() -> None:
    out, m = feed(["zz", "b"], ["aazzb"])
    assert "".join(out) == "aa" and m.matched == "zz"


# ---------------------------------------------------------------------------------------- router



def test_router_prefers_longest_cached_prefix_and_avoids_overloaded() -> None:
    clock = Clock()
    r = Router(RouterConfig(expiry_s=3.0, max_waiting=4), clock)
    prompt = list(range(40))  # 10 blocks of 4
    chain = hash_blocks(ROOT, prompt, 4)
    for w in ("a", "b", "c"):
        r.on_beat(beat(w))
    r.on_stored(BlockStored(worker_id="a", hashes=chain[:3]))
    r.on_stored(BlockStored(worker_id="b", hashes=chain[:8]))
    r.on_stored(BlockStored(worker_id="c", hashes=chain[1:10]))  # not a prefix: worthless
    route = r.pick(prompt)
    assert (route.worker_id, route.cached_blocks, route.prompt_blocks) == ("b", 8, 10)
    # b is now over its waiting bound: the next best prefix wins
    r.on_beat(beat("b", waiting=4))
    assert r.pick(prompt).worker_id == "a"
    # eviction is seen too
    r.on_removed(BlockRemoved(worker_id="a", hashes=chain[:1]))
    r.on_beat(beat("a"))
    r.on_beat(beat("c"))
    assert r.pick(prompt).cached_blocks == 0


def test_round_robin_routing_ignores_caches_and_skips_full_workers() -> None:
    clock = Clock()
    r = Router(RouterConfig(expiry_s=3.0, max_waiting=4, policy="round-robin"), clock)
    prompt = list(range(40))
    for w in ("b", "a", "c"):
        r.on_beat(beat(w))
    r.on_stored(BlockStored(worker_id="c", hashes=hash_blocks(ROOT, prompt, 4)))  # c holds it all
    picks = [r.pick(prompt) for _ in range(6)]
    assert [p.worker_id for p in picks] == ["a", "b", "c"] * 2
    assert [p.cached_blocks for p in picks[:3]] == [0, 0, 10]  # what the chosen worker holds, still reported
    r.on_beat(beat("b", waiting=4))  # at the bound: skipped
    assert {r.pick(prompt).worker_id for _ in range(4)} == {"a", "c"}
    with pytest.raises(AssertionError, match="routing"):
        RouterConfig(policy="random")


def test_router_scores_the_host_tier_and_the_kvstore() -> None:
    """Issue 10 item 5: a block in a worker's host tier is cheap on that worker; a block in the kvstore
    is cheap on every worker, which lets load decide where a small device prefix would have won."""
    r = Router(RouterConfig(max_waiting=10), Clock())
    prompt = list(range(40))
    chain = hash_blocks(ROOT, prompt, 4)
    for w in ("a", "b"):
        r.on_beat(beat(w))
    r.on_stored(BlockStored(worker_id="a", hashes=chain[:2]))
    r.on_stored(BlockStored(worker_id="b", hashes=chain[:8], tier="host"))  # evicted to b's host tier
    route = r.pick(prompt)
    assert (route.worker_id, route.cached_blocks, route.host_blocks) == ("b", 0, 8)
    r.on_removed(BlockRemoved(worker_id="b", hashes=chain[:8], tier="host"))
    r.on_beat(beat("b"))
    assert r.pick(prompt).worker_id == "a"
    # A worker cannot claim the kvstore's tier; the kvstore's own events can.
    r.on_stored(BlockStored(worker_id="b", hashes=chain, tier="kvstore"))
    r.on_beat(beat("a", running=4, free=90))  # a is a little busy now
    r.on_beat(beat("b"))
    assert r.pick(prompt).worker_id == "a"  # its 2 device blocks still beat computing 10 blocks on b
    r.on_kvstore_stored(BlockStored(worker_id="kvstore", hashes=chain, tier="kvstore"))
    r.on_beat(beat("a", running=4, free=90))
    r.on_beat(beat("b"))
    route = r.pick(prompt)  # with the whole prompt in the kvstore, the idle worker is the better home
    assert (route.worker_id, route.cached_blocks, route.kvstore_blocks) == ("b", 0, 10)
    r.on_kvstore_removed(BlockRemoved(worker_id="kvstore", hashes=chain, tier="kvstore"))  # evicted from the store
    r.on_beat(beat("a", running=4, free=90))
    r.on_beat(beat("b"))
    assert r.pick(prompt).worker_id == "a"


def test_router_weighs_load() -> None:
    clock = Clock()
    r = Router(RouterConfig(max_waiting=10), clock)
    prompt = list(range(40))
    chain = hash_blocks(ROOT, prompt, 4)
    r.on_beat(beat("hot", running=8, waiting=9, free=0))  # full cache, long queue
    r.on_beat(beat("idle"))
    r.on_stored(BlockStored(worker_id="hot", hashes=chain[:2]))  # a small prefix is not worth the queue
    assert r.pick(prompt).worker_id == "idle"


def test_router_expires_silent_workers_and_refuses_when_all_full() -> None:
    clock = Clock()
    r = Router(RouterConfig(expiry_s=3.0, max_waiting=2), clock)
    with pytest.raises(NoWorkerError):
        r.pick([1, 2, 3])
    r.on_beat(beat("a"))
    assert r.pick([1, 2, 3]).worker_id == "a"
    for _ in range(2):
        clock.t += 1.75
        r.on_beat(beat("b"))  # others are heard: a's silence is its own
    assert [w.worker_id for w in r.alive()] == ["b"]
    clock.t += 9.5
    assert r.alive() == []  # both silent past three expiry periods, and nobody heard meanwhile either
    with pytest.raises(NoWorkerError):
        r.pick([1, 2, 3])
    r.on_beat(beat("a", waiting=2))
    r.on_beat(beat("b", waiting=2))
    with pytest.raises(OverloadedError):
        r.pick([1, 2, 3])


def test_router_spreads_a_burst_between_beats() -> None:
    r = Router(RouterConfig(max_waiting=8), Clock())
    r.on_beat(beat("a"))
    r.on_beat(beat("b"))
    picks = [r.pick([1, 2, 3, 4, 5]).worker_id for _ in range(4)]
    assert sorted(picks) == ["a", "a", "b", "b"]


def test_beats_inconsistent_with_their_subject_or_the_model_are_ignored() -> None:
    from services.gateway.beat_check import beat_problem
    from shared import subjects

    ok = LoadBeat(worker_id="d0", running=1, waiting=0, free_blocks=10, total_blocks=20, block_size=16, max_model_len=512)
    assert beat_problem(ok, subjects.decode_load("d0"), 512, "decode") is None
    assert "another worker's subject" in beat_problem(ok, subjects.decode_load("d1"), 512, "decode")
    assert "max_model_len 1" in beat_problem(ok.model_copy(update={"max_model_len": 1}), subjects.decode_load("d0"),
                                             512, "decode")
    assert "max_model_len 4096" in beat_problem(ok.model_copy(update={"max_model_len": 4096}),
                                                subjects.decode_load("d0"), 512, "decode")
    assert "power of two" in beat_problem(ok.model_copy(update={"block_size": 12}), subjects.decode_load("d0"), 512,
                                          "decode")
    assert "inconsistent" in beat_problem(ok.model_copy(update={"free_blocks": 30}), subjects.decode_load("d0"), 512,
                                          "decode")
    assert "prefill subject" in beat_problem(ok, subjects.prefill_load("d0"), 512, "prefill")


def test_workers_do_not_expire_for_silence_the_gateway_could_not_hear() -> None:
    """The gateway's own NATS connection was down: on reconnect every known worker counts as just heard from
    (services/gateway/service.py watches the connection); one that stays silent expires after that."""
    clock = Clock()
    r = Router(RouterConfig(expiry_s=1.0), clock)
    r.on_beat(beat("a"))
    clock.t += 3.5  # a lone worker silent past the deaf limit (Router._silent)
    assert not r.is_alive("a")
    r.heard_from_all()
    assert r.is_alive("a") and [w.worker_id for w in r.alive()] == ["a"]
    clock.t += 3.5
    assert not r.is_alive("a")


def test_a_late_gateway_is_not_every_worker_dead() -> None:
    """Issue 25: a gateway behind on its input hears every beat late at once. A worker dies when others are
    heard meanwhile; when nobody is heard, only after `deaf_expiries` periods (a lone dead worker too)."""
    clock = Clock()
    r = Router(RouterConfig(expiry_s=1.0, deaf_expiries=3.0), clock)
    r.on_beat(beat("a"))
    r.on_beat(beat("b"))
    clock.t += 2.5  # the gateway heard nothing for 2.5 expiry periods: it is late, not both workers dead
    assert sorted(w.worker_id for w in r.alive()) == ["a", "b"] and r.is_alive("a")
    r.on_beat(beat("b"))  # it catches up: b's beat is handled first; a's may be right behind it
    for _ in range(2):
        clock.t += 0.45
        r.on_beat(beat("b"))
        assert r.is_alive("a")
    clock.t += 0.2  # over an expiry period since the gateway hears again, and b's beats are handled, a's not
    r.on_beat(beat("b"))
    assert not r.is_alive("a") and [w.worker_id for w in r.alive()] == ["b"]
    # Nobody heard: b (alone now) is dead only past three expiry periods of silence.
    clock.t += 2.9
    assert r.is_alive("b")
    clock.t += 0.2
    assert not r.is_alive("b") and r.alive() == []
    # A new worker beating on time stays alive throughout; the silent ones get one expiry period from when the
    # gateway hears again (their beats could be right behind c's), then are dead.
    for _ in range(5):
        clock.t += 0.5
        r.on_beat(beat("c"))
        assert r.is_alive("c")
    assert [w.worker_id for w in r.alive()] == ["c"]


# ---------------------------------------------------------------------------------------- Retry-After

def test_retry_after_follows_the_backlog_with_jitter() -> None:
    from services.gateway.retry_after import MAX_S, MIN_S, RetryAdvice

    clock = Clock()
    advice = RetryAdvice(clock=clock)
    for _ in range(50):  # 10 requests finish per second
        clock.t += 0.1
        advice.finished()
    waits = [advice.for_count(in_flight=8) for _ in range(40)]  # 40 clients refused in the same instant
    # Each refusal adds to the backlog: the k-th waits for k slots to free (50 freed in the 4.9 s since the first),
    # at least that long, at most twice.
    est = [max(k * 4.9 / 50, MIN_S) for k in range(1, 41)]
    assert all(e <= w < 2 * e for e, w in zip(est, waits))
    # Hardly two alike (random jitter at ms resolution can collide now and then): they do not come back together.
    assert len({round(w, 3) for w in waits}) >= 0.9 * len(waits)
    assert max(waits) > 4 * min(waits)  # and the spread grows with the backlog
    lag = [advice.for_lag(3.0) for _ in range(20)]
    assert all(3.0 <= w < 6.0 for w in lag) and len({round(w, 3) for w in lag}) >= 18
    assert all(MIN_S <= advice.for_lag(0.0) < 2 * MIN_S for _ in range(10))
    assert advice.for_lag(1e6) < 2 * MAX_S
    h = advice.headers(2.345)
    assert h == {"Retry-After": "3", "retry-after-ms": "2345"}
    clock.t += 100  # everything above forgotten: nothing finished lately, one refused, 8 long requests in flight
    assert 5.0 / 8 <= advice.for_count(in_flight=8) < 2 * 5.0 / 8  # the window's worth of time shared by 8
