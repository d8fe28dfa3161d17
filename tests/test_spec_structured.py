"""Structured outputs with speculative decoding (shared/engine/spec/grammar_drafts.py): drafts are cut where the
grammar rejects them, every verify row is sampled under the grammar state after the drafts before it, and the
matcher only ever advances over kept tokens. Greedy structured output with speculation equals it without."""
from __future__ import annotations

import json

import jsonschema
import pytest
import torch

from shared.engine.spec.grammar_drafts import fill_draft_rows, grammar_prefix
from shared.sampling_params import SamplingParams, StructuredOutput
from shared.spec_config import SpeculativeConfig
from tests.engine_helpers import assert_all_free, make_engine

NGRAM = SpeculativeConfig(method="ngram", num_speculative_tokens=4, prompt_lookup_min=1, prompt_lookup_max=3)
SUFFIX = SpeculativeConfig(method="suffix", num_speculative_tokens=4)
METHODS = {"ngram": NGRAM, "suffix": SUFFIX}

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 12},
    "items": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "maxItems": 12},
    "ok": {"type": "boolean"}}, "required": ["name", "items", "ok"], "additionalProperties": False}


def _schema(schema: dict) -> StructuredOutput:
    return StructuredOutput(kind="json_schema", spec=json.dumps(schema))


def _fresh_mask(engine, seq) -> torch.Tensor:  # noqa: ANN001
    """The mask of a new matcher fed exactly the request's kept output: what seq.matcher must still say."""
    m = engine.grammar().matcher(seq.params.structured)
    for t in seq.output_token_ids:
        assert m.accept_token(t), "a kept token the grammar rejects"
    mask = engine.grammar().allocate(1)
    if not m.is_terminated():
        m.fill_next_token_bitmask(mask, 0)
    return mask


def _run_checking_matchers(engine, requests: list[tuple[str, list[int], SamplingParams]]) -> dict:  # noqa: ANN001
    """Run to completion; after every step each live structured request's matcher stands exactly after its
    kept tokens (a rejected draft never advanced it, a rollback never undid a kept one)."""
    for rid, prompt, params in requests:
        engine.add_request(rid, prompt, params)
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
        engine.check_integrity()
        for seq in engine.scheduler.sequences():
            if seq.matcher is not None and not seq.matcher.is_terminated():
                mask = engine.grammar().allocate(1)
                seq.matcher.fill_next_token_bitmask(mask, 0)
                assert torch.equal(mask, _fresh_mask(engine, seq)), seq.request_id
    return done


