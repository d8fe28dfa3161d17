"""`kvmesh up` as a subprocess for benchmarks: started in its own session with its output in a file, waited for
until it says it is up, and stopped (SIGINT to the group, SIGKILL after 60 s) when the block ends."""
from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

UP_LINE = "kvmesh is up at"


@contextlib.contextmanager
def kvmesh_up(gguf: Path, port: int, model_name: str, extra: list[str], log_path: Path, cwd: str | None = None,
              env: dict[str, str] | None = None, timeout_s: float = 300) -> Iterator[tuple[subprocess.Popen, Path]]:
    """(the `kvmesh up` process, its log file) once the mesh is up; RuntimeError with the log's tail if it is not
    within timeout_s."""
    cmd = [sys.executable, "-m", "shared.cli", "up", "--model", str(gguf), "--port", str(port),
           "--served-model-name", model_name, "--kvstore-disk-dir", "none", *extra]
    # The mesh's output goes to a file: a pipe nobody reads once the mesh is up would fill and block its logging.
    with open(log_path, "w") as log_file:
        proc = subprocess.Popen(cmd, stdout=log_file, stderr=subprocess.STDOUT, cwd=cwd, env=env,
                                start_new_session=True)
    try:
        end = time.monotonic() + timeout_s
        lines: list[str] = []
        while time.monotonic() < end and proc.poll() is None:
            lines = log_path.read_text().splitlines()
            if any(UP_LINE in x for x in lines):
                break
            time.sleep(0.5)
        lines = log_path.read_text().splitlines()  # what an up that exited at once said
        if not any(UP_LINE in x for x in lines):
            raise RuntimeError(f"kvmesh up did not come up (exit {proc.poll()}):\n" + "\n".join(lines[-30:]))
        yield proc, log_path
    finally:
        with contextlib.suppress(ProcessLookupError):  # an up that exited at once may have left no process
            os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
