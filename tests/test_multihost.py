"""A mesh over three hosts (network namespaces, each its own address): the gateway, tokenizer and kvstore on
host a, a prefill worker on host b, a decode worker on host c, each host with its own nats-server routed into
one cluster. A prompt prefilled on b is decoded on c with its KV pushed over TCP between the hosts, and the
tokens are transformers' (what a single-host mesh answers)."""
from __future__ import annotations

import stat
import time

import openai
import pytest

from shared.models.tokenizer import load_tokenizer
from tests.checkpoints import build_checkpoint
from tests.netns_hosts import NetnsHosts, available
from shared.launcher.join import JOINED
from tests.netns_mesh import MultiHostMesh

pytestmark = pytest.mark.skipif(available() is not None, reason=f"no network namespaces: {available()}")

MAX_NEW = 8


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return build_checkpoint("llama", tmp_path_factory.mktemp("multihost") / "llama")


@pytest.fixture(scope="module")
def mesh(llama, tmp_path_factory):
    with NetnsHosts(3) as hosts:
        m = MultiHostMesh(hosts, llama.path, tmp_path_factory.mktemp("multihost-mesh"))
        try:
            m.start_first("a", "--nats-tls")  # the joining hosts sign their certificates with the mesh's CA
            joining = [m.join("b", 0, 1, wait=False), m.join("c", 1, 0, "--remote-prefill-threshold", "0", wait=False)]
            for lines in joining:
                lines.wait_for(JOINED, timeout=60)
            m.wait_ready({"decode-c_0"})
            m.wait_worker("prefill-b_0")
            yield m
        except BaseException:
            print(m.output())
            raise


def test_multihost_prefill_on_one_host_decode_on_another(mesh, llama, hf_reference) -> None:
    client = openai.OpenAI(base_url=f"{mesh.url}/v1", api_key="unused", max_retries=0, timeout=60)
    model = client.models.list().data[0].id
    tokenizer = load_tokenizer(llama.path)
    for prompt in ([5 + (i * 7) % 200 for i in range(45)], [9 + (i * 13) % 180 for i in range(70)]):
        tokens, _ = hf_reference(llama, prompt, MAX_NEW)
        r = client.completions.create(model=model, prompt=prompt, max_tokens=MAX_NEW, temperature=0)
        assert (r.choices[0].text, r.usage.completion_tokens) == (tokenizer.decode(tokens, skip_special_tokens=True),
                                                                  len(tokens))
    # The prompts were prefilled on b and their KV went to c over TCP, between the hosts' own addresses: the
    # prefill worker's connection to the decode worker's KV channel is there on c (shared memory never
    # crosses hosts, and NATS is only the fallback).
    deadline = time.monotonic() + 20  # the count rides on the prefill worker's next load beat
    while mesh.metric("kvmesh:kv_pushes_total", worker="prefill-b_0") < 2:
        assert time.monotonic() < deadline, mesh.output()
        time.sleep(0.2)
    b, c = mesh.hosts["b"].address, mesh.hosts["c"].address
    kv_links = [(local, peer) for local, peer, proc in mesh.hosts["c"].tcp_peers()
                if local.startswith(c + ":") and peer.startswith(b + ":") and "python" in proc]
    assert kv_links, mesh.hosts["c"].tcp_peers()
    # The join file holds the mesh secret and the route URLs, no process's password, readable by its owner only.
    text = mesh.join_file.read_text()
    assert stat.S_IMODE(mesh.join_file.stat().st_mode) == 0o600
    assert "password" not in text and mesh.hosts["a"].address in text
    assert "one user per process, subject permissions, TLS" in mesh.output()
    assert "Violation" not in mesh.output()
