"""The gateway, tokenizer and kvstore processes never import torch (issue 9): they load in seconds and
stay small. Checked in a fresh interpreter that also does their real work: load the tokenizer, render a
chat with tools, encode, decode incrementally, build and parse wire messages."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

SCRIPT = """
import sys
import services.gateway.service, services.tokenizer.service, services.kvstore.service
from shared.models.tokenizer import load_tokenizer, encode_chat
from shared.detokenizer import IncrementalDetokenizer
from shared import wire
from shared.protocol.generate import GenerateRequest
from shared.sampling_params import SamplingParams
tok = load_tokenizer(sys.argv[1])
tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}]
ids = encode_chat(tok, [{"role": "user", "content": "hello"}], True, tools)
detok = IncrementalDetokenizer(tok, ids[:3])
text = detok.push(ids[3:]) + detok.flush()
msg = GenerateRequest(request_id="r", prompt_token_ids=ids, sampling=SamplingParams(max_tokens=4, logit_bias={1: 2.0}))
assert wire.decode(wire.encode(msg), GenerateRequest).sampling.logit_bias == {1: 2.0}
assert text and len(ids) > 10
loaded = sorted(m for m in sys.modules if m == "torch" or m.startswith("torch."))
print("TORCH" if loaded else "NO-TORCH")
"""


def test_gateway_tokenizer_and_kvstore_never_import_torch(checkpoints) -> None:
    root = Path(__file__).resolve().parents[1]
    out = subprocess.run([sys.executable, "-c", SCRIPT, str(checkpoints["qwen3"].path)], capture_output=True, text=True,
                         cwd=root, timeout=120, env={"PYTHONPATH": str(root), "PATH": ""})
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().endswith("NO-TORCH")
