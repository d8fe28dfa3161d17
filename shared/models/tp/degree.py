"""Which tensor-parallel degrees a model can be split into, and the sizes of one rank's share."""
from __future__ import annotations

from dataclasses import dataclass

from shared.models.model_config import ModelConfig


class TPDegreeError(ValueError):
    """A degree the model's heads or MLP cannot be split into evenly."""


@dataclass(frozen=True)
class TPShard:
    """One rank's share of every split dimension (the vocabulary is padded up to a multiple of the degree:
    the last rank's padding rows are zero and its logits there are cut off after the gather)."""

    rank: int
    size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_per_rank: int

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def vocab_start(self) -> int:
        return self.rank * self.vocab_per_rank


def check_degree(cfg: ModelConfig, size: int) -> None:
    """Raise TPDegreeError, naming the dimension, unless `size` splits the model evenly.

    KV heads are split, never replicated: each rank holds whole KV heads of its own, which is what keeps a
    rank's KV cache shard a plain head range of the whole blocks the tiers and the wire carry."""
    if size < 1:
        raise TPDegreeError(f"tensor-parallel size must be >= 1, got {size}")
    for what, n in (("num_attention_heads", cfg.num_heads), ("num_key_value_heads", cfg.num_kv_heads),
                    ("intermediate_size", cfg.intermediate_size)):
        if n % size:
            divisors = [d for d in range(1, cfg.num_kv_heads + 1)
                        if cfg.num_heads % d == 0 and cfg.num_kv_heads % d == 0 and cfg.intermediate_size % d == 0]
            raise TPDegreeError(f"tensor-parallel size {size} does not divide the model's {what} ({n}); "
                                f"this model splits into {', '.join(map(str, divisors))} ranks")


def shard_of(cfg: ModelConfig, rank: int, size: int) -> TPShard:
    check_degree(cfg, size)
    assert 0 <= rank < size
    return TPShard(rank, size, cfg.num_heads // size, cfg.num_kv_heads // size, cfg.head_dim,
                   cfg.intermediate_size // size, -(-cfg.vocab_size // size))
