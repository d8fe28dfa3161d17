"""After the engine's start-up warm-up, serving launches no Triton kernel variant that was not compiled yet.

Triton compiles a variant per distinct binding of a kernel's arguments (types, constexprs, integers of 1 or
divisible by 16, pointer alignment); a compile blocks the engine thread for a second or more. Under
kernels/aot.py's LaunchRecorder (every launch bound as Triton binds it, the twins computing), the variants
the engine's start-up records must cover every step of serving: decode contexts of many lengths (so many
split counts and block-table widths), chunked prompts beside decodes, prompt logprobs, structured output,
decode-graph steps at several batch buckets."""
from __future__ import annotations

import pytest

from kernels.aot import LaunchRecorder
from shared.sampling_params import SamplingParams, StructuredOutput
from tests.engine_helpers import make_engine, random_prompts

# Every kernel the engine launches (store_kv and rotary alone are fused into _qk_rope_store_kernel).
EVERY_KERNEL = {"_qk_rope_store_kernel", "_rms_norm_kernel", "_silu_mul_kernel", "_extend_kernel",
                "_decode_split_kernel", "_decode_reduce_kernel", "_apply_bitmask_kernel"}


@pytest.mark.parametrize("arch,graphs", [("qwen3", False), ("mistral", True)])
def test_serving_after_warm_up_compiles_nothing_new(checkpoints, arch, graphs):
    with LaunchRecorder() as rec:
        engine = make_engine(checkpoints[arch], max_num_batched_tokens=48, max_num_seqs=16)
        warm = set(rec.variants)
        assert rec.kernels() == EVERY_KERNEL, "the warm-up launches every kernel"
        if graphs:  # the decode-graph path (static padded buffers), run eagerly as on CPU it is
            engine.runner.use_decode_graphs(engine.max_model_len, 16, capture=False)
        lengths = [1, 2, 15, 16, 17, 31, 70, 130, 5, 200, 47, 9]
        params = [SamplingParams(max_tokens=3 + i % 5, temperature=0.0, ignore_eos=True) for i in range(len(lengths))]
        params[3] = SamplingParams(max_tokens=4, temperature=0.0, prompt_logprobs=3, ignore_eos=True)
        params[5] = SamplingParams(max_tokens=6, temperature=0.8, seed=1, top_p=0.9, logprobs=2)
        params[8] = SamplingParams(max_tokens=5, structured=StructuredOutput(kind="choice", spec='["yes", "no"]'))
        outs = engine.generate(random_prompts(lengths, seed=4), params, use_tqdm=False)
        assert all(o.output_token_ids for o in outs)
        assert sum(rec.variants.values()) > 100
        new = [v.label() for v in rec.variants if v not in warm]
        assert not new, "serving compiled new variants:\n" + "\n".join(new)
