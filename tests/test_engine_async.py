"""Async scheduling (shared/engine/async_step.py): step n+1 is scheduled and built before step n's ids reach the
host, and the tokens are those of the synchronous engine (and of transformers), whatever finishes, arrives,
aborts or is preempted meanwhile."""
from __future__ import annotations

import argparse
import threading
import time
from dataclasses import replace

import pytest

from shared.config import EngineConfig
from shared.engine.async_step import PLACEHOLDER, async_wanted
from shared.sampling_params import SamplingParams
from shared.spec_config import SpeculativeConfig
from tests.engine_helpers import (assert_all_free, assert_matches_hf, greedy, make_engine, random_prompts,
                                  run_to_completion)

MIXED_LENGTHS = [1, 5, 16, 17, 31, 48, 64, 90, 7, 33]
MAX_NEW = 16
DEVICE_S = 0.03  # how long the stand-in device takes per step


def _tokens(outputs) -> list[tuple[list[int], str]]:
    return [(o.output_token_ids, o.finish_reason) for o in outputs]


def _both(ckpt, prompts, params, **cfg):
    """Outputs of the synchronous engine and of the async one, and the async engine."""
    sync = make_engine(ckpt, async_scheduling=False, **cfg).generate(prompts, params, use_tqdm=False)
    engine = make_engine(ckpt, async_scheduling=True, **cfg)
    assert engine.overlap is not None
    return sync, engine.generate(prompts, params, use_tqdm=False), engine


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_greedy_matches_transformers_and_the_sync_engine(arch, checkpoints, hf_reference):
    ckpt = checkpoints[arch]
    prompts = random_prompts(MIXED_LENGTHS, seed=1)
    sync, outs, engine = _both(ckpt, prompts, greedy(MAX_NEW))
    assert _tokens(outs) == _tokens(sync)
    assert_matches_hf(ckpt, hf_reference, prompts, outs, MAX_NEW)  # logprobs too, through the packed host copy
    assert_all_free(engine)


def test_decode_graph_path_reads_the_fed_ids(checkpoints, hf_reference):
    """The padded static decode path (what CUDA graphs replay; run eagerly here) takes its fed ids too."""
    ckpt = checkpoints["qwen3"]
    engine = make_engine(ckpt, async_scheduling=True)
    graphs = engine.runner.use_decode_graphs(engine.max_model_len, 16, capture=False)
    replays = []
    graphs.replay = lambda bs, n, replay=graphs.replay: replays.append(n) or replay(bs, n)
    prompts = random_prompts([3, 18, 35, 60], seed=10)
    outs = engine.generate(prompts, greedy(MAX_NEW), use_tqdm=False)
    assert replays, "no decode step took the graph path"
    assert_matches_hf(ckpt, hf_reference, prompts, outs, MAX_NEW)
    assert_all_free(engine)


def test_stops_and_lengths_mid_batch_match_the_sync_engine(checkpoints):
    """Requests finish at different steps, by max_tokens or by a stop id: their extra async row is dropped."""
    ckpt = checkpoints["llama"]
    prompts = random_prompts(MIXED_LENGTHS, seed=5)
    free_run = make_engine(ckpt, async_scheduling=False).generate(prompts, greedy(MAX_NEW, None), use_tqdm=False)
    params = []
    for i, out in enumerate(free_run):
        if i % 2:  # stop on the token it emits at step 2 + i % 7 (an eos in the middle of the batch)
            stop = out.output_token_ids[2 + i % 7]
            params.append(SamplingParams(max_tokens=MAX_NEW, temperature=0.0, stop_token_ids=[stop]))
        else:
            params.append(greedy(3 + i, None))
    sync, outs, engine = _both(ckpt, prompts, params)
    assert _tokens(outs) == _tokens(sync)
    assert {o.finish_reason for o in outs} == {"stop", "length"}
    assert all(PLACEHOLDER not in o.output_token_ids for o in outs)
    assert_all_free(engine)


