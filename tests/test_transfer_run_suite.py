"""The transfer suite of a run (benchmarks/suites/transfer_run.py) on a garden run folder: one row per task, gamma
and temperature, the run's own task marked; the same draft before and after gives the same acceptance."""

import pytest

from benchmarks.suites.transfer_run import suite_transfer_run

from .conftest import SHARED_DATA, finished_run


def test_each_task_gets_rows_before_and_after(tiny_garden, tmp_path):
    other = SHARED_DATA / "multi30k"
    if not other.exists():
        pytest.skip(f"{other} is not here")
    run = finished_run(tiny_garden, tmp_path / "run")
    result = suite_transfer_run(run, [], datasets=[str(other)], gammas=[3], temperatures=[0.0], prompts=2,
                                max_new_tokens=4, batch_size=2, out=tmp_path / "out")  # fmt: skip
    rows = result["rows"]
    assert [(r["task"], r["trained_on"]) for r in rows] == [("arith", True), ("multi30k", False)]
    for r in rows:  # the stand-in "distilled" draft is the undistilled one: greedy SD accepts the same tokens
        assert r["alpha_after"] == pytest.approx(r["alpha_before"]) and r["tau_gain"] == pytest.approx(0.0)
    assert "| arith (trained on) | 3 | 0 |" in (tmp_path / "out" / "transfer.md").read_text()
