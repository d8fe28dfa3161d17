"""Nothing lost when a decode worker dies (issue 9 item 2): the gateway notices the missing beats and
moves the request (prompt + tokens streamed so far) to another worker; the client's stream goes on and
the greedy text equals an undisturbed run. Real nats-server, real services, the real openai client."""
from __future__ import annotations

import threading
import time

import openai
import pytest

from tests.checkpoints import build_checkpoint
from tests.gateway_harness import Mesh

# Long enough that the worker is still streaming when it is killed: the tiny model on the C++ CPU path runs
# about a thousand steps a second.
MAX_TOKENS = 900


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):  # noqa: ANN001, ANN201
    return build_checkpoint("llama", tmp_path_factory.mktemp("migrate") / "llama", max_position_embeddings=1024).path


def _mesh(tmp_path, model_dir, **gateway):  # noqa: ANN001, ANN003, ANN202
    m = Mesh(tmp_path, model_dir, **gateway)
    m.start_tokenizer()
    for wid in ("d0", "d1"):
        m.start_decoder(wid, num_kv_blocks=128)
    m.wait_until(lambda: len(m.gateway.ctx.router.alive()) == 2)
    return m


def _kill_serving_worker(mesh) -> tuple[threading.Thread, list[str]]:  # noqa: ANN001
    """Kills (silences, as SIGKILL would) the worker serving the next request, once it has streamed a while."""
    killed: list[str] = []

    def kill() -> None:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            serving = [w for w, d in list(mesh.decoders.items()) if d.requests.ids()]
            if serving:
                time.sleep(0.05)  # tokens stream meanwhile
                mesh.crash(serving[0])
                killed.append(serving[0])
                return
            time.sleep(0.005)
    t = threading.Thread(target=kill)
    t.start()
    return t, killed


def _migrations(mesh) -> float:  # noqa: ANN001
    for line in mesh.gateway.ctx.metrics.render().decode().splitlines():
        if line.startswith("kvmesh:request_migrations_total"):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


@pytest.mark.parametrize("stream", [True, False])
def test_a_dead_decode_worker_does_not_lose_the_stream(model_dir, tmp_path, stream) -> None:  # noqa: ANN001
    mesh = _mesh(tmp_path, model_dir)
    try:
        client = openai.OpenAI(base_url=f"{mesh.url}/v1", api_key="unused", max_retries=0, timeout=60)
        kw = dict(model="tiny", prompt="Once upon a time", max_tokens=MAX_TOKENS, temperature=0,
                  extra_body={"ignore_eos": True})
        undisturbed = client.completions.create(**kw).choices[0].text
        killer, killed = _kill_serving_worker(mesh)
        if stream:
            text, reason = "", None
            for c in client.completions.create(stream=True, **kw):
                if c.choices:
                    text += c.choices[0].text
                    reason = c.choices[0].finish_reason or reason
        else:
            r = client.completions.create(**kw)
            text, reason = r.choices[0].text, r.choices[0].finish_reason
            assert r.usage.completion_tokens == MAX_TOKENS
        killer.join(10)
        assert killed, "the serving worker was never killed"
        # No wall-clock bound (a busy machine moves it): the client's 60 s timeout is half the gateway's 120 s
        # stream idle timeout, so an answer at all means the loss was seen, not waited out.
        assert text == undisturbed and reason == "length"
        assert _migrations(mesh) == 1.0
        (survivor,) = mesh.decoders.values()
        assert survivor.num_received >= 1
    finally:
        mesh.close()


def test_no_migration_allowed_gives_a_clean_error(model_dir, tmp_path) -> None:  # noqa: ANN001
    mesh = _mesh(tmp_path, model_dir, migration_limit=0)
    try:
        client = openai.OpenAI(base_url=f"{mesh.url}/v1", api_key="unused", max_retries=0, timeout=60)
        killer, killed = _kill_serving_worker(mesh)
        with pytest.raises(openai.APIError) as info:
            for _ in client.completions.create(model="tiny", prompt="Hello", max_tokens=MAX_TOKENS, temperature=0,
                                               stream=True, extra_body={"ignore_eos": True}):
                pass
        killer.join(10)
        assert killed
        assert "migration-limit" in str(info.value)  # within the client's 60 s: the loss was seen, not waited out
    finally:
        mesh.close()