def test_requests_reaching_max_model_len(checkpoints):
    """The row computed past a request that reached the model's length stays inside the pool and the rotary table."""
    ckpt = checkpoints["qwen3"]
    prompts = random_prompts([30, 47, 12], seed=11)
    sync, outs, engine = _both(ckpt, prompts, greedy(40, None), max_model_len=48)
    assert _tokens(outs) == _tokens(sync)
    assert [o.finish_reason for o in outs][:2] == ["length", "length"]
    assert_all_free(engine)


def test_the_extra_token_never_reaches_block_hashes(checkpoints):
    """Prompt + output end on a block boundary: the token sampled past the end must not complete a block."""
    ckpt = checkpoints["qwen2"]
    prompts = random_prompts([10, 26, 3], seed=6)
    params = [greedy(6, None), greedy(6, None), greedy(13, None)]  # 16, 32 and 16 tokens in all
    cached = []
    for mode in (False, True):
        engine = make_engine(ckpt, async_scheduling=mode)
        engine.generate(prompts, params, use_tqdm=False)
        cached.append((set(engine.block_manager.cached), engine.block_manager.drain_events()))
        assert_all_free(engine)
    assert cached[0] == cached[1]


def test_requests_arriving_between_steps_and_aborts(checkpoints, hf_reference):
    ckpt = checkpoints["llama"]
    prompts = random_prompts(MIXED_LENGTHS, seed=1)
    arrivals = {0: [0, 1, 2], 2: [3, 4], 3: [5, 6, 7], 6: [8, 9]}  # step -> requests added before it
    aborted = {"r1", "r6"}
    done = {}
    for mode in (False, True):
        engine = make_engine(ckpt, async_scheduling=mode, max_num_batched_tokens=40)
        finished = {}
        for step in range(8):
            for i in arrivals.get(step, []):
                engine.add_request(f"r{i}", prompts[i], greedy(MAX_NEW))
            if step == 5:
                for rid in aborted:
                    out = engine.abort(rid)
                    assert out is not None and out.finish_reason == "abort"
                engine.check_integrity()
            finished |= {o.request_id: o for o in engine.step() if o.finished}
        finished |= run_to_completion(engine)
        assert set(finished) == {f"r{i}" for i in range(len(prompts))} - aborted
        assert_all_free(engine)
        done[mode] = finished
    keep = [i for i in range(len(prompts)) if f"r{i}" not in aborted]
    assert [_tokens([done[True][f"r{i}"]]) for i in keep] == [_tokens([done[False][f"r{i}"]]) for i in keep]
    assert_matches_hf(ckpt, hf_reference, [prompts[i] for i in keep], [done[True][f"r{i}"] for i in keep], MAX_NEW)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_preemption_by_recompute(arch, checkpoints, hf_reference):
    ckpt = checkpoints[arch]
    prompts = random_prompts(MIXED_LENGTHS, seed=1)
    sync, outs, engine = _both(ckpt, prompts, greedy(MAX_NEW), num_kv_blocks=14, max_num_batched_tokens=64)
    assert engine.stats().num_preemptions > 0, "the pool was meant to be too small"
    assert _tokens(outs) == _tokens(sync)
    assert_matches_hf(ckpt, hf_reference, prompts, outs, MAX_NEW)
    assert_all_free(engine)


def test_seeded_sampling_matches_the_sync_engine(checkpoints):
    ckpt = checkpoints["mistral"]
    prompts = random_prompts([4, 20, 40], seed=7)
    params = [SamplingParams(max_tokens=8 + 3 * i, temperature=0.9, top_p=0.9, seed=100 + i) for i in range(3)]
    sync, outs, _ = _both(ckpt, prompts, params)
    assert _tokens(outs) == _tokens(sync)


def test_a_request_that_needs_its_last_token_on_the_host_makes_steps_synchronous(checkpoints):
    ckpt = checkpoints["llama"]
    prompts = random_prompts([12, 30, 5], seed=8)
    params = [greedy(10, None), SamplingParams(max_tokens=6, temperature=0.0, repetition_penalty=1.3),
              greedy(12, None)]
    sync, outs, engine = _both(ckpt, prompts, params)
    assert _tokens(outs) == _tokens(sync)
    assert_all_free(engine)
    # Launches are counted: the penalty request keeps every step it can run in synchronous.
    engine.add_request("pen", prompts[1], params[1])
    assert not engine.overlap.allows()
    launches = []
    engine.overlap.launch = lambda plan, prev: launches.append(plan)  # would fail loudly if it were used
    while engine.has_unfinished_requests():
        engine.step()
    assert launches == []
    assert engine.overlap.allows()


