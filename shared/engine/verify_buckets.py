"""Which verify graphs an engine captures, and the device memory they hold beyond the memory profile.

A verify step of speculative decoding gives every request 1 + k query rows. Its graphs are keyed by (requests,
draft length): a step of n requests whose longest draft is k runs in the smallest captured (bs >= n, K >= k)
(shared/engine/verify_graphs.py pads it). Request buckets are the decode graphs' spacing
(shared/engine/cuda_graphs.batch_buckets), capped where no verify step can be larger: the adaptive rule turns
speculation off above `disable_by_batch_size` running decodes (shared/engine/spec/adaptive.py), and no step
holds more than max_num_batched_tokens tokens. Draft buckets are every length up to k (k is small: vLLM and
SGLang default to 3 to 5), powers of two beyond 8 so a large k does not multiply the graphs.

Memory, vLLM's way: the graphs share the decode graphs' pool, whose size is the largest shape's activations,
already inside the profiled peak (a verify shape holds at most max_num_batched_tokens tokens, the profile's
step); what outlives a replay is each graph's output (its hidden rows) and the static input buffers, plus the
graphs' own bookkeeping, counted per graph.
"""
from __future__ import annotations

from dataclasses import dataclass

from shared.engine.cuda_graphs import batch_buckets

# Per captured graph, beyond its output: allocator segments the capture pins and the graph's kernel nodes
# (a few hundred per forward). An estimate, checked on a GPU by loadtest/gpu_check.py's spec step.
PER_GRAPH_BYTES = 2 << 20


def draft_buckets(k: int) -> list[int]:
    """Every draft length up to k when k <= 8; beyond, powers of two and k itself."""
    if k <= 8:
        return list(range(1, k + 1))
    out = [1, 2, 4, 8]
    while out[-1] * 2 < k:
        out.append(out[-1] * 2)
    return out + [k]


@dataclass(frozen=True)
class VerifyGraphPlan:
    shapes: list[tuple[int, int]]  # (requests bucket, draft-length bucket), largest tokens first (capture order)
    max_bs: int
    max_k: int
    width: int  # block-table entries per row: the blocks of max_model_len

    @property
    def count(self) -> int:
        return len(self.shapes)

    @property
    def max_tokens(self) -> int:
        return max(bs * (k + 1) for bs, k in self.shapes)

    def request_buckets(self) -> list[int]:
        return sorted({bs for bs, _ in self.shapes})

    def bucket(self, n: int, k: int) -> tuple[int, int] | None:
        """The smallest captured shape for n requests with drafts of at most k (fewest padded rows); None: none."""
        fits = [(bs * (kb + 1), bs, kb) for bs, kb in self.shapes if bs >= n and kb >= k]
        if not fits:
            return None
        _, bs, kb = min(fits)
        return bs, kb

    def memory_bytes(self, hidden_size: int, dtype_bytes: int) -> int:
        """Device bytes the graphs keep beyond the profiled peak: outputs, static inputs, per-graph bookkeeping."""
        outputs = sum(bs * (k + 1) for bs, k in self.shapes) * hidden_size * dtype_bytes
        inputs = 4 * (4 * self.max_tokens + self.max_bs + self.max_bs * self.width)  # int32 rows and tables
        return outputs + inputs + PER_GRAPH_BYTES * self.count


def decode_graph_bytes(max_num_seqs: int, hidden_size: int, dtype_bytes: int) -> int:
    """What a draft model's decode graphs keep beyond its profiled forward: each bucket's output rows and
    bookkeeping (the target's decode graphs are inside memory_budget.CUDA_GRAPH_RESERVE)."""
    buckets = batch_buckets(max_num_seqs)
    return sum(buckets) * hidden_size * dtype_bytes + PER_GRAPH_BYTES * len(buckets)


def plan_verify_graphs(k: int, max_num_seqs: int, disable_by_batch_size: int, max_num_batched_tokens: int,
                       max_model_len: int, block_size: int) -> VerifyGraphPlan | None:
    """The verify shapes to capture; None when no verify step can fit one (e.g. a token budget below 2 a request)."""
    cap = min(max_num_seqs, disable_by_batch_size) if disable_by_batch_size > 0 else max_num_seqs
    shapes = [(bs, kb) for bs in batch_buckets(cap) for kb in draft_buckets(k)
              if bs * (kb + 1) <= max_num_batched_tokens]
    if not shapes:
        return None
    shapes.sort(key=lambda s: (-s[0] * (s[1] + 1), -s[0]))
    return VerifyGraphPlan(shapes, max(bs for bs, _ in shapes), max(kb for _, kb in shapes),
                           -(-max_model_len // block_size))


def verify_plan_for(c, max_model_len: int) -> VerifyGraphPlan | None:  # noqa: ANN001 - an EngineConfig
    """The verify graphs of engine config c; None without speculation."""
    spec = c.speculative_config
    if spec is None:
        return None
    return plan_verify_graphs(spec.num_speculative_tokens, c.max_num_seqs, spec.disable_by_batch_size,
                              c.max_num_batched_tokens, max_model_len, c.block_size)
