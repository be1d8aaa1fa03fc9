"""End-to-end smoke tests of jobs/distill.py, run as a user runs it (a subprocess; its refusals of bad input in this
process, through the script's entry point)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
from transformers import AutoModelForCausalLM

from distillspec import DistillSpecError
from distillspec.models.loading import load_model, load_pair
from jobs import distill

from .conftest import run_here, run_job

TINY = [
    "garden.vocab_size=300",
    "garden.train_examples=300",
    "garden.target_steps=15",
    "garden.draft_steps=15",
    "garden.target.d_model=64",
    "garden.target.n_layers=2",
    "garden.target.d_ff=128",
    "garden.target.n_heads=2",
    "garden.draft.d_model=32",
    "garden.draft.d_ff=64",
    "garden.draft.n_heads=2",
    "garden.batch_size=8",
    "distill.steps=3",
    "distill.batch_size=4",
    "distill.max_new_tokens=8",
    "eval.gammas=[2,3]",
    "eval.num_prompts=6",
    "eval.batch_size=3",
    "eval.max_new_tokens=8",
    "eval.speedup_prompts=2",
    "eval.speedup_gamma=3",
]


@pytest.fixture(scope="module")
def job_run(tmp_path_factory, ray_cluster):
    """The default (asynchronous) mode, joining the test session's Ray cluster."""
    out = tmp_path_factory.mktemp("job")
    proc = run_job(
        "--output-dir", str(out / "run"), f"garden.cache_dir={out / 'garden'}", f"ray.address={ray_cluster}", *TINY
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out, proc


def test_job_writes_results_plot_and_draft(job_run):
    out, proc = job_run
    records = json.loads((out / "run" / "results.json").read_text())["records"]
    assert {(r["phase"], r["gamma"], r["temperature"]) for r in records} == {
        (p, g, t) for p in ("before", "after") for g in (2, 3) for t in (0.0, 1.0)
    }
    for r in records:
        assert 0.0 <= r["alpha"] <= 1.0 and 1.0 <= r["tau"] <= r["gamma"] + 1 and "accuracy" in r
        if r["gamma"] == 3:
            assert r["measured_speedup"] > 0 and r["c"] > 0 and r["predicted_speedup"] > 0
            assert r["speedup_min"] <= r["measured_speedup"] <= r["speedup_max"] and "baseline_speed" not in r
    # before and after raced side by side, in the after phase: one target-alone figure for both
    alone = {(r["gamma"], r["temperature"], r["phase"]): r["target_tokens_per_s"] for r in records if r["gamma"] == 3}
    assert all(alone[(3, t, "before")] == alone[(3, t, "after")] for t in (0.0, 1.0))
    assert (out / "run" / "tau.png").stat().st_size > 1000
    assert AutoModelForCausalLM.from_pretrained(out / "run" / "draft").config.num_hidden_layers == 2
    assert "tau before" in proc.stdout
    after = {(r["gamma"], r["temperature"]): r for r in records if r["phase"] == "after"}
    for t in (0, 1):  # each measurement's line as the evaluator's task made it, the race's speedups too
        assert f"measure after: gamma 2, T = {t}: alpha {after[(2, float(t))]['alpha']:.3f}, " in proc.stdout
        speedup = after[(3, float(t))]["measured_speedup"]
        assert f"measure after: the distilled draft, gamma 3, T = {t}: {speedup:.2f}x the target alone" in proc.stdout
    training = json.loads((out / "run" / "results.json").read_text())["training"]
    assert training["mode"] == "async" and training["ledger"]["balanced"] and training["ledger"]["consumed"] == 3
    assert (out / "run" / "training.png").stat().st_size > 1000
    garden = next((out / "garden").iterdir())
    assert json.loads(next(garden.glob("target-*/garden.json")).read_text())["parameters"] > 0


def test_measurements_before_are_kept_for_a_rerun_that_measures_the_same(tmp_path, capsys):
    """The job keeps its measurements before distillation in the output folder; a rerun (to resume a checkpoint)
    takes them from there unless a knob they depend on changed; a file cut off while written is measured anew."""
    from cluster.distill_job import BEFORE, measured_before
    from distillspec.config import load_config

    taken = []

    def measure() -> list[dict]:
        taken.append(len(taken))
        return [{"phase": "before", "gamma": 2, "alpha": 0.5 + len(taken) / 10}]

    first = measured_before(load_config(None, ["eval.num_prompts=6"]), tmp_path, measure)
    rerun = load_config(None, ["eval.num_prompts=6", "distill.steps=7", "ray.address=auto", "learner.cpus=0.5"])
    assert measured_before(rerun, tmp_path, measure) == first and len(taken) == 1
    assert "as the run before this one measured it" in capsys.readouterr().out
    for changed in (["eval.num_prompts=8"], ["eval.num_prompts=8"], ["eval.num_prompts=8", "seed=3"]):
        measured_before(load_config(None, changed), tmp_path, measure)
    assert len(taken) == 3  # the second measures what the first did
    (tmp_path / BEFORE).write_text('{"measured": {')
    assert measured_before(load_config(None, ["eval.num_prompts=8"]), tmp_path, measure)[0]["alpha"] == 0.9


def test_garden_is_reused_and_models_load(job_run):
    out, _ = job_run
    garden = next((out / "garden").iterdir())
    target, draft, tokenizer = load_pair(str(next(garden.glob("target-*"))), str(next(garden.glob("draft-*"))))
    assert target.config.vocab_size == draft.config.vocab_size == len(tokenizer)
    proc = run_job(
        "--output-dir",
        str(out / "again"),
        f"garden.cache_dir={out / 'garden'}",
        *TINY,
        "eval.gammas=[2]",
        "eval.temperatures=[0]",
        "eval.speedup_prompts=0",
        "ray.mode=sync",
        "serve.api_key=sesame",
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "reusing the target" in proc.stdout and "reusing the draft" in proc.stdout
    assert "sesame" not in (out / "again" / "config.yaml").read_text()  # a run's folder never holds the key
    training = json.loads((out / "again" / "results.json").read_text())["training"]
    assert training["mode"] == "sync" and "ledger" not in training
    assert "measure before: gamma 2, T = 0: alpha " in proc.stdout and "measure after: gamma 2, T = 0: " in proc.stdout


def test_garden_job_reports_paths_and_cost_ratio(job_run):
    out, _ = job_run
    proc = run_job(f"garden.cache_dir={out / 'garden'}", *[o for o in TINY if o.startswith("garden.")], job="garden.py")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "reusing the target" in proc.stdout and "c = " in proc.stdout
    lines = dict(line.split(":", 1) for line in proc.stdout.splitlines() if line.startswith(("target:", "draft:")))
    for role in ("target", "draft"):
        assert (Path(lines[role].strip()) / "garden.json").exists()


def test_mismatched_tokenizers_are_refused(job_run, tmp_path):
    out, _ = job_run
    garden = next((out / "garden").iterdir())
    from distillspec.models.garden import train_tokenizer

    other = train_tokenizer(["completely different text " * 50], vocab_size=280)
    model, _ = load_model(str(next(garden.glob("draft-*"))))
    model.save_pretrained(tmp_path / "odd")
    other.save_pretrained(tmp_path / "odd")
    with pytest.raises(DistillSpecError, match="must share one tokenizer"):
        load_pair(str(next(garden.glob("target-*"))), str(tmp_path / "odd"))


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--dataset", "./missing/data"], "dataset path './missing/data' does not exist"),
        (["--target", "./nope", "--draft", "./nope2"], "model path './nope' does not exist"),
        (["eval.gammas=[0]"], "eval.gammas[0]=0: input should be greater than or equal to 1"),
        (["distill.stepz=3"], "unknown config key 'distill.stepz' (did you mean 'steps'?)"),
        (["--draft", "./x"], "give both --target and --draft"),
        (["ray.mode=asyn"], "ray.mode='asyn': choose one of ['async', 'sync'] (did you mean 'async'?)"),
        (["rollout.workers=0"], "rollout.workers=0: input should be greater than or equal to 1"),
    ],
)
def test_bad_input_is_one_line(args, message, tmp_path, capsys, monkeypatch):
    proc = run_here(lambda: distill.cli(["--output-dir", str(tmp_path), *args]), capsys, monkeypatch)
    assert proc.returncode == 2
    assert proc.stderr.strip().count("\n") == 0 and message in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--target", "org/big", "--draft", "org/small"], "model 'org/big' is not a local path"),
        (["--dataset", "gsm8k"], "dataset 'gsm8k' is not a local path"),
    ],
)
def test_hub_names_fail_at_once_without_the_hub(args, message, tmp_path):
    proc = run_job("--output-dir", str(tmp_path), *args, env={"HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path)})
    # The project's own hub check answered (its message names the setting) before any library tried the hub: no
    # retries (they took 29-52 s), and one line.
    assert proc.returncode == 2 and message in proc.stderr and "HF_HUB_OFFLINE is set" in proc.stderr, proc.stderr
    assert proc.stderr.strip().count("\n") == 0


def test_sigterm_interrupts_a_job_as_ctrl_c_does():
    """A service manager's stop reaches a job as KeyboardInterrupt (its cleanup runs: the endpoint's stop, the
    distill job's "interrupted" and status 130)."""
    code = (
        "import os, signal, time\n"
        "from distillspec.cli import run_main\n"
        "def main():\n"
        "    os.kill(os.getpid(), signal.SIGTERM)\n"
        "    time.sleep(30)\n"
        "run_main(main)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=60)
    assert done.returncode == 130 and done.stderr.strip() == "interrupted"


def test_a_sigterm_while_ray_starts_is_held_then_stops_the_job():
    """While Ray starts a SIGTERM waits; once Ray is up it stops the job as Ctrl-C does, its cleanup run."""
    code = (
        "import os, signal\n"
        "from distillspec.cli import run_main, sigterm_held\n"
        "def main():\n"
        "    try:\n"
        "        with sigterm_held():\n"
        "            os.kill(os.getpid(), signal.SIGTERM)\n"
        "            print('held', flush=True)\n"
        "        print('not reached', flush=True)\n"
        "    finally:\n"
        "        print('cleanup', flush=True)\n"
        "run_main(main)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=60)
    assert done.returncode == 130 and done.stdout.split() == ["held", "cleanup"], (done.stdout, done.stderr)