def test_next_step_is_built_before_the_previous_ids_reach_the_host(checkpoints):
    """A stand-in device: each launched step's ids become readable DEVICE_S after its launch. Step n+1's schedule
    and build must start before step n's ids are read, and its decode rows must read step n's ids on the device.
    The synchronous order (read, update, schedule, build) fails the order and feed assertions below."""
    engine = make_engine(checkpoints["llama"], async_scheduling=True)
    overlap, runner = engine.overlap, engine.runner
    log: list[tuple[str, int, float]] = []  # (what, launch index, when)
    launches, fed = [], []

    def record(name, fn):
        def wrapped(*a, **kw):
            log.append((name, len(launches), time.perf_counter()))
            return fn(*a, **kw)
        return wrapped

    def slow_launch(plan, prev, launch=overlap.launch):
        i = len(launches)
        launched = launch(plan, prev)  # its build is logged under index i
        launches.append(plan)
        ready = threading.Event()
        threading.Timer(DEVICE_S, ready.set).start()
        result = launched.result

        def synced():
            ready.wait()
            log.append(("synced", i, time.perf_counter()))
            return result()
        launched.result = synced
        return launched

    def execute(plan, rows, fed_tokens=None, execute=runner.execute):
        fed.append(len(fed_tokens.rows) if fed_tokens else 0)
        return execute(plan, rows, fed_tokens)

    overlap.launch = slow_launch
    runner.execute = execute
    engine.scheduler.schedule = record("schedule", engine.scheduler.schedule)
    runner.build = record("build", runner.build)
    prompts = random_prompts([9, 21, 40], seed=9)
    outs = engine.generate(prompts, greedy(6, None), use_tqdm=False)
    assert len(launches) >= 6
    synced = {i: t for what, i, t in log if what == "synced"}
    for what in ("schedule", "build"):
        # Step n+1's (logged while launches == n + 1) against step n's sync.
        starts = {i: t for w, i, t in reversed(log) if w == what}  # the first of each index
        for n in range(len(launches) - 1):
            assert starts[n + 1] < synced[n], f"{what} of step {n + 1} waited for step {n}'s ids"
    # Every decode row after the first step reads the previous step's ids on the device.
    assert fed[0] == 0 and all(f == len(p.scheduled) for f, p in zip(fed[1:], launches[1:]))
    reference = make_engine(checkpoints["llama"], async_scheduling=False).generate(prompts, greedy(6, None),
                                                                                    use_tqdm=False)
    assert _tokens(outs) == _tokens(reference)


def test_the_config_and_the_flag():
    cpu = EngineConfig(model="m", device="cpu")
    assert not async_wanted(cpu)
    assert async_wanted(replace(cpu, async_scheduling=True))
    assert async_wanted(replace(cpu, device="cuda"))
    assert not async_wanted(replace(cpu, device="cuda", async_scheduling=False))
    assert not async_wanted(replace(cpu, async_scheduling=True, tensor_parallel_size=2))
    spec = SpeculativeConfig("ngram", num_speculative_tokens=2)
    assert not async_wanted(replace(cpu, async_scheduling=True, speculative_config=spec))

    from services.engine_args import add_engine_arguments, engine_config_from_args

    p = argparse.ArgumentParser()
    add_engine_arguments(p)
    base = ["--model", "m", "--device", "cpu"]
    assert engine_config_from_args(p.parse_args(base)).async_scheduling is None
    assert engine_config_from_args(p.parse_args(base + ["--async-scheduling"])).async_scheduling is True
    assert engine_config_from_args(p.parse_args(base + ["--no-async-scheduling"])).async_scheduling is False

    from shared.launcher.process_spec import MeshOptions, mesh_services

    def decode_args(**kw):
        return {s.service: s.args for s in mesh_services(MeshOptions(model="m", **kw))}["decode"]
    assert "--no-async-scheduling" in decode_args(async_scheduling=False)
    assert not any("async-scheduling" in a for a in decode_args())
