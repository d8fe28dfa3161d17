"""The three transformers baselines of the offline benchmark, on the same weights and threads as kvmesh.

Fairness rules every baseline follows:
- Throughput counts only the *requested* output tokens of each request (useful tokens). Tokens a
  static batch generates past a request's length are work it wasted, reported apart.
- ignore_eos is emulated by clearing eos (generate) or passing eos -1 (continuous batching), never
  with min_new_tokens, which would mask the eos logit and change the greedy argmax.
- Model load, KV-cache allocation and a tiny warm-up run happen before the clock starts, as for kvmesh.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from loadtest.workload import RunResult, Workload

PAD_ID = 0  # left padding; masked out, so its value never reaches a logit


def load_hf_model(model_dir: str, attn_implementation: str = "sdpa", device: str = "cpu", dtype: str = "float32"):
    from pathlib import Path

    from transformers import AutoConfig, AutoModelForCausalLM

    torch_dtype = getattr(torch, dtype)
    if any(Path(model_dir).glob("*.safetensors")):
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch_dtype, attn_implementation=attn_implementation)
    else:  # a config-only shape: transformers' own seeded initialisation, built on the device directly
        torch.manual_seed(0)
        config = AutoConfig.from_pretrained(model_dir)
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(config, dtype=torch_dtype, attn_implementation=attn_implementation)
    model.to(device).eval()
    # generate() fills unset fields from the checkpoint's generation_config, so eos must be cleared
    # there for every request to run to its full length (the ignore_eos of the kvmesh side).
    model.generation_config.eos_token_id = None
    _quiet_psutil_error()
    return model


def _not_about_psutil(record: logging.LogRecord) -> bool:
    return "psutil" not in record.getMessage()


def _quiet_psutil_error() -> None:
    """transformers logs an ERROR on CPU without psutil, yet sizes the cache fine from our explicit num_blocks."""
    logging.getLogger("ContinuousBatchingLogger").addFilter(_not_about_psutil)  # addFilter ignores repeats


def _greedy_config(max_new_tokens: int):
    from transformers import GenerationConfig

    return GenerationConfig(do_sample=False, max_new_tokens=max_new_tokens, pad_token_id=PAD_ID, eos_token_id=None)


def left_pad(prompts: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), PAD_ID, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt):] = torch.tensor(prompt, dtype=torch.long)
        mask[row, width - len(prompt):] = 1
    return ids, mask


@torch.inference_mode()
def generate_batch_static(model, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """One generate() call; every row runs to max_new_tokens. Returns only the new tokens."""
    ids, mask = (t.to(model.device) for t in left_pad(prompts))
    out = model.generate(input_ids=ids, attention_mask=mask, generation_config=_greedy_config(max_new_tokens))
    return out[:, ids.shape[1]:].tolist()


def warm_up_generate(model) -> None:
    generate_batch_static(model, [[5, 6, 7, 8], [9, 10]], 4)


def run_static_batched(model, wl: Workload, batch_size: int = 16) -> RunResult:
    """Static batches in workload order; each batch runs until its longest requested output."""
    warm_up_generate(model)
    outputs: list[list[int]] = []
    generated = 0
    start = time.perf_counter()
    for i in range(0, len(wl.prompts), batch_size):
        lens = wl.output_lens[i:i + batch_size]
        rows = generate_batch_static(model, wl.prompts[i:i + batch_size], max(lens))
        outputs += [row[:n] for row, n in zip(rows, lens)]
        generated += max(lens) * len(lens)
    seconds = time.perf_counter() - start
    return RunResult("hf_batched", seconds, wl.total_output_tokens, generated, outputs,
                     {"batch_size": batch_size, "padding": "left"})


def run_unbatched(model, wl: Workload, num_measured: int = 8) -> RunResult:
    """One request per generate() call on the first num_measured requests; the rate is scaled to the workload."""
    warm_up_generate(model)
    n = min(num_measured, len(wl.prompts))
    outputs: list[list[int]] = []
    start = time.perf_counter()
    for prompt, out_len in zip(wl.prompts[:n], wl.output_lens[:n]):
        outputs += generate_batch_static(model, [prompt], out_len)
    measured = time.perf_counter() - start
    measured_tokens = sum(wl.output_lens[:n])
    # Scaling by output tokens: decode dominates at these lengths, and the first n requests are a
    # uniform random sample of the same length distribution.
    estimated = measured * wl.total_output_tokens / measured_tokens
    return RunResult("hf_unbatched", estimated, wl.total_output_tokens, wl.total_output_tokens, outputs,
                     {"measured_requests": n, "measured_seconds": measured, "measured_tokens": measured_tokens,
                      "scaled": "seconds = measured_seconds * total_output_tokens / measured_tokens"})


@dataclass
class ContinuousSettings:
    """transformers' continuous batching, sized like the kvmesh engine it is compared with."""

    kv_cache_bytes: int  # same KV budget as kvmesh
    max_batch_tokens: int  # kvmesh's max_num_batched_tokens
    max_requests_per_batch: int  # kvmesh's max_num_seqs
    page_size: int = 256  # transformers' default; one page per layer per block
    per_request_lengths: bool = True  # False: model.generate_batch() with the batch-wide max_new_tokens


def kv_bytes_per_token(config) -> int:
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return 2 * config.num_hidden_layers * config.num_key_value_heads * head_dim * 4  # K and V, float32


