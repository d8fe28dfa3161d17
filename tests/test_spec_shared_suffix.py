"""Shared suffix decoding (services/decode/suffix_sharing.py): decode workers on a real nats-server publish their
finished outputs and learn the others' into their worker-wide suffix tables, per cache salt, bounded, only
between workers of the same model; a worker that learned another's answer drafts it (acceptance rises)."""
from __future__ import annotations

import asyncio

import pytest

from shared import bus, subjects
from shared.launcher.process_spec import MeshOptions, mesh_services
from shared.protocol.suffix import SharedOutput, SuffixOutputs
from shared.sampling_params import SamplingParams
from shared.spec_config import SpeculativeConfig
from services.decode.suffix_sharing import MAX_SHARED_TOKENS
from tests.engine_helpers import random_prompts
from tests.mesh_helpers import decode_service, generate, running
from tests.nats_fixtures import nats_server  # noqa: F401

SUFFIX = SpeculativeConfig(method="suffix", num_speculative_tokens=4)
SALT = "tenant-secret-salt"


async def _until(check, timeout: float = 10.0) -> None:  # noqa: ANN001
    for _ in range(int(timeout / 0.05)):
        if check():
            return
        await asyncio.sleep(0.05)
    raise AssertionError("timed out")


def _tables(worker):  # noqa: ANN001, ANN202
    return worker.thread.call(lambda e: {salt: dict(t) for salt, t in e.speculator.proposer.shared.items()})


def _stats(worker):  # noqa: ANN001, ANN202
    return worker.thread.call(lambda e: (e.speculator.stats.num_drafts, e.speculator.stats.num_accepted_tokens))


def test_workers_learn_each_others_outputs_per_salt(nats_server, checkpoints) -> None:  # noqa: F811
    ckpt = checkpoints["llama"]
    d0, d1 = (decode_service(ckpt, wid, threshold=1 << 30, kvstore=False, speculative_config=SUFFIX)
              for wid in ("d0", "d1"))
    d0.settings.share_suffix_outputs = d1.settings.share_suffix_outputs = True
    loner = decode_service(ckpt, "d2", threshold=1 << 30, kvstore=False, speculative_config=SUFFIX)  # flag off
    prompt = random_prompts([20], seed=3)[0]

    async def main() -> None:
        async with running(nats_server, d0, d1, loner) as nc:
            wire_seen: list[bytes] = []

            async def snoop(msg) -> None:  # noqa: ANN001 - what any decode identity reads of the broadcast
                wire_seen.append(msg.data)
            await nc.subscribe(subjects.DECODE_SUFFIX_ALL, cb=snoop)
            # d1 learns outputs under a salt once a request of that salt came to it (it knows the salt's tag
            # then); an output under a salt it never served is dropped.
            d1.suffix_sharing.saw_salt(SALT)
            await generate(nc, prompt, SamplingParams(max_tokens=12, temperature=0.0, cache_salt="never on d1"),
                           "r-other", subjects.decode_generate("d0"))
            await _until(lambda: d1.suffix_sharing.unknown_salt == 1)
            out, _ = await generate(nc, prompt, SamplingParams(max_tokens=12, temperature=0.0, cache_salt=SALT), "r0",
                                    subjects.decode_generate("d0"))
            await _until(lambda: d1.suffix_sharing.learned == 1)
            assert d0.suffix_sharing.published == 2 and d0.suffix_sharing.learned == 0  # not its own back
            mine, theirs = await _tables(d0), await _tables(d1)
            assert set(theirs) == {SALT} and theirs[SALT] == mine[SALT]  # the same counts, under the salt only
            # Neither a salt nor the mesh's block-hash root went on the bus.
            assert len(wire_seen) == 2
            assert not any(secret in data for data in wire_seen
                           for secret in (SALT.encode(), b"never on d1", d0.engine.block_manager.root))
            assert loner.suffix_sharing is None and await _tables(loner) == {}
            # Another model's outputs (another block-hash root) and over-long outputs.
            await bus.publish(nc, subjects.decode_suffix("dx"), SuffixOutputs(
                worker_id="dx", model_tag=b"other model", outputs=[SharedOutput(token_ids=[1, 2, 3])]))
            long = list(range(5, 5 + MAX_SHARED_TOKENS + 100))
            await bus.publish(nc, subjects.decode_suffix("dx"), SuffixOutputs(
                worker_id="dx", model_tag=d1.suffix_sharing.model_tag, outputs=[SharedOutput(token_ids=long)]))
            await _until(lambda: d1.suffix_sharing.learned == 2)
            recent = await d1.thread.call(lambda e: [(s, len(t)) for s, t in e.speculator.proposer.recent])
            assert recent == [(SALT, len(out)), ("", MAX_SHARED_TOKENS)]  # the foreign model's message taught nothing
            # The learning budget: 100 tokens a second leaves room for one 60-token output of three at once.
            d1.suffix_sharing.rate = d1.suffix_sharing._budget = 100
            await bus.publish(nc, subjects.decode_suffix("d0"), SuffixOutputs(
                worker_id="d0", model_tag=d1.suffix_sharing.model_tag,
                outputs=[SharedOutput(token_ids=list(range(60))) for _ in range(3)]))
            await _until(lambda: d1.suffix_sharing.learned == 3)
            assert d1.suffix_sharing.dropped == 2

    asyncio.run(main())


