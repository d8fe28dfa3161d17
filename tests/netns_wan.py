"""A wide-area link between two namespaced hosts without netem (this machine's kernel has neither netem nor fq):
a userspace link emulator on a pair of TUN devices.

    python -m tests.netns_wan NS_A ADDR_A NS_B ADDR_B DELAY_MS RATE_MBIT QUEUE_KB TAG

Run in the root namespace. It makes one TUN device in each namespace and routes the other host's address over it
(`ip route add ADDR_B/32 dev TUN src ADDR_A`), so every packet between the two hosts' own addresses (NATS routes,
KV over TCP, HTTP) crosses it, while their traffic with any other host keeps the bridge. Each direction is a
link of its own: a packet waits behind the ones before it for its serialization time (size / rate), then
arrives DELAY_MS later, in order; one that would queue more than QUEUE_KB is dropped, as a router's tail drop.
RATE_MBIT 0 means no rate limit. It prints WAN_READY once routed, and when its stdin closes (or on SIGTERM) its
devices, and with them the routes, are gone: the hosts fall back to the bridge. On a clean close it says on stderr
how many packets each way's queue dropped.

The devices' MTU is 65,000 bytes, so TCP crosses in segments of up to 64 KB, as it reaches the stack of a NIC
with segmentation offload; a Python forwarder could not move 10 Gbit/s in 1,500-byte packets.
"""
from __future__ import annotations

import collections
import fcntl
import os
import signal
import struct
import sys
import threading
import time

from tests.netns_hosts import _ip

WAN_READY = "WAN_READY"
MTU = 65000
_TUNSETIFF = 0x400454CA
_IFF_TUN = 0x0001
_IFF_NO_PI = 0x1000


def _tun(name: str) -> int:
    fd = os.open("/dev/net/tun", os.O_RDWR)
    fcntl.ioctl(fd, _TUNSETIFF, struct.pack("16sH", name.encode(), _IFF_TUN | _IFF_NO_PI))
    return fd


class Direction:
    """One way of the link: packets read from `src` are written to `dst` once serialized and delayed."""

    def __init__(self, src: int, dst: int, delay_s: float, rate_bytes_s: float, queue_bytes: int) -> None:
        self.src, self.dst = src, dst
        self.delay_s, self.rate, self.queue_bytes = delay_s, rate_bytes_s, queue_bytes
        self.held: collections.deque[tuple[float, bytes]] = collections.deque()
        self.cond = threading.Condition()
        self.sent_until = 0.0  # when the last accepted packet has finished serializing
        self.dropped = 0

    def start(self) -> None:
        threading.Thread(target=self._take, daemon=True).start()
        threading.Thread(target=self._give, daemon=True).start()

    def _take(self) -> None:
        while True:
            try:
                packet = os.read(self.src, MTU + 64)
            except OSError:
                return
            now = time.monotonic()
            if self.rate:
                start = max(now, self.sent_until)
                if (start - now) * self.rate > self.queue_bytes:
                    self.dropped += 1
                    continue
                self.sent_until = start + len(packet) / self.rate
                due = self.sent_until + self.delay_s
            else:
                due = now + self.delay_s
            with self.cond:
                self.held.append((due, packet))
                self.cond.notify()

    def _give(self) -> None:
        while True:
            with self.cond:
                while not self.held:
                    self.cond.wait()
                due, packet = self.held[0]
            if (wait := due - time.monotonic()) > 0:
                time.sleep(wait)
            with self.cond:
                self.held.popleft()
            try:
                os.write(self.dst, packet)
            except OSError:
                pass  # the device went down (a partition test): the packet is lost, as on a real link


def main(argv: list[str]) -> int:
    ns_a, addr_a, ns_b, addr_b, delay_ms, rate_mbit, queue_kb, tag = argv
    names = (f"kvmw{tag}a", f"kvmw{tag}b")
    fds = [_tun(n) for n in names]
    for name, ns, own, peer in ((names[0], ns_a, addr_a, addr_b), (names[1], ns_b, addr_b, addr_a)):
        _ip("link", "set", name, "netns", ns)
        _ip("-n", ns, "link", "set", name, "mtu", str(MTU), "up")
        _ip("-n", ns, "route", "add", f"{peer}/32", "dev", name, "src", own)
    rate = float(rate_mbit) * 1e6 / 8
    delay = float(delay_ms) / 1000
    queue = int(float(queue_kb) * 1024)
    ways = (Direction(fds[0], fds[1], delay, rate, queue), Direction(fds[1], fds[0], delay, rate, queue))
    for way in ways:
        way.start()
    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
    print(WAN_READY, flush=True)
    sys.stdin.read()
    # What the queue dropped, for a run that wonders why TCP slowed down (its stderr).
    print(f"dropped {ways[0].dropped} packets {ns_a}->{ns_b}, {ways[1].dropped} {ns_b}->{ns_a}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
