"""Draft-model speculation: a small checkpoint with the target's tokenizer drafts k tokens per request per step.

The draft is loaded with the project's own loader and model code (shared/models/) on the target's device and
dtype and runs through its own ModelRunner over its own paged KV pool (draft_kv.py). One propose runs k draft
forwards for the whole batch: the first feeds each request what the draft has not computed (the whole prompt
the first time, then the one or two tokens the last verify added past the accepted drafts), each next one the
token just drafted (one-token steps: on CUDA replayed from the draft's own decode graphs, captured into the
target's graph pool). A first forward larger than max_num_batched_tokens (contexts the draft has not seen yet)
is preceded by catch-up forwards within that budget, as the memory profile assumes. Greedy requests draft the
draft's argmax; sampled ones draw from the draft's distribution q (its logits through the request's temperature,
top-k, top-p and min-p), and q goes to the rejection sampler on Sequence.spec_draft_probs, so the emitted tokens
follow the target exactly (accept with min(1, p/q), resample from max(p - q, 0)). Penalties and logit bias are the
target's business: a draft that ignores them only drafts worse, never wrongly.

Checked at start (ConfigError): the draft's vocabulary is the target's (same size, and the same tokenizer
vocabulary where both checkpoints ship one), and it loads on the target's device and dtype; no tensor parallelism.
"""
from __future__ import annotations

import logging
from itertools import accumulate

import torch

from shared.config import EngineConfig
from shared.engine.errors import ConfigError
from shared.engine.kv_cache import bytes_per_block, kv_dtype
from shared.engine.model_runner import ModelRunner
from shared.engine.sampler import sampling_probs
from shared.engine.sequence import Sequence
from shared.engine.spec.draft_kv import DraftKV
from shared.models.loader import load_model
from shared.models.model_config import ModelConfig

log = logging.getLogger(__name__)


