"""LoRA adapters in the engine: greedy output equals transformers on the weights merged with the adapter (float32),
a batch mixing the base model and three adapters equals each run alone, an evicted adapter read back from disk
gives the same tokens, adapters never share prefix-cache blocks, and bad adapters are refused with the reason,
leaving the engine serving as before."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from shared.engine.errors import ConfigError
from shared.engine.lora_config import LoRAConfig, parse_lora_modules
from shared.models.lora_files import AdapterError
from shared.sampling_params import SamplingParams
from tests.checkpoints import build_checkpoint, hf_greedy
from tests.engine_helpers import assert_all_free, make_engine, random_prompts, run_to_completion
from tests.lora_adapters import merged, write_adapter

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
SOME = ["q_proj", "v_proj", "o_proj", "gate_proj", "down_proj"]
MAX_TOKENS = 10


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):  # noqa: ANN001, ANN201
    root = tmp_path_factory.mktemp("lora-ckpt")
    return {arch: build_checkpoint(arch, root / arch) for arch in ("llama", "qwen3", "mistral")}


@pytest.fixture(scope="module")
def adapters(ckpts, tmp_path_factory):  # noqa: ANN001, ANN201
    """Per architecture: a (all projections, rank 8), b (five projections, rank 4, rsLoRA), c (attention, rank 16)."""
    root = tmp_path_factory.mktemp("lora-adapters")
    out = {}
    for arch, ck in ckpts.items():
        cfg = ck.hf_model.config
        out[arch] = {
            "a": write_adapter(root / arch / "a", cfg, ALL, r=8, alpha=16, seed=1, std=0.15),
            "b": write_adapter(root / arch / "b", cfg, SOME, r=4, alpha=4, seed=2, std=0.2, use_rslora=True),
            "c": write_adapter(root / arch / "c", cfg, ["q_proj", "k_proj", "v_proj", "o_proj"], r=16, alpha=8,
                               seed=3, std=0.15),
        }
    return out


def _greedy(name: str | None) -> SamplingParams:
    return SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, lora_name=name)


def _engine(ck, adapters: dict[str, Path], **lora):  # noqa: ANN001, ANN003, ANN202
    modules = tuple((n, str(p)) for n, p in adapters.items())
    return make_engine(ck, dtype="float32", lora=LoRAConfig(modules=modules, **{"max_loras": 4, **lora}))


@pytest.mark.parametrize("arch", ["llama", pytest.param("qwen3", marks=pytest.mark.slow),
                                  pytest.param("mistral", marks=pytest.mark.slow)])
def test_greedy_with_an_adapter_equals_transformers_on_merged_weights(arch, ckpts, adapters) -> None:  # noqa: ANN001
    ck = ckpts[arch]
    engine = _engine(ck, adapters[arch])
    # 70 tokens: longer than mistral's window of 48, and prompt chunks (the Python path) and decode rows both.
    prompts = random_prompts([7, 70], seed=5)
    for i, p in enumerate(prompts):
        for name in ("a", "b", "c", None):
            engine.add_request(f"{name}-{i}", p, _greedy(name))
    done = run_to_completion(engine)
    for name in ("a", "b", "c"):
        model = merged(ck.hf_model, adapters[arch][name])
        for i, p in enumerate(prompts):
            ref, _ = hf_greedy(model, p, MAX_TOKENS)
            assert done[f"{name}-{i}"].output_token_ids == ref, f"{arch} adapter {name} prompt {i}"
    for i, p in enumerate(prompts):
        base, _ = hf_greedy(ck.hf_model, p, MAX_TOKENS)
        assert done[f"None-{i}"].output_token_ids == base
        assert done[f"a-{i}"].output_token_ids != base, "the adapter changes the output (else the test proves nothing)"
    assert_all_free(engine)


def test_a_mixed_batch_equals_each_request_alone_and_slots_evict(ckpts, adapters) -> None:  # noqa: ANN001
    ck, ads = ckpts["llama"], adapters["llama"]
    prompts = random_prompts([9, 33, 20, 16], seed=7)
    names = [None, "a", "b", "c"]
    alone = {}
    engine = _engine(ck, ads)
    for i, (p, name) in enumerate(zip(prompts, names)):
        engine.add_request(f"r{i}", p, _greedy(name))
        alone[i] = run_to_completion(engine)[f"r{i}"].output_token_ids
    mixed_steps = []
    original = engine.runner.lora.prepare

    def watch(plan, order):  # noqa: ANN001, ANN202
        used = original(plan, order)
        mixed_steps.append(len({id(s.lora) for s, _ in plan}))
        return used

    engine.runner.lora.prepare = watch
    for i, (p, name) in enumerate(zip(prompts, names)):
        engine.add_request(f"m{i}", p, _greedy(name))
    batched = run_to_completion(engine)
    assert max(mixed_steps) == 4, "base and three adapters ran in one step"
    assert {i: batched[f"m{i}"].output_token_ids for i in alone} == alone
    # Two slots for three adapters: the scheduler keeps each step within them, slots are evicted and reloaded.
    small = _engine(ck, ads, max_loras=2)
    for i, (p, name) in enumerate(zip(prompts, names)):
        small.add_request(f"s{i}", p, _greedy(name))
    done = run_to_completion(small)
    assert {i: done[f"s{i}"].output_token_ids for i in alone} == alone
    assert small.lora.stats.slot_loads >= 3
    assert_all_free(small)


def test_an_adapter_dropped_from_the_host_cache_is_read_again_with_the_same_tokens(ckpts, adapters) -> None:  # noqa: ANN001
    ck, ads = ckpts["qwen3"], adapters["qwen3"]
    engine = _engine(ck, ads, max_loras=1, max_cpu_loras=1)
    assert engine.lora.stats.disk_reads == 3 and len(engine.lora.host) == 1  # only the last read stays in memory
    prompt = random_prompts([12], seed=11)[0]
    first = {}
    for name in ("a", "b", "a"):
        engine.add_request(f"{name}{len(first)}", prompt, _greedy(name))
        first[f"{name}{len(first)}"] = run_to_completion(engine)
    reads = engine.lora.stats.disk_reads
    assert reads >= 5 and engine.lora.stats.slot_evictions >= 2
    a0 = first["a0"]["a0"].output_token_ids
    assert first["a2"]["a2"].output_token_ids == a0
    assert a0 == hf_greedy(merged(ck.hf_model, ads["a"]), prompt, MAX_TOKENS)[0]


def test_adapters_never_share_prefix_blocks(ckpts, adapters) -> None:  # noqa: ANN001
    ck, ads = ckpts["llama"], adapters["llama"]
    engine = _engine(ck, ads)
    prompt = random_prompts([65], seed=3)[0]  # four full blocks
    hashes, cached = {}, {}
    for name in ("a", "b", None, "a", "b", None):
        rid = f"{name}-{len(hashes)}"
        engine.add_request(rid, prompt, _greedy(name))
        seq = engine.scheduler.requests[rid]
        out = run_to_completion(engine)[rid]
        hashes.setdefault(name, set()).update(seq.block_hashes[:4])
        cached.setdefault(name, []).append(out.num_cached_tokens)
    assert all(len(h) == 4 for h in hashes.values())
    assert not (hashes["a"] & hashes["b"]) and not (hashes["a"] & hashes[None]) and not (hashes["b"] & hashes[None])
    # Each name's second run hits its own first run's blocks, and nothing else's.
    assert all(c == [0, 64] for c in cached.values()), cached
    # The same adapter loaded again from other files (another digest) hashes apart too.
    engine.lora.remove("a")
    engine.lora.add("a", str(ads["c"]))
    engine.add_request("again", prompt, _greedy("a"))
    seq = engine.scheduler.requests["again"]
    assert run_to_completion(engine)["again"].num_cached_tokens == 0
    assert not set(seq.block_hashes[:4]) & hashes["a"]


def _broken(root: Path, good: Path, name: str, config: dict | None = None, weights: bytes | None = None) -> Path:
    out = root / name
    out.mkdir()
    cfg = json.loads((good / "adapter_config.json").read_text())
    (out / "adapter_config.json").write_text(json.dumps({**cfg, **(config or {})}))
    (out / "adapter_model.safetensors").write_bytes(weights if weights is not None
                                                    else (good / "adapter_model.safetensors").read_bytes())
    return out


def test_bad_adapters_are_refused_with_the_reason_and_nothing_changes(ckpts, adapters, tmp_path) -> None:  # noqa: ANN001
    ck, ads = ckpts["llama"], adapters["llama"]
    engine = _engine(ck, {"a": ads["a"]}, max_lora_rank=8)
    other = build_checkpoint("llama", tmp_path / "wide", hidden_size=96, intermediate_size=160)
    cases = {
        "missing": (tmp_path / "nowhere", "is not a directory"),
        "no config": (_broken(tmp_path, ads["a"], "noconf"), None),
        "bad json": (_broken(tmp_path, ads["a"], "badjson"), None),
        "rank": (ads["c"], "above --max-lora-rank 8"),
        "target": (_broken(tmp_path, ads["a"], "target", {"target_modules": ["q_proj", "lm_head"]}),
                   "not projections of this model"),
        "base": (write_adapter(tmp_path / "wide-adapter", other.hf_model.config, SOME, r=4), "another base model"),
        "garbage": (_broken(tmp_path, ads["a"], "garbage", weights=b"\x05\x00\x00\x00\x00\x00\x00\x00{xx}"),
                    "safetensors"),
        "dora": (_broken(tmp_path, ads["a"], "dora", {"use_dora": True}), "DoRA"),
    }
    (cases["no config"][0] / "adapter_config.json").unlink()
    (cases["bad json"][0] / "adapter_config.json").write_text("{")
    for what, (path, reason) in cases.items():
        with pytest.raises(AdapterError) as e:
            engine.lora.add(f"x-{what}", str(path))
        assert reason is None or reason in str(e.value), (what, str(e.value))
    assert engine.lora.names() == ["a"]
    with pytest.raises(ValueError, match="not loaded"):
        engine.add_request("unknown", [1, 2, 3], _greedy("x-rank"))
    prompt = random_prompts([10], seed=2)[0]
    engine.add_request("ok", prompt, _greedy("a"))
    assert run_to_completion(engine)["ok"].output_token_ids == hf_greedy(merged(ck.hf_model, ads["a"]), prompt,
                                                                        MAX_TOKENS)[0]
    # An engine without LoRA refuses an adapter request; a bad adapter at start is a configuration error.
    with pytest.raises(ValueError, match="--enable-lora"):
        make_engine(ck, dtype="float32", num_kv_blocks=16).add_request("r", [1, 2], _greedy("a"))
    with pytest.raises(ConfigError, match="--lora-modules bad="):
        _engine(ck, {"bad": tmp_path / "nowhere"})
    with pytest.raises(ConfigError):
        parse_lora_modules(["no-equals-sign"])
    assert parse_lora_modules(['{"name": "j", "path": "/p"}', "k=/q"]) == (("j", "/p"), ("k", "/q"))
