"""The lossy-SD suite (benchmarks/suites/lossy.py) on the tiny garden pair: a lenient setting keeps more of the
draft's tokens than lossless SD, so its tau is higher and its predicted latency lower; bad settings are refused."""

import json

import pytest

from benchmarks.suites.lossy import parse_setting, suite_lossy
from distillspec.errors import DistillSpecError

from .conftest import finished_run, garden_overrides


def test_a_lenient_setting_accepts_more_and_costs_less(tiny_garden, tmp_path):
    result = suite_lossy(
        garden_overrides(tiny_garden),
        settings=[parse_setting("lin:0.02")],
        distilled=tiny_garden.draft,  # the same draft under the distilled label: both rows and the plot's two styles
        gamma=3,
        prompts=4,
        max_new_tokens=8,
        batch_size=4,
        out=tmp_path,
    )
    points = {(p["draft"], p["lenience"]): p for p in result["points"]}
    assert len(points) == 4
    for draft in ("raw", "distilled"):
        lossless, lenient = points[(draft, None)], points[(draft, "lin")]
        assert lenient["alpha"] > lossless["alpha"]
        assert lenient["tau"] > lossless["tau"]
        assert lenient["relative_latency"] < lossless["relative_latency"]
        assert 0 <= lenient["accuracy"] <= 1
    assert json.loads((tmp_path / "lossy.json").read_text())["config"]["metric"] == "accuracy"
    assert "| raw | lin | 0.02 |" in (tmp_path / "lossy.md").read_text()
    assert (tmp_path / "lossy.png").stat().st_size > 0
    length = sum(p["new_tokens"] / p["prompts"] for p in result["points"]) / len(result["points"])
    assert ("warning" in result) == (length > 0.9 * 8)  # answers cut at the limit: the table says what it measures
    assert ("raise --max-new-tokens" in (tmp_path / "lossy.md").read_text()) == ("warning" in result)


@pytest.mark.parametrize("text", ["lin", "lin:0", "lin:2", "cube:0.1", "sq:x"])
def test_a_bad_setting_is_refused_in_one_line(text):
    with pytest.raises(DistillSpecError, match="LENIENCE:EPSILON"):
        parse_setting(text)


def test_a_run_folder_gives_the_pair_and_both_drafts(tiny_garden, tmp_path):
    run = finished_run(tiny_garden, tmp_path / "run")
    result = suite_lossy([], settings=[], distilled=None, run=run, gamma=3, prompts=2, max_new_tokens=4,
                         batch_size=2, out=tmp_path / "out")  # fmt: skip
    assert {p["draft"] for p in result["points"]} == {"raw", "distilled"}
    assert result["config"]["distilled"] == str((run / "draft").resolve())
