"""Vocabulary-parallel output head: each rank computes the logits of its vocabulary range and rank 0, where the
sampler is, gathers them (the padding past the real vocabulary is cut off). The other ranks get None: nothing
after the head runs there."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from shared.models.tp.group import TPGroup


class ParallelLMHead(nn.Module):
    def __init__(self, vocab_per_rank: int, hidden_size: int, vocab_size: int, tp: TPGroup) -> None:
        super().__init__()
        self.tp = tp
        self.vocab_size = vocab_size
        self.weight = nn.Parameter(torch.empty(vocab_per_rank, hidden_size))

    def forward(self, hidden: torch.Tensor) -> torch.Tensor | None:
        logits = self.tp.gather_last_dim(F.linear(hidden, self.weight))
        if logits is None or logits.shape[-1] == self.vocab_size:
            return logits
        return logits[..., : self.vocab_size]

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]} vocabulary rows per rank, tp_size={self.tp.size}"
