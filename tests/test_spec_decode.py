"""Speculative decoding (shared/engine/spec/, shared/engine/rejection_sampler.py): greedy output identical token for
token to decoding without it (and to transformers), drafts actually accepted, stops and max_tokens inside an
accepted run, aborts, prefix-cache hits and preemption with nothing rejected ever hashed; the rejection sampler
preserves the target distribution (chi-square on a tiny vocabulary)."""
from __future__ import annotations

import pytest
import torch

from shared.block_hash import hash_blocks
from shared.engine.block_events import BlocksStored
from shared.engine.errors import ConfigError
from shared.engine.rejection_sampler import rejection_sample
from shared.engine.sampler import Sampler, sampling_probs
from shared.engine.sequence import Sequence
from shared.engine.spec.adaptive import DraftBudget
from shared.engine.spec.draft_position import positions
from shared.sampling_params import SamplingParams
from shared.spec_config import SpeculativeConfig
from tests.checkpoints import ARCHS
from tests.engine_helpers import (assert_all_free, assert_matches_hf, greedy, make_engine, random_prompts,
                                  run_to_completion)

NGRAM = SpeculativeConfig(method="ngram", num_speculative_tokens=4, prompt_lookup_min=1, prompt_lookup_max=3)
SUFFIX = SpeculativeConfig(method="suffix", num_speculative_tokens=4)
METHODS = {"ngram": NGRAM, "suffix": SUFFIX}
MAX_NEW = 24


def repetitive_prompts(lengths: list[int], seed: int) -> list[list[int]]:
    """Prompts that repeat their own start: a lookup proposer finds something to draft."""
    return [p + p[:12] + p[:12] for p in random_prompts(lengths, seed=seed)]


def all_cached_hashes_are_real(engine, token_sequences: list[list[int]], events) -> None:  # noqa: ANN001
    """Every hash the prefix cache and its block events ever saw is a block of real (kept) tokens."""
    bm = engine.block_manager
    real = set()
    for tokens in token_sequences:
        real.update(hash_blocks(bm.root, tokens, bm.block_size, None, 0))
    assert set(bm.cached) <= real, "a cached block hash covers a token that was never kept"
    stored = {h for e in events if isinstance(e, BlocksStored) for h in e.hashes}
    assert stored <= real, "a block event announced a block with a rejected token"


# --- the flag -------------------------------------------------------------------------------------


@pytest.mark.parametrize("text, message", [
    ("{nope", "not valid JSON"),
    ('["ngram"]', "must be a JSON object"),
    ('{"num_speculative_tokens": 3}', "needs a \"method\""),
    ('{"method": "medusa"}', "unknown method 'medusa'"),
    ('{"method": "ngram", "num_speculative_tokens": 0}', "num_speculative_tokens must be an integer >= 1"),
    ('{"method": "ngram", "prompt_lookup_min": 4, "prompt_lookup_max": 2}', "prompt_lookup_min (4) is larger"),
    ('{"method": "ngram", "lookahead": 2}', "unknown key(s) lookahead"),
])
def test_bad_speculative_config_is_a_clear_error(text, message):
    with pytest.raises(ConfigError, match=None) as e:
        SpeculativeConfig.parse(text)
    assert message in str(e.value)


def test_speculative_config_round_trips_to_the_workers_flag():
    c = SpeculativeConfig.parse('{"method": "suffix", "num_speculative_tokens": 6}')
    assert SpeculativeConfig.parse(c.to_json()) == c
    assert SpeculativeConfig.parse(None) is None and SpeculativeConfig.parse("") is None


def test_engine_and_launcher_flags_carry_it():
    import argparse

    from services.engine_args import add_engine_arguments, engine_config_from_args
    from shared.launcher.process_spec import MeshOptions, mesh_services

    p = argparse.ArgumentParser()
    add_engine_arguments(p)
    args = p.parse_args(["--model", "m", "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 2}',
                         "--device", "cpu"])
    assert engine_config_from_args(args).speculative_config == SpeculativeConfig("ngram", num_speculative_tokens=2)
    services = {s.service: s.args for s in mesh_services(MeshOptions(model="m", speculative_config=NGRAM.to_json()))}
    at = services["decode"].index("--speculative-config")
    assert SpeculativeConfig.parse(services["decode"][at + 1]) == NGRAM
    assert "--speculative-config" not in services["prefill"]


# --- greedy exactness -------------------------------------------------------------------------------


