"""The token-bitmask kernel against its twin under the Triton interpreter, and the twin against xgrammar's layout."""
from __future__ import annotations

import pytest
import torch

from kernels.token_bitmask import apply_token_bitmask_ref, apply_token_bitmask_triton


def _mask(rows: int, vocab: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    words = -(-vocab // 32)
    m = torch.randint(-2**31, 2**31 - 1, (rows, words), generator=g, dtype=torch.int64).to(torch.int32)
    m[0] = -1  # an unconstrained row
    return m


@pytest.mark.parametrize("vocab", [32, 100, 1000, 1057])
def test_triton_matches_the_twin(vocab):
    rows = 3
    logits = torch.randn(rows, vocab)
    mask = _mask(rows, vocab, vocab)
    want, got = logits.clone(), logits.clone()
    apply_token_bitmask_ref(want, mask)
    apply_token_bitmask_triton(got, mask, block=256)
    assert torch.equal(torch.isinf(want), torch.isinf(got)) and torch.equal(want, got)
    assert not torch.isinf(want[0]).any(), "a row of -1 is unconstrained"


def test_bits_mean_tokens_in_xgrammars_layout():
    logits = torch.zeros(1, 70)
    mask = torch.zeros(1, 3, dtype=torch.int32)
    mask[0, 0] = 1 << 5  # token 5
    mask[0, 2] = 1 << 1  # token 65
    apply_token_bitmask_ref(logits, mask)
    assert (~torch.isinf(logits[0])).nonzero().flatten().tolist() == [5, 65]
    xgr = pytest.importorskip("xgrammar")
    ours, theirs = torch.randn(2, 70), None
    theirs = ours.clone()
    m = _mask(2, 70, 1)
    apply_token_bitmask_ref(ours, m)
    xgr.apply_token_bitmask_inplace(theirs, m)
    assert torch.equal(ours, theirs)
