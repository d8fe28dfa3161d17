"""The C++ kernels' own worker threads (kernels/cpu/thread_pool.cpp): every kernel gives the same bits on 1, 2 and 3
threads and with KVMESH_CPU_POOL=omp (torch's OpenMP team), the workers really run chunks, an error raised in a
chunk reaches the caller and leaves the pool working, and two Python threads calling kernels at once both get
their own results.

The test processes of `make test` compute on one thread (tests/conftest.py), where the pool never starts, so each
case runs in a child process with its own thread count."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kernels.cpu.extension import native_status

ROOT = Path(__file__).resolve().parents[1]

CHILD = r"""
import hashlib, json, sys, threading, time
import torch
threads = int(sys.argv[1])
torch.set_num_threads(threads)
from kernels.cpu.extension import native_status
assert native_status()[0], native_status()
from kernels.cpu import gemv_gguf as G
from kernels.cpu import paged_attention as A
from kernels.cpu import qk_rope_store as R
from kernels.cpu import rms_norm as N
from kernels.cpu import silu_mul as S
from kernels.cpu.gemv_bf16 import linear_w16
from shared.models.model_config import RopeConfig
from shared.models.rope import cos_sin_cache
from tests.test_cpu_gemv import _blocks
from tests.test_cpu_kernels import _caches, _meta

