"""The documentation stays true: the CLI reference is what the parsers say, and the site builds with
`mkdocs build --strict` (every link and anchor resolves)."""
from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_cli_reference_is_current() -> None:
    # A subprocess: the generator renders defaults for an empty KVMESH_*/NATS_* environment and imports
    # every command's module, neither of which should leak into this test process.
    r = subprocess.run([sys.executable, "docs/gen_cli_reference.py", "--check"], cwd=ROOT,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr + "\n(regenerate with: python docs/gen_cli_reference.py)"


@pytest.mark.skipif(importlib.util.find_spec("mkdocs") is None or importlib.util.find_spec("material") is None,
                    reason="mkdocs / mkdocs-material not installed (pip install -e '.[dev]')")
def test_docs_build_strict(tmp_path: Path) -> None:
    r = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
                       cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
