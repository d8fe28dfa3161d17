"""Ranks 1..N-1: hold this rank's weight and KV shards and do what rank 0 broadcasts, until told to stop.

A follower decides nothing: it has no scheduler, no block manager and no sampler; the block ids, slots and
block tables it computes over are rank 0's (identical on every rank, only the heads differ)."""
from __future__ import annotations

import logging
from collections.abc import Callable

import torch
import torch.distributed as dist

from kernels import AttentionMetadata
from shared.engine.kv_cache import gather_blocks, write_blocks
from shared.engine.model_runner import ModelRunner
from shared.engine.tp.channel import TPChannel
from shared.engine.tp.kv_heads import gather_heads, scatter_heads
from shared.engine.tp.rank_memory import RankMemory
from shared.engine.tp.shard_link import ShardLink, ShardTarget, ShardTransport, local_kv
from shared.engine.tp.step_message import KV_DTYPES, Op, StepLayout, unpack_strings
from shared.kv_blocks import KVBlocks
from shared.models.tp.degree import kv_replicas

log = logging.getLogger(__name__)


@torch.inference_mode()
def follow(runner: ModelRunner, channel: TPChannel, rank: int, size: int, memory: RankMemory | None = None,
           shard_transport: Callable[[], ShardTransport] | None = None) -> None:
    """shard_transport: the data plane of rank-to-rank KV, opened by the first such op; None: this rank has none."""
    model = runner.model
    memory = memory or RankMemory(runner.device)
    real: list | None = None  # the real KV cache while the memory profile's temporary one is in
    kept: torch.Tensor | None = None
    replicas = kv_replicas(model.cfg, size)  # ranks holding each KV head: whole blocks take each head once
    link: ShardLink | None = None  # the data plane, opened by the first rank-to-rank op
    try:
        while True:
            header, payload = channel.receive()
            if header.op == Op.STOP:
                return
            if header.op == Op.PROFILE_KV:
                real = _profile_cache(runner, memory, header.args, real)
                continue
            if header.op == Op.MEMORY:
                dist.gather(memory.report(), None, dst=0, group=channel.control)
                continue
            if header.op in (Op.LISTEN, Op.EXPECT, Op.FORGET, Op.SEND_SHARDS):
                if shard_transport is None:
                    raise RuntimeError("rank-to-rank KV asked of a rank started without a data plane: a worker's "
                                       "engine starts its ranks with one (services/tp_rank.py)")
                link = link or ShardLink(lambda: runner.kv_caches, shard_transport())
                _rank_to_rank(link, runner, channel, rank, header.op, header.args, payload)
                continue
            kept = _do(runner, channel, rank, size, replicas, header.op, header.args, payload, kept)
    finally:
        if link is not None:
            link.close()


def _profile_cache(runner: ModelRunner, memory: RankMemory, args: tuple[int, ...], real: list | None) -> list | None:
    """PROFILE_KV: swap the profile's temporary cache in (measuring from there) or the real one back; the real."""
    if args[2]:
        real = runner.kv_caches
        before = memory.allocated()
        runner.allocate_kv_cache(args[0], KV_DTYPES[args[1]])
        memory.profile_started(sum(t.numel() * t.element_size() for layer in runner.kv_caches for t in layer), before)
        return real
    memory.profile_ended()
    runner.kv_caches = real
    return None