def test_a_long_engine_step_is_not_a_dead_worker(model_dir, tmp_path) -> None:  # noqa: ANN001
    """A step that takes longer than the gateway's expiry (a big prefill on a CPU takes seconds) must not
    silence the worker's beats: it stays alive, and nothing migrates."""
    mesh = _mesh(tmp_path, model_dir, worker_expiry_s=1.0)
    try:
        d0 = mesh.decoders["d0"]
        stalled = mesh.call_soon(d0.thread.call(lambda e: time.sleep(3.0)))  # the engine is busy for 3 s
        seen_dead = False
        end = time.monotonic() + 3.0
        while time.monotonic() < end:
            seen_dead |= not mesh.gateway.ctx.router.is_alive("d0")
            time.sleep(0.05)
        stalled.result(10)
        assert not seen_dead, "d0's beats stopped while its engine was busy"
        assert _migrations(mesh) == 0
    finally:
        mesh.close()


def test_a_lost_tensor_parallel_rank_moves_the_workers_requests(model_dir, tmp_path) -> None:  # noqa: ANN001
    """Issue 22: SIGKILL the follower rank of a TP=2 decode worker while streams run on it. Its engine fails
    with TPRankError; the worker sends MOVE_ELSEWHERE (not "decode worker failed"), so every client's greedy
    text equals the undisturbed run's; the worker's wait_closed fails (the runner exits non-zero for a restart)
    and no rank is left: the follower is reaped and rank 0 has left its process group."""
    import os
    import signal
    from concurrent.futures import ThreadPoolExecutor

    import torch.distributed as dist

    mesh = Mesh(tmp_path, model_dir)
    try:
        mesh.start_tokenizer()
        d0 = mesh.start_decoder("d0", num_kv_blocks=128, tensor_parallel_size=2)
        mesh.wait_until(lambda: len(mesh.gateway.ctx.router.alive()) == 1)
        client = openai.OpenAI(base_url=f"{mesh.url}/v1", api_key="unused", max_retries=0, timeout=60)
        prompts = ["Once upon a time", "The quick brown fox", "In a distant galaxy"]
        kw = dict(model="tiny", max_tokens=120, temperature=0, extra_body={"ignore_eos": True})
        # Undisturbed on d0 alone; its prefix cache then draws the disturbed run's requests to it.
        undisturbed = [client.completions.create(prompt=p, **kw).choices[0].text for p in prompts]
        d1 = mesh.start_decoder("d1", num_kv_blocks=128)
        mesh.wait_until(lambda: len(mesh.gateway.ctx.router.alive()) == 2)
        closed = mesh.call_soon(d0.wait_closed())  # what the service runner awaits
        follower = d0.engine.tp.procs[0]
        on_d0: list[int] = []

        def kill() -> None:
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline and sum(len(d.requests.ids()) for d in (d0, d1)) < len(prompts):
                time.sleep(0.005)  # every stream placed: none reaches d0 after the kill
            time.sleep(0.3)  # tokens stream meanwhile
            on_d0.append(len(d0.requests.ids()))
            os.kill(follower.pid, signal.SIGKILL)

        def stream(prompt: str) -> tuple[str, str | None]:
            text, reason = "", None
            for c in client.completions.create(prompt=prompt, stream=True, **kw):
                if c.choices:
                    text += c.choices[0].text
                    reason = c.choices[0].finish_reason or reason
            return text, reason

        with ThreadPoolExecutor(len(prompts) + 1) as pool:
            killer = pool.submit(kill)
            results = list(pool.map(stream, prompts))
            killer.result(30)
        assert on_d0 and on_d0[0] >= 1, "no stream was on the TP worker when its rank was killed"
        assert results == [(t, "length") for t in undisturbed]
        assert _migrations(mesh) == on_d0[0]
        with pytest.raises(RuntimeError, match="TPRankError"):
            closed.result(30)
        mesh.decoders.pop("d0")
        mesh.call(d0.drain(1.0))  # the runner's drain before it exits
        assert follower.poll() == -signal.SIGKILL
        assert d0.engine.tp.closed and not dist.is_initialized()
    finally:
        mesh.close()
