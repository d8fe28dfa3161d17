"""A slow link to one decode host (network namespaces, tests/netns_hosts.py): the gateway, tokenizer and kvstore
on host a, a decode worker on b and one on c, each host with its own nats-server in one routed cluster; every
packet between c and the other hosts takes 20 ms each way (c's links to a and to b go through the userspace
link emulator, tests/netns_wan.py: this kernel has no netem). The router sees c answer later and sends it less;
nobody times out. KVMESH_SLOW_LINK_RESULT=FILE writes the measured split and latencies there as JSON."""
from __future__ import annotations

import json
import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest

from shared.launcher.join import JOINED
from tests.checkpoints import build_checkpoint
from tests.netns_hosts import NetnsHosts, available
from tests.netns_mesh import MultiHostMesh

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(available() is not None, reason=f"no network namespaces: {available()}")]

DELAY_MS = 20
FAST, SLOW = "decode-b_0", "decode-c_0"
# One at a time (the link's share of a request's time is largest), then several at once (the slow host takes
# its part once the other is busier).
PHASES = (("one_at_a_time", 20, 1), ("three_at_a_time", 45, 3))
MAX_TOKENS = 2


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return build_checkpoint("llama", tmp_path_factory.mktemp("multihost-slow") / "llama")


@pytest.fixture(scope="module")
def mesh(llama, tmp_path_factory):
    with NetnsHosts(3) as hosts, hosts.wan("a", "c", DELAY_MS), hosts.wan("b", "c", DELAY_MS):
        m = MultiHostMesh(hosts, llama.path, tmp_path_factory.mktemp("multihost-slow-mesh"))
        try:
            m.start_first("a")
            joining = [m.join("b", 1, 0, wait=False), m.join("c", 1, 0, wait=False)]
            for lines in joining:
                lines.wait_for(JOINED, timeout=60)
            m.wait_ready({FAST, SLOW})
            yield m
        except BaseException:
            print(m.output())
            raise


def _workers(mesh: MultiHostMesh) -> dict[str, dict]:
    return {w["worker_id"]: w for w in httpx.get(f"{mesh.url}/get_load", timeout=10).json()["workers"]}


def test_a_slow_link_to_one_decode_host_gets_it_less_and_nobody_times_out(mesh) -> None:
    # Host c reaches a and b only over the emulated links, and its nats-server is routed to theirs.
    c = mesh.hosts["c"]
    for peer in ("a", "b"):
        address = mesh.hosts[peer].address
        assert "dev kvmw" in c.run("ip", "route", "get", address), peer
        assert any(p.startswith(address + ":") and "nats-server" in proc for _, p, proc in c.tcp_peers()), peer
    client = openai.OpenAI(base_url=f"{mesh.url}/v1", api_key="unused", max_retries=0, timeout=120)
    model = client.models.list().data[0].id

    def one(i: int) -> float:
        prompt = [(11 * i + 5 * k) % 240 + 3 for k in range(16)]  # distinct: no cache hit, load alone decides
        t0 = time.monotonic()
        r = client.completions.create(model=model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                      extra_body={"ignore_eos": True})
        assert r.usage.completion_tokens == MAX_TOKENS and r.choices[0].finish_reason == "length"
        return time.monotonic() - t0

    with ThreadPoolExecutor(2) as pool:  # warm-up: both workers answer (first steps build kernels)
        list(pool.map(one, range(1000, 1008)))
    migrations = mesh.metric("kvmesh:request_migrations_total")
    result: dict = {"delay_ms_each_way": DELAY_MS, "max_tokens": MAX_TOKENS, "phases": {}}
    start = 0
    for name, count, concurrency in PHASES:
        before = _workers(mesh)
        with ThreadPoolExecutor(concurrency) as pool:
            latencies = list(pool.map(one, range(start, start + count)))  # any failure or timeout raises here
        start += count
        after = _workers(mesh)
        routed = {w: after[w]["gateway_routed"] - before[w]["gateway_routed"] for w in (FAST, SLOW)}
        assert sum(routed.values()) == count, routed
        result["phases"][name] = {
            "requests": count, "concurrency": concurrency, "routed": routed,
            "observed_ttft_s": {w: after[w]["observed_ttft_s"] for w in (FAST, SLOW)},
            "observed_token_gap_s": {w: after[w]["observed_token_gap_s"] for w in (FAST, SLOW)},
            "client_latency_s": {"mean": sum(latencies) / len(latencies), "max": max(latencies)}}
    result["migrations"] = mesh.metric("kvmesh:request_migrations_total") - migrations
    print(json.dumps(result, indent=1))
    if path := os.environ.get("KVMESH_SLOW_LINK_RESULT"):
        Path(path).write_text(json.dumps(result, indent=1) + "\n")
    assert result["migrations"] == 0, result  # slow is not dead: nothing moves off the slow host
    alone, busy = result["phases"]["one_at_a_time"], result["phases"]["three_at_a_time"]
    # The gateway sees the link (c's first tokens come later) and sends c less: hardly anything while b is free,
    # its part once b is busier.
    assert alone["observed_ttft_s"][SLOW] > alone["observed_ttft_s"][FAST], result
    assert alone["routed"][SLOW] * 3 <= alone["routed"][FAST], result
    assert 0 < busy["routed"][SLOW], result
    assert alone["routed"][SLOW] + busy["routed"][SLOW] < alone["routed"][FAST] + busy["routed"][FAST], result
