"""A PEFT LoRA adapter on disk, read and checked without torch: adapter_config.json and the safetensors
header of adapter_model.safetensors (tensor names, shapes, dtypes), against the shapes of the base model.

Both the gateway (which never imports torch) and the engine workers use it: the gateway to answer a bad
adapter with a 400 before any worker is asked, the workers before they load a single tensor. The adapter's
digest (its config and weight bytes) is its identity in the block hashes (shared/block_hash.py lora_root):
two adapters, or one name loaded again from other files, never share a KV block.
"""
from __future__ import annotations

import hashlib
import json
import re
import struct
from dataclasses import dataclass, field
from pathlib import Path

CONFIG_NAME = "adapter_config.json"
WEIGHTS_NAME = "adapter_model.safetensors"
# The projections of a Llama-family layer a LoRA may adapt, in the order the engine stacks them.
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
_KEY = re.compile(r"(?:^|\.)layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.default)?\.weight$")
MAX_HEADER_BYTES = 64 << 20
SAFETENSORS_DTYPES = ("F32", "F16", "BF16")


class AdapterError(ValueError):
    """An adapter that cannot be served on this model: the message says why (a 400 at load)."""


@dataclass(frozen=True)
class ModelShapes:
    """What an adapter must fit: (in, out) features of each projection and the number of layers."""

    num_layers: int
    shapes: dict[str, tuple[int, int]]

    @classmethod
    def of(cls, hidden: int, q_size: int, kv_size: int, intermediate: int, num_layers: int) -> ModelShapes:
        return cls(num_layers, {"q_proj": (hidden, q_size), "k_proj": (hidden, kv_size), "v_proj": (hidden, kv_size),
                                "o_proj": (q_size, hidden), "gate_proj": (hidden, intermediate),
                                "up_proj": (hidden, intermediate), "down_proj": (intermediate, hidden)})


@dataclass(frozen=True)
class AdapterFiles:
    """A checked adapter: where it is, its rank and scaling, which (layer, projection) it adapts, and its
    tensor names there: {(layer, proj): (lora_A name, lora_B name)}."""

    path: str
    rank: int
    scaling: float  # lora_alpha / r, or lora_alpha / sqrt(r) with use_rslora
    targets: tuple[str, ...]  # projections adapted in at least one layer
    tensors: dict[tuple[int, str], tuple[str, str]] = field(default_factory=dict)
    digest: str = ""
    base_model: str | None = None  # base_model_name_or_path, as the config says (informative)
    nbytes: int = 0  # size of the weights file


def _header(weights: Path) -> dict:
    try:
        with weights.open("rb") as f:
            raw = f.read(8)
            if len(raw) != 8:
                raise AdapterError(f"{weights.name} is not a safetensors file (shorter than its header length)")
            (n,) = struct.unpack("<Q", raw)
            if n > MAX_HEADER_BYTES:
                raise AdapterError(f"{weights.name} is not a safetensors file (header of {n} bytes)")
            header = json.loads(f.read(n))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise AdapterError(f"{weights.name} is not a readable safetensors file: {e}") from None
    if not isinstance(header, dict):
        raise AdapterError(f"{weights.name} is not a safetensors file (its header is not an object)")
    header.pop("__metadata__", None)
    return header


def _config(path: Path) -> dict:
    try:
        cfg = json.loads((path / CONFIG_NAME).read_text())
    except FileNotFoundError:
        raise AdapterError(f"no {CONFIG_NAME} in {path}") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise AdapterError(f"{CONFIG_NAME} in {path} is not valid JSON: {e}") from None
    if not isinstance(cfg, dict):
        raise AdapterError(f"{CONFIG_NAME} in {path} is not a JSON object")
    return cfg


def _target_names(raw: object) -> set[str]:
    if isinstance(raw, str):  # PEFT takes a regex over module names too: the projections it matches
        try:
            pattern = re.compile(raw)
        except re.error as e:
            raise AdapterError(f"target_modules {raw!r} is not a valid pattern: {e}") from None
        found = {p for p in PROJECTIONS if pattern.fullmatch(f"model.layers.0.self_attn.{p}")
                 or pattern.fullmatch(f"model.layers.0.mlp.{p}") or raw == p}
        return found or {raw}
    if isinstance(raw, list) and all(isinstance(t, str) for t in raw):
        return {t.rsplit(".", 1)[-1] for t in raw}
    raise AdapterError("target_modules must be a list of module names or a pattern")


