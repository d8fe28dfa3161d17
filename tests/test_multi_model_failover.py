"""Two models in one mesh under load, one model's decode worker killed (SIGKILL) mid-stream: every request of
either model still ends with exactly its greedy text (the killed worker's move to the model's other worker,
never to the other model's)."""
from __future__ import annotations

import os
import re
import signal
import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from shared.models.tokenizer import load_tokenizer
from tests.engine_helpers import random_prompts
from tests.multi_model_mesh import UpMesh

MAX_NEW = 160
NAMES = {"llama": "tiny-llama", "qwen3": "tiny-qwen3"}
PER_MODEL = 4


@pytest.mark.slow
def test_one_models_worker_killed_under_load_loses_nothing(checkpoints, hf_reference) -> None:  # noqa: ANN001
    prompts = random_prompts([11, 17, 29, 40], seed=5)
    want = {(arch, i): load_tokenizer(checkpoints[arch].path).decode(
                hf_reference(checkpoints[arch], p, MAX_NEW)[0], skip_special_tokens=True)
            for arch in NAMES for i, p in enumerate(prompts)}
    mesh = UpMesh(["--model", str(checkpoints["llama"].path), "--model", str(checkpoints["qwen3"].path),
                   "--served-model-name", NAMES["llama"], "--served-model-name", NAMES["qwen3"],
                   "--decode", f"{NAMES['llama']}=2,{NAMES['qwen3']}=1", "--kvstore", "0", "--grace", "2"])
    try:
        client = openai.OpenAI(base_url=f"{mesh.base}/v1", api_key="unused", max_retries=0, timeout=120)
        started = threading.Barrier(len(want) + 1, timeout=120)

        def run(arch: str, i: int) -> str:
            stream = client.completions.create(model=NAMES[arch], prompt=prompts[i], max_tokens=MAX_NEW,
                                               temperature=0, stream=True)
            text, first = "", True
            for chunk in stream:
                if chunk.choices:
                    text += chunk.choices[0].text
                if first:
                    first = False
                    started.wait()
            return text

        with ThreadPoolExecutor(len(want)) as pool:
            futures = {key: pool.submit(run, *key) for key in want}
            started.wait()
            # The llama worker with the most requests running goes, mid-stream.
            running = {m[1]: float(m[2]) for m in re.finditer(
                r'kvmesh:num_requests_running\{model_name="tiny-llama",role="decode",worker="(\S+?)"\} (\S+)',
                httpx.get(f"{mesh.base}/metrics", timeout=10).text)}
            victim = max(running, key=running.get)
            os.kill(mesh.pids[victim], signal.SIGKILL)
            got = {key: f.result(timeout=300) for key, f in futures.items()}
        assert got == want
        migrations = re.search(r'kvmesh:request_migrations_total\{model_name="tiny-llama"\} (\S+)',
                               httpx.get(f"{mesh.base}/metrics", timeout=10).text)
        assert migrations and float(migrations[1]) >= 1, "no stream was on the killed worker"
        assert any(line.startswith(f"[kvmesh] {victim} exited with code -9") for line in mesh.lines)
    finally:
        mesh.close()
