"""A Llama-family decoder run as a pooling model: whole prompts, causal attention, no KV cache.

A pooling request needs the hidden states of one forward pass and nothing after it, so the paged cache
(and its blocks, block tables and slot mapping) would be bookkeeping for KV that is thrown away. This runs
the same modules as shared/models/llama.py (fused q/k/v and gate/up, the RMSNorm and silu*mul kernels'
torch twins on CPU) over a batch of packed prompts: every matmul covers all the batch's tokens at once,
attention runs per prompt (torch's scaled_dot_product_attention, causal).

`*ForSequenceClassification` checkpoints keep their `score` head (no lm_head): the classifier's logits
are the head applied to the pooled hidden state, as transformers computes them at the last token.
"""
from __future__ import annotations

import logging
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import safe_open
from torch import nn

from kernels.rotary import rope_rows, rotate_rows
from shared.models.llama import LlamaFamilyForCausalLM
from shared.models.loader import Target, _shard_files, _validate, resolve_dtype, weight_plan
from shared.models.model_config import ModelConfig, load_model_config
from shared.models.pooling_config import PoolingSpec

log = logging.getLogger(__name__)


class LlamaPoolingModel:
    """forward(ids, seq_lens) -> hidden [tokens, hidden]; score(pooled) -> logits for a classifier."""

    causal = True

    def __init__(self, body: LlamaFamilyForCausalLM, cfg: ModelConfig, score: nn.Linear | None) -> None:
        self.body, self.cfg, self.score_head = body, cfg, score
        self.dtype = body.embed_tokens.weight.dtype
        self.device = body.embed_tokens.weight.device
        self.hidden_size = cfg.hidden_size
        self.max_positions = body.cos_sin.shape[0]

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, seq_lens: list[int]) -> torch.Tensor:
        cfg, body = self.cfg, self.body
        positions = torch.cat([torch.arange(n, device=input_ids.device) for n in seq_lens])
        rows = rope_rows(body.cos_sin, positions, self.dtype)
        x = body.embed_tokens(input_ids)
        residual = None
        for layer in body.layers:
            if residual is None:
                residual = x
                h = layer.input_layernorm(x)
            else:
                h, residual = layer.input_layernorm(x, residual)
            h = self._attention(layer.self_attn, h, rows, seq_lens)
            h, residual = layer.post_attention_layernorm(h, residual)
            x = layer.mlp(h)
        return body.norm(x, residual)[0]

    def _attention(self, attn, x: torch.Tensor, rows, seq_lens: list[int]) -> torch.Tensor:
        cfg = self.cfg
        t = x.shape[0]
        qkv = attn.qkv_proj(x)
        q_size, kv_size = attn.num_heads * cfg.head_dim, attn.num_kv_heads * cfg.head_dim
        q = qkv[:, :q_size].reshape(t, attn.num_heads, cfg.head_dim)
        k = qkv[:, q_size:q_size + kv_size].reshape(t, attn.num_kv_heads, cfg.head_dim)
        v = qkv[:, q_size + kv_size:].reshape(t, attn.num_kv_heads, cfg.head_dim)
        if cfg.qk_norm:
            q, k = attn.q_norm(q), attn.k_norm(k)
        q, k = q.contiguous(), k.contiguous()
        rotate_rows(q, rows)
        rotate_rows(k, rows)
        group = attn.num_heads // attn.num_kv_heads
        out = torch.empty(t, attn.num_heads, cfg.head_dim, dtype=x.dtype, device=x.device)
        start = 0
        for n in seq_lens:  # attention is the only per-prompt op; the matmuls above cover the whole batch
            qs = q[start:start + n].transpose(0, 1)
            ks = k[start:start + n].transpose(0, 1)
            vs = v[start:start + n].transpose(0, 1)
            if group > 1:
                ks, vs = ks.repeat_interleave(group, 0), vs.repeat_interleave(group, 0)
            out[start:start + n] = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True,
                                                                  scale=attn.scale).transpose(0, 1)
            start += n
        return attn.o_proj(out.view(t, q_size))

    @torch.inference_mode()
    def score(self, pooled: torch.Tensor) -> torch.Tensor:
        assert self.score_head is not None, "not a classification model"
        return self.score_head(pooled)


def load_llama_pooling(model_dir: str | Path, spec: PoolingSpec, *, dtype: str = "auto", device: str = "cpu",
                       max_positions: int | None = None) -> LlamaPoolingModel:
    """The decoder body (never lm_head), plus the score head of a classifier; every tensor checked first."""
    model_dir = Path(model_dir)
    cfg = load_model_config(model_dir)
    torch_dtype = resolve_dtype(dtype, cfg, device)
    plan = {k: v for k, v in weight_plan(cfg).items() if not k.startswith("lm_head.")}
    if spec.task == "classify":
        plan["score.weight"] = Target("score.weight", 0, (spec.num_labels, cfg.hidden_size))
    located = _validate(_shard_files(model_dir), plan, model_dir)
    positions = max_positions or cfg.max_position_embeddings
    with torch.device("meta"):
        body = LlamaFamilyForCausalLM(cfg, positions)
        del body.lm_head  # a pooling model never computes logits over the vocabulary
        score = nn.Linear(cfg.hidden_size, spec.num_labels, bias=False) if spec.task == "classify" else None
    body = body.to_empty(device=device).to(torch_dtype)
    body.cos_sin = LlamaFamilyForCausalLM.rope_table(cfg, positions).to(device)
    if score is not None:
        score = score.to_empty(device=device).to(torch_dtype)
    params = dict(body.named_parameters())
    if score is not None:
        params["score.weight"] = score.weight
    by_file: dict[Path, list[str]] = {}
    for name, path in located.items():
        by_file.setdefault(path, []).append(name)
    with torch.no_grad():
        for path, names in by_file.items():
            with safe_open(str(path), framework="pt", device="cpu") as f:
                for name in names:
                    t = plan[name]
                    params[t.param][t.row_offset:t.row_offset + t.shape[0]].copy_(f.get_tensor(name))
    body.eval()
    log.info("pooling model %s (%s, %s) in %s", model_dir.name, spec.architecture, spec.task, torch_dtype)
    return LlamaPoolingModel(body, cfg, score)
