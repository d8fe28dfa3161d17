"""Per-step overhead of the eager CPU decode (issue 27): the step's rotary rows gathered and cast once per step and
q and k rotated together in four in-place ops (kernels/rotary.rope_rows / rotate_rows), and the kept KV slots
derived once per step (kernels/store_kv.kept_slots), against the previous twin that gathered, cast and rotated q and
k separately and filtered the slots (with a sync) in every layer, in one engine, interleaved.

`python -m loadtest.experiments.cpu_engine.cpu_step_overhead_ab [--json PATH] [--rounds 4] [--batches 1,8] [--threads N]`: SmolLM2-135M-Instruct
in bfloat16 (packed linears), eager decode, prompts of ~50 tokens, 64 output tokens each (ignore_eos). The baseline
is swapped in for a round and out again, so drift on a shared machine hits both arms; the ratio is the median of the
per-round ratios. Greedy outputs of both arms are compared too.
"""
from __future__ import annotations

import importlib
import os

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from loadtest.experiments.cpu_engine.engine_ab import smollm2_ab_setup, decode_prompts, decode_tok_s, interleaved, median_ratio, medians
from loadtest.report_json import emit_report
from shared.engine.llm_engine import LLMEngine
from shared.sampling_params import SamplingParams

qrs = importlib.import_module("kernels.qk_rope_store")


def _old_rotary(q, k, positions, cos_sin_cache) -> None:
    """The previous twin: per layer, the gather, four casts and the rotate-half of q and k separately."""
    cos_sin = cos_sin_cache[positions]
    half = q.shape[-1] // 2
    for x in (q, k):
        cos, sin = cos_sin[:, None, :half].to(x.dtype), cos_sin[:, None, half:].to(x.dtype)
        x1, x2 = x[..., :half], x[..., half:]
        new1 = x1 * cos - x2 * sin
        x2.copy_(x2 * cos + x1 * sin)
        x1.copy_(new1)


def _old_ref(qkv, heads, kv_heads, head_dim, q_weight, k_weight, eps, positions, cos_sin_cache, k_cache, v_cache,
             slot_mapping, k_scale=1.0, v_scale=1.0, rope=None, kept=None) -> torch.Tensor:
    """The previous qk_rope_store twin (ignores the per-step rows and slots: store_kv_ref derives them per layer)."""
    q, k, v = qrs._views(qkv, heads, kv_heads, head_dim)
    if q_weight is not None:
        q, k = qrs.rms_norm_ref(q, q_weight, eps), qrs.rms_norm_ref(k, k_weight, eps)
    _old_rotary(q, k, positions, cos_sin_cache)
    qrs.store_kv_ref(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)
    return q


class _CountOps(TorchDispatchMode):
    """Counts the aten ops dispatched (a load-independent figure beside the timings)."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        self.count += 1
        return func(*args, **(kwargs or {}))


def ops_per_decode_step(engine: LLMEngine, batch: int, steps: int = 8) -> float:
    """aten ops per decode step: a run of steps + 1 tokens minus a run of 1 token (the prefill), over steps."""
    counts = []
    for n in (1, steps + 1):
        engine.generate(decode_prompts(batch), SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True),
                        use_tqdm=False)  # the prompts are in the prefix cache for the counted run too
        with _CountOps() as c:
            engine.generate(decode_prompts(batch), SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True),
                            use_tqdm=False)
        counts.append(c.count)
    return (counts[1] - counts[0]) / steps


def main() -> None:
    args, batches, engine = smollm2_ab_setup("1,8")
    arms = {"new": qrs.qk_rope_store_ref, "old": _old_ref}

    def measure(name: str, batch: int) -> float:
        qrs.qk_rope_store_ref = arms[name]
        return decode_tok_s(engine, batch, warm=True)

    greedy = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    # A first run fills the prefix cache, so both compared runs prefill alike (a cache hit changes the prefill's
    # matmul shapes, and with them bf16 rounding).
    engine.generate(decode_prompts(8), greedy, use_tqdm=False)
    tokens = {}
    for name in arms:
        qrs.qk_rope_store_ref = arms[name]
        tokens[name] = [o.output_token_ids for o in engine.generate(decode_prompts(8), greedy, use_tqdm=False)]
    ops = {}
    for name in arms:
        qrs.qk_rope_store_ref = arms[name]
        ops[name] = {b: ops_per_decode_step(engine, b) for b in batches}
    runs = interleaved(arms, batches, args.rounds, measure)
    qrs.qk_rope_store_ref = arms["new"]
    report = {"model": "SmolLM2-135M-Instruct", "dtype": "bfloat16", "decode": "eager (packed linears)",
              "threads": torch.get_num_threads(),
              "machine": f"{os.cpu_count()} cores, shared with other jobs (load average below)",
              "loadavg_1m_after": os.getloadavg()[0],
              "greedy_tokens_equal_8_rows": tokens["new"] == tokens["old"],
              "aten_ops_per_decode_step": ops,
              "ratio_new_vs_old_median_of_rounds": median_ratio(runs, "new", "old"),
              "decode_tok_s_median": medians(runs),
              "runs": runs}
    emit_report(report, args.json)


if __name__ == "__main__":
    main()
