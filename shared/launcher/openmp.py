"""How a CPU engine worker's OpenMP team waits between parallel regions when `kvmesh up` starts it.

torch's CPU kernels run in a libgomp team (one thread per core). By default an idle team member spins for a
long while (libgomp: 300,000 pause loops, several ms) before it sleeps, so between two parallel regions, and
through the Python part of every engine step (scheduling, sampling, outputs: about a quarter of a SmolLM2
batch-1 step), the team keeps every core busy. In-process nothing else wants those cores; in the mesh the
gateway, nats-server, the tokenizer and a local client do, and each token's work there (about 1 ms of CPU)
then lands on a core a spinning member holds: the OS shares the core, the member misses the next region's
start, and the whole team waits at the barrier. Measured on this project's 2-core CPU with other jobs busy
(SmolLM2 Q4_1, the C++ decoder stack, in process): 179-389 ms a batch-1 step spinning against 15-19 ms
passive (loadtest/results/mesh_overhead_s35.json). A passive team sleeps as soon as a region ends; the mesh's
processes run in the engine's own Python phase, on the core it leaves idle.

The user's own OpenMP settings win: any of these variables in the launcher's environment keeps the default.
"""
from __future__ import annotations

from collections.abc import Mapping

OPENMP_WAIT_VARIABLES = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "KMP_BLOCKTIME")


def shared_cores_env(environ: Mapping[str, str]) -> dict[str, str]:
    """The variables for a CPU engine worker's environment (empty where environ already says how to wait)."""
    if any(k in environ for k in OPENMP_WAIT_VARIABLES):
        return {}
    return {"OMP_WAIT_POLICY": "PASSIVE"}
