"""Will the mesh fit its GPUs? Planned before `kvmesh up` starts a worker, from the checkpoint's config alone.

Each engine worker needs, inside its share of its GPU's memory (shared/launcher/process_spec.py's placement()):
its copy of the weights, the activations of a step at --max-num-batched-tokens, the CUDA context and
cuBLAS workspaces, the CUDA graphs' reserve, and KV for one request of max_model_len tokens (what the
worker's own memory budget requires at start: shared/engine/memory_budget.py). The estimate here is the
same arithmetic done without loading anything, so a layout that cannot work is refused (or replaced)
before a single process starts, instead of a worker exiting 78 minutes into a start-up.

When the requested layout does not fit, `plan_mesh` picks one that does, and says why:
- the default layout (one prefill and one decode worker a GPU pair) first drops to one worker per GPU that
  prefills and decodes (two copies of the weights do not fit), keeping the model's full context;
- then, or for a layout the user asked for explicitly, lowers max_model_len to what the smallest share holds;
- and refuses when not even the weights and one step fit.
"""
from __future__ import annotations

import re
import shutil
import subprocess
from dataclasses import dataclass, replace

from shared.engine.memory_budget import CUDA_GRAPH_RESERVE, GIB
from shared.launcher.process_spec import MeshOptions, placement
from shared.models.model_config import ModelConfig
from shared.models.quant_config import CHECKPOINT_METHODS, linear_bytes

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
# The CUDA context, cuBLAS/cuDNN workspaces and the NCCL-free runtime a worker holds outside torch's allocator:
# about 0.5-0.7 GiB on an H100 with torch 2.x; rounded up so the plan errs towards fitting at start.
NON_TORCH_BYTES = 1 * GIB
# Rows of full-vocabulary float32 logits a step may hold beside its activations: the sampled rows (up to
# max_num_seqs) and a prompt-logprobs slice (shared/engine/prompt_logprobs.py), each twice (logits, softmax).
PROMPT_LOGPROB_ROWS = 256
# A tensor-parallel rank's NCCL communicators and buffers, outside torch's allocator: an estimate (a few hundred
# MiB per communicator with NCCL's defaults), not measured here (no multi-GPU machine); rounded up.
NCCL_BYTES = 1 * GIB


@dataclass(frozen=True)
class WorkerDefaults:
    """The engine workers' defaults the plan depends on (shared/config.py's EngineConfig, which imports torch;
    tests/test_gpu_plan.py keeps the two equal)."""
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 128
    block_size: int = 16


WORKER_DEFAULTS = WorkerDefaults()
HEADROOM = 0.03
# Below this many tokens of context a "fitting" worker is of no use: refuse instead.
MIN_MODEL_LEN = 1024


