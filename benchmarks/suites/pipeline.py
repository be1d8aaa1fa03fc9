"""Suite ``async``: the asynchronous pipeline against the synchronous loop.

The same pair, data and recipe, trained for the same wall-clock budget by ``ray.mode=sync`` (one process: sample,
score, update) and by ``ray.mode=async`` (rollout actors sample while the Ray Train learner updates), with the target
scored by the learner (the default) or by a scoring actor. Reports learner steps/s against sync and against the most
the measured stage times allow on this machine, samples/s, policy lag and the acceptance rate alpha reached (gamma 5,
T = 1, held-out prompts).

    python benchmarks/benchmark.py async                 # the benchmark garden, 240 s per pipeline
    python benchmarks/benchmark.py async --budget 300
    python benchmarks/benchmark.py async --scale real --output-dir outputs/real   # SmolLM2, 480 s per pipeline
"""

from __future__ import annotations

import json
import os
import statistics
import time
from dataclasses import replace
from pathlib import Path

import torch

from benchmarks.suites.common import with_garden
from cluster.distill_job import run
from distillspec.config import JobConfig, load_config
from distillspec.models.loading import load_pair
from distillspec.training.learner import Learner
from distillspec.training.losses import forward_logits
from distillspec.training.rollout import Sampler

ASYNC_VARIANTS = {
    "sync": ["ray.mode=sync"],
    "async": ["ray.mode=async"],
    "async-scorer": [
        "ray.mode=async",
        "learner.target_logits=scorer",
        "scorer.workers=1",
        "rollout.workers=1",
    ],
}


def suite_async(overrides: list[str], budget: float, out: Path) -> dict:
    """The synchronous loop against the asynchronous pipeline (target scored by the learner or by a scoring actor),
    each trained for ``budget`` seconds: learner steps/s, samples/s, policy lag and the alpha reached."""
    rows = {}
    costs = None
    for name, settings in ASYNC_VARIANTS.items():
        cfg = load_config(
            None,
            [
                f"output_dir={out / name}",
                f"distill.time_budget_s={budget}",
                "distill.steps=100000",  # the budget stops training; the cosine schedule stays near its peak
                "distill.checkpoint_every=0",
                "eval.gammas=[5]",
                "eval.temperatures=[1]",
                "eval.speedup_prompts=0",
                "evaluator.every=0",  # the learners compete for the cores alone (sync has no evaluations either)
                *overrides,
                *settings,
            ],
        )
        records = run(cfg)
        log = json.loads((out / name / "train_log.json").read_text())
        before, after = (next(r for r in records if r["phase"] == p) for p in ("before", "after"))
        seconds = log[-1]["time"] if log else float("nan")
        results = json.loads((out / name / "results.json").read_text())
        produced = results.get("training", {}).get("ledger", {}).get("produced", len(log))
        rows[name] = {
            "steps": len(log),
            "train_seconds": seconds,
            "steps_per_s": len(log) / seconds,
            "tokens_per_s": sum(r["tokens"] for r in log) / seconds,
            "samples_per_s": produced * cfg.distill.batch_size / seconds,
            "alpha_before": before["alpha"],
            "alpha_after": after["alpha"],
            "tau_before": before["tau"],
            "tau_after": after["tau"],
            "mean_lag": sum(r.get("lag", 0) for r in log) / max(1, len(log)),
        }
        if costs is None:  # before Ray starts: the step's parts alone on this machine
            costs = step_costs(load_config(out / name / "config.yaml"))
        rows[name]["bound"] = 1.0 if name == "sync" else async_bound(costs, cfg)
    for name in ASYNC_VARIANTS:
        rows[name]["ratio_steps_per_s"] = rows[name]["steps_per_s"] / rows["sync"]["steps_per_s"]
        rows[name]["alpha_gap"] = rows[name]["alpha_after"] - rows["sync"]["alpha_after"]
        rows[name]["of_bound"] = rows[name]["ratio_steps_per_s"] / rows[name]["bound"]
    print(f"\nasync vs sync, {budget:.0f} s of training each (alpha at gamma 5, T = 1, held-out prompts):")
    print(
        f"{'pipeline':>12} {'steps':>6} {'steps/s':>8} {'x sync':>7} {'bound':>6} {'of bound':>8} {'samples/s':>9} "
        f"{'alpha before':>12} {'alpha after':>11} {'tau after':>9} {'lag':>5}"
    )
    for name in ASYNC_VARIANTS:
        r = rows[name]
        print(
            f"{name:>12} {r['steps']:>6} {r['steps_per_s']:>8.3f} {r['ratio_steps_per_s']:>6.2f}x {r['bound']:>5.2f}x "
            f"{r['of_bound']:>8.2f} {r['samples_per_s']:>9.2f} {r['alpha_before']:>12.3f} {r['alpha_after']:>11.3f} "
            f"{r['tau_after']:>9.3f} {r['mean_lag']:>5.2f}"
        )
    c = costs
    stages = ", ".join(f"{k} {v:.2f} s ({c['stages_1thread'][k]:.2f} s on 1)" for k, v in c["stages"].items())
    print(
        f"one step alone ({c['batch_size']} x {c['max_new_tokens']} tokens, {c['threads']} threads), median of "
        f"{c['steps']}: {stages}; the most async can gain over sync with each stage on its own device: "
        f"{c['bound_own_devices']:.2f}x; bound: the most on these {c['cores']} cores with the pipeline's actors"
    )
    return {"budget": budget, "pipelines": rows, "step_costs": costs}


