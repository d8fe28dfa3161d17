"""Which tensor-parallel degrees a model can be split into, and the sizes of one rank's share."""
from __future__ import annotations

from dataclasses import dataclass

from shared.models.model_config import ModelConfig


class TPDegreeError(ValueError):
    """A degree the model's heads or MLP cannot be split into evenly."""


@dataclass(frozen=True)
class TPShard:
    """One rank's share of every split dimension (the vocabulary is padded up to a multiple of the degree:
    the last rank's padding rows are zero and its logits there are cut off after the gather).

    KV heads: rank r holds KV heads [kv_head_start, kv_head_start + num_kv_heads). With fewer KV heads than
    ranks each rank holds one, the one its query heads use, and kv_replicas ranks in a row hold the same."""

    rank: int
    size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_per_rank: int
    kv_head_start: int = 0
    kv_replicas: int = 1

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def vocab_start(self) -> int:
        return self.rank * self.vocab_per_rank


def _splits(cfg: ModelConfig, size: int) -> bool:
    kv = cfg.num_kv_heads
    return (cfg.num_heads % size == 0 and cfg.intermediate_size % size == 0
            and (kv % size == 0 or size % kv == 0))


def kv_replicas(cfg: ModelConfig, size: int) -> int:
    """How many ranks hold each KV head: 1 while the degree divides the KV heads, size // KV heads above."""
    return max(1, size // cfg.num_kv_heads)


def check_degree(cfg: ModelConfig, size: int) -> None:
    """Raise TPDegreeError, naming the dimension, unless `size` splits the model evenly.

    Query heads and the MLP are split; KV heads are split while the degree divides them and replicated above
    (the degree then a multiple of them): each rank always holds whole KV heads, so a rank's KV cache shard is
    a plain head range of the whole blocks the tiers and the wire carry."""
    if size < 1:
        raise TPDegreeError(f"tensor-parallel size must be >= 1, got {size}")
    if _splits(cfg, size):
        return
    kv = cfg.num_kv_heads
    divisors = ", ".join(str(d) for d in range(1, cfg.num_heads + 1) if _splits(cfg, d))
    if cfg.num_heads % size:
        why = f"does not divide the model's num_attention_heads ({cfg.num_heads})"
    elif cfg.intermediate_size % size:
        why = f"does not divide the model's intermediate_size ({cfg.intermediate_size})"
    else:
        why = (f"neither divides nor is a multiple of the model's num_key_value_heads ({kv}): KV heads are "
               f"split, or replicated when there are fewer than ranks")
    raise TPDegreeError(f"tensor-parallel size {size} {why}; this model splits into {divisors} ranks")


def shard_of(cfg: ModelConfig, rank: int, size: int) -> TPShard:
    check_degree(cfg, size)
    assert 0 <= rank < size
    replicas = kv_replicas(cfg, size)
    # Replicated: rank r's query heads all belong to KV head r // replicas (the degree is a multiple of the KV
    # heads, so a rank's H / size query heads never straddle two of the H / kv query-head groups).
    num_kv = cfg.num_kv_heads // size if replicas == 1 else 1
    return TPShard(rank, size, cfg.num_heads // size, num_kv, cfg.head_dim, cfg.intermediate_size // size,
                   -(-cfg.vocab_size // size), kv_head_start=rank // replicas * num_kv, kv_replicas=replicas)
