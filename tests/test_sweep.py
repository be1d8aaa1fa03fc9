"""The recipe search (jobs/sweep.py): a real Ray Tune grid on the session's Ray cluster, and its CLI errors."""

from __future__ import annotations

import json
import os

import pytest

from distillspec.config import load_config
from distillspec.models.loading import load_model
from jobs import sweep
from tests.conftest import run_here


def test_sweep_runs_the_grid_as_tune_trials_and_ranks_the_recipes(
    ray_cluster, tiny_garden, task, tmp_path, monkeypatch
):
    """Relative paths, as a user types them: Tune runs each trial in its own working directory. Each trial asks for
    more memory than the node has: the ask is capped at the node's, and the trials run one at a time."""
    from cluster.sweep import run_sweep
    from distillspec.evaluation.report import format_sweep

    monkeypatch.chdir(tmp_path)
    (tmp_path / "data").mkdir()
    for split, examples in (("train", task.train), ("test", task.test)):
        lines = [json.dumps({"prompt": e.prompt, "reference": e.reference}) for e in examples]
        (tmp_path / "data" / f"{split}.jsonl").write_text("\n".join(lines) + "\n")
    os.symlink(tiny_garden.target, tmp_path / "target")
    os.symlink(tiny_garden.draft, tmp_path / "draft")
    cfg = load_config(
        None,
        [
            "target=./target",
            "draft=./draft",
            "dataset=./data",
            "sweep.sources=[draft,fixed]",
            "sweep.divergences=[tvd]",
            "sweep.seeds=[0]",
            "sweep.steps=2",
            "eval.num_prompts=4",
            "eval.max_new_tokens=8",
            "eval.temperatures=[0,1]",
            "distill.batch_size=4",
            "distill.max_new_tokens=8",
            "sweep.trial_memory_gb=100000",
            f"output_dir={tmp_path}",
        ],
    )
    result = run_sweep(cfg, tmp_path, log=lambda *_: None)
    assert not result["failed"]
    assert sorted((t["source"], t["divergence"]) for t in result["trials"]) == [("draft", "tvd"), ("fixed", "tvd")]
    for trial in result["trials"]:
        m = trial["metrics"]
        assert 1.0 <= m["tau_T1"] <= 6.0 and 0.0 <= m["alpha_T0"] <= 1.0
        assert m["tau_gain_T1"] == pytest.approx(m["tau_T1"] / result["before"]["T1"]["tau"] - 1.0)
        assert m["train_tokens"] > 0
        assert load_model(str(tmp_path / "drafts" / f"{trial['source']}-tvd-s0"))[0] is not None
    gains = [c["tau_gain_T1"]["mean"] for c in result["cells"]]
    assert gains == sorted(gains, reverse=True)
    assert (result["best"]["source"], result["best"]["divergence"]) == (result["cells"][0]["source"], "tvd")
    assert f"best recipe on {result['task']}" in format_sweep(result)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["sweep.sources=[web]"], "sweep.sources[0]='web': choose one of ['fixed', 'draft', 'target', 'mixed']"),
        (["sweep.divergences=[]"], "sweep.divergences=[]: list should have at least 1 item"),
        (["sweep.rank_temperature=0.5"], "sweep.rank_temperature=0.5 is not among eval.temperatures"),
    ],
)
def test_sweep_bad_input_is_one_line(args, message, tmp_path, capsys, monkeypatch):
    proc = run_here(lambda: sweep.cli(["--output-dir", str(tmp_path), *args]), capsys, monkeypatch)
    assert proc.returncode == 2, proc.stderr[-500:]
    assert proc.stderr.strip().count("\n") == 0 and message in proc.stderr


def test_a_trial_asks_for_the_memory_its_pair_and_batch_hold(tiny_garden):
    from cluster.sweep import trial_memory

    target, _ = load_model(str(tiny_garden.target))
    draft, _ = load_model(str(tiny_garden.draft))
    small, large = (
        trial_memory(target, draft, load_config(None, [f"distill.batch_size={b}", "distill.max_new_tokens=8"]))
        for b in (1, 64)
    )
    weights = sum(p.numel() * p.element_size() for p in target.parameters())
    assert small > weights + 16 * sum(p.numel() for p in draft.parameters())
    assert large > small  # a larger batch's logits
