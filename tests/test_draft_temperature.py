"""The draft-temperature suite (benchmarks/suites/draft_temperature.py) on the tiny garden pair: alpha at T = 1 where
the draft proposes at its own temperature, exact, for the job's draft and another."""

import json

import pytest

from benchmarks.suites.draft_temperature import suite_draft_temperature
from benchmarks.suites.trajectory import acceptance, held_out
from distillspec.models.draft_vocab import vocab_size
from distillspec.models.loading import load_pair

from .conftest import garden_overrides


def test_the_suite_scores_each_draft_at_each_temperature(tiny_garden, tmp_path):
    result = suite_draft_temperature(
        garden_overrides(tiny_garden),
        drafts=[str(tiny_garden.target)],
        temperatures=[0.5, 2.0],
        held=3,
        max_new_tokens=6,
        out=tmp_path,
    )
    rows = list(result["drafts"].values())
    assert len(rows) == 2 and all(list(row["alpha"]) == ["0.5", "1.0", "2.0"] for row in rows)
    assert all(0.0 < a <= 1.0 for row in rows for a in row["alpha"].values())
    # the target as its own draft, at its own temperature, is accepted everywhere; any other temperature is not
    assert rows[1]["alpha"]["1.0"] == pytest.approx(1.0, abs=1e-5) and rows[1]["greedy"] == 1.0
    assert rows[1]["alpha"]["0.5"] < 0.999 and rows[1]["alpha"]["2.0"] < 0.999
    assert json.loads((tmp_path / "draft_temperature.json").read_text()) == result
    assert (tmp_path / "draft_temperature.png").stat().st_size > 0


def test_alpha_at_draft_temperature_one_is_alpha(tiny_garden, task):
    target, draft, tokenizer = load_pair(str(tiny_garden.target), str(tiny_garden.draft))
    sets = held_out(target, draft, tokenizer, task.test[:4], max_new_tokens=6, seed=0)
    scored = acceptance(draft, sets, vocab_size(target), draft_temperatures=[1.0, 0.5])
    assert scored["alpha_at"]["1.0"] == pytest.approx(scored["alpha"], abs=1e-7)
    assert scored["alpha_at"]["0.5"] != pytest.approx(scored["alpha"], abs=1e-4)
