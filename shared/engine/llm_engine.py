"""The engine core: requests in, a step = schedule, run the model, sample, scheduler.update_from_output.

Single-threaded; services call it from their compute thread (shared/engine/engine_thread.py, through
shared/engine/commands.py). What it composes, each the one owner of its concept: the scheduler (every
request's state, held ones included, and postprocessing), the model runner (the KV pool and decode
graphs), the sampler, the block manager, and the KV tiers below the device (shared/engine/kv_tiers.py).
"""
from __future__ import annotations

import logging
import time
from collections.abc import Sequence as Seq
from itertools import accumulate
from pathlib import Path

import torch
from tqdm import tqdm

from shared.block_hash import root_hash
from shared.config import EngineConfig
from shared.engine.block_manager import BlockManager
from shared.engine.cpu_compile import CompiledDecode, cpu_compile_enabled
from shared.engine.engine_stats import EngineStats, engine_stats
from shared.engine.grammar import GrammarBackend
from shared.engine.kv_cache import kv_dtype
from shared.engine.kv_pool_size import plan_num_blocks
from shared.engine.kv_tiers import KVTiers
from shared.engine.memory_budget import snapshot
from shared.engine.model_runner import ModelRunner
from shared.engine.output_processor import OutputProcessor
from shared.engine.outputs import RequestOutput, TokenLogprobs
from shared.kv_blocks import KVBlocks
from shared.engine.prompt_logprobs import prompt_logprob_rows, record_prompt_logprobs
from shared.engine.sampler import Sampler
from shared.engine.scheduler import Reservation, Scheduler, SchedulerOutput
from shared.engine.sequence import Sequence
from shared.engine.spec.speculator import Speculator
from shared.engine.spec.verify import verify
from shared.engine.step_metrics import CumulativeHistogram
from shared.engine.tp.launch import TPWorkers
from shared.models.loader import load_model
from shared.prompt_check import check_prompt, check_token_ids
from shared.sampling_params import SamplingParams

__all__ = ["EngineStats", "LLMEngine", "Reservation"]

