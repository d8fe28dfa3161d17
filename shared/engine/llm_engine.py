"""The engine core: requests in, a step = schedule, run the model, sample, scheduler.update_from_output.

Single-threaded; services call it from their compute thread (shared/engine/engine_thread.py, through
shared/engine/commands.py). What it composes, each the one owner of its concept: the scheduler (every
request's state, held ones included, and postprocessing), the model runner (the KV pool and decode
graphs), the sampler, the block manager, and the KV tiers below the device (shared/engine/kv_tiers.py).
"""
from __future__ import annotations

import threading
import time
from collections.abc import Callable
from collections.abc import Sequence as Seq

import torch
from shared.config import EngineConfig
from shared.engine.async_step import AsyncSteps
from shared.engine.block_manager import BlockManager
from shared.engine.engine_stats import EngineStats, engine_stats
from shared.engine.executor import ModelExecutor
from shared.engine.grammar import GrammarBackend
from shared.engine.kv_tiers import KVTiers
from shared.engine.lora_manager import LoRAManager, check_adapter_request
from shared.engine.offline import generate
from shared.engine.output_processor import OutputProcessor
from shared.engine.outputs import RequestOutput, TokenLogprobs
from shared.kv_blocks import KVBlocks
from shared.engine.scheduler import Reservation, Scheduler
from shared.engine.sequence import Sequence
from shared.engine.spec.speculator import Speculator
from shared.engine.step_metrics import CumulativeHistogram
from shared.engine.tp.launch import TPWorkers
from shared.prompt_check import check_prompt, check_token_ids
from shared.sampling_params import SamplingParams

__all__ = ["EngineStats", "LLMEngine", "Reservation"]


class LLMEngine:
    def __init__(self, config: EngineConfig, executor: Callable[[EngineConfig], ModelExecutor] = ModelExecutor) -> None:
        """executor builds what the engine computes with (shared/engine/executor.py): the real model by
        default, a simulated one for scale tests; everything else is built here, the same for both."""
        self.config = c = config
        self.executor = ex = executor(c)
        self.tp: TPWorkers | None = ex.tp
        # What an idle engine thread calls to learn that a rank died (raises TPRankError); None: one process.
        self.check_alive = self.tp.check_alive if self.tp is not None else None
        try:
            self._build(c, ex)
        except BaseException:
            self.shutdown()
            raise

    def _build(self, c: EngineConfig, ex: ModelExecutor) -> None:
        self.model, self.model_config, self.max_model_len = ex.model, ex.model_config, ex.max_model_len
        self.dtype, self.kv_dtype, self.num_blocks = ex.dtype, ex.kv_dtype, ex.num_blocks
        self.runner, self.sampler = ex.runner, ex.sampler
        self.block_manager = BlockManager(self.num_blocks, c.block_size, ex.block_root, c.enable_prefix_caching)
        # Host tier, offload queue and spills: every tier below the device pool has this one owner.
        self.tiers = KVTiers(self.block_manager, self.runner.gather_blocks, c.host_kv_bytes,
                             async_copies=ex.async_copies)
        outputs = OutputProcessor(c.block_size, self.max_model_len, self.sampler.stop_ids, self.runner.read_blocks)
        self.scheduler = Scheduler(self.block_manager, c.max_num_seqs, c.max_num_batched_tokens,
                                   c.long_prefill_token_threshold, outputs)
        self.lora: LoRAManager | None = getattr(ex, "lora", None)  # LoRA adapters (a simulated engine has none)
        self.scheduler.max_loras = self.lora.config.max_loras if self.lora is not None else 0
        self.iteration_tokens = CumulativeHistogram()
        spec = c.speculative_config
        self.speculator = Speculator(spec, self.max_model_len, ex.draft, self.sampler) if spec else None
        # Async scheduling (shared/engine/async_step.py): None when the config, a speculator or ranks rule it out.
        self.overlap = AsyncSteps(self.scheduler, self.runner, self.sampler, self.tiers, self.iteration_tokens.observe
                                  ) if ex.can_overlap else None
        self._grammar: GrammarBackend | None = None
        self._grammar_lock = threading.Lock()

    # --- requests -------------------------------------------------------------------------------

    def validate(self, prompt_token_ids: Seq[int], params: SamplingParams) -> None:
        """Raise ValueError for a request that can never run; nothing is queued."""
        self.executor.check(params)  # what the executor cannot compute is refused, never silently left out
        check_prompt(prompt_token_ids, self.model_config.vocab_size, self.max_model_len)
        check_token_ids(params.token_ids_named, self.model_config.vocab_size, "sampling parameters", "sampling")
        if params.structured is not None:
            self.grammar().compile(params.structured)  # a bad schema or grammar is the request's error
        need = self.block_manager.blocks_for(min(len(prompt_token_ids) + params.max_tokens, self.max_model_len))
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
        adapter = check_adapter_request(self.lora, params.lora_name)
        seq = Sequence(request_id, list(prompt_token_ids), params, priority, arrival_time)
        seq.lora = adapter
        if params.structured is not None:
            seq.matcher = self.grammar().matcher(params.structured)
        return seq

    def grammar(self) -> GrammarBackend:
        """The structured-output backend, built on the first structured request (xgrammar loads slowly). Also
        called from the compile thread (shared/engine/grammar_compile.py): built once under a lock."""
        with self._grammar_lock:
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
        if self.speculator is not None:
            self.speculator.release(request_id)
        return None if seq is None else OutputProcessor.output(seq, [])

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self.scheduler.held)

    def has_work(self) -> bool:
        """Whether step() would compute anything (held requests wait for KV, not for steps)."""
        return self.scheduler.has_unfinished()

    # --- the step -------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        if self.overlap is not None and (outs := self.overlap.step()) is not None:
            return outs  # scheduled and built the next step while this one computed
        if self.speculator is not None:
            self.speculator.propose(s for _, s in self.scheduler.running)
        plan = self.scheduler.schedule()
        with self.tiers.step_spills():
            return self.executor.run(self, plan)

    def generate(self, prompt_token_ids: list[list[int]], sampling_params: SamplingParams | list[SamplingParams],
                 use_tqdm: bool = True) -> list[RequestOutput]:
        return generate(self, prompt_token_ids, sampling_params, use_tqdm)

    def shutdown(self) -> None:
        """Stop the follower ranks of a tensor-parallel engine (nothing to do for one rank); idempotent."""
        self.executor.shutdown()

    # --- introspection --------------------------------------------------------------------------

    def stats(self) -> EngineStats:
        spec = self.speculator.stats if self.speculator else None
        # The verify-step counters only mean something when the engine speculates (a simulated engine's runner
        # has none).
        verify = self.runner.verify_stats if self.speculator else None
        return engine_stats(self.scheduler, self.block_manager, self.iteration_tokens, spec, verify)

    def check_integrity(self) -> None:
        live = self.scheduler.sequences()
        self.block_manager.check_integrity(live)
        assert set(self.scheduler.requests) == {s.request_id for s in live}
        if self.speculator is not None:
            self.speculator.check_integrity(set(self.scheduler.requests))

