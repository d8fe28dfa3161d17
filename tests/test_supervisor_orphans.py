"""A launcher killed with SIGKILL leaves no service behind: its children get SIGTERM from the kernel."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from tests.test_launcher import _alive

SCRIPT = """
import asyncio, sys
from shared.launcher.process_spec import ProcessSpec
from shared.launcher.supervisor import Supervisor

async def main():
    sup = Supervisor(emit=lambda line: print(line, flush=True))
    child = await sup.start(ProcessSpec("sleeper", (sys.executable, "-c", "import time; time.sleep(60)")))
    print("child", child.proc.pid, flush=True)
    await asyncio.Event().wait()

asyncio.run(main())
"""


def test_children_die_with_a_killed_launcher() -> None:
    root = Path(__file__).resolve().parents[1]
    launcher = subprocess.Popen([sys.executable, "-c", SCRIPT], cwd=root, stdout=subprocess.PIPE, text=True,
                                env={**os.environ, "PYTHONPATH": str(root)})
    try:
        pid = None
        for line in launcher.stdout:
            if line.startswith("child "):
                pid = int(line.split()[1])
                break
        assert pid is not None and _alive(pid)
        launcher.send_signal(signal.SIGKILL)
        launcher.wait(5)
        deadline = time.monotonic() + 5
        while _alive(pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _alive(pid), "the service outlived its launcher"
    finally:
        if launcher.poll() is None:
            launcher.kill()
