"""`kvmesh up` beyond loopback without an API key warns loudly; the gateway's request-limit switches reach it.
Through the real CLI's dry run (what it prints and the gateway's command line)."""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from loadtest.shapes import SHAPES, build_shape_checkpoint


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    shape = replace(SHAPES["qwen3-0.6b"], write_weights=False)  # the dry run reads config.json only
    return Path(build_shape_checkpoint(str(tmp_path_factory.mktemp("sec-up") / "m"), shape))


def _up(capsys, monkeypatch, *argv: str, key: str | None = None) -> tuple[str, str]:  # noqa: ANN001
    from shared.cli import main

    if key is None:
        monkeypatch.delenv("KVMESH_API_KEY", raising=False)
    else:
        monkeypatch.setenv("KVMESH_API_KEY", key)
    assert main(["up", "--dry-run", "--devices", "none", *argv]) == 0
    out = capsys.readouterr()
    gateway = next(line for line in out.out.splitlines() if line.startswith("gateway-0: "))
    return out.err, gateway


def test_an_open_gateway_without_a_key_warns(model: Path, capsys, monkeypatch) -> None:  # noqa: ANN001
    err, _ = _up(capsys, monkeypatch, "--model", str(model), "--host", "0.0.0.0")
    assert "WARNING: SECURITY" in err and "KVMESH_API_KEY" in err
    err, _ = _up(capsys, monkeypatch, "--model", str(model), "--host", "0.0.0.0", key="sk-set")
    assert "SECURITY" not in err
    err, _ = _up(capsys, monkeypatch, "--model", str(model))  # loopback, the default
    assert "SECURITY" not in err


def test_the_request_limit_switches_reach_the_gateway(model: Path, capsys, monkeypatch) -> None:  # noqa: ANN001
    _, gateway = _up(capsys, monkeypatch, "--model", str(model))
    assert "--trust-request-chat-template" not in gateway and "--scheduling-policy" not in gateway
    _, gateway = _up(capsys, monkeypatch, "--model", str(model), "--trust-request-chat-template",
                     "--scheduling-policy", "priority", "--trusted-hosts", "llm.example,localhost")
    assert "--trust-request-chat-template" in gateway and "--scheduling-policy priority" in gateway
    assert "--trusted-hosts llm.example,localhost" in gateway
