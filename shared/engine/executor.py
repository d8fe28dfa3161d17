"""What an engine computes with: the model, its runner and KV pool, the sampler, and the step's forward.

This is the one piece that differs between the real engine and the simulated one
(shared/engine/sim_engine.py), so LLMEngine takes it as an argument, the way vLLM's
EngineCore(config, executor_class) does, and builds the rest (scheduler, block manager, KV tiers) itself:
the simulated engine goes through the same constructor rather than rebuilding it.

An executor provides, once built: model (None when no weights load), model_config, max_model_len, dtype,
kv_dtype, runner, sampler, num_blocks, block_root (the block hashes' seed), draft (a draft model or None),
tp (the follower ranks or None), async_copies and can_overlap; and the methods check, run and shutdown.
"""
from __future__ import annotations

import logging

from shared.config import EngineConfig
from shared.engine.async_step import async_wanted
from shared.engine.cpu_compile import compile_cpu_decode
from shared.engine.cuda_device import use_device
from shared.engine.kv_cache import engine_root, kv_dtype
from shared.engine.kv_pool_size import plan_num_blocks
from shared.engine.lora_manager import LoRAManager
from shared.engine.memory_budget import snapshot
from shared.engine.outputs import RequestOutput
from shared.engine.sampler import Sampler
from shared.engine.scheduler import SchedulerOutput
from shared.engine.spec.draft_model import DraftModel
from shared.engine.startup_graphs import capture_graphs
from shared.engine.step_parts import StepParts
from shared.engine.sync_step import run_plan
from shared.engine.tp.driver_runner import runner_for
from shared.engine.tp.launch import COMPUTE_FOLLOWER, TPWorkers, start_tensor_parallel
from shared.models.loader import load_model
from shared.sampling_params import SamplingParams


log = logging.getLogger(__name__)


class ModelExecutor:
    """The real model: loads the weights (after starting the follower ranks of a tensor-parallel engine),
    sizes and allocates the KV pool, compiles and captures what the device runs."""

    def __init__(self, config: EngineConfig, follower_main: str = COMPUTE_FOLLOWER) -> None:
        """follower_main: the module a tensor-parallel engine's follower ranks run (shared/engine/tp/launch.py)."""
        c = config
        use_device(c.device)  # this thread's current device: Triton launches and new streams go there
        # Taken before the weights load: the memory budget needs what was free before this worker.
        start = snapshot(c.device) if c.device.startswith("cuda") else None
        # Rank 0 of a tensor-parallel engine: start the follower ranks (a bad degree fails before any starts).
        self.tp: TPWorkers | None = start_tensor_parallel(c, follower_main) if c.tensor_parallel_size > 1 else None
        try:
            self._build(c, start)
        except BaseException:
            self.shutdown()
            raise

    def _build(self, c: EngineConfig, start) -> None:  # noqa: ANN001 - a DeviceSnapshot or None
        self.model, self.model_config = load_model(c.model, dtype=c.dtype, device=c.device, load_format=c.load_format,
                                                   seed=c.seed, max_positions=c.max_model_len,
                                                   quantization=c.quantization, pack_weights=c.cpu_weight_packing,
                                                   tp=self.tp.group if self.tp else None)
        mc = self.model_config
        self.max_model_len = c.max_model_len or mc.max_position_embeddings
        self.dtype = next(self.model.parameters()).dtype
        self.kv_dtype = kv_dtype(self.dtype, c.kv_cache_dtype)
        self.runner = runner_for(self.model, c.block_size, c.device, self.tp)
        self.sampler = Sampler(mc.eos_token_ids, c.seed, c.device)
        # LoRA slots before the KV pool is sized: the memory plan sees them as the model's.
        self.lora = self.runner.lora = LoRAManager(c.lora, self.model, c.device) if c.lora is not None else None
        spec = c.speculative_config  # a draft model loads before the pool is sized: its weights and KV take a share
        draft = DraftModel(c, mc, self.dtype, self.max_model_len) if spec and spec.method == "draft_model" else None
        self.draft = draft
        self.num_blocks = plan_num_blocks(c, self.runner, self.sampler, self.kv_dtype, self.max_model_len, start, draft)
        if draft is not None:
            self.num_blocks = draft.share_pool(self.num_blocks, c.num_kv_blocks is None, mc)
        self.runner.allocate_kv_cache(self.num_blocks, self.kv_dtype)
        self.runner.warm_up()  # compiles every kernel variant before the engine serves (nothing to compile on CPU)
        if self.lora is not None:
            self.lora.warm_up()
        if c.device.startswith("cuda") and not c.enforce_eager:
            capture_graphs(self.runner, c, self.max_model_len, draft, self.tp is None)
        # (bucket, seconds of its first step) of the CPU decode graphs compiled at start; [] when eager.
        self.cpu_compile_seconds = compile_cpu_decode(self.runner, self.model, c, self.dtype, self.max_model_len)
        self.block_root = engine_root(c, self.kv_dtype)
        self.async_copies = c.device.startswith("cuda")  # tier copies on a side stream
        self.can_overlap = async_wanted(c)  # shared/engine/async_step.py decides what rules it out
        log.info("engine ready: %s, %d KV blocks of %d tokens, dtype %s, KV %s", mc.architecture, self.num_blocks,
                 c.block_size, self.dtype, self.kv_dtype)

    def check(self, params: SamplingParams) -> None:
        """Raise ValueError for parameters this executor cannot honour: the real model honours all."""

    def run(self, engine: StepParts, plan: SchedulerOutput) -> list[RequestOutput]:
        """The step's forward, sampling and verification; the scheduler's update ends it."""
        return run_plan(engine, plan)

    def shutdown(self) -> None:
        """Stop the follower ranks of a tensor-parallel engine (nothing to do for one rank); idempotent."""
        if self.tp is not None:
            self.tp.shutdown()
