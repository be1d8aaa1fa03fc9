"""Suite ``online``: online distillation from served prompts.

The endpoint serves the task's test prompts (4 clients) and records them; a distill job with ``rollout.online=true``
trains on them for --budget seconds; prints and plots alpha at the endpoint over time, and the mean gamma the endpoint
chose (``serve.gamma=auto``) as the draft improves.

    python benchmarks/benchmark.py online --budget 300 dataset=../shared/data/gsm8k
"""

from __future__ import annotations

from pathlib import Path

import requests
from ray import serve

from benchmarks.suites.traffic import distill_job, send
from cluster.connect import connect
from cluster.serve_job import start
from distillspec.config import load_config
from distillspec.errors import DistillSpecError
from distillspec.evaluation.report import pyplot
from distillspec.models.pretrained import resolve_models
from distillspec.serving.completer import merge_stats
from distillspec.tasks.data import load_task


def suite_online(overrides: list[str], budget: float, out: Path, distilled: str | None = None) -> dict:
    """Online distillation: the endpoint serves a stream of the task's test prompts and records them; a distill
    job (``rollout.online=true``, joining the same cluster) trains on them and publishes; the endpoint's alpha rises."""
    del distilled
    # The replica follows every version the learner publishes (no evaluator runs, so none passes a gate).
    run = ["ray.run_name=online", "serve.record_prompts=true", "serve.replica.cpus=0.5", "serve.follow.version=latest"]
    run += overrides
    cfg = resolve_models(load_config(None, run))
    connect(cfg.ray)
    url = start(cfg)
    prompts = [e.prompt for e in load_task(cfg.dataset, seed=cfg.seed).test]
    proc = distill_job(out, ["rollout.online=true", *run], budget)
    body = {"max_tokens": cfg.eval.max_new_tokens, "temperature": 1.0}
    rows, errors, _ = send(url, prompts, body, 4, lambda i: proc.poll() is None)
    proc.wait()
    choices = requests.get(f"{url}/stats", timeout=10).json().get("auto_gamma")  # gammas chosen over the run
    serve.shutdown()
    if proc.returncode != 0:
        raise DistillSpecError(f"the online distill job failed (exit {proc.returncode}); see {out / 'distill.log'}")
    windows = []  # alpha, and the gamma the endpoint chose (draft tokens per target call), over each 20 responses
    for w in (rows[j : j + 20] for j in range(0, len(rows) - 19, 20)):
        sd = merge_stats([r["sd"] for r in w])
        version = max(r["sd"]["draft_version"] for r in w)
        gamma = sd["drafted"] / sd["target_calls"]
        windows.append({"time": w[-1]["time"], "alpha": sd["alpha"], "gamma": gamma, "draft_version": version})
    result = {"responses": len(rows), "errors": len(errors), "error_samples": errors[:3], "windows": windows}
    result["auto_gamma"] = choices
    plt = pyplot()
    fig, (ax, below) = plt.subplots(2, 1, figsize=(7, 5.5), sharex=True)
    times = [w["time"] for w in windows]
    ax.plot(times, [w["alpha"] for w in windows], marker="o")
    ax.set_ylabel("alpha at the endpoint (20 responses)")
    ax.set_title(f"online distillation on served {cfg.dataset} prompts")
    ax2 = ax.twinx()
    ax2.step(times, [w["draft_version"] for w in windows], color="grey", where="post")
    ax2.set_ylabel("draft version", color="grey")
    below.plot(times, [w["gamma"] for w in windows], marker="o", color="tab:green")
    below.set_ylabel(f"mean gamma (serve.gamma={cfg.serve.gamma})")
    below.set_xlabel("seconds since the endpoint started serving")
    fig.tight_layout()
    fig.savefig(out / "online_alpha.png", dpi=120)
    print(f"\nonline distillation: {len(rows)} responses, {len(errors)} errors; alpha at the endpoint over time:")
    for w in windows[:: max(1, len(windows) // 12)] + windows[-1:]:
        alpha = "-" if w["alpha"] is None else f"{w['alpha']:.3f}"
        print(f"  t={w['time']:6.0f}s  version {w['draft_version']:>4}  alpha {alpha}  mean gamma {w['gamma']:.2f}")
    if choices:
        print(f"gamma chosen by the replica (blocks): {choices['chosen']}")
    print(f"wrote {out / 'online_alpha.png'}")
    return result
