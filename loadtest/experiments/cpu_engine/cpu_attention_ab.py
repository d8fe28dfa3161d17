"""CPU decode attention: two batched matmuls (kernels/decode_attention._attend_one_query) vs torch's
F.scaled_dot_product_attention (what the twin called before), in one engine, interleaved.

`python -m loadtest.experiments.cpu_engine.cpu_attention_ab [--json PATH] [--rounds 4] [--batches 1,8,32] [--threads N]`: SmolLM2-135M-Instruct
in bfloat16, eager decode, prompts of ~50 tokens, 64 output tokens each (ignore_eos). The baseline is swapped in
for a round and out again (A, B, A, B, ...), so drift on a shared machine hits both; the ratio is the median of
the per-round ratios.
"""
from __future__ import annotations

import importlib
import os

import torch
import torch.nn.functional as F

from loadtest.experiments.cpu_engine.engine_ab import smollm2_ab_setup, decode_tok_s, interleaved, median_ratio, medians
from loadtest.report_json import emit_report

# The module (kernels/__init__.py exports a function of the same name).
da = importlib.import_module("kernels.decode_attention")


def _sdpa(q, ks, vs, mask, scale):
    """The previous twin's attention call (the baseline)."""
    o = F.scaled_dot_product_attention(q.unsqueeze(2), ks.transpose(1, 2), vs.transpose(1, 2), attn_mask=mask,
                                       scale=scale, enable_gqa=True)
    return o.squeeze(2)


def main() -> None:
    args, batches, engine = smollm2_ab_setup("1,8,32")
    arms = {"bmm": da._attend_one_query, "sdpa": _sdpa}

    def measure(name: str, batch: int) -> float:
        da._attend_one_query = arms[name]
        return decode_tok_s(engine, batch)

    runs = interleaved(arms, batches, args.rounds, measure)
    da._attend_one_query = arms["bmm"]
    report = {"model": "SmolLM2-135M-Instruct", "dtype": "bfloat16", "decode": "eager", "threads": torch.get_num_threads(),
              "machine": f"{os.cpu_count()} cores, shared with other jobs (load average below)",
              "loadavg_1m_after": os.getloadavg()[0],
              "ratio_bmm_vs_sdpa_median_of_rounds": median_ratio(runs, "bmm", "sdpa"),
              "decode_tok_s_median": medians(runs),
              "runs": runs}
    emit_report(report, args.json)


if __name__ == "__main__":
    main()
