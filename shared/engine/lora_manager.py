"""An engine's LoRA adapters: the registry (name -> checked adapter), the host cache of their weights and the
device slots a step computes with (S-LoRA's layout: all adapters on the host, the ones in use in a fixed set of
device slots).

- Registry: adapters loaded at start (--lora-modules) or while serving (shared/engine/lora_commands.py), each
  checked against the model (shared/models/lora_files.py) before anything is kept. A request names one; its
  Sequence holds the Adapter object, so unloading a name stops new requests at once while those already running
  finish with the weights they started with.
- Host cache: at most --max-cpu-loras adapters' weights in host memory, least recently used dropped first and
  read from disk again when a request needs it.
- Device slots: --max-loras slots of rank R (--max-lora-rank rounded up to a power of 2), per layer and
  projection A [slots, R, in] and B [slots, out, R], allocated before the KV pool is sized, so the memory plan
  counts them. A step's adapters are put in slots before its forward, least recently used slot evicted first
  (the scheduler keeps a step's adapters within the slot count: shared/engine/scheduler.py).
- Each step: `prepare` writes every row's slot (-1: the base model) into one device tensor that every layer's
  hook reads (kernels/lora_shrink_expand.py). A step without any adapter row sets none and costs nothing. Steps
  with adapter rows run the eager Python path: on CPU the C++ decoder stack has no LoRA, and on CUDA the decode
  graphs are captured without LoRA rows. Capturing graphs with LoRA would take `rows` as one more static graph
  input (the padded rows -1), which is why the slot index is a device tensor the kernels read rather than a host
  branch; that capture is not built yet.
"""
from __future__ import annotations

import itertools
import logging
from collections import OrderedDict
from dataclasses import dataclass, field

import torch

from kernels.lora_shrink_expand import lora_shrink_expand
from shared.engine.errors import ConfigError
from shared.engine.lora_config import LoRAConfig
from shared.models.lora_files import AdapterError, AdapterFiles, ModelShapes, inspect_adapter
from shared.models.lora_weights import AdapterWeights, read_adapter

log = logging.getLogger(__name__)

# Each hook's output columns: (projection, offset in the fused output); offsets resolved per model below.
FUSED = {"qkv": ("q_proj", "k_proj", "v_proj"), "o": ("o_proj",), "gate_up": ("gate_proj", "up_proj"),
         "down": ("down_proj",)}
_uids = itertools.count(1)


@dataclass(eq=False)
class Adapter:
    name: str
    files: AdapterFiles
    uid: int = field(default_factory=lambda: next(_uids))

    @property
    def digest(self) -> str:
        return self.files.digest


@dataclass
class LoRAStats:
    disk_reads: int = 0  # adapters read from disk (at load, and again after the host cache dropped them)
    slot_loads: int = 0  # adapters copied into a device slot
    slot_evictions: int = 0


class LayerLoRA:
    """One decoder layer's hook: adds the step's LoRA deltas to its projections' outputs in place."""

    def __init__(self, manager: LoRAManager, layer: int) -> None:
        self.m = manager
        self.layer = layer

    def __call__(self, hook: str, x: torch.Tensor, out: torch.Tensor) -> None:
        m = self.m
        rows = m.rows
        if rows is None:
            return
        for proj in FUSED[hook]:
            if proj not in m.targeted:
                continue
            off, n = m.columns[proj]
            a, b = m.a[self.layer][proj], m.b[self.layer][proj]
            lora_shrink_expand(out[:, off : off + n], x, a, b, rows)


