"""How many threads a CPU engine process computes with, on which cores, and how its OpenMP team waits.

torch computes on CPU with an OpenMP team (libgomp, bundled with torch; a C++ extension built with -fopenmp
loads the same libgomp.so.1 by soname, so one runtime and one team serve both). The team's threads meet at a
barrier after every parallel op, and libgomp's default makes a waiting thread spin ~300k iterations before it
sleeps. When another process takes one of the team's cores (a second engine worker of the same mesh, a compiler,
any busy job), every barrier waits for the descheduled thread while the others burn their cores spinning: on a
2-core machine a decode step of 25-50 ms became 186-1,000 ms. Two rules follow:

- each engine process of a host gets its own share of the cores: threads = usable cores / engine slots (a slot is
  one engine process, or one tensor-parallel rank), pinned to disjoint cores when there is more than one slot, so
  the mesh's own workers never sit on each other's cores. Usable cores are the process's affinity mask, one CPU a
  physical core (SMT siblings share their core's execution units), capped by the cgroup's CPU quota;
- the team spins briefly, then sleeps (GOMP_SPINCOUNT=1000, libgomp's own figure for an oversubscribed team: tens
  of microseconds): a neighbour that took a core costs this process that core's share of time, not every barrier.
  Beside other jobs it decoded 4-9x faster than libgomp's default spin and as fast as OMP_WAIT_POLICY=PASSIVE
  (loadtest/experiments/cpu_engine/omp_neighbour_ab.py; docs/cpu.md has the figures). The team now runs torch's
  own ops; the C++ kernels, most of a decode step, have their own threads (kernels/cpu/thread_pool.cpp), which
  the same thread count sizes.

The OpenMP environment is read once, when torch loads libgomp: it is set in the launcher's child environment and
at the top of the engine services' entry points, never later. Standard library only: it runs before torch loads.
"""
from __future__ import annotations

import logging
import math
import os
import sys
from collections.abc import Callable, Iterable, Mapping, MutableMapping
from dataclasses import dataclass, replace
from pathlib import Path

log = logging.getLogger(__name__)

# "first,width,total": this process's engine slots among the `total` slots of the engine workers that one
# `kvmesh up` starts on this host (a worker with tensor parallelism k takes k slots).
SHARE_ENV = "KVMESH_CPU_SHARE"
CGROUP_CPU_MAX = Path("/sys/fs/cgroup/cpu.max")
CPU_SYSFS = Path("/sys/devices/system/cpu")
# What a CPU engine process's OpenMP team does at a barrier; a value the user set in the environment wins.
OPENMP_DEFAULTS: Mapping[str, str] = {"GOMP_SPINCOUNT": "1000"}
OPENMP_KEYS = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")


@dataclass(frozen=True)
class CoreShare:
    """Engine slots [first, first + width) of `total` on this host."""

    first: int = 0
    width: int = 1
    total: int = 1

    def __post_init__(self) -> None:
        if self.first < 0 or self.width < 1 or self.first + self.width > self.total:
            raise ValueError(f"bad core share {self.first},{self.width},{self.total}: need 0 <= first, "
                             "1 <= width, first + width <= total")

    def encode(self) -> str:
        return f"{self.first},{self.width},{self.total}"

    @classmethod
    def parse(cls, text: str) -> CoreShare:
        try:
            first, width, total = (int(x) for x in text.split(","))
        except ValueError:
            raise ValueError(f"{SHARE_ENV}={text!r}: expected FIRST,WIDTH,TOTAL (integers)") from None
        return cls(first, width, total)


@dataclass(frozen=True)
class ThreadPlan:
    """What one engine process computes with: `threads` torch threads, pinned to `cpus` (None: the affinity is
    left as it is), and the sentence the worker logs at start."""

    threads: int
    cpus: tuple[int, ...] | None
    cores: int  # usable physical cores on this host for this process's mesh
    reason: str


