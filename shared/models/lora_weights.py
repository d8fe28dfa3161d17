"""A checked PEFT adapter's tensors (shared/models/lora_files.py), read into host memory in the model's dtype:
for each (layer, projection) lora_A [r, in] and lora_B [out, r] with the adapter's scaling folded into B."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from shared.models.lora_files import WEIGHTS_NAME, AdapterError, AdapterFiles


@dataclass
class AdapterWeights:
    pairs: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]  # (layer, proj) -> (A, scaling * B)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for ab in self.pairs.values() for t in ab)


def read_adapter(files: AdapterFiles, dtype: torch.dtype) -> AdapterWeights:
    pairs: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}
    try:
        with safe_open(str(Path(files.path) / WEIGHTS_NAME), framework="pt") as f:
            for key, (a_name, b_name) in files.tensors.items():
                a = f.get_tensor(a_name).float()
                b = f.get_tensor(b_name).float() * files.scaling
                if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
                    raise AdapterError(f"{WEIGHTS_NAME}: layer {key[0]} {key[1]} has non-finite values")
                pairs[key] = (a.to(dtype).contiguous(), b.to(dtype).contiguous())
    except (OSError, RuntimeError) as e:  # the header said one thing, the bytes another
        raise AdapterError(f"{WEIGHTS_NAME} in {files.path} could not be read: {e}") from None
    return AdapterWeights(pairs)
