"""Turns a scheduler plan into tensors, runs the model over the paged cache, returns logits.

It decides no policy: which tokens to compute comes from the plan, what to sample from the sampler.
Every integer a step needs (token ids, positions, slots, chunk offsets, context lengths, block tables, the
rows to sample) is written into one host buffer (pinned on CUDA, two used in turn) and sent to the device in one
non-blocking copy; the metadata are views into that one device buffer. Nothing in the step waits for the
device: the logits come back on it, and the sampler's single copy of sampled ids is the step's only sync.
"""
from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from collections.abc import Sequence as Seq
from contextlib import contextmanager
from itertools import accumulate
from typing import NamedTuple

import torch

from kernels import AttentionMetadata
from kernels.cpu.extension import native_available
from kernels.cpu.thread_pool import stats as pool_stats
from kernels.cpu.thread_pool import use_torch_team
from kernels.extend_attention import tune_extend_tiles
from kernels.token_bitmask import apply_token_bitmask
from shared.engine.block_tables import BlockTables
from shared.engine.cuda_graphs import DecodeGraphs
from shared.engine.kv_cache import KVCaches, allocate_kv_cache, gather_blocks, write_blocks
from shared.engine.sequence import Sequence
from shared.engine.staging import CopyStream, StagingRing, copy_stream_for
from shared.engine.verify_buckets import VerifyGraphPlan
from shared.engine.verify_graphs import VerifyGraphs, VerifyGraphStats, is_verify
from shared.models.cpu_native import MAX_CHUNK, choose_kernel_threads, native_decode_for
from shared.models.llama import LlamaFamilyForCausalLM
from shared.sampling_params import SamplingParams


ALIGN = 4  # int32 elements: 16 bytes
log = logging.getLogger(__name__)


class FedTokens(NamedTuple):
    """Input ids a step reads on the device, not from the host: the previous step's samples, whose host copy is
    still on its way (async scheduling, shared/engine/async_step.py). The one-token row of plan index rows[i]
    takes tokens[src[i]]; the host holds a placeholder there."""

    rows: list[int]
    src: list[int]
    tokens: torch.Tensor


class StepBuffers:
    """The step's int32 staging buffers on the host (two, pinned, on CUDA: shared/engine/staging.py) and one
    buffer on the device, grown on demand. On CPU one buffer is both."""

    def __init__(self, device: str, capacity: int = 1 << 16, stream: CopyStream | None | str = "auto") -> None:
        self.device = device
        self.stream = copy_stream_for(device) if stream == "auto" else stream
        self._alloc(capacity)

    def _alloc(self, capacity: int) -> None:
        self.capacity = capacity
        if self.stream is None:
            self.dev = torch.empty(capacity, dtype=torch.int32, device=self.device)
            self.ring = StagingRing([self.dev], None)
            return
        pinned = self.device.startswith("cuda")
        # Host buffers given up by a growth may still be read by an enqueued copy: torch's pinned-memory
        # allocator keeps them until that copy has run.
        self.ring = StagingRing([torch.empty(capacity, dtype=torch.int32, pin_memory=pinned) for _ in range(2)],
                                self.stream)
        self.dev = torch.empty(capacity, dtype=torch.int32, device=self.device)

    def upload(self, chunks: list[list[int] | torch.Tensor]) -> list[torch.Tensor]:
        """Copy the chunks (lists of ints, or int32 tensors such as block tables) in one transfer; return one
        device view per chunk, shaped like it.

        Each chunk starts on a 16-byte boundary: Triton specialises a pointer argument on its alignment, so
        views at arbitrary offsets would compile a new kernel variant whenever a step's sizes moved them.
        The lists go into the buffer as one flat list (torch.tensor of one list is the fastest fill for
        Python ints), the tensors after them."""
        flat: list[int] = []
        starts: list[int] = [0] * len(chunks)
        tensors = []
        for i, c in enumerate(chunks):
            if isinstance(c, torch.Tensor):
                tensors.append(i)
                continue
            starts[i] = len(flat)
            flat.extend(c)
            flat.extend([0] * (-len(flat) % ALIGN))
        total = len(flat)
        for i in tensors:
            starts[i] = total
            total += chunks[i].numel() + (-chunks[i].numel() % ALIGN)
        if total > self.capacity:
            self._alloc(max(total, 2 * self.capacity))
        host = self.ring.acquire()  # waits, if ever, for the copy that last read this buffer
        if flat:
            host[: len(flat)] = torch.tensor(flat, dtype=torch.int32)
        for i in tensors:
            host[starts[i] : starts[i] + chunks[i].numel()].view(chunks[i].shape).copy_(chunks[i])
        if self.stream is not None:
            self.stream.copy(self.dev[:total], host[:total])
            self.ring.sent()
        views = []
        for at, c in zip(starts, chunks):
            if isinstance(c, torch.Tensor):
                views.append(self.dev[at : at + c.numel()].view(c.shape))
            else:
                views.append(self.dev[at : at + len(c)])
        return views