def num_cache_blocks(model, wl: Workload, s: ContinuousSettings) -> int:
    """The KV budget in blocks, capped at what the whole workload needs resident at once.

    The cap matters because transformers sizes its attention mask from the cache size (the mask is
    [batch tokens, cache tokens + batch tokens] with sdpa), so an oversized cache costs memory and
    time without letting it hold a single extra request of this workload.
    """
    budget = s.kv_cache_bytes // (s.page_size * kv_bytes_per_token(model.config))
    needed = sum(-(-(len(p) + n) // s.page_size) for p, n in zip(wl.prompts, wl.output_lens)) + 1
    return max(1, min(budget, needed))


def continuous_batching_config(model, wl: Workload, s: ContinuousSettings):
    import inspect

    from transformers import ContinuousBatchingConfig

    # transformers 5.17 calls the page size `block_size`; 5.23 renamed it `page_size` (keeping block_size
    # as a deprecated alias). Ask the installed version which it takes.
    params = inspect.signature(ContinuousBatchingConfig.__init__).parameters
    page_key = "page_size" if "page_size" in params else "block_size"
    return ContinuousBatchingConfig(
        **{page_key: s.page_size}, num_blocks=num_cache_blocks(model, wl, s), max_batch_tokens=s.max_batch_tokens,
        max_requests_per_batch=s.max_requests_per_batch,
    )


def _cb_generation_config(max_new_tokens: int):
    # eos -1 is transformers' "no eos" for continuous batching; None would fall back to the checkpoint's.
    cfg = _greedy_config(max_new_tokens)
    cfg.eos_token_id = -1
    return cfg


def _collect(manager, request_ids: list[str]) -> list[list[int]]:
    results = {}
    while len(results) < len(request_ids):
        out = manager.get_result(timeout=1)
        if out is None:
            if not manager.is_running():
                raise RuntimeError("transformers' continuous batching thread died; see its log above")
            continue
        if out.is_finished():
            if out.error is not None:
                raise RuntimeError(f"transformers continuous batching failed request {out.request_id}: {out.error}")
            results[out.request_id] = out.generated_tokens
    return [results[r] for r in request_ids]


# No inference_mode here: the manager's thread updates tensors created on this one (in-place
# update of an inference tensor fails); transformers runs its loop under no_grad itself.
def _run_manager(model, wl: Workload, s: ContinuousSettings) -> tuple[list[list[int]], float]:
    """The machinery under model.generate_batch(), driven directly so each request gets its own max_new_tokens."""
    from transformers.generation.continuous_batching.utils import WorkloadHints

    hints = WorkloadHints(max_prompt_length=max(map(len, wl.prompts)), max_generated_length=max(wl.output_lens),
                          num_requests=len(wl.prompts))
    with model.continuous_batching_context_manager(
        generation_config=_cb_generation_config(max(wl.output_lens)),
        continuous_batching_config=continuous_batching_config(model, wl, s), block=True, workload_hints=hints,
    ) as manager:
        # Warm up inside the same session: the cache exists, first-call costs are paid before the clock.
        _collect(manager, [manager.add_request([5, 6, 7, 8], request_id="warmup", max_new_tokens=4, eos_token_id=-1)])
        start = time.perf_counter()
        ids = [manager.add_request(p, request_id=f"r{i}", max_new_tokens=n, eos_token_id=-1)
               for i, (p, n) in enumerate(zip(wl.prompts, wl.output_lens))]
        outputs = _collect(manager, ids)
        return outputs, time.perf_counter() - start


def _run_generate_batch(model, wl: Workload, s: ContinuousSettings) -> tuple[list[list[int]], float]:
    """model.generate_batch() as documented: one max_new_tokens for all, manager set-up inside the clock."""
    cb_config = continuous_batching_config(model, wl, s)
    model.generate_batch([[5, 6, 7, 8]], generation_config=_cb_generation_config(4), continuous_batching_config=cb_config)
    start = time.perf_counter()
    results = model.generate_batch(wl.prompts, generation_config=_cb_generation_config(max(wl.output_lens)),
                                   continuous_batching_config=cb_config)
    seconds = time.perf_counter() - start
    outputs = [r.generated_tokens for r in results.values()]  # generate_batch returns them in input order
    if len(outputs) != len(wl.prompts):
        raise RuntimeError(f"generate_batch returned {len(outputs)} of {len(wl.prompts)} requests")
    return outputs, seconds


def run_continuous(model, wl: Workload, s: ContinuousSettings) -> RunResult:
    run = _run_manager if s.per_request_lengths else _run_generate_batch
    attn = model.config._attn_implementation
    outputs, seconds = run(model, wl, s)
    generated = sum(map(len, outputs))
    outputs = [o[:n] for o, n in zip(outputs, wl.output_lens)]
    api = ("model.continuous_batching_context_manager() + manager.add_request(max_new_tokens=per request)"
           if s.per_request_lengths else "model.generate_batch(max_new_tokens=workload max)")
    return RunResult("hf_continuous", seconds, wl.total_output_tokens, generated, outputs,
                     {"api": api, "attn_implementation": "paged|eager" if attn == "eager" else attn,
                      "page_size": s.page_size, "max_batch_tokens": s.max_batch_tokens,
                      "max_requests_per_batch": s.max_requests_per_batch, "kv_cache_bytes": s.kv_cache_bytes,
                      "num_blocks": num_cache_blocks(model, wl, s)})