def step_costs(cfg, steps: int = 8) -> dict:
    """What one training step of ``cfg`` costs alone in this process, stage by stage: sampling the batch, the target
    scoring it and the draft's update (with all cores' threads and with one), median over ``steps`` after 2 warm-up
    steps; and from those, the most the asynchronous pipeline can gain over the synchronous loop (whose step is the
    three stages in a row, with all threads).

    - On their own devices the stages overlap fully: the slowest stage bounds a step.
    - On this machine's cores: :func:`async_bound`.
    """
    cfg, task = with_garden(cfg)
    threads, cores = torch.get_num_threads(), os.cpu_count() or torch.get_num_threads()
    target, draft, tokenizer = load_pair(cfg.target, cfg.draft, device=cfg.device, dtype=cfg.dtype)
    dcfg = replace(cfg.distill, steps=10_000)
    sampler, learner = Sampler(target, draft, tokenizer, task.train, dcfg, seed=cfg.seed), Learner(draft, target, dcfg)
    medians: dict[int, dict[str, float]] = {}
    try:
        for n in (threads, 1):
            torch.set_num_threads(n)
            rows = []
            for _ in range(steps + 2):
                t0 = time.perf_counter()
                _, batch = sampler()
                t1 = time.perf_counter()
                with torch.no_grad():
                    logits = forward_logits(target, batch)
                t2 = time.perf_counter()
                learner.step(batch, target_logits=logits)
                rows.append({"sample": t1 - t0, "score": t2 - t1, "update": time.perf_counter() - t2})
            medians[n] = {k: statistics.median(r[k] for r in rows[2:]) for k in rows[0]}
    finally:
        torch.set_num_threads(threads)
    alone, one = medians[threads], medians[1]
    step = sum(alone.values())
    return {
        "steps": steps,
        "threads": threads,
        "cores": cores,
        "batch_size": cfg.distill.batch_size,
        "max_new_tokens": cfg.distill.max_new_tokens,
        "stages": alone,
        "stages_1thread": one,
        "sync_step_s": step,
        "bound_own_devices": step / max(alone.values()),
    }


def async_bound(costs: dict, cfg: JobConfig) -> float:
    """The most ``cfg``'s pipeline can gain over the synchronous loop on this machine's cores, from
    :func:`step_costs`: with one thread per actor, a step takes at least the learner's stage (its update, plus the
    scoring when it holds the target), the rollout actors' and scorers' stages divided among them, and the CPU work of
    all three shared by the cores."""
    one = costs["stages_1thread"]
    scorers = cfg.learner.target_logits == "scorer"
    floor = max(
        one["update"] + (0.0 if scorers else one["score"]),
        one["sample"] / cfg.rollout.workers,
        one["score"] / cfg.scorer.workers if scorers else 0.0,
        sum(one.values()) / costs["cores"],
    )
    return costs["sync_step_s"] / floor
