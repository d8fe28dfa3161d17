"""`kvmesh bench serve|compare|baseline` against a real `transformers serve --continuous-batching`
on a tiny checkpoint built here, plus a server that is down and one that never answers."""
from __future__ import annotations

import json
import math
import os
import random
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import matplotlib.image
import pytest
import torch
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

from loadtest.serve.arrivals import arrival_offsets
from loadtest.serve.baseline import BaselineConfig, start_baseline
from loadtest.serve.client import RequestResult
from loadtest.serve.datasets import PromptMaker, id_pool, parse_len, random_dataset, shared_prefix_dataset
from loadtest.serve.payload import Endpoint, EosMode, Message, build_body
from loadtest.serve.metrics import parse_goodput, summarize
from loadtest.cli import main
from shared.models.demo_tokenizer import BOS, EOS, PAD, cached_byte_bpe, write_tokenizer_files

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
SUMMARY_KEYS = {
    "duration_s", "planned", "sent", "completed", "failed", "not_sent", "total_input_tokens",
    "total_output_tokens", "requested_output_tokens", "request_throughput", "input_throughput",
    "output_throughput", "total_token_throughput", "goodput", "slo_ms", "ttft_ms", "tpot_ms", "itl_ms",
    "e2el_ms", "short_outputs", "output_tokens_source", "errors",
}
DIST_KEYS = {"mean", "median", "p90", "p99", "std", "min", "max", "count"}
REQUEST_KEYS = {
    "job", "turn", "requested_output_tokens", "prompt_len_estimate", "start", "ok", "error", "status", "ttft",
    "e2e", "itl", "prompt_tokens", "output_tokens", "output_tokens_source", "usage", "stream_chunks",
    "finish_reason", "input_tokens", "retry_after_s", "retries", "retry_wait_s",
}
# Small everything: the machine has 2 shared cores.
LIGHT = ["--num-warmups", "1", "--no-progress", "--time-limit", "120", "--request-timeout", "60"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("tiny-llama")
    tok = cached_byte_bpe(512)
    write_tokenizer_files(tok, out)
    ids = {t: tok.token_to_id(t) for t in (BOS, EOS, PAD)}
    cfg = LlamaConfig(vocab_size=tok.get_vocab_size(), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                      bos_token_id=ids[BOS], eos_token_id=ids[EOS], pad_token_id=ids[PAD])
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = LlamaForCausalLM(cfg).eval()
    model.generation_config = GenerationConfig(bos_token_id=ids[BOS], eos_token_id=ids[EOS], pad_token_id=ids[PAD])
    model.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def server(model_dir):
    # A fixed small paged cache: left to size itself, the first request spends ~14 s doing so.
    cfg = BaselineConfig(str(model_dir), port=free_port(), cb_num_blocks=256, cb_max_batch_tokens=512)
    with start_baseline(cfg) as srv:
        yield srv


def run_cli(argv: list[str], capsys) -> tuple[int, str]:
    rc = main(argv)
    captured = capsys.readouterr()
    text = captured.out + captured.err
    assert "Traceback" not in text
    return rc, text


def check_dist(d: dict) -> None:
    assert set(d) == DIST_KEYS
    if d["count"]:
        assert d["min"] <= d["median"] <= d["p90"] <= d["p99"] <= d["max"]
        assert d["min"] <= d["mean"] <= d["max"]


def check_run(run: dict, expect_all_ok: bool) -> None:
    s, reqs = run["summary"], run["requests"]
    assert set(s) == SUMMARY_KEYS
    assert s["sent"] == s["completed"] + s["failed"] == len(reqs)
    assert s["planned"] == s["sent"] + s["not_sent"]
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2el_ms"):
        check_dist(s[key])
    for r in reqs:
        assert set(r) == REQUEST_KEYS
        if not r["ok"]:
            assert r["error"]
            continue
        assert 0 <= r["ttft"] <= r["e2e"]
        assert sum(r["itl"]) <= r["e2e"] - r["ttft"] + 1e-6
        if r["usage"] is not None:
            assert r["output_tokens_source"] == "usage"
            assert r["output_tokens"] == r["usage"]["completion_tokens"]
            assert r["input_tokens"] == r["usage"]["prompt_tokens"]
    if expect_all_ok:
        assert s["completed"] == s["planned"] and s["failed"] == 0
        assert s["total_output_tokens"] == sum(r["output_tokens"] for r in reqs)


def check_png(path: Path) -> None:
    assert path.read_bytes()[:8] == PNG_SIGNATURE
    img = matplotlib.image.imread(path)
    assert img.ndim == 3 and img.shape[0] > 100 and img.shape[1] > 100


def test_serve_sweep_through_cli(server, tmp_path, capsys):
    out_json, plots = tmp_path / "serve.json", tmp_path / "plots"
    rc, text = run_cli([
        "bench", "serve", "--base-url", server.base_url, "--model", server.model_name,
        "--num-prompts", "6", "--input-len", "8:40", "--output-len", "4:12", "--sweep-concurrency", "1,3",
        "--goodput", "ttft:60000", "tpot:60000", "--json", str(out_json), "--plot", str(plots), *LIGHT,
    ], capsys)
    assert rc == 0, text
    assert "Output token throughput" in text and "concurrency" in text
    doc = json.loads(out_json.read_text())
    assert {"schema", "created", "target", "eos", "workload", "load", "runs", "skipped_levels"} <= set(doc)
    # transformers serve answers ignore_eos with 422; its generation_config field is the fallback.
    assert doc["eos"]["mode"] == "hf_generation_config"
    assert [r["max_concurrency"] for r in doc["runs"]] == [1, 3]
    for run in doc["runs"]:
        check_run(run, expect_all_ok=True)
        s = run["summary"]
        assert s["short_outputs"] == 0 and s["total_output_tokens"] == s["requested_output_tokens"]
        assert s["output_tokens_source"] == {"usage": 6}
        assert s["goodput"] == pytest.approx(s["request_throughput"])  # SLOs nobody misses
        assert all(r["output_tokens"] == r["requested_output_tokens"] for r in run["requests"])
        # transformers serve exports no spec_decode counters: every field null, nothing printed, no error.
        assert run["spec_decode"] and set(run["spec_decode"].values()) == {None}
    assert "acceptance" not in text
    names = {p.name for p in plots.iterdir()}
    assert names == {"ttft_distribution.png", "itl_distribution.png", "throughput_vs_concurrency.png",
                     "latency_vs_concurrency.png"}
    for p in plots.iterdir():
        check_png(p)


def test_chat_multi_turn_resends_history(server, tmp_path, capsys):
    out_json = tmp_path / "chat.json"
    rc, text = run_cli([
        "bench", "serve", "--base-url", server.base_url + "/v1", "--model", server.model_name,
        "--endpoint", "chat", "--dataset", "multi-turn", "--num-prompts", "4", "--turns", "2",
        "--input-len", "6", "--output-len", "5", "--max-concurrency", "2", "--request-rate", "20", "--burstiness", "0.5",
        "--json", str(out_json), *LIGHT,
    ], capsys)
    assert rc == 0, text
    run = json.loads(out_json.read_text())["runs"][0]
    check_run(run, expect_all_ok=True)
    by_job: dict[int, dict[int, dict]] = {}
    for r in run["requests"]:
        by_job.setdefault(r["job"], {})[r["turn"]] = r
    assert len(by_job) == 2 and all(set(t) == {0, 1} for t in by_job.values())
    for turns in by_job.values():
        first, second = turns[0], turns[1]
        # Turn 2 carries turn 1's prompt and answer, so it is longer by at least the answer.
        assert second["input_tokens"] >= first["input_tokens"] + first["output_tokens"]
        assert second["start"] >= first["start"] + first["e2e"] - 1e-6


def test_errors_from_a_live_server_are_failures(server, tmp_path, capsys):
    # transformers serve takes text prompts only: token-id lists come back as HTTP 400.
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps(row) for row in [
        {"prompt": "hello there", "output_len": 4}, {"prompt": [5, 6, 7]}, {"prompt": "more words here"},
    ]))
    out_json = tmp_path / "mixed.json"
    rc, text = run_cli([
        "bench", "serve", "--base-url", server.base_url, "--model", server.model_name, "--no-stream",
        "--dataset", "jsonl", "--jsonl", str(prompts), "--num-prompts", "6", "--output-len", "6",
        "--max-concurrency", "2", "--json", str(out_json), *LIGHT,
    ], capsys)
    assert rc == 0, text  # some succeeded: the run itself is fine, the failures are data
    run = json.loads(out_json.read_text())["runs"][0]
    check_run(run, expect_all_ok=False)
    s = run["summary"]
    assert (s["sent"], s["completed"], s["failed"]) == (6, 4, 2)
    assert all(k.startswith("RuntimeError: HTTP 400") for k in s["errors"])
    for r in run["requests"]:
        assert r["ok"] == (r["status"] == 200)
        if r["ok"]:
            assert r["ttft"] == r["e2e"] and r["itl"] == []  # not streamed: no first token to see


