"""The end of every benchmark script: print its report as JSON, and write the same JSON to --json when given.

Standard library only, so that any script in loadtest/ can import it whatever else it imports (no cycles,
no torch just to print a dict)."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def emit_report(report: Any, path: str | Path | None, indent: int = 2) -> None:  # noqa: ANN401 - any JSON value
    """Print `report` as indented JSON; when `path` is given, write the same text there with a final newline."""
    text = json.dumps(report, indent=indent)
    print(text)
    if path:
        Path(path).write_text(text + "\n")
