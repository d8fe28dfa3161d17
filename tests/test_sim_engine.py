"""The simulated engine (`--engine sim`, issue 25): the real scheduler, block manager and bus protocol with a
cost model in place of the forward pass. Checked here: profiles load or fail clearly, the step waits what
the cost model says, tokens are the documented function of the sequence end to end through a real mesh
(gateway, tokenizer, decode and prefill workers over a real nats-server, the real openai client), KV
pushes carry the right block count, and a real engine refuses their placeholder contents."""
from __future__ import annotations

import json

import pytest
import torch

from services.decode.service import DecodeService, DecodeSettings
from services.prefill.service import PrefillService, PrefillSettings
from shared.engine.kv_cache import write_blocks
from shared.engine.kv_placeholder import PLACEHOLDER_MESSAGE, placeholder_kv
from shared.engine.sim_engine import SimEngine, expected_tokens
from shared.engine.sim_profile import DEFAULT_PROFILE, CostModel, ProfileError, StepShape, load_profile
from shared.sampling_params import SamplingParams
from tests.checkpoints import EOS, VOCAB, build_checkpoint
from tests.gateway_harness import Mesh, openai_client
from tests.mesh_helpers import engine_config

FAST = {"base_s": 0.002, "prefill_token_s": 1e-6, "prefill_attention_s": 0.0, "decode_seq_s": 1e-4,
        "decode_context_token_s": 1e-7}


def profile_dict(**step: float) -> dict:
    return {"format": "kvmesh-sim-profile/1", "name": "test", "source": "written by the test", "hardware": "none",
            "model": "tiny", "kv_tokens": 4096, "step": {**FAST, **step}}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):  # noqa: ANN001, ANN201
    return build_checkpoint("llama", tmp_path_factory.mktemp("sim") / "llama").path


@pytest.fixture
def cost(tmp_path) -> CostModel:  # noqa: ANN001
    path = tmp_path / "p.json"
    path.write_text(json.dumps(profile_dict()))
    return CostModel(load_profile(path))


def test_shipped_profile_loads_and_predicts_in_gpu_ranges() -> None:
    c = CostModel(load_profile(DEFAULT_PROFILE))
    assert 0.05 < c.prefill_s(4096, chunk=1024) < 1.0  # a 4k prompt on an H100: a fraction of a second
    assert 0.005 < c.decode_step_s(64, 1024) < 0.05
    assert CostModel(c.profile, speed=2.0).decode_step_s(64, 1024) == pytest.approx(c.decode_step_s(64, 1024) / 2)


@pytest.mark.parametrize("text, needle", [
    ("{not json", "is not JSON"),
    (json.dumps({**profile_dict(), "format": "other/1"}), "format must be"),
    (json.dumps({k: v for k, v in profile_dict().items() if k != "step"}), "step"),
    (json.dumps(profile_dict(base_s=-1.0)), "step.base_s"),
    (json.dumps({**profile_dict(), "kv_tokens": 0}), "kv_tokens"),
    (json.dumps({**profile_dict(), "surprise": 1}), "surprise"),
])
def test_bad_profiles_fail_naming_the_file_and_field(tmp_path, text: str, needle: str) -> None:  # noqa: ANN001
    path = tmp_path / "bad.json"
    path.write_text(text)
    with pytest.raises(ProfileError, match=needle) as e:
        load_profile(path)
    assert str(path) in str(e.value)
    with pytest.raises(ProfileError, match="cannot read"):
        load_profile(tmp_path / "missing.json")


def test_step_time_is_the_cost_models(cost: CostModel) -> None:
    shape = StepShape(prefill_tokens=100, prefill_attention=5000, decode_seqs=3, decode_context_tokens=300)
    assert cost.step_s(shape) == pytest.approx(0.002 + 100e-6 + 3e-4 + 300e-7)
    with pytest.raises(ProfileError, match="speed"):
        CostModel(cost.profile, speed=0)


def test_sim_engine_generates_the_documented_tokens_and_keeps_the_prefix_cache(model_dir, cost) -> None:  # noqa: ANN001
    engine = SimEngine(engine_config(model_dir, num_kv_blocks=64), cost)
    prompts = [list(range(5, 105)), list(range(5, 105)), [7, 9, 11]]
    outs = [engine.generate([p], SamplingParams(max_tokens=9), use_tqdm=False)[0] for p in prompts]
    for prompt, out in zip(prompts, outs):
        assert out.output_token_ids == expected_tokens(prompt, 9, VOCAB, [EOS])
        assert out.finish_reason == "length"
    # The second copy of the 100-token prompt found its first 6 blocks in the (real) prefix cache.
    assert engine.stats().prefix_cache_hits >= 96
    assert engine.executor.num_steps >= 9 and engine.executor.busy_s >= 9 * 0.002
    engine.check_integrity()
    assert engine.block_manager.num_free_blocks == 64


