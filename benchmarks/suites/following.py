"""An endpoint that follows a live distillation run: the evaluator measures each new draft version, the serving gate's
canary passes or refuses it, and the endpoint's replica swaps in what passed while it answers requests.

    python -m benchmarks.suites.following --out outputs/following evaluator.every=2 distill.steps=12
    python -m benchmarks.suites.following --out outputs/following-qwen --interval 30 \\
        target=qwen2.5-coder-1.5b-instruct draft=qwen2.5-coder-0.5b-instruct dataset=../shared/data/gsm8k ...

One local Ray cluster holds both: ``jobs/distill.py`` joins it (its log in ``--out``/distill.log, its output in
``--out``/distill), the endpoint starts once the run's weight store is up (its replica then builds the target over
the weights the run shares, ``ray.share_target``), and one client sends the task's test prompts, one request every
``--interval`` seconds, until the job ends. Prints the evaluator's versions with the canary's verdicts, the versions
the endpoint answered with over time, and when the endpoint first served each version; plots both
(``following.png``), writes ``following.json``.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from ray import serve

from benchmarks.suites.traffic import distill_job, send, wait_for_store
from cluster.connect import connect
from cluster.serve_job import start
from distillspec.cli import run_main
from distillspec.config import load_config
from distillspec.errors import DistillSpecError
from distillspec.evaluation.report import pyplot
from distillspec.models.loading import load_tokenizer
from distillspec.models.pretrained import resolve_models
from distillspec.tasks.data import chat_prompts, load_task

RUN = "following"  #: the run's name: the endpoint follows its weight store


def first_served(rows: list[dict]) -> dict[int, float]:
    """``{version: seconds}``: when a response first came from each draft version."""
    seen: dict[int, float] = {}
    for r in rows:
        seen.setdefault(r["sd"]["draft_version"], r["time"])
    return seen


def plot(out: Path, evaluations: list[dict], rows: list[dict], started: float) -> Path:
    plt = pyplot()
    fig, (top, below) = plt.subplots(2, 1, figsize=(7.5, 6), sharex=True)
    for served in (True, False):
        pts = [e for e in evaluations if e["served"] == served]
        top.scatter(
            [e["time"] - started for e in pts],
            [e["canary"]["alpha"] for e in pts],
            marker="o" if served else "x",
            color="tab:green" if served else "tab:red",
            label="canary passed: serving" if served else "canary refused",
        )
    top.plot([e["time"] - started for e in evaluations], [e["alpha"] for e in evaluations], color="grey", lw=1)
    top.set_ylabel("evaluator alpha (gamma 5, T = 1)")
    top.legend(loc="lower right")
    top.set_title("an endpoint following a live distillation run")
    below.step([r["time"] for r in rows], [r["sd"]["draft_version"] for r in rows], where="post", color="tab:blue")
    below.set_ylabel("draft version the endpoint answered with")
    below.set_xlabel("seconds since the endpoint started")
    fig.tight_layout()
    path = out / "following.png"
    fig.savefig(path, dpi=120)
    return path


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("outputs/following"), help="folder of the results")
    parser.add_argument("--interval", type=float, default=5.0, help="seconds between the client's requests")
    parser.add_argument("--max-tokens", type=int, default=32, help="tokens per completion")
    parser.add_argument("overrides", nargs="*", help="the job's config overrides (key=value), for both")
    args = parser.parse_args(argv)
    run = [f"ray.run_name={RUN}", "serve.replica.cpus=0.25", "serve.replica.threads=1", *args.overrides]
    cfg = resolve_models(load_config(None, run))
    if not cfg.evaluator.every:
        raise DistillSpecError("evaluator.every=0: without the evaluator no version passes the gate to follow")
    connect(cfg.ray)
    keep = [f"evaluator.every={cfg.evaluator.every}", f"distill.steps={cfg.distill.steps}"]  # not the job's defaults
    proc = distill_job(args.out, [*keep, *run], cfg.distill.time_budget_s)
    print(f"distill job started (log: {args.out / 'distill.log'}); waiting for its pipeline ...", flush=True)
    wait_for_store(proc, RUN)
    url = start(cfg)
    started = time.time()
    print(f"endpoint up at {url}, following run {RUN}", flush=True)
    task = chat_prompts(load_task(cfg.dataset, seed=cfg.seed), load_tokenizer(cfg.target), cfg.chat_template)
    prompts = [e.prompt for e in task.test]
    body = {"max_tokens": args.max_tokens, "temperature": 1.0}
    pause = lambda _ok: time.sleep(args.interval)
    rows, errors, _ = send(url, prompts, body, 1, lambda i: proc.poll() is None, pause)
    proc.wait()
    serve.shutdown()
    if proc.returncode != 0:
        raise DistillSpecError(f"the distill job failed (exit {proc.returncode}); see {args.out / 'distill.log'}")
    done = args.out / "distill" / "evaluations.json"
    evaluations = json.loads(done.read_text()) if done.exists() else []
    served_at = first_served(rows)
    print(f"\n{len(rows)} responses, {len(errors)} errors; the evaluator's versions (alpha at gamma 5, T = 1):")
    for e in evaluations:
        verdict = "serving" if e["served"] else "refused"
        first = served_at.get(e["version"])
        seen = f"first answered {first:.0f}s after the endpoint started" if first is not None else "never answered"
        print(
            f"  version {e['version']:>3}: alpha {e['alpha']:.3f}, canary {e['canary']['alpha']:.3f} {verdict}; {seen}"
        )
    result = {
        "responses": len(rows),
        "errors": len(errors),
        "error_samples": errors[:3],
        "evaluations": evaluations,
        "first_served_s": served_at,
        "rows": [{"time": r["time"], "version": r["sd"]["draft_version"], "alpha": r["sd"].get("alpha")} for r in rows],
    }
    (args.out / "following.json").write_text(json.dumps(result, indent=1))
    print(f"wrote {plot(args.out, evaluations, rows, started)} and {args.out / 'following.json'}")
    return result


if __name__ == "__main__":
    run_main(main)
