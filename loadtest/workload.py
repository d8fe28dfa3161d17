"""What the offline benchmarks run: the benchmark model, the random-token workload, the machine.

Both kvmesh and transformers load the *same* checkpoint directory written here, so any
difference in speed is the engines', never the weights'.
"""
from __future__ import annotations

import json

import os
import platform
import random
import sys
from dataclasses import asdict, dataclass, field

import torch

from loadtest.report_json import git_commit


@dataclass(frozen=True)
class ModelShape:
    """Llama shape of the benchmark model (by default hidden 512, 8 layers, 8 heads, 4 KV heads)."""

    hidden_size: int = 512
    num_hidden_layers: int = 8
    num_attention_heads: int = 8
    num_key_value_heads: int = 4
    intermediate_size: int = 1408
    vocab_size: int = 8192
    max_position_embeddings: int = 4096  # room for the prefix benchmark's 2,048-token prompt


# For tests: seconds, not minutes, on two CPU cores.
TINY_SHAPE = ModelShape(
    hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    intermediate_size=128, vocab_size=512, max_position_embeddings=1024,
)


def build_bench_model(out_dir: str, shape: ModelShape = ModelShape(), seed: int = 0) -> str:
    """Writes a float32 LlamaForCausalLM with seeded random weights (safetensors) to out_dir."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**asdict(shape), dtype="float32", tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).to(torch.float32)
    model.save_pretrained(out_dir, safe_serialization=True)
    return out_dir


def read_shape(model_dir: str) -> dict:
    """The model's shape as recorded in the JSON reports (read back, so --model DIR is described too)."""
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(model_dir)
    keys = [f.name for f in ModelShape.__dataclass_fields__.values()]
    return {k: getattr(cfg, k, None) for k in keys} | {"architecture": (cfg.architectures or ["?"])[0]}


@dataclass
class Workload:
    prompts: list[list[int]]
    output_lens: list[int]  # requested output tokens per request; ignore_eos makes them exact
    description: dict = field(default_factory=dict)

    @property
    def total_output_tokens(self) -> int:
        return sum(self.output_lens)

    @property
    def total_prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)


def random_tokens(rng: random.Random, n: int, vocab_size: int) -> list[int]:
    # Ids below 4 are skipped so no prompt is full of bos/eos/pad by chance; it changes nothing
    # for speed but keeps the prompts plausible if a real tokenizer's specials sit there.
    return [rng.randrange(4, vocab_size) for _ in range(n)]


def make_workload(
    num_prompts: int, input_len: tuple[int, int], output_len: tuple[int, int], vocab_size: int, seed: int = 0
) -> Workload:
    """Prompt and output lengths uniform over the inclusive ranges, random token ids, seeded."""
    assert num_prompts > 0 and 1 <= input_len[0] <= input_len[1] and 1 <= output_len[0] <= output_len[1]
    rng = random.Random(seed)
    in_lens = [rng.randint(*input_len) for _ in range(num_prompts)]
    out_lens = [rng.randint(*output_len) for _ in range(num_prompts)]
    prompts = [random_tokens(rng, n, vocab_size) for n in in_lens]
    desc = {
        "num_prompts": num_prompts,
        "input_len_range": list(input_len),
        "output_len_range": list(output_len),
        "seed": seed,
        "sampling": "greedy, ignore_eos",
        "token_ids": f"uniform random in [4, {vocab_size})",
        "total_prompt_tokens": sum(in_lens),
        "total_output_tokens": sum(out_lens),
    }
    return Workload(prompts, out_lens, desc)


@dataclass
class RunResult:
    """One system's timed pass over a workload (kvmesh or a transformers baseline)."""

    name: str
    seconds: float  # timed wall-clock (for "hf_unbatched": the estimate for the whole workload)
    useful_tokens: int  # sum of requested output lengths over the requests it covers
    generated_tokens: int  # what the model actually produced, a static batch's overrun included
    outputs: list[list[int]] = field(default_factory=list)  # greedy tokens, cut to the requested lengths
    details: dict = field(default_factory=dict)

    @property
    def tok_s(self) -> float:
        return self.useful_tokens / self.seconds if self.seconds > 0 else 0.0

    def to_json(self) -> dict:
        return {"seconds": self.seconds, "useful_tokens": self.useful_tokens,
                "generated_tokens": self.generated_tokens, "tok_s": self.tok_s} | self.details


def warn_if_busy(threshold: float = 0.5) -> None:
    load = os.getloadavg()[0]
    if load > threshold:
        print(f"WARNING: 1-minute load average is {load:.2f} before timing; other work on these cores "
              "will distort the figures (see machine.loadavg_1m_5m_15m in the JSON)", file=sys.stderr)


def machine_info(device: str = "cpu") -> dict:
    import transformers

    info = {
        "device": device,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "torch_threads": torch.get_num_threads(),
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "kvmesh_commit": git_commit(short=True),
        # Other processes on the cores distort the timings badly: with 2 torch threads on 2 shared
        # cores, OpenMP barriers wait on descheduled peers and small ops slow down 5-50x.
        "loadavg_1m_5m_15m": list(os.getloadavg()),
    }
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:
        info["triton"] = None
    if device.startswith("cuda") and torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
        info["gpu_memory_bytes"] = torch.cuda.get_device_properties(0).total_memory
    return info


def write_result(path: str | None, result: dict) -> None:
    """A benchmark's JSON report (nothing when no --json was given)."""
    if path:
        with open(path, "w") as f:
            json.dump(result, f, indent=2)
        print(f"wrote {path}")
