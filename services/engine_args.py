"""Engine flags shared by the decode and prefill services."""
from __future__ import annotations

import argparse
import logging
import os

from shared.config import EngineConfig
from shared.engine.cpu_threads import apply_plan, plan_for_this_process
from shared.engine.lora_config import add_lora_arguments, lora_config_from_args
from shared.spec_config import SpeculativeConfig


# A prefill worker's chunk: its KV goes out while the next chunk computes, so the decode worker waits
# for one chunk's transfer instead of the whole prompt's (shared/kv_transport/outgoing.py): on the CPU bench
# model ~10 ms of waiting after a 2,048-token prompt's last chunk against ~33 ms for the whole prompt's KV.
PREFILL_CHUNK_TOKENS = 1024
log = logging.getLogger(__name__)


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=os.environ.get("KVMESH_MODEL"), required="KVMESH_MODEL" not in os.environ,
                        help="Hugging Face checkpoint directory (env KVMESH_MODEL)")
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    parser.add_argument("--device", default="auto")
    parser.add_argument("--load-format", default="auto", choices=["auto", "dummy"])
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--kv-cache-bytes", type=int, default=None)
    parser.add_argument("--offload-policy", choices=["eviction", "write-through"],
                        default=os.environ.get("KVMESH_OFFLOAD_POLICY", "eviction"),
                        help="when KV blocks go to the kvstore: as they are evicted (and shared prefixes at "
                             "once; default), or every new block right away (write-through)")
    parser.add_argument("--host-kv-bytes", type=int, default=int(os.environ.get("KVMESH_HOST_KV_BYTES", 0)),
                        help="host memory for KV blocks evicted from the device pool, loaded back without the "
                             "network (0: no host tier; env KVMESH_HOST_KV_BYTES)")
    parser.add_argument("--gpu-memory-utilization", type=float,
                        default=float(os.environ.get("KVMESH_GPU_MEMORY_UTILIZATION", 0.9)),
                        help="fraction of the GPU's total memory this worker may use (weights, activations, KV); "
                             "env KVMESH_GPU_MEMORY_UTILIZATION")
    parser.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8"],
                        help="fp8: KV cache in float8_e4m3fn with a per-tensor scale (half the memory of bf16)")
    parser.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs for decode steps")
    parser.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                        help="schedule and build the next step while the current one computes (default: on for "
                             "CUDA devices, off on CPU); steps with structured outputs, penalties, bad words, prompt "
                             "logprobs or speculative decoding stay synchronous")
    parser.add_argument("--num-kv-blocks", type=int, default=None)
    parser.add_argument("--max-num-seqs", type=int, default=128)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--long-prefill-token-threshold", type=int, default=None,
                        help="at most this many prompt tokens of one request per step (0: no cap); a prefill "
                             "worker pushes each chunk's KV while the next computes (default: 0, prefill "
                             "workers %d)" % PREFILL_CHUNK_TOKENS)
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--quantization", default="auto",
                        choices=["auto", "none", "gguf", "gguf-hybrid", "int8", "int4", "fp8", "awq", "gptq"],
                        help="quantized linear layers. GPU (CPU through the reference path): fp8 (W8A8, sm_89+; an "
                             "FP8 checkpoint as published, or a bf16 one quantized at load), awq / gptq (4-bit "
                             "checkpoints). CPU weight-only: gguf (a GGUF's Q4_0/Q4_1/Q8_0 weights as stored), "
                             "gguf-hybrid (the same for steps of <= 4 rows, a bf16 copy above), int8 (per row), int4 "
                             "(groups of 32), none; auto (default): the checkpoint's quantization_config, gguf-hybrid "
                             "for a GGUF model served in bf16 on CPU, else none")
    parser.add_argument("--no-cpu-weight-packing", dest="cpu_weight_packing", action="store_false",
                        help="bf16 on CPU: plain F.linear instead of oneDNN pre-packed weights or the C++ AVX512-BF16 "
                             "matmul (KVMESH_CPU_BF16_LINEAR chooses between those two; slower)")
    parser.add_argument("--speculative-config", default=os.environ.get("KVMESH_SPECULATIVE_CONFIG"), metavar="JSON",
                        help='speculative decoding as vLLM\'s JSON, e.g. {"method": "ngram", "num_speculative_tokens": 4, '
                             '"prompt_lookup_min": 2, "prompt_lookup_max": 4} or {"method": "suffix"} '
                             'or {"method": "draft_model", "model": DIR, "num_speculative_tokens": 4} '
                             '(env KVMESH_SPECULATIVE_CONFIG)')
    parser.add_argument("--cpu-compile", default=os.environ.get("KVMESH_CPU_COMPILE", "off"),
                        choices=["auto", "on", "whole", "off"],
                        help="decode steps on CPU through torch.compile (inductor C++), batch sizes bucketed and "
                             "compiled at start (~20 s a graph, two graphs): auto = when serving bfloat16 on CPU; "
                             "default off (not faster than eager as measured so far; env KVMESH_CPU_COMPILE)")
    parser.add_argument("--served-model-name", default=None, help="model id folded into block hashes")
    add_lora_arguments(parser)
    # Not a flag (it would show in `ps`): the mesh's secret, folded into every block hash so nobody can
    # compute the hash of a predicted prompt and plant blocks for it in a kvstore.
    parser.set_defaults(cache_salt=os.environ.get("KVMESH_CACHE_SALT", ""))
    parser.add_argument("--threads", type=int, default=None,
                        help="torch intra-op threads, affinity left as it is (default: this process's share of the "
                             "usable cores: cores / engine processes that `kvmesh up` starts on this host, pinned to "
                             "its own cores when there are several)")
    parser.add_argument("--tensor-parallel-size", "-tp", type=int,
                        default=int(os.environ.get("KVMESH_TENSOR_PARALLEL_SIZE", 1)),
                        help="split the model across this many ranks: this process is rank 0 and starts the others "
                             "(gloo on CPU, NCCL on CUDA; env KVMESH_TENSOR_PARALLEL_SIZE)")
    parser.add_argument("--engine", choices=["real", "sim"], default=os.environ.get("KVMESH_ENGINE", "real"),
                        help="sim: a SIMULATED engine for scale tests and planner studies: the real scheduler, "
                             "block manager, prefix cache and bus protocol, but no model: each step waits the time "
                             "a cost-model profile gives, tokens are a fixed function of the sequence and KV pushes "
                             "carry placeholders (env KVMESH_ENGINE)")
    parser.add_argument("--sim-profile", default=os.environ.get("KVMESH_SIM_PROFILE"), metavar="PATH",
                        help="the simulated engine's cost-model profile (JSON; default: the shipped H100 "
                             "Llama-3.1-8B profile; `kvmesh bench sim-profile` fits one on this machine)")
    parser.add_argument("--sim-speed", type=float, default=float(os.environ.get("KVMESH_SIM_SPEED", 1.0)),
                        help="the simulated engine runs this many times faster than its profile (default 1)")


