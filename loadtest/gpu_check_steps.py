"""The steps of the GPU check (loadtest/gpu_check.py): each runs in a process of its own, appends every case it
finishes to DIR/<step>.jsonl at once (a step killed at any moment keeps what it measured) and returns its
result, which the driver writes to DIR/<step>.json."""
from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path

# Start-up lines of the engine that the summary reads (memory plan, graphs captured, tiles tuned, ready).
ENGINE_LOG_PREFIXES = ("memory", "captured", "engine ready", "prefill attention tiles", "CUDA graph")


class EngineLog(logging.Handler):
    """Keeps the engine's start-up lines (ENGINE_LOG_PREFIXES) of this process for the step's result."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        if record.name.startswith("shared.engine"):
            msg = record.getMessage()
            if msg.startswith(ENGINE_LOG_PREFIXES):
                self.lines.append(msg)

    def take(self) -> list[str]:
        lines, self.lines = self.lines, []
        return lines


ENGINE_LOG = EngineLog()


def configure_logging() -> None:
    """Every step process logs at INFO to its own log file (the driver sends stdout/stderr there)."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        stream=sys.stderr, force=True)
    logging.getLogger().addHandler(ENGINE_LOG)


def append_case(args, case: dict) -> None:
    """One finished case, appended to DIR/<step>.jsonl in one write (shards of a step append to the same file)."""
    line = json.dumps({"step": args.run_step, **case}, default=str) + "\n"
    with open(Path(args.out) / f"{args.run_step}.jsonl", "a") as f:
        f.write(line)


def read_cases(out: Path, step: str) -> list[dict]:
    path = out / f"{step}.jsonl"
    if not path.exists():
        return []
    cases = []
    for line in path.read_text().splitlines():
        try:
            cases.append(json.loads(line))
        except json.JSONDecodeError:  # a line cut by a kill
            continue
    return cases


def _bench(args, argv: list[str], out: Path) -> dict:
    """Run a `kvmesh bench ...` command in this process; its JSON result (appended as the step's one case)."""
    from loadtest.cli import main

    t0 = time.perf_counter()
    rc = main(["bench", *argv, "--json", str(out)])
    result = json.loads(out.read_text()) if out.exists() else {}
    run = {"ok": rc == 0 and bool(result), "command": "kvmesh bench " + " ".join(argv),
           "seconds": round(time.perf_counter() - t0, 1), "result": result}
    append_case(args, {"case": run["command"], **run})
    return run


def kill_tree(procs: list[subprocess.Popen]) -> None:
    """Kill child processes still alive (a failed step must not leave engines holding GPU memory)."""
    for p in procs:
        if p.poll() is None:
            try:
                p.send_signal(signal.SIGKILL)
            except ProcessLookupError:
                pass
    for p in procs:
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass


# --------------------------------------------------------------------------------------------- steps


def step_env(args) -> dict:
    import torch

    info = {"ok": True, "torch": torch.__version__, "python": sys.version.split()[0], "device": args.device,
            "cpus": os.cpu_count()}
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:
        info["triton"] = None
        info["ok"] = args.device == "cpu"
    import transformers

    info["transformers"] = transformers.__version__
    if args.device.startswith("cuda"):
        if not torch.cuda.is_available():
            return {"ok": False, "error": "torch sees no CUDA device"}
        props = torch.cuda.get_device_properties(0)
        info.update(gpu=props.name, gpus=torch.cuda.device_count(), capability=list(torch.cuda.get_device_capability()),
                    total_memory=props.total_memory, cuda=torch.version.cuda, free_memory=torch.cuda.mem_get_info()[0],
                    multiprocessors=props.multi_processor_count)
    append_case(args, {"case": "env", **info})
    return info


def _fp8_ok(device: str) -> bool:
    import torch

    return device == "cpu" or tuple(torch.cuda.get_device_capability()) >= (8, 9)


