"""kvmesh up's OpenMP wait policy for CPU engine workers (shared/launcher/openmp.py): passive unless the user chose,
and a passive libgomp team really stops burning a core between parallel regions (what the mesh's other processes
need; loadtest/results/mesh_overhead_s35.json)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from shared.launcher.openmp import OPENMP_WAIT_VARIABLES, shared_cores_env

ROOT = Path(__file__).resolve().parents[1]


def test_passive_unless_the_user_chose() -> None:
    assert shared_cores_env({}) == {"OMP_WAIT_POLICY": "PASSIVE"}
    assert shared_cores_env({"PATH": "/bin"}) == {"OMP_WAIT_POLICY": "PASSIVE"}
    for var in OPENMP_WAIT_VARIABLES:
        assert shared_cores_env({var: "ACTIVE"}) == {}, var


# A torch process with a 2-thread team: short parallel regions with 2 ms pauses of Python between them, like an
# engine step's C++ stack and its Python phase. Prints the CPU seconds of every thread but the main one.
TEAM = r"""
import json, os, time, torch
torch.set_num_threads(2)
a = torch.randn(384, 384)
for _ in range(20):
    a @ a
def others():
    out = 0
    for t in os.listdir("/proc/self/task"):
        if int(t) != os.getpid():
            f = open(f"/proc/self/task/{t}/stat").read().rsplit(")", 1)[1].split()
            out += int(f[11]) + int(f[12])
    return out / os.sysconf("SC_CLK_TCK")
c0, t0 = others(), time.perf_counter()
for _ in range(150):
    a @ a
    time.sleep(0.002)
print(json.dumps({"others_cpu_s": others() - c0, "wall_s": time.perf_counter() - t0}))
"""


def _team_cpu(env: dict[str, str]) -> float:
    base = {k: v for k, v in os.environ.items() if k not in OPENMP_WAIT_VARIABLES and k != "OMP_NUM_THREADS"}
    out = subprocess.run([sys.executable, "-c", TEAM], env={**base, **env}, cwd=ROOT, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])["others_cpu_s"]


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="an OpenMP team needs two cores here")
def test_a_passive_team_sleeps_between_regions() -> None:
    # A spinning member burns its core through every 2 ms pause (about 0.3 s over the loop); a passive one only
    # computes its share of the matmuls.
    spinning = _team_cpu({"GOMP_SPINCOUNT": "100000000"})
    passive = _team_cpu(shared_cores_env({}))
    assert passive < 0.5 * spinning, (passive, spinning)
