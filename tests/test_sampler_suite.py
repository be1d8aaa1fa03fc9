"""The sampler suite (benchmarks/suites/sampler.py) on the tiny garden pair: both samplers, both nucleus searches and
both ways of penalising decode, each timed, and the decoders get their own functions back afterwards."""

import json

from benchmarks.suites.sampler import MULTINOMIAL, NUCLEI, PENALTIES, SAMPLERS, suite_sampler
from distillspec.decoding import sampling, speculative

from .conftest import garden_overrides


def test_the_suite_times_both_ways_in_every_decoder(tiny_garden, tmp_path):
    own = speculative.sample, sampling.truncate, sampling.History.process
    overrides = garden_overrides(tiny_garden)
    result = suite_sampler(
        overrides,
        prompts=2,
        max_new_tokens=5,
        gamma=3,
        repeats=1,
        top_p=0.8,
        presence_penalty=0.5,
        repetition_penalty=1.2,
        out=tmp_path,
    )
    assert (speculative.sample, sampling.truncate, sampling.History.process) == own
    assert [r["vocab"] for r in result["draw_ms"]] == [32_768, 151_936, 32_768, 151_936]
    assert all(r[name] > 0 for r in result["draw_ms"] for name in [*SAMPLERS, MULTINOMIAL])
    for part, variants in (("decoders", SAMPLERS), ("top_p", NUCLEI), ("penalties", PENALTIES)):
        rows = {(r["decoder"], r["variant"]): r for r in result[part]}
        decoders = ("sd",) if part == "penalties" else ("alone", "sd")
        assert set(rows) == {(d, v) for d in decoders for v in variants}
        for (decoder, _), row in rows.items():
            assert row["tokens"] == 10  # 2 prompts x 5 tokens, EOS ignored
            assert 0 < row["timed_s"] < row["seconds"]
            assert row["target_calls"] == 10 if decoder == "alone" else 0 < row["target_calls"] <= 10
        assert all(0 <= rows["sd", v]["alpha"] <= 1 for v in variants)
    assert [(r["variant"], r["rows"], r["steps"]) for r in result["rollouts"]] == [(s, 2, 5) for s in SAMPLERS]
    assert json.loads((tmp_path / "sampler.json").read_text()) == result
    table = (tmp_path / "sampler.md").read_text()
    assert "of it truncating" in table and "of it processing logits" in table