@pytest.mark.parametrize("arch", list(ARCHS))
def test_greedy_equals_no_speculation_and_transformers(arch, checkpoints, hf_reference):
    """Mixed batch: prompts of many lengths under a small token budget, so prompt chunks run beside verifies."""
    ckpt = checkpoints[arch]
    prompts = repetitive_prompts([3, 17, 60], seed=11)
    plain = make_engine(ckpt, max_num_batched_tokens=48).generate(prompts, greedy(MAX_NEW), use_tqdm=False)
    for name, config in METHODS.items():
        engine = make_engine(ckpt, max_num_batched_tokens=48, speculative_config=config)
        events = []
        done = {}
        ids = [f"r{i}" for i in range(len(prompts))]
        for rid, p in zip(ids, prompts):
            engine.add_request(rid, p, greedy(MAX_NEW))
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    done[out.request_id] = out
            engine.check_integrity()
            events += engine.block_manager.drain_events()
        outputs = [done[rid] for rid in ids]
        assert [o.output_token_ids for o in outputs] == [o.output_token_ids for o in plain], name
        assert_matches_hf(ckpt, hf_reference, prompts, outputs, MAX_NEW)  # logprobs are the target's
        stats = engine.speculator.stats
        assert stats.num_accepted_tokens > 0, f"{arch} {name}: no draft was ever accepted ({stats})"
        all_cached_hashes_are_real(engine, [p + o.output_token_ids for p, o in zip(prompts, outputs)], events)
        assert_all_free(engine)


def test_real_model_greedy_equals_no_speculation(smollm2_dir):
    from shared.config import EngineConfig
    from shared.engine.llm_engine import LLMEngine
    from shared.models.tokenizer import encode_chat, load_tokenizer

    tok = load_tokenizer(smollm2_dir)
    text = ("The committee met on Tuesday to review the budget. The committee agreed that the budget for the "
            "library would rise by ten percent, and that the budget for the park would stay the same.")
    prompts = [encode_chat(tok, [{"role": "user", "content": f"Repeat this text exactly:\n\n{text}"}])]
    params = SamplingParams(max_tokens=24, temperature=0.0, logprobs=2)
    cfg = dict(model=str(smollm2_dir), num_kv_blocks=128, max_num_batched_tokens=512, dtype="float32")
    plain = LLMEngine(EngineConfig(**cfg)).generate(prompts, params, use_tqdm=False)
    for name, config in METHODS.items():
        engine = LLMEngine(EngineConfig(**cfg, speculative_config=config))
        outs = engine.generate(prompts, params, use_tqdm=False)
        assert [o.output_token_ids for o in outs] == [o.output_token_ids for o in plain], name
        for a, b in zip(plain, outs):
            for x, y in zip(a.logprobs, b.logprobs):
                assert x.token_id == y.token_id and abs(x.logprob - y.logprob) < 1e-3
        stats = engine.speculator.stats
        assert stats.num_accepted_tokens > 0 and stats.mean_acceptance_length > 1.5, f"{name}: {stats}"
        assert_all_free(engine)


# --- where a run of accepted tokens ends ---------------------------------------------------------------


class RecordedProposer:
    """Drafts the continuation a run without speculation produced (tokens the verify must accept), so where the
    accepted runs fall is known; the verify step, sampler and bookkeeping are the engine's own."""

    def __init__(self, prompt: list[int], output: list[int]) -> None:
        self.full = prompt + output

    def propose(self, seq: Sequence, k: int) -> list[int]:
        n = seq.num_tokens
        return self.full[n : n + k] if self.full[:n] == seq.token_ids else []

    def finished(self, seq: Sequence) -> None:
        pass


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_stop_id_and_max_tokens_inside_an_accepted_run(arch, checkpoints):
    ckpt = checkpoints[arch]
    plain = make_engine(ckpt)
    prompt = repetitive_prompts([30], seed=5)[0]
    out = plain.generate([prompt], greedy(MAX_NEW, logprobs=None), use_tqdm=False)[0].output_token_ids
    spec = make_engine(ckpt, speculative_config=NGRAM)
    spec.speculator.proposer = RecordedProposer(prompt, out)
    spec.add_request("probe", prompt, greedy(MAX_NEW, logprobs=None))
    chunks = [list(o.new_token_ids) for o in run_to_completion_outputs(spec)]
    assert max(len(c) for c in chunks) == 5, "every draft of the recorded continuation is accepted"
    # A token in the middle of an accepted run, at its first occurrence in the output.
    at, inside = 0, []
    for c in chunks:
        inside += [at + j for j in range(len(c) - 1) if out.index(c[j]) == at + j]
        at += len(c)
    assert inside, "no first occurrence inside an accepted run"
    j = inside[-1]
    cases = [SamplingParams(max_tokens=MAX_NEW, temperature=0.0, stop_token_ids=[out[j]], logprobs=1),
             SamplingParams(max_tokens=j + 1, temperature=0.0, logprobs=1)]
    for params in cases:
        a = plain.generate([prompt], params, use_tqdm=False)[0]
        b = spec.generate([prompt], params, use_tqdm=False)[0]
        assert b.output_token_ids == a.output_token_ids == out[: j + 1]
        assert b.finish_reason == a.finish_reason
        assert [lp.token_id for lp in b.logprobs] == out[: j + 1]
    assert spec.speculator.stats.num_accepted_tokens > 0
    assert_all_free(spec)


