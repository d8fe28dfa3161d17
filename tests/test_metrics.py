"""The vLLM metric set on the gateway's /metrics, fed by real decode and prefill workers over a real
nats-server: every series with worker and role labels, and gauges that follow the engine without waiting
for the periodic load beat."""
from __future__ import annotations

import re
import threading

import httpx
import openai
import pytest

from tests.checkpoints import build_checkpoint
from tests.gateway_harness import Mesh

WORKER_SERIES = ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "num_preemptions_total",
                 "prefix_cache_queries_total", "prefix_cache_hits_total", "iteration_tokens_total_bucket",
                 "iteration_tokens_total_sum", "cache_config_info")
REQUEST_SERIES = ("request_success_total", "prompt_tokens_total", "generation_tokens_total",
                  "time_to_first_token_seconds_bucket", "inter_token_latency_seconds_bucket",
                  "e2e_request_latency_seconds_bucket", "request_queue_time_seconds_bucket",
                  "request_prefill_time_seconds_bucket", "request_decode_time_seconds_bucket",
                  "request_inference_time_seconds_bucket", "request_prompt_tokens_bucket",
                  "request_generation_tokens_bucket", "request_params_max_tokens_bucket")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):  # noqa: ANN001, ANN201
    return build_checkpoint("llama", tmp_path_factory.mktemp("metrics") / "llama").path


def sample(text: str, name: str, **labels: str) -> float | None:
    """The value of the first series `kvmesh:<name>` whose labels include `labels`."""
    for line in text.splitlines():
        m = re.match(rf"^kvmesh:{re.escape(name)}\{{(.*)\}} (\S+)$", line)
        if m and all(f'{k}="{v}"' in m.group(1) for k, v in labels.items()):
            return float(m.group(2))
    return None


def scrape(mesh: Mesh) -> str:
    return httpx.get(f"{mesh.url}/metrics", timeout=10).text


def test_vllm_metric_set_with_worker_and_role_labels(model_dir, tmp_path) -> None:  # noqa: ANN001
    mesh = Mesh(tmp_path, model_dir)
    try:
        mesh.start_tokenizer()
        mesh.start_decoder("d0", threshold=8)  # prompts of 8+ uncached tokens go to the prefill worker
        p = mesh.start_prefill()
        mesh.wait_until(lambda: mesh.gateway.ctx.router.alive() and mesh.gateway.ctx.metrics.prefill_workers.alive())
        client = openai.OpenAI(base_url=f"{mesh.url}/v1", api_key="unused", max_retries=0, timeout=30)
        for prompt in ("short", "a longer prompt that is prefilled by the prefill worker " * 3):
            client.completions.create(model="tiny", prompt=prompt, max_tokens=5, temperature=0)
        text = scrape(mesh)
        for name in REQUEST_SERIES:
            assert f"kvmesh:{name}" in text, name
        for role, worker in (("decode", "d0"), ("prefill", p.worker_id)):
            for name in WORKER_SERIES:
                assert sample(text, name, worker=worker, role=role) is not None, (name, role)
        assert sample(text, "request_success_total", finished_reason="length") == 2
        assert sample(text, "request_queue_time_seconds_count") == 2
        assert sample(text, "request_generation_tokens_sum") == 10
        # Both workers computed prompt tokens: their per-step histograms counted steps.
        assert sample(text, "iteration_tokens_total_count", worker="d0") >= 5
        assert sample(text, "iteration_tokens_total_count", worker=p.worker_id) >= 1
        assert sample(text, "cache_config_info", worker="d0", block_size="16", num_gpu_blocks="96") == 1
        assert sample(text, "workers_alive", role="prefill") == 1
        assert sample(text, "prefix_cache_queries_total", worker=p.worker_id) > 0
    finally:
        mesh.close()


def test_gauges_follow_the_engine_without_waiting_for_a_beat(model_dir, tmp_path) -> None:  # noqa: ANN001
    # Periodic beats every 60 s: whatever the gauges show within the test came from change-driven beats.
    mesh = Mesh(tmp_path, model_dir, worker_expiry_s=120.0)
    try:
        mesh.start_tokenizer()
        d = mesh.start_decoder("slow", beat_interval_s=60.0)
        mesh.wait_until(lambda: mesh.gateway.ctx.router.alive())
        assert sample(scrape(mesh), "num_requests_running", worker="slow") == 0
        beats_before = d.beats.sent
        client = openai.OpenAI(base_url=f"{mesh.url}/v1", api_key="unused", max_retries=0, timeout=60)
        first_token = threading.Event()

        def stream() -> None:
            for _ in client.completions.create(model="tiny", prompt="hello", max_tokens=400, temperature=0,
                                               stream=True, extra_body={"ignore_eos": True}):
                first_token.set()

        t = threading.Thread(target=stream)
        t.start()
        assert first_token.wait(30)
        mesh.wait_until(lambda: sample(scrape(mesh), "num_requests_running", worker="slow") == 1, timeout=2)
        assert sample(scrape(mesh), "kv_cache_usage_perc", worker="slow") > 0
        t.join(120)
        mesh.wait_until(lambda: sample(scrape(mesh), "num_requests_running", worker="slow") == 0, timeout=2)
        assert sample(scrape(mesh), "kv_cache_usage_perc", worker="slow") == 0
        assert d.beats.sent > beats_before
    finally:
        mesh.close()