def kernel_shards(device: str) -> int:
    """Processes the kernels step splits its cases over: Triton compiles on the host, one variant at a time per
    process (16 cores on the GPU machine; 2 here, where the interpreter runs them)."""
    return max(1, min(8, (os.cpu_count() or 2) // 2)) if device.startswith("cuda") else 2


def step_kernels(args) -> dict:
    """Each kernel's Triton version against its torch twin on the device (loadtest/gpu_kernel_cases.py), the cases
    split over parallel processes, then the warm-up's prefill tile tuning against SDPA (GPU only)."""
    from loadtest.gpu_kernel_cases import kernel_cases, measure

    fp8 = _fp8_ok(args.device)
    if args.shard:  # one shard: run its cases, append each
        i, n = (int(x) for x in args.shard.split("/"))
        for case in kernel_cases(args.device, args.smoke, fp8)[i::n]:
            try:
                append_case(args, measure(case, args.device))
            except Exception as e:  # noqa: BLE001 - one case's crash is that case's result
                append_case(args, {"kernel": case.kernel, "dtype": case.dtype, "kv": case.kv, "case": case.name,
                                   "ok": False, "error": f"{type(e).__name__}: {e}"})
        return {"ok": True}
    n = kernel_shards(args.device)
    total = len(kernel_cases(args.device, args.smoke, fp8))
    t0 = time.perf_counter()
    cmd = [sys.executable, "-m", "loadtest.gpu_check", "--run-step", "kernels", "--device", args.device,
           "--out", args.out] + (["--smoke"] if args.smoke else [])
    procs = [subprocess.Popen(cmd + ["--shard", f"{i}/{n}"]) for i in range(n)]
    try:
        rcs = [p.wait() for p in procs]
    finally:
        kill_tree(procs)
    cases = [c for c in read_cases(Path(args.out), "kernels") if "kernel" in c]
    failed = [c for c in cases if not c["ok"]]
    result = {"ok": not failed and len(cases) == total and rcs == [0] * n, "cases_run": len(cases),
              "cases_planned": total, "shards": n, "seconds": round(time.perf_counter() - t0, 1),
              "failed": failed, "fp8_tested": fp8, "by_kernel": kernel_table(cases),
              "variants_compiled": compiled_variants(),
              "summary": f"{len(cases) - len(failed)}/{total} kernel cases agree with their twins ({n} processes)"}
    if args.device.startswith("cuda"):
        try:
            result["prefill_tiles"] = _prefill_tiles(args.device)
            append_case(args, {"case": "prefill tiles vs SDPA", **result["prefill_tiles"]})
        except Exception as e:  # noqa: BLE001 - the kernel cases stand on their own
            result["prefill_tiles"] = {"error": f"{type(e).__name__}: {e}"}
    return result


def kernel_table(cases: list[dict]) -> dict:
    """Per kernel and KV dtype: cases, the largest error against the tolerance, and the compile seconds summed."""
    table: dict[str, dict] = {}
    for c in cases:
        row = table.setdefault(f"{c['kernel']} {c['dtype']}/{c['kv']}", {"cases": 0, "failed": 0, "max_rel_err": 0.0,
                                                                         "compile_s": 0.0})
        row["cases"] += 1
        row["failed"] += not c["ok"]
        row["max_rel_err"] = max(row["max_rel_err"], c.get("max_rel_err") or 0.0)
        row["compile_s"] = round(row["compile_s"] + c.get("compile_s", 0.0), 3)
    return table


def compiled_variants() -> dict | str:
    """Kernel variants compiled in this run, by kernel: the cubins in the run's Triton cache."""
    cache = os.environ.get("TRITON_CACHE_DIR")
    if os.environ.get("TRITON_INTERPRET") == "1":
        return "none: Triton's interpreter"
    if not cache or not Path(cache).is_dir():
        return "unknown: no TRITON_CACHE_DIR"
    counts: dict[str, int] = {}
    for f in Path(cache).rglob("*.cubin"):
        counts[f.stem] = counts.get(f.stem, 0) + 1
    return dict(sorted(counts.items()))


def _prefill_tiles(dev: str) -> dict:
    """The warm-up's tile tuning for prefill attention at Qwen3-0.6B's and SmolLM2's heads (4 prompts of 512
    tokens, bf16), against torch's scaled_dot_product_attention (FlashAttention on an H100) on the same
    tokens laid out contiguously, which a paged kernel cannot beat by much: the ratio is the figure."""
    import torch
    import torch.nn.functional as F

    from kernels.extend_attention import median_ms, tune_extend_tiles

    out = {}
    for name, hq, hk, d in (("qwen3-0.6b", 16, 8, 128), ("smollm2-135m", 9, 3, 64)):
        q = torch.empty(1, hq, d, device=dev, dtype=torch.bfloat16)
        kc = torch.empty(1, 16, hk, d, device=dev, dtype=torch.bfloat16)
        tuned = tune_extend_tiles(q, kc)
        qs = torch.randn(4, hq, 512, d, device=dev, dtype=torch.bfloat16)
        ks = torch.randn(4, hk, 512, d, device=dev, dtype=torch.bfloat16)
        vs = torch.randn_like(ks)
        def sdpa_launch() -> None:
            F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, enable_gqa=True)
        sdpa_launch()  # warm-up
        torch.cuda.synchronize()
        sdpa = median_ms(sdpa_launch, qs.device, reps=5)
        best = min(tuned["ms"].values())
        out[name] = {**tuned, "sdpa_ms": round(sdpa, 4), "paged_vs_sdpa": round(best / sdpa, 2)}
    return out


def step_greedy(args) -> dict:
    """Engine vs transformers generate(), greedy, on the device: the real SmolLM2 first (bf16 on CUDA), then the
    four architectures in float32 (the exactness oracle's precision)."""
    import torch

    from shared.config import EngineConfig
    from shared.engine.llm_engine import LLMEngine
    from shared.sampling_params import SamplingParams
    from tests.checkpoints import ARCHS, VOCAB, build_checkpoint

    dev = args.device
    results = {"smollm2": _greedy_smollm2(args, prompts_n=4)}
    append_case(args, {"case": "smollm2", **results["smollm2"]})
    ok = results["smollm2"].get("ok", True)
    g = torch.Generator().manual_seed(1)
    lengths = [3, 17, 40, 64] if args.smoke else [3, 17, 40, 64, 100, 150]
    prompts = [torch.randint(0, VOCAB - 1, (n,), generator=g).tolist() for n in lengths]
    max_tokens = 8 if args.smoke else 24
    with tempfile.TemporaryDirectory() as tmp:
        for arch in ARCHS:
            ckpt = build_checkpoint(arch, Path(tmp) / arch)
            engine = LLMEngine(EngineConfig(model=str(ckpt.path), dtype="float32", device=dev, num_kv_blocks=256,
                                            max_num_seqs=16, max_num_batched_tokens=128))
            ours = engine.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0.0), use_tqdm=False)
            hf = ckpt.hf_model.to(dev)
            same = same_as_transformers(hf, prompts, ours, max_tokens, dev)
            results[arch] = {"prompts": len(prompts), "identical": sum(same), "dtype": "float32", "ok": all(same)}
            append_case(args, {"case": arch, **results[arch]})
            ok &= all(same)
            del engine, hf
    return {"ok": ok, "archs": results, "max_tokens": max_tokens,
            "summary": ", ".join(f"{a} {r['identical']}/{r['prompts']}" if "identical" in r else f"{a} skipped"
                                 for a, r in results.items())}


