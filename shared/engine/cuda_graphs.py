"""Decode steps replayed from CUDA graphs, one per batch-size bucket.

A decode step launches a few hundred small kernels whose shapes depend only on the batch size; launching
them from Python costs more than running them at small batches. Each bucket's forward (embedding to final
norm; the logits matmul stays outside so the graphs' outputs are small) is captured once at start, over
static input buffers. A step of n decodes fills the smallest bucket >= n: its rows are the real ones,
then padding rows that write nowhere (slot -1) and attend to one token of block 0; their outputs are
ignored. The decode kernel's launch grid depends on shapes only, and the block-table width is fixed at
the blocks of max_model_len, so a graph stays valid as contexts grow.

All inputs of a step travel in one host-to-device copy of a [4, row_words(max_bs)] int32 block (ids,
positions, slots, context lengths) plus one copy of the used part of the block tables (gathered from rows
kept across steps: shared/engine/block_tables.py). With capture off (CPU, or tests) the same static path
runs eagerly, so it is testable without a GPU.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch

from kernels import AttentionMetadata
from shared.engine.block_tables import BlockTables
from shared.engine.graph_capture import capture_kwargs
from shared.engine.sequence import Sequence
from shared.engine.staging import StagingRing, copy_stream_for
from shared.models.llama import LlamaFamilyForCausalLM

log = logging.getLogger(__name__)


def batch_buckets(max_num_seqs: int) -> list[int]:
    """The grid 1, 2, 4, 8, 16, 24, 32, then every 16 (vLLM's spacing), cut at max_num_seqs: every grid size
    below it, then max_num_seqs itself in place of the first grid size at or above it. So the list ends exactly
    at max_num_seqs, adds no bucket beside the grid's (17 gives 1, 2, 4, 8, 16, 17: as many graphs as 24 would),
    and only the last gap can be narrower than the grid's step."""
    grid = [1, 2, 4, 8, 16, 24, 32] + list(range(48, max_num_seqs + 16, 16))
    return [s for s in grid if s < max_num_seqs] + [max_num_seqs]


def row_words(max_bs: int) -> int:
    """Words per row of a step's staged int32 block: max_bs rounded up to a multiple of 4, so every row starts on
    a 16-byte boundary. Triton specialises pointer arguments on 16-byte alignment: rows (positions, slots,
    context lengths) starting off it would compile and capture other variants of the kernels reading them than
    the ones warm-up compiled, whenever max_num_seqs is not a multiple of 4."""
    return -(-max_bs // 4) * 4


class DecodeGraphs:
    def __init__(self, model: LlamaFamilyForCausalLM, kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                 block_size: int, max_model_len: int, max_num_seqs: int, device: str, capture: bool,
                 block_tables: BlockTables | None = None, forward: Callable[..., torch.Tensor] | None = None,
                 pool=None) -> None:  # noqa: ANN001 - pool: a CUDA graph pool handle to share (another model's graphs)
        self.model = model
        # What a bucket's step runs: the model, or on CPU its compiled decode (shared/engine/cpu_compile.py).
        self.forward = forward if forward is not None else model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.device = device
        self.buckets = batch_buckets(max_num_seqs)
        self.max_bs = self.buckets[-1]
        self.width = -(-max_model_len // block_size)
        # The runner's tables (shared/engine/block_tables.py): rows updated incrementally, one gather per step.
        self.block_tables = block_tables if block_tables is not None else BlockTables(self.width)
        pinned = device.startswith("cuda")
        # Rows: ids, positions, slots, context lengths; one copy per step. Two host sets used in turn, each
        # rewritten only after its last copy ran (shared/engine/staging.py).
        self.stream = copy_stream_for(device)
        words = row_words(self.max_bs)
        self.staging = StagingRing([(torch.zeros(4, words, dtype=torch.int32, pin_memory=pinned),
                                     torch.zeros(self.max_bs * self.width, dtype=torch.int32, pin_memory=pinned))
                                    for _ in range(2 if self.stream is not None else 1)], self.stream)
        self.vec = torch.zeros(4, words, dtype=torch.int32, device=device)  # columns past max_bs: never read
        self.tables = torch.zeros(self.max_bs, self.width, dtype=torch.int32, device=device)
        empty = torch.zeros(1, dtype=torch.int32, device=device)
        self._no_prefill = (empty, empty[:0], torch.zeros(0, 0, dtype=torch.int32, device=device))
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.pool = pool  # the graphs' memory pool once captured: the verify graphs share it (verify_graphs.py)
        if capture:
            self._capture_all()

    def _meta(self, bs: int) -> AttentionMetadata:
        qs, pctx, ptab = self._no_prefill
        return AttentionMetadata(
            slot_mapping=self.vec[2, :bs], num_prefill_tokens=0, prefill_query_start=qs,
            prefill_context_lens=pctx, prefill_block_tables=ptab, max_prefill_query_len=0,
            decode_context_lens=self.vec[3, :bs], decode_block_tables=self.tables[:bs],
            sliding_window=self.model.cfg.sliding_window)

    def _forward(self, bs: int) -> torch.Tensor:
        return self.forward(self.vec[0, :bs], self.vec[1, :bs], self._meta(bs), self.kv_caches)

    def _padding_only(self) -> None:
        """Every row writes nowhere and reads one token of block 0."""
        self.vec[2].fill_(-1)
        self.vec[3].fill_(1)

    @torch.inference_mode()
    def warm_all(self) -> list[tuple[int, float]]:
        """Run every bucket once, smallest first, without capture: what compiles a compiled forward (CPU) for
        every shape a serving step can have. Returns (bucket, seconds) per bucket."""
        self._padding_only()
        times = []
        for bs in self.buckets:
            t = time.perf_counter()
            self._forward(bs)
            times.append((bs, time.perf_counter() - t))
        return times

    @torch.inference_mode()
    def _capture_all(self) -> None:
        self._padding_only()
        pool = self.pool
        for bs in reversed(self.buckets):  # largest first, so the smaller graphs reuse its pool memory
            self._forward(bs)  # warm-up: compiles the Triton kernels, settles cuBLAS workspaces
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, **capture_kwargs(pool)):
                self.outputs[bs] = self._forward(bs)
            pool = graph.pool()
            self.graphs[bs] = graph
        torch.cuda.synchronize(self.device)
        self.pool = pool
        log.info("captured CUDA graphs for decode batch sizes %s", self.buckets)

    def bucket(self, n: int) -> int | None:
        return next((b for b in self.buckets if b >= n), None)

    def can_run(self, plan: list[tuple[Sequence, int]]) -> bool:
        """A decode-only step that fits a bucket (every context fits the table width by construction)."""
        return 0 < len(plan) <= self.max_bs and all(n == 1 for _, n in plan)

    @torch.inference_mode()
    def run(self, plan: list[tuple[Sequence, int]]) -> torch.Tensor:
        """Hidden states [len(plan), hidden] of a decode-only step."""
        bs, n, _ = self.stage(plan)
        return self.replay(bs, n)

    def stage(self, plan: list[tuple[Sequence, int]]) -> tuple[int, int, int]:
        """The step's rows into the static buffers (self.vec, self.tables[:bs, :width]); (bs, n, width)."""
        n = len(plan)
        bs = self.bucket(n)
        bsz = self.block_size
        ids, positions, slots, ctx = [], [], [], []
        for seq, _ in plan:
            pos = seq.num_computed_tokens
            ids.append(seq.token_ids[pos])
            positions.append(pos)
            slots.append(seq.block_table[pos // bsz] * bsz + pos % bsz)
            ctx.append(pos + 1)
        width = -(-max(ctx) // bsz)
        pad = bs - n
        vec, host_tables = self.staging.acquire()
        vec[:, :bs] = torch.tensor([ids + [0] * pad, positions + [0] * pad, slots + [-1] * pad, ctx + [1] * pad],
                                   dtype=torch.int32)
        rows = [self.block_tables.sync(seq, -(-c // bsz)) for (seq, _), c in zip(plan, ctx)]
        host_t = host_tables[: bs * width]
        table = host_t.view(bs, width)
        self.block_tables.gather(rows, width, out=table[:n])
        table[n:, 0] = 0  # padding rows read one token of block 0
        if self.stream is None:
            self.vec.copy_(vec)
            self.tables[:bs, :width].copy_(host_t.view(bs, width))
        else:
            self.stream.copy(self.vec, vec)
            self.stream.copy(self.tables[:bs, :width], host_t.view(bs, width))
            self.staging.sent()
        return bs, n, width

    def load(self, bs: int, width: int, vec: torch.Tensor, tables: torch.Tensor) -> None:
        """A tensor-parallel follower: rank 0's staged rows ([4, bs] and [bs, width], on the device) into the
        static buffers its own graphs read."""
        self.vec[:, :bs].copy_(vec)
        self.tables[:bs, :width].copy_(tables)

    @torch.inference_mode()
    def replay(self, bs: int, n: int) -> torch.Tensor:
        """The staged step of bucket bs: its first n rows (the graph, or the same forward eagerly)."""
        graph = self.graphs.get(bs)
        if graph is None:
            return self._forward(bs)[:n]
        graph.replay()
        return self.outputs[bs][:n]
