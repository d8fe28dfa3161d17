"""Loading the linear layers of a quantized checkpoint (AWQ, GPTQ, FP8) into the model, at their quantized size.

The loader (shared/models/loader.py) builds the model without the decoder layers' linear weights (drop_linear_weights:
nothing is allocated for them), loads everything else as usual (biases too), then load_quantized_linears reads each
projection's tensors, converts them to the served layout (shared/models/w4a16.py, fp8_linear.py), takes this
tensor-parallel rank's share (output columns of q/k/v and gate/up, input rows of o and down, with their scales and
groups), fuses q/k/v and gate/up, and puts the quantized module in the linear's place.

A projection the checkpoint left unquantized (a quantization_config ignore list) is loaded as a plain linear when
all parts of its fused layer are unquantized. Every tensor's presence, dtype and shape is checked from the headers
before any of them is read, and a mismatch is a CheckpointError naming the tensor.
"""
from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from shared.models import fp8_linear, w4a16
from shared.models.errors import CheckpointError
from shared.models.model_config import ModelConfig
from shared.models.quant_config import CheckpointQuant
from shared.models.tp.degree import TPShard

log = logging.getLogger(__name__)

# The fused layers of a decoder layer: (parent, attribute) -> (checkpoint projection, how TP splits it).
FUSED = {
    ("self_attn", "qkv_proj"): (("self_attn.q_proj", "rows"), ("self_attn.k_proj", "kv_heads"),
                                ("self_attn.v_proj", "kv_heads")),
    ("self_attn", "o_proj"): (("self_attn.o_proj", "cols"),),
    ("mlp", "gate_up_proj"): (("mlp.gate_proj", "rows"), ("mlp.up_proj", "rows")),
    ("mlp", "down_proj"): (("mlp.down_proj", "cols"),),
}
SUFFIXES = {"awq": ("qweight", "qzeros", "scales"), "gptq": ("qweight", "qzeros", "scales", "g_idx"),
            "fp8": ("weight", "weight_scale", "input_scale")}
_PROJ = re.compile(r"^model\.layers\.\d+\.(self_attn\.[qkvo]_proj|mlp\.(gate|up|down)_proj)\.([a-z_]+)$")
_INT32, _FLOATS = "I32", ("F16", "BF16", "F32")


def claims(name: str, quant: CheckpointQuant) -> bool:
    """Whether load_quantized_linears reads this checkpoint tensor (the loader's own plan skips it)."""
    m = _PROJ.match(name)
    return m is not None and m.group(3) in SUFFIXES[quant.method] + ("weight",)


def is_linear_weight(param: str) -> bool:
    return param.endswith(("qkv_proj.weight", "o_proj.weight", "gate_up_proj.weight", "down_proj.weight")) \
        and param.startswith("layers.")


def drop_linear_weights(model: nn.Module) -> None:
    """On the meta model: the decoder layers' linears lose their weights, which load_quantized_linears replaces."""
    for layer in model.layers:
        for parent, attr in FUSED:
            getattr(getattr(layer, parent), attr).weight = nn.Parameter(torch.empty(0, device="meta"))


def _dims(cfg: ModelConfig, proj: str) -> tuple[int, int]:
    """(K, N) of one checkpoint projection."""
    h, q, kv, inter = cfg.hidden_size, cfg.q_size, cfg.kv_size, cfg.intermediate_size
    return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h), "gate_proj": (h, inter),
            "up_proj": (h, inter), "down_proj": (inter, h)}[proj.rsplit(".", 1)[1]]


@dataclass(frozen=True)
class _Meta:
    path: Path
    dtype: str
    shape: tuple[int, ...]


