"""A sequence-classification copy of the demo model (LlamaForSequenceClassification, one label, a random score
head) served by `kvmesh up --runner pooling` as a reranker: /v1/rerank, /rerank, /v1/score and /classify equal
transformers' scores of each query/document pair, built the way vLLM builds a cross-encoder's pair."""
from __future__ import annotations

import httpx
import numpy as np
import pytest
import torch

from loadtest.up_process import kvmesh_up
from tests.pooling_checkpoints import build_classifier
from tests.test_pooling_mesh import ROOT, _env, _port

pytestmark = pytest.mark.slow  # a second mesh: the default suite's endpoint checks share test_pooling_mesh's

QUERY = "What is the capital of France?"
DOCS = ["The capital of Brazil is Brasilia.", "The capital of France is Paris.", "Bananas are yellow.",
        "Paris is a city in France and its capital."]


@pytest.fixture(scope="module")
def classifier_dir(smollm2_dir, tmp_path_factory):
    return build_classifier(smollm2_dir, tmp_path_factory.mktemp("cls") / "SmolLM2-cls")


@pytest.fixture(scope="module")
def rerank_mesh(classifier_dir, tmp_path_factory):
    port = _port()
    log = tmp_path_factory.mktemp("rerank-mesh") / "up.log"
    with kvmesh_up(classifier_dir, port, "rr", ["--runner", "pooling", "--kvstore", "0"], log, cwd=str(ROOT),
                   env=_env()):
        yield f"http://127.0.0.1:{port}"


@pytest.fixture(scope="module")
def hf_scores(classifier_dir):
    from transformers import AutoTokenizer, LlamaForSequenceClassification

    tok = AutoTokenizer.from_pretrained(classifier_dir)
    model = LlamaForSequenceClassification.from_pretrained(classifier_dir, dtype=torch.float32).eval()

    def score(q: str, d: str) -> float:
        ids = tok(text=q, text_pair=d)["input_ids"]
        with torch.no_grad():
            logit = model(torch.tensor([ids])).logits[0, 0]
        return float(torch.sigmoid(logit))

    return score


def test_rerank_equals_transformers(rerank_mesh, hf_scores) -> None:
    want = [hf_scores(QUERY, d) for d in DOCS]
    for route in ("/v1/rerank", "/rerank"):
        r = httpx.post(f"{rerank_mesh}{route}", json={"model": "rr", "query": QUERY, "documents": DOCS}, timeout=60)
        assert r.status_code == 200, r.text
        results = r.json()["results"]
        assert [x["index"] for x in results] == sorted(range(len(DOCS)), key=lambda i: -want[i])
        for x in results:
            assert abs(x["relevance_score"] - want[x["index"]]) < 1e-4
            assert x["document"]["text"] == DOCS[x["index"]]
        assert r.json()["usage"]["total_tokens"] > 0
    top = httpx.post(f"{rerank_mesh}/v1/rerank", json={"query": QUERY, "documents": DOCS, "top_n": 2,
                                                       "return_documents": False}, timeout=60).json()["results"]
    assert len(top) == 2 and "document" not in top[0]
    assert top[0]["relevance_score"] >= top[1]["relevance_score"]


def test_score_and_classify(rerank_mesh, hf_scores) -> None:
    r = httpx.post(f"{rerank_mesh}/v1/score", json={"text_1": QUERY, "text_2": DOCS}, timeout=60).json()
    np.testing.assert_allclose([d["score"] for d in r["data"]], [hf_scores(QUERY, d) for d in DOCS], atol=1e-4)
    pairwise = httpx.post(f"{rerank_mesh}/v1/score", json={"text_1": [QUERY, DOCS[0]], "text_2": DOCS[1:3]},
                          timeout=60).json()["data"]
    assert abs(pairwise[1]["score"] - hf_scores(DOCS[0], DOCS[2])) < 1e-4
    c = httpx.post(f"{rerank_mesh}/classify", json={"input": [QUERY, DOCS[1]]}, timeout=60).json()
    assert [d["num_classes"] for d in c["data"]] == [1, 1]
    bad = httpx.post(f"{rerank_mesh}/v1/embeddings", json={"input": "hi"}, timeout=30)
    assert bad.status_code == 400 and "embedding model" in bad.json()["error"]["message"]
    bad = httpx.post(f"{rerank_mesh}/v1/rerank", json={"query": QUERY, "documents": []}, timeout=30)
    assert bad.status_code == 400
