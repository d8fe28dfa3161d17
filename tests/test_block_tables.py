"""Block tables kept across steps (shared/engine/block_tables.py): rows follow appends incrementally, a
replaced list (preemption, re-admission) is copied again, rows come back when sequences go; and streamed
outputs carry only what a stream sends."""
from __future__ import annotations

import gc

import torch

from shared.engine.block_tables import BlockTables
from shared.engine.sequence import Sequence
from shared.sampling_params import SamplingParams
from tests.engine_helpers import greedy, make_engine, random_prompts


def _seq(name: str, blocks: list[int]) -> Sequence:
    s = Sequence(name, [1, 2, 3], SamplingParams())
    s.block_table = blocks
    return s


def test_rows_follow_appends_and_replaced_lists():
    bt = BlockTables(max_blocks=4, rows=1)
    a, b = _seq("a", [7, 3]), _seq("b", [9])
    ra, rb = bt.sync(a, 2), bt.sync(b, 1)
    assert ra != rb and bt.table.shape[0] >= 2  # grew for the second sequence
    a.block_table.append(11)
    bt.sync(a, 3)
    a.block_table += [12, 13, 14]  # past the initial width: widens
    bt.sync(a, 6)
    assert bt.gather([ra, rb], 6)[0].tolist() == [7, 3, 11, 12, 13, 14]
    a.block_table = [5]  # freed and reallocated (preemption): a new list, copied from the start
    assert bt.sync(a, 1) == ra and bt.gather([ra], 1).tolist() == [[5]]
    free = len(bt.free_rows)
    del a
    gc.collect()
    assert len(bt.free_rows) == free + 1, "a finished sequence's row comes back"


def test_engine_steps_with_preemption_match_fresh_tables(checkpoints):
    # Few blocks: preemption frees and reallocates tables; every step's decode table equals the sequences' lists.
    engine = make_engine(checkpoints["llama"], num_kv_blocks=24, max_num_batched_tokens=64)
    seen = []
    build = engine.runner.build

    def checked(plan, rows, *fed):
        out = build(plan, rows, *fed)
        meta = out[2]
        decodes = [s for s, n in plan if n == 1]
        for seq, row in zip(decodes, meta.decode_block_tables):
            n = -(-(seq.num_computed_tokens + 1) // 16)
            assert row[:n].tolist() == seq.block_table[:n]
        seen.append(len(decodes))
        return out

    engine.runner.build = checked
    outs = engine.generate(random_prompts([30, 45, 60, 20, 70], seed=5), greedy(40, None), use_tqdm=False)
    assert all(len(o.output_token_ids) == 40 for o in outs) and max(seen) > 1
    assert engine.stats().num_preemptions > 0


def test_streamed_outputs_carry_only_what_is_sent(checkpoints):
    engine = make_engine(checkpoints["qwen3"])
    prompt = random_prompts([20])[0]
    engine.add_request("r", prompt, greedy(6, logprobs=2))
    streamed = []
    while engine.has_unfinished_requests():
        streamed += engine.step()
    *running, last = streamed
    assert all(o.output_token_ids == [] and o.prompt_token_ids == [] and len(o.logprobs) == 1 for o in running)
    assert last.finished and last.prompt_token_ids == prompt and len(last.output_token_ids) == 6
    assert [t for o in streamed for t in o.new_token_ids] == last.output_token_ids
    assert [lp for o in running for lp in o.logprobs] == last.logprobs[:-1]
    assert torch.tensor([lp.logprob for lp in last.logprobs]).isfinite().all()