def same_as_transformers(hf, prompts: list[list[int]], ours: list, max_tokens: int, dev: str) -> list[bool]:
    """Per prompt: whether the engine's greedy tokens equal transformers' generate() on the same prompt."""
    import torch

    same = []
    for p, o in zip(prompts, ours):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([p], device=dev), max_new_tokens=max_tokens, do_sample=False)
        same.append(ref[0, len(p):].tolist() == o.output_token_ids)
    return same


def _greedy_smollm2(args, prompts_n: int) -> dict:
    """The real SmolLM2 checkpoint, bf16 on CUDA (float32 on CPU): identical greedy text for real prompts. A GGUF
    goes through kvmesh's own conversion (the directory `kvmesh up --model FILE.gguf` serves), and transformers
    loads that same directory: both run the same weights."""
    path = args.smollm2
    if not path or not Path(path).exists():
        return {"skipped": "no real SmolLM2 model: pass --smollm2 PATH (an HF checkpoint directory or a .gguf) "
                           "or set KVMESH_SMOLLM2" + (f" ({args.smollm2_missing})" if args.smollm2_missing else "")}
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from shared.config import EngineConfig
    from shared.engine.llm_engine import LLMEngine
    from shared.models.model_source import resolve_model
    from shared.sampling_params import SamplingParams

    dev = args.device
    dtype = "bfloat16" if dev.startswith("cuda") else "float32"
    t0 = time.perf_counter()
    model_dir = resolve_model(path)
    convert_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    engine = LLMEngine(EngineConfig(model=model_dir, dtype=dtype, device=dev, max_num_seqs=8,
                                    **({"gpu_memory_utilization": 0.3} if dev.startswith("cuda") else
                                       {"num_kv_blocks": 512})))
    ready_s = time.perf_counter() - t0
    tok = AutoTokenizer.from_pretrained(model_dir)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).to(dev).eval()
    texts = ["The capital of France is", "def fibonacci(n):", "Once upon a time,", "1, 2, 3, 4,"][:prompts_n]
    prompts = [tok(t)["input_ids"] for t in texts]
    ours = engine.generate(prompts, SamplingParams(max_tokens=32, temperature=0.0), use_tqdm=False)
    same = same_as_transformers(hf, prompts, ours, 32, dev)
    texts_out = [tok.decode(o.output_token_ids) for o in ours]
    # In bf16 a near-tie may resolve differently in two correct implementations: report, require most.
    return {"ok": sum(same) >= len(same) - 1 if dtype == "bfloat16" else all(same), "identical": sum(same),
            "prompts": len(same), "dtype": dtype, "model": path, "convert_s": round(convert_s, 2),
            "time_to_ready_s": round(ready_s, 2), "texts": texts_out, "engine_log": ENGINE_LOG.take()}