@dataclass(frozen=True)
class WorkerNeeds:
    """Bytes one engine worker needs, from the model's config, its dtype and the scheduler's limits."""
    weights: int
    activations: int
    overhead: int  # non-torch memory + the CUDA graphs' reserve
    kv_per_token: int
    num_kv_heads: int = 0  # the model's (0: unknown, the KV then divides by the degree)

    @property
    def fixed(self) -> int:
        return self.weights + self.activations + self.overhead

    def total(self, tokens: int) -> int:
        return self.fixed + self.kv_per_token * tokens

    def per_rank(self, tp: int) -> WorkerNeeds:
        """What the neediest rank of a worker of degree tp holds on its GPU: 1/tp of the weights (the vocabulary
        too is split), its KV heads (replicated when the degree exceeds them), NCCL beside the runtime; the
        activations stay whole (hidden-size rows are not split, and rank 0 gathers every row's full logits)."""
        if tp == 1:
            return self
        heads = self.num_kv_heads or tp
        local_heads = max(heads // tp, 1)
        return WorkerNeeds(-(-self.weights // tp), self.activations, self.overhead + NCCL_BYTES,
                           self.kv_per_token * local_heads // heads, self.num_kv_heads)


def weight_bytes(cfg: ModelConfig, elem: int, quantization: str | None = None) -> int:
    """The weights as served: the decoder layers' linears at their quantized size (the checkpoint's own
    quantization, or `quantization`, e.g. fp8 applied at load), everything else in the model dtype."""
    method = quantization if quantization in CHECKPOINT_METHODS else (cfg.quant.method if cfg.quant else None)
    if method is None:
        return parameter_count(cfg) * elem
    group = cfg.quant.group if cfg.quant and cfg.quant.group else 128
    h, q, kv, inter = cfg.hidden_size, cfg.q_size, cfg.kv_size, cfg.intermediate_size
    shapes = ((h, q + 2 * kv), (q, h), (h, 2 * inter), (inter, h))
    linear_params = sum(k * n for k, n in shapes)
    linear = sum(linear_bytes(method, k, n, group, elem) for k, n in shapes)
    return (parameter_count(cfg) - cfg.num_layers * linear_params) * elem + cfg.num_layers * linear


def parameter_count(cfg: ModelConfig) -> int:
    h, layers = cfg.hidden_size, cfg.num_layers
    attn = h * (cfg.q_size + 2 * cfg.kv_size) + cfg.q_size * h
    attn += (cfg.q_size + 2 * cfg.kv_size) * cfg.qkv_bias + h * cfg.o_bias + 2 * cfg.head_dim * cfg.qk_norm
    mlp = 3 * h * cfg.intermediate_size + (2 * cfg.intermediate_size + h) * cfg.mlp_bias
    embed = cfg.vocab_size * h * (1 if cfg.tie_word_embeddings else 2)
    return layers * (attn + mlp + 2 * h) + embed + h


def worker_needs(cfg: ModelConfig, dtype: str, kv_cache_dtype: str, max_num_batched_tokens: int,
                 max_num_seqs: int, quantization: str | None = None) -> WorkerNeeds:
    dtype = cfg.dtype if dtype == "auto" else dtype  # on a GPU "auto" is the checkpoint's dtype
    elem = DTYPE_BYTES[dtype]
    kv_elem = 1 if kv_cache_dtype == "fp8" else elem
    t = max_num_batched_tokens
    # A layer's live tensors at the peak: residual + normed input + attention output + o-projection (4 x hidden),
    # the fused q/k/v rows, and the MLP's gate/up rows plus their product (3 x intermediate).
    per_token = 4 * cfg.hidden_size + cfg.q_size + 2 * cfg.kv_size + 3 * cfg.intermediate_size
    logits = (min(max_num_seqs, t) + PROMPT_LOGPROB_ROWS) * cfg.vocab_size * 4 * 2
    return WorkerNeeds(
        weights=weight_bytes(cfg, elem, quantization),
        activations=t * per_token * elem + logits,
        overhead=NON_TORCH_BYTES + CUDA_GRAPH_RESERVE,
        kv_per_token=2 * cfg.num_layers * cfg.kv_size * kv_elem,
        num_kv_heads=cfg.num_kv_heads,
    )


@dataclass(frozen=True)
class WorkerPlan:
    name: str
    device: str  # its GPUs, comma-separated (one per rank)
    share: float
    budget: int  # per rank: its share of the smallest of its GPUs
    need: int  # per rank: the neediest rank's (WorkerNeeds.per_rank)
    tp: int = 1
    rank_needs: WorkerNeeds | None = None

    @property
    def fits(self) -> bool:
        return self.need <= self.budget


@dataclass(frozen=True)
class GpuPlan:
    prefill: int
    decode: int
    max_model_len: int
    workers: tuple[WorkerPlan, ...]
    changes: tuple[str, ...]  # why the layout differs from the one asked for
    needs: WorkerNeeds

    @property
    def fits(self) -> bool:
        return all(w.fits for w in self.workers)

    def table(self) -> str:
        n = self.needs
        rows = [f"GPU plan: {self.decode} decode + {self.prefill} prefill worker(s), max_model_len {self.max_model_len}; "
                f"each needs weights {_gib(n.weights)} + activations {_gib(n.activations)} + runtime "
                f"{_gib(n.overhead)} + KV {_gib(n.kv_per_token * self.max_model_len)} "
                f"({n.kv_per_token // 1024} KiB/token)"]
        if any(w.tp > 1 for w in self.workers):
            rows.append("tensor-parallel workers: budget and needs are per rank (each rank on its own GPU; weights "
                        "and KV heads split, activations whole, NCCL estimated)")
        rows.append(f"{'worker':<12}{'GPU':>7}{'tp':>4}{'share':>7}{'budget':>12}{'needs':>12}  fits")
        for w in self.workers:
            rows.append(f"{w.name:<12}{w.device:>7}{w.tp:>4}{w.share:>7.2f}{_gib(w.budget):>12}{_gib(w.need):>12}  "
                        + ("yes" if w.fits else "NO"))
        rows += [f"changed: {c}" for c in self.changes]
        return "\n".join(rows)


def _gib(n: int) -> str:
    return f"{n / GIB:.2f} GiB"


class PlanError(ValueError):
    """No layout fits; the message says what each worker needs and what to change."""


def evaluate(opts: MeshOptions, gpu_bytes: dict[str, int], needs: WorkerNeeds, max_model_len: int,
             changes: tuple[str, ...] = (), only: frozenset[str] | None = None) -> GpuPlan:
    """The plan of opts' engine workers (only: those instance names, one model's of several)."""
    workers = []
    for name, p in placement(opts).items():
        if only is not None and name not in only:
            continue
        tp = opts.tp(name.split("-")[0])
        rank = needs.per_rank(tp)
        workers.append(WorkerPlan(name, p.device, p.gpu_memory_utilization,
                                  int(min(gpu_bytes[d] for d in p.devices) * p.gpu_memory_utilization),
                                  rank.total(max_model_len), tp, rank))
    workers = tuple(workers)
    return GpuPlan(opts.prefill, opts.decode, max_model_len, workers, changes, needs)


def _longest_that_fits(plan: GpuPlan, block_size: int) -> int:
    # A shortened context leaves HEADROOM of the budget unplanned: the estimate is not the worker's measured
    # profile, and a context cut to the last byte would turn a small underestimate into an exit 78 at start.
    def fits(w: WorkerPlan) -> int:
        n = w.rank_needs or plan.needs
        return max(int(w.budget * (1 - HEADROOM)) - n.fixed, 0) // n.kv_per_token

    tokens = min(fits(w) for w in plan.workers)
    step = max(block_size, 256)
    return tokens // step * step


def plan_mesh(opts: MeshOptions, gpu_bytes: dict[str, int], needs: WorkerNeeds, model_max_len: int,
              block_size: int = 16, layout_given: bool = False) -> GpuPlan:
    """The layout to start: the one asked for if it fits, else the closest that does (reasons in .changes), else
    PlanError. layout_given: --prefill/--decode were set by the user (keep them; only the context may shrink)."""
    missing = [d for d in opts.devices if d not in gpu_bytes]  # (a worker's ranks use only these)
    if missing:
        raise PlanError(f"no memory size for GPU(s) {', '.join(missing)}: give --gpu-memory SIZE (or DEVICE=SIZE)")
    max_len = opts.max_model_len or model_max_len
    asked = evaluate(opts, gpu_bytes, needs, max_len)
    if asked.fits:
        return asked
    layouts = [(opts.prefill, opts.decode)]
    if not layout_given:
        layouts += [(0, opts.decode), (0, min(opts.decode, len(opts.devices)))]
        for prefill, decode in dict.fromkeys(layouts[1:]):
            plan = evaluate(replace(opts, prefill=prefill, decode=decode), gpu_bytes, needs, max_len)
            if plan.fits:
                return replace(plan, changes=(
                    f"{asked.decode} decode + {asked.prefill} prefill worker(s) do not fit "
                    f"({_why(asked)}); running {decode} decode worker(s) that prefill locally, one copy of the "
                    "weights each",))
    smallest = evaluate(replace(opts, prefill=layouts[-1][0], decode=layouts[-1][1]), gpu_bytes, needs, max_len)
    tokens = min(_longest_that_fits(smallest, block_size), max_len)
    if tokens < MIN_MODEL_LEN:
        raise PlanError(f"the model does not fit: {_why(smallest)}; even {MIN_MODEL_LEN} tokens of context leave no "
                        "room. Use GPUs with more memory, --kv-cache-dtype fp8, a lower --max-num-batched-tokens, "
                        "or fewer workers per GPU\n" + smallest.table())
    plan = evaluate(replace(opts, prefill=smallest.prefill, decode=smallest.decode), gpu_bytes, needs, tokens)
    layout = ("" if (plan.prefill, plan.decode) == (asked.prefill, asked.decode) else
              f"{plan.decode} decode worker(s) that prefill locally instead of {asked.decode} decode + "
              f"{asked.prefill} prefill, and ")
    return replace(plan, changes=(
        f"{_why(asked)}: {layout}max_model_len {tokens} instead of {max_len} (the KV of one full-length "
        "request must fit each worker's share; --max-model-len sets it)",))


def model_workers(opts: MeshOptions) -> list[frozenset[str]]:
    """Each model's engine worker instance names, numbered as mesh_services numbers them (per role, model by
    model)."""
    out, seen = [], {"decode": 0, "prefill": 0}
    for m in opts.models:
        names = set()
        for role in seen:
            names |= {f"{role}-{seen[role] + i}" for i in range(getattr(m, role))}
            seen[role] += getattr(m, role)
        out.append(frozenset(names))
    return out


def plan_models(opts: MeshOptions, gpu_bytes: dict[str, int], needs: list[WorkerNeeds], model_max_lens: list[int],
                block_size: int = 16) -> list[GpuPlan]:
    """Several models on the GPUs (placement() spreads every model's workers together): per model, its
    workers' shares against its own needs. The layout is the one asked for (a model's workers are its own
    pool: none is dropped for another's sake); a model whose workers cannot hold its full context gets the
    longest that fits, and PlanError when not even MIN_MODEL_LEN does."""
    missing = [d for d in opts.devices if d not in gpu_bytes]
    if missing:
        raise PlanError(f"no memory size for GPU(s) {', '.join(missing)}: give --gpu-memory SIZE (or DEVICE=SIZE)")
    plans = []
    for m, names, need, model_len in zip(opts.models, model_workers(opts), needs, model_max_lens):
        max_len = m.max_model_len or model_len
        plan = evaluate(opts, gpu_bytes, need, max_len, only=names)
        plan = replace(plan, prefill=m.prefill, decode=m.decode)
        if not plan.fits:
            tokens = min(_longest_that_fits(plan, block_size), max_len)
            if tokens < MIN_MODEL_LEN:
                raise PlanError(f"model {m.name} does not fit: {_why(plan)}; even {MIN_MODEL_LEN} tokens of context "
                                "leave no room. Use fewer workers per GPU, GPUs with more memory or --kv-cache-dtype "
                                "fp8\n" + plan.table())
            plan = replace(evaluate(opts, gpu_bytes, need, tokens, only=names), prefill=m.prefill, decode=m.decode,
                           changes=(f"{m.name}: {_why(plan)}: max_model_len {tokens} instead of {max_len}",))
        plans.append(plan)
    return plans


def _why(plan: GpuPlan) -> str:
    bad = [w for w in plan.workers if not w.fits]
    w = min(bad, key=lambda w: w.budget) if bad else plan.workers[0]
    return (f"{w.name} has {_gib(w.budget)} ({w.share:.2f} of GPU {w.device}) and needs {_gib(w.need)} for "
            f"{plan.max_model_len} tokens of context")


_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(gib|gb|mib|mb|g|m)?\s*$", re.I)
_UNITS = {"gib": GIB, "g": GIB, "gb": 10**9, "mib": 1 << 20, "m": 1 << 20, "mb": 10**6, None: GIB}


def parse_gpu_memory(values: list[str], devices: tuple[str, ...]) -> dict[str, int]:
    """--gpu-memory SIZE (every device) or DEVICE=SIZE, repeatable; SIZE like 80GiB, 24GB, 81559MiB (GiB if bare)."""
    out: dict[str, int] = {}
    for value in values:
        dev, _, size = value.rpartition("=")
        m = _SIZE.match(size)
        if not m:
            raise PlanError(f"--gpu-memory {value!r}: a size like 80GiB, 24GB or 81559MiB (optionally DEVICE=SIZE)")
        n = int(float(m.group(1)) * _UNITS[(m.group(2) or "").lower() or None])
        for d in ([dev] if dev else devices):
            out[d] = n
    return out


def gpu_memory_from_nvidia_smi(devices: tuple[str, ...]) -> dict[str, int]:
    """Total memory of each visible GPU by its index, without importing torch ({} without nvidia-smi)."""
    smi = shutil.which("nvidia-smi")
    if smi is None or not devices:
        return {}
    try:
        out = subprocess.run([smi, "--query-gpu=index,memory.total", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=20, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return {}
    sizes = {}
    for line in out.splitlines():
        index, _, mib = line.partition(",")
        if index.strip() and mib.strip().isdigit():
            sizes[index.strip()] = int(mib.strip()) << 20
    return {d: sizes[d] for d in devices if d in sizes}
