"""The engine loop: schedule, run, postprocess. Single-threaded; services call it from their compute thread."""
from __future__ import annotations

import logging
import time
from collections.abc import Sequence as Seq
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from shared.block_hash import root_hash
from shared.config import EngineConfig
from shared.engine.block_manager import BlockManager
from shared.engine.kv_cache import allocate_kv_cache, num_blocks_for
from shared.engine.model_runner import ModelRunner
from shared.engine.outputs import RequestOutput
from shared.engine.sampler import Sampler
from shared.engine.sampling_params import SamplingParams
from shared.engine.scheduler import Scheduler
from shared.engine.sequence import Sequence
from shared.models.loader import load_model

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class EngineStats:
    running: int
    waiting: int
    free_blocks: int
    total_blocks: int
    prefix_cache_hit_rate: float
    num_preemptions: int


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.model, self.model_config = load_model(
            config.model, dtype=config.dtype, device=config.device, load_format=config.load_format,
            seed=config.seed, max_positions=config.max_model_len,
        )
        mc = self.model_config
        self.max_model_len = config.max_model_len or mc.max_position_embeddings
        self.dtype = next(self.model.parameters()).dtype
        self.num_blocks = config.num_kv_blocks or num_blocks_for(
            mc, config.block_size, self.dtype, config.device, config.kv_cache_bytes, config.gpu_memory_utilization
        )
        kv = allocate_kv_cache(mc, self.num_blocks, config.block_size, self.dtype, config.device)
        model_id = config.model_id or Path(config.model).resolve().name
        root = root_hash(model_id, config.block_size, str(self.dtype).removeprefix("torch."), config.cache_salt)
        self.block_manager = BlockManager(self.num_blocks, config.block_size, root, config.enable_prefix_caching)
        self.scheduler = Scheduler(self.block_manager, config.max_num_seqs, config.max_num_batched_tokens)
        self.runner = ModelRunner(self.model, kv, config.block_size, config.device)
        self.sampler = Sampler(mc.eos_token_ids, config.seed)
        self.seqs: dict[str, Sequence] = {}
        log.info("engine ready: %s, %d KV blocks of %d tokens, dtype %s", mc.architecture, self.num_blocks,
                 config.block_size, self.dtype)

    # --- requests -------------------------------------------------------------------------------

    def validate(self, prompt_token_ids: Seq[int], params: SamplingParams) -> None:
        """Raise ValueError for a request that can never run; nothing is queued."""
        n = len(prompt_token_ids)
        if n == 0:
            raise ValueError("prompt must contain at least one token")
        vocab = self.model_config.vocab_size
        bad = next((t for t in prompt_token_ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise ValueError(f"token id {bad} is outside the vocabulary [0, {vocab})")
        if n >= self.max_model_len:
            raise ValueError(f"prompt has {n} tokens; the model's context is {self.max_model_len} tokens")
        need = self.block_manager.blocks_for(min(n + params.max_tokens, self.max_model_len))
        if need > self.num_blocks:
            raise ValueError(f"request needs {need} KV blocks but the pool has {self.num_blocks}")

    def add_request(self, request_id: str, prompt_token_ids: Seq[int], params: SamplingParams, priority: int = 0,
                    arrival_time: float | None = None) -> None:
        if request_id in self.seqs:
            raise ValueError(f"request id {request_id!r} is already in use")
        self.validate(prompt_token_ids, params)
        seq = Sequence(request_id, list(prompt_token_ids), params, priority, arrival_time)
        self.seqs[request_id] = seq
        self.scheduler.add(seq)

    def abort(self, request_id: str) -> RequestOutput | None:
        seq = self.seqs.pop(request_id, None)
        if seq is None:
            return None
        self.scheduler.finish(seq)
        seq.finish_reason = "abort"
        seq.finished_time = time.time()
        return self._output(seq, [])

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    # --- the step -------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        plan = self.scheduler.schedule()
        if plan.is_empty:
            return []
        # A sequence samples when this step brings its computed tokens up to all its tokens.
        sampling = [(i, s) for i, (s, n) in enumerate(plan.scheduled) if s.num_computed_tokens + n == s.num_tokens]
        last_row, end = [], 0
        for _, n in plan.scheduled:
            end += n
            last_row.append(end - 1)
        rows = [last_row[i] for i, _ in sampling]
        logits = self.runner.execute(plan.scheduled, rows)
        for seq, n in plan.scheduled:
            seq.num_computed_tokens += n
            self.block_manager.cache_full_blocks(seq)
        if not rows:
            return []
        now = time.time()
        outputs = []
        for (_, seq), (token, lp) in zip(sampling, self.sampler.sample(logits, [s for _, s in sampling])):
            seq.token_ids.append(token)
            if lp is not None:
                seq.logprobs.append(lp)
            if seq.first_token_time is None:
                seq.first_token_time = now
            reason = self._finish_reason(seq, token)
            if reason is not None:
                seq.finish_reason = reason
                seq.finished_time = now
                self.scheduler.finish(seq)
                del self.seqs[seq.request_id]
            outputs.append(self._output(seq, [token]))
        return outputs

    def _finish_reason(self, seq: Sequence, token: int) -> str | None:
        p = seq.params
        if seq.num_output_tokens >= p.min_tokens and token in self.sampler.stop_ids(seq):
            return "stop"
        if seq.num_output_tokens >= p.max_tokens or seq.num_tokens >= self.max_model_len:
            return "length"
        return None

    def _output(self, seq: Sequence, new: list[int]) -> RequestOutput:
        return RequestOutput(
            request_id=seq.request_id,
            prompt_token_ids=seq.prompt_token_ids,
            output_token_ids=seq.output_token_ids,
            new_token_ids=new,
            finished=seq.is_finished,
            finish_reason=seq.finish_reason,
            logprobs=list(seq.logprobs) if seq.params.logprobs is not None else None,
            num_cached_tokens=seq.num_cached_tokens,
            arrival_time=seq.arrival_time,
            first_token_time=seq.first_token_time,
            finished_time=seq.finished_time,
        )

    # --- offline --------------------------------------------------------------------------------

    def generate(self, prompt_token_ids: list[list[int]], sampling_params: SamplingParams | list[SamplingParams],
                 use_tqdm: bool = True) -> list[RequestOutput]:
        params = sampling_params if isinstance(sampling_params, list) else [sampling_params] * len(prompt_token_ids)
        assert len(params) == len(prompt_token_ids), "one SamplingParams per prompt"
        ids = [f"offline-{time.monotonic_ns()}-{i}" for i in range(len(prompt_token_ids))]
        for rid, prompt, p in zip(ids, prompt_token_ids, params):
            self.add_request(rid, prompt, p)
        done: dict[str, RequestOutput] = {}
        with tqdm(total=len(ids), desc="generate", unit="req", disable=not use_tqdm) as bar:
            while self.has_unfinished_requests():
                for out in self.step():
                    if out.finished:
                        done[out.request_id] = out
                        bar.update(1)
        return [done[rid] for rid in ids]

    # --- introspection --------------------------------------------------------------------------

    def stats(self) -> EngineStats:
        bm = self.block_manager
        return EngineStats(
            running=self.scheduler.num_running,
            waiting=self.scheduler.num_waiting,
            free_blocks=bm.num_free_blocks,
            total_blocks=bm.num_blocks,
            prefix_cache_hit_rate=bm.hits / bm.queries if bm.queries else 0.0,
            num_preemptions=self.scheduler.num_preemptions,
        )

    def check_integrity(self) -> None:
        self.block_manager.check_integrity(self.scheduler.sequences())
        assert set(self.seqs) == {s.request_id for s in self.scheduler.sequences()}
