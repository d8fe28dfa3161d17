"""`kvmesh up` hands the gateway's request limits and the engine workers' thread count to the processes it starts,
through the real CLI's dry run (the exact command lines it would run)."""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from loadtest.shapes import SHAPES, build_shape_checkpoint


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    shape = replace(SHAPES["qwen3-0.6b"], write_weights=False)  # the dry run reads config.json only
    return Path(build_shape_checkpoint(str(tmp_path_factory.mktemp("up-limits") / "m"), shape))


def _argv(capsys, *argv: str) -> dict[str, list[str]]:
    from shared.cli import main

    assert main(["up", "--dry-run", *argv]) == 0
    return {name: line.split() for name, line in (row.split(": ", 1) for row in capsys.readouterr().out.splitlines()
                                                  if ": -m services." in row)}


def _value(argv: list[str], flag: str) -> str | None:
    return argv[argv.index(flag) + 1] if flag in argv else None


def test_gateway_limits_reach_the_gateway_only(model: Path, capsys) -> None:
    procs = _argv(capsys, "--model", str(model), "--devices", "none", "--prefill", "1", "--max-request-tokens",
                  "5000", "--stream-write-timeout", "7.5", "--max-queue-wait", "12")
    gateway = procs["gateway-0"]
    assert (_value(gateway, "--max-request-tokens"), _value(gateway, "--stream-write-timeout"),
            _value(gateway, "--max-queue-wait")) == ("5000", "7.5", "12")
    for name in ("decode-0", "prefill-0", "tokenizer-0"):
        assert "--max-request-tokens" not in procs[name] and "--stream-write-timeout" not in procs[name]


def test_threads_reach_every_engine_worker(model: Path, capsys) -> None:
    procs = _argv(capsys, "--model", str(model), "--devices", "none", "--prefill", "1", "--threads", "3")
    assert _value(procs["decode-0"], "--threads") == _value(procs["prefill-0"], "--threads") == "3"
    assert "--threads" not in procs["gateway-0"]
    # Without it each worker takes its share of the cores (shared/engine/cpu_threads.py), not a flag.
    procs = _argv(capsys, "--model", str(model), "--devices", "none", "--prefill", "1")
    assert "--threads" not in procs["decode-0"]


def test_a_thread_count_below_one_is_refused(model: Path, capsys) -> None:
    from shared.cli import main

    assert main(["up", "--dry-run", "--model", str(model), "--devices", "none", "--threads", "0"]) == 2
    assert "--threads must be positive" in capsys.readouterr().err
