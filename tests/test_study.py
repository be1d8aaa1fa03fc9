"""The results page's building blocks: recipe cells, summaries, the peer decoders and the page itself (no Ray)."""

from __future__ import annotations

import json

import pytest
import torch

from benchmarks.suites.analysis import race, time_to_alpha
from distillspec.config import DATA_SOURCES, DistillConfig, cell_config, resolve_recipe
from distillspec.errors import DistillSpecError
from distillspec.evaluation.report import spread
from distillspec.evaluation.study import run_cell


@pytest.mark.parametrize("source", sorted(DATA_SOURCES))
def test_cell_config_sets_the_data_source_of_algorithm_a2(source):
    cfg = cell_config(DistillConfig(), source, "jsd", steps=7)
    recipe = resolve_recipe(cfg)
    assert (recipe.lambda1, recipe.lambda2) == DATA_SOURCES[source]
    assert recipe.divergence == "jsd" and cfg.steps == 7 and cfg.time_budget_s == 0


@pytest.mark.parametrize(
    ("source", "divergence", "message"), [("web", "tvd", "data source='web'"), ("draft", "kl", "'kl'")]
)
def test_cell_config_refuses_unknown_names(source, divergence, message):
    with pytest.raises(DistillSpecError, match=message):
        cell_config(DistillConfig(), source, divergence, steps=1)


def test_run_cell_distils_a_copy_and_measures_it(text_pair, tokenizer, task):
    target, draft = text_pair
    before = [p.clone() for p in draft.parameters()]
    cfg = cell_config(DistillConfig(batch_size=4, max_new_tokens=8, lr=1e-2, warmup_steps=1), "draft", "tvd", 3)
    student, record = run_cell(
        target, draft, tokenizer, task, cfg, gammas=[2, 3], temperatures=[0.0, 1.0], num_prompts=4, max_new_tokens=8
    )
    assert all(torch.equal(a, b) for a, b in zip(before, draft.parameters())), "the caller's draft must not change"
    assert any(not torch.equal(a, b) for a, b in zip(before, student.parameters()))
    assert record["steps"] == 3 and record["train_tokens"] > 0
    assert [(r["gamma"], r["temperature"]) for r in record["sd"]] == [(2, 0.0), (2, 1.0), (3, 0.0), (3, 1.0)]
    for r in record["sd"]:
        assert 1.0 <= r["tau"] <= r["gamma"] + 1 and 0.0 <= r["alpha_tvd"] <= 1.0
    assert 0.0 <= record["draft_alone"]["accuracy"] <= 1.0 and record["draft_alone"]["seconds_per_token"] > 0


def test_spread_and_time_to_alpha():
    s = spread([0.1, 0.3])
    assert s["mean"] == pytest.approx(0.2) and s["std"] == pytest.approx(0.1414, abs=1e-4) and s["n"] == 2
    assert spread([0.5])["std"] == 0.0
    curve = [{"seconds": 0, "alpha": 0.7}, {"seconds": 5, "alpha": 0.75}, {"seconds": 9, "alpha": 0.8}]
    assert time_to_alpha(curve, 0.74) == 5 and time_to_alpha(curve, 0.8) == 9 and time_to_alpha(curve, 0.9) is None
    theirs = [{"seconds": 0, "alpha": 0.7}, {"seconds": 3, "alpha": 0.78}, {"seconds": 6, "alpha": 0.85}]
    r = race(curve, theirs)  # the common alpha is the lower best, 0.8: ours at 9 s, theirs at 6 s
    assert r["goal_alpha"] == 0.8 and r["ratio"] == pytest.approx(9 / 6)
    flat = [{"seconds": 0, "alpha": 0.7}, {"seconds": 3, "alpha": 0.6}]
    assert race(curve, flat)["ratio"] is None


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_our_decoders_and_transformers_assisted_generation_agree_on_greedy_text(
    text_pair, tokenizer, task, temperature
):
    """The peer suite times like with like: at T = 0 all three decoders print the target's greedy output."""
    from benchmarks.suites.peers import _timed, decoder

    target, draft = text_pair
    draft.generation_config.num_assistant_tokens = 3
    draft.generation_config.num_assistant_tokens_schedule = "constant"
    prompts = [e.prompt for e in task.test[:3]]
    outputs = {}
    for kind in ("hf", "hf_assisted", "ours", "ours_sd", "ours_sd_compiled"):
        fn = decoder(kind, target, draft, tokenizer, gamma=3, max_new_tokens=12, temperature=temperature)
        speed, outputs[kind] = _timed(fn, prompts, tokenizer, batch=1)
        assert speed > 0 and all(1 <= len(o) <= 12 for o in outputs[kind])
    if temperature == 0:
        assert outputs["hf"] == outputs["hf_assisted"] == outputs["ours"] == outputs["ours_sd"]
    assert outputs["ours_sd_compiled"] == outputs["ours_sd"]  # the same generator seed: the same tokens at T = 1 too


