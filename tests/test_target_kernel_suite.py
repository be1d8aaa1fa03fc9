"""The target-kernel suite (benchmarks/suites/target_kernel.py) on the tiny garden pair: the target in each layout
(float32 and bfloat16) steps, is compared with the baseline's distributions, and races; the tables hold every
layout."""

import json
import shutil

import pytest

from benchmarks.suites.target_kernel import LAYOUTS, suite_target_kernel
from distillspec import DistillSpecError
from distillspec.models import few_rows
from distillspec.models.loading import load_model

from .conftest import garden_overrides, needs_compiler, on_4_bit_grids


@needs_compiler
def test_the_suite_steps_compares_and_races_the_target_in_each_layout(tiny_garden, tmp_path):
    """The garden's target with its decoder layers on 4-bit grids (as a 4-bit GGUF's), so that the 4-bit layouts
    hold them in 4 bits."""
    if few_rows.unavailable_reason() is not None:
        pytest.skip(few_rows.unavailable_reason())
    layouts = ["few_rows", "bfloat16", "int4", "int4-int8", "int4-bf16-rest", "int4-all", "bf16-few-rows"]
    layouts += ["bf16-matrix-vector", "bf16-plain"]
    layouts.append("bf16-int4")
    layouts.append("onednn")
    assert set(layouts) == set(LAYOUTS)
    target = tmp_path / "target"
    shutil.copytree(tiny_garden.target, target)
    on_4_bit_grids(load_model(str(target))[0]).save_pretrained(target)
    result = suite_target_kernel(
        [*garden_overrides(tiny_garden), f"target={target}"],
        layouts=layouts,
        ks=[1, 6],
        gammas=[3],
        temperatures=[0.0, 1.0],
        prompts=1,
        max_new_tokens=6,
        repeats=2,
        held=1,
        out=tmp_path,
    )
    assert list(result["step_ms"]) == layouts
    assert all(ms > 0 for by_k in result["step_ms"].values() for ms in by_k.values())
    near = result["closeness"]
    assert set(near) == set(layouts[:-1]) and all(row["positions"] > 0 for row in near.values())
    assert near["few_rows"]["tvd"] < 1e-4 < near["bfloat16"]["tvd"] < 0.05  # float32 sums; weights rounded
    assert 1e-6 < near["int4"]["tvd"] < 0.01  # the rows in 16 bits, the scales in bfloat16
    assert near["int4"]["tvd"] < near["int4-int8"]["tvd"] < 0.05  # the head in int8, not bfloat16
    assert near["int4-bf16-rest"]["tvd"] == near["int4"]["tvd"]  # the garden's head lies on no 6-bit grid: bfloat16
    assert 1e-6 < near["int4-all"]["tvd"] < 0.01  # the same layers in 4 bits (the head's 300 outputs: not in 16s)
    assert all(1e-4 < near[name]["tvd"] < 0.05 for name in layouts if name.startswith("bf16"))  # bfloat16 targets
    assert len(result["races"]) == 2 * 2 * len(layouts)  # temperatures x passes x layouts
    greedy = [r for r in result["races"] if r["temperature"] == 0.0 and r["layout"] in ("few_rows", "onednn")]
    assert len({r["sd"][0]["tau"] for r in greedy}) == 1  # the same tokens whichever float32 layout verifies
    assert json.loads((tmp_path / "target_kernel.json").read_text()) == result
    table = (tmp_path / "target_kernel.md").read_text()
    assert "few_rows / onednn" in table and "bf16-few-rows / onednn" in table and "| 1 | 3 | bfloat16 |" in table
    with pytest.raises(DistillSpecError, match="--layouts takes two or more"):
        suite_target_kernel([], layouts=["few_rows"], ks=[1], gammas=[3], temperatures=[0.0], prompts=1,
                            max_new_tokens=2, repeats=1, held=1, out=tmp_path)  # fmt: skip