def test_grafana_dashboard_queries_only_series_the_gateway_exports(model_dir, tmp_path) -> None:  # noqa: ANN001
    import json
    from pathlib import Path

    dashboard = json.loads((Path(__file__).resolve().parents[1] / "compose/grafana/dashboards/kvmesh.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    wanted = {name for e in exprs for name in re.findall(r"kvmesh:[a-z0-9_]+", e)}
    assert len(wanted) >= 15
    mesh = Mesh(tmp_path, model_dir)
    try:
        mesh.start_tokenizer()
        mesh.start_decoder("d0")
        mesh.wait_until(lambda: mesh.gateway.ctx.router.alive())
        client = openai.OpenAI(base_url=f"{mesh.url}/v1", api_key="unused", max_retries=0, timeout=30)
        client.completions.create(model="tiny", prompt="hi", max_tokens=3)
        with pytest.raises(openai.BadRequestError):
            client.completions.create(model="tiny", prompt="hi", max_tokens=3, temperature=5)
        exported = {line.split("{")[0].split(" ")[0] for line in scrape(mesh).splitlines() if line.startswith("kvmesh:")}
        assert wanted <= exported, wanted - exported
    finally:
        mesh.close()


def test_offload_counters_per_worker(model_dir, tmp_path) -> None:  # noqa: ANN001
    """Blocks handed to the kvstore, and blocks dropped under backpressure (issue 10 item 7)."""
    mesh = Mesh(tmp_path, model_dir)
    try:
        mesh.start_tokenizer()
        mesh.start_kvstore()
        mesh.start_decoder("d0", use_kvstore=True)
        mesh.wait_until(lambda: mesh.gateway.ctx.router.alive())
        client = openai.OpenAI(base_url=f"{mesh.url}/v1", api_key="unused", max_retries=0, timeout=30)
        client.completions.create(model="tiny", prompt=list(range(1, 70)), max_tokens=3, temperature=0)
        # Offload by eviction: the prefix goes to the kvstore once a second request reuses it.
        client.completions.create(model="tiny", prompt=list(range(1, 70)), max_tokens=3, temperature=0)
        mesh.wait_until(lambda: (sample(scrape(mesh), "kv_offloaded_blocks_total", worker="d0") or 0) >= 4)
        assert sample(scrape(mesh), "kv_offload_dropped_blocks_total", worker="d0") == 0
        assert sample(scrape(mesh), "kv_tier_hit_tokens_total", worker="d0", tier="kvstore") == 0
        assert sample(scrape(mesh), "host_tier_bytes", worker="d0") == 0  # no host tier configured
        # The kvstore announces what it stored; the gateway's router counts those blocks for every worker.
        mesh.wait_until(lambda: len(mesh.gateway.ctx.router._kvstore_blocks) >= 4)
        # The kvstore announces its tiers' figures every 2 s: blocks and bytes per tier in /metrics.
        mesh.wait_until(lambda: (sample(scrape(mesh), "kvstore_blocks", tier="cpu") or 0) >= 4, timeout=6)
        assert sample(scrape(mesh), "kvstore_bytes", tier="cpu") > 0
        assert sample(scrape(mesh), "kvstore_blocks", tier="disk") == 0  # the harness's kvstore has no disk
    finally:
        mesh.close()


def test_kv_push_counters_of_a_prefill_worker(model_dir, tmp_path) -> None:  # noqa: ANN001
    """A prefill worker's pushes: how many, their bytes, what decode waited after the compute, and the engine
    seconds it spent handing the KV out."""
    mesh = Mesh(tmp_path, model_dir)
    try:
        mesh.start_tokenizer()
        prefill = mesh.start_prefill()
        mesh.start_decoder("d0", threshold=0)
        mesh.wait_until(lambda: mesh.gateway.ctx.router.alive() and mesh.gateway.ctx.metrics.prefill_workers.alive())
        client = openai.OpenAI(base_url=f"{mesh.url}/v1", api_key="unused", max_retries=0, timeout=30)
        client.completions.create(model="tiny", prompt=list(range(1, 70)), max_tokens=3, temperature=0)
        wid = prefill.settings.worker_id
        mesh.wait_until(lambda: (sample(scrape(mesh), "kv_pushes_total", worker=wid) or 0) == 1)
        text = scrape(mesh)
        assert sample(text, "kv_push_bytes_total", worker=wid) == prefill.kv_push.bytes > 0
        assert 0 < sample(text, "kv_push_wait_seconds_total", worker=wid) < 10
        # The engine's part of the push (reading the prompt's captured blocks out), as the prefill worker's beat has it.
        handout = sample(text, "kv_handout_seconds_total", worker=wid, role="prefill")
        assert 0 < handout < 10
        assert handout == mesh.gateway.ctx.metrics.prefill_workers.alive()[0].kv_handout_seconds
        assert sample(text, "kv_pushes_total", worker="d0") == 0  # decode workers push nothing
        assert sample(text, "kv_handout_seconds_total", worker="d0", role="decode") == 0  # nor hand any KV out
        assert "# TYPE kvmesh:kv_handout_seconds_total counter" in text  # a counter, as the push series
    finally:
        mesh.close()
