"""Every engine worker computes with torch on one thread for its whole life (issue 27).

torch's CPU ops run their parallel loops in an OpenMP team per calling thread; once a second thread of a
process has run one parallel op, the engine's steps on a 2-core CPU get about 1.45x slower (SmolLM2 bf16,
batch 1: 31 -> 21 tok/s; loadtest/experiments/cpu_engine/engine_thread.py). Python cannot see OpenMP teams, so these tests load a
small probe (tests/omp_masters.c, LD_PRELOAD) that records which threads start parallel regions, run a real
`kvmesh up` on the real SmolLM2 checkpoint (its KV blocks are large enough that copying one runs in parallel)
with remote prefill, KV transfer, kvstore offload and a kvstore fetch, and check each engine worker process
had exactly one such thread.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import openai
import pytest

from shared.bus.natsd import free_port
from shared.launcher.up import READY
from tests.test_launcher import ROOT, Lines, _env

PROBE = Path(__file__).with_name("omp_masters.c")


@pytest.fixture(scope="module")
def probe(tmp_path_factory) -> Path:
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler to build the OpenMP probe")
    out = tmp_path_factory.mktemp("probe") / "omp_masters.so"
    subprocess.run([cc, "-shared", "-fPIC", "-O2", "-o", str(out), str(PROBE), "-ldl"], check=True)
    return out


def _masters(directory: Path) -> dict[int, set[int]]:
    return {int(f.name): {int(x) for x in f.read_text().split()} for f in directory.iterdir()}


SCRIPT = """
import threading, torch
torch.randn(1_000_000).sum()                  # the main thread: one team
if {second}:
    t = threading.Thread(target=lambda: torch.randn(1_000_000).sum())
    t.start(); t.join()                       # a second thread: a second team
torch.randn(1_000_000).sum()                  # the main thread again: still one
"""


@pytest.mark.parametrize("second", [False, True])
def test_the_probe_sees_each_thread_that_runs_parallel_ops(probe: Path, tmp_path: Path, second: bool) -> None:
    env = dict(os.environ, LD_PRELOAD=str(probe), OMP_MASTERS_DIR=str(tmp_path), OMP_NUM_THREADS="2")
    subprocess.run([sys.executable, "-c", SCRIPT.format(second=second)], check=True, env=env)
    ((_, threads),) = _masters(tmp_path).items()
    assert len(threads) == (2 if second else 1)


def test_engine_workers_compute_on_one_thread(probe: Path, smollm2_dir: Path, tmp_path: Path) -> None:
    masters = tmp_path / "masters"
    masters.mkdir()
    port = free_port()
    env = _env(LD_PRELOAD=str(probe), OMP_MASTERS_DIR=str(masters), OMP_NUM_THREADS="2",
               KVMESH_CPU_DTYPE="bfloat16")
    # --threads 2: two workers' shares on a 2-core machine are one thread each, and a team of one runs no
    # parallel region the probe could see.
    proc = subprocess.Popen(
        [sys.executable, "-m", "shared.cli", "up", "--model", str(smollm2_dir), "--port", str(port), "--grace", "3",
         "--startup-timeout", "150", "--prefill", "1", "--decode", "1", "--kvstore", "1",
         "--remote-prefill-threshold", "64", "--kvstore-disk-dir", "none", "--threads", "2"],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    out = Lines(proc.stdout)
    try:
        out.wait_for(READY, timeout=180)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused")
        text = " ".join(f"Line {i} of the ledger of the town of Brindlemoor." for i in range(40))
        for i in range(3):  # remote prefill + KV transfer, offload to the kvstore, then a cached prefix
            reply = client.chat.completions.create(model=smollm2_dir.name, max_tokens=4, temperature=0,
                                                   messages=[{"role": "user", "content": f"{text} Question {i}?"}])
            assert reply.usage.completion_tokens == 4
        time.sleep(1.0)  # offload is asynchronous
        workers = {}
        for pid, threads in _masters(masters).items():
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
            for role in ("services.prefill", "services.decode"):
                if role in cmdline:
                    workers[role] = threads
        assert set(workers) == {"services.prefill", "services.decode"}, f"no parallel ops seen: {workers}"
        for role, threads in workers.items():
            assert len(threads) == 1, f"{role}: {len(threads)} threads ran parallel torch ops"
    finally:
        proc.send_signal(2)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