def test_server_down_is_reported_not_raised(tmp_path, capsys):
    out_json, plots = tmp_path / "down.json", tmp_path / "plots"
    rc, text = run_cli([
        "bench", "serve", "--base-url", f"http://127.0.0.1:{free_port()}", "--model", "m",
        "--num-prompts", "5", "--input-len", "8", "--output-len", "4", "--sweep-concurrency", "1,2",
        "--json", str(out_json), "--plot", str(plots), *LIGHT,
    ], capsys)
    assert rc == 1  # documented: not a single request succeeded
    doc = json.loads(out_json.read_text())
    assert doc["eos"]["mode"] == "off"
    for run in doc["runs"]:
        check_run(run, expect_all_ok=False)
        s = run["summary"]
        assert (s["sent"], s["failed"], s["completed"]) == (5, 5, 0)
        assert all("ConnectError" in k for k in s["errors"])
    for p in plots.iterdir():
        check_png(p)


def test_time_limit_stops_a_server_that_never_answers(tmp_path, capsys):
    with socket.socket() as lsock:  # accepts connections (kernel backlog) and never replies
        lsock.bind(("127.0.0.1", 0))
        lsock.listen(64)
        url = f"http://127.0.0.1:{lsock.getsockname()[1]}"
        out_json = tmp_path / "stuck.json"
        t0 = time.monotonic()
        rc, text = run_cli([
            "bench", "serve", "--base-url", url, "--model", "m", "--num-prompts", "4", "--input-len", "8",
            "--output-len", "4", "--max-concurrency", "2", "--num-warmups", "0", "--eos-mode", "off",
            "--time-limit", "2", "--request-timeout", "600", "--no-progress", "--json", str(out_json),
        ], capsys)
        elapsed = time.monotonic() - t0
    assert rc == 1 and elapsed < 10
    run = json.loads(out_json.read_text())["runs"][0]
    assert run["hit_time_limit"]
    check_run(run, expect_all_ok=False)
    s = run["summary"]
    assert s["sent"] == 2 and s["not_sent"] == 2  # concurrency 2: the other two never went out
    assert set(s["errors"]) == {"cancelled: time limit reached"}


