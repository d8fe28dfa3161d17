"""`kvmesh bench scale`'s load generator on a small real simulated mesh (real `kvmesh up --engine sim`, real
nats-server, the real gateway over HTTP): the lean client (loadtest/lean_http.py) streams exactly the documented
simulated tokens, reads the gateway's 429 and its Retry-After, and a level run with it ramps, settles, counts the
refused apart from the finished and reports the mesh's added time from the gateway's own clock."""
from __future__ import annotations

import asyncio
import json

import pytest

from loadtest.lean_http import LeanConnection
from loadtest.retry import advised_s
from loadtest.scale_bench import Level, _stream_lean, ramp_seconds, run_level
from loadtest.sim_mesh import SimMesh
from loadtest.sim_model import build_sim_model
from shared.engine.sim_engine import expected_tokens


@pytest.fixture(scope="module")
def sim_model(tmp_path_factory):  # noqa: ANN001, ANN201
    return build_sim_model(tmp_path_factory.mktemp("scalebench") / "model")


@pytest.fixture(scope="module")
def mesh(sim_model):  # noqa: ANN001, ANN201
    # At most 3 requests at once: the fourth is refused with a 429 (services/gateway/overload.py).
    with SimMesh(sim_model, decode=2, prefill=1, per_process=3,
                 extra=["--sim-speed", "0.05", "--max-inflight-requests", "3"]) as m:
        yield m


def test_the_lean_client_streams_the_documented_tokens_and_reads_a_429(mesh, sim_model) -> None:  # noqa: ANN001
    from shared.models.tokenizer import load_tokenizer

    cfg = json.loads((sim_model / "config.json").read_text())
    tok = load_tokenizer(str(sim_model))

    async def go() -> None:
        conn = LeanConnection(mesh.base)
        prompt = [(7 * j) % 1500 + 10 for j in range(40)]
        r = await conn.post_json("/v1/completions", {"model": "sim", "prompt": prompt, "max_tokens": 12,
                                                     "temperature": 0, "stream": True,
                                                     "stream_options": {"include_usage": True}})
        assert r.status == 200 and r.headers["content-type"].startswith("text/event-stream")
        payloads = [d async for batch in r.sse_data() for d in batch]
        assert payloads[-1] == "[DONE]"
        msgs = [json.loads(p) for p in payloads[:-1]]
        text = "".join(c["text"] for m in msgs for c in m["choices"])
        assert text == tok.decode(expected_tokens(prompt, 12, cfg["vocab_size"], cfg["eos_token_id"]),
                                  skip_special_tokens=True)
        assert msgs[-1]["usage"]["completion_tokens"] == 12
        # The same connection again, through the bench's own reader.
        res = await _stream_lean(conn, prompt, 5)
        assert res.error is None and res.tokens == 5 and res.ttft > 0 and res.span >= 0

        # Three long streams fill the gateway's bound; a fourth request is refused at once, with Retry-After.
        long = [LeanConnection(mesh.base) for _ in range(3)]
        streams = [asyncio.ensure_future(_stream_lean(c, prompt, 200)) for c in long]
        for _ in range(200):
            if "kvmesh:gateway_requests_in_flight" in (m := await _metrics(conn)) and _in_flight(m) >= 3:
                break
            await asyncio.sleep(0.05)
        refused = await _stream_lean(conn, prompt, 5)
        assert refused.error.startswith("HTTP 429") and "--max-inflight-requests" in refused.error
        assert refused.retry_after is not None and 0.25 <= refused.retry_after <= 60
        r = await conn.post_json("/v1/completions", {"model": "sim", "prompt": prompt, "max_tokens": 5})
        assert r.status == 429 and advised_s(r.headers) == pytest.approx(float(r.headers["retry-after-ms"]) / 1000)
        assert (await r.json())["error"]["code"] == "too_many_requests"
        for s in streams:
            s.cancel()
        await asyncio.gather(*streams, return_exceptions=True)
        for c in (conn, *long):
            c.close()

    asyncio.run(asyncio.wait_for(go(), 120))


