"""Suite ``online``: online distillation from served prompts.

A distill job with ``rollout.online=true`` starts its pipeline; the endpoint then starts (its replica builds the
target over the weights the run shares), serves the task's test prompts through the target's chat template from
``--clients`` clients and records them, and takes every version the learner publishes; the rollouts train on what
it served for --budget seconds. Prints and plots alpha at the endpoint over time, and the mean gamma the endpoint
chose (``serve.gamma=auto``) as the draft improves. ``--distinct N`` serves the first N test prompts in turn:
traffic whose prompts recur, each window of alpha then one pass over the same N.

    python benchmarks/benchmark.py online --budget 300 dataset=../shared/data/gsm8k
    python benchmarks/benchmark.py online --budget 4500 --distinct 32 --clients 1 -o outputs/online-qwen \\
        target=qwen2.5-coder-1.5b-instruct draft=qwen2.5-coder-0.5b-instruct dataset=../shared/data/gsm8k ...
"""

from __future__ import annotations

from pathlib import Path

import requests
from ray import serve

from benchmarks.suites.traffic import distill_job, job_settings, send, wait_for_store
from cluster.connect import connect
from cluster.pipeline import check_resources
from cluster.serve_job import start
from distillspec.config import load_config
from distillspec.errors import DistillSpecError
from distillspec.evaluation.report import pyplot
from distillspec.models.loading import load_tokenizer
from distillspec.models.pretrained import resolve_models
from distillspec.serving.completer import merge_stats
from distillspec.tasks.data import chat_prompts, load_task

RUN = "online"  #: the run's name: the endpoint records prompts into its prompt log and follows its weight store


def plot(out: Path, windows: list[dict], size: int, title: str, gamma: int | str) -> Path:
    """alpha at the endpoint and the draft version over time; below, tau (tokens per target call) and, where the
    replica chooses it (``serve.gamma=auto``), the mean gamma."""
    plt = pyplot()
    fig, (ax, below) = plt.subplots(2, 1, figsize=(7, 5.5), sharex=True)
    times = [w["time"] for w in windows]
    ax.plot(times, [w["alpha"] for w in windows], marker="o")
    ax.set_ylabel(f"alpha at the endpoint\n({size} responses)")
    ax.set_title(title)
    ax2 = ax.twinx()
    ax2.step(times, [w["draft_version"] for w in windows], color="grey", where="post")
    ax2.set_ylabel("draft version", color="grey")
    below.plot(times, [w["tau"] for w in windows], marker="o", color="tab:purple")
    below.set_ylabel(f"tau (gamma {gamma})")
    if gamma == "auto":
        right = below.twinx()
        right.plot(times, [w["gamma"] for w in windows], marker=".", color="tab:green")
        right.set_ylabel("mean gamma chosen", color="tab:green")
    below.set_xlabel("seconds since the endpoint started serving")
    fig.tight_layout()
    path = out / "online_alpha.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def suite_online(
    overrides: list[str],
    budget: float,
    out: Path,
    distilled: str | None = None,
    clients: int | None = None,
    distinct: int | None = None,
) -> dict:
    """Online distillation: the endpoint serves a stream of the task's test prompts (``distinct``: the first that
    many, in turn) from ``clients`` clients and records them; a distill job (``rollout.online=true``, on the same
    cluster) trains on them and publishes; the endpoint takes each version."""
    del distilled
    clients = clients or 4
    if clients < 1 or (distinct is not None and distinct < 1):
        raise DistillSpecError("--clients and --distinct: at least 1")
    # The replica follows every version the learner publishes (no evaluator runs, so none passes a gate).
    run = [f"ray.run_name={RUN}", "rollout.online=true", "serve.record_prompts=true", "serve.replica.cpus=0.5"]
    run += ["serve.follow.version=latest", *overrides]
    cfg = resolve_models(load_config(None, run))
    task = chat_prompts(load_task(cfg.dataset, seed=cfg.seed), load_tokenizer(cfg.target), cfg.chat_template)
    prompts = [e.prompt for e in task.test][:distinct]
    if distinct is not None and len(prompts) < distinct:
        raise DistillSpecError(f"--distinct {distinct}: {cfg.dataset} has {len(prompts)} test prompts")
    # The endpoint's replica and the job's pipeline share the cluster: one that cannot hold both would leave the
    # learner waiting for the whole budget.
    job = load_config(None, job_settings(run, budget))
    check_resources(job, strict=connect(cfg.ray).startswith("started"), endpoint=True)
    proc = distill_job(out, run, budget)
    print(f"distill job started (log: {out / 'distill.log'}); waiting for its pipeline ...", flush=True)
    wait_for_store(proc, RUN)
    url = start(cfg)
    print(f"endpoint up at {url}, serving {len(prompts)} distinct prompts from {clients} clients", flush=True)
    body = {"max_tokens": cfg.eval.max_new_tokens, "temperature": 1.0}
    rows, errors, _ = send(url, prompts, body, clients, lambda i: proc.poll() is None)
    proc.wait()
    try:
        choices = requests.get(f"{url}/stats", timeout=10).json().get("auto_gamma")  # gammas chosen over the run
    except requests.RequestException:  # an endpoint that went down with a failed job: its responses are kept
        choices = None
    serve.shutdown()
    size = distinct or 20  # alpha over each pass over the recurring prompts, else over each 20 responses
    windows = []  # alpha, tau, and the gamma the endpoint chose (draft tokens per target call), per window
    for w in (rows[j : j + size] for j in range(0, len(rows) - size + 1, size)):
        sd = merge_stats([r["sd"] for r in w])
        version = max(r["sd"]["draft_version"] for r in w)
        gamma = sd["drafted"] / sd["target_calls"]
        windows.append(
            {"time": w[-1]["time"], "alpha": sd["alpha"], "tau": sd["tau"], "gamma": gamma, "draft_version": version}
        )
    result = {"responses": len(rows), "errors": len(errors), "error_samples": errors[:3], "windows": windows}
    result |= {"distinct": distinct, "clients": clients, "auto_gamma": choices}
    result["rows"] = [{"time": r["time"], "tokens": r["tokens"], "sd": r["sd"]} for r in rows]
    served = f"{distinct} recurring" if distinct else "served"
    plot(out, windows, size, f"online distillation on {served} {Path(cfg.dataset).name} prompts", cfg.serve.gamma)
    print(f"\nonline distillation: {len(rows)} responses, {len(errors)} errors; alpha at the endpoint over time:")
    for w in windows[:: max(1, len(windows) // 12)] + windows[-1:]:
        alpha = "-" if w["alpha"] is None else f"{w['alpha']:.3f}"
        print(
            f"  t={w['time']:6.0f}s  version {w['draft_version']:>4}  alpha {alpha}  tau {w['tau'] or 0:.2f}"
            f"  mean gamma {w['gamma']:.2f}"
        )
    if choices:
        print(f"gamma chosen by the replica (blocks): {choices['chosen']}")
    print(f"wrote {out / 'online_alpha.png'}")
    if proc.returncode != 0:  # after the served responses are summed up and plotted: they are not lost
        raise DistillSpecError(f"the online distill job failed (exit {proc.returncode}); see {out / 'distill.log'}")
    return result
