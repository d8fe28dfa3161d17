"""A simulated mesh (or, with engine="real", one of real CPU workers) as a real `kvmesh up --engine sim` (nats-server, gateway, tokenizer, simulated workers,
the supervisor) for the scale bench and the tests that run it: started, waited for until every worker has
beaten to the gateway, measured (per-process CPU and memory from /proc, nats-server's /varz), stopped.
Always torn down, also on an exception (the process group is killed if the drain does not end)."""
from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

READY = re.compile(r"kvmesh is up at (http://\S+)/v1")
STARTED = re.compile(r"^\[kvmesh\] started (\S+) \(pid (\d+)\)")
PLANNER = re.compile(r"decisions at (http://\S+)/decisions")
MONITOR = re.compile(r"^\[kvmesh\] nats(?:-0)? at \S+ \(monitoring (\S+);")
WORKER_SERIES = re.compile(r'^kvmesh:num_requests_running\{[^}]*role="(\w+)",worker="([^"]+)"')
CLK_TCK = os.sysconf("SC_CLK_TCK")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cpu_seconds(pid: int) -> float:
    """utime + stime of the process (its threads included)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def memory_mib(pid: int) -> dict[str, float]:
    """RSS and PSS (shared pages split between the processes mapping them) in MiB."""
    out = {}
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
        key, _, rest = line.partition(":")
        if key in ("Rss", "Pss"):
            out[key.lower() + "_mib"] = int(rest.split()[0]) / 1024
    return out


@dataclass
class SimMesh:
    model: Path
    decode: int
    prefill: int
    per_process: int = 1
    extra: Sequence[str] = ()
    log_path: Path | None = None
    startup_timeout_s: float = 240.0
    engine: str = "sim"  # "real": real engine workers on the CPU (the planner's mechanism test)
    base: str = ""
    planner: str = ""  # the planner's endpoint, when --planner is among the flags
    monitor: str = ""
    pids: dict[str, int] = field(default_factory=dict)
    lines: list[str] = field(default_factory=list)
    _proc: subprocess.Popen | None = None

    def __enter__(self) -> SimMesh:
        argv = [sys.executable, "-m", "shared.cli", "up", "--engine", self.engine, "--model", str(self.model),
                "--served-model-name", "sim", "--kvstore", "0", "--port", str(free_port()), "--nats-monitor",
                "--decode", str(self.decode), "--prefill", str(self.prefill), "--log-level", "warning",
                "--startup-timeout", str(self.startup_timeout_s), *self.extra]
        if self.engine == "sim":
            argv += ["--sim-workers-per-process", str(self.per_process)]
        env = {k: v for k, v in os.environ.items() if not k.startswith(("NATS_", "KVMESH_"))}
        self._proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                      start_new_session=True, env={**env, "PYTHONUNBUFFERED": "1"})
        threading.Thread(target=self._read, daemon=True).start()
        try:
            self._wait_up()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _read(self) -> None:
        assert self._proc is not None and self._proc.stdout is not None
        log = open(self.log_path, "w") if self.log_path else None  # noqa: SIM115 - closed at the end of output
        for line in self._proc.stdout:
            self.lines.append(line.rstrip("\n"))
            if log:
                log.write(line)
            if m := STARTED.search(line):
                self.pids[m[1]] = int(m[2])
            elif m := MONITOR.search(line):
                self.monitor = m[1]
            elif m := PLANNER.search(line):
                self.planner = m[1]
            elif m := READY.search(line):
                self.base = m[1]
        if log:
            log.close()

    def _wait_up(self) -> None:
        import httpx

        deadline = time.monotonic() + self.startup_timeout_s
        while not self.base:
            if self._proc.poll() is not None or time.monotonic() > deadline:  # type: ignore[union-attr]
                raise RuntimeError("the simulated mesh did not come up:\n" + "\n".join(self.lines[-30:]))
            time.sleep(0.2)
        # /health needs one decode worker; the bench needs all of them routable.
        while True:
            workers = self.workers(httpx.get(f"{self.base}/metrics", timeout=10).text)
            if len(workers["decode"]) >= self.decode and len(workers["prefill"]) >= self.prefill:
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"only {len(workers['decode'])}/{self.decode} decode and "
                                   f"{len(workers['prefill'])}/{self.prefill} prefill workers beat in time")
            time.sleep(0.5)

    @staticmethod
    def workers(metrics: str) -> dict[str, set[str]]:
        out: dict[str, set[str]] = {"decode": set(), "prefill": set()}
        for line in metrics.splitlines():
            if m := WORKER_SERIES.search(line):
                out.setdefault(m[1], set()).add(m[2])
        return out

    def service_pids(self) -> dict[str, int]:
        """Process name -> pid of what runs now (the launcher itself as "launcher")."""
        assert self._proc is not None
        return {"launcher": self._proc.pid, **self.pids}

    def cpu(self) -> dict[str, float]:
        out = {}
        for name, pid in self.service_pids().items():
            try:
                out[name] = cpu_seconds(pid)
            except (FileNotFoundError, ProcessLookupError):
                pass
        return out

    def varz(self) -> dict:
        import httpx

        return httpx.get(f"{self.monitor}/varz", timeout=5).json() if self.monitor else {}

    def stop(self, timeout: float = 60.0) -> int | None:
        p = self._proc
        if p is None or p.poll() is not None:
            return p.returncode if p else None
        os.killpg(p.pid, signal.SIGINT)  # the launcher drains the mesh like a Ctrl-C
        try:
            return p.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            return p.wait()