def _graph_pool_mib(pool) -> float | None:
    """MiB of the segments torch's allocator holds for one graph memory pool (the captured graphs' memory)."""
    import torch

    try:
        segs = torch.cuda.memory_snapshot()
        return round(sum(s["total_size"] for s in segs if tuple(s.get("segment_pool_id", ())) == tuple(pool))
                     / 2**20, 1)
    except Exception:  # noqa: BLE001 - an allocator without pool ids in its snapshot
        return None


# Logprob gap (nats) under which two correct bf16 runs may pick either of the two best tokens.
NEAR_TIE = 0.1


def generate_with_logprobs(engine, prompts: list[list[int]], params) -> list[tuple[list[int], list]]:
    """Each prompt's (output token ids, per-token TokenLogprobs), stepping the engine directly (the offline
    generate() keeps only the last step's logprobs)."""
    ids = [f"lp-{time.monotonic_ns()}-{i}" for i in range(len(prompts))]
    for rid, prompt in zip(ids, prompts):
        engine.add_request(rid, prompt, params)
    tokens: dict[str, list[int]] = {rid: [] for rid in ids}
    lps: dict[str, list] = {rid: [] for rid in ids}
    while engine.has_unfinished_requests():
        for out in engine.step():
            lp = out.logprobs or []
            if out.finished:  # the whole request: its tokens, and its logprobs whole or the last step's
                tokens[out.request_id] = list(out.output_token_ids)
                lps[out.request_id] = lp if len(lp) == len(out.output_token_ids) else lps[out.request_id] + lp
            else:
                lps[out.request_id] += lp
    return [(tokens[rid], lps[rid]) for rid in ids]


def divergence_margins(reference: list[tuple[list[int], list]], other: list[tuple[list[int], list]]) -> list[float]:
    """For each pair of runs that part: how much likelier the reference's token was than the other's at the
    first token where they differ (inf when the other's token is not in the reference's top list)."""
    margins = []
    for (ref_ids, ref_lps), (ids, _) in zip(reference, other):
        i = next((k for k, (a, b) in enumerate(zip(ref_ids, ids)) if a != b), None)
        if i is None:
            continue
        top = dict(ref_lps[i].top) if i < len(ref_lps) else {}
        margins.append(ref_lps[i].logprob - top[ids[i]] if ids[i] in top else float("inf"))
    return margins


