"""The router and LoRA adapters (services/gateway/router.py): a prompt is hashed under its adapter, so blocks cached
for the base model or another adapter are no hit; workers holding the adapter are the only candidates while any
alive one holds it, one with it resident is preferred, and load outweighs that preference (a hot adapter spreads)."""
from __future__ import annotations

from services.gateway.router import Router, RouterConfig
from shared.block_hash import hash_blocks, lora_root, root_hash
from shared.protocol.events import BlockStored, LoadBeat

ROOT = root_hash("m", 4, "float32")
A = ("a", "digest-a")


def beat(worker: str, held: list[str], resident: list[str] | None = None, running: int = 0, waiting: int = 0,
         free: int = 100) -> LoadBeat:
    return LoadBeat(worker_id=worker, running=running, waiting=waiting, free_blocks=free, total_blocks=100,
                    block_size=4, hash_root=ROOT, max_model_len=512, lora_adapters=held,
                    lora_resident=held if resident is None else resident)


def test_adapter_prompts_hash_under_the_adapter_and_go_to_holders() -> None:
    r = Router(RouterConfig(expiry_s=60))
    prompt = list(range(40))
    r.on_beat(beat("d0", []))
    r.on_beat(beat("d1", ["a"], resident=[]))
    base_chain = hash_blocks(ROOT, prompt, 4)
    r.on_stored(BlockStored(worker_id="d1", hashes=base_chain, parent=None))
    # d1 caches the prompt for the base model only: no hit for the adapter, but d1 is the only holder.
    route = r.pick(prompt, lora=A)
    assert route.worker_id == "d1" and route.cached_blocks == 0
    assert r.pick(prompt).cached_blocks in (0, 10)
    lora_chain = hash_blocks(lora_root(ROOT, A[1]), prompt, 4)
    assert not set(lora_chain) & set(base_chain)
    r.on_stored(BlockStored(worker_id="d1", hashes=lora_chain, parent=None))
    assert r.pick(prompt, lora=A).cached_blocks == 10
    # Nobody holds adapter b: every worker is a candidate (the worker answers why it cannot serve it).
    assert r.pick(prompt, lora=("b", "digest-b")).worker_id in ("d0", "d1")


def test_a_resident_adapter_is_preferred_until_load_outweighs_it() -> None:
    r = Router(RouterConfig(expiry_s=60, max_waiting=8))
    prompt = list(range(8))
    r.on_beat(beat("d0", ["a"], resident=[]))
    r.on_beat(beat("d1", ["a"], resident=["a"]))
    assert r.pick(prompt, lora=A).worker_id == "d1"
    r.on_beat(beat("d1", ["a"], resident=["a"], running=8, waiting=7, free=10))  # busy: the hot adapter spreads
    assert r.pick(prompt, lora=A).worker_id == "d0"
