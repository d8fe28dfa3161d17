"""`kvmesh up`'s secrets directory (issue 20): a launcher killed with SIGKILL leaves it behind; the next
launcher removes it (and only directories whose launcher is gone)."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from shared.bus.natsd import free_port
from shared.launcher.secrets_dir import OWNER_FILE, PREFIX, remove_stale, secrets_dir
from shared.launcher.up import READY
from tests.test_launcher import ROOT, Lines, _env


def test_stale_directories_of_dead_launchers_are_removed(tmp_path, monkeypatch) -> None:  # noqa: ANN001
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    import tempfile
    monkeypatch.setattr(tempfile, "tempdir", None)
    dead = subprocess.Popen(["true"])
    dead.wait()
    stale, live, unknown = tmp_path / f"{PREFIX}stale", tmp_path / f"{PREFIX}live", tmp_path / f"{PREFIX}unknown"
    for d, pid in ((stale, dead.pid), (live, os.getpid()), (unknown, None)):
        d.mkdir(mode=0o700)
        (d / "nats.json").write_text('{"password": "x"}')
        if pid is not None:
            (d / OWNER_FILE).write_text(str(pid))
    with secrets_dir() as mine:
        assert mine.parent == tmp_path and (mine / OWNER_FILE).read_text() == str(os.getpid())
        assert oct(mine.stat().st_mode & 0o777) == "0o700"
        assert not stale.exists() and live.exists() and unknown.exists()
    assert not mine.exists()
    assert remove_stale(tmp_path) == []


def test_a_sigkilled_launchers_secrets_are_gone_after_the_next_start(tmp_path) -> None:  # noqa: ANN001
    from shared.models.demo import build_demo_model

    model = build_demo_model(tmp_path / "demo")
    root = tmp_path / "tmp"
    root.mkdir()

    def launch() -> tuple[subprocess.Popen, Lines]:
        proc = subprocess.Popen(
            [sys.executable, "-m", "shared.cli", "up", "--model", str(model), "--port", str(free_port()), "--grace", "3",
             "--startup-timeout", "120", "--prefill", "0", "--kvstore", "0"],
            cwd=ROOT, env=_env(TMPDIR=str(root)), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        out = Lines(proc.stdout)
        out.wait_for(READY, timeout=150)
        return proc, out

    first, _ = launch()
    (old,) = root.glob(f"{PREFIX}*")
    first.send_signal(signal.SIGKILL)
    first.wait()
    time.sleep(1.0)  # its children notice and go (tests/test_supervisor_orphans.py)
    assert old.exists() and (old / "nats.json").exists(), "SIGKILL leaves the secrets behind"
    second, _ = launch()
    try:
        dirs = list(root.glob(f"{PREFIX}*"))
        assert old not in dirs and len(dirs) == 1
    finally:
        second.send_signal(signal.SIGINT)
        second.wait(30)
    assert not list(root.glob(f"{PREFIX}*"))
