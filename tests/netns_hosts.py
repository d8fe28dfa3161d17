"""Separate hosts on one machine: Linux network namespaces, each with its own address on a bridge.

Every host is a network namespace (`ip netns add`) with one veth pair: `eth0` inside, the other end on a bridge
in the root namespace, which also gets an address so the test process can reach the hosts (the gateway's
HTTP). A process runs on a host through `ip netns exec`. Faults are real network events: a partition takes the
host's link down (its processes live on, cut off), a lost host has every process in its namespace SIGKILLed,
and a slow link is a `tc` qdisc on the host's link (tbf: rate and queueing latency). This machine's kernel has no
netem, so a link with a fixed delay between two hosts is a userspace link emulator on TUN devices
(`NetnsHosts.wan`, tests/netns_wan.py).

Names start with `kvmh-<pid>-` (links `kvmh<tag>...`), so a run's leftovers are recognisable: `NetnsHosts`
removes everything it made on exit, failure included, and removes namespaces a dead test run left behind.
Needs root and iproute2; `available()` says whether this machine has them (tests skip otherwise).
"""
from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

PREFIX = "kvmh-"


def available() -> str | None:
    """None if network namespaces can be made here, else why not."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None:
        return "no iproute2 (ip)"
    name = f"{PREFIX}{os.getpid()}-probe"
    if _ip("netns", "add", name, check=False).returncode != 0:
        return "ip netns add fails here"
    _ip("netns", "del", name, check=False)
    return None


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    out = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if check and out.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {out.stderr.strip()}")
    return out


@dataclass
class Host:
    name: str  # the network namespace
    address: str  # its address on the bridge
    link: str  # the root-namespace end of its veth pair
    procs: list[subprocess.Popen] = field(default_factory=list)

    def argv(self, *argv: str) -> list[str]:
        return ["ip", "netns", "exec", self.name, *argv]

    def popen(self, argv: list[str], **kw) -> subprocess.Popen:  # noqa: ANN003
        """A process on this host (its own session, so it and its children can be signalled as a group)."""
        proc = subprocess.Popen(self.argv(*argv), start_new_session=True, **kw)
        self.procs.append(proc)
        return proc

    def run(self, *argv: str, timeout: float = 30) -> str:
        return subprocess.run(self.argv(*argv), capture_output=True, text=True, timeout=timeout, check=True).stdout

    def pids(self) -> list[int]:
        """Every process in this host's network namespace."""
        out = _ip("netns", "pids", self.name, check=False).stdout
        return [int(p) for p in out.split()]

    def partition(self) -> None:
        """The host's link goes down: its processes keep running, cut off from every other host."""
        _ip("link", "set", self.link, "down")

    def heal(self) -> None:
        _ip("link", "set", self.link, "up")

    def cut_from(self, other: Host) -> None:
        """Packets between this host and `other` only are dropped (both ways); every other path stays up."""
        self.run("ip", "route", "add", "blackhole", f"{other.address}/32")
        other.run("ip", "route", "add", "blackhole", f"{self.address}/32")

    def heal_cut(self, other: Host) -> None:
        for host, peer in ((self, other), (other, self)):
            subprocess.run(host.argv("ip", "route", "del", "blackhole", f"{peer.address}/32"), capture_output=True,
                           timeout=30)

    def kill_all(self) -> int:
        """The host is lost: SIGKILL to every process in its namespace (nats-server included)."""
        n = 0
        for _ in range(5):  # a dying launcher's children may still be exec'ing: sweep until none is left
            pids = self.pids()
            if not pids:
                break
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
                    n += 1
            time.sleep(0.1)
        for proc in self.procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=5)
        return n

    def shape(self, rate: str, latency: str = "50ms", burst: str = "64kb") -> None:
        """Traffic towards this host goes through a token bucket (tbf) of `rate`, queueing up to `latency`."""
        subprocess.run(["tc", "qdisc", "replace", "dev", self.link, "root", "tbf", "rate", rate, "burst", burst,
                        "latency", latency], check=True, capture_output=True, timeout=30)
        self.run("tc", "qdisc", "replace", "dev", "eth0", "root", "tbf", "rate", rate, "burst", burst,
                 "latency", latency)

    def unshape(self) -> None:
        subprocess.run(["tc", "qdisc", "del", "dev", self.link, "root"], capture_output=True, timeout=30)
        subprocess.run(self.argv("tc", "qdisc", "del", "dev", "eth0", "root"), capture_output=True, timeout=30)

    def tcp_peers(self) -> list[tuple[str, str, str]]:
        """Established TCP connections on this host: (local address:port, peer address:port, process)."""
        out = self.run("ss", "-tnpH", "state", "established")
        rows = []
        for line in out.splitlines():
            parts = line.split()
            if len(parts) >= 4:
                rows.append((parts[2], parts[3], " ".join(parts[4:])))
        return rows


