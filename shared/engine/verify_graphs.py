"""Verify steps of speculative decoding replayed from CUDA graphs, one per (requests, draft length) bucket.

A verify step computes, for each request, its last token and the k drafts after it: 1 + k query rows through
extend attention (kernels/extend_attention.py) over the paged cache. Like a decode step it is a few hundred
small kernels whose shapes depend only on the batch, so each bucket of shared/engine/verify_buckets.py is
captured once at start, after the decode graphs and in their memory pool, over static input buffers.

Layout of a bucket (bs, K): every request owns K + 1 rows, query_start = r * (K + 1) (a constant per K). A
request with n = 1 + k real tokens puts them in its LAST n rows; the K + 1 - n rows before are padding. Extend
attention places row i of a request at position context_len - (K + 1) + i, so with context_len = the real one
(start + n) the real rows sit at their true positions and see exactly the keys they see unpadded, while the
padding rows sit before them (at positions < start, negative for very short contexts): they read only the
request's own earlier keys, never a table entry past its blocks and never a position past max_model_len.
Requests past the step's n are all padding, reading one token of block 0. Padding rows write no KV (slot -1),
take rotary position 0, and no logits row is taken from them: the verifier (shared/engine/spec/verify.py) and
the rejection sampler only ever see the real rows, so a padded draft can neither be accepted nor hashed.
Their outputs may be NaN (a row with no key to attend to); rows never mix, so nothing else sees them.

With capture off (CPU, tests) the same padded path runs eagerly: tests/test_verify_graphs.py checks it gives
the unpadded path's tokens and writes KV only into the step's real slots.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from itertools import accumulate

import torch

from kernels import AttentionMetadata
from shared.engine.block_tables import BlockTables
from shared.engine.graph_capture import capture_kwargs
from shared.engine.sequence import Sequence
from shared.engine.staging import StagingRing, copy_stream_for
from shared.engine.verify_buckets import VerifyGraphPlan
from shared.models.llama import LlamaFamilyForCausalLM

log = logging.getLogger(__name__)


@dataclass
class VerifyGraphStats:
    replays: int = 0  # verify steps replayed from a captured graph
    padded_eager: int = 0  # verify steps through the padded path run eagerly (capture off: CPU, tests)
    eager: int = 0  # verify steps on the runner's eager path (no verify graphs, no bucket fits, prompt chunks)


def is_verify(plan: list[tuple[Sequence, int]]) -> bool:
    """Whether a step verifies drafts (some sequence computes past its tokens)."""
    return any(seq.num_computed_tokens + n > seq.num_tokens for seq, n in plan)


def verify_shape(plan: list[tuple[Sequence, int]]) -> tuple[int, int] | None:
    """(requests, longest draft) of a step every row of which is a decode or a verify; None otherwise (a
    prompt chunk of several tokens is in it)."""
    k = 0
    for seq, n in plan:
        if n > 1 and seq.num_computed_tokens != seq.num_tokens - 1:
            return None
        k = max(k, n - 1)
    return len(plan), k


class VerifyGraphs:
    def __init__(self, model: LlamaFamilyForCausalLM, kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                 block_size: int, plan: VerifyGraphPlan, device: str, capture: bool, block_tables: BlockTables,
                 stats: VerifyGraphStats, pool=None) -> None:  # noqa: ANN001 - pool: the decode graphs' (a handle)
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.plan = plan
        self.device = device
        self.block_tables = block_tables
        self.stats = stats  # the runner's: it counts the eager verify steps in the same place
        # Segments start on 16-byte boundaries (m a multiple of 4 words): Triton specialises pointers on alignment.
        m, bs = -(-plan.max_tokens // 4) * 4, plan.max_bs
        self.m = m
        # One int32 buffer, one copy a step: ids, positions, slots [m each], logits rows [m], context lens [bs].
        self.words = 4 * m + bs
        pinned = device.startswith("cuda")
        self.stream = copy_stream_for(device)
        self.staging = StagingRing([(torch.zeros(self.words, dtype=torch.int32, pin_memory=pinned),
                                     torch.zeros(bs * plan.width, dtype=torch.int32, pin_memory=pinned))
                                    for _ in range(2 if self.stream is not None else 1)], self.stream)
        self.dev = torch.zeros(self.words, dtype=torch.int32, device=device)
        self.tables = torch.zeros(bs, plan.width, dtype=torch.int32, device=device)
        # query_start of bucket (bs, K) is r * (K + 1): constant per K, never copied.
        self.qstarts = {k: torch.arange(0, (bs + 1) * (k + 1), k + 1, dtype=torch.int32, device=device)
                        for k in {k for _, k in plan.shapes}}
        self._no_decode = (torch.zeros(0, dtype=torch.int32, device=device),
                           torch.zeros(0, 0, dtype=torch.int32, device=device))
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self.outputs: dict[tuple[int, int], torch.Tensor] = {}
        self.pool = pool
        self.capture_bytes = 0  # device memory the capture reserved (its pool's growth): checks the plan's estimate
        if capture:
            self._capture_all()

    def _view(self, i: int, n: int) -> torch.Tensor:
        """Segment i (0 ids, 1 positions, 2 slots, 3 logits rows) of the device buffer, its first n words."""
        return self.dev[i * self.m : i * self.m + n]

    def _meta(self, bs: int, k: int) -> AttentionMetadata:
        t = bs * (k + 1)
        dctx, dtab = self._no_decode
        return AttentionMetadata(
            slot_mapping=self._view(2, t), num_prefill_tokens=t, prefill_query_start=self.qstarts[k][: bs + 1],
            prefill_context_lens=self.dev[4 * self.m : 4 * self.m + bs], prefill_block_tables=self.tables[:bs],
            max_prefill_query_len=k + 1, decode_context_lens=dctx, decode_block_tables=dtab,
            sliding_window=self.model.cfg.sliding_window)

    def _forward(self, bs: int, k: int) -> torch.Tensor:
        t = bs * (k + 1)
        return self.model(self._view(0, t), self._view(1, t), self._meta(bs, k), self.kv_caches)

    def _padding_only(self) -> None:
        """Every row writes nowhere, every request reads one token of block 0 (what capture runs over)."""
        self.dev.zero_()
        self._view(2, self.m).fill_(-1)
        self.dev[4 * self.m :].fill_(1)
        self.tables.zero_()

    @torch.inference_mode()
    def _capture_all(self) -> None:
        self._padding_only()
        torch.cuda.synchronize(self.device)
        before = torch.cuda.memory_reserved(self.device)
        pool = self.pool
        for shape in self.plan.shapes:  # largest first: the smaller graphs reuse its pool memory
            self._forward(*shape)  # warm-up: compiles this query length's Triton variants
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, **capture_kwargs(pool)):
                self.outputs[shape] = self._forward(*shape)
            pool = graph.pool()
            self.graphs[shape] = graph
        torch.cuda.synchronize(self.device)
        self.pool = pool
        self.capture_bytes = torch.cuda.memory_reserved(self.device) - before
        log.info("captured %d CUDA graphs for verify steps (requests, draft length): %s; %.1f MiB reserved",
                 len(self.graphs), self.plan.shapes, self.capture_bytes / (1 << 20))

    def bucket(self, plan: list[tuple[Sequence, int]]) -> tuple[int, int] | None:
        """The (requests, draft length) bucket of a decode/verify step with at least one draft; None: not one."""
        shape = verify_shape(plan)
        if shape is None or shape[1] == 0:
            return None
        return self.plan.bucket(*shape)

    @torch.inference_mode()
    def run(self, plan: list[tuple[Sequence, int]], sample_rows: list[int], shape: tuple[int, int]) -> torch.Tensor:
        """Hidden states of sample_rows (plan row numbering) of a step that fits bucket `shape`."""
        self.stage(plan, sample_rows, *shape)
        return self.replay(shape, len(sample_rows))

    def stage(self, plan: list[tuple[Sequence, int]], sample_rows: list[int], bs: int, k: int) -> None:
        """The step's padded rows into the static buffers."""
        host, host_tables = self.staging.acquire()
        host[:] = torch.tensor(self._rows(plan, sample_rows, bs, k), dtype=torch.int32)
        bsz = self.block_size
        rows = [self.block_tables.sync(seq, -(-(seq.num_computed_tokens + n) // bsz)) for seq, n in plan]
        width = max(-(-(seq.num_computed_tokens + n) // bsz) for seq, n in plan)
        table = host_tables[: bs * width].view(bs, width)
        self.block_tables.gather(rows, width, out=table[: len(plan)])
        table[len(plan) :, 0] = 0  # padding requests read one token of block 0
        if self.stream is None:
            self.dev.copy_(host)
            self.tables[:bs, :width].copy_(table)
        else:
            self.stream.copy(self.dev, host)
            self.stream.copy(self.tables[:bs, :width], table)
            self.staging.sent()

    def _rows(self, plan: list[tuple[Sequence, int]], sample_rows: list[int], bs: int, k: int) -> list[int]:
        """The host words of a step: ids, positions, slots, logits rows (each m long), context lens (max_bs)."""
        m, q, bsz = self.m, k + 1, self.block_size
        ids, pos, slots, ctx = [0] * m, [0] * m, [-1] * m, [1] * self.plan.max_bs
        first = []  # padded row of each request's first real token
        for r, (seq, n) in enumerate(plan):
            start = seq.num_computed_tokens
            at = r * q + q - n
            first.append(at)
            toks = seq.token_ids[start : start + n]
            toks = toks + seq.spec_token_ids[: n - len(toks)]  # a verify: the drafts follow the last token
            ids[at : at + n] = toks
            pos[at : at + n] = range(start, start + n)
            slots[at : at + n] = [seq.block_table[p // bsz] * bsz + p % bsz for p in range(start, start + n)]
            ctx[r] = start + n
        plan_start = list(accumulate((n for _, n in plan), initial=0))
        request = [r for r, (_, n) in enumerate(plan) for _ in range(n)]  # plan row -> its request
        logits_rows = [first[request[p]] + p - plan_start[request[p]] for p in sample_rows]
        return ids + pos + slots + logits_rows + [0] * (m - len(logits_rows)) + ctx

    @torch.inference_mode()
    def replay(self, shape: tuple[int, int], n: int) -> torch.Tensor:
        """The staged step of bucket `shape`: the hidden states of its first n logits rows (the graph, or the same
        forward eagerly)."""
        graph = self.graphs.get(shape)
        if graph is None:
            self.stats.padded_eager += 1
            hidden = self._forward(*shape)
        else:
            self.stats.replays += 1
            graph.replay()
            hidden = self.outputs[shape]
        return hidden.index_select(0, self._view(3, n))
