"""Rank 0's model runner under tensor parallelism: the single-device runner, with every operation that touches
the model or the KV cache first broadcast to the follower ranks (shared/engine/tp/follower.py does the same
operation on its shards), and KV blocks gathered from / scattered to the ranks' head shards.

Decode graphs: every rank captures the same buckets in step (their all-reduces inside); a decode step sends the
followers only its staged rows, and each rank replays its own graph (CPU: the same padded path eagerly)."""
from __future__ import annotations

from collections.abc import Iterator
from collections.abc import Sequence as Seq
from contextlib import contextmanager

import torch
import torch.distributed as dist

from shared.engine.kv_cache import allocate_kv_cache, gather_blocks, write_blocks
from shared.engine.kv_placeholder import PLACEHOLDER_MESSAGE, is_placeholder
from shared.engine.model_runner import ModelRunner
from shared.engine.sequence import Sequence
from shared.engine.tp.kv_heads import gather_heads, scatter_heads
from shared.engine.verify_graphs import is_verify
from shared.engine.tp.launch import TPWorkers
from shared.engine.tp.rank_memory import FIELDS
from shared.engine.tp.shard_link import ShardSendError, ShardTarget, local_kv
from shared.engine.tp.step_message import KV_DTYPES, Header, Op, StepLayout, pack_strings
from shared.models.llama import LlamaFamilyForCausalLM
from shared.models.tp.degree import kv_replicas


