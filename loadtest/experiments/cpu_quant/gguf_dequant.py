"""Which dequantizer the GGUF loader uses, by measurement: gguf's numpy dequantize, transformers' GGUF
loading (which calls gguf's dequantize per tensor, then builds torch tensors), and a vectorised torch
Q4_1 dequantizer, on the Q4_1 tensors of SmolLM2-135M-Instruct; plus the loader's cold (convert) and
warm (cache hit) resolve times. `python -m loadtest.experiments.cpu_quant.gguf_dequant --json loadtest/results/gguf_dequant.json`"""
from __future__ import annotations

import argparse
import os
import platform
import tempfile
import time
from pathlib import Path

import gguf
import numpy as np
import torch

from loadtest.report_json import emit_report


def torch_q4_1(raw: np.ndarray, rows: int, cols: int) -> torch.Tensor:
    """Q4_1 block: fp16 d, fp16 m, 16 bytes of nibbles (low nibbles are values 0..15, high 16..31)."""
    b = torch.from_numpy(np.ascontiguousarray(raw)).reshape(-1, 20)
    d = b[:, 0:2].contiguous().view(torch.float16).float()
    m = b[:, 2:4].contiguous().view(torch.float16).float()
    qs = b[:, 4:]
    q = torch.cat([qs & 0x0F, qs >> 4], dim=1).float()
    return (q * d + m).reshape(rows, cols)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--json", default=None)
    args = p.parse_args()
    from shared.models.smollm2 import smollm2_gguf
    from shared.models.model_source import resolve_model

    path = smollm2_gguf()
    reader = gguf.GGUFReader(str(path))
    q41 = [t for t in reader.tensors if t.tensor_type.name == "Q4_1"]
    res: dict = {"file": path.name, "q4_1_tensors": len(q41), "machine": f"{platform.machine()} {os.cpu_count()} cores",
                 "torch_threads": torch.get_num_threads()}
    t0 = time.perf_counter()
    ref = [gguf.quants.dequantize(t.data, t.tensor_type) for t in q41]
    res["gguf_numpy_q4_1_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    ours = [torch_q4_1(t.data, *reversed([int(x) for x in t.shape])) for t in q41]
    res["torch_q4_1_s"] = time.perf_counter() - t0
    res["torch_equals_gguf"] = all(torch.equal(o, torch.from_numpy(r)) for o, r in zip(ours, ref))
    t0 = time.perf_counter()
    for t in reader.tensors:
        gguf.quants.dequantize(t.data, t.tensor_type)
    res["gguf_numpy_all_tensors_s"] = time.perf_counter() - t0
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint
    from transformers import AutoConfig
    cfg = AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name)
    from transformers import LlamaForCausalLM
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    t0 = time.perf_counter()
    load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=model)
    res["transformers_load_gguf_checkpoint_s"] = time.perf_counter() - t0
    with tempfile.TemporaryDirectory() as cache:
        t0 = time.perf_counter()
        resolve_model(path, Path(cache))
        res["kvmesh_resolve_cold_s"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        resolve_model(path, Path(cache))
        res["kvmesh_resolve_warm_s"] = time.perf_counter() - t0
        from shared.models.loader import load_model
        t0 = time.perf_counter()
        load_model(resolve_model(path, Path(cache)))
        res["kvmesh_warm_resolve_plus_load_model_s"] = time.perf_counter() - t0
    emit_report(res, args.json)


if __name__ == "__main__":
    main()