async def _metrics(conn: LeanConnection) -> str:
    return (await (await conn.request("GET", "/metrics")).read()).decode()


def _in_flight(text: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("kvmesh:gateway_requests_in_flight{"))


def test_a_level_ramps_settles_and_counts_refusals_apart(mesh) -> None:  # noqa: ANN001
    assert ramp_seconds(2000, None) == 20.0 and ramp_seconds(100, None) == 5.0 and ramp_seconds(10, 1.5) == 1.5
    # Six streams against a bound of three: some are refused (and retried after Retry-After), the rest finish.
    lv = asyncio.run(run_level(mesh, Level(6), isl=20, osl=6, seconds=4.0, seed=1, vocab=1500, client="lean",
                               ramp_s=0.5, settle_s=0.5))
    assert lv["client"] == "lean" and lv["finished"] > 0 and lv["failed_after_admission"] == 0
    assert lv["refused"] > 0 and lv["errors"] == lv["refused"]
    assert lv["refused_by_reason_at_gateway"]["max_inflight_requests"] >= lv["refused"]
    assert lv["output_tokens_per_s"] > 0 and lv["client_cpu_ms_per_token"] > 0
    for key in ("ttft_s", "per_output_token_s"):
        fig = lv[key]
        assert fig["worker_mean"] > 0 and fig["gateway_mean"] > 0 and fig["client_mean"] > 0
        # The gateway sees the first token no earlier than the worker made it, and the client no earlier still.
        assert fig["gateway_mean"] >= fig["worker_mean"] * 0.95 and fig["gateway_added_fraction"] is not None
    ttft = lv["ttft_s"]
    assert ttft["client_mean"] >= ttft["gateway_mean"] * 0.95
    assert ttft["client_mean_first_token_in_window"] >= ttft["gateway_mean_first_token_in_window"] * 0.95


def test_bench_serve_with_the_lean_client_measures_what_httpx_does(mesh, tmp_path, capsys) -> None:  # noqa: ANN001
    """`bench serve --http-client lean` (opt-in; httpx stays the default): the same requests, the same token
    counts from usage and per-chunk timings as with httpx, streamed and plain JSON."""
    from loadtest.cli import main

    docs = {}
    for client in ("httpx", "lean"):
        for stream in (True, False):
            out = tmp_path / f"{client}-{stream}.json"
            rc = main(["bench", "serve", "--base-url", mesh.base, "--model", "sim", "--endpoint", "completions",
                       "--prompt-kind", "ids", "--vocab-size", "1500", "--num-prompts", "4", "--input-len", "30",
                       "--output-len", "6", "--max-concurrency", "2", "--eos-mode", "ignore_eos", "--num-warmups",
                       "1", "--no-progress", "--time-limit", "120", "--request-timeout", "60", "--http-client", client,
                       "--json", str(out), *([] if stream else ["--no-stream"])])
            text = capsys.readouterr()
            assert rc == 0, text.out + text.err
            docs[client, stream] = json.loads(out.read_text())["runs"][0]
    for stream in (True, False):
        for client in ("httpx", "lean"):
            s, reqs = docs[client, stream]["summary"], docs[client, stream]["requests"]
            assert s["completed"] == 4 and s["failed"] == 0 and s["total_output_tokens"] == 24
            assert all(r["output_tokens_source"] == "usage" and r["finish_reason"] == "length" for r in reqs)
            if stream:
                assert all(r["stream_chunks"] >= 1 and 0 < r["ttft"] <= r["e2e"] for r in reqs)
                assert all(len(r["itl"]) == r["stream_chunks"] - 1 for r in reqs)
        # The same requests both ways: the same prompts in, the same counts out.
        assert [r["input_tokens"] for r in docs["httpx", stream]["requests"]] == \
            [r["input_tokens"] for r in docs["lean", stream]["requests"]]