def test_draft_prefix_and_rows_follow_the_grammar(checkpoints):
    """grammar_prefix cuts at the first token the grammar rejects and leaves the matcher where it was;
    fill_draft_rows gives row j the mask after drafts[:j] (as decoding one by one) and rolls back."""
    engine = make_engine(checkpoints["qwen3"])
    backend = engine.grammar()
    from shared.models.tokenizer import load_tokenizer

    tok = load_tokenizer(checkpoints["qwen3"].path)
    so = StructuredOutput(kind="regex", spec="(ab|cd)+x")
    ids = [tok.convert_tokens_to_ids(c) for c in "abcdx"]
    a, b, c, d, x = ids
    m = backend.matcher(so)
    assert grammar_prefix(m, [a, b, c, d, a, a, b]) == [a, b, c, d, a]  # 'aa' breaks the pattern
    assert grammar_prefix(m, [c, d, x]) == [c, d, x]
    assert grammar_prefix(m, [b]) == []  # the matcher did not move: it still wants 'a' or 'c' first
    drafts = [a, b, c]
    rows = backend.allocate(len(drafts) + 1)
    fill_draft_rows(m, drafts, rows, 0)
    one_by_one = backend.matcher(so)
    for j in range(len(drafts) + 1):
        expect = backend.allocate(1)
        one_by_one.fill_next_token_bitmask(expect, 0)
        assert torch.equal(rows[j], expect[0]), f"row {j}"
        if j < len(drafts):
            assert one_by_one.accept_token(drafts[j])
    before = backend.allocate(1)
    m.fill_next_token_bitmask(before, 0)
    assert torch.equal(before[0], rows[0]), "fill_draft_rows left the matcher advanced"


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_greedy_structured_equals_no_speculation(arch, checkpoints):
    """Random-weight models loop under a JSON schema, so drafts get accepted and rejected; the tokens equal
    decoding without speculation, the JSON is valid, and the matchers are checked after every step."""
    from shared.models.tokenizer import load_tokenizer

    ckpt = checkpoints[arch]
    tok = load_tokenizer(ckpt.path)
    example = json.dumps({"name": "abc", "items": [1, 2, 3, 1, 2, 3], "ok": True}, separators=(",", ":"))
    prompts = [tok.encode(f"Answer like {example} {example}"), tok.encode("JSON please"), tok.encode(example)]
    schemas = [_schema(SCHEMA), StructuredOutput(kind="json_object"), _schema(SCHEMA)]
    requests = [(f"r{i}", p, SamplingParams(max_tokens=64, temperature=0.0, logprobs=1, structured=s))
                for i, (p, s) in enumerate(zip(prompts, schemas))]
    plain = _run_checking_matchers(make_engine(ckpt), requests)
    # The target drafting for itself: long model drafts that the grammar cuts and verification masks.
    own_draft = SpeculativeConfig(method="draft_model", model=str(ckpt.path), num_speculative_tokens=4)
    for name, config in {**METHODS, "draft_model": own_draft}.items():
        engine = make_engine(ckpt, speculative_config=config)
        outs = _run_checking_matchers(engine, requests)
        for rid, _, params in requests:
            assert outs[rid].output_token_ids == plain[rid].output_token_ids, (name, rid)
            assert [lp.token_id for lp in outs[rid].logprobs] == outs[rid].output_token_ids
            for x, y in zip(outs[rid].logprobs, plain[rid].logprobs):
                assert abs(x.logprob - y.logprob) < 1e-4
            if outs[rid].finish_reason == "stop":
                value = json.loads(tok.decode(outs[rid].output_token_ids, skip_special_tokens=True))
                if params.structured.kind == "json_schema":
                    jsonschema.validate(value, SCHEMA)
        stats = engine.speculator.stats
        assert stats.num_accepted_tokens > 0, f"{arch} {name}: structured requests never speculated ({stats})"
        assert_all_free(engine)


def test_sampled_structured_requests_stay_valid_under_rejection_sampling(checkpoints):
    """Sampled requests verify through the rejection sampler on masked probabilities: every finished answer
    satisfies its schema and the matchers stay exact after every step."""
    from shared.models.tokenizer import load_tokenizer

    ckpt = checkpoints["qwen3"]
    tok = load_tokenizer(ckpt.path)
    example = json.dumps({"name": "abc", "items": [1, 2, 3, 1, 2, 3], "ok": True})
    requests = [(f"s{i}", tok.encode(f"{example} {example}"),
                 SamplingParams(max_tokens=64, temperature=0.8, top_p=0.95, seed=i, structured=_schema(SCHEMA)))
                for i in range(6)]
    engine = make_engine(ckpt, speculative_config=NGRAM)
    outs = _run_checking_matchers(engine, requests)
    for out in outs.values():
        if out.finish_reason == "stop":
            jsonschema.validate(json.loads(tok.decode(out.output_token_ids, skip_special_tokens=True)), SCHEMA)
    assert engine.speculator.stats.num_draft_tokens > 0
    assert_all_free(engine)


def test_sampled_structured_requests_do_not_draft_from_a_model(checkpoints):
    """A model's draft cut at the grammar is a draw conditioned on being legal, which min(1, p/q) does not
    correct for: sampled structured requests decode without model drafts, greedy ones beside them still draft."""
    from shared.models.tokenizer import load_tokenizer

    ckpt = checkpoints["qwen3"]
    tok = load_tokenizer(ckpt.path)
    prompt = tok.encode("JSON please")
    own_draft = SpeculativeConfig(method="draft_model", model=str(ckpt.path), num_speculative_tokens=4)
    sampled = SamplingParams(max_tokens=24, temperature=0.8, seed=3, structured=_schema(SCHEMA))
    engine = make_engine(ckpt, speculative_config=own_draft)
    _run_checking_matchers(engine, [("s", prompt, sampled)])
    assert engine.speculator.stats.num_draft_tokens == 0
    greedy = SamplingParams(max_tokens=24, temperature=0.0, structured=_schema(SCHEMA))
    _run_checking_matchers(engine, [("s2", prompt, sampled), ("g", prompt, greedy)])
    assert engine.speculator.stats.num_draft_tokens > 0
    assert_all_free(engine)


