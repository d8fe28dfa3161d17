"""`kvmesh demo-model DIR`: SmolLM2-135M-Instruct (shared/models/smollm2.py), or with --random the
small, deterministic Llama checkpoint below, which the fast tests use.

The random one has random weights (so its text is gibberish), but every file is what a real checkpoint has:
config.json, sharded safetensors with an index, generation_config.json, tokenizer.json,
tokenizer_config.json and chat_template.jinja. Same seed -> byte-identical files, on any machine
with the same transformers version (config.json records that version).
"""
from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

import torch
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

from shared.models.demo_tokenizer import (
    BOS,
    EOS,
    IM_END,
    MODEL_MAX_LENGTH,
    PAD,
    train_byte_bpe,
    write_tokenizer_files,
)

VOCAB_SIZE = 2048
# ~16 MB of float32 weights: small shards so the demo exercises sharded loading.
MAX_SHARD_SIZE = "8MB"


def build_demo_model(out_dir: str | Path, seed: int = 0) -> Path:
    """Write the demo checkpoint into `out_dir` (created if needed) and return its path."""
    out = Path(out_dir)
    tok = train_byte_bpe(VOCAB_SIZE)
    ids = {t: tok.token_to_id(t) for t in (BOS, EOS, IM_END, PAD)}
    config = LlamaConfig(
        vocab_size=_round_up(tok.get_vocab_size(), 64),  # padded like real checkpoints; extra rows unused
        hidden_size=256,
        intermediate_size=688,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=MODEL_MAX_LENGTH,
        tie_word_embeddings=False,
        # 5x the default spread: greedy output then varies from token to token instead of
        # repeating one token, so token-for-token comparisons with generate() catch more bugs.
        initializer_range=0.1,
        bos_token_id=ids[BOS],
        eos_token_id=[ids[EOS], ids[IM_END]],
        pad_token_id=ids[PAD],
        dtype="float32",
    )
    # fork_rng: seeding must not leak into the caller's random stream.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config).to(torch.float32).eval()
    model.generation_config = GenerationConfig(
        bos_token_id=ids[BOS], eos_token_id=[ids[EOS], ids[IM_END]], pad_token_id=ids[PAD]
    )
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, max_shard_size=MAX_SHARD_SIZE, safe_serialization=True)
    for shard in out.glob("*.safetensors"):
        shard.chmod(0o644)  # saved 0600; containers running as another user must read them
    write_tokenizer_files(tok, out, template_in_jinja_file=True)
    return out


def build_real_demo_model(out_dir: str | Path) -> Path:
    """Copy the converted SmolLM2 checkpoint into `out_dir` (SmolLM2Unavailable when it cannot be had)."""
    from shared.models.smollm2 import smollm2_checkpoint

    src = smollm2_checkpoint()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        shutil.copyfile(f, out / f.name)
    return out


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("dir", type=Path, help="output directory (created; existing files overwritten)")
    parser.add_argument("--random", action="store_true",
                        help="the small random-weights demo (gibberish, seconds to build, no download) instead of SmolLM2")
    parser.add_argument("--seed", type=int, default=0, help="--random: weight initialisation seed (default 0)")


def run(args: argparse.Namespace) -> int:
    if args.random:
        print(build_demo_model(args.dir, seed=args.seed))
        return 0
    from shared.models.smollm2 import SmolLM2Unavailable

    try:
        print(build_real_demo_model(args.dir))
    except SmolLM2Unavailable as e:
        print(f"kvmesh demo-model: {e}", file=sys.stderr)
        return 2
    return 0


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple
