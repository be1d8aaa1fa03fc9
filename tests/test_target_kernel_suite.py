"""The target-kernel suite (benchmarks/suites/target_kernel.py) on the tiny garden pair: the target with each layout
steps and races, and the tables hold both."""

import json

import pytest

from benchmarks.suites.target_kernel import KERNELS, suite_target_kernel
from distillspec.models import few_rows

from .conftest import garden_overrides, needs_compiler


@needs_compiler
def test_the_suite_steps_and_races_the_target_with_each_kernel(tiny_garden, tmp_path):
    if few_rows.unavailable_reason() is not None:
        pytest.skip(few_rows.unavailable_reason())
    result = suite_target_kernel(
        garden_overrides(tiny_garden),
        ks=[1, 6],
        gammas=[3],
        temperatures=[0.0, 1.0],
        prompts=1,
        max_new_tokens=6,
        repeats=2,
        out=tmp_path,
    )
    assert set(result["step_ms"]) == set(KERNELS)
    assert all(ms > 0 for by_k in result["step_ms"].values() for ms in by_k.values())
    assert len(result["races"]) == 2 * 2 * len(KERNELS)  # temperatures x passes x kernels
    greedy = [r for r in result["races"] if r["temperature"] == 0.0]
    assert len({r["sd"][0]["tau"] for r in greedy}) == 1  # the same tokens whichever kernel verifies
    assert json.loads((tmp_path / "target_kernel.json").read_text()) == result
    table = (tmp_path / "target_kernel.md").read_text()
    assert "few_rows / onednn" in table and "| 1 | 3 | few_rows |" in table
