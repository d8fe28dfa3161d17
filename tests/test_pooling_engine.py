"""The pooling engine below the bus: the Llama-family body without a KV cache and the BERT encoder equal
transformers (LAST, MEAN, CLS pooling; a classification head), a packed batch equals one prompt at a time,
batches are cut by tokens, and the pooling flags parse or fail clearly."""
from __future__ import annotations

import json

import pytest
import torch

from shared.engine.pooler import pool
from shared.engine.pooling_engine import PoolingEngine, PoolJob
from shared.models.bert_pooling import load_bert_pooling
from shared.models.llama_pooling import load_llama_pooling
from shared.models.pooling_config import PoolerConfig, PoolingConfigError, pooling_spec
from tests.checkpoints import build_checkpoint
from tests.pooling_checkpoints import BERT_WORDS, build_bert, build_classifier

PROMPTS = [[5, 17, 42, 99, 3], [7], [300, 301, 302, 303, 304, 305, 306, 307, 308], [11, 12]]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    ckpt = build_checkpoint("qwen3", tmp_path_factory.mktemp("pool") / "qwen3")
    return ckpt


def _run(engine: PoolingEngine, jobs: list[PoolJob]) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for j in jobs:
        j.done = lambda values, error, rid=j.request_id: out.__setitem__(rid, values if error is None else error)
        engine.waiting.append(j)
    while engine.waiting:
        engine.step()
    return out


@pytest.mark.parametrize("ptype", ["LAST", "MEAN", "CLS"])
def test_causal_pooling_equals_transformers(tiny, ptype: str) -> None:
    spec = pooling_spec(tiny.path, "embed", PoolerConfig(pooling_type=ptype, normalize=False))
    engine = PoolingEngine(load_llama_pooling(tiny.path, spec), spec, max_num_batched_tokens=8)
    got = _run(engine, [PoolJob(str(i), p, "embed") for i, p in enumerate(PROMPTS)])
    body = tiny.hf_model.model
    for i, p in enumerate(PROMPTS):
        with torch.no_grad():
            h = body(torch.tensor([p])).last_hidden_state[0]
        want = {"LAST": h[-1], "MEAN": h.mean(0), "CLS": h[0]}[ptype]
        torch.testing.assert_close(got[str(i)][0], want, atol=2e-5, rtol=1e-4)
    assert engine.stats.steps >= 2  # a budget of 8 tokens cannot take all 17 at once


def test_batch_equals_one_at_a_time_and_budget(tiny) -> None:
    spec = pooling_spec(tiny.path, "embed")
    engine = PoolingEngine(load_llama_pooling(tiny.path, spec), spec, max_num_batched_tokens=10, max_num_seqs=3)
    engine.waiting.extend(PoolJob(str(i), p, "embed") for i, p in enumerate(PROMPTS))
    first = engine.schedule()
    assert [len(j.token_ids) for j in first] == [5, 1]  # the 9-token prompt would pass the 10-token budget
    alone = {str(i): _run(engine, [PoolJob(str(i), p, "embed")])[str(i)] for i, p in enumerate(PROMPTS)}
    together = _run(engine, [PoolJob(str(i), p, "embed") for i, p in enumerate(PROMPTS)])
    for k in alone:
        torch.testing.assert_close(together[k], alone[k], atol=1e-6, rtol=1e-5)
        assert abs(float(together[k].norm()) - 1) < 1e-5
    cut = _run(engine, [PoolJob("m", PROMPTS[0], "embed", dimensions=16)])["m"]
    assert cut.shape == (1, 16) and abs(float(cut.norm()) - 1) < 1e-5
    assert engine.check(PoolJob("x", [], "embed")) == "empty input"
    assert "context" in engine.check(PoolJob("x", [1] * 600, "embed"))
    assert "classification head" in engine.check(PoolJob("x", [1], "classify"))


def test_classifier_equals_transformers(tiny, tmp_path) -> None:
    from transformers import Qwen3ForSequenceClassification

    out = build_classifier(tiny.path, tmp_path / "cls", num_labels=3)
    spec = pooling_spec(out)
    assert spec.task == "classify" and spec.num_labels == 3 and spec.pooler.activation
    engine = PoolingEngine(load_llama_pooling(out, spec), spec)
    got = _run(engine, [PoolJob(str(i), p, "classify") for i, p in enumerate(PROMPTS)])
    raw = _run(engine, [PoolJob("raw", PROMPTS[0], "classify", activation=False)])["raw"]
    hf = Qwen3ForSequenceClassification.from_pretrained(out, dtype=torch.float32).eval()
    for i, p in enumerate(PROMPTS):
        with torch.no_grad():
            logits = hf(torch.tensor([p])).logits[0]
        torch.testing.assert_close(got[str(i)][0], logits.softmax(-1), atol=2e-5, rtol=1e-4)
        if i == 0:
            torch.testing.assert_close(raw[0], logits, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("ptype", ["CLS", "MEAN"])
def test_bert_encoder_equals_transformers(tmp_path_factory, ptype: str) -> None:
    from transformers import BertModel, PreTrainedTokenizerFast

    path = build_bert(tmp_path_factory.getbasetemp() / "bert")
    spec = pooling_spec(path, pooler=PoolerConfig(pooling_type=ptype) if ptype == "MEAN" else None)
    assert spec.encoder and spec.task == "embed" and spec.pooler.pooling_type == ptype
    tok = PreTrainedTokenizerFast.from_pretrained(str(path))
    texts = ["what is the capital of france?", "paris", "the dog and the cat in the rain"]
    ids = [tok(t)["input_ids"] for t in texts]
    assert ids[1][0] == tok.cls_token_id and tok.unk_token_id not in ids[0]
    engine = PoolingEngine(load_bert_pooling(path, spec, dtype="float32"), spec)
    got = _run(engine, [PoolJob(str(i), p, "embed") for i, p in enumerate(ids)])
    hf = BertModel.from_pretrained(path, dtype=torch.float32).eval()
    for i, p in enumerate(ids):
        with torch.no_grad():
            h = hf(torch.tensor([p])).last_hidden_state[0]
        want = torch.nn.functional.normalize(h[0] if ptype == "CLS" else h.mean(0), dim=-1)
        torch.testing.assert_close(got[str(i)][0], want, atol=2e-5, rtol=1e-4)
    assert len(BERT_WORDS) > 10


def test_pooling_flags(tiny, tmp_path) -> None:
    assert PoolerConfig.parse('{"pooling_type": "mean", "normalize": false}') == PoolerConfig("MEAN", False, None)
    assert PoolerConfig.parse('{"softmax": false}').activation is False
    for bad, why in (("[1]", "object"), ('{"pooling_type": "MAX"}', "pooling_type"), ('{"normalise": true}', "unknown"),
                     ("{", "not JSON"), ('{"normalize": "yes"}', "true or false")):
        with pytest.raises(PoolingConfigError, match=why):
            PoolerConfig.parse(bad)
    with pytest.raises(PoolingConfigError, match="no classification head"):
        pooling_spec(tiny.path, "classify")
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "hidden_size": 8,
                                                      "matryoshka_dimensions": [4, 8], "use_sep_token": False}))
    spec = pooling_spec(tmp_path)
    assert spec.matryoshka_dimensions == (4, 8) and not spec.pair_as_text_pair and spec.pooler.normalize
    assert pool(torch.arange(12.0).view(6, 2), [2, 4], "MEAN").tolist() == [[1.0, 2.0], [7.0, 8.0]]
