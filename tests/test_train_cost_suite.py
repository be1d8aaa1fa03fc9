"""The train-cost suite (benchmarks/suites/train_cost.py) on the tiny garden pair: a learner step per setting on the
same scored batches, timed."""

import json

from benchmarks.suites.train_cost import suite_train_cost

from .conftest import garden_overrides


def test_the_train_cost_suite_times_each_setting_on_the_same_batches(tiny_garden, tmp_path):
    overrides = [*garden_overrides(tiny_garden), "distill.batch_size=2", "distill.max_new_tokens=6"]
    result = suite_train_cost(overrides, ["layers", "top:1", "lora:2"], rounds=2, topk=8, out=tmp_path)
    rows = result["settings"]
    assert list(rows) == ["layers", "top:1", "lora:2"] and rows["layers"]["ratio"] == 1.0
    assert all(len(r["seconds"]) == 2 and r["step_s"] > 0 for r in rows.values())
    assert rows["lora:2"]["trained"] < rows["top:1"]["trained"] < rows["layers"]["trained"]
    assert json.loads((tmp_path / "train_cost.json").read_text())["settings"].keys() == set(rows)
    assert "| lora:2 |" in (tmp_path / "train_cost.md").read_text()
