"""A tiny BERT encoder (transformers' BertModel, a WordPiece tokenizer built here) served by `kvmesh up
--runner pooling`: /v1/embeddings through the real openai client equals transformers' CLS vector, normalized."""
from __future__ import annotations

import numpy as np
import openai
import pytest
import torch

from loadtest.up_process import kvmesh_up
from tests.pooling_checkpoints import build_bert
from tests.test_pooling_mesh import ROOT, _cos, _env, _port

pytestmark = pytest.mark.slow  # a mesh of its own


def test_bert_mesh_embeddings(tmp_path) -> None:
    from transformers import BertModel, PreTrainedTokenizerFast

    path = build_bert(tmp_path / "bert")
    tok = PreTrainedTokenizerFast.from_pretrained(str(path))
    hf = BertModel.from_pretrained(path, dtype=torch.float32).eval()
    texts = ["what is the capital of france?", "the dog and the cat", "paris"]
    port = _port()
    with kvmesh_up(path, port, "bert", ["--runner", "pooling", "--kvstore", "0"], tmp_path / "up.log",
                   cwd=str(ROOT), env=_env()):
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none")
        got = client.embeddings.create(model="bert", input=texts)
        with pytest.raises(openai.BadRequestError, match="pooling model"):
            client.chat.completions.create(model="bert", messages=[{"role": "user", "content": "hi"}])
    for d, text in zip(got.data, texts):
        with torch.no_grad():
            cls = hf(torch.tensor([tok(text)["input_ids"]])).last_hidden_state[0, 0]
        assert _cos(d.embedding, torch.nn.functional.normalize(cls, dim=-1).numpy()) >= 0.9999
        assert abs(np.linalg.norm(d.embedding) - 1) < 1e-4