def run_to_completion_outputs(engine):  # noqa: ANN001, ANN201
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
        engine.check_integrity()
    return outs


def test_preemption_prefix_hits_and_aborts(checkpoints):
    ckpt = checkpoints["mistral"]
    prompts = repetitive_prompts([16, 9, 20], seed=7)  # 40, 33 and 44 tokens: 3 blocks each
    # 9 blocks for three requests that grow to 4-5 blocks: preemption happens, drafts included.
    spec = make_engine(ckpt, num_kv_blocks=9, speculative_config=SUFFIX)
    plain = make_engine(ckpt, num_kv_blocks=9)
    params = greedy(24, logprobs=None)
    want = plain.generate(prompts, params, use_tqdm=False)
    got = spec.generate(prompts, params, use_tqdm=False)
    assert [o.output_token_ids for o in got] == [o.output_token_ids for o in want]
    assert spec.scheduler.num_preemptions > 0
    assert_all_free(spec)
    # The same prompts again: prefix hits on blocks the first run cached, which hold only kept tokens.
    again = spec.generate(prompts, params, use_tqdm=False)
    assert any(o.num_cached_tokens for o in again)
    assert [o.output_token_ids for o in again] == [o.output_token_ids for o in want]
    all_cached_hashes_are_real(spec, [p + o.output_token_ids for p, o in zip(prompts, want)], [])
    # Aborts in the middle of verifying: nothing leaks, the others are undisturbed.
    for i, p in enumerate(prompts):
        spec.add_request(f"a{i}", p, params)
    for _ in range(5):
        spec.step()
        spec.check_integrity()
    spec.abort("a1")
    done = run_to_completion(spec)
    assert set(done) == {"a0", "a2"}
    assert [done["a0"].output_token_ids, done["a2"].output_token_ids] == [want[0].output_token_ids,
                                                                          want[2].output_token_ids]
    assert spec.speculator.stats.num_accepted_tokens > 0
    assert_all_free(spec)


def test_sampled_and_greedy_requests_in_one_batch(checkpoints):
    """Seeded sampled requests repeat their tokens run after run (same config); greedy requests beside them, and
    one with logit_bias and a repetition penalty (processed through the drafts before each row), equal decoding
    without speculation."""
    check_mixed_batch(checkpoints["qwen2"], NGRAM)


def check_mixed_batch(ckpt, config: SpeculativeConfig, check_engine=lambda engine: None) -> None:  # noqa: ANN001
    """Two seeded sampled, one greedy and one penalised greedy request in one batch, twice under config: the
    greedy ones equal decoding without speculation, the seeded ones repeat; check_engine(engine) after each run."""
    prompts = repetitive_prompts([20, 45, 33, 27], seed=9)
    params = [SamplingParams(max_tokens=16, temperature=0.8, top_k=20, top_p=0.9, seed=s, logprobs=1) for s in (1, 2)]
    params += [greedy(16), SamplingParams(max_tokens=16, temperature=0.0, repetition_penalty=1.3,
                                           logit_bias={7: 2.0}, logprobs=1)]
    want = make_engine(ckpt).generate(prompts[2:], params[2:], use_tqdm=False)
    runs = []
    for _ in range(2):
        engine = make_engine(ckpt, speculative_config=config)
        outs = engine.generate(prompts, params, use_tqdm=False)
        runs.append([o.output_token_ids for o in outs])
        assert [o.output_token_ids for o in outs[2:]] == [o.output_token_ids for o in want]
        assert all(len(o.logprobs) == len(o.output_token_ids) for o in outs)
        assert_all_free(engine)
        check_engine(engine)
    assert runs[0] == runs[1], "a seeded request's tokens must repeat (same config, same seed)"


# --- the rejection sampler keeps the target's distribution -------------------------------------------

