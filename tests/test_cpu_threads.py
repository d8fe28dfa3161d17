"""Each CPU engine process's share of the cores, its pinning and its OpenMP wait policy (shared/engine/cpu_threads.py):
the arithmetic on made-up affinity masks, cgroup quotas and SMT topologies, then a real decode worker started the way
`kvmesh up` starts the second of two engine workers."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from shared.bus.natsd import NatsServer
from shared.engine.cpu_threads import (SHARE_ENV, CoreShare, apply_openmp_defaults, capped, host_shares, openmp_env,
                                       plan_for_this_process, plan_threads, quota_cores, sibling_groups, worker_env)

ROOT = Path(__file__).resolve().parents[1]


def test_quota_cores_reads_cgroup_v2_cpu_max() -> None:
    assert quota_cores("max 100000") is None
    assert quota_cores(None) is None and quota_cores("") is None
    assert quota_cores("150000 100000") == 1.5
    assert quota_cores("200000 50000") == 4.0
    assert quota_cores("garbage") is None


def test_shares_split_the_host_in_order() -> None:
    assert host_shares([1, 1]) == [CoreShare(0, 1, 2), CoreShare(1, 1, 2)]
    assert host_shares([2, 1]) == [CoreShare(0, 2, 3), CoreShare(2, 1, 3)]  # a tensor-parallel worker takes 2
    assert CoreShare.parse("1,1,2") == CoreShare(1, 1, 2)
    for bad in ("1,1", "a,b,c", "2,1,2", "0,0,1"):
        with pytest.raises(ValueError):
            CoreShare.parse(bad)


def test_one_engine_process_takes_every_usable_core_unpinned() -> None:
    plan = plan_threads({0, 1, 2, 3}, None, None, None)
    assert (plan.threads, plan.cpus, plan.cores) == (4, None, 4)
    assert "only engine process" in plan.reason


def test_two_workers_on_two_cores_get_one_pinned_core_each() -> None:
    first = plan_threads({0, 1}, None, CoreShare(0, 1, 2), None)
    second = plan_threads({0, 1}, None, CoreShare(1, 1, 2), None)
    assert (first.threads, first.cpus) == (1, (0,))
    assert (second.threads, second.cpus) == (1, (1,))


def test_existing_affinity_mask_is_respected() -> None:
    # `taskset -c 4-7 kvmesh up --prefill 1`: the workers split CPUs 4-7, never leave them.
    plans = [plan_threads({4, 5, 6, 7}, None, s, None) for s in host_shares([1, 1])]
    assert [p.cpus for p in plans] == [(4, 5), (6, 7)]
    assert [p.threads for p in plans] == [2, 2]
    assert "affinity 4-7" in plans[0].reason


def test_cgroup_quota_caps_the_cores() -> None:
    # 8 CPUs visible, a 2.5-CPU quota: two whole cores, one for each of the two workers.
    plans = [plan_threads(set(range(8)), 2.5, s, None) for s in host_shares([1, 1])]
    assert [(p.threads, p.cpus, p.cores) for p in plans] == [(1, (0,), 2), (1, (1,), 2)]
    assert "quota 2.5" in plans[0].reason
    assert plan_threads(set(range(8)), 0.5, None, None).threads == 1  # below one CPU: still one thread


def test_smt_siblings_count_as_one_core() -> None:
    topo = {0: "0,4", 1: "1,5", 2: "2,6", 3: "3,7", 4: "0,4", 5: "1,5", 6: "2,6", 7: "3,7"}
    assert sibling_groups(range(8), topo.get) == [(0, 4), (1, 5), (2, 6), (3, 7)]
    assert sibling_groups([0, 1], {0: "0-1", 1: "0-1"}.get) == [(0, 1)]
    plan = plan_threads(set(range(8)), None, CoreShare(1, 1, 2), None, topo.get)
    assert (plan.threads, plan.cpus) == (2, (2, 3, 6, 7))  # two cores, both hardware threads of each pinned


def test_tensor_parallel_worker_gets_its_ranks_cores() -> None:
    decode, prefill = host_shares([2, 1])
    plan = plan_threads(set(range(6)), None, decode, None)
    assert (plan.threads, plan.cpus) == (4, (0, 1, 2, 3))
    assert plan_threads(set(range(6)), None, prefill, None).cpus == (4, 5)


def test_more_workers_than_cores_deal_the_cores_round() -> None:
    plans = [plan_threads({0, 1}, None, s, None) for s in host_shares([1, 1, 1])]
    assert [(p.threads, p.cpus) for p in plans] == [(1, (0,)), (1, (1,)), (1, (0,))]
    assert "more slots than cores" in plans[0].reason


def test_threads_flag_overrides_and_leaves_affinity_alone() -> None:
    plan = plan_threads({0, 1}, None, CoreShare(1, 1, 2), 3)
    assert (plan.threads, plan.cpus) == (3, None)
    assert plan.reason.startswith("--threads 3 given")


def test_omp_num_threads_caps_the_share() -> None:
    # The test suite runs every service with OMP_NUM_THREADS=1 under xdist: the share must not undo that.
    plan = plan_threads({0, 1, 2, 3}, None, CoreShare(0, 1, 2), None)
    one = capped(plan, "1")
    assert (one.threads, one.cpus) == (1, (0, 1)) and "OMP_NUM_THREADS=1 caps it" in one.reason
    assert capped(plan, "8") == plan and capped(plan, None) == plan and capped(plan, "x") == plan
    given = plan_threads({0, 1}, None, None, 2)
    assert capped(given, "1") == given  # --threads wins over the environment


def test_openmp_defaults_yield_to_the_users_choice() -> None:
    assert openmp_env({}) == {"GOMP_SPINCOUNT": "1000"}
    assert openmp_env({"OMP_WAIT_POLICY": "ACTIVE"}) == {}
    assert openmp_env({"GOMP_SPINCOUNT": "10000"}) == {}
    assert openmp_env({"OMP_WAIT_POLICY": "PASSIVE"}) == {}
    env: dict[str, str] = {}
    assert apply_openmp_defaults(env) is ("torch" not in sys.modules)


def test_worker_env_for_the_launcher() -> None:
    env = worker_env([("decode-0", 1), ("prefill-0", 1)], environ={})
    assert env == {"decode-0": {SHARE_ENV: "0,1,2", "GOMP_SPINCOUNT": "1000"},
                   "prefill-0": {SHARE_ENV: "1,1,2", "GOMP_SPINCOUNT": "1000"}}
    assert worker_env([("decode-0", 1)], environ={"OMP_WAIT_POLICY": "ACTIVE"}) == {"decode-0": {SHARE_ENV: "0,1,1"}}


@pytest.fixture(scope="module")
def demo_model(tmp_path_factory) -> Path:
    from shared.models.demo import build_demo_model

    return build_demo_model(tmp_path_factory.mktemp("cpu-threads") / "demo")


def _allowed(status: Path) -> set[int]:
    text = next(x for x in status.read_text().splitlines() if x.startswith("Cpus_allowed_list"))
    out: set[int] = set()
    for part in text.split(":", 1)[1].strip().split(","):
        lo, _, hi = part.partition("-")
        out.update(range(int(lo), int(hi or lo) + 1))
    return out


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="needs Linux affinity")
def test_real_decode_worker_takes_its_share(demo_model: Path, tmp_path: Path) -> None:
    """A decode worker started as the second of two engine workers on this host: pinned to its share of the cores,
    its torch threads set to match, OpenMP's spin bounded, and it says so in its log."""
    share = {SHARE_ENV: "1,1,2"}
    expected = plan_for_this_process(None, share)
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("NATS_", "OTEL_", "KVMESH_", "OMP_", "GOMP_"))}
    with NatsServer(workdir=tmp_path) as nats:
        proc = subprocess.Popen(
            [sys.executable, "-m", "services.decode", "--model", str(demo_model), "--nats-url", nats.url,
             "--worker-id", "decode-1", "--kv-cache-bytes", str(8 << 20)],
            cwd=ROOT, env={**env, **share, "PYTHONUNBUFFERED": "1"}, stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, text=True)
        lines: list[str] = []
        try:
            assert proc.stdout is not None
            for line in proc.stdout:
                lines.append(line.rstrip())
                if "CPU threads:" in line:
                    break
            else:
                pytest.fail("no CPU threads line:\n" + "\n".join(lines[-30:]))
            line = lines[-1]
            m = re.search(r"CPU threads: (\d+) of (\d+) cores", line)
            assert m and int(m[1]) == expected.threads and int(m[2]) == expected.cores, line
            assert "GOMP_SPINCOUNT=1000" in line, line
            if expected.cpus is not None:
                assert "pinned to CPUs" in line, line
                # Every thread of the worker, the ones made before the pinning included (a short-lived one may
                # end between the listing and the read: what it was allowed no longer matters).
                for task in Path(f"/proc/{proc.pid}/task").iterdir():
                    try:
                        allowed = _allowed(task / "status")
                    except FileNotFoundError:
                        continue
                    assert allowed == set(expected.cpus), task.name
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


