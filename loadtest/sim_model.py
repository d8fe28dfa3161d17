"""A model directory for simulated meshes (`--engine sim`): a real tokenizer (the demo byte-level BPE) and a
Llama-3.1-8B-shaped config.json (32 layers, 8 KV heads, a 131,072-token context) with no weights, which the
simulated engine never needs. The gateway and tokenizer services load it like any checkpoint."""
from __future__ import annotations

import json
from pathlib import Path

from shared.models.demo_tokenizer import BOS, EOS, IM_END, train_byte_bpe, write_tokenizer_files

CONTEXT = 131072


def build_sim_model(out_dir: str | Path) -> Path:
    out = Path(out_dir)
    tok = train_byte_bpe(2048)
    write_tokenizer_files(tok, out, template_in_jinja_file=True)
    cfg_path = out / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["model_max_length"] = CONTEXT
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    vocab = -(-tok.get_vocab_size() // 64) * 64
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": vocab, "hidden_size": 4096,
        "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
        "head_dim": 128, "max_position_embeddings": CONTEXT, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
        "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 8192},
        "tie_word_embeddings": False, "torch_dtype": "bfloat16", "bos_token_id": tok.token_to_id(BOS),
        "eos_token_id": [tok.token_to_id(EOS), tok.token_to_id(IM_END)],
        "_kvmesh_note": "tokenizer of the demo model, shape of Llama-3.1-8B; no weights: for --engine sim only",
    }
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out
