"""A kvmesh spread over namespaced hosts (tests/netns_hosts.py), started the way a user does it: the first host
runs `kvmesh up --write-join FILE --advertise-host ADDR` (gateway, tokenizer, kvstore and its nats-server), every
other host `kvmesh up --join FILE --advertise-host ADDR` with its workers, each inside its own namespace."""
from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from shared.launcher.join import JOINED
from shared.launcher.up import READY
from tests.netns_hosts import Host, NetnsHosts

ROOT = Path(__file__).resolve().parents[1]
GATEWAY_PORT = 8000


class Lines:
    """A child's output lines, collected in a thread; wait_for() blocks until one matches."""

    def __init__(self, stream) -> None:  # noqa: ANN001
        self.lines: list[str] = []
        self.closed = False  # the child closed its output (it exited)
        self._cond = threading.Condition()
        threading.Thread(target=self._read, args=(stream,), daemon=True).start()

    def _read(self, stream) -> None:  # noqa: ANN001
        for line in stream:
            with self._cond:
                self.lines.append(line.rstrip("\n"))
                self._cond.notify_all()
        with self._cond:
            self.closed = True
            self._cond.notify_all()

    def wait_for(self, pattern: str, timeout: float, start: int = 0) -> re.Match[str]:
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                for line in self.lines[start:]:
                    if m := re.search(pattern, line):
                        return m
                left = deadline - time.monotonic()
                if left <= 0 or self.closed:
                    raise AssertionError(f"no line matching {pattern!r} in {timeout}s; output:\n"
                                         + "\n".join(self.lines[-60:]))
                self._cond.wait(left)

    def text(self) -> str:
        with self._cond:
            return "\n".join(self.lines)


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("NATS_", "OTEL_", "KVMESH_"))}
    return {**env, "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(ROOT)}


@dataclass
class MultiHostMesh:
    hosts: NetnsHosts
    model: Path
    workdir: Path
    launchers: dict[str, tuple[subprocess.Popen, Lines]] = field(default_factory=dict)
    first: str = "a"

    @property
    def join_file(self) -> Path:
        return self.workdir / "mesh.join"

    @property
    def url(self) -> str:
        return f"http://{self.hosts[self.first].address}:{GATEWAY_PORT}"

    def _launch(self, host: Host, letter: str, args: list[str]) -> Lines:
        proc = host.popen([sys.executable, "-m", "shared.cli", "up", "--model", str(self.model), *args], cwd=ROOT,
                          env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        lines = Lines(proc.stdout)
        self.launchers[letter] = (proc, lines)
        return lines

    def start_first(self, letter: str = "a", *extra: str) -> Lines:
        """The first host: gateway, tokenizer, kvstore, nats-server; no engine worker of its own."""
        self.first = letter
        host = self.hosts[letter]
        lines = self._launch(host, letter, [
            "--host", host.address, "--port", str(GATEWAY_PORT), "--advertise-host", host.address,
            "--write-join", str(self.join_file), "--decode", "0", "--prefill", "0",
            "--kvstore-disk-dir", "none", "--startup-timeout", "420", "--grace", "3", *extra])
        lines.wait_for(r"join file ", timeout=30)
        return lines

    def join(self, letter: str, decode: int = 1, prefill: int = 0, *extra: str, wait: bool = True) -> Lines:
        """Host `letter` joins with its workers (wait: until its launcher says it joined)."""
        host = self.hosts[letter]
        lines = self._launch(host, letter, [
            "--join", str(self.join_file), "--advertise-host", host.address, "--host-name", letter,
            "--decode", str(decode), "--prefill", str(prefill), "--grace", "3", *extra])
        if wait:
            lines.wait_for(JOINED, timeout=60)
        return lines

    def wait_ready(self, decode_workers: set[str], timeout: float = 420.0) -> None:
        """Until the gateway answers /health with at least these decode workers alive. The bound is generous: a
        worker's first start on a machine may build the C++ CPU kernels, minutes on a busy 2-core machine."""
        self.launchers[self.first][1].wait_for(READY, timeout=timeout)
        self.wait_decode_workers(lambda alive: decode_workers <= alive, timeout)

    def health(self) -> dict:
        return httpx.get(f"{self.url}/health", timeout=5).json()

    def wait_decode_workers(self, ok, timeout: float = 60.0) -> set[str]:  # noqa: ANN001
        deadline = time.monotonic() + timeout
        alive: set[str] = set()
        while time.monotonic() < deadline:
            try:
                alive = set(self.health().get("decode_workers", []))
                if ok(alive):
                    return alive
            except (httpx.HTTPError, ValueError):
                pass
            time.sleep(0.3)
        raise AssertionError(f"decode workers alive: {sorted(alive)}; first host's output:\n"
                             + "\n".join(self.launchers[self.first][1].lines[-40:]))

    def wait_worker(self, worker: str, timeout: float = 300.0) -> None:
        """Until the gateway has heard the worker's load beats (its series are in /metrics)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                if f'worker="{worker}"' in httpx.get(f"{self.url}/metrics", timeout=5).text:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        raise AssertionError(f"{worker} never beat; output:\n{self.output()}")

    def metric(self, name: str, **labels: str) -> float:
        """Sum of a gateway /metrics series over the samples matching the labels."""
        total = 0.0
        for line in httpx.get(f"{self.url}/metrics", timeout=5).text.splitlines():
            if not line.startswith((name + "{", name + " ")):
                continue
            if all(f'{k}="{v}"' in line for k, v in labels.items()):
                total += float(line.rsplit(" ", 1)[1])
        return total

    def output(self) -> str:
        return "\n".join(f"--- {letter}\n" + lines.text()[-6000:] for letter, (_, lines) in self.launchers.items())
