"""KV transfer between two namespaced hosts (tests/netns_hosts.py), for docs/benchmarks.md:

    python -m tests.netns_bench --json loadtest/results/multihost_kv_cpu.json

A receiver (a DirectServer, as a decode worker runs it) on host c, a sender (DirectSender) on host b: the KV of a
4096-token prompt of SmolLM2-135M's shape (30 layers, 3 KV heads of 64, bf16: 94 MB), pushed whole as a prefill
worker pushes it, over the hosts' own addresses, so inline over TCP (shared memory is offered only to this
host's own addresses). Links: the bridge unshaped and shaped with tbf (10 Gbit/s and 1 Gbit/s, a queue of at most
the given latency), and the userspace link emulator (tests/netns_wan.py: this machine's kernel has no netem) with
no limit (its own cost), 10 Gbit/s with 0.5 ms each way and 1 Gbit/s with 2 ms each way.
Root only; the namespaces are removed on exit.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
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
from loadtest.report_json import provenance
from tests.netns_hosts import Host, NetnsHosts

SHAPE = (30, 256, 16, 3, 64)  # layers, blocks of 16 tokens (4096 tokens), block size, KV heads, head dim
# name: ("tbf", rate, queue latency, burst) on the bridge, or ("wan", delay ms, rate Mbit/s) through the emulator
LINKS: dict[str, tuple | None] = {
    "unshaped": None, "tbf 10gbit": ("tbf", "10gbit", "5ms", "4mb"), "tbf 1gbit": ("tbf", "1gbit", "20ms", "1mb"),
    "emulated, no limit": ("wan", 0, 0), "emulated 10gbit 0.5ms": ("wan", 0.5, 10000),
    "emulated 1gbit 2ms": ("wan", 2, 1000)}
TTFT_LINKS = ("unshaped", "emulated, no limit", "emulated 10gbit 0.5ms", "emulated 1gbit 2ms")


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


def _transfer(b: Host, c: Host, repeats: int) -> list[float]:
    """Seconds of each push b -> c after a first one that warms up."""
    token = secrets.token_bytes(16)
    shape = ",".join(map(str, SHAPE))
    recv = c.popen([sys.executable, "-m", "tests.netns_bench_receiver", c.address, shape, str(repeats + 1),
                    token.hex()], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    port = int(recv.stdout.readline().split()[1])
    sent = subprocess.run(b.argv(sys.executable, "-m", "tests.netns_bench", "--send", c.address, str(port),
                                 token.hex(), str(repeats)), capture_output=True, text=True, timeout=900)
    recv.stdin.close()
    recv.wait(timeout=60)
    if sent.returncode != 0:
        raise RuntimeError(sent.stderr[-2000:])
    return json.loads(sent.stdout.strip().splitlines()[-1])


def measure(repeats: int) -> dict:
    nbytes = 2 * torch.Size(SHAPE).numel() * 2
    out: dict = {"bytes": nbytes, "tokens": SHAPE[1] * SHAPE[2], "shape": list(SHAPE), "dtype": "bfloat16",
                 "links": {}}
    with NetnsHosts(2) as hosts:
        b, c = hosts["a"], hosts["b"]
        for name, shaping in LINKS.items():
            with contextlib.ExitStack() as link:
                if shaping and shaping[0] == "tbf":
                    for host in (b, c):
                        host.shape(*shaping[1:])
                        link.callback(host.unshape)
                elif shaping:
                    link.enter_context(hosts.wan("a", "b", shaping[1], shaping[2]))
                seconds = _transfer(b, c, repeats)
            med = statistics.median(seconds)
            out["links"][name] = {"seconds": seconds, "median_seconds": med, "gb_per_s": nbytes / med / 1e9}
            print(f"{name}: {nbytes / 1e6:.0f} MB in {med * 1e3:.0f} ms = {nbytes / med / 1e9:.2f} GB/s", flush=True)
    return out


def _ttft(client, tokens: int, rng: random.Random) -> float:  # noqa: ANN001
    """Seconds to the one token of a fresh prompt (random tokens: nothing cached anywhere)."""
    name = client.models.list().data[0].id
    prompt = [rng.randrange(100, 40000) for _ in range(tokens)]
    t0 = time.perf_counter()
    client.completions.create(model=name, prompt=prompt, max_tokens=1, temperature=0)
    return time.perf_counter() - t0


def _pushes(m) -> tuple[float, float]:  # noqa: ANN001
    """The prefill worker's KV pushes so far and the seconds decode waited for them after the last chunk computed
    (read after its next load beat, so the last request is in them)."""
    time.sleep(2.5)
    return (m.metric("kvmesh:kv_pushes_total", worker="prefill-b_0"),
            m.metric("kvmesh:kv_push_wait_seconds_total", worker="prefill-b_0"))


def measure_ttft(repeats: int, workdir: Path, tokens: int = 4096) -> dict:
    """TTFT of a fresh `tokens`-token prompt (max_tokens 1) on SmolLM2-135M through a three-host mesh: prefilled on
    host b and its KV pushed to the decode worker on host c over TCP, a request on each link between b and c in
    turn (rounds, so a drift of the machine's speed touches every link alike); then (c rejoined with local prefill
    only) recomputed on c itself. With each remote row, the seconds decode waited for the KV after the prompt's
    last chunk computed: the part of TTFT the link adds (the rest of a 4k prefill is compute on both paths)."""
    import openai

    from shared.models.smollm2 import smollm2_checkpoint
    from tests.netns_mesh import MultiHostMesh

    model = smollm2_checkpoint()
    rng = random.Random(0)
    out: dict = {"model": "SmolLM2-135M-Instruct", "prompt_tokens": tokens, "remote_prefill": {}}
    with NetnsHosts(3) as hosts:
        m = MultiHostMesh(hosts, model, workdir)
        m.start_first("a")
        m.join("b", 0, 1)
        for label, threshold in (("remote_prefill", "0"), ("local_recompute", "1000000")):
            m.join("c", 1, 0, "--remote-prefill-threshold", threshold)
            m.wait_ready({"decode-c_0"}, timeout=300)
            m.wait_worker("prefill-b_0")
            client = openai.OpenAI(base_url=f"{m.url}/v1", api_key="unused", max_retries=0, timeout=600)
            _ttft(client, tokens, rng)  # warms up
            links = TTFT_LINKS if label == "remote_prefill" else ("unshaped",)
            rows: dict[str, dict] = {name: {"ttft_seconds": [], "kv_pushes": 0.0, "kv_wait_seconds": []}
                                     for name in links}
            pushes, waited = _pushes(m)  # the counters after each request are the next one's starting point
            for _ in range(repeats):
                for name in links:
                    spec = LINKS[name]
                    with contextlib.ExitStack() as link:
                        if spec:
                            link.enter_context(hosts.wan("b", "c", spec[1], spec[2]))
                        rows[name]["ttft_seconds"].append(_ttft(client, tokens, rng))
                        pushes_after, waited_after = _pushes(m)
                    rows[name]["kv_pushes"] += pushes_after - pushes
                    rows[name]["kv_wait_seconds"].append(waited_after - waited)
                    pushes, waited = pushes_after, waited_after
            for name, row in rows.items():
                row["median_ms"] = statistics.median(row["ttft_seconds"]) * 1e3
                row["kv_wait_median_ms"] = statistics.median(row["kv_wait_seconds"]) * 1e3
                print(f"{label} {name}: TTFT {row['median_ms']:.0f} ms, waited for KV {row['kv_wait_median_ms']:.0f}"
                      f" ms ({row['kv_pushes']:.0f} KV pushes)", flush=True)
            if label == "remote_prefill":
                out[label] = rows
            else:
                out[label] = rows["unshaped"]
            proc, _ = m.launchers.pop("c")
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=60)
            m.wait_decode_workers(lambda alive: not alive, timeout=60)
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
    p.add_argument("--ttft-repeats", type=int, default=3)
    p.add_argument("--no-transfer", action="store_true", help="keep the JSON's transfer figures, measure TTFT only")
    a = p.parse_args()
    result = {"what": "KV of a 4096-token SmolLM2-135M prompt pushed between two network namespaces over TCP",
              "note": "tbf shapes the bridge; delays come from the userspace link emulator (tests/netns_wan.py), "
                      "this kernel has no netem", "provenance": provenance()}
    if a.json and a.no_transfer and Path(a.json).exists():
        result = json.loads(Path(a.json).read_text())
    else:
        result["transfer"] = measure(a.repeats)
    if a.json:
        Path(a.json).write_text(json.dumps(result, indent=1))
    if a.ttft:
        with tempfile.TemporaryDirectory() as d:
            result["ttft"] = {**measure_ttft(a.ttft_repeats, Path(d), a.ttft_tokens), "provenance": provenance()}
    if a.json:
        Path(a.json).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