def add_pooling_arguments(parser: argparse.ArgumentParser) -> None:
    """vLLM's pooling flags, on the prefill worker only: a pooling request is a prefill with no decode."""
    parser.add_argument("--runner", choices=["generate", "pooling"], default="generate",
                        help="pooling: serve the model for embeddings, classification and reranking (no decode, no "
                             "KV kept); only a prefill worker runs it")
    parser.add_argument("--convert", choices=["auto", "embed", "classify"], default="auto",
                        help="--runner pooling: what the model computes (auto: classify for a "
                             "*ForSequenceClassification checkpoint, else embed)")
    parser.add_argument("--pooler-config", default=None, metavar="JSON",
                        help='--runner pooling: vLLM\'s pooler JSON, e.g. {"pooling_type": "MEAN", "normalize": false} '
                             "(pooling_type LAST, MEAN or CLS; normalize; activation/softmax for classifiers)")


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    # The engine's CPU threads and cores: this process's share of the host (shared/engine/cpu_threads.py).
    log.info(apply_plan(plan_for_this_process(args.threads)))
    return EngineConfig(model=args.model, dtype=args.dtype, device=args.device, load_format=args.load_format,
                        block_size=args.block_size, kv_cache_bytes=args.kv_cache_bytes, host_kv_bytes=args.host_kv_bytes,
                        offload_policy=args.offload_policy,
                        num_kv_blocks=args.num_kv_blocks, gpu_memory_utilization=args.gpu_memory_utilization,
                        kv_cache_dtype=args.kv_cache_dtype, enforce_eager=args.enforce_eager, max_num_seqs=args.max_num_seqs,
                        max_num_batched_tokens=args.max_num_batched_tokens, max_model_len=args.max_model_len,
                        long_prefill_token_threshold=args.long_prefill_token_threshold or 0,
                        model_id=args.served_model_name, cache_salt=args.cache_salt, quantization=args.quantization,
                        cpu_weight_packing=getattr(args, "cpu_weight_packing", True),
                        tensor_parallel_size=getattr(args, "tensor_parallel_size", 1),
                        speculative_config=SpeculativeConfig.parse(getattr(args, "speculative_config", None)),
                        cpu_compile=getattr(args, "cpu_compile", "off"),
                        async_scheduling=getattr(args, "async_scheduling", None),
                        lora=lora_config_from_args(args))


def engine_factory_from_args(args: argparse.Namespace):  # noqa: ANN201 - Callable[[EngineConfig], LLMEngine]
    """What builds the worker's engine: the real one, or the simulated one with its cost model (the profile is
    read here, at start, so a bad one stops the worker with a clear error before it joins the mesh)."""
    if getattr(args, "engine", "real") != "sim":
        return None
    from shared.engine.sim_engine import SimEngine
    from shared.engine.sim_profile import DEFAULT_PROFILE, CostModel, load_profile

    cost = CostModel(load_profile(args.sim_profile or DEFAULT_PROFILE), args.sim_speed)
    return lambda config: SimEngine(config, cost)
