"""Quantized checkpoints written here in the published formats, from a float checkpoint's weights, and each format's
dequantization by its own definition (the tests' oracle, written bit by bit as the formats' authors pack):

- AWQ (AutoAWQ WQLinear_GEMM.from_linear): qweight [K, N/8] int32, word c of row k holds columns 8c..8c+7 with
  nibble i = column 8c + AWQ_ORDER[i]; qzeros the same over [K/group, N/8]; scales [K/group, N] float16;
  w = (q - z) * s.
- GPTQ (AutoGPTQ QuantLinear.pack): qweight [K/8, N] int32, nibble b of word r = row 8r + b; qzeros [groups, N/8],
  nibble b of word c = column 8c + b, storing zero - 1 (format "gptq"; "gptq_v2" stores the zero); scales
  [groups, N] float16; g_idx [K] int32; w = (q - z) * s[g_idx]. Symmetric: zero 8, scale = 2 max|w| / 15.
  desc_act: columns taken in a permuted order, group of column c = its position // group.
- FP8: vLLM's `fp8` (per-tensor weight_scale, static input_scale) and compressed-tensors float-quantized
  (weight_scale [N, 1] per channel, dynamic per-token activations).
"""
from __future__ import annotations

import json
import shutil
import zlib
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file

AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]
PROJS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
         "mlp.up_proj", "mlp.down_proj")