class LoRAManager:
    def __init__(self, config: LoRAConfig, model: torch.nn.Module, device: str) -> None:
        cfg = model.cfg
        self.config = config
        self.device = device
        self.dtype = model.norm.weight.dtype
        self.shapes = ModelShapes.of(cfg.hidden_size, cfg.q_size, cfg.kv_size, cfg.intermediate_size, cfg.num_layers)
        q, kv, inter = cfg.q_size, cfg.kv_size, cfg.intermediate_size
        self.columns = {"q_proj": (0, q), "k_proj": (q, kv), "v_proj": (q + kv, kv), "o_proj": (0, cfg.hidden_size),
                        "gate_proj": (0, inter), "up_proj": (inter, inter), "down_proj": (0, cfg.hidden_size)}
        slots, rank = config.max_loras, config.slot_rank
        self.a: list[dict[str, torch.Tensor]] = []
        self.b: list[dict[str, torch.Tensor]] = []
        for _ in range(cfg.num_layers):
            self.a.append({p: torch.zeros(slots, rank, fin, dtype=self.dtype, device=device)
                           for p, (fin, _) in self.shapes.shapes.items()})
            self.b.append({p: torch.zeros(slots, fout, rank, dtype=self.dtype, device=device)
                           for p, (_, fout) in self.shapes.shapes.items()})
        self.registry: dict[str, Adapter] = {}
        self.host: OrderedDict[int, AdapterWeights] = OrderedDict()  # uid -> weights, least recently used first
        self.slots: list[Adapter | None] = [None] * slots
        self.slot_use: OrderedDict[int, None] = OrderedDict((i, None) for i in range(slots))  # LRU order
        self.targeted: set[str] = set()  # projections some slotted adapter adapts (others are skipped)
        self.rows: torch.Tensor | None = None  # the step's per-row slots; None: no adapter row this step
        self.stats = LoRAStats()
        self.loaded: tuple[str, ...] = ()  # the registry's names, replaced whole (read by other threads: beats)
        self.resident: tuple[str, ...] = ()  # ... of them, those in a slot or the host cache (no disk read to start)
        for i, layer in enumerate(model.layers):
            hook = LayerLoRA(self, i)
            layer.self_attn.lora = hook
            layer.mlp.lora = hook
        for name, path in config.modules:
            try:
                self.add(name, path)
            except AdapterError as e:  # a bad adapter at start stops the worker; restarting would not help
                raise ConfigError(f"--lora-modules {name}={path}: {e}") from None

    @property
    def nbytes(self) -> int:
        """Device bytes of the slots (what the memory plan counts)."""
        return sum(t.numel() * t.element_size() for per in (self.a, self.b) for layer in per for t in layer.values())

    # --- the registry ---------------------------------------------------------------------------

    def add(self, name: str, path: str) -> Adapter:
        """Check and read an adapter, then register it (raises AdapterError, changing nothing). The same name
        and files again is a no-op (a gateway making sure a worker that joined late holds it)."""
        files = inspect_adapter(path, self.shapes, self.config.max_lora_rank)
        held = self.registry.get(name)
        if held is not None:
            if held.digest == files.digest:
                return held
            raise AdapterError(f"an adapter named {name!r} is already loaded (from other files)")
        adapter = Adapter(name, files)
        self._cache(adapter, read_adapter(files, self.dtype))
        self.registry[name] = adapter
        self._names_changed()
        log.info("LoRA adapter %s loaded from %s (rank %d, %s)", name, files.path, files.rank, ", ".join(files.targets))
        return adapter

    def remove(self, name: str) -> None:
        """Forget an adapter: new requests naming it are refused; requests running with it keep its weights."""
        adapter = self.registry.pop(name, None)
        if adapter is None:
            raise AdapterError(f"no adapter named {name!r} is loaded")
        self._names_changed()
        log.info("LoRA adapter %s unloaded", name)

    def adapter(self, name: str) -> Adapter:
        adapter = self.registry.get(name)
        if adapter is None:
            raise ValueError(f"the LoRA adapter {name!r} is not loaded on this worker")
        return adapter

    def names(self) -> list[str]:
        return sorted(self.registry)

    def digests(self) -> dict[str, str]:
        return {n: a.digest for n, a in sorted(self.registry.items())}

    def _cache(self, adapter: Adapter, weights: AdapterWeights) -> None:
        self.host[adapter.uid] = weights
        self.host.move_to_end(adapter.uid)
        self.stats.disk_reads += 1
        while len(self.host) > self.config.host_capacity:
            self.host.popitem(last=False)
        self._names_changed()

    def _names_changed(self) -> None:
        self.loaded = tuple(sorted(self.registry))
        near = set(self.host) | {a.uid for a in self.slots if a is not None}
        self.resident = tuple(sorted(n for n, a in self.registry.items() if a.uid in near))

    def _weights(self, adapter: Adapter) -> AdapterWeights:
        w = self.host.get(adapter.uid)
        if w is None:  # dropped from the host cache: read again
            w = read_adapter(adapter.files, self.dtype)
            self._cache(adapter, w)
        else:
            self.host.move_to_end(adapter.uid)
        return w

    # --- the slots ------------------------------------------------------------------------------

    def slot_of(self, adapter: Adapter, pinned: set[int]) -> int:
        """The adapter's device slot, loading it into the least recently used slot not in `pinned` if needed."""
        for i, held in enumerate(self.slots):
            if held is adapter:
                self.slot_use.move_to_end(i)
                return i
        free = next((i for i in self.slot_use if i not in pinned), None)
        assert free is not None, "more adapters in one step than --max-loras slots (the scheduler bounds them)"
        if self.slots[free] is not None:
            self.stats.slot_evictions += 1
        w = self._weights(adapter)
        r = adapter.files.rank
        for layer in range(len(self.a)):
            for proj in self.a[layer]:
                a, b = self.a[layer][proj][free], self.b[layer][proj][free]
                pair = w.pairs.get((layer, proj))
                a.zero_()
                b.zero_()
                if pair is not None:
                    a[:r].copy_(pair[0])
                    b[:, :r].copy_(pair[1])
        self.slots[free] = adapter
        self.slot_use.move_to_end(free)
        self.stats.slot_loads += 1
        self.targeted = {t for held in self.slots if held is not None for t in held.files.targets}
        self._names_changed()
        return free

    def prepare(self, plan, order: list[int]) -> bool:  # noqa: ANN001 - the step's [(Sequence, tokens)]
        """Before a step's forward: each row's slot (rows in step order), loading adapters as needed. Returns
        whether any row uses an adapter (False: the step runs exactly as without LoRA)."""
        self.rows = None
        if not any(plan[i][0].lora is not None for i in order):
            return False
        pinned: set[int] = set()
        rows: list[int] = []
        for i in order:
            seq, n = plan[i]
            slot = -1
            if seq.lora is not None:
                slot = self.slot_of(seq.lora, pinned)
                pinned.add(slot)
            rows.extend([slot] * n)
        self.rows = torch.tensor(rows, dtype=torch.int32).to(self.device, non_blocking=True)
        return True

    def finish(self) -> None:
        self.rows = None

    def warm_up(self) -> None:
        """Run each projection's kernels once (every Triton variant compiles at start, none in a serving step)."""
        x_rows = torch.full((2,), 0, dtype=torch.int32, device=self.device)
        for proj, (fin, fout) in self.shapes.shapes.items():
            x = torch.zeros(2, fin, dtype=self.dtype, device=self.device)
            y = torch.zeros(2, fout, dtype=self.dtype, device=self.device)
            lora_shrink_expand(y, x, self.a[0][proj], self.b[0][proj], x_rows)


def check_adapter_request(manager: LoRAManager | None, name: str | None) -> Adapter | None:
    """The Adapter a request names (None: the base model); ValueError when this engine cannot serve it."""
    if name is None:
        return None
    if manager is None:
        raise ValueError(f"the request names the LoRA adapter {name!r}, but this worker serves no adapters "
                         f"(start it with --enable-lora)")
    return manager.adapter(name)
