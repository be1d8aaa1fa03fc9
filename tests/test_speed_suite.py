"""The speed suite (benchmarks/suites/speed.py) on the tiny garden pair: every draft kind raced beside the target
alone, step costs and predictions per row, and seeded races in which every decoder emits the target alone's text."""

import json

from benchmarks.suites.speed import suite_speed

from .conftest import needs_compiler


def test_the_speed_suite_races_every_draft_kind_and_seeded_requests_give_the_target_alones_text(tiny_garden, tmp_path):
    overrides = [f"target={tiny_garden.target}", f"draft={tiny_garden.draft}", "dataset=arith"]
    result = suite_speed(
        overrides,
        draft_vocab=64,
        pruned=["first:1"],
        gammas=[2],
        temperatures=[0.0, 1.0],
        prompts=2,
        max_new_tokens=6,
        repeats=1,
        out=tmp_path,
        seeded=True,
    )
    kinds = {row["draft"] for row in result["rows"]}
    assert kinds == {"draft", "draft V=64", "@first:1", "@first:1 V=64"}
    assert set(result["target_alone"]) == {"0", "1", "1 seeded"}
    seeded = [row for row in result["rows"] if row["seeded"]]
    assert len(seeded) == 4 and all(row["temperature"] == 1.0 for row in seeded)
    assert all(row["same_text"] == 1.0 for row in seeded)  # a seed gives the target alone's text
    greedy = [row for row in result["rows"] if row["temperature"] == 0.0]
    assert all(row["same_text"] == 1.0 for row in greedy)  # greedy SD is the target's greedy
    for row in result["rows"]:
        assert row["c"] > 0 and row["v"] > 0 and row["tokens_per_s"] > 0 and 0 <= row["alpha"] <= 1
        assert row["ttft_s"] > 0 and row["decode_speedup"] > 0  # split at each call's first block
    assert all(alone["ttft_s"] > 0 and alone["decode_tokens_per_s"] > 0 for alone in result["target_alone"].values())
    assert json.loads((tmp_path / "speed.json").read_text())["config"]["prepack"] is False
    assert "1 seeded" in (tmp_path / "speed.md").read_text()


def greedy_race(tiny_garden, tmp_path, **kinds) -> dict:
    """The suite on the garden pair: one prompt, 6 greedy tokens, gamma 2, the draft kinds ``kinds`` asks for."""
    overrides = [f"target={tiny_garden.target}", f"draft={tiny_garden.draft}", "dataset=arith"]
    common = dict(pruned=[], gammas=[2], temperatures=[0.0], prompts=1, max_new_tokens=6, repeats=1, out=tmp_path)
    return suite_speed(overrides, **common | {"draft_vocab": 0} | kinds)


def test_int8_only_races_each_draft_with_int8_weights_instead_of_its_own_fused_or_not(tiny_garden, tmp_path):
    from benchmarks.suites.common import suite_int8_kernels

    kernels = tuple(suite_int8_kernels())  # with int4-torch where the few-row kernel takes the 4-bit steps
    result = greedy_race(tiny_garden, tmp_path, draft_vocab=64, int8="only", int8_kernels=kernels, unfused=True)
    suffixes = ["" if kernel == "weight-only" else f" {kernel}" for kernel in kernels]
    names = {f"{draft} int8{suffix}{fused}" for draft in ("draft", "draft V=64") for suffix in suffixes
             for fused in ("", " unfused")}  # fmt: skip
    assert {row["draft"] for row in result["rows"]} == names
    assert all(row["same_text"] == 1.0 for row in result["rows"])  # greedy SD with int8 drafts is still exact


def test_the_vllm_rows_name_their_draft_and_compare_with_vllms_target_alone():
    from benchmarks.suites.speed import format_table

    config = {"target": "t", "draft": "d", "dtype": "bfloat16", "threads": 2, "prompts": 1, "max_new_tokens": 8}
    result = {"config": config | {"repeats": 1}, "rows": [], "target_alone": {}}
    result["vllm"] = [
        {"draft": None, "gamma": 0, "temperature": 0.0, "tokens_per_s": 4.0},
        {"draft": "draft", "gamma": 5, "temperature": 0.0, "tokens_per_s": 6.0, "alpha": 0.8, "tau": 4.0},
        {"draft": "outputs/run/draft", "gamma": 5, "temperature": 0.0, "tokens_per_s": 8.0, "alpha": 0.9, "tau": 5.0},
    ]
    table = format_table(result)
    assert "| 0 | target alone | - | - | - | 4.00 | 1.00x |" in table
    assert "| 0 | outputs/run/draft | 5 | 0.900 | 5.00 | 8.00 | 2.00x |" in table


@needs_compiler
def test_compiled_drafts_race_beside_their_eager_selves(tiny_garden, tmp_path):
    result = greedy_race(tiny_garden, tmp_path, compiled_drafts=True)
    assert {row["draft"] for row in result["rows"]} == {"draft", "draft compiled"}
    assert set(result["draft_ms"]) == {"draft", "draft compiled"}
    assert all(row["same_text"] == 1.0 for row in result["rows"])  # greedy SD, compiled or not, is the target's
    assert result["config"]["compiled_drafts"] and not result["config"]["compile"]
