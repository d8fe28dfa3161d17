"""Turns a scheduler plan into tensors, runs the model over the paged cache, returns logits.

It decides no policy: which tokens to compute comes from the plan, what to sample from the sampler.
"""
from __future__ import annotations

import torch

from kernels import AttentionMetadata, DecodeBatch, PrefillSpan
from shared.engine.sequence import Sequence
from shared.models.llama import LlamaFamilyForCausalLM


class ModelRunner:
    def __init__(self, model: LlamaFamilyForCausalLM, kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                 block_size: int, device: str) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.device = device
        self.sliding_window = model.cfg.sliding_window
        self.dtype = kv_caches[0][0].dtype

    def _slots(self, block_table: list[int], start: int, end: int) -> torch.Tensor:
        pos = torch.arange(start, end)
        table = torch.tensor(block_table, dtype=torch.long)
        return table[pos // self.block_size] * self.block_size + pos % self.block_size

    def _window(self, q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
        """Which keys each query may see: causal, and inside the sliding window if the model has one."""
        allowed = k_pos[None, :] <= q_pos[:, None]
        if self.sliding_window is not None:
            allowed &= k_pos[None, :] > q_pos[:, None] - self.sliding_window
        return allowed

    def build(self, plan: list[tuple[Sequence, int]]) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        ids: list[int] = []
        positions: list[torch.Tensor] = []
        slots: list[torch.Tensor] = []
        prefills: list[PrefillSpan] = []
        decode_rows: list[int] = []
        decode_seqs: list[Sequence] = []
        for seq, n in plan:
            start = seq.num_computed_tokens
            row = len(ids)
            ids.extend(seq.token_ids[start : start + n])
            positions.append(torch.arange(start, start + n))
            slots.append(self._slots(seq.block_table, start, start + n))
            ctx = start + n
            if n == 1:
                decode_rows.append(row)
                decode_seqs.append(seq)
            elif start == 0:
                needs_mask = self.sliding_window is not None and n > self.sliding_window
                pos = torch.arange(n)
                prefills.append(PrefillSpan(row, n, ctx, None, self._window(pos, pos) if needs_mask else None))
            else:
                k_pos = torch.arange(ctx)
                mask = self._window(torch.arange(start, ctx), k_pos)
                table = torch.tensor(seq.block_table[: -(-ctx // self.block_size)], dtype=torch.long)
                prefills.append(PrefillSpan(row, n, ctx, table, mask))
        decodes = [self._decode_batch([decode_rows[i] for i in g], [decode_seqs[i] for i in g])
                   for g in self._group_by_context(decode_seqs)]
        meta = AttentionMetadata(len(ids), torch.cat(slots), None, prefills, decodes)
        return torch.tensor(ids, dtype=torch.long), torch.cat(positions), meta

    def _group_by_context(self, seqs: list[Sequence], min_group: int = 8, max_waste: float = 1.3) -> list[list[int]]:
        """Indices of seqs in groups of similar length: a group is padded to its longest context, and
        on CPU the padded K/V copy is the cost of decode attention at large batch."""
        order = sorted(range(len(seqs)), key=lambda i: seqs[i].num_computed_tokens)
        groups: list[list[int]] = []
        for i in order:
            ctx = seqs[i].num_computed_tokens + 1
            if groups and (len(groups[-1]) < min_group or ctx <= max_waste * (seqs[groups[-1][0]].num_computed_tokens + 1)):
                groups[-1].append(i)
            else:
                groups.append([i])
        return groups

    def _decode_batch(self, rows: list[int], seqs: list[Sequence]) -> DecodeBatch:
        bs = self.block_size
        ctx = torch.tensor([s.num_computed_tokens + 1 for s in seqs])
        max_ctx = int(ctx.max())
        max_blocks = -(-max_ctx // bs)
        table = torch.zeros(len(seqs), max_blocks, dtype=torch.long)
        for i, s in enumerate(seqs):
            bt = s.block_table[:max_blocks]
            table[i, : len(bt)] = torch.tensor(bt, dtype=torch.long)
        k_pos = torch.arange(max_blocks * bs)[None, :]
        mask = k_pos < ctx[:, None]
        if self.sliding_window is not None:
            mask &= k_pos > (ctx[:, None] - 1) - self.sliding_window
        additive = torch.zeros(mask.shape, dtype=self.dtype)
        additive.masked_fill_(~mask, float("-inf"))
        return DecodeBatch(torch.tensor(rows, dtype=torch.long), table, additive[:, None, None, :])

    @torch.inference_mode()
    def execute(self, plan: list[tuple[Sequence, int]], sample_rows: list[int]) -> torch.Tensor:
        """Run one step; return float32 logits for the given rows (each sampling sequence's last token)."""
        ids, positions, meta = self.build(plan)
        dev = self.device
        if dev != "cpu":
            ids, positions, meta = ids.to(dev), positions.to(dev), _to_device(meta, dev)
        hidden = self.model(ids, positions, meta, self.kv_caches)
        return self.model.compute_logits(hidden[torch.tensor(sample_rows, dtype=torch.long, device=dev)])


def _to_device(meta: AttentionMetadata, dev: str) -> AttentionMetadata:
    def mv(t):
        return None if t is None else t.to(dev, non_blocking=True)

    prefills = [PrefillSpan(p.q_start, p.q_len, p.ctx_len, mv(p.block_table), mv(p.mask)) for p in meta.prefills]
    decodes = [DecodeBatch(mv(d.rows), mv(d.block_tables), mv(d.mask)) for d in meta.decodes]
    return AttentionMetadata(meta.num_tokens, mv(meta.slot_mapping), mv(meta.write_rows), prefills, decodes)
