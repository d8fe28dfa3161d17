"""The overloaded mesh, end to end: many concurrent chat streams, a fifth given up by their client (some before
their first token, some mid-stream), the decode worker serving most of them killed mid-run and restarted under its
own id. Every request is answered, or refused with a clean 429/503 OpenAI error carrying Retry-After; none hangs;
and shortly after the last one no engine holds a request or a KV block and the gateway waits on nothing.
Real nats-server, real gateway, tokenizer, prefill and decode workers on a tiny checkpoint, the real openai client.
The default run is small; the slow one is the size of the CPU load test (`kvmesh bench overload`)."""
from __future__ import annotations

import asyncio
import random
import time

import openai
import pytest

from tests.checkpoints import build_checkpoint
from tests.gateway_harness import Mesh

IDLE_WITHIN_S = 10.0


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):  # noqa: ANN001, ANN201
    return build_checkpoint("llama", tmp_path_factory.mktemp("overload_scenario") / "llama",
                            max_position_embeddings=1024).path


def _engines_idle(mesh: Mesh) -> list[tuple[str, int, int, int]]:
    """The engines still holding something: (worker, requests, free blocks, total blocks)."""
    busy = []
    for name, s in [*mesh.decoders.items(), *((f"prefill-{i}", p) for i, p in enumerate(mesh.prefills))]:
        held, free, total = mesh.engine_state(s)
        if held or free != total:
            busy.append((name, held, free, total))
    return busy


async def _one(client: openai.AsyncOpenAI, i: int, rng: random.Random) -> str:
    words = " ".join(rng.choice(("mesh", "token", "block", "cache", "stream")) for _ in range(rng.randint(4, 60)))
    args = dict(model="tiny", messages=[{"role": "user", "content": words}], max_tokens=rng.randint(40, 200),
                temperature=0, stream=True, extra_body={"ignore_eos": True})
    try:
        if i % 10 == 0:  # the client gives up before (or just after) its first token
            try:
                await asyncio.wait_for(client.chat.completions.create(**args), rng.uniform(0.01, 0.5))
            except asyncio.TimeoutError:
                pass
            return "cancelled"
        stream = await client.chat.completions.create(**args)
        n = 0
        async for chunk in stream:
            n += 1
            if i % 10 == 5 and n == 5:  # the client leaves mid-stream
                await stream.close()
                return "cancelled"
            if chunk.choices and chunk.choices[0].finish_reason is not None:
                assert chunk.choices[0].finish_reason == "length"
                return "answered"
        return "truncated"
    except openai.APIStatusError as e:
        assert e.status_code in (429, 503), (e.status_code, e.body)
        assert e.body["code"] and e.body["message"] and float(e.response.headers["retry-after-ms"]) > 0
        assert int(e.response.headers["retry-after"]) >= 1
        return f"refused {e.status_code}"


def _run(mesh: Mesh, total: int, concurrency: int, kill_after: int) -> dict[str, int]:
    outcomes: dict[str, int] = {}

    async def go() -> None:
        client = openai.AsyncOpenAI(base_url=f"{mesh.url}/v1", api_key="unused", max_retries=0, timeout=60)
        rng = random.Random(7)
        sem = asyncio.Semaphore(concurrency)
        done = 0

        async def bounded(i: int) -> None:
            nonlocal done
            async with sem:
                out = await asyncio.wait_for(_one(client, i, rng), 90)  # a hang fails the test
            outcomes[out] = outcomes.get(out, 0) + 1
            done += 1

        tasks = [asyncio.create_task(bounded(i)) for i in range(total)]
        while done < kill_after:
            await asyncio.sleep(0.02)
        victim = max(mesh.decoders, key=lambda w: len(mesh.decoders[w].requests.ids()))
        await asyncio.to_thread(mesh.crash, victim)
        await asyncio.to_thread(mesh.start_decoder, victim, 48, 32)  # the supervisor restarts it, same id
        await asyncio.gather(*tasks)
        await client.close()

    asyncio.run(go())
    return outcomes


def _check(mesh: Mesh, outcomes: dict[str, int], total: int) -> None:
    assert sum(outcomes.values()) == total and "truncated" not in outcomes, outcomes
    assert outcomes.get("answered", 0) > 0, outcomes
    end = time.monotonic() + IDLE_WITHIN_S
    while (busy := _engines_idle(mesh)) and time.monotonic() < end:
        time.sleep(0.2)
    assert not busy, f"engines still hold work {IDLE_WITHIN_S:g}s after the last request: {busy} ({outcomes})"
    ctx = mesh.gateway.ctx
    assert ctx.in_flight == 0 and ctx.model.queue.waiting == 0


def _mesh(tmp_path, model_dir, max_queue_wait_s: float) -> Mesh:  # noqa: ANN001
    m = Mesh(tmp_path, model_dir, max_queue_wait_s=max_queue_wait_s)
    m.start_tokenizer()
    m.start_prefill(num_kv_blocks=64)
    for w in ("d0", "d1"):
        m.start_decoder(w, num_kv_blocks=48, threshold=32)  # longer prompts prefill remotely
    m.wait_until(lambda: len(m.gateway.ctx.router.alive()) == 2)
    return m


def _scenario(tmp_path, model_dir, max_queue_wait_s: float, total: int, concurrency: int,  # noqa: ANN001
              kill_after: int) -> None:
    mesh = _mesh(tmp_path, model_dir, max_queue_wait_s=max_queue_wait_s)
    try:
        _check(mesh, _run(mesh, total=total, concurrency=concurrency, kill_after=kill_after), total)
    finally:
        mesh.close()


def test_cancels_and_a_killed_worker_leave_no_work_behind(tmp_path, model_dir) -> None:  # noqa: ANN001
    _scenario(tmp_path, model_dir, max_queue_wait_s=20.0, total=30, concurrency=10, kill_after=8)


@pytest.mark.slow
def test_the_cpu_load_test_scenario_in_process(tmp_path, model_dir) -> None:  # noqa: ANN001
    _scenario(tmp_path, model_dir, max_queue_wait_s=10.0, total=300, concurrency=32, kill_after=100)