def test_compare_same_workload_both_sides(server, tmp_path, capsys):
    out_json, plots = tmp_path / "cmp.json", tmp_path / "cmp"
    down = f"http://127.0.0.1:{free_port()}"
    rc, text = run_cli([
        "bench", "compare", "--a", f"{server.base_url},{server.model_name},transformers",
        "--b", f"{down},{server.model_name},nothing", "--ratio", "a/b",
        "--num-prompts", "3", "--input-len", "8", "--output-len", "4", "--sweep-concurrency", "1,2",
        "--json", str(out_json), "--plot", str(plots), *LIGHT,
    ], capsys)
    assert rc == 0, text
    assert "transformers/nothing (a/b)" in text
    doc = json.loads(out_json.read_text())
    assert doc["names"] == {"a": "transformers", "b": "nothing"} and doc["ratio"] == "a/b"
    assert [lv["max_concurrency"] for lv in doc["levels"]] == [1, 2]
    for side, ok in (("a", True), ("b", False)):
        for run in doc[side]["runs"]:
            check_run(run, expect_all_ok=ok)
    # Same seed, same prompts: both sides were asked for the same output lengths.
    req = lambda side: sorted(r["requested_output_tokens"] for r in doc[side]["runs"][0]["requests"])  # noqa: E731
    assert req("a") == req("b")
    for lv in doc["levels"]:
        assert lv["a"]["output_throughput"] > 0 and lv["b"]["output_throughput"] == 0
        assert lv["ratios"]["output_throughput"] is None  # division by zero is reported as null
        assert lv["ratios"]["ttft_p50_ms"] is None
    assert len(list(plots.glob("*.png"))) == 4


