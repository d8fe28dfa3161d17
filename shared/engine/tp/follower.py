"""Ranks 1..N-1: hold this rank's weight and KV shards and do what rank 0 broadcasts, until told to stop.

A follower decides nothing: it has no scheduler, no block manager and no sampler; the block ids, slots and
block tables it computes over are rank 0's (identical on every rank, only the heads differ)."""
from __future__ import annotations

import logging

import torch

from kernels import AttentionMetadata
from shared.engine.kv_cache import gather_blocks, write_blocks
from shared.engine.model_runner import ModelRunner
from shared.engine.tp.channel import TPChannel
from shared.engine.tp.kv_heads import gather_heads, scatter_heads
from shared.engine.tp.step_message import KV_DTYPES, Op, StepLayout
from shared.models.tp.degree import kv_replicas

log = logging.getLogger(__name__)


@torch.inference_mode()
def follow(runner: ModelRunner, channel: TPChannel, rank: int, size: int) -> None:
    model = runner.model
    kept: torch.Tensor | None = None
    replicas = kv_replicas(model.cfg, size)  # ranks holding each KV head: whole blocks take each head once
    while True:
        header, payload = channel.receive()
        op, args = header.op, header.args
        if op == Op.STOP:
            return
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