def step_graphs(args) -> dict:
    """Greedy tokens with CUDA graphs equal the eager engine's, at batch sizes that pad into buckets; the graphs'
    buckets and their pool's size against the memory plan's reserve."""
    import torch

    from shared.config import EngineConfig
    from shared.engine.kv_pool_size import graph_reserve
    from shared.engine.llm_engine import LLMEngine
    from shared.sampling_params import SamplingParams
    from tests.checkpoints import VOCAB, build_checkpoint

    dev = args.device
    cuda = dev.startswith("cuda")
    g = torch.Generator().manual_seed(2)
    results, ok, capture = {}, True, {}
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = build_checkpoint("qwen3", Path(tmp) / "qwen3")
        for dtype in (["float32"] if args.smoke else ["float32", "bfloat16"]):
            engines = {}
            for eager in (True, False):
                c = EngineConfig(model=str(ckpt.path), dtype=dtype, device=dev, num_kv_blocks=512, max_num_seqs=64,
                                 max_num_batched_tokens=256, enforce_eager=eager)
                t0 = time.perf_counter()
                engine = LLMEngine(c)
                if not eager and engine.runner.graphs is None:  # CPU: the same static path, not captured
                    engine.runner.use_decode_graphs(engine.max_model_len, 64, capture=False)
                elif not eager:
                    graphs = engine.runner.graphs
                    reserve = graph_reserve(c, engine.runner, engine.max_model_len, None)
                    capture[dtype] = {"buckets": graphs.buckets, "ready_s": round(time.perf_counter() - t0, 2),
                                      "pool_mib": _graph_pool_mib(graphs.pool) if cuda else None,
                                      "reserve_estimate_mib": round(reserve / 2**20, 1),
                                      "engine_log": ENGINE_LOG.take()}
                    append_case(args, {"case": f"capture {dtype}", **capture[dtype]})
                engines[eager] = engine
            for batch in ([1, 5] if args.smoke else [1, 5, 40]):
                prompts = [torch.randint(0, VOCAB - 1, (int(n),), generator=g).tolist()
                           for n in torch.randint(3, 60, (batch,), generator=g)]
                params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=2)
                runs = {eager: generate_with_logprobs(e, prompts, params) for eager, e in engines.items()}
                same = sum(a[0] == b[0] for a, b in zip(runs[True], runs[False]))
                # A graph replays GEMMs at the padded bucket's size, eager at the batch's: cuBLAS may pick other
                # kernels, so bits can differ. In float32 no greedy token may; in bf16 a sequence may part only
                # where the eager run's two best tokens were a near-tie.
                margins = divergence_margins(runs[True], runs[False])
                run_ok = same == batch if dtype == "float32" else all(m < NEAR_TIE for m in margins)
                results[f"{dtype} batch {batch}"] = {"identical": same, "of": batch, "ok": run_ok,
                                                     "divergence_margins": [round(m, 4) for m in margins]}
                append_case(args, {"case": f"{dtype} batch {batch}", **results[f"{dtype} batch {batch}"]})
                ok &= run_ok
            del engines
    return {"ok": ok, "runs": results, "capture": capture,
            "summary": ", ".join(f"{k} {r['identical']}/{r['of']}" for k, r in results.items())}


def step_two_workers(args) -> dict:
    """Two engine processes on one GPU, each --gpu-memory-utilization 0.4: the second starts while the first
    holds its memory, both serve at once; each reports its plan and its peak against its budget."""
    out = Path(args.out)
    with tempfile.TemporaryDirectory() as tmp:
        model = _shape_dir(Path(tmp), "smollm2-135m" if args.smoke else "qwen3-0.6b", args.smoke)
        procs, files = [], []
        try:
            for i in range(2):
                status = out / f"two-workers-{i}.json"
                status.unlink(missing_ok=True)
                ready = Path(tmp) / f"ready-{i}"
                cmd = [sys.executable, "-m", "loadtest.gpu_check", "--device", args.device, "--out", args.out,
                       "--worker", json.dumps({"model": model, "status": str(status), "ready": str(ready),
                                               "go": str(Path(tmp) / "go"), "smoke": args.smoke})]
                procs.append(subprocess.Popen(cmd))
                files.append(status)
                deadline = time.time() + 100
                while not ready.exists() and procs[-1].poll() is None and time.time() < deadline:
                    time.sleep(0.2)  # the next one starts once this one holds its memory
            (Path(tmp) / "go").touch()
            rcs = [p.wait(timeout=120) for p in procs]
        finally:  # one worker that failed or hangs must not leave the other holding its share of the GPU
            kill_tree(procs)
    workers = [json.loads(f.read_text()) if f.exists() else {"ok": False, "error": "no status written"} for f in files]
    for i, w in enumerate(workers):
        append_case(args, {"case": f"worker {i}", **w})
    return {"ok": rcs == [0, 0] and all(w.get("ok") for w in workers), "exit_codes": rcs, "workers": workers,
            "summary": "; ".join(f"worker {i}: " + (f"peak reserved {w['peak_reserved'] / 2**30:.2f} of "
                                                   f"{w['budget'] / 2**30:.2f} GiB" if "budget" in w else
                                                   w.get("error", "ok")[:100]) for i, w in enumerate(workers))}


def _shape_dir(root: Path, name: str, smoke: bool) -> str:
    from dataclasses import replace

    from loadtest.shapes import SHAPES, build_shape_checkpoint

    shape = SHAPES[name]
    if smoke:
        shape = replace(shape, config=dict(shape.config, num_hidden_layers=2, vocab_size=1024, bos_token_id=0,
                                           eos_token_id=1))
    return build_shape_checkpoint(str(root / name), replace(shape, write_weights=False))


