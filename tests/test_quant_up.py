"""`kvmesh up --quantization fp8|awq|gptq`: every engine worker (prefill and decode, each model's, on GPUs or on the
CPU) gets the method on its command line, the other services do not; CPU-only formats stay refused on GPUs."""
from __future__ import annotations

import pytest

from shared.cli import main


def _dry_run(capsys, *argv: str) -> tuple[int, dict[str, list[str]], str]:
    rc = main(["up", "--dry-run", *argv])
    out = capsys.readouterr()
    lines: dict[str, list[str]] = {}
    for line in out.out.splitlines():
        name, sep, cmd = line.partition(": ")
        if sep and cmd.startswith("-m services."):  # a process line: "NAME: -m services.X ARGS [ENV=...]"
            lines.setdefault(name, []).append(cmd)
    return rc, lines, out.err


@pytest.mark.parametrize("method", ["fp8", "awq", "gptq"])
def test_every_engine_worker_on_gpus_gets_the_quantization(capsys, checkpoints, method) -> None:
    rc, lines, err = _dry_run(capsys, "--model", str(checkpoints["llama"].path), "--devices", "0,1",
                              "--gpu-memory", "80GiB", "--prefill", "2", "--decode", "2", "--quantization", method)
    assert rc == 0, err
    engines = {n: c for n, c in lines.items() if n.startswith(("prefill", "decode"))}
    assert len(engines) == 4, lines
    for name, cmds in engines.items():
        assert all(f"--quantization {method}" in c for c in cmds), (name, cmds)
    others = {n: c for n, c in lines.items() if n not in engines}
    assert others and not any("--quantization" in c for cmds in others.values() for c in cmds), others


def test_cpu_workers_get_fp8_too_and_cpu_formats_stay_refused_on_gpus(capsys, checkpoints) -> None:
    rc, lines, err = _dry_run(capsys, "--model", str(checkpoints["llama"].path), "--devices", "none",
                              "--quantization", "fp8")
    assert rc == 0, err
    assert any(n.startswith("decode") for n in lines)
    assert all("--quantization fp8" in c for n, cmds in lines.items() if n.startswith(("prefill", "decode"))
               for c in cmds)
    rc, _, err = _dry_run(capsys, "--model", str(checkpoints["llama"].path), "--devices", "0",
                          "--gpu-memory", "80GiB", "--quantization", "int8")
    assert rc == 2 and "--devices none" in err