def digest(t):
    return hashlib.sha256(t.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()[:16]

g = torch.Generator().manual_seed(0)
out = {}
# Matmuls big enough for several chunks: one activation row (the two-weight-row kernel), 5 rows (row blocks),
# 40 rows (float32 tiles).
blocks = _blocks(1024, 576, g)[0]
w16 = torch.randn(1024, 576, generator=g).to(torch.bfloat16)
for rows in (1, 5, 40):
    x = torch.randn(rows, 576, generator=g)
    for fmt, (qs, sc) in blocks.items():
        for act in (G.ACT_F32, G.ACT_Q8):
            out[f"gguf{fmt}-{act}-{rows}"] = digest(G.linear_gguf(x, qs, sc, None, fmt, act))
    out[f"w16-{rows}"] = digest(linear_w16(x, w16))
x = torch.randn(300, 576, generator=g)
out["rms_norm"] = digest(N.rms_norm(x, torch.randn(576, generator=g), 1e-6))
out["silu_mul"] = digest(S.silu_mul(torch.randn(64, 2 * 1536, generator=g)))
table = cos_sin_cache(RopeConfig(theta=10000.0), 64, 512)
kc, vc = _caches(40, 16, 2, 64, torch.float32, 1)
qkv = torch.randn(200, 8 * 64, generator=g)
positions, slots = torch.arange(200, dtype=torch.int32), torch.arange(200, dtype=torch.int32)
out["rope_q"] = digest(R.qk_rope_store(qkv, 4, 2, 64, None, None, 1e-6, positions, table, kc, vc, slots))
out["rope_k"] = digest(kc)
meta = _meta([(6, 300)], [1, 17, 100, 160, 250, 333, 400, 500], 16, 40, seed=2)
q = torch.randn(meta.num_prefill_tokens + 8, 8, 64, generator=g)
out["attention"] = digest(A.paged_attention(q, kc, vc, meta, 0.125))
# An error inside a chunk (the last token's position is outside the rotary table) reaches the caller.
bad = positions.clone()
bad[-1] = 10_000
try:
    R.qk_rope_store(qkv, 4, 2, 64, None, None, 1e-6, bad, table, kc.clone(), vc.clone(), slots)
    out["error"] = None
except RuntimeError as e:
    out["error"] = str(e).splitlines()[0]
qs, sc = blocks[G.Q4]
x1 = torch.randn(1, 576, generator=g)
out["after_error"] = digest(G.linear_gguf(x1, qs, sc, None, G.Q4, G.ACT_Q8))
# Two Python threads at once (the op releases the GIL): each gets its own result every time.
want = {i: G.linear_gguf(x1 * (i + 1), qs, sc, None, G.Q4, G.ACT_Q8) for i in range(2)}
wrong = []
def loop(i):
    for _ in range(200):
        if not torch.equal(G.linear_gguf(x1 * (i + 1), qs, sc, None, G.Q4, G.ACT_Q8), want[i]):
            wrong.append(i)
ts = [threading.Thread(target=loop, args=(i,)) for i in range(2)]
[t.start() for t in ts]
[t.join() for t in ts]
out["concurrent_wrong"] = len(wrong)
# On a loaded machine the caller can claim every chunk of every job above before a woken worker gets a core:
# a larger matmul until a worker has taken one (a worker that never does fails the test after a minute).
big = torch.randn(8192, 576, generator=g).bfloat16()
deadline = time.monotonic() + 60
while threads > 1 and (s := torch.ops.kvmesh_cpu.pool_stats())[4] == 0 and s[3] == 0 and time.monotonic() < deadline:
    linear_w16(x1, big)
out["stats"] = list(torch.ops.kvmesh_cpu.pool_stats())
# A forked child has none of the parent's workers: it starts its own and computes the same bits.
if threads > 1 and not out["stats"][4]:
    import os
    pid = os.fork()
    if pid == 0:
        same = torch.equal(G.linear_gguf(x1 * 2, qs, sc, None, G.Q4, G.ACT_Q8), want[1])
        os._exit(0 if same and torch.ops.kvmesh_cpu.pool_stats()[0] == threads - 1 else 3)
    out["fork_child_exit"] = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
print("RESULT " + json.dumps(out))
"""


@pytest.fixture(scope="module", autouse=True)
def built() -> None:
    ok, why = native_status()
    assert ok, f"the C++ CPU kernels did not load: {why}"


def _start(threads: int, pool: str | None = None) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "KVMESH_CPU_POOL")}
    if pool:
        env["KVMESH_CPU_POOL"] = pool
    return subprocess.Popen([sys.executable, "-c", CHILD, str(threads)], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


@pytest.fixture(scope="module")
def runs() -> dict[str, dict]:
    # At once: most of a child's time is importing torch and the kernels.
    procs = {"1": _start(1), "2": _start(2), "3": _start(3), "omp2": _start(2, "omp")}
    out = {}
    for name, proc in procs.items():
        stdout, stderr = proc.communicate(timeout=600)
        assert proc.returncode == 0, stderr[-3000:]
        line = next(x for x in stdout.splitlines() if x.startswith("RESULT "))
        out[name] = json.loads(line.removeprefix("RESULT "))
    return out


def _outputs(r: dict) -> dict:
    return {k: v for k, v in r.items() if k not in ("stats", "error", "concurrent_wrong", "fork_child_exit")}


def test_every_kernel_gives_the_same_bits_on_any_thread_count_and_on_openmp(runs) -> None:
    one = _outputs(runs["1"])
    assert len(one) > 20
    for name in ("2", "3", "omp2"):
        assert _outputs(runs[name]) == one, name


def test_the_workers_run_chunks_and_one_thread_never_starts_them(runs) -> None:
    workers, jobs, chunks, worker_chunks, omp = runs["1"]["stats"]
    assert (workers, jobs, omp) == (0, 0, 0)
    for name, n in (("2", 1), ("3", 2)):
        workers, jobs, chunks, worker_chunks, omp = runs[name]["stats"]
        assert workers == n and omp == 0
        assert jobs > 30 and chunks > jobs and 0 < worker_chunks < chunks
        assert runs[name]["fork_child_exit"] == 0
    workers, jobs, _, _, omp = runs["omp2"]["stats"]
    assert (workers, jobs, omp) == (0, 0, 1)


def test_an_error_in_a_chunk_reaches_the_caller_and_the_pool_keeps_working(runs) -> None:
    for name, r in runs.items():
        assert r["error"] is not None and "outside the rotary table" in r["error"], name
        assert r["after_error"] == runs["1"]["after_error"]


def test_two_threads_calling_kernels_at_once_get_their_own_results(runs) -> None:
    for name, r in runs.items():
        assert r["concurrent_wrong"] == 0, name


def test_the_kernels_loops_follow_the_models_matmuls() -> None:
    """Loops go to the kernels' own threads only when every linear layer is one of the kernels' (16-bit or GGUF
    weights); a model with one of torch's (here a float32 nn.Linear head) runs them on torch's OpenMP team."""
    from torch import nn

    from kernels.cpu.thread_pool import stats, use_torch_team
    from shared.models.cpu_native import choose_kernel_threads
    from shared.models.quant_linear import WeightLinear

    assert "KVMESH_CPU_POOL" not in os.environ
    w = torch.randn(8, 16)
    try:
        ours = nn.Sequential(WeightLinear(w, None, torch.bfloat16), WeightLinear(w, None, torch.float16))
        assert choose_kernel_threads(ours).endswith("on their own threads: the matmuls are these kernels too")
        assert stats()[4] == 0
        mixed = nn.Sequential(WeightLinear(w, None, torch.bfloat16), nn.Linear(16, 8))
        assert "torch's OpenMP team: the matmuls are torch's (Linear)" in choose_kernel_threads(mixed)
        assert stats()[4] == 1
        assert "no linear layer is one of the kernels'" in choose_kernel_threads(nn.Sequential(nn.LayerNorm(4)))
    finally:
        use_torch_team(False)
    assert stats()[4] == 0
