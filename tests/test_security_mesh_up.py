"""`kvmesh up` refuses a kvstore disk directory that someone else could write (they could plant links or
read what is written there) before anything starts; the running mesh's disk tier is attacked in
tests/test_bus_attacks.py (one mesh for all the attacks)."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from shared.engine.errors import EXIT_CONFIG
from tests.test_launcher import ROOT, _env


def test_a_disk_directory_others_can_write_is_refused_before_anything_starts(tmp_path: Path) -> None:
    from shared.models.demo import build_demo_model

    model = build_demo_model(tmp_path / "demo")
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o777)
    r = subprocess.run([sys.executable, "-m", "shared.cli", "up", "--model", str(model), "--kvstore-disk-dir",
                        str(shared)], cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=120)
    assert r.returncode == EXIT_CONFIG, r.stdout + r.stderr
    assert re.search(r"--kvstore-disk-dir: .* writable by its group or by everyone", r.stderr), r.stderr
    assert "started" not in r.stdout and not list(shared.iterdir())


def test_the_compose_image_gives_the_kvstore_a_private_disk_directory() -> None:
    """The named volume takes the image directory's owner and mode when it is created: it must be the service
    user's own and 0700, or the kvstore (which refuses any other) could not use its disk tier."""
    text = (Path(ROOT) / "compose" / "Dockerfile").read_text()
    assert re.search(r"^RUN install -d -o kvmesh -g kvmesh -m 700 /data/kvstore$", text, re.M)
    assert text.index("useradd") < text.index("/data/kvstore") < text.index("USER kvmesh")
    compose = (Path(ROOT) / "compose" / "docker-compose.yml").read_text()
    assert "KVMESH_KVSTORE_DISK_DIR: /data/kvstore" in compose and "kvstore-data:/data/kvstore" in compose
