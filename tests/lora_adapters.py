"""Random PEFT LoRA adapters for the tests (adapter_config.json + adapter_model.safetensors, PEFT's tensor names),
and transformers models with such an adapter merged into their weights (the oracle: W' = W + scaling * B @ A)."""
from __future__ import annotations

import copy
import json
from pathlib import Path

import torch
from safetensors.torch import save_file

MODULE_OF = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
             "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}


def projection_shapes(hf_config) -> dict[str, tuple[int, int]]:  # noqa: ANN001 - a transformers config
    h, inter = hf_config.hidden_size, hf_config.intermediate_size
    head_dim = getattr(hf_config, "head_dim", None) or h // hf_config.num_attention_heads
    q, kv = hf_config.num_attention_heads * head_dim, hf_config.num_key_value_heads * head_dim
    return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h), "gate_proj": (h, inter),
            "up_proj": (h, inter), "down_proj": (inter, h)}


def write_adapter(out: Path, hf_config, targets: list[str], r: int = 8, alpha: float = 16, seed: int = 0,  # noqa: ANN001
                  std: float = 0.05, use_rslora: bool = False, base: str = "base") -> Path:
    """A random adapter on every layer's `targets` (B random too, unlike PEFT's zero init, so it changes outputs)."""
    out.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(seed)
    shapes = projection_shapes(hf_config)
    tensors = {}
    for layer in range(hf_config.num_hidden_layers):
        for t in targets:
            fin, fout = shapes[t]
            stem = f"base_model.model.model.layers.{layer}.{MODULE_OF[t]}.{t}"
            tensors[f"{stem}.lora_A.weight"] = torch.randn(r, fin, generator=g) * std
            tensors[f"{stem}.lora_B.weight"] = torch.randn(fout, r, generator=g) * std
    save_file(tensors, str(out / "adapter_model.safetensors"))
    (out / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": r, "lora_alpha": alpha, "use_rslora": use_rslora, "target_modules": targets,
        "lora_dropout": 0.0, "bias": "none", "task_type": "CAUSAL_LM", "base_model_name_or_path": base}))
    return out


def merged(hf_model: torch.nn.Module, adapter: Path) -> torch.nn.Module:
    """A copy of a transformers model with the adapter merged into its weights."""
    from safetensors.torch import load_file

    cfg = json.loads((adapter / "adapter_config.json").read_text())
    r = cfg["r"]
    scaling = cfg["lora_alpha"] / (r ** 0.5 if cfg.get("use_rslora") else r)
    tensors = load_file(str(adapter / "adapter_model.safetensors"))
    model = copy.deepcopy(hf_model)
    with torch.no_grad():
        for name, a in tensors.items():
            if ".lora_A." not in name:
                continue
            b = tensors[name.replace(".lora_A.", ".lora_B.")]
            module = name.removeprefix("base_model.model.").split(".lora_A.")[0]
            lin = model.get_submodule(module)
            lin.weight += (scaling * (b.double() @ a.double())).to(lin.weight.dtype)
    return model.eval()
