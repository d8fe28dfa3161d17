"""`kvmesh up --runner pooling` end to end: the demo model as an embedder, and a sequence-classification copy of
it as a reranker, each a real mesh (nats-server, tokenizer, pooling prefill worker, gateway) asked through the
real `openai` client and HTTP, compared with transformers in float32."""
from __future__ import annotations

import asyncio
import base64
import os
import socket
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest
import torch

from loadtest.up_process import kvmesh_up
from tests.pooling_checkpoints import build_classifier

ROOT = Path(__file__).resolve().parents[1]
TEXTS = ["The capital of France is Paris.", "Embeddings turn text into vectors", "hi",
         "A much longer sentence about rivers, mountains and the weather in the spring of last year."]


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT), "KVMESH_CPU_DTYPE": "float32"}


@pytest.fixture(scope="module")
def embed_mesh(smollm2_dir, tmp_path_factory):
    port = _port()
    log = tmp_path_factory.mktemp("embed-mesh") / "up.log"
    with kvmesh_up(smollm2_dir, port, "emb", ["--runner", "pooling", "--convert", "embed", "--kvstore", "0",
                                              "--max-model-len", "64"], log, cwd=str(ROOT), env=_env()):
        yield f"http://127.0.0.1:{port}"


@pytest.fixture(scope="module")
def hf_embedder(smollm2_dir):
    from transformers import AutoModel, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    model = AutoModel.from_pretrained(smollm2_dir, dtype=torch.float32).eval()

    def embed(item: str | list[int]) -> np.ndarray:
        ids = tok(item)["input_ids"] if isinstance(item, str) else item
        with torch.no_grad():
            last = model(torch.tensor([ids])).last_hidden_state[0, -1]
        return torch.nn.functional.normalize(last, dim=-1).numpy()

    return embed, tok


def _cos(a, b) -> float:
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return float(a @ b / np.linalg.norm(a) / np.linalg.norm(b))


def test_embeddings_equal_transformers(embed_mesh, hf_embedder) -> None:
    embed, tok = hf_embedder
    client = openai.OpenAI(base_url=f"{embed_mesh}/v1", api_key="none")
    one = client.embeddings.create(model="emb", input=TEXTS[0])
    assert len(one.data) == 1 and _cos(one.data[0].embedding, embed(TEXTS[0])) >= 0.9999
    assert one.usage.prompt_tokens == len(tok(TEXTS[0])["input_ids"])
    many = client.embeddings.create(model="emb", input=TEXTS)
    assert [d.index for d in many.data] == list(range(len(TEXTS)))
    for d, text in zip(many.data, TEXTS):
        assert _cos(d.embedding, embed(text)) >= 0.9999
        assert abs(np.linalg.norm(d.embedding) - 1) < 1e-4
    assert many.usage.prompt_tokens == sum(len(tok(t)["input_ids"]) for t in TEXTS)
    ids = [tok(t)["input_ids"] for t in TEXTS[:2]]
    by_ids = client.embeddings.create(model="emb", input=ids[0])
    assert _cos(by_ids.data[0].embedding, embed(ids[0])) >= 0.9999
    by_lists = client.embeddings.create(model="emb", input=ids)
    for d, i in zip(by_lists.data, ids):
        assert _cos(d.embedding, embed(i)) >= 0.9999


def test_base64_decodes_to_the_float_vectors(embed_mesh) -> None:
    as_float = httpx.post(f"{embed_mesh}/v1/embeddings", json={"input": TEXTS[:2], "encoding_format": "float"},
                          timeout=60).json()
    as_b64 = httpx.post(f"{embed_mesh}/v1/embeddings", json={"input": TEXTS[:2], "encoding_format": "base64"},
                        timeout=60).json()
    for f, b in zip(as_float["data"], as_b64["data"]):
        decoded = np.frombuffer(base64.b64decode(b["embedding"]), dtype="<f4")
        np.testing.assert_allclose(decoded, np.asarray(f["embedding"], dtype=np.float32), rtol=0, atol=1e-6)
    client = openai.OpenAI(base_url=f"{embed_mesh}/v1", api_key="none")
    raw = client.embeddings.create(model="emb", input=TEXTS[0], encoding_format="base64").data[0].embedding
    assert _cos(np.frombuffer(base64.b64decode(raw), dtype="<f4"), as_float["data"][0]["embedding"]) > 0.99999


def test_truncate_and_bad_input(embed_mesh, hf_embedder) -> None:
    embed, tok = hf_embedder
    client = openai.OpenAI(base_url=f"{embed_mesh}/v1", api_key="none", max_retries=0)
    long = " ".join(["word"] * 100)  # over the mesh's 64-token context
    with pytest.raises(openai.BadRequestError, match="context"):
        client.embeddings.create(model="emb", input=long)
    cut = client.embeddings.create(model="emb", input=long, extra_body={"truncate_prompt_tokens": 10})
    assert cut.usage.prompt_tokens == 10
    assert _cos(cut.data[0].embedding, embed(tok(long)["input_ids"][-10:])) >= 0.9999
    with pytest.raises(openai.BadRequestError, match="Matryoshka"):
        client.embeddings.create(model="emb", input="x", dimensions=32)
    for empty in ("", [], [[]]):
        with pytest.raises(openai.BadRequestError):
            client.embeddings.create(model="emb", input=empty)
    with pytest.raises(openai.BadRequestError, match="pooling model"):
        client.chat.completions.create(model="emb", messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(openai.BadRequestError, match="pooling model"):
        client.completions.create(model="emb", prompt="hi")
    r = httpx.post(f"{embed_mesh}/classify", json={"input": "hi"}, timeout=30)
    assert r.status_code == 400 and "classification" in r.json()["error"]["message"]
    health = httpx.get(f"{embed_mesh}/health", timeout=10).json()
    assert health["status"] == "ok" and health["pooling_workers"] == ["prefill-0"]
    # Nothing above disturbed the worker.
    assert client.embeddings.create(model="emb", input="hi").data[0].embedding


@pytest.mark.parametrize("n", [pytest.param(64, marks=pytest.mark.slow), 12])
def test_concurrent_equal_sequential(embed_mesh, n: int) -> None:
    texts = [f"request number {i} about {TEXTS[i % len(TEXTS)]}" for i in range(n)]
    seq = [httpx.post(f"{embed_mesh}/v1/embeddings", json={"input": t}, timeout=60).json()["data"][0]["embedding"]
           for t in texts[:4]]

    async def all_at_once() -> list[list[float]]:
        async with httpx.AsyncClient(timeout=120) as c:
            rs = await asyncio.gather(*(c.post(f"{embed_mesh}/v1/embeddings", json={"input": t}) for t in texts))
        return [r.json()["data"][0]["embedding"] for r in rs]

    together = asyncio.run(all_at_once())
    batch = httpx.post(f"{embed_mesh}/v1/embeddings", json={"input": texts}, timeout=120).json()["data"]
    for i in range(4):
        assert _cos(seq[i], together[i]) > 0.99999 and _cos(seq[i], batch[i]["embedding"]) > 0.99999
    for i in range(n):
        assert _cos(together[i], batch[i]["embedding"]) > 0.99999


def test_metrics_name_the_pooling_model(embed_mesh) -> None:
    text = httpx.get(f"{embed_mesh}/metrics", timeout=10).text
    from services.gateway.metrics import PREFIX

    assert f'{PREFIX}request_prompt_tokens_count{{model_name="emb"}}' in text
    assert f'{PREFIX}prompt_tokens_total{{model_name="emb"}}' in text
