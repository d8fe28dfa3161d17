"""The whole mesh over HTTP with the official openai client: gateway, tokenizer, decode, prefill and
kvstore on a real nats-server, compared with transformers generate() token for token."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from shared import subjects
from shared.models.tokenizer import encode_chat, load_tokenizer
from tests.engine_helpers import random_prompts
from tests.gateway_harness import Mesh

MAX_NEW = 12
LENGTHS = [1, 7, 16, 31, 48, 90, 120, 200]
CHATS = [[{"role": "user", "content": "Hello there, who are you?"}],
         [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name three colors. Ünïcödé ✓"}]]


@pytest.fixture
def ckpt(checkpoints):
    return checkpoints["llama"]


def client_for(mesh: Mesh) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{mesh.url}/v1", api_key="unused", max_retries=0, timeout=60)


def expected_text(ckpt, hf_reference, prompt_ids: list[int]) -> tuple[str, int]:
    tokens, _ = hf_reference(ckpt, prompt_ids, MAX_NEW)
    return load_tokenizer(ckpt.path).decode(tokens, skip_special_tokens=True), len(tokens)


def check_completion(client, ckpt, hf_reference, prompt_ids: list[int]) -> None:
    r = client.completions.create(model="tiny", prompt=prompt_ids, max_tokens=MAX_NEW, temperature=0)
    text, n = expected_text(ckpt, hf_reference, prompt_ids)
    assert (r.choices[0].text, r.usage.completion_tokens) == (text, n), f"prompt of {len(prompt_ids)} tokens"


def check_chat(client, ckpt, hf_reference, messages) -> None:
    r = client.chat.completions.create(model="tiny", messages=messages, max_tokens=MAX_NEW, temperature=0)
    ids = encode_chat(load_tokenizer(ckpt.path), messages)
    text, n = expected_text(ckpt, hf_reference, ids)
    assert (r.choices[0].message.content, r.usage.completion_tokens) == (text, n)
    assert r.usage.prompt_tokens == len(ids)


def wait_all_free(mesh: Mesh, timeout: float = 2.0) -> None:
    workers = list(mesh.decoders.values()) + mesh.prefills
    mesh.wait_until(lambda: all(held == 0 and free == total
                                for held, free, total in map(mesh.engine_state, workers)), timeout=timeout)


@pytest.mark.parametrize("mode", ["remote", "local"])
def test_greedy_through_the_mesh_matches_transformers(mode, ckpt, hf_reference, tmp_path):
    mesh = Mesh(tmp_path, ckpt.path)
    try:
        mesh.start_tokenizer()
        mesh.start_kvstore()
        if mode == "remote":
            mesh.start_prefill(use_kvstore=True)
        d0 = mesh.start_decoder("d0", threshold=0 if mode == "remote" else 1 << 30, use_kvstore=True)
        mesh.wait_until(lambda: mesh.gateway.ctx.router.alive())
        client = client_for(mesh)
        for prompt in random_prompts(LENGTHS, seed=31):
            check_completion(client, ckpt, hf_reference, prompt)
        for messages in CHATS:
            check_chat(client, ckpt, hf_reference, messages)
        n = len(LENGTHS) + len(CHATS)
        assert (d0.remote_prefills, d0.remote_fallbacks) == ((n, 0) if mode == "remote" else (0, 0))
        wait_all_free(mesh)
    finally:
        mesh.close()


def test_two_prefill_two_decode_under_32_concurrent_requests(ckpt, hf_reference, tmp_path):
    mesh = Mesh(tmp_path, ckpt.path)
    try:
        mesh.start_tokenizer()
        mesh.start_kvstore()
        prefills = [mesh.start_prefill(use_kvstore=True) for _ in range(2)]
        # Pools large enough to reserve every prompt at once (a full pool queues a request locally instead).
        decoders = [mesh.start_decoder(f"d{i}", threshold=0, use_kvstore=True, num_kv_blocks=320) for i in range(2)]
        mesh.wait_until(lambda: len(mesh.gateway.ctx.router.alive()) == 2)
        client = client_for(mesh)
        prompts = random_prompts([5 + 7 * i for i in range(32)], seed=32)
        with ThreadPoolExecutor(32) as pool:
            list(pool.map(lambda p: check_completion(client, ckpt, hf_reference, p), prompts))
        # Every answer is exact (above) and every request went remote, landed or fell back (a queued one may also
        # have fallen back); how many took which path, and which worker got how many, is scheduling that a loaded
        # machine may change: a prefill reply late past its deadline falls back to a local recompute.
        assert sum(d.num_received for d in decoders) == 32
        paths = sum(d.remote_prefills + d.remote_fallbacks + d.queued_local for d in decoders)
        assert paths >= 32 and sum(d.remote_prefills for d in decoders) > 0
        wait_all_free(mesh)
    finally:
        mesh.close()


def test_killed_prefill_worker_never_hangs_or_returns_wrong_text(ckpt, hf_reference, tmp_path):
    mesh = Mesh(tmp_path, ckpt.path)
    # A stand-in prefill worker that takes the request and never answers, killed while it holds it.
    proc = subprocess.Popen([sys.executable, "-m", "tests.stalling_prefill", mesh.nats.url], start_new_session=True)
    try:
        mesh.start_tokenizer()
        d0 = mesh.start_decoder("d0", threshold=0, remote_timeout_s=2.0)  # the default: dead prefill noticed in ~2 s
        mesh.wait_until(lambda: mesh.gateway.ctx.router.alive())

        async def prefill_is_up() -> bool:
            try:
                await mesh.nc.request(f"$SRV.PING.{subjects.SERVICE_PREFILL}", b"", timeout=0.5)
                return True
            except Exception:  # noqa: BLE001
                return False
        mesh.wait_until(lambda: mesh.call(prefill_is_up()), timeout=60)

        async def kill_on_request() -> None:
            sub = await mesh.nc.subscribe(subjects.PREFILL_PREFILL)  # a spy: sees the request as the worker does
            await sub.next_msg(timeout=30)
            os.kill(proc.pid, signal.SIGKILL)
            await sub.unsubscribe()
        spy = mesh.call_soon(kill_on_request())
        prompt = random_prompts([60], seed=33)[0]
        t0 = time.monotonic()
        check_completion(client_for(mesh), ckpt, hf_reference, prompt)
        assert time.monotonic() - t0 < 8
        spy.result(5)
        assert proc.wait(5) == -signal.SIGKILL
        assert (d0.remote_prefills, d0.remote_fallbacks) == (0, 1)
        check_completion(client_for(mesh), ckpt, hf_reference, prompt)  # no prefill worker now: local at once
        wait_all_free(mesh)
    finally:
        if proc.poll() is None:
            proc.kill()
        mesh.close()


def test_disconnect_during_remote_generation_frees_every_worker(ckpt, tmp_path):
    mesh = Mesh(tmp_path, ckpt.path)
    try:
        mesh.start_tokenizer()
        mesh.start_prefill()
        d0 = mesh.start_decoder("d0", threshold=0)
        mesh.wait_until(lambda: mesh.gateway.ctx.router.alive())
        body = {"model": "tiny", "prompt": random_prompts([70], seed=34)[0], "max_tokens": 400, "ignore_eos": True,
                "stream": True}
        with httpx.stream("POST", f"{mesh.url}/v1/completions", json=body, timeout=30) as r:
            lines = r.iter_lines()
            assert next(lines).startswith("data: ")
        t0 = time.monotonic()
        wait_all_free(mesh, timeout=2.0)
        assert time.monotonic() - t0 < 2.0 and d0.num_cancels >= 1
    finally:
        mesh.close()


def test_one_trace_from_http_to_kv_transfer(ckpt, tmp_path):
    from shared.telemetry import attach_memory_exporter

    exporter = attach_memory_exporter()
    mesh = Mesh(tmp_path, ckpt.path)
    try:
        mesh.start_tokenizer()
        mesh.start_prefill()
        mesh.start_decoder("d0", threshold=0)
        mesh.wait_until(lambda: mesh.gateway.ctx.router.alive())
        client_for(mesh).completions.create(model="tiny", prompt="a traced request through the mesh", max_tokens=4,
                                            temperature=0)
        wait_all_free(mesh)
    finally:
        mesh.close()
    spans = exporter.get_finished_spans()
    (root,) = [s for s in spans if s.name == "text_completion tiny"]
    names = {s.name for s in spans if s.context.trace_id == root.context.trace_id}
    for expected in (f"serve {subjects.TOKENIZER_ENCODE}", "decode.request", "decode.admit", "decode.remote_prefill",
                     "prefill.compute", "kv.transfer.send", "kv.transfer.receive"):
        assert expected in names, f"{expected} missing from the request's trace: {sorted(names)}"


def test_prefix_from_the_kvstore_on_another_decode_worker(ckpt, hf_reference, tmp_path):
    mesh = Mesh(tmp_path, ckpt.path)
    try:
        mesh.start_tokenizer()
        store = mesh.start_kvstore()
        d0 = mesh.start_decoder("d0", use_kvstore=True)
        mesh.wait_until(lambda: mesh.gateway.ctx.router.alive())
        client = client_for(mesh)
        shared = random_prompts([192], seed=35)[0]
        check_completion(client, ckpt, hf_reference, shared + [7, 8, 9])
        mesh.call(d0.drain(2.0))  # the worker that computed the prefix leaves the mesh; its cache goes to the kvstore
        del mesh.decoders["d0"]
        mesh.start_decoder("d1", use_kvstore=True)
        mesh.wait_until(lambda: [w.worker_id for w in mesh.gateway.ctx.router.alive()] == ["d1"], timeout=5)
        r = client.completions.create(model="tiny", prompt=shared + [10, 11], max_tokens=MAX_NEW, temperature=0)
        assert r.usage.prompt_tokens_details.cached_tokens == 192
        assert r.choices[0].text == expected_text(ckpt, hf_reference, shared + [10, 11])[0]
        assert store.tier.stats().hits >= 12
        metrics = httpx.get(f"{mesh.url}/metrics", timeout=10).text
        hits = [line for line in metrics.splitlines() if line.startswith("kvmesh:prefix_cache_hits_total")]
        assert hits and float(hits[0].split()[-1]) >= 192
    finally:
        mesh.close()


def test_cached_tokens_count_what_the_prefill_worker_found(ckpt, hf_reference, tmp_path):
    """usage.prompt_tokens_details.cached_tokens counts prompt tokens served from any cache: here the
    decode worker holds nothing of the prompt, the prefill worker's device pool holds its prefix."""
    mesh = Mesh(tmp_path, ckpt.path)
    try:
        mesh.start_tokenizer()
        mesh.start_prefill()
        d0 = mesh.start_decoder("d0", threshold=0)
        mesh.wait_until(lambda: mesh.gateway.ctx.router.alive())
        client = client_for(mesh)
        shared = random_prompts([160], seed=36)[0]
        first = client.completions.create(model="tiny", prompt=shared + [7, 8, 9], max_tokens=4, temperature=0)
        assert first.usage.prompt_tokens_details.cached_tokens == 0
        mesh.call(d0.drain(2.0))  # the decode worker leaves with its cache; the prefill worker keeps its own
        del mesh.decoders["d0"]
        d1 = mesh.start_decoder("d1", threshold=0)
        mesh.wait_until(lambda: [w.worker_id for w in mesh.gateway.ctx.router.alive()] == ["d1"], timeout=5)
        for stream in (False, True):
            prompt = shared + ([10, 11] if not stream else [12, 13])
            if stream:
                chunks = list(client.completions.create(model="tiny", prompt=prompt, max_tokens=MAX_NEW, temperature=0,
                                                        stream=True, stream_options={"include_usage": True}))
                text, usage = "".join(c.choices[0].text for c in chunks if c.choices), chunks[-1].usage
            else:
                r = client.completions.create(model="tiny", prompt=prompt, max_tokens=MAX_NEW, temperature=0)
                text, usage = r.choices[0].text, r.usage
            assert usage.prompt_tokens_details.cached_tokens == 160, stream
            assert text == expected_text(ckpt, hf_reference, prompt)[0]
        assert d1.remote_prefills == 2
    finally:
        mesh.close()