def _rank_to_rank(link: ShardLink, runner: ModelRunner, channel: TPChannel, rank: int, op: Op,
                  args: tuple[int, ...], payload: torch.Tensor | None) -> None:
    """This rank's side of the rank-to-rank KV ops (shared/engine/tp/shard_link.py)."""
    if op == Op.LISTEN:
        port = link.listen(unpack_strings(payload)[0].decode())
        dist.gather(torch.tensor([port], dtype=torch.int64), None, dst=0, group=channel.control)
    elif op == Op.FORGET:  # a receiver's transfer over, or a sender's abandoned
        tid = unpack_strings(payload)[0].decode()
        link.forget(tid)
        link.abandon(tid)
    elif op == Op.EXPECT:
        n, first_block, deadline_ms = args[0], args[1], args[2]
        tid, token = unpack_strings(payload[n:])
        link.expect(tid.decode(), token, payload[:n].tolist(), first_block, deadline_ms / 1e3)
    elif op == Op.SEND_SHARDS:
        n, first_block, final, deadline_ms = args[0], args[1], bool(args[2]), args[3]
        tid, token, *endpoints = unpack_strings(payload[n:])
        k, v = gather_blocks(runner.kv_caches, payload[:n].tolist())
        target = ShardTarget(tid.decode(), token, tuple(e.decode() for e in endpoints), deadline_ms / 1e3)
        error = link.send(target, target.rank_endpoints[rank - 1], KVBlocks(local_kv(k), local_kv(v), first_block),
                          final)
        if error is not None:
            log.warning("rank %d could not send its KV shard of %s: %s", rank, target.transfer_id, error)
        if final:
            ok = torch.tensor([0 if error else 1], dtype=torch.int64)
            dist.all_reduce(ok, op=dist.ReduceOp.MIN, group=channel.control)


def _do(runner: ModelRunner, channel: TPChannel, rank: int, size: int, replicas: int, op: Op, args: tuple[int, ...],
        payload: torch.Tensor | None, kept: torch.Tensor | None) -> torch.Tensor | None:
    """One of rank 0's compute ops; the hidden rows kept for a later LOGITS."""
    model = runner.model
    if op == Op.ALLOCATE:
        runner.allocate_kv_cache(args[0], KV_DTYPES[args[1]])
    elif op == Op.STEP:
        layout = StepLayout.from_args(args)
        v = layout.unpack(payload)
        meta = AttentionMetadata(
            slot_mapping=v["slot_mapping"], num_prefill_tokens=layout.num_prefill_tokens,
            prefill_query_start=v["prefill_query_start"], prefill_context_lens=v["prefill_context_lens"],
            prefill_block_tables=v["prefill_block_tables"], max_prefill_query_len=layout.max_prefill_query_len,
            decode_context_lens=v["decode_context_lens"], decode_block_tables=v["decode_block_tables"],
            sliding_window=runner.sliding_window)
        hidden = model(v["ids"], v["positions"], meta, runner.kv_caches)
        rows = v["rows"].long()
        n = layout.num_sample_rows
        model.compute_logits(hidden[rows[:n]])  # this rank's share of the gather; rank 0 samples
        kept = hidden[rows[n:]]
    elif op == Op.GRAPHS:
        runner.use_decode_graphs(args[0], args[1], capture=bool(args[2]))
    elif op == Op.GRAPH_STEP:
        bs, n, width = args[0], args[1], args[2]
        rows, tables = payload[: 4 * bs].view(4, bs), payload[4 * bs : 4 * bs + bs * width].view(bs, width)
        runner.graphs.load(bs, width, rows, tables)
        model.compute_logits(runner.graphs.replay(bs, n))  # this rank's share of the gather; rank 0 samples
    elif op == Op.LOGITS:
        assert kept is not None
        model.compute_logits(kept[args[0] : args[1]])
    elif op == Op.GATHER:
        k, v_ = gather_blocks(runner.kv_caches, payload.tolist())
        gather_heads(k, size, rank, channel.compute, replicas)
        gather_heads(v_, size, rank, channel.compute, replicas)
    elif op == Op.WRITE:
        ids = payload.tolist()
        first_layer, num_layers = args[0], args[1]
        cache = runner.kv_caches[0][0]
        shape = (num_layers, len(ids), *cache.shape[1:])
        k = scatter_heads(None, torch.empty(shape, dtype=cache.dtype, device=cache.device), size, rank,
                          channel.compute, replicas)
        v_ = scatter_heads(None, torch.empty(shape, dtype=cache.dtype, device=cache.device), size, rank,
                           channel.compute, replicas)
        write_blocks(runner.kv_caches, ids, k, v_, first_layer)
    else:  # pragma: no cover - Header.decode accepts only known ops
        raise ValueError(f"unknown op {op}")
    return kept