@dataclass
class NetnsHosts:
    """`count` hosts named a, b, c, ... on one bridge, subnet 10.213.<n>.0/24; the root namespace is .254."""

    count: int = 3
    tag: str = field(default_factory=lambda: secrets.token_hex(2))
    hosts: dict[str, Host] = field(default_factory=dict)
    bridge: str = ""

    def __post_init__(self) -> None:
        self.bridge = f"kvmh{self.tag}br"
        self.subnet = f"10.213.{int(self.tag, 16) % 250}"

    @property
    def gateway_address(self) -> str:
        return f"{self.subnet}.254"

    def __enter__(self) -> NetnsHosts:
        remove_stale()
        try:
            _ip("link", "add", self.bridge, "type", "bridge")
            _ip("addr", "add", f"{self.gateway_address}/24", "dev", self.bridge)
            _ip("link", "set", self.bridge, "up")
            for i in range(self.count):
                letter = chr(ord("a") + i)
                host = Host(f"{PREFIX}{os.getpid()}-{self.tag}-{letter}", f"{self.subnet}.{i + 1}",
                            f"kvmh{self.tag}{letter}")
                _ip("netns", "add", host.name)
                self.hosts[letter] = host
                _ip("link", "add", host.link, "type", "veth", "peer", "name", "eth0", "netns", host.name)
                _ip("link", "set", host.link, "master", self.bridge, "up")
                _ip("-n", host.name, "addr", "add", f"{host.address}/24", "dev", "eth0")
                _ip("-n", host.name, "link", "set", "eth0", "up")
                _ip("-n", host.name, "link", "set", "lo", "up")
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __getitem__(self, letter: str) -> Host:
        return self.hosts[letter]

    @contextlib.contextmanager
    def wan(self, x: str, y: str, delay_ms: float, rate_mbit: float = 0, queue_kb: float = 4096):  # noqa: ANN201
        """Hosts x and y talk over an emulated wide-area link (tests/netns_wan.py): `delay_ms` each way, `rate_mbit`
        each way (0: unlimited), a tail-drop queue of `queue_kb`; every other pair keeps the bridge."""
        from tests.netns_wan import WAN_READY

        a, b = self.hosts[x], self.hosts[y]
        tag = f"{self.tag}{x}{y}"
        proc = subprocess.Popen([sys.executable, "-m", "tests.netns_wan", a.name, a.address, b.name, b.address,
                                 str(delay_ms), str(rate_mbit), str(queue_kb), tag], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                cwd=Path(__file__).resolve().parents[1])
        try:
            line = proc.stdout.readline().strip()
            if line != WAN_READY:
                raise RuntimeError(f"link emulator failed: {line} {proc.stderr.read()[-2000:]}")
            yield
        finally:
            if proc.poll() is None:
                proc.stdin.close()
                try:
                    proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(timeout=10)

    def close(self) -> None:
        for host in self.hosts.values():
            for proc in host.procs:  # the launchers first: a SIGTERM drains them and their children
                if proc.poll() is None:
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(proc.pid, signal.SIGTERM)
        for host in self.hosts.values():
            for proc in host.procs:
                try:
                    proc.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    pass
            host.kill_all()
            _ip("link", "del", host.link, check=False)
            _ip("netns", "del", host.name, check=False)
        _ip("link", "del", self.bridge, check=False)


def remove_stale() -> list[str]:
    """Namespaces (and their links) of test runs whose process is gone."""
    removed = []
    for line in _ip("netns", "list", check=False).stdout.splitlines():
        name = line.split()[0] if line.split() else ""
        if not name.startswith(PREFIX):
            continue
        try:
            pid = int(name[len(PREFIX):].split("-")[0])
        except ValueError:
            continue
        if Path(f"/proc/{pid}").exists():
            continue
        for p in _ip("netns", "pids", name, check=False).stdout.split():
            with contextlib.suppress(ProcessLookupError, ValueError):
                os.kill(int(p), signal.SIGKILL)
        tag = name.split("-")[2] if name.count("-") >= 3 else ""
        _ip("netns", "del", name, check=False)
        if tag:
            _ip("link", "del", f"kvmh{tag}br", check=False)
        removed.append(name)
    return removed
