"""The long-prompt suite (benchmarks/suites/long_prompts.py) on the tiny garden pair: the target alone and speculative
decoding with the draft reading the whole prompt or its last tokens, the same greedy text from each."""

import json

from benchmarks.suites.long_prompts import suite_long_prompts

from .conftest import garden_overrides


def test_the_suite_races_each_draft_context_and_keeps_the_targets_greedy_text(tiny_garden, tmp_path):
    result = suite_long_prompts(
        garden_overrides(tiny_garden),
        shots=3,
        prompts=2,
        draft_contexts=[None, 6],
        gamma=3,
        temperatures=[0.0, 1.0],
        max_new_tokens=8,
        out=tmp_path,
    )
    assert result["greedy_first_differences"] == {}  # float32: every decoder gives the target's greedy text
    assert min(result["config"]["prompt_tokens"]) > 6  # the draft's context is shorter than the prompts
    rows = {(r["temperature"], r["decoder"], r["draft_context"]): r for r in result["rows"]}
    assert set(rows) == {(t, d, c) for t in (0.0, 1.0) for d, c in (("target alone", None), ("SD", None), ("SD", 6))}
    assert all(r["tokens_per_s"] > 0 for r in rows.values())
    assert all(0 <= r["alpha"] <= 1 and 1 <= r["tau"] <= 4 for r in rows.values() if r["decoder"] == "SD")
    assert json.loads((tmp_path / "long_prompts.json").read_text()) == result
    table = (tmp_path / "long_prompts.md").read_text()
    assert "its last 6 tokens" in table and "every decoder gave the target alone's tokens" in table
