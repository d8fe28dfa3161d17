"""A NATS cluster of local nats-servers joined by routes: the test fixture for a mesh spread over
several servers (one can die and the clients move to another).

Every server routes to every other (a full mesh of routes, as the NATS docs recommend for small
clusters: no gossip is needed to find a peer). Ports are chosen before any server starts, because
each server's config names its peers' route ports.
"""
from __future__ import annotations

import json
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from shared.bus.natsd import NatsServer, free_ports


@dataclass
class NatsCluster:
    size: int = 3
    host: str = "127.0.0.1"
    workdir: Path | None = None
    servers: list[NatsServer] = field(default_factory=list)
    authorization: dict | None = field(default=None, repr=False)  # every server's users (NatsServer)

    def start(self, timeout: float = 15.0, attempts: int = 3) -> NatsCluster:
        assert self.size >= 1, "a cluster needs at least one server"
        workdir = Path(self.workdir or tempfile.mkdtemp(prefix="kvmesh-nats-cluster-"))
        for attempt in range(attempts):  # a "free" port can be taken before its server binds it: new ports
            try:
                return self._start_on_new_ports(workdir, timeout)
            except RuntimeError:
                if attempt == attempts - 1:
                    raise
        raise AssertionError("unreachable")

    def _start_on_new_ports(self, workdir: Path, timeout: float) -> NatsCluster:
        flat = free_ports(3 * self.size, self.host)
        ports = [tuple(flat[3 * i:3 * i + 3]) for i in range(self.size)]
        self.servers = [
            NatsServer(host=self.host, workdir=workdir, port=p, http_port=h, cluster_port=c, authorization=self.authorization,
                       routes=tuple(f"nats-route://{self.host}:{oc}" for j, (_, _, oc) in enumerate(ports) if j != i))
            for i, (p, h, c) in enumerate(ports)
        ]
        try:
            for server in self.servers:
                server.start(timeout, attempts=1, same_ports=True)
            self.wait_routed(timeout)
        except BaseException:
            self.stop()
            raise
        return self

    @property
    def urls(self) -> list[str]:
        return [s.url for s in self.servers]

    @property
    def url(self) -> str:
        """Every server, comma separated (what NATS_URL takes): a client fails over along the list."""
        return ",".join(self.urls)

    def url_from(self, i: int) -> str:
        """The list rotated to start at server i: with NATS_NO_RANDOMIZE a client prefers server i."""
        urls = self.urls
        i %= len(urls)
        return ",".join(urls[i:] + urls[:i])

    def routes(self, i: int) -> int:
        """Peers server i has a route to now (its /routez monitoring endpoint; a server keeps a pool of
        several route connections per peer, so peers are counted by their server id)."""
        s = self.servers[i]
        with urllib.request.urlopen(f"http://{s.host}:{s.http_port}/routez", timeout=2) as r:
            return len({route["remote_id"] for route in json.load(r).get("routes") or []})

    def connections(self, i: int) -> int:
        """Client connections on server i now (/connz)."""
        s = self.servers[i]
        with urllib.request.urlopen(f"http://{s.host}:{s.http_port}/connz", timeout=2) as r:
            return int(json.load(r)["num_connections"])

    def wait_routed(self, timeout: float = 15.0) -> None:
        """Until every running server has a route to every other running one."""
        deadline = time.monotonic() + timeout
        live = [i for i, s in enumerate(self.servers) if s.running]
        while True:
            try:
                if all(self.routes(i) >= len(live) - 1 for i in live):
                    return
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"nats cluster not routed within {timeout:g}s: "
                                   + "; ".join(s.log_tail(5) for s in self.servers))
            time.sleep(0.05)

    def kill(self, i: int) -> None:
        """SIGKILL server i: its clients lose their connection and reconnect to another server."""
        self.servers[i].kill()

    def restart(self, i: int, timeout: float = 15.0) -> None:
        """Server i comes back on the same ports and rejoins the cluster."""
        self.servers[i].start(timeout, attempts=10, same_ports=True)
        self.wait_routed(timeout)

    def stop(self) -> None:
        for s in self.servers:
            s.stop()

    def __enter__(self) -> NatsCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
