"""The calibrated 4-bit writers (tests/quant_calibrate.py) on tiny real checkpoints: AWQ's scales folded into the
previous ops leave the float model's function unchanged (MHA, where v -> o is folded too, and GQA); the AWQ and
GPTQ checkpoints they write load through the real loader, serve what their format defines, and come closer to the
float model than rounding to nearest does. The real SmolLM2 figures: tests/test_quant_smollm2.py (slow)."""
from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from shared.sampling_params import SamplingParams
from tests import quant_calibrate as cq
from tests import quant_checkpoints as qc
from tests.checkpoints import build_checkpoint
from tests.engine_helpers import make_engine, random_prompts

GROUP = 32
CALIBRATION = random_prompts([64, 64, 48], seed=11)
PROMPTS = random_prompts([40, 24], seed=12)


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):  # noqa: ANN001, ANN201
    root = tmp_path_factory.mktemp("calib")
    return {"gqa": build_checkpoint("llama", root / "gqa", hidden_size=128, intermediate_size=256),
            "mha": build_checkpoint("llama", root / "mha", hidden_size=128, intermediate_size=256,
                                    num_key_value_heads=4)}


@torch.no_grad()
def _logits(model: torch.nn.Module, prompts: list[list[int]]) -> torch.Tensor:
    return torch.cat([model(torch.tensor([p])).logits[0] for p in prompts])


@pytest.mark.parametrize("kind", ["gqa", "mha"])
def test_awq_scales_fold_without_changing_the_float_model(ckpts, kind) -> None:
    ckpt = ckpts[kind]
    model = cq.load_float_model(ckpt.path)
    tensors = qc.read_tensors(ckpt.path)
    folded = cq.awq_float_weights(tensors, cq.calibrate(model, CALIBRATION), GROUP, clip=False)
    changed = [k for k in tensors if not torch.equal(tensors[k], folded[k])]
    assert any("input_layernorm" in k for k in changed) and any("post_attention_layernorm" in k for k in changed)
    assert any("o_proj" in k for k in changed) == (kind == "mha"), changed  # v -> o only when they are square
    before = _logits(model, PROMPTS)
    model.load_state_dict(folded, strict=False)
    torch.testing.assert_close(_logits(model, PROMPTS), before, rtol=1e-4, atol=1e-4)


def _served_logprobs(path: Path) -> torch.Tensor:
    engine = make_engine(SimpleNamespace(path=path), dtype="float32", device="cpu")
    outs = engine.generate(CALIBRATION, SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)
    return torch.tensor([p.logprob for out in outs for p in out.prompt_logprobs[1:]])


def _oracle_logprobs(src: Path, out: Path, method: str) -> torch.Tensor:
    """The float model with the written checkpoint's weights as its format defines them (and its norms)."""
    model = cq.load_float_model(src)
    t = qc.read_tensors(out)
    state = {k: v.float() for k, v in t.items() if k in model.state_dict()}
    for proj in {k.rsplit(".", 1)[0] for k in t if k.endswith(".qweight")}:
        state[f"{proj}.weight"] = (qc.dequant_awq(t[f"{proj}.qweight"], t[f"{proj}.qzeros"], t[f"{proj}.scales"], GROUP)
                                   if method == "awq" else
                                   qc.dequant_gptq(t[f"{proj}.qweight"], t[f"{proj}.qzeros"], t[f"{proj}.scales"],
                                                   t[f"{proj}.g_idx"]))
    model.load_state_dict(state, strict=False)
    lps = []
    with torch.no_grad():
        for p in CALIBRATION:
            logits = torch.log_softmax(model(torch.tensor([p])).logits[0, :-1].float(), -1)
            lps.append(logits.gather(1, torch.tensor(p[1:])[:, None])[:, 0])
    return torch.cat(lps)


@pytest.mark.slow  # minutes on two busy cores
def test_calibrated_checkpoints_serve_their_format_and_beat_round_to_nearest(ckpts, tmp_path) -> None:
    """On the calibration text (what the searches minimise over: random weights and tokens have no outlier
    channels for AWQ to find, nor a low-rank input for GPTQ to exploit beyond it), all on the same asymmetric grid."""
    src = ckpts["gqa"].path
    full = _served_logprobs(src)
    written = {
        "rtn": qc.write_quantized(src, tmp_path / "rtn", "awq", qc.awq_config(GROUP), group=GROUP),
        "awq": cq.write_awq(src, tmp_path / "awq", CALIBRATION, GROUP),
        "gptq": cq.write_gptq(src, tmp_path / "gptq", CALIBRATION, GROUP, sym=False),
        "gptq act order": cq.write_gptq(src, tmp_path / "gptq-act", CALIBRATION, GROUP, sym=False, act_order=True),
    }
    err = {}
    for name, path in written.items():
        served = _served_logprobs(path)
        torch.testing.assert_close(served, _oracle_logprobs(src, path, "gptq" if "gptq" in name else "awq"),
                                   rtol=1e-3, atol=1e-3)
        err[name] = (served - full).abs().mean().item()
    print({k: round(v, 5) for k, v in err.items()})
    assert all(err[k] < err["rtn"] for k in ("awq", "gptq", "gptq act order")), err
