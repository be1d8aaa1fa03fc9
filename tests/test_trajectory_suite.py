"""The trajectory suite (benchmarks/suites/trajectory.py) on the tiny garden pair: held-out acceptance before and
along a few learner steps, per setting."""

import json

import pytest

from benchmarks.suites.trajectory import acceptance, held_out, suite_trajectory
from distillspec.models.draft_vocab import vocab_size
from distillspec.models.loading import load_model, load_pair

from .conftest import garden_overrides


def test_the_trajectory_suite_scores_each_setting_on_fixed_target_samples(tiny_garden, tmp_path):
    overrides = garden_overrides(tiny_garden)
    settings = ["distill.lr=1e-3", "distill.lr=1e-3 distill.divergence=fkl distill.train=top:1",
                "distill.lr=1e-2 distill.train=lora:4"]  # fmt: skip
    result = suite_trajectory(overrides, settings, steps=3, every=2, held=4, out=tmp_path, keep_drafts=True)
    assert 0.0 < result["start"]["alpha"] <= 1.0 and 0.0 <= result["start"]["greedy"] <= 1.0
    assert list(result["settings"]) == settings
    for rows in result["settings"].values():
        assert [r["step"] for r in rows] == [2, 3]
        assert all(0.0 < r["alpha"] <= 1.0 and r["loss"] >= 0 for r in rows)
    assert json.loads((tmp_path / "trajectory.json").read_text())["settings"].keys() == set(settings)
    assert (tmp_path / "trajectory.png").stat().st_size > 0
    assert "distill.train=top:1" in (tmp_path / "trajectory.md").read_text()
    assert result["drafts"] == {s: str(tmp_path / "drafts" / str(i)) for i, s in enumerate(settings)}
    for folder in result["drafts"].values():  # each setting's draft as of its last evaluation, loadable as draft=
        draft, _ = load_model(folder)
        assert draft.config.vocab_size > 0


def test_held_out_acceptance_is_the_same_scored_a_few_rows_at_a_time(tiny_garden, task):
    target, draft, tokenizer = load_pair(str(tiny_garden.target), str(tiny_garden.draft))
    sets = held_out(target, draft, tokenizer, task.test[:6], max_new_tokens=6, seed=0)
    whole = acceptance(draft, sets, vocab_size(target), rows=64)
    for rows in (1, 4):
        assert acceptance(draft, sets, vocab_size(target), rows=rows) == pytest.approx(whole, abs=1e-6)
    assert 0.0 < whole["alpha"] < 1.0 and 0.0 < whole["greedy"] <= 1.0


def test_the_trajectory_suite_can_train_on_the_held_out_questions(tiny_garden, tmp_path, monkeypatch):
    from benchmarks.suites import trajectory

    seen = []
    original = trajectory.Sampler

    def sampler(target, draft, tokenizer, train, cfg, **kwargs):
        seen.append([example.prompt for example in train])
        return original(target, draft, tokenizer, train, cfg, **kwargs)

    monkeypatch.setattr(trajectory, "Sampler", sampler)
    result = suite_trajectory(
        garden_overrides(tiny_garden),
        ["distill.lr=1e-3"],
        steps=1,
        every=1,
        held=3,
        out=tmp_path,
        train_on="held",
        unseen=2,
    )
    task = trajectory.load_task(trajectory.load_config(None, garden_overrides(tiny_garden)).dataset, seed=0)
    assert seen == [[example.prompt for example in task.test[:3]]]  # never the 2 unseen questions
    assert result["config"]["train_on"] == "held"
    (row,) = result["settings"]["distill.lr=1e-3"]
    for scored in (result["start"], row):  # the unseen questions are scored beside the seen ones
        assert 0.0 < scored["unseen"]["alpha"] <= 1.0 and 0.0 <= scored["unseen"]["greedy"] <= 1.0
    table = (tmp_path / "trajectory.md").read_text()
    assert "(the questions trained on)" in table and "| unseen alpha |" in table
    assert f"{row['unseen']['alpha']:.4f}" in table


def test_the_trajectory_suite_refuses_unseen_questions_it_cannot_have(tiny_garden, tmp_path):
    run = dict(steps=1, every=1, held=3, out=tmp_path)
    with pytest.raises(SystemExit, match="--train-on held"):  # without it, no held-out question is ever seen
        suite_trajectory(garden_overrides(tiny_garden), ["distill.lr=1e-3"], unseen=2, **run)
    with pytest.raises(SystemExit, match="test questions, 3 of them held out"):
        suite_trajectory(garden_overrides(tiny_garden), ["distill.lr=1e-3"], train_on="held", unseen=10**6, **run)


def test_the_trajectory_suite_scores_a_draft_alone_without_settings(tiny_garden, tmp_path):
    with pytest.raises(SystemExit, match="--settings: at least one"):  # steps to take, and no setting to take them
        suite_trajectory(garden_overrides(tiny_garden), [], steps=1, every=1, held=3, out=tmp_path)
    result = suite_trajectory(garden_overrides(tiny_garden), [], steps=0, every=1, held=3, out=tmp_path)
    assert 0.0 < result["start"]["alpha"] <= 1.0 and result["settings"] == {}
    assert "the draft as loaded" in (tmp_path / "trajectory.md").read_text()
    assert json.loads((tmp_path / "trajectory.json").read_text())["start"] == result["start"]
