"""The end of every benchmark script: print its report as JSON, and write the same JSON to --json when given.

Standard library only, so that any script in loadtest/ can import it whatever else it imports (no cycles,
no torch just to print a dict)."""
from __future__ import annotations

import json
import platform
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path
from typing import Any


def emit_report(report: Any, path: str | Path | None, indent: int = 2) -> None:  # noqa: ANN401 - any JSON value
    """Print `report` as indented JSON; when `path` is given, write the same text there with a final newline."""
    text = json.dumps(report, indent=indent)
    print(text)
    if path:
        Path(path).write_text(text + "\n")


def git_commit(short: bool = False) -> str | None:
    """The commit of the checkout this file is in (None outside a git checkout or without git)."""
    try:
        return subprocess.run(["git", "rev-parse", *(["--short"] if short else []), "HEAD"], capture_output=True,
                              text=True, timeout=10, cwd=Path(__file__).resolve().parent).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def provenance() -> dict[str, Any]:
    """What makes a result comparable over time: the commit (None outside a git checkout), when, where, and the
    command line that produced it."""
    spec = getattr(sys.modules["__main__"], "__spec__", None)
    program = f"python -m {spec.name}" if spec is not None else f"python {sys.argv[0]}"
    return {"commit": git_commit(), "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "machine": platform.node(), "command": " ".join([program, *sys.argv[1:]])}