VOCAB = 6
# chi-square critical values at p = 0.001 by degrees of freedom: a correct sampler fails one run in a thousand.
CHI2_999 = {1: 10.83, 2: 13.82, 3: 16.27, 4: 18.47, 5: 20.52}


def _chi2(counts: torch.Tensor, probs: torch.Tensor) -> tuple[float, int]:
    n = counts.sum().item()
    keep = probs > 0
    assert counts[~keep].sum() == 0, "a token the processed target cannot emit was emitted"
    expected = probs[keep] * n
    return float(((counts[keep] - expected) ** 2 / expected).sum()), int(keep.sum()) - 1


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0.7),
    SamplingParams(temperature=1.3, top_k=4),
    SamplingParams(temperature=1.0, top_p=0.8),
    SamplingParams(temperature=0.9, top_k=5, top_p=0.9, presence_penalty=0.8, repetition_penalty=1.2),
])
def test_rejection_sampler_preserves_the_target_distribution(params):
    torch.manual_seed(0)
    logits = torch.tensor([[1.2, 0.3, 2.0, -0.5, 0.9, 0.1], [0.2, 1.7, -1.0, 1.1, 0.4, 0.8],
                           [0.0, 0.5, 1.5, 0.7, -0.3, 1.0]])
    seq = Sequence("chi2", [0, 1, 2], params)
    seq.token_ids += [4, 2]  # two output tokens: the penalties have something to count
    seq.spec_token_ids = [2, 3]  # the draft: token 2, then token 3
    sampler = Sampler(eos_token_ids=(), seed=0)
    views = positions(seq, 2)
    lg = logits.clone()
    sampler.process_logits(lg, views)  # type: ignore[arg-type]
    probs = sampling_probs(lg, [v.params for v in views])
    n = 20000
    gen = torch.Generator().manual_seed(1)
    emitted = rejection_sample(probs.repeat(n, 1), [[2, 3]] * n, [gen] * n)
    first = torch.bincount(torch.tensor([e[0] for e in emitted]), minlength=VOCAB).float()
    stat, df = _chi2(first, probs[0])
    assert stat < CHI2_999[df], f"first token: chi2 {stat:.1f} with {df} degrees of freedom"
    # After an accepted first draft, the next token follows the target at the next position.
    second = torch.bincount(torch.tensor([e[1] for e in emitted if e[0] == 2]), minlength=VOCAB).float()
    stat, df = _chi2(second, probs[1])
    assert stat < CHI2_999[df], f"second token: chi2 {stat:.1f} with {df} degrees of freedom"


def test_rejection_sampler_general_form_with_draft_probabilities():
    """A draft model's q: accept with min(1, p/q), resample from max(p - q, 0)."""
    p = torch.tensor([[0.1, 0.5, 0.2, 0.2], [0.25, 0.25, 0.25, 0.25]])
    q = torch.tensor([[0.4, 0.1, 0.4, 0.1]])
    n = 20000
    gen = torch.Generator().manual_seed(2)
    drafts = torch.multinomial(q[0], n, replacement=True, generator=torch.Generator().manual_seed(3)).tolist()
    emitted = rejection_sample(p.repeat(n, 1), [[d] for d in drafts], [gen] * n, draft_probs=q.repeat(n, 1))
    first = torch.bincount(torch.tensor([e[0] for e in emitted]), minlength=4).float()
    stat, df = _chi2(first, p[0])
    assert stat < CHI2_999[df], f"chi2 {stat:.1f}"


def test_draft_budget_backs_off_and_recovers():
    b = DraftBudget(4)
    b.update(4, 0)
    assert b.allowed() == 2
    b.update(2, 0)
    b.update(1, 0)
    assert [b.allowed() for _ in range(8)] == [0] * 7 + [1]
    b.update(1, 1)
    assert b.allowed() == 2
    b.update(2, 2)
    assert b.allowed() == 4


def test_no_speculation_above_the_batch_size_threshold(checkpoints):
    ckpt = checkpoints["llama"]
    prompts = repetitive_prompts([20] * 6, seed=13)
    engine = make_engine(ckpt, speculative_config=SpeculativeConfig(method="ngram", disable_by_batch_size=4))
    engine.generate(prompts, greedy(8, logprobs=None), use_tqdm=False)
    assert engine.speculator.stats.num_drafts == 0 and engine.speculator.steps_off > 0


# --- across the mesh --------------------------------------------------------------------------------