class ModelRunner:
    """Owns what a step runs on: the paged KV pool and the decode graphs over it (both built here)."""

    def __init__(self, model: LlamaFamilyForCausalLM, block_size: int, device: str) -> None:
        self.model = model
        self.kv_caches: KVCaches = []  # none until allocate_kv_cache (the memory profile runs before)
        self.block_size = block_size
        self.device = device
        self.sliding_window = model.cfg.sliding_window
        self.buffers = StepBuffers(device)
        self.tables = BlockTables()  # every running sequence's block table, kept across steps
        self.graphs: DecodeGraphs | None = None  # built by use_decode_graphs once the KV pool exists
        self.verify_graphs: VerifyGraphs | None = None  # built by use_verify_graphs (speculative decoding)
        self.verify_stats = VerifyGraphStats()  # verify steps replayed, padded eagerly, or eager
        # LoRA adapters' slots and per-step rows (shared/engine/lora_manager.py); None: none served. A step with an
        # adapter row runs eagerly, in Python (no C++ stack, no decode graph); other steps are unchanged.
        self.lora = None
        # On CPU, small steps (decode, verify, short chunks) through the C++ decoder stack (shared/models/cpu_native.py)
        self.native, why = native_decode_for(model, device)
        self.own_loops = False
        if device == "cpu":
            log.info("CPU step path: %s", f"C++ decoder stack for steps of chunks <= {MAX_CHUNK} rows or whole "
                     f"prompts <= {self.native.short_prompt} tokens ({why})"
                     if self.native is not None else f"Python, torch twins ({why})")
            if native_available():
                log.info("%s", choose_kernel_threads(model))
                # Own threads serve the C++ stack's steps; a Python step interleaves the kernels' matmuls with
                # torch's ops, and two teams taking the cores in turn cost it 1.4-1.6x (a 64-row bf16 prompt), so its
                # loops go to torch's team (set every step: a draft model's runner shares the process).
                self.own_loops = not pool_stats()[4]

    # --- the KV pool and the graphs over it ----------------------------------------------------

    def allocate_kv_cache(self, num_blocks: int, dtype: torch.dtype) -> None:
        self.kv_caches = allocate_kv_cache(self.model.cache_config, num_blocks, self.block_size, dtype, self.device)

    @contextmanager
    def temporary_kv_cache(self, num_blocks: int, dtype: torch.dtype) -> Iterator[int]:
        """A KV pool for a dummy step (the memory profile), in place of the real one until the block ends;
        yields its size in bytes."""
        real = self.kv_caches
        self.allocate_kv_cache(num_blocks, dtype)
        try:
            yield sum(t.numel() * t.element_size() for layer in self.kv_caches for t in layer)
        finally:
            self.kv_caches = real

    def use_decode_graphs(self, max_model_len: int, max_num_seqs: int, capture: bool = True,
                          forward: Callable[..., torch.Tensor] | None = None, pool=None) -> DecodeGraphs:  # noqa: ANN001
        """Decode steps go through static padded buffers from now on, captured as CUDA graphs when capture
        (capture=False runs the same path eagerly: what CPU tests and benches check). forward: what runs a
        bucket instead of the model (the compiled CPU decode, shared/engine/cpu_compile.py). pool: another
        model's graph pool to capture into (a draft model's graphs share the target's)."""
        self.graphs = DecodeGraphs(self.model, self.kv_caches, self.block_size, max_model_len, max_num_seqs,
                                   self.device, capture=capture, block_tables=self.tables, forward=forward, pool=pool)
        return self.graphs

    def use_verify_graphs(self, plan: VerifyGraphPlan, capture: bool = True) -> VerifyGraphs:
        """Verify steps (speculative decoding) that fit a bucket of `plan` go through static padded buffers from
        now on, captured as CUDA graphs when capture (after the decode graphs, in their pool); capture=False runs
        the same padded path eagerly (CPU tests and benches)."""
        pool = self.graphs.pool if self.graphs is not None else None
        self.verify_graphs = VerifyGraphs(self.model, self.kv_caches, self.block_size, plan, self.device, capture,
                                          self.tables, self.verify_stats, pool)
        return self.verify_graphs

    def gather_blocks(self, block_ids: Seq[int]) -> tuple[torch.Tensor, torch.Tensor]:
        return gather_blocks(self.kv_caches, block_ids)

    def read_blocks(self, block_ids: Seq[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Copies of K and V of physical blocks: [layers, n, block_size, kv_heads, head_dim] each, on CPU."""
        k, v = gather_blocks(self.kv_caches, block_ids)
        return k.cpu(), v.cpu()

    def write_blocks(self, block_ids: Seq[int], k: torch.Tensor, v: torch.Tensor, first_layer: int = 0) -> None:
        write_blocks(self.kv_caches, block_ids, k, v, first_layer)

    # --- a step ---------------------------------------------------------------------------------

    def _slots(self, table: list[int], start: int, end: int) -> list[int]:
        bs = self.block_size
        return [table[p // bs] * bs + p % bs for p in range(start, end)]

    def build(self, plan: list[tuple[Sequence, int]], sample_rows: list[int], fed: FedTokens | None = None
              ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor, list[int]]:
        """Inputs of one step: (ids, positions, metadata, rows to sample, plan order of the step's rows).

        Rows are reordered so prompt chunks come first and decode rows last; `order[i]` is the plan index
        of the i-th sequence in the step, and sample_rows are mapped to the new row numbers."""
        chunks = [i for i, (_, n) in enumerate(plan) if n > 1]  # a 1-token chunk is a decode row like any other
        decodes = [i for i, (_, n) in enumerate(plan) if n == 1]
        order = chunks + decodes
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        new_row: dict[int, int] = {}  # old row (plan order) -> new row (step order)
        old_start = list(accumulate((n for _, n in plan), initial=0))  # each sequence's first row, plan order
        qstart = [0]
        pctx: list[int] = []
        prows: list[int] = []
        dctx: list[int] = []
        drows: list[int] = []
        pw = dw = 0
        bs = self.block_size
        tables = self.tables
        for i in order:
            seq, n = plan[i]
            start = seq.num_computed_tokens
            ctx = start + n
            at = len(ids)
            for j in range(n):
                new_row[old_start[i] + j] = at + j
            nblk = -(-ctx // bs)
            row = tables.sync(seq, nblk)
            if n > 1:
                ids.extend(seq.token_ids[start:ctx])
                if ctx > seq.num_tokens:  # a verify step: the drafts follow the last token
                    ids.extend(seq.spec_token_ids[: ctx - seq.num_tokens])
                positions.extend(range(start, ctx))
                slots.extend(self._slots(seq.block_table, start, ctx))
                qstart.append(qstart[-1] + n)
                pctx.append(ctx)
                prows.append(row)
                pw = max(pw, nblk)
            else:
                ids.append(seq.token_ids[start])
                positions.append(start)
                slots.append(seq.block_table[start // bs] * bs + start % bs)
                dctx.append(ctx)
                drows.append(row)
                dw = max(dw, nblk)
        # Entries of a row past its sequence's blocks are never read (each kernel stops at its context length).
        rows = [new_row[r] for r in sample_rows]
        fed_rows = [new_row[old_start[i]] for i in fed.rows] if fed else []
        (ids_t, pos_t, slot_t, qs_t, pctx_t, dctx_t, rows_t, ptab_t, dtab_t, fed_t, src_t) = self.buffers.upload(
            [ids, positions, slots, qstart if pctx else [0], pctx, dctx, rows, tables.gather(prows, pw),
             tables.gather(drows, dw), fed_rows, fed.src if fed else []])
        if fed:
            feed(ids_t, fed_t, src_t, fed.tokens)
        meta = AttentionMetadata(
            slot_mapping=slot_t, num_prefill_tokens=qstart[-1], prefill_query_start=qs_t,
            prefill_context_lens=pctx_t, prefill_block_tables=ptab_t,
            max_prefill_query_len=max((b - a for a, b in zip(qstart, qstart[1:])), default=0),
            decode_context_lens=dctx_t, decode_block_tables=dtab_t,
            sliding_window=self.sliding_window)
        return ids_t, pos_t, meta, rows_t, order

    @torch.inference_mode()
    def warm_up(self) -> None:
        """One eager step with a prompt chunk and a decode row, then a structured-output mask on its logits:
        every Triton variant the engine can launch compiles here, at start, and never in a serving step
        (per-step sizes are never specialised: kernels/decode_attention.py, StepBuffers.upload), which
        tests/test_warm_up.py checks. Its K/V goes to block 0, free at start."""
        params = SamplingParams(max_tokens=1)
        chunk = Sequence("warm-up-chunk", [0, 0, 0], params)
        # A decode row over 5 blocks (all block 0): more than one split, so the reduce kernel compiles too. A
        # model too short for 5 blocks never splits a decode (kernels/decode_attention.default_num_splits).
        ctx = min(4 * self.block_size + 2, self.model.cos_sin.shape[0])
        decode = Sequence("warm-up-decode", [0] * ctx, params)
        decode.num_computed_tokens = ctx - 1
        chunk.block_table = [0]
        decode.block_table = [0] * -(-ctx // self.block_size)
        logits = self.execute([(chunk, 2), (decode, 1)], [1, 2])
        # On the float32 rows the sampler masks (shared/engine/sampler.py).
        apply_token_bitmask(logits.float(), torch.full((2, -(-logits.shape[1] // 32)), -1, dtype=torch.int32))
        if self.device.startswith("cuda"):
            # The prefill attention's tiles, timed on this GPU for this model (kernels/extend_attention.py): the
            # candidates compile here too, so no serving step compiles or tunes.
            cfg = self.model.cfg
            q = torch.empty(1, cfg.num_heads, cfg.head_dim, dtype=next(self.model.parameters()).dtype,
                            device=self.device)
            try:
                tuned = tune_extend_tiles(q, self.kv_caches[0][0], self.sliding_window)
                log.info("prefill attention tiles: %s (ms per candidate: %s)", tuned["chosen"], tuned["ms"])
            except Exception:  # noqa: BLE001 - tuning is an optimisation: the default tiles are always right
                log.exception("tuning the prefill attention tiles failed; keeping the default tiles")

    @torch.inference_mode()
    def execute(self, plan: list[tuple[Sequence, int]], sample_rows: list[int], fed: FedTokens | None = None
                ) -> torch.Tensor:
        """Run one step; return logits (model dtype), on the device, for the given rows (plan row numbering)."""
        with_lora = self.lora is not None and any(seq.lora is not None for seq, _ in plan)
        if with_lora:
            return self.execute_rows(plan, sample_rows, [], fed)[0]
        if self.graphs is not None and self.graphs.can_run(plan) and sample_rows == list(range(len(plan))):
            if fed is None:
                return self.model.compute_logits(self.graphs.run(plan))
            bs, n, _ = self.graphs.stage(plan)
            feed(self.graphs.vec[0], *self.buffers.upload([fed.rows, fed.src]), fed.tokens)  # rows in plan order
            return self.model.compute_logits(self.graphs.replay(bs, n))
        verify = self.verify_graphs
        if verify is not None:
            shape = verify.bucket(plan)
            if shape is not None:
                return self.model.compute_logits(verify.run(plan, sample_rows, shape))
        return self.execute_rows(plan, sample_rows, [], fed)[0]

    def prompt_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits of hidden rows execute_rows returned (prompt logprobs compute them in slices)."""
        return self.model.compute_logits(hidden)

    @torch.inference_mode()
    def execute_rows(self, plan: list[tuple[Sequence, int]], sample_rows: list[int], hidden_rows: list[int],
                     fed: FedTokens | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Run one (eager) step: logits (model dtype) of sample_rows and the hidden states of hidden_rows (whose
        logits the caller computes in slices: prompt logprobs), both on the device, plan row numbering."""
        if is_verify(plan):
            self.verify_stats.eager += 1
        ids, positions, meta, rows, order = self.build(plan, sample_rows + hidden_rows, fed)
        lora = self.lora is not None and self.lora.prepare(plan, order)
        try:
            native = not lora and self.native is not None and self.native.can_run(meta, self.kv_caches)
            if self.own_loops:
                use_torch_team(not native)
            if native:
                hidden = self.native(ids, positions, meta, self.kv_caches)
            else:
                hidden = self.model(ids, positions, meta, self.kv_caches)
        finally:
            if lora:
                self.lora.finish()
        rows = rows.long()
        n = len(sample_rows)
        return self.model.compute_logits(hidden[rows[:n]]), hidden[rows[n:]]


def feed(ids: torch.Tensor, rows: torch.Tensor, src: torch.Tensor, tokens: torch.Tensor) -> None:
    """ids[rows] = tokens[src], on the device: no host round trip, nothing waits."""
    ids[rows.long()] = tokens[src.long()].to(ids.dtype)