@pytest.mark.slow  # 20 s on a quiet machine, minutes under load: the tiny-model tests above cover exactness
def test_real_model_json_with_speculation(smollm2_dir):
    """SmolLM2 asked to repeat a JSON document under its schema: the same tokens as without speculation, valid
    JSON, and long accepted runs (the prompt holds the answer)."""
    from shared.config import EngineConfig
    from shared.engine.llm_engine import LLMEngine
    from shared.models.tokenizer import encode_chat, load_tokenizer

    tok = load_tokenizer(smollm2_dir)
    doc = {"name": "Ada", "items": [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8], "ok": True}
    text = json.dumps(doc)  # xgrammar's whitespace-free JSON still writes ", " and ": "
    prompt = encode_chat(tok, [{"role": "user", "content": f"Repeat this JSON exactly:\n{text}"}])
    params = SamplingParams(max_tokens=64, temperature=0.0, structured=_schema(SCHEMA))
    cfg = dict(model=str(smollm2_dir), num_kv_blocks=128, max_num_batched_tokens=512, dtype="float32")
    plain = LLMEngine(EngineConfig(**cfg)).generate([prompt], params, use_tqdm=False)[0]
    assert plain.finish_reason == "stop"
    jsonschema.validate(json.loads(tok.decode(plain.output_token_ids, skip_special_tokens=True)), SCHEMA)
    for name, config in METHODS.items():
        engine = LLMEngine(EngineConfig(**cfg, speculative_config=config))
        out = engine.generate([prompt], params, use_tqdm=False)[0]
        assert out.output_token_ids == plain.output_token_ids, name
        stats = engine.speculator.stats
        assert stats.mean_acceptance_length > 1.5, f"{name}: {stats}"
        assert_all_free(engine)


def test_mesh_structured_output_speculates(checkpoints, tmp_path):
    """A decode worker started with --speculative-config behind the real gateway and the openai client: a
    json_schema completion gives the engine's text without speculation, chat with response_format json_schema
    gives valid JSON, and the worker's spec_decode counters show accepted drafts."""
    import httpx
    import openai

    from shared.models.tokenizer import load_tokenizer
    from tests.gateway_harness import Mesh
    from tests.test_metrics import sample

    ckpt = checkpoints["qwen3"]
    tok = load_tokenizer(ckpt.path)
    example = json.dumps({"name": "abc", "items": [1, 2, 3, 1, 2, 3], "ok": True})
    prompt = tok.encode(f"Answer like {example} {example}")
    params = SamplingParams(max_tokens=64, temperature=0.0, structured=_schema(SCHEMA))
    want = make_engine(ckpt).generate([prompt], params, use_tqdm=False)[0]
    mesh = Mesh(tmp_path, ckpt.path)
    try:
        mesh.start_tokenizer()
        mesh.start_decoder("d0", speculative_config=SUFFIX)
        mesh.wait_until(lambda: mesh.gateway.ctx.router.alive())
        client = openai.OpenAI(base_url=f"{mesh.url}/v1", api_key="unused", max_retries=0, timeout=60)
        r = client.completions.create(model="tiny", prompt=prompt, max_tokens=64, temperature=0,
                                      extra_body={"structured_outputs": {"json": SCHEMA}})
        assert r.choices[0].text == tok.decode(want.output_token_ids, skip_special_tokens=True)
        assert r.usage.completion_tokens == len(want.output_token_ids)
        fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA, "strict": True}}
        r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": example}],
                                           temperature=0, max_tokens=96, response_format=fmt)
        if r.choices[0].finish_reason == "stop":
            jsonschema.validate(json.loads(r.choices[0].message.content), SCHEMA)
        metrics = httpx.get(f"{mesh.url}/metrics", timeout=10).text
        assert sample(metrics, "spec_decode_num_accepted_tokens_total", worker="d0") > 0
    finally:
        mesh.close()