def test_sim_engine_refuses_what_it_cannot_simulate(model_dir, cost) -> None:  # noqa: ANN001
    engine = SimEngine(engine_config(model_dir, num_kv_blocks=16), cost)
    with pytest.raises(ValueError, match="logprobs"):
        engine.validate([1, 2, 3], SamplingParams(max_tokens=2, logprobs=1))
    with pytest.raises(ValueError, match="KV blocks"):
        engine.validate([1, 2, 3], SamplingParams(max_tokens=2000))


def test_a_real_kv_cache_refuses_placeholder_blocks() -> None:
    caches = [(torch.zeros(4, 16, 1, 1), torch.zeros(4, 16, 1, 1))]  # even one shaped like the placeholders
    with pytest.raises(ValueError, match="simulated engine"):
        write_blocks(caches, [0], *placeholder_kv(1, 16))
    assert "real engine refuses" in PLACEHOLDER_MESSAGE


def _sim_decoder(model_dir, cost: CostModel, worker_id: str) -> DecodeService:  # noqa: ANN001
    d = DecodeService(engine_config(model_dir, num_kv_blocks=256), DecodeSettings(
        worker_id=worker_id, remote_prefill_threshold=0, use_kvstore=False, remote_prefill_timeout_s=10.0,
        kv_transfer_timeout_s=10.0, beat_interval_s=0.2, direct_kv=False))
    d.engine_factory = lambda config: SimEngine(config, cost)
    return d


def _sim_prefill(model_dir, cost: CostModel) -> PrefillService:  # noqa: ANN001
    p = PrefillService(engine_config(model_dir, num_kv_blocks=256, long_prefill_token_threshold=32),
                       PrefillSettings(worker_id="sim-p0", use_kvstore=False))
    p.engine_factory = lambda config: SimEngine(config, cost)
    return p


def _add(mesh: Mesh, service, user: str) -> None:  # noqa: ANN001
    async def go() -> None:
        await service.start(await mesh._connect(user))
    mesh.call(go(), timeout=60)


def test_sim_mesh_streams_the_documented_tokens_with_remote_prefill(tmp_path, model_dir, cost) -> None:  # noqa: ANN001
    from shared.models.tokenizer import load_tokenizer

    mesh = Mesh(tmp_path, model_dir)
    try:
        mesh.start_tokenizer()
        decoders = [_sim_decoder(model_dir, cost, w) for w in ("s0", "s1")]
        for d in decoders:
            _add(mesh, d, "harness")
            mesh.decoders[d.settings.worker_id] = d
        prefill = _sim_prefill(model_dir, cost)
        _add(mesh, prefill, "harness")
        mesh.prefills.append(prefill)
        mesh.wait_until(lambda: len(mesh.gateway.ctx.router.alive()) == 2)
        client = openai_client(mesh)
        tok = load_tokenizer(str(model_dir))
        for i in range(4):
            prompt = [(7 * i + j) % 400 + 3 for j in range(90)]  # 90 tokens: 5 full blocks pushed, 1 partial
            r = client.completions.create(model="tiny", prompt=prompt, max_tokens=12, temperature=0)
            want = expected_tokens(prompt, 12, VOCAB, [EOS])
            assert r.usage.completion_tokens == 12
            assert r.choices[0].text == tok.decode(want)
        assert sum(d.remote_prefills for d in decoders) == 4  # every prompt's KV came from the prefill worker
        assert sum(d.remote_fallbacks for d in decoders) == 0
        assert prefill.kv_push.bytes > 0
    finally:
        mesh.close()


