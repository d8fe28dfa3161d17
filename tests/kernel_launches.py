"""Engines at real model shapes (one layer, a tiny MLP and vocabulary: neither changes a Triton kernel's
variant: kernels/silu_mul.py takes the intermediate size at run time, and the token mask is driven at the
real vocabulary below), driven through serving steps under kernels/aot.py's LaunchRecorder, so the variants recorded
are the ones the project's own wrappers launch on a GPU at those shapes."""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import torch

from shared.engine.lora_config import LoRAConfig
from shared.engine.lora_manager import LoRAManager

from kernels.aot import LaunchRecorder
from kernels.extend_attention import candidate_tiles, extend_attention_triton
from kernels.rotary import rotary
from kernels.store_kv import store_kv
from kernels.token_bitmask import apply_token_bitmask
from loadtest.shapes import SHAPES, build_shape_checkpoint
from shared.config import EngineConfig
from shared.engine.llm_engine import LLMEngine
from shared.sampling_params import SamplingParams

# (shape, KV cache dtype): the four architectures' shapes, SmolLM2's group of 3, FP8 KV.
AOT_CASES = [("qwen3-0.6b", "auto"), ("llama-3.1-8b", "auto"), ("mistral-7b", "auto"), ("smollm2-135m", "auto"),
             ("qwen3-0.6b", "fp8"), ("smollm2-135m", "fp8")]
SMALL_VOCAB = 512


def shape_checkpoint(root: Path, name: str) -> str:
    """config.json of the shape with one layer, a small MLP and vocabulary (loaded with dummy weights)."""
    out = root / name
    if not (out / "config.json").exists():
        shape = SHAPES[name]
        small = dict(shape.config, num_hidden_layers=1, intermediate_size=64, vocab_size=SMALL_VOCAB,
                     tie_word_embeddings=True, bos_token_id=0, eos_token_id=1)
        build_shape_checkpoint(str(out), replace(shape, config=small, write_weights=False))
    return str(out)


def shape_engine(root: Path, name: str, kv_cache_dtype: str = "auto", dtype: str = "bfloat16",
                 max_num_seqs: int = 64, max_model_len: int = 256, **overrides) -> LLMEngine:
    cfg = dict(model=shape_checkpoint(root, name), load_format="dummy", dtype=dtype, device="cpu",
               kv_cache_dtype=kv_cache_dtype, num_kv_blocks=max_num_seqs * (max_model_len // 16) + 16,
               max_num_seqs=max_num_seqs, max_num_batched_tokens=64, max_model_len=max_model_len)
    cfg.update(overrides)
    engine = LLMEngine(EngineConfig(**cfg))
    # The decode-graph path (static buffers, padded buckets) run eagerly: what CUDA captures and replays.
    engine.runner.use_decode_graphs(engine.max_model_len, max_num_seqs, capture=False)
    return engine


def serve_steps(engine: LLMEngine, batch: int, long_prompt: int = 100, max_tokens: int = 3) -> None:
    """Batch 1 alone, then a long prompt chunked beside `batch` - 1 short ones (mixed prefill + decode steps,
    then decode-graph steps at the large batch)."""
    g = torch.Generator().manual_seed(0)
    vocab = engine.model_config.vocab_size
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    engine.generate([torch.randint(2, vocab, (5,), generator=g).tolist()], params, use_tqdm=False)
    prompts = [torch.randint(2, vocab, (long_prompt,), generator=g).tolist()]
    prompts += [torch.randint(2, vocab, (3 + i % 7,), generator=g).tolist() for i in range(batch - 1)]
    engine.generate(prompts, params, use_tqdm=False)


def record_shape(root: Path, name: str, kv_cache_dtype: str, batch: int = 64) -> LaunchRecorder:
    engine = shape_engine(root, name, kv_cache_dtype, max_num_seqs=batch)
    real_vocab = SHAPES[name].config["vocab_size"]
    with LaunchRecorder() as rec:
        serve_steps(engine, batch)
        # Structured-output masks at the real vocabulary (the sampler applies them on the logits' device).
        logits = torch.zeros(2, real_vocab)
        apply_token_bitmask(logits, torch.full((2, -(-real_vocab // 32)), -1, dtype=torch.int32))
        # store-KV and rotary on their own (the engine runs them fused in qk_rope_store) at the shape.
        cfg, (kc, vc) = engine.model_config, engine.runner.kv_caches[0]
        qkv = torch.zeros(3, cfg.q_size + 2 * cfg.kv_size, dtype=engine.dtype)
        q = qkv[:, : cfg.q_size].view(3, cfg.num_heads, cfg.head_dim)
        k = qkv[:, cfg.q_size : cfg.q_size + cfg.kv_size].view(3, cfg.num_kv_heads, cfg.head_dim)
        v = qkv[:, cfg.q_size + cfg.kv_size :].view(3, cfg.num_kv_heads, cfg.head_dim)
        rotary(q, k, torch.arange(3), engine.model.cos_sin)
        store_kv(k, v, kc, vc, torch.tensor([0, 1, -1]))
        # Batched multi-LoRA at every projection of the shape, as an engine with --enable-lora warms it up.
        LoRAManager(LoRAConfig(), engine.model, "cpu").warm_up()
        # Every tiling tune_extend_tiles may choose on a GPU at this shape (the engine launched the default).
        one = torch.tensor([0, 3], dtype=torch.int32)
        for tiles in candidate_tiles(cfg.head_dim):
            extend_attention_triton(q.contiguous(), kc, vc, one, torch.tensor([3], dtype=torch.int32),
                                    torch.zeros(1, 4, dtype=torch.int32), 3, 1.0, cfg.sliding_window, tiles=tiles)
    return rec
