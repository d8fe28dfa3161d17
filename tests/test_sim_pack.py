"""Several simulated workers in one process (`kvmesh up --engine sim --sim-workers-per-process K`, issue 25):
through a real `kvmesh up` on its locked-down bus (one NATS user per worker), each packed worker beats under
its own id, takes remote prefills and decodes, and the tokens are the documented simulated ones end to end
through the real openai client. The slow test runs the 64 decode + 16 prefill mesh of the scale benchmark."""
from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from loadtest.sim_mesh import SimMesh
from loadtest.sim_model import build_sim_model
from shared.engine.sim_engine import expected_tokens
from shared.launcher.process_spec import MeshOptions, mesh_services


@pytest.fixture(scope="module")
def sim_model(tmp_path_factory):  # noqa: ANN001, ANN201
    return build_sim_model(tmp_path_factory.mktemp("simpack") / "model")


def _check_tokens(mesh: SimMesh, model, n: int, prompt_len: int) -> None:  # noqa: ANN001
    import openai

    from shared.models.tokenizer import load_tokenizer

    cfg = json.loads((model / "config.json").read_text())
    tok = load_tokenizer(str(model))
    # Retries as a real client makes them: on a loaded machine the gateway may refuse a request with 429 and
    # Retry-After while its own input lags (--max-input-lag), which is its overload rule, not this test's subject.
    client = openai.OpenAI(base_url=f"{mesh.base}/v1", api_key="unused", max_retries=5, timeout=120)

    def one(i: int) -> None:
        prompt = [(13 * i + 7 * j) % 1500 + 10 for j in range(prompt_len)]
        r = client.completions.create(model="sim", prompt=prompt, max_tokens=10, temperature=0)
        assert r.usage.completion_tokens == 10
        assert r.choices[0].text == tok.decode(expected_tokens(prompt, 10, cfg["vocab_size"], cfg["eos_token_id"]),
                                                   skip_special_tokens=True)

    with ThreadPoolExecutor(16) as pool:
        list(pool.map(one, range(n)))


def test_spec_packs_simulated_workers_and_refuses_packing_real_ones() -> None:
    opts = MeshOptions(engine="sim", decode=5, prefill=2, sim_workers_per_process=2)
    procs = {s.service: s.processes("python", {}) for s in mesh_services(opts)}
    assert [p.members for p in procs["decode"]] == [("decode-0", "decode-1"), ("decode-2", "decode-3"), ("decode-4",)]
    assert [p.name for p in procs["prefill"]] == ["prefill-pack-0"]
    assert procs["decode"][2].argv[-2:] == ("--worker-ids", "decode-4")
    assert [p.members for p in procs["gateway"]] == [()]  # only engine workers are packed
    with pytest.raises(AssertionError, match="simulated"):
        MeshOptions(decode=2, sim_workers_per_process=2)


def test_packed_sim_workers_serve_under_their_own_identities(sim_model) -> None:  # noqa: ANN001
    with SimMesh(sim_model, decode=6, prefill=2, per_process=3, extra=["--remote-prefill-threshold", "0"]) as mesh:
        assert sorted(n for n in mesh.pids if "pack" in n) == ["decode-pack-0", "decode-pack-1", "prefill-pack-0"]
        workers = mesh.workers(httpx.get(f"{mesh.base}/metrics", timeout=10).text)
        assert workers == {"decode": {f"decode-{i}" for i in range(6)}, "prefill": {"prefill-0", "prefill-1"}}
        _check_tokens(mesh, sim_model, n=24, prompt_len=70)
        metrics = httpx.get(f"{mesh.base}/metrics", timeout=10).text
        busy = {m[1] for line in metrics.splitlines()
                if (m := re.search(r'^kvmesh:prefix_cache_queries_total\{[^}]*worker="(decode-\d)"\} (\d+)', line))
                and float(m[2]) > 0}
        assert len(busy) >= 3, busy  # the router spread the requests over workers in both packs
        assert "one user per process, subject permissions" in "\n".join(mesh.lines)
        assert not any("Violation" in line for line in mesh.lines)
        assert mesh.stop() == 0, "\n".join(mesh.lines[-30:])


@pytest.mark.slow
def test_a_64_decode_16_prefill_sim_mesh_serves(sim_model) -> None:  # noqa: ANN001
    with SimMesh(sim_model, decode=64, prefill=16, per_process=16,
                 extra=["--remote-prefill-threshold", "0"]) as mesh:
        workers = mesh.workers(httpx.get(f"{mesh.base}/metrics", timeout=10).text)
        assert len(workers["decode"]) == 64 and len(workers["prefill"]) == 16
        assert len([n for n in mesh.pids if "pack" in n]) == 5
        _check_tokens(mesh, sim_model, n=128, prompt_len=40)
        assert not any("Violation" in line for line in mesh.lines)
        assert mesh.stop() == 0, "\n".join(mesh.lines[-30:])