def _cell(source: str, divergence: str, t0: float, t1: float) -> dict:
    one = lambda v: {"mean": v, "std": 0.0, "min": v, "max": v, "n": 1}
    return {
        "source": source,
        "divergence": divergence,
        "seeds": [0],
        "tau_gain_T0": one(t0),
        "tau_gain_T1": one(t1),
        "draft_accuracy": one(0.1),
    }


def test_results_page_names_commands_and_says_where_on_policy_loses(tmp_path):
    from benchmarks.suites.page import write_page

    runs, docs = tmp_path / "runs", tmp_path / "docs"
    runs.mkdir()
    cells = [_cell("draft", "tvd", 0.20, 0.15), _cell("fixed", "fkl", 0.05, 0.30)]
    sweep = {"steps": 40, "gamma": 5, "cells": cells, "best": {"source": "draft", "divergence": "tvd"}}
    common = {"scale": "quick", "seconds": 120.0, "machine": "x86_64"}
    (runs / "recipes.json").write_text(
        json.dumps({**common, "command": "python benchmarks/benchmark.py recipes", "tasks": {"arith": sweep}})
    )
    page = write_page(runs, docs).read_text()
    assert "Made by `python benchmarks/benchmark.py recipes`" in page
    assert "| draft | TVD | +20.0% | +15.0% | 0.100 |" in page
    assert "T=0: on-policy data beats fixed data on arith" in page
    assert "T=1: on-policy data does NOT beat fixed data on arith" in page
    assert "Best recipe on arith: **draft data + TVD**" in page


def test_results_page_without_results_is_a_clear_error(tmp_path):
    from benchmarks.suites.page import write_page

    with pytest.raises(DistillSpecError, match="no suite results"):
        write_page(tmp_path, tmp_path / "docs")


def test_results_page_pools_the_seeds_of_several_runs(tmp_path):
    from benchmarks.suites.page import write_page

    def run(folder, seed: int, gain: float) -> None:
        folder.mkdir()
        metrics = {"tau_gain_T1": gain, "tau_T1": 4.0}
        sweep = {
            "steps": 40,
            "gamma": 5,
            "rank": "tau_gain_T1",
            "trials": [{"source": "draft", "divergence": "tvd", "seed": seed, "metrics": metrics}],
            "cells": [],
            "best": {},
        }
        data = {
            "scale": "full",
            "seconds": 60.0,
            "machine": "x86_64",
            "command": f"run {seed}",
            "tasks": {"gsm8k": sweep},
        }
        (folder / "recipes.json").write_text(json.dumps(data))

    run(tmp_path / "a", 0, 0.10)
    run(tmp_path / "b", 1, 0.20)
    page = write_page([tmp_path / "a", tmp_path / "b"], tmp_path / "docs").read_text()
    assert "Made by `run 0` (gsm8k)" in page and "Made by `run 1` (gsm8k)" in page
    assert "| draft | TVD | +15.0% ± 7.1 |" in page and "(40 steps a cell, 2 seeds)" in page


def test_results_page_credits_only_the_runs_it_shows():
    from benchmarks.suites.page import merge

    def run(command: str, tasks: list[str]) -> dict:
        return {"command": command, "scale": "full", "seconds": 60.0, "tasks": {t: {"x": command} for t in tasks}}

    merged = merge([run("old", ["arith", "gsm8k"]), run("older peer", ["arith"]), run("new", ["gsm8k"])])
    assert merged["tasks"] == {"arith": {"x": "older peer"}, "gsm8k": {"x": "new"}}
    assert [(r["command"], r["tasks"]) for r in merged["runs"]] == [("older peer", ["arith"]), ("new", ["gsm8k"])]
    assert merged["seconds"] == 120.0


def test_saved_drafts_report_the_steps_they_were_distilled_for(tmp_path):
    from benchmarks.suites.common import draft_steps

    own = tmp_path / "drafts" / "arith" / "draft-tvd-s0"
    own.mkdir(parents=True)
    (own / "distillspec.json").write_text(json.dumps({"source": "draft", "divergence": "tvd", "steps": 25}))
    grid = tmp_path / "out" / "recipes" / "gsm8k" / "drafts" / "draft-tvd-s0"
    grid.mkdir(parents=True)
    (tmp_path / "out" / "recipes.json").write_text(json.dumps({"tasks": {"gsm8k": {"steps": 40}}}))
    assert draft_steps(own) == 25 and draft_steps(grid) == 40 and draft_steps(tmp_path) is None