def _i32(a: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(a.astype(np.uint32).view(np.int32).copy())


def quantize_groups(w: torch.Tensor, group: int, sym: bool, g_idx: torch.Tensor | None = None):
    """w [N, K] float -> (q [K, N] int, scales [G, N] float16, zeros [G, N] int) with round to nearest."""
    n, k = w.shape
    g_idx = torch.arange(k) // group if g_idx is None else g_idx.long()
    groups = k // group
    wt = w.detach().float().t()
    scales = torch.empty(groups, n)
    zeros = torch.empty(groups, n, dtype=torch.int64)
    for g in range(groups):
        cols = wt[g_idx == g]
        lo, hi = cols.amin(0).clamp(max=0), cols.amax(0).clamp(min=0)
        if sym:
            hi = torch.maximum(lo.abs(), hi)
            lo = -hi
        scale = ((hi - lo) / 15).clamp(min=1e-6).half().float()
        scales[g] = scale
        zeros[g] = 8 if sym else torch.round(-lo / scale).clamp(0, 15).long()
    s, z = scales[g_idx], zeros[g_idx]
    q = torch.round(wt / s + z).clamp(0, 15).long()
    return q, scales.half(), zeros


def pack_awq(q: torch.Tensor) -> torch.Tensor:
    """[R, C] values -> [R, C/8] int32, AutoAWQ's column packing."""
    iw = q.numpy().astype(np.uint32)
    out = np.zeros((iw.shape[0], iw.shape[1] // 8), dtype=np.uint32)
    for col in range(iw.shape[1] // 8):
        for i in range(8):
            out[:, col] |= iw[:, col * 8 + AWQ_ORDER[i]] << (i * 4)
    return _i32(out)


def pack_gptq_rows(q: torch.Tensor) -> torch.Tensor:
    iw = q.numpy().astype(np.uint32)
    out = np.zeros((iw.shape[0] // 8, iw.shape[1]), dtype=np.uint32)
    for row in range(out.shape[0]):
        for j in range(8):
            out[row] |= iw[row * 8 + j] << (4 * j)
    return _i32(out)


def pack_gptq_zeros(z: torch.Tensor, v1: bool) -> torch.Tensor:
    zz = (z.numpy() - (1 if v1 else 0)).astype(np.int64) & 0xF  # v1 stores zero - 1 (a zero of 0 wraps: rare)
    out = np.zeros((zz.shape[0], zz.shape[1] // 8), dtype=np.uint32)
    for col in range(out.shape[1]):
        for j in range(8):
            out[:, col] |= zz[:, col * 8 + j].astype(np.uint32) << (4 * j)
    return _i32(out)


def nibble(words: torch.Tensor, i: int) -> torch.Tensor:
    return (words.numpy().view(np.uint32).astype(np.int64) >> (4 * i)) & 0xF


def dequant_awq(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, group: int) -> torch.Tensor:
    """AWQ's definition -> float32 [N, K]."""
    k, n = qweight.shape[0], qweight.shape[1] * 8
    q, z = np.zeros((k, n), dtype=np.int64), np.zeros((qzeros.shape[0], n), dtype=np.int64)
    for i in range(8):
        q[:, AWQ_ORDER[i]::8] = nibble(qweight, i)
        z[:, AWQ_ORDER[i]::8] = nibble(qzeros, i)
    g = np.arange(k) // group
    return (torch.from_numpy(q - z[g]).float() * scales.float()[torch.from_numpy(g)]).t().contiguous()


def dequant_gptq(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, g_idx: torch.Tensor,
                 v1: bool = True) -> torch.Tensor:
    """GPTQ's definition -> float32 [N, K]."""
    k, n = qweight.shape[0] * 8, qweight.shape[1]
    q, z = np.zeros((k, n), dtype=np.int64), np.zeros((qzeros.shape[0], n), dtype=np.int64)
    for b in range(8):
        q[b::8] = nibble(qweight, b)
        z[:, b::8] = nibble(qzeros, b)
    z = z + (1 if v1 else 0)
    g = g_idx.long()
    return (torch.from_numpy(q - z[g.numpy()]).float() * scales.float()[g]).t().contiguous()


def awq_tensors(w: torch.Tensor, group: int) -> dict[str, torch.Tensor]:
    q, s, z = quantize_groups(w, group, sym=False)
    return {"qweight": pack_awq(q), "qzeros": pack_awq(z), "scales": s}


def gptq_tensors(w: torch.Tensor, group: int, sym: bool, desc_act: bool, v1: bool = True,
                 seed: int = 0) -> dict[str, torch.Tensor]:
    k = w.shape[1]
    if desc_act:
        perm = torch.randperm(k, generator=torch.Generator().manual_seed(seed))
        g_idx = torch.empty(k, dtype=torch.int64)
        g_idx[perm] = torch.arange(k) // group
    else:
        g_idx = torch.arange(k) // group
    q, s, z = quantize_groups(w, group, sym, g_idx)
    if v1:
        z = z.clamp(min=1)  # AutoGPTQ v1 cannot store a zero of 0 (it wraps to 16); keep the test grid exact
        q = torch.round(w.detach().float().t() / s.float()[g_idx] + z[g_idx]).clamp(0, 15).long()
    return {"qweight": pack_gptq_rows(q), "qzeros": pack_gptq_zeros(z, v1), "scales": s,
            "g_idx": g_idx.to(torch.int32)}


def fp8_tensors(w: torch.Tensor, per_channel: bool, input_absmax: float | None) -> dict[str, torch.Tensor]:
    wf = w.detach().float()
    amax = wf.abs().amax(dim=1, keepdim=True) if per_channel else wf.abs().amax()
    scale = (amax / 448).clamp(min=1e-12)
    out = {"weight": (wf / scale).clamp(-448, 448).to(torch.float8_e4m3fn).contiguous(),
           "weight_scale": scale.reshape(-1, 1) if per_channel else scale.reshape(())}
    if input_absmax is not None:
        out["input_scale"] = torch.tensor(input_absmax / 448, dtype=torch.float32).reshape(())
    return out


def input_absmax(hf_model: torch.nn.Module, prompts: list[list[int]]) -> dict[str, float]:
    """Calibration for static FP8 activation scales: each projection's largest |input| over the prompts."""
    seen: dict[str, float] = {}
    hooks = []
    for name, mod in hf_model.named_modules():
        if name.endswith(PROJS):
            hooks.append(mod.register_forward_hook(
                lambda m, a, o, name=name: seen.__setitem__(name, max(seen.get(name, 0.0), a[0].abs().max().item()))))
    with torch.no_grad():
        for p in prompts:
            hf_model(torch.tensor([p]))
    for h in hooks:
        h.remove()
    return {f"{k}.weight": v for k, v in seen.items()}


def read_tensors(src: Path) -> dict[str, torch.Tensor]:
    from safetensors import safe_open

    tensors: dict[str, torch.Tensor] = {}
    index = src / "model.safetensors.index.json"
    files = sorted({src / n for n in json.loads(index.read_text())["weight_map"].values()}) if index.exists() \
        else [src / "model.safetensors"]
    for f in files:
        with safe_open(str(f), framework="pt") as h:
            for name in h.keys():
                tensors[name] = h.get_tensor(name)
    return tensors


def write_quantized(src: Path, out: Path, method: str, quantization_config: dict, **opts) -> Path:
    """A copy of the float checkpoint at src with every decoder projection in `method`'s format (opts: group, sym,
    desc_act, v1, per_channel, absmax; tensors: the float tensors to write instead of src's, e.g. with AWQ's scales
    folded in; parts: projection -> its tensors already quantized, e.g. by GPTQ), sharded in two files with an
    index as save_pretrained writes."""
    out.mkdir(parents=True, exist_ok=True)
    tensors = opts.get("tensors") or read_tensors(src)
    given = opts.get("parts") or {}
    result: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        proj = name.removesuffix(".weight")
        if name.endswith(".weight") and proj.endswith(PROJS) and proj not in opts.get("skip", ()):
            if proj in given:
                parts = given[proj]
            elif method == "awq":
                parts = awq_tensors(t, opts["group"])
            elif method == "gptq":
                # The act order comes from the inputs' statistics: projections reading the same input share it.
                # The seed is a fixed function of the names (str's hash() differs between processes).
                layer, kind = proj.split(".")[2], proj.rsplit(".", 1)[1]
                shared_input = {"k_proj": "q_proj", "v_proj": "q_proj", "up_proj": "gate_proj"}.get(kind, kind)
                parts = gptq_tensors(t, opts["group"], opts.get("sym", True), opts.get("desc_act", False),
                                     opts.get("v1", True), seed=zlib.crc32(f"{layer}.{shared_input}".encode()))
            else:
                absmax = opts.get("absmax")
                parts = fp8_tensors(t, opts.get("per_channel", False), None if absmax is None else absmax[name])
            result.update({f"{proj}.{k}": v for k, v in parts.items()})
        else:
            result[name] = t
    names = sorted(result)
    half = len(names) // 2
    shards = {"model-00001-of-00002.safetensors": names[:half], "model-00002-of-00002.safetensors": names[half:]}
    weight_map = {}
    for file, keys in shards.items():
        save_file({k: result[k].contiguous() for k in keys}, str(out / file))
        weight_map.update({k: file for k in keys})
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    for f in src.iterdir():
        if f.suffix != ".safetensors" and f.name != "model.safetensors.index.json" and f.is_file():
            shutil.copy(f, out / f.name)
    cfg = json.loads((out / "config.json").read_text())
    cfg["quantization_config"] = quantization_config
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    return out


def awq_config(group: int) -> dict:
    return {"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True, "version": "gemm"}


def gptq_config(group: int, sym: bool = True, desc_act: bool = False, v1: bool = True) -> dict:
    return {"quant_method": "gptq", "bits": 4, "group_size": group, "sym": sym, "desc_act": desc_act,
            "checkpoint_format": "gptq" if v1 else "gptq_v2"}


def fp8_config(static: bool) -> dict:
    return {"quant_method": "fp8", "activation_scheme": "static" if static else "dynamic"}


def compressed_tensors_fp8_config(per_channel: bool = True, static: bool = False) -> dict:
    act = {"num_bits": 8, "type": "float", "strategy": "tensor" if static else "token", "dynamic": not static,
           "symmetric": True}
    return {"quant_method": "compressed-tensors", "format": "float-quantized", "ignore": ["lm_head"],
            "config_groups": {"group_0": {"targets": ["Linear"], "input_activations": act,
                                          "weights": {"num_bits": 8, "type": "float", "symmetric": True,
                                                      "dynamic": False,
                                                      "strategy": "channel" if per_channel else "tensor"}}}}
