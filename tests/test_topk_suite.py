"""The top-k suite (benchmarks/suites/topk.py) on the tiny garden pair: the divergences with the target's top k are
lower bounds of the full ones, equal to them when k is the whole vocabulary."""

import json

import pytest

from benchmarks.suites.topk import suite_topk
from distillspec.models.loading import load_tokenizer

from .conftest import garden_overrides


def test_the_topk_suite_bounds_each_divergence_from_below(tiny_garden, tmp_path):
    vocab = len(load_tokenizer(str(tiny_garden.target)))
    overrides = garden_overrides(tiny_garden)
    result = suite_topk(overrides, [1, 4, vocab], batches=1, out=tmp_path)
    for name, row in result["divergence"].items():
        assert row["full"] > 0, name
        assert row[str(vocab)] == pytest.approx(row["full"], rel=1e-4, abs=1e-6), name  # all of it: exact
        assert row["1"] <= row["4"] + 1e-6 and row["4"] <= row["full"] + 1e-6, name  # coarser, lower
    assert result["batch_mib"]["1"] < result["batch_mib"]["full"]
    assert json.loads((tmp_path / "topk.json").read_text())["divergence"].keys() == result["divergence"].keys()
    assert "| tvd |" in (tmp_path / "topk.md").read_text()
