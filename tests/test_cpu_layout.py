"""`kvmesh up` on CPU starts no prefill worker unless asked (shared/launcher/cpu_layout.py), through the real CLI's
dry run: what it logs and the processes it would start."""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from loadtest.shapes import SHAPES, build_shape_checkpoint
from shared.launcher.cpu_layout import CPU_LAYOUT_NOTE
from shared.launcher.process_spec import NEVER_REMOTE


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    shape = replace(SHAPES["qwen3-0.6b"], write_weights=False)  # the dry run reads config.json only
    return Path(build_shape_checkpoint(str(tmp_path_factory.mktemp("cpu-layout") / "m"), shape))


def _processes(capsys, *argv: str) -> tuple[str, dict[str, str]]:
    from shared.cli import main

    assert main(["up", "--dry-run", *argv]) == 0
    out = capsys.readouterr().out
    procs = dict(line.split(": ", 1) for line in out.splitlines() if ": -m services." in line)
    return out, procs


def test_cpu_default_is_one_engine_process(model: Path, capsys) -> None:
    out, procs = _processes(capsys, "--model", str(model), "--devices", "none")
    assert CPU_LAYOUT_NOTE in out
    assert sorted(procs) == ["decode-0", "gateway-0", "kvstore-0", "tokenizer-0"]
    # Nothing may go remote without a prefill worker: decode prefills every prompt itself.
    assert f"--remote-prefill-threshold {NEVER_REMOTE}" in procs["decode-0"]


@pytest.mark.parametrize("ask", [["--prefill", "1"], ["--remote-prefill-threshold", "64"]])
def test_cpu_mesh_as_asked(model: Path, capsys, ask: list[str]) -> None:
    out, procs = _processes(capsys, "--model", str(model), "--devices", "none", *ask)
    assert CPU_LAYOUT_NOTE not in out
    assert "prefill-0" in procs and "decode-0" in procs


def test_gpu_and_simulated_layouts_keep_their_prefill_workers(model: Path, capsys) -> None:
    out, procs = _processes(capsys, "--model", str(model), "--devices", "0,1", "--gpu-memory", "80GiB")
    assert CPU_LAYOUT_NOTE not in out and "prefill-0" in procs
    out, procs = _processes(capsys, "--model", str(model), "--engine", "sim")
    assert CPU_LAYOUT_NOTE not in out and "prefill-0" in procs


def test_a_gguf_file_is_served_from_its_converted_directory(smollm2_gguf_file, capsys) -> None:
    """`kvmesh up --model FILE.gguf` alone: every worker is handed the converted checkpoint directory."""
    _, procs = _processes(capsys, "--model", str(smollm2_gguf_file), "--devices", "none")
    argv = procs["decode-0"].split()
    served = Path(argv[argv.index("--model") + 1])
    assert served.suffix != ".gguf" and (served / "config.json").is_file()