def test_bad_arguments_exit_2(capsys):
    rc, text = run_cli(["bench", "serve", "--model", "m", "--goodput", "latency:5"], capsys)
    assert rc == 2 and "--goodput" in text
    rc, text = run_cli(["bench", "compare", "--a", "nourl", "--b", "x,y"], capsys)
    assert rc == 2 and "URL,MODEL" in text


def test_arrivals_poisson_and_unbounded():
    assert arrival_offsets(5, math.inf, 1.0, 0) == [0.0] * 5
    a = arrival_offsets(2000, 10.0, 1.0, 7)
    assert a == arrival_offsets(2000, 10.0, 1.0, 7)  # seeded
    assert a == sorted(a) and a[0] == 0.0
    assert a[-1] / 1999 == pytest.approx(0.1, rel=0.1)  # mean gap 1/rate
    bursty = arrival_offsets(2000, 10.0, 0.2, 7)
    gaps = [y - x for x, y in zip(bursty, bursty[1:])]
    mean = sum(gaps) / len(gaps)
    cv = math.sqrt(sum((g - mean) ** 2 for g in gaps) / len(gaps)) / mean
    assert cv > 1.5  # gamma shape 0.2: coefficient of variation sqrt(5) ~ 2.2, Poisson's is 1


def test_datasets_lengths_and_shared_prefix():
    assert parse_len("100", 0.5) == (50, 150) and parse_len("32:512", 0.9) == (32, 512)
    maker = PromptMaker("ids", id_pool(300))
    w = shared_prefix_dataset(maker, 8, 3, 20, 5, (4, 4), seed=1)
    assert w.num_requests == 8
    prompts = [j.turns[0].prompt for j in w.jobs]
    assert all(len(p) == 25 and all(4 <= t < 300 for t in p) for p in prompts)
    for i, p in enumerate(prompts):
        same = [q for k, q in enumerate(prompts) if k % 3 == i % 3]
        other = [q for k, q in enumerate(prompts) if k % 3 != i % 3]
        assert all(q[:20] == p[:20] for q in same)
        assert all(q[:20] != p[:20] for q in other)
    assert w == shared_prefix_dataset(maker, 8, 3, 20, 5, (4, 4), seed=1)


def test_metrics_definitions():
    rng = random.Random(0)
    results = []
    for i in range(50):
        ttft = rng.uniform(0.01, 0.5)
        itl = [rng.uniform(0.001, 0.05) for _ in range(9)]
        r = RequestResult(i, 0, 10, 20, start=i * 0.01, ok=True, ttft=ttft, e2e=ttft + sum(itl), itl=itl,
                          prompt_tokens=20, output_tokens=10, output_tokens_source="usage")
        results.append(r)
    results.append(RequestResult(50, 0, 10, 20, ok=False, error="boom"))
    s = summarize(results, duration=2.0, planned=52, slo=parse_goodput(["ttft:250"]))
    assert (s.sent, s.completed, s.failed, s.not_sent) == (51, 50, 1, 1)
    assert s.request_throughput == 25.0 and s.output_throughput == 250.0 and s.input_throughput == 500.0
    assert s.goodput == sum(1 for r in results if r.ok and r.ttft <= 0.25) / 2.0
    assert s.itl_ms.count == 450 and s.tpot_ms.count == 50
    # TPOT of one request = (e2e - ttft) / (n - 1) = mean of its 9 gaps here.
    assert s.tpot_ms.mean == pytest.approx(sum(sum(r.itl) / 9 for r in results[:50]) / 50 * 1000)
    assert s.errors == {"boom": 1}
    for d in (s.ttft_ms, s.tpot_ms, s.itl_ms, s.e2el_ms):
        assert d.min <= d.median <= d.p90 <= d.p99 <= d.max


