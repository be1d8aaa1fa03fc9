"""The prompt-cache suite (benchmarks/suites/prompt_cache.py) on the tiny garden pair: prompts sharing their worked
examples, each decoder with and without a prompt cache, the same text from both."""

import json

from benchmarks.suites.prompt_cache import suite_prompt_cache

from .conftest import garden_overrides


def test_the_suite_races_each_decoder_with_and_without_a_cache_to_the_same_text(tiny_garden, tmp_path):
    result = suite_prompt_cache(
        garden_overrides(tiny_garden), shots=4, prompts=2, gamma=3, temperature=0.0, max_new_tokens=8, out=tmp_path
    )
    assert result["config"]["shared_tokens"] >= 32 and result["same_text"] == 2
    rows = {(r["decoder"], r["prompt_cache"]): r for r in result["rows"]}
    assert set(rows) == {(d, c) for d in ("target alone", "SD") for c in (False, True)}
    assert all(r["tokens_per_s"] > 0 and r["ttft_s"] > 0 for r in rows.values())
    assert all(0 <= r["alpha"] <= 1 and 1 <= r["tau"] <= 4 for (d, _), r in rows.items() if d == "SD")
    assert json.loads((tmp_path / "prompt_cache.json").read_text()) == result
    assert "tokens/s over the target alone without a cache" in (tmp_path / "prompt_cache.md").read_text()