def _expected(quant: CheckpointQuant, k: int, n: int) -> dict[str, tuple[tuple[str, ...], tuple[int, ...] | None, bool]]:
    """suffix -> (dtypes, shape (None: 1 or N elements), required) of one quantized projection's tensors."""
    g = k // quant.group if quant.group else 0
    if quant.method == "awq":
        return {"qweight": ((_INT32,), (k, n // 8), True), "qzeros": ((_INT32,), (g, n // 8), True),
                "scales": (_FLOATS, (g, n), True)}
    if quant.method == "gptq":
        return {"qweight": ((_INT32,), (k // 8, n), True), "qzeros": ((_INT32,), (g, n // 8), True),
                "scales": (_FLOATS, (g, n), True), "g_idx": ((_INT32,), (k,), quant.desc_act)}
    return {"weight": (("F8_E4M3",), (n, k), True), "weight_scale": (_FLOATS, None, True),
            "input_scale": (_FLOATS, None, quant.fp8_static_input)}


def _part_kind(prefix: str, where: dict[str, _Meta], quant: CheckpointQuant, k: int, n: int) -> str:
    """"quant" or "dense" (a float weight the checkpoint left unquantized), after checking its tensors."""
    w = where.get(f"{prefix}.weight")
    if w is not None and (quant.method != "fp8" or w.dtype in _FLOATS):
        if w.dtype not in _FLOATS or w.shape != (n, k):
            raise CheckpointError(w.path, f"{prefix}.weight", f"{w.dtype} {list(w.shape)}: expected a float [{n}, {k}]")
        return "dense"
    for suffix, (dtypes, shape, required) in _expected(quant, k, n).items():
        name = f"{prefix}.{suffix}"
        meta = where.get(name)
        if meta is None:
            if required:
                raise CheckpointError(next(iter(where.values())).path.parent, name,
                                      f"missing from this {quant.fmt} checkpoint")
            continue
        if meta.dtype not in dtypes:
            raise CheckpointError(meta.path, name, f"dtype {meta.dtype}; a {quant.fmt} checkpoint has {'/'.join(dtypes)}")
        numel = 1
        for d in meta.shape:
            numel *= d
        ok = meta.shape == shape if shape is not None else numel in (1, n)
        if not ok:
            want = list(shape) if shape is not None else f"1 or {n} values"
            group = f", group {quant.group}" if quant.group else ""
            raise CheckpointError(meta.path, name, f"shape {list(meta.shape)}, expected {want} for a {k} x {n} "
                                                   f"layer ({quant.fmt}{group})")
    return "quant"


def _split_range(split: str, full: int, shard: TPShard) -> tuple[int, int]:
    """This rank's [start, stop) of a dimension of size `full` split as shared/models/tp/shard_read.py does."""
    if split == "kv_heads":
        start = shard.kv_head_start * shard.head_dim
        return start, start + shard.kv_size
    n = full // shard.size
    return shard.rank * n, (shard.rank + 1) * n


class RowParallelQuant(nn.Module):
    """A row-parallel layer (o, down) whose share of the input rows is quantized: local product, all-reduce, bias."""

    def __init__(self, local: nn.Module, tp, bias: torch.Tensor | None) -> None:  # noqa: ANN001 - TPGroup
        super().__init__()
        self.local, self.tp = local, tp
        self.register_buffer("bias", None if bias is None else bias.detach().clone())
        self.in_features, self.out_features = local.in_features, local.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.tp.all_reduce(self.local(x))
        return out if self.bias is None else out + self.bias

    def dequantized(self) -> torch.Tensor:
        return self.local.dequantized()


def _read(handles: dict, where: dict[str, _Meta], prefix: str, quant: CheckpointQuant, kind: str,
          device: str):  # noqa: ANN202
    def get(suffix: str) -> torch.Tensor | None:  # a projection's tensors may sit in different shards
        meta = where.get(f"{prefix}.{suffix}")
        # repacked where they are served: on a GPU the unpacking and sorting run there, not on the host
        return None if meta is None else handles[meta.path].get_tensor(f"{prefix}.{suffix}").to(device)

    if kind == "dense":
        return get("weight")
    if quant.method == "awq":
        return w4a16.from_awq(get("qweight"), get("qzeros"), get("scales"), quant.group)
    if quant.method == "gptq":
        return w4a16.from_gptq(get("qweight"), get("qzeros"), get("scales"), get("g_idx"), quant.group,
                               quant.zero_offset)
    return fp8_linear.from_checkpoint(get("weight"), get("weight_scale"), get("input_scale"))


def _share(w, split: str, k: int, n: int, shard: TPShard | None):  # noqa: ANN001, ANN202
    if shard is None:
        return w
    if split == "cols":
        a, b = _split_range(split, k, shard)
        return w[:, a:b] if isinstance(w, torch.Tensor) else w.rows(a, b)
    a, b = _split_range(split, n, shard)
    return w[a:b] if isinstance(w, torch.Tensor) else w.columns(a, b)


@dataclass(frozen=True)
class QuantPlan:
    files: list[Path]
    where: dict[str, _Meta]  # tensor -> its file, dtype and shape
    kinds: dict[str, str]  # projection prefix -> "quant" or "dense"


def inspect(cfg: ModelConfig, files: list[Path]) -> QuantPlan:
    """Every quantized projection's tensors found and checked from the headers (no tensor data is read)."""
    quant = cfg.quant
    where: dict[str, _Meta] = {}
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                if claims(name, quant):
                    sl = f.get_slice(name)
                    where[name] = _Meta(path, sl.get_dtype(), tuple(sl.get_shape()))
    kinds: dict[str, str] = {}
    for i in range(cfg.num_layers):  # every header checked before any tensor is read
        for (parent, attr), parts in FUSED.items():
            found = {p: _part_kind(f"model.layers.{i}.{p}", where, quant, *_dims(cfg, p)) for p, _ in parts}
            if len(set(found.values())) > 1:
                raise CheckpointError(files[0].parent, f"model.layers.{i}.{parent}.{attr}",
                                      f"{', '.join(f'{p}: {v}' for p, v in found.items())}: the parts of a fused "
                                      "layer must be all quantized or all unquantized")
            kinds.update({f"model.layers.{i}.{p}": v for p, v in found.items()})
    return QuantPlan(files, where, kinds)


@torch.no_grad()
def load_quantized_linears(model: nn.Module, cfg: ModelConfig, qplan: QuantPlan, shard: TPShard | None,
                           device: str, dtype: torch.dtype) -> int:
    """Put every decoder layer's quantized linears in place; returns how many weights (elements) are quantized."""
    quant, files, where, kinds = cfg.quant, qplan.files, qplan.where, qplan.kinds
    handles = {path: safe_open(str(path), framework="pt") for path in files}
    count = 0
    for i, layer in enumerate(model.layers):
        for (parent_name, attr), parts in FUSED.items():
            parent = getattr(layer, parent_name)
            old = getattr(parent, attr)
            got = []
            for proj, split in parts:
                prefix = f"model.layers.{i}.{proj}"
                k, n = _dims(cfg, proj)
                try:
                    got.append(_share(_read(handles, where, prefix, quant, kinds[prefix], device), split, k, n, shard))
                except ValueError as e:
                    raise CheckpointError(files[0].parent, prefix, f"tensor-parallel rank {shard.rank}: {e}") from None
            what = f"model.layers.{i}.{parent_name}.{attr}"
            row_parallel = shard is not None and parts[0][1] == "cols"
            if isinstance(got[0], torch.Tensor):  # unquantized in the checkpoint: the plain linear, weights restored
                old.weight = nn.Parameter(torch.cat(got).to(device=device, dtype=dtype), requires_grad=False)
                continue
            try:
                fused = (w4a16.fuse if quant.method != "fp8" else fp8_linear.fuse)(got, what)
            except ValueError as e:
                raise CheckpointError(files[0].parent, what, str(e)) from None
            bias = None if row_parallel else old.bias
            cls = fp8_linear.Fp8Linear if quant.method == "fp8" else w4a16.W4A16Linear
            new: nn.Module = cls(fused, bias)
            if row_parallel:
                new = RowParallelQuant(new, old.tp, old.bias)
            setattr(parent, attr, new.to(device))
            count += new.in_features * new.out_features
    return count


@torch.no_grad()
def quantize_fp8_model(model: nn.Module) -> int:
    """`--quantization fp8` on an unquantized checkpoint: every decoder layer's linears to FP8 (a tensor-parallel
    rank's shares each with their own row scales); returns how many weights are quantized."""
    from shared.models.quant_linear import quantize_layers
    from shared.models.tp.row_linear import RowParallelLinear

    def one(linear: nn.Module) -> nn.Module:
        if isinstance(linear, RowParallelLinear):
            return RowParallelQuant(fp8_linear.Fp8Linear(fp8_linear.quantize_fp8_weight(linear.weight), None),
                                    linear.tp, linear.bias)
        return fp8_linear.Fp8Linear.from_linear(linear)

    return quantize_layers(model, one)


def quantize_w4(weight: torch.Tensor, group: int) -> w4a16.W4Weights:
    """A float weight [N, K] rounded to 4 bits with a zero point per group of K (round to nearest, as AWQ's
    and GPTQ's asymmetric grids are before their search): for dummy weights at real shapes."""
    n, k = weight.shape
    w = weight.detach().float().t().reshape(k // group, group, n)
    lo, hi = w.amin(dim=1).clamp(max=0), w.amax(dim=1).clamp(min=0)
    scale = ((hi - lo) / 15).clamp(min=1e-8).half()
    zero = torch.round(-lo / scale.float()).clamp(0, 15)
    q = torch.round(w / scale.float()[:, None] + zero[:, None]).clamp(0, 15).reshape(k, n).to(torch.int32)
    return w4a16.W4Weights(w4a16.pack_rows(q).to(weight.device), scale.to(weight.device),
                           zero.to(torch.uint8).to(weight.device), group)


@torch.no_grad()
def quantize_w4_model(model: nn.Module, group: int) -> int:
    from shared.models.quant_linear import quantize_layers
    from shared.models.tp.row_linear import RowParallelLinear

    def one(linear: nn.Module) -> nn.Module:
        g = group if linear.weight.shape[1] % group == 0 else 32  # a width the group does not divide
        if isinstance(linear, RowParallelLinear):
            return RowParallelQuant(w4a16.W4A16Linear(quantize_w4(linear.weight, g), None), linear.tp, linear.bias)
        return w4a16.W4A16Linear(quantize_w4(linear.weight, g), linear.bias)

    return quantize_layers(model, one)