def test_prompts_from_a_tokenizer_have_exact_lengths_and_no_specials():
    tok = cached_byte_bpe(512)
    text = random_dataset(PromptMaker("text", tokenizer=tok), 5, (10, 30), (4, 4), seed=3)
    for job in text.jobs:
        turn = job.turns[0]
        assert len(tok.encode(turn.prompt, add_special_tokens=False).ids) == turn.prompt_len
    pool = id_pool(None, tok)
    specials = {tok.token_to_id(t) for t in (BOS, EOS, PAD)}
    assert pool and not specials & set(pool)
    ids = random_dataset(PromptMaker("ids", pool), 5, (10, 30), (4, 4), seed=3)
    assert all(len(j.turns[0].prompt) == j.turns[0].prompt_len for j in ids.jobs)


def test_request_bodies():
    ep = Endpoint("http://h:1", "m", api_key="k", eos_mode=EosMode.IGNORE_EOS)
    body = build_body(ep, [1, 2, 3], [], 7)
    assert ep.url == "http://h:1/v1/completions" and ep.headers()["Authorization"] == "Bearer k"
    assert body["prompt"] == [1, 2, 3] and body["max_tokens"] == 7 and body["ignore_eos"] is True
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    chat = Endpoint("http://h:1/v1/", "m", chat=True, stream=False, eos_mode=EosMode.HF_GENERATION_CONFIG)
    body = build_body(chat, "next", [Message("user", "q"), Message("assistant", "a")], 5)
    assert chat.url == "http://h:1/v1/chat/completions" and "stream_options" not in body
    assert [m["content"] for m in body["messages"]] == ["q", "a", "next"]
    assert json.loads(body["generation_config"]) == {"eos_token_id": -1, "max_new_tokens": 5}
    assert "ignore_eos" not in build_body(Endpoint("u", "m", eos_mode=EosMode.OFF), "x", [], 1)


def test_baseline_cli_starts_and_stops_on_ctrl_c(model_dir):
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "loadtest.cli", "bench", "baseline", "--model", str(model_dir),
                             "--port", str(port)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            cwd=Path(__file__).resolve().parents[1], env=dict(os.environ))
    try:
        lines = []
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            lines.append(line)
            if line.startswith("ready:") or not line:
                break
        assert lines[-1].startswith("ready:"), "".join(lines)
        assert f"--model {model_dir.resolve()}" in lines[-1]
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=90) == 0
    finally:
        if proc.poll() is None:
            proc.kill()


def test_fresh_prompts_per_level_are_new_per_level_and_deterministic():
    import argparse

    from loadtest.serve import options as opt

    p = argparse.ArgumentParser()
    for add in (opt.add_request_arguments, opt.add_dataset_arguments, opt.add_load_arguments, opt.add_output_arguments):
        add(p)
    flags = ["--num-prompts", "4", "--input-len", "8:16", "--output-len", "4:8", "--prompt-kind", "ids",
             "--vocab-size", "100", "--sweep-concurrency", "1,4"]
    fresh = p.parse_args(flags + ["--fresh-prompts-per-level"])
    base = opt.build_workload(fresh)
    assert opt.workload_for_level(fresh, base, 0) is base
    level1 = opt.workload_for_level(fresh, base, 1)
    assert level1.jobs != base.jobs and level1.jobs == opt.workload_for_level(fresh, base, 1).jobs
    same = p.parse_args(flags)
    assert opt.workload_for_level(same, opt.build_workload(same), 1).jobs == base.jobs