def run_worker(args) -> int:
    import torch

    from shared.config import EngineConfig
    from shared.engine.kv_cache import bytes_per_block
    from shared.engine.llm_engine import LLMEngine
    from shared.sampling_params import SamplingParams

    spec = json.loads(args.worker)
    status = {"ok": False, "pid": os.getpid()}
    try:
        cuda = args.device.startswith("cuda")
        util = 0.4
        cfg = dict(model=spec["model"], load_format="dummy", device=args.device, max_num_seqs=64,
                   max_num_batched_tokens=2048, gpu_memory_utilization=util)
        if not cuda:
            cfg.update(kv_cache_bytes=32 << 20, dtype="float32", max_model_len=512)
        t0 = time.perf_counter()
        engine = LLMEngine(EngineConfig(**cfg))
        status["time_to_ready_s"] = round(time.perf_counter() - t0, 2)
        status["engine_log"] = ENGINE_LOG.take()
        kv_bytes = engine.num_blocks * bytes_per_block(engine.model_config, engine.config.block_size, engine.kv_dtype)
        Path(spec["ready"]).touch()
        deadline = time.time() + 100
        while not Path(spec["go"]).exists() and time.time() < deadline:
            time.sleep(0.1)
        g = torch.Generator().manual_seed(os.getpid())
        vocab = engine.model_config.vocab_size
        n, plen, olen = (4, 16, 8) if spec["smoke"] else (64, 512, 128)
        prompts = [torch.randint(2, vocab, (plen,), generator=g).tolist() for _ in range(n)]
        outs = engine.generate(prompts, SamplingParams(max_tokens=olen, temperature=0.0, ignore_eos=True),
                               use_tqdm=False)
        status.update(num_blocks=engine.num_blocks, kv_bytes=kv_bytes,
                      tokens=sum(len(o.output_token_ids) for o in outs), expected_tokens=n * olen)
        status["ok"] = status["tokens"] == status["expected_tokens"]
        if cuda:
            total = torch.cuda.get_device_properties(0).total_memory
            reserved = torch.cuda.max_memory_reserved()
            status.update(budget=int(total * util), peak_reserved=reserved, within_budget=reserved <= total * util,
                          peak_allocated=torch.cuda.max_memory_allocated(), spare=int(total * util) - reserved)
            status["ok"] &= status["within_budget"]
    except Exception as e:  # noqa: BLE001 - the status file says what happened (an OOM included)
        status["error"] = f"{type(e).__name__}: {e}"
        status["traceback"] = traceback.format_exc()[-3000:]
    Path(spec["status"]).write_text(json.dumps(status, indent=2))
    return 0 if status["ok"] else 1


def step_decode(args) -> dict:
    out = Path(args.out) / "decode-bench.json"
    if args.smoke:
        argv = ["decode", "--shape", "bench", "--device", args.device, "--batch-sizes", "1,2", "--context-len", "32",
                "--steps", "2", "--attn-batch", "2", "--attn-context", "64"]
    else:
        argv = ["decode", "--shape", "qwen3-0.6b", "--device", args.device]
    return _bench(args, argv, out)


def step_offline(args) -> dict:
    """nano-vllm's workload through kvmesh, then transformers' static batches of 128 on the same random weights
    (its fastest here; the other two baselines take minutes): two runs, so kvmesh's figure is kept when the
    baseline is cut."""
    common = (["offline", "--device", args.device, "--num-prompts", "4", "--input-len-min", "8", "--input-len-max",
               "16", "--output-len-min", "4", "--output-len-max", "8"] if args.smoke else
              ["offline", "--preset", "nano-vllm", "--device", args.device])
    ours = _bench(args, common + ["--skip-hf"], Path(args.out) / "offline-kvmesh.json")
    hf = _bench(args, common + ["--skip-kvmesh", "--baselines", "batched"], Path(args.out) / "offline-hf.json")
    kv, base = ours["result"].get("kvmesh_tok_s"), hf["result"].get("hf_batched_tok_s")
    ratio = kv / base if kv and base else None
    return {"ok": ours["ok"] and hf["ok"], "kvmesh_tok_s": kv, "hf_batched_tok_s": base, "ratio_vs_hf_batched": ratio,
            "result": {**ours["result"], "hf_batched_tok_s": base, "ratio_vs_hf_batched": ratio},
            "summary": f"kvmesh {kv or 0:.0f} tok/s, transformers batched {base or 0:.0f} tok/s"
                       + (f" ({ratio:.2f}x)" if ratio else "")}


