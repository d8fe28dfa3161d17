"""`kvmesh up` with several models, as a subprocess (each model's workers use their own subject namespace,
which is a process's configuration: an in-process mesh cannot have two), for the multi-model tests."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from shared.bus.natsd import free_port
from shared.launcher.up import READY

ROOT = Path(__file__).resolve().parents[1]


class UpMesh:
    """A running `kvmesh up`; lines holds its output, pids the services' process ids by instance name."""

    def __init__(self, args: list[str], timeout: float = 240.0) -> None:
        self.port = free_port()
        env = {k: v for k, v in os.environ.items() if not k.startswith(("NATS_", "OTEL_", "KVMESH_"))}
        # float32 on every CPU (bf16 where the CPU has it natively would not equal transformers' float32 output).
        env |= {"PYTHONUNBUFFERED": "1", "KVMESH_CPU_DTYPE": "float32"}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "shared.cli", "up", *args, "--port", str(self.port), "--kvstore-disk-dir", "none",
             "--startup-timeout", str(timeout)],
            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
        self.lines: list[str] = []
        self._cond = threading.Condition()
        threading.Thread(target=self._read, daemon=True).start()
        try:
            self.base = self.wait_for(rf"{READY} (http://\S+)/v1", timeout + 30)[1]
        except BaseException:
            self.close()
            raise

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            with self._cond:
                self.lines.append(line.rstrip("\n"))
                self._cond.notify_all()

    def wait_for(self, pattern: str, timeout: float) -> re.Match[str]:
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                for line in self.lines:
                    if m := re.search(pattern, line):
                        return m
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise AssertionError(f"no line matching {pattern!r}; output:\n" + "\n".join(self.lines[-60:]))
                self._cond.wait(1.0)

    @property
    def pids(self) -> dict[str, int]:
        """The latest pid of each service instance (a restarted one has a new pid)."""
        with self._cond:
            return {m[1]: int(m[2]) for line in self.lines
                    if (m := re.search(r"^\[kvmesh\] started (\S+) \(pid (\d+)\)", line))}

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
