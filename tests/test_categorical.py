"""One categorical draw per row (shared/engine/categorical.py): the frequencies follow the weights, a token of
weight 0 is never drawn (also at u = 0 and u just below 1), rows are independent of each other, and a draw takes
exactly one number from its generator."""
from __future__ import annotations

import torch

from shared.engine.categorical import DRAW_DTYPE, sample_rows, uniforms


def test_frequencies_follow_the_weights() -> None:
    w = torch.tensor([0.0, 3.0, 0.0, 1.0, 6.0, 0.0])
    g = torch.Generator().manual_seed(0)
    n = 60_000
    got = sample_rows(w.expand(n, -1), uniforms(n, g, torch.device("cpu")))
    counts = torch.bincount(got, minlength=len(w)).double()
    expected = w.double() / w.sum() * n
    assert counts[w == 0].sum() == 0
    chi2 = float((((counts - expected) ** 2)[w > 0] / expected[w > 0]).sum())
    assert chi2 < 13.8, (counts, expected)  # 2 degrees of freedom: p = 0.001


def test_edges_of_u_draw_tokens_of_positive_weight() -> None:
    w = torch.tensor([[0.0, 0.25, 0.0, 0.75, 0.0], [0.0, 0.0, 1e-30, 0.0, 0.0]])
    below_one = torch.nextafter(torch.tensor(1.0, dtype=DRAW_DTYPE), torch.tensor(0.0, dtype=DRAW_DTYPE))
    for u, want in ((0.0, [1, 2]), (float(below_one), [3, 2]), (0.25, [3, 2]), (0.2499, [1, 2])):
        assert sample_rows(w, torch.full((2,), u, dtype=DRAW_DTYPE)).tolist() == want, u


def test_rows_are_independent_and_one_draw_is_one_number() -> None:
    w = torch.rand(4, 1000, generator=torch.Generator().manual_seed(1))
    u = uniforms(4, torch.Generator().manual_seed(5), torch.device("cpu"))
    together = sample_rows(w, u)
    alone = [int(sample_rows(w[i : i + 1], u[i : i + 1])[0]) for i in range(4)]
    assert together.tolist() == alone
    g = torch.Generator().manual_seed(5)
    uniforms(1, g, torch.device("cpu"))  # one draw skipped
    assert torch.equal(uniforms(3, g, torch.device("cpu")), u[1:])
