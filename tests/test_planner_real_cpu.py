"""The planner's mechanism with real engine workers (issue 25 section 3): `kvmesh up --planner load` on a tiny
real checkpoint, CPU workers with a small batch limit so a closed loop of streams queues requests. The planner
scales decode 1 -> 3 under the load and back to 1 once it idles (each removal drains the worker: its requests
move to another), no request is lost, and every greedy output equals the one a fixed one-worker mesh gives."""
from __future__ import annotations

import re
import threading
import time

import httpx
import pytest

from loadtest.sim_mesh import SimMesh
from tests.checkpoints import build_checkpoint

MAX_TOKENS = 40


def _prompts(n: int) -> list[list[int]]:
    return [[(11 * i + 5 * j) % 500 + 3 for j in range(24 + i % 9)] for i in range(n)]


def _complete(client: httpx.Client, base: str, prompt: list[int]) -> tuple[str, str, int]:
    r = client.post(f"{base}/v1/completions", json={"model": "sim", "prompt": prompt, "max_tokens": MAX_TOKENS,
                                                    "temperature": 0})
    assert r.status_code == 200, r.text
    body = r.json()
    return body["choices"][0]["text"], body["choices"][0]["finish_reason"], body["usage"]["completion_tokens"]


def _counts(mesh: SimMesh) -> dict[str, int]:
    return httpx.get(f"{mesh.planner}/decisions", timeout=5).json()["counts"]


def _path_of(decisions: list[dict]) -> list[int]:
    return [d["applied"]["decode"] for d in decisions if d["changed"] and d["outcome"] == "ok"]


def _path(mesh: SimMesh) -> list[int]:
    """The decode counts the planner's applied decisions went through."""
    return _path_of(httpx.get(f"{mesh.planner}/decisions", timeout=5).json()["decisions"])


def _all_served(mesh: SimMesh, n: int) -> bool:
    """n decode workers beat to the gateway, and each has looked up prompts (taken requests)."""
    served = set()
    for line in httpx.get(f"{mesh.base}/metrics", timeout=10).text.splitlines():
        m = re.search(r'^kvmesh:prefix_cache_queries_total\{[^}]*worker="(decode-\d+)"\} (\S+)', line)
        if m and float(m[2]) > 0:
            served.add(m[1])
    return len(served) >= n


@pytest.mark.slow
def test_the_planner_scales_real_decode_workers_up_and_down_losing_nothing(tmp_path) -> None:  # noqa: ANN001
    model = build_checkpoint("llama", tmp_path / "llama").path
    prompts = _prompts(48)
    flags = ["--max-num-seqs", "2", "--grace", "5"]
    with SimMesh(model, decode=1, prefill=0, engine="real", extra=flags) as fixed, httpx.Client(timeout=120) as c:
        want = {i: _complete(c, fixed.base, p) for i, p in enumerate(prompts)}
    planner = ["--planner", "load", "--decode-min", "1", "--decode-max", "3", "--prefill-min", "0",
               "--prefill-max", "0", "--planner-interval", "1", "--drain-grace", "3"]
    with SimMesh(model, decode=1, prefill=0, engine="real", extra=flags + planner) as mesh:
        assert mesh.planner, "\n".join(mesh.lines[-20:])
        got: list[tuple[int, tuple[str, str, int] | str]] = []
        stop = threading.Event()
        seen: list[int] = []

        def stream(k: int) -> None:
            with httpx.Client(timeout=120) as c:
                i = k
                while not stop.is_set():
                    try:
                        got.append((i % len(prompts), _complete(c, mesh.base, prompts[i % len(prompts)])))
                    except Exception as e:  # noqa: BLE001 - a lost request, counted below
                        got.append((i % len(prompts), f"{type(e).__name__}: {e}"))
                    i += 12

        threads = [threading.Thread(target=stream, args=(k,)) for k in range(12)]
        for t in threads:
            t.start()
        try:
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline:
                seen.append(_counts(mesh)["decode"])
                if seen[-1] == 3:
                    break
                time.sleep(0.5)
            assert seen[-1] == 3, seen
            # The planner asked for 3 once the processes exist; the load goes on until all three serve.
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline and not _all_served(mesh, 3):
                time.sleep(1)
            assert _all_served(mesh, 3), httpx.get(f"{mesh.base}/metrics", timeout=10).text[-3000:]
        finally:
            stop.set()
            for t in threads:
                t.join(timeout=150)
        up_done = len(got)
        # Idle: back to one, one drained worker at a time (a decision is recorded once its drain has ended).
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline and _path(mesh)[-1:] != [1]:
            time.sleep(0.5)
        decisions = httpx.get(f"{mesh.planner}/decisions", timeout=5).json()["decisions"]
        assert _counts(mesh)["decode"] == 1 and _path(mesh)[-1:] == [1], decisions
        # After the scale-down the one worker left still serves, with the same outputs.
        with httpx.Client(timeout=120) as c:
            for i in range(4):
                got.append((i, _complete(c, mesh.base, prompts[i])))
        assert mesh.stop() == 0, "\n".join(mesh.lines[-30:])
    lost = [(i, r) for i, r in got if isinstance(r, str)]
    assert not lost, lost[:5]
    differ = [(i, r, want[i]) for i, r in got if r != want[i]]
    assert not differ, differ[:3]
    assert up_done >= 24
    assert _path_of(decisions) == [2, 3, 2, 1], decisions  # one step at a time, no flapping
