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
from shared.prompt_check import check_prompt, check_token_ids
from shared.config import EngineConfig
from shared.engine.block_manager import BlockManager
from shared.engine.grammar import GrammarBackend
from shared.engine.kv_tiers import KVTiers
from shared.engine.kv_cache import bytes_per_block, kv_dtype, num_blocks_for
from shared.engine.memory_budget import CUDA_GRAPH_RESERVE, DeviceSnapshot, MemoryProfile, plan_kv_pool, snapshot
from shared.engine.model_runner import ModelRunner
from shared.engine.profile_run import profile_run
from shared.engine.prompt_logprobs import prompt_logprob_rows, record_prompt_logprobs
from shared.engine.outputs import RequestOutput, TokenLogprobs
from shared.engine.sampler import Sampler
from shared.sampling_params import SamplingParams
from shared.engine.scheduler import Scheduler
from shared.engine.step_metrics import CumulativeHistogram
from shared.engine.sequence import Sequence, SequenceStatus
from shared.models.loader import load_model

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Reservation:
    num_cached_tokens: int  # prompt tokens already in this engine's prefix cache (whole blocks)
    block_hashes: list[bytes]  # hashes of the prompt's full blocks that may be fetched (never the last token's)
    num_blocks: int  # blocks reserved for the whole prompt


