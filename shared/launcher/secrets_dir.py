"""The directory where `kvmesh up` keeps one mesh's secrets (the nats-server configs with every password,
the TLS keys): private to this user, removed when the launcher exits. A launcher killed with SIGKILL cannot
remove it, so each launcher records its pid there and the next one removes directories whose launcher is
gone before it makes its own.
"""
from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

PREFIX = "kvmesh-up-"
OWNER_FILE = "launcher.pid"


@contextmanager
def secrets_dir() -> Iterator[Path]:
    remove_stale()
    path = Path(tempfile.mkdtemp(prefix=PREFIX))  # mode 0700
    try:
        (path / OWNER_FILE).write_text(str(os.getpid()))
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def remove_stale(root: Path | None = None) -> list[Path]:
    """Removes this user's secrets directories whose launcher no longer runs; returns them."""
    removed = []
    for d in Path(root or tempfile.gettempdir()).glob(f"{PREFIX}*"):
        try:
            if not d.is_dir() or d.is_symlink() or d.stat().st_uid != os.getuid():
                continue
            pid = int((d / OWNER_FILE).read_text().strip())
        except (OSError, ValueError):
            continue  # no owner recorded (an older launcher, or one still starting): leave it
        if not _alive(pid):
            shutil.rmtree(d, ignore_errors=True)
            removed.append(d)
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process: not ours to judge
    return True