log = logging.getLogger(__name__)


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = c = config
        # Taken before the weights load: the memory budget needs what was free before this worker.
        start = snapshot(c.device) if c.device.startswith("cuda") else None
        # Rank 0 of a tensor-parallel engine: start the follower ranks (a bad degree fails before any starts).
        self.tp: TPWorkers | None = self._start_tensor_parallel(c) if c.tensor_parallel_size > 1 else None
        # What an idle engine thread calls to learn that a rank died (raises TPRankError); None: one process.
        self.check_alive = self.tp.check_alive if self.tp is not None else None
        try:
            self._build(c, start)
        except BaseException:
            self.shutdown()
            raise

    @staticmethod
    def _start_tensor_parallel(c: EngineConfig) -> TPWorkers:
        from shared.models.model_config import load_model_config
        from shared.models.tp.degree import check_degree

        check_degree(load_model_config(c.model), c.tensor_parallel_size)
        if c.device.startswith("cuda"):
            from shared.engine.tp.launch import rank_device

            last = rank_device(c.device, c.tensor_parallel_size - 1)
            if int(last.split(":")[1]) >= torch.cuda.device_count():
                raise ValueError(f"tensor-parallel size {c.tensor_parallel_size} from {c.device} needs {last}, but "
                                 f"this machine has {torch.cuda.device_count()} CUDA device(s)")
        if c.device.startswith("cuda") and c.num_kv_blocks is None and c.kv_cache_bytes is None:
            raise ValueError("tensor parallelism on CUDA needs --num-kv-blocks or --kv-cache-bytes (the memory "
                             "profile does not run across ranks yet)")
        return TPWorkers(c)

    def _build(self, c: EngineConfig, start) -> None:  # noqa: ANN001 - a DeviceSnapshot or None
        self.model, self.model_config = load_model(c.model, dtype=c.dtype, device=c.device, load_format=c.load_format,
                                                   seed=c.seed, max_positions=c.max_model_len,
                                                   quantization=c.quantization, pack_weights=c.cpu_weight_packing,
                                                   tp=self.tp.group if self.tp else None)
        mc = self.model_config
        self.max_model_len = c.max_model_len or mc.max_position_embeddings
        self.dtype = next(self.model.parameters()).dtype
        self.kv_dtype = kv_dtype(self.dtype, c.kv_cache_dtype)
        if self.tp is None:
            self.runner = ModelRunner(self.model, c.block_size, c.device)
        else:
            from shared.engine.tp.driver_runner import TPDriverRunner

            self.runner = TPDriverRunner(self.model, c.block_size, c.device, self.tp)
        self.sampler = Sampler(mc.eos_token_ids, c.seed, c.device)
        self.num_blocks = plan_num_blocks(c, self.runner, self.sampler, self.kv_dtype, self.max_model_len, start)
        self.runner.allocate_kv_cache(self.num_blocks, self.kv_dtype)
        self.runner.warm_up()  # compiles every kernel variant before the engine serves (nothing to compile on CPU)
        if c.device.startswith("cuda") and not c.enforce_eager and self.tp is None:
            self.runner.use_decode_graphs(self.max_model_len, c.max_num_seqs)
        self.cpu_compile_seconds: list[tuple[int, float]] = []  # (bucket, seconds of its first step) at start
        compile_on, why = cpu_compile_enabled(c.cpu_compile, c.device, self.dtype, c.enforce_eager)
        if compile_on:
            graphs = self.runner.use_decode_graphs(self.max_model_len, c.max_num_seqs, capture=False,
                                                   forward=CompiledDecode(self.model))
            self.cpu_compile_seconds = graphs.warm_all()
            log.info("CPU decode compiled (%s) for batch buckets %s in %.1f s (per bucket: %s)", why, graphs.buckets,
                     sum(s for _, s in self.cpu_compile_seconds),
                     ", ".join(f"{b}: {s:.1f}" for b, s in self.cpu_compile_seconds))
        elif c.device == "cpu":
            log.info("CPU decode eager: %s", why)
        model_id = c.model_id or Path(c.model).resolve().name
        # The KV dtype is in the root so FP8 and model-dtype blocks never share a hash (or a kvstore entry).
        # Quantized weights compute different KV from the same dtype: their blocks hash apart too.
        kv_kind = str(self.kv_dtype).removeprefix("torch.") + (f"/weights-{c.quantization}" if c.quantization else "")
        root = root_hash(model_id, c.block_size, kv_kind, c.cache_salt)
        self.block_manager = BlockManager(self.num_blocks, c.block_size, root, c.enable_prefix_caching)
        # Host tier, offload queue and spills: every tier below the device pool has this one owner.
        self.tiers = KVTiers(self.block_manager, self.runner.gather_blocks, c.host_kv_bytes,
                             async_copies=c.device.startswith("cuda"))
        outputs = OutputProcessor(c.block_size, self.max_model_len, self.sampler.stop_ids, self.runner.read_blocks)
        self.scheduler = Scheduler(self.block_manager, c.max_num_seqs, c.max_num_batched_tokens,
                                   c.long_prefill_token_threshold, outputs)
        self.iteration_tokens = CumulativeHistogram()
        # Speculative decoding (shared/engine/spec/): drafts before scheduling, a verify inside the step.
        self.speculator = Speculator(c.speculative_config, self.max_model_len) if c.speculative_config else None
        self._grammar: GrammarBackend | None = None
        log.info("engine ready: %s, %d KV blocks of %d tokens, dtype %s, KV %s", mc.architecture, self.num_blocks,
                 c.block_size, self.dtype, self.kv_dtype)

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

    def reserve(self, request_id: str, prompt_token_ids: Seq[int], params: SamplingParams, priority: int = 0,
                arrival_time: float | None = None, capture_kv_from_block: int | None = None) -> Reservation | None:
        """Admit a request to wait for KV from elsewhere (a prefill worker, the kvstore) with blocks for its
        whole prompt: Scheduler.hold. None when the pool is too full now (the caller then falls back to
        add_request). Held requests wait for commit_held/release_held."""
        seq = self._new_sequence(request_id, prompt_token_ids, params, priority, arrival_time)
        res = self.scheduler.hold(seq)
        if res is not None:
            self._track(seq, capture_kv_from_block)
        return res

    def write_blocks(self, request_id: str, blocks: KVBlocks) -> None:
        """Write KV (its layer range) into a held request's logical blocks [first_block, end_block)."""
        self.tiers.spill()  # the blocks about to be written may be ones just given up by the cache
        seq = self.scheduler.held[request_id]
        if blocks.end_block > len(seq.block_table):
            raise ValueError(f"blocks [{blocks.first_block}, {blocks.end_block}) outside the "
                             f"{len(seq.block_table)} reserved")
        self.runner.write_blocks(seq.block_table[blocks.first_block : blocks.end_block], blocks.k, blocks.v,
                                 blocks.first_layer)

    def read_blocks(self, block_ids: Seq[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Copies of K and V of physical blocks: [layers, n, block_size, kv_heads, head_dim] each, on CPU."""
        return self.runner.read_blocks(block_ids)

    def commit_held(self, request_id: str, num_computed_tokens: int, first_token: int | None = None,
                    logprobs: TokenLogprobs | None = None) -> RequestOutput | None:
        """Hand a held request to the scheduler with KV for its first num_computed_tokens in place.

        With first_token (a remote prefill computed the whole prompt and sampled it), the token becomes
        the first output and the returned RequestOutput carries it.
        """
        seq = self.scheduler.commit(request_id, num_computed_tokens)
        if first_token is None:
            return None
        assert num_computed_tokens == seq.num_tokens, "a remote first token needs the whole prompt computed"
        # Keep seeded sampling identical to a local run: the prefill worker used the first draw.
        self.sampler.skip_draw(seq, self.model_config.vocab_size)
        return self.scheduler.append_token(seq, first_token, logprobs, time.time())

    def release_held(self, request_id: str) -> None:
        """Give up on KV from elsewhere: free the reserved blocks and queue the request to run locally."""
        self.scheduler.release(request_id)

    def is_held(self, request_id: str) -> bool:
        return request_id in self.scheduler.held

    def _new_sequence(self, request_id: str, prompt_token_ids: Seq[int], params: SamplingParams, priority: int,
                      arrival_time: float | None) -> Sequence:
        """A validated sequence the engine does not know yet (raises ValueError, changing nothing)."""
        if request_id in self.scheduler.requests:
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
        self.scheduler.requests[seq.request_id] = seq
        if capture_kv_from_block is not None:
            self.scheduler.outputs.capture_kv[seq.request_id] = capture_kv_from_block

    def abort(self, request_id: str) -> RequestOutput | None:
        seq = self.scheduler.abort(request_id)
        return None if seq is None else OutputProcessor.output(seq, [])

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self.scheduler.held)

    def has_work(self) -> bool:
        """Whether step() would compute anything (held requests wait for KV, not for steps)."""
        return self.scheduler.has_unfinished()

    # --- the step -------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        if self.speculator is not None:
            self.speculator.propose(s for _, s in self.scheduler.running)
        plan = self.scheduler.schedule()
        # Before the forward overwrites blocks this schedule took from the cache; they reach the tier at the end.
        self.tiers.spill(wait=False)
        try:
            return self._step(plan)
        finally:
            self.tiers.finish_spills()

    def _step(self, plan: SchedulerOutput) -> list[RequestOutput]:
        if plan.is_empty:
            return []
        now = time.time()
        self.iteration_tokens.observe(plan.num_batched_tokens)
        for seq, _ in plan.scheduled:
            if seq.first_scheduled_time is None:
                seq.first_scheduled_time = now
        # A sequence samples when this step brings its computed tokens up to all its tokens; one that verifies
        # k drafts computes k more than that and samples at each of its last k + 1 rows.
        sampling = [(i, s) for i, (s, n) in enumerate(plan.scheduled) if s.num_computed_tokens + n == s.num_tokens]
        last_row = [end - 1 for end in accumulate(n for _, n in plan.scheduled)]
        drafts = [(i, s, s.num_computed_tokens + n - s.num_tokens) for i, (s, n) in enumerate(plan.scheduled)
                  if s.num_computed_tokens + n > s.num_tokens]
        if drafts:
            return self._verify_step(plan, sampling, drafts, last_row)
        rows = [last_row[i] for i, _ in sampling]
        prompt_rows = prompt_logprob_rows(plan.scheduled, last_row)
        if prompt_rows:
            logits, hidden = self.runner.execute_rows(plan.scheduled, rows, [r for r, _, _ in prompt_rows])
            record_prompt_logprobs(self.runner.prompt_logits, hidden, prompt_rows)
        else:
            logits = self.runner.execute(plan.scheduled, rows)
        # On CUDA the forward is still running here: the grammar masks are filled on the host meanwhile.
        seqs = [s for _, s in sampling]
        matchers = [s.matcher if s.reasoning_over else None for s in seqs]  # none while a model still reasons
        bitmask = self.grammar().token_bitmask(matchers) if any(m is not None for m in matchers) else None
        samples = self.sampler.sample(logits, seqs, token_bitmask=bitmask) if rows else []
        sampled = [(seq, token, lp) for seq, (token, lp) in zip(seqs, samples)]
        outs = self.scheduler.update_from_output(plan, sampled, time.time())
        if self.speculator is not None:
            self._finished(seqs)
        return outs

    def _verify_step(self, plan: SchedulerOutput, sampling: list[tuple[int, Sequence]],
                     drafts: list[tuple[int, Sequence, int]], last_row: list[int]) -> list[RequestOutput]:
        """A step in which some sequences verify drafts: one forward over every row (the drafts go through the
        prompt/extend path, several query tokens a sequence), the normal sampler for the others' last rows,
        verify.py for each drafting sequence's k + 1 rows."""
        assert self.speculator is not None
        rows = [last_row[i] for i, _ in sampling]
        spec_rows = [r for i, _, k in drafts for r in range(last_row[i] - k, last_row[i] + 1)]
        prompt_rows = prompt_logprob_rows(plan.scheduled, last_row)
        logits, hidden = self.runner.execute_rows(plan.scheduled, rows + spec_rows, [r for r, _, _ in prompt_rows])
        if prompt_rows:
            record_prompt_logprobs(self.model.compute_logits, hidden, prompt_rows)
        seqs = [s for _, s in sampling]
        sampled = []
        if seqs:
            matchers = [s.matcher if s.reasoning_over else None for s in seqs]
            bitmask = self.grammar().token_bitmask(matchers) if any(m is not None for m in matchers) else None
            samples = self.sampler.sample(logits[: len(rows)], seqs, token_bitmask=bitmask)
            sampled = [(seq, token, lp) for seq, (token, lp) in zip(seqs, samples)]
        spec_seqs = [s for _, s, _ in drafts]
        ks = [k for _, _, k in drafts]
        kept = verify(self.sampler, logits[len(rows):], spec_seqs, ks)
        verified = []
        for seq, k, (tokens, lps) in zip(spec_seqs, ks, kept):
            self.speculator.verified(seq, k, len(tokens) - 1)
            verified.append((seq, tokens, lps))
        outs = self.scheduler.update_from_output(plan, sampled, time.time(), verified)
        self._finished(seqs + spec_seqs)
        return outs

    def _finished(self, seqs: list[Sequence]) -> None:
        """Finished outputs feed the proposer's worker-wide table (suffix decoding)."""
        assert self.speculator is not None
        for seq in seqs:
            if seq.is_finished:
                self.speculator.finished(seq)

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

    def shutdown(self) -> None:
        """Stop the follower ranks of a tensor-parallel engine (nothing to do for one rank); idempotent."""
        if self.tp is not None:
            self.tp.shutdown()

    # --- introspection --------------------------------------------------------------------------

    def stats(self) -> EngineStats:
        return engine_stats(self.scheduler, self.block_manager, self.iteration_tokens,
                            None if self.speculator is None else self.speculator.stats)

    def check_integrity(self) -> None:
        live = self.scheduler.sequences()
        self.block_manager.check_integrity(live)
        assert set(self.scheduler.requests) == {s.request_id for s in live}