@dataclass(frozen=True)
class EngineStats:
    running: int
    waiting: int
    free_blocks: int
    total_blocks: int
    prefix_cache_hit_rate: float
    num_preemptions: int
    prefix_cache_queries: int = 0  # prompt tokens looked up in this engine's prefix cache (cumulative)
    prefix_cache_hits: int = 0  # of those, tokens found (cumulative)
    iteration_tokens: CumulativeHistogram | None = None  # tokens computed per step (cumulative)


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        # Taken before the weights load: the memory budget needs what was free before this worker.
        start = snapshot(config.device) if config.device.startswith("cuda") else None
        self.model, self.model_config = load_model(
            config.model, dtype=config.dtype, device=config.device, load_format=config.load_format,
            seed=config.seed, max_positions=config.max_model_len,
        )
        mc = self.model_config
        self.max_model_len = config.max_model_len or mc.max_position_embeddings
        self.dtype = next(self.model.parameters()).dtype
        self.kv_dtype = kv_dtype(self.dtype, config.kv_cache_dtype)
        self.runner = ModelRunner(self.model, config.block_size, config.device)
        self.sampler = Sampler(mc.eos_token_ids, config.seed, config.device)
        self.num_blocks = self._plan_num_blocks(start)
        self.runner.allocate_kv_cache(self.num_blocks, self.kv_dtype)
        self.runner.warm_up()  # compiles every kernel variant before the engine serves (nothing to compile on CPU)
        if config.device.startswith("cuda") and not config.enforce_eager:
            self.runner.use_decode_graphs(self.max_model_len, config.max_num_seqs)
        model_id = config.model_id or Path(config.model).resolve().name
        # The KV dtype is in the root so FP8 and model-dtype blocks never share a hash (or a kvstore entry).
        root = root_hash(model_id, config.block_size, str(self.kv_dtype).removeprefix("torch."), config.cache_salt)
        self.block_manager = BlockManager(self.num_blocks, config.block_size, root, config.enable_prefix_caching)
        # Host tier, offload queue and spills: every tier below the device pool has this one owner.
        self.tiers = KVTiers(self.block_manager, self.runner.gather_blocks, config.host_kv_bytes,
                             async_copies=config.device.startswith("cuda"))
        self.scheduler = Scheduler(self.block_manager, config.max_num_seqs, config.max_num_batched_tokens,
                                   config.long_prefill_token_threshold)
        self.seqs: dict[str, Sequence] = {}
        self.held: dict[str, Sequence] = {}  # reserved, waiting for KV from elsewhere
        self.capture_kv: dict[str, int] = {}
        self.iteration_tokens = CumulativeHistogram()
        self._grammar: GrammarBackend | None = None
        log.info("engine ready: %s, %d KV blocks of %d tokens, dtype %s, KV %s", mc.architecture, self.num_blocks,
                 config.block_size, self.dtype, self.kv_dtype)

    def _plan_num_blocks(self, start: DeviceSnapshot | None) -> int:
        """Explicit block count, else an explicit byte budget (or CPU's default), else the GPU memory budget."""
        c, mc = self.config, self.model_config
        if c.num_kv_blocks:
            return c.num_kv_blocks
        if start is None or c.kv_cache_bytes is not None:
            return num_blocks_for(mc, c.block_size, self.kv_dtype, c.kv_cache_bytes)
        device = torch.device(c.device)
        weights = torch.cuda.memory_allocated(device)
        peak = profile_run(self.runner, self.sampler, self.kv_dtype, c.max_num_batched_tokens, c.max_num_seqs,
                           self.max_model_len)
        now = snapshot(c.device)
        # Growth of device memory in use that torch's allocator does not account for (cuBLAS, NCCL, ...).
        non_torch = max(start.free_bytes - now.free_bytes - torch.cuda.memory_reserved(device), 0)
        profile = MemoryProfile(start.total_bytes, start.free_bytes, weights, peak, non_torch,
                                0 if c.enforce_eager else CUDA_GRAPH_RESERVE)
        plan = plan_kv_pool(profile, c.gpu_memory_utilization, bytes_per_block(mc, c.block_size, self.kv_dtype),
                            -(-self.max_model_len // c.block_size))
        log.info("memory: %s", plan.describe(profile))
        return plan.num_blocks

    # --- requests -------------------------------------------------------------------------------

    def validate(self, prompt_token_ids: Seq[int], params: SamplingParams) -> None:
        """Raise ValueError for a request that can never run; nothing is queued."""
        n = len(prompt_token_ids)
        vocab = self.model_config.vocab_size
        check_prompt(prompt_token_ids, vocab, self.max_model_len)
        check_token_ids(params.token_ids_named, vocab, "sampling parameters", "sampling")
        if params.structured is not None:
            self.grammar().compile(params.structured)  # a bad schema or grammar is the request's error
        need = self.block_manager.blocks_for(min(n + params.max_tokens, self.max_model_len))
        if need > self.num_blocks:
            raise ValueError(f"request needs {need} KV blocks but the pool has {self.num_blocks}")

    def add_request(self, request_id: str, prompt_token_ids: Seq[int], params: SamplingParams, priority: int = 0,
                    arrival_time: float | None = None, capture_kv_from_block: int | None = None) -> None:
        """Queue a request. capture_kv_from_block: its RequestOutputs' kv_blocks hold the K/V of its
        prompt's logical blocks from that index on (what a prefill worker pushes): the blocks a chunk
        completed with each unfinished output, the rest with the finished one."""
        seq = self._new_sequence(request_id, prompt_token_ids, params, priority, arrival_time)
        self._track(seq, capture_kv_from_block)
        self.scheduler.add(seq)

    # --- KV that arrives from elsewhere (kvstore, a prefill worker) ---------------------------------

    def reserve(self, request_id: str, prompt_token_ids: Seq[int], params: SamplingParams, priority: int = 0,
                arrival_time: float | None = None, capture_kv_from_block: int | None = None) -> Reservation | None:
        """Admit a request without scheduling it: match the prefix cache and allocate blocks for the
        whole prompt, so KV computed elsewhere can be written in. None when the pool is too full now
        (the caller then falls back to add_request). Held sequences wait for commit_held/release_held.
        """
        seq = self._new_sequence(request_id, prompt_token_ids, params, priority, arrival_time)
        computed = self.block_manager.get_computed_blocks(seq)
        if not self.block_manager.allocate(seq, seq.num_tokens - len(computed) * self.config.block_size, computed):
            return None
        self._track(seq, capture_kv_from_block)
        self.held[request_id] = seq
        bs = self.config.block_size
        return Reservation(seq.num_computed_tokens, list(seq.block_hashes[: (seq.num_tokens - 1) // bs]),
                           len(seq.block_table))

    def write_blocks(self, request_id: str, first_block: int, k: torch.Tensor, v: torch.Tensor,
                     first_layer: int = 0) -> None:
        """Write K/V ([layers, n, block_size, kv_heads, head_dim], layers from first_layer on) into a held
        request's logical blocks."""
        self.tiers.spill()  # the blocks about to be written may be ones just given up by the cache
        seq = self.held[request_id]
        n = k.shape[1]
        if first_block < 0 or first_block + n > len(seq.block_table):
            raise ValueError(f"blocks [{first_block}, {first_block + n}) outside the {len(seq.block_table)} reserved")
        self.runner.write_blocks(seq.block_table[first_block : first_block + n], k, v, first_layer)

    def read_blocks(self, block_ids: Seq[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Copies of K and V of physical blocks: [layers, n, block_size, kv_heads, head_dim] each, on CPU."""
        return self.runner.read_blocks(block_ids)

    def read_request_blocks(self, request_id: str, first_block: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K/V of a live request's logical blocks from first_block to its last (partial) prompt block."""
        seq = self.seqs[request_id]
        last = self.block_manager.blocks_for(seq.num_prompt_tokens)
        return self.read_blocks(seq.block_table[first_block:last])

    def commit_held(self, request_id: str, num_computed_tokens: int, first_token: int | None = None,
                    logprobs: TokenLogprobs | None = None) -> RequestOutput | None:
        """Hand a held request to the scheduler with KV for its first num_computed_tokens in place.

        With first_token (a remote prefill computed the whole prompt and sampled it), the token becomes
        the first output and the returned RequestOutput carries it.
        """
        seq = self.held.pop(request_id)
        assert num_computed_tokens <= seq.num_tokens
        seq.num_computed_tokens = num_computed_tokens
        self.block_manager.cache_full_blocks(seq)
        seq.status = SequenceStatus.RUNNING
        self.scheduler.add_running(seq)
        if first_token is None:
            return None
        assert num_computed_tokens == seq.num_tokens, "a remote first token needs the whole prompt computed"
        # Keep seeded sampling identical to a local run: the prefill worker used the first draw.
        self.sampler.skip_draw(seq, self.model_config.vocab_size)
        return self._append_token(seq, first_token, logprobs, time.time())

    def release_held(self, request_id: str) -> None:
        """Give up on KV from elsewhere: free the reserved blocks and queue the request to run locally."""
        seq = self.held.pop(request_id)
        self.block_manager.free_blocks(seq)
        self.scheduler.add(seq)

    def _new_sequence(self, request_id: str, prompt_token_ids: Seq[int], params: SamplingParams, priority: int,
                      arrival_time: float | None) -> Sequence:
        """A validated sequence the engine does not know yet (raises ValueError, changing nothing)."""
        if request_id in self.seqs:
            raise ValueError(f"request id {request_id!r} is already in use")
        self.validate(prompt_token_ids, params)
        seq = Sequence(request_id, list(prompt_token_ids), params, priority, arrival_time)
        if params.structured is not None:
            seq.matcher = self.grammar().matcher(params.structured)
        return seq

    def grammar(self) -> GrammarBackend:
        """The structured-output backend, built on the first structured request (xgrammar loads slowly)."""
        if self._grammar is None:
            self._grammar = GrammarBackend(self.config.model, self.model_config.vocab_size,
                                           self.model_config.eos_token_ids)
        return self._grammar

    def _track(self, seq: Sequence, capture_kv_from_block: int | None) -> None:
        self.seqs[seq.request_id] = seq
        if capture_kv_from_block is not None:
            self.capture_kv[seq.request_id] = capture_kv_from_block

    def abort(self, request_id: str) -> RequestOutput | None:
        seq = self.seqs.pop(request_id, None)
        if seq is None:
            return None
        if self.held.pop(request_id, None) is not None:
            self.block_manager.free_blocks(seq)
        self.scheduler.finish(seq)
        self.capture_kv.pop(request_id, None)
        seq.finish_reason = "abort"
        seq.finished_time = time.time()
        return self._output(seq, [])

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self.held)

    def has_work(self) -> bool:
        """Whether step() would compute anything (held requests wait for KV, not for steps)."""
        return self.scheduler.has_unfinished()

    # --- the step -------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        plan = self.scheduler.schedule()
        # Before the forward overwrites blocks this schedule took from the cache; they reach the tier at the end.
        self.tiers.spill(wait=False)
        try:
            return self._step(plan)
        finally:
            self.tiers.finish_spills()

    def _step(self, plan) -> list[RequestOutput]:
        if plan.is_empty:
            return []
        step_start = time.time()
        self.iteration_tokens.observe(plan.num_batched_tokens)
        for seq, _ in plan.scheduled:
            if seq.first_scheduled_time is None:
                seq.first_scheduled_time = step_start
        # A sequence samples when this step brings its computed tokens up to all its tokens.
        sampling = [(i, s) for i, (s, n) in enumerate(plan.scheduled) if s.num_computed_tokens + n == s.num_tokens]
        last_row, end = [], 0
        for _, n in plan.scheduled:
            end += n
            last_row.append(end - 1)
        rows = [last_row[i] for i, _ in sampling]
        prompt_rows = prompt_logprob_rows(plan.scheduled, last_row)
        if prompt_rows:
            logits, hidden = self.runner.execute_rows(plan.scheduled, rows, [r for r, _, _ in prompt_rows])
            record_prompt_logprobs(self.model.compute_logits, hidden, prompt_rows)
        else:
            logits = self.runner.execute(plan.scheduled, rows)
        # On CUDA the forward is still running here: the grammar masks are filled on the host meanwhile.
        bitmask = self._token_bitmask([s for _, s in sampling])
        for seq, n in plan.scheduled:
            seq.num_computed_tokens += n
            self.block_manager.cache_full_blocks(seq)
        pieces = self._captured_pieces(plan.scheduled)
        if not rows:
            return pieces
        now = time.time()
        samples = self.sampler.sample(logits, [s for _, s in sampling], token_bitmask=bitmask)
        return pieces + [self._append_token(seq, token, lp, now) for (_, seq), (token, lp) in zip(sampling, samples)]

    def _captured_pieces(self, scheduled: list[tuple[Sequence, int]]) -> list[RequestOutput]:
        """For prefill-only requests still computing their prompt: the K/V of the blocks this step
        completed, as an unfinished output, so they travel while the next chunk computes (the rest,
        the last partial block included, comes with the finished output of the step that samples)."""
        pieces = []
        for seq, _ in scheduled:
            start = self.capture_kv.get(seq.request_id)
            if start is None or seq.num_computed_tokens == seq.num_tokens:  # sampling now: finishes below
                continue
            done = seq.num_computed_tokens // self.config.block_size
            if done <= start:
                continue
            out = self._output(seq, [])
            out.kv_blocks = self.read_blocks(seq.block_table[start:done])
            out.kv_first_block = start
            self.capture_kv[seq.request_id] = done
            pieces.append(out)
        return pieces

    def _token_bitmask(self, seqs: list[Sequence]) -> torch.Tensor | None:
        rows = [(i, s.matcher) for i, s in enumerate(seqs) if s.matcher is not None]
        if not rows:
            return None
        mask = self.grammar().allocate(len(seqs))
        for i, matcher in rows:
            matcher.fill_next_token_bitmask(mask, i)
        return mask

    def _append_token(self, seq: Sequence, token: int, lp: TokenLogprobs | None, now: float) -> RequestOutput:
        seq.token_ids.append(token)
        if seq.matcher is not None and not seq.matcher.is_terminated():
            seq.matcher.accept_token(token)
        if lp is not None:
            seq.logprobs.append(lp)
        if seq.first_token_time is None:
            seq.first_token_time = now
        reason = self._finish_reason(seq, token)
        kv = None
        if reason is not None:
            if seq.request_id in self.capture_kv:
                # Prefill-only requests hand their prompt KV out before the blocks are freed.
                kv_first_block = self.capture_kv.pop(seq.request_id)
                kv = self.read_request_blocks(seq.request_id, kv_first_block)
            seq.finish_reason = reason
            seq.finished_time = now
            self.scheduler.finish(seq)
            del self.seqs[seq.request_id]
        out = self._output(seq, [token])
        if kv is not None:
            out.kv_blocks, out.kv_first_block = kv, kv_first_block
        return out

    def _finish_reason(self, seq: Sequence, token: int) -> str | None:
        p = seq.params
        if seq.matcher is not None and seq.matcher.is_terminated():
            return "stop"  # the grammar is complete (it accepted a stop token)
        if seq.num_output_tokens >= p.min_tokens and token in self.sampler.stop_ids(seq):
            return "stop"
        if seq.num_output_tokens >= p.max_tokens or seq.num_tokens >= self.max_model_len:
            return "length"
        return None

    def _output(self, seq: Sequence, new: list[int]) -> RequestOutput:
        """A finished output carries everything; a streamed one only what a stream sends (its new tokens and
        their logprobs, the prompt logprobs with the first token): copying each sequence's prompt and output
        on every token was most of a decode step's host time at batch 128 and 4k-token prompts."""
        done = seq.is_finished
        first = bool(new) and seq.num_output_tokens == len(new)
        logprobs = None
        if seq.params.logprobs is not None:
            logprobs = list(seq.logprobs) if done else (seq.logprobs[-len(new):] if new else [])
        prompt_logprobs = None
        if seq.params.prompt_logprobs is not None and (done or first):
            prompt_logprobs = list(seq.prompt_logprobs) or [None]
        return RequestOutput(
            request_id=seq.request_id,
            prompt_token_ids=seq.prompt_token_ids if done else [],
            output_token_ids=seq.output_token_ids if done else [],
            new_token_ids=new,
            finished=done,
            finish_reason=seq.finish_reason,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            num_cached_tokens=seq.num_cached_tokens,
            arrival_time=seq.arrival_time,
            first_scheduled_time=seq.first_scheduled_time,
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
            waiting=self.scheduler.num_waiting + len(self.held),
            free_blocks=bm.num_free_blocks,
            total_blocks=bm.num_blocks,
            prefix_cache_hit_rate=bm.hits / bm.queries if bm.queries else 0.0,
            num_preemptions=self.scheduler.num_preemptions,
            prefix_cache_queries=bm.queries,
            prefix_cache_hits=bm.hits,
            iteration_tokens=CumulativeHistogram(self.iteration_tokens.buckets, list(self.iteration_tokens.counts),
                                                 self.iteration_tokens.total),
        )

    def check_integrity(self) -> None:
        live = self.scheduler.sequences() + list(self.held.values())
        self.block_manager.check_integrity(live)
        assert set(self.seqs) == {s.request_id for s in live}