def test_sharing_without_suffix_speculation_is_a_config_error(checkpoints) -> None:
    from services.decode.service import DecodeService, DecodeSettings
    from shared.engine.errors import ConfigError
    from tests.mesh_helpers import engine_config

    for spec in (None, SpeculativeConfig(method="ngram")):
        with pytest.raises(ConfigError, match="needs suffix speculation"):
            DecodeService(engine_config(checkpoints["llama"], speculative_config=spec),
                          DecodeSettings("d0", share_suffix_outputs=True))


def test_a_learned_answer_raises_acceptance_on_the_other_worker(nats_server, checkpoints) -> None:  # noqa: F811
    """The same greedy request on d1 after d0 answered it: with sharing d1 drafts d0's answer and accepts more
    than the same run without sharing (random-weight models: the answer is not in the prompt)."""
    ckpt = checkpoints["qwen3"]
    prompt = random_prompts([24], seed=8)[0]
    params = SamplingParams(max_tokens=24, temperature=0.0)
    accepted = {}
    for share in (False, True):
        d0, d1 = (decode_service(ckpt, wid, threshold=1 << 30, kvstore=False, speculative_config=SUFFIX)
                  for wid in ("d0", "d1"))
        d0.settings.share_suffix_outputs = d1.settings.share_suffix_outputs = share

        async def main() -> list[int]:
            async with running(nats_server, d0, d1) as nc:
                first, _ = await generate(nc, prompt, params, "a", subjects.decode_generate("d0"))
                if share:
                    await _until(lambda: d1.suffix_sharing.learned == 1)
                again, _ = await generate(nc, prompt, params, "b", subjects.decode_generate("d1"))
                assert again == first
                accepted[share] = (await _stats(d1))[1]
                return first

        asyncio.run(main())
    assert accepted[True] > accepted[False], accepted


def test_kvmesh_up_passes_sharing_to_decode_workers_and_refuses_it_without_suffix() -> None:
    opts = MeshOptions(model="m", speculative_config=SUFFIX.to_json(), share_suffix_outputs=True)
    services = {s.service: s.args for s in mesh_services(opts)}
    assert "--share-suffix-outputs" in services["decode"] and "--share-suffix-outputs" not in services["prefill"]
    ngram = SpeculativeConfig(method="ngram", num_speculative_tokens=4).to_json()
    for spec in (None, ngram):
        with pytest.raises(AssertionError, match="needs suffix speculation"):
            MeshOptions(model="m", speculative_config=spec, share_suffix_outputs=True)