def test_gamma_suite_compares_settings_round_by_round_and_splits_a_distilling_run_in_thirds(capsys):
    from benchmarks.suites.gamma import _gamma_row, _gamma_thirds, _print_gamma_table, _third_notes

    def stats(drafted: int, accepted: int, calls: int) -> dict:
        return {
            "gamma": 5,
            "drafted": drafted,
            "accepted": accepted,
            "rejected": drafted - accepted,
            "target_calls": calls,
        }

    settings, slices = [0, 5, "auto"], []
    for r in range(6):  # the draft improves: gamma 5 is slower than plain decoding at first, faster at the end
        alpha = [0.4, 0.4, 0.7, 0.7, 0.9, 0.9][r]
        speeds = {"0": 100.0, "5": 60.0 + 100 * alpha, "auto": 100.0 if alpha < 0.5 else 55.0 + 100 * alpha}
        for g, speed in speeds.items():
            drafted = 0 if g == "0" or (g == "auto" and alpha < 0.5) else 50
            sd = stats(drafted, int(alpha * drafted), 10)
            cell = {"round": r, "gamma": g, "end_s": 10.0 * r + 1, "tokens": speed, "seconds": 1.0, "sd": sd}
            slices.append({**cell, "cpu_s": 0.5 if g == "auto" else 0.8})  # the replica's CPU seconds
            slices[-1]["draft_version"] = r if drafted else None
            slices[-1]["batch_sizes"] = {"4": 1, "2": 2} if g == "0" else {"4": 2}
    whole = _gamma_row(slices, settings)
    assert whole["0"]["requests_per_batch"] == pytest.approx(8 / 3) and whole["auto"]["requests_per_batch"] == 4.0
    _print_gamma_table({"all": whole}, settings, "run")
    assert whole["0"]["tokens_per_s"] == pytest.approx(100.0) and whole["0"]["mean_gamma"] == 0.0
    assert whole["5"]["alpha"] == pytest.approx((20 + 35 + 45) * 2 / 300) and whole["5"]["mean_gamma"] == 5.0
    per_cpu_s = _gamma_row(slices, settings, "cpu_s")  # per second of the replica's CPU time
    assert per_cpu_s["0"]["tokens_per_s"] == pytest.approx(125.0) and per_cpu_s["auto"]["per_round"][0] == 200.0
    assert _gamma_thirds(slices, settings, "cpu_s")[0]["row"]["5"]["tokens_per_s"] == pytest.approx(100 / 0.8)
    thirds = _gamma_thirds(slices, settings)
    assert [p["name"] for p in thirds] == ["first", "second", "last"] and all(p["rounds"] == 2 for p in thirds)
    assert [p["draft_versions"] for p in thirds] == [[0, 1], [2, 3], [4, 5]]
    assert [p["alpha"] for p in thirds] == pytest.approx([0.4, 0.7, 0.9])
    _print_gamma_table({p["name"]: p["row"] for p in thirds}, settings, "third", extra=_third_notes(thirds))
    first, last = thirds[0]["row"], thirds[2]["row"]
    assert first["best_fixed"] == 0 and first["auto_vs_best"] == pytest.approx(1.0)
    assert last["best_fixed"] == 5 and last["auto_vs_best"] == pytest.approx(145 / 150)
    assert last["auto_vs_best_per_round"] == pytest.approx([145 / 150] * 2)
    assert last["auto_vs_best_interval"] == pytest.approx((145 / 150, 145 / 150))  # the same ratio every round
    low, high = whole["auto_vs_best_interval"]  # over the run: gamma 0 best in some draws, gamma 5 in others
    assert 0.85 < low < whole["auto_vs_best"] < high <= 1.0
    printed = capsys.readouterr().out
    assert "2 rounds, 0-11 s, alpha 0.400, versions 0 to 1" in printed and "(best fixed: 5)" in printed


def test_gamma_suite_while_distilling_refuses_a_round_count(tmp_path):
    from benchmarks.suites.gamma import suite_gamma

    with pytest.raises(DistillSpecError, match=r"--distilling: not with --rounds \(rounds run until the job ends\)"):
        suite_gamma([], 60.0, tmp_path, rounds=4, distilling=True)
