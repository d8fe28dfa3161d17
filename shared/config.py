"""Engine configuration. The only process-wide state kvmesh keeps is what lives here."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from shared.engine.errors import ConfigError
from shared.engine.lora_config import LoRAConfig
from shared.spec_config import SpeculativeConfig

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
KV_CACHE_DTYPES = ("auto", "fp8")
# The attention kernels multiply by a block's tokens with tl.dot, which needs K >= 16.
MIN_BLOCK_SIZE = 16
# float8_e4m3 (Triton's fp8e4nv) exists from Ada / Hopper on: sm_89.
FP8_MIN_CAPABILITY = (8, 9)


@dataclass
class EngineConfig:
    model: str  # a Hugging Face checkpoint directory (config.json alone with load_format="dummy")
    dtype: str = "auto"  # auto: the checkpoint's dtype on CUDA; on CPU shared/models/cpu_dtype.py decides
    device: str = "auto"
    load_format: str = "auto"  # "auto": safetensors from the directory; "dummy": random weights
    seed: int = 0  # for dummy weights
    block_size: int = 16
    kv_cache_bytes: int | None = None  # byte budget for the KV pool; default: 1 GiB on CPU
    # Fraction of the device's *total* memory this worker may use (weights, activations, graphs and
    # the KV pool together), as in vLLM, so co-located workers can share one GPU by splitting it.
    gpu_memory_utilization: float = 0.9
    kv_cache_dtype: str = "auto"  # "auto": the model dtype; "fp8": float8_e4m3fn with a per-tensor scale
    enforce_eager: bool = False  # True: no CUDA graphs for decode steps
    num_kv_blocks: int | None = None  # overrides the byte budget (tests use it to force preemption)
    max_num_seqs: int = 128
    max_num_batched_tokens: int = 2048  # per-step token budget; prompts are chunked to fit
    # At most this many prompt tokens of one request per step (0: no cap), as vLLM's flag of the name:
    # a prefill worker cuts long prompts into chunks so each chunk's KV goes out while the next computes.
    long_prefill_token_threshold: int = 0
    max_model_len: int | None = None  # default: the checkpoint's max_position_embeddings
    enable_prefix_caching: bool = True
    # Host memory for blocks evicted from the device pool (shared/engine/host_tier.py); 0: no host tier.
    host_kv_bytes: int = 0
    # When blocks go to the kvstore (shared/engine/offload.py): "eviction" or "write-through".
    offload_policy: str = "eviction"
    cache_salt: str = ""
    model_id: str | None = None  # name folded into block hashes; default: the directory name
    # (major, minor) compute capability of the CUDA device; default: asked of the device (tests pass one).
    gpu_capability: tuple[int, int] | None = None
    # Weight-only quantization of the linear layers at load: None (or "none"), int8, int4
    # (shared/models/quant_linear.py), gguf (a converted GGUF's Q4/Q8_0 weights as stored:
    # shared/models/gguf_quant.py; gguf-hybrid: plus a bf16 twin for large steps), or auto (the CLI's default):
    # gguf-hybrid when that applies, else None. Resolved here.
    quantization: str | None = None
    # bf16 linear layers on CPU with their weights repacked at load: oneDNN's pre-packed weights
    # (shared/models/packed_linear.py: same results, about 2x faster decode matmuls) or, on CPUs with AVX512-BF16
    # and no AMX, the C++ kernels' own matmul (shared/models/dp_linear.py). False: plain F.linear (the baseline).
    cpu_weight_packing: bool = True
    # Ranks one engine's model is split across (shared/engine/tp/): rank 0 is this engine, the others are
    # follower processes it starts; 1 is the single-device engine, unchanged.
    tensor_parallel_size: int = 1
    # Speculative decoding (shared/spec_config.py; shared/engine/spec/): None, no speculation.
    speculative_config: SpeculativeConfig | None = None
    # Decode steps on CPU through torch.compile, batch sizes bucketed and compiled at start
    # (shared/engine/cpu_compile.py): "off" (eager, the default: compiled measured 0.92-1.07x of eager on the
    # project's loaded 2-core CPU), "auto" (when serving bf16 on
    # a CPU with a C++ compiler), "on".
    cpu_compile: str = "off"
    # Schedule and build step n+1 while step n computes (shared/engine/async_step.py): None is on for CUDA devices
    # and off on CPU (where torch runs synchronously, so there is nothing to overlap); True also on CPU.
    async_scheduling: bool | None = None
    # LoRA adapters (shared/engine/lora_manager.py): None, none served (--enable-lora off).
    lora: LoRAConfig | None = None

    def _capability(self) -> tuple[int, int]:
        """The serving GPU's compute capability (given, or asked of the device)."""
        return tuple(self.gpu_capability or torch.cuda.get_device_capability(torch.device(self.device)))

    def _checkpoint_quantization(self) -> str | None:
        """awq/gptq/fp8 when the checkpoint is quantized (its quantization_config) or --quantization fp8 quantizes
        it at load; None leaves the other modes to decide. ConfigError when the flag and the checkpoint disagree or
        the checkpoint's quantization is not servable."""
        from pathlib import Path

        from shared.models.errors import CheckpointError
        from shared.models.quant_config import CHECKPOINT_METHODS, resolve_checkpoint_quantization

        requested = self.quantization or "auto"  # None: not asked for
        ckpt = None
        if (Path(self.model) / "config.json").is_file():
            from shared.models.model_config import load_model_config

            try:
                ckpt = load_model_config(self.model).quant
            except CheckpointError as e:
                if "quantization_config" in e.field:
                    raise ConfigError(str(e)) from None
        if ckpt is None and requested not in CHECKPOINT_METHODS:
            return None
        try:
            return resolve_checkpoint_quantization(requested, ckpt, self.model)
        except ValueError as e:
            raise ConfigError(str(e)) from None

    def __post_init__(self) -> None:
        if self.block_size < MIN_BLOCK_SIZE or self.block_size & (self.block_size - 1):
            raise ConfigError(f"block size {self.block_size}: the KV block size must be a power of 2 >= {MIN_BLOCK_SIZE} "
                              f"(the attention kernels compute over a block's tokens with tl.dot, which needs 16)")
        assert self.max_num_seqs > 0
        if self.tensor_parallel_size < 1:
            raise ConfigError(f"tensor-parallel size must be >= 1, got {self.tensor_parallel_size}")
        if self.lora is not None and self.tensor_parallel_size > 1:
            raise ConfigError("LoRA adapters are not served with tensor parallelism yet (the slots are not sharded)")
        assert self.max_num_batched_tokens > 0
        assert self.long_prefill_token_threshold >= 0, "long_prefill_token_threshold must be >= 0"
        assert self.load_format in ("auto", "dummy"), f"unknown load_format {self.load_format!r}"
        assert self.offload_policy in ("eviction", "write-through"), f"unknown offload_policy {self.offload_policy!r}"
        assert self.host_kv_bytes >= 0, "host_kv_bytes must be >= 0"
        assert 0 < self.gpu_memory_utilization <= 1
        if self.device == "auto":
            self.device = "cuda" if torch.cuda.is_available() else "cpu"
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"unknown kv_cache_dtype {self.kv_cache_dtype!r}; choose one of {', '.join(KV_CACHE_DTYPES)}")
        if self.kv_cache_dtype == "fp8" and self.device.startswith("cuda"):
            cap = self._capability()
            if cap < FP8_MIN_CAPABILITY:
                raise ConfigError(
                    f"--kv-cache-dtype fp8 needs a GPU of compute capability >= {FP8_MIN_CAPABILITY[0]}."
                    f"{FP8_MIN_CAPABILITY[1]} (Ada, Hopper or newer); {self.device} is sm_{cap[0]}{cap[1]}: use "
                    f"--kv-cache-dtype auto")
        from shared.models.quant_config import CHECKPOINT_METHODS

        checkpoint_quant = self._checkpoint_quantization()
        if checkpoint_quant is not None:
            self.quantization = checkpoint_quant
        elif self.quantization in ("auto", "none", "gguf", "gguf-hybrid"):
            from shared.models.gguf_quant import resolve_gguf_quantization

            self.quantization = resolve_gguf_quantization(self.quantization, self.model, self.device, self.dtype,
                                                          self.load_format, self.tensor_parallel_size)
        if self.quantization is not None and self.quantization not in CHECKPOINT_METHODS:
            from shared.models.quant_linear import QUANTIZATIONS

            if self.quantization not in QUANTIZATIONS + ("gguf", "gguf-hybrid"):
                raise ConfigError(f"--quantization {self.quantization!r}: choose one of auto, none, gguf, "
                                  f"gguf-hybrid, {', '.join(QUANTIZATIONS + CHECKPOINT_METHODS)}")
            if self.device != "cpu":
                raise ConfigError(f"--quantization {self.quantization} is weight-only quantization for CPU serving "
                                  f"(torch's CPU int8/int4 kernels); {self.device} serves the model's own dtype: "
                                  "leave --quantization out")
        if self.quantization == "fp8" and self.device.startswith("cuda"):
            cap = self._capability()
            if cap < FP8_MIN_CAPABILITY:
                raise ConfigError(
                    f"--quantization fp8 (FP8 weights and activations) needs a GPU of compute capability >= "
                    f"{FP8_MIN_CAPABILITY[0]}.{FP8_MIN_CAPABILITY[1]} (Ada, Hopper or newer); {self.device} is "
                    f"sm_{cap[0]}{cap[1]}: serve the bf16 checkpoint, or a 4-bit AWQ/GPTQ one")
        if self.cpu_compile not in ("auto", "on", "whole", "off"):
            raise ConfigError(f"--cpu-compile {self.cpu_compile!r}: choose one of auto, on, whole, off")
        if self.dtype != "auto" and self.dtype not in DTYPES:
            raise ValueError(f"unknown dtype {self.dtype!r}; choose one of auto, {', '.join(DTYPES)}")