def test_a_real_decode_worker_refuses_a_simulated_prefills_kv(tmp_path, model_dir, cost) -> None:  # noqa: ANN001
    """The placeholder flag on the wire: the real worker refuses the push and computes the prompt itself."""
    mesh = Mesh(tmp_path, model_dir)
    try:
        mesh.start_tokenizer()
        real = mesh.start_decoder("r0", threshold=0, num_kv_blocks=128)
        prefill = _sim_prefill(model_dir, cost)
        _add(mesh, prefill, "harness")
        mesh.prefills.append(prefill)
        mesh.wait_until(lambda: len(mesh.gateway.ctx.router.alive()) == 1)
        client = openai_client(mesh)
        prompt = [(5 * j) % 400 + 3 for j in range(70)]
        r = client.completions.create(model="tiny", prompt=prompt, max_tokens=6, temperature=0)
        assert r.usage.completion_tokens == 6
        assert real.remote_fallbacks == 1 and real.remote_prefills == 0
        assert r.choices[0].text  # the real model's tokens, computed locally after the refusal
    finally:
        mesh.close()


def test_the_profile_fit_recovers_known_coefficients() -> None:
    from loadtest.sim_profile import fit

    true = {"base_s": 0.003, "prefill_token_s": 2e-5, "prefill_attention_s": 1e-9, "decode_seq_s": 5e-4,
            "decode_context_token_s": 2e-7}
    shapes = [StepShape(prefill_tokens=n, prefill_attention=n * n // 2) for n in (64, 256, 1024, 2048)]
    shapes += [StepShape(decode_seqs=b, decode_context_tokens=b * c) for b in (1, 4, 16) for c in (128, 512)]
    truth = CostModel(load_profile(DEFAULT_PROFILE).model_copy(update={"step": type(load_profile(DEFAULT_PROFILE).step)(**true)}))
    coef, err = fit([(s, truth.step_s(s)) for s in shapes])
    assert err < 1e-6
    for k, v in true.items():
        assert coef[k] == pytest.approx(v, rel=1e-4)


def test_a_drained_decode_worker_moves_its_requests_and_none_is_lost(tmp_path, model_dir) -> None:  # noqa: ANN001
    """What the planner's scale-in relies on: a worker drained with requests still running ends them with
    MOVE_ELSEWHERE after its grace period, the gateway continues each on another worker, and the client's
    stream is whole (the simulated tokens continue exactly, so the text is the undisturbed run's)."""
    import threading

    from shared.models.tokenizer import load_tokenizer

    slow = tmp_path / "slow.json"
    slow.write_text(json.dumps(profile_dict(base_s=0.03)))
    cost = CostModel(load_profile(slow))
    mesh = Mesh(tmp_path, model_dir)
    try:
        mesh.start_tokenizer()
        decoders = [_sim_decoder(model_dir, cost, w) for w in ("s0", "s1")]
        for d in decoders:
            d.settings.remote_prefill_threshold = 1 << 30  # no prefill worker here
            _add(mesh, d, "harness")
            mesh.decoders[d.settings.worker_id] = d
        mesh.wait_until(lambda: len(mesh.gateway.ctx.router.alive()) == 2)
        client = openai_client(mesh)
        tok = load_tokenizer(str(model_dir))
        prompts = [[(11 * i + j) % 400 + 3 for j in range(40)] for i in range(4)]
        texts: dict[int, str] = {}

        def ask(i: int) -> None:
            r = client.completions.create(model="tiny", prompt=prompts[i], max_tokens=60, temperature=0)
            texts[i] = r.choices[0].text

        threads = [threading.Thread(target=ask, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        mesh.wait_until(lambda: all(len(d.requests) for d in decoders), timeout=20)
        mesh.wait_until(lambda: mesh.call(decoders[0].thread.call(
            lambda e: max((s.num_output_tokens for s in e.scheduler.sequences()), default=0))) >= 5, timeout=20)
        moved = len(decoders[0].requests)
        mesh.call(decoders[0].drain(0.1), timeout=30)  # the planner's SIGTERM, with a short grace
        mesh.decoders.pop("s0")  # drained: released its subscriptions and engine
        for t in threads:
            t.join(timeout=60)
        assert moved >= 1
        assert mesh.gateway.ctx.metrics.migrations.labels(mesh.gateway.ctx.metrics.model)._value.get() >= moved
        for i in range(4):
            assert texts[i] == tok.decode(expected_tokens(prompts[i], 60, VOCAB, [EOS]))
    finally:
        mesh.close()


def test_every_shipped_profile_loads() -> None:
    from shared.engine.sim_profile import PROFILES_DIR

    names = sorted(p.name for p in PROFILES_DIR.glob("*.json"))
    assert "h100_llama3_8b.json" in names and "cpu_demo_model.json" in names
    for p in PROFILES_DIR.glob("*.json"):
        assert CostModel(load_profile(p)).decode_step_s(8, 512) > 0