def test_mesh_decode_worker_speculates_after_remote_prefill(checkpoints, tmp_path):
    """A decode worker with --speculative-config behind the real gateway, fed by a prefill worker: the same text
    and usage as the engine without speculation, a stop string cut inside a verify step's tokens, and the
    spec_decode counters on /metrics."""
    import httpx
    import openai

    from shared.models.tokenizer import load_tokenizer
    from tests.gateway_harness import Mesh
    from tests.test_metrics import sample

    ckpt = checkpoints["llama"]
    prompt = repetitive_prompts([30], seed=5)[0]
    out = make_engine(ckpt).generate([prompt], greedy(MAX_NEW, logprobs=None), use_tqdm=False)[0].output_token_ids
    tok = load_tokenizer(ckpt.path)
    text = tok.decode(out)
    mesh = Mesh(tmp_path, ckpt.path)
    try:
        mesh.start_tokenizer()
        mesh.start_prefill()
        mesh.start_decoder("d0", threshold=8, speculative_config=NGRAM)  # the prompt is prefilled remotely
        mesh.wait_until(lambda: mesh.gateway.ctx.router.alive() and mesh.gateway.ctx.metrics.prefill_workers.alive())
        client = openai.OpenAI(base_url=f"{mesh.url}/v1", api_key="unused", max_retries=0, timeout=60)
        r = client.completions.create(model="tiny", prompt=prompt, max_tokens=MAX_NEW, temperature=0)
        assert r.choices[0].text == text and r.usage.completion_tokens == len(out)
        # A stop string: the text of a token at its first occurrence; the answer ends before it, and usage counts
        # the tokens up to it, as decoding one token at a time would.
        for j in range(len(out) - 1, 0, -1):
            before, piece = tok.decode(out[:j]), tok.decode(out[: j + 1])
            stop = piece[len(before):]
            if stop.strip() and piece.startswith(before) and text.find(stop) == len(before):
                break
        else:
            pytest.skip("no token text usable as a stop string")
        r = client.completions.create(model="tiny", prompt=prompt, max_tokens=MAX_NEW, temperature=0, stop=[stop])
        assert r.choices[0].text == before and r.usage.completion_tokens == j + 1
        metrics = httpx.get(f"{mesh.url}/metrics", timeout=10).text
        assert sample(metrics, "spec_decode_num_drafts_total", worker="d0") > 0
        assert sample(metrics, "spec_decode_num_accepted_tokens_total", worker="d0") > 0
        assert sample(metrics, "spec_decode_num_accepted_tokens_per_pos_total", worker="d0", position="0") > 0
        assert sample(metrics, "spec_decode_num_draft_tokens_total", worker="d0") >= sample(
            metrics, "spec_decode_num_accepted_tokens_total", worker="d0")
        # How the runner ran the verify steps: on CPU capture is off, so through the verify graphs' padded path run
        # eagerly, or the runner's eager path; never a replay. One request at a time: a verify step per draft.
        steps = {path: sample(metrics, "spec_decode_verify_steps_total", worker="d0", path=path)
                 for path in ("graph", "padded_eager", "eager")}
        assert steps["graph"] == 0 and steps["padded_eager"] + steps["eager"] > 0, steps
        assert sum(steps.values()) == sample(metrics, "spec_decode_num_drafts_total", worker="d0"), steps
    finally:
        mesh.close()


def test_suffix_worker_table_never_crosses_cache_salts():
    """A finished output teaches the worker-wide suffix table only for its own cache salt: a request under
    another salt (or none) drafts nothing from it, one under the same salt drafts its continuation; the oldest
    output leaves past the bound, its salt's table with it."""
    from shared.engine.spec.suffix import SuffixProposer

    def finished(prompt: list[int], output: list[int], salt: str | None) -> Sequence:
        seq = Sequence(f"r{salt}", prompt, SamplingParams(max_tokens=len(output), cache_salt=salt))
        seq.token_ids.extend(output)
        return seq

    proposer = SuffixProposer(depth=4, max_cached_requests=1, min_token_prob=0.1, max_spec_factor=4.0)
    proposer.finished(finished([1, 2], [7, 8, 9, 10, 11], "a"))
    context = [3, 4, 7, 8]  # ends with the start of salt a's output, nothing of it in its own tokens after that

    def drafts(salt: str | None) -> list[int]:
        return proposer.propose(Sequence(f"q{salt}", list(context), SamplingParams(max_tokens=8, cache_salt=salt)), 3)

    assert drafts("a") == [9, 10, 11]
    assert drafts("b") == [] and drafts(None) == []
    proposer.finished(finished([1, 2], [5, 6, 5, 6], None))  # the bound (1) pushes salt a's output out
    assert drafts("a") == [] and set(proposer.shared) == {""}