def digest_of(path: Path) -> str:
    h = hashlib.blake2b(digest_size=16)
    for name in (CONFIG_NAME, WEIGHTS_NAME):
        with (path / name).open("rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
        h.update(b"|")
    return h.hexdigest()


def inspect_adapter(path: str | Path, model: ModelShapes | None = None, max_rank: int | None = None) -> AdapterFiles:
    """Read and check the adapter at path (raises AdapterError saying what is wrong). model: the base model's
    shapes (None: the checks that need them are left to the engine workers, which have them)."""
    p = Path(path)
    if not p.is_dir():
        raise AdapterError(f"adapter path {str(path)!r} is not a directory")
    cfg = _config(p)
    if cfg.get("peft_type", "LORA") != "LORA":
        raise AdapterError(f"peft_type {cfg.get('peft_type')!r}: only LORA adapters are served")
    r, alpha = cfg.get("r"), cfg.get("lora_alpha", cfg.get("r"))
    if not isinstance(r, int) or isinstance(r, bool) or r < 1:
        raise AdapterError(f"{CONFIG_NAME}: r must be a positive integer, got {r!r}")
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool):
        raise AdapterError(f"{CONFIG_NAME}: lora_alpha must be a number, got {alpha!r}")
    for key in ("rank_pattern", "alpha_pattern", "modules_to_save"):
        if cfg.get(key):
            raise AdapterError(f"{CONFIG_NAME}: {key} is not supported (one rank and alpha for every module, "
                               f"no fully trained modules)")
    if cfg.get("use_dora"):
        raise AdapterError(f"{CONFIG_NAME}: DoRA adapters (use_dora) are not supported")
    if cfg.get("bias", "none") != "none":
        raise AdapterError(f"{CONFIG_NAME}: bias={cfg.get('bias')!r} is not supported (only 'none')")
    if max_rank is not None and r > max_rank:
        raise AdapterError(f"adapter rank {r} is above --max-lora-rank {max_rank}")
    wanted = _target_names(cfg.get("target_modules"))
    unknown = sorted(wanted - set(PROJECTIONS))
    if unknown:
        raise AdapterError(f"target modules {unknown} are not projections of this model "
                           f"(it has {', '.join(PROJECTIONS)})")
    weights = p / WEIGHTS_NAME
    if not weights.is_file():
        raise AdapterError(f"no {WEIGHTS_NAME} in {path} (adapter_model.bin, a pickle, is not read)")
    header = _header(weights)
    pairs: dict[tuple[int, str], dict[str, str]] = {}
    for name, meta in header.items():
        m = _KEY.search(name)
        if m is None:
            raise AdapterError(f"{WEIGHTS_NAME}: tensor {name!r} is not a lora_A/lora_B weight of a projection")
        layer, proj, ab = int(m.group(1)), m.group(2), m.group(3)
        if proj not in wanted:
            raise AdapterError(f"{WEIGHTS_NAME}: tensor {name!r} adapts {proj}, which target_modules does not list")
        if not isinstance(meta, dict) or meta.get("dtype") not in SAFETENSORS_DTYPES:
            raise AdapterError(f"{WEIGHTS_NAME}: tensor {name!r} must be one of {SAFETENSORS_DTYPES}")
        shape = meta.get("shape")
        if not (isinstance(shape, list) and len(shape) == 2):
            raise AdapterError(f"{WEIGHTS_NAME}: tensor {name!r} is not a matrix")
        rows, cols = shape
        if (ab == "A" and rows != r) or (ab == "B" and cols != r):
            raise AdapterError(f"{WEIGHTS_NAME}: tensor {name!r} has shape {shape}, not rank r={r}")
        if model is not None:
            if layer >= model.num_layers:
                raise AdapterError(f"{WEIGHTS_NAME}: tensor {name!r} is for layer {layer}, but the base model has "
                                   f"{model.num_layers} layers: the adapter was made for another base model")
            fin, fout = model.shapes[proj]
            if (ab == "A" and cols != fin) or (ab == "B" and rows != fout):
                want = [r, fin] if ab == "A" else [fout, r]
                raise AdapterError(f"{WEIGHTS_NAME}: tensor {name!r} has shape {shape} where the base model's "
                                   f"{proj} needs {want}: the adapter was made for another base model")
        pairs.setdefault((layer, proj), {})[ab] = name
    if not pairs:
        raise AdapterError(f"{WEIGHTS_NAME} holds no lora_A/lora_B weights")
    for (layer, proj), ab in pairs.items():
        if set(ab) != {"A", "B"}:
            raise AdapterError(f"{WEIGHTS_NAME}: layer {layer} {proj} has lora_{''.join(ab)} without its pair")
    scaling = alpha / (r ** 0.5) if cfg.get("use_rslora") else alpha / r
    return AdapterFiles(path=str(p.resolve()), rank=r, scaling=float(scaling),
                        targets=tuple(t for t in PROJECTIONS if any(proj == t for _, proj in pairs)),
                        tensors={k: (v["A"], v["B"]) for k, v in sorted(pairs.items())}, digest=digest_of(p),
                        base_model=cfg.get("base_model_name_or_path"), nbytes=weights.stat().st_size)
