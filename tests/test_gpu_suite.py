"""The GPU suite's arithmetic on the CPU: its predicted speedups and tables from step times (the timing itself
needs a CUDA GPU: ``tests/test_cuda.py`` and ``python -m benchmarks.suites.gpu``)."""

import pytest

from benchmarks.suites.gpu import KS, best_speedup, format_tables, predictions
from distillspec.decoding.metrics import expected_tau


def test_best_speedup_takes_the_gamma_that_pays_most():
    free = {k: 1.0 for k in KS}  # verification as cheap as one step
    gamma, speedup = best_speedup(0.8, 0.1, free)
    assert speedup == pytest.approx(max(expected_tau(0.8, g) / (0.1 * g + 1) for g in range(1, 8)))
    assert 1 <= gamma <= 7
    assert best_speedup(0.6, 1.0, free)[1] < 1  # a draft as dear as the target never pays


def test_predictions_and_tables_for_the_batches_asked_for():
    target = {k: 4.0 + 0.1 * k for k in KS}
    times = {
        "t": {"graphs": {1: target}},
        "d": {"graphs": {1: {k: 2.0 for k in KS}}},
        "d/V32768": {"graphs": {1: {1: 1.0}}},
    }
    rows = predictions(times, ("t", "d"), ["graphs"])
    assert [row["draft"] for row in rows] == ["full", "V=32768"]
    assert rows[0]["c"] == pytest.approx(2.0 / 4.1) and rows[1]["c"] == pytest.approx(1.0 / 4.1)
    assert rows[1]["alpha=0.8"]["speedup"] > rows[0]["alpha=0.8"]["speedup"]
    result = {"device": "a GPU", "bandwidth_gbs": 1000.0, "times": times, "predictions": rows, "target_alone": []}
    table = format_tables(result)
    assert "| t | graphs | 1 | 4.10 |" in table and "| t / d | V=32768 | graphs | 1 |" in table
