"""The sampler suite (benchmarks/suites/sampler.py) on the tiny garden pair: both samplers decode, each timed, and
the decoders get their own sampler back afterwards."""

import json

from benchmarks.suites.sampler import MULTINOMIAL, SAMPLERS, suite_sampler
from distillspec.decoding import speculative

from .conftest import garden_overrides


def test_the_suite_times_both_samplers_in_every_decoder(tiny_garden, tmp_path):
    own = speculative.sample
    result = suite_sampler(garden_overrides(tiny_garden), prompts=2, max_new_tokens=5, gamma=3, repeats=1, out=tmp_path)
    assert speculative.sample is own
    assert [r["vocab"] for r in result["draw_ms"]] == [32_768, 151_936, 32_768, 151_936]
    assert all(r[name] > 0 for r in result["draw_ms"] for name in [*SAMPLERS, MULTINOMIAL])
    rows = {(r["decoder"], r["sampler"]): r for r in result["decoders"]}
    assert set(rows) == {(d, s) for d in ("alone", "sd") for s in SAMPLERS}
    for (decoder, _), row in rows.items():
        assert row["tokens"] == 10  # 2 prompts x 5 tokens, EOS ignored
        assert 0 < row["drawing_s"] < row["seconds"]
        assert row["target_calls"] == 10 if decoder == "alone" else 0 < row["target_calls"] <= 10
    assert all(0 <= rows["sd", s]["alpha"] <= 1 for s in SAMPLERS)
    assert [(r["sampler"], r["rows"], r["steps"]) for r in result["rollouts"]] == [(s, 2, 5) for s in SAMPLERS]
    assert json.loads((tmp_path / "sampler.json").read_text()) == result
    assert "of it drawing tokens" in (tmp_path / "sampler.md").read_text()
