"""`kvmesh bench serve --endpoint embeddings`: its flags route to the embeddings benchmark, which needs the
served checkpoint for its in-process comparison (the measurement itself runs against a real mesh by hand:
its figures are in docs/benchmarks.md)."""
from __future__ import annotations

from loadtest.cli import main
from loadtest.serve.embeddings import _cos, texts_of


def test_embeddings_bench_needs_the_reference_model(capsys) -> None:
    assert main(["bench", "serve", "--endpoint", "embeddings", "--model", "m"]) == 2
    assert "--reference-model" in capsys.readouterr().out


def test_embeddings_bench_texts() -> None:
    a, b = texts_of(5, 12, seed=3), texts_of(5, 12, seed=3)
    assert a == b and len(a) == 5 and all(len(t.split()) == 12 for t in a)
    assert texts_of(5, 12, seed=4) != a
    assert abs(_cos([1.0, 0.0], [2.0, 0.0]) - 1) < 1e-12 and _cos(None, [1.0]) is None
