"""LoRA adapters through a real mesh (nats-server, tokenizer, gateway, a decode and a prefill worker, both with
--enable-lora) and the official openai client: /v1/models lists adapters with their parent, adapter requests
streamed and not equal transformers on the merged weights (long prompts prefilled remotely, with the adapter),
adapters load and unload while another request streams, and bad loads are a 400 that changes nothing."""
from __future__ import annotations

import threading

import httpx
import openai
import pytest

from shared.engine.lora_config import LoRAConfig
from tests.checkpoints import build_checkpoint, hf_greedy
from tests.engine_helpers import random_prompts
from tests.gateway_harness import Mesh
from tests.lora_adapters import merged, write_adapter
from tests.mesh_helpers import prefill_service

SOME = ["q_proj", "v_proj", "o_proj", "gate_proj", "down_proj"]
THRESHOLD = 24  # prompts with more uncached tokens than this are prefilled by the prefill worker


@pytest.fixture(scope="module")
def setup(tmp_path_factory):  # noqa: ANN001, ANN201
    root = tmp_path_factory.mktemp("lora-mesh")
    ck = build_checkpoint("llama", root / "llama")
    cfg = ck.hf_model.config
    ads = {"a": write_adapter(root / "a", cfg, SOME, r=8, alpha=16, seed=1, std=0.15),
           "b": write_adapter(root / "b", cfg, ["q_proj", "k_proj", "up_proj"], r=4, alpha=8, seed=2, std=0.2),
           "big": write_adapter(root / "big", cfg, ["q_proj"], r=32, seed=3)}
    lora = LoRAConfig(max_loras=2, max_lora_rank=16, modules=(("a", str(ads["a"])),))
    m = Mesh(tmp_path_factory.mktemp("nats"), ck.path, enable_lora=True, lora_modules=lora.modules,
             allow_runtime_lora_updating=True)
    try:
        m.start_tokenizer()
        m.start_decoder("d0", threshold=THRESHOLD, dtype="float32", lora=lora)

        async def start_prefill():  # noqa: ANN202
            p = prefill_service(ck.path, kvstore=False, num_kv_blocks=96, dtype="float32", lora=lora)
            await p.start(await m._connect())
            m.prefills.append(p)
            return p
        m.call(start_prefill(), timeout=60)
        m.wait_until(lambda: m.gateway.ctx.router.alive() and m.gateway.ctx.metrics.prefill_workers.alive())
        yield m, ck, ads
    finally:
        m.close()


@pytest.fixture(scope="module")
def client(setup):  # noqa: ANN001, ANN201
    return openai.OpenAI(base_url=f"{setup[0].url}/v1", api_key="unused", max_retries=0, timeout=60)


def _ids(client: openai.OpenAI, model: str, prompt: list[int], n: int = 8, stream: bool = False) -> list[int]:
    kw = dict(model=model, prompt=prompt, max_tokens=n, temperature=0, extra_body={"return_token_ids": True,
                                                                                 "ignore_eos": True})
    if not stream:
        return client.completions.create(**kw).choices[0].token_ids
    out: list[int] = []
    for chunk in client.completions.create(stream=True, **kw):
        for c in chunk.choices:
            out += getattr(c, "token_ids", None) or []
    return out


def test_models_lists_each_adapter_with_its_parent(setup, client) -> None:  # noqa: ANN001
    models = {m.id: m for m in client.models.list().data}
    assert set(models) == {"tiny", "a"}
    assert models["a"].parent == "tiny" and getattr(models["tiny"], "parent", None) is None
    assert client.models.retrieve("a").id == "a"


def test_adapter_requests_equal_transformers_on_merged_weights(setup, client) -> None:  # noqa: ANN001
    m, ck, ads = setup
    short, long = random_prompts([6, 50], seed=4)
    ref = merged(ck.hf_model, ads["a"])
    for prompt in (short, long):
        want = hf_greedy(ref, prompt, 8)[0]
        assert _ids(client, "a", prompt) == want
        assert _ids(client, "a", prompt, stream=True) == want
        assert _ids(client, "tiny", prompt) == hf_greedy(ck.hf_model, prompt, 8)[0] != want
    # The long prompt went to the prefill worker, which computed it with the adapter (its first token is in `want`).
    assert m.prefills[0].engine.lora.stats.slot_loads >= 1
    # An adapter's blocks never serve the base model: the same long prompt again on the base has no adapter prefix.
    assert _ids(client, "tiny", long) == hf_greedy(ck.hf_model, long, 8)[0]


def test_load_and_unload_while_another_request_streams(setup, client) -> None:  # noqa: ANN001
    m, ck, ads = setup
    prompt = random_prompts([10], seed=8)[0]
    base_alone = hf_greedy(ck.hf_model, prompt, 60)[0]
    streamed: list[list[int]] = []
    worker = threading.Thread(target=lambda: streamed.append(_ids(client, "tiny", prompt, n=60, stream=True)))
    worker.start()
    url = m.url
    r = httpx.post(f"{url}/v1/load_lora_adapter", json={"lora_name": "b", "lora_path": str(ads["b"])}, timeout=60)
    assert r.status_code == 200, r.text
    # Every worker holds it: those alive at the load at once, one whose beat was late from its next beat on.
    m.wait_until(lambda: [w.engine.lora.names() for w in [*m.decoders.values(), *m.prefills]] == [["a", "b"]] * 2,
                 timeout=10)
    assert "b" in {x.id for x in client.models.list().data}
    p2 = random_prompts([40], seed=9)[0]
    assert _ids(client, "b", p2, stream=True) == hf_greedy(merged(ck.hf_model, ads["b"]), p2, 8)[0]
    # Bad loads: a 400 with the reason, and the mesh's adapters unchanged.
    for body, reason in (({"lora_name": "big", "lora_path": str(ads["big"])}, "above --max-lora-rank 16"),
                         ({"lora_name": "x", "lora_path": str(ads["b"] / "missing")}, "not a directory"),
                         ({"lora_name": "a", "lora_path": str(ads["b"])}, "already been loaded"),
                         ({"lora_name": "tiny", "lora_path": str(ads["b"])}, "base model"),
                         ({"lora_name": ""}, "lora_name")):
        r = httpx.post(f"{url}/v1/load_lora_adapter", json=body, timeout=60)
        assert r.status_code == 400 and reason in r.json()["error"]["message"], (body, r.text)
    assert [w.engine.lora.names() for w in [*m.decoders.values(), *m.prefills]] == [["a", "b"]] * 2
    r = httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "b"}, timeout=60)
    assert r.status_code == 200, r.text
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="b", prompt=p2, max_tokens=2)
    assert httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "b"}, timeout=60).status_code == 404
    m.wait_until(lambda: [w.engine.lora.names() for w in [*m.decoders.values(), *m.prefills]] == [["a"]] * 2,
                 timeout=10)
    worker.join(timeout=120)
    assert streamed == [base_alone]
