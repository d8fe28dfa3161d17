"""Vocabulary-parallel embedding: each rank holds the rows of its vocabulary range; a token outside the range
looks up row 0 and is zeroed, and one all-reduce gives every rank the whole embedding."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from shared.models.tp.group import TPGroup


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab_per_rank: int, hidden_size: int, tp: TPGroup) -> None:
        super().__init__()
        self.tp = tp
        self.vocab_per_rank = vocab_per_rank
        self.start = tp.rank * vocab_per_rank
        self.weight = nn.Parameter(torch.empty(vocab_per_rank, hidden_size))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.start
        outside = (local < 0) | (local >= self.vocab_per_rank)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out.masked_fill_(outside.unsqueeze(-1), 0.0)
        return self.tp.all_reduce(out)

    def extra_repr(self) -> str:
        return f"rows [{self.start}, {self.start + self.vocab_per_rank}) of the vocabulary, tp_size={self.tp.size}"
