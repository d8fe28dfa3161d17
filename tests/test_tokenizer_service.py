"""The tokenizer service against a real nats-server: same ids as load_tokenizer, bad input, hostility, scaling."""
from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable, Coroutine
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, TypeVar

import pytest
from nats.aio.client import Client

from services.tokenizer.service import TokenizerService
from shared import bus, subjects
from shared import protocol as p
from shared.models.demo_tokenizer import cached_byte_bpe, write_tokenizer_files
from shared.models.tokenizer import encode_chat, load_tokenizer
from tests.checkpoints import VOCAB
from tests.hostile import assert_survives, hostile_bodies
from tests.nats_fixtures import wait_discoverable, nats_server, nats_server_factory  # noqa: F401  (fixtures)

T = TypeVar("T")
ENCODE, DECODE = subjects.TOKENIZER_ENCODE, subjects.TOKENIZER_DECODE
REPO = Path(__file__).resolve().parents[1]
PROMPTS = ["Hello, world!", "  leading spaces and\ttabs\n\nnewlines", "héllo wörld — ünïcode 中文 🙂🚀", "<|im_start|>user"]
CHAT = [p.ChatMessage(role="system", content="Be brief."), p.ChatMessage(role="user", content="Hi 🙂")]


def run(coro: Coroutine[Any, Any, T], timeout: float = 30.0) -> T:
    return asyncio.run(asyncio.wait_for(coro, timeout))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tokenizer half of tests.checkpoints.build_checkpoint: no weights needed here."""
    out = tmp_path_factory.mktemp("tok")
    write_tokenizer_files(cached_byte_bpe(VOCAB), out)
    return out


@asynccontextmanager
async def serving(url: str, model_dir: Path, instances: int = 1) -> AsyncIterator[tuple[Client, list[TokenizerService]]]:
    """Services on their own connections (as separate processes would be) and a client connection."""
    conns, services = [], []
    for _ in range(instances):
        conns.append(await bus.connect(url))
        services.append(TokenizerService(load_tokenizer(model_dir)))
        await services[-1].start(conns[-1])
    client = await bus.connect(url)
    await wait_discoverable(client, subjects.SERVICE_TOKENIZER)
    try:
        yield client, services
    finally:
        await client.close()
        for svc, nc in zip(services, conns):
            await svc.drain(1.0)
            await nc.close()


async def remote_error(coro: Coroutine[Any, Any, Any]) -> bus.RemoteError:
    with pytest.raises(bus.RemoteError) as e:
        await coro
    return e.value


def test_encode_decode_match_load_tokenizer(nats_server_factory: Callable[..., str], model_dir: Path) -> None:
    url = nats_server_factory(max_payload=64 * 1024)  # small, so the long prompt is chunked both ways
    tok = load_tokenizer(model_dir)
    long_prompt = " ".join(PROMPTS) * 2000  # ~200 KB of text

    async def body() -> None:
        async with serving(url, model_dir) as (nc, _):
            for prompt in [*PROMPTS, long_prompt]:
                for special in (True, False):
                    req = p.EncodeRequest(prompt=prompt, add_special_tokens=special)
                    reply = await bus.request(nc, ENCODE, req, expect=p.EncodeReply)
                    assert reply.token_ids == tok.encode(prompt, add_special_tokens=special)
            ids = [tok.encode(x) for x in [*PROMPTS, long_prompt]] + [[]]
            for skip in (True, False):
                reply = await bus.request(nc, DECODE, p.DecodeRequest(sequences=ids, skip_special_tokens=skip), expect=p.DecodeReply)
                assert reply.texts == tok.batch_decode(ids, skip_special_tokens=skip)
            assert reply.texts[:3] == [tok.bos_token + x for x in PROMPTS[:3]]  # byte-level BPE round trips exactly
            passthrough = await bus.request(nc, ENCODE, p.EncodeRequest(token_ids=ids[0]), expect=p.EncodeReply)
            assert passthrough.token_ids == ids[0]
            # Concurrent big and small requests through the worker threads.
            many = [p.EncodeRequest(prompt=long_prompt), *(p.EncodeRequest(prompt=x) for x in PROMPTS * 5),
                    p.EncodeRequest(messages=CHAT)]
            replies = await asyncio.gather(*(bus.request(nc, ENCODE, m, timeout=20) for m in many))
            assert replies[-1].token_ids == encode_chat(tok, [m.model_dump() for m in CHAT])
            assert [r.token_ids for r in replies[1:-1]] == [tok.encode(x) for x in PROMPTS * 5]

    run(body())


def test_chat_template(nats_server: str, model_dir: Path) -> None:
    tok = load_tokenizer(model_dir)

    async def body() -> None:
        async with serving(nats_server, model_dir) as (nc, _):
            for gen in (True, False):
                req = p.EncodeRequest(messages=CHAT, add_generation_prompt=gen)
                reply = await bus.request(nc, ENCODE, req, expect=p.EncodeReply)
                assert reply.token_ids == encode_chat(tok, [m.model_dump() for m in CHAT], gen)
            text = (await bus.request(nc, DECODE, p.DecodeRequest(sequences=[reply.token_ids], skip_special_tokens=False))).texts[0]
            assert text == "<|begin_of_text|><|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi 🙂<|im_end|>\n"

    run(body())


def test_bad_inputs_answer_bad_request_and_service_keeps_serving(nats_server: str, model_dir: Path, tmp_path: Path) -> None:
    write_tokenizer_files(cached_byte_bpe(VOCAB), tmp_path, chat_template=None)

    async def body() -> None:
        async with serving(nats_server, model_dir) as (nc, _):
            size = len(load_tokenizer(model_dir))
            cases = [
                (ENCODE, p.EncodeRequest(prompt=""), "empty prompt"),
                (ENCODE, p.EncodeRequest(token_ids=[]), "empty prompt"),
                (ENCODE, p.EncodeRequest(messages=[]), "empty prompt"),
                (ENCODE, p.EncodeRequest(token_ids=[1, 2, size]), f"token id {size} is outside the vocabulary [0, {size})"),
                (ENCODE, p.EncodeRequest(token_ids=[1, -3]), f"token id -3 is outside the vocabulary [0, {size})"),
                (DECODE, p.DecodeRequest(sequences=[[1], [10**12]]), f"token id {10**12} is outside the vocabulary"),
            ]
            for subject, msg, text in cases:
                err = await remote_error(bus.request(nc, subject, msg))
                assert err.code == "bad_request" and text in err.message, err
            assert (await bus.request(nc, ENCODE, p.EncodeRequest(token_ids=[size - 1]))).token_ids == [size - 1]
        async with serving(nats_server, tmp_path) as (nc, _):  # a checkpoint without a chat template
            err = await remote_error(bus.request(nc, ENCODE, p.EncodeRequest(messages=CHAT)))
            assert err.code == "bad_request" and "chat template" in err.message
            assert (await bus.request(nc, ENCODE, p.EncodeRequest(prompt="ok", add_special_tokens=False))).token_ids

    run(body())


def test_hostile_messages_leave_the_service_answering(nats_server: str, model_dir: Path) -> None:
    async def body() -> None:
        async with serving(nats_server, model_dir) as (nc, _):
            await assert_survives(nc, ENCODE, hostile_bodies("tokenizer.encode", p.EncodeRequest(prompt="x" * 40)))
            await assert_survives(nc, DECODE, hostile_bodies("tokenizer.decode", p.DecodeRequest(sequences=[[1, 2, 3]] * 5)))
            assert (await bus.request(nc, ENCODE, p.EncodeRequest(prompt="still here", add_special_tokens=False))).token_ids
            assert (await bus.request(nc, DECODE, p.DecodeRequest(sequences=[[65]]))).texts

    run(body())


def test_two_instances_share_the_queue_group_and_discovery(nats_server: str, model_dir: Path) -> None:
    async def body() -> None:
        async with serving(nats_server, model_dir, instances=2) as (nc, services):
            await asyncio.gather(*(bus.request(nc, ENCODE, p.EncodeRequest(prompt=f"request {i}")) for i in range(60)))
            ids = {svc._micro.id for svc in services}  # type: ignore[union-attr]
            ping = json.loads((await nc.request(f"$SRV.PING.{subjects.SERVICE_TOKENIZER}", b"", timeout=2)).data)
            assert ping["name"] == subjects.SERVICE_TOKENIZER and ping["id"] in ids
            served = {}
            for sid in ids:
                stats = json.loads((await nc.request(f"$SRV.STATS.{subjects.SERVICE_TOKENIZER}.{sid}", b"", timeout=2)).data)
                served[sid] = {e["subject"]: e["num_requests"] for e in stats["endpoints"]}
                info = json.loads((await nc.request(f"$SRV.INFO.{subjects.SERVICE_TOKENIZER}.{sid}", b"", timeout=2)).data)
                assert {(e["subject"], e["queue_group"]) for e in info["endpoints"]} == {
                    (ENCODE, subjects.QUEUE_TOKENIZER), (DECODE, subjects.QUEUE_TOKENIZER)}
            assert sum(s[ENCODE] for s in served.values()) == 60
            assert all(s[ENCODE] > 0 for s in served.values()), served  # 60 requests, both members got work

    run(body())


def test_drain_finishes_in_flight_work(nats_server: str, model_dir: Path) -> None:
    async def body() -> None:
        nc, client = await bus.connect(nats_server), await bus.connect(nats_server)
        svc = TokenizerService(load_tokenizer(model_dir))
        await svc.start(nc)
        # Long enough to be in flight when the drain starts (the loop below waits for that), short enough that a
        # loaded machine still encodes it well within the drain's grace.
        pending = asyncio.ensure_future(bus.request(client, ENCODE, p.EncodeRequest(prompt="word " * 50_000), timeout=50))
        while not svc._inflight.count:
            await asyncio.sleep(0.005)
        await svc.drain(45.0)  # the long encode in its thread finishes and is answered
        assert len((await pending).token_ids) > 25_000
        with pytest.raises(bus.NoRespondersError):
            await bus.request(client, ENCODE, p.EncodeRequest(prompt="late"))
        await client.close()
        await nc.close()

    run(body(), timeout=60.0)


def test_subprocess_serves_and_exits_0_on_sigterm(nats_server: str, model_dir: Path) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-m", "services.tokenizer", "--nats-url", nats_server, "--model", str(model_dir), "--log-level", "WARNING"],
        cwd=REPO, env={**os.environ, "OTEL_EXPORTER_OTLP_ENDPOINT": ""},
    )
    try:
        async def ask() -> list[int]:
            nc = await bus.connect(nats_server)
            try:
                deadline = time.monotonic() + 25
                while True:
                    try:
                        return (await bus.request(nc, ENCODE, p.EncodeRequest(prompt="hello"))).token_ids
                    except bus.NoRespondersError:
                        assert proc.poll() is None and time.monotonic() < deadline, "service did not start"
                        await asyncio.sleep(0.1)
            finally:
                await nc.close()

        assert run(ask()) == load_tokenizer(model_dir).encode("hello")
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=8) == 0  # the drain takes milliseconds; exiting a torch process can take seconds
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
