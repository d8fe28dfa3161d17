"""The link emulator (tests/netns_wan.py) between two namespaced hosts delays and paces what crosses it, and
only that: a TCP handshake takes its two one-way delays, a bulk transfer its rate, and the hosts are back on
the bridge once it stops."""
from __future__ import annotations

import sys
import textwrap

import pytest

from tests.netns_hosts import NetnsHosts, available

pytestmark = pytest.mark.skipif(available() is not None, reason=f"no network namespaces: {available()}")

# On host b: accept one connection at a time and read it to the end; on host a: time a handshake, then time
# sending NBYTES (until b has read them all: b answers one byte at the end).
SERVER = textwrap.dedent("""
    import socket, sys
    s = socket.socket(); s.bind((sys.argv[1], 7301)); s.listen(); print("up", flush=True)
    while True:
        c, _ = s.accept()
        n = int.from_bytes(c.recv(8), "big")
        while n > 0:
            n -= len(c.recv(1 << 20))
        c.sendall(b"k"); c.close()
""")
CLIENT = textwrap.dedent("""
    import socket, sys, time
    nbytes = int(sys.argv[2])
    t0 = time.perf_counter(); c = socket.create_connection((sys.argv[1], 7301)); t1 = time.perf_counter()
    c.sendall(nbytes.to_bytes(8, "big") + bytes(nbytes)); c.recv(1); t2 = time.perf_counter()
    print(t1 - t0, t2 - t1)
""")


def _timed(hosts: NetnsHosts, nbytes: int) -> tuple[float, float]:
    out = hosts["a"].run(sys.executable, "-c", CLIENT, hosts["b"].address, str(nbytes), timeout=60)
    handshake, transfer = map(float, out.split())
    return handshake, transfer


def test_the_emulated_link_delays_and_paces_and_goes_away() -> None:
    with NetnsHosts(2) as hosts:
        server = hosts["b"].popen([sys.executable, "-c", SERVER, hosts["b"].address], stdout=-1, text=True)
        assert server.stdout.readline().strip() == "up"
        with hosts.wan("a", "b", delay_ms=20, rate_mbit=40):
            assert "dev kvmw" in hosts["a"].run("ip", "route", "get", hosts["b"].address)
            handshake, transfer = _timed(hosts, 2_000_000)  # 16 Mbit: 0.4 s at 40 Mbit/s
        assert handshake >= 0.04  # SYN there, SYN-ACK back: 20 ms each way
        assert transfer >= 0.4
        # Its devices, and the routes over them, are gone: the hosts talk over the bridge again (only lower bounds
        # on time are asserted; a busy machine can slow anything down).
        assert "kvmw" not in hosts["a"].run("ip", "route", "get", hosts["b"].address)
        _timed(hosts, 1)
