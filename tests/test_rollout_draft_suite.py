"""The rollout-draft suite (benchmarks/suites/rollout_draft.py) on the tiny garden pair: the draft's own weights and
its int8 decoding copy sample the same batches, a version loads into each, and the copy's distance is measured."""

import json

import pytest

from benchmarks.suites.rollout_draft import DRAFTS, suite_rollout_draft
from distillspec import DistillSpecError
from distillspec.config import load_config

from .conftest import garden_overrides


def test_the_suite_samples_with_both_drafts_and_loads_a_version_into_each(tiny_garden, tmp_path):
    overrides = garden_overrides(tiny_garden, "draft_int8=true")  # the garden's draft is int8 only when asked
    result = suite_rollout_draft(overrides, rows=2, max_new_tokens=5, repeats=2, out=tmp_path)
    assert [r["draft"] for r in result["sampling"]] == list(DRAFTS)
    assert all(r["steps"] == 10 and r["seconds"] > 0 for r in result["sampling"])  # 2 batches x 5 tokens, EOS ignored
    assert set(result["load_s"]) == set(DRAFTS) and all(s > 0 for s in result["load_s"].values())
    assert result["positions"] == 2 * 2 * 5
    assert 0 < result["tvd"] < 0.2 and result["argmax_agreement"] > 0.5  # rounded, still nearly the same draft
    assert json.loads((tmp_path / "rollout_draft.json").read_text()) == result
    assert "its decoding copy" in (tmp_path / "rollout_draft.md").read_text()


def test_the_job_says_its_rollouts_sample_with_the_decoding_copy(tiny_garden):
    from distillspec.models.pretrained import prepare_models
    from distillspec.tasks.data import arith_task

    lines = []
    pair = [f"target={tiny_garden.target}", f"draft={tiny_garden.draft}", "draft_int8=true"]
    prepare_models(
        load_config(None, [*pair, "rollout.decoding_copy=true"]), arith_task(n_train=8, n_test=4), log=lines.append
    )
    assert "decodes in weight-only int8 (set by draft_int8); its rollouts sample with that copy" in lines[-1]
    prepare_models(load_config(None, pair), arith_task(n_train=8, n_test=4), log=lines.append)
    assert "rollout" not in lines[-1]


@pytest.mark.parametrize("setting", ["rollout.backend=vllm", "ray.mode=sync"])
def test_a_decoding_copy_is_refused_where_no_rollout_actor_samples_with_it(setting):
    with pytest.raises(DistillSpecError, match="rollout.decoding_copy"):
        load_config(None, ["rollout.decoding_copy=true", setting])
