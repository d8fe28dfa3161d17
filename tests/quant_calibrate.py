"""Calibrated 4-bit checkpoints, as AutoAWQ and AutoGPTQ make them, written in their published formats by
tests/quant_checkpoints.py: the tests' stand-in for the real tools (not installed here; they need a GPU).

Calibration: the float model (transformers' own class, float32) runs a fixed text once; each projection's input
rows are kept (a 135M model at a few hundred tokens: some 100 MB).

- AWQ (AutoAWQ's `_search_best_scale` and `_search_best_clip`): per input channel s = mean|x|^a / mean|w~|^(1-a)
  (w~: |w| over its group's max; AutoAWQ's duo scaling), a in a grid of 20 over [0, 1), the a whose rounded
  weight (W s) with inputs x / s gives the smallest output error; s folded into the op before: the RMSNorm weight
  for q/k/v and gate/up, up's rows for down, v's rows for o only when v and o are square (AutoAWQ skips GQA, as
  here). Then each group's clipping range shrunk (down to half, 20 steps) where it lowers the output error, except
  for q and k (AutoAWQ leaves them: attention scores magnify their error).
- GPTQ (the paper's algorithm, AutoGPTQ's `fasterquant`): columns rounded one at a time, each one's error spread
  over the columns not yet rounded through the inverse Hessian 2 X^T X (damped 1%), in blocks of 128; act order
  optional (columns by decreasing Hessian diagonal, g_idx as AutoGPTQ writes it without static groups).

The scales are searched on each layer's float inputs at once (AutoAWQ feeds each layer the outputs of the layers
already scaled and clipped; the difference is second order here and keeps this one pass).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from tests import quant_checkpoints as qc

GRID = 20


@dataclass(frozen=True)
class Calibration:
    inputs: dict[str, torch.Tensor]  # projection name (model.layers.L.self_attn.q_proj) -> input rows [T, K]


def load_float_model(src: Path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(src), torch_dtype=torch.float32).eval()


@torch.no_grad()
def calibrate(model: torch.nn.Module, ids: list[list[int]]) -> Calibration:
    seen: dict[str, list[torch.Tensor]] = {}
    hooks = []
    for name, mod in model.named_modules():
        if name.endswith(qc.PROJS):
            hooks.append(mod.register_forward_hook(
                lambda m, a, o, name=name: seen.setdefault(name, []).append(a[0].reshape(-1, a[0].shape[-1]))))
    try:
        for row in ids:
            model(torch.tensor([row]))
    finally:
        for h in hooks:
            h.remove()
    return Calibration({k: torch.cat(v) for k, v in seen.items()})


def fake_quant(w: torch.Tensor, group: int) -> torch.Tensor:
    """w [N, K] rounded to AWQ's asymmetric 4-bit grid (fp16 scales, integer zeros) and back."""
    n, k = w.shape
    g = w.reshape(n, k // group, group)
    lo, hi = g.amin(-1, keepdim=True).clamp(max=0), g.amax(-1, keepdim=True).clamp(min=0)
    scale = ((hi - lo) / 15).clamp(min=1e-6).half().float()
    zero = torch.round(-lo / scale).clamp(0, 15)
    return ((torch.round(g / scale + zero).clamp(0, 15) - zero) * scale).reshape(n, k)


def _w_mean(ws: list[torch.Tensor], group: int) -> torch.Tensor:
    w = torch.cat(ws)
    g = w.abs().reshape(w.shape[0], -1, group)
    return (g / g.amax(-1, keepdim=True).clamp(min=1e-12)).reshape_as(w).mean(0)


def _sample(x: torch.Tensor, rows: int) -> torch.Tensor:
    return x[torch.linspace(0, x.shape[0] - 1, min(rows, x.shape[0])).long()]


def search_scale(x: torch.Tensor, ws: list[torch.Tensor], group: int, rows: int = 256) -> torch.Tensor:
    """AutoAWQ's grid search: the per-input-channel scale [K] minimising |x W^T - (x/s) Q(W s)^T|^2 over ws (the
    error on `rows` of the calibration rows, spread over them, for time; the channel means on all)."""
    x_mean, w_mean = x.abs().mean(0), _w_mean(ws, group)
    x = _sample(x, rows)
    ref = [x @ w.t() for w in ws]
    best, best_s = float("inf"), torch.ones_like(x_mean)
    for i in range(GRID):
        a = i / GRID
        s = (x_mean.pow(a) / (w_mean.pow(1 - a) + 1e-4)).clamp(min=1e-4)
        s = s / (s.max() * s.min()).sqrt()
        err = sum(((x / s) @ fake_quant(w * s, group).t() - r).pow(2).mean().item() for w, r in zip(ws, ref))
        if err < best:
            best, best_s = err, s
    return best_s


def search_clip(x: torch.Tensor, w: torch.Tensor, group: int, rows: int = 128) -> torch.Tensor:
    """AutoAWQ's clip search: each group's |w| bound shrunk by up to half where the group's output error drops;
    the clamped weight [N, K]."""
    n, k = w.shape
    xs = _sample(x, rows)
    xg = xs.reshape(xs.shape[0], k // group, group)  # [T, G, g]
    wg = w.reshape(n, k // group, group)  # [N, G, g]
    ref = torch.einsum("tgc,ngc->ngt", xg, wg)
    amax = wg.abs().amax(-1, keepdim=True)
    best_err = torch.full((n, k // group), float("inf"))
    best_max = amax.clone()
    for i in range(GRID // 2):
        mx = amax * (1 - i / GRID)
        q = fake_quant(wg.clamp(-mx, mx).reshape(n, k), group).reshape(n, k // group, group)
        err = (torch.einsum("tgc,ngc->ngt", xg, q) - ref).pow(2).mean(-1)
        better = err < best_err
        best_err = torch.where(better, err, best_err)
        best_max = torch.where(better[..., None], mx, best_max)
    return wg.clamp(-best_max, best_max).reshape(n, k)


def _layers(tensors: dict[str, torch.Tensor]) -> list[str]:
    return sorted({n.rsplit(".self_attn.", 1)[0] for n in tensors if ".self_attn.q_proj.weight" in n},
                  key=lambda p: int(p.rsplit(".", 1)[1]))


@torch.no_grad()
def awq_float_weights(tensors: dict[str, torch.Tensor], cal: Calibration, group: int,
                      clip: bool = True) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors with AWQ's scales folded in and its clipping applied: rounding each projection to
    the nearest point of its grid (tests/quant_checkpoints.py's awq writer) then gives AutoAWQ's checkpoint."""
    t = {k: v.float().clone() for k, v in tensors.items()}
    for layer in _layers(t):
        a, m = f"{layer}.self_attn", f"{layer}.mlp"

        def w(p: str) -> torch.Tensor:
            return t[f"{p}.weight"]

        qkv = [f"{a}.q_proj", f"{a}.k_proj", f"{a}.v_proj"]
        s = search_scale(cal.inputs[qkv[0]], [w(p) for p in qkv], group)
        t[f"{layer}.input_layernorm.weight"] /= s
        for p in qkv:
            t[f"{p}.weight"] *= s
        scaled_in = {p: cal.inputs[p] / s for p in qkv}
        if w(f"{a}.v_proj").shape == w(f"{a}.o_proj").shape:
            s = search_scale(cal.inputs[f"{a}.o_proj"], [w(f"{a}.o_proj")], group)
            t[f"{a}.v_proj.weight"] /= s[:, None]
            t[f"{a}.o_proj.weight"] *= s
            scaled_in[f"{a}.o_proj"] = cal.inputs[f"{a}.o_proj"] / s
        else:
            scaled_in[f"{a}.o_proj"] = cal.inputs[f"{a}.o_proj"]
        gu = [f"{m}.gate_proj", f"{m}.up_proj"]
        s = search_scale(cal.inputs[gu[0]], [w(p) for p in gu], group)
        t[f"{layer}.post_attention_layernorm.weight"] /= s
        for p in gu:
            t[f"{p}.weight"] *= s
            scaled_in[p] = cal.inputs[p] / s
        s = search_scale(cal.inputs[f"{m}.down_proj"], [w(f"{m}.down_proj")], group)
        t[f"{m}.up_proj.weight"] /= s[:, None]
        t[f"{m}.down_proj.weight"] *= s
        scaled_in[f"{m}.down_proj"] = cal.inputs[f"{m}.down_proj"] / s
        if clip:
            for p, x in scaled_in.items():
                if not p.endswith(("q_proj", "k_proj")):
                    t[f"{p}.weight"] = search_clip(x, w(p), group)
    return {k: v.to(tensors[k].dtype) for k, v in t.items()}


@torch.no_grad()
def gptq_quantize(w: torch.Tensor, x: torch.Tensor, group: int, sym: bool = True, act_order: bool = False,
                  damp: float = 0.01, block: int = 128) -> tuple[torch.Tensor, ...]:
    """GPTQ of w [N, K] on inputs x [T, K] -> (q [K, N], scales [G, N] float16, zeros [G, N], g_idx [K]) in the
    layout tests/quant_checkpoints.py packs (column c of w is row c of q; group of column c: g_idx[c])."""
    n, k = w.shape
    W = w.double().clone()
    H = (2 / x.shape[0]) * (x.double().t() @ x.double())
    dead = torch.diag(H) == 0
    H[dead, dead] = 1
    W[:, dead] = 0
    perm = torch.argsort(torch.diag(H), descending=True) if act_order else torch.arange(k)
    W, H = W[:, perm], H[perm][:, perm]
    H += damp * torch.diag(H).mean() * torch.eye(k, dtype=H.dtype)
    Hinv = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(H)), upper=True)
    Q = torch.zeros(n, k, dtype=torch.int64)
    scales = torch.zeros(k // group, n)
    zeros = torch.zeros(k // group, n, dtype=torch.int64)
    scale = zero = None
    for i1 in range(0, k, block):
        i2 = min(i1 + block, k)
        W1, Err1, Hinv1 = W[:, i1:i2].clone(), torch.zeros(n, i2 - i1, dtype=W.dtype), Hinv[i1:i2, i1:i2]
        for i in range(i2 - i1):
            col = i1 + i
            if col % group == 0:  # the group's grid from the columns as they are now (errors of earlier ones in)
                g = torch.cat([W1[:, i:], W[:, i2:]], 1)[:, :group] if i + group > i2 - i1 else W1[:, i:i + group]
                lo, hi = g.amin(1).clamp(max=0), g.amax(1).clamp(min=0)
                if sym:
                    hi = torch.maximum(lo.abs(), hi)
                    lo = -hi
                scale = ((hi - lo) / 15).clamp(min=1e-6).half().double()
                zero = torch.full_like(scale, 8) if sym else torch.round(-lo / scale).clamp(1, 15)
                scales[col // group], zeros[col // group] = scale.float(), zero.long()
            q = torch.round(W1[:, i] / scale + zero).clamp(0, 15)
            Q[:, col] = q.long()
            err = (W1[:, i] - (q - zero) * scale) / Hinv1[i, i]
            W1[:, i:] -= err[:, None] @ Hinv1[i, i:][None, :]
            Err1[:, i] = err
        W[:, i2:] -= Err1 @ Hinv[i1:i2, i2:]
    g_idx = torch.empty(k, dtype=torch.int64)
    g_idx[perm] = torch.arange(k) // group
    q = torch.empty(k, n, dtype=torch.int64)
    q[perm] = Q.t()
    return q, scales.half(), zeros, g_idx


def gptq_parts(tensors: dict[str, torch.Tensor], cal: Calibration, group: int, sym: bool = True,
               act_order: bool = False) -> dict[str, dict[str, torch.Tensor]]:
    """Every projection GPTQ'd, packed as AutoGPTQ's v1 format: projection name -> its tensors."""
    out = {}
    for name, x in cal.inputs.items():
        q, s, z, g_idx = gptq_quantize(tensors[f"{name}.weight"].float(), x, group, sym, act_order)
        out[name] = {"qweight": qc.pack_gptq_rows(q), "qzeros": qc.pack_gptq_zeros(z, v1=True), "scales": s,
                     "g_idx": g_idx.to(torch.int32)}
    return out


def write_awq(src: Path, out: Path, ids: list[list[int]], group: int, clip: bool = True) -> Path:
    model = load_float_model(src)
    cal = calibrate(model, ids)
    tensors = qc.read_tensors(src)
    floats = awq_float_weights({k: v for k, v in tensors.items()}, cal, group, clip)
    return qc.write_quantized(src, out, "awq", qc.awq_config(group), group=group, tensors=floats)


def write_gptq(src: Path, out: Path, ids: list[list[int]], group: int, sym: bool = True,
               act_order: bool = False) -> Path:
    model = load_float_model(src)
    cal = calibrate(model, ids)
    parts = gptq_parts(qc.read_tensors(src), cal, group, sym, act_order)
    return qc.write_quantized(src, out, "gptq", qc.gptq_config(group, sym, act_order), group=group, parts=parts)
