"""loadtest/report_json.emit_report: the tail every benchmark script shares (print the report, write it to --json)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from loadtest.report_json import emit_report

REPORT = {"model": "SmolLM2-135M-Instruct", "ratio": 1.234, "runs": [{"a": {"1": 31.5}}, {"a": {"1": 30.25}}], "none": None}


def test_prints_the_report_and_writes_the_same_json_with_a_final_newline(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "out.json"
    emit_report(REPORT, str(path))
    printed = capsys.readouterr().out
    # What the scripts printed and wrote before they shared this (json.dumps(report, indent=2), + "\n" on disk).
    assert printed == json.dumps(REPORT, indent=2) + "\n"
    assert path.read_text() == json.dumps(REPORT, indent=2) + "\n"
    assert json.loads(path.read_text()) == REPORT


def test_without_a_path_it_only_prints(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                       capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(tmp_path)
    for path in (None, ""):  # argparse's default, and an empty --json
        emit_report(REPORT, path, indent=1)
        assert capsys.readouterr().out == json.dumps(REPORT, indent=1) + "\n"
    assert list(tmp_path.iterdir()) == []
