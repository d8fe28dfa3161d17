"""A BERT-family encoder (BertModel) for embeddings: bidirectional attention, no KV cache at all.

An encoder attends over its whole input in both directions and produces nothing after it, so it needs no
paged KV: the simplest path that batches well is the same packed batch as the causal pooling model (one matmul
per projection over all the batch's tokens) with attention per input. CLS or MEAN pooling (sentence-transformers'
1_Pooling/config.json picks it) runs in shared/engine/pooler.py. Segment ids are all 0: an embedding input is
one text.
"""
from __future__ import annotations

import json
import logging
import math
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import safe_open
from torch import nn

from shared.models.errors import CheckpointError
from shared.models.loader import _shard_files
from shared.models.pooling_config import PoolingSpec

log = logging.getLogger(__name__)


class BertLayer(nn.Module):
    def __init__(self, hidden: int, heads: int, inter: int, eps: float) -> None:
        super().__init__()
        self.heads = heads
        self.query, self.key, self.value = (nn.Linear(hidden, hidden) for _ in range(3))
        self.attn_out = nn.Linear(hidden, hidden)
        self.attn_norm = nn.LayerNorm(hidden, eps=eps)
        self.inter = nn.Linear(hidden, inter)
        self.out = nn.Linear(inter, hidden)
        self.out_norm = nn.LayerNorm(hidden, eps=eps)

    def forward(self, x: torch.Tensor, seq_lens: list[int]) -> torch.Tensor:
        t, h = x.shape
        d = h // self.heads
        q, k, v = (p(x).view(t, self.heads, d).transpose(0, 1) for p in (self.query, self.key, self.value))
        ctx = torch.empty(self.heads, t, d, dtype=x.dtype, device=x.device)
        start = 0
        for n in seq_lens:  # every token sees its whole input, and only its input
            s = slice(start, start + n)
            ctx[:, s] = F.scaled_dot_product_attention(q[:, s], k[:, s], v[:, s], scale=1 / math.sqrt(d))
            start += n
        x = self.attn_norm(self.attn_out(ctx.transpose(0, 1).reshape(t, h)) + x)
        return self.out_norm(self.out(F.gelu(self.inter(x))) + x)


class BertPoolingModel(nn.Module):
    causal = False

    def __init__(self, cfg: dict) -> None:
        super().__init__()
        hidden, eps = cfg["hidden_size"], cfg.get("layer_norm_eps", 1e-12)
        if cfg.get("hidden_act", "gelu") != "gelu" or cfg.get("position_embedding_type", "absolute") != "absolute":
            raise CheckpointError(Path("config.json"), "hidden_act", "only gelu and absolute positions are supported")
        self.word = nn.Embedding(cfg["vocab_size"], hidden)
        self.position = nn.Embedding(cfg["max_position_embeddings"], hidden)
        self.token_type = nn.Embedding(cfg.get("type_vocab_size", 2), hidden)
        self.emb_norm = nn.LayerNorm(hidden, eps=eps)
        self.layers = nn.ModuleList(BertLayer(hidden, cfg["num_attention_heads"], cfg["intermediate_size"], eps)
                                    for _ in range(cfg["num_hidden_layers"]))
        self.hidden_size = hidden
        self.max_positions = cfg["max_position_embeddings"]
        # RoBERTa-style checkpoints start positions after the padding index.
        self.position_offset = cfg["pad_token_id"] + 1 if cfg.get("model_type") in ("roberta", "xlm-roberta") else 0
        if self.position_offset:
            self.max_positions -= self.position_offset

    @property
    def device(self) -> torch.device:
        return self.word.weight.device

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, seq_lens: list[int]) -> torch.Tensor:  # type: ignore[override]
        positions = torch.cat([torch.arange(n, device=input_ids.device) for n in seq_lens]) + self.position_offset
        x = self.word(input_ids) + self.position(positions) + self.token_type.weight[0]
        x = self.emb_norm(x)
        for layer in self.layers:
            x = layer(x, seq_lens)
        return x

    def score(self, pooled: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError("an encoder classifier head is not supported")


def _names(i: int) -> dict[str, str]:
    """checkpoint name (after the layer prefix) -> this module's parameter."""
    src, dst = f"encoder.layer.{i}", f"layers.{i}"
    out = {}
    for a, b in (("attention.self.query", "query"), ("attention.self.key", "key"), ("attention.self.value", "value"),
                 ("attention.output.dense", "attn_out"), ("attention.output.LayerNorm", "attn_norm"),
                 ("intermediate.dense", "inter"), ("output.dense", "out"), ("output.LayerNorm", "out_norm")):
        for p in ("weight", "bias"):
            out[f"{src}.{a}.{p}"] = f"{dst}.{b}.{p}"
    return out


def load_bert_pooling(model_dir: str | Path, spec: PoolingSpec, *, dtype: str = "auto",
                      device: str = "cpu") -> BertPoolingModel:
    model_dir = Path(model_dir)
    cfg = json.loads((model_dir / "config.json").read_text())
    model = BertPoolingModel(cfg)
    plan = {"embeddings.word_embeddings.weight": "word.weight",
            "embeddings.position_embeddings.weight": "position.weight",
            "embeddings.token_type_embeddings.weight": "token_type.weight",
            "embeddings.LayerNorm.weight": "emb_norm.weight", "embeddings.LayerNorm.bias": "emb_norm.bias"}
    for i in range(cfg["num_hidden_layers"]):
        plan.update(_names(i))
    params = dict(model.named_parameters())
    seen: set[str] = set()
    with torch.no_grad():
        for path in _shard_files(model_dir):
            with safe_open(str(path), framework="pt", device="cpu") as f:
                for name in f.keys():
                    key = name.split(".", 1)[1] if name.split(".", 1)[0] in ("bert", "roberta", "model") else name
                    target = plan.get(key)
                    if target is None:
                        continue  # the pooler, an MLM head: not part of the encoder's hidden states
                    tensor = f.get_tensor(name)
                    if tensor.shape != params[target].shape:
                        raise CheckpointError(path, name, f"shape {list(tensor.shape)} does not match "
                                              f"{list(params[target].shape)}")
                    params[target].copy_(tensor)
                    seen.add(key)
    missing = [k for k in plan if k not in seen]
    if missing:
        raise CheckpointError(model_dir, missing[0], f"tensor missing from the checkpoint ({len(missing)} missing)")
    from shared.config import DTYPES
    from shared.models.cpu_dtype import default_cpu_dtype

    if dtype != "auto":
        name = dtype
    elif device == "cpu":
        name = default_cpu_dtype()[0]
    else:
        name = cfg.get("dtype", cfg.get("torch_dtype")) or "float32"
    model = model.to(device=device, dtype=DTYPES[name]).eval()
    log.info("encoder %s (%s, pooling %s) in %s", model_dir.name, spec.architecture, spec.pooler.pooling_type, name)
    return model