class TPDriverRunner(ModelRunner):
    def __init__(self, model: LlamaFamilyForCausalLM, block_size: int, device: str, workers: TPWorkers) -> None:
        super().__init__(model, block_size, device)
        self.workers = workers
        self.channel = workers.channel
        self.size = workers.size
        self._kept: torch.Tensor | None = None  # the last step's hidden rows, for LOGITS
        # Whole blocks carry every KV head once; this rank holds local_kv_heads of them, each on `replicas` ranks.
        self.kv_heads = model.cfg.num_kv_heads
        self.local_kv_heads = model.cache_config.num_kv_heads
        self.replicas = kv_replicas(model.cfg, self.size)
        # Rank-to-rank transfers this rank receives: transfer id -> the blocks they fill. Only those blocks take
        # a write of this rank's shard alone (the followers' shards come to them directly).
        self._shard_transfers: dict[str, set[int]] = {}
        self.shard_writes = 0  # writes of this rank's shard alone (rank-to-rank pieces received)
        self.whole_writes = 0  # writes of whole blocks, scattered by heads

    # --- the KV pool ----------------------------------------------------------------------------

    def allocate_kv_cache(self, num_blocks: int, dtype: torch.dtype) -> None:
        with self.workers.guard("allocating the KV cache"):
            self.channel.send(Header(Op.ALLOCATE, 0, (num_blocks, KV_DTYPES.index(dtype))))
            super().allocate_kv_cache(num_blocks, dtype)

    @contextmanager
    def temporary_kv_cache(self, num_blocks: int, dtype: torch.dtype) -> Iterator[int]:
        """The memory profile's cache on every rank (each measures its own step around it: rank_memory.py)."""
        with self.workers.guard("swapping in the profile's KV cache"):
            self.channel.send(Header(Op.PROFILE_KV, 0, (num_blocks, KV_DTYPES.index(dtype), 1)))
        real = self.kv_caches
        self.kv_caches = allocate_kv_cache(self.model.cache_config, num_blocks, self.block_size, dtype, self.device)
        try:
            yield sum(t.numel() * t.element_size() for layer in self.kv_caches for t in layer)
        finally:
            self.kv_caches = real
            with self.workers.guard("swapping the KV cache back"):
                self.channel.send(Header(Op.PROFILE_KV, 0, (0, 0, 0)))

    def rank_memory(self) -> list[list[int]]:
        """The followers' memory reports (rank_memory.RankMemory.report), rank 1 first."""
        with self.workers.guard("gathering the ranks' memory profiles"):
            self.channel.send(Header(Op.MEMORY))
            parts = [torch.zeros(FIELDS, dtype=torch.int64) for _ in range(self.size)]
            dist.gather(torch.zeros(FIELDS, dtype=torch.int64), parts, dst=0, group=self.channel.control)
        return [p.tolist() for p in parts[1:]]

    def use_decode_graphs(self, max_model_len: int, max_num_seqs: int, capture: bool = True,
                          forward=None):  # noqa: ANN001
        """Every rank builds its decode graphs and captures them in step (a bucket's forward, all-reduces and all,
        is captured on all ranks at once); a decode step then broadcasts only the staged rows (GRAPH_STEP)."""
        if forward is not None:
            raise NotImplementedError("--cpu-compile does not run under tensor parallelism")
        with self.workers.guard("capturing decode graphs"):
            self.channel.send(Header(Op.GRAPHS, 0, (max_model_len, max_num_seqs, int(capture))))
            return super().use_decode_graphs(max_model_len, max_num_seqs, capture)

    def _local_shape(self, whole: torch.Tensor) -> list[int]:
        shape = list(whole.shape)
        shape[3] = self.local_kv_heads
        return shape

    def gather_blocks(self, block_ids: Seq[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of physical blocks with all heads, [layers, n, block_size, kv_heads, head_dim], on the device."""
        ids = list(block_ids)
        with self.workers.guard("gathering KV blocks"):
            self.channel.send(Header(Op.GATHER, len(ids)), torch.tensor(ids, dtype=torch.int32, device=self.device))
            k, v = gather_blocks(self.kv_caches, ids)
            group = self.channel.compute
            return (gather_heads(k, self.size, 0, group, self.replicas),
                    gather_heads(v, self.size, 0, group, self.replicas))

    def read_blocks(self, block_ids: Seq[int]) -> tuple[torch.Tensor, torch.Tensor]:
        k, v = self.gather_blocks(block_ids)
        return k.cpu(), v.cpu()

    def write_blocks(self, block_ids: Seq[int], k: torch.Tensor, v: torch.Tensor, first_layer: int = 0) -> None:
        if is_placeholder(k) or is_placeholder(v):
            raise ValueError(PLACEHOLDER_MESSAGE)
        ids = list(block_ids)
        layers = self.kv_caches[first_layer : first_layer + k.shape[0]]
        cache = self.kv_caches[0][0]
        if k.dim() == 5 and k.shape[3] == self.local_kv_heads != self.kv_heads:
            return self._write_own_shard(ids, k, v, first_layer)
        whole = (len(layers), len(ids), cache.shape[1], self.kv_heads, cache.shape[3])
        # Checked here, before any rank is told: a bad write must fail this request, not the ranks.
        if not layers or tuple(k.shape) != whole or tuple(v.shape) != whole:
            raise ValueError(f"KV blocks shaped {tuple(k.shape)}/{tuple(v.shape)} from layer {first_layer}, "
                             f"expected {whole}")
        if k.dtype != cache.dtype and torch.float8_e4m3fn in (k.dtype, cache.dtype):
            raise ValueError(f"KV blocks in {k.dtype} cannot be written into a {cache.dtype} cache")
        self.whole_writes += 1
        with self.workers.guard("writing KV blocks"):
            self.channel.send(Header(Op.WRITE, len(ids), (first_layer, len(layers))),
                              torch.tensor(ids, dtype=torch.int32, device=self.device))
            group = self.channel.compute
            mine = []
            for whole_t in (k, v):
                whole_t = whole_t.to(self.device, cache.dtype)
                out = torch.empty(self._local_shape(whole_t), dtype=cache.dtype, device=self.device)
                mine.append(scatter_heads(whole_t, out, self.size, 0, group, self.replicas))
            write_blocks(self.kv_caches, ids, mine[0], mine[1], first_layer)

    # --- rank-to-rank KV (shared/engine/tp/shard_link.py) -----------------------------------------

    def listen_shards(self, host: str) -> list[int]:
        """Open a KV receiver on every follower rank, on host; their ports, rank 1 first."""
        with self.workers.guard("opening the ranks' KV receivers"):
            words = pack_strings([host])
            self.channel.send(Header(Op.LISTEN, words.numel()), words.to(self.device))
            ports = [torch.zeros(1, dtype=torch.int64) for _ in range(self.size)]
            dist.gather(torch.zeros(1, dtype=torch.int64), ports, dst=0, group=self.channel.control)
        return [int(p) for p in ports[1:]]

    def expect_shards(self, transfer_id: str, token: bytes, block_ids: Seq[int], first_block: int,
                      deadline_s: float) -> None:
        """The followers accept their shards of logical blocks [first_block, ...) into block_ids, this rank its
        own through write_blocks."""
        ids = list(block_ids)
        with self.workers.guard("registering a rank-to-rank transfer"):
            words = torch.cat([torch.tensor(ids, dtype=torch.int32), pack_strings([transfer_id, token])])
            self.channel.send(Header(Op.EXPECT, words.numel(), (len(ids), first_block, int(deadline_s * 1e3))),
                              words.to(self.device))
        self._shard_transfers[transfer_id] = set(ids)

    def forget_shards(self, transfer_id: str) -> None:
        """Before the transfer's blocks can be reused: the followers refuse its later frames."""
        if self._shard_transfers.pop(transfer_id, None) is None:
            return
        with self.workers.guard("forgetting a rank-to-rank transfer"):
            words = pack_strings([transfer_id])
            self.channel.send(Header(Op.FORGET, words.numel()), words.to(self.device))

    def abandon_shards(self, transfer_id: str) -> None:
        """A rank-to-rank transfer this worker sends ends before its last piece: the followers drop its state."""
        with self.workers.guard("abandoning a rank-to-rank transfer"):
            words = pack_strings([transfer_id])
            self.channel.send(Header(Op.FORGET, words.numel()), words.to(self.device))

    def send_shards(self, target: ShardTarget, block_ids: Seq[int], first_block: int, final: bool
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Every follower sends its shard of the blocks to its decode rank (a last piece: after waiting for every
        piece's acks); then this rank's own shard (on the CPU) for the worker's usual path to decode rank 0.
        ShardSendError when any follower's piece failed (known at the last piece)."""
        if len(target.rank_endpoints) != self.size - 1:
            raise ShardSendError(f"{len(target.rank_endpoints) + 1} decode ranks for {self.size} prefill ranks")
        ids = list(block_ids)
        with self.workers.guard("sending KV shards rank to rank"):
            words = torch.cat([torch.tensor(ids, dtype=torch.int32),
                               pack_strings([target.transfer_id, target.token, *target.rank_endpoints])])
            self.channel.send(Header(Op.SEND_SHARDS, words.numel(),
                                     (len(ids), first_block, int(final), int(target.deadline_s * 1e3))),
                              words.to(self.device))
            k, v = gather_blocks(self.kv_caches, ids)
            ok = torch.ones(1, dtype=torch.int64)
            if final:  # the followers' every piece acked (earlier pieces went out while the prefill computed on)
                dist.all_reduce(ok, op=dist.ReduceOp.MIN, group=self.channel.control)
        if not int(ok):
            raise ShardSendError(f"a follower rank could not send its KV shard of {target.transfer_id}")
        return local_kv(k), local_kv(v)

    def _write_own_shard(self, ids: list[int], k: torch.Tensor, v: torch.Tensor, first_layer: int) -> None:
        """Rank 0's shard of a rank-to-rank transfer: written here alone (each follower got its own)."""
        expected = set().union(*self._shard_transfers.values()) if self._shard_transfers else set()
        if not set(ids) <= expected:
            raise ValueError(f"KV blocks with {k.shape[3]} of {self.kv_heads} KV heads for blocks no rank-to-rank "
                             f"transfer reserved")
        cache = self.kv_caches[0][0]
        if tuple(k.shape[2:]) != tuple(cache.shape[1:]) or k.shape != v.shape or k.dtype != cache.dtype:
            raise ValueError(f"KV shard {tuple(k.shape)} {k.dtype} does not fit {tuple(cache.shape)} {cache.dtype}")
        write_blocks(self.kv_caches, ids, k.to(self.device), v.to(self.device), first_layer)
        self.shard_writes += 1

    # --- a step ---------------------------------------------------------------------------------

    @torch.inference_mode()
    def execute(self, plan: list[tuple[Sequence, int]], sample_rows: list[int]) -> torch.Tensor:
        graphs = self.graphs
        if graphs is None or not graphs.can_run(plan) or sample_rows != list(range(len(plan))):
            return self.execute_rows(plan, sample_rows, [])[0]
        bs, n, width = graphs.stage(plan)
        payload = torch.cat([graphs.vec[:, :bs].reshape(-1), graphs.tables[:bs, :width].reshape(-1)])
        with self.workers.guard("replaying a decode graph"):
            self.channel.send(Header(Op.GRAPH_STEP, payload.numel(), (bs, n, width)), payload)
            return self.model.compute_logits(graphs.replay(bs, n))

    @torch.inference_mode()
    def execute_rows(self, plan: list[tuple[Sequence, int]], sample_rows: list[int], hidden_rows: list[int]
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        if is_verify(plan):
            self.verify_stats.eager += 1  # tensor parallel: every verify step is eager
        ids, positions, meta, rows, _ = self.build(plan, sample_rows + hidden_rows)
        layout = StepLayout.of(self.buffers.dev, [
            ids, positions, meta.slot_mapping, meta.prefill_query_start, meta.prefill_context_lens,
            meta.decode_context_lens, rows, meta.prefill_block_tables, meta.decode_block_tables],
            meta.num_prefill_tokens, meta.max_prefill_query_len, len(sample_rows), len(hidden_rows))
        with self.workers.guard("running a step"):
            self.channel.send(Header(Op.STEP, layout.payload_len, layout.args()),
                              self.buffers.dev[: layout.payload_len])
            hidden = self.model(ids, positions, meta, self.kv_caches)
            rows = rows.long()
            n = len(sample_rows)
            logits = self.model.compute_logits(hidden[rows[:n]])
        self._kept = hidden[rows[n:]]
        return logits, self._kept

    def prompt_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits of a slice of the last step's hidden rows (record_prompt_logprobs slices them): the followers
        are told which rows, and run the head over their own copy of the same rows."""
        kept = self._kept
        assert kept is not None and hidden.untyped_storage().data_ptr() == kept.untyped_storage().data_ptr(), \
            "prompt logits only of the last step's hidden rows"
        start = (hidden.storage_offset() - kept.storage_offset()) // kept.stride(0)
        with self.workers.guard("computing prompt logits"):
            self.channel.send(Header(Op.LOGITS, 0, (start, start + hidden.shape[0])))
            return self.model.compute_logits(hidden)


def runner_for(model: LlamaFamilyForCausalLM, block_size: int, device: str, workers: TPWorkers | None) -> ModelRunner:
    """The single-device runner, or rank 0's of a tensor-parallel engine."""
    return ModelRunner(model, block_size, device) if workers is None else TPDriverRunner(model, block_size, device, workers)
