"""KV transfer between two namespaced hosts (tests/netns_hosts.py), for docs/benchmarks.md:

    python -m tests.netns_bench --json loadtest/results/multihost_kv_cpu.json

A receiver (a DirectServer, as a decode worker runs it) on host c, a sender (DirectSender) on host b: the KV of a
4096-token prompt of SmolLM2-135M's shape (30 layers, 3 KV heads of 64, bf16: 94 MB), pushed whole as a prefill
worker pushes it, over the hosts' own addresses, so inline over TCP (shared memory is offered only to this
host's own addresses). Links unshaped and shaped with tbf (10 Gbit/s and 1 Gbit/s, a queue of at most the given
latency); this machine's kernel has no netem, so no fixed delay is added.
Root only; the namespaces are removed on exit.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import secrets
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from shared.kv_blocks import KVBlocks
from shared.kv_transport.direct import DirectSender, DirectSettings
from tests.netns_hosts import NetnsHosts

SHAPE = (30, 256, 16, 3, 64)  # layers, blocks of 16 tokens (4096 tokens), block size, KV heads, head dim
LINKS = {"unshaped": None, "tbf 10gbit": ("10gbit", "5ms", "4mb"), "tbf 1gbit": ("1gbit", "20ms", "1mb")}


async def _send(address: str, port: int, token: bytes, repeats: int) -> list[float]:
    g = torch.Generator().manual_seed(0)
    k = torch.randn(SHAPE, generator=g).to(torch.bfloat16)
    v = torch.randn(SHAPE, generator=g).to(torch.bfloat16)
    sender = DirectSender(DirectSettings())
    endpoint = f"tcp://{address}:{port}"
    try:
        seconds = []
        for i in range(repeats + 1):
            t0 = time.perf_counter()
            await sender.send(endpoint, token, f"t{i}", KVBlocks(k, v), 600)
            seconds.append(time.perf_counter() - t0)
        assert not sender.uses_shared_memory(endpoint), "shared memory between hosts"
        return seconds[1:]
    finally:
        await sender.close()


def sender_main(argv: list[str]) -> None:
    address, port, token, repeats = argv[0], int(argv[1]), bytes.fromhex(argv[2]), int(argv[3])
    torch.set_num_threads(1)
    print(json.dumps(asyncio.run(_send(address, port, token, repeats))), flush=True)


def measure(repeats: int) -> dict:
    nbytes = 2 * torch.Size(SHAPE).numel() * 2
    out: dict = {"bytes": nbytes, "tokens": SHAPE[1] * SHAPE[2], "shape": list(SHAPE), "dtype": "bfloat16",
                 "links": {}}
    with NetnsHosts(2) as hosts:
        b, c = hosts["a"], hosts["b"]
        for name, shaping in LINKS.items():
            if shaping:
                rate, latency, burst = shaping
                b.shape(rate, latency, burst)
                c.shape(rate, latency, burst)
            token = secrets.token_bytes(16)
            shape = ",".join(map(str, SHAPE))
            recv = c.popen([sys.executable, "-m", "tests.netns_bench_receiver", c.address, shape,
                            str(repeats + 1), token.hex()], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
            port = int(recv.stdout.readline().split()[1])
            sent = subprocess.run(b.argv(sys.executable, "-m", "tests.netns_bench", "--send", c.address, str(port),
                                         token.hex(), str(repeats)), capture_output=True, text=True, timeout=900)
            recv.stdin.close()
            recv.wait(timeout=60)
            if sent.returncode != 0:
                raise RuntimeError(sent.stderr[-2000:])
            seconds = json.loads(sent.stdout.strip().splitlines()[-1])
            med = statistics.median(seconds)
            out["links"][name] = {"seconds": seconds, "median_seconds": med, "gb_per_s": nbytes / med / 1e9}
            print(f"{name}: {nbytes / 1e6:.0f} MB in {med * 1e3:.0f} ms = {nbytes / med / 1e9:.2f} GB/s", flush=True)
    return out


def measure_ttft(repeats: int, workdir: Path, tokens: int = 4096) -> dict:
    """TTFT of a fresh `tokens`-token prompt (max_tokens 1) on SmolLM2-135M through a three-host mesh: prefilled on
    host b and its KV pushed to the decode worker on host c over TCP, then (c rejoined with local prefill
    only) recomputed on c itself."""
    import httpx
    import openai

    from shared.models.smollm2 import smollm2_checkpoint
    from tests.netns_mesh import MultiHostMesh

    model = smollm2_checkpoint()
    rng = random.Random(0)
    out: dict = {"model": "SmolLM2-135M-Instruct", "prompt_tokens": tokens}
    with NetnsHosts(3) as hosts:
        m = MultiHostMesh(hosts, model, workdir)
        m.start_first("a")
        m.join("b", 0, 1)
        for label, threshold in (("remote_prefill", "0"), ("local_recompute", "1000000")):
            m.join("c", 1, 0, "--remote-prefill-threshold", threshold)
            m.wait_ready({"decode-c_0"}, timeout=300)
            m.wait_worker("prefill-b_0")
            client = openai.OpenAI(base_url=f"{m.url}/v1", api_key="unused", max_retries=0, timeout=600)
            name = client.models.list().data[0].id
            seconds = []
            for _ in range(repeats + 1):  # the first warms up
                prompt = [rng.randrange(100, 40000) for _ in range(tokens)]
                t0 = time.perf_counter()
                client.completions.create(model=name, prompt=prompt, max_tokens=1, temperature=0)
                seconds.append(time.perf_counter() - t0)
            pushes = m.metric("kvmesh:kv_pushes_total", worker="prefill-b_0")
            out[label] = {"ttft_seconds": seconds[1:], "median_ms": statistics.median(seconds[1:]) * 1e3,
                          "prefill_worker_pushes_so_far": pushes}
            print(f"{label}: TTFT {statistics.median(seconds[1:]) * 1e3:.0f} ms (pushes so far {pushes:.0f})",
                  flush=True)
            proc, _ = m.launchers.pop("c")
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=60)
            m.wait_decode_workers(lambda alive: not alive, timeout=60)
        del httpx
    return out


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--send":
        sender_main(sys.argv[2:])
        return 0
    p = argparse.ArgumentParser()
    p.add_argument("--json", default=None)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--ttft", action="store_true", help="also TTFT of a remote-prefilled prompt vs recompute")
    p.add_argument("--ttft-tokens", type=int, default=4096)
    p.add_argument("--no-transfer", action="store_true", help="keep the JSON's transfer figures, measure TTFT only")
    a = p.parse_args()
    result = {"what": "KV of a 4096-token SmolLM2-135M prompt pushed between two network namespaces over TCP",
              "note": "CPU machine shared with other jobs; tbf shaping only (no netem in this kernel)"}
    if a.json and a.no_transfer and Path(a.json).exists():
        result = json.loads(Path(a.json).read_text())
    else:
        result["transfer"] = measure(a.repeats)
    if a.json:
        Path(a.json).write_text(json.dumps(result, indent=1))
    if a.ttft:
        with tempfile.TemporaryDirectory() as d:
            result["ttft"] = measure_ttft(2, Path(d), a.ttft_tokens)
    if a.json:
        Path(a.json).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