class DraftModel:
    """The loaded draft: model, runner and (after allocate) its KV pool. Built before the target's pool is sized,
    so the draft's weights count in the memory budget and its pool takes its share of the KV bytes."""

    def __init__(self, c: EngineConfig, target: ModelConfig, dtype: torch.dtype, max_model_len: int) -> None:
        spec = c.speculative_config
        assert spec is not None and spec.method == "draft_model" and spec.model
        if c.tensor_parallel_size > 1:
            raise ConfigError("--speculative-config: draft_model with tensor parallelism is not supported yet")
        from shared.models.model_source import resolve_model

        self.path = resolve_model(spec.model)
        self.k = spec.num_speculative_tokens
        name = str(dtype).removeprefix("torch.")
        try:
            self.model, self.config = load_model(self.path, dtype=name, device=c.device,
                                                 max_positions=max_model_len + self.k,
                                                 pack_weights=c.cpu_weight_packing)
        except (OSError, ValueError) as e:
            raise ConfigError(f"--speculative-config: cannot load the draft model {spec.model!r}: {e}") from e
        p = next(self.model.parameters())
        if p.dtype != dtype or p.device.type != torch.device(c.device).type:
            raise ConfigError(f"--speculative-config: the draft model loaded as {p.dtype} on {p.device}, the target "
                              f"runs {dtype} on {c.device}")
        check_same_vocabulary(c.model, target, self.path, self.config)
        self.kv_dtype = kv_dtype(dtype, c.kv_cache_dtype)
        self.runner = ModelRunner(self.model, c.block_size, c.device)
        self.block_size = c.block_size
        self.max_num_seqs = c.max_num_seqs
        self.max_num_batched_tokens = c.max_num_batched_tokens  # the most tokens one draft forward computes
        self.max_model_len = max_model_len
        self.kv: DraftKV | None = None

    def share_pool(self, target_blocks: int, planned: bool, target: ModelConfig) -> int:
        """Allocate the draft's pool beside the target's; returns the target's block count. The draft holds as
        many tokens as the target plus every running request's drafts. planned: target_blocks came from a byte
        budget (default or measured), which the two pools then split in proportion to their bytes per block;
        otherwise (--num-kv-blocks) the target keeps its count and the draft's pool comes on top."""
        if planned:
            mine = bytes_per_block(self.config, self.block_size, self.kv_dtype)
            theirs = bytes_per_block(target, self.block_size, self.kv_dtype)
            target_blocks = max(1, target_blocks * theirs // (theirs + mine))
        n = target_blocks + self.max_num_seqs * (-(-self.k // self.block_size) + 1)
        self.runner.allocate_kv_cache(n, self.kv_dtype)
        self.runner.warm_up()  # its K/V goes to draft block 0, free at start
        self.kv = DraftKV(n, self.block_size)
        log.info("draft model %s: %s, %d layers, %d KV blocks of its own", self.path, self.config.architecture,
                 self.config.num_layers, n)
        return target_blocks

    def use_decode_graphs(self, capture: bool = True, pool=None) -> None:  # noqa: ANN001 - a CUDA graph pool
        """The draft's one-token steps (every forward of a propose but the first) go through the decode-graph path
        (shared/engine/cuda_graphs.py): captured on CUDA, into the target's graph pool when given (the two never
        replay at once); capture=False runs the same padded path eagerly (tests)."""
        self.runner.use_decode_graphs(self.max_model_len + self.k, self.max_num_seqs, capture=capture, pool=pool)


def check_same_vocabulary(target_dir: str, target: ModelConfig, draft_dir: str, draft: ModelConfig) -> None:
    """Drafted ids are verified as the target's ids: both models must number tokens alike."""
    if draft.vocab_size != target.vocab_size:
        raise ConfigError(f"--speculative-config: the draft model's vocabulary has {draft.vocab_size} entries, the "
                          f"target's {target.vocab_size}: a draft model must use the target's tokenizer")
    from pathlib import Path

    from shared.models.model_source import resolve_model
    from shared.models.tokenizer import load_tokenizer

    dirs = [Path(resolve_model(target_dir)), Path(draft_dir)]
    if not all((d / "tokenizer.json").is_file() for d in dirs):
        log.warning("draft model: no tokenizer.json in %s to compare; trusting the equal vocabulary size",
                    " or ".join(str(d) for d in dirs if not (d / "tokenizer.json").is_file()))
        return
    a, b = (load_tokenizer(d).get_vocab() for d in dirs)
    if a != b:
        diff = sum(1 for t, i in a.items() if b.get(t) != i)
        raise ConfigError(f"--speculative-config: the draft model's tokenizer differs from the target's ({diff} "
                          f"tokens numbered differently): a draft model must use the target's tokenizer")


class DraftModelProposer:
    def __init__(self, draft: DraftModel, generator_for) -> None:  # noqa: ANN001 - Sampler.generator_for
        assert draft.kv is not None, "share_pool() first"
        self.draft = draft
        self.kv = draft.kv
        self.generator_for = generator_for

    @torch.inference_mode()
    def propose_batch(self, wants: list[tuple[Sequence, int]]) -> list[list[int]]:
        """Drafts of each (request, at most k), in one batch of k draft forwards; [] for a request whose drafts do
        not fit the draft's pool this step. Sets spec_draft_probs of sampled requests."""
        shadows = [self.kv.sync(seq, k - 1) for seq, k in wants]
        live = [(i, s) for i, s in enumerate(shadows) if s is not None]
        drafts: list[list[int]] = [[] for _ in wants]
        probs: list[list[torch.Tensor]] = [[] for _ in wants]
        self._catch_up([s for _, s in live])
        step = 0
        while live:
            plan = [(s, s.num_tokens - s.num_computed_tokens) for _, s in live]
            rows = list(accumulate(n for _, n in plan))
            # One token each (every forward but maybe the first): the draft's decode graphs where it has them.
            logits = self.draft.runner.execute(plan, [r - 1 for r in rows]).float()
            tokens = self._draw(logits, [wants[i][0] for i, _ in live], [probs[i] for i, _ in live])
            step += 1
            nxt = []
            for (i, s), t in zip(live, tokens):
                s.num_computed_tokens = s.num_tokens
                s.token_ids.append(t)
                drafts[i].append(t)
                if step < wants[i][1]:
                    nxt.append((i, s))
            live = nxt
        for (seq, _), q in zip(wants, probs):
            seq.spec_draft_probs = torch.stack(q) if q else None
        return drafts

    def _catch_up(self, shadows: list[Sequence]) -> None:
        """Draft KV of the contexts the draft has not seen (a new or readmitted request's whole prompt), in forwards
        of at most max_num_batched_tokens tokens, until the first drafting forward fits that budget: the draft's
        activations stay within what the memory profile measured (shared/engine/profile_run.profile_draft)."""
        budget = self.draft.max_num_batched_tokens
        while sum(s.num_tokens - s.num_computed_tokens for s in shadows) > max(budget, len(shadows)):
            plan, room = [], budget
            for s in shadows:
                n = min(s.num_tokens - s.num_computed_tokens - 1, room)  # the last token drafts: left for later
                if n > 0:
                    plan.append((s, n))
                    room -= n
                if room == 0:
                    break
            self.draft.runner.execute_rows(plan, [], [])
            for s, n in plan:
                s.num_computed_tokens += n

    def _draw(self, logits: torch.Tensor, seqs: list[Sequence], probs: list[list[torch.Tensor]]) -> list[int]:
        greedy = [s.params.greedy for s in seqs]
        out = logits.argmax(-1)
        if not all(greedy):
            sampled = [j for j, g in enumerate(greedy) if not g]
            q = sampling_probs(logits[sampled], [seqs[j].params for j in sampled])
            for row, j in enumerate(sampled):
                out[j] = torch.multinomial(q[row], 1, generator=self.generator_for(seqs[j]))[0]
                probs[j].append(q[row])
        return out.tolist()

    def propose(self, seq: Sequence, k: int) -> list[int]:
        return self.propose_batch([(seq, k)])[0]

    def finished(self, seq: Sequence) -> None:
        self.kv.release(seq.request_id)

    def release(self, request_id: str) -> None:
        self.kv.release(request_id)