def step_kv_transfer(args) -> dict:
    out = Path(args.out) / "kv-transfer-bench.json"
    argv = ["kv-transfer", "--shape", "bench" if args.smoke else "qwen3-0.6b"]
    if args.smoke:
        argv += ["--prompt-len", "64", "--repeats", "1"]
    return _bench(args, argv, out)


def step_tiers(args) -> dict:
    out = Path(args.out) / "tiers-bench.json"
    argv = ["tiers", "--shape", "bench" if args.smoke else "qwen3-0.6b", "--device", args.device]
    if args.smoke:
        argv += ["--prompt-len", "64", "--repeats", "1", "--prefixes", "2", "--uses", "2", "--prefix-len", "32",
                 "--output-len", "2", "--pool-blocks", "40"]
    return _bench(args, argv, out)


def step_tp(args) -> dict:
    if args.smoke:
        argv = ["offline", "--device", args.device, "--tensor-parallel-size", "2", "--num-prompts", "4",
                "--input-len-min", "8", "--input-len-max", "16", "--output-len-min", "4", "--output-len-max", "8",
                "--skip-hf"]
        return _bench(args, argv, Path(args.out) / "tp-offline.json")
    import torch

    gpus = torch.cuda.device_count()
    degree = max((n for n in (2, 4, 8) if n <= gpus), default=0)
    if degree == 0:
        return {"ok": True, "skipped": f"{gpus} GPU(s): tensor parallelism needs at least two"}
    runs = {}
    for shape in ["llama-3.1-8b"] + (["llama-3.1-70b"] if degree == 8 else []):
        argv = ["offline", "--shape", shape, "--device", "cuda", "--tensor-parallel-size", str(degree),
                "--skip-hf"]
        runs[shape] = _bench(args, argv, Path(args.out) / f"tp-offline-{shape}.json")
    return {"ok": all(r["ok"] for r in runs.values()), "degree": degree, "runs": runs}


def step_spec(args) -> dict:
    from dataclasses import replace

    from loadtest.draft_checkpoint import truncated_checkpoint
    from loadtest.shapes import SHAPES, build_shape_checkpoint

    cuda = args.device.startswith("cuda")
    shape = SHAPES["qwen3-0.6b"]
    if args.smoke:
        shape = replace(shape, config=dict(shape.config, num_hidden_layers=2, vocab_size=1024, hidden_size=256,
                                           intermediate_size=512, num_attention_heads=4, num_key_value_heads=2,
                                           head_dim=64, bos_token_id=0, eos_token_id=1))
    with tempfile.TemporaryDirectory() as tmp:
        model = build_shape_checkpoint(str(Path(tmp) / "qwen3"), replace(shape, write_weights=True))
        draft = truncated_checkpoint(model, Path(tmp) / "qwen3-draft", 1 if args.smoke else 4)
        # First, in a fresh process: the budgeted engine (the bench's engines share the process: fixed KV bytes).
        budget = _spec_budget(model, str(draft), args.device) if cuda else {
            "ok": True, "skipped": "no GPU memory budget on the CPU"}
        append_case(args, {"case": "draft engine under --gpu-memory-utilization 0.5", **budget})
        argv = ["spec", "--model", model, "--device", args.device, "--synthetic-prompts",
                "--methods", "off,ngram,suffix,draft_model", "--draft-model", str(draft)]
        if args.smoke:
            argv += ["--concurrency", "1,2", "--requests", "2", "--max-tokens", "12", "--padded-verify"]
        else:
            argv += ["--concurrency", "1,4", "--max-tokens", "64", "--max-model-len", "4096"]
        # Exactness in float32 (a verify step's GEMMs have other shapes than a decode step's: in bf16 a near-tie of
        # random weights resolves either way), then the speed in bf16 on a GPU.
        run = _bench(args, argv + ["--dtype", "float32"], Path(args.out) / "spec-bench.json")
        speed = _bench(args, argv + ["--dtype", "bfloat16"], Path(args.out) / "spec-bench-bf16.json") if cuda else None
    verdict = spec_verdict(run.get("result", {}), cuda)
    if speed is not None:
        bf16 = spec_verdict(speed.get("result", {}), cuda)
        verdict["bf16"] = {"identical_to_off": bf16["identical_to_off"], "verify_steps": bf16["verify_steps"],
                           "ok": speed["ok"]}
        verdict["ok"] &= speed["ok"]
    return {**run, **verdict, "ok": verdict["ok"] and budget["ok"], "budgeted_draft_engine": budget}