@pytest.mark.slow
@pytest.mark.skipif(not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2,
                    reason="needs Linux affinity and two usable CPUs")
def test_kvmesh_up_splits_the_cores_between_its_engine_workers(demo_model: Path, tmp_path: Path) -> None:
    """`kvmesh up --prefill 1` on CPU: the prefill and the decode worker each on their own cores."""
    import signal
    import time

    from shared.bus.natsd import free_port
    from shared.launcher.up import READY

    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("NATS_", "OTEL_", "KVMESH_", "OMP_", "GOMP_"))}
    log = tmp_path / "up.log"
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "shared.cli", "up", "--model", str(demo_model), "--port",
                                 str(free_port()), "--prefill", "1", "--kvstore", "0", "--devices", "none",
                                 "--startup-timeout", "240"], cwd=ROOT, env={**env, "PYTHONUNBUFFERED": "1"},
                                stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 300
        while READY not in log.read_text() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(1)
        text = log.read_text()
        assert READY in text, text[-3000:]
        pids = {m[1]: int(m[2]) for m in re.finditer(r"started (prefill-0|decode-0) \(pid (\d+)\)", text)}
        assert set(pids) == {"prefill-0", "decode-0"}, text[-3000:]
        masks = {name: _allowed(Path(f"/proc/{pid}/status")) for name, pid in pids.items()}
        assert masks["prefill-0"].isdisjoint(masks["decode-0"]), masks
        assert len(re.findall(r"CPU threads: \d+ of \d+ cores, pinned to CPUs", text)) == 2, text[-3000:]
    finally:
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