def host_shares(widths: Iterable[int]) -> list[CoreShare]:
    """One share per engine process of a host, in order, each `width` slots wide (its tensor-parallel size)."""
    widths = list(widths)
    total, first, shares = sum(widths), 0, []
    for w in widths:
        shares.append(CoreShare(first, w, total))
        first += w
    return shares


def quota_cores(cpu_max: str | None) -> float | None:
    """The CPUs a cgroup v2 `cpu.max` ("QUOTA PERIOD" or "max PERIOD") allows, None for no quota."""
    if not cpu_max:
        return None
    parts = cpu_max.split()
    if not parts or parts[0] == "max":
        return None
    try:
        quota, period = int(parts[0]), int(parts[1]) if len(parts) > 1 else 100_000
    except ValueError:
        return None
    return quota / period if period > 0 and quota > 0 else None


def read_text(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def sibling_groups(cpus: Iterable[int], siblings_of: Callable[[int], str | None]) -> list[tuple[int, ...]]:
    """The usable CPUs grouped by physical core (SMT siblings together), in CPU order. `siblings_of(cpu)` gives
    sysfs's thread_siblings_list ("0,4" or "0-1"); a CPU whose topology is unknown is its own core."""
    usable = sorted(set(cpus))
    seen: set[int] = set()
    groups = []
    for cpu in usable:
        if cpu in seen:
            continue
        text = siblings_of(cpu)
        sibs = {cpu} if not text else _cpu_list(text)
        group = tuple(c for c in usable if c in sibs) or (cpu,)
        seen.update(group)
        groups.append(group)
    return groups


def _cpu_list(text: str) -> set[int]:
    out: set[int] = set()
    for part in text.split(","):
        lo, _, hi = part.strip().partition("-")
        if lo:
            out.update(range(int(lo), int(hi or lo) + 1))
    return out


def plan_threads(affinity: Iterable[int], quota: float | None, share: CoreShare | None, requested: int | None,
                 siblings_of: Callable[[int], str | None] = lambda cpu: None) -> ThreadPlan:
    """The plan for one engine process. `requested` (--threads) wins and leaves the affinity alone. Otherwise the
    usable physical cores (affinity, capped at the quota's whole CPUs, at least one) are split evenly among the
    host's engine slots; with more slots than cores each process gets one thread and the cores are dealt round."""
    groups = sibling_groups(affinity, siblings_of)
    if quota is not None:
        groups = groups[:max(1, math.floor(quota))]
    cores = len(groups)
    where = f"{cores} usable core{'s' if cores != 1 else ''} (affinity {_describe(affinity)}" + (
        f", cgroup quota {quota:g} CPUs)" if quota is not None else ")")
    if requested:
        return ThreadPlan(requested, None, cores, f"--threads {requested} given; {where}")
    share = share or CoreShare()
    if share.total == 1:
        return ThreadPlan(cores, None, cores, f"the only engine process on {where}")
    per = cores // share.total
    if per >= 1:
        chosen = groups[share.first * per:(share.first + share.width) * per]
        why = f"{share.total} engine slots share {where}: {per} core{'s' if per != 1 else ''} a slot"
    else:
        chosen = [groups[(share.first + j) % cores] for j in range(min(share.width, cores))]
        why = f"{share.total} engine slots on {where}: more slots than cores, one thread a slot"
    cpus = tuple(sorted({c for g in chosen for c in g}))
    return ThreadPlan(len(chosen), cpus, cores, f"{why}, this process has slot{'s' if share.width > 1 else ''} "
                      f"{share.first}{f'-{share.first + share.width - 1}' if share.width > 1 else ''}")


def _describe(cpus: Iterable[int]) -> str:
    cpus = sorted(set(cpus))
    runs: list[str] = []
    for c in cpus:
        if runs and runs[-1].split("-")[-1] == str(c - 1):
            runs[-1] = f"{runs[-1].split('-')[0]}-{c}"
        else:
            runs.append(str(c))
    return ",".join(runs)


def capped(plan: ThreadPlan, omp_num_threads: str | None) -> ThreadPlan:
    """An OMP_NUM_THREADS in the environment (the test suite's one thread a service, a user's own limit) caps the
    share's threads; the pinning stays."""
    try:
        cap = int(omp_num_threads or 0)
    except ValueError:
        return plan
    if cap < 1 or cap >= plan.threads or plan.reason.startswith("--threads"):
        return plan
    return replace(plan, threads=cap, reason=f"{plan.reason}; OMP_NUM_THREADS={cap} caps it")


def plan_for_this_process(requested: int | None, environ: Mapping[str, str] = os.environ) -> ThreadPlan:
    """The plan from this process's affinity, the cgroup quota, the topology, the launcher's share and
    OMP_NUM_THREADS."""
    affinity = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else set(range(os.cpu_count() or 1))
    share = CoreShare.parse(environ[SHARE_ENV]) if environ.get(SHARE_ENV) else None
    plan = plan_threads(affinity, quota_cores(read_text(CGROUP_CPU_MAX)), share, requested,
                        lambda cpu: read_text(CPU_SYSFS / f"cpu{cpu}" / "topology" / "thread_siblings_list"))
    return capped(plan, environ.get("OMP_NUM_THREADS"))


def pin_process(cpus: Iterable[int]) -> bool:
    """Every thread of this process onto `cpus` (threads made later inherit it); False where the OS refuses."""
    if not hasattr(os, "sched_setaffinity"):
        return False
    cpus = set(cpus)
    try:
        tids = [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:
        tids = [0]
    pinned = False
    for tid in tids:
        try:
            os.sched_setaffinity(tid, cpus)
            pinned = True
        except OSError:  # a thread that ended meanwhile, or a mask the cgroup forbids
            continue
    return pinned


def openmp_env(environ: Mapping[str, str]) -> dict[str, str]:
    """The OpenMP defaults an engine process's environment lacks (the user's own OMP_WAIT_POLICY or
    GOMP_SPINCOUNT stays: either one means they chose how the team waits)."""
    if any(k in environ for k in OPENMP_KEYS):
        return {}
    return dict(OPENMP_DEFAULTS)


def apply_openmp_defaults(environ: MutableMapping[str, str] = os.environ) -> bool:
    """Set the defaults in this process's environment, before torch loads libgomp; False when torch is already
    loaded (its team would not read them) or the user set their own."""
    if "torch" in sys.modules:
        return False
    extra = openmp_env(environ)
    environ.update(extra)
    return bool(extra)


def apply_plan(plan: ThreadPlan) -> str:
    """Pin (when the plan says so) and set torch's threads; returns the line the worker logs."""
    import torch

    pinned = pin_process(plan.cpus) if plan.cpus else False
    torch.set_num_threads(plan.threads)
    where = (f"pinned to CPUs {_describe(plan.cpus)}" if pinned else
             f"not pinned (the OS refused CPUs {_describe(plan.cpus)})" if plan.cpus else "affinity unchanged")
    wait = ", ".join(f"{k}={os.environ[k]}" for k in OPENMP_KEYS if k in os.environ) or "libgomp default (spin)"
    return f"CPU threads: {plan.threads} of {plan.cores} cores, {where}; OpenMP wait {wait}; why: {plan.reason}"


def worker_env(workers: Iterable[tuple[str, int]], environ: Mapping[str, str] = os.environ) -> dict[str, dict[str, str]]:
    """What the launcher adds to each CPU engine worker's environment, by process name: its core share among
    `workers` ((name, tensor-parallel size) of every engine process it starts on this host) and the OpenMP
    defaults the environment lacks."""
    workers = list(workers)
    omp = openmp_env(environ)
    return {name: {SHARE_ENV: share.encode(), **omp}
            for (name, _), share in zip(workers, host_shares(w for _, w in workers), strict=True)}