def _spec_budget(model: str, draft: str, device: str) -> dict:
    """A draft_model engine under --gpu-memory-utilization 0.5 (its memory profile runs the draft's largest forward
    too, the graph reserve counts the verify and draft graphs): 8 requests of 512 prompt tokens (the draft catches
    up in chunks of max_num_batched_tokens) and 32 greedy tokens each stay within the budget."""
    import gc

    import torch

    from shared.config import EngineConfig
    from shared.engine.llm_engine import LLMEngine
    from shared.sampling_params import SamplingParams
    from shared.spec_config import SpeculativeConfig

    util = 0.5
    spec = SpeculativeConfig(method="draft_model", model=draft, num_speculative_tokens=4)
    t0 = time.perf_counter()
    engine = LLMEngine(EngineConfig(model=model, device=device, dtype="bfloat16", speculative_config=spec,
                                    gpu_memory_utilization=util, max_num_seqs=64, max_model_len=8192))
    ready_s = time.perf_counter() - t0
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(10, engine.model_config.vocab_size, (512,), generator=g).tolist() for _ in range(8)]
    outs = engine.generate(prompts, SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True), use_tqdm=False)
    total = torch.cuda.get_device_properties(torch.device(device)).total_memory
    reserved = torch.cuda.max_memory_reserved(torch.device(device))
    result = {"num_blocks": engine.num_blocks, "budget": int(total * util), "peak_reserved": reserved,
              "spare": int(total * util) - reserved, "time_to_ready_s": round(ready_s, 2),
              "tokens": sum(len(o.output_token_ids) for o in outs), "expected_tokens": 8 * 32,
              "verify_steps": dict(engine.runner.verify_stats.__dict__),
              "draft_decode_graphs": len(getattr(engine.speculator.proposer.draft.runner.graphs, "graphs", {}))}
    result["ok"] = result["tokens"] == result["expected_tokens"] and reserved <= total * util
    result["engine_log"] = ENGINE_LOG.take()
    del engine, outs
    gc.collect()
    torch.cuda.empty_cache()
    return result


def spec_verdict(report: dict, cuda: bool) -> dict:
    """Greedy outputs against off's (all in float32; in bf16 a near-tie of random weights may resolve otherwise
    between a verify and a decode step: 90%), and verify steps by path (replays required on CUDA)."""
    same = total = 0
    steps = {"replays": 0, "padded_eager": 0, "eager": 0}
    for cells in report.get("results", {}).values():
        for by_method in cells.values():
            for method, cell in by_method.items():
                if method == "off":
                    continue
                a, b = (int(x) for x in cell["identical_to_off"].split("/"))
                same, total = same + a, total + b
                for k in steps:
                    steps[k] += cell["verify_steps"][k]
    exact = same == total if report.get("dtype") == "float32" else same >= 0.9 * total
    used = steps["replays"] > 0 if cuda else steps["padded_eager"] > 0
    note = ("random weights: acceptance says nothing of trained models (a random model repeats itself, which "
            "ngram, suffix and a draft cut from it predict); the draft_model row measures the cost of drafting")
    summary = (f"greedy identical to off {same}/{total}; verify steps: {steps['replays']} graph replays, "
               f"{steps['padded_eager']} padded eager, {steps['eager']} eager")
    return {"ok": bool(report) and total > 0 and exact and used, "identical_to_off": f"{same}/{total}",
            "verify_steps": steps, "verify_graphs_used": steps["replays"] > 0, "summary": summary, "note": note}


def step_quant(args) -> dict:
    from loadtest.gpu_check_quant import step_quant as run

    return run(args, _bench, _fp8_ok(args.device))


STEP_FUNCTIONS: dict[str, Callable] = {
    "env": step_env, "kernels": step_kernels, "greedy": step_greedy, "graphs": step_graphs,
    "two-workers": step_two_workers, "decode": step_decode, "offline": step_offline,
    "kv-transfer": step_kv_transfer, "tiers": step_tiers, "tp": step_tp, "spec": step_spec, "quant": step_quant,
}
